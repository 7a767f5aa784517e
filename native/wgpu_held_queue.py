"""A device queue whose runs may be held back and submitted with the next submission
(``WgpuContext.hold_runs``): a greedy decode step reads nothing back, and its argmax, with the read of
the pick, follows at once (core/llm.py), so the two go to the GPU in ONE ``wgpuQueueSubmit`` a token
instead of two. On Dawn each submit has a fixed cost beside recording its command buffers' Vulkan
commands (docs/NOTES.md, "Dawn's host time per greedy token").

The ordering rule that makes holding safe: every operation on the queue is ordered against the
submissions made before it (``writeBuffer`` most of all: a write made after a run must not be seen
by that run). So EVERY use of the queue goes through :class:`HeldQueue`, which submits what is held
before it does anything else: ``submit`` puts the held command buffers first in the same submission,
``write_buffer`` and any other attribute (``on_submitted_work_done_async``, the raw handle, ...)
submit them alone first. The context also submits them before destroying a buffer (a held command
buffer may use it) and before closing; a read waited for later submits them inside its own
submission (``take``). Nothing else can observe a held run: its outputs are read by later runs or
reads, each of which goes through the queue.

A run is held only while earlier work is queued (``WgpuContext._idle`` false), so the GPU always has
work while the host finishes the token: a run that finds the queue idle is submitted at once.
"""

from __future__ import annotations

from typing import Any, List


class HeldQueue:
    """``queue`` (wgpu-py's GPUQueue, or wgpudawn's) with held command buffers (module doc).
    Not thread-safe on its own: the context's callers hold the device lock (Environment)."""

    __slots__ = ("_queue", "held")

    def __init__(self, queue):
        self._queue = queue
        self.held: List[Any] = []  # finished command buffers of runs not submitted yet, in order

    @property
    def raw(self):
        """The queue itself, for calls that must not submit what is held (the warm-up thread)."""
        return self._queue

    def hold(self, command_buffers) -> None:
        self.held.extend(command_buffers)

    def take(self) -> list:
        """The held command buffers, no longer held: the caller submits them before its own."""
        held, self.held = self.held, []
        return held

    def flush(self) -> None:
        """Submit what is held, alone."""
        if self.held:
            self._queue.submit(self.take())

    def submit(self, command_buffers) -> None:
        if self.held:
            command_buffers = self.take() + list(command_buffers)
        self._queue.submit(command_buffers)

    def write_buffer(self, *args, **kwargs) -> None:
        self.flush()
        self._queue.write_buffer(*args, **kwargs)

    def __getattr__(self, name):
        # Any other use of the queue (a future of submitted work, the raw handle of a submit of
        # its own): what is held goes first.
        self.flush()
        return getattr(self._queue, name)
