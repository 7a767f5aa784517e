"""Packed GGUF weights (q4_0, q4_1, q8_0) on the wgpu executor beyond the conformance cases:
the decoded values bit for bit against gguf's, both linear kernels on the same shapes, the fused
epilogues and sibling linears in the packed kernels, weights and tables over a binding, and the
device buffers' sizes.

Runs on any wgpu adapter (software Vulkan in CI); skipped, with the reason printed by -rs, where
none starts.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpudelegate
from gpudelegate import dtypes
from gpudelegate.environment import Environment, register_device
from gpudelegate.native import quant
from gpudelegate.plan import plan_session
from gpudelegate.plan.fusion import sibling_groups
from gpudelegate.webgpu import lowering
from gpudelegate.webgpu.commands import round4

from conformance.cases import Case, Leaf, Op, build_program, golden, make_data, tolerance

pytestmark = pytest.mark.wgpu

PACKED = ("q4_0", "q4_1", "q8_0")
SMALL_BINDING = 7168  # splits the weights below into row ranges while x and the outputs fit


def _small_context(env_):
    from gpudelegate.native.wgpu_device import WgpuContext

    return WgpuContext(env_, limits_override={"max_binding_size": SMALL_BINDING})


@pytest.fixture(scope="module")
def env(wgpu_adapter):
    register_device("wgpu-quant-small-binding", _small_context)
    e = Environment()
    yield e
    e.close()


def _run(env, case: Case, device: str = "wgpu", data=None, **opts):
    """Run ``case`` once; returns (outputs, {op: [entry points]}, session plan)."""
    data = make_data(case) if data is None else data
    prog, names = build_program(case, data)
    prog = gpudelegate.loads(prog.to_bytes())
    with env.session(prog, device=device, **opts) as s:
        outs = s.run("forward", [data[n] for n in names])
        entries = {}
        for n in s.executor.recorded[0].nodes:
            entries.setdefault(n.op, []).extend(L.pipeline.label.split(":")[-1].strip() for L in n.launches)
        sizes = {i: b.size for i, b in s.executor.resident.items()}
        return [np.asarray(o) for o in outs], entries, s.plan, sizes


def _check(case: Case, outs, data):
    rtol, atol = tolerance(case)
    for i, (g, w) in enumerate(zip(outs, golden(case, data))):
        np.testing.assert_allclose(g.astype(np.float64), w, rtol=rtol, atol=atol, err_msg=f"{case.id} output {i}")


# ---------------------------------------------------------------------------- decoded values

def _ordered(bits: np.ndarray) -> np.ndarray:
    """float32 bit patterns as integers in the floats' order (ulp distance = difference)."""
    b = bits.astype(np.int64)
    return np.where(b & 0x80000000, 0x80000000 - b, b)


def _random_blocks(qt: str, rows: int, d: int, rng) -> np.ndarray:
    """Raw ``qt`` rows with every nibble / int8 value at random and scales across the f16 range:
    normal ones of both signs from 2^-14 to 2^15, subnormals, and zeros."""
    block, size = dtypes.QUANT_BLOCKS[qt]
    raw = rng.integers(0, 256, (rows, d // block, size), dtype=np.uint8)
    n = rows * (d // block)
    scales = np.concatenate([
        (rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(-14, 15, n)),
        rng.choice([-1.0, 1.0], n) * rng.integers(1, 1024, n) * 2.0 ** -24,  # f16 subnormals
        np.zeros(n),
    ])
    fields = 2 if qt == "q4_1" else 1  # q4_1 has d and m
    pick = rng.permutation(len(scales))[:n * fields].reshape(n, fields)
    f16 = scales[pick].astype(np.float16).reshape(rows, d // block, fields)
    raw[..., :2 * fields] = f16.view(np.uint8).reshape(rows, d // block, 2 * fields)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qt", PACKED)
def test_embedding_of_every_row_is_ggufs_dequantization(env, qt):
    """The gather of every row of a packed table gives gguf's float32 values: bit for bit for
    q4_0 ((q - 8) d is exact in float32) and q8_0 (q d is exact), within 1 ulp for q4_1 (q d + m
    rounds once; a compiler may contract it into an fma, which rounds once too, so lavapipe gives
    the same bits). 37 rows of 3 blocks: q4_0's and q8_0's rows start at 2 mod 4 every other row."""
    v, d = 37, 96
    raw = _random_blocks(qt, v, d, np.random.default_rng(7))
    case = Case(f"quant/all_rows/{qt}", [Leaf("w", qt, (v, d), kind="const"), Leaf("ids", "int32", (v,), "ids", hi=v)],
                [Op("embedding", ["w", "ids"], out="y")], ["y"])
    data = {"w": raw, "ids": np.arange(v, dtype=np.int32)}
    (got,), entries, _, _ = _run(env, case, data=data)
    assert entries["embedding"] == ["qembed"]
    want = quant.dequantize(qt, raw, (v, d))
    assert np.isfinite(want).all()
    ulps = np.abs(_ordered(got.view(np.uint32)) - _ordered(want.view(np.uint32)))
    assert ulps.max() <= (1 if qt == "q4_1" else 0), f"{qt}: {int((ulps > 0).sum())} values off, by up to {ulps.max()} ulp"


# ---------------------------------------------------------------------------- the two linear kernels

def _linear_case(qt: str, lead, n: int, k: int, bias: bool) -> Case:
    leaves = [Leaf("x", "float", tuple(lead) + (k,)), Leaf("w", qt, (n, k), kind="prepack")]
    leaves += [Leaf("b", "float", (n,), kind="prepack")] if bias else []
    return Case(f"quant/linear/{qt}_{lead}_{n}_{k}", leaves, [Op("linear", ["x", "w", "b" if bias else None], out="y")],
                ["y"], red=k)


@pytest.mark.parametrize("qt", PACKED)
@pytest.mark.parametrize("m", [1, 2, 8, 9, 33])
def test_decode_and_tiled_kernels_on_the_same_shapes(env, qt, m):
    """qgemv runs M <= 8, qmm the rest, split along K into qmm + qmm_sum while it has few tiles;
    forcing qmm (Tuning(qgemv_max_m=0)) on the decode shapes, and qmm without the split, gives the
    same answers within the suite's tolerance. K = 288 (9 blocks, 36 units: qgemv's lanes take 2
    units each, 18 lanes; qmm splits 9 blocks 4 ways, the last split shorter), N = 67 (qmm's 32-
    and 64-column tiles end in a partial one)."""
    case = _linear_case(qt, (m,), 67, 288, bias=m % 2 == 1)
    data = make_data(case)
    split = ["qmm", "qmm_sum"]
    for tuning, want in ((None, ["qgemv"] if m <= 8 else split), (lowering.Tuning(qgemv_max_m=0), split),
                         (lowering.Tuning(qgemv_max_m=0, ksplit_below_groups=0), ["qmm"])):
        outs, entries, _, _ = _run(env, case, data=data, **({"tuning": tuning} if tuning else {}))
        assert entries["linear"] == want, (tuning, entries)
        _check(case, outs, data)


# ---------------------------------------------------------------------------- fusions

@pytest.mark.parametrize("qt", PACKED)
@pytest.mark.parametrize("m", [3, 40])
@pytest.mark.parametrize("consumer", ["gelu", "gelu_tanh", "add"])
def test_epilogues_run_in_the_packed_kernels(env, qt, m, consumer):
    """plan.fusion.epilogue_fusions pairs a packed linear with its gelu / residual add, and the
    packed kernels carry the pair out: the consumer runs nothing of its own."""
    leaves = [Leaf("x", "float", (m, 64)), Leaf("w", qt, (37, 64), "small", kind="prepack"),
              Leaf("b", "float", (37,), kind="const"), Leaf("r", "float", (m, 37))]
    op = (Op("gelu", ["h"], {"approximate": "tanh" if consumer == "gelu_tanh" else "none"}, out="y")
          if consumer != "add" else Op("add", ["h", "r"], out="y"))
    case = Case(f"quant/epilogue/{qt}_{m}_{consumer}", leaves if consumer == "add" else leaves[:3],
                [Op("linear", ["x", "w", "b"], out="h"), op], ["y"], red=64)
    data = make_data(case)
    outs, entries, _, _ = _run(env, case, data=data)
    assert entries["linear"][0] == ("qgemv" if m <= 8 else "qmm") and entries[op.op] == [], entries
    _check(case, outs, data)


@pytest.mark.parametrize("qt", PACKED)
@pytest.mark.parametrize("m", [3, 17])
@pytest.mark.parametrize("count, bias", [(2, None), (3, "own"), (2, "shared")])
def test_sibling_linears_with_packed_weights_run_as_one_product(env, qt, m, count, bias):
    """Linears reading one input with same-shaped weights of one packed type (64 x 64: whole
    256-byte units, so the executor may place them back to back) run as one product over all
    their rows, each writing its own output: biases back to back, or one shared bias (equal
    constants are one buffer)."""
    leaves = [Leaf("x", "float", (m, 64))]
    ops = []
    for z in range(count):
        leaves.append(Leaf(f"w{z}", qt, (64, 64), kind="prepack"))
        b = None
        if bias == "own":
            leaves.append(Leaf(f"b{z}", "float", (64,), kind="prepack"))
            b = f"b{z}"
        elif bias == "shared":
            b = "b"
        ops.append(Op("linear", ["x", f"w{z}", b], out=f"y{z}"))
    if bias == "shared":
        leaves.append(Leaf("b", "float", (64,), kind="prepack"))
    case = Case(f"quant/siblings/{qt}_{m}_{count}_{bias}", leaves, ops, [f"y{z}" for z in range(count)], red=64)
    data = make_data(case)
    outs, entries, plan, _ = _run(env, case, data=data)
    groups = sibling_groups(plan, env.context("wgpu").limits)
    assert any(len(g) == count for g in groups), f"the executor placed no {count} weights back to back: {groups}"
    assert entries["linear"] == (["qgemv"] if m <= 8 else ["qmm"]), entries  # K = 64: 2 blocks, not split
    _check(case, outs, data)


# ---------------------------------------------------------------------------- binding limit

_SPLIT = [
    # decode rows: 197 rows of 54 bytes (q4_0, K = 96) are 10.6 KB
    Case("quant/split/qgemv", [Leaf("x", "float", (3, 96)), Leaf("w", "q4_0", (197, 96), kind="prepack"),
                               Leaf("b", "float", (197,), kind="const")], [Op("linear", ["x", "w", "b"], out="y")], ["y"],
         red=96),
    # prefill rows: 97 rows of 102 bytes (q8_0, K = 96) are 9.9 KB
    Case("quant/split/qmm", [Leaf("x", "float", (17, 96)), Leaf("w", "q8_0", (97, 96), kind="const")],
         [Op("linear", ["x", "w", None], out="y")], ["y"], red=96),
    # x (40 x 96 float32: 15 KB) and the output (8.5 KB) over a binding: ranges of x's rows
    Case("quant/split/x_rows", [Leaf("x", "float", (40, 96)), Leaf("w", "q4_1", (53, 96), kind="prepack"),
                                Leaf("b", "float", (53,), kind="prepack")], [Op("linear", ["x", "w", "b"], out="y")],
         ["y"], red=96),
    # a table of 211 rows of 60 bytes (q4_1, D = 96): 12.7 KB
    Case("quant/split/qembed", [Leaf("w", "q4_1", (211, 96), kind="prepack"), Leaf("ids", "int32", (3, 5), "ids", hi=211)],
         [Op("embedding", ["w", "ids"], out="y")], ["y"]),
]


@pytest.mark.parametrize("case", _SPLIT, ids=lambda c: c.id)
def test_packed_products_and_gathers_over_the_binding_limit_are_split(env, case):
    data = make_data(case)
    prog, _ = build_program(case, data)
    limits = env.context("wgpu-quant-small-binding").limits
    assert limits.max_binding_size == SMALL_BINDING
    plan = plan_session(gpudelegate.loads(prog.to_bytes()), limits)
    (d,) = [d for d in plan.payloads[0].dispatches]
    assert any(r.buf.nbytes > SMALL_BINDING for r in d.args + d.outputs if r is not None), \
        "every operand fits one binding: the test would prove nothing"
    calls = lowering.select(d, limits)
    assert len([c for c in calls if c.entry in ("qgemv", "qmm", "qembed")]) >= 2, [c.label for c in calls]
    for c in calls:
        for b in c.bindings:
            assert b.buf.nbytes <= SMALL_BINDING and b.buf.offset % limits.offset_alignment == 0, (c.label, b)
    outs, _, _, _ = _run(env, case, "wgpu-quant-small-binding", data=data)
    _check(case, outs, data)


# ---------------------------------------------------------------------------- device buffers

def test_packed_weight_buffers_hold_their_bytes_rounded_to_words(env):
    """A packed weight's device buffer is its byte count rounded up to 4 (the kernels read u32
    words): 7 rows of one q4_0 block are 126 bytes, 5 q8_0 rows of 5 blocks 850."""
    case = Case("quant/sizes", [Leaf("x", "float", (2, 32)), Leaf("w", "q4_0", (7, 32), kind="prepack"),
                                Leaf("x2", "float", (2, 160)), Leaf("w2", "q8_0", (5, 160), kind="const")],
                [Op("linear", ["x", "w", None], out="y"), Op("linear", ["x2", "w2", None], out="y2")], ["y", "y2"], red=160)
    data = make_data(case)
    outs, _, plan, sizes = _run(env, case, data=data)
    _check(case, outs, data)
    got = sorted((b.dtype, b.nbytes, sizes[i]) for i, b in enumerate(plan.prepack.buffers))
    assert got == [("q4_0", 126, round4(126)), ("q8_0", 850, round4(850))]
