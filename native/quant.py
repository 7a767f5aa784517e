"""Packed (GGUF block) weights on the host: what the numpy reference computes with, and the
checks export runs. The blocks are decoded by the ``gguf`` package itself (llama.cpp's own Python
reader), so the reference's dequantized values are gguf's by construction; the GPU kernels decode
the same bytes on their own and are held to these values (``tests/conformance``)."""

from __future__ import annotations

from typing import Tuple

import numpy as np

from gpudelegate import dtypes as _dt

GGML_TYPE = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0"}  # our dtype -> GGMLQuantizationType name
DTYPE_OF_GGML = {v: k for k, v in GGML_TYPE.items()}


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - gguf is a dependency of the native extra
        raise ImportError("packed weights need the gguf package on the host: pip install 'gguf>=0.10'") from None
    return gguf


def ggml_type(dtype: str):
    return getattr(_gguf().GGMLQuantizationType, GGML_TYPE[dtype])


def byte_shape(dtype: str, shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The uint8 array shape of a packed tensor: its rows, then each row's bytes."""
    return tuple(shape[:-1]) + (_dt.packed_row_bytes(dtype, shape[-1]),)


class PackedWeight:
    """A packed tensor's bytes (a view of a device buffer or a constant) with its logical shape.
    Kernels that read packed weights call :meth:`dequantize`; nothing else accepts one."""

    __slots__ = ("dtype", "shape", "raw")

    def __init__(self, dtype: str, shape: Tuple[int, ...], raw: np.ndarray):
        self.dtype, self.shape, self.raw = dtype, tuple(shape), raw.reshape(byte_shape(dtype, shape))

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def dequantize(self) -> np.ndarray:
        """float32 values, bit for bit what ``gguf.quants.dequantize`` gives."""
        if self.raw.size == 0:
            return np.zeros(self.shape, np.float32)
        return np.asarray(_gguf().quants.dequantize(self.raw, ggml_type(self.dtype)), dtype=np.float32).reshape(self.shape)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows ``ids`` of a [V, D] table (only those rows are decoded)."""
        if ids.size == 0 or self.shape[-1] == 0:
            return np.zeros(tuple(ids.shape) + (self.shape[-1],), np.float32)
        picked = self.raw[ids.reshape(-1)]
        out = np.asarray(_gguf().quants.dequantize(picked, ggml_type(self.dtype)), dtype=np.float32)
        return out.reshape(tuple(ids.shape) + (self.shape[-1],))


def quantize(dtype: str, w: np.ndarray) -> np.ndarray:
    """Pack float weights (last dim a multiple of 32) into ``dtype`` blocks: uint8 of byte_shape."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    return np.ascontiguousarray(_gguf().quants.quantize(w, ggml_type(dtype)))


def dequantize(dtype: str, raw: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    return PackedWeight(dtype, shape, np.asarray(raw, dtype=np.uint8)).dequantize()
