"""Programmatic dependent launch in captured graphs (native/cuda_pdl.py): the launcher is there on
compute capability 9.0+ unless switched off, a captured decode whose kernels launched with PDL
gives the eager run's outputs exactly (the same kernels in the same order: only when each starts
moves), across fused, packed and offloaded programs, and the ordinary launch is kept where it
must be."""

from __future__ import annotations

import numpy as np
import pytest

from cuda_env import REASON, cp
from greedy_program import decode_steps, tiny_causal_lm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")]


def _cc() -> int:
    return int(cp.cuda.Device().compute_capability)


def test_the_launcher_follows_the_device_and_the_switch(monkeypatch):
    from gpudelegate.native.cuda_pdl import PdlLauncher

    got = PdlLauncher(cp)
    assert got.available == (_cc() >= 90), got.why_not
    monkeypatch.setenv("GPUDELEGATE_CUDA_PDL", "0")
    off = PdlLauncher(cp)
    assert not off.available and "GPUDELEGATE_CUDA_PDL=0" in off.why_not


def test_arguments_it_cannot_pack_keep_the_ordinary_launch():
    from gpudelegate.native.cuda_pdl import PdlLauncher

    pdl = PdlLauncher(cp)
    x = cp.zeros(4, cp.float32)
    assert pdl._pack((x, np.int32(3), np.float32(0.5), np.uint64(0))) is not None
    assert pdl._pack((x, 3)) is None  # a Python int: CuPy's own rule for its width applies
    assert pdl._pack((x, np.float16(1))) is None


@pytest.fixture(scope="module")
def programs():
    pytest.importorskip("torch")
    return {"float32": tiny_causal_lm()}


@pytest.mark.parametrize("opts", [{}, {"fuse": False}], ids=["fused", "unfused"])
def test_a_graph_of_pdl_launches_gives_the_eager_outputs(env, programs, opts):
    prog = programs["float32"]
    with env.session(prog, device="cuda", **opts) as eager:
        want = decode_steps(eager)
    pdl = env.context("cuda").kernels.pdl
    before = pdl.launches
    with env.session(prog, device="cuda", capture_graph=True, **opts) as graph:
        got = decode_steps(graph)
        assert graph.executor.stats.get("graphs"), "no graph was captured"
    if pdl.available:
        assert pdl.launches > before, "no kernel of the captured step launched with PDL"
    for step, (w, g) in enumerate(zip(want, got)):
        for k, (a, b) in enumerate(zip(w, g)):
            np.testing.assert_array_equal(a, b, err_msg=f"decode step {step}, output {k}")
