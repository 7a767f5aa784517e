// Prefill attention on the subgroup-matrix units (tensor cores): the `attn_sgmat_d*v*` entries,
// float32 q, k, v and output, at most 128 keys, head dims of 16 or 32 (precision="fast": q, k, the
// probabilities and v are rounded to float16 on their way into the matrices; the products
// accumulate in float32, the softmax is float32). core/webgpu/ops_attention.py chooses it.
//
// A workgroup of 8 subgroups takes 128 query rows of one (batch, head) and every key of its kv
// head, staged once as float16; the passes over 32-key chunks (the row maxima, then exp, the
// row sums and P v) are written out per head-dim pair by attn_sgmat.py (the `//! generate` line
// at the end), which says how. Everything the entries share is here. The kernel assumes
// subgroups of 32 (the 16x16x16 f16 config's devices, NVIDIA's), as matmul_sgmat.wgsl does.
//
// Semantics as attention_tile.wgsl: a key j is dropped when CAUSAL and j > i + causal_offset, or
// MASK == 1 and the bool mask is 0; MASK == 2 adds a float mask. A row with nothing kept gives
// zeros (as torch's scaled_dot_product_attention and the reference); a NaN score makes its row NaN.
// Operands are addressed by (batch, head, row) strides with a contiguous last dim, with
// attn_tile's parameters (head permutes fold into them); q, k and v are read as 16-byte words
// (q_base, k_base and their strides multiples of 4; v's are in vec4s already).

enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;
// Matrix offsets depend on the subgroup id only: uniform within each subgroup, which is what the
// hardware needs; Tint's analysis asks for workgroup uniformity.
diagnostic(off, chromium.subgroup_matrix_uniformity);

//! include common.wgsl

//! include attn_tile_params.wgsl

override DTM: u32 = 0u;
override MASK: u32 = 0u;
override CAUSAL: bool = false;
override MROWS: bool = false;    // the mask varies along the query rows (ms_i != 0): a load per row

@group(0) @binding(0) var<uniform> P: TileParams;
@group(0) @binding(2) var<storage, read_write> Q4: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> K4: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> V4: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> MK: array<u32>;

// Dims 4c .. 4c + 3 of key `key` of k (v), or of query row `row` of q, as float32 words; zeros
// past the keys (rows), where the load reads element 0 instead.
fn load_k(key: u32, c: u32, kb: u32) -> vec4<u32> {
    let ok = key < P.tk;
    return select(vec4<u32>(0u), K4[select(0u, (kb + key * P.ks_j) / 4u + c, ok)], ok);
}

fn load_v(key: u32, c: u32, vb: u32) -> vec4<u32> {
    let ok = key < P.tk;
    return select(vec4<u32>(0u), V4[select(0u, vb + key * P.vs_j + c, ok)], ok);
}

fn load_q(row: u32, c: u32, qb: u32) -> vec4<u32> {
    let ok = row < P.tq;
    return select(vec4<u32>(0u), Q4[select(0u, (qb + row * P.qs_i) / 4u + c, ok)], ok);
}

var<private> mrow: u32;          // the mask's element of (row 0, key 0) for this (batch, head)

// The mask value of (row i, key j), or 0 when there is no mask; a row or key past the block reads
// element m_base instead.
fn mask_at(i: u32, j: u32) -> f32 {
    if (MASK == 0u) {
        return 0.0;
    }
    let ok = i < P.tq && j < P.tk;
    let mi = select(P.m_base, mrow + i * P.ms_i + j * P.ms_j, ok);
    return word_f32(MK[widx(mi, DTM)], mi, DTM);
}

// What every row adds to key j's scaled score: -inf for a key past tk, or (a mask the same for
// every row) one the bool mask drops; a float mask's value; else 0.
fn key_bias(j: u32) -> f32 {
    if (j >= P.tk) {
        return neg_inf();
    }
    if (MROWS) {
        return 0.0;
    }
    let m = mask_at(0u, j);
    if (MASK == 1u) {
        return select(0.0, neg_inf(), m == 0.0);
    }
    return m;
}

// Final score of (row i, key j) from its raw q.k and the key's bias, or -inf where the key is
// dropped. Rows past tq get scores too (their q is zeros): they are never written.
fn score(raw: f32, kbias: f32, j: u32, i: u32) -> f32 {
    var e = raw * P.scale + kbias;
    if (MROWS) {
        let m = mask_at(i, j);
        if (MASK == 1u && m == 0.0) {
            e = neg_inf();
        } else if (MASK == 2u) {
            e += m;
        }
    }
    if (CAUSAL && i32(j) > i32(i) + P.causal_offset) {
        e = neg_inf();
    }
    return e;
}

// Output row i, value column col: P v over the row's sum (zeros where every key was dropped, a sum
// of exactly 0; a NaN score made both NaN).
fn out_row(i: u32, col: u32, o: f32, l: f32, b: u32, h: u32) {
    if (i >= P.tq) {
        return;
    }
    var v = o / l;
    if (l == 0.0) {
        v = 0.0;
    }
    OUT[P.o_base + b * P.os_b + h * P.os_h + i * P.os_i + col] = bitcast<u32>(v);
}

//! generate attn_sgmat
