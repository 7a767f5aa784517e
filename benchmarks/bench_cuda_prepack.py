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


def ring_anatomy(cp, total: int = 1 << 30):
    """The staging ring's parts on ``total`` bytes of pageable host memory: the threads' fill
    alone (no CUDA calls), the DMAs alone (windows already filled), and the Ring end to end with
    blocking-sync events (the default) and with spinning ones; and how long a pure-Python loop
    on the main thread takes while the ring runs (GIL pressure)."""
    import threading

    st = cuda_prepack.Staging(cp, cuda_prepack.WINDOW, cuda_prepack.MAX_SLOTS)
    W, S = st.window, st.slots
    src = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    dev = cp.cuda.alloc(total)
    stream = cp.cuda.Stream(non_blocking=True)
    pool = cuda_prepack._pool()
    n = total // W
    rows = []

    def fill_only():
        futs = [pool.submit(np.copyto, st.np[(k % S) * W:(k % S + 1) * W], src[k * W:(k + 1) * W]) for k in range(n)]
        for f in futs:
            f.result()

    def dma_only():
        for k in range(n):
            cp.cuda.runtime.memcpyAsync(dev.ptr + k * W, st.ptr(k % S), W, 1, stream.ptr)
        stream.synchronize()

    def ring(block: bool):
        old = st.events
        st.events = [cp.cuda.Event(block=block, disable_timing=True) for _ in range(S)]
        r = cuda_prepack.Ring(cp, st, stream, cp.cuda.Device().id)
        for k in range(n):
            r.submit([(0, src[k * W:(k + 1) * W])], W, dev.ptr + k * W)
        r.finish()
        st.events = old

    def ring_from(source):
        def go():
            r = cuda_prepack.Ring(cp, st, stream, cp.cuda.Device().id)
            for k in range(n):
                r.submit([(0, source[k * W:(k + 1) * W])], W, dev.ptr + k * W)
            r.finish()
        return go

    variants = [("fill only (threads, no CUDA)", fill_only), ("DMA only (filled windows)", dma_only),
                ("Ring, blocking-sync events", lambda: ring(True)), ("Ring, spinning events", lambda: ring(False))]
    try:
        import torch

        tsrc = torch.empty(total, dtype=torch.uint8).numpy()  # torch's CPU allocator
        tsrc[:] = src
        variants.append(("Ring, source allocated by torch", ring_from(tsrc)))
    except ImportError:
        pass
    import mmap

    msrc = mmap.mmap(-1, total)  # anonymous mapping, 4 KiB pages unless THP collapses them
    mview = np.frombuffer(msrc, np.uint8)
    mview[:] = src
    variants.append(("Ring, source in an anonymous mmap", ring_from(mview)))
    def hybrid(frac: float, reg_threads: int = 1, chunk: int = 64 << 20):
        """The ring copies the first (1 - frac) of the bytes while ``reg_threads`` threads
        page-lock 64 MiB chunks of the rest in place (cudaHostRegister), DMA them straight from
        there on a second stream, and unregister each once its copy is done."""
        import concurrent.futures as cf

        page = 4096
        base = src.ctypes.data
        split = int(total * (1 - frac)) // W * W
        a = -(-(base + split) // page) * page - base       # first page boundary at or after split
        stream2 = cp.cuda.Stream(non_blocking=True)

        def reg_part(lo, hi):
            cp.cuda.runtime.hostRegister(base + lo, hi - lo, 0)
            cp.cuda.runtime.memcpyAsync(dev.ptr + lo, base + lo, hi - lo, 1, stream2.ptr)
            return lo

        def go():
            pieces = [(lo, min(lo + chunk, total) // page * page if lo + chunk < total else total // page * page)
                      for lo in range(a, total, chunk)]
            pieces = [(lo, hi) for lo, hi in pieces if hi > lo]
            ex = cf.ThreadPoolExecutor(reg_threads)
            futs = [ex.submit(reg_part, lo, hi) for lo, hi in pieces]
            r = cuda_prepack.Ring(cp, st, stream, cp.cuda.Device().id)
            ring_end = pieces[0][0] if pieces else total
            tail = pieces[-1][1] if pieces else total
            for k in range(0, ring_end, W):
                r.submit([(0, src[k:min(k + W, ring_end)])], min(W, ring_end - k), dev.ptr + k)
            for k in range(tail, total, W):
                r.submit([(0, src[k:min(k + W, total)])], min(W, total - k), dev.ptr + k)
            for f in futs:
                f.result()
            r.finish()
            stream2.synchronize()
            for lo, hi in pieces:
                cp.cuda.runtime.hostUnregister(base + lo)
            ex.shutdown()
        return go

    for frac, nt in ((0.2, 1), (0.3, 1), (0.3, 2), (0.4, 2)):
        variants.append((f"hybrid: ring + {int(frac * 100)}% registered in place, {nt} register thread(s)",
                         hybrid(frac, nt)))
    for name, fn in variants:
        fn()
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            fn()
            best = max(best, total / (time.perf_counter() - t) / 1e9)
        rows.append((name, best))
    # GIL pressure: a Python loop's rate alone and while the ring runs
    def spin(flag, out):
        c = 0
        t = time.perf_counter()
        while not flag:
            c += 1
        out.append(c / (time.perf_counter() - t))
    alone, during = [], []
    flag = []
    th = threading.Thread(target=spin, args=(flag, alone))
    th.start()
    time.sleep(0.05)
    flag.append(1)
    th.join()
    flag2 = []
    th = threading.Thread(target=spin, args=(flag2, during))
    th.start()
    ring(True)
    flag2.append(1)
    th.join()
    rows.append(("Python loop on another thread while the ring runs (share of its rate alone)",
                 100.0 * during[0] / max(alone[0], 1e-9)))
    del mview
    st.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--anatomy-only", action="store_true", help="only the ring anatomy rows")
    a = ap.parse_args(argv)
    import cupy as cp

    models = [] if a.anatomy_only else [("SmolLM2 fp16", SMOLLM2)] + ([] if a.quick else [("Llama-1B fp16", LLAMA_1B)])
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
    lines += ["", "| ring anatomy (1 GiB, default window and threads) | GB/s |", "|---|---:|"]
    for name, v in ring_anatomy(cp, (64 << 20) if a.quick else (1 << 30)):
        lines.append(f"| {name} | {v:.1f}{' %' if name.startswith('Python') else ''} |")
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
