// Rotary position embedding (Llama's half rotation): out = x * cos + rotate_half(x) * sin with
// x [B, H, T, D], cos/sin [T, D], rotate_half(x)[d] = -x[d + D/2] for d < D/2, x[d - D/2] otherwise.
// One thread per output element (float16 output: per output word).

//! include common.wgsl

struct RopeParams {
    n: u32,
    T: u32,
    D: u32,
    x_base: u32,
    cos_base: u32,
    sin_base: u32,
    out_base: u32,
    _pad0: u32,
}

override DTX: u32 = 0u;
override DTC: u32 = 0u;
override DTS: u32 = 0u;

@group(0) @binding(0) var<uniform> P: RopeParams;
@group(0) @binding(2) var<storage, read_write> X: array<u32>;
@group(0) @binding(3) var<storage, read_write> COS: array<u32>;
@group(0) @binding(4) var<storage, read_write> SIN: array<u32>;

fn ldx(i: u32) -> f32 { return word_f32(X[widx(i, DTX)], i, DTX); }

fn rope_at(e: u32) -> f32 {
    let d = e % P.D;
    let t = (e / P.D) % P.T;
    let hd = P.D / 2u;
    let x = ldx(P.x_base + e);
    var partner = 0.0;
    if (d < hd) {
        partner = -ldx(P.x_base + e + hd);
    } else {
        partner = ldx(P.x_base + e - hd);
    }
    let ci = P.cos_base + t * P.D + d;
    let si = P.sin_base + t * P.D + d;
    return x * word_f32(COS[widx(ci, DTC)], ci, DTC) + partner * word_f32(SIN[widx(si, DTS)], si, DTS);
}

@compute @workgroup_size(256)
fn rope(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_id(gid, nwg, 256u);
    if (DT_OUT == DT_F16) {
        let w = (P.out_base >> 1u) + t;
        let e0 = i32(2u * w) - i32(P.out_base);
        let has_lo = e0 >= 0 && e0 < i32(P.n);
        let has_hi = e0 + 1 >= 0 && e0 + 1 < i32(P.n);
        var lo = 0.0;
        var hi = 0.0;
        if (has_lo) { lo = rope_at(u32(e0)); }
        if (has_hi) { hi = rope_at(u32(e0 + 1)); }
        store_pair(w, lo, hi, has_lo, has_hi);
        return;
    }
    if (t < P.n) {
        store_f(P.out_base + t, rope_at(t));
    }
}
