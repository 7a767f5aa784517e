"""The graph form of an export (:class:`ExportGraph`) and the lowering context ATen handlers emit
into (:class:`Lowering`, with :class:`Vid` and the lazy :class:`Const`).

These are what :mod:`.aten_table` (the handlers) and :mod:`.frontend` (the FX walk that calls
them) share; they live apart from both so that the frontend imports the table and the table
imports this module, never the frontend: no import cycle. :mod:`.frontend` re-exports every name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from gpudelegate import ops as _ops
from gpudelegate.errors import ExportError, GpuDelegateError
from gpudelegate.program import Value

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def program_dtype(dt: torch.dtype, where: str = "") -> str:
    """The program dtype that stores a torch dtype. Narrowing/widening rules (docs/OPS.md): float64
    and bfloat16 compute as float32, every integer type as int32 (range-checked for constants)."""
    if dt in (torch.float32, torch.float64, torch.bfloat16):
        return "float32"
    if dt == torch.float16:
        return "float16"
    if dt == torch.bool:
        return "bool"
    if dt in _INT_DTYPES:
        return "int32"
    raise ExportError(f"{where}: dtype {dt} has no program dtype (supported: float32/64, bfloat16, float16, "
                      f"integers, bool)" if where else f"dtype {dt} has no program dtype")


_STORAGE = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "bool": np.uint32}


def constant_array(t: torch.Tensor, where: str, dtype: Optional[str] = None) -> Tuple[str, np.ndarray]:
    """A torch tensor as (program dtype, C-contiguous numpy array in device storage form)."""
    dtype = dtype or program_dtype(t.dtype, where)
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    a = t.contiguous().numpy()
    if dtype == "int32":
        if a.dtype.kind == "f":
            a = np.trunc(a)
        if a.size and (a.min() < -2**31 or a.max() >= 2**31):
            raise ExportError(f"{where}: integer constant has values in [{a.min()}, {a.max()}], outside int32 "
                              f"(programs store integers as int32)")
    elif dtype == "bool":
        a = a != 0
    # np.array(order="C"), not ascontiguousarray: that one turns a 0-d constant into shape [1]
    return dtype, np.array(a, dtype=_STORAGE[dtype], order="C")


# --------------------------------------------------------------------------------- graph form

@dataclass
class GValue:
    dtype: str
    shape: Tuple[int, ...]
    name: str = ""
    data: Optional[np.ndarray] = None  # constant data in storage form; None for computed values
    # A model parameter (torch.export's graph signature), or a view of one folded at export: what
    # weights_dtype may quantize. Buffers (rope tables, masks) and folded results stay as they are.
    parameter: bool = False

    @property
    def is_constant(self) -> bool:
        return self.data is not None

    @property
    def nbytes(self) -> int:
        return Value(self.dtype, self.shape).nbytes


@dataclass
class GNode:
    op: str  # a docs/OPS.md op name
    args: List[int]  # value ids, -1 = absent optional argument
    outputs: List[int]
    attrs: Dict[str, Any] = field(default_factory=dict)
    origin: str = ""  # the ATen op and FX node it was lowered from, e.g. "aten.addmm.default (addmm_1)"
    stack_trace: str = ""


@dataclass
class ExportGraph:
    """One method in the op set, before partitioning. Values are tensors; constants carry data."""

    name: str = "forward"
    values: List[GValue] = field(default_factory=list)
    inputs: List[int] = field(default_factory=list)
    outputs: List[int] = field(default_factory=list)
    nodes: List[GNode] = field(default_factory=list)

    def add_value(self, dtype: str, shape, name: str = "", data: Optional[np.ndarray] = None) -> int:
        self.values.append(GValue(dtype, tuple(int(d) for d in shape), name, data))
        return len(self.values) - 1

    def producers(self) -> Dict[int, int]:
        """value id -> index of the node that computes it."""
        return {o: i for i, n in enumerate(self.nodes) for o in n.outputs}

    def consumers(self) -> Dict[int, List[int]]:
        """value id -> indices of the nodes that read it (in node order)."""
        out: Dict[int, List[int]] = {}
        for i, n in enumerate(self.nodes):
            for a in n.args:
                if a >= 0:
                    out.setdefault(a, []).append(i)
        return out

    @property
    def constant_bytes(self) -> int:
        return sum(v.nbytes for v in self.values if v.is_constant)

    def summary(self) -> str:
        from collections import Counter
        c = Counter(n.op for n in self.nodes)
        return f"{self.name}: {len(self.nodes)} nodes ({', '.join(f'{k} x{v}' for k, v in c.most_common())})"


def mark_parameters(g: ExportGraph, ep: "torch.export.ExportedProgram") -> ExportGraph:
    """Flag the constants of ``g`` (lowered from ``ep``) that are model parameters. Constants are
    named after their state-dict target (a folded view of one keeps that name), and torch.export's
    graph signature says which targets are parameters, as opposed to buffers and lifted tensors."""
    params = set(ep.graph_signature.parameters)
    for v in g.values:
        if v.is_constant and v.name in params:
            v.parameter = True
    return g


# --------------------------------------------------------------------------------- lowering

class Vid(int):
    """A value id inside lowering, distinct from a python ``int`` argument (``add.Tensor(x, 2)``
    passes the scalar 2; an FX tensor argument resolves to a Vid)."""


@dataclass(eq=False)
class Const:
    """A lazy constant: a torch tensor written into the graph only when an emitted op reads it."""

    tensor: torch.Tensor
    name: str = ""


def _short_trace(trace: Optional[str], lines: int = 8) -> str:
    if not trace:
        return "(no stack trace recorded for this node)"
    parts = [ln for ln in trace.strip().splitlines() if ln.strip()]
    return "\n".join(parts[-lines:])


def _flat_nodes(x) -> List[torch.fx.Node]:
    out: List[torch.fx.Node] = []
    torch.fx.node.map_arg(x, lambda n: out.append(n))
    return out


def bind_arguments(target, args: Sequence, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Name every argument of an ATen call after its schema, defaults filled in, so table
    handlers read ``a["stride"]`` whether the graph passed it positionally, by keyword or not at all."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    bound: Dict[str, Any] = {}
    for i, sa in enumerate(schema.arguments):
        if i < len(args) and not sa.kwarg_only:
            bound[sa.name] = args[i]
        elif sa.name in kwargs:
            bound[sa.name] = kwargs[sa.name]
        elif sa.has_default_value():
            bound[sa.name] = sa.default_value
        else:
            bound[sa.name] = None
    return bound


class Lowering:
    """Builds one :class:`ExportGraph` from one ExportedProgram. ATen table handlers call
    ``value``/``emit``/``scalar``/... on it while ``node`` is the FX node being lowered."""

    def __init__(self, name: str):
        self.g = ExportGraph(name=name)
        self.env: Dict[torch.fx.Node, Any] = {}
        self.node: Optional[torch.fx.Node] = None
        self._const_vids: Dict[Tuple[int, str], int] = {}
        self._keepalive: List[Const] = []  # ids in _const_vids stay unique while lowering

    # ----------------------------------------------------------------- errors and metadata
    @property
    def where(self) -> str:
        n = self.node
        return f"{self.g.name}: {n.target} (node {n.name})" if n is not None else self.g.name

    def fail(self, message: str) -> ExportError:
        """An ExportError for the current node: names the op, the node and the model source."""
        trace = _short_trace(self.node.meta.get("stack_trace")) if self.node is not None else ""
        return ExportError(f"{self.where}: {message}\n  model source:\n    " + trace.replace("\n", "\n    "))

    def meta(self, node: Optional[torch.fx.Node] = None, index: Optional[int] = None) -> Tuple[str, Tuple[int, ...]]:
        """(program dtype, static shape) of an FX node's output (``index`` for multi-output ops)."""
        node = node if node is not None else self.node
        val = node.meta.get("val")
        if index is not None:
            val = val[index]
        if not isinstance(val, torch.Tensor):
            raise self.fail(f"output is {type(val).__name__}, not a tensor (only tensor values are supported)")
        shape = []
        for d in val.shape:
            if not isinstance(d, int):
                raise self.fail(f"dynamic dimension {d} in shape {list(val.shape)}: programs have static shapes; "
                                f"export with concrete example inputs and no dynamic_shapes")
            shape.append(d)
        return program_dtype(val.dtype, self.where), tuple(shape)

    # ----------------------------------------------------------------- values
    def dtype(self, vid: int) -> str:
        return self.g.values[vid].dtype

    def shape(self, vid: int) -> Tuple[int, ...]:
        return self.g.values[vid].shape

    def entry_dtype(self, e) -> str:
        return program_dtype(e.tensor.dtype, self.where) if isinstance(e, Const) else self.dtype(e)

    def entry_shape(self, e) -> Tuple[int, ...]:
        return tuple(e.tensor.shape) if isinstance(e, Const) else self.shape(e)

    def value(self, e, dtype: Optional[str] = None) -> int:
        """The value id of a handler argument (materializing a lazy constant); with ``dtype``,
        converted to it (constants at export time, computed values by a ``cast`` node)."""
        if isinstance(e, Vid):
            if dtype is not None and self.dtype(e) != dtype:
                return self.emit("cast", [e], {"dtype": dtype}, dtype, self.shape(e))
            return e
        if isinstance(e, (bool, int, float)):
            return self.scalar(e, dtype or ("bool" if isinstance(e, bool) else "int32" if isinstance(e, int) else "float32"))
        if isinstance(e, Const):
            dt = dtype or program_dtype(e.tensor.dtype, self.where)
            key = (id(e), dt)
            if key not in self._const_vids:
                _, data = constant_array(e.tensor, f"{self.where}: constant {e.name or 'tensor'}", dt)
                self._const_vids[key] = Vid(self.g.add_value(dt, data.shape, e.name, data))
                self._keepalive.append(e)
            return self._const_vids[key]
        raise self.fail(f"expected a tensor argument, got {type(e).__name__} {e!r}")

    def scalar(self, x, dtype: str) -> int:
        """A 0-d constant holding a python scalar (``add.Tensor(x, 2.0)`` reads ``2.0`` through this)."""
        return self.value(Const(torch.tensor(x, dtype=_TORCH_DTYPE[dtype]), name=f"scalar {x}"), dtype)

    def emit(self, op: str, args: List[Any], attrs: Optional[dict], dtype: str, shape, name: str = "") -> Vid:
        """Append one op-set node (every op of the set has one output); returns its output value id.
        ``args`` may hold value ids, lazy constants, python scalars or None (absent optional)."""
        arg_ids = [-1 if a is None else int(self.value(a)) for a in args]
        while arg_ids and arg_ids[-1] == -1:  # absent trailing optionals are left out, not marked
            arg_ids.pop()
        out = Vid(self.g.add_value(dtype, shape, name or (self.node.name if self.node is not None else op)))
        origin = f"{self.node.target} ({self.node.name})" if self.node is not None else ""
        trace = self.node.meta.get("stack_trace", "") if self.node is not None else ""
        gn = GNode(op, arg_ids, [int(out)], dict(attrs or {}), origin, trace or "")
        self._check_inference(gn)
        self.g.nodes.append(gn)
        return out

    def _check_inference(self, gn: GNode) -> None:
        """Hold the table to the core's shape/dtype inference: a disagreement here would otherwise
        surface as a PayloadError at load time, far from its cause."""
        arg_values = [None if a < 0 else Value(self.g.values[a].dtype, self.g.values[a].shape) for a in gn.args]
        try:
            inferred = _ops.infer(gn.op, arg_values, gn.attrs)
        except GpuDelegateError as e:
            raise self.fail(f"lowered to {gn.op}{gn.attrs}, which the core rejects: {e}") from None
        expected = [(self.g.values[o].dtype, self.g.values[o].shape) for o in gn.outputs]
        got = [(d, tuple(s)) for d, s in inferred]
        if got != expected:
            raise self.fail(f"lowered to {gn.op}{gn.attrs}: the core infers {got}, torch says {expected}")

    def reshape(self, e, shape, dtype: Optional[str] = None) -> int:
        vid = self.value(e, dtype)
        if tuple(shape) == self.shape(vid):
            return vid
        return self.emit("reshape", [vid], {"shape": [int(d) for d in shape]}, self.dtype(vid), shape)


_TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "int32": torch.int32, "bool": torch.bool}
