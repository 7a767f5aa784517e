"""The browser executor: carries out a SessionPlan on WebGPU through Pyodide's ``js`` bridge.

Same plan (``gpudelegate.plan.plan_session``), same WGSL files (``gpudelegate.shaders``) and same
kernel selection (``gpudelegate.kernels``) as the desktop wgpu executor; only the calls differ.

- Constants go from the fetched program bytes (a JS ``Uint8Array`` over the data segment, see
  ``web/loader.py``) to GPU buffers with ``queue.writeBuffer`` on typed-array views, chunk by chunk
  with progress: no copy through the WebAssembly heap.
- Recording builds pipelines and bind groups once and a flat JS array
  ``[pipeline, bindGroup, x, y, z, ...]`` per segment of the chain; at the first run these, the
  input/output buffers and the offload loads become one JS plan object, and a run is one JS call
  (``_ENCODE_JS``): the inputs are read by JS straight from Python's buffers, and nothing crosses
  the bridge per dispatch, per segment or per input.
- Offloaded weights: the plan's slot ring; each load is a ``queue.writeBuffer`` into its slot from
  the host mirror. A write is ordered after every command buffer submitted before it, so the chain
  is cut into segments at load points and each segment is submitted before the loads that follow it.
- ``run_async`` awaits the read-back; ``run`` (the Executor interface) blocks on it through JSPI.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gpudelegate import dtypes as _dt
from gpudelegate import shaders
from gpudelegate.errors import DeviceError, InputError
from gpudelegate.executor import DeviceContext, DeviceTensor, Executor, HostTensor, Progress
from gpudelegate.plan.types import BufferRef, DeviceLimits, SessionPlan, TensorRef

from . import webgpu
from .webgpu import js, to_js

DUMMY_SLOTS = 16  # binding slots a kernel may leave unused (each gets its own dummy range)
UPLOAD_PIECE = 16 << 20  # bytes per writeBuffer: bounds transient GPU-process memory; progress granularity

# One run's host side in one JS call (no Python -> JS crossing per dispatch, per segment or per
# input): input writes, device-tensor copies, offload loads with their submits, recorded copies,
# the dispatch loop, output copies and the submit. ``plan`` is built once per payload
# (``_js_plan``); the arguments after ``staging`` are one per input: 1 (its bytes are in
# ``plan.host[i]``, a Uint8Array that Python filled with one ``assign``), a [buffer, offset] pair
# (a device tensor, copied on the encoder) or null (already in place). Measured in Chromium 156:
# ``assign`` into a kept typed array costs ~1 us, a ``to_js`` copy ~5 us and a PyProxy argument
# read with ``getBuffer`` ~10 us.
# mode 0: finish the command buffer and drop it (benchmarks: the host side alone); 1: submit;
# 2: also copy the outputs into ``staging`` and submit.
_ENCODE_JS = """
const queue = plan.queue, PIECE = plan.piece;
const write = (dst, off, src, n) => {
  const full = n - (n % 4);
  for (let s = 0; s < full; s += PIECE) queue.writeBuffer(dst, off + s, src, s, Math.min(PIECE, full - s));
  if (full < n) { const t = new Uint8Array(4); t.set(src.subarray(full, n)); queue.writeBuffer(dst, off + full, t, 0, 4); }
};
const ins = plan.ins;
let enc = plan.device.createCommandEncoder();
for (let i = 0; i < xs.length; i++) {
  const x = xs[i];
  if (x == null) continue;
  if (x === 1) queue.writeBuffer(ins[3 * i], ins[3 * i + 1], plan.host[i]);
  else enc.copyBufferToBuffer(x[0], x[1], ins[3 * i], ins[3 * i + 1], (ins[3 * i + 2] + 3) & ~3);
}
const segs = plan.segs;
for (let si = 0; si < segs.length; si++) {
  const seg = segs[si];
  const loads = seg.loads;
  if (loads.length) {
    // Loads must land after the work already encoded has run: submit it first.
    queue.submit([enc.finish()]);
    for (let j = 0; j < loads.length; j += 3) write(loads[j], 0, loads[j + 1], loads[j + 2]);
    enc = plan.device.createCommandEncoder();
  }
  const c = seg.copies;
  for (let j = 0; j < c.length; j += 5) enc.copyBufferToBuffer(c[j], c[j + 1], c[j + 2], c[j + 3], c[j + 4]);
  const list = seg.list;
  if (list.length) {
    const pass = enc.beginComputePass();
    for (let j = 0; j < list.length; j += 5) {
      pass.setPipeline(list[j]);
      pass.setBindGroup(0, list[j + 1]);
      pass.dispatchWorkgroups(list[j + 2], list[j + 3], list[j + 4]);
    }
    pass.end();
  }
}
if (mode === 0) { enc.finish(); return null; }
if (mode === 2) {
  const r = plan.reads;
  for (let j = 0; j < r.length; j += 4) enc.copyBufferToBuffer(r[j], r[j + 1], staging, r[j + 2], r[j + 3]);
}
queue.submit([enc.finish()]);
return null;
"""


# float32 -> float16 bytes in JS: Float16Array (Chromium 135+, Firefox 129+) converts natively.
# Done entirely in JS: Pyodide 314 cannot wrap a Float16Array as a Python buffer.
_F16_JS = """
if (typeof Float16Array === "undefined") return null;
const f32 = (src.byteOffset % 4 === 0) ? new Float32Array(src.buffer, src.byteOffset, n)
                                       : new Float32Array(src.slice().buffer, 0, n);
return new Uint8Array(new Float16Array(f32).buffer);
"""
_to_f16 = None


def _init_f16() -> bool:
    global _to_f16
    if js().eval("typeof Float16Array") == "undefined":
        return False
    _to_f16 = js().Function.new("src", "n", _F16_JS)
    return True


def _round4(n: int) -> int:
    return max(4, (n + 3) // 4 * 4)


@dataclass
class Segment:
    """Dispatches replayed in one compute pass, preceded by the offload loads they wait for."""

    loads: List[Any] = field(default_factory=list)  # OffloadLoad
    copies: List[tuple] = field(default_factory=list)  # (src, src offset, dst, dst offset, nbytes) before the pass
    launches: List[tuple] = field(default_factory=list)  # (pipeline, bind group, x, y, z, op, node)
    js_list: Any = None


@dataclass
class Recorded:
    segments: List[Segment]
    scratch: List[Any]
    dispatch_count: int


class WebGPUContext(DeviceContext):
    """The page's WebGPU device (GPUState) with the shader-module and pipeline caches that every
    session of the Environment shares."""

    kind = "webgpu"

    def __init__(self, st: "webgpu.GPUState"):
        self.st = st
        self.device = st.device
        lim = st.device.limits
        self._limits = DeviceLimits(max_buffer_size=int(lim.maxBufferSize),
                                    max_binding_size=int(lim.maxStorageBufferBindingSize),
                                    offset_alignment=int(lim.minStorageBufferOffsetAlignment),
                                    name=f"webgpu:{st.info['vendor']}/{st.info['architecture']}")
        self.uniform_alignment = int(lim.minUniformBufferOffsetAlignment)
        self._modules: Dict[str, Any] = {}
        self._pipelines: Dict[tuple, Any] = {}
        self._layouts: Dict[tuple, Any] = {}
        self.uncaptured: List[str] = []

        def on_error(ev):
            self.uncaptured.append(str(ev.error.message))

        from pyodide.ffi import create_proxy
        self._on_error = create_proxy(on_error)
        self.device.addEventListener("uncapturederror", self._on_error)
        self.closed = False

    @property
    def limits(self) -> DeviceLimits:
        return self._limits

    @property
    def features(self) -> Tuple[str, ...]:
        return self.st.features

    def info(self) -> dict:
        d = {"kind": self.kind, **self.st.info, "features": list(self.st.features),
             "max_buffer_size": self._limits.max_buffer_size,
             "max_binding_size": self._limits.max_binding_size}
        return d

    def create_executor(self, program, data=None, **options) -> "WebGPUExecutor":
        return WebGPUExecutor(self, program, data=data, **options)

    def module(self, name: str):
        m = self._modules.get(name)
        if m is None:
            m = self.device.createShaderModule(to_js({"code": shaders.source(name), "label": name}))
            self._modules[name] = m
        return m

    def layout(self, slots: Tuple[int, ...]):
        """(bind group layout, pipeline layout): binding 0 uniform + read_write storage ``slots``
        (core/kernels.py's convention, the same as the desktop executor's)."""
        lay = self._layouts.get(slots)
        if lay is None:
            S = js().GPUShaderStage.COMPUTE
            entries = [{"binding": 0, "visibility": S, "buffer": {"type": "uniform"}}]
            entries += [{"binding": b, "visibility": S, "buffer": {"type": "storage"}} for b in slots]
            bgl = self.device.createBindGroupLayout(to_js({"entries": entries}))
            lay = (bgl, self.device.createPipelineLayout(to_js({"bindGroupLayouts": [bgl]})))
            self._layouts[slots] = lay
        return lay

    def pipeline(self, call):
        """The compute pipeline of a ``kernels.KernelCall``, cached by its pipeline key."""
        key = call.pipeline_key
        p = self._pipelines.get(key)
        if p is None:
            _, pl = self.layout(tuple(b.binding for b in call.bindings))
            stage = {"module": self.module(call.shader), "entryPoint": call.entry}
            if call.constants:
                stage["constants"] = {k: (float(v) if isinstance(v, bool) else v) for k, v in call.constants.items()}
            p = self.device.createComputePipeline(to_js({"layout": pl, "compute": stage,
                                                         "label": f"{call.shader}:{call.entry}"}))
            self._pipelines[key] = p
        return p

    def check(self, where: str = "") -> None:
        self.st.check(where)
        if self.uncaptured:
            errs, self.uncaptured[:] = list(self.uncaptured), []
            raise DeviceError(f"WebGPU reported {len(errs)} error(s){' ' + where if where else ''}: " + " | ".join(errs[:3]))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.device.removeEventListener("uncapturederror", self._on_error)
            self._on_error.destroy()
        except Exception:
            pass
        self._pipelines.clear()
        self._layouts.clear()
        self._modules.clear()


def create_context(env=None) -> WebGPUContext:
    """Environment factory for device kind "webgpu" (registered in gpudelegate.environment)."""
    try:
        import js as _js  # noqa: F401
    except ImportError:
        raise DeviceError("device 'webgpu' runs in a browser (Pyodide); on the desktop use device='wgpu'") from None
    return WebGPUContext(webgpu.get_state())


async def init_context(env) -> WebGPUContext:
    """Create the WebGPU device asynchronously, then the Environment's context for it (the async
    path for callers that cannot use JSPI)."""
    await webgpu.init()
    return env.context("webgpu")


class WebGPUExecutor(Executor):
    kind = "webgpu"

    def __init__(self, context: WebGPUContext, program, data=None, tuning=None):
        super().__init__(context, program)
        if tuning is None and context.st.info.get("is_fallback_adapter"):
            # Software adapters (SwiftShader): the barrier-heavy gemv kernels were 1.5x slower
            # than tiled products for M=1 rows (SmolLM2 decode step 27 s -> 17.7 s, measured).
            from gpudelegate.kernels import Tuning
            tuning = Tuning(gemv_max_m=0)
        self.tuning = tuning  # kernels.Tuning: kernel choices (None: kernels.py's defaults)
        self.ctx = context
        self.device = context.device
        self.queue = context.device.queue
        self.data = data  # JS Uint8Array over the program's data segment, or None
        self.arena: Dict[int, List[Any]] = {}
        self.resident: Dict[int, Any] = {}
        self.host_mirror: Dict[int, Any] = {}  # streamed buffer index -> JS bytes (view or packed copy)
        self.slots: List[Any] = []
        self.recorded: Dict[int, Recorded] = {}
        self._staging: Dict[int, List[Any]] = {}
        self._dummy = None
        self.prepacked = False
        self._owned: List[Any] = []
        self._encode_js = js().Function.new("plan", "mode", "staging", "...xs", _ENCODE_JS)
        self._js_plans: Dict[int, Any] = {}  # payload -> the JS plan _ENCODE_JS replays (built at the first run)
        self._host_in: Dict[int, List[tuple]] = {}  # payload -> per input (dtype, nbytes, the typed array its bytes go into)
        self.stats = {"uploaded_bytes": 0, "runs": 0}

    # ------------------------------------------------------------------ buffers
    def _create_buffer(self, nbytes: int, usage: int, label: str):
        lim = self.ctx.limits
        size = _round4(nbytes)
        if size > lim.max_buffer_size:
            raise DeviceError(f"{label}: {size} bytes exceeds this device's maxBufferSize {lim.max_buffer_size}")
        buf = self.device.createBuffer(to_js({"size": size, "usage": usage, "label": label}))
        self._owned.append(buf)
        return buf

    def _storage_usage(self) -> int:
        U = js().GPUBufferUsage
        return U.STORAGE | U.COPY_SRC | U.COPY_DST

    def buffer_of(self, payload: int, ref: BufferRef, scratch=None):
        try:
            if ref.space == "arena":
                return self.arena[payload][ref.index]
            if ref.space == "resident":
                return self.resident[ref.index]
            if ref.space == "slot":
                return self.slots[ref.index]
            if ref.space == "scratch":
                return scratch[ref.index]
            if ref.space == "dummy":
                return self._dummy
        except (KeyError, IndexError, TypeError):
            pass
        raise DeviceError(f"webgpu: payloads[{payload}] refers to {ref.space} buffer {ref.index}, which this executor does not have")

    # ------------------------------------------------------------------ build phases
    def allocate(self, plan: SessionPlan) -> None:
        self.plan = plan
        usage = self._storage_usage()
        streamed = set(plan.offload.streamed) if plan.offload else set()
        # Unused inputs bind a 16-byte range of this buffer, a different range per binding slot:
        # Dawn rejects two writable bindings of one dispatch that overlap (wgpu-native does not).
        self._dummy = self._create_buffer(DUMMY_SLOTS * self.ctx.limits.offset_alignment, usage, "dummy binding")
        for i, rb in enumerate(plan.prepack.buffers):
            if i not in streamed:
                self.resident[i] = self._create_buffer(rb.nbytes, usage, f"resident[{i}] constants[{rb.constant}] {rb.layout}")
        if plan.offload:
            self.slots = [self._create_buffer(n, usage, f"offload slot {j}") for j, n in enumerate(plan.offload.slots)]
        for p, pp in plan.payloads.items():
            self.arena[p] = [self._create_buffer(n, usage, f"payloads[{p}] arena object {j}") for j, n in enumerate(pp.memory.objects)]

    def _load_points(self, p: int, pp) -> Dict[int, list]:
        """Offload loads by the position (index into pp.dispatches) they run before: the earliest
        the plan allows (issue_before reached, the slot's previous reader ``reuse_after`` done).
        Position len(dispatches) means after the last dispatch."""
        out: Dict[int, list] = {}
        if self.plan.offload is None:
            return out
        nodes = [d.node for d in pp.dispatches]
        for ld in self.plan.offload.loads.get(p, []):
            t = max(ld.issue_before, getattr(ld, "reuse_after", -1) + 1)
            if t > ld.needed_by:
                raise DeviceError(f"webgpu: payloads[{p}] offload load of buffer {ld.buffer} cannot run before node "
                                  f"{ld.needed_by} that needs it (issue_before {ld.issue_before}, reuse_after {ld.reuse_after})")
            pos = next((i for i, n in enumerate(nodes) if n >= t), len(nodes))
            out.setdefault(pos, []).append(ld)
        for lds in out.values():
            lds.sort(key=lambda ld: ld.issue_before)
        return out

    def record(self, plan: SessionPlan) -> None:
        from gpudelegate import kernels

        J = js()
        U = J.GPUBufferUsage
        align = max(self.ctx.uniform_alignment, 16)
        self.device.pushErrorScope("validation")
        for p, pp in plan.payloads.items():
            per_dispatch = list(zip(pp.dispatches, kernels.select_all(pp, self.ctx.limits, self.ctx.features,
                                                                      self.tuning, f"payloads[{p}]")))
            sizes: Dict[int, int] = {}
            for _, calls in per_dispatch:
                for k, n in kernels.scratch_sizes(calls).items():
                    sizes[k] = max(sizes.get(k, 0), n)
            scratch = [self._create_buffer(sizes.get(k, 4), self._storage_usage(), f"payloads[{p}] scratch {k}")
                       for k in range(max(sizes, default=-1) + 1)]
            # One uniform buffer per payload, written once; each call binds its aligned range.
            flat = [c for _, calls in per_dispatch for c in calls]
            offs, size = [], 0
            for c in flat:
                size = (size + align - 1) // align * align
                offs.append(size)
                size += _round4(len(c.uniform))
            ubuf = None
            if flat:
                blob = bytearray(_round4(size))
                for c, o in zip(flat, offs):
                    blob[o:o + len(c.uniform)] = c.uniform
                ubuf = self._create_buffer(len(blob), U.UNIFORM | U.COPY_DST, f"payloads[{p}] uniforms")
                self.queue.writeBuffer(ubuf, 0, to_js(memoryview(blob)))
            loads = self._load_points(p, pp)
            segments = [Segment()]
            at = 0
            for pos, (d, calls) in enumerate(per_dispatch):
                if pos in loads:
                    if segments[-1].launches or segments[-1].loads:
                        segments.append(Segment())
                    segments[-1].loads.extend(loads[pos])
                for c in calls:
                    launch, copies = self._launch(p, d, c, ubuf, offs[at], scratch)
                    if copies:  # copies are encoder commands: they end the current compute pass
                        if segments[-1].launches or segments[-1].loads or segments[-1].copies:
                            segments.append(Segment())
                        segments[-1].copies.extend(copies)
                    segments[-1].launches.append(launch)
                    at += 1
            if len(per_dispatch) in loads:
                segments.append(Segment(loads=loads[len(per_dispatch)]))
            for seg in segments:
                arr = J.Array.new()
                for (pipe, bg, x, y, z, _op, _n) in seg.launches:
                    arr.push(pipe, bg, x, y, z)
                seg.js_list = arr
            self.recorded[p] = Recorded(segments, scratch, len(flat))
        self._pop_errors("while recording pipelines and bind groups")

    def _launch(self, p: int, d, call, ubuf, uoff: int, scratch) -> Tuple[tuple, List[tuple]]:
        """Bind group + pipeline of one kernel call (and copies to run before it: none since
        kernels.py stopped emitting overlapping bindings; the list stays for the recording's
        segment structure).

        WebGPU (Dawn) rejects a dispatch whose writable storage bindings overlap, and kernels.py
        binds everything read_write; kernels.py guarantees disjoint ranges (snapshots of aliased
        inputs are its own scratch copies), so an overlap here is a kernels.py bug: refused with
        the call named, before Dawn would refuse it with a less specific message."""
        bgl, _ = self.ctx.layout(tuple(b.binding for b in call.bindings))
        entries = [{"binding": 0, "resource": {"buffer": ubuf, "offset": uoff, "size": _round4(len(call.uniform))}}]
        seen: List[Tuple[Any, int, int]] = []  # (buffer, start, end) of the bindings so far
        copies: List[tuple] = []
        for b in sorted(call.bindings, key=lambda b: b.binding):
            off = b.buf.offset
            buf = self.buffer_of(p, b.buf, scratch)
            if b.buf.space == "dummy":
                if b.binding >= DUMMY_SLOTS:
                    raise DeviceError(f"webgpu: {call.shader}:{call.entry} binds a dummy at slot {b.binding} (>= {DUMMY_SLOTS})")
                off = b.binding * self.ctx.limits.offset_alignment
            elif any(sb is buf and off < e and st < off + b.buf.nbytes for sb, st, e in seen):
                raise DeviceError(f"webgpu: payloads[{p}] node {d.node} ({call.shader}:{call.entry}) binding {b.binding} "
                                  f"overlaps an earlier binding of the same call ({b.buf.space} buffer {b.buf.index}, "
                                  f"bytes {off}..{off + b.buf.nbytes}): WebGPU rejects overlapping writable bindings")
            else:
                seen.append((buf, off, off + b.buf.nbytes))
            entries.append({"binding": b.binding, "resource": {"buffer": buf, "offset": off, "size": b.buf.nbytes}})
        bg = self.device.createBindGroup(to_js({"layout": bgl, "entries": entries,
                                                "label": call.label or f"payloads[{p}] node {d.node} {d.op}"}))
        x, y, z = (tuple(call.workgroups) + (1, 1))[:3]
        return (self.ctx.pipeline(call), bg, int(x), int(y), int(z), d.op, d.node), copies

    def _pop_errors(self, where: str) -> None:
        promise = self.device.popErrorScope()
        if webgpu.can_run_sync():
            err = webgpu.run_sync(promise)
            if not webgpu.is_nullish(err):
                raise DeviceError(f"WebGPU validation error {where}: {err.message}")

    # ------------------------------------------------------------------ prepack
    def _constant_view(self, index: int):
        """A JS Uint8Array of constant ``index``'s bytes: a view over the fetched data segment
        (no copy), or the Python-side bytes of an in-memory program."""
        c = self.program.constants[index]
        if self.data is not None:
            return self.data.subarray(c.offset, c.offset + c.nbytes)
        return to_js(self.program.constant_bytes(index))

    def _packed(self, rb):
        """JS bytes of resident buffer ``rb`` in its device layout."""
        view = self._constant_view(rb.constant)
        if rb.layout == "identity":
            return view
        if rb.layout == "fp16":
            n = rb.src_nbytes // 4
            if _to_f16 is not None or _init_f16():  # native, round-to-nearest-even like numpy
                return _to_f16(view, n)
            src = bytes(view.to_bytes())
            return to_js(struct.pack(f"<{n}e", *struct.unpack(f"<{n}f", src)))
        raise DeviceError(f"prepack: layout {rb.layout!r} of constant {rb.constant} is not supported by the WebGPU executor")

    def _write(self, buf, view, nbytes: int, on_piece=None) -> None:
        """writeBuffer in pieces; the tail is padded to 4 bytes (writeBuffer's size granularity)."""
        full = nbytes // 4 * 4
        for s in range(0, full, UPLOAD_PIECE):
            n = min(UPLOAD_PIECE, full - s)
            self.queue.writeBuffer(buf, s, view, s, n)
            if on_piece:
                on_piece(n)
        if full < nbytes:
            J = js()
            tail = J.Uint8Array.new(4)
            tail.set(view.subarray(full, nbytes))
            self.queue.writeBuffer(buf, full, tail, 0, 4)
            if on_piece:
                on_piece(nbytes - full)

    def prepack(self, plan: SessionPlan, progress: Progress = None) -> None:
        self.ctx.check("before prepack")
        streamed = set(plan.offload.streamed) if plan.offload else set()
        total = sum(plan.prepack.buffers[i].nbytes for chunk in plan.prepack.chunks for i in chunk)
        done = [0]

        def tick(n):
            done[0] += n
            if progress:
                progress(done[0], total)

        for chunk in plan.prepack.chunks:
            for i in chunk:
                rb = plan.prepack.buffers[i]
                packed = self._packed(rb)
                if packed.byteLength != rb.nbytes:
                    raise DeviceError(f"prepack buffer {i} (constant {rb.constant}, {rb.layout}): packed {packed.byteLength} "
                                      f"bytes, plan expects {rb.nbytes}")
                if i in streamed:
                    self.host_mirror[i] = packed  # streamed into a slot when needed
                    tick(rb.nbytes)
                else:
                    self._write(self.resident[i], packed, rb.nbytes, tick)
                    self.stats["uploaded_bytes"] += rb.nbytes
        if progress and total == 0:
            progress(0, 0)
        self.prepacked = True

    # ------------------------------------------------------------------ run
    def _host_bytes(self, path: str, x, ref: TensorRef):
        """Storage bytes (a contiguous Python buffer) of a host input in the planned dtype (numpy-free)."""
        src_dtype = getattr(x, "dtype", None)
        name = getattr(src_dtype, "name", None) or str(src_dtype)
        have = _dt.HOST_ALIASES.get(name, name)
        if isinstance(x, HostTensor):
            data = memoryview(x.data).cast("B")
        else:
            try:
                data = memoryview(x).cast("B")
            except TypeError:
                raise InputError(f"{path}: expected a HostTensor or a buffer, got {type(x).__name__}") from None
        if name == "int64" and ref.dtype == "int32":
            vals = struct.unpack(f"<{len(data) // 8}q", data)
            if any(v < -2**31 or v >= 2**31 for v in vals):
                raise InputError(f"{path}: int64 values outside the int32 range cannot be narrowed")
            data = memoryview(struct.pack(f"<{len(vals)}i", *vals))
        elif have != ref.dtype:
            fmt_in, fmt_out = _dt.STRUCT_FORMAT[have], _dt.STRUCT_FORMAT[ref.dtype]
            n = _dt.numel(ref.shape)
            vals = struct.unpack(f"<{n}{fmt_in}", data)
            data = memoryview(struct.pack(f"<{n}{fmt_out}", *vals))
        if data.nbytes != ref.buf.nbytes:
            raise InputError(f"{path}: {data.nbytes} bytes for a {ref.dtype}{list(ref.shape)} input ({ref.buf.nbytes} bytes)")
        return data

    def _input_arg(self, payload: int, i: int, ref: TensorRef, x):
        """What _ENCODE_JS takes for input ``i``: 1 once the host bytes are in the plan's kept
        typed array, a device tensor's [buffer, offset], or None when it already sits where the
        plan wants it (e.g. a KV cache fed back)."""
        if isinstance(x, DeviceTensor):
            buf, off = x.handle
            if buf is self.buffer_of(payload, ref.buf) and off == ref.buf.offset:
                return None
            return to_js([buf, off])
        if isinstance(x, HostTensor) and x.dtype == ref.dtype and type(x.data) in (bytes, bytearray):
            if len(x.data) != ref.buf.nbytes:
                raise InputError(f"payload {payload} inputs[{i}]: {len(x.data)} bytes for a {ref.dtype}"
                                 f"{list(ref.shape)} input ({ref.buf.nbytes} bytes)")
            data = x.data  # the common case: no conversion in Python
        else:
            data = self._host_bytes(f"payload {payload} inputs[{i}]", x, ref)
        self._host_in[payload][i][2].assign(data)
        return 1

    def _js_plan(self, payload: int):
        """The payload's recorded run as one JS object for _ENCODE_JS (after prepack: offload
        loads carry the host mirrors' bytes)."""
        jp = self._js_plans.get(payload)
        if jp is not None:
            return jp
        pp = self.plan.payloads[payload]
        rec = self.recorded[payload]
        ins, host, views = [], [], []
        for ref in pp.inputs:
            ins += [self.buffer_of(payload, ref.buf), ref.buf.offset, ref.buf.nbytes]
            h = js().Uint8Array.new(_round4(ref.buf.nbytes))  # writeBuffer wants 4-byte multiples
            host.append(h)
            views.append((ref.dtype, ref.buf.nbytes, h if ref.buf.nbytes == h.byteLength else h.subarray(0, ref.buf.nbytes)))
        segs = []
        for seg in rec.segments:
            loads = []
            for ld in seg.loads:
                loads += [self.slots[ld.slot], self.host_mirror[ld.buffer], self.plan.prepack.buffers[ld.buffer].nbytes]
            segs.append({"loads": loads, "copies": [v for c in seg.copies for v in c], "list": seg.js_list})
        reads, size = [], 0
        for r in pp.outputs:
            reads += [self.buffer_of(payload, r.buf), r.buf.offset, size, _round4(r.buf.nbytes)]
            size += _round4(r.buf.nbytes)
        jp = to_js({"device": self.device, "queue": self.queue, "piece": UPLOAD_PIECE, "ins": ins, "host": host,
                    "segs": segs, "reads": reads, "read_size": max(size, 4)})
        self._host_in[payload] = views
        self._js_plans[payload] = jp
        return jp

    def _encode(self, payload: int, inputs: Sequence[Any], mode: int = 0, staging=None) -> None:
        """The run's host side in one JS call (_ENCODE_JS): mode 0 encodes and finishes without
        submitting (to time the host side); 1 submits; 2 also copies the outputs into ``staging``
        and submits. Python's part per run: one ``assign`` per host input, one call."""
        plan = self._js_plans.get(payload)
        if plan is None:
            plan = self._js_plan(payload)
        args = []
        for i, ((dtype, n, view), x) in enumerate(zip(self._host_in[payload], inputs)):
            if type(x) is HostTensor and x.dtype == dtype and type(x.data) is bytes and len(x.data) == n:
                view.assign(x.data)  # the common case, kept short: one bridge call
                args.append(1)
            else:
                args.append(self._input_arg(payload, i, self.plan.payloads[payload].inputs[i], x))
        self._encode_js(plan, mode, staging, *args)

    def _staging_buffer(self, size: int):
        pool = self._staging.setdefault(size, [])
        if pool:
            return pool.pop()
        U = js().GPUBufferUsage
        return self._create_buffer(size, U.MAP_READ | U.COPY_DST, f"staging {size}")

    async def run_async(self, payload: int, inputs: Sequence[Any], keep_on_device: bool = False) -> List[Any]:
        pp = self.begin_run(payload, inputs)
        self.ctx.check(f"before running payload {payload}")
        self.stats["runs"] += 1
        if keep_on_device:
            self._encode(payload, inputs, 1)
            return [DeviceTensor(self, r.dtype, tuple(r.shape), (self.buffer_of(payload, r.buf), r.buf.offset), r.buf.nbytes)
                    for r in pp.outputs]
        size = int(self._js_plan(payload).read_size)
        staging = self._staging_buffer(size)
        self._encode(payload, inputs, 2, staging)
        raw = await self._map(staging, size)
        out, at = [], 0
        for r in pp.outputs:
            out.append(HostTensor(r.dtype, tuple(r.shape), raw[at:at + r.buf.nbytes]))
            at += _round4(r.buf.nbytes)
        return out

    async def profile_async(self, payload: int, inputs: Sequence[Any]) -> List[Tuple[str, int, float]]:
        """Wall time of each dispatch of one run: each is submitted alone and waited for
        (``queue.onSubmittedWorkDone``), so the times include submit overhead; use it to find the
        slow kernels, not to time a whole run. Returns [(op, node, seconds)]; offloaded payloads
        are not profiled (their loads interleave)."""
        import time
        self.begin_run(payload, inputs)
        rec = self.recorded[payload]
        if any(seg.loads for seg in rec.segments):
            raise DeviceError("profile_async: payloads with offload loads are not profiled")
        # The inputs alone: the payload's JS plan without its segments.
        only_inputs = js().Object.assign(js().Object.new(), self._js_plan(payload), to_js({"segs": []}))
        refs = self.plan.payloads[payload].inputs
        self._encode_js(only_inputs, 1, None, *[self._input_arg(payload, i, ref, x)
                                                 for i, (ref, x) in enumerate(zip(refs, inputs))])
        await self.queue.onSubmittedWorkDone()
        out = []
        for seg in rec.segments:
            enc = self.device.createCommandEncoder()
            for (src, so, dst, do, n) in seg.copies:
                enc.copyBufferToBuffer(src, so, dst, do, n)
            self.queue.submit(to_js([enc.finish()]))
            for (pipe, bg, x, y, z, op, node) in seg.launches:
                t0 = time.perf_counter()
                enc = self.device.createCommandEncoder()
                cp = enc.beginComputePass()
                cp.setPipeline(pipe)
                cp.setBindGroup(0, bg)
                cp.dispatchWorkgroups(x, y, z)
                cp.end()
                self.queue.submit(to_js([enc.finish()]))
                await self.queue.onSubmittedWorkDone()
                out.append((op, node, time.perf_counter() - t0))
        self.ctx.check("after profiling")
        return out

    def run(self, payload: int, inputs: Sequence[Any], keep_on_device: bool = False) -> List[Any]:
        return webgpu.run_sync(self.run_async(payload, inputs, keep_on_device))

    async def _map(self, staging, size: int) -> bytes:
        """Map a submitted pooled MAP_READ buffer, return its bytes and put it back in the pool."""
        try:
            await staging.mapAsync(js().GPUMapMode.READ, 0, size)
        except Exception as e:
            self.ctx.check("while reading results")
            raise DeviceError(f"reading results back failed: {e}") from None
        raw = staging.getMappedRange(0, size).to_bytes()
        staging.unmap()
        self._staging[size].append(staging)
        self.ctx.check("after a run")
        return raw

    async def _read(self, parts) -> List[bytes]:
        """Copy (buffer, offset, nbytes) parts into one pooled MAP_READ buffer, map it and return
        each part's bytes."""
        offs, size = [], 0
        for _, _, n in parts:
            offs.append(size)
            size += _round4(n)
        size = max(size, 4)
        staging = self._staging_buffer(size)
        encoder = self.device.createCommandEncoder()
        for (buf, off, n), so in zip(parts, offs):
            encoder.copyBufferToBuffer(buf, off, staging, so, _round4(n))
        self.queue.submit(to_js([encoder.finish()]))
        raw = await self._map(staging, size)
        return [raw[so:so + n] for (_, _, n), so in zip(parts, offs)]

    async def to_host_async(self, t: DeviceTensor) -> HostTensor:
        buf, off = t.handle
        (b,) = await self._read([(buf, off, t.nbytes)])
        return HostTensor(t.dtype, t.shape, b)

    def to_host(self, t: DeviceTensor) -> HostTensor:
        return webgpu.run_sync(self.to_host_async(t))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for buf in self._owned:
            try:
                buf.destroy()
            except Exception:
                pass
        self._owned.clear()
        self.arena.clear()
        self.resident.clear()
        self.slots.clear()
        self._staging.clear()
        self.host_mirror.clear()
        self.recorded.clear()
        self._js_plans.clear()
        self._host_in.clear()
