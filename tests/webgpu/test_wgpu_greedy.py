"""Greedy decoding with the pick on the GPU (``Executor.argmax_device``, shaders/argmax.wgsl) and
the generation loop that submits decode steps before it reads the token they follow
(``gpudelegate.llm``, ``lookahead``): the kernel against numpy's argmax (the same first-index and
first-NaN rule as torch.argmax), and whole generations whose ids must equal the host-picked
loop's, on wgpu and on the numpy reference executor."""

from __future__ import annotations


import numpy as np
import pytest

from gpudelegate.errors import DeviceError, InputError
from gpudelegate.executor import DeviceTensor, IndexTensor

from conformance.executors import environment_fixture
from greedy_program import CONTEXT, V, IdsTokenizer, argmax_cases, tiny_causal_lm

pytestmark = pytest.mark.wgpu

env = environment_fixture("wgpu")


@pytest.fixture(scope="module")
def program():
    pytest.importorskip("torch")
    return tiny_causal_lm()


def _vector(ex, vals: np.ndarray, offset: int) -> DeviceTensor:
    """``vals`` (float32) written at byte ``offset`` of a buffer of their own, as a device tensor."""
    raw = vals.astype(np.float32).tobytes()
    buf = ex._buffer(offset + len(raw), "test vector")
    ex.device.write_buffer(buf, offset, raw)
    return DeviceTensor(ex, "float32", (1, len(vals)), (buf, offset), len(raw))


@pytest.mark.parametrize("offset", [0, 4, 260])  # 4, 260: not at a storage-binding alignment
def test_argmax_device_matches_numpy(env, program, offset):
    rng = np.random.default_rng(11 + offset)
    with env.session(program, device="wgpu") as s:
        ex = s.executor
        for what, vals in argmax_cases(rng):
            idx = ex.argmax_device(_vector(ex, vals, offset))
            assert isinstance(idx, IndexTensor) and (idx.dtype, idx.shape) == ("int32", (1, 1))
            want = int(np.argmax(vals.astype(np.float32)))  # numpy: first max, first NaN
            assert ex.index_value(idx) == want, (what, offset)
            assert ex.index_value(idx) == want  # read once, kept
            assert int(ex.to_host(idx).ravel()[0]) == want  # the device word itself


def test_argmax_device_errors(env, program):
    with env.session(program, device="wgpu") as s:
        ex = s.executor
        empty = DeviceTensor(ex, "float32", (1, 0), (ex._buffer(4, "empty"), 0), 0)
        with pytest.raises(InputError, match="empty"):
            ex.argmax_device(empty)
        with pytest.raises(InputError, match="empty"):
            ex.argmax(empty)
        with pytest.raises(InputError, match="index_value"):
            ex.index_value(np.zeros(3, np.float32).tobytes())
    with env.session(program, device="reference") as s:
        ref = s.executor
        outs = s.run("decode", _decode_inputs(s), keep_on_device=True)
        host = ref.argmax_device(outs[0])  # the base: a host pick, as an int32 [1, 1] HostTensor
        assert (host.dtype, host.shape) == ("int32", (1, 1))
        assert ref.index_value(host) == int(np.argmax(ref.to_host(outs[0])))


def _decode_inputs(s):
    from gpudelegate import llm

    layout = llm.LLMLayout.from_metadata(s.program.metadata)
    return {"ids": np.array([[5]], np.int32), "pos": np.array([3], np.int32),
            **{c: np.zeros(layout.cache_shape, np.float32) for c in layout.caches}}


def test_greedy_on_the_gpu_gives_the_host_loops_ids(env, program):
    """The ids of wgpu's pipelined loop (lookahead 0, 1, 2) and its host-picked loop (lookahead
    None) equal the reference's host-picked loop, for a 20-token prompt, EOS in the middle,
    max_new_tokens 1 and 2 and the context's end."""
    from gpudelegate.llm import generate

    tok = IdsTokenizer()
    # one prompt of 20 random ids (a 1-token prompt: tests/core/test_text_pure.py's fake queue)
    prompts = [[int(x) for x in np.random.default_rng(2).integers(0, V, 20)]]
    with env.session(program, device="wgpu") as g, env.session(program, device="reference") as r:
        # 2 ahead on a GPU (a read waits for its own submission, native/wgpu_pending_reads.py); none
        # on a software adapter, where a step ahead takes the CPU cores the awaited one needs
        assert g.executor.greedy_lookahead == (0 if g.executor.device.is_fallback_adapter else 2)
        for prompt in prompts:
            free = generate(r, tok, prompt, max_new_tokens=CONTEXT + 1, stop_ids=(), lookahead=None)
            assert free.stop_reason == "context" and len(free.ids) == CONTEXT - len(prompt) + 1
            new = [i for i, t in enumerate(free.ids) if t not in free.ids[:i]]
            assert len(new) >= 3, free.ids  # tokens that vary: an EOS can stop in the middle
            cases = [dict(max_new_tokens=CONTEXT + 1, stop_ids=()),
                     dict(max_new_tokens=CONTEXT + 1, stop_ids=[free.ids[new[2]]]),
                     dict(max_new_tokens=1, stop_ids=()), dict(max_new_tokens=2, stop_ids=())]
            for case in cases:
                # (the reference's own lookahead loops: tests/core/test_text_pure.py, a fake queue)
                want = generate(r, tok, prompt, **case, lookahead=None)
                for la in (None, 0, 1, 2):
                    got = generate(g, tok, prompt, **case, lookahead=la)
                    assert (got.ids, got.stop_reason, got.text) == (want.ids, want.stop_reason, want.text), \
                        (la, prompt, case)
                    assert got.decode_steps == len(got.ids) - 1 == len(got.step_seconds)
            # "auto": the executor's lookahead
            assert generate(g, tok, prompt, max_new_tokens=5, stop_ids=()).ids == free.ids[:5]


def test_a_session_closed_with_an_index_pending_raises(env, program):
    with env.session(program, device="wgpu") as s:
        ex = s.executor
        outs = s.run("decode", _decode_inputs(s), keep_on_device=True)
        assert ex.index_value(ex.argmax_device(outs[0])) == int(np.argmax(ex.to_host(outs[0])))
    with pytest.raises(DeviceError, match="closed"):
        ex.argmax_device(outs[0])


def check_reads_resolve_one_submission_at_a_time(ex, ctx):
    """Picks submitted one after another and read newest first: each read waits for its own
    submission and returns its own value (each token has its own staging buffer); the queue
    counts as idle (the run-input staging's condition, native/wgpu_run_inputs.py) only once the
    last submission was read."""
    rng = np.random.default_rng(5)
    vals = [rng.standard_normal(n) for n in (1021, 4099, 251)]
    picks = [ex.argmax_device(_vector(ex, v, 0)) for v in vals]
    assert all(p.value is None for p in picks) and not ctx._idle
    for p, v in zip(picks[::-1], vals[::-1]):
        assert ex.index_value(p) == int(np.argmax(v.astype(np.float32)))
        if p is picks[-1]:
            assert ctx._idle  # the last submission was read: nothing in flight
    # A submission after the pick (a fence's marker): reading the pick leaves the queue busy.
    pick = ex.argmax_device(_vector(ex, vals[0], 0))
    marker = ctx.marker()
    assert ex.index_value(pick) == int(np.argmax(vals[0].astype(np.float32)))
    assert not ctx._idle
    ctx.wait(marker)
    assert ctx._idle

def test_reads_resolve_one_submission_at_a_time(env, program):
    with env.session(program, device="wgpu") as s:
        ctx = s.executor.device
        assert ctx.indexed_reads is not None  # wgpu-native's wgpuQueueSubmitForIndex path
        check_reads_resolve_one_submission_at_a_time(s.executor, ctx)
