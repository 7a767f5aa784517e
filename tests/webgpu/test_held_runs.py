"""Runs held back and submitted with the next submission (``WgpuContext.hold_runs``,
native/wgpu_held_queue.py): a run that reads nothing while earlier work is queued is not submitted
at once; every later use of the queue submits it first. Checked against the float64 reference
(tolerances: test_wgpu_executor's for float32 products and tanh, 1e-4 relative): a write after a
held run is seen by the next run only, a read of a held run's output returns its values, runs
whose device-tensor inputs come from other buffers than the run before (the copies encoded ahead
do not fit) still compute theirs, closing a session or a context with a run held raises nothing,
Dawn reports a held run's submit error, and a greedy decode two steps ahead makes one submission
a token with the reference's ids.

wgpu-native on any adapter (software Vulkan in CI); Dawn where a Dawn adapter starts (a process of
its own on Mesa 25's lavapipe, as tests/run_all.sh runs the ``dawn`` tests).
"""

from __future__ import annotations

import numpy as np
import pytest

import gpudelegate
from conformance.cases import golden
from gpudelegate.errors import DeviceError
from gpudelegate.executor import DeviceTensor
from greedy_program import CONTEXT, V, IdsTokenizer, tiny_causal_lm
from test_wgpu_executor import _check, _mlp_case, _program


@pytest.fixture(scope="module")
def mlp():
    case = _mlp_case(width=19, depth=3)  # 3 x (linear, tanh)
    prog, names, data = _program(case)
    xa = data[names[0]]
    xb = np.ascontiguousarray(xa[::-1] * 0.5 + 0.25).astype(xa.dtype)
    return case, prog, xa, xb, golden(case, data), golden(case, {**data, names[0]: xb})


def _device_input(ex, x) -> DeviceTensor:
    """``x`` (float32) at byte 16 of a buffer of its own, as a device tensor: a run copies it into
    its input (the input's arena memory is reused by the output, so a test writes here)."""
    raw = x.astype(np.float32).tobytes()
    buf = ex._buffer(len(raw) + 16, "test input")
    ex.device.write_buffer(buf, 16, raw)
    return DeviceTensor(ex, "float32", x.shape, (buf, 16), len(raw))


def _check_write_after_held_run(env, device, mlp):
    case, prog, xa, xb, want_a, want_b = mlp
    with env.session(prog, device=device) as s:
        ex, ctx = s.executor, s.executor.device
        x = _device_input(ex, xa)
        s.run("forward", [x], keep_on_device=True)  # finds the queue idle: submitted at once
        assert not ctx.queue.held
        (t,) = s.run("forward", [x], keep_on_device=True)  # the first still queued: held
        assert ctx.queue.held
        ctx.write_buffer(x.handle[0], 16, xb.astype(np.float32).tobytes())  # after the held run
        assert not ctx.queue.held
        _check(case, [t.numpy()], want_a, what="the held run, read after a write made after it")
        s.run("forward", [x], keep_on_device=True)  # the queue idle after the read: submitted
        (t,) = s.run("forward", [x], keep_on_device=True)  # held; both see the write
        assert ctx.queue.held
        _check(case, [t.numpy()], want_b, what="the runs after the write")


def _check_copies_that_change(env, device, mlp):
    """Device-tensor inputs from alternating buffers: the copies encoded ahead with the last run's
    inputs do not fit the next run, which encodes its own."""
    case, prog, xa, xb, want_a, want_b = mlp
    with env.session(prog, device=device) as s:
        ex = s.executor
        tensors = [_device_input(ex, x) for x in (xa, xb)]
        for keep in (False, True, True, False):
            for t, want in ((tensors[0], want_a), (tensors[0], want_a), (tensors[1], want_b), (tensors[0], want_a)):
                (y,) = s.run("forward", [t], keep_on_device=keep)
                _check(case, [y.numpy() if keep else y], want, what=f"keep_on_device={keep}")


def _check_close_with_a_held_run(device, mlp):
    case, prog, xa, _, want_a, _ = mlp
    with gpudelegate.Environment() as env:
        s = env.session(prog, device=device)
        ctx = s.executor.device
        s.run("forward", [xa], keep_on_device=True)
        s.run("forward", [xa], keep_on_device=True)
        assert ctx.queue.held
        s.close()  # its buffers destroyed: the held run is submitted before them
        assert not ctx.queue.held
        ctx.fence()  # nothing destroyed was submitted: no error
        s = env.session(prog, device=device)
        s.run("forward", [xa], keep_on_device=True)
        (t,) = s.run("forward", [xa], keep_on_device=True)
        assert ctx.queue.held
        _check(case, [t.numpy()], want_a, what="a second session on the context")
        s.run("forward", [xa], keep_on_device=True)
        s.run("forward", [xa], keep_on_device=True)
        assert ctx.queue.held
        ctx.close()  # the context first, a run held: submitted before the device goes
        assert not ctx.queue.held
        s.close()


class _Submissions:
    """Counts the context's submissions: its queue's and wgpu-native's indexed ones."""

    def __init__(self, ctx, monkeypatch):
        self.count = 0
        raw = ctx.queue.raw
        outer = self

        class Counting:
            def submit(self, cbs):
                outer.count += 1
                return raw.submit(cbs)

            def __getattr__(self, name):
                return getattr(raw, name)

        monkeypatch.setattr(ctx.queue, "_queue", Counting())
        if ctx.indexed_reads is not None:
            inner = ctx.indexed_reads.submit

            def submit(*a, **k):
                self.count += 1
                return inner(*a, **k)

            monkeypatch.setattr(ctx.indexed_reads, "submit", submit)


def _check_greedy_one_submission_a_token(env, device, monkeypatch):
    from gpudelegate.llm import generate

    program = tiny_causal_lm()
    tok = IdsTokenizer()
    prompt = [int(x) for x in np.random.default_rng(3).integers(0, V, 12)]
    with env.session(program, device=device) as g, env.session(program, device="reference") as r:
        want = generate(r, tok, prompt, max_new_tokens=CONTEXT, stop_ids=(), lookahead=None)
        generate(g, tok, prompt, max_new_tokens=4, stop_ids=(), lookahead=2)  # argmax chain recorded
        subs = _Submissions(g.executor.device, monkeypatch)
        got = generate(g, tok, prompt, max_new_tokens=CONTEXT, stop_ids=(), lookahead=2)
        assert (got.ids, got.stop_reason) == (want.ids, want.stop_reason)
        # The prefill (its head, the rest) and the first pick, then one per decode step: the step
        # held and submitted with its argmax and the pick's read (two a step before).
        assert got.decode_steps >= 10 and subs.count <= got.decode_steps + 4, (subs.count, got.decode_steps)


@pytest.mark.wgpu
def test_wgpu_held_runs(wgpu_adapter, mlp, monkeypatch):
    pytest.importorskip("torch")
    with gpudelegate.Environment() as env:
        _check_write_after_held_run(env, "wgpu", mlp)
        _check_copies_that_change(env, "wgpu", mlp)
        _check_greedy_one_submission_a_token(env, "wgpu", monkeypatch)
    _check_close_with_a_held_run("wgpu", mlp)


@pytest.mark.dawn
def test_dawn_held_runs(dawn_env, mlp, monkeypatch):
    pytest.importorskip("torch")
    _check_write_after_held_run(dawn_env, "dawn", mlp)
    _check_copies_that_change(dawn_env, "dawn", mlp)
    _check_greedy_one_submission_a_token(dawn_env, "dawn", monkeypatch)
    _check_close_with_a_held_run("dawn", mlp)


@pytest.mark.dawn
def test_dawn_reports_a_held_runs_submit_error(dawn_env, mlp):
    """A held run whose buffer was destroyed behind the context's back: the next use of the queue
    raises Dawn's validation error as a DeviceError (wgpu-native aborts the process on such a
    submit, which is why the context submits held runs before it destroys a buffer)."""
    case, prog, xa, *_ = mlp
    s = dawn_env.session(prog, device="dawn")
    try:
        ctx = s.executor.device
        s.run("forward", [xa], keep_on_device=True)
        s.run("forward", [xa], keep_on_device=True)
        assert ctx.queue.held
        buf = s.executor.buffer_of(0, s.executor.plan.payloads[0].inputs[0].buf)
        buf.destroy()  # not through the context: the held run still uses it
        with pytest.raises(DeviceError, match="destroyed"):
            ctx.fence()
        assert not ctx.queue.held
        ctx.fence()  # the failed submission is gone: the queue works on
    finally:
        s.close()
