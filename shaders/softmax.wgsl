// softmax / log_softmax over one dim, and the masked softmax step of sdpa, one workgroup per row.
//
// Rows: the tensor is viewed as [outer, L, inner]; row r is (r / inner, :, r % inner), element j
// at base + (r / inner) * L * inner + r % inner + j * inner (inner = 1 for the last dim).
//
// For sdpa (core/kernels.py: scores = scale * q @ k^T in a float32 scratch, this kernel in place,
// then P @ v) rows are (b, h, i) with i = r % tq, h = (r / tq) % heads, b = r / (tq * heads), and
// score (i, j) is dropped when CAUSAL and j > i + causal_offset, or MASK == 1 and the bool mask is
// 0; MASK == 2 adds a float mask. Mask strides are broadcast (0 where the mask has size 1). A row
// with nothing kept, or whose maximum is -inf, is NaN for the softmax op (torch.softmax of an all
// -inf row is NaN) and zeros for sdpa's masked step (MASK or CAUSAL set: torch's
// scaled_dot_product_attention gives zeros there, its _safe_softmax); the reference does the same.

//! include common.wgsl

struct SoftmaxParams {
    rows: u32,
    L: u32,
    inner: u32,
    x_base: u32,
    out_base: u32,
    m_base: u32,
    tq: u32,
    heads: u32,
    ms_b: u32,
    ms_h: u32,
    ms_i: u32,
    ms_j: u32,
    causal_offset: i32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override DTX: u32 = 0u;
override DTM: u32 = 0u;
override MASK: u32 = 0u;
override CAUSAL: bool = false;
override LOG: bool = false;
override RWG: u32 = 64u;

@group(0) @binding(0) var<uniform> P: SoftmaxParams;
@group(0) @binding(2) var<storage, read_write> X: array<u32>;
@group(0) @binding(3) var<storage, read_write> MK: array<u32>;

var<workgroup> red: array<f32, RWG>;

fn wg_reduce(v: f32, li: u32, is_max: bool) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var s = RWG / 2u; s > 0u; s >>= 1u) {
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

// Score j of row r: x.y is the value, x.x is 1 when kept.
fn score(r: u32, xb: u32, mrow: u32, i: u32, j: u32) -> vec2<f32> {
    let e = xb + j * P.inner;
    var v = word_f32(X[widx(e, DTX)], e, DTX);
    if (CAUSAL && i32(j) > i32(i) + P.causal_offset) {
        return vec2<f32>(0.0, v);
    }
    if (MASK != 0u) {
        let mi = mrow + j * P.ms_j;
        let m = word_f32(MK[widx(mi, DTM)], mi, DTM);
        if (MASK == 1u) {
            if (m == 0.0) {
                return vec2<f32>(0.0, v);
            }
        } else {
            v = v + m;
        }
    }
    return vec2<f32>(1.0, v);
}

fn out_value(s: vec2<f32>, mx: f32, sum: f32) -> f32 {
    if (LOG) {
        if (s.x == 0.0) {
            return neg_inf();
        }
        return s.y - mx - log_f(sum);
    }
    if (s.x == 0.0) {
        return 0.0;
    }
    return exp_f(s.y - mx) / sum;
}

@compute @workgroup_size(RWG)
fn softmax_rows(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
                @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= P.rows) {
        return;
    }
    let rel = (r / P.inner) * P.L * P.inner + r % P.inner;
    let xb = P.x_base + rel;
    let ob = P.out_base + rel;
    let i = r % P.tq;
    let bh = r / P.tq;
    let mrow = P.m_base + (bh / P.heads) * P.ms_b + (bh % P.heads) * P.ms_h + i * P.ms_i;

    var mx = neg_inf();
    var kept = 0.0;
    for (var j = li; j < P.L; j += RWG) {
        let s = score(r, xb, mrow, i, j);
        if (s.x != 0.0) {
            kept += 1.0;
            if (s.y > mx || is_nan(s.y)) {
                mx = s.y;
            }
        }
    }
    mx = wg_reduce(mx, li, true);
    kept = wg_reduce(kept, li, false);
    var sum = 0.0;
    for (var j = li; j < P.L; j += RWG) {
        let s = score(r, xb, mrow, i, j);
        if (s.x != 0.0 && ne_f(s.y, neg_inf())) {   // a NaN score makes the sum NaN
            sum += exp_f(s.y - mx);
        }
    }
    sum = wg_reduce(sum, li, false);
    // Dead: nothing kept, or every kept score -inf: the only ways to an exp-sum of exactly 0 (a
    // NaN score makes it NaN, also where a compiler lets the maximum skip NaNs).
    let dead = kept == 0.0 || sum == 0.0;
    // What a dead row holds: NaN for the softmax op, zeros for sdpa's masked rows (see the top).
    var dead_v = nan_f32();
    if (MASK != 0u || CAUSAL) {
        dead_v = 0.0;
    }

    if (DT_OUT == DT_F16) {
        // inner == 1, L even and ob even (kernels.py): whole words.
        for (var w = li; w < P.L / 2u; w += RWG) {
            let j = 2u * w;
            var v0 = dead_v;
            var v1 = dead_v;
            if (!dead) {
                v0 = out_value(score(r, xb, mrow, i, j), mx, sum);
                v1 = out_value(score(r, xb, mrow, i, j + 1u), mx, sum);
            }
            store_pair((ob + j) >> 1u, v0, v1, true, true);
        }
        return;
    }
    for (var j = li; j < P.L; j += RWG) {
        var v = dead_v;
        if (!dead) {
            v = out_value(score(r, xb, mrow, i, j), mx, sum);
        }
        store_f(ob + j * P.inner, v);
    }
}
