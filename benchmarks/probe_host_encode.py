"""Host time per dispatch of the desktop WebGPU run path (wgpu-native or Dawn) on a SmolLM2-shaped
decode step, against a bare loop of the same raw pass calls.

    python benchmarks/probe_host_encode.py [--device wgpu|dawn] [--layers 30] [--steps 200] [--profile]

Builds our SmolLM2 module with small seeded random weights (SmolLM2-135M's 30 layers and layout,
hidden 128, GGUF mix: Q4_1 linears, a Q8_0 tied embedding; ``bench_decode.random_model``), exports
its decode method once (cached under ``.cache/probe_host_encode/``), and per decode step reports:

- ``dispatches``: the launches of the recorded chain;
- ``run()``: host seconds inside ``Session.run`` (KV cache kept on the device, nothing read back:
  input writes, copies, submit, and the next step's chain encoded ahead), with the GPU idle when
  it starts (a fence after each step: on lavapipe the "GPU" is CPU threads, whose work would
  otherwise land inside the host timings); ``executor.run()`` the same without the session layer;
- ``encode``: the adapter's ``_encode`` of the chain into a fresh command encoder, plus ``finish``
  (nothing submitted);
- ``bare``: the same pipelines and bind groups through the raw ``SetPipeline / SetBindGroup /
  DispatchWorkgroups`` cffi calls in the tightest Python loop over prepared handles, plus the
  pass begin/end and finish;
- ``wait``: the read-back of the argmax's logits after the step (not host work; lavapipe computes).

``--profile`` adds a cProfile of the timed ``Session.run`` calls (top functions by own time).
Dawn on lavapipe needs Mesa 25: ``VK_DRIVER_FILES=/tmp/mesa25/lvp25.json XDG_RUNTIME_DIR=/tmp/xdg``.
The numbers are the host cost per dispatch on this CPU; lavapipe says nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def import_from(src: Path) -> None:
    """Import gpudelegate from the source tree ``src`` instead of the installed one (an A/B of
    two checkouts in alternated processes)."""
    import importlib.util

    layout = {"gpudelegate": "core", "gpudelegate.native": "native", "gpudelegate.shaders": "shaders",
              "gpudelegate.web": "web", "gpudelegate.export": "export"}
    for name, folder in layout.items():
        spec = importlib.util.spec_from_file_location(name, src / folder / "__init__.py",
                                                      submodule_search_locations=[str(src / folder)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)


def build_program(layers: int, cache_dir: Path):
    """The decode method of a small SmolLM2 (GGUF-mix weights), exported once and cached."""
    from gpudelegate.program import load

    path = cache_dir / f"smollm2_decode_l{layers}.gdp"
    if path.exists():
        return load(path), _cfg(layers)
    import torch

    from bench_decode import random_model
    from gpudelegate.export.frontend import export_method
    from gpudelegate.export.models import smollm2
    from gpudelegate.export.writer import export_program

    cfg = _cfg(layers)
    model, packed = random_model(cfg)
    names = smollm2.cache_names(cfg)
    with torch.no_grad():
        methods = {"decode": export_method(smollm2.Decode(model), smollm2.example_inputs(cfg, "decode"))}
        prog = export_program(methods, weights_dtype="float32", packed_weights=packed, progress=False,
                              input_names={"decode": ["ids", "pos", *names]},
                              output_names={"decode": ["logits", *names]})
    cache_dir.mkdir(parents=True, exist_ok=True)
    prog.save(path)
    return prog, cfg


def _cfg(layers: int):
    from gpudelegate.export.models import smollm2

    return smollm2.SmolLM2Config(vocab_size=1024, hidden=128, intermediate=256, layers=layers, heads=2, kv_heads=1,
                                 head_dim=64, max_context=512, prefill_chunk=16)


def bare_loop(ctx, chain, reps: int) -> list:
    """Seconds per encode of the chain's launches through the raw pass calls, prepared handles."""
    raw = ctx.raw_calls
    if raw is None:
        return []
    set_pipe, set_bg, dispatch, null = raw
    items = [(L.pipeline._internal, L.bind_group._internal, *L.workgroups)
             for s in chain.steps for L in s.launches]
    best = []
    for _ in range(reps):
        enc = ctx.device.create_command_encoder()
        t = time.perf_counter()
        cp = enc.begin_compute_pass()
        h = cp._internal
        for p, bg, x, y, z in items:
            set_pipe(h, p)
            set_bg(h, 0, bg, 0, null)
            dispatch(h, x, y, z)
        cp.end()
        enc.finish()
        best.append(time.perf_counter() - t)
    return best


def encode_only(ctx, chain, reps: int) -> list:
    out = []
    for _ in range(reps):
        enc = ctx.device.create_command_encoder()
        t = time.perf_counter()
        ctx.encode_chain(chain, enc)
        enc.finish()
        out.append(time.perf_counter() - t)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="wgpu", choices=("wgpu", "dawn"))
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M: 30)")
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps (after 5 warm-up steps)")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed Session.run calls")
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "probe_host_encode"), help="where the program is cached")
    ap.add_argument("--src", default=None, help="import gpudelegate from this source tree (A/B of two checkouts)")
    args = ap.parse_args(argv)
    if args.src:
        import_from(Path(args.src).resolve())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import gpudelegate

    prog, cfg = build_program(args.layers, Path(args.cache))
    env = gpudelegate.Environment()
    s = env.session(prog, device=args.device)
    ex = s.executor
    ctx = ex.device
    pid = prog.methods["decode"].nodes[0].attrs["payload"]
    rec = ex.recorded[pid]
    nd = sum(len(n.launches) for n in rec.nodes)
    shape = (1, cfg.kv_heads, cfg.max_context, cfg.head_dim)
    caches = [np.zeros(shape, np.float32) for _ in range(2 * cfg.layers)]
    tok = 7
    run_t, wait_t, exrun_t = [], [], []
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    inner = ex.run

    def timed_run(*a, **k):  # the executor's share of Session.run
        t0 = time.perf_counter()
        r = inner(*a, **k)
        exrun_t.append(time.perf_counter() - t0)
        return r

    ex.run = timed_run
    ahead_t = []
    inner_ahead = getattr(ctx, "_encode_ahead", None)

    def timed_ahead(*a, **k):  # the next step encoded after the submit (overlaps lavapipe's work)
        t0 = time.perf_counter()
        inner_ahead(*a, **k)
        ahead_t.append(time.perf_counter() - t0)

    if inner_ahead is not None:
        ctx._encode_ahead = timed_ahead
    pos = 0
    for i in range(args.steps + 5):
        ids, p = np.array([[tok]], np.int32), np.array([pos % cfg.max_context], np.int32)
        pos += 1
        ctx.fence()
        if prof is not None and i >= 5:
            prof.enable()
        t = time.perf_counter()
        out = s.run("decode", [ids, p, *caches], keep_on_device=True)
        dt = time.perf_counter() - t
        if prof is not None:
            prof.disable()
        t = time.perf_counter()
        tok = int(np.argmax(out[0].numpy())) % cfg.vocab_size
        wt = time.perf_counter() - t
        caches = out[1:]
        if i < 5:
            exrun_t.clear()
            ahead_t.clear()
        else:
            run_t.append(dt)
            wait_t.append(wt)
    ex.run = inner
    if inner_ahead is not None:
        del ctx._encode_ahead
    ctx.fence()
    reps = min(args.steps, 100)
    enc = encode_only(ctx, rec.chain, reps)
    bare = bare_loop(ctx, rec.chain, reps)
    ctx.fence()
    med = statistics.median
    before = [r - a for r, a in zip(exrun_t, ahead_t)] if len(ahead_t) == len(exrun_t) else []
    import gpudelegate.webgpu.executor as wx

    print(f"device: {ctx.info()['device']} ({args.device}); {cfg.layers} layers; {nd} dispatches per decode step; "
          f"{args.steps} steps; gpudelegate from {Path(wx.__file__).parent.parent.parent}")
    rows = [("Session.run (host)", run_t), ("executor.run (host)", exrun_t),
            ("  of it: encode ahead", ahead_t), ("  of it: all but encode ahead", before),
            ("encode chain + finish (idle)", enc), ("bare raw-call loop + finish", bare)]
    print(f"  {'':34s} {'median':>8s} {'min':>8s} ms/step   median us/dispatch")
    for name, v in rows:
        if not v:
            continue
        m, lo = med(v), min(v)
        print(f"  {name:34s} {m * 1e3:8.3f} {lo * 1e3:8.3f}           {m / nd * 1e6:7.2f}")
    print(f"  {'read-back wait (not host)':30s} {med(wait_t) * 1e3:8.3f} ms/step")
    if prof is not None:
        import pstats

        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(18)
    s.close()
    env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
