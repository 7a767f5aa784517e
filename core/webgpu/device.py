"""The device protocol: the WebGPU calls the executor makes, and nothing else.

One :class:`GPUDevice` per Environment (it is the Environment's device context): an adapter
implements it over a WebGPU implementation, and :class:`~gpudelegate.webgpu.executor.WebGPUExecutor`
runs on any adapter. Two exist: ``gpudelegate.native.wgpu_device`` (wgpu-py: wgpu-native, or Dawn
through wgpudawn) and ``gpudelegate.web.webgpu`` (the browser's ``navigator.gpu`` through Pyodide's
``js``). The model is tinygrad's ``Allocator`` (a shared core; ``_alloc``/``_copyin``/``_copyout``
implemented by each runtime) and wgpu-py's backends (one spec-named API, chosen by platform).

Names follow the WebGPU spec (snake_case as in wgpu-py): ``create_buffer``, ``write_buffer``
(``GPUQueue.writeBuffer``), ``create_shader_module``, ``create_bind_group_layout``,
``create_pipeline_layout``, ``create_compute_pipeline``, ``create_bind_group``, ``destroy``
(``GPUBuffer.destroy``). Buffer usages are the spec's ``GPUBufferUsage`` bit values, the same
numbers in every implementation (:class:`BufferUsage`).

What is not a single spec call is marked NON-SPEC with the reason; each exists because the two
runtimes reach the same effect through very different fast paths:

- ``record_chain`` / ``run_chain`` / ``run_chain_async``: a payload's run is the same commands
  every time. The browser replays them in one JavaScript call (one Python -> JS crossing per
  run instead of five per dispatch); the desktop encodes the next run's command buffer while the
  GPU works and calls wgpu-native's pass functions without wgpu-py's per-call error proxies.
- ``upload`` / ``flush_uploads``: bulk host -> device copies of constants. The desktop stages
  them through a ring of persistent mapped buffers (``queue.writeBuffer`` allocates staging
  memory per call); the browser writes typed-array views of the fetched file with
  ``writeBuffer`` (no copy through the WebAssembly heap).
- ``write_mapped``: fill a buffer created ``mapped_at_creation`` and unmap it
  (``getMappedRange`` + a copy + ``unmap``: three calls whose array types differ per runtime).
- ``float16_bytes``: float32 -> float16 on the host for weights that stay in host memory
  (streamed weights; everything resident is packed on the GPU). numpy on the desktop,
  ``Float16Array`` in the browser: the core has neither.
- ``fence``: wait until the queue is idle (``onSubmittedWorkDone``, which wgpu-py 0.32 cannot
  call: the desktop maps a marker buffer instead).
- host conversions (``host_bytes``, ``host_array``): inputs and outputs are numpy arrays on the
  desktop and :class:`~gpudelegate.executor.HostTensor` in the browser.

Everything else (buffers of a plan, uniforms, bind groups and their overlap checks, sibling
placement, offload loads, fp16 packing, read-back layout, IO binding) is the executor's, written
once.
"""

from __future__ import annotations

import abc
import threading
from typing import Any, Dict, List, Tuple

from gpudelegate import shaders
from gpudelegate.errors import DeviceError
from gpudelegate.executor import DeviceContext
from gpudelegate.plan.types import DeviceLimits

from .commands import STORAGE_USAGE, BufferUsage, Copy, Launch, RunIO, Step, round4  # noqa: F401  (the protocol's vocabulary)
from .executor import WebGPUExecutor, transfer
from .kernel import SUBGROUP_FEATURES


_ENABLE_SUBGROUPS = "enable subgroups;"


def wgsl_dialect(code: str, features) -> str:
    """``code`` as this device's WGSL front end takes it. The kernels are written in WebGPU's
    WGSL, where subgroup built-ins need ``enable subgroups;`` (Tint: Dawn, browsers).
    wgpu-native 0.32's naga rejects that line ("not yet supported") and offers the built-ins
    with its own feature ``subgroup`` instead: its modules get the line commented out (line
    numbers in compile errors stay the file's)."""
    if "subgroup" in features and "subgroups" not in features and _ENABLE_SUBGROUPS in code:
        return "\n".join("// " + line if line.strip() == _ENABLE_SUBGROUPS else line for line in code.split("\n"))
    return code


class GPUDevice(DeviceContext):
    """A WebGPU device as the executor sees it. Subclasses fill in the spec calls and the NON-SPEC
    fast paths; the pipeline, layout and shader-module caches every session shares are here."""

    kind = "webgpu"
    #: the adapter's subgroup-matrix shapes (feature ``chromium-experimental-subgroup-matrix``) as
    #: ``{"component": "f16", "result": "f32", "M": 16, "N": 16, "K": 16}`` dicts; the lowering
    #: reads them (with ``features``) when it picks kernels, never at run time
    subgroup_matrix_configs: Tuple[dict, ...] = ()
    #: ``(wgsl source name) -> code``; a test may point it elsewhere
    source = staticmethod(shaders.source)

    def __init__(self, limits: DeviceLimits, features, uniform_alignment: int, is_fallback_adapter: bool):
        self._limits = limits
        self.features = frozenset(features)
        self.uniform_alignment = int(uniform_alignment)
        self.is_fallback_adapter = bool(is_fallback_adapter)
        self._modules: Dict[str, Any] = {}
        self._layouts: Dict[tuple, tuple] = {}
        self._pipelines: Dict[tuple, Any] = {}
        self._cache_lock = threading.RLock()  # sessions on several threads share the caches
        self._subgroup_size = None  # subgroup_size(), measured once
        self.closed = False

    @property
    def limits(self) -> DeviceLimits:
        return self._limits

    def create_executor(self, program, **options):
        unknown = set(options) - {"profile", "tuning", "precision"}
        if unknown:
            raise TypeError(f"{self.kind} executor: unknown options {sorted(unknown)} (known: profile, tuning, precision)")
        return WebGPUExecutor(self, program, **options)

    def register_transfers(self, registry) -> None:
        for pair in (("host", self.kind), (self.kind, "host"), (self.kind, self.kind)):
            registry.register(*pair, transfer)

    # ------------------------------------------------------------------ spec calls
    @abc.abstractmethod
    def create_buffer(self, size: int, usage: int, label: str = "", mapped_at_creation: bool = False) -> Any: ...

    def destroy(self, buffer) -> None:
        """``GPUBuffer.destroy()`` (the same call in wgpu-py and JS); never raises (teardown)."""
        try:
            buffer.destroy()
        except Exception:
            pass

    @abc.abstractmethod
    def write_buffer(self, buffer, offset: int, data) -> None:
        """``GPUQueue.writeBuffer``: ``data`` is a Python buffer whose size is a multiple of 4."""

    @abc.abstractmethod
    def create_shader_module(self, code: str, label: str) -> Any: ...

    @abc.abstractmethod
    def create_bind_group_layout(self, entries: List[dict]) -> Any:
        """``entries``: spec dicts {binding, visibility: "compute", buffer: {type}}."""

    @abc.abstractmethod
    def create_pipeline_layout(self, bind_group_layouts: List[Any]) -> Any: ...

    @abc.abstractmethod
    def create_compute_pipeline(self, layout, module, entry_point: str, constants: dict, label: str) -> Any: ...

    @abc.abstractmethod
    def create_bind_group(self, layout, entries: List[Tuple[int, Any, int, int]], label: str) -> Any:
        """``entries``: (binding, buffer, offset, size) of buffer bindings."""

    # ------------------------------------------------------------------ NON-SPEC (see the module doc)
    @abc.abstractmethod
    def record_chain(self, steps: List[Step]) -> Any:
        """Prepare ``steps`` for replay; returns the adapter's chain object."""

    @abc.abstractmethod
    def run_chain(self, chain, io: RunIO, profile: bool = False):
        """Submit ``io``'s writes and copies, the chain, and the read-back; wait for it when
        ``io.reads`` is not None. Returns the read-back bytes, one bytes-like per read (or [] when
        not reading), and with ``profile`` also [(op, node, seconds)] GPU time per step."""

    async def run_chain_async(self, chain, io: RunIO, profile: bool = False):
        """``run_chain`` for callers that await (the browser without JSPI)."""
        return self.run_chain(chain, io, profile)

    @abc.abstractmethod
    def upload(self, buffer, offset: int, data) -> None:
        """Queue a bulk copy of ``data`` (a constant view, of any size) into ``buffer``; ordered
        before later submissions once ``flush_uploads`` ran."""

    def flush_uploads(self) -> None:
        """Submit uploads the adapter still holds back."""

    def discard_uploads(self) -> None:
        """Drop uploads not yet submitted (their caller failed)."""

    @abc.abstractmethod
    def write_mapped(self, buffer, data) -> None:
        """Fill a buffer made ``mapped_at_creation`` with ``data`` (at offset 0) and unmap it."""

    @abc.abstractmethod
    def float16_bytes(self, data, count: int) -> Any:
        """``count`` float32 values of ``data`` as float16 bytes (round to nearest even)."""

    @abc.abstractmethod
    def fence(self) -> None:
        """Block until everything submitted so far has run."""

    def released(self) -> None:
        """An executor destroyed its buffers (its session closed). A backend that frees destroyed
        memory lazily, inside later submits, does it here instead, in the closing session."""

    @abc.abstractmethod
    def host_bytes(self, x, dtype: str, nbytes: int, where: str):
        """A host input (numpy array, HostTensor, buffer) as ``nbytes`` of ``dtype`` storage
        (bool as uint32 0/1, int64 narrowed to int32 when every value fits: InputError if not)."""

    @abc.abstractmethod
    def host_array(self, data, dtype: str, shape: tuple):
        """Read-back bytes of one output as what the caller gets (numpy array or HostTensor)."""

    def check(self, where: str = "") -> None:
        """Raise DeviceError for errors the device reported since the last check (lost device,
        uncaptured validation errors)."""

    # ------------------------------------------------------------------ caches shared by sessions
    def _made(self, what: str, make):
        """``make()``, with a device library's own exception turned into a DeviceError naming
        ``what`` (a WGSL compile error, a refused pipeline)."""
        try:
            return make()
        except DeviceError:
            raise
        except Exception as e:
            raise DeviceError(f"{self.kind}: {what} failed: {e}") from None

    def module(self, name: str):
        m = self._modules.get(name)
        if m is None:
            code = wgsl_dialect(self.source(name), self.features)
            m = self._modules[name] = self._made(f"compiling shader {name}",
                                                 lambda: self.create_shader_module(code, name))
        return m

    def layout(self, slots: Tuple[int, ...]):
        """(bind group layout, pipeline layout): binding 0 uniform + read_write storage ``slots``
        (the lowering's convention)."""
        lay = self._layouts.get(slots)
        if lay is None:
            entries = [{"binding": 0, "visibility": "compute", "buffer": {"type": "uniform"}}]
            entries += [{"binding": s, "visibility": "compute", "buffer": {"type": "storage"}} for s in slots]
            bgl = self.create_bind_group_layout(entries)
            lay = (bgl, self.create_pipeline_layout([bgl]))
            self._layouts[slots] = lay
        return lay

    def pipeline(self, call):
        """The compute pipeline of a lowering ``KernelCall``, cached by its pipeline key."""
        key = call.pipeline_key
        with self._cache_lock:
            return self._pipelines.get(key) or self._make_pipeline(key, call)

    def _make_pipeline(self, key, call):
        _, pl = self.layout(tuple(b.binding for b in call.bindings))
        module = self.module(call.shader)
        p = self._pipelines[key] = self._made(
            f"pipeline {call.shader}:{call.entry} {call.constants}",
            lambda: self.create_compute_pipeline(pl, module, call.entry, dict(call.constants), f"{call.shader}:{call.entry}"))
        return p

    def subgroup_size(self) -> int:
        """Invocations per subgroup this device runs, for kernels laid out one subgroup per row
        (ops_quant.py's qgemv): measured once by a dispatch of shaders/subgroup_size.wgsl, since
        adapters report a range (``subgroupMinSize`` 4 to ``subgroupMaxSize`` 128 for NVIDIA
        through wgpu-native and Dawn, which runs 32, and for llvmpipe, which runs 8). 0 without
        the subgroup feature or where the dispatch fails (e.g. a page that can only await): the
        kernels' plain path. Kernels that rely on it still check it (a device may vary it)."""
        with self._cache_lock:
            if self._subgroup_size is None:
                self._subgroup_size = self._measure_subgroup_size() if self.features & SUBGROUP_FEATURES else 0
            return self._subgroup_size

    def _measure_subgroup_size(self) -> int:
        made = []
        try:
            ubuf = self.create_buffer(16, BufferUsage.UNIFORM | BufferUsage.COPY_DST, "subgroup size probe uniform")
            made.append(ubuf)
            obuf = self.create_buffer(16, STORAGE_USAGE, "subgroup size probe")
            made.append(obuf)
            bgl, pl = self.layout((1,))
            label = "subgroup_size.wgsl:subgroup_size"
            pipe = self._made(label, lambda: self.create_compute_pipeline(pl, self.module("subgroup_size.wgsl"),
                                                                          "subgroup_size", {}, label))
            bg = self.create_bind_group(bgl, [(0, ubuf, 0, 16), (1, obuf, 0, 16)], "subgroup size probe")
            chain = self.record_chain([Step("subgroup_size", -1, [], [Launch(pipe, bg, (1, 1, 1), label)])])
            (got,) = self.run_chain(chain, RunIO(reads=[(obuf, 0, 8)]))
            n = int.from_bytes(bytes(memoryview(got)[:4]), "little")
        except Exception:  # best effort: the plain kernels need none of this
            return 0
        finally:
            for b in made:
                self.destroy(b)
        return n if 4 <= n <= 128 and not n & (n - 1) else 0

    def clear_caches(self) -> None:
        self._pipelines.clear()
        self._layouts.clear()
        self._modules.clear()
