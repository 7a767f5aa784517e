"""The golden kernels themselves, checked against PyTorch in float64 on random inputs.

Every other executor is held to native/reference_kernels.py by the conformance suite, so the
reference must agree with the framework models come from. Both sides compute in float64, so the
tolerance (rtol 1e-10, atol 1e-12) only covers different summation orders; erf goes through libm
on our side and through torch's own erf, both accurate to a few ulp in double.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gpudelegate.errors import InputError, PayloadError
from gpudelegate.native.reference_kernels import KERNELS

RTOL, ATOL = 1e-10, 1e-12


def rng(seed):
    return np.random.default_rng(1000 + seed)


def randn(r, *shape):
    # never zero, never tiny: avoids sign/division edge cases that say nothing about a kernel
    x = r.standard_normal(shape)
    return np.where(np.abs(x) < 0.05, 0.05 * np.sign(x) + 0.05 * (x == 0), x)


def T(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def run(op, args, attrs=None):
    outs = KERNELS[op](args, attrs or {})
    assert len(outs) == 1
    return outs[0]


def check(ours, ref):
    ref = ref.detach().numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    if ref.dtype == np.bool_ or ref.dtype.kind in "iu":
        assert ours.dtype.kind == ref.dtype.kind or (ours.dtype == np.int32 and ref.dtype.kind == "i")
        np.testing.assert_array_equal(ours, ref)
    else:
        assert ours.dtype == np.float64
        np.testing.assert_allclose(ours, ref, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- elementwise

BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
          "maximum": torch.maximum, "minimum": torch.minimum}


@pytest.mark.parametrize("op", sorted(BINARY))
@pytest.mark.parametrize("shapes", [((5, 7), (5, 7)), ((3, 1, 7), (5, 1)), ((11,), ())])
def test_binary_float(op, shapes):
    r = rng(1)
    a, b = randn(r, *shapes[0]), randn(r, *shapes[1])
    if op == "pow":
        a = np.abs(a) + 0.5  # real-valued results only
    check(run(op, [a, b]), BINARY[op](T(a), T(b)))


@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_int32(op):
    r = rng(2)
    a = r.integers(-9, 10, (3, 5)).astype(np.int32)
    b = r.integers(1, 4, (5,)).astype(np.int32)  # positive: division and powers stay defined
    ours = run(op, [a, b])
    ref = BINARY[op](T(a), T(b))
    assert ours.dtype == (np.float32 if op == "div" else np.int32)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)


def test_int_pow_negative_exponent_matches_torch():
    a = np.array([-3, -1, 1, 2, 5], np.int32)
    b = np.array([-1, -3, -2, -2, 2], np.int32)
    np.testing.assert_array_equal(run("pow", [a, b]), torch.pow(T(a), T(b)).numpy())


@pytest.mark.parametrize("op", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_compare(op):
    r = rng(3)
    a = np.round(randn(r, 5, 7), 1)
    b = np.round(randn(r, 7), 1)
    b[:3] = a[0, :3]  # some exact ties
    check(run(op, [a, b]), getattr(torch, op)(T(a), T(b)))


@pytest.mark.parametrize("op", ["logical_and", "logical_or", "logical_not"])
def test_logical(op):
    r = rng(4)
    a, b = r.random((3, 5)) > 0.5, r.random((5,)) > 0.5
    args = [a] if op == "logical_not" else [a, b]
    check(run(op, args), getattr(torch, op)(*[T(x) for x in args]))
    # bool storage (uint32 0/1) is read as bool too
    check(run(op, [x.astype(np.uint32) for x in args]), getattr(torch, op)(*[T(x) for x in args]))


def test_where():
    r = rng(5)
    c, a, b = r.random((5, 1)) > 0.5, randn(r, 7), randn(r, 5, 7)
    check(run("where", [c, a, b]), torch.where(T(c), T(a), T(b)))


UNARY = {
    "neg": (torch.neg, None), "abs": (torch.abs, None), "exp": (torch.exp, None),
    "log": (torch.log, "pos"), "sqrt": (torch.sqrt, "pos"), "rsqrt": (torch.rsqrt, "pos"),
    "sin": (torch.sin, None), "cos": (torch.cos, None), "tanh": (torch.tanh, None),
    "sigmoid": (torch.sigmoid, None), "relu": (torch.relu, None), "silu": (F.silu, None),
    "erf": (torch.erf, None), "reciprocal": (torch.reciprocal, None),
}


@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(op):
    fn, dom = UNARY[op]
    x = randn(rng(6), 7, 11) * 3
    if dom == "pos":
        x = np.abs(x)
    check(run(op, [x]), fn(T(x)))


def test_sigmoid_extremes_do_not_overflow():
    x = np.array([-800.0, -50.0, 0.0, 50.0, 800.0])
    check(run("sigmoid", [x]), torch.sigmoid(T(x)))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate):
    x = randn(rng(7), 13, 5) * 3
    check(run("gelu", [x], {"approximate": approximate}), F.gelu(T(x), approximate=approximate))


@pytest.mark.parametrize("lo,hi", [(-1.0, 1.0), (0.0, 6.0)])
def test_hardtanh(lo, hi):
    x = randn(rng(8), 7, 5) * 4
    check(run("hardtanh", [x], {"min_val": lo, "max_val": hi}), F.hardtanh(T(x), lo, hi))


def test_cast():
    x = randn(rng(9), 5, 7) * 5
    check(run("cast", [x], {"dtype": "int32"}), T(x).to(torch.int32))  # truncation toward zero
    check(run("cast", [x], {"dtype": "bool"}), T(x).to(torch.bool))
    i = np.arange(-5, 6, dtype=np.int32)
    np.testing.assert_array_equal(run("cast", [i], {"dtype": "float32"}), T(i).float().numpy())
    b = i > 0
    np.testing.assert_array_equal(run("cast", [b], {"dtype": "int32"}), T(b).int().numpy())
    h = run("cast", [x], {"dtype": "float16"})
    assert h.dtype == np.float16
    np.testing.assert_array_equal(h, T(x).half().numpy())


# --------------------------------------------------------------------------- linear algebra

@pytest.mark.parametrize("sa,sb", [((5, 7), (7, 3)), ((2, 5, 7), (7, 11)), ((3, 1, 5, 7), (2, 7, 3)),
                                   ((7,), (7, 3)), ((5, 7), (7,)), ((7,), (7,))])
def test_matmul(sa, sb):
    r = rng(10)
    a, b = randn(r, *sa), randn(r, *sb)
    check(run("matmul", [a, b]), torch.matmul(T(a), T(b)))


@pytest.mark.parametrize("bias", [False, True])
def test_linear(bias):
    r = rng(11)
    x, w, b = randn(r, 2, 3, 7), randn(r, 5, 7), randn(r, 5)
    check(run("linear", [x, w, b if bias else None]), F.linear(T(x), T(w), T(b) if bias else None))


@pytest.mark.parametrize("cfg", [
    dict(),
    dict(stride=[2, 2], padding=[1, 1]),
    dict(stride=[1, 2], padding=[2, 0], dilation=[2, 1]),
    dict(groups=2, padding=[1, 1]),
    dict(groups=6, stride=[2, 2], padding=[1, 1]),  # depthwise
])
@pytest.mark.parametrize("bias", [False, True])
def test_conv2d(cfg, bias):
    r = rng(12)
    g = cfg.get("groups", 1)
    x = randn(r, 2, 6, 11, 13)
    w = randn(r, 6 if g == 6 else 4, 6 // g, 3, 3)
    b = randn(r, w.shape[0])
    ref = F.conv2d(T(x), T(w), T(b) if bias else None, stride=cfg.get("stride", 1),
                   padding=cfg.get("padding", 0), dilation=cfg.get("dilation", 1), groups=g)
    check(run("conv2d", [x, w, b if bias else None], cfg), ref)


@pytest.mark.parametrize("cfg", [
    dict(kernel=[2, 2]),
    dict(kernel=[3, 3], stride=[2, 2], padding=[1, 1]),
    dict(kernel=[3, 3], stride=[2, 2], ceil_mode=True),
    dict(kernel=[3, 2], stride=[2, 1], padding=[1, 1], dilation=[2, 1], ceil_mode=True),
])
def test_max_pool2d(cfg):
    x = randn(rng(13), 2, 3, 11, 13)
    ref = F.max_pool2d(T(x), cfg["kernel"], cfg.get("stride"), cfg.get("padding", 0), cfg.get("dilation", 1),
                       ceil_mode=cfg.get("ceil_mode", False))
    check(run("max_pool2d", [x], cfg), ref)


@pytest.mark.parametrize("cfg", [
    dict(kernel=[2, 2]),
    dict(kernel=[3, 3], stride=[2, 2], padding=[1, 1]),
    dict(kernel=[3, 3], stride=[2, 2], padding=[1, 1], count_include_pad=False),
    dict(kernel=[3, 3], stride=[2, 2], ceil_mode=True),
    dict(kernel=[3, 2], stride=[2, 2], padding=[1, 1], ceil_mode=True, count_include_pad=False),
    dict(kernel=[3, 3], stride=[2, 2], padding=[1, 1], ceil_mode=True),
])
def test_avg_pool2d(cfg):
    x = randn(rng(14), 2, 3, 11, 13)
    ref = F.avg_pool2d(T(x), cfg["kernel"], cfg.get("stride"), cfg.get("padding", 0),
                       ceil_mode=cfg.get("ceil_mode", False), count_include_pad=cfg.get("count_include_pad", True))
    check(run("avg_pool2d", [x], cfg), ref)


# --------------------------------------------------------------------------- normalization

@pytest.mark.parametrize("affine", [False, True])
def test_batch_norm(affine):
    r = rng(15)
    x = randn(r, 2, 5, 7, 3)
    mean, var, w, b = randn(r, 5), np.abs(randn(r, 5)) + 0.1, randn(r, 5), randn(r, 5)
    ref = F.batch_norm(T(x), T(mean), T(var), T(w) if affine else None, T(b) if affine else None,
                       training=False, eps=1e-3)
    check(run("batch_norm", [x, mean, var, w if affine else None, b if affine else None], {"eps": 1e-3}), ref)


@pytest.mark.parametrize("ns", [[11], [5, 11]])
@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm(ns, affine):
    r = rng(16)
    x = randn(r, 3, 5, 11) * 2 + 1
    w, b = randn(r, *ns), randn(r, *ns)
    ref = F.layer_norm(T(x), ns, T(w) if affine else None, T(b) if affine else None, eps=1e-5)
    check(run("layer_norm", [x, w if affine else None, b if affine else None], {"normalized_shape": ns}), ref)


@pytest.mark.parametrize("affine", [False, True])
def test_rms_norm(affine):
    r = rng(17)
    x, w = randn(r, 3, 5, 13), randn(r, 13)
    ref = F.rms_norm(T(x), [13], T(w) if affine else None, eps=1e-6)
    check(run("rms_norm", [x, w if affine else None]), ref)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_softmax(op, dim):
    x = randn(rng(18), 5, 7, 3) * 4
    check(run(op, [x], {"dim": dim}), getattr(F, op)(T(x), dim=dim))


# --------------------------------------------------------------------------- reductions

@pytest.mark.parametrize("op", ["sum", "mean", "amax"])
@pytest.mark.parametrize("dims", [[-1], [0, 2], None])
@pytest.mark.parametrize("keepdim", [False, True])
def test_reduce(op, dims, keepdim):
    x = randn(rng(19), 5, 7, 3)
    attrs = {"dims": dims, "keepdim": keepdim}
    fn = getattr(torch, op)
    ref = fn(T(x), dim=dims if dims is not None else [0, 1, 2], keepdim=keepdim)
    check(run(op, [x], attrs), ref)


def test_sum_int32_stays_int32():
    x = rng(20).integers(-50, 50, (5, 7)).astype(np.int32)
    y = run("sum", [x], {"dims": [1]})
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, T(x).sum(1).numpy())


@pytest.mark.parametrize("dim", [-1, 0, 1])
@pytest.mark.parametrize("keepdim", [False, True])
def test_argmax(dim, keepdim):
    x = np.round(randn(rng(21), 5, 7, 3), 1)  # rounding makes ties: first index wins in both
    y = run("argmax", [x], {"dim": dim, "keepdim": keepdim})
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, torch.argmax(T(x), dim=dim, keepdim=keepdim).numpy())


# --------------------------------------------------------------------------- indexing and layout

def test_embedding():
    r = rng(22)
    w = randn(r, 11, 5)
    ids = r.integers(0, 11, (3, 7)).astype(np.int32)
    check(run("embedding", [w, ids]), F.embedding(T(ids).long(), T(w)))


def test_embedding_out_of_range_id_is_an_input_error():
    w = randn(rng(23), 11, 5)
    with pytest.raises(InputError, match="id 11 out of range"):
        run("embedding", [w, np.array([3, 11], np.int32)])


def test_layout_ops():
    r = rng(24)
    x = randn(r, 3, 5, 7)
    check(run("reshape", [x], {"shape": [5, -1]}), T(x).reshape(5, -1))
    check(run("permute", [x], {"dims": [2, 0, 1]}), T(x).permute(2, 0, 1))
    check(run("expand", [x[:, :1]], {"shape": [2, -1, 5, 7]}), T(x[:, :1]).expand(2, -1, 5, 7))
    check(run("slice", [x], {"dim": 2, "start": 1, "end": 2**63 - 1, "step": 2}), T(x)[:, :, 1::2])
    check(run("slice", [x], {"dim": -2, "start": -3, "end": -1}), T(x)[:, -3:-1])
    y, z = randn(r, 3, 2, 7), randn(r, 3, 1, 7)
    check(run("cat", [x, y, z], {"dim": 1}), torch.cat([T(x), T(y), T(z)], 1))
    check(run("copy", [x]), T(x).clone())


@pytest.mark.parametrize("pads,value", [([1, 2], 0.0), ([1, 0, 2, 3], -1.5), ([-1, 2, 0, 1, 1, 1], 2.0)])
def test_pad(pads, value):
    x = randn(rng(25), 3, 5, 7)
    check(run("pad", [x], {"pads": pads, "value": value}), F.pad(T(x), pads, value=value))


# --------------------------------------------------------------------------- attention

def test_rope():
    r = rng(26)
    x, cos, sin = randn(r, 2, 3, 5, 8), randn(r, 5, 8), randn(r, 5, 8)
    tx = T(x)
    rot = torch.cat([-tx[..., 4:], tx[..., :4]], dim=-1)  # Llama's rotate_half
    check(run("rope", [x, cos, sin]), tx * T(cos) + rot * T(sin))


@pytest.mark.parametrize("case", ["plain", "gqa", "causal", "bool_mask", "float_mask", "causal_offset", "scale"])
def test_sdpa(case):
    r = rng(27)
    h, hk = (6, 2) if case == "gqa" else (3, 3)
    tq, tk = (3, 7) if case == "causal_offset" else (5, 5)
    q, k, v = randn(r, 2, h, tq, 8), randn(r, 2, hk, tk, 8), randn(r, 2, hk, tk, 3)
    attrs, mask, tmask = {}, None, None
    kw = {}
    if case == "gqa":
        kw["enable_gqa"] = True
    if case == "causal":
        attrs["causal"] = True
        kw["is_causal"] = True
    if case == "bool_mask":
        mask = r.random((1, 1, tq, tk)) > 0.3
        mask[..., 0] = True  # no fully masked row
        tmask = T(mask)
    if case == "float_mask":
        mask = randn(r, 2, 1, tq, tk)
        tmask = T(mask)
    if case == "causal_offset":
        attrs.update(causal=True, causal_offset=4)  # a decode chunk: 3 new queries after 4 cached keys
        tmask = torch.ones(tq, tk, dtype=torch.bool).tril(diagonal=4)
    if case == "scale":
        attrs["scale"] = 0.3
        kw["scale"] = 0.3
    ref = F.scaled_dot_product_attention(T(q), T(k), T(v), attn_mask=tmask, **kw)
    check(run("sdpa", [q, k, v, mask], attrs), ref)


def test_kv_update():
    r = rng(28)
    cache, new = randn(r, 1, 2, 11, 4), randn(r, 1, 2, 3, 4)
    out = run("kv_update", [cache, new, np.array([5], np.int32)])
    ref = T(cache).clone()
    ref[:, :, 5:8] = T(new)
    check(out, ref)
    with pytest.raises(InputError, match="do not fit"):
        run("kv_update", [cache, new, np.array([9], np.int32)])


# --------------------------------------------------------------------------- storage precision

@pytest.mark.parametrize("op,attrs", [("softmax", {}), ("gelu", {}), ("exp", {}), ("rms_norm", {})])
def test_float16_storage_computes_in_float32(op, attrs):
    x = randn(rng(29), 5, 7).astype(np.float16)
    y = run(op, [x], attrs)
    assert y.dtype == np.float16
    y32 = run(op, [x.astype(np.float32)], attrs)
    assert y32.dtype == np.float32
    # the float16 result is the float32 one rounded once (to nearest): they agree to fp16 rounding
    np.testing.assert_array_equal(y, y32.astype(np.float16))


def test_mixed_float16_float32_gives_float32():
    r = rng(30)
    y = run("linear", [randn(r, 3, 7).astype(np.float32), randn(r, 5, 7).astype(np.float16), None])
    assert y.dtype == np.float32


def test_bad_attrs_raise_payload_errors():
    x = randn(rng(31), 3, 5)
    with pytest.raises(PayloadError, match="approximate"):
        run("gelu", [x], {"approximate": "fast"})
    with pytest.raises(PayloadError, match="cannot hold"):
        run("reshape", [x], {"shape": [4, -1]})
