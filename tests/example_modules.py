"""The scripts of examples/ as modules, for the tests that run their export and demo code
(tests/export, tests/webgpu). tests/conftest.py puts this folder on ``sys.path``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    """``examples/<name>.py`` imported as ``gpudelegate_example_<name>``: once per run, so every
    test module that asks gets the same module (and whatever it caches)."""
    mod_name = f"gpudelegate_example_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod  # before exec: dataclasses and pickling look the module up by name
    spec.loader.exec_module(mod)
    return mod
