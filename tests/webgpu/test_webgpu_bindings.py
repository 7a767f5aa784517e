"""The WGSL lowering (core/webgpu/) never binds overlapping ranges in one call (Dawn rejects
overlapping writable bindings; all of ours are writable), checked over every conformance case.
Pure Python, but it needs the conformance cases (numpy), so it lives outside the numpy-free core
kernel tests."""

from __future__ import annotations

from gpudelegate.webgpu import lowering
from gpudelegate.plan.types import BufferRef, DeviceLimits, Dispatch, TensorRef

LIM = DeviceLimits(name="test")


def _ref(v, dtype, shape, index=0, offset=0):
    from gpudelegate import dtypes

    return TensorRef(v, dtype, tuple(shape), BufferRef("arena", index, offset, dtypes.nbytes(dtype, shape)))


def _overlaps(call):
    seen = []
    for b in call.bindings:
        r = b.buf
        for k in seen:
            if (k.space, k.index) == (r.space, r.index) and r.offset < k.offset + k.nbytes and k.offset < r.offset + r.nbytes:
                return b.binding
        seen.append(r)
    return None


def test_no_call_binds_overlapping_ranges():
    """Dawn rejects a dispatch whose writable storage bindings overlap (all of ours are writable):
    every conformance case, planned for a device with 256-byte offset alignment, is lowered to
    calls whose bindings are pairwise disjoint (dummies included)."""
    from conformance.cases import CASES, build_program, make_data
    from gpudelegate.plan import plan_session

    lim = DeviceLimits(offset_alignment=256, name="t")
    snapshots = 0
    for case in CASES:
        prog, _ = build_program(case, make_data(case))
        plan = plan_session(prog, lim)
        for p, pp in plan.payloads.items():
            for d in pp.dispatches:
                for c in lowering.select(d, lim):
                    assert _overlaps(c) is None, (case.id, c.label, c.bindings)
                    snapshots += "snapshot" in c.label
    assert snapshots, "no case reads one tensor twice: the snapshot path went untested"


def test_self_product_and_in_place_softmax_read_snapshots():
    x = _ref(0, "float32", (6, 6))
    (snap, mul) = lowering.select(Dispatch(0, "mul", {}, [x, x], [_ref(1, "float32", (6, 6), 1)]), LIM)
    assert "snapshot" in snap.label and mul.entry == "map" and _overlaps(mul) is None
    # The composite sdpa (long query blocks) puts scores and probabilities in distinct scratches.
    q = _ref(0, "float32", (1, 2, 40, 8))
    calls = lowering.select(Dispatch(0, "sdpa", {"causal": True}, [q, _ref(1, "float32", (1, 2, 40, 8), 1),
                                                                    _ref(2, "float32", (1, 2, 40, 8), 2)],
                                     [_ref(3, "float32", (1, 2, 40, 8), 3)]), LIM)
    assert [c.entry for c in calls if "snapshot" in c.label] == []
    assert all(_overlaps(c) is None for c in calls)
