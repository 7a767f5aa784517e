"""Backends: what turns partitions into delegate payloads (ExecuTorch's ``BackendDetails``).

``to_backend`` calls each backend's :meth:`BackendDetails.preprocess_all` exactly once, with every
partition of every method it was given, so a backend can plan across methods: the gpudelegate
backend stores each constant once for all of them (prefill and decode read one copy of the
weights) and gives every payload its prepack entries and offload schedule.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from gpudelegate.errors import ExportError
from gpudelegate.program import Node, OffloadSchedule, Payload, PrepackEntry, Program, Value

from .frontend import ExportGraph, GValue
from .partitioner import Partition


@dataclass
class DelegateCandidate:
    """One partition as a backend receives it: a self-contained graph (its inputs are the values
    flowing in from the method, constants carry their data) plus where it came from."""

    method: str
    index: int  # position among the method's partitions
    partition: Partition
    graph: ExportGraph

    @property
    def compile_specs(self) -> Dict[str, Any]:
        return self.partition.compile_specs


class BackendDetails(abc.ABC):
    """A lowering target. ``preprocess_all`` gets ``{method: [candidate, ...]}`` for every method
    at once and returns ``{method: [payload, ...]}`` in the same order; it adds the constants it
    needs to ``program`` (``Program.add_constant`` keys them by content, so sharing is free)."""

    backend_id: str = "abstract"

    @abc.abstractmethod
    def preprocess_all(self, program: Program, candidates: Dict[str, List[DelegateCandidate]]) -> Dict[str, List[Payload]]:
        ...


# (op, arg index) pairs that read a weight that may be stored as float16 on the device. Ops
# compute in float32 whatever the storage, and the core infers float32 outputs for a float32
# activation with a float16 weight (embedding's output follows its weight: see _payload).
FP16_WEIGHT_ARGS = {("linear", 1), ("conv2d", 1), ("matmul", 1), ("embedding", 0)}
FP16_MAX = 65504.0
FP16_MIN_NUMEL = 64  # small constants (biases, norms, scalars) are not worth a pack kernel


class GpuDelegateBackend(BackendDetails):
    """The backend every gpudelegate executor runs (wgpu, browser WebGPU, CUDA, reference)."""

    backend_id = "gpudelegate"

    def __init__(self):
        self._const_index: Dict[tuple, int] = {}  # (id(GValue.data), fp16) -> program constant (hash each array once)

    def preprocess_all(self, program: Program, candidates: Dict[str, List[DelegateCandidate]]) -> Dict[str, List[Payload]]:
        # The cache is only valid for this program and while these graphs keep their arrays alive.
        self._const_index = {}
        out: Dict[str, List[Payload]] = {}
        for method, cands in candidates.items():
            out[method] = [self._payload(program, c) for c in cands]
        return out

    # ------------------------------------------------------------------ one payload
    def _constant(self, program: Program, v: GValue, as_fp16: bool = False) -> int:
        key = (id(v.data), as_fp16)
        if key not in self._const_index:
            if as_fp16:  # converted once at export: the file (and the browser download) halves
                data = np.array(v.data, dtype=np.float16, order="C")  # (keeps a 0-d constant 0-d)
                self._const_index[key] = program.add_constant("float16", v.shape, data)
            else:
                self._const_index[key] = program.add_constant(v.dtype, v.shape, v.data)
        return self._const_index[key]

    def _layout(self, c: DelegateCandidate, op: str, arg: int, v: GValue) -> str:
        if c.compile_specs.get("weights_dtype", "float32") != "float16":
            return "identity"
        if (op, arg) not in FP16_WEIGHT_ARGS or v.dtype != "float32" or v.data.size < FP16_MIN_NUMEL:
            return "identity"
        if not np.all(np.abs(v.data) <= FP16_MAX):  # would become inf: keep it float32
            return "identity"
        return "fp16"

    def _payload(self, program: Program, c: DelegateCandidate) -> Payload:
        g = c.graph
        values: List[Value] = []
        remap: Dict[int, int] = {}  # graph value id -> payload value id (computed values)
        src_of: Dict[int, int] = {}  # program constant -> payload source value
        dst_of: Dict[Tuple[int, str], int] = {}  # (program constant, layout) -> payload destination
        prepack: List[PrepackEntry] = []

        def computed(gid: int) -> int:
            if gid not in remap:
                gv = g.values[gid]
                values.append(Value(gv.dtype, gv.shape, name=gv.name))
                remap[gid] = len(values) - 1
            return remap[gid]

        fp16_in_file = c.compile_specs.get("fp16_at", "load") == "export"

        def prepacked(gid: int, layout: str) -> int:
            gv = g.values[gid]
            in_file = layout == "fp16" and fp16_in_file
            ci = self._constant(program, gv, as_fp16=in_file)
            if in_file:
                layout = "identity"  # already float16 in the file: a plain copy at load
            if ci not in src_of:
                values.append(Value("float16" if in_file else gv.dtype, gv.shape, constant=ci, name=gv.name))
                src_of[ci] = len(values) - 1
            if (ci, layout) not in dst_of:
                values.append(Value("float16" if layout == "fp16" or in_file else gv.dtype, gv.shape, name=gv.name))
                dst_of[(ci, layout)] = len(values) - 1
                prepack.append(PrepackEntry(src_of[ci], dst_of[(ci, layout)], layout))
            return dst_of[(ci, layout)]

        inputs = [computed(i) for i in g.inputs]
        nodes: List[Node] = []
        for n in g.nodes:
            args, fp16_embedding = [], False
            for j, a in enumerate(n.args):
                if a < 0:
                    args.append(-1)
                elif g.values[a].is_constant:
                    layout = self._layout(c, n.op, j, g.values[a])
                    fp16_embedding |= layout == "fp16" and n.op == "embedding"
                    args.append(prepacked(a, layout))
                else:
                    args.append(computed(a))
            outs = [computed(o) for o in n.outputs]
            if fp16_embedding:
                # embedding's output takes its weight's dtype: gather float16 rows, then widen them
                # to the float32 the rest of the graph was typed with.
                ov = values[outs[0]]
                values.append(Value("float16", ov.shape, name=ov.name + ".fp16"))
                nodes.append(Node("embedding", args, [len(values) - 1], dict(n.attrs)))
                nodes.append(Node("cast", [len(values) - 1], outs, {"dtype": ov.dtype}))
            else:
                nodes.append(Node(n.op, args, outs, dict(n.attrs)))
        outputs = [computed(o) for o in g.outputs]
        dsts = set(dst_of.values())
        reads = [list(dict.fromkeys(a for a in nd.args if a in dsts)) for nd in nodes]
        return Payload(values, inputs, outputs, nodes, backend=self.backend_id, prepack=prepack,
                       offload=OffloadSchedule(reads))


_REGISTRY: Dict[str, BackendDetails] = {}


def register_backend(backend: BackendDetails) -> None:
    """Make a backend available to ``to_backend`` under its ``backend_id``."""
    _REGISTRY[backend.backend_id] = backend


def get_backend(backend_id: str, overrides: Optional[Dict[str, BackendDetails]] = None) -> BackendDetails:
    if overrides and backend_id in overrides:
        return overrides[backend_id]
    if backend_id == GpuDelegateBackend.backend_id:
        return GpuDelegateBackend()  # fresh per lowering: its constant cache is per program
    if backend_id in _REGISTRY:
        return _REGISTRY[backend_id]
    known = sorted({GpuDelegateBackend.backend_id, *_REGISTRY, *(overrides or {})})
    raise ExportError(f"no backend {backend_id!r} is registered (known: {known})")
