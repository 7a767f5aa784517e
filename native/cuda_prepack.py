"""Host-to-device uploads through pinned staging: the prepack phase of the CUDA executor.

Two pinned staging buffers alternate: while the copy engine drains one (async ``memcpyAsync`` on
the copy stream), the host fills the other. Filling is a memcpy out of the program's constant
bytes (an mmap or in-memory blobs), split over a few threads because one core's memcpy is slower
than a PCIe 5 DMA. Many small weights share one staging fill; each becomes one DMA into its
resident buffer (a weight larger than a staging buffer goes in pieces).

The staging buffers belong to the CUDA context (pinning memory is slow, ~the cost of copying it,
so it is paid once per process, not per session) and are only used from the thread that holds
the context lock.
"""

from __future__ import annotations

import concurrent.futures
from typing import List, Optional

import numpy as np

_H2D = 1
_PIECE = 4 << 20  # host-copy work unit handed to a thread
_THREADS = 8
_POOL: Optional[concurrent.futures.ThreadPoolExecutor] = None


def parallel_copy(jobs) -> None:
    """Run memcpy jobs ``(dst, src)`` (uint8 numpy views) on a few threads; numpy releases the
    GIL while copying, so they do run in parallel."""
    global _POOL
    pieces = []
    for dst, src in jobs:
        n = dst.nbytes
        if n <= _PIECE:
            pieces.append((dst, src))
        else:
            pieces += [(dst[a:a + _PIECE], src[a:a + _PIECE]) for a in range(0, n, _PIECE)]
    if sum(d.nbytes for d, _ in pieces) < (2 << 20) or len(pieces) == 1:
        for d, s in pieces:
            np.copyto(d, s)
        return
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(_THREADS, thread_name_prefix="gpudelegate-stage")
    for f in [_POOL.submit(np.copyto, d, s) for d, s in pieces]:
        f.result()


class Staging:
    """Two pinned buffers of ``nbytes`` each (context-owned; see the module docstring)."""

    def __init__(self, cp, nbytes: int):
        self.cp = cp
        self.nbytes = nbytes
        self.pool = cp.cuda.PinnedMemoryPool()
        self.mem = [self.pool.malloc(nbytes) for _ in range(2)]
        self.np = [np.frombuffer(m, dtype=np.uint8, count=nbytes) for m in self.mem]

    def close(self) -> None:
        self.np = []
        self.mem = []
        try:
            self.pool.free_all_blocks()
        except Exception:
            pass


class Uploader:
    """Queues ``(device pointer, host bytes)`` uploads into the staging buffers and issues the
    DMAs on ``stream``; ``finish()`` waits for all of them."""

    def __init__(self, cp, staging: Staging, stream):
        self.cp, self.st, self.stream = cp, staging, stream
        self.cur = 0
        self.fill = 0
        self.jobs: List[tuple] = []
        self.dmas: List[list] = []  # [device ptr, staging offset, n]
        self.events = [None, None]
        self.bytes = 0

    def add(self, dst_ptr: int, src: np.ndarray) -> None:
        off, n_all = 0, src.nbytes
        while off < n_all:
            space = self.st.nbytes - self.fill
            if space == 0:
                self.flush()
                space = self.st.nbytes
            n = min(space, n_all - off)
            self.jobs.append((self.st.np[self.cur][self.fill:self.fill + n], src[off:off + n]))
            last = self.dmas[-1] if self.dmas else None
            if last is not None and last[0] + last[2] == dst_ptr + off and last[1] + last[2] == self.fill:
                last[2] += n  # contiguous on both sides: one DMA
            else:
                self.dmas.append([dst_ptr + off, self.fill, n])
            self.fill += n
            off += n
            self.bytes += n

    def flush(self) -> None:
        """Fill the current staging buffer, start its DMAs, switch to the other buffer (waiting
        until the DMAs that last read it are done)."""
        if not self.jobs:
            return
        parallel_copy(self.jobs)
        base = self.st.mem[self.cur].ptr
        for dst, off, n in self.dmas:
            self.cp.cuda.runtime.memcpyAsync(dst, base + off, n, _H2D, self.stream.ptr)
        self.events[self.cur] = self.stream.record()
        self.jobs, self.dmas, self.fill = [], [], 0
        self.cur ^= 1
        if self.events[self.cur] is not None:
            self.events[self.cur].synchronize()

    def stage_now(self, src: np.ndarray) -> int:
        """Put ``src`` (at most one staging buffer) alone into a staging buffer and return its
        pointer, for a caller that issues its own device work from it (the fp16 packing)."""
        self.flush()
        if src.nbytes > self.st.nbytes:
            raise ValueError("stage_now: larger than a staging buffer")
        parallel_copy([(self.st.np[self.cur][:src.nbytes], src)])
        return self.st.mem[self.cur].ptr

    def release_now(self) -> None:
        """After the work issued from ``stage_now``'s buffer: record it and switch buffers."""
        self.events[self.cur] = self.stream.record()
        self.cur ^= 1
        if self.events[self.cur] is not None:
            self.events[self.cur].synchronize()

    def finish(self) -> None:
        self.flush()
        self.stream.synchronize()
