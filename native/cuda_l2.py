"""An L2 access-policy window over a session's activation arena, for the graphs it captures.

A decode step streams every weight once (SmolLM2-135M q4_1: 96.5 MB, twice the H100's 50 MB L2),
and that stream evicts what the step reads back a few kernels later or in the next step: the KV
caches, the residual rows, the attention partials. Those live in the executor's activation arena.
CUDA lets a stream mark an address range "persisting" (an access-policy window): its lines go to a
carve-out of L2 (``CU_LIMIT_PERSISTING_L2_CACHE_SIZE``, at most the device's
``MAX_PERSISTING_L2_CACHE_SIZE``) that normal and streaming accesses do not evict. A kernel
launched or captured on that stream carries the window, so a graph captured with it keeps it on
every replay, whatever the stream's attribute is later.

:class:`L2Window` sets the window on the compute stream only while a payload is captured and
clears it right after: eager runs and other work on the stream are untouched, and each graph keeps
its own session's window. The carve-out belongs to the CUDA context, which every Environment of
the process shares (CuPy's primary context): it is read from the driver and raised to what a
window asks, never lowered. A carve-out no persisting access uses serves normal accesses too (the
CUDA programming guide, "L2 cache set-aside"), so keeping it costs other work nothing;
``CudaContext.close`` only demotes the lines its graphs marked. Where the arena is larger than
the carve-out the window's hit ratio is the share that fits (CUDA then keeps a hashed subset of
its lines).

Why a window and not ``.L2::evict_first`` on the weight loads: the window needs no kernel change
and covers every kernel that touches the arena (CuPy's, cuBLAS's, ours). Off with
``GPUDELEGATE_CUDA_L2_WINDOW=0`` or the executor option ``l2_window=False``; a driver without
``cuStreamSetAttribute`` or a device without a persisting carve-out (before compute capability
8.0) leaves it off, with the reason in the executor's ``stats["l2_window"]``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Optional

L2_WINDOW_ENV = "GPUDELEGATE_CUDA_L2_WINDOW"
_ACCESS_POLICY_WINDOW = 1  # CUstreamAttrID (= CUlaunchAttributeID) CU_..._ACCESS_POLICY_WINDOW
_LIMIT_PERSISTING_L2 = 0x06  # CUlimit CU_LIMIT_PERSISTING_L2_CACHE_SIZE
_ATTR_MAX_PERSISTING_L2 = 108  # cudaDevAttrMaxPersistingL2CacheSize
_ATTR_MAX_WINDOW = 109  # cudaDevAttrMaxAccessPolicyWindowSize
_NORMAL, _STREAMING, _PERSISTING = 0, 1, 2  # CUaccessProperty


class _Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class _Value(ctypes.Union):
    _fields_ = [("window", _Window), ("pad", ctypes.c_char * 64)]


class L2Window:
    """The persisting-L2 window of one CUDA context (see the module doc)."""

    def __init__(self, cp, device_id: int):
        self.why_not: Optional[str] = None
        self.max_persisting = self.max_window = 0
        self.used = False  # whether a window was set (close then demotes its lines)
        self._set_attr = self._set_limit = None
        if os.environ.get(L2_WINDOW_ENV, "1") == "0":
            self.why_not = f"{L2_WINDOW_ENV}=0"
            return
        try:
            get = cp.cuda.runtime.deviceGetAttribute
            self.max_persisting = int(get(_ATTR_MAX_PERSISTING_L2, device_id))
            self.max_window = int(get(_ATTR_MAX_WINDOW, device_id))
        except Exception as e:  # an older runtime: no such attributes
            self.why_not = f"the device's persisting L2 size cannot be read ({e})"
            return
        if self.max_persisting <= 0 or self.max_window <= 0:
            self.why_not = "the device has no persisting L2 carve-out"
            return
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            set_attr, set_limit, get_limit = lib.cuStreamSetAttribute, lib.cuCtxSetLimit, lib.cuCtxGetLimit
        except (OSError, AttributeError) as e:
            self.why_not = f"no cuStreamSetAttribute / cuCtxSetLimit in the driver ({e})"
            return
        set_attr.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Value)]
        set_limit.argtypes = [ctypes.c_int, ctypes.c_size_t]
        get_limit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
        set_attr.restype = set_limit.restype = get_limit.restype = ctypes.c_int
        self._set_attr, self._set_limit, self._get_limit = set_attr, set_limit, get_limit
        self._reset = getattr(lib, "cuCtxResetPersistingL2Cache", None)

    @property
    def available(self) -> bool:
        return self._set_attr is not None

    def plan(self, nbytes: int) -> Optional[dict]:
        """The window a range of ``nbytes`` gets: bytes covered, hit ratio, carve-out."""
        if not self.available or nbytes <= 0:
            return None
        n = min(int(nbytes), self.max_window)
        carve = min(self.max_persisting, n)
        return {"bytes": n, "hit_ratio": min(1.0, carve / n), "persisting_l2": carve}

    @contextlib.contextmanager
    def around_capture(self, stream, ptr: int, nbytes: int):
        """Within the block, kernels launched or captured on ``stream`` carry a persisting window
        over ``[ptr, ptr + nbytes)``. Yields the window's plan (None: nothing was set, and why
        is in ``why_not``). A driver call that fails leaves the window off, never the run."""
        w = self.plan(nbytes)
        if w is None:
            yield None
            return
        now = ctypes.c_size_t()
        rc = self._get_limit(ctypes.byref(now), _LIMIT_PERSISTING_L2)
        if not rc and now.value < w["persisting_l2"]:
            rc = self._set_limit(_LIMIT_PERSISTING_L2, w["persisting_l2"])
        if rc:
            self.why_not = f"the persisting L2 carve-out cannot be read or set (CUresult {rc})"
            yield None
            return
        if not self._window(stream, ptr, w["bytes"], w["hit_ratio"]):
            yield None
            return
        self.used = True
        try:
            yield w
        finally:
            self._window(stream, 0, 0, 0.0)

    def _window(self, stream, ptr: int, nbytes: int, ratio: float) -> bool:
        v = _Value()
        v.window = _Window(ptr, nbytes, ratio, _PERSISTING if nbytes else _NORMAL,
                           _STREAMING if nbytes else _NORMAL)
        rc = self._set_attr(stream.ptr, _ACCESS_POLICY_WINDOW, ctypes.byref(v))
        if rc:
            self.why_not = f"cuStreamSetAttribute(ACCESS_POLICY_WINDOW) returned CUresult {rc}"
        return not rc

    def close(self) -> None:
        """Demote the lines this context's graphs marked persisting (the context is going away)."""
        if self.used and self._reset is not None:
            self._reset()
        self.used = False
