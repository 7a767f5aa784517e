"""GPU time of the fused attention alone: sdpa_tile (CUDA cores, split-K for decode) and
sdpa_mma (tensor cores, float16 prefill; forced here wherever its shapes allow, to compare it
with sdpa_tile) against PyTorch's scaled_dot_product_attention.

    python benchmarks/bench_cuda_sdpa.py [--out DIR]

Each variant is bound once (as a session binds it) and 50 launches are captured into one CUDA
graph, so the time per call is GPU time without Python launch costs; median of 7 replays.
Outputs are compared with float64 numpy on the same fp16 inputs. Prints a table and writes
cuda_sdpa_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import numpy as np

import gpudelegate
from gpudelegate.native import cuda_kernels
from gpudelegate.native.cuda_kernels import sdpa_launch

ROOT = Path(__file__).resolve().parents[1]
N_CALLS = 50

# name, (B, H, Hk, Tq, Tk, D), keys visible to query i: i + offset (the benchmark's cache mask)
SHAPES = [
    ("SmolLM2 prefill-128 over a 512 cache", (1, 9, 3, 128, 512, 64), 0),
    ("SmolLM2 decode at position 128", (1, 9, 3, 1, 512, 64), 128),
    ("Llama-1B decode at position 200", (1, 32, 8, 1, 256, 64), 200),
    ("Llama-1B prefill-1024, causal", (1, 32, 8, 1024, 1024, 64), 0),
]


def reference(q, k, v, keep, scale):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, 1), np.repeat(v, G, 1)
    s = np.where(keep, q @ np.swapaxes(k, -1, -2) * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def graph_time_us(cp, fn) -> float:
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # compile / warm up outside the capture
        stream.synchronize()
        stream.begin_capture()
        for _ in range(N_CALLS):
            fn()
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
        times = []
        for _ in range(7):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            graph.launch(stream)
            b.record(stream)
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / N_CALLS)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    import cupy as cp
    env = gpudelegate.Environment()
    ctx = env.context("cuda")
    kern = ctx.kernels
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        torch = None
    rows, data = [], {"device": ctx.name, "calls_per_graph": N_CALLS, "results": []}
    rng = np.random.default_rng(0)
    for name, (B, H, Hk, Tq, Tk, D), off in SHAPES:
        q = rng.standard_normal((B, H, Tq, D)).astype(np.float16)
        k = rng.standard_normal((B, Hk, Tk, D)).astype(np.float16)
        v = rng.standard_normal((B, Hk, Tk, D)).astype(np.float16)
        keep = np.arange(Tk)[None, :] <= (np.arange(Tq)[:, None] + off)
        scale = 1.0 / math.sqrt(D)
        want = reference(q, k, v, keep[None, None], scale)
        dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
        dm = cp.asarray(keep[None, None].astype(np.uint32))
        attrs = {"causal": False, "scale": scale, "causal_offset": 0}
        fill = cuda_kernels.SDPA_FILL4
        # (tensor cores, SDPA_FILL4): the automatic CUDA-core launch, the same with 4-row blocks
        # switched off where they are taken (the policy's A/B), the tensor-core kernel forced
        auto = sdpa_launch(B, H, Hk, Tq, Tk, D, D, kern.max_shared, kern.sm_count, fp16=True, tensor_cores=False)
        for tc, f4 in ((False, fill), (False, 0), (True, fill)):
            cuda_kernels.SDPA_FILL4 = f4
            lp = sdpa_launch(B, H, Hk, Tq, Tk, D, D, kern.max_shared, kern.sm_count, fp16=True, tensor_cores=tc)
            cuda_kernels.SDPA_FILL4 = fill
            if tc and lp.kernel != "mma":
                continue
            if f4 != fill and lp == auto:
                continue  # the policy changes nothing for this shape
            label = (f"{lp.kernel} (bk {lp.bk}, {lp.splits} split{'s' if lp.splits > 1 else ''}, grid {lp.grid}"
                     + (f", {lp.br}-row blocks" if lp.kernel == "tile" else "") + (", SDPA_FILL4=0" if f4 != fill else "")
                     + ")")
            try:
                out = cp.empty((B, H, Tq, D), np.float16)
                kern.sdpa_tensor_cores = tc
                cuda_kernels.SDPA_FILL4 = f4  # read when the dispatch binds
                run = kern.bind("sdpa", [dq, dk, dv, dm], [out], attrs, f"bench {name}")
                us = graph_time_us(cp, run)
                err = float(np.max(np.abs(out.get().astype(np.float64) - want)) / np.max(np.abs(want)))
                rows.append((name, label, f"{us:.1f} us", f"{err:.1e}"))
            except Exception as e:  # record and go on: one variant failing must not hide the others
                rows.append((name, label, f"failed: {type(e).__name__}: {str(e)[:80]}", ""))
            finally:
                kern.sdpa_tensor_cores = None
                cuda_kernels.SDPA_FILL4 = fill
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
            tm = torch.from_numpy(keep).cuda()
            fn = lambda: F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, enable_gqa=True)
            try:
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    fn()
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, stream=s):
                        for _ in range(N_CALLS):
                            res = fn()
                    g.replay()
                    torch.cuda.synchronize()
                    ts = []
                    for _ in range(7):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        g.replay()
                        b.record()
                        b.synchronize()
                        ts.append(a.elapsed_time(b) * 1e3 / N_CALLS)
                err = float(np.max(np.abs(res.float().cpu().numpy() - want)) / np.max(np.abs(want)))
                rows.append((name, f"torch {torch.__version__} F.scaled_dot_product_attention", f"{statistics.median(ts):.1f} us",
                             f"{err:.1e}"))
            except Exception as e:
                rows.append((name, "torch F.scaled_dot_product_attention", f"failed: {type(e).__name__}: {str(e)[:80]}", ""))
    env.close()
    data["results"] = [dict(zip(("shape", "kernel", "time_per_call", "max_err_rel_to_max"), r)) for r in rows]
    slug = "".join(c if c.isalnum() else "_" for c in ctx.name).strip("_").lower()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"cuda_sdpa_{slug}.json").write_text(json.dumps(data, indent=1))
    print(f"| shape (fp16, keep-mask) | kernel | GPU time per call | max err / max |\n|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
