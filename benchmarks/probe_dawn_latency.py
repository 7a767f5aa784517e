"""Where a Dawn run's latency goes beyond the chain's GPU time, and what cuts it: a probe.

    python benchmarks/probe_dawn_latency.py [--small] [--heads 0,4,8,16] [--rounds 3] [--runs 30]
        [--device-toggles ';skip_validation'] [--out DIR]

MiniLM-L6 (seeded weights) at 32 x 128 with ``precision="fast"`` on Dawn (issue 17: one
``session.run`` returning numpy), per device-toggle set (``;``-separated sets of ``,``-separated
names; an empty set is Dawn's defaults), each in a context of its own:

- the chain's GPU time between two timestamps (fastest of 5), and the round trip of an empty
  submit and a 4-byte map;
- ``session.run`` wall (median of ``--runs``, after the GPU's clock is up) for each
  ``WgpuContext.head_dispatches`` in ``--heads`` (0: one submit; h: the first h dispatches
  submitted before the rest), interleaved over ``--rounds`` rounds (the median of the rounds'
  medians is reported, and every round's);
- the host time of each phase of a run (the same calls as ``run_chain``, timed one by one):
  the executor's input checks, ``write_buffer``, the head's submit, the rest's submit, the next
  run's encode ahead, the map's wait (Dawn's ``wgpuInstanceWaitAny`` under wgpudawn's
  ``map_sync``, or ``map_async`` then a spin on ``wgpuInstanceProcessEvents``: ``wait=spin``),
  the copy out and the outputs' arrays;
- the host time of ``queue.submit`` alone for the whole chain, its head and its rest, the GPU idle
  before each (Dawn records a command buffer's Vulkan commands inside the submit).

``--small`` runs a 2-layer MiniLM at 2 x 16 to check the script on a software adapter.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOGGLES = ["allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"]


def export_minilm(small: bool):
    import torch

    from gpudelegate.export.models import minilm as mm
    from gpudelegate.export.writer import export_program

    torch.manual_seed(0)
    cfg = mm.MiniLMConfig(layers=2, hidden=64, heads=4, intermediate=128) if small else mm.MiniLMConfig()
    b, t = (2, 16) if small else (32, 128)
    model = mm.MiniLM(cfg).eval()
    with torch.no_grad():
        prog = export_program(model, mm.example_inputs(b, t), progress=False)
    rng = np.random.default_rng(b * 1000 + t)
    ids = rng.integers(1000, cfg.vocab_size, (b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    mask[b // 2:, t - t // 4:] = 0
    return prog, [ids, mask]


def chain_gpu_ms(ctx, chain) -> float:
    """GPU ms of ``chain`` as the executor encodes it, between timestamps of empty passes."""
    dev = ctx.device
    qs = dev.create_query_set(type="timestamp", count=2)
    enc = dev.create_command_encoder()
    enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": 0}).end()
    ctx.encode_chain(chain, enc)
    enc.begin_compute_pass(timestamp_writes={"query_set": qs, "end_of_pass_write_index": 1}).end()
    U = ctx.wgpu.BufferUsage
    rbuf = dev.create_buffer(size=16, usage=U.QUERY_RESOLVE | U.COPY_SRC)
    enc.resolve_query_set(qs, 0, 2, rbuf, 0)
    dev.queue.submit([enc.finish()])
    ticks = np.frombuffer(dev.queue.read_buffer(rbuf), np.uint64)
    rbuf.destroy()
    return float(ticks[1] - ticks[0]) * 1e-6


def round_trip_ms(ctx, n: int = 50) -> float:
    """Median host ms of an empty submit, then a 4-byte copy's map: the floor of any read-back."""
    w = ctx.wgpu
    src = ctx.device.create_buffer(size=16, usage=w.BufferUsage.COPY_SRC | w.BufferUsage.STORAGE)
    got = []
    for _ in range(n):
        dst = ctx.staging.get(16)
        t = time.perf_counter()
        enc = ctx.device.create_command_encoder()
        enc.copy_buffer_to_buffer(src, 0, dst, 0, 16)
        ctx.queue.submit([enc.finish()])
        dst.map_sync(w.MapMode.READ, 0, 16)
        got.append(time.perf_counter() - t)
        dst.unmap()
        ctx.staging.put(dst)
    return statistics.median(got) * 1e3


def spin_map(buf, mode, size: int) -> None:
    """``map_async``, then Dawn's ProcessEvents in a loop until the map's callback ran."""
    from wgpudawn.backends.dawn._api import process_events

    promise = buf.map_async(mode, 0, size)
    while promise._state == "pending":
        process_events()
    promise.sync_wait()  # resolved: raises a failed map's error


def phases(s, inputs, wait: str = "sync") -> dict:
    """One run as ``run_chain`` makes it (run_chain's fast path, the same calls), host seconds per
    phase. ``wait``: "sync" (wgpudawn's map_sync: wgpuInstanceWaitAny) or "spin"."""
    from gpudelegate.webgpu.commands import round4

    ex = s.executor
    ctx, pid = ex.device, 0
    chain = ex.recorded[pid].chain
    t = [time.perf_counter()]
    temps: list = []
    pp, io = ex._io(pid, list(inputs), False, temps)
    t.append(time.perf_counter())
    for buf, off, data in io.writes:
        ctx.write_buffer(buf, off, data)
    t.append(time.perf_counter())
    parts = ctx._take_chain(chain)
    if len(parts) > 1:
        ctx.queue.submit(parts[:-1])
    t.append(time.perf_counter())
    reads = list(io.reads)
    offs, size = [], 0
    for _, _, n in reads:
        offs.append(size)
        size += round4(n)
    staging = ctx.staging.get(size)
    enc = ctx.device.create_command_encoder()
    for (buf, off, n), so in zip(reads, offs):
        enc.copy_buffer_to_buffer(buf, off, staging, so, round4(n))
    ctx.queue.submit([parts[-1], enc.finish()])
    t.append(time.perf_counter())
    ctx._encode_ahead(chain)
    t.append(time.perf_counter())
    if wait == "spin":
        spin_map(staging, ctx.wgpu.MapMode.READ, size)
    else:
        staging.map_sync(ctx.wgpu.MapMode.READ, 0, size)
    t.append(time.perf_counter())
    mv = staging.read_mapped(0, size, copy=False)
    outs = [np.frombuffer(mv, np.uint8, count=n, offset=so).copy() for (_, _, n), so in zip(reads, offs)]
    del mv
    staging.unmap()
    ctx.staging.put(staging)
    t.append(time.perf_counter())
    ex._outputs(pid, pp, outs, False, temps)
    t.append(time.perf_counter())
    names = ("inputs", "write_buffer", "head submit", "rest submit", "encode ahead", "map wait", "copy out",
             "outputs")
    return dict(zip(names, np.diff(t)))


def submit_ms(ctx, chain, head: int, n: int = 10) -> dict:
    """Median host ms of ``queue.submit`` of the chain's parts at ``head``, the GPU idle before."""
    got: dict = {}
    old = ctx.head_dispatches
    ctx.head_dispatches = head
    try:
        for _ in range(n):
            cbs = ctx._chain_buffers(chain)
            ctx.fence()
            for k, cb in enumerate(cbs):
                t = time.perf_counter()
                ctx.queue.submit([cb])
                got.setdefault(k, []).append(time.perf_counter() - t)
            ctx.fence()
    finally:
        ctx.head_dispatches = old
    return {k: statistics.median(v) * 1e3 for k, v in got.items()}


def median_run_ms(s, inputs, runs: int) -> float:
    got = []
    for _ in range(runs):
        t = time.perf_counter()
        s.run("forward", inputs)
        got.append(time.perf_counter() - t)
    return statistics.median(got) * 1e3


def warm(s, inputs, seconds: float) -> None:
    """Runs back to back for ``seconds``: the GPU's clock rises under ~2 s of load."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        s.run("forward", inputs)


def probe(prog, inputs, toggles, heads, rounds: int, runs: int, warm_s: float) -> list:
    import gpudelegate

    env = gpudelegate.Environment(device_options={"dawn": {"toggles": TOGGLES, "device_toggles": list(toggles)}})
    name = ",".join(toggles) or "default"
    lines = []
    with env.session(prog, device="dawn", precision="fast") as s:
        ex = s.executor
        ctx, chain = ex.device, ex.recorded[0].chain
        dispatches = sum(len(st.launches) for st in chain.steps)
        ref = s.run("forward", inputs)[0]
        warm(s, inputs, warm_s)
        gpu = min(chain_gpu_ms(ctx, chain) for _ in range(5))
        rt = round_trip_ms(ctx)
        walls = {h: [] for h in heads}
        for _ in range(rounds):
            for h in heads:
                ctx.head_dispatches = h
                for _ in range(3):
                    got = s.run("forward", inputs)[0]
                if not np.array_equal(got, ref):
                    raise SystemExit(f"head {h}: the outputs differ from the one-submit run's")
                walls[h].append(median_run_ms(s, inputs, runs))
        lines.append(f"## {name}: {ctx.limits.name}; {dispatches} dispatches; chain GPU {gpu:.3f} ms "
                     f"(fastest of 5); empty submit + 4-byte map {rt:.3f} ms (median)")
        lines += ["", "| head dispatches | session.run ms (median of rounds) | - chain GPU | rounds |",
                  "|---|---|---|---|"]
        for h in heads:
            m = statistics.median(walls[h])
            lines.append(f"| {h} | {m:.3f} | {m - gpu:+.3f} | {' / '.join(f'{w:.3f}' for w in walls[h])} |")
        lines += ["", "| head | wait | " + " | ".join(("inputs", "write_buffer", "head submit", "rest submit",
                                                     "encode ahead", "map wait", "copy out", "outputs"))
                  + " | sum ms |", "|---" * 11 + "|"]
        for h in heads:
            for wait in ("sync", "spin"):
                ctx.head_dispatches = h
                for _ in range(3):
                    phases(s, inputs, wait)
                per = [phases(s, inputs, wait) for _ in range(runs)]
                med = {k: statistics.median(p[k] for p in per) * 1e3 for k in per[0]}
                tot = statistics.median(sum(p.values()) for p in per) * 1e3
                lines.append(f"| {h} | {wait} | " + " | ".join(f"{v:.3f}" for v in med.values()) + f" | {tot:.3f} |")
        sub = {h: submit_ms(ctx, chain, h) for h in heads}
        lines += ["", "queue.submit alone, GPU idle before (median ms): " +
                  "; ".join(f"head {h}: " + " + ".join(f"{v:.3f}" for v in d.values()) for h, d in sub.items())]
        ctx.head_dispatches = type(ctx).head_dispatches
    env.close()
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true")
    p.add_argument("--heads", default="0,4,8,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--warm", type=float, default=3.0, help="seconds of runs before timing (the GPU's clock)")
    p.add_argument("--device-toggles", default="", help="';'-separated sets of ','-separated Dawn device toggles")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    prog, inputs = export_minilm(a.small)
    heads = [int(h) for h in a.heads.split(",")]
    lines = []
    for group in a.device_toggles.split(";"):
        toggles = [t for t in group.split(",") if t]
        lines += probe(prog, inputs, toggles, heads, a.rounds, a.runs, a.warm) + [""]
        print("\n".join(lines), flush=True)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "probe_dawn_latency.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
