"""A payload's kept run in the page: the fast path of ``WebGPUContext._submit`` (web/webgpu.py).

A payload's runs write the same locations with the same sizes and read the same outputs every
time, so the first such run binds everything in JavaScript once: the recorded chain, where each
input goes, the read-back copies and a Python ``bytearray`` (the *stage*) whose bytes the writes
take straight from the WebAssembly heap. A later run then copies its inputs into the stage
(``memoryview`` slice assignments: memcpy inside the heap) and makes one call from Python with
three arguments (the run's device copies, usually none; the staging buffer or None; whether to
submit). Nothing is converted or joined per run and no JS array is filled: joining the inputs in
Python and copying them into a JS Uint8Array (``assign``) cost a second bridge call a run, and
that fixed part is what a run adds to a plain JavaScript loop (pages_probes.py's slope page).

The JS side reaches the stage through ``PyProxy.getBuffer``: a Uint8Array view of the heap at the
stage's address. The view is made on the first run and again whenever the heap has grown (the
heap's old ArrayBuffer is then detached, and a view of it has length 0); the address itself never
changes, because the stage is never resized (the kept ``memoryview`` of it forbids that). The
buffer is released right after the view is made: the view stays valid while the stage lives at
that address, which the kept memoryview guarantees.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

# ``run``: _RUN_JS with its device, queue and piece size bound (WebGPUContext._run_bound);
# ``locs``: [buffer, offset, offset in the stage, size] per write; the rest as _RUN_JS takes them
# (``copies``, of device-tensor inputs, may differ per run: an argument of each call).
BIND_KEPT_JS = """
const writes = [];
let view = null;
return (copies, staging, SUBMIT) => {
  if (locs.length && (view === null || view.byteLength === 0)) {
    const pb = stage.getBuffer("u8");
    view = pb.data;
    pb.release();
    writes.length = 0;
    for (let j = 0; j < locs.length; j += 4) writes.push(locs[j], locs[j + 1], view, locs[j + 2], locs[j + 3]);
  }
  return run(cmds, writes, copies, reads, staging, SUBMIT);
};
"""

# How many kept runs one chain holds (most recent first): a payload run both with and without a
# read-back, or with some inputs sometimes left on the device (no write), has one each.
MAX_KEPT = 8


class KeptRun:
    """One payload's writes (destination buffer, offset, size) and reads, with the JS call that
    replays its chain on them (``call(copies, staging, submit)``)."""

    __slots__ = ("locs", "reads", "offsets", "size", "stage", "view", "proxy", "call")

    def __init__(self, bind, run_bound, chain_cmds, writes, reads, reads_js, offsets: List[int], size: int,
                 to_js, create_proxy):
        at, locs = 0, []
        for buf, off, data in writes:
            n = memoryview(data).nbytes
            locs.append((buf, off, at, n))
            at += n
        self.locs: Tuple[tuple, ...] = tuple(locs)
        self.reads: Optional[tuple] = tuple(reads) if reads else None
        self.offsets, self.size = offsets, size
        self.stage = bytearray(at)
        self.view = memoryview(self.stage)  # held: the stage can never be resized (moved) under the JS view
        self.proxy = create_proxy(self.stage)
        flat = to_js([v for buf, off, a, n in locs for v in (buf, off, a, n)])
        self.call = bind(run_bound, chain_cmds, flat, reads_js, self.proxy)

    def fill(self, writes: Sequence[tuple], reads) -> bool:
        """Copy this run's inputs into the stage if the run is this one's (same write locations
        and sizes, same reads); False (and nothing to rely on in the stage) if not."""
        kept = self.reads
        if not reads:
            if kept:
                return False
        elif not kept or len(reads) != len(kept):
            return False
        else:
            for r, k in zip(reads, kept):
                if r is not k and (r[0] is not k[0] or r[1] != k[1] or r[2] != k[2]):
                    return False
        locs = self.locs
        if len(writes) != len(locs):
            return False
        view = self.view
        for (buf, off, data), (kbuf, koff, at, n) in zip(writes, locs):
            if buf is not kbuf or off != koff:
                return False
            try:
                view[at:at + n] = data  # raises for another size, another format or a JS view
            except (TypeError, ValueError):
                try:
                    view[at:at + n] = memoryview(data).cast("B")  # bytes of another format
                except (TypeError, ValueError):
                    return False
        return True

    def close(self) -> None:
        self.proxy.destroy()


def find(kept: List[KeptRun], writes, reads) -> Optional[KeptRun]:
    """The kept run of ``kept`` that these writes and reads are, with the inputs copied into its
    stage; None if none is."""
    for k in kept:
        if k.fill(writes, reads):
            return k
    return None


def keep(kept: List[KeptRun], run: KeptRun) -> None:
    """Put ``run`` first in ``kept``, dropping (and freeing) the oldest beyond MAX_KEPT."""
    kept.insert(0, run)
    while len(kept) > MAX_KEPT:
        kept.pop().close()


def is_host_bytes(data: Any) -> bool:
    """Whether ``data`` is Python memory (a buffer), which a stage can take, and not a JS view."""
    if getattr(data, "js", None) is not None:
        return False
    try:
        memoryview(data)
    except TypeError:
        return False
    return True
