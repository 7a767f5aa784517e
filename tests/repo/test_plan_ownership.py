"""The core plans, executors carry out: every planning decision lives in core/plan/ and nowhere
else (offload load positions, arena and weight layouts, fusion matches). Checked on the source
tree, so it runs in CPython only (tests/core/ is what Pyodide runs)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXECUTOR_DIRS = [ROOT / "native", ROOT / "web", ROOT / "core" / "webgpu"]
# The planners' entry points and helpers: defined in core/plan/ only.
PLANNING = ("load_position", "check_loads", "plan_offload", "pack_offsets", "plan_layout", "plan_memory",
            "plan_prepack", "match", "cat_candidates", "epilogue_fusions", "sdpa_folds", "sibling_groups",
            "fusion_lifetimes")


def test_only_the_planner_computes_load_positions():
    """Executors read ``OffloadLoad.at``; none of them works the position out again from
    ``reuse_after`` (in any spelling: ``ld.reuse_after + 1``, ``getattr(ld, "reuse_after", -1) + 1``)."""
    root = Path(__file__).resolve().parents[2]
    dirs = [root / "native", root / "web", root / "core" / "webgpu"]
    pattern = re.compile(r"reuse_after\b[^\n]{0,24}?\+\s*1\b")
    offenders = []
    for d in dirs:
        for folder, subdirs, files in os.walk(d):
            subdirs[:] = sorted(s for s in subdirs if s not in ("node_modules", "__pycache__"))  # third-party, built
            for name in sorted(files):
                f = Path(folder) / name
                if f.suffix not in (".py", ".js", ".mjs", ".ts", ".wgsl"):
                    continue
                for i, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                    if pattern.search(line):
                        offenders.append(f"{f.relative_to(root)}:{i}: {line.strip()}")
    assert not offenders, "load positions computed outside core/plan:\n" + "\n".join(offenders)
    # the pattern does catch the formula the executors used to carry
    assert pattern.search("t = max(ld.issue_before, ld.reuse_after + 1)")
    assert pattern.search('t = max(ld.issue_before, getattr(ld, "reuse_after", -1) + 1)')



def _defs(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_planning_helpers_are_defined_only_in_core_plan():
    where = {}
    for d in [ROOT / "core", ROOT / "native", ROOT / "web", ROOT / "export"]:
        for f in sorted(d.rglob("*.py")):
            if "node_modules" in f.parts:
                continue
            for name in _defs(f) & set(PLANNING):
                where.setdefault(name, []).append(f.relative_to(ROOT).as_posix())
    outside = {n: fs for n, fs in where.items() if any(not f.startswith("core/plan/") for f in fs)}
    assert not outside, f"planning helpers defined outside core/plan/: {outside}"
    assert set(where) == set(PLANNING), f"not found in core/plan/: {sorted(set(PLANNING) - set(where))}"


def test_executors_take_fusion_and_layout_from_the_plan():
    """The CUDA executor and the WebGPU lowering import their fusion decisions and the CUDA
    executor its layout from gpudelegate.plan, and no executor module keeps a matcher of its own."""
    cuda = (ROOT / "native" / "cuda_executor.py").read_text(encoding="utf-8")
    lowering = (ROOT / "core" / "webgpu" / "lowering.py").read_text(encoding="utf-8")
    assert "plan.fusion" in cuda and "plan.layout" in cuda
    assert "plan.fusion" in lowering
    assert not (ROOT / "native" / "cuda_fusion.py").exists()
