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

The step's timeline (:class:`Timeline`, ``GPUDELEGATE_CUDA_TIMELINE=1`` when a context is made; off
by default): the kernels of that context compile with ``GD_TIMELINE`` (shaders/cuda_common.cu), so
each takes one more argument, its launch's record, which :class:`PdlKernel` appends; while the
timeline is armed, every launch captured into a graph gets a record of its own, in capture order,
into which each replay stamps %globaltimer: the first block's start, the first and last return
from the wait, the last block's end. For probes (benchmarks/probe_cuda_graph.py ``--timeline``).
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import numpy as np

from gpudelegate.errors import DeviceError

PDL_ENV = "GPUDELEGATE_CUDA_PDL"
TIMELINE_ENV = "GPUDELEGATE_CUDA_TIMELINE"
TIMELINE_SM_SLOTS = 256  # a record's slots, one per SM (%smid modulo this; cuda_common.cu GD_TIMELINE)
TIMELINE_DEFINE = f"#define GD_TIMELINE {TIMELINE_SM_SLOTS}\n"
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


class Timeline:
    """Per-launch %globaltimer stamps of captured launches (see the module docstring).

    ``stamps`` [capacity, TIMELINE_SM_SLOTS, 4] uint64 on the device, row i the i-th launch
    captured while armed, a slot per SM of: the first block's start, the first and the last
    return from grid_dep_wait, the last block's end (ns; :meth:`reset` before each replay: mins
    start at the largest value, maxes at 0). :meth:`reduce` gives a launch's four values over its
    slots. ``launches`` holds (CUfunction address, grid, block) of each row. Launches not
    captured, or captured while disarmed, get a null record and stamp nothing."""

    FIELDS = ("start", "wait_first", "wait_last", "end")

    def __init__(self, cp, capacity: int = 1024):
        self.cp = cp
        self.capacity = capacity
        self.stamps = cp.empty((capacity, TIMELINE_SM_SLOTS, len(self.FIELDS)), cp.uint64)
        self.launches: list = []
        self.armed = False
        self.reset()

    def arm(self) -> None:
        """Records from the next captured launch on, from row 0."""
        self.launches = []
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def record(self, func, grid, block) -> int:
        """The device address of the next row for a launch being captured (0 while disarmed)."""
        if not self.armed:
            return 0
        i = len(self.launches)
        if i >= self.capacity:
            raise DeviceError(f"cuda timeline: more than {self.capacity} launches captured while armed")
        self.launches.append((int(func.kernel.ptr), _dims(grid), _dims(block)))
        return self.stamps.data.ptr + i * self.stamps.strides[0]

    def reset(self, rows: Optional[int] = None) -> None:
        """The first ``rows`` records (all: None) back to (max, max, 0, 0), on the current stream."""
        s = self.stamps[:rows]
        s[..., :2].fill(np.uint64(0xFFFFFFFFFFFFFFFF))
        s[..., 2:].fill(np.uint64(0))

    @staticmethod
    def reduce(raw: np.ndarray) -> np.ndarray:
        """[..., slots, 4] uint64 records (host) -> [..., 4] int64: the min of the starts and first
        waits, the max of the last waits and ends over the SM slots (a launch nothing stamped
        reads start -1, end 0)."""
        lo, hi = raw[..., :2].min(axis=-2), raw[..., 2:].max(axis=-2)
        return np.concatenate([lo, hi], axis=-1).astype(np.int64)


class PdlLauncher:
    """cuLaunchKernelEx with the programmatic-serialization attribute, for one process; and the
    timeline switch of the kernels compiled for it (``prelude``: what their source begins with)."""

    def __init__(self, cp):
        self.cp = cp
        self.launches = 0  # launches made with the attribute (tests, probes)
        self.fallbacks = 0  # captured launches that went the ordinary way (an argument it cannot pack)
        self._fn = None
        self.why_not: Optional[str] = None
        # read once: the kernels' argument lists depend on it, so it may not change under them
        self.timeline: Optional[Timeline] = Timeline(cp) if os.environ.get(TIMELINE_ENV, "0") == "1" else None
        self.prelude = TIMELINE_DEFINE if self.timeline is not None else ""
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
        launcher = self.launcher
        stream = launcher.cp.cuda.get_current_stream()
        capturing = stream.is_capturing()
        if launcher.timeline is not None:  # the kernel was compiled with its record argument
            args = (*args, np.uint64(launcher.timeline.record(self.func, grid, block) if capturing else 0))
        if capturing and launcher.available and launcher.launch(self.func, grid, block, args, shared_mem, stream):
            return
        self.func(grid, block, args, shared_mem=shared_mem)

    def __getattr__(self, name):  # the RawKernel's attributes (num_regs, ...), read-only here
        return getattr(self.func, name)


def wrap(func, launcher: Optional[PdlLauncher]):
    """``func`` as a :class:`PdlKernel` where PDL is available or the timeline is on (its record
    argument is then appended to every launch), else ``func`` itself."""
    if launcher is not None and (launcher.available or launcher.timeline is not None):
        return PdlKernel(func, launcher)
    return func
