// Matrix products: C[z] = alpha * A[z] @ B[z] + bias, with every operand strided, so one kernel serves
// matmul (batch broadcast, 1-D operands), linear (B = w^T: b_sk = 1), 1x1 conv2d (A = w) and the
// two products of sdpa (B = K^T with grouped-query batch mapping; P @ V).
//
//   A(m, k) = A[a_base + b0*a_sb0 + b1*a_sb1 + m*a_sm + k*a_sk]
//   B(k, n) = B[b_base + b0*b_sb0 + (b1 / group)*b_sb1 + k*b_sk + n*b_sn]
//   C(m, n) = OUT[c_base + b0*c_sb0 + b1*c_sb1 + m*c_sm + n*c_sn]        z = b0 * nb1 + b1
//
// Entry points (core/kernels.py picks one):
// - `mm`: register-blocked tiles. A workgroup of WX x WY threads computes a (8*WY) x (8*WX) tile of
//   C (TM = 8; TM = 4 gives 4x4 per thread and a quarter of the tile), each thread 8x8 outputs held in 16 vec4 registers (two 4-row groups x two 4-column groups
//   half a tile apart, so shared-memory reads are conflict-free vec4s). K advances BK at a time
//   through double-buffered shared tiles: the next tile's global loads are in flight while the
//   current one is multiplied, with one barrier per step. 128x128 tiles (WX = WY = 16, BK = 8) use
//   exactly the default 16 KiB of workgroup memory.
// - `gemv_k`: M <= 4 and b_sk == 1 (decode-time linear layers, q @ K^T): 32 lanes split K for each
//   of 8 columns per workgroup, then a shared-memory tree reduction.
// - `gemv_n`: M <= 4 otherwise (b_sn == 1, e.g. P @ V): one thread per 2 adjacent columns, serial K.
//
// float16 C: threads write column pairs (n even, n + 1) as whole words; kernels.py routes shapes
// where that pairing would straddle rows (odd N, odd strides) through a float32 scratch instead.

//! include common.wgsl

//! include mm_params.wgsl

override DTA: u32 = 0u;
override DTB: u32 = 0u;
override DTBIAS: u32 = 0u;
override BIAS: u32 = 0u;         // 0 none, 1 one value per column n, 2 one value per row m
override A_KMAJOR: bool = true;  // a_sk == 1: tile loads walk k fastest (coalesced)
override B_NMAJOR: bool = true;  // b_sn == 1: tile loads walk n fastest
override WX: u32 = 16u;
override WY: u32 = 16u;
override BK: u32 = 8u;           // <= min(WX, WY): each thread stages at most 8 elements per tile

@group(0) @binding(0) var<uniform> P: MMParams;
@group(0) @binding(2) var<storage, read_write> A: array<u32>;
@group(0) @binding(3) var<storage, read_write> B: array<u32>;
@group(0) @binding(4) var<storage, read_write> BIASV: array<u32>;

fn lda(i: u32) -> f32 { return word_f32(A[widx(i, DTA)], i, DTA); }
fn ldb(i: u32) -> f32 { return word_f32(B[widx(i, DTB)], i, DTB); }

fn bias_at(m: u32, n: u32) -> f32 {
    if (BIAS == 0u) {
        return 0.0;
    }
    let i = P.bias_base + select(m, n, BIAS == 1u);
    return word_f32(BIASV[widx(i, DTBIAS)], i, DTBIAS);
}

// Store C(m, n) (and C(m, n + 1) when `pair`); bounds are the caller's.
fn store_c(c_off: u32, m: u32, n: u32, v0: f32, v1: f32, has1: bool) {
    if (DT_OUT == DT_F16) {
        let e = c_off + m * P.c_sm + n;      // c_sn == 1, even: kernels.py
        store_pair(e >> 1u, v0, v1, true, has1);
        return;
    }
    let e = c_off + m * P.c_sm + n * P.c_sn;
    store_f(e, v0);
    if (has1) {
        store_f(e + P.c_sn, v1);
    }
}

// ------------------------------------------------------------------------------------------ mm

// Micro-tile: 8 (8x8 outputs per thread) or 4 (4x4: four times the threads for the same output,
// for products too small to fill the GPU with 8x8 tiles, e.g. prefill-sized M).
override TM: u32 = 8u;

var<workgroup> As: array<vec4<f32>, 2u * BK * (TM / 4u) * WY>;   // [buffer][k][BM / 4], BM = TM * WY
var<workgroup> Bs: array<vec4<f32>, 2u * BK * (TM / 4u) * WX>;   // [buffer][k][BN / 4], BN = TM * WX

// Element `idx` of the A tile of step k0 (rows m0.., BK columns), zero outside A. The tile is
// walked along whichever of A's axes is contiguous, so neighbouring threads read neighbouring words.
fn tile_a(idx: u32, m0: u32, k0: u32, a_off: u32) -> f32 {
    let BM = TM * WY;
    var r = idx / BK;
    var kk = idx % BK;
    if (!A_KMAJOR) {
        r = idx % BM;
        kk = idx / BM;
    }
    let m = m0 + r;
    let k = k0 + kk;
    if (m >= P.M || k >= P.K) {
        return 0.0;
    }
    return lda(a_off + m * P.a_sm + k * P.a_sk);
}

fn tile_b(idx: u32, n0: u32, k0: u32, b_off: u32) -> f32 {
    let BN = TM * WX;
    var c = idx % BN;
    var kk = idx / BN;
    if (!B_NMAJOR) {
        c = idx / BK;
        kk = idx % BK;
    }
    let n = n0 + c;
    let k = k0 + kk;
    if (n >= P.N || k >= P.K) {
        return 0.0;
    }
    return ldb(b_off + k * P.b_sk + n * P.b_sn);
}

// Store element `idx` of a staged tile into shared buffer `buf` ([k][rows / 4] vec4s).
fn put_a(idx: u32, buf: u32, v: f32) {
    let BM = TM * WY;
    let AV = BM / 4u;
    var r = idx / BK;
    var kk = idx % BK;
    if (!A_KMAJOR) {
        r = idx % BM;
        kk = idx / BM;
    }
    As[buf * BK * AV + kk * AV + (r >> 2u)][r & 3u] = v;
}

fn put_b(idx: u32, buf: u32, v: f32) {
    let BN = TM * WX;
    let BV = BN / 4u;
    var c = idx % BN;
    var kk = idx / BN;
    if (!B_NMAJOR) {
        c = idx / BK;
        kk = idx % BK;
    }
    Bs[buf * BK * BV + kk * BV + (c >> 2u)][c & 3u] = v;
}

@compute @workgroup_size(WX, WY)
fn mm(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let BM = TM * WY;
    let BN = TM * WX;
    let AV = BM / 4u;   // vec4s per k-row of As
    let BV = BN / 4u;
    let NT = WX * WY;
    let tid = lid.y * WX + lid.x;
    let tx = lid.x;
    let ty = lid.y;
    let m0 = wid.y * BM;
    let n0 = wid.x * BN;
    let offs = batch_offsets(wid.z);
    // Tile elements each thread stages per step: 2, 4 or 8 (kernels.py keeps BK <= WX = WY).
    let LA = BM * BK / NT;
    let LB = BN * BK / NT;
    let nt = (P.K + BK - 1u) / BK;

    // Every register is a named variable and every conditional below depends only on pipeline
    // constants: a loop-indexed register array may be demoted to local memory by a driver
    // compiler that does not unroll the loop (it was, on an H100).
    var ra0 = vec4<f32>(0.0);
    var ra1 = vec4<f32>(0.0);
    var rb0 = vec4<f32>(0.0);
    var rb1 = vec4<f32>(0.0);
    var c0 = vec4<f32>(0.0); var c1 = vec4<f32>(0.0); var c2 = vec4<f32>(0.0); var c3 = vec4<f32>(0.0);
    var c4 = vec4<f32>(0.0); var c5 = vec4<f32>(0.0); var c6 = vec4<f32>(0.0); var c7 = vec4<f32>(0.0);
    var c8 = vec4<f32>(0.0); var c9 = vec4<f32>(0.0); var c10 = vec4<f32>(0.0); var c11 = vec4<f32>(0.0);
    var c12 = vec4<f32>(0.0); var c13 = vec4<f32>(0.0); var c14 = vec4<f32>(0.0); var c15 = vec4<f32>(0.0);

    // Step s stages tile s in registers (its global loads in flight), multiplies tile s - 1 from
    // shared buffer (s - 1) & 1, then stores tile s into buffer s & 1, which was last read at step
    // s - 1, before the previous barrier: one barrier per step.
    for (var s = 0u; s <= nt; s++) {
        if (s < nt) {
            let k0 = s * BK;
            ra0.x = tile_a(tid, m0, k0, offs.x);
            ra0.y = tile_a(NT + tid, m0, k0, offs.x);
            rb0.x = tile_b(tid, n0, k0, offs.y);
            rb0.y = tile_b(NT + tid, n0, k0, offs.y);
            if (LA > 2u) {
                ra0.z = tile_a(2u * NT + tid, m0, k0, offs.x);
                ra0.w = tile_a(3u * NT + tid, m0, k0, offs.x);
            }
            if (LB > 2u) {
                rb0.z = tile_b(2u * NT + tid, n0, k0, offs.y);
                rb0.w = tile_b(3u * NT + tid, n0, k0, offs.y);
            }
            if (LA > 4u) {
                ra1.x = tile_a(4u * NT + tid, m0, k0, offs.x);
                ra1.y = tile_a(5u * NT + tid, m0, k0, offs.x);
                ra1.z = tile_a(6u * NT + tid, m0, k0, offs.x);
                ra1.w = tile_a(7u * NT + tid, m0, k0, offs.x);
            }
            if (LB > 4u) {
                rb1.x = tile_b(4u * NT + tid, n0, k0, offs.y);
                rb1.y = tile_b(5u * NT + tid, n0, k0, offs.y);
                rb1.z = tile_b(6u * NT + tid, n0, k0, offs.y);
                rb1.w = tile_b(7u * NT + tid, n0, k0, offs.y);
            }
        }
        if (s > 0u) {
            let abase = ((s - 1u) & 1u) * BK * AV;
            let bbase = ((s - 1u) & 1u) * BK * BV;
            if (TM == 4u) {
                for (var kk = 0u; kk < BK; kk++) {
                    let a0 = As[abase + kk * AV + ty];
                    let b0 = Bs[bbase + kk * BV + tx];
                    c0 += a0.x * b0;
                    c2 += a0.y * b0;
                    c4 += a0.z * b0;
                    c6 += a0.w * b0;
                }
            } else {
                for (var kk = 0u; kk < BK; kk++) {
                    let a0 = As[abase + kk * AV + ty];
                    let a1 = As[abase + kk * AV + WY + ty];
                    let b0 = Bs[bbase + kk * BV + tx];
                    let b1 = Bs[bbase + kk * BV + WX + tx];
                    c0 += a0.x * b0; c1 += a0.x * b1;
                    c2 += a0.y * b0; c3 += a0.y * b1;
                    c4 += a0.z * b0; c5 += a0.z * b1;
                    c6 += a0.w * b0; c7 += a0.w * b1;
                    c8 += a1.x * b0; c9 += a1.x * b1;
                    c10 += a1.y * b0; c11 += a1.y * b1;
                    c12 += a1.z * b0; c13 += a1.z * b1;
                    c14 += a1.w * b0; c15 += a1.w * b1;
                }
            }
        }
        if (s < nt) {
            let buf = s & 1u;
            put_a(tid, buf, ra0.x);
            put_a(NT + tid, buf, ra0.y);
            put_b(tid, buf, rb0.x);
            put_b(NT + tid, buf, rb0.y);
            if (LA > 2u) {
                put_a(2u * NT + tid, buf, ra0.z);
                put_a(3u * NT + tid, buf, ra0.w);
            }
            if (LB > 2u) {
                put_b(2u * NT + tid, buf, rb0.z);
                put_b(3u * NT + tid, buf, rb0.w);
            }
            if (LA > 4u) {
                put_a(4u * NT + tid, buf, ra1.x);
                put_a(5u * NT + tid, buf, ra1.y);
                put_a(6u * NT + tid, buf, ra1.z);
                put_a(7u * NT + tid, buf, ra1.w);
            }
            if (LB > 4u) {
                put_b(4u * NT + tid, buf, rb1.x);
                put_b(5u * NT + tid, buf, rb1.y);
                put_b(6u * NT + tid, buf, rb1.z);
                put_b(7u * NT + tid, buf, rb1.w);
            }
        }
        workgroupBarrier();
    }

    // Epilogue: rows ty*4 + r and BM/2 + ty*4 + r; columns tx*4 + j and BN/2 + tx*4 + j.
    let ma = m0 + ty * 4u;
    if (TM == 4u) {
        let n4 = n0 + tx * 4u;
        store_row4(offs.z, ma, n4, c0);
        store_row4(offs.z, ma + 1u, n4, c2);
        store_row4(offs.z, ma + 2u, n4, c4);
        store_row4(offs.z, ma + 3u, n4, c6);
        return;
    }
    let mb = m0 + BM / 2u + ty * 4u;
    let na = n0 + tx * 4u;
    let nb = n0 + BN / 2u + tx * 4u;
    store_row(offs.z, ma, na, nb, c0, c1);
    store_row(offs.z, ma + 1u, na, nb, c2, c3);
    store_row(offs.z, ma + 2u, na, nb, c4, c5);
    store_row(offs.z, ma + 3u, na, nb, c6, c7);
    store_row(offs.z, mb, na, nb, c8, c9);
    store_row(offs.z, mb + 1u, na, nb, c10, c11);
    store_row(offs.z, mb + 2u, na, nb, c12, c13);
    store_row(offs.z, mb + 3u, na, nb, c14, c15);
}

// C(m, na..na+3) = va and C(m, nb..nb+3) = vb (scaled, biased, clipped to M x N).
fn store_row(c_off: u32, m: u32, na: u32, nb: u32, va: vec4<f32>, vb: vec4<f32>) {
    if (m >= P.M) {
        return;
    }
    store_two(c_off, m, na, va.x, va.y);
    store_two(c_off, m, na + 2u, va.z, va.w);
    store_two(c_off, m, nb, vb.x, vb.y);
    store_two(c_off, m, nb + 2u, vb.z, vb.w);
}

fn store_row4(c_off: u32, m: u32, n: u32, v: vec4<f32>) {
    if (m >= P.M) {
        return;
    }
    store_two(c_off, m, n, v.x, v.y);
    store_two(c_off, m, n + 2u, v.z, v.w);
}

fn store_two(c_off: u32, m: u32, n: u32, a0: f32, a1: f32) {
    if (n >= P.N) {
        return;
    }
    let has1 = n + 1u < P.N;
    var v1 = 0.0;
    if (has1) { v1 = P.alpha * a1 + bias_at(m, n + 1u); }
    store_c(c_off, m, n, P.alpha * a0 + bias_at(m, n), v1, has1);
}

// -------------------------------------------------------------------------------------- gemv_k

const GV_COLS: u32 = 8u;
const GV_LANES: u32 = 32u;
// Rows of A (M <= 4) as a pipeline constant. Row m's accumulator is component m of a vec4, touched
// only under `GM > m` tests of that constant: no loop-indexed register array.
override GM: u32 = 1u;

var<workgroup> red: array<vec4<f32>, 256>;   // [col][lane], component m = row m

// A(m, k) for rows 0..3 (rows past GM read as 0).
fn a_rows(a_off: u32, k: u32) -> vec4<f32> {
    var a = vec4<f32>(0.0);
    a.x = lda(a_off + k * P.a_sk);
    if (GM > 1u) { a.y = lda(a_off + P.a_sm + k * P.a_sk); }
    if (GM > 2u) { a.z = lda(a_off + 2u * P.a_sm + k * P.a_sk); }
    if (GM > 3u) { a.w = lda(a_off + 3u * P.a_sm + k * P.a_sk); }
    return a;
}

@compute @workgroup_size(256)
fn gemv_k(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let lane = li % GV_LANES;
    let col = li / GV_LANES;
    let n = wid.x * GV_COLS + col;
    let offs = batch_offsets(wid.z);
    var acc = vec4<f32>(0.0);
    if (n < P.N) {
        for (var k = lane; k < P.K; k += GV_LANES) {
            acc += a_rows(offs.x, k) * ldb(offs.y + k * P.b_sk + n * P.b_sn);
        }
    }
    red[li] = acc;
    workgroupBarrier();
    for (var s = GV_LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            red[li] += red[li + s];
        }
        workgroupBarrier();
    }
    // Column pairs: thread q writes row q / 4, columns 2 * (q % 4) and + 1 of this workgroup.
    let m = li / (GV_COLS / 2u);
    let c = 2u * (li % (GV_COLS / 2u));
    let n0 = wid.x * GV_COLS + c;
    if (m < GM && n0 < P.N) {
        let has1 = n0 + 1u < P.N;
        let v0 = P.alpha * red[c * GV_LANES][m] + bias_at(m, n0);
        var v1 = 0.0;
        if (has1) { v1 = P.alpha * red[(c + 1u) * GV_LANES][m] + bias_at(m, n0 + 1u); }
        store_c(offs.z, m, n0, v0, v1, has1);
    }
}

// -------------------------------------------------------------------------------------- gemv_n

fn store_gemv_n(c_off: u32, m: u32, n: u32, v0: f32, v1: f32, has1: bool) {
    var w1 = 0.0;
    if (has1) { w1 = P.alpha * v1 + bias_at(m, n + 1u); }
    store_c(c_off, m, n, P.alpha * v0 + bias_at(m, n), w1, has1);
}

@compute @workgroup_size(256)
fn gemv_n(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let n = 2u * (wid.x * 256u + li);
    if (n >= P.N) {
        return;
    }
    let has1 = n + 1u < P.N;
    let offs = batch_offsets(wid.z);
    var acc0 = vec4<f32>(0.0);   // column n, rows 0..3
    var acc1 = vec4<f32>(0.0);   // column n + 1
    for (var k = 0u; k < P.K; k++) {
        let bo = offs.y + k * P.b_sk + n * P.b_sn;
        let b0 = ldb(bo);
        var b1 = 0.0;
        if (has1) { b1 = ldb(bo + P.b_sn); }
        let a = a_rows(offs.x, k);
        acc0 += a * b0;
        acc1 += a * b1;
    }
    store_gemv_n(offs.z, 0u, n, acc0.x, acc1.x, has1);
    if (GM > 1u) { store_gemv_n(offs.z, 1u, n, acc0.y, acc1.y, has1); }
    if (GM > 2u) { store_gemv_n(offs.z, 2u, n, acc0.z, acc1.z, has1); }
    if (GM > 3u) { store_gemv_n(offs.z, 3u, n, acc0.w, acc1.w, has1); }
}
