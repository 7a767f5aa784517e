"""Can a float32 linear reach tensor cores from WGSL? wgpu-native's experimental
``cooperative-matrix`` feature (8x8x8 float32 tiles, WGSL ``enable wgpu_cooperative_matrix``)
against our float32 SIMT kernel (matmul_fast.wgsl, what the WGSL lowering picks) and cuBLAS on the same
GPU, for the linear shapes of MiniLM 32x128.

    python benchmarks/probe_wgpu_coopmat.py [--small]

Prints one table: time, TFLOP/s and max relative error against float64 for each kernel. The
error column tells what arithmetic the driver really does: float32 FMAs give ~1e-6 on these
shapes, TF32 tensor cores (10-bit mantissa inputs) ~1e-3. A cooperative-matrix kernel is only
useful to the float32 path if it is both faster and float32-accurate.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_wgpu import Torch, _gpu_seconds, gpu_seconds, single_op_program  # noqa: E402

import gpudelegate  # noqa: E402

SHAPES = [("minilm 32x128 qkvo", 4096, 384, 384), ("minilm 32x128 ffn up", 4096, 1536, 384),
          ("minilm 32x128 ffn down", 4096, 384, 1536), ("square", 4096, 4096, 4096)]


def coop_source(tm: int, tn: int) -> str:
    """Y[M][N] = X[M][K] @ W[N][K]^T, one subgroup-sized workgroup per (8 tm) x (8 tn) block of Y,
    tm x tn accumulator tiles, A and B tiles loaded straight from storage every k step of 8."""
    lines = ["enable wgpu_cooperative_matrix;",
             "struct P { M: u32, N: u32, K: u32, pad: u32 }",
             "@group(0) @binding(0) var<uniform> p: P;",
             "@group(0) @binding(1) var<storage, read_write> X: array<f32>;",
             "@group(0) @binding(2) var<storage, read_write> W: array<f32>;",
             "@group(0) @binding(3) var<storage, read_write> Y: array<f32>;",
             "@compute @workgroup_size(32)",
             "fn main(@builtin(workgroup_id) wid: vec3<u32>) {",
             f"    let m0 = wid.y * {8 * tm}u;",
             f"    let n0 = wid.x * {8 * tn}u;"]
    for i in range(tm):
        for j in range(tn):
            lines.append(f"    var c{i}_{j} = coopLoadT<f32, C>(&Y[(m0 + {8 * i}u) * p.N + n0 + {8 * j}u], p.N);")
    lines.append("    for (var k = 0u; k < p.K; k += 8u) {")
    for i in range(tm):
        lines.append(f"        let a{i} = coopLoadT<f32, A>(&X[(m0 + {8 * i}u) * p.K + k], p.K);")
    for j in range(tn):
        lines.append(f"        let b{j} = coopLoad<f32, B>(&W[(n0 + {8 * j}u) * p.K + k], p.K);")
    for i in range(tm):
        for j in range(tn):
            lines.append(f"        c{i}_{j} = coopMultiplyAdd(a{i}, b{j}, c{i}_{j});")
    lines.append("    }")
    for i in range(tm):
        for j in range(tn):
            lines.append(f"    coopStoreT(c{i}_{j}, &Y[(m0 + {8 * i}u) * p.N + n0 + {8 * j}u], p.N);")
    lines.append("}")
    return "\n".join(lines)


def run_coop(ctx, x: np.ndarray, w: np.ndarray, tm: int, tn: int, iters: int):
    wg = ctx.wgpu
    d = ctx.device
    U = wg.BufferUsage
    m, k = x.shape
    n = w.shape[0]
    mod = d.create_shader_module(code=coop_source(tm, tn))
    pipe = d.create_compute_pipeline(layout="auto", compute={"module": mod, "entry_point": "main"})
    pbuf = d.create_buffer_with_data(data=np.array([m, n, k, 0], np.uint32).tobytes(), usage=U.UNIFORM)
    xb = d.create_buffer_with_data(data=x.tobytes(), usage=U.STORAGE)
    wb = d.create_buffer_with_data(data=w.tobytes(), usage=U.STORAGE)
    yb = d.create_buffer(size=m * n * 4, usage=U.STORAGE | U.COPY_SRC | U.COPY_DST)
    bg = d.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": pbuf}}, {"binding": 1, "resource": {"buffer": xb}},
        {"binding": 2, "resource": {"buffer": wb}}, {"binding": 3, "resource": {"buffer": yb}}])
    groups = (n // (8 * tn), m // (8 * tm), 1)

    def encode(enc, reps):
        for _ in range(reps):
            enc.clear_buffer(yb)  # C starts from the output: zero it (counted in the time)
            cp = enc.begin_compute_pass()
            cp.set_pipeline(pipe)
            cp.set_bind_group(0, bg)
            cp.dispatch_workgroups(*groups)
            cp.end()

    enc = d.create_command_encoder()
    encode(enc, 1)
    ctx.queue.submit([enc.finish()])
    got = np.frombuffer(ctx.queue.read_buffer(yb), np.float32).reshape(m, n)

    return got, gpu_seconds(ctx, lambda e: encode(e, 1), iters)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args(argv)
    env = gpudelegate.Environment()
    ctx = env.context("wgpu")
    print("device:", ctx.limits.name)
    feats = sorted(ctx.adapter.features)
    if "cooperative-matrix" not in feats:
        print("cooperative-matrix: not offered by this adapter (wgpu-native offers it on Vulkan only where "
              "the driver lists an 8x8x8 float32 configuration); nothing to measure")
        env.close()
        return 0
    # A second device with the feature: the executor's context does not ask for it.
    from gpudelegate.errors import DeviceError
    from gpudelegate.native.wgpu_device import WgpuContext
    try:
        cctx = WgpuContext(extra_features=["cooperative-matrix"])
    except DeviceError as e:
        # Seen with wgpu 0.32 / wgpu-native 29 on an H100: the adapter lists the feature, but wgpu
        # refuses a device with it unless "experimental features" are enabled, which only the
        # Rust API can do (wgpu.h's WGPUDeviceExtras carries a trace path alone).
        print(f"cooperative-matrix: advertised by the adapter, but no device can have it here: {e}")
        env.close()
        return 0
    tch = None
    try:
        tch = Torch()
    except Exception as e:
        print("torch:", e)
    shapes = [(l, m // 8, n // 8, k // 8) for l, m, n, k in SHAPES[:1]] if a.small else SHAPES
    rows = []
    for label, m, n, k in shapes:
        flop = 2.0 * m * n * k
        rng = np.random.default_rng(m * 7 + n * 3 + k)
        x = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((n, k), dtype=np.float32)
        want = x.astype(np.float64) @ w.astype(np.float64).T
        scale = float(np.abs(want).max())
        iters = 3 if a.small else 20
        prog = single_op_program("linear", [("float32", (m, k)), ("float32", (n, k))])
        with env.session(prog, device="wgpu") as s:
            got = s.run("forward", [x, w])[0]
            sec = _gpu_seconds(s.executor, ctx, iters)
        rows.append((label, f"{m}x{n}x{k}", "ours: mm_f32 (SIMT float32)", sec, flop / sec / 1e12,
                     float(np.abs(got - want).max()) / scale))
        for tm, tn in ((2, 2), (4, 4), (4, 2)):
            if m % (8 * tm) or n % (8 * tn) or k % 8:
                continue
            try:
                got, sec = run_coop(cctx, x, w, tm, tn, iters)
            except Exception as e:
                print(f"coop {tm}x{tn} on {label}: {type(e).__name__}: {str(e)[:600]}")
                continue
            rows.append((label, f"{m}x{n}x{k}", f"coop-matrix 8x8x8 f32, {8 * tm}x{8 * tn} per subgroup", sec,
                         flop / sec / 1e12, float(np.abs(got - want).max()) / scale))
        if tch is not None and tch.cuda:
            t = tch.torch
            tx, tw = t.from_numpy(x).cuda(), t.from_numpy(w).cuda()
            for tf32 in (False, True):
                t.backends.cuda.matmul.allow_tf32 = tf32
                out = t.nn.functional.linear(tx, tw)
                err = float((out.double().cpu().numpy() - want).__abs__().max()) / scale
                sec = tch.timed(lambda: [t.nn.functional.linear(tx, tw) for _ in range(iters)], 3) / iters
                rows.append((label, f"{m}x{n}x{k}", f"cuBLAS {'TF32' if tf32 else 'fp32'} (F.linear)", sec,
                             flop / sec / 1e12, err))
            t.backends.cuda.matmul.allow_tf32 = False
    lines = [f"| {ctx.limits.name} | shape | kernel | time | TFLOP/s | max rel err vs float64 |", "|---|---|---|---:|---:|---:|"]
    for label, shp, kern, sec, tf, err in rows:
        lines.append(f"| {label} | {shp} | {kern} | {sec * 1e6:.1f} us | {tf:.2f} | {err:.1e} |")
    print("\n" + "\n".join(lines))
    cctx.close()
    env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
