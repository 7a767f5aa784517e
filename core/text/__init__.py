"""Pure-Python tokenizers (no numpy, no `tokenizers`): they run unchanged in Pyodide.

- :class:`~gpudelegate.text.wordpiece.WordPieceTokenizer`: BERT uncased (MiniLM);
- :class:`~gpudelegate.text.bpe.BPETokenizer`: GPT-2 style byte-level BPE (SmolLM2);
- :class:`~gpudelegate.text.chat.ChatTemplate`: the ChatML template of SmolLM2-Instruct;
- :class:`~gpudelegate.text.ids.IdsTokenizer`: no vocabulary, for callers that hold token ids.

Every tokenizer serializes to a plain dict (``to_metadata``) stored in a program's ``metadata``
under ``"tokenizer"``, so the browser needs nothing but the program file;
:func:`tokenizer_from_metadata` rebuilds it.
"""

from __future__ import annotations

from ..errors import PayloadError
from .chars import WHITESPACE, char_class, is_whitespace, split_special


def tokenizer_from_metadata(meta: dict):
    """Rebuild a tokenizer from the dict a tokenizer's ``to_metadata()`` wrote into a program."""
    if not isinstance(meta, dict) or "type" not in meta:
        raise PayloadError("metadata.tokenizer", "expected a dict with a 'type' (wordpiece or bpe)")
    kind = meta["type"]
    if kind == "wordpiece":
        from .wordpiece import WordPieceTokenizer
        return WordPieceTokenizer.from_metadata(meta)
    if kind == "bpe":
        from .bpe import BPETokenizer
        return BPETokenizer.from_metadata(meta)
    raise PayloadError("metadata.tokenizer.type", f"unknown tokenizer type {kind!r} (expected wordpiece or bpe)")


__all__ = ["WHITESPACE", "char_class", "is_whitespace", "split_special", "tokenizer_from_metadata"]
