"""A Session: one program on one device with one set of options.

``build()`` runs DESIGN.md's build phases once (decode/validate happened at load):
plan -> allocate -> record -> prepack. ``run(method, inputs)`` executes: delegate nodes on the
session's executor, host nodes (ops no backend took) with the host kernels (numpy, desktop only).
"""

from __future__ import annotations

import importlib
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

from .errors import GpuDelegateError, InputError, UnsupportedOpError
from .executor import DeviceTensor, check_host_input
from .program import DELEGATE_OP, Method, Program

_HOST_RUNNER = "gpudelegate.native.host:run_host_node"


def _host_runner():
    mod, _, fn = _HOST_RUNNER.partition(":")
    return getattr(importlib.import_module(mod), fn)


class Session:
    def __init__(self, env, program: Program, device: str, weight_budget: Optional[int] = None,
                 prefetch_depth: int = 2, pinned: Sequence[str] = (), methods: Optional[Sequence[str]] = None,
                 executor_options: Optional[dict] = None):
        self.env = env
        self.program = program
        self.device = device
        self.weight_budget = weight_budget
        self.prefetch_depth = prefetch_depth
        self.pinned = tuple(pinned)
        self.methods = list(methods) if methods is not None else list(program.methods)
        for m in self.methods:
            if m not in program.methods:
                raise InputError(f"method {m!r} is not in the program (it has: {', '.join(program.methods)})")
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
    def build(self, progress=None) -> "Session":
        from .plan import plan_session

        t0 = time.perf_counter()
        self._check_host_ops()
        self.plan = plan_session(self.program, self.context.limits, weight_budget=self.weight_budget,
                                 prefetch_depth=self.prefetch_depth, pinned=self.pinned, methods=self.methods)
        t1 = time.perf_counter()
        ex = self.context.create_executor(self.program, **self.executor_options)
        try:
            ex.allocate(self.plan)
            t2 = time.perf_counter()
            ex.record(self.plan)
            t3 = time.perf_counter()
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
            raise GpuDelegateError("this session is closed")
        if name not in self.methods:
            raise InputError(f"no method {name!r} in this session (it has: {', '.join(self.methods)})")
        return self.program.methods[name]

    def _bind_inputs(self, name: str, m: Method, inputs) -> Dict[int, Any]:
        if isinstance(inputs, dict):
            by_name = {m.values[v].name: v for v in m.inputs}
            unknown = [k for k in inputs if k not in by_name]
            if unknown:
                raise InputError(f"{name}: unknown inputs {unknown} (expected {list(by_name)})")
            missing = [k for k in by_name if k not in inputs]
            if missing:
                raise InputError(f"{name}: missing inputs {missing}")
            inputs = [inputs[m.values[v].name] for v in m.inputs]
        inputs = list(inputs)
        if len(inputs) != len(m.inputs):
            raise InputError(f"{name}: expected {len(m.inputs)} inputs, got {len(inputs)}")
        vals: Dict[int, Any] = {}
        for i, (vid, x) in enumerate(zip(m.inputs, inputs)):
            v = m.values[vid]
            check_host_input(f"{name}.inputs[{i}]" + (f" ({v.name})" if v.name else ""), x, v.dtype, v.shape)
            if isinstance(x, DeviceTensor) and x.owner is not self.executor and x.device != self.device:
                raise InputError(f"{name}.inputs[{i}]: a tensor on device {x.device!r} given to a session on "
                                 f"{self.device!r}; copy it with env.copy_tensors first")
            vals[vid] = x
        return vals

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
        """Free the session's device buffers (not the device: the Environment owns it). Idempotent."""
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
