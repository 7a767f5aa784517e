"""Greedy picks read back one token at a time on CUDA (``CudaExecutor.argmax_device`` /
``index_value``): each pick's int32 index is copied into its own word of pinned host memory on the
executor's stream, and a CUDA event recorded after the copy; reading the value waits for that event
alone. Synchronizing the stream instead would wait for every step queued after the pick too (a
greedy decode looking ahead queues steps n+1 and n+2 before it reads token n, core/llm.py).
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

_D2H = 2  # cudaMemcpyDeviceToHost


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

    def submit(self, index_tensor, stream) -> int:
        """Queue the copy of ``index_tensor``'s device word (its handle, an int32 CuPy array) on
        ``stream`` and record its event; returns the slot, ``index_tensor.read``."""
        k = self.turn
        self.turn = (k + 1) % self.SLOTS
        prev = self.owners[k]
        if prev is not None and prev.value is None:
            self.value(prev)
        self.cp.cuda.runtime.memcpyAsync(self.mem.ptr + 4 * k, index_tensor.handle.data.ptr, 4, _D2H, stream.ptr)
        self.events[k].record(stream)
        self.owners[k] = index_tensor
        return k

    def value(self, index_tensor) -> int:
        """The pick's value, once its copy has run (kept on the tensor: read once)."""
        if index_tensor.value is None:
            k = index_tensor.read
            self.events[k].synchronize()
            index_tensor.value, index_tensor.read = int(self.words[k]), None
            if self.owners[k] is index_tensor:
                self.owners[k] = None
        return index_tensor.value
