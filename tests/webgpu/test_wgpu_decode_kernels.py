"""Decode-time kernels on wgpu against float64 numpy (conformance goldens): the gemv family
(shaders/gemv.wgsl, gemv_any.wgsl: M <= 8 rows, weights along k, float32 or float16, with bias,
gelu, residual and sibling epilogues) and flash-decoding attention (shaders/attention_flash.wgsl:
key chunks over many workgroups, then a combine), plus checks that the lowering picks them for
SmolLM2-135M's decode shapes.

Tolerances are the conformance suite's float32 ones (rtol 1e-4, atol 1e-5 sqrt(K)) also for
float16 weights: the goldens use the float16-rounded weights the device holds, and the kernels
accumulate in float32. Runs on any wgpu adapter (lavapipe in CI); shapes stay small enough for a
software rasterizer except the decode shapes themselves (K up to 1536, 1000-key caches).
"""

from __future__ import annotations

import numpy as np
import pytest

from gpudelegate.webgpu import lowering

from conformance.cases import Case, Leaf, Op
from conformance.executors import environment_fixture, run_on

pytestmark = pytest.mark.wgpu

env = environment_fixture("wgpu")

GEMV_M = (1, 2, 3, 5, 8)
GEMV_N = (1, 7, 192, 577, 1537)
GEMV_K = (3, 64, 577, 1536)
WEIGHTS = {"f32": "prepack", "f16": "prepack_fp16"}


def _gemv_entry(k: int, wkind: str) -> str:
    """The kernel the lowering must pick for a linear of this K: gemv.wgsl where weight rows are
    whole 16-byte chunks (4 float32, 8 float16), gemv_any.wgsl otherwise."""
    return "gemv" if k % (4 if wkind == "f32" else 8) == 0 else "gemv_any"


@pytest.mark.parametrize("k", GEMV_K)
@pytest.mark.parametrize("wkind", sorted(WEIGHTS))
@pytest.mark.parametrize("m", GEMV_M)
def test_gemv_every_shape(env, m, wkind, k):
    # One program per (M, weights, K): a linear for every N, with a bias on every other one.
    leaves = [Leaf("x", "float", (m, k))]
    ops, outs = [], []
    for i, n in enumerate(GEMV_N):
        leaves.append(Leaf(f"w{n}", "float", (n, k), kind=WEIGHTS[wkind]))
        b = None
        if i % 2 == 0:
            b = f"b{n}"
            leaves.append(Leaf(b, "float", (n,), kind="prepack"))
        ops.append(Op("linear", ["x", f"w{n}", b], out=f"y{n}"))
        outs.append(f"y{n}")
    by_op = run_on(env, Case(f"gemv/m{m}_{wkind}_k{k}", leaves, ops, outs, red=k), "wgpu")
    assert by_op["linear"] == [_gemv_entry(k, wkind)] * len(GEMV_N), by_op


def _run(env, case: Case, tuning=None, fix=None, device: str = "wgpu"):
    """run_on with the case's data first edited by ``fix(data)`` (fully masked rows, NaNs);
    returns {op: [kernel entry points]} of the recorded nodes."""
    import gpudelegate

    from conformance.cases import build_program, golden, make_data, tolerance

    data = make_data(case)
    if fix is not None:
        fix(data)
    prog, names = build_program(case, data)
    prog = gpudelegate.loads(prog.to_bytes())
    with env.session(prog, device=device, **({"tuning": tuning} if tuning else {})) as s:
        outs = s.run("forward", [data[n] for n in names])
        by_op = {}
        for n in s.executor.recorded[0].nodes:
            by_op.setdefault(n.op, []).extend(L.pipeline.label.split(":")[-1].strip() for L in n.launches)
    rtol, atol = tolerance(case)
    for i, (g, w) in enumerate(zip(outs, golden(case, data))):
        np.testing.assert_allclose(np.asarray(g).astype(np.float64), w, rtol=rtol, atol=atol,
                                   err_msg=f"{case.id} output {i} ({by_op})")
    return by_op, outs


# ---------------------------------------------------------------------------- gemv epilogues

def _epilogue_case(m: int, n: int, k: int, wkind: str, epi: str) -> Case:
    leaves = [Leaf("x", "float", (m, k)), Leaf("w", "float", (n, k), kind=WEIGHTS[wkind]),
              Leaf("b", "float", (n,), kind="prepack")]
    ops = [Op("linear", ["x", "w", "b"], out="y")]
    if epi.startswith("gelu"):
        ops.append(Op("gelu", ["y"], {"approximate": "tanh" if epi == "gelu_tanh" else "none"}, out="z"))
    else:  # a residual add, the linear's output on either side
        leaves.append(Leaf("r", "float", (m, n)))
        ops.append(Op("add", ["y", "r"] if epi == "residual" else ["r", "y"], out="z"))
    return Case(f"gemv_epi/{epi}_m{m}_n{n}_k{k}_{wkind}", leaves, ops, ["z"], red=k)


@pytest.mark.parametrize("epi", ["gelu", "gelu_tanh", "residual", "residual_first"])
@pytest.mark.parametrize("n,k", [(192, 576), (7, 577)])  # gemv (float32 weights) and gemv_any
@pytest.mark.parametrize("wkind", sorted(WEIGHTS))
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_fused_epilogues(env, m, wkind, n, k, epi):
    by_op, _ = _run(env, _epilogue_case(m, n, k, wkind, epi))
    consumer = "gelu" if epi.startswith("gelu") else "add"
    assert by_op[consumer] == [], by_op  # nothing of its own: the gemv wrote z
    assert by_op["linear"] == [_gemv_entry(k, wkind)], by_op


def _siblings_case(m: int, z: int, bias: bool) -> Case:
    # z linears reading one x with same-shaped identity-prepacked weights: the executor places them
    # back to back and the lowering runs them as one product over z (gemv NC, BIAS 3 per member).
    leaves = [Leaf("x", "float", (m, 64))]
    ops = []
    for i in range(z):
        leaves.append(Leaf(f"w{i}", "float", (192, 64), kind="prepack"))
        if bias:
            leaves.append(Leaf(f"b{i}", "float", (192,), kind="prepack"))
        ops.append(Op("linear", ["x", f"w{i}", f"b{i}" if bias else None], out=f"y{i}"))
    return Case(f"gemv_sib/m{m}_z{z}_{'bias' if bias else 'nobias'}", leaves, ops, [f"y{i}" for i in range(z)],
                red=64)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("z", [2, 3])
@pytest.mark.parametrize("m", [1, 5])
def test_gemv_sibling_linears_as_one_product(env, m, z, bias):
    by_op, _ = _run(env, _siblings_case(m, z, bias))
    assert by_op["linear"] == ["gemv"], by_op  # the first runs all z, the others nothing


def test_older_gemv_kernels_still_selectable(env):
    # Tuning(gemv_old=True): gemv_k for M <= 4 (what bench_gemv.py compares against), the
    # epilogue then runs apart; above 4 rows the tiles.
    by_op, _ = _run(env, _epilogue_case(3, 192, 576, "f32", "gelu"), lowering.Tuning(gemv_old=True))
    assert by_op["linear"] == ["gemv_k"] and by_op["gelu"] == ["map"], by_op
    by_op, _ = _run(env, _epilogue_case(8, 7, 577, "f32", "residual"), lowering.Tuning(gemv_old=True))
    assert not any(e.startswith("gemv") for e in by_op["linear"]), by_op


@pytest.mark.parametrize("lanes,cols", [(32, 8), (64, 1), (128, 2), (256, 1)])
def test_gemv_forced_shapes(env, lanes, cols):
    # Every threads-per-column width (one to several loop trips per thread) and columns per
    # workgroup, against float64: what bench_gemv.py's variants force.
    case = Case(f"gemv_shape/l{lanes}_c{cols}", [Leaf("x", "float", (5, 1536)), Leaf("x3", "float", (5, 577)),
                                                 Leaf("w", "float", (37, 1536), kind="prepack"),
                                                 Leaf("w3", "float", (37, 577), kind="prepack_fp16")],
                [Op("linear", ["x", "w", None], out="y"), Op("linear", ["x3", "w3", None], out="y3")],
                ["y", "y3"], red=1536)
    by_op, _ = _run(env, case, lowering.Tuning(gemv_lanes=lanes, gemv_cols=cols))
    assert by_op["linear"] == ["gemv", "gemv_any"], by_op


def test_gemv_edges(env):
    # No rows, no columns, and K = 0 (zeros, or the bias: a product over nothing) next to a
    # 2-D grid of columns (more than 65535 workgroups of one column each).
    leaves = [Leaf("x0", "float", (0, 64)), Leaf("x", "float", (2, 64)), Leaf("xk", "float", (2, 0)),
              Leaf("w", "float", (5, 64), kind="prepack"), Leaf("w0", "float", (0, 64), kind="prepack"),
              Leaf("wk", "float", (5, 0), kind="prepack"), Leaf("b", "float", (5,), kind="prepack")]
    ops = [Op("linear", ["x0", "w", "b"], out="y0"), Op("linear", ["x", "w0", None], out="y1"),
           Op("linear", ["xk", "wk", "b"], out="y2"), Op("linear", ["xk", "wk", None], out="y3")]
    by_op, outs = _run(env, Case("gemv_edge/empty", leaves, ops, ["y0", "y1", "y2", "y3"], red=64))
    assert outs[0].shape == (0, 5) and outs[1].shape == (2, 0), [o.shape for o in outs]
    assert not any(e.startswith("gemv") for e in by_op["linear"]), by_op  # nothing to run, or fills
    wide = Case("gemv_edge/many_groups", [Leaf("x", "float", (1, 8)), Leaf("w", "float", (70001, 8), kind="prepack")],
                [Op("linear", ["x", "w", None], out="y")], ["y"], red=8)
    by_op, _ = _run(env, wide, lowering.Tuning(gemv_cols=1, gemv_lanes=32))
    assert by_op["linear"] == ["gemv"], by_op


SMALL_BINDING = 4096


def _small_binding_context(env_):
    from gpudelegate.native.wgpu_device import WgpuContext

    return WgpuContext(env_, limits_override={"max_binding_size": SMALL_BINDING})


def test_gemv_weights_over_one_binding(env):
    # Weights of 61 x 64 float32 (15.6 KiB) with 4 KiB bindings: the lowering splits N, each part a
    # gemv call whose weight rows stay 16-byte aligned; and a prime K through gemv_any.
    from gpudelegate.environment import register_device

    register_device("wgpu-gemv-small-bindings", _small_binding_context)
    case = Case("gemv_split/n", [Leaf("x", "float", (3, 64)), Leaf("w", "float", (61, 64), kind="prepack"),
                                 Leaf("b", "float", (61,), kind="prepack"), Leaf("x2", "float", (2, 29)),
                                 Leaf("w2", "float", (61, 29), kind="prepack")],
                [Op("linear", ["x", "w", "b"], out="y"), Op("linear", ["x2", "w2", None], out="y2")], ["y", "y2"],
                red=64)
    by_op, _ = _run(env, case, device="wgpu-gemv-small-bindings")
    entries = by_op["linear"]
    assert entries.count("gemv") >= 4 and entries.count("gemv_any") >= 2 and set(entries) == {"gemv", "gemv_any"}, by_op


# ---------------------------------------------------------------------------- flash-decoding

def _sdpa_case(tag: str, q, k, v, mask=None, attrs=None) -> Case:
    leaves = [Leaf("q", "float", q), Leaf("k", "float", k), Leaf("v", "float", v)]
    args = ["q", "k", "v"]
    if mask is not None:
        dtype, shape = mask
        leaves.append(Leaf("m", dtype, shape, gen="keep" if dtype == "bool" else "normal"))
        args.append("m")
    return Case(f"flash/{tag}", leaves, [Op("sdpa", args, dict(attrs or {}), out="y")], ["y"], red=k[2])


FLASH = {"attn_flash", "attn_flash_combine"}


@pytest.mark.parametrize("keys", [None, 16, 32])
@pytest.mark.parametrize("tk", [1, 17, 256, 1000])
def test_flash_decoding_smollm2_shape(env, tk, keys):
    # SmolLM2's decode: 9 query heads over 3 kv heads, one query row, a bool keep-mask [1, Tk].
    # Two query rows here (a 2-token step), the first keeping no key at all: zeros, as torch.
    case = _sdpa_case(f"smollm2_tk{tk}", (1, 9, 2, 64), (1, 3, tk, 64), (1, 3, tk, 64), ("bool", (2, tk)))

    def dead_row(data):
        data["m"][0] = False

    by_op, outs = _run(env, case, lowering.Tuning(attn_flash_keys=keys), fix=dead_row)
    assert set(by_op["sdpa"]) == FLASH, by_op
    y = outs[0]
    assert (y[:, :, 0] == 0).all() and np.isfinite(y[:, :, 1]).all()


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("keys", [16, 32])
@pytest.mark.parametrize("pos", [0, 13, 31, 32, 131, 255])
def test_flash_decoding_smollm2_positions(env, pos, keys, rows):
    # A decode step at cache row pos of a 256-row cache, SmolLM2's keep-mask (keys j <= pos): the
    # first row alone, a prime, a chunk's last and next first key, the last row; every chunk
    # past pos keeps no key (its partial changes nothing in the combine). One query row a
    # workgroup (the default) and SmolLM2's 3 rows of a kv head in one.
    case = _sdpa_case(f"smollm2_pos{pos}", (1, 9, 1, 64), (1, 3, 256, 64), (1, 3, 256, 64), ("bool", (1, 256)))

    def keep_to_pos(data):
        data["m"][0] = np.arange(256) <= pos

    by_op, outs = _run(env, case, lowering.Tuning(attn_flash_keys=keys, attn_flash_rows=rows), fix=keep_to_pos)
    assert set(by_op["sdpa"]) == FLASH, by_op
    assert np.isfinite(outs[0]).all()


FLASH_CASES = [
    # causal offset -2 over 3 query rows: rows 0 and 1 keep nothing; 5 rows per kv head (two row
    # blocks of attn_flash's 4, the last partial); head dim 12 (3 vec4s), value dim 8
    ("causal_dead_rows", (1, 4, 3, 12), (1, 2, 37, 12), (1, 2, 37, 8), None, {"causal": True, "causal_offset": -2}),
    # decode-like causal offset into a longer cache, batch 2, float mask broadcast over heads and rows
    ("float_mask_batch", (2, 6, 1, 16), (2, 3, 300, 16), (2, 3, 300, 4), ("float", (2, 1, 1, 300)),
     {"causal": True, "causal_offset": 250}),
    # head dims past 64 (the key loop past the first four vec4s, values past four keys per thread)
    ("head_dim_128", (1, 8, 1, 128), (1, 2, 200, 128), (1, 2, 200, 128), ("bool", (1, 200)), None),
    # value dim 256: the combine has 4 chunk groups, each merging several trips of four chunks
    ("head_dim_256", (1, 2, 2, 256), (1, 1, 600, 256), (1, 1, 600, 256), None, None),
    # no grouping (H == Hk), 16 query rows (the short path's most), the mask per batch and row
    ("mha_16_rows", (2, 2, 16, 8), (2, 2, 45, 8), (2, 2, 45, 12), ("bool", (2, 1, 16, 45)), None),
    # G = 4 (one full block of 4 rows), head dim 32 over value dim 64, a causal offset past the cache
    ("gqa4_d32_v64", (1, 8, 1, 32), (1, 2, 70, 32), (1, 2, 70, 64), None, {"causal": True, "causal_offset": 69}),
]


@pytest.mark.parametrize("keys", [16, 32])
@pytest.mark.parametrize("tag,q,k,v,mask,attrs", FLASH_CASES, ids=[c[0] for c in FLASH_CASES])
def test_flash_decoding_layouts(env, tag, q, k, v, mask, attrs, keys):
    by_op, outs = _run(env, _sdpa_case(tag, q, k, v, mask, attrs), lowering.Tuning(attn_flash_keys=keys))
    assert set(by_op["sdpa"]) == FLASH, by_op
    if tag == "causal_dead_rows":
        assert (outs[0][:, :, :2] == 0).all() and np.isfinite(outs[0][:, :, 2]).all()


@pytest.mark.parametrize("rows", [2, 3, 4])
@pytest.mark.parametrize("tag", ["causal_dead_rows", "mha_16_rows", "gqa4_d32_v64"])
def test_flash_decoding_rows_a_workgroup(env, tag, rows):
    # 2, 3 or 4 query rows of a kv head a workgroup (Tuning.attn_flash_rows; the other cases run
    # the default 1): blocks that split a head group, the last one partial.
    _, q, k, v, mask, attrs = next(c for c in FLASH_CASES if c[0] == tag)
    by_op, outs = _run(env, _sdpa_case(tag, q, k, v, mask, attrs), lowering.Tuning(attn_flash_rows=rows))
    assert set(by_op["sdpa"]) == FLASH, by_op
    if tag == "causal_dead_rows":
        assert (outs[0][:, :, :2] == 0).all() and np.isfinite(outs[0][:, :, 2]).all()


@pytest.mark.parametrize("rows", [1, 4])
def test_flash_decoding_float_mask_rows_of_minus_inf_and_nan(env, rows):
    # An additive mask that is -inf over a whole row (zeros, as torch), -inf over some keys (they
    # drop out), and a NaN query element (its row is NaN, the others are not).
    case = _sdpa_case("inf_nan", (1, 3, 3, 8), (1, 1, 50, 8), (1, 1, 50, 8), ("float", (3, 50)))

    def edit(data):
        data["m"][0] = -np.inf
        data["m"][1, ::3] = -np.inf
        data["q"][0, 2, 2, 5] = np.nan

    by_op, outs = _run(env, case, lowering.Tuning(attn_flash_rows=rows), fix=edit)
    assert set(by_op["sdpa"]) == FLASH, by_op
    y = outs[0]
    assert (y[0, :, 0] == 0).all() and np.isnan(y[0, 2, 2]).all() and np.isfinite(y[0, :2, 1:]).all()


@pytest.mark.parametrize("rows", [1, 4])
def test_flash_decoding_nan_key_row_and_nan_query_row(env, rows):
    # SmolLM2's decode shape: a NaN in one kept key of kv head 1 makes its 3 query heads NaN (the
    # others stay finite); a NaN in a key past the mask changes nothing; a NaN query row (head 7,
    # kv head 2) is NaN alone.
    case = _sdpa_case("nan_rows", (1, 9, 1, 64), (1, 3, 100, 64), (1, 3, 100, 64), ("bool", (1, 100)))

    def edit(data):
        data["m"][0] = np.arange(100) <= 60
        data["k"][0, 1, 40, 3] = np.nan
        data["k"][0, 0, 80, 3] = np.nan
        data["q"][0, 7, 0, 9] = np.nan

    by_op, outs = _run(env, case, lowering.Tuning(attn_flash_rows=rows), fix=edit)
    assert set(by_op["sdpa"]) == FLASH, by_op
    y = outs[0]
    nan_heads = [3, 4, 5, 7]
    assert np.isnan(y[0, nan_heads]).all() and np.isfinite(np.delete(y[0], nan_heads, axis=0)).all()


def test_layouts_flash_declines_take_the_older_kernels(env):
    # float16 storage or a head dim that is not a multiple of 4: attn_split, still right.
    odd = _sdpa_case("odd_head_dim", (1, 4, 1, 6), (1, 2, 40, 6), (1, 2, 40, 5), ("bool", (1, 40)))
    by_op, _ = _run(env, odd)
    assert set(by_op["sdpa"]) == {"attn_split", "attn_combine"}, by_op
    half = Case("flash/f16", [Leaf("q", "float", (1, 4, 1, 8)), Leaf("k", "float", (1, 2, 40, 8)),
                              Leaf("v", "float", (1, 2, 40, 8))], [Op("sdpa", ["q", "k", "v"], out="y")], ["y"],
                storage="float16", red=40)
    by_op, _ = _run(env, half)
    assert set(by_op["sdpa"]) == {"attn_split", "attn_combine"}, by_op
    by_op, _ = _run(env, _sdpa_case("forced_off", (1, 4, 1, 8), (1, 2, 40, 8), (1, 2, 40, 8)),
                    lowering.Tuning(attn_flash=False))
    assert set(by_op["sdpa"]) == {"attn_split", "attn_combine"}, by_op


def _conformance_sdpa_cases():
    from conformance.cases import CASES

    return [c for c in CASES if c.op_names == ["sdpa"]]


@pytest.mark.parametrize("case", _conformance_sdpa_cases(), ids=lambda c: c.id)
def test_every_conformance_attention_case_on_the_short_path(env, case):
    # Every query block forced onto the short path, where flash-decoding takes what it can.
    by_op, _ = _run(env, case, lowering.Tuning(attn_fused_max_tq=1 << 20))
    shapes = {lf.name: lf.shape for lf in case.leaves}
    q, k, v = (shapes[a] for a in case.ops[0].args[:3])
    applies = case.storage == "float32" and q[3] % 4 == 0 and v[3] % 4 == 0 and 0 < q[3] <= 256 \
        and 0 < v[3] <= 256 and k[2] > 0 and 0 not in q[:3]
    assert (set(by_op["sdpa"]) == FLASH) == applies, by_op


# ---------------------------------------------------------------------------- SmolLM2's decode

def _decode_dispatch(op, args, outs):
    from gpudelegate.plan.types import BufferRef, Dispatch, TensorRef
    from gpudelegate import dtypes

    def ref(i, dtype, shape):  # each tensor in its own arena buffer, at offset 0
        return TensorRef(i, dtype, shape, BufferRef("arena", i, 0, dtypes.nbytes(dtype, shape)))

    return Dispatch(0, op, {}, [ref(i, *a) for i, a in enumerate(args)],
                    [ref(10 + i, *o) for i, o in enumerate(outs)])


@pytest.mark.parametrize("wdtype", ["float32", "float16"])
@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)])
def test_lowering_picks_gemv_for_smollm2_decode_linears(env, n, k, wdtype):
    limits = env.context("wgpu").limits
    d = _decode_dispatch("linear", [("float32", (1, 1, k)), (wdtype, (n, k))], [("float32", (1, 1, n))])
    calls = lowering.select(d, limits)
    assert [c.entry for c in calls] == ["gemv"], calls
    c = calls[0]
    groups = c.workgroups[0] * c.workgroups[1]
    # every thread's weight row in one loop trip; at least two workgroups per H100 multiprocessor
    assert c.constants["LANES"] * 4 * (4 if wdtype == "float32" else 8) >= k and groups >= 132, c


@pytest.mark.parametrize("tk", [256, 512, 2048])
def test_lowering_picks_flash_decoding_for_smollm2_attention(env, tk):
    limits = env.context("wgpu").limits
    d = _decode_dispatch("sdpa", [("float32", (1, 9, 1, 64)), ("float32", (1, 3, tk, 64)), ("float32", (1, 3, tk, 64)),
                                  ("bool", (1, tk))], [("float32", (1, 9, 1, 64))])
    calls = lowering.select(d, limits)
    assert [c.entry for c in calls] == ["attn_flash", "attn_flash_combine"], calls
    assert calls[0].workgroups[0] * calls[0].workgroups[1] * calls[0].workgroups[2] >= 48  # 3 kv heads x chunks


@pytest.mark.parametrize("weights_dtype", ["float32", "float16"])
def test_smollm2_decode_step_runs_the_decode_kernels(env, weights_dtype):
    # A one-layer SmolLM2-135M-shaped model (hidden 576, 9/3 heads, MLP 1536; a small vocabulary)
    # exported with random weights: its decode step on wgpu against the numpy reference executor,
    # and the kernels its linears and attention ran.
    torch = pytest.importorskip("torch")
    from gpudelegate.export.models import smollm2
    from gpudelegate.export.writer import export_program

    cfg = smollm2.SmolLM2Config(layers=1, vocab_size=1000, max_context=64, prefill_chunk=16)
    torch.manual_seed(0)
    model = smollm2.SmolLM2(cfg).eval()
    with torch.no_grad():
        prog = export_program({"decode": (smollm2.Decode(model), smollm2.example_inputs(cfg, "decode"))},
                              progress=False, weights_dtype=weights_dtype)
    rng = np.random.default_rng(3)
    caches = [rng.standard_normal((1, cfg.kv_heads, cfg.max_context, cfg.head_dim)).astype(np.float32)
              for _ in smollm2.cache_names(cfg)]
    inputs = [np.array([[17]], np.int32), np.array([40], np.int32), *caches]
    with env.session(prog, device="reference") as s:
        want = s.run("decode", inputs)
    for tuning in (lowering.Tuning(), lowering.Tuning(fuse=False)):
        with env.session(prog, device="wgpu", tuning=tuning) as s:
            got = s.run("decode", inputs)
            pid = prog.methods["decode"].nodes[0].attrs["payload"]
            by_op = {}
            for nd in s.executor.recorded[pid].nodes:
                by_op.setdefault(nd.op, []).extend(L.pipeline.label.split(":")[-1].strip() for L in nd.launches)
        for g, w in zip(got, want):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            assert np.abs(g - w).max() <= 1e-4 * np.abs(w).max(), (tuning, np.abs(g - w).max())
        assert set(by_op["sdpa"]) == FLASH, by_op
        # The float linears run gemv (those a planner fusion takes run there, e.g. q/k/v + rope).
        assert by_op["linear"] and set(by_op["linear"]) == {"gemv"}, by_op
        if not tuning.fuse:
            assert len(by_op["linear"]) == 8, by_op  # q, k, v, o, gate, up, down, lm head: one gemv each
