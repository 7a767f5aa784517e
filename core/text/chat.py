"""The ChatML chat template (SmolLM2-Instruct's), rendered in plain Python.

Pyodide has no jinja2, and a chat template is a tiny program: rather than interpret Jinja we
recognize the one family we ship (ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per
message, a default system message when the conversation has none, and
``<|im_start|>assistant\\n`` as the generation prompt) and extract its parameters from the GGUF's
template text. Tests render the same conversations with transformers' Jinja renderer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import InputError, PayloadError

_MESSAGE = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
_DEFAULT_SYSTEM = re.compile(
    r"\{% if loop\.first and messages\[0\]\['role'\] != 'system' %\}"
    r"\{\{ '<\|im_start\|>system\n(?P<system>.*?)<\|im_end\|>\n' \}\}\{% endif %\}", re.S)
_GENERATION = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"


@dataclass(frozen=True)
class ChatTemplate:
    start: str = "<|im_start|>"
    end: str = "<|im_end|>"
    default_system: Optional[str] = None

    @classmethod
    def from_jinja(cls, template: str) -> "ChatTemplate":
        """Recognize a ChatML Jinja template (the SmolLM2 family); anything else is refused rather
        than rendered wrongly."""
        if _MESSAGE not in template or _GENERATION not in template:
            raise PayloadError("tokenizer.chat_template", "not a ChatML template this renderer knows "
                                                          f"(expected the per-message block {_MESSAGE!r})")
        m = _DEFAULT_SYSTEM.search(template)
        return cls(default_system=m.group("system") if m else None)

    def to_metadata(self) -> dict:
        return {"format": "chatml", "start": self.start, "end": self.end, "default_system": self.default_system}

    @classmethod
    def from_metadata(cls, meta: dict) -> "ChatTemplate":
        if not isinstance(meta, dict) or meta.get("format") != "chatml":
            raise PayloadError("metadata.tokenizer.chat", f"unsupported chat template {meta!r} (expected format chatml)")
        return cls(start=meta.get("start", "<|im_start|>"), end=meta.get("end", "<|im_end|>"),
                   default_system=meta.get("default_system"))

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (a list of ``{"role", "content"}`` dicts)."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise InputError(f"chat messages: expected a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
        parts = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
                raise InputError(f"chat messages[{i}]: expected a dict with string 'role' and 'content', got {msg!r}")
            if i == 0 and msg["role"] != "system" and self.default_system is not None:
                parts.append(f"{self.start}system\n{self.default_system}{self.end}\n")
            parts.append(f"{self.start}{msg['role']}\n{msg['content']}{self.end}\n")
        if add_generation_prompt:
            parts.append(f"{self.start}assistant\n")
        return "".join(parts)
