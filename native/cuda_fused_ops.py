"""Binding of the fused groups that :mod:`gpudelegate.plan.fusion` found: one closure per group, on the
kernels of ``shaders/cuda_fused.cu`` (and the attention kernel's permuted-output option).

``bind_fusion`` returns the closure, or None when a kernel-level condition the pure-Python
matcher cannot see does not hold (the executor then binds the members one by one, as before).
Concatenated GEMMs write into ``scratch``: one device block per executor, as large as the
largest group needs. Groups run one after another on the compute stream and each consumes its
scratch inside its own closure, so they can share it.

A group's linears may read packed (GGUF block) weights: they run through
``CudaKernels.linear`` like unfused ones (the dequantizing GEMV, or dequantization into the
plan's scratch, ``dequant``, and a GEMM); a concatenated GEMM needs every member packed alike or
every member float.

A concatenated product over at most 8 rows may carry the rms norm before it (``Fusion.norm``):
:mod:`.cuda_norm_prologue` binds it, ``CudaKernels.linear_norm`` / ``gemv_silu(norm=...)`` run it
inside the product's launch, and where no kernel carries it (float32 weights through cuBLAS,
float16 activations with float16 weights) the unfused norm kernel writes h into the scratch past
the product's output and the product reads it there (``scratch_bytes`` counts both).

Two decode groups run inside one packed GEMV (at most 8 rows), where its conditions hold:

- ``rope_kv`` over a concatenated q/k/v product whose parts are the jobs' heads
  (``_rope_in_product``): QuantKernels.gemv_rope rotates and stores each head's row pairs as the
  product ends them, so neither the product's scratch nor the rope_kv launch is used;
- ``sdpa_linear`` (an attention read only by the packed product after it), where
  ``QuantKernels.attn_in_product`` is set (off by default: see there): the attention's split-key
  partials (CudaKernels.sdpa_partials), then QuantKernels.gemv_attn, whose blocks merge them as
  their prologue, so sdpa_combine has no launch. Where the attention runs in one split (nothing to
  merge), on tensor cores, with a residual add in the group, or over float weights, the group's
  ops run apart.

Where ``attn_in_product`` is off (the default), the sdpa_linear group runs the decode attention
that reads its cache rows before its wait (CudaKernels.sdpa_early_keys: no split, no combine),
then the product, where ``fresh_rows`` finds in the plan that the caches are what the run began
with but for the kv_update's row, and the kernel takes the shapes; else its ops run apart.

``stats`` counts them as ``rope_in_product``, ``attn_in_product`` and ``sdpa_early_keys``.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np

from gpudelegate import dtypes as _dt
from gpudelegate.plan.fusion import Fusion, view_strides
from gpudelegate.plan.layout import GEMV_MAX_ROWS

from .cuda_kernels import _BLOCK, FreshRows, _ctype
from .cuda_norm_prologue import NormPrologue, overlaps
from .cuda_quant import PackedView, RopeOut

FUSED = "cuda_fused.cu"


_ALIGN = 256  # start of the norm's h inside the scratch (past the concatenated output)


def _cat_out_bytes(f: Fusion, dispatches) -> int:
    rows = _rows(dispatches[f.cat[0]].args[0])
    n = sum(dispatches[k].args[1].shape[0] for k in f.cat)
    return rows * n * _itemsize(dispatches[f.cat[0]].outputs[0].dtype)


def _h_offset(f: Fusion, dispatches) -> int:
    """Where a norm prologue run unfused puts h in the scratch: after the concatenated output."""
    return -(-_cat_out_bytes(f, dispatches) // _ALIGN) * _ALIGN


def scratch_bytes(f: Fusion, dispatches) -> int:
    """Bytes of scratch a group needs (its concatenated GEMM output, then the norm's h where the
    group has a norm prologue, or the attention output)."""
    if f.cat:
        if getattr(f, "norm", None):
            h = dispatches[f.cat[0]].args[0]
            return _h_offset(f, dispatches) + _dt.numel(h.shape) * _itemsize(h.dtype)
        return _cat_out_bytes(f, dispatches)
    if f.kind in ("sdpa_bthd", "sdpa_linear"):  # sdpa_linear: the attention's rows (_early_keys_linear)
        o = dispatches[f.roles["sdpa"]].outputs[0]
        return int(np.prod(o.shape)) * _itemsize(o.dtype)
    return 0


def _itemsize(dt: str) -> int:
    return 2 if dt == "float16" else 4


def _rows(ref) -> int:
    return int(np.prod(ref.shape[:-1])) if len(ref.shape) > 1 else 1


def bind_fusion(kernels, f: Fusion, dispatches, view: Callable, attrs: Dict[int, dict], scratch, where: str,
                dequant: Optional[tuple] = None, stats: Optional[dict] = None) -> Optional[Callable[[], None]]:
    """``dequant``: the plan's dequantization scratch (memory pointer or None, bytes) for packed
    linears of the group (None: bound without a plan, kernels make their own). ``stats``: counts
    a group's norm prologue as ``norm_prologue`` (inside the product's launch) or
    ``norm_unfused`` (its own launch first)."""
    fn = {"add_rms_norm": _add_rms_norm, "silu_mul": _silu_mul, "rope_kv": _rope_kv, "sdpa_bthd": _sdpa_bthd,
          "sdpa_linear": _sdpa_linear}.get(f.kind)
    if fn is None:
        return None  # a kind the planner knows and these kernels do not carry: its ops run apart
    refs = [r for k in f.members for r in list(dispatches[k].args) + list(dispatches[k].outputs) if r is not None]
    if any(0 in tuple(r.shape) for r in refs):
        return None  # an empty tensor (a zero-size dim): the ops run apart, empty outputs launch nothing
    pro = None
    if getattr(f, "norm", None):
        if not f.cat:
            return None  # the planner gives a norm prologue to concatenated products only
        pro = _norm_prologue(f, dispatches, view)
        if pro is None:
            return None
    got = fn(kernels, f, dispatches, view, attrs, scratch, where, dequant, pro)
    if got is not None and pro is not None and stats is not None:
        key = "norm_unfused" if getattr(got, "norm_unfused", False) else "norm_prologue"
        stats[key] = stats.get(key, 0) + 1
    if got is not None and stats is not None and getattr(got, "in_product", None):
        stats[got.in_product] = stats.get(got.in_product, 0) + 1
    return got


def _norm_prologue(f: Fusion, dispatches, view) -> Optional[NormPrologue]:
    """The group's Fusion.norm on device views as [M, K] rows, or None where the norm's operands,
    sum and output are not all of one float dtype (the ops then run apart, as unfused)."""
    n = f.norm
    h = dispatches[f.cat[0]].args[0]
    K = int(h.shape[-1])
    x = view(n["x"] if n["add"] is not None else n["src"])
    y = view(n["y"]) if n["add"] is not None else None
    s = view(n["s"]) if n["add"] is not None and n["s"] is not None else None
    w = view(n["w"]) if n["w"] is not None else None
    if any(a is not None and a.dtype != view(h).dtype for a in (x, y, s)) or x.dtype.kind != "f":
        return None
    if any(a is not None and a.size != x.size for a in (y, s)) or x.size != _dt.numel(h.shape):
        return None
    rows = lambda a: None if a is None else a.reshape(-1, K)
    return NormPrologue(rows(x), rows(y), None if w is None else w.reshape(-1), rows(s), float(n["eps"]))


def _unfused_mark(fn: Callable[[], None]) -> Callable[[], None]:
    fn.norm_unfused = True  # read by bind_fusion's count
    return fn


def _cat_weight(kernels, f: Fusion, dispatches, view):
    """(the concatenated weight [N_0 + N_1 + ..., K] as one view, first row of each part, x as
    [rows, K]) or None when the weights are not back to back or the product is empty."""
    cp = kernels.cp
    ws = [view(dispatches[k].args[1]) for k in f.cat]
    x = view(dispatches[f.cat[0]].args[0])
    K = ws[0].shape[1]
    packed = isinstance(ws[0], PackedView)
    # bytes of one weight row: rows of back-to-back weights continue one another
    row_bytes = (lambda w: w.row_bytes) if packed else (lambda w: w.shape[1] * w.itemsize)
    ptr = ws[0].raw.data.ptr if packed else ws[0].data.ptr
    offs, n = [], 0
    for w in ws:
        if isinstance(w, PackedView) != packed or w.dtype != ws[0].dtype or w.shape[1] != K:
            return None
        if (w.raw.data.ptr if packed else w.data.ptr) != ptr + n * row_bytes(ws[0]):
            return None
        offs.append(n)
        n += w.shape[0]
    if K == 0 or x.size == 0:
        return None  # an empty product: the linears run apart (zeros + bias, or nothing to launch)
    if packed:
        wcat = PackedView(ws[0].dtype, (n, K), cp.ndarray((_dt.nbytes(ws[0].dtype, (n, K)),), dtype=np.uint8,
                                                          memptr=ws[0].raw.data))
    else:
        wcat = cp.ndarray((n, K), dtype=ws[0].dtype, memptr=ws[0].data)
    return wcat, offs, x.reshape(-1, K)


def _cat_gemm(kernels, f: Fusion, dispatches, view, scratch, dequant, pro: Optional[NormPrologue] = None):
    """(closure running x @ [W_0; W_1; ...]^T into scratch, scratch view [rows, N], column
    offsets of the parts) or None when the weights are not back to back. With ``pro`` (the
    group's norm prologue) x is its h: computed inside the product's launch where a kernel
    carries it, else by the unfused norm into the scratch past the product's output first (the
    closure then has ``norm_unfused`` set)."""
    cp = kernels.cp
    got = _cat_weight(kernels, f, dispatches, view)
    if got is None:
        return None
    wcat, offs, x2 = got
    n = wcat.shape[0]
    rows = x2.shape[0]
    out_dt = view(dispatches[f.cat[0]].outputs[0]).dtype
    scr = cp.ndarray((rows, n), dtype=out_dt, memptr=scratch)
    where = f"fused GEMM of linears {f.cat}"
    if pro is None:
        return kernels.linear(x2, wcat, None, scr, where, scratch=dequant), scr, offs
    mm = kernels.linear_norm(pro, wcat, scr, where)
    if mm is not None:
        return mm, scr, offs
    h = cp.ndarray(x2.shape, dtype=x2.dtype, memptr=scratch + _h_offset(f, dispatches))
    norm = pro.unfused(kernels, h)
    prod = kernels.linear(h, wcat, None, scr, where, scratch=dequant)

    def run():
        norm()
        prod()
    return _unfused_mark(run), scr, offs


def _carry_mark(src: Callable, fn: Callable[[], None]) -> Callable[[], None]:
    """fn, marked as src is (a group's closure built around its product's)."""
    if getattr(src, "norm_unfused", False):
        fn.norm_unfused = True
    return fn


def _add_rms_norm(kernels, f, dispatches, view, attrs, scratch, where, dequant, pro):
    r = f.roles
    x, y, s, h = view(r["x"]), view(r["y"]), view(r["s"]), view(r["h"])
    w = view(r["w"]) if r["w"] is not None else None
    cols = s.shape[-1]
    rows = s.size // cols if cols else 0
    if not rows:
        return lambda: None
    wt = w if w is not None else x
    fk = kernels.func(FUSED, f"add_rms_norm<{_ctype(x)},{_ctype(wt)}>")
    eps = np.float32(attrs[r["norm"]].get("eps", 1e-6))
    block = min(_BLOCK, max(32, (cols + 31) // 32 * 32))
    a = (x, y, wt, s, h, np.int32(cols), eps, np.int32(w is not None))
    return lambda: fk((rows,), (block,), a)


def _silu_mul(kernels, f, dispatches, view, attrs, scratch, where, dequant, pro):
    r = f.roles
    out = view(r["out"])
    cols = out.shape[-1]
    rows = out.size // cols if cols else 0
    fk = kernels.func(FUSED, f"silu_mul<{_ctype(out)}>")
    n = rows * cols
    grid = ((n + _BLOCK - 1) // _BLOCK,)
    if f.cat:
        one = _packed_silu(kernels, f, dispatches, view, out, pro)
        if one is not None:
            return one
        got = _cat_gemm(kernels, f, dispatches, view, scratch, dequant, pro)
        if got is None:
            return None
        mm, scr, offs = got
        N = scr.shape[1]
        g = np.uint64(scr.data.ptr + offs[r["g_part"]] * scr.itemsize)
        u = np.uint64(scr.data.ptr + offs[r["u_part"]] * scr.itemsize)
        a = (g, np.int64(N), u, np.int64(N), out, np.int64(rows), np.int32(cols))

        def run():
            mm()
            fk(grid, (_BLOCK,), a)
        return _carry_mark(mm, run)
    g, u = view(r["g"]), view(r["u"])
    a = (g, np.int64(cols), u, np.int64(cols), out, np.int64(rows), np.int32(cols))
    return lambda: fk(grid, (_BLOCK,), a) if n else None


def _packed_silu(kernels, f, dispatches, view, out, pro):
    """A packed gate/up group over at most 8 rows as one launch (QuantKernels.gemv_silu, with the
    norm prologue ``pro`` when the group has one), or None: float weights, more rows, or an
    output sharing bytes with what the launch reads (every block reads all of x, or of the
    norm's operands, while others write out, so the products then go through the scratch
    first)."""
    got = _cat_weight(kernels, f, dispatches, view)
    if got is None or not isinstance(got[0], PackedView) or len(f.cat) != 2:
        return None
    wcat, offs, x2 = got
    r = f.roles
    n = out.shape[-1]
    if offs[1] != n or wcat.shape[0] != 2 * n:
        return None
    if pro is None and overlaps(out, x2):
        return None  # with a prologue, gemv_silu checks out against the norm's operands
    return kernels.quant.gemv_silu(x2, wcat, offs[r["g_part"]], offs[r["u_part"]], n, out.reshape(-1, n), norm=pro)


def _in_product(fn: Callable[[], None], what: str) -> Callable[[], None]:
    fn.in_product = what  # read by bind_fusion's count
    return fn


def _rope_in_product(kernels, f: Fusion, dispatches, view, pro) -> Optional[Callable[[], None]]:
    """The rope_kv group as one QuantKernels.gemv_rope launch, or None: each part of the packed
    concatenated product has exactly one job, reading it as heads of D contiguous columns
    ([B, T, H, D] viewed as [B, H, T, D]: x row b T + t, column h D + d of the part), the jobs
    agreeing on T, D, the tables and the position (the planner's compatibility), at most 8 rows."""
    got = _cat_weight(kernels, f, dispatches, view)
    if got is None or not isinstance(got[0], PackedView):
        return None
    wcat, offs, x2 = got
    by_part = {j.cat_part: j for j in f.jobs}
    if len(by_part) != len(f.jobs) or sorted(by_part) != list(range(len(f.cat))):
        return None
    jobs = [by_part[p] for p in range(len(f.cat))]
    ncat = wcat.shape[0]
    B, _, T, D = jobs[0].shape
    for j, k in zip(jobs, f.cat):
        b, H, t, d = j.shape
        want = (T * ncat, D, ncat, 1)  # strides of [B, H, T, D] in the concatenated rows
        st = view_strides(j.src.shape, ncat, j.view)
        if (b, t, d) != (B, T, D) or H * D != dispatches[k].args[1].shape[0] or st is None or \
                any(n > 1 and g != e for n, g, e in zip(j.shape, st, want)):
            return None
    if B * T != x2.shape[0]:
        return None
    rope = [j for j in jobs if j.rope]
    cache = [j for j in jobs if j.cache]
    out = RopeOut(dsts=tuple(view(j.dst) for j in jobs), heads=tuple(j.shape[1] for j in jobs),
                  cache=tuple(j.cache for j in jobs), rope=tuple(j.rope for j in jobs),
                  cos=view(rope[0].cos) if rope else None, sin=view(rope[0].sin) if rope else None,
                  pos=view(cache[0].pos) if cache else None, T=T, D=D,
                  S=cache[0].dst.shape[2] if cache else 0)
    fn = kernels.quant.gemv_rope(None if pro is not None else x2, wcat, out, norm=pro)
    return None if fn is None else _in_product(fn, "rope_in_product")


def _rope_kv(kernels, f, dispatches, view, attrs, scratch, where, dequant, pro):
    jobs = f.jobs
    if not 1 <= len(jobs) <= 3:
        return None
    pre = None
    if f.cat and _rows(dispatches[f.cat[0]].args[0]) <= GEMV_MAX_ROWS:
        one = _rope_in_product(kernels, f, dispatches, view, pro)
        if one is not None:
            return one
    if f.cat:
        got = _cat_gemm(kernels, f, dispatches, view, scratch, dequant, pro)
        if got is None:
            return None
        pre, scr, offs = got
    dst0 = view(jobs[0].dst)
    T = _ctype(dst0)
    rope_jobs = [j for j in jobs if j.rope]
    cache_jobs = [j for j in jobs if j.cache]
    cs = view(rope_jobs[0].cos) if rope_jobs else dst0
    sn = view(rope_jobs[0].sin) if rope_jobs else dst0
    pos = view(cache_jobs[0].pos) if cache_jobs else None
    S = cache_jobs[0].dst.shape[2] if cache_jobs else 0
    B, _, Tn, D = jobs[0].shape
    params: List = []
    for i in range(3):
        if i >= len(jobs):
            params += [np.uint64(0), np.uint64(0), np.int64(0), np.int64(0), np.int64(0), np.int32(1), np.int64(0)]
            continue
        j = jobs[i]
        if f.cat and j.cat_part >= 0:
            N = scr.shape[1]
            base = scr.data.ptr + offs[j.cat_part] * scr.itemsize
            strides = view_strides(j.src.shape, N, j.view)
        else:
            src = view(j.src)
            base = src.data.ptr
            strides = view_strides(j.src.shape, j.src.shape[-1], j.view)
        if strides is None or (D > 1 and strides[3] != 1):
            return None
        dst = view(j.dst)
        H = j.shape[1]
        hmr = H | ((1 if j.cache else 0) << 24) | ((1 if j.rope else 0) << 25)
        params += [np.uint64(base), np.uint64(dst.data.ptr), np.int64(strides[0]), np.int64(strides[1]),
                   np.int64(strides[2]), np.int32(hmr), np.int64(B * H * Tn * (D // 2))]
    total = sum(int(params[7 * i + 6]) for i in range(3))
    fk = kernels.func(FUSED, f"rope_kv<{T},{_ctype(cs)}>")
    a = tuple(params) + (cs, sn, pos if pos is not None else dst0, np.int32(Tn), np.int32(D), np.int32(S))
    grid = ((total + _BLOCK - 1) // _BLOCK,)
    if pre is None:
        return lambda: fk(grid, (_BLOCK,), a) if total else None

    def run():
        pre()
        if total:
            fk(grid, (_BLOCK,), a)
    return _carry_mark(pre, run)


def _sdpa_linear(kernels, f, dispatches, view, attrs, scratch, where, dequant, pro):
    """The attention's partials, then the packed o product merging them (QuantKernels.gemv_attn),
    or None (the ops run apart): a residual add in the group, a float weight, an attention in
    one split, a merge too large for the product's shared memory."""
    r = f.roles
    sd, lin = dispatches[r["sdpa"]], dispatches[r["linear"]]
    if r.get("add") is not None or lin.args[1] is None:
        return None
    if not kernels.quant.attn_in_product:
        return _early_keys_linear(kernels, f, dispatches, view, attrs, scratch, where, dequant)
    if not _dt.is_packed(lin.args[1].dtype):
        return None  # (checked first: binding the partials would allocate them for nothing)
    w = view(lin.args[1])
    if not isinstance(w, PackedView) or len(w.shape) != 2:
        return None
    args = [None if a is None else view(a) for a in sd.args]
    att = kernels.sdpa_partials(args, view(sd.outputs[0]), attrs[r["sdpa"]], where)
    if att is None:
        return None
    bias = view(lin.args[2]) if len(lin.args) > 2 and lin.args[2] is not None else None
    out = view(lin.outputs[0])
    N = w.shape[0]
    if out.size % N or out.dtype != view(sd.outputs[0]).dtype:
        return None  # the merged rows are stored as the attention output's dtype, the product's
    mm = kernels.quant.gemv_attn(att.part_o, att.part_ml, att.rows, att.dv, att.splits, w, bias,
                                 out.reshape(-1, N), where)
    if mm is None:
        return None
    first = att.run

    def run():
        first()
        mm()
    return _in_product(run, "attn_in_product")


def fresh_rows(dispatches, at: int, view) -> Optional[FreshRows]:
    """The fact that lets the decode attention ``dispatches[at]`` read its cache rows before its
    wait (cuda_kernels.FreshRows), or None where the plan does not show it: its k and v are each
    the in-place output of a kv_update (cache and output at one address) with one position, and
    no dispatch before the attention but that kv_update writes a byte of the cache or of the
    position. The cache and the position are then what the run began with (inputs, written
    before the run) but for the kv_update's rows; groups run at their last member, so a write
    the attention could meet comes from a dispatch listed before it."""
    sd = dispatches[at]
    if len(sd.args) < 3 or sd.args[1] is None or sd.args[2] is None:
        return None
    writer = {o.value: i for i, d in enumerate(dispatches[:at]) for o in d.outputs}
    pos, n, ranges = None, 0, []
    for ref in (sd.args[1], sd.args[2]):
        i = writer.get(ref.value)
        if i is None or dispatches[i].op != "kv_update":
            return None
        cache, new, p = dispatches[i].args
        c, out = view(cache), view(dispatches[i].outputs[0])
        if not c.data.ptr == out.data.ptr == view(ref).data.ptr or c.nbytes != out.nbytes \
                or (pos is not None and p.value != pos.value):
            return None
        pos, n = p, int(new.shape[2])
        ranges.append((i, c.data.ptr, c.data.ptr + c.nbytes))
    pv = view(pos)
    ranges.append((-1, pv.data.ptr, pv.data.ptr + pv.nbytes))
    for m, d in enumerate(dispatches[:at]):
        for o in d.outputs:
            ov = view(o)
            lo, hi = ov.data.ptr, ov.data.ptr + ov.nbytes
            if any(m != i and lo < b and a < hi for i, a, b in ranges):
                return None
    return FreshRows(pv, n)


def _early_keys_linear(kernels, f, dispatches, view, attrs, scratch, where, dequant):
    """The sdpa_linear group where the attention's partials are not merged in the product: the
    decode attention reading its cache rows before its wait (CudaKernels.sdpa_early_keys, where
    fresh_rows shows the fact and the kernel takes the shapes) into the scratch, then the
    product over those rows (the group's view ops are no-op reshapes: the attention's [B, H, 1,
    Dv] are the product's rows). None otherwise: the ops run apart (sdpa_tile + sdpa_combine)."""
    cp = kernels.cp
    r = f.roles
    sd, lin = dispatches[r["sdpa"]], dispatches[r["linear"]]
    fresh = fresh_rows(dispatches, r["sdpa"], view) if kernels.sdpa_early_keys_on else None
    if fresh is None:
        return None
    o = view(sd.outputs[0])
    tmp = cp.ndarray(o.shape, dtype=o.dtype, memptr=scratch)
    att = kernels.sdpa_early_keys([None if a is None else view(a) for a in sd.args], tmp, attrs[r["sdpa"]],
                                  where, fresh)
    if att is None:
        return None
    w = view(lin.args[1])
    bias = view(lin.args[2]) if len(lin.args) > 2 and lin.args[2] is not None else None
    out = view(lin.outputs[0])
    N, K = w.shape[0], w.shape[-1]
    if len(w.shape) != 2 or out.size % N or view(lin.args[0]).dtype != o.dtype or o.size % K:
        return None
    mm = kernels.linear(tmp.reshape(-1, K), w, bias, out.reshape(-1, N), where, scratch=dequant)

    def run():
        att()
        mm()
    return _in_product(run, "sdpa_early_keys")  # counted in stats like the products' groups


def _sdpa_bthd(kernels, f, dispatches, view, attrs, scratch, where, dequant, pro):
    cp = kernels.cp
    r = f.roles
    sd = dispatches[r["sdpa"]]
    lin = dispatches[r["linear"]]
    o = view(sd.outputs[0])  # [B, H, T, Dv]: only its shape and dtype are used
    B, H, T, Dv = o.shape
    tmp = cp.ndarray((B, T, H, Dv), dtype=o.dtype, memptr=scratch)
    args = [None if a is None else view(a) for a in sd.args]
    att = kernels._op_sdpa(args, [tmp], attrs[r["sdpa"]], where, out_bthd=True)
    x2 = tmp.reshape(-1, H * Dv)
    w = view(lin.args[1])
    bias = view(lin.args[2]) if len(lin.args) > 2 and lin.args[2] is not None else None
    out = view(lin.outputs[0])
    o2 = out.reshape(-1, w.shape[0])
    # cuBLAS (+ bias) for a float weight, the cuda_quant kernels for a packed one
    mm = kernels.linear(x2, w, bias, o2, where, scratch=dequant)

    def run():
        att()
        mm()
    return run
