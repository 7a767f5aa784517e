"""What ``gpudelegate inspect FILE`` prints: a program's methods, ops, payloads, constants and the
plans a session would make from it.

:func:`describe` returns plain data (dicts, lists, str, int, float, bool, None: JSON-ready, for a
``--json`` flag or a browser page) and :func:`format_report` renders it as text. Both are pure
Python: the plans come from :func:`gpudelegate.plan.plan_session`, the same call a session makes,
so the numbers are the ones an executor would get, not an estimate.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Optional

import msgpack

from .errors import GpuDelegateError
from .plan.types import DeviceLimits
from .program import DELEGATE_OP, HEADER_SIZE, Graph, Program, align_up, program_document

LARGEST = 5  # constants listed by size in the report


# ------------------------------------------------------------------ pieces

def _tensor(g: Graph, vid: int) -> dict:
    v = g.values[vid]
    return {"id": vid, "name": v.name, "dtype": v.dtype, "shape": list(v.shape), "nbytes": v.nbytes}


def _histogram(names) -> Dict[str, int]:
    return dict(sorted(Counter(names).items(), key=lambda kv: (-kv[1], kv[0])))


def _called_payloads(program: Program, name: str) -> List[int]:
    """Payload indices a method calls, one entry per call, in call order."""
    return [n.attrs["payload"] for n in program.methods[name].nodes if n.op == DELEGATE_OP]


def _constant_users(program: Program) -> Dict[int, List[str]]:
    """constant index -> methods that read it (directly, or through a payload they call)."""
    payload_consts = [{v.constant for v in pl.values if v.constant is not None} for pl in program.payloads]
    users: Dict[int, List[str]] = {i: [] for i in range(len(program.constants))}
    for name, m in program.methods.items():
        used = {v.constant for v in m.values if v.constant is not None}
        for p in set(_called_payloads(program, name)):
            used |= payload_consts[p]
        for c in sorted(used):
            users[c].append(name)
    return users


def _file_layout(program: Program, file_size: Optional[int]) -> dict:
    """Sizes as the writer lays the program out (for a loaded file that is the file itself)."""
    doc_bytes = len(msgpack.packb(program_document(program), use_bin_type=True))
    data_bytes = 0
    for c in program.constants:
        data_bytes = align_up(data_bytes + c.nbytes)
    computed = align_up(HEADER_SIZE + doc_bytes) + data_bytes
    const_bytes = program.constant_bytes_total
    size = computed if file_size is None else file_size
    return {"file_bytes": size, "header_bytes": HEADER_SIZE, "document_bytes": doc_bytes,
            "data_segment_bytes": data_bytes, "constant_bytes": const_bytes,
            "overhead_bytes": size - const_bytes, "constant_fraction": const_bytes / size if size else 0.0}


def constants_by_dtype(program: Program) -> Dict[str, dict]:
    """dtype -> {"count", "bytes"} of the program's constants, most bytes first: what a packed
    (q4_1, q8_0, ...) or float16 export actually stores."""
    return _by_dtype((c.dtype, c.nbytes) for c in program.constants)


def _by_dtype(items) -> Dict[str, dict]:
    out: Dict[str, dict] = {}
    for dtype, nbytes in items:
        e = out.setdefault(dtype, {"count": 0, "bytes": 0})
        e["count"] += 1
        e["bytes"] += nbytes
    return dict(sorted(out.items(), key=lambda kv: (-kv[1]["bytes"], kv[0])))


def format_dtype_bytes(by: Dict[str, dict], size=None, noun: str = "constants") -> str:
    """``q4_1: 210 constants, 63.3 MiB; q8_0: 1, 28.7 MiB; float32: 63, 265.2 KiB`` (``size``
    formats a byte count; human_bytes by default)."""
    size = size or human_bytes
    parts = [f"{dt}: {e['count']}{' ' + noun if i == 0 else ''}, {size(e['bytes'])}"
             for i, (dt, e) in enumerate(by.items())]
    return "; ".join(parts) or "none"


def _plan(program: Program, limits: DeviceLimits, weight_budget: Optional[int], prefetch_depth: int) -> dict:
    from .plan import plan_session  # planning is the expensive part; only inspect pulls it in

    out: Dict[str, Any] = {"limits": {"name": limits.name, "max_buffer_size": limits.max_buffer_size,
                                      "max_binding_size": limits.max_binding_size,
                                      "offset_alignment": limits.offset_alignment}}
    try:
        sp = plan_session(program, limits)
    except GpuDelegateError as e:  # a tensor over the device's limits, a malformed in-memory program
        out["error"] = f"{type(e).__name__}: {e}"
        return out

    out["payloads"] = {}
    for p, pp in sorted(sp.payloads.items()):
        mem = pp.memory
        out["payloads"][str(p)] = {"arena_bytes": mem.arena_bytes, "lower_bound": mem.lower_bound,
                                   "objects": list(mem.objects), "dispatches": len(pp.dispatches)}
    pk = sp.prepack
    chunk_sizes = [sum(pk.buffers[b].nbytes for b in ch) for ch in pk.chunks]
    out["prepack"] = {"buffers": len(pk.buffers), "device_bytes": sum(b.nbytes for b in pk.buffers),
                      "file_bytes": sum(b.src_nbytes for b in pk.buffers),
                      "layouts": _histogram(b.layout for b in pk.buffers),
                      "device_dtypes": _by_dtype((b.dtype, b.nbytes) for b in pk.buffers), "chunks": len(pk.chunks),
                      "chunk_bytes": pk.chunk_bytes, "largest_chunk_bytes": max(chunk_sizes, default=0)}

    # The floor exists whatever the budget: plan once with room for every weight (always >= the
    # floor), so the report can say how far a too-small budget is from working.
    off: Dict[str, Any] = {"prefetch_depth": prefetch_depth, "weights": 0, "all_resident_bytes": 0, "floor": 0}
    out["offload"] = off
    if pk.buffers:
        roomy = sum(align_up(max(b.nbytes, 1), 4) for b in pk.buffers)
        try:
            full = plan_session(program, limits, weight_budget=roomy, prefetch_depth=prefetch_depth).offload
            off.update(weights=len(pk.buffers), all_resident_bytes=roomy, floor=full.floor)
        except GpuDelegateError as e:
            off["error"] = f"{type(e).__name__}: {e}"
    if weight_budget is not None:
        b: Dict[str, Any] = {"budget": weight_budget}
        off["with_budget"] = b
        try:
            op = plan_session(program, limits, weight_budget=weight_budget, prefetch_depth=prefetch_depth).offload
        except GpuDelegateError as e:  # BudgetError below the floor: report it, with the floor above
            b.update(fits=False, error=f"{type(e).__name__}: {e}")
        else:
            b.update(fits=True)
            if op is not None:
                b.update(peak_bytes=op.peak_bytes, resident=len(op.resident), streamed=len(op.streamed),
                         resident_bytes=sum(pk.buffers[i].nbytes for i in op.resident),
                         streamed_bytes=sum(pk.buffers[i].nbytes for i in op.streamed), slots=list(op.slots),
                         loads_per_run=sum(len(v) for v in op.loads.values()))
    return out


# ------------------------------------------------------------------ entry points

def describe(program: Program, limits: DeviceLimits = DeviceLimits(), weight_budget: Optional[int] = None,
             file_size: Optional[int] = None, prefetch_depth: int = 2) -> dict:
    """Everything ``inspect`` reports, as plain data. ``file_size`` is the file's size on disk
    (computed from the layout when None); ``weight_budget`` adds an offload plan for that budget."""
    users = _constant_users(program)
    methods = {}
    for name, m in program.methods.items():
        calls = _called_payloads(program, name)
        methods[name] = {
            "inputs": [_tensor(m, v) for v in m.inputs],
            "outputs": [_tensor(m, v) for v in m.outputs],
            "nodes": len(m.nodes),
            "ops": _histogram(n.op for n in m.nodes),
            "payloads": sorted(set(calls)),
            # ops run inside the payloads this method calls, counted per call
            "delegated_ops": _histogram(n.op for p in calls for n in program.payloads[p].nodes),
        }
    payloads = []
    for i, pl in enumerate(program.payloads):
        payloads.append({
            "index": i, "backend": pl.backend, "nodes": len(pl.nodes), "ops": _histogram(n.op for n in pl.nodes),
            "inputs": len(pl.inputs), "outputs": len(pl.outputs),
            "prepack": len(pl.prepack), "prepack_layouts": _histogram(e.layout for e in pl.prepack),
            "offload_schedule": pl.offload is not None,
            "methods": [name for name in program.methods if i in methods[name]["payloads"]],
        })
    consts = [{"index": i, "key": c.key[:16], "dtype": c.dtype, "shape": list(c.shape), "nbytes": c.nbytes,
               "methods": users[i]} for i, c in enumerate(program.constants)]
    shared = [c for c in consts if len(c["methods"]) > 1]
    unused = [c for c in consts if not c["methods"]]
    constants = {
        "count": len(consts), "total_bytes": sum(c["nbytes"] for c in consts),
        "by_dtype": constants_by_dtype(program),
        "largest": sorted(consts, key=lambda c: (-c["nbytes"], c["index"]))[:LARGEST],
        "shared_count": len(shared), "shared_bytes": sum(c["nbytes"] for c in shared),
        "unused_count": len(unused), "unused_bytes": sum(c["nbytes"] for c in unused),
    }
    return {
        "version": program.version,
        "metadata_keys": sorted(str(k) for k in program.metadata),
        "file": _file_layout(program, file_size),
        "methods": methods,
        "payloads": payloads,
        "constants": constants,
        "plan": _plan(program, limits, weight_budget, prefetch_depth),
    }


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def _sig(ts: List[dict]) -> str:
    """``name: dtype[shape]`` per tensor; a run of 3 or more consecutive tensors of one dtype and
    shape (a model's KV caches: 60 of them for SmolLM2) prints as one ``first..last`` item."""
    parts, i = [], 0
    while i < len(ts):
        j = i
        while j + 1 < len(ts) and (ts[j + 1]["dtype"], ts[j + 1]["shape"]) == (ts[i]["dtype"], ts[i]["shape"]):
            j += 1
        name = lambda t: t["name"] or "%" + str(t["id"])
        if j - i >= 2:
            parts.append(f"{name(ts[i])}..{name(ts[j])} ({j - i + 1} x {ts[i]['dtype']}{ts[i]['shape']})")
            i = j + 1
        else:
            parts.append(f"{name(ts[i])}: {ts[i]['dtype']}{ts[i]['shape']}")
            i += 1
    return ", ".join(parts)


def _hist(h: Dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in h.items()) or "none"


def format_report(d: dict) -> str:
    """Render :func:`describe`'s result as the text ``gpudelegate inspect`` prints."""
    f, c, plan = d["file"], d["constants"], d["plan"]
    lines = [f"program v{d['version']}: {human_bytes(f['file_bytes'])} ({f['file_bytes']} bytes): document "
             f"{human_bytes(f['document_bytes'])}, constants {human_bytes(f['constant_bytes'])} "
             f"({100 * f['constant_fraction']:.1f}% of the file)"]
    if d["metadata_keys"]:
        lines.append(f"metadata: {', '.join(d['metadata_keys'])}")

    lines.append(f"methods ({len(d['methods'])}):")
    for name, m in d["methods"].items():
        lines.append(f"  {name}({_sig(m['inputs'])}) -> ({_sig(m['outputs'])})")
        lines.append(f"    {m['nodes']} nodes: {_hist(m['ops'])}")
        if m["payloads"]:
            lines.append(f"    payloads {m['payloads']} run: {_hist(m['delegated_ops'])}")

    lines.append(f"payloads ({len(d['payloads'])}):")
    for p in d["payloads"]:
        called = ", ".join(p["methods"]) or "no method (never runs)"
        pk = f"prepack {p['prepack']} ({_hist(p['prepack_layouts'])})" if p["prepack"] else "no prepack"
        lines.append(f"  [{p['index']}] {p['backend']}: {p['nodes']} nodes, {p['inputs']} in / {p['outputs']} out, "
                     f"{pk}, offload schedule {'yes' if p['offload_schedule'] else 'no'}; called by {called}")
        lines.append(f"      {_hist(p['ops'])}")

    lines.append(f"constants: {c['count']}, {human_bytes(c['total_bytes'])}; shared by several methods: "
                 f"{c['shared_count']} ({human_bytes(c['shared_bytes'])}); unused: {c['unused_count']} "
                 f"({human_bytes(c['unused_bytes'])})")
    lines.append(f"  by type: {format_dtype_bytes(c['by_dtype'])}")
    for k in c["largest"]:
        used = ", ".join(k["methods"]) or "unused"
        lines.append(f"  [{k['index']}] {k['dtype']}{k['shape']} {human_bytes(k['nbytes'])} {k['key']}... ({used})")

    lim = plan["limits"]
    lines.append(f"plan for {lim['name']} limits (max buffer {human_bytes(lim['max_buffer_size'])}, max binding "
                 f"{human_bytes(lim['max_binding_size'])}):")
    if "error" in plan:
        lines.append(f"  cannot plan: {plan['error']}")
        return "\n".join(lines)
    for p, mem in plan["payloads"].items():
        lb = mem["lower_bound"]
        ratio = f", {mem['arena_bytes'] / lb:.2f}x the lower bound" if lb else ""
        lines.append(f"  payload {p}: arena {human_bytes(mem['arena_bytes'])} in {len(mem['objects'])} buffer(s) "
                     f"(lower bound {human_bytes(lb)}{ratio}), {mem['dispatches']} planned ops (before "
                     f"executor fusion: wgpu and CUDA launch fewer kernels)")
    pk = plan["prepack"]
    big = pk["largest_chunk_bytes"] > pk["chunk_bytes"]
    lines.append(f"  prepack: {pk['buffers']} buffers, {human_bytes(pk['device_bytes'])} on the device from "
                 f"{human_bytes(pk['file_bytes'])} in the file ({_hist(pk['layouts'])}), {pk['chunks']} chunk(s) "
                 f"filled up to {human_bytes(pk['chunk_bytes'])} each" +
                 (f"; a buffer bigger than that is a chunk of its own (largest {human_bytes(pk['largest_chunk_bytes'])})"
                  if big else f" (largest {human_bytes(pk['largest_chunk_bytes'])})"))
    lines.append(f"    weights on the device by type: {format_dtype_bytes(pk['device_dtypes'], noun='buffers')}")
    off = plan["offload"]
    if "error" in off:
        lines.append(f"  offload: cannot plan: {off['error']}")
    elif off["weights"]:
        lines.append(f"  offload: floor {human_bytes(off['floor'])} = {off['floor']} bytes (the smallest --budget) at "
                     f"prefetch depth {off['prefetch_depth']} (all {off['weights']} weights resident: "
                     f"{human_bytes(off['all_resident_bytes'])} = {off['all_resident_bytes']} bytes)")
    else:
        lines.append("  offload: no weights")
    b = off.get("with_budget")
    if b is not None:
        if not b["fits"]:
            lines.append(f"  budget {human_bytes(b['budget'])}: does not fit: {b['error']}")
        elif "peak_bytes" in b:
            lines.append(f"  budget {human_bytes(b['budget'])}: peak {human_bytes(b['peak_bytes'])}; {b['resident']} resident "
                         f"({human_bytes(b['resident_bytes'])}), {b['streamed']} streamed "
                         f"({human_bytes(b['streamed_bytes'])}) through {len(b['slots'])} slot(s) "
                         f"of {', '.join(human_bytes(s) for s in b['slots']) or '-'}; {b['loads_per_run']} loads per run")
        else:
            lines.append(f"  budget {human_bytes(b['budget'])}: fits (no weights to place)")
    return "\n".join(lines)
