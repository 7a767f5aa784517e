"""The browser WebGPU adapter (device kind ``webgpu``): the device protocol of
:mod:`gpudelegate.webgpu.device` over ``navigator.gpu`` through Pyodide's ``js`` bridge, with the
WebGPU spec's names kept as they are. The executor is the shared
:class:`~gpudelegate.webgpu.executor.WebGPUExecutor`.

What only the browser has: device creation is asynchronous (``await init()`` creates it; the
synchronous ``Environment.context("webgpu")`` path then reuses it, or creates it itself through
JSPI, ``pyodide.ffi.run_sync``, when the caller runs inside ``runPythonAsync``); a run is one
JavaScript call (``_RUN_JS``: input writes, copies, the recorded chain and the read-back copies,
so nothing crosses the Python/JS bridge per dispatch); constants are written to the GPU straight
from typed-array views of the fetched file (``loader.JsBytes``), never through the WebAssembly
heap.
"""

from __future__ import annotations

import struct
from typing import Any, Dict, List, Optional

from gpudelegate import dtypes as _dt
from gpudelegate.errors import DeviceError, InputError
from gpudelegate.executor import HostTensor, first_max
from gpudelegate.plan.types import DeviceLimits
from gpudelegate.webgpu.device import GPUDevice, RunIO, round4

from . import page_runs
from .loader import JsBytes

NO_WEBGPU = ("WebGPU is not available here: navigator.gpu is undefined. Use a browser with WebGPU "
             "(Chrome/Edge 113+, Safari 26+, Firefox 141+ on Windows); a headless Chromium needs "
             "--enable-unsafe-webgpu; the page must be served from https:// or http://localhost")
NO_ADAPTER = ("WebGPU is present but requestAdapter() returned no adapter (GPU blocklisted or "
              "disabled; a headless Chromium needs --enable-unsafe-webgpu)")


# A float32 argmax over a read-back (a greedy decode's pick): a Python list of SmolLM2's 49,152
# logits costs ~3 ms a token in Pyodide, this loop well under one. The first NaN wins, then the
# first largest value (torch.argmax's rule). ``bytes`` is a fresh Uint8Array (offset 0, aligned).
_ARGMAX_JS = """
const n = bytes.byteLength >> 2;
const f = new Float32Array(bytes.buffer, bytes.byteOffset, n);
let best = -Infinity, at = 0;
for (let i = 0; i < n; i++) {
  const v = f[i];
  if (v !== v) return i;
  if (v > best) { best = v; at = i; }
}
return at;
"""
_argmax_fn = None

# dtypes whose host bytes are their storage bytes (host_bytes' fast path: no conversion)
_STORED_AS_IS = frozenset(d for d in _dt.STRUCT_FORMAT if _dt.HOST_ALIASES.get(d, d) == d)


class PageTensor(HostTensor):
    """A HostTensor read back in the page: the same dtype/shape/bytes, with an ``argmax`` that
    runs in JavaScript for float32 (``gpudelegate.llm.greedy_token`` uses it)."""

    def argmax(self) -> int:
        global _argmax_fn
        if not len(self.data):
            raise InputError(f"argmax of an empty {self.dtype}{list(self.shape)} tensor")
        if self.dtype != "float32":
            return first_max(_dt.byte_view(self.data).cast(_dt.STRUCT_FORMAT[self.dtype]).tolist())
        if _argmax_fn is None:
            _argmax_fn = js().Function.new("bytes", _ARGMAX_JS)
        from pyodide.ffi import to_js as _to_js
        return int(_argmax_fn(_to_js(memoryview(self.data))))


def js():
    import js as _js  # only importable inside Pyodide; imported lazily so the module is testable
    return _js


def to_js(x: Any):
    """Python dicts/lists -> plain JS objects/arrays (WebGPU descriptors)."""
    from pyodide.ffi import to_js as _to_js
    return _to_js(x, dict_converter=js().Object.fromEntries)


def is_nullish(x) -> bool:
    """JS null/undefined as Pyodide hands them over (None, or a JsNull object in Pyodide 314)."""
    return x is None or type(x).__name__ in ("JsNull", "JsUndefined") or str(x) in ("null", "undefined") \
        and type(x).__module__.startswith("pyodide")


def can_run_sync() -> bool:
    try:
        from pyodide.ffi import can_run_sync as _can
    except ImportError:
        return False
    return bool(_can())


def run_sync(awaitable):
    """Block on a JS promise / Python awaitable through JSPI; a clear DeviceError where the
    caller's stack cannot be suspended (plain runPython, or a browser without JSPI)."""
    if not can_run_sync():
        raise DeviceError("this call needs to wait for the GPU, which a synchronous call can only do "
                          "through JSPI (run it inside pyodide.runPythonAsync, in a browser with "
                          "JSPI), or use the async API: await session.run_async(...)")
    from pyodide.ffi import run_sync as _run_sync
    return _run_sync(awaitable)


class GPUState:
    """The page's adapter and device, and why it was lost (if it was)."""

    def __init__(self, adapter, device, features):
        self.adapter = adapter
        self.device = device
        self.queue = device.queue
        self.features = features
        self.lost_reason: Optional[str] = None
        info = getattr(adapter, "info", None)
        # the tensor-core shapes the lowering may use (ops_sgmat.py); none without the feature
        self.subgroup_matrix_configs = subgroup_matrix_configs(info) \
            if "chromium-experimental-subgroup-matrix" in features else ()
        self.info = {
            "vendor": str(getattr(info, "vendor", "") or ""),
            "architecture": str(getattr(info, "architecture", "") or ""),
            "device": str(getattr(info, "device", "") or ""),
            "description": str(getattr(info, "description", "") or ""),
            "is_fallback_adapter": bool(getattr(info, "isFallbackAdapter", False)),
        }

    def check(self, where: str = "") -> None:
        if self.lost_reason is not None:
            raise DeviceError(f"the WebGPU device was lost{' ' + where if where else ''}: {self.lost_reason}; "
                              f"reload the page (or create a new Environment) to start again")


_STATE: Optional[GPUState] = None


def state() -> Optional[GPUState]:
    return _STATE if _STATE is not None and _STATE.lost_reason is None else None


# The limits we ask for: the adapter's own, so big models get big bindings (the defaults are
# 128 MiB per binding and 256 MiB per buffer), and its offset alignments (the default is 256
# bytes; desktop wgpu and Dawn ask for the adapter's, e.g. 32 or 16), so the planner packs
# tensors and uniforms as tightly in the page as on the desktop and both lower the same plan.
_WANTED_LIMITS = ("maxBufferSize", "maxStorageBufferBindingSize", "maxStorageBuffersPerShaderStage",
                  "maxComputeWorkgroupStorageSize", "maxComputeInvocationsPerWorkgroup",
                  "maxComputeWorkgroupSizeX", "maxComputeWorkgroupSizeY", "maxComputeWorkgroupsPerDimension",
                  "minStorageBufferOffsetAlignment", "minUniformBufferOffsetAlignment")
_WANTED_FEATURES = ("shader-f16", "timestamp-query", "subgroups", "chromium-experimental-subgroup-matrix")


def subgroup_matrix_configs(info) -> tuple:
    """Chrome's ``GPUAdapterInfo.subgroupMatrixConfigs`` (with the subgroup-matrix feature) as the
    ``{"component", "result", "M", "N", "K"}`` dicts of ``GPUDevice.subgroup_matrix_configs``."""
    configs = getattr(info, "subgroupMatrixConfigs", None)
    if is_nullish(configs):
        return ()
    return tuple({"component": str(c.componentType), "result": str(c.resultComponentType),
                  "M": int(c.M), "N": int(c.N), "K": int(c.K)} for c in configs)


async def init(power_preference: str = "high-performance") -> GPUState:
    """Create (once) the page's WebGPU adapter and device. Raises DeviceError with a message that
    says what to do when WebGPU or an adapter is missing."""
    global _STATE
    if state() is not None:
        return _STATE
    J = js()
    gpu = getattr(J.navigator, "gpu", None)
    if is_nullish(gpu):
        raise DeviceError(NO_WEBGPU)
    adapter = await gpu.requestAdapter(to_js({"powerPreference": power_preference}))
    if is_nullish(adapter):
        raise DeviceError(NO_ADAPTER)
    features = [f for f in _WANTED_FEATURES if adapter.features.has(f)]
    limits = {}
    for name in _WANTED_LIMITS:
        v = getattr(adapter.limits, name, None)
        if v is not None:
            limits[name] = int(v)
    device = await adapter.requestDevice(to_js({"requiredFeatures": features, "requiredLimits": limits}))
    st = GPUState(adapter, device, tuple(features))

    def on_lost(info):
        st.lost_reason = f"{info.reason}: {info.message}" if getattr(info, "message", "") else str(info.reason)

    from pyodide.ffi import create_once_callable
    device.lost.then(create_once_callable(on_lost))
    _STATE = st
    return st


def get_state() -> GPUState:
    """The initialized state, creating it through JSPI if needed (see module doc)."""
    st = state()
    if st is not None:
        return st
    if _STATE is not None and _STATE.lost_reason is not None:
        _STATE.check()
    return run_sync(init())


UPLOAD_PIECE = 16 << 20  # bytes per writeBuffer: bounds transient GPU-process memory; progress granularity

# One run's host side in one JS call. ``cmds`` is the recorded chain as compute passes: [copies,
# dispatches] pairs, the copies (src, src offset, dst, dst offset, size) encoded before the pass,
# the dispatches (pipeline, bind group, x, y, z) in it; a step with copies ends the pass before it.
# These are the arrays a hand-written loop walks: the flat array of tagged 6-entry records they
# replaced cost about twice the plain loop's time per dispatch in Chromium (pages_probes.py's
# slope in benchmarks/gpu_browser; docs/NOTES.md). ``writes`` (buffer, offset, source Uint8Array,
# offset in it, size: a kept run's inputs are all in its stage, a view of the WebAssembly heap,
# page_runs.py), ``copies`` (5 each) come before it, ``reads`` (buffer, offset, staging offset,
# size) after it, copied into ``staging``.
_RUN_JS = """
const full = (n) => n - (n % 4);
for (let j = 0; j < writes.length; j += 5) {
  const buf = writes[j], off = writes[j + 1], src = writes[j + 2], at = writes[j + 3], n = writes[j + 4], f = full(n);
  for (let s = 0; s < f; s += PIECE) queue.writeBuffer(buf, off + s, src, at + s, Math.min(PIECE, f - s));
  if (f < n) { const t = new Uint8Array(4); t.set(src.subarray(at + f, at + n)); queue.writeBuffer(buf, off + f, t, 0, 4); }
}
const enc = device.createCommandEncoder();
for (let j = 0; j < copies.length; j += 5) enc.copyBufferToBuffer(copies[j], copies[j + 1], copies[j + 2], copies[j + 3], copies[j + 4]);
for (let p = 0; p < cmds.length; p++) {
  const cp = cmds[p][0], list = cmds[p][1];
  for (let j = 0; j < cp.length; j += 5) enc.copyBufferToBuffer(cp[j], cp[j + 1], cp[j + 2], cp[j + 3], cp[j + 4]);
  if (list.length) {
    const pass = enc.beginComputePass();
    let last = null;
    for (let i = 0; i < list.length; i += 5) {
      if (list[i] !== last) { last = list[i]; pass.setPipeline(last); }
      pass.setBindGroup(0, list[i + 1]);
      pass.dispatchWorkgroups(list[i + 2], list[i + 3], list[i + 4]);
    }
    pass.end();
  }
}
for (let j = 0; j < reads.length; j += 4) enc.copyBufferToBuffer(reads[j], reads[j + 1], staging, reads[j + 2], reads[j + 3]);
if (SUBMIT) queue.submit([enc.finish()]); else enc.finish();
return null;
"""

_BIND_RUN_JS = """
return (cmds, writes, copies, reads, staging, SUBMIT) =>
  run(device, queue, PIECE, cmds, writes, copies, reads, staging, SUBMIT);
"""

# float32 -> float16 bytes in JS: Float16Array (Chromium 135+, Firefox 129+) converts natively
# (round to nearest even, like numpy). Done in JS: Pyodide cannot wrap a Float16Array as a buffer.
_F16_JS = """
if (typeof Float16Array === "undefined") return null;
const f32 = (src.byteOffset % 4 === 0) ? new Float32Array(src.buffer, src.byteOffset, n)
                                       : new Float32Array(src.slice().buffer, 0, n);
return new Uint8Array(new Float16Array(f32).buffer);
"""


class _Chain:
    def __init__(self, steps, cmds):
        self.steps = steps
        self.cmds = cmds  # the JS array of [copies, dispatches] passes _RUN_JS replays
        self.kept: List[page_runs.KeptRun] = []  # its payload's runs bound in JS (page_runs.py), most recent first


class _PendingRead:
    """A submitted read-back (``WebGPUContext.submit_read``): its staging buffer, the mapAsync
    promise started at submit, where each read sits in the staging buffer and its size."""

    def __init__(self, staging, promise, offsets, size: int, sizes):
        self.staging, self.promise, self.offsets, self.size, self.sizes = staging, promise, offsets, size, sizes


class WebGPUContext(GPUDevice):
    """The page's WebGPU device (GPUState) with the caches every session of the Environment
    shares."""

    kind = "webgpu"

    def __init__(self, st: "GPUState"):
        self.st = st
        self.device = st.device
        self.queue = st.device.queue
        lim = st.device.limits
        limits = DeviceLimits(max_buffer_size=int(lim.maxBufferSize),
                              max_binding_size=int(lim.maxStorageBufferBindingSize),
                              offset_alignment=int(lim.minStorageBufferOffsetAlignment),
                              max_workgroup_storage=int(lim.maxComputeWorkgroupStorageSize),
                              max_workgroup_invocations=min(int(lim.maxComputeInvocationsPerWorkgroup),
                                                            int(lim.maxComputeWorkgroupSizeX)),
                              name=f"webgpu:{st.info['vendor']}/{st.info['architecture']}")
        super().__init__(limits, st.features, int(lim.minUniformBufferOffsetAlignment), st.info.get("is_fallback_adapter"))
        self.subgroup_matrix_configs = st.subgroup_matrix_configs
        if self.is_fallback_adapter:
            # Software adapters (SwiftShader): the barrier-heavy gemv kernels, float and packed,
            # run slower there than tiled products for rows of one token (docs/NOTES.md).
            from gpudelegate.webgpu.lowering import Tuning
            self.default_tuning = Tuning(gemv_max_m=0, qgemv_max_m=0)
            # A step submitted ahead runs on the CPU cores the step being waited for needs: the
            # greedy loop gains nothing there (it measured slower per token), so none ahead.
            self.greedy_lookahead = 0
        self.uncaptured: List[str] = []

        def on_error(ev):
            self.uncaptured.append(str(ev.error.message))

        from pyodide.ffi import create_proxy
        self._on_error = create_proxy(on_error)
        self.device.addEventListener("uncapturederror", self._on_error)
        J = js()
        self._run_js = J.Function.new("device", "queue", "PIECE", "cmds", "writes", "copies", "reads", "staging",
                                      "SUBMIT", _RUN_JS)
        # The same function with this context's device, queue and piece size bound in JS: each
        # argument of a call from Python is converted on the way, and these three never change.
        self._run_bound = J.Function.new("run", "device", "queue", "PIECE", _BIND_RUN_JS)(
            self._run_js, self.device, self.queue, UPLOAD_PIECE)
        self._bind_kept = J.Function.new("run", "cmds", "locs", "reads", "stage", page_runs.BIND_KEPT_JS)
        self._f16 = J.Function.new("src", "n", _F16_JS) if J.eval("typeof Float16Array") != "undefined" else None
        self._staging: Dict[int, List[Any]] = {}
        self._io_arrays: Dict[tuple, tuple] = {}  # a run's read locations -> kept JS arrays (_reads_of)
        self._empty = J.Array.new()  # never written to: the "none" of _RUN_JS's arrays

    def info(self) -> dict:
        return {"kind": self.kind, **self.st.info, "features": sorted(self.features),
                "max_buffer_size": self._limits.max_buffer_size, "max_binding_size": self._limits.max_binding_size,
                "software": self.is_fallback_adapter,
                "subgroup_matrix_configs": [dict(c) for c in self.subgroup_matrix_configs]}

    # ------------------------------------------------------------------ spec calls
    def create_buffer(self, size: int, usage: int, label: str = "", mapped_at_creation: bool = False):
        return self.device.createBuffer(to_js({"size": size, "usage": usage, "label": label,
                                               "mappedAtCreation": bool(mapped_at_creation)}))

    def write_buffer(self, buffer, offset: int, data) -> None:
        self._write(buffer, offset, self._js_bytes(data))

    def create_shader_module(self, code: str, label: str):
        return self.device.createShaderModule(to_js({"code": code, "label": label}))

    def create_bind_group_layout(self, entries):
        S = js().GPUShaderStage.COMPUTE
        return self.device.createBindGroupLayout(to_js({"entries": [{**e, "visibility": S} for e in entries]}))

    def create_pipeline_layout(self, bind_group_layouts):
        return self.device.createPipelineLayout(to_js({"bindGroupLayouts": list(bind_group_layouts)}))

    def create_compute_pipeline(self, layout, module, entry_point: str, constants: dict, label: str):
        stage = {"module": module, "entryPoint": entry_point}
        if constants:
            stage["constants"] = {k: (float(v) if isinstance(v, bool) else v) for k, v in constants.items()}
        return self.device.createComputePipeline(to_js({"layout": layout, "compute": stage, "label": label}))

    def create_bind_group(self, layout, entries, label: str):
        return self.device.createBindGroup(to_js({"layout": layout, "label": label or "", "entries": [
            {"binding": b, "resource": {"buffer": buf, "offset": off, "size": size}} for b, buf, off, size in entries]}))

    # ------------------------------------------------------------------ NON-SPEC fast paths
    def record_chain(self, steps):
        passes = []  # [copies, dispatches] (_RUN_JS): one conversion to JS, not a push per command
        for step in steps:
            if step.copies or not passes:
                passes.append(([v for c in step.copies for v in (c.src, c.src_offset, c.dst, c.dst_offset, c.size)], []))
            passes[-1][1].extend(v for L in step.launches for v in (L.pipeline, L.bind_group, *L.workgroups))
        return _Chain(steps, to_js([[c, d] for c, d in passes]))

    def _js_bytes(self, data):
        """A JS Uint8Array of ``data``: a loader.JsBytes view as it is, Python bytes copied once."""
        js_view = getattr(data, "js", None)
        if js_view is not None:
            return js_view
        return to_js(memoryview(data).cast("B"))

    def _staging_buffer(self, size: int):
        pool = self._staging.setdefault(size, [])
        if pool:
            return pool.pop()
        U = js().GPUBufferUsage
        return self.create_buffer(size, U.MAP_READ | U.COPY_DST, f"staging {size}")

    def _reads_of(self, reads):
        """The JS ``reads`` of a run's read-backs, their offsets in the staging buffer and its size,
        made once per set of locations and kept (each push is a bridge call)."""
        if not reads:
            return self._empty, [], 0
        key = tuple((id(buf), off, n) for buf, off, n in reads)
        got = self._io_arrays.get(key)
        if got is None:
            if len(self._io_arrays) > 512:
                self._io_arrays.clear()
            arr, offs, size = js().Array.new(), [], 0
            for buf, off, n in reads:
                offs.append(size)
                arr.push(buf, off, size, round4(n))
                size += round4(n)
            # the buffers are kept with the array, so their id()s cannot be reused while it is
            got = self._io_arrays[key] = (arr, offs, size, [b for b, _, _ in reads])
        return got[0], got[1], got[2]

    def _keep_run(self, chain, io: RunIO):
        """A payload's first run with these write locations and reads: bound in JS and kept on
        the chain (page_runs.py), with this run's inputs in its stage; None if they cannot be."""
        from pyodide.ffi import create_proxy
        reads, offs, size = self._reads_of(io.reads)
        run = page_runs.KeptRun(self._bind_kept, self._run_bound, chain.cmds, io.writes, io.reads, reads, offs,
                                max(size, 4), to_js, create_proxy)
        if not run.fill(io.writes, io.reads):
            run.close()
            return None
        page_runs.keep(chain.kept, run)
        return run

    def _submit(self, chain, io: RunIO, submit: bool = True):
        """One JS call: ``io``'s writes and copies, the chain, the read-back copies into a pooled
        staging buffer, the submit. Returns (staging or None, offsets in it, its size)."""
        if self.st.lost_reason is not None or self.uncaptured:
            self.check("before a run")
        copies = self._empty
        if io.copies:  # device-tensor inputs: their sources may differ per run
            copies = js().Array.new()
            for c in io.copies:
                copies.push(c.src, c.src_offset, c.dst, c.dst_offset, c.size)
        if chain is not None:
            # A payload's runs write and read the same locations every time: bound once, then
            # one call a run with the inputs taken from the WebAssembly heap (page_runs.py).
            run = page_runs.find(chain.kept, io.writes, io.reads)
            if run is None and all(page_runs.is_host_bytes(d) for _, _, d in io.writes):
                run = self._keep_run(chain, io)
            if run is not None:
                staging = self._staging_buffer(run.size) if io.reads else None
                run.call(copies, staging, submit)
                return staging, run.offsets, run.size
        # The rest (JS views among the inputs (JsBytes), no chain): arrays made for this run.
        writes = self._empty
        if io.writes:
            writes = js().Array.new()
            for buf, off, data in io.writes:
                view = self._js_bytes(data)
                writes.push(buf, off, view, 0, int(view.byteLength))
        reads, offs, size = self._reads_of(io.reads)
        staging = self._staging_buffer(max(size, 4)) if io.reads else None
        self._run_bound(chain.cmds if chain is not None else self._empty, writes, copies, reads, staging, submit)
        return staging, offs, max(size, 4)

    def encode_only(self, chain, io: RunIO) -> None:
        """The host side of ``run_chain`` (input writes, the one JS call encoding the chain) with
        the command buffer finished but not submitted: benchmarks/bench_browser.py times it
        against hand-written JavaScript without queueing GPU work. Reads need a submit: none."""
        if io.reads:
            raise ValueError("encode_only: a read-back needs the submit (io.reads must be empty)")
        self._submit(chain, io, submit=False)

    async def run_chain_async(self, chain, io: RunIO, profile: bool = False):
        if profile and chain is not None:
            return await self._profiled(chain, io)
        staging, offs, size = self._submit(chain, io)
        if not io.reads:
            return []
        raw = await self._map(staging, size)
        return [memoryview(raw)[so:so + n] for (_, _, n), so in zip(io.reads, offs)]

    # A greedy decode submits steps n+1 and n+2 (their ids: the argmax before each, on the GPU)
    # before it reads token n: mapAsync of token n's own staging buffer resolves when the
    # submission that filled it is done, not later work, so the GPU works while the page waits
    # (core/llm.py). Two steps ahead measured faster than one in Chromium on an H200, both far
    # faster than none (benchmarks/results/browser_chromium_nvidia_h200.md); a stop costs the
    # two discarded steps' GPU time.
    greedy_lookahead = 2

    def submit_read(self, chain, io: RunIO):
        """NON-SPEC: ``run_chain`` whose read-back is waited for later: submits, starts mapAsync
        of the run's own staging buffer, returns the pending read for ``read_submitted_async``."""
        staging, offs, size = self._submit(chain, io)
        return _PendingRead(staging, staging.mapAsync(js().GPUMapMode.READ, 0, size), offs, size,
                            [n for _, _, n in io.reads])

    async def read_submitted_async(self, pending: "_PendingRead"):
        raw = await self._map(pending.staging, pending.size, pending.promise)
        return [memoryview(raw)[so:so + n] for n, so in zip(pending.sizes, pending.offsets)]

    def read_submitted(self, pending: "_PendingRead"):
        return run_sync(self.read_submitted_async(pending))

    def run_chain(self, chain, io: RunIO, profile: bool = False):
        if io.reads is None and not (profile and chain is not None):
            # Nothing to wait for (prepack's pack kernels, a run that keeps its outputs on the
            # device, a device-to-device copy): the queue orders it before later work, so this
            # needs no JSPI and works from plain runPython too.
            self._submit(chain, io)
            return []
        return run_sync(self.run_chain_async(chain, io, profile))

    async def _map(self, staging, size: int, mapping=None) -> bytes:
        """Map a submitted pooled MAP_READ buffer (``mapping``: its mapAsync promise, when it was
        started already), return its bytes and put it back in the pool."""
        try:
            await (mapping if mapping is not None else staging.mapAsync(js().GPUMapMode.READ, 0, size))
        except Exception as e:
            self.check("while reading results")
            raise DeviceError(f"reading results back failed: {e}") from None
        raw = staging.getMappedRange(0, size).to_bytes()
        staging.unmap()
        self._staging[size].append(staging)
        self.check("after a run")
        return raw

    async def _profiled(self, chain, io: RunIO):
        """A run with each dispatching step in its own pass between two GPU timestamps (the slow
        path: it is encoded from Python, call by call)."""
        steps = [s for s in chain.steps if s.launches]
        q = max(2, 2 * len(steps))
        qs = self.device.createQuerySet(to_js({"type": "timestamp", "count": q}))
        U = js().GPUBufferUsage
        resolve = self.create_buffer(8 * q, U.QUERY_RESOLVE | U.COPY_SRC, "profile timestamps")
        for buf, off, data in io.writes:
            self._write(buf, off, self._js_bytes(data))
        enc = self.device.createCommandEncoder()
        for c in io.copies:
            enc.copyBufferToBuffer(c.src, c.src_offset, c.dst, c.dst_offset, c.size)
        k = 0
        for step in chain.steps:
            for c in step.copies:
                enc.copyBufferToBuffer(c.src, c.src_offset, c.dst, c.dst_offset, c.size)
            if not step.launches:
                continue
            cp = enc.beginComputePass(to_js({"timestampWrites": {"querySet": qs, "beginningOfPassWriteIndex": 2 * k,
                                                                 "endOfPassWriteIndex": 2 * k + 1}}))
            for L in step.launches:
                cp.setPipeline(L.pipeline)
                cp.setBindGroup(0, L.bind_group)
                cp.dispatchWorkgroups(*L.workgroups)
            cp.end()
            k += 1
        enc.resolveQuerySet(qs, 0, q, resolve, 0)
        self.queue.submit(to_js([enc.finish()]))
        parts = list(io.reads or []) + [(resolve, 0, 8 * q)]
        got = await self.run_chain_async(None, RunIO(reads=parts))
        ticks = struct.unpack(f"<{2 * len(steps)}Q", bytes(got[-1][:16 * len(steps)]))
        self.destroy(resolve)
        qs.destroy()
        # WebGPU timestamps are nanoseconds.
        prof = [(s.op, s.node, (ticks[2 * i + 1] - ticks[2 * i]) * 1e-9) for i, s in enumerate(steps)]
        return got[:-1], prof

    def _write(self, buf, offset: int, view) -> None:
        """writeBuffer in pieces; the tail is padded to 4 bytes (writeBuffer's size granularity)."""
        nbytes = int(view.byteLength)
        full = nbytes // 4 * 4
        for s in range(0, full, UPLOAD_PIECE):
            self.queue.writeBuffer(buf, offset + s, view, s, min(UPLOAD_PIECE, full - s))
        if full < nbytes:
            tail = js().Uint8Array.new(4)
            tail.set(view.subarray(full, nbytes))
            self.queue.writeBuffer(buf, offset + full, tail, 0, 4)

    def upload(self, buffer, offset: int, data) -> None:
        self._write(buffer, offset, self._js_bytes(data))

    def write_mapped(self, buffer, data) -> None:
        view = self._js_bytes(data)
        if int(view.byteLength):
            js().Uint8Array.new(buffer.getMappedRange()).set(view)
        buffer.unmap()

    def float16_bytes(self, data, count: int):
        view = self._js_bytes(data)
        if self._f16 is not None:
            return JsBytes(self._f16(view, count))
        src = bytes(view.to_bytes())
        return struct.pack(f"<{count}e", *struct.unpack(f"<{count}f", src[:4 * count]))

    def fence(self) -> None:
        # Ordering never needs it (the queue orders everything); it bounds memory and makes
        # upload timings honest, so without JSPI it is skipped rather than refused.
        if can_run_sync():
            run_sync(self.queue.onSubmittedWorkDone())

    def host_bytes(self, x, dtype: str, nbytes: int, where: str):
        """Storage bytes (a contiguous Python buffer) of a host input in ``dtype`` (numpy-free)."""
        if isinstance(x, HostTensor) and x.dtype == dtype and dtype in _STORED_AS_IS:
            # Every run of the page passes these (no conversion): what the general path below
            # does for them, without its look-ups; bytes as they are (a kept run copies them
            # into its stage, page_runs.py), other buffers as a byte view.
            data = x.data
            if type(data) is not bytes:
                data = memoryview(data).cast("B")
            n = len(data) if type(data) is bytes else data.nbytes
            if n != nbytes:
                raise InputError(f"{where}: {n} bytes for a {dtype} input of {nbytes} bytes")
            return data
        src_dtype = getattr(x, "dtype", None)
        name = getattr(src_dtype, "name", None) or str(src_dtype)
        have = _dt.HOST_ALIASES.get(name, name)
        if isinstance(x, HostTensor):
            data = memoryview(x.data).cast("B")
        else:
            try:
                data = memoryview(x).cast("B")
            except TypeError:
                raise InputError(f"{where}: expected a HostTensor or a buffer, got {type(x).__name__}") from None
        if name == "int64" and dtype == "int32":
            vals = struct.unpack(f"<{len(data) // 8}q", data)
            if any(v < -2**31 or v >= 2**31 for v in vals):
                raise InputError(f"{where}: int64 values outside the int32 range cannot be narrowed")
            data = memoryview(struct.pack(f"<{len(vals)}i", *vals))
        elif have != dtype:
            fmt_in = {"float64": "d", "int64": "q", "uint8": "B", "int8": "b"}.get(name, _dt.STRUCT_FORMAT.get(have))
            if fmt_in is None:
                raise InputError(f"{where}: cannot convert {name} to {dtype}")
            fmt_out = _dt.STRUCT_FORMAT[dtype]
            n = nbytes // _dt.ITEMSIZE[dtype]
            vals = struct.unpack(f"<{n}{fmt_in}", data)
            if dtype == "bool":
                vals = [1 if v else 0 for v in vals]
            data = memoryview(struct.pack(f"<{n}{fmt_out}", *vals))
        if data.nbytes != nbytes:
            raise InputError(f"{where}: {data.nbytes} bytes for a {dtype} input of {nbytes} bytes")
        return data

    def host_array(self, data, dtype: str, shape: tuple):
        return PageTensor(dtype, tuple(shape), bytes(data))

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
        for pool in self._staging.values():
            for b in pool:
                self.destroy(b)
        self._staging.clear()
        self._io_arrays.clear()
        self.clear_caches()


def create_context(env=None) -> WebGPUContext:
    """Environment factory for device kind "webgpu"."""
    try:
        import js as _js  # noqa: F401
    except ImportError:
        raise DeviceError("device 'webgpu' runs in a browser (Pyodide); on the desktop use device='wgpu'") from None
    return WebGPUContext(get_state())


async def init_context(env) -> WebGPUContext:
    """Create the WebGPU device asynchronously, then the Environment's context for it (the async
    path for callers that cannot use JSPI)."""
    await init()
    return env.context("webgpu")
