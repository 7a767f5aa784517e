"""The ATen -> op-set table: one handler per core ATen op (after torch.export's decompositions,
minus the ops kept whole, see :data:`.frontend.KEEP_WHOLE`).

A handler gets the :class:`~.lowering.Lowering` (whose ``node`` is the FX node being lowered) and
the node's arguments named after the op's schema (tensors as value ids or lazy constants, python
scalars as they are) and returns the value (or a tuple of values for multi-output ops; ``None``
where an output is not supported). Output dtype/shape come from the node's ``meta["val"]``, so the
table never re-derives torch's promotion and broadcasting rules; the core's inference checks it.

This module also defines the custom ops ``torch.ops.gpudelegate.kv_update`` and
``torch.ops.gpudelegate.rope`` for models that want those op-set ops whole (a KV cache updated
in place on the device, Llama rotary embeddings).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .lowering import Const, Lowering, Vid

aten = torch.ops.aten
TABLE: Dict[Any, Callable[[Lowering, Dict[str, Any]], Any]] = {}


def _register(*targets):
    def deco(fn):
        for t in targets:
            if t is not None:
                TABLE[t] = fn
        return fn
    return deco


def _ov(packet, *names):
    """Overloads of an op packet that exist in this torch build."""
    return [getattr(packet, n) for n in names if n in packet.overloads()]


# ------------------------------------------------------------------------------ custom ops

@torch.library.custom_op("gpudelegate::kv_update", mutates_args=())
def kv_update(cache: torch.Tensor, new: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rows ``pos .. pos+T-1`` of dim 2 of ``cache`` [B,H,S,D] replaced by ``new`` [B,H,T,D].
    Functional in torch; on the device the op-set ``kv_update`` writes the cache in place."""
    p = int(pos.reshape(-1)[0])
    out = cache.clone()
    out[:, :, p:p + new.shape[2]] = new
    return out


@kv_update.register_fake
def _kv_update_fake(cache, new, pos):
    return torch.empty_like(cache)


@torch.library.custom_op("gpudelegate::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama rotary embedding: ``x*cos + rotate_half(x)*sin`` with x [B,H,T,D], cos/sin [T,D]."""
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rot * sin


@rope.register_fake
def _rope_fake(x, cos, sin):
    return torch.empty_like(x)


# ------------------------------------------------------------------------------ helpers

def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _pair(x, name: str, L: Lowering) -> List[int]:
    if isinstance(x, int):
        return [x, x]
    x = list(x)
    if len(x) == 1:
        return [x[0], x[0]]
    if len(x) != 2:
        raise L.fail(f"{name}={x}: expected one or two values (2-D op)")
    return [int(v) for v in x]


def _is_scalar(x) -> bool:
    return isinstance(x, (bool, int, float)) and not isinstance(x, Vid)


def _promote(L: Lowering, entries: Sequence[Any]) -> str:
    """The common program dtype of tensor/scalar operands (python scalars are 'weak', as in torch:
    a float scalar makes an int tensor float, but never widens a float16 tensor)."""
    tensor_dts = [L.entry_dtype(e) for e in entries if not _is_scalar(e) and e is not None]
    if "float32" in tensor_dts:
        return "float32"
    if "float16" in tensor_dts:
        return "float16"
    if any(isinstance(e, float) for e in entries):
        return "float32"
    if "int32" in tensor_dts or any(isinstance(e, int) and not isinstance(e, bool) for e in entries):
        return "int32"
    return "bool"


def _out(L: Lowering, index: Optional[int] = None):
    return L.meta(index=index)


def _operand(L: Lowering, e, dtype: str) -> int:
    return L.scalar(e, dtype) if _is_scalar(e) else L.value(e, dtype)


def _elementwise(L: Lowering, op: str, operands: Sequence[Any], dtype: Optional[str] = None, attrs=None) -> int:
    """One element-wise op on the node's output dtype/shape, operands cast to ``dtype``."""
    odt, oshape = _out(L)
    dt = dtype or odt
    return L.emit(op, [_operand(L, e, dt) for e in operands], attrs, odt, oshape)


def _const_reshape(L: Lowering, e, shape) -> Any:
    """Reshape a lazy constant at export time (no node), a computed value with a ``reshape``."""
    if isinstance(e, Const):
        return Const(e.tensor.reshape(shape), name=e.name)
    return L.reshape(e, shape)


# ------------------------------------------------------------------------------ arithmetic

def _scaled(L: Lowering, e, alpha, dt: str, shape) -> Any:
    if alpha == 1:
        return e
    if _is_scalar(e):
        return e * alpha
    return L.emit("mul", [L.value(e, dt), L.scalar(alpha, dt)], {}, dt, L.entry_shape(e))


@_register(aten.add.Tensor, aten.add.Scalar)
def _add(L, a):
    dt, shape = _out(L)
    other = _scaled(L, a["other"], a.get("alpha", 1), dt, shape)
    return _elementwise(L, "add", [a["self"], other])


@_register(aten.sub.Tensor, aten.sub.Scalar)
def _sub(L, a):
    dt, shape = _out(L)
    other = _scaled(L, a["other"], a.get("alpha", 1), dt, shape)
    return _elementwise(L, "sub", [a["self"], other])


@_register(aten.mul.Tensor, aten.mul.Scalar)
def _mul(L, a):
    return _elementwise(L, "mul", [a["self"], a["other"]])


@_register(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div(L, a):
    mode = a.get("rounding_mode")
    dt, shape = _out(L)
    if mode is None:
        return _elementwise(L, "div", [a["self"], a["other"]], dtype="float32" if dt == "int32" else dt)
    if mode == "trunc" and dt == "int32":
        q = L.emit("div", [_operand(L, a["self"], "float32"), _operand(L, a["other"], "float32")], {}, "float32", shape)
        return L.emit("cast", [q], {"dtype": "int32"}, "int32", shape)  # cast truncates toward zero
    raise L.fail(f"rounding_mode={mode!r} for {dt} is not supported (the op set has no floor)")


@_register(aten.pow.Tensor_Scalar)
def _pow_scalar(L, a):
    e = a["exponent"]
    x = a["self"]
    dt, shape = _out(L)
    # Common exponents as exact ops: WGSL's pow is undefined for negative bases, and these are
    # what norms and attention decompose to.
    if e == 1:
        return L.value(x, dt)
    if e == 2:
        v = L.value(x, dt)
        return L.emit("mul", [v, v], {}, dt, shape)
    if e == 0.5:
        return L.emit("sqrt", [L.value(x, dt)], {}, dt, shape)
    if e == -0.5:
        return L.emit("rsqrt", [L.value(x, dt)], {}, dt, shape)
    if e == -1:
        return L.emit("reciprocal", [L.value(x, dt)], {}, dt, shape)
    return _elementwise(L, "pow", [x, float(e) if dt != "int32" else e])


@_register(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _pow(L, a):
    return _elementwise(L, "pow", [a["self"], a["exponent"]])


@_register(aten.maximum.default)
def _maximum(L, a):
    return _elementwise(L, "maximum", [a["self"], a["other"]])


@_register(aten.minimum.default)
def _minimum(L, a):
    return _elementwise(L, "minimum", [a["self"], a["other"]])


@_register(aten.clamp.default, aten.clamp.Tensor)
def _clamp(L, a):
    dt, shape = _out(L)
    lo, hi = a.get("min"), a.get("max")
    x = L.value(a["self"], dt)
    if dt != "int32" and _is_scalar(lo) and _is_scalar(hi):
        return L.emit("hardtanh", [x], {"min_val": float(lo), "max_val": float(hi)}, dt, shape)
    if lo is not None:
        x = L.emit("maximum", [x, _operand(L, lo, dt)], {}, dt, shape)
    if hi is not None:
        x = L.emit("minimum", [x, _operand(L, hi, dt)], {}, dt, shape)
    return x


def _compare(op):
    def handler(L, a):
        return _elementwise(L, op, [a["self"], a["other"]], dtype=_promote(L, [a["self"], a["other"]]))
    return handler


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    _register(*_ov(getattr(aten, _name), "Tensor", "Scalar"))(_compare(_name))


def _logical(op):
    def handler(L, a):
        return _elementwise(L, op, [a["self"], a["other"]], dtype="bool")
    return handler


@_register(aten.logical_and.default, *_ov(aten.bitwise_and, "Tensor", "Scalar"))
def _and(L, a):
    if _out(L)[0] != "bool":
        raise L.fail("bitwise ops are supported on bool tensors only")
    return _logical("logical_and")(L, a)


@_register(aten.logical_or.default, *_ov(aten.bitwise_or, "Tensor", "Scalar"))
def _or(L, a):
    if _out(L)[0] != "bool":
        raise L.fail("bitwise ops are supported on bool tensors only")
    return _logical("logical_or")(L, a)


@_register(aten.logical_xor.default, *_ov(aten.bitwise_xor, "Tensor", "Scalar"))
def _xor(L, a):
    if _out(L)[0] != "bool":
        raise L.fail("bitwise ops are supported on bool tensors only")
    return _logical("ne")(L, a)


@_register(aten.logical_not.default, aten.bitwise_not.default)
def _not(L, a):
    if _out(L)[0] != "bool":
        raise L.fail("bitwise_not is supported on bool tensors only")
    return _elementwise(L, "logical_not", [a["self"]], dtype="bool")


@_register(aten.where.self)
def _where(L, a):
    dt, shape = _out(L)
    cond = L.value(a["condition"], "bool")
    return L.emit("where", [cond, _operand(L, a["self"], dt), _operand(L, a["other"], dt)], {}, dt, shape)


# ------------------------------------------------------------------------------ unary

def _unary(op):
    def handler(L, a):
        return _elementwise(L, op, [a["self"]])
    return handler


for _name in ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu", "silu",
              "erf", "reciprocal"):
    _register(getattr(aten, _name).default)(_unary(_name))


@_register(aten.gelu.default)
def _gelu(L, a):
    return _elementwise(L, "gelu", [a["self"]], attrs={"approximate": a.get("approximate") or "none"})


@_register(aten.hardtanh.default)
def _hardtanh(L, a):
    return _elementwise(L, "hardtanh", [a["self"]], attrs={"min_val": float(a["min_val"]), "max_val": float(a["max_val"])})


@_register(aten.leaky_relu.default)
def _leaky_relu(L, a):
    dt, shape = _out(L)
    x = L.value(a["self"], dt)
    pos = L.emit("gt", [x, L.scalar(0.0, dt)], {}, "bool", shape)
    neg = L.emit("mul", [x, L.scalar(float(a["negative_slope"]), dt)], {}, dt, shape)
    return L.emit("where", [pos, x, neg], {}, dt, shape)


@_register(aten._to_copy.default)
def _to_copy(L, a):
    dt, shape = _out(L)
    return L.value(a["self"], dt)  # a cast node only when the program dtype changes


# Functional graphs never mutate, so a clone is the same value (ops that write in place,
# kv_update, alias on purpose and the memory planner tracks them).
@_register(aten.clone.default, aten.alias.default)
def _identity(L, a):
    return L.value(a["self"])


# ------------------------------------------------------------------------------ shape ops

@_register(aten.view.default, aten.squeeze.dims, aten.unsqueeze.default)
def _reshape(L, a):
    dt, shape = _out(L)
    return L.reshape(a["self"], shape)


@_register(aten.permute.default)
def _permute(L, a):
    x = L.value(a["self"])
    rank = len(L.shape(x))
    dims = [_dim(d, rank) for d in a["dims"]]
    if dims == list(range(rank)):
        return x
    dt, shape = _out(L)
    xs = L.shape(x)
    moved = [d for d in dims if xs[d] != 1]
    if moved == sorted(moved):
        # Only size-1 dims move (e.g. [1,1,H,D] -> [1,H,1,D] in decode): the bytes are already in
        # order, so a free reshape replaces a copy kernel (90+ dispatches per SmolLM2 decode step).
        return L.reshape(x, shape)
    return L.emit("permute", [x], {"dims": dims}, dt, shape)


def _expand_to(L, e, shape):
    x = L.value(e)
    xs = L.shape(x)
    if tuple(xs) == tuple(shape):
        return x
    if len(xs) < len(shape):  # numpy broadcasting aligns trailing dims: make the ranks equal first
        x = L.reshape(x, (1,) * (len(shape) - len(xs)) + tuple(xs))
    return L.emit("expand", [x], {"shape": [int(d) for d in shape]}, L.dtype(x), shape)


@_register(aten.expand.default)
def _expand(L, a):
    return _expand_to(L, a["self"], _out(L)[1])


@_register(aten.repeat.default)
def _repeat(L, a):
    x = L.value(a["self"])
    reps = list(a["repeats"])
    xs = (1,) * (len(reps) - len(L.shape(x))) + tuple(L.shape(x))
    inter = [d for pair in zip([1] * len(xs), xs) for d in pair]  # [1, d0, 1, d1, ...]
    big = [d for pair in zip(reps, xs) for d in pair]  # [r0, d0, r1, d1, ...]
    y = _expand_to(L, L.reshape(x, inter), big)
    return L.reshape(y, _out(L)[1])


def _slice(L, x, dim: int, start, end, step: int = 1, name: str = ""):
    shape = L.shape(x)
    dim = _dim(dim, len(shape))
    start, end, step = slice(start, end, step).indices(shape[dim])  # python semantics, clamped
    if (start, end, step) == (0, shape[dim], 1):
        return x
    n = max(0, (end - start + (step - (1 if step > 0 else -1))) // step)
    out = list(shape)
    out[dim] = n
    return L.emit("slice", [x], {"dim": dim, "start": start, "end": end, "step": step}, L.dtype(x), out, name=name)


@_register(aten.slice.Tensor)
def _slice_op(L, a):
    if a.get("step", 1) is not None and a.get("step", 1) < 1:
        raise L.fail(f"slice step {a['step']} < 1")
    return _slice(L, L.value(a["self"]), a.get("dim", 0), a.get("start"), a.get("end"), a.get("step") or 1)


@_register(aten.select.int)
def _select(L, a):
    x = L.value(a["self"])
    dim = _dim(a["dim"], len(L.shape(x)))
    i = a["index"] % L.shape(x)[dim]
    return L.reshape(_slice(L, x, dim, i, i + 1), _out(L)[1])


@_register(aten.cat.default)
def _cat(L, a):
    dt, shape = _out(L)
    parts = [L.value(t, dt) for t in a["tensors"]]
    parts = [p for p in parts if L.shape(p) != (0,)]  # torch's legacy empty tensors join nothing
    dim = _dim(a.get("dim", 0), len(shape))
    parts = [p for p in parts if L.shape(p)[dim] != 0]
    if not parts:  # every piece empty: so is the result, a constant with no bytes
        return Const(torch.empty(shape, dtype=L.node.meta["val"].dtype), name=L.node.name)
    if len(parts) == 1:
        return parts[0]
    return L.emit("cat", parts, {"dim": dim}, dt, shape)


def _split_at(L, x, dim: int, sizes: Sequence[int]):
    outs, start = [], 0
    for i, n in enumerate(sizes):
        outs.append(_slice(L, x, dim, start, start + n, name=f"{L.node.name}.{i}"))
        start += n
    return tuple(outs)


@_register(aten.split_with_sizes.default)
def _split_with_sizes(L, a):
    x = L.value(a["self"])
    return _split_at(L, x, _dim(a.get("dim", 0), len(L.shape(x))), a["split_sizes"])


@_register(aten.constant_pad_nd.default)
def _pad(L, a):
    pads = [int(p) for p in a["pad"]]
    if any(p < 0 for p in pads):
        raise L.fail(f"negative padding {pads} (cropping) is not supported")
    x = L.value(a["self"])
    if not any(pads):
        return x
    dt, shape = _out(L)
    return L.emit("pad", [x], {"pads": pads, "value": float(a.get("value") or 0.0)}, dt, shape)


# ------------------------------------------------------------------------------ gathers

def _gather_rows(L, x_entry, dim: int, ids_entry, out_shape):
    """x.index_select(dim, ids) with ids of any shape, through ``embedding`` (rows of a 2-D view)."""
    xs = list(L.entry_shape(x_entry))
    x = L.value(x_entry)
    if not xs:  # a 0-d tensor is a 1-row table (torch accepts dim 0 or -1 and index 0)
        x, xs = L.reshape(x, [1]), [1]
    dim = _dim(dim, len(xs))
    if dim != 0:
        perm = [dim] + [d for d in range(len(xs)) if d != dim]
        x = L.emit("permute", [x], {"dims": perm}, L.dtype(x), [xs[d] for d in perm])
        xs = [xs[d] for d in perm]
    rest = xs[1:]
    inner = math.prod(rest)
    w = L.reshape(x, [xs[0], inner])
    ids = L.value(ids_entry, "int32")
    idshape = list(L.shape(ids))
    rows = L.emit("embedding", [w, ids], {}, L.dtype(w), idshape + [inner])
    y = L.reshape(rows, idshape + rest)
    if dim != 0:
        # y is [*ids, x dims except dim]; move the gathered dims back to where dim was
        k = len(idshape)
        before = list(range(k, k + dim))
        order = before + list(range(k)) + list(range(k + dim, k + len(rest)))
        ys = L.shape(y)
        y = L.emit("permute", [y], {"dims": order}, L.dtype(y), [ys[d] for d in order])
    return L.reshape(y, out_shape)


@_register(aten.embedding.default)
def _embedding(L, a):
    dt, shape = _out(L)
    return L.emit("embedding", [L.value(a["weight"]), L.value(a["indices"], "int32")], {}, dt, shape)


@_register(aten.index_select.default)
def _index_select(L, a):
    return _gather_rows(L, a["self"], a["dim"], a["index"], _out(L)[1])


@_register(aten.index.Tensor)
def _index(L, a):
    idx = list(a["indices"])
    used = [i for i, t in enumerate(idx) if t is not None]
    if len(used) != 1:
        raise L.fail(f"advanced indexing with {len(used)} index tensors; only one is supported")
    if L.entry_dtype(idx[used[0]]) == "bool":
        raise L.fail("boolean mask indexing has a data-dependent shape; use where() instead")
    return _gather_rows(L, a["self"], used[0], idx[used[0]], _out(L)[1])


# ------------------------------------------------------------------------------ matmul family

def _transposed_weight(b: Const) -> Const:
    """K x N constant -> its N x K transpose for ``linear``. For a weight that export transposed
    (``addmm(bias, x, permute(w))``) this is ``w`` itself, byte for byte, so the program stores the
    original weight once (constants are keyed by content)."""
    return Const(b.tensor.t().contiguous(), name=b.name)


def _matmul_entries(L, x, b, out_dt, out_shape, bias=None):
    if isinstance(b, Const) and b.tensor.dim() == 2 and len(L.entry_shape(x)) >= 1:
        return L.emit("linear", [L.value(x, out_dt), L.value(_transposed_weight(b), out_dt),
                                 None if bias is None else L.value(bias, out_dt)], {}, out_dt, out_shape)
    y = L.emit("matmul", [L.value(x, out_dt), L.value(b, out_dt)], {}, out_dt, out_shape)
    if bias is not None:
        y = L.emit("add", [y, L.value(bias, out_dt)], {}, out_dt, out_shape)
    return y


@_register(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _mm(L, a):
    dt, shape = _out(L)
    return _matmul_entries(L, a["self"], a["mat2"] if "mat2" in a else a["other"], dt, shape)


@_register(aten.addmm.default)
def _addmm(L, a):
    dt, shape = _out(L)
    bias, m1, m2 = a["self"], a["mat1"], a["mat2"]
    beta, alpha = a.get("beta", 1), a.get("alpha", 1)
    n = shape[-1]
    if beta == 1 and alpha == 1 and isinstance(m2, Const) and m2.tensor.dim() == 2 \
            and tuple(L.entry_shape(bias)) in ((n,), (1, n)):
        return _matmul_entries(L, m1, m2, dt, shape, bias=_const_reshape(L, bias, (n,)))
    y = _matmul_entries(L, m1, m2, dt, shape)
    if alpha != 1:
        y = L.emit("mul", [y, L.scalar(float(alpha), dt)], {}, dt, shape)
    if beta != 0:
        b = L.value(bias, dt)
        if beta != 1:
            b = L.emit("mul", [b, L.scalar(float(beta), dt)], {}, dt, L.shape(b))
        y = L.emit("add", [y, b], {}, dt, shape)
    return y


@_register(aten.linear.default)
def _linear(L, a):
    dt, shape = _out(L)
    bias = a.get("bias")
    return L.emit("linear", [L.value(a["input"], dt), L.value(a["weight"], dt),
                             None if bias is None else L.value(bias, dt)], {}, dt, shape)


# ------------------------------------------------------------------------------ conv and pooling

@_register(aten.convolution.default)
def _convolution(L, a):
    if a["transposed"]:
        raise L.fail("transposed convolution is not supported")
    dt, shape = _out(L)
    x, w, bias = a["input"], a["weight"], a.get("bias")
    rank = len(L.entry_shape(x))
    stride, padding, dilation = list(a["stride"]), list(a["padding"]), list(a["dilation"])
    if rank == 3:  # conv1d as a conv2d over a height of 1
        n, c, length = L.entry_shape(x)
        x = L.reshape(x, (n, c, 1, length), dt)
        w = _const_reshape(L, w, tuple(L.entry_shape(w)[:2]) + (1, L.entry_shape(w)[2]))
        stride, padding, dilation = [1] + stride, [0] + padding, [1] + dilation
        out4 = (shape[0], shape[1], 1, shape[2])
    elif rank == 4:
        out4 = shape
    else:
        raise L.fail(f"{rank - 2}-D convolution is not supported (conv1d and conv2d are)")
    y = L.emit("conv2d", [L.value(x, dt), L.value(w, dt), None if bias is None else L.value(bias, dt)],
               {"stride": _pair(stride, "stride", L), "padding": _pair(padding, "padding", L),
                "dilation": _pair(dilation, "dilation", L), "groups": int(a["groups"])}, dt, out4)
    return L.reshape(y, shape)


def _pool_input(L, x):
    s = L.entry_shape(x)
    if len(s) == 3:
        return L.reshape(x, (1,) + tuple(s)), True
    if len(s) != 4:
        raise L.fail(f"pooling over a {len(s)}-D tensor (expected [N,C,H,W] or [C,H,W])")
    return L.value(x), False


@_register(aten.max_pool2d_with_indices.default)
def _max_pool2d(L, a):
    dt, shape = _out(L, 0)
    x, squeeze = _pool_input(L, a["self"])
    kernel = _pair(a["kernel_size"], "kernel_size", L)
    stride = _pair(a["stride"], "stride", L) if a.get("stride") else kernel
    shape4 = (1,) + tuple(shape) if squeeze else shape
    y = L.emit("max_pool2d", [x], {"kernel": kernel, "stride": stride, "padding": _pair(a["padding"], "padding", L),
                                  "dilation": _pair(a["dilation"], "dilation", L), "ceil_mode": bool(a["ceil_mode"])},
               dt, shape4)
    return (L.reshape(y, shape), None)  # the indices output is not supported (None fails at use)


@_register(aten.avg_pool2d.default)
def _avg_pool2d(L, a):
    if a.get("divisor_override") is not None:
        raise L.fail("avg_pool2d divisor_override is not supported")
    dt, shape = _out(L)
    x, squeeze = _pool_input(L, a["self"])
    kernel = _pair(a["kernel_size"], "kernel_size", L)
    stride = _pair(a["stride"], "stride", L) if a.get("stride") else kernel
    shape4 = (1,) + tuple(shape) if squeeze else shape
    y = L.emit("avg_pool2d", [x], {"kernel": kernel, "stride": stride, "padding": _pair(a["padding"], "padding", L),
                                  "ceil_mode": bool(a["ceil_mode"]),
                                  "count_include_pad": bool(a["count_include_pad"])}, dt, shape4)
    return L.reshape(y, shape)


@_register(aten._adaptive_avg_pool2d.default)
def _adaptive_avg_pool2d(L, a):
    dt, shape = _out(L)
    x, squeeze = _pool_input(L, a["self"])
    n, c, h, w = L.shape(x)
    oh, ow = _pair(a["output_size"], "output_size", L)
    shape4 = (n, c, oh, ow)
    if (oh, ow) == (1, 1):
        y = L.emit("mean", [x], {"dims": [2, 3], "keepdim": True}, dt, shape4)
    elif h % oh == 0 and w % ow == 0:
        k = [h // oh, w // ow]
        y = L.emit("avg_pool2d", [x], {"kernel": k, "stride": k, "padding": [0, 0], "ceil_mode": False,
                                      "count_include_pad": True}, dt, shape4)
    else:
        raise L.fail(f"adaptive_avg_pool2d from {h}x{w} to {oh}x{ow}: only output sizes that divide the input "
                     f"are supported")
    return L.reshape(y, shape)


# ------------------------------------------------------------------------------ normalization

@_register(aten._native_batch_norm_legit_no_training.default)
def _batch_norm(L, a):
    dt, shape = _out(L, 0)
    opt = lambda k: None if a.get(k) is None else L.value(a[k], dt)
    y = L.emit("batch_norm", [L.value(a["input"], dt), L.value(a["running_mean"], dt), L.value(a["running_var"], dt),
                              opt("weight"), opt("bias")], {"eps": float(a["eps"])}, dt, shape)
    return (y, None, None)


@_register(aten.layer_norm.default)  # kept whole: see frontend.KEEP_WHOLE
def _layer_norm(L, a):
    dt, shape = _out(L)
    opt = lambda k: None if a.get(k) is None else L.value(a[k], dt)
    y = L.emit("layer_norm", [L.value(a["input"], dt), opt("weight"), opt("bias")],
               {"normalized_shape": [int(d) for d in a["normalized_shape"]],
                "eps": float(a["eps"]) if a.get("eps") is not None else 1e-5}, dt, shape)
    return y


@_register(aten.rms_norm.default)
def _rms_norm(L, a):
    dt, shape = _out(L)
    if len(a["normalized_shape"]) != 1:
        raise L.fail(f"rms_norm over {list(a['normalized_shape'])}: only the last dimension is supported")
    eps = a.get("eps")
    if eps is None:  # torch's default is the input dtype's machine epsilon
        eps = torch.finfo(torch.float16 if dt == "float16" else torch.float32).eps
    w = a.get("weight")
    return L.emit("rms_norm", [L.value(a["input"], dt), None if w is None else L.value(w, dt)],
                  {"eps": float(eps)}, dt, shape)


@_register(aten._softmax.default)
def _softmax(L, a):
    dt, shape = _out(L)
    return L.emit("softmax", [L.value(a["self"], dt)], {"dim": _dim(a["dim"], len(shape))}, dt, shape)


@_register(aten._log_softmax.default)
def _log_softmax(L, a):
    dt, shape = _out(L)
    return L.emit("log_softmax", [L.value(a["self"], dt)], {"dim": _dim(a["dim"], len(shape))}, dt, shape)


# ------------------------------------------------------------------------------ reductions

def _reduce(op):
    def handler(L, a):
        dt, shape = _out(L)
        x = L.value(a["self"], dt if op != "amax" else None)
        rank = len(L.shape(x))
        dims = a.get("dim")
        dims = list(range(rank)) if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0) else dims
        dims = [dims] if isinstance(dims, int) else list(dims)
        dims = sorted({_dim(d, rank) for d in dims})
        return L.emit(op, [x], {"dims": dims, "keepdim": bool(a.get("keepdim", False))}, dt, shape)
    return handler


_register(aten.mean.dim, aten.mean.default)(_reduce("mean"))
_register(aten.sum.dim_IntList)(_reduce("sum"))
_register(aten.amax.default)(_reduce("amax"))
_register(aten.max.default)(_reduce("amax"))  # torch.max(x): the maximum of every element (NaN propagates)


@_register(aten.argmax.default)
def _argmax(L, a):
    dt, shape = _out(L)
    x = L.value(a["self"])
    if a.get("dim") is None:
        flat = L.reshape(x, (math.prod(L.shape(x)),))
        y = L.emit("argmax", [flat], {"dim": 0, "keepdim": False}, "int32", ())
        return L.reshape(y, shape)
    return L.emit("argmax", [x], {"dim": _dim(a["dim"], len(L.shape(x))), "keepdim": bool(a.get("keepdim"))},
                  "int32", shape)


@_register(aten.max.dim)
def _max_dim(L, a):
    dt, shape = _out(L, 0)
    x = L.value(a["self"])
    dim, keep = _dim(a["dim"], len(L.shape(x))), bool(a.get("keepdim"))
    values = L.emit("amax", [x], {"dims": [dim], "keepdim": keep}, dt, shape)
    idx = L.emit("argmax", [x], {"dim": dim, "keepdim": keep}, "int32", shape)
    return (values, idx)


# ------------------------------------------------------------------------------ attention

@_register(aten.scaled_dot_product_attention.default)
def _sdpa(L, a):
    if a.get("dropout_p"):
        raise L.fail(f"dropout_p={a['dropout_p']} in attention: export in eval mode with dropout 0")
    dt, shape = _out(L)
    q, k, v = (L.value(a[n], dt) for n in ("query", "key", "value"))
    # torch takes [..., H, T, D] operands whose leading dims broadcast (a 3-D query against 4-D
    # keys, one head against many); the op set's sdpa is [B, H, T, D] with one B and H a multiple
    # of Hk: pad every operand to rank 4, then expand a batch or query-head dim of size 1.
    names = ("query", "key", "value")
    ranks = [len(L.shape(t)) for t in (q, k, v)]
    for n, r in zip(names, ranks):
        if not 2 <= r <= 4:
            raise L.fail(f"attention: argument {n!r} is {r}-D {list(L.shape(dict(zip(names, (q, k, v)))[n]))}; "
                         f"the op set's sdpa takes [T, D], [H, T, D] or [B, H, T, D] (merge further batch dims "
                         f"into B first)")
    q, k, v = (L.reshape(t, (1,) * (4 - r) + L.shape(t)) for t, r in zip((q, k, v), ranks))
    B = max(L.shape(t)[0] for t in (q, k, v))
    hq, hk = L.shape(q)[1], L.shape(k)[1]

    def expand(t, dim, size):
        s = list(L.shape(t))
        if s[dim] == size:
            return t
        s[dim] = size
        return L.emit("expand", [t], {"shape": s}, dt, s)

    q, k, v = (expand(t, 0, B) for t in (q, k, v))
    if hq == 1 and hk > 1:  # one query head against many key heads: torch broadcasts it
        q, hq = expand(q, 1, hk), hk
    mask = a.get("attn_mask")
    if mask is not None:
        mask = L.value(mask, "bool" if L.entry_dtype(mask) == "bool" else dt)
        if len(L.shape(mask)) > 4:
            raise L.fail(f"attention: attn_mask is {len(L.shape(mask))}-D {list(L.shape(mask))}; it must broadcast "
                         f"to the scores [B, H, Tq, Tk]")
    attrs = {"causal": bool(a.get("is_causal"))}
    if a.get("scale") is not None:
        attrs["scale"] = float(a["scale"])
    out4 = (B, hq, L.shape(q)[2], L.shape(v)[3])
    y = L.emit("sdpa", [q, k, v, mask], attrs, dt, out4)
    return L.reshape(y, shape)


@_register(torch.ops.gpudelegate.kv_update.default)
def _kv_update(L, a):
    dt, shape = _out(L)
    return L.emit("kv_update", [L.value(a["cache"], dt), L.value(a["new"], dt), L.value(a["pos"], "int32")], {}, dt, shape)


@_register(torch.ops.gpudelegate.rope.default)
def _rope(L, a):
    dt, shape = _out(L)
    return L.emit("rope", [L.value(a[n], dt) for n in ("x", "cos", "sin")], {}, dt, shape)


# ------------------------------------------------------------------------------ shape-only constants

@_register(aten.full_like.default)
def _full_like(L, a):
    """A filled tensor shaped like a computed value is still a constant: its values never depend
    on the input's values (ones_like/zeros_like decompose to this)."""
    dt, shape = _out(L)
    return Const(torch.full(shape, a["fill_value"], dtype=L.node.meta["val"].dtype), name=L.node.name)
