"""torch.export frontend: an ExportedProgram in core ATen -> our graph form (:class:`ExportGraph`).

The graph form is the op set of docs/OPS.md over numbered tensor values, as in the program file,
except that constants still carry their data (numpy arrays in device storage form: bool as a
32-bit 0/1, int64 narrowed to int32) and every node remembers the ATen op and the user's stack
trace it came from, so the partitioner and error messages can point back at the model source.

Lowering walks the FX graph once, in order:

- parameters, buffers and lifted constants become *lazy* constants (torch tensors): one is written
  into the graph only when an emitted op reads it, so a weight transpose folded into ``linear``
  never stores the transposed copy;
- a node whose tensor inputs are all constants (``arange``, ``full``, mask building, a permuted
  weight, ...) is evaluated with torch at export time and becomes a lazy constant itself;
- every other node goes through the ATen table (:mod:`.aten_table`), whose handler emits op-set
  nodes. An op the table lacks raises :class:`~gpudelegate.errors.ExportError` naming the op, the
  node and the model source line that produced it.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from gpudelegate import ops as _ops
from gpudelegate.errors import ExportError, GpuDelegateError
from gpudelegate.program import Value

aten = torch.ops.aten

# Ops our op set has whole: keep them out of the default decompositions so they reach the table
# as one node (one kernel) instead of a chain of views, bmm and reductions.
KEEP_WHOLE = (
    aten.linear.default,
    aten.matmul.default,
    aten.scaled_dot_product_attention.default,
    aten.layer_norm.default,
    aten.rms_norm.default,
    aten.silu.default,
)

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def decomposition_table():
    """torch.export's default decompositions, minus the ops in :data:`KEEP_WHOLE`."""
    table = torch.export.default_decompositions()
    for op in KEEP_WHOLE:
        table.pop(op, None)
    return table


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
    return dtype, np.ascontiguousarray(a, dtype=_STORAGE[dtype])


# --------------------------------------------------------------------------------- graph form

@dataclass
class GValue:
    dtype: str
    shape: Tuple[int, ...]
    name: str = ""
    data: Optional[np.ndarray] = None  # constant data in storage form; None for computed values

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

# --------------------------------------------------------------------------------- driver

_CONSTANT_KINDS = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")
_IGNORED = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range", "sym_constrain_range_for_size",
            "_assert_async", "_print"}


def _is_ignored(target) -> bool:
    name = getattr(target, "__name__", "") or str(target)
    return name.split(".")[0] in _IGNORED


@contextlib.contextmanager
def _quiet_torch():
    # torch 2.13's own pytree code trips its LeafSpec deprecation warning on every export: noise
    # the user can do nothing about.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        yield


def lower(ep: "torch.export.ExportedProgram", name: str = "forward", decompose: bool = True) -> ExportGraph:
    """Lower an ExportedProgram (as ``torch.export.export`` returns it) to an :class:`ExportGraph`.
    ``decompose`` runs :func:`decomposition_table` first (pass False for an already-decomposed one)."""
    from .aten_table import TABLE

    if decompose:
        with _quiet_torch():
            ep = ep.run_decompositions(decomposition_table())
    L = Lowering(name)
    sig = ep.graph_signature
    state = dict(ep.state_dict)
    state.update(getattr(ep, "constants", {}) or {})
    specs = {s.arg.name: s for s in sig.input_specs}

    for node in ep.graph.nodes:
        L.node = node
        if node.op == "placeholder":
            spec = specs.get(node.name)
            kind = spec.kind.name if spec is not None else "USER_INPUT"
            if kind in _CONSTANT_KINDS:
                t = state.get(spec.target)
                if t is None:
                    raise L.fail(f"{kind.lower()} {spec.target!r} has no tensor in the exported program")
                L.env[node] = Const(t.detach(), name=spec.target)
            elif kind == "USER_INPUT":
                if not isinstance(node.meta.get("val"), torch.Tensor):
                    raise L.fail(f"input {node.name!r} is {type(node.meta.get('val')).__name__}: methods take tensors only")
                dt, sh = L.meta(node)
                vid = Vid(L.g.add_value(dt, sh, node.name))
                L.g.inputs.append(int(vid))
                L.env[node] = vid
            else:
                raise L.fail(f"input {node.name!r} of kind {kind} is not supported")
        elif node.op == "call_function":
            L.env[node] = _lower_call(L, node, TABLE)
        elif node.op == "output":
            _lower_outputs(L, node, sig)
        elif node.op == "get_attr":
            attr = getattr(ep.graph_module, node.target, None)
            if not isinstance(attr, torch.Tensor):
                raise L.fail(f"get_attr {node.target!r} is {type(attr).__name__}: control flow and submodules "
                             f"are not supported")
            L.env[node] = Const(attr.detach(), name=str(node.target))
        else:
            raise L.fail(f"FX node kind {node.op!r} is not supported")
    L.node = None
    return L.g


def _resolve(L: Lowering, x):
    return torch.fx.node.map_aggregate(x, lambda a: L.env[a] if isinstance(a, torch.fx.Node) else a)


def _lower_call(L: Lowering, node: torch.fx.Node, table) -> Any:
    if node.target is operator.getitem:
        src, idx = L.env[node.args[0]], node.args[1]
        if isinstance(src, (tuple, list)):
            item = src[idx]
            if item is None:
                raise L.fail(f"output {idx} of {node.args[0].target} is used, but only its output 0 is supported")
            return item
        raise L.fail(f"getitem on a single value ({type(src).__name__})")
    if _is_ignored(node.target):
        return None
    inputs = _flat_nodes((node.args, node.kwargs))
    if all(isinstance(L.env.get(n), Const) for n in inputs) and _foldable(node):
        return _fold(L, node)
    handler = table.get(node.target)
    if handler is None:
        raise L.fail("this op is not in the gpudelegate op set (docs/OPS.md) and the ATen table has no lowering "
                     "for it: add one to export/aten_table.py, or rewrite the model to avoid the op")
    args = _resolve(L, node.args)
    kwargs = _resolve(L, node.kwargs)
    try:
        return handler(L, bind_arguments(node.target, args, kwargs))
    except ExportError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise L.fail(f"could not lower ({type(e).__name__}: {e})") from e


_VIEW_OPS = {"permute", "t", "transpose", "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand",
             "_to_copy", "clone", "detach", "alias", "lift_fresh_copy"}


def _foldable(node: torch.fx.Node) -> bool:
    # Random ops must not be frozen into the program at export time.
    return not getattr(node.target, "is_nondeterministic", False) and "rand" not in str(node.target)


def _fold(L: Lowering, node: torch.fx.Node):
    """Evaluate a node whose tensor inputs are all constants with torch (export-time folding)."""
    unwrap = lambda x: torch.fx.node.map_aggregate(x, lambda a: L.env[a].tensor if isinstance(a, torch.fx.Node) else a)
    try:
        out = node.target(*unwrap(node.args), **unwrap(node.kwargs))
    except Exception as e:
        raise L.fail(f"constant folding failed ({type(e).__name__}: {e})") from e
    if "empty" in str(node.target) and isinstance(out, torch.Tensor):
        out = torch.zeros_like(out)  # uninitialized memory must not become a (nondeterministic) constant
    if isinstance(out, torch.Tensor):
        # A view of one named constant (a transposed or reshaped weight) keeps that name.
        srcs = [L.env[n] for n in _flat_nodes((node.args, node.kwargs))]
        name = srcs[0].name if len(srcs) == 1 and str(node.target).split(".")[1] in _VIEW_OPS else node.name
        return Const(out.detach(), name=name)
    if isinstance(out, (tuple, list)):
        return tuple(Const(o.detach(), name=f"{node.name}.{i}") if isinstance(o, torch.Tensor) else None
                     for i, o in enumerate(out))
    raise L.fail(f"constant folding produced {type(out).__name__}, not a tensor")


def _lower_outputs(L: Lowering, node: torch.fx.Node, sig) -> None:
    outs = node.args[0]
    specs = list(sig.output_specs)
    for i, o in enumerate(outs):
        kind = specs[i].kind.name if i < len(specs) else "USER_OUTPUT"
        if kind != "USER_OUTPUT":
            raise L.fail(f"output {i} is a {kind} (the model mutates a buffer or input in place): pass state "
                         f"such as a KV cache as a method input and return the updated tensor instead")
        if not isinstance(o, torch.fx.Node):
            raise L.fail(f"output {i} is the python value {o!r}, not a tensor")
        e = L.env[o]
        vid = L.value(e)
        # Every method output is computed by a node: an output that is a constant or a method input
        # gets a copy, so executors never have to return a constant buffer or alias an input.
        if L.g.values[vid].is_constant or vid in L.g.inputs:
            L.node = o if o.op != "placeholder" else node
            vid = L.emit("copy", [vid], {}, L.dtype(vid), L.shape(vid), name=o.name)
        L.g.outputs.append(int(vid))


def export_method(module: torch.nn.Module, example_inputs: Sequence, strict: bool = False) -> "torch.export.ExportedProgram":
    """``torch.export.export`` with the checks that give a clear error up front."""
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise ExportError(f"example_inputs[{i}] is {type(x).__name__}: methods take tensors only")
    module = module.eval() if isinstance(module, torch.nn.Module) else module
    try:
        with _quiet_torch():
            return torch.export.export(module, tuple(example_inputs), strict=strict)
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"torch.export failed for {type(module).__name__}: {type(e).__name__}: {e}") from e
