"""CUDA kernels of the op set (docs/OPS.md), bound once per dispatch and replayed every run.

``CudaKernels.bind(op, args, outs, attrs, where)`` returns a closure that enqueues the op on the
current CuPy stream, writing into the preallocated output views (arena, never a fresh array), so
a run is a list of closures that can be replayed eagerly or captured into a CUDA graph.

- matmul / linear / conv2d go to cuBLAS (float16 operands accumulate in float32) on a handle of
  our own (:mod:`.cuda_blas`): CuPy refuses cuBLAS calls inside a CUDA-graph capture;
- a linear over at most 8 rows of float32 activations with a float16 weight runs ``hgemv``
  (``shaders/cuda_gemv.cu``: reads the float16 weight once, fp32 accumulation) instead of
  cuBLAS, which would convert the weight to float32 on every call; ``linear_norm`` runs
  ``hgemv_norm`` (or the packed ``qgemv_norm``) for a product that takes the rms norm before it
  as its prologue (:mod:`.cuda_norm_prologue`);
- linear and embedding on packed (GGUF block) weights, which reach the kernels as
  :class:`.cuda_quant.PackedView`, run the kernels of :mod:`.cuda_quant` (a dequantizing GEMV
  for a few rows, dequantization into scratch + cuBLAS for more, a dequantizing row gather);
- norms, softmax, rope, sdpa and kv_update are fused kernels from ``shaders/cuda_*.cu``
  (RawModule templates over float / float16 storage, fp32 arithmetic); sdpa is a tiled
  online-softmax kernel, split over the keys for decode, with a tensor-core variant for long
  float16 prefills (see ``sdpa_launch``), and a decode kernel that reads the cache rows before
  its wait where the executor knows them unchanged (``sdpa_early_keys``, ``FreshRows``);
- activations are CuPy ElementwiseKernels whose preamble is ``shaders/cuda_activations.cu``;
- everything else is CuPy array code writing with ``out=`` / ``copyto``.

Storage: bool is a 32-bit 0/1 (``uint32``), as everywhere in gpudelegate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import numpy as np

from gpudelegate.errors import UnsupportedOpError
from gpudelegate import shaders

from .cuda_argmax import ArgmaxKernel
from .cuda_pdl import PdlLauncher, wrap as pdl_wrap
from .cuda_norm_prologue import NormPrologue, kernel_source
from .cuda_quant import PackedView, QuantKernels

STORAGE = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "bool": np.uint32}
"""Device storage dtype of each program dtype."""

_BLOCK = 256
HV_WARPS = 4  # warps (output rows) of one hgemv block (cuda_gemv.cu HV_WARPS)
HGEMV_MAX_ROWS = 8  # hgemv holds one float32 accumulator per x row

_UNARY_EXPR = {
    "neg": "-v", "abs": "fabsf(v)", "exp": "expf(v)", "log": "logf(v)", "sqrt": "sqrtf(v)",
    "rsqrt": "gd_rsqrt(v)", "sin": "sinf(v)", "cos": "cosf(v)", "tanh": "tanhf(v)",
    "sigmoid": "gd_sigmoid(v)", "relu": "gd_relu(v)", "silu": "gd_silu(v)", "erf": "erff(v)",
    "reciprocal": "gd_reciprocal(v)",
}
_BINARY = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "true_divide", "pow": "power",
           "maximum": "maximum", "minimum": "minimum", "eq": "equal", "ne": "not_equal", "lt": "less",
           "le": "less_equal", "gt": "greater", "ge": "greater_equal", "logical_and": "logical_and",
           "logical_or": "logical_or"}


def _is_float(a) -> bool:
    return a.dtype.kind == "f"


def _ctype(a) -> str:
    """C storage type of a float array inside the RawModules (see cuda_common.cu)."""
    if a.dtype == np.float32:
        return "float"
    if a.dtype == np.float16:
        return "half_t"
    raise TypeError(a.dtype)


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


SDPA_THREADS = 128
SDPA_ROWS = 16
"""Threads and query rows of one sdpa_tile block (SDPA_NT / SDPA_BR in cuda_attention.cu)."""


SDPA_FILL4 = 2
"""Prefill (more than 8 query rows per kv head): 4-row sdpa_tile blocks where 8-row ones would
give fewer than this many blocks per SM (0: never). SmolLM2's 128-token prefill: 144 blocks of 8
rows on 132 SMs -> 288 of 4 (see sdpa_launch)."""


SDPA_MMA_ROWS = 64
"""Query rows of one sdpa_mma block (SDPA_MMA_BR), 16 per warp."""


@dataclass(frozen=True)
class SdpaLaunch:
    """How one sdpa dispatch runs: sdpa_tile (+ sdpa_combine when split over the keys), or
    sdpa_mma (tensor cores, float16, one split)."""
    kernel: str           # "tile" or "mma"
    bk: int               # keys per shared-memory tile (tile: template argument; mma: 64)
    no: int               # tile: output accumulators per thread (template argument); mma: 0
    splits: int           # key-range splits (grid z); 1 writes the output directly
    tiles_per_split: int
    grid: tuple           # (row tiles per kv head, B * Hk, splits)
    smem: int             # dynamic shared memory bytes
    rows: int             # B * H * Tq output rows
    br: int = SDPA_ROWS   # tile: query rows per block (template argument BR: 16, 8 or 4)


@dataclass(frozen=True)
class SdpaPartials:
    """sdpa_tile's launch over several key splits without sdpa_combine (CudaKernels.sdpa_partials):
    ``run`` writes ``part_o`` [splits, rows, dv] and ``part_ml`` [splits, rows, 2] (float32)."""
    run: Callable[[], None]
    part_o: object
    part_ml: object
    rows: int
    dv: int
    splits: int


SDPA_EARLY_KEYS = 256
"""Most keys of one sdpa_early_keys block (a thread a key: SDPA_EK_KEYS in cuda_attention.cu)."""


@dataclass(frozen=True)
class FreshRows:
    """What the executor knows of a decode attention's caches (cuda_fused_ops.fresh_rows): k and
    v hold, when the run begins, what the attention reads, except rows ``pos[0]`` ..
    ``pos[0] + n - 1``, which a kernel of the run before it writes; ``pos`` (an int32 device
    array) is a run input that no kernel of the run writes. sdpa_early_keys then reads every
    other row before griddepcontrol.wait."""
    pos: object
    n: int


def early_keys_fit(Tq: int, Tk: int, D: int, Dv: int, itemsize: int) -> bool:
    """Whether sdpa_early_keys takes these shapes: one query row, a thread per key (at most
    SDPA_EARLY_KEYS), a key's k and v rows in whole 16-byte words, Dv a multiple of 32 (its
    transpose-reduce), and both rows at most 64 elements: with its p v sums that is ~160
    registers a thread at float32, so the block still fits beside the kernel ahead's blocks."""
    ew = 16 // itemsize
    return (Tq == 1 and 0 < Tk <= SDPA_EARLY_KEYS and 0 < D <= 64 and 0 < Dv <= 64 and D % ew == 0
            and Dv % ew == 0 and Dv % 32 == 0)


def sdpa_smem(bk: int, d: int, dv: int, br: int = SDPA_ROWS) -> int:
    """Shared memory of sdpa_tile in bytes (the layout comment of cuda_attention.cu)."""
    return 4 * (br * (d + 1) + bk * (d + 1) + bk * dv + br * (bk + 1) + 3 * br)


def sdpa_mma_smem(d: int, dv: int) -> int:
    """Shared memory of sdpa_mma in bytes: Q and K tiles [64][D+8], V transposed [Dv][64+8], fp16."""
    return 2 * (SDPA_MMA_ROWS * (d + 8) + 64 * (d + 8) + dv * (64 + 8))


def decode_key_tile(bk: int, B, H, Hk, Tq, Tk, sm_count) -> int:
    """The key tile of a decode attention (at most 8 query rows per kv head, split over the keys):
    the smallest of 16 / 32 (not above ``bk``, the largest that fits shared memory) whose tiles
    still number no more than the splits that make about one block per SM, else ``bk``. Each
    block then walks one short tile: a decode block's time is the latency chain of its one tile
    (load, scores over the head dim, softmax, P.V over the tile's keys), and with more, shorter
    blocks the P.V loop and the tile load shrink while the blocks run side by side. 16 is the
    least: 8-row blocks need a score row per thread (BK >= 16)."""
    rows = (H // Hk) * Tq
    base = B * Hk  # one 8-row tile per kv head
    if rows > 8 or bk <= 16 or base * 2 >= sm_count:
        return bk
    most = -(-sm_count // base)
    return next((t for t in (16, 32) if t < bk and -(-Tk // t) <= most), bk)


def sdpa_launch(B, H, Hk, Tq, Tk, D, Dv, max_shared, sm_count, fp16=False,
                tensor_cores: Optional[bool] = None) -> Optional[SdpaLaunch]:
    """Tile sizes and key split of the fused attention, or None where it does not apply (head
    dims above 256: the accumulators would not fit in registers; no tile fits shared memory).

    The largest key tile that fits shared memory is taken (fewer barriers per key). Keys are
    split across blocks only when the query rows alone give fewer blocks than half the SMs
    (decode: B*Hk groups of H/Hk*Tq rows), aiming at about one block per SM; causal prefill
    keeps one split, since its later key tiles are skipped anyway.

    float16 with one split (prefill) can run on the tensor-core kernel where its shapes allow
    (head dims multiples of 16 up to 128, its tiles in shared memory). ``tensor_cores`` None
    (auto) takes it only when its 64-row blocks still fill half the SMs: measured on an H100
    (benchmarks/results/cuda_sdpa_*.json), a 1024-token causal prefill with 8 kv heads ran 2.9x
    faster on it (512 blocks), but SmolLM2's 128-token prefill (3 kv heads: 18 blocks against 72
    of the CUDA-core kernel) ran 1.3x slower. True takes it wherever shapes allow, False never.
    Decode stays on the split-K CUDA-core kernel, bound by reading the keys, not by arithmetic."""
    if min(B, H, Hk, Tq, Tk, D, Dv) <= 0 or D > 256 or Dv > 256:
        return None
    bk = next((t for t in (64, 32, 16, 8) if sdpa_smem(t, D, Dv) <= max_shared), None)
    if bk is None:
        return None
    bk = decode_key_tile(bk, B, H, Hk, Tq, Tk, sm_count)
    # 8-row blocks where 16-row ones would leave SMs idle (SmolLM2's 128-token prefill: 72
    # blocks of 16 rows on 132 SMs; each block's time is mostly the latency of its key-tile
    # steps, so twice the blocks of half the rows finish in about half the time). Only with key
    # tiles of 16 or more: each thread then still owns at least one score row.
    rows = (H // Hk) * Tq
    br = SDPA_ROWS
    # Also decode (a few rows per kv head): 8-row blocks waste less of each key tile's work.
    if bk >= 16 and (rows <= 8 or -(-rows // SDPA_ROWS) * B * Hk < sm_count):
        br = 8
    # 4-row blocks where even 8-row ones leave an SM with one block or none: a block's time is
    # the latency chain of its key-tile steps (mask read, tile load, barriers), so more, shorter
    # blocks per SM overlap more of it. Key tiles of 32 or more: each thread owns a score row.
    if br == 8 and rows > 8 and bk >= 32 and -(-rows // 8) * B * Hk < SDPA_FILL4 * sm_count:
        br = 4
    no = next(n for n in (4, 8, 16, 32) if n * SDPA_THREADS >= br * Dv)
    row_tiles = -(-rows // br)
    base = row_tiles * B * Hk
    ntiles = -(-Tk // bk)
    splits = 1
    if base * 2 < sm_count:
        splits = max(1, min(ntiles, -(-sm_count // base)))
    tps = -(-ntiles // splits)
    splits = -(-ntiles // tps)  # no empty split
    mma_blocks = -(-rows // SDPA_MMA_ROWS) * B * Hk
    if (fp16 and tensor_cores is not False and splits == 1 and D % 16 == 0 and Dv % 16 == 0 and D <= 128
            and Dv <= 128 and rows >= SDPA_MMA_ROWS and sdpa_mma_smem(D, Dv) <= max_shared
            and (tensor_cores or mma_blocks * 2 >= sm_count)):
        return SdpaLaunch(kernel="mma", bk=64, no=0, splits=1, tiles_per_split=-(-Tk // 64),
                          grid=(-(-rows // SDPA_MMA_ROWS), B * Hk, 1), smem=sdpa_mma_smem(D, Dv), rows=B * H * Tq)
    return SdpaLaunch(kernel="tile", bk=bk, no=no, splits=splits, tiles_per_split=tps, grid=(row_tiles, B * Hk, splits),
                      smem=sdpa_smem(bk, D, Dv, br), rows=B * H * Tq, br=br)


class CudaKernels:
    """Compiled kernels of one device, shared by every executor of a CudaContext."""

    def __init__(self, cp):
        self.cp = cp
        self._modules: Dict[str, object] = {}
        self._funcs: Dict[tuple, object] = {}
        self._ew: Dict[tuple, object] = {}
        self.max_shared = 48 * 1024  # without opting in to more per kernel
        self._blas = None
        self._sm_count = None
        # float16 prefill attention on tensor cores (sdpa_mma): None = where it pays (see
        # sdpa_launch), True = wherever shapes allow, False = never; for tests and comparisons
        # (set before a session is built: kernels are chosen when a session binds).
        self.sdpa_tensor_cores: Optional[bool] = None
        # the decode attention reading its cache rows before the wait where the executor's fact
        # allows it (sdpa_early_keys; False: sdpa_tile + sdpa_combine), read at bind time; for
        # tests and comparisons
        self.sdpa_early_keys_on = True
        # Kernels captured into graphs launch with PDL where the device has it (cuda_pdl).
        self.pdl = PdlLauncher(cp)
        self.quant = QuantKernels(cp, lambda: self.sm_count, lambda: self.blas, wrap=self._compiled,
                                  prelude=self.pdl.prelude)
        self.argmax = ArgmaxKernel(cp)  # the greedy pick (CudaExecutor.argmax_device)

    @property
    def blas(self):
        """cuBLAS on our own handle (capturable in CUDA graphs, see cuda_blas.py)."""
        if self._blas is None:
            from .cuda_blas import Blas
            self._blas = Blas(self.cp)
        return self._blas

    def close(self) -> None:
        if self._blas is not None:
            self._blas.close()
            self._blas = None

    # ------------------------------------------------------------------ compilation
    _TEMPLATES = {
        "cuda_norms.cu": ["rms_norm<{T},{W}>", "layer_norm<{T},{W}>", "softmax_rows<{T}>"],
        "cuda_rope.cu": ["rope<{T},{W}>", "kv_update<{E}>"],
        "cuda_fused.cu": ["add_rms_norm<{T},{W}>", "silu_mul<{T}>", "rope_kv<{T},{W}>"],
    }

    def _module(self, name: str):
        mod = self._modules.get(name)
        if mod is None:
            exprs = []
            for pat in self._TEMPLATES[name]:
                for t in ("float", "half_t"):
                    for w in ("float", "half_t"):
                        for e in ("unsigned int", "half_t"):
                            exprs.append(pat.format(T=t, W=w, E=e))
            exprs = sorted(set(exprs))
            code = self._common() + "\n" + shaders.source(name)
            mod = self.cp.RawModule(code=code, name_expressions=exprs)
            self._modules[name] = mod
        return mod

    def _common(self) -> str:
        """cuda_common.cu as our RawModules begin (after the PDL launcher's prelude: the timeline
        switch, which adds an argument to every kernel, see cuda_pdl)."""
        return self.pdl.prelude + shaders.source("cuda_common.cu")

    def _compiled(self, func):
        """A kernel of ours as the executor launches it (PDL while a graph is captured)."""
        return pdl_wrap(func, self.pdl)

    def func(self, module: str, expr: str):
        key = (module, expr)
        f = self._funcs.get(key)
        if f is None:
            f = self._compiled(self._module(module).get_function(expr))
            self._funcs[key] = f
        return f

    def elementwise(self, key: str, in_params: str, out_params: str, body: str):
        k = self._ew.get(key)
        if k is None:
            k = self.cp.ElementwiseKernel(in_params, out_params, body, name="gd_" + key,
                                          preamble=shaders.source("cuda_activations.cu"))
            self._ew[key] = k
        return k

    # ------------------------------------------------------------------ binding
    def bind(self, op: str, args: List, outs: List, attrs: dict, where: str) -> Callable[[], None]:
        fn = getattr(self, "_op_" + op, None)
        if fn is None:
            if op in _BINARY:
                return self._binary(op, args, outs, attrs, where)
            if op in _UNARY_EXPR:
                return self._unary(op, args, outs, attrs, where)
            raise UnsupportedOpError(where, f"op {op!r} has no CUDA kernel")
        return fn(args, outs, attrs, where)

    # --- elementwise -------------------------------------------------------------------------
    def _binary(self, op, args, outs, attrs, where):
        ufunc = getattr(self.cp, _BINARY[op])
        a, b = args
        o = outs[0]
        # fp16 storage: CuPy's float16 arithmetic widens to float and rounds once per op, which is
        # the contract (compute in fp32, narrow on store). "unsafe" lets int32/int32 `div` and
        # comparisons (bool -> uint32 storage) write into the planned output dtype.
        return lambda: ufunc(a, b, out=o, casting="unsafe")

    def _unary(self, op, args, outs, attrs, where):
        x, o = args[0], outs[0]
        cp = self.cp
        if x.dtype.kind != "f" and op in ("neg", "abs", "relu"):
            if op == "neg":
                return lambda: cp.negative(x, out=o)
            if op == "abs":
                return lambda: cp.absolute(x, out=o)
            return lambda: cp.maximum(x, 0, out=o)
        expr = _UNARY_EXPR[op]
        k = self.elementwise(op, "X x", "Y y", f"float v = (float)x; y = (Y)({expr});")
        return lambda: k(x, o)

    def _op_logical_not(self, args, outs, attrs, where):
        x, o = args[0], outs[0]
        return lambda: self.cp.logical_not(x, out=o)

    def _op_gelu(self, args, outs, attrs, where):
        x, o = args[0], outs[0]
        approx = attrs.get("approximate", "none")
        if approx not in ("none", "tanh"):
            raise UnsupportedOpError(where, f"gelu approximate={approx!r} (expected 'none' or 'tanh')")
        fn = "gd_gelu_tanh" if approx == "tanh" else "gd_gelu_erf"
        k = self.elementwise("gelu_" + approx, "X x", "Y y", f"y = (Y){fn}((float)x);")
        return lambda: k(x, o)

    def _op_hardtanh(self, args, outs, attrs, where):
        x, o = args[0], outs[0]
        lo = np.float32(attrs.get("min_val", -1.0))
        hi = np.float32(attrs.get("max_val", 1.0))
        if x.dtype.kind != "f":
            return lambda: self.cp.clip(x, int(lo), int(hi), out=o)
        k = self.elementwise("hardtanh", "X x, float32 lo, float32 hi", "Y y", "y = (Y)gd_hardtanh((float)x, lo, hi);")
        return lambda: k(x, lo, hi, o)

    def _op_where(self, args, outs, attrs, where):
        c, a, b = args
        o = outs[0]
        k = self.elementwise("where", "C c, A a, B b", "Y y", "y = c ? (Y)a : (Y)b;")
        return lambda: k(c, a, b, o)

    def _op_cast(self, args, outs, attrs, where):
        x, o = args[0], outs[0]
        cp = self.cp
        if attrs.get("dtype") == "bool":
            return lambda: cp.not_equal(x, 0, out=o)
        # float -> int truncates toward zero (a C conversion), bool (0/1) -> number is exact.
        return lambda: cp.copyto(o, x, casting="unsafe")

    # --- linear algebra ----------------------------------------------------------------------
    def _op_matmul(self, args, outs, attrs, where):
        a, b = args
        return self.blas.plan_matmul(a, b, outs[0])

    def _op_linear(self, args, outs, attrs, where):
        return self.linear(args[0], args[1], args[2] if len(args) > 2 else None, outs[0], where)

    def linear(self, x, w, bias, o, where: str, scratch: Optional[tuple] = None):
        """A closure computing ``o = x @ w.T (+ bias)``: cuBLAS for a float weight, the kernels of
        :mod:`.cuda_quant` for a packed one (``scratch``: the plan's dequantization scratch as
        (memory pointer or None, bytes), see QuantKernels.linear)."""
        if isinstance(w, PackedView):
            return self.quant.linear(x, w, bias, o, scratch, where)
        cp = self.cp
        K, N = w.shape[1], w.shape[0]
        M = int(np.prod(x.shape[:-1], dtype=np.int64))  # not reshape(-1, K): ambiguous when K = 0
        x2 = x.reshape(M, K)
        o2 = o.reshape(M, N)
        hv = self._hgemv(x2, w, bias, o2)
        if hv is not None:
            return hv
        # w.T is a transposed view: cuBLAS reads it with op = T, no copy (the classic "TN" GEMM)
        mm = self.blas.plan_matmul(x2, w.T, o2)

        def run():
            mm()
            if bias is not None:
                cp.add(o2, bias, out=o2, casting="unsafe")
        return run

    def _hgemv(self, x2, w, bias, o2) -> Optional[Callable[[], None]]:
        """The closure of ``hgemv`` (cuda_gemv.cu) for o2 = x2 @ w.T (+ bias) where it applies:
        1..HGEMV_MAX_ROWS rows of float32 x into float32 o2, a float16 weight; contiguous operands
        from 16-byte aligned starts, K a multiple of 8 (whole 16-byte chunks of weight row). Else
        None (cuBLAS then runs it)."""
        cp = self.cp
        M, K = x2.shape
        N = w.shape[0]
        if not (1 <= M <= HGEMV_MAX_ROWS and N > 0 and K > 0 and K % 8 == 0 and w.dtype == np.float16
                and x2.dtype == np.float32 and o2.dtype == np.float32):
            return None
        if not (w.flags.c_contiguous and x2.flags.c_contiguous and o2.flags.c_contiguous
                and w.data.ptr % 16 == 0 and x2.data.ptr % 16 == 0):
            return None
        if bias is not None and (bias.dtype != np.float32 or not bias.flags.c_contiguous):
            return None
        mm = 1 if M == 1 else 2 if M == 2 else 4 if M <= 4 else 8
        expr = f"hgemv<{mm}>"
        f = self._funcs.get(("cuda_gemv.cu", expr))
        if f is None:
            code = self._common() + "\n" + shaders.source("cuda_gemv.cu")
            f = self._compiled(cp.RawModule(code=code, name_expressions=[expr]).get_function(expr))
            self._funcs[("cuda_gemv.cu", expr)] = f
        a = (w, x2, o2, bias if bias is not None else np.uint64(0), np.int32(N), np.int32(K), np.int32(M),
             np.int64(N))
        grid, block = (-(-N // HV_WARPS),), (HV_WARPS * 32,)
        return lambda: f(grid, block, a)

    def linear_norm(self, norm: NormPrologue, w, o, where: str) -> Optional[Callable[[], None]]:
        """A closure computing ``o = h @ w.T`` where h is the rms-normed rows of ``norm``, computed
        inside the product's launch (and s written): ``qgemv_norm`` for a packed weight,
        ``hgemv_norm`` for a float16 weight against float32 activations. None where no such kernel
        applies (a float weight through cuBLAS, a failed check): the caller then runs
        ``norm.unfused`` and the product."""
        o2 = o.reshape(norm.rows, w.shape[0])
        if isinstance(w, PackedView):
            return self.quant.gemv_norm(norm, w, o2, where)
        return self._hgemv_norm(norm, w, o2)

    def _hgemv_norm(self, norm: NormPrologue, w, o2) -> Optional[Callable[[], None]]:
        """``hgemv_norm`` (cuda_gemv.cu) where hgemv would run on the prologue's h, else None."""
        M, K = norm.rows, norm.cols
        N = w.shape[0]
        if not (N > 0 and w.ndim == 2 and w.shape[1] == K and w.dtype == np.float16 and norm.dtype == np.float32
                and o2.dtype == np.float32 and w.flags.c_contiguous and w.data.ptr % 16 == 0
                and norm.in_kernel(o2)):
            return None
        mm = 1 if M == 1 else 2 if M == 2 else 4 if M <= 4 else 8
        expr = f"hgemv_norm<{mm},{norm.weight_ctype()}>"
        f = self._funcs.get(("cuda_gemv.cu", expr))
        if f is None:
            f = self._compiled(self.cp.RawModule(code=kernel_source("cuda_gemv.cu", self.pdl.prelude),
                                                 name_expressions=[expr]).get_function(expr))
            self._funcs[("cuda_gemv.cu", expr)] = f
        a = (w, o2, np.uint64(0), np.int32(N), np.int32(K), np.int32(M), np.int64(N)) + norm.kernel_args()
        grid, block = (-(-N // HV_WARPS),), (HV_WARPS * 32,)
        return lambda: f(grid, block, a)

    def _op_conv2d(self, args, outs, attrs, where):
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else None
        o = outs[0]
        cp = self.cp
        sh, sw = attrs.get("stride", [1, 1])
        ph, pw = attrs.get("padding", [0, 0])
        dh, dw = attrs.get("dilation", [1, 1])
        g = int(attrs.get("groups", 1))
        N, C, H, W = x.shape
        O, Cg, kh, kw = w.shape
        Ho, Wo = o.shape[2], o.shape[3]
        as_strided = cp.lib.stride_tricks.as_strided
        wm = w.reshape(g, O // g, Cg * kh * kw)

        def run():
            xp = cp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw))) if (ph or pw) else x
            s0, s1, s2, s3 = xp.strides
            win = as_strided(xp, shape=(N, g, Cg, Ho, Wo, kh, kw),
                             strides=(s0, s1 * Cg, s1, s2 * sh, s3 * sw, s2 * dh, s3 * dw))
            # im2col: [g, Cg*kh*kw, N*Ho*Wo]; cuBLAS then does one batched product per group.
            cols = cp.ascontiguousarray(win.transpose(1, 2, 5, 6, 0, 3, 4)).reshape(g, Cg * kh * kw, N * Ho * Wo)
            res = cp.empty((g, O // g, N * Ho * Wo), dtype=o.dtype)
            self.blas.plan_matmul(wm, cols, res)()  # [g, O/g, N*Ho*Wo], one batched GEMM
            cp.copyto(o.reshape(N, g, O // g, Ho, Wo), res.reshape(g, O // g, N, Ho, Wo).transpose(2, 0, 1, 3, 4),
                      casting="unsafe")
            if bias is not None:
                cp.add(o, bias.reshape(1, O, 1, 1), out=o, casting="unsafe")
        return run

    # --- pooling and normalization -----------------------------------------------------------
    @staticmethod
    def _pool_geometry(size, k, s, p, d, ceil_mode):
        span = d * (k - 1) + 1
        if ceil_mode:
            out = -(-(size + 2 * p - span) // s) + 1
            if (out - 1) * s >= size + p:  # the last window must start inside input or left pad
                out -= 1
        else:
            out = (size + 2 * p - span) // s + 1
        extra = max(0, (out - 1) * s + span - (size + 2 * p))
        return out, extra

    def _op_max_pool2d(self, args, outs, attrs, where):
        x, o = args[0], outs[0]
        cp = self.cp
        kh, kw = attrs["kernel"]
        sh, sw = attrs.get("stride") or attrs["kernel"]
        ph, pw = attrs.get("padding", [0, 0])
        dh, dw = attrs.get("dilation", [1, 1])
        ceil = bool(attrs.get("ceil_mode", False))
        N, C, H, W = x.shape
        Ho, eh = self._pool_geometry(H, kh, sh, ph, dh, ceil)
        Wo, ew = self._pool_geometry(W, kw, sw, pw, dw, ceil)
        fill = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
        as_strided = cp.lib.stride_tricks.as_strided

        def run():
            xp = cp.pad(x, ((0, 0), (0, 0), (ph, ph + eh), (pw, pw + ew)), constant_values=fill)
            s0, s1, s2, s3 = xp.strides
            win = as_strided(xp, shape=(N, C, Ho, Wo, kh, kw), strides=(s0, s1, s2 * sh, s3 * sw, s2 * dh, s3 * dw))
            cp.amax(win, axis=(4, 5), out=o)
        return run

    def _op_avg_pool2d(self, args, outs, attrs, where):
        x, o = args[0], outs[0]
        cp = self.cp
        kh, kw = attrs["kernel"]
        sh, sw = attrs.get("stride") or attrs["kernel"]
        ph, pw = attrs.get("padding", [0, 0])
        ceil = bool(attrs.get("ceil_mode", False))
        include_pad = bool(attrs.get("count_include_pad", True))
        N, C, H, W = x.shape
        Ho, eh = self._pool_geometry(H, kh, sh, ph, 1, ceil)
        Wo, ew = self._pool_geometry(W, kw, sw, pw, 1, ceil)

        def counts(size, k, s, p, n_out):
            # PyTorch's divisor: the window clipped to the padded input (count_include_pad) or to
            # the input itself; the ceil-mode overhang past the right padding never counts.
            c = []
            for i in range(n_out):
                a = i * s - p
                b = min(a + k, size + p)
                if not include_pad:
                    a, b = max(a, 0), min(b, size)
                c.append(b - a)
            return np.asarray(c, dtype=np.float32)

        div = np.outer(counts(H, kh, sh, ph, Ho), counts(W, kw, sw, pw, Wo)).astype(np.float32)
        div_d = cp.asarray(div)
        as_strided = cp.lib.stride_tricks.as_strided

        def run():
            xp = cp.pad(x, ((0, 0), (0, 0), (ph, ph + eh), (pw, pw + ew)))
            s0, s1, s2, s3 = xp.strides
            win = as_strided(xp, shape=(N, C, Ho, Wo, kh, kw), strides=(s0, s1, s2 * sh, s3 * sw, s2, s3))
            tot = win.sum(axis=(4, 5), dtype=np.float32)
            cp.divide(tot, div_d, out=o, casting="unsafe")
        return run

    def _op_batch_norm(self, args, outs, attrs, where):
        x, mean, var = args[0], args[1], args[2]
        w = args[3] if len(args) > 3 else None
        b = args[4] if len(args) > 4 else None
        o = outs[0]
        cp = self.cp
        C = x.shape[1]
        bshape = (C,) + (1,) * (x.ndim - 2)
        eps = np.float32(attrs.get("eps", 1e-5))
        ones = cp.ones(C, np.float32) if w is None else None
        zeros = cp.zeros(C, np.float32) if b is None else None
        # torch's inference form x * alpha + beta (alpha = w / sqrt(var + eps), beta = b - mean *
        # alpha): an infinite alpha gives torch's NaN (inf - inf), not (x - mean) * alpha's inf.
        k = self.elementwise("batch_norm", "X x, M m, V v, W w, B b, float32 eps", "Y y",
                             "float a = rsqrtf((float)v + eps) * (float)w; "
                             "y = (Y)((float)x * a + ((float)b - (float)m * a));")
        mm, vv = mean.reshape(bshape), var.reshape(bshape)
        ww = (w if w is not None else ones).reshape(bshape)
        bb = (b if b is not None else zeros).reshape(bshape)
        return lambda: k(x, mm, vv, ww, bb, eps, o)

    def _rows(self, x, cols):
        rows = x.size // cols if cols else 0
        block = min(_BLOCK, max(32, (cols + 31) // 32 * 32))
        return rows, block

    def _op_layer_norm(self, args, outs, attrs, where):
        x = args[0]
        w = args[1] if len(args) > 1 else None
        b = args[2] if len(args) > 2 else None
        o = outs[0]
        self._need_float(where, "layer_norm", x)
        ns = attrs.get("normalized_shape") or list(x.shape[-1:])
        cols = int(np.prod(ns)) if ns else 1
        rows, block = self._rows(x, cols)
        wt = w if w is not None else (b if b is not None else x)
        f = self.func("cuda_norms.cu", f"layer_norm<{_ctype(x)},{_ctype(wt)}>")
        bb = b if b is not None else wt
        args_ = (x, wt, bb, o, np.int32(cols), np.float32(attrs.get("eps", 1e-5)),
                 np.int32(w is not None), np.int32(b is not None))
        if b is not None and w is not None and b.dtype != w.dtype:
            raise UnsupportedOpError(where, f"layer_norm with weight {w.dtype} and bias {b.dtype} of different dtypes")
        return lambda: f((rows,), (block,), args_) if rows else None

    def _op_rms_norm(self, args, outs, attrs, where):
        x = args[0]
        w = args[1] if len(args) > 1 else None
        o = outs[0]
        self._need_float(where, "rms_norm", x)
        cols = x.shape[-1] if x.ndim else 1
        rows, block = self._rows(x, cols)
        wt = w if w is not None else x
        f = self.func("cuda_norms.cu", f"rms_norm<{_ctype(x)},{_ctype(wt)}>")
        args_ = (x, wt, o, np.int32(cols), np.float32(attrs.get("eps", 1e-6)), np.int32(w is not None))
        return lambda: f((rows,), (block,), args_) if rows else None

    def _softmax(self, args, outs, attrs, where, log_out):
        x, o = args[0], outs[0]
        cp = self.cp
        self._need_float(where, "softmax", x)
        if x.ndim == 0:
            # one row of one element: 1 (0 for log_softmax), NaN for a NaN or infinite x (torch)
            x, o = x.reshape(1), o.reshape(1)
        dim = _norm_dim(int(attrs.get("dim", -1)), x.ndim)
        f = self.func("cuda_norms.cu", f"softmax_rows<{_ctype(x)}>")
        cols = x.shape[dim]
        rows, block = self._rows(x, cols)
        if not rows:
            return lambda: None
        flag = np.int32(1 if log_out else 0)
        if dim == x.ndim - 1:
            return lambda: f((rows,), (block,), (x, o, np.int32(cols), flag))

        def run():  # another dim: move it last (one copy each way)
            xt = cp.ascontiguousarray(cp.moveaxis(x, dim, -1))
            ot = cp.empty_like(xt)
            f((rows,), (block,), (xt, ot, np.int32(cols), flag))
            cp.copyto(o, cp.moveaxis(ot, -1, dim))
        return run

    def _op_softmax(self, args, outs, attrs, where):
        return self._softmax(args, outs, attrs, where, False)

    def _op_log_softmax(self, args, outs, attrs, where):
        return self._softmax(args, outs, attrs, where, True)

    # --- reductions --------------------------------------------------------------------------
    def _reduce_axes(self, x, attrs):
        dims = attrs.get("dims")
        if dims is None or len(dims) == 0:
            return tuple(range(x.ndim))  # torch: an empty dim list reduces everything
        return tuple(sorted(_norm_dim(int(d), x.ndim) for d in dims))

    def _reduction(self, name, args, outs, attrs, where):
        x, o = args[0], outs[0]
        cp = self.cp
        axes = self._reduce_axes(x, attrs)
        keep = bool(attrs.get("keepdim", False))
        if name == "amax":
            return lambda: cp.copyto(o, cp.amax(x, axis=axes, keepdims=keep).reshape(o.shape))
        acc = np.float32 if x.dtype.kind == "f" else np.int64  # fp32 accumulation of fp16 data
        f = cp.sum if name == "sum" else cp.mean
        if name == "mean" and x.dtype.kind != "f":
            acc = np.float32
        return lambda: cp.copyto(o, f(x, axis=axes, dtype=acc, keepdims=keep).reshape(o.shape), casting="unsafe")

    def _op_sum(self, args, outs, attrs, where):
        return self._reduction("sum", args, outs, attrs, where)

    def _op_mean(self, args, outs, attrs, where):
        return self._reduction("mean", args, outs, attrs, where)

    def _op_amax(self, args, outs, attrs, where):
        return self._reduction("amax", args, outs, attrs, where)

    def _op_argmax(self, args, outs, attrs, where):
        x, o = args[0], outs[0]
        cp = self.cp
        if x.ndim == 0:
            return lambda: o.fill(0)
        dim = _norm_dim(int(attrs.get("dim", -1)), x.ndim)
        if x.dtype.kind != "f":
            return lambda: cp.copyto(o, cp.argmax(x, axis=dim).reshape(o.shape), casting="unsafe")

        def run():
            # torch (and numpy): the first NaN is the maximum; said explicitly rather than
            # trusting the reduction's NaN handling.
            nan = cp.isnan(x)
            idx = cp.where(nan.any(axis=dim), cp.argmax(nan, axis=dim), cp.argmax(x, axis=dim))
            cp.copyto(o, idx.reshape(o.shape), casting="unsafe")
        return run

    # --- indexing and data movement ----------------------------------------------------------
    def _op_embedding(self, args, outs, attrs, where):
        w, ids = args
        o = outs[0]
        cp = self.cp
        if isinstance(w, PackedView):
            return self.quant.embedding(w, ids, o, where)
        # Out-of-range ids cannot raise inside a kernel; cupy.take wraps them. Export narrows
        # ids from a vocabulary, so this only matters for hostile inputs.
        return lambda: cp.take(w, ids, axis=0, out=o)

    def _alias_or_copy(self, x, o):
        cp = self.cp
        if x.data.ptr == o.data.ptr and x.nbytes == o.nbytes:
            return lambda: None  # the planner gave the alias the same storage: nothing to do
        return lambda: cp.copyto(o, x.reshape(o.shape))

    def _op_reshape(self, args, outs, attrs, where):
        return self._alias_or_copy(args[0], outs[0])

    def _op_copy(self, args, outs, attrs, where):
        x, o = args[0], outs[0]
        return lambda: self.cp.copyto(o, x, casting="unsafe")

    def _op_permute(self, args, outs, attrs, where):
        x, o = args[0], outs[0]
        dims = [_norm_dim(int(d), x.ndim) for d in attrs["dims"]]
        xt = x.transpose(dims)
        return lambda: self.cp.copyto(o, xt)

    def _op_expand(self, args, outs, attrs, where):
        x, o = args[0], outs[0]
        return lambda: self.cp.copyto(o, x)  # copyto broadcasts x to o's (already resolved) shape

    def _op_slice(self, args, outs, attrs, where):
        x, o = args[0], outs[0]
        dim = _norm_dim(int(attrs.get("dim", 0)), x.ndim)
        idx = [slice(None)] * x.ndim
        idx[dim] = slice(attrs.get("start"), attrs.get("end"), attrs.get("step", 1) or 1)
        view = x[tuple(idx)]
        return lambda: self.cp.copyto(o, view)

    def _op_cat(self, args, outs, attrs, where):
        o = outs[0]
        parts = [a for a in args if a is not None]
        dim = _norm_dim(int(attrs.get("dim", 0)), o.ndim)
        pairs, off = [], 0
        for a in parts:
            n = a.shape[dim]
            idx = [slice(None)] * o.ndim
            idx[dim] = slice(off, off + n)
            pairs.append((o[tuple(idx)], a))
            off += n

        def run():
            for dst, src in pairs:
                self.cp.copyto(dst, src, casting="unsafe")
        return run

    def _op_pad(self, args, outs, attrs, where):
        x, o = args[0], outs[0]
        pads = list(attrs.get("pads", []))
        value = attrs.get("value", 0.0)
        src = [slice(None)] * x.ndim
        dst = [slice(None)] * x.ndim
        for k in range(len(pads) // 2):
            d = x.ndim - 1 - k
            lo, hi = int(pads[2 * k]), int(pads[2 * k + 1])
            # Negative pads crop (torch's constant_pad_nd).
            s0, s1 = max(0, -lo), x.shape[d] - max(0, -hi)
            t0 = max(0, lo)
            src[d] = slice(s0, max(s0, s1))
            dst[d] = slice(t0, t0 + max(0, s1 - s0))
        sv, dv = x[tuple(src)], o[tuple(dst)]
        fill = value if o.dtype.kind == "f" else int(value)

        def run():
            o.fill(fill)
            if sv.size:
                self.cp.copyto(dv, sv)
        return run

    # --- attention and friends ---------------------------------------------------------------
    def _need_float(self, where, op, *xs):
        for a in xs:
            if a is not None and a.dtype.kind != "f":
                raise UnsupportedOpError(where, f"{op} on {a.dtype} data: the CUDA kernel takes float32 or float16")

    def _op_rope(self, args, outs, attrs, where):
        x, c, s = args
        o = outs[0]
        self._need_float(where, "rope", x, c, s)
        if c.dtype != s.dtype:
            raise UnsupportedOpError(where, f"rope with cos {c.dtype} and sin {s.dtype} of different dtypes")
        D = x.shape[-1]
        T = x.shape[-2] if x.ndim >= 2 else 1
        n = x.size
        f = self.func("cuda_rope.cu", f"rope<{_ctype(x)},{_ctype(c)}>")
        grid = ((n + _BLOCK - 1) // _BLOCK,)
        a = (x, c, s, o, np.int64(n), np.int32(T), np.int32(D))
        return lambda: f(grid, (_BLOCK,), a) if n else None

    def _op_kv_update(self, args, outs, attrs, where):
        cache, new, pos = args
        o = outs[0]
        cp = self.cp
        B, H, S, D = cache.shape
        Tn = new.shape[2]
        n = new.size
        if cache.dtype.itemsize == 4:
            e = "unsigned int"
        elif cache.dtype.itemsize == 2:
            e = "half_t"
        else:
            raise UnsupportedOpError(where, f"kv_update on {cache.dtype}")
        f = self.func("cuda_rope.cu", f"kv_update<{e}>")
        grid = ((n + _BLOCK - 1) // _BLOCK,)
        same_storage = o.data.ptr == cache.data.ptr
        newc = new if new.dtype == cache.dtype else None

        def run():
            if not same_storage:  # planner kept the alias apart: carry the old cache over first
                cp.copyto(o, cache)
            src = newc if newc is not None else new.astype(o.dtype)
            if n:
                f(grid, (_BLOCK,), (o, src, pos, np.int64(n), np.int32(S), np.int32(Tn), np.int32(D)))
        return run

    def sdpa_partials(self, args, o, attrs, where) -> Optional[SdpaPartials]:
        """The attention's first kernel alone where it runs split over the keys (decode): sdpa_tile
        writing its partials, which the caller merges itself (the o product's prologue,
        QuantKernels.gemv_attn) instead of sdpa_combine. ``o``: the attention's planned output
        (its shape and dtype). None where the attention runs otherwise (one split, tensor cores,
        the composite path, nothing to compute)."""
        got = self._op_sdpa(args, [o], attrs, where, partials=True)
        return got if isinstance(got, SdpaPartials) else None

    def _op_sdpa(self, args, outs, attrs, where, out_bthd: bool = False, partials: bool = False):
        """``out_bthd``: write the output as [B, Tq, H, Dv] (``outs[0]`` has that shape), the
        layout of a following permute(0, 2, 1, 3) that the fusion step folded in. ``partials``:
        see sdpa_partials (anything but an SdpaPartials then means it does not apply)."""
        q, k, v = args[0], args[1], args[2]
        mask = args[3] if len(args) > 3 else None
        o = outs[0]
        cp = self.cp
        self._need_float(where, "sdpa", q, k, v)
        B, H, Tq, D = q.shape
        Hk, Tk, Dv = k.shape[1], k.shape[2], v.shape[3]
        if H % Hk:
            raise UnsupportedOpError(where, f"sdpa with {H} query heads over {Hk} kv heads (not a multiple)")
        scale = attrs.get("scale")
        scale = np.float32(1.0 / math.sqrt(D) if scale is None else scale)
        causal = bool(attrs.get("causal", False))
        coff = int(attrs.get("causal_offset", 0))
        if o.size == 0:
            return lambda: None
        if Tk == 0:  # no keys: every row is fully masked, zeros (torch)
            return lambda: o.fill(0)
        fused = q.dtype == k.dtype == v.dtype == o.dtype and all(a.flags.c_contiguous for a in (q, k, v, o))
        # sdpa_mma reads q, k, v 8 halves (16 bytes) at a time
        aligned16 = all(a.data.ptr % 16 == 0 for a in (q, k, v))
        lp = sdpa_launch(B, H, Hk, Tq, Tk, D, Dv, self.max_shared, self.sm_count, fp16=q.dtype == np.float16,
                         tensor_cores=self.sdpa_tensor_cores if aligned16 else False) if fused else None
        fused = lp is not None
        if not fused:
            if out_bthd:
                tmp = cp.empty((B, H, Tq, Dv), o.dtype)
                comp = self._sdpa_composite(q, k, v, mask, tmp, float(scale), causal, coff)

                def run_perm():
                    comp()
                    cp.copyto(o, tmp.transpose(0, 2, 1, 3))
                return run_perm
            return self._sdpa_composite(q, k, v, mask, o, float(scale), causal, coff)
        bthd = np.int32(1 if out_bthd else 0)
        mkind, mptr, ms = self._sdpa_mask(q, mask, Tk, where)
        T = _ctype(q)
        if lp.kernel == "mma":
            f = self._sdpa_func(f"sdpa_mma<{D},{Dv}>")
            a = (q, k, v, mptr, o, np.int32(H), np.int32(Hk), np.int32(Tq), np.int32(Tk), np.int32(D), np.int32(Dv),
                 np.int32(mkind), np.int64(ms[0]), np.int64(ms[1]), np.int64(ms[2]), np.int64(ms[3]),
                 np.int32(causal), np.int32(coff), scale, bthd)
            grid, smem = lp.grid, lp.smem
            return lambda: f(grid, (SDPA_THREADS,), a, shared_mem=smem)
        f = self._sdpa_func(f"sdpa_tile<{T},{lp.bk},{lp.no},{lp.br}>")
        if lp.splits > 1:
            # Partial outputs of the splits: made once here, so graph replays reuse them.
            part_o = cp.empty((lp.splits, lp.rows, Dv), np.float32)
            part_ml = cp.empty((lp.splits, lp.rows, 2), np.float32)
            comb = self._sdpa_func(f"sdpa_combine<{T}>")
            n = lp.rows * Dv
            cgrid = ((n + _BLOCK - 1) // _BLOCK,)
            cargs = (part_o, part_ml, o, np.int64(lp.rows), np.int32(Dv), np.int32(lp.splits), np.int32(H),
                     np.int32(Tq), bthd)
        else:
            part_o = part_ml = o  # not read: the kernel writes `out` directly with one split
        # 4-element loads need rows of 4k elements and 4-element aligned bases (the arena aligns
        # buffers to 256 bytes, but a view may start anywhere).
        vec4 = D % 4 == 0 and Dv % 4 == 0 and all(a.data.ptr % (4 * a.itemsize) == 0 for a in (k, v))
        a = (q, k, v, mptr, o, part_o, part_ml, np.int32(H), np.int32(Hk), np.int32(Tq), np.int32(Tk), np.int32(D),
             np.int32(Dv), np.int32(lp.tiles_per_split), np.int32(vec4), np.int32(mkind),
             np.int64(ms[0]), np.int64(ms[1]), np.int64(ms[2]), np.int64(ms[3]),
             np.int32(causal), np.int32(coff), scale, bthd)
        grid, block, smem = lp.grid, (SDPA_THREADS,), lp.smem
        if partials:
            if lp.splits == 1:
                return None
            return SdpaPartials(lambda: f(grid, block, a, shared_mem=smem), part_o, part_ml, lp.rows, Dv, lp.splits)
        if lp.splits == 1:
            return lambda: f(grid, block, a, shared_mem=smem)

        def run():
            f(grid, block, a, shared_mem=smem)
            comb(cgrid, (_BLOCK,), cargs)
        return run

    def _sdpa_mask(self, q, mask, Tk: int, where):
        """(kind, pointer, element strides over [B, H, Tq, Tk]) of an sdpa's mask, as the kernels
        take it: kind 0 none, 1 bool (uint32 0/1 keep-mask), 2 float32 additive, 3 float16."""
        if mask is None:
            return 0, q, (0, 0, 0, 0)
        if mask.ndim > 4:
            raise UnsupportedOpError(where, f"sdpa mask of rank {mask.ndim}")
        kind = 1 if mask.dtype == np.uint32 else (2 if mask.dtype == np.float32 else 3)
        B, H, Tq, _ = q.shape
        mb = self.cp.broadcast_to(mask, (B, H, Tq, Tk))
        return kind, mask, tuple(st // mask.itemsize for st in mb.strides)

    def sdpa_early_keys(self, args, o, attrs, where, fresh: FreshRows) -> Optional[Callable[[], None]]:
        """The decode attention reading its cache rows before the wait (sdpa_early_keys in
        cuda_attention.cu; ``fresh``: the executor's fact that allows it), writing ``o``
        [B, H, 1, Dv]; None where the kernel does not take the shapes (early_keys_fit), the
        dtypes differ, a tensor is not contiguous or a cache row not 16-byte aligned."""
        q, k, v = args[0], args[1], args[2]
        mask = args[3] if len(args) > 3 else None
        B, H, Tq, D = q.shape
        Hk, Tk, Dv = k.shape[1], k.shape[2], v.shape[3]
        if (not q.dtype == k.dtype == v.dtype == o.dtype or q.dtype.kind != "f" or H % Hk or o.size == 0
                or not early_keys_fit(Tq, Tk, D, Dv, q.itemsize) or k.shape[3] != D or v.shape[2] != Tk
                or tuple(o.shape) != (B, H, Tq, Dv)
                or not all(a.flags.c_contiguous for a in (q, k, v, o)) or k.data.ptr % 16 or v.data.ptr % 16
                or fresh.pos.dtype != np.int32 or fresh.pos.size < 1):
            return None
        self._need_float(where, "sdpa", q, k, v)
        scale = attrs.get("scale")
        scale = np.float32(1.0 / math.sqrt(D) if scale is None else scale)
        mkind, mptr, ms = self._sdpa_mask(q, mask, Tk, where)
        f = self._sdpa_func(f"sdpa_early_keys<{_ctype(q)},{D},{Dv}>")
        a = (q, k, v, mptr, o, fresh.pos, np.int32(H), np.int32(Hk), np.int32(Tk), np.int32(fresh.n), np.int32(mkind),
             np.int64(ms[0]), np.int64(ms[1]), np.int64(ms[2]), np.int64(ms[3]),
             np.int32(bool(attrs.get("causal", False))), np.int32(int(attrs.get("causal_offset", 0))), scale,
             np.int32(0))
        grid, block = (H, B), (-(-Tk // 32) * 32,)
        return lambda: f(grid, block, a)

    def _sdpa_func(self, expr: str):
        """One sdpa instantiation, compiled alone on first use (a session needs one or two of
        the 32 tile variants and the mma ones; compiling all of them would cost every session start seconds)."""
        f = self._funcs.get(("sdpa", expr))
        if f is None:
            code = self._common() + "\n" + shaders.source("cuda_attention.cu")
            f = self._compiled(self.cp.RawModule(code=code, name_expressions=[expr]).get_function(expr))
            self._funcs[("sdpa", expr)] = f
        return f

    @property
    def sm_count(self) -> int:
        if self._sm_count is None:
            dev = self.cp.cuda.Device()
            self._sm_count = int(self.cp.cuda.runtime.getDeviceProperties(dev.id)["multiProcessorCount"])
        return self._sm_count

    def _sdpa_composite(self, q, k, v, mask, o, scale, causal, coff):
        """matmul + softmax + matmul in fp32, for key lengths whose scores do not fit in shared
        memory (or mixed dtypes)."""
        cp = self.cp
        B, H, Tq, D = q.shape
        Hk, Tk, Dv = k.shape[1], k.shape[2], v.shape[3]
        G = H // Hk

        def run():
            qq = q.astype(np.float32).reshape(B, Hk, G, Tq, D)
            kk = k.astype(np.float32).reshape(B, Hk, 1, Tk, D)
            vv = v.astype(np.float32).reshape(B, Hk, 1, Tk, Dv)
            s = cp.empty((B, Hk, G, Tq, Tk), np.float32)
            self.blas.plan_matmul(qq, kk.swapaxes(-1, -2), s)()
            s = s.reshape(B, H, Tq, Tk) * scale
            if mask is not None:
                if mask.dtype == np.uint32:
                    s = cp.where(mask != 0, s, -np.inf)
                else:
                    s = s + mask.astype(np.float32)
            if causal:
                keep = cp.arange(Tk)[None, :] <= (cp.arange(Tq)[:, None] + coff)
                s = cp.where(keep, s, -np.inf)
            # A fully masked row (every score -inf) gives zeros, as the fused kernels and torch do;
            # a NaN score still makes its row NaN.
            m = s.max(axis=-1, keepdims=True)
            p = cp.exp(s - cp.where(m == -np.inf, 0, m))
            d = p.sum(axis=-1, keepdims=True)
            p /= cp.where(d == 0, 1, d)
            r = cp.empty((B, Hk, G, Tq, Dv), np.float32)
            self.blas.plan_matmul(p.reshape(B, Hk, G, Tq, Tk), vv, r)()
            cp.copyto(o, r.reshape(B, H, Tq, Dv), casting="unsafe")
        return run
