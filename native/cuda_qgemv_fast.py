"""The q4_1 decode GEMV at two instructions a weight (about three with its loads): ``qgemv41x`` of
``shaders/cuda_qgemv_fast.cu``, bound by :meth:`QuantKernels._gemv <.cuda_quant.QuantKernels>` in
place of ``qgemv41`` for a plain packed linear (no fused prologue or epilogue) on a 4-byte aligned
q4_1 weight of at least :data:`QX_MIN_WEIGHTS` weights and at most :data:`QX_MAX_ROWS` activation
rows (smaller products are bound by latency, where qgemv41 is faster).

Each weight costs one LOP3 (its nibble masked in place is an exact denormal float) and one FFMA
against an activation pre-scaled by a power of two; the block stages the scaled activations of a
chunk of the row in shared memory once for all its rows (see the .cu file's comment for why it is
exact). A block of :data:`QX_WARPS` warps computes ``QX_WARPS / KS * R`` rows, R rows a warp, KS
warps a row group; a lane loads 3 words (d|m and two nibble words) per row per group of 16
blocks, ``S`` groups a trip, the next trip's loads issued before this one is summed.

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
"""Warps of one qgemv41x block (its WARPS): 16 rows share one staging of the activations (8 were
slower at an 8B model's MLP shapes: the staging is paid per block)."""

QX_STEPS = 2
"""Groups of 16 blocks a lane loads per trip (its S): 3 words each, twice that in flight with the
next trip's."""

QX_SMEM = 36 * 1024
"""Dynamic shared memory a block may take for its staged activations (a chunk of kcg groups of
the row: MM * kcg * QX_GROUP_BYTES); a longer row is walked in several chunks. Below the 48 KiB a
block gets without opting in."""

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
                warps: Optional[int] = None, smem: Optional[int] = None,
                rows_per_warp: Optional[int] = None) -> Optional[FastLaunch]:
    """The launch of qgemv41x for an [m, k] x [n, k]^T product, or None where its staged chunk of
    KS * S groups cannot fit ``smem`` bytes (wide x rows with long steps). ``steps`` (1, 2 or 4),
    ``split_k`` (1, 2 or 4, dividing ``warps``), ``warps`` (4, 8 or 16), ``smem`` (at most
    46 KiB) and ``rows_per_warp`` (1 or 2) override the defaults (S 2, KS 1, 16 warps, 36 KiB; two
    rows a warp for one x row, else one: the fastest over an 8B model's MLP and attention shapes
    on an H100): for tests and comparisons."""
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"qgemv41x takes 1..{GEMV_MAX_ROWS} rows, not {m}")
    if n <= 0 or k <= 0 or k % 32:
        raise ValueError(f"qgemv41x needs whole q4_1 blocks: [{n}, {k}]")
    mm = 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8
    wp = QX_WARPS if warps is None else warps
    if wp not in (4, 8, 16):
        raise ValueError(f"warps {wp}: 4, 8 or 16 a block")
    budget = QX_SMEM if smem is None else smem
    if not QX_GROUP_BYTES <= budget <= 46 * 1024:
        raise ValueError(f"smem {budget}: {QX_GROUP_BYTES} .. {46 * 1024} bytes")
    s = QX_STEPS if steps is None else steps
    if s not in (1, 2, 4):
        raise ValueError(f"steps {s}: 1, 2 or 4 groups a trip")
    r = (2 if mm == 1 else 1) if rows_per_warp is None else rows_per_warp
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

    def __init__(self, cp, wrap: Callable[[object], object] = lambda f: f):
        self.cp = cp
        self._wrap = wrap
        self._funcs: Dict[str, object] = {}
        self.enabled: Optional[bool] = None
        self.rows_per_warp: Optional[int] = None
        self.steps: Optional[int] = None
        self.split_k: Optional[int] = None
        self.warps: Optional[int] = None
        self.smem: Optional[int] = None
        self.bound = 0  # launches bound (tests: which products took it)

    def func(self, expr: str):
        """One instantiation, compiled alone on first use (CuPy adds -ftz=true to every RawModule:
        the kernel keeps its denormal weights with inline PTX, see the .cu file)."""
        f = self._funcs.get(expr)
        if f is None:
            mod = self.cp.RawModule(code=kernel_source("cuda_qgemv_fast.cu"), name_expressions=[expr])
            f = self._wrap(mod.get_function(expr))
            self._funcs[expr] = f
        return f

    def launch(self, n: int, k: int, m: int) -> Optional[FastLaunch]:
        return fast_launch(n, k, m, self.steps, self.split_k, self.warps, self.smem,
                           self.rows_per_warp)

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
        if lp is None:
            return None
        f = self.func(f"qgemv41x<{_ctype(xa.dtype)},{lp.mm},{lp.rows_per_warp},{lp.steps},{lp.split_k},{lp.warps}>")
        a = (w.raw, xa, o2, bptr, np.int32(bkind), np.int32(N), np.int32(K), np.int32(M), np.int64(N),
             np.int32(lp.kcg))
        grid, block, smem = (lp.grid,), (lp.warps * 32,), lp.smem
        self.bound += 1
        return lambda: f(grid, block, a, shared_mem=smem)
