"""The attention's combine inside the packed product (qgemv_attn) on Dawn: test_wgpu_attn_product.py's
cases and tolerances, fewer of them. Tint checks the entry point's uniformity (the prologue's
barrier before the product, the subgroup module's sums) and its bindings, as Chrome would.

Runs where a Dawn adapter starts (tests/run_all.sh: Mesa 25's lavapipe; the GPU machine).
"""

from __future__ import annotations

import pytest

from test_wgpu_attn_product import VARIANTS, attn_product, check, check_greedy

pytestmark = pytest.mark.dawn


@pytest.fixture(scope="module")
def env(dawn_env):
    return dawn_env


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("B,T,H,Hk,D,S,weights,mask", [(1, 1, 8, 2, 12, 67, "q4_1", "last"),
                                                       (8, 1, 8, 2, 12, 23, "q8_0", "random"),
                                                       (1, 5, 1, 1, 32, 13, "q4_0", "dead"),
                                                       (1, 1, 8, 2, 12, 131, "q4_1", "random")])
def test_the_combine_in_the_product(env, variant, B, T, H, Hk, D, S, weights, mask):
    check(env, attn_product(B, T, H, Hk, D, S, weights), mask, variant, device="dawn")


def test_greedy_ids_match_the_reference(env):
    check_greedy(env, "dawn")
