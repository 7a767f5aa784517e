"""How the CUDA executor orders offload copies against compute: the plan's loads as CUDA events.

The offload planner (``gpudelegate.plan.offload``) decides *what* moves and *where*: per payload a
list of ``OffloadLoad(buffer, slot, issue_before, needed_by, at, last_use, reuse_after)``, already
placed (``at``: the dispatch the copy is issued before) and proved safe against the dispatches at
plan time (``plan.offload.check_loads``). On CUDA the copies run on a copy stream beside the
compute stream, so the executor only maps each load onto events:

- the copy of a load is enqueued before dispatch ``ld.at``; when ``ld.reuse_after`` names a node
  (the last reader of the slot's previous occupant in this run), the copy stream first waits for
  a "release" event recorded on the compute stream right after that node's dispatch (always an
  earlier dispatch than ``at``, so the event is recorded in this run before the wait is enqueued);
- a load with ``reuse_after == -1`` waits only for the run's start (the copy stream joins the
  compute stream there, which also orders it after every earlier run);
- dispatch ``k`` waits for the "loaded" event of every load whose ``needed_by`` is its node.

Recording only the events that something waits for keeps the chain short, and the same list is
replayed eagerly or captured once into a CUDA graph (events recorded and waited inside one
capture become graph edges). Nothing is derived here that the plan does not say; the plan check
is run again on the plan the executor is handed (a hand-edited plan fails with PlanError before
anything is enqueued).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from gpudelegate.plan.offload import check_loads, slot_reads

__all__ = ["StepSchedule", "OffloadStreamSchedule", "build_schedule", "slot_reads"]


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


def build_schedule(payload: int, dispatch_nodes: Sequence[int], dispatch_slot_reads: Sequence[Sequence[Tuple[int, int]]],
                   loads: Sequence, value_buffer: Dict[Tuple[int, int], int]) -> OffloadStreamSchedule:
    """The stream schedule of one payload, after checking the plan against the dispatches.

    ``dispatch_nodes[k]``: node index of dispatch k; ``dispatch_slot_reads[k]``: its
    ``slot_reads``; ``loads``: ``plan.offload.loads[payload]``; ``value_buffer``:
    ``plan.prepack.value_buffer`` (which buffer a weight value is). Raises PlanError.
    """
    check_loads(payload, dispatch_nodes, dispatch_slot_reads, loads, value_buffer)
    pos = {n: k for k, n in enumerate(dispatch_nodes)}
    steps = [StepSchedule() for _ in dispatch_nodes]
    copy_after: List[Optional[int]] = []
    for li, ld in enumerate(loads):
        steps[ld.at].issue.append(li)
        steps[pos[ld.needed_by]].wait.append(li)
        r = None if ld.reuse_after < 0 else pos[ld.reuse_after]
        copy_after.append(r)
        if r is not None:
            steps[r].release = True
    return OffloadStreamSchedule(steps=steps, copy_after=copy_after)
