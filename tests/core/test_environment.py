"""Environment / Session lifecycle and data transfer (seed PR 26450), with a pure-Python device so
these tests also run where numpy does not exist (Pyodide, the numpy-blocked subprocess)."""

import array
import subprocess
import sys
import textwrap
import threading

import pytest

import gpudelegate
from gpudelegate import environment as envmod
from gpudelegate.errors import DeviceError, GpuDelegateError, InputError
from gpudelegate.executor import DeviceContext, DeviceTensor, Executor, HostTensor
from gpudelegate.plan.types import DeviceLimits
from gpudelegate.program import DELEGATE_OP, Method, Node, Payload, Program, Value

LOG = []


class PyExecutor(Executor):
    """A 'device' in pure Python: runs `add` payloads over float32 memoryviews."""

    kind = "pydev"

    def allocate(self, plan):
        LOG.append(("allocate", id(self)))

    def record(self, plan):
        self.plan = plan

    def prepack(self, plan, progress=None):
        if progress:
            progress(0, 0)

    def run(self, payload, inputs, keep_on_device=False):
        bufs = [x.handle if isinstance(x, DeviceTensor) else x.data for x in inputs]
        a, b = (memoryview(buf).cast("B").cast("f") for buf in bufs)
        out = array.array("f", [x + y for x, y in zip(a, b)])
        shape = tuple(inputs[0].shape)
        if keep_on_device:
            return [DeviceTensor(self, "float32", shape, out, out.itemsize * len(out))]
        return [HostTensor("float32", shape, out)]

    def to_host(self, t):
        return HostTensor(t.dtype, t.shape, t.handle)

    def close(self):
        LOG.append(("executor.close", id(self)))
        super().close()


class PyContext(DeviceContext):
    kind = "pydev"
    fail_close = False

    def __init__(self, env):
        LOG.append(("context.create", id(self)))
        self.closed = False

    @property
    def limits(self):
        return DeviceLimits(name="pydev")

    def create_executor(self, program, **options):
        return PyExecutor(self, program)

    def register_transfers(self, registry):
        def h2d(srcs, dsts):
            for s, d in zip(srcs, dsts):
                d.handle[:] = array.array("f", memoryview(s.data).cast("B").cast("f"))
        registry.register("host", "pydev", h2d)

    def close(self):
        LOG.append(("context.close", id(self)))
        if self.fail_close:
            raise RuntimeError("driver exploded")


envmod.register_device("pydev", PyContext)

N = 7


def add_program() -> Program:
    vals = [Value("float32", (N,), name="a"), Value("float32", (N,), name="b"), Value("float32", (N,), name="y")]
    payload = Payload(values=list(vals), inputs=[0, 1], outputs=[2], nodes=[Node("add", [0, 1], [2])])
    method = Method(values=list(vals), inputs=[0, 1], outputs=[2],
                    nodes=[Node(DELEGATE_OP, [0, 1], [2], {"payload": 0})], name="forward")
    return Program(constants=[], payloads=[payload], methods={"forward": method})


def ht(values):
    return HostTensor("float32", (len(values),), array.array("f", values))


@pytest.fixture(autouse=True)
def clear_log():
    LOG.clear()
    PyContext.fail_close = False
    yield


def test_context_is_lazy_and_shared_by_sessions():
    env = gpudelegate.Environment()
    assert not env.has_context("pydev")
    prog = add_program()
    s1 = env.session(prog, device="pydev")
    s2 = env.session(prog, device="pydev")
    creates = [e for e in LOG if e[0] == "context.create"]
    assert len(creates) == 1 and s1.context is s2.context
    s1.close()
    assert not any(e[0] == "context.close" for e in LOG), "a session must never close the shared context"
    y = s2.run("forward", [ht([1.0] * N), ht([2.0] * N)])[0]
    assert list(memoryview(y.data).cast("B").cast("f")) == [3.0] * N
    env.close()


def test_teardown_order_sessions_then_contexts_and_idempotent():
    env = gpudelegate.Environment()
    s = env.session(add_program(), device="pydev")
    env.close()
    kinds = [e[0] for e in LOG]
    assert kinds.index("executor.close") < kinds.index("context.close")
    assert s.closed
    env.close()  # idempotent
    s.close()  # closing a session after its environment: no error
    assert kinds.count("context.close") == 1
    with pytest.raises(GpuDelegateError, match="closed"):
        env.session(add_program(), device="pydev")
    with pytest.raises(GpuDelegateError, match="closed"):
        s.run("forward", [ht([1.0] * N), ht([1.0] * N)])


def test_session_closed_before_environment_then_env_close():
    env = gpudelegate.Environment()
    s = env.session(add_program(), device="pydev")
    s.close()
    s.close()
    env.close()
    assert [e[0] for e in LOG].count("executor.close") == 1


def test_failing_context_close_never_raises():
    PyContext.fail_close = True
    env = gpudelegate.Environment()
    env.session(add_program(), device="pydev")
    with pytest.warns(UserWarning, match="driver exploded"):
        env.close()


def test_unknown_and_unavailable_devices_are_clear():
    env = gpudelegate.Environment()
    with pytest.raises(DeviceError, match="unknown device 'tpu'"):
        env.session(add_program(), device="tpu")
    envmod.register_device("broken", "gpudelegate_no_such_module:create_context")
    with pytest.raises(DeviceError, match="not available here"):
        env.context("broken")
    env.close()


def test_data_transfer_registry_is_environment_level():
    env = gpudelegate.Environment()
    # host <-> host works with no device at all
    dst = HostTensor("float32", (3,), bytearray(12))
    env.copy_tensors([ht([1.0, 2.0, 3.0])], [dst])
    assert list(memoryview(dst.data).cast("f")) == [1.0, 2.0, 3.0]
    # the device's transfer appears when its context is first created, without any session
    assert not env.data_transfer.can_copy("host", "pydev")
    ctx = env.context("pydev")
    assert env.data_transfer.can_copy("host", "pydev")
    dev = DeviceTensor(PyExecutor(ctx, add_program()), "float32", (3,), array.array("f", [0, 0, 0]), 12)
    env.copy_tensors([ht([4.0, 5.0, 6.0])], [dev])
    assert list(dev.handle) == [4.0, 5.0, 6.0]
    with pytest.raises(DeviceError, match="no data transfer registered from 'pydev' to 'host'"):
        env.copy_tensors([dev], [dst])
    with pytest.raises(GpuDelegateError, match="2 sources but 1 destinations"):
        env.copy_tensors([dst, dst], [dst])
    env.close()


def test_bad_inputs_are_input_errors():
    env = gpudelegate.Environment()
    s = env.session(add_program(), device="pydev")
    with pytest.raises(InputError, match="expected 2 inputs, got 1"):
        s.run("forward", [ht([1.0] * N)])
    with pytest.raises(InputError, match=r"forward.inputs\[1\] \(b\): shape \[3\] does not match the method's \[7\]"):
        s.run("forward", [ht([1.0] * N), ht([1.0] * 3)])
    with pytest.raises(InputError, match="no method 'decode'"):
        s.run("decode", [])
    with pytest.raises(InputError, match="missing inputs"):
        s.run("forward", {"a": ht([1.0] * N)})
    out = s.run("forward", {"a": ht([1.0] * N), "b": ht([0.5] * N)})[0]
    assert list(memoryview(out.data).cast("B").cast("f")) == [1.5] * N
    env.close()


def test_outputs_left_on_device_feed_the_next_run():
    env = gpudelegate.Environment()
    s = env.session(add_program(), device="pydev")
    y = s.run("forward", [ht([1.0] * N), ht([1.0] * N)], keep_on_device=True)[0]
    assert isinstance(y, DeviceTensor) and y.device == "pydev"
    z = s.run("forward", [y, ht([1.0] * N)])[0]
    assert list(memoryview(z.data).cast("B").cast("f")) == [3.0] * N
    env.close()


def test_build_reports_each_phase_as_it_starts():
    """``phase(name)`` comes before the work of its phase (the executor's allocate, prepack's
    progress), in ``Session.BUILD_PHASES`` order, and ``timings`` uses the same names."""
    env = gpudelegate.Environment()
    s = env.session(add_program(), device="pydev", phase=lambda name: LOG.append(("phase", name)),
                    progress=lambda done, total: LOG.append(("progress", done)))
    seen = [e[1] if e[0] == "phase" else e[0] for e in LOG if e[0] in ("phase", "allocate", "progress")]
    assert seen == ["plan", "allocate", "allocate", "record", "prepack", "progress"]
    assert list(s.BUILD_PHASES) == ["plan", "allocate", "record", "prepack"]
    assert set(s.BUILD_PHASES) <= set(s.timings)
    with pytest.raises(InputError, match="phase must be a callable"):
        env.session(add_program(), device="pydev", phase="plan")
    env.close()


@pytest.mark.skipif(sys.platform == "emscripten", reason="Pyodide (the browser) cannot start threads")
def test_two_sessions_two_threads():
    env = gpudelegate.Environment()
    prog = add_program()
    sessions = [env.session(prog, device="pydev") for _ in range(2)]
    errors = []

    def work(k):
        try:
            for i in range(50):
                y = sessions[k].run("forward", [ht([float(i)] * N), ht([float(k)] * N)])[0]
                assert list(memoryview(y.data).cast("B").cast("f")) == [float(i + k)] * N
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    env.close()


@pytest.mark.skipif(sys.platform == "emscripten", reason="Pyodide cannot start a subprocess")
def test_environment_left_open_is_closed_at_interpreter_exit(tmp_path):
    script = textwrap.dedent(f"""
        import atexit, sys
        # registered before gpudelegate's own handler, so it runs after it (atexit is LIFO)
        atexit.register(lambda: print("LOG", [e[0] for e in sys.modules["test_environment"].LOG]))
        import gpudelegate
        from gpudelegate import environment as envmod
        sys.path.insert(0, {str(__import__('os').path.dirname(__file__))!r})
        import test_environment as t
        env = gpudelegate.Environment()
        s = env.session(t.add_program(), device="pydev")
        # no close: atexit must tear down sessions, then contexts, without raising
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    log = r.stdout.split("LOG", 1)[1]
    assert log.index("executor.close") < log.index("context.close")


class SoftwareContext(PyContext):
    def info(self):
        return {"kind": "pysw", "software": True}


def test_auto_passes_over_a_software_adapter(monkeypatch):
    envmod.register_device("pysw", SoftwareContext)
    monkeypatch.setattr(envmod, "AUTO_ORDER", ("pysw", "pydev"))
    env = gpudelegate.Environment()
    assert env.resolve_device("auto") == "pydev"  # the CPU adapter is slower than the fallback
    assert env.resolve_device("pysw") == "pysw"  # asked for by name, it is used
    monkeypatch.setattr(envmod, "AUTO_ORDER", ("pysw",))
    assert env.resolve_device("auto") == "pysw"  # the last resort is taken even if software
    env.close()
