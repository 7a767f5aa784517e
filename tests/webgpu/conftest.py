"""Fixtures of the wgpu tests."""

import pytest

import gpudelegate

from conformance.executors import probe_device


@pytest.fixture(scope="session")
def wgpu_adapter():
    """Skips every test that asks for it, with the reason (which ``pytest -rs`` prints), where no
    wgpu adapter starts; the adapter is probed once per run, not once per module."""
    ok, reason = probe_device("wgpu")()
    if not ok:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def dawn_adapter():
    """As ``wgpu_adapter``, for Dawn (wgpudawn): skipped with the reason where no Dawn adapter
    starts (tests/run_all.sh runs these in a process whose Vulkan driver is Mesa 25's lavapipe)."""
    ok, reason = probe_device("dawn")()
    if not ok:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def dawn_env(dawn_adapter):
    """One Environment per Dawn test module, closed after it (a module names it ``env``)."""
    e = gpudelegate.Environment()
    yield e
    e.close()
