"""Planning: what a session builds, computed once from the program and the device's limits.

``plan_session`` runs the three planners over every payload the session's methods call and
joins their answers into one :class:`~gpudelegate.plan.types.SessionPlan`:

- :mod:`.prepack`: the resident constant buffers, deduplicated across payloads and methods;
- :mod:`.memory`: per payload, the arena (lifetime-based reuse within the device's limits);
- :mod:`.offload`: with a weight budget, which weights stay resident and how the rest stream
  through a fixed ring of slots;

then lists, per payload, the dispatches with every tensor resolved to where it lives (arena,
resident buffer or ring slot), checks the offload schedule against them
(:func:`.offload.check_loads`), and lays everything out for executors that use one allocation
per kind of memory (:mod:`.layout`). Executors carry this out and never re-plan.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Set

from ..errors import BudgetError, DeviceError, InputError, PayloadError
from .. import ops
from ..program import DELEGATE_OP, Program
from .memory import check_limits, plan_memory
from .fusion import match
from .layout import plan_layout
from .offload import check_loads, plan_offload, slot_reads
from .prepack import PayloadWeights, plan_prepack
from .types import (BufferRef, DeviceLimits, Dispatch, Layout, MemoryPlan, OffloadPlan, PayloadPlan, PrepackPlan,
                    SessionPlan, TensorRef)

__all__ = ["plan_session", "payloads_of", "DeviceLimits", "SessionPlan", "PayloadPlan", "MemoryPlan",
           "PrepackPlan", "OffloadPlan", "Layout"]


def payloads_of(program: Program, methods: Optional[Iterable[str]] = None) -> List[int]:
    """Indices of the payloads called by ``methods`` (all methods when None), in first-call order."""
    names = list(program.methods) if methods is None else list(methods)
    out: List[int] = []
    for name in names:
        m = program.methods.get(name)
        if m is None:
            raise InputError(f"method {name!r} is not in the program (it has: {', '.join(program.methods) or 'none'})")
        for k, node in enumerate(m.nodes):
            if node.op != DELEGATE_OP:
                continue
            p = node.attrs.get("payload") if isinstance(node.attrs, dict) else None
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < len(program.payloads):
                raise PayloadError(f"methods.{name}.ops[{k}].attrs.payload",
                                   f"{p!r} is not a payload index (0..{len(program.payloads) - 1})")
            if p not in out:
                out.append(p)
    return out


def _schedule_reads(program: Program, p: int, pw: PayloadWeights) -> List[List[int]]:
    """Per node, the buffers it reads. The payload's offload schedule, when present, must list
    exactly the prepacked weights each node reads, in argument order (the cursor of the seed's
    runtime relies on it); a disagreement would hand a node the wrong weight, so it is an error."""
    pl = program.payloads[p]
    if pl.offload is None:
        return pw.reads
    where = f"payloads[{p}].offload.reads"
    sched = pl.offload.reads
    if len(sched) != len(pl.nodes):
        raise PayloadError(where, f"{len(sched)} entries for {len(pl.nodes)} nodes (one per node, in order)")
    dsts = {e.dst for e in pl.prepack}
    for k, (got, node) in enumerate(zip(sched, pl.nodes)):
        want = list(dict.fromkeys(a for a in node.args if a in dsts))
        if list(got) != want:
            raise PayloadError(f"{where}[{k}]", f"schedule says node {k} ({node.op}) reads prepacked values "
                                                f"{list(got)}, but its args read {want}")
    return pw.reads


def _pinned_buffers(program: Program, weights: Dict[int, PayloadWeights], prepack: PrepackPlan,
                    pinned: Sequence[str]) -> Set[int]:
    out: Set[int] = set()
    known: Set[str] = set()
    for name in pinned:
        found = False
        for p, pw in weights.items():
            pl = program.payloads[p]
            for vid, b in pw.buffer_of.items():
                v = pl.values[vid]
                if v.name:
                    known.add(v.name)
                if v.name != name:
                    continue
                found = True
                out.add(b)
            for vid, v in enumerate(pl.values):  # a constant pins every layout packed from it
                if v.name == name and v.constant is not None:
                    for i, rb in enumerate(prepack.buffers):
                        if rb.constant == v.constant:
                            out.add(i)
                            found = True
        if not found:
            sample = ", ".join(sorted(known)[:8]) or "none named"
            raise BudgetError(f"pinned weight {name!r} is not a weight read by the planned payloads (names: {sample}"
                              f"{', ...' if len(known) > 8 else ''})")
    return out


def plan_session(program: Program, limits: DeviceLimits, weight_budget: Optional[int] = None, prefetch_depth: int = 2,
                 pinned: Sequence[str] = (), chunk_bytes: int = 64 << 20,
                 methods: Optional[Iterable[str]] = None) -> SessionPlan:
    """Plan every payload used by ``methods`` (all methods when None) for a device with ``limits``.

    ``weight_budget`` (bytes) caps the device memory of weights (resident buffers + offload ring;
    activations are not counted): None keeps every weight resident. ``prefetch_depth`` is how many
    weight-reading nodes ahead loads are issued; ``pinned`` names weights that must stay resident;
    ``chunk_bytes`` bounds each prepack step. Raises PayloadError (malformed payload),
    DeviceError (a tensor over the device's limits) and BudgetError (budget below the floor)."""
    check_limits(limits)
    pids = payloads_of(program, methods)
    prepack, weights, names = plan_prepack(program, pids, chunk_bytes)
    for i, rb in enumerate(prepack.buffers):  # resident or streamed, a weight is one buffer (or slot)
        if rb.nbytes > limits.max_buffer_size:
            raise DeviceError(f"weight {names[i]} (constants[{rb.constant}], layout {rb.layout}) {rb.dtype}{list(rb.shape)} "
                              f"needs {rb.nbytes} bytes, more than the device's max_buffer_size of "
                              f"{limits.max_buffer_size} bytes ({limits.name}); no buffer can hold it")
    reads = {p: _schedule_reads(program, p, weights[p]) for p in pids}
    # Every node is one dispatch, in node order: what OffloadLoad.at indexes.
    dispatch_nodes = {p: list(range(len(program.payloads[p].nodes))) for p in pids}

    offload: Optional[OffloadPlan] = None
    slot_of: Dict[tuple, int] = {}
    if weight_budget is not None:
        must = _pinned_buffers(program, weights, prepack, list(pinned))
        for p in pids:  # a weight handed back to the caller must still be there after the run
            must.update(weights[p].buffer_of[o] for o in program.payloads[p].outputs if o in weights[p].buffer_of)
        result = plan_offload(reads, prepack.buffers, names, weight_budget, prefetch_depth, must, dispatch_nodes)
        offload, slot_of = result.plan, result.slot_of
    streamed = set(offload.streamed) if offload else set()

    plan = SessionPlan(limits=limits, prepack=prepack, offload=offload)
    for p in pids:
        pl = program.payloads[p]
        pw = weights[p]
        memory = plan_memory(pl, limits, external=set(pw.buffer_of), where=f"payloads[{p}]")

        def ref(v: int, node: Optional[int]) -> TensorRef:
            val = pl.values[v]
            b = pw.buffer_of.get(v)
            if b is None:
                buf = memory.locations[v]
            elif b in streamed:
                buf = BufferRef("slot", slot_of[(p, node, b)], 0, val.nbytes)
            else:
                buf = BufferRef("resident", b, 0, val.nbytes)
            return TensorRef(v, val.dtype, tuple(val.shape), buf)

        # Executors receive attrs resolved against the argument shapes (non-negative dims, concrete
        # reshape shapes, clamped slices, sdpa scale...), so none of them repeats that logic.
        dispatches = [Dispatch(k, n.op,
                               ops.normalize_attrs(n.op, n.attrs, [None if a == -1 else pl.values[a] for a in n.args]),
                               [None if a == -1 else ref(a, k) for a in n.args],
                               [ref(o, k) for o in n.outputs])
                      for k in dispatch_nodes[p] for n in (pl.nodes[k],)]
        plan.payloads[p] = PayloadPlan(payload=p, memory=memory, dispatches=dispatches,
                                       inputs=[ref(v, None) for v in pl.inputs],
                                       outputs=[ref(v, None) for v in pl.outputs])
        if offload is not None:
            check_loads(p, [d.node for d in dispatches], [slot_reads(d.args) for d in dispatches],
                        offload.loads.get(p, []), prepack.value_buffer)
    plan.layout = plan_layout(plan)
    # Which dispatches run as one kernel, decided once here for every executor: concatenated
    # products need the layout's back-to-back weight groups.
    plan.fusions = {p: match(pp, p, prepack.value_buffer, contiguous=plan.layout.adjacent)
                    for p, pp in plan.payloads.items()}
    return plan
