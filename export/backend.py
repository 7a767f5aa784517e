"""Backends: what turns partitions into delegate payloads (ExecuTorch's ``BackendDetails``).

``to_backend`` calls each backend's :meth:`BackendDetails.preprocess_all` exactly once, with every
partition of every method it was given, so a backend can plan across methods: the gpudelegate
backend stores each constant once for all of them (prefill and decode read one copy of the
weights) and gives every payload its prepack entries and offload schedule. Per the partition's
compile specs it stores weights as float16, or as GGUF blocks (``weights_dtype`` q4_0/q4_1/q8_0
quantizes at export; ``packed_weights`` supplies blocks made elsewhere, checked bit for bit).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from gpudelegate import dtypes as _dt
from gpudelegate import ops as _ops
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
# Weights that may be stored as packed blocks: linear's [N, K] and embedding's [V, D] (the core's
# list). weights_dtype quantizes only parameters this large: a [2, 384] token-type table or a small
# classifier head is a rounding error of the file size, and 4 bits would cost it precision for nothing.
PACKED_WEIGHT_ARGS = frozenset(_ops.PACKED_WEIGHT_ARGS)
QUANT_MIN_NUMEL = 4096


class GpuDelegateBackend(BackendDetails):
    """The backend every gpudelegate executor runs (wgpu, browser WebGPU, CUDA, reference)."""

    backend_id = "gpudelegate"

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        # Caches valid for one program, while these graphs keep their arrays alive (ids stay unique).
        self._const_index: Dict[tuple, int] = {}  # (id(GValue.data), stored dtype) -> program constant
        self._packed: Dict[int, Optional[Tuple[str, np.ndarray]]] = {}  # id(GValue) -> (dtype, blocks) or None
        self._packable: Dict[int, bool] = {}  # id(GValue) -> every delegated read may take packed blocks
        self._keys: Dict[int, str] = {}  # id(GValue.data) -> weight_key
        self._quantized: Dict[Tuple[str, str], np.ndarray] = {}  # (weight_key, dtype) -> blocks
        self._verified: set = set()  # packed_weights keys whose blocks were checked against a weight
        self._used: set = set()  # packed_weights keys that found their weight
        self._unmarked: List[str] = []  # weights weights_dtype would quantize, were they marked parameters

    def preprocess_all(self, program: Program, candidates: Dict[str, List[DelegateCandidate]]) -> Dict[str, List[Payload]]:
        self._reset()
        for cands in candidates.values():
            for c in cands:
                self._note_reads(c.graph)
        out: Dict[str, List[Payload]] = {}
        for method, cands in candidates.items():
            out[method] = [self._payload(program, c) for c in cands]
        self._check_all_packed_used(candidates)
        self._check_something_quantized(candidates)
        return out

    # ------------------------------------------------------------------ packed weights
    def _note_reads(self, g: ExportGraph) -> None:
        """A weight is stored packed only if every delegated op that reads it takes packed blocks
        there: a tied weight read by linear and by matmul would otherwise be stored twice."""
        for n in g.nodes:
            for j, a in enumerate(n.args):
                if a >= 0 and g.values[a].is_constant:
                    key = id(g.values[a])
                    self._packable[key] = self._packable.get(key, True) and (n.op, j) in PACKED_WEIGHT_ARGS

    def _key(self, v: GValue) -> str:
        k = self._keys.get(id(v.data))
        if k is None:
            k = self._keys[id(v.data)] = _quant().weight_key(v.data)
        return k

    def _packed_storage(self, c: DelegateCandidate, v: GValue) -> Optional[Tuple[str, np.ndarray]]:
        """(packed dtype, blocks) when ``v`` is stored as GGUF blocks, else None; decided once per
        value, so every read of a tied weight gets the one constant."""
        if id(v) in self._packed:
            return self._packed[id(v)]
        got = None
        if v.dtype == "float32" and self._packable.get(id(v), False) and len(v.shape) == 2:
            given = c.compile_specs.get("packed_weights") or {}
            if given:
                got = self._given_blocks(given, v)
            wd = c.compile_specs.get("weights_dtype", "float32")
            if got is None and wd in _dt.PACKED_DTYPES and v.data.size >= QUANT_MIN_NUMEL \
                    and not _dt.packed_shape_error(wd, v.shape):
                if v.parameter:
                    key = (self._key(v), wd)
                    if key not in self._quantized:
                        self._quantized[key] = _quant().quantize(wd, v.data)
                    got = (wd, self._quantized[key])
                else:
                    self._unmarked.append(v.name or "(unnamed)")
        self._packed[id(v)] = got
        return got

    def _given_blocks(self, given: Dict[str, Tuple[str, Any]], v: GValue) -> Optional[Tuple[str, np.ndarray]]:
        key = self._key(v)
        if key not in given:
            return None
        dtype, raw = given[key]
        q = _quant()
        what = f"packed_weights: weight {v.name or '(unnamed)'!r} {v.dtype}{list(v.shape)}"
        blocks, why = q.as_blocks(dtype, raw, v.shape)
        if blocks is None:
            raise ExportError(f"{what}: {why}")
        if (key, dtype) not in self._verified:
            # The key says the weight's float32 content; the blocks must be exactly that content,
            # or the program would compute with different weights than the model it came from.
            why = q.mismatch(dtype, blocks, v.data)
            if why:
                raise ExportError(f"{what}: {why}")
            self._verified.add((key, dtype))
        self._used.add(key)
        return dtype, blocks

    def _check_all_packed_used(self, candidates: Dict[str, List[DelegateCandidate]]) -> None:
        """Blocks given for a weight no delegated linear/embedding reads would silently leave the
        file float32-sized: say so."""
        given: Dict[str, Tuple[str, Any]] = {}
        for cands in candidates.values():
            for c in cands:
                given.update(c.compile_specs.get("packed_weights") or {})
        unused = sorted(set(given) - self._used)
        if unused:
            raise ExportError(f"packed_weights: {len(unused)} of {len(given)} entries match no float32 weight that a "
                              f"delegated linear (weight) or embedding (table) reads and nothing else does (keys "
                              f"{', '.join(k[:12] + '...' for k in unused[:3])}{', ...' if len(unused) > 3 else ''}): "
                              f"a key is weight_key() of the float32 weight exactly as the model holds it")

    def _check_something_quantized(self, candidates: Dict[str, List[DelegateCandidate]]) -> None:
        """A graph lowered without its parameters marked (``lower`` called directly, a graph built
        by hand) would quietly export float32 under weights_dtype q4_0: say what is missing."""
        wds = {c.compile_specs.get("weights_dtype") for cands in candidates.values() for c in cands}
        if wds & set(_dt.PACKED_DTYPES) and not self._quantized and self._unmarked:
            names = ", ".join(repr(n) for n in self._unmarked[:3]) + (", ..." if len(self._unmarked) > 3 else "")
            raise ExportError(f"weights_dtype {sorted(wds & set(_dt.PACKED_DTYPES))}: {len(self._unmarked)} weights "
                              f"({names}) could be quantized but none is marked a model parameter; export_program marks "
                              f"them, a graph lowered by hand needs gpudelegate.export.lowering.mark_parameters(graph, "
                              f"exported_program) (or GValue.parameter = True)")

    # ------------------------------------------------------------------ one payload
    def _constant(self, program: Program, v: GValue, stored: str) -> int:
        """The program constant holding ``v`` stored as ``stored`` (its own dtype, float16
        converted at export, or a packed type)."""
        key = (id(v.data), stored)
        if key not in self._const_index:
            if _dt.is_packed(stored):
                self._const_index[key] = program.add_constant(stored, v.shape, self._packed[id(v)][1])
            elif stored == "float16" and v.dtype != "float16":  # converted once at export: the file halves
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
            # stored: the constant's dtype in the file; layout: what the prepack makes of it
            packed = self._packed_storage(c, gv)
            if packed is not None:
                stored, layout = packed[0], "identity"  # blocks are copied as they are
            elif layout == "fp16" and fp16_in_file:
                stored, layout = "float16", "identity"  # already float16 in the file: a plain copy at load
            else:
                stored = gv.dtype
            ci = self._constant(program, gv, stored)
            if ci not in src_of:
                values.append(Value(stored, gv.shape, constant=ci, name=gv.name))
                src_of[ci] = len(values) - 1
            if (ci, layout) not in dst_of:
                values.append(Value("float16" if layout == "fp16" else stored, gv.shape, name=gv.name))
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
                    arg = prepacked(a, self._layout(c, n.op, j, g.values[a]))
                    fp16_embedding |= n.op == "embedding" and j == 0 and values[arg].dtype == "float16" != g.values[a].dtype
                    args.append(arg)
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


def _quant():
    # native.quant needs numpy and gguf only when weights are packed: imported on first use.
    from gpudelegate.native import quant

    return quant


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
