"""Lowering of the map-like ops: elementwise ops and casts, copies, reshape, permute, expand,
slice, cat, pad, kv_update, the embedding gather and rope (pure Python)."""

from __future__ import annotations

from ..plan.types import Dispatch
from .kernel import (DT_CODE, _bcast, _contig, _flat_out, _full, _grid, _Lowering, _numel, _T, _u32, _View,
                     lowers)

# ------------------------------------------------------------------------------------------ elementwise

_MAP_DIRECT = {"add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
               "logical_and", "logical_or", "logical_not", "where", "neg", "abs", "exp", "log", "sqrt",
               "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu", "silu", "erf", "reciprocal", "gelu",
               "hardtanh", "cast", "copy"}


@lowers(*sorted(_MAP_DIRECT))
def _elementwise(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    o = d.outputs[0]
    op = d.op
    fa = fb = 0.0
    if op == "cast":
        op = "copy"
    elif op == "gelu" and attrs["approximate"] == "tanh":
        op = "gelu_tanh"
    elif op == "hardtanh":
        fa, fb = attrs["min_val"], attrs["max_val"]
    ins = [_View(_T.of(a), 0, _bcast(a.shape, o.shape)) for a in d.args]
    lw.map(op, _full(_T.of(o), o.shape), ins, o.shape, fa, fb)


@lowers("reshape")
def _reshape(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x, o = _T.of(d.args[0]), _T.of(d.outputs[0])
    if not x.same_place(o):  # the plan did not alias them: copy
        lw.copy_tensor(x, o, d.outputs[0].shape)


@lowers("permute")
def _permute(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x, o = d.args[0], d.outputs[0]
    st = _contig(x.shape)
    lw.map("copy", _full(_T.of(o), o.shape), [_View(_T.of(x), 0, [st[i] for i in attrs["dims"]])], o.shape)


@lowers("expand")
def _expand(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x, o = d.args[0], d.outputs[0]
    lw.map("copy", _full(_T.of(o), o.shape), [_View(_T.of(x), 0, _bcast(x.shape, o.shape))], o.shape)


@lowers("slice")
def _slice(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x, o = d.args[0], d.outputs[0]
    st = _contig(x.shape)
    dim = attrs["dim"]
    base = attrs["start"] * st[dim]
    st[dim] *= attrs["step"]
    lw.map("copy", _full(_T.of(o), o.shape), [_View(_T.of(x), base, st)], o.shape)


@lowers("cat")
def _cat(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    o = d.outputs[0]
    dim = attrs["dim"]
    ost = _contig(o.shape)
    out = _T.of(o)
    at = 0
    for i, x in enumerate(d.args):
        lw.map("copy", _View(out, at * ost[dim], ost), [_full(_T.of(x), x.shape)], x.shape, what=f"part {i}")
        at += x.shape[dim]


@lowers("pad")
def _pad(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x, o = d.args[0], d.outputs[0]
    out = _T.of(o)
    value = attrs["value"]
    if o.dtype == "bool":
        value = 1.0 if value else 0.0
    lw.map("fill", _full(out, o.shape), [], o.shape, fa=value, what="fill")
    pads = attrs["pads"]
    rank = len(x.shape)
    xst, ost = _contig(x.shape), _contig(o.shape)
    xbase = obase = 0
    inner = list(x.shape)
    for j in range(len(pads) // 2):
        dim = rank - 1 - j
        lo, hi = pads[2 * j], pads[2 * j + 1]
        crop_lo, crop_hi = max(-lo, 0), max(-hi, 0)
        inner[dim] = max(0, x.shape[dim] - crop_lo - crop_hi)
        xbase += crop_lo * xst[dim]
        obase += max(lo, 0) * ost[dim]
    lw.map("copy", _View(out, obase, ost), [_View(_T.of(x), xbase, xst)], inner, what="interior")


@lowers("kv_update")
def _kv_update(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    cache, new, pos = d.args
    o = d.outputs[0]
    out = _T.of(o)
    if not _T.of(cache).same_place(out):  # not aliased by the plan: start from a copy of the cache
        lw.copy_tensor(_T.of(cache), out, cache.shape, what="cache copy")
    b, h, s, dd = cache.shape
    t = new.shape[2]
    ost = _contig(cache.shape)
    lw.map("copy", _View(out, 0, ost), [_full(_T.of(new), new.shape)], new.shape,
           dyn=(_T.of(pos), dd, s - t), what="rows")


# ------------------------------------------------------------------------------------------ gather, rope

@lowers("embedding")
def _embedding(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    w, ids = d.args
    o = d.outputs[0]
    v, dd = w.shape
    out = _T.of(o)
    wt = _T.of(w, f"embedding table (value {w.value})")
    total = _numel(o.shape)
    ob, oe, threads = _flat_out(lw, out, total)
    ib, ie = lw.bind(3, _T.of(ids))
    step = v
    if not lw.fits(wt, 0, v * dd):
        step = max(1, (lw.limits.max_binding_size - lw.align) // max(dd * wt.isz, 1))
        if not lw.fits(wt, 0, step * dd):
            raise lw.too_big(wt, lw.span(wt, 0, dd), "one row is larger than a binding")
    for v0 in range(0, v, step):
        v1 = min(v, v0 + step)
        wb, we = lw.bind(2, wt, v0 * dd, v1 * dd)
        uni = _u32(total, dd, v, we, ie, oe, v0, v1)
        lw.emit("embedding", {"DT_OUT": out.code, "DTW": wt.code}, uni, [ob, wb, ib], _grid(threads),
                f"rows {v0}..{v1 - 1}" if step < v else "")


@lowers("rope")
def _rope(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x, cos, sin = d.args
    o = d.outputs[0]
    _, _, t, dd = x.shape
    out = _T.of(o)
    total = _numel(o.shape)
    ob, oe, threads = _flat_out(lw, out, total)
    xb, xe = lw.bind(2, _T.of(x))
    cb, ce = lw.bind(3, _T.of(cos))
    sb, se = lw.bind(4, _T.of(sin))
    uni = _u32(total, t, dd, xe, ce, se, oe, 0)
    lw.emit("rope", {"DT_OUT": out.code, "DTX": DT_CODE[x.dtype], "DTC": DT_CODE[cos.dtype], "DTS": DT_CODE[sin.dtype]},
            uni, [ob, xb, cb, sb], _grid(threads))
