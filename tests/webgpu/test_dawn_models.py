"""Real models on Dawn against the numpy reference executor, same program file, same inputs:
all-MiniLM-L6-v2 (a padded sentence: masked attention) and SmolLM2-135M greedy generation with the
KV cache on the device, as tests/webgpu/test_wgpu_models.py runs them on wgpu-native.

Tolerance: max |difference| / max |reference output| <= 1e-4 (both compute in float32 from the
same bytes; only summation order differs). Generated tokens must be identical. On lavapipe (the
CI's Dawn adapter) these take about a minute, most of it SmolLM2's export and prefill.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from model_packages import require_model_package  # noqa: E402

pytestmark = [pytest.mark.dawn, pytest.mark.slow]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def env(dawn_env):
    return dawn_env


def test_minilm(env):
    minilm = pytest.importorskip("gpudelegate.export.models.minilm")
    require_model_package(minilm.PACKAGE)
    prog = minilm.export(batch=2, seq_len=16, progress=False)
    rng = np.random.default_rng(3)
    ids = rng.integers(1000, 20000, (2, 16)).astype(np.int32)
    mask = np.ones((2, 16), np.int32)
    mask[1, 9:] = 0
    outs = {}
    for dev in ("reference", "dawn"):
        with env.session(prog, device=dev) as s:
            (outs[dev],) = s.run("forward", [ids, mask])
    ref, got = np.asarray(outs["reference"], np.float64), np.asarray(outs["dawn"], np.float64)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel <= 1e-4, f"minilm embeddings: max |dawn - reference| / max |reference| = {rel:.3g} > 1e-4"


def test_smollm2_generates_the_reference_tokens(env):
    smollm2 = pytest.importorskip("gpudelegate.export.models.smollm2")
    require_model_package(smollm2.PACKAGE)
    from gpudelegate.llm import generate
    from gpudelegate.text import tokenizer_from_metadata

    ck = smollm2.read_gguf(max_context=32, prefill_chunk=16)
    prog = smollm2.export(checkpoint=ck, progress=False)
    tok = tokenizer_from_metadata(prog.metadata["tokenizer"])
    results = {}
    for dev in ("reference", "dawn"):
        with env.session(prog, device=dev) as s:
            results[dev] = generate(s, tok, "The capital of France is", max_new_tokens=4)
    assert results["dawn"].ids == results["reference"].ids, (results["dawn"].text, results["reference"].text)
    assert "Paris" in results["dawn"].text
