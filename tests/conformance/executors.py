"""The executors the conformance suite holds to the reference kernels.

An executor joins by appending an :class:`ExecutorSpec` to ``EXECUTORS`` (here, or from its own
module imported below). ``available()`` returns ``(ok, reason)``; an unavailable executor's cases
are skipped with that reason, which ``pytest -rs`` prints, so "no GPU here" is never silent.

``EXECUTORS`` run in this process (``test_conformance.py``). ``IN_PAGE`` executors run in a web
page: the browser's WebGPU (the shared executor over ``gpudelegate.web.webgpu`` in Pyodide, in
headless Chromium) runs the same cases, tolerances and session options from
``tests/browser/test_conformance_browser.py``; ``REGISTRY`` is both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, List, Tuple

from gpudelegate.environment import Environment
from gpudelegate.errors import GpuDelegateError


@dataclass(frozen=True)
class ExecutorSpec:
    name: str  # test id
    device_kind: str  # Environment device kind (env.session(..., device=device_kind))
    available: Callable[[], Tuple[bool, str]]
    session_options: dict = field(default_factory=dict)  # extra env.session keyword arguments
    marks: Tuple[str, ...] = ()  # pytest markers (e.g. "wgpu", "gpu") for selecting runs
    runs_in: str = "process"  # "process": test_conformance.py; "page": tests/browser/ (Playwright)


def probe_device(kind: str) -> Callable[[], Tuple[bool, str]]:
    """``available`` for a device kind: start its context once in a scratch Environment."""

    @functools.lru_cache(maxsize=None)
    def available() -> Tuple[bool, str]:
        env = Environment()
        try:
            env.context(kind)
            return True, ""
        except GpuDelegateError as e:  # DeviceError: module missing, no adapter, no CUDA
            return False, f"device {kind!r} unavailable: {e}"
        finally:
            env.close()

    return available


def probe_page() -> Tuple[bool, str]:
    """``available`` for the in-page executor: what tests/browser/conftest.py needs to open the
    page (a Chromium binary, Pyodide from npm). The device itself is probed in the page."""
    import os
    from pathlib import Path

    chromium = os.environ.get("GPUDELEGATE_CHROMIUM", "/usr/bin/chromium")
    pyodide = Path(__file__).resolve().parents[2] / "web" / "node_modules" / "pyodide"
    if not Path(chromium).exists():
        return False, f"{chromium} is missing: `make apt` installs Debian's chromium"
    if not pyodide.exists():
        return False, f"{pyodide} is missing: run `npm ci --prefix web` (make setup does it)"
    return True, ""


EXECUTORS: List[ExecutorSpec] = [
    ExecutorSpec("reference", "reference", probe_device("reference")),
    ExecutorSpec("wgpu", "wgpu", probe_device("wgpu"), marks=("wgpu",)),
    # Dawn runs in a pytest process of its own (tests/run_all.sh: `-m dawn` with Mesa 25's lavapipe
    # as the only Vulkan driver), so these cases are marked "dawn" and not "wgpu".
    ExecutorSpec("dawn", "dawn", probe_device("dawn"), marks=("dawn",)),
    ExecutorSpec("cuda", "cuda", probe_device("cuda"), marks=("gpu",)),
]

IN_PAGE: List[ExecutorSpec] = [
    # session_options travel to the page as JSON: plain values only.
    ExecutorSpec("browser-webgpu", "webgpu", probe_page, marks=("browser",), runs_in="page"),
]

REGISTRY: List[ExecutorSpec] = EXECUTORS + IN_PAGE


def run_on(env: Environment, case, device: str, tuning=None, atol: float = 1e-5, scaled: bool = False):
    """Run conformance ``case`` on ``device`` with kernel ``tuning``, check every output against
    the float64 golden (rtol 1e-4, atol ``atol`` sqrt(case.red), times the output's largest
    magnitude when ``scaled``: chains of products round with the size of their values), and
    return ``{op: [kernel entry points]}`` of the recorded nodes (WGSL executors)."""
    import numpy as np

    import gpudelegate

    from .cases import build_program, golden, make_data

    data = make_data(case)
    prog, names = build_program(case, data)
    prog = gpudelegate.loads(prog.to_bytes())
    opts = {"tuning": tuning} if tuning is not None else {}
    with env.session(prog, device=device, **opts) as s:
        outs = s.run("forward", [data[n] for n in names])
        by_op = {}
        for n in getattr(s.executor, "recorded", {}).get(0, _NoNodes).nodes:
            by_op.setdefault(n.op, []).extend(L.pipeline.label.split(":")[-1].strip() for L in n.launches)
    for i, (g, w) in enumerate(zip(outs, golden(case, data))):
        scale = float(np.abs(w).max()) if scaled else 1.0
        np.testing.assert_allclose(np.asarray(g).astype(np.float64), w, rtol=1e-4,
                                   atol=atol * scale * case.red ** 0.5, err_msg=f"{case.id} output {i} ({by_op})")
    return by_op


class _NoNodes:
    nodes: list = []


def environment_fixture(kind: str):
    """A module-scoped pytest fixture: an Environment where device ``kind`` starts, else the
    module's tests are skipped with the reason (``pytest -rs`` prints it)."""
    import pytest

    @pytest.fixture(scope="module")
    def env():
        ok, reason = probe_device(kind)()
        if not ok:
            pytest.skip(reason)
        e = Environment()
        yield e
        e.close()

    return env
