"""A Session: one program on one device with one set of options.

``build()`` runs the build phases (docs/ARCHITECTURE.md) once (decode/validate happened at load):
plan -> allocate -> record -> prepack. ``run(method, inputs)`` executes: delegate nodes on the
session's executor, host nodes (ops no backend took) with the host kernels (numpy, desktop only).
"""

from __future__ import annotations

import importlib
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

from . import dtypes as _dt
from .errors import BudgetError, DeviceError, InputError, UnsupportedOpError
from .executor import DeviceTensor, HostTensor, check_host_input
from .program import DELEGATE_OP, Graph, Method, Program

_HOST_RUNNER = "gpudelegate.native.host:run_host_node"


def _host_runner():
    mod, _, fn = _HOST_RUNNER.partition(":")
    return getattr(importlib.import_module(mod), fn)


# Ops whose argument is an index into another tensor: (op, argument position). Out-of-range
# indices are checked on the host before any executor runs (``index_bounds``), so every executor
# raises the same InputError; a device kernel would otherwise read past its table silently.
_INDEX_ARGS = {"embedding": 1, "kv_update": 2}
# Ops whose output elements are elements of their inputs (indices keep their values through them).
_PASS_THROUGH = ("reshape", "copy", "permute", "expand", "slice", "cat")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_options(weight_budget, prefetch_depth, pinned, methods, program: Program) -> None:
    """Type checks of Environment.session's options (their values are checked by the planner)."""
    if weight_budget is not None and not _is_int(weight_budget):
        raise BudgetError(f"weight_budget must be a number of bytes (int) or None, got {type(weight_budget).__name__} "
                          f"{weight_budget!r}")
    if not _is_int(prefetch_depth):
        raise BudgetError(f"prefetch_depth must be an int, got {type(prefetch_depth).__name__} {prefetch_depth!r}")
    if isinstance(pinned, (str, bytes)) or not isinstance(pinned, (list, tuple, set, frozenset)) \
            or not all(isinstance(n, str) for n in pinned):
        raise BudgetError(f"pinned must be a list of weight names (str), got {pinned!r}")
    if methods is not None:
        if isinstance(methods, (str, bytes)) or not isinstance(methods, (list, tuple)) \
                or not all(isinstance(m, str) for m in methods):
            raise InputError(f"methods must be a list of method names (str) or None, got {methods!r}")
        for m in methods:
            if m not in program.methods:
                raise InputError(f"method {m!r} is not in the program (it has: {', '.join(program.methods)})")


def _merge(bounds: Dict[int, tuple], vid: int, lo: int, hi: int, what: str) -> None:
    old = bounds.get(vid)
    if old is None:
        bounds[vid] = (lo, hi, what)
    elif (lo, hi) != old[:2]:
        nlo, nhi = max(lo, old[0]), min(hi, old[1])
        bounds[vid] = (nlo, nhi, what if (nlo, nhi) == (lo, hi) else old[2])


def _graph_index_bounds(program: Program, g: Graph, payload_bounds) -> Dict[int, tuple]:
    """Input position -> (lo, hi, what): the values an input may hold because it reaches an index
    argument (directly, through value-preserving ops, or through delegate calls)."""
    bounds: Dict[int, tuple] = {}
    shape = lambda v: g.values[v].shape
    for n in reversed(g.nodes):  # nodes are in topological order: consumers first when reversed
        if n.op == "embedding" and len(n.args) > 1 and n.args[1] >= 0:
            rows = shape(n.args[0])[0] if shape(n.args[0]) else 0
            _merge(bounds, n.args[1], 0, rows, f"embedding (a table of {rows} rows)")
        elif n.op == "kv_update" and len(n.args) > 2 and n.args[2] >= 0:
            s, t = shape(n.args[0])[2], shape(n.args[1])[2]
            _merge(bounds, n.args[2], 0, s - t + 1, f"kv_update (a cache of {s} rows, {t} new)")
        elif n.op in _PASS_THROUGH:
            for o in n.outputs:
                if o in bounds:
                    for a in (n.args if n.op == "cat" else n.args[:1]):
                        if a >= 0:
                            _merge(bounds, a, *bounds[o])
        elif n.op == DELEGATE_OP:
            for k, (lo, hi, what) in payload_bounds(n.attrs["payload"]).items():
                if k < len(n.args) and n.args[k] >= 0:
                    _merge(bounds, n.args[k], lo, hi, what)
    return {i: bounds[v] for i, v in enumerate(g.inputs) if v in bounds}


def index_bounds(program: Program, method: str) -> Dict[int, tuple]:
    """``{input position: (lo, hi, what)}`` of ``method``'s index inputs: every element must be in
    ``[lo, hi)``. Pure: computed from the program (embedding table rows, KV cache rows)."""
    cache: Dict[int, Dict[int, tuple]] = {}

    def payload_bounds(p: int) -> Dict[int, tuple]:
        if p not in cache:
            cache[p] = _graph_index_bounds(program, program.payloads[p], payload_bounds)
        return cache[p]

    return _graph_index_bounds(program, program.methods[method], payload_bounds)


def check_source_unchanged(program: Program) -> None:
    """Refuse a program whose memory-mapped file changed after ``load`` (PayloadError).

    ``load`` verified every constant's SHA-256; re-hashing hundreds of MB at each session build
    would cost about a second per 500 MB, so this check is cheap instead (microseconds plus one
    hash of the document, a few KB to a few MB):

    1. the size of the mapped file (``mmap.size()``, an fstat of the mapping's own descriptor):
       a truncated file would raise SIGBUS as soon as a page past its new end is read, so this
       comes before any byte of the mapping is touched;
    2. when ``path`` still names the same inode: its mtime (any write bumps it; a touch too);
    3. the document's digest, recomputed from the mapping, against the one read at load: an
       in-place overwrite by another program file of the same length changes the document (it
       holds every constant's SHA-256), even within one timestamp tick.

    ``Program.save`` replaces files by rename, so saving over the loaded path leaves the mapped
    (old, now unlinked) inode untouched: that is not a change, and the session runs on the
    bytes that were verified at load."""
    src = getattr(program, "source_file", None)
    if src is None:
        return
    import os

    from .errors import PayloadError
    from .program import HEADER_SIZE, document_digest

    path, ident, mapping, digest = src
    why = None
    try:
        size = mapping.size()
    except (OSError, ValueError) as e:
        size, why = None, f"its size cannot be read ({e})"
    if why is None and size != ident[2]:
        why = f"it is now {size} bytes, {ident[2]} when loaded"
    if why is None:
        try:
            st = os.stat(path)
        except OSError:
            st = None  # deleted or renamed: the mapping keeps the loaded inode, unchanged
        if st is not None and (st.st_dev, st.st_ino) == ident[:2] \
                and (st.st_size, st.st_mtime_ns) != ident[2:4]:
            why = "it was written to after it was loaded"
    if why is None:
        doc_size = int.from_bytes(mapping[24:32], "little")
        if bytes(mapping[48:64]) != digest or document_digest(mapping[HEADER_SIZE:HEADER_SIZE + doc_size]) != digest:
            why = "its bytes differ from the ones loaded"
    if why is not None:
        raise PayloadError("", f"{path} changed on disk after gpudelegate.load(): {why}; the program's constants "
                               f"are read from that file, so load it again (Program.save writes a new file and "
                               f"renames it, which never changes a loaded one)")


def _min_max(x, dtype: str):
    """(min, max) of a host integer array without numpy (None: empty, or on a device)."""
    if isinstance(x, DeviceTensor) or hasattr(x, "__cuda_array_interface__"):
        # a device array (ours, CuPy's, torch's): reading it back would cost a device round trip
        # per run; see _check_indices
        return None
    if type(x).__name__ == "ndarray" and x.size <= 64:
        # token ids and positions of a decode step (numpy): a Python min/max of a few values is
        # several times cheaper than two array reductions, and this runs every step
        flat = x.ravel().tolist()
        return (int(min(flat)), int(max(flat))) if flat else None
    if isinstance(x, HostTensor):
        flat = _dt.byte_view(x.data).cast(_dt.STRUCT_FORMAT[dtype])
        return (min(flat), max(flat)) if len(flat) else None
    if _dt.numel(tuple(getattr(x, "shape", ()))) == 0:
        return None
    if _dt.numel(tuple(x.shape)) <= 64 and hasattr(x, "tolist"):
        # token ids and positions of a decode step: a Python min/max of a few values is several
        # times cheaper than two array reductions, and this runs every step
        flat = x.tolist()
        if not isinstance(flat, list):  # a 0-d array gives its scalar
            flat = [flat]
        while flat and isinstance(flat[0], list):
            flat = [v for row in flat for v in row]
        return (int(min(flat)), int(max(flat))) if flat else None
    lo, hi = getattr(x, "min", None), getattr(x, "max", None)
    if callable(lo) and callable(hi):  # numpy arrays, torch tensors
        return int(lo()), int(hi())
    return None


#: Environment.session(precision=...): "exact" (the default) computes as the program says;
#: "fast" lets the WebGPU executor round a product's inputs to float16 and accumulate in float32
#: (subgroup-matrix kernels where the device has them, else its float32 kernels). The reference
#: and CUDA executors take it and compute exactly as with "exact".
PRECISIONS = ("exact", "fast")


def check_precision(precision) -> str:
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise InputError(f"precision must be one of {', '.join(repr(p) for p in PRECISIONS)}, got {precision!r}")
    return precision


class Session:
    def __init__(self, env, program: Program, device: str, weight_budget: Optional[int] = None,
                 prefetch_depth: int = 2, pinned: Sequence[str] = (), methods: Optional[Sequence[str]] = None,
                 executor_options: Optional[dict] = None, precision: str = "exact"):
        _check_options(weight_budget, prefetch_depth, pinned, methods, program)
        self.precision = check_precision(precision)
        self.env = env
        self.program = program
        self.device = device
        self.weight_budget = weight_budget
        self.prefetch_depth = prefetch_depth
        self.pinned = tuple(pinned)
        self.methods = list(methods) if methods is not None else list(program.methods)
        self._index_bounds: Dict[str, Dict[int, tuple]] = {}
        self._signatures: Dict[str, List[tuple]] = {}
        self._input_names: Dict[str, tuple] = {}  # per method: ({input name: value id}, [names in order])
        self.executor_options = executor_options or {}
        self.context = env.context(device)
        self.executor = None
        self.plan = None
        self.timings: Dict[str, float] = {}
        self.closed = False
        self._lock = threading.RLock()
        self._keep_cache: Dict[tuple, List[bool]] = {}
        self._host = None

    # ------------------------------------------------------------------ build
    #: The build phases, in order, as ``phase`` reports them and as ``timings`` names them.
    BUILD_PHASES = ("plan", "allocate", "record", "prepack")

    def build(self, progress=None, phase=None) -> "Session":
        """Plan, allocate, record and prepack (docs/ARCHITECTURE.md, "Build phases").
        ``progress(done, total)``: prepack bytes. ``phase(name)``: called as each phase of
        ``BUILD_PHASES`` starts, so a UI can say which one runs (the browser demo shows them);
        ``timings`` has their durations under the same names."""
        from .plan import plan_session

        say = phase if phase is not None else (lambda name: None)
        t0 = time.perf_counter()
        say("plan")
        check_source_unchanged(self.program)
        self._check_host_ops()
        self.plan = plan_session(self.program, self.context.limits, weight_budget=self.weight_budget,
                                 prefetch_depth=self.prefetch_depth, pinned=self.pinned, methods=self.methods)
        t1 = time.perf_counter()
        say("allocate")
        try:
            # precision goes to the executor only when asked for, so contexts that predate it work
            opts = dict(self.executor_options, **({"precision": self.precision} if self.precision != "exact" else {}))
            ex = self.context.create_executor(self.program, **opts)
        except TypeError as e:
            if not self.executor_options:
                raise
            raise InputError(f"executor options {sorted(self.executor_options)} for {self.device!r}: {e}") from None
        try:
            ex.allocate(self.plan)
            t2 = time.perf_counter()
            say("record")
            ex.record(self.plan)
            t3 = time.perf_counter()
            say("prepack")
            ex.prepack(self.plan, progress)
            t4 = time.perf_counter()
        except BaseException:
            ex.close()  # a failed build leaks nothing
            raise
        self.executor = ex
        self.timings.update(plan=t1 - t0, allocate=t2 - t1, record=t3 - t2, prepack=t4 - t3, build=t4 - t0)
        return self

    def _check_host_ops(self) -> None:
        host_ops = sorted({n.op for m in self.methods for n in self.program.methods[m].nodes if n.op != DELEGATE_OP})
        if host_ops:
            try:
                self._host = _host_runner()
            except ImportError as e:
                raise UnsupportedOpError("", f"ops {host_ops} run on the host, which needs numpy; not available here ({e})") from None

    # ------------------------------------------------------------------ run
    def signature(self, method: str) -> dict:
        m = self._method(method)
        sig = lambda ids: [{"name": m.values[v].name, "dtype": m.values[v].dtype, "shape": list(m.values[v].shape)} for v in ids]
        return {"inputs": sig(m.inputs), "outputs": sig(m.outputs)}

    def _method(self, name: str) -> Method:
        if self.closed:
            raise DeviceError("this session is closed")
        if not isinstance(name, str):
            raise InputError(f"the method name must be a str, got {type(name).__name__} {name!r} "
                             f"(methods: {', '.join(self.methods)})")
        if name not in self.methods:
            raise InputError(f"no method {name!r} in this session (it has: {', '.join(self.methods)})")
        return self.program.methods[name]

    def _bind_inputs(self, name: str, m: Method, inputs) -> Dict[int, Any]:
        if not isinstance(inputs, (list, tuple, dict)):
            # A bare array is iterable (over its rows): taking it as a list of inputs would give a
            # confusing count error, or silently bind rows to inputs.
            got = type(inputs).__name__ + (f" of shape {list(inputs.shape)}" if hasattr(inputs, "shape") else "")
            raise InputError(f"{name}: inputs must be a list (in signature order) or a dict by input name, got {got}"
                             + ("; wrap a single input as [x]" if hasattr(inputs, "shape") else ""))
        if isinstance(inputs, dict):
            names = self._input_names.get(name)
            if names is None:  # made once: a decode step binds its ~60 inputs by name every token
                names = self._input_names[name] = ({m.values[v].name: v for v in m.inputs},
                                                   [m.values[v].name for v in m.inputs])
            by_name, order = names
            if inputs.keys() != by_name.keys():
                unknown = [k for k in inputs if k not in by_name]
                if unknown:
                    raise InputError(f"{name}: unknown inputs {unknown} (expected {list(by_name)})")
                missing = [k for k in by_name if k not in inputs]
                if missing:
                    raise InputError(f"{name}: missing inputs {missing}")
            inputs = [inputs[k] for k in order]
        inputs = list(inputs)
        if len(inputs) != len(m.inputs):
            raise InputError(f"{name}: expected {len(m.inputs)} inputs, got {len(inputs)}")
        vals: Dict[int, Any] = {}
        own = self.executor
        for i, (vid, dtype, shape, label) in enumerate(self._signature(name, m)):
            x = inputs[i]
            # This session's own outputs fed back (a KV cache every decode step) are alive while
            # it runs and were checked when they were made: matching dtype and shape is all they
            # need (62 full checks cost ~0.3-0.7 ms of a SmolLM2 decode step's host time).
            if type(x) is DeviceTensor and x.owner is own and x.dtype == dtype and x.shape == shape:
                vals[vid] = x
                continue
            check_host_input(label, x, dtype, shape)
            if isinstance(x, DeviceTensor):
                x.check_alive(label)
                if x.device != self.device:
                    raise InputError(f"{label}: a tensor on device {x.device!r} given to a session on "
                                     f"{self.device!r}; copy it with env.copy_tensors first")
            vals[vid] = x
        self._check_indices(name, m, vals)
        return vals

    def _signature(self, name: str, m: Method) -> List[tuple]:
        """Per input of method ``name``: (value id, dtype, shape, label for errors), made once."""
        sig = self._signatures.get(name)
        if sig is None:
            sig = self._signatures[name] = [
                (vid, m.values[vid].dtype, tuple(m.values[vid].shape),
                 f"{name}.inputs[{i}]" + (f" ({m.values[vid].name})" if m.values[vid].name else ""))
                for i, vid in enumerate(m.inputs)]
        return sig

    def _check_indices(self, name: str, m: Method, vals: Dict[int, Any]) -> None:
        """Index inputs (embedding ids, a KV-cache position) must be in range, checked here on the
        host for every executor alike (one min/max per index input; the reference would raise,
        a GPU kernel would read outside its table). A DeviceTensor index input is not read back."""
        bounds = self._index_bounds.get(name)
        if bounds is None:
            bounds = self._index_bounds[name] = index_bounds(self.program, name)
        for i, (lo, hi, what) in bounds.items():
            v = m.values[m.inputs[i]]
            mm = _min_max(vals[m.inputs[i]], v.dtype)
            if mm is None:
                continue
            bad = mm[0] if mm[0] < lo else mm[1] if mm[1] >= hi else None
            if bad is not None:
                label = f"{name}.inputs[{i}]" + (f" ({v.name})" if v.name else "")
                raise InputError(f"{label}: index {bad} is out of range [0, {hi}) for {what}"
                                 if lo == 0 else f"{label}: index {bad} is out of range [{lo}, {hi}) for {what}")

    def _keep_flags(self, method: str, m: Method, keep_on_device: bool) -> List[bool]:
        """Per node: leave delegate outputs on the device when every consumer is another delegate
        call (or a method output the caller wants on the device)."""
        key = (method, keep_on_device)
        if key not in self._keep_cache:
            consumers: Dict[int, List[str]] = {}
            for n in m.nodes:
                for a in n.args:
                    consumers.setdefault(a, []).append(n.op)
            outs = set(m.outputs)
            flags = []
            for n in m.nodes:
                ok = n.op == DELEGATE_OP
                for o in n.outputs:
                    for op in consumers.get(o, []):
                        ok = ok and op == DELEGATE_OP
                    if o in outs:
                        ok = ok and keep_on_device
                flags.append(ok)
            self._keep_cache[key] = flags
        return self._keep_cache[key]

    def run(self, method: str, inputs, keep_on_device: bool = False) -> List[Any]:
        """Run ``method`` on ``inputs`` (a list in signature order, or a dict by input name).
        Returns host arrays, or DeviceTensors with ``keep_on_device`` (valid until the next run)."""
        m = self._method(method)
        with self._lock, self.env.context_lock(self.device):
            m = self._method(method)  # again under the lock: close() waits for a run, then wins
            vals = self._bind_inputs(method, m, inputs)
            flags = self._keep_flags(method, m, keep_on_device)
            for i, n in enumerate(m.nodes):
                args = [vals.get(a) if a >= 0 else None for a in n.args]
                if n.op == DELEGATE_OP:
                    outs = self.executor.run(n.attrs["payload"], args, keep_on_device=flags[i])
                else:
                    outs = self._host(self.program, m, n, vals)
                vals.update(zip(n.outputs, outs))
            return self._finish(m, vals, keep_on_device)

    async def run_async(self, method: str, inputs, keep_on_device: bool = False) -> List[Any]:
        """The same as ``run`` for executors with an async path (the browser)."""
        m = self._method(method)
        vals = self._bind_inputs(method, m, inputs)
        flags = self._keep_flags(method, m, keep_on_device)
        run_async = getattr(self.executor, "run_async", None)
        for i, n in enumerate(m.nodes):
            args = [vals.get(a) if a >= 0 else None for a in n.args]
            if n.op == DELEGATE_OP:
                p = n.attrs["payload"]
                outs = (await run_async(p, args, keep_on_device=flags[i]) if run_async
                        else self.executor.run(p, args, keep_on_device=flags[i]))
            else:
                outs = self._host(self.program, m, n, vals)
            vals.update(zip(n.outputs, outs))
        return self._finish(m, vals, keep_on_device)

    def _finish(self, m: Method, vals: Dict[int, Any], keep_on_device: bool) -> List[Any]:
        outs = []
        for o in m.outputs:
            x = vals[o]
            if isinstance(x, DeviceTensor) and not keep_on_device:
                x = x.owner.to_host(x)
            outs.append(x)
        return outs

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Free the session's device buffers (not the device: the Environment owns it). Idempotent.
        A run in progress on another thread finishes first (the run lock); later runs raise
        DeviceError, and DeviceTensors this session returned become dead (DeviceError on use)."""
        if self.closed:
            return
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                if self.executor is not None:
                    self.executor.close()
            finally:
                self.executor = None
                self.env._forget(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
