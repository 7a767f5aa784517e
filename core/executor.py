"""The executor interface: the per-device part that carries out a plan.

Every executor (numpy reference, wgpu, browser WebGPU, CUDA) implements the same steps, called by
``Session.build`` in the order of the build phases (docs/ARCHITECTURE.md):

1. ``allocate(plan)``: arena memory objects of every payload plan, resident constant buffers
   (prepack destinations), the offload slot ring and host mirrors of streamed weights;
2. ``record(plan)``: pipelines, bind groups / kernel launch lists, made once and reused;
3. ``prepack(plan, progress)``: one-time constant uploads and pack kernels, chunk by chunk
   (``plan.prepack.chunks``), queued before the first run; ``progress(done_bytes, total_bytes)``;
4. ``run(payload, inputs, keep_on_device)``: write inputs (or bind device tensors), replay the
   chain (streaming offloaded weights per ``plan.offload.loads[payload]``), return outputs.

Device contexts (adapter/device, CUDA device and streams) belong to the Environment, never to a
session or an executor: an executor borrows its context and must not close it.
"""

from __future__ import annotations

import abc
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import dtypes as _dt
from .errors import DeviceError, GpuDelegateError, InputError
from .plan.types import DeviceLimits, PayloadPlan, SessionPlan
from .program import Program

Progress = Optional[Callable[[int, int], None]]


@dataclass
class HostTensor:
    """A numpy-free host tensor (the browser has no numpy): dtype, shape and a bytes-like buffer
    in the dtype's storage format (see ``dtypes.STRUCT_FORMAT``)."""

    dtype: str
    shape: tuple
    data: Any  # bytes, bytearray, memoryview

    @property
    def nbytes(self) -> int:
        return _dt.nbytes(self.dtype, self.shape)

    def tolist(self) -> list:
        mv = _dt.byte_view(self.data).cast(_dt.STRUCT_FORMAT[self.dtype])
        flat = mv.tolist()
        if self.dtype == "bool":
            flat = [bool(x) for x in flat]
        for d in reversed(self.shape[1:]):
            flat = [flat[i:i + d] for i in range(0, len(flat), d)]
        return flat if self.shape else flat[0]


@dataclass
class DeviceTensor:
    """A tensor left on a device (IO binding). Valid until the producing session's next run of
    the same payload, or until ``owner`` is closed. Feeding it back as the same method input is
    zero-copy when it already sits at the planned location (e.g. a KV cache).

    A tensor knows whether its memory still exists (``alive``): once the executor that made it is
    closed (its session or Environment closed), its buffers are freed, and reading it, passing it
    to a session or copying it raises DeviceError instead of reaching the device library with a
    destroyed buffer (wgpu-native aborts the process on that, with no Python exception)."""

    owner: "Executor"
    dtype: str
    shape: tuple
    handle: Any  # executor-specific: (buffer, offset) on wgpu, a cupy array on CUDA, ...
    nbytes: int = 0

    @property
    def device(self) -> str:
        return self.owner.kind

    @property
    def alive(self) -> bool:
        """False once the owning executor is closed (its buffers are gone)."""
        return not getattr(self.owner, "closed", False)

    def check_alive(self, what: str = "device tensor") -> None:
        if not self.alive:
            raise DeviceError(f"{what}: this {self.device} tensor {self.dtype}{list(self.shape)} belongs to a closed "
                              f"session (its device memory is freed); keep the session open while you use its "
                              f"outputs, or run without keep_on_device to get host arrays")

    def numpy(self):
        self.check_alive()
        return self.owner.to_host(self)


@dataclass
class IndexTensor(DeviceTensor):
    """``Executor.argmax_device``'s result where the executor reads the index back on its own
    schedule: an int32 [1, 1] DeviceTensor (fed to the next decode step as its ``ids``) plus
    ``read``, the executor's pending read of its value, submitted with the argmax itself so that
    it does not wait for work submitted later (``Executor.index_value`` resolves it once and keeps
    ``value``). The device buffer is shared by the executor's argmaxes (the next one overwrites
    it, in queue order); the value read here is this argmax's."""

    read: Any = None
    value: Optional[int] = None


def first_max(values: List[float]) -> int:
    """Index of the first largest value, NaN counting as the largest (torch.argmax's rule)."""
    for i, v in enumerate(values):
        if v != v:
            return i
    return values.index(max(values))


class Executor(abc.ABC):
    """Base class of every executor. ``kind`` names the device context it runs on."""

    kind: str = "abstract"

    def __init__(self, context: "DeviceContext", program: Program):
        self.context = context
        self.program = program
        self.plan: Optional[SessionPlan] = None
        self.closed = False

    @property
    def limits(self) -> DeviceLimits:
        return self.context.limits

    prepacked = False  # set by prepack(); run() before it is a usage error

    def begin_run(self, payload: int, inputs: Sequence[Any]) -> "PayloadPlan":
        """The checks every executor's ``run`` starts with; returns the payload's plan."""
        if self.closed:
            raise GpuDelegateError(f"{self.kind} executor: run after close")
        if not self.prepacked:
            raise GpuDelegateError(f"{self.kind} executor: run before prepack")
        pp = self.plan.payloads.get(payload) if self.plan is not None else None
        if pp is None:
            planned = sorted(self.plan.payloads) if self.plan is not None else []
            raise InputError(f"payload {payload} is not planned in this session (planned: {planned})")
        if len(inputs) != len(pp.inputs):
            raise InputError(f"payloads[{payload}]: expected {len(pp.inputs)} inputs, got {len(inputs)}")
        return pp

    @abc.abstractmethod
    def allocate(self, plan: SessionPlan) -> None: ...

    @abc.abstractmethod
    def record(self, plan: SessionPlan) -> None: ...

    @abc.abstractmethod
    def prepack(self, plan: SessionPlan, progress: Progress = None) -> None: ...

    @abc.abstractmethod
    def run(self, payload: int, inputs: Sequence[Any], keep_on_device: bool = False) -> List[Any]:
        """``inputs`` are host arrays (numpy or HostTensor, already checked by the session against
        the payload's input refs) or DeviceTensors; returns host arrays, or DeviceTensors when
        ``keep_on_device``."""

    @abc.abstractmethod
    def to_host(self, t: DeviceTensor) -> Any: ...

    def argmax(self, t: DeviceTensor) -> int:
        """Flat index of the largest value of a device tensor (the first on ties; NaN counts as
        the largest, as in torch.argmax): a greedy decode's pick. This reads the tensor back and
        asks the host array (numpy, or the page's tensor) for it; an executor that can reduce on
        its device overrides it and reads back one index."""
        t.check_alive("argmax")
        check_argmax_input(t)
        host = self.to_host(t)
        if hasattr(host, "argmax"):
            return int(host.argmax())
        return first_max(_dt.byte_view(host.data).cast(_dt.STRUCT_FORMAT[host.dtype]).tolist())

    #: Decode steps a greedy generation loop may submit before it reads the token of the step
    #: before (``gpudelegate.llm``): worth it only where reading one token's index does not wait
    #: for later work (a staging buffer per token mapped after its own submission on WebGPU, an
    #: event per token on CUDA); 0 elsewhere.
    greedy_lookahead: int = 0

    def argmax_device(self, t: DeviceTensor) -> Any:
        """The greedy pick of ``t`` (the flat index of its largest value, torch.argmax's rule as
        :meth:`argmax`) as an int32 [1, 1] tensor this executor's sessions accept as an input
        (a decode step's ``ids``), without the host waiting for it where the executor can: a
        DeviceTensor (an :class:`IndexTensor` on WebGPU) produced on the device. Its value comes
        from :meth:`index_value`. This base reduces on the host (:meth:`argmax`) and returns a
        HostTensor. An empty tensor is an InputError."""
        if not isinstance(t, DeviceTensor):
            raise InputError(f"argmax_device: expected a DeviceTensor of this session, got {type(t).__name__}")
        t.check_alive("argmax_device")
        check_argmax_input(t)
        return HostTensor("int32", (1, 1), struct.pack("<i", self.argmax(t)))

    def index_value(self, x: Any) -> int:
        """The int of an :meth:`argmax_device` result (waits for the device where it must)."""
        if isinstance(x, DeviceTensor):
            x.check_alive("index_value")
            x = x.owner.to_host(x)
        if hasattr(x, "ravel"):  # numpy
            return int(x.ravel()[0])
        if isinstance(x, HostTensor) and x.dtype == "int32" and _dt.numel(tuple(x.shape)) == 1:
            return struct.unpack_from("<i", _dt.byte_view(x.data))[0]
        raise InputError(f"index_value: expected an int32 tensor of one element, got {type(x).__name__}"
                         f"{' ' + x.dtype + str(list(x.shape)) if isinstance(x, HostTensor) else ''}")

    async def index_value_async(self, x: Any) -> int:
        """:meth:`index_value` for callers that must not block (the browser)."""
        return self.index_value(x)

    def close(self) -> None:
        """Free this executor's buffers. Idempotent, never raises."""
        self.closed = True


def check_argmax_input(t: DeviceTensor) -> None:
    """An argmax needs at least one value (torch.argmax raises on an empty tensor too)."""
    if _dt.numel(tuple(t.shape)) == 0:
        raise InputError(f"argmax of an empty {t.dtype}{list(t.shape)} tensor")


class DeviceContext(abc.ABC):
    """One device (adapter+device, a CUDA device, the numpy 'device'), created lazily by the
    Environment and shared by all its sessions."""

    kind: str = "abstract"

    @property
    @abc.abstractmethod
    def limits(self) -> DeviceLimits: ...

    @abc.abstractmethod
    def create_executor(self, program: Program, **options) -> Executor:
        """A new executor for one session (``options``: executor-specific, e.g. ``profile``)."""

    def info(self) -> dict:
        return {"kind": self.kind}

    def close(self) -> None:
        """Release the device. Idempotent, never raises."""


# dtype object -> its name. numpy's ``dtype.name`` is computed in Python on every access (~8 us,
# most of a decode step's input checks); dtype objects are few and hashable, so name each once.
_DTYPE_NAMES: Dict[Any, str] = {}


def _dtype_name(dt) -> str:
    name = getattr(dt, "name", None) or str(dt)
    name = name.rsplit(".", 1)[-1]  # torch dtypes print as "torch.float32"
    try:
        if len(_DTYPE_NAMES) < 256:
            _DTYPE_NAMES[dt] = name
    except TypeError:
        pass
    return name


def check_host_input(path: str, x: Any, dtype: str, shape: tuple) -> None:
    """Shape/dtype check of one host or device input against the method's (numpy-free: reads
    ``.shape`` and ``.dtype``, which numpy arrays, HostTensor and DeviceTensor all provide)."""
    got_shape = tuple(getattr(x, "shape", ()))
    dt = getattr(x, "dtype", None)
    if dt is None:
        raise InputError(f"{path}: expected an array with .shape and .dtype, got {type(x).__name__}")
    try:
        name = _DTYPE_NAMES[dt]
    except (KeyError, TypeError):  # TypeError: an unhashable dtype object
        name = _dtype_name(dt)
    mapped = _dt.HOST_ALIASES.get(name)
    if got_shape != tuple(shape):
        raise InputError(f"{path}: shape {list(got_shape)} does not match the method's {list(shape)}")
    floats = _dt.FLOAT_DTYPES
    if mapped != dtype and not (dtype in floats and mapped in floats):  # executors convert floats
        raise InputError(f"{path}: dtype {name} does not match the method's {dtype}")
