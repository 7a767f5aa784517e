"""Fused epilogues (core/plan/fusion.py `epilogue_fusions`, core/webgpu/lowering.py `select_all`,
matmul_fast.wgsl ACT and RES): a float32 linear followed by gelu (erf or tanh) or by a residual
add runs as one kernel that writes the consumer's output. Checked on wgpu against float64 numpy at fp32 tolerances
(rtol 1e-4, atol 1e-5 sqrt(K)) through every kernel that takes them (mm_f32, mm_f32_4, split-K
sums), with the ops kept apart where the fast kernel cannot run (gemv rows, float16) or the
pattern does not hold (the linear's output read twice or returned, overlapping storage).

Runs on any wgpu adapter (software Vulkan in CI); the plan-level rules need no adapter.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpudelegate.plan import fusion
from gpudelegate.plan.types import BufferRef, DeviceLimits, Dispatch, PayloadPlan, TensorRef
from gpudelegate.webgpu import lowering

from conformance.cases import Case, Leaf, Op
from conformance.executors import environment_fixture, run_on

pytestmark = pytest.mark.wgpu

env = environment_fixture("wgpu")


def _run(env, case: Case, tuning: lowering.Tuning = lowering.Tuning(), atol: float = 1e-5, scaled: bool = False):
    return run_on(env, case, "wgpu", tuning, atol, scaled)


def _gelu_case(m=131, approximate="none", bias=True, storage="float32"):
    # M prime, N = 4 x 11, K = 4 x 17: partial tiles everywhere.
    leaves = [Leaf("x", "float", (m, 68)), Leaf("w", "float", (44, 68), kind="prepack")]
    args = ["x", "w"]
    if bias:
        leaves.append(Leaf("b", "float", (44,), kind="prepack"))
        args.append("b")
    return Case(f"epi/linear_gelu_{approximate}_{m}", leaves,
                [Op("linear", args, out="y"), Op("gelu", ["y"], {"approximate": approximate}, out="z")], ["z"],
                storage=storage, red=68)


def _residual_case(m=131, lin_first=True, batch=True):
    # x [2, m, 68] (batched rows, as a transformer's hidden states) -> linear -> + r
    shape = (2, m) if batch else (m,)
    add = ["y", "r"] if lin_first else ["r", "y"]
    return Case(f"epi/linear_add_{'yr' if lin_first else 'ry'}_{m}",
                [Leaf("x", "float", shape + (68,)), Leaf("r", "float", shape + (44,)),
                 Leaf("w", "float", (44, 68), kind="prepack"), Leaf("b", "float", (44,), kind="prepack")],
                [Op("linear", ["x", "w", "b"], out="y"), Op("add", add, out="z")], ["z"], red=68)


TUNINGS = {"picked": lowering.Tuning(), "mm_f32 64": lowering.Tuning(mm_tile=64),
           "mm_f32 64x128 split 2": lowering.Tuning(mm_tile=64, mm_tile_n=128, mm_ksplit=2),
           "mm_f32 128 two stages": lowering.Tuning(mm_tile=128),
           "mm_f32_4 32 split 3": lowering.Tuning(mm_tile=32, mm_ksplit=3, mm_bk=8)}


@pytest.mark.parametrize("tname", sorted(TUNINGS))
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_linear_gelu_runs_in_the_matrix_kernel(env, tname, approximate):
    by_op = _run(env, _gelu_case(approximate=approximate), TUNINGS[tname])
    assert by_op["gelu"] == [], by_op  # nothing of its own: the linear's kernel wrote z
    assert any(e.startswith("mm_f32") for e in by_op["linear"]), by_op
    if "split" in tname:
        assert "mm_f32_sum" in by_op["linear"], by_op  # the epilogue runs on the summed partials


@pytest.mark.parametrize("tname", sorted(TUNINGS))
@pytest.mark.parametrize("lin_first", [True, False])
def test_linear_residual_add_runs_in_the_matrix_kernel(env, tname, lin_first):
    by_op = _run(env, _residual_case(lin_first=lin_first), TUNINGS[tname])
    assert by_op["add"] == [], by_op


def test_fusion_off_keeps_the_ops_apart(env):
    by_op = _run(env, _gelu_case(), lowering.Tuning(fuse=False))
    assert by_op["gelu"] == ["map"], by_op


@pytest.mark.parametrize("case", [_gelu_case(m=3), _gelu_case(bias=False, m=3)], ids=lambda c: c.id)
def test_gemv_rows_take_the_epilogue(env, case):
    # M <= 8 runs on gemv.wgsl's gemv, which applies the epilogue itself; the older gemv_k
    # (Tuning(gemv_old=True)) takes none, so there both ops run. Results are right either way.
    by_op = _run(env, case)
    assert by_op["gelu"] == [] and by_op["linear"] == ["gemv"], by_op
    by_op = _run(env, case, lowering.Tuning(gemv_old=True))
    assert by_op["gelu"] == ["map"] and by_op["linear"] == ["gemv_k"], by_op


def test_float16_storage_keeps_the_ops_apart(env):
    by_op = _run(env, _gelu_case(storage="float16"), atol=2e-2)
    assert by_op["gelu"] == ["map"], by_op


def test_linear_output_read_elsewhere_is_not_fused(env):
    case = Case("epi/y_also_output", [Leaf("x", "float", (131, 68)), Leaf("w", "float", (44, 68), kind="prepack")],
                [Op("linear", ["x", "w"], out="y"), Op("gelu", ["y"], out="z")], ["z", "y"], red=68)
    by_op = _run(env, case)
    assert by_op["gelu"] == ["map"], by_op


# ---------------------------------------------------------------------------- plan-level rules

def _ref(v, shape, index, offset=0):
    n = 4 * int(np.prod(shape))
    return TensorRef(v, "float32", tuple(shape), BufferRef("arena", index, offset, n))


def _pp(dispatches, outputs):
    return PayloadPlan(0, None, dispatches, [], outputs)


def test_epilogue_rules_on_a_plan():
    x, w, y = _ref(0, (37, 8), 0), _ref(1, (12, 8), 1), _ref(2, (37, 12), 2)
    z = _ref(3, (37, 12), 3)
    lin = Dispatch(0, "linear", {}, [x, w], [y])
    gelu = Dispatch(1, "gelu", {}, [y], [z])
    assert fusion.epilogue_fusions(_pp([lin, gelu], [z])) == {0: fusion.Epilogue(1, 1, None, z)}
    # z placed over x (the planner may reuse storage the linear read last): kept apart.
    z_on_x = _ref(3, (37, 12), 0)
    assert fusion.epilogue_fusions(_pp([lin, Dispatch(1, "gelu", {}, [y], [z_on_x])], [z_on_x])) == {}
    # y returned, or read by a later op too, or the consumer not right after the linear: apart.
    assert fusion.epilogue_fusions(_pp([lin, gelu], [z, y])) == {}
    later = Dispatch(2, "neg", {}, [y], [_ref(4, (37, 12), 4)])
    assert fusion.epilogue_fusions(_pp([lin, gelu, later], [z])) == {}
    other = Dispatch(1, "neg", {}, [x], [_ref(5, (37, 8), 5)])
    assert fusion.epilogue_fusions(_pp([lin, other, Dispatch(2, "gelu", {}, [y], [z])], [z])) == {}
    # add: the residual must match y's shape (no broadcast) and not be y itself.
    r = _ref(6, (37, 12), 6)
    assert fusion.epilogue_fusions(_pp([lin, Dispatch(1, "add", {}, [r, y], [z])], [z])) == \
        {0: fusion.Epilogue(1, 0, r, z)}
    row = _ref(7, (1, 12), 7)
    assert fusion.epilogue_fusions(_pp([lin, Dispatch(1, "add", {}, [y, row], [z])], [z])) == {}
    assert fusion.epilogue_fusions(_pp([lin, Dispatch(1, "add", {}, [y, y], [z])], [z])) == {}
    # select_all: the consumer's list is empty, the linear's kernel carries ACT.
    calls = lowering.select_all(_pp([lin, gelu], [z]), DeviceLimits())
    assert calls[1] == [] and calls[0][-1].constants["ACT"] == 1


# ---------------------------------------------------------------------------- permutes folded into sdpa

def _bert_attention(B=2, T=19, H=3, Hk=3, D=8, mask=True):
    """Projections, head split (reshape + [0, 2, 1, 3] permute), attention (composite path: more
    than 16 query rows), head merge, output projection and residual: what MiniLM runs."""
    W = H * D
    leaves = [Leaf("x", "float", (B, T, W)), Leaf("wq", "float", (W, W), kind="prepack"),
              Leaf("wk", "float", (Hk * D, W), kind="prepack"), Leaf("wv", "float", (Hk * D, W), kind="prepack"),
              Leaf("wo", "float", (W, W), kind="prepack")]
    ops = [Op("linear", ["x", "wq", None], out="q"), Op("linear", ["x", "wk", None], out="k"),
           Op("linear", ["x", "wv", None], out="v"),
           Op("reshape", ["q"], {"shape": [B, T, H, D]}, "q4"), Op("reshape", ["k"], {"shape": [B, T, Hk, D]}, "k4"),
           Op("reshape", ["v"], {"shape": [B, T, Hk, D]}, "v4"),
           Op("permute", ["q4"], {"dims": [0, 2, 1, 3]}, "qh"), Op("permute", ["k4"], {"dims": [0, 2, 1, 3]}, "kh"),
           Op("permute", ["v4"], {"dims": [0, 2, 1, 3]}, "vh")]
    args = ["qh", "kh", "vh"]
    if mask:
        leaves.append(Leaf("m", "float", (B, 1, 1, T)))
        args.append("m")
    ops += [Op("sdpa", args, {}, "att"), Op("permute", ["att"], {"dims": [0, 2, 1, 3]}, "mrg"),
            Op("reshape", ["mrg"], {"shape": [B, T, W]}, "mf"), Op("linear", ["mf", "wo", None], out="o"),
            Op("add", ["o", "x"], out="y")]
    return Case(f"fold/bert_attention_T{T}_Hk{Hk}", leaves, ops, ["y"], red=max(W, T))


@pytest.mark.parametrize("case", [_bert_attention(), _bert_attention(Hk=1, mask=False)], ids=lambda c: c.id)
def test_head_permutes_fold_into_the_attention(env, case):
    # three chained float32 products: 1e-6 of the largest output per sqrt(24) (~6e-6 relative)
    by_op = _run(env, case, atol=1e-6, scaled=True)
    assert by_op["permute"] == [], by_op  # q, k, v read and the output written through strides
    assert by_op["add"] == [], by_op
    assert by_op["sdpa"], by_op
    by_op = _run(env, case, lowering.Tuning(fuse=False), atol=1e-6, scaled=True)
    assert len(by_op["permute"]) == 4, by_op


def test_decode_attention_keeps_its_permutes(env):
    # 5 query rows: the fused decode kernels, which read [B, H, T, D] only.
    by_op = _run(env, _bert_attention(T=5), atol=1e-6, scaled=True)
    assert len(by_op["permute"]) == 4 and by_op["sdpa"], by_op


def test_sdpa_fold_rules_on_a_plan():
    x = _ref(0, (1, 19, 2, 8), 0)
    qh, k, v = _ref(1, (1, 2, 19, 8), 1), _ref(2, (1, 2, 19, 8), 2), _ref(3, (1, 2, 19, 8), 3)
    att, out = _ref(4, (1, 2, 19, 8), 4), _ref(5, (1, 19, 2, 8), 5)
    perm = Dispatch(0, "permute", {"dims": [0, 2, 1, 3]}, [x], [qh])
    sdpa = Dispatch(1, "sdpa", {}, [qh, k, v], [att])
    back = Dispatch(2, "permute", {"dims": [0, 2, 1, 3]}, [att], [out])
    f = fusion.sdpa_folds(_pp([perm, sdpa, back], [out]))
    assert f == {1: fusion.SdpaFold({"q": x}, out, (0, 2))}
    # x overwritten between the permute and the attention: q is read from the permute's output.
    clobber = Dispatch(1, "neg", {}, [k], [_ref(6, (1, 19, 2, 8), 0)])
    sdpa2 = Dispatch(2, "sdpa", {}, [qh, k, v], [att])
    assert fusion.sdpa_folds(_pp([perm, clobber, sdpa2], [att])) == {}
    # other permutations, a permuted q read twice, an output placed over what the attention reads
    other = Dispatch(0, "permute", {"dims": [0, 1, 3, 2]}, [_ref(0, (1, 2, 8, 19), 0)], [qh])
    assert fusion.sdpa_folds(_pp([other, sdpa], [att])) == {}
    twice = Dispatch(2, "neg", {}, [qh], [_ref(7, (1, 2, 19, 8), 7)])
    assert fusion.sdpa_folds(_pp([perm, sdpa, twice], [att])) == {}
    over_k = _ref(5, (1, 19, 2, 8), 2)
    assert fusion.sdpa_folds(_pp([sdpa, Dispatch(2, "permute", {"dims": [0, 2, 1, 3]}, [att], [over_k])],
                                 [over_k])) == {}


# ---------------------------------------------------------------------------- sibling linears

def _siblings_case(bias=True, n=64):
    # three linears reading x (38 rows over a batch of 2): weights 64 x 40 (and biases of 64,
    # 256 bytes: an offset_alignment multiple) placed back to back run as one batched product
    leaves = [Leaf("x", "float", (2, 19, 40))]
    ops = []
    for name in "qkv":
        leaves.append(Leaf(f"w{name}", "float", (n, 40), kind="prepack"))
        args = ["x", f"w{name}", None]
        if bias:
            leaves.append(Leaf(f"b{name}", "float", (n,), kind="prepack"))
            args[2] = f"b{name}"
        ops.append(Op("linear", args, out=name))
    return Case(f"siblings/qkv_bias{bias}_{n}", leaves, ops, ["q", "k", "v"], red=40)


@pytest.mark.parametrize("tname", ["picked", "mm_f32 64", "mm_f32_4 32 split 3", "mm_f32 64x128 split 2"])
@pytest.mark.parametrize("bias", [True, False])
def test_sibling_linears_run_as_one_batched_product(env, tname, bias):
    import dataclasses

    fused = _run(env, _siblings_case(bias), TUNINGS[tname])["linear"]
    apart = _run(env, _siblings_case(bias), dataclasses.replace(TUNINGS[tname], fuse=False))["linear"]
    assert len(apart) == 3 * len(fused), (fused, apart)  # one product's kernels instead of three


def test_sibling_linears_share_one_device_buffer(env):
    import gpudelegate
    from conformance.cases import build_program, make_data

    case = _siblings_case()
    data = make_data(case)
    prog, names = build_program(case, data)
    with env.session(gpudelegate.loads(prog.to_bytes()), device="wgpu") as s:
        ex = s.executor
        assert len(ex._contiguous) == 2, ex._contiguous  # the weights, the biases
        for g in ex._contiguous:
            assert len({id(ex.resident[i]) for i in g}) == 1
            assert [ex._res_base[i] for i in g] == [j * s.plan.prepack.buffers[g[0]].nbytes for j in range(3)]
        nodes = [n for n in ex.recorded[0].nodes if n.op == "linear"]
        assert [len(n.launches) > 0 for n in nodes] == [True, False, False]
    # With fusion off (as the browser executor, which never co-locates) each runs on its own.
    by_op = _run(env, case, lowering.Tuning(fuse=False))
    assert len(by_op["linear"]) == 3, by_op


def test_sibling_groups_on_a_plan():
    x, y = _ref(0, (38, 40), 0), [_ref(10 + i, (38, 64), 10 + i) for i in range(3)]
    ws = [TensorRef(20 + i, "float32", (64, 40), BufferRef("resident", i, 0, 64 * 40 * 4)) for i in range(3)]
    lin = [Dispatch(i, "linear", {}, [x, ws[i]], [y[i]]) for i in range(3)]
    pp = _pp(lin, y)
    assert fusion._sibling_sets(pp) == [[0, 1, 2]]
    calls = lowering.select_all(pp, DeviceLimits(), contiguous=[(0, 1, 2)])
    assert [len(c) > 0 for c in calls] == [True, False, False] and calls[0][0].constants["NC"] == 3
    # not placed back to back: each alone
    assert all(lowering.select_all(pp, DeviceLimits()))
    # a later member's output over the shared input: it cannot be written early
    y2 = _ref(11, (38, 64), 0)
    pp2 = _pp([lin[0], Dispatch(1, "linear", {}, [x, ws[1]], [y2]), lin[2]], [y[0], y2, y[2]])
    assert fusion._siblings(pp2, [(0, 1, 2)], set()) == {}


def test_sibling_linears_with_one_shared_bias(env):
    # Equal bias constants are deduplicated into one buffer (zeros, in a freshly initialized
    # model): the batched product adds that one bias to every member, nothing to place.
    base = _siblings_case()
    leaves = [lf for lf in base.leaves if not lf.name.startswith("b")] + [Leaf("b", "float", (64,), kind="prepack")]
    ops = [Op("linear", ["x", f"w{n}", "b"], out=n) for n in "qkv"]
    case = Case("siblings/shared_bias", leaves, ops, ["q", "k", "v"], red=40)
    import dataclasses

    fused = _run(env, case)["linear"]
    apart = _run(env, case, dataclasses.replace(lowering.Tuning(), fuse=False))["linear"]
    assert len(apart) == 3 * len(fused), (fused, apart)
