"""Prepack planning: which constant buffers a session materializes on the device, once.

Every constant an op of a payload reads gets one :class:`ResidentBuffer` per distinct
``(program constant, layout)``: read through a prepack entry (its ``dst`` value) with that entry's
layout, or read directly (a constant value used as an op argument) with the ``identity`` layout.
The key is the *program* constant index, so prefill and decode (or any payloads of any methods)
that read the same weight share one buffer: it is uploaded or packed once per session.

A pure view of a weight (an aliasing op with a single argument, e.g. ``reshape`` of a weight)
reads the same buffer; an aliasing op that writes other tensors into its aliased argument
(``kv_update``) must never target a weight, since that buffer is shared by every payload.

Validation follows the ExecuTorch WebGPU prepack handler (seed PR 20265): source and destination
must agree in dims, element size and byte count for the layout, or the plan fails loudly with a
:class:`PayloadError` naming the payload and the entry. The program decoder checks the same
things for files; the planner checks again because programs are also built in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from .. import dtypes as _dt
from .. import ops as _ops
from ..errors import BudgetError, PayloadError
from ..program import Payload, Program, Value
from .types import PrepackPlan, ResidentBuffer

LAYOUTS = ("identity", "fp16")
"""Prepack layouts: ``identity`` is a plain copy (same dtype, shape, bytes); ``fp16`` packs a
float32 constant into float16 storage of the same shape (half the bytes)."""


@dataclass
class PayloadWeights:
    """The weights of one payload, as the later planning steps need them."""

    payload: int
    # value id -> buffer index, for constant values read by ops, prepack destinations and pure
    # views of either. These values never live in the arena.
    buffer_of: Dict[int, int] = field(default_factory=dict)
    # per node: the buffers it reads, in argument order, each once
    reads: List[List[int]] = field(default_factory=list)


def _fmt(v: Value) -> str:
    return f"{v.dtype}{list(v.shape)}"


def _value(pl: Payload, vid: int, path: str) -> Value:
    if not isinstance(vid, int) or not 0 <= vid < len(pl.values):
        raise PayloadError(path, f"value {vid!r} out of range (0..{len(pl.values) - 1})")
    return pl.values[vid]


def _check_constant_value(program: Program, v: Value, path: str) -> None:
    """A constant value must describe its program constant exactly (the buffer is shared, so two
    payloads disagreeing about its shape would read garbage)."""
    c = v.constant
    if not isinstance(c, int) or not 0 <= c < len(program.constants):
        raise PayloadError(path, f"constant index {c!r} out of range (program has {len(program.constants)} constants)")
    const = program.constants[c]
    if (const.dtype, tuple(const.shape)) != (v.dtype, tuple(v.shape)):
        raise PayloadError(path, f"value is {_fmt(v)} but constants[{c}] is {const.dtype}{list(const.shape)}")
    if const.nbytes != _dt.nbytes(const.dtype, const.shape):
        raise PayloadError(path, f"constants[{c}] records {const.nbytes} bytes, but {const.dtype}{list(const.shape)} "
                                 f"is {_dt.nbytes(const.dtype, const.shape)}")


def _check_entry(src: Value, dst: Value, layout: str, where: str) -> None:
    """Validate one prepack entry: src/dst dims, element size and nbytes for the layout."""
    if src.constant is None:
        raise PayloadError(where, "src is not a constant value (prepack materializes constants only)")
    if dst.constant is not None:
        raise PayloadError(where, "dst is a constant value (a destination is its own device buffer)")
    if layout not in LAYOUTS:
        raise PayloadError(where, f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
    if src.dtype not in _dt.STORAGE_DTYPES or dst.dtype not in _dt.STORAGE_DTYPES:
        raise PayloadError(where, f"unknown dtype (src {src.dtype}, dst {dst.dtype})")
    want_dtype = "float16" if layout == "fp16" else src.dtype
    if layout == "fp16" and src.dtype != "float32":
        raise PayloadError(where, f"fp16 layout packs float32, but src is {_fmt(src)}")
    if tuple(dst.shape) != tuple(src.shape):
        raise PayloadError(where, f"dims differ: src {_fmt(src)}, dst {_fmt(dst)}")
    if dst.dtype != want_dtype:
        raise PayloadError(where, f"dtype: layout {layout!r} turns {_fmt(src)} into {want_dtype}, dst is {_fmt(dst)}")
    want_nbytes = _dt.nbytes(want_dtype, src.shape)
    if dst.nbytes != want_nbytes:  # cannot differ once dims and dtype agree; kept as the seed's explicit check
        raise PayloadError(where, f"nbytes: dst holds {dst.nbytes}, layout {layout!r} of src needs {want_nbytes}")


class _Buffers:
    """The deduplicated buffer list, in first-use order."""

    def __init__(self, program: Program):
        self.program = program
        self.list: List[ResidentBuffer] = []
        self.index: Dict[Tuple[int, str], int] = {}
        self.names: List[str] = []  # a readable name per buffer, for messages

    def get(self, constant: int, layout: str, dtype: str, shape, name: str) -> int:
        key = (constant, layout)
        i = self.index.get(key)
        if i is None:
            c = self.program.constants[constant]
            self.list.append(ResidentBuffer(constant, layout, dtype, tuple(shape), _dt.nbytes(dtype, shape), c.nbytes))
            self.names.append(name or f"constants[{constant}]")
            i = self.index[key] = len(self.list) - 1
        elif name and self.names[i].startswith("constants["):
            self.names[i] = name
        return i


def _payload_weights(program: Program, p: int, bufs: _Buffers) -> PayloadWeights:
    pl = program.payloads[p]
    where = f"payloads[{p}]"
    entries: Dict[int, Tuple[int, str]] = {}  # dst value -> (src value, layout)
    for i, e in enumerate(pl.prepack):
        ep = f"{where}.prepack[{i}]"
        src = _value(pl, e.src, f"{ep}.src")
        dst = _value(pl, e.dst, f"{ep}.dst")
        desc = f"{ep} (src {e.src} {_fmt(src)} -> dst {e.dst} {_fmt(dst)}, layout {e.layout!r})"
        _check_entry(src, dst, e.layout, desc)
        _check_constant_value(program, src, f"{ep}.src")
        if e.dst in entries:
            raise PayloadError(f"{ep}.dst", f"value {e.dst} is already a prepack destination")
        if e.dst in pl.inputs:
            raise PayloadError(f"{ep}.dst", f"value {e.dst} is a payload input, not a device buffer of its own")
        entries[e.dst] = (e.src, e.layout)

    pw = PayloadWeights(p)

    def weight_of(vid: int):
        """The buffer value ``vid`` names, or None when it is not a weight."""
        b = pw.buffer_of.get(vid)
        if b is not None:
            return b
        v = pl.values[vid]
        if vid in entries:
            src_id, layout = entries[vid]
            s = pl.values[src_id]
            b = bufs.get(s.constant, layout, v.dtype, v.shape, s.name or v.name)
        elif v.constant is not None:
            _check_constant_value(program, v, f"{where}.values[{vid}]")
            b = bufs.get(v.constant, "identity", v.dtype, v.shape, v.name)
        else:
            return None
        pw.buffer_of[vid] = b
        return b

    for k, node in enumerate(pl.nodes):
        np_ = f"{where}.ops[{k}]"
        try:
            opdef = _ops.get(node.op)
        except PayloadError as e:
            raise type(e)(f"{np_}.op", e.detail) from None
        reads: List[int] = []
        for j, a in enumerate(node.args):
            if a == -1:
                continue
            _value(pl, a, f"{np_}.args[{j}]")
            b = weight_of(a)
            if b is not None and b not in reads:
                reads.append(b)
        for j, o in enumerate(node.outputs):
            ov = _value(pl, o, f"{np_}.outputs[{j}]")
            if ov.constant is not None or o in entries:
                raise PayloadError(f"{np_}.outputs[{j}]", f"{node.op} writes value {o}, which is a weight (constant or "
                                                          f"prepack destination): weights are read-only and shared")
        a = opdef.alias
        if a is not None and a < len(node.args) and node.args[a] != -1 and node.args[a] in pw.buffer_of:
            if opdef.max_args != 1:
                # An aliasing op with more inputs writes them into the aliased storage (kv_update):
                # that storage is a weight buffer shared by every payload of the session.
                raise PayloadError(np_, f"{node.op} would write in place into weight value {node.args[a]} "
                                        f"({bufs.names[pw.buffer_of[node.args[a]]]}); weights are read-only")
            # A pure view (reshape) of a weight: the same buffer under another shape.
            pw.buffer_of[node.outputs[0]] = pw.buffer_of[node.args[a]]
        pw.reads.append(reads)
    # A weight returned as a payload output is read by the caller: it needs a buffer too.
    for j, o in enumerate(pl.outputs):
        _value(pl, o, f"{where}.outputs[{j}]")
        weight_of(o)
    for j, i in enumerate(pl.inputs):
        v = _value(pl, i, f"{where}.inputs[{j}]")
        if v.constant is not None:
            raise PayloadError(f"{where}.inputs[{j}]", f"value {i} is a constant; payload inputs come from the caller")
    return pw


def chunk_buffers(buffers: Sequence[ResidentBuffer], chunk_bytes: int) -> List[List[int]]:
    """Group buffer indices, in order, into chunks of at most ``chunk_bytes`` device bytes; a
    buffer bigger than that gets a chunk of its own (it cannot be split across prepack steps)."""
    chunks: List[List[int]] = []
    cur: List[int] = []
    cur_bytes = 0
    for i, b in enumerate(buffers):
        if cur and cur_bytes + b.nbytes > chunk_bytes:
            chunks.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += b.nbytes
    if cur:
        chunks.append(cur)
    return chunks


def plan_prepack(program: Program, payloads: Sequence[int], chunk_bytes: int = 64 << 20
                 ) -> Tuple[PrepackPlan, Dict[int, PayloadWeights], List[str]]:
    """Plan the resident buffers of ``payloads`` (program payload indices, in first-use order).

    Returns the plan, the per-payload weight map (value -> buffer, per-node reads) and a readable
    name per buffer (for error messages and ``pinned``)."""
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise BudgetError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    bufs = _Buffers(program)
    weights = {p: _payload_weights(program, p, bufs) for p in payloads}
    value_buffer = {(p, v): b for p, pw in weights.items() for v, b in pw.buffer_of.items()}
    plan = PrepackPlan(buffers=bufs.list, value_buffer=value_buffer,
                       chunks=chunk_buffers(bufs.list, chunk_bytes), chunk_bytes=chunk_bytes)
    return plan, weights, bufs.names
