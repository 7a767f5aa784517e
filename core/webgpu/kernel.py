"""The vocabulary of the WGSL lowering and its shared machinery (pure Python).

:class:`KernelCall` (one compute dispatch: shader entry point, constants, uniform bytes, storage
bindings, workgroups), :class:`Binding`, :class:`Tuning`, the entry points' declarations
(``ENTRIES``), the device-memory view of a tensor (``_T``, ``_View``), the per-dispatch collector
``_Lowering`` (bindings, splitting for the binding limit, the strided ``map`` kernel) and the op
registry: each op family module (``ops_*``) registers its lowering functions with
:func:`lowers`. The conventions every executor follows are in :mod:`.lowering`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from .. import dtypes as _dt
from ..errors import DeviceError
from ..plan.types import BufferRef, DeviceLimits, Dispatch, TensorRef

DT_CODE = {"float32": 0, "float16": 1, "int32": 2, "bool": 3}
WG = 256  # threads per workgroup of the 1-D (map-like) kernels
MAX_GROUPS = 65535  # maxComputeWorkgroupsPerDimension (WebGPU default)
MAX_RANK = 8  # dims of a map view after merging
MAX_CALLS = 4096  # splitting that would need more calls than this is refused
DUMMY = BufferRef("dummy", 0, 0, 16)  # placeholder: emit() gives each slot its own range
# The names devices give the feature of WGSL's subgroup built-ins: "subgroups" is WebGPU's (Dawn,
# browsers), "subgroup" wgpu-native's (whose WGSL front end also takes no `enable subgroups;`).
SUBGROUP_FEATURES = frozenset({"subgroups", "subgroup"})
MAX_SLOT = 8  # highest storage binding slot any entry point uses (8 storage buffers: WebGPU's default limit)


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
    "mm_f32": EntrySpec("matmul_fast.wgsl", (1, 2, 3, 4, 5, 6, 7, 8),
                        ("BIAS", "B_KMAJOR", "WX", "WY", "BK", "TM", "KSPLIT", "STAGES", "ACT", "RES", "NC", "B_F16")),
    "mm_f32_4": EntrySpec("matmul_fast.wgsl", (1, 2, 3, 4, 5, 6, 7, 8),
                          ("BIAS", "B_KMAJOR", "WX", "WY", "BK", "TM", "KSPLIT", "STAGES", "ACT", "RES", "NC",
                           "B_F16")),  # STAGES: 1
    "mm_f32_sum": EntrySpec("matmul_fast.wgsl", (1, 2, 5, 6, 7), ("KSPLIT", "ACT", "RES", "NC")),
    "gemv_k": EntrySpec("matmul.wgsl", (1, 2, 3, 4), ("DT_OUT", "DTA", "DTB", "DTBIAS", "BIAS", "GM")),
    "gemv_n": EntrySpec("matmul.wgsl", (1, 2, 3, 4), ("DT_OUT", "DTA", "DTB", "DTBIAS", "BIAS", "GM")),
    "gemv": EntrySpec("gemv.wgsl", (1, 2, 3, 4, 5, 6, 7),
                      ("DT_OUT", "DTB", "DTBIAS", "BIAS", "GM", "LANES", "WGS", "ACT", "RES", "NC")),
    "gemv_any": EntrySpec("gemv_any.wgsl", (1, 2, 3, 4, 5, 6, 7),
                          ("DT_OUT", "DTA", "DTB", "DTBIAS", "BIAS", "GM", "LANES", "WGS", "ACT", "RES", "NC")),
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
    "attn_flash": EntrySpec("attention_flash.wgsl", (1, 2, 3, 4, 5), ("CK", "RWG", "DTM", "MASK", "CAUSAL")),
    "attn_flash_combine": EntrySpec("attention_flash.wgsl", (1, 6), ()),
    # packed GGUF weights (ops_quant.py)
    "qgemv": EntrySpec("quant_mm.wgsl", (1, 2, 3, 4, 5, 6, 7),
                       ("QT", "TPR", "TP2", "ROWS", "GM", "BIAS", "ACT", "RES", "NC", "CAT", "NORM", "HS", "UPL",
                        "RPT")),
    "qmm": EntrySpec("quant_mm.wgsl", (1, 2, 3, 4, 5, 6, 7),
                     ("QT", "WX", "WY", "KSPLIT", "BIAS", "ACT", "RES", "NC", "CAT")),
    "qmm_sum": EntrySpec("quant_mm.wgsl", (1, 2, 4, 5, 6, 7), ("KSPLIT", "BIAS", "ACT", "RES", "NC")),
    "qembed": EntrySpec("quant_embed.wgsl", (1, 2, 3), ("QT",)),
}


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
    gemv_max_m: int = 8  # M at or below this uses the gemv kernels (gemv/gemv_any up to 8; gemv_k/gemv_n up to 4)
    gemv_old: bool = False  # the older gemv_k/gemv_n (M <= 4, no epilogues) instead of gemv/gemv_any (A/B runs)
    gemv_lanes: Optional[int] = None  # gemv threads per output column (32..256); None: one loop trip per thread
    gemv_cols: Optional[int] = None  # gemv output columns per workgroup; None: most that keep gemv_min_groups
    gemv_min_groups: int = 264  # ... workgroups (2 per multiprocessor of an H100)
    attn_fused_max_tq: int = 16  # sdpa with at most this many query rows runs as one fused kernel
    attn_flash: bool = True  # ... as flash-decoding (attn_flash + attn_flash_combine) where its layout fits
    attn_split: bool = True  # ... else split-K (attn_split + attn_combine); False: attn_rows
    attn_split_min_groups: int = 128  # 64-key chunks when they give this many workgroups, else 32 (attn_flash: 32, 16)
    attn_flash_keys: Optional[int] = None  # keys per attn_flash workgroup (16 or 32); None: by attn_split_min_groups
    attn_flash_rows: int = 1  # query rows of a kv head per attn_flash workgroup (1..4): one row a workgroup spreads
    # a decode step's few rows over more workgroups, each thread's work one row's (docs/NOTES.md: 1 beat 2 and 4)
    attn_tile: bool = True  # longer float32 query blocks over <= 128 keys: one-pass attn_tile (False: composite)
    attn_sgmat: bool = True  # ... under precision="fast" on subgroup matrices where ops_attention allows (False: attn_tile)
    attn_sgmat_min_groups: int = 48  # ... where that gives this many workgroups (docs/NOTES.md: 12 ran slower)
    mm_fast: bool = True  # float32 products with vec4-aligned rows use matmul_fast.wgsl (False: never)
    mm_tm: Optional[int] = None  # outputs per thread along m and n (8 or 4); None: by the tile choice
    mm_ksplit: Optional[int] = None  # split-K ways of mm_f32_4, or of mm_f32 when given (1 = none); None: by the rule below
    mm_tile_n: Optional[int] = None  # mm_f32 (8x8 per thread): the tile's N edge when not mm_tile (128x64, 64x128)
    mm_stages: Optional[int] = None  # mm_f32: 2 = double-buffered shared tiles (one barrier per K step)
    fuse: bool = True  # select_all: epilogues in linear kernels, head permutes folded into attention
    ksplit_below_groups: int = 256  # split K (mm_f32_4) only products with fewer workgroups than this ...
    ksplit_target_groups: int = 1024  # ... into up to 8 ranges of >= 64 of K until there are this many
    qgemv_max_m: int = 8  # packed-weight linears: M at or below this use qgemv (<= 8), above it qmm
    qgemv_subgroups: bool = True  # qgemv* reduce by subgroup sums where the device has them (False: trees)
    qgemv_sg_lanes: Optional[int] = None  # ... with this many lanes per weight row (a power of two, 4..128; forces
    # the subgroup kernels on any device with the feature, e.g. a test's); None: the device's subgroup size
    qgemv_sg_rows: int = 4  # ... and weight rows per workgroup (gate / up pairs: rounded up to even); 4 was the
    # fastest on the H100 (docs/NOTES.md)
    qgemv_rope: bool = True  # a packed q/k/v product with a norm prologue also rotates and writes the caches
    # (qgemv_rope: one dispatch for the attention's front); False: qgemv_cat_norm + rope_kv
    attn_in_product: bool = True  # the planner's sdpa_linear: a packed decode product merges the flash-decoding
    # partials in its prologue (qgemv_attn: no attn_flash_combine dispatch); False: combine, then the product
    attn_product_rows: Optional[int] = 8  # qgemv_attn's weight rows per workgroup on the subgroup kernels (each
    # workgroup merges all the partials: more rows, fewer merges; 8 beat 4 on an H100); None: qgemv_sg_rows
    qgemv_pair_min_groups: Optional[int] = 1024  # a plain packed decode product (subgroup kernels, <= 4 rows of x,
    # one loop trip a weight row) gives each thread row two weight rows where that still leaves this many
    # workgroups (the LM head: faster on an H100, docs/NOTES.md); None: never
    sgmat: bool = True  # products may run on subgroup-matrix units where ops_sgmat allows (False: never)
    sgmat_entry: Optional[str] = None  # one of ops_sgmat.ENTRY_POINTS (the generated tile shapes); None: by operand dtype and size
    sgmat_stages: Optional[int] = None  # 2 = double-buffered tiles (one barrier per K step), 1; None: the entry's default
    sgmat_min_groups: int = 96  # ... only products whose 128x128 tiles give this many workgroups (docs/NOTES.md)


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
        if _dt.is_packed(self.dtype):  # blocks, not elements: only ops_quant binds them, by bytes
            raise DeviceError(f"{self.name} is packed {self.dtype}: it has no element size "
                              f"(a packed weight is read by ops_quant's kernels alone)")
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

    def __init__(self, d: Dispatch, limits: DeviceLimits, features, tuning: Tuning, precision: str = "exact",
                 configs: Sequence[dict] = (), subgroup_size: int = 0):
        self.d = d
        self.limits = limits
        self.features = frozenset(features or ())
        self.tuning = tuning
        self.precision = precision  # session.PRECISIONS: "fast" lets products round inputs to float16
        self.configs = tuple(configs)  # the device's subgroup-matrix configs (GPUDevice.subgroup_matrix_configs)
        self.subgroup_size = int(subgroup_size)  # invocations per subgroup (GPUDevice.subgroup_size()); 0: none
        self.calls: List[KernelCall] = []
        self.nscratch = 0
        self.label = f"node {d.node} {d.op}"

    @property
    def subgroups(self) -> bool:
        """The device has subgroup operations: WebGPU's ``subgroups`` (Dawn, browsers) or
        wgpu-native's ``subgroup`` (its name for the same feature)."""
        return bool(self.features & SUBGROUP_FEATURES)

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
             workgroups: Tuple[int, int, int], what: str = "", shader: Optional[str] = None) -> None:
        """Append one kernel call. ``shader``: another module that defines ``entry`` with the
        same bindings and overrides (quant_mm_sg.wgsl's subgroup reductions); default the entry's."""
        spec = ENTRIES[entry]
        if len(self.calls) >= MAX_CALLS:
            raise DeviceError(f"{self.label}: splitting for the binding limit needs more than {MAX_CALLS} kernel calls")
        assert set(constants) <= set(spec.overrides), (entry, set(constants) - set(spec.overrides))
        assert sorted(b.binding for b in bindings) == list(spec.slots), (entry, bindings)
        if workgroups[1] > MAX_GROUPS or workgroups[2] > MAX_GROUPS:
            raise DeviceError(f"{self.label}: {workgroups} workgroups exceed {MAX_GROUPS} per dimension")
        bindings = self._distinct(sorted(bindings, key=lambda b: b.binding), entry)
        self.calls.append(KernelCall(shader or spec.shader, entry, dict(constants), uniform, bindings,
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


def _flat_out(lw: _Lowering, o: _T, n: int):
    """(binding, base, threads) for a kernel writing n contiguous elements of ``o``."""
    b, e = lw.bind(1, o, 0, n)
    threads = n // 2 + 1 if o.dtype == "float16" else n
    return b, e, threads


# ------------------------------------------------------------------------------------------ registry

Lower = Callable[[_Lowering, Dispatch, dict], None]

# op name -> its lowering function ``fn(lw, d, attrs)``, filled by the ops_* modules (lowering.py
# imports them all). PACKED_LOWERINGS: the lowering of an op whose weight argument is packed
# (dtypes.QUANT_BLOCKS; ops.PACKED_WEIGHT_ARGS says which ops take one), from ops_quant.py.
LOWERINGS: Dict[str, Lower] = {}
PACKED_LOWERINGS: Dict[str, Lower] = {}


def lowers(*ops: str, packed: bool = False) -> Callable[[Lower], Lower]:
    """Register the decorated function as the lowering of ``ops`` (each op has exactly one, and
    one more for packed weights when ``packed``)."""
    table = PACKED_LOWERINGS if packed else LOWERINGS

    def register(fn: Lower) -> Lower:
        for op in ops:
            if op in table:
                raise ValueError(f"op {op!r} is lowered twice: {table[op].__name__} and {fn.__name__}")
            table[op] = fn
        return fn
    return register


def lowering_of(d: Dispatch) -> Optional[Lower]:
    """The lowering function of dispatch ``d``: the packed-weight one when an argument is packed."""
    if any(a is not None and _dt.is_packed(a.dtype) for a in d.args):
        return PACKED_LOWERINGS.get(d.op)
    return LOWERINGS.get(d.op)
