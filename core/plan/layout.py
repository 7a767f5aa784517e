"""Layout planning: byte offsets for executors that use ONE allocation per kind of memory.

The memory plan (:mod:`.memory`) gives each payload's activations a few memory objects, the
prepack plan (:mod:`.prepack`) one buffer per weight, the offload plan (:mod:`.offload`) a ring of
slots. An executor that allocates each of them as a device buffer of its own (WebGPU) needs
nothing more. One that makes a single allocation per kind (CUDA: fewer, larger allocations, and
fixed addresses for graph capture) needs offsets inside it, decided here once, so that every such
executor places memory the same way and none of them packs its own:

- **arena**: every memory object of every payload, in payload order then object order, each
  start a multiple of ``limits.offset_alignment`` (any tensor of the memory plan starts at an
  offset that is a multiple of it inside its object, so it stays aligned in the arena);
- **weight block**: every resident buffer, then every ring slot, each start a multiple of
  ``limits.weight_alignment``. The groups of :func:`.fusion.cat_candidates` come first, each
  back to back: the weights of 2 or 3 bias-free linears reading one input, so that their
  concatenation is one tensor and the linears can run as one GEMM. A group whose buffers still
  end up apart (a size that is not a multiple of the alignment) is not listed in ``adjacent``,
  which is what the fusion step reads;
- **host mirror**: every streamed weight, each start a multiple of :data:`HOST_ALIGN`;
- **dequantization scratch**: where a linear reads a packed (GGUF block) weight with more than
  :data:`GEMV_MAX_ROWS` rows of input, the executor dequantizes the weight into scratch and runs a
  GEMM on it (fewer rows run a fused dequantizing GEMV that needs none). The scratch is one region
  at the end of the arena, after every memory object, keyed :data:`SCRATCH` in ``arena``, as large
  as the largest such weight in the activations' dtype (:func:`dequant_scratch_bytes`); a session
  without such linears has none.

Alignment gaps are counted (``weight_padding``): a weight budget counts weight bytes, and an
executor that caps its weight pool adds the padding on top.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from .. import dtypes as _dt
from ..errors import PlanError
from .fusion import cat_candidates
from .types import Layout, SessionPlan

HOST_ALIGN = 64
"""Start alignment of each streamed weight in the host mirror: a cache line, and the alignment
the program file gives constants, so host copies run on aligned bytes."""


GEMV_MAX_ROWS = 8
"""A linear over at most this many input rows reads a packed weight directly (a dequantizing
GEMV: the weight is read once for all rows); over more rows the weight is dequantized into the
scratch once per call and a GEMM runs on it."""

SCRATCH = (-1, 0)
"""Key of the dequantization scratch in ``Layout.arena`` (payload -1: it is no payload's memory
object). ``arena[SCRATCH]`` is its offset; it runs to ``arena_bytes``."""


def _float_itemsize(dtype: str) -> int:
    return _dt.itemsize(dtype) if dtype in _dt.FLOAT_DTYPES else 4


def dequant_scratch_bytes(plan: SessionPlan) -> int:
    """Bytes of the dequantization scratch: the largest packed linear weight read with more than
    GEMV_MAX_ROWS input rows, as [N, K] in its input's dtype. Sibling linears that the layout
    places back to back (``cat_candidates``) may run as one GEMM over their concatenated weight:
    such a group counts with the sum of its members."""
    groups = {b: gr for gr in cat_candidates(plan) for b in gr}
    vb = plan.prepack.value_buffer
    need = 0
    for p, pp in plan.payloads.items():
        per_group: Dict[tuple, int] = {}
        for d in pp.dispatches:
            if d.op != "linear" or len(d.args) < 2 or d.args[1] is None or not _dt.is_packed(d.args[1].dtype):
                continue
            x, w = d.args[0], d.args[1]
            rows = _dt.numel(x.shape[:-1])
            if rows <= GEMV_MAX_ROWS:
                continue
            n = _dt.numel(w.shape) * _float_itemsize(x.dtype)
            need = max(need, n)
            gr = groups.get(vb.get((p, w.value)))
            if gr is not None:
                key = (x.value, gr)
                per_group[key] = per_group.get(key, 0) + n
        need = max([need] + list(per_group.values()))
    return need


def pack_offsets(sizes: Sequence[int], align: int) -> Tuple[List[int], int]:
    """Offsets of consecutive regions of ``sizes`` bytes, each start ``align``-aligned; returns
    (offsets, total bytes). An empty region takes no bytes (it shares the next start)."""
    offs, off = [], 0
    for n in sizes:
        off = (off + align - 1) // align * align
        offs.append(off)
        off += int(n)
    return offs, off


def plan_layout(plan: SessionPlan) -> Layout:
    """The single-allocation layout of ``plan`` (see the module docstring)."""
    lim = plan.limits
    bufs = plan.prepack.buffers
    keys, sizes = [], []
    for p, pp in plan.payloads.items():
        for k, n in enumerate(pp.memory.objects):
            keys.append((p, k))
            sizes.append(n)
    scratch = dequant_scratch_bytes(plan)
    if scratch:
        keys.append(SCRATCH)
        sizes.append(scratch)
    arena_offs, arena_bytes = pack_offsets(sizes, lim.offset_alignment)

    off = plan.offload
    streamed = set(off.streamed) if off is not None else set()
    groups = [tuple(gr) for gr in cat_candidates(plan) if not set(gr) & streamed]
    grouped = [b for gr in groups for b in gr]
    if len(set(grouped)) != len(grouped):  # cat_candidates drops conflicting groups
        raise PlanError(f"layout: a weight buffer is in two groups to place back to back: {groups}")
    taken = streamed | set(grouped)
    order = grouped + [i for i in range(len(bufs)) if i not in taken]
    slot_sizes = list(off.slots) if off is not None else []
    w_offs, w_bytes = pack_offsets([bufs[i].nbytes for i in order] + slot_sizes, lim.weight_alignment)
    resident = dict(zip(order, w_offs[:len(order)]))
    raw = sum(bufs[i].nbytes for i in order) + sum(slot_sizes)
    adjacent = [gr for gr in groups if all(resident[a] + bufs[a].nbytes == resident[b] for a, b in zip(gr, gr[1:]))]

    mirror_ids = sorted(streamed)
    m_offs, m_bytes = pack_offsets([bufs[i].nbytes for i in mirror_ids], HOST_ALIGN)
    return Layout(arena_alignment=lim.offset_alignment, arena=dict(zip(keys, arena_offs)), arena_bytes=arena_bytes,
                  weight_alignment=lim.weight_alignment, weight_order=order, resident=resident,
                  slots=w_offs[len(order):], weight_bytes=w_bytes, weight_padding=w_bytes - raw, adjacent=adjacent,
                  mirror_alignment=HOST_ALIGN, mirror=dict(zip(mirror_ids, m_offs)), mirror_bytes=m_bytes)
