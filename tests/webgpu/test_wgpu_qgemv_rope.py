"""The attention front of a packed decoder layer in one dispatch on WebGPU: quant_mm.wgsl
``qgemv_rope`` (core/webgpu/ops_fused.py ``_rope_in_product``, ops_quant.py ``cat_gemv_rope``),
the norm prologue, the q/k/v product, q's and k's rotation and the k / v cache writes, where the
planner's rope_kv group over a packed gemm_cat with a norm prologue ran qgemv_cat_norm into a
scratch and then rope_kv.

Cases: s = x + r, h = rms_norm(s) * w (or the norm alone), q / k / v = h W^T as [1, T, H, D]
viewed [1, H, T, D], q and k rotated, k and v written into [1, Hk, S, D] caches at pos. Sizes:
H = 7 query heads and Hk = 3 kv heads (primes, GQA) on q4_1, H = 6 and Hk = 2 on q4_0 and q8_0
(with 7 and 3 the planner does not group their products: its memory plan puts a member's output
over an input of the group), D = 12, S = 23 cache rows (prime), K = 96 or 160 (whole 32-value
blocks: 3 and 5 of them), M = T = 1..8 rows; positions at the cache's edges (0,
and S - T: the last rows; the session refuses positions past them before any kernel runs).
Each case runs with the fusion, with ``Tuning.qgemv_rope`` off (the two-dispatch path) and
without fusions, all against the float64 reference at the conformance tolerances (float32:
rtol 1e-4, atol 1e-5 sqrt(K), the accumulation over K; the rotation adds two products of values
of size ~sqrt(K) each, inside that bound), on the subgroup kernels (the device's size) and on
quant_mm.wgsl's trees. test_dawn_qgemv_rope.py runs them on Dawn.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from gpudelegate.plan import plan_session
from gpudelegate.plan.types import DeviceLimits
from gpudelegate.webgpu import lowering, ops_fused
from gpudelegate.webgpu.ops_quant import QPARAMS_WORDS

from conformance.cases import Case, build_program, golden, make_data, tolerance
from conformance.executors import environment_fixture
from test_wgpu_norm_prologue import _attention

pytestmark = pytest.mark.wgpu

env = environment_fixture("wgpu")

D, S = 12, 23
HEADS = {"q4_1": (7, 3), "q4_0": (6, 2), "q8_0": (6, 2)}  # (H, Hk) the planner groups (module docstring)


def front(T: int, K: int, weights: str, pos: int, add: bool = True) -> Case:
    """The attention front of one decoder layer (test_wgpu_norm_prologue.py's, with the position
    and the GQA heads chosen here)."""
    H, HK = HEADS[weights]
    case = _attention(T, K, weights, add=add, D=D, H=H, Hk=HK, S=S, pos=pos)
    return dataclasses.replace(case, id=f"qgemv_rope/{T}x{K}_{weights}_pos{pos}_{'add' if add else 'norm'}")


def run(env, case: Case, tuning, device: str = "wgpu"):
    """Outputs of ``case`` on ``device`` (each checked against the float64 golden) and the entry
    points the last kv_update's dispatch ran."""
    import gpudelegate

    data = make_data(case)
    prog, names = build_program(case, data)
    prog = gpudelegate.loads(prog.to_bytes())
    with env.session(prog, device=device, tuning=tuning) as s:
        outs = [np.asarray(o).astype(np.float64) for o in s.run("forward", [data[n] for n in names])]
        chain = [(n.op, [L.pipeline.label.split(":")[-1].strip() for L in n.launches])
                 for n in s.executor.recorded[0].nodes]
    rtol, atol = tolerance(case)
    for i, (g, w) in enumerate(zip(outs, golden(case, data))):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{case.id} output {i} {tuning} ({chain})")
    return outs, [e for op, e in chain if op == "kv_update"][-1]


VARIANTS = {"subgroups": lowering.Tuning(), "trees": lowering.Tuning(qgemv_subgroups=False)}


def check(env, case: Case, variant: str, device: str = "wgpu") -> None:
    """The fused run takes the whole front as one qgemv_rope dispatch; it, the two-dispatch path
    and the unfused ops all match the golden (run checks) and each other."""
    import dataclasses

    tuning = VARIANTS[variant]
    fused, entries = run(env, case, tuning, device)
    assert entries == ["qgemv_rope"], entries
    two, entries_two = run(env, case, dataclasses.replace(tuning, qgemv_rope=False), device)
    assert entries_two == ["qgemv_cat_norm", "rope_kv"], entries_two
    apart, _ = run(env, case, dataclasses.replace(tuning, fuse=False), device)
    rtol, atol = tolerance(case)
    for a, b, c in zip(fused, two, apart):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
        np.testing.assert_allclose(a, c, rtol=rtol, atol=atol)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T", [1, 2, 3, 5, 8])
def test_rows_and_packed_types(env, variant, T):
    weights = ("q4_1", "q4_0", "q8_0")[T % 3]
    check(env, front(T, 96 if T % 2 else 160, weights, pos=5), variant)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T,pos", [(1, 0), (1, S - 1), (3, S - 3), (8, S - 8), (4, 0)])
def test_positions_at_the_cache_edges(env, variant, T, pos):
    check(env, front(T, 96, "q4_1", pos), variant)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_plain_norm(env, variant):
    """Layer 0's front: the norm reads the embedding, no add, nothing written but the outputs."""
    check(env, front(1, 160, "q4_1", pos=7, add=False), variant)
    check(env, front(3, 96, "q8_0", pos=S - 3, add=False), variant)


def test_the_uniform_and_bindings():
    """qgemv_rope's QParams words 24..33 (D, T, S, cos, sin, pos, the three destinations, the
    flags) and its bindings: every tensor but the weights in one range of S (slot 8), the three
    weights at 3, 6, 7, the norm's weight at 4, X and R (2, 5) dummies, no OUT."""
    case = front(3, 96, "q4_1", pos=5)
    data = make_data(case)
    prog, _ = build_program(case, data)
    lim = DeviceLimits(name="test")
    plan = plan_session(prog, lim)
    pp = plan.payloads[0]
    (f,) = [f for f in ops_fused.plan_fusions(plan, 0) if f.kind == "rope_kv"]
    assert f.cat and f.norm is not None
    (call,) = lowering.select_all(pp, lim, fusions=ops_fused.plan_fusions(plan, 0))[f.at]
    assert call.entry == "qgemv_rope" and call.constants["RK"] is True and call.constants["CAT"] == 1
    w = struct.unpack(f"<{QPARAMS_WORDS}I", call.uniform)
    H, HK = HEADS["q4_1"]
    assert w[:3] == (3, 96, 3) and w[18:20] == (H * D, HK * D) and w[4] == (H + 2 * HK) * D
    assert w[24:27] == (D, 3, S) and w[33] == (2 | (1 | 2) << 2 | 1 << 4)  # q rotated; k rotated, cached; v cached
    by_slot = {b.binding: b.buf for b in call.bindings}
    assert sorted(by_slot) == [2, 3, 4, 5, 6, 7, 8] and by_slot[2].space == by_slot[5].space == "dummy"
    cover = by_slot[8]
    jobs = sorted(f.jobs, key=lambda j: j.cat_part)
    for word, ref in ((27, jobs[0].cos), (28, jobs[0].sin), (29, jobs[1].pos), (30, jobs[0].dst), (31, jobs[1].dst),
                      (32, jobs[2].dst), (12, f.norm["x"]), (10, f.norm["y"]), (13, f.norm["s"])):
        assert (cover.space, cover.index) == (ref.buf.space, ref.buf.index)
        assert cover.offset + 4 * w[word] == ref.buf.offset  # the word index inside S


def check_greedy(env, device: str, tuning) -> None:
    """tests/greedy_program.py's LM in q4_1 (one layer: its decode front is the norm alone): a
    20-token prompt decoded to the context's end gives the reference executor's ids, picked on
    the host and on the device with 2 steps ahead, and its decode step ran qgemv_rope."""
    pytest.importorskip("torch")
    from greedy_program import check_fused_greedy

    check_fused_greedy(env, device, "qgemv_rope", "rope_kv", tuning)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_ids_match_the_reference(env, variant):
    check_greedy(env, "wgpu", VARIANTS[variant])
