"""The split-key attention's combine inside the packed product after it, on WebGPU: the planner's
``sdpa_linear`` group (core/plan/fusion.py) run as attn_flash + quant_mm.wgsl ``qgemv_attn``
(core/webgpu/ops_fused.py ``_sdpa_linear``), where attn_flash_combine and the product ran as two
dispatches.

Cases: a decode attention sdpa(q, k cache, v cache, keep-mask) over S cache rows, its output
[B, H, T, D] read as [B, T, H D] rows by a packed linear (N = 37 outputs, a prime) and, with
``res``, a residual add after it. M = B T = 1..8 rows: one query row a batch (GQA, H = 8 query
heads on Hk = 2 kv heads, D = 12: K = 96, three 32-value blocks) or T = 5 query rows of one head
(D = 32). S = 13, 23, 67 and 131 cache rows (prime) with 16-key chunks: 1, 2, 5 and 9 partials a
row (qgemv_attn loads eight partials before merging them: 131 takes two such trips).
Masks at the cache's edges: the first key alone (position 0), every key (the last position),
the last key alone, a random keep-mask, a row with nothing kept (zeros, as torch's sdpa) and a
NaN query row (NaN through the merge and the product, as the reference).
attn_flash runs one query row a workgroup by default, 4 rows of a kv head in the ``rows4`` variant.
Each runs fused and with ``Tuning.attn_in_product`` off (attn_flash_combine, then the product),
both against the float64 reference at the conformance tolerances (float32: rtol 1e-4, atol
1e-5 sqrt(K) for the product's length-K sums; the merge's rescaling adds a few float32 roundings
of O(1) values, inside that) and against each other, on the subgroup kernels and on the trees.
test_dawn_attn_product.py runs a few on Dawn.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gpudelegate.webgpu import lowering

from conformance.cases import Case, Leaf, Op, build_program, golden, make_data, tolerance
from conformance.executors import environment_fixture

pytestmark = pytest.mark.wgpu

env = environment_fixture("wgpu")

N = 37
VARIANTS = {"subgroups": lowering.Tuning(attn_flash_keys=16),
            "trees": lowering.Tuning(attn_flash_keys=16, qgemv_subgroups=False),
            # attn_flash with 4 query rows of a kv head a workgroup (1 by default)
            "rows4": lowering.Tuning(attn_flash_keys=16, attn_flash_rows=4)}


def attn_product(B: int, T: int, H: int, Hk: int, D: int, S: int, weights: str = "q4_1", res: bool = True) -> Case:
    """sdpa -> reshape to [B, T, H D] -> packed linear (-> + r)."""
    K = H * D
    leaves = [Leaf("q", "float", (B, H, T, D)), Leaf("kc", "float", (B, Hk, S, D)), Leaf("vc", "float", (B, Hk, S, D)),
              Leaf("keep", "bool", (B, 1, T, S), gen="keep"), Leaf("w", weights, (N, K), kind="prepack")]
    ops = [Op("sdpa", ["q", "kc", "vc", "keep"], out="y"), Op("reshape", ["y"], {"shape": [B, T, K]}, out="x"),
           Op("linear", ["x", "w", None], out="o")]
    if res:
        leaves.append(Leaf("r", "float", (B, T, N)))
        ops.append(Op("add", ["o", "r"], out="z"))
    return Case(f"attn_product/B{B}_T{T}_H{H}_{Hk}_D{D}_S{S}_{weights}{'_res' if res else ''}", leaves, ops,
                ["z" if res else "o"], red=max(K, S))


def masked(data: dict, mask: str) -> dict:
    """``data`` with its keep-mask replaced: "first", "all" or "last" key(s) kept, "random" (the
    generated one: key 0 always kept), "dead" (random, but batch 0's rows keep nothing), "nan"
    (random, with a NaN in batch 0's first query head)."""
    keep = data["keep"].copy()
    if mask in ("first", "last", "all"):
        keep[:] = mask == "all"
        keep[..., 0 if mask == "first" else -1] = True
    elif mask == "dead":
        keep[0] = False
    elif mask == "nan":   # random, and a NaN in batch 0's first head: that row's outputs are NaN
        q = data["q"].copy()
        q[0, 0, 0, 0] = np.nan
        return {**data, "keep": keep, "q": q}
    return {**data, "keep": keep}


def run(env, case: Case, mask: str, tuning, device: str = "wgpu"):
    """Outputs of ``case`` (checked against the float64 golden) and the entry points each
    dispatch ran: {op: [entries of each of its dispatches]}."""
    import gpudelegate

    data = masked(make_data(case), mask)
    prog, names = build_program(case, data)
    prog = gpudelegate.loads(prog.to_bytes())
    with env.session(prog, device=device, tuning=tuning) as s:
        outs = [np.asarray(o).astype(np.float64) for o in s.run("forward", [data[n] for n in names])]
        chain = {}
        for n in s.executor.recorded[0].nodes:
            chain.setdefault(n.op, []).append([L.pipeline.label.split(":")[-1].strip() for L in n.launches])
    rtol, atol = tolerance(case)
    for i, (g, w) in enumerate(zip(outs, golden(case, data))):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{case.id} {mask} output {i} ({chain})")
    return outs, chain


def check(env, case: Case, mask: str, variant, device: str = "wgpu") -> None:
    """Fused: the attention runs nothing at its own place and the group's last member runs
    attn_flash + qgemv_attn; off: attn_flash + attn_flash_combine, then the product.
    ``variant``: a name in VARIANTS, or a Tuning. Returns the fused run's outputs."""
    tuning = VARIANTS[variant] if isinstance(variant, str) else variant
    fused, chain = run(env, case, mask, tuning, device)
    last = "add" if "add" in case.op_names else "linear"
    assert chain["sdpa"] == [[]] and chain[last] == [["attn_flash", "qgemv_attn"]], chain
    two, chain_two = run(env, case, mask, dataclasses.replace(tuning, attn_in_product=False), device)
    assert chain_two["sdpa"] == [["attn_flash", "attn_flash_combine"]] and chain_two["linear"] == [["qgemv"]], chain_two
    rtol, atol = tolerance(case)
    for a, b in zip(fused, two):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
    return fused


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("B,T,H,Hk,D,S,weights,mask", [
    (1, 1, 8, 2, 12, 23, "q4_1", "random"),   # SmolLM2's shape of decode: one row, GQA
    (3, 1, 8, 2, 12, 67, "q4_0", "first"),    # position 0 of a 5-chunk cache
    (8, 1, 8, 2, 12, 13, "q8_0", "all"),      # eight rows, one chunk, the cache full
    (2, 1, 8, 2, 12, 67, "q4_1", "last"),     # only the last key: four chunks keep nothing
    (1, 5, 1, 1, 32, 23, "q4_1", "dead"),     # five query rows of one head, none kept: zeros
    # nine partials a row (S = 131, prime): the merge's two trips of eight chunks, the second
    # holding one chunk and seven past the row's
    (1, 1, 8, 2, 12, 131, "q4_1", "random"),
    (2, 1, 8, 2, 12, 131, "q8_0", "last"),    # only the last key: the ninth chunk's alone kept
    (2, 1, 8, 2, 12, 131, "q4_1", "nan"),     # a NaN query row: its batch's outputs NaN, the other's not
    (1, 1, 9, 3, 64, 256, "q4_1", "random"),  # SmolLM2-135M's own: 9 heads of 64 on 3 kv heads, 256 rows
])
def test_rows_splits_and_masks(env, variant, B, T, H, Hk, D, S, weights, mask):
    out = check(env, attn_product(B, T, H, Hk, D, S, weights), mask, variant)[0]
    if mask == "nan":
        assert np.isnan(out[0]).all() and np.isfinite(out[1:]).all()


def test_without_the_residual(env):
    """The product's output read by nothing after it in the group: no epilogue."""
    check(env, attn_product(2, 1, 8, 2, 12, 23, res=False), "random", "subgroups")


@pytest.mark.parametrize("tuning", [{"attn_product_rows": 4}, {"attn_flash_keys": 32}])
def test_the_prologue_tunings(env, tuning):
    """qgemv_attn with 4 weight rows a workgroup (8 by default), and merging 32-key chunks (3
    partials a row at S = 67; the other cases fix 16-key ones)."""
    check(env, attn_product(3, 1, 8, 2, 12, 67, "q4_1"), "random", dataclasses.replace(VARIANTS["subgroups"], **tuning))


def test_greedy_ids_match_the_reference(env):
    """tests/greedy_program.py's LM in q4_1: ids identical to the reference executor's (host
    pick and 2 steps ahead), its decode step running qgemv_attn and no attn_flash_combine."""
    check_greedy(env, "wgpu")


def check_greedy(env, device: str) -> None:
    pytest.importorskip("torch")
    from greedy_program import check_fused_greedy

    check_fused_greedy(env, device, "qgemv_attn", "attn_flash_combine", None)
