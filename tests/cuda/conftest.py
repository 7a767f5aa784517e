"""Fixtures of the CUDA tests."""

import pytest

import gpudelegate


@pytest.fixture(scope="module")
def env():
    """One Environment per test module: its contexts (and their compiled kernels) are shared by
    the module's sessions."""
    e = gpudelegate.Environment()
    yield e
    e.close()
