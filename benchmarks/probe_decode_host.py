"""Why does the host time of a WebGPU decode step swing between processes? A probe.

bench_decode.py measured wgpu-native SmolLM2 decode at 140-159 tok/s with 3.4-4.6 ms of host time
per ``session.run`` step, where bench_dawn.py's process measured 1.5 ms and 422 tok/s minutes
earlier on the same machine (docs/NOTES.md). The two processes differ in what ran before the
WebGPU rows: bench_decode runs PyTorch eager on CUDA and our CUDA executor with CUDA graphs
first. This probe runs the same wgpu (and Dawn) decode in one process before and after each of
those, on the same program, and prints host ms/step, tok/s and the top of a cProfile of 16 steps
for each phase, so the phase that slows the host shows, and where the time goes.

    python benchmarks/probe_decode_host.py [--small] [--out DIR]

The ``cudahost`` step asks the same of CUDA greedy decode looking two steps ahead (issue 16):
whether the host's side of a token (a run, its pick, the read of an older pick) or a wait on the
GPU bounds it, what a pageable input copy does while steps are queued, what each operation a token
enqueues costs on the GPU's timeline (``_gpu_chains``) and how the decode graph's own step time
changes with what runs between its replays (``_graph_contexts``):

    python benchmarks/probe_decode_host.py --steps cudahost --weights q4_1 --program /tmp/q41.gdp

The ``dawnhost`` / ``wgpuhost`` steps ask it of WebGPU greedy decode two steps ahead: per token the
host time of each call (the session's run, the executor's, the encode ahead, the queue's submits
and writes, the argmax's submit, the index read's wait) and the generator's own Python
(``webgpu_host_probe``):

    python benchmarks/probe_decode_host.py --steps dawnhost --weights q4_1 --program /tmp/q41.gdp

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
from typing import Tuple

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


def _median(xs) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _timed_generate(s, prompt, tokens: int, lookahead, stream, cp):
    """gpudelegate.llm.generate's loop (the same generator, driven the same way) with the wall
    time of each call by kind (decode run, argmax_device, index_value) and a CUDA timing event
    after each decode step's submission: the GPU's period per token."""
    from gpudelegate import llm
    from gpudelegate.text.ids import IdsTokenizer

    steps = llm.generation_steps(llm._layout(s), IdsTokenizer(), prompt, tokens, 0.0, None, None, None, (), lookahead)
    ex = s.executor
    calls = {"run": [], "argmax_device": [], "index_value": []}
    marks = []
    pc = time.perf_counter
    t_all = pc()
    try:
        op, arg = next(steps)
        while True:
            t = pc()
            if op == llm.ARGMAX:
                got = ex.argmax_device(arg)
                calls["argmax_device"].append(pc() - t)
            elif op == llm.READ:
                got = ex.index_value(arg)
                calls["index_value"].append(pc() - t)
            else:
                got = s.run(op, arg, keep_on_device=True)
                calls["run"].append(pc() - t)
                if op == "decode":
                    e = cp.cuda.Event()
                    e.record(stream)
                    marks.append(e)
            op, arg = steps.send(got)
    except StopIteration as stop:
        r = stop.value
    wall = pc() - t_all
    if marks:  # none in a 1-token generation (its token comes from the prefill)
        marks[-1].synchronize()
    periods = [cp.cuda.get_elapsed_time(a, b) for a, b in zip(marks, marks[1:])]
    return r, wall, calls, periods


def _gpu_chains(ex, pid: int, cp, start: int, n: int = 64) -> list:
    """The GPU side of ``n`` greedy tokens queued back to back by hand (the host far ahead, so the
    GPU never waits for it), from position ``start``: chains of the per-token operations a greedy
    step two ahead enqueues (the ids copy device to device, the pos copy from pinned memory, the
    decode graph, the argmax kernel, the pick's copy to pinned memory and its event, run()'s
    event joins with the caller's stream), each chain timed with events at its ends only; the
    whole chain again with events between the operations. Returns lines."""
    st, pp, stream = ex._states[pid], ex.plan.payloads[pid], ex.stream
    ins = {(r.dtype, tuple(r.shape)): v for r, v in zip(pp.inputs, st.inputs)}
    ids_v, pos_v, logits = ins[("int32", (1, 1))], ins[("int32", (1,))], st.outputs[0]
    pos_mem, pick_mem = cp.cuda.alloc_pinned_memory(4 * n), cp.cuda.alloc_pinned_memory(4 * n)
    pos_w = np.frombuffer(pos_mem, np.int32, n)
    idx = cp.zeros((1, 1), cp.int32)
    mc, argmax = cp.cuda.runtime.memcpyAsync, ex.kernels.argmax
    caller = cp.cuda.Stream.null  # generate's current stream: run() orders ours after it and it after ours
    ev_in, ev_out, ev_pick = (cp.cuda.Event(disable_timing=True) for _ in range(3))

    def hop(ev, a, b):
        ev.record(a)
        b.wait_event(ev)

    pick_dev = int(cp.cuda.runtime.pointerGetAttributes(pick_mem.ptr).devicePointer or 0)
    # one thread writing both inputs (ids from the pick's device word, pos from a kernel argument):
    # what folding the two copies into one launch would cost
    feed = cp.RawKernel(r"""extern "C" __global__ void feed(int* ids, const int* pick, int* pos, int p) {
        ids[0] = pick[0]; pos[0] = p; }""", "feed")
    with ex.context.device, stream:  # compiled outside the timings
        feed((1,), (1,), (ids_v, idx, pos_v, np.int32(start)))
        argmax.launch(logits, idx)
    ops = {"caller wait": lambda i: hop(ev_in, caller, stream),
           "caller joins": lambda i: hop(ev_out, stream, caller),
           "pick event": lambda i: ev_pick.record(stream),
           "ids D2D": lambda i: mc(ids_v.data.ptr, idx.data.ptr, 4, 3, stream.ptr),
           "pos H2D": lambda i: mc(pos_v.data.ptr, pos_mem.ptr + 4 * i, 4, 1, stream.ptr),
           "feed kernel": lambda i: feed((1,), (1,), (ids_v, idx, pos_v, np.int32(start + i))),
           "graph": lambda i: st.graph.launch(stream),
           "argmax": lambda i: argmax.launch(logits, idx),
           "argmax to host": lambda i: argmax.launch(logits, idx, pick_dev + 4 * i),
           "pick D2H": lambda i: mc(pick_mem.ptr + 4 * i, idx.data.ptr, 4, 2, stream.ptr)}
    chains = [["pos H2D", "graph"], ["pos H2D", "graph", "argmax"], ["pos H2D", "graph", "argmax", "pick D2H"],
              ["ids D2D", "pos H2D", "graph", "argmax", "pick D2H"],
              ["caller wait", "ids D2D", "pos H2D", "graph", "argmax", "pick D2H"],
              ["ids D2D", "pos H2D", "graph", "caller joins", "argmax", "pick D2H"],
              # the executor before issue 16's join and copy cuts: all a token enqueued in generate
              ["caller wait", "ids D2D", "pos H2D", "graph", "caller joins", "argmax", "pick D2H", "pick event"],
              # after them: no inbound join, the pick stored to the host word by the argmax kernel
              ["ids D2D", "pos H2D", "graph", "caller joins", "argmax to host", "pick event"],
              ["feed kernel", "graph", "caller joins", "argmax to host", "pick event"],
              ["feed kernel", "graph", "argmax to host", "pick event"]]
    if not pick_dev:
        chains = [c for c in chains if "argmax to host" not in c]
    lines = []
    for k, chain in enumerate(chains + [chains[-4], chains[-3]]):
        between = k >= len(chains)
        pos_w[:] = np.arange(start, start + n)
        with ex.context.device, stream:  # the kernels (argmax, feed) launch on the current stream
            stream.synchronize()
            e0 = cp.cuda.Event()
            e0.record(stream)
            marks = []
            for i in range(n):
                for name in chain:
                    ops[name](i)
                    if between:
                        e = cp.cuda.Event()
                        e.record(stream)
                        marks.append((name, e))
            e1 = cp.cuda.Event()
            e1.record(stream)
            e1.synchronize()
        per = cp.cuda.get_elapsed_time(e0, e1) / n * 1e3
        text = f"GPU chain of {n} tokens from position {start}, {' > '.join(chain)}: {per:.1f} us a token"
        if between:
            seg, prev = {}, e0
            for name, e in marks:
                seg.setdefault(name, []).append(cp.cuda.get_elapsed_time(prev, e) * 1e3)
                prev = e
            text += " (events between the operations; median us each: " + ", ".join(
                f"{name} {_median(v):.1f}" for name, v in seg.items()) + ")"
        lines.append(text)
    return lines


def _graph_contexts(ex, pid: int, cp, start: int, n: int = 64) -> list:
    """The decode graph alone is ~100 us a step faster replayed back to back at one position than
    in any chain of tokens (``_gpu_chains``). Which difference costs it: ``n`` replays back to back
    at a fixed position (start, start + n - 2, then start again: a drift of the clocks shows), with
    the pos word rewritten between replays with the same value or with the next position, and with
    an empty kernel between replays. Returns lines."""
    st, pp, stream = ex._states[pid], ex.plan.payloads[pid], ex.stream
    ins = {(r.dtype, tuple(r.shape)): v for r, v in zip(pp.inputs, st.inputs)}
    pos_v = ins[("int32", (1,))]
    pos_mem = cp.cuda.alloc_pinned_memory(4 * n)
    pos_w = np.frombuffer(pos_mem, np.int32, n)
    nop = cp.RawKernel('extern "C" __global__ void nop() {}', "nop")
    mc = cp.cuda.runtime.memcpyAsync

    def timed(first: int, between, vary: bool) -> float:
        pos_w[:] = np.arange(first, first + n) if vary else first
        with ex.context.device, stream:
            mc(pos_v.data.ptr, pos_mem.ptr, 4, 1, stream.ptr)
            stream.synchronize()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            for i in range(n):
                if between is not None:
                    between(i)
                st.graph.launch(stream)
            e1.record(stream)
            e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) / n * 1e3

    def pos_copy(i):
        mc(pos_v.data.ptr, pos_mem.ptr + 4 * i, 4, 1, stream.ptr)

    with ex.context.device, stream:
        nop((1,), (1,), ())  # compiled outside the timings
    cases = [("graph alone, fixed position", start, None, False),
             ("graph alone, fixed position", start + n - 2, None, False),
             ("pos H2D (same value) > graph", start, pos_copy, False),
             ("pos H2D (next position) > graph", start, pos_copy, True),
             ("empty kernel > graph, fixed position", start, lambda i: nop((1,), (1,), ()), False),
             ("graph alone, fixed position", start, None, False)]
    return [f"graph context, {n} steps, {what} from {first}: {timed(first, between, vary):.1f} us a step"
            for what, first, between, vary in cases]


def cuda_host_probe(env, prog, wl, label: str, tokens: int = 64) -> Tuple[str, list]:
    """Where a CUDA greedy decode's time per token goes (graphs on): the decode graph's replay
    alone; the host time of a 4-byte host-to-device copy from pageable and from pinned memory
    while decode steps are queued (a pageable copy that waits shows as ~ms and an idle stream
    after it); then, per executor setting (pinned input staging on / off where the tree has it),
    llm.generate's tok/s (64 steps, wall less a 1-token generate's, median of 3) for lookahead
    host and 2, the wall time of each call kind and the GPU's period per token; the GPU side of a
    token without the host (``_gpu_chains``); and a cProfile of one generation two ahead.
    Returns (report text, table rows)."""
    import cupy as cp

    from gpudelegate.llm import generate
    from gpudelegate.text.ids import IdsTokenizer

    tok = IdsTokenizer()
    prompt = [int(x) for x in wl.prompt.reshape(-1)]
    out, rows = [], []

    def say(line: str) -> None:  # printed as it comes too: a later failure keeps what was measured
        print(line, flush=True)
        out.append(line)

    say(f"## {label}: CUDA greedy decode, host side per token")
    s = env.session(prog, device="cuda", capture_graph=True)
    try:
        ex = s.executor
        stream = ex.stream
        generate(s, tok, prompt, max_new_tokens=4, stop_ids=(), lookahead=2)  # warm-up: graphs captured
        st = ex._states[prog.methods["decode"].nodes[0].attrs["payload"]]
        with ex.context.device:
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            stream.synchronize()
            e0.record(stream)
            for _ in range(100):
                st.graph.launch(stream)
            e1.record(stream)
            e1.synchronize()
            step_ms = cp.cuda.get_elapsed_time(e0, e1) / 100
            say(f"decode graph replayed alone: {step_ms * 1e3:.1f} us a step (100 back to back)")
            rows.append(("graph step alone", f"{step_ms * 1e3:.1f} us", ""))
            dst = cp.zeros(1, cp.int32)
            page = np.zeros(1, np.int32)
            pin_mem = cp.cuda.alloc_pinned_memory(4)
            for kind, src in (("pageable", page.ctypes.data), ("pinned", pin_mem.ptr)):
                ts, idle = [], 0
                for _ in range(7):
                    stream.synchronize()
                    for _ in range(4):
                        st.graph.launch(stream)
                    t = time.perf_counter()
                    cp.cuda.runtime.memcpyAsync(dst.data.ptr, src, 4, 1, stream.ptr)
                    ts.append(time.perf_counter() - t)
                    idle += bool(stream.done)
                stream.synchronize()
                say(f"{kind} 4-byte H2D memcpyAsync with 4 steps queued: median {_median(ts) * 1e6:.1f} us "
                    f"(max {max(ts) * 1e6:.1f}); stream idle right after: {idle}/7")
                rows.append((f"{kind} 4-byte copy, GPU busy", f"{_median(ts) * 1e6:.1f} us", f"stream idle after {idle}/7"))
        settings = [True, False] if hasattr(type(ex), "stage_host_inputs") else [None]
        for stage in settings:
            if stage is not None:
                ex.stage_host_inputs = stage
            name = {True: "pinned inputs", False: "pageable inputs", None: "this tree"}[stage]
            for la in (None, 2):
                first = _median([_timed_generate(s, prompt, 1, la, stream, cp)[1] for _ in range(3)])
                runs = [_timed_generate(s, prompt, tokens + 1, la, stream, cp) for _ in range(3)]
                walls = [w for _, w, _, _ in runs]
                tps = tokens / max(_median(walls) - first, 1e-9)
                r, _, calls, periods = runs[walls.index(_median(walls))]
                per = {k: (_median(v) * 1e6, sum(v) / max(len(r.ids) - 1, 1) * 1e6) for k, v in calls.items() if v}
                gpu = _median(periods[2:]) * 1e3 if len(periods) > 3 else float("nan")
                la_s = "host" if la is None else la
                say(f"{name}, lookahead {la_s}: {tps:.0f} tok/s; GPU period per token (median) {gpu:.1f} us "
                    f"vs graph alone {step_ms * 1e3:.1f}; per call median / per token us: "
                    + ", ".join(f"{k} {a:.1f} / {b:.1f}" for k, (a, b) in per.items()))
                rows.append((f"{name}, lookahead {la_s}", f"{tps:.0f} tok/s",
                             f"GPU period {gpu:.0f} us; " + ", ".join(f"{k} {b:.0f}" for k, (_, b) in per.items())
                             + " us/token"))
        if settings[0] is not None:
            ex.stage_host_inputs = True
        try:
            for line in _gpu_chains(ex, prog.methods["decode"].nodes[0].attrs["payload"], cp, len(prompt), tokens):
                say(line)
        except Exception as e:  # a tree whose executor keeps these parts elsewhere: said, the rest still runs
            say(f"GPU chains not timed: {type(e).__name__}: {e}")
        try:
            for line in _graph_contexts(ex, prog.methods["decode"].nodes[0].attrs["payload"], cp, len(prompt), tokens):
                say(line)
        except Exception as e:
            say(f"graph contexts not timed: {type(e).__name__}: {e}")
        prof = cProfile.Profile()
        prof.enable()
        generate(s, tok, prompt, max_new_tokens=tokens, stop_ids=(), lookahead=2)
        prof.disable()
        buf = io.StringIO()
        ps = pstats.Stats(prof, stream=buf)
        ps.sort_stats("tottime").print_stats(28)
        ps.sort_stats("cumulative").print_stats(24)
        say(f"cProfile of generate, lookahead 2, {tokens} tokens:\n" + buf.getvalue())
    finally:
        s.close()
    return "\n".join(out) + "\n", rows


class _Timed:
    """Wall time of each call of a wrapped callable, by name, into ``acc`` (lists of seconds),
    while ``gate["on"]`` (the decode steps: the prefill's calls are left out)."""

    def __init__(self, acc: dict, name: str, fn, gate: dict):
        self.acc, self.fn, self.gate = acc.setdefault(name, []), fn, gate

    def __call__(self, *a, **k):
        if not self.gate["on"]:
            return self.fn(*a, **k)
        t = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.acc.append(time.perf_counter() - t)


class _TimedQueue:
    """A device's queue whose ``submit`` (Dawn records the Vulkan commands there) is timed."""

    def __init__(self, queue, acc: dict, gate: dict):
        self._queue, self.submit = queue, _Timed(acc, "queue.submit", queue.submit, gate)

    def __getattr__(self, name):
        return getattr(self._queue, name)


# The phases of a WebGPU greedy token, outermost first: (name, object kind, attribute). "ctx"
# names the device context's methods (native/wgpu_device.py), "ex" the executor's, "s" the session's.
_WEBGPU_PHASES = (("session.run", "s", "run"), ("executor.run", "ex", "run"), ("executor._io", "ex", "_io"),
                  ("argmax_device", "ex", "argmax_device"), ("index_value", "ex", "index_value"),
                  ("ctx._run_buffers", "ctx", "_run_buffers"), ("ctx.write_buffer", "ctx", "write_buffer"),
                  ("ctx._encode_ahead", "ctx", "_encode_ahead"), ("ctx.read_submitted", "ctx", "read_submitted"))


def _decode_loop(s, steps, gate: dict) -> Tuple[object, float]:
    """llm.generate's loop over ``steps`` (llm.generation_steps), with ``gate["on"]`` set from
    the first decode step on; returns the result and the loop's wall time from that step."""
    from gpudelegate import llm

    ex = s.executor
    t0 = None
    try:
        op, arg = next(steps)
        while True:
            if op == "decode" and t0 is None:
                gate["on"], t0 = True, time.perf_counter()
            if op == llm.ARGMAX:
                got = ex.argmax_device(arg)
            elif op == llm.READ:
                got = ex.index_value(arg)
            else:
                got = s.run(op, arg, keep_on_device=True)
            op, arg = steps.send(got)
    except StopIteration as stop:
        gate["on"] = False
        return stop.value, time.perf_counter() - (t0 or time.perf_counter())


def webgpu_host_probe(env, prog, device: str, wl, label: str, tokens: int = 64, rounds: int = 3) -> Tuple[str, list]:
    """Where a WebGPU greedy token's host time goes, two steps ahead (issue 16, Dawn q4 >= 1,000
    tok/s): llm.generate's loop (``_decode_loop``) with every call of the decode steps timed
    (``_WEBGPU_PHASES`` and the queue's submit, wrapped on this session's objects only; the
    prefill's calls left out: its 60 zero caches go through write_buffer, ~12 MB), per token the
    median of ``rounds`` generations; the generator's Python is the decode loop's wall less the
    calls. The wait in ``read_submitted`` is where the host waits for the GPU: ~0 means the host
    bounds the token; "host time" is the loop's wall less that wait. From the cProfile, where its
    C calls show (wgpudawn's; wgpu-native's cffi calls count in their callers): the library's
    submit time a token and its DispatchWorkgroups a dispatch, which gauges the host's speed, so
    processes of one call compare (their host time swings by up to 2x). Before that the same generations unwrapped (tok/s), after it a cProfile of
    one (prefill included). Returns (text, rows)."""
    from gpudelegate import llm
    from gpudelegate.text.ids import IdsTokenizer

    tok = IdsTokenizer()
    prompt = [int(x) for x in wl.prompt.reshape(-1)]
    out, rows = [f"## {label}: {device} greedy decode two ahead, host time per token"], []
    s = env.session(prog, device=device)
    try:
        ex = s.executor
        ctx = ex.device
        llm.generate(s, tok, prompt, max_new_tokens=8, stop_ids=(), lookahead=2)  # warm-up
        plain = []
        for _ in range(rounds):
            t = time.perf_counter()
            r = llm.generate(s, tok, prompt, max_new_tokens=tokens, stop_ids=(), lookahead=2)
            plain.append((time.perf_counter() - t, r.decode_seconds / max(1, r.decode_steps)))
        per_tok = _median([d for _, d in plain])
        rows.append(("tok/s two ahead (decode_seconds)", f"{1 / per_tok:.0f}", f"{per_tok * 1e3:.3f} ms a token"))
        objs = {"s": s, "ex": ex, "ctx": ctx}
        per_round = []
        for _ in range(rounds):
            acc: dict = {}
            gate = {"on": False}
            for name, kind, attr in _WEBGPU_PHASES:
                setattr(objs[kind], attr, _Timed(acc, name, getattr(objs[kind], attr), gate))
            queue = ctx.queue
            ctx.queue = _TimedQueue(queue, acc, gate)
            try:
                steps = llm.generation_steps(llm._layout(s), tok, prompt, tokens, stop_ids=(), lookahead=2)
                r, wall = _decode_loop(s, steps, gate)
            finally:
                ctx.queue = queue
                for _, kind, attr in _WEBGPU_PHASES:
                    delattr(objs[kind], attr)  # the instance attribute goes: the class's method again
            n = max(1, r.decode_steps)
            calls = sum(sum(acc.get(k, [])) for k in ("session.run", "argmax_device", "index_value"))
            got = {k: sum(v) / n for k, v in acc.items()}
            got["calls per token: queue.submit"] = len(acc.get("queue.submit", [])) / n
            got["generator's Python (loop wall less calls)"] = (wall - calls) / n
            got["decode loop wall"] = wall / n
            # The host's own time: what the loop spent not waiting for the GPU.
            got["host time (loop wall less the index read's wait)"] = (wall - sum(acc.get("index_value", []))) / n
            per_round.append(got)
        for k in sorted({k for g in per_round for k in g}, key=lambda k: -_median([g.get(k, 0) for g in per_round])):
            v = _median([g.get(k, 0.0) for g in per_round])
            shown = f"{v:.2f}" if k.startswith("calls") else f"{v * 1e3:.3f} ms"
            out.append(f"- {k}: {shown} a token")
            rows.append((k, shown, "median of rounds"))
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(s, tok, prompt, max_new_tokens=tokens, stop_ids=(), lookahead=2)
        prof.disable()
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        # The library's own C time, which the host's speed moves from process to process: a
        # dispatch's encode call gauges that speed, so submits compare across processes.
        c_time = {}
        for (_, _, name), (_, ncalls, tottime, _, _) in stats.stats.items():
            fn = name.rstrip(">}").split(".")[-1].split(" ")[-1]  # "<built-in method mod.fn>" -> fn
            call = "QueueSubmit" if fn.startswith("wgpuQueueSubmit") else \
                "DispatchWorkgroups" if fn == "wgpuComputePassEncoderDispatchWorkgroups" else None
            if call is not None:  # (QueueSubmit: wgpu-native's ForIndex too)
                got_n, got_t = c_time.get(call, (0, 0.0))
                c_time[call] = (got_n + ncalls, got_t + tottime)
        if "DispatchWorkgroups" in c_time:
            n, t = c_time["DispatchWorkgroups"]
            rows.append(("cProfile: the library's DispatchWorkgroups a dispatch (the host's speed)",
                         f"{t / max(1, n) * 1e6:.2f} us", f"{n} calls"))
        if "QueueSubmit" in c_time:
            n, t = c_time["QueueSubmit"]
            rows.append(("cProfile: the library's QueueSubmit a token (the prefill's in the generation's)",
                         f"{t / tokens * 1e3:.3f} ms", f"{n} calls in a generation of {tokens} tokens"))
        stats.sort_stats("tottime").print_stats(22)
        out.append(buf.getvalue())
    finally:
        s.close()
    return "\n".join(out), rows


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
                        "cuda (our CUDA graphs decode), dawnhost / wgpuhost (where a WebGPU greedy token's host time "
                        "goes two steps ahead: webgpu_host_probe), cudahost (where a CUDA greedy decode's time per "
                        "token goes: cuda_host_probe), torch (PyTorch eager decode), freeze (gc.freeze()), "
                        "new (close the Environment, make another)")
    p.add_argument("--profile", action="store_true", help="a cProfile of 16 steps after each measured decode")
    p.add_argument("--weights", default="float32", help="programs to run, comma-separated: float32, float16, q4_1")
    p.add_argument("--gpu-ops", action="store_true", help="after each measured decode, its GPU time by op")
    p.add_argument("--generate-profile", type=int, default=None, metavar="LOOKAHEAD",
                   help="after each measured decode, a cProfile of llm.generate with this many steps ahead")
    p.add_argument("--program", default=None, metavar="PATH",
                   help="one weights kind only: load its program from PATH when the file exists, else export "
                        "and save it there (another tree's probe run then skips the export)")
    a = p.parse_args(argv)
    import gpudelegate

    cfg = bd.model_config(a.small)
    wl = bd.Workload(cfg, a.small)
    if a.program and "," in a.weights:
        p.error("--program takes one --weights kind")
    model = None
    if a.program and Path(a.program).exists():
        progs = {a.weights: gpudelegate.load(a.program)}
    else:
        model, packed = bd.random_model(cfg)
        progs, _ = bd.export_programs(model, cfg, packed, weights=tuple(a.weights.split(",")))
        if a.program:
            progs[a.weights].save(a.program)
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
        elif step in ("dawnhost", "wgpuhost"):
            for wd, prog in progs.items():
                text, table = webgpu_host_probe(env, prog, step[:-4], wl, f"{label} ({wd})", tokens=8 if a.small else 64)
                print(text, flush=True)
                profiles.append(text)
                rows.extend((f"{label} ({wd}): {what}", step[:-4], value, "", note) for what, value, note in table)
        elif step == "cudahost":
            cp, why = bd._cuda()
            if cp is None:
                rows.append((label, step, "skipped", "", why[:80]))
            for wd, prog in (progs.items() if cp is not None else ()):
                text, table = cuda_host_probe(env, prog, wl, f"{label} ({wd})", tokens=8 if a.small else 64)
                profiles.append(text)
                rows.extend((f"{label} ({wd}): {what}", "cuda", value, "", note) for what, value, note in table)
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

                if model is None:
                    model, _ = bd.random_model(cfg)
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
