// Fused scaled-dot-product attention for short query blocks (decode): one workgroup per query row
// (b, h, i) computes scale * q k^T over every key, the masked softmax and P v, in one dispatch
// instead of three (core/kernels.py uses the matmul + softmax_rows composition for longer query
// blocks, where tiled products pay off, and for key counts past SCORES).
//
// q [B, H, Tq, D], k [B, Hk, Tk, D], v [B, Hk, Tk, Dv], out [B, H, Tq, Dv], all contiguous; query
// head h reads key/value head h / (H / Hk) (grouped-query). A key j is dropped when CAUSAL and
// j > i + causal_offset, or MASK == 1 and the bool mask is 0; MASK == 2 adds a float mask (mask
// strides are broadcast: 0 where the mask has size 1). A row with nothing kept, or whose maximum is
// -inf, is NaN, as the reference and torch's math kernel.
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
    _pad0: u32,
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
                red[li] = max(red[li], red[li + s]);
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
    var kept = 0.0;
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
            kept += 1.0;
            if (s > mx || s != s) {
                mx = s;
            }
            sc[j] = s;
        } else {
            sc[j] = neg_inf();
        }
    }
    mx = attn_reduce(mx, li, true);
    kept = attn_reduce(kept, li, false);
    let dead = kept == 0.0 || mx == neg_inf();
    var sum = 0.0;
    for (var j = li; j < P.tk; j += AWG) {
        var e = 0.0;
        if (!dead && sc[j] != neg_inf()) {
            e = exp(sc[j] - mx);
        }
        sc[j] = e;
        sum += e;
    }
    sum = attn_reduce(sum, li, false);   // its barriers also publish sc[] to every thread

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
            if (dead) {
                o0 = nan_f32();
                o1 = nan_f32();
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
        if (dead) {
            o = nan_f32();
        }
        store_f(ob + d, o);
    }
}
