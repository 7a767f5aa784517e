"""The desktop WebGPU adapter (device kind ``wgpu``): the device protocol of
:mod:`gpudelegate.webgpu.device` over wgpu-py (wgpu-native). ``dawn_device.DawnContext`` (device
kind ``dawn``, wgpudawn: the same API over Dawn) is this class with the hooks under "what a backend
changes" overridden. It keeps what only the desktop has: the staging ring for uploads and the MAP_READ pool
(``wgpu_staging``), the warm-up of wgpu-py's cffi types, chains encoded ahead and replayed with
wgpu-native's raw pass calls (a run's input copies and read-back copies encoded ahead with it),
GPU timestamps per dispatch for profiles, and read-backs waited for one submission at a time
(``submit_read``: a greedy decode looking ahead, ``wgpu_pending_reads``).

One :class:`WgpuContext` per Environment (created lazily on first use, closed by the Environment
after its sessions); the executor is the shared :class:`~gpudelegate.webgpu.executor.WebGPUExecutor`.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from gpudelegate import dtypes as _dt
from gpudelegate.errors import DeviceError, InputError
from gpudelegate.executor import HostTensor
from gpudelegate.plan.types import DeviceLimits
from gpudelegate.webgpu.device import GPUDevice, RunIO, round4

from .hostio import NP_DTYPE, from_storage, to_storage
from .wgpu_pending_reads import IndexedReads, submit_promised, wait_promised, wgpu_native_api
from .wgpu_run_inputs import RunInputStaging
from .wgpu_staging import HOST_STAGING_FEATURE, StagingPool, Uploader

# Limits asked of the device: the adapter's maximum for each (WebGPU's defaults are lower).
_WANTED_LIMITS = ("max-buffer-size", "max-storage-buffer-binding-size", "max-compute-workgroup-storage-size",
                  "max-storage-buffers-per-shader-stage", "max-compute-invocations-per-workgroup",
                  "max-compute-workgroup-size-x", "max-compute-workgroup-size-y", "max-compute-workgroups-per-dimension")
# Optional features used when present (each kernel has a path without them).
_OPTIONAL_FEATURES = ("timestamp-query", "shader-f16", "subgroup")
UPLOAD_PIECE = 64 << 20  # bytes per write_buffer call
UPLOAD_DIRECT = 1 << 20  # host writes at least this large go through the staging ring


def _import_wgpu():
    try:
        import wgpu  # noqa: F401
    except ImportError as e:
        raise DeviceError(f"device 'wgpu' needs the wgpu package: pip install 'gpudelegate[wgpu]' ({e})") from None
    return wgpu


def _private_runtime_dir() -> None:
    # wgpu-native (via Vulkan loaders) warns when XDG_RUNTIME_DIR is unset; a private 0700 folder
    # silences it without touching anything shared.
    if os.environ.get("XDG_RUNTIME_DIR"):
        return
    path = os.path.join(os.path.expanduser("~"), ".cache", "gpudelegate-xdg")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
        os.environ["XDG_RUNTIME_DIR"] = path
    except OSError:
        pass


def raw_pass_calls(api_module: str = "wgpu.backends.wgpu_native._api"):
    """The three webgpu.h calls a replay makes per dispatch, unwrapped: wgpu-py routes each
    through an error-capturing proxy. Pipelines and bind groups were validated when recorded, so
    the replay skips it; any error still surfaces through the device's uncaptured-error handler.
    ``api_module`` is the backend's cffi module (wgpu-native's, or wgpudawn's: the same standard
    names). None when the build does not expose them (public API then)."""
    try:
        api = importlib.import_module(api_module)
        ffi, lib = api.ffi, api.lib
        return (lib.wgpuComputePassEncoderSetPipeline, lib.wgpuComputePassEncoderSetBindGroup,
                lib.wgpuComputePassEncoderDispatchWorkgroups, ffi.NULL)
    except (ImportError, AttributeError):
        return None


_RAW = raw_pass_calls()
_WARM_LOCK = threading.Lock()
_CALLS_WARMED: set = set()  # the kinds whose cffi calls a context exercised (WgpuContext._warm_calls)


class _Chain:
    """A recorded chain: its steps, and the next run's command buffers encoded ahead (while the GPU
    runs the previous submission; the chain is the same every run).

    ``passes`` is the replay's form of the steps, made once at record time so a replay does no
    per-dispatch lookups: one ``(copies, ops)`` per compute pass (the copies, as argument tuples,
    come before the pass and end the previous one), each op ``(pipeline, bind_group, x, y, z)``
    with ``pipeline`` None where the previous dispatch of the pass set the same one. With raw
    calls the pipeline and bind group are the cffi handles (``_internal``), else the objects; the
    objects stay alive through ``steps``.

    ``parts(head)``: the passes as one list, or as the first steps holding ``head`` dispatches and
    the rest (two lists: two command buffers, the first submitted on its own; see
    ``WgpuContext.head_dispatches``).

    ``ahead``: the next run's command buffers, encoded ahead with the copies and reads of the run
    before (a decode step copies its ``ids`` from the same argmax word each time; an argmax reads
    the same word): :class:`_Ahead`."""

    def __init__(self, steps, raw: bool = False):
        self.steps = steps
        self.raw = raw
        self.ahead: Optional[_Ahead] = None
        self.passes = self._passes(steps)
        self._parts = {0: (self.passes,)}

    def _passes(self, steps) -> list:
        passes, copies, ops, last = [], [], [], None
        raw = self.raw
        for step in steps:
            if step.copies:
                if ops:
                    passes.append((copies, ops))
                    copies, ops, last = [], [], None
                copies.extend((c.src, c.src_offset, c.dst, c.dst_offset, c.size) for c in step.copies)
            for L in step.launches:
                pipe = L.pipeline._internal if raw else L.pipeline
                bg = L.bind_group._internal if raw else L.bind_group
                x, y, z = L.workgroups
                ops.append((None if L.pipeline is last else pipe, bg, int(x), int(y), int(z)))
                last = L.pipeline
        if copies or ops:
            passes.append((copies, ops))
        return passes

    def parts(self, head: int) -> tuple:
        got = self._parts.get(head)
        if got is None:
            n, cut = 0, len(self.steps)
            for i, step in enumerate(self.steps):
                if n >= head:
                    cut = i
                    break
                n += len(step.launches)
            # A chain no longer than the head stays whole (a split would only add a submit).
            got = (self.passes,) if cut >= len(self.steps) else \
                (self._passes(self.steps[:cut]), self._passes(self.steps[cut:]))
            self._parts[head] = got
        return got


class _Read:
    """A run's read-back: ``reads`` (buffer, offset, nbytes) copied into ``staging`` (a pooled
    MAP_READ buffer) at ``offsets``, ``size`` bytes in all."""

    __slots__ = ("reads", "staging", "offsets", "sizes", "size")

    def __init__(self, reads, staging, offsets, size: int):
        self.reads, self.staging, self.offsets, self.size = reads, staging, offsets, size
        self.sizes = [n for _, _, n in reads]


class _Ahead:
    """A run's command buffers encoded ahead: ``copies`` (device-tensor inputs) before the chain
    and ``read``'s copies after it, the chain split at ``head``. Used only by a run whose copies
    and reads are the same (same buffer objects, which this holds, so no id is reused)."""

    __slots__ = ("head", "copies", "read", "cbs")

    def __init__(self, head: int, copies, read: Optional[_Read], cbs: list):
        self.head, self.copies, self.read, self.cbs = head, copies, read, cbs

    def fits(self, head: int, copies, reads) -> bool:
        if head != self.head or len(copies) != len(self.copies):
            return False
        for a, b in zip(copies, self.copies):
            if a.src is not b.src or a.dst is not b.dst or a.src_offset != b.src_offset \
                    or a.dst_offset != b.dst_offset or a.size != b.size:
                return False
        mine = self.read.reads if self.read is not None else ()
        if len(reads or ()) != len(mine):
            return False
        return all(a[0] is b[0] and a[1] == b[1] and a[2] == b[2] for a, b in zip(reads or (), mine))


class WgpuContext(GPUDevice):
    """Adapter + device. ``limits_override`` lowers the limits reported to the planner and the
    kernel selection (tests use it to exercise binding splits on small tensors); the device itself
    keeps the adapter's."""

    kind = "wgpu"
    #: optional features asked for when the adapter offers them
    optional_features: Tuple[str, ...] = _OPTIONAL_FEATURES
    #: the replay's unwrapped pass calls (``raw_pass_calls``), None for the public API
    raw_calls = _RAW
    #: a run's small inputs through persistent staging instead of write_buffer (wgpu_run_inputs)
    stage_run_inputs = True
    #: A run's chain longer than this many dispatches is encoded as two command buffers; a run that
    #: finds the queue idle submits them apart: the first ``head_dispatches`` (with the run's
    #: writes and copies), then the rest with the read-back, so the GPU starts on the head while
    #: the library prepares the rest inside its submit (Dawn records a command buffer's Vulkan
    #: commands there). With work queued (steps ahead) the GPU is busy anyway: one submit. 0: whole.
    head_dispatches = 0

    def __init__(self, env=None, power_preference: str = "high-performance",
                 limits_override: Optional[dict] = None, upload_staging: Optional[str] = None,
                 extra_features: Sequence[str] = ()):
        wgpu = self._import_module()
        _private_runtime_dir()
        self.wgpu = wgpu
        adapter = self._request_adapter(power_preference)
        self.adapter = adapter
        alim = adapter.limits
        wanted = {k: alim[k] for k in _WANTED_LIMITS if k in alim}
        staging = self._staging_choice(upload_staging)
        want = list(extra_features) + self._staging_features(staging)
        missing = [f for f in want if f not in adapter.features]
        if missing:
            raise DeviceError(f"{self.kind}: the adapter {adapter.info.get('device', '?')} lacks features {missing}")
        opt = self.optional_features
        feats = [f for f in opt if f in adapter.features] + [f for f in want if f not in opt]
        try:
            self.device = self._request_device(adapter, feats, wanted)
        except Exception as e:
            raise DeviceError(f"{self.kind}: creating a device on {adapter.info.get('device', '?')} failed: "
                              f"{type(e).__name__}: {e}") from None
        self.queue = self.device.queue
        dl = self.device.limits
        info = adapter.info
        name = f"{info.get('device', '?')} ({info.get('backend_type', '?')}, {info.get('adapter_type', '?')})"
        limits = DeviceLimits(max_buffer_size=int(dl["max-buffer-size"]),
                                    max_binding_size=int(dl["max-storage-buffer-binding-size"]),
                                    offset_alignment=int(dl["min-storage-buffer-offset-alignment"]), name=name,
                                    max_workgroup_storage=int(dl["max-compute-workgroup-storage-size"]),
                                    max_workgroup_invocations=min(int(dl["max-compute-invocations-per-workgroup"]),
                                                                  int(dl["max-compute-workgroup-size-x"])))
        if limits_override:
            limits = DeviceLimits(**{**limits.__dict__, **limits_override})
            if limits.max_binding_size > int(dl["max-storage-buffer-binding-size"]) or \
                    limits.max_buffer_size > int(dl["max-buffer-size"]):
                raise DeviceError(f"{self.kind}: limits_override {limits_override} raises a limit above the device's")
        software = str(info.get("adapter_type", "")).upper() == "CPU"
        GPUDevice.__init__(self, limits, feats, int(dl["min-uniform-buffer-offset-alignment"]), software)
        self.staging = StagingPool(self.device, wgpu)
        self.uploader = self._make_uploader(staging)
        self.run_inputs = RunInputStaging(self) if self.stage_run_inputs else None
        self._idle = True  # nothing submitted since the last read-back or fence
        self.indexed_reads = self._make_indexed_reads()
        self._last_read = None  # the submit_read that was the last submission, while it is
        # A step submitted ahead runs on the CPU cores the step being waited for needs on a
        # software adapter (lavapipe): none ahead there, as in the browser (web/webgpu.py).
        if software:
            self.greedy_lookahead = 0
        self._fence_src = None
        self.closed = False
        self._warmer: Optional[threading.Thread] = None
        with _WARM_LOCK:
            if self.kind not in _CALLS_WARMED:  # each backend has its own cffi module to warm
                _CALLS_WARMED.add(self.kind)
                self._warmer = threading.Thread(target=self._warm_calls, name="gpudelegate-warm", daemon=True)
                self._warmer.start()

    # ------------------------------------------------------------------ what a backend changes
    def _import_module(self):
        return _import_wgpu()

    def _request_device(self, adapter, features, limits):
        return adapter.request_device_sync(required_features=features, required_limits=limits)

    def _request_adapter(self, power_preference: str):
        try:
            adapter = self.wgpu.gpu.request_adapter_sync(power_preference=power_preference)
        except Exception as e:
            raise DeviceError(f"{self.kind}: requesting an adapter failed: {type(e).__name__}: {e}") from None
        if adapter is None:
            raise DeviceError(f"{self.kind}: no WebGPU adapter found. {self._no_adapter_hint}")
        return adapter

    _no_adapter_hint = ("On Linux without a GPU, install a software Vulkan driver (apt-get install "
                        "mesa-vulkan-drivers libvulkan1); on a GPU machine, the Vulkan loader and the vendor's ICD")

    def _staging_choice(self, upload_staging: Optional[str]) -> str:
        # "bar" (the portable MAP_WRITE ring) or "host" (Uploader); GPUDELEGATE_WGPU_STAGING sets
        # it for the contexts an Environment makes.
        return upload_staging or os.environ.get("GPUDELEGATE_WGPU_STAGING", "bar")

    def _staging_features(self, staging: str) -> List[str]:
        return [HOST_STAGING_FEATURE] if staging == "host" else []

    def _make_uploader(self, staging: str):
        return Uploader(self, staging=staging)

    def info(self) -> dict:
        # A CPU adapter (lavapipe, SwiftShader) is correct but slower than the numpy reference;
        # device="auto" passes it over (device="wgpu" still takes it).
        return {"kind": self.kind, "device": self._limits.name, "limits": self._limits,
                "features": sorted(self.features), "software": self.is_fallback_adapter}

    # ------------------------------------------------------------------ spec calls
    def create_buffer(self, size: int, usage: int, label: str = "", mapped_at_creation: bool = False):
        return self.device.create_buffer(size=size, usage=usage, mapped_at_creation=mapped_at_creation, label=label)

    def write_buffer(self, buffer, offset: int, data) -> None:
        """Host bytes into a device buffer: large ones through the staging ring, small ones with
        queue.write_buffer (the tail padded to a multiple of 4 bytes)."""
        mv = _dt.byte_view(data)
        if mv.nbytes >= UPLOAD_DIRECT:
            self.uploader.write(buffer, offset, mv)
            return
        full = mv.nbytes // 4 * 4
        for s in range(0, full, UPLOAD_PIECE):
            self.queue.write_buffer(buffer, offset + s, mv[s:min(full, s + UPLOAD_PIECE)])
        if full < mv.nbytes:
            tail = bytearray(4)
            tail[:mv.nbytes - full] = mv[full:]
            self.queue.write_buffer(buffer, offset + full, tail)

    def create_shader_module(self, code: str, label: str):
        return self.device.create_shader_module(code=code, label=label)

    def create_bind_group_layout(self, entries):
        S = self.wgpu.ShaderStage.COMPUTE
        return self.device.create_bind_group_layout(entries=[{**e, "visibility": S} for e in entries])

    def create_pipeline_layout(self, bind_group_layouts):
        return self.device.create_pipeline_layout(bind_group_layouts=bind_group_layouts)

    def create_compute_pipeline(self, layout, module, entry_point: str, constants: dict, label: str):
        return self.device.create_compute_pipeline(layout=layout, label=label, compute={
            "module": module, "entry_point": entry_point, "constants": constants})

    def create_bind_group(self, layout, entries, label: str):
        return self.device.create_bind_group(layout=layout, label=label, entries=[
            {"binding": b, "resource": {"buffer": buf, "offset": off, "size": size}} for b, buf, off, size in entries])

    # ------------------------------------------------------------------ NON-SPEC fast paths
    def record_chain(self, steps):
        return _Chain(steps, raw=self.raw_calls is not None)

    def _encode(self, chain: _Chain, enc, qs=None) -> int:
        """Encode ``chain`` into ``enc``; with a timestamp query set ``qs``, each step that
        dispatches runs in its own pass between two timestamps. Returns the queries written."""
        if qs is None:
            self._encode_passes(chain.passes, enc)
            return 0
        cp = None
        last_pipe = None
        q = 0
        for step in chain.steps:
            if step.copies:
                if cp is not None:
                    cp.end()
                    cp = None
                for c in step.copies:
                    enc.copy_buffer_to_buffer(c.src, c.src_offset, c.dst, c.dst_offset, c.size)
            if not step.launches:
                continue
            if qs is not None:
                if cp is not None:
                    cp.end()
                cp = enc.begin_compute_pass(timestamp_writes={"query_set": qs, "beginning_of_pass_write_index": q,
                                                              "end_of_pass_write_index": q + 1})
                q += 2
                last_pipe = None
            elif cp is None:
                cp = enc.begin_compute_pass()
                last_pipe = None
            if self.raw_calls is not None:
                set_pipe, set_bg, dispatch, null = self.raw_calls
                h = cp._internal
                for L in step.launches:
                    if L.pipeline is not last_pipe:
                        set_pipe(h, L.pipeline._internal)
                        last_pipe = L.pipeline
                    set_bg(h, 0, L.bind_group._internal, 0, null)
                    x, y, z = L.workgroups
                    dispatch(h, x, y, z)
            else:
                for L in step.launches:
                    if L.pipeline is not last_pipe:
                        cp.set_pipeline(L.pipeline)
                        last_pipe = L.pipeline
                    cp.set_bind_group(0, L.bind_group)
                    cp.dispatch_workgroups(*L.workgroups)
            if qs is not None:
                cp.end()
                cp = None
        if cp is not None:
            cp.end()
        return q

    def _encode_passes(self, passes, enc) -> None:
        """The replay: ``passes`` (a chain's, or a part's) in one loop per pass, the pass calls bound to locals (the
        same calls, pipelines and bind groups as the steps, made once per dispatch)."""
        copy = enc.copy_buffer_to_buffer
        begin = enc.begin_compute_pass
        raw = self.raw_calls
        if raw is not None:
            set_pipe, set_bg, dispatch, null = raw
            for copies, ops in passes:
                for c in copies:
                    copy(*c)
                if not ops:
                    continue
                cp = begin()
                h = cp._internal
                for pipe, bg, x, y, z in ops:
                    if pipe is not None:
                        set_pipe(h, pipe)
                    set_bg(h, 0, bg, 0, null)
                    dispatch(h, x, y, z)
                cp.end()
            return
        for copies, ops in passes:
            for c in copies:
                copy(*c)
            if not ops:
                continue
            cp = begin()
            set_pipe, set_bg, dispatch = cp.set_pipeline, cp.set_bind_group, cp.dispatch_workgroups
            for pipe, bg, x, y, z in ops:
                if pipe is not None:
                    set_pipe(pipe)
                set_bg(0, bg)
                dispatch(x, y, z)
            cp.end()

    def encode_chain(self, chain: _Chain, enc) -> None:
        """Encode ``chain`` into a caller's command encoder (benchmarks time the encoding alone)."""
        self._encode(chain, enc)

    def _read(self, reads) -> Optional[_Read]:
        """A read-back of ``reads`` (buffer, offset, nbytes): its layout in one pooled MAP_READ
        staging buffer; None for no reads."""
        if not reads:
            return None
        offs, size = [], 0
        for _, _, n in reads:
            offs.append(size)
            size += round4(n)
        return _Read(list(reads), self.staging.get(max(size, 4)), offs, max(size, 4))

    @staticmethod
    def _encode_read(enc, read: _Read) -> None:
        for (buf, off, n), so in zip(read.reads, read.offsets):
            if n:
                enc.copy_buffer_to_buffer(buf, off, read.staging, so, round4(n))

    def _chain_buffers(self, chain: _Chain, copies=(), read: Optional[_Read] = None) -> list:
        """The command buffers of one run of ``chain``: one, or its head and the rest
        (``head_dispatches``), with ``copies`` (device-tensor inputs) encoded before the chain and
        ``read``'s copies into its staging after it: no encoder of their own."""
        parts = chain.parts(self.head_dispatches)
        cbs, last = [], len(parts) - 1
        for i, passes in enumerate(parts):
            enc = self.device.create_command_encoder()
            if i == 0:
                for c in copies:
                    enc.copy_buffer_to_buffer(c.src, c.src_offset, c.dst, c.dst_offset, c.size)
            self._encode_passes(passes, enc)
            if i == last and read is not None:
                self._encode_read(enc, read)
            cbs.append(enc.finish())
        return cbs

    def _take_run(self, chain: _Chain, copies=(), reads=None) -> Tuple[list, Optional[_Read]]:
        """(command buffers, read-back) of a run of ``chain`` with ``copies`` and ``reads``: those
        encoded ahead where they fit (same copies and reads, same ``head_dispatches``: benchmarks
        switch it between runs), else encoded now."""
        ahead, chain.ahead = chain.ahead, None
        if ahead is not None:
            if ahead.fits(self.head_dispatches, copies, reads):
                return ahead.cbs, ahead.read
            if ahead.read is not None:
                self.staging.put(ahead.read.staging)  # its copies were never submitted
        read = self._read(reads)
        return self._chain_buffers(chain, copies, read), read

    def _take_chain(self, chain: _Chain) -> list:
        """The command buffers of the chain alone (no copies, no reads; benchmarks)."""
        return self._take_run(chain)[0]

    def _staged_writes(self, writes):
        """A command encoder with ``writes`` copied from the run-input staging, or None (no writes,
        no staging on this backend, the queue busy, or they do not fit: write_buffer them)."""
        if not writes or self.run_inputs is None or not self._idle:
            return None
        try:
            return self.run_inputs.encode(writes)
        except Exception:  # never lose a run to the fast path: write_buffer from now on
            self.run_inputs = None
            return None

    def _now_idle(self) -> None:
        """Everything submitted has run (a read-back or a fence returned)."""
        self._idle = True
        if self.run_inputs is not None:
            try:
                self.run_inputs.prefetch()
            except Exception:
                self.run_inputs = None

    def _run_buffers(self, chain, io: RunIO, reads=None) -> Tuple[list, Optional[_Read]]:
        """(command buffers, read-back) of a run of ``chain``: its writes (those that do not go
        through the run-input staging already queued), copies, the chain, and with ``reads``
        their copies into a staging buffer. Where the chain comes in two parts and the queue is
        idle, those before its last part are submitted here."""
        idle = self._idle
        cbs = []
        enc = self._staged_writes(io.writes)
        if enc is None:
            for buf, off, data in io.writes:  # ordered before the submit of the buffers
                self.write_buffer(buf, off, data)
        else:
            cbs.append(enc.finish())
        parts, read = self._take_run(chain, io.copies, reads)
        cbs += parts
        if len(parts) > 1 and idle:
            self.queue.submit(cbs[:-1])  # the GPU starts on the head now
            self._idle, self._last_read = False, None
            del cbs[:-1]
        return cbs, read

    def run_chain(self, chain, io: RunIO, profile: bool = False):
        if chain is not None and not profile:
            # The usual run: its copies, the chain and its reads in the command buffers encoded
            # ahead (no encoders of their own).
            cbs, read = self._run_buffers(chain, io, io.reads)
            return self._submit_and_read(cbs, read, lambda: self._encode_ahead(chain, io.copies, io.reads))
        # A read of device tensors alone (chain None), or a profiled run.
        for buf, off, data in io.writes:  # ordered before the submit below
            self.write_buffer(buf, off, data)
        enc = self.device.create_command_encoder()
        for c in io.copies:
            enc.copy_buffer_to_buffer(c.src, c.src_offset, c.dst, c.dst_offset, c.size)
        prof = None
        if chain is not None:
            n = max(1, 2 * sum(1 for s in chain.steps if s.launches))
            qs = self.device.create_query_set(type="timestamp", count=n)
            q = self._encode(chain, enc, qs)
            if q:
                U = self.wgpu.BufferUsage
                rbuf = self.device.create_buffer(size=8 * q, usage=U.QUERY_RESOLVE | U.COPY_SRC)
                enc.resolve_query_set(qs, 0, q, rbuf, 0)
                prof = (rbuf, q)
        got = self._download(enc, list(io.reads or []))
        if chain is None:
            return got
        timings = []
        if prof is not None:
            rbuf, q = prof
            enc = self.device.create_command_encoder()
            (ts,) = self._download(enc, [(rbuf, 0, 8 * q)])
            ticks = np.frombuffer(ts, np.uint64)
            steps = [s for s in chain.steps if s.launches]
            # WebGPU timestamps are nanoseconds.
            timings = [(s.op, s.node, float(ticks[2 * k + 1] - ticks[2 * k]) * 1e-9) for k, s in enumerate(steps)]
            rbuf.destroy()
        return got, timings

    def _encode_ahead(self, chain: _Chain, copies=(), reads=None) -> None:
        """The next run of ``chain`` encoded now, while the GPU works, with ``copies`` and
        ``reads`` (this run's: a decode step's or an argmax's are the same every time)."""
        if self.closed:
            return
        old = chain.ahead
        if old is not None and old.read is not None:
            self.staging.put(old.read.staging)
        read = self._read(reads)
        chain.ahead = _Ahead(self.head_dispatches, tuple(copies), read, self._chain_buffers(chain, copies, read))

    def _download(self, enc, reads, before=(), after_submit=None) -> List[np.ndarray]:
        """Copy ``reads`` (buffer, offset, nbytes) into one pooled MAP_READ buffer in ``enc`` (a
        new encoder where it is None), submit (after the command buffers ``before``), call
        ``after_submit`` while the GPU works, map once, and return each read's bytes (uint8
        arrays)."""
        read = self._read(reads)
        if read is not None:
            enc = enc if enc is not None else self.device.create_command_encoder()
            self._encode_read(enc, read)
        # enc None: nothing to read (the run's command buffers alone)
        return self._submit_and_read(list(before) + ([enc.finish()] if enc is not None else []), read, after_submit)

    def _submit_and_read(self, cbs, read: Optional[_Read], after_submit=None) -> List[np.ndarray]:
        """Submit ``cbs`` (whose last copies ``read``'s reads into its staging), call
        ``after_submit`` while the GPU works, and return each read's bytes (uint8 arrays)."""
        self.queue.submit(cbs)
        self._idle, self._last_read = False, None
        if after_submit is not None:
            after_submit()
        if read is None:
            return []
        staging, size = read.staging, read.size
        self._map_read_back(staging, size)
        self._now_idle()  # the read's copy was the last thing submitted
        try:
            mv = staging.read_mapped(0, size, copy=False)
            outs = [np.frombuffer(mv, np.uint8, count=n, offset=so).copy() for n, so in zip(read.sizes, read.offsets)]
            del mv
        finally:
            staging.unmap()
            self.staging.put(staging)
        return outs

    def _map_read_back(self, staging, size: int) -> None:
        """Map a run's read-back staging for reading, waiting for the run (a backend may wait
        otherwise: dawn_device spins)."""
        staging.map_sync(self.wgpu.MapMode.READ, 0, size)

    # ------------------------------------------------------------------ reads waited for later
    #: Decode steps a greedy loop submits before it reads the token they follow (core/llm.py);
    #: 0 on a software adapter (set in __init__).
    greedy_lookahead = 2

    def _make_indexed_reads(self):
        """wgpu-native's per-submission waits (wgpu_pending_reads), None where the build lacks them
        (then a read's map resolves as wgpu-py's maps do: after all submitted work)."""
        api = wgpu_native_api()
        return IndexedReads(self.device, self.device.queue, api) if api is not None else None

    def submit_read(self, chain, io: RunIO):
        """NON-SPEC (web/webgpu.py's protocol): ``run_chain`` whose read-back is waited for later
        (``read_submitted``): the run and the copies of ``io.reads`` into a staging buffer of
        their own are submitted, and that buffer's map started, now; the wait is for this submission alone, not for what is submitted after it (a
        greedy decode's steps ahead)."""
        reads = list(io.reads or [])
        cbs, read = self._run_buffers(chain, io, reads)
        if read is None:  # nothing to read: a map of an untouched buffer still waits for the run
            read = _Read([], self.staging.get(4), [], 4)
        if self.indexed_reads is not None:
            pending = self.indexed_reads.submit(cbs, read.staging, read.offsets, read.sizes, read.size)
        else:
            pending = submit_promised(self.queue, cbs, read.staging, self.wgpu.MapMode.READ, read.offsets,
                                      read.sizes, read.size)
        self._idle, self._last_read = False, pending
        self._encode_ahead(chain, io.copies, reads)
        return pending

    def read_submitted(self, pending) -> List[bytes]:
        """The bytes of each read of a ``submit_read``, once its submission has run."""
        if self.indexed_reads is not None:
            got = self.indexed_reads.wait(pending)
        else:
            got = wait_promised(pending)
        self.staging.put(pending.staging)  # (a failed map raised above: that buffer is dropped)
        if pending is self._last_read:
            self._last_read = None
            self._now_idle()
        return got

    async def read_submitted_async(self, pending) -> List[bytes]:
        return self.read_submitted(pending)

    def upload(self, buffer, offset: int, data) -> None:
        self.uploader.write(buffer, offset, data, defer=True)

    def flush_uploads(self) -> None:
        self.uploader.flush()

    def discard_uploads(self) -> None:
        self.uploader.discard()

    def prepare_uploads(self, nbytes: int) -> None:
        """Have the staging ring's buffers made on a thread while the pipelines compile (the first
        ones are slow to make on some drivers)."""
        self.uploader.prepare(-(-nbytes // self.uploader.piece))

    def write_mapped(self, buffer, data) -> None:
        mv = _dt.byte_view(data)
        if mv.nbytes % 4:
            mv = memoryview(bytes(mv) + bytes(4 - mv.nbytes % 4))
        if mv.nbytes:
            buffer.write_mapped(mv, 0)
        buffer.unmap()

    def float16_bytes(self, data, count: int):
        return np.frombuffer(data, np.float32, count=count).astype(np.float16)

    def host_bytes(self, x, dtype: str, nbytes: int, where: str):
        if isinstance(x, HostTensor) and x.dtype == dtype:
            mv = _dt.byte_view(x.data)
        else:
            mv = _dt.byte_view(to_storage(x, dtype, where))
        if mv.nbytes != nbytes:
            raise InputError(f"{where}: {mv.nbytes} bytes for a {dtype} input of {nbytes} bytes")
        return mv

    def host_array(self, data, dtype: str, shape: tuple):
        a = np.frombuffer(data, NP_DTYPE[dtype], count=_dt.numel(shape)).reshape(shape)
        return from_storage(a, dtype)

    # ------------------------------------------------------------------ fences
    def marker(self):
        """Submit a marker after everything submitted so far; ``wait(marker)`` blocks until it has
        run (a map of the buffer the marker's copy wrote: wgpu 0.32's on_submitted_work_done_sync
        raises a TypeError)."""
        w = self.wgpu
        if self._fence_src is None:
            self._fence_src = self.device.create_buffer(size=16, usage=w.BufferUsage.COPY_SRC | w.BufferUsage.STORAGE)
        dst = self.staging.get(16)
        enc = self.device.create_command_encoder()
        enc.copy_buffer_to_buffer(self._fence_src, 0, dst, 0, 16)
        self.queue.submit([enc.finish()])
        self._idle, self._last_read = False, None
        return dst

    def wait(self, marker) -> None:
        marker.map_sync(self.wgpu.MapMode.READ, 0, 16)
        marker.unmap()
        self.staging.put(marker)
        self._now_idle()  # (another marker may be later: then the staging map merely waits)

    def fence(self) -> None:
        self.wait(self.marker())

    def _warm_calls(self) -> None:
        """wgpu-py makes the cffi type of each C struct on its first use in the process, and cffi
        re-parses every typedef name of the header each time: ~50-100 ms per struct type on an H100
        host (~0.2-0.5 s in all, which the first prepack and the first run of a process paid:
        benchmarks/results/wgpu_upload_*). The first context exercises the calls an upload and a
        run make (buffers, write_buffer, an encoder with a copy and a compute pass, submit, a
        map) on this thread while its caller goes on loading, planning and compiling pipelines.
        Best effort: a call that fails here fails again, with its error, where it is really made."""
        try:
            U, d, q = self.wgpu.BufferUsage, self.device, self.queue
            a = d.create_buffer(size=16, usage=U.COPY_SRC | U.COPY_DST | U.STORAGE)
            b = d.create_buffer(size=16, usage=U.MAP_READ | U.COPY_DST)
            c = d.create_buffer(size=16, usage=U.MAP_WRITE | U.COPY_SRC, mapped_at_creation=True)
            c._experimental_get_mapped_range(0, 16)
            c.unmap()
            q.write_buffer(a, 0, bytes(16))
            enc = d.create_command_encoder()
            enc.copy_buffer_to_buffer(c, 0, a, 0, 16)
            enc.begin_compute_pass().end()
            enc.copy_buffer_to_buffer(a, 0, b, 0, 16)
            q.submit([enc.finish()])
            b.map_sync(self.wgpu.MapMode.READ, 0, 16)
            b.read_mapped(0, 16, copy=False)
            b.unmap()
            for x in (a, b, c):
                x.destroy()
        except Exception:
            pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._warmer is not None:
            self._warmer.join()
        try:
            self.staging.clear()
            if self.run_inputs is not None:
                self.run_inputs.close()
            self.uploader.close()
            self.clear_caches()
            self.device.destroy()
        except Exception:
            pass


def create_context(env=None, **options) -> WgpuContext:
    return WgpuContext(env, **options)
