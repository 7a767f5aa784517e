"""qgemv41x (native/cuda_qgemv_fast.py, shaders/cuda_qgemv_fast.cu): the q4_1 decode GEMV whose
weights are masked nibbles read as exact denormal floats against power-of-two scaled activations.

CPU: its launch arithmetic (chunks of the staged activations, warps a row, shared memory) and
which products take it by default. GPU (qgemv41x forced, as for products too small to take it):
every variant against float64 numpy on gguf's dequantized weights, over prime row counts, rows of
several chunks with a partial last group, 1..8 activation rows, float32 and float16 activations,
and activations far from 1 in magnitude (the scaling follows each half block's largest exponent).

Tolerance: the float32 bound of tests/cuda/test_cuda_quant.py (rtol 1e-4, atol 1e-5 sqrt(K)).
q, d, m and the power-of-two scalings are exact; what differs from the reference is float32
rounding of the products q x and of the sums, in another order (d * sum(q x) + m * sum(x) per half
block), the same error class as the other GEMVs.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpudelegate.native import quant
from gpudelegate.native.cuda_qgemv_fast import (GROUP, QX_GROUP_BYTES, QX_SMEM, QX_SMEM_MAX, QX_SMEM_OPT_IN,
                                                 QX_SMEM_WHOLE, FastQ41, fast_launch)

from cuda_env import REASON, cp


def _weights(n: int, k: int, seed: int):
    """(q4_1 blocks [n, row bytes], gguf's dequantization in float64)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[:, ::7] *= 4.0  # blocks with a wide range: the scale and the offset both matter
    blocks = quant.quantize("q4_1", w)
    return blocks, quant.dequantize("q4_1", blocks, (n, k)).astype(np.float64)


def _tol(k: int, storage: str = "float32"):
    return (1e-4, 1e-5 * k ** 0.5) if storage == "float32" else (1e-2, 2e-3 * k ** 0.5)


# ---------------------------------------------------------------------------- CPU: launches

@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (576, 1536), (14336, 4096), (4096, 14336), (1031, 3616),
                                 (7, 32)])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_fast_launch_chunks_cover_the_row_within_the_shared_memory(n, k, m):
    lp = fast_launch(n, k, m)
    groups = -(-(k // 32) // GROUP)
    assert lp is not None
    assert lp.kcg % (lp.split_k * lp.steps) == 0  # a trip never crosses a chunk
    assert lp.chunks * lp.kcg >= groups > (lp.chunks - 1) * lp.kcg
    # a 32-warp block may stage the whole row at once (up to QX_SMEM_WHOLE), else chunks
    most = QX_SMEM_WHOLE if lp.chunks == 1 and lp.warps == 32 else QX_SMEM
    assert lp.smem == lp.mm * lp.kcg * QX_GROUP_BYTES <= most
    rows = lp.warps // lp.split_k * lp.rows_per_warp
    assert lp.grid * rows >= n > (lp.grid - 1) * rows


def test_fast_launch_choices():
    # one x row: about one 32-row block an SM (an 8B down: 31 rows an SM on 132 SMs) -> 32 warps
    # of 1 row, the whole row staged (28 groups, 64.5 KiB); many (its gate / up: 108) -> 8 warps of
    # 2 rows; fewer (2048 rows: 16) -> 16 warps of 2 rows
    lp = fast_launch(4096, 14336, 1)
    assert (lp.steps, lp.split_k, lp.warps, lp.rows_per_warp, lp.grid) == (2, 1, 32, 1, 4096 // 32)
    assert (lp.chunks, lp.kcg, lp.smem) == (1, 28, 28 * QX_GROUP_BYTES)
    lp = fast_launch(14336, 4096, 1)
    assert (lp.warps, lp.rows_per_warp, lp.grid, lp.chunks) == (8, 2, 14336 // 16, 1)
    assert fast_launch(4096, 14336, 1, sm_count=64).warps == 8  # 64 rows an SM
    assert (fast_launch(2048, 2048, 1).warps, fast_launch(2048, 2048, 1).rows_per_warp) == (16, 2)
    assert fast_launch(2048, 2048, 1, sm_count=64).warps == 32
    # a device that allows less shared memory: chunks of at most QX_SMEM
    assert (fast_launch(4096, 14336, 1, smem_limit=QX_SMEM_OPT_IN).chunks, fast_launch(4096, 14336, 1).chunks) == (2, 1)
    lp = fast_launch(4096, 14336, 2)
    assert (lp.rows_per_warp, lp.warps, lp.chunks) == (1, 16, 4)  # 2 x rows: 8 groups a 36 KiB chunk
    # 28 groups in chunks of at most 15 (36 KiB / 2304 bytes): two chunks of 14
    lp = fast_launch(14336, 14336, 1, split_k=1, steps=1)
    assert (lp.chunks, lp.kcg) == (2, 14)
    # 8 x rows with the default steps: fewer steps so a trip's chunk fits
    lp = fast_launch(4096, 14336, 8)
    assert lp.mm == 8 and lp.steps * lp.split_k * 8 * QX_GROUP_BYTES <= QX_SMEM
    # a chunk of KS * S groups that cannot fit: None (the caller binds qgemv41)
    assert fast_launch(4096, 14336, 8, steps=4, split_k=4, smem=QX_GROUP_BYTES) is None
    for bad in (dict(m=9), dict(steps=3), dict(split_k=3), dict(warps=64), dict(warps=4, split_k=8),
                dict(smem=QX_SMEM_MAX + 1), dict(rows_per_warp=4)):
        args = dict(n=64, k=512, m=1)
        args.update(bad)
        with pytest.raises(ValueError):
            fast_launch(**args)
    with pytest.raises(ValueError):
        fast_launch(64, 500, 1)  # not whole blocks
    # by default only large products of 1 or 2 rows take it: an 8B model's MLP and attention
    # products, not SmolLM2's (latency-bound) nor 8 rows (FMA-bound)
    assert FastQ41.applies(14336, 4096, 1) and FastQ41.applies(4096, 14336, 2) and FastQ41.applies(2048, 2048, 1)
    assert not FastQ41.applies(1536, 576, 1) and not FastQ41.applies(576, 1536, 1)
    assert not FastQ41.applies(14336, 4096, 8)


# ---------------------------------------------------------------------------- GPU

def _run(kern, w, x, bias=None):
    out = cp.full((x.shape[0], w.shape[0]), np.nan, x.dtype)
    fn = kern.quant.linear(x, w, bias, out, None, "test")
    fn()
    return fn, out


def _forced(kern, w, x, bias=None):
    """_run with qgemv41x forced (these weights are below its default size); asserts it ran."""
    fast = kern.quant.fast
    before = fast.bound
    fast.enabled = True
    try:
        res = _run(kern, w, x, bias)
    finally:
        fast.enabled = None
    assert fast.bound == before + 1
    return res


@pytest.mark.parametrize("variant", [dict(), dict(steps=1), dict(steps=4), dict(split_k=2), dict(rows_per_warp=2),
                                     dict(rows_per_warp=2, warps=8, split_k=2), dict(split_k=4, steps=1),
                                     dict(warps=4), dict(smem=2, steps=1, split_k=2), dict(warps=32, smem=8)],
                         ids=["default", "S1", "S4", "KS2", "R2", "R2-W8-KS2", "KS4", "W4", "chunked",
                              "W32-whole"])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_qgemv41x_matches_float64(env, m, variant):
    # K = 3616: 113 blocks = 8 groups of 16, the last with one block (idle lanes); N prime (a
    # last block with idle rows); the weight 4 bytes past a 16-byte boundary; a float16 bias;
    # "chunked" stages 2 groups at a time (4 chunks, barriers between them); S4 and KS4 cannot
    # fit 4 groups of 5..8 x rows in their shared memory: those run qgemv41, as bind promises
    from gpudelegate.native.cuda_quant import PackedView

    n, k = 1031, 3616
    blocks, w64 = _weights(n, k, seed=m)
    rng = np.random.default_rng(m + 200)
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float16)
    kern = env.context("cuda").kernels
    buf = cp.zeros(blocks.nbytes + 68, np.uint8)
    raw = buf[4:4 + blocks.nbytes]
    raw.set(blocks.reshape(-1))
    w = PackedView("q4_1", (n, k), raw)
    fast = kern.quant.fast
    mm = 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8
    for key, val in variant.items():
        setattr(fast, key, val * mm * QX_GROUP_BYTES if key == "smem" else val)  # smem: groups of each x row
    fast.enabled = True
    try:
        lp = fast.launch(n, k, m)
        fn, out = _run(kern, w, cp.asarray(x), cp.asarray(b))
    finally:
        fast.steps = fast.split_k = fast.warps = fast.smem = fast.rows_per_warp = fast.enabled = None
    # only a forced S whose trip's chunk cannot fit the shared bytes gives no launch
    budget = variant["smem"] * mm * QX_GROUP_BYTES if "smem" in variant else QX_SMEM
    need = mm * variant.get("split_k", 1) * variant.get("steps", 1) * QX_GROUP_BYTES
    assert (lp is None) == ("steps" in variant and need > budget)
    if lp is not None:
        assert f"qgemv41x<float,{lp.mm},{lp.rows_per_warp},{lp.steps},{lp.split_k},{lp.warps}>" in fast._funcs
        if "smem" in variant:  # 2 groups a chunk: 4 chunks; 8: the whole row, past 48 KiB from 4 x rows
            assert lp.chunks == (4 if variant["smem"] == 2 else 1)
    got = out.get()
    want = x.astype(np.float64) @ w64.T + b.astype(np.float64)
    rtol, atol = _tol(k)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol)
    fn()  # a second launch gives the same bits
    np.testing.assert_array_equal(out.get(), got)


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_qgemv41x_whole_row_past_the_default_shared_memory(env):
    # a block of 32 warps (1 row each) stages the whole row at once; K = 11296 is 353 blocks, 23
    # groups (the last with one block), 24 staged: 54 KiB, past the 48 KiB a block gets without
    # raising its limit (FastQ41.func does); N prime, below one block's 32 rows
    from gpudelegate.native.cuda_quant import PackedView

    n, k = 23, 11296
    blocks, w64 = _weights(n, k, seed=11)
    x = np.random.default_rng(12).standard_normal((1, k)).astype(np.float32)
    kern = env.context("cuda").kernels
    fast = kern.quant.fast
    fast.warps, fast.rows_per_warp = 32, 1
    try:
        lp = fast.launch(n, k, 1)
        if lp.smem <= QX_SMEM_OPT_IN:
            pytest.skip(f"this device allows {fast.smem_optin} shared bytes: the row is staged in chunks")
        assert lp.chunks == 1
        w = PackedView("q4_1", (n, k), cp.asarray(blocks.reshape(-1)))
        _, out = _forced(kern, w, cp.asarray(x))
    finally:
        fast.warps = fast.rows_per_warp = None
    np.testing.assert_allclose(out.get().astype(np.float64), x.astype(np.float64) @ w64.T, *_tol(k))


@pytest.mark.parametrize("scale", [1e-30, 1e-8, 1e8, 1e16])
@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_qgemv41x_activations_far_from_one(env, scale):
    # the scaling follows each half block's largest exponent: tiny and huge activations keep the
    # float32 bound relative to their own size; zeros and one half block 2^40 apart from the
    # rest as well (all below 2^100, where the scaling's documented range ends)
    from gpudelegate.native.cuda_quant import PackedView

    n, k = 257, 1184
    blocks, w64 = _weights(n, k, seed=7)
    rng = np.random.default_rng(int(-np.log10(scale)) + 50)
    x = rng.standard_normal((2, k)).astype(np.float64)
    x[0, 100:140] = 0.0
    x[1, 16:32] *= 2.0 ** 40
    x = (x * scale).astype(np.float32)
    kern = env.context("cuda").kernels
    w = PackedView("q4_1", (n, k), cp.asarray(blocks.reshape(-1)))
    _, out = _forced(kern, w, cp.asarray(x))
    want = x.astype(np.float64) @ w64.T
    got = out.get().astype(np.float64)
    for r in range(2):
        s = np.abs(want[r]).max()
        rtol, atol = _tol(k)
        np.testing.assert_allclose(got[r] / s, want[r] / s, rtol=rtol, atol=atol, err_msg=f"row {r}")


@pytest.mark.parametrize("m", [1, 4, 7])
@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_qgemv41x_float16_activations_and_non_finite(env, m):
    from gpudelegate.native.cuda_quant import PackedView

    n, k = 211, 608
    blocks, w64 = _weights(n, k, seed=m + 30)
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, k)).astype(np.float16)
    kern = env.context("cuda").kernels
    w = PackedView("q4_1", (n, k), cp.asarray(blocks.reshape(-1)))
    fn, out = _forced(kern, w, cp.asarray(x))
    assert out.dtype == np.float16
    rtol, atol = _tol(k, "float16")
    np.testing.assert_allclose(out.get().astype(np.float64), x.astype(np.float64) @ w64.T, rtol=rtol, atol=atol)
    # a non-finite activation makes its row's outputs non-finite, the other rows stay exact
    x32 = rng.standard_normal((m, k)).astype(np.float32)
    x32[0, 37] = np.inf
    _, out32 = _forced(kern, w, cp.asarray(x32))
    got = out32.get()
    assert not np.isfinite(got[0]).any()
    if m > 1:
        np.testing.assert_allclose(got[1:].astype(np.float64), x32[1:].astype(np.float64) @ w64.T, *_tol(k))


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_q4_1_greedy_ids_equal_the_references(env):
    # the greedy tests' LM in q4_1 (its plain products, e.g. the MLP's down projection, forced
    # through qgemv41x): a 20-token prompt decoded to the context's end, picked on the host and on
    # the device 2 steps ahead, in a CUDA graph, gives the reference executor's ids
    pytest.importorskip("torch")
    import gpudelegate
    from gpudelegate.llm import generate
    from greedy_program import CONTEXT, V, IdsTokenizer, tiny_causal_lm

    prog = gpudelegate.loads(tiny_causal_lm(weights_dtype="q4_1").to_bytes())
    tok = IdsTokenizer()
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, V, 20)]
    fast = env.context("cuda").kernels.quant.fast
    before = fast.bound
    fast.enabled = True
    try:
        g = env.session(prog, device="cuda", capture_graph=True)
    finally:
        fast.enabled = None
    with g, env.session(prog, device="reference") as r:
        want = generate(r, tok, prompt, max_new_tokens=CONTEXT + 1, stop_ids=(), lookahead=None)
        for la in (None, 2):
            got = generate(g, tok, prompt, max_new_tokens=CONTEXT + 1, stop_ids=(), lookahead=la)
            assert got.ids == want.ids, (la, got.ids, want.ids)
    assert len(set(want.ids)) >= 3, want.ids
    assert fast.bound > before, "no product ran qgemv41x"
