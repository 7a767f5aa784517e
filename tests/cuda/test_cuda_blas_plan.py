"""The row-major -> cuBLAS (column-major) mapping of native/cuda_blas.py, checked without a GPU.

``Blas._calls`` turns a row-major batched product into cublasGemmEx / GemmStridedBatchedEx
argument tuples (operand order, transposes, leading dims, batch strides). Here those tuples are
executed by a numpy emulation of cuBLAS's documented semantics (column-major, op(A) m x k,
op(B) k x n, C m x n with leading dimension ldc, batch i at pointer + i * stride) over the real
host memory of numpy operands, and compared with numpy's matmul in float64.
"""

import ctypes

import numpy as np
import pytest

from gpudelegate.native.cuda_blas import CUDA_R_16F, CUDA_R_32F, OP_N, Blas, _layout


class _Ptr:
    def __init__(self, p):
        self.ptr = p


class Dev:
    """A numpy array posing as a CuPy one (shape, strides, itemsize, dtype, data.ptr)."""

    def __init__(self, a):
        self.a = a
        self.shape, self.strides, self.itemsize, self.dtype = a.shape, a.strides, a.itemsize, a.dtype
        self.data = _Ptr(a.__array_interface__["data"][0])


def _mat(ptr, dtype, rows, cols, ld):
    """Column-major rows x cols matrix at ``ptr`` with leading dimension ld (a numpy view)."""
    item = np.dtype(dtype).itemsize
    span = ((cols - 1) * ld + rows) * item if rows and cols else 0
    buf = (ctypes.c_char * max(span, 1)).from_address(ptr)
    base = np.frombuffer(buf, dtype=dtype, count=max(span // item, 0))
    return np.lib.stride_tricks.as_strided(base, shape=(rows, cols), strides=(item, ld * item))


def emulate(args):
    """cublasGemmEx (19 args) / cublasGemmStridedBatchedEx (23 args) on host memory."""
    if len(args) == 19:
        _, opa, opb, m, n, k, _, A, at, lda, B, bt, ldb, _, C, ct, ldc, _, _ = args
        sa = sb = sc = 0
        batch = 1
    else:
        _, opa, opb, m, n, k, _, A, at, lda, sa, B, bt, ldb, sb, _, C, ct, ldc, sc, batch, _, _ = args
    dt = {CUDA_R_32F: np.float32, CUDA_R_16F: np.float16}[ct]
    item = np.dtype(dt).itemsize
    for i in range(batch):
        a = _mat(A.value + i * sa * item, dt, *((m, k) if opa == OP_N else (k, m)), lda)
        b = _mat(B.value + i * sb * item, dt, *((k, n) if opb == OP_N else (n, k)), ldb)
        a = a if opa == OP_N else a.T
        b = b if opb == OP_N else b.T
        c = _mat(C.value + i * sc * item, dt, m, n, ldc)
        c[...] = (a.astype(np.float64) @ b.astype(np.float64)).astype(dt)


def _blas():
    b = Blas.__new__(Blas)  # no GPU: only the argument planning is exercised
    b.handle = None
    b._one_p = b._zero_p = None
    return b


CASES = [
    ((5, 7), (7, 3), None),  # plain
    ((1, 13), (13, 11), None),  # decode-shaped GEMV
    ((3, 4, 5, 7), (4, 7, 2), None),  # batch broadcast over a leading dim
    ((2, 1, 5, 7), (3, 7, 2), None),  # both operands broadcast
    ((6, 5), (3, 5), "linear"),  # x @ w.T with w [N, K]: the transposed (column-major) view
    ((2, 5, 3), (2, 3, 7), "a_t"),  # a given as a transposed view
]


@pytest.mark.parametrize("sa,sb,kind", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_calls_compute_the_row_major_product(sa, sb, kind, dtype):
    rng = np.random.default_rng(0)
    a = rng.standard_normal(sa).astype(dtype)
    b = rng.standard_normal(sb).astype(dtype)
    if kind == "linear":
        b = b.T  # [K, N] view of w [N, K]
    if kind == "a_t":
        a = np.ascontiguousarray(np.swapaxes(a, -1, -2)).swapaxes(-1, -2)  # same values, transposed memory
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    batch = want.shape[:-2]
    A = np.broadcast_to(a, batch + a.shape[-2:])
    B = np.broadcast_to(b, batch + b.shape[-2:])
    out = np.full(want.shape, np.nan, dtype)
    assert _layout(Dev(A)) is not None and _layout(Dev(B)) is not None
    for args in _blas()._calls(Dev(A), Dev(B), Dev(out)):
        emulate(args)
    tol = 1e-5 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=tol, atol=tol * 10)


def test_layout_classification():
    x = np.zeros((4, 6), np.float32)
    assert _layout(Dev(x)) == ("rm", 6)
    assert _layout(Dev(x.T)) == ("cm", 6)
    assert _layout(Dev(x[:, ::2])) is None  # strided columns: neither (copied before cuBLAS)
    assert _layout(Dev(np.zeros((1, 5), np.float16))) == ("rm", 5)
