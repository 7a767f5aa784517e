"""The reference executor carries plans out faithfully, so it checks the planners: a wrong memory
plan gives wrong numbers, a wrong offload schedule raises, a malformed plan is refused. Also its
prepack (chunks, progress, fp16 packing), IO binding and data transfers."""

import copy

import numpy as np
import pytest

import gpudelegate
from gpudelegate.environment import Environment
from gpudelegate.errors import InputError, PlanError
from gpudelegate.executor import DeviceTensor
from gpudelegate.native.reference import ReferenceContext, ReferenceExecutor
from gpudelegate.plan import plan_session
from gpudelegate.plan.types import BufferRef, TensorRef

from conformance.cases import CASES, build_program, golden, make_data, tolerance


def _case(cid):
    return next(c for c in CASES if c.id == cid)


def _setup(cid, **plan_kw):
    case = _case(cid)
    data = make_data(case, 0)
    prog, names = build_program(case, data)
    ctx = ReferenceContext()
    plan = plan_session(prog, ctx.limits, **plan_kw)
    return case, data, prog, names, ctx, plan


def _execute(ctx, prog, plan, inputs, progress=None):
    ex = ReferenceExecutor(ctx, prog)
    ex.allocate(plan)
    ex.record(plan)
    ex.prepack(plan, progress)
    return ex, ex.run(0, inputs)


def test_plan_as_planned_matches_golden():
    case, data, prog, names, ctx, plan = _setup("chain/mlp_block/float32")
    _, outs = _execute(ctx, prog, plan, [data[n] for n in names])
    rtol, atol = tolerance(case)
    np.testing.assert_allclose(outs[0], golden(case, data)[0], rtol=rtol, atol=atol)


def test_overlapping_memory_plan_gives_wrong_results():
    """Put a value at the bytes of another one that is still live: the reference must not hide it."""
    case, data, prog, names, ctx, plan = _setup("chain/mlp_block/float32")
    pp = plan.payloads[0]
    by_value = {r.value: r for d in pp.dispatches for r in d.outputs}
    pl = prog.payloads[0]
    # node 1 (gelu) writes "a" while the input x is still needed by the residual add (node 3):
    # move "a" onto x's bytes.
    x_ref = pp.inputs[0]
    a_vid = pl.nodes[1].outputs[0]
    bad = copy.deepcopy(plan)
    new = BufferRef(x_ref.buf.space, x_ref.buf.index, x_ref.buf.offset, by_value[a_vid].buf.nbytes)
    assert by_value[a_vid].buf.nbytes <= x_ref.buf.nbytes
    for d in bad.payloads[0].dispatches:
        for lst in (d.args, d.outputs):
            for i, r in enumerate(lst):
                if r is not None and r.value == a_vid:
                    lst[i] = TensorRef(r.value, r.dtype, r.shape, new)
    _, outs = _execute(ctx, prog, bad, [data[n] for n in names])
    want = golden(case, data)[0]
    assert not np.allclose(outs[0], want, rtol=1e-2, atol=1e-2)


def _offload_setup():
    case, data, prog, names, ctx, plan0 = _setup("chain/mlp_block/float32")
    floor = plan_session(prog, ctx.limits, weight_budget=1 << 40, prefetch_depth=0).offload.floor
    plan = plan_session(prog, ctx.limits, weight_budget=floor, prefetch_depth=0)
    assert plan.offload.streamed and plan.offload.loads[0]
    return case, data, prog, names, ctx, plan


def test_offload_plan_streams_and_matches_golden():
    case, data, prog, names, ctx, plan = _offload_setup()
    ex, outs = _execute(ctx, prog, plan, [data[n] for n in names])
    rtol, atol = tolerance(case)
    np.testing.assert_allclose(outs[0], golden(case, data)[0], rtol=rtol, atol=atol)
    assert ex.bytes_streamed == plan.offload.stream_bytes[0]
    assert set(ex.host_mirrors) == set(plan.offload.streamed)  # streamed weights stay on the host


def test_offload_load_into_wrong_slot_raises():
    case, data, prog, names, ctx, plan = _offload_setup()
    assert len(plan.offload.slots) >= 2, plan.offload
    bad = copy.deepcopy(plan)
    ld = bad.offload.loads[0][0]
    ld.slot = (ld.slot + 1) % len(bad.offload.slots)
    # either the weight does not fit the other slot, or a reader finds the wrong weight there
    with pytest.raises(PlanError, match="slot"):
        _execute(ctx, prog, bad, [data[n] for n in names])


def test_offload_wait_after_read_raises():
    case, data, prog, names, ctx, plan = _offload_setup()
    bad = copy.deepcopy(plan)
    ld = bad.offload.loads[0][0]
    ld.needed_by += 1  # the plan no longer waits for the copy before the first reader
    ld.last_use = max(ld.last_use, ld.needed_by)
    with pytest.raises(PlanError, match="before the plan waits for its load"):
        _execute(ctx, prog, bad, [data[n] for n in names])


def test_offload_reuse_before_last_reader_raises():
    """A load that overwrites its slot's occupant too early (reuse_after too small) is caught."""
    case, data, prog, names, ctx, plan = _offload_setup()
    loads = plan.offload.loads[0]
    later = [i for i, ld in enumerate(loads) if ld.reuse_after >= 0]
    assert later, "expected a slot reused within the run at depth 0"
    bad = copy.deepcopy(plan)
    # overwrite the slot before its occupant's reader ran: issued first, before dispatch 0
    ld = bad.offload.loads[0].pop(later[0])
    ld.issue_before, ld.reuse_after, ld.at = 0, -1, 0
    bad.offload.loads[0].insert(0, ld)
    with pytest.raises(PlanError, match="offload plan"):
        _execute(ctx, prog, bad, [data[n] for n in names])


def test_offload_load_placed_after_its_reader_raises():
    """The reference issues each copy at the plan's ``at``; one placed past the dispatch that
    needs it is refused before anything runs (the planner never makes one)."""
    case, data, prog, names, ctx, plan = _offload_setup()
    bad = copy.deepcopy(plan)
    loads = bad.offload.loads[0]
    loads[-1].at = len(bad.payloads[0].dispatches)
    with pytest.raises(PlanError, match="after node .* that needs it"):
        _execute(ctx, prog, bad, [data[n] for n in names])


def _alias_output_in_a_new_object(pp):
    """kv_update's output (an alias of the cache it updates) moved to a memory object of its own."""
    d = pp.dispatches[0]
    o = d.outputs[0]
    pp.memory.objects.append(o.buf.nbytes)
    d.outputs[0] = TensorRef(o.value, o.dtype, o.shape, BufferRef("arena", len(pp.memory.objects) - 1, 0, o.buf.nbytes))


def _input_past_its_memory_object(pp):
    """The first input moved to 4 bytes before the end of its memory object."""
    r = pp.inputs[0]
    size = pp.memory.objects[r.buf.index]
    pp.inputs[0] = TensorRef(r.value, r.dtype, r.shape, BufferRef("arena", r.buf.index, size - 4, r.buf.nbytes))


@pytest.mark.parametrize("cid,spoil,match", [
    ("kv_update/mid/float32", _alias_output_in_a_new_object, "must share the storage"),  # refused by record
    ("add/same/float32", _input_past_its_memory_object, "run past arena"),  # refused by allocate
], ids=["alias_op_must_share_storage", "location_outside_its_memory_object"])
def test_misplaced_tensor_is_refused(cid, spoil, match):
    case, data, prog, names, ctx, plan = _setup(cid)
    bad = copy.deepcopy(plan)
    spoil(bad.payloads[0])
    with pytest.raises(PlanError, match=match):
        _execute(ctx, prog, bad, [data[n] for n in names])


def test_prepack_chunks_progress_and_fp16_packing():
    case, data, prog, names, ctx, plan = _setup("linear/prepack_fp16/float32", chunk_bytes=200)
    seen = []
    ex, outs = _execute(ctx, prog, plan, [data[n] for n in names], progress=lambda d, t: seen.append((d, t)))
    total = sum(b.nbytes for b in plan.prepack.buffers)
    assert len(plan.prepack.chunks) >= 2 and len(seen) == len(plan.prepack.chunks)
    assert [t for _, t in seen] == [total] * len(seen) and seen[-1][0] == total
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))
    w = plan.prepack.value_buffer[(0, prog.payloads[0].prepack[0].dst)]
    assert plan.prepack.buffers[w].layout == "fp16"
    packed = np.frombuffer(ex.buffers[w], np.float16)
    np.testing.assert_array_equal(packed, data["w"].astype(np.float16).ravel())


def test_keep_on_device_and_zero_copy_feedback():
    case, data, prog, names, ctx, plan = _setup("kv_update/mid/float32")
    ex = ReferenceExecutor(ctx, prog)
    ex.allocate(plan)
    ex.record(plan)
    ex.prepack(plan)
    args = [data[n] for n in names]
    (cache,) = ex.run(0, args, keep_on_device=True)
    assert isinstance(cache, DeviceTensor) and cache.device == "reference"
    np.testing.assert_array_equal(cache.numpy(), golden(case, data)[0])
    # fed back as the cache input: it already sits at the planned location, no copy happens
    args2 = [cache, data["new"] * 2, np.array([0], np.int32)]
    (cache2,) = ex.run(0, args2, keep_on_device=True)
    assert np.shares_memory(cache.handle, cache2.handle)
    want = golden(case, {"cache": golden(case, data)[0].astype(np.float32), "new": data["new"] * 2,
                         "pos": np.array([0], np.int32)})[0]
    np.testing.assert_array_equal(cache2.numpy(), want)


def test_bad_inputs_raise_input_errors():
    case, data, prog, names, ctx, plan = _setup("add/same/float32")
    ex, _ = _execute(ctx, prog, plan, [data[n] for n in names])
    with pytest.raises(InputError, match="expected 2 inputs, got 1"):
        ex.run(0, [data["a"]])
    with pytest.raises(InputError, match="payload 3 is not planned"):
        ex.run(3, [data["a"], data["b"]])
    with pytest.raises(InputError, match="does not match"):
        ex.run(0, [data["a"][:2], data["b"]])


def test_session_on_reference_device_and_transfers():
    case = _case("softmax/last/float16")
    data = make_data(case, 0)
    prog, names = build_program(case, data)
    with Environment() as env:
        with env.session(gpudelegate.loads(prog.to_bytes()), device="reference") as sess:
            (y,) = sess.run("forward", [data["x"]], keep_on_device=True)
            assert y.dtype == "float16" and y.device == "reference"
            host = np.zeros(y.shape, np.float16)
            env.copy_tensors([y], [host])
            np.testing.assert_allclose(host.astype(np.float64), golden(case, data)[0], rtol=1e-2, atol=1e-3)
            env.copy_tensors([np.ones(y.shape, np.float16)], [y])  # host -> device
            np.testing.assert_array_equal(y.numpy(), np.ones(y.shape, np.float16))


def test_unknown_executor_option_is_refused():
    with pytest.raises(TypeError, match="unknown options"):
        ReferenceContext().create_executor(None, fast=True)
