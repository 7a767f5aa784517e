"""The golden kernels: one numpy function per op of docs/OPS.md (``delegate`` excepted).

``KERNELS[op](args, attrs) -> [np.ndarray]``: ``args`` are numpy arrays (None for an absent
optional argument), ``attrs`` the node's attributes as written in the program (defaults and
shape-dependent values are resolved here through :func:`gpudelegate.ops.normalize_attrs`, which
also validates them, so a bad node fails with the same PayloadError everywhere).

Precision is chosen by the arguments, so one kernel serves both uses:

- storage mode (float32/float16 arrays, what the reference executor and the host runner pass):
  float ops compute in float32 whatever the storage, and results are narrowed back to float16
  when every float argument was float16 (docs/OPS.md);
- golden mode (float64 arrays, what the conformance suite passes): everything computes and
  returns in float64, so executor results are compared with the exact answer, not with another
  float32 rounding of it.

Booleans may arrive as numpy bool or as their uint32 0/1 storage; bool results are numpy bool.
int64 ids are accepted (narrowed by the caller's storage conversion).
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Dict, List, Optional

import numpy as np

from gpudelegate import ops as _ops
from gpudelegate.errors import InputError

from .quant import PackedWeight

Kernel = Callable[[List[Optional[np.ndarray]], dict], List[np.ndarray]]
KERNELS: Dict[str, Kernel] = {}

_NP_TO_DTYPE = {"float64": "float32", "float32": "float32", "float16": "float16", "int32": "int32",
                "int64": "int32", "bool": "bool", "uint32": "bool"}


class _Spec:
    """An argument as ops.normalize_attrs sees it (dtype name + shape)."""

    __slots__ = ("dtype", "shape")

    def __init__(self, a: np.ndarray):
        if isinstance(a, PackedWeight):  # its dtype is already a program dtype (q4_0, ...)
            self.dtype, self.shape = a.dtype, a.shape
            return
        name = a.dtype.name
        if name not in _NP_TO_DTYPE:
            raise InputError(f"array of dtype {name} has no gpudelegate dtype")
        self.dtype = _NP_TO_DTYPE[name]
        self.shape = a.shape


def _prep(a):
    """Widen float16 to float32 (compute type), give bool storage its numpy bool form."""
    if a is None or isinstance(a, PackedWeight):  # blocks stay packed until the kernel decodes them
        return a
    a = np.asarray(a)
    if a.dtype == np.float16:
        return a.astype(np.float32)
    if a.dtype == np.uint32:
        return a != 0
    if a.dtype == np.int64:
        return a.astype(np.int32)
    return a


def _store_float(args) -> type:
    """Float storage of a result: float64 in golden mode, float16 only when every float argument
    was float16, float32 otherwise (also for float results of integer inputs, like int / int)."""
    # a packed weight decodes to float32: it leaves the choice to the other arguments
    fl = [a.dtype for a in args if a is not None and not isinstance(a, PackedWeight) and a.dtype.kind == "f"]
    if any(d == np.float64 for d in fl):
        return np.float64
    if fl and all(d == np.float16 for d in fl):
        return np.float16
    return np.float32


def _compute_float(args) -> type:
    return np.float64 if _store_float(args) == np.float64 else np.float32


def kernel(*names: str, cast_floats: bool = True):
    """Register ``fn(args, attrs, ct)`` for ``names``; ``ct`` is the float compute type. The
    wrapper resolves attrs, widens float16 inputs and narrows float outputs to storage."""

    def deco(fn):
        for name in names:
            def run(args, attrs, _fn=fn, _name=name):
                raw = [a if a is None or isinstance(a, PackedWeight) else np.asarray(a) for a in args]
                mx = _ops.get(_name).max_args
                if mx is not None and len(raw) < mx:
                    raw += [None] * (mx - len(raw))  # trailing optionals may be left out
                full = _ops.normalize_attrs(_name, attrs, [None if a is None else _Spec(a) for a in raw])
                store = _store_float(raw)
                ct = _compute_float(raw)
                # NaN and inf are results like any other (IEEE 754), the mean of nothing is NaN.
                with np.errstate(all="ignore"), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    outs = _fn(_name, [_prep(a) for a in raw], full, ct)
                if cast_floats:
                    outs = [o.astype(store, copy=False) if o.dtype.kind == "f" else o for o in outs]
                return [np.asarray(o, order="C") for o in outs]  # (ascontiguousarray would make 0-d 1-d)

            run.__name__ = f"kernel_{name}"
            KERNELS[name] = run
        return fn

    return deco


def _f(a, ct):
    if isinstance(a, PackedWeight):  # linear's weight: gguf's float32 values, then the compute type
        return a.dequantize().astype(ct, copy=False)
    return a.astype(ct, copy=False)


# --------------------------------------------------------------------------- elementwise

_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "maximum": np.maximum, "minimum": np.minimum,
}


@kernel("add", "sub", "mul", "maximum", "minimum")
def _binary(op, args, attrs, ct):
    a, b = args
    if a.dtype == np.int32 and b.dtype == np.int32:
        return [_BINARY[op](a, b).astype(np.int32)]
    return [_BINARY[op](_f(a, ct), _f(b, ct))]


@kernel("div")
def _div(op, args, attrs, ct):
    a, b = args
    with np.errstate(divide="ignore", invalid="ignore"):
        return [np.divide(_f(a, ct), _f(b, ct))]


@kernel("pow")
def _pow(op, args, attrs, ct):
    a, b = args
    if a.dtype == np.int32 and b.dtype == np.int32:
        # torch semantics for negative integer exponents: 1 / a**|b| truncated (0 unless |a| == 1);
        # numpy refuses them outright.
        a, b = np.broadcast_arrays(a, b)
        neg = b < 0
        out = np.power(a, np.where(neg, 0, b)).astype(np.int32)
        inv = np.where(a == 1, 1, np.where(a == -1, np.where(b % 2 == 0, 1, -1), 0)).astype(np.int32)
        return [np.where(neg, inv, out)]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return [np.power(_f(a, ct), _f(b, ct))]


_COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal}


@kernel("eq", "ne", "lt", "le", "gt", "ge")
def _compare(op, args, attrs, ct):
    a, b = args
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        a, b = _f(a, ct), _f(b, ct)
    return [_COMPARE[op](a, b)]


@kernel("logical_and", "logical_or", "logical_not")
def _logical(op, args, attrs, ct):
    if op == "logical_not":
        return [np.logical_not(args[0])]
    fn = np.logical_and if op == "logical_and" else np.logical_or
    return [fn(args[0], args[1])]


@kernel("where")
def _where(op, args, attrs, ct):
    c, a, b = args
    if a.dtype.kind == "f":
        a, b = _f(a, ct), _f(b, ct)
    return [np.where(c, a, b).astype(a.dtype, copy=False)]


def _sigmoid(x):
    # Split by sign so exp never overflows (exp(-x) for x << 0 would be inf).
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype, copy=False)


# math.erf is libm's correctly rounded-in-double erf; numpy has none and scipy is not a
# dependency. frompyfunc costs ~0.1 us/element, fine for a reference.
_erf_obj = np.frompyfunc(math.erf, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    # (np.asarray: a 0-d argument gives a Python float back)
    return np.asarray(_erf_obj(x.astype(np.float64)), dtype=np.float64).astype(x.dtype)


_UNARY = {
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "sin": np.sin, "cos": np.cos, "tanh": np.tanh, "sigmoid": _sigmoid,
    "silu": lambda x: x * _sigmoid(x), "erf": erf, "reciprocal": lambda x: 1.0 / x,
}


@kernel("neg", "abs", "relu")
def _int_unary(op, args, attrs, ct):
    (x,) = args
    if x.dtype.kind == "f":
        x = _f(x, ct)
    if op == "neg":
        return [np.negative(x)]
    if op == "abs":
        return [np.abs(x)]
    return [np.maximum(x, x.dtype.type(0))]


@kernel(*_UNARY)
def _unary(op, args, attrs, ct):
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return [_UNARY[op](_f(args[0], ct))]


@kernel("gelu")
def _gelu(op, args, attrs, ct):
    x = _f(args[0], ct)
    if attrs["approximate"] == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
        return [0.5 * x * (1.0 + np.tanh(inner))]
    return [0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))]


@kernel("hardtanh")
def _hardtanh(op, args, attrs, ct):
    return [np.clip(_f(args[0], ct), attrs["min_val"], attrs["max_val"])]


@kernel("cast", cast_floats=False)
def _cast(op, args, attrs, ct):
    (x,) = args
    to = attrs["dtype"]
    if to == "bool":
        return [x != 0]
    if to == "int32":
        if x.dtype.kind == "f":
            with np.errstate(invalid="ignore"):
                return [np.trunc(x).astype(np.int32)]  # toward zero, as C and torch do
        return [x.astype(np.int32)]
    if to == "float16":
        return [x.astype(np.float16)]
    # float32: golden mode keeps float64 (a float32 rounding is what the executor is compared to)
    return [x.astype(np.float64 if x.dtype == np.float64 else np.float32)]


# --------------------------------------------------------------------------- linear algebra

@kernel("matmul")
def _matmul(op, args, attrs, ct):
    return [np.matmul(_f(args[0], ct), _f(args[1], ct))]


@kernel("linear")
def _linear(op, args, attrs, ct):
    x, w, b = args
    y = np.matmul(_f(x, ct), _f(w, ct).T)
    if b is not None:
        y = y + _f(b, ct)
    return [y]


def _windows(xp: np.ndarray, ho: int, wo: int, k, s, dil):
    """Yield (i, j, patch[N, C, Ho, Wo]) for every kernel tap of a padded input."""
    for i in range(k[0]):
        for j in range(k[1]):
            r0, c0 = i * dil[0], j * dil[1]
            yield i, j, xp[:, :, r0:r0 + s[0] * (ho - 1) + 1:s[0], c0:c0 + s[1] * (wo - 1) + 1:s[1]]


def _pad_hw(x, top, bottom, left, right, value):
    return np.pad(x, ((0, 0), (0, 0), (top, max(bottom, 0)), (left, max(right, 0))), constant_values=value)


@kernel("conv2d")
def _conv2d(op, args, attrs, ct):
    x, w, b = (None if a is None else _f(a, ct) for a in args)
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    g = attrs["groups"]
    (sh, sw), (ph, pw), (dh, dw) = attrs["stride"], attrs["padding"], attrs["dilation"]
    (_, (_, _, ho, wo)), = _ops.infer("conv2d", [_Spec(args[0]), _Spec(args[1]), None], attrs)
    xp = _pad_hw(x, ph, ph, pw, pw, 0.0)
    out = np.zeros((n, g, o // g, ho, wo), dtype=ct)
    xg = xp.reshape(n, g, cg, xp.shape[2], xp.shape[3])
    wg = w.reshape(g, o // g, cg, kh, kw)
    for i in range(kh):
        for j in range(kw):
            r0, c0 = i * dh, j * dw
            patch = xg[:, :, :, r0:r0 + sh * (ho - 1) + 1:sh, c0:c0 + sw * (wo - 1) + 1:sw]
            out += np.einsum("ngchw,goc->ngohw", patch, wg[:, :, :, i, j])
    out = out.reshape(n, o, ho, wo)
    if b is not None:
        out = out + b.reshape(1, o, 1, 1)
    return [out]


def _pool_geometry(x, attrs, op):
    (_, shape), = _ops.infer(op, [_Spec(x)], attrs)
    ho, wo = shape[2], shape[3]
    k, s, p = attrs["kernel"], attrs["stride"], attrs["padding"]
    dil = attrs.get("dilation", [1, 1])
    # ceil_mode windows may run past the right padding: pad enough to index them.
    need_h = (ho - 1) * s[0] + dil[0] * (k[0] - 1) + 1
    need_w = (wo - 1) * s[1] + dil[1] * (k[1] - 1) + 1
    extra_h = max(0, need_h - (x.shape[2] + 2 * p[0]))
    extra_w = max(0, need_w - (x.shape[3] + 2 * p[1]))
    return ho, wo, k, s, p, dil, extra_h, extra_w


@kernel("max_pool2d")
def _max_pool2d(op, args, attrs, ct):
    x = _f(args[0], ct)
    ho, wo, k, s, p, dil, eh, ew = _pool_geometry(x, attrs, op)
    xp = _pad_hw(x, p[0], p[0] + eh, p[1], p[1] + ew, -np.inf)
    out = np.full(x.shape[:2] + (ho, wo), -np.inf, dtype=ct)
    for _, _, patch in _windows(xp, ho, wo, k, s, dil):
        np.maximum(out, patch, out=out)
    return [out]


def _avg_divisor(size, out, k, s, p, include_pad):
    # torch (AvgPool2d): the window [o*s - p, o*s - p + k) is first cut at size + p (the right
    # padding edge; ceil_mode overhang never counts), then at the input for count_include_pad=False.
    start = np.arange(out) * s - p
    end = np.minimum(start + k, size + p)
    if include_pad:
        return end - start
    return np.minimum(end, size) - np.maximum(start, 0)


@kernel("avg_pool2d")
def _avg_pool2d(op, args, attrs, ct):
    x = _f(args[0], ct)
    ho, wo, k, s, p, dil, eh, ew = _pool_geometry(x, attrs, op)
    xp = _pad_hw(x, p[0], p[0] + eh, p[1], p[1] + ew, 0.0)
    acc = np.zeros(x.shape[:2] + (ho, wo), dtype=ct)
    for _, _, patch in _windows(xp, ho, wo, k, s, dil):
        acc += patch
    dh = _avg_divisor(x.shape[2], ho, k[0], s[0], p[0], attrs["count_include_pad"])
    dw = _avg_divisor(x.shape[3], wo, k[1], s[1], p[1], attrs["count_include_pad"])
    return [acc / (dh[:, None] * dw[None, :]).astype(ct)]


# --------------------------------------------------------------------------- normalization

@kernel("batch_norm")
def _batch_norm(op, args, attrs, ct):
    x, mean, var, w, b = (None if a is None else _f(a, ct) for a in args)
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    # torch's inference form: y = x * alpha + beta with alpha = w / sqrt(var + eps) and
    # beta = b - mean * alpha. It rounds like (x - mean) * alpha + b, but not where alpha is
    # infinite: there torch gives inf - inf = NaN, and so must we.
    alpha = 1.0 / np.sqrt(var + attrs["eps"])
    if w is not None:
        alpha = alpha * w
    beta = -mean * alpha
    if b is not None:
        beta = beta + b
    return [x * alpha.reshape(shape) + beta.reshape(shape)]


@kernel("layer_norm")
def _layer_norm(op, args, attrs, ct):
    x, w, b = (None if a is None else _f(a, ct) for a in args)
    axes = tuple(range(x.ndim - len(attrs["normalized_shape"]), x.ndim))
    mu = x.mean(axis=axes, keepdims=True)
    d = x - mu
    var = (d * d).mean(axis=axes, keepdims=True)  # biased, as torch
    y = d / np.sqrt(var + attrs["eps"])
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return [y]


@kernel("rms_norm")
def _rms_norm(op, args, attrs, ct):
    x, w = (None if a is None else _f(a, ct) for a in args)
    y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + attrs["eps"])
    if w is not None:
        y = y * w
    return [y]


@kernel("softmax", "log_softmax")
def _softmax(op, args, attrs, ct):
    x = _f(args[0], ct)
    dim = attrs["dim"]
    # initial=-inf: an empty dim has no maximum (and no output elements); NaN still propagates.
    m = x.max(axis=dim, keepdims=True, initial=-np.inf) if x.ndim else x
    with np.errstate(invalid="ignore"):
        z = x - m
        e = np.exp(z)
        s = e.sum(axis=dim, keepdims=True) if x.ndim else e
        if op == "softmax":
            return [e / s]
        return [z - np.log(s)]


# --------------------------------------------------------------------------- reductions

@kernel("sum", "mean", "amax")
def _reduce(op, args, attrs, ct):
    x = args[0]
    axes = tuple(attrs["dims"])
    if x.dtype.kind == "f":
        x = _f(x, ct)
    if op == "sum":
        y = np.sum(x, axis=axes, keepdims=attrs["keepdim"])
        return [y.astype(np.int32) if x.dtype == np.int32 else y]  # numpy widens int sums to int64
    if op == "mean":
        return [np.mean(x, axis=axes, keepdims=attrs["keepdim"])]
    return [np.amax(x, axis=axes, keepdims=attrs["keepdim"])]


@kernel("argmax")
def _argmax(op, args, attrs, ct):
    x = args[0]
    if x.ndim == 0:
        return [np.zeros((), np.int32)]
    # numpy and torch both return the first maximal index (and the first NaN if any).
    y = np.argmax(x, axis=attrs["dim"]).astype(np.int32)
    if attrs["keepdim"]:
        y = np.expand_dims(y, attrs["dim"])
    return [y]


# --------------------------------------------------------------------------- indexing and layout

@kernel("embedding")
def _embedding(op, args, attrs, ct):
    w, ids = args
    v = w.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= v):
        bad = ids[(ids < 0) | (ids >= v)].ravel()[0]
        raise InputError(f"embedding: id {int(bad)} out of range for a {v}-row table (0..{v - 1})")
    if isinstance(w, PackedWeight):  # decode only the gathered rows
        return [w.rows(ids).astype(ct, copy=False)]
    return [_f(w, ct)[ids]]


@kernel("reshape")
def _reshape(op, args, attrs, ct):
    return [args[0].reshape(attrs["shape"])]


@kernel("permute")
def _permute(op, args, attrs, ct):
    return [np.transpose(args[0], attrs["dims"])]


@kernel("expand")
def _expand(op, args, attrs, ct):
    return [np.broadcast_to(args[0], attrs["shape"])]


@kernel("slice")
def _slice(op, args, attrs, ct):
    x = args[0]
    idx = [slice(None)] * x.ndim
    idx[attrs["dim"]] = slice(attrs["start"], attrs["end"], attrs["step"])
    return [x[tuple(idx)]]


@kernel("cat")
def _cat(op, args, attrs, ct):
    if args[0].dtype.kind == "f":
        args = [_f(a, ct) for a in args]
    return [np.concatenate(args, axis=attrs["dim"])]


@kernel("pad")
def _pad(op, args, attrs, ct):
    x = args[0]
    if x.dtype.kind == "f":
        x = _f(x, ct)
    pads = attrs["pads"]
    widths = [(0, 0)] * x.ndim
    crop = [slice(None)] * x.ndim
    for j in range(len(pads) // 2):
        dim = x.ndim - 1 - j
        lo, hi = pads[2 * j], pads[2 * j + 1]
        widths[dim] = (max(lo, 0), max(hi, 0))
        # Negative pads crop (torch constant_pad_nd).
        crop[dim] = slice(-lo if lo < 0 else 0, x.shape[dim] + hi if hi < 0 else None)
    x = x[tuple(crop)]
    value = attrs["value"]
    if x.dtype == np.int32:
        value = int(value)
    elif x.dtype == np.bool_:
        value = bool(value)
    return [np.pad(x, widths, constant_values=value)]


@kernel("copy")
def _copy(op, args, attrs, ct):
    return [np.array(args[0], copy=True)]


# --------------------------------------------------------------------------- attention

def rotate_half(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


@kernel("rope")
def _rope(op, args, attrs, ct):
    x, cos, sin = (_f(a, ct) for a in args)
    return [x * cos + rotate_half(x) * sin]


@kernel("sdpa")
def _sdpa(op, args, attrs, ct):
    q, k, v, mask = args
    q, k, v = _f(q, ct), _f(k, ct), _f(v, ct)
    h, hk = q.shape[1], k.shape[1]
    if h != hk:  # grouped-query: query head i uses key/value head i // (H / Hk)
        k = np.repeat(k, h // hk, axis=1)
        v = np.repeat(v, h // hk, axis=1)
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * ct(attrs["scale"])
    tq, tk = scores.shape[-2:]
    if attrs["causal"]:
        keep = np.arange(tk)[None, :] <= np.arange(tq)[:, None] + attrs["causal_offset"]
        scores = np.where(keep, scores, -np.inf)
    if mask is not None:
        if mask.dtype == np.bool_:
            scores = np.where(mask, scores, -np.inf)
        else:
            scores = scores + _f(mask, ct)
    # A fully masked row (every key dropped, or every score -inf) gives zeros: torch 2.13's
    # F.scaled_dot_product_attention (aten.scaled_dot_product_attention, the op export lowers to
    # sdpa) returns 0 there, float32 and float16, bool or float -inf mask (its math path uses
    # _safe_softmax), where a plain softmax of an all -inf row is NaN (the softmax op keeps that).
    # A NaN score still makes its row NaN.
    with np.errstate(invalid="ignore"):
        m = scores.max(axis=-1, keepdims=True, initial=-np.inf)  # no keys (Tk = 0): a dead row
        dead = m == -np.inf
        e = np.exp(scores - np.where(dead, 0.0, m))  # exp(-inf) = 0 in a dead row
        p = e / np.where(dead, 1.0, e.sum(axis=-1, keepdims=True))
    return [np.matmul(p, v)]


@kernel("kv_update")
def _kv_update(op, args, attrs, ct):
    cache, new, pos = args
    p = int(np.asarray(pos).reshape(-1)[0])
    s, t = cache.shape[2], new.shape[2]
    if p < 0 or p + t > s:
        raise InputError(f"kv_update: rows {p}..{p + t - 1} do not fit a cache of {s} rows")
    out = np.array(cache, copy=True)
    out[:, :, p:p + t] = new
    return [out]


_missing = set(_ops.KERNEL_OPS) - set(KERNELS)
assert not _missing, f"reference kernels missing for {sorted(_missing)}"
