"""A stand-in tokenizer for callers that hold token ids themselves (benchmarks, tests, programs
without a tokenizer in their metadata): :func:`gpudelegate.llm.generate` takes prompts as lists of
ids, streams each generated id as the text ``"<id>"`` and stops at ``eos_ids`` (none by default)."""

from __future__ import annotations

from typing import Sequence

from ..errors import InputError


class _IdsStream:
    def feed(self, tok: int) -> str:
        return f"<{tok}>"

    def flush(self) -> str:
        return ""


class IdsTokenizer:
    def __init__(self, eos_ids: Sequence[int] = ()):
        self.eos_ids = tuple(eos_ids)

    def encode(self, text: str):
        raise InputError("IdsTokenizer has no vocabulary: give the prompt as a list of token ids")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)

    def stream_decoder(self, skip_special_tokens: bool = True) -> _IdsStream:
        return _IdsStream()
