"""``to_backend`` with ``preprocess_all`` (the design of ExecuTorch PR 9811).

Takes ``method -> program`` and ``method -> partitioner`` and, in this order:

1. lowers every method to an :class:`~.frontend.ExportGraph` (ExportedPrograms go through the
   frontend) and partitions it with its partitioner, checking the partitions;
2. cuts every partition out as a self-contained graph (a :class:`~.backend.DelegateCandidate`);
3. groups the candidates of *all* methods by backend id;
4. calls each backend's ``preprocess_all({method: [candidate, ...]})`` exactly once;
5. replaces each partition with a ``delegate`` node calling the payload it got back; the nodes no
   partition took stay in the method and run on the host.

The result is one :class:`~gpudelegate.program.Program` whose constant store holds every constant
once, however many methods and partitions read it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from gpudelegate.errors import ExportError
from gpudelegate.program import DELEGATE_OP, Method, Node, Program, Value

from .backend import BackendDetails, DelegateCandidate, get_backend
from .frontend import ExportGraph, GNode
from .partitioner import Partition, Partitioner


@dataclass
class LoweredProgram:
    """What ``to_backend`` returns: the program plus how each method was split."""

    program: Program
    partitions: Dict[str, List[Partition]]
    graphs: Dict[str, ExportGraph]  # the method graphs before partitioning
    preprocess_calls: Dict[str, List[str]] = field(default_factory=dict)  # backend id -> methods it got

    def host_ops(self, method: str) -> List[str]:
        """Ops of ``method`` that no backend took (they run on the host)."""
        return [n.op for n in self.program.methods[method].nodes if n.op != DELEGATE_OP]


# ------------------------------------------------------------------------------ partition checks

def _check_partitions(method: str, g: ExportGraph, parts: List[Partition]) -> None:
    owner: Dict[int, int] = {}
    for p_i, p in enumerate(parts):
        if not isinstance(p, Partition):
            raise ExportError(f"{method}: partition {p_i} is a {type(p).__name__}, not a Partition")
        if not p.nodes:
            raise ExportError(f"{method}: partition {p_i} ({p.backend_id}) has no nodes")
        for n in p.nodes:
            if not isinstance(n, int) or not 0 <= n < len(g.nodes):
                raise ExportError(f"{method}: partition {p_i} ({p.backend_id}) names node {n!r}, "
                                  f"outside 0..{len(g.nodes) - 1}")
            if n in owner:
                raise ExportError(f"{method}: node {n} ({g.nodes[n].op}) is in partitions {owner[n]} and {p_i}")
            owner[n] = p_i
    producers = g.producers()
    for p_i, p in enumerate(parts):
        _check_convex(method, g, p_i, p, producers)


def _check_convex(method: str, g: ExportGraph, p_i: int, p: Partition, producers: Dict[int, int]) -> None:
    """A partition becomes one call, so no path may leave it and come back (that would need the
    call to both precede and follow an outside node)."""
    inside = set(p.nodes)
    downstream = set()  # outside nodes that depend on the partition
    for i in range(min(inside), max(inside) + 1):
        deps = {producers[a] for a in g.nodes[i].args if a in producers}
        if i in inside:
            bad = deps & downstream
            if bad:
                j = min(bad)
                raise ExportError(f"{method}: partition {p_i} ({p.backend_id}) is not convex: node {i} "
                                  f"({g.nodes[i].op}) depends on node {j} ({g.nodes[j].op}), which is outside the "
                                  f"partition but depends on it")
        elif deps & (inside | downstream):
            downstream.add(i)


# ------------------------------------------------------------------------------ cutting a partition

@dataclass
class _Cut:
    graph: ExportGraph
    inputs: List[int]  # method value ids flowing in (payload inputs, in order)
    outputs: List[int]  # method value ids flowing out (payload outputs, in order)


def _cut(method: str, g: ExportGraph, nodes: Tuple[int, ...], consumers: Dict[int, List[int]], p_i: int) -> _Cut:
    inside = set(nodes)
    produced = {o for i in nodes for o in g.nodes[i].outputs}
    ins: List[int] = []
    for i in nodes:
        for a in g.nodes[i].args:
            if a >= 0 and a not in produced and not g.values[a].is_constant and a not in ins:
                ins.append(a)
    method_outs = set(g.outputs)
    outs = [o for i in nodes for o in g.nodes[i].outputs
            if o in method_outs or any(c not in inside for c in consumers.get(o, ()))]
    sub = ExportGraph(name=f"{method}.partition{p_i}")
    remap: Dict[int, int] = {}

    def mapped(vid: int) -> int:
        if vid < 0:
            return -1
        if vid not in remap:
            v = g.values[vid]
            sub.values.append(v)  # shares the GValue (and constant data): nothing is copied
            remap[vid] = len(sub.values) - 1
        return remap[vid]

    sub.inputs = [mapped(v) for v in ins]
    for i in nodes:
        n = g.nodes[i]
        sub.nodes.append(GNode(n.op, [mapped(a) for a in n.args], [mapped(o) for o in n.outputs], dict(n.attrs),
                               n.origin, n.stack_trace))
    sub.outputs = [mapped(o) for o in outs]
    return _Cut(sub, ins, outs)


# ------------------------------------------------------------------------------ method rewrite

def _dead_code_eliminated(g: ExportGraph) -> ExportGraph:
    """Drop nodes whose outputs nothing reads (ops have no side effects a caller could see), so
    no partition ends up with nothing to return."""
    live = set(g.outputs)
    keep = []
    for i in range(len(g.nodes) - 1, -1, -1):
        n = g.nodes[i]
        if any(o in live for o in n.outputs):
            keep.append(i)
            live.update(a for a in n.args if a >= 0)
    if len(keep) == len(g.nodes):
        return g
    keep.reverse()
    return ExportGraph(g.name, g.values, g.inputs, g.outputs, [g.nodes[i] for i in keep])


def _schedule(g: ExportGraph, parts: List[Partition], cuts: List[_Cut], payload_ids: List[int]) -> List[Node]:
    """The method's node list with each partition replaced by its delegate call, in a topological
    order that keeps the original order where it can (each call sits as early as its inputs allow)."""
    owner = {n: p_i for p_i, p in enumerate(parts) for n in p.nodes}
    units: List[Tuple[int, Node]] = []  # (position, node)
    for i, n in enumerate(g.nodes):
        if i not in owner:
            units.append((i, Node(n.op, list(n.args), list(n.outputs), dict(n.attrs))))
    for p_i, (p, cut) in enumerate(zip(parts, cuts)):
        units.append((min(p.nodes), Node(DELEGATE_OP, list(cut.inputs), list(cut.outputs),
                                         {"payload": payload_ids[p_i]})))
    producer = {o: u for u, (_, n) in enumerate(units) for o in n.outputs}
    deps = [{producer[a] for a in n.args if a in producer} for _, n in units]
    users: Dict[int, List[int]] = {}
    for u, d in enumerate(deps):
        for x in d:
            users.setdefault(x, []).append(u)
    waiting = [len(d) for d in deps]
    ready = [(units[u][0], u) for u in range(len(units)) if not waiting[u]]
    heapq.heapify(ready)
    order: List[Node] = []
    while ready:
        _, u = heapq.heappop(ready)
        order.append(units[u][1])
        for v in users.get(u, ()):
            waiting[v] -= 1
            if not waiting[v]:
                heapq.heappush(ready, (units[v][0], v))
    if len(order) != len(units):  # cannot happen for convex partitions; checked anyway
        raise ExportError(f"{g.name}: delegate calls form a cycle with the host nodes")
    return order


def _method(program: Program, g: ExportGraph, nodes: List[Node]) -> Method:
    """The method as the program stores it: only the values it still references, renumbered;
    constants read by host nodes go to the program's constant store."""
    remap: Dict[int, int] = {}
    values: List[Value] = []

    def mapped(vid: int) -> int:
        if vid < 0:
            return -1
        if vid not in remap:
            v = g.values[vid]
            const = program.add_constant(v.dtype, v.shape, v.data) if v.is_constant else None
            values.append(Value(v.dtype, v.shape, constant=const, name=v.name))
            remap[vid] = len(values) - 1
        return remap[vid]

    inputs = [mapped(v) for v in g.inputs]
    out_nodes = [Node(n.op, [mapped(a) for a in n.args], [mapped(o) for o in n.outputs], n.attrs) for n in nodes]
    outputs = [mapped(v) for v in g.outputs]
    return Method(values, inputs, outputs, out_nodes, name=g.name)


# ------------------------------------------------------------------------------ entry point

def to_backend(method_programs: Mapping[str, Any], method_partitioners: Mapping[str, Partitioner],
               backends: Optional[Mapping[str, BackendDetails]] = None, program: Optional[Program] = None,
               ) -> LoweredProgram:
    """Lower several methods at once. ``method_programs`` maps a method name to an ExportedProgram
    (lowered by the frontend) or an :class:`ExportGraph`; a method without a partitioner runs
    entirely on the host. ``backends`` overrides/extends the registered backends by id."""
    from .frontend import lower

    unknown = sorted(set(method_partitioners) - set(method_programs))
    if unknown:
        raise ExportError(f"partitioners given for methods {unknown} that are not in method_programs "
                          f"({sorted(method_programs)})")
    graphs: Dict[str, ExportGraph] = {}
    for name, prog in method_programs.items():
        g = prog if isinstance(prog, ExportGraph) else lower(prog, name=name)
        g.name = name
        graphs[name] = _dead_code_eliminated(g)

    # 1-2. partition every method first and cut every partition out
    partitions: Dict[str, List[Partition]] = {}
    cuts: Dict[str, List[_Cut]] = {}
    for name, g in graphs.items():
        partitioner = method_partitioners.get(name)
        parts = list(partitioner.partition(g)) if partitioner is not None else []
        _check_partitions(name, g, parts)
        parts = [Partition(p.backend_id, tuple(sorted(p.nodes)), dict(p.compile_specs)) for p in parts]
        consumers = g.consumers()
        partitions[name] = parts
        cuts[name] = [_cut(name, g, p.nodes, consumers, i) for i, p in enumerate(parts)]

    # 3. group the partitions of all methods by backend
    grouped: Dict[str, Dict[str, List[DelegateCandidate]]] = {}
    for name, parts in partitions.items():
        for i, (p, cut) in enumerate(zip(parts, cuts[name])):
            grouped.setdefault(p.backend_id, {}).setdefault(name, []).append(DelegateCandidate(name, i, p, cut.graph))

    # 4. one preprocess_all per backend, with everything it takes
    program = program if program is not None else Program(constants=[], payloads=[], methods={})
    payload_ids: Dict[str, List[Optional[int]]] = {name: [None] * len(parts) for name, parts in partitions.items()}
    calls: Dict[str, List[str]] = {}
    for backend_id, by_method in grouped.items():
        backend = get_backend(backend_id, dict(backends or {}))
        result = backend.preprocess_all(program, by_method)
        calls[backend_id] = list(by_method)
        for name, cands in by_method.items():
            got = list((result or {}).get(name, ()))
            if len(got) != len(cands):
                raise ExportError(f"backend {backend_id!r}: preprocess_all returned {len(got)} payloads for method "
                                  f"{name!r}, which has {len(cands)} partitions for it")
            for cand, payload in zip(cands, got):
                cut = cuts[name][cand.index]
                if len(payload.inputs) != len(cut.inputs) or len(payload.outputs) != len(cut.outputs):
                    raise ExportError(f"backend {backend_id!r}: payload for {name} partition {cand.index} has "
                                      f"{len(payload.inputs)} inputs/{len(payload.outputs)} outputs; the partition has "
                                      f"{len(cut.inputs)}/{len(cut.outputs)}")
                program.payloads.append(payload)
                payload_ids[name][cand.index] = len(program.payloads) - 1

    # 5. replace partitions with delegate calls
    for name, g in graphs.items():
        nodes = _schedule(g, partitions[name], cuts[name], payload_ids[name])
        program.methods[name] = _method(program, g, nodes)
    return LoweredProgram(program, partitions, graphs, calls)
