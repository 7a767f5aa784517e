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
//   3. out = P v: each warp a quarter of the keys for all 16 rows, each thread 4 rows x 4 value
//      columns (twice for dv > 32) from one broadcast read of P and one vec4 of v, the warps'
//      partial outputs summed through workgroup memory.
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
// then the row maxima and sums for phase 3 (SA[512, 520)) while the warps' partial outputs replace
// the probabilities (4 x 128); SB holds the q chunk (16 x 5), then the lanes' row sums (16 x 8).
//
// Semantics as attention.wgsl: a key j is dropped when CAUSAL and j > i + causal_offset, or MASK ==
// 1 and the bool mask is 0; MASK == 2 adds a float mask. A row with nothing kept, or whose maximum
// is -inf, gives zeros (as torch's scaled_dot_product_attention and the reference); a NaN score
// makes its row NaN.
// Operands are addressed by (batch, head, row) strides with a contiguous last dim, so head
// permutes around the attention fold into them (kernels.py `sdpa_folds`); v's strides and base are
// multiples of 4 and dv a multiple of 4 (vec4 loads), dv <= 4 * CGS <= 64.

//! include common.wgsl

//! include attn_tile_params.wgsl

override DTM: u32 = 0u;
override MASK: u32 = 0u;
override CAUSAL: bool = false;
override CGS: u32 = 16u;     // value vec4s per row in phase 3: 8 (dv <= 32) or 16 (dv <= 64)

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

fn nmax4(v: vec4<f32>) -> f32 {
    return nmax(nmax(v.x, v.y), nmax(v.z, v.w));
}

// The mask value of (row i, key j), or 0 when there is no mask; rows and keys past the block read
// element 0 instead (their scores are dropped anyway). Loaded for all 16 scores of a thread before
// any is used, so the loads are in flight together.
fn mask_at(i: u32, j: u32, mrow0: u32) -> f32 {
    if (MASK == 0u) {
        return 0.0;
    }
    let ok = i < P.tq && j < P.tk;
    let mi = select(P.m_base, mrow0 + i * P.ms_i + j * P.ms_j, ok);
    return word_f32(MK[widx(mi, DTM)], mi, DTM);
}

// Final score of (row i, key j) from its raw q.k and mask value m, or -inf when the key is
// dropped (or the row is past the query block).
fn tile_score(raw: f32, m: f32, i: u32, j: u32) -> f32 {
    if (i >= P.tq || j >= P.tk || (CAUSAL && i32(j) > i32(i) + P.causal_offset) || (MASK == 1u && m == 0.0)) {
        return neg_inf();
    }
    if (MASK == 2u) {
        return raw * P.scale + m;
    }
    return raw * P.scale;
}

// The scores of row i against keys j, j + 32, j + 64, j + 96, given their mask values.
fn row_scores(raw: vec4<f32>, m: vec4<f32>, i: u32, j: u32) -> vec4<f32> {
    return vec4<f32>(tile_score(raw.x, m.x, i, j), tile_score(raw.y, m.y, i, j + 32u),
                     tile_score(raw.z, m.z, i, j + 64u), tile_score(raw.w, m.w, i, j + 96u));
}

fn row_mask(i: u32, j: u32, mrow0: u32) -> vec4<f32> {
    return vec4<f32>(mask_at(i, j, mrow0), mask_at(i, j + 32u, mrow0), mask_at(i, j + 64u, mrow0),
                     mask_at(i, j + 96u, mrow0));
}

fn row_exp(f: vec4<f32>, m: f32) -> vec4<f32> {
    let ninf = vec4<f32>(neg_inf());
    return select(exp4_f(f - vec4<f32>(m)), vec4<f32>(0.0), f == ninf);
}

// Dims t .. t + 3 of a staged row at element `at` of Q or K (4 loads, issued together): zeros past
// the chunk's dn dims or when `ok` is false (a key or row past the tensor; the loads then read
// element 0).
fn ld4(is_q: bool, at: u32, t: u32, dn: u32, ok: bool) -> vec4<f32> {
    let a = select(0u, at, ok);
    var w: vec4<u32>;
    if (is_q) {
        w = vec4<u32>(Q[a], Q[a + select(0u, 1u, ok)], Q[a + select(0u, 2u, ok)], Q[a + select(0u, 3u, ok)]);
    } else {
        w = vec4<u32>(K[a], K[a + select(0u, 1u, ok)], K[a + select(0u, 2u, ok)], K[a + select(0u, 3u, ok)]);
    }
    let keep = vec4<bool>(ok && t < dn, ok && t + 1u < dn, ok && t + 2u < dn, ok && t + 3u < dn);
    return select(vec4<f32>(0.0), bitcast<vec4<f32>>(w), keep);
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
        // 16 dims (64 contiguous bytes). All 16 loads are issued before the first store.
        let key = li / 4u;
        let t4 = li % 4u;
        let kt = kb + d0 + 4u * t4;
        let ka = ld4(false, kt + key * P.ks_j, 4u * t4, dn, key < P.tk);
        let kb1 = ld4(false, kt + (key + 32u) * P.ks_j, 4u * t4, dn, key + 32u < P.tk);
        let kb2 = ld4(false, kt + (key + 64u) * P.ks_j, 4u * t4, dn, key + 64u < P.tk);
        let kb3 = ld4(false, kt + (key + 96u) * P.ks_j, 4u * t4, dn, key + 96u < P.tk);
        var qv = vec4<f32>(0.0);
        if (li < BR * 4u) {
            qv = ld4(true, qb + (i0 + key) * P.qs_i + d0 + 4u * t4, 4u * t4, dn, i0 + key < P.tq);
            SB[key * RS + t4] = qv;
        }
        SA[key * RS + t4] = ka;
        SA[(key + 32u) * RS + t4] = kb1;
        SA[(key + 64u) * RS + t4] = kb2;
        SA[(key + 96u) * RS + t4] = kb3;
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

    // ---- 2. masked softmax of each row. A row is zeros when its maximum is -inf (nothing kept,
    // or only -inf scores: tile_out), NaN when it is NaN (a NaN score).
    let mb = P.m_base + b * P.ms_b + h * P.ms_h;
    let m0 = row_mask(i0 + ra, kq, mb);
    let m1 = row_mask(i0 + ra + 1u, kq, mb);
    let m2 = row_mask(i0 + ra + 2u, kq, mb);
    let m3 = row_mask(i0 + ra + 3u, kq, mb);
    let f0 = row_scores(s0, m0, i0 + ra, kq);
    let f1 = row_scores(s1, m1, i0 + ra + 1u, kq);
    let f2 = row_scores(s2, m2, i0 + ra + 2u, kq);
    let f3 = row_scores(s3, m3, i0 + ra + 3u, kq);
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
        rmx = vec4<f32>(nmax(rmx.x, nmax4(SA[RED + (ra + 0u) * 8u + x])),
                        nmax(rmx.y, nmax4(SA[RED + (ra + 1u) * 8u + x])),
                        nmax(rmx.z, nmax4(SA[RED + (ra + 2u) * 8u + x])),
                        nmax(rmx.w, nmax4(SA[RED + (ra + 3u) * 8u + x])));
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

    // ---- 3. out = P v: warp rg takes keys 32 rg .. 32 rg + 31 for all 16 rows; lane (rq, cq)
    // holds rows 4 rq .. 4 rq + 3 against value vec4s cq (and cq + 8 when CGS is 16): one
    // broadcast read of 4 probabilities and one vec4 of v feed 16 FMAs. The four warps' partial
    // outputs are then summed through workgroup memory.
    let rq = kq / 8u;
    let cq = kq % 8u;
    let cv = P.dv / 4u;
    let vb = P.v_base + b * P.vs_b + kvh * P.vs_h;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var c0 = vec4<f32>(0.0);
    var c1 = vec4<f32>(0.0);
    var c2 = vec4<f32>(0.0);
    var c3 = vec4<f32>(0.0);
    // Eight keys a step, their loads issued together: issuing the loads of several keys before
    // using any took MiniLM 32x128's attention from 139 to 111 us on an H100 (four keys), eight
    // to 106; keys past tk have probability 0, and their v (key j's, read instead) is zeroed so
    // that no inf or NaN leaks in.
    let z = vec4<f32>(0.0);
    for (var j = 32u * rg; j < min(32u * rg + 32u, P.tk); j += 8u) {
        let p0 = SA[(j + 0u) * 4u + rq];
        let p1 = SA[(j + 1u) * 4u + rq];
        let p2 = SA[(j + 2u) * 4u + rq];
        let p3 = SA[(j + 3u) * 4u + rq];
        let p4 = SA[(j + 4u) * 4u + rq];
        let p5 = SA[(j + 5u) * 4u + rq];
        let p6 = SA[(j + 6u) * 4u + rq];
        let p7 = SA[(j + 7u) * 4u + rq];
        let ok1 = j + 1u < P.tk;
        let ok2 = j + 2u < P.tk;
        let ok3 = j + 3u < P.tk;
        let ok4 = j + 4u < P.tk;
        let ok5 = j + 5u < P.tk;
        let ok6 = j + 6u < P.tk;
        let ok7 = j + 7u < P.tk;
        let vr0 = vb + j * P.vs_j;
        let vr1 = vb + select(j, j + 1u, ok1) * P.vs_j;
        let vr2 = vb + select(j, j + 2u, ok2) * P.vs_j;
        let vr3 = vb + select(j, j + 3u, ok3) * P.vs_j;
        let vr4 = vb + select(j, j + 4u, ok4) * P.vs_j;
        let vr5 = vb + select(j, j + 5u, ok5) * P.vs_j;
        let vr6 = vb + select(j, j + 6u, ok6) * P.vs_j;
        let vr7 = vb + select(j, j + 7u, ok7) * P.vs_j;
        if (cq < cv) {
            let v0 = bitcast<vec4<f32>>(V4[vr0 + cq]);
            let v1 = select(z, bitcast<vec4<f32>>(V4[vr1 + cq]), ok1);
            let v2 = select(z, bitcast<vec4<f32>>(V4[vr2 + cq]), ok2);
            let v3 = select(z, bitcast<vec4<f32>>(V4[vr3 + cq]), ok3);
            let v4 = select(z, bitcast<vec4<f32>>(V4[vr4 + cq]), ok4);
            let v5 = select(z, bitcast<vec4<f32>>(V4[vr5 + cq]), ok5);
            let v6 = select(z, bitcast<vec4<f32>>(V4[vr6 + cq]), ok6);
            let v7 = select(z, bitcast<vec4<f32>>(V4[vr7 + cq]), ok7);
            a0 += p0.x * v0 + p1.x * v1 + p2.x * v2 + p3.x * v3 + p4.x * v4 + p5.x * v5 + p6.x * v6 + p7.x * v7;
            a1 += p0.y * v0 + p1.y * v1 + p2.y * v2 + p3.y * v3 + p4.y * v4 + p5.y * v5 + p6.y * v6 + p7.y * v7;
            a2 += p0.z * v0 + p1.z * v1 + p2.z * v2 + p3.z * v3 + p4.z * v4 + p5.z * v5 + p6.z * v6 + p7.z * v7;
            a3 += p0.w * v0 + p1.w * v1 + p2.w * v2 + p3.w * v3 + p4.w * v4 + p5.w * v5 + p6.w * v6 + p7.w * v7;
        }
        if (CGS == 16u && cq + 8u < cv) {
            let v0 = bitcast<vec4<f32>>(V4[vr0 + cq + 8u]);
            let v1 = select(z, bitcast<vec4<f32>>(V4[vr1 + cq + 8u]), ok1);
            let v2 = select(z, bitcast<vec4<f32>>(V4[vr2 + cq + 8u]), ok2);
            let v3 = select(z, bitcast<vec4<f32>>(V4[vr3 + cq + 8u]), ok3);
            let v4 = select(z, bitcast<vec4<f32>>(V4[vr4 + cq + 8u]), ok4);
            let v5 = select(z, bitcast<vec4<f32>>(V4[vr5 + cq + 8u]), ok5);
            let v6 = select(z, bitcast<vec4<f32>>(V4[vr6 + cq + 8u]), ok6);
            let v7 = select(z, bitcast<vec4<f32>>(V4[vr7 + cq + 8u]), ok7);
            c0 += p0.x * v0 + p1.x * v1 + p2.x * v2 + p3.x * v3 + p4.x * v4 + p5.x * v5 + p6.x * v6 + p7.x * v7;
            c1 += p0.y * v0 + p1.y * v1 + p2.y * v2 + p3.y * v3 + p4.y * v4 + p5.y * v5 + p6.y * v6 + p7.y * v7;
            c2 += p0.z * v0 + p1.z * v1 + p2.z * v2 + p3.z * v3 + p4.z * v4 + p5.z * v5 + p6.z * v6 + p7.z * v7;
            c3 += p0.w * v0 + p1.w * v1 + p2.w * v2 + p3.w * v3 + p4.w * v4 + p5.w * v5 + p6.w * v6 + p7.w * v7;
        }
    }

    workgroupBarrier();   // every warp is done with the probabilities: SA[0, 512) takes partials
    let pw = rg * 128u + 4u * rq * 8u + cq;
    put_partials(pw, a0, a1, a2, a3);
    workgroupBarrier();
    tile_out(li, 0u, i0, b, h);
    if (CGS == 16u) {
        workgroupBarrier();
        put_partials(pw, c0, c1, c2, c3);
        workgroupBarrier();
        tile_out(li, 8u, i0, b, h);
    }
}

// A lane's partial outputs of its 4 rows (one value vec4 each) into SA as [warp][row][vec4].
fn put_partials(pw: u32, o0: vec4<f32>, o1: vec4<f32>, o2: vec4<f32>, o3: vec4<f32>) {
    SA[pw] = o0;
    SA[pw + 8u] = o1;
    SA[pw + 16u] = o2;
    SA[pw + 24u] = o3;
}

// Thread li sums the four warps' partials of row li / 8, value vec4 li % 8 + c0, normalizes and
// writes it (zeros for a row whose maximum is -inf, as torch's sdpa; NaN for a NaN maximum).
fn tile_out(li: u32, c0: u32, i0: u32, b: u32, h: u32) {
    let r = li / 8u;
    let c = li % 8u;
    let i = i0 + r;
    if (c + c0 >= P.dv / 4u || i >= P.tq) {
        return;
    }
    let at = r * 8u + c;
    let mx = SA[RED + r / 4u][r % 4u];
    let l = SA[RED + 4u + r / 4u][r % 4u];
    var o = (SA[at] + SA[128u + at] + SA[256u + at] + SA[384u + at]) / l;
    if (is_nan(mx)) {
        o = vec4<f32>(nan_f32());
    } else if (l == 0.0) {
        // Every score -inf (row_exp gives 0 for each): the only way to a sum of exactly 0, where
        // a NaN score makes it NaN even if a compiler let the maximum skip it.
        o = vec4<f32>(0.0);
    }
    let ob = P.o_base + b * P.os_b + h * P.os_h + i * P.os_i + 4u * (c + c0);
    OUT[ob] = bitcast<u32>(o.x);
    OUT[ob + 1u] = bitcast<u32>(o.y);
    OUT[ob + 2u] = bitcast<u32>(o.z);
    OUT[ob + 3u] = bitcast<u32>(o.w);
}
