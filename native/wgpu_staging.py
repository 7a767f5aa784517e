"""Host <-> device staging for the wgpu adapter: the MAP_READ pool that read-backs reuse, and the
upload ring that prepack streams constants through (``Uploader``).

Why a ring: ``queue.write_buffer`` copies into fresh staging memory on every call, where a copy
into an already-mapped, persistent buffer does not; where the staging lives (BAR memory or host
memory) decides the ceiling: docs/NOTES.md has the measurements behind each choice here.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import astuple, dataclass
from typing import Dict, List, Optional, Tuple

from gpudelegate import dtypes as _dt
from gpudelegate.errors import DeviceError

# Asked for only when the upload staging is "host" (Uploader): wgpu-native warns about it on
# discrete GPUs, and it changes nothing else.
HOST_STAGING_FEATURE = "mappable-primary-buffers"


def host_staging_possible(ctx) -> bool:
    """Whether ``ctx``'s device can stage uploads in host memory: it has the feature, and wgpu-py's
    buffers give a writable view of a READ mapping (an experimental call)."""
    try:
        from wgpu.backends.wgpu_native import GPUBuffer
    except Exception:
        return False
    return HOST_STAGING_FEATURE in getattr(ctx, "features", ()) and hasattr(GPUBuffer, "_experimental_get_mapped_range")


class StagingPool:
    """MAP_READ | COPY_DST buffers reused across runs (a fresh buffer per read costs an allocation
    and, in wgpu-native, a blocking temp buffer: docs/NOTES.md). Sizes are powers of two."""

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


@dataclass
class UploadStats:
    """Where an :class:`Uploader`'s time went, summed over its life: ``fill_s`` copying into staging
    (the host's threaded copy), ``wait_s`` waiting for a staging buffer's turn (its previous copies
    to have run), ``make_s`` making staging buffers (in the caller's thread, or waiting for
    ``prepare``'s), ``submit_s`` encoding and submitting the copies (and a ring's marker);
    ``bytes`` written and ``pieces`` (staging buffers handed to the GPU); ``direct`` bytes copied
    by the GPU straight out of host memory that held them already (Dawn: a program loaded into
    ``gpu_readable_memory``; no fill, no staging). A session's share is
    ``after.since(before)``; what a prepack took beyond the sum is the caller's own time and the
    final wait for the GPU."""

    bytes: int = 0
    pieces: int = 0
    fill_s: float = 0.0
    wait_s: float = 0.0
    make_s: float = 0.0
    submit_s: float = 0.0
    direct: int = 0

    def copy(self) -> "UploadStats":
        return UploadStats(*astuple(self))

    def since(self, earlier: "UploadStats") -> "UploadStats":
        return UploadStats(*(a - b for a, b in zip(astuple(self), astuple(earlier))))


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
    def __init__(self, ctx: "WgpuContext", piece: int = 64 << 20, count: int = 3, staging: str = "bar",
                 threads: Optional[int] = None, min_part: int = 8 << 20):
        if staging not in ("host", "bar"):
            raise ValueError(f"Uploader: staging must be 'bar' or 'host', not {staging!r}")
        if staging == "host" and not host_staging_possible(ctx):
            raise DeviceError(f"wgpu: host-memory upload staging needs the device feature '{HOST_STAGING_FEATURE}' "
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
        # (source buffer, its offset, dst, dst offset, bytes): the source is the staging buffer
        # being filled, or (Dawn) host memory that already holds the bytes (dawn_staging)
        self.copies: List[Tuple[object, int, object, int, int]] = []
        self.turn = 0
        # A large write is copied by up to ``fill_threads`` threads, each ``min_part`` bytes at least
        # (each hand-off to the thread pool costs tens to hundreds of microseconds).
        self.fill_threads = max(1, min(threads or 8, os.cpu_count() or 1))
        self.min_part = max(1, min_part)
        self.threads = None  # the fill's thread pool, made on first use
        self.warm: Optional[threading.Thread] = None
        self.stats = UploadStats()
        self.lock = threading.Lock()  # sessions on other threads share the ring

    @property
    def bytes(self) -> int:
        """Bytes written through the ring so far."""
        return self.stats.bytes

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
                        self._touch(buf)
                        self.ready.append(buf)
                except Exception:
                    pass

        self.warm = threading.Thread(target=make, name="gpudelegate-staging", daemon=True)
        self.warm.start()

    def _touch(self, buf) -> None:
        """Have the memory behind a new staging buffer made now (on the prepare thread)."""
        buf._experimental_get_mapped_range(0, self.piece)  # the driver maps it now

    def _open(self, buf):
        """A writable numpy view of a mapped staging buffer, or None (public API only)."""
        get = getattr(buf, "_experimental_get_mapped_range", None)
        if get is None:
            return None
        import numpy as np

        return np.frombuffer(get(0, self.piece), np.uint8)

    def _release(self, buf) -> None:
        """The filled staging buffer is handed to the GPU (its copies are encoded next)."""
        buf.unmap()

    def _submitted(self, buf) -> None:
        """The copies out of ``buf`` were submitted (a ring whose buffers are not mapped again
        before reuse remembers when they will have run)."""

    def _take(self):
        if self.ready:
            buf = self.ready.pop(0)
            self.bufs.append(buf)
            return buf
        t0 = time.perf_counter()
        if len(self.bufs) < self.count:
            buf = self._new()
            self.bufs.append(buf)
            self.stats.make_s += time.perf_counter() - t0
            return buf
        buf = self.bufs[self.turn]
        self.turn = (self.turn + 1) % self.count
        self._map(buf)
        self.stats.wait_s += time.perf_counter() - t0
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
        parts = min(self.fill_threads, max(1, n // self.min_part))
        if parts > 1:
            if self.threads is None:
                from concurrent.futures import ThreadPoolExecutor

                self.threads = ThreadPoolExecutor(max_workers=self.fill_threads, thread_name_prefix="upload")
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
        mv = _dt.byte_view(data)
        warm = self.warm
        if warm is not None and warm.is_alive():  # prepare() is still making the ring's buffers
            t0 = time.perf_counter()
            warm.join()
            self.stats.make_s += time.perf_counter() - t0
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
                self._release(self.cur)
            self.cur, self.copies = None, []

    def _write(self, dst, dst_offset: int, mv: memoryview) -> None:
        pos, n = 0, mv.nbytes
        while pos < n:
            if self.cur is None:
                self.cur = self._take()
                self.view = self._open(self.cur)
                self.off = 0
            take = min(self.piece - self.off, n - pos)
            if take < n - pos:
                take = take // 4 * 4  # a piece that does not end the write keeps offsets aligned
            if take <= 0:
                self._flush()
                continue
            t0 = time.perf_counter()
            self._fill(self.off, mv[pos:pos + take])
            self.stats.fill_s += time.perf_counter() - t0
            size = (take + 3) // 4 * 4
            self.copies.append((self.cur, self.off, dst, dst_offset + pos, size))
            self.off += size
            pos += take
            self.stats.bytes += take
            if self.off >= self.piece:
                self._flush()

    def _submit(self) -> None:
        """Encode and submit the copies queued so far (out of the current staging buffer)."""
        if not self.copies:
            return
        t0 = time.perf_counter()
        enc = self.ctx.device.create_command_encoder()
        for src, src_off, dst, dst_off, size in self.copies:
            enc.copy_buffer_to_buffer(src, src_off, dst, dst_off, size)
        self.ctx.queue.submit([enc.finish()])
        self.copies = []
        self.stats.submit_s += time.perf_counter() - t0

    def _flush(self) -> None:
        if self.cur is None:
            return
        self.view = None
        self._release(self.cur)
        self._submit()
        t0 = time.perf_counter()
        self._submitted(self.cur)
        self.stats.submit_s += time.perf_counter() - t0
        self.stats.pieces += 1
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
