"""Fixtures of the wgpu tests."""

import pytest

from conformance.executors import probe_device


@pytest.fixture(scope="session")
def wgpu_adapter():
    """Skips every test that asks for it, with the reason (which ``pytest -rs`` prints), where no
    wgpu adapter starts; the adapter is probed once per run, not once per module."""
    ok, reason = probe_device("wgpu")()
    if not ok:
        pytest.skip(reason)
