"""Kernel sources (WGSL shared by the wgpu and browser executors; CUDA sources for CuPy).

``source(name)`` returns a file's text ready to compile: a WGSL line ``//! include other.wgsl``
is replaced by that file's text (once per file, so a prelude can be included from several
places). WGSL has no include of its own; doing it here keeps one copy of the shared helpers and
gives the browser and the desktop executor the very same code.

Two files are partly generated: matmul_sgmat.wgsl's line ``//! generate matmul_sgmat`` is
replaced by the entry points that matmul_sgmat.py writes out per tile shape, attention_sgmat.wgsl's
``//! generate attn_sgmat`` by those attn_sgmat.py writes per head-dim pair (straight-line code
WGSL has no macros for). No other file has such a line.
"""
from functools import lru_cache
from pathlib import Path

_HERE = Path(__file__).parent
_INCLUDE = "//! include "
_GENERATE = "//! generate "


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
        elif line.startswith(_GENERATE):
            out.append(_generated(line[len(_GENERATE):].strip()))
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def _generated(what: str) -> str:
    if what not in ("matmul_sgmat", "attn_sgmat"):
        raise ValueError(f"no generator {what!r} for a //! generate line")
    from importlib import import_module

    return import_module(f".{what}", __name__).entry_points()


def names() -> list:
    return sorted(p.name for p in _HERE.iterdir() if p.suffix in (".wgsl", ".cu"))
