"""A small causal LM for the greedy-decoding tests (tests/webgpu/test_wgpu_greedy.py,
tests/cuda/test_cuda_greedy.py), a tokenizer for prompts given as ids, and a fixed prefill +
decode sequence whose outputs the captured-graph tests compare (tests/cuda/test_cuda_pdl.py,
test_cuda_l2.py)."""

from __future__ import annotations

import numpy as np

from gpudelegate.text.ids import IdsTokenizer  # noqa: F401 (the tests' tokenizer)

V = 1009  # a prime vocabulary
CONTEXT = 32


def tiny_causal_lm(weights_dtype="float32"):
    """A one-layer SmolLM2-shaped causal LM (9/3 heads of 64, MLP 1536) with seeded random
    weights, larger than the init's so the greedy tokens vary, a 1009-token vocabulary, a
    32-token context in chunks of 8; ``weights_dtype`` as export_program takes it (e.g. "q4_1")."""
    import torch

    from gpudelegate.export.models import smollm2
    from gpudelegate.export.writer import export_program

    cfg = smollm2.SmolLM2Config(layers=1, vocab_size=V, max_context=CONTEXT, prefill_chunk=8)
    torch.manual_seed(7)
    model = smollm2.SmolLM2(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    names = smollm2.cache_names(cfg)
    meta = {"llm": {"max_context": CONTEXT, "prefill_chunk": 8, "layers": 1, "kv_heads": cfg.kv_heads,
                    "head_dim": cfg.head_dim, "vocab_size": V, "cache_dtype": "float32", "caches": names}}
    with torch.no_grad():
        methods = {"prefill": (smollm2.Prefill(model), smollm2.example_inputs(cfg, "prefill")),
                   "decode": (smollm2.Decode(model), smollm2.example_inputs(cfg, "decode"))}
        return export_program(methods, progress=False, metadata=meta, weights_dtype=weights_dtype,
                              input_names={"prefill": ["ids", "pos", "last", *names], "decode": ["ids", "pos", *names]},
                              output_names={m: ["logits", *names] for m in methods})


def decode_steps(s, steps: int = 6):
    """Prefill an 8-token prompt, then ``steps`` decode steps fed their own caches (kept on the
    device): every output of every step, on the host."""
    lay = s.program.metadata["llm"]
    zeros = [np.zeros((1, lay["kv_heads"], CONTEXT, lay["head_dim"]), np.float32) for _ in lay["caches"]]
    ids = np.random.default_rng(5).integers(0, V, (1, 8)).astype(np.int32)
    out = s.run("prefill", [ids, np.array([0], np.int32), np.array([7], np.int32), *zeros], keep_on_device=True)
    got = []
    for i in range(steps):
        out = s.run("decode", [np.array([[11 + i]], np.int32), np.array([8 + i], np.int32), *out[1:]],
                    keep_on_device=True)
        got.append([np.asarray(o.numpy()) for o in out])
    return got


def argmax_cases(rng):
    """(what, float64 values) for argmax checks: prime sizes, ties (also across workgroups),
    -inf, NaNs (the first wins), +inf."""
    import numpy as np

    inf, nan = np.inf, np.nan
    for n in (1, 2, 3, 251, 1021, 4099, 49157, 300007):  # 300007: more parts than argmax_final's one pass
        yield f"normal {n}", rng.standard_normal(n)
    yield "ties", np.array([0.5, 2.0, -1.0, 2.0, 2.0])
    big = rng.standard_normal(49157)
    big[[40000, 7, 30001]] = 9.0  # equal maxima in different workgroups: the first wins
    yield "ties across workgroups", big
    yield "all -inf", np.full(1031, -inf)
    yield "-inf then a value", np.concatenate([np.full(2053, -inf), [-1e30]])
    nans = rng.standard_normal(49157)
    nans[[44000, 3001, 3000]] = nan  # the first NaN wins
    yield "NaNs", nans
    yield "NaN after +inf", np.array([1.0, inf, 3.0, nan, inf])
    yield "+inf ties", np.array([-3.0, inf, inf])


def check_fused_greedy(env, device: str, ran: str, replaced: str, tuning=None) -> None:
    """This module's LM in q4_1: a 20-token prompt decoded to the context's end gives the
    reference executor's ids on ``device`` (a WebGPU one), picked on the host and on the device
    with 2 steps ahead, and its recorded decode step launched entry ``ran`` and not ``replaced``
    (the fused kernel a test is about, and the dispatch it replaces)."""
    import numpy as np

    import gpudelegate
    from gpudelegate.llm import generate

    prog = gpudelegate.loads(tiny_causal_lm(weights_dtype="q4_1").to_bytes())
    tok = IdsTokenizer()
    prompt = [int(x) for x in np.random.default_rng(3).integers(0, V, 20)]
    with env.session(prog, device=device, tuning=tuning) as g, env.session(prog, device="reference") as r:
        want = generate(r, tok, prompt, max_new_tokens=CONTEXT + 1, stop_ids=(), lookahead=None)
        for la in (None, 2):
            got = generate(g, tok, prompt, max_new_tokens=CONTEXT + 1, stop_ids=(), lookahead=la)
            assert got.ids == want.ids, (la, got.ids, want.ids)
        assert len(set(want.ids)) >= 3, want.ids
        pid = prog.methods["decode"].nodes[0].attrs["payload"]
        entries = [L.pipeline.label.split(":")[-1].strip() for n in g.executor.recorded[pid].nodes
                   for L in n.launches]
        assert ran in entries and replaced not in entries, entries
