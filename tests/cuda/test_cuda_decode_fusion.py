"""Decode groups carried out inside the packed GEMV on CUDA (native/cuda_fused_ops.py,
shaders/cuda_quant.cu): the planner's rope_kv group over a q/k/v product with at most 8 rows
(``QuantKernels.gemv_rope``: the rotations and the cache writes in the product's own launch) and
its sdpa_linear group (``QuantKernels.gemv_attn``, where ``attn_in_product`` is set: the
split-key attention's partials merged in the o product's prologue, no sdpa_combine launch).

The first test is pure Python (CI has no GPU): the decode plan of a packed decoder holds both
groups. The rest (``-m gpu``) run on the GPU machine: each kernel against float64 numpy on
prime-sized shapes, a packed decoder (each GGUF type) eager, replayed from CUDA graphs and unfused
against the reference executor, and greedy ids against the reference's.

Tolerances: activations are float32, weights gguf's own float32 values, so the kernels differ
from float64 only by float32 rounding of their sums (relative 1e-5 per kernel, 1e-4 over a
whole decoder, the bounds of tests/cuda/test_cuda_quant.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import gpudelegate
from gpudelegate.native import quant
from gpudelegate.plan import plan_session
from gpudelegate.plan.fusion import cat_candidates, match
from gpudelegate.plan.types import DeviceLimits

from cuda_env import REASON, cp
from packed_program import pack_program

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_cuda as bc  # noqa: E402

LIMITS = DeviceLimits(max_buffer_size=1 << 34, max_binding_size=1 << 34, offset_alignment=256, name="test")
# 131 cache rows: the decode attention runs in 9 key splits of 16 (decode_key_tile; one split would
# leave nothing to merge)
CFG = bc.LlamaConfig(vocab=263, dim=96, layers=2, heads=6, kv_heads=2, hidden=160, max_ctx=131)
LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
PACKED = ("q4_0", "q4_1", "q8_0")


def gpu(test):
    """A test for the GPU machine (skipped where no CUDA device answers)."""
    return pytest.mark.gpu(pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")(test))


def _packed_program(lin: str, methods, seed: int = 3, scale: float = 1.0):
    """CFG's decoder with float32 activations, its linears stored as ``lin`` blocks and its
    embedding (also read as the LM head) as q8_0, loaded back from its bytes. ``scale``
    multiplies every weight but the norms' (larger weights: greedy tokens that vary)."""
    ws = bc.random_weights(CFG, seed, np.float32)
    ws = {n: w if n.endswith("norm") else w * np.float32(scale) for n, w in ws.items()}
    prog = bc.llama_program(CFG, ws, methods, act_dtype="float32")
    names = {f"l{i}.{n}": lin for i in range(CFG.layers) for n in LINEARS}
    names["embed"] = "q8_0"
    pack_program(prog, names)
    return gpudelegate.loads(prog.to_bytes())


def test_a_packed_decode_plan_has_both_groups():
    prog = _packed_program("q4_1", {"decode": 1})
    plan = plan_session(prog, LIMITS)
    fs = match(plan.payloads[0], 0, plan.prepack.value_buffer, contiguous=cat_candidates(plan))
    kinds = [(f.kind, bool(f.cat), f.norm is not None) for f in fs]
    assert kinds.count(("rope_kv", True, True)) == CFG.layers  # q/k/v with the norm prologue
    att = [f for f in fs if f.kind == "sdpa_linear"]
    assert len(att) == CFG.layers and all(f.roles["add"] is None for f in att)  # the add is the MLP's prologue


# ---------------------------------------------------------------------------- GPU: the kernels

def _blocks(dtype: str, n: int, k: int, rng):
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[:, ::7] *= 4.0  # blocks with a wide range: the scale and (q4_1) the offset both matter
    b = quant.quantize(dtype, w)
    return b, quant.dequantize(dtype, b, (n, k)).astype(np.float64)


def _rotate(y, cos, sin):
    """rope of [..., T, D] rows (Llama's half rotation) in float64."""
    h = y.shape[-1] // 2
    a, c = y[..., :h], y[..., h:]
    return np.concatenate([a * cos[:, :h] - c * sin[:, :h], c * cos[:, h:] + a * sin[:, h:]], axis=-1)


@pytest.mark.parametrize("T,pos", [(1, 4), (3, 9)], ids=["decode", "3rows-past-end"])
@pytest.mark.parametrize("dtype", PACKED)
@gpu
def test_gemv_rope_against_float64(env, dtype, T, pos):
    """q (3 heads, rotated, contiguous), k (1 head, rotated, into the cache) and v (1 head, into
    the cache) of D = 18 from K = 224, T rows at cache row pos (rows past S = 11 are skipped)."""
    from gpudelegate.native.cuda_quant import PackedView, RopeOut

    rng = np.random.default_rng(17 + T)
    D, K, S, heads = 18, 224, 11, (3, 1, 1)
    N = sum(heads) * D
    blocks, w64 = _blocks(dtype, N, K, rng)
    raw = cp.asarray(blocks.reshape(-1))
    x = rng.standard_normal((T, K)).astype(np.float32)
    cos, sin = rng.standard_normal((2, T, D)).astype(np.float32)
    q = cp.full((1, 3, T, D), np.nan, np.float32)
    kc0 = rng.standard_normal((1, 1, S, D)).astype(np.float32)
    kc, vc = cp.asarray(kc0), cp.asarray(kc0 + 1)
    st = RopeOut(dsts=(q, kc, vc), heads=heads, cache=(False, True, True), rope=(True, True, False),
                 cos=cp.asarray(cos), sin=cp.asarray(sin), pos=cp.asarray(np.array([pos], np.int32)), T=T, D=D, S=S)
    fn = env.context("cuda").kernels.quant.gemv_rope(cp.asarray(x), PackedView(dtype, (N, K), raw), st)
    assert fn is not None
    fn()
    y = x.astype(np.float64) @ w64.T  # [T, N]
    parts = np.split(y, np.cumsum([h * D for h in heads])[:-1], axis=1)
    c64, s64 = cos.astype(np.float64), sin.astype(np.float64)
    want_q = _rotate(parts[0].reshape(T, 3, D).transpose(1, 0, 2), c64, s64)[None]
    want_k, want_v = kc0.astype(np.float64).copy(), kc0.astype(np.float64) + 1
    rows = [t for t in range(T) if pos + t < S]
    kr = _rotate(parts[1].reshape(T, 1, D).transpose(1, 0, 2), c64, s64)[0]
    for t in rows:
        want_k[0, 0, pos + t] = kr[t]
        want_v[0, 0, pos + t] = parts[2][t]
    for got, want in ((q, want_q), (kc, want_k), (vc, want_v)):
        np.testing.assert_allclose(got.get(), want, rtol=1e-5, atol=1e-5 * K ** 0.5)


@pytest.mark.parametrize("M,H,dv", [(1, 7, 32), (3, 1, 224)], ids=["decode", "one-head-3rows"])
@pytest.mark.parametrize("dtype", PACKED)
@gpu
def test_gemv_attn_against_float64(env, dtype, M, H, dv):
    """The o product (N = 131, + bias) on 5 splits' partials of M H rows of dv, one split of one
    row having seen no key (m = -inf): the merge sdpa_combine does, in float64, then x @ W^T + b."""
    from gpudelegate.native.cuda_quant import PackedView

    rng = np.random.default_rng(5 + M)
    splits, N = 5, 131
    rows, K = M * H, H * dv
    blocks, w64 = _blocks(dtype, N, K, rng)
    po = rng.standard_normal((splits, rows, dv)).astype(np.float32)
    ml = np.stack([rng.standard_normal((splits, rows)), rng.uniform(0.5, 3, (splits, rows))], -1).astype(np.float32)
    ml[2, 0] = (-np.inf, 0.0)
    bias = rng.standard_normal(N).astype(np.float32)
    out = cp.full((M, N), np.nan, np.float32)
    qk = env.context("cuda").kernels.quant
    keep = qk.attn_in_product
    qk.attn_in_product = True  # off by default (docs/NOTES.md): the kernel is tested all the same
    try:
        fn = qk.gemv_attn(cp.asarray(po), cp.asarray(ml), rows, dv, splits,
                          PackedView(dtype, (N, K), cp.asarray(blocks.reshape(-1))), cp.asarray(bias), out, "test")
    finally:
        qk.attn_in_product = keep
    assert fn is not None
    fn()
    m, l = ml[..., 0].astype(np.float64), ml[..., 1].astype(np.float64)
    wts = np.where(np.isneginf(m), 0.0, np.exp(m - m.max(axis=0)))
    x = (wts[..., None] * po).sum(0) / (wts * l).sum(0)[:, None]  # [rows, dv]
    want = x.reshape(M, K) @ w64.T + bias
    np.testing.assert_allclose(out.get(), want, rtol=1e-5, atol=1e-5 * K ** 0.5)


# ---------------------------------------------------------------------------- GPU: a packed decoder

def _steps(sess, prompt, feed, greedy=0):
    """Prefill (7 rows: q/k/v with the rotations in the product too), then a decode step per token
    of ``feed`` (the same tokens everywhere, so a near-tie of random logits cannot part two
    executors), then ``greedy`` steps feeding each step's argmax. (logits of every step, greedy ids)."""
    out = sess.run("prefill", bc.step_inputs(CFG, prompt, 0) + bc.empty_caches(CFG, np.float32), keep_on_device=True)
    logits, caches = [out[0].numpy()], out[1:]
    ids, n = [], len(prompt)
    for tok in list(feed) + [None] * greedy:
        if tok is None:
            tok = int(np.argmax(logits[-1].reshape(-1)))
            ids.append(tok)
        out = sess.run("decode", bc.step_inputs(CFG, [tok], n) + list(caches), keep_on_device=True)
        logits.append(out[0].numpy())
        caches, n = out[1:], n + 1
    return logits, ids


PROMPT = [5, 17, 3, 250, 9, 101, 42]
FEED = [33, 0, 262, 12, 12, 190]


MERGES = {"o-product": True, "combine": False}  # QuantKernels.attn_in_product


def _merge_knobs(env, mode):
    """Sets the attention merge ``mode`` on the context's kernels; returns a function restoring it."""
    q = env.context("cuda").kernels.quant
    keep = q.attn_in_product
    q.attn_in_product = MERGES[mode]

    def restore():
        q.attn_in_product = keep
    return restore


@pytest.mark.parametrize("mode", sorted(MERGES))
@pytest.mark.parametrize("dtype", PACKED)
@gpu
def test_packed_decoder_with_both_groups_in_the_products(env, dtype, mode):
    prog = _packed_program(dtype, {"prefill": len(PROMPT), "decode": 1})
    runs = {}
    restore = _merge_knobs(env, mode)
    try:
        for name, kw in (("eager", {}), ("graph", {"capture_graph": True}), ("unfused", {"fuse": False})):
            with env.session(prog, device="cuda", **kw) as s:
                runs[name] = _steps(s, PROMPT, FEED)[0]
                st = s.executor.stats
                if name != "unfused":
                    # q/k/v of every layer in prefill (7 rows) and decode; the attention merge in decode
                    assert st.get("rope_in_product") == 2 * CFG.layers, st
                    assert st.get("attn_in_product") == (CFG.layers if mode == "o-product" else None), st
    finally:
        restore()
    with env.session(prog, device="reference") as s:
        ref = _steps(s, PROMPT, FEED)[0]
    for i, (a, b, c, r) in enumerate(zip(runs["eager"], runs["graph"], runs["unfused"], ref)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {i}: replayed graph differs from eager")
        for name, x in (("eager", a), ("unfused", c)):
            assert bc.rel_err(x, r) < 1e-4, (name, i, bc.rel_err(x, r))


@gpu
def test_greedy_ids_on_the_fused_decoder_are_the_references(env):
    """16 greedy steps of the q4_1 decoder replayed from its graphs give the reference's ids. Its
    weights 20 times the init's make 13 different tokens, and the top two logits of every step
    stay at least 2% of the largest apart in the reference: far beyond float32 rounding."""
    prog = _packed_program("q4_1", {"prefill": len(PROMPT), "decode": 1}, seed=11, scale=20.0)
    with env.session(prog, device="reference") as s:
        _, want = _steps(s, PROMPT, [], greedy=16)
    with env.session(prog, device="cuda", capture_graph=True) as s:
        _, got = _steps(s, PROMPT, [], greedy=16)
        assert s.executor.stats.get("rope_in_product") == 2 * CFG.layers
    assert got == want
    assert len(set(want)) >= 3, want
