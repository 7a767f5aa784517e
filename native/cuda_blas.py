"""cuBLAS GEMMs on a handle of our own, callable while a stream is being captured into a graph.

CuPy refuses every cuBLAS call during stream capture (its ``setStream`` raises
NotImplementedError, a blanket guard). cuBLAS itself supports capture when it is given a
workspace of the caller's (``cublasSetWorkspace``, so it allocates nothing while capturing) and
its scalars are host values (read at capture time): PyTorch captures cuBLAS the same way. This
module binds the libcublas that CuPy already loaded (one cuBLAS in the process) with ctypes and
exposes one thing, a row-major batched ``matmul`` planned once per dispatch:

    call = blas.plan_matmul(a, b, out)   # cupy arrays: a [..., M, K] @ b [..., K, N] -> out
    call()                               # enqueues the GEMM(s) on the current CuPy stream

Float16 operands accumulate in float32 (CUBLAS_COMPUTE_32F), float32 stays exact float32 (no
TF32: the default math mode).

float32 activations against a float16 weight (a float16-weight program's prefill) are mixed
dtypes, which cuBLAS does not multiply (GemmEx takes one type for A and B). The weight is widened
exactly into a float32 scratch (one elementwise cast, in the weight's own memory order so the GEMM
still reads it transposed in place) and the float32 GEMM runs on it: the result is the float32
weights' product. The scratch is the executor's (:class:`WidenScratch`, made current with
``Blas.widening_into`` while a session records): one buffer, as large as the largest weight
widened, shared by every product of that executor, which run one after another on its stream.
Without one (a product planned outside a recording) each call widens into a fresh array.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
from typing import Callable, List, Optional, Tuple

import numpy as np

from gpudelegate.errors import DeviceError

CUDA_R_32F, CUDA_R_16F = 0, 2
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
OP_N, OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20  # cuBLAS's recommendation for Hopper
_DTYPE = {np.dtype(np.float32): CUDA_R_32F, np.dtype(np.float16): CUDA_R_16F}

_c = ctypes
_GEMM_EX = [_c.c_void_p, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_void_p,
            _c.c_void_p, _c.c_int, _c.c_int, _c.c_void_p, _c.c_int, _c.c_int, _c.c_void_p,
            _c.c_void_p, _c.c_int, _c.c_int, _c.c_int, _c.c_int]
_GEMM_STRIDED = [_c.c_void_p, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_void_p,
                 _c.c_void_p, _c.c_int, _c.c_int, _c.c_longlong, _c.c_void_p, _c.c_int, _c.c_int, _c.c_longlong,
                 _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_int, _c.c_longlong, _c.c_int, _c.c_int, _c.c_int]


def _load_cublas(cp):
    """The libcublas CuPy uses: found in this process's mappings after CuPy has loaded it."""
    cp.cuda.device.get_cublas_handle()  # makes CuPy load the library
    found: List[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if os.path.basename(path).startswith("libcublas.so") and path not in found:
                    found.append(path)
    except OSError:
        pass
    for cand in found + ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]:
        try:
            return ctypes.CDLL(cand)
        except OSError:
            continue
    raise DeviceError("cuBLAS: cannot find the libcublas CuPy loaded (searched the process mappings)")


def _layout(x) -> Optional[Tuple[str, int]]:
    """How the last two dims of ``x`` (rows x cols) lie in memory: ("rm", ld) row-major with
    leading dimension ld, ("cm", ld) column-major (a transposed view), or None (neither)."""
    rows, cols = x.shape[-2], x.shape[-1]
    s0, s1 = x.strides[-2] // x.itemsize, x.strides[-1] // x.itemsize
    if cols == 1 or s1 == 1:
        ld = s0 if rows > 1 else cols
        if ld >= max(cols, 1):
            return "rm", ld
    if rows == 1 or s0 == 1:
        ld = s1 if cols > 1 else rows
        if ld >= max(rows, 1):
            return "cm", ld
    return None


class WidenScratch:
    """The float32 scratch float16 operands are widened into, of one executor (see the module
    docstring). ``alloc(nbytes)`` gives device memory (a CuPy MemoryPointer, from the executor's
    pool). It grows while products are planned (``reserve``, at record time, before any run and
    so before a CUDA graph can capture its pointer); the planned calls read ``mem`` when they run."""

    def __init__(self, alloc: Callable[[int], object]):
        self._alloc = alloc
        self.mem = None
        self.nbytes = 0

    def reserve(self, nbytes: int) -> None:
        if nbytes > self.nbytes:
            self.mem = None  # the smaller buffer goes back to the pool first
            self.mem = self._alloc(nbytes)
            self.nbytes = nbytes

    def free(self) -> None:
        self.mem = None
        self.nbytes = 0


class Blas:
    """One cuBLAS handle with its own workspace, bound to the stream it is called on."""

    def __init__(self, cp):
        self.cp = cp
        lib = _load_cublas(cp)
        self.lib = lib
        lib.cublasGemmEx.argtypes = _GEMM_EX
        lib.cublasGemmStridedBatchedEx.argtypes = _GEMM_STRIDED
        lib.cublasCreate_v2.argtypes = [_c.POINTER(_c.c_void_p)]
        lib.cublasSetStream_v2.argtypes = [_c.c_void_p, _c.c_void_p]
        lib.cublasSetWorkspace_v2.argtypes = [_c.c_void_p, _c.c_void_p, _c.c_size_t]
        lib.cublasDestroy_v2.argtypes = [_c.c_void_p]
        h = _c.c_void_p()
        self._check(lib.cublasCreate_v2(_c.byref(h)), "cublasCreate")
        self.handle = h
        self.workspace = cp.cuda.alloc(WORKSPACE_BYTES)  # held for the handle's life
        self._stream: Optional[int] = None
        self._widen: Optional[WidenScratch] = None  # the recording executor's (widening_into)
        self._one = _c.c_float(1.0)
        self._zero = _c.c_float(0.0)
        self._one_p = _c.cast(_c.pointer(self._one), _c.c_void_p)  # host scalars: read at call/capture time
        self._zero_p = _c.cast(_c.pointer(self._zero), _c.c_void_p)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def _bind_stream(self) -> None:
        s = self.cp.cuda.get_current_stream().ptr
        if s != self._stream:
            # SetStream resets the workspace to cuBLAS's own pool: give ours back after it.
            self._check(self.lib.cublasSetStream_v2(self.handle, _c.c_void_p(s)), "cublasSetStream")
            self._check(self.lib.cublasSetWorkspace_v2(self.handle, _c.c_void_p(self.workspace.ptr), WORKSPACE_BYTES),
                        "cublasSetWorkspace")
            self._stream = s

    def close(self) -> None:
        if self.handle is not None:
            try:
                self.lib.cublasDestroy_v2(self.handle)
            except Exception:
                pass
            self.handle = None
            self.workspace = None

    @contextlib.contextmanager
    def widening_into(self, scratch: Optional[WidenScratch]):
        """Products planned inside widen their float16 operands into ``scratch``."""
        prev, self._widen = self._widen, scratch
        try:
            yield
        finally:
            self._widen = prev

    # ------------------------------------------------------------------ matmul
    def plan_matmul(self, a, b, out) -> Callable[[], None]:
        """A closure computing ``out = a @ b`` (numpy matmul semantics, batch dims broadcast) with
        every pointer, stride and leading dimension computed now. Operands of another dtype, or
        whose matrices are neither row- nor column-major, are converted at each call first."""
        cp = self.cp
        if out.dtype not in _DTYPE:
            raise TypeError(f"matmul into {out.dtype}: cuBLAS path takes float32/float16")
        if not out.flags.c_contiguous:
            raise ValueError("matmul output must be contiguous")
        fast = a.dtype == out.dtype and b.dtype == out.dtype
        a2 = a.reshape(1, -1) if a.ndim == 1 else a
        b2 = b.reshape(-1, 1) if b.ndim == 1 else b
        M, K, N = a2.shape[-2], a2.shape[-1], b2.shape[-1]
        batch = tuple(np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]))
        o2 = out.reshape(batch + (M, N))
        if K == 0:  # an empty contraction sums nothing: zeros (torch), no GEMM with empty operands
            return lambda: out.fill(0)
        fast = fast and _layout(a2) is not None and _layout(b2) is not None
        if fast:
            calls = self._calls(cp.broadcast_to(a2, batch + (M, K)), cp.broadcast_to(b2, batch + (K, N)), o2)
            fns = [(self.lib.cublasGemmEx if len(c) == 19 else self.lib.cublasGemmStridedBatchedEx, c) for c in calls]

            def run():
                self._bind_stream()
                for fn, args in fns:
                    st = fn(*args)
                    if st:
                        raise RuntimeError(f"cuBLAS GEMM failed with status {st}")
            return run

        if (a2.dtype == np.float32 and b2.dtype == np.float16 and out.dtype == np.float32 and b2.ndim == 2
                and _layout(a2) is not None and (b2.flags.c_contiguous or b2.flags.f_contiguous)):
            return self._plan_widened(a2, b2, o2, batch, M, K, N)

        def run_slow():
            aa = cp.ascontiguousarray(a2.astype(out.dtype, copy=False))
            bb = cp.ascontiguousarray(b2.astype(out.dtype, copy=False))
            self._bind_stream()
            for args in self._calls(cp.broadcast_to(aa, batch + (M, K)), cp.broadcast_to(bb, batch + (K, N)), o2):
                fn = self.lib.cublasGemmEx if len(args) == 19 else self.lib.cublasGemmStridedBatchedEx
                st = fn(*args)
                if st:
                    raise RuntimeError(f"cuBLAS GEMM failed with status {st}")
        return run_slow

    def _plan_widened(self, a2, b2, o2, batch, M, K, N) -> Callable[[], None]:
        """float32 a2 @ float16 b2 (one matrix, C- or F-contiguous: a weight or its transpose):
        b2 widened exactly into float32 in its own memory order, then the float32 GEMM."""
        cp = self.cp
        order = "C" if b2.flags.c_contiguous else "F"
        wid = self._widen
        # The cast runs over the C-contiguous side (b2 or its transpose): CuPy's elementwise
        # kernels walk C order, so an F-contiguous pair would be read and written a row stride
        # apart per thread (uncoalesced: slower than the GEMM itself).
        flip = (lambda v: v) if order == "C" else (lambda v: v.T)
        if wid is None:  # no executor's scratch: a fresh float32 copy per call
            def run_fresh():
                bb = flip(flip(b2).astype(np.float32))
                self._bind_stream()
                self._launch(self._calls(cp.broadcast_to(a2, batch + (M, K)), cp.broadcast_to(bb, batch + (K, N)), o2))
            return run_fresh
        wid.reserve(b2.size * 4)
        src = flip(b2)  # C-contiguous
        bound = {"mem": None, "dst": None, "calls": None}  # dst: flip of the scratch's view, C-contiguous

        def run():
            if bound["mem"] is not wid.mem:  # first run (the scratch no longer grows after recording)
                dst = cp.ndarray(b2.shape, np.float32, memptr=wid.mem, order=order)
                bound.update(mem=wid.mem, dst=flip(dst), calls=self._calls(cp.broadcast_to(a2, batch + (M, K)),
                                                                           cp.broadcast_to(dst, batch + (K, N)), o2))
            cp.copyto(bound["dst"], src, casting="same_kind")  # exact: every float16 is a float32
            self._bind_stream()
            self._launch(bound["calls"])
        return run

    def _launch(self, calls: List[tuple]) -> None:
        for args in calls:
            fn = self.lib.cublasGemmEx if len(args) == 19 else self.lib.cublasGemmStridedBatchedEx
            st = fn(*args)
            if st:
                raise RuntimeError(f"cuBLAS GEMM failed with status {st}")

    def _calls(self, A, B, C) -> List[tuple]:
        """Argument tuples of the cuBLAS calls for row-major C = A @ B (equal batch shapes).

        Row-major C = A @ B is column-major C^T = B^T A^T: cuBLAS computes an N x M result from
        B (as the first operand) and A, whose row-major memory reads as their transposes."""
        dt = _DTYPE[C.dtype]
        item = C.itemsize
        M, K, N = A.shape[-2], A.shape[-1], B.shape[-1]
        la, lb = _layout(A), _layout(B)
        op_b = OP_N if lb[0] == "rm" else OP_T
        op_a = OP_N if la[0] == "rm" else OP_T
        ldc = C.strides[-2] // item if M > 1 else N
        batch = C.shape[:-2]
        h, one, zero = self.handle, self._one_p, self._zero_p
        if M == 0 or N == 0:
            return []
        if not batch:
            return [(h, op_b, op_a, N, M, K, one, _c.c_void_p(B.data.ptr), dt, lb[1], _c.c_void_p(A.data.ptr), dt, la[1],
                     zero, _c.c_void_p(C.data.ptr), dt, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)]
        sa = [s // item for s in A.strides[:-2]]
        sb = [s // item for s in B.strides[:-2]]
        sc = [s // item for s in C.strides[:-2]]
        calls = []
        # Strided-batched over the last batch dim, one call per index of the others.
        for idx in itertools.product(*[range(n) for n in batch[:-1]]):
            oa = sum(i * s for i, s in zip(idx, sa)) * item
            ob = sum(i * s for i, s in zip(idx, sb)) * item
            oc = sum(i * s for i, s in zip(idx, sc)) * item
            calls.append((h, op_b, op_a, N, M, K, one, _c.c_void_p(B.data.ptr + ob), dt, lb[1], sb[-1],
                          _c.c_void_p(A.data.ptr + oa), dt, la[1], sa[-1], zero, _c.c_void_p(C.data.ptr + oc), dt, ldc,
                          sc[-1], batch[-1], CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT))
        return calls
