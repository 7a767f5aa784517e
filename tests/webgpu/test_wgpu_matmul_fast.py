"""matmul_fast.wgsl (`mm_f32`): the float32 vec4 matrix product core/webgpu/ops_matmul.py picks when K, N and
every row base/stride are multiples of 4. Forced on prime M and on N, K = 4 x prime (partial
tiles in every dimension), B along n (matmul) and along k (linear, K^T of attention), batches,
grouped-query batch mapping, bias and alpha; and the shapes it must leave to `mm`. Results
against float64 numpy (the conformance golden) at fp32 tolerances: rtol 1e-4, atol 1e-5 sqrt(K)
(a K-term float32 dot product's rounding grows with sqrt(K)).

Runs on any wgpu adapter (software Vulkan in CI); skipped, with the reason printed by -rs, where
none starts. Shapes are small: the software adapter does 1-2 GFLOP/s.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpudelegate
from gpudelegate.webgpu import lowering

from conformance.cases import Case, Leaf, Op, build_program, golden, make_data
from conformance.executors import environment_fixture, run_on

pytestmark = pytest.mark.wgpu

env = environment_fixture("wgpu")


def _run(env, case: Case, tuning: lowering.Tuning):
    """Run ``case`` on wgpu, check it against float64, return the entry points it dispatched."""
    return {e for entries in run_on(env, case, "wgpu", tuning).values() for e in entries}


# M = 131 (prime), K = 68 = 4 * 17, N = 116 = 4 * 29: partial tiles in M, N and K for every tile.
MATMUL = Case("fast/matmul_and_linear",
              [Leaf("a", "float", (131, 68)), Leaf("b", "float", (68, 116)),
               Leaf("w", "float", (44, 68), kind="prepack"), Leaf("bias", "float", (44,), kind="prepack")],
              [Op("matmul", ["a", "b"], out="y"), Op("linear", ["a", "w", "bias"], out="z")], ["y", "z"], red=68)


@pytest.mark.parametrize("tile,bk", [(128, None), (128, 8), (128, 32), (64, None), (64, 16)])
def test_fast_kernel_forced_on_partial_tiles(env, tile, bk):
    # mm_bk 32 needs 2 x 32 x 128 x 4 = 32 KiB of workgroup memory.
    if bk == 32 and env.context("wgpu").device.limits["max-compute-workgroup-storage-size"] < 32768:
        pytest.skip("this adapter's workgroup memory is under the 32 KiB a K step of 32 needs")
    entries = _run(env, MATMUL, lowering.Tuning(mm_tile=tile, mm_bk=bk))
    assert "mm_f32" in entries and "mm" not in entries, entries


@pytest.mark.parametrize("tile,bk", [(32, None), (32, 4), (32, 8), (32, 32), (64, None), (64, 4), (64, 8)])
def test_small_tile_fast_kernel_forced_on_partial_tiles(env, tile, bk):
    # mm_f32_4: 4x4 per thread (32x32 tiles of 64 threads, 64x64 of 256), what a 128-token
    # prefill's linears get; every K step it allows (half, one, two or four vec4s per thread).
    entries = _run(env, MATMUL, lowering.Tuning(mm_tile=tile, mm_tm=4, mm_bk=bk))
    assert entries == {"mm_f32_4"}, entries


@pytest.mark.parametrize("ks", [2, 3, 4, 8])
def test_split_k_forced(env, ks):
    # K = 68 in ks ranges of whole K steps: with 4 and 8 some ranges are empty (zero partials);
    # the linear's bias is added once (partial 0).
    entries = _run(env, MATMUL, lowering.Tuning(mm_tile=32, mm_ksplit=ks, mm_bk=8))
    assert entries == {"mm_f32_4", "mm_f32_sum"}, entries


@pytest.mark.parametrize("tile,tile_n,bk,ks", [(128, 64, None, None), (64, 128, None, None), (128, 64, 8, 2),
                                                (64, 128, 4, 3), (128, None, None, 2), (64, None, 16, 4)])
def test_8x8_kernel_rectangular_tiles_and_split_k(env, tile, tile_n, bk, ks):
    # mm_f32 with 128x64 / 64x128 tiles (A and B tiles staged in different counts per thread)
    # and split along K into partials summed by mm_f32_sum (bias once), on partial tiles.
    entries = _run(env, MATMUL, lowering.Tuning(mm_tile=tile, mm_tile_n=tile_n, mm_bk=bk, mm_ksplit=ks))
    assert entries == ({"mm_f32", "mm_f32_sum"} if ks else {"mm_f32"}), entries


@pytest.mark.parametrize("tile,tile_n,bk,ks", [(128, None, 4, None), (128, None, 16, None), (64, 128, 8, 2),
                                                (128, 64, 8, None), (64, None, 8, 3)])
def test_8x8_kernel_two_stages(env, tile, tile_n, bk, ks):
    # Double-buffered shared tiles (one barrier per K step): K = 68 leaves a partial last step.
    entries = _run(env, MATMUL, lowering.Tuning(mm_tile=tile, mm_tile_n=tile_n, mm_bk=bk, mm_ksplit=ks, mm_stages=2))
    assert "mm_f32" in entries, entries


def test_many_row_product_picks_64x128_split_k():
    # The rule for products with many rows but few 128x128 tiles (MiniLM 32x128's linears):
    # 64x128 tiles of 8x8 per thread, K in two ranges. Lowering only (no device needed).
    from gpudelegate.plan.types import DeviceLimits

    calls = _lower_linear(4096, 384, 384, DeviceLimits())
    assert [(c.entry, c.constants.get("WX"), c.constants.get("WY"), c.constants.get("KSPLIT"))
            for c in calls] == [("mm_f32", 16, 8, 2), ("mm_f32_sum", None, None, 2)]
    assert calls[0].workgroups == (3, 64, 2)  # 384 / 128 column tiles, 4096 / 64 row tiles, 2 K ranges
    # 128x128 tiles once they are plenty (4096 x 1536: 384 of them), two stages of K step 8;
    # 128 rows keep the 4x4 kernel.
    (c,) = _lower_linear(4096, 1536, 384, DeviceLimits())
    assert (c.entry, c.constants["WX"], c.constants["WY"], c.constants["STAGES"], c.constants["BK"]) == \
        ("mm_f32", 16, 16, 2, 8)
    assert "mm_f32_4" in [c.entry for c in _lower_linear(128, 384, 384, DeviceLimits())]


def _lower_linear(m, n, k, limits):
    from gpudelegate.plan.types import BufferRef, Dispatch, TensorRef

    def ref(v, shape, space, index=0):
        nbytes = 4 * int(np.prod(shape))
        return TensorRef(v, "float32", tuple(shape), BufferRef(space, index, 0, nbytes))
    d = Dispatch(0, "linear", {}, [ref(0, (m, k), "arena", 0), ref(1, (n, k), "resident", 0)],
                 [ref(2, (m, n), "arena", 1)])
    return lowering.select(d, limits, (), lowering.Tuning())


def test_prefill_shaped_linear_picks_the_small_tile_kernel(env):
    # M = 37 rows, N = 44, K = 68: too few 64-wide tiles for 8x8 per thread, so by default 4x4.
    entries = _run(env, MATMUL, lowering.Tuning())
    assert "mm_f32_4" in entries and "mm" not in entries, entries


BATCHED = [
    # Batched product with a broadcast B (batch stride 0) and M = 37.
    Case("fast/bmm_broadcast", [Leaf("a", "float", (3, 37, 20)), Leaf("b", "float", (20, 12))],
         [Op("matmul", ["a", "b"], out="y")], ["y"], red=20),
    # Two batch dims, M = 23 prime.
    Case("fast/bmm_2d_batch", [Leaf("a", "float", (2, 3, 23, 28)), Leaf("b", "float", (2, 3, 28, 8))],
         [Op("matmul", ["a", "b"], out="y")], ["y"], red=28),
    # Attention: Q K^T (B along k, alpha, grouped-query batch mapping) and P V, 44 keys.
    Case("fast/sdpa_gqa", [Leaf("q", "float", (1, 4, 37, 8)), Leaf("k", "float", (1, 2, 44, 8)),
                           Leaf("v", "float", (1, 2, 44, 8))],
         [Op("sdpa", ["q", "k", "v"], out="y")], ["y"], red=44),
]


@pytest.mark.parametrize("case", BATCHED, ids=lambda c: c.id)
def test_fast_kernel_batched(env, case):
    entries = _run(env, case, lowering.Tuning(mm_tile=64))
    if case.id != "fast/sdpa_gqa":  # attention may take a kernel of its own; there only results count
        assert "mm_f32" in entries, entries
    entries = _run(env, case, lowering.Tuning(mm_tile=32))
    if case.id != "fast/sdpa_gqa":
        assert "mm_f32_4" in entries, entries


@pytest.mark.parametrize("case", BATCHED[:2], ids=lambda c: c.id)
def test_split_k_batched(env, case):
    entries = _run(env, case, lowering.Tuning(mm_tile=32, mm_ksplit=2, mm_bk=4))
    assert entries == {"mm_f32_4", "mm_f32_sum"}, entries


FALLBACK = [
    # K = 41 (prime): rows of A are not whole vec4s.
    Case("fast/odd_k", [Leaf("a", "float", (37, 41)), Leaf("b", "float", (41, 12))],
         [Op("matmul", ["a", "b"], out="y")], ["y"], red=41),
    # N = 13: rows of B and C are not whole vec4s.
    Case("fast/odd_n", [Leaf("a", "float", (37, 16)), Leaf("b", "float", (16, 13))],
         [Op("matmul", ["a", "b"], out="y")], ["y"], red=16),
    # float16 storage: the fast kernel is float32 only.
    Case("fast/float16", [Leaf("a", "float", (37, 16)), Leaf("b", "float", (16, 12))],
         [Op("matmul", ["a", "b"], out="y")], ["y"], storage="float16", red=16),
]


@pytest.mark.parametrize("case", FALLBACK, ids=lambda c: c.id)
def test_shapes_it_cannot_run_go_to_mm(env, case):
    if case.storage == "float16":  # float16 tolerances: 11-bit significands
        data = make_data(case)
        prog, names = build_program(case, data)
        with env.session(gpudelegate.loads(prog.to_bytes()), device="wgpu", tuning=lowering.Tuning(mm_tile=64)) as s:
            out = s.run("forward", [data[n] for n in names])[0]
            entries = {L.pipeline.label.split(":")[-1] for n in s.executor.recorded[0].nodes for L in n.launches}
        np.testing.assert_allclose(np.asarray(out).astype(np.float64), golden(case, data)[0], rtol=1e-2, atol=2e-3)
    else:
        entries = _run(env, case, lowering.Tuning(mm_tile=64))
    assert "mm" in entries and "mm_f32" not in entries and "mm_f32_4" not in entries, entries


def test_mm_fast_off_uses_the_general_kernel(env):
    entries = _run(env, MATMUL, lowering.Tuning(mm_tile=128, mm_fast=False))
    assert "mm" in entries and "mm_f32" not in entries, entries


# float16 weights, float32 activations (a float16-weight program's linears on an adapter without
# subgroup matrices): B read as quads of halves (B_F16) and widened exactly, so the float32
# bounds hold (the golden holds the same float16-rounded weights in float64). M = 131, K = 68,
# N = 44 / 116: partial tiles everywhere; the weight along k (linear) and along n (matmul).
F16_WEIGHTS = Case("fast/float16_weights",
                   [Leaf("a", "float", (131, 68)), Leaf("w", "float", (44, 68), kind="prepack_fp16"),
                    Leaf("bias", "float", (44,), kind="prepack"), Leaf("b", "float", (68, 116), kind="prepack_fp16")],
                   [Op("linear", ["a", "w", "bias"], out="z"), Op("matmul", ["a", "b"], out="y")], ["z", "y"], red=68)


@pytest.mark.parametrize("tuning", [dict(mm_tile=128), dict(mm_tile=128, mm_stages=2, mm_bk=8),
                                    dict(mm_tile=64, mm_tile_n=128), dict(mm_tile=32, mm_tm=4),
                                    dict(mm_tile=32, mm_tm=4, mm_ksplit=3, mm_bk=8)],
                         ids=lambda t: ",".join(f"{k}={v}" for k, v in t.items()))
def test_float16_weights_take_the_fast_kernel(env, tuning):
    by_op = run_on(env, F16_WEIGHTS, "wgpu", lowering.Tuning(**tuning))
    entries = {e for es in by_op.values() for e in es}
    assert entries & {"mm_f32", "mm_f32_4"} and "mm" not in entries, by_op


def test_float16_weights_by_default(env):
    """Without a forced tuning a 131-row product with float16 weights runs mm_f32*, not `mm`
    (which ran 10x slower than the float32 kernel on an H100)."""
    by_op = run_on(env, F16_WEIGHTS, "wgpu")
    assert all(e != "mm" for es in by_op.values() for e in es), by_op
