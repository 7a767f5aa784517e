"""BERT WordPiece tokenizer (uncased), pure Python.

Follows the `tokenizers` pipeline that all-MiniLM-L6-v2's tokenizer.json describes, step by step:
added (special) tokens split off the raw text -> BertNormalizer (clean text, pad CJK ideographs
with spaces, lowercase, strip accents) -> BertPreTokenizer (split on whitespace, isolate
punctuation) -> WordPiece (greedy longest match, ``##`` continuation, [UNK] for a word that does
not decompose or is longer than ``max_input_chars_per_word``) -> ``[CLS] ... [SEP]`` with
truncation to ``max_length``.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import InputError, PayloadError
from .chars import WHITESPACE, split_special

# CJK ideograph blocks that BERT pads with spaces (same table as tokenizers' BertNormalizer).
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
               (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _is_cjk(c: str) -> bool:
    o = ord(c)
    return any(lo <= o <= hi for lo, hi in _CJK_RANGES)


def _is_control(c: str) -> bool:
    # \t \n \r are control characters that BERT treats as whitespace instead.
    if c in "\t\n\r":
        return False
    return unicodedata.category(c) in ("Cc", "Cf", "Cn", "Co", "Cs")


def _is_punctuation(c: str) -> bool:
    # ASCII symbols such as $ + < = > ^ ` | ~ are not Unicode punctuation, but BERT splits them too.
    o = ord(c)
    if 33 <= o <= 47 or 58 <= o <= 64 or 91 <= o <= 96 or 123 <= o <= 126:
        return True
    return unicodedata.category(c).startswith("P")


@dataclass
class WordPieceTokenizer:
    vocab: List[str]  # id -> token
    unk_token: str = "[UNK]"
    cls_token: str = "[CLS]"
    sep_token: str = "[SEP]"
    pad_token: str = "[PAD]"
    special_tokens: Tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    lowercase: bool = True
    strip_accents: Optional[bool] = None  # None: follow `lowercase` (BERT's rule)
    handle_chinese_chars: bool = True
    clean_text: bool = True
    continuing_prefix: str = "##"
    max_input_chars_per_word: int = 100
    max_length: int = 128
    _ids: Dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self._ids = {t: i for i, t in enumerate(self.vocab)}
        for name in ("unk_token", "cls_token", "sep_token", "pad_token"):
            tok = getattr(self, name)
            if tok not in self._ids:
                raise PayloadError(f"tokenizer.{name}", f"{tok!r} is not in the {len(self.vocab)}-token vocabulary")
        self.special_tokens = tuple(t for t in self.special_tokens if t in self._ids)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_vocab_txt(cls, text: str, **options) -> "WordPieceTokenizer":
        """From a BERT vocab.txt (one token per line, id = line number)."""
        vocab = text.split("\n")
        if vocab and vocab[-1] == "":
            vocab.pop()
        return cls(vocab=vocab, **options)

    @classmethod
    def from_tokenizer_json(cls, doc) -> "WordPieceTokenizer":
        """From a Hugging Face tokenizer.json (a path, JSON text, or the decoded dict). Only the
        BertNormalizer/BertPreTokenizer/WordPiece combination is accepted."""
        if isinstance(doc, str):
            doc = json.loads(open(doc, encoding="utf-8").read() if not doc.lstrip().startswith("{") else doc)
        model = doc.get("model") or {}
        if model.get("type") != "WordPiece":
            raise PayloadError("tokenizer.json.model.type", f"{model.get('type')!r} (expected WordPiece)")
        norm = doc.get("normalizer") or {}
        if norm.get("type") != "BertNormalizer":
            raise PayloadError("tokenizer.json.normalizer.type", f"{norm.get('type')!r} (expected BertNormalizer)")
        vocab_map = model["vocab"]
        vocab = [""] * len(vocab_map)
        for tok, i in vocab_map.items():
            if not 0 <= i < len(vocab):
                raise PayloadError("tokenizer.json.model.vocab", f"id {i} of {tok!r} out of range (0..{len(vocab) - 1})")
            vocab[i] = tok
        trunc = doc.get("truncation") or {}
        return cls(vocab=vocab, unk_token=model.get("unk_token", "[UNK]"),
                   special_tokens=tuple(a["content"] for a in doc.get("added_tokens", []) if a.get("special")),
                   lowercase=bool(norm.get("lowercase", True)), strip_accents=norm.get("strip_accents"),
                   handle_chinese_chars=bool(norm.get("handle_chinese_chars", True)),
                   clean_text=bool(norm.get("clean_text", True)),
                   continuing_prefix=model.get("continuing_subword_prefix", "##"),
                   max_input_chars_per_word=int(model.get("max_input_chars_per_word", 100)),
                   max_length=int(trunc.get("max_length", 512)))

    _OPTIONS = ("unk_token", "cls_token", "sep_token", "pad_token", "lowercase", "strip_accents",
                "handle_chinese_chars", "clean_text", "continuing_prefix", "max_input_chars_per_word", "max_length")

    def to_metadata(self) -> dict:
        d = {"type": "wordpiece", "vocab": list(self.vocab), "special_tokens": list(self.special_tokens)}
        d.update({k: getattr(self, k) for k in self._OPTIONS})
        return d

    @classmethod
    def from_metadata(cls, meta: dict) -> "WordPieceTokenizer":
        if not isinstance(meta.get("vocab"), list) or not all(isinstance(t, str) for t in meta["vocab"]):
            raise PayloadError("metadata.tokenizer.vocab", "expected a list of strings")
        opts = {k: meta[k] for k in cls._OPTIONS if k in meta}
        return cls(vocab=meta["vocab"], special_tokens=tuple(meta.get("special_tokens", ())), **opts)

    # ------------------------------------------------------------------ pipeline
    def token_id(self, token: str) -> int:
        return self._ids[token]

    def normalize(self, text: str) -> str:
        if self.clean_text:
            text = "".join(" " if c in WHITESPACE else c for c in text
                           if not (c == "\x00" or c == "\ufffd" or _is_control(c)))
        if self.handle_chinese_chars:
            text = "".join(f" {c} " if _is_cjk(c) else c for c in text)
        strip = self.lowercase if self.strip_accents is None else self.strip_accents
        if strip:
            text = "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")
        if self.lowercase:
            # Per character, as tokenizers does: str.lower() would apply the final-sigma rule.
            text = "".join(c.lower() for c in text)
        return text

    @staticmethod
    def pre_tokenize(text: str) -> List[str]:
        words, cur = [], []
        for c in text:
            if c in WHITESPACE:
                if cur:
                    words.append("".join(cur))
                    cur = []
            elif _is_punctuation(c):
                if cur:
                    words.append("".join(cur))
                    cur = []
                words.append(c)
            else:
                cur.append(c)
        if cur:
            words.append("".join(cur))
        return words

    def wordpiece(self, word: str) -> List[int]:
        unk = [self._ids[self.unk_token]]
        if len(word) > self.max_input_chars_per_word:
            return unk
        ids, start, n = [], 0, len(word)
        while start < n:
            end = n
            found = None
            while start < end:
                piece = word[start:end]
                if start > 0:
                    piece = self.continuing_prefix + piece
                found = self._ids.get(piece)
                if found is not None:
                    break
                end -= 1
            if found is None:
                return unk
            ids.append(found)
            start = end
        return ids

    def encode(self, text: str, add_special_tokens: bool = True, max_length: Optional[int] = None) -> List[int]:
        """Token ids of ``text``; with special tokens ``[CLS] ... [SEP]``, truncated to
        ``max_length`` (default: the tokenizer's) including them."""
        if not isinstance(text, str):
            raise InputError(f"WordPieceTokenizer.encode: expected str, got {type(text).__name__}")
        ids: List[int] = []
        for piece, special in split_special(text, self.special_tokens):
            if special:
                ids.append(self._ids[piece])
                continue
            for word in self.pre_tokenize(self.normalize(piece)):
                ids.extend(self.wordpiece(word))
        limit = self.max_length if max_length is None else max_length
        if add_special_tokens:
            if limit is not None and limit < 2:
                raise InputError(f"WordPieceTokenizer.encode: max_length {limit} leaves no room for [CLS] and [SEP]")
            if limit is not None:
                ids = ids[:limit - 2]
            return [self._ids[self.cls_token]] + ids + [self._ids[self.sep_token]]
        return ids[:limit] if limit is not None else ids

    def encode_batch(self, texts: Sequence[str], seq_len: int) -> Tuple[List[List[int]], List[List[int]]]:
        """Ids and attention mask for a batch, each row truncated/padded to exactly ``seq_len``."""
        pad = self._ids[self.pad_token]
        ids, mask = [], []
        for t in texts:
            row = self.encode(t, max_length=seq_len)
            ids.append(row + [pad] * (seq_len - len(row)))
            mask.append([1] * len(row) + [0] * (seq_len - len(row)))
        return ids, mask

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Join word pieces back into text: the `tokenizers` WordPiece decoder with cleanup, which
        cleans each piece on its own (so " ." -> "." but "i ' m" stays as it is)."""
        special = set(self.special_tokens)
        out: List[str] = []
        for i in ids:
            if not 0 <= i < len(self.vocab):
                raise InputError(f"WordPieceTokenizer.decode: id {i} out of range (0..{len(self.vocab) - 1})")
            tok = self.vocab[i]
            if skip_special_tokens and tok in special:
                continue
            if out:
                p = self.continuing_prefix
                tok = tok[len(p):] if tok.startswith(p) else " " + tok
            for a, b in _CLEANUP:
                tok = tok.replace(a, b)
            out.append(tok)
        return "".join(out)


_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" do not", " don't"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
