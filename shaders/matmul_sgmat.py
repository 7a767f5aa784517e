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
        return self.bk + PAD

    @property
    def np_(self) -> int:  # row stride (halves) of a group of B's tile when B runs along n
        return self.fn * MAT + PAD

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
    def quads_a(self) -> int:  # 4-element quads of A each thread stages per K step
        return self.bm * self.bk // 4 // self.threads

    @property
    def quads_b(self) -> int:
        return self.bn * self.bk // 4 // self.threads

    def workgroup_bytes(self, stages: int = 1) -> int:
        """Workgroup memory of this entry with ``stages`` shared tiles (tC included)."""
        return 2 * stages * (self.tile_a + self.tile_b) + 4 * self.tile_c

    @property
    def tile_c(self) -> int:  # floats of tC: one 16x16 result per subgroup on its way out
        return self.subgroups * MAT * MAT

    @property
    def subgroups(self) -> int:
        return self.sg_m * self.sg_n

    def check(self) -> None:
        if self.bk % MAT:
            raise ValueError(f"{self}: K step not a multiple of {MAT}")
        for what, n in (("A", self.bm), ("B", self.bn)):
            if (n * self.bk // 4) % self.threads:
                raise ValueError(f"{self}: {what}'s {n} x {self.bk} tile is not whole quads per thread")


# The shapes the lowering may choose (ops_sgmat.ENTRY_POINTS; Tuning.sgmat_entry): 128 x 128 of C
# per workgroup, 8 subgroups of 32 x 64 (8 result matrices each), which ran fastest on an H200;
# subgroups of 64 x 64 (16) ran slower with every K step and tile tried there (docs/NOTES.md).
SHAPES = (
    Shape("mm_sgmat", 4, 2, 2, 4, 16),    # K step 16: 20 KiB, 32 KiB with two stages (the least)
    Shape("mm_sgmat8", 4, 2, 2, 4, 32),   # K step 32: 28 KiB, 48 KiB with two
    Shape("mm_sgmat8k", 4, 2, 2, 4, 64),  # K step 64: 44 KiB
)


def _lines(*parts: Iterable[str]) -> List[str]:
    return [line for part in parts for line in part]


def _acc(s: Shape) -> List[str]:
    return [f"    var c{i}_{j} = subgroup_matrix_result<f32, 16, 16>();" for i in range(s.fm) for j in range(s.fn)]


def _loads(s: Shape, k: str, ind: str) -> List[str]:
    """Global loads of one K step (at ``k``) into the quad registers qa*, qb*."""
    qpr, qprn = s.bk // 4, s.bn // 4
    return [f"{ind}qa{j} = load_a(tid + {j * s.threads}u, m0, {k}, o.x, {qpr}u);" for j in range(s.quads_a)] + \
        [f"{ind}qb{j} = load_b(tid + {j * s.threads}u, n0, {k}, o.y, {qpr}u, {qprn}u);" for j in range(s.quads_b)]


def _puts(s: Shape, ind: str) -> List[str]:
    """Stores of the quad registers into stage ``s`` of the workgroup tiles."""
    return [f"{ind}put_a_{s.name}(s, tid + {j * s.threads}u, qa{j});" for j in range(s.quads_a)] + \
        [f"{ind}put_b_{s.name}(s, tid + {j * s.threads}u, qb{j});" for j in range(s.quads_b)]


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


def _tiles(s: Shape) -> List[str]:
    """The entry's workgroup tiles, the functions that store one staged quad into them and the one
    that writes a result matrix out of tC_*. tA_*[stage * sg_m + r] holds the rows of A that
    subgroup row r reads (row stride kp), tB_*[stage * sg_n + c] the columns of B that subgroup
    column c reads (k-major: those rows of B's [n][k] tile, stride kp; n-major: the K step's rows
    of those columns, stride np_), tC_*[sg] subgroup sg's result on its way out."""
    qpr, qprn = s.bk // 4, s.bn // 4
    rows_a, cols_b = s.fm * MAT, s.fn * MAT
    return [
        f"var<workgroup> tA_{s.name}: array<array<f16, {s.group_a}u>, STAGES * {s.sg_m}u>;",
        f"var<workgroup> tB_{s.name}: array<array<f16, {s.group_b}u>, STAGES * {s.sg_n}u>;",
        f"var<workgroup> tC_{s.name}: array<array<f32, 256u>, {s.subgroups}u>;",
        "",
        "// Lane `lane` of subgroup `sg` writes its pairs of the 16x16 result at tC_*[sg]: rows",
        "// m .. m + 15, columns n .. n + 15 of C.",
        f"fn out_{s.name}(sg: u32, lane: u32, z: u32, c_off: u32, m: u32, n: u32) {{",
        "    for (var e = 2u * lane; e < 256u; e += 64u) {",
        f"        write_pair(z, c_off, m + e / 16u, n + e % 16u, tC_{s.name}[sg][e], tC_{s.name}[sg][e + 1u]);",
        "    }",
        "}",
        "",
        "// Quad i of the K step (row i / qpr, k (i % qpr) * 4 of A's tile) into stage s.",
        f"fn put_a_{s.name}(s: u32, i: u32, q: vec4<u32>) {{",
        f"    let row = i / {qpr}u;",
        f"    put4_a_{s.name}(s * {s.sg_m}u + row / {rows_a}u, (row % {rows_a}u) * {s.kp}u + (i % {qpr}u) * 4u, "
        "halves(q, DTA));",
        "}",
        "",
        "// Quad i of B's K step: k-major row (n) i / qpr, k (i % qpr) * 4; n-major row (k) i / qprn,",
        "// n (i % qprn) * 4.",
        f"fn put_b_{s.name}(s: u32, i: u32, q: vec4<u32>) {{",
        "    if (B_KMAJOR) {",
        f"        let n = i / {qpr}u;",
        f"        put4_b_{s.name}(s * {s.sg_n}u + n / {cols_b}u, (n % {cols_b}u) * {s.kp}u + (i % {qpr}u) * 4u, "
        "halves(q, DTB));",
        "    } else {",
        f"        let n = (i % {qprn}u) * 4u;",
        f"        put4_b_{s.name}(s * {s.sg_n}u + n / {cols_b}u, (i / {qprn}u) * {s.np_}u + n % {cols_b}u, "
        "halves(q, DTB));",
        "    }",
        "}",
        "",
    ] + [line for t in ("a", "b") for line in (
        f"fn put4_{t}_{s.name}(g: u32, p: u32, h: vec4<f16>) {{",
        f"    t{t.upper()}_{s.name}[g][p] = h.x;",
        f"    t{t.upper()}_{s.name}[g][p + 1u] = h.y;",
        f"    t{t.upper()}_{s.name}[g][p + 2u] = h.z;",
        f"    t{t.upper()}_{s.name}[g][p + 3u] = h.w;",
        "}",
        "")]


def entry(s: Shape) -> str:
    """The WGSL of one entry point (its tiles, staging functions and the kernel)."""
    s.check()
    ind = "        "
    body = _lines(
        _tiles(s),
        [f"// {s.name}: {s.sg_m} x {s.sg_n} subgroups of {s.fm * MAT} x {s.fn * MAT} "
         f"({s.bm} x {s.bn} of C per workgroup), K step {s.bk}.",
         f"@compute @workgroup_size({s.threads})",
         f"fn {s.name}(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,",
         "        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {",
         "    let z = wid.z;",
         "    let o = batch_offsets(z);",
         f"    let m0 = wid.y * {s.bm}u;",
         f"    let n0 = wid.x * {s.bn}u;",
         f"    let wm = (sg / {s.sg_n}u) * {s.fm * MAT}u;",
         f"    let wn = (sg % {s.sg_n}u) * {s.fn * MAT}u;",
         f"    let ra0 = sg / {s.sg_n}u;  // this subgroup's inner arrays of tA_*, tB_* (stage 0)",
         f"    let rb0 = sg % {s.sg_n}u;"],
        _acc(s),
        [f"    var qa{j}: vec4<u32>;" for j in range(s.quads_a)],
        [f"    var qb{j}: vec4<u32>;" for j in range(s.quads_b)],
        [f"    let steps = (P.K + {s.bk - 1}u) / {s.bk}u;"],
        _loads(s, "0u", "    "),
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
        _epilogue(s),
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
