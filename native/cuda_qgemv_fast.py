"""The q4_1 decode GEMV at two instructions a weight (about three with its loads): ``qgemv41x`` of
``shaders/cuda_qgemv_fast.cu``, bound by :meth:`QuantKernels._gemv <.cuda_quant.QuantKernels>` in
place of ``qgemv41`` for a plain packed linear (no fused prologue or epilogue) on a 4-byte aligned
q4_1 weight of at least :data:`QX_MIN_WEIGHTS` weights and at most :data:`QX_MAX_ROWS` activation
rows (smaller products are bound by latency, where qgemv41 is faster).

Each weight costs one LOP3 (its nibble masked in place is an exact denormal float) and one FFMA
against an activation pre-scaled by a power of two; the block stages the scaled activations of a
chunk of the row in shared memory once for all its rows (see the .cu file's comment for why it is
exact). A block of WARPS warps (8, 16 or 32: :func:`fast_launch` picks by rows per SM) computes
``WARPS / KS * R`` rows, R rows a warp, KS warps a row group; a lane loads 3 words (d|m and two
nibble words) per row per group of 16 blocks, ``S`` groups a trip, the next trip's loads issued
before this one is summed (the first trip's before the wait for the kernel ahead under PDL).

Like :mod:`.cuda_quant` it imports no device library at import time (:func:`fast_launch` is pure
arithmetic, checked on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import numpy as np

from gpudelegate.plan.layout import GEMV_MAX_ROWS

from .cuda_norm_prologue import kernel_source

QX_WARPS = 16
"""Warps of one qgemv41x block (its WARPS) for 2 or more x rows: 16 rows share one staging of the
activations (8 were slower at an 8B model's MLP shapes: the staging is paid per block)."""

QX_WIDE_ROWS_PER_SM = 64
"""For one x row, the weight rows per SM from which a block is 8 warps of 2 rows. With many rows
an SM (an 8B model's gate / up: 108 on an H100) several small blocks share it, one's staging
overlapping the others' streaming, and the last wave is short."""

QX_ONE_BLOCK_ROWS_PER_SM = 24
"""For one x row, the weight rows per SM from which (up to :data:`QX_WIDE_ROWS_PER_SM`) a block
is 32 warps of 1 row, about one block an SM (an 8B model's down and q / o: 31 rows an SM on an
H100) staging the activations once for all of them, the whole row where it fits. Fewer rows (a
2048x2048 product: 16 an SM, bound by latency) ran faster in 16 warps of 2 rows (the benchmark's
variant rows say by how much)."""

QX_REF_SMS = 132
"""SM count :func:`fast_launch` assumes where it is given none (an H100 SXM; FastQ41 passes its
device's)."""

QX_STEPS = 2
"""Groups of 16 blocks a lane loads per trip (its S): 3 words each, twice that in flight with the
next trip's."""

QX_SMEM = 36 * 1024
"""Dynamic shared memory a block may take for its staged activations (a chunk of kcg groups of
the row: MM * kcg * QX_GROUP_BYTES); a longer row is walked in several chunks. Below the 48 KiB a
block gets without opting in."""

QX_SMEM_WHOLE = 96 * 1024
"""Dynamic shared bytes up to which a block of 32 warps (alone on its SM) stages the whole row at
once rather than in :data:`QX_SMEM` chunks: one barrier before its first sum instead of one a
chunk (an 8B down projection: 64.5 KiB)."""

QX_SMEM_OPT_IN = 48 * 1024
"""Dynamic shared bytes above which a launch must raise its function's limit first
(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)."""

QX_SMEM_MAX = 200 * 1024
"""The most a forced ``smem`` may ask (a device may allow less: then nothing is bound)."""

QX_GROUP_BYTES = 2304
"""Shared bytes of one group of 16 blocks of one activation row: 16 scaled values, 2^c and the
sum per lane (QX_GROUP_BYTES of the .cu file)."""

QX_MIN_WEIGHTS = 1 << 22
"""Weights (N * K) from which a q4_1 linear takes qgemv41x by default: on an H100 it ran a
2048x2048 product 1.2x faster than qgemv41 and SmolLM2's (at most 1536x576) 1.2-1.3x slower
(bound by latency: the staging and its barrier are paid before any weight is summed)."""

QX_MAX_ROWS = 2
"""Activation rows up to which a q4_1 linear takes qgemv41x by default: 2 rows ran 1.15-1.24x
faster than qgemv41 at an 8B model's MLP shapes, 8 rows 2-6% slower (the FMAs, not the weight
decoding, bound them)."""

GROUP = 16  # q4_1 blocks of one warp step


@dataclass(frozen=True)
class FastLaunch:
    """Template arguments, grid and shared memory of one qgemv41x launch."""

    mm: int  # MM: x rows compiled for (1, 2, 4, 8)
    rows_per_warp: int  # R
    steps: int  # S
    split_k: int  # KS
    warps: int  # WARPS
    kcg: int  # groups of 16 blocks per staged chunk (a multiple of KS * S)
    chunks: int  # staged chunks per row
    grid: int
    smem: int  # dynamic shared bytes


def fast_launch(n: int, k: int, m: int, steps: Optional[int] = None, split_k: Optional[int] = None,
                warps: Optional[int] = None, smem: Optional[int] = None, rows_per_warp: Optional[int] = None,
                sm_count: int = QX_REF_SMS, smem_limit: int = QX_SMEM_MAX) -> Optional[FastLaunch]:
    """The launch of qgemv41x for an [m, k] x [n, k]^T product, or None where its staged chunk of
    KS * S groups cannot fit ``smem`` bytes (wide x rows with long steps). By default S 2, KS 1;
    for one x row 8 warps of 2 rows a block from :data:`QX_WIDE_ROWS_PER_SM` rows per SM (of
    ``sm_count``), 32 warps of 1 row from :data:`QX_ONE_BLOCK_ROWS_PER_SM`, else 16 warps of 2
    rows; for more x rows 16 warps of 1 row; chunks of at most :data:`QX_SMEM`, except that a block
    of 32 warps stages the whole row where it fits min(:data:`QX_SMEM_WHOLE`, ``smem_limit``).
    ``steps`` (1, 2 or 4), ``split_k`` (1, 2 or 4, dividing ``warps``), ``warps`` (4, 8, 16 or
    32), ``smem`` (at most :data:`QX_SMEM_MAX`) and ``rows_per_warp`` (1 or 2) override those
    choices: for tests and comparisons."""
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"qgemv41x takes 1..{GEMV_MAX_ROWS} rows, not {m}")
    if n <= 0 or k <= 0 or k % 32:
        raise ValueError(f"qgemv41x needs whole q4_1 blocks: [{n}, {k}]")
    mm = 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8
    if mm == 1 and warps is None and rows_per_warp is None:
        per_sm = n / sm_count
        if per_sm >= QX_WIDE_ROWS_PER_SM:
            wp, r = 8, 2
        else:
            wp, r = (32, 1) if per_sm >= QX_ONE_BLOCK_ROWS_PER_SM else (16, 2)
    else:
        wp = QX_WARPS if warps is None else warps
        r = (2 if mm == 1 else 1) if rows_per_warp is None else rows_per_warp
    if wp not in (4, 8, 16, 32):
        raise ValueError(f"warps {wp}: 4, 8, 16 or 32 a block")
    budget = QX_SMEM if smem is None else smem
    if not QX_GROUP_BYTES <= budget <= QX_SMEM_MAX:
        raise ValueError(f"smem {budget}: {QX_GROUP_BYTES} .. {QX_SMEM_MAX} bytes")
    s = QX_STEPS if steps is None else steps
    if s not in (1, 2, 4):
        raise ValueError(f"steps {s}: 1, 2 or 4 groups a trip")
    if r not in (1, 2) or r * mm > 32:
        raise ValueError(f"rows_per_warp {r}: 1 or 2")
    groups = -(-(k // 32) // GROUP)
    if split_k is None:
        ks = 1
    elif split_k in (1, 2, 4) and wp % split_k == 0:
        ks = split_k
    else:
        raise ValueError(f"split_k {split_k}: 1, 2 or 4 warps a row, dividing {wp}")
    if steps is None:
        while s > 1 and mm * ks * s * QX_GROUP_BYTES > budget:
            s //= 2
    unit = ks * s
    whole = mm * -(-groups // unit) * unit * QX_GROUP_BYTES
    if smem is None and wp == 32 and budget < whole <= min(QX_SMEM_WHOLE, smem_limit):
        budget = whole
    max_kcg = budget // (mm * QX_GROUP_BYTES) // unit * unit
    if max_kcg < unit:
        return None
    chunks = -(-groups // max_kcg)
    kcg = -(-(-(-groups // chunks)) // unit) * unit
    rows_per_block = wp // ks * r
    return FastLaunch(mm=mm, rows_per_warp=r, steps=s, split_k=ks, warps=wp, kcg=kcg, chunks=chunks,
                      grid=-(-n // rows_per_block), smem=mm * kcg * QX_GROUP_BYTES)


def _ctype(dtype) -> str:
    return "float" if dtype == np.float32 else "half_t"


class FastQ41:
    """qgemv41x of one device (one per :class:`.cuda_quant.QuantKernels`). ``enabled``: None (the
    default) binds it where :meth:`applies`, True wherever it can run, False nowhere;
    ``steps`` / ``split_k`` / ``warps`` / ``smem`` / ``rows_per_warp`` force :func:`fast_launch`'s
    choices (tests and comparisons; set before a session binds its kernels)."""

    def __init__(self, cp, wrap: Callable[[object], object] = lambda f: f, prelude: str = ""):
        self.cp = cp
        self._wrap = wrap
        self._prelude = prelude  # what the source begins with (cuda_pdl: the timeline switch)
        self._funcs: Dict[str, object] = {}
        self._raw: Dict[str, object] = {}  # the RawKernels, whose shared-memory limit a launch may raise
        self._smem_set: Dict[str, int] = {}  # that limit where raised
        self._smem_optin: Optional[int] = None
        self._sm_count: Optional[int] = None
        self.enabled: Optional[bool] = None
        self.rows_per_warp: Optional[int] = None
        self.steps: Optional[int] = None
        self.split_k: Optional[int] = None
        self.warps: Optional[int] = None
        self.smem: Optional[int] = None
        self.bound = 0  # launches bound (tests: which products took it)

    def func(self, expr: str, smem: int = 0):
        """One instantiation, compiled alone on first use (CuPy adds -ftz=true to every RawModule:
        the kernel keeps its denormal weights with inline PTX, see the .cu file), allowed ``smem``
        dynamic shared bytes (above :data:`QX_SMEM_OPT_IN` its limit is raised first)."""
        f = self._funcs.get(expr)
        if f is None:
            mod = self.cp.RawModule(code=kernel_source("cuda_qgemv_fast.cu", self._prelude), name_expressions=[expr])
            raw = mod.get_function(expr)
            f = self._wrap(raw)
            self._funcs[expr], self._raw[expr] = f, raw
        if smem > max(QX_SMEM_OPT_IN, self._smem_set.get(expr, 0)):
            self._raw[expr].max_dynamic_shared_size_bytes = smem
            self._smem_set[expr] = smem
        return f

    def _device(self) -> None:
        dev = self.cp.cuda.Device()
        props = self.cp.cuda.runtime.getDeviceProperties(dev.id)
        most = props.get("sharedMemPerBlockOptin")
        if most is None:
            most = dev.attributes.get("MaxSharedMemoryPerBlockOptin", QX_SMEM_OPT_IN)
        self._smem_optin = int(most) - 4096  # room for the split sums' static array (KS > 1)
        self._sm_count = int(props["multiProcessorCount"])

    @property
    def smem_optin(self) -> int:
        """The device's most dynamic shared bytes a block may opt in to (less its static part)."""
        if self._smem_optin is None:
            self._device()
        return self._smem_optin

    @property
    def sm_count(self) -> int:
        if self._sm_count is None:
            self._device()
        return self._sm_count

    def launch(self, n: int, k: int, m: int) -> Optional[FastLaunch]:
        return fast_launch(n, k, m, self.steps, self.split_k, self.warps, self.smem, self.rows_per_warp,
                           self.sm_count, self.smem_optin)

    @staticmethod
    def applies(n: int, k: int, m: int) -> bool:
        """Whether an [m, k] x [n, k]^T q4_1 product takes qgemv41x by default (``enabled`` None)."""
        return n * k >= QX_MIN_WEIGHTS and m <= QX_MAX_ROWS

    def bind(self, w, xa, o2, bptr, bkind: int) -> Optional[Callable[[], None]]:
        """The launch closure of out ``o2`` [M, N] = ``xa`` [M, K] @ dequant(``w``).T (+ bias
        ``bptr`` of kind ``bkind``: 0 none, 1 float32, 2 float16), or None where qgemv41x is not
        to run (``enabled`` False, or None and not :meth:`applies`) or cannot (not q4_1, a weight
        not 4-byte aligned, x not contiguous from a 16-byte aligned start, more than GEMV_MAX_ROWS
        rows, a chunk that cannot fit): the caller then binds qgemv41 / qgemv."""
        if self.enabled is False or w.dtype != "q4_1" or w.ptr % 4 or len(w.shape) != 2:
            return None
        M, K = xa.shape
        N = w.shape[0]
        if self.enabled is None and not self.applies(N, K, M):
            return None
        if not (1 <= M <= GEMV_MAX_ROWS and N > 0 and K > 0 and K == w.shape[1] and xa.flags.c_contiguous
                and xa.data.ptr % 16 == 0 and o2.flags.c_contiguous and xa.dtype in (np.float32, np.float16)):
            return None
        lp = self.launch(N, K, M)
        if lp is None or lp.smem > self.smem_optin:
            return None
        f = self.func(f"qgemv41x<{_ctype(xa.dtype)},{lp.mm},{lp.rows_per_warp},{lp.steps},{lp.split_k},{lp.warps}>",
                      lp.smem)
        a = (w.raw, xa, o2, bptr, np.int32(bkind), np.int32(N), np.int32(K), np.int32(M), np.int64(N),
             np.int32(lp.kcg))
        grid, block, smem = (lp.grid,), (lp.warps * 32,), lp.smem
        self.bound += 1
        return lambda: f(grid, block, a, shared_mem=smem)
