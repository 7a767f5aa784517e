"""Matrix products on subgroup-matrix units (tensor cores): shaders/matmul_sgmat.wgsl (pure Python).

Dawn's ``chromium-experimental-subgroup-matrix`` feature gives WGSL cooperative 16x16 matrices;
on an NVIDIA GPU its f16 x f16 -> f32 16x16x16 config runs on the tensor cores. The kernel rounds
A and B to float16 as it stages them and accumulates in float32, so :func:`emit` runs a product
there only when that rounding loses nothing (both operands stored as float16) or the session
asked for it (``precision="fast"``). Everything is decided here at lowering time from the
device's features and configs (``GPUDevice.subgroup_matrix_configs``), never at run time.

Called by ops_matmul's ``_matmul_emit`` (which owns the matmul/linear/bmm lowering and their
fused epilogues, batching and binding splits) before it picks a float kernel; it declines (False)
wherever the kernel's layout rules do not hold, and the float kernels run the product.
"""

from __future__ import annotations

from typing import Sequence

from gpudelegate.shaders import matmul_sgmat as _gen

from .kernel import ENTRIES, MAX_GROUPS, EntrySpec, _Lowering

SGMAT_FEATURE = "chromium-experimental-subgroup-matrix"
SHADER = "matmul_sgmat.wgsl"
# The device features the kernel's WGSL enables (f16 tiles, subgroup ids, subgroup matrices).
NEEDED_FEATURES = frozenset({"shader-f16", "subgroups", SGMAT_FEATURE})
# The entry points (one per tile shape of shaders/matmul_sgmat.py) and the workgroup memory each
# needs with one shared stage, in bytes (32 KiB is what every Dawn adapter offers, 48 KiB what
# the NVIDIA ones that have the config offer; DeviceLimits.max_workgroup_storage says which):
# 8 subgroups of 32x64 each, with a K step of 16 (mm_sgmat), 32 (mm_sgmat8) or 64 (mm_sgmat8k,
# and with 16-byte loads mm_sgmat8kv and mm_sgmat8kvs, whose workgroups run in groups of 8 tile
# rows), and 16 of 32x64 in 128 x 256 tiles (mm_sgmat16s).
SHAPES = {s.name: s for s in _gen.SHAPES}
ENTRY_POINTS = {name: s.workgroup_bytes(1) for name, s in SHAPES.items()}
# The default entry and stages (H100, robustness off and on; docs/NOTES.md): mm_sgmat8kv (128 x
# 128, K step 64, 44 KiB) for float16 and float32 operands alike: its one 16-byte load per thread
# and step (float16 octets, float32 quads) ran float16 operands at 4096^3 1.2x (device toggle
# disable_robustness) to 2.7x (default robustness) faster than the quad entry mm_sgmat8k, and
# MiniLM's products as fast as any entry. Products with at least LARGE_GROUPS
# workgroups of LARGE's tile (4096^3: 512) take LARGE, 16 subgroups in 128 x 256 tiles walked
# in groups of 8 tile rows: 152-154 TFLOP/s at 4096^3 with the device toggle disable_robustness,
# 118-121 without. It needs 512 invocations per workgroup (NVIDIA's adapters allow 1024): a device
# that allows fewer (DeviceLimits.max_workgroup_invocations) goes on to the default.
# A product whose layout an entry does not admit (float16 rows not in eights) takes the next
# that admits it and fits.
DEFAULT_F16 = ("mm_sgmat8kv", 1)
DEFAULT_F32 = ("mm_sgmat8kv", 1)
LARGE = ("mm_sgmat16s", 1)
LARGE_GROUPS = 512
# Where a default does not fit the device's workgroup memory or the product's layout: the first
# of these that does (the quad entries admit every product in quads of 4).
FALLBACK = (("mm_sgmat8", 2), ("mm_sgmat", 2), ("mm_sgmat", 1))
# A default's twin with the epilogue in the result matrices (Shape.direct), taken first where the
# product allows it (direct_ok): through tC, MiniLM 32x128's bias, gelu and residual epilogues
# cost 6-26 us a product (H100); the twin took its 24 products from 2.06 to 1.99 ms of profiled
# GPU time (docs/NOTES.md).
DIRECT = {"mm_sgmat8kv": "mm_sgmat8kvd"}
MATRIX_SLOTS = (5, 6, 7)  # the bindings a direct entry loads or stores as matrices besides C (R, C1, C2)
MATRIX_FLOATS = 256  # one 16x16 float32 result matrix

# The entry points come from the generator's shape table (one row per shape).
# (A direct entry writes float32 C only: no DT_OUT.)
ENTRIES.update({name: EntrySpec(SHADER, (1, 2, 3, 4, 5, 6, 7),
                                ("DT_OUT",) * (not s.direct)
                                + ("DTA", "DTB", "B_KMAJOR", "BIAS", "ACT", "RES", "NC", "STAGES"))
                for name, s in SHAPES.items()})


def tile_of(entry: str):
    """(rows, columns) of C one workgroup of ``entry`` computes."""
    return SHAPES[entry].bm, SHAPES[entry].bn


def stage_bytes(entry: str, stages: int) -> int:
    """Workgroup memory of ``entry`` with ``stages`` shared tiles."""
    return SHAPES[entry].workgroup_bytes(stages)


def has_config(configs: Sequence[dict]) -> bool:
    """Does the device offer the one config the kernel uses: f16 inputs, f32 result, 16x16x16?"""
    return any(c.get("component") == "f16" and c.get("result") == "f32" and
               (c.get("M"), c.get("N"), c.get("K")) == (16, 16, 16) for c in configs)


def available(lw: _Lowering) -> bool:
    """Can this device run matmul_sgmat.wgsl at all?"""
    return lw.tuning.sgmat and NEEDED_FEATURES <= lw.features and has_config(lw.configs)


def layout_ok(mm, bases, batch_strides, entry: str = "mm_sgmat") -> bool:
    """The kernel reads A and B in staged loads along their contiguous axis: A along k
    (a_sk == 1), B along k (a linear's weight) or along n, every base, row stride and batch stride
    of those rows, and K (and N when B runs along n), in multiples of what ``entry`` loads at a
    time (4, or 8 for float16 operands of the 16-byte-load entries: Shape.align). Bias and residual
    are float32, C float32 with any strides or float16 in whole words."""
    if mm.a.dtype not in ("float32", "float16") or mm.b.dtype not in ("float32", "float16"):
        return False
    if mm.c.dtype not in ("float32", "float16") or (mm.bias is not None and mm.bias.dtype != "float32"):
        return False  # a float16 C arrives here only in whole words (ops_matmul._mm_f16_ok)
    shape = SHAPES[entry]
    qa, qb = shape.align(mm.a.dtype == "float16"), shape.align(mm.b.dtype == "float16")
    _, a_sb, b_sb, _ = batch_strides
    a_base, b_base, _ = bases
    if mm.a_sk != 1 or not _in(qa, mm.K, a_base, mm.a_sm, *a_sb):
        return False
    if mm.b_sk == 1 and _in(qb, mm.K, b_base, mm.b_sn, *b_sb):
        return True
    return mm.b_sn == 1 and _in(qb, mm.N, b_base, mm.b_sk, *b_sb)


def direct_ok(mm) -> bool:
    """Can a direct entry (Shape.direct) carry out product ``mm``? It stores whole 16x16 result
    matrices into float32 C rows (c_sn 1; siblings' outputs too), so M and N in sixteens; its
    accumulators start as R + bias, so alpha 1 and a bias per column (BIAS 1, or 3: per column and
    sibling)."""
    return (all(t.dtype == "float32" for t in (mm.c,) + tuple(mm.outs)) and mm.c_sn == 1
            and mm.M % 16 == 0 and mm.N % 16 == 0 and mm.alpha == 1.0
            and (mm.bias is None or mm.bias_mode in (1, 3)))


def _in(unit: int, *vals: int) -> bool:
    return all(v % unit == 0 for v in vals)


def wanted(lw: _Lowering, mm) -> bool:
    """May this product round its inputs to float16? Yes where they are float16 already, or where
    the session chose precision="fast"."""
    return lw.precision == "fast" or (mm.a.dtype == "float16" and mm.b.dtype == "float16")


def groups(entry: str, mm, z: int = 1) -> int:
    """Workgroups of ``entry`` for product ``mm`` (``z`` batch entries)."""
    bm, bn = tile_of(entry)
    return -(-mm.N // bn) * -(-mm.M // bm) * z


def choose(lw: _Lowering, mm, admits=lambda entry: True, z: int = 1):
    """(entry, stages) for product ``mm``, or None where nothing fits the device's workgroup
    memory and ``admits`` (the product's layout, by entry): Tuning.sgmat_entry / sgmat_stages where
    given (a ValueError where they do not fit the memory; None where the entry does not admit the
    layout), else LARGE for a product of at least LARGE_GROUPS of its workgroups (``z`` batch
    entries), the default for its operands (any float16 operand: DEFAULT_F16) or, where that
    does not fit or admit it, the first of FALLBACK that does."""
    t = lw.tuning
    room = lw.limits.max_workgroup_storage
    threads = lw.limits.max_workgroup_invocations
    if t.sgmat_entry is not None and t.sgmat_entry not in SHAPES:
        raise ValueError(f"Tuning(sgmat_entry={t.sgmat_entry!r}): one of {sorted(SHAPES)}")
    if t.sgmat_stages not in (None, 1, 2):
        raise ValueError(f"Tuning(sgmat_stages={t.sgmat_stages!r}): 1 or 2")
    entry, stages = DEFAULT_F16 if "float16" in (mm.a.dtype, mm.b.dtype) else DEFAULT_F32
    if t.sgmat_entry is not None or t.sgmat_stages is not None:
        entry, stages = t.sgmat_entry or entry, t.sgmat_stages or (1 if t.sgmat_entry else stages)
        if stage_bytes(entry, stages) > room:
            raise ValueError(f"Tuning(sgmat_entry={t.sgmat_entry!r}, sgmat_stages={t.sgmat_stages!r}): "
                             f"{entry} with {stages} stages needs {stage_bytes(entry, stages)} bytes of "
                             f"workgroup memory, the device has {room}")
        if SHAPES[entry].threads > threads:
            raise ValueError(f"Tuning(sgmat_entry={t.sgmat_entry!r}): {entry} has {SHAPES[entry].threads} "
                             f"invocations per workgroup, the device allows {threads}")
        return (entry, stages) if admits(entry) else None
    large = (LARGE,) if groups(LARGE[0], mm, z) >= LARGE_GROUPS else ()
    twin = ((DIRECT[entry], stages),) if entry in DIRECT else ()
    for entry, stages in large + twin + ((entry, stages),) + FALLBACK:
        if stage_bytes(entry, stages) <= room and SHAPES[entry].threads <= threads and admits(entry):
            return entry, stages
    return None


def emit(lw: _Lowering, mm, uni: bytes, binds, bases, batch) -> bool:
    """Emit the subgroup-matrix kernel for product ``mm`` (ops_matmul._MM with its uniform, its
    bindings 1-7 and element bases) when the device, the precision and the layout allow it;
    False (nothing emitted) otherwise."""
    if not (available(lw) and wanted(lw, mm)):
        return False
    nb = batch[0]
    z = nb[0] * nb[1]
    chosen = choose(lw, mm, lambda entry: layout_ok(mm, bases, batch, entry)
                    and (not SHAPES[entry].direct or direct_ok(mm)), z)
    if chosen is None:
        return False
    entry, stages = chosen
    bm, bn = tile_of(entry)
    gx, gy = -(-mm.N // bn), -(-mm.M // bm)
    if gx > MAX_GROUPS or gy > MAX_GROUPS or z > MAX_GROUPS:
        return False
    if gx * gy * z < lw.tuning.sgmat_min_groups:
        # A few 128x128 tiles leave most multiprocessors idle: MiniLM 1x128's 128x384 linears (3
        # workgroups) ran 2.3x slower end to end than on the split-K float kernels, while 32x128's
        # 4096x384 ones (96) ran faster (H100, docs/NOTES.md).
        return False
    if mm.res is not None and mm.res.dtype != "float32":
        return False
    kmajor = mm.b_sk == 1 and _in(SHAPES[entry].align(mm.b.dtype == "float16"), mm.K, bases[1], mm.b_sn, *batch[2])
    da, db = mm.a.dtype, mm.b.dtype
    consts = {"DT_OUT": int(mm.c.dtype == "float16"), "DTA": int(da == "float16"), "DTB": int(db == "float16"),
              "B_KMAJOR": kmajor, "BIAS": mm.bias_mode if mm.bias is not None else 0, "ACT": mm.act,
              "RES": mm.res is not None, "NC": 1 + len(mm.outs), "STAGES": stages}
    what = (" direct" if SHAPES[entry].direct else "") + (" + gelu" if mm.act else "") + \
        (" + residual" if mm.res is not None else "") + \
        (f" x{1 + len(mm.outs)} siblings" if mm.outs else "") + (f" stages {stages}" if stages > 1 else "")
    binds = list(binds)
    if SHAPES[entry].direct:
        del consts["DT_OUT"]  # float32 C (direct_ok)
        # Dawn wants every binding that a matrix load or store names to hold a whole matrix (1 KiB
        # of float32) even where an override constant leaves it unused: R, C1 and C2 in scratch
        # ranges of that size instead of the 16-byte dummies
        binds = [lw.bind(b.binding, lw.scratch("float32", MATRIX_FLOATS))[0]
                 if b.buf.space == "dummy" and b.binding in MATRIX_SLOTS else b for b in binds]
    lw.emit(entry, consts, uni, binds, (gx, gy, z),
            f"{entry} f{da[5:]} x f{db[5:]} -> f{mm.c.dtype[5:]} {'k' if kmajor else 'n'}-major{what}")
    return True
