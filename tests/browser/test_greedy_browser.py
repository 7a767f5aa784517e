"""The page's run path (Pyodide + WebGPU): two checks that share one harness page (its boot dominates).

The greedy pick on the GPU in the page (``WebGPUExecutor.argmax_device``, shaders/argmax.wgsl,
the browser's ``submit_read``: a mapAsync per pick, started at its submit): the index of each
vector equals numpy's argmax (torch.argmax's rule: first of equal maxima, first NaN), and two
picks submitted before either is read each read their own value, not the later work's.

Also, a payload's kept run in the page (web/page_runs.py, ``WebGPUContext._submit``'s fast path): the
inputs are copied into a Python bytearray and written to the GPU straight from the WebAssembly heap.
Checked against numpy in float64 on fresh random inputs of every run: one kept run serves every run
of the payload (async and JSPI APIs alike); a 14-byte float16 input (not a multiple of 4: the
padded tail) arrives whole; after the heap has grown (which detaches the view the JS side holds)
the inputs still arrive; a run with a JS view (``loader.JsBytes``, as streamed weights come) among
its writes goes the general way and leaves the kept run intact.

Tolerance: none. ``x * 2`` is exact in float16 and ``z + 1`` is one float32 rounding of the exact
sum, which numpy's float64 result rounded to float32 reproduces bit for bit."""

from __future__ import annotations

import base64

import numpy as np
import pytest

N = 4099  # a prime vocabulary

PAGE = r"""
import base64
from pyodide.ffi import to_js
from gpudelegate.environment import Environment
from gpudelegate.executor import HostTensor, IndexTensor
from gpudelegate.web import loader

prog = loader.program_from_bytes(to_js(base64.b64decode(ARGS["program"])))
method = list(prog.methods)[0]
env = Environment()
out = {"each": [], "ahead": []}
with env.session(prog, device="webgpu") as s:
    ex = s.executor
    out["lookahead"] = ex.greedy_lookahead
    out["software"] = ex.device.is_fallback_adapter
    def vec(b64):
        return [HostTensor("float32", (1, ARGS["n"]), base64.b64decode(b64))]
    for b64 in ARGS["cases"]:
        (y,) = await s.run_async(method, vec(b64), keep_on_device=True)
        idx = ex.argmax_device(y)
        out["kind"] = type(idx).__name__
        out["each"].append(await ex.index_value_async(idx))
    # every pick submitted before any is read: the next run overwrites the logits and the next
    # pick the index buffer; each read is its own submission's
    pending = []
    for b64 in ARGS["cases"]:
        (y,) = await s.run_async(method, vec(b64), keep_on_device=True)
        pending.append(ex.argmax_device(y))
    for idx in pending:
        out["ahead"].append(await ex.index_value_async(idx))
env.close()
out
"""


def _cases():
    rng = np.random.default_rng(4)
    cases = [rng.standard_normal(N) for _ in range(3)]
    ties = rng.standard_normal(N)
    ties[[4000, 9, 2000]] = 7.0
    nans = rng.standard_normal(N)
    nans[[3000, 101, 100]] = np.nan
    return cases + [ties, nans, np.full(N, -np.inf)]


@pytest.fixture(scope="module")
def program_b64(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from gpudelegate.export import export_program

    class Double(torch.nn.Module):  # y = 2x: exact, NaN and infinities kept
        def forward(self, x):
            return x * 2.0

    path = tmp_path_factory.mktemp("greedy") / "double.gdp"
    export_program(Double().eval(), (torch.zeros(1, N),), path=path, progress=False)
    return base64.b64encode(path.read_bytes()).decode()


def test_argmax_device_in_the_page(harness, program_b64):
    cases = _cases()
    want = [int(np.argmax(c.astype(np.float32))) for c in cases]
    r = harness(PAGE, {"program": program_b64, "n": N,
                       "cases": [base64.b64encode(c.astype(np.float32).tobytes()).decode() for c in cases]})
    # two steps ahead on a GPU; none on a software adapter (its "GPU" is the page's CPU cores)
    assert r["kind"] == "IndexTensor" and r["lookahead"] == (0 if r["software"] else 2)
    assert r["each"] == want
    assert r["ahead"] == want


# ---------------------------------------------------------------- a payload's kept run (web/page_runs.py)
KEPT_PAGE = r"""
import base64, js
from pyodide.ffi import to_js, create_proxy
from gpudelegate.environment import Environment
from gpudelegate.executor import HostTensor
from gpudelegate.web import loader
from gpudelegate.webgpu.device import RunIO

prog = loader.program_from_bytes(to_js(base64.b64decode(ARGS["program"])))
method = list(prog.methods)[0]
heap_size = js.Function.new("p", "const b = p.getBuffer('u8'); const n = b.data.buffer.byteLength; b.release(); return n;")
probe = create_proxy(bytearray(4))
env = Environment()
out = {"runs": []}

def feeds(case):
    return [HostTensor("float16", (7,), base64.b64decode(case[0])), HostTensor("float32", (3, 11), base64.b64decode(case[1]))]

def as_b64(outs):
    return [base64.b64encode(bytes(o.data)).decode() for o in outs]

with env.session(prog, device="webgpu") as s:
    ex = s.executor; dev = ex.device
    p = next(iter(s.plan.payloads)); chain = ex.recorded[p].chain
    cases = ARGS["cases"]
    out["runs"].append(as_b64(await s.run_async(method, feeds(cases[0]))))
    out["runs"].append(as_b64(s.run(method, feeds(cases[1]))))  # the synchronous API (JSPI)
    out["kept_first"] = len(chain.kept)
    before = heap_size(probe)
    big = bytearray(ARGS["grow_mib"] << 20)  # the heap grows: the kept run's view of its stage is detached
    out["heap_grew"] = heap_size(probe) > before
    out["runs"].append(as_b64(await s.run_async(method, feeds(cases[2]))))
    del big
    # the general way: a JS view among the writes (offload's streamed weights come so)
    ins, _, reads = ex._run_refs(p, s.plan.payloads[p])
    x, z = feeds(cases[3])
    jx = loader.JsBytes(js.Uint8Array.new(to_js(x.data)))
    got = await dev.run_chain_async(chain, RunIO(writes=[(ins[0][0], ins[0][1], jx), (ins[1][0], ins[1][1], z.data)],
                                                 reads=list(reads)))
    out["runs"].append([base64.b64encode(bytes(g)).decode() for g in got])
    out["runs"].append(as_b64(await s.run_async(method, feeds(cases[4]))))
    out["kept_last"] = len(chain.kept)
probe.destroy()
env.close()
out
"""


@pytest.fixture(scope="module")
def two_inputs_b64(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from gpudelegate.export import export_program

    class TwoInputs(torch.nn.Module):
        def forward(self, x, z):
            return x * 2.0, z + 1.0

    path = tmp_path_factory.mktemp("page_runs") / "two_inputs.gdp"
    export_program(TwoInputs().eval(), (torch.zeros(7, dtype=torch.float16), torch.zeros(3, 11)), path=path,
                   progress=False)
    return base64.b64encode(path.read_bytes()).decode()


def test_kept_run_writes_from_the_heap(harness, two_inputs_b64):
    rng = np.random.default_rng(18)
    cases = [(rng.standard_normal(7).astype(np.float16), rng.standard_normal((3, 11)).astype(np.float32)) for _ in range(5)]
    r = harness(KEPT_PAGE, {"program": two_inputs_b64, "grow_mib": 96,
                       "cases": [[base64.b64encode(x.tobytes()).decode(), base64.b64encode(z.tobytes()).decode()]
                                 for x, z in cases]})
    assert r["kept_first"] == 1 and r["kept_last"] == 1, r  # one kept run for every run of the payload
    assert r["heap_grew"], "the page's heap did not grow: the detached-view path went unchecked"
    for i, ((x, z), (y0, y1)) in enumerate(zip(cases, r["runs"])):
        want0 = (x.astype(np.float64) * 2).astype(np.float16)
        want1 = (z.astype(np.float64) + 1).astype(np.float32)
        got0 = np.frombuffer(base64.b64decode(y0), np.float16)[:7]
        got1 = np.frombuffer(base64.b64decode(y1), np.float32)[:33].reshape(3, 11)
        np.testing.assert_array_equal(got0, want0, err_msg=f"run {i}: float16 x * 2")
        np.testing.assert_array_equal(got1, want1, err_msg=f"run {i}: float32 z + 1")
