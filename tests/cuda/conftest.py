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


@pytest.fixture(scope="module")
def program():
    """The greedy tests' one-layer SmolLM2-shaped LM (tests/greedy_program.py), exported once a
    module; a module that needs another program defines its own ``program`` fixture."""
    pytest.importorskip("torch")
    from greedy_program import tiny_causal_lm

    return tiny_causal_lm()
