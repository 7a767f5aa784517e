"""The single-allocation layout (gpudelegate.plan.layout) that the CUDA executor reads.

Checked on plans of a model-shaped program (a small Llama decoder, prefill + decode, with and
without weight offload): every region starts aligned, no two regions overlap, each fits its
allocation, the groups of fused GEMMs sit back to back, and the offsets are the ones the CUDA
executor used to compute for itself (its alignments and orders, each region packed right after
the one before), so moving the decision into the planner changed no address the executor uses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpudelegate.plan import plan_session
from gpudelegate.plan.fusion import cat_candidates
from gpudelegate.plan.layout import HOST_ALIGN, pack_offsets, plan_layout
from gpudelegate.plan.types import DeviceLimits

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_cuda as bc  # noqa: E402

LIMITS = DeviceLimits(max_buffer_size=1 << 34, max_binding_size=1 << 34, offset_alignment=256, name="test")
TINY = bc.LlamaConfig(vocab=257, dim=96, layers=2, heads=6, kv_heads=2, hidden=160, max_ctx=37)


def _program():
    return bc.llama_program(TINY, bc.random_weights(TINY, 0), {"prefill": 7, "decode": 1})


def _disjoint(regions, total, align, what):
    """``regions``: (name, offset, nbytes). Aligned starts, inside ``total``, no overlap."""
    end = 0
    for name, off, n in sorted(regions, key=lambda r: (r[1], r[2])):
        assert off % align == 0, f"{what}: {name} starts at {off}, not a multiple of {align}"
        assert off >= end or n == 0, f"{what}: {name} at {off} overlaps the region ending at {end}"
        end = max(end, off + n)
    assert end <= total, f"{what}: regions end at {end}, past the {total}-byte allocation"


def _packed_in_order(regions, align, total, what):
    """``regions``: (name, offset, nbytes) in the order the CUDA executor packed them. Each starts
    at the end of the one before, rounded up to ``align`` (the first at 0), and ``total`` is where
    the last ends: no gap beyond alignment, no region out of order."""
    end = 0
    for name, off, n in regions:
        start = -(-end // align) * align
        assert off == start, f"{what}: {name} starts at {off}, packed in order it would start at {start}"
        end = off + n
    assert total == end, f"{what}: {total} bytes, the packed regions end at {end}"


@pytest.mark.parametrize("offload", [False, True])
def test_layout_is_aligned_disjoint_and_what_cuda_packed(offload):
    prog = _program()
    plan = plan_session(prog, LIMITS)
    if offload:
        total = sum(b.nbytes for b in plan.prepack.buffers)
        plan = plan_session(prog, LIMITS, weight_budget=total // 2, prefetch_depth=1)
        assert plan.offload.streamed, "half the weights should not fit: something must stream"
    lay = plan.layout
    assert lay is not None and lay == plan_layout(plan)  # the planner sets it; recomputing agrees
    bufs = plan.prepack.buffers

    _disjoint([(f"payload {p} object {k}", o, plan.payloads[p].memory.objects[k]) for (p, k), o in lay.arena.items()],
              lay.arena_bytes, LIMITS.offset_alignment, "arena")
    objects = [(p, k) for p, pp in plan.payloads.items() for k in range(len(pp.memory.objects))]
    assert set(lay.arena) == set(objects)

    streamed = set(plan.offload.streamed) if plan.offload else set()
    slots = plan.offload.slots if plan.offload else []
    assert sorted(lay.weight_order) == [i for i in range(len(bufs)) if i not in streamed]
    weights = [(f"buffer {i}", lay.resident[i], bufs[i].nbytes) for i in lay.weight_order]
    weights += [(f"slot {j}", o, slots[j]) for j, o in enumerate(lay.slots)]
    _disjoint(weights, lay.weight_bytes, LIMITS.weight_alignment, "weight block")
    assert lay.weight_padding == lay.weight_bytes - sum(bufs[i].nbytes for i in lay.weight_order) - sum(slots)

    assert sorted(lay.mirror) == sorted(streamed)
    _disjoint([(f"buffer {i}", o, bufs[i].nbytes) for i, o in lay.mirror.items()], lay.mirror_bytes, HOST_ALIGN, "mirror")

    # q/k/v and gate/up of every layer sit back to back (one GEMM reads their concatenation)
    cats = cat_candidates(plan)
    assert lay.adjacent == [tuple(g) for g in cats]
    if not offload:
        assert len(cats) == 2 * TINY.layers
    for gr in lay.adjacent:
        for a, b in zip(gr, gr[1:]):
            assert lay.resident[a] + bufs[a].nbytes == lay.resident[b]

    # the offsets CudaExecutor._allocate computed before the layout moved into the planner: its
    # alignments (256, 16, 64) and orders, stated here rather than taken from the planner
    _packed_in_order([(f"payload {p} object {k}", lay.arena[p, k], plan.payloads[p].memory.objects[k])
                      for p, k in objects], 256, lay.arena_bytes, "arena")
    grouped = [b for gr in cats if not set(gr) & streamed for b in gr]  # fused groups first, then by index
    assert lay.weight_order == grouped + sorted(set(lay.weight_order) - set(grouped))
    _packed_in_order(weights, 16, lay.weight_bytes, "weight block")
    _packed_in_order([(f"buffer {i}", lay.mirror[i], bufs[i].nbytes) for i in sorted(streamed)], 64,
                     lay.mirror_bytes, "mirror")


def test_pack_offsets():
    offs, total = pack_offsets([5, 17, 0, 3], 16)
    assert offs == [0, 16, 48, 48] and total == 51
    assert pack_offsets([], 256) == ([], 0)
