"""The weight-offload planner (gpudelegate.plan.offload), through plan_session.

Property tests draw random weight-read sequences (weights of random prime sizes read by linear
nodes, with and without bias, repeated, shared by two methods' payloads, some fp16-packed, some
pinned), a random prefetch depth and a random budget between the floor and "everything
resident", then replay the plan on a model of the device: loads land in their ring slots when
issued; at each node the dispatch's weight refs must find the right buffer, already waited for,
in the slot (or the right resident buffer); device weight bytes stay within the budget; loads in
flight while a node runs serve at most ``depth`` nodes; each load's ``at`` (the dispatch it is
issued before) is where the executors used to compute it, and comes no later than the first
dispatch that reads its slot. A budget of floor - 1 must raise. No executor computes ``at``
again (a grep over native/, web/ and core/webgpu/).

Pure core: no numpy (this file also runs inside Pyodide, see tests/core_tests.txt).
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from gpudelegate.errors import BudgetError, PlanError
from gpudelegate.plan import payloads_of, plan_session
from gpudelegate.plan.offload import check_loads, device_bytes, footprint, slot_reads
from gpudelegate.plan.prepack import plan_prepack
from gpudelegate.plan.types import DeviceLimits
from progbuild import ProgramBuilder, rand_floats

LIMITS = DeviceLimits(offset_alignment=16)
K = 3  # every weight is [N, K]: any weight can follow any other, the read order is free
SIZES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97]


def build_program(weights, sequences, layouts=None):
    """``weights``: N per weight; ``sequences``: per method, a list of node specs, each
    ``(weight index, with_bias)`` (a linear of the method's input) or ``None`` (a relu, no
    weight). ``layouts[i]``: "direct" (constant read by the op), "identity" or "fp16"."""
    b = ProgramBuilder()
    layouts = layouts or ["identity"] * len(weights)
    consts = [b.constant("float32", (n, K), rand_floats(n * K, seed=i)) for i, n in enumerate(weights)]
    biases = [b.constant("float32", (n,), rand_floats(n, seed=100 + i)) for i, n in enumerate(weights)]
    for m_i, seq in enumerate(sequences):
        pl = b.payload()
        x = pl.input("float32", (1, K), name="x")
        memo = {}

        def weight(kind, i):
            if (kind, i) not in memo:
                c = consts[i] if kind == "w" else biases[i]
                v = pl.constant(c, name=f"{kind}{i}")
                if layouts[i] != "direct":
                    v = pl.prepack(v, layouts[i])
                memo[(kind, i)] = v
            return memo[(kind, i)]

        last = x
        for spec in seq:
            if spec is None:
                last = pl.op("relu", [last])
            else:
                i, with_bias = spec
                args = [x, weight("w", i)] + ([weight("b", i)] if with_bias else [])
                last = pl.op("linear", args)
        pl.output(last)
        pl.schedule_offload()
        m = b.method(f"method{m_i}")
        m.output(*m.delegate(pl, [m.input("float32", (1, K))]))
    return b.build()


def replay(prog, plan, budget):
    """Run the plan on a model of the device; returns the bytes streamed per payload."""
    off = plan.offload
    buffers = plan.prepack.buffers
    resident = set(off.resident)
    assert resident.isdisjoint(off.streamed) and resident | set(off.streamed) == set(range(len(buffers)))
    resident_bytes = sum(device_bytes(buffers[b]) for b in resident)
    assert off.peak_bytes == resident_bytes + sum(off.slots) <= budget
    streamed_bytes = {}
    for p, pp in plan.payloads.items():
        loads = off.loads[p]
        assert [ld.issue_before for ld in loads] == sorted(ld.issue_before for ld in loads), "loads in issue order"
        check_at(plan, p)
        slot = {}  # slot -> the load last issued into it
        last_reader = {}  # slot -> last node (this run) that read it
        for t, d in enumerate(pp.dispatches):
            for ld in (ld for ld in loads if ld.issue_before == t):
                assert ld.issue_before <= ld.needed_by <= ld.last_use
                assert device_bytes(buffers[ld.buffer]) <= off.slots[ld.slot]
                assert ld.buffer in off.streamed
                # The copy overwrites the slot: whoever read it before must have run, and the
                # plan must name that node for the executor's event wait.
                assert ld.reuse_after == last_reader.get(ld.slot, -1) and ld.reuse_after < t
                slot[ld.slot] = ld
            in_flight = [ld for ld in loads if ld.issue_before <= t < ld.needed_by]
            assert len({ld.needed_by for ld in in_flight}) <= off.depth, f"node {t}: in flight {in_flight}"
            occupied = resident_bytes + sum(buffers[ld.buffer].nbytes for ld in slot.values())
            assert occupied <= resident_bytes + sum(off.slots) <= budget
            for ref in [r for r in d.args if r is not None] + d.outputs:
                want = plan.prepack.value_buffer.get((p, ref.value))
                if want is None:
                    assert ref.buf.space == "arena"
                elif want in resident:
                    assert (ref.buf.space, ref.buf.index) == ("resident", want)
                else:
                    assert ref.buf.space == "slot", f"node {t}: streamed weight {want} not read from a slot"
                    ld = slot.get(ref.buf.index)
                    assert ld is not None and ld.buffer == want, f"node {t}: slot {ref.buf.index} holds the wrong weight"
                    assert ld.needed_by <= t <= ld.last_use, f"node {t}: weight {want} read before its load was waited for"
                    last_reader[ref.buf.index] = t
        # every streamed weight a node reads came through a load of this run
        streamed_bytes[p] = sum(buffers[ld.buffer].nbytes for ld in loads)
        assert off.stream_bytes[p] == streamed_bytes[p]
    return streamed_bytes


def check_at(plan, p):
    """Every load's ``at`` is where the executors used to compute it, the first dispatch whose
    node is at least ``max(issue_before, reuse_after + 1)`` (scanned here, not bisected), and no
    later than the first dispatch that reads its weight from its slot."""
    disp = plan.payloads[p].dispatches
    vb = plan.prepack.value_buffer
    loads = plan.offload.loads[p]
    assert [ld.at for ld in loads] == sorted(ld.at for ld in loads), "loads listed by position"
    for ld in loads:
        t = max(ld.issue_before, ld.reuse_after + 1)
        old = next((k for k, d in enumerate(disp) if d.node >= t), len(disp))
        assert ld.at == old, (ld, old)
        readers = [k for k, d in enumerate(disp) if d.node >= ld.issue_before
                   and any(s == ld.slot and vb[(p, v)] == ld.buffer for s, v in slot_reads(d.args))]
        assert readers, f"load {ld} is read by no dispatch"
        assert ld.at <= readers[0] and disp[readers[0]].node == ld.needed_by, (ld, readers)


def reads_of(prog):
    pids = payloads_of(prog)
    _, weights, _ = plan_prepack(prog, pids)
    return {p: weights[p].reads for p in pids}




@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_read_sequences_replay_within_budget(data):
    n_w = data.draw(st.integers(3, 8), label="weights")
    weights = data.draw(st.lists(st.sampled_from(SIZES), min_size=n_w, max_size=n_w), label="N")
    layouts = data.draw(st.lists(st.sampled_from(["identity", "identity", "fp16", "direct"]), min_size=n_w,
                                 max_size=n_w), label="layouts")
    spec = st.one_of(st.none(), st.tuples(st.integers(0, n_w - 1), st.booleans()), st.tuples(st.integers(0, n_w - 1), st.just(False)))
    seqs = data.draw(st.lists(st.lists(spec, min_size=4, max_size=16), min_size=1, max_size=2), label="sequences")
    depth = data.draw(st.integers(0, 3), label="depth")
    prog = build_program(weights, seqs, layouts)
    used = sorted({s[0] for seq in seqs for s in seq if s is not None})
    pinned = data.draw(st.lists(st.sampled_from([f"w{i}" for i in used]), max_size=2, unique=True) if used
                       else st.just([]), label="pinned")

    everything = plan_session(prog, LIMITS)
    total = sum(device_bytes(rb) for rb in everything.prepack.buffers)
    roomy = plan_session(prog, LIMITS, weight_budget=total, prefetch_depth=depth, pinned=pinned)
    floor = roomy.offload.floor
    assert 0 <= floor <= total and roomy.offload.streamed == []
    event(f"floor {'<' if floor < total else '=='} all resident")
    # Favour budgets that force streaming: the floor itself, or anything short of all resident.
    budget = data.draw(st.one_of(st.just(floor), st.integers(floor, max(floor, total - 4))), label="budget")
    plan = plan_session(prog, LIMITS, weight_budget=budget, prefetch_depth=depth, pinned=pinned)
    assert plan.offload.floor == floor and plan.offload.budget == budget and plan.offload.depth == depth
    replay(prog, plan, budget)
    event(f"streamed weights: {'none' if not plan.offload.streamed else ('1' if len(plan.offload.streamed) == 1 else '2+')}")
    event(f"ring slots: {min(len(plan.offload.slots), 3)}")
    # pinned weights are resident
    pinned_bufs = {plan.prepack.value_buffer[(p, v)] for p in plan.payloads
                   for v, val in enumerate(prog.payloads[p].values) if val.name in pinned and (p, v) in plan.prepack.value_buffer}
    assert pinned_bufs <= set(plan.offload.resident)
    # no streamed weight could have been kept resident on its own within the budget
    reads = reads_of(prog)
    bufs = plan.prepack.buffers
    streamed = set(plan.offload.streamed)
    assert footprint(reads, bufs, streamed, depth) == plan.offload.peak_bytes
    for b in streamed:
        assert footprint(reads, bufs, streamed - {b}, depth) > budget
    if floor > 0:
        with pytest.raises(BudgetError, match=rf"below the offload floor of {floor} bytes"):
            plan_session(prog, LIMITS, weight_budget=floor - 1, prefetch_depth=depth, pinned=pinned)


# ----------------------------------------------------------------------------- unit tests

W = 13 * K * 4  # bytes of one [13, 3] float32 weight


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_floor_of_a_uniform_chain_is_depth_plus_one_weights(depth):
    # Six equal weights read once each, in order: the ring holds the weight in use plus the next
    # `depth` ones, so the floor is (depth + 1) weights; one byte less is refused, loudly.
    prog = build_program([13] * 6, [[(i, False) for i in range(6)]])
    plan = plan_session(prog, LIMITS, weight_budget=(depth + 1) * W, prefetch_depth=depth)
    assert plan.offload.floor == (depth + 1) * W
    assert plan.offload.slots == [W] * (depth + 1) and plan.offload.resident == []
    assert plan.offload.stream_bytes == {0: 6 * W}
    replay(prog, plan, (depth + 1) * W)
    with pytest.raises(BudgetError) as e:
        plan_session(prog, LIMITS, weight_budget=(depth + 1) * W - 1, prefetch_depth=depth)
    msg = str(e.value)
    assert f"below the offload floor of {(depth + 1) * W} bytes for prefetch depth {depth}" in msg
    assert f"largest weight: w0, {W} bytes" in msg


def test_loads_are_prefetched_depth_nodes_ahead():
    prog = build_program([13] * 5, [[(0, False), None, (1, False), (2, False), None, (3, False), (4, False)]])
    plan = plan_session(prog, LIMITS, weight_budget=3 * W, prefetch_depth=2)
    got = [(ld.buffer, ld.issue_before, ld.needed_by) for ld in plan.offload.loads[0]]
    # weight-reading nodes are 0, 2, 3, 5, 6: group j is issued before group j-2's node runs
    assert got == [(0, 0, 0), (1, 0, 2), (2, 0, 3), (3, 2, 5), (4, 3, 6)]


def test_load_positions_are_planned_and_checked():
    # Depth 0 with two slots: w2 goes into w0's slot once node 0 (w0's last reader) has run, so
    # its position is set by reuse_after, not by issue_before alone.
    prog = build_program([13] * 4, [[(0, False), (1, False), (2, False), (3, False)]])
    plan = plan_session(prog, LIMITS, weight_budget=2 * W, prefetch_depth=1)
    got = [(ld.buffer, ld.issue_before, ld.reuse_after, ld.needed_by, ld.at) for ld in plan.offload.loads[0]]
    assert got == [(0, 0, -1, 0, 0), (1, 0, -1, 1, 0), (2, 1, 0, 2, 1), (3, 2, 1, 3, 2)]
    replay(prog, plan, 2 * W)
    pp = plan.payloads[0]
    nodes = [d.node for d in pp.dispatches]
    reads = [slot_reads(d.args) for d in pp.dispatches]
    vb = plan.prepack.value_buffer
    # A position after the dispatch that needs the weight cannot be carried out: a plan error.
    late = copy.deepcopy(plan.offload.loads[0])
    late[2].issue_before = late[2].at = 3
    with pytest.raises(PlanError, match=r"load 2 \(buffer 2 -> slot \d\) cannot be issued before node 3 .* after the node 2"):
        check_loads(0, nodes, reads, late, vb)
    # A position the node fields do not give (a stale or hand-edited ``at``) is refused too.
    stale = copy.deepcopy(plan.offload.loads[0])
    stale[2].at = 0
    with pytest.raises(PlanError, match=r"at=0, but issue_before=1 and reuse_after=0 put it before dispatch 1"):
        check_loads(0, nodes, reads, stale, vb)



def test_more_budget_keeps_more_resident_and_streams_less():
    prog = build_program([13] * 6, [[(i, False) for i in range(6)]])
    prev = None
    for extra in range(0, 4):
        plan = plan_session(prog, LIMITS, weight_budget=2 * W + extra * W, prefetch_depth=1)
        replay(prog, plan, 2 * W + extra * W)
        assert len(plan.offload.resident) == extra
        if extra:  # 4 bytes short of one more weight: one fewer resident
            short = plan_session(prog, LIMITS, weight_budget=2 * W + extra * W - 4, prefetch_depth=1)
            assert len(short.offload.resident) == extra - 1
        if prev is not None:
            assert plan.offload.stream_bytes[0] < prev
        prev = plan.offload.stream_bytes[0]
    full = plan_session(prog, LIMITS, weight_budget=6 * W, prefetch_depth=1)
    assert full.offload.streamed == [] and full.offload.slots == [] and full.offload.stream_bytes == {0: 0}


def test_weights_read_most_often_are_kept_first():
    # w0 is read by three separated nodes (three loads per run); w1..w4 once each.
    seq = [(0, False), (1, False), (0, False), (2, False), (3, False), (0, False), (4, False)]
    prog = build_program([13] * 5, [seq])
    plan = plan_session(prog, LIMITS, weight_budget=3 * W, prefetch_depth=1)
    assert plan.offload.resident == [0]
    replay(prog, plan, 3 * W)


def test_consecutive_reads_share_one_load():
    prog = build_program([13, 13], [[(0, True), (0, False), (1, False)]])
    plan = plan_session(prog, LIMITS, weight_budget=plan_floor(prog, 1), prefetch_depth=1)
    w0 = [ld for ld in plan.offload.loads[0] if ld.buffer == 0]
    assert [(ld.needed_by, ld.last_use) for ld in w0] == [(0, 1)]
    replay(prog, plan, plan.offload.budget)


def plan_floor(prog, depth, pinned=()):
    roomy = plan_session(prog, LIMITS, weight_budget=1 << 30, prefetch_depth=depth, pinned=pinned)
    return roomy.offload.floor


def test_pinned_weights_stay_resident_and_raise_the_floor():
    prog = build_program([13] * 6, [[(i, False) for i in range(6)]])
    floor = plan_floor(prog, 1, pinned=["w2"])
    assert floor == 3 * W  # w2 resident + two ring slots
    plan = plan_session(prog, LIMITS, weight_budget=floor, prefetch_depth=1, pinned=["w2"])
    assert plan.prepack.buffers[plan.offload.resident[0]].constant == 2 and len(plan.offload.resident) == 1
    replay(prog, plan, floor)
    with pytest.raises(BudgetError, match=r"pinned weight 'w9' is not a weight read by the planned payloads \(names: w0"):
        plan_session(prog, LIMITS, weight_budget=floor, pinned=["w9"])


def test_two_methods_share_one_ring_and_one_resident_set():
    prefill = [(i, True) for i in range(4)]
    decode = [(3, True), (2, True), (1, True), (0, True)]
    prog = build_program([5, 29, 11, 17], [prefill, decode])
    depth = 1
    floor = plan_floor(prog, depth)
    plan = plan_session(prog, LIMITS, weight_budget=floor, prefetch_depth=depth)
    assert len(plan.prepack.buffers) == 8  # 4 weights + 4 biases, once for both methods
    assert set(plan.offload.loads) == {0, 1}
    used_slots = {ld.slot for ls in plan.offload.loads.values() for ld in ls}
    assert used_slots == set(range(len(plan.offload.slots)))
    replay(prog, plan, floor)
    # the ring for one method alone is not smaller than for both: they take turns in it
    alone = plan_floor(build_program([5, 29, 11, 17], [prefill]), depth)
    assert floor == alone


def test_weight_returned_as_output_is_resident():
    b = ProgramBuilder()
    c = b.constant("float32", (13, K), rand_floats(13 * K, seed=9))
    d = b.constant("float32", (13, K), rand_floats(13 * K, seed=10))
    e = b.constant("float32", (13, K), rand_floats(13 * K, seed=11))
    pl = b.payload()
    x = pl.input("float32", (1, K))
    wc = pl.prepack(pl.constant(c, name="table"))
    y = pl.op("linear", [x, wc])
    y = pl.op("linear", [y, pl.op("reshape", [pl.prepack(pl.constant(d, name="other"))], {"shape": [K, 13]})])
    y = pl.op("linear", [y, pl.prepack(pl.constant(e, name="third"))])
    pl.output(y, wc)
    m = b.method("forward")
    m.output(*m.delegate(pl, [m.input("float32", (1, K))]))
    prog = b.build()
    # the table must stay resident (the caller reads it after the run); the others share one slot
    assert plan_floor(prog, 0) == 2 * W
    plan = plan_session(prog, LIMITS, weight_budget=2 * W, prefetch_depth=0)
    assert plan.offload.resident == [0] and plan.payloads[0].outputs[1].buf.space == "resident"
    assert plan.offload.slots == [W]
    replay(prog, plan, 2 * W)


def test_no_budget_means_no_offload_plan():
    prog = build_program([13] * 3, [[(i, False) for i in range(3)]])
    plan = plan_session(prog, LIMITS)
    assert plan.offload is None
    assert all(d.args[1].buf.space == "resident" for d in plan.payloads[0].dispatches)


@pytest.mark.parametrize("kwargs, message", [
    (dict(weight_budget=-1), r"weight_budget must be a non-negative int \(bytes\), got -1"),
    (dict(weight_budget=1.5), r"weight_budget must be a non-negative int \(bytes\), got 1.5"),
    (dict(weight_budget=1 << 20, prefetch_depth=-1), r"prefetch_depth must be a non-negative int, got -1"),
])
def test_bad_offload_options_raise_budget_error(kwargs, message):
    prog = build_program([13], [[(0, False)]])
    with pytest.raises(BudgetError, match=message):
        plan_session(prog, LIMITS, **kwargs)
