"""test_wgpu_quant_subgroups.py's layouts on Dawn: quant_mm_sg.wgsl compiled by Tint (with its
``enable subgroups;``, which naga takes without), whose uniformity analysis checks the subgroup
calls and barriers as Chrome's does; the plain module beside it. The same cases and tolerances
(fewer shapes; greedy ids on the subgroup kernels are the wgpu file's: Dawn's lavapipe takes a
minute and a half for that model).

Runs where a Dawn adapter starts (tests/run_all.sh: Mesa 25's lavapipe; the GPU machine).
"""

from __future__ import annotations

import pytest

from test_wgpu_norm_prologue import _attention, _gate_up
from test_wgpu_quant_subgroups import LAYOUT_IDS, LAYOUTS, check_layout, linear_case

pytestmark = pytest.mark.dawn


@pytest.fixture(scope="module")
def env(dawn_env):
    return dawn_env


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("qt,m,k", [("q4_1", 3, 544), ("q8_0", 8, 96)])
def test_qgemv(env, layout, qt, m, k):
    check_layout(env, "dawn", layout, linear_case(qt, m, k, gelu=m == 3), "linear", "qgemv")


# rows of 32 lanes sum through workgroup memory on llvmpipe (subgroups of 8): its qgemv case covers
# that path here; a concatenated product of it takes half a minute on Dawn's llvmpipe
CAT_LAYOUTS = [lay for lay in LAYOUTS if lay[0] != "lanes-32"]


@pytest.mark.parametrize("layout", CAT_LAYOUTS, ids=[lay[0] for lay in CAT_LAYOUTS])
@pytest.mark.parametrize("rows,k", [(1, 544), (3, 96)])
def test_gate_up_and_qkv_with_the_norm_prologue(env, layout, rows, k):
    check_layout(env, "dawn", layout, _gate_up(rows, k, 44, "q4_1"), "mul", "qgemv_cat_norm")
    check_layout(env, "dawn", layout, _attention(rows, k, "q4_1", add=rows != 3), "kv_update", "qgemv_rope")


def test_the_measured_subgroup_size(env):
    assert env.context("dawn").subgroup_size() in (4, 8, 16, 32, 64, 128)
