// Matrix product on the subgroup-matrix units (tensor cores) of a device with Dawn's
// `chromium-experimental-subgroup-matrix` feature and its f16 x f16 -> f32 16x16x16 config:
// C[z] = alpha * A[z] @ B[z] (+ bias, gelu, + R) with the parameters and binding slots of
// matmul_fast.wgsl (MMParams). Inputs are rounded to float16 as they are staged; products are
// accumulated in float32 (the session's precision="fast"; core/webgpu/ops_sgmat.py chooses it).
//
// A workgroup computes a 128x128 tile of C with 4 or 8 subgroups of 32 threads (the kernel
// assumes subgroups of 32, which the 16x16x16 f16 config implies on the devices that report it,
// NVIDIA's; it needs the `subgroups` feature for subgroup_id). Each subgroup keeps its part of the
// tile as 16x16 result matrices in named registers (a loop-indexed array of them would be placed
// in local memory; docs/NOTES.md). Each K step stages A's 128 x BK and B's BK x 128 tile in
// workgroup memory as float16; the next step's global loads are issued into registers before
// this step's multiply-accumulates and stored after them (STAGES = 2: into the other of two
// shared tiles, one barrier per step). The three entry points at the end differ only in that
// shape (their code is written out per shape: named registers); edit them together.
//
// Storage: A and B are bound as array<vec2<u32>> and read in quads of 4 elements along their
// contiguous axis (float32: two vec2s, float16: one), so K (and N where B runs along n) are
// multiples of 4 and every base and stride of those rows is too (ops_sgmat.py checks it); rows
// past M or N and k past K read zeros. R and the bias are float32, C float32 or float16.

enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;
// The matrix offsets depend on the subgroup id only, so they are uniform within each subgroup,
// which is what the hardware needs; Tint's analysis asks for workgroup uniformity.
diagnostic(off, chromium.subgroup_matrix_uniformity);

//! include mm_params.wgsl
//! include math.wgsl

override DT_OUT: u32 = 0u;        // C storage: 0 float32, 1 float16 (then c_sn == 1, bases and N even)
override DTA: u32 = 0u;           // A storage: 0 float32, 1 float16
override DTB: u32 = 0u;           // B storage: 0 float32, 1 float16
override B_KMAJOR: bool = true;   // B(k, n) at n * b_sn + k (a linear's weight), else at k * b_sk + n
override BIAS: u32 = 0u;          // 0 none, 1 per column n, 2 per row m, 3 per column and batch entry
override ACT: u32 = 0u;           // fused epilogue: 1 gelu (erf), 2 gelu (tanh)
override RES: bool = false;       // fused epilogue: + R(m, n) (float32 [M][N] at P.r_base, one batch)
override NC: u32 = 1u;            // sibling linears: batch entry z writes C, C1 or C2
override STAGES: u32 = 1u;        // shared tiles: 1 (two barriers per step) or 2 (one)

const BM: u32 = 128u;
const BN: u32 = 128u;
const KP: u32 = 40u;              // K step 32: row stride (halves) of k-major tiles, 32 + 8 against bank conflicts
const TILE: u32 = 5120u;          // halves of one stage: BM * KP (>= 32 * NP)
const KP64: u32 = 72u;            // K step 64 (mm_sgmat8k): 64 + 8
const TILE64: u32 = 9216u;        // BM * KP64 (>= 64 * NP)
const NP: u32 = 136u;             // row stride of B's n-major tile

@group(0) @binding(0) var<uniform> P: MMParams;
@group(0) @binding(1) var<storage, read_write> C: array<u32>;
@group(0) @binding(2) var<storage, read_write> A2: array<vec2<u32>>;
@group(0) @binding(3) var<storage, read_write> B2: array<vec2<u32>>;
@group(0) @binding(4) var<storage, read_write> BIASV: array<f32>;
@group(0) @binding(5) var<storage, read_write> R: array<f32>;
@group(0) @binding(6) var<storage, read_write> C1: array<u32>;
@group(0) @binding(7) var<storage, read_write> C2: array<u32>;

var<workgroup> tA: array<f16, STAGES * TILE>;
var<workgroup> tB: array<f16, STAGES * TILE>;
var<workgroup> tA64: array<f16, STAGES * TILE64>;  // mm_sgmat8k's (an entry point uses only the tiles it names)
var<workgroup> tB64: array<f16, STAGES * TILE64>;
var<workgroup> tC: array<f32, 2048>;  // one 16x16 result per subgroup on its way out

// Quad (4 elements along the contiguous axis) at element e (a multiple of 4) of a tensor of dtype dt.
fn quad_a(e: u32) -> vec4<u32> {
    if (DTA == 1u) {
        return vec4<u32>(A2[e >> 2u], 0u, 0u);
    }
    return vec4<u32>(A2[e >> 1u], A2[(e >> 1u) + 1u]);
}

fn quad_b(e: u32) -> vec4<u32> {
    if (DTB == 1u) {
        return vec4<u32>(B2[e >> 2u], 0u, 0u);
    }
    return vec4<u32>(B2[e >> 1u], B2[(e >> 1u) + 1u]);
}

fn halves(q: vec4<u32>, dt: u32) -> vec4<f16> {
    if (dt == 1u) {
        return vec4<f16>(bitcast<vec2<f16>>(q.x), bitcast<vec2<f16>>(q.y));
    }
    return vec4<f16>(bitcast<vec4<f32>>(q));
}

// Quad i of A's 128 x (4 qpr) tile at (m0, k0): row i / qpr, k (i % qpr) * 4.
fn load_a(i: u32, m0: u32, k0: u32, a_off: u32, qpr: u32) -> vec4<u32> {
    let m = m0 + i / qpr;
    let k = k0 + (i % qpr) * 4u;
    if (m < P.M && k < P.K) {
        return quad_a(a_off + m * P.a_sm + k);
    }
    return vec4<u32>(0u);
}

// Quad i of B's tile: k-major 128 (n) x (4 qpr) (k) like A, or n-major (4 qpr) (k) x 128 (n).
fn load_b(i: u32, n0: u32, k0: u32, b_off: u32, qpr: u32) -> vec4<u32> {
    if (B_KMAJOR) {
        let n = n0 + i / qpr;
        let k = k0 + (i % qpr) * 4u;
        if (n < P.N && k < P.K) {
            return quad_b(b_off + n * P.b_sn + k);
        }
        return vec4<u32>(0u);
    }
    let k = k0 + i / 32u;
    let n = n0 + (i % 32u) * 4u;
    if (k < P.K && n < P.N) {
        return quad_b(b_off + k * P.b_sk + n);
    }
    return vec4<u32>(0u);
}

fn put_a(s: u32, i: u32, q: vec4<u32>) {
    let h = halves(q, DTA);
    let p = s * TILE + (i / 8u) * KP + (i % 8u) * 4u;
    tA[p] = h.x;
    tA[p + 1u] = h.y;
    tA[p + 2u] = h.z;
    tA[p + 3u] = h.w;
}

fn put_b(s: u32, i: u32, q: vec4<u32>) {
    let h = halves(q, DTB);
    var p = s * TILE + (i / 8u) * KP + (i % 8u) * 4u;
    if (!B_KMAJOR) {
        p = s * TILE + (i / 32u) * NP + (i % 32u) * 4u;
    }
    tB[p] = h.x;
    tB[p + 1u] = h.y;
    tB[p + 2u] = h.z;
    tB[p + 3u] = h.w;
}

fn put_a64(s: u32, i: u32, q: vec4<u32>) {
    let h = halves(q, DTA);
    let p = s * TILE64 + (i / 16u) * KP64 + (i % 16u) * 4u;
    tA64[p] = h.x;
    tA64[p + 1u] = h.y;
    tA64[p + 2u] = h.z;
    tA64[p + 3u] = h.w;
}

fn put_b64(s: u32, i: u32, q: vec4<u32>) {
    let h = halves(q, DTB);
    var p = s * TILE64 + (i / 16u) * KP64 + (i % 16u) * 4u;
    if (!B_KMAJOR) {
        p = s * TILE64 + (i / 32u) * NP + (i % 32u) * 4u;
    }
    tB64[p] = h.x;
    tB64[p + 1u] = h.y;
    tB64[p + 2u] = h.z;
    tB64[p + 3u] = h.w;
}

fn gelu1(x: f32) -> f32 {
    if (ACT == 2u) {
        return 0.5 * x * (1.0 + tanh_f(0.79788456080286536 * (x + 0.044715 * x * x * x)));
    }
    return 0.5 * x * (1.0 + erf_f(x * 0.70710678118654752));
}

// Result element e of the 16x16 matrix subgroup sg stored at tC[sg * 256] (C(mm, nn)): scaled,
// biased and through the fused epilogue.
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
        C1[w] = bits;
    } else if (NC > 2u && z == 2u) {
        C2[w] = bits;
    } else {
        C[w] = bits;
    }
}

// Lane `lane` of subgroup `sg` writes its pairs of the 16x16 result stored at tC[sg * 256]: rows
// m..m+15, columns n..n+15 of C. A pair is two neighbouring columns, so a float16 C is written
// in whole words (the lowering routes float16 outputs whose pairs are not words through float32).
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

// mm_sgmat: 4 subgroups (2 x 2), each 64x64 of C (4 x 4 result matrices), K step 32.
@compute @workgroup_size(128)
fn mm_sgmat(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let z = wid.z;
    let o = batch_offsets(z);
    let m0 = wid.y * BM;
    let n0 = wid.x * BN;
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
    var qa0 = vec4<u32>(0u);
    var qa1 = vec4<u32>(0u);
    var qa2 = vec4<u32>(0u);
    var qa3 = vec4<u32>(0u);
    var qa4 = vec4<u32>(0u);
    var qa5 = vec4<u32>(0u);
    var qa6 = vec4<u32>(0u);
    var qa7 = vec4<u32>(0u);
    var qb0 = vec4<u32>(0u);
    var qb1 = vec4<u32>(0u);
    var qb2 = vec4<u32>(0u);
    var qb3 = vec4<u32>(0u);
    var qb4 = vec4<u32>(0u);
    var qb5 = vec4<u32>(0u);
    var qb6 = vec4<u32>(0u);
    var qb7 = vec4<u32>(0u);
    let steps = (P.K + 32u - 1u) / 32u;
    var k0 = 0u;
    {
        qa0 = load_a(tid + 0u, m0, k0, o.x, 8u);
        qa1 = load_a(tid + 128u, m0, k0, o.x, 8u);
        qa2 = load_a(tid + 256u, m0, k0, o.x, 8u);
        qa3 = load_a(tid + 384u, m0, k0, o.x, 8u);
        qa4 = load_a(tid + 512u, m0, k0, o.x, 8u);
        qa5 = load_a(tid + 640u, m0, k0, o.x, 8u);
        qa6 = load_a(tid + 768u, m0, k0, o.x, 8u);
        qa7 = load_a(tid + 896u, m0, k0, o.x, 8u);
        qb0 = load_b(tid + 0u, n0, k0, o.y, 8u);
        qb1 = load_b(tid + 128u, n0, k0, o.y, 8u);
        qb2 = load_b(tid + 256u, n0, k0, o.y, 8u);
        qb3 = load_b(tid + 384u, n0, k0, o.y, 8u);
        qb4 = load_b(tid + 512u, n0, k0, o.y, 8u);
        qb5 = load_b(tid + 640u, n0, k0, o.y, 8u);
        qb6 = load_b(tid + 768u, n0, k0, o.y, 8u);
        qb7 = load_b(tid + 896u, n0, k0, o.y, 8u);
    }
    var s = 0u;
    put_a(s, tid + 0u, qa0);
    put_b(s, tid + 0u, qb0);
    put_a(s, tid + 128u, qa1);
    put_b(s, tid + 128u, qb1);
    put_a(s, tid + 256u, qa2);
    put_b(s, tid + 256u, qb2);
    put_a(s, tid + 384u, qa3);
    put_b(s, tid + 384u, qb3);
    put_a(s, tid + 512u, qa4);
    put_b(s, tid + 512u, qb4);
    put_a(s, tid + 640u, qa5);
    put_b(s, tid + 640u, qb5);
    put_a(s, tid + 768u, qa6);
    put_b(s, tid + 768u, qb6);
    put_a(s, tid + 896u, qa7);
    put_b(s, tid + 896u, qb7);
    workgroupBarrier();
    for (var t = 0u; t < steps; t++) {
        k0 = (t + 1u) * 32u;
        if (t + 1u < steps) {
        qa0 = load_a(tid + 0u, m0, k0, o.x, 8u);
        qa1 = load_a(tid + 128u, m0, k0, o.x, 8u);
        qa2 = load_a(tid + 256u, m0, k0, o.x, 8u);
        qa3 = load_a(tid + 384u, m0, k0, o.x, 8u);
        qa4 = load_a(tid + 512u, m0, k0, o.x, 8u);
        qa5 = load_a(tid + 640u, m0, k0, o.x, 8u);
        qa6 = load_a(tid + 768u, m0, k0, o.x, 8u);
        qa7 = load_a(tid + 896u, m0, k0, o.x, 8u);
        qb0 = load_b(tid + 0u, n0, k0, o.y, 8u);
        qb1 = load_b(tid + 128u, n0, k0, o.y, 8u);
        qb2 = load_b(tid + 256u, n0, k0, o.y, 8u);
        qb3 = load_b(tid + 384u, n0, k0, o.y, 8u);
        qb4 = load_b(tid + 512u, n0, k0, o.y, 8u);
        qb5 = load_b(tid + 640u, n0, k0, o.y, 8u);
        qb6 = load_b(tid + 768u, n0, k0, o.y, 8u);
        qb7 = load_b(tid + 896u, n0, k0, o.y, 8u);
        }
        let cur = t % STAGES;
        let sa = cur * TILE + wm * KP;
        let sb = cur * TILE + wn * KP;
        let sbn = cur * TILE + wn;
        {
        var b0: subgroup_matrix_right<f16, 16, 16>; var b1: subgroup_matrix_right<f16, 16, 16>; var b2: subgroup_matrix_right<f16, 16, 16>; var b3: subgroup_matrix_right<f16, 16, 16>;
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA, sa + 0u * KP + 0u, KP);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA, sa + 16u * KP + 0u, KP);
        let a2 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA, sa + 32u * KP + 0u, KP);
        let a3 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA, sa + 48u * KP + 0u, KP);
        if (B_KMAJOR) {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 0u * KP + 0u, KP);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 16u * KP + 0u, KP);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 32u * KP + 0u, KP);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 48u * KP + 0u, KP);
        } else {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 0u * NP + 0u, NP);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 0u * NP + 16u, NP);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 0u * NP + 32u, NP);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 0u * NP + 48u, NP);
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
        var b0: subgroup_matrix_right<f16, 16, 16>; var b1: subgroup_matrix_right<f16, 16, 16>; var b2: subgroup_matrix_right<f16, 16, 16>; var b3: subgroup_matrix_right<f16, 16, 16>;
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA, sa + 0u * KP + 16u, KP);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA, sa + 16u * KP + 16u, KP);
        let a2 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA, sa + 32u * KP + 16u, KP);
        let a3 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA, sa + 48u * KP + 16u, KP);
        if (B_KMAJOR) {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 0u * KP + 16u, KP);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 16u * KP + 16u, KP);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 32u * KP + 16u, KP);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 48u * KP + 16u, KP);
        } else {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 16u * NP + 0u, NP);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 16u * NP + 16u, NP);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 16u * NP + 32u, NP);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 16u * NP + 48u, NP);
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
        if (t + 1u < steps) {
            if (STAGES == 1u) {
                workgroupBarrier();
                s = 0u;
            } else {
                s = (t + 1u) % 2u;
            }
    put_a(s, tid + 0u, qa0);
    put_b(s, tid + 0u, qb0);
    put_a(s, tid + 128u, qa1);
    put_b(s, tid + 128u, qb1);
    put_a(s, tid + 256u, qa2);
    put_b(s, tid + 256u, qb2);
    put_a(s, tid + 384u, qa3);
    put_b(s, tid + 384u, qb3);
    put_a(s, tid + 512u, qa4);
    put_b(s, tid + 512u, qb4);
    put_a(s, tid + 640u, qa5);
    put_b(s, tid + 640u, qb5);
    put_a(s, tid + 768u, qa6);
    put_b(s, tid + 768u, qb6);
    put_a(s, tid + 896u, qa7);
    put_b(s, tid + 896u, qb7);
        }
        workgroupBarrier();
    }
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
    workgroupBarrier();
}

// mm_sgmat8: 8 subgroups (4 x 2), each 32x64 of C (2 x 4 result matrices): half the
// accumulator registers per thread, twice the subgroups per workgroup.
@compute @workgroup_size(256)
fn mm_sgmat8(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let z = wid.z;
    let o = batch_offsets(z);
    let m0 = wid.y * BM;
    let n0 = wid.x * BN;
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
    var qa0 = vec4<u32>(0u);
    var qa1 = vec4<u32>(0u);
    var qa2 = vec4<u32>(0u);
    var qa3 = vec4<u32>(0u);
    var qb0 = vec4<u32>(0u);
    var qb1 = vec4<u32>(0u);
    var qb2 = vec4<u32>(0u);
    var qb3 = vec4<u32>(0u);
    let steps = (P.K + 32u - 1u) / 32u;
    var k0 = 0u;
    {
        qa0 = load_a(tid + 0u, m0, k0, o.x, 8u);
        qa1 = load_a(tid + 256u, m0, k0, o.x, 8u);
        qa2 = load_a(tid + 512u, m0, k0, o.x, 8u);
        qa3 = load_a(tid + 768u, m0, k0, o.x, 8u);
        qb0 = load_b(tid + 0u, n0, k0, o.y, 8u);
        qb1 = load_b(tid + 256u, n0, k0, o.y, 8u);
        qb2 = load_b(tid + 512u, n0, k0, o.y, 8u);
        qb3 = load_b(tid + 768u, n0, k0, o.y, 8u);
    }
    var s = 0u;
    put_a(s, tid + 0u, qa0);
    put_b(s, tid + 0u, qb0);
    put_a(s, tid + 256u, qa1);
    put_b(s, tid + 256u, qb1);
    put_a(s, tid + 512u, qa2);
    put_b(s, tid + 512u, qb2);
    put_a(s, tid + 768u, qa3);
    put_b(s, tid + 768u, qb3);
    workgroupBarrier();
    for (var t = 0u; t < steps; t++) {
        k0 = (t + 1u) * 32u;
        if (t + 1u < steps) {
        qa0 = load_a(tid + 0u, m0, k0, o.x, 8u);
        qa1 = load_a(tid + 256u, m0, k0, o.x, 8u);
        qa2 = load_a(tid + 512u, m0, k0, o.x, 8u);
        qa3 = load_a(tid + 768u, m0, k0, o.x, 8u);
        qb0 = load_b(tid + 0u, n0, k0, o.y, 8u);
        qb1 = load_b(tid + 256u, n0, k0, o.y, 8u);
        qb2 = load_b(tid + 512u, n0, k0, o.y, 8u);
        qb3 = load_b(tid + 768u, n0, k0, o.y, 8u);
        }
        let cur = t % STAGES;
        let sa = cur * TILE + wm * KP;
        let sb = cur * TILE + wn * KP;
        let sbn = cur * TILE + wn;
        {
        var b0: subgroup_matrix_right<f16, 16, 16>; var b1: subgroup_matrix_right<f16, 16, 16>; var b2: subgroup_matrix_right<f16, 16, 16>; var b3: subgroup_matrix_right<f16, 16, 16>;
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA, sa + 0u * KP + 0u, KP);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA, sa + 16u * KP + 0u, KP);
        if (B_KMAJOR) {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 0u * KP + 0u, KP);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 16u * KP + 0u, KP);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 32u * KP + 0u, KP);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 48u * KP + 0u, KP);
        } else {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 0u * NP + 0u, NP);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 0u * NP + 16u, NP);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 0u * NP + 32u, NP);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 0u * NP + 48u, NP);
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
        var b0: subgroup_matrix_right<f16, 16, 16>; var b1: subgroup_matrix_right<f16, 16, 16>; var b2: subgroup_matrix_right<f16, 16, 16>; var b3: subgroup_matrix_right<f16, 16, 16>;
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA, sa + 0u * KP + 16u, KP);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA, sa + 16u * KP + 16u, KP);
        if (B_KMAJOR) {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 0u * KP + 16u, KP);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 16u * KP + 16u, KP);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 32u * KP + 16u, KP);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB, sb + 48u * KP + 16u, KP);
        } else {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 16u * NP + 0u, NP);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 16u * NP + 16u, NP);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 16u * NP + 32u, NP);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB, sbn + 16u * NP + 48u, NP);
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
        if (t + 1u < steps) {
            if (STAGES == 1u) {
                workgroupBarrier();
                s = 0u;
            } else {
                s = (t + 1u) % 2u;
            }
    put_a(s, tid + 0u, qa0);
    put_b(s, tid + 0u, qb0);
    put_a(s, tid + 256u, qa1);
    put_b(s, tid + 256u, qb1);
    put_a(s, tid + 512u, qa2);
    put_b(s, tid + 512u, qb2);
    put_a(s, tid + 768u, qa3);
    put_b(s, tid + 768u, qb3);
        }
        workgroupBarrier();
    }
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
}

// mm_sgmat8k: mm_sgmat8 with a K step of 64 (half the barriers per K; 36 KiB of tiles).
@compute @workgroup_size(256)
fn mm_sgmat8k(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let z = wid.z;
    let o = batch_offsets(z);
    let m0 = wid.y * BM;
    let n0 = wid.x * BN;
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
    var qa0 = vec4<u32>(0u);
    var qa1 = vec4<u32>(0u);
    var qa2 = vec4<u32>(0u);
    var qa3 = vec4<u32>(0u);
    var qa4 = vec4<u32>(0u);
    var qa5 = vec4<u32>(0u);
    var qa6 = vec4<u32>(0u);
    var qa7 = vec4<u32>(0u);
    var qb0 = vec4<u32>(0u);
    var qb1 = vec4<u32>(0u);
    var qb2 = vec4<u32>(0u);
    var qb3 = vec4<u32>(0u);
    var qb4 = vec4<u32>(0u);
    var qb5 = vec4<u32>(0u);
    var qb6 = vec4<u32>(0u);
    var qb7 = vec4<u32>(0u);
    let steps = (P.K + 64u - 1u) / 64u;
    var k0 = 0u;
    {
        qa0 = load_a(tid + 0u, m0, k0, o.x, 16u);
        qa1 = load_a(tid + 256u, m0, k0, o.x, 16u);
        qa2 = load_a(tid + 512u, m0, k0, o.x, 16u);
        qa3 = load_a(tid + 768u, m0, k0, o.x, 16u);
        qa4 = load_a(tid + 1024u, m0, k0, o.x, 16u);
        qa5 = load_a(tid + 1280u, m0, k0, o.x, 16u);
        qa6 = load_a(tid + 1536u, m0, k0, o.x, 16u);
        qa7 = load_a(tid + 1792u, m0, k0, o.x, 16u);
        qb0 = load_b(tid + 0u, n0, k0, o.y, 16u);
        qb1 = load_b(tid + 256u, n0, k0, o.y, 16u);
        qb2 = load_b(tid + 512u, n0, k0, o.y, 16u);
        qb3 = load_b(tid + 768u, n0, k0, o.y, 16u);
        qb4 = load_b(tid + 1024u, n0, k0, o.y, 16u);
        qb5 = load_b(tid + 1280u, n0, k0, o.y, 16u);
        qb6 = load_b(tid + 1536u, n0, k0, o.y, 16u);
        qb7 = load_b(tid + 1792u, n0, k0, o.y, 16u);
    }
    var s = 0u;
    put_a64(s, tid + 0u, qa0);
    put_b64(s, tid + 0u, qb0);
    put_a64(s, tid + 256u, qa1);
    put_b64(s, tid + 256u, qb1);
    put_a64(s, tid + 512u, qa2);
    put_b64(s, tid + 512u, qb2);
    put_a64(s, tid + 768u, qa3);
    put_b64(s, tid + 768u, qb3);
    put_a64(s, tid + 1024u, qa4);
    put_b64(s, tid + 1024u, qb4);
    put_a64(s, tid + 1280u, qa5);
    put_b64(s, tid + 1280u, qb5);
    put_a64(s, tid + 1536u, qa6);
    put_b64(s, tid + 1536u, qb6);
    put_a64(s, tid + 1792u, qa7);
    put_b64(s, tid + 1792u, qb7);
    workgroupBarrier();
    for (var t = 0u; t < steps; t++) {
        k0 = (t + 1u) * 64u;
        if (t + 1u < steps) {
        qa0 = load_a(tid + 0u, m0, k0, o.x, 16u);
        qa1 = load_a(tid + 256u, m0, k0, o.x, 16u);
        qa2 = load_a(tid + 512u, m0, k0, o.x, 16u);
        qa3 = load_a(tid + 768u, m0, k0, o.x, 16u);
        qa4 = load_a(tid + 1024u, m0, k0, o.x, 16u);
        qa5 = load_a(tid + 1280u, m0, k0, o.x, 16u);
        qa6 = load_a(tid + 1536u, m0, k0, o.x, 16u);
        qa7 = load_a(tid + 1792u, m0, k0, o.x, 16u);
        qb0 = load_b(tid + 0u, n0, k0, o.y, 16u);
        qb1 = load_b(tid + 256u, n0, k0, o.y, 16u);
        qb2 = load_b(tid + 512u, n0, k0, o.y, 16u);
        qb3 = load_b(tid + 768u, n0, k0, o.y, 16u);
        qb4 = load_b(tid + 1024u, n0, k0, o.y, 16u);
        qb5 = load_b(tid + 1280u, n0, k0, o.y, 16u);
        qb6 = load_b(tid + 1536u, n0, k0, o.y, 16u);
        qb7 = load_b(tid + 1792u, n0, k0, o.y, 16u);
        }
        let cur = t % STAGES;
        let sa = cur * TILE64 + wm * KP64;
        let sb = cur * TILE64 + wn * KP64;
        let sbn = cur * TILE64 + wn;
        {
        var b0: subgroup_matrix_right<f16, 16, 16>; var b1: subgroup_matrix_right<f16, 16, 16>; var b2: subgroup_matrix_right<f16, 16, 16>; var b3: subgroup_matrix_right<f16, 16, 16>;
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA64, sa + 0u * KP64 + 0u, KP64);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA64, sa + 16u * KP64 + 0u, KP64);
        if (B_KMAJOR) {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 0u * KP64 + 0u, KP64);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 16u * KP64 + 0u, KP64);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 32u * KP64 + 0u, KP64);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 48u * KP64 + 0u, KP64);
        } else {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 0u * NP + 0u, NP);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 0u * NP + 16u, NP);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 0u * NP + 32u, NP);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 0u * NP + 48u, NP);
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
        var b0: subgroup_matrix_right<f16, 16, 16>; var b1: subgroup_matrix_right<f16, 16, 16>; var b2: subgroup_matrix_right<f16, 16, 16>; var b3: subgroup_matrix_right<f16, 16, 16>;
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA64, sa + 0u * KP64 + 16u, KP64);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA64, sa + 16u * KP64 + 16u, KP64);
        if (B_KMAJOR) {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 0u * KP64 + 16u, KP64);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 16u * KP64 + 16u, KP64);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 32u * KP64 + 16u, KP64);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 48u * KP64 + 16u, KP64);
        } else {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 16u * NP + 0u, NP);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 16u * NP + 16u, NP);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 16u * NP + 32u, NP);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 16u * NP + 48u, NP);
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
        var b0: subgroup_matrix_right<f16, 16, 16>; var b1: subgroup_matrix_right<f16, 16, 16>; var b2: subgroup_matrix_right<f16, 16, 16>; var b3: subgroup_matrix_right<f16, 16, 16>;
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA64, sa + 0u * KP64 + 32u, KP64);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA64, sa + 16u * KP64 + 32u, KP64);
        if (B_KMAJOR) {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 0u * KP64 + 32u, KP64);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 16u * KP64 + 32u, KP64);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 32u * KP64 + 32u, KP64);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 48u * KP64 + 32u, KP64);
        } else {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 32u * NP + 0u, NP);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 32u * NP + 16u, NP);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 32u * NP + 32u, NP);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 32u * NP + 48u, NP);
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
        var b0: subgroup_matrix_right<f16, 16, 16>; var b1: subgroup_matrix_right<f16, 16, 16>; var b2: subgroup_matrix_right<f16, 16, 16>; var b3: subgroup_matrix_right<f16, 16, 16>;
        let a0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA64, sa + 0u * KP64 + 48u, KP64);
        let a1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tA64, sa + 16u * KP64 + 48u, KP64);
        if (B_KMAJOR) {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 0u * KP64 + 48u, KP64);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 16u * KP64 + 48u, KP64);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 32u * KP64 + 48u, KP64);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tB64, sb + 48u * KP64 + 48u, KP64);
        } else {
            b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 48u * NP + 0u, NP);
            b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 48u * NP + 16u, NP);
            b2 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 48u * NP + 32u, NP);
            b3 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tB64, sbn + 48u * NP + 48u, NP);
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
        if (t + 1u < steps) {
            if (STAGES == 1u) {
                workgroupBarrier();
                s = 0u;
            } else {
                s = (t + 1u) % 2u;
            }
    put_a64(s, tid + 0u, qa0);
    put_b64(s, tid + 0u, qb0);
    put_a64(s, tid + 256u, qa1);
    put_b64(s, tid + 256u, qb1);
    put_a64(s, tid + 512u, qa2);
    put_b64(s, tid + 512u, qb2);
    put_a64(s, tid + 768u, qa3);
    put_b64(s, tid + 768u, qb3);
    put_a64(s, tid + 1024u, qa4);
    put_b64(s, tid + 1024u, qb4);
    put_a64(s, tid + 1280u, qa5);
    put_b64(s, tid + 1280u, qb5);
    put_a64(s, tid + 1536u, qa6);
    put_b64(s, tid + 1536u, qb6);
    put_a64(s, tid + 1792u, qa7);
    put_b64(s, tid + 1792u, qb7);
        }
        workgroupBarrier();
    }
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
}

