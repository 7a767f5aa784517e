"""Two source trees, one benchmark, one table: is the new commit as fast as the old one?

    python benchmarks/ab_compare.py --old OLD_TREE --new NEW_TREE \
        --bench bench_wgpu.py --args "--sections minilm,smollm2" [--rounds 2] [--out FILE.md]

Runs ``benchmarks/<bench>`` from each tree (each tree imports its own gpudelegate: the scripts
import the package from their own source tree when it is not installed), alternating new, old,
new, old ... so a lent machine's drift lands on both sides, then prints every row of the
benchmark's JSON with the new figure, the old one, and new/old of the leading numbers. Rows whose
figures are not numbers (notes, refusals) are shown as they are. The same-tree spread (the two
rounds of one tree) is printed too: a difference smaller than it is noise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

_NUM = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def lead_number(text: str) -> Optional[float]:
    m = _NUM.search(str(text))
    return float(m.group(0)) if m else None


def run_once(tree: Path, bench: str, args: List[str], timeout: float,
             pythonpath: str = "") -> Tuple[Dict[Tuple[str, str], str], float]:
    """Run the benchmark in ``tree`` (``pythonpath`` first on PYTHONPATH: where that tree's
    gpudelegate is installed); returns {(section, metric): our figure} and its wall time."""
    tree = tree.resolve()  # the script runs with cwd=tree: a relative path would resolve twice
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(tree / "benchmarks" / bench), "--out", out, *args],
                              cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t0
        files = sorted(Path(out).glob("*.json"))
        if proc.returncode != 0 or not files:
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise SystemExit(f"{bench} in {tree} failed (exit {proc.returncode}):\n{tail}")
        rows = json.loads(files[0].read_text())["rows"]
    return {(r[0], r[1]): r[2] for r in rows}, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, type=Path, help="source tree of the old commit")
    ap.add_argument("--new", required=True, type=Path, help="source tree of the new commit")
    ap.add_argument("--old-pythonpath", default="", help="where the old tree's gpudelegate is installed (PYTHONPATH)")
    ap.add_argument("--new-pythonpath", default="", help="where the new tree's gpudelegate is installed (PYTHONPATH)")
    ap.add_argument("--bench", required=True, help="script under benchmarks/ (it must take --out DIR and write JSON rows)")
    ap.add_argument("--args", default="", help="arguments passed to the benchmark script")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternated")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    ap.add_argument("--out", type=Path, help="write the table (markdown) here too")
    a = ap.parse_args()
    runs: Dict[str, List[Dict[Tuple[str, str], str]]] = {"new": [], "old": []}
    walls: Dict[str, List[float]] = {"new": [], "old": []}
    for r in range(a.rounds):
        for side in ("new", "old"):
            print(f"round {r + 1}/{a.rounds}: {a.bench} on the {side} tree ...", flush=True)
            got, wall = run_once(getattr(a, side), a.bench, a.args.split(), a.timeout, getattr(a, f"{side}_pythonpath"))
            runs[side].append(got)
            walls[side].append(wall)
    keys = list(runs["new"][0]) + [k for k in runs["old"][0] if k not in runs["new"][0]]
    lines = [f"# A/B: {a.bench} {a.args}".rstrip(), "",
             f"new = `{a.new}`, old = `{a.old}`; {a.rounds} alternated rounds each "
             f"(wall {sum(walls['new']):.0f} s new, {sum(walls['old']):.0f} s old). Figures: median-of-script "
             "values of each round, first round | second round; ratio = new/old of the means of the leading numbers "
             "(for times lower is better, for rates higher is better); spread = max/min across one tree's rounds.", "",
             "| section | metric | new | old | new/old | spread new | spread old |", "|---|---|---|---|---|---|---|"]
    for k in keys:
        new = [x.get(k, "") for x in runs["new"]]
        old = [x.get(k, "") for x in runs["old"]]
        nn = [v for v in (lead_number(x) for x in new) if v is not None]
        on = [v for v in (lead_number(x) for x in old) if v is not None]
        ratio = spread_n = spread_o = ""
        if nn and on and sum(on):
            ratio = f"{(sum(nn) / len(nn)) / (sum(on) / len(on)):.3f}"
        if len(nn) > 1 and min(nn) > 0:
            spread_n = f"{max(nn) / min(nn):.3f}"
        if len(on) > 1 and min(on) > 0:
            spread_o = f"{max(on) / min(on):.3f}"
        lines.append(f"| {k[0]} | {k[1]} | {' / '.join(new)} | {' / '.join(old)} | {ratio} | {spread_n} | {spread_o} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)


if __name__ == "__main__":
    main()
