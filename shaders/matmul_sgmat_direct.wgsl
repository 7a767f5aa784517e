// Subgroup-matrix (tensor-core) product that loads its float16 fragments straight from the
// storage buffers (no workgroup staging in the main loop, no barriers there): the "direct"
// variants of core/webgpu/ops_sgmat.py. Same parameters, binding slots and epilogue as
// matmul_sgmat.wgsl (MMParams; C[z] = alpha * A[z] @ B[z] (+ bias, gelu, + R)), but A and B are
// float16 storage (array<f16>; ops_sgmat converts float32 operands to float16 scratch first).
//
// A workgroup computes a BM x BN tile of C with several subgroups of 32 threads, each holding its
// part as 16x16 float32 result matrices in named registers. Where the whole tile lies inside C,
// every base and row stride of A and B is a multiple of 8 halves (16 bytes) and at least 16, the
// K loop loads 16x16 fragments from A and B in storage and multiplies them, 32 of K per step,
// with no workgroup memory and no barrier; the rest of K (K mod 32), and every k of a tile
// that crosses M or N (or of unaligned operands), goes through a 16-wide slice staged in
// workgroup memory with bounds checks (two barriers per 16 of K: slow, but only edge tiles).
// Matrix loads are in bounds by construction (Tint's robustness checks the exact extent).
// Results: interior tiles without an epilogue (alpha 1, no bias, gelu or residual, one float32
// C with unit column stride, aligned) are stored straight from the registers; every other
// tile through a 16x16 workgroup tile per subgroup like matmul_sgmat.wgsl. C, C1 and C2 are
// declared array<f32>: a float16 C is written as pairs of halves bitcast to f32 (bit patterns
// kept; only a NaN pair could be canonicalised by a driver).
//
// The three entry points at the end differ only in shape; their code is written out per shape
// (named registers: a loop-indexed array of matrices would live in local memory). Edit them
// together; tests/webgpu/test_sgmat.py runs every entry point on the GPU machine and
// `bench_sgmat.py --dry` compiles them on any Dawn adapter with the matrix builtins stubbed.

enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;
// The matrix offsets depend on the subgroup id only, so they are uniform within each subgroup,
// which is what the hardware needs; Tint's analysis asks for workgroup uniformity.
diagnostic(off, chromium.subgroup_matrix_uniformity);

//! include mm_params.wgsl
//! include math.wgsl

override DT_OUT: u32 = 0u;        // C storage: 0 float32, 1 float16 (then c_sn == 1, bases and N even)
override B_KMAJOR: bool = true;   // B(k, n) at n * b_sn + k (a linear's weight), else at k * b_sk + n
override BIAS: u32 = 0u;          // 0 none, 1 per column n, 2 per row m, 3 per column and batch entry
override ACT: u32 = 0u;           // fused epilogue: 1 gelu (erf), 2 gelu (tanh)
override RES: bool = false;       // fused epilogue: + R(m, n) (float32 [M][N] at P.r_base, one batch)
override NC: u32 = 1u;            // sibling linears: batch entry z writes C, C1 or C2

const KS: u32 = 24u;              // row stride (halves) of the staged 16-wide k slices (48 bytes)

@group(0) @binding(0) var<uniform> P: MMParams;
@group(0) @binding(1) var<storage, read_write> C: array<f32>;
@group(0) @binding(2) var<storage, read_write> A: array<f16>;
@group(0) @binding(3) var<storage, read_write> B: array<f16>;
@group(0) @binding(4) var<storage, read_write> BIASV: array<f32>;
@group(0) @binding(5) var<storage, read_write> R: array<f32>;
@group(0) @binding(6) var<storage, read_write> C1: array<f32>;
@group(0) @binding(7) var<storage, read_write> C2: array<f32>;

var<workgroup> sA: array<f16, 3072>;  // 128 rows (m) x KS
var<workgroup> sB: array<f16, 6144>;  // up to 256 columns (n) x KS
var<workgroup> tC: array<f32, 2048>;  // one 16x16 result per subgroup on its way out

// Stage A(m0 .. m0 + 127, k0 .. k0 + 15) into sA (row r at r * KS), zeros outside A.
fn stage_a(tid: u32, nt: u32, m0: u32, k0: u32, a_off: u32) {
    for (var i = tid; i < 2048u; i += nt) {
        let r = i / 16u;
        let c = i % 16u;
        let m = m0 + r;
        let k = k0 + c;
        var v = 0.0h;
        if (m < P.M && k < P.K) {
            v = A[a_off + m * P.a_sm + k];
        }
        sA[r * KS + c] = v;
    }
}

// Stage B(k0 .. k0 + 15, n0 .. n0 + bn - 1) into sB k-major (column c at c * KS), zeros outside B.
fn stage_b(tid: u32, nt: u32, bn: u32, n0: u32, k0: u32, b_off: u32) {
    for (var i = tid; i < bn * 16u; i += nt) {
        let c = i / 16u;
        let kk = i % 16u;
        let n = n0 + c;
        let k = k0 + kk;
        var v = 0.0h;
        if (n < P.N && k < P.K) {
            if (B_KMAJOR) {
                v = B[b_off + n * P.b_sn + k];
            } else {
                v = B[b_off + k * P.b_sk + n];
            }
        }
        sB[c * KS + kk] = v;
    }
}

// Can this workgroup's tile at (m0, n0), bm x bn, load straight from storage, and how much of K?
fn direct_k(m0: u32, n0: u32, bm: u32, bn: u32, o: vec3<u32>) -> u32 {
    var bs = P.b_sn;
    if (!B_KMAJOR) {
        bs = P.b_sk;
    }
    let aligned = ((o.x | o.y | P.a_sm | bs) & 7u) == 0u && P.a_sm >= 16u && bs >= 16u;
    if (aligned && m0 + bm <= P.M && n0 + bn <= P.N) {
        return P.K / 32u * 32u;
    }
    return 0u;
}

// May this tile store its results straight from the registers (no epilogue, aligned f32 C)?
fn plain_store(m0: u32, n0: u32, bm: u32, bn: u32, z: u32, c_off: u32) -> bool {
    return DT_OUT == 0u && BIAS == 0u && ACT == 0u && !RES && (NC == 1u || z == 0u) &&
           P.alpha == 1.0 && P.c_sn == 1u && ((c_off | P.c_sm) & 3u) == 0u && P.c_sm >= 16u &&
           m0 + bm <= P.M && n0 + bn <= P.N;
}

fn gelu1(x: f32) -> f32 {
    if (ACT == 2u) {
        return 0.5 * x * (1.0 + tanh_f(0.79788456080286536 * (x + 0.044715 * x * x * x)));
    }
    return 0.5 * x * (1.0 + erf_f(x * 0.70710678118654752));
}

fn result(sg: u32, e: u32, z: u32, mm: u32, nn: u32) -> f32 {
    var v = P.alpha * tC[sg * 256u + e];
    if (BIAS == 1u) {
        v += BIASV[P.bias_base + nn];
    } else if (BIAS == 2u) {
        v += BIASV[P.bias_base + mm];
    } else if (BIAS == 3u) {
        v += BIASV[P.bias_base + z * P.N + nn];
    }
    if (ACT != 0u) {
        v = gelu1(v);
    }
    if (RES) {
        v += R[P.r_base + mm * P.N + nn];
    }
    return v;
}

fn put_word(z: u32, w: u32, bits: u32) {
    if (NC > 1u && z == 1u) {
        C1[w] = bitcast<f32>(bits);
    } else if (NC > 2u && z == 2u) {
        C2[w] = bitcast<f32>(bits);
    } else {
        C[w] = bitcast<f32>(bits);
    }
}

fn write_out(sg: u32, lane: u32, z: u32, c_off: u32, m: u32, n: u32) {
    for (var e = 2u * lane; e < 256u; e += 64u) {
        let mm = m + e / 16u;
        let nn = n + e % 16u;
        if (mm < P.M && nn < P.N) {
            let idx = c_off + mm * P.c_sm + nn * P.c_sn;
            let v0 = result(sg, e, z, mm, nn);
            if (DT_OUT == 1u) {
                put_word(z, idx >> 1u, pack2x16float(vec2<f32>(v0, result(sg, e + 1u, z, mm, nn + 1u))));
            } else {
                put_word(z, idx, bitcast<u32>(v0));
                if (nn + 1u < P.N) {
                    put_word(z, idx + P.c_sn, bitcast<u32>(result(sg, e + 1u, z, mm, nn + 1u)));
                }
            }
        }
    }
}


// mm_sgmat_d: 4 subgroups (2 x 2), each 64x64 of C (4 x 4 result matrices), 128x128 tiles.
@compute @workgroup_size(128)
fn mm_sgmat_d(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let z = wid.z;
    let o = batch_offsets(z);
    let m0 = wid.y * 128u;
    let n0 = wid.x * 128u;
    let wm = (sg / 2u) * 64u;
    let wn = (sg % 2u) * 64u;
    var c00 = subgroup_matrix_result<f32, 16, 16>();
    var c01 = subgroup_matrix_result<f32, 16, 16>();
    var c02 = subgroup_matrix_result<f32, 16, 16>();
    var c03 = subgroup_matrix_result<f32, 16, 16>();
    var c10 = subgroup_matrix_result<f32, 16, 16>();
    var c11 = subgroup_matrix_result<f32, 16, 16>();
    var c12 = subgroup_matrix_result<f32, 16, 16>();
    var c13 = subgroup_matrix_result<f32, 16, 16>();
    var c20 = subgroup_matrix_result<f32, 16, 16>();
    var c21 = subgroup_matrix_result<f32, 16, 16>();
    var c22 = subgroup_matrix_result<f32, 16, 16>();
    var c23 = subgroup_matrix_result<f32, 16, 16>();
    var c30 = subgroup_matrix_result<f32, 16, 16>();
    var c31 = subgroup_matrix_result<f32, 16, 16>();
    var c32 = subgroup_matrix_result<f32, 16, 16>();
    var c33 = subgroup_matrix_result<f32, 16, 16>();
    let kd = direct_k(m0, n0, 128u, 128u, o);
    let arow = o.x + (m0 + wm) * P.a_sm;
    var bcol = o.y + (n0 + wn) * P.b_sn;  // B k-major: fragment j at bcol + 16 j * b_sn + k
    var bkst = P.b_sn;
    var bfs = 16u * P.b_sn;
    if (!B_KMAJOR) {
        bcol = o.y + n0 + wn;             // B n-major: fragment j at bcol + k * b_sk + 16 j
        bkst = P.b_sk;
        bfs = 16u;
    }
    let afs = 16u * P.a_sm;
    for (var k0 = 0u; k0 < kd; k0 += 32u) {
        {
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 0u * afs + k0, P.a_sm);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 1u * afs + k0, P.a_sm);
        let a2 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 2u * afs + k0, P.a_sm);
        let a3 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 3u * afs + k0, P.a_sm);
        var bofs = bcol + k0;
        if (!B_KMAJOR) {
            bofs = bcol + (k0) * bkst;
        }
        var b0: subgroup_matrix_right<f16, 16, 16>;
        var b1: subgroup_matrix_right<f16, 16, 16>;
        var b2: subgroup_matrix_right<f16, 16, 16>;
        var b3: subgroup_matrix_right<f16, 16, 16>;
        if (B_KMAJOR) {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 0u * bfs, bkst);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 1u * bfs, bkst);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 2u * bfs, bkst);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 3u * bfs, bkst);
        } else {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 0u * bfs, bkst);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 1u * bfs, bkst);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 2u * bfs, bkst);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 3u * bfs, bkst);
        }
        c00 = subgroupMatrixMultiplyAccumulate(a0, b0, c00);
        c01 = subgroupMatrixMultiplyAccumulate(a0, b1, c01);
        c02 = subgroupMatrixMultiplyAccumulate(a0, b2, c02);
        c03 = subgroupMatrixMultiplyAccumulate(a0, b3, c03);
        c10 = subgroupMatrixMultiplyAccumulate(a1, b0, c10);
        c11 = subgroupMatrixMultiplyAccumulate(a1, b1, c11);
        c12 = subgroupMatrixMultiplyAccumulate(a1, b2, c12);
        c13 = subgroupMatrixMultiplyAccumulate(a1, b3, c13);
        c20 = subgroupMatrixMultiplyAccumulate(a2, b0, c20);
        c21 = subgroupMatrixMultiplyAccumulate(a2, b1, c21);
        c22 = subgroupMatrixMultiplyAccumulate(a2, b2, c22);
        c23 = subgroupMatrixMultiplyAccumulate(a2, b3, c23);
        c30 = subgroupMatrixMultiplyAccumulate(a3, b0, c30);
        c31 = subgroupMatrixMultiplyAccumulate(a3, b1, c31);
        c32 = subgroupMatrixMultiplyAccumulate(a3, b2, c32);
        c33 = subgroupMatrixMultiplyAccumulate(a3, b3, c33);
        }
        {
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 0u * afs + k0 + 16u, P.a_sm);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 1u * afs + k0 + 16u, P.a_sm);
        let a2 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 2u * afs + k0 + 16u, P.a_sm);
        let a3 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 3u * afs + k0 + 16u, P.a_sm);
        var bofs = bcol + k0 + 16u;
        if (!B_KMAJOR) {
            bofs = bcol + (k0 + 16u) * bkst;
        }
        var b0: subgroup_matrix_right<f16, 16, 16>;
        var b1: subgroup_matrix_right<f16, 16, 16>;
        var b2: subgroup_matrix_right<f16, 16, 16>;
        var b3: subgroup_matrix_right<f16, 16, 16>;
        if (B_KMAJOR) {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 0u * bfs, bkst);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 1u * bfs, bkst);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 2u * bfs, bkst);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 3u * bfs, bkst);
        } else {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 0u * bfs, bkst);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 1u * bfs, bkst);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 2u * bfs, bkst);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 3u * bfs, bkst);
        }
        c00 = subgroupMatrixMultiplyAccumulate(a0, b0, c00);
        c01 = subgroupMatrixMultiplyAccumulate(a0, b1, c01);
        c02 = subgroupMatrixMultiplyAccumulate(a0, b2, c02);
        c03 = subgroupMatrixMultiplyAccumulate(a0, b3, c03);
        c10 = subgroupMatrixMultiplyAccumulate(a1, b0, c10);
        c11 = subgroupMatrixMultiplyAccumulate(a1, b1, c11);
        c12 = subgroupMatrixMultiplyAccumulate(a1, b2, c12);
        c13 = subgroupMatrixMultiplyAccumulate(a1, b3, c13);
        c20 = subgroupMatrixMultiplyAccumulate(a2, b0, c20);
        c21 = subgroupMatrixMultiplyAccumulate(a2, b1, c21);
        c22 = subgroupMatrixMultiplyAccumulate(a2, b2, c22);
        c23 = subgroupMatrixMultiplyAccumulate(a2, b3, c23);
        c30 = subgroupMatrixMultiplyAccumulate(a3, b0, c30);
        c31 = subgroupMatrixMultiplyAccumulate(a3, b1, c31);
        c32 = subgroupMatrixMultiplyAccumulate(a3, b2, c32);
        c33 = subgroupMatrixMultiplyAccumulate(a3, b3, c33);
        }
    }
    // The rest of K (all of it for edge tiles) through 16-wide slices in workgroup memory.
    for (var k0 = kd; k0 < P.K; k0 += 16u) {
        workgroupBarrier();
        stage_a(tid, 128u, m0, k0, o.x);
        stage_b(tid, 128u, 128u, n0, k0, o.y);
        workgroupBarrier();
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&sA, (wm + 0u) * KS, KS);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&sA, (wm + 16u) * KS, KS);
        let a2 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&sA, (wm + 32u) * KS, KS);
        let a3 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&sA, (wm + 48u) * KS, KS);
        let b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&sB, (wn + 0u) * KS, KS);
        let b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&sB, (wn + 16u) * KS, KS);
        let b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&sB, (wn + 32u) * KS, KS);
        let b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&sB, (wn + 48u) * KS, KS);
        c00 = subgroupMatrixMultiplyAccumulate(a0, b0, c00);
        c01 = subgroupMatrixMultiplyAccumulate(a0, b1, c01);
        c02 = subgroupMatrixMultiplyAccumulate(a0, b2, c02);
        c03 = subgroupMatrixMultiplyAccumulate(a0, b3, c03);
        c10 = subgroupMatrixMultiplyAccumulate(a1, b0, c10);
        c11 = subgroupMatrixMultiplyAccumulate(a1, b1, c11);
        c12 = subgroupMatrixMultiplyAccumulate(a1, b2, c12);
        c13 = subgroupMatrixMultiplyAccumulate(a1, b3, c13);
        c20 = subgroupMatrixMultiplyAccumulate(a2, b0, c20);
        c21 = subgroupMatrixMultiplyAccumulate(a2, b1, c21);
        c22 = subgroupMatrixMultiplyAccumulate(a2, b2, c22);
        c23 = subgroupMatrixMultiplyAccumulate(a2, b3, c23);
        c30 = subgroupMatrixMultiplyAccumulate(a3, b0, c30);
        c31 = subgroupMatrixMultiplyAccumulate(a3, b1, c31);
        c32 = subgroupMatrixMultiplyAccumulate(a3, b2, c32);
        c33 = subgroupMatrixMultiplyAccumulate(a3, b3, c33);
    }
    if (plain_store(m0, n0, 128u, 128u, z, o.z)) {
        let cb = o.z + (m0 + wm) * P.c_sm + n0 + wn;
        subgroupMatrixStore<row_major>(&C, cb + 0u * P.c_sm + 0u, c00, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 0u * P.c_sm + 16u, c01, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 0u * P.c_sm + 32u, c02, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 0u * P.c_sm + 48u, c03, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 16u * P.c_sm + 0u, c10, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 16u * P.c_sm + 16u, c11, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 16u * P.c_sm + 32u, c12, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 16u * P.c_sm + 48u, c13, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 32u * P.c_sm + 0u, c20, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 32u * P.c_sm + 16u, c21, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 32u * P.c_sm + 32u, c22, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 32u * P.c_sm + 48u, c23, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 48u * P.c_sm + 0u, c30, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 48u * P.c_sm + 16u, c31, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 48u * P.c_sm + 32u, c32, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 48u * P.c_sm + 48u, c33, P.c_sm);
        return;
    }
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c00, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 0u, n0 + wn + 0u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c01, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 0u, n0 + wn + 16u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c02, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 0u, n0 + wn + 32u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c03, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 0u, n0 + wn + 48u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c10, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 16u, n0 + wn + 0u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c11, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 16u, n0 + wn + 16u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c12, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 16u, n0 + wn + 32u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c13, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 16u, n0 + wn + 48u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c20, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 32u, n0 + wn + 0u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c21, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 32u, n0 + wn + 16u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c22, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 32u, n0 + wn + 32u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c23, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 32u, n0 + wn + 48u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c30, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 48u, n0 + wn + 0u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c31, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 48u, n0 + wn + 16u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c32, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 48u, n0 + wn + 32u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c33, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 48u, n0 + wn + 48u);
}

// mm_sgmat_d8: 8 subgroups (4 x 2), each 32x64 of C (2 x 4 result matrices), 128x128 tiles:
// twice the subgroups per multiprocessor to hide the global-load latency.
@compute @workgroup_size(256)
fn mm_sgmat_d8(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let z = wid.z;
    let o = batch_offsets(z);
    let m0 = wid.y * 128u;
    let n0 = wid.x * 128u;
    let wm = (sg / 2u) * 32u;
    let wn = (sg % 2u) * 64u;
    var c00 = subgroup_matrix_result<f32, 16, 16>();
    var c01 = subgroup_matrix_result<f32, 16, 16>();
    var c02 = subgroup_matrix_result<f32, 16, 16>();
    var c03 = subgroup_matrix_result<f32, 16, 16>();
    var c10 = subgroup_matrix_result<f32, 16, 16>();
    var c11 = subgroup_matrix_result<f32, 16, 16>();
    var c12 = subgroup_matrix_result<f32, 16, 16>();
    var c13 = subgroup_matrix_result<f32, 16, 16>();
    let kd = direct_k(m0, n0, 128u, 128u, o);
    let arow = o.x + (m0 + wm) * P.a_sm;
    var bcol = o.y + (n0 + wn) * P.b_sn;  // B k-major: fragment j at bcol + 16 j * b_sn + k
    var bkst = P.b_sn;
    var bfs = 16u * P.b_sn;
    if (!B_KMAJOR) {
        bcol = o.y + n0 + wn;             // B n-major: fragment j at bcol + k * b_sk + 16 j
        bkst = P.b_sk;
        bfs = 16u;
    }
    let afs = 16u * P.a_sm;
    for (var k0 = 0u; k0 < kd; k0 += 32u) {
        {
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 0u * afs + k0, P.a_sm);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 1u * afs + k0, P.a_sm);
        var bofs = bcol + k0;
        if (!B_KMAJOR) {
            bofs = bcol + (k0) * bkst;
        }
        var b0: subgroup_matrix_right<f16, 16, 16>;
        var b1: subgroup_matrix_right<f16, 16, 16>;
        var b2: subgroup_matrix_right<f16, 16, 16>;
        var b3: subgroup_matrix_right<f16, 16, 16>;
        if (B_KMAJOR) {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 0u * bfs, bkst);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 1u * bfs, bkst);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 2u * bfs, bkst);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 3u * bfs, bkst);
        } else {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 0u * bfs, bkst);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 1u * bfs, bkst);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 2u * bfs, bkst);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 3u * bfs, bkst);
        }
        c00 = subgroupMatrixMultiplyAccumulate(a0, b0, c00);
        c01 = subgroupMatrixMultiplyAccumulate(a0, b1, c01);
        c02 = subgroupMatrixMultiplyAccumulate(a0, b2, c02);
        c03 = subgroupMatrixMultiplyAccumulate(a0, b3, c03);
        c10 = subgroupMatrixMultiplyAccumulate(a1, b0, c10);
        c11 = subgroupMatrixMultiplyAccumulate(a1, b1, c11);
        c12 = subgroupMatrixMultiplyAccumulate(a1, b2, c12);
        c13 = subgroupMatrixMultiplyAccumulate(a1, b3, c13);
        }
        {
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 0u * afs + k0 + 16u, P.a_sm);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 1u * afs + k0 + 16u, P.a_sm);
        var bofs = bcol + k0 + 16u;
        if (!B_KMAJOR) {
            bofs = bcol + (k0 + 16u) * bkst;
        }
        var b0: subgroup_matrix_right<f16, 16, 16>;
        var b1: subgroup_matrix_right<f16, 16, 16>;
        var b2: subgroup_matrix_right<f16, 16, 16>;
        var b3: subgroup_matrix_right<f16, 16, 16>;
        if (B_KMAJOR) {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 0u * bfs, bkst);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 1u * bfs, bkst);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 2u * bfs, bkst);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 3u * bfs, bkst);
        } else {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 0u * bfs, bkst);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 1u * bfs, bkst);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 2u * bfs, bkst);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 3u * bfs, bkst);
        }
        c00 = subgroupMatrixMultiplyAccumulate(a0, b0, c00);
        c01 = subgroupMatrixMultiplyAccumulate(a0, b1, c01);
        c02 = subgroupMatrixMultiplyAccumulate(a0, b2, c02);
        c03 = subgroupMatrixMultiplyAccumulate(a0, b3, c03);
        c10 = subgroupMatrixMultiplyAccumulate(a1, b0, c10);
        c11 = subgroupMatrixMultiplyAccumulate(a1, b1, c11);
        c12 = subgroupMatrixMultiplyAccumulate(a1, b2, c12);
        c13 = subgroupMatrixMultiplyAccumulate(a1, b3, c13);
        }
    }
    // The rest of K (all of it for edge tiles) through 16-wide slices in workgroup memory.
    for (var k0 = kd; k0 < P.K; k0 += 16u) {
        workgroupBarrier();
        stage_a(tid, 256u, m0, k0, o.x);
        stage_b(tid, 256u, 128u, n0, k0, o.y);
        workgroupBarrier();
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&sA, (wm + 0u) * KS, KS);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&sA, (wm + 16u) * KS, KS);
        let b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&sB, (wn + 0u) * KS, KS);
        let b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&sB, (wn + 16u) * KS, KS);
        let b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&sB, (wn + 32u) * KS, KS);
        let b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&sB, (wn + 48u) * KS, KS);
        c00 = subgroupMatrixMultiplyAccumulate(a0, b0, c00);
        c01 = subgroupMatrixMultiplyAccumulate(a0, b1, c01);
        c02 = subgroupMatrixMultiplyAccumulate(a0, b2, c02);
        c03 = subgroupMatrixMultiplyAccumulate(a0, b3, c03);
        c10 = subgroupMatrixMultiplyAccumulate(a1, b0, c10);
        c11 = subgroupMatrixMultiplyAccumulate(a1, b1, c11);
        c12 = subgroupMatrixMultiplyAccumulate(a1, b2, c12);
        c13 = subgroupMatrixMultiplyAccumulate(a1, b3, c13);
    }
    if (plain_store(m0, n0, 128u, 128u, z, o.z)) {
        let cb = o.z + (m0 + wm) * P.c_sm + n0 + wn;
        subgroupMatrixStore<row_major>(&C, cb + 0u * P.c_sm + 0u, c00, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 0u * P.c_sm + 16u, c01, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 0u * P.c_sm + 32u, c02, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 0u * P.c_sm + 48u, c03, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 16u * P.c_sm + 0u, c10, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 16u * P.c_sm + 16u, c11, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 16u * P.c_sm + 32u, c12, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 16u * P.c_sm + 48u, c13, P.c_sm);
        return;
    }
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c00, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 0u, n0 + wn + 0u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c01, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 0u, n0 + wn + 16u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c02, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 0u, n0 + wn + 32u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c03, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 0u, n0 + wn + 48u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c10, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 16u, n0 + wn + 0u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c11, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 16u, n0 + wn + 16u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c12, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 16u, n0 + wn + 32u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c13, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 16u, n0 + wn + 48u);
}

// mm_sgmat_dw: 8 subgroups (2 x 4), each 64x64 of C (4 x 4 result matrices), 128x256 tiles:
// each A fragment serves 4 and each B fragment 4 products, half the B reloads of mm_sgmat_d per tile row.
@compute @workgroup_size(256)
fn mm_sgmat_dw(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let z = wid.z;
    let o = batch_offsets(z);
    let m0 = wid.y * 128u;
    let n0 = wid.x * 256u;
    let wm = (sg / 4u) * 64u;
    let wn = (sg % 4u) * 64u;
    var c00 = subgroup_matrix_result<f32, 16, 16>();
    var c01 = subgroup_matrix_result<f32, 16, 16>();
    var c02 = subgroup_matrix_result<f32, 16, 16>();
    var c03 = subgroup_matrix_result<f32, 16, 16>();
    var c10 = subgroup_matrix_result<f32, 16, 16>();
    var c11 = subgroup_matrix_result<f32, 16, 16>();
    var c12 = subgroup_matrix_result<f32, 16, 16>();
    var c13 = subgroup_matrix_result<f32, 16, 16>();
    var c20 = subgroup_matrix_result<f32, 16, 16>();
    var c21 = subgroup_matrix_result<f32, 16, 16>();
    var c22 = subgroup_matrix_result<f32, 16, 16>();
    var c23 = subgroup_matrix_result<f32, 16, 16>();
    var c30 = subgroup_matrix_result<f32, 16, 16>();
    var c31 = subgroup_matrix_result<f32, 16, 16>();
    var c32 = subgroup_matrix_result<f32, 16, 16>();
    var c33 = subgroup_matrix_result<f32, 16, 16>();
    let kd = direct_k(m0, n0, 128u, 256u, o);
    let arow = o.x + (m0 + wm) * P.a_sm;
    var bcol = o.y + (n0 + wn) * P.b_sn;  // B k-major: fragment j at bcol + 16 j * b_sn + k
    var bkst = P.b_sn;
    var bfs = 16u * P.b_sn;
    if (!B_KMAJOR) {
        bcol = o.y + n0 + wn;             // B n-major: fragment j at bcol + k * b_sk + 16 j
        bkst = P.b_sk;
        bfs = 16u;
    }
    let afs = 16u * P.a_sm;
    for (var k0 = 0u; k0 < kd; k0 += 32u) {
        {
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 0u * afs + k0, P.a_sm);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 1u * afs + k0, P.a_sm);
        let a2 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 2u * afs + k0, P.a_sm);
        let a3 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 3u * afs + k0, P.a_sm);
        var bofs = bcol + k0;
        if (!B_KMAJOR) {
            bofs = bcol + (k0) * bkst;
        }
        var b0: subgroup_matrix_right<f16, 16, 16>;
        var b1: subgroup_matrix_right<f16, 16, 16>;
        var b2: subgroup_matrix_right<f16, 16, 16>;
        var b3: subgroup_matrix_right<f16, 16, 16>;
        if (B_KMAJOR) {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 0u * bfs, bkst);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 1u * bfs, bkst);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 2u * bfs, bkst);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 3u * bfs, bkst);
        } else {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 0u * bfs, bkst);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 1u * bfs, bkst);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 2u * bfs, bkst);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 3u * bfs, bkst);
        }
        c00 = subgroupMatrixMultiplyAccumulate(a0, b0, c00);
        c01 = subgroupMatrixMultiplyAccumulate(a0, b1, c01);
        c02 = subgroupMatrixMultiplyAccumulate(a0, b2, c02);
        c03 = subgroupMatrixMultiplyAccumulate(a0, b3, c03);
        c10 = subgroupMatrixMultiplyAccumulate(a1, b0, c10);
        c11 = subgroupMatrixMultiplyAccumulate(a1, b1, c11);
        c12 = subgroupMatrixMultiplyAccumulate(a1, b2, c12);
        c13 = subgroupMatrixMultiplyAccumulate(a1, b3, c13);
        c20 = subgroupMatrixMultiplyAccumulate(a2, b0, c20);
        c21 = subgroupMatrixMultiplyAccumulate(a2, b1, c21);
        c22 = subgroupMatrixMultiplyAccumulate(a2, b2, c22);
        c23 = subgroupMatrixMultiplyAccumulate(a2, b3, c23);
        c30 = subgroupMatrixMultiplyAccumulate(a3, b0, c30);
        c31 = subgroupMatrixMultiplyAccumulate(a3, b1, c31);
        c32 = subgroupMatrixMultiplyAccumulate(a3, b2, c32);
        c33 = subgroupMatrixMultiplyAccumulate(a3, b3, c33);
        }
        {
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 0u * afs + k0 + 16u, P.a_sm);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 1u * afs + k0 + 16u, P.a_sm);
        let a2 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 2u * afs + k0 + 16u, P.a_sm);
        let a3 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&A, arow + 3u * afs + k0 + 16u, P.a_sm);
        var bofs = bcol + k0 + 16u;
        if (!B_KMAJOR) {
            bofs = bcol + (k0 + 16u) * bkst;
        }
        var b0: subgroup_matrix_right<f16, 16, 16>;
        var b1: subgroup_matrix_right<f16, 16, 16>;
        var b2: subgroup_matrix_right<f16, 16, 16>;
        var b3: subgroup_matrix_right<f16, 16, 16>;
        if (B_KMAJOR) {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 0u * bfs, bkst);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 1u * bfs, bkst);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 2u * bfs, bkst);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&B, bofs + 3u * bfs, bkst);
        } else {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 0u * bfs, bkst);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 1u * bfs, bkst);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 2u * bfs, bkst);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&B, bofs + 3u * bfs, bkst);
        }
        c00 = subgroupMatrixMultiplyAccumulate(a0, b0, c00);
        c01 = subgroupMatrixMultiplyAccumulate(a0, b1, c01);
        c02 = subgroupMatrixMultiplyAccumulate(a0, b2, c02);
        c03 = subgroupMatrixMultiplyAccumulate(a0, b3, c03);
        c10 = subgroupMatrixMultiplyAccumulate(a1, b0, c10);
        c11 = subgroupMatrixMultiplyAccumulate(a1, b1, c11);
        c12 = subgroupMatrixMultiplyAccumulate(a1, b2, c12);
        c13 = subgroupMatrixMultiplyAccumulate(a1, b3, c13);
        c20 = subgroupMatrixMultiplyAccumulate(a2, b0, c20);
        c21 = subgroupMatrixMultiplyAccumulate(a2, b1, c21);
        c22 = subgroupMatrixMultiplyAccumulate(a2, b2, c22);
        c23 = subgroupMatrixMultiplyAccumulate(a2, b3, c23);
        c30 = subgroupMatrixMultiplyAccumulate(a3, b0, c30);
        c31 = subgroupMatrixMultiplyAccumulate(a3, b1, c31);
        c32 = subgroupMatrixMultiplyAccumulate(a3, b2, c32);
        c33 = subgroupMatrixMultiplyAccumulate(a3, b3, c33);
        }
    }
    // The rest of K (all of it for edge tiles) through 16-wide slices in workgroup memory.
    for (var k0 = kd; k0 < P.K; k0 += 16u) {
        workgroupBarrier();
        stage_a(tid, 256u, m0, k0, o.x);
        stage_b(tid, 256u, 256u, n0, k0, o.y);
        workgroupBarrier();
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&sA, (wm + 0u) * KS, KS);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&sA, (wm + 16u) * KS, KS);
        let a2 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&sA, (wm + 32u) * KS, KS);
        let a3 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&sA, (wm + 48u) * KS, KS);
        let b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&sB, (wn + 0u) * KS, KS);
        let b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&sB, (wn + 16u) * KS, KS);
        let b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&sB, (wn + 32u) * KS, KS);
        let b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&sB, (wn + 48u) * KS, KS);
        c00 = subgroupMatrixMultiplyAccumulate(a0, b0, c00);
        c01 = subgroupMatrixMultiplyAccumulate(a0, b1, c01);
        c02 = subgroupMatrixMultiplyAccumulate(a0, b2, c02);
        c03 = subgroupMatrixMultiplyAccumulate(a0, b3, c03);
        c10 = subgroupMatrixMultiplyAccumulate(a1, b0, c10);
        c11 = subgroupMatrixMultiplyAccumulate(a1, b1, c11);
        c12 = subgroupMatrixMultiplyAccumulate(a1, b2, c12);
        c13 = subgroupMatrixMultiplyAccumulate(a1, b3, c13);
        c20 = subgroupMatrixMultiplyAccumulate(a2, b0, c20);
        c21 = subgroupMatrixMultiplyAccumulate(a2, b1, c21);
        c22 = subgroupMatrixMultiplyAccumulate(a2, b2, c22);
        c23 = subgroupMatrixMultiplyAccumulate(a2, b3, c23);
        c30 = subgroupMatrixMultiplyAccumulate(a3, b0, c30);
        c31 = subgroupMatrixMultiplyAccumulate(a3, b1, c31);
        c32 = subgroupMatrixMultiplyAccumulate(a3, b2, c32);
        c33 = subgroupMatrixMultiplyAccumulate(a3, b3, c33);
    }
    if (plain_store(m0, n0, 128u, 256u, z, o.z)) {
        let cb = o.z + (m0 + wm) * P.c_sm + n0 + wn;
        subgroupMatrixStore<row_major>(&C, cb + 0u * P.c_sm + 0u, c00, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 0u * P.c_sm + 16u, c01, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 0u * P.c_sm + 32u, c02, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 0u * P.c_sm + 48u, c03, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 16u * P.c_sm + 0u, c10, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 16u * P.c_sm + 16u, c11, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 16u * P.c_sm + 32u, c12, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 16u * P.c_sm + 48u, c13, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 32u * P.c_sm + 0u, c20, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 32u * P.c_sm + 16u, c21, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 32u * P.c_sm + 32u, c22, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 32u * P.c_sm + 48u, c23, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 48u * P.c_sm + 0u, c30, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 48u * P.c_sm + 16u, c31, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 48u * P.c_sm + 32u, c32, P.c_sm);
        subgroupMatrixStore<row_major>(&C, cb + 48u * P.c_sm + 48u, c33, P.c_sm);
        return;
    }
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c00, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 0u, n0 + wn + 0u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c01, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 0u, n0 + wn + 16u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c02, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 0u, n0 + wn + 32u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c03, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 0u, n0 + wn + 48u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c10, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 16u, n0 + wn + 0u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c11, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 16u, n0 + wn + 16u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c12, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 16u, n0 + wn + 32u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c13, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 16u, n0 + wn + 48u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c20, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 32u, n0 + wn + 0u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c21, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 32u, n0 + wn + 16u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c22, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 32u, n0 + wn + 32u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c23, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 32u, n0 + wn + 48u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c30, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 48u, n0 + wn + 0u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c31, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 48u, n0 + wn + 16u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c32, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 48u, n0 + wn + 32u);
    workgroupBarrier();
    subgroupMatrixStore<row_major>(&tC, sg * 256u, c33, 16u);
    workgroupBarrier();
    write_out(sg, lane, z, o.z, m0 + wm + 48u, n0 + wn + 48u);
}
