"""Test folders (tests/core, webgpu, cuda, export, conformance, browser, api, repo) share two
helpers: the conformance package (tests/conformance) and the program builder
(tests/core/progbuild.py, which lives with the core tests because Pyodide runs that folder)."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE / "core"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
