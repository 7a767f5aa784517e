"""Lowering of the matrix products: matmul and linear (the tiled, fast float32 and gemv
kernels, split-K, sibling linears as one batched product; the subgroup-matrix kernel of
ops_sgmat.py where the device and the session's precision allow), conv2d and pooling (pure Python)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from .. import ops as _ops
from ..errors import DeviceError
from ..plan.fusion import Epilogue
from ..plan.types import BufferRef, Dispatch
from .kernel import (DT_CODE, DUMMY, MAX_GROUPS, Binding, _contig, _flat_out, _grid, _Lowering, _NoFusion, _numel,
                     _T, _u32, _up, _View, lowers)
from . import ops_sgmat

# ------------------------------------------------------------------------------------------ matmul

@dataclass
class _MM:
    """C(m, n) = alpha * sum_k A(m, k) B(k, n) + bias over batch dims (see matmul.wgsl)."""

    a: _T
    b: _T
    c: _T
    M: int
    N: int
    K: int
    a_base: int
    a_sm: int
    a_sk: int
    b_base: int
    b_sk: int
    b_sn: int
    c_base: int
    c_sm: int
    c_sn: int
    batch: List[int] = field(default_factory=list)
    a_sb: List[int] = field(default_factory=list)
    b_sb: List[int] = field(default_factory=list)
    c_sb: List[int] = field(default_factory=list)
    group: int = 1  # B's last batch index is divided by this (grouped-query attention)
    bias: Optional[_T] = None
    bias_mode: int = 0  # 1: per column n, 2: per row m
    bias_base: int = 0
    alpha: float = 1.0
    tile: Optional[int] = None  # preferred tile edge when Tuning does not force one (None: by tile count)
    act: int = 0  # fused epilogue (matmul_fast.wgsl ACT): 1 gelu, 2 gelu tanh
    res: Optional[_T] = None  # fused epilogue: + res, float32 [M, N] contiguous, unbatched
    outs: Tuple[_T, ...] = ()  # sibling linears (NC): batch entry z > 0 writes outs[z - 1], not c

    @property
    def fused(self) -> bool:
        return bool(self.act) or self.res is not None or bool(self.outs)

    def replace(self, **kw) -> "_MM":
        d = dict(self.__dict__)
        d.update(kw)
        return _MM(**d)


def _mm_ranges(mm: _MM) -> List[Tuple[_T, int, int]]:
    def ext(strides, sizes):
        return sum((s - 1) * st for s, st in zip(sizes, strides))

    nb = list(mm.batch)
    b_sizes = list(nb)
    if mm.group > 1 and b_sizes:
        b_sizes[-1] = -(-b_sizes[-1] // mm.group)
    out = [(mm.a, mm.a_base, mm.a_base + ext(mm.a_sb, nb) + (mm.M - 1) * mm.a_sm + (mm.K - 1) * mm.a_sk + 1),
           (mm.b, mm.b_base, mm.b_base + ext(mm.b_sb, b_sizes) + (mm.K - 1) * mm.b_sk + (mm.N - 1) * mm.b_sn + 1),
           (mm.c, mm.c_base, mm.c_base + ext(mm.c_sb, nb) + (mm.M - 1) * mm.c_sm + (mm.N - 1) * mm.c_sn + 1)]
    if mm.bias is not None:
        n = {1: mm.N, 2: mm.M, 3: mm.N * (1 + len(mm.outs))}[mm.bias_mode]
        out.append((mm.bias, mm.bias_base, mm.bias_base + n))
    return out


def _mm_f16_ok(mm: _MM) -> bool:
    """Can the kernels write float16 C as column-pair words without two threads sharing a word?"""
    if mm.c.dtype != "float16":
        return True
    even = [mm.c_base, mm.c_sm, mm.N] + list(mm.c_sb)
    return mm.c_sn == 1 and all(v % 2 == 0 for v in even)


def _matmul_call(lw: _Lowering, mm: _MM) -> None:
    """Lower one product: merge/loop batch dims, route odd float16 outputs through float32, split
    for the binding limit, pick the kernel."""
    if mm.M == 0 or mm.N == 0 or 0 in mm.batch:
        return
    if mm.K == 0:
        _empty_product(lw, mm)
        return
    # Merge adjacent batch dims (not across the grouped dim) and drop size-1 ones.
    dims = [(s, a, b, c) for s, a, b, c in zip(mm.batch, mm.a_sb, mm.b_sb, mm.c_sb)]
    if mm.group == 1:
        dims = [x for x in dims if x[0] != 1]
        merged: List[tuple] = []
        for s, a, b, c in dims:
            if merged and merged[-1][1] == a * s and merged[-1][2] == b * s and merged[-1][3] == c * s:
                merged[-1] = (merged[-1][0] * s, a, b, c)
            else:
                merged.append((s, a, b, c))
        dims = merged
    if mm.fused and (len(dims) != (1 if mm.outs else 0) or not _mm_f16_ok(mm)):
        raise _NoFusion()
    if len(dims) > 2:  # loop over the leading batch dims
        s, a, b, c = dims[0]
        rest = dims[1:]
        for i in range(s):
            _matmul_call(lw, mm.replace(a_base=mm.a_base + i * a, b_base=mm.b_base + i * b,
                                        c_base=mm.c_base + i * c, batch=[x[0] for x in rest],
                                        a_sb=[x[1] for x in rest], b_sb=[x[2] for x in rest], c_sb=[x[3] for x in rest]))
        return
    mm = mm.replace(batch=[x[0] for x in dims], a_sb=[x[1] for x in dims], b_sb=[x[2] for x in dims],
                    c_sb=[x[3] for x in dims])
    if not _mm_f16_ok(mm):
        # Compute into a float32 scratch [batch..., M, N], then cast into C's strided view.
        nb = list(mm.batch)
        scr = lw.scratch("float32", _numel(nb) * mm.M * mm.N)
        sst = _contig(nb + [mm.M, mm.N])
        _matmul_split(lw, mm.replace(c=scr, c_base=0, c_sm=mm.N, c_sn=1, c_sb=sst[:len(nb)]))
        lw.map("copy", _View(mm.c, mm.c_base, list(mm.c_sb) + [mm.c_sm, mm.c_sn]),
               [_View(scr, 0, sst)], nb + [mm.M, mm.N], what="float16 store")
        return
    _matmul_split(lw, mm)


def _empty_product(lw: _Lowering, mm: _MM) -> None:
    """A product over K = 0 sums nothing: C is zeros, or the bias broadcast (torch's answer; the
    product kernels would read empty operands). Fused epilogues decline, so they run apart."""
    if mm.fused or mm.bias_mode == 3:
        raise _NoFusion()
    nb = len(mm.batch)
    shape = list(mm.batch) + [mm.M, mm.N]
    out = _View(mm.c, mm.c_base, list(mm.c_sb) + [mm.c_sm, mm.c_sn])
    if mm.bias is None:
        lw.map("fill", out, [], shape, fa=0.0, what="product over K = 0: zeros")
        return
    per = [0, 1] if mm.bias_mode == 1 else [1, 0]  # per column n, or per row m
    lw.map("copy", out, [_View(mm.bias, mm.bias_base, [0] * nb + per)], shape, what="product over K = 0: bias")


def _matmul_split(lw: _Lowering, mm: _MM) -> None:
    over = [(t, lw.span(t, lo, hi)) for t, lo, hi in _mm_ranges(mm)]
    over = [(t, n) for t, n in over if n > lw.limits.max_binding_size]
    nbatch = _numel(mm.batch)
    if not over and nbatch <= MAX_GROUPS:
        _matmul_emit(lw, mm)
        return
    if mm.fused:
        raise _NoFusion()
    names = {id(mm.a): "a", id(mm.b): "b", id(mm.c): "c"}
    worst = max((n for _, n in over), default=0)
    parts = max(2, -(-worst // max(1, lw.limits.max_binding_size - lw.align)))
    which = {names.get(id(t), "bias") for t, _ in over}
    if nbatch > MAX_GROUPS or ("a" in which and mm.M == 1) or ("b" in which and mm.N == 1) \
            or (which == {"c"} and mm.M == 1 and mm.N == 1):
        if not mm.batch or nbatch == 1:
            t, n = over[0]
            raise lw.too_big(t, n, "no dimension of this product can be split further")
        _split_batch(lw, mm, parts if over else -(-nbatch // MAX_GROUPS))
        return
    if "b" in which or ("c" in which and mm.M == 1):
        step = -(-mm.N // parts)
        if mm.c.dtype == "float16":
            step = _up(step, 2)  # keep column pairs whole
        for n0 in range(0, mm.N, step):
            nn = min(step, mm.N - n0)
            _matmul_split(lw, mm.replace(N=nn, b_base=mm.b_base + n0 * mm.b_sn, c_base=mm.c_base + n0 * mm.c_sn,
                                         bias_base=mm.bias_base + (n0 if mm.bias_mode == 1 else 0)))
        return
    step = -(-mm.M // parts)
    for m0 in range(0, mm.M, step):
        mmm = min(step, mm.M - m0)
        _matmul_split(lw, mm.replace(M=mmm, a_base=mm.a_base + m0 * mm.a_sm, c_base=mm.c_base + m0 * mm.c_sm,
                                     bias_base=mm.bias_base + (m0 if mm.bias_mode == 2 else 0)))


def _split_batch(lw: _Lowering, mm: _MM, parts: int) -> None:
    # Split the outer batch dim when there is one with more than one entry, else the inner (in
    # multiples of the group, so B's grouped index stays aligned).
    k = 0 if len(mm.batch) == 2 and mm.batch[0] > 1 else len(mm.batch) - 1
    size = mm.batch[k]
    step = max(1, -(-size // parts))
    if k == len(mm.batch) - 1 and mm.group > 1:
        step = _up(step, mm.group)
    if step >= size:
        step = max(1, size // 2)
        if k == len(mm.batch) - 1 and mm.group > 1:
            step = mm.group if mm.group < size else size
    for s0 in range(0, size, step):
        n = min(step, size - s0)
        batch = list(mm.batch)
        batch[k] = n
        boff = s0 * mm.b_sb[k] // (mm.group if (k == len(mm.batch) - 1) else 1)
        _matmul_split(lw, mm.replace(batch=batch, a_base=mm.a_base + s0 * mm.a_sb[k], b_base=mm.b_base + boff,
                                     c_base=mm.c_base + s0 * mm.c_sb[k]))


def _matmul_emit(lw: _Lowering, mm: _MM) -> None:
    nb = list(mm.batch)
    while len(nb) < 2:
        nb.insert(0, 1)
    a_sb = [0] * (2 - len(mm.a_sb)) + list(mm.a_sb)
    b_sb = [0] * (2 - len(mm.b_sb)) + list(mm.b_sb)
    c_sb = [0] * (2 - len(mm.c_sb)) + list(mm.c_sb)
    rs = _mm_ranges(mm)
    binds = []
    bases = []
    for slot, (t, lo, hi) in zip((2, 3, 1), rs[:3]):
        b, e = lw.bind(slot, t, lo, hi)
        binds.append(b)
        bases.append(e)
    if mm.bias is not None:
        b, e = lw.bind(4, mm.bias, rs[3][1], rs[3][2])
        binds.append(b)
        bias_base = e
    else:
        binds.append(Binding(4, DUMMY))
        bias_base = 0
    a_base, b_base, c_base = bases
    if mm.res is not None:
        if mm.res.dtype != "float32" or mm.res.numel != mm.M * mm.N:
            raise _NoFusion()
        rbind, r_base = lw.bind(5, mm.res)
    else:
        rbind, r_base = Binding(5, DUMMY), 0
    extra = [Binding(6, DUMMY), Binding(7, DUMMY)]
    for slot, t in zip((6, 7), mm.outs):
        b, e = lw.bind(slot, t)
        if e != c_base:  # the outputs share C's element base
            raise _NoFusion()
        extra[slot - 6] = b
    rbind = [rbind] + extra
    uni = _u32(mm.M, mm.N, mm.K, nb[1], a_base, b_base, c_base, bias_base, mm.a_sm, mm.a_sk, mm.b_sk, mm.b_sn,
               mm.c_sm, mm.c_sn, mm.group, nb[0], a_sb[0], a_sb[1], b_sb[0], b_sb[1], c_sb[0], c_sb[1]) \
        + struct.pack("<fI", mm.alpha, r_base)
    consts = {"DT_OUT": mm.c.code, "DTA": mm.a.code, "DTB": mm.b.code,
              "DTBIAS": mm.bias.code if mm.bias is not None else 0, "BIAS": mm.bias_mode if mm.bias is not None else 0}
    z = nb[0] * nb[1]
    if mm.fused and z != 1 + len(mm.outs):
        raise _NoFusion()
    if mm.M <= min(lw.tuning.gemv_max_m, GEMV_MAX_M) and not lw.tuning.gemv_old and \
            _gemv_emit(lw, mm, consts, uni, binds + rbind, bases, (nb, a_sb, b_sb, c_sb)):
        return
    if ops_sgmat.emit(lw, mm, uni, binds + rbind, bases, (nb, a_sb, b_sb, c_sb)):
        return  # tensor cores: float16 operands, or precision="fast" (ops_sgmat.py)
    if mm.fused and (mm.M <= min(lw.tuning.gemv_max_m, 4) or r_base % 4):
        raise _NoFusion()  # the older gemv kernels take no epilogue; matmul_fast.wgsl reads R as vec4s
    if mm.M <= min(lw.tuning.gemv_max_m, 4):
        consts["GM"] = mm.M
        if mm.b_sk == 1 and mm.b_sn != 1:
            lw.emit("gemv_k", consts, uni, binds, (-(-mm.N // 8), 1, z), "gemv_k")
        else:
            lw.emit("gemv_n", consts, uni, binds, (-(-mm.N // 512), 1, z), "gemv_n")
        return
    tile, tm = (lw.tuning.mm_tile if lw.tuning.mm_tile is not None else mm.tile), lw.tuning.mm_tm or 8

    def groups(t):
        return -(-mm.M // t) * -(-mm.N // t) * z

    if tile is None and lw.tuning.mm_tm != 4 and groups(128) < lw.tuning.huge_tile_min_groups \
            and -(-mm.M // 64) * -(-mm.N // 128) * z >= lw.tuning.big_tile_min_groups:
        # Many rows but too few 128x128 tiles to keep every multiprocessor busy with a few
        # workgroups (MiniLM 32x128's 4096x384 linears: 96): 64x128 tiles of 8x8 per thread and
        # two K ranges (measured: docs/NOTES.md, "Many rows, few tiles").
        ks = 2 if mm.K >= 256 and _ksplit_fits(lw, mm, 2, z) else 1
        if _mm_f32_emit(lw, mm, 64, 8, consts, uni, binds + rbind, bases, (nb, a_sb, b_sb, c_sb),
                        tile_n=128, ksplit=ks):
            return
    if tile is None:
        if lw.tuning.mm_tm != 4 and groups(128) >= 2 * lw.tuning.big_tile_min_groups:
            tile = 128
        else:
            # Too few 128x128 tiles of 8x8 per thread to fill a GPU (a 128-token prefill's
            # linears; MiniLM's 4096x384 ones): 4x4 per thread, 64x64 tiles of 256 threads when
            # they are enough, else 32x32 of 64 (H100: bench_wgpu's shapes section).
            tm = 4
            tile = 64 if groups(64) >= lw.tuning.big_tile_min_groups else 32
    elif tile == 32:  # 4x4 per thread, 8x8 threads
        tm = 4
    if _mm_f32_emit(lw, mm, tile, tm, consts, uni, binds + rbind, bases, (nb, a_sb, b_sb, c_sb)):
        return
    if mm.fused:
        raise _NoFusion()
    if tm == 4 and tile == 32 and lw.tuning.mm_tile is None:
        tile = 64  # the general kernel's 4x4 variant: 256 threads per 64x64 tile (measured best for it)
    w = tile // tm
    bk = lw.tuning.mm_bk or 8
    if tm * bk // w not in (2, 4, 8) or tm * bk % w:
        # each thread stages tm * bk / w elements of a tile per step, named registers for 2, 4 or 8
        raise ValueError(f"Tuning(mm_tile={tile}, mm_bk={bk}): a K step of {bk} does not fit {tm}x{tm} per thread")
    consts.update(A_KMAJOR=mm.a_sk == 1 or mm.a_sm != 1, B_NMAJOR=mm.b_sn == 1 or mm.b_sk != 1,
                  WX=w, WY=w, BK=bk, TM=tm)
    gx, gy = -(-mm.N // tile), -(-mm.M // tile)
    if gx > MAX_GROUPS or gy > MAX_GROUPS:
        raise DeviceError(f"{lw.label}: a {mm.M}x{mm.N} product needs more than {MAX_GROUPS} tiles per dimension")
    lw.emit("mm", consts, uni, binds, (gx, gy, z), f"mm{tile}/{tm}x{tm}")


# ---------------------------------------------------------------- gemv (M <= 8, B read along k)
# gemv.wgsl / gemv_any.wgsl (shared part: gemv_common.wgsl): a workgroup owns a few output
# columns and every row of A; each column's weight row is walked by LANES threads in 16-byte
# chunks, up to four per thread in flight at once, then summed in workgroup memory. They replace
# gemv_k (32 lanes reading one 4-byte element at a time, so a K-long row was a chain of K / 32
# dependent loads per thread) for every product whose B runs along k; gemv_n and the tiles keep
# the rest. Also the fused epilogues and sibling linears, which the older kernels declined.
GEMV_MAX_M = 8  # gemv_common.wgsl GM: one named accumulator per row of A
GEMV_UNROLL = 4  # chunks per thread and loop trip (named registers q0..q3 / w0..w3)
GEMV_LANES = (32, 64, 128, 256)
GEMV_WG = 256  # most threads per workgroup (gemv_common.wgsl WGS; red[] holds GM x WGS floats)


def _gemv_vec(lw: _Lowering, mm: _MM, bases, batch_strides) -> bool:
    """Can gemv.wgsl (16-byte loads) run this product? A float32 read along k in vec4-aligned
    rows; B float32 or float16 in whole 16-byte chunks (4 or 8 elements) at chunk-aligned offsets."""
    if mm.a.dtype != "float32" or mm.b.dtype not in ("float32", "float16") or mm.a_sk != 1 or lw.align % 16:
        return False
    _, a_sb, b_sb, _ = batch_strides
    a_base, b_base, _ = bases
    ch = 4 if mm.b.dtype == "float32" else 8
    return all(v % 4 == 0 for v in [a_base, mm.a_sm, mm.K] + list(a_sb)) and \
        all(v % ch == 0 for v in [b_base, mm.b_sn, mm.K] + list(b_sb))


def _gemv_shape(lw: _Lowering, mm: _MM, ch: int) -> Tuple[int, int]:
    """(LANES, WGS): threads per column, so that one loop trip of GEMV_UNROLL chunks per thread
    covers the row (every weight load of a thread in flight at once); then as many columns per
    workgroup as still give Tuning.gemv_min_groups workgroups (a 192-row k/v projection runs
    192 workgroups of one column rather than 48 of four, so it spreads over every multiprocessor
    of an H100), up to GEMV_WG threads."""
    t = lw.tuning
    nch = -(-mm.K // ch)
    if t.gemv_lanes is not None:
        if t.gemv_lanes not in GEMV_LANES:
            raise ValueError(f"Tuning(gemv_lanes={t.gemv_lanes}): one of {GEMV_LANES}")
        lanes = t.gemv_lanes
    else:
        lanes = next((x for x in GEMV_LANES if nch <= GEMV_UNROLL * x), GEMV_LANES[-1])
    if t.gemv_cols is not None:
        if t.gemv_cols < 1 or lanes * t.gemv_cols > GEMV_WG or t.gemv_cols & (t.gemv_cols - 1):
            raise ValueError(f"Tuning(gemv_cols={t.gemv_cols}): a power of two with {lanes} * cols <= {GEMV_WG}")
        cols = t.gemv_cols
    else:
        cols = 1
        while lanes * cols * 2 <= GEMV_WG and -(-mm.N // (cols * 2)) >= t.gemv_min_groups:
            cols *= 2
    return lanes, lanes * cols


def _gemv_emit(lw: _Lowering, mm: _MM, consts: dict, uni: bytes, binds, bases, batch) -> bool:
    """Emit gemv (aligned 16-byte loads) or gemv_any (anything else whose B runs along k) for
    M <= GEMV_MAX_M; False (nothing emitted) where B does not run along k or C is float16 (one
    thread owns one column: it cannot write a float16 word of two)."""
    if mm.b_sk != 1 or mm.c.dtype == "float16":
        return False
    vec = _gemv_vec(lw, mm, bases, batch)
    ch = (4 if mm.b.dtype == "float32" else 8) if vec else 4
    lanes, wgs = _gemv_shape(lw, mm, ch)
    groups = -(-mm.N // (wgs // lanes))
    gx = min(groups, MAX_GROUPS)
    nb = batch[0]
    c = {"DT_OUT": mm.c.code, "DTB": mm.b.code, "DTBIAS": consts["DTBIAS"], "BIAS": consts["BIAS"], "GM": mm.M,
         "LANES": lanes, "WGS": wgs, "ACT": mm.act, "RES": mm.res is not None, "NC": 1 + len(mm.outs)}
    if not vec:
        c["DTA"] = mm.a.code
    what = (" + gelu" if mm.act else "") + (" + residual" if mm.res is not None else "") + \
        (f" x{1 + len(mm.outs)} siblings" if mm.outs else "")
    entry = "gemv" if vec else "gemv_any"
    lw.emit(entry, c, uni, binds, (gx, -(-groups // gx), nb[0] * nb[1]),
            f"{entry} {mm.b.dtype} {lanes}x{wgs // lanes}{what}")
    return True


# ---------------------------------------------------------------- float32 vec4 fast path (mm_f32)
# matmul_fast.wgsl: the same parameters and slots as `mm`, float32 only, every operand read and C
# written as vec4s; faster than `mm` where it applies (measured: docs/NOTES.md). Its K step: 16
# for 128x128 tiles, 8 for 64x64 (measured best).
_MM_F32_BK = {(128, 8): (16, (4, 8, 16, 32)), (64, 8): (8, (4, 8, 16)),
              (64, 4): (16, (4, 8, 16, 32)), (32, 4): (16, (4, 8, 16, 32))}


def _mm_f32_ok(lw: _Lowering, mm: _MM, bases, batch_strides) -> Optional[bool]:
    """None when matmul_fast.wgsl cannot run this product, else B_KMAJOR (B read along k). B may be
    float16 (B_F16: quads of halves, 8-byte aligned by the same checks)."""
    if mm.a.dtype != "float32" or mm.b.dtype not in ("float32", "float16") or mm.c.dtype != "float32" or \
            (mm.bias is not None and mm.bias.dtype != "float32") or lw.align % 16:
        return None
    _, a_sb, b_sb, c_sb = batch_strides
    a_base, b_base, c_base = bases

    def quad(*vals):  # every value a whole number of vec4s
        return all(v % 4 == 0 for v in vals)

    if not (mm.K % 4 == 0 and mm.a_sk == 1 and quad(a_base, mm.a_sm, *a_sb)):
        return None
    if not (mm.N % 4 == 0 and mm.c_sn == 1 and quad(c_base, mm.c_sm, *c_sb)):
        return None
    if mm.b_sn == 1 and quad(b_base, mm.b_sk, *b_sb):
        return False
    if mm.b_sk == 1 and quad(b_base, mm.b_sn, *b_sb):
        return True
    return None


def _stage_ok(edge: int, bk: int, nt: int) -> bool:
    """matmul_fast.wgsl stages an operand's edge x bk tile as vec4s: at most one per thread, or
    two, or four (named registers)."""
    q = edge * bk // 4
    return q <= nt or q in (2 * nt, 4 * nt)


def _mm_f32_emit(lw: _Lowering, mm: _MM, tile: int, tm: int, consts: dict, uni: bytes, binds, bases, batch,
                 tile_n: Optional[int] = None, ksplit: Optional[int] = None) -> bool:
    """Emit the fast kernel when it applies (see _mm_f32_ok): mm_f32 (8x8 per thread, square or
    Tuning(mm_tile_n) rectangular tiles) or mm_f32_4 (4x4), either split along K; False leaves the
    product to `mm`."""
    if not lw.tuning.mm_fast or (tile, tm) not in _MM_F32_BK:
        return False
    kmaj = _mm_f32_ok(lw, mm, bases, batch)
    if kmaj is None:
        return False
    bm = tile
    bn = (tile_n or lw.tuning.mm_tile_n or tile) if tm == 8 else tile
    if (bn, tm) not in _MM_F32_BK:
        raise ValueError(f"Tuning(mm_tile_n={bn}): mm_f32 tiles are 64 or 128 wide")
    default, allowed = _MM_F32_BK[(tile, tm)]
    bk = lw.tuning.mm_bk if lw.tuning.mm_bk in allowed else default
    nt = (bm // tm) * (bn // tm)
    if not (_stage_ok(bm, bk, nt) and _stage_ok(bn, bk, nt)):
        bk = next(b for b in (16, 8, 4) if _stage_ok(bm, b, nt) and _stage_ok(bn, b, nt))
    nb = batch[0]
    gx, gy = -(-mm.N // bn), -(-mm.M // bm)
    if gx > MAX_GROUPS or gy > MAX_GROUPS:
        raise DeviceError(f"{lw.label}: a {mm.M}x{mm.N} product needs more than {MAX_GROUPS} tiles per dimension")
    z = nb[0] * nb[1]
    c = {"BIAS": consts["BIAS"], "B_KMAJOR": kmaj, "WX": bn // tm, "WY": bm // tm, "BK": bk, "TM": tm}
    if mm.b.dtype == "float16":  # B's range moves to slot 8 (BH, halves); slot 3 (B4) is a placeholder
        c["B_F16"] = True
        binds = [Binding(8, b.buf) if b.binding == 3 else b for b in binds] + [Binding(3, DUMMY)]
    else:
        binds = list(binds) + [Binding(8, DUMMY)]
    entry = "mm_f32" if tm == 8 else "mm_f32_4"
    stages = lw.tuning.mm_stages
    if stages is None and tm == 8 and bm == bn == 128 and lw.tuning.mm_bk is None:
        # 128x128 tiles: two shared stages of K step 8 (one barrier per step, the same 16 KiB as
        # one stage of 16; measured: docs/NOTES.md, "Many rows, few tiles").
        stages, bk = 2, 8
        c["BK"] = bk
    if tm == 8 and stages:
        c["STAGES"] = stages
    shape = f"{bm}" if bm == bn else f"{bm}x{bn}"
    if ksplit is not None:
        ks = ksplit
    elif tm == 8 and lw.tuning.mm_ksplit is None:
        ks = 1
    else:
        ks = _ksplit(lw, mm, gx * gy * z, z)
    c["KSPLIT"] = ks
    epi = {"ACT": mm.act, "RES": mm.res is not None, "NC": 1 + len(mm.outs)}
    what = (" + gelu" if mm.act else "") + (" + residual" if mm.res is not None else "") + \
        (f" x{1 + len(mm.outs)} siblings" if mm.outs else "")
    if ks == 1:
        lw.emit(entry, dict(c, **epi), uni, binds, (gx, gy, z), f"{entry} {shape} bk{bk}{what}")
        return True
    # Split-K: partial products into a float32 scratch [ks][batch][M][N], then their sum into C.
    per = mm.M * mm.N
    scr = lw.scratch("float32", ks * z * per)
    vals = list(struct.unpack_from("<22I", uni))
    vals[6], vals[12], vals[13], vals[20], vals[21] = 0, mm.N, 1, nb[1] * per, per  # c_base, c_sm, c_sn, c_sb
    part = _u32(*vals) + uni[88:]
    pb = Binding(1, BufferRef("scratch", scr.index, 0, ks * z * per * 4))
    lw.emit(entry, c, part, [pb] + [b for b in binds if b.binding not in (1, 5, 6, 7)]
            + [Binding(5, DUMMY), Binding(6, DUMMY), Binding(7, DUMMY)],
            (gx, gy, z * ks), f"{entry} {shape} bk{bk} split-K {ks}")
    cb = next(b for b in binds if b.binding == 1)
    rb = [b for b in binds if b.binding in (5, 6, 7)]
    lw.emit("mm_f32_sum", dict({"KSPLIT": ks}, **epi), uni, [cb, Binding(2, pb.buf)] + rb, _grid(z * per // 4),
            f"split-K {ks} sum{what}")
    return True


def _ksplit(lw: _Lowering, mm: _MM, groups: int, z: int) -> int:
    """Split-K ways for mm_f32_4: a 128-row product's time on an H100 follows K, not N (each
    workgroup's k loop is a chain of dependent memory round trips and there are too few
    workgroups to hide it), so split K while there are too few workgroups, keeping >= 64 of K
    per split."""
    t = lw.tuning
    if t.mm_ksplit is not None:
        ks = max(1, t.mm_ksplit)
    else:
        ks = 1
        while groups < t.ksplit_below_groups and ks < 8 and groups * ks < t.ksplit_target_groups \
                and mm.K // (2 * ks) >= 64:
            ks *= 2
    return ks if _ksplit_fits(lw, mm, ks, z) else 1


def _ksplit_fits(lw: _Lowering, mm: _MM, ks: int, z: int) -> bool:
    """The split-K partials ([ks][batch][M][N] float32) fit one binding and the grid."""
    return z * ks <= MAX_GROUPS and ks * z * mm.M * mm.N * 4 <= lw.limits.max_binding_size \
        and _up(ks * z * mm.M * mm.N * 4, 4) <= lw.limits.max_buffer_size


@lowers("matmul")
def _matmul(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    a, b = d.args
    o = d.outputs[0]
    sa, sb = tuple(a.shape), tuple(b.shape)
    a2 = (1,) + sa if len(sa) == 1 else sa
    b2 = sb + (1,) if len(sb) == 1 else sb
    M, K, N = a2[-2], a2[-1], b2[-1]
    batch = list(_ops.broadcast_shapes(a2[:-2], b2[:-2]))
    ast, bst = _contig(a2), _contig(b2)

    def bstrides(shape2, st2):
        lead = len(batch) - (len(shape2) - 2)
        return [0] * lead + [0 if s == 1 and bsz != 1 else t for s, t, bsz in zip(shape2[:-2], st2[:-2], batch[lead:])]

    cst = _contig(batch + [M, N])
    _matmul_call(lw, _MM(_T.of(a), _T.of(b), _T.of(o), M, N, K, 0, ast[-2], ast[-1], 0, bst[-2], bst[-1], 0, N, 1,
                         batch, bstrides(a2, ast), bstrides(b2, bst), cst[:len(batch)]))


@lowers("linear")
def _linear(lw: _Lowering, d: Dispatch, attrs: dict, epi: Optional[Epilogue] = None) -> None:
    x, w, bias = (list(d.args) + [None])[:3]
    o = epi.out if epi is not None else d.outputs[0]
    n, k = w.shape
    m = _numel(x.shape[:-1])
    _matmul_call(lw, _MM(_T.of(x), _T.of(w, f"weight (value {w.value})"), _T.of(o), m, n, k, 0, k, 1, 0, 1, k, 0, n, 1,
                         bias=_T.of(bias) if bias is not None else None, bias_mode=1,
                         act=epi.act if epi is not None else 0,
                         res=_T.of(epi.res) if epi is not None and epi.res is not None else None))


def _lower_siblings(lw: _Lowering, ds: List[Dispatch]) -> None:
    """Sibling linears as one product batched over them: weights [z][N][K] and biases [z][N]
    back to back in the first one's buffer (the executor placed them so), batch z writes the
    z-th output (matmul_fast.wgsl NC)."""
    d0 = ds[0]
    x, w = d0.args[0], d0.args[1]
    n, k = w.shape
    m = _numel(x.shape[:-1])
    z = len(ds)
    wt = _T(w.buf.space, w.buf.index, w.buf.offset, "float32", z * n * k, f"weights of {z} sibling linears")
    bias, mode = None, 3
    if len(d0.args) > 2 and d0.args[2] is not None:
        b = d0.args[2]
        if all(d.args[2].buf == b.buf for d in ds):  # one shared bias buffer (deduplicated constants)
            bias, mode = _T.of(b), 1
        else:
            bias = _T(b.buf.space, b.buf.index, b.buf.offset, "float32", z * n, f"biases of {z} sibling linears")
    outs = tuple(_T.of(d.outputs[0]) for d in ds[1:])
    _matmul_call(lw, _MM(_T.of(x), wt, _T.of(d0.outputs[0]), m, n, k, 0, k, 1, 0, 1, k, 0, n, 1,
                         batch=[z], a_sb=[0], b_sb=[n * k], c_sb=[0], bias=bias, bias_mode=mode, outs=outs))


# ------------------------------------------------------------------------------------------ conv / pool

@lowers("conv2d")
def _conv2d(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x, w, bias = (list(d.args) + [None])[:3]
    o = d.outputs[0]
    n, c, h, wd = x.shape
    oc, cg, kh, kw = w.shape
    g = attrs["groups"]
    (sh, sw), (ph, pw), (dh, dw) = attrs["stride"], attrs["padding"], attrs["dilation"]
    _, _, ho, wo = o.shape
    if kh == kw == 1 and sh == sw == 1 and ph == pw == 0 and g == 1:
        # A pointwise conv is a product: out[n] [O, HW] = w [O, C] @ x[n] [C, HW] (+ bias per row).
        hw = h * wd
        _matmul_call(lw, _MM(_T.of(w, f"weight (value {w.value})"), _T.of(x), _T.of(o), oc, hw, c,
                             0, c, 1, 0, hw, 1, 0, hw, 1, [n], [0], [c * hw], [oc * hw],
                             bias=_T.of(bias) if bias is not None else None, bias_mode=2))
        return
    out = _T.of(o)
    total = _numel(o.shape)
    ob, oe, threads = _flat_out(lw, out, total)
    xb, xe = lw.bind(2, _T.of(x))
    wb, we = lw.bind(3, _T.of(w))
    if bias is not None:
        bb, be = lw.bind(4, _T.of(bias))
    else:
        bb, be = Binding(4, DUMMY), 0
    uni = _u32(total, oe, xe, we, be, c, h, wd, oc, ho, wo, kh, kw, sh, sw, ph, pw, dh, dw, cg, oc // g, 0, 0, 0)
    lw.emit("conv2d", {"DT_OUT": out.code, "DTX": DT_CODE[x.dtype], "DTW": DT_CODE[w.dtype],
                       "DTBIAS": DT_CODE[bias.dtype] if bias is not None else 0, "HAS_BIAS": bias is not None},
            uni, [ob, xb, wb, bb], _grid(threads))


@lowers("max_pool2d", "avg_pool2d")
def _pool(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x = d.args[0]
    o = d.outputs[0]
    n, c, h, wd = x.shape
    _, _, ho, wo = o.shape
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["padding"]
    dh, dw = attrs.get("dilation", [1, 1])
    out = _T.of(o)
    total = _numel(o.shape)
    ob, oe, threads = _flat_out(lw, out, total)
    xb, xe = lw.bind(2, _T.of(x))
    cip = 1 if attrs.get("count_include_pad", True) else 0
    uni = _u32(total, oe, xe, 0, 0, c, h, wd, c, ho, wo, kh, kw, sh, sw, ph, pw, dh, dw, 1, 1, cip, 0, 0)
    lw.emit("pool2d", {"DT_OUT": out.code, "DTX": DT_CODE[x.dtype], "POOL_MAX": d.op == "max_pool2d"},
            uni, [ob, xb], _grid(threads))
