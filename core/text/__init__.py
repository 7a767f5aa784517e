"""Pure-Python tokenizers (no numpy, no `tokenizers`): they run unchanged in Pyodide.

- :class:`~gpudelegate.text.wordpiece.WordPieceTokenizer`: BERT uncased (MiniLM);
- :class:`~gpudelegate.text.bpe.BPETokenizer`: GPT-2 style byte-level BPE (SmolLM2);
- :class:`~gpudelegate.text.chat.ChatTemplate`: the ChatML template of SmolLM2-Instruct.

Every tokenizer serializes to a plain dict (``to_metadata``) stored in a program's ``metadata``
under ``"tokenizer"``, so the browser needs nothing but the program file;
:func:`tokenizer_from_metadata` rebuilds it.
"""

from __future__ import annotations

import unicodedata

from ..errors import PayloadError

# Unicode White_Space (PropList.txt). Rust's char::is_whitespace and Oniguruma's \s both use this
# set; Python's str.isspace differs (it includes U+001C..U+001F), so it cannot be used here.
WHITESPACE = frozenset(
    [chr(c) for c in range(0x09, 0x0E)]
    + ["\u0020", "\u0085", "\u00a0", "\u1680"]
    + [chr(c) for c in range(0x2000, 0x200B)]
    + ["\u2028", "\u2029", "\u202f", "\u205f", "\u3000"])


def is_whitespace(c: str) -> bool:
    return c in WHITESPACE


def char_class(c: str) -> str:
    """'S' whitespace, 'L' letter (\\p{L}), 'N' number (\\p{N}), 'P' anything else. Python's `re`
    has no \\p{..} classes, so the GPT-2 pre-tokenizer is written over these classes instead."""
    if c in WHITESPACE:
        return "S"
    cat = unicodedata.category(c)[0]
    if cat == "L" or cat == "N":
        return cat
    return "P"


def split_special(text: str, specials) -> list:
    """Split ``text`` on occurrences of the special-token strings ``specials`` (matched on the raw
    text, leftmost and then longest first, as the `tokenizers` added-vocabulary does). Returns a
    list of ``(piece, is_special)``; empty pieces are dropped."""
    if not specials:
        return [(text, False)] if text else []
    ordered = sorted(set(specials), key=lambda s: (-len(s), s))
    out = []
    i = start = 0
    n = len(text)
    first_chars = {s[0] for s in ordered}
    while i < n:
        if text[i] in first_chars:
            hit = next((s for s in ordered if text.startswith(s, i)), None)
            if hit is not None:
                if start < i:
                    out.append((text[start:i], False))
                out.append((hit, True))
                i += len(hit)
                start = i
                continue
        i += 1
    if start < n:
        out.append((text[start:], False))
    return out


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
