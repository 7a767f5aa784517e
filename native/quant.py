"""Packed (GGUF block) weights on the host: what the numpy reference computes with, and the
checks export runs. The blocks are decoded by the ``gguf`` package itself (llama.cpp's own Python
reader), so the reference's dequantized values are gguf's by construction; the GPU kernels decode
the same bytes on their own and are held to these values (``tests/conformance``)."""

from __future__ import annotations

import hashlib
from typing import Any, Dict, Optional, Tuple

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
    Kernels that read packed weights call :meth:`dequantize`; nothing else accepts one.

    ``cache``/``key``: where the dequantized values may be kept between calls, for bytes that do
    not change once written (the reference's resident weight buffers: decoding every weight through
    gguf on every run would make a 4-bit LLM ~100x slower than its float32 program). The owner of
    the bytes clears ``cache`` whenever it writes them; a view of bytes that are re-filled while it
    lives (an offload slot) must be made without a cache."""

    __slots__ = ("dtype", "shape", "raw", "cache", "key")

    def __init__(self, dtype: str, shape: Tuple[int, ...], raw: np.ndarray, cache: Optional[Dict[Any, np.ndarray]] = None,
                 key: Any = None):
        self.dtype, self.shape, self.raw = dtype, tuple(shape), raw.reshape(byte_shape(dtype, shape))
        self.cache, self.key = cache, key

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def _decode(self, raw: np.ndarray) -> np.ndarray:
        return np.asarray(_gguf().quants.dequantize(raw, ggml_type(self.dtype)), dtype=np.float32)

    def dequantize(self) -> np.ndarray:
        """float32 values, bit for bit what ``gguf.quants.dequantize`` gives (read-only when cached:
        kernels share the array)."""
        if self.cache is not None and self.key in self.cache:
            return self.cache[self.key]
        if self.raw.size == 0:
            out = np.zeros(self.shape, np.float32)
        else:
            out = self._decode(self.raw).reshape(self.shape)
        if self.cache is not None:
            out.flags.writeable = False
            self.cache[self.key] = out
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows ``ids`` of a [V, D] table (only those rows are decoded, unless the
        whole table is already in the cache)."""
        if ids.size == 0 or self.shape[-1] == 0:
            return np.zeros(tuple(ids.shape) + (self.shape[-1],), np.float32)
        if self.cache is not None and self.key in self.cache:
            return self.cache[self.key][ids]
        out = self._decode(self.raw[ids.reshape(-1)])
        return out.reshape(tuple(ids.shape) + (self.shape[-1],))


def quantize(dtype: str, w: np.ndarray) -> np.ndarray:
    """Pack float weights (last dim a multiple of 32) into ``dtype`` blocks: uint8 of byte_shape."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    return np.ascontiguousarray(_gguf().quants.quantize(w, ggml_type(dtype)))


def dequantize(dtype: str, raw: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    return PackedWeight(dtype, shape, np.asarray(raw, dtype=np.uint8)).dequantize()


def weight_key(w) -> str:
    """The key of a float weight in an export's ``packed_weights``: SHA-256 (hex) of its values as
    C-contiguous float32 bytes. Content, not identity: the torch module, the exported graph and
    each method hold their own copies of one weight."""
    a = np.ascontiguousarray(np.asarray(w), dtype=np.float32)
    return hashlib.sha256(_dt.byte_view(a)).hexdigest()


def as_blocks(dtype: str, raw, shape: Tuple[int, ...]) -> Tuple[Optional[np.ndarray], str]:
    """``raw`` (bytes or a uint8 array) as the uint8 array of ``dtype`` blocks for ``shape``, or
    (None, why it cannot be)."""
    if dtype not in _dt.QUANT_BLOCKS:
        return None, f"dtype {dtype!r} is not a packed type (known: {', '.join(_dt.PACKED_DTYPES)})"
    why = _dt.packed_shape_error(dtype, shape)
    if why:
        return None, why
    if isinstance(raw, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(raw, dtype=np.uint8)
    else:
        arr = np.asarray(raw)
        if arr.dtype != np.uint8:
            return None, f"blocks are {arr.dtype}, not uint8 bytes"
    want = _dt.nbytes(dtype, shape)
    if arr.nbytes != want:
        return None, (f"{arr.nbytes} bytes of blocks for {dtype}{list(shape)}, which needs {want} "
                      f"({_dt.numel(shape) // _dt.QUANT_BLOCKS[dtype][0]} blocks of {_dt.QUANT_BLOCKS[dtype][1]} bytes)")
    return np.ascontiguousarray(arr).reshape(byte_shape(dtype, shape)), ""


def mismatch(dtype: str, blocks: np.ndarray, w: np.ndarray) -> str:
    """Why ``blocks`` do not dequantize (with gguf) to exactly the float32 values ``w`` ("" when
    they do, bit for bit: -0.0 and 0.0 differ, a NaN must be the same NaN)."""
    got = dequantize(dtype, blocks, tuple(w.shape))
    want = np.ascontiguousarray(w, dtype=np.float32)
    diff = got.view(np.uint32) != want.view(np.uint32)
    if not diff.any():
        return ""
    at = tuple(int(i) for i in np.argwhere(diff)[0])
    return (f"{int(diff.sum())} of {diff.size} values differ from the blocks' {dtype} dequantization "
            f"(first at {list(at)}: weight {want[at]!r}, blocks {got[at]!r})")
