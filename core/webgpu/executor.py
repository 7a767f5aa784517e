"""THE WebGPU executor: carries out a SessionPlan on any :class:`~gpudelegate.webgpu.device.GPUDevice`
(desktop wgpu-py, the browser through Pyodide). Pure Python; it never re-plans.

- allocate: one storage buffer per arena memory object, per resident constant buffer (sibling
  linears' weights back to back in one buffer: ``plan.fusion.sibling_groups``) and per offload
  ring slot; a streamed weight's host mirror is a MAP_WRITE | COPY_SRC buffer (host memory on a
  discrete GPU: what a pinned buffer is on CUDA).
- record: the lowering's kernel calls (``webgpu.lowering.select_all``), one uniform buffer per
  payload and one bind group per call, made once; offload loads (host mirror -> slot copies) go
  where the plan put them (``OffloadLoad.at``). The device records the chain for its replay path.
- prepack: chunk by chunk (``plan.prepack.chunks``) with progress: identity layouts are uploaded
  as they are, ``fp16`` ones uploaded as float32 and packed on the GPU by the cast kernel,
  streamed weights written into their mapped host mirrors.
- run: host inputs are written, device-tensor inputs copied (none when already where the plan
  wants them, e.g. a KV cache fed back), the chain replayed, outputs read back in one mapping, or
  left on the device (``keep_on_device``).
- argmax_device: a greedy pick on the GPU (:mod:`.argmax`, shaders/argmax.wgsl) into a one-word
  index buffer the next decode step copies its ``ids`` from; the index's value is copied into a
  staging buffer in the same submission, read when the caller asks (``index_value``).
- profile: with ``profile=True`` the device times each dispatch with timestamp queries;
  ``last_profile`` is [(op, node, seconds)] of the last run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gpudelegate import dtypes as _dt
from gpudelegate.errors import DeviceError, InputError, PayloadError
from gpudelegate.executor import DeviceTensor, Executor, HostTensor, IndexTensor, Progress, check_argmax_input
from gpudelegate.plan.fusion import sibling_groups
from gpudelegate.plan.types import BufferRef, SessionPlan, TensorRef

from . import argmax as argmax_kernel
from . import lowering
from .commands import STORAGE_USAGE, BufferUsage, Copy, Launch, RunIO, Step, round4


@dataclass
class Recorded:
    """A payload's recorded chain: ``nodes`` one :class:`Step` per dispatch of the plan (empty
    for a dispatch another one's kernel carries out) plus a tail step for loads after the last;
    ``chain`` the device's replayable form of it."""

    nodes: List[Step]
    scratch: List[Any]
    chain: Any
    dispatch_count: int
    stream_bytes: int


class WebGPUExecutor(Executor):
    def __init__(self, device: "GPUDevice", program, profile: bool = False,
                 tuning: Optional["lowering.Tuning"] = None, precision: str = "exact"):
        super().__init__(device, program)
        self.kind = device.kind
        self.device = device
        # "fast": products may round their inputs to float16 (subgroup-matrix kernels where the
        # device has them; ops_sgmat.py); the session checked the value (session.PRECISIONS)
        self.precision = precision
        if profile and "timestamp-query" not in device.features:
            raise DeviceError(f"{self.kind}: profiling reads GPU timestamps, and this adapter "
                              f"({device.limits.name}) has no timestamp-query feature")
        self.profile = bool(profile)
        self.tuning = tuning if tuning is not None else getattr(device, "default_tuning", None)
        self.arena: Dict[int, List[Any]] = {}
        self.resident: Dict[int, Any] = {}
        # Resident buffers placed back to back in one device buffer: their byte offset in it.
        self._res_base: Dict[int, int] = {}
        self._contiguous: List[Tuple[int, ...]] = []
        self.mirrors: Dict[int, Any] = {}
        self.slots: List[Any] = []
        self.recorded: Dict[int, Recorded] = {}
        self._refs: Dict[int, tuple] = {}  # per payload: input and output (buffer, offset)s (_run_refs)
        self.last_profile: List[Tuple[str, int, float]] = []
        self.bytes_streamed = 0
        self.upload_seconds = 0.0
        self.upload_bytes = 0
        self._dummy = None
        self._owned: List[Any] = []
        # argmax_device: per logits location (buffer id, offset, bytes) its buffer (kept, so the
        # id stays its own) and recorded chain; the partials and index buffers they share.
        self._argmax: Dict[tuple, tuple] = {}
        self._argmax_bufs: Optional[Dict[str, Any]] = None
        self.greedy_lookahead = int(getattr(device, "greedy_lookahead", 0))

    @property
    def ctx(self) -> "GPUDevice":
        return self.device

    # ------------------------------------------------------------------ buffers
    def _buffer(self, nbytes: int, what: str, usage: int = STORAGE_USAGE, mapped: bool = False, own: bool = True):
        size = round4(nbytes)
        lim = self.limits.max_buffer_size
        if size > lim:
            raise DeviceError(f"{self.kind}: {what} needs a {size}-byte buffer, over this device's maxBufferSize {lim}")
        b = self.device.create_buffer(size, usage, what, mapped_at_creation=mapped)
        if own:
            self._owned.append(b)
        return b

    def _weight_name(self, i: int) -> str:
        rb = self.plan.prepack.buffers[i]
        for pl in self.program.payloads:
            for v in pl.values:
                if v.constant == rb.constant and v.name:
                    return f"weight {v.name!r} (constants[{rb.constant}], {rb.layout})"
        return f"constants[{rb.constant}] ({rb.layout})"

    def buffer_of(self, p: int, ref: BufferRef, scratch: Optional[List[Any]] = None, extra: Optional[dict] = None):
        try:
            if ref.space == "arena":
                return self.arena[p][ref.index]
            if ref.space == "resident":
                return self.resident[ref.index]
            if ref.space == "slot":
                return self.slots[ref.index]
            if ref.space == "scratch":
                return scratch[ref.index]
            if ref.space == "dummy":
                return self._dummy
            if extra is not None and ref.space in extra:
                return extra[ref.space]
        except (KeyError, IndexError, TypeError):
            pass
        raise DeviceError(f"{self.kind}: payloads[{p}] refers to {ref.space} buffer {ref.index}, "
                          f"which this executor does not have")

    # ------------------------------------------------------------------ allocate
    def allocate(self, plan: SessionPlan) -> None:
        self.plan = plan
        streamed = set(plan.offload.streamed) if plan.offload is not None else set()
        self._dummy = self._buffer(lowering.dummy_nbytes(self.limits), "dummy binding")
        fuse = (self.tuning or lowering.Tuning()).fuse
        self._contiguous = [g for g in sibling_groups(plan, self.limits) if not set(g) & streamed] if fuse else []
        for g in self._contiguous:
            buf = self._buffer(sum(plan.prepack.buffers[i].nbytes for i in g), " + ".join(self._weight_name(i) for i in g))
            at = 0
            for i in g:
                self.resident[i], self._res_base[i] = buf, at
                at += plan.prepack.buffers[i].nbytes
        U = BufferUsage
        for i, rb in enumerate(plan.prepack.buffers):
            if i in self.resident:
                continue
            if i in streamed:
                # Host mirror: written once through its mapping in prepack, copied into a slot per use.
                self.mirrors[i] = self._buffer(rb.nbytes, f"host mirror of {self._weight_name(i)}",
                                               usage=U.MAP_WRITE | U.COPY_SRC, mapped=True)
            else:
                self.resident[i] = self._buffer(rb.nbytes, self._weight_name(i))
        if plan.offload is not None:
            self.slots = [self._buffer(n, f"offload slot {j}") for j, n in enumerate(plan.offload.slots)]
        for p, pp in plan.payloads.items():
            self.arena[p] = [self._buffer(n, f"payloads[{p}] arena object {k}") for k, n in enumerate(pp.memory.objects)]
        prepare = getattr(self.device, "prepare_uploads", None)
        if prepare is not None:  # the desktop makes its staging ring while record() compiles pipelines
            prepare(sum(rb.src_nbytes for i, rb in enumerate(plan.prepack.buffers) if i not in streamed))

    # ------------------------------------------------------------------ record
    def _bind_group(self, p: int, call, uniform, uoff: int, scratch, extra=None):
        bgl, _ = self.device.layout(tuple(b.binding for b in call.bindings))
        entries = [(0, uniform, uoff, round4(len(call.uniform)))]
        seen = []
        for b in call.bindings:
            buf = self.buffer_of(p, b.buf, scratch, extra)
            base = self._res_base.get(b.buf.index, 0) if b.buf.space == "resident" else 0
            # Every binding is read_write storage, and WebGPU (Dawn) rejects overlapping writable
            # bindings of one dispatch (wgpu-native lets them pass): the lowering promises none,
            # and this check holds it to that on every device.
            lo, hi = base + b.buf.offset, base + b.buf.offset + b.buf.nbytes
            if any(sb is buf and lo < e and s < hi for sb, s, e in seen):
                raise DeviceError(f"{self.kind}: {call.label} ({call.shader}:{call.entry}) binds overlapping ranges of "
                                  f"one buffer at binding {b.binding}; WebGPU rejects overlapping writable bindings")
            seen.append((buf, lo, hi))
            entries.append((b.binding, buf, lo, b.buf.nbytes))
        return self.device.create_bind_group(bgl, entries, call.label)

    def _launches(self, p: int, calls, scratch, extra=None) -> List[Launch]:
        """Pipelines, one uniform buffer and bind groups for ``calls``."""
        if not calls:
            return []
        align = max(self.device.uniform_alignment, 16)
        offs, size = [], 0
        for c in calls:
            size = (size + align - 1) // align * align
            offs.append(size)
            size += round4(len(c.uniform))
        blob = bytearray(round4(size))
        for c, o in zip(calls, offs):
            blob[o:o + len(c.uniform)] = c.uniform
        ubuf = self._buffer(len(blob), f"payloads[{p}] uniforms", usage=BufferUsage.UNIFORM | BufferUsage.COPY_DST,
                            own=extra is None)
        self.device.write_buffer(ubuf, 0, blob)
        if extra is not None:
            extra.setdefault("_temps", []).append(ubuf)
        return [Launch(self.device.pipeline(c), self._bind_group(p, c, ubuf, o, scratch, extra), tuple(c.workgroups),
                       f"{c.shader}:{c.entry}") for c, o in zip(calls, offs)]

    def record(self, plan: SessionPlan) -> None:
        limits, feats = self.limits, self.device.features
        fuse = (self.tuning or lowering.Tuning()).fuse
        for p, pp in plan.payloads.items():
            # One list per dispatch; a dispatch another kernel carries out (a fused epilogue, a
            # folded permute, a sibling linear, a member of one of the planner's fusions) has an
            # empty one.
            per_dispatch = lowering.select_all(pp, limits, feats, self.tuning, f"payloads[{p}]",
                                               contiguous=self._contiguous,
                                               fusions=lowering.ops_fused.plan_fusions(plan, p) if fuse else (),
                                               precision=self.precision,
                                               configs=self.device.subgroup_matrix_configs,
                                               subgroup_size=self.device.subgroup_size())
            sizes: Dict[int, int] = {}
            for calls in per_dispatch:
                for k, n in lowering.scratch_sizes(calls).items():
                    sizes[k] = max(sizes.get(k, 0), n)
            scratch = [self._buffer(sizes.get(k, 4), f"payloads[{p}] scratch {k}") for k in range(max(sizes, default=-1) + 1)]
            launches = self._launches(p, [c for calls in per_dispatch for c in calls], scratch)
            loads = self._loads_at(p, len(pp.dispatches))
            steps, at = [], 0
            for pos, (d, calls) in enumerate(zip(pp.dispatches, per_dispatch)):
                steps.append(Step(d.op, d.node, loads.get(pos, []), launches[at:at + len(calls)]))
                at += len(calls)
            if loads.get(len(pp.dispatches)):
                steps.append(Step("offload", -1, loads[len(pp.dispatches)], []))
            stream = sum(c.size for s in steps for c in s.copies)
            self.recorded[p] = Recorded(steps, scratch, self.device.record_chain(steps), len(launches), stream)
        self.device.check("while recording pipelines and bind groups")

    def _loads_at(self, p: int, count: int) -> Dict[int, List[Copy]]:
        """The plan's offload loads of payload ``p`` as copies, by the dispatch position the
        planner gave them (``OffloadLoad.at``)."""
        out: Dict[int, List[Copy]] = {}
        if self.plan.offload is None:
            return out
        for ld in self.plan.offload.loads.get(p, []):
            src = self.mirrors.get(ld.buffer)
            if src is None or not 0 <= ld.slot < len(self.slots) or not 0 <= ld.at <= count:
                raise DeviceError(f"{self.kind}: payloads[{p}] offload load of buffer {ld.buffer} into slot {ld.slot} "
                                  f"at {ld.at} does not fit this plan's mirrors, slots or {count} dispatches")
            out.setdefault(ld.at, []).append(Copy(src, 0, self.slots[ld.slot], 0, round4(self.plan.prepack.buffers[ld.buffer].nbytes)))
        return out

    # ------------------------------------------------------------------ prepack
    def prepack(self, plan: SessionPlan, progress: Progress = None) -> None:
        import time

        bufs = plan.prepack.buffers
        total = sum(b.nbytes for b in bufs)
        covered = sorted(i for c in plan.prepack.chunks for i in c)
        if covered != list(range(len(bufs))):
            raise PayloadError("prepack.chunks", f"cover buffers {covered}, expected each of 0..{len(bufs) - 1} once")
        self.device.check("before prepack")
        t0 = time.perf_counter()
        done = 0
        temps_in_flight = False
        for chunk in plan.prepack.chunks:
            # float32 sources of fp16 packing are temporaries: at most two chunks of them exist at
            # once (the previous chunk's have run before this chunk makes its own).
            if temps_in_flight:
                self.device.fence()
            temps: Dict[str, list] = {"_temps": []}
            steps: List[Step] = []
            try:
                for i in chunk:
                    self._pack(i, steps, temps)
                    done += bufs[i].nbytes
                self.device.flush_uploads()  # the chunk's weights share staging and submits
                if steps:  # pack kernels, after the uploads of their sources
                    self.device.run_chain(self.device.record_chain(steps), RunIO())
            except BaseException:
                self.device.discard_uploads()  # nothing half-written reaches the queue
                raise
            finally:
                # WebGPU keeps a destroyed buffer alive until the work submitted with it has run.
                for t in temps["_temps"]:
                    self.device.destroy(t)
            temps_in_flight = bool(steps)
            if progress is not None:
                progress(done, total)
        self.device.fence()
        if progress is not None and not plan.prepack.chunks:
            progress(0, 0)
        self.device.check("after prepack")
        self.upload_seconds = time.perf_counter() - t0
        self.upload_bytes = total
        self.prepacked = True

    def _pack(self, i: int, steps: List[Step], temps: dict) -> None:
        rb = self.plan.prepack.buffers[i]
        where = f"prepack.buffers[{i}] ({self._weight_name(i)})"
        if not 0 <= rb.constant < len(self.program.constants):
            raise PayloadError(where, f"constant {rb.constant} does not exist")
        c = self.program.constants[rb.constant]
        raw = self.program.constant_bytes(rb.constant)
        n = _dt.numel(rb.shape)
        if raw.nbytes != rb.src_nbytes or raw.nbytes != c.nbytes or tuple(c.shape) != tuple(rb.shape):
            raise PayloadError(where, f"constant is {c.dtype}{list(c.shape)} with {raw.nbytes} bytes; the plan expects "
                                      f"{list(rb.shape)} with {rb.src_nbytes} bytes")
        if rb.layout == "identity":
            if c.dtype != rb.dtype or rb.nbytes != raw.nbytes:
                raise PayloadError(where, f"identity layout of a {c.dtype} constant into {rb.dtype} ({rb.nbytes} bytes)")
        elif rb.layout == "fp16":
            if c.dtype != "float32" or rb.dtype != "float16" or rb.nbytes != 2 * n:
                raise PayloadError(where, f"fp16 layout packs float32 into float16; got {c.dtype} -> {rb.dtype} "
                                          f"({rb.nbytes} bytes for {n} elements)")
        else:
            raise PayloadError(where, f"unknown layout {rb.layout!r} (known: identity, fp16)")
        if i in self.mirrors:
            data = raw if rb.layout == "identity" else self.device.float16_bytes(raw, n)
            self.device.write_mapped(self.mirrors[i], data)
            return
        dst = self.resident.get(i)
        if dst is None:
            raise DeviceError(f"{self.kind}: {where} has no device buffer (allocate did not run?)")
        if rb.layout == "identity":
            if raw.nbytes:
                self.device.upload(dst, self._res_base.get(i, 0), raw)
            return
        if n == 0:
            return
        # fp16: the float32 bytes into a temporary, then the pack kernel (a cast map) into the buffer.
        tmp = self._buffer(raw.nbytes, f"{where} float32 source", own=False)
        temps["_temps"].append(tmp)
        self.device.upload(tmp, 0, raw)
        calls = lowering.pack_fp16_calls(BufferRef("temp", 0, 0, raw.nbytes), BufferRef("resident", i, 0, rb.nbytes),
                                         n, self.limits, label=where)
        temps["temp"] = tmp
        steps.append(Step("pack_fp16", -1, [], self._launches(-1, calls, [], extra=temps)))

    # ------------------------------------------------------------------ run
    def _input(self, p: int, i: int, ref: TensorRef, x: Any, io: RunIO, temps: list) -> None:
        dst = self.buffer_of(p, ref.buf)
        where = f"payloads[{p}].inputs[{i}]"
        if x is None:
            raise InputError(f"{where}: no value given")
        if isinstance(x, DeviceTensor):
            if x.owner.kind == self.kind and getattr(x.owner, "device", None) is self.device:
                src, off = x.handle
                if src is dst and off == ref.buf.offset:
                    return  # already where the plan wants it (a KV cache fed back): zero copy
                if x.dtype != ref.dtype:
                    raise InputError(f"{where}: a {x.dtype} device tensor for a {ref.dtype} input")
                if not ref.buf.nbytes:
                    return  # an empty tensor: no zero-byte copy
                size = round4(ref.buf.nbytes)
                if src is dst:  # WebGPU copies need distinct buffers: bounce through a temporary
                    tmp = self._buffer(size, f"{where} bounce", own=False)
                    temps.append(tmp)
                    io.copies.append(Copy(src, off, tmp, 0, size))
                    src, off = tmp, 0
                io.copies.append(Copy(src, off, dst, ref.buf.offset, size))
                return
            x = x.owner.to_host(x)
        if ref.buf.nbytes:
            io.writes.append((dst, ref.buf.offset, self.device.host_bytes(x, ref.dtype, ref.buf.nbytes, where)))

    def _run_refs(self, payload: int, pp):
        """Per payload, made on its first run: each input's destination (buffer, offset), error
        prefix, dtype and size, and each output's (buffer, offset), so a run looks up no buffers
        and formats no strings (a decode step has ~60 inputs)."""
        got = self._refs.get(payload)
        if got is None:
            ins = [(self.buffer_of(payload, r.buf), r.buf.offset, f"payloads[{payload}].inputs[{i}]", r.dtype,
                    r.buf.nbytes) for i, r in enumerate(pp.inputs)]
            outs = [(self.buffer_of(payload, r.buf), r.buf.offset) for r in pp.outputs]
            reads = [(b, off, r.buf.nbytes) for (b, off), r in zip(outs, pp.outputs) if r.buf.nbytes] or None
            got = self._refs[payload] = (ins, outs, reads)
        return got

    def _io(self, payload: int, inputs: Sequence[Any], keep_on_device: bool, temps: list):
        pp = self.begin_run(payload, inputs)
        ins, _, reads = self._run_refs(payload, pp)
        io = RunIO()
        writes, host_bytes = io.writes, self.device.host_bytes
        for i, (x, (dst, off, where, dtype, nbytes)) in enumerate(zip(inputs, ins)):
            if isinstance(x, DeviceTensor):
                # Already where the plan wants it (a KV cache fed back): zero copy, checked first
                # without a call (_input makes the same check).
                if x.owner is self and x.handle[0] is dst and x.handle[1] == off:
                    continue
                self._input(payload, i, pp.inputs[i], x, io, temps)
            elif x is None:
                raise InputError(f"{where}: no value given")
            elif nbytes:
                # A host input: what _input does for one, with its destination looked up once.
                writes.append((dst, off, host_bytes(x, dtype, nbytes, where)))
        if not keep_on_device:
            # Empty outputs (a zero-size dim) are not read back: no zero-byte copy (_outputs).
            io.reads = list(reads) if reads else None
        return pp, io

    def _outputs(self, payload: int, pp, got, keep_on_device: bool, temps: list) -> List[Any]:
        for t in temps:
            self.device.destroy(t)
        if self.profile:
            got, self.last_profile = got
        self.bytes_streamed += self.recorded[payload].stream_bytes
        if keep_on_device:
            return [DeviceTensor(self, r.dtype, tuple(r.shape), h, r.buf.nbytes)
                    for r, h in zip(pp.outputs, self._refs[payload][1])]
        got = iter(got or [])
        return [self.device.host_array(next(got) if r.buf.nbytes else b"", r.dtype, tuple(r.shape))
                for r in pp.outputs]

    def run(self, payload: int, inputs: Sequence[Any], keep_on_device: bool = False) -> List[Any]:
        temps: list = []
        pp, io = self._io(payload, list(inputs), keep_on_device, temps)
        got = self.device.run_chain(self.recorded[payload].chain, io, self.profile)
        return self._outputs(payload, pp, got, keep_on_device, temps)

    async def run_async(self, payload: int, inputs: Sequence[Any], keep_on_device: bool = False) -> List[Any]:
        temps: list = []
        pp, io = self._io(payload, list(inputs), keep_on_device, temps)
        got = await self.device.run_chain_async(self.recorded[payload].chain, io, self.profile)
        return self._outputs(payload, pp, got, keep_on_device, temps)

    # ------------------------------------------------------------------ greedy pick on the GPU
    def _argmax_chain(self, t: DeviceTensor):
        """The recorded argmax of ``t``'s location, made on its first use (a decode method's
        logits always sit at the same place)."""
        buf, off = t.handle
        key = (id(buf), off, t.nbytes)
        got = self._argmax.get(key)
        if got is None:
            if self._argmax_bufs is None:
                self._argmax_bufs = {"argmax_scratch": self._buffer(argmax_kernel.SCRATCH_BYTES, "argmax partials"),
                                     "argmax_out": self._buffer(4, "argmax index")}
            extra = {"logits": buf, **self._argmax_bufs}
            calls = argmax_kernel.argmax_calls(off, _dt.numel(tuple(t.shape)), self.limits.offset_alignment,
                                               f"argmax_device {t.dtype}{list(t.shape)}")
            launches = self._launches(-1, calls, [], extra)
            self._owned.extend(extra.pop("_temps"))  # the uniforms live as long as the chain
            got = self._argmax[key] = (buf, self.device.record_chain([Step("argmax", -1, [], launches)]))
        return got[1]

    def argmax_device(self, t: DeviceTensor):
        """The greedy pick of a float32 device tensor of this executor, reduced on the GPU into an
        :class:`IndexTensor` (other dtypes, and vectors over the binding limit: the host pick of
        the base class). The read of its value is submitted with it: on a device with
        ``submit_read`` (the browser, wgpu-native, Dawn) it is a map of its own staging buffer
        that resolves when this submission is done; elsewhere the value is read back at once."""
        if not isinstance(t, DeviceTensor) or t.owner is not self:
            return super().argmax_device(t)
        self._check_tensor(t)
        check_argmax_input(t)
        if t.dtype != "float32" or t.nbytes + self.limits.offset_alignment > self.limits.max_binding_size:
            return super().argmax_device(t)
        chain = self._argmax_chain(t)
        out = self._argmax_bufs["argmax_out"]
        io = RunIO(reads=[(out, 0, 4)])
        submit = getattr(self.device, "submit_read", None)
        idx = IndexTensor(self, "int32", (1, 1), (out, 0), 4)
        if submit is not None:
            idx.read = submit(chain, io)
        else:
            (b,) = self.device.run_chain(chain, io)
            idx.value = _index_of(b)
        return idx

    def index_value(self, x) -> int:
        if isinstance(x, IndexTensor) and x.owner is self:
            if x.value is None:
                self._check_tensor(x)
                (b,) = self.device.read_submitted(x.read)
                x.value, x.read = _index_of(b), None
            return x.value
        return super().index_value(x)

    async def index_value_async(self, x) -> int:
        if isinstance(x, IndexTensor) and x.owner is self:
            if x.value is None:
                self._check_tensor(x)
                (b,) = await self.device.read_submitted_async(x.read)
                x.value, x.read = _index_of(b), None
            return x.value
        return super().index_value(x)

    def _check_tensor(self, t: DeviceTensor) -> None:
        if t.owner is self and self.closed:
            raise DeviceError(f"{self.kind} executor: the session that made this device tensor is closed")

    def to_host(self, t: DeviceTensor):
        if t.owner is not self:
            return t.owner.to_host(t)
        self._check_tensor(t)
        if not t.nbytes:
            return self.device.host_array(b"", t.dtype, tuple(t.shape))
        buf, off = t.handle
        (b,) = self.device.run_chain(None, RunIO(reads=[(buf, off, t.nbytes)]))
        return self.device.host_array(b, t.dtype, tuple(t.shape))

    async def to_host_async(self, t: DeviceTensor):
        self._check_tensor(t)
        if not t.nbytes:
            return self.device.host_array(b"", t.dtype, tuple(t.shape))
        buf, off = t.handle
        (b,) = await self.device.run_chain_async(None, RunIO(reads=[(buf, off, t.nbytes)]))
        return self.device.host_array(b, t.dtype, tuple(t.shape))

    def close(self) -> None:
        if self.closed:
            return
        for b in self._owned:
            self.device.destroy(b)
        if self._owned:
            self.device.released()
        for held in (self._owned, self.arena, self.resident, self._res_base, self.mirrors, self.slots, self.recorded,
                     self._refs, self._argmax):
            held.clear()
        self._argmax_bufs = None
        super().close()


def _index_of(raw) -> int:
    """The int32 index in the first 4 bytes of a read-back."""
    return int.from_bytes(bytes(memoryview(raw)[:4]), "little", signed=True)


def transfer(srcs: Sequence[Any], dsts: Sequence[Any]) -> None:
    """Environment data transfers host <-> device and device <-> device (one GPUDevice)."""
    for s, d in zip(srcs, dsts):
        if isinstance(d, DeviceTensor):
            ex: WebGPUExecutor = d.owner
            ex._check_tensor(d)
            if not d.nbytes:
                continue  # an empty tensor: nothing to copy (no zero-byte write or copy)
            buf, off = d.handle
            io = RunIO()
            temps: list = []
            if isinstance(s, DeviceTensor) and getattr(s.owner, "device", None) is ex.device:
                s.owner._check_tensor(s)
                sbuf, soff = s.handle
                size = round4(d.nbytes)
                if sbuf is buf:
                    tmp = ex._buffer(size, "copy_tensors bounce", own=False)
                    temps.append(tmp)
                    io.copies.append(Copy(sbuf, soff, tmp, 0, size))
                    sbuf, soff = tmp, 0
                io.copies.append(Copy(sbuf, soff, buf, off, size))
            else:
                host = s.owner.to_host(s) if isinstance(s, DeviceTensor) else s
                io.writes.append((buf, off, ex.device.host_bytes(host, d.dtype, d.nbytes, "copy_tensors")))
            ex.device.run_chain(None, io)
            for t in temps:
                ex.device.destroy(t)
            continue
        host = s.owner.to_host(s) if isinstance(s, DeviceTensor) else s
        src = _dt.byte_view(host.data if isinstance(host, HostTensor) else host)
        dst = _dt.byte_view(d.data if isinstance(d, HostTensor) else d)
        if src.nbytes != dst.nbytes:
            raise InputError(f"copy_tensors: {src.nbytes} source bytes into a {dst.nbytes}-byte destination")
        dst[:] = src
