"""A run's small host inputs (a decode step's token ids and position) on wgpu-native, through two
persistent MAP_WRITE staging buffers copied in the run's own command buffer, instead of
``queue.write_buffer``.

Why: wgpu-native's ``write_buffer`` makes a staging allocation on every call. On the NVIDIA driver
that costs nothing on some devices and ~0.8 ms of CPU a call on others, at random per device (the
same process, program and code: SmolLM2 decode on an H200 ran at 433-445 tok/s on two fresh
devices and 160-180 tok/s on three; docs/NOTES.md, "Decode host time"). Two 4-byte writes a step
then outweighed the whole step's encoding.

Only used while the queue is idle (after a read-back or a fence: a greedy decode step): a map in
wgpu-py waits for everything submitted (its poll thread polls the device until all work has run),
so a caller that pipelines runs without reading back keeps ``write_buffer``. After a read-back the
next buffer is mapped in the background, so the next run finds it mapped. WebGPU's own rules keep
it correct whatever the timing: a buffer maps only once the GPU is done with its last copies.
Anything failing here switches the context back to ``write_buffer`` for good (never a lost run).
"""

from __future__ import annotations

from typing import Dict, List, Optional

from gpudelegate import dtypes as _dt


class RunInputStaging:
    SIZE = 64 << 10  # bytes a run may stage; larger inputs (a long prompt) take write_buffer
    COUNT = 2  # one filled for this run while the other's copies may still be queued

    def __init__(self, ctx):
        self.ctx = ctx
        self.bufs: List = []
        self.turn = 0
        self.pending: Dict[int, object] = {}  # buffer index -> promise of its background map

    def _buffer(self, i: int):
        if i < len(self.bufs):
            return self.bufs[i]
        U = self.ctx.wgpu.BufferUsage
        buf = self.ctx.device.create_buffer(size=self.SIZE, usage=U.MAP_WRITE | U.COPY_SRC, mapped_at_creation=True,
                                            label="run inputs staging")
        self.bufs.append(buf)
        return buf

    def _mapped(self, i: int, buf) -> None:
        promise = self.pending.pop(i, None)
        if promise is not None:
            promise.sync_wait()  # normally resolved long ago
        if buf.map_state != "mapped":
            buf.map_sync(self.ctx.wgpu.MapMode.WRITE)

    def encode(self, writes) -> Optional[object]:
        """A command encoder holding the copies of ``writes`` [(buffer, offset, data)], or None
        when they do not fit (the caller writes them with write_buffer)."""
        views = [_dt.byte_view(d) for _, _, d in writes]
        if sum(-(-v.nbytes // 8) * 8 for v in views) > self.SIZE:
            return None
        i = self.turn
        buf = self._buffer(i)
        self._mapped(i, buf)
        self.turn = (i + 1) % self.COUNT
        copies, off = [], 0
        for (dst, dst_off, _), v in zip(writes, views):
            if v.nbytes % 4:  # the tail padded to 4 bytes with zeros, as write_buffer pads it
                v = memoryview(bytes(v) + bytes(4 - v.nbytes % 4))
            if v.nbytes:
                buf.write_mapped(v, off)
                copies.append((off, dst, dst_off, v.nbytes))
                off += -(-v.nbytes // 8) * 8  # wgpu-py writes mapped ranges at multiples of 8
        buf.unmap()
        enc = self.ctx.device.create_command_encoder()
        for src_off, dst, dst_off, n in copies:
            enc.copy_buffer_to_buffer(buf, src_off, dst, dst_off, n)
        return enc

    def prefetch(self) -> None:
        """The queue is idle: map the next buffer now, in the background (the poll thread resolves
        it at once), so the next run does not wait for a map."""
        i = self.turn
        if i < len(self.bufs) and i not in self.pending and self.bufs[i].map_state == "unmapped":
            self.pending[i] = self.bufs[i].map_async(self.ctx.wgpu.MapMode.WRITE)

    def close(self) -> None:
        self.pending.clear()
        for b in self.bufs:
            try:
                b.destroy()
            except Exception:
                pass
        self.bufs = []
