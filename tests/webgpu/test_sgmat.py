"""Subgroup-matrix (tensor-core) products and the session's ``precision`` (core/webgpu/ops_sgmat.py,
shaders/matmul_sgmat.wgsl and the generator of its entry points, shaders/matmul_sgmat.py).

- Lowering (pure Python, no device): which products ops_sgmat takes (a device with the feature
  and its f16 -> f32 16x16x16 config; precision="fast", or both operands float16) and which it
  leaves to the float kernels (no config, exact float32, K or rows not in quads of 4, gemv-sized
  M); which entry and stages it picks (by operand dtype, or as Tuning says) within the device's
  workgroup memory (DeviceLimits.max_workgroup_storage: fallbacks, the float kernels where
  nothing fits, a ValueError for a Tuning that does not fit).
- The generated WGSL (pure Python): one entry point per shape of the table, its workgroup
  arrays as large as the table says, the shared code written once, every matrix load and store
  a literal offset and stride inside one inner array (what lets Dawn's robustness transform
  leave it unpredicated).
- ``precision`` on every session: a bad value is an InputError; the reference computes exactly.
- Conformance against float64 numpy with the bound of float16 inputs and float32 accumulation,
  |C - C64| <= (2^-10 + K 2^-22) (|A| @ |B|) + 1e-6 (each input rounded to float16 moves a
  product term by at most 2^-10 of |a||b|; K float32 additions add K 2^-23 of it, doubled for
  the tensor cores' accumulation order): precision="fast" on wgpu (software Vulkan: the plain
  float32 kernels, no subgroup matrices there), and on Dawn where the adapter has the feature
  (the GPU machine; elsewhere skipped with "no subgroup-matrix adapter"). Prime and odd shapes
  (partial 128x128 tiles and 16x16 matrices in M and N, K = 4 x prime), K = 0, an empty product,
  batched products (attention's bmm), bias and a fused gelu epilogue, whole aligned tiles. Every
  entry point with one and (where the adapter's workgroup memory allows) two shared stages, on
  the GPU machine.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from gpudelegate.errors import InputError
from gpudelegate.environment import Environment
from gpudelegate.plan.types import BufferRef, DeviceLimits, Dispatch, TensorRef
from gpudelegate.shaders import matmul_sgmat as gen
from gpudelegate.webgpu import lowering, ops_sgmat

from conformance.cases import Case, Leaf, Op, build_program, make_data
from conformance.executors import probe_device

SG_FEATURES = ("shader-f16", "subgroups", "chromium-experimental-subgroup-matrix")
SG_CONFIGS = ({"component": "f16", "result": "f32", "M": 16, "N": 16, "K": 16},)
DAWN_TOGGLES = ["allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"]
LIM = DeviceLimits(name="test", max_workgroup_storage=48 * 1024, max_workgroup_invocations=1024)  # what NVIDIA's adapters offer


# ------------------------------------------------------------------------------------ lowering

def _ref(v, dtype, shape, index=0):
    from gpudelegate import dtypes

    return TensorRef(v, dtype, tuple(shape), BufferRef("arena", index, 0, dtypes.nbytes(dtype, shape)))


def _linear(m, n, k, dx="float32", dw="float32"):
    return Dispatch(0, "linear", {}, [_ref(0, dx, (m, k)), _ref(1, dw, (n, k), 1)], [_ref(2, "float32", (m, n), 2)])


def _entries(d, precision="fast", features=SG_FEATURES, configs=SG_CONFIGS, tuning=None, limits=LIM):
    return [c.entry for c in lowering.select(d, limits, features, tuning, precision, configs)]


def _calls(d, precision="fast", tuning=None, limits=LIM):
    return lowering.select(d, limits, SG_FEATURES, tuning, precision, SG_CONFIGS)


def test_fast_float32_linear_runs_on_subgroup_matrices():
    (c,) = _calls(_linear(2048, 772, 68))
    assert (c.entry, c.constants["STAGES"]) == ops_sgmat.DEFAULT_F32
    assert c.constants["DTA"] == 0 and c.constants["DTB"] == 0 and c.constants["B_KMAJOR"] is True
    bm, bn = ops_sgmat.tile_of(c.entry)
    assert c.workgroups == (-(-772 // bn), 2048 // bm, 1)
    for e in sorted(ops_sgmat.ENTRY_POINTS):  # N in sixteens: the direct entries take it too
        (c,) = _calls(_linear(2048, 768, 68), tuning=lowering.Tuning(sgmat_entry=e, sgmat_min_groups=1))
        assert (c.entry, c.constants["STAGES"]) == (e, 1)


def test_float16_operands_take_the_float16_default():
    # any float16 operand: the entry and stages that ran fastest with float16 staging
    for dx, dw in (("float16", "float16"), ("float32", "float16")):
        (c,) = _calls(_linear(2048, 772, 72, dx, dw))
        assert (c.entry, c.constants["STAGES"]) == ops_sgmat.DEFAULT_F16
        assert (c.constants["DTA"], c.constants["DTB"]) == (int(dx == "float16"), 1)


def test_float16_rows_not_in_eights_take_a_quad_entry():
    # the default stages float16 operands in 16-byte octets: K = 68 (quads, not octets) goes to the
    # first fallback that loads quads, for either operand; float32 operands need quads only
    assert gen.SHAPES[[s.name for s in gen.SHAPES].index(ops_sgmat.DEFAULT_F16[0])].align(True) == 8
    for dx, dw in (("float16", "float16"), ("float32", "float16"), ("float16", "float32")):
        (c,) = _calls(_linear(2048, 772, 68, dx, dw))
        assert (c.entry, c.constants["STAGES"]) == ops_sgmat.FALLBACK[0], (dx, dw)
        assert ops_sgmat.SHAPES[c.entry].align(True) == 4
    (c,) = _calls(_linear(2048, 772, 68))
    assert (c.entry, c.constants["STAGES"]) == ops_sgmat.DEFAULT_F32
    # a forced entry that does not admit the layout leaves the product to the float kernels
    assert not set(ops_sgmat.ENTRY_POINTS) & set(_entries(_linear(2048, 772, 68, "float16", "float16"),
                                                            tuning=lowering.Tuning(sgmat_entry="mm_sgmat8kv")))


def test_large_products_take_the_large_tile():
    # at least LARGE_GROUPS workgroups of LARGE's tile: LARGE for either operand dtype; MiniLM's
    # 4096-row products (192 of them at most) keep the defaults
    for dx, default in (("float16", ops_sgmat.DEFAULT_F16), ("float32", ops_sgmat.DEFAULT_F32)):
        (c,) = _calls(_linear(4096, 4096, 4096, dx, dx))
        assert (c.entry, c.constants["STAGES"]) == ops_sgmat.LARGE
        gx, gy, gz = c.workgroups
        assert gx * gy * gz == ops_sgmat.groups(c.entry, _Dims(4096, 4096)) >= ops_sgmat.LARGE_GROUPS
        (c,) = _calls(_linear(4096, 1536, 384, dx, dx))
        assert (c.entry, c.constants["STAGES"]) == (ops_sgmat.DIRECT[default[0]], default[1])
    # where LARGE does not fit the workgroup memory: the default chain
    small = DeviceLimits(name="small", max_workgroup_storage=32 * 1024)
    assert ops_sgmat.stage_bytes(*ops_sgmat.LARGE) > 32 * 1024
    (c,) = _calls(_linear(4096, 4096, 4096), limits=small)
    assert c.entry != ops_sgmat.LARGE[0]
    # where the device allows fewer invocations per workgroup than LARGE's 512 (WebGPU's default
    # 256): the default, and forcing LARGE says why it cannot run
    assert ops_sgmat.SHAPES[ops_sgmat.LARGE[0]].threads == 512
    narrow = DeviceLimits(name="narrow", max_workgroup_storage=48 * 1024, max_workgroup_invocations=256)
    (c,) = _calls(_linear(4096, 4096, 4096), limits=narrow)
    assert (c.entry, c.constants["STAGES"]) == (ops_sgmat.DIRECT[ops_sgmat.DEFAULT_F32[0]], ops_sgmat.DEFAULT_F32[1])
    with pytest.raises(ValueError, match="512 invocations per workgroup, the device allows 256"):
        _calls(_linear(4096, 4096, 4096), limits=narrow, tuning=lowering.Tuning(sgmat_entry=ops_sgmat.LARGE[0]))


class _Dims:
    def __init__(self, m, n):
        self.M, self.N = m, n


def test_direct_twin_where_c_allows_it():
    # float32 C in whole 16x16 matrices (M, N in sixteens), alpha 1, a bias per column: the
    # default's direct twin (epilogue in the result matrices); anything else the default itself
    for d in (_linear(2048, 768, 72), _linear(2048, 768, 72, "float16", "float16"), _bias_linear(2048, 768, 72)):
        (c,) = _calls(d)
        assert c.entry == ops_sgmat.DIRECT[ops_sgmat.DEFAULT_F32[0]] and ops_sgmat.SHAPES[c.entry].direct, d
        assert "direct" in c.label
        # Dawn wants a whole matrix (1 KiB) in every binding the entry loads or stores as matrices
        assert all(b.buf.nbytes >= 1024 for b in c.bindings if b.binding in (1,) + ops_sgmat.MATRIX_SLOTS), c.bindings
    for why, d in (("N not in sixteens", _linear(2048, 772, 72)), ("M not in sixteens", _linear(2044, 768, 72))):
        (c,) = _calls(d)
        assert c.entry == ops_sgmat.DEFAULT_F32[0], why
    assert ops_sgmat.direct_ok(_product())
    for why, kw in (("float16 C", {"c": _dt("float16")}), ("float16 sibling", {"outs": (_dt("float16"),)}),
                    ("alpha", {"alpha": 0.5}), ("strided C", {"c_sn": 2}), ("bias per row", {"bias_mode": 2}),
                    ("N", {"N": 40}), ("M", {"M": 20})):
        assert not ops_sgmat.direct_ok(_product(**kw)), why
    # a forced direct entry that the product does not admit leaves it to the float kernels
    assert not set(ops_sgmat.ENTRY_POINTS) & set(_entries(_linear(2048, 772, 72),
                                                            tuning=lowering.Tuning(sgmat_entry="mm_sgmat8kvd")))


def _dt(dtype):
    return SimpleNamespace(dtype=dtype)


def _product(**kw):
    """What ops_sgmat.direct_ok reads of a product: a direct-able one, changed by ``kw``."""
    return SimpleNamespace(**dict(dict(c=_dt("float32"), outs=(), c_sn=1, M=32, N=48, alpha=1.0, bias=_dt("float32"),
                                       bias_mode=1), **kw))


def _bias_linear(m, n, k):
    return Dispatch(0, "linear", {}, [_ref(0, "float32", (m, k)), _ref(1, "float32", (n, k), 1),
                                      _ref(3, "float32", (n,), 3)], [_ref(2, "float32", (m, n), 2)])


def test_tuning_picks_entry_and_stages():
    (c,) = _calls(_linear(2048, 772, 68), tuning=lowering.Tuning(sgmat_entry="mm_sgmat8", sgmat_stages=2))
    assert (c.entry, c.constants["STAGES"]) == ("mm_sgmat8", 2)
    (c,) = _calls(_linear(2048, 772, 72, "float16", "float16"), tuning=lowering.Tuning(sgmat_stages=1))
    assert (c.entry, c.constants["STAGES"]) == (ops_sgmat.DEFAULT_F16[0], 1)
    (c,) = _calls(_linear(2048, 772, 72, "float16", "float16"),
                  tuning=lowering.Tuning(sgmat_entry="mm_sgmat", sgmat_stages=2))
    assert (c.entry, c.constants["STAGES"]) == ("mm_sgmat", 2)
    with pytest.raises(ValueError, match="sgmat_stages"):
        _calls(_linear(2048, 772, 68), tuning=lowering.Tuning(sgmat_stages=3))


def test_defaults_fit_the_workgroup_memory_of_the_adapters_that_have_the_config():
    # NVIDIA's adapters (the ones with the f16 -> f32 16x16x16 config) offer 48 KiB
    for entry, stages in (ops_sgmat.DEFAULT_F16, ops_sgmat.DEFAULT_F32):
        assert ops_sgmat.stage_bytes(entry, stages) <= 48 * 1024, (entry, stages)
    assert min(ops_sgmat.ENTRY_POINTS.values()) <= 32 * 1024  # one entry for any Dawn adapter


@pytest.mark.parametrize("room", [32 * 1024, 28 * 1024, 24 * 1024, 20 * 1024])
def test_choice_fits_the_device_workgroup_memory(room):
    # less workgroup memory than a default needs: the first fallback that fits
    lim = DeviceLimits(name="small", max_workgroup_storage=room)
    for dx, default in (("float16", ops_sgmat.DEFAULT_F16), ("float32", ops_sgmat.DEFAULT_F32)):
        (c,) = _calls(_linear(2048, 772, 72, dx, dx), limits=lim)
        got = (c.entry, c.constants["STAGES"])
        assert ops_sgmat.stage_bytes(*got) <= room, (dx, got)
        want = next(e for e in (default,) + ops_sgmat.FALLBACK if ops_sgmat.stage_bytes(*e) <= room)
        assert got == want, (dx, room, got)
    # the last fallback is the entry that needs least memory
    assert ops_sgmat.FALLBACK[-1] == (min(ops_sgmat.ENTRY_POINTS, key=ops_sgmat.ENTRY_POINTS.get), 1)


def test_no_entry_fits_then_the_float_kernels_run():
    lim = DeviceLimits(name="webgpu default", max_workgroup_storage=16384)
    assert not set(ops_sgmat.ENTRY_POINTS) & set(_entries(_linear(2048, 772, 68), limits=lim))
    assert not set(ops_sgmat.ENTRY_POINTS) & set(_entries(_linear(2048, 772, 68, "float16", "float16"),
                                                            precision="exact", limits=lim))


def test_tuning_that_does_not_fit_is_refused():
    for tuning in (lowering.Tuning(sgmat_entry="mm_sgmat8k", sgmat_stages=2), lowering.Tuning(sgmat_stages=2)):
        with pytest.raises(ValueError, match="bytes of workgroup memory"):
            _calls(_linear(2048, 772, 68), tuning=tuning)  # float32 default mm_sgmat8kv: 80 KiB with two


def test_float16_operands_use_subgroup_matrices_even_when_exact():
    # rounding float16 values to float16 loses nothing: exact sessions take the tensor cores too
    assert _entries(_linear(2048, 772, 72, "float16", "float16"), precision="exact") == [ops_sgmat.DEFAULT_F16[0]]
    # a float16 weight with float32 activations would round the activations: only when fast
    assert not set(ops_sgmat.ENTRY_POINTS) & set(_entries(_linear(2048, 772, 68, "float32", "float16"),
                                                            precision="exact"))
    assert _entries(_linear(2048, 772, 72, "float32", "float16")) == [ops_sgmat.DEFAULT_F16[0]]


@pytest.mark.parametrize("why,d,kw", [
    ("exact float32", _linear(2048, 772, 68), {"precision": "exact"}),
    ("no config", _linear(2048, 772, 68), {"configs": ()}),
    ("an f16 -> f16 config only", _linear(2048, 772, 68), {"configs": (dict(SG_CONFIGS[0], result="f16"),)}),
    ("no subgroups feature", _linear(2048, 772, 68), {"features": SG_FEATURES[::2]}),
    ("K not in quads", _linear(2048, 772, 66), {}),
    ("gemv-sized M", _linear(3, 772, 68), {}),
    ("switched off", _linear(2048, 772, 68), {"tuning": lowering.Tuning(sgmat=False)}),
    ("too few workgroups", _linear(128, 384, 384), {}),
])
def test_products_left_to_the_float_kernels(why, d, kw):
    assert not set(ops_sgmat.ENTRY_POINTS) & set(_entries(d, **kw)), why


def test_unknown_entry_is_refused():
    with pytest.raises(ValueError, match="sgmat_entry"):
        _entries(_linear(2048, 772, 68), tuning=lowering.Tuning(sgmat_entry="mm_sgmat16"))


# ------------------------------------------------------------------------------------ generated WGSL

def test_every_shape_is_one_entry_point_with_the_memory_the_table_says():
    from gpudelegate import shaders
    from gpudelegate.shaders import matmul_sgmat as gen

    src = shaders.source(ops_sgmat.SHADER)
    assert src.count(gen.BEGIN) == 1 and src.count(gen.END) == 1 and "\n//! generate" not in src
    for s in gen.SHAPES:
        assert len(re.findall(r"@compute @workgroup_size\((\d+)\)\nfn " + s.name + r"\(", src)) == 1, s.name
        assert f"@workgroup_size({s.threads})\nfn {s.name}(" in src
        decl = dict(re.findall(r"var<workgroup> (t[ABC]_" + s.name + r"): (array<[^;]+>);", src))
        assert len(decl) == 3, decl
        for stages in (1, 2):
            total = 0
            for ty in decl.values():
                elem, inner, outer = re.fullmatch(r"array<array<(f16|f32), (\d+)u>, (.+)u>", ty).groups()
                total += {"f16": 2, "f32": 4}[elem] * int(inner) * eval(outer.replace("u", ""), {"STAGES": stages})
            assert total == s.workgroup_bytes(stages) == ops_sgmat.stage_bytes(s.name, stages), (s.name, stages)


def _end(offset, stride, major=16, elems=16):
    """One past the last element a 16x16 matrix load or store at ``offset`` with ``stride`` reads."""
    return offset + stride * (major - 1) + elems


def test_every_matrix_access_is_a_constant_in_bounds_range_of_an_inner_array():
    # Dawn's robustness transform leaves a subgroupMatrixLoad/Store unpredicated only where the
    # array's length, the offset and the stride are constants and the matrix lies inside: every
    # access of every entry is a literal offset and stride into one inner array of its tile.
    from gpudelegate.shaders import matmul_sgmat as gen

    shapes = list(gen.SHAPES) + [gen.Shape("t_wide", 4, 2, 4, 4, 32), gen.Shape("t_nk", 2, 4, 1, 2, 64),
                                 gen.Shape("t_direct", 4, 2, 2, 4, 16, direct=True)]
    for s in shapes:
        text = gen.entry(s)
        sizes = {m[0]: int(m[1]) for m in re.findall(r"var<workgroup> (t[ABC]_\w+): array<array<f\d+, (\d+)u>", text)}
        calls = re.findall(r"subgroupMatrix(?:Load<[^>]+>, \w+>|Store<\w+>)\(&(\w+)\[\w+\], ([^,]+),(?: \w+,)? ([^)]+)\)",
                           text)
        # a direct entry also loads R and stores C as matrices in storage, once per result
        # matrix, outside the K loop (predicated there by arrayLength: cheap at that count)
        storage = re.findall(r"subgroupMatrix(?:Load<[^>]+>, \w+>|Store<\w+>)\(&(R|CF\d?), ", text)
        assert len(storage) == (s.fm * s.fn * 4 if s.direct else 0), (s.name, len(storage))
        assert len(calls) + len(storage) == text.count("subgroupMatrixLoad") + text.count("subgroupMatrixStore") > 0, s.name
        for arr, off, stride in calls:
            assert re.fullmatch(r"\d+u", off) and re.fullmatch(r"\d+u", stride), (s.name, arr, off, stride)
            assert _end(int(off[:-1]), int(stride[:-1])) <= sizes[arr], (s.name, arr, off, stride)


def test_shared_code_is_written_once():
    # the generated part holds only per-shape code: every function the entries share is in the file
    from gpudelegate import shaders
    from gpudelegate.shaders import matmul_sgmat as gen

    generated = gen.entry_points()
    for fn in ("load_a", "load_b", "halves", "result", "write_pair", "put_word", "gelu1"):
        assert f"fn {fn}(" not in generated and shaders.source(ops_sgmat.SHADER).count(f"fn {fn}(") == 1, fn
    other = gen.Shape("t_other", 1, 2, 1, 2, 32)
    text = gen.with_shapes(shaders.source(ops_sgmat.SHADER), [other])
    assert "fn t_other(" in text and not any(f"fn {s.name}(" in text for s in gen.SHAPES)
    with pytest.raises(ValueError, match="K step"):
        gen.entry(gen.Shape("bad", 2, 2, 2, 2, 24))
    with pytest.raises(ValueError, match="no generator"):
        shaders._generated("matmul_other")


# ------------------------------------------------------------------------------------ precision option

LINEAR = Case("sgmat/linear", [Leaf("x", "float", (37, 20)), Leaf("w", "float", (12, 20), kind="prepack"),
                               Leaf("b", "float", (12,), kind="prepack")],
              [Op("linear", ["x", "w", "b"], out="y")], ["y"], red=20)


def _program(case):
    import gpudelegate

    data = make_data(case)
    prog, names = build_program(case, data)
    return gpudelegate.loads(prog.to_bytes()), [data[n] for n in names], data


@pytest.mark.parametrize("bad", ["half", "FAST", None, 16])
def test_bad_precision_is_an_input_error(bad):
    prog, _, _ = _program(LINEAR)
    with Environment() as env, pytest.raises(InputError, match="precision must be one of"):
        env.session(prog, device="reference", precision=bad)


def test_reference_computes_exactly_when_fast():
    prog, inputs, _ = _program(LINEAR)
    with Environment() as env:
        with env.session(prog, device="reference", precision="fast") as s:
            fast = s.run("forward", inputs)[0]
        with env.session(prog, device="reference") as s:
            exact = s.run("forward", inputs)[0]
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(exact))


# ------------------------------------------------------------------------------------ conformance

def _case(cid, storage, a_shape, b_shape, linear=False, bias=False, gelu=False, res=False):
    leaves = [Leaf("a", "float", a_shape), Leaf("b", "float", b_shape, kind="prepack" if linear else "input")]
    args = ["a", "b"]
    if bias:
        leaves.append(Leaf("bias", "float", (b_shape[0],), kind="prepack"))
        args.append("bias")
    ops = [Op("linear" if linear else "matmul", args, out="y")]
    out = "y"
    if gelu:
        ops.append(Op("gelu", ["y"], out="g"))
        out = "g"
    if res:  # + r: the executor runs it in the product's epilogue
        leaves.append(Leaf("r", "float", a_shape[:-1] + (b_shape[0],)))
        ops.append(Op("add", ["y", "r"], out="s"))
        out = "s"
    k = a_shape[-1]
    return Case(cid, leaves, ops, [out], storage=storage, red=max(k, 1))


CASES = [
    _case("linear_prime", "float32", (131, 68), (44, 68), linear=True, bias=True),
    _case("linear_gelu", "float32", (257, 36), (132, 36), linear=True, bias=True, gelu=True),
    _case("matmul_n_major", "float32", (131, 68), (68, 116)),
    _case("bmm", "float32", (3, 37, 20), (3, 20, 52)),
    _case("bmm_broadcast", "float32", (2, 1, 40, 28), (3, 28, 24)),
    _case("matmul_f16", "float16", (129, 44), (44, 36)),
    # whole 128x128 tiles; K = 80: a partial last K step of 16 (of 32) or of 16 (of 64)
    _case("linear_aligned", "float32", (259, 80), (264, 80), linear=True, bias=True),
    _case("matmul_aligned", "float32", (256, 96), (96, 512)),
    _case("linear_aligned_gelu", "float32", (256, 64), (384, 64), linear=True, bias=True, gelu=True),
    _case("bmm_aligned", "float32", (2, 256, 64), (2, 64, 256)),
    _case("matmul_f16_aligned", "float16", (256, 96), (96, 256)),
    # float16 rows in eights (the 16-byte-load entries' octets), partial tiles in M and N
    _case("linear_f16_eights", "float16", (131, 72), (52, 72), linear=True),
    # sixteens in M and N (the direct entries): bias, a residual add in the epilogue, partial tiles
    _case("linear_bias16", "float32", (144, 40), (208, 40), linear=True, bias=True),
    _case("linear_residual16", "float32", (272, 48), (144, 48), linear=True, bias=True, res=True),
    _case("k0", "float32", (33, 0), (0, 17)),
    _case("empty", "float32", (0, 16), (16, 20)),
]


def _bound_check(case, data, got):
    """|got - C64| within the float16-input bound, C64 and |A| @ |B| from the program's values."""
    a = data["a"].astype(np.float64)
    b = data["b"].astype(np.float64)
    lin = case.ops[0].op == "linear"
    bt = b.T if lin else b
    ref = a @ bt
    mag = np.abs(a) @ np.abs(bt)
    if "bias" in data:
        ref = ref + data["bias"].astype(np.float64)
    if "r" in data:
        ref = ref + data["r"].astype(np.float64)
    elif len(case.ops) > 1:  # gelu: |gelu'| <= 1.13, so the bound carries over scaled by that
        from math import erf
        ref = 0.5 * ref * (1.0 + np.vectorize(erf)(ref / np.sqrt(2.0)))
        mag = 1.13 * mag
    k = a.shape[-1]
    bound = (2.0 ** -10 + k * 2.0 ** -22) * mag + 1e-6
    if case.storage == "float16":  # float16 outputs add their own rounding
        bound = bound + 2.0 ** -11 * np.abs(ref)
    got = np.asarray(got).astype(np.float64)
    assert got.shape == ref.shape, (case.id, got.shape, ref.shape)
    err = np.abs(got - ref)
    assert np.all(err <= bound), f"{case.id}: max error {err.max():.3g}, worst error/bound {(err / bound).max():.3f}"


def _run_fast(env, device, case, tuning=None):
    prog, inputs, data = _program(case)
    opts = {"tuning": tuning} if tuning is not None else {}
    with env.session(prog, device=device, precision="fast", **opts) as s:
        out = s.run("forward", inputs)[0]
        entries = {L.pipeline.label.split(":")[-1].strip() for n in s.executor.recorded[0].nodes for L in n.launches}
    _bound_check(case, data, out)
    return entries


@pytest.fixture(scope="module")
def wgpu_env():
    ok, reason = probe_device("wgpu")()
    if not ok:
        pytest.skip(reason)
    with Environment() as env:
        yield env


@pytest.mark.wgpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fast_on_wgpu_plain_path(wgpu_env, case):
    # wgpu-native has no subgroup matrices: "fast" runs the float kernels and stays within the bound
    entries = _run_fast(wgpu_env, "wgpu", case)
    assert not set(ops_sgmat.ENTRY_POINTS) & entries, entries


@pytest.fixture(scope="module")
def sgmat_env():
    env = Environment(device_options={"dawn": {"toggles": DAWN_TOGGLES}})
    try:
        ctx = env.context("dawn")
    except Exception as e:  # no wgpudawn, no adapter
        env.close()
        pytest.skip(f"no subgroup-matrix adapter (dawn: {e})")
    if not (ops_sgmat.NEEDED_FEATURES <= ctx.features and ops_sgmat.has_config(ctx.subgroup_matrix_configs)):
        env.close()
        pytest.skip(f"no subgroup-matrix adapter ({ctx.limits.name}: features {sorted(ctx.features)})")
    yield env
    env.close()


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("entry", sorted(ops_sgmat.ENTRY_POINTS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fast_on_subgroup_matrices(sgmat_env, case, entry, stages):
    limit = sgmat_env.context("dawn").device.limits["max-compute-workgroup-storage-size"]
    need = ops_sgmat.stage_bytes(entry, stages)
    if need > limit:
        pytest.skip(f"{entry} with {stages} stages needs {need} bytes of workgroup memory, this adapter has {limit}")
    tuning = lowering.Tuning(sgmat_entry=entry, sgmat_stages=stages, sgmat_min_groups=1)
    entries = _run_fast(sgmat_env, "dawn", case, tuning)
    if not any(s == 0 for s in case.leaves[0].shape + case.leaves[1].shape):
        # an entry that stages float16 octets leaves rows not in eights to the float kernels
        assert (entry in entries) == _admits(entry, case), entries


def _admits(entry, case):
    """Does ``entry`` take the case's product: K, and N of a matmul's B (along n), in its loads;
    for a direct entry also float32 C with M and N in sixteens?"""
    shape = ops_sgmat.SHAPES[entry]
    q = shape.align(case.storage == "float16")
    a, b = case.leaves[0].shape, case.leaves[1].shape
    lin = case.ops[0].op == "linear"
    m, k, n = a[-2], a[-1], b[0] if lin else b[-1]
    if shape.direct and (case.storage != "float32" or m % 16 or n % 16):
        return False
    return k % q == 0 and (lin or n % q == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_default_choice_on_subgroup_matrices(sgmat_env, case):
    entries = _run_fast(sgmat_env, "dawn", case, lowering.Tuning(sgmat_min_groups=1))
    if not any(s == 0 for s in case.leaves[0].shape + case.leaves[1].shape):
        assert set(ops_sgmat.ENTRY_POINTS) & entries, entries
