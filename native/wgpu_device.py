"""The desktop WebGPU device (wgpu-native through the ``wgpu`` package): adapter, device, limits,
and the caches sessions share (shader modules, pipelines, bind group layouts, MAP_READ staging).

One :class:`WgpuContext` per Environment (created lazily on first use, closed by the
Environment after its sessions). Executors borrow it and never close it.
"""

from __future__ import annotations

import os
import threading
from typing import Dict, List, Optional, Sequence, Tuple

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
# Asked for only when the upload staging is "host" (Uploader): wgpu-native warns about it on
# discrete GPUs, and it changes nothing else.
_HOST_STAGING_FEATURE = "mappable-primary-buffers"


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


def host_staging_possible(ctx) -> bool:
    """Whether ``ctx``'s device can stage uploads in host memory: it has the feature, and wgpu-py's
    buffers give a writable view of a READ mapping (an experimental call)."""
    try:
        from wgpu.backends.wgpu_native import GPUBuffer
    except Exception:
        return False
    return _HOST_STAGING_FEATURE in getattr(ctx, "features", ()) and hasattr(GPUBuffer, "_experimental_get_mapped_range")


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
    """Host -> device uploads through a ring of persistent, mapped staging buffers.

    ``queue.write_buffer`` copies into fresh staging memory on every call (first-touch page faults,
    and wgpu-native's own copy): measured 0.6-1.6 GB/s on the software adapter against 5-6 GB/s
    for a copy into an already-mapped buffer. Here writes are copied (by several threads when
    large) into a staging buffer that stays allocated, one after another (a staging belt: a
    model's hundred small weights share one buffer, one unmap and one submit; a buffer per write
    made MiniLM's 90 MB prepack take ~300 ms on an H100, one map round trip per weight), then it is
    unmapped and copied to the destinations with copy_buffer_to_buffer; a buffer is re-mapped
    only when its turn comes round again, by which time its previous copies have long run (map
    waits for them otherwise).

    Where the staging lives decides the ceiling. A WebGPU upload buffer (MAP_WRITE | COPY_SRC) is
    placed by wgpu-native on the NVIDIA Vulkan driver in device memory behind the BAR: the fill is
    the host writing over PCIe (25-30 GB/s with 8-16 threads on an H100) and the copy is device
    to device (170-190 GB/s), so the fill bounds the ring (22-26 GB/s). With wgpu-native's
    ``mappable-primary-buffers`` feature a buffer may be MAP_READ | COPY_SRC, which wgpu places in
    a read-back memory type, i.e. host memory that the copy engine pulls over PCIe like a pinned
    CUDA copy (``staging="host"``). Such a buffer is mapped for READ and written through the raw
    mapped range (wgpu-py's ``_experimental_get_mapped_range``): wgpu does nothing to a READ
    mapping at unmap, and tests check every byte that arrives (software Vulkan in CI, an H100).
    Measured on an H100 host (16 vCPUs, benchmarks/results/wgpu_upload_*): the copy out of host
    staging runs at 49 GB/s, but the host fills it at only 30-39 GB/s, and with the copy engine
    reading the same memory the ring reached 18-23 GB/s against 24-25 GB/s for the BAR ring
    (cold contexts 4-6 against 7-15 GB/s: making host staging costs more than BAR staging). So
    ``staging="bar"``, the portable WebGPU path, is the default, and "host" is there for machines
    with more host memory bandwidth (GPUDELEGATE_WGPU_STAGING=host, bench_wgpu_upload.py compares
    both)."""

    # 64 MiB pieces: 25 GB/s on an H100 against 21 GB/s with 32 MiB and 14.8 GB/s with 16 MiB
    # (benchmarks/results/wgsl_matmul_*; 128 MiB gains 6 % more for twice the staging memory).
    # 4 or 6 buffers, or mapping the next one ahead, measured no better than 3
    # (benchmarks/results/wgpu_upload_*). Making the buffers is paid by the context's first large
    # upload: 1 GiB went at 8.5-8.9 GB/s in a fresh context against 22.6-23.4 GB/s in the next
    # session (~75 ms for the three), so an executor calls prepare() at allocate: the buffers are
    # made on a thread while the pipelines compile.
    def __init__(self, ctx: "WgpuContext", piece: int = 64 << 20, count: int = 3, staging: str = "bar"):
        if staging not in ("host", "bar"):
            raise ValueError(f"Uploader: staging must be 'bar' or 'host', not {staging!r}")
        if staging == "host" and not host_staging_possible(ctx):
            raise DeviceError(f"wgpu: host-memory upload staging needs the device feature '{_HOST_STAGING_FEATURE}' "
                              "(make the context with upload_staging='host') and wgpu-py's raw mapped range")
        self.host = staging == "host"
        self.ctx = ctx
        self.piece = piece
        self.count = count
        self.bufs: List = []
        self.ready: List = []  # made (and mapped) by prepare(), not yet in the ring
        self.cur = None  # the mapped staging buffer being filled, its numpy view and fill offset
        self.view = None
        self.off = 0
        self.copies: List[Tuple[int, object, int, int]] = []  # (staging offset, dst, dst offset, bytes)
        self.turn = 0
        self.threads = None
        self.warm: Optional[threading.Thread] = None
        self.bytes = 0
        self.lock = threading.Lock()  # sessions on other threads share the ring

    @property
    def staging(self) -> str:
        return "host" if self.host else "bar"

    def _map(self, buf) -> None:
        w = self.ctx.wgpu
        buf.map_sync(w.MapMode.READ if self.host else w.MapMode.WRITE, 0, self.piece)

    def _new(self):
        """A new staging buffer, mapped. Host staging is mapped for READ after creation:
        ``mapped_at_creation`` on a buffer without MAP_WRITE would make wgpu stage it itself."""
        U = self.ctx.wgpu.BufferUsage
        if not self.host:
            return self.ctx.device.create_buffer(size=self.piece, usage=U.MAP_WRITE | U.COPY_SRC,
                                                 mapped_at_creation=True, label="upload staging")
        buf = self.ctx.device.create_buffer(size=self.piece, usage=U.MAP_READ | U.COPY_SRC, label="upload staging (host)")
        self._map(buf)
        return buf

    def prepare(self, pieces: int) -> None:
        """Make up to ``pieces`` of the ring's buffers on a background thread, ahead of the uploads
        that will use them. Best effort: a buffer it could not make is made (and its error
        raised) by the upload that needs it."""
        want = min(self.count, pieces)
        if want <= len(self.bufs) + len(self.ready) or (self.warm is not None and self.warm.is_alive()):
            return

        def make():
            with self.lock:
                try:
                    while len(self.bufs) + len(self.ready) < want:
                        buf = self._new()
                        buf._experimental_get_mapped_range(0, self.piece)  # the driver maps it now
                        self.ready.append(buf)
                except Exception:
                    pass

        self.warm = threading.Thread(target=make, name="gpudelegate-staging", daemon=True)
        self.warm.start()

    def _take(self):
        if self.ready:
            buf = self.ready.pop(0)
            self.bufs.append(buf)
            return buf
        if len(self.bufs) < self.count:
            buf = self._new()
            self.bufs.append(buf)
            return buf
        buf = self.bufs[self.turn]
        self.turn = (self.turn + 1) % self.count
        self._map(buf)
        return buf

    def _fill(self, off: int, src: memoryview) -> None:
        """Copy ``src`` into the current staging buffer at byte ``off`` (by several threads when
        large; numpy releases the GIL for large contiguous copies, so they really run at once),
        zero-padding it to a multiple of 4 bytes."""
        n = src.nbytes
        size = (n + 3) // 4 * 4
        if self.view is None:  # public API only (never host staging): one memcpy under the GIL
            self.cur.write_mapped(bytes(src) + bytes(size - n), off)
            return
        import numpy as np

        dst = self.view[off:off + size]
        s = np.frombuffer(src, np.uint8)
        parts = min(8, os.cpu_count() or 1, max(1, n >> 23))  # 8 MiB per thread at least
        if parts > 1:
            if self.threads is None:
                from concurrent.futures import ThreadPoolExecutor

                self.threads = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="upload")
            step = -(-n // parts)
            list(self.threads.map(lambda i: np.copyto(dst[i:i + step], s[i:i + step]), range(0, n, step)))
        else:
            np.copyto(dst[:n], s)
        if size > n:
            dst[n:size] = 0

    def write(self, dst, dst_offset: int, data, defer: bool = False) -> None:
        """Queue a copy of ``data`` into ``dst`` at ``dst_offset`` (multiple of 4; the tail is
        padded to 4 bytes with zeros). Ordered like any queue operation once submitted: at once,
        or with ``defer`` at the next ``flush()`` (or when the staging buffer it went into is
        full), so that many small writes share one staging buffer and one submit."""
        mv = memoryview(data).cast("B")
        with self.lock:
            self._write(dst, dst_offset, mv)
            if not defer:
                self._flush()

    def flush(self) -> None:
        """Submit the copies of deferred writes."""
        with self.lock:
            self._flush()

    def discard(self) -> None:
        """Drop deferred writes that were not flushed (their caller failed): nothing is copied."""
        with self.lock:
            self.view = None
            if self.cur is not None:
                self.cur.unmap()
            self.cur, self.copies = None, []

    def _write(self, dst, dst_offset: int, mv: memoryview) -> None:
        pos, n = 0, mv.nbytes
        while pos < n:
            if self.cur is None:
                self.cur = self._take()
                get = getattr(self.cur, "_experimental_get_mapped_range", None)
                if get is not None:
                    import numpy as np

                    self.view = np.frombuffer(get(0, self.piece), np.uint8)
                self.off = 0
            take = min(self.piece - self.off, n - pos)
            if take < n - pos:
                take = take // 4 * 4  # a piece that does not end the write keeps offsets aligned
            if take <= 0:
                self._flush()
                continue
            self._fill(self.off, mv[pos:pos + take])
            size = (take + 3) // 4 * 4
            self.copies.append((self.off, dst, dst_offset + pos, size))
            self.off += size
            pos += take
            self.bytes += take
            if self.off >= self.piece:
                self._flush()

    def _flush(self) -> None:
        if self.cur is None:
            return
        self.view = None
        self.cur.unmap()
        enc = self.ctx.device.create_command_encoder()
        for src_off, dst, dst_off, size in self.copies:
            enc.copy_buffer_to_buffer(self.cur, src_off, dst, dst_off, size)
        self.ctx.queue.submit([enc.finish()])
        self.cur, self.copies = None, []

    def close(self) -> None:
        if self.warm is not None:
            self.warm.join()
            self.warm = None
        self.view, self.cur, self.copies = None, None, []
        for b in self.bufs + self.ready:
            try:
                b.destroy()
            except Exception:
                pass
        self.bufs = []
        self.ready = []
        if self.threads is not None:
            self.threads.shutdown(wait=False)
            self.threads = None


_WARM_LOCK = threading.Lock()
_CALLS_WARMED = False  # one context per process exercises wgpu-py's calls (WgpuContext._warm_calls)


class WgpuContext(DeviceContext):
    """Adapter + device. ``limits_override`` lowers the limits reported to the planner and the
    kernel selection (tests use it to exercise binding splits on small tensors); the device itself
    keeps the adapter's."""

    kind = "wgpu"

    def __init__(self, env=None, power_preference: str = "high-performance",
                 limits_override: Optional[dict] = None, upload_staging: Optional[str] = None,
                 extra_features: Sequence[str] = ()):
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
        staging = upload_staging or os.environ.get("GPUDELEGATE_WGPU_STAGING", "bar")
        want = list(extra_features) + ([_HOST_STAGING_FEATURE] if staging == "host" else [])
        missing = [f for f in want if f not in adapter.features]
        if missing:
            raise DeviceError(f"wgpu: the adapter {adapter.info.get('device', '?')} lacks features {missing}")
        feats = [f for f in _OPTIONAL_FEATURES if f in adapter.features] + [f for f in want if f not in _OPTIONAL_FEATURES]
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
        # Upload staging: "bar" (the portable MAP_WRITE ring) or "host" (Uploader);
        # GPUDELEGATE_WGPU_STAGING sets it for the contexts an Environment makes.
        self.uploader = Uploader(self, staging=staging)
        self._fence_src = None
        self._lock = threading.RLock()
        self.closed = False
        self._warmer: Optional[threading.Thread] = None
        global _CALLS_WARMED
        with _WARM_LOCK:
            if not _CALLS_WARMED:
                _CALLS_WARMED = True
                self._warmer = threading.Thread(target=self._warm_calls, name="gpudelegate-warm", daemon=True)
                self._warmer.start()

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

    def _warm_calls(self) -> None:
        """wgpu-py makes the cffi type of each C struct on its first use in the process, and cffi
        re-parses every typedef name of the header each time: ~50-100 ms per struct type on an H100
        host (~0.2-0.5 s in all, which the first prepack and the first run of a process paid:
        benchmarks/results/wgpu_upload_*). The first context exercises the calls an upload and a
        run make (buffers, write_buffer, an encoder with a copy and a compute pass, submit, a
        map) on this thread while its caller goes on loading, planning and compiling pipelines.
        Best effort: a call that fails here fails again, with its error, where it is really made."""
        try:
            U, d = self.wgpu.BufferUsage, self.device
            a = d.create_buffer(size=16, usage=U.COPY_SRC | U.COPY_DST | U.STORAGE)
            b = d.create_buffer(size=16, usage=U.MAP_READ | U.COPY_DST)
            c = d.create_buffer(size=16, usage=U.MAP_WRITE | U.COPY_SRC, mapped_at_creation=True)
            c._experimental_get_mapped_range(0, 16)
            c.unmap()
            self.queue.write_buffer(a, 0, bytes(16))
            enc = d.create_command_encoder()
            enc.copy_buffer_to_buffer(c, 0, a, 0, 16)
            enc.begin_compute_pass().end()
            enc.copy_buffer_to_buffer(a, 0, b, 0, 16)
            self.queue.submit([enc.finish()])
            b.map_sync(self.wgpu.MapMode.READ, 0, 16)
            b.read_mapped(0, 16, copy=False)
            b.unmap()
            for x in (a, b, c):
                x.destroy()
        except Exception:
            pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._warmer is not None:
            self._warmer.join()
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
