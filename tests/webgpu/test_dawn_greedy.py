"""Greedy decoding with the pick on the GPU on Dawn (``DawnContext.submit_read``: wgpudawn's own
map, started right after the submit, waited for alone): picks read out of order return their own
values, and generations looking ahead give the host-picked loop's ids (tolerance: none, token ids
are compared exactly; the reference and Dawn pick from float32 logits of the same tiny model).

Runs where a Dawn adapter starts (tests/run_all.sh: Mesa 25's lavapipe; the GPU machine).
"""

from __future__ import annotations

import numpy as np
import pytest

from greedy_program import CONTEXT, V, IdsTokenizer
from test_wgpu_greedy import check_reads_resolve_one_submission_at_a_time, program  # noqa: F401 (fixture)

pytestmark = pytest.mark.dawn


@pytest.fixture(scope="module")
def env(dawn_env):
    return dawn_env


def test_reads_resolve_one_submission_at_a_time(env, program):  # noqa: F811
    with env.session(program, device="dawn") as s:
        assert s.executor.device.indexed_reads is None  # Dawn: its own maps, tied to a submission
        check_reads_resolve_one_submission_at_a_time(s.executor, s.executor.device)


def test_greedy_looking_ahead_gives_the_host_loops_ids(env, program):  # noqa: F811
    from gpudelegate.llm import generate

    tok = IdsTokenizer()
    prompt = [int(x) for x in np.random.default_rng(2).integers(0, V, 20)]
    with env.session(program, device="dawn") as d, env.session(program, device="reference") as r:
        want = generate(r, tok, prompt, max_new_tokens=CONTEXT + 1, stop_ids=(), lookahead=None)
        assert want.stop_reason == "context"
        stop = dict(max_new_tokens=CONTEXT + 1, stop_ids=[want.ids[5]])
        for case in (dict(max_new_tokens=CONTEXT + 1, stop_ids=()), stop):
            ref = generate(r, tok, prompt, **case, lookahead=None)
            for la in (None, 0, 2):
                got = generate(d, tok, prompt, **case, lookahead=la)
                assert (got.ids, got.stop_reason) == (ref.ids, ref.stop_reason), (la, case)
