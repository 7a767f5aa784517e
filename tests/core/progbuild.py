"""Build small programs in memory for tests (numpy-free: it runs in Pyodide with the core tests).

    b = ProgramBuilder()
    w = b.constant("float32", (5, 3), rand_floats(15, seed=1))   # program constant index
    pl = b.payload()                                             # backend "gpudelegate"
    x = pl.input("float32", (7, 3))
    wd = pl.prepack(pl.constant(w))                              # identity prepack -> dst value
    y = pl.op("linear", [x, wd])                                 # output dtype/shape from ops.infer
    pl.output(y); pl.schedule_offload()
    m = b.method("forward")
    mx = m.input("float32", (7, 3))
    (my,) = m.delegate(pl, [mx])
    m.output(my)
    prog = b.build()                                             # a gpudelegate.program.Program

Values are typed as the file stores them; ``op(..., out=[(dtype, shape)])`` declares outputs
explicitly (needed for ops whose inference you want to contradict in a test).
"""

from __future__ import annotations

import random
import struct
from typing import Dict, List, Optional, Sequence, Tuple

from gpudelegate import dtypes as _dt
from gpudelegate.program import (DELEGATE_OP, Method, Node, OffloadSchedule, Payload, PrepackEntry, Program,
                                 Value)


def rand_floats(n: int, seed: int = 0, lo: float = -1.0, hi: float = 1.0) -> List[float]:
    r = random.Random(seed)
    return [r.uniform(lo, hi) for _ in range(n)]


def pack(dtype: str, values: Sequence) -> bytes:
    """Little-endian storage bytes of ``values`` in ``dtype`` (bool as 32-bit 0/1)."""
    if dtype == "bool":
        values = [1 if v else 0 for v in values]
    return struct.pack(f"<{len(values)}{_dt.STRUCT_FORMAT[dtype]}", *values)


def unpack(dtype: str, data) -> list:
    n = len(data) // _dt.itemsize(dtype)
    return list(struct.unpack(f"<{n}{_dt.STRUCT_FORMAT[dtype]}", bytes(data)))


class GraphBuilder:
    def __init__(self, program: "ProgramBuilder"):
        self.program = program
        self.values: List[Value] = []
        self.inputs: List[int] = []
        self.outputs: List[int] = []
        self.nodes: List[Node] = []

    def value(self, dtype: str, shape, name: str = "", constant: Optional[int] = None) -> int:
        self.values.append(Value(dtype, tuple(shape), constant, name))
        return len(self.values) - 1

    def input(self, dtype: str, shape, name: str = "") -> int:
        vid = self.value(dtype, shape, name)
        self.inputs.append(vid)
        return vid

    def constant(self, index: int, name: str = "") -> int:
        """A value reading program constant ``index`` (see ProgramBuilder.constant)."""
        c = self.program.prog.constants[index]
        return self.value(c.dtype, c.shape, name, constant=index)

    def op(self, op: str, args: Sequence[int], attrs: Optional[dict] = None,
           out: Optional[Sequence[Tuple[str, Sequence[int]]]] = None):
        """Append a node; returns its output id (or the list of ids if it has several)."""
        attrs = dict(attrs or {})
        if out is None:
            from gpudelegate import ops
            out = ops.infer(op, [None if a == -1 else self.values[a] for a in args], attrs)
        outs = [self.value(dt, shape) for dt, shape in out]
        self.nodes.append(Node(op, list(args), outs, attrs))
        return outs[0] if len(outs) == 1 else outs

    def output(self, *ids: int) -> None:
        self.outputs.extend(ids)


class PayloadBuilder(GraphBuilder):
    def __init__(self, program: "ProgramBuilder", backend: str):
        super().__init__(program)
        self.backend = backend
        self.prepack_entries: List[PrepackEntry] = []
        self.offload: Optional[OffloadSchedule] = None
        self.index = -1

    def prepack(self, src: int, layout: str = "identity") -> int:
        """Prepack constant value ``src``; returns the destination value id."""
        s = self.values[src]
        dtype = "float16" if layout == "fp16" else s.dtype
        dst = self.value(dtype, s.shape, f"{s.name}.packed" if s.name else "")
        self.prepack_entries.append(PrepackEntry(src, dst, layout))
        return dst

    def schedule_offload(self) -> None:
        """The schedule export would write: prepacked weights each node reads, in arg order."""
        dsts = {e.dst for e in self.prepack_entries}
        self.offload = OffloadSchedule([list(dict.fromkeys(a for a in n.args if a in dsts)) for n in self.nodes])

    def build(self) -> Payload:
        return Payload(self.values, self.inputs, self.outputs, self.nodes, backend=self.backend,
                       prepack=self.prepack_entries, offload=self.offload)


class MethodBuilder(GraphBuilder):
    def __init__(self, program: "ProgramBuilder", name: str):
        super().__init__(program)
        self.name = name

    def delegate(self, payload: PayloadBuilder, args: Sequence[int]) -> List[int]:
        """Call ``payload``; returns the new output value ids (typed as the payload's outputs)."""
        out = [(payload.values[o].dtype, payload.values[o].shape) for o in payload.outputs]
        outs = [self.value(dt, shape) for dt, shape in out]
        self.nodes.append(Node(DELEGATE_OP, list(args), outs, {"payload": payload.index}))
        return outs

    def build(self) -> Method:
        return Method(self.values, self.inputs, self.outputs, self.nodes, name=self.name)


class ProgramBuilder:
    def __init__(self, metadata: Optional[dict] = None):
        self.prog = Program(constants=[], payloads=[], methods={}, metadata=dict(metadata or {}))
        self._payloads: List[PayloadBuilder] = []
        self._methods: Dict[str, MethodBuilder] = {}

    def constant(self, dtype: str, shape, values_or_bytes) -> int:
        """Add a constant (deduplicated by content); ``values_or_bytes`` is raw storage bytes or a
        flat list of numbers."""
        data = values_or_bytes
        if not isinstance(data, (bytes, bytearray, memoryview)):
            data = pack(dtype, list(data))
        return self.prog.add_constant(dtype, shape, data)

    def payload(self, backend: str = "gpudelegate") -> PayloadBuilder:
        pb = PayloadBuilder(self, backend)
        pb.index = len(self._payloads)
        self._payloads.append(pb)
        return pb

    def method(self, name: str) -> MethodBuilder:
        mb = MethodBuilder(self, name)
        self._methods[name] = mb
        return mb

    def build(self) -> Program:
        self.prog.payloads = [p.build() for p in self._payloads]
        self.prog.methods = {n: m.build() for n, m in self._methods.items()}
        return self.prog


# ------------------------------------------------------------------ ready-made programs and files

def weight_op_program(op: str, x_shape, w_shape, seed: int = 1, metadata: Optional[dict] = None) -> Program:
    """``forward(x float32[x_shape]) -> op(x, w)``, ``w`` a prepacked float32 constant of
    ``w_shape`` (values ``rand_floats(seed=seed)``) with offload scheduled: the smallest program
    that has a resident weight, which every executor runs."""
    b = ProgramBuilder(metadata=metadata)
    n = 1
    for d in w_shape:
        n *= d
    w = b.constant("float32", w_shape, rand_floats(n, seed=seed))
    p = b.payload()
    x = p.input("float32", x_shape, "x")
    p.output(p.op(op, [x, p.prepack(p.constant(w, "w"))]))
    p.schedule_offload()
    m = b.method("forward")
    (y,) = m.delegate(p, [m.input("float32", x_shape, "x")])
    m.output(y)
    return b.build()


def sample_program() -> Program:
    """Two payloads on two backends, three methods sharing constants (prime-ish dims):

    - ``forward``: x[7,3] -> payload 0 (linear with prepacked w[5,3] and bias[5], relu) -> payload 1
      (softmax) -> [7,5]
    - ``decode``: x[7,3] -> payload 0 -> host ``add`` of the shared bias constant -> [7,5]
    - ``step``: kv_update of a cache input [1,2,11,3] (the updated cache is a fresh value id)
    """
    b = ProgramBuilder(metadata={"model": "sample", "dims": [7, 3, 5]})
    w = b.constant("float32", (5, 3), rand_floats(15, seed=1))
    bias = b.constant("float32", (5,), rand_floats(5, seed=2))

    p0 = b.payload()
    x = p0.input("float32", (7, 3), "x")
    wd = p0.prepack(p0.constant(w, "w"))
    bd = p0.prepack(p0.constant(bias, "bias"))
    y = p0.op("linear", [x, wd, bd])
    p0.output(p0.op("relu", [y]))
    p0.schedule_offload()

    p1 = b.payload("other")
    a = p1.input("float32", (7, 5))
    p1.output(p1.op("softmax", [a], {"dim": -1}))

    m = b.method("forward")
    (h,) = m.delegate(p0, [m.input("float32", (7, 3), "x")])
    (o,) = m.delegate(p1, [h])
    m.output(o)

    d = b.method("decode")
    (h,) = d.delegate(p0, [d.input("float32", (7, 3), "x")])
    d.output(d.op("add", [h, d.constant(bias)]))

    s = b.method("step")
    cache = s.input("float32", (1, 2, 11, 3), "cache")
    new = s.input("float32", (1, 2, 1, 3), "new")
    pos = s.input("int32", (1,), "pos")
    s.output(s.op("kv_update", [cache, new, pos]))
    return b.build()


def file_bytes(doc, data: bytes = b"", version: Optional[int] = None) -> bytes:
    """A program file around an arbitrary (possibly invalid) document and data segment, laid out
    exactly as the writer lays it out; for tests that hand-craft bad documents."""
    import msgpack

    from gpudelegate.program import FORMAT_VERSION, HEADER_SIZE, align_up, pack_header

    d = msgpack.packb(doc, use_bin_type=True)
    data_off = align_up(HEADER_SIZE + len(d))
    data = bytes(data) + bytes(align_up(len(data)) - len(data))
    header = pack_header(FORMAT_VERSION if version is None else version, d, len(data))
    return header + d + bytes(data_off - HEADER_SIZE - len(d)) + data


def split_file(buf: bytes):
    """(document, data segment bytes) of a valid program file."""
    import msgpack

    from gpudelegate.program import read_header

    _, doc_off, doc_size, data_off, data_size = read_header(buf)
    return msgpack.unpackb(buf[doc_off:doc_off + doc_size], raw=False), bytes(buf[data_off:data_off + data_size])


def reseal(raw) -> bytes:
    """Recompute the header's document digest after a test edited the document bytes in place, so
    the edit reaches the decoder instead of stopping at the checksum."""
    from gpudelegate.program import _HEADER, document_digest

    raw = bytearray(raw)
    fields = list(_HEADER.unpack_from(raw, 0))
    fields[7] = document_digest(bytes(raw[fields[3]:fields[3] + fields[4]]))
    _HEADER.pack_into(raw, 0, *fields)
    return bytes(raw)
