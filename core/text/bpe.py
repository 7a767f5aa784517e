"""Byte-level BPE tokenizer (GPT-2 family, SmolLM2's), pure Python.

The pipeline is the one SmolLM2's tokenizer.json (and llama.cpp's ``smollm`` pre-tokenizer type)
describes: special tokens split off the raw text -> every digit isolated (``Digits(individual_digits)``)
-> the GPT-2 pre-tokenizer regex
``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`` -> UTF-8 bytes
mapped to GPT-2's printable byte alphabet -> merges applied lowest rank first.

Python's ``re`` has no ``\\p{L}``/``\\p{N}``, so the regex is written out as a scanner over
Unicode general categories (see :func:`gpudelegate.text.char_class`); it follows the regex's
alternation order and backtracking exactly (the whitespace rules are the subtle part).
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import InputError, PayloadError
from .chars import char_class, split_special

_CONTRACTIONS = ("s", "t", "re", "ve", "m", "ll", "d")


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable character map (printable Latin-1 bytes map to
    themselves, the rest to U+0100 onwards), so every byte string is a string of vocab symbols."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def split_gpt2(text: str) -> List[str]:
    """The GPT-2 pre-tokenizer regex (see the module docstring), as a scanner."""
    out: List[str] = []
    n = len(text)
    i = 0
    classes = [char_class(c) for c in text]
    while i < n:
        c = text[i]
        # 1. contractions, case-sensitive, only at the current position
        if c == "'" and i + 1 < n:
            suf = next((s for s in _CONTRACTIONS if text.startswith(s, i + 1)), None)
            if suf is not None:
                out.append(text[i:i + 1 + len(suf)])
                i += 1 + len(suf)
                continue
        # 2-4. an optional single U+0020 then a run of letters / numbers / other symbols
        j = i + 1 if (c == " " and i + 1 < n and classes[i + 1] != "S") else i
        k = classes[j]
        if k != "S":
            e = j + 1
            while e < n and classes[e] == k:
                e += 1
            out.append(text[i:e])
            i = e
            continue
        # 5. \s+(?!\S): a whitespace run, minus its last character when a non-space follows
        e = i + 1
        while e < n and classes[e] == "S":
            e += 1
        if e == n:
            out.append(text[i:e])
            i = e
        elif e - i >= 2:
            out.append(text[i:e - 1])
            i = e - 1
        else:  # 6. \s+ : one whitespace character (not U+0020) before a non-space
            out.append(c)
            i += 1
    return out


def split_digits(text: str) -> List[str]:
    """``Digits(individual_digits=True)``: every \\p{N} character becomes its own piece."""
    out: List[str] = []
    start = 0
    for i, c in enumerate(text):
        if char_class(c) == "N":
            if start < i:
                out.append(text[start:i])
            out.append(c)
            start = i + 1
    if start < len(text):
        out.append(text[start:])
    return out


@dataclass
class BPETokenizer:
    tokens: List[str]  # id -> token (byte-level symbols; special tokens literally)
    merges: List[str]  # "left right", in rank order
    special_tokens: Tuple[str, ...] = ()
    isolate_digits: bool = True
    bos_id: Optional[int] = None
    eos_ids: Tuple[int, ...] = ()
    pad_id: Optional[int] = None
    chat: Optional[dict] = None  # a ChatTemplate's to_metadata(), see gpudelegate.text.chat
    _ids: Dict[str, int] = field(default_factory=dict, repr=False)
    _ranks: Dict[Tuple[str, str], int] = field(default_factory=dict, repr=False)
    _cache: Dict[str, List[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self._ids = {t: i for i, t in enumerate(self.tokens)}
        for r, m in enumerate(self.merges):
            a, sep, b = m.partition(" ")
            if not sep or not a or not b:
                raise PayloadError(f"tokenizer.merges[{r}]", f"{m!r} is not 'left right'")
            self._ranks.setdefault((a, b), r)
        self.special_tokens = tuple(self.special_tokens)
        for s in self.special_tokens:
            if s not in self._ids:
                raise PayloadError("tokenizer.special_tokens", f"{s!r} is not in the vocabulary")
        self.eos_ids = tuple(self.eos_ids)
        self._special_ids = frozenset(self._ids[s] for s in self.special_tokens)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_gguf_fields(cls, fields: dict) -> "BPETokenizer":
        """From a GGUF's ``tokenizer.ggml.*`` metadata (``fields``: key -> python value).
        Tokens of type CONTROL (3) are the special tokens."""
        model = fields.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise PayloadError("gguf.tokenizer.ggml.model", f"{model!r} (expected gpt2: byte-level BPE)")
        pre = fields.get("tokenizer.ggml.pre", "default")
        if pre not in ("smollm", "gpt2", "default"):
            raise PayloadError("gguf.tokenizer.ggml.pre", f"pre-tokenizer {pre!r} is not supported (smollm, gpt2)")
        tokens = list(fields["tokenizer.ggml.tokens"])
        types = list(fields.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        specials = tuple(t for t, ty in zip(tokens, types) if ty == 3)
        eos = fields.get("tokenizer.ggml.eos_token_id")
        bos = fields.get("tokenizer.ggml.bos_token_id")
        # Generation stops at the GGUF's EOS (<|im_end|> for the Instruct model) and also at
        # <|endoftext|>, which the base model's documents end with.
        stops = {eos} if eos is not None else set()
        if "<|endoftext|>" in tokens:
            stops.add(tokens.index("<|endoftext|>"))
        eos_ids = tuple(sorted(stops))
        chat = None
        if "tokenizer.chat_template" in fields:
            from .chat import ChatTemplate
            chat = ChatTemplate.from_jinja(fields["tokenizer.chat_template"]).to_metadata()
        return cls(tokens=tokens, merges=list(fields["tokenizer.ggml.merges"]), special_tokens=specials,
                   isolate_digits=(pre == "smollm"),
                   bos_id=bos if fields.get("tokenizer.ggml.add_bos_token", False) else None,
                   eos_ids=eos_ids, pad_id=fields.get("tokenizer.ggml.padding_token_id"), chat=chat)

    _OPTIONS = ("isolate_digits", "bos_id", "pad_id", "chat")

    def to_metadata(self) -> dict:
        d = {"type": "bpe", "tokens": list(self.tokens), "merges": list(self.merges),
             "special_tokens": list(self.special_tokens), "eos_ids": list(self.eos_ids)}
        d.update({k: getattr(self, k) for k in self._OPTIONS})
        return d

    @classmethod
    def from_metadata(cls, meta: dict) -> "BPETokenizer":
        for key in ("tokens", "merges"):
            if not isinstance(meta.get(key), list) or not all(isinstance(t, str) for t in meta[key]):
                raise PayloadError(f"metadata.tokenizer.{key}", "expected a list of strings")
        opts = {k: meta[k] for k in cls._OPTIONS if k in meta}
        return cls(tokens=meta["tokens"], merges=meta["merges"], special_tokens=tuple(meta.get("special_tokens", ())),
                   eos_ids=tuple(meta.get("eos_ids", ())), **opts)

    # ------------------------------------------------------------------ encode
    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def token_id(self, token: str) -> int:
        return self._ids[token]

    def pre_tokenize(self, text: str) -> List[str]:
        pieces = split_digits(text) if self.isolate_digits else [text]
        return [w for p in pieces for w in split_gpt2(p)]

    def _bpe(self, word: str) -> List[int]:
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        # A byte symbol missing from the vocabulary (SmolLM2 lacks 21 bytes that never occur in
        # its training text, e.g. 0x04 or 0xC0) has no id: it is dropped before merging, so its
        # neighbours may merge, as `tokenizers` does for a BPE model without an unk token.
        parts = [c for c in (_BYTE_TO_CHAR[b] for b in word.encode("utf-8")) if c in self._ids]
        ranks = self._ranks
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                r = ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best < 0:
                break
            a, b = parts[best], parts[best + 1]
            merged, i, n = [], 0, len(parts)
            while i < n:  # merge every occurrence of the best pair, left to right
                if i < n - 1 and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        ids = [self._ids[p] for p in parts]
        if len(self._cache) < 100_000:
            self._cache[word] = ids
        return ids

    def encode(self, text: str, allow_special: bool = True, add_bos: Optional[bool] = None) -> List[int]:
        """Token ids of ``text``. Special-token strings in the text become their ids when
        ``allow_special`` (as Hugging Face tokenizers do); otherwise they are encoded as text."""
        if not isinstance(text, str):
            raise InputError(f"BPETokenizer.encode: expected str, got {type(text).__name__}")
        ids: List[int] = []
        if (self.bos_id is not None) if add_bos is None else add_bos:
            if self.bos_id is None:
                raise InputError("BPETokenizer.encode: add_bos=True but this tokenizer has no BOS token")
            ids.append(self.bos_id)
        for piece, special in split_special(text, self.special_tokens if allow_special else ()):
            if special:
                ids.append(self._ids[piece])
            else:
                for w in self.pre_tokenize(piece):
                    ids.extend(self._bpe(w))
        return ids

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, with the template stored beside the vocabulary."""
        if self.chat is None:
            raise InputError("BPETokenizer.apply_chat_template: this tokenizer has no chat template")
        from .chat import ChatTemplate
        return ChatTemplate.from_metadata(self.chat).render(messages, add_generation_prompt)

    # ------------------------------------------------------------------ decode
    def id_bytes(self, i: int, skip_special_tokens: bool = False) -> bytes:
        if not 0 <= i < len(self.tokens):
            raise InputError(f"BPETokenizer.decode: id {i} out of range (0..{len(self.tokens) - 1})")
        if i in self._special_ids:
            return b"" if skip_special_tokens else self.tokens[i].encode("utf-8")
        tok = self.tokens[i]
        try:
            return bytes(_CHAR_TO_BYTE[c] for c in tok)
        except KeyError:  # a non-special added token written literally
            return tok.encode("utf-8")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        data = b"".join(self.id_bytes(i, skip_special_tokens) for i in ids)
        return data.decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)

    def is_special(self, i: int) -> bool:
        return i in self._special_ids


class StreamDecoder:
    """Turns token ids into text as they are generated. A character split across tokens (e.g.
    an emoji's four UTF-8 bytes) is held back until it is complete."""

    def __init__(self, tokenizer: BPETokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._dec.decode(self.tokenizer.id_bytes(token_id, self.skip))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
