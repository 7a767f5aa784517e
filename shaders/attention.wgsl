// Scaled-dot-product attention for short query blocks (decode), two ways:
//
// - `attn_split` + `attn_combine` (split-K, flash-decoding; the default): a workgroup per
//   (batch x kv head, block of up to RB query rows sharing that kv head, chunk of AWG keys) scores
//   its keys one thread per key, takes each row's chunk maximum and exp-sum by tree reductions in
//   workgroup memory, and P v with threads over (row, value column); it writes the partial
//   (max, sum, unnormalised output) of every (row, chunk) to a float32 scratch. `attn_combine`
//   (a workgroup per query row) rescales the chunks to the global maximum and normalises. Many
//   workgroups share the key range, which a decode step's handful of rows cannot fill otherwise.
// - `attn_rows` (the older fused kernel, kept for Tuning(attn_split=False) and for a scratch too
//   big for one binding): one workgroup per query row (b, h, i) computes scale * q k^T over every
//   key, the masked softmax and P v, in one dispatch; serial over keys within a thread.
//
// core/kernels.py uses the matmul + softmax_rows composition for longer query blocks, where tiled
// products pay off.
//
// q [B, H, Tq, D], k [B, Hk, Tk, D], v [B, Hk, Tk, Dv], out [B, H, Tq, Dv], all contiguous; query
// head h reads key/value head h / (H / Hk) (grouped-query). A key j is dropped when CAUSAL and
// j > i + causal_offset, or MASK == 1 and the bool mask is 0; MASK == 2 adds a float mask (mask
// strides are broadcast: 0 where the mask has size 1). A row with nothing kept, or whose maximum is
// -inf, gives zeros, as torch's scaled_dot_product_attention (its _safe_softmax) and the reference;
// a NaN score makes its row NaN.
//
// float16 output: threads write column pairs (kernels.py sends odd Dv elsewhere).

//! include common.wgsl

struct AttnParams {
    rows: u32,
    tq: u32,
    heads: u32,
    group: u32,
    tk: u32,
    d: u32,
    dv: u32,
    hk: u32,
    q_base: u32,
    k_base: u32,
    v_base: u32,
    out_base: u32,
    m_base: u32,
    ms_b: u32,
    ms_h: u32,
    ms_i: u32,
    ms_j: u32,
    causal_offset: i32,
    scale: f32,
    nc: u32,     // key chunks (attn_split / attn_combine)
}

override DTQ: u32 = 0u;
override DTK: u32 = 0u;
override DTV: u32 = 0u;
override DTM: u32 = 0u;
override MASK: u32 = 0u;
override CAUSAL: bool = false;
override AWG: u32 = 64u;

const SCORES: u32 = 2048u;   // keys per row held in workgroup memory (8 KiB)
const QMAX: u32 = 256u;      // head dim held in workgroup memory

@group(0) @binding(0) var<uniform> P: AttnParams;
@group(0) @binding(2) var<storage, read_write> Q: array<u32>;
@group(0) @binding(3) var<storage, read_write> K: array<u32>;
@group(0) @binding(4) var<storage, read_write> V: array<u32>;
@group(0) @binding(5) var<storage, read_write> MK: array<u32>;

var<workgroup> sc: array<f32, SCORES>;
var<workgroup> qs: array<f32, QMAX>;
var<workgroup> red: array<f32, AWG>;

fn ldk(i: u32) -> f32 { return word_f32(K[widx(i, DTK)], i, DTK); }
fn ldv(i: u32) -> f32 { return word_f32(V[widx(i, DTV)], i, DTV); }

fn attn_reduce(v: f32, li: u32, is_max: bool) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var s = AWG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            if (is_max) {
                red[li] = nmax(red[li], red[li + s]);
            } else {
                red[li] += red[li + s];
            }
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(AWG)
fn attn_rows(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
             @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= P.rows) {
        return;
    }
    let i = r % P.tq;
    let bh = r / P.tq;
    let h = bh % P.heads;
    let b = bh / P.heads;
    let kvh = b * P.hk + h / P.group;
    let kb = P.k_base + kvh * P.tk * P.d;
    let vb = P.v_base + kvh * P.tk * P.dv;
    let mrow = P.m_base + b * P.ms_b + h * P.ms_h + i * P.ms_i;

    let qb = P.q_base + r * P.d;
    for (var t = li; t < P.d; t += AWG) {
        qs[t] = word_f32(Q[widx(qb + t, DTQ)], qb + t, DTQ);
    }
    workgroupBarrier();

    // Scores of this thread's keys; dropped keys are marked -inf (exp gives 0 for them).
    var mx = neg_inf();
    for (var j = li; j < P.tk; j += AWG) {
        var keep = true;
        if (CAUSAL && i32(j) > i32(i) + P.causal_offset) {
            keep = false;
        }
        var s = 0.0;
        if (keep) {
            let kr = kb + j * P.d;
            for (var t = 0u; t < P.d; t++) {
                s += qs[t] * ldk(kr + t);
            }
            s *= P.scale;
            if (MASK != 0u) {
                let mi = mrow + j * P.ms_j;
                let m = word_f32(MK[widx(mi, DTM)], mi, DTM);
                if (MASK == 1u) {
                    keep = m != 0.0;
                } else {
                    s += m;
                }
            }
        }
        if (keep) {
            if (s > mx || is_nan(s)) {
                mx = s;
            }
            sc[j] = s;
        } else {
            sc[j] = neg_inf();
        }
    }
    mx = attn_reduce(mx, li, true);
    var sum = 0.0;
    for (var j = li; j < P.tk; j += AWG) {
        var e = 0.0;
        if (ne_f(sc[j], neg_inf())) {
            e = exp_f(sc[j] - mx);   // NaN for a NaN score, also where the max skipped it
        }
        sc[j] = e;
        sum += e;
    }
    sum = attn_reduce(sum, li, false);   // its barriers also publish sc[] to every thread
    // Dead: every key dropped or -inf, the only way to an exp-sum of exactly 0 (a kept finite
    // score contributes exp(0) = 1 at the maximum; a NaN one makes the sum NaN). Tested on the
    // sum, not on the maximum: a compiler may drop `s != s` and skip NaN scores in the maximum.
    let dead = sum == 0.0;

    let ob = P.out_base + r * P.dv;
    if (DT_OUT == DT_F16) {
        for (var w = li; w < P.dv / 2u; w += AWG) {
            let d0 = 2u * w;
            var a0 = 0.0;
            var a1 = 0.0;
            for (var j = 0u; j < P.tk; j++) {
                let p = sc[j];
                a0 += p * ldv(vb + j * P.dv + d0);
                a1 += p * ldv(vb + j * P.dv + d0 + 1u);
            }
            var o0 = a0 / sum;
            var o1 = a1 / sum;
            if (dead) {   // fully masked row: zeros (torch's sdpa), not 0/0
                o0 = 0.0;
                o1 = 0.0;
            }
            store_pair((ob + d0) >> 1u, o0, o1, true, true);
        }
        return;
    }
    for (var d = li; d < P.dv; d += AWG) {
        var a = 0.0;
        for (var j = 0u; j < P.tk; j++) {
            a += sc[j] * ldv(vb + j * P.dv + d);
        }
        var o = a / sum;
        if (dead) {   // fully masked row: zeros (torch's sdpa), not 0/0
            o = 0.0;
        }
        store_f(ob + d, o);
    }
}

// ------------------------------------------------------------------------------------ split-K
//
// Partial of (global query row R, chunk c) in the scratch (attn_split's OUT, attn_combine's PT),
// float32 words at (R * nc + c) * (dv + 2): [chunk max, exp-sum, dv unnormalised outputs]. A chunk
// that keeps no key (or only -inf scores) has max -inf, sum 0 and zero outputs; combine makes a
// row zeros when every chunk is like that (its global maximum is -inf). Query rows sharing kv head
// (b, kvh) are the contiguous global rows (b * hk + kvh) * group * tq + [0, group * tq).

const RB: u32 = 8u;        // query rows per split workgroup
const CHMAX: u32 = 64u;    // largest AWG for attn_split (kernels.py picks 32 or 64)

@group(0) @binding(6) var<storage, read_write> PT: array<u32>;

var<workgroup> sq: array<f32, 2048>;    // RB x QMAX query values
var<workgroup> ss: array<f32, 512>;     // RB x CHMAX scores, then probabilities
var<workgroup> sr: array<f32, 512>;     // RB x CHMAX reduction lanes
var<workgroup> srow: array<f32, 8>;     // RB row maxima

@compute @workgroup_size(AWG)
fn attn_split(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let c = wid.x;
    let gkv = wid.z;                     // b * hk + kvh
    let gr = P.group * P.tq;             // query rows sharing this kv head
    let r0 = wid.y * RB;
    if (r0 >= gr) {
        return;
    }
    let nr = min(RB, gr - r0);
    let row0 = gkv * gr + r0;            // global row of local row 0
    let kb = P.k_base + gkv * P.tk * P.d;
    let vb = P.v_base + gkv * P.tk * P.dv;
    let d = P.d;

    for (var x = li; x < nr * d; x += AWG) {
        let qi = P.q_base + row0 * d + x;
        sq[x] = word_f32(Q[widx(qi, DTQ)], qi, DTQ);
    }
    for (var r = 0u; r < nr; r++) {
        ss[r * AWG + li] = 0.0;
    }
    workgroupBarrier();

    // One thread per key: each K element is read once and used for every row of the block.
    let j = c * AWG + li;
    if (j < P.tk) {
        let kr = kb + j * d;
        for (var t = 0u; t < d; t++) {
            let kv = ldk(kr + t);
            for (var r = 0u; r < nr; r++) {
                ss[r * AWG + li] += sq[r * d + t] * kv;
            }
        }
    }
    for (var r = 0u; r < nr; r++) {
        let g = row0 + r;
        let i = g % P.tq;
        let h = (g / P.tq) % P.heads;
        let b = g / (P.tq * P.heads);
        var keep = j < P.tk;
        if (CAUSAL && i32(j) > i32(i) + P.causal_offset) {
            keep = false;
        }
        var s = ss[r * AWG + li] * P.scale;
        if (keep && MASK != 0u) {
            let mi = P.m_base + b * P.ms_b + h * P.ms_h + i * P.ms_i + j * P.ms_j;
            let m = word_f32(MK[widx(mi, DTM)], mi, DTM);
            if (MASK == 1u) {
                keep = m != 0.0;
            } else {
                s += m;
            }
        }
        if (!keep) {
            s = neg_inf();
        }
        ss[r * AWG + li] = s;
        sr[r * AWG + li] = s;
    }
    workgroupBarrier();
    for (var w = AWG / 2u; w > 0u; w >>= 1u) {
        if (li < w) {
            for (var r = 0u; r < nr; r++) {
                sr[r * AWG + li] = nmax(sr[r * AWG + li], sr[r * AWG + li + w]);
            }
        }
        workgroupBarrier();
    }
    if (li < nr) {
        srow[li] = sr[li * AWG];
    }
    workgroupBarrier();
    for (var r = 0u; r < nr; r++) {
        let s = ss[r * AWG + li];
        var p = 0.0;
        if (ne_f(s, neg_inf())) {
            p = exp_f(s - srow[r]);
        }
        ss[r * AWG + li] = p;
        sr[r * AWG + li] = p;
    }
    workgroupBarrier();
    for (var w = AWG / 2u; w > 0u; w >>= 1u) {
        if (li < w) {
            for (var r = 0u; r < nr; r++) {
                sr[r * AWG + li] += sr[r * AWG + li + w];
            }
        }
        workgroupBarrier();
    }

    // P v: threads over (row, value column), consecutive threads read consecutive V words.
    let dv = P.dv;
    let cnt = min(AWG, P.tk - c * AWG);
    let vc = vb + c * AWG * dv;
    for (var x = li; x < nr * dv; x += AWG) {
        let r = x / dv;
        let col = x % dv;
        var a = 0.0;
        for (var jj = 0u; jj < cnt; jj++) {
            a += ss[r * AWG + jj] * ldv(vc + jj * dv + col);
        }
        OUT[((row0 + r) * P.nc + c) * (dv + 2u) + 2u + col] = bitcast<u32>(a);
    }
    if (li < nr) {
        let pb = ((row0 + li) * P.nc + c) * (dv + 2u);
        OUT[pb] = bitcast<u32>(srow[li]);
        OUT[pb + 1u] = bitcast<u32>(sr[li * AWG]);
    }
}

fn pt(i: u32) -> f32 {
    return bitcast<f32>(PT[i]);
}

// Weight of chunk partial at word pb against the row maximum mx (0 for a chunk that kept nothing).
fn chunk_w(pb: u32, mx: f32) -> f32 {
    let m = pt(pb);
    if (m == neg_inf()) {
        return 0.0;
    }
    return exp_f(m - mx);
}

@compute @workgroup_size(64)
fn attn_combine(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
                @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= P.rows) {
        return;
    }
    let dv = P.dv;
    let stride = dv + 2u;
    let pb = r * P.nc * stride;
    // Every thread walks the chunk headers itself (a few words, cached): no barriers needed.
    var mx = neg_inf();
    for (var c = 0u; c < P.nc; c++) {
        mx = nmax(mx, pt(pb + c * stride));
    }
    var l = 0.0;
    for (var c = 0u; c < P.nc; c++) {
        l += chunk_w(pb + c * stride, mx) * pt(pb + c * stride + 1u);
    }
    let dead = l == 0.0;   // every chunk kept nothing (a NaN partial sum makes l NaN instead)
    let ob = P.out_base + r * dv;
    if (DT_OUT == DT_F16) {
        for (var w = li; w < dv / 2u; w += 64u) {
            let d0 = 2u * w;
            var a0 = 0.0;
            var a1 = 0.0;
            for (var c = 0u; c < P.nc; c++) {
                let cb = pb + c * stride;
                let e = chunk_w(cb, mx);
                a0 += e * pt(cb + 2u + d0);
                a1 += e * pt(cb + 3u + d0);
            }
            var o0 = a0 / l;
            var o1 = a1 / l;
            if (dead) {   // fully masked row: zeros (torch's sdpa), not 0/0
                o0 = 0.0;
                o1 = 0.0;
            }
            store_pair((ob + d0) >> 1u, o0, o1, true, true);
        }
        return;
    }
    for (var col = li; col < dv; col += 64u) {
        var a = 0.0;
        for (var c = 0u; c < P.nc; c++) {
            let cb = pb + c * stride;
            a += chunk_w(cb, mx) * pt(cb + 2u + col);
        }
        var o = a / l;
        if (dead) {   // fully masked row: zeros (torch's sdpa), not 0/0
            o = 0.0;
        }
        store_f(ob + col, o);
    }
}
