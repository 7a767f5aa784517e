"""Lowering of the planner's fusions to shaders/fused.wgsl (pure Python).

:func:`gpudelegate.plan.fusion.match` decides, on the plan, which runs of dispatches may run as
one kernel and proves each replacement safe; the CUDA executor carries its groups out with
shaders/cuda_fused.cu, and this module carries out the same groups on WebGPU:

- ``add_rms_norm``: one ``add_rms`` dispatch writes the residual sum s and the normalized h;
- ``silu_mul``: one ``silu_mul`` dispatch;
- ``rope_kv``: one ``rope_kv`` dispatch for up to three jobs (q rotated, k rotated into its cache,
  v into its cache), reading the projections through the strides of the permutes and reshapes
  between them (those run nothing);
- ``gemm_cat`` (``Fusion.cat``: the q/k/v or gate/up linears of one input as one product into a
  private scratch, read by the group's consumer): with at most 4 rows (decode) one ``gemv_cat``
  dispatch, which for gate/up also applies silu(g) * u and writes the group's output, so the whole
  MLP front is one dispatch; with more rows the usual product kernels write the scratch's column
  blocks (one batched product per run of weights the executor placed back to back, ``contiguous``).
  Packed (GGUF block) weights take ops_quant's kernels the same way: ``qgemv_cat`` for at most 8
  rows (the concatenated row, or silu(g) * u), else one packed product per weight into its
  column block.
- ``rope_kv`` over a packed ``gemm_cat`` with a norm prologue (the decode attention front of a
  GGUF model): one ``qgemv_rope`` dispatch for the norm, the q/k/v product, the rotations and the
  cache writes (ops_quant.cat_gemv_rope), where its tensors allow; the two dispatches above
  (``qgemv_cat_norm`` into the scratch, ``rope_kv``) elsewhere or with ``Tuning.qgemv_rope`` off.
- ``sdpa_linear`` (an attention into the product after it, decode rows): ``attn_flash`` for the
  split-key partials, then one ``qgemv_attn`` dispatch for a packed weight whose workgroups each
  merge the partials into their X rows before the product (ops_quant ``_product``), with no
  ``attn_flash_combine`` between them, and the group's residual add as its epilogue. Elsewhere
  (float weights: :func:`plan_fusions` drops those groups; no flash-decoding; a residual that is
  not float32 or shares bytes with the output; ``Tuning.attn_in_product`` off) the group declines
  and the attention and the linear run as they do apart.
- the norm prologue of a ``gemm_cat`` group (``Fusion.norm``: the add and rms norm whose output
  only the product reads, decode rows): ``gemv_cat_norm`` / ``qgemv_cat_norm``, the same products
  computing h = rms_norm(x + y) * w in every workgroup (and s = x + y in the first), so a decoder
  layer runs no add_rms dispatch. Where neither kernel takes the group (float16 activations, rows
  that do not fit in workgroup memory, s over a binding it would share), the add + norm (or the
  norm) runs first into a private scratch and the group reads h there: still one dispatch less
  than apart, never wrong (h's own storage may hold another value by then).

A group runs at its last member (``Fusion.at``); the other members run nothing. Where a kernel
cannot take a group (a tensor over one binding, float16 rows that would share words, two written
ranges that overlap), ``_NoFusion`` leaves its ops to run apart, as on CUDA.

Uniform: every entry reads ``FusedParams``, :data:`UNIFORM_WORDS` 32-bit words whose layout each
lowering function below lists (the WGSL reads them by index).
"""

from __future__ import annotations

import struct
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

from .. import dtypes as _dt
from .. import ops as _ops
from ..plan.fusion import Epilogue, Fusion, RopeJob, match, view_strides
from ..plan.types import BufferRef, Dispatch, TensorRef
from .kernel import (DUMMY, ENTRIES, MAX_GROUPS, Binding, EntrySpec, _Lowering, _NoFusion, _numel, _row_grid, _T,
                     _TooBig, _u32)
from .ops_matmul import _MM, _matmul_call
from .ops_attention import flash_partials
from .ops_quant import NormPrologue, RopeStores, cat_gemv, cat_gemv_rope, cat_products, linear_packed
from .ops_rows import _norm_rows, _rwg

SHADER = "fused.wgsl"
KINDS = frozenset({"add_rms_norm", "silu_mul", "rope_kv", "gemm_cat", "sdpa_linear"})
"""The kinds of :func:`~gpudelegate.plan.fusion.match` this executor carries out. ``sdpa_bthd`` is
not among them: the attention's permuted output is ``sdpa_folds``' business here."""
UNIFORM_WORDS = 32  # FusedParams: array<vec4<u32>, 8>
GEMV_MAX_ROWS = 4  # gemv_cat GM: one vec4 component per row of x
GEMV_LANES = (32, 64, 128, 256)  # gemv_cat threads per output column
GEMV_WG = 256  # most threads per gemv_cat workgroup
GEMV_MIN_GROUPS = 264  # columns per workgroup only while this many workgroups remain (2 per H100 SM)
ATTN_PRODUCT_KEYS = 32  # sdpa_linear: keys per attn_flash chunk unless Tuning.attn_flash_keys says otherwise;
# every qgemv_attn workgroup merges all the chunks, so fewer, longer ones (faster on an H100: docs/NOTES.md)

ENTRIES.update({
    "add_rms": EntrySpec(SHADER, (1, 2, 3, 4, 5), ("DT_OUT", "DTX", "DTW", "HAS_W", "X_AT", "Y_AT", "PAIR", "RWG")),
    "silu_mul": EntrySpec(SHADER, (1, 2, 3), ("DT_OUT", "DTX", "G_AT", "U_AT", "PAIR")),
    "rope_kv": EntrySpec(SHADER, (1, 2, 3, 4, 5, 6, 7), ("DT_OUT", "DTX", "DTW", "PAIR")),
    "gemv_cat": EntrySpec(SHADER, (1, 2, 3, 4, 5), ("DTW", "GM", "NP", "EPI", "VEC", "LANES", "WGS", "NORM", "HS")),
    "gemv_cat_norm": EntrySpec(SHADER, (1, 2, 3, 4, 5, 6, 7, 8),
                               ("DTW", "GM", "NP", "EPI", "VEC", "LANES", "WGS", "NORM", "HS", "HAS_W")),
})


def plan_fusions(plan, p: int) -> List[Fusion]:
    """The planner's fusions of payload ``p`` (``SessionPlan.fusions``, the decision the CUDA
    executor carries out too) that these kernels run: :data:`KINDS`. The others (``sdpa_bthd``:
    WebGPU folds the permutes into its attention kernels through ``sdpa_folds`` instead) never
    share a dispatch with these, so dropping them changes no other group. An ``sdpa_linear`` over
    a float weight is dropped too: only the packed product (qgemv_attn) merges the partials."""
    pp = plan.payloads[p]
    return [f for f in plan.fusions.get(p, []) if f.kind in KINDS and not (
        f.kind == "sdpa_linear" and not _dt.is_packed(pp.dispatches[f.roles["linear"]].args[1].dtype))]


def payload_fusions(pp) -> List[Fusion]:
    """``match`` on a payload plan alone (no value buffers: no concatenated GEMMs)."""
    return match(pp, kinds=set(KINDS))


def lower(lw: _Lowering, pp, f: Fusion, contiguous: Sequence[Sequence[int]] = ()) -> None:
    """Emit the calls that carry out fusion ``f`` of payload plan ``pp`` into ``lw`` (the
    dispatch at ``f.at``), or raise _NoFusion."""
    fn = {"add_rms_norm": _add_rms, "silu_mul": _silu_mul, "rope_kv": _rope_kv, "sdpa_linear": _sdpa_linear}.get(f.kind)
    if fn is None or (f.norm is not None and not f.cat):
        raise _NoFusion()
    try:
        if f.norm is None:
            fn(lw, pp, f, contiguous)
            return
        n = len(lw.calls)
        try:
            fn(lw, pp, f, contiguous)
        except _NoFusion:  # no prologue kernel takes it: the norm into a scratch, then the group
            del lw.calls[n:]
            _norm_apart(lw, pp, f, contiguous, fn)
    except _TooBig:
        raise _NoFusion() from None  # a tensor over one binding: the ops run apart (and split there)


def split_norm(pp, f: Fusion) -> List[Fusion]:
    """Fusion ``f`` with a norm prologue as the groups ``match`` finds without one: the add +
    rms_norm (when the norm has an add) and ``f``'s own group. Both are safe where ``f`` is: the
    add + norm runs earlier than ``f`` would, before any reader of s or h (the products), and
    the memory plan keeps x and y apart from s and h for as long as ``f`` reads them."""
    nm = f.norm
    own = set(nm["members"])
    h = pp.dispatches[nm["norm"]].outputs[0]
    plain = replace(f, norm=None, members=[k for k in f.members if k not in own],
                    eliminated=[v for v in f.eliminated if v != h.value])
    if nm["add"] is None:
        return [plain]
    nd = pp.dispatches[nm["norm"]]
    ar = Fusion("add_rms_norm", sorted(own), roles={"add": nm["add"], "norm": nm["norm"], "x": nm["x"], "y": nm["y"],
                                                     "s": nm["s"], "w": nd.args[1] if len(nd.args) > 1 else None,
                                                     "h": h})
    return [ar, plain]


class _Redirected:
    """A payload plan's dispatches with the concatenated linears reading ``h`` instead."""

    def __init__(self, pp, cat: Sequence[int], h: TensorRef):
        self.dispatches = list(pp.dispatches)
        for k in cat:
            d = self.dispatches[k]
            self.dispatches[k] = replace(d, args=[h] + list(d.args[1:]))


def _norm_apart(lw: _Lowering, pp, f: Fusion, contiguous, fn) -> None:
    """Fusion ``f`` with its norm as a kernel of its own before the product: add_rms (or the
    rms_norm) writes h into a private scratch, which the product reads instead of h's planned
    storage (the group runs at its last member, where that storage may hold another value)."""
    nm = f.norm
    nd = pp.dispatches[nm["norm"]]
    h = nd.outputs[0]
    scr = lw.scratch(h.dtype, max(_numel(h.shape), 1))
    hs = TensorRef(h.value, h.dtype, tuple(h.shape), BufferRef("scratch", scr.index, 0, scr.numel * scr.isz))
    if nm["add"] is not None:
        _add_rms(lw, pp, Fusion("add_rms_norm", [nm["add"], nm["norm"]],
                                roles={"add": nm["add"], "norm": nm["norm"], "x": nm["x"], "y": nm["y"], "s": nm["s"],
                                       "w": nm["w"], "h": hs}), contiguous)
    else:
        _norm_rows(lw, replace(nd, outputs=[hs]), nd.attrs)
    fn(lw, _Redirected(pp, f.cat, hs), replace(f, norm=None), contiguous)


def _prologue(f: Fusion) -> Optional[NormPrologue]:
    return NormPrologue.of(f.norm) if f.norm is not None else None


# ------------------------------------------------------------------------------------------ helpers

def _uniform(words: Sequence[int], floats: Dict[int, float] = None) -> bytes:
    vals = list(words) + [0] * (UNIFORM_WORDS - len(words))
    for i, v in (floats or {}).items():
        vals[i] = struct.unpack("<I", struct.pack("<f", v))[0]
    return _u32(*vals)


def _clash(a: Binding, b: Binding) -> bool:
    """Two bindings whose byte ranges overlap (dummies never do: emit gives each slot its own)."""
    x, y = a.buf, b.buf
    return x.space != "dummy" and x.space == y.space and x.index == y.index and \
        x.offset < y.offset + y.nbytes and y.offset < x.offset + x.nbytes


def _outputs(lw: _Lowering, outs: Sequence[Tuple[int, _T]]) -> List[Tuple[Binding, int]]:
    """Bindings of the tensors a kernel writes. WebGPU refuses overlapping writable bindings, and
    the lowering's snapshot copies only make inputs distinct, so overlapping outputs decline."""
    got = [lw.bind(slot, t) for slot, t in outs]
    for i in range(len(got)):
        for j in range(i):
            if _clash(got[i][0], got[j][0]):
                raise _NoFusion()
    return got


def _same(a: TensorRef, b: TensorRef) -> bool:
    return a.buf == b.buf


def _bytes_overlap(a: BufferRef, b: BufferRef) -> bool:
    return a.space == b.space and a.index == b.index and a.offset < b.offset + b.nbytes and \
        b.offset < a.offset + a.nbytes


def _rows(shape) -> Tuple[int, int]:
    """(rows, row length) of a tensor whose last dim is the row."""
    L = shape[-1] if shape else 1
    return (_numel(shape) // L if L else 0), L


def _grid2(x: int, rows: int) -> Tuple[int, int, int]:
    """Workgroups (x, rows): rows past MAX_GROUPS spill into z (the kernels read y + z * ny)."""
    y = min(max(rows, 1), MAX_GROUPS)
    return (max(x, 1), y, -(-rows // y))


# ------------------------------------------------------------------------------------------ add_rms_norm

def _add_rms(lw: _Lowering, pp, f: Fusion, contiguous) -> None:
    """Uniform: rows, L, x_base, y_base, s_base, h_base, w_base, eps."""
    r = f.roles
    x, y, s, h, w = r["x"], r["y"], r["s"], r["h"], r["w"]
    rows, L = _rows(s.shape)
    # h may be a reshape of s's shape (the final norm reads the residual stream through a view)
    if rows == 0 or L == 0 or _rows(h.shape) != (rows, L) or (w is not None and tuple(w.shape) != (L,)):
        raise _NoFusion()
    eps = pp.dispatches[r["norm"]].attrs["eps"]
    ht, st = _T.of(h), _T.of(s)
    (hb, he), (sb, se) = _outputs(lw, [(1, ht), (2, st)])
    pair = "float16" in (h.dtype, s.dtype)
    if pair and (L % 2 or he % 2 or se % 2):
        raise _NoFusion()  # float16 rows sharing words between workgroups

    def source(t: TensorRef, slot: int) -> Tuple[int, Binding, int]:
        # A row-wise kernel may read and write one position in the same thread: an input that is
        # exactly s or h is read from that output's binding (no second, overlapping binding).
        if _same(t, h):
            return 1, Binding(slot, DUMMY), he
        if _same(t, s):
            return 2, Binding(slot, DUMMY), se
        b, e = lw.bind(slot, _T.of(t))
        return 0, b, e

    x_at, xb, xe = source(x, 3)
    y_at, yb, ye = source(y, 4)
    wb, we = lw.bind(5, _T.of(w)) if w is not None else (Binding(5, DUMMY), 0)
    consts = {"DT_OUT": ht.code, "DTX": st.code, "DTW": _T.of(w).code if w is not None else 0,
              "HAS_W": w is not None, "X_AT": x_at, "Y_AT": y_at, "PAIR": pair, "RWG": _rwg(L)}
    uni = _uniform([rows, L, xe, ye, se, he, we], {7: eps})
    lw.emit("add_rms", consts, uni, [hb, sb, xb, yb, wb], _row_grid(rows), "add + rms_norm")


# ------------------------------------------------------------------------------------------ silu_mul

def _silu_mul(lw: _Lowering, pp, f: Fusion, contiguous) -> None:
    r = f.roles
    out = r["out"]
    rows, cols = _rows(out.shape)
    if rows == 0 or cols == 0:
        raise _NoFusion()
    if not f.cat:
        _silu_mul_call(lw, _T.of(out), rows, cols, (_T.of(r["g"]), 0, cols), (_T.of(r["u"]), 0, cols))
        return
    x = pp.dispatches[f.cat[0]].args[0]
    pro = _prologue(f)
    if pro is not None:  # one dispatch with the norm in it, or _NoFusion (lower() runs the norm apart)
        if out.dtype != "float32" or any(_bytes_overlap(out.buf, t.buf) for t in (pro.src, pro.y) if t is not None):
            raise _NoFusion()
        if rows <= GEMV_MAX_ROWS and _gemv_ok(pp, f):
            _gemv_cat(lw, pp, f, _T.of(out), 0, cols, epi=1, pro=pro)
            return
        if not _packed(pp, f):
            raise _NoFusion()
        _, _, ws, _, _ = _cat_parts(pp, f)
        cat_gemv(lw, x, ws, _T.of(out), cols, parts=(r["g_part"], r["u_part"]), norm=pro)
        return
    # One dispatch for the product and its consumer, unless out shares bytes with the product's
    # input (every workgroup reads all of x while others write out).
    if out.dtype == "float32" and not _bytes_overlap(out.buf, x.buf):
        if rows <= GEMV_MAX_ROWS and _gemv_ok(pp, f):
            _gemv_cat(lw, pp, f, _T.of(out), 0, cols, epi=1)
            return
        if _packed(pp, f):
            _, _, ws, _, _ = _cat_parts(pp, f)
            try:
                cat_gemv(lw, x, ws, _T.of(out), cols, parts=(r["g_part"], r["u_part"]))
                return
            except _NoFusion:  # more rows than qgemv_cat takes: product into the scratch, then silu_mul
                pass
    scr, offs, ncat = _cat_gemm(lw, pp, f, contiguous)
    _silu_mul_call(lw, _T.of(out), rows, cols, (scr, offs[r["g_part"]], ncat), (scr, offs[r["u_part"]], ncat))


def _silu_mul_call(lw: _Lowering, out: _T, rows: int, cols: int, g: Tuple[_T, int, int], u: Tuple[_T, int, int]):
    """out [rows, cols] = silu(g) * u; g, u = (tensor, first element, row stride).
    Uniform: rows, cols, g_base, gs, u_base, us, out_base."""
    if g[0].dtype != u[0].dtype:
        raise _NoFusion()
    (ob, oe), = _outputs(lw, [(1, out)])
    pair = out.dtype == "float16"
    if pair and (cols % 2 or oe % 2):
        raise _NoFusion()  # float16 rows sharing words between threads

    def is_out(src) -> bool:  # the very tensor out is: read where it is written, same thread
        t, base, stride = src
        return t.same_place(out) and base == 0 and stride == cols and t.numel == out.numel

    def span(src) -> Tuple[int, int]:
        return src[1], src[1] + (rows - 1) * src[2] + cols

    g_at, u_at = (1 if is_out(g) else 0), (1 if is_out(u) else 0)
    gb, ge = Binding(2, DUMMY), oe
    ub, ue = Binding(3, DUMMY), oe
    if g_at == 0 and u_at == 0 and g[0] is u[0]:
        # both parts of one concatenated product's scratch: one binding over both, read twice
        lo = min(span(g)[0], span(u)[0])
        gb, e = lw.bind(2, g[0], lo, max(span(g)[1], span(u)[1]))
        ge, ue, u_at = e + g[1] - lo, e + u[1] - lo, 2
    else:
        if g_at == 0:
            gb, e = lw.bind(2, g[0], *span(g))
            ge = e
        if u_at == 0:
            ub, e = lw.bind(3, u[0], *span(u))
            ue = e
    consts = {"DT_OUT": out.code, "DTX": g[0].code, "G_AT": g_at, "U_AT": u_at, "PAIR": pair}
    uni = _uniform([rows, cols, ge, g[2], ue, u[2], oe])
    per = -(-cols // (512 if pair else 256))
    lw.emit("silu_mul", consts, uni, [ob, gb, ub], _grid2(per, rows), "silu * mul")


# ------------------------------------------------------------------------------------------ sdpa_linear

def _sdpa_linear(lw: _Lowering, pp, f: Fusion, contiguous) -> None:
    """attn_flash, then the packed product merging its partials (qgemv_attn) with the group's
    residual add as its epilogue, or _NoFusion."""
    r = f.roles
    sd, lin = pp.dispatches[r["sdpa"]], pp.dispatches[r["linear"]]
    if not lw.tuning.attn_in_product or not _dt.is_packed(lin.args[1].dtype):
        raise _NoFusion()
    res = r.get("res")
    if res is not None and not (res.dtype == r["out"].dtype == "float32"
                                and not _bytes_overlap(r["out"].buf, res.buf)):
        raise _NoFusion()  # qgemv's residual is float32, read while other workgroups write out
    n = len(lw.calls)
    attn = flash_partials(lw, sd, _ops.normalize_attrs(sd.op, sd.attrs, sd.args), keys=ATTN_PRODUCT_KEYS)
    if attn is None:
        raise _NoFusion()
    try:
        epi = Epilogue(r["add"], 0, res, r["out"]) if res is not None else None
        linear_packed(lw, lin, {}, epi, attn=attn)
    except _NoFusion:
        del lw.calls[n:]
        raise


# ------------------------------------------------------------------------------------------ rope_kv

def _rope_kv(lw: _Lowering, pp, f: Fusion, contiguous) -> None:
    jobs = list(f.jobs)
    if not 1 <= len(jobs) <= 3:
        raise _NoFusion()
    if f.cat:
        if f.norm is not None and lw.tuning.qgemv_rope and _packed(pp, f):
            n = len(lw.calls)
            try:
                _rope_in_product(lw, pp, f)
                return
            except (_NoFusion, _TooBig):  # the product into a scratch, then rope_kv (below)
                del lw.calls[n:]
        scr, offs, ncat = _cat_gemm(lw, pp, f, contiguous)
        srcs = [(scr, offs[j.cat_part], ncat) if j.cat_part >= 0 else None for j in jobs]
        if None in srcs:
            raise _NoFusion()
        _rope_calls(lw, jobs, srcs)
        return
    _rope_calls(lw, jobs, [(_T.of(j.src), 0, j.src.shape[-1]) for j in jobs])


def _rope_calls(lw: _Lowering, jobs: List[RopeJob], srcs: List[Tuple[_T, int, int]]) -> None:
    """Jobs read one source binding per dispatch: jobs whose sources share a buffer run together
    (a binding over all of them), the rest alone; a group whose bindings clash runs job by job."""
    groups: Dict[tuple, List[int]] = {}
    for i, (t, _, _) in enumerate(srcs):
        groups.setdefault((t.space, t.index), []).append(i)
    for ids in groups.values():
        try:
            _rope_call(lw, [jobs[i] for i in ids], [srcs[i] for i in ids])
        except (_NoFusion, _TooBig):  # clashing bindings, or one over all sources too large
            if len(ids) == 1:
                raise
            for i in ids:
                _rope_call(lw, [jobs[i]], [srcs[i]])


def _rope_in_product(lw: _Lowering, pp, f: Fusion) -> None:
    """The group as one ``qgemv_rope`` dispatch (ops_quant.cat_gemv_rope): each packed weight of
    the concatenated product has exactly one job, which reads the weight's output as heads of D
    contiguous columns ([B, T, H, D] viewed as [B, H, T, D]: X row b T + t, column h D + d), and
    the jobs agree on T, D, the tables and the position. Raises _NoFusion otherwise."""
    _, x, ws, M, K = _cat_parts(pp, f)
    by_part = {j.cat_part: j for j in f.jobs}
    if len(by_part) != len(f.jobs) or sorted(by_part) != list(range(len(ws))):
        raise _NoFusion()
    jobs = [by_part[p] for p in range(len(ws))]
    ncat = sum(w.shape[0] for w in ws)
    B, _, T, D = jobs[0].shape
    rope = [j for j in jobs if j.rope]
    cache = [j for j in jobs if j.cache]
    for j, w in zip(jobs, ws):
        b, H, t, d = j.shape
        want = (T * ncat, D, ncat, 1)  # strides of [B, H, T, D] in the concatenated rows
        got = view_strides(j.src.shape, ncat, j.view)
        if (b, t, d) != (B, T, D) or H * D != w.shape[0] or got is None or \
                any(n > 1 and g != e for n, g, e in zip(j.shape, got, want)):
            raise _NoFusion()
        if (tuple(j.dst.shape[:2]) + tuple(j.dst.shape[3:]) != (B, H, D)) if j.cache else \
                _numel(j.dst.shape) != B * H * T * D:
            raise _NoFusion()
        if j.rope and not (_same(j.cos, rope[0].cos) and _same(j.sin, rope[0].sin)):
            raise _NoFusion()
        if j.cache and not (_same(j.pos, cache[0].pos) and j.dst.shape[2] == cache[0].dst.shape[2]):
            raise _NoFusion()
    if B * T != M:
        raise _NoFusion()
    st = RopeStores(D, T, cache[0].dst.shape[2] if cache else 0, tuple(j.dst for j in jobs),
                    tuple(j.cache for j in jobs), tuple(j.rope for j in jobs),
                    rope[0].cos if rope else None, rope[0].sin if rope else None, cache[0].pos if cache else None)
    cat_gemv_rope(lw, x, ws, _prologue(f), st)


def _rope_call(lw: _Lowering, jobs: List[RopeJob], srcs: List[Tuple[_T, int, int]]) -> None:
    """One rope_kv dispatch. Uniform: T, D, S, cos_base, sin_base, pos_base, rows, jobs; then per
    job (word 8 + 8j): first row, H, src_base, sb, sh, st, dst_base, flags (1 cache, 2 rope)."""
    B, _, T, D = jobs[0].shape
    dst_dt, src_dt = jobs[0].dst.dtype, srcs[0][0].dtype
    if any(j.dst.dtype != dst_dt or s[0].dtype != src_dt for j, s in zip(jobs, srcs)) or D % 2:
        raise _NoFusion()
    pair = dst_dt == "float16"
    if pair and D % 4:
        raise _NoFusion()
    outs = _outputs(lw, [(1 + i, _T.of(j.dst)) for i, j in enumerate(jobs)])
    if pair and any(e % 2 for _, e in outs):
        raise _NoFusion()
    # one binding over every source of the group (in one buffer), at element offsets of it
    t0 = srcs[0][0]
    isz = t0.isz
    lo = min(t.offset + b * isz for t, b, _ in srcs)
    hi = max(t.offset + (b + _src_extent(j, rs)) * isz for j, (t, b, rs) in zip(jobs, srcs))
    if lo % isz:
        raise _NoFusion()
    cover = _T(t0.space, t0.index, lo, src_dt, (hi - lo) // isz, t0.name)
    sb, se = lw.bind(4, cover)
    if len(jobs) > 1 and any(_clash(sb, o) for o, _ in outs):
        raise _NoFusion()  # let each job bind only its own source (or snapshot it when alone)
    rope = [j for j in jobs if j.rope]
    cache = [j for j in jobs if j.cache]
    cb, ce = lw.bind(5, _T.of(rope[0].cos)) if rope else (Binding(5, DUMMY), 0)
    nb, ne = lw.bind(6, _T.of(rope[0].sin)) if rope else (Binding(6, DUMMY), 0)
    pb, pe = lw.bind(7, _T.of(cache[0].pos), 0, 1) if cache else (Binding(7, DUMMY), 0)
    S = cache[0].dst.shape[2] if cache else 0
    words = [T, D, S, ce, ne, pe, 0, len(jobs)]
    row = 0
    for j, (t, base, rs), (_, de) in zip(jobs, srcs, outs):
        st = view_strides(j.src.shape, rs, j.view)
        if st is None or (D > 1 and st[3] != 1) or tuple(j.shape[:1]) != (B,) or tuple(j.shape[2:]) != (T, D):
            raise _NoFusion()
        H = j.shape[1]
        first = se + (t.offset - lo) // isz + base
        words += [row, H, first, st[0], st[1], st[2], de, (1 if j.cache else 0) | (2 if j.rope else 0)]
        row += B * H * T
    words[6] = row
    if row == 0:
        return
    binds = [o for o, _ in outs] + [Binding(k, DUMMY) for k in range(len(jobs) + 1, 4)] + [sb, cb, nb, pb]
    consts = {"DT_OUT": _T.of(jobs[0].dst).code, "DTX": cover.code,
              "DTW": _T.of(rope[0].cos).code if rope else 0, "PAIR": pair}
    what = "+".join(("rope" if j.rope else "") + ("+cache" if j.cache and j.rope else "cache" if j.cache else "")
                    for j in jobs)
    lw.emit("rope_kv", consts, _uniform(words), binds, _row_grid(row), f"rope_kv {what}")


def _src_extent(j: RopeJob, row_stride: int) -> int:
    """Elements from a job's first source element past its last one."""
    st = view_strides(j.src.shape, row_stride, j.view)
    if st is None:
        raise _NoFusion()
    return sum((n - 1) * s for n, s in zip(j.shape, st)) + 1


# ------------------------------------------------------------------------------------------ gemm_cat

def _cat_parts(pp, f: Fusion):
    ds: List[Dispatch] = [pp.dispatches[k] for k in f.cat]
    x = ds[0].args[0]
    ws = [d.args[1] for d in ds]
    K = x.shape[-1] if x.shape else 1
    M = _numel(x.shape) // K if K else 0
    return ds, x, ws, M, K


def _gemv_ok(pp, f: Fusion) -> bool:
    """gemv_cat takes float32 inputs and outputs, float32 or float16 weights of one dtype, 1 to 3
    parts, each weight in its own binding."""
    ds, x, ws, M, K = _cat_parts(pp, f)
    return (1 <= M <= GEMV_MAX_ROWS and K > 0 and 1 <= len(ds) <= 3 and x.dtype == "float32"
            and all(d.outputs[0].dtype == "float32" for d in ds)
            and len({w.dtype for w in ws}) == 1 and ws[0].dtype in ("float32", "float16"))


def _packed(pp, f: Fusion) -> bool:
    """Whether the group's weights are packed (the planner's groups are all packed of one type
    or all float)."""
    return _dt.is_packed(pp.dispatches[f.cat[0]].args[1].dtype)


def _cat_gemm(lw: _Lowering, pp, f: Fusion, contiguous) -> Tuple[_T, List[int], int]:
    """The concatenated product x @ [W_0; W_1; ...]^T into a private scratch [M, N_0 + N_1 + ...]
    (the linears' own outputs are eliminated values: nothing else reads them). Returns the
    scratch, each part's first column and the row length."""
    ds, x, ws, M, K = _cat_parts(pp, f)
    ns = [w.shape[0] for w in ws]
    offs = [sum(ns[:i]) for i in range(len(ns))]
    ncat = sum(ns)
    pro = _prologue(f)
    if pro is not None:  # one product with the norm in it, or _NoFusion (lower() runs the norm apart)
        if M == 0 or ncat == 0 or any(d.outputs[0].dtype != "float32" for d in ds):
            raise _NoFusion()
        scr = lw.scratch("float32", M * ncat)
        if _gemv_ok(pp, f):
            _gemv_cat(lw, pp, f, scr, 0, ncat, epi=0, pro=pro)
        elif _packed(pp, f):
            cat_gemv(lw, x, ws, scr, ncat, norm=pro)
        else:
            raise _NoFusion()
        return scr, offs, ncat
    if _packed(pp, f):
        # ops_quant's kernels write float32; a float16 concatenation leaves the linears apart
        if any(d.outputs[0].dtype != "float32" for d in ds) or len({w.dtype for w in ws}) != 1:
            raise _NoFusion()
        scr = lw.scratch("float32", max(M * ncat, 1))
        if M == 0 or ncat == 0:
            return scr, offs, ncat
        try:
            cat_gemv(lw, x, ws, scr, ncat)
        except _NoFusion:
            cat_products(lw, x, ws, scr, offs, ncat)
        return scr, offs, ncat
    scr = lw.scratch(ds[0].outputs[0].dtype, max(M * ncat, 1))
    if M == 0 or ncat == 0:
        return scr, offs, ncat
    if _gemv_ok(pp, f):
        _gemv_cat(lw, pp, f, scr, 0, ncat, epi=0)
        return scr, offs, ncat
    xt = _T.of(x)
    i = 0
    for run in _weight_runs(ws, contiguous):
        z, n = len(run), ns[i]
        w0 = ws[i]
        wt = _T(w0.buf.space, w0.buf.index, w0.buf.offset, w0.dtype, z * n * K, f"weights of {z} linears") \
            if z > 1 else _T.of(w0, f"weight (value {w0.value})")
        _matmul_call(lw, _MM(xt, wt, scr, M, n, K, 0, K, 1, 0, 1, K, offs[i], ncat, 1,
                             batch=[z] if z > 1 else [], a_sb=[0] if z > 1 else [], b_sb=[n * K] if z > 1 else [],
                             c_sb=[n] if z > 1 else []))
        i += z
    return scr, offs, ncat


def _weight_runs(ws: Sequence[TensorRef], contiguous) -> List[List[int]]:
    """Consecutive weights that one batched product can read: same shape and dtype, each at the
    start of its buffer, and their buffers a consecutive part of a group the executor placed back
    to back (``contiguous``)."""
    groups = [tuple(g) for g in contiguous]

    def placed(bufs) -> bool:
        return any(tuple(g[s:s + len(bufs)]) == tuple(bufs) for g in groups for s in range(len(g)))

    runs: List[List[int]] = []
    for i, w in enumerate(ws):
        if runs:
            last = [ws[k] for k in runs[-1]] + [w]
            if (all(tuple(v.shape) == tuple(w.shape) and v.dtype == w.dtype and v.buf.space == "resident"
                    and v.buf.offset == 0 for v in last) and placed([v.buf.index for v in last])):
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs


def _gemv_cat(lw: _Lowering, pp, f: Fusion, out: _T, out_base: int, ncols: int, epi: int,
              pro: Optional[NormPrologue] = None) -> None:
    """gemv_cat: EPI 0 writes the concatenated row (``ncols`` = all parts) at ``out_base`` of
    ``out``, EPI 1 silu(x . W_g) * (x . W_u) (``ncols`` = N of each). Uniform: K, x_base, x_sm,
    out_base, out_sm, N, n0, n1, w0_base, w1_base, w2_base, g_part, u_part.

    Threads per column: the fewest lanes whose four 16-byte chunks per trip cover a weight row
    in one trip; then columns per workgroup doubled while GEMV_MIN_GROUPS workgroups remain (the
    split ops_matmul's gemv measured on an H100).

    ``pro``: gemv_cat_norm, x = h of that norm prologue (float32, M rows of K), computed by every
    workgroup into workgroup memory first; raises _NoFusion where it does not fit there."""
    ds, x, ws, M, K = _cat_parts(pp, f)
    (ob, oe), = _outputs(lw, [(1, out)])
    wb = [lw.bind(3 + i, _T.of(w, f"weight (value {w.value})")) for i, w in enumerate(ws)]
    wb += [(Binding(3 + i, DUMMY), 0) for i in range(len(ws), 3)]
    if pro is None:
        xb, xe = lw.bind(2, _T.of(x))
    else:
        if not pro.ok(M, K):
            raise _NoFusion()
        (xb, src_e), (yb, ye), (nwb, nwe), (sb, se) = pro.bind(lw, 2, 6, 7, 8, [ob] + [b for b, _ in wb[:len(ws)]])
        xe = 0  # x is the workgroup's normalized rows
    ns = [w.shape[0] for w in ws] + [0, 0]
    gp, up = (f.roles["g_part"], f.roles["u_part"]) if epi == 1 else (0, 0)
    ch = 4 if ws[0].dtype == "float32" else 8  # elements of a 16-byte chunk of weights
    vec = K % ch == 0 and xe % 4 == 0 and all(e % ch == 0 for _, e in wb[:len(ws)])
    nch = -(-K // ch) if vec else K
    lanes = next((n for n in GEMV_LANES if nch <= 4 * n), GEMV_LANES[-1]) if vec else 32
    cols = 1
    while lanes * cols * 2 <= GEMV_WG and -(-ncols // (cols * 2)) >= GEMV_MIN_GROUPS:
        cols *= 2
    words = [K, xe, K, oe + out_base, ncols, ncols, ns[0], ns[1], wb[0][1], wb[1][1], wb[2][1], gp, up]
    what = f"gemv x{len(ws)} {lanes}x{cols}" + (" + silu * mul" if epi else " concatenated")
    if pro is not None:
        # red_a and red_b (16 bytes a thread each) and the normalized rows in workgroup memory
        room = lw.limits.max_workgroup_storage  # what the device granted (DeviceLimits)
        while cols > 1 and 32 * lanes * cols + 4 * M * K > room:
            cols //= 2
        if 32 * lanes * cols + 4 * M * K > room:
            raise _NoFusion()
    groups = -(-ncols // cols)
    gx = min(groups, MAX_GROUPS)
    consts = {"DTW": _T.of(ws[0]).code, "GM": M, "NP": len(ws), "EPI": epi, "VEC": vec, "LANES": lanes,
              "WGS": lanes * cols}
    if pro is None:
        lw.emit("gemv_cat", consts, _uniform(words), [ob, xb] + [b for b, _ in wb], (gx, -(-groups // gx), 1), what)
        return
    consts.update(NORM=pro.mode, HS=M * K, HAS_W=pro.w is not None)
    uni = _uniform(words + [src_e, ye, se, nwe], {17: pro.eps})
    lw.emit("gemv_cat_norm", consts, uni, [ob, xb] + [b for b, _ in wb] + [yb, nwb, sb], (gx, -(-groups // gx), 1),
            ("add + " if pro.mode == 2 else "") + "rms_norm + " + what)
