"""Prefill attention on subgroup matrices (shaders/attention_sgmat.wgsl, core/webgpu/ops_attention.py
``_sdpa_sgmat``) under precision="fast".

- Lowering (pure Python): which sdpa dispatches take attn_sgmat (opt-in: Tuning(attn_sgmat=True);
  fast, a device with the
  subgroup-matrix config, float32, <= 128 keys, head dims 16 or 32, 16-byte rows), with one or two
  subgroups per workgroup by the device's workgroup memory; which keep attn_tile.
- Conformance against float64 numpy on an adapter with the feature (the GPU machine; elsewhere
  skipped with "no subgroup-matrix adapter"): partial row blocks, a bool padding mask, causal with
  grouped heads, a float mask with head dims 32 / 16 and a scale, all 128 keys. Tolerance: q and
  k rounded to float16 move a score by at most d_i = scale 2^-10 max_j sum_d |q_id| |k_jd| (+ float32 sums), which moves each
  probability by a factor within exp(+-2 d_i); the probabilities and v rounded to float16 add
  2^-11 each, so |out_i - out64_i| <= (exp(2 d_i) - 1 + 2^-10 + Tk 2^-22) (P64 |v|)_i
  + 2^-24 sum_j |v_j| + 1e-6 (the last two: float16's subnormal floor, float32's own rounding).
"""

from __future__ import annotations

import numpy as np
import pytest

from gpudelegate.environment import Environment
from gpudelegate.plan.types import BufferRef, DeviceLimits, Dispatch, TensorRef
from gpudelegate.webgpu import lowering, ops_attention

from conformance.cases import Case, Leaf, Op, build_program, make_data

SG_FEATURES = ("shader-f16", "subgroups", "chromium-experimental-subgroup-matrix")
SG_CONFIGS = ({"component": "f16", "result": "f32", "M": 16, "N": 16, "K": 16},)
DAWN_TOGGLES = ["allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"]
NVIDIA = DeviceLimits(name="nvidia", max_workgroup_storage=48 * 1024, max_workgroup_invocations=1024)


# ------------------------------------------------------------------------------------ lowering

def _t(v, shape, index, dtype="float32"):
    from gpudelegate import dtypes

    return TensorRef(v, dtype, tuple(shape), BufferRef("arena", index, 0, dtypes.nbytes(dtype, shape)))


def _sdpa(b=2, h=3, tq=40, tk=40, d=32, dv=32, dtype="float32", mask=False):
    args = [_t(0, (b, h, tq, d), 0, dtype), _t(1, (b, h, tk, d), 1, dtype), _t(2, (b, h, tk, dv), 2, dtype)]
    if mask:
        args.append(_t(4, (b, 1, 1, tk), 4, "bool"))
    return Dispatch(0, "sdpa", {}, args, [_t(3, (b, h, tq, dv), 3, dtype)])


ON = lowering.Tuning(attn_sgmat=True)  # opt-in: slower than attn_tile on an H100 so far


def _calls(d, precision="fast", limits=NVIDIA, configs=SG_CONFIGS, tuning=ON):
    return lowering.select(d, limits, SG_FEATURES, tuning, precision, configs)


def test_fast_prefill_attention_runs_on_subgroup_matrices():
    for kw in ({}, {"d": 16, "dv": 16}, {"tk": 128, "tq": 128}, {"mask": True}, {"d": 16, "dv": 32}):
        (c,) = _calls(_sdpa(**kw))
        assert c.entry == "attn_sgmat", kw
        b, h, tq = 2, 3, kw.get("tq", 40)
        assert c.constants["SGS"] == 2 and c.workgroups == (-(-tq // 32), h, b), kw
        assert (c.constants["DK"], c.constants["DV"]) == (kw.get("d", 32) // 16, kw.get("dv", 32) // 16)
    # 32 KiB of workgroup memory (any Dawn adapter): one subgroup, 16 rows a workgroup
    (c,) = _calls(_sdpa(), limits=DeviceLimits(name="small", max_workgroup_storage=32 * 1024))
    assert (c.entry, c.constants["SGS"], c.workgroups) == ("attn_sgmat", 1, (3, 3, 2))
    assert ops_attention.attn_sgmat_bytes(1) == 32 * 1024 and ops_attention.attn_sgmat_bytes(2) <= 48 * 1024


@pytest.mark.parametrize("why,d,kw", [
    ("exact", _sdpa(), {"precision": "exact"}),
    ("no config", _sdpa(), {"configs": ()}),
    ("not asked for (the default)", _sdpa(), {"tuning": lowering.Tuning()}),
    ("more than 128 keys", _sdpa(tk=129), {}),
    ("head dim 64", _sdpa(d=64, dv=64), {}),
    ("head dim 8", _sdpa(d=8, dv=8), {}),
    ("float16 operands", _sdpa(dtype="float16"), {}),
    ("16 KiB of workgroup memory", _sdpa(), {"limits": DeviceLimits(name="webgpu", max_workgroup_storage=16384)}),
])
def test_attention_left_to_attn_tile_or_the_composite(why, d, kw):
    assert "attn_sgmat" not in [c.entry for c in _calls(d, **kw)], why


# ------------------------------------------------------------------------------------ conformance

def _case(cid, qs, ks, dv, mask=None, **attrs):
    leaves = [Leaf("q", "float", qs), Leaf("k", "float", ks), Leaf("v", "float", ks[:3] + (dv,))]
    args = ["q", "k", "v"]
    if mask is not None:
        leaves.append(Leaf("mask", mask[1], mask[0], mask[2]))
        args.append("mask")
    return Case(f"attn_sgmat/{cid}", leaves, [Op("sdpa", args, attrs, out="y")], ["y"], red=ks[2])


CASES = [
    # MiniLM's shape in small: 32-dim heads, a bool padding mask per key, partial row blocks
    _case("bool_mask", (2, 3, 37, 32), (2, 3, 37, 32), 32, ((2, 1, 1, 37), "bool", "keep")),
    _case("causal_gqa", (1, 4, 21, 16), (1, 2, 21, 16), 16, causal=True),
    _case("float_mask_dv16", (2, 2, 19, 32), (2, 2, 23, 32), 16, ((2, 1, 19, 23), "float", "normal"), scale=0.3),
    _case("all_keys", (1, 2, 33, 16), (1, 2, 128, 16), 32),
]


def _bound_check(case, data, got):
    q, k, v = (data[n].astype(np.float64) for n in ("q", "k", "v"))
    attrs = case.ops[0].attrs
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scale = attrs.get("scale", 1.0 / np.sqrt(q.shape[-1]))
    s = scale * q @ np.swapaxes(k, -1, -2)
    keep = np.ones(s.shape, bool)
    if "mask" in data:
        m = data["mask"]
        if m.dtype == bool:
            keep = keep & np.broadcast_to(m, s.shape)
        else:
            s = s + m.astype(np.float64)
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
    err = np.abs(got - ref)
    assert np.all(err <= bound), f"{case.id}: max error {err.max():.3g}, worst error/bound {(err / bound).max():.3f}"


def _run(env, case):
    import gpudelegate

    data = make_data(case)
    prog, names = build_program(case, data)
    with env.session(gpudelegate.loads(prog.to_bytes()), device="dawn", precision="fast", tuning=ON) as s:
        out = s.run("forward", [data[n] for n in names])[0]
        entries = {L.entry.split(":")[-1] for n in s.executor.recorded[0].nodes for L in n.launches}
    assert "attn_sgmat" in entries, entries
    _bound_check(case, data, out)


@pytest.fixture(scope="module")
def sgmat_env():
    from gpudelegate.webgpu import ops_sgmat

    env = Environment(device_options={"dawn": {"toggles": DAWN_TOGGLES}})
    try:
        ctx = env.context("dawn")
    except Exception as e:
        env.close()
        pytest.skip(f"no subgroup-matrix adapter (dawn: {e})")
    if not (ops_sgmat.NEEDED_FEATURES <= ctx.features and ops_sgmat.has_config(ctx.subgroup_matrix_configs)):
        env.close()
        pytest.skip(f"no subgroup-matrix adapter ({ctx.limits.name})")
    yield env
    env.close()


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_attn_sgmat_on_the_gpu(sgmat_env, case):
    _run(sgmat_env, case)
