"""Packed (GGUF block) weights on the CUDA executor: the kernels of native/cuda_quant.py.

GPU tests (``@pytest.mark.gpu``; skipped with the reason where CUDA is absent) hold every kernel
to native.quant's dequantization (gguf's own float32 values) in float64: the dequantizing GEMV
(1..8 rows: every rows-per-warp variant, rows longer than one stage pass, a weight that starts
and ends off a 16-byte boundary, unaligned activations; q4_1's unstaged qgemv41 with its trips,
split rows and split sums), the dequantize-then-GEMM path of longer
inputs (through the plan's scratch), the embedding gather (bit for bit), the planner's
concatenated q/k/v and gate/up products on packed weights (gate/up with silu * up in qgemv's
epilogue up to 8 rows), a packed decoder run eagerly, replayed from CUDA graphs, unfused and on
the reference executor, the float16-weight GEMV (hgemv) that replaces cuBLAS's per-call
weight conversion against float32 activations, and the float16-weight prefill that widens each
weight into the executor's one scratch for cuBLAS.

CPU tests (run everywhere) check the plan side: packed weights' sizes in the weight block, the
dequantization scratch the layout adds to the arena, and the GEMV's launch choices.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import gpudelegate
from gpudelegate import dtypes as _dt
from gpudelegate.native import quant
from gpudelegate.native.cuda_quant import DIRECT_STEPS, DIRECT_WARPS_PER_SM, GEMV_MAX_ROWS, chunk_blocks, gemv_launch
from gpudelegate.plan import plan_session
from gpudelegate.plan.layout import SCRATCH, dequant_scratch_bytes
from gpudelegate.plan.types import DeviceLimits

from conformance.cases import Case, L, Op, build_program
from cuda_env import REASON, cp
from packed_program import pack_program

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_cuda as bc  # noqa: E402  (llama_program: a decoder in the op set)

PACKED = list(_dt.PACKED_DTYPES)
LIMITS = DeviceLimits(max_buffer_size=1 << 34, max_binding_size=1 << 34, offset_alignment=256, name="test")


# ---------------------------------------------------------------------------- helpers

def _weights(dtype: str, n: int, k: int, seed: int):
    """(blocks uint8 [n, row bytes], their gguf dequantization in float64)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[:, ::7] *= 4.0  # blocks with a wide range: the scale and (q4_1) the offset both matter
    blocks = quant.quantize(dtype, w)
    return blocks, quant.dequantize(dtype, blocks, (n, k)).astype(np.float64)


def _linear_case(dtype: str, x_shape, n: int, bias: bool, storage: str = "float32", kind: str = "const"):
    """A one-linear program: x (input) @ w (packed constant, read directly or through an identity
    prepack) (+ b, a float constant). Returns (case, data, float64 weight)."""
    k = x_shape[-1]
    leaves = [L("x", tuple(x_shape)), L("w", (n, k), dtype=dtype, kind=kind)]
    if bias:
        leaves.append(L("b", (n,), kind="const"))
    case = Case(f"linear/{dtype}/{'x'.join(map(str, x_shape))}x{n}/{storage}", leaves,
                [Op("linear", ["x", "w", "b" if bias else None], {}, "y")], ["y"], storage, k)
    rng = np.random.default_rng(len(case.id) * 7919 + n)
    npdt = np.float32 if storage == "float32" else np.float16
    blocks, w64 = _weights(dtype, n, k, seed=n + k)
    data = {"x": rng.standard_normal(x_shape).astype(npdt), "w": blocks}
    if bias:
        data["b"] = rng.standard_normal(n).astype(npdt)
    return case, data, w64


def _linear_golden(data, w64):
    y = data["x"].astype(np.float64) @ w64.T
    if "b" in data:
        y = y + data["b"].astype(np.float64)
    return y


def _tol(storage: str, k: int):
    # float32: every product and sum in float32 (the conformance suite's bound); float16: the
    # input and the output are float16-rounded
    return (1e-4, 1e-5 * k ** 0.5) if storage == "float32" else (1e-2, 2e-3 * k ** 0.5)


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in units in the last place of their (common) float dtype; values of
    opposite signs count as far apart (none of the weights here is zero: see _weights)."""
    it = np.int32 if a.dtype == np.float32 else np.int16
    ia = a.view(it).astype(np.int64)
    ib = b.astype(a.dtype).view(it).astype(np.int64)
    return int(np.abs(ia - ib).max()) if a.size else 0


def _check_gguf_values(dtype: str, got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Dequantized values: bit for bit gguf's for q4_0 and q8_0 (a product exact in float32); q4_1
    within 1 ulp (d * q + m: a compiler may fuse it, which the kernel does on purpose: d * q is
    exact, so both round once; the bound leaves room for a toolchain that rounds otherwise)."""
    want = want.astype(got.dtype)
    if dtype == "q4_1":
        assert _ulps(got, want) <= 1, f"{what}: {_ulps(got, want)} ulps from gguf"
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


# ---------------------------------------------------------------------------- CPU: the plan

TINY = bc.LlamaConfig(vocab=257, dim=96, layers=2, heads=6, kv_heads=2, hidden=160, max_ctx=37)
LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


def _packed_tiny(methods, lin="q4_1", embed="q8_0"):
    prog = bc.llama_program(TINY, bc.random_weights(TINY, 3, np.float32), methods, act_dtype="float32")
    names = {f"l{i}.{n}": lin for i in range(TINY.layers) for n in LINEARS}
    names["embed"] = embed
    pack_program(prog, names)
    # as a file holds it (the float constants it replaced stay in it, read by nothing)
    return gpudelegate.loads(prog.to_bytes())


def test_packed_weights_take_their_block_bytes_in_the_weight_block():
    prog = _packed_tiny({"decode": 1})
    plan = plan_session(prog, LIMITS)
    bufs = plan.prepack.buffers
    packed = [b for b in bufs if _dt.is_packed(b.dtype)]
    assert {b.dtype for b in packed} == {"q4_1", "q8_0"}
    assert len(packed) == 1 + len(LINEARS) * TINY.layers
    for b in packed:
        assert b.layout == "identity" and b.nbytes == b.src_nbytes == _dt.nbytes(b.dtype, b.shape)
    emb = next(b for b in packed if b.dtype == "q8_0")
    assert emb.nbytes == TINY.vocab * (TINY.dim // 32) * 34
    lay = plan.layout
    for i in lay.weight_order:  # each buffer inside the block, 16-byte aligned, no overlap
        assert lay.resident[i] % LIMITS.weight_alignment == 0
    spans = sorted((lay.resident[i], lay.resident[i] + bufs[i].nbytes) for i in lay.weight_order)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= lay.weight_bytes
    # one-token decode: every linear runs the dequantizing GEMV, no scratch
    assert SCRATCH not in lay.arena and dequant_scratch_bytes(plan) == 0


def test_longer_inputs_get_a_dequantization_scratch_at_the_end_of_the_arena():
    prog = _packed_tiny({"prefill": 17, "decode": 1})
    plan = plan_session(prog, LIMITS)
    lay = plan.layout
    # the largest packed weight a linear over > 8 rows reads, as float32 [N, K]: the prefill's
    # gate and up (160 x 96 each) dequantized together for their concatenated GEMM (the planner's
    # gemm_cat group); its LM head (257 x 96) is read by one row only (the last token)
    want = 2 * TINY.hidden * TINY.dim * 4
    assert dequant_scratch_bytes(plan) == want
    assert SCRATCH in lay.arena
    off = lay.arena[SCRATCH]
    assert off % LIMITS.offset_alignment == 0 and lay.arena_bytes == off + want
    ends = [lay.arena[(p, k)] + n for p, pp in plan.payloads.items() for k, n in enumerate(pp.memory.objects)]
    assert max(ends) <= off  # after every memory object
    # the threshold: 8 rows still run the GEMV
    assert dequant_scratch_bytes(plan_session(_packed_tiny({"prefill": GEMV_MAX_ROWS}), LIMITS)) == 0
    assert dequant_scratch_bytes(plan_session(_packed_tiny({"prefill": GEMV_MAX_ROWS + 1}), LIMITS)) == want


def test_scratch_holds_a_concatenated_group_of_packed_siblings():
    # gate/up placed back to back run as one GEMM over their concatenation (the planner groups
    # packed weights of one type and K): the scratch holds the two together
    prog = _packed_tiny({"prefill": 17})
    plan = plan_session(prog, LIMITS)
    vb = plan.prepack.value_buffer
    lin = [d for d in plan.payloads[0].dispatches if d.op == "linear"]
    gate_up = [d for d in lin if d.args[1].shape == (TINY.hidden, TINY.dim)][:2]  # layer 0's, one input
    assert len(gate_up) == 2 and gate_up[0].args[0].value == gate_up[1].args[0].value
    group = tuple(vb[(0, d.args[1].value)] for d in gate_up)
    assert group in plan.layout.adjacent
    assert dequant_scratch_bytes(plan) == 2 * TINY.hidden * TINY.dim * 4  # larger than any one weight


def test_gemv_launch_choices():
    sms = 132  # an H100 SXM
    # SmolLM2-135M decode: too few rows for more than one row per warp (8 warps per SM wanted)
    for n, k in ((576, 576), (192, 576), (1536, 576), (576, 1536)):
        lp = gemv_launch("q4_1", n, k, 1, sms, direct=False)
        assert lp.rows_per_warp == 1 and lp.chunks == 1 and lp.grid * 4 == n  # one row per warp
        assert not lp.direct
        # q4_1 by default: qgemv41, one row per warp, S groups of 8 blocks a trip, rows split over
        # KS warps while the SMs get at most DIRECT_WARPS_PER_SM warps and each warp 2 groups
        d = gemv_launch("q4_1", n, k, 1, sms)
        assert d.direct and d.rows_per_warp == 1 and d.steps == DIRECT_STEPS
        ks = 2 if k == 1536 else 1  # 6 groups of 8 blocks a row: 2 warps; 3 groups: one
        assert d.split_k == ks and d.grid == -(-n // (4 // ks))
        assert d.chunks == -(-(-(-(k // 32) // 8)) // (ks * DIRECT_STEPS))
    assert gemv_launch("q4_1", 49152, 576, 1, sms, direct=False).rows_per_warp == 4
    head = gemv_launch("q4_1", 49152, 576, 1, sms)
    assert head.rows_per_warp == 1 and head.split_k == 1 and head.grid == 49152 // 4
    # no stage to fit: an 8B model's rows (4096, 14336 values) are one warp's whatever their length,
    # its down projection's (4096 rows) two warps' (8192 warps: at most DIRECT_WARPS_PER_SM an SM)
    assert gemv_launch("q4_1", 14336, 4096, 1, sms, steps=8).chunks == 2
    assert gemv_launch("q4_1", 14336, 4096, 1, sms).split_k == 1
    assert gemv_launch("q4_1", 4096, 14336, 1, sms).split_k == 2 and 4096 * 2 <= DIRECT_WARPS_PER_SM * sms
    assert gemv_launch("q4_1", 4096, 14336, 1, sms, split_k=4, steps=2).chunks == 7  # 56 groups, 8 a trip
    for bad in (dict(qtype="q8_0", direct=True), dict(qtype="q4_1", steps=3), dict(qtype="q4_1", split_k=3)):
        with pytest.raises(ValueError):
            gemv_launch(bad.pop("qtype"), 64, 64, 1, sms, **bad)
    # q8_0 rows of 576 values (612 bytes) do not fit a 4-row stage pass of 4 words a lane (512
    # bytes a row), they do with 8 words
    lh = gemv_launch("q8_0", 49152, 576, 1, sms, words=4)
    assert lh.rows_per_warp == 2 and lh.chunks == 1 and lh.grid == 49152 // 2 // 4
    assert gemv_launch("q8_0", 49152, 576, 1, sms, words=8).rows_per_warp == 4
    with pytest.raises(ValueError):
        gemv_launch("q8_0", 64, 64, 1, sms, words=2)
    # 8 x rows: at most 2 rows per warp (16 accumulators)
    assert gemv_launch("q4_1", 49152, 576, 8, sms, direct=False).rows_per_warp == 2
    # a row longer than one stage pass is read in several
    long = gemv_launch("q4_0", 100, 3616, 1, sms, words=4)
    assert long.rows_per_warp == 1 and long.chunks == -(-(3616 // 32) // chunk_blocks("q4_0", 1, 4)) == 2
    assert gemv_launch("q8_0", 4229, 576, 3, sms, rows_per_warp=4).mm == 4
    with pytest.raises(ValueError):
        gemv_launch("q8_0", 64, 64, 9, sms)
    with pytest.raises(ValueError):
        gemv_launch("q8_0", 64, 64, 8, sms, rows_per_warp=8)
    # every stage pass holds whole blocks within its slot, whatever the start's offset mod 16
    for qt, (_, size) in _dt.QUANT_BLOCKS.items():
        for r in (1, 2, 4):
            for u in (4, 8):
                kc = chunk_blocks(qt, r, u)
                assert kc >= 1 and 15 + kc * size <= 32 * u * 16 // r


# ---------------------------------------------------------------------------- GPU: linear

@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m", [1, 3, 8, 17, 64])
@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_packed_linear_matches_float64(env, dtype, m, bias):
    n, k = 37, 96
    # rows through a leading dim: [1, m, K]; the weight through an identity prepack for half
    case, data, w64 = _linear_case(dtype, (1, m, k), n, bias, kind="prepack" if m % 2 else "const")
    prog, names = build_program(case, data)
    prog = gpudelegate.loads(prog.to_bytes())
    with env.session(prog, device="cuda") as s:
        assert (SCRATCH in s.plan.layout.arena) == (m > GEMV_MAX_ROWS)  # dequantize + GEMM only beyond 8 rows
        (got,) = s.run("forward", {nm: data[nm] for nm in names})
    rtol, atol = _tol("float32", k)
    np.testing.assert_allclose(got.astype(np.float64), _linear_golden(data, w64), rtol=rtol, atol=atol)


@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_packed_linear_on_float16_activations(env, dtype, m):
    n, k = 41, 160
    case, data, w64 = _linear_case(dtype, (m, k), n, True, storage="float16")
    prog, names = build_program(case, data)
    with env.session(prog, device="cuda") as s:
        (got,) = s.run("forward", {nm: data[nm] for nm in names})
    assert got.dtype == np.float16
    rtol, atol = _tol("float16", k)
    np.testing.assert_allclose(got.astype(np.float64), _linear_golden(data, w64), rtol=rtol, atol=atol)


def _device_blocks(blocks: np.ndarray, offset: int):
    """The blocks on the device starting ``offset`` bytes past a 256-byte aligned allocation."""
    buf = cp.zeros(blocks.nbytes + offset + 64, np.uint8)
    raw = buf[offset:offset + blocks.nbytes]
    raw.set(blocks.reshape(-1))
    return buf, raw


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("rows_per_warp,words", [(1, 4), (2, 4), (4, 4), (1, 8), (4, 8)])
@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_gemv_variants_long_rows_and_unaligned_edges(env, dtype, rows_per_warp, words, m):
    # K = 3616 (113 blocks): more than one stage pass per row for every variant; N prime; the
    # weight starts 2 bytes past a 16-byte boundary and ends off one (the edge words); x starts
    # 4 bytes past one (the copy to an aligned buffer); a float16 bias
    from gpudelegate.native.cuda_quant import PackedView

    n, k = 1031, 3616
    blocks, w64 = _weights(dtype, n, k, seed=rows_per_warp)
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float16)
    kern = env.context("cuda").kernels
    buf, raw = _device_blocks(blocks, 2)
    w = PackedView(dtype, (n, k), raw)
    xbuf = cp.zeros(m * k + 1, np.float32)
    xd = xbuf[1:].reshape(m, k)
    xd.set(x)
    out = cp.full((m, n), np.nan, np.float32)
    kern.quant.gemv_rows_per_warp, kern.quant.gemv_words = rows_per_warp, words
    try:
        fn = kern.quant.linear(xd, w, cp.asarray(b), out, None, "test")
    finally:
        kern.quant.gemv_rows_per_warp = kern.quant.gemv_words = None
    fn()
    got = out.get()
    want = x.astype(np.float64) @ w64.T + b.astype(np.float64)
    rtol, atol = _tol("float32", k)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol)
    fn()  # a second launch gives the same bits (no state kept between runs)
    np.testing.assert_array_equal(out.get(), got)


@pytest.mark.parametrize("split", [0, 1], ids=["dequant", "split"])
@pytest.mark.parametrize("steps,split_k", [(1, 1), (4, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("m,rows_per_warp", [(1, 1), (3, 2), (8, 4)])
@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_q4_1_direct_gemv_variants(env, m, rows_per_warp, steps, split_k, split):
    # qgemv41: K = 3616 (113 blocks = 15 groups of 8, the last partial: several trips, warps of a
    # split row with different counts of groups), N prime (a last warp with fewer than R rows, a
    # last block with idle row groups), the weight 4 bytes past a 16-byte boundary (it reads
    # 32-bit words), a float16 bias. split 1 (d * sum(q x) + m * sum(x)) and split rows (KS
    # partial sums) round in another order: the same float32 bound holds
    from gpudelegate.native.cuda_quant import PackedView

    n, k = 1031, 3616
    blocks, w64 = _weights("q4_1", n, k, seed=10 * steps + rows_per_warp)
    rng = np.random.default_rng(m + 100)
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float16)
    kern = env.context("cuda").kernels
    buf, raw = _device_blocks(blocks, 4)
    w = PackedView("q4_1", (n, k), raw)
    out = cp.full((m, n), np.nan, np.float32)
    q = kern.quant
    q.gemv_rows_per_warp, q.gemv_steps, q.gemv_split_k, q.gemv_split = rows_per_warp, steps, split_k, split
    try:
        fn = q.linear(cp.asarray(x), w, cp.asarray(b), out, None, "test")
    finally:
        q.gemv_rows_per_warp = q.gemv_steps = q.gemv_split_k = None
        q.gemv_split = 0
    mm = 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8
    assert f"qgemv41<float,{rows_per_warp},{mm},{steps},{split_k},0,{split}>" in q._funcs
    fn()
    got = out.get()
    want = x.astype(np.float64) @ w64.T + b.astype(np.float64)
    rtol, atol = _tol("float32", k)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol)
    fn()
    np.testing.assert_array_equal(out.get(), got)


# ---------------------------------------------------------------------------- GPU: rows

@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_packed_embedding_gathers_gguf_values(env, dtype):
    V, D = 97, 160
    blocks, _ = _weights(dtype, V, D, seed=11)
    ids = np.array([[0, 96, 5, 5, 40, 1, 95], [17, 0, 96, 63, 2, 2, 50], [3, 4, 5, 6, 7, 8, 9]], np.int32)
    for kind in ("const", "prepack"):
        case = Case(f"embedding/{dtype}/{kind}", [L("w", (V, D), dtype=dtype, kind=kind), L("i", ids.shape, "int32")],
                    [Op("embedding", ["w", "i"], {}, "y")], ["y"])
        prog, names = build_program(case, {"w": blocks, "i": ids})
        for graph in (False, True):
            with env.session(prog, device="cuda", capture_graph=graph) as s:
                for _ in range(2):  # with graphs: eager + capture, then a replay
                    (got,) = s.run("forward", {"i": ids})
                    want = quant.PackedWeight(dtype, (V, D), blocks).rows(ids)
                    assert got.dtype == np.float32 and got.shape == ids.shape + (D,)
                    _check_gguf_values(dtype, got, want, f"{case.id} graph={graph}")


@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_dequantize_whole_weight_gives_gguf_values(env, dtype):
    from gpudelegate.native.cuda_quant import PackedView

    n, k = 131, 224
    blocks, _ = _weights(dtype, n, k, seed=5)
    buf, raw = _device_blocks(blocks, 2)  # a 2-byte aligned start: 16-bit reads only
    kern = env.context("cuda").kernels
    want = quant.dequantize(dtype, blocks, (n, k))
    out = cp.full((n, k), np.nan, np.float32)
    kern.quant.dequantize(PackedView(dtype, (n, k), raw), out)()
    _check_gguf_values(dtype, out.get(), want, f"{dtype} dequantize")
    out16 = cp.zeros((n, k), np.float16)
    kern.quant.dequantize(PackedView(dtype, (n, k), raw), out16)()
    _check_gguf_values(dtype, out16.get(), want, f"{dtype} dequantize to float16")  # one rounding of gguf's value


# ---------------------------------------------------------------------------- GPU: a packed decoder

def _generate(sess, prompt, feed):
    """Prefill, then one decode step per token of ``feed`` (the same tokens on every executor, so
    a near-tie of random logits cannot send two executors down different paths); the logits of
    every step."""
    out = sess.run("prefill", bc.step_inputs(TINY, prompt, 0) + bc.empty_caches(TINY, np.float32), keep_on_device=True)
    logits = [out[0].numpy()]
    caches = out[1:]
    for i, tok in enumerate(feed):
        out = sess.run("decode", bc.step_inputs(TINY, [tok], len(prompt) + i) + list(caches), keep_on_device=True)
        logits.append(out[0].numpy())
        caches = out[1:]
    return logits


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_graph_replay_of_a_packed_decoder_matches_eager_and_reference(env):
    # q4_1 linears and a q8_0 embedding that is also the LM head (SmolLM2's GGUF mix); a 17-token
    # prefill dequantizes into the plan's scratch, decode steps run the GEMV
    prog = _packed_tiny({"prefill": 17, "decode": 1})
    prompt = [5, 17, 3, 250, 9, 101, 42, 7, 7, 8, 200, 31, 64, 1, 0, 256, 128]
    feed = [33, 0, 256, 12, 12, 190]
    runs = {}
    for name, kw in (("eager", {}), ("graph", {"capture_graph": True}), ("unfused", {"fuse": False})):
        with env.session(prog, device="cuda", **kw) as s:
            assert SCRATCH in s.plan.layout.arena
            runs[name] = _generate(s, prompt, feed)
            if name == "graph":
                assert sorted(s.executor.stats["graphs"]) == sorted(s.plan.payloads)
    with env.session(prog, device="reference") as s:
        ref = _generate(s, prompt, feed)
    for i, (a, b, c, r) in enumerate(zip(runs["eager"], runs["graph"], runs["unfused"], ref)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {i}: replayed graph differs from eager")
        for name, x in (("eager", a), ("unfused", c)):
            assert bc.rel_err(x, r) < 1e-4, (name, i, bc.rel_err(x, r))


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_packed_siblings_run_as_one_gemm_when_the_planner_groups_them(env):
    # The planner groups packed q/k/v and gate/up weights of one type and K (placed back to back,
    # their rows continue one another): the executor runs the group's GEMV, or its dequantization
    # into the scratch and one GEMM, over the concatenation.
    prog = _packed_tiny({"prefill": 17, "decode": 1})
    prompt = [5, 17, 3, 250, 9, 101, 42, 7, 7, 8, 200, 31, 64, 1, 0, 256, 128]
    feed = [33, 0, 256]
    with env.session(prog, device="cuda", capture_graph=True) as s:
        lay = s.plan.layout
        assert len(lay.adjacent) == 2 * TINY.layers  # q/k/v and gate/up of each layer, back to back
        # the prefill's gate/up dequantize together: the scratch holds both
        assert lay.arena_bytes - lay.arena[SCRATCH] == 2 * TINY.hidden * TINY.dim * 4
        got = _generate(s, prompt, feed)
        fused = s.executor.stats.get("fusions", {})
        assert fused.get("rope_kv+gemm_cat") == 2 * TINY.layers and fused.get("silu_mul+gemm_cat") == 2 * TINY.layers, fused
    with env.session(prog, device="reference") as s:
        ref = _generate(s, prompt, feed)
    for i, (a, r) in enumerate(zip(got, ref)):
        assert bc.rel_err(a, r) < 1e-4, (i, bc.rel_err(a, r))


# ---------------------------------------------------------------------------- GPU: concatenated products
# q/k/v with rope and cache writes, gate/up with silu * up, on packed weights of each type: the
# planner's gemm_cat groups (the dequantizing GEMV over the concatenation for up to 8 rows, its
# dequantization into the scratch and one GEMM beyond), against the float64 golden of
# conformance.cases at its tolerances (float32 activations; gguf's float32 weight values).

def _cat_cases(qt: str, T: int):
    """gate/up with x read afterwards (one qgemv launch with silu * up for T <= 8), gate/up
    whose output may take x's storage (x dies at the products: the products go through the
    scratch first), and the attention front."""
    from conformance.cases import Leaf

    E, D, H, Hk, S, N = 256, 22, 6, 2, 37, 37  # K = 256: every weight a 16-byte multiple; N prime
    cases = []
    for live in (True, False):
        cases.append((Case(f"cuda/gate_up/{qt}/{T}/{live}",
                           [Leaf("x", "float", (1, T, E)), Leaf("wg", qt, (N, E), kind="prepack"),
                            Leaf("wu", qt, (N, E), kind="prepack")],
                           [Op("linear", ["x", "wg", None], out="g"), Op("linear", ["x", "wu", None], out="u"),
                            Op("silu", ["g"], out="a"), Op("mul", ["a", "u"], out="o")]
                           + ([Op("neg", ["x"], out="xn")] if live else []),
                           ["o", "xn"] if live else ["o"], red=E), "silu_mul+gemm_cat"))
    leaves = [Leaf("x", "float", (1, T, E)), Leaf("kc", "float", (1, Hk, S, D)), Leaf("vc", "float", (1, Hk, S, D)),
              Leaf("pos", "int32", (1,), gen="value", lo=5),
              Leaf("cos", "float", (T, D), gen="angle"), Leaf("sin", "float", (T, D), gen="angle")]
    ops = []
    for name, heads in (("q", H), ("k", Hk), ("v", Hk)):
        leaves.append(Leaf(f"w{name}", qt, (heads * D, E), kind="prepack"))
        ops += [Op("linear", ["x", f"w{name}", None], out=f"{name}l"),
                Op("reshape", [f"{name}l"], {"shape": [1, T, heads, D]}, out=f"{name}4"),
                Op("permute", [f"{name}4"], {"dims": [0, 2, 1, 3]}, out=f"{name}h")]
    ops += [Op("rope", ["qh", "cos", "sin"], out="qr"), Op("rope", ["kh", "cos", "sin"], out="kr"),
            Op("kv_update", ["kc", "kr", "pos"], out="kc2"), Op("kv_update", ["vc", "vh", "pos"], out="vc2")]
    front = Case(f"cuda/qkv/{qt}/{T}", leaves, ops, ["qr", "kc2", "vc2"], red=E)
    return cases + [(front, "rope_kv+gemm_cat")]


@pytest.mark.parametrize("T", [1, 3, 8, 17])
@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_packed_concatenated_products_match_float64(env, dtype, T):
    from conformance.cases import golden, make_data, tolerance

    for case, kind in _cat_cases(dtype, T):
        data = make_data(case)
        prog, names = build_program(case, data)
        prog = gpudelegate.loads(prog.to_bytes())
        for graph in (False, True):
            with env.session(prog, device="cuda", capture_graph=graph) as s:
                outs = s.run("forward", [data[n] for n in names])
                assert s.executor.stats.get("fusions", {}).get(kind) == 1, (case.id, s.executor.stats.get("fusions"))
            rtol, atol = tolerance(case)
            for i, (g, w) in enumerate(zip(outs, golden(case, data))):
                np.testing.assert_allclose(np.asarray(g).astype(np.float64), w, rtol=rtol, atol=atol,
                                           err_msg=f"{case.id} output {i} (graph {graph})")
    if T <= GEMV_MAX_ROWS:  # the gate/up group with x read afterwards ran qgemv's silu * up epilogue
        assert any(e.endswith(",1>") for e in env.context("cuda").kernels.quant._funcs)


# ---------------------------------------------------------------------------- GPU: float16 weights
# Not packed, but the same problem: a decode linear whose weight is stored float16 while the
# activations are float32 runs hgemv (shaders/cuda_gemv.cu: the float16 bytes read once, fp32
# accumulation) instead of cuBLAS, which converts the weight to float32 on every call.

@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_float16_weight_prefill_widens_into_one_scratch(env, graph):
    # 17 float32 rows (past hgemv) against float16 weights: cuBLAS on the weight widened exactly
    # into the executor's scratch, one buffer as large as the largest weight for both products;
    # the float32 product's bound (the widening adds no rounding)
    from conformance.cases import golden, make_data

    case = Case("linear2/float16_weights/17rows", [L("x", (17, 131)), L("w1", (211, 131), "float16", kind="const"),
                                                   L("w2", (101, 211), "float16", kind="const")],
                [Op("linear", ["x", "w1", None], {}, "h"), Op("linear", ["h", "w2", None], {}, "y")], ["y"], "float32",
                211)
    data = make_data(case)
    prog, names = build_program(case, data)
    with env.session(prog, device="cuda", capture_graph=graph) as s:
        for run in range(3):  # with graphs: run 0 eager + capture, runs 1-2 replay on fresh inputs
            d = data if run == 0 else {**data, "x": make_data(case, run)["x"]}
            (got,) = s.run("forward", {nm: d[nm] for nm in names})
            (want,) = golden(case, d)
            rtol, atol = _tol("float32", 211)
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol, err_msg=f"run {run}")
        assert s.executor._widen.nbytes == 211 * 131 * 4


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m", [1, 3, 8, 17])
@pytest.mark.parametrize("k", [72, 576])
@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_float16_weight_gemv_matches_float64(env, m, k, bias):
    # N = 211 (prime: a last block of fewer than 4 rows); K = 72 is 9 chunks of 8 (a warp's second
    # trip partial), 576 SmolLM2's hidden size; 17 rows run cuBLAS (checked alike)
    n = 211
    rng = np.random.default_rng(m * 1000 + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float16)
    b = rng.standard_normal(n).astype(np.float32)
    kern = env.context("cuda").kernels
    out = cp.full((m, n), np.nan, np.float32)
    fn = kern.linear(cp.asarray(x), cp.asarray(w), cp.asarray(b) if bias else None, out, "test")
    if m <= 8:  # bound to hgemv (compiled on first use), not cuBLAS
        mm = 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8
        assert ("cuda_gemv.cu", f"hgemv<{mm}>") in kern._funcs
    fn()
    want = x.astype(np.float64) @ w.astype(np.float64).T + (b.astype(np.float64) if bias else 0.0)
    rtol, atol = _tol("float32", k)
    np.testing.assert_allclose(out.get().astype(np.float64), want, rtol=rtol, atol=atol)
