"""Kernel selection for the WebGPU executor (desktop wgpu and the browser): pure Python.

Given one :class:`~gpudelegate.plan.types.Dispatch` of a plan, :func:`select` returns the kernel
calls that carry it out: which shader file (``gpudelegate.shaders.source(name)``) and entry
point, the pipeline-overridable constants, the uniform bytes (binding 0), the storage bindings
(byte ranges of plan buffers) and the workgroup counts. Executors only create pipelines and bind
groups from these and replay them; desktop and browser therefore run exactly the same kernels
with exactly the same parameters.

This module is the public face of the lowering: the vocabulary and shared machinery live in
:mod:`.kernel`, the per-op lowering functions in the op family modules (:mod:`.ops_layout`,
:mod:`.ops_matmul`, :mod:`.ops_rows`, :mod:`.ops_attention`; :mod:`.ops_quant` for ops reading a
packed GGUF weight), each registering its ops with ``kernel.lowers``, and the decisions about which dispatches run as one kernel (fused epilogues,
folded head permutes, sibling linears) in :mod:`gpudelegate.plan.fusion`.

Conventions every executor follows:

- ``@group(0)``: binding 0 is the uniform, bindings 1.. the storage buffers listed in
  ``KernelCall.bindings`` (every one the entry point uses; all are ``read_write`` storage, because
  WebGPU forbids one buffer in a read-only and a writable binding of one dispatch, and the memory
  planner places an op's inputs and output at offsets of one buffer).
- A binding's ``buf`` is a :class:`BufferRef` whose ``space`` is a plan space (``arena``,
  ``resident``, ``slot``), ``scratch`` (a per-payload temporary: allocate ``scratch_sizes(calls)``),
  or ``dummy`` (an unused input: a range of one buffer of ``dummy_nbytes(limits)`` bytes; each
  slot gets its own range).
- No two bindings of one call overlap (WebGPU/Dawn rejects overlapping writable bindings, and all
  of ours are writable): binding 1 is the one every kernel writes; an input whose range overlaps
  an earlier binding of the call (``x * x``, an op reading its own output) is first copied into a
  scratch ("snapshot") by a call of its own, so executors need no workaround. ``offset`` is a multiple of the
  device's storage offset alignment and ``nbytes`` (the bound size) a multiple of 4, so every
  buffer must be allocated with its size rounded up to 4 bytes.
- Calls of one dispatch run in order in one compute pass (WebGPU orders storage writes between
  dispatches); a dispatch may leave nothing to run (``reshape`` where the plan aliased storage).

Carrying out one call (both executors)::

    module   = createShaderModule(gpudelegate.shaders.source(call.shader))      # cache per file
    pipeline = createComputePipeline(module, call.entry, constants=call.constants,
                                     layout: binding 0 uniform, b.binding storage for b in bindings)
                                     # cache per call.pipeline_key ("auto" layout also works: each
                                     # entry uses exactly its bindings, tests/test_wgpu_kernels.py)
    group    = {0: a uniform buffer range holding call.uniform (size rounded up to 4)}
             + {b.binding: (buffer of b.buf.space/index, b.buf.offset, b.buf.nbytes)}
    pass.setPipeline(pipeline); pass.setBindGroup(0, group); pass.dispatchWorkgroups(*call.workgroups)

Tensors larger than ``limits.max_binding_size`` are split: map kernels (elementwise, layout ops,
casts) into sub-boxes, matrix products along N (a weight's rows), M or the batch, embedding tables
into row ranges, row kernels (norms, softmax, reductions) into row ranges. What cannot be split
raises :class:`DeviceError` naming the tensor and the limit.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from .. import dtypes as _dt
from .. import ops as _ops
from ..errors import PayloadError, UnsupportedOpError
from ..plan.fusion import _siblings, epilogue_fusions, sdpa_folds
from ..plan.types import BufferRef, DeviceLimits, Dispatch, TensorRef
# Binding, MAX_SLOT, dummy_nbytes and scratch_sizes are for the executors (the names they use
# from this module are listed in __all__).
from .kernel import (LOWERINGS, MAX_SLOT, Binding, KernelCall, Tuning, _Lowering, _NoFusion, _numel, _T,  # noqa: F401
                     _TooBig, dummy_nbytes, lowering_of, scratch_sizes)
# The op families: importing them registers their ops in LOWERINGS (ops_quant: PACKED_LOWERINGS).
from . import ops_attention, ops_fused, ops_layout, ops_matmul, ops_quant, ops_rows  # noqa: F401
from .ops_attention import _sdpa
from .ops_matmul import _lower_siblings
from .ops_quant import lower_packed_siblings

__all__ = ["KernelCall", "Binding", "Tuning", "select", "select_all", "scratch_sizes", "dummy_nbytes",
           "pack_fp16_calls", "SUPPORTED_OPS", "MAX_SLOT"]

SUPPORTED_OPS = tuple(sorted(LOWERINGS))


def select(d: Dispatch, limits: DeviceLimits, features=(), tuning: Optional[Tuning] = None,
           precision: str = "exact", configs: Sequence[dict] = (),
           subgroup_size: int = 0) -> List[KernelCall]:
    """The kernel calls that carry out dispatch ``d`` on a device with ``limits`` (in order).
    ``precision`` is the session's (``"fast"`` lets products round inputs to float16) and
    ``configs`` the device's subgroup-matrix shapes (``GPUDevice.subgroup_matrix_configs``) and
    ``subgroup_size`` the invocations per subgroup it runs (``GPUDevice.subgroup_size()``; 0 none).
    Raises UnsupportedOpError for an op without WGSL kernels and DeviceError for tensors over the
    device's limits that cannot be split."""
    fn = lowering_of(d)
    if fn is None:
        raise UnsupportedOpError("", f"op {d.op!r} has no WGSL kernel")
    attrs = _ops.normalize_attrs(d.op, d.attrs, d.args)
    lw = _Lowering(d, limits, features, tuning or Tuning(), precision, configs, subgroup_size)
    if any(_numel(o.shape) == 0 for o in d.outputs):
        return []
    try:
        fn(lw, d, attrs)
    except _TooBig as e:
        raise lw.too_big(e.t, e.nbytes) from None
    return lw.calls


def select_all(pp, limits: DeviceLimits, features=(), tuning: Optional[Tuning] = None,
               where: str = "", contiguous: Sequence[Sequence[int]] = (),
               fusions: Optional[Sequence] = None, precision: str = "exact",
               configs: Sequence[dict] = (), subgroup_size: int = 0) -> List[List[KernelCall]]:
    """The kernel calls of every dispatch of payload plan ``pp`` (one list per dispatch, in order),
    with the epilogues of ``epilogue_fusions`` folded into their linears' kernels where the
    float32 fast kernel runs the product (else the pair is lowered apart), the permutes of
    ``sdpa_folds`` in the attention, and sibling linears whose resident weights (and biases) the
    executor placed back to back (``contiguous``, from ``sibling_groups``) as one batched product
    at the first of them. The planner's fusions (``fusions``: plan.fusion.match's groups, of the
    kinds ops_fused.KINDS, as ops_fused.plan_fusions gives them for a session plan; None: match on
    ``pp`` alone, without concatenated GEMMs) run in shaders/fused.wgsl at each group's last
    member; a group takes its dispatches from the epilogues and sibling linears (they then give
    SmolLM2 decode fewer dispatches), never from a folded attention. ``precision`` and
    ``configs`` and ``subgroup_size`` as for :func:`select`. Errors name ``{where}.ops[node]``."""
    t = tuning or Tuning()

    def _select_with(d, limits, features, tuning, lower, what="", out=None):
        return _select_lowered(d, limits, features, tuning, lower, what, out, precision, configs, subgroup_size)

    fz = epilogue_fusions(pp) if t.fuse else {}
    folds = sdpa_folds(pp) if t.fuse else {}
    # A permute folded into the attention after it runs nothing, so it must not be lowered
    # before we know the fold holds: lower the attentions first.
    fold_calls: Dict[int, List[KernelCall]] = {}
    skip = set()
    for j, f in folds.items():
        d = pp.dispatches[j]
        try:
            calls = _select_with(d, limits, features, t, lambda lw, attrs: _sdpa(lw, d, attrs, f))
        except PayloadError as e:
            raise type(e)(f"{where}.ops[{d.node}]{('.' + e.path) if e.path else ''}", e.detail) from None
        if calls is not None:
            fold_calls[j] = calls
            skip.update(f.skip)
    fused: Dict[int, List[KernelCall]] = {}
    claimed = skip | set(fold_calls)
    todo = list(ops_fused.payload_fusions(pp) if fusions is None else fusions) if t.fuse else []
    while todo:
        f = todo.pop(0)
        if f.kind not in ops_fused.KINDS or set(f.members) & claimed:
            continue
        d = pp.dispatches[f.at]
        try:
            calls = _select_with(d, limits, features, t, lambda lw, attrs: ops_fused.lower(lw, pp, f, contiguous),
                                 f" fused {f.kind}{' + gemm_cat' if f.cat else ''}{' + norm' if f.norm else ''}")
        except PayloadError as e:
            raise type(e)(f"{where}.ops[{d.node}]{('.' + e.path) if e.path else ''}", e.detail) from None
        if calls is not None:
            fused[f.at] = calls
            claimed |= set(f.members)
            skip.update(set(f.members) - {f.at})
        elif f.norm is not None:
            # A group whose product no kernel here takes (e.g. float16 gate/up): its norm and the
            # group without it, each as the planner would have grouped them apart.
            todo[:0] = ops_fused.split_norm(pp, f)
    fz = {i: e for i, e in fz.items() if i not in claimed and e.consumer not in claimed}
    sib = _siblings(pp, contiguous, set(fz) | claimed) if t.fuse and contiguous else {}
    sib_calls: Dict[int, List[KernelCall]] = {}
    for k0, ks in sib.items():
        ds = [pp.dispatches[k] for k in ks]
        sib_lower = lower_packed_siblings if _dt.is_packed(ds[0].args[1].dtype) else _lower_siblings
        calls = _select_with(ds[0], limits, features, t, lambda lw, attrs: sib_lower(lw, ds),
                             f" + {len(ks) - 1} sibling linears")
        if calls is not None:
            sib_calls[k0] = calls
            skip.update(ks[1:])
    out: List[List[KernelCall]] = []
    for k, d in enumerate(pp.dispatches):
        if k in skip:
            out.append([])
            continue
        if k in fold_calls:
            out.append(fold_calls[k])
            continue
        if k in fused:
            out.append(fused[k])
            continue
        if k in sib_calls:
            out.append(sib_calls[k])
            continue
        try:
            calls = None
            if k in fz:
                lower = lowering_of(d)  # the float or the packed-weight linear, both take the epilogue
                calls = _select_with(d, limits, features, t, lambda lw, attrs: lower(lw, d, attrs, fz[k]),
                                     " + gelu" if fz[k].act else " + add", fz[k].out)
            if calls is None:
                calls = select(d, limits, features, t, precision, configs, subgroup_size)
            else:
                skip.add(fz[k].consumer)
        except PayloadError as e:
            raise type(e)(f"{where}.ops[{d.node}]{('.' + e.path) if e.path else ''}", e.detail) from None
        out.append(calls)
    return out


def _select_lowered(d: Dispatch, limits, features, tuning: Tuning, lower, what: str = "",
                    out: Optional[TensorRef] = None, precision: str = "exact",
                    configs: Sequence[dict] = (),
                    subgroup_size: int = 0) -> Optional[List[KernelCall]]:
    """``lower(lw, attrs)``'s calls for ``d``, or None when it declines (_NoFusion) or an output
    is empty."""
    if any(_numel(o.shape) == 0 for o in list(d.outputs) + ([out] if out is not None else [])):
        return None
    lw = _Lowering(d, limits, features, tuning, precision, configs, subgroup_size)
    lw.label += what
    try:
        lower(lw, _ops.normalize_attrs(d.op, d.attrs, d.args))
    except _NoFusion:
        return None
    except _TooBig as e:
        raise lw.too_big(e.t, e.nbytes) from None
    return lw.calls


def pack_fp16_calls(src: BufferRef, dst: BufferRef, numel: int, limits: DeviceLimits,
                    label: str = "prepack fp16") -> List[KernelCall]:
    """The pack kernel of the ``fp16`` prepack layout: float32 ``src`` -> float16 ``dst``."""
    d = Dispatch(-1, "cast", {"dtype": "float16"}, [], [])
    lw = _Lowering(d, limits, (), Tuning())
    lw.label = label
    s = _T(src.space, src.index, src.offset, "float32", numel, f"{label} source")
    t = _T(dst.space, dst.index, dst.offset, "float16", numel, f"{label} destination")
    try:
        lw.copy_tensor(s, t, (numel,), what="pack")
    except _TooBig as e:
        raise lw.too_big(e.t, e.nbytes) from None
    return lw.calls
