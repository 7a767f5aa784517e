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

Reuse: a buffer is filled again only after the copies out of it have run. Each buffer's submit is
followed by ``queue.on_submitted_work_done_async()`` (a future, no GPU work: the context's marker,
a copy into a read-back buffer and a submit of its own, cost several times more host time per
piece), and the buffer's next turn waits on it; with three 64 MiB buffers that wait is normally
long over.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

from gpudelegate.errors import DeviceError

from .wgpu_staging import Uploader

# Asked of a Dawn device for host-memory staging (experimental in Dawn: the allow_unsafe_apis toggle).
HOST_MEMORY_FEATURE = "host-mapped-pointer"


def _extras():
    from wgpudawn.backends.dawn import extras

    return extras


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
        self.memory.clear()
        try:  # let Dawn release the destroyed buffers' memory
            _extras().process_events()
        except Exception:
            pass
