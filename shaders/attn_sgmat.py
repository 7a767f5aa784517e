"""The entry points of attention_sgmat.wgsl (prefill attention on subgroup matrices), written out
per head-dim pair.

A workgroup of SUBGROUPS subgroups takes up to ROWS query rows of one (batch, head) and every key
(at most KEYS) of its kv head; subgroup sg owns query rows 16 sg .. 16 sg + 15. Keys go in chunks
of CHUNK (two 16-key result matrices):

1. k and v (all keys) and each subgroup's q rows are staged once as float16, and one float32
   bias per key (-inf for a key past tk or dropped by a bool mask, a float mask's value, else 0)
   into the padding of the float32 tiles;
2. pass 1, chunk by chunk: the subgroup's 16 x 32 block of q k^T (float32 results of 16x16x16
   float16 products) is stored to its own float32 tile; lanes 2r and 2r + 1 read row r's keys
   0-15 and 16-31 of the chunk (rotated by the row, so the 32 lanes hit 32 banks) and keep the
   row's running maximum; the pair's maxima are merged by one shuffle;
3. pass 2, chunk by chunk: the same block again (cheaper on the tensor cores than keeping 16 x
   128 float32 scores, which do not fit the workgroup memory), p = exp(s - max) as float16 into
   the subgroup's P tile, each lane summing its p, and out += P v on result matrices;
4. the pairs' sums merged by a shuffle, out through the float32 tile to the output, each lane
   writing one value column of the 16 rows divided by the row's sum.

A lane holds one row's maximum and sum (a first version gave each lane one key of all 16 rows: 16
maxima and 16 sums a lane, and ran MiniLM's attention markedly slower: docs/NOTES.md). The steps of a
lane's walk, the result matrices and their loads are straight-line code: WGSL has no macros, so
this module writes it for each head-dim pair in :data:`SHAPES`, and ``shaders.source`` puts it
where attention_sgmat.wgsl says ``//! generate attn_sgmat``. Every subgroupMatrixLoad/Store names
one inner array of a workgroup tile at a literal offset and stride (chunk and subgroup are the
outer index), which is what lets Dawn's robustness transform leave it unpredicated
(matmul_sgmat.py).

Pure Python with no imports from the package: core/webgpu/ops_attention.py reads the same table
for the dims each entry takes and its workgroup memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

MAT = 16  # rows, columns and depth of the f16 x f16 -> f32 subgroup-matrix config
SUBGROUP = 32  # invocations per subgroup (NVIDIA's, with that config)
SUBGROUPS = 8  # subgroups per workgroup
ROWS = SUBGROUPS * MAT  # query rows per workgroup
KEYS = 128  # keys at most
CHUNK = 2 * MAT  # keys per pass step: one per lane
CHUNKS = KEYS // CHUNK
PAD = 8  # halves added to each staged float16 row: 16 bytes, so rows start on distinct banks
# Floats per row of the float32 tile: 16-byte rows whose 16x16 result stores spread over the banks
# (at a stride of 32 they conflict 8-way), read by the lanes rotated by row (_score), which
# spreads those reads over the 32 banks too. The 4 floats past each row's 32 are never written by
# a matrix store: 8 subgroups x 16 rows x 4 of them hold the key biases (KB_PER_TILE a tile),
# which fit nowhere else in 48 KiB.
SS = CHUNK + 4
KB_PER_TILE = MAT * (SS - CHUNK)
THREADS = SUBGROUPS * SUBGROUP
BEGIN = "// ---- begin generated attn_sgmat"
END = "// ---- end generated attn_sgmat"


@dataclass(frozen=True)
class Shape:
    """One entry point: head dims ``dk`` (q, k) and ``dv`` (v, out) in sixteens."""

    dk: int
    dv: int

    @property
    def name(self) -> str:
        return f"attn_sgmat_d{self.dk * MAT}v{self.dv * MAT}"

    @property
    def hk(self) -> int:  # halves per staged key row of k (and per q row)
        return self.dk * MAT + PAD

    @property
    def hv(self) -> int:  # halves per staged key row of v
        return self.dv * MAT + PAD

    @property
    def ps(self) -> int:  # halves per row of a subgroup's P tile (P of a chunk, or its q rows first)
        return max(CHUNK, self.dk * MAT) + PAD

    def workgroup_bytes(self) -> int:
        """k and v staged (2 bytes a half), then per subgroup its float32 tile (the key biases in its
        padding) and its P tile."""
        return 2 * KEYS * (self.hk + self.hv) + SUBGROUPS * MAT * (4 * SS + 2 * self.ps)

    def check(self) -> None:
        if SUBGROUPS * KB_PER_TILE < KEYS or KB_PER_TILE % CHUNK:
            raise ValueError("the key biases need whole chunks of the float32 tiles' padding")
        if not (1 <= self.dk <= 2 and 1 <= self.dv <= 2):
            raise ValueError(f"{self}: head dims of 16 or 32 (one lane per value column, CHUNK = 32)")


# The head-dim pairs the lowering may choose (ops_attention.ATTN_SGMAT_DIMS): 16 or 32 each
# (MiniLM-L6: 32 and 32). Wider heads do not fit the workgroup memory with all 128 keys staged.
SHAPES = tuple(Shape(dk, dv) for dk in (1, 2) for dv in (1, 2))


def _tiles(s: Shape) -> List[str]:
    n = s.name
    return [
        f"var<workgroup> tK_{n}: array<array<f16, {CHUNK * s.hk}u>, {CHUNKS}u>;  // [chunk][key][dim]",
        f"var<workgroup> tV_{n}: array<array<f16, {CHUNK * s.hv}u>, {CHUNKS}u>;  // [chunk][key][value dim]",
        f"var<workgroup> tS_{n}: array<array<f32, {MAT * SS}u>, {SUBGROUPS}u>;  // [subgroup][row][key of chunk; biases]",
        f"var<workgroup> tP_{n}: array<array<f16, {MAT * s.ps}u>, {SUBGROUPS}u>;  // [subgroup][row][...]",
        "",
    ]


def _put_fns(s: Shape) -> List[str]:
    """put4k_*, put4v_*, put4p_*: a staged quad (float32 words) as four float16 stores at element p
    of inner array g of tK_*, tV_* or tP_* (workgroup arrays that subgroupMatrixLoad reads must be
    arrays of f16, so nothing wider can be stored)."""
    out = []
    for t in "KVP":
        out += [f"fn put4{t.lower()}_{s.name}(g: u32, p: u32, w: vec4<u32>) {{",
                "    let h = vec4<f16>(bitcast<vec4<f32>>(w));"]
        out += [f"    t{t}_{s.name}[g][p + {e}u] = h.{c};" for e, c in enumerate("xyzw")]
        out += ["}", ""]
    return out


def _staging(s: Shape) -> List[str]:
    """Global loads of k, v (every key) and q (the workgroup's rows), issued together, then their
    stores as float16. A quad past the tensor (key past tk, row past tq) is zeros."""
    n = s.name
    qk, qv = s.dk * 4, s.dv * 4  # quads per row
    per_k, per_v = KEYS * qk // THREADS, KEYS * qv // THREADS
    per_q = ROWS * qk // THREADS
    out = []
    for t, per, q4 in (("k", per_k, qk), ("v", per_v, qv), ("q", per_q, qk)):
        for j in range(per):
            out += [f"    let {t}i{j} = tid + {j * THREADS}u;",
                    f"    let {t}r{j} = {t}i{j} / {q4}u;",
                    f"    let {t}c{j} = {t}i{j} % {q4}u;",
                    f"    let {t}w{j} = load_{t}({'i0 + ' if t == 'q' else ''}{t}r{j}, {t}c{j}, {t}b);"]
    for j in range(per_k):
        out.append(f"    put4k_{n}(kr{j} / {CHUNK}u, (kr{j} % {CHUNK}u) * {s.hk}u + 4u * kc{j}, kw{j});")
    for j in range(per_v):
        out.append(f"    put4v_{n}(vr{j} / {CHUNK}u, (vr{j} % {CHUNK}u) * {s.hv}u + 4u * vc{j}, vw{j});")
    for j in range(per_q):
        out.append(f"    put4p_{n}(qr{j} / {MAT}u, (qr{j} % {MAT}u) * {s.ps}u + 4u * qc{j}, qw{j});")
    return out


def _scores(s: Shape, ind: str) -> List[str]:
    """The chunk's 16 x 32 block of q k^T into tS (keys 0-15 of the chunk at column 0, 16-31 at
    16), then the barrier after which each lane reads its row's half of it."""
    n = s.name
    out = [f"{ind}var s0 = subgroup_matrix_result<f32, 16, 16>();",
           f"{ind}var s1 = subgroup_matrix_result<f32, 16, 16>();"]
    for h in range(2):
        for kk in range(s.dk):
            out.append(f"{ind}s{h} = subgroupMatrixMultiplyAccumulate(q{kk}, subgroupMatrixLoad<subgroup_matrix_right"
                       f"<f16, 16, 16>, col_major>(&tK_{n}[c], {h * MAT * s.hk + kk * MAT}u, {s.hk}u), s{h});")
    return out + [f"{ind}let kt = c * {CHUNK}u / {KB_PER_TILE}u;  // the chunk's biases: tile kt, keys kc ..",
                  f"{ind}let kc = c * {CHUNK}u % {KB_PER_TILE}u;",
                  f"{ind}subgroupMatrixStore<row_major>(&tS_{n}[sg], 0u, s0, {SS}u);",
                  f"{ind}subgroupMatrixStore<row_major>(&tS_{n}[sg], 16u, s1, {SS}u);",
                  f"{ind}workgroupBarrier();"]


def _kb_at(j: str) -> str:
    """Where key ``j``'s bias lies in its tile (tS_*[j / KB_PER_TILE]): the padding of row
    (j % KB_PER_TILE) / 4, float j % 4 of it."""
    pad = SS - CHUNK
    return f"(({j}) % {KB_PER_TILE}u) / {pad}u * {SS}u + {CHUNK}u + ({j}) % {pad}u"


def _score(s: Shape, t: int, ind: str) -> List[str]:
    """Step t of a lane's walk over its 16 keys: key x{t} of the chunk (16 hf + (t + rl) % 16: the
    rotation by the row puts the 32 lanes' reads of tS in 32 banks), its final score e{t}; its bias
    from the chunk's tile of biases (kt, key kc + x{t} of it)."""
    n = s.name
    return [f"{ind}let x{t} = hf + ({t}u + rl) % 16u;",
            f"{ind}let e{t} = score(tS_{n}[sg][rl * {SS}u + x{t}], tS_{n}[kt][{_kb_at(f'kc + x{t}')}], "
            f"c * {CHUNK}u + x{t}, ri);"]


def entry(s: Shape) -> str:
    """The WGSL of one entry point (its tiles, its staging stores and the kernel)."""
    s.check()
    n = s.name
    ind = "        "
    steps = range(MAT)
    lines = _tiles(s) + _put_fns(s) + [
        f"// {n}: head dim {s.dk * MAT} (q, k), {s.dv * MAT} (v); {SUBGROUPS} subgroups of 16 query rows, "
        f"{s.workgroup_bytes()} bytes of workgroup memory.",
        f"@compute @workgroup_size({THREADS})",
        f"fn {n}(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,",
        "        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {",
        f"    let i0 = wid.x * {ROWS}u;",
        "    let h = wid.y;",
        "    let b = wid.z;",
        "    let kvh = h / P.group;",
        "    let qb = P.q_base + b * P.qs_b + h * P.qs_h;",
        "    let kb = P.k_base + b * P.ks_b + kvh * P.ks_h;",
        "    let vb = P.v_base + b * P.vs_b + kvh * P.vs_h;",
        "    mrow = P.m_base + b * P.ms_b + h * P.ms_h;",
        f"    let r0 = i0 + sg * {MAT}u;  // this subgroup's first query row",
        "    let rl = lane / 2u;  // the lane's row of the subgroup's 16 (lanes 2r and 2r + 1 share row r)",
        f"    let hf = (lane % 2u) * {MAT}u;  // ... and its half of each chunk's 32 keys",
        "    let ri = r0 + rl;",
        f"    let nch = (P.tk + {CHUNK - 1}u) / {CHUNK}u;",
        "    let ninf = neg_inf();",
    ] + _staging(s) + [
        f"    if (tid < {KEYS}u) {{",
        f"        tS_{n}[tid / {KB_PER_TILE}u][{_kb_at('tid')}] = key_bias(tid);",
        "    }",
        "    workgroupBarrier();",
    ] + [f"    let q{kk} = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>"
         f"(&tP_{n}[sg], {kk * MAT}u, {s.ps}u);" for kk in range(s.dk)] + [
        "    // ---- pass 1: the row's maximum",
        "    var mx = ninf;",
        "    for (var c = 0u; c < nch; c++) {",
    ] + _scores(s, ind) + [line for t in steps for line in _score(s, t, ind)] + [
        f"{ind}mx = max(mx, e{t});" for t in steps] + [
        f"{ind}workgroupBarrier();  // tS is rewritten by the next chunk",
        "    }",
        "    mx = max(mx, subgroupShuffleXor(mx, 1u));",
        # a row with every key dropped: exp(-inf - 0) = 0 for each, where exp(-inf - -inf) is NaN;
        # a NaN score stays NaN and makes its row NaN through P v and the sum
        "    mx = select(mx, 0.0, mx == ninf);",
        "    // ---- pass 2: p = exp(s - max) as float16 into tP, the row's sum, out += P v",
        "    var l = 0.0;",
    ] + [f"    var o{v} = subgroup_matrix_result<f32, 16, 16>();" for v in range(s.dv)] + [
        "    for (var c = 0u; c < nch; c++) {",
    ] + _scores(s, ind) + [line for t in steps for line in _score(s, t, ind)] + [
        f"{ind}let p{t} = exp(e{t} - mx);" for t in steps] + [
        f"{ind}l += p{t};" for t in steps] + [
        f"{ind}tP_{n}[sg][rl * {s.ps}u + x{t}] = f16(p{t});" for t in steps] + [
        f"{ind}workgroupBarrier();",
        f"{ind}let pa = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tP_{n}[sg], 0u, {s.ps}u);",
        f"{ind}let pb = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tP_{n}[sg], 16u, {s.ps}u);",
    ] + [line for v in range(s.dv) for line in (
        f"{ind}o{v} = subgroupMatrixMultiplyAccumulate(pa, subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, "
        f"row_major>(&tV_{n}[c], {v * MAT}u, {s.hv}u), o{v});",
        f"{ind}o{v} = subgroupMatrixMultiplyAccumulate(pb, subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, "
        f"row_major>(&tV_{n}[c], {MAT * s.hv + v * MAT}u, {s.hv}u), o{v});")] + [
        "    }",
        "    // ---- out = (P v) / row sum through tS (no reader of tS is left since the last barrier)",
        "    l += subgroupShuffleXor(l, 1u);",
    ] + [f"    subgroupMatrixStore<row_major>(&tS_{n}[sg], {v * MAT}u, o{v}, {SS}u);" for v in range(s.dv)] + [
        "    workgroupBarrier();",
    ] + _writes(s) + ["}", ""]
    return "\n".join(lines)


def _writes(s: Shape) -> List[str]:
    """Lane l writes value column l of the 16 rows (dv 32), or column l % 16 of rows 8 (l / 16) ..
    + 7 (dv 16): one coalesced row segment per row and store; row r's sum from lane 2r."""
    n = s.name
    if s.dv == 2:
        return [f"    out_row(r0 + {r}u, lane, tS_{n}[sg][{r * SS}u + lane], subgroupShuffle(l, {2 * r}u), b, h);"
                for r in range(MAT)]
    out = ["    let col = lane % 16u;", "    let rh = (lane / 16u) * 8u;"]
    out += [f"    out_row(r0 + rh + {r}u, col, tS_{n}[sg][(rh + {r}u) * {SS}u + col], "
            f"subgroupShuffle(l, 2u * (rh + {r}u)), b, h);" for r in range(MAT // 2)]
    return out


def entry_points() -> str:
    """The generated part of attention_sgmat.wgsl, between BEGIN and END lines."""
    return "\n".join([BEGIN] + [entry(s) for s in SHAPES] + [END]) + "\n"


def shape_for(d: int, dv: int):
    """The entry for head dims ``d`` (q, k) and ``dv`` (v), or None where none is written."""
    for s in SHAPES:
        if (s.dk * MAT, s.dv * MAT) == (d, dv):
            return s
    return None
