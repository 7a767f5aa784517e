"""The pure-Python text stack (tokenizers, chat template, generation loop) with nothing but the
standard library: this file runs with numpy blocked and inside Pyodide (tests/core_tests.txt).
The comparisons with `tokenizers` on the real vocabularies are in tests/test_tokenizers.py; here
toy vocabularies, an ASCII-equivalent `re` regex, and a pure-Python causal "model" behind the
session interface check the logic itself."""

import random
import re
import struct
from types import SimpleNamespace

import pytest

from gpudelegate.errors import InputError, PayloadError
from gpudelegate.executor import HostTensor
from gpudelegate.llm import GenerationResult, LLMLayout, Sampler, generate, generation_steps, to_float_list
from gpudelegate.text import split_special, tokenizer_from_metadata
from gpudelegate.text.bpe import BPETokenizer, bytes_to_unicode, split_digits, split_gpt2
from gpudelegate.text.chat import ChatTemplate
from gpudelegate.text.wordpiece import WordPieceTokenizer

# The GPT-2 pattern with \p{L} -> [A-Za-z] and \p{N} -> [0-9]: identical to the real pattern on
# ASCII text, which Python's `re` can run.
ASCII_GPT2 = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")


def test_gpt2_scanner_equals_the_regex_on_ascii():
    rng = random.Random(1234)
    alphabet = "ab Z09 '\t\n\r!?.,;-_sStTdmlvre\x0b\x0c"
    for n in range(2000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 23)))
        assert split_gpt2(s) == ASCII_GPT2.findall(s), repr(s)


def test_gpt2_scanner_unicode_classes():
    # letters, numbers and other symbols are classified by Unicode category, whitespace by White_Space
    assert split_gpt2("héllo wörld") == ["héllo", " wörld"]
    assert split_gpt2("日本 語") == ["日本", " 語"]
    assert split_gpt2("x²½ ⅫY") == ["x", "²½", " Ⅻ", "Y"]
    assert split_gpt2("a\u00a0\u00a0b") == ["a", "\u00a0", "\u00a0", "b"]  # NBSP is whitespace, not ' '
    assert split_gpt2("a\u3000 b") == ["a", "\u3000", " b"]
    assert split_gpt2("🎉🎉 !") == ["🎉🎉", " !"]
    assert split_digits("ab12c3") == ["ab", "1", "2", "c", "3"]


def test_split_special_is_leftmost_longest():
    assert split_special("a<x><xy>b<x", ["<x>", "<xy>", "<x"]) == [
        ("a", False), ("<x>", True), ("<xy>", True), ("b", False), ("<x", True)]
    assert split_special("", ["<x>"]) == []
    assert split_special("plain", []) == [("plain", False)]


# ----------------------------------------------------------------------------- toy BPE

def toy_bpe(merges=("a b", "ab c", "Ġ a", "Ġa b"), specials=("<eos>", "<pad>")):
    b2u = bytes_to_unicode()
    tokens = list(specials) + [b2u[b] for b in range(256)]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    return BPETokenizer(tokens=tokens, merges=list(merges), special_tokens=tuple(specials),
                        eos_ids=(0,), chat=ChatTemplate(default_system="sys").to_metadata())


def test_bpe_applies_merges_by_rank():
    tok = toy_bpe()
    ids = tok.encode("abc ab aab")
    # lowest rank first: in " ab" the pair "a b" (rank 0) beats "Ġ a" (rank 2), and no merge joins
    # "Ġ" with "ab", so "Ġa b" never applies there; in " aab" "a b" goes first, then "Ġ a".
    assert [tok.tokens[i] for i in ids] == ["abc", "Ġ", "ab", "Ġa", "ab"]
    tok2 = toy_bpe(merges=("b c", "a b", "ab c"))
    assert [tok2.tokens[i] for i in tok2.encode("abc")] == ["a", "bc"]


def test_bpe_round_trip_on_random_unicode():
    tok = toy_bpe()
    rng = random.Random(7)
    pool = "abc xyz\n\t'sé中🎉½<eos>"
    for _ in range(300):
        s = "".join(rng.choice(pool) for _ in range(rng.randint(0, 31)))
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert tok.decode(tok.encode(s, allow_special=False)) == s
        stream = tok.stream_decoder(skip_special_tokens=False)
        assert "".join([stream.feed(i) for i in ids] + [stream.flush()]) == s


def test_bpe_metadata_round_trip_and_errors():
    tok = toy_bpe()
    back = tokenizer_from_metadata(tok.to_metadata())
    assert back.encode("abc <eos>") == tok.encode("abc <eos>")
    assert back.apply_chat_template([{"role": "user", "content": "q"}]) == \
        "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    meta = tok.to_metadata()
    meta["tokens"] = meta["tokens"][:5] + [3]
    with pytest.raises(PayloadError, match="metadata.tokenizer.tokens"):
        tokenizer_from_metadata(meta)
    with pytest.raises(PayloadError, match="special_tokens"):
        BPETokenizer(tokens=tok.tokens, merges=[], special_tokens=("<nope>",))
    with pytest.raises(InputError, match="no chat template"):
        BPETokenizer(tokens=tok.tokens, merges=[]).apply_chat_template([{"role": "user", "content": "q"}])


# ----------------------------------------------------------------------------- toy WordPiece

def toy_wordpiece(**kw):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##aff", "##able", "play", "##ing", "!", "中",
             "cafe", "a", "##a"]
    return WordPieceTokenizer(vocab=vocab, **kw)


def test_wordpiece_pipeline():
    tok = toy_wordpiece()
    v = tok.vocab
    assert [v[i] for i in tok.encode("UnAffable playing!", add_special_tokens=False)] == \
        ["un", "##aff", "##able", "play", "##ing", "!"]
    assert [v[i] for i in tok.encode("Café中cafe")] == ["[CLS]", "cafe", "中", "cafe", "[SEP]"]  # accents stripped
    assert [v[i] for i in tok.encode("unplayable [MASK]", add_special_tokens=False)] == ["[UNK]", "[MASK]"]
    assert [v[i] for i in tok.encode("aaaa", add_special_tokens=False)] == ["a", "##a", "##a", "##a"]
    long = toy_wordpiece(max_input_chars_per_word=3)
    assert [v[i] for i in long.encode("aaaa aaa", add_special_tokens=False)] == ["[UNK]", "a", "##a", "##a"]
    assert tok.normalize("A\u0000b\tc\u200b") == "ab c"  # controls removed, whitespace -> space
    assert tok.decode(tok.encode("unaffable playing!")) == "unaffable playing!"
    cased = toy_wordpiece(lowercase=False)
    assert cased.normalize("Café") == "Café"


# ----------------------------------------------------------------------------- chat template

SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_chat_template_from_jinja():
    t = ChatTemplate.from_jinja(SMOL_TEMPLATE)
    assert t.default_system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    sys_first = t.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], add_generation_prompt=False)
    assert sys_first == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    assert t.render([{"role": "user", "content": "U"}]).startswith("<|im_start|>system\nYou are")
    with pytest.raises(InputError, match="chat messages"):
        t.render("just text")
    with pytest.raises(PayloadError):
        ChatTemplate.from_metadata({"format": "llama3"})


# ----------------------------------------------------------------------------- generation loop

class FakeCausalLM:
    """A causal 'model' in pure Python behind the Session interface of an exported SmolLM2: each
    layer's K cache row p holds the token at position p and its V cache row p the position + 1,
    written at `pos` like kv_update; the logits at position p peak at a function of the cached
    tokens 0..p only (the causal mask). Wrong positions, chunk padding, `last` rows or cache
    plumbing change the tokens, and inconsistent caches raise."""

    def __init__(self, vocab: int, max_context: int = 24, chunk: int = 8, layers: int = 2):
        self.V, self.S, self.C, self.layers = vocab, max_context, chunk, layers
        names = [f"{kv}{i}" for i in range(layers) for kv in ("k", "v")]
        self.names = names
        meta = {"llm": {"max_context": max_context, "prefill_chunk": chunk, "layers": layers, "kv_heads": 1,
                        "head_dim": 1, "vocab_size": vocab, "cache_dtype": "float32", "caches": names}}
        self.program = SimpleNamespace(metadata=meta, methods={"prefill": None, "decode": None})
        self.calls = []

    @staticmethod
    def target(tokens, vocab):
        return (sum(tokens) * 7 + len(tokens)) % vocab

    def run(self, method, inputs, keep_on_device=False):
        expected = {"ids", "pos"} | ({"last"} if method == "prefill" else set()) | set(self.names)
        assert set(inputs) == expected, sorted(inputs)
        ids = list(struct.unpack(f"<{len(inputs['ids'].data) // 4}i", inputs["ids"].data))
        pos = struct.unpack("<i", inputs["pos"].data)[0]
        assert len(ids) == (self.C if method == "prefill" else 1)
        caches = {n: to_float_list(inputs[n]) for n in self.names}
        for n in self.names:
            assert len(caches[n]) == self.S
        for t, tok in enumerate(ids):  # kv_update: rows pos..pos+T-1
            assert pos + t < self.S, "a chunk wrote past the cache"
            for i in range(self.layers):
                caches[f"k{i}"][pos + t] = float(tok)
                caches[f"v{i}"][pos + t] = float(pos + t + 1)
        row = struct.unpack("<i", inputs["last"].data)[0] if method == "prefill" else 0
        p = pos + row
        for i in range(1, self.layers):
            assert caches[f"k{i}"][:p + 1] == caches["k0"][:p + 1], "layer caches disagree"
        assert caches["v0"][:p + 1] == [float(j + 1) for j in range(p + 1)], "a cache row was skipped"
        target = self.target([int(x) for x in caches["k0"][:p + 1]], self.V)
        logits = [-abs(v - target) / 3.0 for v in range(self.V)]
        self.calls.append((method, pos, row))
        pack = lambda vals: HostTensor("float32", (1, 1, self.S, 1), struct.pack(f"<{len(vals)}f", *vals))
        return [HostTensor("float32", (1, self.V), struct.pack(f"<{self.V}f", *logits))] + \
            [pack(caches[n]) for n in self.names]


def expected_greedy(prompt, n, vocab, stops=()):
    seq, out = list(prompt), []
    for _ in range(n):
        t = FakeCausalLM.target(seq, vocab)
        out.append(t)
        seq.append(t)
        if t in stops:
            break
    return out


@pytest.mark.parametrize("prompt_len", [1, 7, 8, 9, 19])
def test_generate_greedy_with_chunked_prefill(prompt_len):
    tok = toy_bpe()
    lm = FakeCausalLM(vocab=len(tok.tokens))
    rng = random.Random(prompt_len)
    prompt = [rng.randrange(2, len(tok.tokens)) for _ in range(prompt_len)]
    n = min(4, lm.S - prompt_len)
    r = generate(lm, tok, prompt, max_new_tokens=n, stop_ids=())
    assert isinstance(r, GenerationResult)
    assert r.ids == expected_greedy(prompt, n, lm.V)
    assert r.stop_reason == "length" and r.decode_steps == n - 1 and r.prompt_ids == prompt
    chunks = [c for c in lm.calls if c[0] == "prefill"]
    assert [c[1] for c in chunks] == list(range(0, prompt_len, lm.C))  # chunk starts at multiples of C
    assert chunks[-1][2] == (prompt_len - 1) % lm.C  # `last` picks the final prompt token's row
    assert [c[1] for c in lm.calls if c[0] == "decode"] == list(range(prompt_len, prompt_len + n - 1))


def test_generate_stops_at_eos_and_context():
    tok = toy_bpe()
    lm = FakeCausalLM(vocab=len(tok.tokens))
    prompt = [5, 9, 11]
    free = expected_greedy(prompt, 10, lm.V)
    stop = free[3]
    r = generate(lm, tok, prompt, max_new_tokens=10, stop_ids=[stop])
    assert r.ids == free[:free.index(stop) + 1] and r.stop_reason == "eos"
    r = generate(FakeCausalLM(vocab=lm.V), tok, [3] * 20, max_new_tokens=50, stop_ids=())
    assert r.stop_reason == "context" and len(r.ids) == 24 - 20 + 1  # the last token needs no cache row
    seen = []
    r = generate(FakeCausalLM(vocab=lm.V), tok, "abc", max_new_tokens=3, stop_ids=(),
                 on_token=lambda i, piece: seen.append((i, piece)))
    assert [i for i, _ in seen] == r.ids and "".join(p for _, p in seen) == r.text == tok.decode(r.ids, True)


def test_generate_chat_messages_use_the_template():
    tok = toy_bpe()
    lm = FakeCausalLM(vocab=len(tok.tokens), max_context=128)
    msgs = [{"role": "user", "content": "ab"}]
    r = generate(lm, tok, msgs, max_new_tokens=2, stop_ids=())
    assert r.prompt_ids == tok.encode(tok.apply_chat_template(msgs))


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    logits = [0.1 * ((i * 37) % 11) for i in range(53)]
    a = [Sampler(0.8, seed=3)(logits) for _ in range(5)]
    s1, s2 = Sampler(0.8, seed=3), Sampler(0.8, seed=3)
    draws1 = [s1(logits) for _ in range(40)]
    assert draws1 == [s2(logits) for _ in range(40)]
    assert len(set(draws1)) > 1  # it samples
    assert all(Sampler(1.5, top_k=1, seed=s)(logits) == logits.index(max(logits)) for s in range(10))
    top3 = sorted(range(53), key=lambda i: -logits[i])[:3]
    assert all(x in top3 or logits[x] == logits[top3[-1]] for x in (Sampler(2.0, top_k=3, seed=s)(logits) for s in range(30)))
    assert a[0] in range(53)


def test_generation_errors():
    tok = toy_bpe()
    lm = FakeCausalLM(vocab=len(tok.tokens))
    with pytest.raises(InputError, match="context is 24"):
        generate(lm, tok, [3] * 24, max_new_tokens=1)
    with pytest.raises(InputError, match="outside the vocabulary"):
        generate(lm, tok, [lm.V + 5], max_new_tokens=1)
    with pytest.raises(InputError, match="temperature"):
        generate(lm, tok, [3], max_new_tokens=1, temperature=-1)
    with pytest.raises(InputError, match="top_k"):
        generate(lm, tok, [3], max_new_tokens=1, temperature=1.0, top_k=0)
    with pytest.raises(InputError, match="prompt"):
        generate(lm, tok, [], max_new_tokens=1)
    with pytest.raises(InputError, match="max_new_tokens"):
        generate(lm, tok, [3], max_new_tokens=-1)
    no_llm = SimpleNamespace(program=SimpleNamespace(metadata={}, methods={"forward": None}))
    with pytest.raises(PayloadError, match="metadata.llm"):
        generate(no_llm, tok, [3], max_new_tokens=1)
    bad = SimpleNamespace(program=SimpleNamespace(metadata=lm.program.metadata, methods={"prefill": None}))
    with pytest.raises(InputError, match="no decode method"):
        generate(bad, tok, [3], max_new_tokens=1)
    meta = {"llm": dict(lm.program.metadata["llm"], prefill_chunk=5)}
    with pytest.raises(PayloadError, match="prefill_chunk"):
        LLMLayout.from_metadata(meta)
    assert generate(lm, tok, [3], max_new_tokens=0).ids == []


def test_generation_steps_protocol():
    # The loop is a generator any runner can drive (sync here, session.run_async in the browser).
    tok = toy_bpe()
    lm = FakeCausalLM(vocab=len(tok.tokens))
    steps = generation_steps(LLMLayout.from_metadata(lm.program.metadata), tok, [4, 4], 3, stop_ids=())
    method, inputs = next(steps)
    methods = []
    try:
        while True:
            methods.append(method)
            method, inputs = steps.send(lm.run(method, inputs))
    except StopIteration as stop:
        result = stop.value
    assert methods == ["prefill", "decode", "decode"] and result.ids == expected_greedy([4, 4], 3, lm.V)


def test_greedy_pick_reads_the_holder_as_torch_argmax_does():
    """Greedy decoding picks from the logits as the session returned them (a HostTensor here, a
    numpy array or a page tensor elsewhere) without a list per step; the rule is torch.argmax's:
    the first of equal maxima, and the first NaN when there is one."""
    from gpudelegate.llm import greedy_token

    def host(vals):
        return HostTensor("float32", (1, len(vals)), struct.pack(f"<{len(vals)}f", *vals))

    inf, nan = float("inf"), float("nan")
    cases = [([0.5, 2.0, 2.0, -1.0], 1), ([-inf, -inf, -inf], 0), ([1.0, nan, 3.0, nan], 1),
             ([-3.0, inf, inf], 1), ([7.0], 0)]
    for vals, want in cases:
        assert greedy_token(host(vals)) == want, vals
        assert Sampler(0.0)(host(vals)) == want, vals
        assert Sampler(0.0)(list(vals)) == want, vals
    rng = random.Random(5)
    vals = [rng.uniform(-20, 20) for _ in range(4099)]  # a prime-sized vocabulary
    assert greedy_token(host(vals)) == max(range(len(vals)), key=vals.__getitem__)

    class WithArgmax:  # what numpy arrays and the page's tensors offer
        def argmax(self):
            return 3
    assert greedy_token(WithArgmax()) == 3


class _SlowLogits:
    """A logits holder whose argmax waits (as a device's does: the GPU finishing the step)."""

    def __init__(self, tensor: HostTensor, wait: float):
        self.tensor, self.wait = tensor, wait

    def argmax(self):
        import time

        time.sleep(self.wait)
        vals = to_float_list(self.tensor)
        return max(range(len(vals)), key=lambda i: (vals[i], -i))


def test_generation_timers_include_the_pick_where_the_gpu_is_waited_for():
    # A run call returns once its work is submitted; the pick waits for it. The prefill time (time
    # to first token) and every decode step's time must contain that wait, or a page reports the
    # submission rate as tokens per second.
    tok = toy_bpe()
    lm = FakeCausalLM(vocab=len(tok.tokens))
    wait = 0.02

    class SlowLM:
        program = lm.program

        def run(self, method, inputs, keep_on_device=False):
            outs = lm.run(method, inputs, keep_on_device)
            return [_SlowLogits(outs[0], wait)] + outs[1:]

    prompt = [5, 9, 11]
    r = generate(SlowLM(), tok, prompt, max_new_tokens=4, stop_ids=())
    assert r.ids == expected_greedy(prompt, 4, lm.V)
    assert r.prefill_seconds >= wait and r.decode_steps == 3
    assert all(s >= wait for s in r.step_seconds) and r.tokens_per_second <= 1 / wait


# ----------------------------------------------------------------------------- greedy pick on the device

class _QueueDevice:
    """An executor whose work runs in submission order, as a GPU queue does: argmax_device writes
    the pick into ONE shared index cell (as WebGPU's index buffer) and snapshots it for the read
    (the staging copy of the same submission); a decode step's ids are the cell's value when the
    step runs. ``log`` records what the loop asked, in order."""

    greedy_lookahead = 1

    def __init__(self, lm):
        self.lm, self.cell, self.log = lm, None, []

    def argmax_device(self, logits):
        vals = to_float_list(logits)
        self.cell = max(range(len(vals)), key=lambda i: (vals[i], -i))
        self.log.append(("argmax",))
        return SimpleNamespace(snapshot=self.cell, read=False)

    def index_value(self, idx):
        assert not idx.read, "an index read twice"
        idx.read = True
        self.log.append(("read", idx.snapshot))
        return idx.snapshot

    def bind_ids(self, x):
        """A decode step's ids input: the device cell (the newest argmax), never a stale one."""
        if isinstance(x, SimpleNamespace):
            assert x.snapshot == self.cell, "a step took an index the device had already overwritten"
            return HostTensor("int32", (1, 1), struct.pack("<i", self.cell))
        return x


class OnDeviceLM:
    """FakeCausalLM behind a session whose executor picks on the device (_QueueDevice)."""

    def __init__(self, lm):
        self.lm, self.program = lm, lm.program
        self.executor = _QueueDevice(lm)

    def run(self, method, inputs, keep_on_device=False):
        inputs = dict(inputs, ids=self.executor.bind_ids(inputs["ids"]))
        self.executor.log.append((method, struct.unpack("<i", inputs["pos"].data)[0]))
        return self.lm.run(method, inputs, keep_on_device)


@pytest.mark.parametrize("lookahead", [0, 1, 2, 3])
def test_greedy_on_device_gives_the_host_loops_tokens(lookahead):
    """Whatever the lookahead, the tokens, stop reason and step count equal the host-picked loop's:
    EOS in the middle, max_new_tokens 1 and 2, and the context's end (the last token needs no
    cache row); steps past an EOS may be submitted, never past the length or context limits."""
    tok = toy_bpe()
    V = len(tok.tokens)
    prompt = [5, 9, 11]
    free = expected_greedy(prompt, 12, V)
    cases = [dict(prompt=prompt, max_new_tokens=12, stop_ids=[free[4]]),  # EOS in the middle
             dict(prompt=prompt, max_new_tokens=12, stop_ids=[free[0]]),  # EOS first (from the prefill)
             dict(prompt=prompt, max_new_tokens=1, stop_ids=()),
             dict(prompt=prompt, max_new_tokens=2, stop_ids=()),
             dict(prompt=[3] * 20, max_new_tokens=50, stop_ids=()),  # the context ends (24)
             dict(prompt=[3] * 23, max_new_tokens=5, stop_ids=())]  # one token, from the prefill
    for case in cases:
        want = generate(FakeCausalLM(vocab=V), tok, **case)
        lm = OnDeviceLM(FakeCausalLM(vocab=V))
        seen = []
        got = generate(lm, tok, **case, lookahead=lookahead, on_token=lambda i, p: seen.append(i))
        assert (got.ids, got.stop_reason, got.decode_steps, got.text) == \
            (want.ids, want.stop_reason, want.decode_steps, want.text), (case, lookahead)
        assert seen == got.ids and len(got.step_seconds) == got.decode_steps
        decodes = [e[1] for e in lm.executor.log if e[0] == "decode"]
        n = len(case["prompt"])
        assert decodes == list(range(n, n + len(decodes)))  # every step at its own position, in order
        assert len(decodes) <= min(len(got.ids) - 1 + lookahead, case["max_new_tokens"] - 1, 24 - n)
        reads = [e for e in lm.executor.log if e[0] == "read"]
        assert len(reads) == len(decodes) + 1  # every index is read, the dropped ones too
        assert [e[1] for e in reads[:len(got.ids)]] == got.ids


def test_greedy_lookahead_submits_the_next_step_before_reading_a_token():
    tok = toy_bpe()
    lm = OnDeviceLM(FakeCausalLM(vocab=len(tok.tokens)))
    generate(lm, tok, [5, 9, 11], max_new_tokens=4, stop_ids=(), lookahead=1)
    kinds = [e[0] for e in lm.executor.log]
    # prefill, its pick, then each decode step is submitted before the token it follows is read
    assert kinds == ["prefill", "argmax", "decode", "argmax", "read", "decode", "argmax", "read",
                     "decode", "argmax", "read", "read"]
    lm = OnDeviceLM(FakeCausalLM(vocab=len(tok.tokens)))
    generate(lm, tok, [5, 9, 11], max_new_tokens=3, stop_ids=(), lookahead=0)
    assert [e[0] for e in lm.executor.log] == ["prefill", "argmax", "read", "decode", "argmax", "read",
                                               "decode", "argmax", "read"]


def test_decode_time_counts_the_steps_run_ahead():
    """Steps submitted ahead may run before the first token is read (on a synchronous executor
    they run inside the submission): the decode time is the span from the first decode step's
    submission to the last pick, so tokens per second never counts those steps as free."""
    import time

    tok = toy_bpe()
    wait = 0.02

    class SlowDecode(OnDeviceLM):
        def run(self, method, inputs, keep_on_device=False):
            if method == "decode":
                time.sleep(wait)  # the step's work, done at submission
            return super().run(method, inputs, keep_on_device)

    for lookahead in (0, 2):
        r = generate(SlowDecode(FakeCausalLM(vocab=len(tok.tokens))), tok, [5, 9, 11], max_new_tokens=5,
                     stop_ids=(), lookahead=lookahead)
        assert r.decode_steps == 4 and r.decode_seconds >= 4 * wait, (lookahead, r.decode_seconds)
        assert r.tokens_per_second <= 1 / wait


def test_greedy_lookahead_choice():
    tok = toy_bpe()
    lm = OnDeviceLM(FakeCausalLM(vocab=len(tok.tokens)))
    generate(lm, tok, [5], max_new_tokens=2, stop_ids=())  # "auto": the executor's greedy_lookahead
    assert [e[0] for e in lm.executor.log][:3] == ["prefill", "argmax", "decode"]
    lm = OnDeviceLM(FakeCausalLM(vocab=len(tok.tokens)))
    generate(lm, tok, [5], max_new_tokens=2, stop_ids=(), lookahead=None)  # None: the host picks
    assert [e[0] for e in lm.executor.log] == ["prefill", "decode"]
    lm = OnDeviceLM(FakeCausalLM(vocab=len(tok.tokens)))
    generate(lm, tok, [5], max_new_tokens=2, stop_ids=(), temperature=0.7, seed=1)  # sampling: on the host
    assert "argmax" not in [e[0] for e in lm.executor.log]
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(InputError, match="lookahead"):
            generate(lm, tok, [5], max_new_tokens=2, lookahead=bad)


def test_ids_tokenizer_streams_ids_and_refuses_text():
    from gpudelegate.text.ids import IdsTokenizer

    tok = IdsTokenizer(eos_ids=[7])
    lm = FakeCausalLM(vocab=50)
    r = generate(lm, tok, [5, 9, 11], max_new_tokens=6)
    assert r.text == tok.decode(r.ids) == "".join(f"<{i}>" for i in r.ids)
    assert (r.stop_reason == "eos") == (7 in r.ids)
    with pytest.raises(InputError, match="list of token ids"):
        generate(lm, tok, "hello", max_new_tokens=2)
