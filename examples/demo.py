"""gpudelegate demo: export SmolLM2-135M-Instruct and all-MiniLM-L6-v2 (cached), run them on the
best device found, and show a streamed answer and a similarity ranking.

    make demo                      # = .venv/bin/python examples/demo.py
    make demo ARGS="--device reference --max-new-tokens 32"
    make demo ARGS="--weights-dtype float32"   # SmolLM2 with float weights (a 539 MB program)

SmolLM2 runs on its GGUF's own 4-bit blocks by default (``--weights-dtype gguf``: Q4_1 linears,
the Q8_0 embedding, a 98 MB program). Exported programs are cached under .cache/programs/ and
exported again only when missing or stale (the export code, the weights or the options changed);
``make web`` bundles them for the browser demo (``web/build.py --weights-dtype``).
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if "XDG_RUNTIME_DIR" not in os.environ:  # wgpu warns without one (the Makefile sets it too)
    xdg = ROOT / ".cache" / "xdg"
    xdg.mkdir(parents=True, exist_ok=True)
    xdg.chmod(0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(xdg)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgpack  # noqa: E402

import gpudelegate  # noqa: E402
from gpudelegate.inspect import constants_by_dtype, format_dtype_bytes  # noqa: E402
from gpudelegate.program import read_header  # noqa: E402
from gpudelegate.text import tokenizer_from_metadata  # noqa: E402

import minilm as minilm_example  # noqa: E402  (examples/minilm.py)
import smollm2 as smollm2_example  # noqa: E402  (examples/smollm2.py)

QUESTION = "What is the capital of France?"
QUERY = "How do I get to the train station?"
# --weights-dtype: "gguf" keeps SmolLM2's GGUF blocks as they are (the default: 4-bit, the
# published model's own weights, not quantized again); the others are export's weights_dtype.
WEIGHTS_DTYPES = ["gguf", "float32", "float16", "q4_0", "q4_1", "q8_0"]
DEFAULT_WEIGHTS = "gguf"


def minilm_weights(weights_dtype: str) -> str:
    """MiniLM's weights for a --weights-dtype: its checkpoint is safetensors, not a GGUF, so
    "gguf" means float32 for it; every other choice applies to both models."""
    return "float32" if weights_dtype == "gguf" else weights_dtype


# ----------------------------------------------------------------------------- program cache

def program_metadata(path: Path) -> Optional[dict]:
    """The metadata of a program file, reading only its header and document (no constants)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            _, doc_off, doc_size, _, _ = read_header(m)
            doc = msgpack.unpackb(m[doc_off:doc_off + doc_size], raw=False)
        return doc.get("metadata") if isinstance(doc, dict) else None
    except Exception:  # noqa: BLE001 - any unreadable or foreign file is simply exported again
        return None


def fingerprint(model: str, weights: Path, options: dict) -> str:
    """What an exported program depends on: the export code, the program format, torch, the
    weight file and the export options."""
    import torch

    h = hashlib.sha256()
    sources = sorted((ROOT / "export").rglob("*.py")) + [ROOT / "core" / "program.py", ROOT / "core" / "text" / "bpe.py",
                                                        ROOT / "core" / "text" / "wordpiece.py"]
    for p in sources:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    st = weights.stat()
    h.update(f"{model}|{weights}|{st.st_size}|{st.st_mtime_ns}|{sorted(options.items())}|{torch.__version__}|"
             f"{gpudelegate.__version__}".encode())
    return h.hexdigest()[:32]


def cached_program(path: Path, key: str, export_fn: Callable, what: str, force: bool = False) -> Path:
    meta = None if force else program_metadata(path)
    if meta is not None and meta.get("demo_fingerprint") == key:
        print(f"  {what}: cached {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        return path
    reason = "forced" if force else ("missing" if not path.exists() else "stale")
    print(f"  {what}: exporting ({reason}) -> {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    export_fn(path, {"demo_fingerprint": key})
    print(f"  {what}: exported in {time.perf_counter() - t:.1f} s ({path.stat().st_size / 1e6:.0f} MB)")
    return path


def export_programs(cache: Path, weights_dtype: str = DEFAULT_WEIGHTS, force: bool = False) -> List[Path]:
    """The demo's two programs for ``weights_dtype`` (SmolLM2, then MiniLM), each exported into
    ``cache`` when missing or stale: what ``make demo`` runs and ``make web`` bundles."""
    from gpudelegate.export.models import minilm, smollm2

    smol_opts = {"weights_dtype": weights_dtype, "max_context": 256, "prefill_chunk": 32}
    smol_path = cached_program(
        cache / f"smollm2-{weights_dtype}.gdp", fingerprint("smollm2", smollm2.gguf_path(), smol_opts),
        lambda p, meta: smollm2_example.export(p, progress=True, metadata=meta, **smol_opts),
        "SmolLM2-135M-Instruct", force)
    mini_opts = {"weights_dtype": minilm_weights(weights_dtype), "batch": 8, "seq_len": 32}
    mini_path = cached_program(
        cache / f"minilm-{mini_opts['weights_dtype']}.gdp",
        fingerprint("minilm", minilm.model_dir() / "model.safetensors", mini_opts),
        lambda p, meta: minilm_example.export(p, progress=True, metadata=meta, **mini_opts),
        "all-MiniLM-L6-v2", force)
    return [smol_path, mini_path]


def weights_line(program) -> str:
    """What a loaded program's weights are, as the browser demo labels them, then by type:
    "4-bit GGUF blocks (Q4_1, Q8_0); q4_1: 210 constants, 63.3 MiB; ..."."""
    from gpudelegate.web.demo import weights_summary  # pure Python: the page's label, here too

    return f"{weights_summary(program)['label']}; {format_dtype_bytes(constants_by_dtype(program))}"


# ----------------------------------------------------------------------------- progress

class LoadBar:
    """A tqdm bar for a session's prepack ``progress(done, total)`` (weight loading)."""

    def __init__(self, desc: str):
        self.desc = desc
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=self.desc, unit="B", unit_scale=True, unit_divisor=1024,
                            file=sys.stderr, leave=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def load(env, path: Path, device: str, what: str):
    bar = LoadBar(f"loading {what} weights")
    t = time.perf_counter()
    try:
        s = env.session(path, device=device, progress=bar)
    finally:
        bar.close()
    return s, time.perf_counter() - t


# ----------------------------------------------------------------------------- demo

def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Export SmolLM2 and MiniLM (cached) and run them on the best device.")
    ap.add_argument("--device", default="auto", help="auto (default: cuda, then a hardware wgpu adapter, then reference) | reference | wgpu | cuda")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="tokens SmolLM2 may generate (default 48)")
    ap.add_argument("--question", default=QUESTION, help="what SmolLM2 is asked")
    ap.add_argument("--query", default=QUERY, help="what MiniLM ranks sentences against")
    ap.add_argument("--weights-dtype", default=DEFAULT_WEIGHTS, choices=WEIGHTS_DTYPES,
                    help="weight storage on the device: gguf (default) keeps SmolLM2's GGUF blocks (4-bit Q4_1 linears, "
                         "Q8_0 embedding; MiniLM, which has no GGUF, stays float32); float16 halves float32's memory; "
                         "q4_0/q4_1/q8_0 quantize both models at export")
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "programs"))
    ap.add_argument("--force-export", action="store_true", help="export again even when the cache is fresh")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be at least 1")

    print("gpudelegate demo")
    env = gpudelegate.Environment()
    try:
        device = env.resolve_device(args.device)
        info = env.context(device).info()
        print(f"device: {device}" + (f" ({info['device']})" if info.get("device") else ""))

        print("programs:")
        smol_path, mini_path = export_programs(Path(args.cache_dir), args.weights_dtype, args.force_export)

        # SmolLM2: a streamed answer
        session, secs = load(env, smol_path, device, "SmolLM2")
        layout = session.program.metadata["llm"]
        print(f"\nSmolLM2-135M-Instruct loaded in {secs:.2f} s on {device} "
              f"({smol_path.stat().st_size / 1e6:.1f} MB, {layout['layers']} layers, context {layout['max_context']})\n"
              f"weights: {weights_line(session.program)}")
        print(f"Q: {args.question}\nA: ", end="", flush=True)
        r = smollm2_example.chat(session, args.question, max_new_tokens=args.max_new_tokens)
        print(f"\n   {len(r.ids)} tokens ({r.stop_reason}); prefill {len(r.prompt_ids)} tokens in "
              f"{r.prefill_seconds:.2f} s; decode {r.tokens_per_second:.2f} tokens/s")
        session.close()

        # MiniLM: rank sentences by similarity to a query
        session, secs = load(env, mini_path, device, "MiniLM")
        print(f"\nall-MiniLM-L6-v2 loaded in {secs:.2f} s on {device} ({mini_path.stat().st_size / 1e6:.1f} MB)\n"
              f"weights: {weights_line(session.program)}")
        tok = tokenizer_from_metadata(session.program.metadata["tokenizer"])
        t = time.perf_counter()
        ranked = minilm_example.rank(session, args.query, minilm_example.SENTENCES, tok)
        print(f'query: "{args.query}" ({len(ranked)} sentences embedded in {time.perf_counter() - t:.2f} s)')
        for score, s in ranked:
            print(f"  {score:+.3f}  {s}")
        session.close()
    except gpudelegate.GpuDelegateError as e:
        print(f"\nerror: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
