"""core/ops.py: schemas, shape/dtype inference and the errors for bad nodes.

Pure Python (listed in tests/core_tests.txt: also runs with numpy blocked and inside Pyodide).
Shapes are checked against hand-derived answers; the numpy kernels are checked against these
same shapes by the conformance suite.
"""

import pytest

from gpudelegate import ops
from gpudelegate.errors import PayloadError, UnsupportedOpError
from gpudelegate.program import Value


def V(dtype, *shape):
    return Value(dtype, tuple(shape))


F = lambda *s: V("float32", *s)  # noqa: E731
H = lambda *s: V("float16", *s)  # noqa: E731
I = lambda *s: V("int32", *s)  # noqa: E731
B = lambda *s: V("bool", *s)  # noqa: E731


def out(op, args, attrs=None):
    (res,) = ops.infer(op, args, attrs or {})
    return res


def bad(op, args, attrs, match):
    with pytest.raises(PayloadError, match=match) as e:
        ops.infer(op, args, attrs)
    assert e.value.path == ""  # the caller adds the path inside the document
    return e.value


# --------------------------------------------------------------------------- registry

def test_every_documented_op_has_a_schema():
    documented = """add sub mul div pow maximum minimum eq ne lt le gt ge logical_and logical_or logical_not
        where neg abs exp log sqrt rsqrt sin cos tanh sigmoid relu silu erf reciprocal gelu hardtanh cast
        matmul linear conv2d max_pool2d avg_pool2d batch_norm layer_norm rms_norm softmax log_softmax sum mean
        amax argmax embedding reshape permute expand slice cat pad copy rope sdpa kv_update delegate""".split()
    assert sorted(documented) == sorted(ops.OP_NAMES)
    assert "delegate" not in ops.KERNEL_OPS


def test_unknown_op():
    with pytest.raises(UnsupportedOpError, match="unknown op 'conv3d'"):
        ops.get("conv3d")
    with pytest.raises(UnsupportedOpError):
        ops.infer("conv3d", [F(3)], {})


def test_aliases():
    assert ops.get("reshape").alias == 0 and ops.get("kv_update").alias == 0
    assert all(ops.get(n).alias is None for n in ops.OP_NAMES if n not in ("reshape", "kv_update"))


def test_delegate_is_not_inferred_here():
    bad("delegate", [F(3)], {"payload": 0}, "payload's signature")


# --------------------------------------------------------------------------- elementwise

def test_binary_broadcast_and_dtypes():
    assert out("add", [F(3, 1, 7), F(5, 1)]) == ("float32", (3, 5, 7))
    assert out("mul", [H(5, 7), H(7)]) == ("float16", (5, 7))
    assert out("mul", [H(5, 7), F(7)]) == ("float32", (5, 7))  # mixed storage keeps the wider
    assert out("sub", [I(5), I(5)]) == ("int32", (5,))
    assert out("div", [I(5), I(5)]) == ("float32", (5,))  # div is always float
    assert out("pow", [F(3), I()]) == ("float32", (3,))
    assert out("maximum", [F(), F()]) == ("float32", ())
    e = bad("add", [F(3, 5), F(7)], {}, "do not broadcast")
    assert "args[0] (a) [3, 5]" in str(e) and "args[1] (b) [7]" in str(e)
    bad("add", [B(3), B(3)], {}, r"args\[0\] \(a\) has dtype bool; add needs")


def test_compare_and_logical():
    assert out("lt", [F(5, 7), F(7)]) == ("bool", (5, 7))
    assert out("eq", [B(3), B(1)]) == ("bool", (3,))
    bad("lt", [B(3), B(3)], {}, "lt needs")
    bad("eq", [B(3), F(3)], {}, "compares bool with float32")
    assert out("logical_not", [B(3, 5)]) == ("bool", (3, 5))
    bad("logical_and", [B(3), F(3)], {}, r"args\[1\] \(b\) has dtype float32; logical_and needs bool")


def test_where():
    assert out("where", [B(5, 1), F(7), F(5, 7)]) == ("float32", (5, 7))
    assert out("where", [B(3), I(3), I(1)]) == ("int32", (3,))
    bad("where", [F(3), F(3), F(3)], {}, r"args\[0\] \(cond\) has dtype float32; where needs bool")
    bad("where", [B(3), I(3), F(3)], {}, "where needs matching dtypes")
    bad("where", [B(3), F(5), F(3)], {}, "do not broadcast")


def test_unary():
    assert out("exp", [H(3, 5)]) == ("float16", (3, 5))
    assert out("neg", [I(3)]) == ("int32", (3,))
    bad("exp", [I(3)], {}, "exp needs float32 or float16")
    bad("exp", [F(3), F(3)], {}, "exp takes 1 args, got 2")
    assert out("gelu", [F(3)], {"approximate": "tanh"}) == ("float32", (3,))
    bad("gelu", [F(3)], {"approximate": "fast"}, "attrs.approximate is 'fast'")
    bad("hardtanh", [F(3)], {"min_val": 2, "max_val": 1}, "min_val 2.0 is above")


def test_cast():
    assert out("cast", [F(3)], {"dtype": "int32"}) == ("int32", (3,))
    assert out("cast", [B(3)], {"dtype": "float16"}) == ("float16", (3,))
    bad("cast", [F(3)], {}, "attrs.dtype is required by cast")
    bad("cast", [F(3)], {"dtype": "int64"}, "attrs.dtype of cast: expected one of")


# --------------------------------------------------------------------------- linear algebra

def test_matmul_numpy_semantics():
    assert out("matmul", [F(5, 7), F(7, 3)]) == ("float32", (5, 3))
    assert out("matmul", [F(3, 1, 5, 7), F(2, 7, 3)]) == ("float32", (3, 2, 5, 3))
    assert out("matmul", [F(7), F(7, 3)]) == ("float32", (3,))
    assert out("matmul", [F(2, 5, 7), F(7)]) == ("float32", (2, 5))
    assert out("matmul", [F(7), F(7)]) == ("float32", ())
    bad("matmul", [F(5, 7), F(5, 3)], {}, "contraction mismatch.*K=7.*K=5")
    bad("matmul", [F(2, 5, 7), F(3, 7, 3)], {}, "do not broadcast")
    bad("matmul", [F(), F(3)], {}, "scalar")


def test_linear():
    assert out("linear", [F(2, 3, 13), F(5, 13), F(5)]) == ("float32", (2, 3, 5))
    assert out("linear", [F(7, 13), H(5, 13), None]) == ("float32", (7, 5))
    assert out("linear", [F(7, 13), F(5, 13)]) == ("float32", (7, 5))  # trailing optional left out
    bad("linear", [F(7, 13), F(5, 11), None], {}, "has K=13 but")
    bad("linear", [F(7, 13), F(5, 13), F(7)], {}, r"args\[2\] \(bias\) has shape \[7\]; expected \[5\]")
    bad("linear", [F(7, 13), F(13)], {}, "rank-2")
    bad("linear", [F(7, 13), None, F(5)], {}, r"args\[1\] \(w\) of linear is required but absent")
    bad("linear", [F(7, 13), F(5, 13), F(5), F(5)], {}, "linear takes 2..3 args, got 4")


def test_conv2d_shapes():
    # Ho = floor((H + 2p - d(k-1) - 1)/s) + 1
    assert out("conv2d", [F(2, 3, 11, 13), F(5, 3, 3, 3), None], {"stride": [2, 2], "padding": [1, 1]}) == \
        ("float32", (2, 5, 6, 7))
    assert out("conv2d", [F(1, 3, 11, 13), F(5, 3, 3, 2), F(5)], {"dilation": [2, 1], "padding": [2, 0],
                                                                "stride": [1, 2]}) == ("float32", (1, 5, 11, 6))
    assert out("conv2d", [F(1, 6, 7, 11), F(4, 3, 3, 3)], {"groups": 2}) == ("float32", (1, 4, 5, 9))
    assert out("conv2d", [F(1, 5, 7, 7), F(5, 1, 3, 3)], {"groups": 5, "stride": 2}) == ("float32", (1, 5, 3, 3))
    bad("conv2d", [F(1, 6, 7, 11), F(4, 2, 3, 3)], {"groups": 2}, "has 2 input channels per group.* = 3")
    bad("conv2d", [F(1, 6, 7, 11), F(5, 3, 3, 3)], {"groups": 2}, "groups=2 must divide")
    bad("conv2d", [F(1, 3, 2, 2), F(5, 3, 3, 3)], {}, "larger than the padded input")
    bad("conv2d", [F(3, 7, 7), F(5, 3, 3, 3)], {}, r"args\[0\] \(x\) has shape \[3, 7, 7\]; conv2d needs a rank-4")
    bad("conv2d", [F(1, 3, 7, 7), F(5, 3, 3, 3)], {"stride": [0, 1]}, "attrs.stride")
    bad("conv2d", [F(1, 3, 7, 7), F(5, 3, 3, 3)], {"padding": "same"}, "attrs.padding of conv2d: expected an int or a list of 2")


def test_pool_shapes_and_ceil_mode():
    x = F(2, 3, 11, 13)
    assert out("max_pool2d", [x], {"kernel": [2, 2]}) == ("float32", (2, 3, 5, 6))
    assert out("max_pool2d", [x], {"kernel": 3, "stride": 2, "padding": 1}) == ("float32", (2, 3, 6, 7))
    # ceil_mode: (11-3)/2 -> 4 (+1 = 5), (13-3)/2 = 5 exactly (+1 = 6)
    assert out("avg_pool2d", [x], {"kernel": [3, 3], "stride": [2, 2], "ceil_mode": True}) == ("float32", (2, 3, 5, 6))
    assert out("max_pool2d", [F(1, 1, 6, 6)], {"kernel": 2, "stride": 2, "ceil_mode": True}) == ("float32", (1, 1, 3, 3))
    # the last ceil window must start inside the input or left padding: 5 -> 3, not 4
    assert out("max_pool2d", [F(1, 1, 5, 5)], {"kernel": 2, "stride": 2, "padding": 1, "ceil_mode": True}) == \
        ("float32", (1, 1, 3, 3))
    assert ops.normalize_attrs("max_pool2d", {"kernel": 3}, [x])["stride"] == [3, 3]
    bad("max_pool2d", [x], {}, "attrs.kernel is required")
    bad("max_pool2d", [x], {"kernel": 2, "padding": 2}, "at most half of attrs.kernel")
    bad("avg_pool2d", [x], {"kernel": 2, "dilation": 2}, r"unknown attribute\(s\) \['dilation'\] for op avg_pool2d")


def test_norms():
    assert out("batch_norm", [F(2, 5, 7), F(5), F(5), None, F(5)]) == ("float32", (2, 5, 7))
    bad("batch_norm", [F(2, 5, 7), F(5), F(7)], {}, r"args\[2\] \(var\) has shape \[7\]; expected \[5\]")
    bad("batch_norm", [F(5), F(5), F(5)], {}, "needs \\[N, C, ...\\]")
    assert out("layer_norm", [F(3, 5, 11), F(5, 11), F(5, 11)], {"normalized_shape": [5, 11]}) == ("float32", (3, 5, 11))
    bad("layer_norm", [F(3, 5, 11)], {"normalized_shape": [5]}, "not the trailing dims")
    bad("layer_norm", [F(3, 11), F(5)], {"normalized_shape": [11]}, r"args\[1\] \(weight\)")
    bad("layer_norm", [F(3, 11)], {"normalized_shape": [11], "eps": -1.0}, "attrs.eps -1.0 must be >= 0")
    assert out("rms_norm", [H(3, 13), H(13)]) == ("float16", (3, 13))
    bad("rms_norm", [F(3, 13), F(3)], {}, "the last dim of x")


def test_softmax_and_reductions():
    assert ops.normalize_attrs("softmax", {}, [F(3, 5)]) == {"dim": 1}
    bad("softmax", [F(3, 5)], {"dim": 2}, "attrs.dim 2 out of range for a rank-2 tensor")
    bad("softmax", [F(3, 5)], {"dim": 1.0}, "attrs.dim of softmax: expected an int")
    x = F(5, 7, 3)
    assert out("sum", [x], {"dims": [-1]}) == ("float32", (5, 7))
    assert out("mean", [x], {"dims": [0, 2], "keepdim": True}) == ("float32", (1, 7, 1))
    assert out("amax", [x]) == ("float32", ())
    assert out("sum", [I(3, 5)], {"dims": []}) == ("int32", ())
    assert ops.normalize_attrs("sum", {"dims": [2, -3]}, [x])["dims"] == [0, 2]
    bad("mean", [I(3)], {"dims": [0]}, "mean needs float32 or float16")
    bad("sum", [x], {"dims": [0, -3]}, "names a dim twice")
    assert out("argmax", [x], {"dim": 1, "keepdim": True}) == ("int32", (5, 1, 3))
    assert out("argmax", [x]) == ("int32", (5, 7))


# --------------------------------------------------------------------------- indexing and layout

def test_embedding():
    assert out("embedding", [H(11, 5), I(3, 7)]) == ("float16", (3, 7, 5))
    bad("embedding", [F(11, 5), F(3)], {}, r"args\[1\] \(ids\) has dtype float32; embedding needs int32")
    bad("embedding", [F(11), I(3)], {}, "rank-2")


def test_reshape_permute_expand():
    assert out("reshape", [F(3, 5, 7)], {"shape": [5, -1]}) == ("float32", (5, 21))
    assert ops.normalize_attrs("reshape", {"shape": [-1]}, [F(3, 5)]) == {"shape": [15]}
    bad("reshape", [F(3, 5)], {"shape": [4, -1]}, "cannot hold the 15 elements")
    bad("reshape", [F(3, 5)], {"shape": [-1, -1]}, "more than one -1")
    bad("reshape", [F(3, 5)], {"shape": [16]}, "has 16 elements")
    bad("reshape", [F(3, 5)], {}, "attrs.shape is required")
    assert out("permute", [F(3, 5, 7)], {"dims": [2, 0, -2]}) == ("float32", (7, 3, 5))
    bad("permute", [F(3, 5, 7)], {"dims": [0, 0, 1]}, "not a permutation")
    bad("permute", [F(3, 5, 7)], {"dims": [0, 1]}, "has 2 entries")
    assert out("expand", [F(3, 1, 7)], {"shape": [2, 3, 5, -1]}) == ("float32", (2, 3, 5, 7))
    bad("expand", [F(3, 2)], {"shape": [3, 5]}, "cannot expand dim 1 of size 2")
    bad("expand", [F(3)], {"shape": [-1, 3]}, "new leading dim")
    bad("expand", [F(3, 1)], {"shape": [7]}, "fewer dims")


def test_slice_python_semantics():
    x = F(3, 11, 5)
    assert out("slice", [x], {"dim": 1, "start": 2, "end": 9}) == ("float32", (3, 7, 5))
    assert out("slice", [x], {"dim": -1, "start": 1, "end": 2**63 - 1, "step": 2}) == ("float32", (3, 11, 2))
    assert ops.normalize_attrs("slice", {"dim": 0, "start": -5, "end": 100}, [F(13)]) == \
        {"dim": 0, "start": 8, "end": 13, "step": 1}
    assert out("slice", [x], {"dim": 1, "start": 9, "end": 2}) == ("float32", (3, 0, 5))  # empty, as python
    bad("slice", [x], {"dim": 1, "start": 0, "end": 3, "step": 0}, "attrs.step 0 must be >= 1")
    bad("slice", [x], {"dim": 3, "start": 0, "end": 1}, "attrs.dim 3 out of range")
    bad("slice", [x], {"dim": 1, "start": "a"}, "attrs.start of slice: expected an int")


def test_cat_pad_copy():
    assert out("cat", [F(3, 5), F(3, 2), F(3, 1)], {"dim": -1}) == ("float32", (3, 8))
    bad("cat", [F(3, 5), F(2, 5)], {"dim": 1}, r"args\[1\] \(x\) shape \[2, 5\] does not match")
    bad("cat", [F(3, 5), I(3, 5)], {"dim": 0}, r"args\[1\] \(x\) has dtype int32")
    bad("cat", [F(3), None], {"dim": 0}, "required but absent")
    bad("cat", [], {"dim": 0}, "at least 1")
    assert out("pad", [F(3, 5, 7)], {"pads": [1, 2, 0, 3]}) == ("float32", (3, 8, 10))
    assert out("pad", [F(3, 5, 7)], {"pads": [-1, 2]}) == ("float32", (3, 5, 8))
    bad("pad", [F(3, 5)], {"pads": [1, 2, 3]}, "even length")
    bad("pad", [F(3, 5)], {"pads": [-3, -3]}, "crops dim 1")
    assert out("copy", [B(3)]) == ("bool", (3,))


# --------------------------------------------------------------------------- attention

def test_rope():
    assert out("rope", [F(2, 3, 5, 8), F(5, 8), F(5, 8)]) == ("float32", (2, 3, 5, 8))
    bad("rope", [F(2, 3, 5, 7), F(5, 7), F(5, 7)], {}, "odd head dim 7")
    bad("rope", [F(2, 3, 5, 8), F(7, 8), F(5, 8)], {}, r"args\[1\] \(cos\) has shape \[7, 8\]; expected \[5, 8\]")


def test_sdpa():
    q, k, v = F(2, 6, 5, 8), F(2, 2, 7, 8), F(2, 2, 7, 3)
    assert out("sdpa", [q, k, v, None]) == ("float32", (2, 6, 5, 3))
    assert out("sdpa", [q, k, v, B(1, 1, 5, 7)], {"causal": True}) == ("float32", (2, 6, 5, 3))
    assert ops.normalize_attrs("sdpa", {}, [q, k, v])["scale"] == pytest.approx(8 ** -0.5)
    assert ops.normalize_attrs("sdpa", {"scale": 1}, [q, k, v])["scale"] == 1.0
    bad("sdpa", [F(2, 5, 5, 8), k, v], {}, "query heads 5 are not a multiple of key/value heads 2")
    bad("sdpa", [q, F(2, 2, 7, 4), v], {}, "head dim 8 != .* head dim 4")
    bad("sdpa", [q, k, F(2, 2, 6, 3)], {}, "disagree on heads/length")
    bad("sdpa", [q, k, v, B(5, 5)], {}, r"do not broadcast \(args\[3\] \(mask\) \[5, 5\], scores \[2, 6, 5, 7\]\)")
    bad("sdpa", [q, k, v, I(5, 7)], {}, r"args\[3\] \(mask\) has dtype int32")
    bad("sdpa", [q, k, v], {"causal": 1}, "attrs.causal of sdpa: expected a bool")


def test_kv_update():
    assert out("kv_update", [H(1, 2, 11, 4), H(1, 2, 3, 4), I(1)]) == ("float16", (1, 2, 11, 4))
    bad("kv_update", [F(1, 2, 11, 4), F(1, 2, 12, 4), I(1)], {}, "has 12 rows; the cache holds only 11")
    bad("kv_update", [F(1, 2, 11, 4), F(1, 3, 1, 4), I(1)], {}, "does not match the cache")
    bad("kv_update", [F(1, 2, 11, 4), H(1, 2, 1, 4), I(1)], {}, "the cache is float32")
    bad("kv_update", [F(1, 2, 11, 4), F(1, 2, 1, 4), F(1)], {}, r"args\[2\] \(pos\) has dtype float32")


# --------------------------------------------------------------------------- attrs in general

def test_normalize_fills_defaults_without_values():
    assert ops.normalize_attrs("conv2d", {}) == {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1}
    assert ops.normalize_attrs("sdpa", None) == {"causal": False, "scale": None, "causal_offset": 0}
    assert ops.normalize_attrs("layer_norm", {"normalized_shape": [4], "eps": 1}) == {"normalized_shape": [4], "eps": 1.0}


def test_attr_errors():
    bad("add", [F(3), F(3)], {"alpha": 2}, r"unknown attribute\(s\) \['alpha'\] for op add")
    bad("add", [F(3), F(3)], [1], "attrs of add must be a map")
    bad("hardtanh", [F(3)], {"min_val": True}, "expected a number, got True")
    bad("layer_norm", [F(3)], {"normalized_shape": [1.5]}, "expected a list of ints")
    bad("add", [F(3), Value("float64", (3,))], {}, "unknown dtype 'float64'")
