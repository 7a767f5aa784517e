"""Test folders (tests/core, webgpu, cuda, export, conformance, browser, api, repo) share two
helpers: the conformance package (tests/conformance) and the program builder
(tests/core/progbuild.py, which lives with the core tests because Pyodide runs that folder)."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE / "core"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def pytest_terminal_summary(terminalreporter):
    """The conformance suite's edge samples per op (tests/conformance/edges.py), printed whenever
    a run imported the cases (the conformance suite, the browser's, the tests that share them)."""
    edges = sys.modules.get("conformance.edges")
    if edges is not None and edges.SUMMARY:
        terminalreporter.write_sep("-", "conformance edge samples")
        terminalreporter.write_line(edges.summary())
