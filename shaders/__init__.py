"""Kernel sources (WGSL shared by the wgpu and browser executors; CUDA sources for CuPy)."""
from pathlib import Path

_HERE = Path(__file__).parent


def source(name: str) -> str:
    """Return the text of kernel file ``name`` (e.g. ``"elementwise.wgsl"``)."""
    return (_HERE / name).read_text()


def names() -> list:
    return sorted(p.name for p in _HERE.iterdir() if p.suffix in (".wgsl", ".cu"))
