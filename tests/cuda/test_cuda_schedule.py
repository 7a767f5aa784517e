"""The CUDA executor's offload stream schedule (native/cuda_schedule.py), checked without a GPU.

The schedule decides which event each CUDA stream waits for. These tests take plans from the real
planner (budgets from the floor to everything resident, several prefetch depths), derive the
schedule, and then *simulate the two streams* with random durations: every copy into a slot must
start after the last reader of the slot's previous occupant has finished, and every dispatch must
start after the copies of the weights it reads have finished and before they are overwritten.
"""

import random
from dataclasses import dataclass

import pytest

from gpudelegate.errors import BudgetError, PlanError
from gpudelegate.native.cuda_schedule import build_schedule, slot_reads
from gpudelegate.plan import plan_session
from gpudelegate.plan.layout import pack_offsets
from gpudelegate.plan.types import BufferRef, DeviceLimits, OffloadLoad, TensorRef
from progbuild import ProgramBuilder, rand_floats

LIMITS = DeviceLimits(max_buffer_size=1 << 30, max_binding_size=1 << 30, offset_alignment=256, name="test")


def mlp_program(widths, reuse_first=False):
    """A chain of linear layers (prepacked weights, export's offload schedule); with
    ``reuse_first`` the first weight is read again at the end (a reload after a gap)."""
    b = ProgramBuilder()
    p = b.payload()
    x = p.input("float32", (3, widths[0]), "x")
    ws = []
    for i, (k, n) in enumerate(zip(widths, widths[1:])):
        c = b.constant("float32", (n, k), rand_floats(n * k, seed=i))
        ws.append(p.prepack(p.constant(c, f"w{i}")))
    h = x
    for w in ws:
        h = p.op("relu", [p.op("linear", [h, w])])
    if reuse_first and widths[-1] == widths[0]:
        h = p.op("linear", [h, ws[0]])
    p.output(h)
    p.schedule_offload()
    m = b.method("forward")
    (y,) = m.delegate(p, [m.input("float32", (3, widths[0]), "x")])
    m.output(y)
    return b.build()


def schedule_of(plan, p=0):
    pp = plan.payloads[p]
    return build_schedule(p, [d.node for d in pp.dispatches], [slot_reads(d.args) for d in pp.dispatches],
                          plan.offload.loads[p], plan.prepack.value_buffer)


@dataclass
class Interval:
    start: float
    end: float


def simulate(plan, sched, runs=3, seed=0):
    """Event-driven model of the executor's enqueue order (``CudaExecutor._execute``) on two
    in-order streams; returns per run the dispatch and copy intervals."""
    rng = random.Random(seed)
    pp = plan.payloads[0]
    t_compute = t_copy = 0.0
    history = []
    for _ in range(runs):
        start = t_compute  # start_event recorded on compute
        t_copy = max(t_copy, start)  # copy waits for it
        release, loaded = {}, {}
        disp, copies = [], {}
        for k, d in enumerate(pp.dispatches):
            step = sched.steps[k]
            for li in step.issue:
                r = sched.copy_after[li]
                if r is not None:
                    t_copy = max(t_copy, release[r])  # recorded earlier in this run (checked below)
                s = t_copy
                t_copy = s + rng.uniform(0.1, 3.0)
                copies[li] = Interval(s, t_copy)
                loaded[li] = t_copy
            for li in step.wait:
                t_compute = max(t_compute, loaded[li])
            s = t_compute
            t_compute = s + rng.uniform(0.1, 3.0)
            disp.append(Interval(s, t_compute))
            if step.release:
                release[k] = t_compute
        t_compute = max(t_compute, t_copy)  # end_event join
        history.append((disp, copies))
    return history


def check_history(plan, sched, history):
    pp = plan.payloads[0]
    loads = plan.offload.loads[0]
    prev_end = -1.0
    for disp, copies in history:
        assert disp[0].start >= prev_end  # runs do not overlap
        prev_end = max(max(i.end for i in disp), max((c.end for c in copies.values()), default=0))
        # occupant of each slot over time: copies sorted by start
        for k, d in enumerate(pp.dispatches):
            for s, vid in slot_reads(d.args):
                want = plan.prepack.value_buffer[(0, vid)]
                # the load into s most recently started before dispatch k starts
                cands = [li for li, c in copies.items() if loads[li].slot == s and c.start <= disp[k].start]
                li = max(cands, key=lambda i: copies[i].start)
                assert loads[li].buffer == want, f"dispatch {k} reads the wrong weight from slot {s}"
                assert copies[li].end <= disp[k].start, f"dispatch {k} starts before its weight arrived"
                later = [c for j, c in copies.items() if loads[j].slot == s and c.start > copies[li].start]
                for c in later:  # whatever overwrites the slot next starts after this read ended
                    assert c.start >= disp[k].end, f"slot {s} overwritten while dispatch {k} reads it"


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("reuse_first", [False, True])
def test_schedule_is_safe_for_every_budget(depth, reuse_first):
    prog = mlp_program([13, 11, 7, 13, 5, 13, 11, 7, 13, 5, 13], reuse_first=reuse_first)
    full = plan_session(prog, LIMITS)
    total = sum(b.nbytes for b in full.prepack.buffers)
    floor = plan_session(prog, LIMITS, weight_budget=total, prefetch_depth=depth).offload.floor
    budgets = sorted(b for b in {floor, (floor + total) // 2, total - 4, total} if b >= floor)
    streamed_some = False
    for budget in budgets:
        plan = plan_session(prog, LIMITS, weight_budget=budget, prefetch_depth=depth)
        if not plan.offload.loads.get(0):
            continue
        streamed_some = True
        sched = schedule_of(plan)
        # Two derivations of "which node must finish before this copy" agree with the planner's.
        node_of = [d.node for d in plan.payloads[0].dispatches]
        for ld, k in zip(plan.offload.loads[0], sched.copy_after):
            assert ld.reuse_after == (-1 if k is None else node_of[k])
        for seed in range(5):
            check_history(plan, sched, simulate(plan, sched, seed=seed))
    assert streamed_some
    with pytest.raises(BudgetError, match="floor"):
        plan_session(prog, LIMITS, weight_budget=floor - 1, prefetch_depth=depth)


def test_rejects_read_before_wait():
    loads = [OffloadLoad(buffer=0, slot=0, issue_before=0, needed_by=1, at=0)]
    with pytest.raises(PlanError, match="before waiting for load 0"):
        build_schedule(0, [0, 1], [[(0, 5)], []], loads, {(0, 5): 0})


def test_rejects_wrong_occupant():
    loads = [OffloadLoad(buffer=1, slot=0, issue_before=0, needed_by=0, at=0)]
    with pytest.raises(PlanError, match="holds buffer 1"):
        build_schedule(0, [0], [[(0, 5)]], loads, {(0, 5): 0})


def test_rejects_overwrite_before_use():
    loads = [OffloadLoad(buffer=0, slot=0, issue_before=0, needed_by=1, at=0),
             OffloadLoad(buffer=1, slot=0, issue_before=0, needed_by=1, at=0)]
    with pytest.raises(PlanError, match="overwrites slot 0"):
        build_schedule(0, [0, 1], [[], [(0, 5)]], loads, {(0, 5): 1})


def test_rejects_issue_after_need_and_unknown_node():
    with pytest.raises(PlanError, match="after the node 0 that needs it"):
        build_schedule(0, [0, 1], [[(0, 5)], []], [OffloadLoad(0, 0, 1, 0, at=1)], {(0, 5): 0})
    with pytest.raises(PlanError, match="needed_by=7 names no dispatched node"):
        build_schedule(0, [0, 1], [[], []], [OffloadLoad(0, 0, 0, 7, at=0)], {})


def test_rejects_a_position_that_disagrees_with_the_node_fields():
    # issue_before 1 puts the copy before dispatch 1; a plan saying 0 was edited or is stale
    with pytest.raises(PlanError, match="at=0, but issue_before=1"):
        build_schedule(0, [0, 1], [[], [(0, 5)]], [OffloadLoad(0, 0, 1, 1, at=0)], {(0, 5): 0})


def test_reload_waits_for_last_reader():
    # slot 0: buffer 0 read by nodes 0 and 1, then buffer 1 (issued before node 2) read by node 3
    loads = [OffloadLoad(0, 0, 0, 0, at=0, last_use=1), OffloadLoad(1, 0, 2, 3, at=2, last_use=3, reuse_after=1)]
    reads = [[(0, 10)], [(0, 10)], [], [(0, 11)]]
    vb = {(0, 10): 0, (0, 11): 1}
    s = build_schedule(0, [0, 1, 2, 3], reads, loads, vb)
    assert s.copy_after == [None, 1]
    assert s.releases == [1]
    assert s.steps[0].issue == [0] and s.steps[2].issue == [1] and s.steps[3].wait == [1]
    # The executor waits for reuse_after and nothing else, so a plan naming an earlier reader
    # (the copy would overwrite buffer 0 while node 1 reads it) is refused.
    early = [loads[0], OffloadLoad(1, 0, 2, 3, at=2, last_use=3, reuse_after=0)]
    with pytest.raises(PlanError, match="must wait for node 1"):
        build_schedule(0, [0, 1, 2, 3], reads, early, vb)


def test_slot_reads_and_pack_offsets():
    refs = [TensorRef(3, "float32", (2,), BufferRef("slot", 1, 0, 8)), None,
            TensorRef(4, "float32", (2,), BufferRef("arena", 0, 0, 8))]
    assert slot_reads(refs) == [(1, 3)]
    offs, total = pack_offsets([5, 17, 0, 3], 16)
    assert offs == [0, 16, 48, 48] and total == 51
