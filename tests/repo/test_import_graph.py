"""No import cycles among gpudelegate's modules.

Every Python module under core/ (``gpudelegate``), native/ (``gpudelegate.native``), web/
(``gpudelegate.web``) and export/ (``gpudelegate.export``) is parsed, and every import statement
in it (module level, inside functions and classes, under ``if TYPE_CHECKING``, in ``try``: all of
them, since a lazy import only hides a cycle until the function runs) becomes an edge to the
module it names: ``from A import b`` names ``A.b`` when that is a module of ours, else ``A``.
Imports of other packages (numpy, torch, js, ...) are not edges. Nothing is excluded.

The one implicit dependency that is not an edge is a module's own parent packages: importing
``gpudelegate.plan.types`` first runs ``gpudelegate/plan/__init__.py``, and a package's
``__init__`` importing its own submodules is how packages work, not a design cycle (counting it
would make every package with an ``__init__`` that re-exports a cycle). Dynamic imports
(``importlib.import_module``) are not statements and are not seen.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Dict, List, Optional, Set

ROOT = Path(__file__).resolve().parents[2]
TREES = {"core": "gpudelegate", "native": "gpudelegate.native", "web": "gpudelegate.web",
         "export": "gpudelegate.export"}
SKIP_DIRS = {"node_modules", "__pycache__", "app"}  # web/app: JS and HTML of the browser demo


def modules() -> Dict[str, Path]:
    """Module name -> file, for every .py file of the four trees."""
    out: Dict[str, Path] = {}
    for tree, pkg in TREES.items():
        base = ROOT / tree
        for folder, subdirs, files in os.walk(base):
            subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS)
            rel = Path(folder).relative_to(base).parts
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                parts = list(rel) + ([] if name == "__init__.py" else [name[:-3]])
                out[".".join([pkg] + parts)] = Path(folder) / name
    return out


def _resolve(mod: str, is_package: bool, node: ast.ImportFrom) -> Optional[str]:
    """The absolute module an ``ImportFrom`` starts from."""
    if not node.level:
        return node.module
    base = mod.split(".") if is_package else mod.split(".")[:-1]
    if node.level > 1:
        base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges(mods: Dict[str, Path]) -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, is_package, node)
                if src is None:
                    continue
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    targets.append(sub if sub in mods else src)
            for t in targets:
                # `import gpudelegate.plan.types` names the deepest module of ours in the path
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a list."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (a few hundred)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _path_in(comp: List[str], graph: Dict[str, Set[str]]) -> List[str]:
    """One concrete cycle inside a component, for the failure message."""
    members = set(comp)
    start = comp[0]
    prev = {start: None}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev:
                prev[w] = v
                todo.append(w)
    return comp


def test_the_walk_sees_every_tree_and_every_kind_of_import():
    mods = modules()
    for pkg in TREES.values():
        assert pkg in mods, f"{pkg} not found"
    graph = edges(mods)
    # a module-level relative import, a function-level one and an absolute one are all edges
    assert "gpudelegate.errors" in graph["gpudelegate.program"]
    assert "gpudelegate.plan" in graph["gpudelegate.session"]  # imported inside Session.build
    assert "gpudelegate.executor" in graph["gpudelegate.native.reference"]


def test_there_are_no_import_cycles():
    graph = edges(modules())
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(_path_in(c, graph)) for c in found)


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert _path_in(["a", "b", "c"], graph) == ["a", "b", "c", "a"]
