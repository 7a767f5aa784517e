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

from gpudelegate.plan.types import BufferRef

from .kernel import MAX_GROUPS, Binding, _Lowering, _T, _up

SGMAT_FEATURE = "chromium-experimental-subgroup-matrix"
# The device features the kernel's WGSL enables (f16 tiles, subgroup ids, subgroup matrices).
NEEDED_FEATURES = frozenset({"shader-f16", "subgroups", SGMAT_FEATURE})
TILE = 128  # rows and columns of C per workgroup (every entry point but mm_sgmat_dw: 128 x 256)
# The entry points and the workgroup memory each needs (bytes, with one stage; 32 KiB is what
# every Dawn adapter offers, more only on some). Staged (matmul_sgmat.wgsl: A and B tiles go
# through workgroup memory, float32 or float16 storage): mm_sgmat (4 subgroups of 64x64, K step
# 32), mm_sgmat8 (8 subgroups of 32x64), mm_sgmat8k (mm_sgmat8 with a K step of 64). Direct
# (matmul_sgmat_direct.wgsl: fragments loaded straight from float16 storage; float32 operands are
# converted to float16 scratch by a map kernel first): mm_sgmat_d (4 subgroups of 64x64),
# mm_sgmat_d8 (8 of 32x64), mm_sgmat_dw (8 of 64x64, 128x256 tiles).
ENTRY_POINTS = {"mm_sgmat": 28672, "mm_sgmat8": 28672, "mm_sgmat8k": 45056,
                "mm_sgmat_d": 26624, "mm_sgmat_d8": 26624, "mm_sgmat_dw": 26624}
DIRECT = frozenset({"mm_sgmat_d", "mm_sgmat_d8", "mm_sgmat_dw"})
TILES = {"mm_sgmat_dw": (128, 256)}  # (rows, columns) of C per workgroup where not TILE x TILE
DEFAULT_ENTRY = "mm_sgmat"  # fits 32 KiB; Tuning(sgmat_entry=...) picks another


def tile_of(entry: str):
    """(rows, columns) of C one workgroup of ``entry`` computes."""
    return TILES.get(entry, (TILE, TILE))


def stage_bytes(entry: str, stages: int) -> int:
    """Workgroup memory of a staged entry with ``stages`` shared tiles (8 KiB of it is tC)."""
    need = ENTRY_POINTS[entry]
    return need if entry in DIRECT else need + (stages - 1) * (need - 8192)


def has_config(configs: Sequence[dict]) -> bool:
    """Does the device offer the one config the kernel uses: f16 inputs, f32 result, 16x16x16?"""
    return any(c.get("component") == "f16" and c.get("result") == "f32" and
               (c.get("M"), c.get("N"), c.get("K")) == (16, 16, 16) for c in configs)


def available(lw: _Lowering) -> bool:
    """Can this device run matmul_sgmat.wgsl at all?"""
    return lw.tuning.sgmat and NEEDED_FEATURES <= lw.features and has_config(lw.configs)


def _quads(*vals: int) -> bool:
    return all(v % 4 == 0 for v in vals)


def layout_ok(mm, bases, batch_strides) -> bool:
    """The kernel reads A and B in quads of 4 elements along their contiguous axis: A along k
    (a_sk == 1), B along k (a linear's weight) or along n, every base, row stride and batch stride
    of those rows a multiple of 4, and K (and N when B runs along n) too. Bias and residual are
    float32, C float32 with any strides or float16 in whole words."""
    if mm.a.dtype not in ("float32", "float16") or mm.b.dtype not in ("float32", "float16"):
        return False
    if mm.c.dtype not in ("float32", "float16") or (mm.bias is not None and mm.bias.dtype != "float32"):
        return False  # a float16 C arrives here only in whole words (ops_matmul._mm_f16_ok)
    _, a_sb, b_sb, _ = batch_strides
    a_base, b_base, _ = bases
    if mm.a_sk != 1 or not _quads(mm.K, a_base, mm.a_sm, *a_sb):
        return False
    if mm.b_sk == 1 and _quads(b_base, mm.b_sn, *b_sb):
        return True
    return mm.b_sn == 1 and _quads(mm.N, b_base, mm.b_sk, *b_sb)


def wanted(lw: _Lowering, mm) -> bool:
    """May this product round its inputs to float16? Yes where they are float16 already, or where
    the session chose precision="fast"."""
    return lw.precision == "fast" or (mm.a.dtype == "float16" and mm.b.dtype == "float16")


def _to_f16(lw: _Lowering, binds, slot: int, what: str):
    """Convert the float32 range bound at ``slot`` to a float16 scratch of as many elements, so
    the element bases and strides of the product stay valid; returns the bindings with the
    scratch at ``slot``. One map kernel (elementwise.wgsl copy) over the whole bound range."""
    b = next(x for x in binds if x.binding == slot)
    n = b.buf.nbytes // 4
    src = _T(b.buf.space, b.buf.index, b.buf.offset, "float32", n, f"{what} of {lw.label}")
    scr = lw.scratch("float16", n)
    lw.copy_tensor(src, scr, (n,), what=f"{what} to float16 for the tensor cores")
    nb = Binding(slot, BufferRef("scratch", scr.index, 0, _up(n * 2, 4)))
    return [nb if x.binding == slot else x for x in binds]


# Dawn sizes a binding that subgroupMatrixLoad/Store touch by one whole matrix: the direct
# kernels' C (16x16 float32) must be bound with at least 1024 bytes and A, B (16x16 float16) with
# 512, whatever the dispatch reaches ("Binding size (28) ... is smaller than the minimum binding
# size (1024)" on an H200 for a 7-column product).
DIRECT_MIN_BYTES = {1: 1024, 2: 512, 3: 512}


def _direct_fits(binds, da: str, db: str) -> bool:
    size = {b.binding: b.buf.nbytes for b in binds}
    # float32 operands are bound as float16 scratch copies of half the bytes (_to_f16)
    size[2] = size[2] if da == "float16" else size[2] // 2
    size[3] = size[3] if db == "float16" else size[3] // 2
    return all(size.get(slot, 0) >= need for slot, need in DIRECT_MIN_BYTES.items())


def emit(lw: _Lowering, mm, uni: bytes, binds, bases, batch) -> bool:
    """Emit the subgroup-matrix kernel for product ``mm`` (ops_matmul._MM with its uniform, its
    bindings 1-7 and element bases) when the device, the precision and the layout allow it;
    False (nothing emitted) otherwise."""
    if not (available(lw) and wanted(lw, mm) and layout_ok(mm, bases, batch)):
        return False
    entry = lw.tuning.sgmat_entry or DEFAULT_ENTRY
    if entry not in ENTRY_POINTS:
        raise ValueError(f"Tuning(sgmat_entry={entry!r}): one of {sorted(ENTRY_POINTS)}")
    nb = batch[0]
    z = nb[0] * nb[1]
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
    kmajor = mm.b_sk == 1 and _quads(bases[1], mm.b_sn, *batch[2])
    consts = {"DT_OUT": int(mm.c.dtype == "float16"), "B_KMAJOR": kmajor,
              "BIAS": mm.bias_mode if mm.bias is not None else 0, "ACT": mm.act, "RES": mm.res is not None,
              "NC": 1 + len(mm.outs)}
    da, db = mm.a.dtype, mm.b.dtype
    if entry in DIRECT and not _direct_fits(binds, da, db):
        entry = DEFAULT_ENTRY  # the staged kernel reads matrices from workgroup memory only
    convert = entry in DIRECT or lw.tuning.sgmat_prepass
    binds = list(binds)
    if convert:
        # float16 storage for both operands: float32 ones go through a float16 scratch first
        # (precision="fast" only: wanted() let float32 through only then)
        if da == "float32":
            binds = _to_f16(lw, binds, 2, "A")
        if db == "float32":
            binds = _to_f16(lw, binds, 3, "B")
    if entry not in DIRECT:
        consts.update(DTA=int(convert or da == "float16"), DTB=int(convert or db == "float16"))
        if lw.tuning.sgmat_stages:
            consts["STAGES"] = lw.tuning.sgmat_stages
    what = (" + gelu" if mm.act else "") + (" + residual" if mm.res is not None else "") + \
        (f" x{1 + len(mm.outs)} siblings" if mm.outs else "") + (" (f16 prepass)" if convert and "float32" in (da, db) else "")
    lw.emit(entry, consts, uni, binds, (gx, gy, z),
            f"{entry} f{da[5:]} x f{db[5:]} -> f{mm.c.dtype[5:]} {'k' if kmajor else 'n'}-major{what}")
    return True
