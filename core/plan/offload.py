"""Weight offload planning: which weights stay on the device, and how the rest are streamed.

After the ExecuTorch CUDA weight-offload design (seed PR 19711): weights live in host memory
(pinned on CUDA) and only the ones needed soon are copied into a capped device pool, ahead of use.
Here the pool is a FIXED ring of slots (sizes decided at plan time, so buffer addresses never
change and CUDA graph capture stays possible), shared by every payload of the session, and the
schedule is computed from the graph (the payload's ``offload`` schedule, when present, must agree).

**What the budget counts.** ``weight_budget`` bounds the device bytes of weights: every resident
buffer plus every ring slot, each rounded up to a multiple of 4 bytes (WebGPU buffer sizes).
Activations (the arena of :mod:`.memory`) are NOT counted: they are the same whatever the budget
and the memory plan reports them (``arena_bytes``) next to it.

**The run model.** Node ``t`` of a payload runs after three steps: (1) the loads whose
``issue_before == t`` are issued on the copy queue, each after ``reuse_after`` has run, since it
overwrites the slot's previous occupant; (2) the compute queue waits for the loads whose
``needed_by == t``; (3) node ``t`` runs, reading its streamed weights from their slots.

**Prefetch depth k.** The nodes that read streamed weights form a sequence of *groups*
``g_0, g_1, ...`` (a node's weights travel together). The loads of group ``j`` are issued before
group ``j-k``'s node runs (before node 0 for ``j < k``), so while any node runs the loads in
flight (issued, not yet waited for) serve at most ``k`` groups, and up to ``k+1`` groups' weights
occupy the ring at once. ``k = 0`` loads each group just before its node (no overlap). A weight
read by consecutive groups stays in its slot across them (one load); a weight read again after
a gap is loaded again (keeping it costs memory, which is what the budget decides).

**Slots.** A load occupies its slot from its issue until its last reader has run. The ring is
packed first-fit decreasing: loads in decreasing size, each into the smallest slot whose other
loads (of the same payload: payloads run one at a time) do not overlap it in time, or a new slot.

**Choosing residents.** ``U(S)`` is the footprint of streaming the set ``S``: resident bytes of
every other buffer plus the ring for ``S``. ``S0`` is every weight that nodes read, minus the
``pinned`` ones and weights returned as payload outputs (those must be resident). ``S*`` is
``S0`` improved by trying, largest first, to keep resident each weight whose load opened a ring
slot (the slots' sizes are what packing can waste), keeping the change when it lowers ``U``,
until every such weight has been tried. The **floor** is ``min(U(S*), total)``, ``total`` being
all buffers resident. Streaming a weight never needs more memory than keeping it resident when
slots are packed optimally (its loads could take a slot of their own), so ``S0`` is the
least-memory choice up to the packing heuristic, and the pass recovers what the packing loses.
For ``n`` equal weights read once each in turn the floor is ``(k+1)`` weights (``n > k``). A
budget >= floor always plans; a budget below it raises :class:`BudgetError` (never a silent
fallback). Given a budget, weights
are then made resident greedily, most loads per run first and larger first among equals, while
``U`` stays within the budget, in passes until none fits: the result streams no weight that could
be made resident on its own within the budget (a local optimum of the knapsack problem of
minimizing bytes streamed per run; ``stream_bytes`` reports them).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import AbstractSet, Dict, List, Optional, Sequence, Set, Tuple

from ..errors import BudgetError
from .memory import MIN_ALIGN, align_up
from .types import OffloadLoad, OffloadPlan, ResidentBuffer


def device_bytes(b: ResidentBuffer) -> int:
    """Bytes a buffer takes on the device: a 4-byte multiple, never empty."""
    return align_up(max(b.nbytes, 1), MIN_ALIGN)


@dataclass
class _Load:
    payload: int
    buffer: int
    issue: int
    need: int
    last: int
    rank: int  # position among the payload's reads (orders loads issued before the same node)
    nodes: List[int] = field(default_factory=list)  # the nodes reading it from the slot
    slot: int = -1


@dataclass
class _Eval:
    streamed: Set[int]
    loads: Dict[int, List[_Load]]
    slots: List[int]
    resident_bytes: int
    creators: List[int] = field(default_factory=list)  # per slot, the buffer whose load opened it

    @property
    def footprint(self) -> int:
        return self.resident_bytes + sum(self.slots)


class _Problem:
    """The fixed inputs of the search, precomputed once: only nodes that read weights matter, and
    device sizes are looked up for every load of every evaluation."""

    def __init__(self, reads: Dict[int, List[List[int]]], buffers: Sequence[ResidentBuffer], depth: int):
        self.depth = depth
        self.size = [device_bytes(b) for b in buffers]
        self.total = sum(self.size)
        self.reads = {p: [(k, r) for k, r in enumerate(per_node) if r] for p, per_node in reads.items()}

    def loads(self, streamed: AbstractSet[int]) -> Dict[int, List[_Load]]:
        """The loads of every payload when ``streamed`` are streamed (slots not yet assigned)."""
        out: Dict[int, List[_Load]] = {}
        depth = self.depth
        for p, sparse in self.reads.items():
            loads: List[_Load] = []
            groups = []
            for k, r in sparse:
                bs = [b for b in r if b in streamed]
                if bs:
                    groups.append((k, bs))
            open_: Dict[int, _Load] = {}  # loads still holding their slot (read by the previous group)
            for j, (k, bs) in enumerate(groups):
                issue = groups[j - depth][0] if j >= depth else 0
                if open_:
                    open_ = {b: ld for b, ld in open_.items() if b in bs}
                for b in bs:
                    ld = open_.get(b)
                    if ld is None:
                        ld = open_[b] = _Load(p, b, issue, k, k, len(loads))
                        loads.append(ld)
                    ld.last = k
                    ld.nodes.append(k)
            out[p] = loads
        return out

    def assign_slots(self, loads: Dict[int, List[_Load]], creators: Optional[List[int]] = None) -> List[int]:
        """First-fit-decreasing packing of the loads into a ring of fixed slots; returns slot sizes
        (and appends to ``creators`` the buffer whose load opened each slot)."""
        size = self.size
        sizes: List[int] = []
        # per slot, per payload: starts and ends of the disjoint occupancy intervals, sorted
        busy: List[Dict[int, Tuple[List[int], List[int]]]] = []
        every = [ld for ls in loads.values() for ld in ls]
        every.sort(key=lambda ld: (-size[ld.buffer], ld.payload, ld.issue, ld.rank))
        for ld in every:
            chosen = -1
            # Slots are created in non-increasing size, so scanning from the end finds the
            # smallest slot that is free over [issue, last].
            for si in range(len(sizes) - 1, -1, -1):
                iv = busy[si].get(ld.payload)
                if iv is not None:
                    starts, ends = iv
                    i = bisect_right(starts, ld.issue)
                    if i > 0 and ends[i - 1] >= ld.issue:
                        continue
                    if i < len(starts) and starts[i] <= ld.last:
                        continue
                chosen = si
                break
            if chosen < 0:
                chosen = len(sizes)
                sizes.append(size[ld.buffer])
                busy.append({})
                if creators is not None:
                    creators.append(ld.buffer)
            starts, ends = busy[chosen].setdefault(ld.payload, ([], []))
            i = bisect_right(starts, ld.issue)
            starts.insert(i, ld.issue)
            ends.insert(i, ld.last)
            ld.slot = chosen
        return sizes

    def evaluate(self, streamed: AbstractSet[int]) -> _Eval:
        streamed = set(streamed)
        loads = self.loads(streamed)
        creators: List[int] = []
        slots = self.assign_slots(loads, creators)
        resident = self.total - sum(self.size[b] for b in streamed)
        return _Eval(streamed, loads, slots, resident, creators)


def footprint(reads: Dict[int, List[List[int]]], buffers: Sequence[ResidentBuffer], streamed: AbstractSet[int],
              depth: int) -> int:
    """``U(streamed)`` of the module docstring: device bytes of weights (resident + ring) when the
    buffers in ``streamed`` are streamed with prefetch depth ``depth``."""
    return _Problem(reads, buffers, depth).evaluate(streamed).footprint


def _floor_state(prob: _Problem, candidates: Set[int]) -> _Eval:
    """S* of the module docstring: stream everything streamable; then, largest first, try keeping
    resident each weight whose load opened a ring slot, and keep it so when that lowers U."""
    cur = prob.evaluate(candidates)
    tried: Set[int] = set()
    while True:
        setters = set(cur.creators) - tried
        if not setters:
            return cur
        b = max(setters, key=lambda b: (prob.size[b], -b))
        tried.add(b)
        trial = prob.evaluate(cur.streamed - {b})
        if trial.footprint < cur.footprint:
            cur = trial


def _to_plan(ev: _Eval, budget: int, floor: int, depth: int, buffers: Sequence[ResidentBuffer]) -> OffloadPlan:
    loads: Dict[int, List[OffloadLoad]] = {}
    stream_bytes: Dict[int, int] = {}
    for p, ls in ev.loads.items():
        # reuse_after: the last reader of the slot's previous occupant within this payload run
        by_slot: Dict[int, List[_Load]] = {}
        for ld in sorted(ls, key=lambda ld: ld.issue):
            by_slot.setdefault(ld.slot, []).append(ld)
        reuse: Dict[int, int] = {}
        for seq in by_slot.values():
            for prev, ld in zip(seq, seq[1:]):
                reuse[id(ld)] = prev.last
        ordered = sorted(ls, key=lambda ld: (ld.issue, ld.need, ld.rank))
        loads[p] = [OffloadLoad(ld.buffer, ld.slot, ld.issue, ld.need, ld.last, reuse.get(id(ld), -1)) for ld in ordered]
        stream_bytes[p] = sum(buffers[ld.buffer].nbytes for ld in ls)
    resident = [i for i in range(len(buffers)) if i not in ev.streamed]
    streamed = sorted(ev.streamed)
    return OffloadPlan(budget=budget, floor=floor, depth=depth, resident=resident, streamed=streamed,
                       slots=list(ev.slots), peak_bytes=ev.footprint, loads=loads, stream_bytes=stream_bytes)


@dataclass
class OffloadResult:
    plan: OffloadPlan
    # (payload, node, buffer) -> ring slot holding that streamed buffer when the node runs
    slot_of: Dict[Tuple[int, int, int], int]


def plan_offload(reads: Dict[int, List[List[int]]], buffers: Sequence[ResidentBuffer], names: Sequence[str],
                 budget: int, depth: int = 2, must_resident: AbstractSet[int] = frozenset()) -> OffloadResult:
    """Plan residency and streaming of ``buffers`` within ``budget`` device bytes.

    ``reads[payload][node]`` lists the buffers each node reads (in order, each once);
    ``must_resident`` are buffers that may not be streamed (pinned, or returned as outputs)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise BudgetError(f"weight_budget must be a non-negative int (bytes), got {budget!r}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise BudgetError(f"prefetch_depth must be a non-negative int, got {depth!r}")
    read_anywhere = {b for per_node in reads.values() for r in per_node for b in r}
    candidates = {b for b in read_anywhere if b not in must_resident}
    prob = _Problem(reads, buffers, depth)

    star = _floor_state(prob, candidates)
    floor = min(star.footprint, prob.total)
    if budget < floor:
        big = max(range(len(buffers)), key=lambda i: buffers[i].nbytes, default=None)
        largest = f"{names[big]}, {buffers[big].nbytes} bytes" if big is not None else "none"
        pinned = sum(prob.size[b] for b in must_resident)
        raise BudgetError(f"weight budget of {budget} bytes is below the offload floor of {floor} bytes for prefetch "
                          f"depth {depth} (largest weight: {largest}; {pinned} bytes must stay resident: pinned or "
                          f"returned as outputs). Raise the budget to at least {floor}, or lower prefetch_depth.")

    if budget >= prob.total:
        best = prob.evaluate(set())
    else:
        best = star
        # Most loads per run first (each resident byte saves that many streamed bytes), then size.
        count: Dict[int, int] = {}
        for ls in star.loads.values():
            for ld in ls:
                count[ld.buffer] = count.get(ld.buffer, 0) + 1
        order = sorted(best.streamed, key=lambda b: (-count.get(b, 0), -prob.size[b], b))
        version = 0  # bumped at each acceptance; a rejection stays valid while it is unchanged
        rejected_at: Dict[int, int] = {}
        changed = True
        while changed:  # again until stable: a weight that did not fit may fit once the ring shrank
            changed = False
            top = sorted(((prob.size[c], c) for c in best.streamed), reverse=True)[:2]
            for b in order:
                if b not in best.streamed or rejected_at.get(b) == version:
                    continue
                # Cheap reject, a lower bound of U without b: b resident, and a ring that still
                # holds the largest weight left streamed.
                rest = next((sz for sz, c in top if c != b), 0)
                if best.resident_bytes + prob.size[b] + rest > budget:
                    rejected_at[b] = version
                    continue
                trial = prob.evaluate(best.streamed - {b})
                if trial.footprint <= budget:
                    best, changed, version = trial, True, version + 1
                    top = sorted(((prob.size[c], c) for c in best.streamed), reverse=True)[:2]
                else:
                    rejected_at[b] = version
    plan = _to_plan(best, budget, floor, depth, buffers)
    slot_of = {(ld.payload, k, ld.buffer): ld.slot for ls in best.loads.values() for ld in ls for k in ld.nodes}
    return OffloadResult(plan, slot_of)
