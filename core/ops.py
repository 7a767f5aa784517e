"""The op set: schemas, attribute defaults, and shape/dtype inference (see docs/OPS.md).

Pure Python. Every consumer of a graph (the validator, the planners, export's writer, the
executors) asks this module what an op accepts and produces, so there is one answer:

- ``get(name) -> OpDef`` (``UnsupportedOpError`` for names outside the op set);
- ``infer(op, arg_values, attrs) -> [(dtype, shape), ...]`` checks arg count, dtypes, ranks,
  broadcasting and attribute types/values, and raises ``PayloadError("", message)``: the caller
  prefixes the path inside the document (e.g. ``payloads[0].ops[3]``);
- ``normalize_attrs(op, attrs, arg_values=None)`` fills defaults; given the arg values it also
  *resolves* shape-dependent attributes (negative dims, ``-1`` in reshape/expand shapes, slice
  bounds clamped, pool stride defaulting to the kernel, sdpa scale, reduction dims) so executors
  receive plain non-negative integers and never repeat this logic.

``arg_values`` are :class:`~gpudelegate.program.Value` (anything with ``.dtype`` and ``.shape``),
or ``None`` for an absent optional argument (``-1`` in the node's args).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .dtypes import DTYPES, FLOAT_DTYPES, PACKED_DTYPES, is_packed, packed_shape_error
from .errors import PayloadError, UnsupportedOpError

Shape = Tuple[int, ...]
OutSpec = Tuple[str, Shape]


class _Required:
    """Default of an attribute that has none: the node must give it."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()


@dataclass(frozen=True)
class OpDef:
    """One op's schema.

    ``attrs`` maps each attribute name to its default (``REQUIRED`` when there is none);
    ``attr_types`` to its kind (see ``_ATTR_CHECKS``). Arguments at positions ``>= min_args`` are
    optional and may be absent (None); ``max_args`` None means variadic (``cat``), where every
    argument must be present. ``alias``: output 0 shares the storage of that argument.
    ``infer(args, attrs) -> (resolved attrs, outputs)`` receives attrs with defaults filled and
    types checked."""

    name: str
    min_args: int
    max_args: Optional[int]
    attrs: Dict[str, Any]
    alias: Optional[int]
    infer: Optional[Callable[[List[Any], Dict[str, Any]], Tuple[Dict[str, Any], List[OutSpec]]]]
    attr_types: Dict[str, str] = field(default_factory=dict)
    arg_names: Tuple[str, ...] = ()

    def arg_name(self, i: int) -> str:
        n = self.arg_names[i] if i < len(self.arg_names) else (self.arg_names[-1] if self.arg_names else "x")
        return f"args[{i}] ({n})"


def _fail(msg: str):
    raise PayloadError("", msg)


# --------------------------------------------------------------------------- attribute checks

def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _chk_int(x):
    return x if _is_int(x) else _fail_type("an int", x)


def _chk_float(x):
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return _fail_type("a number", x)


def _chk_bool(x):
    return x if isinstance(x, bool) else _fail_type("a bool", x)


def _chk_str(x):
    return x if isinstance(x, str) else _fail_type("a string", x)


def _chk_ints(x):
    if isinstance(x, (list, tuple)) and all(_is_int(v) for v in x):
        return [int(v) for v in x]
    return _fail_type("a list of ints", x)


def _chk_pair(x):
    # Pool/conv hyper-parameters: export writes [h, w]; a single int (or [k]) means both.
    if _is_int(x):
        return [x, x]
    if isinstance(x, (list, tuple)) and all(_is_int(v) for v in x) and len(x) in (1, 2):
        return [int(x[0]), int(x[-1])]
    return _fail_type("an int or a list of 2 ints", x)


def _chk_dtype(x):
    if isinstance(x, str) and x in DTYPES:
        return x
    return _fail_type(f"one of {list(DTYPES)}", x)


def _optional(chk):
    return lambda x: None if x is None else chk(x)


class _AttrTypeError(Exception):
    pass


def _fail_type(what: str, x):
    raise _AttrTypeError(f"expected {what}, got {x!r} ({type(x).__name__})")


_ATTR_CHECKS = {
    "int": _chk_int, "float": _chk_float, "bool": _chk_bool, "str": _chk_str, "ints": _chk_ints,
    "pair": _chk_pair, "dtype": _chk_dtype,
    "int?": _optional(_chk_int), "float?": _optional(_chk_float), "ints?": _optional(_chk_ints),
    "pair?": _optional(_chk_pair), "any": lambda x: x,
}


# --------------------------------------------------------------------------- shape helpers

def _shape(v) -> Shape:
    return tuple(int(d) for d in v.shape)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def broadcast_shapes(*shapes: Sequence[int], names: Sequence[str] = ()) -> Shape:
    """numpy broadcasting of static shapes; PayloadError naming the operands when incompatible."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        d = 1
        for s in shapes:
            k = i - (rank - len(s))
            if k < 0:
                continue
            e = s[k]
            if e != 1 and d != 1 and e != d:
                desc = ", ".join(f"{n} {list(s)}" for n, s in zip(names or [f"#{j}" for j in range(len(shapes))], shapes))
                _fail(f"shapes do not broadcast ({desc}): dim {i} of the result is {d} and {e}")
            if e != 1:
                d = e
        out.append(d)
    return tuple(out)


def _norm_dim(dim: int, rank: int, what: str = "dim") -> int:
    lo = -rank if rank else -1
    hi = rank - 1 if rank else 0
    if not lo <= dim <= hi:
        _fail(f"{what} {dim} out of range for a rank-{rank} tensor (expected {lo}..{hi})")
    return dim % rank if rank else 0


def _need_dtype(d: OpDef, i: int, v, allowed: Sequence[str]):
    if v.dtype not in allowed:
        _fail(f"{d.arg_name(i)} has dtype {v.dtype}; {d.name} needs {' or '.join(allowed)}")


def _need_rank(d: OpDef, i: int, v, rank: int, layout: str = ""):
    if len(v.shape) != rank:
        lay = f" {layout}" if layout else ""
        _fail(f"{d.arg_name(i)} has shape {list(v.shape)}; {d.name} needs a rank-{rank}{lay} tensor")


def _need_shape(d: OpDef, i: int, v, shape: Sequence[int], why: str = ""):
    if _shape(v) != tuple(shape):
        _fail(f"{d.arg_name(i)} has shape {list(v.shape)}; expected {list(shape)}{(' ' + why) if why else ''}")


def _float_result(dtypes: Sequence[str]) -> str:
    floats = [t for t in dtypes if t in FLOAT_DTYPES]
    if not floats:
        return "float32"
    # Mixed storage (a float16-packed weight and a float32 activation) computes in float32
    # anyway (docs/OPS.md); keep the wider storage so nothing is narrowed by accident.
    return "float32" if "float32" in floats else floats[0]


# --------------------------------------------------------------------------- inference per family

NUMERIC = ("float32", "float16", "int32")


def _binary_arith(d, args, attrs):
    a, b = args
    _need_dtype(d, 0, a, NUMERIC)
    _need_dtype(d, 1, b, NUMERIC)
    shape = broadcast_shapes(_shape(a), _shape(b), names=(d.arg_name(0), d.arg_name(1)))
    if a.dtype == "int32" and b.dtype == "int32" and d.name != "div":
        return attrs, [("int32", shape)]
    return attrs, [(_float_result([a.dtype, b.dtype]), shape)]


def _compare(d, args, attrs):
    a, b = args
    allowed = NUMERIC + ("bool",) if d.name in ("eq", "ne") else NUMERIC
    _need_dtype(d, 0, a, allowed)
    _need_dtype(d, 1, b, allowed)
    if (a.dtype == "bool") != (b.dtype == "bool"):
        _fail(f"{d.name} compares bool with {b.dtype if a.dtype == 'bool' else a.dtype}; cast one side first")
    return attrs, [("bool", broadcast_shapes(_shape(a), _shape(b), names=(d.arg_name(0), d.arg_name(1))))]


def _logical(d, args, attrs):
    for i, v in enumerate(args):
        _need_dtype(d, i, v, ("bool",))
    return attrs, [("bool", broadcast_shapes(*[_shape(v) for v in args], names=[d.arg_name(i) for i in range(len(args))]))]


def _where(d, args, attrs):
    c, a, b = args
    _need_dtype(d, 0, c, ("bool",))
    _need_dtype(d, 1, a, DTYPES)
    if not (a.dtype == b.dtype or (a.dtype in FLOAT_DTYPES and b.dtype in FLOAT_DTYPES)):
        _fail(f"{d.arg_name(1)} is {a.dtype} and {d.arg_name(2)} is {b.dtype}; where needs matching dtypes")
    shape = broadcast_shapes(_shape(c), _shape(a), _shape(b), names=[d.arg_name(i) for i in range(3)])
    return attrs, [(a.dtype, shape)]


_INT_OK_UNARY = ("neg", "abs", "relu")


def _unary(d, args, attrs):
    (x,) = args
    _need_dtype(d, 0, x, NUMERIC if d.name in _INT_OK_UNARY else FLOAT_DTYPES)
    return attrs, [(x.dtype, _shape(x))]


def _gelu(d, args, attrs):
    if attrs["approximate"] not in ("none", "tanh"):
        _fail(f"attrs.approximate is {attrs['approximate']!r}; expected 'none' or 'tanh'")
    return _unary(d, args, attrs)


def _hardtanh(d, args, attrs):
    if attrs["min_val"] > attrs["max_val"]:
        _fail(f"attrs.min_val {attrs['min_val']} is above attrs.max_val {attrs['max_val']}")
    return _unary(d, args, attrs)


def _cast(d, args, attrs):
    (x,) = args
    return attrs, [(attrs["dtype"], _shape(x))]


def _matmul(d, args, attrs):
    a, b = args
    _need_dtype(d, 0, a, FLOAT_DTYPES)
    _need_dtype(d, 1, b, FLOAT_DTYPES)
    sa, sb = _shape(a), _shape(b)
    if not sa or not sb:
        _fail(f"matmul of a scalar ({d.arg_name(0)} {list(sa)}, {d.arg_name(1)} {list(sb)}); both need rank >= 1")
    # numpy semantics: a 1-D operand gets a unit dim that is removed from the result.
    a2 = (1,) + sa if len(sa) == 1 else sa
    b2 = sb + (1,) if len(sb) == 1 else sb
    if a2[-1] != b2[-2]:
        _fail(f"contraction mismatch: {d.arg_name(0)} {list(sa)} has K={a2[-1]}, {d.arg_name(1)} {list(sb)} has K={b2[-2]}")
    batch = broadcast_shapes(a2[:-2], b2[:-2], names=(f"{d.arg_name(0)} batch", f"{d.arg_name(1)} batch"))
    out = batch + ((a2[-2],) if len(sa) > 1 else ()) + ((b2[-1],) if len(sb) > 1 else ())
    return attrs, [(_float_result([a.dtype, b.dtype]) if a.dtype != b.dtype else a.dtype, out)]


# Weights that may be packed blocks (dtypes.QUANT_BLOCKS): linear's [N, K] with blocks along K
# (each output's row of K values), embedding's [V, D] with blocks along D (each gathered row).
# The op computes with the dequantized values; its output is float32.
WEIGHT_DTYPES = FLOAT_DTYPES + PACKED_DTYPES
PACKED_WEIGHT_ARGS = (("linear", 1), ("embedding", 0))


def _need_packable(d: OpDef, i: int, v):
    if is_packed(v.dtype) and packed_shape_error(v.dtype, _shape(v)):
        _fail(f"{d.arg_name(i)}: {packed_shape_error(v.dtype, _shape(v))}")


def _linear(d, args, attrs):
    x, w, bias = args
    _need_dtype(d, 0, x, FLOAT_DTYPES)
    _need_dtype(d, 1, w, WEIGHT_DTYPES)
    if len(x.shape) < 1:
        _fail(f"{d.arg_name(0)} is a scalar; linear needs [..., K]")
    _need_rank(d, 1, w, 2, "[N, K]")
    n, k = _shape(w)
    if x.shape[-1] != k:
        _fail(f"{d.arg_name(0)} {list(x.shape)} has K={x.shape[-1]} but {d.arg_name(1)} {list(w.shape)} has K={k}")
    _need_packable(d, 1, w)
    if bias is not None:
        _need_dtype(d, 2, bias, FLOAT_DTYPES)
        _need_shape(d, 2, bias, (n,), "([N])")
    return attrs, [(x.dtype, _shape(x)[:-1] + (n,))]


def _pool_out(size: int, k: int, s: int, p: int, dil: int, ceil_mode: bool, what: str) -> int:
    # torch's formula (pooling_output_shape): with ceil_mode the last window must start inside
    # the input or the left padding, never only in the right padding.
    eff = dil * (k - 1) + 1
    num = size + 2 * p - eff
    if num < 0:
        _fail(f"{what}: window {eff} is larger than the padded input {size + 2 * p}")
    out = (-(-num // s) if ceil_mode else num // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _conv2d(d, args, attrs):
    x, w, bias = args
    _need_dtype(d, 0, x, FLOAT_DTYPES)
    _need_dtype(d, 1, w, FLOAT_DTYPES)
    _need_rank(d, 0, x, 4, "[N, C, H, W]")
    _need_rank(d, 1, w, 4, "[O, C/groups, kh, kw]")
    n, c, h, wd = _shape(x)
    o, cg, kh, kw = _shape(w)
    g = attrs["groups"]
    _pos("groups", [g])
    _pos("stride", attrs["stride"])
    _pos("dilation", attrs["dilation"])
    _nonneg("padding", attrs["padding"])
    if c % g or o % g:
        _fail(f"groups={g} must divide the input channels {c} and the output channels {o}")
    if cg * g != c:
        _fail(f"{d.arg_name(1)} {list(w.shape)} has {cg} input channels per group; {d.arg_name(0)} has {c} channels / {g} groups = {c // g}")
    if kh < 1 or kw < 1:
        _fail(f"{d.arg_name(1)} {list(w.shape)} has an empty kernel ({kh}x{kw}); torch refuses it too")
    if cg < 1:
        # torch answers with an empty tensor of the wrong channel count: nothing to be faithful to
        _fail(f"{d.arg_name(1)} {list(w.shape)} reads 0 input channels; conv2d needs at least one")
    if bias is not None:
        _need_dtype(d, 2, bias, FLOAT_DTYPES)
        _need_shape(d, 2, bias, (o,), "([O])")
    (sh, sw), (ph, pw), (dh, dw) = attrs["stride"], attrs["padding"], attrs["dilation"]
    ho = _pool_out(h, kh, sh, ph, dh, False, "conv2d height")
    wo = _pool_out(wd, kw, sw, pw, dw, False, "conv2d width")
    return attrs, [(x.dtype, (n, o, ho, wo))]


def _pos(name, vals):
    if any(v < 1 for v in vals):
        _fail(f"attrs.{name} {vals} must be >= 1")


def _nonneg(name, vals):
    if any(v < 0 for v in vals):
        _fail(f"attrs.{name} {vals} must be >= 0")


def _pool(d, args, attrs):
    (x,) = args
    _need_dtype(d, 0, x, FLOAT_DTYPES)
    _need_rank(d, 0, x, 4, "[N, C, H, W]")
    attrs = dict(attrs)
    if attrs["stride"] is None:
        attrs["stride"] = list(attrs["kernel"])
    k, s, p = attrs["kernel"], attrs["stride"], attrs["padding"]
    dil = attrs.get("dilation", [1, 1])
    _pos("kernel", k)
    _pos("stride", s)
    _pos("dilation", dil)
    _nonneg("padding", p)
    for i in range(2):
        # torch refuses padding beyond half the kernel: a window could then see only padding.
        if p[i] * 2 > k[i]:
            _fail(f"attrs.padding {p} must be at most half of attrs.kernel {k}")
    n, c, h, w = _shape(x)
    ho = _pool_out(h, k[0], s[0], p[0], dil[0], attrs["ceil_mode"], f"{d.name} height")
    wo = _pool_out(w, k[1], s[1], p[1], dil[1], attrs["ceil_mode"], f"{d.name} width")
    return attrs, [(x.dtype, (n, c, ho, wo))]


def _batch_norm(d, args, attrs):
    x = args[0]
    _need_dtype(d, 0, x, FLOAT_DTYPES)
    if len(x.shape) < 2:
        _fail(f"{d.arg_name(0)} has shape {list(x.shape)}; batch_norm needs [N, C, ...]")
    c = x.shape[1]
    for i in range(1, 5):
        if args[i] is not None:
            _need_dtype(d, i, args[i], FLOAT_DTYPES)
            _need_shape(d, i, args[i], (c,), f"([C] with C={c} from {d.arg_name(0)})")
    _eps(attrs)
    return attrs, [(x.dtype, _shape(x))]


def _eps(attrs):
    if not attrs["eps"] >= 0.0:
        _fail(f"attrs.eps {attrs['eps']} must be >= 0")


def _layer_norm(d, args, attrs):
    x, w, b = args
    _need_dtype(d, 0, x, FLOAT_DTYPES)
    ns = tuple(attrs["normalized_shape"])
    if not ns:
        _fail("attrs.normalized_shape is empty; it names the trailing dims to normalize")
    if _shape(x)[len(x.shape) - len(ns):] != ns or len(ns) > len(x.shape):
        _fail(f"attrs.normalized_shape {list(ns)} is not the trailing dims of {d.arg_name(0)} {list(x.shape)}")
    for i, v in ((1, w), (2, b)):
        if v is not None:
            _need_dtype(d, i, v, FLOAT_DTYPES)
            _need_shape(d, i, v, ns, "(= attrs.normalized_shape)")
    _eps(attrs)
    return attrs, [(x.dtype, _shape(x))]


def _rms_norm(d, args, attrs):
    x, w = args
    _need_dtype(d, 0, x, FLOAT_DTYPES)
    if not x.shape:
        _fail(f"{d.arg_name(0)} is a scalar; rms_norm normalizes the last dim")
    if w is not None:
        _need_dtype(d, 1, w, FLOAT_DTYPES)
        _need_shape(d, 1, w, (x.shape[-1],), "(the last dim of x)")
    _eps(attrs)
    return attrs, [(x.dtype, _shape(x))]


def _softmax(d, args, attrs):
    (x,) = args
    _need_dtype(d, 0, x, FLOAT_DTYPES)
    attrs = dict(attrs, dim=_norm_dim(attrs["dim"], len(x.shape), "attrs.dim"))
    return attrs, [(x.dtype, _shape(x))]


def _reduce(d, args, attrs):
    (x,) = args
    allowed = FLOAT_DTYPES if d.name == "mean" else NUMERIC
    _need_dtype(d, 0, x, allowed)
    rank = len(x.shape)
    dims = attrs["dims"]
    # None or [] reduce every dim (torch's dim=None, and what aten.sum(x, []) means).
    dims = list(range(rank)) if not dims else [_norm_dim(v, rank, "attrs.dims entry") for v in dims]
    if len(set(dims)) != len(dims):
        _fail(f"attrs.dims {attrs['dims']} names a dim twice")
    # A 0-d tensor takes dim 0 or -1 (as torch: its one element is "dim 0") and stays 0-d.
    dims = sorted(dims) if rank else []
    shape = _shape(x)
    if attrs["keepdim"]:
        out = tuple(1 if i in dims else s for i, s in enumerate(shape))
    else:
        out = tuple(s for i, s in enumerate(shape) if i not in dims)
    if any(shape[i] == 0 for i in dims) and d.name == "amax":
        _fail(f"amax over an empty dim of {list(shape)}")
    return dict(attrs, dims=dims), [(x.dtype, out)]


def _argmax(d, args, attrs):
    (x,) = args
    _need_dtype(d, 0, x, NUMERIC)
    rank = len(x.shape)
    dim = _norm_dim(attrs["dim"], rank, "attrs.dim")
    shape = _shape(x)
    if rank and shape[dim] == 0:
        _fail(f"argmax over an empty dim of {list(shape)}")
    out = tuple(1 if i == dim else s for i, s in enumerate(shape)) if attrs["keepdim"] else \
        tuple(s for i, s in enumerate(shape) if i != dim)
    return dict(attrs, dim=dim), [("int32", out)]


def _embedding(d, args, attrs):
    w, ids = args
    _need_rank(d, 0, w, 2, "[V, D]")
    _need_dtype(d, 0, w, WEIGHT_DTYPES)
    _need_packable(d, 0, w)
    _need_dtype(d, 1, ids, ("int32",))
    return attrs, [("float32" if is_packed(w.dtype) else w.dtype, _shape(ids) + (w.shape[1],))]


def _reshape(d, args, attrs):
    (x,) = args
    shape = list(attrs["shape"])
    n = _numel(_shape(x))
    holes = [i for i, s in enumerate(shape) if s == -1]
    if len(holes) > 1:
        _fail(f"attrs.shape {shape} has more than one -1")
    if any(s < -1 for s in shape):
        _fail(f"attrs.shape {shape} has a negative size other than -1")
    known = _numel([s for s in shape if s != -1])
    if holes:
        if known == 0 or n % known:
            _fail(f"attrs.shape {shape} cannot hold the {n} elements of {d.arg_name(0)} {list(x.shape)}")
        shape[holes[0]] = n // known
    elif known != n:
        _fail(f"attrs.shape {shape} has {known} elements; {d.arg_name(0)} {list(x.shape)} has {n}")
    return dict(attrs, shape=shape), [(x.dtype, tuple(shape))]


def _permute(d, args, attrs):
    (x,) = args
    rank = len(x.shape)
    dims = attrs["dims"]
    if len(dims) != rank:
        _fail(f"attrs.dims {dims} has {len(dims)} entries; {d.arg_name(0)} has rank {rank}")
    dims = [_norm_dim(v, rank, "attrs.dims entry") for v in dims]
    if sorted(dims) != list(range(rank)):
        _fail(f"attrs.dims {attrs['dims']} is not a permutation of 0..{rank - 1}")
    return dict(attrs, dims=dims), [(x.dtype, tuple(x.shape[i] for i in dims))]


def _expand(d, args, attrs):
    (x,) = args
    shape = list(attrs["shape"])
    xs = _shape(x)
    lead = len(shape) - len(xs)
    if lead < 0:
        _fail(f"attrs.shape {shape} has fewer dims than {d.arg_name(0)} {list(xs)}")
    out = []
    for i, s in enumerate(shape):
        if i < lead:
            if s < 0:
                _fail(f"attrs.shape {shape}: -1 at new leading dim {i} (only existing dims can keep their size)")
            out.append(s)
            continue
        have = xs[i - lead]
        if s == -1:
            out.append(have)
        elif s < 0:
            _fail(f"attrs.shape {shape} has a negative size other than -1")
        elif have != 1 and have != s:
            _fail(f"cannot expand dim {i - lead} of size {have} of {d.arg_name(0)} {list(xs)} to {s} (attrs.shape {shape})")
        else:
            out.append(s)
    return dict(attrs, shape=out), [(x.dtype, tuple(out))]


def _slice(d, args, attrs):
    (x,) = args
    xs = _shape(x)
    if not xs:
        _fail(f"{d.arg_name(0)} is a 0-d tensor; slice needs rank >= 1 (as torch)")
    dim = _norm_dim(attrs["dim"], len(xs), "attrs.dim")
    step = attrs["step"]
    if step < 1:
        _fail(f"attrs.step {step} must be >= 1")
    # Python slice semantics with clamping (torch export writes end = 2**63-1 for "to the end").
    start, end, _ = slice(attrs["start"], attrs["end"], step).indices(xs[dim])
    end = max(end, start)
    size = len(range(start, end, step))
    out = xs[:dim] + (size,) + xs[dim + 1:]
    return dict(attrs, dim=dim, start=start, end=end, step=step), [(x.dtype, out)]


def _cat(d, args, attrs):
    x0 = args[0]
    rank = len(x0.shape)
    if rank == 0:
        _fail(f"{d.arg_name(0)} is a scalar; cat needs rank >= 1")
    dim = _norm_dim(attrs["dim"], rank, "attrs.dim")
    total = 0
    for i, v in enumerate(args):
        if v.dtype != x0.dtype:
            _fail(f"{d.arg_name(i)} has dtype {v.dtype}; args[0] has {x0.dtype}")
        vs = _shape(v)
        if len(vs) != rank or any(vs[j] != x0.shape[j] for j in range(rank) if j != dim):
            _fail(f"{d.arg_name(i)} shape {list(vs)} does not match args[0] {list(x0.shape)} outside dim {dim}")
        total += vs[dim]
    out = _shape(x0)[:dim] + (total,) + _shape(x0)[dim + 1:]
    return dict(attrs, dim=dim), [(x0.dtype, out)]


def _pad(d, args, attrs):
    (x,) = args
    pads = attrs["pads"]
    xs = list(_shape(x))
    if len(pads) % 2 or len(pads) > 2 * len(xs):
        _fail(f"attrs.pads {pads} needs an even length of at most 2*rank = {2 * len(xs)}")
    for j in range(len(pads) // 2):
        dim = len(xs) - 1 - j
        new = xs[dim] + pads[2 * j] + pads[2 * j + 1]
        if new < 0:
            _fail(f"attrs.pads {pads} crops dim {dim} of size {xs[dim]} below zero")
        xs[dim] = new
    return attrs, [(x.dtype, tuple(xs))]


def _copy(d, args, attrs):
    (x,) = args
    return attrs, [(x.dtype, _shape(x))]


def _rope(d, args, attrs):
    x, cos, sin = args
    _need_dtype(d, 0, x, FLOAT_DTYPES)
    _need_rank(d, 0, x, 4, "[B, H, T, D]")
    b, h, t, dd = _shape(x)
    if dd % 2:
        _fail(f"{d.arg_name(0)} {list(x.shape)} has an odd head dim {dd}; rotate_half needs it even")
    for i, v in ((1, cos), (2, sin)):
        _need_dtype(d, i, v, FLOAT_DTYPES)
        _need_shape(d, i, v, (t, dd), "([T, D] of x)")
    return attrs, [(x.dtype, _shape(x))]


def _sdpa(d, args, attrs):
    q, k, v, mask = args
    for i, t in enumerate((q, k, v)):
        _need_dtype(d, i, t, FLOAT_DTYPES)
        _need_rank(d, i, t, 4, "[B, H, T, D]")
    b, h, tq, dq = _shape(q)
    bk, hk, tk, dk = _shape(k)
    bv, hv, tv, dv = _shape(v)
    if bk != b or bv != b:
        _fail(f"batch sizes differ: q {b}, k {bk}, v {bv}")
    if hv != hk or tv != tk:
        _fail(f"{d.arg_name(1)} {list(k.shape)} and {d.arg_name(2)} {list(v.shape)} disagree on heads/length")
    if dk != dq:
        _fail(f"{d.arg_name(0)} head dim {dq} != {d.arg_name(1)} head dim {dk}")
    if hk < 1 or h % hk:
        _fail(f"query heads {h} are not a multiple of key/value heads {hk}")
    if mask is not None:
        _need_dtype(d, 3, mask, ("bool",) + FLOAT_DTYPES)
        if len(mask.shape) > 4 or broadcast_shapes(_shape(mask), (b, h, tq, tk), names=(d.arg_name(3), "scores")) != (b, h, tq, tk):
            _fail(f"{d.arg_name(3)} {list(mask.shape)} does not broadcast to the scores [B,H,Tq,Tk] = {[b, h, tq, tk]}")
    scale = attrs["scale"]
    if scale is None:
        scale = 1.0 / math.sqrt(dq) if dq else 1.0
    return dict(attrs, scale=scale), [(q.dtype, (b, h, tq, dv))]


def _kv_update(d, args, attrs):
    cache, new, pos = args
    _need_rank(d, 0, cache, 4, "[B, H, S, D]")
    _need_rank(d, 1, new, 4, "[B, H, T, D]")
    if new.dtype != cache.dtype:
        _fail(f"{d.arg_name(1)} is {new.dtype}; the cache is {cache.dtype}")
    cs, ns = _shape(cache), _shape(new)
    if (cs[0], cs[1], cs[3]) != (ns[0], ns[1], ns[3]):
        _fail(f"{d.arg_name(1)} {list(ns)} does not match the cache {list(cs)} in B, H or D")
    if ns[2] > cs[2]:
        _fail(f"{d.arg_name(1)} has {ns[2]} rows; the cache holds only {cs[2]}")
    _need_dtype(d, 2, pos, ("int32",))
    _need_shape(d, 2, pos, (1,))
    return attrs, [(cache.dtype, cs)]


def _delegate(d, args, attrs):
    _fail("delegate outputs come from the called payload's signature; check them against it, not ops.infer")


# --------------------------------------------------------------------------- the table

_OPS: Dict[str, OpDef] = {}


def _def(names, min_args, max_args, infer, attrs=None, alias=None, arg_names=()):
    attrs = attrs or {}
    for name in names.split():
        _OPS[name] = OpDef(name, min_args, max_args, {k: v[1] for k, v in attrs.items()}, alias,
                           infer, {k: v[0] for k, v in attrs.items()}, tuple(arg_names))


_def("add sub mul div pow maximum minimum", 2, 2, _binary_arith, arg_names=("a", "b"))
_def("eq ne lt le gt ge", 2, 2, _compare, arg_names=("a", "b"))
_def("logical_and logical_or", 2, 2, _logical, arg_names=("a", "b"))
_def("logical_not", 1, 1, _logical, arg_names=("a",))
_def("where", 3, 3, _where, arg_names=("cond", "a", "b"))
_def("neg abs exp log sqrt rsqrt sin cos tanh sigmoid relu silu erf reciprocal", 1, 1, _unary, arg_names=("x",))
_def("gelu", 1, 1, _gelu, {"approximate": ("str", "none")}, arg_names=("x",))
_def("hardtanh", 1, 1, _hardtanh, {"min_val": ("float", -1.0), "max_val": ("float", 1.0)}, arg_names=("x",))
_def("cast", 1, 1, _cast, {"dtype": ("dtype", REQUIRED)}, arg_names=("x",))
_def("matmul", 2, 2, _matmul, arg_names=("a", "b"))
_def("linear", 2, 3, _linear, arg_names=("x", "w", "bias"))
_def("conv2d", 2, 3, _conv2d, {"stride": ("pair", [1, 1]), "padding": ("pair", [0, 0]),
                               "dilation": ("pair", [1, 1]), "groups": ("int", 1)},
     arg_names=("x", "w", "bias"))
_def("max_pool2d", 1, 1, _pool, {"kernel": ("pair", REQUIRED), "stride": ("pair?", None),
                                 "padding": ("pair", [0, 0]), "dilation": ("pair", [1, 1]),
                                 "ceil_mode": ("bool", False)}, arg_names=("x",))
_def("avg_pool2d", 1, 1, _pool, {"kernel": ("pair", REQUIRED), "stride": ("pair?", None),
                                 "padding": ("pair", [0, 0]), "ceil_mode": ("bool", False),
                                 "count_include_pad": ("bool", True)}, arg_names=("x",))
_def("batch_norm", 3, 5, _batch_norm, {"eps": ("float", 1e-5)}, arg_names=("x", "mean", "var", "weight", "bias"))
_def("layer_norm", 1, 3, _layer_norm, {"normalized_shape": ("ints", REQUIRED), "eps": ("float", 1e-5)},
     arg_names=("x", "weight", "bias"))
_def("rms_norm", 1, 2, _rms_norm, {"eps": ("float", 1e-6)}, arg_names=("x", "weight"))
_def("softmax log_softmax", 1, 1, _softmax, {"dim": ("int", -1)}, arg_names=("x",))
_def("sum mean amax", 1, 1, _reduce, {"dims": ("ints?", None), "keepdim": ("bool", False)}, arg_names=("x",))
_def("argmax", 1, 1, _argmax, {"dim": ("int", -1), "keepdim": ("bool", False)}, arg_names=("x",))
_def("embedding", 2, 2, _embedding, arg_names=("weight", "ids"))
_def("reshape", 1, 1, _reshape, {"shape": ("ints", REQUIRED)}, alias=0, arg_names=("x",))
_def("permute", 1, 1, _permute, {"dims": ("ints", REQUIRED)}, arg_names=("x",))
_def("expand", 1, 1, _expand, {"shape": ("ints", REQUIRED)}, arg_names=("x",))
_def("slice", 1, 1, _slice, {"dim": ("int", REQUIRED), "start": ("int?", None), "end": ("int?", None),
                             "step": ("int", 1)}, arg_names=("x",))
_def("cat", 1, None, _cat, {"dim": ("int", REQUIRED)}, arg_names=("x",))
_def("pad", 1, 1, _pad, {"pads": ("ints", REQUIRED), "value": ("float", 0.0)}, arg_names=("x",))
_def("copy", 1, 1, _copy, arg_names=("x",))
_def("rope", 3, 3, _rope, arg_names=("x", "cos", "sin"))
_def("sdpa", 3, 4, _sdpa, {"causal": ("bool", False), "scale": ("float?", None), "causal_offset": ("int", 0)},
     arg_names=("q", "k", "v", "mask"))
_def("kv_update", 3, 3, _kv_update, alias=0, arg_names=("cache", "new", "pos"))
_def("delegate", 0, None, _delegate, {"payload": ("int", REQUIRED)}, arg_names=("x",))

OP_NAMES: Tuple[str, ...] = tuple(_OPS)
"""Every op of docs/OPS.md, ``delegate`` included."""

KERNEL_OPS: Tuple[str, ...] = tuple(n for n in _OPS if n != "delegate")
"""The ops an executor must have a kernel for (``delegate`` is method-level only)."""


# --------------------------------------------------------------------------- public API

def get(name: str) -> OpDef:
    try:
        return _OPS[name]
    except (KeyError, TypeError):
        raise UnsupportedOpError("", f"unknown op {name!r}") from None


def _def_of(op) -> OpDef:
    return op if isinstance(op, OpDef) else get(op)


def _check_attrs(d: OpDef, attrs) -> Dict[str, Any]:
    if attrs is None:
        attrs = {}
    if not isinstance(attrs, dict):
        _fail(f"attrs of {d.name} must be a map, got {type(attrs).__name__}")
    unknown = sorted(str(k) for k in attrs if k not in d.attrs)
    if unknown:
        _fail(f"unknown attribute(s) {unknown} for op {d.name} (known: {sorted(d.attrs)})")
    out = {}
    for name, default in d.attrs.items():
        if name in attrs:
            try:
                out[name] = _ATTR_CHECKS[d.attr_types[name]](attrs[name])
            except _AttrTypeError as e:
                _fail(f"attrs.{name} of {d.name}: {e}")
        elif default is REQUIRED:
            _fail(f"attrs.{name} is required by {d.name}")
        else:
            out[name] = list(default) if isinstance(default, list) else default
    return out


def _check_args(d: OpDef, arg_values) -> List[Any]:
    args = list(arg_values)
    n = len(args)
    if n < d.min_args or (d.max_args is not None and n > d.max_args):
        want = f"{d.min_args}" if d.max_args == d.min_args else \
            f"{d.min_args}..{d.max_args}" if d.max_args is not None else f"at least {d.min_args}"
        _fail(f"{d.name} takes {want} args, got {n}")
    for i, v in enumerate(args):
        if v is None and (i < d.min_args or d.max_args is None):
            _fail(f"{d.arg_name(i)} of {d.name} is required but absent (-1)")
        dt = getattr(v, "dtype", None) if v is not None else None
        if v is not None and dt not in DTYPES and dt not in PACKED_DTYPES:
            _fail(f"{d.arg_name(i)} has unknown dtype {dt!r}")
        if dt in PACKED_DTYPES and (d.name, i) not in PACKED_WEIGHT_ARGS:
            _fail(f"{d.arg_name(i)} is packed {dt}; only {' and '.join(f'{o} arg {j}' for o, j in PACKED_WEIGHT_ARGS)} "
                  f"read packed weights")
    if d.max_args is not None:
        args += [None] * (d.max_args - n)  # absent trailing optionals
    return args


def _run(op, arg_values, attrs):
    d = _def_of(op)
    args = _check_args(d, arg_values)
    attrs = _check_attrs(d, attrs)
    resolved, outs = d.infer(d, args, attrs)
    for dt, shape in outs:
        if any(s < 0 for s in shape):  # defensive: an inference rule bug must not pass silently
            _fail(f"{d.name} inferred a negative size {list(shape)}")
    return resolved, [(dt, tuple(shape)) for dt, shape in outs]


def infer(op, arg_values: Sequence[Any], attrs: Optional[dict]) -> List[OutSpec]:
    """Output (dtype, shape) of ``op`` applied to ``arg_values`` with ``attrs``.

    Raises ``UnsupportedOpError`` for an unknown op and ``PayloadError("", msg)`` for bad args or
    attrs (the caller adds the path)."""
    return _run(op, arg_values, attrs)[1]


def normalize_attrs(op, attrs: Optional[dict], arg_values: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
    """``attrs`` with defaults filled and types checked. With ``arg_values`` also resolved against
    the argument shapes (non-negative dims, concrete reshape/expand shapes, clamped slice bounds,
    pool stride, sdpa scale, sorted reduction dims), which is what executors should receive."""
    d = _def_of(op)
    if arg_values is None:
        return _check_attrs(d, attrs)
    return _run(d, arg_values, attrs)[0]


def num_outputs(op) -> int:
    """Every op of the set has exactly one output (``delegate`` excepted: its payload decides)."""
    return 1
