"""Storing a float32 test program's weights as GGUF blocks, for the CUDA packed-weight tests."""

from __future__ import annotations

import numpy as np

from gpudelegate.native import quant


def pack_program(prog, dtypes) -> None:
    """Store the named float32 weight constants of ``prog`` as GGUF blocks (``dtypes``: value name
    -> packed dtype), in place; a constant shared by several values is packed once."""
    new = {}
    for pl in prog.payloads:
        for v in pl.values:
            if v.constant is None or v.name not in dtypes:
                continue
            dt = dtypes[v.name]
            if v.constant not in new:
                c = prog.constants[v.constant]
                w = np.frombuffer(prog.constant_bytes(v.constant), np.float32).reshape(c.shape)
                new[v.constant] = prog.add_constant(dt, c.shape, quant.quantize(dt, w))
            v.constant, v.dtype = new[v.constant], dt
