// Embedding gather from a packed GGUF table (quant.wgsl): OUT[t, :] = the dequantized row ids[t],
// float32. Four threads per (token, block), each decoding a quarter of the block (8 values) and
// storing them. A table larger than one binding is split by core/webgpu/ops_quant.py into row
// ranges [v_lo, v_hi): each dispatch binds only those rows and writes only the tokens whose id
// falls in its range. Ids outside 0..V-1 are clamped (a GPU cannot raise; the reference executor
// raises InputError), as embedding.wgsl does.

//! include common.wgsl
//! include quant.wgsl

struct QEmbedParams {
    units: u32,      // tokens * nb * 4
    nb: u32,         // blocks per row (D / 32)
    D: u32,
    V: u32,
    w_base: u32,     // byte offset in W of row v_lo
    ids_base: u32,
    out_base: u32,
    v_lo: u32,
    v_hi: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> P: QEmbedParams;
@group(0) @binding(2) var<storage, read_write> IDS: array<u32>;
@group(0) @binding(3) var<storage, read_write> W: array<u32>;

fn q_word(i: u32) -> u32 {
    return W[i];
}

@compute @workgroup_size(256)
fn qembed(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let u = linear_id(gid, nwg, 256u);
    if (u >= P.units) {
        return;
    }
    let j = u % 4u;
    let b = (u / 4u) % P.nb;
    let t = u / (4u * P.nb);
    let v = u32(clamp(bitcast<i32>(IDS[P.ids_base + t]), 0, i32(P.V) - 1));
    if (v < P.v_lo || v >= P.v_hi) {
        return;
    }
    let part = q_part(P.w_base + ((v - P.v_lo) * P.nb + b) * q_block_bytes(), j);
    let o = P.out_base + t * P.D + 32u * b;
    let lo = o + q_klo(j);
    let hi = o + q_khi(j);
    OUT[lo] = bitcast<u32>(part.lo.x);
    OUT[lo + 1u] = bitcast<u32>(part.lo.y);
    OUT[lo + 2u] = bitcast<u32>(part.lo.z);
    OUT[lo + 3u] = bitcast<u32>(part.lo.w);
    OUT[hi] = bitcast<u32>(part.hi.x);
    OUT[hi + 1u] = bitcast<u32>(part.hi.y);
    OUT[hi + 2u] = bitcast<u32>(part.hi.z);
    OUT[hi + 3u] = bitcast<u32>(part.hi.w);
}
