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
Executors do not work this out: each load carries ``at``, the position in the payload plan's
dispatch list it is issued before (:class:`~.types.OffloadLoad`), and :func:`check_loads` proves
the whole schedule safe against the dispatches once, at plan time (a violation is a
:class:`~gpudelegate.errors.PlanError`).

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

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import AbstractSet, Dict, List, Optional, Sequence, Set, Tuple

from ..errors import BudgetError, PlanError
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


def load_position(dispatch_nodes: Sequence[int], issue_before: int, reuse_after: int) -> int:
    """``OffloadLoad.at``: the position (index into the dispatch list, whose node ids are
    ``dispatch_nodes``, ascending) of the first dispatch of node ``>= max(issue_before,
    reuse_after + 1)``, or ``len(dispatch_nodes)``. Before it, the copy may start (issue_before
    reached) without overwriting what the slot's previous reader still needs (reuse_after run)."""
    return bisect_left(dispatch_nodes, max(issue_before, reuse_after + 1))


def _to_plan(ev: _Eval, budget: int, floor: int, depth: int, buffers: Sequence[ResidentBuffer],
             dispatch_nodes: Dict[int, Sequence[int]]) -> OffloadPlan:
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
        nodes = dispatch_nodes[p]
        placed = [OffloadLoad(ld.buffer, ld.slot, ld.issue, ld.need,
                              load_position(nodes, ld.issue, reuse.get(id(ld), -1)), ld.last, reuse.get(id(ld), -1))
                  for ld in ordered]
        # A slot's previous reader always runs before the next load's issue_before (slots are
        # packed by the intervals [issue, last]), so ``at`` follows issue order; the stable sort
        # only makes the documented order (non-decreasing ``at``) hold by construction.
        loads[p] = sorted(placed, key=lambda ld: ld.at)
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
                 budget: int, depth: int = 2, must_resident: AbstractSet[int] = frozenset(),
                 dispatch_nodes: Optional[Dict[int, Sequence[int]]] = None) -> OffloadResult:
    """Plan residency and streaming of ``buffers`` within ``budget`` device bytes.

    ``reads[payload][node]`` lists the buffers each node reads (in order, each once);
    ``must_resident`` are buffers that may not be streamed (pinned, or returned as outputs);
    ``dispatch_nodes[payload]`` are the node ids of the payload plan's dispatches, ascending
    (what ``OffloadLoad.at`` indexes; None: every node is one dispatch, in order)."""
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
    if dispatch_nodes is None:
        dispatch_nodes = {p: range(len(per_node)) for p, per_node in reads.items()}
    plan = _to_plan(best, budget, floor, depth, buffers, dispatch_nodes)
    slot_of = {(ld.payload, k, ld.buffer): ld.slot for ls in best.loads.values() for ld in ls for k in ld.nodes}
    return OffloadResult(plan, slot_of)


# ----------------------------------------------------------------------------- plan checking

def slot_reads(args) -> List[Tuple[int, int]]:
    """(slot index, value id) of every argument of a dispatch that lives in a ring slot."""
    return [(a.buf.index, a.value) for a in args if a is not None and a.buf.space == "slot"]


def check_loads(payload: int, dispatch_nodes: Sequence[int], dispatch_slot_reads: Sequence[Sequence[Tuple[int, int]]],
                loads: Sequence[OffloadLoad], value_buffer: Dict[Tuple[int, int], int]) -> None:
    """Prove the offload schedule of one payload safe against its dispatches, or raise PlanError.

    ``dispatch_nodes[k]``: node id of dispatch k (ascending); ``dispatch_slot_reads[k]``: its
    :func:`slot_reads`; ``loads``: ``plan.offload.loads[payload]``; ``value_buffer``:
    ``plan.prepack.value_buffer``. Checked, walking the dispatches in order with the loads issued
    at their ``at``: ``at`` is :func:`load_position` of the load's node fields, loads are in
    non-decreasing ``at``, and no later than the dispatch of ``needed_by``; a load never
    overwrites a slot whose occupant is still unread; ``reuse_after`` is the last dispatch that
    read the slot's previous occupant in this run (-1: none), since executors order the copy after
    that node and nothing else; every slot a dispatch reads holds the buffer it expects, loaded by
    a load already waited for (``needed_by`` reached) whose ``last_use`` is not yet passed.
    The planner runs this on every plan; executors may run it again on a plan they are handed."""
    where = f"payloads[{payload}]"
    n_disp = len(dispatch_nodes)
    pos: Dict[int, int] = {}
    for k, n in enumerate(dispatch_nodes):
        if k and n <= dispatch_nodes[k - 1]:
            raise PlanError(f"{where}: dispatch {k} is node {n}, not after node {dispatch_nodes[k - 1]} (dispatches "
                            f"must follow node order)")
        pos[n] = k
    issue: List[List[int]] = [[] for _ in range(n_disp + 1)]
    wait: List[List[int]] = [[] for _ in range(n_disp)]
    prev_at = 0
    for li, ld in enumerate(loads):
        what = f"{where}: offload load {li} (buffer {ld.buffer} -> slot {ld.slot})"
        if ld.needed_by not in pos:
            raise PlanError(f"{what}: needed_by={ld.needed_by} names no dispatched node")
        if ld.reuse_after != -1 and ld.reuse_after not in pos:
            raise PlanError(f"{what}: reuse_after={ld.reuse_after} names no dispatched node")
        want = load_position(dispatch_nodes, ld.issue_before, ld.reuse_after)
        if isinstance(ld.at, bool) or not isinstance(ld.at, int) or ld.at != want:
            raise PlanError(f"{what}: at={ld.at!r}, but issue_before={ld.issue_before} and reuse_after="
                            f"{ld.reuse_after} put it before dispatch {want}")
        need = pos[ld.needed_by]
        if ld.at > need:
            raise PlanError(f"{what} cannot be issued before node {max(ld.issue_before, ld.reuse_after + 1)} "
                            f"(issue_before {ld.issue_before}, reuse_after {ld.reuse_after}), after the node "
                            f"{ld.needed_by} that needs it")
        if ld.at < prev_at:
            raise PlanError(f"{what}: at={ld.at} comes after a load at {prev_at} (loads are listed by position)")
        prev_at = ld.at
        issue[ld.at].append(li)
        wait[need].append(li)

    occupant: Dict[int, int] = {}  # slot -> the load last issued into it
    waited: Set[int] = set()
    last_reader: Dict[int, int] = {}  # slot -> last node (this run) that read its current occupant
    for k in range(n_disp + 1):
        for li in issue[k]:
            ld = loads[li]
            s = ld.slot
            if s in occupant and occupant[s] not in waited:
                raise PlanError(f"{where}: load {li} overwrites slot {s} before load {occupant[s]} into it was used")
            r = last_reader.get(s, -1)
            if ld.reuse_after != r:
                raise PlanError(f"{where}: load {li} (buffer {ld.buffer} -> slot {s}) must wait for node {r}, the last "
                                f"reader of the slot's previous occupant, but the plan says reuse_after={ld.reuse_after}")
            occupant[s] = li
            last_reader[s] = -1
        if k == n_disp:
            break
        waited.update(wait[k])
        node = dispatch_nodes[k]
        for s, vid in dispatch_slot_reads[k]:
            li = occupant.get(s)
            at = f"{where}: dispatch {k} (node {node})"
            if li is None:
                raise PlanError(f"{at} reads slot {s} before any load into it")
            if li not in waited:
                raise PlanError(f"{at} reads slot {s} before waiting for load {li}")
            ld = loads[li]
            want = value_buffer.get((payload, vid))
            if want != ld.buffer:
                raise PlanError(f"{at} reads value {vid} (buffer {want}) from slot {s}, which holds buffer {ld.buffer}")
            if ld.last_use >= 0 and node > ld.last_use:
                raise PlanError(f"{at} reads slot {s} after load {li}'s last_use {ld.last_use} (the slot may be reused)")
            last_reader[s] = node
