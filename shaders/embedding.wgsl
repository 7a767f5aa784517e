// Embedding gather: out[t, d] = weight[ids[t], d]. One thread per output element (float16 output:
// per output word). A table larger than one binding is split by core/kernels.py into row ranges
// [v_lo, v_hi): each dispatch binds only those rows and writes only the elements whose id falls in
// its range (the others keep their value: whole float16 words are read back and merged).
// Ids outside 0..V-1 are clamped (a GPU cannot raise; the reference executor raises InputError).

//! include common.wgsl

struct EmbeddingParams {
    n: u32,          // output elements
    D: u32,
    V: u32,
    w_base: u32,     // element offset of row v_lo in W
    ids_base: u32,
    out_base: u32,
    v_lo: u32,
    v_hi: u32,
}

override DTW: u32 = 0u;

@group(0) @binding(0) var<uniform> P: EmbeddingParams;
@group(0) @binding(2) var<storage, read_write> W: array<u32>;
@group(0) @binding(3) var<storage, read_write> IDS: array<u32>;

// Row of output element e, clamped to the table.
fn row_of(e: u32) -> u32 {
    let id = bitcast<i32>(IDS[P.ids_base + e / P.D]);
    return u32(clamp(id, 0, i32(P.V) - 1));
}

fn gather(e: u32, v: u32) -> f32 {
    let i = P.w_base + (v - P.v_lo) * P.D + e % P.D;
    return word_f32(W[widx(i, DTW)], i, DTW);
}

fn ours(v: u32) -> bool {
    return v >= P.v_lo && v < P.v_hi;
}

@compute @workgroup_size(256)
fn embedding(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_id(gid, nwg, 256u);
    if (DT_OUT == DT_F16) {
        let w = (P.out_base >> 1u) + t;
        let e0 = i32(2u * w) - i32(P.out_base);
        var has_lo = e0 >= 0 && e0 < i32(P.n);
        var has_hi = e0 + 1 >= 0 && e0 + 1 < i32(P.n);
        var lo = 0.0;
        var hi = 0.0;
        if (has_lo) {
            let v = row_of(u32(e0));
            has_lo = ours(v);
            if (has_lo) { lo = gather(u32(e0), v); }
        }
        if (has_hi) {
            let v = row_of(u32(e0 + 1));
            has_hi = ours(v);
            if (has_hi) { hi = gather(u32(e0 + 1), v); }
        }
        store_pair(w, lo, hi, has_lo, has_hi);
        return;
    }
    if (t < P.n) {
        let v = row_of(t);
        if (ours(v)) {
            store_f(P.out_base + t, gather(t, v));
        }
    }
}
