"""The core must run where numpy, torch, wgpu and cupy do not exist (the browser): every core
module imports with them blocked, and the core test files pass in that interpreter."""

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORBIDDEN = ("numpy", "torch", "wgpu", "cupy", "cupyx", "js", "pyodide", "transformers")

BLOCKER = textwrap.dedent(f"""
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {FORBIDDEN!r}:
                raise ImportError(f"{{name}} is blocked: the core must not need it")
            return None
    sys.meta_path.insert(0, Block())
""")


def core_modules():
    for p in sorted((ROOT / "core").rglob("*.py")):
        rel = p.relative_to(ROOT / "core").with_suffix("")
        parts = [x for x in rel.parts if x != "__init__"]
        yield ".".join(["gpudelegate", *parts]) if parts else "gpudelegate"


def core_test_files():
    """Every test file of tests/core/: what Pyodide runs, so what must pass without numpy."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "core").glob("test_*.py"))


def test_no_module_level_import_of_device_libraries():
    bad = []
    for p in (ROOT / "core").rglob("*.py"):
        tree = ast.parse(p.read_text())
        for node in tree.body:  # module level only: lazy imports inside functions are the way out
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            bad += [f"{p.relative_to(ROOT)}: import {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not bad, bad


def test_core_imports_and_core_tests_pass_with_numpy_blocked():
    files = core_test_files()
    assert files, "tests/core/ holds no test file"
    mods = list(core_modules())
    code = BLOCKER + textwrap.dedent(f"""
        import importlib
        for m in {mods!r}:
            importlib.import_module(m)
        import pytest
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-x", *{files!r}]))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert " passed" in r.stdout
