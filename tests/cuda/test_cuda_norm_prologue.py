"""The rms-norm prologue of the decode products on CUDA (native/cuda_norm_prologue.py,
shaders/cuda_norm_prologue.cu, hgemv_norm of cuda_gemv.cu, qgemv_norm of cuda_quant.cu): the
planner's Fusion.norm (core/plan/fusion.py), carried out inside the concatenated product's launch.

GPU tests (``@pytest.mark.gpu``) hold each kernel to the unfused chain it replaces (the
add_rms_norm / rms_norm kernel storing s and h, then the plain GEMV on h) bit for bit: the
prologue sums the squares in the unfused kernel's order and rounds s and h where it stores them,
and the product runs the same FMAs on the same values; and to float64 at the GEMV's tolerances.
Sizes are prime where the kernels allow (N = 211 output rows); K covers one, three and eight
virtual warps of the unfused norm's block (72 / 96, 200, 328, 576: SmolLM2's hidden size). Decoders
then run with the planner's groups: float16 weights against float32 activations and packed
weights take the prologue inside the product (``norm_prologue`` in the executor's stats), float32
weights (cuBLAS) run the norm into the group's scratch first (``norm_unfused``), each against the
unfused session and the numpy reference, eagerly and replayed from CUDA graphs.

The CPU test checks where the scratch holds h for the unfused way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import gpudelegate
from gpudelegate import dtypes as _dt
from gpudelegate.native import quant
from gpudelegate.native.cuda_fused_ops import scratch_bytes
from gpudelegate.plan import plan_session
from gpudelegate.plan.types import DeviceLimits

from cuda_env import REASON, cp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_cuda as bc  # noqa: E402

LIMITS = DeviceLimits(max_buffer_size=1 << 34, max_binding_size=1 << 34, offset_alignment=256, name="test")
TINY = bc.LlamaConfig(vocab=257, dim=96, layers=2, heads=6, kv_heads=2, hidden=160, max_ctx=37)
PACKED = list(_dt.PACKED_DTYPES)
N = 211


# ---------------------------------------------------------------------------- CPU: the scratch

def test_scratch_holds_h_past_the_concatenated_product():
    prog = bc.llama_program(TINY, bc.random_weights(TINY, 0, np.float16), {"decode": 1}, act_dtype="float32")
    plan = plan_session(prog, LIMITS)
    disp = plan.payloads[0].dispatches
    normed = [f for f in plan.fusions[0] if f.norm]
    assert normed
    for f in normed:
        rows = 1
        n = sum(disp[k].args[1].shape[0] for k in f.cat)
        h = disp[f.cat[0]].args[0]
        assert -(-rows * n * 4 // 256) * 256 + _dt.numel(h.shape) * 4 == scratch_bytes(f, disp)


# ---------------------------------------------------------------------------- GPU: kernels

def _inputs(m: int, k: int, add: bool, wdt, act, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(act)
    y = rng.standard_normal((m, k)).astype(act) if add else None
    w = (rng.standard_normal(k) * 0.5 + 1.0).astype(wdt) if wdt is not None else None
    return x, y, w


def _golden_h(x, y, w, eps):
    s = x.astype(np.float64) + (y.astype(np.float64) if y is not None else 0.0)
    h = s / np.sqrt((s * s).mean(-1, keepdims=True) + eps)
    return h * (w.astype(np.float64) if w is not None else 1.0)


def _prologue(x, y, w, eps, s=None):
    from gpudelegate.native.cuda_norm_prologue import NormPrologue

    dx = cp.asarray(x) if isinstance(x, np.ndarray) else x
    dy = (cp.asarray(y) if isinstance(y, np.ndarray) else y) if y is not None else None
    dw = (cp.asarray(w) if isinstance(w, np.ndarray) else w) if w is not None else None
    if s is None and y is not None:
        s = cp.full(x.shape, np.nan, x.dtype)
    return NormPrologue(dx, dy, dw, s, eps)


def _unfused_h(kern, pro):
    """(h, s) as the unfused chain stores them: the add_rms_norm / rms_norm kernel, on its own."""
    h = cp.empty(pro.x.shape, pro.x.dtype)
    s = cp.full(pro.x.shape, np.nan, pro.x.dtype) if pro.y is not None else None
    _prologue(pro.x, pro.y, pro.w, pro.eps, s).unfused(kern, h)()
    return h, s


def _weight(kind: str, n: int, k: int, seed: int):
    """(device weight for CudaKernels.linear, float64 values)."""
    from gpudelegate.native.cuda_quant import packed_view

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    if kind == "float16":
        w16 = w.astype(np.float16)
        return cp.asarray(w16), w16.astype(np.float64)
    blocks = quant.quantize(kind, w)
    raw = cp.asarray(np.ascontiguousarray(blocks).reshape(-1).view(np.uint8))
    return packed_view(cp, kind, (n, k), raw.data), quant.dequantize(kind, blocks, (n, k)).astype(np.float64)


def _check(pro, s_ref, got, want, golden, rtol, atol, what):
    np.testing.assert_array_equal(got.get(), want.get(), err_msg=f"{what}: fused differs from the unfused chain")
    if s_ref is not None:
        np.testing.assert_array_equal(pro.s.get(), s_ref.get(), err_msg=f"{what}: s")
    np.testing.assert_allclose(got.get().astype(np.float64), golden, rtol=rtol, atol=atol, err_msg=what)


def _cases():
    out = []
    for kind in ["float16"] + PACKED:
        for act in (["float32"] if kind == "float16" else ["float32", "float16"]):
            for k in ((72, 200, 328, 576) if kind == "float16" else (96, 576)):
                for m in (1, 3, 8):
                    for add, wdt in ((True, "float16"), (True, "float32"), (False, "float32"), (True, None)):
                        out.append((kind, act, k, m, add, wdt))
    return out


CASES = _cases()


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
@pytest.mark.parametrize("kind,act,k,m,add,wdt", CASES,
                         ids=[f"{c[0]}-{c[1]}-k{c[2]}-m{c[3]}-{'add' if c[4] else 'noadd'}-w{c[5]}" for c in CASES])
def test_product_with_norm_prologue_equals_the_unfused_chain(env, kind, act, k, m, add, wdt):
    kern = env.context("cuda").kernels
    act_np = np.float32 if act == "float32" else np.float16
    x, y, w = _inputs(m, k, add, None if wdt is None else np.dtype(wdt), act_np, seed=m * 7 + k)
    eps = 1e-5
    pro = _prologue(x, y, w, eps)
    wd, w64 = _weight(kind, N, k, seed=k)
    out = cp.full((m, N), np.nan, act_np)
    fn = kern.linear_norm(pro, wd, out, "test")
    assert fn is not None, "no kernel took the prologue"
    fn()
    h, s_ref = _unfused_h(kern, pro)
    want = cp.full((m, N), np.nan, act_np)
    kern.linear(h, wd, None, want, "unfused")()
    golden = _golden_h(x, y, w, eps) @ w64.T
    # float32: the GEMV's bound (conformance); float16: h and the output are float16-rounded
    rtol, atol = (1e-4, 2e-5 * k ** 0.5) if act == "float32" else (1e-2, 4e-3 * k ** 0.5)
    _check(pro, s_ref, out, want, golden, rtol, atol, f"{kind} {act} k={k} m={m} add={add} w={wdt}")


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.parametrize("m", [1, 5])
def test_gate_up_silu_with_norm_prologue_equals_the_unfused_chain(env, dtype, m):
    kern = env.context("cuda").kernels
    k, n = 576, 211
    x, y, w = _inputs(m, k, True, np.dtype("float32"), np.float32, seed=m)
    pro = _prologue(x, y, w, 1e-6)
    wd, w64 = _weight(dtype, 2 * n, k, seed=3)
    out = cp.full((m, n), np.nan, np.float32)
    fn = kern.quant.gemv_silu(cp.empty((m, k), np.float32), wd, 0, n, n, out, norm=pro)
    assert fn is not None
    fn()
    h, s_ref = _unfused_h(kern, pro)
    want = cp.full((m, n), np.nan, np.float32)
    kern.quant.gemv_silu(h, wd, 0, n, n, want)()
    hg = _golden_h(x, y, w, 1e-6)
    g, u = hg @ w64[:n].T, hg @ w64[n:].T
    golden = g / (1.0 + np.exp(-g)) * u
    _check(pro, s_ref, out, want, golden, 1e-4, 2e-5 * k ** 0.5 * float(np.abs(u).max()), f"{dtype} m={m}")


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_products_without_a_prologue_kernel_say_so(env):
    # float32 weights (cuBLAS) and an output overlapping the norm's operands: no kernel takes the
    # prologue (the fusion binding then runs it unfused into its scratch)
    kern = env.context("cuda").kernels
    x, y, w = _inputs(1, 96, True, np.dtype("float32"), np.float32, seed=0)
    pro = _prologue(x, y, w, 1e-5)
    assert kern.linear_norm(pro, cp.ones((N, 96), np.float32), cp.empty((1, N), np.float32), "t") is None
    wd, _ = _weight("float16", 96, 96, seed=1)
    assert kern.linear_norm(pro, wd, pro.y, "t") is None  # out = y: blocks would read what others write
    assert kern.linear_norm(pro, wd, cp.empty((1, 96), np.float32), "t") is not None


# ---------------------------------------------------------------------------- GPU: decoders

def _generate(sess, cfg, prompt, n, np_dt):
    out = sess.run("prefill", bc.step_inputs(cfg, prompt, 0) + bc.empty_caches(cfg, np_dt), keep_on_device=True)
    logits = [out[0].numpy()]
    caches = out[1:]
    for i in range(n):
        tok = int(np.argmax(logits[-1]))
        out = sess.run("decode", bc.step_inputs(cfg, [tok], len(prompt) + i) + list(caches), keep_on_device=True)
        logits.append(out[0].numpy())
        caches = out[1:]
    return logits


def _pack(prog, dtype):
    """The decoder's linear weights stored as ``dtype`` blocks (the embedding stays float)."""
    names = {f"l{i}.{n}" for i in range(TINY.layers) for n in ("q", "k", "v", "o", "gate", "up", "down")}
    new = {}
    for pl in prog.payloads:
        for v in pl.values:
            if v.constant is None or v.name not in names:
                continue
            if v.constant not in new:
                c = prog.constants[v.constant]
                wf = np.frombuffer(prog.constant_bytes(v.constant), np.float32).reshape(c.shape)
                new[v.constant] = prog.add_constant(dtype, c.shape, quant.quantize(dtype, wf))
            v.constant, v.dtype = new[v.constant], dtype


DECODERS = [("float16 weights", np.float16, None, "norm_prologue"),
            ("q4_1 weights", np.float32, "q4_1", "norm_prologue"),
            ("q8_0 weights", np.float32, "q8_0", "norm_prologue"),
            ("float32 weights", np.float32, None, "norm_unfused")]


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
@pytest.mark.parametrize("name,wdt,packed,stat", DECODERS, ids=[d[0] for d in DECODERS])
def test_decoder_with_norm_prologues_matches_unfused_and_reference(env, name, wdt, packed, stat):
    prog = bc.llama_program(TINY, bc.random_weights(TINY, 5, wdt), {"prefill": 7, "decode": 1}, act_dtype="float32")
    if packed:
        _pack(prog, packed)
        prog = gpudelegate.loads(prog.to_bytes())
    prompt = [5, 17, 3, 250, 9, 101, 42]
    with env.session(prog, device="reference") as ref:
        want = _generate(ref, TINY, prompt, 4, np.float32)
    runs = {}
    for run, kw in (("unfused", dict(fuse=False)), ("eager", {}), ("graph", dict(capture_graph=True))):
        with env.session(prog, device="cuda", **kw) as s:
            runs[run] = _generate(s, TINY, prompt, 4, np.float32)
            st = s.executor.stats
            if run != "unfused":
                # both payloads (7 and 1 rows): every q/k/v and gate/up product of every layer
                assert st.get(stat) == 2 * 2 * TINY.layers, st
    for i, (a, b, c, r) in enumerate(zip(runs["eager"], runs["graph"], runs["unfused"], want)):
        np.testing.assert_array_equal(a, b, err_msg=f"{name} step {i}: replayed graph differs from eager")
        assert bc.rel_err(a, r) < 1e-4, (name, i, bc.rel_err(a, r))
        assert bc.rel_err(a, c) < 2.5e-5, (name, i, bc.rel_err(a, c))
