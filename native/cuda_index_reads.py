"""Greedy picks read back one token at a time on CUDA (``CudaExecutor.argmax_device`` /
``index_value``): each pick's int32 index lands in its own word of pinned host memory, and a CUDA
event is recorded on the executor's stream behind it; reading the value waits for that event
alone. Synchronizing the stream instead would wait for every step queued after the pick too (a
greedy decode looking ahead queues steps n+1 and n+2 before it reads token n, core/llm.py).

The argmax kernel stores the pick into the host word itself where the words are mapped into the
device's address space (CUDA's unified addressing maps every pinned ``cudaHostAlloc`` block, which
``cudaPointerGetAttributes`` confirms): one operation less per token on the GPU's timeline than a
device-to-host copy after the kernel. Where they are not mapped the word is copied after the pick.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

_D2H = 2  # cudaMemcpyDeviceToHost


def _device_address(cp, ptr: int) -> int:
    """The device's address of pinned host memory at ``ptr``, 0 when the current device cannot
    address it (no unified addressing, or memory mapped for another device only)."""
    try:
        attrs = cp.cuda.runtime.pointerGetAttributes(ptr)
        if attrs.device != cp.cuda.runtime.getDevice():
            return 0
        return int(attrs.devicePointer or 0)
    except Exception:  # an older runtime or driver: the copy path
        return 0


class IndexReads:
    """A ring of ``SLOTS`` pinned int32 words with one event each. A word is reused only after the
    pick that used it was read: a pick still unread when its word comes round is read first."""

    SLOTS = 8  # more than any lookahead plus the picks a caller holds unread

    def __init__(self, cp, pinned_pool):
        self.cp = cp
        self.mem = pinned_pool.malloc(4 * self.SLOTS)
        self.words = np.frombuffer(self.mem, np.int32, self.SLOTS)
        self.events = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(self.SLOTS)]
        self.owners: List[Optional[Any]] = [None] * self.SLOTS  # the IndexTensor each word holds
        self.turn = 0
        self.mapped = _device_address(cp, self.mem.ptr)  # device address of word 0, or 0

    def slot(self) -> int:
        """The next word to write a pick into; the pick it held before is read first if unread."""
        k = self.turn
        self.turn = (k + 1) % self.SLOTS
        prev = self.owners[k]
        if prev is not None and prev.value is None:
            self.value(prev)
        self.owners[k] = None
        return k

    def device_word(self, k: int) -> int:
        """The device address of word ``k`` for a kernel to store the pick into, 0 when the words
        are not mapped (``submit`` then copies it)."""
        return self.mapped + 4 * k if self.mapped else 0

    def submit(self, index_tensor, stream, k: int, written: bool = False) -> int:
        """Word ``k`` (from ``slot``) now follows ``index_tensor`` (its handle, an int32 CuPy array):
        the copy of its device word is queued on ``stream`` unless the kernel that made it already
        ``written`` the host word, then the word's event is recorded; returns ``k``, the tensor's
        ``read``."""
        if not written:
            self.cp.cuda.runtime.memcpyAsync(self.mem.ptr + 4 * k, index_tensor.handle.data.ptr, 4, _D2H, stream.ptr)
        self.events[k].record(stream)
        self.owners[k] = index_tensor
        return k

    def value(self, index_tensor) -> int:
        """The pick's value, once its word was written (kept on the tensor: read once)."""
        if index_tensor.value is None:
            k = index_tensor.read
            self.events[k].synchronize()
            index_tensor.value, index_tensor.read = int(self.words[k]), None
            if self.owners[k] is index_tensor:
                self.owners[k] = None
        return index_tensor.value
