"""The GPU's own time for one WebGPU decode step, whole and by op, under kernel tunings: a probe.

    python benchmarks/probe_decode_gpu.py [--small] [--devices wgpu,dawn] [--weights q4_1]
        [--variants tree,sg1,sg2,sg4,sg8] [--copies 32] [--out DIR]
        [--dawn-device-toggles ';disable_robustness;...'] [--kernels [--kernel-copies 200]]
        [--layers 6 --vocab 4096]

A decode step with steps submitted ahead overlaps the host with the GPU, so the GPU's time per
step bounds it. Two measures per (device, weights, variant), SmolLM2-135M shapes with seeded
random weights (bench_decode.py's model), the cache filled by a 128-token prefill:

- whole step: ``--copies`` copies of the decode chain encoded into one command buffer (the host's
  encoding outside the timing), submitted once and waited for: wall / copies, with no gap between
  steps (every copy writes the same cache row; the work is a real step's). Median of 5. Beside
  it the same command buffer's time between two timestamps around the copies (the GPU's alone)
  and the host time of the submit call (Dawn records a command buffer's Vulkan commands inside
  it, before the GPU starts, so Dawn's wall holds it; wgpu-native's does not).
- with ``--tok-s``: greedy decode tok/s through ``llm.generate`` with 2 steps ahead
  (bench_decode.py's ``time_generate``), where the host overlaps the GPU.
- by op: the executor's profile mode (each dispatch in its own pass between two timestamps, so
  small dispatches read high: the shares are what it is for).

Variants are ``Tuning``s of core/webgpu/kernel.py: ``tree`` the workgroup-memory reductions of
quant_mm.wgsl (``qgemv_subgroups=False``), ``sgR`` quant_mm_sg.wgsl's subgroup sums with R weight
rows per workgroup (``qgemv_sg_rows``), ``sgLxR`` also ``qgemv_sg_lanes`` L; ``+norope`` and ``+rows``
after any of them switch one fusion or kernel off, ``+combine`` runs the attention's combine as
its own dispatch (not in the o product's prologue), ``+ar8`` / ``+ar4`` give that prologue's
product 8 / 4 weight rows a workgroup, ``+k32`` / ``+k16`` fix flash-decoding's chunks at 32 /
16 keys (``OPTIONS``). Each variant's first decode logits are compared with the first variant's
(max abs difference). ``--small`` checks the script on a software adapter.
``--dawn-device-toggles`` repeats Dawn's rows under each set of device toggles (``;``-separated
sets of ``,``-separated names, ``-name`` disables one; an empty set is Dawn's defaults), each set
a context of its own, in one process.

``--kernels`` adds a per-kernel table: for each dispatch kind of the decode chain (its
``shader:entry`` and workgroup counts), ``--kernel-copies`` back-to-back copies of that one
dispatch (its first occurrence's bind group) in one pass between two timestamps, per copy: the
kernel with the per-dispatch cost between dependent dispatches included, as in the chain. Times
its occurrences a step, the rows sum to a step made of such dispatches, beside the chain's own
timestamps, and the chain's excess over that sum a dispatch.

``--layers`` / ``--vocab`` change the model's depth and vocabulary (same layer shapes): with 6
layers and 4,096 tokens a step's weights (~16 MB, the caches and norm weights with them) stay in
an H100's 50 MB L2, so the chain's excess over its kernels there, against the full model's, bounds
what a step's trips to HBM add between its dispatches.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode as bd  # noqa: E402  (imports gpudelegate from the tree when not installed)
from probe_decode_host import ops_of  # noqa: E402


# A variant's "+option" suffixes (e.g. sg4+norope), each a Tuning switch for an A/B in one tree:
# norope: the packed q/k/v product into a scratch, then rope_kv (two dispatches, not qgemv_rope);
# rows: decode attention as one workgroup per query row (attn_rows), no split-key pass + combine;
# combine: flash-decoding's combine as its own dispatch before the o product (not qgemv_attn's prologue);
# arR: qgemv_attn with R weight rows per workgroup (subgroup kernels); k32 / k16: flash-decoding in
# 32- / 16-key chunks (whatever the path); nopair: one weight row a thread row in every qgemv (the LM
# head too).
OPTIONS = {"norope": {"qgemv_rope": False}, "rows": {"attn_flash": False, "attn_split": False},
           "combine": {"attn_in_product": False}, "ar8": {"attn_product_rows": 8}, "ar4": {"attn_product_rows": 4},
           "k32": {"attn_flash_keys": 32}, "k16": {"attn_flash_keys": 16},
           "nopair": {"qgemv_pair_min_groups": None}}


def tuning_of(name: str):
    from gpudelegate.webgpu.lowering import Tuning

    base, *opts = name.split("+")
    extra = {}
    for o in opts:
        if o not in OPTIONS:
            raise SystemExit(f"--variants: {name!r}: option {o!r} is not one of {sorted(OPTIONS)}")
        extra.update(OPTIONS[o])
    known = set(Tuning.__dataclass_fields__)
    if any(k not in known for k in extra):  # an older tree (the baseline) lacks the switch
        raise ValueError(f"{name!r} needs Tuning fields this tree lacks")
    if base == "tree":
        return Tuning(qgemv_subgroups=False, **extra)
    if base.startswith("sg"):
        lanes, _, rows = base[2:].rpartition("x")
        return Tuning(qgemv_sg_rows=int(rows), **({"qgemv_sg_lanes": int(lanes)} if lanes else {}), **extra)
    raise SystemExit(f"--variants: {name!r} is neither 'tree' nor sgR / sgLxR (with +options)")


def _decode_inputs(wl, tok: int, pos: int, caches):
    return [np.array([[tok]], np.int32), np.array([pos], np.int32), *caches]


def kernel_table(ctx, chain, copies: int) -> list:
    """[(kind, occurrences a step, us a dispatch)] of a recorded decode chain: each kind's first
    dispatch repeated ``copies`` times in one pass between two timestamps (median of 5, after
    one warm-up round). Every copy rewrites the same outputs from the same inputs, so each waits for
    the one before it (WebGPU orders dispatches that write a buffer) as the chain's do."""
    kinds = {}
    for step in chain.steps:
        for L in step.launches:
            key = (L.entry, tuple(int(v) for v in L.workgroups))
            n, first = kinds.get(key, (0, L))
            kinds[key] = (n + 1, first)
    qs = ctx.device.create_query_set(type="timestamp", count=2)
    U = ctx.wgpu.BufferUsage
    rbuf = ctx.device.create_buffer(size=16, usage=U.QUERY_RESOLVE | U.COPY_SRC)
    rows = []
    for (entry, wg), (n, L) in kinds.items():
        got = []
        for _ in range(6):
            enc = ctx.device.create_command_encoder()
            cp = enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": 0,
                                                          "end_of_pass_write_index": 1})
            cp.set_pipeline(L.pipeline)
            for _ in range(copies):
                cp.set_bind_group(0, L.bind_group)
                cp.dispatch_workgroups(*wg)
            cp.end()
            enc.resolve_query_set(qs, 0, 2, rbuf, 0)
            ctx.device.queue.submit([enc.finish()])
            ticks = np.frombuffer(ctx.device.queue.read_buffer(rbuf), np.uint64)
            got.append(float(ticks[1] - ticks[0]) * 1e-3 / copies)
        rows.append((f"{entry.split(':')[-1]} {'x'.join(map(str, wg))}", n, statistics.median(got[1:])))
    return rows


def measure(env, prog, device: str, wl, tuning, copies: int, lookahead: bool, kernel_copies: int = 0) -> dict:
    """Whole-step GPU ms, first decode logits and GPU us by op of one session."""
    cfg = wl.cfg
    zeros = [np.zeros((1, cfg.kv_heads, cfg.max_context, cfg.head_dim), np.float32) for _ in range(2 * cfg.layers)]
    s = env.session(prog, device=device, tuning=tuning)
    try:
        out = s.run("prefill", [wl.prompt, np.array([0], np.int32), np.array([wl.chunk - 1], np.int32), *zeros],
                    keep_on_device=True)
        out = s.run("decode", _decode_inputs(wl, 7, wl.chunk, out[1:]), keep_on_device=True)
        logits = out[0].numpy().reshape(-1).astype(np.float64)
        ex = s.executor
        pid = prog.methods["decode"].nodes[0].attrs["payload"]
        ctx, chain = ex.device, ex.recorded[pid].chain
        ms, sub, ts = [], [], []
        stamps = "timestamp-query" in ctx.features
        if stamps:
            qs = ctx.device.create_query_set(type="timestamp", count=2)
            U = ctx.wgpu.BufferUsage
            rbuf = ctx.device.create_buffer(size=16, usage=U.QUERY_RESOLVE | U.COPY_SRC)
        for _ in range(6):
            enc = ctx.device.create_command_encoder()
            if stamps:
                enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": 0}).end()
            for _ in range(copies):
                ctx.encode_chain(chain, enc)
            if stamps:
                enc.begin_compute_pass(timestamp_writes={"query_set": qs, "end_of_pass_write_index": 1}).end()
                enc.resolve_query_set(qs, 0, 2, rbuf, 0)
            cb = enc.finish()
            ctx.fence()
            t = time.perf_counter()
            ctx.device.queue.submit([cb])
            t1 = time.perf_counter()
            ctx.fence()
            ms.append((time.perf_counter() - t) / copies * 1e3)
            # Dawn records the Vulkan commands of a command buffer inside the submit (wgpu-native
            # while encoding): the GPU starts after it, so the wall above includes it there.
            sub.append((t1 - t) / copies * 1e3)
            if stamps:
                ticks = np.frombuffer(ctx.device.queue.read_buffer(rbuf), np.uint64)
                ts.append(float(ticks[1] - ticks[0]) * 1e-6 / copies)
        dispatches = sum(len(n.launches) for n in ex.recorded[pid].nodes)
        kernels = kernel_table(ctx, chain, kernel_copies) if kernel_copies and stamps else []
        gen = bd.time_generate(s, wl, [2])["tok_s"][2] if lookahead else None
    finally:
        s.close()
    s = env.session(prog, device=device, tuning=tuning, profile=True)
    try:
        out = s.run("prefill", [wl.prompt, np.array([0], np.int32), np.array([wl.chunk - 1], np.int32), *zeros],
                    keep_on_device=True)
        for i in range(3):
            out = s.run("decode", _decode_inputs(wl, 7, wl.chunk + i, out[1:]), keep_on_device=True)
            out[0].numpy()
        by_op = ops_of(s.executor.last_profile)
    finally:
        s.close()
    return {"step_ms": statistics.median(ms[1:]), "submit_ms": statistics.median(sub[1:]),
            "stamps_ms": statistics.median(ts[1:]) if ts else float("nan"), "logits": logits, "by_op": by_op,
            "dispatches": dispatches, "kernels": kernels,
            "tok_s": gen}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true")
    p.add_argument("--devices", default="wgpu,dawn")
    p.add_argument("--weights", default="q4_1")
    p.add_argument("--variants", default="tree,sg1,sg2,sg4,sg8")
    p.add_argument("--copies", type=int, default=32)
    p.add_argument("--tok-s", action="store_true", help="also greedy tok/s through llm.generate, 2 steps ahead")
    p.add_argument("--out", default=None, help="folder for probe_decode_gpu.txt (the tables)")
    p.add_argument("--dawn-device-toggles", default="",
                   help="';'-separated sets of ','-separated Dawn device toggles: Dawn's rows once per set")
    p.add_argument("--kernels", action="store_true",
                   help="also the per-kernel table (timestamps around copies of one dispatch)")
    p.add_argument("--kernel-copies", type=int, default=200)
    p.add_argument("--layers", type=int, default=None, help="the model with this many layers")
    p.add_argument("--vocab", type=int, default=None, help="the model with this vocabulary")
    a = p.parse_args(argv)
    import gpudelegate

    cfg = bd.model_config(a.small)
    resize = {k: v for k, v in (("layers", a.layers), ("vocab_size", a.vocab)) if v}
    if resize:
        cfg = dataclasses.replace(cfg, **resize)
    wl = bd.Workload(cfg, a.small)
    model, packed = bd.random_model(cfg)
    progs, _ = bd.export_programs(model, cfg, packed, weights=tuple(a.weights.split(",")))
    variants = a.variants.split(",")
    summary = ["| device | weights | variant | GPU ms/step (wall) | timestamps ms/step | submit host ms/step "
               "| tok/s (generate, 2 ahead) | dispatches | max abs logits diff vs first |",
               "|---|---|---|---|---|---|---|---|---|"]
    ops_lines = []
    runs = []  # (device, its name in the rows, the environment whose context it is)
    for device in a.devices.split(","):
        if device != "dawn" or not a.dawn_device_toggles:
            runs.append((device, device, gpudelegate.Environment()))
            continue
        for group in a.dawn_device_toggles.split(";"):
            toggles = [t for t in group.split(",") if t]
            runs.append((device, f"dawn[{','.join(toggles) or 'default'}]",
                         gpudelegate.Environment(device_options={"dawn": {"device_toggles": toggles}})))
    for device, name, env in runs:
        try:
            ctx = env.context(device)
            ops_lines.append(f"# {name}: {ctx.limits.name}, measured subgroup size {ctx.subgroup_size()}, "
                             f"features {sorted(ctx.features)}")
        except Exception as e:
            ops_lines.append(f"# {name}: no context ({str(e)[:120]})")
            continue
        for wd, prog in progs.items():
            first = None
            for v in variants:
                try:
                    r = measure(env, prog, device, wl, tuning_of(v), a.copies, a.tok_s,
                                a.kernel_copies if a.kernels else 0)
                except Exception as e:  # a device that does not start: say so, go on
                    summary.append(f"| {name} | {wd} | {v} | failed: {str(e)[:90]} | | | | | |")
                    continue
                first = r["logits"] if first is None else first
                diff = float(np.max(np.abs(r["logits"] - first)))
                tok = f"{r['tok_s']:.0f}" if r["tok_s"] else ""
                summary.append(f"| {name} | {wd} | {v} | {r['step_ms']:.3f} | {r['stamps_ms']:.3f} "
                               f"| {r['submit_ms']:.3f} | {tok} | {r['dispatches']} "
                               f"| {diff:.2e} |")
                total = sum(t for _, t in r["by_op"].values())
                ops_lines.append(f"## {name} {wd} {v}: profile mode {total * 1e3:.3f} ms")
                ops_lines += [f"  {op:<14} {n:4.0f} x {t / n * 1e6:6.1f} us = {t * 1e6:7.0f} us ({t / total:4.0%})"
                              for op, (n, t) in sorted(r["by_op"].items(), key=lambda kv: -kv[1][1])[:8]]
                if r["kernels"]:
                    kern = sum(n * us for _, n, us in r["kernels"])
                    over = (r["stamps_ms"] * 1e3 - kern) / r["dispatches"]
                    ops_lines.append(f"## {name} {wd} {v}: per kernel ({a.kernel_copies} copies of one dispatch in a "
                                     f"pass), sum {kern / 1e3:.3f} ms a step against the chain's {r['stamps_ms']:.3f} "
                                     f"({over:.2f} us a dispatch more)")
                    ops_lines += [f"  {k:<34} {n:3d} x {us:6.2f} us = {n * us:7.1f} us ({n * us / kern:4.0%})"
                                  for k, n, us in sorted(r["kernels"], key=lambda t: -t[1] * t[2])]
                print(summary[-1], flush=True)
        env.close()
    text = "\n".join(ops_lines + [""] + summary) + "\n"
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "probe_decode_gpu.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
