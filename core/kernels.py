"""Kernel selection for the WGSL executors (desktop wgpu and the browser): pure Python.

Given one :class:`~gpudelegate.plan.types.Dispatch` of a plan, :func:`select` returns the kernel
calls that carry it out: which shader file (``gpudelegate.shaders.source(name)``) and entry
point, the pipeline-overridable constants, the uniform bytes (binding 0), the storage bindings
(byte ranges of plan buffers) and the workgroup counts. Executors only create pipelines and bind
groups from these and replay them; the two WebGPU executors therefore run exactly the same
kernels with exactly the same parameters.

Conventions every executor follows:

- ``@group(0)``: binding 0 is the uniform, bindings 1.. the storage buffers listed in
  ``KernelCall.bindings`` (every one the entry point uses; all are ``read_write`` storage, because
  WebGPU forbids one buffer in a read-only and a writable binding of one dispatch, and the memory
  planner places an op's inputs and output at offsets of one buffer).
- A binding's ``buf`` is a :class:`BufferRef` whose ``space`` is a plan space (``arena``,
  ``resident``, ``slot``), ``scratch`` (a per-payload temporary: allocate ``scratch_sizes(calls)``),
  or ``dummy`` (an unused input: a range of one buffer of ``dummy_nbytes(limits)`` bytes; each
  slot gets its own range).
- No two bindings of one call overlap (WebGPU/Dawn rejects overlapping writable bindings, and all
  of ours are writable): binding 1 is the one every kernel writes; an input whose range overlaps
  an earlier binding of the call (``x * x``, an op reading its own output) is first copied into a
  scratch ("snapshot") by a call of its own, so executors need no workaround. ``offset`` is a multiple of the
  device's storage offset alignment and ``nbytes`` (the bound size) a multiple of 4, so every
  buffer must be allocated with its size rounded up to 4 bytes.
- Calls of one dispatch run in order in one compute pass (WebGPU orders storage writes between
  dispatches); a dispatch may leave nothing to run (``reshape`` where the plan aliased storage).

Carrying out one call (both executors)::

    module   = createShaderModule(gpudelegate.shaders.source(call.shader))      # cache per file
    pipeline = createComputePipeline(module, call.entry, constants=call.constants,
                                     layout: binding 0 uniform, b.binding storage for b in bindings)
                                     # cache per call.pipeline_key ("auto" layout also works: each
                                     # entry uses exactly its bindings, tests/test_wgpu_kernels.py)
    group    = {0: a uniform buffer range holding call.uniform (size rounded up to 4)}
             + {b.binding: (buffer of b.buf.space/index, b.buf.offset, b.buf.nbytes)}
    pass.setPipeline(pipeline); pass.setBindGroup(0, group); pass.dispatchWorkgroups(*call.workgroups)

Tensors larger than ``limits.max_binding_size`` are split: map kernels (elementwise, layout ops,
casts) into sub-boxes, matrix products along N (a weight's rows), M or the batch, embedding tables
into row ranges, row kernels (norms, softmax, reductions) into row ranges. What cannot be split
raises :class:`DeviceError` naming the tensor and the limit.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from . import dtypes as _dt
from . import ops as _ops
from .errors import DeviceError, PayloadError, UnsupportedOpError
from .plan.types import BufferRef, DeviceLimits, Dispatch, TensorRef

DT_CODE = {"float32": 0, "float16": 1, "int32": 2, "bool": 3}
WG = 256  # threads per workgroup of the 1-D (map-like) kernels
MAX_GROUPS = 65535  # maxComputeWorkgroupsPerDimension (WebGPU default)
MAX_RANK = 8  # dims of a map view after merging
MAX_CALLS = 4096  # splitting that would need more calls than this is refused
DUMMY = BufferRef("dummy", 0, 0, 16)  # placeholder: emit() gives each slot its own range
MAX_SLOT = 7  # highest storage binding slot any entry point uses


def dummy_nbytes(limits: DeviceLimits) -> int:
    """Size of the buffer that backs ``dummy`` bindings (slot k binds 16 bytes at k * alignment)."""
    return (MAX_SLOT + 1) * max(4, limits.offset_alignment) + 16

# The element functions of elementwise.wgsl's `map`, by code (kept in the WGSL switch order).
MAP_OPS = ("copy", "fill", "add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt",
           "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "where", "neg", "abs", "exp",
           "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu", "silu", "erf", "reciprocal",
           "gelu", "gelu_tanh", "hardtanh")
MAP_CODE = {name: i for i, name in enumerate(MAP_OPS)}
_INT_OK = {"copy", "fill", "add", "sub", "mul", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt",
           "ge", "logical_and", "logical_or", "logical_not", "where", "neg", "abs", "relu"}


@dataclass(frozen=True)
class EntrySpec:
    """What an entry point declares: its shader file, storage binding slots and overrides."""

    shader: str
    slots: Tuple[int, ...]
    overrides: Tuple[str, ...]


ENTRIES: Dict[str, EntrySpec] = {
    "map": EntrySpec("elementwise.wgsl", (1, 2, 3, 4, 5),
                     ("DT_OUT", "OP", "NIN", "DT0", "DT1", "DT2", "INT_MATH", "DYN", "EPT")),
    "mm": EntrySpec("matmul.wgsl", (1, 2, 3, 4),
                    ("DT_OUT", "DTA", "DTB", "DTBIAS", "BIAS", "A_KMAJOR", "B_NMAJOR", "WX", "WY", "BK", "TM")),
    "mm_f32": EntrySpec("matmul_fast.wgsl", (1, 2, 3, 4, 5, 6, 7),
                        ("BIAS", "B_KMAJOR", "WX", "WY", "BK", "TM", "KSPLIT", "STAGES", "ACT", "RES", "NC")),
    "mm_f32_4": EntrySpec("matmul_fast.wgsl", (1, 2, 3, 4, 5, 6, 7),
                          ("BIAS", "B_KMAJOR", "WX", "WY", "BK", "TM", "KSPLIT", "STAGES", "ACT", "RES", "NC")),  # STAGES: 1
    "mm_f32_sum": EntrySpec("matmul_fast.wgsl", (1, 2, 5, 6, 7), ("KSPLIT", "ACT", "RES", "NC")),
    "gemv_k": EntrySpec("matmul.wgsl", (1, 2, 3, 4), ("DT_OUT", "DTA", "DTB", "DTBIAS", "BIAS", "GM")),
    "gemv_n": EntrySpec("matmul.wgsl", (1, 2, 3, 4), ("DT_OUT", "DTA", "DTB", "DTBIAS", "BIAS", "GM")),
    "conv2d": EntrySpec("conv.wgsl", (1, 2, 3, 4), ("DT_OUT", "DTX", "DTW", "DTBIAS", "HAS_BIAS")),
    "pool2d": EntrySpec("conv.wgsl", (1, 2), ("DT_OUT", "DTX", "POOL_MAX")),
    "norm_rows": EntrySpec("norm.wgsl", (1, 2, 3, 4),
                           ("DT_OUT", "DTX", "DTW", "DTB", "HAS_W", "HAS_B", "NORM_RMS", "RWG")),
    "batch_norm": EntrySpec("norm.wgsl", (1, 2, 3, 4, 5, 6),
                            ("DT_OUT", "DTX", "DTW", "DTB", "DTM", "DTV", "HAS_W", "HAS_B")),
    "softmax_rows": EntrySpec("softmax.wgsl", (1, 2, 3), ("DT_OUT", "DTX", "DTM", "MASK", "CAUSAL", "LOG", "RWG")),
    "reduce_rows": EntrySpec("reduce.wgsl", (1, 2), ("DT_OUT", "DTX", "OP", "INT_MATH", "RWG")),
    "embedding": EntrySpec("embedding.wgsl", (1, 2, 3), ("DT_OUT", "DTW")),
    "rope": EntrySpec("rope.wgsl", (1, 2, 3, 4), ("DT_OUT", "DTX", "DTC", "DTS")),
    "attn_rows": EntrySpec("attention.wgsl", (1, 2, 3, 4, 5),
                           ("DT_OUT", "DTQ", "DTK", "DTV", "DTM", "MASK", "CAUSAL", "AWG")),
    "attn_split": EntrySpec("attention.wgsl", (1, 2, 3, 4, 5),
                            ("DTQ", "DTK", "DTV", "DTM", "MASK", "CAUSAL", "AWG")),
    "attn_combine": EntrySpec("attention.wgsl", (1, 6), ("DT_OUT",)),
    "attn_tile": EntrySpec("attention_tile.wgsl", (1, 2, 3, 4, 5), ("DTM", "MASK", "CAUSAL", "CGS")),
}
ATTN_MAX_KEYS = 2048  # attention.wgsl SCORES
ATTN_MAX_HEAD_DIM = 256  # attention.wgsl QMAX
ATTN_SPLIT_ROWS = 8  # attention.wgsl RB: query rows of one kv head per attn_split workgroup
ATTN_TILE_MAX_KEYS = 128  # attention_tile.wgsl TKM
ATTN_TILE_ROWS = 16  # attention_tile.wgsl BR: query rows per attn_tile workgroup


@dataclass(frozen=True)
class Binding:
    binding: int  # @binding(n) of @group(0)
    buf: BufferRef  # where: aligned offset, bound size in nbytes


@dataclass
class KernelCall:
    shader: str
    entry: str
    constants: Dict[str, Union[int, float, bool]]
    uniform: bytes  # contents of binding 0
    bindings: List[Binding]
    workgroups: Tuple[int, int, int]
    label: str = ""

    uniform_binding = 0

    @property
    def pipeline_key(self) -> tuple:
        return (self.shader, self.entry, tuple(sorted(self.constants.items())),
                tuple(b.binding for b in self.bindings))


@dataclass(frozen=True)
class Tuning:
    """Choices a benchmark or a test may force; the defaults suit a discrete GPU."""

    mm_tile: Optional[int] = None  # 128 or 64 (8x8 per thread, or 4x4 with mm_tm=4), 32 (4x4); None: by tile count
    mm_bk: Optional[int] = None  # K step of the tiled kernel (default 8; 16 doubles workgroup memory)
    big_tile_min_groups: int = 96  # 128x128 tiles only when they still give this many workgroups
    huge_tile_min_groups: int = 384  # float32 8x8 kernel: 128x128 tiles from this many, below 64x128 split-K 2
    gemv_max_m: int = 4  # M at or below this uses the gemv kernels (must be <= 4)
    attn_fused_max_tq: int = 16  # sdpa with at most this many query rows runs as one fused kernel
    attn_split: bool = True  # ... and that kernel is split-K (attn_split + attn_combine); False: attn_rows
    attn_split_min_groups: int = 128  # 64-key chunks when they give this many workgroups, else 32
    attn_tile: bool = True  # longer float32 query blocks over <= 128 keys: one-pass attn_tile (False: composite)
    mm_fast: bool = True  # float32 products with vec4-aligned rows use matmul_fast.wgsl (False: never)
    mm_tm: Optional[int] = None  # outputs per thread along m and n (8 or 4); None: by the tile choice
    mm_ksplit: Optional[int] = None  # split-K ways of mm_f32_4, or of mm_f32 when given (1 = none); None: by the rule below
    mm_tile_n: Optional[int] = None  # mm_f32 (8x8 per thread): the tile's N edge when not mm_tile (128x64, 64x128)
    mm_stages: Optional[int] = None  # mm_f32: 2 = double-buffered shared tiles (one barrier per K step)
    fuse: bool = True  # select_all: epilogues in linear kernels, head permutes folded into attention
    ksplit_below_groups: int = 256  # split K (mm_f32_4) only products with fewer workgroups than this ...
    ksplit_target_groups: int = 1024  # ... into up to 8 ranges of >= 64 of K until there are this many


def scratch_sizes(calls: Sequence[KernelCall]) -> Dict[int, int]:
    """Bytes each scratch buffer index needs for ``calls`` (allocate the maximum over a payload)."""
    out: Dict[int, int] = {}
    for c in calls:
        for b in c.bindings:
            if b.buf.space == "scratch":
                out[b.buf.index] = max(out.get(b.buf.index, 0), b.buf.offset + b.buf.nbytes)
    return out


# ------------------------------------------------------------------------------------------ helpers

def _up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _numel(shape) -> int:
    return _dt.numel(shape)


def _contig(shape) -> List[int]:
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return st[::-1]


def _bcast(shape, out_shape) -> List[int]:
    """Element strides reading a contiguous ``shape`` broadcast to ``out_shape`` (numpy rules)."""
    st = _contig(shape)
    lead = len(out_shape) - len(shape)
    return [0] * lead + [0 if s == 1 and o != 1 else t for s, t, o in zip(shape, st, out_shape[lead:])]


def _grid(threads: int, wg: int = WG) -> Tuple[int, int, int]:
    groups = max(1, -(-threads // wg))
    x = min(groups, MAX_GROUPS)
    return (x, -(-groups // x), 1)


def _row_grid(rows: int) -> Tuple[int, int, int]:
    x = min(max(rows, 1), MAX_GROUPS)
    return (x, -(-rows // x), 1)


def _u32(*vals) -> bytes:
    try:
        return struct.pack(f"<{len(vals)}I", *vals)
    except struct.error:
        raise DeviceError(f"a kernel parameter does not fit 32 bits: {vals}") from None


def _vec8(vals: Sequence[int]) -> bytes:
    return _u32(*(list(vals) + [0] * (MAX_RANK - len(vals))))


@dataclass(frozen=True)
class _T:
    """A tensor in device memory: a plan buffer range, or a scratch buffer."""

    space: str
    index: int
    offset: int  # bytes
    dtype: str
    numel: int
    name: str = ""

    @classmethod
    def of(cls, ref: TensorRef, name: str = "") -> "_T":
        return cls(ref.buf.space, ref.buf.index, ref.buf.offset, ref.dtype, _numel(ref.shape),
                   name or f"value {ref.value}")

    @property
    def isz(self) -> int:
        return _dt.ITEMSIZE[self.dtype]

    @property
    def code(self) -> int:
        return DT_CODE[self.dtype]

    def same_place(self, other: "_T") -> bool:
        return (self.space, self.index, self.offset) == (other.space, other.index, other.offset)


class _NoFusion(Exception):
    """A fused epilogue this product's kernel cannot take (select_all lowers the ops apart)."""


class _TooBig(Exception):
    def __init__(self, t: _T, nbytes: int):
        self.t, self.nbytes = t, nbytes


@dataclass
class _View:
    """A strided view of a tensor: element ``base + sum(i_d * strides[d])``."""

    t: _T
    base: int
    strides: List[int]


class _Lowering:
    """Collects the calls of one dispatch."""

    def __init__(self, d: Dispatch, limits: DeviceLimits, features, tuning: Tuning):
        self.d = d
        self.limits = limits
        self.features = frozenset(features or ())
        self.tuning = tuning
        self.calls: List[KernelCall] = []
        self.nscratch = 0
        self.label = f"node {d.node} {d.op}"

    # ---------------------------------------------------------------- memory
    def scratch(self, dtype: str, numel: int) -> _T:
        t = _T("scratch", self.nscratch, 0, dtype, numel, f"scratch {self.nscratch} of {self.label}")
        self.nscratch += 1
        if _up(max(numel * t.isz, 4), 4) > self.limits.max_buffer_size:
            raise DeviceError(f"{self.label}: a {numel * t.isz}-byte temporary exceeds maxBufferSize "
                              f"{self.limits.max_buffer_size}")
        return t

    def span(self, t: _T, lo: int, hi: int) -> int:
        """Bytes of the binding that covers elements [lo, hi) of ``t``."""
        start = t.offset + lo * t.isz
        end = t.offset + max(hi, lo + 1) * t.isz
        a = start // self.align * self.align
        return _up(end, 4) - a

    @property
    def align(self) -> int:
        return max(4, self.limits.offset_alignment)

    def fits(self, t: _T, lo: int, hi: int) -> bool:
        return self.span(t, lo, hi) <= self.limits.max_binding_size

    def bind(self, slot: int, t: Optional[_T], lo: int = 0, hi: Optional[int] = None) -> Tuple[Binding, int]:
        """Binding of elements [lo, hi) of ``t`` (whole tensor by default); returns it and the
        element index of element ``lo`` inside the binding."""
        if t is None:
            return Binding(slot, DUMMY), 0
        hi = t.numel if hi is None else hi
        if t.offset % min(t.isz, 4):
            raise DeviceError(f"{self.label}: {t.name} sits at byte offset {t.offset}, not a multiple of "
                              f"its {t.isz}-byte elements")
        start = t.offset + lo * t.isz
        a = start // self.align * self.align
        size = self.span(t, lo, hi)
        if size > self.limits.max_binding_size:
            raise _TooBig(t, size)
        return Binding(slot, BufferRef(t.space, t.index, a, size)), (start - a) // t.isz

    def too_big(self, t: _T, nbytes: int, how: str = "") -> DeviceError:
        return DeviceError(f"{self.label}: {t.name} needs a {nbytes}-byte binding, over this device's "
                           f"maxStorageBufferBindingSize {self.limits.max_binding_size}"
                           f"{'; ' + how if how else ''}")

    def emit(self, entry: str, constants: dict, uniform: bytes, bindings: List[Binding],
             workgroups: Tuple[int, int, int], what: str = "") -> None:
        spec = ENTRIES[entry]
        if len(self.calls) >= MAX_CALLS:
            raise DeviceError(f"{self.label}: splitting for the binding limit needs more than {MAX_CALLS} kernel calls")
        assert set(constants) <= set(spec.overrides), (entry, set(constants) - set(spec.overrides))
        assert sorted(b.binding for b in bindings) == list(spec.slots), (entry, bindings)
        if workgroups[1] > MAX_GROUPS or workgroups[2] > MAX_GROUPS:
            raise DeviceError(f"{self.label}: {workgroups} workgroups exceed {MAX_GROUPS} per dimension")
        bindings = self._distinct(sorted(bindings, key=lambda b: b.binding), entry)
        self.calls.append(KernelCall(spec.shader, entry, dict(constants), uniform, bindings,
                                     workgroups, f"{self.label}{(' ' + what) if what else ''}"))

    def _distinct(self, bindings: List[Binding], entry: str) -> List[Binding]:
        """Bindings with no two overlapping: dummies at per-slot ranges; an input overlapping an
        earlier binding (slot 1, the written one, comes first) is read from a scratch snapshot of
        its range, copied by a call emitted just before this one. The snapshot keeps the range's
        layout (byte 0 of the scratch is the range's first byte), so element bases stay valid."""
        out: List[Binding] = []
        for b in bindings:
            r = b.buf
            if r.space == "dummy":
                r = BufferRef("dummy", 0, b.binding * self.align, 16)
            elif any(k.buf.space == r.space and k.buf.index == r.index and r.offset < k.buf.offset + k.buf.nbytes
                     and k.buf.offset < r.offset + r.nbytes for k in out if k.buf.space != "dummy"):
                n = r.nbytes // 4
                snap = self.scratch("int32", n)
                src = _T(r.space, r.index, r.offset, "int32", n, f"binding {b.binding} of {entry}")
                self.map("copy", _full(snap, [n]), [_full(src, [n])], [n], what=f"snapshot of binding {b.binding}")
                r = BufferRef("scratch", snap.index, 0, r.nbytes)
            out.append(Binding(b.binding, r))
        return out

    # ---------------------------------------------------------------- map kernel
    def map(self, op: str, out: _View, ins: Sequence[_View], shape: Sequence[int], fa: float = 0.0,
            fb: float = 0.0, dyn: Optional[Tuple[_T, int, int]] = None, what: str = "") -> None:
        """out[view] = op(ins[view]) over ``shape`` (see elementwise.wgsl). ``dyn`` = (pos tensor,
        elements per pos unit, largest pos) adds a device-side row offset to the output (kv_update)."""
        if _numel(shape) == 0:
            return
        if len(ins) > 3:
            raise ValueError("map takes at most 3 inputs")
        views = [out] + list(ins)
        dims = [(s, [v.strides[i] for v in views]) for i, s in enumerate(shape) if s != 1]
        merged: List[Tuple[int, List[int]]] = []
        for s, st in dims:
            if merged and all(p == q * s for p, q in zip(merged[-1][1], st)):
                merged[-1] = (merged[-1][0] * s, st)
            else:
                merged.append((s, st))
        if not merged:
            merged = [(1, [1] + [0] * len(ins))]
        if len(merged) > MAX_RANK:
            raise DeviceError(f"{self.label}: a rank-{len(merged)} strided view (max {MAX_RANK} after merging dims)")
        mshape = [s for s, _ in merged]
        mstrides = [[st[k] for _, st in merged] for k in range(len(views))]
        int_math = op in _INT_OK and out.t.dtype in ("int32", "bool") and \
            all(v.t.dtype in ("int32", "bool") for v in ins)
        consts = {"DT_OUT": out.t.code, "OP": MAP_CODE[op], "NIN": len(ins),
                  "DT0": ins[0].t.code if len(ins) > 0 else 0, "DT1": ins[1].t.code if len(ins) > 1 else 0,
                  "DT2": ins[2].t.code if len(ins) > 2 else 0, "INT_MATH": int_math, "DYN": dyn is not None}
        ts = [v.t for v in views]
        dyn_extent = dyn[1] * dyn[2] if dyn else 0

        def emit_box(sh, st, bases):
            binds = []
            ebases = []
            for k, (t, (lo, hi)) in enumerate(zip(ts, ranges_for(sh, st, bases))):
                b, e = self.bind(1 + k, t, lo, hi)  # OUT is binding 1, IN0..IN2 bindings 2..4
                binds.append(b)
                ebases.append(e)
            for k in range(len(ins) + 1, 4):
                binds.append(Binding(1 + k, DUMMY))
                ebases.append(0)
            if dyn:
                pb, pe = self.bind(5, dyn[0], 0, 1)
                if pe:
                    raise DeviceError(f"{self.label}: {dyn[0].name} is not at a 4-byte boundary")
                binds.append(pb)
            else:
                binds.append(Binding(5, DUMMY))
            n = _numel(sh)
            # float16 output: a thread owns a word of a "row", a maximal run of the view that is
            # contiguous in OUT (trailing dims whose output strides chain from 1). Separate runs
            # are at least one element apart, so no word is shared by two rows of one call.
            row_len = 1
            for s_, o_ in zip(reversed(sh), reversed(st[0])):
                if o_ != row_len:
                    break
                row_len *= s_
            rows = n // row_len
            ppr = row_len // 2 + 1
            ept = 4 if out.t.dtype != "float16" and sh[-1] % 4 == 0 else 1
            threads = rows * ppr if out.t.dtype == "float16" else n // ept
            shp = list(sh)
            strides = [list(s) for s in st] + [[0] * len(sh)] * (4 - len(st))
            uni = (_u32(n, len(sh), rows, ppr, row_len, ebases[0], ebases[1], ebases[2], ebases[3],
                        dyn[1] if dyn else 0, dyn[2] if dyn else 0, 0)
                   + struct.pack("<4f", fa, fb, 0.0, 0.0)
                   + _vec8(shp) + b"".join(_vec8(s) for s in strides))
            self.emit("map", dict(consts, EPT=ept), uni, binds, _grid(threads), what or op)

        def ranges_for(sh, st, bases):
            res = []
            for k, (t, b) in enumerate(zip(ts, bases)):
                ext = sum((s - 1) * x for s, x in zip(sh, st[k])) + 1
                res.append((b, b + ext + (dyn_extent if k == 0 else 0)))
            return res

        self._split(mshape, mstrides, [v.base for v in views], ts, ranges_for, emit_box)

    def _split(self, shape, strides, bases, ts, ranges_for, emit_box) -> None:
        """Emit ``shape`` as boxes whose every operand range fits one binding."""
        rs = ranges_for(shape, strides, bases)
        worst = 1
        culprit = None
        for t, (lo, hi) in zip(ts, rs):
            n = self.span(t, lo, hi)
            if n > self.limits.max_binding_size:
                parts = -(-n // max(1, self.limits.max_binding_size - self.align))
                if parts > worst:
                    worst, culprit = parts, (t, n)
        if culprit is None:
            emit_box(shape, strides, bases)
            return
        if _numel(shape) == 1:
            raise self.too_big(*culprit, "a single element cannot be split")
        d0 = shape[0]
        if d0 == 1:
            self._split(shape[1:], [s[1:] for s in strides], bases, ts, ranges_for, emit_box)
            return
        chunk = -(-d0 // max(worst, 2))
        for s0 in range(0, d0, chunk):
            n0 = min(chunk, d0 - s0)
            nb = [b + s0 * st[0] for b, st in zip(bases, strides)]
            if n0 == 1 and len(shape) > 1:
                self._split(shape[1:], [s[1:] for s in strides], nb, ts, ranges_for, emit_box)
            else:
                self._split([n0] + list(shape[1:]), strides, nb, ts, ranges_for, emit_box)

    def copy(self, src: _View, dst: _View, shape: Sequence[int], what: str = "copy") -> None:
        self.map("copy", dst, [src], shape, what=what)

    def copy_tensor(self, src: _T, dst: _T, shape: Sequence[int], what: str = "copy") -> None:
        st = _contig(shape)
        self.map("copy", _View(dst, 0, st), [_View(src, 0, st)], shape, what=what)


def _full(t: _T, shape) -> _View:
    return _View(t, 0, _contig(shape))


# ------------------------------------------------------------------------------------------ public

def select(d: Dispatch, limits: DeviceLimits, features=(), tuning: Optional[Tuning] = None) -> List[KernelCall]:
    """The kernel calls that carry out dispatch ``d`` on a device with ``limits`` (in order).
    Raises UnsupportedOpError for an op without WGSL kernels and DeviceError for tensors over the
    device's limits that cannot be split."""
    fn = _LOWER.get(d.op)
    if fn is None:
        raise UnsupportedOpError("", f"op {d.op!r} has no WGSL kernel")
    attrs = _ops.normalize_attrs(d.op, d.attrs, d.args)
    lw = _Lowering(d, limits, features, tuning or Tuning())
    if any(_numel(o.shape) == 0 for o in d.outputs):
        return []
    try:
        fn(lw, d, attrs)
    except _TooBig as e:
        raise lw.too_big(e.t, e.nbytes) from None
    return lw.calls


# ---------------------------------------------------------------- fused epilogues

@dataclass(frozen=True)
class Epilogue:
    """The op right after a linear that its matrix kernel carries out instead (matmul_fast.wgsl
    ACT / RES): ``out = gelu(linear)`` (act 1, or 2 for the tanh form) or ``out = linear + res``."""

    consumer: int  # index of the gelu / add dispatch in the payload plan (it then runs nothing)
    act: int
    res: Optional[TensorRef]
    out: TensorRef


@dataclass(frozen=True)
class SdpaFold:
    """Permutes ([0, 2, 1, 3]) around an sdpa that its composite kernels do through strides:
    ``src[name]`` is the [B, T, H, D] tensor a permute turned into q, k or v; ``out`` the
    [B, T, H, D] tensor the permute after the attention writes. ``skip``: those permutes'
    dispatch indices (they run nothing)."""

    src: Dict[str, TensorRef]
    out: Optional[TensorRef]
    skip: Tuple[int, ...]


def _bthd(d: Dispatch) -> bool:
    return d.op == "permute" and len(d.args) == 1 and d.args[0] is not None and len(d.args[0].shape) == 4 \
        and [int(x) % 4 for x in d.attrs.get("dims", ())] == [0, 2, 1, 3]


def sdpa_folds(pp) -> Dict[int, SdpaFold]:
    """sdpa dispatches (by index) whose q / k / v come from a [0, 2, 1, 3] permute read by
    nothing else, or whose output only a [0, 2, 1, 3] permute right after reads. A permuted
    input's source must not be written between the permute and the attention, and a folded
    output must not overlap anything the attention reads (the memory planner arranges both:
    plan.memory)."""
    ds = pp.dispatches
    producer: Dict[int, int] = {}
    readers: Dict[int, List[int]] = {}
    for k, d in enumerate(ds):
        for o in d.outputs:
            producer[o.value] = k
        for a in d.args:
            if a is not None:
                readers.setdefault(a.value, []).append(k)
    outs = {r.value for r in pp.outputs}
    found: Dict[int, SdpaFold] = {}
    for j, d in enumerate(ds):
        if d.op != "sdpa" or len(d.outputs) != 1:
            continue
        src: Dict[str, TensorRef] = {}
        skip: List[int] = []
        for name, a in zip("qkv", d.args[:3]):
            p = producer.get(a.value) if a is not None else None
            if p is None or not _bthd(ds[p]) or readers.get(a.value) != [j] or a.value in outs:
                continue
            x = ds[p].args[0]
            if x.dtype != a.dtype or any(_overlap(o.buf, x.buf) for t in range(p + 1, j) for o in ds[t].outputs):
                continue
            src[name] = x
            skip.append(p)
        out = None
        o = d.outputs[0]
        if j + 1 < len(ds) and _bthd(ds[j + 1]) and ds[j + 1].args[0].value == o.value \
                and readers.get(o.value) == [j + 1] and o.value not in outs:
            z = ds[j + 1].outputs[0]
            reads = [a for a in d.args if a is not None] + list(src.values())
            if z.dtype == o.dtype and not any(_overlap(z.buf, r.buf) for r in reads):
                out = z
                skip.append(j + 1)
        if src or out is not None:
            found[j] = SdpaFold(src, out, tuple(sorted(skip)))
    return found


def _overlap(a: BufferRef, b: BufferRef) -> bool:
    return a.space == b.space and a.index == b.index and a.offset < b.offset + b.nbytes \
        and b.offset < a.offset + a.nbytes


def epilogue_fusions(pp) -> Dict[int, Epilogue]:
    """Linear dispatches (by index in ``pp.dispatches``) whose float32 output is read only by the
    next dispatch, a gelu or an add of a same-shaped float32 tensor, and is no payload output.
    The fused kernel runs at the linear's place and writes the consumer's output, so that output
    must not overlap anything the pair reads (the planner may give it the storage of a value the
    linear reads last: then the pair stays apart)."""
    ds = pp.dispatches
    readers: Dict[int, List[int]] = {}
    for k, d in enumerate(ds):
        for a in d.args:
            if a is not None:
                readers.setdefault(a.value, []).append(k)
    outs = {r.value for r in pp.outputs}
    found: Dict[int, Epilogue] = {}
    for i in range(len(ds) - 1):
        d, c = ds[i], ds[i + 1]
        if d.op != "linear" or len(d.outputs) != 1 or len(c.outputs) != 1:
            continue
        y, z = d.outputs[0], c.outputs[0]
        if y.dtype != "float32" or z.dtype != "float32" or tuple(z.shape) != tuple(y.shape):
            continue
        if y.value in outs or readers.get(y.value) != [i + 1]:
            continue
        act, res = 0, None
        if c.op == "gelu" and len(c.args) == 1:
            act = 2 if _ops.normalize_attrs(c.op, c.attrs, c.args)["approximate"] == "tanh" else 1
        elif c.op == "add" and len(c.args) == 2 and None not in c.args:
            a0, a1 = c.args
            res = a1 if a0.value == y.value else a0
            if res.value == y.value or res.dtype != "float32" or tuple(res.shape) != tuple(y.shape):
                continue
        else:
            continue
        reads = [a for a in d.args if a is not None] + ([res] if res is not None else [])
        if any(_overlap(z.buf, a.buf) for a in reads):
            continue
        found[i] = Epilogue(i + 1, act, res, z)
    return found


def _sibling_sets(pp) -> List[List[int]]:
    """Dispatch indices of 2 or 3 float32 linears reading one input with same-shaped resident
    weights (each its own buffer) and all with or all without a resident bias, in order."""
    by_x: Dict[tuple, List[int]] = {}
    for k, d in enumerate(pp.dispatches):
        if d.op != "linear" or len(d.outputs) != 1 or len(d.args) < 2 or d.args[0] is None or d.args[1] is None:
            continue
        x, w = d.args[0], d.args[1]
        b = d.args[2] if len(d.args) > 2 else None
        if not (x.dtype == w.dtype == d.outputs[0].dtype == "float32") or (b is not None and b.dtype != "float32"):
            continue
        if any(t is not None and (t.buf.space != "resident" or t.buf.offset != 0) for t in (w, b)):
            continue
        by_x.setdefault((x.value, tuple(w.shape), b is not None), []).append(k)
    out = []
    for ks in by_x.values():
        ws = [pp.dispatches[k].args[1].buf.index for k in ks]
        if 2 <= len(ks) <= 3 and len(set(ws)) == len(ws):
            out.append(ks)
    return out


def _sibling_buffers(pp, ks) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    ds = [pp.dispatches[k] for k in ks]
    return (tuple(d.args[1].buf.index for d in ds),
            tuple(d.args[2].buf.index for d in ds if len(d.args) > 2 and d.args[2] is not None))


def sibling_groups(plan, limits: DeviceLimits) -> List[Tuple[int, ...]]:
    """Groups of resident buffers an executor may place back to back (in order, each at an
    offset_alignment multiple, nothing between) so that sibling linears, float32 linears reading
    one input, run as one batched product (select_all's ``contiguous``): their weights, and their
    biases. Identity layout only; a buffer in two different groups drops both."""
    bufs = plan.prepack.buffers
    align = max(4, limits.offset_alignment)
    groups: List[Tuple[int, ...]] = []
    for pp in plan.payloads.values():
        for ks in _sibling_sets(pp):
            for gr in _sibling_buffers(pp, ks):
                # one buffer for every bias (constants deduplicated: all zeros) needs no placing
                if len(set(gr)) == len(gr) > 1 and all(bufs[i].layout == "identity" and bufs[i].nbytes % align == 0
                                                        for i in gr):
                    groups.append(gr)
    count: Dict[int, set] = {}
    for gr in groups:
        for i in gr:
            count.setdefault(i, set()).add(gr)
    out = []
    for gr in groups:
        if all(len(count[i]) == 1 for i in gr) and gr not in out:
            out.append(gr)
    return out


def _siblings(pp, contiguous, taken) -> Dict[int, List[int]]:
    """First dispatch index -> sibling group (dispatch indices) whose weights (and biases) an
    executor placed back to back, and whose later members' outputs may be written when the first
    runs: they overlap nothing that the dispatches from the first to them read or write."""
    ds = pp.dispatches
    cont = {tuple(g) for g in contiguous}
    found: Dict[int, List[int]] = {}
    for ks in _sibling_sets(pp):
        if set(ks) & taken:
            continue
        wb, bb = _sibling_buffers(pp, ks)
        if wb not in cont or (bb and bb not in cont and len(set(bb)) != 1):
            continue
        ok = True
        for j in ks[1:]:
            o = ds[j].outputs[0]
            refs = [r for t in range(ks[0], j) for r in list(ds[t].args) + list(ds[t].outputs) if r is not None]
            if any(_overlap(o.buf, r.buf) for r in refs):
                ok = False
        if ok:
            found[ks[0]] = ks
    return found


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


def select_all(pp, limits: DeviceLimits, features=(), tuning: Optional[Tuning] = None,
               where: str = "", contiguous: Sequence[Sequence[int]] = ()) -> List[List[KernelCall]]:
    """The kernel calls of every dispatch of payload plan ``pp`` (one list per dispatch, in order),
    with the epilogues of ``epilogue_fusions`` folded into their linears' kernels where the
    float32 fast kernel runs the product (else the pair is lowered apart), the permutes of
    ``sdpa_folds`` in the attention, and sibling linears whose resident weights (and biases) the
    executor placed back to back (``contiguous``, from ``sibling_groups``) as one batched product
    at the first of them. Errors name ``{where}.ops[node]``."""
    t = tuning or Tuning()
    fz = epilogue_fusions(pp) if t.fuse else {}
    folds = sdpa_folds(pp) if t.fuse else {}
    # A permute folded into the attention after it runs nothing, so it must not be lowered
    # before we know the fold holds: lower the attentions first.
    fold_calls: Dict[int, List[KernelCall]] = {}
    skip = set()
    for j, f in folds.items():
        d = pp.dispatches[j]
        try:
            calls = _select_with(d, limits, features, t, lambda lw, attrs: _sdpa(lw, d, attrs, f))
        except PayloadError as e:
            raise type(e)(f"{where}.ops[{d.node}]{('.' + e.path) if e.path else ''}", e.detail) from None
        if calls is not None:
            fold_calls[j] = calls
            skip.update(f.skip)
    sib = _siblings(pp, contiguous, set(fz) | skip | set(fold_calls)) if t.fuse and contiguous else {}
    sib_calls: Dict[int, List[KernelCall]] = {}
    for k0, ks in sib.items():
        ds = [pp.dispatches[k] for k in ks]
        calls = _select_with(ds[0], limits, features, t, lambda lw, attrs: _lower_siblings(lw, ds),
                             f" + {len(ks) - 1} sibling linears")
        if calls is not None:
            sib_calls[k0] = calls
            skip.update(ks[1:])
    out: List[List[KernelCall]] = []
    for k, d in enumerate(pp.dispatches):
        if k in skip:
            out.append([])
            continue
        if k in fold_calls:
            out.append(fold_calls[k])
            continue
        if k in sib_calls:
            out.append(sib_calls[k])
            continue
        try:
            calls = None
            if k in fz:
                calls = _select_with(d, limits, features, t, lambda lw, attrs: _linear(lw, d, attrs, fz[k]),
                                     " + gelu" if fz[k].act else " + add", fz[k].out)
            if calls is None:
                calls = select(d, limits, features, t)
            else:
                skip.add(fz[k].consumer)
        except PayloadError as e:
            raise type(e)(f"{where}.ops[{d.node}]{('.' + e.path) if e.path else ''}", e.detail) from None
        out.append(calls)
    return out


def _select_with(d: Dispatch, limits, features, tuning: Tuning, lower, what: str = "",
                 out: Optional[TensorRef] = None) -> Optional[List[KernelCall]]:
    """``lower(lw, attrs)``'s calls for ``d``, or None when it declines (_NoFusion) or an output
    is empty."""
    if any(_numel(o.shape) == 0 for o in list(d.outputs) + ([out] if out is not None else [])):
        return None
    lw = _Lowering(d, limits, features, tuning)
    lw.label += what
    try:
        lower(lw, _ops.normalize_attrs(d.op, d.attrs, d.args))
    except _NoFusion:
        return None
    except _TooBig as e:
        raise lw.too_big(e.t, e.nbytes) from None
    return lw.calls


def pack_fp16_calls(src: BufferRef, dst: BufferRef, numel: int, limits: DeviceLimits,
                    label: str = "prepack fp16") -> List[KernelCall]:
    """The pack kernel of the ``fp16`` prepack layout: float32 ``src`` -> float16 ``dst``."""
    d = Dispatch(-1, "cast", {"dtype": "float16"}, [], [])
    lw = _Lowering(d, limits, (), Tuning())
    lw.label = label
    s = _T(src.space, src.index, src.offset, "float32", numel, f"{label} source")
    t = _T(dst.space, dst.index, dst.offset, "float16", numel, f"{label} destination")
    try:
        lw.copy_tensor(s, t, (numel,), what="pack")
    except _TooBig as e:
        raise lw.too_big(e.t, e.nbytes) from None
    return lw.calls


# ------------------------------------------------------------------------------------------ elementwise

_MAP_DIRECT = {"add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
               "logical_and", "logical_or", "logical_not", "where", "neg", "abs", "exp", "log", "sqrt",
               "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu", "silu", "erf", "reciprocal", "gelu",
               "hardtanh", "cast", "copy"}


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


def _reshape(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x, o = _T.of(d.args[0]), _T.of(d.outputs[0])
    if not x.same_place(o):  # the plan did not alias them: copy
        lw.copy_tensor(x, o, d.outputs[0].shape)


def _permute(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x, o = d.args[0], d.outputs[0]
    st = _contig(x.shape)
    lw.map("copy", _full(_T.of(o), o.shape), [_View(_T.of(x), 0, [st[i] for i in attrs["dims"]])], o.shape)


def _expand(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x, o = d.args[0], d.outputs[0]
    lw.map("copy", _full(_T.of(o), o.shape), [_View(_T.of(x), 0, _bcast(x.shape, o.shape))], o.shape)


def _slice(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    x, o = d.args[0], d.outputs[0]
    st = _contig(x.shape)
    dim = attrs["dim"]
    base = attrs["start"] * st[dim]
    st[dim] *= attrs["step"]
    lw.map("copy", _full(_T.of(o), o.shape), [_View(_T.of(x), base, st)], o.shape)


def _cat(lw: _Lowering, d: Dispatch, attrs: dict) -> None:
    o = d.outputs[0]
    dim = attrs["dim"]
    ost = _contig(o.shape)
    out = _T.of(o)
    at = 0
    for i, x in enumerate(d.args):
        lw.map("copy", _View(out, at * ost[dim], ost), [_full(_T.of(x), x.shape)], x.shape, what=f"part {i}")
        at += x.shape[dim]


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
    if mm.M == 0 or mm.N == 0:
        return
    if mm.K == 0:  # an empty contraction is all zeros (+ bias): scale a zero-sized sum... just fill
        raise DeviceError(f"{lw.label}: a matrix product over K = 0 is not supported by the WGSL kernels")
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
        if r_base % 4:
            raise _NoFusion()
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
    if mm.fused and (mm.M <= min(lw.tuning.gemv_max_m, 4) or z != 1 + len(mm.outs)):
        raise _NoFusion()
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
        # two K ranges. On an H100 that took those linears from 98 / 297 us (the picks before)
        # to 88 / 243 us (benchmarks/results/wgpu_tiles_*).
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


# ---------------------------------------------------------------- float32 vec4 fast path (mm_f32)
# matmul_fast.wgsl: the same parameters and slots as `mm`, float32 only, every operand read and C
# written as vec4s. On an H100 (Vulkan) 28.6 TFLOP/s at 4096^3 against mm's 23.5 (cuBLAS 51.4);
# benchmarks/bench_wgsl_matmul.py. Its K step: 16 for 128x128 tiles, 8 for 64x64 (measured best).
_MM_F32_BK = {(128, 8): (16, (4, 8, 16, 32)), (64, 8): (8, (4, 8, 16)),
              (64, 4): (16, (4, 8, 16, 32)), (32, 4): (16, (4, 8, 16, 32))}


def _mm_f32_ok(lw: _Lowering, mm: _MM, bases, batch_strides) -> Optional[bool]:
    """None when matmul_fast.wgsl cannot run this product, else B_KMAJOR (B read along k)."""
    if mm.a.dtype != "float32" or mm.b.dtype != "float32" or mm.c.dtype != "float32" or \
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
    entry = "mm_f32" if tm == 8 else "mm_f32_4"
    stages = lw.tuning.mm_stages
    if stages is None and tm == 8 and bm == bn == 128 and lw.tuning.mm_bk is None:
        # 128x128 tiles: two shared stages of K step 8 (one barrier per step, the same 16 KiB as
        # one stage of 16). H100: 4096^3 26.9 -> 28.9 TFLOP/s, 4096x1536x384 277 -> 220 us.
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


def _linear(lw: _Lowering, d: Dispatch, attrs: dict, epi: Optional[Epilogue] = None) -> None:
    x, w, bias = (list(d.args) + [None])[:3]
    o = epi.out if epi is not None else d.outputs[0]
    n, k = w.shape
    m = _numel(x.shape[:-1])
    _matmul_call(lw, _MM(_T.of(x), _T.of(w, f"weight (value {w.value})"), _T.of(o), m, n, k, 0, k, 1, 0, 1, k, 0, n, 1,
                         bias=_T.of(bias) if bias is not None else None, bias_mode=1,
                         act=epi.act if epi is not None else 0,
                         res=_T.of(epi.res) if epi is not None and epi.res is not None else None))


# ------------------------------------------------------------------------------------------ conv / pool

def _flat_out(lw: _Lowering, o: _T, n: int):
    """(binding, base, threads) for a kernel writing n contiguous elements of ``o``."""
    b, e = lw.bind(1, o, 0, n)
    threads = n // 2 + 1 if o.dtype == "float16" else n
    return b, e, threads


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


# ------------------------------------------------------------------------------------------ gather, rope

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


# ------------------------------------------------------------------------------------------ attention

def _sdpa(lw: _Lowering, d: Dispatch, attrs: dict, fold: Optional["SdpaFold"] = None) -> None:
    """Short query blocks (decode): split-K attention (attention.wgsl attn_split + attn_combine),
    or the one-workgroup-per-row fused kernel attn_rows where split-K does not fit the limits or
    Tuning(attn_split=False) asks for it. Otherwise scores =
    scale * q @ k^T into a float32 scratch, masked softmax into a second one, out = P @ v; blocks of
    (batch, heads, query rows) keep the scratch within one binding. Both products take 32x32 tiles
    of 4x4 per thread: their K (head dim) or N (value dim) is short, and on an H100 that ran MiniLM
    32x128's attention in 174 us against 236 us with the tiles picked by count
    (benchmarks/bench_wgpu_attention.py).

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
    uni = _u32(Tq, H, H // Hk, Tk, D, Dv, 0, 0, qe, *qs, ke, *ks, ve // 4, *(x // 4 for x in vs), oe, *os_,
               me, *mst) + struct.pack("<ifI", attrs["causal_offset"], attrs["scale"], 0)
    consts = {"DTM": mt.code if mt else 0, "MASK": (1 if mt.dtype == "bool" else 2) if mt else 0,
              "CAUSAL": bool(attrs["causal"]), "CGS": 8 if Dv <= 32 else 16}
    lw.emit("attn_tile", consts, uni, [ob, qb, kb, vb, mb], (-(-Tq // ATTN_TILE_ROWS), H, B), "one-pass tile")
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


_LOWER: Dict[str, Callable[[_Lowering, Dispatch, dict], None]] = {}
for _name in _MAP_DIRECT:
    _LOWER[_name] = _elementwise
_LOWER.update({
    "reshape": _reshape, "permute": _permute, "expand": _expand, "slice": _slice, "cat": _cat, "pad": _pad,
    "kv_update": _kv_update, "matmul": _matmul, "linear": _linear, "conv2d": _conv2d, "max_pool2d": _pool,
    "avg_pool2d": _pool, "batch_norm": _batch_norm, "layer_norm": _norm_rows, "rms_norm": _norm_rows,
    "softmax": _softmax, "log_softmax": _softmax, "sum": _reduce, "mean": _reduce, "amax": _reduce,
    "argmax": _reduce, "embedding": _embedding, "rope": _rope, "sdpa": _sdpa,
})

SUPPORTED_OPS = tuple(sorted(_LOWER))
