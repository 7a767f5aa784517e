"""Where a Dawn run's latency goes beyond the chain's GPU time, and what cuts it: a probe.

    python benchmarks/probe_dawn_latency.py [--small] [--configs 0,16,0s,16s] [--rounds 3] [--runs 30]
        [--device-toggles ';skip_validation'] [--out DIR]

MiniLM-L6 (seeded weights) at 32 x 128 with ``precision="fast"`` on Dawn (issue 17: one
``session.run`` returning numpy), per device-toggle set (``;``-separated sets of ``,``-separated
names; an empty set is Dawn's defaults), each in a context of its own:

- the chain's GPU time between two timestamps (fastest of 5), and the round trip of an empty
  submit and a 4-byte map;
- ``session.run`` and ``executor.run`` wall (median of ``--runs``, after the GPU's clock is up)
  for each config in ``--configs``: ``h`` is ``WgpuContext.head_dispatches`` (0: one submit; h:
  the first h dispatches submitted before the rest), a trailing ``s`` has the read-back spin
  (``DawnContext.map_spin_s``, else 0: block in WaitAny), interleaved over ``--rounds`` rounds (the
  median of the rounds' medians is reported, and every round's);
- the host time of each phase of a run (the same calls as ``run_chain``, timed one by one):
  the executor's input checks, ``write_buffer``, the head's submit, the rest's submit, the next
  run's encode ahead, the map's wait (Dawn's ``wgpuInstanceWaitAny`` under wgpudawn's
  ``map_sync``, or ``map_async`` then a spin on ``wgpuInstanceProcessEvents``: ``wait=spin``),
  the copy out and the outputs' arrays;
- the host time of ``queue.submit`` alone for the whole chain, its head and its rest, the GPU idle
  before each (Dawn records a command buffer's Vulkan commands inside the submit).

With ``--decode``, SmolLM2 q4_1 greedy decode (bench_decode.py's seeded model) through
``llm.generate`` on Dawn, tok/s with the host's pick and with the GPU's (0 and 2 steps ahead),
under each config, interleaved over ``--rounds`` rounds: whether the configs cost decode anything.

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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_sgmat, bench_decode

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
    from bench_sgmat import _gpu_pass_ms

    return _gpu_pass_ms(ctx, lambda enc: ctx.encode_chain(chain, enc), 1)


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


def median_run_ms(run, inputs, runs: int) -> float:
    got = []
    for _ in range(runs):
        t = time.perf_counter()
        run(inputs)
        got.append(time.perf_counter() - t)
    return statistics.median(got) * 1e3


def config(ctx, name: str) -> None:
    """Set ``ctx`` to config ``name`` (``16``, ``16s``: see the module docstring)."""
    ctx.head_dispatches = int(name.rstrip("s"))
    ctx.map_spin_s = type(ctx).map_spin_s if name.endswith("s") else 0.0


def warm(s, inputs, seconds: float) -> None:
    """Runs back to back for ``seconds``: the GPU's clock rises under ~2 s of load."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        s.run("forward", inputs)


def probe(prog, inputs, toggles, configs, rounds: int, runs: int, warm_s: float) -> list:
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
        walls = {c: [] for c in configs}
        ex_walls = {c: [] for c in configs}
        ex_run = lambda xs: ex.run(0, xs)  # noqa: E731
        s_run = lambda xs: s.run("forward", xs)  # noqa: E731
        for _ in range(rounds):
            for c in configs:
                config(ctx, c)
                for _ in range(3):
                    got = s.run("forward", inputs)[0]
                if not np.array_equal(got, ref):
                    raise SystemExit(f"config {c}: the outputs differ from the first run's")
                walls[c].append(median_run_ms(s_run, inputs, runs))
                ex_walls[c].append(median_run_ms(ex_run, inputs, runs))
        lines.append(f"## {name}: {ctx.limits.name}; {dispatches} dispatches; chain GPU {gpu:.3f} ms "
                     f"(fastest of 5); empty submit + 4-byte map {rt:.3f} ms (median)")
        lines += ["", "| config (head dispatches, s: spin) | session.run ms (median of rounds) | - chain GPU "
                  "| executor.run ms | session.run rounds |", "|---|---|---|---|---|"]
        for c in configs:
            m = statistics.median(walls[c])
            lines.append(f"| {c} | {m:.3f} | {m - gpu:+.3f} | {statistics.median(ex_walls[c]):.3f} "
                         f"| {' / '.join(f'{w:.3f}' for w in walls[c])} |")
        lines += ["", "| head | wait | " + " | ".join(("inputs", "write_buffer", "head submit", "rest submit",
                                                     "encode ahead", "map wait", "copy out", "outputs"))
                  + " | sum ms |", "|---" * 11 + "|"]
        heads = sorted({int(c.rstrip("s")) for c in configs})
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
        config(ctx, f"{type(ctx).head_dispatches}s")
    env.close()
    return lines


def decode(small: bool, configs, rounds: int) -> list:
    import bench_decode as bd
    import gpudelegate

    cfg = bd.model_config(small)
    wl = bd.Workload(cfg, small)
    model, packed = bd.random_model(cfg)
    progs, _ = bd.export_programs(model, cfg, packed, weights=("q4_1",))
    env = gpudelegate.Environment(device_options={"dawn": {"toggles": TOGGLES}})
    got = {c: [] for c in configs}
    ids = set()
    with env.session(progs["q4_1"], device="dawn") as s:
        ctx = s.executor.device
        for _ in range(rounds):
            for c in configs:
                config(ctx, c)
                r = bd.time_generate(s, wl, [None, 0, 2])
                got[c].append(r["tok_s"])
                ids.add(tuple(r["ids"]))
                if not r["same_ids"]:
                    raise SystemExit(f"decode {c}: the lookaheads gave different ids")
    env.close()
    if len(ids) != 1:
        raise SystemExit("decode: the configs gave different ids")
    lines = ["## SmolLM2 q4_1 greedy decode on Dawn, tok/s (median of rounds; each round's)", "",
             "| config | host pick | GPU pick | 2 ahead |", "|---|---|---|---|"]
    for c in configs:
        cells = [f"{statistics.median(r[k] for r in got[c]):.0f} ({' / '.join(f'{r[k]:.0f}' for r in got[c])})"
                 for k in ("host", 0, 2)]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true")
    p.add_argument("--configs", default="0,16,0s,16s")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--warm", type=float, default=3.0, help="seconds of runs before timing (the GPU's clock)")
    p.add_argument("--device-toggles", default="", help="';'-separated sets of ','-separated Dawn device toggles")
    p.add_argument("--decode", action="store_true", help="also SmolLM2 q4_1 greedy decode under each config")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    prog, inputs = export_minilm(a.small)
    configs = a.configs.split(",")
    lines = []
    for group in a.device_toggles.split(";"):
        toggles = [t for t in group.split(",") if t]
        got = probe(prog, inputs, toggles, configs, a.rounds, a.runs, a.warm) + [""]
        print("\n".join(got), flush=True)
        lines += got
    if a.decode:
        got = decode(a.small, configs, a.rounds)
        print("\n".join(got), flush=True)
        lines += got
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "probe_dawn_latency.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
