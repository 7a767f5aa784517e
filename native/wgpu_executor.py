"""The desktop WebGPU executor (device kind ``wgpu``): carries out a SessionPlan with wgpu-native.

- allocate: one storage buffer per arena memory object, per resident constant buffer and per
  offload ring slot; host mirrors of streamed weights are MAP_WRITE | COPY_SRC buffers (host
  memory on a discrete GPU: what a pinned buffer is on CUDA).
- record: kernel calls from :func:`gpudelegate.kernels.select` (shared with the browser), their
  pipelines (cached on the context), one uniform buffer per payload and one bind group per call,
  made once. Offload loads are placed between dispatches, each at the earliest node the plan
  allows; a load is a copy_buffer_to_buffer from the host mirror into the slot, so a run is still
  one command encoder and one submit.
- prepack: chunk by chunk (``plan.prepack.chunks``) with progress: identity layouts are written
  with ``queue.write_buffer``, ``fp16`` ones uploaded as float32 and packed by the cast kernel,
  streamed weights copied into their mapped host mirrors; each chunk is fenced so staging memory
  stays bounded, and all of it is queued before the first run.
- run: inputs by ``queue.write_buffer`` (or a device copy of a DeviceTensor; none when it already
  sits at the planned location, e.g. a KV cache fed back), the recorded chain, outputs copied into
  one pooled MAP_READ buffer in the same submit and mapped once; ``keep_on_device`` returns
  DeviceTensors over the arena instead.
- profile: with ``profile=True`` each node runs in its own compute pass with timestamp writes;
  ``last_profile`` is [(op, node, seconds)] of the last run.
"""

from __future__ import annotations

import collections

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from gpudelegate import dtypes as _dt
from gpudelegate import kernels
from gpudelegate.errors import DeviceError, InputError, PayloadError
from gpudelegate.executor import DeviceTensor, Executor, HostTensor, Progress
from gpudelegate.plan.types import BufferRef, OffloadLoad, SessionPlan, TensorRef
from gpudelegate.program import Program

from .hostio import NP_DTYPE, from_storage, to_storage
from .wgpu_device import WgpuContext, create_context  # noqa: F401  (Environment factory lives here)

UPLOAD_PIECE = 64 << 20  # bytes per write_buffer call
UPLOAD_DIRECT = 1 << 20  # host writes at least this large go through the staging ring


def _up4(n: int) -> int:
    return max(4, (n + 3) // 4 * 4)


@dataclass
class _Launch:
    pipeline: Any
    bind_group: Any
    workgroups: Tuple[int, int, int]


def _raw_pass_calls():
    """The three wgpu-native calls a replay makes per dispatch, unwrapped: wgpu-py routes each
    through an error-capturing proxy (~2 us per call). Pipelines and bind groups were validated
    when recorded, so the replay skips it; any error still surfaces through the device's
    uncaptured-error handler. None when this wgpu build does not expose them (public API then)."""
    try:
        from wgpu.backends.wgpu_native._api import ffi, lib

        return (lib.wgpuComputePassEncoderSetPipeline, lib.wgpuComputePassEncoderSetBindGroup,
                lib.wgpuComputePassEncoderDispatchWorkgroups, ffi.NULL)
    except (ImportError, AttributeError):
        return None


_RAW = _raw_pass_calls()


@dataclass
class _Node:
    node: int
    op: str
    launches: List[_Launch]
    loads: List[OffloadLoad] = field(default_factory=list)  # issued before this node


@dataclass
class _Recorded:
    nodes: List[_Node]
    tail_loads: List[OffloadLoad]  # loads the plan issues after the last node (none in practice)
    scratch: List[Any]


class WgpuExecutor(Executor):
    kind = "wgpu"

    def __init__(self, context: WgpuContext, program: Program, profile: bool = False,
                 tuning: Optional[kernels.Tuning] = None):
        super().__init__(context, program)
        self.ctx = context
        self.device = context.device
        self.queue = context.queue
        self.wgpu = context.wgpu
        if profile and "timestamp-query" not in context.features:
            raise DeviceError(f"wgpu: profiling reads GPU timestamps, and this adapter ({context.limits.name}) "
                              f"has no timestamp-query feature")
        self.profile = bool(profile)
        self.tuning = tuning
        self.arena: Dict[int, List[Any]] = {}
        self.resident: Dict[int, Any] = {}
        # Resident buffers placed back to back in one device buffer (kernels.sibling_groups):
        # their byte offset in it, and the groups (select_all runs each group's linears as one).
        self._res_base: Dict[int, int] = {}
        self._contiguous: List[Tuple[int, ...]] = []
        self.mirrors: Dict[int, Any] = {}
        self.slots: List[Any] = []
        self.recorded: Dict[int, _Recorded] = {}
        self.prepacked = False
        self.last_profile: List[Tuple[str, int, float]] = []
        self.bytes_streamed = 0
        # A payload's chain encoded ahead (while the GPU runs the previous submission): finished
        # command buffer and the bytes its offload copies stream. Not kept when profiling (each
        # run's timestamp queries are its own).
        self._ahead: Dict[int, Tuple[Any, int]] = {}
        self.upload_seconds = 0.0
        self.upload_bytes = 0
        self._dummy = None
        self._owned: List[Any] = []

    # ------------------------------------------------------------------ buffers
    def _usage(self):
        U = self.wgpu.BufferUsage
        return U.STORAGE | U.COPY_SRC | U.COPY_DST

    def _buffer(self, nbytes: int, what: str, usage=None, mapped: bool = False):
        size = _up4(nbytes)
        lim = self.limits.max_buffer_size
        if size > lim:
            raise DeviceError(f"wgpu: {what} needs a {size}-byte buffer, over this device's maxBufferSize {lim}")
        b = self.device.create_buffer(size=size, usage=usage or self._usage(), mapped_at_creation=mapped, label=what)
        self._owned.append(b)
        return b

    def _weight_name(self, buf_index: int) -> str:
        rb = self.plan.prepack.buffers[buf_index]
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
        raise DeviceError(f"wgpu: payloads[{p}] refers to {ref.space} buffer {ref.index}, which this executor does not have")

    # ------------------------------------------------------------------ allocate
    def allocate(self, plan: SessionPlan) -> None:
        self.plan = plan
        streamed = set(plan.offload.streamed) if plan.offload is not None else set()
        U = self.wgpu.BufferUsage
        self._dummy = self._buffer(kernels.dummy_nbytes(self.limits), "dummy binding")
        fuse = (self.tuning or kernels.Tuning()).fuse
        self._contiguous = [g for g in kernels.sibling_groups(plan, self.limits) if not set(g) & streamed] if fuse else []
        for g in self._contiguous:
            buf = self._buffer(sum(plan.prepack.buffers[i].nbytes for i in g),
                               " + ".join(self._weight_name(i) for i in g))
            at = 0
            for i in g:
                self.resident[i], self._res_base[i] = buf, at
                at += plan.prepack.buffers[i].nbytes
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
        # prepack's uploads go through the context's staging ring: have its buffers made while
        # record() compiles the pipelines (the first ones are slow to make on some drivers)
        up = self.ctx.uploader
        up.prepare(-(-sum(rb.src_nbytes + 4 for i, rb in enumerate(plan.prepack.buffers) if i not in streamed)
                     // up.piece))

    # ------------------------------------------------------------------ record
    def _bind_group(self, p: int, call: kernels.KernelCall, uniform, uoff: int, scratch, extra=None):
        bgl, _ = self.ctx.layout(tuple(b.binding for b in call.bindings))
        entries = [{"binding": 0, "resource": {"buffer": uniform, "offset": uoff, "size": _up4(len(call.uniform))}}]
        seen = []
        for b in call.bindings:
            buf = self.buffer_of(p, b.buf, scratch, extra)
            base = self._res_base.get(b.buf.index, 0) if b.buf.space == "resident" else 0
            # wgpu-native accepts overlapping writable bindings; Dawn (the browser) does not, and
            # kernels.py promises none: hold it to that here too, so desktop tests catch it.
            lo, hi = base + b.buf.offset, base + b.buf.offset + b.buf.nbytes
            if any(sb is buf and lo < e and s < hi for sb, s, e in seen):
                raise DeviceError(f"wgpu: {call.label} ({call.shader}:{call.entry}) binds overlapping ranges of one "
                                  f"buffer at binding {b.binding}; WebGPU (Dawn) rejects overlapping writable bindings")
            seen.append((buf, lo, hi))
            entries.append({"binding": b.binding, "resource": {"buffer": buf, "offset": lo, "size": b.buf.nbytes}})
        return self.device.create_bind_group(layout=bgl, entries=entries, label=call.label)

    def _launches(self, p: int, calls: List[kernels.KernelCall], scratch, extra=None) -> List[_Launch]:
        """Pipelines, one uniform buffer and bind groups for ``calls``."""
        align = max(self.ctx.uniform_alignment, 16)
        offs, size = [], 0
        for c in calls:
            size = (size + align - 1) // align * align
            offs.append(size)
            size += _up4(len(c.uniform))
        if not calls:
            return []
        blob = bytearray(_up4(size))
        for c, o in zip(calls, offs):
            blob[o:o + len(c.uniform)] = c.uniform
        U = self.wgpu.BufferUsage
        ubuf = self._buffer(len(blob), f"payloads[{p}] uniforms", usage=U.UNIFORM | U.COPY_DST)
        self.queue.write_buffer(ubuf, 0, blob)
        return [_Launch(self.ctx.pipeline(c), self._bind_group(p, c, ubuf, o, scratch, extra), c.workgroups)
                for c, o in zip(calls, offs)]

    def record(self, plan: SessionPlan) -> None:
        limits, feats = self.limits, self.ctx.features
        self._ahead.clear()
        for p, pp in plan.payloads.items():
            # Per dispatch; a linear whose gelu / residual add runs in its kernel takes that op's
            # calls and the op's own list is empty (kernels.select_all).
            per_node = list(zip(pp.dispatches, kernels.select_all(pp, limits, feats, self.tuning, f"payloads[{p}]",
                                                                  contiguous=self._contiguous)))
            sizes: Dict[int, int] = {}
            for _, calls in per_node:
                for k, n in kernels.scratch_sizes(calls).items():
                    sizes[k] = max(sizes.get(k, 0), n)
            scratch = [self._buffer(sizes.get(k, 4), f"payloads[{p}] scratch {k}") for k in range(max(sizes, default=-1) + 1)]
            flat = [c for _, calls in per_node for c in calls]
            launches = self._launches(p, flat, scratch)
            nodes, at = [], 0
            for d, calls in per_node:
                nodes.append(_Node(d.node, d.op, launches[at:at + len(calls)]))
                at += len(calls)
            tail = self._place_loads(p, nodes)
            self.recorded[p] = _Recorded(nodes, tail, scratch)

    def _place_loads(self, p: int, nodes: List[_Node]) -> List[OffloadLoad]:
        """Attach each offload load to the node it must precede: the earliest the plan allows
        (issue_before reached, the slot's previous reader ``reuse_after`` done)."""
        if self.plan.offload is None:
            return []
        tail = []
        for ld in self.plan.offload.loads.get(p, []):
            t = max(ld.issue_before, ld.reuse_after + 1)
            if t > ld.needed_by:
                raise DeviceError(f"wgpu: payloads[{p}] offload load of buffer {ld.buffer} cannot run before node "
                                  f"{ld.needed_by} that needs it (issue_before {ld.issue_before}, reuse_after {ld.reuse_after})")
            later = [n for n in nodes if n.node >= t]
            if later:
                later[0].loads.append(ld)
            else:
                tail.append(ld)
        for n in nodes:
            n.loads.sort(key=lambda ld: ld.issue_before)
        return tail

    # ------------------------------------------------------------------ prepack
    def prepack(self, plan: SessionPlan, progress: Progress = None) -> None:
        import time

        bufs = plan.prepack.buffers
        total = sum(b.nbytes for b in bufs)
        covered = sorted(i for c in plan.prepack.chunks for i in c)
        if covered != list(range(len(bufs))):
            raise PayloadError("prepack.chunks", f"cover buffers {covered}, expected each of 0..{len(bufs) - 1} once")
        t0 = time.perf_counter()
        done = 0
        # The host fills staging memory while the GPU copies: nothing here waits on a chunk that
        # only uploads (the staging ring's own map waits bound how far the host runs ahead, and
        # a blocking wait in wgpu-native waits for *every* submission, so waiting on chunk k - 1
        # after submitting chunk k serialized the fill with the copies: 14-19 GB/s against
        # 21-24 GB/s on an H100, bench_wgpu_upload.py). A chunk with float32 temporaries (fp16
        # packing) is waited on once the next such chunk is queued, so at most two chunks of
        # temporaries exist at once. Progress is reported in chunk order: a chunk without
        # temporaries when it is queued (at most the ring's pieces ahead of the copies), one
        # with them when its pack kernels have run, and everything after the final fence.
        queue = collections.deque()  # (marker or None, temporaries, bytes done when it completes)
        for chunk in plan.prepack.chunks:
            enc = None
            temps = []
            try:
                for i in chunk:
                    enc = self._pack(i, enc, temps)
                    done += bufs[i].nbytes
            except BaseException:
                self.ctx.uploader.discard()  # nothing half-written reaches the queue
                for t in temps:
                    t.destroy()
                raise
            self.ctx.uploader.flush()  # the chunk's weights share staging buffers and submits
            if enc is not None:  # pack kernels, after the uploads of their sources
                self.queue.submit([enc.finish()])
            queue.append((self.ctx.marker() if temps else None, temps, done))
            newest = max((k for k, e in enumerate(queue) if e[0] is not None), default=-1)
            while queue and newest != 0:
                self._retire(queue.popleft(), total, progress)
                newest -= 1
        self.ctx.fence()
        while queue:
            marker, temps, d = queue.popleft()
            self._retire((None, temps, d), total, progress)
            if marker is not None:
                self.ctx.staging.put(marker)
        if progress is not None and not plan.prepack.chunks:
            progress(0, 0)
        self.upload_seconds = time.perf_counter() - t0
        self.upload_bytes = total
        self.prepacked = True

    def _retire(self, pending, total: int, progress: Progress) -> None:
        marker, temps, done = pending
        if marker is not None:
            self.ctx.wait(marker)
        for t in temps:
            t.destroy()
        if progress is not None:
            progress(done, total)

    def _pack(self, i: int, enc, temps: list):
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
            mirror = self.mirrors[i]
            data = raw if rb.layout == "identity" else \
                np.frombuffer(raw, np.float32).astype(np.float16).tobytes()
            mirror.write_mapped(data, 0)
            mirror.unmap()
            return enc
        dst = self.resident.get(i)
        if dst is None:
            raise DeviceError(f"wgpu: {where} has no device buffer (allocate did not run?)")
        if rb.layout == "identity":
            self.ctx.uploader.write(dst, self._res_base.get(i, 0), raw, defer=True)
            return enc
        # fp16: float32 bytes to a temporary, then the pack kernel (a cast map) into the buffer.
        tmp = self._buffer(raw.nbytes, f"{where} float32 source")
        self._owned.pop()
        temps.append(tmp)
        self.ctx.uploader.write(tmp, 0, raw, defer=True)
        calls = kernels.pack_fp16_calls(BufferRef("temp", 0, 0, raw.nbytes), BufferRef("resident", i, 0, rb.nbytes),
                                        n, self.limits, label=where)
        launches = self._launches(-1, calls, [], extra={"temp": tmp})
        if enc is None:
            enc = self.device.create_command_encoder()
        cp = enc.begin_compute_pass()
        for L in launches:
            cp.set_pipeline(L.pipeline)
            cp.set_bind_group(0, L.bind_group)
            cp.dispatch_workgroups(*L.workgroups)
        cp.end()
        return enc

    def _write(self, buf, offset: int, data) -> None:
        """Host bytes into a device buffer: large ones through the context's staging ring, small
        ones with queue.write_buffer (the tail padded to a multiple of 4 bytes)."""
        mv = memoryview(data).cast("B")
        if mv.nbytes >= UPLOAD_DIRECT:
            self.ctx.uploader.write(buf, offset, mv)
            return
        full = mv.nbytes // 4 * 4
        for s in range(0, full, UPLOAD_PIECE):
            self.queue.write_buffer(buf, offset + s, mv[s:min(full, s + UPLOAD_PIECE)])
        if full < mv.nbytes:
            tail = bytearray(4)
            tail[:mv.nbytes - full] = mv[full:]
            self.queue.write_buffer(buf, offset + full, tail)

    # ------------------------------------------------------------------ run
    def _write_input(self, p: int, i: int, ref: TensorRef, x: Any, enc) -> None:
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
                size = _up4(ref.buf.nbytes)
                if src is dst:  # WebGPU copies need distinct buffers: bounce through a temporary
                    tmp = self.device.create_buffer(size=size, usage=self._usage())
                    enc.copy_buffer_to_buffer(src, off, tmp, 0, size)
                    src, off = tmp, 0
                enc.copy_buffer_to_buffer(src, off, dst, ref.buf.offset, size)
                return
            x = x.numpy()
        if isinstance(x, HostTensor) and x.dtype == ref.dtype:
            self._write(dst, ref.buf.offset, x.data)
            return
        a = to_storage(x, ref.dtype, where)
        self._write(dst, ref.buf.offset, a)

    def _encode(self, p: int, enc) -> Optional[Any]:
        rec = self.recorded[p]
        qs = None
        if self.profile:
            n = max(1, 2 * len(rec.nodes))
            qs = self.device.create_query_set(type="timestamp", count=n)
        cp = None
        last_pipe = None
        q = 0
        for node in rec.nodes:
            if node.loads:
                if cp is not None:
                    cp.end()
                    cp = None
                for ld in node.loads:
                    self._encode_load(enc, ld)
            if not node.launches:
                continue
            if self.profile:
                if cp is not None:
                    cp.end()
                cp = enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": q,
                                                              "end_of_pass_write_index": q + 1})
                q += 2
                last_pipe = None
            elif cp is None:
                cp = enc.begin_compute_pass()
                last_pipe = None
            if _RAW is not None:
                set_pipe, set_bg, dispatch, null = _RAW
                h = cp._internal
                for L in node.launches:
                    if L.pipeline is not last_pipe:
                        set_pipe(h, L.pipeline._internal)
                        last_pipe = L.pipeline
                    set_bg(h, 0, L.bind_group._internal, 0, null)
                    x, y, z = L.workgroups
                    dispatch(h, x, y, z)
            else:
                for L in node.launches:
                    if L.pipeline is not last_pipe:
                        cp.set_pipeline(L.pipeline)
                        last_pipe = L.pipeline
                    cp.set_bind_group(0, L.bind_group)
                    cp.dispatch_workgroups(*L.workgroups)
            if self.profile:
                cp.end()
                cp = None
        if cp is not None:
            cp.end()
        for ld in rec.tail_loads:
            self._encode_load(enc, ld)
        if self.profile and q:
            U = self.wgpu.BufferUsage
            rbuf = self.device.create_buffer(size=8 * q, usage=U.QUERY_RESOLVE | U.COPY_SRC)
            enc.resolve_query_set(qs, 0, q, rbuf, 0)
            return rbuf, q
        return None

    def _encode_load(self, enc, ld: OffloadLoad) -> None:
        src = self.mirrors.get(ld.buffer)
        if src is None:
            raise DeviceError(f"wgpu: the plan streams buffer {ld.buffer}, which has no host mirror")
        enc.copy_buffer_to_buffer(src, 0, self.slots[ld.slot], 0, src.size)
        self.bytes_streamed += src.size

    def run(self, payload: int, inputs: Sequence[Any], keep_on_device: bool = False) -> List[Any]:
        """Host inputs go through ``queue.write_buffer`` (ordered before the next submit), device
        tensor inputs through copies in a command buffer of their own, then the payload's chain.
        The chain is the same every run, so the next run's is encoded right after this submit,
        while the GPU works (MiniLM 32x128: 160 dispatches, 0.3-0.5 ms of Python per encode)."""
        inputs = list(inputs)
        pp = self.begin_run(payload, inputs)
        enc = self.device.create_command_encoder()
        for i, (ref, x) in enumerate(zip(pp.inputs, inputs)):
            self._write_input(payload, i, ref, x, enc)
        prof = None
        if self.profile:
            prof = self._encode(payload, enc)
            cbs = []
        else:
            cbs = [enc.finish(), self._take_chain(payload)]
            enc = self.device.create_command_encoder()
        if keep_on_device:
            self.queue.submit(cbs + [enc.finish()])
            self._encode_ahead(payload)
            outs = [DeviceTensor(self, r.dtype, tuple(r.shape), (self.buffer_of(payload, r.buf), r.buf.offset), r.buf.nbytes)
                    for r in pp.outputs]
            if prof:
                self._read_profile(payload, *prof)
            return outs
        outs = self._download(enc, [(self.buffer_of(payload, r.buf), r.buf.offset, r) for r in pp.outputs],
                              before=cbs, after_submit=lambda: self._encode_ahead(payload))
        if prof:
            self._read_profile(payload, *prof)
        return outs

    def _take_chain(self, p: int):
        """The payload's chain as a finished command buffer: the one encoded ahead, else now."""
        got = self._ahead.pop(p, None)
        if got is None:
            got = self._chain(p)
        cb, streamed = got
        self.bytes_streamed += streamed
        return cb

    def _chain(self, p: int) -> Tuple[Any, int]:
        before = self.bytes_streamed
        enc = self.device.create_command_encoder()
        self._encode(p, enc)
        streamed = self.bytes_streamed - before
        self.bytes_streamed = before  # counted when submitted (_take_chain)
        return enc.finish(), streamed

    def _encode_ahead(self, p: int) -> None:
        if not self.profile and not self.closed:
            self._ahead[p] = self._chain(p)

    def _download(self, enc, items: List[Tuple[Any, int, Any]], before: Sequence[Any] = (),
                  after_submit: Optional[Callable[[], None]] = None) -> List[np.ndarray]:
        """Copy ``items`` (buffer, offset, TensorRef-like with dtype/shape/buf.nbytes) into one pooled
        MAP_READ buffer in ``enc``, submit (after the command buffers ``before``), call
        ``after_submit`` while the GPU works, map once, and return host arrays."""
        offs, size = [], 0
        for _, _, r in items:
            offs.append(size)
            size += _up4(_dt.nbytes(r.dtype, r.shape))
        staging = self.ctx.staging.get(max(size, 4)) if items else None
        for (buf, off, r), so in zip(items, offs):
            n = _dt.nbytes(r.dtype, r.shape)
            if n:
                enc.copy_buffer_to_buffer(buf, off, staging, so, _up4(n))
        self.queue.submit(list(before) + [enc.finish()])
        if after_submit is not None:
            after_submit()
        if not items:
            return []
        staging.map_sync(self.wgpu.MapMode.READ, 0, max(_up4(size), 4))
        try:
            mv = staging.read_mapped(0, max(_up4(size), 4), copy=False)
            outs = []
            for (_, _, r), so in zip(items, offs):
                n = _dt.numel(r.shape)
                a = np.frombuffer(mv, dtype=NP_DTYPE[r.dtype], count=n, offset=so).reshape(r.shape).copy()
                outs.append(from_storage(a, r.dtype))
            del mv
        finally:
            staging.unmap()
            self.ctx.staging.put(staging)
        return outs

    def _read_profile(self, p: int, rbuf, q: int) -> None:
        enc = self.device.create_command_encoder()
        (ts,) = self._download(enc, [(rbuf, 0, _Raw("int32", (2 * q,)))])
        ticks = ts.view(np.uint64)
        rec = self.recorded[p]
        nodes = [n for n in rec.nodes if n.launches]
        # WebGPU timestamps are nanoseconds.
        self.last_profile = [(n.op, n.node, float(ticks[2 * k + 1] - ticks[2 * k]) * 1e-9)
                             for k, n in enumerate(nodes)]
        rbuf.destroy()

    def to_host(self, t: DeviceTensor) -> np.ndarray:
        if t.owner is not self or self.closed:
            if t.owner is not self:
                return t.owner.to_host(t)
            raise DeviceError("wgpu executor: the session that made this device tensor is closed")
        buf, off = t.handle
        enc = self.device.create_command_encoder()
        (a,) = self._download(enc, [(buf, off, _Raw(t.dtype, tuple(t.shape)))])
        return a

    def close(self) -> None:
        if self.closed:
            return
        for b in self._owned:
            try:
                b.destroy()
            except Exception:
                pass
        self._owned.clear()
        self._ahead.clear()
        self.arena.clear()
        self.resident.clear()
        self._res_base.clear()
        self.mirrors.clear()
        self.slots = []
        self.recorded.clear()
        super().close()


@dataclass
class _Raw:
    """dtype/shape of a byte range to download (a TensorRef without a plan location)."""

    dtype: str
    shape: tuple


def transfer(srcs: Sequence[Any], dsts: Sequence[Any]) -> None:
    """Environment data transfers host <-> wgpu and wgpu <-> wgpu."""
    for s, d in zip(srcs, dsts):
        if isinstance(d, DeviceTensor):
            ex: WgpuExecutor = d.owner
            buf, off = d.handle
            if isinstance(s, DeviceTensor) and s.device == "wgpu" and s.owner.device is ex.device:
                sbuf, soff = s.handle
                enc = ex.device.create_command_encoder()
                size = _up4(d.nbytes)
                if sbuf is buf:
                    tmp = ex.device.create_buffer(size=size, usage=ex._usage())
                    enc.copy_buffer_to_buffer(sbuf, soff, tmp, 0, size)
                    sbuf, soff = tmp, 0
                enc.copy_buffer_to_buffer(sbuf, soff, buf, off, size)
                ex.queue.submit([enc.finish()])
                continue
            host = s.numpy() if isinstance(s, DeviceTensor) else s
            ex._write(buf, off, to_storage(host, d.dtype, "copy_tensors"))
            continue
        host = s.numpy() if isinstance(s, DeviceTensor) else s
        dst = d.data if isinstance(d, HostTensor) else d
        np.asarray(dst).reshape(-1)[...] = np.asarray(host).reshape(-1)
