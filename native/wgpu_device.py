"""The desktop WebGPU device (wgpu-native through the ``wgpu`` package): adapter, device, limits,
and the caches sessions share (shader modules, pipelines, bind group layouts, MAP_READ staging).

One :class:`WgpuContext` per Environment (created lazily on first use, closed by the
Environment after its sessions). Executors borrow it and never close it.
"""

from __future__ import annotations

import os
import threading
from typing import Dict, List, Optional, Tuple

from gpudelegate import shaders
from gpudelegate.errors import DeviceError
from gpudelegate.executor import DeviceContext
from gpudelegate.kernels import KernelCall
from gpudelegate.plan.types import DeviceLimits

# Limits asked of the device: the adapter's maximum for each (WebGPU's defaults are lower).
_WANTED_LIMITS = ("max-buffer-size", "max-storage-buffer-binding-size", "max-compute-workgroup-storage-size",
                  "max-storage-buffers-per-shader-stage", "max-compute-invocations-per-workgroup",
                  "max-compute-workgroup-size-x", "max-compute-workgroup-size-y", "max-compute-workgroups-per-dimension")
# Optional features used when present (each kernel has a path without them).
_OPTIONAL_FEATURES = ("timestamp-query", "shader-f16", "subgroup")


def _import_wgpu():
    try:
        import wgpu  # noqa: F401
    except ImportError as e:
        raise DeviceError(f"device 'wgpu' needs the wgpu package: pip install 'gpudelegate[wgpu]' ({e})") from None
    return wgpu


def _private_runtime_dir() -> None:
    # wgpu-native (via Vulkan loaders) warns when XDG_RUNTIME_DIR is unset; a private 0700 folder
    # silences it without touching anything shared.
    if os.environ.get("XDG_RUNTIME_DIR"):
        return
    path = os.path.join(os.path.expanduser("~"), ".cache", "gpudelegate-xdg")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
        os.environ["XDG_RUNTIME_DIR"] = path
    except OSError:
        pass


class StagingPool:
    """MAP_READ | COPY_DST buffers reused across runs (a fresh buffer per read costs an allocation
    and, in wgpu-native, a blocking temp buffer: FIELD-NOTES). Sizes are powers of two."""

    def __init__(self, device, wgpu):
        self.device = device
        self.usage = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
        self.free: Dict[int, List] = {}
        self.lock = threading.Lock()

    def get(self, nbytes: int):
        size = 256
        while size < nbytes:
            size *= 2
        with self.lock:
            lst = self.free.get(size)
            if lst:
                return lst.pop()
        return self.device.create_buffer(size=size, usage=self.usage, label=f"staging {size}")

    def put(self, buf) -> None:
        with self.lock:
            lst = self.free.setdefault(buf.size, [])
            if len(lst) < 4:
                lst.append(buf)
                return
        buf.destroy()

    def clear(self) -> None:
        with self.lock:
            bufs = [b for lst in self.free.values() for b in lst]
            self.free.clear()
        for b in bufs:
            try:
                b.destroy()
            except Exception:
                pass


class Uploader:
    """Host -> device uploads through a ring of persistent MAP_WRITE | COPY_SRC staging buffers.

    ``queue.write_buffer`` copies into fresh staging memory on every call (first-touch page faults,
    and wgpu-native's own copy): measured 0.6-1.6 GB/s on the software adapter against 5-6 GB/s
    for a copy into an already-mapped buffer. Here each piece is copied (by several threads when
    large) into a staging buffer that stays allocated, unmapped, and copied to its destination
    with copy_buffer_to_buffer; a buffer is re-mapped for writing only when its turn comes round
    again, by which time its previous copy has long run (map waits for it otherwise)."""

    # 64 MiB pieces: 25 GB/s on an H100 against 21 GB/s with 32 MiB and 14.8 GB/s with 16 MiB
    # (benchmarks/results/wgsl_matmul_*; 128 MiB gains 6 % more for twice the staging memory).
    # On the NVIDIA Vulkan driver wgpu-native puts MAP_WRITE buffers in device memory behind the
    # BAR: the fill is the host writing over PCIe (25-30 GB/s with 8-16 threads on an H100) and
    # the copy is device to device (170-190 GB/s), so the fill bounds the ring (22-26 GB/s end to
    # end; 4 or 6 buffers, or mapping the next one ahead, measured no better than 3:
    # benchmarks/results/wgpu_upload_*). Making the buffers is paid by the context's first large
    # upload: 1 GiB went at 8.5-8.9 GB/s in a fresh context against 22.6-23.4 GB/s in the next
    # session (~75 ms for the three).
    def __init__(self, ctx: "WgpuContext", piece: int = 64 << 20, count: int = 3):
        self.ctx = ctx
        self.piece = piece
        self.count = count
        self.bufs: List = []
        self.turn = 0
        self.threads = None
        self.bytes = 0
        self.lock = threading.Lock()  # sessions on other threads share the ring

    def _take(self):
        w = self.ctx.wgpu
        if len(self.bufs) < self.count:
            buf = self.ctx.device.create_buffer(size=self.piece, usage=w.BufferUsage.MAP_WRITE | w.BufferUsage.COPY_SRC,
                                                mapped_at_creation=True, label="upload staging")
            self.bufs.append(buf)
            return buf
        buf = self.bufs[self.turn]
        self.turn = (self.turn + 1) % self.count
        buf.map_sync(w.MapMode.WRITE, 0, self.piece)
        return buf

    def _fill(self, buf, src: memoryview) -> None:
        n = src.nbytes
        size = (n + 3) // 4 * 4
        get = getattr(buf, "_experimental_get_mapped_range", None)
        if get is None:  # public API only: one memcpy under the GIL
            buf.write_mapped(src, 0)
            return
        import numpy as np

        dst = np.frombuffer(get(0, size), np.uint8)
        s = np.frombuffer(src, np.uint8)
        parts = min(8, os.cpu_count() or 1, max(1, n >> 23))  # 8 MiB per thread at least
        if parts > 1:
            if self.threads is None:
                from concurrent.futures import ThreadPoolExecutor

                self.threads = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="upload")
            step = -(-n // parts)
            # numpy releases the GIL for large contiguous copies: the threads really run at once.
            list(self.threads.map(lambda i: np.copyto(dst[i:i + step], s[i:i + step]), range(0, n, step)))
        else:
            np.copyto(dst[:n], s)
        if size > n:
            dst[n:size] = 0
        del dst

    def write(self, dst, dst_offset: int, data) -> None:
        """Queue a copy of ``data`` into ``dst`` at ``dst_offset`` (multiple of 4; the tail is
        padded to 4 bytes with zeros). Ordered like any queue operation."""
        mv = memoryview(data).cast("B")
        with self.lock:
            self._write(dst, dst_offset, mv)

    def _write(self, dst, dst_offset: int, mv: memoryview) -> None:
        for s in range(0, mv.nbytes, self.piece):
            piece = mv[s:s + self.piece]
            size = (piece.nbytes + 3) // 4 * 4
            buf = self._take()
            self._fill(buf, piece)
            buf.unmap()
            enc = self.ctx.device.create_command_encoder()
            enc.copy_buffer_to_buffer(buf, 0, dst, dst_offset + s, size)
            self.ctx.queue.submit([enc.finish()])
            self.bytes += piece.nbytes

    def close(self) -> None:
        for b in self.bufs:
            try:
                b.destroy()
            except Exception:
                pass
        self.bufs = []
        if self.threads is not None:
            self.threads.shutdown(wait=False)
            self.threads = None


class WgpuContext(DeviceContext):
    """Adapter + device. ``limits_override`` lowers the limits reported to the planner and the
    kernel selection (tests use it to exercise binding splits on small tensors); the device itself
    keeps the adapter's."""

    kind = "wgpu"

    def __init__(self, env=None, power_preference: str = "high-performance",
                 limits_override: Optional[dict] = None):
        wgpu = _import_wgpu()
        _private_runtime_dir()
        self.wgpu = wgpu
        try:
            adapter = wgpu.gpu.request_adapter_sync(power_preference=power_preference)
        except Exception as e:
            raise DeviceError(f"wgpu: requesting an adapter failed: {type(e).__name__}: {e}") from None
        if adapter is None:
            raise DeviceError("wgpu: no WebGPU adapter found. On Linux without a GPU, install a software Vulkan "
                              "driver (apt-get install mesa-vulkan-drivers libvulkan1); on a GPU machine, the "
                              "Vulkan loader and the vendor's ICD")
        self.adapter = adapter
        alim = adapter.limits
        wanted = {k: alim[k] for k in _WANTED_LIMITS if k in alim}
        feats = [f for f in _OPTIONAL_FEATURES if f in adapter.features]
        try:
            self.device = adapter.request_device_sync(required_features=feats, required_limits=wanted)
        except Exception as e:
            raise DeviceError(f"wgpu: creating a device on {adapter.info.get('device', '?')} failed: "
                              f"{type(e).__name__}: {e}") from None
        self.queue = self.device.queue
        self.features = frozenset(feats)
        dl = self.device.limits
        info = adapter.info
        name = f"{info.get('device', '?')} ({info.get('backend_type', '?')}, {info.get('adapter_type', '?')})"
        self._limits = DeviceLimits(max_buffer_size=int(dl["max-buffer-size"]),
                                    max_binding_size=int(dl["max-storage-buffer-binding-size"]),
                                    offset_alignment=int(dl["min-storage-buffer-offset-alignment"]), name=name)
        if limits_override:
            self._limits = DeviceLimits(**{**self._limits.__dict__, **limits_override})
            if self._limits.max_binding_size > int(dl["max-storage-buffer-binding-size"]) or \
                    self._limits.max_buffer_size > int(dl["max-buffer-size"]):
                raise DeviceError(f"wgpu: limits_override {limits_override} raises a limit above the device's")
        self.uniform_alignment = int(dl["min-uniform-buffer-offset-alignment"])
        self._modules: Dict[str, object] = {}
        self._pipelines: Dict[tuple, object] = {}
        self._layouts: Dict[tuple, tuple] = {}
        self.staging = StagingPool(self.device, wgpu)
        self.uploader = Uploader(self)
        self._fence_src = None
        self._lock = threading.RLock()
        self.closed = False

    # ------------------------------------------------------------------ DeviceContext
    @property
    def limits(self) -> DeviceLimits:
        return self._limits

    def create_executor(self, program, **options):
        from .wgpu_executor import WgpuExecutor

        unknown = set(options) - {"profile", "tuning"}
        if unknown:
            raise TypeError(f"wgpu executor: unknown options {sorted(unknown)} (known: profile, tuning)")
        return WgpuExecutor(self, program, **options)

    def info(self) -> dict:
        # A CPU adapter (lavapipe, SwiftShader) is correct but slower than the numpy reference;
        # device="auto" passes it over (device="wgpu" still takes it).
        software = str(self.adapter.info.get("adapter_type", "")).upper() == "CPU"
        return {"kind": self.kind, "device": self._limits.name, "limits": self._limits,
                "features": sorted(self.features), "software": software}

    def register_transfers(self, registry) -> None:
        from .wgpu_executor import transfer

        for pair in (("host", "wgpu"), ("wgpu", "host"), ("wgpu", "wgpu")):
            registry.register(*pair, transfer)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.staging.clear()
            self.uploader.close()
            self._pipelines.clear()
            self._modules.clear()
            self._layouts.clear()
            self.device.destroy()
        except Exception:
            pass

    # ------------------------------------------------------------------ caches
    def module(self, name: str):
        m = self._modules.get(name)
        if m is None:
            try:
                m = self.device.create_shader_module(code=shaders.source(name), label=name)
            except Exception as e:
                raise DeviceError(f"wgpu: compiling shader {name} failed: {e}") from None
            self._modules[name] = m
        return m

    def layout(self, slots: Tuple[int, ...]):
        """(bind group layout, pipeline layout) for binding 0 uniform + read_write storage ``slots``."""
        lay = self._layouts.get(slots)
        if lay is None:
            S = self.wgpu.ShaderStage.COMPUTE
            entries = [{"binding": 0, "visibility": S, "buffer": {"type": "uniform"}}]
            entries += [{"binding": s, "visibility": S, "buffer": {"type": "storage"}} for s in slots]
            bgl = self.device.create_bind_group_layout(entries=entries)
            lay = (bgl, self.device.create_pipeline_layout(bind_group_layouts=[bgl]))
            self._layouts[slots] = lay
        return lay

    def pipeline(self, call: KernelCall):
        key = call.pipeline_key
        with self._lock:
            p = self._pipelines.get(key)
            if p is None:
                _, pl = self.layout(tuple(b.binding for b in call.bindings))
                try:
                    p = self.device.create_compute_pipeline(
                        layout=pl, label=f"{call.shader}:{call.entry}",
                        compute={"module": self.module(call.shader), "entry_point": call.entry,
                                 "constants": dict(call.constants)})
                except Exception as e:
                    raise DeviceError(f"wgpu: pipeline {call.shader}:{call.entry} {call.constants} failed: {e}") from None
                self._pipelines[key] = p
            return p

    def marker(self):
        """Submit a marker after everything submitted so far; ``wait(marker)`` blocks until it has
        run (a map of the buffer the marker's copy wrote: wgpu 0.32's on_submitted_work_done_sync
        is broken, FIELD-NOTES)."""
        w = self.wgpu
        if self._fence_src is None:
            self._fence_src = self.device.create_buffer(size=16, usage=w.BufferUsage.COPY_SRC | w.BufferUsage.STORAGE)
        dst = self.staging.get(16)
        enc = self.device.create_command_encoder()
        enc.copy_buffer_to_buffer(self._fence_src, 0, dst, 0, 16)
        self.queue.submit([enc.finish()])
        return dst

    def wait(self, marker) -> None:
        marker.map_sync(self.wgpu.MapMode.READ, 0, 16)
        marker.unmap()
        self.staging.put(marker)

    def fence(self) -> None:
        """Block until everything submitted so far has run."""
        self.wait(self.marker())


def create_context(env=None, **options) -> WgpuContext:
    return WgpuContext(env, **options)
