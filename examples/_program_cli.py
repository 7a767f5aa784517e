"""What the text examples (minilm.py, smollm2.py) share: the command-line options that pick the
device, the program file and its weights' dtype, and opening a session on that program, exported
first where the file is missing."""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable, Sequence


WEIGHTS_DTYPES = ("float32", "float16", "q4_0", "q4_1", "q8_0")  # export's weights_dtype for any model


def add_program_args(ap: argparse.ArgumentParser, default_program: str, extra_weights: Sequence[str] = ()) -> None:
    """``--device``, ``--program`` (default ``default_program``) and ``--weights-dtype``
    (``extra_weights``: choices only one model has, e.g. SmolLM2's "gguf")."""
    ap.add_argument("--device", default="auto", help="auto | reference | wgpu | cuda (default: auto)")
    ap.add_argument("--program", default=default_program, help="program file (exported if missing)")
    ap.add_argument("--weights-dtype", default="float32", choices=[*WEIGHTS_DTYPES, *extra_weights])


def open_session(env, path: str, device: str, export: Callable[[str], object]):
    """A session of ``env`` on the program file ``path`` on ``device``; where the file is missing,
    ``export(path)`` writes it first. Prints how long the export and the load took."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        t = time.perf_counter()
        export(path)
        print(f"exported {path} in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    session = env.session(path, device=device)
    print(f"device {session.device}, loaded in {time.perf_counter() - t:.2f} s")
    return session
