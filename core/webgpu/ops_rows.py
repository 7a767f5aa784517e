"""Lowering of the row-wise ops: layer and RMS norms, batch norm, softmax and log-softmax, and the
reductions (sum, mean, amax, argmax) (pure Python)."""

from __future__ import annotations

import struct
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from ..errors import DeviceError
from ..plan.types import Dispatch
from .kernel import (DT_CODE, DUMMY, Binding, _contig, _flat_out, _full, _grid, _Lowering, _numel, _row_grid, _T,
                     _u32, _View, lowers)

# ------------------------------------------------------------------------------------------ rows

def _rwg(L: int) -> int:
    return 256 if L > 2048 else 64


def _f32_route(lw: _Lowering, out: _T, direct_ok: bool) -> Tuple[_T, Callable[[Sequence[int]], None]]:
    """Where a row kernel should write: ``out`` itself, or (float16 output it cannot write as whole
    words) a float32 scratch, with the cast to run afterwards."""
    if out.dtype != "float16" or direct_ok:
        return out, lambda shape: None
    scr = lw.scratch("float32", out.numel)
    return scr, lambda shape: lw.copy_tensor(scr, out, shape, what="float16 store")


def _row_blocks(lw: _Lowering, ts: Sequence[_T], outer: int, block: int) -> Iterator[Tuple[int, int]]:
    """Split ``outer`` blocks of ``block`` elements (in every tensor of ``ts``) into runs whose
    bindings fit; yields (first block, block count)."""
    if outer == 0:
        return
    per = max(t.isz * block for t in ts)
    cap = (lw.limits.max_binding_size - lw.align) // max(per, 1)
    if cap < 1:
        t = max(ts, key=lambda t: t.isz)
        raise lw.too_big(t, per + lw.align, "one row is larger than a binding")
    step = min(outer, cap)
    for s in range(0, outer, step):
        yield s, min(step, outer - s)


@lowers("layer_norm", "rms_norm")
def _norm_rows(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x = d.args[0]
    o = d.outputs[0]
    if d.op == "layer_norm":
        L = _numel(attrs["normalized_shape"])
        w, b = (list(d.args) + [None, None])[1:3]
    else:
        L = x.shape[-1] if x.shape else 1
        w, b = (list(d.args) + [None])[1], None
    rows = _numel(x.shape) // L if L else 0
    out = _T.of(o)
    xin = _T.of(x)
    dst, finish = _f32_route(lw, out, L % 2 == 0 and out.offset % 4 == 0)
    wt = _T.of(w) if w is not None else None
    bt = _T.of(b) if b is not None else None
    consts = {"DT_OUT": dst.code, "DTX": xin.code, "DTW": wt.code if wt else 0, "DTB": bt.code if bt else 0,
              "HAS_W": wt is not None, "HAS_B": bt is not None, "NORM_RMS": d.op == "rms_norm", "RWG": _rwg(L)}
    wb, we = lw.bind(3, wt)
    bb, be = lw.bind(4, bt)
    for r0, nr in _row_blocks(lw, [xin, dst], rows, L):
        xb, xe = lw.bind(2, xin, r0 * L, (r0 + nr) * L)
        ob, oe = lw.bind(1, dst, r0 * L, (r0 + nr) * L)
        if dst.dtype == "float16" and oe % 2:
            raise DeviceError(f"{lw.label}: float16 rows at an odd element offset")
        uni = _u32(nr, L, xe, oe, we, be, 0, 0, 0, 0, 0) + struct.pack("<f", attrs["eps"])
        lw.emit("norm_rows", consts, uni, [ob, xb, wb, bb], _row_grid(nr))
    finish(o.shape)


@lowers("batch_norm")
def _batch_norm(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x, mean, var, w, b = (list(d.args) + [None, None])[:5]
    o = d.outputs[0]
    out = _T.of(o)
    total = _numel(o.shape)
    c = x.shape[1]
    inner = _numel(x.shape[2:])
    ob, oe, threads = _flat_out(lw, out, total)
    xb, xe = lw.bind(2, _T.of(x))
    wb, we = lw.bind(3, _T.of(w) if w is not None else None)
    bb, be = lw.bind(4, _T.of(b) if b is not None else None)
    mb, me = lw.bind(5, _T.of(mean))
    vb, ve = lw.bind(6, _T.of(var))
    uni = _u32(0, 0, xe, oe, we, be, me, ve, total, c, inner) + struct.pack("<f", attrs["eps"])
    consts = {"DT_OUT": out.code, "DTX": DT_CODE[x.dtype], "DTW": DT_CODE[w.dtype] if w is not None else 0,
              "DTB": DT_CODE[b.dtype] if b is not None else 0, "DTM": DT_CODE[mean.dtype], "DTV": DT_CODE[var.dtype],
              "HAS_W": w is not None, "HAS_B": b is not None}
    lw.emit("batch_norm", consts, uni, [ob, xb, wb, bb, mb, vb], _grid(threads))


def _softmax_call(lw: _Lowering, x: _T, out: _T, outer: int, L: int, inner: int, log: bool,
                  mask: Optional[Tuple[_T, int, List[int]]] = None, tq: int = 1, heads: int = 1,
                  causal: Optional[int] = None) -> None:
    """softmax_rows over [outer, L, inner] (x overlapping out is read from a snapshot, see emit)."""
    rows_per_block = inner
    consts = {"DT_OUT": out.code, "DTX": x.code, "DTM": mask[0].code if mask else 0,
              "MASK": (1 if mask[0].dtype == "bool" else 2) if mask else 0, "CAUSAL": causal is not None,
              "LOG": log, "RWG": _rwg(L)}
    if mask:
        mb, me = lw.bind(3, mask[0])
    else:
        mb, me = Binding(3, DUMMY), 0
    blocks = list(_row_blocks(lw, [x, out], outer, L * inner))
    if len(blocks) > 1 and (mask or causal is not None):
        raise lw.too_big(x, lw.span(x, 0, x.numel), "masked rows are split per head by sdpa, not here")
    for o0, no in blocks:
        xb, xe = lw.bind(2, x, o0 * L * inner, (o0 + no) * L * inner)
        ob, oe = lw.bind(1, out, o0 * L * inner, (o0 + no) * L * inner)
        ms = mask[2] if mask else [0, 0, 0, 0]
        uni = _u32(no * rows_per_block, L, inner, xe, oe, me + (mask[1] if mask else 0), tq, heads,
                   ms[0], ms[1], ms[2], ms[3]) + struct.pack("<i3I", causal or 0, 0, 0, 0)
        lw.emit("softmax_rows", consts, uni, [ob, xb, mb], _row_grid(no * rows_per_block))


@lowers("softmax", "log_softmax")
def _softmax(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x = d.args[0]
    o = d.outputs[0]
    shape = list(x.shape) or [1]
    dim = attrs["dim"] if x.shape else 0
    outer, L, inner = _numel(shape[:dim]), shape[dim], _numel(shape[dim + 1:])
    out = _T.of(o)
    dst, finish = _f32_route(lw, out, inner == 1 and L % 2 == 0 and out.offset % 4 == 0)
    _softmax_call(lw, _T.of(x), dst, outer, L, inner, d.op == "log_softmax")
    finish(o.shape)


_REDUCE_OP = {"sum": 0, "mean": 1, "amax": 2, "argmax": 3}


@lowers("sum", "mean", "amax", "argmax")
def _reduce(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x = d.args[0]
    o = d.outputs[0]
    shape = list(x.shape)
    if d.op == "argmax":
        dims = [attrs["dim"]] if shape else []
    else:
        dims = list(attrs["dims"])
    xin = _T.of(x)
    if not shape:
        outer, L, inner = 1, 1, 1
    elif dims == list(range(dims[0], dims[-1] + 1)):
        outer, L, inner = _numel(shape[:dims[0]]), _numel(shape[dims[0]:dims[-1] + 1]), _numel(shape[dims[-1] + 1:])
    else:
        # Reduced dims are not one block: permute them last into a scratch first.
        kept = [i for i in range(len(shape)) if i not in dims]
        perm = kept + dims
        st = _contig(shape)
        pshape = [shape[i] for i in perm]
        scr = lw.scratch(x.dtype, _numel(shape))
        lw.map("copy", _full(scr, pshape), [_View(xin, 0, [st[i] for i in perm])], pshape, what="gather reduced dims")
        xin = scr
        outer, L, inner = _numel([shape[i] for i in kept]), _numel([shape[i] for i in dims]), 1
    out = _T.of(o)
    dst, finish = _f32_route(lw, out, False)
    int_math = x.dtype in ("int32", "bool") and d.op != "mean"
    consts = {"DT_OUT": dst.code, "DTX": xin.code, "OP": _REDUCE_OP[d.op], "INT_MATH": int_math, "RWG": _rwg(L)}
    for o0, no in _row_blocks(lw, [xin], outer, L * inner):
        xb, xe = lw.bind(2, xin, o0 * L * inner, (o0 + no) * L * inner)
        ob, oe = lw.bind(1, dst, o0 * inner, (o0 + no) * inner)
        uni = _u32(no * inner, L, inner, xe, oe, 0, 0, 0)
        lw.emit("reduce_rows", consts, uni, [ob, xb], _row_grid(no * inner))
    finish(o.shape)
