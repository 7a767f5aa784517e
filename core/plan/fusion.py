"""Fusion decisions on a plan: which dispatches run as one kernel (pure Python).

Executors carry out a payload plan's dispatches in order; some runs of neighbouring dispatches
can run as one kernel instead. Every such decision is made here, on the plan, with one set of
graph helpers and predicates for all of its users:

- the memory planner (:mod:`.memory`): ``fusion_lifetimes`` lengthens the lifetimes of the values
  a fused kernel still reads or writes early, so the planner never gives their bytes away;
- the WebGPU lowering (:mod:`gpudelegate.webgpu.lowering`): ``epilogue_fusions`` (a gelu or a
  residual add in a linear's kernel), ``sdpa_folds`` (head permutes read and written through the
  attention's strides) and sibling linears as one batched product (``sibling_groups`` tells the
  executor which resident buffers to place back to back, ``_siblings`` which groups then fuse);
- the CUDA executor (:mod:`gpudelegate.native.cuda_executor`, bound by
  :mod:`gpudelegate.native.cuda_fused_ops`): ``match`` and ``cat_candidates``, below.

CUDA fusion. The program format and the op set stay as they are; the CUDA executor alone, when
it records a payload, replaces some runs of dispatches by one fused launch (kernels in
``shaders/cuda_fused.cu`` and an output-layout option of the attention kernel). ``match`` finds
those runs and proves each replacement safe on the plan; the executor binds them.

A fused group runs at the position of its LAST member dispatch; the other members do nothing.
An intermediate value a group does not write ("eliminated") must have no reader outside the
group, must not be a payload output, and may be aliased only by the no-op reshapes the group
swallows (an alias class = a value and its in-place reshapes). Everything a group writes
("kept" outputs) is written when the group runs. It is safe when:

1. no dispatch between the group's first and last member writes bytes the group reads, reads a
   kept output (not yet written), or writes bytes of a kept output;
2. every reader of a kept output outside the group comes after the group;
3. the group's kept outputs do not overlap the bytes it reads (the memory planner may have
   reused the storage of a value whose last use was an earlier member), except an output over
   its own in-place input (``kv_update``), identical ranges for the row-wise kernels that read a
   position before writing it, and reads consumed by an earlier stage of the group (the input
   of a concatenated GEMM, read completely before anything is written);
4. members before the last read no offload slot (a slot may be refilled once its reader ran).

Patterns (every dtype check is exact; a pattern that does not match leaves the ops alone):

- ``add_rms_norm``: ``s = add(x, y)`` (same shapes) then ``h = rms_norm(s, w)``: one kernel
  writes s (kept) and h;
- ``silu_mul``: ``mul(silu(g), u)`` (either order): the silu output is eliminated;
- ``rope_kv``: up to three jobs of one layer, each a ``rope`` and/or ``kv_update`` whose input
  is reached through permutes and reshapes of a projection output (folded into read strides):
  q = rope(permute(q_lin)) kept, k_cache = kv_update(cache, rope(permute(k_lin))),
  v_cache = kv_update(cache, permute(v_lin));
- ``sdpa_bthd``: ``permute(sdpa(...), [0, 2, 1, 3])``: the attention writes the permuted layout;
- ``sdpa_linear``: ``linear(reshape*(sdpa(q, k, v, mask)))`` with at most PROLOGUE_MAX_ROWS rows
  (decode), the attention output read by that linear alone through no-op reshapes, with one
  query row or one head (so its [B, H, T, Dv] layout is already the linear's rows of H Dv): the
  attention's partials are merged inside the product, each workgroup of it combining the rows
  it needs before its GEMV (WebGPU: one dispatch less per layer, the split-key combine's). The
  attention output is eliminated; the group reads q, k, v and the mask in its first stage, so
  its output may take their bytes. A residual ``add`` reading only the product's output, where
  no group above took it, joins as the product's epilogue (roles add / res / out). Tried after ``sdpa_bthd`` (which CUDA carries), never in its
  place. CUDA carries it for packed weights behind a knob that is off by default (its combine
  launched apart measured faster inside a captured step: docs/NOTES.md).
- ``gemm_cat`` variants: q/k/v (or gate/up) ``linear`` ops reading the same input with resident
  weights that the executor placed back to back (``cat_candidates`` proposes them before the
  weights are allocated) run as one GEMM into private scratch, read by the ``rope_kv`` or
  ``silu_mul`` kernel with the concatenated row stride. Streamed (offloaded) weights never take
  part: they live in ring slots, one at a time.
- ``norm_prologue`` (a variant of ``gemm_cat``, ``Fusion.norm``): with at most PROLOGUE_MAX_ROWS
  rows (decode), the ``rms_norm`` whose output h only the concatenated GEMM reads, and the
  ``add`` s = x + y writing its input, join the group: every workgroup of the product computes
  h = rms_norm(s) * w on the fly (s = x + y rounded to s's dtype, h rounded to h's dtype, as the
  ops apart store them) and one workgroup writes s (kept). h is eliminated. A decoder layer then
  runs no add_rms_norm kernel of its own. The group reads x and y while it writes s and its
  outputs, so none of those may overlap them (``fusion_lifetimes`` arranges it).

Packed (GGUF block) weights (``dtypes.QUANT_BLOCKS``; ``linear``'s weight may be one): their
linears take part where every executor that carries the decision out has a kernel for it.

- ``epilogue_fusions`` and sibling linears (WebGPU only): yes. The packed kernels
  (core/webgpu/ops_quant.py) apply gelu / the residual add, and run siblings whose packed weights
  (one dtype, same shape) the executor placed back to back as one product over all their rows.
- ``gemm_cat`` (``cat_candidates``, ``match``; CUDA and WebGPU): yes, when every member's weight
  has the same packed dtype and K (a group is all float of one dtype or all packed of one type).
  Each sibling's weight stays its own constant; no prepack step concatenates them. CUDA reads the
  group as one packed [sum N, K] tensor because the layout places its buffers back to back (rows
  of back-to-back weights continue one another), so the dequantizing GEMV (or dequantization and
  one GEMM, for prefill) runs once for all of them. WebGPU places only same-shaped siblings back
  to back, so its packed concatenated GEMV binds up to three weight ranges and picks one per
  weight row (core/webgpu/ops_quant.py ``cat_gemv``). A prepacked concatenation would double
  those weights' device memory (or change every executor's resident-buffer identity) for no
  saving: both executors already read the separate buffers in one dispatch.
- ``sdpa_bthd`` (CUDA): yes. The projection after the attention runs through
  ``CudaKernels.linear``, which has the packed kernels; the attention never reads a weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .. import dtypes as _dt
from .. import ops as _ops
from ..program import Payload
from .types import BufferRef, DeviceLimits, Dispatch, TensorRef

FLOAT = ("float32", "float16")
MAX_SIBLINGS = 3  # sibling linears batched into one product (matmul_fast.wgsl NC)
PROLOGUE_MAX_ROWS = 8
"""Most rows of a concatenated product that takes the rms norm before it as its prologue (decode):
every workgroup of the product recomputes the rows' sums of squares, cheap only for a few rows."""


# ---------------------------------------------------------------------------------------- shared

def _overlap(a: BufferRef, b: BufferRef) -> bool:
    return a.space == b.space and a.index == b.index and a.offset < b.offset + b.nbytes \
        and b.offset < a.offset + a.nbytes


def _producers(ds: Sequence[Dispatch]) -> Dict[int, int]:
    """Value -> index of the dispatch that writes it (the last one, if several do)."""
    producer: Dict[int, int] = {}
    for k, d in enumerate(ds):
        for o in d.outputs:
            producer[o.value] = k
    return producer


def _readers(ds: Sequence[Dispatch]) -> Dict[int, List[int]]:
    """Value -> indices of the dispatches reading it, in order (once per argument)."""
    readers: Dict[int, List[int]] = {}
    for k, d in enumerate(ds):
        for a in d.args:
            if a is not None:
                readers.setdefault(a.value, []).append(k)
    return readers


def bthd_dims(dims) -> bool:
    """``dims`` (None: absent) is the [0, 2, 1, 3] permutation of a 4-D tensor, negative dims
    allowed: the head permute between [B, T, H, D] and [B, H, T, D] around an attention."""
    return dims is not None and [int(x) % 4 for x in dims] == [0, 2, 1, 3]


def epilogue_pair(producer: str, consumer: str, arg_shapes: Sequence[Optional[tuple]]) -> bool:
    """Whether ``consumer`` (the shapes of its arguments, None for an absent one), reading the
    output of the ``producer`` op right before it, may run in that op's kernel as its epilogue:
    a linear followed by a gelu, or by an add of two same-shaped tensors."""
    return producer == "linear" and ((consumer == "gelu" and len(arg_shapes) == 1) or (
        consumer == "add" and len(arg_shapes) == 2 and None not in arg_shapes and arg_shapes[0] == arg_shapes[1]))


def sibling_linear(op: str, n_outputs: int, present: Sequence[bool]) -> bool:
    """Whether a dispatch may run batched with sibling linears (the same input, same-shaped
    weights): a linear with one output whose input and weight are ``present``."""
    return op == "linear" and n_outputs == 1 and len(present) >= 2 and present[0] and present[1]


# ---------------------------------------------------------------------------------------- memory planner

def _bthd_node(node) -> bool:
    """A program node that is a [0, 2, 1, 3] permute."""
    dims = node.attrs.get("dims") if isinstance(node.attrs, dict) else None
    return node.op == "permute" and bthd_dims(dims)


def fusion_lifetimes(payload: Payload):
    """([(value, earlier start)], [(value, later last use)]) of the neighbours an executor may run
    as one kernel (the WebGPU fusions below; plan.memory's docstring lists them): the outputs of
    sibling linears start at the first of them, a linear's epilogue output and the permute output
    after an sdpa start at the producer, the source of a permute read only by an sdpa lives
    until that sdpa, and the operands of a norm a concatenated GEMM may take as its prologue live
    until that GEMM's consumer (``_prologue_lifetimes``)."""
    nodes = payload.nodes
    reads: Dict[int, List[int]] = {}
    for k, node in enumerate(nodes):
        for a in node.args:
            reads.setdefault(a, []).append(k)
    outs = set(payload.outputs)
    early, late = [], []
    sibs: Dict[tuple, List[int]] = {}
    for k, node in enumerate(nodes):
        if sibling_linear(node.op, len(node.outputs), [a != -1 for a in node.args]):
            w = payload.values[node.args[1]]
            key = (node.args[0], tuple(w.shape), w.dtype, len(node.args) > 2 and node.args[2] != -1)
            sibs.setdefault(key, []).append(k)
    for ks in sibs.values():
        if 2 <= len(ks) <= MAX_SIBLINGS:
            early += [(nodes[k].outputs[0], ks[0]) for k in ks[1:]]
    for k, node in enumerate(nodes):
        if len(node.outputs) != 1:
            continue
        y = node.outputs[0]
        if y in outs:
            continue
        rd = reads.get(y, [])
        if _bthd_node(node) and len(rd) == 1 and nodes[rd[0]].op == "sdpa" \
                and y in nodes[rd[0]].args[:3]:
            late.append((node.args[0], rd[0]))
            continue
        if rd != [k + 1] or len(nodes[k + 1].outputs) != 1:
            continue
        c = nodes[k + 1]
        if epilogue_pair(node.op, c.op, [None if a == -1 else tuple(payload.values[a].shape) for a in c.args]):
            early.append((c.outputs[0], k))
        elif node.op == "sdpa" and _bthd_node(c):
            early.append((c.outputs[0], k))
    late += _prologue_lifetimes(payload, reads, outs)
    return early, late


# ops a concatenated product's consumer group may hold (rope_kv: views, rope, cache writes;
# silu_mul): the end of such a chain bounds where the group runs
_GROUP_OPS = frozenset({"reshape", "permute", "rope", "kv_update", "silu", "mul"})


def _prologue_lifetimes(payload: Payload, reads: Dict[int, List[int]], outs: Set[int]) -> List[Tuple[int, int]]:
    """[(value, later last use)]: the operands of an ``rms_norm`` (and of the ``add`` writing its
    input) that a concatenated product may take as its norm prologue (``match``: h read only by
    2 or 3 linears, at most PROLOGUE_MAX_ROWS rows) live until the last node the product's
    consumer group may hold: the group reads them while it writes the sum and its own outputs,
    from many workgroups, so those outputs must never get their bytes. Conservative (the group
    is decided later, on the plan): only memory, a few rows, is at stake."""
    nodes = payload.nodes
    producer = {o: k for k, n in enumerate(nodes) for o in n.outputs}
    late: List[Tuple[int, int]] = []
    for k, node in enumerate(nodes):
        if node.op != "rms_norm" or len(node.outputs) != 1 or node.outputs[0] in outs:
            continue
        h = node.outputs[0]
        shape = tuple(payload.values[h].shape)
        K = shape[-1] if shape else 1
        if K <= 0 or _dt.numel(shape) // K > PROLOGUE_MAX_ROWS:
            continue
        lin = reads.get(h, [])
        if not 2 <= len(lin) <= MAX_SIBLINGS or any(nodes[j].op != "linear" for j in lin):
            continue
        end, todo, seen = max(lin), [o for j in lin for o in nodes[j].outputs], set()
        while todo:
            v = todo.pop()
            for j in reads.get(v, []):
                if j not in seen and nodes[j].op in _GROUP_OPS:
                    seen.add(j)
                    end = max(end, j)
                    todo += list(nodes[j].outputs)
        src = node.args[0]
        while src in producer and nodes[producer[src]].op == "reshape":  # the norm may read a view of the sum
            src = nodes[producer[src]].args[0]
        a = producer.get(src)
        operands = list(nodes[a].args) if a is not None and nodes[a].op == "add" else [node.args[0]]
        late += [(v, end) for v in operands if v != -1]
    return late


# ---------------------------------------------------------------------------------------- WebGPU

@dataclass(frozen=True)
class Epilogue:
    """The op right after a linear that its matrix kernel carries out instead (matmul_fast.wgsl
    ACT / RES): ``out = gelu(linear)`` (act 1, or 2 for the tanh form) or ``out = linear + res``."""

    consumer: int  # index of the gelu / add dispatch in the payload plan (it then runs nothing)
    act: int
    res: Optional[TensorRef]
    out: TensorRef


@dataclass(frozen=True)
class SdpaFold:
    """Permutes ([0, 2, 1, 3]) around an sdpa that its composite kernels do through strides:
    ``src[name]`` is the [B, T, H, D] tensor a permute turned into q, k or v; ``out`` the
    [B, T, H, D] tensor the permute after the attention writes. ``skip``: those permutes'
    dispatch indices (they run nothing)."""

    src: Dict[str, TensorRef]
    out: Optional[TensorRef]
    skip: Tuple[int, ...]


def _bthd(d: Dispatch) -> bool:
    return d.op == "permute" and len(d.args) == 1 and d.args[0] is not None and len(d.args[0].shape) == 4 \
        and bthd_dims(d.attrs.get("dims", ()))


def sdpa_folds(pp) -> Dict[int, SdpaFold]:
    """sdpa dispatches (by index) whose q / k / v come from a [0, 2, 1, 3] permute read by
    nothing else, or whose output only a [0, 2, 1, 3] permute right after reads. A permuted
    input's source must not be written between the permute and the attention, and a folded
    output must not overlap anything the attention reads (the memory planner arranges both:
    plan.memory)."""
    ds = pp.dispatches
    producer = _producers(ds)
    readers = _readers(ds)
    outs = {r.value for r in pp.outputs}
    found: Dict[int, SdpaFold] = {}
    for j, d in enumerate(ds):
        if d.op != "sdpa" or len(d.outputs) != 1:
            continue
        src: Dict[str, TensorRef] = {}
        skip: List[int] = []
        for name, a in zip("qkv", d.args[:3]):
            p = producer.get(a.value) if a is not None else None
            if p is None or not _bthd(ds[p]) or readers.get(a.value) != [j] or a.value in outs:
                continue
            x = ds[p].args[0]
            if x.dtype != a.dtype or any(_overlap(o.buf, x.buf) for t in range(p + 1, j) for o in ds[t].outputs):
                continue
            src[name] = x
            skip.append(p)
        out = None
        o = d.outputs[0]
        if j + 1 < len(ds) and _bthd(ds[j + 1]) and ds[j + 1].args[0].value == o.value \
                and readers.get(o.value) == [j + 1] and o.value not in outs:
            z = ds[j + 1].outputs[0]
            reads = [a for a in d.args if a is not None] + list(src.values())
            if z.dtype == o.dtype and not any(_overlap(z.buf, r.buf) for r in reads):
                out = z
                skip.append(j + 1)
        if src or out is not None:
            found[j] = SdpaFold(src, out, tuple(sorted(skip)))
    return found


def epilogue_fusions(pp) -> Dict[int, Epilogue]:
    """Linear dispatches (by index in ``pp.dispatches``) whose float32 output is read only by the
    next dispatch, a gelu or an add of a same-shaped float32 tensor, and is no payload output.
    The fused kernel runs at the linear's place and writes the consumer's output, so that output
    must not overlap anything the pair reads (the planner may give it the storage of a value the
    linear reads last: then the pair stays apart)."""
    ds = pp.dispatches
    readers = _readers(ds)
    outs = {r.value for r in pp.outputs}
    found: Dict[int, Epilogue] = {}
    for i in range(len(ds) - 1):
        d, c = ds[i], ds[i + 1]
        if d.op != "linear" or len(d.outputs) != 1 or len(c.outputs) != 1:
            continue
        y, z = d.outputs[0], c.outputs[0]
        if y.dtype != "float32" or z.dtype != "float32" or tuple(z.shape) != tuple(y.shape):
            continue
        if y.value in outs or readers.get(y.value) != [i + 1]:
            continue
        if not epilogue_pair(d.op, c.op, [None if a is None else tuple(a.shape) for a in c.args]):
            continue
        act, res = 0, None
        if c.op == "gelu":
            act = 2 if _ops.normalize_attrs(c.op, c.attrs, c.args)["approximate"] == "tanh" else 1
        else:  # an add of y and a same-shaped tensor (c reads y)
            a0, a1 = c.args
            res = a1 if a0.value == y.value else a0
            if res.value == y.value or res.dtype != "float32":
                continue
        reads = [a for a in d.args if a is not None] + ([res] if res is not None else [])
        if any(_overlap(z.buf, a.buf) for a in reads):
            continue
        found[i] = Epilogue(i + 1, act, res, z)
    return found


def _sibling_sets(pp) -> List[List[int]]:
    """Dispatch indices of 2 to MAX_SIBLINGS float32 linears reading one input with same-shaped resident
    weights of one dtype (float32, or one packed type: ops_quant's kernels batch those), each its
    own buffer, and all with or all without a resident bias, in order."""
    by_x: Dict[tuple, List[int]] = {}
    for k, d in enumerate(pp.dispatches):
        if not sibling_linear(d.op, len(d.outputs), [a is not None for a in d.args]):
            continue
        x, w = d.args[0], d.args[1]
        b = d.args[2] if len(d.args) > 2 else None
        if not (x.dtype == d.outputs[0].dtype == "float32") or (b is not None and b.dtype != "float32"):
            continue
        if w.dtype != "float32" and not _dt.is_packed(w.dtype):
            continue
        if any(t is not None and (t.buf.space != "resident" or t.buf.offset != 0) for t in (w, b)):
            continue
        by_x.setdefault((x.value, tuple(w.shape), w.dtype, b is not None), []).append(k)
    out = []
    for ks in by_x.values():
        ws = [pp.dispatches[k].args[1].buf.index for k in ks]
        if 2 <= len(ks) <= MAX_SIBLINGS and len(set(ws)) == len(ws):
            out.append(ks)
    return out


def _sibling_buffers(pp, ks) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    ds = [pp.dispatches[k] for k in ks]
    return (tuple(d.args[1].buf.index for d in ds),
            tuple(d.args[2].buf.index for d in ds if len(d.args) > 2 and d.args[2] is not None))


def sibling_groups(plan, limits: DeviceLimits) -> List[Tuple[int, ...]]:
    """Groups of resident buffers an executor may place back to back (in order, each at an
    offset_alignment multiple, nothing between) so that sibling linears, float32 linears reading
    one input, run as one batched product (select_all's ``contiguous``): their weights, and their
    biases. Identity layout only; a buffer in two different groups drops both."""
    bufs = plan.prepack.buffers
    align = max(4, limits.offset_alignment)
    groups: List[Tuple[int, ...]] = []
    for pp in plan.payloads.values():
        for ks in _sibling_sets(pp):
            for gr in _sibling_buffers(pp, ks):
                # one buffer for every bias (constants deduplicated: all zeros) needs no placing
                if len(set(gr)) == len(gr) > 1 and all(bufs[i].layout == "identity" and bufs[i].nbytes % align == 0
                                                        for i in gr):
                    groups.append(gr)
    count: Dict[int, set] = {}
    for gr in groups:
        for i in gr:
            count.setdefault(i, set()).add(gr)
    out = []
    for gr in groups:
        if all(len(count[i]) == 1 for i in gr) and gr not in out:
            out.append(gr)
    return out


def _siblings(pp, contiguous, taken) -> Dict[int, List[int]]:
    """First dispatch index -> sibling group (dispatch indices) whose weights (and biases) an
    executor placed back to back, and whose later members' outputs may be written when the first
    runs: they overlap nothing that the dispatches from the first to them read or write."""
    ds = pp.dispatches
    cont = {tuple(g) for g in contiguous}
    found: Dict[int, List[int]] = {}
    for ks in _sibling_sets(pp):
        if set(ks) & taken:
            continue
        wb, bb = _sibling_buffers(pp, ks)
        if wb not in cont or (bb and bb not in cont and len(set(bb)) != 1):
            continue
        ok = True
        for j in ks[1:]:
            o = ds[j].outputs[0]
            refs = [r for t in range(ks[0], j) for r in list(ds[t].args) + list(ds[t].outputs) if r is not None]
            if any(_overlap(o.buf, r.buf) for r in refs):
                ok = False
        if ok:
            found[ks[0]] = ks
    return found


# ---------------------------------------------------------------------------------------- CUDA

@dataclass
class RopeJob:
    """One job of the rope_kv kernel: read ``src`` (a TensorRef whose storage holds the
    projection output; for a concatenated GEMM, ``cat_part`` names its column block instead)
    through ``view`` ops, rotate when ``cos`` is set, write ``dst`` (contiguous) or rows
    ``pos + t`` of the cache ``dst`` (``cache=True``)."""
    src: object  # TensorRef of the root value (the linear output)
    view: List[tuple]  # ("reshape", shape) / ("permute", dims) applied to the root, in order
    shape: Tuple[int, ...]  # [B, H, T, D] read by the job
    dst: object  # TensorRef written
    cache: bool
    rope: bool
    cos: object = None
    sin: object = None
    pos: object = None
    members: List[int] = field(default_factory=list)
    eliminated: List[int] = field(default_factory=list)  # value ids (alias roots) not written
    cat_part: int = -1  # index of the linear in the cat group, when the root comes from one


@dataclass
class Fusion:
    kind: str  # add_rms_norm | silu_mul | rope_kv | sdpa_bthd | sdpa_linear
    members: List[int]  # dispatch indices, sorted; the group runs at members[-1]
    roles: Dict[str, object] = field(default_factory=dict)  # kind-specific dispatch indices / refs
    jobs: List[RopeJob] = field(default_factory=list)
    cat: Optional[List[int]] = None  # linear dispatch indices of a concatenated GEMM (in weight order)
    eliminated: List[int] = field(default_factory=list)
    # a concatenated GEMM's norm prologue (``_norm_prologue``): keys add, norm (dispatch indices,
    # add None without one), x, y, s (TensorRefs of the add, None without it), src (what the norm
    # reads), w (norm weight or None), eps, members (the dispatch indices it added to the group)
    norm: Optional[dict] = None

    @property
    def at(self) -> int:
        return self.members[-1]


# ---------------------------------------------------------------------------------------- CUDA: views

def contiguous_strides(shape: Sequence[int]) -> List[int]:
    st, acc = [], 1
    for n in reversed(list(shape)):
        st.append(acc)
        acc *= max(int(n), 1)
    return st[::-1]


def reshape_strides(shape: Sequence[int], strides: Sequence[int], new: Sequence[int]) -> Optional[List[int]]:
    """Strides of a no-copy reshape of a strided view (numpy's rule), or None when the reshape
    would need a copy. Size-1 dims take any stride."""
    old = [(int(n), int(s)) for n, s in zip(shape, strides) if n != 1]
    new = [int(n) for n in new]
    out = [0] * len(new)
    ni = [i for i, n in enumerate(new) if n != 1]
    oi = 0
    k = 0
    while k < len(ni) or oi < len(old):
        if k >= len(ni) or oi >= len(old):
            return None
        # take old dims until their product matches the next run of new dims
        po, pn = old[oi][0], new[ni[k]]
        o_end, n_end = oi + 1, k + 1
        while po != pn:
            if po < pn:
                if o_end >= len(old):
                    return None
                po *= old[o_end][0]
                o_end += 1
            else:
                if n_end >= len(ni):
                    return None
                pn *= new[ni[n_end]]
                n_end += 1
        for j in range(oi, o_end - 1):  # the old run must be contiguous within itself
            if old[j][1] != old[j + 1][0] * old[j + 1][1]:
                return None
        s = old[o_end - 1][1]
        for j in range(n_end - 1, k - 1, -1):
            out[ni[j]] = s
            s *= new[ni[j]]
        oi, k = o_end, n_end
    for i, n in enumerate(new):
        if n == 1:
            out[i] = 0
    return out


def view_strides(root_shape: Sequence[int], row_stride: int, view: Sequence[tuple]) -> Optional[List[int]]:
    """Element strides of ``view`` applied to a root tensor whose last dim is contiguous and
    whose rows (all leading dims flattened) are ``row_stride`` elements apart."""
    shape = [int(n) for n in root_shape]
    if not shape:
        return None
    strides = contiguous_strides(shape)
    # leading dims: rows row_stride apart
    lead = 1
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = lead * row_stride
        lead *= shape[i]
    for kind, p in view:
        if kind == "reshape":
            s = reshape_strides(shape, strides, p)
            if s is None:
                return None
            shape, strides = [int(n) for n in p], s
        else:
            shape, strides = [shape[d] for d in p], [strides[d] for d in p]
    return strides


# ---------------------------------------------------------------------------------------- CUDA: the graph

def _same_place(a, b) -> bool:
    return a.buf.space == b.buf.space and a.buf.index == b.buf.index and a.buf.offset == b.buf.offset


def _identical(a, b) -> bool:
    return _same_place(a, b) and a.buf.nbytes == b.buf.nbytes


def _norm(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


class _Graph:
    """Readers, producers and alias classes of one payload plan's dispatches."""

    def __init__(self, pp):
        self.d = list(pp.dispatches)
        self.outputs = {r.value for r in pp.outputs}
        self.inputs = {r.value for r in pp.inputs}
        self.producer: Dict[int, int] = _producers(self.d)
        self.ref: Dict[int, object] = {}
        self.root: Dict[int, int] = {}
        self.noop: Set[int] = set()  # dispatch indices of in-place reshapes (alias, nothing runs)
        for k, dp in enumerate(self.d):
            for r in dp.outputs:
                self.ref[r.value] = r
            for r in dp.args:
                if r is not None:
                    self.ref.setdefault(r.value, r)
            if dp.op == "reshape" and dp.args and dp.args[0] is not None and _same_place(dp.args[0], dp.outputs[0]):
                self.noop.add(k)
        for k in sorted(self.noop):
            a, o = self.d[k].args[0].value, self.d[k].outputs[0].value
            self.root[o] = self.root.get(a, a)
        self.readers: Dict[int, List[int]] = {}  # alias root -> dispatches reading any member
        self.members: Dict[int, List[int]] = {}
        for v in self.ref:
            self.members.setdefault(self.root_of(v), []).append(v)
        for k, dp in enumerate(self.d):
            if k in self.noop:
                continue
            for r in dp.args:
                if r is not None:
                    self.readers.setdefault(self.root_of(r.value), []).append(k)

    def root_of(self, v: int) -> int:
        return self.root.get(v, v)

    def readers_of(self, v: int) -> List[int]:
        return sorted(set(self.readers.get(self.root_of(v), [])))

    def is_output(self, v: int) -> bool:
        return any(m in self.outputs for m in self.members.get(self.root_of(v), [v]))

    def only_read_by(self, v: int, allowed: Iterable[int]) -> bool:
        """v (with its aliases) is read only by ``allowed`` dispatches and is no output."""
        allowed = set(allowed)
        rd = self.readers_of(v)
        return bool(rd) and set(rd) <= allowed and not self.is_output(v) and self.root_of(v) not in self.inputs

    def alias_dispatches(self, v: int) -> List[int]:
        """The no-op reshapes of v's alias class."""
        ms = set(self.members.get(self.root_of(v), [v]))
        return [k for k in self.noop if self.d[k].outputs[0].value in ms]

    def source(self, v: int) -> Tuple[int, Optional[int]]:
        """(value, producing dispatch) behind v's alias chain: the root and who wrote it."""
        r = self.root_of(v)
        return r, self.producer.get(r)


# ---------------------------------------------------------------------------------------- CUDA: validation

def validate(g: _Graph, members: Sequence[int], eliminated: Sequence[int], inplace: Sequence[tuple] = (),
             rowwise: bool = False, early: Sequence[object] = ()) -> Optional[str]:
    """None when the group is safe (see the module docstring: CUDA fusion), else the reason it is not."""
    M = sorted(set(members))
    at, first = M[-1], M[0]
    Ms = set(M)
    elim = {g.root_of(v) for v in eliminated}
    for v in elim:
        if not g.only_read_by(v, Ms):
            return f"value {v} is read outside the group or is an output"
    produced = set()
    for k in M:
        if k in g.noop:  # an in-place reshape produces nothing: its class was written before
            continue
        for r in g.d[k].outputs:
            produced.add(g.root_of(r.value))
    reads, kept = [], []
    for k in M:
        if k in g.noop:
            continue
        for r in g.d[k].args:
            if r is not None and g.root_of(r.value) not in produced:
                reads.append(r)
        for r in g.d[k].outputs:
            if g.root_of(r.value) not in elim:
                kept.append(r)
        if k != at and any(r is not None and r.buf.space == "slot" for r in g.d[k].args):
            return f"dispatch {k} reads an offload slot before the group runs"
    kept_roots = {g.root_of(r.value) for r in kept}
    for v in kept_roots:
        for k in g.readers_of(v):
            if k not in Ms and k <= at:
                return f"kept value {v} is read by dispatch {k} before the group runs"
    for t in range(first + 1, at):
        if t in Ms or t in g.noop:
            continue
        for w in g.d[t].outputs:
            if any(_overlap(w.buf, r.buf) for r in reads if r.buf.space == "arena"):
                return f"dispatch {t} overwrites an input of the group"
            if any(_overlap(w.buf, o.buf) for o in kept):
                return f"dispatch {t} writes over a kept output of the group"
        for r in g.d[t].args:
            if r is not None and g.root_of(r.value) in kept_roots:
                return f"dispatch {t} reads kept value {r.value} before the group writes it"
    early_ids = {id(r) for r in early}
    pairs = {(a, b) for a, b in inplace}
    for o in kept:
        for r in reads:
            if not _overlap(o.buf, r.buf):
                continue
            if (r.value, o.value) in pairs and _identical(o, r):
                continue
            if rowwise and _identical(o, r):
                continue
            if id(r) in early_ids or any(e.value == r.value and _identical(e, r) for e in early):
                continue
            return f"output {o.value} overlaps input {r.value}"
    return None


# ---------------------------------------------------------------------------------------- CUDA: patterns

def _trace_view(g: _Graph, v: int, taken: Set[int]):
    """Walk back from value v through permutes and no-op reshapes whose outputs nothing else
    reads. Returns (root TensorRef, view ops root -> v, member dispatches, eliminated roots)."""
    ops: List[tuple] = []
    members: List[int] = []
    elim: List[int] = []
    cur = v
    while True:
        r, k = g.source(cur)
        # reshapes inside the alias class: the root's shape -> cur's shape
        if g.root_of(cur) != cur:
            ops.insert(0, ("reshape", tuple(g.ref[cur].shape)))
            members += g.alias_dispatches(cur)
        if k is None or k in taken:
            break
        dp = g.d[k]
        if dp.op != "permute":
            break
        src = dp.args[0]
        rank = len(src.shape)
        dims = [_norm(int(d), rank) for d in dp.attrs["dims"]]
        ops.insert(0, ("permute", tuple(dims)))
        members.append(k)
        elim.append(r)
        cur = src.value
    root = g.ref[g.root_of(cur)]
    return root, ops, sorted(set(members)), elim


def _rope_jobs(g: _Graph, taken: Set[int]) -> List[RopeJob]:
    jobs = []
    used_rope: Set[int] = set()
    for k, dp in enumerate(g.d):
        if k in taken:
            continue
        if dp.op == "kv_update":
            cache, new, pos = dp.args
            out = dp.outputs[0]
            if not (_identical(cache, out) and cache.dtype == new.dtype == out.dtype and cache.dtype in FLOAT):
                continue
            r, pk = g.source(new.value)
            members, elim, cos = [k] + g.alias_dispatches(new.value), [], None
            sin = None
            x = new
            if pk is not None and g.d[pk].op == "rope" and pk not in taken and g.only_read_by(new.value, [k]):
                rp = g.d[pk]
                x, cos, sin = rp.args
                members.append(pk)
                elim.append(r)
                used_rope.add(pk)
            root, view, vm, velim = _trace_view(g, x.value, taken)
            job = RopeJob(src=root, view=view, shape=tuple(x.shape), dst=out, cache=True, rope=cos is not None,
                          cos=cos, sin=sin, pos=pos, members=sorted(set(members + vm)), eliminated=elim + velim)
            jobs.append(job)
    for k, dp in enumerate(g.d):
        if k in taken or dp.op != "rope" or k in used_rope:
            continue
        x, cos, sin = dp.args
        if not (x.dtype == dp.outputs[0].dtype and x.dtype in FLOAT):
            continue
        root, view, vm, velim = _trace_view(g, x.value, taken)
        jobs.append(RopeJob(src=root, view=view, shape=tuple(x.shape), dst=dp.outputs[0], cache=False, rope=True,
                            cos=cos, sin=sin, members=sorted(set([k] + vm)), eliminated=velim))
    ok = []
    for j in jobs:
        if j.src.dtype != j.dst.dtype or len(j.shape) != 4 or j.shape[3] % 2:
            continue
        if j.rope and (j.cos.dtype != j.sin.dtype or tuple(j.cos.shape) != (j.shape[2], j.shape[3])
                       or tuple(j.sin.shape) != (j.shape[2], j.shape[3])):
            continue
        s = view_strides(j.src.shape, j.src.shape[-1], j.view)
        if s is None or (j.shape[3] > 1 and s[3] != 1):
            continue
        ok.append(j)
    return sorted(ok, key=lambda j: j.members[-1])


def _compatible(a: RopeJob, b: RopeJob) -> bool:
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2] or a.shape[3] != b.shape[3] or a.dst.dtype != b.dst.dtype:
        return False
    cs = [j for j in (a, b) if j.rope]
    if len(cs) == 2 and (cs[0].cos.value != cs[1].cos.value or cs[0].sin.value != cs[1].sin.value):
        return False
    ps = [j for j in (a, b) if j.cache]
    if len(ps) == 2 and (ps[0].pos.value != ps[1].pos.value or ps[0].dst.shape[2] != ps[1].dst.shape[2]):
        return False
    return True


def _rope_group(g: _Graph, jobs: List[RopeJob], extra_members=(), early=()) -> Tuple[Optional[Fusion], Optional[str]]:
    members = sorted(set(m for j in jobs for m in j.members) | set(extra_members))
    elim = [v for j in jobs for v in j.eliminated]
    inplace = [(j.dst.value, j.dst.value) for j in jobs if j.cache]
    # the cache argument of each kv_update is its own in-place output
    pairs = []
    for j in jobs:
        if j.cache:
            k = g.producer[j.dst.value]
            pairs.append((g.d[k].args[0].value, j.dst.value))
    why = validate(g, members, elim, inplace=pairs + inplace, early=early)
    if why is not None:
        return None, why
    return Fusion("rope_kv", members, jobs=list(jobs), eliminated=elim), None


def _silu_mul(g: _Graph, k: int, taken: Set[int]):
    dp = g.d[k]
    a, b = dp.args
    o = dp.outputs[0]
    for s_ref, u in ((a, b), (b, a)):
        r, sk = g.source(s_ref.value)
        if sk is None or sk in taken or g.d[sk].op != "silu":
            continue
        gref = g.d[sk].args[0]
        if not (tuple(gref.shape) == tuple(u.shape) == tuple(o.shape) == tuple(g.d[sk].outputs[0].shape)
                and gref.dtype == u.dtype == o.dtype == s_ref.dtype and o.dtype in FLOAT):
            continue
        members = sorted({k, sk} | set(g.alias_dispatches(s_ref.value)))
        return Fusion("silu_mul", members, roles={"silu": sk, "mul": k, "g": gref, "u": u, "out": o},
                      eliminated=[r])
    return None


def _add_rms(g: _Graph, k: int, taken: Set[int]):
    dp = g.d[k]
    x = dp.args[0]
    r, ak = g.source(x.value)
    if ak is None or ak in taken or g.d[ak].op != "add":
        return None
    a, b = g.d[ak].args
    s = g.d[ak].outputs[0]
    if not (tuple(a.shape) == tuple(b.shape) == tuple(s.shape) and a.dtype == b.dtype == s.dtype == x.dtype
            and x.dtype in FLOAT and tuple(x.shape)[-1:] == tuple(s.shape)[-1:] and s.shape):
        return None
    members = sorted({k, ak} | set(g.alias_dispatches(x.value)))
    return Fusion("add_rms_norm", members, roles={"add": ak, "norm": k, "x": a, "y": b, "s": s,
                                                   "w": dp.args[1] if len(dp.args) > 1 else None,
                                                   "h": dp.outputs[0]})


def _sdpa_bthd(g: _Graph, k: int, taken: Set[int]):
    """linear(reshape(permute(sdpa(q, k, v, mask), [0, 2, 1, 3]))): the attention writes the
    permuted layout into private scratch and the projection reads it there (writing it over the
    planned permute output could race with the attention's own reads of q, whose storage the
    planner may give to that output)."""
    dp = g.d[k]
    src = dp.args[0]
    if len(src.shape) != 4 or not bthd_dims(dp.attrs["dims"]):
        return None
    r, sk = g.source(src.value)
    if sk is None or sk in taken or g.d[sk].op != "sdpa" or g.root_of(src.value) != src.value:
        return None
    if not g.only_read_by(src.value, [k]) or dp.outputs[0].dtype != src.dtype:
        return None
    p = dp.outputs[0]
    rd = g.readers_of(p.value)
    if len(rd) != 1 or rd[0] in taken or g.d[rd[0]].op != "linear" or g.is_output(p.value):
        return None
    lk = rd[0]
    lin = g.d[lk]
    if g.root_of(lin.args[0].value) != g.root_of(p.value) or lin.args[0].shape[-1] != p.shape[2] * p.shape[3]:
        return None
    if lin.args[0].dtype != p.dtype or lin.outputs[0].dtype != p.dtype:
        return None
    if lin.args[1] is None or not _cat_weight(lin.args[1].dtype):
        return None
    members = sorted({sk, k, lk} | set(g.alias_dispatches(p.value)))
    sd = g.d[sk]
    early = [a for a in sd.args if a is not None]
    return Fusion("sdpa_bthd", members, roles={"sdpa": sk, "permute": k, "linear": lk, "early": early},
                  eliminated=[r, p.value])


def _sdpa_linear(g: _Graph, k: int, taken: Set[int]) -> Optional[Fusion]:
    """linear(reshape*(sdpa(...))) for decode rows (the module docstring's ``sdpa_linear``): the
    attention output o [B, H, T, Dv] is read by one linear alone, through no-op reshapes, as its
    [B T, H Dv] rows, which is o's own layout when T or H is 1."""
    sd = g.d[k]
    if len(sd.outputs) != 1 or len(sd.outputs[0].shape) != 4:
        return None
    o = sd.outputs[0]
    B, H, T, Dv = (int(n) for n in o.shape)
    if (T != 1 and H != 1) or not 1 <= B * T <= PROLOGUE_MAX_ROWS or g.root_of(o.value) != o.value:
        return None
    rd = g.readers_of(o.value)
    if len(rd) != 1 or rd[0] in taken or g.d[rd[0]].op != "linear" or not g.only_read_by(o.value, rd):
        return None
    lk = rd[0]
    lin = g.d[lk]
    x = lin.args[0]
    if x is None or lin.args[1] is None or g.root_of(x.value) != o.value or x.dtype != o.dtype \
            or not x.shape or int(x.shape[-1]) != H * Dv or _dt.numel(x.shape) != _dt.numel(o.shape):
        return None
    members = sorted({k, lk} | set(g.alias_dispatches(o.value)))
    early = [a for a in sd.args if a is not None]
    if members[-1] != lk or validate(g, members, [o.value], early=early) is not None:
        return None
    roles = {"sdpa": k, "linear": lk, "early": early, "add": None, "res": None, "out": lin.outputs[0]}
    # The residual add after the product, where no group above took it: the product's epilogue.
    y = lin.outputs[0]
    rd = g.readers_of(y.value)
    if len(rd) == 1 and rd[0] not in taken and g.d[rd[0]].op == "add" and g.root_of(y.value) == y.value:
        ak = rd[0]
        a, b = g.d[ak].args
        z = g.d[ak].outputs[0]
        res = b if a is not None and a.value == y.value else a
        wide = sorted(set(members) | {ak} | set(g.alias_dispatches(y.value)))
        if res is not None and res.value != y.value and tuple(res.shape) == tuple(y.shape) == tuple(z.shape) \
                and wide[-1] == ak and g.only_read_by(y.value, [ak]) \
                and validate(g, wide, [o.value, y.value], early=early) is None:
            members = wide
            roles.update(add=ak, res=res, out=z)
            return Fusion("sdpa_linear", members, roles=roles, eliminated=[o.value, y.value])
    return Fusion("sdpa_linear", members, roles=roles, eliminated=[o.value])


# ---------------------------------------------------------------------------------------- CUDA: cat GEMMs

def _cat_weight(dtype: str) -> bool:
    """A weight dtype a concatenated GEMM reads: float, or one packed GGUF block type (the group
    key keeps the dtype, so a group never mixes them)."""
    return dtype in FLOAT or _dt.is_packed(dtype)


def _linear_ok(dp, value_buffer, payload, streamed) -> Optional[int]:
    """The resident weight buffer (float or packed) of a bias-free linear, else None."""
    if dp.op != "linear" or (len(dp.args) > 2 and dp.args[2] is not None):
        return None
    w = dp.args[1]
    if w is None or w.buf.space != "resident" or not _cat_weight(w.dtype) or len(w.shape) != 2:
        return None
    b = value_buffer.get((payload, w.value))
    if b is None or b in streamed or w.buf.offset != 0:
        return None
    return b


def cat_candidates(plan) -> List[Tuple[int, ...]]:
    """Groups of resident weight buffers (in dispatch order) that the executor should place back
    to back so that linears reading one input can run as one GEMM: 2 or 3 bias-free linears with
    the same input and weight dtype, each weight a 16-byte multiple. A buffer in two different
    groups is dropped from both (the layout can honour only one)."""
    streamed = set(plan.offload.streamed) if plan.offload is not None else set()
    vb = plan.prepack.value_buffer
    groups: List[Tuple[int, ...]] = []
    for p, pp in plan.payloads.items():
        for cand in _cat_sets(pp, p, vb, streamed, plan.prepack.buffers):
            groups.append(tuple(b for b, _ in cand))
    seen: Dict[int, Tuple[int, ...]] = {}
    bad: Set[Tuple[int, ...]] = set()
    for gr in groups:
        for b in gr:
            if b in seen and seen[b] != gr:
                bad.add(gr)
                bad.add(seen[b])
            seen[b] = gr
    out = []
    for gr in groups:
        if gr not in bad and gr not in out:
            out.append(gr)
    return out


def _cat_sets(pp, payload, vb, streamed, buffers):
    """(buffer, dispatch index) lists of linears sharing an input, in dispatch order."""
    by_input: Dict[tuple, List[tuple]] = {}
    for k, dp in enumerate(pp.dispatches):
        b = _linear_ok(dp, vb, payload, streamed)
        if b is None:
            continue
        x = dp.args[0]
        by_input.setdefault((x.value, dp.args[1].dtype, dp.args[1].shape[1]), []).append((b, k))
    out = []
    for key, lst in by_input.items():
        bs = [b for b, _ in lst]
        if 2 <= len(lst) <= 3 and len(set(bs)) == len(bs) and all(buffers[b].nbytes % 16 == 0 for b in bs):
            out.append(lst)
    return out


# ---------------------------------------------------------------------------------------- CUDA: the matcher

def match(pp, payload: int = 0, value_buffer: Optional[dict] = None, contiguous: Sequence[Sequence[int]] = (),
          kinds: Optional[Set[str]] = None) -> List[Fusion]:
    """The fusions of one payload plan, in dispatch order, none sharing a dispatch.

    ``contiguous``: weight buffer groups the executor placed back to back (from
    ``cat_candidates``); ``value_buffer``: ``plan.prepack.value_buffer``. ``kinds`` limits the
    patterns tried (all when None; ``norm_prologue`` lets a concatenated GEMM take its norm)."""
    g = _Graph(pp)
    vb = value_buffer or {}
    want = kinds or {"add_rms_norm", "silu_mul", "rope_kv", "sdpa_bthd", "gemm_cat", "norm_prologue", "sdpa_linear"}
    taken: Set[int] = set()
    out: List[Fusion] = []
    contig = {tuple(c) for c in contiguous}

    def take(f: Fusion):
        taken.update(f.members)
        out.append(f)

    # 1. concatenated GEMMs with their consumers
    if "gemm_cat" in want and contig:
        by_input: Dict[int, List[int]] = {}
        for k, dp in enumerate(g.d):
            if dp.op == "linear" and (len(dp.args) < 3 or dp.args[2] is None) and dp.args[1] is not None \
                    and _cat_weight(dp.args[1].dtype):
                b = vb.get((payload, dp.args[1].value))
                if b is not None and dp.args[1].buf.space == "resident":
                    by_input.setdefault(dp.args[0].value, []).append(k)
        for x, ks in by_input.items():
            bufs = tuple(vb[(payload, g.d[k].args[1].value)] for k in ks)
            if bufs not in contig:
                continue
            f = _cat_group(g, ks, taken, want)
            if f is not None:
                take(f)
    # 2. the single patterns
    if "rope_kv" in want:
        jobs = [j for j in _rope_jobs(g, taken) if not set(j.members) & taken]
        cur: List[RopeJob] = []
        for j in jobs:
            if set(j.members) & taken:
                continue
            if cur and len(cur) < 3 and all(_compatible(c, j) for c in cur):
                f, _ = _rope_group(g, cur + [j])
                if f is not None:
                    cur = cur + [j]
                    continue
            if cur:
                f, _ = _rope_group(g, cur)
                if f is not None:
                    take(f)
            cur = [j]
        if cur:
            f, _ = _rope_group(g, cur)
            if f is not None:
                take(f)
    for k, dp in enumerate(g.d):
        if k in taken:
            continue
        f = None
        if dp.op == "mul" and "silu_mul" in want:
            f = _silu_mul(g, k, taken)
            if f is not None and validate(g, f.members, f.eliminated, rowwise=True) is not None:
                f = None
        elif dp.op == "rms_norm" and "add_rms_norm" in want:
            f = _add_rms(g, k, taken)
            if f is not None and validate(g, f.members, [], rowwise=True) is not None:
                f = None
        elif dp.op == "permute" and "sdpa_bthd" in want:
            f = _sdpa_bthd(g, k, taken)
            if f is not None and validate(g, f.members, f.eliminated, early=f.roles["early"]) is not None:
                f = None
        if f is not None and not set(f.members) & taken:
            take(f)
    # 3. an attention into the product after it, where no group above took either
    if "sdpa_linear" in want:
        for k, dp in enumerate(g.d):
            if dp.op == "sdpa" and k not in taken:
                f = _sdpa_linear(g, k, taken)
                if f is not None:
                    take(f)
    return sorted(out, key=lambda f: f.at)


def _cat_group(g: _Graph, ks: List[int], taken: Set[int], want) -> Optional[Fusion]:
    """A concatenated GEMM over linears ``ks`` (weights back to back, in this order) with the
    consumer that reads its column blocks: rope_kv jobs (q/k/v) or silu_mul (gate/up)."""
    if set(ks) & taken:
        return None
    outs = [g.d[k].outputs[0] for k in ks]
    if len({o.dtype for o in outs}) != 1 or g.d[ks[0]].args[0].dtype != outs[0].dtype:
        return None
    ws = [g.d[k].args[1] for k in ks]
    if len({(w.dtype, tuple(w.shape[1:])) for w in ws}) != 1:
        return None  # one GEMM reads one weight dtype with one K
    x = g.d[ks[0]].args[0]
    # gate/up: silu(lin_a) * lin_b
    if len(ks) == 2 and "silu_mul" in want:
        for k in range(len(g.d)):
            if k in taken or g.d[k].op != "mul":
                continue
            f = _silu_mul(g, k, taken)
            if f is None:
                continue
            gsrc, gk = g.source(f.roles["g"].value)
            usrc, uk = g.source(f.roles["u"].value)
            if {gk, uk} != set(ks) or g.root_of(f.roles["g"].value) != f.roles["g"].value \
                    or g.root_of(f.roles["u"].value) != f.roles["u"].value:
                continue
            members = sorted(set(f.members) | set(ks))
            elim = f.eliminated + [gsrc, usrc]
            if validate(g, members, elim, rowwise=True, early=[x]) is None:
                f = Fusion("silu_mul", members, roles={**f.roles, "g_part": ks.index(gk), "u_part": ks.index(uk)},
                           cat=list(ks), eliminated=elim)
                return _norm_prologue(g, f, x, taken) if "norm_prologue" in want else f
    if "rope_kv" not in want:
        return None
    jobs = [j for j in _rope_jobs(g, taken) if j.src.value in {o.value for o in outs}]
    if len(jobs) != len(ks) or any(not g.only_read_by(j.src.value, j.members) for j in jobs):
        return None
    for j in jobs:
        j.cat_part = [o.value for o in outs].index(j.src.value)
        j.eliminated = j.eliminated + [j.src.value]
    for a in range(len(jobs)):
        for b in range(a + 1, len(jobs)):
            if not _compatible(jobs[a], jobs[b]):
                return None
    f, _ = _rope_group(g, jobs, extra_members=ks, early=[x])
    if f is None:
        return None
    f.cat = list(ks)
    return _norm_prologue(g, f, x, taken) if "norm_prologue" in want else f


def _norm_prologue(g: _Graph, f: Fusion, x, taken: Set[int]) -> Fusion:
    """Concatenated GEMM ``f`` (input ``x``) with the ``rms_norm`` that writes x, and the ``add``
    that writes the norm's input, taken in as its prologue (``Fusion.norm``), or ``f`` unchanged.

    Only for at most PROLOGUE_MAX_ROWS rows (decode: each workgroup of the product recomputes the
    rows' sums of squares) and when x is read by the GEMM alone. The group then writes the sum s
    (a kept output) from one workgroup while the others still read the add's operands, so nothing
    it writes may overlap what it reads, not even row for row (no ``rowwise``, nothing read
    early): ``fusion_lifetimes`` keeps those operands alive until the group's consumer so the
    memory planner never gives their bytes away, and where they still overlap the group keeps
    the norm apart."""
    h, nk = g.source(x.value)
    if nk is None or nk in taken or g.d[nk].op != "rms_norm" or len(g.d[nk].outputs) != 1:
        return f
    nd = g.d[nk]
    K = x.shape[-1] if x.shape else 0
    rows = _dt.numel(x.shape) // K if K else 0
    if not 1 <= rows <= PROLOGUE_MAX_ROWS or not g.only_read_by(h, f.cat):
        return f
    src = nd.args[0]
    w = nd.args[1] if len(nd.args) > 1 else None
    ho = nd.outputs[0]
    if not (src.dtype in FLOAT and ho.dtype == x.dtype and tuple(src.shape)[-1:] == (K,)
            and _dt.numel(src.shape) == _dt.numel(x.shape) and (w is None or (w.dtype in FLOAT and tuple(w.shape) == (K,)))):
        return f
    at = f.at
    members = {nk} | set(g.alias_dispatches(h))
    norm = {"add": None, "norm": nk, "x": None, "y": None, "s": None, "src": src, "w": w,
            "eps": float(nd.attrs.get("eps", 1e-6))}
    s_root, ak = g.source(src.value)
    if ak is not None and ak not in taken and g.d[ak].op == "add" and len(g.d[ak].outputs) == 1:
        a, b = g.d[ak].args
        s = g.d[ak].outputs[0]
        if a is not None and b is not None and tuple(a.shape) == tuple(b.shape) == tuple(s.shape) \
                and a.dtype == b.dtype == s.dtype == src.dtype and _dt.numel(s.shape) == _dt.numel(src.shape):
            # the add's output and the views of it before the group (later views read the kept sum)
            members |= {ak} | {k for k in g.alias_dispatches(s_root) if k < at}
            norm.update(add=ak, x=a, y=b, s=s)
    norm["members"] = sorted(members)
    members = sorted(set(f.members) | members)
    elim = f.eliminated + [h]
    pairs = [(g.d[g.producer[j.dst.value]].args[0].value, j.dst.value) for j in f.jobs if j.cache]
    pairs += [(j.dst.value, j.dst.value) for j in f.jobs if j.cache]
    if members[-1] != at or validate(g, members, elim, inplace=pairs) is not None:
        return f
    return Fusion(f.kind, members, roles=f.roles, jobs=f.jobs, cat=f.cat, eliminated=elim, norm=norm)
