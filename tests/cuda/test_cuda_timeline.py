"""The step's timeline switch (native/cuda_pdl.py Timeline, GD_TIMELINE in shaders/cuda_common.cu):
off by default; on, every launch captured while it is armed gets one record, each replay stamps
every record in the order start <= first wait <= last wait <= end, and the stamped kernels
compute exactly what the plain ones do (graph == eager bit for bit, the same logits as a context
without the switch, greedy ids equal to the reference's)."""

from __future__ import annotations

import numpy as np
import pytest

import gpudelegate

from cuda_env import REASON, cp
from test_cuda_decode_fusion import CFG, FEED, PROMPT, _packed_program, _steps

import bench_cuda as bc  # noqa: E402  (benchmarks/ is on sys.path through test_cuda_decode_fusion)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")]


def test_the_switch_is_off_by_default():
    from gpudelegate.native.cuda_pdl import PdlLauncher

    pdl = PdlLauncher(cp)
    assert pdl.timeline is None and pdl.prelude == ""


@pytest.fixture(scope="module")
def tl_env():
    """An Environment whose CUDA context was made with the switch on (its kernels carry the stamps)."""
    from gpudelegate.native.cuda_pdl import TIMELINE_ENV

    mp = pytest.MonkeyPatch()
    mp.setenv(TIMELINE_ENV, "1")
    e = gpudelegate.Environment()
    try:
        e.context("cuda")
    finally:
        mp.undo()
    yield e
    e.close()


def _decode_armed(s, tl):
    """Prefill, then decode steps over FEED with ``tl`` armed around the first decode run (the
    one that captures the decode graph): (logits of each step, the decode payload's state)."""
    out = s.run("prefill", _inputs(PROMPT, 0), keep_on_device=True)
    logits, caches, n = [out[0].numpy()], out[1:], len(PROMPT)
    for i, tok in enumerate(FEED):
        if i == 0:
            tl.arm()
        try:
            out = s.run("decode", _inputs([tok], n, caches), keep_on_device=True)
        finally:
            tl.disarm()
        logits.append(out[0].numpy())
        caches, n = out[1:], n + 1
    pid = s.program.methods["decode"].nodes[0].attrs["payload"]
    return logits, s.executor._states[pid], caches, n


def _inputs(tokens, pos, caches=None):
    return bc.step_inputs(CFG, tokens, pos) + (list(caches) if caches is not None else bc.empty_caches(CFG, np.float32))


def test_each_captured_launch_has_a_record_stamped_in_order(tl_env):
    prog = _packed_program("q4_1", {"prefill": len(PROMPT), "decode": 1})
    kernels = tl_env.context("cuda").kernels
    tl = kernels.pdl.timeline
    assert tl is not None and kernels.pdl.prelude
    with tl_env.session(prog, device="cuda", capture_graph=True) as s:
        _, st, caches, n = _decode_armed(s, tl)
        rows = len(tl.launches)
        # the packed decoder's step: per layer q/k/v + rope, attention + combine, o, gate/up, down; LM head
        assert rows >= 5 * CFG.layers + 1, tl.launches
        assert all(f and len(g) == 3 and len(b) == 3 for f, g, b in tl.launches), tl.launches
        ex = s.executor
        with ex.context.device, ex.stream:
            tl.reset()
        s.run("decode", _inputs([7], n, caches), keep_on_device=True)  # a replay of the captured graph
        ex.stream.synchronize()
        raw = tl.stamps.get()
        h = tl.reduce(raw[:rows])
        assert len(tl.launches) == rows, "a replay took records of its own"
        start, w1, w2, end = h.T
        assert (start > 0).all(), f"unstamped records: {np.flatnonzero(start <= 0)}"
        assert (start <= w1).all() and (w1 <= w2).all() and (w2 <= end).all(), h
        # one launch after another: each starts its work after the one before it has ended
        assert (w1[1:] >= end[:-1]).all(), np.flatnonzero(w1[1:] < end[:-1])
        # records after the captured ones stay untouched
        rest = raw[rows:]
        assert (rest[..., :2] == np.iinfo(np.uint64).max).all() and (rest[..., 2:] == 0).all()


def test_stamped_kernels_compute_what_the_plain_ones_do(tl_env, env):
    prog = _packed_program("q4_1", {"prefill": len(PROMPT), "decode": 1})
    tl = tl_env.context("cuda").kernels.pdl.timeline
    with tl_env.session(prog, device="cuda", capture_graph=True) as s:
        graph = _decode_armed(s, tl)[0]
    with tl_env.session(prog, device="cuda") as s:
        eager = _steps(s, PROMPT, FEED)[0]
    with env.session(prog, device="cuda", capture_graph=True) as s:
        plain = _steps(s, PROMPT, FEED)[0]
    with env.session(prog, device="reference") as s:
        ref = _steps(s, PROMPT, FEED)[0]
    for i, (g, e, p, r) in enumerate(zip(graph, eager, plain, ref)):
        np.testing.assert_array_equal(g, e, err_msg=f"step {i}: stamped graph differs from stamped eager")
        np.testing.assert_array_equal(g, p, err_msg=f"step {i}: stamped differs from plain")
        assert bc.rel_err(g, r) < 1e-4, (i, bc.rel_err(g, r))  # the decode fusion tests' bound


def test_greedy_ids_with_stamps_are_the_references(tl_env):
    prog = _packed_program("q4_1", {"prefill": len(PROMPT), "decode": 1}, seed=11, scale=20.0)
    with tl_env.session(prog, device="reference") as s:
        _, want = _steps(s, PROMPT, [], greedy=12)
    with tl_env.session(prog, device="cuda", capture_graph=True) as s:
        _, got = _steps(s, PROMPT, [], greedy=12)
    assert got == want
