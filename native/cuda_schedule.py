"""How the CUDA executor orders offload copies against compute, derived from the plan (pure Python).

The offload planner (``gpudelegate.plan.offload``) decides *what* moves: per payload a list of
``OffloadLoad(buffer, slot, issue_before, needed_by)``. On CUDA the copies run on a copy stream
beside the compute stream, so the executor also needs *which event each side waits for*:

- a load into slot ``s`` issued before dispatch ``p`` must not start before the last dispatch
  that read ``s``'s previous occupant (a dispatch ``k < p``) has finished: the copy stream waits
  for a "release" event recorded on the compute stream right after dispatch ``k``;
- the first load into a slot in a run waits only for the run's start (the copy stream joins the
  compute stream there, which also orders it after every earlier run);
- dispatch ``k`` waits for the "loaded" event of every load whose ``needed_by`` is ``k``.

Recording only the events that something waits for keeps the chain short, and the same list is
replayed eagerly or captured once into a CUDA graph (events recorded and waited inside one
capture become graph edges). The builder also proves the plan is safe *before* anything runs:
every slot a dispatch reads holds the buffer that dispatch expects, its load was waited for, and
no load overwrites a slot whose occupant is still to be read. A plan that breaks this is a
planner bug, reported as :class:`RuntimeError` naming the payload, the dispatch and the slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple


@dataclass
class StepSchedule:
    """What happens around dispatch ``k`` of a payload."""

    issue: List[int] = field(default_factory=list)  # load indices issued on the copy stream before k
    wait: List[int] = field(default_factory=list)  # load indices the compute stream waits for before k
    release: bool = False  # record a release event after k (a later copy waits for it)


@dataclass
class OffloadStreamSchedule:
    steps: List[StepSchedule]
    # Per load: the dispatch whose release event its copy waits for (None: the run-start join).
    copy_after: List[Optional[int]]

    @property
    def n_loads(self) -> int:
        return len(self.copy_after)

    @property
    def releases(self) -> List[int]:
        return [k for k, s in enumerate(self.steps) if s.release]


def slot_reads(args) -> List[Tuple[int, int]]:
    """(slot index, value id) of every argument of a dispatch that lives in a ring slot."""
    out = []
    for a in args:
        if a is not None and a.buf.space == "slot":
            out.append((a.buf.index, a.value))
    return out


def build_schedule(payload: int, dispatch_nodes: Sequence[int], dispatch_slot_reads: Sequence[Sequence[Tuple[int, int]]],
                   loads: Sequence, value_buffer: Dict[Tuple[int, int], int]) -> OffloadStreamSchedule:
    """Derive the stream schedule of one payload and check the plan against the dispatches.

    ``dispatch_nodes[k]``: node index of dispatch k; ``dispatch_slot_reads[k]``: its
    ``slot_reads``; ``loads``: ``plan.offload.loads[payload]`` (OffloadLoad-like objects);
    ``value_buffer``: ``plan.prepack.value_buffer`` (which buffer a weight value is).
    """
    where = f"payload {payload}"
    pos = {}
    for k, n in enumerate(dispatch_nodes):
        pos.setdefault(n, k)
    steps = [StepSchedule() for _ in dispatch_nodes]
    n_disp = len(dispatch_nodes)

    def at(node: int, what: str, li: int) -> int:
        if node in pos:
            return pos[node]
        raise RuntimeError(f"{where}: offload load {li} {what}={node} names no dispatched node")

    for li, ld in enumerate(loads):
        i = at(ld.issue_before, "issue_before", li)
        n = at(ld.needed_by, "needed_by", li)
        if i > n:
            raise RuntimeError(f"{where}: offload load {li} (buffer {ld.buffer} -> slot {ld.slot}) is issued before node "
                               f"{ld.issue_before}, after the node {ld.needed_by} that needs it")
        steps[i].issue.append(li)
        steps[n].wait.append(li)

    # Walk the dispatches in order, tracking each slot's occupant (the last load issued into it).
    occupant: Dict[int, int] = {}  # slot -> load index
    waited: set = set()
    last_reader: Dict[int, Optional[int]] = {}  # slot -> last dispatch that read the current occupant
    copy_after: List[Optional[int]] = [None] * len(loads)
    for k in range(n_disp):
        for li in steps[k].issue:
            s = loads[li].slot
            if s in occupant and occupant[s] not in waited:
                raise RuntimeError(f"{where}: load {li} overwrites slot {s} before load {occupant[s]} into it was used")
            r = last_reader.get(s)
            copy_after[li] = r
            if r is not None:
                steps[r].release = True
            occupant[s] = li
            last_reader[s] = None
        waited.update(steps[k].wait)
        for s, vid in dispatch_slot_reads[k]:
            li = occupant.get(s)
            if li is None:
                raise RuntimeError(f"{where}: dispatch {k} (node {dispatch_nodes[k]}) reads slot {s} before any load into it")
            if li not in waited:
                raise RuntimeError(f"{where}: dispatch {k} (node {dispatch_nodes[k]}) reads slot {s} before waiting for load {li}")
            want = value_buffer.get((payload, vid))
            if want is not None and want != loads[li].buffer:
                raise RuntimeError(f"{where}: dispatch {k} (node {dispatch_nodes[k]}) reads value {vid} (buffer {want}) from "
                                   f"slot {s}, which holds buffer {loads[li].buffer}")
            last_reader[s] = k
    return OffloadStreamSchedule(steps=steps, copy_after=copy_after)


def pack_offsets(sizes: Sequence[int], align: int = 256) -> Tuple[List[int], int]:
    """Offsets of consecutive regions of ``sizes`` bytes, each start ``align``-aligned; returns
    (offsets, total bytes). Used for the arena (one allocation for every payload's memory
    objects), the resident weights and the slot ring (one allocation each)."""
    offs, off = [], 0
    for n in sizes:
        off = (off + align - 1) // align * align
        offs.append(off)
        off += int(n)
    return offs, off
