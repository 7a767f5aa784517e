"""Read-backs waited for later, one submission at a time, on wgpu-native (``WgpuContext.submit_read``
/ ``read_submitted``: a greedy decode reads token n while steps n+1 and n+2 run, core/llm.py).

Why not wgpu-py's ``map_async``: its promises resolve through the device's poll thread, which calls
``wgpuDevicePoll(device, wait=True, NULL)``, i.e. waits for ALL work submitted so far; a map of
token n's staging buffer would then wait for the steps submitted after it, and looking ahead would
gain nothing. Here the read's submission goes in with ``wgpuQueueSubmitForIndex`` (a wgpu-native
extension, wgpu.h) and its staging buffer is mapped with a raw ``wgpuBufferMapAsync`` at once (the
map is tied to the last submission that used the buffer: this one); the wait is
``wgpuDevicePoll(device, wait=True, &index)``, which returns once that submission is done and runs
the callbacks of what completed, this map's among them. Every call goes straight to wgpu-native's
cffi library (``lib``): a failed map reports through its callback's status, anything else through
the device's uncaptured-error handler as for the replay's raw pass calls.

The wgpu-py buffer object never learns of the mapping (its state stays "unmapped"): the mapping is
made and undone here, between ``submit`` and ``wait``, on pooled MAP_READ buffers that nothing
else touches meanwhile.

Dawn (``PromisedRead``) needs none of this: its maps are tied to the submissions made before them
and a promise's wait (``wgpuInstanceWaitAny`` on its future) waits for that map alone, so
wgpudawn's own ``map_async``, started right after the submit, is the same protocol.
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional

from gpudelegate.errors import DeviceError


def wgpu_native_api():
    """wgpu-py's cffi ``(ffi, lib)`` for wgpu-native, or None where this build lacks the calls."""
    try:
        from wgpu.backends.wgpu_native._ffi import ffi, lib

        for name in ("wgpuQueueSubmitForIndex", "wgpuDevicePoll", "wgpuBufferMapAsync",
                     "wgpuBufferGetConstMappedRange", "wgpuBufferUnmap"):
            getattr(lib, name)
        return ffi, lib
    except (ImportError, AttributeError):
        return None


class PendingRead:
    """One submitted read: its staging buffer, the submission index, where each read sits in the
    staging buffer, and the map's status once its callback ran (None before)."""

    __slots__ = ("staging", "index", "key", "offsets", "sizes", "size", "status")

    def __init__(self, staging, index: int, key: int, offsets: List[int], sizes: List[int], size: int):
        self.staging, self.index, self.key = staging, index, key
        self.offsets, self.sizes, self.size = offsets, sizes, size
        self.status: Optional[int] = None


# Every map's callback, for the process: wgpu-native may call it after the context that started
# the map is gone (a device destroyed with a map pending aborts it), so it is never freed. A
# new ffi.callback per read would also cost more than the read. userdata1 carries the read's key.
_WAITING: Dict[int, PendingRead] = {}  # callback key -> read whose map is pending
_KEYS = itertools.count(1)
_CALLBACK = None


def _map_callback(ffi):
    global _CALLBACK
    if _CALLBACK is None:
        def mapped(status, _message, userdata1, _userdata2) -> None:
            # Runs inside a wgpuDevicePoll or a submit, on whichever thread made it (wgpu-py's
            # poll thread too): it only records the status.
            read = _WAITING.pop(int(ffi.cast("uintptr_t", userdata1)), None)
            if read is not None:
                read.status = int(status)

        _CALLBACK = ffi.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)", mapped)
    return _CALLBACK


class IndexedReads:
    """Submits command buffers with a read and waits for that submission alone (module doc)."""

    def __init__(self, device, queue, api):
        self.ffi, self.lib = api
        self.device_h, self.queue_h = device._internal, queue._internal
        self.success = self.lib.WGPUMapAsyncStatus_Success
        self._info = self.ffi.new("WGPUBufferMapCallbackInfo *")
        self._info.mode = self.lib.WGPUCallbackMode_AllowProcessEvents
        self._info.callback = _map_callback(self.ffi)
        self._index = self.ffi.new("WGPUSubmissionIndex *")

    def submit(self, command_buffers, staging, offsets: List[int], sizes: List[int], size: int) -> PendingRead:
        """Submit ``command_buffers`` (the last copies the reads into ``staging``) and start the
        staging buffer's map; returns the pending read for :meth:`wait`."""
        ffi, lib = self.ffi, self.lib
        handles = ffi.new("WGPUCommandBuffer[]", [cb._internal for cb in command_buffers])
        index = int(lib.wgpuQueueSubmitForIndex(self.queue_h, len(command_buffers), handles))
        read = PendingRead(staging, index, next(_KEYS), offsets, sizes, size)
        _WAITING[read.key] = read
        self._info.userdata1 = ffi.cast("void *", read.key)
        lib.wgpuBufferMapAsync(staging._internal, lib.WGPUMapMode_Read, 0, size, self._info[0])
        return read

    def wait(self, read: PendingRead) -> List[bytes]:
        """Wait for ``read``'s submission (not later ones), then copy its bytes out and unmap."""
        lib = self.lib
        if read.status is None:
            self._index[0] = read.index
            lib.wgpuDevicePoll(self.device_h, True, self._index)
        while read.status is None and read.key in _WAITING:  # not expected: the map is tied to it
            lib.wgpuDevicePoll(self.device_h, True, self.ffi.NULL)
        if read.status != self.success:
            _WAITING.pop(read.key, None)
            raise DeviceError(f"wgpu: mapping a read-back failed (status {read.status})")
        try:
            ptr = lib.wgpuBufferGetConstMappedRange(read.staging._internal, 0, read.size)
            if ptr == self.ffi.NULL:
                raise DeviceError("wgpu: a mapped read-back has no mapped range")
            raw = self.ffi.buffer(ptr, read.size)
            return [raw[o:o + n] for o, n in zip(read.offsets, read.sizes)]
        finally:
            lib.wgpuBufferUnmap(read.staging._internal)


class PromisedRead:
    """A submitted read whose map was started right after its submit through the backend's own
    ``map_async`` (Dawn: a map is tied to the submissions made before it, and its future is
    waited for alone by ``wgpuInstanceWaitAny``)."""

    __slots__ = ("staging", "promise", "offsets", "sizes", "size")

    def __init__(self, staging, promise, offsets: List[int], sizes: List[int], size: int):
        self.staging, self.promise = staging, promise
        self.offsets, self.sizes, self.size = offsets, sizes, size


def submit_promised(queue, command_buffers, staging, map_mode, offsets, sizes, size: int) -> PromisedRead:
    queue.submit(command_buffers)
    return PromisedRead(staging, staging.map_async(map_mode, 0, size), offsets, sizes, size)


def wait_promised(read: PromisedRead) -> List[bytes]:
    try:
        read.promise.sync_wait()
    except Exception as e:
        raise DeviceError(f"mapping a read-back failed: {type(e).__name__}: {e}") from None
    mv = read.staging.read_mapped(0, read.size, copy=False)
    try:
        return [bytes(mv[o:o + n]) for o, n in zip(read.offsets, read.sizes)]
    finally:
        del mv
        read.staging.unmap()
