"""Packed (GGUF block) weights from export to the reference executor: weights_dtype q4_0/q4_1/q8_0
(quantized at export), packed_weights (blocks made elsewhere, checked bit for bit), SmolLM2 with
its GGUF's own blocks (size, bit-exact blocks, greedy decoding against torch), MiniLM quantized
(against torch with the same dequantized weights and against the float model), and damaged
packed constants in a program file."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf", reason="packed weights are made and decoded by the gguf package")

import gpudelegate  # noqa: E402
from gpudelegate.errors import ExportError, PayloadError  # noqa: E402
from gpudelegate.export import GpuDelegatePartitioner, export_program  # noqa: E402
from gpudelegate.llm import generate  # noqa: E402
from gpudelegate.native import quant  # noqa: E402
from gpudelegate.native.reference import ReferenceContext  # noqa: E402
from gpudelegate.plan import plan_session  # noqa: E402
from gpudelegate.program import constant_key, loads  # noqa: E402
from gpudelegate.text import tokenizer_from_metadata  # noqa: E402

from progbuild import file_bytes, split_file  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PACKED = ("q4_0", "q4_1", "q8_0")


def bits(a) -> np.ndarray:
    """float32 values as their bit patterns: equality of these is bit-exactness (-0.0 != 0.0)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def packed_constants(prog):
    return {i: c for i, c in enumerate(prog.constants) if c.dtype in PACKED}


def readers_of(prog, constant: int):
    """(payload, op, arg position) of every node that reads ``constant`` through its prepacked copy."""
    out = []
    for p, pl in enumerate(prog.payloads):
        dsts = {e.dst for e in pl.prepack if pl.values[e.src].constant == constant}
        out += [(p, n.op, j) for n in pl.nodes for j, a in enumerate(n.args) if a in dsts]
    return out


# ------------------------------------------------------------------ a small model: the rules

class Toy(torch.nn.Module):
    """Tied table (embedding and output linear), a buffer read by embedding like SmolLM2's rope
    tables, a stack of same-shape linears (they share an offload slot), a small head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(200, 64)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(4)])
        self.head = torch.nn.Linear(64, 32)  # 2048 values: under QUANT_MIN_NUMEL, stays float32
        self.register_buffer("table", torch.randn(50, 64))

    def forward(self, ids):
        h = self.emb(ids) + torch.nn.functional.embedding(ids, self.table)
        for lin in self.layers:
            h = torch.tanh(lin(h))
        return torch.nn.functional.linear(h, self.emb.weight), self.head(h)


IDS = torch.tensor([[1, 5, 7, 49, 0, 33]], dtype=torch.int32)


@pytest.fixture(scope="module")
def toy():
    return Toy().eval()


def _run(prog, inputs, **session_kw):
    with gpudelegate.Environment() as env:
        s = env.session(prog, device="reference", **session_kw)
        return [np.asarray(o) for o in s.run("forward", inputs)]


def _dequantized_copy(model, dtype, prog):
    """``model`` with every parameter the program stores packed replaced by its dequantization,
    found by the constant key of its quantized bytes; returns (copy, names replaced)."""
    import copy

    keys = {c.key for c in prog.constants if c.dtype == dtype}
    m = copy.deepcopy(model)
    replaced = []
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim == 2 and p.shape[-1] % 32 == 0:
                blocks = quant.quantize(dtype, p.numpy())
                if constant_key(dtype, p.shape, blocks) in keys:
                    p.copy_(torch.from_numpy(quant.dequantize(dtype, blocks, tuple(p.shape))))
                    replaced.append(name)
    return m, replaced


@pytest.mark.parametrize("dtype", PACKED)
def test_weights_dtype_quantizes_parameters_read_by_linear_and_embedding(toy, dtype):
    prog = export_program(toy, (IDS,), weights_dtype=dtype, progress=False)
    assert prog.metadata["weights_dtype"] == dtype
    packed = packed_constants(prog)
    # the tied table once (read by embedding and by the output linear), the 4 layer weights; not
    # the buffer (an embedding table too, but not a parameter), the small head, biases
    assert sorted(tuple(c.shape) for c in packed.values()) == [(64, 64)] * 4 + [(200, 64)]
    (table,) = [i for i, c in packed.items() if tuple(c.shape) == (200, 64)]
    assert sorted((op, j) for _, op, j in readers_of(prog, table)) == [("embedding", 0), ("linear", 1)]
    floats = sorted(tuple(c.shape) for c in prog.constants if c.dtype == "float32")
    assert (50, 64) in floats and (32, 64) in floats and all(c.dtype in PACKED + ("float32",) for c in prog.constants)
    for pl in prog.payloads:  # packed blocks are copied as they are at load
        assert all(e.layout == "identity" for e in pl.prepack)

    ref, replaced = _dequantized_copy(toy, dtype, prog)
    assert sorted(replaced) == ["emb.weight"] + [f"layers.{i}.weight" for i in range(4)]
    ours = _run(prog, [IDS.numpy()])
    with torch.no_grad():
        want = [t.numpy() for t in ref(IDS)]
    for o, w in zip(ours, want):  # same weights, float32 both: only summation order differs
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5)


def test_offloaded_packed_weights_are_decoded_fresh_from_their_slot(toy):
    """Streamed weights pass through shared slots, so a slot's bytes change between dispatches:
    the reference must decode them at each read (its cache of decoded weights holds resident
    buffers only), and a run under the floor budget gives exactly the resident run's numbers."""
    prog = export_program(toy, (IDS,), weights_dtype="q8_0", progress=False)
    resident = _run(prog, [IDS.numpy()])
    limits = ReferenceContext().limits
    floor = plan_session(prog, limits, weight_budget=1 << 40, prefetch_depth=0).offload.floor
    with gpudelegate.Environment() as env:
        s = env.session(prog, device="reference", weight_budget=floor, prefetch_depth=0)
        ex = s.executor
        assert ex.plan.offload.streamed and ex.slots
        slot_reads = [step.args[j] for steps in ex.steps.values() for step in steps for j, _, _ in step.slot_reads]
        packed_reads = [a for a in slot_reads if isinstance(a, quant.PackedWeight)]
        assert len(packed_reads) >= 2 and all(a.cache is None for a in packed_reads)
        for _ in range(2):  # the second run finds the slots holding the last weights of the first
            streamed = [np.asarray(o) for o in s.run("forward", [IDS.numpy()])]
            for a, b in zip(streamed, resident):
                np.testing.assert_array_equal(bits(a), bits(b))


def test_prepack_empties_the_decoded_weight_cache(toy):
    prog = export_program(toy, (IDS,), weights_dtype="q4_1", progress=False)
    with gpudelegate.Environment() as env:
        s = env.session(prog, device="reference")
        first = [np.asarray(o) for o in s.run("forward", [IDS.numpy()])]
        ex = s.executor
        assert len(ex.dequantized) == 5  # the tied table once, four layers
        assert all(not a.flags.writeable for a in ex.dequantized.values())  # shared by kernels: read-only
        ex.prepack(ex.plan)  # rewrites the resident buffers: nothing decoded before may be served
        assert not ex.dequantized
        again = [np.asarray(o) for o in s.run("forward", [IDS.numpy()])]
        for a, b in zip(first, again):
            np.testing.assert_array_equal(bits(a), bits(b))


def test_packed_weights_are_checked_bit_for_bit(toy):
    w = toy.layers[0].weight.detach().numpy()
    blocks = quant.quantize("q4_0", w)
    deq = quant.dequantize("q4_0", blocks, w.shape)
    model = Toy().eval()
    with torch.no_grad():
        model.layers[0].weight.copy_(torch.from_numpy(deq))  # the model holds what the blocks decode to
    key = quant.weight_key(deq)
    prog = export_program(model, (IDS,), packed_weights={key: ("q4_0", blocks)}, progress=False)
    (i,) = packed_constants(prog)
    assert prog.constants[i].dtype == "q4_0" and bytes(prog.constant_bytes(i)) == blocks.tobytes()

    bad = blocks.copy()
    bad[3, 5] ^= 0x10  # one nibble of one block: another weight value
    with pytest.raises(ExportError, match=r"weight 'layers\.0\.weight' float32\[64, 64\]: 1 of 4096 values differ"):
        export_program(model, (IDS,), packed_weights={key: ("q4_0", bad)}, progress=False)
    with pytest.raises(ExportError, match=r"layers\.0\.weight.*: 1152 bytes of blocks for q4_0\[64, 64\], which needs "
                                          r"2304 \(128 blocks of 18 bytes\)"):
        export_program(model, (IDS,), packed_weights={key: ("q4_0", blocks[:, :-18])}, progress=False)
    with pytest.raises(ExportError, match="1 of 1 entries match no float32 weight"):
        export_program(toy, (IDS,), packed_weights={key: ("q4_0", blocks)}, progress=False)  # toy holds w, not deq
    with pytest.raises(ExportError, match="expected \\(dtype, blocks\\) with dtype one of"):
        export_program(model, (IDS,), packed_weights={key: ("q5_0", blocks)}, progress=False)
    with pytest.raises(ExportError, match="GpuDelegatePartitioner\\(packed_weights=...\\)"):
        export_program(model, (IDS,), packed_weights={key: ("q4_0", blocks)},
                       partitioner=GpuDelegatePartitioner(), progress=False)
    with pytest.raises(ExportError, match="weights_dtype='gguf' keeps a GGUF file's own block types"):
        export_program(model, (IDS,), weights_dtype="gguf", progress=False)


def test_lowered_graphs_know_their_parameters(toy):
    """lower() marks which constants are model parameters (from torch.export's graph signature), so
    to_backend quantizes a graph lowered by hand; a graph built without that knowledge gets an
    error saying what is missing instead of a float32 export under weights_dtype q8_0."""
    from gpudelegate.export import export_method, lower, to_backend
    from gpudelegate.export.lowering import mark_parameters

    ep = export_method(toy, (IDS,))
    part = GpuDelegatePartitioner(weights_dtype="q8_0")
    prog = to_backend({"forward": lower(ep)}, {"forward": part}).program
    assert len(packed_constants(prog)) == 5
    unmarked = lower(ep)
    for v in unmarked.values:
        v.parameter = False
    with pytest.raises(ExportError, match=r"5 weights \('emb\.weight', .*none is marked a model parameter.*"
                                          r"mark_parameters\(graph, exported_program\)"):
        to_backend({"forward": unmarked}, {"forward": part})
    prog = to_backend({"forward": mark_parameters(unmarked, ep)}, {"forward": part}).program
    assert len(packed_constants(prog)) == 5


# ------------------------------------------------------------------ damaged files

def test_damaged_packed_constants_are_payload_errors_naming_them(toy, tmp_path):
    prog = export_program(toy, (IDS,), weights_dtype="q4_0", progress=False)
    raw = prog.to_bytes()
    doc, data = split_file(raw)
    i = next(i for i, c in packed_constants(prog).items() if tuple(c.shape) == (64, 64))
    c = doc["constants"][i]
    assert (c["dtype"], c["shape"], c["nbytes"]) == ("q4_0", [64, 64], 64 * 2 * 18)

    flipped = bytearray(data)
    flipped[c["offset"] + 100] ^= 0x01  # a nibble in the file: the constant's hash no longer matches
    with pytest.raises(PayloadError, match=rf"constants\[{i}\]: bytes at data\[{c['offset']}:"):
        loads(file_bytes(doc, bytes(flipped)))

    def with_constant(**change):
        d = {**doc, "constants": [dict(x) for x in doc["constants"]]}
        d["constants"][i].update(change)
        return file_bytes(d, data)

    with pytest.raises(PayloadError, match=rf"constants\[{i}\]\.shape: q4_0 last dim 48 is not a multiple of its "
                                           r"32-value block"):
        loads(with_constant(shape=[64, 48]))
    with pytest.raises(PayloadError, match=rf"constants\[{i}\]\.nbytes: 2304 but q4_0\[64, 96\] is 3456 bytes"):
        loads(with_constant(shape=[64, 96]))  # a block more per row than the bytes hold
    with pytest.raises(PayloadError, match=rf"constants\[{i}\]\.nbytes: 2286 but q4_0\[64, 64\] is 2304 bytes"):
        loads(with_constant(nbytes=2304 - 18))  # a block short
    assert loads(raw).constants[i].dtype == "q4_0"  # the untouched file loads


# ------------------------------------------------------------------ SmolLM2 with its GGUF's blocks

smollm2 = pytest.importorskip("gpudelegate.export.models.smollm2")

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


@pytest.fixture(scope="module")
def gguf_program(checkpoint, tmp_path_factory):
    """SmolLM2 exported once with the GGUF's own blocks: (path, the program as loaded)."""
    path = tmp_path_factory.mktemp("smollm2-gguf") / "smollm2-gguf.gdp"
    smollm2.export(path, weights_dtype="gguf", checkpoint=checkpoint, progress=False)
    yield path, gpudelegate.load(path)
    path.unlink()


@pytest.fixture(scope="module")
def session(gguf_program):
    env = gpudelegate.Environment()
    s = env.session(gguf_program[0], device="reference")
    yield s
    s.close()
    env.close()


@pytest.mark.slow
def test_gguf_program_is_the_size_of_the_gguf(gguf_program, checkpoint):
    path, prog = gguf_program
    gguf_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(smollm2.gguf_path())).tensors)
    size = os.path.getsize(path)
    # the blocks themselves plus rope tables, index tables and the document (~1.3% measured)
    assert abs(size - gguf_bytes) <= 0.05 * gguf_bytes, (size, gguf_bytes)
    kinds = {}
    for c in prog.constants:
        kinds[c.dtype] = kinds.get(c.dtype, 0) + 1
    assert kinds["q4_1"] == 7 * checkpoint.config.layers and kinds["q8_0"] == 1
    assert prog.metadata["weights_dtype"] == "gguf"
    # the Q8_0 embedding is also the output layer: one constant, read by both ops in both methods
    (emb,) = [i for i, c in enumerate(prog.constants) if c.dtype == "q8_0"]
    assert {(op, j) for _, op, j in readers_of(prog, emb)} == {("embedding", 0), ("linear", 1)}
    assert {p for p, _, _ in readers_of(prog, emb)} == {0, 1}


@pytest.mark.slow
def test_packed_constants_are_the_gguf_blocks_bit_for_bit(gguf_program, checkpoint):
    """Each packed constant is a GGUF tensor's blocks (Q/K rows un-permuted as the float weights
    are), and native.quant decodes it to exactly what gguf decodes the file's tensor to."""
    _, prog = gguf_program
    cfg = checkpoint.config
    by_key = {c.key: i for i, c in enumerate(prog.constants)}
    seen = set()
    for t in gguf.GGUFReader(str(smollm2.gguf_path())).tensors:
        dtype = quant.DTYPE_OF_GGML.get(t.tensor_type.name)
        if dtype is None:
            continue  # F32 norms
        raw = np.asarray(t.data)
        want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        kind = t.name.split(".")[-2]
        if kind in ("attn_q", "attn_k"):
            heads = cfg.heads if kind == "attn_q" else cfg.kv_heads
            raw, want = smollm2.unpermute_rope(raw, heads), smollm2.unpermute_rope(want, heads)
        i = by_key[constant_key(dtype, want.shape, np.ascontiguousarray(raw))]
        got = quant.dequantize(dtype, prog.constant_bytes(i), prog.constants[i].shape)
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=t.name)
        seen.add(i)
    assert seen == set(packed_constants(prog)) and len(seen) == 7 * cfg.layers + 1


def _torch_greedy(model, ids, n):
    """Greedy decoding with the torch module (float32): the whole prompt in one step, then one
    token per step against its KV cache."""
    caches = model.empty_caches()
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    out = []
    with torch.no_grad():
        logits, caches = model.step(i32([ids]), i32([0]), caches, i32([len(ids) - 1]))
        for k in range(n):
            out.append(int(logits[0].argmax()))
            if k + 1 < n:
                logits, caches = model.step(i32([[out[-1]]]), i32([len(ids) + k]), caches)
    return out


@pytest.fixture(scope="module")
def torch_model(checkpoint):
    return smollm2.build_torch_model(checkpoint)  # the floats the blocks decode to, bit for bit


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS, ids=["chat-2-chunks", "raw-1-chunk", "chat-3-chunks"])
def test_greedy_decoding_matches_torch(session, torch_model, prompt):
    tok = tokenizer_from_metadata(session.program.metadata["tokenizer"])
    result = generate(session, tok, prompt, max_new_tokens=NEW_TOKENS, stop_ids=())
    ref = _torch_greedy(torch_model, result.prompt_ids, NEW_TOKENS)
    # Both compute in float32 from identical weights (the reference decodes the blocks with gguf,
    # torch holds gguf's dequantization); only the summation order differs (~1e-6 relative on the
    # logits), which changes a greedy pick only where the top two logits are that close. Measured:
    # all 32 tokens identical for each of the three prompts, so all 32 are asserted.
    assert result.ids == ref, (tok.decode(result.ids), tok.decode(ref))
    assert result.decode_steps == NEW_TOKENS - 1


# ------------------------------------------------------------------ MiniLM quantized at export

minilm = pytest.importorskip("gpudelegate.export.models.minilm")

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
             "Zürich ist eine Stadt in der Schweiz.", "GPUs multiply matrices very quickly."]
MINILM_SEQ = 32


@pytest.fixture(scope="module")
def minilm_float():
    return minilm.build_torch_model()


def _cos(a, b):
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


# (dtype, min cosine against the float model): q8_0 keeps ~2 decimal digits more than 4 bits.
# Measured on these sentences: q8_0 0.99985, q4_0 0.964 (round-to-nearest 4-bit blocks of every
# linear and the word embeddings; MiniLM has no outlier handling to absorb it).
MINILM_FLOAT_BOUND = {"q8_0": 0.999, "q4_0": 0.95}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", sorted(MINILM_FLOAT_BOUND))
def test_minilm_quantized(dtype, minilm_float, tmp_path):
    path = tmp_path / f"minilm-{dtype}.gdp"
    prog = minilm.export(path, batch=len(SENTENCES), seq_len=MINILM_SEQ, weights_dtype=dtype, progress=False)
    ref, replaced = _dequantized_copy(minilm_float, dtype, prog)
    # every linear weight (6 layers x 6) and the word embeddings; the position and token-type
    # tables are read through slices folded at export, not by embedding
    assert len(replaced) == len(packed_constants(prog)) == 37 and "embeddings.word_embeddings.weight" in replaced
    float_bytes = sum(p.numel() * 4 for p in minilm_float.parameters())
    assert os.path.getsize(path) < (0.3 if dtype == "q8_0" else 0.16) * float_bytes

    tok = tokenizer_from_metadata(prog.metadata["tokenizer"])
    ids, mask = (np.array(a, np.int32) for a in tok.encode_batch(SENTENCES, MINILM_SEQ))
    ours = _run(path, [ids, mask])[0]
    with torch.no_grad():
        same_weights = ref(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
        floats = minilm_float(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    assert _cos(ours, same_weights).min() >= 0.9999  # float32 both, the same dequantized weights
    assert _cos(ours, floats).min() >= MINILM_FLOAT_BOUND[dtype]
