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
    # maxComputeWorkgroupStorageSize (bytes; WebGPU's default): the WGSL lowering picks tiles whose
    # workgroup arrays fit it (core/webgpu/ops_sgmat.py).
    max_workgroup_storage: int = 16384
    # Invocations one workgroup may have: the smaller of maxComputeInvocationsPerWorkgroup and
    # maxComputeWorkgroupSizeX (WebGPU's defaults: 256); tiles of more threads are chosen only
    # where the device allows them (core/webgpu/ops_sgmat.py).
    max_workgroup_invocations: int = 256
    # Start alignment of every weight (resident buffer, ring slot) in the weight block of the
    # layout plan (:mod:`.layout`), for executors that put all weights in one allocation: 16
    # bytes suits cuBLAS and 16-byte vector loads.
    weight_alignment: int = 16


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
    ``last_use`` is the last node that reads this load (the slot is busy until it has run).

    ``issue_before``, ``needed_by``, ``last_use`` and ``reuse_after`` are NODE ids (indices into
    ``payload.nodes``). ``at`` is where executors put the copy, as a POSITION in the payload
    plan's ``dispatches`` list: the copy is issued right before ``dispatches[at]`` (after
    ``dispatches[at - 1]``); ``at == len(dispatches)`` would mean after the last dispatch. It is
    the earliest position the plan allows, ``at = min{k : dispatches[k].node >= max(issue_before,
    reuse_after + 1)}`` (``len(dispatches)`` when no such k), computed once by the planner, which
    also checks ``dispatches[at].node <= needed_by`` (the copy comes before the dispatch that
    needs it). Loads are listed in non-decreasing ``at``; loads with one ``at`` are issued in
    list order."""

    buffer: int
    slot: int
    issue_before: int
    needed_by: int
    at: int
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
class Layout:
    """Byte offsets for executors that put each kind of memory in ONE allocation (CUDA: one arena,
    one weight block, one pinned host mirror), planned by :mod:`.layout`. Executors with one
    device buffer per memory object / weight (WebGPU) need none of it."""

    arena_alignment: int
    # (payload, memory object) -> byte offset of that memory object in the arena allocation
    arena: Dict[Tuple[int, int], int]
    arena_bytes: int
    weight_alignment: int
    # Resident buffers in weight-block order (buffers of one ``adjacent`` group consecutive).
    weight_order: List[int]
    resident: Dict[int, int]  # resident buffer index -> byte offset in the weight block
    slots: List[int]  # ring slot -> byte offset in the weight block (after every resident buffer)
    weight_bytes: int  # size of the weight block
    weight_padding: int  # alignment gaps in it: weight_bytes - resident bytes - ring bytes
    # Groups of resident buffers placed back to back with no gap (each starts where the previous
    # one ends), so that their concatenation is one tensor (a fused GEMM of sibling linears).
    adjacent: List[Tuple[int, ...]]
    mirror_alignment: int
    mirror: Dict[int, int]  # streamed buffer index -> byte offset in the host mirror
    mirror_bytes: int


@dataclass
class SessionPlan:
    """Everything one session builds: the shared prepack plan and one plan per payload."""

    limits: DeviceLimits
    prepack: PrepackPlan
    payloads: Dict[int, PayloadPlan] = field(default_factory=dict)
    offload: Optional[OffloadPlan] = None  # one ring shared by all payloads; None = all resident
    layout: Optional[Layout] = None  # single-allocation offsets (set by plan_session)
    # payload -> fusion.match's groups (fusion.Fusion), one decision every executor carries out
    # (each kernel set takes the kinds it has; the rest run apart). Set by plan_session.
    fusions: Dict[int, list] = field(default_factory=dict)
