// Convolution and pooling over NCHW tensors, one thread per output element (float16 output: one
// thread per output word, i.e. two elements). 1x1 stride-1 unpadded convolutions do not come here:
// core/kernels.py runs them as matrix products (matmul.wgsl).
//
// - `conv2d`: groups (depthwise included), stride, padding, dilation, optional bias.
// - `pool2d`: max (padding counts as -inf) or average (torch's divisor rules: the window is cut at
//   the right padding edge; count_include_pad or the count of real inputs), ceil_mode included
//   (the output size comes from core/ops.py; windows past the edge just see fewer inputs).

//! include common.wgsl

struct ConvParams {
    n: u32,          // output elements
    out_base: u32,
    x_base: u32,
    w_base: u32,
    b_base: u32,
    C: u32,
    H: u32,
    W: u32,
    O: u32,          // output channels (pool: = C)
    Ho: u32,
    Wo: u32,
    kh: u32,
    kw: u32,
    sh: u32,
    sw: u32,
    ph: u32,
    pw: u32,
    dh: u32,
    dw: u32,
    cg: u32,         // input channels per group
    og: u32,         // output channels per group
    count_include_pad: u32,
    _pad0: u32,
    _pad1: u32,
}

override DTX: u32 = 0u;
override DTW: u32 = 0u;
override DTBIAS: u32 = 0u;
override HAS_BIAS: bool = false;
override POOL_MAX: bool = true;

@group(0) @binding(0) var<uniform> P: ConvParams;
@group(0) @binding(2) var<storage, read_write> X: array<u32>;
@group(0) @binding(3) var<storage, read_write> WT: array<u32>;
@group(0) @binding(4) var<storage, read_write> BIASV: array<u32>;

fn ldx(i: u32) -> f32 { return word_f32(X[widx(i, DTX)], i, DTX); }
fn ldw(i: u32) -> f32 { return word_f32(WT[widx(i, DTW)], i, DTW); }

fn conv_at(e: u32) -> f32 {
    let ow = e % P.Wo;
    var t = e / P.Wo;
    let oh = t % P.Ho;
    t = t / P.Ho;
    let o = t % P.O;
    let nb = t / P.O;
    let g = o / P.og;
    var acc = 0.0;
    if (HAS_BIAS) {
        let bi = P.b_base + o;
        acc = word_f32(BIASV[widx(bi, DTBIAS)], bi, DTBIAS);
    }
    let ih0 = i32(oh * P.sh) - i32(P.ph);
    let iw0 = i32(ow * P.sw) - i32(P.pw);
    for (var c = 0u; c < P.cg; c++) {
        let xc = P.x_base + (nb * P.C + g * P.cg + c) * P.H * P.W;
        let wc = P.w_base + (o * P.cg + c) * P.kh * P.kw;
        for (var i = 0u; i < P.kh; i++) {
            let ih = ih0 + i32(i * P.dh);
            if (ih < 0 || ih >= i32(P.H)) {
                continue;
            }
            for (var j = 0u; j < P.kw; j++) {
                let iw = iw0 + i32(j * P.dw);
                if (iw < 0 || iw >= i32(P.W)) {
                    continue;
                }
                acc += ldx(xc + u32(ih) * P.W + u32(iw)) * ldw(wc + i * P.kw + j);
            }
        }
    }
    return acc;
}

fn pool_at(e: u32) -> f32 {
    let ow = e % P.Wo;
    var t = e / P.Wo;
    let oh = t % P.Ho;
    let nc = t / P.Ho;
    let xc = P.x_base + nc * P.H * P.W;
    let hs = i32(oh * P.sh) - i32(P.ph);
    let ws = i32(ow * P.sw) - i32(P.pw);
    if (POOL_MAX) {
        var m = neg_inf();
        for (var i = 0u; i < P.kh; i++) {
            let ih = hs + i32(i * P.dh);
            if (ih < 0 || ih >= i32(P.H)) {
                continue;
            }
            for (var j = 0u; j < P.kw; j++) {
                let iw = ws + i32(j * P.dw);
                if (iw < 0 || iw >= i32(P.W)) {
                    continue;
                }
                let v = ldx(xc + u32(ih) * P.W + u32(iw));
                if (v > m || is_nan(v)) {
                    m = v;
                }
            }
        }
        return m;
    }
    let he = min(hs + i32(P.kh), i32(P.H + P.ph));
    let we = min(ws + i32(P.kw), i32(P.W + P.pw));
    let h0 = max(hs, 0);
    let h1 = min(he, i32(P.H));
    let w0 = max(ws, 0);
    let w1 = min(we, i32(P.W));
    var s = 0.0;
    for (var ih = h0; ih < h1; ih++) {
        for (var iw = w0; iw < w1; iw++) {
            s += ldx(xc + u32(ih) * P.W + u32(iw));
        }
    }
    var div = f32((he - hs) * (we - ws));
    if (P.count_include_pad == 0u) {
        div = f32((h1 - h0) * (w1 - w0));
    }
    return s / div;
}

@compute @workgroup_size(256)
fn conv2d(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_id(gid, nwg, 256u);
    if (DT_OUT == DT_F16) {
        let w = (P.out_base >> 1u) + t;
        let e0 = i32(2u * w) - i32(P.out_base);
        let has_lo = e0 >= 0 && e0 < i32(P.n);
        let has_hi = e0 + 1 >= 0 && e0 + 1 < i32(P.n);
        var lo = 0.0;
        var hi = 0.0;
        if (has_lo) { lo = conv_at(u32(e0)); }
        if (has_hi) { hi = conv_at(u32(e0 + 1)); }
        store_pair(w, lo, hi, has_lo, has_hi);
        return;
    }
    if (t < P.n) {
        store_f(P.out_base + t, conv_at(t));
    }
}

@compute @workgroup_size(256)
fn pool2d(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_id(gid, nwg, 256u);
    if (DT_OUT == DT_F16) {
        let w = (P.out_base >> 1u) + t;
        let e0 = i32(2u * w) - i32(P.out_base);
        let has_lo = e0 >= 0 && e0 < i32(P.n);
        let has_hi = e0 + 1 >= 0 && e0 + 1 < i32(P.n);
        var lo = 0.0;
        var hi = 0.0;
        if (has_lo) { lo = pool_at(u32(e0)); }
        if (has_hi) { hi = pool_at(u32(e0 + 1)); }
        store_pair(w, lo, hi, has_lo, has_hi);
        return;
    }
    if (t < P.n) {
        store_f(P.out_base + t, pool_at(t));
    }
}
