"""Host -> device uploads on Dawn: a ring of buffers whose memory is host memory that the GPU reads
itself (Dawn's ``host-mapped-pointer`` feature, through wgpudawn's extras).

Why not the rings of ``wgpu_staging``: Dawn's ``queue.write_buffer`` runs at only 1-1.6 GB/s on an
H100 host, and its MAP_WRITE buffers are mapped and unmapped per fill. A buffer made with
``create_buffer_from_host_memory(usage=COPY_SRC)`` is never mapped: the host writes into its memory
(several threads: one numpy copy into host memory does only 7-10 GB/s) and ``copy_buffer_to_buffer``
pulls it over PCIe like a pinned CUDA copy (48-49 GB/s on the H100 host against 52-54 GB/s for
torch's pinned copy; docs/NOTES.md, "Dawn backend").

The memory is always anonymous pages from ``allocate_host_memory``, never the caller's memory:
a host-mapped buffer over a file-backed mmap (the program file's weights) lost the device on the
NVIDIA driver, and a lost device cannot be caught or recovered.

What bounds it is the host's fill, not the GPU's copy: the copy out of host memory runs at about
the pinned rate, the fill of one buffer overlaps the copy out of the previous one, and the fill's
own rate (the program's bytes read from DRAM, written into host memory while the GPU reads it too)
is well below that. ``stats`` (``UploadStats``) says where a prepack's time went.

Memory that already holds the bytes: ``GpuReadableMemory`` hands out host memory for a program's
data segment (``gpudelegate.load(path, data_memory=ctx.gpu_readable_memory)`` reads the file into
it), covered by host-memory buffers with COPY_SRC; a write whose source lies inside it is one
``copy_buffer_to_buffer`` out of those buffers, no fill and no ring. The host's copy then happens
once, at load, as a loader reading weights into pinned CUDA memory does.

Reuse: a buffer is filled again only after the copies out of it have run. Each buffer's submit is
followed by ``queue.on_submitted_work_done_async()`` (a future, no GPU work: the context's marker,
a copy into a read-back buffer and a submit of its own, cost several times more host time per
piece), and the buffer's next turn waits on it; with three 64 MiB buffers that wait is normally
long over.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from typing import Dict, List, Optional, Tuple

from gpudelegate.errors import DeviceError

from .wgpu_staging import Uploader

# Asked of a Dawn device for host-memory staging (experimental in Dawn: the allow_unsafe_apis toggle).
HOST_MEMORY_FEATURE = "host-mapped-pointer"


def _extras():
    from wgpudawn.backends.dawn import extras

    return extras


def _destroy(regions) -> None:
    """Destroy the buffers of ``regions`` (lists of ``(offset, size, buffer)``); a buffer Dawn
    already let go of is no error here."""
    for bufs in regions:
        for _, _, b in bufs:
            try:
                b.destroy()
            except Exception:
                pass


class GpuReadableMemory:
    """Host memory for programs' data segments that the GPU copies out of itself.

    ``allocate(nbytes)`` returns a writable numpy uint8 array over anonymous pages from
    ``allocate_host_memory`` (never a file's mapping: see the module docstring), covered by
    host-memory buffers with COPY_SRC of at most the device's largest buffer each (several where
    that is smaller than the memory). ``spans(mv)`` says which buffers, at which offsets, hold the
    bytes of a source lying inside such memory.

    Lifetime: the array owns the memory (its base is the memoryview of the pages), and a program
    loaded into it holds the array through its ``data``; each buffer holds its own slice of the
    pages until Dawn releases it (wgpudawn's ``create_buffer_from_host_memory``), so the memory
    outlives every copy out of it. When the array is collected its buffers are destroyed at the
    next ``drop_collected`` (the uploader's next write, a session's release, or close), on those
    threads rather than wherever the collector runs."""

    def __init__(self, ctx, buffer_limit: Optional[int] = None):
        self.ctx = ctx
        self.alignment = _extras().get_host_memory_alignment(ctx.device)
        limit = int(ctx.limits.max_buffer_size if buffer_limit is None else buffer_limit)
        self.buffer_limit = max(self.alignment, limit // self.alignment * self.alignment)
        # id -> (first address, end address, [(offset in the memory, size, buffer)], the memory)
        self.regions: Dict[int, Tuple[int, int, List[tuple], memoryview]] = {}
        self.collected: List[list] = []  # buffers of collected memory, to destroy
        self.ids = itertools.count()
        self.lock = threading.Lock()

    def allocate(self, nbytes: int):
        import numpy as np

        nbytes = int(nbytes)
        if nbytes <= 0:
            raise DeviceError(f"{self.ctx.kind}: gpu_readable_memory needs a positive size, got {nbytes}")
        ex = self.ctx.device
        try:
            mem = _extras().allocate_host_memory(ex, nbytes)  # rounded up to the alignment
        except (OSError, ValueError, OverflowError) as e:
            raise DeviceError(f"{self.ctx.kind}: cannot allocate {nbytes} bytes of host memory: {e}") from None
        usage = self.ctx.wgpu.BufferUsage.COPY_SRC
        bufs, errors = [], []
        # Dawn reports a buffer it could not make (memory it cannot import, a size over its limit)
        # to an error scope, not as an exception: the scopes turn that into DeviceError here.
        ex.push_error_scope("out-of-memory")
        ex.push_error_scope("validation")
        try:
            for off in range(0, mem.nbytes, self.buffer_limit):
                size = min(self.buffer_limit, mem.nbytes - off)
                bufs.append((off, size, _extras().create_buffer_from_host_memory(
                    ex, mem[off:off + size], usage=usage, label=f"program data (host memory) @{off}")))
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            for _ in range(2):
                err = ex.pop_error_scope_async().sync_wait()
                if err is not None:
                    errors.append(str(getattr(err, "message", err)))
        if errors:
            for _, _, b in bufs:
                b.destroy()
            raise DeviceError(f"{self.ctx.kind}: cannot make host-memory buffers over {mem.nbytes} bytes: "
                              + "; ".join(errors))
        arr = np.frombuffer(mem, np.uint8)
        start = int(arr.__array_interface__["data"][0])
        key = next(self.ids)
        with self.lock:
            self.regions[key] = (start, start + mem.nbytes, bufs, mem)
        # a weak reference: a program outliving its context must not keep the context alive
        weakref.finalize(arr, GpuReadableMemory._collected, weakref.ref(self), key)
        return arr

    @staticmethod
    def _collected(owner, key: int) -> None:
        self = owner()
        if self is None:
            return
        with self.lock:
            region = self.regions.pop(key, None)
            if region is not None:
                self.collected.append(region[2])

    def drop_collected(self) -> None:
        with self.lock:
            dead, self.collected = self.collected, []
        _destroy(dead)

    def spans(self, mv: memoryview) -> Optional[List[Tuple[object, int, int, int]]]:
        """``[(buffer, offset in it, offset in mv, bytes)]`` covering ``mv`` (contiguous) rounded
        up to 4 bytes, or None where it does not lie wholly inside one allocation at a 4-byte
        aligned place (copy offsets and sizes are multiples of 4), or where the 1-3 bytes after
        it that the rounding adds are not zero (the ring pads with zeros; a loaded program's
        padding is zero, which its load checked)."""
        import numpy as np

        n = mv.nbytes
        if not self.regions or n == 0 or not mv.c_contiguous:
            return None
        addr = int(np.frombuffer(mv, np.uint8).__array_interface__["data"][0])
        with self.lock:
            regions = list(self.regions.values())
        size4 = (n + 3) // 4 * 4
        for start, end, bufs, mem in regions:
            if start <= addr and addr + n <= end:
                rel = addr - start
                if rel % 4 or addr + size4 > end or any(mem[rel + n:rel + size4]):
                    return None
                out = []
                for off, size, buf in bufs:  # buffer bounds are multiples of the alignment
                    lo, hi = max(rel, off), min(rel + size4, off + size)
                    if lo < hi:
                        out.append((buf, lo - off, lo - rel, hi - lo))
                return out
        return None

    def close(self) -> None:
        """Destroy every buffer (the memory stays the arrays' while they live)."""
        with self.lock:
            dead = [r[2] for r in self.regions.values()] + self.collected
            self.regions, self.collected = {}, []
        _destroy(dead)


class HostMemoryUploader(Uploader):
    """The :class:`~gpudelegate.native.wgpu_staging.Uploader` ring (pieces, threaded fill, deferred
    writes sharing one submit) over host-memory buffers instead of mapped staging buffers."""

    # The host's fill bounds this ring: the GPU copies out of host memory at about the pinned CUDA
    # rate, the host's copy out of the program's memory at a few GB/s per thread. So the fill gets
    # the cores but two (the caller's thread and Dawn's), 8 to 16 threads, in parts of 4 MiB at
    # least: each hand-off to the pool costs a fraction of a millisecond, which is also why smaller
    # pieces, or submitting parts of a piece as they are filled, measured slower than 64 MiB pieces.
    # docs/NOTES.md, "Dawn backend".
    def __init__(self, ctx, piece: int = 64 << 20, count: int = 3, threads: Optional[int] = None,
                 min_part: int = 4 << 20):
        if HOST_MEMORY_FEATURE not in getattr(ctx, "features", ()):
            raise DeviceError(f"{ctx.kind}: host-memory upload staging needs the device feature "
                              f"'{HOST_MEMORY_FEATURE}' (Dawn with the allow_unsafe_apis toggle)")
        alignment = _extras().get_host_memory_alignment(ctx.device)
        piece = -(-piece // alignment) * alignment
        if threads is None:
            threads = min(16, max(8, (os.cpu_count() or 1) - 2))
        Uploader.__init__(self, ctx, piece=piece, count=count, staging="bar", threads=threads, min_part=min_part)
        self.host = True
        self.memory: Dict[int, memoryview] = {}  # id(buffer) -> its host memory
        self.markers: Dict[int, object] = {}  # id(buffer) -> the promise that its last copies ran
        self.data_memory = GpuReadableMemory(ctx)
        self.sources: List[memoryview] = []  # sources of queued direct copies, held until submitted

    @property
    def staging(self) -> str:
        return "host-memory"

    def _new(self):
        ex = self.ctx.device
        mem = _extras().allocate_host_memory(ex, self.piece)
        buf = _extras().create_buffer_from_host_memory(ex, mem, usage=self.ctx.wgpu.BufferUsage.COPY_SRC,
                                                       label="upload staging (host memory)")
        self.memory[id(buf)] = mem
        return buf

    def _write(self, dst, dst_offset: int, mv: memoryview) -> None:
        """A source inside ``data_memory`` is copied by the GPU from where it lies (where its
        last 1-3 bytes cannot be, they go through the ring, zero-padded as always); anything
        else through the ring."""
        self.data_memory.drop_collected()
        n = mv.nbytes
        spans, tail = self.data_memory.spans(mv), None
        if spans is None and n % 4 and n > 4:
            spans, tail = self.data_memory.spans(mv[:n // 4 * 4]), n // 4 * 4
        if not spans:
            Uploader._write(self, dst, dst_offset, mv)
            return
        for buf, src_off, pos, size in spans:
            self.copies.append((buf, src_off, dst, dst_offset + pos, size))
        self.sources.append(mv)
        self.stats.direct += n if tail is None else tail
        if tail is not None:
            Uploader._write(self, dst, dst_offset + tail, mv[tail:])

    def prepare(self, pieces: int) -> None:
        # While this context holds programs in gpu-readable memory its prepacks are copies out of
        # that memory: the ring's buffers (3 x 64 MiB of host memory, made and imported) would be
        # made for nothing, and the first upload waits for them. A session that needs the ring
        # then makes its buffers as it goes.
        if self.data_memory.regions:
            return
        Uploader.prepare(self, pieces)

    def _flush(self) -> None:
        if self.cur is not None:
            Uploader._flush(self)
        elif self.copies:  # direct copies only: no staging buffer to hand over
            self._submit()
        self.sources = []

    def discard(self) -> None:
        Uploader.discard(self)
        self.sources = []

    def _touch(self, buf) -> None:
        # Fault the pages in now (on the prepare thread) rather than during the first fill.
        import numpy as np

        np.frombuffer(self.memory[id(buf)], np.uint8)[::4096] = 0

    def _map(self, buf) -> None:
        done = self.markers.pop(id(buf), None)
        if done is not None:
            done.sync_wait()

    def _open(self, buf):
        import numpy as np

        return np.frombuffer(self.memory[id(buf)], np.uint8)

    def _release(self, buf) -> None:
        pass  # never mapped: the GPU reads the memory as it is

    def _submitted(self, buf) -> None:
        self.markers[id(buf)] = self.ctx.queue.on_submitted_work_done_async()

    def close(self) -> None:
        for done in list(self.markers.values()):
            try:
                done.sync_wait()
            except Exception:
                pass
        self.markers.clear()
        Uploader.close(self)
        self.sources = []
        self.data_memory.close()
        self.memory.clear()
        try:  # let Dawn release the destroyed buffers' memory
            _extras().process_events()
        except Exception:
            pass
