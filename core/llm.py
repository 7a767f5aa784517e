"""Text generation over a causal-LM program (``prefill`` + ``decode`` methods with an explicit KV
cache, as :mod:`gpudelegate.export.models.smollm2` exports them), in pure Python so it runs in
Pyodide too.

The loop lives in one generator (:func:`generation_steps`) that yields ``(method, inputs)`` and
receives the method's outputs; :func:`generate` drives it with ``session.run`` and
:func:`generate_async` with ``session.run_async`` (the browser). The caches are requested with
``keep_on_device=True`` and fed back as they come, so they stay on the device between steps; only
the ``[1, vocab]`` logits come back to the host, where greedy or temperature/top-k sampling runs
over a plain list of floats.

The layout (cache names and shape, prefill chunk, context length) comes from the program's
``metadata["llm"]``, written by the exporter.
"""

from __future__ import annotations

import heapq
import math
import random
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple

from . import dtypes as _dt
from .errors import InputError, PayloadError
from .executor import DeviceTensor, HostTensor, first_max

OnToken = Optional[Callable[[int, str], None]]


@dataclass(frozen=True)
class LLMLayout:
    max_context: int
    prefill_chunk: int
    caches: Tuple[str, ...]  # method input/output names of the cache tensors, in order
    cache_shape: Tuple[int, ...]
    cache_dtype: str
    vocab_size: int

    @classmethod
    def from_metadata(cls, meta: dict) -> "LLMLayout":
        llm = meta.get("llm") if isinstance(meta, dict) else None
        if not isinstance(llm, dict):
            raise PayloadError("metadata.llm", "missing: this program was not exported as a causal LM "
                                               "(prefill/decode with a KV cache)")
        try:
            shape = (1, int(llm["kv_heads"]), int(llm["max_context"]), int(llm["head_dim"]))
            out = cls(max_context=int(llm["max_context"]), prefill_chunk=int(llm["prefill_chunk"]),
                      caches=tuple(str(c) for c in llm["caches"]), cache_shape=shape,
                      cache_dtype=str(llm.get("cache_dtype", "float32")), vocab_size=int(llm["vocab_size"]))
        except (KeyError, TypeError, ValueError) as e:
            raise PayloadError("metadata.llm", f"malformed ({type(e).__name__}: {e})") from None
        if out.cache_dtype not in _dt.FLOAT_DTYPES:
            raise PayloadError("metadata.llm.cache_dtype", f"{out.cache_dtype!r} (expected float32 or float16)")
        if out.prefill_chunk <= 0 or out.max_context % out.prefill_chunk:
            raise PayloadError("metadata.llm.prefill_chunk", f"{out.prefill_chunk} must divide max_context {out.max_context}")
        return out


@dataclass
class GenerationResult:
    prompt_ids: List[int]
    ids: List[int]  # generated tokens (the stop token included when one ended generation)
    text: str  # the generated text, special tokens skipped
    stop_reason: str  # "eos" | "length" | "context"
    prefill_seconds: float = 0.0  # through the first token's pick: the time to first token
    decode_seconds: float = 0.0  # every decode step through its token's pick (the first token comes from prefill)
    decode_steps: int = 0
    step_seconds: List[float] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: tokens produced by decode steps per second of decode time."""
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


# ----------------------------------------------------------------------------- host tensors

def int32_tensor(values: Sequence[int], shape: Tuple[int, ...]) -> HostTensor:
    return HostTensor("int32", tuple(shape), struct.pack(f"<{len(values)}i", *values))


def zeros(dtype: str, shape: Tuple[int, ...]) -> HostTensor:
    return HostTensor(dtype, tuple(shape), bytes(_dt.nbytes(dtype, shape)))


def to_float_list(x: Any) -> List[float]:
    """A host or device tensor's values as a flat list of floats, without numpy."""
    if isinstance(x, DeviceTensor):
        x = x.owner.to_host(x)
    if isinstance(x, HostTensor):
        return _dt.byte_view(x.data).cast(_dt.STRUCT_FORMAT[x.dtype]).tolist()
    if hasattr(x, "ravel"):  # a numpy array on desktop
        return x.ravel().tolist()
    if hasattr(x, "tolist"):
        flat = x.tolist()
        while flat and isinstance(flat[0], list):
            flat = [v for row in flat for v in row]
        return flat
    raise InputError(f"logits: cannot read values from {type(x).__name__}")


# ----------------------------------------------------------------------------- sampling

def argmax(values: Sequence[float]) -> int:
    """Index of the largest value (the first one on ties, as torch.argmax)."""
    return first_max(values if isinstance(values, list) else list(values))


def greedy_token(logits: Any) -> int:
    """The greedy pick from a step's logits as the session returned them, without building a
    Python list of the vocabulary where the holder has its own argmax: a device tensor asks its
    executor (``Executor.argmax``), a numpy array or a page tensor uses ``.argmax()`` (a list of
    49,152 floats costs ~3 ms a token, as much as a whole decode step on a GPU)."""
    if isinstance(logits, DeviceTensor):
        return logits.owner.argmax(logits)
    if hasattr(logits, "argmax"):
        return int(logits.argmax())
    return argmax(to_float_list(logits))


class Sampler:
    """Greedy when ``temperature == 0``; otherwise softmax(logits / temperature) over the
    ``top_k`` largest logits (all when None), drawn with a seeded ``random.Random``."""

    def __init__(self, temperature: float = 0.0, top_k: Optional[int] = None, seed: Optional[int] = None):
        if not isinstance(temperature, (int, float)) or temperature < 0 or math.isnan(temperature):
            raise InputError(f"temperature must be a number >= 0, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise InputError(f"top_k must be a positive int or None, got {top_k!r}")
        self.temperature = float(temperature)
        self.top_k = top_k
        self.rng = random.Random(seed)

    def __call__(self, logits: Any) -> int:
        """``logits``: a flat list of floats, or a step's logits as the session returned them."""
        if self.temperature == 0.0:
            return argmax(logits) if isinstance(logits, list) else greedy_token(logits)
        if not isinstance(logits, list):
            logits = to_float_list(logits)
        n = len(logits)
        if self.top_k is not None and self.top_k < n:
            cand = heapq.nlargest(self.top_k, range(n), key=logits.__getitem__)
        else:
            cand = range(n)
        top = max(logits[i] for i in cand)
        weights = [math.exp((logits[i] - top) / self.temperature) for i in cand]
        r = self.rng.random() * sum(weights)
        acc = 0.0
        for i, w in zip(cand, weights):
            acc += w
            if r < acc:
                return i
        return list(cand)[-1]  # r landed on the rounding error at the very top


# ----------------------------------------------------------------------------- the loop

def prompt_ids(tokenizer, prompt) -> List[int]:
    """``prompt``: text (encoded as is), a list of chat messages (rendered with the tokenizer's
    chat template), or a list of token ids."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        return tokenizer.encode(tokenizer.apply_chat_template(list(prompt)))
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        return list(prompt)
    raise InputError("prompt: expected text, a non-empty list of {'role', 'content'} messages, or a non-empty "
                     f"list of token ids; got {type(prompt).__name__}")


def generation_steps(layout: LLMLayout, tokenizer, prompt, max_new_tokens: int, temperature: float = 0.0,
                     top_k: Optional[int] = None, seed: Optional[int] = None, on_token: OnToken = None,
                     stop_ids: Optional[Sequence[int]] = None,
                     ) -> Generator[Tuple[str, Dict[str, Any]], List[Any], GenerationResult]:
    """The generation loop as a generator: yields ``(method, inputs by name)``, is sent the
    method's outputs (logits first, then the caches in ``layout.caches`` order), returns the
    :class:`GenerationResult`."""
    ids = prompt_ids(tokenizer, prompt)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    vocab = layout.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise InputError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
    if len(ids) >= layout.max_context:
        raise InputError(f"prompt has {len(ids)} tokens; the program's context is {layout.max_context} "
                         f"(it needs room for at least one generated token)")
    sampler = Sampler(temperature, top_k, seed)
    stops = set(getattr(tokenizer, "eos_ids", ()) if stop_ids is None else stop_ids)
    stream = tokenizer.stream_decoder(skip_special_tokens=True)
    result = GenerationResult(prompt_ids=list(ids), ids=[], text="", stop_reason="length")
    caches: Dict[str, Any] = {name: zeros(layout.cache_dtype, layout.cache_shape) for name in layout.caches}
    if max_new_tokens == 0:
        return result

    # Prefill in chunks of C at positions 0, C, 2C, ...; the last chunk is padded and `last` picks
    # the row of the final prompt token.
    C = layout.prefill_chunk
    pad = ids[-1]
    t0 = time.perf_counter()
    logits = None
    for start in range(0, len(ids), C):
        chunk = ids[start:start + C]
        inputs = {"ids": int32_tensor(chunk + [pad] * (C - len(chunk)), (1, C)),
                  "pos": int32_tensor([start], (1,)), "last": int32_tensor([len(chunk) - 1], (1,))}
        inputs.update(caches)
        outs = yield ("prefill", inputs)
        logits = outs[0]
        caches = dict(zip(layout.caches, outs[1:]))
    values = logits  # the sampler reads them as they came (greedy: an argmax on the holder)

    # The timers end at each token's pick: that is where the GPU is waited for (a read-back of the
    # logits, or an argmax on their holder); a run call alone returns once its work is submitted.
    # The prefill's time is the first token's (time to first token); each decode step's runs from
    # its inputs to its token. on_token's own work is outside both.
    pos = len(ids)
    text = []
    t1 = None
    while True:
        tok = sampler(values)
        if t1 is None:
            result.prefill_seconds = time.perf_counter() - t0
        else:
            dt = time.perf_counter() - t1
            result.step_seconds.append(dt)
            result.decode_seconds += dt
            result.decode_steps += 1
        result.ids.append(tok)
        piece = stream.feed(tok)
        text.append(piece)
        if on_token is not None:
            on_token(tok, piece)
        if tok in stops:
            result.stop_reason = "eos"
            break
        if len(result.ids) >= max_new_tokens:
            result.stop_reason = "length"
            break
        if pos >= layout.max_context:
            result.stop_reason = "context"
            break
        t1 = time.perf_counter()
        inputs = {"ids": int32_tensor([tok], (1, 1)), "pos": int32_tensor([pos], (1,))}
        inputs.update(caches)
        outs = yield ("decode", inputs)
        caches = dict(zip(layout.caches, outs[1:]))
        values = outs[0]
        pos += 1
    tail = stream.flush()
    if tail:
        text.append(tail)
    result.text = "".join(text)
    return result


def _layout(session) -> LLMLayout:
    layout = LLMLayout.from_metadata(session.program.metadata)
    missing = [m for m in ("prefill", "decode") if m not in session.program.methods]
    if missing:
        raise InputError(f"the program has no {' or '.join(missing)} method (it has: {', '.join(session.program.methods)})")
    return layout


def generate(session, tokenizer, prompt, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: Optional[int] = None, seed: Optional[int] = None, on_token: OnToken = None,
             stop_ids: Optional[Sequence[int]] = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` (text, chat messages or ids).
    ``on_token(token_id, text_piece)`` is called as each token is produced (streaming). Stops at
    the tokenizer's EOS ids (or ``stop_ids``; pass ``()`` to never stop early)."""
    steps = generation_steps(_layout(session), tokenizer, prompt, max_new_tokens, temperature, top_k, seed,
                             on_token, stop_ids)
    try:
        method, inputs = next(steps)
        while True:
            outs = session.run(method, inputs, keep_on_device=True)
            method, inputs = steps.send(outs)
    except StopIteration as stop:
        return stop.value


async def generate_async(session, tokenizer, prompt, max_new_tokens: int = 64, temperature: float = 0.0,
                         top_k: Optional[int] = None, seed: Optional[int] = None, on_token: OnToken = None,
                         stop_ids: Optional[Sequence[int]] = None) -> GenerationResult:
    """:func:`generate` for sessions whose executor runs asynchronously (the browser)."""
    steps = generation_steps(_layout(session), tokenizer, prompt, max_new_tokens, temperature, top_k, seed,
                             on_token, stop_ids)
    try:
        method, inputs = next(steps)
        while True:
            outs = await session.run_async(method, inputs, keep_on_device=True)
            method, inputs = steps.send(outs)
    except StopIteration as stop:
        return stop.value
