"""The greedy pick on the CUDA executor (``argmax_device``: one launch of cuda_argmax.cu, the
first NaN winning as in torch.argmax) against numpy's argmax; its read (``index_value``: an event
after the copy into a pinned word, native/cuda_index_reads.py) waiting for that pick alone, picks
read out of order and more of them unread than the ring has words; and greedy generations whose
ids equal the host-picked loop's and the reference executor's for every lookahead (ids compared
exactly), with and without CUDA graphs; a decode step's small host inputs (pageable copies)
queued behind busy GPU work without waiting for it; and run()'s joins with the caller's stream:
none for the loop's own tensors (its picks, its caches), one for another library's device array."""

from __future__ import annotations

import numpy as np
import pytest

from gpudelegate.errors import InputError
from gpudelegate.executor import DeviceTensor, IndexTensor
from gpudelegate.native.cuda_index_reads import IndexReads

from cuda_env import REASON, cp
from greedy_program import CONTEXT, IdsTokenizer, argmax_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")]


def test_argmax_device_matches_numpy(env, program):
    with env.session(program, device="cuda") as s:
        ex = s.executor
        for what, vals in argmax_cases(np.random.default_rng(3)):
            for dtype in ("float32", "float16"):
                x = vals.astype(dtype)
                t = DeviceTensor(ex, dtype, (1, len(x)), cp.asarray(x.reshape(1, -1)), x.nbytes)
                idx = ex.argmax_device(t)
                assert (idx.dtype, idx.shape) == ("int32", (1, 1))
                assert ex.index_value(idx) == int(np.argmax(x)), (what, dtype)
        with pytest.raises(InputError, match="empty"):
            ex.argmax_device(DeviceTensor(ex, "float32", (1, 0), cp.zeros((1, 0), cp.float32), 0))


def test_greedy_on_the_gpu_gives_the_host_loops_ids(env, program):
    from gpudelegate.llm import generate

    tok = IdsTokenizer()
    with env.session(program, device="cuda") as c, env.session(program, device="cuda", capture_graph=True) as g, \
            env.session(program, device="reference") as r:
        assert c.executor.greedy_lookahead == 2
        for prompt in ([3], [int(x) for x in np.random.default_rng(2).integers(0, 1009, 20)]):
            want = generate(r, tok, prompt, max_new_tokens=CONTEXT + 1, stop_ids=(), lookahead=None)
            assert want.stop_reason == "context"
            cases = [dict(max_new_tokens=CONTEXT + 1, stop_ids=()), dict(max_new_tokens=CONTEXT + 1, stop_ids=[want.ids[3]]),
                     dict(max_new_tokens=1, stop_ids=()), dict(max_new_tokens=2, stop_ids=())]
            for case in cases:
                ref = generate(r, tok, prompt, **case, lookahead=None)
                for la in (None, 0, 1, 2):
                    for sess in (c, g):
                        got = generate(sess, tok, prompt, **case, lookahead=la)
                        assert (got.ids, got.stop_reason) == (ref.ids, ref.stop_reason), (la, prompt, case, sess is g)


_SPIN = r"""extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64(); while (clock64() - t0 < cycles) {} }"""


def _spin():
    return cp.RawKernel(_SPIN, "spin")


def _pick(ex, vals):
    x = vals.astype("float32")
    with ex.stream:  # the upload ordered before the pick on the executor's stream
        d = cp.asarray(x.reshape(1, -1))
    return ex.argmax_device(DeviceTensor(ex, "float32", (1, len(x)), d, x.nbytes))


def test_a_read_waits_for_its_pick_alone(env, program):
    """A pick, then ~0.3 s of GPU work queued on the same stream: the pick's value comes back
    while that work still runs (a stream sync would have waited for it)."""
    spin = _spin()
    vals = np.random.default_rng(4).standard_normal(4099)
    with env.session(program, device="cuda") as s:
        ex = s.executor
        ex.index_value(_pick(ex, vals[:7]))  # warm-up: the ring made, the argmax kernel compiled
        ex.stream.synchronize()
        idx = _pick(ex, vals)
        with ex.stream:
            spin((1,), (1,), (np.int64(600_000_000),))  # ~0.3 s at 2 GHz
        assert isinstance(idx, IndexTensor) and ex.index_value(idx) == int(np.argmax(vals.astype("float32")))
        assert not ex.stream.done  # the spin still runs: only the pick's event was waited for
        ex.stream.synchronize()


@pytest.mark.parametrize("mapped", [True, False], ids=["stored-by-the-kernel", "copied"])
def test_picks_read_out_of_order_and_past_the_ring(env, program, mapped):
    """Both ways a pick reaches its host word: stored by the argmax kernel (pinned words mapped
    into the device's address space, what a 64-bit CUDA device has) and copied after it."""
    rng = np.random.default_rng(6)
    vals = [rng.standard_normal(n) for n in (251, 1021, 4099) * 4]  # 12 picks: more than the ring's words
    assert len(vals) > IndexReads.SLOTS
    with env.session(program, device="cuda") as s:
        ex = s.executor
        ex.index_value(_pick(ex, vals[0][:7]))  # the ring made
        assert ex._index_reads.mapped  # unified addressing: the kernel stores the pick itself
        if not mapped:
            ex._index_reads.mapped = 0
        picks = [_pick(ex, v) for v in vals]
        for p, v in reversed(list(zip(picks, vals))):
            assert ex.index_value(p) == int(np.argmax(v.astype("float32")))
            assert int(ex.to_host(p).ravel()[0]) == ex.index_value(p)  # the device word itself


def _prefill_8(s, program):
    """The tiny LM's prefill of 8 prompt tokens from zero caches, outputs kept on the device."""
    llm = program.metadata["llm"]
    zeros = [np.zeros((1, llm["kv_heads"], CONTEXT, llm["head_dim"]), np.float32) for _ in llm["caches"]]
    return s.run("prefill", [np.arange(8, dtype=np.int32).reshape(1, 8), np.array([0], np.int32),
                             np.array([7], np.int32), *zeros], keep_on_device=True)


def test_the_loops_own_tensors_are_fed_back_without_joining_the_callers_stream(env, program):
    """A decode step fed a pick, a host position and the caches it returned, called from a stream
    that is busy: our stream does not wait for the caller's work (no join: these tensors were
    written on our stream), and the step equals the same step run from an idle caller."""
    spin = _spin()
    with env.session(program, device="cuda", capture_graph=True) as s:
        ex = s.executor
        out = _prefill_8(s, program)
        pick = ex.argmax_device(out[0])
        caches = out[1:]
        for _ in range(2):  # the graph captured, then replayed
            s.run("decode", [pick, np.array([8], np.int32), *caches], keep_on_device=True)
        want = s.run("decode", [pick, np.array([8], np.int32), *caches], keep_on_device=True)[0].numpy()
        busy = cp.cuda.Stream(non_blocking=True)
        with busy:
            spin((1,), (1,), (np.int64(600_000_000),))  # ~0.3 s at 2 GHz
            got = s.run("decode", [pick, np.array([8], np.int32), *caches], keep_on_device=True)
        ex.stream.synchronize()
        assert not busy.done  # our step finished while the caller's stream still spins
        busy.synchronize()
        assert np.array_equal(got[0].numpy(), want)


def test_another_librarys_device_input_is_read_after_the_callers_writes(env, program):
    """ids as a CuPy array written on the caller's stream behind ~0.3 s of work: run() orders our
    stream after that write (one event), so the step sees the new ids, not the ones before."""
    spin = _spin()
    with env.session(program, device="cuda", capture_graph=True) as s:
        out = _prefill_8(s, program)
        caches = out[1:]
        for _ in range(2):  # the graph captured, then replayed
            s.run("decode", [np.array([[5]], np.int32), np.array([8], np.int32), *caches], keep_on_device=True)
        want = s.run("decode", [np.array([[5]], np.int32), np.array([8], np.int32), *caches], keep_on_device=True)
        want = want[0].numpy()
        # other ids in the input's place: what a step that read before the caller's write would see
        s.run("decode", [np.array([[3]], np.int32), np.array([8], np.int32), *caches], keep_on_device=True)
        busy = cp.cuda.Stream(non_blocking=True)
        with busy:
            ids = cp.full((1, 1), 3, cp.int32)
            spin((1,), (1,), (np.int64(600_000_000),))
            ids.fill(5)  # behind the spin, on the caller's stream
            got = s.run("decode", [ids, np.array([8], np.int32), *caches], keep_on_device=True)
        busy.synchronize()
        assert np.array_equal(got[0].numpy(), want)


def test_a_decode_run_with_host_inputs_does_not_wait_for_queued_work(env, program):
    """A decode step's host ``pos`` (and host ``ids``) written while the GPU is busy: run()
    returns with the work still running, and the step's logits equal the same step run idle."""
    spin = _spin()
    with env.session(program, device="cuda", capture_graph=True) as s:
        ex = s.executor
        out = _prefill_8(s, program)
        caches = out[1:]
        for i in range(2):  # the graph captured, then replayed
            want = s.run("decode", [np.array([[5]], np.int32), np.array([8], np.int32), *caches], keep_on_device=True)
        want = want[0].numpy()
        with ex.stream:
            spin((1,), (1,), (np.int64(400_000_000),))
        got = s.run("decode", [np.array([[5]], np.int32), np.array([8], np.int32), *caches], keep_on_device=True)
        assert not ex.stream.done  # the inputs' copies were queued behind the spin
        assert np.array_equal(got[0].numpy(), want)
