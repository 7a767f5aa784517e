"""A run's chain submitted in two parts (``WgpuContext.head_dispatches``): the first dispatches
(with the run's writes and copies) in a submit of their own, the rest with the read-back in a
second, so the GPU starts while the library prepares the rest; a run queued behind others (the
GPU busy) submits both at once. Every split point gives the
float64 reference's results, on runs that write inputs, chain device tensors and read back later
(``submit_read``), with the parts encoded ahead; a chain no longer than the head stays one submit.

wgpu-native on any adapter (software Vulkan in CI); Dawn where a Dawn adapter starts (a process of
its own on Mesa 25's lavapipe, as tests/run_all.sh runs the ``dawn`` tests).
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.cases import golden
from test_wgpu_executor import _check, _mlp_case, _program


class _CountingQueue:
    """The context's queue, counting submits (the executor calls nothing else on it here)."""

    def __init__(self, queue):
        self.queue, self.submits = queue, 0

    def submit(self, cbs):
        self.submits += 1
        return self.queue.submit(cbs)

    def __getattr__(self, name):
        return getattr(self.queue, name)


def _runs_match_at_every_head(env, device: str, monkeypatch) -> None:
    case = _mlp_case(width=19, depth=4, layout="prepack")  # 4 x (linear, tanh): 8 dispatches
    prog, names, data = _program(case)
    want = golden(case, data)
    x = data[names[0]]
    with env.session(prog, device=device) as s:
        ctx = s.executor.device
        chain = s.executor.recorded[0].chain
        dispatches = sum(len(st.launches) for st in chain.steps)
        assert dispatches >= 4
        queue = _CountingQueue(ctx.queue)
        monkeypatch.setattr(ctx, "queue", queue)
        for head in (0, 1, 3, dispatches - 1, dispatches, 10 * dispatches):
            monkeypatch.setattr(ctx, "head_dispatches", head)
            split = 0 < head < dispatches
            assert len(chain.parts(head)) == (2 if split else 1)
            for run in range(3):  # the first takes parts encoded under the last head, then ahead
                before = queue.submits
                (y,) = s.run("forward", [x])
                assert queue.submits - before == (2 if split else 1), (head, run)
                _check(case, [y], want, 1e-4, 1e-5, f"head {head} run {run}")
            # Kept on the device: the first run finds the queue idle (split), the second finds
            # the first still queued (nothing read back): the GPU is busy, one submit.
            (t,) = s.run("forward", [x], keep_on_device=True)
            before = queue.submits
            (t2,) = s.run("forward", [x], keep_on_device=True)  # (the same output buffer as t's)
            assert queue.submits - before == 1, head
            _check(case, [t2.numpy()], want, 1e-4, 1e-5, f"head {head} kept on the device")
            pending = ctx.submit_read(chain, s.executor._io(0, [x], False, [])[1])
            got = np.frombuffer(ctx.read_submitted(pending)[0], np.float32).reshape(want[0].shape)
            _check(case, [got], want, 1e-4, 1e-5, f"head {head} submit_read")


@pytest.mark.wgpu
def test_wgpu_runs_match_the_reference_at_every_split(wgpu_adapter, monkeypatch):
    import gpudelegate

    with gpudelegate.Environment() as env:
        _runs_match_at_every_head(env, "wgpu", monkeypatch)


@pytest.mark.dawn
def test_dawn_runs_match_the_reference_at_every_split(dawn_env, monkeypatch):
    _runs_match_at_every_head(dawn_env, "dawn", monkeypatch)
