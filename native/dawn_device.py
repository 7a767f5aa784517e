"""The Dawn adapter (device kind ``dawn``): the desktop WebGPU adapter of ``wgpu_device`` over
Dawn through wgpudawn (the wgpu-py API on Google's WebGPU implementation, ``pip install
'gpudelegate[dawn]'``).

Everything the executor sees is :class:`~gpudelegate.native.wgpu_device.WgpuContext`'s: the spec
calls, chains encoded ahead and replayed with the unwrapped webgpu.h pass calls (wgpudawn's cffi
module has the standard names), the MAP_READ pool, fences. What differs here:

- the Dawn instance's toggles, opt-in and per process (Dawn reads them when the instance is made,
  at the first adapter request): ``toggles=`` or ``GPUDELEGATE_DAWN_TOGGLES`` (comma-separated).
  ``allow_unsafe_apis`` unlocks the experimental features (``host-mapped-pointer``,
  ``chromium-experimental-subgroup-matrix``, and on NVIDIA with ``vulkan_enable_f16_on_nvidia``
  also ``shader-f16``); without toggles Dawn offers none of them there;
- the device's toggles, opt-in and per context: ``device_toggles=`` or
  ``GPUDELEGATE_DAWN_DEVICE_TOGGLES`` (e.g. ``disable_robustness``: no bounds checks added to the
  shaders; a name after ``-`` is disabled instead). ``timestamp_quantization`` is off unless named:
  Chrome rounds GPU timestamps against timing attacks from pages (to ~65 us steps here), which made
  every per-dispatch profile on Dawn read 0 or 65.5 us; a desktop process has no such attacker
  (wgpu-native does not round either);
- the features asked for (Dawn names subgroups ``subgroups``) and the subgroup-matrix configs the
  adapter reports, on the context as ``subgroup_matrix_configs``;
- uploads: with ``host-mapped-pointer``, a ring of host-memory buffers (``dawn_staging``), else
  the mapped ring of ``wgpu_staging``; never ``queue.write_buffer`` for bulk data (1-1.6 GB/s);
- ``gpu_readable_memory``: the allocator of ``gpudelegate.load(path, data_memory=...)``, host
  memory the GPU copies out of itself, so that a program read into it is prepacked by the GPU's
  copies alone (``dawn_staging.GpuReadableMemory``);
- a run's chain, where the queue is idle, in two submits (its first dispatches alone: Dawn
  records Vulkan commands inside the submit, before the GPU starts), and its read-back waited
  for by spinning on ProcessEvents for up to ``map_spin_s`` (then blocking in WaitAny);
- a device that was closed or lost raises DeviceError on use instead of a library error.
"""

from __future__ import annotations

import os
import threading
import time
from typing import List, Optional, Sequence, Tuple

from gpudelegate.errors import DeviceError

from .dawn_staging import HOST_MEMORY_FEATURE, HostMemoryUploader
from .wgpu_device import WgpuContext, raw_pass_calls
from .wgpu_staging import Uploader

SUBGROUP_MATRIX_FEATURE = "chromium-experimental-subgroup-matrix"
# Optional features asked for when the adapter offers them (each kernel has a path without them).
DAWN_OPTIONAL_FEATURES = ("timestamp-query", "shader-f16", "subgroups", SUBGROUP_MATRIX_FEATURE)
TOGGLES_ENV = "GPUDELEGATE_DAWN_TOGGLES"
STAGING_ENV = "GPUDELEGATE_DAWN_STAGING"
# Dawn device toggles (per context), e.g. ``disable_robustness``: Dawn then drops the bounds checks
# it adds to every shader (the subgroup-matrix products ran 2x faster without them on an H200;
# docs/NOTES.md). Opt-in only: without them an out-of-bounds access in a kernel is undefined
# behaviour instead of a clamped read; the conformance suite passes with them on the GPU machine.
DEVICE_TOGGLES_ENV = "GPUDELEGATE_DAWN_DEVICE_TOGGLES"
# The toggles that give an NVIDIA GPU its fast paths (docs: "Dawn backend" in README).
RECOMMENDED_TOGGLES = ("allow_unsafe_apis", "vulkan_enable_f16_on_nvidia")
# Device toggles off by default (see the module docstring); ``device_toggles`` naming one turns it on.
DEFAULT_OFF_DEVICE_TOGGLES = ("timestamp_quantization",)

_INSTANCE_LOCK = threading.Lock()
_INSTANCE_TOGGLES: Optional[Tuple[str, ...]] = None  # the toggles this process's Dawn instance has


def _import_wgpudawn():
    try:
        import wgpudawn  # noqa: F401
        from wgpudawn.backends.dawn import extras  # noqa: F401
    except ImportError as e:
        raise DeviceError(f"device 'dawn' needs the wgpudawn package: pip install 'gpudelegate[dawn]' ({e})") from None
    return wgpudawn


def _split(names: str) -> Tuple[str, ...]:
    return tuple(t.strip() for t in names.split(",") if t.strip())


def toggles_from_env() -> Tuple[str, ...]:
    return _split(os.environ.get(TOGGLES_ENV, ""))


def _checked_device_toggles(toggles) -> Tuple[str, ...]:
    if isinstance(toggles, str) or not isinstance(toggles, (list, tuple)) \
            or not all(isinstance(t, str) and t.lstrip("-") for t in toggles):
        raise DeviceError(f"dawn: device_toggles must be a list of Dawn toggle names (-name disables one), "
                          f"got {toggles!r}")
    return tuple(toggles)


def device_toggle_sets(toggles: Sequence[str], known) -> Tuple[List[str], List[str]]:
    """(enabled, disabled) device toggles: ``toggles`` as given (``-name`` disables), then the
    default-off ones this Dawn knows and ``toggles`` does not name."""
    on = [t for t in toggles if not t.startswith("-")]
    off = [t[1:] for t in toggles if t.startswith("-")]
    off += [t for t in DEFAULT_OFF_DEVICE_TOGGLES if t in known and t not in on and t not in off]
    return on, off


def _set_instance_toggles(toggles: Tuple[str, ...]) -> None:
    """Give the process's Dawn instance ``toggles``; a second context asking for other toggles is
    refused (the instance exists once per process, with the toggles of its first context)."""
    global _INSTANCE_TOGGLES
    from wgpudawn.backends.dawn import extras

    with _INSTANCE_LOCK:
        if _INSTANCE_TOGGLES is not None:
            if set(toggles) != set(_INSTANCE_TOGGLES):
                raise DeviceError(f"dawn: this process's Dawn instance was made with toggles {list(_INSTANCE_TOGGLES)}; "
                                  f"toggles {list(toggles)} need a new process (Dawn reads them once)")
            return
        try:
            extras.set_instance_extras(enable_toggles=list(toggles))
        except ValueError as e:  # an unknown toggle name
            raise DeviceError(f"dawn: {e}") from None
        except RuntimeError as e:  # the instance was made before gpudelegate asked (another user of wgpudawn)
            if toggles:
                raise DeviceError(f"dawn: cannot set toggles {list(toggles)}: {e}") from None
        _INSTANCE_TOGGLES = tuple(toggles)


def subgroup_matrix_configs(adapter) -> Tuple[dict, ...]:
    """The adapter's subgroup-matrix configs as ``{"component", "result", "M", "N", "K"}`` dicts
    (component types ``f16``, ``f32``, ``i8``, ...), best-known order as Dawn reports them."""
    if SUBGROUP_MATRIX_FEATURE not in adapter.features:
        return ()
    from wgpudawn.backends.dawn import extras

    props = extras.get_adapter_properties(adapter)
    return tuple({"component": str(c["component_type"]), "result": str(c["result_component_type"]),
                  "M": int(c["m"]), "N": int(c["n"]), "K": int(c["k"])}
                 for c in props.get("subgroup_matrix_configs", ()))


class DawnContext(WgpuContext):
    """Adapter + device on Dawn. ``toggles`` (default: ``GPUDELEGATE_DAWN_TOGGLES``) are the Dawn
    instance toggles; ``upload_staging`` is ``"host-memory"`` (default where the device has
    ``host-mapped-pointer``) or ``"bar"`` (the mapped ring)."""

    kind = "dawn"
    optional_features = DAWN_OPTIONAL_FEATURES
    raw_calls = raw_pass_calls("wgpudawn.backends.dawn._api")
    # Dawn's write_buffer for a few bytes costs nothing measurable (decode steps on an H200), and
    # its maps resolve through process_events rather than wgpu-py's poll thread: keep write_buffer.
    stage_run_inputs = False
    # Dawn records a command buffer's Vulkan commands inside wgpuQueueSubmit (a few us a dispatch)
    # and the GPU starts after it: a run that finds the queue idle submits its first 8 dispatches
    # on their own (WgpuContext.head_dispatches), the rest while the GPU runs them. The head must
    # hold enough GPU work to cover the rest's submit: MiniLM's first 2 or 4 (embeddings) did
    # not, 8 and 16 did (docs/NOTES.md, "A Dawn run's latency").
    head_dispatches = 8
    #: Seconds a run's read-back spins on Dawn's ProcessEvents before it blocks in
    #: wgpuInstanceWaitAny (wgpudawn's map_sync): spinning, the wait returns sooner and the host's
    #: work after it runs faster (docs/NOTES.md), at the price of a core busy for the GPU's time,
    #: as CUDA's default sync spins; longer runs block after it. 0: block at once (set on software
    #: adapters, whose GPU is those cores).
    map_spin_s = 0.05

    def __init__(self, env=None, power_preference: str = "high-performance",
                 limits_override: Optional[dict] = None, upload_staging: Optional[str] = None,
                 extra_features: Sequence[str] = (), toggles: Optional[Sequence[str]] = None,
                 device_toggles: Optional[Sequence[str]] = None):
        self.toggles = tuple(toggles_from_env() if toggles is None else toggles)
        self.device_toggles = _checked_device_toggles(
            _split(os.environ.get(DEVICE_TOGGLES_ENV, "")) if device_toggles is None else device_toggles)
        self._lost: Optional[str] = None
        WgpuContext.__init__(self, env, power_preference=power_preference, limits_override=limits_override,
                             upload_staging=upload_staging, extra_features=extra_features)
        self.subgroup_matrix_configs = subgroup_matrix_configs(self.adapter) \
            if SUBGROUP_MATRIX_FEATURE in self.features else ()
        if self.is_fallback_adapter:
            self.map_spin_s = 0.0  # a software adapter runs on the cores a spin would take
        self._watch_loss()

    # ------------------------------------------------------------------ WgpuContext's hooks
    def _import_module(self):
        return _import_wgpudawn()

    def _request_device(self, adapter, features, limits):
        from wgpudawn.backends.dawn import extras

        on, off = device_toggle_sets(self.device_toggles, extras.all_toggles())
        try:
            return extras.request_device_sync(adapter, required_features=features, required_limits=limits,
                                              enable_toggles=on, disable_toggles=off)
        except ValueError as e:  # an unknown toggle, or one of another stage
            raise DeviceError(f"dawn: {e}") from None

    def _request_adapter(self, power_preference: str):
        _set_instance_toggles(self.toggles)  # before the instance exists: Dawn reads them once
        try:
            return WgpuContext._request_adapter(self, power_preference)
        except DeviceError as e:  # wgpudawn raises where wgpu returns None ("only Dawn's Null backend")
            if "no WebGPU adapter" in str(e):
                raise
            raise DeviceError(f"{e}. {self._no_adapter_hint}") from None

    _no_adapter_hint = ("Dawn needs a newer Vulkan driver than wgpu-native: on Linux without a GPU, Mesa 25's "
                        "lavapipe (make setup unpacks it into .cache/mesa25; VK_DRIVER_FILES=.cache/mesa25/lvp25.json); "
                        "on a GPU machine, the Vulkan loader and the vendor's ICD")

    def _staging_choice(self, upload_staging: Optional[str]) -> str:
        staging = upload_staging or os.environ.get(STAGING_ENV, "")
        if staging not in ("", "host-memory", "bar"):
            raise DeviceError(f"dawn: upload_staging must be 'host-memory' or 'bar', not {staging!r}")
        return staging

    def _staging_features(self, staging: str) -> List[str]:
        # unset: host memory where the adapter offers it (with allow_unsafe_apis), else the mapped ring
        host = staging == "host-memory" or (not staging and HOST_MEMORY_FEATURE in self.adapter.features)
        return [HOST_MEMORY_FEATURE] if host else []

    def _make_uploader(self, staging: str):
        if HOST_MEMORY_FEATURE in self.features and staging != "bar":
            return HostMemoryUploader(self)
        return Uploader(self, staging="bar")

    # ------------------------------------------------------------------ program data in host memory
    def gpu_readable_memory(self, nbytes: int):
        """``nbytes`` (rounded up to a page) of host memory that this device's GPU copies out of
        itself: ``gpudelegate.load(path, data_memory=ctx.gpu_readable_memory)`` reads a program's
        data segment into it, and prepack on this context then copies each constant with one
        ``copy_buffer_to_buffer``, no host copy (what remains is a 1-3 byte tail, or a session
        on another context: through the ring). A writable numpy uint8 array; it lives as long
        as the program (or anything) holds it. DeviceError where uploads are not staged in host
        memory (no ``host-mapped-pointer``: Dawn without ``allow_unsafe_apis``, or
        ``upload_staging="bar"``)."""
        self._alive("gpu_readable_memory")
        memory = getattr(self.uploader, "data_memory", None)
        if memory is None:
            raise DeviceError(f"dawn: gpu_readable_memory needs uploads staged in host memory (the device "
                              f"feature '{HOST_MEMORY_FEATURE}', with the allow_unsafe_apis toggle; this "
                              f"context stages through {self.uploader.staging!r})")
        return memory.allocate(nbytes)

    # ------------------------------------------------------------------ reporting
    def info(self) -> dict:
        d = WgpuContext.info(self)
        d["toggles"] = list(self.toggles)
        d["device_toggles"] = list(self.device_toggles)
        d["upload_staging"] = self.uploader.staging
        d["subgroup_matrix_configs"] = [dict(c) for c in self.subgroup_matrix_configs]
        return d

    # ------------------------------------------------------------------ a lost or closed device
    def _watch_loss(self) -> None:
        """Remember when Dawn reports the device lost (a driver reset, or destroy()); calls after
        it raise DeviceError (``check``) instead of a library error deep in a run."""
        try:
            ctx = self

            def lost(info):
                ctx._lost = str(getattr(info, "message", info))

            self.device.lost_async.then(lost)  # wgpu-py's promise of GPUDeviceLostInfo
        except Exception:
            pass  # no promise API in this build: closed devices are still caught

    def _alive(self, where: str) -> None:
        if self.closed:
            raise DeviceError(f"dawn: {where}: the device context is closed")
        if self._lost is not None:
            raise DeviceError(f"dawn: {where}: the device was lost ({self._lost})")

    def check(self, where: str = "") -> None:
        self._alive(where or "check")

    def _guarded(self, where: str, call):
        self._alive(where)
        try:
            return call()
        except DeviceError:
            raise
        except Exception as e:
            raise DeviceError(f"dawn: {where} failed: {type(e).__name__}: {e}") from None

    def released(self) -> None:
        # Dawn frees destroyed buffers' memory inside a later submit: ~15-20 ms per GiB, which the
        # next session's prepack paid (warm prepack 18.4 GB/s against 24.4 with this). A fence,
        # then an empty submit, frees it now. Best effort: a lost device has nothing to free.
        try:
            self.fence()
            memory = getattr(self.uploader, "data_memory", None)
            if memory is not None:  # buffers over program memory that was collected meanwhile
                memory.drop_collected()
            self.queue.submit([])
        except Exception:
            pass

    def run_chain(self, chain, io, profile: bool = False):
        return self._guarded("run", lambda: WgpuContext.run_chain(self, chain, io, profile))

    def _map_read_back(self, staging, size: int) -> None:
        if self.map_spin_s <= 0:
            return WgpuContext._map_read_back(self, staging, size)
        from wgpudawn.backends.dawn._api import process_events

        promise = staging.map_async(self.wgpu.MapMode.READ, 0, size)
        end = time.perf_counter() + self.map_spin_s
        # wgpudawn's promise leaves "pending" when ProcessEvents has run the map's callback (its
        # own sync_wait loops on the same state); past ``end``, sync_wait blocks in WaitAny.
        while getattr(promise, "_state", "") == "pending" and time.perf_counter() < end:
            process_events()
        promise.sync_wait()

    def _make_indexed_reads(self):
        # Dawn ties a map to the submissions made before it and waits for its future alone
        # (wgpuInstanceWaitAny): wgpudawn's own map_async, started right after the submit, waits
        # for that submission and not for later ones (wgpu_pending_reads.PromisedRead).
        return None

    def submit_read(self, chain, io):
        return self._guarded("run", lambda: WgpuContext.submit_read(self, chain, io))

    def read_submitted(self, pending):
        return self._guarded("reading results", lambda: WgpuContext.read_submitted(self, pending))

    def create_buffer(self, size: int, usage: int, label: str = "", mapped_at_creation: bool = False):
        return self._guarded(f"creating buffer {label!r}",
                             lambda: WgpuContext.create_buffer(self, size, usage, label, mapped_at_creation))

    def write_buffer(self, buffer, offset: int, data) -> None:
        self._guarded("write_buffer", lambda: WgpuContext.write_buffer(self, buffer, offset, data))

    def upload(self, buffer, offset: int, data) -> None:
        self._guarded("upload", lambda: WgpuContext.upload(self, buffer, offset, data))

    def flush_uploads(self) -> None:
        self._guarded("flush_uploads", lambda: WgpuContext.flush_uploads(self))


def create_context(env=None, **options) -> DawnContext:
    return DawnContext(env, **options)
