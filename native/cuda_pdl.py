"""Programmatic dependent launch (PDL) for the kernels a CUDA graph captures.

Between two dependent kernels of a captured decode step the GPU idles while the second one is
launched and its blocks are scheduled: a SmolLM2 step of 217 kernels spent ~250 of ~890 us outside
any kernel on an H200 (docs/NOTES.md). A kernel launched with the attribute
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` may start before the kernel ahead of it
in the stream has finished; it must then wait (``griddepcontrol.wait``) before it reads what that
kernel wrote. Every kernel of shaders/cuda_*.cu calls ``grid_dep_wait()`` before it reads memory a
kernel of the run writes, so an early start overlaps the launch, the scheduling and, in the packed
products, the first loads of their constant weights (shaders/cuda_common.cu states the rule); a graph captured from such
launches keeps the programmatic edges (CUDA 12.3+ drivers).

CuPy cannot set launch attributes, so :class:`PdlKernel` launches through the driver's
``cuLaunchKernelEx`` (ctypes on libcuda) while its stream is being captured, and through CuPy
otherwise (eager runs gain nothing from it and would pay ctypes' packing per launch). Arguments
it cannot pack exactly as CuPy would (anything but CuPy arrays, memory pointers and numpy
scalars), a device older than compute capability 9.0, a driver without ``cuLaunchKernelEx``, or
``GPUDELEGATE_CUDA_PDL=0`` keep the ordinary launch.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import numpy as np

from gpudelegate.errors import DeviceError

PDL_ENV = "GPUDELEGATE_CUDA_PDL"
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("allowed", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
            np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
            np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double,
            np.dtype(np.int16): ctypes.c_int16, np.dtype(np.uint16): ctypes.c_uint16,
            np.dtype(np.int8): ctypes.c_int8, np.dtype(np.uint8): ctypes.c_uint8}


def _dims(d) -> tuple:
    d = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    return tuple(int(x) for x in d) + (1,) * (3 - len(d))


class PdlLauncher:
    """cuLaunchKernelEx with the programmatic-serialization attribute, for one process."""

    def __init__(self, cp):
        self.cp = cp
        self.launches = 0  # launches made with the attribute (tests, probes)
        self.fallbacks = 0  # captured launches that went the ordinary way (an argument it cannot pack)
        self._fn = None
        self.why_not: Optional[str] = None
        if os.environ.get(PDL_ENV, "1") == "0":
            self.why_not = f"{PDL_ENV}=0"
            return
        try:
            major = cp.cuda.Device().compute_capability
            if int(major[:-1] if len(major) > 2 else major[0]) < 9:
                self.why_not = f"compute capability {major} (PDL needs 9.0)"
                return
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuLaunchKernelEx
        except (OSError, AttributeError) as e:
            self.why_not = f"no cuLaunchKernelEx in the driver ({e})"
            return
        fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._attr = _Attr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attr.value.allowed = 1

    @property
    def available(self) -> bool:
        return self._fn is not None

    def _pack(self, args):
        """ctypes values of ``args`` as CuPy passes them, or None where one is of another kind."""
        cp = self.cp
        vals = []
        for a in args:
            if isinstance(a, cp.ndarray):
                vals.append(ctypes.c_void_p(a.data.ptr))
            elif isinstance(a, cp.cuda.MemoryPointer):
                vals.append(ctypes.c_void_p(a.ptr))
            elif isinstance(a, np.generic) and a.dtype in _SCALARS:
                vals.append(_SCALARS[a.dtype](a.item()))
            else:
                return None
        return vals

    def launch(self, func, grid, block, args, shared_mem: int, stream) -> bool:
        """Launch ``func`` (a CuPy RawKernel) on ``stream`` with the attribute; False (nothing
        launched) where an argument cannot be packed."""
        vals = self._pack(args)
        if vals is None:
            self.fallbacks += 1
            return False
        ptrs = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        gx, gy, gz = _dims(grid)
        bx, by, bz = _dims(block)
        cfg = _Config(gx, gy, gz, bx, by, bz, int(shared_mem), ctypes.c_void_p(stream.ptr),
                      ctypes.pointer(self._attr), 1)
        err = self._fn(ctypes.byref(cfg), ctypes.c_void_p(func.kernel.ptr), ptrs, None)  # RawKernel -> CUfunction
        if err:
            raise DeviceError(f"cuda: a programmatic dependent launch of {getattr(func, 'name', '?')} failed "
                              f"(CUresult {err}); {PDL_ENV}=0 launches without it")
        self.launches += 1
        return True


class PdlKernel:
    """A CuPy RawKernel that launches with PDL while its stream is being captured (see the module
    docstring); callable like the Function itself."""

    __slots__ = ("func", "launcher")

    def __init__(self, func, launcher: PdlLauncher):
        self.func = func
        self.launcher = launcher

    def __call__(self, grid, block, args, shared_mem: int = 0):
        stream = self.launcher.cp.cuda.get_current_stream()
        if stream.is_capturing() and self.launcher.launch(self.func, grid, block, args, shared_mem, stream):
            return
        self.func(grid, block, args, shared_mem=shared_mem)

    def __getattr__(self, name):  # the RawKernel's attributes (num_regs, ...), read-only here
        return getattr(self.func, name)


def wrap(func, launcher: Optional[PdlLauncher]):
    """``func`` as a :class:`PdlKernel` where PDL is available, else ``func`` itself."""
    return PdlKernel(func, launcher) if launcher is not None and launcher.available else func
