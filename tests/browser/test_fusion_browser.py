"""The browser runs the shared executor's GPU-side work exactly like the desktop: sibling-linear
fusion (q/k/v linears reading one input run as one batched product, their weights placed back to
back in one buffer) and fp16 packing (float32 weights in the file, packed to float16 on the GPU
at load). One exported program, the same kernel ``Tuning`` on both sides; the page (Pyodide +
WebGPU on SwiftShader, the program loaded through ``web/loader.py`` with its data segment in JS
memory) and desktop wgpu (lavapipe) record the same dispatches, step by step, and give the same
outputs.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest

import gpudelegate

# Explicit on both sides: the browser adapter's own default on a software adapter is
# Tuning(gemv_max_m=0) and desktop wgpu's is Tuning(); the comparison needs one choice.
TUNING = {"gemv_max_m": 0}
D, T = 64, 8  # 64x64 float32 weights and 64-float biases: multiples of the 256-byte offset alignment

PAGE = r"""
import base64, js
from pyodide.ffi import to_js
from gpudelegate.environment import Environment
from gpudelegate.executor import HostTensor
from gpudelegate.webgpu.lowering import Tuning
from gpudelegate.web import loader

buf = to_js(base64.b64decode(ARGS["program"]))  # a JS Uint8Array, like a fetched file
prog = loader.program_from_bytes(buf)
env = Environment()
out = {"data": type(prog.data).__name__}
with env.session(prog, device="webgpu", tuning=Tuning(**ARGS["tuning"])) as s:
    ex = s.executor
    out["executor"] = type(ex).__module__ + "." + type(ex).__name__
    out["recorded"] = {str(p): {"dispatch_count": r.dispatch_count,
                                "steps": [[st.op, st.node, len(st.launches), [L.entry for L in st.launches]] for st in r.nodes]}
                       for p, r in ex.recorded.items()}
    out["layouts"] = [b.layout for b in s.plan.prepack.buffers]
    out["outputs"] = {}
    for m, x in ARGS["inputs"].items():
        (y,) = await s.run_async(m, [HostTensor("float32", tuple(x["shape"]), base64.b64decode(x["data"]))])
        out["outputs"][m] = base64.b64encode(bytes(y.data)).decode()
env.close()
out
"""


def _program(path):
    import torch

    from gpudelegate.export import GpuDelegatePartitioner, export_program

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (torch.nn.Linear(D, D) for _ in range(4))

        def forward(self, x):
            q, k, v = self.q(x), self.k(x), self.v(x)  # siblings: three linears reading x
            a = torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5, dim=-1) @ v
            return self.o(a)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(D, 2 * D), torch.nn.Linear(2 * D, D)

        def forward(self, x):
            return self.down(torch.nn.functional.gelu(self.up(x)))

    torch.manual_seed(0)
    x = torch.randn(1, T, D)
    # The attention method keeps float32 weights (sibling fusion is for float32 linears); the MLP
    # method stores its weights as float16 on the GPU, packed there at load (fp16_at="load").
    export_program({"attention": (Attention().eval(), (x,)), "mlp": (MLP().eval(), (x,))}, path=path,
                   partitioner={"attention": GpuDelegatePartitioner(),
                                "mlp": GpuDelegatePartitioner(weights_dtype="float16", fp16_at="load")},
                   progress=False)
    return gpudelegate.load(path)


def _steps(rec):
    return [[st.op, st.node, len(st.launches), [L.entry for L in st.launches]] for st in rec.nodes]


@pytest.fixture(scope="module")
def desktop(tmp_path_factory):
    from conformance.executors import probe_device
    from gpudelegate.webgpu.lowering import Tuning

    ok, reason = probe_device("wgpu")()
    assert ok, f"desktop wgpu is needed for the comparison: {reason}"
    path = tmp_path_factory.mktemp("fusion") / "fusion.gdp"
    prog = _program(path)
    rng = np.random.default_rng(1)
    inputs = {m: rng.standard_normal((1, T, D)).astype(np.float32) for m in prog.methods}
    with gpudelegate.Environment() as env, env.session(prog, device="wgpu", tuning=Tuning(**TUNING)) as s:
        rec = {str(p): {"dispatch_count": r.dispatch_count, "steps": _steps(r)} for p, r in s.executor.recorded.items()}
        layouts = [b.layout for b in s.plan.prepack.buffers]
        outs = {m: np.asarray(s.run(m, [x])[0]) for m, x in inputs.items()}
    return {"bytes": path.read_bytes(), "recorded": rec, "layouts": layouts, "inputs": inputs, "outputs": outs}


@pytest.fixture(scope="module")
def page_result(harness, desktop):
    feeds = {m: {"shape": list(x.shape), "data": base64.b64encode(x.tobytes()).decode()}
             for m, x in desktop["inputs"].items()}
    return harness(PAGE, {"program": base64.b64encode(desktop["bytes"]).decode(), "tuning": TUNING, "inputs": feeds})


def test_desktop_program_has_fused_siblings_and_fp16_packing(desktop):
    """The program exercises both: otherwise equal counts would prove nothing."""
    fused = [st for r in desktop["recorded"].values() for st in r["steps"] if st[0] == "linear" and st[2] == 0]
    assert len(fused) >= 2, f"no sibling linear was folded into another's kernel: {desktop['recorded']}"
    assert "fp16" in desktop["layouts"] and "identity" in desktop["layouts"], desktop["layouts"]


def test_page_dispatches_equal_desktop(page_result, desktop):
    assert page_result["executor"] == "gpudelegate.webgpu.executor.WebGPUExecutor"
    assert page_result["data"] == "JsBytes"  # the data segment stayed in JS memory
    assert page_result["layouts"] == desktop["layouts"]
    assert sorted(page_result["recorded"]) == sorted(desktop["recorded"])
    for p, want in desktop["recorded"].items():
        got = page_result["recorded"][p]
        assert got["dispatch_count"] == want["dispatch_count"], (p, got, want)
        assert got["steps"] == want["steps"], p


def test_page_outputs_equal_desktop(page_result, desktop):
    """Same kernels on the same fp16-packed weights: the results agree to float32 rounding (the
    two WGSL compilers may contract multiply-adds differently)."""
    for m, want in desktop["outputs"].items():
        got = np.frombuffer(base64.b64decode(page_result["outputs"][m]), np.float32).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=m)
