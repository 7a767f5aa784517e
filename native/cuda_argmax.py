"""The greedy pick on CUDA in one launch: ``shaders/cuda_argmax.cu`` behind
``CudaExecutor.argmax_device``.

torch.argmax's rule (the first NaN if any, else the first of equal maxima) over a float32 or
float16 vector, written as one int32 on the device. CuPy's ``argmax`` + ``isnan`` + ``where``
expression that it replaces enqueued 12 kernels (CUB's two-pass reductions, casts), each a
host-side launch on the path of every generated token.

Imports no device library (CuPy comes from the caller), so CPU-only collection can import it.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from gpudelegate import shaders

ARGMAX = "cuda_argmax.cu"
THREADS = 1024  # one block (cuda_argmax.cu's __launch_bounds__)


class ArgmaxKernel:
    """argmax_first of cuda_argmax.cu, compiled per storage type on first use."""

    def __init__(self, cp):
        self.cp = cp
        self._funcs: Dict[str, object] = {}

    def _func(self, ctype: str):
        f = self._funcs.get(ctype)
        if f is None:
            expr = f"argmax_first<{ctype}>"
            code = shaders.source("cuda_common.cu") + "\n" + shaders.source(ARGMAX)
            f = self.cp.RawModule(code=code, name_expressions=[expr]).get_function(expr)
            self._funcs[ctype] = f
        return f

    def launch(self, x, out, host_word: int = 0) -> None:
        """out (an int32 device array of one element) = torch.argmax(x) over all of ``x`` (a
        non-empty float32 / float16 CuPy array, flattened), enqueued on the current stream.
        ``host_word``: the device address of a pinned host int32 that receives the pick too
        (0: none), so its read back needs no copy (cuda_index_reads)."""
        if x.dtype not in (np.float32, np.float16):
            raise TypeError(f"argmax_first of {x.dtype}: float32 or float16")
        if out.dtype != np.int32 or out.size != 1:
            raise TypeError(f"argmax_first writes one int32, not {out.dtype}{list(out.shape)}")
        if x.size == 0:
            raise ValueError("argmax of an empty vector")
        x = self.cp.ascontiguousarray(x.reshape(-1))
        ctype = "float" if x.dtype == np.float32 else "half_t"
        self._func(ctype)((1,), (THREADS,), (x, np.int64(x.size), out, np.uint64(host_word)))
