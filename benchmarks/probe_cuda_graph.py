"""What one captured decode step launches on CUDA, and what each launch costs inside a graph.

    python benchmarks/probe_cuda_graph.py [--weights q4_1] [--out DIR] [--no-groups]
    python benchmarks/probe_cuda_graph.py --positions 0,64,128,192,250 [--rounds 4]
    python benchmarks/probe_cuda_graph.py --timeline

SmolLM2-135M with bench_decode's seeded weights, a 128-token prompt, then decode steps with
``capture_graph=True``. Three measurements of the decode payload:

1. **census**: the step's chain captured once more through the CUDA driver API (ctypes on
   libcuda; CuPy does not expose a graph's nodes): the nodes by type and every kernel node's
   function name and grid, i.e. what the graph really launches (a bound step that launches
   nothing, such as a no-op reshape, shows up as a step with no node);
2. **step**: the executor's own graph replayed back to back, GPU time per replay (events);
3. **per step**: each bound step (a dispatch or a fused group) captured alone REP times in a row
   into one graph and replayed: its in-graph GPU time, summed by the kernels it launches, next
   to the floor of an empty kernel in a graph measured the same way.

Also the greedy pick on the device (``CudaExecutor.argmax_device``): GPU and host time per call.
Prints one table; ``--out`` also gets probe_cuda_graph.json.

``--positions P,..``: whether a step's time depends on its position (the visible keys). Rounds
of the executor's graph replayed alone at each position in turn (interleaved, after a warm-up:
a round's order is the list's, so drift over time and a position's cost are told apart), the
attention's bound steps (sdpa_tile + sdpa_combine) each captured alone at each position, every
bound step alone at the first and last position (captured and timed one by one, with host
work between them: leads, not the step's split), and greedy ``llm.generate`` two steps ahead
over the same positions (its wall per token is the loop's period: the GPU bounds it there).

``--timeline``: where the step's time goes inside its graph. A second CUDA context in the same
process is made with the timeline switch on (native/cuda_pdl.py Timeline: every kernel of ours
stamps %globaltimer into its launch's record); its decode graph is replayed 40 times, each
replay's records reset before and copied out after it, and per kernel kind (step order) the
table gives the means of launch-to-wait, the wait's spread over the blocks, wait-to-end, the
hand-off from the launch before (its last block's end -> this one's first wait return) and the
overlap with it; the critical path (first wait -> last end) is the sum of every wait-to-end and
hand-off. The step in its graph with the stamps on and off, interleaved, says what they cost.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd  # noqa: E402  (imports gpudelegate from the tree when not installed)

import gpudelegate  # noqa: E402

REP = 20  # launches of one step inside its timing graph
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "ext_sem_signal", 9: "ext_sem_wait", 10: "mem_alloc", 11: "mem_free"}


class Driver:
    """The few CUDA driver calls the probe needs, through ctypes."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def _ok(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: CUresult {rc}")

    def capture(self, stream_ptr: int, fn) -> int:
        """A graph of what ``fn`` enqueues on the stream (relaxed capture mode)."""
        self._ok(self.lib.cuStreamBeginCapture_v2(ctypes.c_void_p(stream_ptr), ctypes.c_int(2)), "begin capture")
        err = None
        try:
            fn()
        except BaseException as e:  # the capture must end either way
            err = e
        g = ctypes.c_void_p()
        rc = self.lib.cuStreamEndCapture(ctypes.c_void_p(stream_ptr), ctypes.byref(g))
        if err is not None:
            raise err
        self._ok(rc, "end capture")
        return g.value

    def nodes(self, graph: int) -> list:
        n = ctypes.c_size_t(0)
        if not graph:
            return []
        rc = self.lib.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n))
        if rc != 0 and n.value == 0:
            return []  # the capture of a step that enqueues nothing (a no-op reshape)
        self._ok(rc, "graph nodes")
        arr = (ctypes.c_void_p * max(n.value, 1))()
        self._ok(self.lib.cuGraphGetNodes(ctypes.c_void_p(graph), arr, ctypes.byref(n)), "graph nodes")
        out = []
        for i in range(n.value):
            t = ctypes.c_int()
            self._ok(self.lib.cuGraphNodeGetType(ctypes.c_void_p(arr[i]), ctypes.byref(t)), "node type")
            kind = NODE_TYPES.get(t.value, str(t.value))
            rec = {"type": kind}
            if kind == "kernel":
                buf = (ctypes.c_ubyte * 256)()
                if self.lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(arr[i]), buf) == 0:
                    func = ctypes.c_void_p.from_buffer(buf, 0).value
                    dims = [ctypes.c_uint.from_buffer(buf, 8 + 4 * j).value for j in range(6)]
                    rec["grid"], rec["block"] = dims[:3], dims[3:]
                    name = ctypes.c_char_p()
                    if func and self.lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(func)) == 0:
                        rec["name"] = name.value.decode()
            out.append(rec)
        return out

    def instantiate(self, graph: int) -> int:
        e = ctypes.c_void_p()
        self._ok(self.lib.cuGraphInstantiateWithFlags(ctypes.byref(e), ctypes.c_void_p(graph), ctypes.c_ulonglong(0)),
                 "instantiate")
        return e.value

    def launch(self, gexec: int, stream_ptr: int) -> None:
        self._ok(self.lib.cuGraphLaunch(ctypes.c_void_p(gexec), ctypes.c_void_p(stream_ptr)), "graph launch")

    def destroy(self, graph: int, gexec: int = None) -> None:
        if gexec:
            self.lib.cuGraphExecDestroy(ctypes.c_void_p(gexec))
        self.lib.cuGraphDestroy(ctypes.c_void_p(graph))


def short_name(mangled: str) -> str:
    """The kernel's identifier and its template arguments' integers (qgemv<1,f,1,1,4,0> reads
    as qgemv/1.1.1.4.0): enough to tell the instantiations of one step apart."""
    m = re.match(r"_Z(\d+)", mangled or "")
    if not m:
        return mangled or "?"
    n = int(m.group(1))
    name = mangled[m.end():m.end() + n]
    ints = re.findall(r"Li(\d+)E", mangled[m.end() + n:])
    return name + ("/" + ".".join(ints) if ints else "")


def gpu_time(cp, stream, fn, reps: int) -> float:
    """GPU seconds per call of fn (enqueued reps times between two events, after one warm call)."""
    fn()
    stream.synchronize()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(stream)
    for _ in range(reps):
        fn()
    b.record(stream)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) * 1e-3 / reps


def timed_graph(drv, cp, stream, fn, rep: int):
    """(GPU seconds of one fn inside a graph of rep fn in a row, the graph's nodes of one fn)."""
    g = drv.capture(stream.ptr, lambda: [fn() for _ in range(rep)])
    nodes = drv.nodes(g)
    if not nodes:
        drv.destroy(g)
        return 0.0, []
    e = drv.instantiate(g)
    try:
        t = min(gpu_time(cp, stream, lambda: drv.launch(e, stream.ptr), 5) for _ in range(3))
    finally:
        drv.destroy(g, e)
    return t / rep, nodes[:len(nodes) // rep]


def decode_session(env, prog, cfg, wl, timeline=None):
    """(session, its decode payload's state, logits of the last step, its caches) after a prefill
    and three decode steps (graph captured; ``timeline``, a cuda_pdl.Timeline, armed around the
    first decode run, which captures the decode graph: its rows are that graph's launches)."""
    from gpudelegate.export.models import smollm2

    cp = bd._cuda()[0]
    names = smollm2.cache_names(cfg)
    shape = (1, cfg.kv_heads, cfg.max_context, cfg.head_dim)
    s = env.session(prog, device="cuda", capture_graph=True)
    pos0, last = np.array([0], np.int32), np.array([wl.chunk - 1], np.int32)
    o = s.run("prefill", [wl.prompt, pos0, last, *[np.zeros(shape, np.float32) for _ in names]], keep_on_device=True)
    tok = int(cp.argmax(o[0].handle))
    for i in range(3):  # the first decode run captures the graph
        if timeline is not None and i == 0:
            timeline.arm()
        try:
            o = s.run("decode", [np.array([[tok]], np.int32), np.array([wl.chunk + i], np.int32), *o[1:]],
                      keep_on_device=True)
        finally:
            if timeline is not None:
                timeline.disarm()
        tok = int(cp.argmax(o[0].handle))
    pid = prog.methods["decode"].nodes[0].attrs["payload"]
    return s, s.executor._states[pid], o[0], o[1:]


def _probe_session(env, prog, cfg, wl, out: dict):
    """CuPy, the driver API and the decode session a probe times (its device named in ``out``)."""
    cp = bd._cuda()[0]
    s, st, logits, caches = decode_session(env, prog, cfg, wl)
    out["device"] = s.executor.context.name
    return cp, Driver(), s, st, logits, caches


def probe(env, prog, cfg, wl, out: dict, groups_alone: bool = True) -> None:
    cp, drv, s, st, logits, _ = _probe_session(env, prog, cfg, wl, out)
    ex = s.executor
    stream = ex.stream
    with ex.context.device, stream:
        # 1. census of one step's chain
        g = drv.capture(stream.ptr, lambda: ex._execute(st))
        nodes = drv.nodes(g)
        drv.destroy(g)
        types, kern = {}, {}
        for n in nodes:
            types[n["type"]] = types.get(n["type"], 0) + 1
            if n["type"] == "kernel":
                k = short_name(n.get("name"))
                r = kern.setdefault(k, {"count": 0, "grid": n.get("grid"), "block": n.get("block")})
                r["count"] += 1
        out["nodes"] = types
        out["kernels"] = kern
        out["bound_steps"] = sum(1 for f in st.steps if f is not None)
        out["kernels_per_step"] = types.get("kernel", 0)
        # the fused groups the session bound, and those run inside a product (cuda_fused_ops)
        out["fusions"] = {k: v for k, v in ex.stats.items() if k in ("fusions", "norm_prologue", "norm_unfused",
                                                                     "rope_in_product", "attn_in_product")}
        # 2. the executor's graph, back to back
        out["step_us"] = min(gpu_time(cp, stream, lambda: st.graph.launch(stream), 100) for _ in range(3)) * 1e6
        # 3. each bound step alone inside a graph
        groups, empty = {}, 0
        for k, fn in enumerate(st.steps):
            if fn is None or not groups_alone:
                continue
            try:
                t, ns = timed_graph(drv, cp, stream, fn, REP)
            except Exception as e:  # a step that cannot be captured alone: named, not timed
                t, ns = float("nan"), [{"type": f"capture failed ({e})"}]
            if not ns:
                empty += 1
                continue
            key = st.ops[k] + ": " + " + ".join(short_name(n.get("name")) if n["type"] == "kernel" else n["type"]
                                                for n in ns)
            r = groups.setdefault(key, {"count": 0, "us": []})
            r["count"] += 1
            r["us"].append(t * 1e6)
        out["steps_without_launch"] = empty
        out["groups"] = {k: {"count": v["count"], "us_each": statistics.median(v["us"]), "us_total": sum(v["us"])}
                         for k, v in groups.items()}
        nop = cp.RawKernel('extern "C" __global__ void nop() {}', "nop")
        out["empty_kernel_us"] = timed_graph(drv, cp, stream, lambda: nop((1,), (32,), ()), 100)[0] * 1e6
        # 4. the greedy pick on the device: the launches (captured alone; the executor's own
        # index kernel where it has one, else the cupy expression argmax_device ran before it),
        # and a whole argmax_device + index_value per call as a greedy loop without lookahead sees it
        x = logits.handle.reshape(-1)
        pick = getattr(ex, "_argmax_index", None)
        if pick is None:
            pick = lambda: cp.where(cp.isnan(x).any(), cp.argmax(cp.isnan(x)), cp.argmax(x)).astype(cp.int32)
        else:
            pick = (lambda f: (lambda: f(x)))(pick)
        try:
            out["argmax_us"], ns = timed_graph(drv, cp, stream, pick, REP)
            out["argmax_us"] *= 1e6
            out["argmax_nodes"] = [short_name(n.get("name")) if n["type"] == "kernel" else n["type"] for n in ns]
        except Exception as e:
            out["argmax_us"], out["argmax_nodes"] = float("nan"), [f"capture failed: {e}"]
        ex.index_value(ex.argmax_device(logits))
        calls = []
        for _ in range(50):
            stream.synchronize()
            t0 = time.perf_counter()
            ex.index_value(ex.argmax_device(logits))
            calls.append(time.perf_counter() - t0)
        out["argmax_call_us"] = statistics.median(calls) * 1e6
    s.close()


def _run_at(s, pos: int, caches):
    """One decode run at ``pos`` (its inputs written, the graph replayed once): later replays
    of the graph alone then run at that position. The token is fixed (1): only the position
    differs between the runs compared."""
    return s.run("decode", [np.array([[1]], np.int32), np.array([pos], np.int32), *caches], keep_on_device=True)


def positions(env, prog, cfg, wl, pos_list, rounds: int, out: dict) -> None:
    """The decode step at each position of ``pos_list`` (see the module doc): fills ``out``."""
    cp, drv, s, st, _, caches = _probe_session(env, prog, cfg, wl, out)
    ex = s.executor
    stream = ex.stream
    attn = [k for k, op in enumerate(st.ops) if st.steps[k] is not None and "sdpa" in op]
    with ex.context.device, stream:
        replay = lambda: st.graph.launch(stream)
        # warm-up: ~2 s of replays bring the clock up (METHOD.md)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 2.0:
            gpu_time(cp, stream, replay, 50)
        step = {p: [] for p in pos_list}
        order = []
        for r in range(rounds):
            for p in pos_list:
                _run_at(s, p, caches)
                t = gpu_time(cp, stream, replay, 50) * 1e6
                step[p].append(t)
                order.append((r, p, t))
        out["step_us"] = {p: v for p, v in step.items()}
        out["step_order"] = order
        print("step us by position:", {p: [round(t, 1) for t in v] for p, v in step.items()}, flush=True)
        # attention's bound steps alone, and every step alone at the ends
        groups = {}
        for p in pos_list:
            _run_at(s, p, caches)
            steps = range(len(st.steps)) if p in (pos_list[0], pos_list[-1]) else attn
            g = groups[p] = {}
            for k in steps:
                fn = st.steps[k]
                if fn is None:
                    continue
                try:
                    t, ns = timed_graph(drv, cp, stream, fn, REP)
                except Exception:  # a step that cannot be captured alone (probe() names these)
                    continue
                if not ns:
                    continue
                key = ("attention" if k in attn else st.ops[k]) + ": " + " + ".join(
                    short_name(n.get("name")) if n["type"] == "kernel" else n["type"] for n in ns)
                r = g.setdefault(key, {"count": 0, "us": 0.0})
                r["count"] += 1
                r["us"] += t * 1e6
        out["groups"] = groups
    s.close()
    # greedy generate two ahead from the prompt's end (the exported prefill takes one full
    # chunk): wall of n tokens less that of one, a token; the loop's period, since the GPU bounds it
    from gpudelegate.llm import generate
    s = env.session(prog, device="cuda", capture_graph=True)
    tok = bd.IdsTokenizer()
    prompt = [int(x) for x in wl.prompt.reshape(-1)]
    generate(s, tok, prompt, max_new_tokens=3, stop_ids=(), lookahead=2)  # captures the graph
    gen = {}
    for n_new in (64, 120):
        walls = []
        for _ in range(3):
            t = time.perf_counter()
            generate(s, tok, prompt, max_new_tokens=1, stop_ids=(), lookahead=2)
            t1 = time.perf_counter()
            generate(s, tok, prompt, max_new_tokens=n_new + 1, stop_ids=(), lookahead=2)
            walls.append(((time.perf_counter() - t1) - (t1 - t)) / n_new * 1e6)
        gen[f"lookahead 2, positions {len(prompt)}..{len(prompt) + n_new}"] = walls
    out["generate_us_per_token"] = gen
    s.close()


def timeline_env(stamps: bool):
    """A fresh Environment, so a CUDA context and compiled kernels of its own: with the timeline
    switch (cuda_pdl.TIMELINE_ENV, read when the context is made) on where ``stamps``."""
    from gpudelegate.native.cuda_pdl import TIMELINE_ENV

    keep = os.environ.get(TIMELINE_ENV)
    os.environ[TIMELINE_ENV] = "1" if stamps else "0"
    try:
        env = gpudelegate.Environment()
        env.context("cuda")
    finally:
        if keep is None:
            del os.environ[TIMELINE_ENV]
        else:
            os.environ[TIMELINE_ENV] = keep
    return env


def func_name(drv, func: int) -> str:
    name = ctypes.c_char_p()
    if drv.lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(func)) != 0:
        return "?"
    return short_name(name.value.decode())


def sample_timeline(cp, tl, graph, stream, n: int, replays: int) -> np.ndarray:
    """[replays, n, 4] int64 stamps (ns) of ``replays`` replays of ``graph`` (its first n records
    reset before each replay and copied out after it, all on ``stream``: one wait at the end)."""
    hist = cp.empty((replays,) + tl.stamps[:n].shape, cp.uint64)
    for i in range(replays):
        tl.reset(n)
        graph.launch(stream)
        hist[i] = tl.stamps[:n]
    stream.synchronize()
    return tl.reduce(hist.get())  # ns since the epoch < 2^63; an unstamped min reads -1


def timeline_table(h: np.ndarray, names: list, foreign: list) -> dict:
    """Per kernel kind (in step order), us: launch-to-wait (first block's start to the first
    return from its wait), the wait's spread over the blocks (first to last return), wait-to-end
    (first return to the last block's end), the hand-off (the launch before it ended -> this
    one's first wait returned) and the overlap (this one's first block started that long before
    the launch ahead ended); the step's span and its critical path (first wait -> last end =
    the sum of every wait-to-end and hand-off) split into those two sums. ``foreign[i]``: kernels
    not ours (CuPy's) between launch i - 1 and i, whose time the hand-off then holds."""
    S, W1, W2, E = (h[..., j] for j in range(4))
    valid = bool(((S > 0) & (S <= W1) & (W1 <= W2) & (W2 <= E)).all())
    us = lambda a: a.astype(np.float64) / 1e3
    pre, spread, work = us(W1 - S), us(W2 - W1), us(E - W1)
    hand = np.concatenate([np.full((h.shape[0], 1), np.nan), us(W1[:, 1:] - E[:, :-1])], axis=1)
    over = np.concatenate([np.full((h.shape[0], 1), np.nan), us(E[:, :-1] - S[:, 1:])], axis=1)
    kinds = {}
    for i, k in enumerate(names):
        key = k + (f" (after {foreign[i]} not ours)" if foreign[i] else "")
        kinds.setdefault(key, []).append(i)
    rows = {}
    for k, idx in kinds.items():
        m = lambda a: float(np.nanmean(a[:, idx])) if not np.all(np.isnan(a[:, idx])) else float("nan")
        rows[k] = {"count": len(idx), "launch_to_wait": m(pre), "wait_spread": m(spread), "wait_to_end": m(work),
                   "handoff": m(hand), "overlap": m(over),
                   "per_step": float(np.nanmean(np.nansum(work[:, idx] + np.nan_to_num(hand[:, idx]), axis=1)))}
    return {"valid": valid, "launches": len(names), "kinds": rows,
            "span_us": float(np.mean(us(E[:, -1] - S[:, 0]))),
            "critical_us": float(np.mean(us(E[:, -1] - W1[:, 0]))),
            "sum_wait_to_end_us": float(np.mean(work.sum(axis=1))),
            "sum_handoff_us": float(np.mean(np.nansum(hand, axis=1))),
            "first_layer": [[names[i]] + [round(float(x), 2) for x in (pre[0, i], spread[0, i], work[0, i], hand[0, i],
                                                                        over[0, i])]
                            for i in range(min(len(names), 14))]}


def globaltimer_tick(cp) -> float:
    """The smallest step of %globaltimer seen by one thread (ns): the stamps' resolution."""
    k = cp.RawKernel(r"""extern "C" __global__ void tick(unsigned long long* out) {
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        for (int i = 0; i < 64; ++i) {
            do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t == t0);
            out[i] = t - t0;
            t0 = t;
        }
    }""", "tick")
    out = cp.zeros(64, cp.uint64)
    k((1,), (1,), (out,))
    return float(np.median(out.get()[1:]))


def foreign_kernels(drv, ex, st, names: list) -> list:
    """For each of our launches (``names``, in order), how many kernel nodes not ours the step's
    graph holds between it and our launch before it (a capture of the step, in node order)."""
    g = drv.capture(ex.stream.ptr, lambda: ex._execute(st))
    try:
        census = [short_name(n.get("name")) for n in drv.nodes(g) if n["type"] == "kernel"]
    finally:
        drv.destroy(g)
    out, j = [], 0
    for k in names:
        skipped = 0
        while j < len(census) and census[j] != k:
            skipped, j = skipped + 1, j + 1
        out.append(skipped)
        j += 1
    return out


def timeline(prog, cfg, wl, out: dict, rounds: int = 3, replays: int = 40) -> None:
    """The captured decode step with the timeline switch on (see the module doc): per-kind table
    of its stamps, and the step in its graph with the switch on and off (two contexts, one
    process, interleaved rounds after a warm-up)."""
    cp, drv = bd._cuda()[0], Driver()
    env_on, env_off = timeline_env(True), timeline_env(False)
    tl = env_on.context("cuda").kernels.pdl.timeline
    s_on, st_on, lg_on, _ = decode_session(env_on, prog, cfg, wl, timeline=tl)
    s_off, st_off, lg_off, _ = decode_session(env_off, prog, cfg, wl)
    out["device"] = s_on.executor.context.name
    out["logits_equal"] = bool((lg_on.numpy() == lg_off.numpy()).all())
    names = [func_name(drv, f) for f, _, _ in tl.launches]
    ex_on, ex_off = s_on.executor, s_off.executor
    replay = {"off": (ex_off, lambda: st_off.graph.launch(ex_off.stream)),
              "on": (ex_on, lambda: st_on.graph.launch(ex_on.stream))}
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:  # warm-up: the clock comes up (METHOD.md)
        for ex, fn in replay.values():
            with ex.context.device, ex.stream:
                gpu_time(cp, ex.stream, fn, 50)
    steps = {k: [] for k in replay}
    for _ in range(rounds):
        for k, (ex, fn) in replay.items():
            with ex.context.device, ex.stream:
                steps[k].append(gpu_time(cp, ex.stream, fn, 50) * 1e6)
    out["step_us"] = steps
    with ex_on.context.device, ex_on.stream:
        foreign = foreign_kernels(drv, ex_on, st_on, names)
        h = sample_timeline(cp, tl, st_on.graph, ex_on.stream, len(names), replays)
        out["tick_ns"] = globaltimer_tick(cp)
    out["timeline"] = timeline_table(h, names, foreign)
    s_on.close()
    s_off.close()
    env_on.close()
    env_off.close()


def print_timeline(wd: str, r: dict) -> None:
    t = r["timeline"]
    print(f"\n== {wd} on {r['device']}: the decode step's timeline, {t['launches']} stamped launches, stamps "
          f"{'consistent' if t['valid'] else 'NOT start <= wait <= end'}; %globaltimer step {r['tick_ns']:.0f} ns; "
          f"logits with / without stamps {'equal' if r['logits_equal'] else 'DIFFER'}")
    for k, v in r["step_us"].items():
        print(f"   step in its graph, stamps {k:3s}: " + " ".join(f"{x:7.1f}" for x in v) + " us")
    print(f"   span {t['span_us']:.1f} us; critical path (first wait -> last end) {t['critical_us']:.1f} = "
          f"wait-to-end {t['sum_wait_to_end_us']:.1f} + hand-offs {t['sum_handoff_us']:.1f}")
    print(f"   {'kernel kind (step order), means in us':58s} {'n':>3s} {'l->wait':>7s} {'spread':>7s} {'w->end':>7s} "
          f"{'handoff':>7s} {'overlap':>7s} {'us/step':>8s}")
    for k, v in t["kinds"].items():
        print(f"   {k[:58]:58s} {v['count']:3d} {v['launch_to_wait']:7.2f} {v['wait_spread']:7.2f} "
              f"{v['wait_to_end']:7.2f} {v['handoff']:7.2f} {v['overlap']:7.2f} {v['per_step']:8.1f}")
    print("   the first launches of one replay (l->wait, spread, w->end, handoff, overlap):")
    for row in t["first_layer"]:
        print(f"      {row[0][:50]:50s} " + " ".join(f"{x:7.2f}" for x in row[1:]))


VARIANTS = {
    # name: (QuantKernels.rope_in_product, QuantKernels.attn_in_product)
    "none (rope_kv, sdpa_combine launched)": (False, False),
    "rope in the q/k/v product": (True, False),
    "rope in product + attention merged in the o product": (True, True),
}


def variants(env, prog, cfg, wl, groups_alone: bool) -> dict:
    """The step under each of VARIANTS (the knobs restored after): kernels a step and step time,
    and for the first (nothing fused away) each group's time alone."""
    q = env.context("cuda").kernels.quant
    keep = (q.rope_in_product, q.attn_in_product)
    res = {}
    try:
        for i, (name, (rope, attn)) in enumerate(VARIANTS.items()):
            q.rope_in_product, q.attn_in_product = rope, attn
            v = res[name] = {}
            probe(env, prog, cfg, wl, v, groups_alone=groups_alone and i == 0)
            print(f"   variant {name:58s}: {v['kernels_per_step']:4d} kernels a step, step {v['step_us']:7.1f} us "
                  f"in its graph")
            for g, t in sorted(v.get("groups", {}).items(), key=lambda kv: -kv[1]["us_total"]):
                print(f"      {g[:84]:84s} {t['count']:4d} {t['us_each']:8.2f} {t['us_total']:8.1f}")
    finally:
        q.rope_in_product, q.attn_in_product = keep
    return res


def print_positions(wd: str, r: dict) -> None:
    print(f"\n== {wd} on {r['device']}: the decode graph replayed alone (50 a timing), us a step, "
          f"by round (time order left to right)")
    for p, v in r["step_us"].items():
        print(f"   position {p:4d}: " + " ".join(f"{t:7.1f}" for t in v) + f"   median {statistics.median(v):7.1f}")
    print("   bound steps alone in a graph, us a step summed over the layers:")
    keys = sorted({k for g in r["groups"].values() for k in g},
                  key=lambda k: -max(g.get(k, {"us": 0})["us"] for g in r["groups"].values()))
    ps = list(r["groups"])
    print(f"   {'group':70s} " + " ".join(f"{'pos ' + str(p):>9s}" for p in ps))
    for k in keys:
        print(f"   {k[:70]:70s} " + " ".join(f"{r['groups'][p][k]['us']:9.1f}" if k in r["groups"][p] else f"{'':9s}"
                                          for p in ps))
    for p in (ps[0], ps[-1]):
        print(f"   sum of every step alone at position {p}: {sum(v['us'] for v in r['groups'][p].values()):.1f} us")
    for k, v in r["generate_us_per_token"].items():
        print(f"   generate {k}: " + " ".join(f"{t:6.1f}" for t in v) + f" us a token "
              f"({1e6 / statistics.median(v):.0f} tok/s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default="q4_1", help="float32,float16,q4_1")
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", action="store_true",
                    help="also probe the decode step's launch-saving choices one by one (the VARIANTS: census "
                         "and step; with per-group times for the first)")
    ap.add_argument("--no-groups", action="store_true",
                    help="skip timing each bound step alone (3.): the census and the step only, in a fraction of the time")
    ap.add_argument("--positions", default="",
                    help="comma-separated decode positions: the step at each (see the module doc) instead of the census")
    ap.add_argument("--rounds", type=int, default=4, help="--positions: rounds of replays over the positions")
    ap.add_argument("--timeline", action="store_true",
                    help="the step's per-launch timeline (cuda_pdl.Timeline) and its cost, instead of the census")
    args = ap.parse_args(argv)
    env = gpudelegate.Environment()
    cfg = bd.model_config(False)
    wl = bd.Workload(cfg, False)
    model, packed = bd.random_model(cfg)
    weights = tuple(w for w in args.weights.split(",") if w)
    progs, missing = bd.export_programs(model, cfg, packed, weights=weights)
    res = {"missing": missing}
    for wd, prog in progs.items():
        r = res[wd] = {}
        if args.timeline:
            timeline(prog, cfg, wl, r)
            print_timeline(wd, r)
            continue
        if args.positions:
            pos_list = [int(p) for p in args.positions.split(",") if p.strip()]
            bad = [p for p in pos_list if not 0 <= p < cfg.max_context]
            if bad:
                raise SystemExit(f"--positions {bad}: outside the cache's {cfg.max_context} rows")
            positions(env, prog, cfg, wl, pos_list, args.rounds, r)
            print_positions(wd, r)
            continue
        probe(env, prog, cfg, wl, r, groups_alone=not args.no_groups)
        if args.variants:
            r["variants"] = variants(env, prog, cfg, wl, groups_alone=not args.no_groups)
        print(f"\n== {wd} on {r['device']}: nodes {r['nodes']}, bound steps {r['bound_steps']} ({r['steps_without_launch']} launch "
              f"nothing); step {r['step_us']:.1f} us in its graph; empty kernel {r['empty_kernel_us']:.2f} us")
        print(f"   {r['kernels_per_step']} kernels a step; fused groups (whole session): {r['fusions']}")
        print(f"   argmax: {r['argmax_nodes']} {r['argmax_us']:.2f} us in a graph; argmax_device + index_value "
              f"{r['argmax_call_us']:.1f} us a call (host clock)")
        for k, v in sorted(r["kernels"].items(), key=lambda kv: -kv[1]["count"]):
            print(f"   kernel {k:40s} x{v['count']:4d} grid {v['grid']} block {v['block']}")
        if args.no_groups:
            continue
        tot = sum(v["us_total"] for v in r["groups"].values() if v["us_total"] == v["us_total"])  # not NaN
        print(f"   {'step group':88s} {'n':>4s} {'us each':>8s} {'us/step':>8s}")
        for k, v in sorted(r["groups"].items(), key=lambda kv: -kv[1]["us_total"]):
            print(f"   {k[:88]:88s} {v['count']:4d} {v['us_each']:8.2f} {v['us_total']:8.1f}")
        print(f"   {'sum of groups alone':88s} {'':4s} {'':8s} {tot:8.1f}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe_cuda_graph.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
