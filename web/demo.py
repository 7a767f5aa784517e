"""The Python half of the browser demo (called from web/app/worker.js).

One Environment per page, one loaded model at a time. Program bytes stay in JavaScript: the worker
fetches the file into one Uint8Array and feeds it, as it arrives, to a ``loader.Download`` that
checks every constant's hash; the Program it returns has that Uint8Array as its data segment
(``loader.JsBytes``), and the shared WebGPU executor uploads weights from views of it.
"""

from __future__ import annotations

import array
import time
from typing import Any, Dict, List, Optional

from gpudelegate.errors import InputError
from gpudelegate.executor import HostTensor

from . import loader, webgpu

_env = None
_loaded: Dict[str, Any] = {}


def _plain(x):
    """Python values -> JS-friendly plain values (dicts become JS objects via to_js)."""
    return webgpu.to_js(x)


def environment():
    global _env
    if _env is None or _env.closed:
        from gpudelegate.environment import Environment
        _env = Environment()
    return _env


async def init_gpu():
    """Create the WebGPU device (DeviceError with advice when there is none); adapter info."""
    await webgpu.init()
    return _plain(environment().context("webgpu").info())


def download(data, total_size: int) -> "loader.Download":
    """The checker the worker feeds while ``data`` (a Uint8Array of the whole file) fills up:
    ``advance(bytes_arrived)`` after each network chunk, ``verify_all()`` for a cached file."""
    return loader.Download(data, int(total_size))


TASKS = {"causal-lm": "chat", "sentence-embedding": "similarity"}  # export's metadata["task"] -> demo card


def weights_summary(program) -> Dict[str, Any]:
    """What weights a program runs, for the page: ``kind`` ("gguf", "q4_0", "q4_1", "q8_0",
    "float16", "float32"), a ``label`` ("4-bit GGUF blocks (Q4_1, Q8_0)") and ``types``: bytes on
    the device by dtype, most first. Counted from the prepack entries (each constant once, though
    prefill and decode both list it), so float32 weights packed to float16 at load count as
    float16: the dtype that runs, not the one in the file."""
    from gpudelegate.dtypes import is_packed

    seen, types = set(), {}
    for pl in program.payloads:
        for e in pl.prepack:
            src, dst = pl.values[e.src], pl.values[e.dst]
            if (src.constant, e.layout) not in seen:
                seen.add((src.constant, e.layout))
                types[dst.dtype] = types.get(dst.dtype, 0) + dst.nbytes
    if not types:  # no prepacked weights (a program that runs only host ops): what the file holds
        for c in program.constants:
            types[c.dtype] = types.get(c.dtype, 0) + c.nbytes
    types = dict(sorted(types.items(), key=lambda kv: (-kv[1], kv[0])))
    packed = [t for t in types if is_packed(t)]
    if packed:
        bits = 4 if any(t.startswith("q4") for t in packed) else 8
        names = ", ".join(t.upper() for t in packed)
        gguf = (program.metadata or {}).get("weights_dtype") == "gguf"
        kind = "gguf" if gguf else packed[0]
        label = f"{bits}-bit GGUF blocks ({names})" if gguf else f"{bits}-bit ({names})"
    else:
        kind = label = "float16" if "float16" in types else "float32"
    return {"kind": kind, "label": label, "types": types}


def task_of(program) -> str:
    meta = program.metadata or {}
    if meta.get("task") in TASKS:
        return TASKS[meta["task"]]
    if "decode" in program.methods and "prefill" in program.methods:
        return "chat"
    return "similarity"


def weight_budget(program, limits, fraction: float) -> Optional[int]:
    """The demo's budget slider: 1.0 keeps every weight resident (None); below it, the budget
    goes linearly from the offload floor (0.0) to all weights resident."""
    if fraction is None or fraction >= 1.0:
        return None
    from gpudelegate.plan import plan_session
    total = sum(b.nbytes for b in plan_session(program, limits).prepack.buffers)
    floor = plan_session(program, limits, weight_budget=total).offload.floor
    return int(floor + max(0.0, float(fraction)) * (total - floor))


async def load(name: str, source, budget_fraction: float = 1.0, progress=None, phase=None, **executor_options):
    """Plan, allocate, record and prepack a program on WebGPU. Returns load facts. ``source``: a
    ``loader.Download`` that checked every byte (the worker's), or the whole file as a Uint8Array
    (checked here, before anything reaches the GPU). ``progress(done, total)``: prepack bytes;
    ``phase(name)``: each load phase as it starts ("verify" when the bytes are checked here,
    then ``Session.BUILD_PHASES``: "plan", "allocate", "record", "prepack"), so the page shows
    which one runs instead of a finished download bar."""
    close()
    env = environment()
    last = []

    def say(name: str) -> None:
        # The budget slider plans before the session does: one "plan" phase, not two.
        if phase is not None and last[-1:] != [name]:
            last.append(name)
            phase(name)

    t0 = time.perf_counter()
    if isinstance(source, loader.Download):
        program, verify = source.program(), source.seconds
    else:
        say("verify")
        dl = loader.Download(source)
        program, verify = dl.verify_all(), dl.seconds
    task = task_of(program)
    t_tok = time.perf_counter()
    tok = None
    meta_tok = (program.metadata or {}).get("tokenizer")
    if meta_tok is not None:
        from gpudelegate.text import tokenizer_from_metadata
        tok = tokenizer_from_metadata(meta_tok)
    t_tok = time.perf_counter() - t_tok
    ctx = env.context("webgpu")
    say("plan")
    budget = weight_budget(program, ctx.limits, budget_fraction)
    cb = (lambda done, total: progress(done, total)) if progress is not None else None
    sess = env.session(program, device="webgpu", weight_budget=budget, progress=cb, phase=say, **executor_options)
    build = time.perf_counter() - t0
    plan = sess.plan
    weights = sum(b.nbytes for b in plan.prepack.buffers)
    off = plan.offload
    _loaded.update(name=name, program=program, session=sess, tokenizer=tok, task=task)
    return _plain({
        "name": name, "task": task, "model": (program.metadata or {}).get("model", name), "buildSeconds": build, "weightBytes": weights,
        "offload": off is not None and bool(off.streamed),
        "deviceWeightBytes": off.peak_bytes if off is not None else weights,
        "budget": budget, "streamed": len(off.streamed) if off is not None else 0,
        "methods": list(program.methods), "timings": dict(sess.timings, tokenizer=t_tok), "verifySeconds": verify,
        "weights": weights_summary(program),
    })


def close() -> None:
    s = _loaded.pop("session", None)
    _loaded.clear()
    if s is not None:
        s.close()


def _need(task: str):
    if _loaded.get("task") != task:
        raise InputError(f"load a {task} model first (loaded: {_loaded.get('name') or 'nothing'})")
    if _loaded.get("tokenizer") is None:
        raise InputError(f"{_loaded['name']}: the program's metadata has no tokenizer")
    return _loaded["session"], _loaded["tokenizer"]


def int_tensor(rows: List[List[int]], dtype: str = "int32") -> HostTensor:
    flat = array.array("i", [v for r in rows for v in r])
    return HostTensor(dtype, (len(rows), len(rows[0])), flat.tobytes())


#: Longer than any text: ``encode`` then returns every token (its default limit is the tokenizer's).
_NO_LIMIT = 1 << 62


def token_counts(texts: List[str]) -> List[int]:
    """Tokens of each text with [CLS] and [SEP], untruncated: more than the program's
    ``seq_len`` means ``embed`` reads only the first ``seq_len`` of them."""
    _, tok = _need("similarity")
    return [len(tok.encode(t, max_length=_NO_LIMIT)) for t in texts]


async def embed(texts: List[str]) -> List[List[float]]:
    """Sentence embeddings from the loaded MiniLM program, batched to its static input shape."""
    sess, tok = _need("similarity")
    meta = sess.program.metadata
    b, t = int(meta["batch"]), int(meta["seq_len"])
    out: List[List[float]] = []
    for s in range(0, len(texts), b):
        batch = list(texts[s:s + b])
        n = len(batch)
        ids, mask = tok.encode_batch(batch + [""] * (b - n), t)
        emb = (await sess.run_async("forward", {"ids": int_tensor(ids), "mask": int_tensor(mask)}))[0]
        out.extend(emb.tolist()[:n])
    return out


async def rank(query: str, sentences) -> Any:
    """Sentences by cosine similarity to ``query``, best first. Each carries its token count and
    whether it was truncated to the model's window (``window``: the program's ``seq_len``,
    [CLS] and [SEP] included), so the page can say so. Nothing to rank is an InputError, at once."""
    query = str(query)
    sentences = [str(s) for s in sentences]
    if not query.strip():
        raise InputError("nothing to rank against: write a query")
    if not any(s.strip() for s in sentences):
        raise InputError("nothing to rank: write at least one sentence, one per line")
    sess, _ = _need("similarity")
    window = int(sess.program.metadata["seq_len"])
    t0 = time.perf_counter()
    counts = token_counts([query] + sentences)
    vecs = await embed([query] + sentences)
    q = vecs[0]

    def cos(a, b):
        na = sum(x * x for x in a) ** 0.5
        nb = sum(x * x for x in b) ** 0.5
        return sum(x * y for x, y in zip(a, b)) / (na * nb or 1.0)

    scores = [cos(q, v) for v in vecs[1:]]
    order = sorted(range(len(sentences)), key=lambda i: -scores[i])
    return _plain({"ranking": [{"sentence": sentences[i], "score": scores[i], "tokens": counts[i + 1],
                                "truncated": counts[i + 1] > window} for i in order],
                   "query": {"tokens": counts[0], "truncated": counts[0] > window},
                   "window": window, "seconds": time.perf_counter() - t0})


def _lookahead(value: str):
    """The page's ``lookahead`` (a string from its URL): "auto" (the executor's: the token picked
    on the GPU, 2 steps submitted ahead on a GPU adapter, none on a software one), "host" (the
    logits read back and picked in the page), or a number of decode steps submitted before the
    token they follow is read."""
    value = str(value)
    if value == "auto":
        return "auto"
    if value == "host":
        return None
    if value.isdigit():
        return int(value)
    raise InputError(f"lookahead {value!r}: expected auto, host or a number of steps (0, 1, 2, ...)")


async def chat(prompt: str, max_new_tokens: int = 48, on_token=None, lookahead: str = "auto") -> Any:
    """Greedy chat completion (core/llm.py's loop over ``run_async``), streaming text pieces."""
    from gpudelegate import llm

    ahead = _lookahead(lookahead)
    sess, tok = _need("chat")
    cb = (lambda token_id, piece: on_token(piece)) if on_token is not None else None
    messages = [{"role": "user", "content": str(prompt)}]
    r = await llm.generate_async(sess, tok, messages, int(max_new_tokens), on_token=cb, lookahead=ahead)
    return _plain({"ids": list(r.ids), "promptIds": list(r.prompt_ids), "text": r.text, "stop": r.stop_reason,
                   "prefillSeconds": r.prefill_seconds, "promptTokens": len(r.prompt_ids),
                   "tokensPerSecond": r.tokens_per_second, "decodeSteps": r.decode_steps,
                   "decodeSeconds": r.decode_seconds, "lookahead": str(llm.greedy_lookahead(sess, 0.0, ahead))})
