"""The program's graphs: tensors (values), ops (nodes), payloads and methods, and the format
constants the decoder checks them against.

These are plain data, shared by the file reader and writer (:mod:`.program`), the document checks
(:mod:`.document`) and everything that builds or plans programs; :mod:`.program` re-exports every
name, so ``gpudelegate.program.Value`` and the rest keep working. They live apart from the
:class:`~gpudelegate.program.Program` file I/O so that the checks, which build these types, do not
import the module that calls them (no import cycle).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from . import dtypes as _dt

FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
ALIGN = 64  # constants start at multiples of this in the data segment (and the segment itself)

DELEGATE_OP = "delegate"
"""The op name of a method node that runs a payload (attrs: ``{"payload": index}``)."""


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def constant_key(dtype: str, shape, data) -> str:
    """SHA-256 of the bytes, salted with dtype and shape (same bytes, another view: another key)."""
    h = hashlib.sha256(_dt.byte_view(data))
    h.update(f"{dtype}{tuple(int(d) for d in shape)}".encode())
    return h.hexdigest()


@dataclass
class Constant:
    key: str  # SHA-256 hex of the bytes
    dtype: str
    shape: Tuple[int, ...]
    nbytes: int
    offset: int = 0  # in the data segment; assigned by the writer


@dataclass
class Value:
    dtype: str
    shape: Tuple[int, ...]
    constant: Optional[int] = None  # index into Program.constants
    name: str = ""

    @property
    def nbytes(self) -> int:
        return _dt.nbytes(self.dtype, self.shape)

    @property
    def numel(self) -> int:
        return _dt.numel(self.shape)


@dataclass
class Node:
    op: str
    args: List[int]  # value ids; -1 marks an absent optional argument
    outputs: List[int]
    attrs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class PrepackEntry:
    """Materialize constant value ``src`` into the dedicated device buffer of value ``dst`` once,
    before the first run. ``layout`` is ``identity`` (same dtype/shape/bytes: a plain copy) or
    ``fp16`` (float32 constant packed to float16 storage by a pack kernel)."""

    src: int
    dst: int
    layout: str = "identity"


@dataclass
class OffloadSchedule:
    """Which prepacked weights (``dst`` value ids) each node of the payload reads, in node order.
    Written by export; the runtime refuses a schedule that disagrees with the graph."""

    reads: List[List[int]]


@dataclass
class Graph:
    values: List[Value]
    inputs: List[int]
    outputs: List[int]
    nodes: List[Node]


@dataclass
class Payload(Graph):
    backend: str = "gpudelegate"
    prepack: List[PrepackEntry] = field(default_factory=list)
    offload: Optional[OffloadSchedule] = None


@dataclass
class Method(Graph):
    name: str = ""
