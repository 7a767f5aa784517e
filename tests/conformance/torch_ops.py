"""Every op of the op set written with eager PyTorch, in float64: what the golden answers of the
conformance suite (the reference kernels) are held to (test_conformance.test_golden_matches_torch).

``TORCH[op](args, attrs)`` takes torch tensors (float64, int32, bool; None for an absent optional)
and the node's attributes resolved by ``ops.normalize_attrs`` (non-negative dims, concrete shapes,
clamped slice bounds, the sdpa scale). Ops PyTorch has whole map to that function; the op set's
composites (rope, kv_update, sdpa's causal_offset) are spelled out with PyTorch ops.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_DT = {"float32": torch.float32, "float16": torch.float16, "int32": torch.int32, "bool": torch.bool}


def _f64(x):
    return x.to(torch.float64) if x.dtype != torch.float64 else x


def _binary(fn):
    def run(args, attrs):
        a, b = args
        if a.is_floating_point() or b.is_floating_point():
            a, b = _f64(a), _f64(b)
        return fn(a, b)
    return run


def _div(args, attrs):
    a, b = args
    return torch.div(_f64(a), _f64(b))  # true division: int32 / int32 is a float result


def _int_ok_unary(fn):
    def run(args, attrs):
        (x,) = args
        return fn(x if x.dtype == torch.int32 else _f64(x))
    return run


def _unary(fn):
    return lambda args, attrs: fn(_f64(args[0]))


def _cast(args, attrs):
    (x,) = args
    to = attrs["dtype"]
    if to == "float32" and x.dtype == torch.float64:
        return x  # the golden keeps float64 (the device's float32 rounding is what is compared)
    return x.to(_DT[to])


def _linear(args, attrs):
    x, w, b = args
    return F.linear(_f64(x), _f64(w), None if b is None else _f64(b))


def _conv2d(args, attrs):
    x, w, b = args
    return F.conv2d(_f64(x), _f64(w), None if b is None else _f64(b), attrs["stride"], attrs["padding"],
                    attrs["dilation"], attrs["groups"])


def _max_pool2d(args, attrs):
    return F.max_pool2d(_f64(args[0]), attrs["kernel"], attrs["stride"], attrs["padding"], attrs["dilation"],
                        attrs["ceil_mode"])


def _avg_pool2d(args, attrs):
    return F.avg_pool2d(_f64(args[0]), attrs["kernel"], attrs["stride"], attrs["padding"], attrs["ceil_mode"],
                        attrs["count_include_pad"])


def _batch_norm(args, attrs):
    x, m, v, w, b = [None if a is None else _f64(a) for a in args]
    return F.batch_norm(x, m, v, w, b, training=False, eps=attrs["eps"])


def _layer_norm(args, attrs):
    x, w, b = [None if a is None else _f64(a) for a in args]
    return F.layer_norm(x, attrs["normalized_shape"], w, b, attrs["eps"])


def _rms_norm(args, attrs):
    x, w = [None if a is None else _f64(a) for a in args]
    return F.rms_norm(x, [x.shape[-1]], w, attrs["eps"])


def _reduce(fn):
    def run(args, attrs):
        x = args[0]
        if x.is_floating_point():
            x = _f64(x)
        dims = attrs["dims"] or list(range(x.ndim))
        if fn is torch.sum and x.dtype == torch.int32:
            return torch.sum(x, dim=dims, keepdim=attrs["keepdim"], dtype=torch.int32)
        return fn(x, dim=dims, keepdim=attrs["keepdim"])
    return run


def _argmax(args, attrs):
    x = args[0]
    return torch.argmax(_f64(x) if x.is_floating_point() else x, dim=attrs["dim"],
                        keepdim=attrs["keepdim"]).to(torch.int32)


def _slice(args, attrs):
    x = args[0]
    idx = [slice(None)] * x.ndim
    idx[attrs["dim"]] = slice(attrs["start"], attrs["end"], attrs["step"])
    return x[tuple(idx)]


def _cat(args, attrs):
    xs = [(_f64(a) if a.is_floating_point() else a) for a in args]
    return torch.cat(xs, dim=attrs["dim"])


def _pad(args, attrs):
    x = args[0]
    if x.is_floating_point():
        x = _f64(x)
    value = attrs["value"] if x.is_floating_point() else int(attrs["value"])
    return F.pad(x, attrs["pads"], value=value)


def _rope(args, attrs):
    x, cos, sin = (_f64(a) for a in args)
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rot * sin


def _sdpa(args, attrs):
    q, k, v, mask = args
    q, k, v = _f64(q), _f64(k), _f64(v)
    tq, tk = q.shape[-2], k.shape[-2]
    if attrs["causal"]:
        # keep key j <= i + causal_offset (top-left aligned when the offset is 0, as is_causal)
        keep = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + attrs["causal_offset"]
        if mask is None:
            mask = keep
        elif mask.dtype == torch.bool:
            mask = mask & keep
        else:
            mask = _f64(mask).masked_fill(~keep, float("-inf"))
    elif mask is not None and mask.is_floating_point():
        mask = _f64(mask)
    if mask is not None and mask.ndim < 2:
        # torch wants a mask of rank >= 2; a 0-d or 1-d one broadcasts the same once expanded
        mask = mask.expand(q.shape[:-1] + (tk,))
    # PyTorch's math backend is its definition of the op. The fused CPU kernels it may pick instead
    # (by CPU and build) return zeros for a row whose scores hold a NaN, where the definition (and
    # IEEE arithmetic, and every executor here) gives NaN.
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attrs["scale"],
                                              enable_gqa=q.shape[1] != k.shape[1])


def _kv_update(args, attrs):
    cache, new, pos = args
    p = int(pos.reshape(-1)[0])
    out = _f64(cache).clone()
    out[:, :, p:p + new.shape[2]] = _f64(new)
    return out


TORCH: Dict[str, Callable] = {
    "add": _binary(torch.add), "sub": _binary(torch.sub), "mul": _binary(torch.mul), "div": _div,
    "pow": _binary(torch.pow), "maximum": _binary(torch.maximum), "minimum": _binary(torch.minimum),
    "eq": _binary(torch.eq), "ne": _binary(torch.ne), "lt": _binary(torch.lt), "le": _binary(torch.le),
    "gt": _binary(torch.gt), "ge": _binary(torch.ge),
    "logical_and": lambda a, _: torch.logical_and(*a), "logical_or": lambda a, _: torch.logical_or(*a),
    "logical_not": lambda a, _: torch.logical_not(a[0]),
    "where": lambda a, _: torch.where(a[0], *[(_f64(x) if x.is_floating_point() else x) for x in a[1:]]),
    "neg": _int_ok_unary(torch.neg), "abs": _int_ok_unary(torch.abs), "relu": _int_ok_unary(torch.relu),
    "exp": _unary(torch.exp), "log": _unary(torch.log), "sqrt": _unary(torch.sqrt), "rsqrt": _unary(torch.rsqrt),
    "sin": _unary(torch.sin), "cos": _unary(torch.cos), "tanh": _unary(torch.tanh), "sigmoid": _unary(torch.sigmoid),
    "silu": _unary(F.silu), "erf": _unary(torch.erf), "reciprocal": _unary(torch.reciprocal),
    "gelu": lambda a, at: F.gelu(_f64(a[0]), approximate=at["approximate"]),
    "hardtanh": lambda a, at: F.hardtanh(_f64(a[0]), at["min_val"], at["max_val"]),
    "cast": _cast,
    "matmul": lambda a, _: torch.matmul(_f64(a[0]), _f64(a[1])),
    "linear": _linear, "conv2d": _conv2d, "max_pool2d": _max_pool2d, "avg_pool2d": _avg_pool2d,
    "batch_norm": _batch_norm, "layer_norm": _layer_norm, "rms_norm": _rms_norm,
    "softmax": lambda a, at: torch.softmax(_f64(a[0]), at["dim"]),
    "log_softmax": lambda a, at: torch.log_softmax(_f64(a[0]), at["dim"]),
    "sum": _reduce(torch.sum), "mean": _reduce(torch.mean), "amax": _reduce(torch.amax), "argmax": _argmax,
    "embedding": lambda a, _: F.embedding(a[1].long(), _f64(a[0])),
    "reshape": lambda a, at: a[0].reshape(at["shape"]), "permute": lambda a, at: a[0].permute(at["dims"]),
    "expand": lambda a, at: a[0].expand(at["shape"]), "slice": _slice, "cat": _cat, "pad": _pad,
    "copy": lambda a, _: a[0].clone(), "rope": _rope, "sdpa": _sdpa, "kv_update": _kv_update,
}
