// Normalizations.
//
// - `norm_rows`: layer_norm (NORM_RMS false: mean and biased variance, two passes over the row for
//   accuracy) and rms_norm (NORM_RMS true), one workgroup of RWG threads per row of L elements (the
//   normalized trailing dims, contiguous), optional weight/bias indexed by the position in the row.
//   float16 output is written as word pairs (kernels.py sends odd L through a float32 scratch).
// - `batch_norm`: inference batch norm as a map, y = (x - mean[c]) / sqrt(var[c] + eps) * w[c] + b[c],
//   c = (e / inner) % C.

//! include common.wgsl

struct NormParams {
    rows: u32,
    L: u32,
    x_base: u32,
    out_base: u32,
    w_base: u32,
    b_base: u32,
    m_base: u32,     // batch_norm: running mean
    v_base: u32,     // batch_norm: running var
    n: u32,          // batch_norm: elements
    C: u32,          // batch_norm: channels
    inner: u32,      // batch_norm: elements per (n, c)
    eps: f32,
}

override DTX: u32 = 0u;
override DTW: u32 = 0u;
override DTB: u32 = 0u;
override DTM: u32 = 0u;
override DTV: u32 = 0u;
override HAS_W: bool = false;
override HAS_B: bool = false;
override NORM_RMS: bool = false;
override RWG: u32 = 64u;

@group(0) @binding(0) var<uniform> P: NormParams;
@group(0) @binding(2) var<storage, read_write> X: array<u32>;
@group(0) @binding(3) var<storage, read_write> WV: array<u32>;
@group(0) @binding(4) var<storage, read_write> BV: array<u32>;
@group(0) @binding(5) var<storage, read_write> MV: array<u32>;
@group(0) @binding(6) var<storage, read_write> VV: array<u32>;

fn ldx(i: u32) -> f32 { return word_f32(X[widx(i, DTX)], i, DTX); }
fn ldw(i: u32) -> f32 { return word_f32(WV[widx(i, DTW)], i, DTW); }
fn ldb(i: u32) -> f32 { return word_f32(BV[widx(i, DTB)], i, DTB); }

var<workgroup> red: array<f32, RWG>;

fn wg_sum(v: f32, li: u32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var s = RWG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] += red[li + s];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn affine(j: u32, x: f32, mean: f32, rstd: f32) -> f32 {
    var y = (x - mean) * rstd;
    if (HAS_W) { y = y * ldw(P.w_base + j); }
    if (HAS_B) { y = y + ldb(P.b_base + j); }
    return y;
}

@compute @workgroup_size(RWG)
fn norm_rows(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
             @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= P.rows) {
        return;
    }
    let xb = P.x_base + row * P.L;
    let ob = P.out_base + row * P.L;
    let fl = f32(P.L);
    var mean = 0.0;
    if (!NORM_RMS) {
        var s = 0.0;
        for (var j = li; j < P.L; j += RWG) { s += ldx(xb + j); }
        mean = wg_sum(s, li) / fl;
    }
    var q = 0.0;
    for (var j = li; j < P.L; j += RWG) {
        let d = ldx(xb + j) - mean;
        q += d * d;
    }
    let rstd = 1.0 / sqrt(wg_sum(q, li) / fl + P.eps);
    if (DT_OUT == DT_F16) {
        for (var w = li; w < P.L / 2u; w += RWG) {
            let j = 2u * w;
            store_pair((ob + j) >> 1u, affine(j, ldx(xb + j), mean, rstd),
                       affine(j + 1u, ldx(xb + j + 1u), mean, rstd), true, true);
        }
        return;
    }
    for (var j = li; j < P.L; j += RWG) {
        store_f(ob + j, affine(j, ldx(xb + j), mean, rstd));
    }
}

fn bn_at(e: u32) -> f32 {
    let c = (e / P.inner) % P.C;
    let mean = word_f32(MV[widx(P.m_base + c, DTM)], P.m_base + c, DTM);
    let var_ = word_f32(VV[widx(P.v_base + c, DTV)], P.v_base + c, DTV);
    // torch's inference form, x * alpha + beta (alpha = w / sqrt(var + eps), beta = b - mean *
    // alpha): it rounds like (x - mean) * alpha + b, but an infinite alpha gives torch's NaN.
    var alpha = 1.0 / sqrt(var_ + P.eps);
    if (HAS_W) { alpha = alpha * ldw(P.w_base + c); }
    var beta = -mean * alpha;
    if (HAS_B) { beta = beta + ldb(P.b_base + c); }
    return ldx(P.x_base + e) * alpha + beta;
}

@compute @workgroup_size(256)
fn batch_norm(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_id(gid, nwg, 256u);
    if (DT_OUT == DT_F16) {
        let w = (P.out_base >> 1u) + t;
        let e0 = i32(2u * w) - i32(P.out_base);
        let has_lo = e0 >= 0 && e0 < i32(P.n);
        let has_hi = e0 + 1 >= 0 && e0 + 1 < i32(P.n);
        var lo = 0.0;
        var hi = 0.0;
        if (has_lo) { lo = bn_at(u32(e0)); }
        if (has_hi) { hi = bn_at(u32(e0 + 1)); }
        store_pair(w, lo, hi, has_lo, has_hi);
        return;
    }
    if (t < P.n) {
        store_f(P.out_base + t, bn_at(t));
    }
}
