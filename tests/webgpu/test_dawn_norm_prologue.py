"""The norm prologue kernels (fused.wgsl ``gemv_cat_norm``, quant_mm.wgsl ``qgemv_cat_norm``) on
Dawn, the cases and tolerances of test_wgpu_norm_prologue.py: Dawn (and Chrome, which compiles
the same WGSL with Tint) checks every binding an entry point uses against its layout and refuses
unused pipeline constants, so eight storage bindings and the prologue's overrides are checked here
as the browser would.

Runs where a Dawn adapter starts (tests/run_all.sh: Mesa 25's lavapipe; the GPU machine).
"""

from __future__ import annotations

import pytest

from test_wgpu_norm_prologue import _attention, _check, _gate_up

pytestmark = pytest.mark.dawn


@pytest.fixture(scope="module")
def env(dawn_env):
    return dawn_env


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("weights,K", [("float32", 48), ("float16", 96), ("q4_1", 64)])
def test_gate_up_and_qkv_take_the_add_and_norm(env, T, weights, K):
    entry = "qgemv_cat_norm" if weights.startswith("q") else "gemv_cat_norm"
    _check(env, _gate_up(T, K, 37 if weights.startswith("float") else 44, weights), "mul", [entry], device="dawn")
    _check(env, _attention(T, K, weights), "kv_update", ["qgemv_rope"] if weights.startswith("q") else [entry, "rope_kv"],
           device="dawn")


@pytest.mark.parametrize("weights,K", [("float32", 48), ("q4_1", 64)])
def test_a_plain_norm_is_a_prologue_too(env, weights, K):
    entry = "qgemv_cat_norm" if weights.startswith("q") else "gemv_cat_norm"
    _check(env, _attention(1, K, weights, add=False), "kv_update",
           ["qgemv_rope"] if weights.startswith("q") else [entry, "rope_kv"], device="dawn")
