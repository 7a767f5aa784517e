"""What the image-classifier examples (mnist.py, efficientnet.py) share: export a
``build_torch_model()`` for ``example_inputs``, and the command line that exports, runs the program
on the numpy reference executor and returns its logits next to PyTorch's."""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch


def export_classifier(build_torch_model: Callable[[], torch.nn.Module], example_inputs: tuple, path=None,
                      weights_dtype: str = "float32", progress=None, metadata: Optional[dict] = None):
    """Export the model for ``example_inputs`` (one ``image`` input, one ``logits`` output)."""
    from gpudelegate.export import export_program

    with torch.no_grad():
        return export_program(build_torch_model(), example_inputs, path=path, weights_dtype=weights_dtype,
                              progress=progress, metadata=metadata or {}, input_names=["image"],
                              output_names=["logits"])


def run_cli(argv: Optional[Sequence[str]], default_path: str, export: Callable, image: np.ndarray,
            build_torch_model: Callable[[], torch.nn.Module]) -> Tuple[np.ndarray, np.ndarray]:
    """``[OUT.gdp] [--fp16]``: export to OUT, run ``image`` on the reference executor; returns
    (our logits, PyTorch's logits) of the first batch row."""
    import gpudelegate

    argv = list(sys.argv[1:] if argv is None else argv)
    dtype = "float16" if "--fp16" in argv else "float32"
    paths = [a for a in argv if not a.startswith("--")]
    path = paths[0] if paths else default_path
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    export(path, weights_dtype=dtype)
    print(f"wrote {path} ({os.path.getsize(path) / 1e6:.2f} MB, weights {dtype})")
    with gpudelegate.Environment() as env:
        sess = env.session(path, device="reference")
        logits = np.asarray(sess.run("forward", [image])[0])[0]
    with torch.no_grad():
        ref = build_torch_model()(torch.from_numpy(image)).numpy()[0]
    return logits, ref
