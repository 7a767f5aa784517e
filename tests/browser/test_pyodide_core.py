"""The pure core inside Pyodide (Node, offline): every pure module imports, the core test files
(tests/core/) pass, and numpy/torch/wgpu/cupy are absent there.

One Node run serves all the tests below (Pyodide takes a few seconds to start). The wheelhouse is
built fresh from the working tree by web/build.py, so the wheel under test is the code under test.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tests" / "pyodide" / "run_core_tests.mjs"

sys.path.insert(0, str(ROOT / "web"))
import build as web_build  # noqa: E402  (web/build.py: the bundle builder, CPython-only)


def core_test_files():
    """Every test file of tests/core/ (the folder is what Pyodide runs)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "core").glob("test_*.py"))


@pytest.fixture(scope="module")
def pyodide_run(tmp_path_factory):
    node = shutil.which("node")
    assert node, "node is not installed (make setup installs nodejs via apt)"
    assert web_build.PYODIDE_NPM.exists(), (
        f"{web_build.PYODIDE_NPM} is missing: run `npm ci --prefix web` (make setup does it)")
    house = tmp_path_factory.mktemp("pyodide-wheelhouse")
    web_build.build_wheelhouse(house, test=True)
    files = core_test_files()
    r = subprocess.run([node, str(RUNNER), "--wheelhouse", str(house), "--repo", str(ROOT), *files],
                       cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    summary = None
    for line in r.stdout.splitlines():
        if line.startswith("PYODIDE_SUMMARY "):
            summary = json.loads(line[len("PYODIDE_SUMMARY "):])
    return {"rc": r.returncode, "output": r.stdout, "summary": summary, "files": files}


def _tail(run, n=6000):
    return run["output"][-n:]


def test_pyodide_has_no_heavy_modules(pyodide_run):
    s = pyodide_run["summary"]
    assert s is not None, f"the Pyodide runner printed no summary (exit {pyodide_run['rc']}):\n{_tail(pyodide_run)}"
    assert s["platform"] == "emscripten"
    assert s["python"].startswith("3.14")
    assert "site-packages/gpudelegate" in s["gpudelegate"], s["gpudelegate"]
    assert s["heavy_modules_present"] == [], f"importable in Pyodide: {s['heavy_modules_present']}"
    assert s.get("imported_during_tests", []) == [], (
        f"the core tests imported {s['imported_during_tests']} inside Pyodide")


def test_every_pure_module_imports_in_pyodide(pyodide_run):
    s = pyodide_run["summary"]
    assert s is not None, _tail(pyodide_run)
    assert s["import_errors"] == {}, "modules failing to import in Pyodide:\n" + "\n".join(
        f"  {k}: {v}" for k, v in s["import_errors"].items())
    # The modules the browser runtime needs (wheel packaging must carry them).
    for m in ("gpudelegate.program", "gpudelegate.errors", "gpudelegate.environment"):
        assert m in s["modules_imported"], f"{m} not in the wheel: {s['modules_imported']}"


def test_core_tests_pass_in_pyodide(pyodide_run):
    assert pyodide_run["files"], "no core test file exists yet (tests/core/)"
    s = pyodide_run["summary"]
    assert pyodide_run["rc"] == 0 and s is not None and s["exit_code"] == 0, (
        f"core tests failed inside Pyodide (exit {pyodide_run['rc']}):\n{_tail(pyodide_run)}")
