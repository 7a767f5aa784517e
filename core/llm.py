"""Text generation over a causal-LM program (``prefill`` + ``decode`` methods with an explicit KV
cache, as :mod:`gpudelegate.export.models.smollm2` exports them), in pure Python so it runs in
Pyodide too.

The loop lives in one generator (:func:`generation_steps`) that yields ``(method, inputs)`` and
receives the method's outputs; :func:`generate` drives it with ``session.run`` and
:func:`generate_async` with ``session.run_async`` (the browser). The caches are requested with
``keep_on_device=True`` and fed back as they come, so they stay on the device between steps; only
the ``[1, vocab]`` logits come back to the host, where greedy or temperature/top-k sampling runs
over a plain list of floats.

Greedy decoding (temperature 0) on a session whose executor has ``argmax_device`` keeps the
token on the device: each step's logits are reduced there into an int32 index that the next
decode step takes as its ``ids``, and the host reads that index (4 bytes) to stream the text and
decide when to stop. With ``lookahead`` k > 0 the loop submits up to k decode steps beyond the
token it reads next, so the device computes step n+1 while the host waits for token n (the
browser: one round trip per token otherwise, during which the GPU idles). The tokens are the
same as without it: a step past the stop is discarded (see :func:`_greedy_on_device`).

The layout (cache names and shape, prefill chunk, context length) comes from the program's
``metadata["llm"]``, written by the exporter.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import random
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple, Union

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


#: What :func:`generation_steps` yields besides ``(method, inputs)`` on its on-device greedy path:
#: ``(ARGMAX, logits)``, to be sent the executor's ``argmax_device(logits)``, and
#: ``(READ, index)``, to be sent ``index_value(index)`` (or ``await index_value_async(index)``).
#: Program methods are ``prefill`` and ``decode``, never these.
ARGMAX = "<argmax_device>"
READ = "<index_value>"


def _check_lookahead(lookahead) -> None:
    if lookahead is not None and (not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0):
        raise InputError(f"lookahead must be None or an int >= 0, got {lookahead!r}")


def generation_steps(layout: LLMLayout, tokenizer, prompt, max_new_tokens: int, temperature: float = 0.0,
                     top_k: Optional[int] = None, seed: Optional[int] = None, on_token: OnToken = None,
                     stop_ids: Optional[Sequence[int]] = None, lookahead: Optional[int] = None,
                     ) -> Generator[Tuple[str, Any], Any, GenerationResult]:
    """The generation loop as a generator: yields ``(method, inputs by name)``, is sent the
    method's outputs (logits first, then the caches in ``layout.caches`` order), returns the
    :class:`GenerationResult`. With ``lookahead`` an int (greedy only: ignored when
    ``temperature > 0``) the greedy pick runs on the device and it also yields ``(ARGMAX,
    logits)`` and ``(READ, index)`` (see :data:`ARGMAX`), submitting up to ``lookahead`` decode
    steps before it reads the token they follow; None: the host picks from the logits."""
    _check_lookahead(lookahead)
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
    # The timers end at each token's pick: that is where the GPU is waited for (a read-back of the
    # logits, an argmax on their holder, or the read of the index the device picked); a run call
    # alone returns once its work is submitted. The prefill's time is the first token's (time to
    # first token); each decode step's runs from the end of the previous token's handling to its
    # token. The decode time is the span from the first decode step's submission to the last pick
    # (not the sum of the steps: steps submitted ahead run before the first token is read, and a
    # sum would leave their time out). on_token's own work is outside both.
    tally = _Tally(result, stream, on_token, stops, max_new_tokens, layout.max_context, t0)
    if lookahead is not None and sampler.temperature == 0.0:
        yield from _greedy_on_device(layout, tally, logits, caches, lookahead)
        return tally.finish()
    values = logits  # the sampler reads them as they came (greedy: an argmax on the holder)
    pos = len(ids)
    while not tally.accept(sampler(values)):
        inputs = {"ids": int32_tensor([result.ids[-1]], (1, 1)), "pos": int32_tensor([pos], (1,))}
        inputs.update(caches)
        tally.decode_starts()
        outs = yield ("decode", inputs)
        caches = dict(zip(layout.caches, outs[1:]))
        values = outs[0]
        pos += 1
    return tally.finish()


class _Tally:
    """A generation's bookkeeping, the same for every loop: each token's timing, the streamed
    text, ``on_token``, and the stop rules (EOS, ``max_new_tokens``, the context's end)."""

    def __init__(self, result: GenerationResult, stream, on_token: OnToken, stops, max_new_tokens: int,
                 max_context: int, t0: float):
        self.result, self.stream, self.on_token, self.stops = result, stream, on_token, stops
        self.max_new_tokens, self.max_context = max_new_tokens, max_context
        self.t0, self.t1 = t0, None
        self.decode_t0: Optional[float] = None  # the first decode step's submission
        self.outside = 0.0  # bookkeeping and on_token time after decode_t0: not decode time
        self.text: List[str] = []

    def decode_starts(self) -> None:
        """A decode step is about to be submitted: the decode clock starts at the first."""
        if self.decode_t0 is None:
            self.decode_t0 = time.perf_counter()

    def accept(self, tok: int) -> bool:
        """Record token ``tok`` just picked; True when generation stops after it."""
        r = self.result
        now = time.perf_counter()
        if self.t1 is None:
            r.prefill_seconds = now - self.t0
        else:
            r.step_seconds.append(now - self.t1)
            r.decode_seconds = now - self.decode_t0 - self.outside
            r.decode_steps += 1
        try:
            return self._handle(tok)
        finally:
            if self.decode_t0 is not None:
                self.outside += time.perf_counter() - max(now, self.decode_t0)

    def _handle(self, tok: int) -> bool:
        r = self.result
        r.ids.append(tok)
        piece = self.stream.feed(tok)
        self.text.append(piece)
        if self.on_token is not None:
            self.on_token(tok, piece)
        # The next decode step would write the KV row of this token's position.
        if tok in self.stops:
            r.stop_reason = "eos"
        elif len(r.ids) >= self.max_new_tokens:
            r.stop_reason = "length"
        elif self.next_position() >= self.max_context:
            r.stop_reason = "context"
        else:
            self.t1 = time.perf_counter()
            return False
        return True

    def next_position(self, ahead: int = 0) -> int:
        """The position of the decode step that takes the ``ahead``-th token after the last one
        accepted (0: the last one itself)."""
        return len(self.result.prompt_ids) + len(self.result.ids) - 1 + ahead

    def may_follow(self, ahead: int) -> bool:
        """Whether a decode step may take the ``ahead``-th pending token, the one ``ahead``
        places after the last accepted (1: the next one), should none of the tokens up to it
        be a stop: the length and context rules, known before the tokens' values are."""
        return (len(self.result.ids) + ahead < self.max_new_tokens
                and self.next_position(ahead) < self.max_context)

    def finish(self) -> GenerationResult:
        tail = self.stream.flush()
        if tail:
            self.text.append(tail)
        self.result.text = "".join(self.text)
        return self.result


def _greedy_on_device(layout: LLMLayout, tally: _Tally, logits, caches: Dict[str, Any], lookahead: int):
    """Greedy decoding with the pick on the device: each step's ``ids`` is the previous step's
    argmax, still on the device, and up to ``lookahead`` steps are submitted before the host
    reads the token they follow. Tokens are read (and accepted, with their timings, text and
    stop rules) in order, so the ids equal the host-picked loop's.

    A step submitted past the stop (its token followed an EOS) is discarded: it only wrote the
    KV row at its own position, beyond the last generated token, and no step ever reads it: a
    decode step at position p attends to the keys j <= p (the exported models' causal mask,
    ``key_index <= qpos`` in export/models/smollm2.py), generation has stopped, and the next
    generation writes its caches afresh (zeros, then its prompt's prefill). Steps past the
    length or context limits are never submitted (those limits are known ahead)."""
    newest = yield (ARGMAX, logits)
    pending = deque([newest])  # index tensors of tokens picked on the device, not read yet, in order
    while True:
        # The step that takes the newest token (read or not: ``newest`` stays valid on the device
        # until the next argmax) runs at that token's position.
        while (len(pending) <= lookahead or not pending) and tally.may_follow(len(pending)):
            inputs = {"ids": newest, "pos": int32_tensor([tally.next_position(len(pending))], (1,))}
            inputs.update(caches)
            tally.decode_starts()
            outs = yield ("decode", inputs)
            caches = dict(zip(layout.caches, outs[1:]))
            newest = yield (ARGMAX, outs[0])
            pending.append(newest)
        if tally.accept((yield (READ, pending.popleft()))):
            break
    # Read what is still pending (steps past the stop; their tokens are dropped): an unread
    # browser map would keep its staging buffer mapped, out of the pool.
    while pending:
        yield (READ, pending.popleft())


def _layout(session) -> LLMLayout:
    layout = LLMLayout.from_metadata(session.program.metadata)
    missing = [m for m in ("prefill", "decode") if m not in session.program.methods]
    if missing:
        raise InputError(f"the program has no {' or '.join(missing)} method (it has: {', '.join(session.program.methods)})")
    return layout


def greedy_lookahead(session, temperature: float = 0.0, lookahead: Union[int, str, None] = "auto") -> Optional[int]:
    """``lookahead`` of :func:`generate` as :func:`generation_steps` takes it: ``"auto"`` is the
    session's executor's ``greedy_lookahead`` where it picks on its device (every Executor
    does, through ``argmax_device``), else None (the host picks)."""
    if lookahead != "auto":
        _check_lookahead(lookahead)
        return lookahead
    ex = getattr(session, "executor", None)
    if temperature != 0 or ex is None or not callable(getattr(ex, "argmax_device", None)):
        return None
    return int(getattr(ex, "greedy_lookahead", 0))


def _device_lock(session):
    env = getattr(session, "env", None)
    return env.context_lock(session.device) if env is not None else contextlib.nullcontext()


def generate(session, tokenizer, prompt, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: Optional[int] = None, seed: Optional[int] = None, on_token: OnToken = None,
             stop_ids: Optional[Sequence[int]] = None, lookahead: Union[int, str, None] = "auto") -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` (text, chat messages or ids).
    ``on_token(token_id, text_piece)`` is called as each token is produced (streaming). Stops at
    the tokenizer's EOS ids (or ``stop_ids``; pass ``()`` to never stop early).

    ``lookahead`` (greedy decoding only): an int k >= 0 picks each token on the device
    (``Executor.argmax_device``) and submits up to k decode steps before reading the token they
    follow; None picks on the host from the read-back logits; ``"auto"`` (the default) is the
    executor's ``greedy_lookahead`` (2 on a GPU: the browser, wgpu, Dawn, CUDA; 0 on software
    adapters and the reference). The tokens are the same whichever is used."""
    steps = generation_steps(_layout(session), tokenizer, prompt, max_new_tokens, temperature, top_k, seed,
                             on_token, stop_ids, greedy_lookahead(session, temperature, lookahead))
    ex = getattr(session, "executor", None)
    try:
        op, arg = next(steps)
        while True:
            if op in (ARGMAX, READ):
                # the device lock session.run takes too: sessions on other threads share the device
                with _device_lock(session):
                    got = ex.argmax_device(arg) if op == ARGMAX else ex.index_value(arg)
            else:
                got = session.run(op, arg, keep_on_device=True)
            op, arg = steps.send(got)
    except StopIteration as stop:
        return stop.value


async def generate_async(session, tokenizer, prompt, max_new_tokens: int = 64, temperature: float = 0.0,
                         top_k: Optional[int] = None, seed: Optional[int] = None, on_token: OnToken = None,
                         stop_ids: Optional[Sequence[int]] = None,
                         lookahead: Union[int, str, None] = "auto") -> GenerationResult:
    """:func:`generate` for sessions whose executor runs asynchronously (the browser): runs and
    index reads are awaited, so the page's event loop runs while the GPU works."""
    steps = generation_steps(_layout(session), tokenizer, prompt, max_new_tokens, temperature, top_k, seed,
                             on_token, stop_ids, greedy_lookahead(session, temperature, lookahead))
    ex = getattr(session, "executor", None)
    try:
        op, arg = next(steps)
        while True:
            if op == ARGMAX:
                got = ex.argmax_device(arg)
            elif op == READ:
                got = await ex.index_value_async(arg)
            else:
                got = await session.run_async(op, arg, keep_on_device=True)
            op, arg = steps.send(got)
    except StopIteration as stop:
        return stop.value
