"""Partitioners: which nodes of a method graph each backend takes (ExecuTorch's ``Partitioner``).

A partition is a set of node indices of one :class:`~.frontend.ExportGraph` tagged with a backend
id; ``to_backend`` replaces it with one ``delegate`` call. Nodes no partition takes stay in the
method graph and run on the host (the numpy reference kernels on desktop).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from gpudelegate import dtypes as _dt
from gpudelegate import ops as _ops
from gpudelegate.errors import ExportError

from .frontend import ExportGraph, GNode

# float16: stored half size on the device (compute stays float32); q4_0/q4_1/q8_0: GGUF blocks
# made at export from the float32 weights (18, 20, 34 bytes per 32 values: ~1/7, ~1/6, ~1/4 of float32).
WEIGHT_DTYPES = ("float32", "float16") + _dt.PACKED_DTYPES


def check_packed_weights(packed_weights: Any) -> Dict[str, Tuple[str, Any]]:
    """``{weight key: (packed dtype, blocks)}`` as given, or an ExportError saying what is wrong
    with it. Keys are :func:`gpudelegate.native.quant.weight_key` of the float32 weight the model
    holds; the blocks are checked against that weight when the backend meets it."""
    if packed_weights is None:
        return {}
    if not isinstance(packed_weights, Mapping):
        raise ExportError(f"packed_weights must be a dict {{weight_key(w): (dtype, blocks)}}, "
                          f"not {type(packed_weights).__name__}")
    for k, v in packed_weights.items():
        if not isinstance(k, str):
            raise ExportError(f"packed_weights: key {k!r} is not a str (weight_key(w) of the float32 weight)")
        if not (isinstance(v, (tuple, list)) and len(v) == 2 and v[0] in _dt.PACKED_DTYPES):
            raise ExportError(f"packed_weights[{k[:16]}...]: expected (dtype, blocks) with dtype one of "
                              f"{list(_dt.PACKED_DTYPES)}, got {type(v).__name__}"
                              + (f" with dtype {v[0]!r}" if isinstance(v, (tuple, list)) and v else ""))
    return dict(packed_weights)


@dataclass
class Partition:
    """Nodes (indices into the method graph, ascending) that one backend runs as one delegate call.
    ``compile_specs`` travel with the partition to the backend's ``preprocess_all``."""

    backend_id: str
    nodes: Tuple[int, ...]
    compile_specs: Dict[str, Any] = field(default_factory=dict)


class Partitioner(abc.ABC):
    """Decides which nodes of a method graph go to which backend."""

    @abc.abstractmethod
    def partition(self, graph: ExportGraph) -> List[Partition]:
        """Disjoint, convex node sets (no path leaves a partition and comes back into it)."""


def contiguous_runs(graph: ExportGraph, takes) -> List[Tuple[int, ...]]:
    """Maximal runs of consecutive nodes (in the graph's topological order) that ``takes(node)``
    accepts. A run of consecutive nodes is always convex, so it can become one delegate call."""
    runs: List[Tuple[int, ...]] = []
    cur: List[int] = []
    for i, n in enumerate(graph.nodes):
        if takes(n):
            cur.append(i)
        elif cur:
            runs.append(tuple(cur))
            cur = []
    if cur:
        runs.append(tuple(cur))
    return runs


class GpuDelegatePartitioner(Partitioner):
    """Takes every op the gpudelegate backend runs (the whole op set), as maximal runs.

    ``exclude_ops`` leaves named ops to the host (for ops a deployment wants on the CPU, or to test
    host fallback); ``weights_dtype="float16"`` asks the backend to store weights as float16 on the
    device (compute stays float32): packed by a prepack kernel from the float32 constants in the
    file (``fp16_at="load"``), or converted at export so the file holds float16 (``"export"``).
    ``weights_dtype="q4_0"``/``"q4_1"``/``"q8_0"`` quantizes the model parameters that linear
    (weight) and embedding (table) read into GGUF blocks at export (docs/OPS.md has which ones).
    ``packed_weights`` (``{weight_key(w): (dtype, blocks)}``) supplies blocks made elsewhere (a
    GGUF file's own), used for the float32 weights they dequantize to exactly."""

    backend_id = "gpudelegate"

    def __init__(self, weights_dtype: str = "float32", exclude_ops: Iterable[str] = (),
                 supported_ops: Optional[Iterable[str]] = None, fp16_at: str = "load",
                 packed_weights: Optional[Mapping[str, Tuple[str, Any]]] = None):
        if weights_dtype not in WEIGHT_DTYPES:
            raise ExportError(f"weights_dtype={weights_dtype!r}: expected one of {list(WEIGHT_DTYPES)}")
        self.packed_weights = check_packed_weights(packed_weights)
        if fp16_at not in ("load", "export"):
            raise ExportError(f"fp16_at={fp16_at!r}: expected 'load' (float32 in the file, packed on the device) "
                              f"or 'export' (float16 in the file: half the download)")
        self.weights_dtype = weights_dtype
        self.fp16_at = fp16_at
        self.supported = frozenset(supported_ops if supported_ops is not None else _ops.KERNEL_OPS)
        self.exclude = frozenset(exclude_ops)
        unknown = sorted(o for o in self.exclude | self.supported if o not in _ops.OP_NAMES)
        if unknown:
            raise ExportError(f"GpuDelegatePartitioner: unknown ops {unknown} (the op set is docs/OPS.md)")

    def supports(self, node: GNode) -> bool:
        return node.op in self.supported and node.op not in self.exclude

    def partition(self, graph: ExportGraph) -> List[Partition]:
        specs = {"weights_dtype": self.weights_dtype, "fp16_at": self.fp16_at, "packed_weights": self.packed_weights}
        return [Partition(self.backend_id, run, dict(specs)) for run in contiguous_runs(graph, self.supports)]


class NoPartitioner(Partitioner):
    """Takes nothing: the whole method runs on the host (a baseline, and for debugging)."""

    def partition(self, graph: ExportGraph) -> List[Partition]:
        return []
