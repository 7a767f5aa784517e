"""Edge samples of every op, generated from the suite's own one-op cases (the seeds in cases.py).

Each float32 one-op case (and each float16 one, for special values) is a seed; every transform
below is applied to every seed, and what the op's schema accepts (``ops.infer``, the contract of
docs/OPS.md) becomes a case of the conformance suite, run on every executor of the registry with
the suite's tolerances (``cases.tolerance``) against the float64 reference kernels, which
``test_conformance.test_golden_matches_torch`` holds to eager PyTorch in float64:

- ``zero<S>``: every dim of size S (in every leaf, and in shape attributes) becomes 0. Seeds give
  each dim its own small prime, so this empties one dim position (an operand's row count, the
  contraction, a channel, ...) at a time;
- ``0d-<leaf>`` / ``0d-all``: a leaf (all leaves) becomes a 0-d tensor: 0-d operands of
  elementwise ops broadcast, 0-d inputs of reductions, casts, softmax, layout ops;
- ``unit-<leaf><d>``: dim d of a leaf becomes 1 where the output keeps its shape (the op
  broadcasts that operand along d);
- ``strided``: method inputs are handed to ``run`` as non-contiguous numpy views (``Case.strided``);
- ``special-<leaf>`` / ``special-all``: NaN, +inf, -inf, -0.0 and 0.0 at random positions of a
  float leaf (of every float leaf); comparisons check that NaN and inf positions match. Cast
  seeds get the values where casts round, overflow or truncate instead: int32 extremes (int32 ->
  float/bool), floats at the int32 range's ends (float -> int32; NaN/inf there are undefined in C
  and PyTorch, so not samples), float16 overflow (float32 -> float16).

A transformed seed the schema refuses (``amax`` over an empty dim or a 0-d input where a matrix is
needed, as PyTorch refuses them; a rank the op set does not take, such as a 3-D ``rope`` input) is
not a case; ``SUMMARY`` counts cases and refusals per op and the suite prints it
(tests/conftest.py's terminal summary).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Tuple

from gpudelegate import dtypes, ops
from gpudelegate.errors import GpuDelegateError
from gpudelegate.program import Value

# cases.py imports this module at its end to add the edge cases, so the seeds' classes are
# imported lazily (this module may also be imported first).
if TYPE_CHECKING:
    from .cases import Case, Leaf  # noqa: F401

# attrs holding shapes: a size substituted in the leaves is substituted there too.
_SHAPE_ATTRS = ("shape", "normalized_shape")
_FLOAT = ("float", "float32", "float16")


def _is_float(case: "Case", leaf: "Leaf") -> bool:
    return leaf.dtype in _FLOAT and leaf.gen not in ("ids", "value", "bool", "keep")


def _infer(case: "Case") -> Optional[list]:
    """Output (dtype, shape) of the case's op, or None when the schema refuses it."""
    values: Dict[str, Value] = {}
    for l in case.leaves:
        dt = case.storage if l.dtype == "float" else l.dtype
        values[l.name] = Value(dt, tuple(l.shape))
    out = None
    for o in case.ops:
        try:
            out = ops.infer(o.op, [None if a is None else values[a] for a in o.args], o.attrs)
        except GpuDelegateError:
            return None
        values[o.out] = Value(*out[0])
    return out


def _valid_ids(case: "Case") -> bool:
    """Embedding ids index rows of the table (an out-of-range id is an InputError, not a case)."""
    (o,) = case.ops
    if o.op != "embedding":
        return True
    by = {l.name: l for l in case.leaves}
    w, ids = by[o.args[0]], by[o.args[1]]
    rows = w.shape[0] if w.shape else 0
    return _numel(ids.shape) == 0 or (ids.lo < ids.hi <= rows)


def _with(seed: "Case", leaves: List["Leaf"], attrs: Optional[dict] = None, strided: bool = False) -> "Case":
    from .cases import Case, Op

    (op,) = seed.ops
    return Case(seed.id, leaves, [Op(op.op, list(op.args), dict(op.attrs if attrs is None else attrs), op.out)],
                list(seed.outputs), seed.storage, seed.red, strided)


def _zero(seed: "Case") -> Iterable[Tuple[str, "Case"]]:
    attrs = seed.ops[0].attrs
    sizes = {d for l in seed.leaves for d in l.shape if d > 1}
    for k in _SHAPE_ATTRS:
        sizes |= {d for d in attrs.get(k, []) if d > 1}
    for s in sorted(sizes):
        leaves = []
        for l in seed.leaves:
            shape = tuple(0 if d == s else d for d in l.shape)
            hi = 0 if l.gen == "ids" and l.hi == s else l.hi  # ids index a dim that became empty
            leaves.append(replace(l, shape=shape, hi=hi))
        new = {k: ([0 if d == s else d for d in v] if k in _SHAPE_ATTRS else v) for k, v in attrs.items()}
        yield f"zero{s}", _with(seed, leaves, new)


def _scalar(seed: "Case") -> Iterable[Tuple[str, "Case"]]:
    for l in seed.leaves:
        if l.shape != ():
            yield f"0d-{l.name}", _with(seed, [replace(x, shape=()) if x is l else x for x in seed.leaves])
    if len(seed.leaves) > 1:
        yield "0d-all", _with(seed, [replace(x, shape=()) for x in seed.leaves])


def _unit(seed: "Case") -> Iterable[Tuple[str, "Case"]]:
    want = _infer(seed)
    for l in seed.leaves:
        for d, n in enumerate(l.shape):
            if n > 1:
                shape = l.shape[:d] + (1,) + l.shape[d + 1:]
                c = _with(seed, [replace(x, shape=shape) if x is l else x for x in seed.leaves])
                if _infer(c) == want:  # the op broadcasts this operand along d
                    yield f"unit-{l.name}{d}", c


def _strided(seed: "Case") -> Iterable[Tuple[str, "Case"]]:
    if any(l.kind == "input" and _numel(l.shape) > 1 for l in seed.leaves):
        yield "strided", _with(seed, list(seed.leaves), strided=True)


def _special_gen(seed: "Case", leaf: "Leaf") -> Optional[str]:
    op = seed.ops[0]
    if op.op == "cast":
        to = op.attrs["dtype"]
        src = seed.storage if leaf.dtype == "float" else leaf.dtype
        if src == "int32":
            return "int_extreme"
        if src == "bool":
            return None
        if to == "int32":
            return "int_range"
        if to == "float16" and src == "float32":
            return "f16_edge"
        return "special"
    return "special" if _is_float(seed, leaf) else None


def _special(seed: "Case") -> Iterable[Tuple[str, "Case"]]:
    gens = [(l, _special_gen(seed, l)) for l in seed.leaves]
    gens = [(l, g) for l, g in gens if g is not None]
    if seed.storage == "float32":
        for l, g in gens:
            yield f"special-{l.name}", _with(seed, [replace(x, gen=g) if x is l else x for x in seed.leaves])
    if len(gens) > 1 or (gens and seed.storage != "float32"):
        chosen = dict((id(l), g) for l, g in gens)
        yield "special-all", _with(seed, [replace(x, gen=chosen[id(x)]) if id(x) in chosen else x for x in seed.leaves])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


TRANSFORMS = (_zero, _scalar, _unit, _strided, _special)
# Transforms that run on float16 seeds too (float16 storage packs two values a word: its NaN, inf
# and overflow handling is its own code).
F16_TRANSFORMS = (_special,)

SUMMARY: Dict[str, Dict[str, int]] = {}
"""op -> {"cases": n, "refused": n}: filled by :func:`generate`."""


def _key(c: "Case") -> tuple:
    o = c.ops[0]
    return (o.op, repr(sorted(o.attrs.items())), tuple(o.args), c.storage, c.strided,
            tuple((l.name, l.dtype, l.shape, l.gen, l.kind, l.lo, l.hi) for l in c.leaves))


# Samples kept per op (per packed weight type, see _family) and transform: all of the op's first
# seed's (every dim position, every operand), then round-robin over its other seeds (each one's first sample, then each one's
# second, ...). The suite runs every case on a software Vulkan adapter and in
# a software-rendered browser, where each costs ~0.1 s to ~0.5 s, so an op gets a few of each kind
# from different seeds rather than every combination.
CAPS = {"zero": 5, "0d": 3, "unit": 3, "strided": 1, "special": 4, "special16": 1}


def _family(seed: "Case") -> str:
    """The op, and the packed weight type its seed reads, if any: the kernels of packed weights
    are their own code, so each type gets the caps of an op of its own (its empty M, N and K,
    strided inputs, NaN and inf in x)."""
    packed = sorted({l.dtype for l in seed.leaves if l.dtype in dtypes.QUANT_BLOCKS})
    return seed.ops[0].op + "".join(f"[{p}]" for p in packed)


def generate(seeds: Iterable["Case"]) -> List["Case"]:
    """The edge cases of ``seeds`` (one-op cases; chains are not seeds), deduplicated, at most
    ``CAPS[kind]`` per op and transform kind."""
    seen = set()
    seeds = [s for s in seeds if len(s.ops) == 1 and not s.id.startswith("chain/")]
    seen.update(_key(s) for s in seeds)
    # (op, kind) -> per seed, its valid samples in order
    pools: Dict[Tuple[str, str], List[List["Case"]]] = {}
    for seed in seeds:
        op = seed.ops[0].op
        family = _family(seed)
        tag = seed.id.split("/")[1]
        stats = SUMMARY.setdefault(op, {"cases": 0, "refused": 0})
        transforms = TRANSFORMS if seed.storage == "float32" else F16_TRANSFORMS
        mine: Dict[str, List["Case"]] = {}
        for t in transforms:
            for name, c in t(seed):
                k = _key(c)
                if k in seen:
                    continue
                seen.add(k)
                if _infer(c) is None or not _valid_ids(c):
                    stats["refused"] += 1
                    continue
                c.id = f"{op}/edge-{name}/{tag}/{seed.storage}"
                kind = name.split("-")[0].rstrip("0123456789")
                if seed.storage != "float32":
                    kind += "16"
                mine.setdefault(kind, []).append(c)
        for kind, cs in mine.items():
            pools.setdefault((family, kind), []).append(cs)
    out: List["Case"] = []
    for (family, kind), per_seed in pools.items():
        op = family.split("[")[0]
        taken = list(per_seed[0])  # the op's first seed: every dim position, every operand
        rest = per_seed[1:]
        for i in range(max((len(cs) for cs in rest), default=0)):
            taken += [cs[i] for cs in rest if i < len(cs)]
        out += taken[:CAPS[kind]]
        SUMMARY[op]["cases"] += len(taken[:CAPS[kind]])
    return out


def summary() -> str:
    """One line per op: its edge cases (and the transformed seeds its schema refuses)."""
    total = sum(s["cases"] for s in SUMMARY.values())
    refused = sum(s["refused"] for s in SUMMARY.values())
    parts = [f"{op} {s['cases']}" + (f" (+{s['refused']} refused)" if s["refused"] else "")
             for op, s in sorted(SUMMARY.items())]
    import textwrap

    head = (f"conformance edge samples: {total} cases over {len(SUMMARY)} ops, on every executor ({refused} "
            f"transformed seeds the op schema refuses are not cases)")
    return head + "\n" + textwrap.fill(", ".join(parts), width=110, initial_indent="  ", subsequent_indent="  ")
