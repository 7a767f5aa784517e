"""Character classes and special-token splitting shared by the tokenizers.

They live apart from the package ``__init__`` (which re-exports them) because the tokenizer
modules need them and the ``__init__`` imports the tokenizer modules: one direction only.
"""

from __future__ import annotations

import unicodedata

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
