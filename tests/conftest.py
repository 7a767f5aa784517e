"""Test folders (tests/core, webgpu, cuda, export, conformance, browser, api, repo) share two
helpers: the conformance package (tests/conformance) and the program builder
(tests/core/progbuild.py, which lives with the core tests because Pyodide runs that folder)."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE / "core"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

# Dawn's contexts in the tests get the toggles that unlock its fast paths (host-memory uploads,
# subgroup matrices, f16 on NVIDIA): the paths the GPU machine runs. Toggles are per process, so the
# toggle-less defaults are checked in a subprocess (tests/webgpu/test_dawn_device.py).
os.environ.setdefault("GPUDELEGATE_DAWN_TOGGLES", "allow_unsafe_apis,vulkan_enable_f16_on_nvidia")


def pytest_terminal_summary(terminalreporter):
    """The conformance suite's edge samples per op (tests/conformance/edges.py), printed whenever
    a run imported the cases (the conformance suite, the browser's, the tests that share them)."""
    edges = sys.modules.get("conformance.edges")
    if edges is not None and edges.SUMMARY:
        terminalreporter.write_sep("-", "conformance edge samples")
        terminalreporter.write_line(edges.summary())


# Executors whose conformance cases run as a deterministic sample (tests/run_all.sh sets it for
# Dawn on lavapipe, where the whole suite takes ~8 minutes of a 2-core CI machine): every op's
# first case, edge samples among them, plus one case in SAMPLE_EVERY chosen by a hash of its id.
# The GPU machine runs them all (benchmarks/gpu_machine.sh tests leaves the variable unset).
SUBSET_ENV = "GPUDELEGATE_CONFORMANCE_SUBSET"
SAMPLE_EVERY = 5


def pytest_collection_modifyitems(config, items):
    import os
    import zlib

    names = {n for n in os.environ.get(SUBSET_ENV, "").split(",") if n}
    if not names:
        return
    keep, drop, seen = [], [], set()
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        spec, case = params.get("spec"), params.get("case")
        if getattr(spec, "name", None) not in names or case is None:
            keep.append(item)
            continue
        key = (item.originalname, spec.name, tuple(case.op_names))
        if key not in seen or zlib.crc32(case.id.encode()) % SAMPLE_EVERY == 0:
            seen.add(key)
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
