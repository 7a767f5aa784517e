"""The numpy reference executor (device kind ``reference``): the golden one, and a plan checker.

It carries out a :class:`~gpudelegate.plan.types.SessionPlan` *faithfully*, with host memory
standing in for device memory, so every planner decision is exercised for real:

- each arena memory object is one ``bytearray``; every value is a numpy view at its planned
  (object, offset), so two live values given overlapping bytes corrupt each other and the
  conformance suite sees wrong numbers;
- resident constant buffers are separate ``bytearray``s filled by the prepack phase (identity copy
  or float32 -> float16 pack), chunk by chunk per ``plan.prepack.chunks``, with progress; packed
  (GGUF block) weights among them are decoded with gguf on first use and kept decoded until the
  next prepack;
- with an offload plan, streamed weights are packed into host mirrors and copied into ring-slot
  ``bytearray``s per ``plan.offload.loads[payload]``. Each copy happens right before the
  dispatch the plan places it at (``OffloadLoad.at``), and every read of a slot checks that the
  slot holds the weight the dispatch expects and that the plan waits for that load before the
  read: a wrong schedule raises PlanError instead of silently working.

Plan-structure violations (a location outside its memory object, an alias op whose output is not
at its input's location, a tensor over the device limits, a load placed after its reader) are
:class:`~gpudelegate.errors.PlanError`: bugs in the planner (or a hand-edited plan), not in the
user's input.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from gpudelegate import dtypes as _dt
from gpudelegate import ops as _ops
from gpudelegate.errors import InputError, PayloadError, PlanError, UnsupportedOpError
from gpudelegate.executor import DeviceContext, DeviceTensor, Executor, HostTensor, Progress
from gpudelegate.plan.types import (BufferRef, DeviceLimits, OffloadLoad, PayloadPlan, SessionPlan,
                                    TensorRef)
from gpudelegate.program import Program

from .hostio import NP_DTYPE, from_storage, to_storage
from .quant import PackedWeight
from .reference_kernels import KERNELS


def _view(buf: bytearray, ref: TensorRef, dequantized: Optional[dict] = None):
    if _dt.is_packed(ref.dtype):  # a weight's blocks: kernels that accept one dequantize it
        raw = np.frombuffer(buf, dtype=np.uint8, count=_dt.nbytes(ref.dtype, ref.shape), offset=ref.buf.offset)
        key = (ref.buf.space, ref.buf.index, ref.buf.offset, ref.dtype, tuple(ref.shape))
        return PackedWeight(ref.dtype, ref.shape, raw, cache=dequantized, key=key)
    n = _dt.numel(ref.shape)
    return np.frombuffer(buf, dtype=NP_DTYPE[ref.dtype], count=n, offset=ref.buf.offset).reshape(ref.shape)


@dataclass
class _Step:
    """One recorded dispatch: kernel, argument views and output views, made once."""

    node: int
    op: str
    attrs: dict
    kernel: Any
    args: List[Optional[np.ndarray]]
    outs: List[np.ndarray]
    out_dtypes: List[str]
    slot_reads: List[tuple]  # (arg position, slot, expected buffer)
    skip: bool  # a pure view (reshape) already at its input's bytes: nothing to compute


@dataclass
class _SlotState:
    buffer: int = -1  # resident-buffer index of the weight the slot holds (-1: empty)
    load: Optional[OffloadLoad] = None  # the load that put it there (None: a previous run)


class ReferenceExecutor(Executor):
    kind = "reference"

    def __init__(self, context: "ReferenceContext", program: Program, profile: bool = False):
        super().__init__(context, program)
        self.profile = profile
        self.timings: List[tuple] = []  # (payload, node, op, seconds) when profiling
        self.arenas: Dict[int, List[bytearray]] = {}
        self.buffers: Dict[int, bytearray] = {}  # resident buffer index -> device bytes
        self.host_mirrors: Dict[int, bytearray] = {}  # streamed buffer index -> host bytes
        self.slots: List[bytearray] = []
        self.slot_state: List[_SlotState] = []
        self.steps: Dict[int, List[_Step]] = {}
        self.prepacked = False
        self.bytes_streamed = 0  # host -> slot bytes copied, for tests and benchmarks
        # Dequantized float32 values of packed weights in resident buffers, shared by every
        # dispatch (and payload) that reads one: gguf decodes a 4-bit LLM's weights in seconds, once
        # per session instead of once per run. Only prepack writes resident buffers, and it empties
        # this; offload slots are re-filled by loads, so their views never use it.
        self.dequantized: Dict[tuple, np.ndarray] = {}

    # ------------------------------------------------------------------ allocate
    def allocate(self, plan: SessionPlan) -> None:
        self.plan = plan
        lim = self.limits
        streamed = set(plan.offload.streamed) if plan.offload is not None else set()
        for i, b in enumerate(plan.prepack.buffers):
            if b.nbytes > lim.max_buffer_size and i not in streamed:
                raise PlanError(f"plan: resident buffer {i} is {b.nbytes} bytes, over max_buffer_size {lim.max_buffer_size}")
            (self.host_mirrors if i in streamed else self.buffers)[i] = bytearray(b.nbytes)
        if plan.offload is not None:
            self.slots = [bytearray(n) for n in plan.offload.slots]
            self.slot_state = [_SlotState() for _ in self.slots]
        for p, pp in plan.payloads.items():
            for k, size in enumerate(pp.memory.objects):
                if size > lim.max_buffer_size:
                    raise PlanError(f"plan: payloads[{p}] memory object {k} is {size} bytes, over "
                                       f"max_buffer_size {lim.max_buffer_size}")
            self.arenas[p] = [bytearray(n) for n in pp.memory.objects]
            for where, ref in self._refs(pp):
                self._check_ref(p, where, ref)

    @staticmethod
    def _refs(pp: PayloadPlan):
        for i, r in enumerate(pp.inputs):
            yield f"inputs[{i}]", r
        for i, r in enumerate(pp.outputs):
            yield f"outputs[{i}]", r
        for d in pp.dispatches:
            for j, r in enumerate(d.args):
                if r is not None:
                    yield f"ops[{d.node}].args[{j}]", r
            for j, r in enumerate(d.outputs):
                yield f"ops[{d.node}].outputs[{j}]", r

    def _container(self, p: int, buf: BufferRef) -> bytearray:
        try:
            if buf.space == "arena":
                return self.arenas[p][buf.index]
            if buf.space == "resident":
                return self.buffers[buf.index]
            if buf.space == "slot":
                return self.slots[buf.index]
        except (KeyError, IndexError):
            raise PlanError(f"plan: payloads[{p}] refers to {buf.space} {buf.index}, which does not exist") from None
        raise PlanError(f"plan: payloads[{p}] uses unknown buffer space {buf.space!r}")

    def _check_ref(self, p: int, where: str, ref: TensorRef) -> None:
        at = f"plan: payloads[{p}].{where} (value {ref.value}, {ref.dtype}{list(ref.shape)})"
        want = _dt.nbytes(ref.dtype, ref.shape)
        if ref.buf.nbytes != want:
            raise PlanError(f"{at}: location holds {ref.buf.nbytes} bytes, the tensor is {want}")
        cont = self._container(p, ref.buf)
        if ref.buf.offset < 0 or ref.buf.offset + want > len(cont):
            raise PlanError(f"{at}: bytes [{ref.buf.offset}, {ref.buf.offset + want}) run past "
                               f"{ref.buf.space} {ref.buf.index} of {len(cont)} bytes")

    # ------------------------------------------------------------------ record
    def record(self, plan: SessionPlan) -> None:
        for p, pp in plan.payloads.items():
            steps = []
            for d in pp.dispatches:
                kernel = KERNELS.get(d.op)
                if kernel is None:
                    raise UnsupportedOpError(f"payloads[{p}].ops[{d.node}]", f"no reference kernel for op {d.op!r}")
                args = [None if r is None else _view(self._container(p, r.buf), r,
                                                     self.dequantized if r.buf.space == "resident" else None)
                        for r in d.args]
                outs = [_view(self._container(p, r.buf), r) for r in d.outputs]
                slot_reads = []
                for j, r in enumerate(d.args):
                    if r is not None and r.buf.space == "slot":
                        expected = plan.prepack.value_buffer.get((p, r.value))
                        if expected is None:
                            raise PlanError(f"plan: payloads[{p}].ops[{d.node}].args[{j}] reads slot {r.buf.index} "
                                               f"but value {r.value} is not a weight of the prepack plan")
                        slot_reads.append((j, r.buf.index, expected))
                alias = _ops.get(d.op).alias
                skip = False
                if alias is not None:
                    a, o = d.args[alias], d.outputs[0]
                    if a is None or (a.buf.space, a.buf.index, a.buf.offset) != (o.buf.space, o.buf.index, o.buf.offset):
                        raise PlanError(f"plan: payloads[{p}].ops[{d.node}] ({d.op}) output 0 must share the storage "
                                           f"of args[{alias}]: {o.buf} vs {None if a is None else a.buf}")
                    # reshape of a contiguous tensor is the same bytes: a true alias costs nothing.
                    skip = d.op == "reshape" and a.dtype == o.dtype
                steps.append(_Step(d.node, d.op, d.attrs, kernel, args, outs, [r.dtype for r in d.outputs],
                                   slot_reads, skip))
            self.steps[p] = steps

    # ------------------------------------------------------------------ prepack
    def prepack(self, plan: SessionPlan, progress: Progress = None) -> None:
        bufs = plan.prepack.buffers
        total = sum(b.nbytes for b in bufs)
        done = 0
        chunks = plan.prepack.chunks
        covered = sorted(i for c in chunks for i in c)
        if covered != list(range(len(bufs))):
            raise PlanError(f"plan: prepack chunks cover buffers {covered}, expected each of 0..{len(bufs) - 1} once")
        self.dequantized.clear()  # the resident bytes change below: decoded values would be stale
        for chunk in chunks:
            for i in chunk:
                self._pack(i)
                done += bufs[i].nbytes
            if progress is not None:
                progress(done, total)
        if progress is not None and not chunks:
            progress(0, 0)
        self.prepacked = True

    def _pack(self, i: int) -> None:
        b = self.plan.prepack.buffers[i]
        c = self.program.constants[b.constant]
        raw = self.program.constant_bytes(b.constant)
        where = f"prepack buffer {i} (constants[{b.constant}], layout {b.layout!r})"
        if raw.nbytes != b.src_nbytes or raw.nbytes != c.nbytes:
            raise PayloadError(where, f"constant has {raw.nbytes} bytes; the plan expects {b.src_nbytes}")
        src = np.frombuffer(raw, dtype=np.uint8 if _dt.is_packed(c.dtype) else NP_DTYPE[c.dtype])
        src = src if _dt.is_packed(c.dtype) else src.reshape(c.shape)
        if b.layout == "identity":
            packed = src
        elif b.layout == "fp16":
            if c.dtype != "float32":  # the prepack planner refuses such entries
                raise PlanError(f"plan: {where}: fp16 packs float32 constants, this one is {c.dtype}")
            packed = src.astype(np.float16)
        else:
            raise PlanError(f"plan: {where}: unknown layout {b.layout!r}")
        dst = self.buffers.get(i)
        if dst is None:
            dst = self.host_mirrors[i]
        if packed.nbytes != len(dst):
            raise PlanError(f"plan: {where} packs to {packed.nbytes} bytes into a {len(dst)}-byte buffer")
        memoryview(dst)[:] = packed.tobytes()

    # ------------------------------------------------------------------ run
    def _load_order(self, p: int) -> List[tuple]:
        """(position, load) pairs in the plan's order: each load is performed right before
        ``dispatches[position]`` (``ld.at``, placed by the planner). Only what this executor relies
        on is checked here; what the plan gets wrong beyond that shows up as a wrong slot read."""
        if self.plan.offload is None:
            return []
        disp = self.plan.payloads[p].dispatches
        order = []
        for li, ld in enumerate(self.plan.offload.loads.get(p, [])):
            at = ld.at
            if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at <= len(disp):
                raise PlanError(f"plan: payloads[{p}] load {li} (buffer {ld.buffer} -> slot {ld.slot}) is placed at "
                                f"{at!r}, not a position in its {len(disp)} dispatches")
            if order and at < order[-1][0]:
                raise PlanError(f"plan: payloads[{p}] load {li} is placed at {at}, before the load listed ahead of it "
                                f"(at {order[-1][0]}): loads are listed by position")
            if at == len(disp) or disp[at].node > ld.needed_by:
                where = "after the last dispatch" if at == len(disp) else f"before node {disp[at].node}"
                raise PlanError(f"plan: payloads[{p}] load of buffer {ld.buffer} into slot {ld.slot} is placed {where}, "
                                f"after node {ld.needed_by} that needs it")
            order.append((at, ld))
        return order

    def _do_load(self, p: int, ld: OffloadLoad) -> None:
        src = self.host_mirrors.get(ld.buffer)
        if src is None:
            raise PlanError(f"plan: payloads[{p}] streams buffer {ld.buffer}, which is not in offload.streamed")
        slot = self.slots[ld.slot]
        if len(src) > len(slot):
            raise PlanError(f"plan: buffer {ld.buffer} ({len(src)} bytes) does not fit slot {ld.slot} ({len(slot)} bytes)")
        memoryview(slot)[:len(src)] = src
        self.slot_state[ld.slot] = _SlotState(ld.buffer, ld)
        self.bytes_streamed += len(src)

    def _check_slot(self, p: int, step: _Step, j: int, slot: int, expected: int) -> None:
        st = self.slot_state[slot]
        where = f"payloads[{p}].ops[{step.node}] ({step.op}) args[{j}]"
        if st.buffer != expected:
            held = "nothing" if st.buffer < 0 else f"buffer {st.buffer}"
            raise PlanError(f"offload plan: {where} reads slot {slot} expecting buffer {expected}, but it holds {held}")
        ld = st.load
        if ld is None:
            return  # loaded by an earlier run and not replaced since: still valid
        if ld.needed_by > step.node:
            raise PlanError(f"offload plan: {where} reads slot {slot} at node {step.node}, before the plan waits for "
                               f"its load (needed_by {ld.needed_by})")
        last = getattr(ld, "last_use", -1)
        if last >= 0 and step.node > last:
            raise PlanError(f"offload plan: {where} reads slot {slot} at node {step.node}, after the load's "
                               f"last_use {last} (the slot may already be reused)")

    def _write_input(self, p: int, i: int, ref: TensorRef, x: Any) -> None:
        view = _view(self._container(p, ref.buf), ref)
        if x is None:
            raise InputError(f"payloads[{p}].inputs[{i}]: no value given")
        if isinstance(x, DeviceTensor):
            h = x.handle
            if isinstance(h, np.ndarray) and h.__array_interface__["data"][0] == view.__array_interface__["data"][0] \
                    and h.nbytes == view.nbytes:
                return  # already at its planned location (a KV cache fed back): zero copy
            x = from_storage(np.asarray(h), x.dtype) if x.owner.kind == self.kind else x.numpy()
        if tuple(np.shape(x) if not isinstance(x, HostTensor) else x.shape) != tuple(ref.shape):
            raise InputError(f"payloads[{p}].inputs[{i}]: shape {list(np.shape(x))} does not match {list(ref.shape)}")
        view[...] = to_storage(x, ref.dtype, f"payloads[{p}].inputs[{i}]")

    def run(self, payload: int, inputs: Sequence[Any], keep_on_device: bool = False) -> List[Any]:
        inputs = list(inputs)
        pp = self.begin_run(payload, inputs)
        for i, (ref, x) in enumerate(zip(pp.inputs, inputs)):
            self._write_input(payload, i, ref, x)
        loads = self._load_order(payload)
        nxt = 0
        for k, step in enumerate(self.steps[payload]):
            while nxt < len(loads) and loads[nxt][0] <= k:
                self._do_load(payload, loads[nxt][1])
                nxt += 1
            for j, slot, expected in step.slot_reads:
                self._check_slot(payload, step, j, slot, expected)
            if step.skip:
                continue
            t0 = time.perf_counter() if self.profile else 0.0
            outs = step.kernel(step.args, step.attrs)
            for view, o, dt in zip(step.outs, outs, step.out_dtypes):
                if tuple(o.shape) != view.shape:
                    raise RuntimeError(f"payloads[{payload}].ops[{step.node}] ({step.op}): kernel gave {list(o.shape)}, "
                                       f"plan has {list(view.shape)}")
                view[...] = to_storage(o, dt)
            if self.profile:
                self.timings.append((payload, step.node, step.op, time.perf_counter() - t0))
        outs = []
        for ref in pp.outputs:
            view = _view(self._container(payload, ref.buf), ref)
            if keep_on_device:
                outs.append(DeviceTensor(self, ref.dtype, tuple(ref.shape), view, view.nbytes))
            else:
                outs.append(from_storage(view.copy(), ref.dtype))
        return outs

    def to_host(self, t: DeviceTensor) -> np.ndarray:
        return from_storage(np.array(t.handle, copy=True), t.dtype)

    def close(self) -> None:
        self.arenas.clear()
        self.buffers.clear()
        self.dequantized.clear()
        self.host_mirrors.clear()
        self.slots = []
        self.steps.clear()
        super().close()


def _copy_transfer(srcs: Sequence[Any], dsts: Sequence[Any]) -> None:
    """host <-> reference and reference <-> reference copies: the reference's device memory is
    host memory, so a copy is a storage conversion into the destination's view."""
    for s, d in zip(srcs, dsts):
        if isinstance(s, DeviceTensor):
            s = from_storage(np.asarray(s.handle), s.dtype)
        if isinstance(d, DeviceTensor):
            d.handle[...] = to_storage(s, d.dtype, "copy_tensors")
        else:
            dst = d.data if isinstance(d, HostTensor) else d
            np.asarray(dst).reshape(-1)[...] = np.asarray(s).reshape(-1)


class ReferenceContext(DeviceContext):
    """The numpy 'device'. Reports WebGPU's default limits so CPU tests exercise the planners'
    splitting and alignment decisions as a browser would."""

    kind = "reference"

    def __init__(self, env=None, limits: Optional[DeviceLimits] = None):
        self._limits = limits or DeviceLimits(name="reference")

    @property
    def limits(self) -> DeviceLimits:
        return self._limits

    def create_executor(self, program: Program, **options) -> ReferenceExecutor:
        unknown = set(options) - {"profile", "precision"}
        if unknown:
            raise TypeError(f"reference executor: unknown options {sorted(unknown)} (known: profile, precision)")
        # precision: the reference is the golden answer, so "fast" computes exactly as "exact" does
        options.pop("precision", None)
        return ReferenceExecutor(self, program, **options)

    def register_transfers(self, registry) -> None:
        for pair in (("host", "reference"), ("reference", "host"), ("reference", "reference")):
            registry.register(*pair, _copy_transfer)

    def info(self) -> dict:
        return {"kind": self.kind, "device": f"numpy {np.__version__} (CPU)", "limits": self._limits}


def create_context(env) -> ReferenceContext:
    return ReferenceContext(env)
