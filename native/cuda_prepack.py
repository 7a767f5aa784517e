"""Host-to-device uploads through a pinned staging ring: the prepack phase of the CUDA executor.

The ring is ``slots`` pinned windows of ``window`` bytes (16 x 8 MiB) (context-owned: pinning costs about as
much as copying, so it is paid once per process and only grows). An upload is a list of
*windows*: a device range of at most ``window`` bytes and the host pieces that fill it. Each
window is one task on a small thread pool: wait until the DMA that last read its slot is done
(a CUDA event), fill the slot (``numpy.copyto``, which releases the GIL, so the fills of several
windows run in parallel), issue ONE ``memcpyAsync`` on the copy stream, optionally a kernel
after it (the fp16 packing: the DMA lands in device scratch and a cast kernel writes the fp16
weight, so dtype conversion happens on the GPU), and record the slot's event. So several
windows are in flight at once: while the copy engine drains one, threads fill the next ones.

Resident weights of the identity layout are uploaded as the *image* of the weight block: the
windows cover the block's bytes in order, each weight copied to its offset inside the window
(alignment gaps are left as they are: nothing reads them), so the DMA count is the window count,
not the weight count (SmolLM2 has 272 weights, many of them 1 KB norms).

Tasks for a slot are submitted in slot order to a FIFO pool whose thread count is at most the
slot count, so the task that waits for a slot's previous use never waits for a task that has not
started: no deadlock.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

_H2D = 1
WINDOW = 8 << 20
MAX_SLOTS = 16
_THREADS = max(2, min(12, (os.cpu_count() or 4) - 2))
_POOL: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(_THREADS, thread_name_prefix="gpudelegate-stage")
    return _POOL


def parallel_copy(jobs) -> None:
    """Run memcpy jobs ``(dst, src)`` (uint8 numpy views) on the pool's threads (numpy releases
    the GIL while copying); small totals are copied inline."""
    pieces = []
    for dst, src in jobs:
        n = dst.nbytes
        if n <= WINDOW:
            pieces.append((dst, src))
        else:
            pieces += [(dst[a:a + WINDOW], src[a:a + WINDOW]) for a in range(0, n, WINDOW)]
    if sum(d.nbytes for d, _ in pieces) < (2 << 20) or len(pieces) == 1:
        for d, s in pieces:
            np.copyto(d, s)
        return
    for f in [_pool().submit(np.copyto, d, s) for d, s in pieces]:
        f.result()


class Staging:
    """``slots`` pinned windows of ``window`` bytes in one allocation, with one event each."""

    def __init__(self, cp, window: int, slots: int):
        self.cp = cp
        self.window, self.slots = window, slots
        self.pool = cp.cuda.PinnedMemoryPool()
        self.mem = self.pool.malloc(window * slots)
        self.np = np.frombuffer(self.mem, dtype=np.uint8, count=window * slots)
        # blocking sync: a thread waiting for a slot sleeps instead of spinning on a core the
        # other threads need for their copies
        self.events = [cp.cuda.Event(block=True, disable_timing=True) for _ in range(slots)]
        self.nbytes = window * slots

    def ptr(self, s: int) -> int:
        return self.mem.ptr + s * self.window

    def close(self) -> None:
        self.np = None
        self.mem = None
        self.events = []
        try:
            self.pool.free_all_blocks()
        except Exception:
            pass


Piece = Tuple[int, np.ndarray]  # (offset inside the window, host bytes)


class Ring:
    """Submits windows to the staging ring (see the module docstring); ``finish()`` waits for
    every fill and DMA. ``device_id``: worker threads select the device themselves (the current
    device is per thread in CUDA)."""

    def __init__(self, cp, staging: Staging, stream, device_id: int):
        self.cp, self.st, self.stream, self.device_id = cp, staging, stream, device_id
        self.futs: List[Optional[concurrent.futures.Future]] = [None] * staging.slots
        self.next = 0
        self.bytes = 0
        self.dmas = 0

    def submit(self, pieces: Sequence[Piece], n: int, dst_ptr: Optional[int],
               post: Optional[Callable[[int], None]] = None) -> None:
        """Fill a window with ``pieces``, copy its first ``n`` bytes to ``dst_ptr`` (or, when
        None, to wherever ``post`` expects them), then run ``post(slot)`` on the copy stream."""
        if n > self.st.window:
            raise ValueError(f"window of {n} bytes is larger than the ring's {self.st.window}")
        s = self.next
        self.next = (s + 1) % self.st.slots
        prev = self.futs[s]
        self.futs[s] = _pool().submit(self._task, s, prev, list(pieces), n, dst_ptr, post)
        self.bytes += n
        self.dmas += 1

    def _task(self, s, prev, pieces, n, dst_ptr, post):
        if prev is not None:
            prev.result()  # the slot's previous task has issued its DMA and recorded the event
        cp = self.cp
        with cp.cuda.Device(self.device_id):
            ev = self.st.events[s]
            ev.synchronize()  # that DMA has read the slot
            buf = self.st.np[s * self.st.window:(s + 1) * self.st.window]
            for off, src in pieces:
                np.copyto(buf[off:off + src.nbytes], src)
            if dst_ptr is not None:
                cp.cuda.runtime.memcpyAsync(dst_ptr, self.st.ptr(s), n, _H2D, self.stream.ptr)
            if post is not None:
                with self.stream:
                    post(s)
            ev.record(self.stream)

    def finish(self) -> None:
        err = None
        for f in self.futs:
            if f is not None:
                try:
                    f.result()
                except BaseException as e:  # wait for every task before raising the first error
                    err = err or e
        self.futs = [None] * self.st.slots
        self.stream.synchronize()
        if err is not None:
            raise err


def image_windows(items: Sequence[Tuple[int, np.ndarray]], window: int, max_gap: int = 0
                  ) -> List[Tuple[int, int, List[Piece]]]:
    """Cut a device image into windows. ``items``: (device offset, host bytes), sorted by offset,
    not overlapping. Returns (window start offset, window length, pieces) with the gaps between
    items inside a window copied as they are (garbage the DMA carries along: alignment padding
    that nothing reads). A window never starts in a gap and ends at the last item byte it holds;
    a gap wider than ``max_gap`` bytes ends the window (the caller's bound on padding)."""
    out: List[Tuple[int, int, List[Piece]]] = []
    cur_start, cur_end, cur = None, 0, []
    for off, src in items:
        a, n = off, src.nbytes
        if a < cur_end:
            raise ValueError(f"image items overlap at device offset {a}")
        pos = 0
        while pos < n:
            if cur_start is None:
                cur_start, cur_end, cur = a + pos, a + pos, []
            room = cur_start + window - (a + pos)
            if room <= 0 or (pos == 0 and a - cur_end > max_gap):
                out.append((cur_start, cur_end - cur_start, cur))
                cur_start, cur_end, cur = a + pos, a + pos, []
                room = window
            take = min(room, n - pos)
            cur.append((a + pos - cur_start, src[pos:pos + take]))
            cur_end = a + pos + take
            pos += take
    if cur_start is not None and cur:
        out.append((cur_start, cur_end - cur_start, cur))
    return out
