"""Conformance cases: small programs (one op, or a chain that exercises memory reuse, prepack and
aliasing) with seeded random inputs, and the float64 answer from the reference kernels.

A case names its leaves (method inputs or constants) and its nodes by string; ``float`` as a
dtype means the case's storage dtype (float32 or float16). Dims are small primes (3, 5, 7, 11,
13) so that no executor passes by luck of a power-of-two tile. Inputs are never zero (values with
|x| < 0.1 are pushed away), so a kernel that forgets an operand cannot match; the edge samples
generated from these cases at the end (edges.py) add zeros, NaN, infinities, empty and 0-d
tensors on purpose.

``tolerance(case)`` gives the comparison bounds, with the reason beside each number.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from gpudelegate import dtypes, ops
from gpudelegate.native.quant import PackedWeight, byte_shape, quantize
from gpudelegate.native.reference_kernels import KERNELS
from gpudelegate.program import DELEGATE_OP, Method, Node, Payload, PrepackEntry, Program, Value


@dataclass
class Leaf:
    """A method input (``kind="input"``) or a constant: read directly by ops (``"const"``), or
    through a prepack entry with the identity (``"prepack"``) or float16 (``"prepack_fp16"``)
    layout. A packed dtype (``q4_0``, ``q4_1``, ``q8_0``: a weight of linear or embedding) is a
    constant holding seeded normal floats quantized by ``native.quant.quantize``."""

    name: str
    dtype: str  # "float" = the case's storage float dtype; a packed dtype = GGUF blocks
    shape: Tuple[int, ...]
    gen: str = "normal"  # see _generate
    kind: str = "input"
    lo: int = 0
    hi: int = 0


@dataclass
class Op:
    op: str
    args: List[Optional[str]]  # leaf / earlier output names; None = absent optional
    attrs: dict = field(default_factory=dict)
    out: str = ""


@dataclass
class Case:
    id: str
    leaves: List[Leaf]
    ops: List[Op]
    outputs: List[str]
    storage: str = "float32"
    red: int = 1  # longest reduction (dot length, window, normalized size): scales tolerances
    strided: bool = False  # method inputs are handed to run() as non-contiguous views (edges.py)

    @property
    def op_names(self) -> List[str]:
        return [o.op for o in self.ops]


# --------------------------------------------------------------------------- data

def _generate(leaf: Leaf, dtype: str, rng: np.random.Generator) -> np.ndarray:
    shape = leaf.shape
    g = leaf.gen
    if g in ("normal", "small"):
        x = rng.standard_normal(shape)
        x = np.where(np.abs(x) < 0.1, np.where(x < 0, -0.1, 0.1), x)  # never (near) zero
        if g == "small":
            x = x * 0.5
    elif g == "positive":
        x = rng.uniform(0.5, 2.0, shape)
    elif g == "round":  # one decimal: comparisons see exact ties
        x = np.round(rng.uniform(-2, 2, shape), 1)
        x = np.where(x == 0, 0.5, x)
    elif g == "int":  # nonzero ints in [lo, hi)
        x = rng.integers(leaf.lo, leaf.hi, shape)
        x = np.where(x == 0, leaf.hi - 1, x)
    elif g == "ids":
        x = rng.integers(leaf.lo, leaf.hi, shape)
    elif g == "value":  # a fixed value (positions)
        x = np.full(shape, leaf.lo)
    elif g == "bool":
        x = rng.random(shape) < 0.6
    elif g == "keep":  # a keep-mask with column 0 kept: no fully masked attention row
        x = np.asarray(rng.random(shape) < 0.6)
        if x.ndim == 0:
            x = np.asarray(True)
        elif x.size:
            x[..., 0] = True
    elif g in SPECIAL_GENS:
        x = SPECIAL_GENS[g](shape, rng)
    elif g == "angle":  # cos/sin tables of rope
        x = np.cos(rng.uniform(0, 6.3, shape)) if "cos" in leaf.name else np.sin(rng.uniform(0, 6.3, shape))
    else:
        raise ValueError(f"unknown generator {g!r}")
    return _as_dtype(x, dtype)


# Edge values (edges.py): every special float, and the integers and floats where casts round,
# overflow or truncate. Each generator places its values at random positions of an otherwise
# "normal" tensor, a third of the elements at least, every value at least once when there is room.
SPECIALS = (np.nan, np.inf, -np.inf, -0.0, 0.0)
INT_EXTREMES = (-2**31, 2**31 - 1, -1, 0, 1, 2**24 + 1, -(2**24 + 1), 65504, 65519, 65520, -65520, 2**31 - 128)
# Floats that are exact in float32 and inside the int32 range (float->int32 outside it, NaN and inf
# included, is undefined in C and in PyTorch: not a sample), with halves that show truncation.
INT_RANGE_FLOATS = (-2147483648.0, 2147483520.0, -2147483520.0, 16777216.0, -0.0, 0.0, 0.5, -0.5, 1.5, -1.5,
                    2.9999998, -2.9999998)
# float32 -> float16 overflow and rounding: 65519 rounds to 65504, 65520 overflows to inf.
F16_EDGE_FLOATS = (65504.0, 65519.0, 65520.0, -65520.0, 1e5, -1e5)


def _sprinkle(values):
    def gen(shape, rng):
        x = rng.standard_normal(shape)
        x = np.where(np.abs(x) < 0.1, np.where(x < 0, -0.1, 0.1), x)
        flat = x.reshape(-1)
        n = flat.size
        if n:
            k = min(n, max(len(values), n // 3))
            pos = rng.permutation(n)[:k]
            flat[pos] = np.resize(np.asarray(values, np.float64), k)
        return flat.reshape(shape)
    return gen


SPECIAL_GENS = {
    "special": _sprinkle(SPECIALS),
    "int_extreme": _sprinkle(INT_EXTREMES),
    "int_range": _sprinkle(INT_RANGE_FLOATS),
    "f16_edge": _sprinkle(F16_EDGE_FLOATS + SPECIALS),
}

_NP = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "bool": np.bool_}


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _as_dtype(x, dtype: str) -> np.ndarray:
    # np.array(order="C"), not ascontiguousarray: that one makes a 0-d array 1-d.
    with np.errstate(invalid="ignore", over="ignore"):
        return np.array(np.asarray(x).astype(_NP[dtype]), order="C")


def leaf_dtype(case: Case, leaf: Leaf) -> str:
    return case.storage if leaf.dtype == "float" else leaf.dtype


def seed_of(case: Case, run: int = 0) -> int:
    return zlib.crc32(f"{case.id}#{run}".encode())


def make_data(case: Case, run: int = 0) -> Dict[str, np.ndarray]:
    """Fresh data for every leaf, in the dtype the program stores it (``prepack_fp16`` leaves are
    float32 constants: the executor packs them)."""
    rng = np.random.default_rng(seed_of(case, run))
    out = {}
    for leaf in case.leaves:
        dt = "float32" if leaf.kind == "prepack_fp16" else leaf_dtype(case, leaf)
        if dtypes.is_packed(dt):  # the file's bytes: uint8 [rows, row bytes]
            x = _generate(leaf, "float32", rng)
            out[leaf.name] = quantize(dt, x) if x.size else np.zeros(byte_shape(dt, leaf.shape), np.uint8)
            continue
        out[leaf.name] = _generate(leaf, dt, rng)
    return out


def leaf_value(case: Case, leaf: Leaf, x: np.ndarray):
    """What the reference kernels read for a leaf holding ``x``: a PackedWeight for packed
    weights (the kernels dequantize it with gguf), else the values the device holds in float64."""
    dt = leaf_dtype(case, leaf)
    if dtypes.is_packed(dt):
        return PackedWeight(dt, leaf.shape, x)
    if leaf.kind == "prepack_fp16":
        x = x.astype(np.float16)
    return x.astype(np.float64) if x.dtype.kind == "f" else x


def golden(case: Case, data: Dict[str, np.ndarray]) -> List[np.ndarray]:
    """The case's outputs from the reference kernels in float64, on exactly the values the
    program holds (float16-stored and fp16-packed values rounded as the device sees them)."""
    env: Dict[str, np.ndarray] = {leaf.name: leaf_value(case, leaf, data[leaf.name]) for leaf in case.leaves}
    for o in case.ops:
        (env[o.out],) = KERNELS[o.op]([None if a is None else env[a] for a in o.args], o.attrs)
    return [env[n] for n in case.outputs]


# --------------------------------------------------------------------------- programs

def build_program(case: Case, data: Dict[str, np.ndarray]) -> Tuple[Program, List[str]]:
    """A program with one method ``forward`` calling one payload that holds the case's graph.
    Returns it and the names of the method inputs, in order."""
    prog = Program(constants=[], payloads=[], methods={}, metadata={"case": case.id})
    values: List[Value] = []
    ids: Dict[str, int] = {}
    inputs: List[int] = []
    prepack: List[PrepackEntry] = []
    input_names: List[str] = []

    def new(dtype, shape, name="", constant=None) -> int:
        values.append(Value(dtype, tuple(shape), constant, name))
        return len(values) - 1

    for leaf in case.leaves:
        x = data[leaf.name]
        dt = leaf_dtype(case, leaf)
        if leaf.kind == "input":
            ids[leaf.name] = new(dt, leaf.shape, leaf.name)
            inputs.append(ids[leaf.name])
            input_names.append(leaf.name)
            continue
        stored = "float32" if leaf.kind == "prepack_fp16" else dt
        store = x.astype(np.uint32) if stored == "bool" else x  # a packed leaf's x is its bytes
        c = prog.add_constant(stored, leaf.shape, np.ascontiguousarray(store).tobytes())
        src = new(stored, leaf.shape, leaf.name, constant=c)
        if leaf.kind == "const":
            ids[leaf.name] = src
        elif leaf.kind in ("prepack", "prepack_fp16"):
            layout = "fp16" if leaf.kind == "prepack_fp16" else "identity"
            dst = new("float16" if layout == "fp16" else stored, leaf.shape, leaf.name + ".packed")
            prepack.append(PrepackEntry(src, dst, layout))
            ids[leaf.name] = dst
        else:
            raise ValueError(f"{case.id}: unknown leaf kind {leaf.kind!r}")
    nodes = []
    for o in case.ops:
        args = [-1 if a is None else ids[a] for a in o.args]
        (dt, shape), = ops.infer(o.op, [None if a == -1 else values[a] for a in args], o.attrs)
        ids[o.out] = new(dt, shape, o.out)
        nodes.append(Node(o.op, args, [ids[o.out]], dict(o.attrs)))
    outputs = [ids[n] for n in case.outputs]
    prog.payloads.append(Payload(values, inputs, outputs, nodes, prepack=prepack))

    mvals = [Value(values[i].dtype, values[i].shape, None, values[i].name) for i in inputs]
    mouts = [Value(values[i].dtype, values[i].shape, None, values[i].name) for i in outputs]
    n_in = len(mvals)
    method = Method(mvals + mouts, list(range(n_in)), list(range(n_in, n_in + len(mouts))),
                    [Node(DELEGATE_OP, list(range(n_in)), list(range(n_in, n_in + len(mouts))), {"payload": 0})],
                    name="forward")
    prog.methods["forward"] = method
    return prog, input_names


# --------------------------------------------------------------------------- tolerances

def tolerance(case: Case) -> Tuple[float, float]:
    """(rtol, atol) for comparing an executor's float outputs with the float64 golden answer.

    float32 storage: every op computes in float32 (eps 6e-8). A length-K reduction of O(1)
    terms has a result of size ~sqrt(K) and an error of a few eps*K in the worst case, so
    rtol 1e-4 plus atol 1e-5*sqrt(K) leaves an order of magnitude of room for any summation
    order (tiled, split-K, tree) while catching every indexing bug, which is off by O(1).
    Transcendentals on GPUs (fast exp/tanh/erf) are within ~1e-6 relative, inside that.

    float16 storage: inputs are rounded to fp16 before the golden is computed, but every
    intermediate and the output are rounded to fp16 (unit roundoff 4.9e-4) on the device and
    not in the golden; a chain of a few ops accumulates a few of those, hence rtol 1e-2 and an
    atol of 2e-3*sqrt(K) for values near zero after cancellation.

    Packed weights (q4_0, q4_1, q8_0) take the bounds of their activations' storage: the golden
    reads gguf's float32 dequantized values, and a kernel's are exact in float32 too (q * d is a
    4- or 8-bit integer times an 11-bit f16 mantissa; q4_1's + m rounds once, fma or not, so at
    most 1 ulp of the weight if a compiler rounds it differently, ~6e-8 relative), so what is
    left is the float32 accumulation over K, which the sqrt(K) atol above is for."""
    k = max(1, case.red) ** 0.5
    if case.storage == "float16" or any(l.kind == "prepack_fp16" for l in case.leaves):
        return 1e-2, 2e-3 * k
    return 1e-4, 1e-5 * k


# --------------------------------------------------------------------------- the cases

CASES: List[Case] = []


def _add(case: Case) -> None:
    if any(c.id == case.id for c in CASES):
        raise ValueError(f"duplicate case id {case.id}")
    CASES.append(case)


def one(op: str, leaves: Sequence[Leaf], attrs: Optional[dict] = None, tag: str = "",
        storages=("float32",), red: int = 1, args: Optional[Sequence[Optional[str]]] = None) -> None:
    """A one-op case per storage dtype; args default to the leaves in order."""
    for st in storages:
        names = list(args) if args is not None else [l.name for l in leaves]
        cid = f"{op}/{tag or 'basic'}/{st}"
        _add(Case(cid, list(leaves), [Op(op, names, dict(attrs or {}), "y")], ["y"], st, red))


def L(name, shape, dtype="float", gen="normal", kind="input", lo=0, hi=0) -> Leaf:
    return Leaf(name, dtype, tuple(shape), gen, kind, lo, hi)


BOTH = ("float32", "float16")

# elementwise binary -------------------------------------------------------------
for op in ("add", "sub", "mul", "div", "pow", "maximum", "minimum"):
    a_gen = "positive" if op == "pow" else "normal"
    b_gen = "small" if op == "pow" else "normal"
    one(op, [L("a", (5, 7), gen=a_gen), L("b", (5, 7), gen=b_gen)], tag="same", storages=BOTH)
    one(op, [L("a", (3, 1, 7), gen=a_gen), L("b", (5, 1), gen=b_gen)], tag="broadcast", storages=BOTH)
    one(op, [L("a", (11, 3), gen=a_gen), L("b", (), gen=b_gen, kind="const")], tag="const_scalar")
    hi = 4 if op == "pow" else 9
    one(op, [L("a", (5, 7), "int32", "int", lo=-9, hi=10), L("b", (7,), "int32", "int", lo=1, hi=hi)], tag="int32")

for op in ("eq", "ne", "lt", "le", "gt", "ge"):
    one(op, [L("a", (5, 7), gen="round"), L("b", (7,), gen="round")], tag="float", storages=BOTH)
    one(op, [L("a", (3, 5), "int32", "int", lo=-3, hi=4), L("b", (3, 1), "int32", "int", lo=-3, hi=4)], tag="int32")
for op in ("eq", "ne"):
    one(op, [L("a", (5, 7), "bool", "bool"), L("b", (7,), "bool", "bool")], tag="bool")

one("logical_and", [L("a", (5, 7), "bool", "bool"), L("b", (5, 1), "bool", "bool")])
one("logical_or", [L("a", (3, 5), "bool", "bool"), L("b", (5,), "bool", "bool")])
one("logical_not", [L("a", (7, 3), "bool", "bool")])

one("where", [L("c", (5, 1), "bool", "bool"), L("a", (7,)), L("b", (5, 7))], tag="broadcast", storages=BOTH)
one("where", [L("c", (3, 5), "bool", "bool"), L("a", (3, 5), "int32", "int", lo=-5, hi=5),
              L("b", (5,), "int32", "int", lo=-5, hi=5)], tag="int32")

# elementwise unary -------------------------------------------------------------
_DOMAIN = {"log": "positive", "sqrt": "positive", "rsqrt": "positive"}
for op in ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu", "silu",
           "erf", "reciprocal"):
    one(op, [L("x", (7, 11), gen=_DOMAIN.get(op, "normal"))], storages=BOTH)
for op in ("neg", "abs", "relu"):
    one(op, [L("x", (5, 7), "int32", "int", lo=-9, hi=10)], tag="int32")
for approx in ("none", "tanh"):
    one("gelu", [L("x", (7, 13))], {"approximate": approx}, tag=approx, storages=BOTH)
one("gelu", [L("x", (3, 5))], tag="default")
one("hardtanh", [L("x", (5, 11))], tag="default", storages=BOTH)
one("hardtanh", [L("x", (5, 11))], {"min_val": 0.0, "max_val": 6.0}, tag="relu6")

for src, dst, gen in (("float", "int32", "normal"), ("float", "bool", "round"), ("int32", "float32", "int"),
                      ("bool", "float32", "bool"), ("float32", "float16", "normal"), ("float16", "float32", "normal"),
                      ("int32", "bool", "int"), ("bool", "int32", "bool")):
    one("cast", [L("x", (5, 7), src, gen, lo=-9, hi=10)], {"dtype": dst}, tag=f"{src}_to_{dst}")

# linear algebra ----------------------------------------------------------------
one("matmul", [L("a", (5, 7)), L("b", (7, 3))], tag="2d", storages=BOTH, red=7)
one("matmul", [L("a", (3, 1, 5, 7)), L("b", (2, 7, 3))], tag="batch_broadcast", storages=BOTH, red=7)
one("matmul", [L("a", (7,)), L("b", (7, 3))], tag="vec_mat", red=7)
one("matmul", [L("a", (5, 7)), L("b", (7,))], tag="mat_vec", red=7)
one("matmul", [L("a", (3, 131)), L("b", (131, 5))], tag="long_k", storages=BOTH, red=131)
one("matmul", [L("a", (5, 7)), L("b", (7, 3), kind="const")], tag="const_b", red=7)

one("linear", [L("x", (2, 3, 13)), L("w", (5, 13), kind="prepack"), L("b", (5,), kind="prepack")],
    tag="bias_prepack", storages=BOTH, red=13)
one("linear", [L("x", (7, 13)), L("w", (11, 13), kind="const")], tag="nobias_const", red=13,
    args=["x", "w", None])
one("linear", [L("x", (7, 13)), L("w", (11, 13), kind="prepack_fp16"), L("b", (11,), kind="prepack_fp16")],
    tag="prepack_fp16", red=13)
one("linear", [L("x", (7, 13)), L("w", (11, 13)), L("b", (11,))], tag="all_inputs", red=13)

# Packed GGUF weights (q4_0, q4_1, q8_0; blocks of 32 along K). For each type, one case per M
# in {1, 3, 5, 8 (decode kernels), 17, 33 (tiled)}, with N (prime) and K (a multiple of 32: 1,
# 3, 5 and 18 blocks, so q4_0/q8_0 rows start at odd half-words) rotating so that each type
# meets every N and K, and bias/no bias x prepacked/plain constant in all four pairings.
PACKED = ("q4_0", "q4_1", "q8_0")
_PACKED_M = ((1,), (3,), (5,), (2, 4), (17,), (3, 11))  # x's leading dims: M = 1, 3, 5, 8, 17, 33
for _i, _qt in enumerate(PACKED):
    for _j, _lead in enumerate(_PACKED_M):
        _n, _k = (7, 13, 37)[(_i + _j) % 3], (32, 96, 160, 576)[(_i + _j) % 4]
        _bias, _kind = _j % 2 == 0, ("prepack", "const")[(_j // 2) % 2]
        _leaves = [L("x", _lead + (_k,)), L("w", (_n, _k), _qt, kind=_kind)] + ([L("b", (_n,), kind=_kind)] if _bias else [])
        one("linear", _leaves, tag=f"{_qt}_m{_numel(_lead)}_n{_n}_k{_k}{'_bias' if _bias else ''}_{_kind}", red=_k,
            args=["x", "w", "b" if _bias else None])
# float16 activations (and bias) with packed weights: the output is float16.
one("linear", [L("x", (5, 96)), L("w", (13, 96), "q4_0", kind="prepack"), L("b", (13,), kind="prepack")],
    tag="q4_0_f16_act_gemv", storages=("float16",), red=96)
one("linear", [L("x", (17, 160)), L("w", (7, 160), "q8_0", kind="const")], tag="q8_0_f16_act_tiled",
    storages=("float16",), red=160, args=["x", "w", None])

_CONV = [
    ("plain", (1, 3, 7, 11), (5, 3, 3, 3), {}, False),
    ("stride_pad_bias", (2, 3, 11, 13), (5, 3, 3, 3), {"stride": [2, 2], "padding": [1, 1]}, True),
    ("dilation", (1, 3, 11, 13), (5, 3, 3, 2), {"dilation": [2, 1], "padding": [2, 0], "stride": [1, 2]}, True),
    ("groups", (1, 6, 7, 11), (4, 3, 3, 3), {"groups": 2, "padding": [1, 1]}, True),
    ("depthwise", (1, 5, 11, 7), (5, 1, 3, 3), {"groups": 5, "padding": [1, 1], "stride": [2, 2]}, True),
    ("pointwise", (1, 7, 5, 3), (11, 7, 1, 1), {}, True),
]
for tag, xs, ws, attrs, bias in _CONV:
    red = ws[1] * ws[2] * ws[3]
    leaves = [L("x", xs), L("w", ws, kind="prepack"), L("b", (ws[0],), kind="prepack")]
    one("conv2d", leaves if bias else leaves[:2], attrs, tag=tag, storages=BOTH, red=red)

_POOL = [
    ("k2", {"kernel": [2, 2]}),
    ("k3s2p1", {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1]}),
    ("ceil", {"kernel": [3, 3], "stride": [2, 2], "ceil_mode": True}),
    ("rect_ceil_pad", {"kernel": [3, 2], "stride": [2, 1], "padding": [1, 1], "ceil_mode": True}),
]
for tag, attrs in _POOL:
    one("max_pool2d", [L("x", (2, 3, 11, 13))], attrs, tag=tag, storages=BOTH, red=9)
    one("avg_pool2d", [L("x", (2, 3, 11, 13))], attrs, tag=tag, storages=BOTH, red=9)
one("max_pool2d", [L("x", (1, 3, 13, 11))], {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1],
                                              "dilation": [2, 2]}, tag="dilation", red=9)
one("avg_pool2d", [L("x", (1, 3, 11, 13))], {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1],
                                              "count_include_pad": False}, tag="exclude_pad", storages=BOTH, red=9)
one("avg_pool2d", [L("x", (1, 3, 11, 13))], {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1], "ceil_mode": True,
                                              "count_include_pad": False}, tag="ceil_exclude_pad", red=9)

# normalization -----------------------------------------------------------------
one("batch_norm", [L("x", (2, 5, 7, 3)), L("mean", (5,), kind="const"), L("var", (5,), gen="positive", kind="const"),
                   L("w", (5,), kind="const"), L("b", (5,), kind="const")], {"eps": 1e-3}, tag="affine", storages=BOTH)
one("batch_norm", [L("x", (3, 7, 5)), L("mean", (7,)), L("var", (7,), gen="positive")], tag="plain_rank3")
one("layer_norm", [L("x", (3, 5, 11)), L("w", (11,), kind="prepack"), L("b", (11,), kind="prepack")],
    {"normalized_shape": [11]}, tag="affine", storages=BOTH, red=11)
one("layer_norm", [L("x", (3, 5, 11)), L("w", (5, 11)), L("b", (5, 11))], {"normalized_shape": [5, 11], "eps": 1e-3},
    tag="2d", red=55)
one("layer_norm", [L("x", (7, 13))], {"normalized_shape": [13]}, tag="plain", red=13)
one("layer_norm", [L("x", (7, 13)), L("b", (13,))], {"normalized_shape": [13]}, tag="bias_only", red=13,
    args=["x", None, "b"])
one("rms_norm", [L("x", (3, 5, 13)), L("w", (13,), kind="prepack")], tag="weight", storages=BOTH, red=13)
one("rms_norm", [L("x", (7, 11))], {"eps": 1e-5}, tag="plain", red=11)

for op in ("softmax", "log_softmax"):
    one(op, [L("x", (5, 7, 3))], tag="last", storages=BOTH, red=3)
    one(op, [L("x", (5, 7, 3))], {"dim": 0}, tag="dim0", red=5)
    one(op, [L("x", (3, 131))], {"dim": 1}, tag="long", storages=BOTH, red=131)

# reductions ------------------------------------------------------------------------
for op in ("sum", "mean", "amax"):
    one(op, [L("x", (5, 7, 3))], {"dims": [-1]}, tag="last", storages=BOTH, red=3)
    one(op, [L("x", (5, 7, 3))], {"dims": [0, 2], "keepdim": True}, tag="keepdim", red=15)
    one(op, [L("x", (5, 7, 3))], tag="all", red=105)
    one(op, [L("x", (3, 131))], {"dims": [1]}, tag="long", storages=BOTH, red=131)
one("sum", [L("x", (5, 7), "int32", "int", lo=-20, hi=20)], {"dims": [1]}, tag="int32")
one("amax", [L("x", (5, 7), "int32", "int", lo=-20, hi=20)], {"dims": [0]}, tag="int32")
one("argmax", [L("x", (5, 7, 3))], tag="last", storages=BOTH)
one("argmax", [L("x", (5, 7, 3))], {"dim": 1, "keepdim": True}, tag="keepdim")
one("argmax", [L("x", (3, 131))], {"dim": 1}, tag="long")
one("argmax", [L("x", (5, 7), "int32", "int", lo=-50, hi=50)], {"dim": 0}, tag="int32")

# indexing and layout ---------------------------------------------------------------
one("embedding", [L("w", (11, 5), kind="prepack"), L("ids", (3, 7), "int32", "ids", hi=11)], tag="prepack", storages=BOTH)
one("embedding", [L("w", (13, 3)), L("ids", (5,), "int32", "ids", hi=13)], tag="inputs")
one("embedding", [L("w", (13, 7), kind="prepack_fp16"), L("ids", (2, 3), "int32", "ids", hi=13)], tag="fp16_table")
# Packed tables (prime V, D of 1 and 3 blocks): float32 rows, decoded from the gathered blocks.
for _i, _qt in enumerate(PACKED):
    for _v, _d, _kind in (((13, 37, 7)[_i], 32, "prepack"), ((37, 7, 13)[_i], 96, "const")):
        one("embedding", [L("w", (_v, _d), _qt, kind=_kind), L("ids", (3, 5), "int32", "ids", hi=_v)],
            tag=f"{_qt}_v{_v}_d{_d}_{_kind}")
one("reshape", [L("x", (3, 5, 7))], {"shape": [5, -1]}, tag="minus1", storages=BOTH)
one("reshape", [L("x", (3, 5, 7), "int32", "int", lo=-9, hi=9)], {"shape": [105]}, tag="flat_int32")
one("permute", [L("x", (3, 5, 7))], {"dims": [2, 0, 1]}, tag="3d", storages=BOTH)
one("permute", [L("x", (2, 3, 5, 7))], {"dims": [0, 2, 1, 3]}, tag="heads")
one("permute", [L("x", (3, 5), "bool", "bool")], {"dims": [1, 0]}, tag="bool")
one("expand", [L("x", (3, 1, 7))], {"shape": [2, 3, 5, -1]}, tag="lead_and_unit", storages=BOTH)
one("expand", [L("x", (1,), "int32", "int", lo=1, hi=9)], {"shape": [5, 3]}, tag="int32")
one("slice", [L("x", (3, 11, 5))], {"dim": 1, "start": 2, "end": 9}, tag="mid", storages=BOTH)
one("slice", [L("x", (3, 11, 5))], {"dim": -1, "start": 1, "end": 2**63 - 1, "step": 2}, tag="step_to_end")
one("slice", [L("x", (13, 3))], {"dim": 0, "start": -5, "end": -1}, tag="negative")
one("slice", [L("x", (7, 3))], {"dim": 0, "start": 2, "end": 100}, tag="clamped")
one("cat", [L("a", (3, 5, 7)), L("b", (3, 2, 7)), L("c", (3, 1, 7))], {"dim": 1}, tag="three", storages=BOTH)
one("cat", [L("a", (2, 3)), L("b", (5, 3), kind="const")], {"dim": 0}, tag="const")
one("cat", [L("a", (3, 2), "int32", "int", lo=-5, hi=5), L("b", (3, 3), "int32", "int", lo=-5, hi=5)], {"dim": -1},
    tag="int32")
one("pad", [L("x", (3, 5, 7))], {"pads": [1, 2]}, tag="last", storages=BOTH)
one("pad", [L("x", (3, 5, 7))], {"pads": [1, 0, 2, 3], "value": -1.5}, tag="two_dims_value")
one("pad", [L("x", (3, 5, 7))], {"pads": [-1, 2, 0, 1, 1, 1]}, tag="crop")
# 0-d tensors through the layout ops (seeds of edges.py too)
one("reshape", [L("x", ())], {"shape": [1, 1]}, tag="from_0d")
one("reshape", [L("x", (1, 1))], {"shape": []}, tag="to_0d")
one("expand", [L("x", ())], {"shape": [3, 5]}, tag="from_0d")
one("permute", [L("x", ())], {"dims": []}, tag="0d")
one("copy", [L("x", (5, 7))], storages=BOTH)
one("copy", [L("x", (5, 7), "int32", "int", lo=-9, hi=9)], tag="int32")

# attention ---------------------------------------------------------------------------
one("rope", [L("x", (2, 3, 5, 8)), L("cos", (5, 8), gen="angle", kind="prepack"),
             L("sin", (5, 8), gen="angle", kind="prepack")], storages=BOTH)
one("rope", [L("x", (1, 2, 7, 6)), L("cos", (7, 6), gen="angle"), L("sin", (7, 6), gen="angle")], tag="inputs")

_SDPA = [
    ("plain", (2, 3, 5, 8), (2, 3, 7, 8), 8, None, {}),
    ("gqa", (1, 6, 5, 8), (1, 2, 5, 8), 8, None, {}),
    ("causal", (1, 3, 7, 8), (1, 3, 7, 8), 8, None, {"causal": True}),
    ("bool_mask", (2, 3, 5, 8), (2, 3, 7, 8), 8, ((1, 1, 5, 7), "bool", "keep"), {}),
    ("float_mask", (2, 3, 5, 8), (2, 3, 7, 8), 8, ((2, 1, 1, 7), "float", "normal"), {}),
    ("causal_offset", (1, 2, 3, 8), (1, 2, 11, 8), 8, None, {"causal": True, "causal_offset": 4}),
    ("scale_dv", (1, 3, 5, 8), (1, 3, 7, 8), 5, None, {"scale": 0.3}),
    ("long_kv", (1, 2, 3, 16), (1, 2, 131, 16), 16, None, {}),
    # more than 16 query rows: a prefill (float32: the one-pass attn_tile; float16: the composite)
    ("prefill_mask", (2, 3, 19, 8), (2, 3, 23, 8), 8, ((2, 1, 1, 23), "float", "normal"), {}),
    ("prefill_causal_gqa", (1, 4, 17, 12), (1, 2, 17, 12), 12, None, {"causal": True}),
]
for tag, qs, ks, dv, mask, attrs in _SDPA:
    leaves = [L("q", qs), L("k", ks), L("v", ks[:3] + (dv,))]
    if mask is not None:
        leaves.append(L("mask", mask[0], mask[1], mask[2]))
    st = BOTH if tag in ("plain", "gqa", "causal", "float_mask", "prefill_mask") else ("float32",)
    one("sdpa", leaves, attrs, tag=tag, storages=st, red=max(qs[3], ks[2]))

one("kv_update", [L("cache", (1, 2, 11, 4)), L("new", (1, 2, 3, 4)), L("pos", (1,), "int32", "value", lo=5)],
    tag="mid", storages=BOTH)
one("kv_update", [L("cache", (2, 3, 7, 5)), L("new", (2, 3, 1, 5)), L("pos", (1,), "int32", "value", lo=6)],
    tag="last_row")


# --------------------------------------------------------------------------- chains

def chain(cid: str, leaves, nodes, outputs, storages=("float32",), red=1) -> None:
    for st in storages:
        _add(Case(f"chain/{cid}/{st}", list(leaves), [Op(*n) for n in nodes], list(outputs), st, red))


# A transformer MLP block with a residual: every activation dies young, so the arena reuses.
chain("mlp_block", [L("x", (5, 13)), L("w1", (11, 13), kind="prepack"), L("b1", (11,), kind="prepack"),
                    L("w2", (13, 11), kind="prepack"), L("b2", (13,), kind="prepack"),
                    L("g", (13,), kind="const"), L("beta", (13,), kind="const")],
      [("linear", ["x", "w1", "b1"], {}, "h"), ("gelu", ["h"], {}, "a"), ("linear", ["a", "w2", "b2"], {}, "o"),
       ("add", ["o", "x"], {}, "r"), ("layer_norm", ["r", "g", "beta"], {"normalized_shape": [13]}, "y")],
      ["y"], storages=BOTH, red=13)

chain("mlp_fp16_weights", [L("x", (5, 13)), L("w1", (11, 13), kind="prepack_fp16"),
                           L("w2", (13, 11), kind="prepack_fp16")],
      [("linear", ["x", "w1", None], {}, "h"), ("silu", ["h"], {}, "a"), ("linear", ["a", "w2", None], {}, "o"),
       ("rms_norm", ["o"], {}, "y")], ["y"], red=13)

# Self-attention with projections, head split/merge (reshape aliases, permute copies), rope.
chain("attention", [L("x", (1, 7, 16)), L("wq", (16, 16), kind="prepack"), L("wk", (8, 16), kind="prepack"),
                    L("wv", (8, 16), kind="prepack"), L("wo", (16, 16), kind="prepack"),
                    L("cos", (7, 8), gen="angle", kind="const"), L("sin", (7, 8), gen="angle", kind="const")],
      [("linear", ["x", "wq", None], {}, "q"), ("linear", ["x", "wk", None], {}, "k"),
       ("linear", ["x", "wv", None], {}, "v"),
       ("reshape", ["q"], {"shape": [1, 7, 2, 8]}, "q4"), ("reshape", ["k"], {"shape": [1, 7, 1, 8]}, "k4"),
       ("reshape", ["v"], {"shape": [1, 7, 1, 8]}, "v4"),
       ("permute", ["q4"], {"dims": [0, 2, 1, 3]}, "qh"), ("permute", ["k4"], {"dims": [0, 2, 1, 3]}, "kh"),
       ("permute", ["v4"], {"dims": [0, 2, 1, 3]}, "vh"),
       ("rope", ["qh", "cos", "sin"], {}, "qr"), ("rope", ["kh", "cos", "sin"], {}, "kr"),
       ("sdpa", ["qr", "kr", "vh", None], {"causal": True}, "att"),
       ("permute", ["att"], {"dims": [0, 2, 1, 3]}, "m"), ("reshape", ["m"], {"shape": [1, 7, 16]}, "mf"),
       ("linear", ["mf", "wo", None], {}, "y")],
      ["y", "kr"], storages=BOTH, red=16)

# A small CNN: conv/bn/relu6/pool/depthwise/avg-pool/global mean/classifier/softmax.
chain("cnn", [L("x", (1, 3, 13, 11)), L("w1", (5, 3, 3, 3), kind="prepack"), L("mu", (5,), kind="const"),
              L("var", (5,), gen="positive", kind="const"), L("w2", (5, 1, 3, 3), kind="prepack"),
              L("fc", (7, 5), kind="prepack"), L("fcb", (7,), kind="prepack")],
      [("conv2d", ["x", "w1", None], {"padding": [1, 1]}, "c1"), ("batch_norm", ["c1", "mu", "var"], {}, "n1"),
       ("hardtanh", ["n1"], {"min_val": 0.0, "max_val": 6.0}, "r1"),
       ("max_pool2d", ["r1"], {"kernel": [2, 2], "ceil_mode": True}, "p1"),
       ("conv2d", ["p1", "w2", None], {"groups": 5, "padding": [1, 1]}, "c2"),
       ("avg_pool2d", ["c2"], {"kernel": [3, 3], "stride": [1, 1], "padding": [1, 1], "count_include_pad": False}, "p2"),
       ("mean", ["p2"], {"dims": [2, 3]}, "g"), ("linear", ["g", "fc", "fcb"], {}, "z"),
       ("softmax", ["z"], {}, "y")],
      ["y"], storages=BOTH, red=27)

# One decode step: write the new key/value rows into caches (kv_update aliases its cache, so the
# updated caches come back as outputs) and attend over them with a padding mask.
chain("decode_step", [L("kc", (1, 2, 11, 4)), L("vc", (1, 2, 11, 4)), L("k", (1, 2, 1, 4)), L("v", (1, 2, 1, 4)),
                      L("q", (1, 4, 1, 4)), L("pos", (1,), "int32", "value", lo=6), L("keep", (1, 1, 1, 11), "bool", "keep")],
      [("kv_update", ["kc", "k", "pos"], {}, "kc2"), ("kv_update", ["vc", "v", "pos"], {}, "vc2"),
       ("sdpa", ["q", "kc2", "vc2", "keep"], {}, "y")],
      ["y", "kc2", "vc2"], storages=BOTH, red=11)

# One tensor read twice by an op (x * x, p = sq @ sq) and a reshape alias read beside its source:
# the WGSL lowering must not bind overlapping ranges (Dawn rejects them), it reads a snapshot instead.
chain("aliased_inputs", [L("x", (6, 6))],
      [("mul", ["x", "x"], {}, "sq"), ("matmul", ["sq", "sq"], {}, "p"), ("reshape", ["sq"], {"shape": [36]}, "sf"),
       ("reshape", ["p"], {"shape": [36]}, "pf"), ("add", ["pf", "sf"], {}, "s"), ("reshape", ["s"], {"shape": [6, 6]}, "s2"),
       ("sub", ["s2", "sq"], {}, "y")],
      ["y"], storages=BOTH, red=6)

# Token ids to a masked, pooled embedding: int32/bool paths through the arena.
chain("masked_pool", [L("ids", (2, 7), "int32", "ids", lo=0, hi=13), L("emb", (13, 5), kind="prepack"),
                      L("pad", (), "int32", "value", lo=3, kind="const"), L("zero", (), kind="const", gen="small")],
      [("embedding", ["emb", "ids"], {}, "e"), ("rms_norm", ["e"], {}, "n"), ("ne", ["ids", "pad"], {}, "keep"),
       ("reshape", ["keep"], {"shape": [2, 7, 1]}, "keep3"), ("where", ["keep3", "n", "zero"], {}, "masked"),
       ("cast", ["keep"], {"dtype": "float32"}, "kf"), ("sum", ["kf"], {"dims": [1], "keepdim": True}, "cnt"),
       ("sum", ["masked"], {"dims": [1]}, "tot"), ("div", ["tot", "cnt"], {}, "y"),
       ("argmax", ["y"], {"dim": -1}, "top")],
      ["y", "top"], red=7)

# Layout ops feeding each other (views, copies, padding, concatenation) with a long lifetime.
chain("layout", [L("x", (3, 5, 7)), L("y", (3, 7))],
      [("permute", ["x"], {"dims": [0, 2, 1]}, "t"), ("slice", ["t"], {"dim": 2, "start": 1, "end": 4}, "s"),
       ("pad", ["s"], {"pads": [1, 1]}, "p"), ("reshape", ["y"], {"shape": [3, 7, 1]}, "y3"),
       ("expand", ["y3"], {"shape": [3, 7, 2]}, "ye"), ("cat", ["p", "ye", "s"], {"dim": 2}, "c"),
       ("copy", ["c"], {}, "cc"), ("log_softmax", ["cc"], {"dim": 1}, "ls"), ("amax", ["ls"], {"dims": [2]}, "out"),
       ("mul", ["out", "y"], {}, "z")],
      ["z", "x"], storages=BOTH, red=7)


# A decoder-ish block on packed weights: a q8_0 embedding and its norm, an MLP whose gelu and
# residual add the WebGPU executor runs in the packed kernels' epilogues, and two sibling
# projections of the norm with same-shaped q4_1 weights of a whole number of 256-byte units (the
# executor places them back to back and runs them as one product). Decode-sized (6 tokens: the
# decode kernels) and prefill-sized (34 tokens: the tiled one); the offload tests stream its
# weights.
for _tag, _ids in (("decode", (2, 3)), ("prefill", (2, 17))):
    chain(f"packed_block_{_tag}",
          [L("ids", _ids, "int32", "ids", hi=13), L("tab", (13, 64), "q8_0", kind="prepack"),
           L("w1", (96, 64), "q4_0", "small", kind="prepack"), L("b1", (96,), kind="prepack"),
           L("w2", (64, 96), "q4_1", "small", kind="const"),
           L("wk", (64, 64), "q4_1", kind="prepack"), L("wv", (64, 64), "q4_1", kind="prepack")],
          [("embedding", ["tab", "ids"], {}, "e"), ("rms_norm", ["e"], {}, "n"), ("linear", ["n", "w1", "b1"], {}, "h"),
           ("gelu", ["h"], {}, "g"), ("linear", ["g", "w2", None], {}, "o"), ("add", ["o", "e"], {}, "r"),
           ("linear", ["n", "wk", None], {}, "k"), ("linear", ["n", "wv", None], {}, "v"), ("mul", ["k", "v"], {}, "y")],
          ["y", "r"], red=96)


def ops_covered() -> set:
    return {o.op for c in CASES for o in c.ops}


# Fully masked attention rows. torch 2.13's F.scaled_dot_product_attention (the op export lowers
# to sdpa) returns zeros for a query row whose keys are all dropped (bool keep-mask all false, a
# causal bound before key 0, or every score -inf), float32 and float16 alike, where a plain
# softmax of such a row is NaN; every executor must give those zeros. `rows` kills whole rows of
# a random keep-mask; it is a constant, so the same rows are dead in both runs of a case (test
# user_robustness checks that each case has dead and live rows). The shapes reach each kernel
# path: one query row (split-K decode), a short block (fused rows), a prefill of 19 rows (float32:
# the one-pass tile; float16: the composite softmax).
for _tag, _qs, _ks in (("decode", (4, 3, 1, 8), (4, 3, 7, 8)), ("short", (2, 3, 5, 8), (2, 3, 7, 8)),
                       ("prefill", (2, 3, 19, 8), (2, 3, 23, 8))):
    chain(f"sdpa_dead_rows_{_tag}",
          [L("q", _qs), L("k", _ks), L("v", _ks), L("keep", (_qs[0], 1, _qs[2], _ks[2]), "bool", "keep"),
           L("rows", (_qs[0], 1, _qs[2], 1), "bool", "bool", kind="const")],
          [("logical_and", ["keep", "rows"], {}, "mask"), ("sdpa", ["q", "k", "v", "mask"], {}, "y")],
          ["y"], storages=BOTH, red=_ks[2])
# A causal bound before key 0 (negative causal_offset) kills the first query rows.
one("sdpa", [L("q", (1, 2, 5, 8)), L("k", (1, 2, 5, 8)), L("v", (1, 2, 5, 8))],
    {"causal": True, "causal_offset": -2}, tag="causal_dead_rows", storages=BOTH, red=5)
one("sdpa", [L("q", (1, 2, 19, 8)), L("k", (1, 2, 19, 8)), L("v", (1, 2, 19, 8))],
    {"causal": True, "causal_offset": -3}, tag="prefill_causal_dead_rows", storages=BOTH, red=19)


# Edge samples of every op (empty dims, 0-d tensors, broadcasting, non-contiguous inputs, NaN, inf,
# -0.0 and integer extremes), generated from the one-op cases above: see edges.py.
from . import edges as _edges  # noqa: E402  (edges builds on the cases above)

for _c in _edges.generate(list(CASES)):
    _add(_c)
