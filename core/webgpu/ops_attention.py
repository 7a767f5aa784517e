"""Lowering of scaled dot-product attention (sdpa): split-K decode attention, the fused
one-row kernel, the one-pass tile kernel (on subgroup matrices under precision="fast" where the
device has them) and the composite path (scores product, masked softmax, value product) (pure
Python)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

from gpudelegate.shaders import attn_sgmat as _sg_gen

from ..plan.fusion import SdpaFold
from ..plan.types import Dispatch
from . import ops_sgmat
from .kernel import ENTRIES, MAX_GROUPS, EntrySpec, _bcast, _Lowering, _NoFusion, _row_grid, _T, _u32, _up, lowers
from .ops_matmul import _MM, _matmul_call
from .ops_rows import _softmax_call

ATTN_MAX_KEYS = 2048  # attention.wgsl SCORES
ATTN_MAX_HEAD_DIM = 256  # attention.wgsl QMAX
ATTN_SPLIT_ROWS = 8  # attention.wgsl RB: query rows of one kv head per attn_split workgroup
ATTN_FLASH_ROWS = 4  # attention_flash.wgsl RB: most query rows of one kv head per attn_flash workgroup (its RWG)
ATTN_FLASH_MAX_DIM = 256  # attention_flash.wgsl QV (vec4s of a query row) x 4
ATTN_TILE_MAX_KEYS = 128  # attention_tile.wgsl TKM
ATTN_TILE_ROWS = 16  # attention_tile.wgsl BR: query rows per attn_tile workgroup
# Prefill attention on subgroup matrices (attention_sgmat.wgsl, entries written per head-dim pair
# by shaders/attn_sgmat.py): at most ATTN_SGMAT_MAX_KEYS keys, ATTN_SGMAT_ROWS query rows a
# workgroup.
ATTN_SGMAT_MAX_KEYS = _sg_gen.KEYS
ATTN_SGMAT_ROWS = _sg_gen.ROWS
ENTRIES.update({s.name: EntrySpec("attention_sgmat.wgsl", (1, 2, 3, 4, 5), ("DTM", "MASK", "CAUSAL", "MROWS"))
                for s in _sg_gen.SHAPES})


# ------------------------------------------------------------------------------------------ attention

@lowers("sdpa")
def _sdpa(lw: _Lowering, d: Dispatch, attrs: dict, fold: Optional["SdpaFold"] = None) -> None:
    """Short query blocks (decode): flash-decoding (attention_flash.wgsl attn_flash +
    attn_flash_combine) for float32 q, k, v with head dims that are multiples of 4; else split-K
    attention (attention.wgsl attn_split + attn_combine), or the one-workgroup-per-row fused kernel
    attn_rows where split-K does not fit the limits or Tuning(attn_split=False) asks for it
    (Tuning(attn_flash=False) skips the first). Otherwise scores =
    scale * q @ k^T into a float32 scratch, masked softmax into a second one, out = P @ v; blocks of
    (batch, heads, query rows) keep the scratch within one binding. Both products take 32x32 tiles
    of 4x4 per thread: their K (head dim) or N (value dim) is short (measured against the tiles
    picked by count: docs/NOTES.md).

    ``fold`` (select_all, composite path only): q, k, v read from and / or the output written to
    [B, T, H, D] tensors through strides, the permutes around the attention running nothing."""
    q, k, v, mask = (list(d.args) + [None])[:4]
    o = d.outputs[0]
    B, H, Tq, D = q.shape
    Hk, Tk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hk
    qt, kt, vt, ot = _T.of(q), _T.of(k), _T.of(v), _T.of(o)
    # element strides (batch, head, row) of each operand; the last dim is contiguous
    qs, ks, vs, os_ = (H * Tq * D, Tq * D, D), (Hk * Tk * D, Tk * D, D), (Hk * Tk * Dv, Tk * Dv, Dv), \
        (H * Tq * Dv, Tq * Dv, Dv)
    if fold is not None:
        if "q" in fold.src:
            qt, qs = _T.of(fold.src["q"]), (Tq * H * D, D, H * D)
        if "k" in fold.src:
            kt, ks = _T.of(fold.src["k"]), (Tk * Hk * D, D, Hk * D)
        if "v" in fold.src:
            vt, vs = _T.of(fold.src["v"]), (Tk * Hk * Dv, Dv, Hk * Dv)
        if fold.out is not None:
            ot, os_ = _T.of(fold.out), (Tq * H * Dv, Dv, H * Dv)
    mt = _T.of(mask) if mask is not None else None
    mst = _bcast(mask.shape, (B, H, Tq, Tk)) if mask is not None else [0, 0, 0, 0]
    short = (Tq <= lw.tuning.attn_fused_max_tq and Tk > 0 and D <= ATTN_MAX_HEAD_DIM
             and (ot.dtype != "float16" or (Dv % 2 == 0 and ot.offset % 4 == 0))
             and all(lw.fits(t, 0, t.numel) for t in (qt, kt, vt, ot) + ((mt,) if mt else ())))
    if short and fold is not None:
        raise _NoFusion()
    if short and lw.tuning.attn_flash and _sdpa_flash(lw, attrs, (qt, kt, vt, ot, mt), mst, (B, H, Tq, D, Hk, Tk, Dv)):
        return
    if short and lw.tuning.attn_split and _sdpa_split(lw, attrs, (qt, kt, vt, ot, mt), mst, (B, H, Tq, D, Hk, Tk, Dv)):
        return
    if short and Tk <= ATTN_MAX_KEYS:
        binds = [lw.bind(slot, t) for slot, t in ((1, ot), (2, qt), (3, kt), (4, vt), (5, mt))]
        (ob, oe), (qb, qe), (kb, ke), (vb, ve), (mb, me) = binds
        rows = B * H * Tq
        uni = _attn_uniform(rows, Tq, H, G, Tk, D, Dv, Hk, (qe, ke, ve, oe, me), mst, attrs, 0)
        consts = {"DT_OUT": ot.code, "DTQ": qt.code, "DTK": kt.code, "DTV": vt.code, "DTM": mt.code if mt else 0,
                  "MASK": (1 if mt.dtype == "bool" else 2) if mt else 0, "CAUSAL": bool(attrs["causal"]),
                  "AWG": 128 if Tk > 512 else 64}
        lw.emit("attn_rows", consts, uni, [ob, qb, kb, vb, mb], _row_grid(rows), "fused")
        return
    if _sdpa_sgmat(lw, attrs, (qt, kt, vt, ot, mt), (qs, ks, vs, os_), mst, (B, H, Tq, D, Hk, Tk, Dv)):
        return
    if lw.tuning.attn_tile and _sdpa_tile(lw, attrs, (qt, kt, vt, ot, mt), (qs, ks, vs, os_), mst,
                                          (B, H, Tq, D, Hk, Tk, Dv)):
        return
    head_bytes = Tq * Tk * 4
    cap = (lw.limits.max_binding_size - lw.align) // max(head_bytes, 1)  # whole heads per scratch
    # Block sizes: whole batches of heads when possible, else groups of heads (multiples of G),
    # else query rows of one head.
    if cap >= B * H:
        nb, nh, ti = B, H, Tq
    elif cap >= H:
        nb, nh, ti = cap // H, H, Tq
    elif cap >= G and cap >= 1:
        nb, nh, ti = 1, cap // G * G, Tq
    else:
        nb, nh = 1, 1
        ti = max(1, (lw.limits.max_binding_size - lw.align) // max(Tk * 4, 1))
    scr = lw.scratch("float32", nb * nh * ti * Tk)  # scores
    prob = lw.scratch("float32", nb * nh * ti * Tk)  # their softmax (not in place: no aliased bindings)
    for b0 in range(0, B, nb):
        bn = min(nb, B - b0)
        for h0 in range(0, H, nh):
            hn = min(nh, H - h0)
            for i0 in range(0, Tq, ti):
                tn = min(ti, Tq - i0)
                sb = [hn * tn * Tk, tn * Tk]
                _matmul_call(lw, _MM(qt, kt, scr, tn, Tk, D,
                                     b0 * qs[0] + h0 * qs[1] + i0 * qs[2], qs[2], 1,
                                     b0 * ks[0] + (h0 // G) * ks[1], 1, ks[2],
                                     0, Tk, 1, [bn, hn], [qs[0], qs[1]], [ks[0], ks[1]], sb,
                                     group=G, alpha=attrs["scale"], tile=32))
                m = (mt, b0 * mst[0] + h0 * mst[1] + i0 * mst[2], mst) if mt is not None else None
                _softmax_call(lw, scr, prob, bn * hn * tn, Tk, 1, False, mask=m, tq=tn, heads=hn,
                              causal=(attrs["causal_offset"] + i0) if attrs["causal"] else None)
                _matmul_call(lw, _MM(prob, vt, ot, tn, Dv, Tk, 0, Tk, 1,
                                     b0 * vs[0] + (h0 // G) * vs[1], vs[2], 1,
                                     b0 * os_[0] + h0 * os_[1] + i0 * os_[2], os_[2], 1,
                                     [bn, hn], sb, [vs[0], vs[1]], [os_[0], os_[1]], group=G,
                                     tile=32))


def _sdpa_tile(lw: _Lowering, attrs: dict, ts, strides, mst, dims) -> bool:
    """One-pass prefill attention (attention_tile.wgsl attn_tile) for float32 operands over at most
    ATTN_TILE_MAX_KEYS keys: a workgroup per (16 query rows, head, batch) holds its scores in
    registers, so no scores scratch and one dispatch instead of three. Operands are addressed by
    their (batch, head, row) ``strides``, so folded head permutes cost nothing here either. False
    (nothing emitted) where it does not apply: another dtype, more keys, a value dim that is not a
    multiple of 4 or over 64, v not vec4-aligned, a tensor over one binding, too many workgroups."""
    qt, kt, vt, ot, mt = ts
    qs, ks, vs, os_ = strides
    B, H, Tq, D, Hk, Tk, Dv = dims
    if (any(t.dtype != "float32" for t in (qt, kt, vt, ot)) or not 0 < Tk <= ATTN_TILE_MAX_KEYS
            or D < 1 or Dv % 4 or not 0 < Dv <= 64 or any(x % 4 for x in vs)
            or not all(lw.fits(t, 0, t.numel) for t in (qt, kt, vt, ot) + ((mt,) if mt else ()))
            or max(-(-Tq // ATTN_TILE_ROWS), H, B) > MAX_GROUPS):
        return False
    (ob, oe), (qb, qe), (kb, ke), (vb, ve), (mb, me) = [
        lw.bind(slot, t) for slot, t in ((1, ot), (2, qt), (3, kt), (4, vt), (5, mt))]
    if ve % 4:
        return False
    uni = _tile_uniform(attrs, dims, (qe, ke, ve, oe, me), strides, mst)
    consts = {"DTM": mt.code if mt else 0, "MASK": (1 if mt.dtype == "bool" else 2) if mt else 0,
              "CAUSAL": bool(attrs["causal"]), "CGS": 8 if Dv <= 32 else 16}
    lw.emit("attn_tile", consts, uni, [ob, qb, kb, vb, mb], (-(-Tq // ATTN_TILE_ROWS), H, B), "one-pass tile")
    return True


def _tile_uniform(attrs, dims, bases, strides, mst) -> bytes:
    """attn_tile_params.wgsl's TileParams (attn_tile's and attn_sgmat's); v's base and strides in vec4s."""
    B, H, Tq, D, Hk, Tk, Dv = dims
    qe, ke, ve, oe, me = bases
    qs, ks, vs, os_ = strides
    return _u32(Tq, H, H // Hk, Tk, D, Dv, 0, 0, qe, *qs, ke, *ks, ve // 4, *(x // 4 for x in vs), oe, *os_,
                me, *mst) + struct.pack("<ifI", attrs["causal_offset"], attrs["scale"], 0)


def _sdpa_sgmat(lw: _Lowering, attrs: dict, ts, strides, mst, dims) -> bool:
    """Prefill attention on subgroup matrices (attention_sgmat.wgsl, the attn_sgmat_d*v* entry for
    the head dims) where the session is precision="fast" and the device runs matmul_sgmat.wgsl's
    config (ops_sgmat.available): float32 operands rounded to float16 on their way into the score
    and value products, float32 softmax. A workgroup per (ATTN_SGMAT_ROWS query rows, head, batch)
    stages k and v once and runs the rows' softmax in two passes over 32-key chunks. False
    (nothing emitted) where it does not apply: exact, no config, Tuning(attn_sgmat=False), another
    dtype, more than ATTN_SGMAT_MAX_KEYS keys, head dims other than 16 or 32, q, k or v rows off
    16-byte words, a tensor over one binding, too little workgroup memory, too many workgroups or
    fewer than Tuning.attn_sgmat_min_groups; attn_tile (or the composite path) then runs it."""
    qt, kt, vt, ot, mt = ts
    qs, ks, vs, os_ = strides
    B, H, Tq, D, Hk, Tk, Dv = dims
    shape = _sg_gen.shape_for(D, Dv)
    if (not lw.tuning.attn_sgmat or lw.precision != "fast" or not ops_sgmat.available(lw) or shape is None
            or any(t.dtype != "float32" for t in (qt, kt, vt, ot)) or not 0 < Tk <= ATTN_SGMAT_MAX_KEYS
            or any(x % 4 for x in qs + ks + vs)
            or lw.limits.max_workgroup_storage < shape.workgroup_bytes()
            or lw.limits.max_workgroup_invocations < _sg_gen.THREADS
            or not all(lw.fits(t, 0, t.numel) for t in (qt, kt, vt, ot) + ((mt,) if mt else ()))
            or max(-(-Tq // ATTN_SGMAT_ROWS), H, B) > MAX_GROUPS
            # a workgroup's passes are one long chain (~11 us on an H100): MiniLM 1x128's 12 of them
            # took 10.8 us a layer against attn_tile's 8.7 (96 workgroups), 4x128's 48 10.8 against
            # 13.8 (docs/NOTES.md)
            or -(-Tq // ATTN_SGMAT_ROWS) * H * B < lw.tuning.attn_sgmat_min_groups):
        return False
    (ob, oe), (qb, qe), (kb, ke), (vb, ve), (mb, me) = [
        lw.bind(slot, t) for slot, t in ((1, ot), (2, qt), (3, kt), (4, vt), (5, mt))]
    if qe % 4 or ke % 4 or ve % 4:
        return False
    consts = {"DTM": mt.code if mt else 0, "MASK": (1 if mt.dtype == "bool" else 2) if mt else 0,
              "CAUSAL": bool(attrs["causal"]), "MROWS": bool(mt is not None and mst[2] != 0)}
    lw.emit(shape.name, consts, _tile_uniform(attrs, dims, (qe, ke, ve, oe, me), strides, mst),
            [ob, qb, kb, vb, mb], (-(-Tq // ATTN_SGMAT_ROWS), H, B), "subgroup matrices")
    return True


def _attn_uniform(rows, Tq, H, G, Tk, D, Dv, Hk, bases, mst, attrs, nc) -> bytes:
    """attention.wgsl's AttnParams."""
    return _u32(rows, Tq, H, G, Tk, D, Dv, Hk, *bases, *mst) \
        + struct.pack("<ifI", attrs["causal_offset"], attrs["scale"], nc)


def _sdpa_split(lw: _Lowering, attrs: dict, ts, mst, dims) -> bool:
    """Split-K decode attention (attention.wgsl attn_split + attn_combine): workgroups over
    (batch x kv head, blocks of ATTN_SPLIT_ROWS query rows sharing it, key chunks) write per-chunk
    partials to a float32 scratch; a combine pass per query row merges them. False (nothing
    emitted) when the partials or the grid do not fit the device limits: attn_rows takes over."""
    qt, kt, vt, ot, mt = ts
    B, H, Tq, D, Hk, Tk, Dv = dims
    G = H // Hk
    rows, gr = B * H * Tq, G * Tq
    rblocks = -(-gr // ATTN_SPLIT_ROWS)
    # One thread per key of a chunk: 64-key chunks, or 32 when that is too few workgroups to
    # spread over a discrete GPU's multiprocessors (a decode step has a handful of rows).
    awg = 64 if B * Hk * rblocks * -(-Tk // 64) >= lw.tuning.attn_split_min_groups else 32
    nc = -(-Tk // awg)
    part = rows * nc * (Dv + 2)
    if (nc > MAX_GROUPS or rblocks > MAX_GROUPS or B * Hk > MAX_GROUPS
            or _up(part * 4, 4) > lw.limits.max_binding_size):
        return False
    scr = lw.scratch("float32", part)
    (sb, _), (qb, qe), (kb, ke), (vb, ve), (mb, me) = [
        lw.bind(slot, t) for slot, t in ((1, scr), (2, qt), (3, kt), (4, vt), (5, mt))]
    consts = {"DTQ": qt.code, "DTK": kt.code, "DTV": vt.code, "DTM": mt.code if mt else 0,
              "MASK": (1 if mt.dtype == "bool" else 2) if mt else 0, "CAUSAL": bool(attrs["causal"]), "AWG": awg}
    lw.emit("attn_split", consts, _attn_uniform(rows, Tq, H, G, Tk, D, Dv, Hk, (qe, ke, ve, 0, me), mst, attrs, nc),
            [sb, qb, kb, vb, mb], (nc, rblocks, B * Hk), "split-K partials")
    (ob, oe), (pb, _) = lw.bind(1, ot), lw.bind(6, scr)
    lw.emit("attn_combine", {"DT_OUT": ot.code},
            _attn_uniform(rows, Tq, H, G, Tk, D, Dv, Hk, (0, 0, 0, oe, 0), mst, attrs, nc),
            [ob, pb], _row_grid(rows), "split-K combine")
    return True


def _sdpa_flash(lw: _Lowering, attrs: dict, ts, mst, dims) -> bool:
    """Flash-decoding (attention_flash.wgsl): attn_flash workgroups over (key chunk, block of
    Tuning.attn_flash_rows query rows sharing a kv head, batch x kv head) write each row's per-chunk
    (maximum, exp-sum, unnormalised P v) to a float32 scratch, one workgroup per query row merges
    them. Each attn_flash thread issues all of its K, V, mask and q loads before its first barrier
    (attn_split walked the head dim and then the chunk's values as chains of dependent loads).
    Chunks of 32 keys where that still gives Tuning.attn_split_min_groups workgroups, else 16.
    False (nothing emitted) where it does not apply: q, k, v (so the output) not float32, a head
    dim that is not a multiple of 4 or over ATTN_FLASH_MAX_DIM, q, k or v off a 16-byte boundary,
    partials or grid over the device limits."""
    got = _flash_partials(lw, attrs, ts, mst, dims)
    if got is None:
        return False
    (ob, oe), (pb, _) = lw.bind(1, ts[3]), lw.bind(6, got.scr)
    uni = got.uniform[:44] + _u32(oe) + got.uniform[48:]  # out_base: word 11
    lw.emit("attn_flash_combine", {}, uni, [ob, pb], _row_grid(got.rows), "flash-decoding combine")
    return True


@dataclass(frozen=True)
class FlashPartials:
    """What attn_flash wrote for a consumer that merges it (attn_flash_combine, or a product's
    prologue: quant_mm_body.wgsl qgemv_attn): the float32 scratch ``scr`` holding ``rows`` (B H Tq)
    query rows' ``nc`` chunks, outputs [rows][nc][Dv] from element 0 and (maximum, exp-sum)
    pairs [rows][nc][2] from element ``hdr``; ``uniform`` is attn_flash's FlashParams."""

    scr: _T
    rows: int
    nc: int
    dv: int
    heads: int
    tq: int
    hdr: int
    uniform: bytes


def flash_partials(lw: _Lowering, d: Dispatch, attrs: dict, keys: Optional[int] = None) -> Optional[FlashPartials]:
    """attn_flash alone for sdpa dispatch ``d`` (no head permutes folded), where the decode path
    of :func:`_sdpa` would run flash-decoding: its partials, or None (nothing emitted). ``keys``:
    keys per chunk (16 or 32) where ``Tuning.attn_flash_keys`` leaves it open (None: the rule)."""
    q, k, v, mask = (list(d.args) + [None])[:4]
    o = d.outputs[0]
    B, H, Tq, D = q.shape
    Hk, Tk, Dv = k.shape[1], k.shape[2], v.shape[3]
    ts = tuple(_T.of(t) for t in (q, k, v, o)) + ((_T.of(mask),) if mask is not None else (None,))
    mst = _bcast(mask.shape, (B, H, Tq, Tk)) if mask is not None else [0, 0, 0, 0]
    if not (lw.tuning.attn_flash and Tq <= lw.tuning.attn_fused_max_tq and Tk > 0 and D <= ATTN_MAX_HEAD_DIM
            and all(lw.fits(t, 0, t.numel) for t in ts if t is not None)):
        return None
    return _flash_partials(lw, attrs, ts, mst, (B, H, Tq, D, Hk, Tk, Dv), keys)


def _flash_partials(lw: _Lowering, attrs: dict, ts, mst, dims, keys: Optional[int] = None) -> Optional[FlashPartials]:
    """attn_flash's call (see :func:`_sdpa_flash`), or None where it does not apply."""
    qt, kt, vt, ot, mt = ts
    B, H, Tq, D, Hk, Tk, Dv = dims
    if (any(t.dtype != "float32" for t in (qt, kt, vt, ot))
            or D % 4 or Dv % 4 or not 0 < D <= ATTN_FLASH_MAX_DIM or not 0 < Dv <= ATTN_FLASH_MAX_DIM
            or lw.align % 16 or any(t.offset % 16 for t in (qt, kt, vt))):
        return None
    G = H // Hk
    rows, gr = B * H * Tq, G * Tq
    rwg = lw.tuning.attn_flash_rows
    if not 1 <= rwg <= ATTN_FLASH_ROWS:
        raise ValueError(f"Tuning(attn_flash_rows={rwg}): 1..{ATTN_FLASH_ROWS}")
    rblocks = -(-gr // rwg)
    ck = lw.tuning.attn_flash_keys or keys
    if ck is None:
        ck = 32 if B * Hk * rblocks * -(-Tk // 32) >= lw.tuning.attn_split_min_groups else 16
    elif ck not in (16, 32):
        raise ValueError(f"Tuning(attn_flash_keys={ck}): 16 or 32")
    nc = -(-Tk // ck)
    hdr = rows * nc * Dv
    part = _up(hdr + 2 * rows * nc, 4)  # whole vec4s: attn_flash_combine reads them as such
    if nc > MAX_GROUPS or rblocks > MAX_GROUPS or B * Hk > MAX_GROUPS or part * 4 > lw.limits.max_binding_size:
        return None
    (qb, qe), (kb, ke), (vb, ve), (mb, me) = [lw.bind(slot, t) for slot, t in ((2, qt), (3, kt), (4, vt), (5, mt))]
    scr = lw.scratch("float32", part)
    sb, _ = lw.bind(1, scr)
    uni = _u32(rows, Tq, H, G, Tk, D // 4, Dv // 4, Hk, qe // 4, ke // 4, ve // 4, 0, me, *mst) \
        + struct.pack("<ifI", attrs["causal_offset"], attrs["scale"], nc) + _u32(hdr, 0, 0, 0)
    consts = {"CK": ck, "RWG": rwg, "DTM": mt.code if mt else 0,
              "MASK": (1 if mt.dtype == "bool" else 2) if mt else 0, "CAUSAL": bool(attrs["causal"])}
    lw.emit("attn_flash", consts, uni, [sb, qb, kb, vb, mb], (nc, rblocks, B * Hk), f"flash-decoding {ck}-key chunks")
    return FlashPartials(scr, rows, nc, Dv, H, Tq, hdr, uni)
