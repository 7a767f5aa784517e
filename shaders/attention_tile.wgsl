// Prefill attention in one pass for short key ranges: `attn_tile`, float32 q, k, v and output.
//
// A workgroup of 128 threads (four warps) takes 16 query rows of one (batch, head) and every key
// (at most TKM = 128) of its kv head:
//   1. scores: a 16 x 128 block of q k^T; warp w holds rows 4w .. 4w + 3 and lane l keys l, l + 32,
//      l + 64, l + 96, so every thread keeps 4 x 4 scores in registers; the head dim goes in steps
//      of DC = 16 staged in workgroup memory as [key][dim] and [row][dim] rows of vec4s, padded to
//      5 vec4s so that a warp's 32 keys fall in different banks;
//   2. the masked softmax of each row from those registers (row maxima and sums reduced through
//      workgroup memory); the probabilities go to workgroup memory as [key][row];
//   3. out = P v, each thread RPT rows x 4 value columns, v read as vec4 from storage.
// Every register is named and indexed by constants only: a vector or array indexed by a loop
// counter is demoted to local memory by the NVIDIA compiler (docs/NOTES.md), which made the first
// version of this kernel 2.3x slower than the composite path.
// The composite path (q k^T, softmax_rows, P v: three dispatches and two float32 scratches) did
// the same in 181 us per MiniLM 32x128 layer on an H100; a flash kernel with online softmax over
// 16-key tiles was slower (383 us), for want of register blocking (benchmarks/results/
// wgpu_attention_*). Here every thread holds a 4x4 block of scores, and the whole key range fits.
//
// Workgroup memory: 12 KiB (WebGPU guarantees 16), reused by phase: SA holds the k chunk
// (128 x 5 vec4s), then the probabilities (128 x 4) and the lanes' row maxima (SA[512, 640)),
// then the row maxima and sums for phase 3 (SA[512, 520)); SB holds the q chunk (16 x 5), then the
// lanes' row sums (16 x 8).
//
// Semantics as attention.wgsl: a key j is dropped when CAUSAL and j > i + causal_offset, or MASK ==
// 1 and the bool mask is 0; MASK == 2 adds a float mask. A row with nothing kept, or whose maximum
// is -inf, is NaN; a NaN score makes its row NaN (as the reference and torch's math kernel).
// Operands are addressed by (batch, head, row) strides with a contiguous last dim, so head
// permutes around the attention fold into them (kernels.py `sdpa_folds`); v's strides and base are
// multiples of 4 and dv a multiple of 4 (vec4 loads), dv <= 4 * CGS <= 64.

//! include common.wgsl

struct TileParams {
    tq: u32,
    heads: u32,
    group: u32,
    tk: u32,
    d: u32,
    dv: u32,
    pad0: u32,
    pad1: u32,
    q_base: u32,
    qs_b: u32,
    qs_h: u32,
    qs_i: u32,
    k_base: u32,
    ks_b: u32,
    ks_h: u32,
    ks_j: u32,
    v_base: u32,      // in vec4s, like vs_*
    vs_b: u32,
    vs_h: u32,
    vs_j: u32,
    o_base: u32,
    os_b: u32,
    os_h: u32,
    os_i: u32,
    m_base: u32,
    ms_b: u32,
    ms_h: u32,
    ms_i: u32,
    ms_j: u32,
    causal_offset: i32,
    scale: f32,
    pad2: u32,
}

override DTM: u32 = 0u;
override MASK: u32 = 0u;
override CAUSAL: bool = false;
override CGS: u32 = 16u;     // value column groups of 4 in phase 3: 4, 8 or 16 (dv <= 4 CGS)

const BR: u32 = 16u;         // query rows per workgroup
const TKM: u32 = 128u;       // keys at most (kernels.py ATTN_TILE_MAX_KEYS)
const DC: u32 = 16u;         // head-dim step of the score product
const RS: u32 = 5u;          // vec4s per staged row: DC / 4, plus one against bank conflicts
const RED: u32 = 512u;       // SA offset of the row reductions (16 rows x 32 lanes)

@group(0) @binding(0) var<uniform> P: TileParams;
@group(0) @binding(2) var<storage, read_write> Q: array<u32>;
@group(0) @binding(3) var<storage, read_write> K: array<u32>;
@group(0) @binding(4) var<storage, read_write> V4: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> MK: array<u32>;

var<workgroup> SA: array<vec4<f32>, 640>;
var<workgroup> SB: array<vec4<f32>, 128>;

// max that propagates NaN (WGSL's max may drop it).
fn nmax_t(a: f32, b: f32) -> f32 {
    if (b > a || b != b) {
        return b;
    }
    return a;
}

fn nmax4(v: vec4<f32>) -> f32 {
    return nmax_t(nmax_t(v.x, v.y), nmax_t(v.z, v.w));
}

// Final score of (row i, key j) from its raw q.k, or -inf when the key is dropped (or the row is
// past the query block).
fn tile_score(raw: f32, i: u32, j: u32, mrow: u32) -> f32 {
    if (i >= P.tq || j >= P.tk || (CAUSAL && i32(j) > i32(i) + P.causal_offset)) {
        return neg_inf();
    }
    var s = raw * P.scale;
    if (MASK != 0u) {
        let mi = mrow + j * P.ms_j;
        let m = word_f32(MK[widx(mi, DTM)], mi, DTM);
        if (MASK == 1u) {
            if (m == 0.0) {
                return neg_inf();
            }
        } else {
            s += m;
        }
    }
    return s;
}

// The scores of row i against keys j, j + 32, j + 64, j + 96.
fn row_scores(raw: vec4<f32>, i: u32, j: u32, mrow: u32) -> vec4<f32> {
    return vec4<f32>(tile_score(raw.x, i, j, mrow), tile_score(raw.y, i, j + 32u, mrow),
                     tile_score(raw.z, i, j + 64u, mrow), tile_score(raw.w, i, j + 96u, mrow));
}

fn row_exp(f: vec4<f32>, m: f32) -> vec4<f32> {
    let ninf = vec4<f32>(neg_inf());
    return select(exp(f - vec4<f32>(m)), vec4<f32>(0.0), f == ninf);
}

// Element e (4 consecutive dims) of a staged row: zeros past the head dim.
fn ld4(buf_is_q: bool, at: u32, t: u32, dn: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    if (buf_is_q) {
        if (t < dn) { v.x = bitcast<f32>(Q[at]); }
        if (t + 1u < dn) { v.y = bitcast<f32>(Q[at + 1u]); }
        if (t + 2u < dn) { v.z = bitcast<f32>(Q[at + 2u]); }
        if (t + 3u < dn) { v.w = bitcast<f32>(Q[at + 3u]); }
    } else {
        if (t < dn) { v.x = bitcast<f32>(K[at]); }
        if (t + 1u < dn) { v.y = bitcast<f32>(K[at + 1u]); }
        if (t + 2u < dn) { v.z = bitcast<f32>(K[at + 2u]); }
        if (t + 3u < dn) { v.w = bitcast<f32>(K[at + 3u]); }
    }
    return v;
}

@compute @workgroup_size(128)
fn attn_tile(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let i0 = wid.x * BR;
    let h = wid.y;
    let b = wid.z;
    let kvh = h / P.group;
    let qb = P.q_base + b * P.qs_b + h * P.qs_h;
    let kb = P.k_base + b * P.ks_b + kvh * P.ks_h;

    // ---- 1. scores: warp rg holds rows ra .. ra + 3, lane kq keys kq + 32 c.
    let rg = li / 32u;
    let kq = li % 32u;
    let ra = 4u * rg;
    var s0 = vec4<f32>(0.0);   // row ra + 0 against keys kq, kq + 32, kq + 64, kq + 96
    var s1 = vec4<f32>(0.0);
    var s2 = vec4<f32>(0.0);
    var s3 = vec4<f32>(0.0);
    for (var d0 = 0u; d0 < P.d; d0 += DC) {
        let dn = min(DC, P.d - d0);
        // k chunk: 128 keys x 4 vec4s, four per thread; four consecutive threads read one key's
        // 16 dims (64 contiguous bytes).
        for (var e = li; e < TKM * 4u; e += 128u) {
            let key = e / 4u;
            let t4 = e % 4u;
            var kv = vec4<f32>(0.0);
            if (key < P.tk) {
                kv = ld4(false, kb + key * P.ks_j + d0 + 4u * t4, 4u * t4, dn);
            }
            SA[key * RS + t4] = kv;
        }
        if (li < BR * 4u) {
            let r = li / 4u;
            let t4 = li % 4u;
            var qv = vec4<f32>(0.0);
            if (i0 + r < P.tq) {
                qv = ld4(true, qb + (i0 + r) * P.qs_i + d0 + 4u * t4, 4u * t4, dn);
            }
            SB[r * RS + t4] = qv;
        }
        workgroupBarrier();
        for (var t4 = 0u; t4 < (dn + 3u) / 4u; t4++) {
            let q0 = SB[(ra + 0u) * RS + t4];
            let q1 = SB[(ra + 1u) * RS + t4];
            let q2 = SB[(ra + 2u) * RS + t4];
            let q3 = SB[(ra + 3u) * RS + t4];
            let k0 = SA[(kq + 0u) * RS + t4];
            let k1 = SA[(kq + 32u) * RS + t4];
            let k2 = SA[(kq + 64u) * RS + t4];
            let k3 = SA[(kq + 96u) * RS + t4];
            s0 += vec4<f32>(dot(q0, k0), dot(q0, k1), dot(q0, k2), dot(q0, k3));
            s1 += vec4<f32>(dot(q1, k0), dot(q1, k1), dot(q1, k2), dot(q1, k3));
            s2 += vec4<f32>(dot(q2, k0), dot(q2, k1), dot(q2, k2), dot(q2, k3));
            s3 += vec4<f32>(dot(q3, k0), dot(q3, k1), dot(q3, k2), dot(q3, k3));
        }
        workgroupBarrier();
    }

    // ---- 2. masked softmax of each row. A row is NaN when its maximum is -inf (nothing kept,
    // or only -inf scores) or NaN (a NaN score).
    let mb = P.m_base + b * P.ms_b + h * P.ms_h;
    let f0 = row_scores(s0, i0 + ra, kq, mb + (i0 + ra) * P.ms_i);
    let f1 = row_scores(s1, i0 + ra + 1u, kq, mb + (i0 + ra + 1u) * P.ms_i);
    let f2 = row_scores(s2, i0 + ra + 2u, kq, mb + (i0 + ra + 2u) * P.ms_i);
    let f3 = row_scores(s3, i0 + ra + 3u, kq, mb + (i0 + ra + 3u) * P.ms_i);
    // Lane partials as [row][lane] floats at SA[RED ...] (the k chunk is dead after the barrier).
    // A warp's rows are its own: after the barrier every lane reads its warp's 4 x 32 partials
    // (the same addresses in every lane, so each read is one broadcast) and reduces them itself.
    let lv = RED + kq / 4u;
    let lc = kq % 4u;
    SA[lv + (ra + 0u) * 8u][lc] = nmax4(f0);
    SA[lv + (ra + 1u) * 8u][lc] = nmax4(f1);
    SA[lv + (ra + 2u) * 8u][lc] = nmax4(f2);
    SA[lv + (ra + 3u) * 8u][lc] = nmax4(f3);
    workgroupBarrier();
    var rmx = vec4<f32>(neg_inf());
    for (var x = 0u; x < 8u; x++) {
        rmx = vec4<f32>(nmax_t(rmx.x, nmax4(SA[RED + (ra + 0u) * 8u + x])),
                        nmax_t(rmx.y, nmax4(SA[RED + (ra + 1u) * 8u + x])),
                        nmax_t(rmx.z, nmax4(SA[RED + (ra + 2u) * 8u + x])),
                        nmax_t(rmx.w, nmax4(SA[RED + (ra + 3u) * 8u + x])));
    }
    let e0 = row_exp(f0, rmx.x);
    let e1 = row_exp(f1, rmx.y);
    let e2 = row_exp(f2, rmx.z);
    let e3 = row_exp(f3, rmx.w);
    // Probabilities as [key][row / 4] vec4s at SA[0, 512), the lanes' partial sums as [row][lane]
    // at SB (the q chunk there is dead).
    SA[(kq + 0u) * 4u + rg] = vec4<f32>(e0.x, e1.x, e2.x, e3.x);
    SA[(kq + 32u) * 4u + rg] = vec4<f32>(e0.y, e1.y, e2.y, e3.y);
    SA[(kq + 64u) * 4u + rg] = vec4<f32>(e0.z, e1.z, e2.z, e3.z);
    SA[(kq + 96u) * 4u + rg] = vec4<f32>(e0.w, e1.w, e2.w, e3.w);
    let one = vec4<f32>(1.0);
    let sv = kq / 4u;
    SB[sv + (ra + 0u) * 8u][lc] = dot(e0, one);
    SB[sv + (ra + 1u) * 8u][lc] = dot(e1, one);
    SB[sv + (ra + 2u) * 8u][lc] = dot(e2, one);
    SB[sv + (ra + 3u) * 8u][lc] = dot(e3, one);
    workgroupBarrier();
    if (kq == 0u) {  // row statistics for phase 3, whose threads hold other rows: SA[RED, RED + 8)
        var sum = vec4<f32>(0.0);
        for (var x = 0u; x < 8u; x++) {
            sum += vec4<f32>(dot(SB[(ra + 0u) * 8u + x], one), dot(SB[(ra + 1u) * 8u + x], one),
                             dot(SB[(ra + 2u) * 8u + x], one), dot(SB[(ra + 3u) * 8u + x], one));
        }
        SA[RED + rg] = rmx;
        SA[RED + 4u + rg] = sum;
    }
    workgroupBarrier();

    // ---- 3. out = P v: thread (row group, column group cg) holds RPT rows x 4 value columns.
    let RPT = max(CGS / 8u, 1u);          // 2 for CGS 16, else 1 (CGS 4 leaves threads idle)
    let cg = li % CGS;
    let r0 = (li / CGS) * RPT;
    if (r0 >= BR || 4u * cg >= P.dv) {
        return;
    }
    let vb = P.v_base + b * P.vs_b + kvh * P.vs_h + cg;
    let pa = r0 / 4u;
    let pc = r0 % 4u;
    var o0 = vec4<f32>(0.0);
    var o1 = vec4<f32>(0.0);
    let tk4 = P.tk / 4u * 4u;
    for (var j = 0u; j < tk4; j += 4u) {
        let v0 = bitcast<vec4<f32>>(V4[vb + j * P.vs_j]);
        let v1 = bitcast<vec4<f32>>(V4[vb + (j + 1u) * P.vs_j]);
        let v2 = bitcast<vec4<f32>>(V4[vb + (j + 2u) * P.vs_j]);
        let v3 = bitcast<vec4<f32>>(V4[vb + (j + 3u) * P.vs_j]);
        o0 += SA[j * 4u + pa][pc] * v0 + SA[(j + 1u) * 4u + pa][pc] * v1
            + SA[(j + 2u) * 4u + pa][pc] * v2 + SA[(j + 3u) * 4u + pa][pc] * v3;
        if (RPT == 2u) {
            o1 += SA[j * 4u + pa][pc + 1u] * v0 + SA[(j + 1u) * 4u + pa][pc + 1u] * v1
                + SA[(j + 2u) * 4u + pa][pc + 1u] * v2 + SA[(j + 3u) * 4u + pa][pc + 1u] * v3;
        }
    }
    for (var j = tk4; j < P.tk; j++) {
        let v = bitcast<vec4<f32>>(V4[vb + j * P.vs_j]);
        o0 += SA[j * 4u + pa][pc] * v;
        if (RPT == 2u) {
            o1 += SA[j * 4u + pa][pc + 1u] * v;
        }
    }
    let ob = P.o_base + b * P.os_b + h * P.os_h + 4u * cg;
    for (var k = 0u; k < RPT; k++) {
        let r = r0 + k;
        let i = i0 + r;
        if (i >= P.tq) {
            break;
        }
        let mx = SA[RED + r / 4u][r % 4u];
        var o = select(o0, o1, k == 1u) / SA[RED + 4u + r / 4u][r % 4u];
        if (mx == neg_inf() || mx != mx) {
            o = vec4<f32>(nan_f32());
        }
        let at = ob + i * P.os_i;
        OUT[at] = bitcast<u32>(o.x);
        OUT[at + 1u] = bitcast<u32>(o.y);
        OUT[at + 2u] = bitcast<u32>(o.z);
        OUT[at + 3u] = bitcast<u32>(o.w);
    }
}
