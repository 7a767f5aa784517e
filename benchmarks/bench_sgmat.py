"""The subgroup-matrix (tensor-core) product of shaders/matmul_sgmat.wgsl on Dawn against cuBLAS.

Runs the kernel straight through wgpudawn (Dawn instance toggles ``allow_unsafe_apis`` and
``vulkan_enable_f16_on_nvidia``, device feature ``chromium-experimental-subgroup-matrix``), so it
measures the WGSL alone: first a correctness check of every operand layout and dtype on odd
shapes against float64 numpy (bound: |C - C64| <= (2^-10 + K 2^-22) (|A| @ |B|) + 1e-6, the
rounding of both inputs to float16 plus float32 accumulation), then TFLOP/s at 4096^3 and
MiniLM-L6 32x128's linear shapes, with torch's cuBLAS float32 (TF32 off) and float16 in the
same process, and each variant's share of cuBLAS float16.

    python benchmarks/bench_sgmat.py [--out DIR] [--repeat N]
    python benchmarks/bench_sgmat.py --minilm [--out DIR]

``--minilm`` instead runs MiniLM-L6 (seeded random weights) at 1x128 and 32x128 through
gpudelegate on Dawn with precision="exact" and "fast" against PyTorch eager float32 and float16
on the same GPU (latency of a run: inputs up, embeddings down; median of repeated runs), the
cosine of each embedding against the model in float64, the GPU time of the chain and of its
linears (timestamp queries), and the GPU time of one float32 linear per shape with each
precision, i.e. the lowering's float kernel against its subgroup-matrix kernel (a separate
process: Dawn's instance toggles are set once per process).

Needs a GPU adapter with the feature (an NVIDIA GPU through Dawn's Vulkan backend); exits 2 with
the reason where there is none.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from pathlib import Path

import numpy as np

TOGGLES = ["allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"]
FEATURE = "chromium-experimental-subgroup-matrix"
BM = BN = 128
ENTRIES = ("mm_sgmat", "mm_sgmat8", "mm_sgmat8k")
NEEDS = {"mm_sgmat": 28672, "mm_sgmat8": 28672, "mm_sgmat8k": 45056}  # workgroup memory (ops_sgmat.ENTRY_POINTS)


def open_device():
    import wgpudawn as wgpu
    from wgpudawn.backends.dawn import extras

    extras.set_instance_extras(enable_toggles=TOGGLES)
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    if adapter is None or not {FEATURE, "shader-f16", "subgroups"} <= set(adapter.features):
        return None, None, "no subgroup-matrix adapter"
    props = extras.get_adapter_properties(adapter)
    lim = adapter.limits
    want = {k: lim[k] for k in ("max-buffer-size", "max-storage-buffer-binding-size",
                                "max-compute-workgroup-storage-size", "max-compute-invocations-per-workgroup")}
    dev = adapter.request_device_sync(required_features=[FEATURE, "shader-f16", "subgroups"], required_limits=want)
    info = {"adapter": adapter.info.get("device", "?"), "configs": [
        f"{c['component_type']}->{c['result_component_type']} {c['m']}x{c['n']}x{c['k']}"
        for c in props.get("subgroup_matrix_configs", ())],
        "workgroup_storage": lim["max-compute-workgroup-storage-size"]}
    return wgpu, dev, info


def params(M, N, K, a_sm, b_sk, b_sn, bias_base=0) -> bytes:
    # MMParams (shaders/mm_params.wgsl): one batch entry, C contiguous [M][N].
    return struct.pack("<22IfI", M, N, K, 1, 0, 0, 0, bias_base, a_sm, 1, b_sk, b_sn, N, 1, 1, 1,
                       0, 0, 0, 0, 0, 0, 1.0, 0) + bytes(8)


class Kernel:
    def __init__(self, wgpu, dev):
        from gpudelegate import shaders

        self.wgpu, self.dev = wgpu, dev
        self.module = dev.create_shader_module(code=shaders.source("matmul_sgmat.wgsl"))
        self.pipes = {}

    def pipeline(self, entry, consts):
        key = (entry,) + tuple(sorted(consts.items()))
        if key not in self.pipes:
            self.pipes[key] = self.dev.create_compute_pipeline(
                layout="auto", compute={"module": self.module, "entry_point": entry, "constants": consts})
        return self.pipes[key]

    def buf(self, data: bytes, extra_usage=0):
        U = self.wgpu.BufferUsage
        n = max(16, (len(data) + 15) // 16 * 16)
        b = self.dev.create_buffer(size=n, usage=U.STORAGE | U.COPY_SRC | U.COPY_DST | extra_usage)
        self.dev.queue.write_buffer(b, 0, bytes(data) + bytes(n - len(data)))
        return b

    def setup(self, a, b, kmajor, stages=1, bias=None, act=0, entry="mm_sgmat"):
        """Bind group and pipeline for C = a @ (b.T if kmajor else b) (+ bias, gelu)."""
        M, K = a.shape
        N = b.shape[0] if kmajor else b.shape[1]
        U = self.wgpu.BufferUsage
        consts = {"DTA": int(a.dtype == np.float16), "DTB": int(b.dtype == np.float16), "B_KMAJOR": bool(kmajor),
                  "STAGES": stages, "BIAS": 1 if bias is not None else 0, "ACT": act}
        pipe = self.pipeline(entry, consts)
        uni = self.dev.create_buffer(size=112, usage=U.UNIFORM | U.COPY_DST)
        self.dev.queue.write_buffer(uni, 0, params(M, N, K, K, 1 if kmajor else N, K if kmajor else 1))
        c = self.dev.create_buffer(size=max(16, M * N * 4), usage=U.STORAGE | U.COPY_SRC)
        bufs = {0: (uni, 112), 1: (c, max(16, M * N * 4)), 2: (self.buf(a.tobytes()), None),
                3: (self.buf(b.tobytes()), None),
                4: (self.buf(bias.astype(np.float32).tobytes()) if bias is not None else self.buf(bytes(16)), None)}
        for k in (5, 6, 7):
            bufs[k] = (self.buf(bytes(16)), None)
        layout = pipe.get_bind_group_layout(0)
        entries = [{"binding": k, "resource": {"buffer": bb, "offset": 0, "size": bb.size if s is None else s}}
                   for k, (bb, s) in bufs.items()]
        group = self.dev.create_bind_group(layout=layout, entries=entries)
        return pipe, group, c, (-(-N // BN), -(-M // BM), 1), (M, N)

    def run(self, setup, times=1):
        pipe, group, c, grid, (M, N) = setup
        enc = self.dev.create_command_encoder()
        p = enc.begin_compute_pass()
        p.set_pipeline(pipe)
        p.set_bind_group(0, group)
        for _ in range(times):
            p.dispatch_workgroups(*grid)
        p.end()
        self.dev.queue.submit([enc.finish()])

    def read(self, setup):
        _, _, c, _, (M, N) = setup
        return np.frombuffer(self.dev.queue.read_buffer(c), np.float32)[:M * N].reshape(M, N)

    def wait(self):
        """Wait for the queue by reading back 16 bytes (reading C itself would time its copy)."""
        if not hasattr(self, "_marker"):
            self._marker = self.buf(bytes(16))
        self.dev.queue.read_buffer(self._marker)

    def time_ms(self, setup, repeat):
        self.run(setup, 2)
        self.wait()
        t0 = time.perf_counter()
        self.run(setup, repeat)
        self.wait()
        return (time.perf_counter() - t0) * 1e3 / repeat


def gelu(x):
    from math import erf
    return 0.5 * x * (1.0 + np.vectorize(erf)(x / np.sqrt(2.0)))


def check(k: Kernel) -> list:
    rng = np.random.default_rng(0)
    rows = []
    cases = [  # (M, N, K, dtype A, dtype B, kmajor, stages, bias/act)
        (257, 131, 200, np.float16, np.float16, True, 1, False),
        (257, 131, 200, np.float32, np.float16, True, 2, False),
        (300, 260, 68, np.float16, np.float16, False, 1, False),
        (129, 388, 36, np.float32, np.float32, False, 2, False),
        (64, 384, 384, np.float32, np.float16, True, 1, True),
        (1, 7, 4, np.float32, np.float32, True, 1, False),
    ]
    cases = [c + (e,) for e in ENTRIES for c in cases]
    for M, N, K, da, db, kmaj, st, epi, entry in cases:
        if NEEDS[entry] + (st - 1) * (NEEDS[entry] - 8192) > k.storage:  # tiles per stage, one 8 KiB tC
            continue
        a = rng.standard_normal((M, K)).astype(da)
        b = rng.standard_normal((N, K) if kmaj else (K, N)).astype(db)
        bias = rng.standard_normal(N).astype(np.float32) if epi else None
        s = k.setup(a, b, kmaj, st, bias, 1 if epi else 0, entry)
        k.run(s)
        got = k.read(s).astype(np.float64)
        b64 = b.astype(np.float64).T if kmaj else b.astype(np.float64)
        ref = a.astype(np.float64) @ b64
        mag = np.abs(a.astype(np.float64)) @ np.abs(b64)
        if epi:
            ref = gelu(ref + bias)  # gelu is 1-Lipschitz-ish (|gelu'| <= 1.13): the bound scales by it
            mag = 1.13 * mag
        bound = (2.0 ** -10 + K * 2.0 ** -22) * mag + 1e-6
        err = np.abs(got - ref)
        ok = bool(np.all(err <= bound))
        rows.append({"case": f"{entry} {M}x{N}x{K} A {np.dtype(da).name} B {np.dtype(db).name} "
                             f"{'k-major' if kmaj else 'n-major'} stages {st}{' bias+gelu' if epi else ''}",
                     "ok": ok, "max_err": float(err.max()), "worst_ratio": float((err / bound).max())})
    return rows


def cublas_ms(M, N, K, dtype, repeat):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(K, N, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(repeat):
        a @ b
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / repeat


def _median_ms(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def _op_gpu_ms(env, prog, inputs, precision, runs=3) -> dict:
    """GPU time by op (ms, the fastest of ``runs``) from timestamp queries: a session with
    profile=True times each node in a compute pass of its own (WebGPUExecutor.last_profile)."""
    best: dict = {}
    with env.session(prog, device="dawn", precision=precision, profile=True) as s:
        for _ in range(runs + 1):
            s.run("forward", inputs)
            by_op: dict = {}
            for op, _node, sec in s.executor.last_profile:
                by_op[op] = by_op.get(op, 0.0) + sec * 1e3
            best = {op: min(v, best.get(op, v)) for op, v in by_op.items()}
    best["total"] = sum(v for k, v in best.items() if k != "total")
    return best


def linears(env, rows: list) -> None:
    """One float32 linear (weights [N, K], no bias) per shape: GPU time of its kernel with
    precision "exact" (the float kernels) and "fast" (the subgroup-matrix kernel)."""
    import torch

    from gpudelegate.export.writer import export_program

    for M, N, K in ((4096, 4096, 4096), (4096, 384, 1536), (4096, 1536, 384), (4096, 384, 384)):
        torch.manual_seed(0)
        with torch.no_grad():
            prog = export_program(torch.nn.Linear(K, N, bias=False).eval(), (torch.zeros(M, K),), progress=False)
        x = np.random.default_rng(0).standard_normal((M, K)).astype(np.float32)
        row = {"shape": f"linear {M}x{N}x{K}"}
        for precision in ("exact", "fast"):
            ms = _op_gpu_ms(env, prog, [x], precision)["linear"]
            row[precision + "_ms"] = ms
            row[precision + "_tflops"] = 2.0 * M * N * K / ms / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)


def minilm(out, repeat) -> int:
    import torch

    from gpudelegate.environment import Environment
    from gpudelegate.export.models import minilm as mm
    from gpudelegate.export.writer import export_program

    torch.manual_seed(0)
    model = mm.MiniLM(mm.MiniLMConfig()).eval()
    rows = []
    env = Environment(device_options={"dawn": {"toggles": TOGGLES}})
    for b, t in ((1, 128), (32, 128)):
        model.float().cpu()  # the eager runs below move and cast it in place
        with torch.no_grad():
            prog = export_program(model, mm.example_inputs(b, t), progress=False)
        rng = np.random.default_rng(b * 1000 + t)
        ids = rng.integers(1000, model.cfg.vocab_size, (b, t)).astype(np.int32)
        mask = np.ones((b, t), np.int32)
        mask[b // 2:, t - t // 4:] = 0
        tid, tmask = torch.from_numpy(ids).cuda(), torch.from_numpy(mask).cuda()
        with torch.no_grad():
            ref = model.double().cuda()(tid, tmask).cpu().numpy()
        row = {"shape": f"{b}x{t}"}

        def cos(x):
            x = np.asarray(x, np.float64)
            return float(np.min(np.sum(x * ref, -1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(ref, axis=-1)))

        for dtype, name in ((torch.float32, "eager_fp32"), (torch.float16, "eager_fp16")):
            dev_model = model.to(dtype).cuda()

            def once():
                with torch.no_grad():
                    y = dev_model(tid, tmask).float().cpu()
                return y

            for _ in range(3):
                once()
            row[name + "_ms"] = _median_ms(once, repeat)
            row[name + "_cos"] = cos(once().numpy())
        for precision in ("exact", "fast"):
            with env.session(prog, device="dawn", precision=precision) as s:
                got = s.run("forward", [ids, mask])[0]
                for _ in range(3):
                    s.run("forward", [ids, mask])
                row[precision + "_ms"] = _median_ms(lambda: s.run("forward", [ids, mask]), repeat)
                row[precision + "_cos"] = cos(got)
                row[precision + "_sgmat_launches"] = sum(
                    "mm_sgmat" in L.pipeline.label for n in s.executor.recorded[0].nodes for L in n.launches)
        for precision in ("exact", "fast"):  # where the GPU time goes
            prof = _op_gpu_ms(env, prog, [ids, mask], precision)
            row[precision + "_gpu_ms"] = prof["total"]
            row[precision + "_linear_gpu_ms"] = prof.get("linear", 0.0)
        row["fast_vs_eager_fp32"] = row["eager_fp32_ms"] / row["fast_ms"]
        row["fast_vs_eager_fp16"] = row["eager_fp16_ms"] / row["fast_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    kernels: list = []
    linears(env, kernels)
    env.close()
    lines = ["| shape | dawn exact ms | dawn fast ms | eager fp32 ms | eager fp16 ms | fast / fp32 eager | "
             "fast / fp16 eager | cos fast | cos exact | cos fp16 eager | sgmat launches |", "|" + "---|" * 11]
    lines += [f"| {r['shape']} | {r['exact_ms']:.3f} | {r['fast_ms']:.3f} | {r['eager_fp32_ms']:.3f} | "
              f"{r['eager_fp16_ms']:.3f} | {r['fast_vs_eager_fp32']:.2f}x | {r['fast_vs_eager_fp16']:.2f}x | "
              f"{r['fast_cos']:.6f} | {r['exact_cos']:.6f} | {r['eager_fp16_cos']:.6f} | {r['fast_sgmat_launches']} |"
              for r in rows]
    lines += ["", "GPU time by timestamp queries (a pass per node): whole chain and its linears, ms", "",
              "| shape | exact chain | fast chain | exact linears | fast linears |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['exact_gpu_ms']:.3f} | {r['fast_gpu_ms']:.3f} | {r['exact_linear_gpu_ms']:.3f} | "
              f"{r['fast_linear_gpu_ms']:.3f} |" for r in rows]
    lines += ["", "| one linear | exact ms | exact TFLOP/s | fast ms | fast TFLOP/s |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['exact_ms']:.3f} | {r['exact_tflops']:.1f} | {r['fast_ms']:.3f} | "
              f"{r['fast_tflops']:.1f} |" for r in kernels]
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "minilm.json").write_text(json.dumps({"minilm": rows, "linears": kernels}, indent=1))
        (Path(out) / "minilm.md").write_text(text + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for sgmat.json and sgmat.md")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--minilm", action="store_true", help="MiniLM-L6 through gpudelegate (exact, fast) vs eager")
    a = ap.parse_args(argv)
    if a.minilm:
        return minilm(a.out, a.repeat)
    wgpu, dev, info = open_device()
    if dev is None:
        print(f"bench_sgmat: {info}", file=sys.stderr)
        return 2
    k = Kernel(wgpu, dev)
    k.storage = info["workgroup_storage"]
    checks = check(k)
    rng = np.random.default_rng(1)
    shapes = [(4096, 4096, 4096), (4096, 384, 1536), (4096, 1536, 384)]
    rows = []
    for M, N, K in shapes:
        flop = 2.0 * M * N * K
        base = {}
        try:
            import torch
            base = {"cublas_fp32": cublas_ms(M, N, K, torch.float32, a.repeat),
                    "cublas_fp16": cublas_ms(M, N, K, torch.float16, a.repeat)}
        except Exception as e:  # no torch or no CUDA: the kernel's numbers alone
            print(f"cuBLAS baseline skipped: {e}", file=sys.stderr)
        for entry in [e for e in ENTRIES if NEEDS[e] <= k.storage]:
            for da, db, kmaj in ((np.float16, np.float16, True), (np.float32, np.float16, True)):
                st = 1
                x = rng.standard_normal((M, K)).astype(da)
                w = rng.standard_normal((N, K) if kmaj else (K, N)).astype(db)
                s = k.setup(x, w, kmaj, st, entry=entry)
                ms = k.time_ms(s, a.repeat)
                row = {"shape": f"{M}x{N}x{K}", "variant": f"{entry} A {np.dtype(da).name} B {np.dtype(db).name} "
                       f"{'k-major' if kmaj else 'n-major'}", "ms": ms, "tflops": flop / ms / 1e9}
                for name, bms in base.items():
                    row[f"{name}_tflops"] = flop / bms / 1e9
                if "cublas_fp16" in base:
                    row["share_of_fp16"] = base["cublas_fp16"] / ms
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"device": info, "checks": checks, "rows": rows}
    lines = [f"# subgroup-matrix matmul on {info['adapter']}", "", f"configs: {', '.join(info['configs'])}", "",
             "| check | ok | max err | err / bound |", "|---|---|---|---|"]
    lines += [f"| {c['case']} | {c['ok']} | {c['max_err']:.3g} | {c['worst_ratio']:.3f} |" for c in checks]
    lines += ["", "| shape | variant | ms | TFLOP/s | cuBLAS fp32 | cuBLAS fp16 | share of fp16 |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.1f} | "
              f"{r.get('cublas_fp32_tflops', float('nan')):.1f} | {r.get('cublas_fp16_tflops', float('nan')):.1f} | "
              f"{r.get('share_of_fp16', float('nan')):.2f} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sgmat.json").write_text(json.dumps(result, indent=1))
        (out / "sgmat.md").write_text(text + "\n")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
