"""The persisting L2 window of captured graphs (native/cuda_l2.py): set only while a payload is
captured and cleared right after, carried by the graph (whose outputs stay exactly the eager
run's: a cache policy moves no value), reported in the executor's stats, off by option or
switch."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cuda_env import REASON, cp
from greedy_program import decode_steps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")]


def _cc() -> int:
    return int(cp.cuda.Device().compute_capability)


def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _stream_window_bytes(stream) -> int:
    """num_bytes of ``stream``'s access-policy window, read back from the driver."""
    from gpudelegate.native.cuda_l2 import _ACCESS_POLICY_WINDOW, _Value

    v = _Value()
    fn = _driver().cuStreamGetAttribute
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Value)]
    assert fn(stream.ptr, _ACCESS_POLICY_WINDOW, ctypes.byref(v)) == 0
    return int(v.window.num_bytes)


def _persisting_limit() -> int:
    from gpudelegate.native.cuda_l2 import _LIMIT_PERSISTING_L2

    n = ctypes.c_size_t()
    assert _driver().cuCtxGetLimit(ctypes.byref(n), _LIMIT_PERSISTING_L2) == 0
    return int(n.value)


def test_the_window_follows_the_device_and_the_switch(monkeypatch):
    from gpudelegate.native.cuda_l2 import L2Window

    got = L2Window(cp, 0)
    assert got.available == (_cc() >= 80), got.why_not
    if got.available:
        w = got.plan(3 * got.max_persisting)  # larger than the carve-out: the share that fits
        assert w["persisting_l2"] == got.max_persisting
        assert w["hit_ratio"] == pytest.approx(1 / 3)
        small = got.plan(4096)
        assert small == {"bytes": 4096, "hit_ratio": 1.0, "persisting_l2": 4096}
        assert got.plan(0) is None
    monkeypatch.setenv("GPUDELEGATE_CUDA_L2_WINDOW", "0")
    off = L2Window(cp, 0)
    assert not off.available and "GPUDELEGATE_CUDA_L2_WINDOW=0" in off.why_not and off.plan(4096) is None


def test_a_graph_with_the_window_gives_the_eager_outputs_and_clears_the_stream(env, program):
    with env.session(program, device="cuda") as eager:
        want = decode_steps(eager)
    l2 = env.context("cuda").l2
    for opts in ({}, {"l2_window": False}):
        with env.session(program, device="cuda", capture_graph=True, **opts) as s:
            got = decode_steps(s)
            ex = s.executor
            stats = ex.stats
            assert stats.get("graphs"), "no graph was captured"
            if opts or not l2.available:
                assert "off" in stats["l2_window"], stats["l2_window"]
            else:
                w = stats["l2_window"]
                assert 0 < w["bytes"] <= ex.plan.layout.arena_bytes and 0 < w["hit_ratio"] <= 1
                assert _persisting_limit() >= w["persisting_l2"] > 0
            # the window is the graph's: the stream itself is left without one
            assert _stream_window_bytes(ex.stream) == 0
        for step, (a_out, b_out) in enumerate(zip(want, got)):
            for k, (a, b) in enumerate(zip(a_out, b_out)):
                np.testing.assert_array_equal(a, b, err_msg=f"{opts}: decode step {step}, output {k}")
