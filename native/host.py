"""Host execution of ops no backend took (desktop only: uses the numpy reference kernels)."""

from __future__ import annotations

import numpy as np

from gpudelegate.executor import DeviceTensor
from gpudelegate.program import Method, Node, Program

from .hostio import NP_DTYPE, from_storage, to_storage


def _arg(program: Program, m: Method, vid: int, vals: dict):
    if vid < 0:
        return None
    v = m.values[vid]
    if v.constant is not None:
        raw = np.frombuffer(program.constant_bytes(v.constant), dtype=NP_DTYPE[v.dtype]).reshape(v.shape)
        return from_storage(raw, v.dtype)
    x = vals[vid]
    if isinstance(x, DeviceTensor):
        x = x.owner.to_host(x)
    return from_storage(to_storage(x, v.dtype), v.dtype)


def run_host_node(program: Program, m: Method, node: Node, vals: dict) -> list:
    from .reference_kernels import KERNELS

    args = [_arg(program, m, a, vals) for a in node.args]
    outs = KERNELS[node.op](args, node.attrs)
    return [from_storage(to_storage(o, m.values[vid].dtype), m.values[vid].dtype) for o, vid in zip(outs, node.outputs)]
