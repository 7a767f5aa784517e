"""Host-side conversions shared by the native executors (numpy allowed here, not in the core)."""

from __future__ import annotations

import numpy as np

from gpudelegate import dtypes as _dt
from gpudelegate.errors import InputError
from gpudelegate.executor import HostTensor

NP_DTYPE = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "bool": np.uint32}


def to_storage(x, dtype: str, path: str = "input") -> np.ndarray:
    """A C-contiguous array in ``dtype``'s device storage (bool -> uint32 0/1). int64 is narrowed
    to int32 only when every value fits; float64 is rounded to float32."""
    if isinstance(x, HostTensor):
        a = np.frombuffer(_dt.byte_view(x.data), dtype=NP_DTYPE[x.dtype]).reshape(x.shape)
    else:
        a = np.asarray(x)
    if dtype == "int32" and a.dtype == np.int64:
        if a.size and (a.min() < -2**31 or a.max() >= 2**31):
            raise InputError(f"{path}: int64 values outside the int32 range cannot be narrowed")
    # np.require, not np.ascontiguousarray: the latter turns a 0-d array into shape (1,)
    if dtype == "bool":
        return np.require(a != 0, dtype=np.uint32, requirements="C")
    return np.require(a, dtype=NP_DTYPE[dtype], requirements="C")


def from_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """The user-facing array of a stored tensor (bool storage -> numpy bool)."""
    if dtype == "bool":
        return a != 0
    return a
