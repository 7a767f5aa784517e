// Split-key attention for short query blocks (decode): flash-decoding in two dispatches.
//
// - `attn_flash`: a workgroup per (key chunk of CK keys, block of RWG query rows sharing one kv
//   head, batch x kv head) computes, for each of its rows, the chunk's partial softmax
//   (maximum, exp-sum) and its unnormalised P v, from one pass over the chunk's keys and values.
//   Every global load of a thread (its share of the chunk's K rows and V rows, the mask, q) is
//   issued at the start, before any barrier, so the chunk costs one memory round trip; the rest is
//   on chip. 4 CK threads: first 4 per key (each a quarter of the key's dot products, partial
//   sums in workgroup memory), then over (value column quad, key group) for P v.
// - `attn_flash_combine`: a workgroup per query row merges its chunks with an online rescaling
//   (running maximum, exp-sum and output per thread over chunks a group apart, four chunks'
//   loads in flight at a time, then across threads) and normalises.
//
// So a decode step's 9 heads x 1 query (3 kv heads) spread over 3 x Tk / CK workgroups instead of
// one per row. Same semantics as attention.wgsl (attn_rows, attn_split): query head h reads kv head
// h / group; key j is dropped when CAUSAL and j > i + causal_offset, or MASK == 1 and the bool
// mask is 0; MASK == 2 adds a float mask (strides 0 where broadcast); a row with nothing kept, or
// whose maximum is -inf, gives zeros (torch's sdpa); a NaN score makes its row NaN.
//
// q [B, H, Tq, D], k [B, Hk, Tk, D], v [B, Hk, Tk, Dv] float32, contiguous, read as vec4s (D and
// Dv multiples of 4 up to 256, bases vec4-aligned: core/webgpu/ops_attention.py `_sdpa_flash`);
// out [B, H, Tq, Dv] float32 (sdpa's output dtype is q's). Partials (a float32 scratch, attn_flash's OUT and
// attn_flash_combine's PT): outputs [rows][nc][Dv] from word 0, then (maximum, exp-sum) pairs
// [rows][nc][2] from word `hdr`. A chunk that keeps no key
// has maximum -inf, sum 0 and zero outputs.

//! include common.wgsl

struct FlashParams {
    rows: u32,     // B * H * Tq
    tq: u32,
    heads: u32,
    group: u32,    // H / Hk
    tk: u32,
    d4: u32,       // D / 4
    dv4: u32,      // Dv / 4
    hk: u32,
    q_base: u32,   // vec4 index of q's first element in its binding
    k_base: u32,   // vec4
    v_base: u32,   // vec4
    out_base: u32, // element
    m_base: u32,   // element
    ms_b: u32,
    ms_h: u32,
    ms_i: u32,
    ms_j: u32,
    causal_offset: i32,
    scale: f32,
    nc: u32,       // key chunks
    hdr: u32,      // word of the first (maximum, exp-sum) pair in the partials
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

const RB: u32 = 4u;      // most query rows a workgroup (named registers: s0..s3, o0..o3; arrays sized for it)
override RWG: u32 = 4u;  // query rows a workgroup, 1..RB (the grid's y: blocks of RWG rows sharing a kv head)
const QV: u32 = 64u;     // vec4s of one query row in workgroup memory (D <= 256)

override CK: u32 = 16u;  // keys per workgroup (16 or 32): 4 CK threads, at most 128
override DTM: u32 = 0u;
override MASK: u32 = 0u;
override CAUSAL: bool = false;

@group(0) @binding(0) var<uniform> P: FlashParams;
@group(0) @binding(2) var<storage, read_write> Q4: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> K4: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> V4: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> MK: array<u32>;
@group(0) @binding(6) var<storage, read_write> PT: array<vec4<f32>>;

// Sized for CK = 32 whatever the pipeline's (14.6 KiB): naga 29 (wgpu 0.32) can panic compiling
// a module with override-sized workgroup arrays (seen with gemv_common.wgsl's).
var<workgroup> fq: array<vec4<f32>, 256>;   // RB x QV: q rows (QV apart)
var<workgroup> fsp: array<f32, 512>;        // RB x 4 x CK: [row][quarter][key] dot partials; then [row][group] exp-sums
var<workgroup> fsc: array<f32, 128>;        // RB x CK: [row][key] scores (-inf: dropped)
var<workgroup> fmx: array<f32, 32>;         // RB x 8: [row][8] partial maxima
var<workgroup> fpv: array<vec4<f32>, 512>;  // RB x 4 CK: [row][group][column quad] P v partials

// Mask value of (query row x of the kv head's rows, key j), widened to float32.
fn flash_mask(gkv: u32, x: u32, j: u32) -> f32 {
    let b = gkv / P.hk;
    let h = (gkv % P.hk) * P.group + x / P.tq;
    let i = x % P.tq;
    let mi = P.m_base + b * P.ms_b + h * P.ms_h + i * P.ms_i + j * P.ms_j;
    return word_f32(MK[widx(mi, DTM)], mi, DTM);
}

// Score s of (row x, key j) after scale, causality and the mask: -inf when dropped.
fn flash_keep(s: f32, x: u32, j: u32, mv: f32) -> f32 {
    var keep = j < P.tk;
    if (CAUSAL && i32(j) > i32(x % P.tq) + P.causal_offset) {
        keep = false;
    }
    var r = s * P.scale;
    if (MASK == 1u && mv == 0.0) {
        keep = false;
    }
    if (MASK == 2u) {
        r += mv;
    }
    return select(neg_inf(), r, keep);
}

// exp(s - mx), 0 for a dropped key (NaN stays NaN).
fn flash_p(s: f32, mx: f32) -> f32 {
    if (ne_f(s, neg_inf())) {
        return exp_f(s - mx);
    }
    return 0.0;
}

// The row maximum of row r from its 8 partial maxima.
fn flash_max(r: u32) -> f32 {
    var m = fmx[r * 8u];
    for (var g = 1u; g < 8u; g++) {
        m = nmax(m, fmx[r * 8u + g]);
    }
    return m;
}

@compute @workgroup_size(4u * CK)
fn attn_flash(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let wgs = 4u * CK;
    let c = wid.x;
    let gkv = wid.z;                     // b * hk + kvh
    let gr = P.group * P.tq;             // query rows sharing this kv head
    let x0 = wid.y * RWG;                // first row of the block among them (< gr: the grid)
    let nr = min(RWG, gr - x0);
    let row0 = gkv * gr + x0;            // global query row of local row 0
    let d4 = P.d4;
    let dv4 = P.dv4;
    let j0 = c * CK;

    // ---- every global load first. K: thread t is quarter `sub` of key `jl`, vec4s sub + 4i.
    let jl = t / 4u;
    let sub = t % 4u;
    let kin = j0 + jl < P.tk;
    let kr = P.k_base + (gkv * P.tk + j0 + jl) * d4;
    var k0 = vec4<f32>(0.0);
    var k1 = vec4<f32>(0.0);
    var k2 = vec4<f32>(0.0);
    var k3 = vec4<f32>(0.0);
    if (kin && sub < d4) { k0 = K4[kr + sub]; }
    if (kin && sub + 4u < d4) { k1 = K4[kr + sub + 4u]; }
    if (kin && sub + 8u < d4) { k2 = K4[kr + sub + 8u]; }
    if (kin && sub + 12u < d4) { k3 = K4[kr + sub + 12u]; }
    // V: thread t is column quad dq of key group g (keys g, g + ng, ...); the first four here.
    let ng = wgs / dv4;
    let dq = t % dv4;
    let g = t / dv4;
    let vr = P.v_base + (gkv * P.tk + j0) * dv4 + dq;
    var v0 = vec4<f32>(0.0);
    var v1 = vec4<f32>(0.0);
    var v2 = vec4<f32>(0.0);
    var v3 = vec4<f32>(0.0);
    if (g < ng && g < CK && j0 + g < P.tk) { v0 = V4[vr + g * dv4]; }
    if (g < ng && g + ng < CK && j0 + g + ng < P.tk) { v1 = V4[vr + (g + ng) * dv4]; }
    if (g < ng && g + 2u * ng < CK && j0 + g + 2u * ng < P.tk) { v2 = V4[vr + (g + 2u * ng) * dv4]; }
    if (g < ng && g + 3u * ng < CK && j0 + g + 3u * ng < P.tk) { v3 = V4[vr + (g + 3u * ng) * dv4]; }
    // Mask: thread t < CK owns key j0 + t.
    var mk0 = 1.0;
    var mk1 = 1.0;
    var mk2 = 1.0;
    var mk3 = 1.0;
    if (MASK != 0u && t < CK && j0 + t < P.tk) {
        mk0 = flash_mask(gkv, x0, j0 + t);
        if (nr > 1u) { mk1 = flash_mask(gkv, x0 + 1u, j0 + t); }
        if (nr > 2u) { mk2 = flash_mask(gkv, x0 + 2u, j0 + t); }
        if (nr > 3u) { mk3 = flash_mask(gkv, x0 + 3u, j0 + t); }
    }
    // q rows QV vec4s apart in fq, zeros from d4 up to the 16 vec4s the first four k registers
    // cover (they are zeros there too; a NaN or inf left by the previous workgroup would not be:
    // wgpu-native 0.32 does not zero workgroup memory, docs/NOTES.md).
    let qw = max(d4, 16u);
    for (var e = t; e < nr * qw; e += wgs) {
        let x = e % qw;
        var qv = vec4<f32>(0.0);
        if (x < d4) { qv = Q4[P.q_base + (row0 + e / qw) * d4 + x]; }
        fq[(e / qw) * QV + x] = qv;
    }
    workgroupBarrier();

    // ---- scores: this thread's quarter of key jl's dot product with each row.
    var s0 = dot(fq[sub], k0) + dot(fq[sub + 4u], k1) + dot(fq[sub + 8u], k2) + dot(fq[sub + 12u], k3);
    var s1 = 0.0;
    var s2 = 0.0;
    var s3 = 0.0;
    if (nr > 1u) {
        s1 = dot(fq[QV + sub], k0) + dot(fq[QV + sub + 4u], k1) + dot(fq[QV + sub + 8u], k2)
            + dot(fq[QV + sub + 12u], k3);
    }
    if (nr > 2u) {
        s2 = dot(fq[2u * QV + sub], k0) + dot(fq[2u * QV + sub + 4u], k1) + dot(fq[2u * QV + sub + 8u], k2)
            + dot(fq[2u * QV + sub + 12u], k3);
    }
    if (nr > 3u) {
        s3 = dot(fq[3u * QV + sub], k0) + dot(fq[3u * QV + sub + 4u], k1) + dot(fq[3u * QV + sub + 8u], k2)
            + dot(fq[3u * QV + sub + 12u], k3);
    }
    // Head dims past 64 (D > 64): the rest of the quarter, loaded now.
    for (var i = sub + 16u; i < d4; i += 4u) {
        var kx = vec4<f32>(0.0);
        if (kin) { kx = K4[kr + i]; }
        s0 += dot(fq[i], kx);
        if (nr > 1u) { s1 += dot(fq[QV + i], kx); }
        if (nr > 2u) { s2 += dot(fq[2u * QV + i], kx); }
        if (nr > 3u) { s3 += dot(fq[3u * QV + i], kx); }
    }
    fsp[sub * CK + jl] = s0;
    fsp[(4u + sub) * CK + jl] = s1;
    fsp[(8u + sub) * CK + jl] = s2;
    fsp[(12u + sub) * CK + jl] = s3;
    workgroupBarrier();
    if (t < CK) {
        let j = j0 + t;
        fsc[t] = flash_keep((fsp[t] + fsp[CK + t]) + (fsp[2u * CK + t] + fsp[3u * CK + t]), x0, j, mk0);
        fsc[CK + t] = flash_keep((fsp[4u * CK + t] + fsp[5u * CK + t]) + (fsp[6u * CK + t] + fsp[7u * CK + t]),
                                 x0 + 1u, j, mk1);
        fsc[2u * CK + t] = flash_keep((fsp[8u * CK + t] + fsp[9u * CK + t]) + (fsp[10u * CK + t] + fsp[11u * CK + t]),
                                      x0 + 2u, j, mk2);
        fsc[3u * CK + t] = flash_keep((fsp[12u * CK + t] + fsp[13u * CK + t]) + (fsp[14u * CK + t] + fsp[15u * CK + t]),
                                      x0 + 3u, j, mk3);
    }
    workgroupBarrier();
    if (t < nr * 8u) {   // 8 partial maxima per row, over keys t % 8, + 8, ...
        let r = t / 8u;
        var m = neg_inf();
        for (var k = t % 8u; k < CK; k += 8u) {
            m = nmax(m, fsc[r * CK + k]);
        }
        fmx[t] = m;
    }
    workgroupBarrier();

    // ---- P v and the exp-sums, threads over (column quad dq, key group g).
    let mx0 = flash_max(0u);
    let mx1 = flash_max(1u);
    let mx2 = flash_max(2u);
    let mx3 = flash_max(3u);
    var o0 = vec4<f32>(0.0);
    var o1 = vec4<f32>(0.0);
    var o2 = vec4<f32>(0.0);
    var o3 = vec4<f32>(0.0);
    var l0 = 0.0;
    var l1 = 0.0;
    var l2 = 0.0;
    var l3 = 0.0;
    if (g < ng) {
        for (var i = 0u; g + i * ng < CK; i++) {
            let k = g + i * ng;
            var v = v0;
            if (i == 1u) { v = v1; }
            if (i == 2u) { v = v2; }
            if (i == 3u) { v = v3; }
            if (i > 3u && j0 + k < P.tk) { v = V4[vr + k * dv4]; }   // Dv > 64 with 16-key chunks
            if (i > 3u && j0 + k >= P.tk) { v = vec4<f32>(0.0); }
            let p0 = flash_p(fsc[k], mx0);
            o0 += p0 * v;
            l0 += p0;
            if (nr > 1u) {
                let p1 = flash_p(fsc[CK + k], mx1);
                o1 += p1 * v;
                l1 += p1;
            }
            if (nr > 2u) {
                let p2 = flash_p(fsc[2u * CK + k], mx2);
                o2 += p2 * v;
                l2 += p2;
            }
            if (nr > 3u) {
                let p3 = flash_p(fsc[3u * CK + k], mx3);
                o3 += p3 * v;
                l3 += p3;
            }
        }
        fpv[g * dv4 + dq] = o0;
        fpv[(ng + g) * dv4 + dq] = o1;
        fpv[(2u * ng + g) * dv4 + dq] = o2;
        fpv[(3u * ng + g) * dv4 + dq] = o3;
        if (dq == 0u) {
            fsp[g] = l0;
            fsp[ng + g] = l1;
            fsp[2u * ng + g] = l2;
            fsp[3u * ng + g] = l3;
        }
    }
    workgroupBarrier();
    for (var e = t; e < nr * dv4; e += wgs) {   // (row r, column quad): the sum over key groups
        let r = e / dv4;
        let q = e % dv4;
        var o = fpv[r * ng * dv4 + q];
        for (var gg = 1u; gg < ng; gg++) {
            o += fpv[(r * ng + gg) * dv4 + q];
        }
        let pr = (row0 + r) * P.nc + c;
        let ow = 4u * (pr * dv4 + q);
        OUT[ow] = bitcast<u32>(o.x);
        OUT[ow + 1u] = bitcast<u32>(o.y);
        OUT[ow + 2u] = bitcast<u32>(o.z);
        OUT[ow + 3u] = bitcast<u32>(o.w);
        if (q == 0u) {
            var l = fsp[r * ng];
            for (var gg = 1u; gg < ng; gg++) {
                l += fsp[r * ng + gg];
            }
            var mx = mx0;
            if (r == 1u) { mx = mx1; }
            if (r == 2u) { mx = mx2; }
            if (r == 3u) { mx = mx3; }
            OUT[P.hdr + 2u * pr] = bitcast<u32>(mx);
            OUT[P.hdr + 2u * pr + 1u] = bitcast<u32>(l);
        }
    }
}

// ------------------------------------------------------------------------------------ combine

const CWG: u32 = 256u;   // attn_flash_combine threads: (chunk group, column quad)

var<workgroup> cm: array<f32, 256>;            // [group] running maxima
var<workgroup> cl: array<f32, 256>;            // [group] exp-sums against them
var<workgroup> co: array<vec4<f32>, 256>;      // [group][column quad] outputs against them

// Weight of a part with maximum m against the merged maximum mn (0 for a part that kept nothing).
fn flash_w(m: f32, mn: f32) -> f32 {
    if (m == neg_inf()) {
        return 0.0;
    }
    return exp_f(m - mn);
}

fn pt_word(w: u32) -> f32 {
    return PT[w / 4u][w % 4u];
}

// Merge part (mc, lc, oc) into the running (m, l, o): both rescaled to the larger maximum. A part
// that kept nothing (maximum -inf) changes nothing; a NaN maximum makes everything NaN.
fn flash_merge(m: ptr<function, f32>, l: ptr<function, f32>, o: ptr<function, vec4<f32>>, mc: f32, lc: f32,
               oc: vec4<f32>) {
    if (ne_f(mc, neg_inf())) {
        let mn = nmax(*m, mc);
        let a = flash_w(*m, mn);
        let b = exp_f(mc - mn);
        *l = *l * a + lc * b;
        *o = *o * a + oc * b;
        *m = mn;
    }
}

@compute @workgroup_size(CWG)
fn attn_flash_combine(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wid: vec3<u32>,
                      @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= P.rows) {
        return;
    }
    let dv4 = P.dv4;
    let ng = CWG / dv4;                 // chunk groups: thread (g, dq) merges chunks g, g + ng, ...
    let g = t / dv4;
    let dq = t % dv4;
    var m = neg_inf();
    var l = 0.0;
    var o = vec4<f32>(0.0);
    if (g < ng) {
        let rb = r * P.nc;
        for (var c = g; c < P.nc; c += 4u * ng) {
            // The trip's four chunks are loaded before the first is merged.
            let m0 = pt_word(P.hdr + 2u * (rb + c));
            let l0 = pt_word(P.hdr + 2u * (rb + c) + 1u);
            let o0 = PT[(rb + c) * dv4 + dq];
            var m1 = neg_inf();
            var l1 = 0.0;
            var o1 = vec4<f32>(0.0);
            var m2 = neg_inf();
            var l2 = 0.0;
            var o2 = vec4<f32>(0.0);
            var m3 = neg_inf();
            var l3 = 0.0;
            var o3 = vec4<f32>(0.0);
            if (c + ng < P.nc) {
                let pr = rb + c + ng;
                m1 = pt_word(P.hdr + 2u * pr);
                l1 = pt_word(P.hdr + 2u * pr + 1u);
                o1 = PT[pr * dv4 + dq];
            }
            if (c + 2u * ng < P.nc) {
                let pr = rb + c + 2u * ng;
                m2 = pt_word(P.hdr + 2u * pr);
                l2 = pt_word(P.hdr + 2u * pr + 1u);
                o2 = PT[pr * dv4 + dq];
            }
            if (c + 3u * ng < P.nc) {
                let pr = rb + c + 3u * ng;
                m3 = pt_word(P.hdr + 2u * pr);
                l3 = pt_word(P.hdr + 2u * pr + 1u);
                o3 = PT[pr * dv4 + dq];
            }
            flash_merge(&m, &l, &o, m0, l0, o0);
            flash_merge(&m, &l, &o, m1, l1, o1);
            flash_merge(&m, &l, &o, m2, l2, o2);
            flash_merge(&m, &l, &o, m3, l3, o3);
        }
        co[t] = o;
        if (dq == 0u) {
            cm[g] = m;
            cl[g] = l;
        }
    }
    workgroupBarrier();
    if (t >= dv4) {
        return;
    }
    // Thread dq merges the groups' parts of its column quad.
    var mm = cm[0];
    for (var gg = 1u; gg < ng; gg++) {
        mm = nmax(mm, cm[gg]);
    }
    var ls = 0.0;
    var os = vec4<f32>(0.0);
    for (var gg = 0u; gg < ng; gg++) {
        let w = flash_w(cm[gg], mm);
        ls += cl[gg] * w;
        os += co[gg * dv4 + t] * w;
    }
    var res = os / ls;
    if (ls == 0.0) {   // every chunk kept nothing (a NaN partial makes ls NaN instead): zeros, as torch
        res = vec4<f32>(0.0);
    }
    let ob = P.out_base + r * 4u * dv4 + 4u * t;
    OUT[ob] = bitcast<u32>(res.x);
    OUT[ob + 1u] = bitcast<u32>(res.y);
    OUT[ob + 2u] = bitcast<u32>(res.z);
    OUT[ob + 3u] = bitcast<u32>(res.w);
}
