"""Prefill attention on subgroup matrices (shaders/attention_sgmat.wgsl, its entries written per
head-dim pair by shaders/attn_sgmat.py; core/webgpu/ops_attention.py ``_sdpa_sgmat``) under
precision="fast".

- Lowering (pure Python): which sdpa dispatches take an attn_sgmat entry (fast, a device with the
  subgroup-matrix config, float32, <= 128 keys, head dims 16 or 32, q, k, v in 16-byte words,
  the entry's workgroup memory and 256 invocations) and which keep attn_tile; the grid, and
  MROWS for a mask that varies along the query rows.
- The generated WGSL (pure Python): one entry per head-dim pair, its workgroup arrays as large as
  the table says, every matrix load and store a literal offset and stride inside one inner array.
- Tint on any Dawn adapter with shader-f16 and subgroups (CI: Mesa 25's lavapipe, which has no
  subgroup matrices): the module with the matrix types and builtins replaced by stand-ins of
  the same shapes compiles, so its syntax, types, barriers' and subgroup operations' uniformity
  are checked without the GPU; the real builtins run only on the GPU machine (below).
- Conformance against float64 numpy on an adapter with the feature (the GPU machine; elsewhere
  skipped with "no subgroup-matrix adapter"): partial row blocks and key chunks, a bool padding
  mask, a per-row float mask with a scale, causal with grouped heads, rows with every key dropped
  (a keep-mask's dead rows, a causal bound before key 0: zeros), two row blocks over all 128
  keys, prime batch and head counts. Tolerance: q and k rounded to float16 move a score by at
  most d_i = scale 2^-10 max_j sum_d |q_id| |k_jd| (+ float32 sums), which moves each probability
  by a factor within exp(+-2 d_i); the probabilities and v rounded to float16 add 2^-11 each, so
  |out_i - out64_i| <= (exp(2 d_i) - 1 + 2^-10 + Tk 2^-22) (P64 |v|)_i + 2^-24 sum_j |v_j| + 1e-6
  (the last two: float16's subnormal floor, float32's own rounding).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from gpudelegate import shaders
from gpudelegate.plan.types import BufferRef, DeviceLimits, Dispatch, TensorRef
from gpudelegate.shaders import attn_sgmat as gen
from gpudelegate.webgpu import lowering

from conformance.cases import Case, Leaf, Op, build_program, make_data
from test_sgmat import SG_CONFIGS, SG_FEATURES, sgmat_env  # noqa: F401  (the fixture: one Dawn with the feature)

NVIDIA = DeviceLimits(name="nvidia", max_workgroup_storage=48 * 1024, max_workgroup_invocations=1024)
ENTRIES = {s.name for s in gen.SHAPES}


# ------------------------------------------------------------------------------------ lowering

def _t(v, shape, index, dtype="float32", offset=0):
    from gpudelegate import dtypes

    return TensorRef(v, dtype, tuple(shape), BufferRef("arena", index, offset, dtypes.nbytes(dtype, shape)))


def _sdpa(b=2, h=3, tq=40, tk=40, d=32, dv=32, dtype="float32", mask=None, q_offset=0):
    args = [_t(0, (b, h, tq, d), 0, dtype, q_offset), _t(1, (b, h, tk, d), 1, dtype), _t(2, (b, h, tk, dv), 2, dtype)]
    if mask is not None:
        args.append(_t(4, mask, 4, "bool"))
    return Dispatch(0, "sdpa", {}, args, [_t(3, (b, h, tq, dv), 3, dtype)])


ANY = lowering.Tuning(attn_sgmat_min_groups=1)  # the small dispatches below take it too


def _calls(d, precision="fast", limits=NVIDIA, configs=SG_CONFIGS, tuning=ANY):
    return lowering.select(d, limits, SG_FEATURES, tuning, precision, configs)


@pytest.mark.parametrize("d,dv", [(32, 32), (16, 16), (16, 32), (32, 16)])
def test_fast_prefill_attention_runs_on_subgroup_matrices(d, dv):
    for tq in (40, 128, 300):
        (c,) = _calls(_sdpa(tq=tq, d=d, dv=dv))
        assert c.entry == f"attn_sgmat_d{d}v{dv}"
        assert c.workgroups == (-(-tq // gen.ROWS), 3, 2)
        assert c.constants["MASK"] == 0 and c.constants["MROWS"] is False
    # MiniLM's padding mask [B, 1, 1, Tk] is one value per key; a [B, 1, Tq, Tk] mask one per row
    (c,) = _calls(_sdpa(mask=(2, 1, 1, 40)))
    assert (c.constants["MASK"], c.constants["MROWS"]) == (1, False)
    (c,) = _calls(_sdpa(mask=(2, 1, 40, 40)))
    assert (c.constants["MASK"], c.constants["MROWS"]) == (1, True)
    (c,) = _calls(_sdpa(tk=128))
    assert c.entry == "attn_sgmat_d32v32"


@pytest.mark.parametrize("why,d,kw", [
    ("exact", _sdpa(), {"precision": "exact"}),
    ("no config", _sdpa(), {"configs": ()}),
    ("switched off", _sdpa(), {"tuning": lowering.Tuning(attn_sgmat=False, attn_sgmat_min_groups=1)}),
    ("fewer workgroups than Tuning.attn_sgmat_min_groups", _sdpa(b=1, h=12, tq=128), {"tuning": lowering.Tuning()}),
    ("more than 128 keys", _sdpa(tk=129), {}),
    ("head dim 64", _sdpa(d=64, dv=64), {}),
    ("head dim 8", _sdpa(d=8, dv=8), {}),
    ("float16 operands", _sdpa(dtype="float16"), {}),
    ("q off a 16-byte word", _sdpa(q_offset=4), {}),
    ("32 KiB of workgroup memory", _sdpa(), {"limits": DeviceLimits(name="small", max_workgroup_storage=32 * 1024)}),
    ("128 invocations", _sdpa(), {"limits": DeviceLimits(name="narrow", max_workgroup_storage=48 * 1024,
                                                         max_workgroup_invocations=128)}),
])
def test_attention_left_to_attn_tile_or_the_composite(why, d, kw):
    entries = [c.entry for c in _calls(d, **kw)]
    assert not ENTRIES & set(entries), why


def test_enough_workgroups_by_default():
    # MiniLM 32x128: 384 workgroups; 4x128: 48, the fewest measured faster than attn_tile
    for b in (32, 4):
        (c,) = _calls(_sdpa(b=b, h=12, tq=128, tk=128), tuning=lowering.Tuning())
        assert c.entry == "attn_sgmat_d32v32" and c.workgroups == (1, 12, b)


def test_the_smaller_entries_fit_where_the_largest_does_not():
    # 40 KiB: head dims of 16 fit, 32 do not
    lim = DeviceLimits(name="40k", max_workgroup_storage=40 * 1024, max_workgroup_invocations=1024)
    assert [c.entry for c in _calls(_sdpa(d=16, dv=16), limits=lim)] == ["attn_sgmat_d16v16"]
    assert not ENTRIES & {c.entry for c in _calls(_sdpa(), limits=lim)}
    assert max(s.workgroup_bytes() for s in gen.SHAPES) <= 48 * 1024  # what NVIDIA's adapters offer


# ------------------------------------------------------------------------------------ generated WGSL

def test_every_shape_is_one_entry_point_with_the_memory_the_table_says():
    src = shaders.source("attention_sgmat.wgsl")
    assert src.count(gen.BEGIN) == 1 and src.count(gen.END) == 1 and "\n//! generate" not in src
    for s in gen.SHAPES:
        assert f"@compute @workgroup_size({gen.THREADS})\nfn {s.name}(" in src
        decl = re.findall(r"var<workgroup> t[KVSP]_" + s.name + r": array<array<(f16|f32), (\d+)u>, (\d+)u>;", src)
        assert len(decl) == 4, decl
        assert sum({"f16": 2, "f32": 4}[e] * int(i) * int(o) for e, i, o in decl) == s.workgroup_bytes(), s.name


def test_every_matrix_access_is_a_constant_in_bounds_range_of_an_inner_array():
    # Dawn's robustness transform leaves a subgroupMatrixLoad/Store unpredicated only where the
    # array's length, the offset and the stride are constants and the matrix lies inside
    for s in gen.SHAPES:
        text = gen.entry(s)
        sizes = {m[0]: int(m[1]) for m in re.findall(r"var<workgroup> (t[KVSP]_\w+): array<array<f\d+, (\d+)u>", text)}
        calls = re.findall(r"subgroupMatrix(?:Load<[^>]+>, \w+>|Store<\w+>)\(&(\w+)\[\w+\], ([^,]+),(?: \w+,)? ([^)]+)\)",
                           text)
        assert len(calls) == text.count("subgroupMatrixLoad") + text.count("subgroupMatrixStore") > 0, s.name
        for arr, off, stride in calls:
            assert re.fullmatch(r"\d+u", off) and re.fullmatch(r"\d+u", stride), (s.name, arr, off, stride)
            assert int(off[:-1]) + int(stride[:-1]) * 15 + 16 <= sizes[arr], (s.name, arr, off, stride)


def test_the_key_biases_lie_where_no_matrix_store_writes():
    # key j's bias: tile j // KB_PER_TILE, at a column of its row past the 32 the result matrices fill
    seen = set()
    for j in range(gen.KEYS):
        tile, at = j // gen.KB_PER_TILE, eval(gen._kb_at(str(j)).replace("u", "").replace("/", "//"))
        assert tile < gen.SUBGROUPS and at % gen.SS >= gen.CHUNK and at < gen.MAT * gen.SS, (j, tile, at)
        seen.add((tile, at))
    assert len(seen) == gen.KEYS


def test_only_the_written_head_dims():
    assert gen.shape_for(32, 32).name == "attn_sgmat_d32v32" and gen.shape_for(64, 64) is None
    with pytest.raises(ValueError, match="head dims"):
        gen.entry(gen.Shape(4, 2))


def _stand_ins(src: str) -> str:
    """``src`` with the subgroup-matrix types and builtins replaced by small structs and functions
    of the same argument shapes (a stand-in reads one element where the builtin reads a matrix),
    and its tiles' outer sizes cut to 2 (lavapipe offers 32 KiB of workgroup memory): what Tint
    checks then is everything else as written."""
    src = src.replace("enable chromium_experimental_subgroup_matrix;", "")
    src = src.replace("diagnostic(off, chromium.subgroup_matrix_uniformity);", "")
    src = src.replace("enable subgroups;", "enable subgroups;\nstruct SMR { x: f32 }\nstruct SMA { x: f16, s: u32 }\n"
                      "fn mma(a: SMA, b: SMA, c: SMR) -> SMR { return SMR(c.x + f32(a.x) * f32(b.x)); }", 1)
    src = src.replace("subgroup_matrix_result<f32, 16, 16>()", "SMR(0.0)")
    src = re.sub(r"subgroupMatrixLoad<subgroup_matrix_(?:left|right)<f16, 16, 16>, \w+>\(&(\w+\[\w+\]), ([^,]+), ([^)]+)\)",
                 r"SMA(\1[\2], \3)", src)
    src = re.sub(r"subgroupMatrixStore<row_major>\(&(\w+\[\w+\]), ([^,]+), (\w+), ([^)]+)\)", r"\1[\2] = \3.x + f32(\4)", src)
    src = src.replace("subgroupMatrixMultiplyAccumulate(", "mma(")
    assert not re.search(r"subgroup_?[mM]atrix", src)
    return re.sub(r"(var<workgroup> \w+: array<array<f\d+, \d+u>, )\d+u>", r"\g<1>2u>", src)


@pytest.mark.dawn
def test_tint_compiles_the_rest_of_the_kernel(dawn_env):
    ctx = dawn_env.context("dawn")
    if not {"shader-f16", "subgroups"} <= ctx.features:
        pytest.skip(f"Dawn adapter without shader-f16 and subgroups ({sorted(ctx.features)})")
    dev = ctx.device
    module = dev.create_shader_module(code=_stand_ins(shaders.source("attention_sgmat.wgsl")))
    for s in gen.SHAPES:
        for consts in ({}, {"MASK": 1, "DTM": 3, "MROWS": True, "CAUSAL": True}, {"MASK": 2, "DTM": 1}):
            dev.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": s.name,
                                                                "constants": consts})


# ------------------------------------------------------------------------------------ conformance

def _case(cid, qs, ks, dv, mask=None, rows=False, **attrs):
    """sdpa of q [qs], k [ks], v [ks[:3] + (dv,)]; ``mask`` (shape, dtype, generator); ``rows``:
    the mask and-ed with a constant per query row that kills some rows whole."""
    leaves = [Leaf("q", "float", qs), Leaf("k", "float", ks), Leaf("v", "float", ks[:3] + (dv,))]
    args = ["q", "k", "v"]
    ops = []
    if mask is not None:
        leaves.append(Leaf("keep" if rows else "mask", mask[1], mask[0], mask[2]))
        args.append("mask")
    if rows:
        leaves.append(Leaf("rows", "bool", (qs[0], 1, qs[2], 1), "bool", kind="const"))
        ops.append(Op("logical_and", ["keep", "rows"], out="mask"))
    ops.append(Op("sdpa", args, attrs, out="y"))
    return Case(f"attn_sgmat/{cid}", leaves, ops, ["y"], red=ks[2])


CASES = [
    # MiniLM's layout in small: 32-dim heads, a bool padding mask per key, partial row block and chunk
    _case("bool_mask", (2, 3, 37, 32), (2, 3, 37, 32), 32, ((2, 1, 1, 37), "bool", "keep")),
    # MiniLM's shape with prime batch and head counts
    _case("minilm_prime", (3, 5, 128, 32), (3, 5, 128, 32), 32, ((3, 1, 1, 128), "bool", "keep")),
    _case("causal_gqa", (1, 4, 21, 16), (1, 2, 21, 16), 16, causal=True),
    _case("float_mask_rows_dv16", (2, 2, 19, 32), (2, 2, 23, 32), 16, ((2, 1, 19, 23), "float", "normal"), scale=0.3),
    # two row blocks over all 128 keys
    _case("all_keys", (1, 2, 133, 16), (1, 2, 128, 16), 32),
    # rows with every key dropped: zeros
    _case("dead_rows", (3, 5, 19, 32), (3, 5, 23, 32), 32, ((3, 1, 19, 23), "bool", "keep"), rows=True),
    _case("causal_dead_rows", (1, 2, 19, 32), (1, 2, 19, 32), 32, causal=True, causal_offset=-3),
]


def _bound_check(case, data, got):
    q, k, v = (data[n].astype(np.float64) for n in ("q", "k", "v"))
    attrs = case.ops[-1].attrs
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scale = attrs.get("scale", 1.0 / np.sqrt(q.shape[-1]))
    s = scale * q @ np.swapaxes(k, -1, -2)
    keep = np.ones(s.shape, bool)
    mask = data["keep"] & data["rows"] if "rows" in data else data.get("mask")
    if mask is not None:
        if mask.dtype == bool:
            keep = keep & np.broadcast_to(mask, s.shape)
        else:
            s = s + mask.astype(np.float64)
    if attrs.get("causal"):
        i, j = np.indices(s.shape[-2:])
        keep = keep & (j <= i + attrs.get("causal_offset", 0))
    s = np.where(keep, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    e = np.where(keep, np.exp(s - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
    tot = e.sum(-1, keepdims=True)
    p = np.where(tot > 0, e / np.where(tot > 0, tot, 1.0), 0.0)
    ref = p @ v
    dq = scale * (2.0 ** -10 + q.shape[-1] * 2.0 ** -22) * (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2)).max(-1, keepdims=True)
    bound = (np.expm1(2 * dq) + 2.0 ** -10 + k.shape[2] * 2.0 ** -22) * (p @ np.abs(v)) \
        + 2.0 ** -24 * np.abs(v).sum(-2, keepdims=True) + 1e-6
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    dead = ~keep.any(-1)
    if "dead" in case.id:  # the case reaches the rule: some rows dead, some alive
        assert dead.any() and not dead.all(), case.id
    assert np.all(got[np.broadcast_to(dead[..., None], got.shape)] == 0.0), f"{case.id}: dead rows not zeros"
    err = np.abs(got - ref)
    assert np.all(err <= bound), f"{case.id}: max error {err.max():.3g}, worst error/bound {(err / bound).max():.3f}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_attn_sgmat_on_the_gpu(sgmat_env, case):
    import gpudelegate

    data = make_data(case)
    prog, names = build_program(case, data)
    with sgmat_env.session(gpudelegate.loads(prog.to_bytes()), device="dawn", precision="fast", tuning=ANY) as s:
        out = s.run("forward", [data[n] for n in names])[0]
        entries = {L.pipeline.label.split(":")[-1].strip() for n in s.executor.recorded[0].nodes for L in n.launches}
    assert ENTRIES & entries, entries
    _bound_check(case, data, out)
