"""Float32 product tiles on wgpu for MiniLM 32x128's linears (4096 rows): every mm_f32 /
mm_f32_4 tile shape, split-K and K step that applies, with the weight read as the linear
stores it (B along k, [N, K]) and pre-transposed ([K, N], B along n), against F.linear (cuBLAS
fp32, TF32 off) on the same GPU. Every variant's output is checked against float64 numpy first.

    python benchmarks/bench_wgpu_tiles.py [--small] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_wgpu import _gpu_seconds, single_op_program  # noqa: E402

import gpudelegate  # noqa: E402
from gpudelegate.webgpu import lowering  # noqa: E402

T = lowering.Tuning
VARIANTS = {
    "picked": T(),
    "mm_f32 128": T(mm_tile=128),
    "mm_f32 128 split 2": T(mm_tile=128, mm_ksplit=2),
    "mm_f32 128 split 3": T(mm_tile=128, mm_ksplit=3),
    "mm_f32 128 split 4": T(mm_tile=128, mm_ksplit=4),
    "mm_f32 128x64": T(mm_tile=128, mm_tile_n=64),
    "mm_f32 128x64 bk8": T(mm_tile=128, mm_tile_n=64, mm_bk=8),
    "mm_f32 128x64 split 2": T(mm_tile=128, mm_tile_n=64, mm_ksplit=2),
    "mm_f32 64x128": T(mm_tile=64, mm_tile_n=128),
    "mm_f32 64x128 split 2": T(mm_tile=64, mm_tile_n=128, mm_ksplit=2),
    "mm_f32 64": T(mm_tile=64),
    "mm_f32 64 bk16": T(mm_tile=64, mm_bk=16),
    "mm_f32 128 2 stages": T(mm_tile=128, mm_stages=2),
    "mm_f32 128 2 stages bk8": T(mm_tile=128, mm_stages=2, mm_bk=8),
    "mm_f32 64x128 split 2, 2 stages": T(mm_tile=64, mm_tile_n=128, mm_ksplit=2, mm_stages=2),
    "mm_f32 64x128 split 2, 2 stages bk8": T(mm_tile=64, mm_tile_n=128, mm_ksplit=2, mm_stages=2, mm_bk=8),
    "mm_f32 128x64 2 stages bk8": T(mm_tile=128, mm_tile_n=64, mm_stages=2, mm_bk=8),
    "mm_f32_4 64": T(mm_tile=64, mm_tm=4, mm_ksplit=1),
    "mm_f32_4 64 split 2": T(mm_tile=64, mm_tm=4, mm_ksplit=2),
}
SHAPES = [("qkvo", 4096, 384, 384), ("ffn up", 4096, 1536, 384), ("ffn down", 4096, 384, 1536),
          ("square", 4096, 4096, 4096)]
SMALL = [("qkvo", 263, 44, 36), ("ffn up", 263, 136, 36), ("ffn down", 263, 44, 136)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="small shapes: checks the script on a software adapter")
    ap.add_argument("--out", default=None, help="also write the table to <out>/wgpu_tiles_<device>.md")
    a = ap.parse_args(argv)
    env = gpudelegate.Environment()
    ctx = env.context("wgpu")
    dev = ctx.info()["device"]
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        torch, cuda = None, False
    iters = 3 if a.small else 50
    lines = ["| shape | weight layout | variant [kernels] | GPU us | TFLOP/s | vs cuBLAS fp32 | max rel err |",
             "|---|---|---|---:|---:|---:|---:|"]
    best = []
    t0 = time.perf_counter()
    for label, m, n, k in (SMALL if a.small else SHAPES):
        rng = np.random.default_rng(m * 7 + n * 3 + k)
        x = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((n, k), dtype=np.float32)
        want = x.astype(np.float64) @ w.astype(np.float64).T
        flop = 2.0 * m * n * k
        base = None
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = False
            tx, tw = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
            reps = 200
            for _ in range(20):
                torch.nn.functional.linear(tx, tw)
            torch.cuda.synchronize()
            ts = []
            for _ in range(3):
                s0 = time.perf_counter()
                for _ in range(reps):
                    torch.nn.functional.linear(tx, tw)
                torch.cuda.synchronize()
                ts.append((time.perf_counter() - s0) / reps)
            base = sorted(ts)[1]
        layouts = {"[N, K] (linear)": (single_op_program("linear", [("float32", (m, k)), ("float32", (n, k))]), w),
                   "[K, N] (pre-transposed)": (single_op_program("matmul", [("float32", (m, k)), ("float32", (k, n))]),
                                               np.ascontiguousarray(w.T))}
        for lname, (prog, wl) in layouts.items():
            for vname, tuning in VARIANTS.items():
                try:
                    with env.session(prog, device="wgpu", tuning=tuning) as s:
                        got = s.run("forward", [x, wl])[0]
                        err = float(np.abs(got - want).max() / np.abs(want).max())
                        calls = [L for nd in s.executor.recorded[0].nodes for L in nd.launches]
                        sec = _gpu_seconds(s.executor, ctx, iters)
                        kname = ", ".join(L.pipeline.label.split(":")[-1].strip() for L in calls)
                except (ValueError, gpudelegate.DeviceError) as e:  # a variant that does not apply here
                    print(f"    {label} {lname} {vname}: {type(e).__name__}: {e}", flush=True)
                    continue
                ratio = f"{base / sec:.2f}x" if base else ""
                row = (f"| {label} {m}x{n}x{k} | {lname} | {vname} [{kname}] | {sec * 1e6:.1f} | "
                       f"{flop / sec / 1e12:.2f} | {ratio} | {err:.1e} |")
                print(row, flush=True)
                lines.append(row)
                best.append((label, lname, vname, sec))
        if base:
            lines.append(f"| {label} {m}x{n}x{k} | | F.linear, cuBLAS fp32 (TF32 off) | {base * 1e6:.1f} | "
                         f"{flop / base / 1e12:.2f} | 1.00x | |")
    lines.append("")
    for label, *_ in (SMALL if a.small else SHAPES):
        rows = [b for b in best if b[0] == label]
        if rows:
            b = min(rows, key=lambda r: r[3])
            lines.append(f"- {label}: fastest {b[2]}, weight {b[1]}, {b[3] * 1e6:.1f} us")
    text = (f"# wgpu float32 tiles: {dev}\n\n`python benchmarks/bench_wgpu_tiles.py{' --small' if a.small else ''}`, "
            f"{time.perf_counter() - t0:.0f} s, {iters} back-to-back runs per figure (GPU wall time)\n\n"
            + "\n".join(lines) + "\n")
    print(text)
    if a.out:
        slug = "".join(c if c.isalnum() else "_" for c in dev).strip("_").lower()[:60] + ("_small" if a.small else "")
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"wgpu_tiles_{slug}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
