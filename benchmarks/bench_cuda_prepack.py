"""Prepack (constants -> GPU through the pinned staging ring) against the pinned-copy bound, for
the ring's window size and fill-thread count: SmolLM2-135M fp16 (269 MB) and, unless --quick,
Llama-1B fp16 (2.47 GB), seeded random weights, resident (no budget).

    python benchmarks/bench_cuda_prepack.py [--quick]

Each configuration gets a fresh Environment (its own pinned ring); the first session pays the
ring's pinning, the next ones are timed (median of 3). Prints one table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cuda import LLAMA_1B, SMOLLM2, llama_program, random_weights, random_weights_gpu  # noqa: E402

import gpudelegate  # noqa: E402
from gpudelegate.native import cuda_executor, cuda_prepack  # noqa: E402



def pinned_gbps(cp, nbytes: int) -> float:
    host = cp.cuda.alloc_pinned_memory(nbytes)
    h = np.frombuffer(host, np.uint8, nbytes)
    h[:] = 3
    d = cp.cuda.alloc(nbytes)
    best = 0.0
    for _ in range(4):
        cp.cuda.runtime.deviceSynchronize()
        t = time.perf_counter()
        cp.cuda.runtime.memcpy(d.ptr, h.ctypes.data, nbytes, 1)
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    return best


def configure(window: int, threads: int) -> None:
    cuda_prepack.WINDOW = window
    cuda_executor.WINDOW = window
    if cuda_prepack._POOL is not None:
        cuda_prepack._POOL.shutdown()
    cuda_prepack._POOL = None
    cuda_prepack._THREADS = threads


def sessions(prog, reps: int):
    env = gpudelegate.Environment()
    out = []
    for _ in range(reps + 1):
        with env.session(prog, device="cuda") as s:
            st = s.executor.stats
            out.append((st["prepack_gbps"], st["prepack_s"], st.get("prepack_dmas")))
    env.close()
    return out[0], out[1:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    import cupy as cp

    models = [("SmolLM2 fp16", SMOLLM2)] + ([] if a.quick else [("Llama-1B fp16", LLAMA_1B)])
    default = (cuda_prepack.WINDOW, cuda_prepack._THREADS)
    configs = [default] + [(w << 20, t) for w, t in ((2, 12), (4, 12), (16, 12), (8, 8), (8, 14))
                           if (w << 20, t) != default]
    lines = ["| model | window x threads | cold GB/s | warm GB/s (median of 3) | warm ms | of pinned | DMAs |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, cfg in models:
        if cfg is SMOLLM2:
            w = random_weights(cfg, 0, np.float16)
        else:
            import torch

            w = random_weights_gpu(cfg, torch, 0)
        prog = llama_program(cfg, w, {"decode": 1}, act_dtype="float16")
        del w
        nbytes = sum(c.nbytes for c in prog.constants)
        pin = pinned_gbps(cp, nbytes)
        for window, threads in configs:
            configure(window, threads)
            cold, warm = sessions(prog, 3)
            g = statistics.median(w[0] for w in warm)
            ms = statistics.median(w[1] for w in warm) * 1e3
            tag = f"{window >> 20} MiB x {threads}" + (" (default)" if (window, threads) == default else "")
            lines.append(f"| {name} ({nbytes / 1e6:.0f} MB) | {tag} | {cold[0]:.1f} | {g:.1f} | {ms:.1f} | "
                         f"{100 * g / pin:.0f} % | {warm[0][2]} |")
            print(lines[-1], flush=True)
        lines.append(f"| {name} | one pinned DMA of the same bytes (anchor) | | {pin:.1f} | "
                     f"{nbytes / pin / 1e6:.1f} | 100 % | 1 |")
    configure(*default)
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
