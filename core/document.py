"""Check a decoded program document and turn it into the fields of a
:class:`~gpudelegate.program.Program` (:func:`program_fields`; ``program.program_from_document``
builds the Program from them, :mod:`gpudelegate.validate` is the public entry point).

The document comes from a file we do not trust (a download, a cache in the browser, a half-written
export), so nothing here assumes a field exists, has the right type, or points somewhere valid.
Every check raises :class:`~gpudelegate.errors.PayloadError` whose path names the place in the
document (``methods.decode.ops[12].args[1]: value 999 out of range (0..311)``), and every size is
bounded *before* anything is allocated for it: shapes are only multiplied, never materialized.

What is checked, in document order:

- the top-level map, its version (== the header's, and supported) and ``metadata`` (plain msgpack);
- ``constants``: SHA-256 key (64 lowercase hex, unique), known dtype, shape (rank <= 8, dims >= 0),
  ``nbytes == itemsize * numel <= MAX_TENSOR_BYTES``, 64-aligned offsets inside the data segment,
  no overlaps, and a data segment exactly as long as the writer makes it (so flipped bits in the
  header's sizes cannot go unnoticed);
- every graph (payloads, then methods): values (dtype/shape, constant index in range and agreeing
  with the constant), inputs/outputs in range, and for every node: known op (``ops.get``), args in
  range or -1 and defined before use, outputs fresh (SSA: produced once, never a constant, a graph
  input or a prepack destination), attrs plain, and ``ops.infer`` equal to each declared output;
- ``delegate`` nodes (methods only): payload index in range, args/outputs matching the payload's
  inputs/outputs in count, dtype and shape;
- payloads: backend, prepack entries (constant source, fresh destination, layout-consistent dtype
  and shape, each destination once) and the offload schedule, which must list exactly the
  prepacked weights each node reads, in arg order, deduplicated (the runtime's cursor relies on it).

:func:`verify_constant_hashes` then checks the data segment itself (keys and zero padding).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from . import dtypes as _dt
from .errors import PayloadError
# The graph types, not .program: program.loads calls into this module, so this one must not
# import it back.
from .graph import (ALIGN, DELEGATE_OP, SUPPORTED_VERSIONS, Constant, Method, Node, OffloadSchedule, Payload,
                    PrepackEntry, Value, align_up, constant_key)

MAX_RANK = 8
MAX_TENSOR_BYTES = 1 << 40  # 1 TiB: far past any device, small enough that nothing overflows
MAX_ATTR_DEPTH = 4  # attrs are scalars or (nested) lists of them, e.g. pads, shapes, dims
MAX_METADATA_DEPTH = 32  # free-form, but must stay re-serializable (msgpack's nest limit is 511)
PREPACK_LAYOUTS = ("identity", "fp16")

_KEY = re.compile(r"[0-9a-f]{64}\Z")
_SCALARS = (type(None), bool, int, float, str)


# ------------------------------------------------------------------ small typed readers

def _brief(x: Any) -> str:
    """Describe a hostile value without repr-ing it whole (it may be huge or 1000 levels deep)."""
    if isinstance(x, (bool, int, float, type(None))):
        s = repr(x)
    elif isinstance(x, (str, bytes)):
        s = repr(x[:40]) + ("..." if len(x) > 40 else "")
    elif isinstance(x, (list, dict)):
        return f"a {type(x).__name__} of {len(x)}"
    else:
        return f"a {type(x).__name__}"
    return s if len(s) <= 60 else s[:57] + "..."


def _dict(x: Any, path: str, required: Sequence[str], optional: Sequence[str] = ()) -> dict:
    if type(x) is not dict:
        raise PayloadError(path, f"expected a map, got {_brief(x)}")
    for k in required:
        if k not in x:
            raise PayloadError(path, f"missing field {k!r}")
    allowed = set(required) | set(optional)
    for k in x:
        if k not in allowed:
            # An unknown field is refused rather than dropped: a newer writer must bump the version.
            raise PayloadError(path, f"unknown field {_brief(k)} (expected {', '.join(list(required) + list(optional))})")
    return x


def _list(x: Any, path: str) -> list:
    if type(x) is not list:
        raise PayloadError(path, f"expected a list, got {_brief(x)}")
    return x


def _int(x: Any, path: str, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    if type(x) is not int:  # bools are ints to isinstance; not here
        raise PayloadError(path, f"expected an integer, got {_brief(x)}")
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise PayloadError(path, f"{x} out of range ({rng})")
    return x


def _str(x: Any, path: str, nonempty: bool = True) -> str:
    if type(x) is not str:
        raise PayloadError(path, f"expected a string, got {_brief(x)}")
    if nonempty and not x:
        raise PayloadError(path, "empty string")
    return x


def _dtype(x: Any, path: str) -> str:
    _str(x, path)
    if x not in _dt.ITEMSIZE and x not in _dt.QUANT_BLOCKS:
        raise PayloadError(path, f"unknown dtype {_brief(x)} (known: {', '.join(_dt.STORAGE_DTYPES)})")
    return x


def _shape(x: Any, path: str) -> Tuple[int, ...]:
    _list(x, path)
    if len(x) > MAX_RANK:
        raise PayloadError(path, f"rank {len(x)} exceeds the maximum of {MAX_RANK}")
    return tuple(_int(d, f"{path}[{i}]", lo=0) for i, d in enumerate(x))


def _tensor_nbytes(dtype: str, shape: Tuple[int, ...], path: str) -> int:
    if _dt.is_packed(dtype) and _dt.packed_shape_error(dtype, shape):
        raise PayloadError(path, _dt.packed_shape_error(dtype, shape))
    n = _dt.nbytes(dtype, shape)  # Python ints: a product of 8 huge dims is just a big number
    if n > MAX_TENSOR_BYTES:
        raise PayloadError(path, f"{dtype}{list(shape)} is {n} bytes, over the {MAX_TENSOR_BYTES}-byte limit per tensor")
    return n


def _plain(x: Any, path: str, depth: int, max_depth: int, maps: bool) -> None:
    """Check ``x`` is plain msgpack data (scalars, lists, and maps if ``maps``) nested at most
    ``max_depth`` deep. Iterative, so a 1000-deep list cannot exhaust Python's stack."""
    stack = [(x, path, depth)]
    while stack:
        v, p, d = stack.pop()
        if isinstance(v, _SCALARS) or (maps and type(v) is bytes):
            continue
        if d >= max_depth:
            raise PayloadError(p, f"nested more than {max_depth} levels deep")
        if type(v) is list:
            stack.extend((e, f"{p}[{i}]", d + 1) for i, e in enumerate(v))
        elif maps and type(v) is dict:
            for k, e in v.items():
                if type(k) is not str:
                    raise PayloadError(p, f"map key {_brief(k)} is not a string")
                stack.append((e, f"{p}.{k}", d + 1))
        else:
            kinds = "nil, bool, int, float, str, bin, list or map" if maps else "nil, bool, int, float, str or list"
            raise PayloadError(p, f"{_brief(v)} is not plain data ({kinds})")


def _value_id(x: Any, path: str, n: int, absent_ok: bool = False) -> int:
    if type(x) is not int:
        raise PayloadError(path, f"expected a value id, got {_brief(x)}")
    if absent_ok and x == -1:
        return x
    if not 0 <= x < n:
        raise PayloadError(path, f"value {x} out of range (0..{n - 1})" if n else f"value {x} out of range (graph has no values)")
    return x


def _method_path(name: str) -> str:
    return f"methods.{name}" if name.isidentifier() else f"methods[{_brief(name)}]"


def _fmt(dtype: str, shape: Sequence[int]) -> str:
    return f"{dtype}{list(shape)}"


# ------------------------------------------------------------------ document parts

def _constants(doc: Any, data_size: int) -> List[Constant]:
    out: List[Constant] = []
    seen: Dict[str, int] = {}
    for i, c in enumerate(_list(doc, "constants")):
        p = f"constants[{i}]"
        _dict(c, p, ("key", "dtype", "shape", "nbytes", "offset"))
        key = _str(c["key"], f"{p}.key")
        if not _KEY.match(key):
            raise PayloadError(f"{p}.key", f"{_brief(key)} is not a SHA-256 hex digest (64 lowercase hex digits)")
        if key in seen:
            raise PayloadError(f"{p}.key", f"duplicate of constants[{seen[key]}] (constants are stored once)")
        seen[key] = i
        dtype = _dtype(c["dtype"], f"{p}.dtype")
        shape = _shape(c["shape"], f"{p}.shape")
        expect = _tensor_nbytes(dtype, shape, f"{p}.shape")
        nbytes = _int(c["nbytes"], f"{p}.nbytes", lo=0)
        if nbytes != expect:
            raise PayloadError(f"{p}.nbytes", f"{nbytes} but {_fmt(dtype, shape)} is {expect} bytes")
        offset = _int(c["offset"], f"{p}.offset", lo=0)
        if offset % ALIGN:
            raise PayloadError(f"{p}.offset", f"{offset} is not {ALIGN}-byte aligned")
        if offset + nbytes > data_size:
            raise PayloadError(f"{p}.offset", f"bytes [{offset}, {offset + nbytes}) run past the {data_size}-byte data segment")
        out.append(Constant(key, dtype, shape, nbytes, offset))

    # Overlaps: sort the non-empty ranges by offset and compare neighbours.
    spans = sorted((c.offset, i, c.offset + c.nbytes) for i, c in enumerate(out) if c.nbytes)
    for (a0, ai, a1), (b0, bi, b1) in zip(spans, spans[1:]):
        if b0 < a1:
            raise PayloadError(f"constants[{bi}].offset", f"bytes [{b0}, {b1}) overlap constants[{ai}] at [{a0}, {a1})")
    # The writer makes the segment exactly as long as its last (padded) constant; anything else
    # means the header's size or a constant's offset was damaged.
    end = align_up(max((c.offset + c.nbytes for c in out), default=0))
    if data_size != end:
        raise PayloadError("constants", f"the data segment is {data_size} bytes but the constants end at {end}")
    return out


def _values(doc: Any, path: str, constants: List[Constant]) -> List[Value]:
    out = []
    for i, v in enumerate(_list(doc, path)):
        p = f"{path}[{i}]"
        _dict(v, p, ("dtype", "shape"), ("constant", "name"))
        dtype = _dtype(v["dtype"], f"{p}.dtype")
        shape = _shape(v["shape"], f"{p}.shape")
        _tensor_nbytes(dtype, shape, f"{p}.shape")
        const = None
        if "constant" in v:
            const = _int(v["constant"], f"{p}.constant")
            if not 0 <= const < len(constants):
                raise PayloadError(f"{p}.constant", f"constant {const} out of range (0..{len(constants) - 1})"
                                   if constants else f"constant {const} out of range (the program has no constants)")
            c = constants[const]
            if (c.dtype, c.shape) != (dtype, shape):
                raise PayloadError(p, f"declared {_fmt(dtype, shape)} but constants[{const}] is {_fmt(c.dtype, c.shape)}")
        name = _str(v["name"], f"{p}.name", nonempty=False) if "name" in v else ""
        out.append(Value(dtype, shape, const, name))
    return out


def _ids(doc: Any, path: str, n: int) -> List[int]:
    return [_value_id(x, f"{path}[{i}]", n) for i, x in enumerate(_list(doc, path))]


def _graph_inputs(doc: Any, path: str, values: List[Value]) -> List[int]:
    ids = _ids(doc, path, len(values))
    seen: Set[int] = set()
    for i, vid in enumerate(ids):
        if vid in seen:
            raise PayloadError(f"{path}[{i}]", f"value {vid} is listed twice")
        if values[vid].constant is not None:
            raise PayloadError(f"{path}[{i}]", f"value {vid} is a constant and cannot be a graph input")
        if _dt.is_packed(values[vid].dtype):  # packed types are weights only: nothing feeds them at run time
            raise PayloadError(f"{path}[{i}]", f"value {vid} is {values[vid].dtype}, which only constants may be")
        seen.add(vid)
    return ids


def _prepack(doc: Any, path: str, values: List[Value], inputs: List[int]) -> List[PrepackEntry]:
    out = []
    dsts: Dict[int, int] = {}
    input_set = set(inputs)
    for i, e in enumerate(_list(doc, path)):
        p = f"{path}[{i}]"
        _dict(e, p, ("src", "dst"), ("layout",))
        src = _value_id(e["src"], f"{p}.src", len(values))
        dst = _value_id(e["dst"], f"{p}.dst", len(values))
        layout = _str(e.get("layout", "identity"), f"{p}.layout")
        if values[src].constant is None:
            raise PayloadError(f"{p}.src", f"value {src} is not a constant")
        if values[dst].constant is not None:
            raise PayloadError(f"{p}.dst", f"value {dst} is a constant (a destination is its own device buffer)")
        if dst in input_set:
            raise PayloadError(f"{p}.dst", f"value {dst} is a graph input")
        if dst in dsts:
            raise PayloadError(f"{p}.dst", f"value {dst} is already the destination of {path}[{dsts[dst]}]")
        s, d = values[src], values[dst]
        if layout == "identity":
            if (s.dtype, s.shape) != (d.dtype, d.shape):
                raise PayloadError(p, f"identity layout needs equal dtype and shape: src {_fmt(s.dtype, s.shape)}, dst {_fmt(d.dtype, d.shape)}")
        elif layout == "fp16":
            if s.dtype != "float32" or d.dtype != "float16" or s.shape != d.shape:
                raise PayloadError(p, f"fp16 layout packs float32 into float16 of the same shape: src {_fmt(s.dtype, s.shape)}, "
                                      f"dst {_fmt(d.dtype, d.shape)}")
        else:
            raise PayloadError(f"{p}.layout", f"unknown layout {_brief(layout)} (known: {', '.join(PREPACK_LAYOUTS)})")
        dsts[dst] = i
        out.append(PrepackEntry(src, dst, layout))
    return out


def _infer(ops, op: str, args: List[int], values: List[Value], attrs: dict, path: str) -> List[Tuple[str, Tuple[int, ...]]]:
    arg_values = [None if a == -1 else values[a] for a in args]
    try:
        inferred = ops.infer(op, arg_values, attrs)
        return [(dt, tuple(shape)) for dt, shape in inferred]
    except PayloadError as e:
        msg = str(e)
        raise type(e)(path, msg if op in msg else f"{op}: {msg}") from None
    except Exception as e:  # ops.infer rejects bad args/attrs with ValueError, but hostile attrs reach it too
        msg = str(e)
        msg = msg if len(msg) <= 300 else msg[:297] + "..."
        raise PayloadError(path, f"{op}: {type(e).__name__}: {msg}") from None


def _graph(doc: Any, path: str, constants: List[Constant], payloads: Optional[List[Payload]]) -> Tuple[list, list, list, list, list, Optional[OffloadSchedule]]:
    """Check one graph. ``payloads`` is None when checking a payload (no delegate nodes, may have
    prepack/offload) and the list of checked payloads when checking a method."""
    from . import ops  # lazy: ops imports program types; keep `import gpudelegate` cheap

    is_payload = payloads is None
    values = _values(doc["values"], f"{path}.values", constants)
    n = len(values)
    inputs = _graph_inputs(doc["inputs"], f"{path}.inputs", values)
    prepack = _prepack(doc["prepack"], f"{path}.prepack", values, inputs) if is_payload else []
    prepack_dst = {e.dst: i for i, e in enumerate(prepack)}

    # Weights: constants, prepack destinations and pure views (reshape) of them. They are
    # read-only buffers shared by every payload of a session (and, on the host, views of the file).
    weights = {i for i, v in enumerate(values) if v.constant is not None} | set(prepack_dst)
    input_set = set(inputs)
    defined = input_set | weights
    produced_by: Dict[int, int] = {}
    nodes: List[Node] = []
    for k, nd in enumerate(_list(doc["ops"], f"{path}.ops")):
        p = f"{path}.ops[{k}]"
        _dict(nd, p, ("op", "args", "outputs"), ("attrs",))
        op = _str(nd["op"], f"{p}.op")
        attrs = nd.get("attrs", {})
        if type(attrs) is not dict:
            raise PayloadError(f"{p}.attrs", f"expected a map, got {_brief(attrs)}")
        for name, a in attrs.items():
            if type(name) is not str:
                raise PayloadError(f"{p}.attrs", f"attribute name {_brief(name)} is not a string")
            _plain(a, f"{p}.attrs.{name}", 1, MAX_ATTR_DEPTH, maps=False)

        args = []
        for i, a in enumerate(_list(nd["args"], f"{p}.args")):
            a = _value_id(a, f"{p}.args[{i}]", n, absent_ok=op != DELEGATE_OP)
            if a != -1 and a not in defined:
                raise PayloadError(f"{p}.args[{i}]", f"value {a} is used before it is defined (not a graph input, "
                                                     f"constant, prepack destination or output of an earlier node)")
            args.append(a)
        outputs = []
        for i, o in enumerate(_list(nd["outputs"], f"{p}.outputs")):
            op_ = f"{p}.outputs[{i}]"
            o = _value_id(o, op_, n)
            if values[o].constant is not None:
                raise PayloadError(op_, f"value {o} is a constant and cannot be written")
            if o in prepack_dst:
                raise PayloadError(op_, f"value {o} is the destination of {path}.prepack[{prepack_dst[o]}]")
            if o in input_set:
                raise PayloadError(op_, f"value {o} is a graph input (an op that updates an input in place "
                                        f"still outputs a fresh value id)")
            if o in produced_by:
                raise PayloadError(op_, f"value {o} is already produced by {path}.ops[{produced_by[o]}] (values are assigned once)")
            produced_by[o] = k
            outputs.append(o)
        if not outputs:
            raise PayloadError(f"{p}.outputs", "a node must produce at least one value")

        if op == DELEGATE_OP:
            if is_payload:
                raise PayloadError(f"{p}.op", "'delegate' nodes are only allowed in methods, not inside a payload")
            _delegate(p, args, outputs, values, attrs, payloads)
        else:
            try:
                opdef = ops.get(op)
            except PayloadError as e:  # UnsupportedOpError: keep its type, add where
                raise type(e)(f"{p}.op", e.detail) from None
            a = opdef.alias
            if a is not None and a < len(args) and args[a] in weights:
                if opdef.max_args != 1:  # kv_update writes its other args into the aliased storage
                    raise PayloadError(f"{p}.args[{a}]", f"{op} would write in place into weight value {args[a]} "
                                                         f"(a constant or prepack destination); weights are read-only")
                weights.add(outputs[0])  # a pure view of a weight is a weight
            inferred = _infer(ops, op, args, values, attrs, p)
            if len(inferred) != len(outputs):
                raise PayloadError(f"{p}.outputs", f"{op} produces {len(inferred)} value(s), {len(outputs)} declared")
            for i, (o, (dt, shape)) in enumerate(zip(outputs, inferred)):
                v = values[o]
                if (v.dtype, v.shape) != (dt, shape):
                    raise PayloadError(f"{p}.outputs[{i}]", f"value {o} is declared {_fmt(v.dtype, v.shape)} but {op} "
                                                            f"infers {_fmt(dt, shape)}")
        defined.update(outputs)
        nodes.append(Node(op, args, outputs, attrs))

    outputs = _ids(doc["outputs"], f"{path}.outputs", n)
    for i, o in enumerate(outputs):
        if o not in defined:
            raise PayloadError(f"{path}.outputs[{i}]", f"value {o} is never produced")
        if _dt.is_packed(values[o].dtype):  # a caller gets float tensors back; blocks stay weights
            raise PayloadError(f"{path}.outputs[{i}]", f"value {o} is {values[o].dtype}, which only constants may be")

    offload = None
    if is_payload and "offload" in doc:
        offload = _offload(doc["offload"], f"{path}.offload", nodes, prepack_dst)
    return values, inputs, outputs, nodes, prepack, offload


def _delegate(p: str, args: List[int], outputs: List[int], values: List[Value], attrs: dict,
              payloads: List[Payload]) -> None:
    if "payload" not in attrs:
        raise PayloadError(f"{p}.attrs", "a delegate node needs attrs.payload")
    idx = attrs["payload"]
    if type(idx) is not int:
        raise PayloadError(f"{p}.attrs.payload", f"expected an integer, got {_brief(idx)}")
    if not 0 <= idx < len(payloads):
        raise PayloadError(f"{p}.attrs.payload", f"payload {idx} out of range (0..{len(payloads) - 1})"
                           if payloads else f"payload {idx} out of range (the program has no payloads)")
    pl = payloads[idx]
    for what, mine, theirs in (("args", args, pl.inputs), ("outputs", outputs, pl.outputs)):
        if len(mine) != len(theirs):
            side = "inputs" if what == "args" else "outputs"
            raise PayloadError(f"{p}.{what}", f"{len(mine)} given but payloads[{idx}] has {len(theirs)} {side}")
        for i, (a, b) in enumerate(zip(mine, theirs)):
            va, vb = values[a], pl.values[b]
            if (va.dtype, va.shape) != (vb.dtype, vb.shape):
                side = "inputs" if what == "args" else "outputs"
                raise PayloadError(f"{p}.{what}[{i}]", f"value {a} is {_fmt(va.dtype, va.shape)} but payloads[{idx}].{side}[{i}] "
                                                       f"is {_fmt(vb.dtype, vb.shape)}")


def _offload(doc: Any, path: str, nodes: List[Node], prepack_dst: Dict[int, int]) -> OffloadSchedule:
    _dict(doc, path, ("reads",))
    reads_doc = _list(doc["reads"], f"{path}.reads")
    if len(reads_doc) != len(nodes):
        raise PayloadError(f"{path}.reads", f"{len(reads_doc)} entries for {len(nodes)} nodes (one per node, in order)")
    reads = []
    for k, (r, nd) in enumerate(zip(reads_doc, nodes)):
        p = f"{path}.reads[{k}]"
        got = [_int(x, f"{p}[{i}]") for i, x in enumerate(_list(r, p))]
        want = list(dict.fromkeys(a for a in nd.args if a in prepack_dst))
        if got != want:
            # The runtime streams weights by walking this list with a cursor; any disagreement
            # would hand a node the wrong weight, so it is a hard error (as in the ExecuTorch seed).
            raise PayloadError(p, f"schedule says node {k} ({nd.op}) reads prepacked values {got}, "
                                  f"but its args read {want}")
        reads.append(got)
    return OffloadSchedule(reads)


# ------------------------------------------------------------------ entry points

def program_fields(doc: Any, data_size: int, header_version: int) -> Dict[str, Any]:
    """The keyword arguments of the typed Program for a decoded document (constants, payloads,
    methods, metadata, version), or PayloadError naming the path."""
    _dict(doc, "document", ("version", "constants", "payloads", "methods", "metadata"))
    version = _int(doc["version"], "version")
    if version not in SUPPORTED_VERSIONS:
        raise PayloadError("version", f"format version {version} is not supported (this build reads {list(SUPPORTED_VERSIONS)})")
    if version != header_version:
        raise PayloadError("version", f"{version} disagrees with the header's version {header_version}")
    metadata = doc["metadata"]
    if type(metadata) is not dict:
        raise PayloadError("metadata", f"expected a map, got {_brief(metadata)}")
    _plain(metadata, "metadata", 0, MAX_METADATA_DEPTH, maps=True)

    constants = _constants(doc["constants"], data_size)

    payloads: List[Payload] = []
    for i, pd in enumerate(_list(doc["payloads"], "payloads")):
        p = f"payloads[{i}]"
        _dict(pd, p, ("values", "inputs", "outputs", "ops", "backend", "prepack"), ("offload",))
        backend = _str(pd["backend"], f"{p}.backend")
        values, inputs, outputs, nodes, prepack, offload = _graph(pd, p, constants, None)
        payloads.append(Payload(values, inputs, outputs, nodes, backend=backend, prepack=prepack, offload=offload))

    methods: Dict[str, Method] = {}
    mdoc = doc["methods"]
    if type(mdoc) is not dict:
        raise PayloadError("methods", f"expected a map of name -> method, got {_brief(mdoc)}")
    for name, md in mdoc.items():
        if type(name) is not str or not name:
            raise PayloadError("methods", f"method name {_brief(name)} is not a non-empty string")
        p = _method_path(name)
        _dict(md, p, ("values", "inputs", "outputs", "ops"))
        values, inputs, outputs, nodes, _, _ = _graph(md, p, constants, payloads)
        methods[name] = Method(values, inputs, outputs, nodes, name=name)

    return dict(constants=constants, payloads=payloads, methods=methods, metadata=metadata, version=version)


def verify_constant_hashes(program) -> None:
    """Recompute every constant's key from ``program``'s bytes (a Program: its ``constants``,
    ``constant_bytes`` and ``data``), and check the padding between constants is zero, so that any
    bit flipped in the data segment is caught before a wrong weight runs."""
    for i, c in enumerate(program.constants):
        key = constant_key(c.dtype, c.shape, program.constant_bytes(i))
        if key != c.key:
            raise PayloadError(f"constants[{i}]", f"bytes at data[{c.offset}:{c.offset + c.nbytes}] hash to {key[:16]}... "
                                                  f"but the key is {c.key[:16]}... (corrupt data segment)")
    if program.data is None:
        return
    data = program.data
    pos = 0
    for off, end in sorted((c.offset, c.offset + c.nbytes) for c in program.constants if c.nbytes):
        if off > pos and data[pos:off].tobytes().count(0) != off - pos:
            raise PayloadError("data", f"padding bytes [{pos}, {off}) of the data segment are not zero (corrupt file)")
        pos = max(pos, end)
    if len(data) > pos and data[pos:].tobytes().count(0) != len(data) - pos:
        raise PayloadError("data", f"padding bytes [{pos}, {len(data)}) of the data segment are not zero (corrupt file)")
