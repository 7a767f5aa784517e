"""What crosses the device protocol: buffer usages, the recorded commands of a chain (copies and
launches, grouped by the plan's dispatch), and a run's host side. Plain data, no device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple


class BufferUsage:
    """``GPUBufferUsage`` flags; the spec fixes the values."""

    MAP_READ = 0x0001
    MAP_WRITE = 0x0002
    COPY_SRC = 0x0004
    COPY_DST = 0x0008
    UNIFORM = 0x0040
    STORAGE = 0x0080
    QUERY_RESOLVE = 0x0200


STORAGE_USAGE = BufferUsage.STORAGE | BufferUsage.COPY_SRC | BufferUsage.COPY_DST


@dataclass
class Launch:
    """One recorded dispatch: a compute pipeline, its bind group, the workgroup counts."""

    pipeline: Any
    bind_group: Any
    workgroups: Tuple[int, int, int]
    entry: str = ""  # "shader:entry", for profiles and tests


@dataclass
class Copy:
    """``copyBufferToBuffer`` recorded in a chain (an offload load: host mirror -> ring slot)."""

    src: Any
    src_offset: int
    dst: Any
    dst_offset: int
    size: int


@dataclass
class Step:
    """The commands of one dispatch of a plan: copies first (they end the compute pass), then
    the launches. ``op``/``node`` name it in profiles."""

    op: str
    node: int
    copies: List[Copy] = field(default_factory=list)
    launches: List[Launch] = field(default_factory=list)


@dataclass
class RunIO:
    """A run's host side around a recorded chain: ``writes`` (buffer, offset, bytes) go in with
    ``write_buffer`` before it, ``copies`` (device-tensor inputs) are encoded before it, and
    ``reads`` (buffer, offset, nbytes) are copied into one staging buffer after it and returned
    (``None``: nothing is read back, the outputs stay on the device)."""

    writes: List[Tuple[Any, int, Any]] = field(default_factory=list)
    copies: List[Copy] = field(default_factory=list)
    reads: Optional[List[Tuple[Any, int, int]]] = None


def round4(n: int) -> int:
    """A buffer or copy size: WebGPU wants multiples of 4 bytes (and no empty buffers)."""
    return max(4, (n + 3) // 4 * 4)
