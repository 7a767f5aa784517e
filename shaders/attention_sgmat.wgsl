// Prefill attention on the subgroup-matrix units (tensor cores): `attn_sgmat`, float32 q, k, v and
// output, at most TKM = 128 keys, head dims of 16 or 32 (precision="fast": q, k, the probabilities
// and v are rounded to float16 on their way into the matrices; products accumulate in float32).
//
// A workgroup of SGS subgroups (1 or 2) takes 16 SGS query rows of one (batch, head), subgroup sg
// rows 16 sg .. 16 sg + 15, and every key of its kv head:
//   1. k and v (all keys) and q (its rows, into its tP) are staged in workgroup memory as
//      float16, keys past tk and rows past tq as zeros (16-byte loads, four keys' in flight);
//   2. scores: each subgroup's 16 x 128 block of q k^T as eight 16x16 result matrices (the head
//      dim in one or two steps of 16), stored as float32 into its own tS;
//   3. the masked softmax of each row: lanes 2r and 2r + 1 take row r's keys 0-63 and 64-127, in
//      three sweeps over tS (scores, their exponentials, the probabilities as float16 into tP), the
//      row maximum and sum shared between the pair by a subgroup shuffle;
//   4. out = P v as one or two 16x16 result matrices per subgroup (eight 16-key steps), through tS
//      to the output rows.
// Semantics as attention_tile.wgsl: a key j is dropped when CAUSAL and j > i + causal_offset, or
// MASK == 1 and the bool mask is 0; MASK == 2 adds a float mask. A row with nothing kept, or whose
// maximum is -inf, gives zeros; a NaN score makes its row NaN.
// Operands are addressed by (batch, head, row) strides with a contiguous last dim, as attn_tile's
// (head permutes fold into them), with the same parameters; q, k and v are read as 16-byte words
// (q_base, k_base and their strides multiples of 4; v's are in vec4s already).
//
// Every matrix load and store names one workgroup array (or an inner array of one) at a literal
// offset and stride, so Dawn's robustness transform leaves it unpredicated (see matmul_sgmat.py).
// Workgroup memory: 20 KiB for k and v, 12 KiB per subgroup (tS, tP): 32 KiB with one subgroup
// (any Dawn adapter), 44 KiB with two (NVIDIA's adapters offer 48 KiB; ops_attention.py picks).

enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;
// Matrix offsets depend on the subgroup id only: uniform within each subgroup, which is what the
// hardware needs; Tint's analysis asks for workgroup uniformity.
diagnostic(off, chromium.subgroup_matrix_uniformity);

//! include common.wgsl

//! include attn_tile_params.wgsl

override DTM: u32 = 0u;
override MASK: u32 = 0u;
override CAUSAL: bool = false;
override DK: u32 = 2u;       // 16-wide steps of the head dim of q and k: 1 (d 16) or 2 (d 32)
override DV: u32 = 2u;       // ... of v: 1 (dv 16) or 2 (dv 32)
override SGS: u32 = 2u;      // subgroups per workgroup: 16 query rows each

const TKM: u32 = 128u;       // keys at most (ops_attention.py ATTN_SGMAT_MAX_KEYS)
const HS: u32 = 40u;         // halves per staged row of q, k, v: 32 dims plus 8 against bank conflicts
const PS: u32 = 128u;        // halves per row of tP (unpadded: one subgroup's tiles fit 32 KiB)
const SS: u32 = 128u;        // floats per row of tS

@group(0) @binding(0) var<uniform> P: TileParams;
@group(0) @binding(2) var<storage, read_write> Q4: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> K4: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> V4: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> MK: array<u32>;

var<workgroup> tK: array<f16, 5120>;                     // [key][HS]
var<workgroup> tV: array<f16, 5120>;                     // [key][HS]
var<workgroup> tS: array<array<f32, 2048>, SGS>;         // per subgroup [row][SS]: scores, then out
var<workgroup> tP: array<array<f16, 2048>, SGS>;         // per subgroup: q [row][HS], then P [row][PS]

// Four dims of a staged k (dst 0) or v (dst 1) row as halves.
fn put4(dst: u32, at: u32, w: vec4<u32>) {
    let h = vec4<f16>(bitcast<vec4<f32>>(w));
    if (dst == 0u) {
        tK[at] = h.x;
        tK[at + 1u] = h.y;
        tK[at + 2u] = h.z;
        tK[at + 3u] = h.w;
    } else {
        tV[at] = h.x;
        tV[at + 1u] = h.y;
        tV[at + 2u] = h.z;
        tV[at + 3u] = h.w;
    }
}

// Four dims of query row `row` of the workgroup (subgroup row / 16's) as halves.
fn put4q(row: u32, c: u32, w: vec4<u32>) {
    let h = vec4<f16>(bitcast<vec4<f32>>(w));
    let at = (row % 16u) * HS + 4u * c;
    tP[row / 16u][at] = h.x;
    tP[row / 16u][at + 1u] = h.y;
    tP[row / 16u][at + 2u] = h.z;
    tP[row / 16u][at + 3u] = h.w;
}

// Final score of (row i, key j) from its raw q.k, or -inf when the key is dropped.
fn score(raw: f32, i: u32, j: u32, mrow0: u32) -> f32 {
    if (i >= P.tq || j >= P.tk || (CAUSAL && i32(j) > i32(i) + P.causal_offset)) {
        return neg_inf();
    }
    var m = 0.0;
    if (MASK != 0u) {
        let mi = mrow0 + i * P.ms_i + j * P.ms_j;
        m = word_f32(MK[widx(mi, DTM)], mi, DTM);
    }
    if (MASK == 1u && m == 0.0) {
        return neg_inf();
    }
    if (MASK == 2u) {
        return raw * P.scale + m;
    }
    return raw * P.scale;
}

@compute @workgroup_size(32u * SGS)
fn attn_sgmat(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
              @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let i0 = wid.x * 16u * SGS;
    let h = wid.y;
    let b = wid.z;
    let kvh = h / P.group;
    let qb = P.q_base + b * P.qs_b + h * P.qs_h;
    let kb = P.k_base + b * P.ks_b + kvh * P.ks_h;
    let vb = P.v_base + b * P.vs_b + kvh * P.vs_h;
    let z = vec4<u32>(0u);

    // ---- 1. staging: thread li takes vec4 c = li % 8 of keys li / 8 + R t (R = 4 SGS threads'
    // rows at a time) and of query rows li / 8 + R t; a vec4 past the dims, a key past tk or a row
    // past tq reads zeros.
    let c = li % 8u;
    let r8 = li / 8u;
    let R = 4u * SGS;
    let kc_ok = c < DK * 4u;
    let vc_ok = c < DV * 4u;
    for (var key0 = r8; key0 < TKM; key0 += 4u * R) {
        let ok0 = key0 < P.tk;
        let ok1 = key0 + R < P.tk;
        let ok2 = key0 + 2u * R < P.tk;
        let ok3 = key0 + 3u * R < P.tk;
        let ka = (kb + key0 * P.ks_j) / 4u + c;
        let ksr = R * P.ks_j / 4u;  // R keys, in vec4s
        let va = vb + key0 * P.vs_j + c;
        let vsr = R * P.vs_j;
        let k0 = select(z, K4[select(0u, ka, ok0 && kc_ok)], ok0 && kc_ok);
        let k1 = select(z, K4[select(0u, ka + ksr, ok1 && kc_ok)], ok1 && kc_ok);
        let k2 = select(z, K4[select(0u, ka + 2u * ksr, ok2 && kc_ok)], ok2 && kc_ok);
        let k3 = select(z, K4[select(0u, ka + 3u * ksr, ok3 && kc_ok)], ok3 && kc_ok);
        let v0 = select(z, V4[select(0u, va, ok0 && vc_ok)], ok0 && vc_ok);
        let v1 = select(z, V4[select(0u, va + vsr, ok1 && vc_ok)], ok1 && vc_ok);
        let v2 = select(z, V4[select(0u, va + 2u * vsr, ok2 && vc_ok)], ok2 && vc_ok);
        let v3 = select(z, V4[select(0u, va + 3u * vsr, ok3 && vc_ok)], ok3 && vc_ok);
        let at = key0 * HS + 4u * c;
        put4(0u, at, k0);
        put4(0u, at + R * HS, k1);
        put4(0u, at + 2u * R * HS, k2);
        put4(0u, at + 3u * R * HS, k3);
        put4(1u, at, v0);
        put4(1u, at + R * HS, v1);
        put4(1u, at + 2u * R * HS, v2);
        put4(1u, at + 3u * R * HS, v3);
    }
    // query rows r8 + R t, t = 0 .. 3 (16 SGS rows)
    let qok0 = i0 + r8 < P.tq && kc_ok;
    let qok1 = i0 + r8 + R < P.tq && kc_ok;
    let qok2 = i0 + r8 + 2u * R < P.tq && kc_ok;
    let qok3 = i0 + r8 + 3u * R < P.tq && kc_ok;
    let qa4 = (qb + (i0 + r8) * P.qs_i) / 4u + c;
    let qsr = R * P.qs_i / 4u;
    let q0 = select(z, Q4[select(0u, qa4, qok0)], qok0);
    let q1 = select(z, Q4[select(0u, qa4 + qsr, qok1)], qok1);
    let q2 = select(z, Q4[select(0u, qa4 + 2u * qsr, qok2)], qok2);
    let q3 = select(z, Q4[select(0u, qa4 + 3u * qsr, qok3)], qok3);
    put4q(r8, c, q0);
    put4q(r8 + R, c, q1);
    put4q(r8 + 2u * R, c, q2);
    put4q(r8 + 3u * R, c, q3);
    workgroupBarrier();

    // ---- 2. scores into tS[sg]
    let qa = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tP[sg], 0u, 40u);
    var qc = subgroup_matrix_left<f16, 16, 16>();
    if (DK == 2u) {
        qc = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tP[sg], 16u, 40u);
    }
    // key blocks 16 jb .. 16 jb + 15, jb = 0 .. 7 (written out: literal matrix offsets)
    {
        let k0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 0u, 40u);
        var s = subgroupMatrixMultiplyAccumulate(qa, k0, subgroup_matrix_result<f32, 16, 16>());
        if (DK == 2u) {
            let k1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 16u, 40u);
            s = subgroupMatrixMultiplyAccumulate(qc, k1, s);
        }
        subgroupMatrixStore<row_major>(&tS[sg], 0u, s, 128u);
    }
    {
        let k0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 640u, 40u);
        var s = subgroupMatrixMultiplyAccumulate(qa, k0, subgroup_matrix_result<f32, 16, 16>());
        if (DK == 2u) {
            let k1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 656u, 40u);
            s = subgroupMatrixMultiplyAccumulate(qc, k1, s);
        }
        subgroupMatrixStore<row_major>(&tS[sg], 16u, s, 128u);
    }
    {
        let k0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 1280u, 40u);
        var s = subgroupMatrixMultiplyAccumulate(qa, k0, subgroup_matrix_result<f32, 16, 16>());
        if (DK == 2u) {
            let k1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 1296u, 40u);
            s = subgroupMatrixMultiplyAccumulate(qc, k1, s);
        }
        subgroupMatrixStore<row_major>(&tS[sg], 32u, s, 128u);
    }
    {
        let k0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 1920u, 40u);
        var s = subgroupMatrixMultiplyAccumulate(qa, k0, subgroup_matrix_result<f32, 16, 16>());
        if (DK == 2u) {
            let k1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 1936u, 40u);
            s = subgroupMatrixMultiplyAccumulate(qc, k1, s);
        }
        subgroupMatrixStore<row_major>(&tS[sg], 48u, s, 128u);
    }
    {
        let k0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 2560u, 40u);
        var s = subgroupMatrixMultiplyAccumulate(qa, k0, subgroup_matrix_result<f32, 16, 16>());
        if (DK == 2u) {
            let k1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 2576u, 40u);
            s = subgroupMatrixMultiplyAccumulate(qc, k1, s);
        }
        subgroupMatrixStore<row_major>(&tS[sg], 64u, s, 128u);
    }
    {
        let k0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 3200u, 40u);
        var s = subgroupMatrixMultiplyAccumulate(qa, k0, subgroup_matrix_result<f32, 16, 16>());
        if (DK == 2u) {
            let k1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 3216u, 40u);
            s = subgroupMatrixMultiplyAccumulate(qc, k1, s);
        }
        subgroupMatrixStore<row_major>(&tS[sg], 80u, s, 128u);
    }
    {
        let k0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 3840u, 40u);
        var s = subgroupMatrixMultiplyAccumulate(qa, k0, subgroup_matrix_result<f32, 16, 16>());
        if (DK == 2u) {
            let k1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 3856u, 40u);
            s = subgroupMatrixMultiplyAccumulate(qc, k1, s);
        }
        subgroupMatrixStore<row_major>(&tS[sg], 96u, s, 128u);
    }
    {
        let k0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 4480u, 40u);
        var s = subgroupMatrixMultiplyAccumulate(qa, k0, subgroup_matrix_result<f32, 16, 16>());
        if (DK == 2u) {
            let k1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&tK, 4496u, 40u);
            s = subgroupMatrixMultiplyAccumulate(qc, k1, s);
        }
        subgroupMatrixStore<row_major>(&tS[sg], 112u, s, 128u);
    }
    workgroupBarrier();

    // ---- 3. softmax: lane pair (2r, 2r + 1) holds row r, keys 64 (lane % 2) .. + 63
    let r = lane / 2u;
    let j0 = (lane % 2u) * 64u;
    let i = i0 + sg * 16u + r;
    let mrow0 = P.m_base + b * P.ms_b + h * P.ms_h;
    var mx = neg_inf();
    for (var j = 0u; j < 64u; j++) {
        let f = score(tS[sg][r * SS + j0 + j], i, j0 + j, mrow0);
        tS[sg][r * SS + j0 + j] = f;
        mx = nmax(mx, f);
    }
    mx = nmax(mx, subgroupShuffleXor(mx, 1u));
    var sum = 0.0;
    for (var j = 0u; j < 64u; j++) {
        let f = tS[sg][r * SS + j0 + j];
        let e = select(exp_f(f - mx), 0.0, f == neg_inf());
        tS[sg][r * SS + j0 + j] = e;
        sum += e;
    }
    sum += subgroupShuffleXor(sum, 1u);
    // a row whose every score is -inf sums to 0: its probabilities (and so its output) are 0
    let inv = select(1.0 / sum, 0.0, sum == 0.0);
    for (var j = 0u; j < 64u; j++) {
        tP[sg][r * PS + j0 + j] = f16(tS[sg][r * SS + j0 + j] * inv);
    }
    workgroupBarrier();

    // ---- 4. out = P v through tS[sg] (16 rows x 32 floats, stride 32)
    var o0 = subgroup_matrix_result<f32, 16, 16>();
    var o1 = subgroup_matrix_result<f32, 16, 16>();
    // 16-key steps kc = 0 .. 7 (written out: literal matrix offsets)
    {
        let p = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tP[sg], 0u, 128u);
        let v0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 0u, 40u);
        o0 = subgroupMatrixMultiplyAccumulate(p, v0, o0);
        if (DV == 2u) {
            let v1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 16u, 40u);
            o1 = subgroupMatrixMultiplyAccumulate(p, v1, o1);
        }
    }
    {
        let p = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tP[sg], 16u, 128u);
        let v0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 640u, 40u);
        o0 = subgroupMatrixMultiplyAccumulate(p, v0, o0);
        if (DV == 2u) {
            let v1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 656u, 40u);
            o1 = subgroupMatrixMultiplyAccumulate(p, v1, o1);
        }
    }
    {
        let p = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tP[sg], 32u, 128u);
        let v0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 1280u, 40u);
        o0 = subgroupMatrixMultiplyAccumulate(p, v0, o0);
        if (DV == 2u) {
            let v1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 1296u, 40u);
            o1 = subgroupMatrixMultiplyAccumulate(p, v1, o1);
        }
    }
    {
        let p = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tP[sg], 48u, 128u);
        let v0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 1920u, 40u);
        o0 = subgroupMatrixMultiplyAccumulate(p, v0, o0);
        if (DV == 2u) {
            let v1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 1936u, 40u);
            o1 = subgroupMatrixMultiplyAccumulate(p, v1, o1);
        }
    }
    {
        let p = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tP[sg], 64u, 128u);
        let v0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 2560u, 40u);
        o0 = subgroupMatrixMultiplyAccumulate(p, v0, o0);
        if (DV == 2u) {
            let v1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 2576u, 40u);
            o1 = subgroupMatrixMultiplyAccumulate(p, v1, o1);
        }
    }
    {
        let p = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tP[sg], 80u, 128u);
        let v0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 3200u, 40u);
        o0 = subgroupMatrixMultiplyAccumulate(p, v0, o0);
        if (DV == 2u) {
            let v1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 3216u, 40u);
            o1 = subgroupMatrixMultiplyAccumulate(p, v1, o1);
        }
    }
    {
        let p = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tP[sg], 96u, 128u);
        let v0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 3840u, 40u);
        o0 = subgroupMatrixMultiplyAccumulate(p, v0, o0);
        if (DV == 2u) {
            let v1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 3856u, 40u);
            o1 = subgroupMatrixMultiplyAccumulate(p, v1, o1);
        }
    }
    {
        let p = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&tP[sg], 112u, 128u);
        let v0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 4480u, 40u);
        o0 = subgroupMatrixMultiplyAccumulate(p, v0, o0);
        if (DV == 2u) {
            let v1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&tV, 4496u, 40u);
            o1 = subgroupMatrixMultiplyAccumulate(p, v1, o1);
        }
    }
    subgroupMatrixStore<row_major>(&tS[sg], 0u, o0, 32u);
    if (DV == 2u) {
        subgroupMatrixStore<row_major>(&tS[sg], 16u, o1, 32u);
    }
    workgroupBarrier();
    if (i < P.tq) {
        let ob = P.o_base + b * P.os_b + h * P.os_h + i * P.os_i;
        let c0 = (lane % 2u) * 8u * DV;   // this lane's half of the row's 16 DV values
        for (var e = 0u; e < 8u * DV; e++) {
            OUT[ob + c0 + e] = bitcast<u32>(tS[sg][r * 32u + c0 + e]);
        }
    }
}
