"""SmolLM2-135M-Instruct end to end on the reference executor: our GGUF reading against
transformers' GGUF loader, the exported program (prefill + decode sharing one copy of the weights)
against transformers' LlamaForCausalLM built from the GGUF metadata with the same dequantized
weights: prefill logits against float64, and greedy generation token for token."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="the gguf package reads SmolLM2's weights")

import gpudelegate  # noqa: E402
from gpudelegate.errors import InputError  # noqa: E402
from gpudelegate.llm import LLMLayout, generate, int32_tensor, zeros  # noqa: E402
from gpudelegate.text import tokenizer_from_metadata  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
smollm2 = pytest.importorskip("gpudelegate.export.models.smollm2")

pytestmark = pytest.mark.slow

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],  # 2 prefill chunks
    "The three primary colors are",  # raw text, one padded chunk
    [{"role": "user", "content": "Write a haiku about the ocean. Use simple words, and mention the moon, "
                                 "the tide and a small wooden boat drifting home at night."}],  # 3 chunks
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def checkpoint():
    return smollm2.read_gguf()


@pytest.fixture(scope="session")
def program_path(tmp_path_factory):
    """The exported program, once per test session (it reads the GGUF itself, so the session
    scope keeps no weights in memory)."""
    path = tmp_path_factory.mktemp("smollm2") / "smollm2.gdp"
    smollm2.export(path, progress=False)
    yield path
    path.unlink()  # 540 MB: pytest keeps the last runs' temp dirs


@pytest.fixture(scope="module")
def session(program_path):
    env = gpudelegate.Environment()
    s = env.session(program_path, device="reference")
    yield s
    s.close()
    env.close()


@pytest.fixture(scope="module")
def tokenizer(session):
    return tokenizer_from_metadata(session.program.metadata["tokenizer"])


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    """transformers' Llama from a config matching the GGUF metadata, with the same weights."""
    model = transformers.LlamaForCausalLM(checkpoint.config.hf_config())
    missing, unexpected = model.load_state_dict(checkpoint.state_dict, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding below
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def test_weights_match_transformers_gguf_loader(checkpoint):
    """Names, Q/K un-permutation and dequantization agree with transformers' own GGUF reading."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(checkpoint.config.hf_config())
    ref = load_gguf_checkpoint(str(smollm2.gguf_path()), return_tensors=True, model_to_load=skeleton)
    assert set(ref["tensors"]) == set(checkpoint.state_dict)
    for name, w in checkpoint.state_dict.items():
        assert torch.equal(torch.as_tensor(ref["tensors"][name]).float(), w), name
    cfg, c = ref["config"], checkpoint.config
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"], cfg["rope_theta"]) == \
           (c.layers, c.hidden, c.intermediate, c.heads, c.kv_heads, c.vocab_size, c.rope_theta)
    assert cfg["rms_norm_eps"] == pytest.approx(c.rms_eps, rel=1e-6) and cfg["tie_word_embeddings"]


def test_program_stores_each_weight_once(program_path, session, checkpoint):
    prog = session.program
    assert set(prog.methods) == {"prefill", "decode"}
    weight_bytes = sum(t.numel() * 4 for t in checkpoint.state_dict.values())  # tied: embedding once
    size = os.path.getsize(program_path)
    assert abs(size - weight_bytes) <= 0.01 * weight_bytes, (size, weight_bytes)

    def constants_read(method):
        (node,) = prog.methods[method].nodes  # one delegate call: the whole method runs on the device
        payload = prog.payloads[node.attrs["payload"]]
        return {payload.values[e.src].constant for e in payload.prepack}

    pre, dec = constants_read("prefill"), constants_read("decode")
    big = {i for i, c in enumerate(prog.constants) if c.nbytes >= 4096}
    assert big <= pre and big <= dec  # every weight is read by both methods, from one stored copy
    layout = LLMLayout.from_metadata(prog.metadata)
    assert layout.max_context == 256 and len(layout.caches) == 2 * checkpoint.config.layers


def _prefill_logits(session, ids):
    layout = LLMLayout.from_metadata(session.program.metadata)
    caches = {n: zeros("float32", layout.cache_shape) for n in layout.caches}
    C = layout.prefill_chunk
    for start in range(0, len(ids), C):
        chunk = ids[start:start + C]
        outs = session.run("prefill", {"ids": int32_tensor(chunk + [0] * (C - len(chunk)), (1, C)),
                                       "pos": int32_tensor([start], (1,)), "last": int32_tensor([len(chunk) - 1], (1,)),
                                       **caches}, keep_on_device=True)
        caches = dict(zip(layout.caches, outs[1:]))
    return outs[0].numpy()[0]


def _hf_logits_float64(hf_model, ids):
    try:
        hf_model.double()
        with torch.no_grad():
            return hf_model(input_ids=torch.tensor([ids])).logits[0, -1].numpy()
    finally:
        hf_model.float()  # float64 -> float32 of float32 values is exact


def test_prefill_logits_match_float64(session, hf_model):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 49152, size=41).tolist()  # 41 tokens: two prefill chunks, the second padded
    ours = _prefill_logits(session, ids)
    ref = _hf_logits_float64(hf_model, ids)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    # fp32 through 30 layers: ~1e-6 measured (transformers' own fp32 is as far); 1e-4 is the bound
    assert rel <= 1e-4, f"seed {seed}: max error {rel} relative to max |logit|"
    assert int(np.argmax(ours)) == int(np.argmax(ref))


def test_fp16_weights(checkpoint, hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm2-fp16") / "smollm2-fp16.gdp"
    prog = smollm2.export(path, checkpoint=checkpoint, weights_dtype="float16", progress=False)
    assert prog.metadata["weights_dtype"] == "float16"
    assert sum(e.layout == "fp16" for p in prog.payloads for e in p.prepack) >= 2 * 7 * checkpoint.config.layers
    seed = int.from_bytes(os.urandom(4), "little")
    ids = np.random.default_rng(seed).integers(3, 49152, size=23).tolist()
    with gpudelegate.Environment() as env:
        s = env.session(path, device="reference")
        ours = _prefill_logits(s, ids)
        s.close()
    path.unlink()
    ref = _hf_logits_float64(hf_model, ids)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    # float16 storage rounds every weight by up to 2^-11 relative (compute stays float32):
    # ~7e-4 measured; 5e-3 is the bound
    assert rel <= 5e-3, f"seed {seed}: max error {rel} relative to max |logit|"


def _hf_greedy(model, ids, n):
    out = []
    with torch.no_grad():
        o = model(input_ids=torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            nxt = int(o.logits[0, -1].argmax())
            out.append(nxt)
            o = model(input_ids=torch.tensor([[nxt]]), past_key_values=o.past_key_values, use_cache=True)
    return out


@pytest.mark.parametrize("prompt", PROMPTS, ids=["chat-2-chunks", "raw-1-chunk", "chat-3-chunks"])
def test_greedy_generation_matches_transformers(session, tokenizer, hf_model, prompt):
    streamed = []
    result = generate(session, tokenizer, prompt, max_new_tokens=NEW_TOKENS, stop_ids=(),
                      on_token=lambda i, piece: streamed.append(piece))
    ref = _hf_greedy(hf_model, result.prompt_ids, NEW_TOKENS)
    assert result.ids == ref, (tokenizer.decode(result.ids), tokenizer.decode(ref))
    assert "".join(streamed) == result.text == tokenizer.decode(result.ids, skip_special_tokens=True)
    assert result.stop_reason == "length" and result.decode_steps == NEW_TOKENS - 1


def test_generation_limits(session, tokenizer):
    r = generate(session, tokenizer, PROMPTS[0], max_new_tokens=40)  # stops at <|im_end|>
    assert r.stop_reason == "eos" and r.ids[-1] in tokenizer.eos_ids and "Paris" in r.text
    with pytest.raises(InputError, match="context is 256"):
        generate(session, tokenizer, "word " * 300, max_new_tokens=1)
