"""Element types of gpudelegate tensors.

Device storage is what matters: WGSL storage buffers have no 8-bit or 64-bit integers, so
``bool`` is stored as a 32-bit 0/1 and int64 does not exist inside a program (export narrows
indices to int32; sessions accept int64 host inputs and narrow them after a range check).
"""

ITEMSIZE = {"float32": 4, "float16": 2, "int32": 4, "bool": 4}
FLOAT_DTYPES = ("float32", "float16")
INT_DTYPES = ("int32",)
DTYPES = tuple(ITEMSIZE)

# Packed (block-quantized) weight types, stored exactly as GGUF / llama.cpp's ggml-common.h lays
# them out: the last dim is cut into blocks of 32 values, each block a little-endian record.
#   q4_0: f16 d, 16 bytes of nibbles          (18 bytes)  x = (q - 8) * d
#   q4_1: f16 d, f16 m, 16 bytes of nibbles   (20 bytes)  x = q * d + m
#   q8_0: f16 d, 32 int8                      (34 bytes)  x = q * d
# Byte j of the nibbles holds value j (low nibble) and value j + 16 (high nibble). Only weights
# are packed (a constant and its prepacked copy, read by linear and embedding); everything
# computed is float32. A packed tensor's last dim must be a multiple of the block length.
QUANT_BLOCKS = {"q4_0": (32, 18), "q4_1": (32, 20), "q8_0": (32, 34)}
PACKED_DTYPES = tuple(QUANT_BLOCKS)
STORAGE_DTYPES = DTYPES + PACKED_DTYPES

# numpy dtype names (``np.dtype(x).name``) accepted for host inputs, mapped to program dtypes.
HOST_ALIASES = {"float32": "float32", "float16": "float16", "int32": "int32", "int64": "int32",
                "bool": "bool", "float64": "float32"}

# struct/memoryview format characters for each dtype's storage (used where numpy is absent).
STRUCT_FORMAT = {"float32": "f", "float16": "e", "int32": "i", "bool": "I"}


def itemsize(dtype: str) -> int:
    return ITEMSIZE[dtype]


def is_packed(dtype: str) -> bool:
    return dtype in QUANT_BLOCKS


def packed_row_bytes(dtype: str, k: int) -> int:
    """Bytes of one row of ``k`` values (``k`` a multiple of the block length)."""
    block, size = QUANT_BLOCKS[dtype]
    return k // block * size


def packed_shape_error(dtype: str, shape) -> str:
    """Why ``shape`` cannot hold ``dtype`` blocks ("" when it can)."""
    block = QUANT_BLOCKS[dtype][0]
    if len(shape) == 0:
        return f"{dtype} needs rank >= 1 (blocks run along the last dim)"
    if shape[-1] % block:
        return f"{dtype} last dim {shape[-1]} is not a multiple of its {block}-value block"
    return ""


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def nbytes(dtype: str, shape) -> int:
    if dtype in QUANT_BLOCKS:  # a shape that cannot hold whole blocks is refused by the checks
        block, size = QUANT_BLOCKS[dtype]
        return numel(shape) // block * size
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
