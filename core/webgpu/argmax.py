"""The kernel calls of ``WebGPUExecutor.argmax_device`` (shaders/argmax.wgsl): the argmax of one
float32 vector into a one-word int32 buffer, a greedy decode's pick kept on the GPU (pure Python).

The calls name their buffers by space, resolved by the executor: ``"logits"`` (the vector's
buffer), ``"argmax_scratch"`` (the partial results, :data:`SCRATCH_BYTES`) and ``"argmax_out"``
(the index, 4 bytes).
"""

from __future__ import annotations

import struct
from typing import List

from ..plan.types import BufferRef
from .kernel import KernelCall, Binding

SHADER = "argmax.wgsl"
WG = 256  # threads per workgroup (argmax.wgsl's WG)
# argmax_final reduces one partial result per thread of its single workgroup.
MAX_PARTS = WG
SCRATCH_BYTES = 8 * MAX_PARTS  # (value bits, index) per part
# Elements each argmax_part thread reads at least: few enough that the loads of a 49,152-entry
# vocabulary spread over ~50 workgroups (one pass of a few loads each, not ~200 dependent trips
# of a single workgroup), many enough that argmax_final stays one workgroup.
PER_THREAD = 4


def parts(n: int) -> int:
    """Workgroups of argmax_part for ``n`` elements."""
    return min(MAX_PARTS, max(1, -(-n // (WG * PER_THREAD))))


def argmax_calls(offset: int, n: int, alignment: int, label: str) -> List[KernelCall]:
    """The two dispatches for ``n`` float32 values at byte ``offset`` of the ``"logits"`` buffer.
    Storage bindings start at a multiple of ``alignment`` (minStorageBufferOffsetAlignment), so
    the vector's first element is passed as an element offset inside its binding."""
    if n <= 0 or offset % 4:
        raise ValueError(f"argmax of {n} float32 values at byte offset {offset}")
    base = offset // alignment * alignment
    end = offset + 4 * n
    k = parts(n)
    uniform = struct.pack("<4I", n, (offset - base) // 4, k, 0)
    bindings = [Binding(1, BufferRef("argmax_scratch", 0, 0, 8 * k)),
                Binding(2, BufferRef("logits", 0, base, end - base)),
                Binding(3, BufferRef("argmax_out", 0, 0, 4))]
    return [KernelCall(SHADER, "argmax_part", {}, uniform, bindings, (k, 1, 1), f"{label} argmax_part"),
            KernelCall(SHADER, "argmax_final", {}, uniform, bindings, (1, 1, 1), f"{label} argmax_final")]
