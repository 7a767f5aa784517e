"""The greedy pick on the GPU in the page (``WebGPUExecutor.argmax_device``, shaders/argmax.wgsl,
the browser's ``submit_read``: a mapAsync per pick, started at its submit): the index of each
vector equals numpy's argmax (torch.argmax's rule: first of equal maxima, first NaN), and two
picks submitted before either is read each read their own value, not the later work's."""

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
