"""Lowering of the ops that read a packed GGUF block weight (dtypes.QUANT_BLOCKS: q4_0, q4_1,
q8_0; ops.PACKED_WEIGHT_ARGS): ``linear`` (weight [N, K], blocks along K) onto
shaders/quant_mm.wgsl, ``embedding`` (table [V, D]) onto shaders/quant_embed.wgsl (pure Python).

``kernel.lowering_of`` sends a dispatch here when an argument is packed, so the float kernels
(ops_matmul.py, ops_layout.py) never see one. The weight is bound as the raw file bytes: a packed
row is ``packed_row_bytes`` long and may start at 2 mod 4 (q4_0's 18- and q8_0's 34-byte blocks),
so the kernels take a byte offset and read whole u32 words around it. Everything else the
kernels touch is float32 (X as vec4s, the bias, the residual, the outputs); other storage goes
through a float32 scratch here, so the shaders have one fast path.

- ``linear``: ``qgemv`` for M <= ``Tuning.qgemv_max_m`` (8; decode), else the ``qmm`` tiles
  (prefill), split along K into ``qmm`` partials and a ``qmm_sum`` while there are too few tiles
  to fill a big GPU (the float kernels' rule, ``Tuning.ksplit_*``). Both take the fused epilogues
  of ``plan.fusion.epilogue_fusions`` (gelu, + residual) and sibling linears
  (``plan.fusion._siblings``: the same input, same-shaped weights of one packed type that the
  executor placed back to back) as one product over all their weight rows. A weight larger
  than one binding is split into row ranges, an x or output larger than one into ranges of x's
  rows, one call each.
- ``embedding``: ``qembed`` dequantizes the gathered rows to float32; a table larger than one
  binding is split into row ranges.
- the planner's concatenated products (``plan.fusion`` gemm_cat, lowered by ops_fused.py):
  :func:`cat_gemv` (M <= 8: one ``qgemv_cat`` dispatch over up to three weights, each bound
  apart, writing the concatenated row or silu(gate) * up) and :func:`cat_products` (more rows:
  one product per weight into its column block of the concatenation). With the planner's norm
  prologue (``Fusion.norm``, :class:`NormPrologue`) :func:`cat_gemv` runs ``qgemv_cat_norm``:
  the add and rms norm before the product computed by every workgroup, no kernel of their own;
  :func:`cat_gemv_rope` (``qgemv_rope``) also takes the rope_kv group after q / k / v as its stores.
- the planner's ``sdpa_linear`` (an attention into the product after it, decode rows; lowered by
  ops_fused.py): ``linear_packed`` with ``attn``, one ``qgemv_attn`` dispatch whose workgroups
  merge attn_flash's partials into their X rows before the product (no attn_flash_combine).

The decode kernels (qgemv, qgemv_cat, qgemv_cat_norm) come from one of two modules with the same
entry points: shaders/quant_mm_sg.wgsl (subgroup sums, a weight row per subgroup) on devices with
subgroups, shaders/quant_mm.wgsl (workgroup-memory trees) elsewhere or with
``Tuning.qgemv_subgroups`` off (:func:`_gemv_kernel`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .. import dtypes as _dt
from ..errors import DeviceError
from ..plan.fusion import Epilogue
from ..plan.types import BufferRef, Dispatch, TensorRef
from .kernel import (DUMMY, ENTRIES, MAX_GROUPS, Binding, EntrySpec, _grid, _Lowering, _NoFusion, _numel, _T, _u32,
                     _up, lowers)
from .ops_attention import FlashPartials

QT = {"q4_0": 0, "q4_1": 1, "q8_0": 2}  # quant.wgsl QT
GEMV_MAX_M = 8  # qgemv holds one accumulator per X row in named registers (quant_mm.wgsl GM)
_BLOCK = 32  # values per block of every packed type (dtypes.QUANT_BLOCKS)
assert all(b == _BLOCK for b, _ in _dt.QUANT_BLOCKS.values()) and set(QT) == set(_dt.QUANT_BLOCKS)

# qgemv whose X rows are merged from the split-key attention's partials (bound at X) first
ENTRIES["qgemv_attn"] = EntrySpec("quant_mm.wgsl", (1, 2, 3, 4, 5, 6, 7),
                                  ("QT", "TPR", "TP2", "ROWS", "GM", "BIAS", "ACT", "RES", "NC", "CAT", "NORM", "HS", "UPL",
                                   "RPT"))  # RPT: qg_main's (the LM head's two rows a thread row), never set here: 1
ENTRIES["qgemv_cat"] = EntrySpec("quant_mm.wgsl", (1, 2, 3, 6, 7),
                                 ("QT", "TPR", "TP2", "ROWS", "GM", "CAT", "NORM", "HS", "UPL"))
# RK: its prologue reads through X / R (false, the default) or S (qgemv_rope)
ENTRIES["qgemv_cat_norm"] = EntrySpec("quant_mm.wgsl", (1, 2, 3, 4, 5, 6, 7, 8),
                                      ("QT", "TPR", "TP2", "ROWS", "GM", "CAT", "NORM", "HS", "HAS_W", "UPL", "RK"))
# qgemv_cat_norm with rope_kv's stores: no OUT (slot 1); X and R (2, 5) are dummies, every tensor but
# the weights is read and written through S (8)
ENTRIES["qgemv_rope"] = EntrySpec("quant_mm.wgsl", (2, 3, 4, 5, 6, 7, 8),
                                  ("QT", "TPR", "TP2", "ROWS", "GM", "CAT", "NORM", "HS", "HAS_W", "UPL", "RK"))


@dataclass(frozen=True)
class NormPrologue:
    """The rms norm a concatenated product computes before it (``plan.fusion`` ``Fusion.norm``),
    as the kernels read it: h = rms_norm(src) * w, where with ``y`` src = x + y (``src`` holds x)
    is also stored to ``s``. The kernels take float32 tensors of M rows of K only (``ok``)."""

    src: TensorRef
    y: Optional[TensorRef]
    s: Optional[TensorRef]
    w: Optional[TensorRef]
    eps: float

    @classmethod
    def of(cls, norm: dict) -> "NormPrologue":
        if norm["add"] is not None:
            return cls(norm["x"], norm["y"], norm["s"], norm["w"], float(norm["eps"]))
        return cls(norm["src"], None, None, norm["w"], float(norm["eps"]))

    @property
    def mode(self) -> int:
        """The shaders' NORM: 1 rms norm of src, 2 the add first."""
        return 2 if self.y is not None else 1

    def ok(self, M: int, K: int) -> bool:
        ts = [t for t in (self.src, self.y, self.s) if t is not None]
        return all(t.dtype == "float32" and _numel(t.shape) == M * K for t in ts) and \
            (self.w is None or (self.w.dtype == "float32" and _numel(self.w.shape) == K))

    def bind(self, lw: _Lowering, src_slot: int, y_slot: int, w_slot: int, s_slot: int, others: Sequence[Binding]):
        """Bindings (src, y, w, s) and the element index of each tensor's start in its binding
        (dummies for absent ones). Raises _NoFusion where s shares bytes with another binding
        (WebGPU: no two overlapping writable bindings; the lowering would read a snapshot)."""
        got = []
        for slot, t in ((src_slot, self.src), (y_slot, self.y), (w_slot, self.w), (s_slot, self.s)):
            got.append(lw.bind(slot, _T.of(t)) if t is not None else (Binding(slot, DUMMY), 0))
        sb = got[3][0]
        if self.s is not None and any(_clash(sb, b) for b in [g for g, _ in got[:3]] + list(others)):
            raise _NoFusion()
        return got

    def eps_word(self) -> int:
        return struct.unpack("<I", struct.pack("<f", self.eps))[0]


def _clash(a: Binding, b: Binding) -> bool:
    x, y = a.buf, b.buf
    return "dummy" not in (x.space, y.space) and x.space == y.space and x.index == y.index and \
        x.offset < y.offset + y.nbytes and y.offset < x.offset + x.nbytes


QPARAMS_WORDS = 36  # quant_mm_body.wgsl's QParams (a multiple of four: uniform structs are 16-byte sized)


def _params(*words: int) -> bytes:
    """quant_mm.wgsl's QParams: :data:`QPARAMS_WORDS` words (the first ones given, the rest zero)."""
    return _u32(*(list(words) + [0] * (QPARAMS_WORDS - len(words))))


SG_SHADER = "quant_mm_sg.wgsl"  # quant_mm.wgsl's qgemv kernels with subgroup-sum reductions


def _gemv_kernel(lw: _Lowering, nb: int, pairs: bool = False, sg_rows: Optional[int] = None) -> Tuple[int, int, Optional[str]]:
    """(TPR, ROWS, shader) of a qgemv / qgemv_cat(_norm) call. On a device with subgroups
    quant_mm_sg.wgsl with as many lanes per weight row as a subgroup has (the size the device
    measured: each row is then one subgroup, whose sum needs no barrier), or
    ``Tuning.qgemv_sg_lanes``, and ``qgemv_sg_rows`` rows (even for gate / up ``pairs``),
    unless ``Tuning.qgemv_subgroups`` is off; else quant_mm.wgsl's shape (:func:`_gemv_shape`)
    and module (None: the entry's own). ``sg_rows``: rows instead of ``qgemv_sg_rows``."""
    t = lw.tuning
    lanes = t.qgemv_sg_lanes or lw.subgroup_size
    if not (t.qgemv_subgroups and lw.subgroups and lanes):
        tpr, rows = _gemv_shape(nb)
        return tpr, rows, None
    rows = max(1, sg_rows or t.qgemv_sg_rows)
    rows += rows % 2 if pairs else 0
    if lanes < 4 or lanes > 128 or lanes & (lanes - 1) or lanes * rows > 256:
        raise ValueError(f"Tuning.qgemv_sg_lanes {lanes} x qgemv_sg_rows {rows}: lanes must be a power of two "
                         f"in 4..128 and lanes x rows at most 256 (WebGPU's invocations per workgroup)")
    return lanes, rows, SG_SHADER


def _row_consts(tpr: int, nb: int, shader: Optional[str]) -> dict:
    """quant_mm.wgsl's tree: TP2 (TPR rounded up to a power of two), two units per lane and trip.
    The subgroup module: no TP2 (its entry points do not use it, and Dawn refuses a constant an
    entry point does not use); the fewest units per lane and trip (2, 3 or 4) that give a row the
    fewest trips (4 a trip at most): a unit past the row is a repeated load, and at SmolLM2's K =
    576 (72 units over 32 lanes: one trip) and 1536 (two) three a trip ran faster than four on an
    H100 (docs/NOTES.md)."""
    if shader is None:
        return {"TP2": 1 << (tpr - 1).bit_length()}
    units = 4 * nb
    fewest = -(-units // (4 * tpr))
    return {"UPL": next(u for u in (2, 3, 4) if -(-units // (u * tpr)) == fewest)}


def _gemv_shape(nb: int) -> Tuple[int, int]:
    """(TPR, ROWS) of qgemv: a row's units (quarter blocks) in trips of two per lane over at most
    64 lanes, divided evenly (K = 576 gives 36 lanes of one trip, K = 4096 64 lanes of 4)."""
    units = 4 * nb
    trips = max(1, -(-units // 128))
    tpr = max(1, -(-units // (2 * trips)))
    return tpr, 256 // tpr


# ------------------------------------------------------------------------------------------ bindings

def _row_ranges(lw: _Lowering, w: TensorRef, rows: int, row_bytes: int, what: str) -> List[Tuple[int, int]]:
    """Rows [r0, r1) of a packed tensor per call so that each call's rows fit one binding."""
    if rows == 0:
        return []
    if row_bytes == 0:
        return [(0, rows)]
    # A binding starts at the alignment boundary below its first row (up to align - 2 bytes
    # before it) and ends at the word holding its last byte (up to 3 bytes after).
    cap = (lw.limits.max_binding_size - lw.align - 4) // row_bytes
    if cap < 1:
        raise lw.too_big(_words(w, what), row_bytes + lw.align, "one row is larger than a binding")
    return [(r, min(rows, r + cap)) for r in range(0, rows, cap)]


def _words(w: TensorRef, what: str) -> _T:
    """The packed tensor as a run of u32 words (for messages: its name)."""
    return _T(w.buf.space, w.buf.index, w.buf.offset, "int32", -(-w.buf.nbytes // 4), what)


def _bind_rows(lw: _Lowering, slot: int, w: TensorRef, r0: int, r1: int, row_bytes: int,
               what: str) -> Tuple[Binding, int]:
    """Binding of rows [r0, r1) of packed ``w`` (of rows that may run past ``w``'s own when
    siblings' weights follow it) and the byte offset of row r0 inside it."""
    if row_bytes == 0 or r1 <= r0:
        return Binding(slot, DUMMY), 0  # K == 0: nothing is read
    if w.buf.offset % 4:
        # Never planned (device buffers of weights start at offset_alignment multiples): the
        # kernels read whole words and know only even byte offsets inside them.
        raise DeviceError(f"{lw.label}: {what} sits at byte offset {w.buf.offset}, not a multiple of 4")
    start = w.buf.offset + r0 * row_bytes
    end = w.buf.offset + r1 * row_bytes
    a = start // lw.align * lw.align
    size = _up(end, 4) - a
    if size > lw.limits.max_binding_size:
        raise lw.too_big(_words(w, what), size)
    return Binding(slot, BufferRef(w.buf.space, w.buf.index, a, size)), start - a


def _float32_in(lw: _Lowering, slot: int, t: _T) -> Tuple[Binding, int]:
    """Binding of a float32 view of input ``t`` and its element base: ``t`` itself, or (other
    storage) a float32 scratch copy."""
    if t.numel == 0:
        return Binding(slot, DUMMY), 0
    if t.dtype != "float32":
        scr = lw.scratch("float32", t.numel)
        lw.copy_tensor(t, scr, [t.numel], what=f"{t.name} as float32")
        t = scr
    return lw.bind(slot, t)


# ------------------------------------------------------------------------------------------ linear

def _product(lw: _Lowering, x: TensorRef, w: TensorRef, outs: Sequence, bias: Optional[_T],
             bias_mode: int, act: int = 0, res: Optional[TensorRef] = None, out_sm: Optional[int] = None,
             attn: Optional[FlashPartials] = None) -> None:
    """OUT_z = x @ W_z^T (+ bias, epilogue) for the len(outs) linears whose weights lie back to back
    from ``w`` on (one linear: outs == [its output]). Calls cover row ranges of the weight and,
    where x or an output is over one binding, ranges of x's rows. An output may be a float32
    ``_T`` written with rows ``out_sm`` elements apart (a column block of a concatenation).

    ``attn``: x is the attention output whose partials these are, never read: each ``qgemv_attn``
    workgroup merges them into its X rows first (the planner's sdpa_linear group). Raises
    _NoFusion where that does not apply (more rows than qgemv takes, x not the partials' rows,
    the rows over workgroup memory, a call per range of x's rows)."""
    n, k = w.shape
    nc = len(outs)
    m = _numel(x.shape[:-1])
    if m == 0 or n == 0:
        return
    nb = k // _BLOCK
    rows = nc * n
    row_bytes = _dt.packed_row_bytes(w.dtype, k)
    name = f"weight (value {w.value}, {w.dtype})" if nc == 1 else f"weights of {nc} sibling linears ({w.dtype})"
    # X as float32 vec4 rows: in place when it is float32 at a 16-byte offset (then every row
    # range starts at a vec4 too: rows are multiples of 128 bytes), else a float32 copy.
    xt = _T.of(x)
    if attn is not None:
        xt = attn.scr  # bound as X: the partials, read as vec4s (attn_flash's layout is vec4-aligned)
    elif k and (xt.dtype != "float32" or xt.offset % 16 or lw.align % 16):
        scr = lw.scratch("float32", xt.numel)
        lw.copy_tensor(xt, scr, [xt.numel], what=f"{xt.name} as float32")
        xt = scr
    # Outputs: float32 written in place, anything else through a float32 scratch cast afterwards.
    sm = n if out_sm is None else out_sm
    targets: List[_T] = []
    finish = []
    for o in outs:
        if isinstance(o, _T):
            if o.dtype != "float32":
                raise DeviceError(f"{lw.label}: a packed product writes float32 scratch, not {o.dtype}")
            targets.append(o)
            continue
        t = _T.of(o)
        if t.dtype != "float32":
            scr = lw.scratch("float32", t.numel)
            finish.append((scr, t, tuple(o.shape)))
            t = scr
        targets.append(t)
    if bias is not None:
        bb, be = _float32_in(lw, 4, bias)
    else:
        bb, be = Binding(4, DUMMY), 0
    rt = None
    if res is not None:
        rt = _T.of(res)
        if rt.dtype != "float32" or rt.numel != m * n:
            raise DeviceError(f"{lw.label}: the fused residual must be float32 [{m}, {n}], got {rt.dtype} of {rt.numel}")
    epi = {"BIAS": bias_mode if bias is not None else 0, "ACT": act, "RES": res is not None, "NC": nc}
    qt = QT[w.dtype]
    gemv = m <= min(lw.tuning.qgemv_max_m, GEMV_MAX_M)
    # Rows of x (and of every output and the residual) per call: all of them unless one is over
    # a binding (a long prefill into a vocabulary-sized output).
    per_row = 4 * max(k, sm)
    m_step = max(1, min(m, (lw.limits.max_binding_size - lw.align) // per_row))
    w_ranges = _row_ranges(lw, w, rows, row_bytes, name)
    if attn is not None:
        tpr, rows_wg, _ = _gemv_kernel(lw, nb, sg_rows=lw.tuning.attn_product_rows)
        if not (gemv and m_step == m and k == attn.heads * attn.dv and m * k == attn.rows * attn.dv
                and 4 * m * k + 32 * (tpr + 1) * rows_wg <= lw.limits.max_workgroup_storage):
            raise _NoFusion()
        _product_attn(lw, attn, w, m, k, nb, row_bytes, name, targets, sm, bias, bb, be, rt, epi, qt, w_ranges)
        for scr, t, shape in finish:
            lw.copy_tensor(scr, t, shape, what="float16 store")
        return
    partials: Optional[_T] = None  # the split-K scratch, made by the first call that splits
    max_partials = KSPLIT_MAX * min(m, m_step) * max((r1 - r0 for r0, r1 in w_ranges), default=0)
    for m0 in range(0, m, m_step):
        m1 = min(m, m0 + m_step)
        mc = m1 - m0
        if k:
            xb, xe = lw.bind(2, xt, m0 * k, m1 * k)
            if xe % 4:
                raise DeviceError(f"{lw.label}: {xt.name} rows do not start at a 16-byte boundary in a binding "
                                  f"(offset alignment {lw.align})")
        else:
            xb, xe = Binding(2, DUMMY), 0
        obinds, bases = [], []
        for slot, t in zip((1, 6, 7), targets):
            b, e = lw.bind(slot, t, m0 * sm, (m1 - 1) * sm + n)
            obinds.append(b)
            bases.append(e)
        obinds += [Binding(slot, DUMMY) for slot in (6, 7)[nc - 1:]]
        bases += [0] * (3 - nc)
        rb, re_ = lw.bind(5, rt, m0 * n, m1 * n) if rt is not None else (Binding(5, DUMMY), 0)
        for r0, r1 in w_ranges:
            wb, wbase = _bind_rows(lw, 3, w, r0, r1, row_bytes, name)
            uni = _params(mc, k, nb, r0, r1, n, xe // 4, k // 4, wbase, be, re_, *bases, sm)
            binds = [obinds[0], xb, wb, bb, rb] + obinds[1:]
            part = (f" rows {r0}..{r1 - 1}" if (r0, r1) != (0, rows) else "") + \
                (f" x rows {m0}..{m1 - 1}" if mc != m else "")
            if gemv:
                tpr, rows_wg, shader = _gemv_kernel(lw, nb)
                consts = dict(epi, QT=qt, TPR=tpr, ROWS=rows_wg, GM=mc, **_row_consts(tpr, nb, shader))
                t = lw.tuning
                # two weight rows a thread row (RPT 2: gemv_two, both rows' loads in flight at once)
                # where rows take one trip, x has at most 4 rows and enough workgroups remain
                if shader and t.qgemv_pair_min_groups and mc <= 4 and consts["UPL"] >= 3 and \
                        4 * nb <= consts["UPL"] * tpr and -(-(r1 - r0) // (2 * rows_wg)) >= t.qgemv_pair_min_groups:
                    consts["RPT"] = 2
                per_wg = rows_wg * consts.get("RPT", 1)
                lw.emit("qgemv", consts, uni, binds, _grid(-(-(r1 - r0) // per_wg), 1),
                        f"qgemv {w.dtype} {tpr}x{rows_wg}{'x2' if per_wg > rows_wg else ''}"
                        f"{' subgroups' if shader else ''}{part}", shader=shader)
                continue
            # 32 x 32 tiles (64 threads) unless there are rows enough for 64 and columns enough
            # for 64-wide tiles to still give big_tile_min_groups workgroups.
            wy = 16 if mc >= 64 else 8
            wx = 16 if -(-mc // (4 * wy)) * -(-(r1 - r0) // 64) >= lw.tuning.big_tile_min_groups else 8
            gx, gy = -(-(r1 - r0) // (4 * wx)), -(-mc // (4 * wy))
            if gx > MAX_GROUPS or gy > MAX_GROUPS:
                raise DeviceError(f"{lw.label}: a {mc}x{r1 - r0} product needs more than {MAX_GROUPS} tiles per dimension")
            ks = _ksplit(lw, gx * gy, nb, mc * (r1 - r0))
            tile = f"qmm {w.dtype} {4 * wy}x{4 * wx}"
            if ks == 1:
                lw.emit("qmm", dict(epi, QT=qt, WX=wx, WY=wy, KSPLIT=1), uni, binds, (gx, gy, 1), f"{tile}{part}")
                continue
            # Split-K: partials [ks][mc][rows of the call] into a float32 scratch (one for every
            # call of this dispatch: each call's sum runs before the next call's product), summed
            # with the bias and the epilogue by qmm_sum.
            if partials is None:
                partials = lw.scratch("float32", _up(max_partials, 4))
            pb, _ = lw.bind(1, partials, 0, ks * mc * (r1 - r0))
            lw.emit("qmm", dict(epi, QT=qt, WX=wx, WY=wy, KSPLIT=ks), uni, [pb] + binds[1:], (gx, gy, ks),
                    f"{tile} split-K {ks}{part}")
            sb, _ = lw.bind(2, partials, 0, _up(ks * mc * (r1 - r0), 4))
            lw.emit("qmm_sum", dict(epi, KSPLIT=ks), uni, [obinds[0], sb, bb, rb] + obinds[1:],
                    _grid(mc * (r1 - r0)), f"split-K {ks} sum{part}")
    for scr, t, shape in finish:
        lw.copy_tensor(scr, t, shape, what="float16 store")


def _product_attn(lw: _Lowering, attn: FlashPartials, w: TensorRef, m: int, k: int, nb: int, row_bytes: int,
                  name: str, targets: List[_T], sm: int, bias, bb: Binding, be: int, rt: Optional[_T], epi: dict,
                  qt: int, w_ranges) -> None:
    """_product's ``qgemv_attn`` calls (one per range of weight rows): X at binding 2 is the
    attention's partials; words 24..30 of the uniform say where (quant_mm_body.wgsl QParams)."""
    pb, pe = lw.bind(2, attn.scr)
    if pe % 4:
        raise _NoFusion()  # the partials are read as vec4s
    n = w.shape[0]
    obinds, bases = [], []
    for slot, t in zip((1, 6, 7), targets):
        b, e = lw.bind(slot, t, 0, (m - 1) * sm + n)
        obinds.append(b)
        bases.append(e)
    obinds += [Binding(slot, DUMMY) for slot in (6, 7)[len(targets) - 1:]]
    bases += [0] * (3 - len(targets))
    rb, re_ = lw.bind(5, rt, 0, m * n) if rt is not None else (Binding(5, DUMMY), 0)
    tpr, rows_wg, shader = _gemv_kernel(lw, nb, sg_rows=lw.tuning.attn_product_rows)
    for r0, r1 in w_ranges:
        wb, wbase = _bind_rows(lw, 3, w, r0, r1, row_bytes, name)
        words = [m, k, nb, r0, r1, n, 0, k // 4, wbase, be, re_, *bases, sm] + [0] * 9
        uni = _params(*words, attn.rows, attn.nc, attn.dv // 4, attn.heads, attn.tq, pe // 4, attn.hdr)
        part = f" rows {r0}..{r1 - 1}" if (r0, r1) != (0, len(targets) * n) else ""
        lw.emit("qgemv_attn", dict(epi, QT=qt, TPR=tpr, ROWS=rows_wg, GM=m, NORM=3, HS=m * k // 4,
                                   **_row_consts(tpr, nb, shader)),
                uni, [obinds[0], pb, wb, bb, rb] + obinds[1:], _grid(-(-(r1 - r0) // rows_wg), 1),
                f"attention combine + qgemv {w.dtype} {tpr}x{rows_wg}{' subgroups' if shader else ''}{part}",
                shader=shader)


# ------------------------------------------------------------------------------------------ gemm_cat

def _x_float32(lw: _Lowering, x: TensorRef) -> _T:
    """x as float32 rows at a 16-byte offset (the vec4 reads of quant_mm.wgsl): x itself, or a copy."""
    xt = _T.of(x)
    if xt.dtype != "float32" or xt.offset % 16 or lw.align % 16:
        scr = lw.scratch("float32", xt.numel)
        lw.copy_tensor(xt, scr, [xt.numel], what=f"{xt.name} as float32")
        xt = scr
    return xt


def cat_gemv(lw: _Lowering, x: TensorRef, ws: Sequence[TensorRef], out: _T, out_sm: int,
             parts: Optional[Tuple[int, int]] = None, norm: Optional[NormPrologue] = None) -> None:
    """One ``qgemv_cat`` dispatch: x [M <= 8, K] against the packed weights ``ws`` (one dtype and
    K, 1 to 3, each bound apart). ``parts`` None: ``out`` (float32, rows ``out_sm`` apart) gets the
    concatenated row [x.W_0 | x.W_1 | x.W_2]; ``parts`` = (gate, up), indices into ``ws`` of two
    weights of N rows each: out[m, n] = silu(x.W_gate[n]) * (x.W_up[n]). Raises _NoFusion where
    the kernel does not apply (more rows, weights of different types, a weight over one binding):
    the linears then run apart. ``norm``: x is h = rms_norm(...) of that prologue, computed in the
    same dispatch (``qgemv_cat_norm``; it raises _NoFusion where that kernel does not apply)."""
    K = x.shape[-1] if x.shape else 0
    M = _numel(x.shape[:-1])
    dt = ws[0].dtype
    if not (1 <= M <= min(lw.tuning.qgemv_max_m, GEMV_MAX_M) and K > 0 and K % _BLOCK == 0 and 1 <= len(ws) <= 3
            and all(w.dtype == dt and _dt.is_packed(dt) and len(w.shape) == 2 and w.shape[1] == K for w in ws)
            and out.dtype == "float32"):
        raise _NoFusion()
    nb = K // _BLOCK
    row_bytes = _dt.packed_row_bytes(dt, K)
    ns = [w.shape[0] for w in ws]
    if parts is None:
        ncols = sum(ns)
        cat, g_part, u_part = 1, 0, 0
    else:
        g_part, u_part = parts
        if ns[g_part] != ns[u_part]:
            raise _NoFusion()
        ncols = ns[g_part]
        cat = 2
    wbinds, wbases = _cat_weights(lw, ws, row_bytes)
    tpr, rows_wg, shader = _gemv_kernel(lw, nb, pairs=parts is not None)
    # workgroup memory: the normalized rows, the reduction's (red) and the subgroup module's row sums
    shared = 4 * M * K + 32 * (tpr + 1) * rows_wg
    if norm is not None and not (norm.ok(M, K) and shared <= lw.limits.max_workgroup_storage):
        raise _NoFusion()  # float32 rows that fit in workgroup memory next to the reduction's
    ob, oe = lw.bind(1, out, 0, (M - 1) * out_sm + ncols)
    if norm is None:
        xt = _x_float32(lw, x)
        xb, xe = lw.bind(2, xt, 0, M * K)
    else:
        (xb, xe), (yb, ye), (nwb, nwe), (sb, se) = norm.bind(lw, 2, 5, 4, 8, [ob] + wbinds[:len(ws)])
        if xe % 4:
            raise _NoFusion()  # X is read as vec4s
    if cat == 2:
        rows_wg -= rows_wg % 2  # thread rows pair a gate row with its up row
        groups = -(-ncols // (rows_wg // 2))
    else:
        groups = sum(-(-n // rows_wg) for n in ns)
    slots = sum(i << (2 * i) for i in range(len(ws)))  # weight p in binding p (W, OUT1, OUT2)
    n0, n1 = (ns + [0, 0])[:2]
    gx = min(groups, MAX_GROUPS)
    consts = {"QT": QT[dt], "TPR": tpr, "ROWS": rows_wg, "GM": M, "CAT": cat, **_row_consts(tpr, nb, shader)}
    what = f"qgemv {dt} x{len(ws)} {tpr}x{rows_wg}" + (" + silu * mul" if cat == 2 else " concatenated") + \
        (" subgroups" if shader else "")
    if norm is None:
        uni = _params(M, K, nb, 0, ncols, ncols, xe // 4, K // 4, wbases[0], 0, 0, oe, 0, 0, out_sm, slots,
                      wbases[1], wbases[2], n0, n1, g_part, u_part)
        binds = [ob, xb, wbinds[0], wbinds[1], wbinds[2]]
        lw.emit("qgemv_cat", consts, uni, binds, (gx, -(-groups // gx), 1), what, shader=shader)
        return
    # X rows come from workgroup memory (x_base 0, K / 4 vec4s apart); the prologue's tensors at
    # bias_base (weight), r_base (y), c_base1 (src, in vec4s), c_base2 (s) and eps (word 22)
    uni = _params(M, K, nb, 0, ncols, ncols, 0, K // 4, wbases[0], nwe, ye, oe, xe // 4, se, out_sm, slots,
                  wbases[1], wbases[2], n0, n1, g_part, u_part, norm.eps_word())
    consts.update(NORM=norm.mode, HS=M * K // 4, HAS_W=norm.w is not None)
    binds = [ob, xb, wbinds[0], nwb, yb, wbinds[1], wbinds[2], sb]
    lw.emit("qgemv_cat_norm", consts, uni, binds, (gx, -(-groups // gx), 1),
            ("add + " if norm.mode == 2 else "") + "rms_norm + " + what, shader=shader)


def _cat_weights(lw: _Lowering, ws: Sequence[TensorRef], row_bytes: int) -> Tuple[List[Binding], List[int]]:
    """qgemv_cat's weight bindings (slots 3, 6, 7: W, OUT1, OUT2; dummies past the weights) and
    the byte offset of each weight's row 0 there. Raises _NoFusion for a weight over one binding."""
    wbinds, wbases = [], []
    for slot, w in zip((3, 6, 7), ws):
        n = w.shape[0]
        size = _up(w.buf.offset + n * row_bytes, 4) - w.buf.offset // lw.align * lw.align
        if size > lw.limits.max_binding_size or w.buf.offset % 4:
            raise _NoFusion()
        b, base = _bind_rows(lw, slot, w, 0, n, row_bytes, f"weight (value {w.value}, {w.dtype})")
        wbinds.append(b)
        wbases.append(base)
    wbinds += [Binding(slot, DUMMY) for slot in (3, 6, 7)[len(ws):]]
    wbases += [0] * (3 - len(ws))
    return wbinds, wbases


@dataclass(frozen=True)
class RopeStores:
    """The planner's rope_kv group as the stores of a q/k/v product (``qgemv_rope``): weight p's
    rows are heads of ``D`` values, written to ``dsts[p]``, a contiguous [B, H_p, T, D] tensor or,
    where ``caches[p]``, the [B, H_p, S, D] cache at rows clamp(pos, 0, S - T) + t; rotated with
    ``cos`` / ``sin`` ([T, D]) where ``ropes[p]``."""

    D: int
    T: int
    S: int
    dsts: Tuple[TensorRef, ...]
    caches: Tuple[bool, ...]
    ropes: Tuple[bool, ...]
    cos: Optional[TensorRef] = None
    sin: Optional[TensorRef] = None
    pos: Optional[TensorRef] = None


def _overlap(a: TensorRef, b: TensorRef) -> bool:
    x, y = a.buf, b.buf
    return x.space == y.space and x.index == y.index and x.offset < y.offset + y.nbytes and \
        y.offset < x.offset + x.nbytes


def cat_gemv_rope(lw: _Lowering, x: TensorRef, ws: Sequence[TensorRef], norm: NormPrologue, st: RopeStores) -> None:
    """One ``qgemv_rope`` dispatch: ``norm``'s h [M <= 8, K] against q, k and v's packed weights
    (one dtype and K), stored as ``st`` says (no scratch, no rope_kv dispatch). Every tensor but
    the weights and the norm's weight is bound as one range of one buffer (WebGPU's default of 8
    storage bindings has no room for ten); raises _NoFusion where they are not in one buffer, where
    a written tensor shares bytes with another tensor of the dispatch (workgroups read while
    others write), or where the shapes do not pair rows (the caller runs the two-dispatch path)."""
    K = x.shape[-1] if x.shape else 0
    M = _numel(x.shape[:-1])
    dt = ws[0].dtype
    ns = [w.shape[0] for w in ws]
    D, T = st.D, st.T
    if not (1 <= M <= min(lw.tuning.qgemv_max_m, GEMV_MAX_M) and K > 0 and K % _BLOCK == 0 and 1 <= len(ws) <= 3
            and len(st.dsts) == len(ws) and all(w.dtype == dt and _dt.is_packed(dt) and len(w.shape) == 2
                                                 and w.shape[1] == K for w in ws)
            and D > 0 and D % 2 == 0 and T > 0 and M % T == 0 and all(n % D == 0 for n in ns) and norm.ok(M, K)):
        raise _NoFusion()
    nb = K // _BLOCK
    tpr, rows_wg, shader = _gemv_kernel(lw, nb, pairs=True)
    rows_wg -= rows_wg % 2  # thread rows pair the two halves of a rotation
    if rows_wg < 2 or 4 * M * K + 32 * (tpr + 1) * rows_wg > lw.limits.max_workgroup_storage:
        raise _NoFusion()
    reads = [t for t in (norm.src, norm.y, st.cos, st.sin, st.pos) if t is not None]
    writes = [t for t in (norm.s, *st.dsts) if t is not None]
    want = {id(t): "float32" for t in reads + writes}
    if st.pos is not None:
        want[id(st.pos)] = "int32"
    if any(t.dtype != want[id(t)] for t in reads + writes) or \
            any(_numel(t.shape) != T * D for t in (st.cos, st.sin) if t is not None):
        raise _NoFusion()
    others = reads + list(ws) + ([norm.w] if norm.w is not None else [])
    for i, t in enumerate(writes):
        if any(_overlap(t, o) for o in others + writes[:i]):
            raise _NoFusion()
    ts = reads + writes
    if len({(t.buf.space, t.buf.index) for t in ts}) != 1 or any(t.buf.offset % 4 for t in ts):
        raise _NoFusion()
    lo = min(t.buf.offset for t in ts)
    hi = max(t.buf.offset + t.buf.nbytes for t in ts)
    b0 = ts[0].buf
    sb, se = lw.bind(8, _T(b0.space, b0.index, lo, "float32", -(-(hi - lo) // 4), "the attention front's tensors"))

    def at(t: Optional[TensorRef]) -> int:  # word index of t's first element in S
        return se + (t.buf.offset - lo) // 4 if t is not None else 0

    wbinds, wbases = _cat_weights(lw, ws, _dt.packed_row_bytes(dt, K))
    nwb, nwe = lw.bind(4, _T.of(norm.w)) if norm.w is not None else (Binding(4, DUMMY), 0)
    S = max([d.shape[2] for d, c in zip(st.dsts, st.caches) if c] or [0])
    flags = sum(((1 if c else 0) | (2 if r else 0)) << (2 * p) for p, (c, r) in enumerate(zip(st.caches, st.ropes)))
    dsts = [at(d) for d in st.dsts] + [0] * (3 - len(ws))
    n0, n1 = (ns + [0, 0])[:2]
    ncols = sum(ns)
    slots = sum(i << (2 * i) for i in range(len(ws)))
    uni = _params(M, K, nb, 0, ncols, ncols, 0, K // 4, wbases[0], nwe, at(norm.y), 0, at(norm.src), at(norm.s), 0,
                  slots, wbases[1], wbases[2], n0, n1, 0, 0, norm.eps_word(), 0,
                  D, T, S, at(st.cos), at(st.sin), at(st.pos), *dsts, flags)
    groups = sum(-(-n // rows_wg) for n in ns)
    gx = min(groups, MAX_GROUPS)
    consts = {"QT": QT[dt], "TPR": tpr, "ROWS": rows_wg, "GM": M, "CAT": 1, "NORM": norm.mode, "HS": M * K // 4,
              "HAS_W": norm.w is not None, "RK": True, **_row_consts(tpr, nb, shader)}
    binds = [Binding(2, DUMMY), wbinds[0], nwb, Binding(5, DUMMY), wbinds[1], wbinds[2], sb]
    what = ("add + " if norm.mode == 2 else "") + f"rms_norm + qgemv {dt} x{len(ws)} {tpr}x{rows_wg} + rope_kv" + \
        (" subgroups" if shader else "")
    lw.emit("qgemv_rope", consts, uni, binds, (gx, -(-groups // gx), 1), what, shader=shader)


def cat_products(lw: _Lowering, x: TensorRef, ws: Sequence[TensorRef], out: _T, offs: Sequence[int],
                 out_sm: int) -> None:
    """x @ W_p^T into columns offs[p].. of ``out`` (float32 [M, out_sm]) for each packed weight
    p: one product (qgemv or qmm tiles) per weight, as an unfused linear would run."""
    for w, c in zip(ws, offs):
        part = _T(out.space, out.index, out.offset + 4 * c, "float32", out.numel - c, f"{out.name} column {c}")
        _product(lw, x, w, [part], None, 1, out_sm=out_sm)


KSPLIT_MAX = 8


def _ksplit(lw: _Lowering, groups: int, nb: int, outputs: int) -> int:
    """Split-K ways of a qmm call with ``groups`` tiles: as the float kernels do (ops_matmul
    _ksplit), split while there are too few workgroups to keep a big GPU busy, keeping two blocks
    (64 of K) or more per split and the partials within one binding."""
    t = lw.tuning
    ks = 1
    while groups < t.ksplit_below_groups and ks < KSPLIT_MAX and groups * ks < t.ksplit_target_groups \
            and nb // (2 * ks) >= 2 and 2 * ks * outputs * 4 <= lw.limits.max_binding_size - lw.align:
        ks *= 2
    return ks


@lowers("linear", packed=True)
def linear_packed(lw: _Lowering, d: Dispatch, attrs: dict, epi: Optional[Epilogue] = None,
                   attn: Optional[FlashPartials] = None) -> None:
    """``attn``: the product takes the attention before it (plan.fusion sdpa_linear; _product)."""
    x, w, bias = (list(d.args) + [None])[:3]
    o = epi.out if epi is not None else d.outputs[0]
    _product(lw, x, w, [o], _T.of(bias) if bias is not None else None, 1,
             act=epi.act if epi is not None else 0, res=epi.res if epi is not None else None, attn=attn)


def lower_packed_siblings(lw: _Lowering, ds: List[Dispatch]) -> None:
    """Sibling linears with packed weights (``plan.fusion._siblings``) as one product over all
    their weight rows: the weights (and biases, unless they share one buffer) lie back to back
    from the first one's on, as the executor placed them."""
    d0 = ds[0]
    x, w = d0.args[0], d0.args[1]
    n = w.shape[0]
    bias, mode = None, 3
    if len(d0.args) > 2 and d0.args[2] is not None:
        b = d0.args[2]
        if all(d.args[2].buf == b.buf for d in ds):  # one shared bias buffer (deduplicated constants)
            bias, mode = _T.of(b), 1
        else:
            bias = _T(b.buf.space, b.buf.index, b.buf.offset, b.dtype, len(ds) * n, f"biases of {len(ds)} sibling linears")
    _product(lw, x, w, [d.outputs[0] for d in ds], bias, mode)


# ------------------------------------------------------------------------------------------ embedding

@lowers("embedding", packed=True)
def _embedding_packed(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    w, ids = d.args
    o = d.outputs[0]
    v, dd = w.shape
    nb = dd // _BLOCK
    tokens = _numel(ids.shape)
    out = _T.of(o)  # float32: the op's result of a packed table
    ob, oe = lw.bind(1, out)
    ib, ie = lw.bind(2, _T.of(ids))
    name = f"embedding table (value {w.value}, {w.dtype})"
    row_bytes = _dt.packed_row_bytes(w.dtype, dd)
    ranges = _row_ranges(lw, w, v, row_bytes, name)
    units = tokens * nb * 4
    for v0, v1 in ranges:
        wb, wbase = _bind_rows(lw, 3, w, v0, v1, row_bytes, name)
        uni = _u32(units, nb, dd, v, wbase, ie, oe, v0, v1, 0, 0, 0)
        lw.emit("qembed", {"QT": QT[w.dtype]}, uni, [ob, ib, wb], _grid(units),
                f"{w.dtype} rows {v0}..{v1 - 1}" if len(ranges) > 1 else w.dtype)
