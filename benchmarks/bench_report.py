"""What the executor benchmarks (bench_cuda.py, bench_wgpu.py) share: the results table, the
section runner that records a failure and goes on, and the result files (``<OUT>/<kind>_<device>``
``.md`` and ``.json``), written after every section so that a run cut short keeps what it measured.

Imported as ``bench_report`` (benchmarks/ is on ``sys.path`` when a script of it runs, and the
tests that import the benchmarks put it there)."""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: Optional[Sequence[str]], doc: str, kind: str, small_flag: str, small_help: str,
               sections: str) -> argparse.Namespace:
    """The command line of ``bench_<kind>.py``: ``--out`` (the folder :func:`result_writer` writes
    to), ``small_flag`` (small shapes) and ``--sections`` (default ``sections``); the description is
    the first line of the script's ``doc``."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS), help=f"folder for {kind}_<device>.{{md,json}}")
    ap.add_argument(small_flag, action="store_true", help=small_help)
    ap.add_argument("--sections", default=sections)
    return ap.parse_args(argv)


class Report:
    """Rows of the results table (each printed as it comes), free-form ``data`` for the JSON file
    (keys starting with ``_`` hold objects for later sections and are not written), and the
    errors of the sections that failed. ``columns``: (key, heading) of each cell of a row."""

    def __init__(self, columns: Sequence[Tuple[str, str]]):
        self.columns = list(columns)
        self.rows: List[tuple] = []
        self.data: Dict[str, object] = {}
        self.errors: List[str] = []

    def row(self, *cells, **named) -> None:
        """One row: cells in column order, then any later ones by key; those left out are empty."""
        keys = [k for k, _ in self.columns]
        if len(cells) > len(keys) or set(named) - set(keys[len(cells):]):
            raise TypeError(f"row{cells} {named}: the columns are {keys}")
        row = tuple(cells) + tuple(named.get(k, "") for k in keys[len(cells):])
        self.rows.append(row)
        print("  " + " | ".join(str(c) for c in row), flush=True)

    def table(self) -> str:
        head = "| " + " | ".join(h for _, h in self.columns) + " |\n|" + "---|" * len(self.columns) + "\n"
        return head + "\n".join("| " + " | ".join(str(c) for c in r) + " |" for r in self.rows)


def section(rep: Report, name: str, fn: Callable[[], object]) -> None:
    """Run a section; a failure is recorded (with its traceback in the log) and the run goes on."""
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:
        traceback.print_exc()
        rep.errors.append(f"{name}: {type(e).__name__}: {e}")
        rep.row(name, "FAILED", f"{type(e).__name__}: {str(e)[:160]}")
    print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)


def result_writer(rep: Report, out_dir, kind: str, device: str, flag: str, heading: str,
                  versions: str) -> Callable[..., str]:
    """``write(final=False)``: the results so far to ``out_dir/<kind>_<device slug>[_<flag>].md``
    (a title, then the table) and ``.json`` (rows and data, with the run's seconds and errors);
    returns the title. The title names the command (``benchmarks/bench_<kind>.py [flag]``),
    ``versions`` and Python's version, and says whether the run is complete."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "_" for c in device).strip("_").lower()[:60]
    stem = f"{kind}_{slug}" + (f"_{flag.lstrip('-')}" if flag else "")
    command = f"python benchmarks/bench_{kind}.py" + (f" {flag}" if flag else "")
    t_all = time.perf_counter()

    def write(final: bool = False) -> str:
        rep.data["seconds"] = time.perf_counter() - t_all
        rep.data["errors"] = rep.errors
        title = (f"# {heading}: {device}\n\n{versions}, Python {platform.python_version()}; `{command}`, "
                 f"{rep.data['seconds']:.0f} s{'' if final else ' (incomplete run)'}. Seeded random weights; "
                 f"medians of timed repeats after warm-up; one run.\n\n")
        (out / f"{stem}.md").write_text(title + rep.table() + "\n")
        data = {k: v for k, v in rep.data.items() if not k.startswith("_")}
        (out / f"{stem}.json").write_text(json.dumps({"rows": rep.rows, **data}, indent=1, default=str))
        return title

    return write


def finish(rep: Report, write: Callable[..., str]) -> int:
    """Write the final results, print the whole table; the exit status (1 if a section failed)."""
    title = write(final=True)
    print()
    print(title + rep.table())
    return 1 if rep.errors else 0
