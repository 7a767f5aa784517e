"""What the planners produce and every executor carries out. Executors never re-plan.

A payload's values live in one of these *spaces*:

- ``arena``: a memory object of the memory plan (inputs, outputs, intermediates; lifetime reuse);
- ``resident``: a dedicated, prepacked constant buffer, shared by every payload of the session
  that reads the same (constant, layout);
- ``slot``: one slot of the offload ring, holding a streamed weight only while it is needed.

Constant values that are read directly by ops (not through a prepack entry) are treated as
prepacked with the identity layout: every constant an op reads gets a resident buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class DeviceLimits:
    """The limits a plan must honour. Executors report their device's; the reference executor
    reports WebGPU's defaults so CPU tests exercise the same splitting logic."""

    max_buffer_size: int = 1 << 30
    max_binding_size: int = 128 << 20  # maxStorageBufferBindingSize
    offset_alignment: int = 256  # minStorageBufferOffsetAlignment
    name: str = "generic"


@dataclass(frozen=True)
class BufferRef:
    space: str  # "arena" | "resident" | "slot"
    index: int  # memory object / resident buffer / slot index
    offset: int  # byte offset inside it
    nbytes: int


@dataclass
class MemoryPlan:
    objects: List[int]  # byte size of each arena memory object (one device buffer each)
    locations: Dict[int, BufferRef]  # value id -> arena location (aliases share one)
    arena_bytes: int  # sum of objects
    lower_bound: int  # max bytes live at once (no assignment can use less)


@dataclass
class ResidentBuffer:
    """One prepacked constant buffer: program constant ``constant`` in ``layout``."""

    constant: int
    layout: str
    dtype: str
    shape: Tuple[int, ...]
    nbytes: int  # bytes on the device (after packing)
    src_nbytes: int  # bytes in the program file


@dataclass
class PrepackPlan:
    buffers: List[ResidentBuffer]  # deduplicated across payloads and methods
    value_buffer: Dict[Tuple[int, int], int]  # (payload index, value id) -> index into buffers
    chunks: List[List[int]]  # groups of buffer indices, each at most chunk_bytes (a huge one alone)
    chunk_bytes: int


@dataclass
class OffloadLoad:
    """Copy streamed weight ``buffer`` (a ResidentBuffer index, kept in host memory) into ring
    ``slot``: issue it before node ``issue_before`` runs, and wait for it before ``needed_by``.

    The copy overwrites the slot's previous occupant, so it must also wait until the last node
    that read that occupant has run: ``reuse_after`` is that node of this payload, or -1 when the
    occupant was last read before this payload run started (wait for the work queued before it).
    ``last_use`` is the last node that reads this load (the slot is busy until it has run)."""

    buffer: int
    slot: int
    issue_before: int
    needed_by: int
    last_use: int = -1
    reuse_after: int = -1


@dataclass
class OffloadPlan:
    budget: int
    floor: int  # smallest budget that works with this prefetch depth
    depth: int  # prefetch depth k (loads in flight ahead of use)
    resident: List[int]  # buffer indices kept on the device
    streamed: List[int]  # buffer indices streamed through the ring
    slots: List[int]  # byte size of each ring slot (fixed: keeps CUDA graph capture possible)
    peak_bytes: int  # resident bytes + sum(slots) (<= budget)
    # Per payload: the loads in issue order. Dispatch args of streamed weights already point at
    # their slot (BufferRef space "slot"), so executors need nothing else.
    loads: Dict[int, List[OffloadLoad]] = field(default_factory=dict)
    # Per payload: bytes copied host -> device by one run (what the budget trades against).
    stream_bytes: Dict[int, int] = field(default_factory=dict)


@dataclass
class TensorRef:
    value: int
    dtype: str
    shape: Tuple[int, ...]
    buf: BufferRef


@dataclass
class Dispatch:
    node: int  # index into payload.nodes
    op: str
    attrs: dict
    args: List[Optional[TensorRef]]  # None for an absent optional argument
    outputs: List[TensorRef]


@dataclass
class PayloadPlan:
    payload: int  # index into program.payloads
    memory: MemoryPlan
    dispatches: List[Dispatch]
    inputs: List[TensorRef]
    outputs: List[TensorRef]


@dataclass
class SessionPlan:
    """Everything one session builds: the shared prepack plan and one plan per payload."""

    limits: DeviceLimits
    prepack: PrepackPlan
    payloads: Dict[int, PayloadPlan] = field(default_factory=dict)
    offload: Optional[OffloadPlan] = None  # one ring shared by all payloads; None = all resident
