"""Prefill-shaped attention on wgpu: the picked path (for more than 16 query rows of float32 over
at most 128 keys the one-pass attn_tile, else the composite: scores matmul, masked softmax,
P @ v) against the composite and the decode kernels (split-K attn_split + attn_combine, one-row
attn_rows) forced by Tuning, on MiniLM 32x128 and SmolLM2 prefill-128 shapes, with torch SDPA
(fp32) as the anchor.
Every variant's output is checked against float64 numpy first.

    python benchmarks/bench_wgpu_attention.py [--small]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_wgpu import _gpu_seconds, single_op_program  # noqa: E402

import gpudelegate  # noqa: E402
from gpudelegate.webgpu import lowering  # noqa: E402

VARIANTS = {"picked (default)": lowering.Tuning(),
            "composite (attn_tile off)": lowering.Tuning(attn_tile=False),
            "composite, 64x64 tiles 4x4": lowering.Tuning(mm_tile=64, mm_tm=4, attn_tile=False),
            "composite, 32x32 tiles 4x4": lowering.Tuning(mm_tile=32, attn_tile=False),
            "composite, 64x64 tiles 8x8": lowering.Tuning(mm_tile=64, attn_tile=False),
            "attn_split": lowering.Tuning(attn_fused_max_tq=1 << 20),
            "attn_rows": lowering.Tuning(attn_fused_max_tq=1 << 20, attn_split=False)}


def ref(q, k, v, mask, causal, scale):
    B, H, T, D = q.shape
    G = H // k.shape[1]
    k = np.repeat(k, G, axis=1).astype(np.float64)
    v = np.repeat(v, G, axis=1).astype(np.float64)
    s = q.astype(np.float64) @ k.transpose(0, 1, 3, 2) * scale
    if mask is not None:
        s = s + mask
    if causal:
        s = np.where(np.tril(np.ones((T, k.shape[2]), bool)), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    return (s / s.sum(-1, keepdims=True)) @ v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args(argv)
    cases = [("MiniLM 32x128", 32, 12, 12, 128, 32, True, False),
             ("SmolLM2 prefill 128", 1, 9, 3, 128, 64, False, True)]
    if a.small:
        cases = [("MiniLM 3x37", 3, 12, 12, 37, 32, True, False), ("SmolLM2 41", 1, 9, 3, 41, 64, False, True)]
    env = gpudelegate.Environment()
    ctx = env.context("wgpu")
    try:
        import torch
        tdev = "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    lines = ["| shape | variant | GPU us per call | vs torch SDPA fp32 | max rel err vs float64 |", "|---|---|---:|---:|---:|"]
    for name, B, H, Hk, T, D, masked, causal in cases:
        q = rng.standard_normal((B, H, T, D), dtype=np.float32)
        k = rng.standard_normal((B, Hk, T, D), dtype=np.float32)
        v = rng.standard_normal((B, Hk, T, D), dtype=np.float32)
        mask = None
        inputs = [("float32", q.shape), ("float32", k.shape), ("float32", v.shape)]
        if masked:
            mask = np.zeros((B, 1, 1, T), np.float32)
            mask[B // 2:, ..., T - T // 4:] = -1e9
            inputs.append(("float32", mask.shape))
        scale = 1.0 / np.sqrt(D)
        prog = single_op_program("sdpa", inputs, {"causal": causal, "scale": float(scale)})
        want = ref(q, k, v, mask, causal, scale)
        args = [q, k, v] + ([mask] if masked else [])
        tsec = None
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(x).to(tdev) for x in (q, np.repeat(k, H // Hk, 1), np.repeat(v, H // Hk, 1)))
            tm = torch.from_numpy(mask).to(tdev) if masked else None
            F = torch.nn.functional.scaled_dot_product_attention
            for _ in range(3):
                F(tq, tk, tv, attn_mask=tm, is_causal=causal)
            if tdev == "cuda":
                st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                st.record()
                for _ in range(50):
                    F(tq, tk, tv, attn_mask=tm, is_causal=causal)
                en.record()
                torch.cuda.synchronize()
                tsec = st.elapsed_time(en) / 1e3 / 50
        for vname, tuning in VARIANTS.items():
            with env.session(prog, device="wgpu", tuning=tuning) as s:
                got = s.run("forward", args)[0]
                err = float(np.abs(got - want).max() / np.abs(want).max())
                sec = _gpu_seconds(s.executor, ctx, 3 if a.small else 30)
                kn = ", ".join(sorted({L.pipeline.label.split(":")[-1] for nd in s.executor.recorded[0].nodes
                                       for L in nd.launches}))
            ratio = f"{tsec / sec:.2f}x speed" if tsec else "n/a"
            lines.append(f"| {name} | {vname} [{kn}] | {sec * 1e6:.1f} | {ratio} | {err:.1e} |")
            print(lines[-1], flush=True)
        if tsec:
            lines.append(f"| {name} | torch SDPA fp32 (anchor) | {tsec * 1e6:.1f} | 1.00x | |")
    print("\n" + "\n".join(lines))
    env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
