"""The CUDA executor on a real GPU: one run, one table, recorded under benchmarks/results/.

    python benchmarks/bench_cuda.py [--out DIR] [--quick]

What it measures (seeded random weights everywhere; real weights are too large to bring to the
GPU machine, and speed does not depend on their values):

1. **copies**: pinned and pageable host-to-device bandwidth (the ceiling of prepack and offload);
2. **conformance**: every case of tests/conformance on the CUDA executor against the float64
   reference kernels, with the suite's tolerances;
3. **models vs reference**: a Llama graph in our op set (the SmolLM2-135M shape: 30 layers, 576
   wide, 9/3 heads) built with :func:`llama_program`, fp32 and fp16, prefill logits against the
   same model in PyTorch float64 on the GPU; a 2-layer version also against our numpy reference
   executor;
4. **SmolLM2-135M shape, fp16, batch 1**: prefill of 128 tokens (latency) and greedy decode
   (tokens/s, argmax on the device, the KV cache left on the device between steps), ours eager
   and with CUDA graphs, against PyTorch eager and ``torch.compile(mode="reduce-overhead")`` of
   the same model;
5. **Llama-1B shape (2048 wide, 16 layers, fp16, 2.47 GB of weights) with a weight budget of 25%
   of the weight bytes**: decode tokens/s against the bound (bytes streamed per token / measured
   pinned H2D bandwidth) and against accelerate's ``cpu_offload`` of the same model in
   transformers; the weight pool's bytes against the budget; the offloaded logits against a
   fully resident session;
6. **prepack**: GB/s of the session build's upload against the plain pinned copy.

``llama_program`` is also used by tests/test_cuda_executor.py (small shapes) to check graphs and
offload on a model-like chain.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from gpudelegate import ops  # noqa: E402
from gpudelegate.errors import BudgetError  # noqa: E402
from gpudelegate.program import DELEGATE_OP, Method, Node, Payload, Program, Value  # noqa: E402

from bench_report import Report, finish, parse_args, result_writer, section  # noqa: E402  (benchmarks/bench_report.py)


# ============================================================================ the Llama program

@dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    max_ctx: int = 256
    theta: float = 100000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


# max_ctx 512: a 128-token prompt plus 130 decode steps stay inside the cache
SMOLLM2 = LlamaConfig(vocab=49152, dim=576, layers=30, heads=9, kv_heads=3, hidden=1536, max_ctx=512, theta=100000.0)
LLAMA_1B = LlamaConfig(vocab=128256, dim=2048, layers=16, heads=32, kv_heads=8, hidden=8192, max_ctx=256, theta=500000.0)


def weight_shapes(cfg: LlamaConfig) -> Dict[str, tuple]:
    """Names and shapes of the weights (nn.Linear layout [out, in]; tied embedding/LM head)."""
    d, h, kv = cfg.dim, cfg.hidden, cfg.kv_heads * cfg.head_dim
    s = {"embed": (cfg.vocab, d), "norm": (d,)}
    for i in range(cfg.layers):
        s.update({f"l{i}.in_norm": (d,), f"l{i}.q": (d, d), f"l{i}.k": (kv, d), f"l{i}.v": (kv, d), f"l{i}.o": (d, d),
                  f"l{i}.post_norm": (d,), f"l{i}.gate": (h, d), f"l{i}.up": (h, d), f"l{i}.down": (d, h)})
    return s


def random_weights(cfg: LlamaConfig, seed: int = 0, dtype=np.float16) -> Dict[str, np.ndarray]:
    """Seeded weights scaled like a freshly initialized model (N(0, 0.02); norms near 1), so
    activations stay O(1) through every layer and float16 neither overflows nor underflows."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm"):
            w = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:
            w = rng.standard_normal(shape, dtype=np.float32)
            w *= 0.02
        out[name] = w.astype(dtype)
    return out


def random_weights_gpu(cfg: LlamaConfig, torch, seed: int = 0) -> Dict[str, np.ndarray]:
    """The same distribution as ``random_weights`` in float16, drawn on the GPU (seeded), for the
    billion-parameter shapes where numpy's generator takes half a minute."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        x = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32)
        x = 1.0 + 0.1 * x if name.endswith("norm") else 0.02 * x
        out[name] = x.to(torch.float16).cpu().numpy()
    return out


def rope_tables(cfg: LlamaConfig):
    """cos/sin [max_ctx, head_dim] as transformers' Llama builds them (halves repeated)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    f = np.outer(np.arange(cfg.max_ctx, dtype=np.float64), inv)
    emb = np.concatenate([f, f], axis=1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


class _Graph:
    """A payload under construction: values typed by ops.infer, weights as program constants."""

    def __init__(self, prog: Program, consts: Dict[str, int]):
        self.prog, self.consts = prog, consts
        self.values: List[Value] = []
        self.inputs: List[int] = []
        self.outputs: List[int] = []
        self.nodes: List[Node] = []
        self._const_vals: Dict[str, int] = {}

    def value(self, dtype, shape, name="", constant=None) -> int:
        self.values.append(Value(dtype, tuple(shape), constant, name))
        return len(self.values) - 1

    def input(self, dtype, shape, name) -> int:
        v = self.value(dtype, shape, name)
        self.inputs.append(v)
        return v

    def w(self, name: str) -> int:
        if name not in self._const_vals:
            c = self.prog.constants[self.consts[name]]
            self._const_vals[name] = self.value(c.dtype, c.shape, name, constant=self.consts[name])
        return self._const_vals[name]

    def op(self, op: str, args: Sequence[int], **attrs) -> int:
        (dt, shape), = ops.infer(op, [None if a < 0 else self.values[a] for a in args], attrs)
        out = self.value(dt, shape)
        self.nodes.append(Node(op, list(args), [out], attrs))
        return out


def llama_program(cfg: LlamaConfig, weights: Dict[str, np.ndarray], methods: Dict[str, int],
                  act_dtype: str = "float16") -> Program:
    """A Llama decoder in our op set. Each method ``name -> T`` (tokens per call) is one payload:

    inputs  ids int32 [1,T], positions int32 [1,T], pos int32 [1] (first cache row written),
            mask bool [1,1,T,S] (key j visible to query i), k0, v0, ..., caches [1,Hk,S,Dh]
    outputs logits [1,1,V] of the last row, then every updated cache (in place: kv_update)

    Weights are program constants read directly by the ops (resident or streamed by the
    planner), shared by all methods. RoPE tables are constants too, gathered by position."""
    prog = Program(constants=[], payloads=[], methods={}, metadata={"model": "llama", "config": asdict(cfg)})
    consts = {}
    for name, arr in weights.items():
        a = np.ascontiguousarray(arr)
        consts[name] = prog.add_constant(str(a.dtype), a.shape, a.reshape(-1).view(np.uint8))
    cos, sin = rope_tables(cfg)
    consts["rope_cos"] = prog.add_constant("float32", cos.shape, cos.reshape(-1).view(np.uint8))
    consts["rope_sin"] = prog.add_constant("float32", sin.shape, sin.reshape(-1).view(np.uint8))
    H, Hk, Dh, S, D = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.max_ctx, cfg.dim
    for mname, T in methods.items():
        g = _Graph(prog, consts)
        ids = g.input("int32", (1, T), "ids")
        positions = g.input("int32", (1, T), "positions")
        pos = g.input("int32", (1,), "pos")
        mask = g.input("bool", (1, 1, T, S), "mask")
        caches = []
        for i in range(cfg.layers):
            caches.append((g.input(act_dtype, (1, Hk, S, Dh), f"k{i}"), g.input(act_dtype, (1, Hk, S, Dh), f"v{i}")))
        x = g.op("embedding", [g.w("embed"), ids])
        if g.values[x].dtype != act_dtype:
            x = g.op("cast", [x], dtype=act_dtype)
        cs = g.op("reshape", [g.op("embedding", [g.w("rope_cos"), positions])], shape=[T, Dh])
        sn = g.op("reshape", [g.op("embedding", [g.w("rope_sin"), positions])], shape=[T, Dh])
        new_caches = []

        def perm(t, dims):
            # as export emits it (export/aten_table.py): a permute that only moves size-1 dims
            # ([1,1,H,D] -> [1,H,1,D] in decode) is a free reshape, not a copy
            shp = g.values[t].shape
            moved = [d for d in dims if shp[d] != 1]
            if moved == sorted(moved):
                return g.op("reshape", [t], shape=[shp[d] for d in dims])
            return g.op("permute", [t], dims=dims)

        def heads(t, n):
            return perm(g.op("reshape", [t], shape=[1, T, n, Dh]), [0, 2, 1, 3])

        for i in range(cfg.layers):
            h = g.op("rms_norm", [x, g.w(f"l{i}.in_norm")], eps=cfg.eps)
            q = g.op("rope", [heads(g.op("linear", [h, g.w(f"l{i}.q")]), H), cs, sn])
            k = g.op("rope", [heads(g.op("linear", [h, g.w(f"l{i}.k")]), Hk), cs, sn])
            v = heads(g.op("linear", [h, g.w(f"l{i}.v")]), Hk)
            kc = g.op("kv_update", [caches[i][0], k, pos])
            vc = g.op("kv_update", [caches[i][1], v, pos])
            new_caches += [kc, vc]
            a = g.op("sdpa", [q, kc, vc, mask])
            a = g.op("reshape", [perm(a, [0, 2, 1, 3])], shape=[1, T, D])
            x = g.op("add", [x, g.op("linear", [a, g.w(f"l{i}.o")])])
            h = g.op("rms_norm", [x, g.w(f"l{i}.post_norm")], eps=cfg.eps)
            m = g.op("mul", [g.op("silu", [g.op("linear", [h, g.w(f"l{i}.gate")])]), g.op("linear", [h, g.w(f"l{i}.up")])])
            x = g.op("add", [x, g.op("linear", [m, g.w(f"l{i}.down")])])
        if T > 1:
            x = g.op("slice", [x], dim=1, start=T - 1, end=T)
        x = g.op("rms_norm", [x, g.w("norm")], eps=cfg.eps)
        logits = g.op("linear", [x, g.w("embed")])
        g.outputs = [logits] + new_caches
        prog.payloads.append(Payload(g.values, g.inputs, g.outputs, g.nodes))
        # the method: its inputs/outputs typed as the payload's, one delegate call
        mv = [Value(g.values[v].dtype, g.values[v].shape, None, g.values[v].name) for v in g.inputs]
        mo = [Value(g.values[v].dtype, g.values[v].shape, None, "") for v in g.outputs]
        n = len(mv)
        prog.methods[mname] = Method(mv + mo, list(range(n)), list(range(n, n + len(mo))),
                                     [Node(DELEGATE_OP, list(range(n)), list(range(n, n + len(mo))),
                                           {"payload": len(prog.payloads) - 1})], name=mname)
    return prog


def step_inputs(cfg: LlamaConfig, ids: Sequence[int], start: int):
    """ids, positions, pos and mask of one call writing cache rows start..start+T-1 (causal)."""
    T = len(ids)
    positions = np.arange(start, start + T, dtype=np.int32)[None, :]
    mask = np.arange(cfg.max_ctx)[None, :] <= positions[0][:, None]
    return [np.asarray(ids, np.int32)[None, :], positions, np.array([start], np.int32), mask[None, None]]


def empty_caches(cfg: LlamaConfig, dtype=np.float16):
    return [np.zeros((1, cfg.kv_heads, cfg.max_ctx, cfg.head_dim), dtype) for _ in range(2 * cfg.layers)]


# ============================================================================ the same model in torch

def torch_llama(cfg: LlamaConfig, weights: Dict[str, np.ndarray], dtype, device):
    """The same math as ``llama_program`` in PyTorch, with a static KV cache (index_copy_), so it
    can also be compiled with mode="reduce-overhead" (CUDA graphs)."""
    import torch
    import torch.nn.functional as F

    class TorchLlama(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for k, v in weights.items():
                self.register_buffer("w_" + k.replace(".", "_"), torch.from_numpy(np.ascontiguousarray(v)).to(device=device, dtype=dtype))
            cos, sin = rope_tables(cfg)
            self.register_buffer("cos", torch.from_numpy(cos).to(device))
            self.register_buffer("sin", torch.from_numpy(sin).to(device))
            shape = (cfg.layers, 1, cfg.kv_heads, cfg.max_ctx, cfg.head_dim)
            self.register_buffer("kc", torch.zeros(shape, dtype=dtype, device=device))
            self.register_buffer("vc", torch.zeros(shape, dtype=dtype, device=device))

        def w(self, name):
            return getattr(self, "w_" + name.replace(".", "_"))

        def norm(self, x, w):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.eps) * w.float()).to(x.dtype)

        @staticmethod
        def rope(x, cos, sin):
            half = x.shape[-1] // 2
            rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
            return (x.float() * cos + rot.float() * sin).to(x.dtype)

        def forward(self, ids, positions, mask):
            T = ids.shape[1]
            H, Hk, Dh = cfg.heads, cfg.kv_heads, cfg.head_dim
            x = F.embedding(ids, self.w("embed"))
            p = positions[0]
            cos, sin = self.cos[p], self.sin[p]
            for i in range(cfg.layers):
                h = self.norm(x, self.w(f"l{i}.in_norm"))
                q = F.linear(h, self.w(f"l{i}.q")).view(1, T, H, Dh).transpose(1, 2)
                k = F.linear(h, self.w(f"l{i}.k")).view(1, T, Hk, Dh).transpose(1, 2)
                v = F.linear(h, self.w(f"l{i}.v")).view(1, T, Hk, Dh).transpose(1, 2)
                q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
                self.kc[i].index_copy_(2, p, k)
                self.vc[i].index_copy_(2, p, v)
                a = F.scaled_dot_product_attention(q, self.kc[i], self.vc[i], attn_mask=mask, enable_gqa=True)
                x = x + F.linear(a.transpose(1, 2).reshape(1, T, -1), self.w(f"l{i}.o"))
                h = self.norm(x, self.w(f"l{i}.post_norm"))
                x = x + F.linear(F.silu(F.linear(h, self.w(f"l{i}.gate"))) * F.linear(h, self.w(f"l{i}.up")),
                                 self.w(f"l{i}.down"))
            x = self.norm(x[:, -1:], self.w("norm"))
            return F.linear(x, self.w("embed"))

    return TorchLlama().eval()


# ============================================================================ measuring helpers

def median_ms(fn, sync, warmup=3, iters=20) -> float:
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def rel_err(got, want) -> float:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


COLUMNS = [("section", "section"), ("metric", "metric"), ("ours", "gpudelegate (CUDA)"), ("baseline", "baseline"),
           ("note", "note")]


# ============================================================================ sections

def bench_copies(rep: Report, cp) -> float:
    n = 1 << 30
    host = np.empty(n, np.uint8)
    host[:] = 7
    pinned_mem = cp.cuda.alloc_pinned_memory(n)
    pinned = np.frombuffer(pinned_mem, np.uint8, n)
    pinned[:] = 7
    dev = cp.empty(n, np.uint8)
    s = cp.cuda.Stream(non_blocking=True)

    def h2d(src):
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, src.ctypes.data, n, 1, s.ptr)
    ms_p = median_ms(lambda: h2d(pinned), s.synchronize, 2, 10)
    ms_g = median_ms(lambda: h2d(host), s.synchronize, 1, 5)
    gbps = n / ms_p / 1e6
    rep.row("copies", "pinned H2D, 1 GiB", f"{gbps:.1f} GB/s", "", "ceiling of prepack and offload")
    rep.row("copies", "pageable H2D, 1 GiB", f"{n / ms_g / 1e6:.1f} GB/s")
    # one DMA of the SmolLM2 weight bytes (the size of its prepack row)
    m = sum(int(np.prod(sh)) for sh in weight_shapes(SMOLLM2).values()) * 2
    ms_m = median_ms(lambda: cp.cuda.runtime.memcpyAsync(dev.data.ptr, pinned.ctypes.data, m, 1, s.ptr),
                     s.synchronize, 2, 10)
    rep.row("copies", f"pinned H2D, {m / 1e6:.0f} MB (one DMA)", f"{m / ms_m / 1e6:.1f} GB/s", "",
            "the SmolLM2 weight bytes")
    rep.data["pinned_h2d_smollm2_gbps"] = m / ms_m / 1e6
    # the host side of prepack: copying the same bytes into pinned memory on the prepack threads
    from gpudelegate.native.cuda_prepack import _THREADS, parallel_copy
    ms_h = median_ms(lambda: parallel_copy([(pinned[:m], host[:m])]), lambda: None, 2, 10)
    rep.row("copies", f"host memcpy into pinned, {m / 1e6:.0f} MB, {_THREADS} threads", f"{m / ms_h / 1e6:.1f} GB/s", "",
            "the fill side of the staging ring")
    rep.data["host_fill_gbps"] = m / ms_h / 1e6
    rep.data["pinned_h2d_gbps"] = gbps
    return gbps


def bench_conformance(rep: Report, env) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.conformance.cases import CASES, build_program, golden, make_data, tolerance
    import gpudelegate

    passed, failed, worst = 0, [], 0.0
    for case in CASES:
        try:
            data = make_data(case, 0)
            prog, names = build_program(case, data)
            prog = gpudelegate.loads(prog.to_bytes())
            want = golden(case, data)
            with env.session(prog, device="cuda") as sess:
                outs = sess.run("forward", {n: data[n] for n in names})
            rtol, atol = tolerance(case)
            ok = True
            for got, w in zip(outs, want):
                got = np.asarray(got)
                if got.dtype.kind in "biu":
                    ok = ok and np.array_equal(got, w)
                else:
                    g64 = got.astype(np.float64)
                    ok = ok and np.allclose(g64, w, rtol=rtol, atol=atol)
                    worst = max(worst, float(np.max(np.abs(g64 - w) / (atol + rtol * np.abs(w)))) if w.size else 0.0)
            if ok:
                passed += 1
            else:
                failed.append(case.id)
        except Exception as e:
            failed.append(f"{case.id} ({type(e).__name__}: {e})")
    rep.row("conformance", "cases passed (fp32 + fp16)", f"{passed}/{len(CASES)}", "float64 reference kernels",
            f"worst error / tolerance {worst:.2f}")
    rep.data["conformance_failed"] = failed
    for f in failed[:20]:
        print("   FAILED", f)


def bench_models_vs_reference(rep: Report, env, torch, quick: bool) -> None:
    dev = torch.device("cuda")
    # (a) 2 layers at SmolLM2 width: CUDA vs the numpy reference executor, fp32 and fp16
    small = LlamaConfig(vocab=4099, dim=576, layers=2, heads=9, kv_heads=3, hidden=1536, max_ctx=64)
    for dt in ("float32", "float16"):
        w = random_weights(small, 1, np.float32 if dt == "float32" else np.float16)
        prog = llama_program(small, w, {"prefill": 16}, act_dtype=dt)
        inputs = step_inputs(small, list(np.random.default_rng(2).integers(0, small.vocab, 16)), 0) + \
            empty_caches(small, np.float32 if dt == "float32" else np.float16)
        with env.session(prog, device="cuda") as s:
            ours = s.run("prefill", inputs)
        with env.session(prog, device="reference") as s:
            ref = s.run("prefill", inputs)
        e = max(rel_err(a, b) for a, b in zip(ours, ref))
        rep.row("models", f"Llama 2x576, {dt}: logits+caches vs numpy reference", f"rel err {e:.1e}",
                "reference executor", "same storage dtype on both")
    # (b) the full SmolLM2 shape vs PyTorch float64 on the GPU (same weights)
    cfg = SMOLLM2 if not quick else LlamaConfig(vocab=4099, dim=576, layers=4, heads=9, kv_heads=3, hidden=1536)
    ids = list(np.random.default_rng(3).integers(0, cfg.vocab, 128))
    inputs = step_inputs(cfg, ids, 0)
    for dt in ("float32", "float16"):
        npdt = np.float32 if dt == "float32" else np.float16
        w = random_weights(cfg, 0, npdt)
        prog = llama_program(cfg, w, {"prefill": 128}, act_dtype=dt)
        with env.session(prog, device="cuda") as s:
            ours = s.run("prefill", inputs + empty_caches(cfg, npdt))[0]
        m = torch_llama(cfg, w, torch.float64, dev)
        with torch.no_grad():
            gold = m(*[torch.from_numpy(a.astype(np.int64) if a.dtype == np.int32 else a).to(dev)
                       for a in (inputs[0], inputs[1], inputs[3])]).cpu().numpy()
        del m
        e = rel_err(ours, gold)
        rep.row("models", f"SmolLM2 shape, {dt}: prefill-128 logits", f"rel err {e:.1e}", "PyTorch float64 (GPU)",
                "fp16: storage rounding per op" if dt == "float16" else "fp32 (cuBLAS may use TF32: off by default)")
        rep.data[f"smollm2_{dt}_rel_err"] = e


def bench_smollm2(rep: Report, env, cp, torch, quick: bool, n_decode: int = 128) -> None:
    """Prefill latency and decode tokens/s. Decode is teacher-forced (the same fixed tokens on
    every side, so logits can be compared step by step; with random weights the greedy argmax is
    decided by rounding noise among near-equal logits), but each step still takes the argmax on
    the device and reads it back, as a generation loop does."""
    cfg = SMOLLM2 if not quick else LlamaConfig(vocab=4099, dim=576, layers=4, heads=9, kv_heads=3, hidden=1536)
    w = random_weights(cfg, 0, np.float16)
    prog = llama_program(cfg, w, {"prefill": 128, "decode": 1}, act_dtype="float16")
    rng = np.random.default_rng(5)
    prompt = list(rng.integers(0, cfg.vocab, 128))
    feed = [int(t) for t in rng.integers(0, cfg.vocab, n_decode + 2)]
    keep_at = (0, 1, n_decode + 1)  # logits kept for comparison: eager/capture step, first replay, last
    ctx = env.context("cuda")
    sync = ctx.compute_stream.synchronize
    results = {}
    for mode in ("eager", "graph", "graph unfused"):
        sess = env.session(prog, device="cuda", capture_graph=(mode != "eager"), fuse=(mode != "graph unfused"))
        if mode == "eager":
            st = sess.executor.stats
            pin = rep.data.get("pinned_h2d_gbps", 0)
            rep.row("prepack", f"SmolLM2 fp16 ({st['prepack_uploaded'] / 1e6:.0f} MB) session upload",
                    f"{st['prepack_gbps']:.1f} GB/s", f"{pin:.1f} GB/s pinned copy",
                    f"{100 * st['prepack_gbps'] / max(pin, 1e-9):.0f}% of pinned; {st.get('prepack_dmas')} DMAs; "
                    f"build {sess.timings['build'] * 1e3:.0f} ms (plan {sess.timings['plan'] * 1e3:.0f} ms)")
            rep.data["smollm2_prepack"] = {k: st.get(k) for k in ("prepack_uploaded", "prepack_s", "prepack_gbps",
                                                                  "prepack_dmas")}
            kernels = {p: sum(1 for f in stt.steps if f is not None) for p, stt in sess.executor._states.items()}
            rep.row("SmolLM2 fp16 b1", "fusion: dispatches bound per run (prefill / decode)",
                    " / ".join(str(kernels[p]) for p in sorted(kernels)),
                    f"{len(sess.plan.payloads[0].dispatches)} / {len(sess.plan.payloads[1].dispatches)} planned",
                    ", ".join(f"{k} x{v}" for k, v in sorted(st.get("fusions", {}).items())))
            rep.data["smollm2_fusions"] = st.get("fusions", {})
        if mode == "graph":  # a second session of the same program (the ring is pinned by now)
            st2 = sess.executor.stats
            rep.data["smollm2_prepack_second"] = {k: st2.get(k) for k in ("prepack_s", "prepack_gbps")}
            rep.row("prepack", "SmolLM2 fp16 session upload, the next session", f"{st2['prepack_gbps']:.1f} GB/s",
                    f"{rep.data.get('pinned_h2d_smollm2_gbps', 0):.1f} GB/s one pinned DMA of the same bytes",
                    f"{st2['prepack_s'] * 1e3:.1f} ms")
        # Caches fed back from the previous prefill sit where the payload wants them: no copy,
        # as the torch module's cache buffers (kv_update overwrites rows 0..127 each time).
        out = sess.run("prefill", step_inputs(cfg, prompt, 0) + empty_caches(cfg), keep_on_device=True)
        state = {"caches": out[1:]}

        def prefill():
            state["out"] = sess.run("prefill", step_inputs(cfg, prompt, 0) + list(state["caches"]), keep_on_device=True)
            state["caches"] = state["out"][1:]
        ms = median_ms(prefill, sync, 3, 20)
        prefill()
        logits = {"prefill": state["out"][0].numpy().astype(np.float32)}
        caches = state["caches"]
        for step in range(n_decode + 2):  # two untimed steps first (the graph is captured at the first)
            if step == 2:
                sync()
                t0 = time.perf_counter()
            o = sess.run("decode", step_inputs(cfg, [feed[step]], 128 + step) + list(caches), keep_on_device=True)
            int(cp.argmax(o[0].handle))  # ordered after the run by the executor's stream event
            caches = o[1:]
            if step in keep_at[:2]:
                logits[step] = o[0].numpy().astype(np.float32)
        dt = time.perf_counter() - t0
        logits[keep_at[2]] = o[0].numpy().astype(np.float32)
        results[mode] = (ms, n_decode / dt, logits)
        sess.close()
    # PyTorch eager and compiled, the same weights and loop
    dev = torch.device("cuda")
    m = torch_llama(cfg, w, torch.float16, dev)
    as_t = lambda ins: [torch.from_numpy(a.astype(np.int64) if a.dtype == np.int32 else a).to(dev)
                        for a in (ins[0], ins[1], ins[3])]
    tin = as_t(step_inputs(cfg, prompt, 0))

    def torch_run(fwd):
        tsync = torch.cuda.synchronize
        with torch.no_grad():
            ms = median_ms(lambda: fwd(*tin), tsync, 3, 20)
            logits = {"prefill": fwd(*tin).float().cpu().numpy()}
            steps = [as_t(step_inputs(cfg, [feed[i]], 128 + i)) for i in range(n_decode + 2)]
            for i in range(n_decode + 2):
                if i == 2:
                    tsync()
                    t0 = time.perf_counter()
                y = fwd(*steps[i])
                int(y.argmax())
                if i in keep_at[:2]:
                    logits[i] = y.float().cpu().numpy()
            dt = time.perf_counter() - t0
            logits[keep_at[2]] = y.float().cpu().numpy()
            return ms, n_decode / dt, logits

    results["torch eager"] = torch_run(m)
    base = results["torch eager"]
    for mode, (ms, tps, _) in results.items():
        rep.data[f"smollm2_{mode}"] = {"prefill_ms": ms, "decode_tok_s": tps}
    for mode in ("eager", "graph", "graph unfused"):
        ms, tps, lg = results[mode]
        err = max(rel_err(lg[k], base[2][k]) for k in lg)
        rep.row("SmolLM2 fp16 b1", f"prefill-128 latency, ours {mode}", f"{ms:.2f} ms", f"torch eager {base[0]:.2f} ms")
        rep.row("SmolLM2 fp16 b1", f"decode tok/s, ours {mode}", f"{tps:.0f} tok/s", f"torch eager {base[1]:.0f} tok/s",
                f"logits vs torch eager fp16 (prefill, decode steps {list(keep_at)}): max rel err {err:.1e}")
        rep.data[f"smollm2_{mode}"]["logits_rel_err_vs_torch"] = err
    # where the GPU time of one prefill goes (eager run, events around every dispatch)
    with env.session(prog, device="cuda", profile=True, methods=["prefill"]) as sess:
        caches = sess.run("prefill", step_inputs(cfg, prompt, 0) + empty_caches(cfg), keep_on_device=True)[1:]
        sess.executor.profile_ms.clear()
        for _ in range(5):
            caches = sess.run("prefill", step_inputs(cfg, prompt, 0) + list(caches), keep_on_device=True)[1:]
        prof = sorted(((v[0] / 5, v[1] // 5, k) for k, v in sess.executor.profile_ms.items()), reverse=True)
    total = sum(t for t, _, _ in prof)
    rep.data["smollm2_prefill_profile_ms"] = {k: [round(t, 4), n] for t, n, k in prof}
    rep.row("SmolLM2 fp16 b1", "prefill-128 GPU time by op (eager, per run)", f"{total:.2f} ms",
            "", ", ".join(f"{k} {t:.2f} ms/{n}" for t, n, k in prof[:6]))
    # and of one decode step at position 128 (same method: events around every dispatch)
    with env.session(prog, device="cuda", profile=True, methods=["prefill", "decode"]) as sess:
        caches = sess.run("prefill", step_inputs(cfg, prompt, 0) + empty_caches(cfg), keep_on_device=True)[1:]
        caches = sess.run("decode", step_inputs(cfg, [feed[0]], 128) + list(caches), keep_on_device=True)[1:]
        sess.executor.profile_ms.clear()
        for i in range(5):
            caches = sess.run("decode", step_inputs(cfg, [feed[i + 1]], 129 + i) + list(caches), keep_on_device=True)[1:]
        prof = sorted(((v[0] / 5, v[1] // 5, k) for k, v in sess.executor.profile_ms.items()), reverse=True)
    total = sum(t for t, _, _ in prof)
    rep.data["smollm2_decode_profile_ms"] = {k: [round(t, 4), n] for t, n, k in prof}
    rep.row("SmolLM2 fp16 b1", "decode step GPU time by op (eager, per step)", f"{total:.2f} ms",
            "", ", ".join(f"{k} {t:.3f} ms/{n}" for t, n, k in prof[:6]))
    # kept for the torch.compile section, which runs last (its compile time is the least predictable)
    rep.data["_smollm2"] = {"model": m, "tin": tin, "run": torch_run,
                            "decode_in": lambda: as_t(step_inputs(cfg, [1], 128)), "ours": results}


def bench_torch_compile(rep: Report, torch) -> None:
    ctx = rep.data.pop("_smollm2", None)
    if ctx is None:
        rep.row("SmolLM2 fp16 b1", "torch.compile", "", "skipped: the SmolLM2 section did not run")
        return
    t0 = time.perf_counter()
    cm = torch.compile(ctx["model"], mode="reduce-overhead", dynamic=False)
    with torch.no_grad():
        for _ in range(3):  # compile + record the CUDA graphs of both shapes
            cm(*ctx["tin"])
            cm(*ctx["decode_in"]())
    rep.data["torch_compile_s"] = time.perf_counter() - t0
    ms, tps, lg = ctx["run"](cm)
    rep.data["smollm2_torch.compile"] = {"prefill_ms": ms, "decode_tok_s": tps}
    g = ctx["ours"]["graph"]
    rep.row("SmolLM2 fp16 b1", "prefill-128 latency: ours graph vs torch.compile(reduce-overhead)", f"{g[0]:.2f} ms",
            f"{ms:.2f} ms", f"compile + capture took {rep.data['torch_compile_s']:.0f} s")
    rep.row("SmolLM2 fp16 b1", "decode tok/s: ours graph vs torch.compile(reduce-overhead)", f"{g[1]:.0f} tok/s",
            f"{tps:.0f} tok/s")


def bench_offload(rep: Report, env, cp, torch, pinned_gbps: float, quick: bool, n_decode: int = 24) -> None:
    cfg = LLAMA_1B if not quick else LlamaConfig(vocab=8192, dim=1024, layers=4, heads=16, kv_heads=4, hidden=4096)
    t0 = time.perf_counter()
    w = random_weights_gpu(cfg, torch, 0)
    prog = llama_program(cfg, w, {"decode": 1}, act_dtype="float16")
    wbytes = sum(a.nbytes for a in w.values())
    print(f"   weights {wbytes / 1e9:.2f} GB built in {time.perf_counter() - t0:.1f} s")
    budget = (wbytes // 4) // 512 * 512
    ctx = env.context("cuda")
    sync = ctx.compute_stream.synchronize
    feed = [int(t) for t in np.random.default_rng(7).integers(0, cfg.vocab, n_decode + 2)]

    def decode_run(sess, n):
        """Teacher-forced decode (the same tokens in every session), argmax read back per step;
        returns tokens/s and the logits of steps 0 (eager + capture), 1 (first replay), last."""
        caches = empty_caches(cfg)
        logits = []
        for step in range(n + 2):  # two warm-up steps (graph capture happens at the first)
            if step == 2:
                sync()
                t = time.perf_counter()
            o = sess.run("decode", step_inputs(cfg, [feed[step]], step) + list(caches), keep_on_device=True)
            int(cp.argmax(o[0].handle))
            caches = o[1:]
            if step < 2:
                logits.append(o[0].numpy().astype(np.float32))
        dt = time.perf_counter() - t
        logits.append(o[0].numpy().astype(np.float32))
        return n / dt, None, logits

    res = {}
    peak_free = {}
    # At 25% the budget holds the 525 MB embedding (read twice per token: lookup and tied LM
    # head) plus a ring for prefetch depth 1; depth 2 needs a larger floor and is refused.
    try:
        env.session(prog, device="cuda", weight_budget=budget, prefetch_depth=2).close()
        rep.row("Llama-1B fp16 offload", "prefetch depth 2 at 25%", "planned")
    except BudgetError as e:
        rep.row("Llama-1B fp16 offload", "prefetch depth 2 at 25%", "refused: BudgetError", "", str(e)[:90] + "...")
    for name, kw in (("offload graph", dict(weight_budget=budget, prefetch_depth=1, capture_graph=True)),
                     ("offload eager", dict(weight_budget=budget, prefetch_depth=1)),
                     ("resident graph", dict(capture_graph=True))):
        free0 = cp.cuda.runtime.memGetInfo()[0]
        sess = env.session(prog, device="cuda", **kw)
        tps, toks, logits = decode_run(sess, n_decode)
        free1 = cp.cuda.runtime.memGetInfo()[0]
        ex = sess.executor
        res[name] = (tps, toks, logits, dict(ex.memory_report()), sess.plan.offload, dict(ex.stats), sess.timings["build"])
        peak_free[name] = free0 - free1
        sess.close()
    tps, toks, logits, mem, off, st, build = res["offload graph"]
    streamed = off.stream_bytes[0]
    bound = pinned_gbps * 1e9 / streamed
    rep.row("Llama-1B fp16 offload", "weights / budget (25%) / floor",
            f"{wbytes / 1e9:.2f} GB / {budget / 1e9:.3f} GB / {off.floor / 1e9:.3f} GB", "",
            f"{len(off.resident)} resident, {len(off.streamed)} streamed, {len(off.slots)} slots, depth {off.depth}")
    rep.row("Llama-1B fp16 offload", "weight pool bytes (resident + ring) vs budget",
            f"{mem['weight_pool_bytes'] / 1e9:.3f} GB", f"budget {budget / 1e9:.3f} GB",
            "under budget" if mem["weight_pool_bytes"] <= budget else "OVER BUDGET")
    rep.row("Llama-1B fp16 offload", "decode tok/s, ours (CUDA graph)", f"{tps:.1f} tok/s",
            f"bound {bound:.1f} tok/s", f"{streamed / 1e9:.2f} GB streamed/token at {pinned_gbps:.1f} GB/s = "
                                        f"{100 * tps / bound:.0f}% of bound")
    rep.row("Llama-1B fp16 offload", "decode tok/s, ours (eager)", f"{res['offload eager'][0]:.1f} tok/s", f"bound {bound:.1f} tok/s")
    rep.row("Llama-1B fp16 resident", "decode tok/s, all weights on the GPU (graph)", f"{res['resident graph'][0]:.1f} tok/s")
    e = max(rel_err(a, b) for name in ("offload graph", "offload eager")
            for a, b in zip(res[name][2], res["resident graph"][2]))
    rep.row("Llama-1B fp16 offload", "offloaded (graph, eager) vs resident: logits of steps 0, 1, last",
            f"max rel err {e:.1e}", "", "identical" if e == 0 else "same kernels and inputs: expected identical")
    rst = res["resident graph"][5]
    rep.row("prepack", f"Llama-1B fp16 ({wbytes / 1e9:.2f} GB) resident session upload", f"{rst['prepack_gbps']:.1f} GB/s",
            f"{pinned_gbps:.1f} GB/s pinned copy", f"{100 * rst['prepack_gbps'] / pinned_gbps:.0f}% of pinned; "
                                                 f"{rst.get('prepack_dmas')} DMAs; build {res['resident graph'][6]:.1f} s")
    rep.data["llama1b"] = {"budget": budget, "floor": off.floor, "weights": wbytes, "stream_bytes": streamed,
                           "tok_s": {k: v[0] for k, v in res.items()}, "bound_tok_s": bound, "memory": mem,
                           "device_bytes_held_during_run": peak_free}
    # accelerate's cpu_offload of the same model in transformers (fp16, same weights)
    try:
        tps_acc = accelerate_offload(cfg, w, torch, n=4 if not quick else 2)
        rep.row("Llama-1B fp16 offload", "decode tok/s, accelerate cpu_offload", f"{tps:.1f} tok/s (ours)",
                f"{tps_acc:.2f} tok/s", f"{tps / tps_acc:.1f}x")
        rep.data["llama1b"]["accelerate_tok_s"] = tps_acc
    except Exception as e:
        traceback.print_exc()
        rep.row("Llama-1B fp16 offload", "accelerate cpu_offload", "", f"failed: {type(e).__name__}: {str(e)[:100]}")


def accelerate_offload(cfg: LlamaConfig, w, torch, n: int) -> float:
    from accelerate import cpu_offload
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

    hf = HFConfig(vocab_size=cfg.vocab, hidden_size=cfg.dim, intermediate_size=cfg.hidden, num_hidden_layers=cfg.layers,
                  num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_ctx,
                  rope_theta=cfg.theta, rms_norm_eps=cfg.eps, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf)
    t = lambda k: torch.from_numpy(np.ascontiguousarray(w[k]))
    sd = {"model.embed_tokens.weight": t("embed"), "model.norm.weight": t("norm"), "lm_head.weight": t("embed")}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": t(f"l{i}.in_norm"), p + "post_attention_layernorm.weight": t(f"l{i}.post_norm"),
                   p + "self_attn.q_proj.weight": t(f"l{i}.q"), p + "self_attn.k_proj.weight": t(f"l{i}.k"),
                   p + "self_attn.v_proj.weight": t(f"l{i}.v"), p + "self_attn.o_proj.weight": t(f"l{i}.o"),
                   p + "mlp.gate_proj.weight": t(f"l{i}.gate"), p + "mlp.up_proj.weight": t(f"l{i}.up"),
                   p + "mlp.down_proj.weight": t(f"l{i}.down")})
    model.load_state_dict(sd, assign=True, strict=False)
    model.tie_weights()
    # non-persistent buffers (rotary inv_freq) are still on meta: rebuild them on the CPU
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf)
    model = model.eval()  # weights float16 as loaded; the rotary table stays float32 as transformers makes it
    cpu_offload(model, execution_device=torch.device("cuda:0"))
    ids = torch.tensor([[11]], device="cuda:0")
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


# ============================================================================ main

def main(argv=None) -> int:
    args = parse_args(argv, __doc__, "cuda", "--quick", "small shapes (a smoke run of every section)",
                      "copies,conformance,models,smollm2,offload,compile")
    want = set(args.sections.split(","))

    import gpudelegate
    from gpudelegate.native.cuda_executor import import_cupy

    cp = import_cupy()
    import torch

    env = gpudelegate.Environment()
    ctx = env.context("cuda")
    rep = Report(COLUMNS)
    info = ctx.info()
    rep.data["device"] = {"name": info["device"], "cc": info["compute_capability"], "memory": info["memory"],
                          "cupy": info["cupy"], "cuda_runtime": info["cuda_runtime"], "torch": torch.__version__,
                          "python": platform.python_version(), "quick": args.quick}
    print(f"device: {info['device']} cc {info['compute_capability']}, cupy {info['cupy']}, torch {torch.__version__}")
    write = result_writer(rep, args.out, "cuda", info["device"], "--quick" if args.quick else "",
                          "CUDA executor benchmark",
                          f"cupy {info['cupy']}, CUDA runtime {info['cuda_runtime']}, torch {torch.__version__}")

    steps = [("copies", lambda: bench_copies(rep, cp)),
             ("conformance", lambda: bench_conformance(rep, env)),
             ("models", lambda: bench_models_vs_reference(rep, env, torch, args.quick)),
             ("smollm2", lambda: bench_smollm2(rep, env, cp, torch, args.quick)),
             ("offload", lambda: bench_offload(rep, env, cp, torch, rep.data.get("pinned_h2d_gbps", 50.0), args.quick)),
             ("compile", lambda: bench_torch_compile(rep, torch))]
    for name, fn in steps:
        if name in want:
            section(rep, name, fn)
            write()
    env.close()
    return finish(rep, write)


if __name__ == "__main__":
    sys.exit(main())
