"""Fusion decisions with packed (GGUF block) weights (core/plan/fusion.py) and their WGSL lowering
(core/webgpu/ops_quant.py), on plans and dispatches alone.

Pure core: no numpy (this file also runs inside Pyodide). The planner lets a packed linear take
part only where every executor carrying the decision out has a kernel for it: the WebGPU epilogues
and sibling products (ops_quant's kernels take them), concatenated GEMMs of one packed type and K
(CUDA's dequantizing GEMV over the back-to-back weights, WebGPU's qgemv_cat) and the CUDA
attention + projection group (its projection runs through the packed kernels).
"""

from __future__ import annotations

import random

import pytest

from gpudelegate import dtypes
from gpudelegate.errors import DeviceError, PayloadError
from gpudelegate.plan import plan_session
from gpudelegate.plan.fusion import _sibling_sets, cat_candidates, epilogue_fusions, match, sibling_groups
from gpudelegate.plan.types import BufferRef, DeviceLimits, Dispatch, TensorRef
from gpudelegate.webgpu import lowering

from progbuild import ProgramBuilder

LIM = DeviceLimits(offset_alignment=256, name="test")


def _blocks(dtype: str, shape, seed: int = 0) -> bytes:
    """Random bytes of a packed tensor (the planner and the lowering never decode them); distinct
    seeds give distinct constants (equal ones are deduplicated into one buffer)."""
    r = random.Random(seed)
    return bytes(r.randrange(256) for _ in range(dtypes.nbytes(dtype, shape)))


def _program(build):
    """A one-payload program: ``build(b, p, x)`` adds nodes after the input x[6, 64] and returns
    the payload outputs."""
    b = ProgramBuilder()
    p = b.payload()
    x = p.input("float32", (6, 64), "x")
    outs = build(b, p, x)
    p.output(*outs)
    p.schedule_offload()
    m = b.method("forward")
    ys = m.delegate(p, [m.input("float32", (6, 64), "x")])
    m.output(*ys)
    return b.build()


_SEED = iter(range(1, 1 << 30))


def _weight(b, p, dtype, shape, prepack=True, name=""):
    if dtypes.is_packed(dtype):
        c = b.constant(dtype, shape, _blocks(dtype, shape, next(_SEED)))
    else:
        n = dtypes.numel(shape)
        c = b.constant(dtype, shape, [0.01 * (i % 97) for i in range(n)])
    v = p.constant(c, name)
    return p.prepack(v) if prepack else v


@pytest.mark.parametrize("dtype", dtypes.PACKED_DTYPES)
@pytest.mark.parametrize("consumer", ["gelu", "add"])
def test_a_packed_linear_takes_its_epilogue(dtype, consumer):
    def build(b, p, x):
        r = p.op("neg", [x])  # the residual: a tensor of its own (x itself would be read twice)
        h = p.op("linear", [x, _weight(b, p, dtype, (64, 64)), _weight(b, p, "float32", (64,))])
        return [p.op("gelu", [h]) if consumer == "gelu" else p.op("add", [h, r])]

    plan = plan_session(_program(build), LIM)
    fz = epilogue_fusions(plan.payloads[0])
    assert list(fz) == [1] and fz[1].consumer == 2 and (fz[1].act == 1) == (consumer == "gelu")
    calls = lowering.select_all(plan.payloads[0], LIM)
    assert [c.entry for c in calls[1]] == ["qgemv"] and calls[2] == []
    assert calls[1][0].constants["ACT"] == (1 if consumer == "gelu" else 0)
    assert calls[1][0].constants["RES"] == (consumer == "add")


def test_sibling_linears_group_by_weight_dtype():
    """Same input, same shape: two q4_1 weights are siblings; a q8_0 and a float32 one of that
    shape are not theirs (one kernel reads one weight type)."""
    def build(b, p, x):
        ws = [_weight(b, p, dt, (64, 64), name=f"w{i}") for i, dt in enumerate(("q4_1", "q8_0", "q4_1", "float32"))]
        return [p.op("linear", [x, w]) for w in ws]

    plan = plan_session(_program(build), LIM)
    pp = plan.payloads[0]
    assert _sibling_sets(pp) == [[0, 2]]
    bufs = [pp.dispatches[k].args[1].buf.index for k in (0, 2)]
    # 64 rows of 2 q4_1 blocks: 2560 bytes, ten 256-byte units: they can lie back to back.
    assert sibling_groups(plan, LIM) == [tuple(bufs)]
    calls = lowering.select_all(pp, LIM, contiguous=sibling_groups(plan, LIM))
    assert [c.entry for c in calls[0]] == ["qgemv"] and calls[2] == []
    assert calls[0][0].constants["NC"] == 2
    assert [c.entry for c in calls[1]] == ["qgemv"] and calls[1][0].constants["NC"] == 1


def test_packed_weights_that_cannot_lie_back_to_back_are_not_grouped():
    # 37 rows of one q4_0 block are 666 bytes: not a whole number of 256-byte units.
    def build(b, p, x):
        x2 = p.op("slice", [x], {"dim": 1, "start": 0, "end": 32})
        return [p.op("linear", [x2, _weight(b, p, "q4_0", (37, 32), name=f"w{i}")]) for i in range(2)]

    plan = plan_session(_program(build), LIM)
    assert _sibling_sets(plan.payloads[0]) == [[1, 2]]
    assert sibling_groups(plan, LIM) == []


@pytest.mark.parametrize("dtype", dtypes.PACKED_DTYPES)
def test_packed_linears_join_a_concatenated_gemm(dtype):
    """cat_candidates proposes bias-free linears of one input, one weight dtype and K for a
    concatenated GEMM, packed ones too (64 rows of 2 blocks: whole 16-byte multiples)."""
    def build(b, p, x):
        return [p.op("linear", [x, _weight(b, p, dtype, (64, 64), name=f"w{i}")]) for i in range(3)]

    plan = plan_session(_program(build), LIM)
    pp = plan.payloads[0]
    bufs = tuple(pp.dispatches[k].args[1].buf.index for k in range(3))
    assert cat_candidates(plan) == [bufs]
    assert [f.cat for f in match(pp, 0, plan.prepack.value_buffer, contiguous=[bufs]) if f.cat] == []  # no consumer
    assert plan.layout.adjacent == [bufs]


def test_a_concatenated_gemm_never_mixes_weight_types():
    """q4_1 and q8_0 weights of one input (or packed and float32) are no group: one GEMM reads one
    weight type, and match refuses them even when handed their buffers as placed back to back."""
    def build(b, p, x):
        ws = [_weight(b, p, dt, (64, 64), name=f"w{i}") for i, dt in enumerate(("q4_1", "q8_0", "float32"))]
        g, u = p.op("linear", [x, ws[0]]), p.op("linear", [x, ws[1]])
        return [p.op("mul", [p.op("silu", [g]), u]), p.op("linear", [x, ws[2]])]

    plan = plan_session(_program(build), LIM)
    assert cat_candidates(plan) == []
    pp = plan.payloads[0]
    forced = [tuple(pp.dispatches[k].args[1].buf.index for k in (0, 1))]
    assert [f for f in match(pp, 0, plan.prepack.value_buffer, contiguous=forced) if f.cat] == []


@pytest.mark.parametrize("dtype", ("float32",) + tuple(dtypes.PACKED_DTYPES))
def test_the_attention_projection_group_takes_packed_weights(dtype):
    """sdpa -> [0, 2, 1, 3] permute -> reshape -> linear is one CUDA group (sdpa_bthd); its
    projection runs through CudaKernels.linear, which has the packed kernels."""
    def build(b, p, x):
        q = p.op("reshape", [x], {"shape": [1, 6, 2, 32]})
        qh = p.op("permute", [q], {"dims": [0, 2, 1, 3]})
        a = p.op("sdpa", [qh, qh, qh])
        m = p.op("permute", [a], {"dims": [0, 2, 1, 3]})
        mf = p.op("reshape", [m], {"shape": [1, 6, 64]})
        return [p.op("linear", [mf, _weight(b, p, dtype, (64, 64))])]

    plan = plan_session(_program(build), LIM)
    kinds = [f.kind for f in match(plan.payloads[0], 0, plan.prepack.value_buffer)]
    assert "sdpa_bthd" in kinds, kinds


def test_fp16_prepack_of_a_packed_constant_is_refused():
    def build(b, p, x):
        c = b.constant("q8_0", (64, 64), _blocks("q8_0", (64, 64), 1))
        return [p.op("linear", [x, p.prepack(p.constant(c), layout="fp16")], out=[("float32", (6, 64))])]

    with pytest.raises(PayloadError, match="fp16 layout packs float32"):
        plan_session(_program(build), LIM)


# ---------------------------------------------------------------------------- the lowering alone

def _ref(v, dtype, shape, space="arena", index=0, offset=0):
    return TensorRef(v, dtype, tuple(shape), BufferRef(space, index, offset, dtypes.nbytes(dtype, shape)))


def _linear(m, n, k, dtype="q4_0", bias=False):
    args = [_ref(0, "float32", (m, k)), _ref(1, dtype, (n, k), "resident", 0)]
    if bias:
        args.append(_ref(3, "float32", (n,), "resident", 1))
    return Dispatch(0, "linear", {}, args, [_ref(2, "float32", (m, n), "arena", 0, 4096 * 16)])


@pytest.mark.parametrize("dtype", dtypes.PACKED_DTYPES)
@pytest.mark.parametrize("m, entry", [(1, "qgemv"), (8, "qgemv"), (9, "qmm"), (40, "qmm")])
def test_operands_over_a_binding_are_split_and_each_call_binds_its_rows(dtype, m, entry):
    """A weight over maxStorageBufferBindingSize runs as calls over its row ranges, each binding
    only its rows from an aligned offset, with the first row's byte offset inside (2 mod 4 for
    every other q4_0 / q8_0 row when a row holds an odd number of blocks); x and outputs over a
    binding add ranges of x's rows, each meeting every weight row."""
    n, k = 211, 96
    row = dtypes.packed_row_bytes(dtype, k)
    lim = DeviceLimits(max_binding_size=4096, offset_alignment=256, name="t")
    calls = lowering.select(_linear(m, n, k, dtype), lim)
    assert {c.entry for c in calls} == {entry}
    x_rows, covered, weight_calls = 0, 0, 0
    for c in calls:
        assert all(b.buf.nbytes <= 4096 and b.buf.offset % 256 == 0 for b in c.bindings), c.bindings
        w = next(b for b in c.bindings if b.binding == 3)
        words = [int.from_bytes(c.uniform[4 * i:4 * i + 4], "little") for i in range(16)]
        mc, n_lo, n_hi, w_base = words[0], words[3], words[4], words[8]
        if n_lo == 0:  # the next range of x's rows starts over the weight
            assert covered in (0, n)
            x_rows, covered = x_rows + mc, 0
        assert n_lo == covered and w.buf.offset + w_base == n_lo * row
        assert w.buf.offset + w.buf.nbytes >= n_hi * row  # the last row's bytes are bound
        covered = n_hi
        weight_calls += 1
    assert covered == n and x_rows == m and weight_calls >= 2


def test_one_packed_row_larger_than_a_binding_is_refused():
    lim = DeviceLimits(max_binding_size=1024, offset_alignment=256, name="t")
    with pytest.raises(DeviceError, match="one row is larger than a binding"):
        lowering.select(_linear(1, 3, 32 * 64, "q8_0"), lim)  # 2176-byte rows


def test_an_empty_contraction_reads_no_weight():
    """K = 0 (a packed [N, 0] weight has no bytes): the output is the bias, the weight and x
    bindings are the dummy."""
    (c,) = lowering.select(_linear(3, 7, 0, "q4_1", bias=True), LIM)
    assert {b.binding: b.buf.space for b in c.bindings}[3] == "dummy"
    assert {b.binding: b.buf.space for b in c.bindings}[2] == "dummy"
    assert c.constants["BIAS"] == 1


def test_a_float16_linear_with_a_packed_weight_computes_in_float32_scratch():
    x = _ref(0, "float16", (5, 64))
    d = Dispatch(0, "linear", {}, [x, _ref(1, "q8_0", (13, 64), "resident", 0)], [_ref(2, "float16", (5, 13), "arena", 1)])
    entries = [c.entry for c in lowering.select(d, LIM)]
    assert entries == ["map", "qgemv", "map"]  # x to float32, the product, the float16 store
