"""qgemv_rope (the packed attention front in one dispatch) on Dawn: test_wgpu_qgemv_rope.py's
cases and tolerances, fewer of them. Tint checks the entry point's bindings against its layout
(seven storage slots, OUT unused) and its uniformity (the subgroup module's sums, the barriers
before the stores), as Chrome would.

Runs where a Dawn adapter starts (tests/run_all.sh: Mesa 25's lavapipe; the GPU machine).
"""

from __future__ import annotations

import pytest

from test_wgpu_qgemv_rope import S, VARIANTS, check, check_greedy, front

pytestmark = pytest.mark.dawn


@pytest.fixture(scope="module")
def env(dawn_env):
    return dawn_env


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T,K,weights,pos,add", [(1, 96, "q4_1", 0, True), (3, 160, "q8_0", S - 3, True),
                                                 (8, 96, "q4_0", 5, True), (1, 160, "q4_1", S - 1, False)])
def test_the_front_in_one_dispatch(env, variant, T, K, weights, pos, add):
    check(env, front(T, K, weights, pos, add), variant, device="dawn")


def test_greedy_ids_match_the_reference(env):
    check_greedy(env, "dawn", VARIANTS["subgroups"])
