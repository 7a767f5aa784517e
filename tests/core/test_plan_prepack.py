"""The prepack planner (gpudelegate.plan.prepack) and the dispatch refs plan_session builds on it.

Pure core: no numpy (this file also runs inside Pyodide, see tests/core_tests.txt).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from gpudelegate.errors import DeviceError, InputError, PayloadError
from gpudelegate.plan import plan_session
from gpudelegate.plan.prepack import chunk_buffers
from gpudelegate.plan.types import DeviceLimits, ResidentBuffer
from gpudelegate.program import OffloadSchedule, PrepackEntry
from progbuild import ProgramBuilder, rand_floats

LIMITS = DeviceLimits(offset_alignment=16)


def two_method_program(fp16_head=False):
    """prefill and decode, each its own payload, sharing weights: w1 prepacked (identity) in
    both, w2 read directly by prefill and prepacked by decode, head packed to fp16 in decode."""
    b = ProgramBuilder()
    w1 = b.constant("float32", (7, 5), rand_floats(35, seed=1))
    w2 = b.constant("float32", (5, 7), rand_floats(35, seed=2))
    head = b.constant("float32", (3, 5), rand_floats(15, seed=3))
    payloads = {}
    for name, t in (("prefill", 11), ("decode", 1)):
        pl = b.payload()
        x = pl.input("float32", (t, 5), name="x")
        h = pl.op("linear", [x, pl.prepack(pl.constant(w1, name="w1"))])
        w2v = pl.constant(w2, name="w2")
        h = pl.op("linear", [h, w2v if name == "prefill" else pl.prepack(w2v)])
        layout = "fp16" if (fp16_head and name == "decode") else "identity"
        h = pl.op("linear", [h, pl.prepack(pl.constant(head, name="head"), layout)])
        pl.output(h)
        pl.schedule_offload()
        m = b.method(name)
        (y,) = m.delegate(pl, [m.input("float32", (t, 5))])
        m.output(y)
        payloads[name] = pl.index
    return b.build(), (w1, w2, head), payloads


def test_shared_constants_are_prepacked_once():
    prog, (w1, w2, head), idx = two_method_program()
    plan = plan_session(prog, LIMITS)
    keys = [(rb.constant, rb.layout) for rb in plan.prepack.buffers]
    assert keys == [(w1, "identity"), (w2, "identity"), (head, "identity")]  # first-use order
    # every read of w1 (a prepack dst in each payload) maps to the same buffer
    for p in idx.values():
        pl = prog.payloads[p]
        for k, d in enumerate(plan.payloads[p].dispatches):
            w = d.args[1]
            assert w.buf.space == "resident"
            assert plan.prepack.buffers[w.buf.index].constant == [w1, w2, head][k]
            assert plan.prepack.value_buffer[(p, w.value)] == w.buf.index
            assert (w.dtype, w.shape) == (pl.values[w.value].dtype, pl.values[w.value].shape)
    assert plan.offload is None  # no budget: everything resident


def test_fp16_layout_is_its_own_buffer_at_half_the_bytes():
    prog, (w1, w2, head), idx = two_method_program(fp16_head=True)
    plan = plan_session(prog, LIMITS)
    bufs = {(rb.constant, rb.layout): rb for rb in plan.prepack.buffers}
    assert set(bufs) == {(w1, "identity"), (w2, "identity"), (head, "identity"), (head, "fp16")}
    packed = bufs[(head, "fp16")]
    assert packed == ResidentBuffer(head, "fp16", "float16", (3, 5), 30, 60)
    d = plan.payloads[idx["decode"]].dispatches[2]
    assert plan.prepack.buffers[d.args[1].buf.index] is packed and d.args[1].dtype == "float16"


def test_only_the_methods_asked_for_are_planned():
    prog, (w1, w2, head), idx = two_method_program(fp16_head=True)
    plan = plan_session(prog, LIMITS, methods=["prefill"])
    assert list(plan.payloads) == [idx["prefill"]]
    assert all(rb.layout == "identity" for rb in plan.prepack.buffers) and len(plan.prepack.buffers) == 3


def test_dispatch_refs_point_at_the_arena_for_activations():
    prog, _, idx = two_method_program()
    plan = plan_session(prog, LIMITS)
    pp = plan.payloads[idx["prefill"]]
    mp = pp.memory
    assert pp.inputs[0].buf == mp.locations[pp.inputs[0].value]
    for d in pp.dispatches:
        assert d.args[0].buf.space == "arena" and d.args[0].buf == mp.locations[d.args[0].value]
        assert d.outputs[0].buf == mp.locations[d.outputs[0].value]
    assert pp.outputs[0].buf == pp.dispatches[-1].outputs[0].buf


def test_view_of_a_weight_reads_the_same_buffer():
    b = ProgramBuilder()
    w = b.constant("float32", (15,), rand_floats(15, seed=4))
    pl = b.payload()
    x = pl.input("float32", (2, 3))
    wv = pl.op("reshape", [pl.prepack(pl.constant(w, name="w"))], {"shape": [5, 3]})
    pl.output(pl.op("linear", [x, wv]))
    m = b.method("forward")
    m.output(*m.delegate(pl, [m.input("float32", (2, 3))]))
    prog = b.build()
    plan = plan_session(prog, LIMITS)
    pp = plan.payloads[0]
    assert len(plan.prepack.buffers) == 1
    view = pp.dispatches[1].args[1]
    assert view.buf.space == "resident" and view.buf.index == 0 and view.shape == (5, 3)
    assert view.value not in pp.memory.locations


def _one_entry_program(src_dtype="float32", dst_dtype="float32", dst_shape=(4, 3), layout="identity",
                       src_is_constant=True):
    b = ProgramBuilder()
    c = b.constant("float32", (4, 3), rand_floats(12, seed=5))
    pl = b.payload()
    x = pl.input("float32", (1, 3))
    src = pl.constant(c, name="w") if src_is_constant else pl.input("float32", (4, 3))
    dst = pl.value(dst_dtype, dst_shape, "w.packed")
    pl.prepack_entries.append(PrepackEntry(src, dst, layout))
    pl.output(pl.op("linear", [x, dst], out=[("float32", (1, dst_shape[0]))]))
    m = b.method("forward")
    m.output(*m.delegate(pl, [m.input(*[(pl.values[i].dtype, pl.values[i].shape) for i in pl.inputs][0])]))
    return b.build()


@pytest.mark.parametrize("kwargs, message", [
    (dict(dst_shape=(3, 4)), r"dims differ: src float32\[4, 3\], dst float32\[3, 4\]"),
    (dict(dst_dtype="float16"), r"dtype: layout 'identity' turns float32\[4, 3\] into float32, dst is float16\[4, 3\]"),
    (dict(dst_dtype="int32", layout="fp16"), r"dtype: layout 'fp16' turns float32\[4, 3\] into float16, dst is int32\[4, 3\]"),
    (dict(layout="int4"), r"unknown layout 'int4' \(known: identity, fp16\)"),
    (dict(src_is_constant=False), r"src is not a constant value"),
])
def test_bad_prepack_entries_name_payload_and_entry(kwargs, message):
    prog = _one_entry_program(**kwargs)
    with pytest.raises(PayloadError, match=r"payloads\[0\]\.prepack\[0\] \(src \d+ .* -> dst \d+ .*\): " + message):
        plan_session(prog, LIMITS)


def test_fp16_of_a_non_float32_constant_is_refused():
    b = ProgramBuilder()
    c = b.constant("float16", (4, 3), rand_floats(12, seed=6))
    pl = b.payload()
    x = pl.input("float32", (1, 3))
    pl.output(pl.op("linear", [x, pl.prepack(pl.constant(c), "fp16")]))
    m = b.method("forward")
    m.output(*m.delegate(pl, [m.input("float32", (1, 3))]))
    with pytest.raises(PayloadError, match=r"payloads\[0\]\.prepack\[0\].*fp16 layout packs float32, but src is float16"):
        plan_session(b.build(), LIMITS)


def test_constant_value_disagreeing_with_its_constant_is_refused():
    prog, (w1, w2, head), idx = two_method_program()
    pl = prog.payloads[idx["prefill"]]
    v = next(i for i, v in enumerate(pl.values) if v.constant == w2)
    pl.values[v].shape = (7, 5)
    with pytest.raises(PayloadError, match=rf"payloads\[{idx['prefill']}\]\.values\[{v}\]: value is float32\[7, 5\] "
                                           rf"but constants\[{w2}\] is float32\[5, 7\]"):
        plan_session(prog, LIMITS)


def test_in_place_update_of_a_weight_is_refused():
    b = ProgramBuilder()
    c = b.constant("float32", (1, 1, 4, 3), rand_floats(12, seed=7))
    pl = b.payload()
    new = pl.input("float32", (1, 1, 1, 3))
    pos = pl.input("int32", (1,))
    pl.output(pl.op("kv_update", [pl.constant(c, name="frozen_cache"), new, pos]))
    m = b.method("forward")
    m.output(*m.delegate(pl, [m.input("float32", (1, 1, 1, 3)), m.input("int32", (1,))]))
    with pytest.raises(PayloadError, match=r"payloads\[0\]\.ops\[0\]: kv_update would write in place into weight value 2 "
                                           r"\(frozen_cache\)"):
        plan_session(b.build(), LIMITS)


def test_offload_schedule_must_agree_with_the_graph():
    prog, _, idx = two_method_program()
    p = idx["decode"]
    reads = prog.payloads[p].offload.reads
    prog.payloads[p].offload = OffloadSchedule([reads[0], reads[2], reads[1]])
    with pytest.raises(PayloadError, match=rf"payloads\[{p}\]\.offload\.reads\[1\]: schedule says node 1 \(linear\) reads "
                                           rf"prepacked values \[{reads[2][0]}\], but its args read \[{reads[1][0]}\]"):
        plan_session(prog, LIMITS)
    prog.payloads[p].offload = OffloadSchedule(reads[:2])
    with pytest.raises(PayloadError, match=r"offload\.reads: 2 entries for 3 nodes"):
        plan_session(prog, LIMITS)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=0, max_size=30), st.integers(1, 400))
def test_chunks_cover_every_buffer_in_order_within_the_chunk_size(sizes, chunk_bytes):
    bufs = [ResidentBuffer(i, "identity", "float32", (n,), n, n) for i, n in enumerate(sizes)]
    chunks = chunk_buffers(bufs, chunk_bytes)
    assert [i for c in chunks for i in c] == list(range(len(sizes)))
    for c in chunks:
        total = sum(sizes[i] for i in c)
        assert total <= chunk_bytes or len(c) == 1, (c, total)
    # greedy: a chunk is closed only when the next buffer would not fit in it
    for a, nxt in zip(chunks, chunks[1:]):
        assert sum(sizes[i] for i in a) + sizes[nxt[0]] > chunk_bytes


def test_plan_chunks_use_device_bytes():
    prog, (w1, w2, head), _ = two_method_program(fp16_head=True)
    plan = plan_session(prog, LIMITS, chunk_bytes=140)
    sizes = [rb.nbytes for rb in plan.prepack.buffers]
    assert sizes == [140, 140, 60, 30]
    assert plan.prepack.chunks == [[0], [1], [2, 3]] and plan.prepack.chunk_bytes == 140


def test_weight_over_max_buffer_size_names_the_weight_and_limit():
    prog, (w1, w2, head), _ = two_method_program()
    limits = DeviceLimits(max_buffer_size=100, max_binding_size=100, offset_alignment=4)
    with pytest.raises(DeviceError, match=rf"weight w1 \(constants\[{w1}\], layout identity\) float32\[7, 5\] needs 140 "
                                          r"bytes, more than the device's max_buffer_size of 100 bytes"):
        plan_session(prog, limits)


def test_unknown_method_and_bad_payload_index_are_refused():
    prog, _, _ = two_method_program()
    with pytest.raises(InputError, match=r"method 'nope' is not in the program \(it has: prefill, decode\)"):
        plan_session(prog, LIMITS, methods=["nope"])
    prog.methods["decode"].nodes[0].attrs["payload"] = 7
    with pytest.raises(PayloadError, match=r"methods\.decode\.ops\[0\]\.attrs\.payload: 7 is not a payload index \(0\.\.1\)"):
        plan_session(prog, LIMITS)
