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
from typing import Any, Sequence

import torch

from gpudelegate.errors import ExportError

from .aten_table import TABLE
# The graph form and the lowering context live in .lowering (which the ATen table imports, so
# that the table never imports this module back); re-exported here, where they always were.
from .lowering import (Const, ExportGraph, GNode, GValue, Lowering, Vid, bind_arguments, constant_array,  # noqa: F401
                       mark_parameters,
                       program_dtype, _flat_nodes)

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


def decomposition_table():
    """torch.export's default decompositions, minus the ops in :data:`KEEP_WHOLE`."""
    table = torch.export.default_decompositions()
    for op in KEEP_WHOLE:
        table.pop(op, None)
    return table


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
    # which constants are parameters: weights_dtype q4_0/q4_1/q8_0 quantizes those, never buffers
    return mark_parameters(L.g, ep)


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
        # A handler bug, not the model's: name the op and what it was given, not only the Python error.
        shapes = [list(L.entry_shape(x)) if isinstance(x, (Vid, Const)) else x for x in args
                  if not isinstance(x, (list, tuple))]
        raise L.fail(f"the lowering of this op failed on arguments {shapes} ({type(e).__name__}: {e}); this is "
                     f"a bug in export/aten_table.py, please report it with the model") from e


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
