"""Memory planning: where each activation of a payload lives in the arena.

Values that are neither weights (constants, prepack destinations and views of them, see
:mod:`.prepack`) nor absent get a place in the arena:

1. **Storages.** Aliasing ops (``ops.get(op).alias``: output 0 shares the storage of that
   argument, e.g. ``reshape`` and the in-place ``kv_update``) merge their output and that argument
   into one storage, whose lifetime is the union of its members'.
2. **Lifetimes**, in node time: payload inputs are live from before node 0 (time -1), a node's
   outputs from that node, payload outputs until after the last node (time ``len(nodes)``); a
   storage is live from its first definition to its last use, inclusive. Two storages live at
   the same node never share bytes (a node reads its inputs while writing its outputs). Five
   exceptions let an executor run neighbouring ops as one kernel (the WebGPU lowering does:
   ``epilogue_fusions``, ``sdpa_folds`` and sibling linears, decided in :mod:`.fusion`, whose
   ``fusion_lifetimes`` applies the same predicates here) without sharing bytes it still reads:
   the outputs of 2 or 3 linears reading one input with same-shaped weights start at the first
   of them;
   the output of a ``gelu`` or same-shaped ``add`` that is the only reader of the ``linear``
   right before it starts at the linear; the output of a ``[0, 2, 1, 3]`` permute that is the
   only reader of the ``sdpa`` right before it starts at the sdpa; and the input of a
   ``[0, 2, 1, 3]`` permute read only by an ``sdpa`` (as q, k or v) lives until that sdpa; and
   the operands of an ``add`` (or the input of an ``rms_norm``) whose normalized output a decode
   product takes as its prologue (``Fusion.norm``) live until that product runs.
3. **Assignment** by the greedy-by-size offset algorithm of TFLite's and ExecuTorch's memory
   planners: storages in decreasing size, each placed at the best-fitting aligned gap among the
   storages of the same memory object that overlap it in time. A memory object is one device
   buffer, so it may not grow past ``limits.max_buffer_size``: when it would, the next object is
   tried, then a new one is opened. Offsets are multiples of ``limits.offset_alignment`` so any
   tensor can be bound at its offset, including tensors larger than ``max_binding_size`` (the
   executors split those bindings; every piece then starts aligned too).

Sizes are reserved in multiples of 4 bytes, at least 4 (WebGPU bindings and buffer sizes are
4-byte multiples and never empty); ``lower_bound`` counts reserved bytes the same way, so
``arena_bytes >= lower_bound`` always holds and the gap is the fragmentation of the assignment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Dict, List, Optional

from .. import ops as _ops
from ..errors import DeviceError, PayloadError
from ..program import Payload
from .fusion import fusion_lifetimes
from .types import BufferRef, DeviceLimits, MemoryPlan

MIN_ALIGN = 4  # WebGPU: buffer sizes, binding offsets and sizes are multiples of 4


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class Storage:
    """One arena allocation: a value and every value aliasing it."""

    root: int
    members: List[int] = field(default_factory=list)
    size: int = 0  # reserved bytes: max member nbytes, rounded up to 4, at least 4
    start: int = 0  # first node time it is live (-1: before node 0)
    end: int = -1  # last node time it is live (len(nodes): after the last node)
    obj: int = -1
    offset: int = -1


class _UnionFind:
    def __init__(self):
        self.parent: Dict[int, int] = {}

    def find(self, x: int) -> int:
        p = self.parent.setdefault(x, x)
        if p != x:
            p = self.parent[x] = self.find(p)
        return p

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)  # the lower id (defined first) names the storage


def storages(payload: Payload, external: AbstractSet[int] = frozenset(), where: str = "payload") -> List[Storage]:
    """The arena storages of ``payload`` with their lifetimes (values in ``external`` excluded)."""
    n = len(payload.nodes)
    uf = _UnionFind()
    start: Dict[int, int] = {}
    end: Dict[int, int] = {}

    def define(v: int, t: int) -> None:
        start[v] = t
        end.setdefault(v, t)

    def use(v: int, t: int) -> None:
        end[v] = max(end.get(v, t), t)

    for v in payload.inputs:
        if v not in external:
            define(v, -1)
    for k, node in enumerate(payload.nodes):
        for j, a in enumerate(node.args):
            if a == -1 or a in external:
                continue
            if a not in start:
                raise PayloadError(f"{where}.ops[{k}].args[{j}]", f"value {a} is read before it is defined "
                                                                  f"(not an input, a weight or an earlier node's output)")
            use(a, k)
        for o in node.outputs:
            if o not in external:
                define(o, k)
        try:
            alias = _ops.get(node.op).alias
        except PayloadError as e:
            raise type(e)(f"{where}.ops[{k}].op", e.detail) from None
        if alias is not None and alias < len(node.args) and node.outputs:
            a, o = node.args[alias], node.outputs[0]
            if a != -1 and a not in external and o not in external:
                uf.union(a, o)
    for j, v in enumerate(payload.outputs):
        if v in external:
            continue
        if v not in start:
            raise PayloadError(f"{where}.outputs[{j}]", f"value {v} is never produced")
        use(v, n)
    early, late = fusion_lifetimes(payload)
    for o, k in early:
        if o in start and o not in external:
            start[o] = min(start[o], k)
    for v, k in late:
        if v in start and v not in external:
            use(v, k)

    by_root: Dict[int, Storage] = {}
    for v in sorted(start):
        r = uf.find(v)
        s = by_root.get(r)
        if s is None:
            s = by_root[r] = Storage(r, start=start[v], end=end[v])
        s.members.append(v)
        s.start = min(s.start, start[v])
        s.end = max(s.end, end[v])
        s.size = max(s.size, align_up(max(payload.values[v].nbytes, 1), MIN_ALIGN))
    return list(by_root.values())


def lower_bound(items: List[Storage]) -> int:
    """Max over node times of the reserved bytes live at that time."""
    delta: Dict[int, int] = {}
    for s in items:
        delta[s.start] = delta.get(s.start, 0) + s.size
        delta[s.end + 1] = delta.get(s.end + 1, 0) - s.size
    live = best = 0
    for t in sorted(delta):
        live += delta[t]
        best = max(best, live)
    return best


def _best_offset(placed: List[Storage], s: Storage, align: int) -> int:
    """Best-fit aligned offset for ``s`` among the ``placed`` storages overlapping it in time."""
    overlapping = sorted((p for p in placed if p.start <= s.end and s.start <= p.end), key=lambda p: p.offset)
    prev_end = 0
    best: Optional[int] = None
    best_gap = None
    for p in overlapping:
        cand = align_up(prev_end, align)
        gap = p.offset - cand
        if gap >= s.size and (best_gap is None or gap < best_gap):
            best, best_gap = cand, gap
        prev_end = max(prev_end, p.offset + p.size)
    return best if best is not None else align_up(prev_end, align)


def _describe(payload: Payload, s: Storage) -> str:
    v = payload.values[s.root]
    name = f" ({v.name})" if v.name else ""
    also = f" and its aliases {s.members[1:]}" if len(s.members) > 1 else ""
    return f"value {s.root}{name} {v.dtype}{list(v.shape)}{also}"


def check_limits(limits: DeviceLimits) -> None:
    for field_name in ("max_buffer_size", "max_binding_size", "offset_alignment", "weight_alignment"):
        x = getattr(limits, field_name)
        if not isinstance(x, int) or x <= 0:
            raise DeviceError(f"device limits {limits.name!r}: {field_name} must be a positive int, got {x!r}")


def assign(items: List[Storage], limits: DeviceLimits, payload: Payload, where: str = "payload") -> List[int]:
    """Place every storage (sets ``obj``/``offset``); returns the byte size of each memory object."""
    align = max(limits.offset_alignment, MIN_ALIGN)
    objects: List[List[Storage]] = []
    sizes: List[int] = []
    for s in sorted(items, key=lambda s: (-s.size, s.start, s.root)):
        if s.size > limits.max_buffer_size:
            raise DeviceError(f"{where}: {_describe(payload, s)} needs {s.size} bytes, more than the device's "
                              f"max_buffer_size of {limits.max_buffer_size} bytes ({limits.name}); no buffer can hold it")
        for oi, placed in enumerate(objects):
            off = _best_offset(placed, s, align)
            if off + s.size <= limits.max_buffer_size:
                break
        else:
            oi, off = len(objects), 0
            objects.append([])
            sizes.append(0)
        s.obj, s.offset = oi, off
        objects[oi].append(s)
        sizes[oi] = max(sizes[oi], off + s.size)
    return sizes


def plan_memory(payload: Payload, limits: DeviceLimits, external: AbstractSet[int] = frozenset(),
                where: str = "payload") -> MemoryPlan:
    """Lifetime-based arena plan of one payload. ``external`` are the weight values (they live in
    resident buffers or offload slots, not in the arena)."""
    check_limits(limits)
    items = storages(payload, external, where)
    sizes = assign(items, limits, payload, where)
    locations = {v: BufferRef("arena", s.obj, s.offset, payload.values[v].nbytes) for s in items for v in s.members}
    return MemoryPlan(objects=sizes, locations=locations, arena_bytes=sum(sizes), lower_bound=lower_bound(items))
