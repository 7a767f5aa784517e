"""The Environment: process-wide owner of device contexts and of the data-transfer registry.

Follows ONNX Runtime's design of registering data transfers on the Environment (seed PR 26450),
including the lessons of its review: the registry does not depend on any session; the device
context behind a transfer is created lazily on first use and shared by all sessions; teardown
order is defined — sessions, then the environment's registry, then device contexts — and never
raises, also when it runs at interpreter exit.
"""

from __future__ import annotations

import atexit
import importlib
import sys
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from . import dtypes as _dt
from .errors import DeviceError, GpuDelegateError, InputError
from .executor import DeviceContext, DeviceTensor

if TYPE_CHECKING:
    from .session import Session

# kind -> "module:function" (imported lazily: the core never imports a device library itself)
_DEVICE_FACTORIES: Dict[str, Union[str, Callable]] = {
    "reference": "gpudelegate.native.reference:create_context",
    "wgpu": "gpudelegate.native.wgpu_device:create_context",
    "dawn": "gpudelegate.native.dawn_device:create_context",
    "cuda": "gpudelegate.native.cuda_executor:create_context",
    "webgpu": "gpudelegate.web.webgpu:create_context",
}
# The pip extra that brings each device's Python dependencies (pyproject's optional-dependencies).
_EXTRAS = {"reference": "native", "wgpu": "wgpu", "dawn": "dawn", "cuda": "cuda"}
# What "auto" tries, best first. In Pyodide only the browser's WebGPU can exist. Dawn comes before
# wgpu-native where wgpudawn is installed and its adapter is a GPU (a software adapter is passed
# over, as for wgpu): its uploads from host memory and its encoding are the faster ones.
AUTO_ORDER = ("webgpu",) if sys.platform == "emscripten" else ("cuda", "dawn", "wgpu", "reference")


def register_device(kind: str, factory: Union[str, Callable]) -> None:
    """Register a device kind: ``factory(env) -> DeviceContext`` or a ``"module:function"`` path."""
    _DEVICE_FACTORIES[kind] = factory


def device_kinds() -> List[str]:
    return list(_DEVICE_FACTORIES)


def _resolve_factory(kind: str) -> Callable:
    if not isinstance(kind, str):
        raise DeviceError(f"device must be a str ({', '.join(_DEVICE_FACTORIES)} or 'auto'), got {type(kind).__name__}")
    f = _DEVICE_FACTORIES.get(kind)
    if f is None:
        raise DeviceError(f"unknown device {kind!r}; known: {', '.join(_DEVICE_FACTORIES)} (or 'auto')")
    if callable(f):
        return f
    mod, _, fn = f.partition(":")
    try:
        return getattr(importlib.import_module(mod), fn)
    except ImportError as e:
        extra = _EXTRAS.get(kind)
        hint = (f"pip install 'gpudelegate[{extra}]'" if extra else
                "it runs in the browser (Pyodide) only" if kind == "webgpu" else "install what it needs")
        raise DeviceError(f"device {kind!r} is not available here: {e} ({hint})") from None


def host_kind(x: Any) -> str:
    return x.device if isinstance(x, DeviceTensor) else "host"


Transfer = Callable[[Sequence[Any], Sequence[Any]], None]


def _copy_buffers(srcs: Sequence[Any], dsts: Sequence[Any]) -> None:
    """Host-to-host copy through the buffer protocol (numpy arrays, HostTensor.data, bytearrays).
    Also serves devices whose tensors are host memory (the reference executor)."""
    for s, d in zip(srcs, dsts):
        sb = _as_buffer(s)
        db = _as_buffer(d)
        if sb.nbytes != db.nbytes:
            raise GpuDelegateError(f"copy_tensors: {sb.nbytes} source bytes into a {db.nbytes}-byte destination")
        if db.readonly:
            raise GpuDelegateError("copy_tensors: destination is read-only")
        db[:] = sb


def _as_buffer(x: Any) -> memoryview:
    if isinstance(x, DeviceTensor):
        x = x.handle
    if hasattr(x, "data") and not isinstance(x, (bytes, bytearray, memoryview)) and not hasattr(x, "__array_interface__"):
        x = x.data  # HostTensor
    return _dt.byte_view(x)


class DataTransferRegistry:
    """Copies between host and devices, and between devices, registered once per Environment and
    independent of any session. ``copy_tensors`` batches by (source kind, destination kind)."""

    def __init__(self):
        self._fns: Dict[Tuple[str, str], Transfer] = {("host", "host"): _copy_buffers}
        self._lock = threading.RLock()

    def register(self, src_kind: str, dst_kind: str, fn: Transfer) -> None:
        with self._lock:
            self._fns[(src_kind, dst_kind)] = fn

    def can_copy(self, src_kind: str, dst_kind: str) -> bool:
        return (src_kind, dst_kind) in self._fns

    def copy_tensors(self, srcs: Sequence[Any], dsts: Sequence[Any]) -> None:
        if len(srcs) != len(dsts):
            raise GpuDelegateError(f"copy_tensors: {len(srcs)} sources but {len(dsts)} destinations")
        for i, t in enumerate(list(srcs) + list(dsts)):
            if isinstance(t, DeviceTensor):
                t.check_alive(f"copy_tensors: {'source' if i < len(srcs) else 'destination'} "
                              f"{i if i < len(srcs) else i - len(srcs)}")
        groups: Dict[Tuple[str, str], Tuple[list, list]] = {}
        for s, d in zip(srcs, dsts):
            ss, ds = groups.setdefault((host_kind(s), host_kind(d)), ([], []))
            ss.append(s)
            ds.append(d)
        for (a, b), (ss, ds) in groups.items():
            fn = self._fns.get((a, b))
            if fn is None:
                raise DeviceError(f"no data transfer registered from {a!r} to {b!r} "
                                  f"(registered: {sorted(self._fns)})")
            fn(ss, ds)

    def clear(self) -> None:
        with self._lock:
            self._fns = {("host", "host"): _copy_buffers}


_LIVE_ENVS: "weakref.WeakSet[Environment]" = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:  # pragma: no cover - exercised by a subprocess test
    for env in list(_LIVE_ENVS):
        env.close()


class Environment:
    """Process-wide: owns lazily created device contexts and the data-transfer registry, and
    creates sessions. Usable as a context manager; ``close()`` is idempotent and never raises."""

    def __init__(self, device_options: Optional[Dict[str, dict]] = None):
        """``device_options``: keyword arguments for each device kind's context, e.g.
        ``{"dawn": {"toggles": ["allow_unsafe_apis"]}}`` (the contexts this Environment makes)."""
        self.device_options = {k: dict(v) for k, v in (device_options or {}).items()}
        self._lock = threading.RLock()
        self._contexts: Dict[str, DeviceContext] = {}
        self._context_locks: Dict[str, threading.RLock] = {}
        self._sessions: "weakref.WeakSet" = weakref.WeakSet()
        self.data_transfer = DataTransferRegistry()
        self.closed = False
        self.auto_skipped: List[str] = []  # why the last "auto" passed over each device it skipped
        _LIVE_ENVS.add(self)

    # ------------------------------------------------------------------ devices
    def context(self, kind: str) -> DeviceContext:
        """The shared context of ``kind``, created on first use."""
        if not isinstance(kind, str):
            raise DeviceError(f"device must be a str ({', '.join(_DEVICE_FACTORIES)} or 'auto'), got {type(kind).__name__}")
        with self._lock:
            if self.closed:
                raise GpuDelegateError("this Environment is closed")
            ctx = self._contexts.get(kind)
            if ctx is None:
                factory = _resolve_factory(kind)
                try:
                    ctx = factory(self, **self.device_options.get(kind, {}))
                except GpuDelegateError:
                    raise
                except Exception as e:  # a device library failing to start is a DeviceError
                    raise DeviceError(f"could not start device {kind!r}: {type(e).__name__}: {e}") from e
                self._contexts[kind] = ctx
                self._context_locks[kind] = threading.RLock()
                reg = getattr(ctx, "register_transfers", None)
                if reg is not None:
                    reg(self.data_transfer)
            return ctx

    def context_lock(self, kind: str) -> threading.RLock:
        return self._context_locks[kind]

    def has_context(self, kind: str) -> bool:
        return kind in self._contexts

    def resolve_device(self, device: str) -> str:
        """``"auto"`` -> the best device that starts here (``auto_skipped`` then says why each
        device before it was passed over); anything else is checked by starting it."""
        self.auto_skipped = []
        if device != "auto":
            self.context(device)
            return device
        reasons = []
        for i, kind in enumerate(AUTO_ORDER):
            try:
                ctx = self.context(kind)
            except DeviceError as e:
                reasons.append(f"{kind}: {e}")
                continue
            if ctx.info().get("software") and i < len(AUTO_ORDER) - 1:
                # a software adapter runs the same kernels on the CPU, slower than the reference
                reasons.append(f"{kind}: a software adapter ({ctx.info().get('device') or 'CPU'}),"
                               f" slower than the reference executor")
                continue
            self.auto_skipped = reasons
            return kind
        raise DeviceError("no device could be started: " + "; ".join(reasons))

    # ------------------------------------------------------------------ sessions
    def session(self, program, device: str = "auto", weight_budget: Optional[int] = None,
                prefetch_depth: int = 2, pinned: Sequence[str] = (), progress=None,
                methods: Optional[Sequence[str]] = None, phase=None, precision: str = "exact",
                **executor_options) -> "Session":
        """Create and build a session of ``program`` (a Program, a path, or bytes) on ``device``.
        ``progress(done, total)`` reports prepack bytes, ``phase(name)`` each build phase as it
        starts (``Session.build``). ``precision``: ``"exact"`` (default) or ``"fast"``, which lets
        the WebGPU executor run products with float16 inputs and float32 accumulation (tensor
        cores through subgroup matrices where the device has them); the reference and CUDA
        executors compute exactly either way (``session.PRECISIONS``); another value raises
        InputError."""
        import os

        from .program import Program, load, loads
        from .session import Session

        if isinstance(program, (bytes, bytearray, memoryview)):
            program = loads(program)
        elif isinstance(program, (str, os.PathLike)):
            program = load(program)
        elif not isinstance(program, Program):
            raise InputError(f"session() takes a Program, a file path or the file's bytes, got {type(program).__name__}")
        if progress is not None and not callable(progress):
            raise InputError(f"progress must be a callable(done, total) or None, got {type(progress).__name__}")
        if phase is not None and not callable(phase):
            raise InputError(f"phase must be a callable(name) or None, got {type(phase).__name__}")
        kind = self.resolve_device(device)
        s = Session(self, program, kind, weight_budget=weight_budget, prefetch_depth=prefetch_depth,
                    pinned=pinned, methods=methods, executor_options=executor_options, precision=precision)
        with self._lock:
            self._sessions.add(s)
        s.build(progress=progress, phase=phase)
        return s

    def _forget(self, session) -> None:
        with self._lock:
            self._sessions.discard(session)

    def copy_tensors(self, srcs: Sequence[Any], dsts: Sequence[Any]) -> None:
        """Batched copies host<->device and device<->device through the registry."""
        self.data_transfer.copy_tensors(srcs, dsts)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Sessions first, then the transfer registry, then device contexts. Never raises."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            sessions = list(self._sessions)
        for s in sessions:
            try:
                s.close()
            except Exception as e:  # teardown must not raise; say what happened
                warnings.warn(f"gpudelegate: closing a session failed: {e!r}")
        self.data_transfer.clear()
        with self._lock:
            contexts = list(self._contexts.items())
            self._contexts.clear()
        for kind, ctx in reversed(contexts):
            try:
                ctx.close()
            except Exception as e:
                warnings.warn(f"gpudelegate: closing device {kind!r} failed: {e!r}")
        _LIVE_ENVS.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_DEFAULT: Optional[Environment] = None


def default_environment() -> Environment:
    """The process's shared Environment (created on first use)."""
    global _DEFAULT
    if _DEFAULT is None or _DEFAULT.closed:
        _DEFAULT = Environment()
    return _DEFAULT
