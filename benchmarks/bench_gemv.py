"""Decode kernels on wgpu against the memory bound: the gemv family and flash-decoding attention
against the kernels they replaced, next to a device-to-device copy of the same bytes; one table,
recorded under benchmarks/results/ (bench_gemv_<device>).

    python benchmarks/bench_gemv.py [--out DIR] [--small] [--sections gemv,attention]

Rows (seeded random data; every variant's output is first checked against float64 numpy):

1. **gemv**: SmolLM2-135M's decode linears (M = 1; weights [N, K] as linear stores them: q/o
   576x576, k/v 192x576, gate/up 1536x576, down 576x1536, lm head 49152x576), float32 and float16
   weights, plus one 8-row product (a batch of 8 decode streams). Ours: the kernel the lowering
   picks (gemv.wgsl) and its best forced shape (Tuning gemv_lanes / gemv_cols); baseline: what
   the lowering picked before it (Tuning(gemv_old=True, gemv_max_m=4): gemv_k for M <= 4, the
   tiles above). GB/s counts the weight bytes once per call.
2. **attention**: SmolLM2's decode attention (9 query heads over 3 kv heads, one query row, head
   dim 64, a bool keep-mask) over 256, 512 and 2048 cached keys: flash-decoding (attn_flash +
   attn_flash_combine) against the split-K kernels it replaced (attn_split + attn_combine) and
   the one-workgroup-per-row attn_rows. GB/s counts K and V once.

The bound in each row: a WGSL kernel that only streams the same bytes in with 16-byte loads
(the floor of any kernel that must read them once), timed like ours, and
``copy_buffer_to_buffer`` of them (it reads and writes them: its traffic is twice its GB/s).
Kernel times are per call of many calls in one compute pass (as a decode step runs them, the
barriers between dependent dispatches included): the span between the pass's two GPU
timestamps with ``timestamp-query``, else the wall time of its submit. Copies cannot sit in a
pass: they are timed by the wall time of many back to back in one submit.

``--small`` shrinks every shape so the script runs in well under a minute on a software adapter
(lavapipe); its numbers only show that the script works.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_wgpu import _import_gpudelegate, single_op_program  # noqa: E402

_import_gpudelegate()

import gpudelegate  # noqa: E402
from gpudelegate.program import DELEGATE_OP, Method, Node, Payload, PrepackEntry, Program, Value  # noqa: E402
from gpudelegate.webgpu import lowering  # noqa: E402

from bench_report import Report, finish, parse_args, result_writer, section  # noqa: E402

COLUMNS = [("section", "section"), ("metric", "metric"), ("ours", "gpudelegate (wgpu)"), ("baseline", "baseline"),
           ("ratio", "baseline / ours"), ("note", "note")]

# (label, M, N, K) of SmolLM2-135M's decode linears (weights [N, K]).
GEMV_SHAPES = [("q/o proj", 1, 576, 576), ("k/v proj", 1, 192, 576), ("gate/up proj", 1, 1536, 576),
               ("down proj", 1, 576, 1536), ("lm head", 1, 49152, 576), ("gate/up proj, 8 rows", 8, 1536, 576)]
GEMV_VARIANTS = {"lanes 32": lowering.Tuning(gemv_lanes=32), "lanes 64": lowering.Tuning(gemv_lanes=64),
                 "lanes 128": lowering.Tuning(gemv_lanes=128),
                 "1 column per workgroup": lowering.Tuning(gemv_cols=1),
                 "256 threads per workgroup": lowering.Tuning(gemv_min_groups=1)}
OLD_GEMV = lowering.Tuning(gemv_old=True, gemv_max_m=4)
ATTN_KEYS = [256, 512, 2048]
ATTN_VARIANTS = {"attn_split (the previous default)": lowering.Tuning(attn_flash=False),
                 "attn_rows": lowering.Tuning(attn_flash=False, attn_split=False)}

# A read-only streaming kernel: each thread loads 4 vec4s a grid apart (neighbouring threads,
# neighbouring vec4s) and writes only when their sum hits a value random data never gives, so
# the loads cannot be dropped and next to nothing is written.
READ_WGSL = """
@group(0) @binding(0) var<storage, read_write> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size(256)
fn read4(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let total = nwg.x * nwg.y * 256u;
    let t = gid.x + gid.y * nwg.x * 256u;
    let n = arrayLength(&src);
    var acc = vec4<f32>(0.0);
    if (t < n) { acc += src[t]; }
    if (t + total < n) { acc += src[t + total]; }
    if (t + 2u * total < n) { acc += src[t + 2u * total]; }
    if (t + 3u * total < n) { acc += src[t + 3u * total]; }
    let s = acc.x + acc.y + acc.z + acc.w;
    if (s == 1234.5678) {
        dst[t % 64u] = s;
    }
}
"""


# ============================================================================ timing

class Timer:
    """GPU time per call of a list of launches: ``iters`` calls in one compute pass (as a decode
    chain runs them, the barriers between dependent dispatches included), timed by the pass's two
    timestamps where the adapter has timestamp-query, else by the wall time of its submit. One
    pass per call instead measured ~25 us per call on an H100 whatever the kernel (a 0.4 MB read
    took 27 us against 2.8 us by timestamps). ``iters`` is chosen so a submit takes ~10 ms."""

    def __init__(self, ctx, small: bool):
        self.ctx = ctx
        self.dev = ctx.device
        self.small = small
        self.ts = "timestamp-query" in ctx.features
        self.how = "GPU timestamps around one compute pass" if self.ts else "wall time of one compute pass"

    def _once(self, launches, iters: int) -> float:
        wgpu = self.ctx.wgpu
        qs = rbuf = None
        enc = self.dev.create_command_encoder()
        if self.ts:
            qs = self.dev.create_query_set(type="timestamp", count=2)
            rbuf = self.dev.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
            cp = enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": 0,
                                                          "end_of_pass_write_index": 1})
        else:
            cp = enc.begin_compute_pass()
        for _ in range(iters):
            for pipe, bg, wg in launches:
                cp.set_pipeline(pipe)
                cp.set_bind_group(0, bg)
                cp.dispatch_workgroups(*wg)
        cp.end()
        if self.ts:
            enc.resolve_query_set(qs, 0, 2, rbuf, 0)
        self.ctx.fence()
        t0 = time.perf_counter()
        self.ctx.queue.submit([enc.finish()])
        self.ctx.fence()
        wall = (time.perf_counter() - t0) / iters
        if not self.ts:
            return wall
        ticks = np.frombuffer(self.ctx.queue.read_buffer(rbuf), np.uint64)
        rbuf.destroy()
        return float(ticks[1] - ticks[0]) * 1e-9 / iters  # WebGPU timestamps are nanoseconds

    def gpu(self, launches) -> float:
        """Median of three timed passes after a warm-up one."""
        iters = 3 if self.small else int(min(4000, max(20, 0.01 / max(self._once(launches, 5), 1e-7))))
        self._once(launches, iters)
        return float(np.median([self._once(launches, iters) for _ in range(3)]))

    def copies(self, encode: Callable[[object], None]) -> float:
        """Wall time per ``encode(encoder)`` (copy commands: they take no timestamps inside a
        pass), back to back in one submit; median of three after a warm-up."""
        def once(iters):
            enc = self.dev.create_command_encoder()
            for _ in range(iters):
                encode(enc)
            self.ctx.fence()
            t0 = time.perf_counter()
            self.ctx.queue.submit([enc.finish()])
            self.ctx.fence()
            return (time.perf_counter() - t0) / iters

        iters = 3 if self.small else int(min(2000, max(20, 0.01 / max(once(5), 1e-7))))
        once(iters)
        return float(np.median([once(iters) for _ in range(3)]))


def _session_launches(ex) -> List[Tuple[object, object, tuple]]:
    return [(L.pipeline, L.bind_group, L.workgroups) for st in ex.recorded[0].chain.steps for L in st.launches]


def _session_kernels(ex) -> str:
    steps = ex.recorded[0].chain.steps
    return ", ".join(sorted({L.pipeline.label.split(":")[-1] for st in steps for L in st.launches}))


class Anchors:
    """The bound for ``nbytes``: a copy_buffer_to_buffer of them and a WGSL streaming read."""

    def __init__(self, timer: Timer):
        self.t = timer
        wgpu = timer.ctx.wgpu
        self.U = wgpu.BufferUsage
        self.read_pipe = timer.dev.create_compute_pipeline(
            layout="auto", compute={"module": timer.dev.create_shader_module(code=READ_WGSL), "entry_point": "read4"})

    def measure(self, nbytes: int) -> Dict[str, float]:
        n = (nbytes + 63) // 64 * 64
        dev, U = self.t.dev, self.U
        src = dev.create_buffer(size=n, usage=U.STORAGE | U.COPY_SRC | U.COPY_DST)
        dst = dev.create_buffer(size=n, usage=U.STORAGE | U.COPY_DST)
        small = dev.create_buffer(size=256, usage=U.STORAGE)

        def copy(enc):
            enc.copy_buffer_to_buffer(src, 0, dst, 0, n)

        bg = dev.create_bind_group(layout=self.read_pipe.get_bind_group_layout(0), entries=[
            {"binding": 0, "resource": {"buffer": src, "offset": 0, "size": n}},
            {"binding": 1, "resource": {"buffer": small, "offset": 0, "size": 256}}])
        threads = -(-(n // 16) // 4)
        groups = -(-threads // 256)
        wg = (min(groups, 65535), -(-groups // 65535), 1)

        res = {"copy": self.t.copies(copy), "read": self.t.gpu([(self.read_pipe, bg, wg)])}
        for b in (src, dst, small):
            b.destroy()
        return res


def _gbps(nbytes: int, sec: float) -> str:
    return f"{nbytes / sec / 1e9:.3g}"


def _bound_note(nbytes: int, anc: Dict[str, float], sec: float) -> str:
    return (f"bound for {nbytes / 1e6:.2f} MB: WGSL streaming read {anc['read'] * 1e6:.1f} us "
            f"({_gbps(nbytes, anc['read'])} GB/s), ours at {100 * anc['read'] / sec:.0f} % of it; "
            f"copy_buffer_to_buffer {anc['copy'] * 1e6:.1f} us ({_gbps(nbytes, anc['copy'])} GB/s copied, twice "
            f"that moved; wall time of copies back to back)")


# ============================================================================ programs

def linear_program(m: int, n: int, k: int, wdtype: str, w: np.ndarray) -> Program:
    """``forward(x) = linear(x, W)`` with W [n, k] a float32 constant prepacked as it is
    (``float32``) or packed to float16 (``float16``): how programs hold linear weights."""
    prog = Program(constants=[], payloads=[], methods={})
    c = prog.add_constant("float32", (n, k), np.ascontiguousarray(w, np.float32).tobytes())
    values = [Value("float32", (m, k), None, "x"), Value("float32", (n, k), c, "w"),
              Value(wdtype, (n, k), None, "w.packed"), Value("float32", (m, n), None, "y")]
    pre = [PrepackEntry(1, 2, "fp16" if wdtype == "float16" else "identity")]
    prog.payloads.append(Payload(values, [0], [3], [Node("linear", [0, 2], [3], {})], prepack=pre))
    mv = [Value("float32", (m, k), None, "x"), Value("float32", (m, n), None, "y")]
    prog.methods["forward"] = Method(mv, [0], [1], [Node(DELEGATE_OP, [0], [1], {"payload": 0})], name="forward")
    return prog


def _run_variant(env, timer: Timer, prog, inputs, want, tuning) -> Tuple[float, float, str]:
    """(seconds per call, max relative error, kernels)."""
    with env.session(prog, device="wgpu", tuning=tuning) as s:
        got = s.run("forward", inputs)[0]
        err = float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())
        return timer.gpu(_session_launches(s.executor)), err, _session_kernels(s.executor)


# ============================================================================ sections

def bench_gemv(rep: Report, env, timer: Timer, anchors: Anchors, small: bool) -> None:
    shapes = [(lab, m, max(1, n // 8), max(8, k // 8)) for lab, m, n, k in GEMV_SHAPES] if small else GEMV_SHAPES
    for label, m, n, k in shapes:
        for wdtype in ("float32", "float16"):  # side by side: a lent machine's speed drifts
            rng = np.random.default_rng(n * 7 + k + m)
            x = rng.standard_normal((m, k), dtype=np.float32)
            w = rng.standard_normal((n, k), dtype=np.float32)
            wq = w.astype(np.float16).astype(np.float64) if wdtype == "float16" else w.astype(np.float64)
            want = x.astype(np.float64) @ wq.T
            prog = linear_program(m, n, k, wdtype, w)
            nbytes = n * k * (2 if wdtype == "float16" else 4)
            sec, err, kern = _run_variant(env, timer, prog, [x], want, lowering.Tuning())
            osec, oerr, okern = _run_variant(env, timer, prog, [x], want, OLD_GEMV)
            best = ("picked", sec)
            for vname, tuning in GEMV_VARIANTS.items():
                vsec, verr, _ = _run_variant(env, timer, prog, [x], want, tuning)
                if verr > 1e-5:
                    raise AssertionError(f"{label} {wdtype} {vname}: relative error {verr:.1e}")
                if vsec < best[1]:
                    best = (vname, vsec)
            if max(err, oerr) > 1e-5:
                raise AssertionError(f"{label} {wdtype}: relative error {err:.1e} (ours), {oerr:.1e} (old)")
            anc = anchors.measure(nbytes)
            note = _bound_note(nbytes, anc, sec)
            note += f"; best forced shape: {best[0]} {best[1] * 1e6:.1f} us; rel err {err:.1e}"
            rep.row("gemv", f"{label} {m}x{n}x{k}, {wdtype} weights",
                    f"{sec * 1e6:.1f} us, {_gbps(nbytes, sec)} GB/s ({kern})",
                    f"{osec * 1e6:.1f} us, {_gbps(nbytes, osec)} GB/s ({okern})", f"{osec / sec:.2f}x", note)


def _attn_ref(q, k, v, keep, scale):
    G = q.shape[1] // k.shape[1]
    kk = np.repeat(k, G, axis=1).astype(np.float64)
    vv = np.repeat(v, G, axis=1).astype(np.float64)
    s = q.astype(np.float64) @ kk.transpose(0, 1, 3, 2) * scale
    s = np.where(keep, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ vv


def bench_attention(rep: Report, env, timer: Timer, anchors: Anchors, small: bool) -> None:
    keys = [37, 300] if small else ATTN_KEYS
    for tk in keys:
        rng = np.random.default_rng(tk)
        q = rng.standard_normal((1, 9, 1, 64), dtype=np.float32)
        k = rng.standard_normal((1, 3, tk, 64), dtype=np.float32)
        v = rng.standard_normal((1, 3, tk, 64), dtype=np.float32)
        keep = np.ones((1, tk), bool)
        keep[:, tk - tk // 8:] = False  # the cache's unwritten tail, as a decode step masks it
        scale = 0.125
        prog = single_op_program("sdpa", [("float32", q.shape), ("float32", k.shape), ("float32", v.shape),
                                          ("bool", keep.shape)], {"scale": scale})
        want = _attn_ref(q, k, v, keep, scale)
        args = [q, k, v, keep]
        sec, err, kern = _run_variant(env, timer, prog, args, want, lowering.Tuning())
        others = []
        for vname, tuning in ATTN_VARIANTS.items():
            osec, oerr, okern = _run_variant(env, timer, prog, args, want, tuning)
            if oerr > 1e-5:
                raise AssertionError(f"attention {tk} keys {vname}: relative error {oerr:.1e}")
            others.append((vname, osec, okern))
        if err > 1e-5:
            raise AssertionError(f"attention {tk} keys: relative error {err:.1e}")
        nbytes = k.nbytes + v.nbytes
        anc = anchors.measure(nbytes)
        note = _bound_note(nbytes, anc, sec)
        note += f"; {others[1][0]}: {others[1][1] * 1e6:.1f} us; rel err {err:.1e}"
        vname, osec, okern = others[0]
        rep.row("attention", f"decode, 9/3 heads x 64, {tk} keys", f"{sec * 1e6:.1f} us ({kern})",
                f"{osec * 1e6:.1f} us ({okern})", f"{osec / sec:.2f}x", note)


# ============================================================================ main

def main(argv=None) -> int:
    args = parse_args(argv, __doc__, "gemv", "--small", "small shapes: checks the script on a software adapter",
                      "gemv,attention")
    env = gpudelegate.Environment()
    ctx = env.context("wgpu")
    info = ctx.info()
    rep = Report(COLUMNS)
    rep.data["device"] = {"adapter": info["device"], "features": info["features"], "small": args.small}
    timer = Timer(ctx, args.small)
    print(f"adapter: {info['device']}; kernels timed by {timer.how}")
    rep.data["timing"] = timer.how
    if info.get("software"):
        print("NOTE: a software (CPU) adapter: the numbers say nothing about GPU speed", flush=True)
    write = result_writer(rep, args.out, "gemv", info["device"], "--small" if args.small else "",
                          "decode kernels (gemv, flash-decoding) against the memory bound", "wgpu")
    anchors = Anchors(timer)
    steps = {"gemv": lambda: bench_gemv(rep, env, timer, anchors, args.small),
             "attention": lambda: bench_attention(rep, env, timer, anchors, args.small)}
    for name in args.sections.split(","):
        if name not in steps:
            print(f"unknown section {name!r} (known: {', '.join(steps)})")
            return 2
        section(rep, name, steps[name])
        write()
    env.close()
    return finish(rep, write)


if __name__ == "__main__":
    sys.exit(main())
