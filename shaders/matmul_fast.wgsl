// Fast float32 matrix product for the shapes that allow vec4 memory access (see core/kernels.py,
// `_mm_fast_ok`): C[z] = alpha * A[z] @ B[z] + bias with the same parameters and binding slots as
// matmul.wgsl's `mm`, but
// - every operand is float32, bound as array<vec4<f32>>: one 16-byte global load or store moves
//   four elements (B may be float16 instead, B_F16: four halves per 8-byte load from BH, widened
//   to float32 as they are staged, so a float16 weight costs half the bytes and no shader-f16) (A(m, k..k+3) with a_sk == 1; B(k, n..n+3) with b_sn == 1, or B(k..k+3, n) with
//   b_sk == 1 when B_KMAJOR, i.e. B = W^T of a linear layer; C(m, n..n+3) with c_sn == 1). So
//   K (and N) are multiples of 4 and every base and stride of the 4-element axis' rows is too;
// - no per-element dtype decode, and every register (tile staging, 64 accumulators) is a named
//   variable: a loop-indexed register array is demoted to local memory by a driver compiler that
//   does not unroll the loop, which is what made `mm` run at 4 % of cuBLAS on an H100;
// - the tile loads for step t + 1 are issued before step t is multiplied, so their latency hides
//   behind 8 x BK FMAs per thread (one shared tile, two barriers per step).
//
// A workgroup of WX x WY threads computes a (8 WY) x (8 WX) tile of C, each thread 8x8 outputs: rows
// ty*4 + r and BM/2 + ty*4 + r, columns tx*4 + j and BN/2 + tx*4 + j (conflict-free vec4 reads of
// the shared tiles). Each thread stages (8 WY) BK / 4 / (WX WY) vec4s of A and (8 WX) BK / 4 / (WX WY)
// of B per step, each at most 1 or exactly 2 or 4 (kernels.py `_stage_ok`): BK in {4, 8, 16, 32} for
// 128x128 tiles, {4, 8, 16} for 64x64; 64x128 and 128x64 tiles (WX != WY) take BK <= 16. 128x128
// tiles with BK = 16 use 16 KiB of workgroup memory. Split-K (KSPLIT > 1) as in mm_f32_4 below.

//! include mm_params.wgsl
//! include math.wgsl

override BIAS: u32 = 0u;          // 0 none, 1 one value per column n, 2 one value per row m
override B_KMAJOR: bool = false;  // b_sk == 1 (vec4 along k) instead of b_sn == 1 (vec4 along n)
override WX: u32 = 16u;
override WY: u32 = 16u;
override BK: u32 = 16u;
override TM: u32 = 8u;            // outputs per thread along m and n: 8 (mm_f32) or 4 (mm_f32_4)
override KSPLIT: u32 = 1u;        // mm_f32_4: workgroups along z per batch entry, each a range of k
override ACT: u32 = 0u;           // fused epilogue: 1 gelu (erf), 2 gelu (tanh) of the result
override RES: bool = false;       // fused epilogue: + R(m, n) (R float32 [M][N] at P.r_base, one batch)
override STAGES: u32 = 1u;
override B_F16: bool = false;     // B is float16, read from BH (binding 8; B4 is then a placeholder)
override NC: u32 = 1u;            // sibling linears as one batched product: batch z writes C, C1 or C2        // mm_f32: shared tiles (2: the next tile is stored while this one is read)

// Storage stays read_write like every gpudelegate binding (one buffer may be bound at several
// slots of one dispatch; WebGPU forbids mixing read-only and writable views of it).
@group(0) @binding(0) var<uniform> P: MMParams;
@group(0) @binding(1) var<storage, read_write> C4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> A4: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> B4: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> BIASV: array<f32>;
@group(0) @binding(5) var<storage, read_write> R4: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> C4b: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> C4c: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read_write> BH: array<vec2<u32>>;  // B_F16: four halves an element

// B's elements 4e .. 4e + 3 (e counts vec4s of float32 or quads of float16) as float32.
fn b_quad(e: u32) -> vec4<f32> {
    if (B_F16) {
        let h = BH[e];
        return vec4<f32>(unpack2x16float(h.x), unpack2x16float(h.y));
    }
    return B4[e];
}

// Batch index of this workgroup: with NC > 1 which output it writes, with BIAS == 3 which bias
// row it adds (sibling linears: their weights and biases lie back to back).
var<private> zb: u32;

// C(idx) = v, in output zb when NC > 1 (the outputs share one element base).
fn put_c(idx: u32, v: vec4<f32>) {
    if (NC == 1u || zb == 0u) {
        C4[idx] = v;
    } else if (zb == 1u) {
        C4b[idx] = v;
    } else {
        C4c[idx] = v;
    }
}

// One past the last k this invocation's workgroup multiplies: K, or the end of its split-K range.
var<private> k_end: u32;

// Shared tile stage that put_a / put_b write (0 unless STAGES == 2).
var<private> wst: u32;

var<workgroup> As: array<vec4<f32>, BK * TM / 4u * WY * STAGES>;   // [stage][k][BM / 4]
var<workgroup> Bs: array<vec4<f32>, BK * TM / 4u * WX * STAGES>;   // [stage][k][BN / 4]

// One vec4 of a "row-major along k" operand tile (A, or B when B_KMAJOR): the tile is R rows of BK
// elements, vec4 `idx` of it is row idx / (BK/4), k-quad idx % (BK/4). Out of range: zeros.
fn load_kq(idx: u32, r0: u32, rows: u32, k0: u32, base: u32, stride: u32, is_a: bool) -> vec4<f32> {
    let r = r0 + idx / (BK / 4u);
    let k = k0 + 4u * (idx % (BK / 4u));
    if (r >= rows || k >= k_end) {
        return vec4<f32>(0.0);
    }
    let e = (base + r * stride + k) >> 2u;
    if (is_a) {
        return A4[e];
    }
    return b_quad(e);
}

// One vec4 of B's tile along n (b_sn == 1): row kk = idx / (BN/4), n-quad idx % (BN/4).
fn load_nq(idx: u32, n0: u32, k0: u32, base: u32) -> vec4<f32> {
    let BV = TM / 4u * WX;
    let k = k0 + idx / BV;
    let n = n0 + 4u * (idx % BV);
    if (k >= k_end || n >= P.N) {
        return vec4<f32>(0.0);
    }
    return b_quad((base + k * P.b_sk + n) >> 2u);
}

// Scatter a k-quad vec4 (row r, k-quad q of the tile) into a [k][R / 4] shared tile: four scalars.
fn put_a(idx: u32, v: vec4<f32>) {
    let AV = TM / 4u * WY;
    let r = idx / (BK / 4u);
    let k = 4u * (idx % (BK / 4u));
    let o = wst * BK * AV + k * AV + (r >> 2u);
    let c = r & 3u;
    As[o][c] = v.x;
    As[o + AV][c] = v.y;
    As[o + 2u * AV][c] = v.z;
    As[o + 3u * AV][c] = v.w;
}

fn put_b(idx: u32, v: vec4<f32>) {
    let BV = TM / 4u * WX;
    if (B_KMAJOR) {
        let r = idx / (BK / 4u);
        let k = 4u * (idx % (BK / 4u));
        let o = wst * BK * BV + k * BV + (r >> 2u);
        let c = r & 3u;
        Bs[o][c] = v.x;
        Bs[o + BV][c] = v.y;
        Bs[o + 2u * BV][c] = v.z;
        Bs[o + 3u * BV][c] = v.w;
    } else {
        Bs[wst * BK * BV + idx] = v;
    }
}

fn load_b(idx: u32, n0: u32, k0: u32, base: u32) -> vec4<f32> {
    if (B_KMAJOR) {
        return load_kq(idx, n0, P.N, k0, base, P.b_sn, false);
    }
    return load_nq(idx, n0, k0, base);
}

// Store one staged tile (the registers a0..a3 / b0..b3 a thread loaded) into stage `wst`.
fn put_tile(tid: u32, a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>,
            b0: vec4<f32>, b1: vec4<f32>, b2: vec4<f32>, b3: vec4<f32>) {
    let NT = WX * WY;
    let NVA = TM * WY * BK / 4u / NT;
    let NVB = TM * WX * BK / 4u / NT;
    if (tid < TM * WY * BK / 4u) { put_a(tid, a0); }
    if (tid < TM * WX * BK / 4u) { put_b(tid, b0); }
    if (NVA >= 2u) { put_a(tid + NT, a1); }
    if (NVB >= 2u) { put_b(tid + NT, b1); }
    if (NVA >= 4u) { put_a(tid + 2u * NT, a2); put_a(tid + 3u * NT, a3); }
    if (NVB >= 4u) { put_b(tid + 2u * NT, b2); put_b(tid + 3u * NT, b3); }
}

@compute @workgroup_size(WX, WY)
fn mm_f32(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let BM = TM * WY;
    let BN = TM * WX;
    let AV = BM / 4u;
    let BV = BN / 4u;
    let NT = WX * WY;
    let tid = lid.y * WX + lid.x;
    let tx = lid.x;
    let ty = lid.y;
    let m0 = wid.y * BM;
    let n0 = wid.x * BN;
    // Split-K as in mm_f32_4 (KSPLIT == 1: the whole of K). Written out in each kernel, like the
    // tile loads: moving this prologue into functions (split offsets, K range) or the staged
    // registers into a struct made these kernels 5-20% slower on an H100 (A/B in one call,
    // 2026-11-24: 4096^3 28.9 -> 27.2 TFLOP/s, 4096x1536x384 211 -> 260 us).
    let split = wid.z % KSPLIT;
    zb = wid.z / KSPLIT;
    var offs = batch_offsets(wid.z / KSPLIT);
    offs.z += split * P.nb0 * P.nb1 * P.M * P.N;
    let kc = ((P.K + KSPLIT - 1u) / KSPLIT + BK - 1u) / BK * BK;
    let kb = min(split * kc, P.K);
    let ke = min(kb + kc, P.K);
    k_end = ke;
    // vec4s of each operand's tile per thread: BM * BK / 4 / NT for A, BN * BK / 4 / NT for B
    // (different when WX != WY), so with 8x8 per thread: BK = 4: the first threads load one
    // (the count is 0); 8: one; 16: two; 32: four. Named registers, not an array.
    let NVA = BM * BK / 4u / NT;
    let NVB = BN * BK / 4u / NT;
    let QA = BM * BK / 4u;        // vec4s in the A tile
    let QB = BN * BK / 4u;

    var a0 = vec4<f32>(0.0); var a1 = vec4<f32>(0.0); var a2 = vec4<f32>(0.0); var a3 = vec4<f32>(0.0);
    var b0 = vec4<f32>(0.0); var b1 = vec4<f32>(0.0); var b2 = vec4<f32>(0.0); var b3 = vec4<f32>(0.0);

    var c0 = vec4<f32>(0.0); var c1 = vec4<f32>(0.0); var c2 = vec4<f32>(0.0); var c3 = vec4<f32>(0.0);
    var c4 = vec4<f32>(0.0); var c5 = vec4<f32>(0.0); var c6 = vec4<f32>(0.0); var c7 = vec4<f32>(0.0);
    var c8 = vec4<f32>(0.0); var c9 = vec4<f32>(0.0); var c10 = vec4<f32>(0.0); var c11 = vec4<f32>(0.0);
    var c12 = vec4<f32>(0.0); var c13 = vec4<f32>(0.0); var c14 = vec4<f32>(0.0); var c15 = vec4<f32>(0.0);

    let nt = (ke - kb + BK - 1u) / BK;
    // Stage tile 0.
    if (tid < QA) { a0 = load_kq(tid, m0, P.M, kb, offs.x, P.a_sm, true); }
    if (tid < QB) { b0 = load_b(tid, n0, kb, offs.y); }
    if (NVA >= 2u) { a1 = load_kq(tid + NT, m0, P.M, kb, offs.x, P.a_sm, true); }
    if (NVB >= 2u) { b1 = load_b(tid + NT, n0, kb, offs.y); }
    if (NVA >= 4u) {
        a2 = load_kq(tid + 2u * NT, m0, P.M, kb, offs.x, P.a_sm, true);
        a3 = load_kq(tid + 3u * NT, m0, P.M, kb, offs.x, P.a_sm, true);
    }
    if (NVB >= 4u) { b2 = load_b(tid + 2u * NT, n0, kb, offs.y); b3 = load_b(tid + 3u * NT, n0, kb, offs.y); }

    // STAGES == 1: store tile t, barrier, multiply it, barrier. STAGES == 2: tile 0 is stored
    // before the loop; step t multiplies stage t & 1 and stores tile t + 1 into the other stage
    // (read by nobody since the previous barrier): one barrier per step.
    wst = 0u;
    if (STAGES == 2u) {
        put_tile(tid, a0, a1, a2, a3, b0, b1, b2, b3);
        workgroupBarrier();
    }
    for (var t = 0u; t < nt; t++) {
        if (STAGES == 1u) {
            put_tile(tid, a0, a1, a2, a3, b0, b1, b2, b3);
            workgroupBarrier();
        }
        if (t + 1u < nt) {
            // Next tile's global loads, in flight while this one is multiplied.
            let k0 = kb + (t + 1u) * BK;
            if (tid < QA) { a0 = load_kq(tid, m0, P.M, k0, offs.x, P.a_sm, true); }
            if (tid < QB) { b0 = load_b(tid, n0, k0, offs.y); }
            if (NVA >= 2u) { a1 = load_kq(tid + NT, m0, P.M, k0, offs.x, P.a_sm, true); }
            if (NVB >= 2u) { b1 = load_b(tid + NT, n0, k0, offs.y); }
            if (NVA >= 4u) {
                a2 = load_kq(tid + 2u * NT, m0, P.M, k0, offs.x, P.a_sm, true);
                a3 = load_kq(tid + 3u * NT, m0, P.M, k0, offs.x, P.a_sm, true);
            }
            if (NVB >= 4u) { b2 = load_b(tid + 2u * NT, n0, k0, offs.y); b3 = load_b(tid + 3u * NT, n0, k0, offs.y); }
        }
        let ra = (t % STAGES) * BK * AV;
        let rb = (t % STAGES) * BK * BV;
        for (var kk = 0u; kk < BK; kk++) {
            let x0 = As[ra + kk * AV + ty];
            let x1 = As[ra + kk * AV + WY + ty];
            let y0 = Bs[rb + kk * BV + tx];
            let y1 = Bs[rb + kk * BV + WX + tx];
            c0 += x0.x * y0; c1 += x0.x * y1;
            c2 += x0.y * y0; c3 += x0.y * y1;
            c4 += x0.z * y0; c5 += x0.z * y1;
            c6 += x0.w * y0; c7 += x0.w * y1;
            c8 += x1.x * y0; c9 += x1.x * y1;
            c10 += x1.y * y0; c11 += x1.y * y1;
            c12 += x1.z * y0; c13 += x1.z * y1;
            c14 += x1.w * y0; c15 += x1.w * y1;
        }
        if (STAGES == 2u && t + 1u < nt) {
            wst = (t + 1u) & 1u;
            put_tile(tid, a0, a1, a2, a3, b0, b1, b2, b3);
        }
        workgroupBarrier();
    }

    let ma = m0 + ty * 4u;
    let mb = m0 + BM / 2u + ty * 4u;
    let na = n0 + tx * 4u;
    let nb = n0 + BN / 2u + tx * 4u;
    let first = split == 0u;
    store_row(offs.z, ma, na, nb, c0, c1, first);
    store_row(offs.z, ma + 1u, na, nb, c2, c3, first);
    store_row(offs.z, ma + 2u, na, nb, c4, c5, first);
    store_row(offs.z, ma + 3u, na, nb, c6, c7, first);
    store_row(offs.z, mb, na, nb, c8, c9, first);
    store_row(offs.z, mb + 1u, na, nb, c10, c11, first);
    store_row(offs.z, mb + 2u, na, nb, c12, c13, first);
    store_row(offs.z, mb + 3u, na, nb, c14, c15, first);
}

// 4x4 outputs per thread (TM = 4): rows ty*4 + r, columns tx*4 + j of a (4 WY) x (4 WX) tile. For
// products too small to give a GPU enough 128- or 64-wide tiles of 8x8 per thread (the linears
// of a 128-token prefill: M = 128, N = 576): 32x32 tiles of 64 threads, or 64x64 of 256. Each
// thread stages BK / WX vec4s of each operand per step (1/2, 1, 2 or 4, as in mm_f32).
// Split-K (KSPLIT > 1): workgroup z = batch * KSPLIT + s multiplies k in [s kc, (s + 1) kc) (kc a
// multiple of BK) into partial product s of a float32 scratch laid out [KSPLIT][batch][M][N]
// (C's uniform fields describe one partial; alpha applied, bias only in partial 0), and
// mm_f32_sum adds the partials into C. On an H100 a 128-row product's time follows K, not N:
// each workgroup's k loop is a chain of dependent memory round trips, so more, shorter chains win.
@compute @workgroup_size(WX, WY)
fn mm_f32_4(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let BM = TM * WY;
    let BN = TM * WX;
    let AV = BM / 4u;
    let BV = BN / 4u;
    let NT = WX * WY;
    let tid = lid.y * WX + lid.x;
    let tx = lid.x;
    let ty = lid.y;
    let m0 = wid.y * BM;
    let n0 = wid.x * BN;
    let split = wid.z % KSPLIT;
    zb = wid.z / KSPLIT;
    var offs = batch_offsets(wid.z / KSPLIT);
    offs.z += split * P.nb0 * P.nb1 * P.M * P.N;
    let kc = ((P.K + KSPLIT - 1u) / KSPLIT + BK - 1u) / BK * BK;
    let kb = min(split * kc, P.K);
    // A let for the loop bound: the barriers in the loop need uniform control flow, and Dawn's
    // uniformity analysis treats any read of a private variable (k_end) as non-uniform.
    let ke = min(kb + kc, P.K);
    k_end = ke;
    let NV = BM * BK / 4u / NT;
    let QA = BM * BK / 4u;

    var a0 = vec4<f32>(0.0); var a1 = vec4<f32>(0.0); var a2 = vec4<f32>(0.0); var a3 = vec4<f32>(0.0);
    var b0 = vec4<f32>(0.0); var b1 = vec4<f32>(0.0); var b2 = vec4<f32>(0.0); var b3 = vec4<f32>(0.0);
    var c0 = vec4<f32>(0.0); var c1 = vec4<f32>(0.0); var c2 = vec4<f32>(0.0); var c3 = vec4<f32>(0.0);

    let nt = (ke - kb + BK - 1u) / BK;
    if (tid < QA) { a0 = load_kq(tid, m0, P.M, kb, offs.x, P.a_sm, true); b0 = load_b(tid, n0, kb, offs.y); }
    if (NV >= 2u) { a1 = load_kq(tid + NT, m0, P.M, kb, offs.x, P.a_sm, true); b1 = load_b(tid + NT, n0, kb, offs.y); }
    if (NV >= 4u) {
        a2 = load_kq(tid + 2u * NT, m0, P.M, kb, offs.x, P.a_sm, true); b2 = load_b(tid + 2u * NT, n0, kb, offs.y);
        a3 = load_kq(tid + 3u * NT, m0, P.M, kb, offs.x, P.a_sm, true); b3 = load_b(tid + 3u * NT, n0, kb, offs.y);
    }
    for (var t = 0u; t < nt; t++) {
        if (tid < QA) { put_a(tid, a0); put_b(tid, b0); }
        if (NV >= 2u) { put_a(tid + NT, a1); put_b(tid + NT, b1); }
        if (NV >= 4u) { put_a(tid + 2u * NT, a2); put_b(tid + 2u * NT, b2); put_a(tid + 3u * NT, a3); put_b(tid + 3u * NT, b3); }
        workgroupBarrier();
        if (t + 1u < nt) {
            let k0 = kb + (t + 1u) * BK;
            if (tid < QA) { a0 = load_kq(tid, m0, P.M, k0, offs.x, P.a_sm, true); b0 = load_b(tid, n0, k0, offs.y); }
            if (NV >= 2u) { a1 = load_kq(tid + NT, m0, P.M, k0, offs.x, P.a_sm, true); b1 = load_b(tid + NT, n0, k0, offs.y); }
            if (NV >= 4u) {
                a2 = load_kq(tid + 2u * NT, m0, P.M, k0, offs.x, P.a_sm, true); b2 = load_b(tid + 2u * NT, n0, k0, offs.y);
                a3 = load_kq(tid + 3u * NT, m0, P.M, k0, offs.x, P.a_sm, true); b3 = load_b(tid + 3u * NT, n0, k0, offs.y);
            }
        }
        for (var kk = 0u; kk < BK; kk++) {
            let x = As[kk * AV + ty];
            let y = Bs[kk * BV + tx];
            c0 += x.x * y; c1 += x.y * y; c2 += x.z * y; c3 += x.w * y;
        }
        workgroupBarrier();
    }
    let m = m0 + ty * 4u;
    let n = n0 + tx * 4u;
    let first = split == 0u;
    store_one(offs.z, m, n, c0, first);
    store_one(offs.z, m + 1u, n, c1, first);
    store_one(offs.z, m + 2u, n, c2, first);
    store_one(offs.z, m + 3u, n, c3, first);
}

fn store_one(c_off: u32, m: u32, n: u32, v: vec4<f32>, with_bias: bool) {
    if (m < P.M && n < P.N) {
        var r = P.alpha * v;
        if (with_bias) {
            r += bias4(m, n);
        }
        put_c((c_off + m * P.c_sm + n) >> 2u, epilogue(m, n, r));
    }
}

fn gelu4(x: vec4<f32>) -> vec4<f32> {
    if (ACT == 2u) {
        let inner = 0.79788456080286536 * (x + 0.044715 * x * x * x);
        return 0.5 * x * (vec4<f32>(1.0) + vec4<f32>(tanh_f(inner.x), tanh_f(inner.y), tanh_f(inner.z), tanh_f(inner.w)));
    }
    let u = x * 0.70710678118654752;
    return 0.5 * x * (vec4<f32>(1.0) + vec4<f32>(erf_f(u.x), erf_f(u.y), erf_f(u.z), erf_f(u.w)));
}

// The fused consumer of a linear (core/kernels.py `epilogue_fusions`): gelu(C), or C + R with R
// laid out like an unbatched C with contiguous rows. Split-K partials are emitted without it;
// mm_f32_sum applies it to the sum.
fn epilogue(m: u32, n: u32, v: vec4<f32>) -> vec4<f32> {
    var r = v;
    if (ACT != 0u) {
        r = gelu4(r);
    }
    if (RES) {
        r += R4[(P.r_base + m * P.N + n) >> 2u];
    }
    return r;
}

// Split-K epilogue: C(m, n..n+3) = sum over s of partial s (bound at binding 2 as A4, laid out
// [KSPLIT][batch][M][N]); one thread per output vec4, z-major over the batch.
@compute @workgroup_size(256)
fn mm_f32_sum(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    let nq = P.N / 4u;
    let per = P.M * nq;            // vec4s of one batch entry
    let total = P.nb0 * P.nb1 * per;
    if (i >= total) {
        return;
    }
    let z = i / per;
    let m = (i % per) / nq;
    let n = 4u * (i % nq);
    var acc = vec4<f32>(0.0);
    for (var s = 0u; s < KSPLIT; s++) {
        acc += A4[s * total + i];
    }
    let b0 = z / P.nb1;
    let b1 = z % P.nb1;
    zb = z;
    put_c((P.c_base + b0 * P.c_sb0 + b1 * P.c_sb1 + m * P.c_sm + n) >> 2u, epilogue(m, n, acc));
}

fn bias4(m: u32, n: u32) -> vec4<f32> {
    if (BIAS == 1u) {
        let i = P.bias_base + n;
        return vec4<f32>(BIASV[i], BIASV[i + 1u], BIASV[i + 2u], BIASV[i + 3u]);
    }
    if (BIAS == 2u) {
        return vec4<f32>(BIASV[P.bias_base + m]);
    }
    if (BIAS == 3u) {  // per column, one row of N per batch entry (sibling linears' biases)
        let i = P.bias_base + zb * P.N + n;
        return vec4<f32>(BIASV[i], BIASV[i + 1u], BIASV[i + 2u], BIASV[i + 3u]);
    }
    return vec4<f32>(0.0);
}

// C(m, na..na+3) = va and C(m, nb..nb+3) = vb, scaled and biased; N is a multiple of 4, so a quad
// is wholly inside or outside.
fn store_row(c_off: u32, m: u32, na: u32, nb: u32, va: vec4<f32>, vb: vec4<f32>, with_bias: bool) {
    if (m >= P.M) {
        return;
    }
    let row = c_off + m * P.c_sm;
    if (na < P.N) {
        var r = P.alpha * va;
        if (with_bias) {
            r += bias4(m, na);
        }
        put_c((row + na) >> 2u, epilogue(m, na, r));
    }
    if (nb < P.N) {
        var r = P.alpha * vb;
        if (with_bias) {
            r += bias4(m, nb);
        }
        put_c((row + nb) >> 2u, epilogue(m, nb, r));
    }
}
