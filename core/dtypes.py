"""Element types of gpudelegate tensors.

Device storage is what matters: WGSL storage buffers have no 8-bit or 64-bit integers, so
``bool`` is stored as a 32-bit 0/1 and int64 does not exist inside a program (export narrows
indices to int32; sessions accept int64 host inputs and narrow them after a range check).
"""

ITEMSIZE = {"float32": 4, "float16": 2, "int32": 4, "bool": 4}
FLOAT_DTYPES = ("float32", "float16")
INT_DTYPES = ("int32",)
DTYPES = tuple(ITEMSIZE)

# numpy dtype names (``np.dtype(x).name``) accepted for host inputs, mapped to program dtypes.
HOST_ALIASES = {"float32": "float32", "float16": "float16", "int32": "int32", "int64": "int32",
                "bool": "bool", "float64": "float32"}

# struct/memoryview format characters for each dtype's storage (used where numpy is absent).
STRUCT_FORMAT = {"float32": "f", "float16": "e", "int32": "i", "bool": "I"}


def itemsize(dtype: str) -> int:
    return ITEMSIZE[dtype]


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def nbytes(dtype: str, shape) -> int:
    return ITEMSIZE[dtype] * numel(shape)


def byte_view(data) -> memoryview:
    """A flat byte view of any buffer: ``memoryview.cast("B")`` refuses an empty multi-dimensional
    array ("cannot cast view with zeros in shape or strides") and a non-contiguous one, which a
    tensor with a zero-size dim or a strided numpy view is; those give an empty view and a copy."""
    mv = memoryview(data)
    if mv.nbytes == 0:
        return memoryview(b"")
    if not mv.c_contiguous:
        return memoryview(mv.tobytes())
    return mv.cast("B")
