"""CUDA kernels on packed GGUF block weights (q4_0, q4_1, q8_0: ``gpudelegate.dtypes.QUANT_BLOCKS``),
bound once per dispatch like the rest of :mod:`.cuda_kernels` and replayed every run.

- **linear over at most** :data:`GEMV_MAX_ROWS` **rows** (decode): ``qgemv`` of
  ``shaders/cuda_quant.cu`` reads the raw blocks. One warp computes up to 4 consecutive output
  rows (blocks of 4 warps, as many as the rows need: the hardware balances small blocks over the
  SMs better than a resident grid looping over rows, which ran SmolLM2's LM head in 23.2 us
  against 20.6 on an H100, its warps taking 5 or 6 row groups each):
  it stages chunks of the rows' bytes into shared memory with coalesced 16-byte loads (q4_0 and
  q8_0 blocks are only 2-byte aligned, so nothing wider could read them in place), issuing a long
  row's next chunk's loads before decoding the current one; each lane then decodes 8-value items
  of every staged row (16-bit shared-memory reads), loads each item's activations once for all
  the warp's rows and all x rows, and accumulates in float32 (q4_0 / q8_0: q * x summed over the
  item, times d once); a warp-shuffle reduction ends the rows, bias added by the writing lane. The
  weight is read once for all (up to 8) x rows.
- **q4_1 without the stage** (``qgemv41``, the default for q4_1 weights whose start is 4-byte
  aligned): q4_1's 20-byte blocks are 4-byte aligned, so each lane loads the d|m word and the
  nibble word of its item straight from global memory, :data:`DIRECT_STEPS` groups of 8 blocks
  a trip, the next trip's loads issued before this one is decoded (no shared memory, no warp
  barrier); a weight of few long rows splits each row over 2 warps (:data:`DIRECT_WARPS_PER_SM`);
  the same activations and epilogues as qgemv.
- **gate/up with silu * mul** (the planner's concatenated gate/up group, at most 8 rows):
  ``gemv_silu`` runs qgemv with EPI 1, each warp a gate row and its up row, writing
  silu(gate) * up: the MLP front in one launch.
- **with the rms-norm prologue** (:mod:`.cuda_norm_prologue`, the planner's ``Fusion.norm``):
  ``gemv_norm`` and ``gemv_silu(norm=...)`` run ``qgemv_norm``, the same body computing its
  activations h = rms_norm(x + y) * w instead of reading them (and writing x + y).
- **q/k/v with their rotations and cache writes** (the planner's rope_kv group over a concatenated
  q/k/v product, at most 8 rows): ``gemv_rope`` runs qgemv / qgemv41 with EPI 2, each warp the two
  rows of a head that one rotation pairs, the lane ending an output rotating it and writing it
  into q or the caches (:class:`RopeOut`), with or without the norm prologue: no rope_kv launch,
  no scratch for the product.
- **the o projection on a split-key attention's partials** (the planner's sdpa_linear group, where
  ``attn_in_product`` is set): ``gemv_attn`` runs qgemv / qgemv41 with the partials' merge as its
  prologue (``AttnSrc``: every block merges them into shared memory, as sdpa_combine would into
  the attention output), so sdpa_combine has no launch of its own.
- **linear over more rows** (prefill): ``qrows`` dequantizes the whole weight into scratch in the
  activations' dtype (float32 stays exact: every dequantized value is a float32), then the cuBLAS
  GEMM of :mod:`.cuda_blas` runs on it. The scratch is the plan's (``gpudelegate.plan.layout``
  puts it at the end of the arena, sized by :func:`gpudelegate.plan.layout.dequant_scratch_bytes`).
- **embedding**: ``qrows`` gathers and dequantizes only the rows the ids name.

Nothing here allocates or synchronizes when a bound closure runs, so runs can be captured into
CUDA graphs. Kernels are compiled on first use, one instantiation at a time (a session needs a few
of the variants).

CuPy is imported by the callers (:mod:`.cuda_kernels`); this module imports no device library at
import time, so CPU-only test collection can import it (:func:`gemv_launch` is pure arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from gpudelegate import dtypes as _dt
from gpudelegate.errors import PlanError, UnsupportedOpError
from gpudelegate.plan.layout import GEMV_MAX_ROWS

from .cuda_norm_prologue import NormPrologue, kernel_source, overlaps
from .cuda_qgemv_fast import FastQ41

QTYPE = {"q4_0": 0, "q4_1": 1, "q8_0": 2}
"""Template index of each packed dtype in cuda_quant.cu."""

QV_WARPS = 4
"""Warps of one qgemv block (QV_WARPS of cuda_quant.cu)."""

QV_WORDS = 4
"""16-byte words each lane stages per chunk by default (qgemv's U): a warp stages 32 * 4 * 16 =
2 KiB of weight bytes at a time; 8 doubles it (and the block's shared memory, 16 KiB)."""

QROWS_BLOCK = 256

DIRECT_STEPS = 4
"""Groups of 8 q4_1 blocks each lane of ``qgemv41`` loads per trip (its S): 2 words per row per
group in flight, twice that with the next trip's."""

DIRECT_WARPS_PER_SM = 64
"""qgemv41 splits each row over 2 or 4 warps (KS) while that keeps the grid at most this many warps
per SM and gives each warp at least 2 groups of 8 blocks: weights of few long rows (an 8B model's
down projection: 4096 rows of 14336 values, 31 warps an SM with one a row) stream with more warps
in flight, while a row of 3 groups (SmolLM2's 576 values) would lose more to the block barrier
than it gains (benchmarks/bench_decode.py's gemv variants)."""

BLOCK_SMEM = 48 * 1024
"""Shared memory a block gets without opting in: ``gemv_attn``'s merge (dynamic) and the kernel's
own (static: qgemv's stage, qgemv41's split sums) must fit; larger merges run as sdpa_combine and
the product."""

__all__ = ["PackedView", "QuantKernels", "GemvLaunch", "gemv_launch", "GEMV_MAX_ROWS", "QTYPE", "RopeOut",
           "attn_smem_bytes"]


class PackedView:
    """A packed weight on the device: its dtype, logical shape ``[..., K]`` and a CuPy uint8 view
    of its bytes (the counterpart of :class:`gpudelegate.native.quant.PackedWeight` on the host).
    Only the kernels of this module read one."""

    __slots__ = ("dtype", "shape", "raw")

    def __init__(self, dtype: str, shape: Tuple[int, ...], raw):
        if not _dt.is_packed(dtype):
            raise TypeError(f"PackedView of {dtype}: not a packed dtype")
        self.dtype, self.shape, self.raw = dtype, tuple(int(d) for d in shape), raw

    @property
    def ptr(self) -> int:
        return self.raw.data.ptr

    @property
    def nbytes(self) -> int:
        return _dt.nbytes(self.dtype, self.shape)

    @property
    def rows(self) -> int:
        return _dt.numel(self.shape[:-1])

    @property
    def row_bytes(self) -> int:
        return _dt.packed_row_bytes(self.dtype, self.shape[-1])

    def __repr__(self) -> str:
        return f"PackedView({self.dtype}{list(self.shape)} at 0x{self.ptr:x})"


@dataclass(frozen=True)
class GemvLaunch:
    """How one qgemv dispatch runs (template arguments and grid)."""

    rows_per_warp: int  # R: output rows one warp computes
    mm: int  # MM: x rows the kernel is compiled for (M <= MM; 1, 2, 4 or 8)
    words: int  # U: 16-byte words each lane stages per chunk
    grid: int  # blocks of QV_WARPS warps
    chunk_blocks: int  # KC: blocks of each row staged at a time
    chunks: int  # stage passes per row (1 when whole rows fit); qgemv41: trips per row
    direct: bool = False  # qgemv41 (q4_1 read straight from global memory) instead of the staged qgemv
    steps: int = 0  # qgemv41's S: groups of 8 blocks a lane loads per trip
    split_k: int = 1  # qgemv41's KS: warps sharing a row group (each a share of its blocks)


def chunk_blocks(qtype: str, rows_per_warp: int, words: int = QV_WORDS) -> int:
    """Blocks of each row one stage pass holds (KC of cuda_quant.cu)."""
    sw = 32 * words // rows_per_warp
    return (sw * 16 - 30) // _dt.QUANT_BLOCKS[qtype][1]


def _forced_rows(rows_per_warp: Optional[int], m: int, mm: int) -> Optional[int]:
    """A forced R checked against the kernel's limits (1, 2 or 4 rows; R * MM <= 32 outputs a
    warp), or None where none was forced."""
    if rows_per_warp is not None and (rows_per_warp not in (1, 2, 4) or rows_per_warp * mm > 32):
        raise ValueError(f"rows_per_warp {rows_per_warp} with {m} x rows (1, 2 or 4; at most 32 outputs a warp)")
    return rows_per_warp


def gemv_launch(qtype: str, n: int, k: int, m: int, sm_count: int, rows_per_warp: Optional[int] = None,
                words: Optional[int] = None, direct: Optional[bool] = None, steps: Optional[int] = None,
                split_k: Optional[int] = None) -> GemvLaunch:
    """Template arguments and grid of ``qgemv`` for an [m, k] x [n, k]^T product (m <= 8).

    Rows per warp R: sharing each item's activations over R rows cuts the activation loads R-fold,
    but a warp's rows are one latency chain, so R shrinks while the grid would give fewer than 8
    warps per SM (the 576- and 1536-row projections of SmolLM2 run one row per warp, its
    49152-row LM head 2 in q8_0 and 4 in q4_1), and whole rows must fit one stage pass (no second
    pass over a row). R * MM stays <= 16 to bound the accumulator registers. ``rows_per_warp``
    forces R (1, 2 or 4; R * MM <= 32 is the kernel's own limit) and ``words`` the staged words
    per lane (4 or 8, default QV_WORDS): for tests and comparisons.

    ``direct``: q4_1 through ``qgemv41`` (None: for every q4_1 weight; the caller checks its
    4-byte alignment), ``steps`` its S (1, 2, 4 or 8; default DIRECT_STEPS), ``split_k`` its KS
    (1, 2 or 4 warps a row group). Without a stage there is no row length to fit; one row per
    warp unless forced (2 rows a warp were no faster at an 8B model's MLP shapes, 4 slower), and
    KS per DIRECT_WARPS_PER_SM."""
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"qgemv takes 1..{GEMV_MAX_ROWS} rows, not {m}")
    mm = 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8
    kb = k // 32
    if direct is None:
        direct = qtype == "q4_1"
    if direct:
        if qtype != "q4_1":
            raise ValueError(f"qgemv41 reads q4_1 blocks, not {qtype}")
        s = DIRECT_STEPS if steps is None else steps
        if s not in (1, 2, 4, 8):
            raise ValueError(f"steps {s}: 1, 2, 4 or 8 groups of 8 blocks a trip")
        r = _forced_rows(rows_per_warp, m, mm) or 1
        groups = -(-n // r)
        if split_k is None:
            ks = 1
            for cand in (4, 2):
                if groups * cand <= DIRECT_WARPS_PER_SM * sm_count and kb >= 16 * cand:
                    ks = cand
                    break
        elif split_k in (1, 2, 4):
            ks = split_k
        else:
            raise ValueError(f"split_k {split_k}: 1, 2 or 4 warps a row group")
        row_groups8 = -(-kb // 8)  # groups of 8 blocks in a row
        return GemvLaunch(rows_per_warp=r, mm=mm, words=0, grid=-(-groups // (QV_WARPS // ks)), chunk_blocks=0,
                          chunks=-(-row_groups8 // (ks * s)), direct=True, steps=s, split_k=ks)
    u = QV_WORDS if words is None else words
    if u not in (4, 8):
        raise ValueError(f"words {u}: 4 or 8 16-byte words a lane")
    r = _forced_rows(rows_per_warp, m, mm) or 1
    if rows_per_warp is None:
        for cand in (4, 2):
            if cand * mm > 16 or chunk_blocks(qtype, cand, u) < kb:
                continue
            if -(-n // cand) >= 8 * sm_count:
                r = cand
                break
    kc = chunk_blocks(qtype, r, u)
    warps = -(-n // r)
    return GemvLaunch(rows_per_warp=r, mm=mm, words=u, grid=-(-warps // QV_WARPS), chunk_blocks=kc,
                      chunks=-(-kb // kc) if kb else 0)


@dataclass(frozen=True)
class RopeOut:
    """Where ``gemv_rope`` puts a q/k/v product (cuda_quant.cu RopeSink): part j of the weight (in
    weight order) is ``heads[j]`` heads of ``D`` rows, stored into ``dsts[j]`` (a device view): a
    contiguous [B, H_j, T, D] tensor, or where ``cache[j]`` rows pos[0] + t of a [B, H_j, S, D]
    cache; rotated with ``cos`` / ``sin`` ([T, D]) where ``rope[j]``. x row m is (b, t) =
    (m // T, m % T)."""

    dsts: Tuple[object, ...]
    heads: Tuple[int, ...]
    cache: Tuple[bool, ...]
    rope: Tuple[bool, ...]
    cos: Optional[object]
    sin: Optional[object]
    pos: Optional[object]
    T: int
    D: int
    S: int

    def table_ctype(self) -> str:
        """C storage type of the rope tables (float where there are none: never read)."""
        return _ctype(self.cos.dtype) if self.cos is not None else "float"

    def kernel_args(self) -> tuple:
        """ROPE_PARAMS of cuda_quant.cu: dst0..2, hmr0..2 (H | mode << 24 | rope << 25), cs, sn, pos,
        Tn, D, S."""
        n = len(self.dsts)
        dst = [np.uint64(self.dsts[j].data.ptr) if j < n else np.uint64(0) for j in range(3)]
        hmr = [np.int32(self.heads[j] | (int(self.cache[j]) << 24) | (int(self.rope[j]) << 25)) if j < n
               else np.int32(0) for j in range(3)]
        nul = np.uint64(0)
        return tuple(dst) + tuple(hmr) + (nul if self.cos is None else self.cos, nul if self.sin is None else self.sin,
                                          nul if self.pos is None else self.pos, np.int32(self.T), np.int32(self.D),
                                          np.int32(self.S))


def attn_smem_bytes(m: int, k: int, rows: int, splits: int) -> int:
    """Dynamic shared memory of qgemv_attn / qgemv41_attn (cuda_quant.cu AttnSrc): x [m, k], the
    splits' weights [rows, splits] and each row's sum."""
    return 4 * (m * k + rows * splits + rows)


def _ctype(dtype) -> str:
    if dtype == np.float32:
        return "float"
    if dtype == np.float16:
        return "half_t"
    raise TypeError(dtype)


class QuantKernels:
    """The packed-weight kernels of one device (shared by every executor of a CudaContext, through
    :class:`.cuda_kernels.CudaKernels`)."""

    def __init__(self, cp, sm_count: Callable[[], int], blas: Callable[[], object],
                 wrap: Callable[[object], object] = lambda f: f, prelude: str = ""):
        self.cp = cp
        self._wrap = wrap  # how a compiled kernel is launched (CudaKernels: PDL inside graph captures)
        self._prelude = prelude  # what the kernels' source begins with (cuda_pdl: the timeline switch)
        self._sm_count = sm_count
        self._blas = blas
        self._funcs: Dict[str, object] = {}
        # qgemv rows per warp and staged words per lane: None = gemv_launch's pick, else forced
        # (tests and comparisons; set before a session binds its kernels)
        self.gemv_rows_per_warp: Optional[int] = None
        self.gemv_words: Optional[int] = None
        # q4_1 through qgemv41 (None: wherever the weight is 4-byte aligned; False: the staged
        # qgemv), its trips' groups of blocks S (None: DIRECT_STEPS), its sum (see q41_body: 0
        # dequantizes each value, 1 sums q * x and x) and its warps a row KS (None: gemv_launch's
        # pick): tests and comparisons
        self.gemv_direct: Optional[bool] = None
        self.gemv_steps: Optional[int] = None
        self.gemv_split: int = 0
        self.gemv_split_k: Optional[int] = None
        # the rope_kv and sdpa_linear groups inside the products (gemv_rope, gemv_attn; False: those
        # return None and the groups run as before). The attention merge in the o product is off:
        # within a captured decode step it ran slower than sdpa_combine's launch and the plain
        # product it replaces (docs/NOTES.md); True takes it (tests, comparisons)
        self.rope_in_product = True
        self.attn_in_product = False
        # large plain q4_1 linears through qgemv41x (cuda_qgemv_fast.py); its knobs
        self.fast = FastQ41(cp, wrap, prelude)

    def func(self, expr: str):
        """One instantiation of cuda_quant.cu, compiled alone on first use."""
        f = self._funcs.get(expr)
        if f is None:
            # qgemv's activation sources live in the prologue's file
            code = kernel_source("cuda_quant.cu", self._prelude)
            f = self._wrap(self.cp.RawModule(code=code, name_expressions=[expr]).get_function(expr))
            self._funcs[expr] = f
        return f

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _check(w: PackedView, where: str) -> None:
        # 16-bit reads of every block: the base must be 2-byte aligned (resident buffers and slots
        # are 16-byte aligned, rows are whole blocks).
        if w.ptr % 2:
            raise UnsupportedOpError(where, f"packed weight {w!r} is not 2-byte aligned")

    def _rows_call(self, w: PackedView, ids, out, rows: int, ldo: int) -> Callable[[], None]:
        """Launch closure of qrows: out rows = dequantized W rows (ids) or all of W (ids None)."""
        K = w.shape[-1]
        f = self.func(f"qrows<{QTYPE[w.dtype]},{_ctype(out.dtype)}>")
        items = rows * (K // 8)
        if items == 0:
            return lambda: None
        grid = (-(-items // QROWS_BLOCK),)
        V = w.rows
        a = (w.raw, ids if ids is not None else np.uint64(0), out, np.int64(rows), np.int32(max(V, 1)), np.int32(K),
             np.int64(ldo))
        return lambda: f(grid, (QROWS_BLOCK,), a)

    # ------------------------------------------------------------------ ops
    def embedding(self, w: PackedView, ids, out, where: str) -> Callable[[], None]:
        """out[..., :] = dequantized rows ``ids`` of the [V, D] table ``w`` (out: float32 or float16)."""
        self._check(w, where)
        if len(w.shape) != 2:
            raise UnsupportedOpError(where, f"packed embedding table of rank {len(w.shape)}")
        V, D = w.shape
        n = int(ids.size)
        if n == 0 or D == 0:
            return lambda: None
        if V == 0:
            return lambda: out.fill(0)  # nothing to gather (the session rejects any id first)
        ids32 = ids.reshape(-1)
        o2 = out.reshape(n, D)
        if ids32.dtype != np.int32 or not (ids32.flags.c_contiguous and o2.flags.c_contiguous):
            raise UnsupportedOpError(where, f"packed embedding with {ids32.dtype} ids or a non-contiguous output")
        return self._rows_call(w, ids32, o2, n, D)

    def _launch(self, w: PackedView, n: int, k: int, m: int, rows_per_warp: Optional[int] = None) -> GemvLaunch:
        """gemv_launch with this object's knobs; qgemv41 only for a 4-byte aligned q4_1 weight."""
        direct = self.gemv_direct
        if w.dtype != "q4_1" or w.ptr % 4:
            direct = False
        elif direct is None and self.gemv_words is not None:
            direct = False  # staged words were asked for
        return gemv_launch(w.dtype, n, k, m, self._sm_count(), self.gemv_rows_per_warp if rows_per_warp is None
                           else rows_per_warp, self.gemv_words, direct=direct, steps=self.gemv_steps,
                           split_k=self.gemv_split_k)

    def _gemv_func(self, lp: GemvLaunch, qtype: str, ctype: str, epi: int, norm_wtype: Optional[str] = None):
        """The compiled qgemv / qgemv41 (norm_wtype: the _norm variant with that weight type)."""
        if lp.direct:
            if norm_wtype is None:
                return self.func(f"qgemv41<{ctype},{lp.rows_per_warp},{lp.mm},{lp.steps},{lp.split_k},{epi},"
                                 f"{self.gemv_split}>")
            return self.func(f"qgemv41_norm<{ctype},{norm_wtype},{lp.rows_per_warp},{lp.mm},{lp.steps},{lp.split_k},"
                             f"{epi},{self.gemv_split}>")
        if norm_wtype is None:
            return self.func(f"qgemv<{QTYPE[qtype]},{ctype},{lp.rows_per_warp},{lp.mm},{lp.words},{epi}>")
        return self.func(f"qgemv_norm<{QTYPE[qtype]},{ctype},{norm_wtype},{lp.rows_per_warp},{lp.mm},{lp.words},{epi}>")

    def dequantize(self, w: PackedView, out) -> Callable[[], None]:
        """out [N, K] (contiguous float32 / float16) = the dequantized [N, K] weight."""
        return self._rows_call(w, None, out, w.rows, w.shape[-1])

    def linear(self, x, w: PackedView, bias, out, scratch: Optional[tuple], where: str) -> Callable[[], None]:
        """out = x @ dequant(w).T (+ bias). ``x`` [..., K] float32/float16, ``out`` [..., N] of x's
        dtype. ``scratch``: (cupy memory pointer or None, bytes) of the plan's dequantization
        scratch, used when x has more than GEMV_MAX_ROWS rows; None (a caller without a plan)
        makes one now."""
        cp = self.cp
        self._check(w, where)
        if len(w.shape) != 2:
            raise UnsupportedOpError(where, f"packed linear weight of rank {len(w.shape)}")
        N, K = w.shape
        M = int(np.prod(x.shape[:-1], dtype=np.int64))
        if x.dtype.kind != "f" or x.dtype != out.dtype:
            raise UnsupportedOpError(where, f"packed linear on {x.dtype} into {out.dtype} (float32/float16, one dtype)")
        x2 = x.reshape(M, K)
        o2 = out.reshape(M, N)
        if M == 0 or N == 0:
            return lambda: None
        if K == 0:  # an empty contraction: zeros (+ bias)
            if bias is None:
                return lambda: o2.fill(0)

            def run_bias():
                o2.fill(0)
                cp.add(o2, bias, out=o2, casting="unsafe")
            return run_bias
        if M <= GEMV_MAX_ROWS:
            return self._gemv(x2, w, bias, o2, where)
        need = N * K * x.dtype.itemsize
        if scratch is None:
            dst = cp.empty((N, K), x.dtype)  # made once, at bind time (outside any capture)
        else:
            mem, have = scratch
            if mem is None or have < need:
                raise PlanError(f"plan: {where}: dequantizing {w!r} for {M} rows needs {need} bytes of scratch, the "
                                f"layout has {have} (gpudelegate.plan.layout.dequant_scratch_bytes)")
            dst = cp.ndarray((N, K), dtype=x.dtype, memptr=mem)
        deq = self.dequantize(w, dst)
        mm = self._blas().plan_matmul(x2, dst.T, o2)

        def run():
            deq()
            mm()
            if bias is not None:
                cp.add(o2, bias, out=o2, casting="unsafe")
        return run

    def _gemv(self, x2, w: PackedView, bias, o2, where: str) -> Callable[[], None]:
        cp = self.cp
        M, K = x2.shape
        N = w.shape[0]
        # x is read 4 elements at a time (float4 / 4 halves): contiguous rows from an aligned
        # start. Arena tensors start 256-byte aligned; anything else goes through a copy made
        # once here and refreshed by each run.
        xa, copy = x2, None
        if not x2.flags.c_contiguous or x2.data.ptr % 16:
            xa = cp.empty((M, K), x2.dtype)
            copy = x2
        if not o2.flags.c_contiguous:
            raise UnsupportedOpError(where, "packed linear into a non-contiguous output")
        if bias is None:
            bkind, bptr = 0, np.uint64(0)
        else:
            if bias.dtype not in (np.float32, np.float16) or not bias.flags.c_contiguous:
                raise UnsupportedOpError(where, f"packed linear bias {bias.dtype}")
            bkind, bptr = (1 if bias.dtype == np.float32 else 2), bias
        # qgemv41x where it applies, unless a knob of qgemv / qgemv41 is forced (tests, comparisons)
        forced = self.gemv_split or any(v is not None for v in (self.gemv_direct, self.gemv_rows_per_warp,
                                                                 self.gemv_words, self.gemv_steps, self.gemv_split_k))
        launch = None if forced else self.fast.bind(w, xa, o2, bptr, bkind)
        if launch is None:
            lp = self._launch(w, N, K, M)
            f = self._gemv_func(lp, w.dtype, _ctype(x2.dtype), 0)
            a = (w.raw, xa, o2, bptr, np.int32(bkind), np.int32(N), np.int32(K), np.int32(M), np.int64(N),
                 np.int32(N), np.int32(0), np.int32(0))
            grid, block = (lp.grid,), (QV_WARPS * 32,)
            launch = lambda: f(grid, block, a)  # noqa: E731
        if copy is None:
            return launch

        def run():
            cp.copyto(xa, copy)
            launch()
        return run

    def gemv_silu(self, x2, w: PackedView, g_row: int, u_row: int, n: int, o2,
                  norm: Optional[NormPrologue] = None) -> Optional[Callable[[], None]]:
        """o2 [M, n] = silu(x2 @ G^T) * (x2 @ U^T), G = rows g_row .. g_row + n - 1 and U = rows
        u_row .. of the packed ``w`` (a gate/up concatenation): qgemv's EPI 1, both products and the
        MLP's silu * mul in one launch. float32 only (a float16 chain would round the products and
        the silu output on the way), contiguous operands from 16-byte aligned starts, 1..8 rows of
        x; else None (the caller runs the concatenated product, then silu_mul). ``norm``: x2 is
        that prologue's h, computed in the launch (qgemv_norm; None where the prologue cannot run
        in the kernel)."""
        M, K = x2.shape
        if not (1 <= M <= GEMV_MAX_ROWS and K > 0 and n > 0 and x2.dtype == o2.dtype == np.float32
                and x2.flags.c_contiguous and o2.flags.c_contiguous and x2.data.ptr % 16 == 0
                and w.ptr % 2 == 0 and tuple(o2.shape) == (M, n)):
            return None
        # each warp: a gate row and its up row (R = 2), the staged kernel's default words
        lp = self._pair_launch(w, n, K, M)
        a = (np.uint64(0), np.int32(0), np.int32(n), np.int32(K), np.int32(M), np.int64(n),
             np.int32(w.rows), np.int32(g_row), np.int32(u_row))
        grid, block = (-(-n // (QV_WARPS // lp.split_k)),), (QV_WARPS * 32,)  # one output column per row group
        if norm is not None:
            if not (norm.in_kernel(o2) and norm.dtype == np.float32 and (norm.rows, norm.cols) == (M, K)):
                return None
            f = self._gemv_func(lp, w.dtype, "float", 1, norm.weight_ctype())
            a = (w.raw, o2) + a + norm.kernel_args()
            return lambda: f(grid, block, a)
        f = self._gemv_func(lp, w.dtype, "float", 1)
        a = (w.raw, x2, o2) + a
        return lambda: f(grid, block, a)

    def gemv_norm(self, norm: NormPrologue, w: PackedView, o2, where: str) -> Optional[Callable[[], None]]:
        """o2 [M, N] = h @ dequant(w).T, h = the prologue's rms-normed rows computed in the launch
        (qgemv_norm, EPI 0), or None where the prologue cannot run in the kernel (the caller then
        runs it unfused)."""
        self._check(w, where)
        if len(w.shape) != 2:
            return None
        N, K = w.shape
        M = norm.rows
        if not (N > 0 and norm.cols == K and norm.in_kernel(o2) and o2.dtype == norm.dtype
                and tuple(o2.shape) == (M, N)):
            return None
        lp = self._launch(w, N, K, M)
        f = self._gemv_func(lp, w.dtype, _ctype(norm.dtype), 0, norm.weight_ctype())
        a = (w.raw, o2, np.uint64(0), np.int32(0), np.int32(N), np.int32(K), np.int32(M), np.int64(N),
             np.int32(N), np.int32(0), np.int32(0)) + norm.kernel_args()
        grid, block = (lp.grid,), (QV_WARPS * 32,)
        return lambda: f(grid, block, a)

    def _pair_launch(self, w: PackedView, n: int, K: int, M: int) -> GemvLaunch:
        """The launch of a product whose warps each own a pair of rows (EPI 1 and 2): n row pairs."""
        lp = self._launch(w, 2 * n, K, M, rows_per_warp=2)  # n row groups of 2 rows
        if not lp.direct:
            lp = gemv_launch(w.dtype, n, K, M, self._sm_count(), 2, QV_WORDS, direct=False)
        return lp

    def gemv_rope(self, x2, w: PackedView, st: RopeOut, norm: Optional[NormPrologue] = None,
                  ) -> Optional[Callable[[], None]]:
        """x2 [M, K] @ dequant(w).T (w: q, k and v's weights back to back) stored as ``st`` says,
        rotated: qgemv / qgemv41 with EPI 2 (RopeSink), the planner's rope_kv group in one launch.
        ``norm``: x2 is that prologue's h, computed in the launch. None where a condition fails
        (the caller then runs the product into its scratch and rope_kv): 1..8 rows with M = B T,
        the parts' heads covering w's rows, D even, outputs of x's dtype, contiguous operands from
        16-byte aligned starts, and nothing written overlapping anything the launch reads or
        another output (every block reads all of x while others write)."""
        if not self.rope_in_product:
            return None
        M, K = (norm.rows, norm.cols) if norm is not None else x2.shape
        T = x2.dtype if norm is None else norm.dtype
        D = st.D
        if len(w.shape) != 2 or w.shape[1] != K or w.ptr % 2 or not (1 <= M <= GEMV_MAX_ROWS) or K <= 0:
            return None
        if D <= 0 or D % 2 or st.T <= 0 or M % st.T or sum(st.heads) * D != w.shape[0] or not 1 <= len(st.dsts) <= 3:
            return None
        if any(d.dtype != T or not d.flags.c_contiguous for d in st.dsts) or T not in (np.float32, np.float16):
            return None
        B = M // st.T
        for d, h, c in zip(st.dsts, st.heads, st.cache):
            if d.size != B * h * (st.S if c else st.T) * D:
                return None
        if any(st.rope) and (st.cos is None or st.sin is None or st.cos.dtype != st.sin.dtype
                             or st.cos.size != st.T * D or st.sin.size != st.T * D):
            return None
        if any(st.cache) and (st.pos is None or st.pos.dtype != np.int32):
            return None
        if norm is None:
            if not (x2.flags.c_contiguous and x2.data.ptr % 16 == 0):
                return None
            reads = [x2]
        else:
            if not norm.in_kernel():
                return None
            reads = [a for a in (norm.x, norm.y, norm.w, norm.s) if a is not None]
        reads += [a for a in (st.cos, st.sin, st.pos) if a is not None]
        for i, d in enumerate(st.dsts):
            if any(overlaps(d, r) for r in reads) or any(overlaps(d, o) for o in st.dsts[:i]):
                return None
        n = w.shape[0] // 2  # rotation pairs: one warp each
        lp = self._pair_launch(w, n, K, M)
        ct, tt = st.table_ctype(), _ctype(T)
        if lp.direct:
            tail = f"{lp.mm},{lp.steps},{lp.split_k},{self.gemv_split}>"
            expr = (f"qgemv41_rope<{tt},{ct},{tail}" if norm is None
                    else f"qgemv41_norm_rope<{tt},{norm.weight_ctype()},{ct},{tail}")
        else:
            tail = f"{lp.mm},{lp.words}>"
            q = QTYPE[w.dtype]
            expr = (f"qgemv_rope<{q},{tt},{ct},{tail}" if norm is None
                    else f"qgemv_norm_rope<{q},{tt},{norm.weight_ctype()},{ct},{tail}")
        f = self.func(expr)
        head = (np.int32(n), np.int32(K), np.int32(M), np.int32(w.rows))
        a = ((w.raw, x2) + head if norm is None else (w.raw,) + head + norm.kernel_args()) + st.kernel_args()
        grid, block = (-(-n // (QV_WARPS // lp.split_k)),), (QV_WARPS * 32,)
        return lambda: f(grid, block, a)

    def gemv_attn(self, part_o, part_ml, rows: int, dv: int, splits: int, w: PackedView, bias, o2,
                  where: str) -> Optional[Callable[[], None]]:
        """o2 [M, N] = x @ dequant(w).T (+ bias), x the split-key attention's output merged from its
        partials (``part_o`` [splits, rows, dv], ``part_ml`` [splits, rows, 2], float32) inside the
        launch (cuda_quant.cu AttnSrc), M K = rows dv. None where a condition fails (the caller then
        runs sdpa_combine and the product): 1..8 rows, a contiguous output of float32/float16, a
        bias of float32/float16, dv % 4 == 0 (the merge reads 4 values at a time), the merge and
        the kernel's own shared memory within BLOCK_SMEM."""
        self._check(w, where)
        if not self.attn_in_product or len(w.shape) != 2 or o2.ndim != 2:
            return None
        N, K = w.shape
        M = o2.shape[0]
        if not (1 <= M <= GEMV_MAX_ROWS and N > 0 and K > 0 and o2.shape[1] == N and M * K == rows * dv
                and o2.flags.c_contiguous and o2.dtype in (np.float32, np.float16) and K % 8 == 0
                and dv % 4 == 0 and part_o.data.ptr % 16 == 0):
            return None
        smem = attn_smem_bytes(M, K, rows, splits)
        if bias is None:
            bkind, bptr = 0, np.uint64(0)
        elif bias.dtype in (np.float32, np.float16) and bias.flags.c_contiguous:
            bkind, bptr = (1 if bias.dtype == np.float32 else 2), bias
        else:
            return None
        lp = self._launch(w, N, K, M)
        static = 1024 if lp.direct else QV_WARPS * 32 * lp.words * 16  # qgemv41's sums (<= 1 KiB), qgemv's stage
        if smem + static > BLOCK_SMEM:
            return None
        ct = _ctype(o2.dtype)
        if lp.direct:
            f = self.func(f"qgemv41_attn<{ct},{lp.rows_per_warp},{lp.mm},{lp.steps},{lp.split_k},{self.gemv_split}>")
        else:
            f = self.func(f"qgemv_attn<{QTYPE[w.dtype]},{ct},{lp.rows_per_warp},{lp.mm},{lp.words}>")
        a = (w.raw, o2, bptr, np.int32(bkind), np.int32(N), np.int32(K), np.int32(M), np.int64(N), part_o, part_ml,
             np.int64(rows), np.int32(dv), np.int32(splits))
        grid, block = (lp.grid,), (QV_WARPS * 32,)
        return lambda: f(grid, block, a, shared_mem=smem)


def packed_view(cp, dtype: str, shape, memptr) -> PackedView:
    """A PackedView of ``dtype[shape]`` over the device memory at ``memptr`` (a CuPy MemoryPointer)."""
    return PackedView(dtype, tuple(shape), cp.ndarray((_dt.nbytes(dtype, shape),), dtype=np.uint8, memptr=memptr))
