"""The entry points of matmul_sgmat.wgsl, written out from one template per tile shape.

The subgroup-matrix product keeps each subgroup's part of C in named 16x16 result matrices (a
loop-indexed array of them would be placed in local memory), so its K loop, its staging of A and
B and its epilogue are straight-line code whose length grows with the tile. WGSL has no macros:
this module writes that code for each :class:`Shape` in :data:`SHAPES`, and ``shaders.source``
puts it where matmul_sgmat.wgsl says ``//! generate matmul_sgmat`` (the only file that uses the
hook). The WGSL above that line (bindings, global loads, conversion to float16, epilogue) exists
once and is shared by every entry point.

Every subgroupMatrixLoad/Store reads a whole inner array of a workgroup tile split by subgroup
row (A), subgroup column (B), stage and subgroup (tC) at a literal offset and stride: Dawn's
robustness transform (Tint's core/ir/transform/robustness.cc) drops its bounds predication of a
matrix load or store only where the array length, the offset and the stride are all constants,
and otherwise rewrites offset and stride into run-time selects (the stride then unknown to the
driver's compiler). The outer index (stage and subgroup) is clamped once with a min.

Pure Python with no imports from the package: core/webgpu/ops_sgmat.py reads the same table for
tile sizes and workgroup memory, and benchmarks/bench_sgmat.py generates shapes outside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List

MAT = 16  # rows, columns and depth of the f16 x f16 -> f32 subgroup-matrix config
SUBGROUP = 32  # invocations per subgroup the kernel assumes (NVIDIA's, with that config)
PAD = 8  # halves added to each staged row: 16 bytes, so rows start on distinct banks
# What a thread's staging registers hold between a K step's global loads and its stores into the
# workgroup tiles (the loads go out before the step's multiply-accumulates, the stores after):
# "raw" the words as loaded (float32 or float16 bits), "f32" float32 values (float16 operands
# widened as loaded: the float32 operands' code from there on), "f16" packed float16 pairs
# (float32 operands narrowed as loaded: half the registers across the multiply-accumulates).
REGS = ("raw", "f32", "f16")
BEGIN = "// ---- begin generated matmul_sgmat"
END = "// ---- end generated matmul_sgmat"


@dataclass(frozen=True)
class Shape:
    """One entry point: ``sg_m`` x ``sg_n`` subgroups, each holding ``fm`` x ``fn`` result matrices
    (a (16 fm) x (16 fn) block of C); a K step of ``bk`` staged per barrier."""

    name: str
    sg_m: int
    sg_n: int
    fm: int
    fn: int
    bk: int
    pad: int = PAD
    regs: str = "raw"
    # elements of one staged load: 4 (a quad), 8 (an octet: 16-byte loads of float16, held as packed
    # halves, regs "f16"), or 0: by operand dtype, octets of float16 and quads of float32 (one
    # 16-byte load either way, through the vec4 view of the binding; the float32 words held as
    # loaded, regs "raw")
    unit: int = 4
    # workgroups in launch order walk groups of ``swz`` tile rows column by column (0: row by row),
    # so the tiles running at once share rows of A and columns of B in L2
    swz: int = 0
    # epilogue in the result matrices: the accumulators start as R (subgroupMatrixLoad from
    # storage) plus the bias (one multiply-accumulate of ones by the bias split into two float16
    # rows, staged in the tiles before the K loop), and are stored straight into C (float32, c_sn
    # 1, whole 16x16 matrices: M and N in sixteens, alpha 1); only gelu still goes through tC
    direct: bool = False

    @property
    def threads(self) -> int:
        return self.sg_m * self.sg_n * SUBGROUP

    @property
    def bm(self) -> int:  # rows of C per workgroup
        return self.sg_m * self.fm * MAT

    @property
    def bn(self) -> int:  # columns of C per workgroup
        return self.sg_n * self.fn * MAT

    @property
    def kp(self) -> int:  # row stride (halves) of the k-contiguous tiles (A; B along k)
        return self.bk + self.pad

    @property
    def np_(self) -> int:  # row stride (halves) of a group of B's tile when B runs along n
        return self.fn * MAT + self.pad

    @property
    def group_a(self) -> int:  # halves of the rows of A one subgroup row reads (one inner array)
        return self.fm * MAT * self.kp

    @property
    def group_b(self) -> int:  # halves of the columns of B one subgroup column reads (either layout)
        return max(self.fn * MAT * self.kp, self.bk * self.np_)

    @property
    def tile_a(self) -> int:  # halves of one stage of A
        return self.sg_m * self.group_a

    @property
    def tile_b(self) -> int:  # halves of one stage of B
        return self.sg_n * self.group_b

    @property
    def quads_a(self) -> int:  # staged loads (quads, or octets where unit is 8) of A per thread and K step
        return self.bm * self.bk // (self.unit or 4) // self.threads  # unit 0: the quads (the more)

    @property
    def quads_b(self) -> int:
        return self.bn * self.bk // (self.unit or 4) // self.threads

    def workgroup_bytes(self, stages: int = 1) -> int:
        """Workgroup memory of this entry with ``stages`` shared tiles (tC included)."""
        return 2 * stages * (self.tile_a + self.tile_b) + 4 * self.tile_c

    @property
    def tile_c(self) -> int:  # floats of tC: one 16x16 result per subgroup on its way out
        return self.subgroups * MAT * MAT

    @property
    def subgroups(self) -> int:
        return self.sg_m * self.sg_n

    def align(self, f16: bool) -> int:
        """Elements by which an operand's K (N where B runs along n), base and row and batch strides
        must divide: its staged load, octets of float16 where unit is 0 (float16 operands)."""
        return 8 if self.unit == 8 or (self.unit == 0 and f16) else 4

    def check(self) -> None:
        if self.regs not in REGS:
            raise ValueError(f"{self}: regs not one of {REGS}")
        if self.unit not in (0, 4, 8) or (self.unit == 8 and self.regs != "f16") or (self.unit == 0 and self.regs != "raw"):
            raise ValueError(f"{self}: unit 4, 8 with regs f16 (octets are held as packed halves) or 0 with regs raw")
        if self.pad % 4:
            raise ValueError(f"{self}: pad not a multiple of 4 (a staged quad stays inside one row)")
        if self.bk % MAT:
            raise ValueError(f"{self}: K step not a multiple of {MAT}")
        if self.direct and (self.group_a < MAT * MAT or self.group_b < self.fn * MAT * MAT):
            raise ValueError(f"{self}: the bias rows need 256 halves of a tA group and fn x 256 of a tB group")
        for what, n in (("A", self.bm), ("B", self.bn)):
            if any((n * self.bk // u) % self.threads or self.bk % u for u in _units(self)):
                raise ValueError(f"{self}: {what}'s {n} x {self.bk} tile is not whole quads per thread")


# The shapes the lowering may choose (ops_sgmat.ENTRY_POINTS; Tuning.sgmat_entry). The quad
# entries (unit 4) admit every product in quads of 4; the v entries stage with one 16-byte load
# per thread and step (unit 0: octets of float16 operands, quads of float32 ones), which is what
# made float16 operands fast (docs/NOTES.md), and need K (N where B runs along n) and the float16
# operands' bases and strides in eights.
SHAPES = (
    Shape("mm_sgmat", 4, 2, 2, 4, 16),    # K step 16: 20 KiB, 32 KiB with two stages (the least)
    Shape("mm_sgmat8", 4, 2, 2, 4, 32),   # K step 32: 28 KiB, 48 KiB with two
    Shape("mm_sgmat8k", 4, 2, 2, 4, 64),  # K step 64: 44 KiB
    Shape("mm_sgmat8kv", 4, 2, 2, 4, 64, unit=0),          # mm_sgmat8k with 16-byte loads: 44 KiB
    Shape("mm_sgmat8kvs", 4, 2, 2, 4, 64, unit=0, swz=8),  # the same in groups of 8 tile rows
    # 16 subgroups of 32 x 64 (512 invocations): 128 x 256 of C in groups of 8 tile rows, 46 KiB
    Shape("mm_sgmat16s", 4, 4, 2, 4, 32, unit=0, swz=8),
    # mm_sgmat8kv with the epilogue in the result matrices (R and bias before the K loop, C
    # stored from them): the lowering's choice where C allows it
    Shape("mm_sgmat8kvd", 4, 2, 2, 4, 64, unit=0, direct=True),
)


def _tile_origin(s: Shape) -> List[str]:
    """m0, n0: the first row and column of C this workgroup computes. With swz, workgroup
    (x, y) is number p = y gx + x in launch order, and groups of swz tile rows are walked column by
    column (the last group has the rows left): a bijection onto the gx x gy tiles."""
    if not s.swz:
        return [f"    let m0 = wid.y * {s.bm}u;", f"    let n0 = wid.x * {s.bn}u;"]
    return ["    let p = wid.y * nwg.x + wid.x;",
            f"    let first = p / ({s.swz}u * nwg.x) * {s.swz}u;",
            f"    let gm = min(nwg.y - first, {s.swz}u);",
            f"    let r = p % ({s.swz}u * nwg.x);",
            f"    let m0 = (first + r % gm) * {s.bm}u;",
            f"    let n0 = (r / gm) * {s.bn}u;"]


def _lines(*parts: Iterable[str]) -> List[str]:
    return [line for part in parts for line in part]


def _acc(s: Shape) -> List[str]:
    return [f"    var c{i}_{j} = subgroup_matrix_result<f32, 16, 16>();" for i in range(s.fm) for j in range(s.fn)]


def _units(s: Shape) -> List[int]:
    """The staged-load sizes the entry is written for: its unit, or both where it picks by dtype."""
    return [4, 8] if s.unit == 0 else [s.unit]


def _count(s: Shape, n: int, u: int) -> int:
    """Staged loads of ``u`` elements per thread and K step for ``n`` rows (A) or columns (B)."""
    return n * s.bk // u // s.threads


def _by_dtype(s: Shape, dt: str, ind: str, body) -> List[str]:
    """``body(u, ind)`` for the entry's unit; where it picks by dtype (unit 0), octets under
    ``dt == 1u`` (float16) and quads otherwise (an override constant: the other branch is dead)."""
    if s.unit != 0:
        return body(s.unit, ind)
    return [f"{ind}if ({dt} == 1u) {{"] + body(8, ind + "    ") + [f"{ind}}} else {{"] + body(4, ind + "    ") + \
        [f"{ind}}}"]


def _loads(s: Shape, k: str, ind: str) -> List[str]:
    """Global loads of one K step (at ``k``) into the staging registers qa*, qb*."""

    def held(load: str, dt: str, u: int) -> str:
        return load if s.regs == "raw" or u == 8 else f"regs_{s.regs}({load}, {dt})"

    def a(u, ind):
        la = "load8_a" if u == 8 else "load16_a" if s.unit == 0 else "load_a"
        return [f"{ind}qa{j} = " + held(f"{la}(tid + {j * s.threads}u, m0, {k}, o.x, {s.bk // u}u)", "DTA", u) + ";"
                for j in range(_count(s, s.bm, u))]

    def b(u, ind):
        lb = "load8_b" if u == 8 else "load16_b" if s.unit == 0 else "load_b"
        return [f"{ind}qb{j} = " + held(f"{lb}(tid + {j * s.threads}u, n0, {k}, o.y, {s.bk // u}u, {s.bn // u}u)",
                                        "DTB", u) + ";" for j in range(_count(s, s.bn, u))]

    return _by_dtype(s, "DTA", ind, a) + _by_dtype(s, "DTB", ind, b)


def _reg_type(s: Shape) -> str:
    return "vec2<u32>" if s.regs == "f16" and s.unit == 4 else "vec4<u32>"


def _halves(s: Shape, dt: str, u: int) -> str:
    """The staged load ``q`` (held as ``s.regs`` says) as four halves (eight: two vec4s, unit 8)."""
    if u == 8:
        return "bitcast<vec4<f16>>(q.xy), bitcast<vec4<f16>>(q.zw)"
    return {"raw": f"halves(q, {dt})", "f32": "halves(q, 0u)", "f16": "bitcast<vec4<f16>>(q)"}[s.regs]


def _puts(s: Shape, ind: str) -> List[str]:
    """Stores of the staging registers into stage ``s`` of the workgroup tiles, written out in the
    entry point itself, every index a sum, product, quotient or remainder of tid and constants
    (the stage as s % STAGES). Dawn's robustness still puts a min on each index (Tint's range
    analysis is off by default), but written this way the products ran about as fast under it as
    without it, while the same stores in helper functions taking (g, p) paid for it in every K
    step (docs/NOTES.md); why the driver's compiler does better here is not established."""

    def put(t):
        return lambda u, ind: [line for j in range(_count(s, s.bm if t == "a" else s.bn, u))
                               for line in _put(s, t, u, j, ind)]

    return _by_dtype(s, "DTA", ind, put("a")) + _by_dtype(s, "DTB", ind, put("b"))


def _put(s: Shape, t: str, u: int, j: int, ind: str) -> List[str]:
    """Staged load j (``u`` elements) of a K step into stage s of tile t: the scalar float16 stores
    (workgroup arrays of subgroupMatrixLoad are arrays of f16, so nothing wider can be stored).
    A: row i / qpr, k (i % qpr) u of A's tile; B k-major: row (n) i / qpr, k (i % qpr) u; B
    n-major: row (k) i / qprn, n (i % qprn) u."""
    qpr, qprn = s.bk // u, s.bn // u
    rows_a, cols_b = s.fm * MAT, s.fn * MAT
    dt = "DTA" if t == "a" else "DTB"
    i2 = ind + "    "
    halves = (["let h = bitcast<vec4<f16>>(q.xy);", "let h1 = bitcast<vec4<f16>>(q.zw);"] if u == 8
              else [f"let h = {_halves(s, dt, 4)};"])
    arr = f"t{t.upper()}_{s.name}"
    stores = [f"{arr}[g][p + {e}u] = h.{c};" for e, c in enumerate("xyzw")]
    if u == 8:
        stores += [f"{arr}[g][p + {e + 4}u] = h1.{c};" for e, c in enumerate("xyzw")]
    head = [f"{ind}{{", f"{i2}let q = q{t}{j};", f"{i2}let i = tid + {j * s.threads}u;"] + [i2 + h for h in halves]
    if t == "a":
        where = [f"{i2}let row = i / {qpr}u;",
                 f"{i2}let g = (s % STAGES) * {s.sg_m}u + row / {rows_a}u;",
                 f"{i2}let p = (row % {rows_a}u) * {s.kp}u + (i % {qpr}u) * {u}u;"]
        return head + where + [i2 + x for x in stores] + [f"{ind}}}"]
    i3 = i2 + "    "
    return head + [f"{i2}if (B_KMAJOR) {{",
                   f"{i3}let n = i / {qpr}u;",
                   f"{i3}let g = (s % STAGES) * {s.sg_n}u + n / {cols_b}u;",
                   f"{i3}let p = (n % {cols_b}u) * {s.kp}u + (i % {qpr}u) * {u}u;"] + [i3 + x for x in stores] + \
        [f"{i2}}} else {{",
         f"{i3}let n = (i % {qprn}u) * {u}u;",
         f"{i3}let g = (s % STAGES) * {s.sg_n}u + n / {cols_b}u;",
         f"{i3}let p = (i / {qprn}u) * {s.np_}u + n % {cols_b}u;"] + [i3 + x for x in stores] + [f"{i2}}}", f"{ind}}}"]


def _mma(s: Shape, kk: int) -> List[str]:
    """Fragment loads and multiply-accumulates of the 16-deep slice ``kk`` of the current stage."""
    ta, tb = f"tA_{s.name}", f"tB_{s.name}"
    out = ["        {"]
    out += [f"        let a{i} = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>"
            f"(&{ta}[ra], {i * MAT * s.kp + kk}u, {s.kp}u);" for i in range(s.fm)]
    out += [f"        var b{j}: subgroup_matrix_right<f16, 16, 16>;" for j in range(s.fn)]
    out.append("        if (B_KMAJOR) {")
    out += [f"            b{j} = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>"
            f"(&{tb}[rb], {j * MAT * s.kp + kk}u, {s.kp}u);" for j in range(s.fn)]
    out.append("        } else {")
    out += [f"            b{j} = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>"
            f"(&{tb}[rb], {kk * s.np_ + j * MAT}u, {s.np_}u);" for j in range(s.fn)]
    out.append("        }")
    out += [f"        c{i}_{j} = subgroupMatrixMultiplyAccumulate(a{i}, b{j}, c{i}_{j});"
            for i in range(s.fm) for j in range(s.fn)]
    out.append("        }")
    return out


def _epilogue(s: Shape) -> List[str]:
    out = []
    for i in range(s.fm):
        for j in range(s.fn):
            out += [f"    subgroupMatrixStore<row_major>(&tC_{s.name}[sg], 0u, c{i}_{j}, 16u);",
                    "    workgroupBarrier();",
                    f"    out_{s.name}(sg, lane, z, o.z, m0 + wm + {i * MAT}u, n0 + wn + {j * MAT}u);",
                    "    workgroupBarrier();"]
    return out


def _result_matrix(s: Shape, i: int, j: int) -> str:
    return f"m0 + wm + {i * MAT}u", f"n0 + wn + {j * MAT}u"


def _direct_init(s: Shape) -> List[str]:
    """The accumulators' start in a direct entry: R's 16x16 matrices (RES), then + bias through
    one multiply-accumulate of tA's ones by tB's two float16 bias rows (BIAS 1 or 3; bias_rows_*
    staged them, and a barrier keeps the first K step's stores from overwriting them)."""
    out = ["    if (BIAS != 0u) {",
           f"        bias_rows_{s.name}(tid, z, n0);",
           "        workgroupBarrier();",
           "    }"]
    for i in range(s.fm):
        for j in range(s.fn):
            m, n = _result_matrix(s, i, j)
            out += [f"    if (RES && {m} < P.M && {n} < P.N) {{",
                    f"        c{i}_{j} = subgroupMatrixLoad<subgroup_matrix_result<f32, 16, 16>, row_major>"
                    f"(&R, P.r_base + ({m}) * P.N + {n}, P.N);",
                    "    }"]
    out += ["    if (BIAS != 0u) {",
            f"        let ones = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA_{s.name}[0], 0u, 16u);"]
    out += [f"        let bias{j} = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>"
            f"(&tB_{s.name}[rb0], {j * MAT * MAT}u, 16u);" for j in range(s.fn)]
    out += [f"        c{i}_{j} = subgroupMatrixMultiplyAccumulate(ones, bias{j}, c{i}_{j});"
            for i in range(s.fm) for j in range(s.fn)]
    out += ["        workgroupBarrier();", "    }"]
    return out


def _direct_epilogue(s: Shape) -> List[str]:
    """Each result matrix stored straight into C (or C1, C2: batch entry z of siblings); under
    gelu through tC_*[sg], a lane applying it to its pairs."""
    out = []
    for i in range(s.fm):
        for j in range(s.fn):
            m, n = _result_matrix(s, i, j)
            stores = [f"subgroupMatrixStore<row_major>(&{arr}, o.z + ({m}) * P.c_sm + {n}, c{i}_{j}, P.c_sm);"
                      for arr in ("CF1", "CF2", "CF")]
            out += ["    if (ACT == 0u) {",
                    f"        if ({m} < P.M && {n} < P.N) {{",
                    f"            if (NC > 1u && z == 1u) {{ {stores[0]} }}",
                    f"            else if (NC > 2u && z == 2u) {{ {stores[1]} }}",
                    f"            else {{ {stores[2]} }}",
                    "        }",
                    "    } else {",
                    f"        subgroupMatrixStore<row_major>(&tC_{s.name}[sg], 0u, c{i}_{j}, 16u);",
                    "        workgroupBarrier();",
                    f"        gelu_out_{s.name}(sg, lane, z, o.z, {m}, {n});",
                    "        workgroupBarrier();",
                    "    }"]
    return out


def _direct_fns(s: Shape) -> List[str]:
    """bias_rows_* (tA_*[0]: a 16x16 left matrix of ones in columns 0 and 1; tB_*[c] for each
    subgroup column c: its fn right matrices, row 0 the bias of their 16 columns rounded to
    float16, row 1 what that rounding left, in float16: their sum is the bias within ~2^-22 of it)
    and gelu_out_* (a lane's pairs of tC_*[sg] through gelu into C)."""
    per = s.fn * MAT * MAT
    return [
        f"fn bias_rows_{s.name}(tid: u32, z: u32, n0: u32) {{",
        f"    for (var e = tid; e < 256u; e += {s.threads}u) {{",
        f"        tA_{s.name}[0][e] = select(0.0h, 1.0h, e % 16u < 2u);",
        "    }",
        f"    for (var e = tid; e < {s.sg_n * per}u; e += {s.threads}u) {{",
        "        let r = (e % 256u) / 16u;",
        f"        let n = n0 + (e / {per}u) * {s.fn * MAT}u + ((e % {per}u) / 256u) * 16u + e % 16u;",
        "        var v = 0.0;",
        "        if (r < 2u && n < P.N) {",
        "            v = bias_at(z, n);",
        "        }",
        "        let hi = f16(v);",
        f"        tB_{s.name}[e / {per}u][e % {per}u] = select(select(0.0h, f16(v - f32(hi)), r == 1u), hi, r == 0u);",
        "    }",
        "}",
        "",
        f"fn gelu_out_{s.name}(sg: u32, lane: u32, z: u32, c_off: u32, m: u32, n: u32) {{",
        "    if (m < P.M && n < P.N) {",
        "        for (var e = 2u * lane; e < 256u; e += 64u) {",
        "            let w = c_off + (m + e / 16u) * P.c_sm + n + e % 16u;",
        f"            put_f32(z, w, gelu1(tC_{s.name}[sg][e]));",
        f"            put_f32(z, w + 1u, gelu1(tC_{s.name}[sg][e + 1u]));",
        "        }",
        "    }",
        "}",
        "",
    ]


def _tiles(s: Shape) -> List[str]:
    """The entry's workgroup tiles, the functions that store one staged quad into them and the one
    that writes a result matrix out of tC_*. tA_*[stage * sg_m + r] holds the rows of A that
    subgroup row r reads (row stride kp), tB_*[stage * sg_n + c] the columns of B that subgroup
    column c reads (k-major: those rows of B's [n][k] tile, stride kp; n-major: the K step's rows
    of those columns, stride np_), tC_*[sg] subgroup sg's result on its way out."""
    return [
        f"var<workgroup> tA_{s.name}: array<array<f16, {s.group_a}u>, STAGES * {s.sg_m}u>;",
        f"var<workgroup> tB_{s.name}: array<array<f16, {s.group_b}u>, STAGES * {s.sg_n}u>;",
        f"var<workgroup> tC_{s.name}: array<array<f32, 256u>, {s.subgroups}u>;",
        "",
    ] + (_direct_fns(s) if s.direct else _out_fn(s))


def _out_fn(s: Shape) -> List[str]:
    return [
        "// Lane `lane` of subgroup `sg` writes its pairs of the 16x16 result at tC_*[sg]: rows",
        "// m .. m + 15, columns n .. n + 15 of C.",
        f"fn out_{s.name}(sg: u32, lane: u32, z: u32, c_off: u32, m: u32, n: u32) {{",
        "    for (var e = 2u * lane; e < 256u; e += 64u) {",
        f"        write_pair(z, c_off, m + e / 16u, n + e % 16u, tC_{s.name}[sg][e], tC_{s.name}[sg][e + 1u]);",
        "    }",
        "}",
        "",
    ]


def entry(s: Shape) -> str:
    """The WGSL of one entry point (its tiles, staging functions and the kernel)."""
    s.check()
    ind = "        "
    body = _lines(
        _tiles(s),
        [f"// {s.name}: {s.sg_m} x {s.sg_n} subgroups of {s.fm * MAT} x {s.fn * MAT} "
         f"({s.bm} x {s.bn} of C per workgroup), K step {s.bk}, rows padded by {s.pad}, staged as {s.regs}.",
         f"@compute @workgroup_size({s.threads})",
         f"fn {s.name}(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,"
         + (" @builtin(num_workgroups) nwg: vec3<u32>," if s.swz else ""),
         "        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {",
         "    let z = wid.z;",
         "    let o = batch_offsets(z);",
         *_tile_origin(s),
         f"    let wm = (sg / {s.sg_n}u) * {s.fm * MAT}u;",
         f"    let wn = (sg % {s.sg_n}u) * {s.fn * MAT}u;",
         f"    let ra0 = sg / {s.sg_n}u;  // this subgroup's inner arrays of tA_*, tB_* (stage 0)",
         f"    let rb0 = sg % {s.sg_n}u;"],
        _acc(s),
        [f"    var qa{j}: {_reg_type(s)};" for j in range(s.quads_a)],
        [f"    var qb{j}: {_reg_type(s)};" for j in range(s.quads_b)],  # the most either unit needs
        [f"    let steps = (P.K + {s.bk - 1}u) / {s.bk}u;"],
        _loads(s, "0u", "    "),
        _direct_init(s) if s.direct else [],
        ["    var s = 0u;"],
        _puts(s, "    "),
        ["    workgroupBarrier();",
         "    for (var t = 0u; t < steps; t++) {",
         # the next step's global loads go out before this step's multiply-accumulates
         f"        let k1 = (t + 1u) * {s.bk}u;",
         "        if (t + 1u < steps) {"],
        _loads(s, "k1", ind + "    "),
        ["        }",
         "        let cur = t % STAGES;",
         f"        let ra = cur * {s.sg_m}u + ra0;",
         f"        let rb = cur * {s.sg_n}u + rb0;"],
        [line for kk in range(0, s.bk, MAT) for line in _mma(s, kk)],
        ["        if (t + 1u < steps) {",
         "            if (STAGES == 1u) {",
         "                workgroupBarrier();  // every subgroup is done reading the one stage",
         "            } else {",
         "                s = (t + 1u) % 2u;",
         "            }"],
        _puts(s, ind + "    "),
        ["        }",
         "        workgroupBarrier();",
         "    }"],
        _direct_epilogue(s) if s.direct else _epilogue(s),
        ["}", ""])
    return "\n".join(body)


def entry_points(shapes: Iterable[Shape] = SHAPES) -> str:
    """The generated part of matmul_sgmat.wgsl for ``shapes``, between BEGIN and END lines."""
    shapes = list(shapes)
    names = [s.name for s in shapes]
    if len(set(names)) != len(names):
        raise ValueError(f"entry names repeat: {names}")
    return "\n".join([BEGIN] + [entry(s) for s in shapes] + [END]) + "\n"


def with_shapes(text: str, shapes: Iterable[Shape]) -> str:
    """``text`` (matmul_sgmat.wgsl as ``shaders.source`` gives it) with its generated entry points
    replaced by those of ``shapes`` (a benchmark trying shapes outside :data:`SHAPES`)."""
    head, rest = text.split(BEGIN, 1)
    return head + entry_points(shapes) + rest.split(END, 1)[1].lstrip("\n")
