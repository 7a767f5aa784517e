"""The CUDA executor (device kind ``cuda``), on CuPy.

It carries out a :class:`~gpudelegate.plan.types.SessionPlan` on one NVIDIA GPU:

- **memory**: every payload's memory objects live in ONE arena allocation; resident weights and
  the offload slot ring share one allocation from a weight pool (``cupy.cuda.MemoryPool``) that is
  capped with ``set_limit`` when a weight budget is given; streamed weights are kept in a pinned
  host mirror. Every offset inside these three allocations is the plan's (``plan.layout``, see
  ``gpudelegate.plan.layout``): this executor places nothing itself;
- **record**: each dispatch is bound once to its argument/output views (see
  :mod:`.cuda_kernels`), so a run is a list of closures on the compute stream; a fusion step
  first replaces runs of dispatches by one fused launch where the plan proves it safe
  (:mod:`gpudelegate.plan.fusion`, :mod:`.cuda_fused_ops`; ``fuse=False`` turns it off), with q/k/v and
  gate/up weights that the plan's layout put back to back (``plan.layout.adjacent``) read as one
  view of their concatenation;
- **prepack**: constants go through the context's pinned staging ring (windows of 4 MiB, several
  in flight: threads fill some while the copy engine drains others; one DMA per window over the
  image of the weight block, see :mod:`.cuda_prepack`); the ``fp16`` layout is packed on the
  device by a cast kernel after each window's DMA; progress is reported as windows are queued;
  packed (GGUF block) weights go up as their raw bytes and are read by the kernels of
  :mod:`.cuda_quant`, through the plan's dequantization scratch (``plan.layout``'s ``SCRATCH``
  region of the arena) where a linear has more rows than the dequantizing GEMV takes;
- **offload**: loads from the pinned mirror into ring slots on the copy stream, each before the
  dispatch the plan places it at (``OffloadLoad.at``), ordered with events (:mod:`.cuda_schedule`):
  a copy waits for the plan's ``reuse_after`` (the last reader of the slot's previous occupant), a
  dispatch waits for its weights' copies;
- **IO binding**: inputs may be numpy arrays, CuPy arrays, torch tensors or anything else with
  ``__dlpack__``/``__cuda_array_interface__`` (device inputs are copied device-to-device into the
  arena; a DeviceTensor already at its planned place is not copied at all, e.g. a KV cache fed
  back); ``keep_on_device`` returns DeviceTensors whose handle is a CuPy view of the arena.
  Streams: run() orders its stream after the caller's current stream only for device inputs the
  caller may have written there (another library's arrays, DeviceTensors wrapping the caller's
  arrays); outputs and picks of this executor are fed back with no join, so a caller that writes
  into one of them on another stream orders that write itself (``executor.stream.wait_event`` or
  a synchronize). Device outputs are always ordered before the caller's stream's next work;
- **CUDA graphs**: with ``capture_graph=True`` (an executor option: ``env.session(...,
  capture_graph=True)``) the first run of a payload runs eagerly, then the same chain —
  offload copies and events included — is captured once with ``stream.begin_capture`` and
  replayed with ``graph.launch`` on every later run. The capture carries a persisting L2 window
  over the activation arena (cuda_l2; executor option ``l2_window``). Shapes are static and every address is
  fixed (arena, weights, slots), which is what makes the replay valid. Temporaries of CuPy ops
  come from the executor's own pool; they are dead at the end of each dispatch, so reusing
  their blocks between graphs and eager work on the one compute stream is safe.

Errors: no CuPy or no CUDA device -> DeviceError at context creation; out of device memory ->
DeviceError naming what was being allocated (everything already allocated is released);
an op or dtype without a kernel -> UnsupportedOpError naming the payload node; a plan that breaks
an invariant (no layout, an unknown buffer space or layout, an unsafe offload schedule) ->
PlanError.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from gpudelegate import dtypes as _dt
from gpudelegate import ops as _ops
from gpudelegate.errors import DeviceError, InputError, PayloadError, PlanError
from gpudelegate.executor import (DeviceContext, DeviceTensor, Executor, HostTensor, IndexTensor, Progress,
                                  check_argmax_input)
from gpudelegate.plan.layout import SCRATCH
from gpudelegate.plan.types import DeviceLimits, SessionPlan, TensorRef
from gpudelegate.program import Program

from .cuda_blas import WidenScratch
from .cuda_fused_ops import bind_fusion, scratch_bytes
from .cuda_index_reads import IndexReads
from .cuda_l2 import L2Window
from .cuda_prepack import MAX_SLOTS, WINDOW, Ring, Staging, image_windows, parallel_copy
from .cuda_quant import packed_view
from .cuda_schedule import OffloadStreamSchedule, build_schedule, slot_reads
from .hostio import NP_DTYPE, from_storage, to_storage

_H2D = 1  # cudaMemcpyHostToDevice
_D2H = 2
_D2D = 3
WEIGHT_ALIGN = 16  # start of every resident buffer and slot: cuBLAS and 16-byte vector loads
ARENA_ALIGN = 256  # start of every arena memory object (the limits' offset_alignment)
POOL_UNIT = 512  # CuPy's memory pool rounds every allocation up to this


def import_cupy():
    """CuPy, or a DeviceError saying why CUDA cannot be used here."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA library failing to load
        raise DeviceError(f"no CUDA device: cupy cannot be imported ({type(e).__name__}: {e}); install "
                          f"gpudelegate[cuda] (cupy-cuda12x or cupy-cuda13x) on a machine with an NVIDIA GPU") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        raise DeviceError(f"no CUDA device: the CUDA runtime cannot start ({type(e).__name__}: {e})") from None
    if n < 1:
        raise DeviceError("no CUDA device: the CUDA runtime reports 0 devices")
    return cupy


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _fmt_bytes(n: int) -> str:
    for unit, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            return f"{n / s:.2f} {unit}"
    return f"{n} B"


@dataclass
class _PayloadState:
    steps: List[Any]  # closures, one per dispatch
    inputs: List[Any]  # cupy views of the payload inputs
    outputs: List[Any]
    ops: List[str] = field(default_factory=list)  # op name per dispatch
    schedule: Optional[OffloadStreamSchedule] = None
    loads: List[Any] = field(default_factory=list)  # OffloadLoad
    load_args: List[tuple] = field(default_factory=list)  # (slot ptr, pinned mirror ptr, bytes) per load
    load_events: List[Any] = field(default_factory=list)
    release_events: Dict[int, Any] = field(default_factory=dict)
    start_event: Any = None
    end_event: Any = None
    graph: Any = None
    runs: int = 0
    in_keys: List[tuple] = field(default_factory=list)  # (device ptr, nbytes) of each input view
    device_outs: Optional[List[Any]] = None  # the DeviceTensors of ``outputs`` that keep_on_device returns


class CudaExecutor(Executor):
    kind = "cuda"

    def __init__(self, context: "CudaContext", program: Program, capture_graph: bool = False, profile: bool = False,
                 fuse: bool = True, l2_window: bool = True):
        super().__init__(context, program)
        self.cp = context.cp
        self.capture_graph = bool(capture_graph)
        # l2_window: captured graphs keep the activation arena in L2's persisting carve-out (cuda_l2)
        self.l2_window = bool(l2_window)
        # fuse: the fusion step of the recording (core/plan/fusion.py); False binds every
        # dispatch alone (for comparisons and tests).
        self.fuse = bool(fuse)
        self._cat_groups: List[tuple] = []
        self._scratch = None
        # the plan's dequantization scratch: (memory pointer or None, bytes)
        self._dequant: tuple = (None, 0)
        # float16 weights against float32 rows (prefill) widen into this one scratch (cuda_blas)
        self._widen = WidenScratch(lambda n: self._malloc(self.pool_act, n, "the float16 widening scratch"))
        self._out_keys: Dict[int, tuple] = {}  # id(output view) -> (view, (ptr, nbytes))
        # profile: GPU time of every dispatch of eager runs, by op (events around each launch);
        # captured graphs replay as one unit and are not profiled.
        self.profile = bool(profile)
        self.profile_ms: Dict[str, list] = {}  # op -> [total ms, dispatches]
        self.kernels = context.kernels
        cp = self.cp
        self.pool_act = cp.cuda.MemoryPool()  # arena + temporaries of CuPy ops
        self.pool_weights = cp.cuda.MemoryPool()  # resident weights + slot ring (capped by the budget)
        self.pool_pinned = cp.cuda.PinnedMemoryPool()  # host mirror of streamed weights
        self._index_reads: Optional[IndexReads] = None  # argmax_device's pinned words, made on first use
        self._arena = None
        self._obj_off: Dict[tuple, int] = {}
        self._wblock = None
        self._res_off: Dict[int, int] = {}
        self._slot_off: List[int] = []
        self._mirror = None
        self._mirror_np: Optional[np.ndarray] = None
        self._mirror_off: Dict[int, int] = {}
        self._streamed: set = set()
        self._states: Dict[int, _PayloadState] = {}
        self.prepacked = False
        self.stats: Dict[str, Any] = {}
        self._ev_in = cp.cuda.Event(disable_timing=True)
        self._ev_out = cp.cuda.Event(disable_timing=True)

    # ------------------------------------------------------------------ helpers
    @property
    def stream(self):
        return self.context.compute_stream

    @property
    def copy_stream(self):
        return self.context.copy_stream

    def _view(self, p: int, ref: TensorRef):
        cp = self.cp
        buf = ref.buf
        if buf.space == "arena":
            ptr = self._arena + (self._obj_off[(p, buf.index)] + buf.offset)
        elif buf.space == "resident":
            ptr = self._wblock + (self._res_off[buf.index] + buf.offset)
        elif buf.space == "slot":
            ptr = self._wblock + (self._slot_off[buf.index] + buf.offset)
        else:
            raise PlanError(f"plan: payloads[{p}] uses unknown buffer space {buf.space!r}")
        if _dt.is_packed(ref.dtype):  # a weight's GGUF blocks: only the cuda_quant kernels read them
            return packed_view(cp, ref.dtype, ref.shape, ptr)
        return cp.ndarray(tuple(ref.shape), dtype=NP_DTYPE[ref.dtype], memptr=ptr)

    def _malloc(self, pool, nbytes: int, what: str):
        cp = self.cp
        try:
            return pool.malloc(max(int(nbytes), 1))
        except cp.cuda.memory.OutOfMemoryError as e:
            free, total = cp.cuda.runtime.memGetInfo()
            raise DeviceError(f"out of CUDA memory allocating {what} ({_fmt_bytes(nbytes)}; device has "
                              f"{_fmt_bytes(free)} free of {_fmt_bytes(total)}): {e}") from None

    # ------------------------------------------------------------------ allocate
    def allocate(self, plan: SessionPlan) -> None:
        self.plan = plan
        try:
            with self.context.device:
                self._allocate(plan)
        except BaseException:
            self.close()
            raise

    def _allocate(self, plan: SessionPlan) -> None:
        bufs = plan.prepack.buffers
        lay = plan.layout
        if lay is None:
            raise PlanError("plan: no layout (plan_session sets plan.layout; the CUDA executor places nothing itself)")
        if lay.arena_alignment % ARENA_ALIGN or lay.weight_alignment % WEIGHT_ALIGN:
            raise PlanError(f"plan: layout aligns arena objects to {lay.arena_alignment} and weights to "
                            f"{lay.weight_alignment} bytes; CUDA needs multiples of {ARENA_ALIGN} and {WEIGHT_ALIGN}")
        self._obj_off = dict(lay.arena)
        self._arena = self._malloc(self.pool_act, lay.arena_bytes,
                                   f"the activation arena of {len(lay.arena)} memory objects")
        if SCRATCH in lay.arena:  # the last region of the arena (gpudelegate.plan.layout)
            off = lay.arena[SCRATCH]
            if not 0 <= off <= lay.arena_bytes or off % ARENA_ALIGN:
                raise PlanError(f"plan: dequantization scratch at arena offset {off} of {lay.arena_bytes} bytes")
            self._dequant = (self._arena + off, lay.arena_bytes - off)

        off = plan.offload
        self._streamed = set(off.streamed) if off is not None else set()
        res_ids = lay.weight_order
        slot_sizes = list(off.slots) if off is not None else []
        self._res_off = dict(lay.resident)
        self._slot_off = list(lay.slots)
        if self.fuse:
            # Weights of linears that can run as one GEMM (q/k/v, gate/up: same input) that the
            # layout put back to back: their concatenation is a plain view (no copy, no extra
            # memory). Resident weights only: the layout never groups streamed ones.
            self._cat_groups = [tuple(gr) for gr in lay.adjacent]
        if off is not None:
            # The budget caps the pool. Alignment padding (16-byte starts: none for weights whose
            # sizes are multiples of 16, as in real models) and the pool's 512-byte unit are
            # added on top, and reported in stats.
            limit = _round_up(off.budget + lay.weight_padding, POOL_UNIT)
            self.pool_weights.set_limit(size=limit)
            self.stats["weight_pool_limit"] = limit
        self._wblock = self._malloc(self.pool_weights, lay.weight_bytes,
                                    f"{len(res_ids)} resident weights and {len(slot_sizes)} offload slots")
        self.stats.update(weight_bytes=self.pool_weights.total_bytes(), arena_bytes=lay.arena_bytes,
                          resident_bytes=sum(bufs[i].nbytes for i in res_ids), ring_bytes=sum(slot_sizes))

        if self._streamed:
            mtotal = lay.mirror_bytes
            try:
                self._mirror = self.pool_pinned.malloc(max(mtotal, 1))
            except Exception as e:  # CUDARuntimeError: pinned host memory is a finite resource too
                raise DeviceError(f"cannot pin {_fmt_bytes(mtotal)} of host memory for the streamed weights: {e}") from None
            self._mirror_np = np.frombuffer(self._mirror, dtype=np.uint8, count=max(mtotal, 1))
            self._mirror_off = dict(lay.mirror)
            self.stats["pinned_mirror_bytes"] = mtotal

    # ------------------------------------------------------------------ record
    def record(self, plan: SessionPlan) -> None:
        try:
            # On the compute stream: constants some kernels make at bind time (ones, divisors)
            # are then ordered before every run (a non-blocking stream does not wait for the
            # legacy default stream).
            with self.context.device, self.stream, self.kernels.blas.widening_into(self._widen):
                fusions = {}
                if self.fuse:
                    fusions = dict(plan.fusions)  # the planner's decision (plan_session)
                    need = max([scratch_bytes(f, plan.payloads[p].dispatches) for p, fs in fusions.items() for f in fs]
                               + [0])
                    if need:
                        # one block for every group of every payload (see cuda_fused_ops)
                        self._scratch = self._malloc(self.pool_act, need, "the scratch of fused groups")
                for p, pp in plan.payloads.items():
                    self._states[p] = self._record_payload(plan, p, pp, fusions.get(p, []))
        except BaseException:
            self.close()
            raise

    def _record_payload(self, plan: SessionPlan, p: int, pp, fusions) -> _PayloadState:
        cp = self.cp
        values = self.program.payloads[p].values
        disp = pp.dispatches
        # Defaults filled and resolved against the shapes (dims normalized, sdpa scale...).
        attrs = {k: _ops.normalize_attrs(d.op, d.attrs, [None if r is None else values[r.value] for r in d.args])
                 for k, d in enumerate(disp)}
        steps: List[Any] = [None] * len(disp)
        ops = [d.op for d in disp]
        covered = set()
        if fusions:
            view = lambda r: self._view(p, r)
            for f in fusions:
                fn = bind_fusion(self.kernels, f, disp, view, attrs, self._scratch,
                                 f"payloads[{p}] fused {f.kind} of ops {[disp[k].node for k in f.members]}",
                                 dequant=self._dequant, stats=self.stats)
                if fn is None:
                    continue
                steps[f.at] = fn
                ops[f.at] = f.kind
                covered.update(f.members)
                n = self.stats.setdefault("fusions", {})
                n[f.kind + ("+gemm_cat" if f.cat else "")] = n.get(f.kind + ("+gemm_cat" if f.cat else ""), 0) + 1
            self.stats["fused_away"] = self.stats.get("fused_away", 0) + sum(
                1 for k in covered if steps[k] is None and k not in self._noop_set(disp))
        for k, d in enumerate(disp):
            if k in covered:
                continue
            if d.outputs and all(_dt.numel(r.shape) == 0 for r in d.outputs):
                continue  # an empty output (a zero-size dim): nothing to launch, as on WebGPU
            where = f"payloads[{p}].ops[{d.node}] ({d.op})"
            args = [None if r is None else self._view(p, r) for r in d.args]
            outs = [self._view(p, r) for r in d.outputs]
            if d.op == "linear" and _dt.is_packed(d.args[1].dtype):
                # its longer inputs dequantize into the plan's scratch
                steps[k] = self.kernels.linear(args[0], args[1], args[2] if len(args) > 2 else None, outs[0], where,
                                               scratch=self._dequant)
            else:
                steps[k] = self.kernels.bind(d.op, args, outs, attrs[k], where)
        st = _PayloadState(steps=steps, inputs=[self._view(p, r) for r in pp.inputs],
                           outputs=[self._view(p, r) for r in pp.outputs], ops=ops)
        # Fast path of IO binding: an output view handed back as an input (a KV cache) is
        # recognized by its identity, without touching CuPy attributes on every step.
        st.in_keys = [(v.data.ptr, v.nbytes) for v in st.inputs]
        for v in st.outputs:
            self._out_keys[id(v)] = (v, (v.data.ptr, v.nbytes))
        off = plan.offload
        loads = list(off.loads.get(p, [])) if off is not None else []
        if loads:
            # The plan's placement and waits as events; the plan is checked again first (a
            # hand-edited plan fails here with PlanError, before anything is enqueued).
            st.schedule = build_schedule(p, [d.node for d in pp.dispatches],
                                         [slot_reads(d.args) for d in pp.dispatches], loads, plan.prepack.value_buffer)
            st.loads = loads
            st.load_args = [((self._wblock + self._slot_off[ld.slot]).ptr, self._mirror.ptr + self._mirror_off[ld.buffer],
                             plan.prepack.buffers[ld.buffer].nbytes) for ld in loads]
            ev = lambda: cp.cuda.Event(block=False, disable_timing=True, interprocess=False)
            st.load_events = [ev() for _ in loads]
            st.release_events = {k: ev() for k in st.schedule.releases}
            st.start_event, st.end_event = ev(), ev()
        return st

    @staticmethod
    def _noop_set(disp) -> set:
        return {k for k, d in enumerate(disp) if d.op == "reshape" and d.args and d.args[0] is not None
                and d.args[0].buf == d.outputs[0].buf}

    # ------------------------------------------------------------------ prepack
    def prepack(self, plan: SessionPlan, progress: Progress = None) -> None:
        try:
            with self.context.device:
                self._prepack(plan, progress)
        except BaseException:
            self.close()
            raise

    def _prepack(self, plan: SessionPlan, progress: Progress) -> None:
        cp = self.cp
        bufs = plan.prepack.buffers
        total = sum(b.src_nbytes for b in bufs)
        t0 = time.perf_counter()
        srcs: Dict[int, np.ndarray] = {}
        for chunk in plan.prepack.chunks:  # every buffer is checked before anything is copied
            for i in chunk:
                b = bufs[i]
                where = f"prepack buffer {i} (constants[{b.constant}], layout {b.layout!r})"
                if b.layout not in ("identity", "fp16"):  # the prepack planner knows no other
                    raise PlanError(f"plan: {where}: unknown layout {b.layout!r} (expected 'identity' or 'fp16')")
                raw = self.program.constant_bytes(b.constant)
                if raw.nbytes != b.src_nbytes:
                    raise PayloadError(where, f"constant has {raw.nbytes} bytes; the plan expects {b.src_nbytes}")
                want = b.src_nbytes // 2 if b.layout == "fp16" else b.src_nbytes
                if want != b.nbytes:
                    raise PlanError(f"plan: {where}: packs {b.src_nbytes} source bytes into {b.nbytes} (expected {want})")
                srcs[i] = np.frombuffer(raw, dtype=np.uint8)
        up = sorted((i for i in range(len(bufs)) if i not in self._streamed), key=lambda i: self._res_off[i])
        # Identity weights as runs of the weight block's image (one DMA per window, see
        # cuda_prepack); a packed (fp16) buffer ends a run: the image must not cover its bytes.
        runs, cur = [], []
        for i in up:
            if bufs[i].layout == "identity":
                cur.append(i)
            elif cur:
                runs.append(cur)
                cur = []
        if cur:
            runs.append(cur)
        windows = [w for run in runs
                   for w in image_windows([(self._res_off[i], srcs[i]) for i in run], WINDOW, max_gap=WEIGHT_ALIGN)]
        fp16 = [i for i in up if bufs[i].layout == "fp16"]
        n_win = len(windows) + sum(-(-bufs[i].src_nbytes // WINDOW) for i in fp16)
        done = 0

        def report(n):
            nonlocal done
            done += n
            if progress is not None:
                progress(min(done, total), total)

        ring = None
        if n_win:
            staging = self.context.staging(min(MAX_SLOTS, max(2, n_win)))
            ring = Ring(cp, staging, self.copy_stream, self.context.device.id)
        try:
            base = self._wblock.ptr if self._wblock is not None else 0
            for start, n, pieces in windows:
                ring.submit(pieces, n, base + start)
                report(sum(p.nbytes for _, p in pieces))
            if fp16:
                # float32 in the program -> float16 on the device: each window's DMA lands in
                # device scratch (one window per ring slot) and a cast kernel on the copy
                # stream packs it, so the conversion runs on the GPU.
                scratch = self._malloc(self.pool_act, ring.st.slots * WINDOW, "the fp16 packing scratch")
                for i in fp16:
                    b = bufs[i]
                    dst16 = cp.ndarray((b.nbytes // 2,), dtype=np.float16, memptr=self._wblock + self._res_off[i])
                    for off in range(0, b.src_nbytes, WINDOW):
                        n = min(WINDOW, b.src_nbytes - off)

                        def post(s, n=n, off=off, dst16=dst16):
                            cp.cuda.runtime.memcpyAsync(scratch.ptr + s * WINDOW, ring.st.ptr(s), n, _H2D,
                                                        ring.stream.ptr)
                            src32 = cp.ndarray((n // 4,), dtype=np.float32, memptr=scratch + s * WINDOW)
                            cp.copyto(dst16[off // 4:(off + n) // 4], src32, casting="same_kind")

                        ring.submit([(0, srcs[i][off:off + n])], n, None, post=post)
                        report(n)
            # streamed weights: into the pinned host mirror, while the ring's DMAs run
            for i in sorted(self._streamed):
                self._pack_mirror(i, bufs[i], srcs[i])
                report(bufs[i].src_nbytes)
        finally:
            if ring is not None:
                ring.finish()
        if progress is not None:
            progress(total, total)  # every copy has landed
        dt = time.perf_counter() - t0
        uploaded = sum(bufs[i].src_nbytes for i in up)
        self.stats.update(prepack_bytes=total, prepack_uploaded=uploaded, prepack_s=dt,
                          prepack_gbps=(uploaded / dt / 1e9) if dt > 0 else 0.0,
                          prepack_dmas=ring.dmas if ring is not None else 0)
        self.prepacked = True

    def _pack_mirror(self, i: int, b, src: np.ndarray) -> None:
        off = self._mirror_off[i]
        dst = self._mirror_np[off:off + b.nbytes]
        if b.layout == "fp16":
            np.copyto(dst.view(np.float16), src.view(np.float32), casting="same_kind")
        else:
            parallel_copy([(dst, src)])

    # ------------------------------------------------------------------ run
    def run(self, payload: int, inputs: Sequence[Any], keep_on_device: bool = False) -> List[Any]:
        inputs = list(inputs)
        pp = self.begin_run(payload, inputs)
        st = self._states[payload]
        cp = self.cp
        stream = self.stream
        # Stream semantics of IO binding (as DLPack producers/consumers do): a device input made
        # on the caller's current stream is waited for by ours (one event) before it is read;
        # inputs this executor's stream wrote itself (its outputs, its picks, host data) need no
        # such join: see _caller_made. Device outputs are made on our stream, so the caller's
        # stream waits for them before anything it enqueues next (e.g. cupy.argmax on a returned
        # logits tensor). Events, not host syncs.
        caller = cp.cuda.get_current_stream()
        foreign = caller.ptr != stream.ptr
        with self.context.device, stream:
            joined = not foreign
            out_keys = self._out_keys
            for i, (ref, view, x) in enumerate(zip(pp.inputs, st.inputs, inputs)):
                if type(x) is DeviceTensor:
                    k = out_keys.get(id(x.handle))
                    if k is not None and k[0] is x.handle and k[1] == st.in_keys[i]:
                        continue  # one of our outputs, already where this input lives: zero copy
                if not joined and self._caller_made(x):
                    self._ev_in.record(caller)
                    stream.wait_event(self._ev_in)
                    joined = True
                self._write_input(f"payloads[{payload}].inputs[{i}]", ref, view, x)
            if self.capture_graph and st.graph is None:
                self._execute(st)  # warm-up: compiles kernels, sizes cuBLAS/CuPy workspaces
                self._capture(payload, st)
            elif st.graph is not None:
                st.graph.launch(stream)
            else:
                self._execute(st, timed=self.profile)
            st.runs += 1
            if keep_on_device:
                if foreign:
                    self._ev_out.record(stream)
                    caller.wait_event(self._ev_out)
                if st.device_outs is None:  # the same views every run: made once (~30 a decode step)
                    st.device_outs = [DeviceTensor(self, ref.dtype, tuple(ref.shape), v, v.nbytes)
                                      for ref, v in zip(pp.outputs, st.outputs)]
                return list(st.device_outs)
            stream.synchronize()
            return [from_storage(cp.asnumpy(v), ref.dtype) for ref, v in zip(pp.outputs, st.outputs)]

    def _caller_made(self, x) -> bool:
        """Whether input ``x`` may have been written on the caller's stream, so that run() must
        order ours after it: a device array of another library, or a DeviceTensor of ours whose
        handle the caller made. Not: host data, a DeviceTensor of another kind (read back through
        its own ``numpy``), an output or pick of a CUDA executor on our stream (written there, in
        order). Contract: a caller that writes into a tensor run() or argmax_device returned,
        on a stream of its own, orders that write before passing it (``executor.stream``'s
        ``wait_event``, or a synchronize); the per-token decode loop then pays no event record on
        the caller's stream and no wait on ours."""
        if isinstance(x, (HostTensor, np.ndarray, int, float, list, tuple)):
            return False
        if isinstance(x, DeviceTensor):
            owner = x.owner
            if owner.kind != self.kind:
                return False
            if getattr(owner, "stream", None) is not self.stream:
                return True
            if isinstance(x, IndexTensor):
                return False
            k = owner._out_keys.get(id(x.handle))
            return k is None or k[0] is not x.handle
        return True

    def _execute(self, st: _PayloadState, timed: bool = False) -> None:
        """Enqueue one run of the payload's chain on the compute stream (eagerly, or into a
        capture), with the offload copies on the copy stream when the plan streams weights."""
        cp = self.cp
        compute, copy = self.stream, self.copy_stream
        sched = st.schedule
        marks = [] if timed else None
        memcpy = cp.cuda.runtime.memcpyAsync
        with cp.cuda.using_allocator(self.pool_act.malloc):
            if sched is not None:
                # The copy stream joins the compute stream: every copy comes after the previous
                # run (and, under capture, this makes the copy stream part of the graph).
                st.start_event.record(compute)
                copy.wait_event(st.start_event)
            for k, fn in enumerate(st.steps):
                step = sched.steps[k] if sched is not None else None
                if step is not None:
                    for li in step.issue:
                        r = sched.copy_after[li]
                        if r is not None:
                            copy.wait_event(st.release_events[r])
                        dst, src, n = st.load_args[li]
                        memcpy(dst, src, n, _H2D, copy.ptr)
                        st.load_events[li].record(copy)
                    for li in step.wait:
                        compute.wait_event(st.load_events[li])
                if fn is not None:  # None: a member of a fused group that runs at its last member
                    if marks is not None:
                        e0 = compute.record()
                    fn()
                    if marks is not None:
                        marks.append((st.ops[k], e0, compute.record()))
                if step is not None and step.release:
                    st.release_events[k].record(compute)
            if sched is not None:
                st.end_event.record(copy)
                compute.wait_event(st.end_event)  # join back (required to end a capture)
        if marks:
            compute.synchronize()
            for op, a, b in marks:
                t = self.profile_ms.setdefault(op, [0.0, 0])
                t[0] += cp.cuda.get_elapsed_time(a, b)
                t[1] += 1

    def _capture(self, payload: int, st: _PayloadState) -> None:
        stream = self.stream
        l2 = self.context.l2
        span = self.plan.layout.arena_bytes if self.l2_window else 0
        with l2.around_capture(stream, self._arena.ptr, span) as window:
            stream.begin_capture()
            try:
                self._execute(st)
            except BaseException:
                try:
                    stream.end_capture()
                except Exception:
                    pass
                raise
            st.graph = stream.end_capture()
        self.stats.setdefault("graphs", []).append(payload)
        self.stats["l2_window"] = window or {"off": "l2_window=False" if not self.l2_window else (l2.why_not or "no arena")}

    def _write_input(self, path: str, ref: TensorRef, view, x) -> None:
        cp = self.cp
        if x is None:
            raise InputError(f"{path}: no value given")
        if isinstance(x, DeviceTensor):
            h = x.handle
            if x.owner.kind == self.kind:
                if h.data.ptr == view.data.ptr and h.nbytes == view.nbytes:
                    return  # already at its planned place (a KV cache fed back): zero copy
                if tuple(h.shape) != tuple(view.shape):
                    raise InputError(f"{path}: shape {list(h.shape)} does not match {list(view.shape)}")
                if h.dtype == view.dtype and h.flags.c_contiguous:
                    # a pick fed to the next decode step (its ids): one copy queued, no kernel
                    cp.cuda.runtime.memcpyAsync(view.data.ptr, h.data.ptr, view.nbytes, _D2D, self.stream.ptr)
                else:
                    cp.copyto(view, h, casting="unsafe")
                return
            x = x.numpy()
        if isinstance(x, HostTensor):  # first: a decode step's position, every token
            a = to_storage(x, ref.dtype, path)
        else:
            try:
                a = _device_array(cp, x)
            except Exception as e:  # e.g. a torch tensor that requires grad refuses DLPack export
                raise InputError(f"{path}: cannot read this {type(x).__name__} on the device: {e}") from None
            if a is not None:  # a CUDA tensor of another library (CuPy, torch, JAX...): stay on device
                self._write_device_input(path, ref, view, a)
                return
            a = np.asarray(x)
            if a.dtype.kind not in "fiub":
                raise InputError(f"{path}: dtype {a.dtype} is not supported (expected {ref.dtype})")
            a = to_storage(a, ref.dtype, path)
        if tuple(a.shape) != tuple(view.shape):
            raise InputError(f"{path}: shape {list(a.shape)} does not match {list(view.shape)}")
        if not a.nbytes:  # an empty tensor (a zero-size dim): nothing to copy
            return
        # Pageable source: the call returns once CUDA has staged the bytes, so `a` may go. CUDA
        # allows such a copy to wait for the queued work; on the H100's driver a 4-byte one with
        # four decode steps queued returned in 2.6-4.5 us with the stream still busy, and a pinned
        # ring measured no faster (docs/NOTES.md), so none is kept.
        cp.cuda.runtime.memcpyAsync(view.data.ptr, a.ctypes.data, a.nbytes, _H2D, self.stream.ptr)

    def _write_device_input(self, path: str, ref: TensorRef, view, a) -> None:
        cp = self.cp
        if tuple(a.shape) != tuple(view.shape):
            raise InputError(f"{path}: shape {list(a.shape)} does not match {list(view.shape)}")
        if a.dtype.kind not in "fiub" or a.dtype.itemsize > 8:
            raise InputError(f"{path}: dtype {a.dtype} is not supported (expected {ref.dtype})")
        if ref.dtype == "bool":
            cp.not_equal(a, 0, out=view)
            return
        if ref.dtype == "int32" and a.dtype.kind in "iu" and a.dtype.itemsize > 4 and a.size:
            lo, hi = int(a.min()), int(a.max())  # a device sync: only for 64-bit ids
            if lo < -2**31 or hi >= 2**31:
                raise InputError(f"{path}: int64 values outside the int32 range cannot be narrowed")
        if ref.dtype == "int32" and a.dtype.kind == "f":
            raise InputError(f"{path}: dtype {a.dtype} given for an int32 input")
        cp.copyto(view, a, casting="unsafe")

    def to_host(self, t: DeviceTensor):
        with self.context.device:
            self.stream.synchronize()
            return from_storage(self.cp.asnumpy(t.handle, stream=self.stream), t.dtype)

    #: A greedy loop submits two decode steps before it reads the token they follow: reading an
    #: index waits for its own copy's event (cuda_index_reads), not for the steps queued after it.
    greedy_lookahead = 2

    def argmax_device(self, t: DeviceTensor):
        """The greedy pick on the GPU, queued on this executor's stream (no host sync): an
        :class:`IndexTensor` (an int32 [1, 1] CuPy array) the next decode step copies its ``ids``
        from, written by one launch (cuda_argmax). The first NaN wins, as in torch.argmax (the
        kernels' argmax rule, cuda_kernels._op_argmax). The same launch stores its value into a
        word of pinned host memory (copied there after it where that memory is not mapped), with
        an event after it that ``index_value`` waits for (cuda_index_reads)."""
        if not isinstance(t, DeviceTensor) or t.owner is not self or t.dtype not in ("float32", "float16"):
            return super().argmax_device(t)
        t.check_alive("argmax_device")
        check_argmax_input(t)
        with self.context.device, self.stream:
            if self._index_reads is None:
                self._index_reads = IndexReads(self.cp, self.pool_pinned)
            reads = self._index_reads
            k = reads.slot()
            word = reads.device_word(k)
            idx = self._argmax_index(t.handle, word)
            out = IndexTensor(self, "int32", (1, 1), idx, 4)
            out.read = reads.submit(out, self.stream, k, written=bool(word))
        return out

    def _argmax_index(self, x, host_word: int = 0):
        """A new int32 [1, 1] device array holding torch.argmax(x), one launch on the current
        stream (cuda_argmax), which also stores it at ``host_word`` (a mapped pinned word's device
        address; 0: none). New each pick: an IndexTensor stays valid as long as it is held."""
        idx = self.cp.empty((1, 1), self.cp.int32)
        self.kernels.argmax.launch(x, idx, host_word)
        return idx

    def index_value(self, x) -> int:
        if isinstance(x, IndexTensor) and x.owner is self:
            x.check_alive("index_value")
            if x.value is None:
                with self.context.device:
                    self._index_reads.value(x)
            return x.value
        return super().index_value(x)

    # ------------------------------------------------------------------ teardown
    def memory_report(self) -> dict:
        """Bytes held now: weights (resident + ring; capped by the budget when offloading),
        activations (arena + cached temporaries), pinned host memory."""
        return {"weight_pool_bytes": self.pool_weights.total_bytes(),
                "weight_pool_limit": self.pool_weights.get_limit(),
                "act_pool_bytes": self.pool_act.total_bytes(),
                "pinned_bytes": self.pool_pinned.total_bytes() if hasattr(self.pool_pinned, "total_bytes") else None,
                **{k: v for k, v in self.stats.items() if k.endswith("_bytes")}}

    def close(self) -> None:
        """Free every device and pinned allocation of this executor. Idempotent, never raises."""
        if self.closed:
            return
        try:
            with self.context.device:
                self.stream.synchronize()
                self.copy_stream.synchronize()
        except Exception:
            pass
        for st in self._states.values():
            st.graph = None
            st.steps.clear()
        self._states.clear()
        self._out_keys.clear()
        self._arena = self._wblock = self._mirror = self._scratch = None
        self._dequant = (None, 0)
        self._widen.free()
        self._mirror_np = None
        self._index_reads = None
        for pool in (self.pool_act, self.pool_weights, self.pool_pinned):
            try:
                pool.free_all_blocks()
            except Exception:
                pass
        super().close()


def _device_array(cp, x):
    """A CuPy view of ``x`` when it is a CUDA tensor (CuPy, or any library speaking DLPack or the
    CUDA array interface: torch, JAX, ...), None for host data."""
    if isinstance(x, np.ndarray):
        return None
    if isinstance(x, cp.ndarray):
        return x
    f = getattr(x, "__dlpack_device__", None)
    if f is not None:
        dev = f()
        # kDLCUDA = 2, kDLCUDAManaged = 13; anything else (kDLCPU...) is host data.
        return cp.from_dlpack(x) if int(dev[0]) in (2, 13) else None
    try:
        x.__cuda_array_interface__
    except Exception:
        return None
    return cp.asarray(x)


# ---------------------------------------------------------------------- device context

class CudaContext(DeviceContext):
    """One CUDA device, its compute and copy streams, and the compiled kernels, shared by every
    session of the Environment."""

    kind = "cuda"

    def __init__(self, env=None, device_id: int = 0):
        cp = import_cupy()
        from .cuda_kernels import CudaKernels

        self.cp = cp
        try:
            self.device = cp.cuda.Device(device_id)
            with self.device:
                props = cp.cuda.runtime.getDeviceProperties(device_id)
                free, total = cp.cuda.runtime.memGetInfo()
                self.compute_stream = cp.cuda.Stream(non_blocking=True)
                self.copy_stream = cp.cuda.Stream(non_blocking=True)
        except DeviceError:
            raise
        except Exception as e:
            raise DeviceError(f"no CUDA device: device {device_id} cannot be used ({type(e).__name__}: {e})") from None
        name = props["name"]
        self.name = name.decode() if isinstance(name, bytes) else str(name)
        self.compute_capability = (int(props["major"]), int(props["minor"]))
        self.total_memory = int(total)
        self.kernels = CudaKernels(cp)
        self.l2 = L2Window(cp, device_id)  # the persisting-L2 carve-out of captured graphs (cuda_l2)
        self.kernels.max_shared = int(props.get("sharedMemPerBlock", 48 * 1024))
        self._limits = DeviceLimits(max_buffer_size=int(total), max_binding_size=int(total), offset_alignment=ARENA_ALIGN,
                                    weight_alignment=WEIGHT_ALIGN, name=self.name)
        self._staging: Optional[Staging] = None
        self.closed = False

    def staging(self, slots: int) -> Staging:
        """The context's pinned staging ring with at least ``slots`` windows (made on first use,
        remade only to grow: pinning costs about as much as copying)."""
        if self._staging is None or self._staging.slots < slots:
            if self._staging is not None:
                self.copy_stream.synchronize()
                self._staging.close()
            self._staging = Staging(self.cp, WINDOW, slots)
        return self._staging

    @property
    def limits(self) -> DeviceLimits:
        return self._limits

    def create_executor(self, program: Program, **options) -> CudaExecutor:
        known = {"capture_graph", "profile", "fuse", "l2_window", "precision"}  # fuse, l2_window: see CudaExecutor
        unknown = set(options) - known
        if unknown:
            raise TypeError(f"cuda executor: unknown options {sorted(unknown)} (known: {', '.join(sorted(known))})")
        # precision: CUDA keeps its float32 kernels and cuBLAS with TF32 off for "fast" too (the
        # session's promise is only that fast may round; exact results are within it)
        options.pop("precision", None)
        if self.closed:
            raise DeviceError("the CUDA context is closed")
        return CudaExecutor(self, program, **options)

    def register_transfers(self, registry) -> None:
        registry.register("host", "cuda", self._host_to_cuda)
        registry.register("cuda", "host", self._cuda_to_host)
        registry.register("cuda", "cuda", self._cuda_to_cuda)

    def _host_to_cuda(self, srcs, dsts) -> None:
        with self.device, self.compute_stream:
            for s, d in zip(srcs, dsts):
                a = to_storage(s, d.dtype, "copy_tensors")
                d.handle.set(a.reshape(d.handle.shape), stream=self.compute_stream)
            self.compute_stream.synchronize()

    def _cuda_to_host(self, srcs, dsts) -> None:
        with self.device:
            self.compute_stream.synchronize()
            for s, d in zip(srcs, dsts):
                a = from_storage(self.cp.asnumpy(s.handle), s.dtype)
                dst = d.data if isinstance(d, HostTensor) else d
                np.asarray(dst).reshape(-1)[...] = a.reshape(-1)

    def _cuda_to_cuda(self, srcs, dsts) -> None:
        with self.device, self.compute_stream:
            for s, d in zip(srcs, dsts):
                self.cp.copyto(d.handle, s.handle.reshape(d.handle.shape), casting="unsafe")

    def info(self) -> dict:
        cp = self.cp
        return {"kind": self.kind, "device": self.name, "compute_capability": self.compute_capability,
                "memory": self.total_memory, "cupy": cp.__version__,
                "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(), "limits": self._limits}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            with self.device:
                self.device.synchronize()
        except Exception:
            pass
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        try:
            with self.device:
                self.l2.close()
        except Exception:
            pass
        try:
            self.kernels.close()
        except Exception:
            pass


def create_context(env) -> CudaContext:
    """The Environment's factory for device kind ``cuda`` (DeviceError when CUDA is missing)."""
    return CudaContext(env)
