"""Kernel sources (WGSL shared by the wgpu and browser executors; CUDA sources for CuPy).

``source(name)`` returns a file's text ready to compile: a WGSL line ``//! include other.wgsl``
is replaced by that file's text (once per file, so a prelude can be included from several
places). WGSL has no include of its own; doing it here keeps one copy of the shared helpers and
gives the browser and the desktop executor the very same code.
"""
from functools import lru_cache
from pathlib import Path

_HERE = Path(__file__).parent
_INCLUDE = "//! include "


def raw_source(name: str) -> str:
    """The text of kernel file ``name`` as stored (includes not expanded)."""
    return (_HERE / name).read_text()


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """Return the text of kernel file ``name`` (e.g. ``"elementwise.wgsl"``), includes expanded."""
    if not name.endswith(".wgsl"):
        return raw_source(name)
    seen = set()
    return _expand(name, seen)


def _expand(name: str, seen: set) -> str:
    if name in seen:
        return ""
    seen.add(name)
    out = []
    for line in raw_source(name).splitlines():
        if line.startswith(_INCLUDE):
            inc = line[len(_INCLUDE):].strip()
            out.append(f"// ---- begin {inc}")
            out.append(_expand(inc, seen))
            out.append(f"// ---- end {inc}")
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def names() -> list:
    return sorted(p.name for p in _HERE.iterdir() if p.suffix in (".wgsl", ".cu"))
