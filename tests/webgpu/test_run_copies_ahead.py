"""A run's device-tensor input copies and read-back copies encoded ahead in its chain's command
buffers (native/wgpu_device.py ``_Ahead``: the next run is encoded while the GPU works, with the
copies and reads of the run before; a greedy decode step copies its ``ids`` from the same argmax
word each time, an argmax reads the same word). Checked against the float64 reference
(tolerances: test_wgpu_executor's for float32 products and tanh, 1e-4 relative): runs whose inputs
come from other buffers than the run before (what was encoded ahead does not fit) compute their
own, kept or read back; a run that fits submits one command buffer; read-back staging goes back to
the pool.

wgpu-native on any adapter (software Vulkan in CI); Dawn where a Dawn adapter starts (a process of
its own on Mesa 25's lavapipe, as tests/run_all.sh runs the ``dawn`` tests).
"""

from __future__ import annotations

import numpy as np
import pytest

import gpudelegate
from conformance.cases import golden
from gpudelegate.executor import DeviceTensor
from test_wgpu_executor import _check, _mlp_case, _program


@pytest.fixture(scope="module")
def mlp():
    case = _mlp_case(width=19, depth=3)  # 3 x (linear, tanh)
    prog, names, data = _program(case)
    xa = data[names[0]]
    xb = np.ascontiguousarray(xa[::-1] * 0.5 + 0.25).astype(xa.dtype)
    return case, prog, xa, xb, golden(case, data), golden(case, {**data, names[0]: xb})


def _device_input(ex, x) -> DeviceTensor:
    """``x`` (float32) at byte 16 of a buffer of its own, as a device tensor a run copies in."""
    raw = x.astype(np.float32).tobytes()
    buf = ex._buffer(len(raw) + 16, "test input")
    ex.device.write_buffer(buf, 16, raw)
    return DeviceTensor(ex, "float32", x.shape, (buf, 16), len(raw))


class _CountingQueue:
    """The context's queue, counting the command buffers of each submit."""

    def __init__(self, queue):
        self.queue, self.sizes = queue, []

    def submit(self, cbs):
        self.sizes.append(len(cbs))
        return self.queue.submit(cbs)

    def __getattr__(self, name):
        return getattr(self.queue, name)


def _check_copies_ahead(env, device, mlp, monkeypatch):
    case, prog, xa, xb, want_a, want_b = mlp
    with env.session(prog, device=device) as s:
        ex, ctx = s.executor, s.executor.device
        monkeypatch.setattr(ctx, "head_dispatches", 0)  # one command buffer for the chain
        queue = _CountingQueue(ctx.queue)
        monkeypatch.setattr(ctx, "queue", queue)
        ta, tb = _device_input(ex, xa), _device_input(ex, xb)
        runs = ((ta, want_a), (ta, want_a), (tb, want_b), (ta, want_a), (ta, want_a))
        for keep in (False, True, True, False):
            for k, (t, want) in enumerate(runs):
                del queue.sizes[:]
                (y,) = s.run("forward", [t], keep_on_device=keep)
                if k and t is runs[k - 1][0]:  # encoded ahead by the run before: copies, chain, reads
                    assert queue.sizes == [1], (keep, k, queue.sizes)
                _check(case, [y.numpy() if keep else y], want, what=f"keep_on_device={keep} run {k}")
        pooled = sum(len(v) for v in ctx.staging.free.values())
        assert 0 < pooled <= 8  # read-back staging went back to the pool (at most 4 a size)


@pytest.mark.wgpu
def test_wgpu_copies_and_reads_encoded_ahead(wgpu_adapter, mlp, monkeypatch):
    with gpudelegate.Environment() as env:
        _check_copies_ahead(env, "wgpu", mlp, monkeypatch)


@pytest.mark.dawn
def test_dawn_copies_and_reads_encoded_ahead(dawn_env, mlp, monkeypatch):
    _check_copies_ahead(dawn_env, "dawn", mlp, monkeypatch)
