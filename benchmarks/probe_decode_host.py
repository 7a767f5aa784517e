"""Why does the host time of a WebGPU decode step swing between processes? A probe.

bench_decode.py measured wgpu-native SmolLM2 decode at 140-159 tok/s with 3.4-4.6 ms of host time
per ``session.run`` step, where bench_dawn.py's process measured 1.5 ms and 422 tok/s minutes
earlier on the same machine (docs/NOTES.md). The two processes differ in what ran before the
WebGPU rows: bench_decode runs PyTorch eager on CUDA and our CUDA executor with CUDA graphs
first. This probe runs the same wgpu (and Dawn) decode in one process before and after each of
those, on the same program, and prints host ms/step, tok/s and the top of a cProfile of 16 steps
for each phase, so the phase that slows the host shows, and where the time goes.

    python benchmarks/probe_decode_host.py [--small] [--out DIR]

``--small`` (2 layers) checks the script on a software adapter.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode as bd  # noqa: E402  (imports gpudelegate from the tree when not installed)


def _profile_steps(s, wl, out, tok: int, steps: int = 16) -> str:
    """cProfile of ``steps`` decode runs, the top functions by own time."""
    prof = cProfile.Profile()
    pos = wl.chunk + wl.n_dec + 3  # within the cache, past the measured steps
    caches = out[1:]
    prof.enable()
    for i in range(steps):
        o = s.run("decode", [np.array([[tok]], np.int32), np.array([pos + i], np.int32), *caches], keep_on_device=True)
        caches = o[1:]
        o[0].numpy()  # read back each step, as a greedy decode does
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf).sort_stats("tottime")
    st.print_stats(14)
    st.print_callers("proxy_func")  # which wgpu-py call the native time is under
    return buf.getvalue()


def generate_profile(env, prog, device: str, wl, label: str, lookahead: int, tokens: int = 64) -> str:
    """cProfile of greedy ``llm.generate`` with ``lookahead`` steps submitted ahead (what the
    decode rows time), the top functions by own time: where a step's host time goes when the
    pick stays on the device."""
    from gpudelegate.llm import generate
    from gpudelegate.text.ids import IdsTokenizer

    s = env.session(prog, device=device)
    try:
        prompt = [int(x) for x in wl.prompt.reshape(-1)]
        generate(s, IdsTokenizer(), prompt, max_new_tokens=4, stop_ids=(), lookahead=lookahead)  # warm-up
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        r = generate(s, IdsTokenizer(), prompt, max_new_tokens=tokens, stop_ids=(), lookahead=lookahead)
        prof.disable()
        wall = time.perf_counter() - t
    finally:
        s.close()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    return (f"## {label}: {device} generate, lookahead {lookahead}: {len(r.ids)} tokens in {wall * 1e3:.1f} ms "
            f"(profiled; decode {r.decode_seconds * 1e3:.1f} ms)\n" + buf.getvalue())


def cuda_op_table(env, prog, wl, label: str, steps: int = 3) -> str:
    """GPU time of one CUDA decode step by op, eager (events around each launch; a graph replays
    as one unit): which kernels a step's time goes to."""
    s = env.session(prog, device="cuda", profile=True)
    try:
        zeros = [np.zeros((1, wl.cfg.kv_heads, wl.cfg.max_context, wl.cfg.head_dim), np.float32)
                 for _ in range(2 * wl.cfg.layers)]
        out = s.run("prefill", [wl.prompt, np.array([0], np.int32), np.array([wl.chunk - 1], np.int32), *zeros],
                    keep_on_device=True)
        s.executor.profile_ms.clear()
        for i in range(steps):
            out = s.run("decode", [np.array([[7]], np.int32), np.array([wl.chunk + i], np.int32), *out[1:]],
                        keep_on_device=True)
            out[0].numpy()
        by_op = {op: (n / steps, ms / 1e3 / steps) for op, (ms, n) in s.executor.profile_ms.items()}
    finally:
        s.close()
    return _op_lines(label, "cuda", by_op)


def _op_lines(label: str, device: str, by_op: dict) -> str:
    total = sum(t for _, t in by_op.values())
    lines = [f"## {label}: {device} GPU time of one decode step by op: {total * 1e3:.3f} ms in "
             f"{sum(n for n, _ in by_op.values()):.0f} dispatches", "| op | dispatches | us | share |", "|---|---|---|---|"]
    for op, (n, t) in sorted(by_op.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {op} | {n:.0f} | {t * 1e6:.0f} | {t / total:.0%} |")
    return "\n".join(lines) + "\n"


def gpu_op_table(env, prog, device: str, wl, label: str) -> str:
    """GPU time of one decode step by op (timestamp queries around each dispatch: each one in its
    own pass, so small ones read high; the shares are what this is for)."""
    s = env.session(prog, device=device, profile=True)
    try:
        zeros = [np.zeros((1, wl.cfg.kv_heads, wl.cfg.max_context, wl.cfg.head_dim), np.float32)
                 for _ in range(2 * wl.cfg.layers)]
        out = s.run("prefill", [wl.prompt, np.array([0], np.int32), np.array([wl.chunk - 1], np.int32), *zeros],
                    keep_on_device=True)
        for i in range(3):
            out = s.run("decode", [np.array([[7]], np.int32), np.array([wl.chunk + i], np.int32), *out[1:]],
                        keep_on_device=True)
            out[0].numpy()
        by_op = ops_of(s.executor.last_profile)
    finally:
        s.close()
    return _op_lines(label, device, by_op)


def ops_of(profile) -> dict:
    """A WebGPU executor's ``last_profile`` ([(op, node, seconds)]) as {op: (dispatches, seconds)}."""
    by_op = {}
    for op, _node, sec in profile:
        n, t = by_op.get(op, (0, 0.0))
        by_op[op] = (n + 1, t + sec)
    return by_op


def measure(env, prog, device: str, wl, label: str, rows: list, profiles: list, profile: bool) -> None:
    import gpudelegate

    try:
        env.context(device)
    except gpudelegate.DeviceError as e:
        rows.append((label, device, "skipped", "", str(e)[:80]))
        return
    poller = getattr(env.context(device).device, "_poller", None)  # wgpu-py's poll thread (wgpu-native)
    cpu0, main0 = time.process_time(), time.thread_time()
    r = bd.run_ours(env, prog, device, wl)
    cpu, main = time.process_time() - cpu0, time.thread_time() - main0
    tokens = len(poller._token_ids) if poller is not None else "-"
    rows.append((label, device, f"{r['decode_tok_s']:.0f}", f"{r['host_ms_per_step']:.3f}",
                 f"CPU s all threads {cpu:.2f} / main thread {main:.2f}; poll tokens open {tokens}; "
                 f"threads {threading.active_count()}"))
    if not profile:
        return
    # a second session for the profile (run_ours closed its own)
    s = env.session(prog, device=device)
    try:
        zeros = [np.zeros((1, wl.cfg.kv_heads, wl.cfg.max_context, wl.cfg.head_dim), np.float32)
                 for _ in range(2 * wl.cfg.layers)]
        out = s.run("prefill", [wl.prompt, np.array([0], np.int32), np.array([wl.chunk - 1], np.int32), *zeros],
                    keep_on_device=True)
        profiles.append(f"## {label}: {device}\n" + _profile_steps(s, wl, out, 7, steps=4 if wl.n_dec < 8 else 16))
    finally:
        s.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="2 layers: checks the script on a software adapter")
    p.add_argument("--out", default=None, help="folder for probe_decode_host.txt (the profiles)")
    p.add_argument("--steps", default="wgpu,dawn,cuda,wgpu,dawn,torch,wgpu,dawn,freeze,new,wgpu",
                   help="what runs, in order: wgpu / dawn (a measured decode in the current Environment), "
                        "cuda (our CUDA graphs decode), torch (PyTorch eager decode), freeze (gc.freeze()), "
                        "new (close the Environment, make another)")
    p.add_argument("--profile", action="store_true", help="a cProfile of 16 steps after each measured decode")
    p.add_argument("--weights", default="float32", help="programs to run, comma-separated: float32, float16, q4_1")
    p.add_argument("--gpu-ops", action="store_true", help="after each measured decode, its GPU time by op")
    p.add_argument("--generate-profile", type=int, default=None, metavar="LOOKAHEAD",
                   help="after each measured decode, a cProfile of llm.generate with this many steps ahead")
    a = p.parse_args(argv)
    import gpudelegate

    cfg = bd.model_config(a.small)
    wl = bd.Workload(cfg, a.small)
    model, packed = bd.random_model(cfg)
    progs, _ = bd.export_programs(model, cfg, packed, weights=tuple(a.weights.split(",")))
    rows, profiles, done = [], [], []
    env = gpudelegate.Environment()
    t0 = time.perf_counter()
    for step in a.steps.split(","):
        label = " > ".join(done + [step])
        if step in ("wgpu", "dawn"):
            for wd, prog in progs.items():
                measure(env, prog, step, wl, f"{label} ({wd})", rows, profiles, a.profile)
                if a.gpu_ops:
                    profiles.append(gpu_op_table(env, prog, step, wl, f"{label} ({wd})"))
                if a.generate_profile is not None:
                    profiles.append(generate_profile(env, prog, step, wl, f"{label} ({wd})", a.generate_profile,
                                                     tokens=8 if a.small else 64))
        elif step in ("cuda", "torch"):
            cp, why = bd._cuda()
            if cp is None:
                rows.append((label, step, "skipped", "", why[:80]))
            elif step == "cuda":
                bd.run_ours(env, next(iter(progs.values())), "cuda", wl, cp=cp, capture_graph=True)
                if a.gpu_ops:
                    for wd, prog in progs.items():
                        profiles.append(cuda_op_table(env, prog, wl, f"{label} ({wd})"))
            else:
                import torch

                lc, tw = bd.torch_weights(model, cfg)
                bd.run_torch(torch, lc, tw, torch.float32, torch.device("cuda"), wl)
        elif step == "freeze":
            gc.collect()
            gc.freeze()
        elif step == "new":
            env.close()
            env = gpudelegate.Environment()
        else:
            p.error(f"unknown step {step!r}")
        done.append(step)
    env.close()
    if a.out and profiles:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "probe_decode_host.txt").write_text("\n".join(profiles))
    elif profiles:
        print("\n".join(profiles))
    print(f"\n{cfg.layers}-layer SmolLM2 {a.weights}, {wl.n_dec} decode steps, {time.perf_counter() - t0:.0f} s")
    print("| steps so far | device | tok/s | host ms/step in run() | note |\n|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
