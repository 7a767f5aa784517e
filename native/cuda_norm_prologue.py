"""The rms-norm prologue of a decode product on CUDA: the planner's ``Fusion.norm``
(:mod:`gpudelegate.plan.fusion`) bound to device views.

A concatenated q/k/v or gate/up product over at most 8 rows that reads h = rms_norm(s) * w,
s = x + y (or s = the norm's own input), runs one kernel that computes h itself
(``shaders/cuda_norm_prologue.cu`` ahead of ``hgemv_norm`` / ``qgemv_norm``) and writes s, instead
of the add_rms_norm (or rms_norm) launch and then the product: two launches fewer a decoder layer.

:class:`NormPrologue` holds the views and checks what the in-kernel prologue needs (contiguous
[M, K] rows from 16-byte aligned starts, one float dtype, no write overlapping a read);
:meth:`NormPrologue.unfused` is the other way, for products no such kernel carries (float32
weights through cuBLAS, float16 activations with float16 weights, a check that fails): the
unfused norm kernel into a buffer of the group's scratch, then the product reads it. Correct, not
faster: the launch stays.

Imports no device library (the views come from the caller), so CPU-only collection can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from gpudelegate import shaders

NORM_PROLOGUE = "cuda_norm_prologue.cu"
MAX_ROWS = 8  # NP_MAX_ROWS of cuda_norm_prologue.cu (PROLOGUE_MAX_ROWS of core/plan/fusion.py)
_BLOCK = 256  # the unfused norm kernels' largest block (cuda_kernels._BLOCK)


def unfused_block(cols: int) -> int:
    """Threads a block of the unfused add_rms_norm / rms_norm kernel gets for rows of ``cols``
    (cuda_kernels.CudaKernels._rows): the prologue sums in that block's order."""
    return min(_BLOCK, max(32, (cols + 31) // 32 * 32))


def kernel_source(name: str, prelude: str = "") -> str:
    """A RawModule's code for ``name`` with the prologue's helpers ahead of it (after ``prelude``:
    cuda_pdl's timeline switch where it is on)."""
    return (prelude + shaders.source("cuda_common.cu") + "\n" + shaders.source(NORM_PROLOGUE) + "\n"
            + shaders.source(name))


def _ctype(a) -> str:
    return "float" if a.dtype == np.float32 else "half_t"


def _span(a):
    return a.data.ptr, a.data.ptr + a.nbytes


def overlaps(a, b) -> bool:
    """Whether two device views share any byte (by their address spans)."""
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


@dataclass
class NormPrologue:
    """h = rms_norm(s) * w over [M, K] rows, s = x + y (y None: s = x, a plain rms_norm), s
    written when ``s`` is given. ``x``, ``y``, ``s`` are [M, K] views, ``w`` a [K] view or None,
    ``eps`` the norm's."""

    x: object
    y: Optional[object]
    w: Optional[object]
    s: Optional[object]
    eps: float

    @property
    def rows(self) -> int:
        return int(self.x.shape[0])

    @property
    def cols(self) -> int:
        return int(self.x.shape[1])

    @property
    def dtype(self):
        return self.x.dtype

    def in_kernel(self, out=None) -> bool:
        """Whether a product kernel can carry this prologue: 1..8 rows of float32/float16 storage
        (x, y, s one dtype; w float32/float16), K % 8 == 0, every view contiguous from a 16-byte
        aligned start, s overlapping none of x, y, w and the product's ``out`` none of them
        either (every block reads all of x and y while others write)."""
        x, y, w, s = self.x, self.y, self.w, self.s
        if not (1 <= self.rows <= MAX_ROWS and self.cols > 0 and self.cols % 8 == 0):
            return False
        if x.dtype not in (np.float32, np.float16):
            return False
        for a in (y, s):
            if a is not None and (a.dtype != x.dtype or tuple(a.shape) != tuple(x.shape)):
                return False
        if w is not None and (w.dtype not in (np.float32, np.float16) or w.size != self.cols):
            return False
        views = [a for a in (x, y, w, s, out) if a is not None]
        if not all(a.flags.c_contiguous and a.data.ptr % 16 == 0 for a in views):
            return False
        reads = [a for a in (x, y, w) if a is not None]
        writes = [a for a in (s, out) if a is not None]
        return not any(overlaps(r, q) for r in reads for q in writes)

    def weight_ctype(self) -> str:
        """C storage type of the norm weight (x's when there is none: the kernel never reads it)."""
        return _ctype(self.w if self.w is not None else self.x)

    def kernel_args(self) -> tuple:
        """The trailing arguments of hgemv_norm / qgemv_norm: nx, ny, nw, ns, eps, vb."""
        nul = np.uint64(0)
        return (self.x, nul if self.y is None else self.y, nul if self.w is None else self.w,
                nul if (self.s is None or self.y is None) else self.s, np.float32(self.eps),
                np.int32(unfused_block(self.cols)))

    def unfused(self, kernels, h) -> Callable[[], None]:
        """The norm as its own launch, writing s (with the add) and h ([M, K], contiguous): the
        kernels the unfused chain runs (cuda_fused.cu add_rms_norm, cuda_norms.cu rms_norm)."""
        x, y, w = self.x, self.y, self.w
        rows, cols = self.rows, self.cols
        if rows == 0 or cols == 0:
            return lambda: None
        wt = w if w is not None else x
        eps = np.float32(self.eps)
        block = (unfused_block(cols),)
        if y is None:
            fk = kernels.func("cuda_norms.cu", f"rms_norm<{_ctype(x)},{_ctype(wt)}>")
            a = (x, wt, h, np.int32(cols), eps, np.int32(w is not None))
        else:
            s = self.s if self.s is not None else h  # no kept sum: h's bytes hold it, then h
            fk = kernels.func("cuda_fused.cu", f"add_rms_norm<{_ctype(x)},{_ctype(wt)}>")
            a = (x, y, wt, s, h, np.int32(cols), eps, np.int32(w is not None))
        return lambda: fk((rows,), block, a)
