// The kernels of quant_mm.wgsl (documented there) without their reductions: quant_mm.wgsl
// (workgroup-memory trees) and quant_mm_sg.wgsl (subgroup sums) each include this file and
// define gemv_reduce, gemv_sum and qn_prologue.

//! include common.wgsl
//! include quant.wgsl

struct QParams {
    M: u32,
    K: u32,
    nb: u32,         // blocks per weight row (K / 32)
    n_lo: u32,       // weight rows n_lo..n_hi-1 of the NC * n_per in this call
    n_hi: u32,
    n_per: u32,      // N of one linear (the row stride of R)
    x_base: u32,     // vec4 index of X(0, 0)
    x_sm: u32,       // vec4s per X row (K / 4)
    w_base: u32,     // byte offset in W of row n_lo's first block
    bias_base: u32,  // element offsets in BIASV, R, OUT, OUT1, OUT2
    r_base: u32,
    c_base0: u32,
    c_base1: u32,
    c_base2: u32,
    c_sm: u32,       // elements between rows of OUT / OUT1 / OUT2 (n_per, or a concatenation's row)
    w_slots: u32,    // qgemv_cat: binding of weight p (0 W, 1 OUT1, 2 OUT2) in bits 2p..2p+1
    w_base1: u32,    // qgemv_cat: byte offsets of weights 1 and 2 in their bindings (weight 0: w_base)
    w_base2: u32,
    n0: u32,         // qgemv_cat CAT 1: rows of weights 0 and 1 (weight 2 has the rest of n_hi)
    n1: u32,
    g_part: u32,     // qgemv_cat CAT 2: which weights are gate and up (both have n_hi rows)
    u_part: u32,
    eps: u32,        // qgemv_cat_norm: the norm's epsilon, f32 bits (its other words: src at c_base1, a vec4
    _pad1: u32,      // index into X; y at r_base in R; s at c_base2 in S; the weight at bias_base)
    // qgemv_rope (RK): the rope / cache epilogue. Its tensors are all in S, at these word indices
    // (and src at c_base1, y at r_base, s at c_base2, words of S too).
    rk_d: u32,       // head dim D (even)
    rk_t: u32,       // T: X row m is batch m / T, position t = m % T
    rk_s: u32,       // cache rows S of the [B, H, S, D] caches
    rk_cos: u32,     // cos and sin [T, D]
    rk_sin: u32,
    rk_pos: u32,     // the int32 cache position (rows clamp(pos, 0, S - T) + t are written)
    rk_dst0: u32,    // weight p's destination: [B, H, T, D], or its [B, H, S, D] cache
    rk_dst1: u32,
    rk_dst2: u32,
    rk_flags: u32,   // bits 2p: weight p writes a cache; 2p + 1: weight p is rotated
    // qgemv_attn reads words 24..30 as its attention partials instead (the ar_* functions below):
    // rows B H T, chunks per row, Dv / 4, heads H, query rows T, the partials' first vec4 in X,
    // and the word (from that vec4's first) of the first (maximum, exp-sum) pair.
    _pad2: u32,
    _pad3: u32,
}

override BIAS: u32 = 0u;   // 0 none, 1 one value per column of a linear, 3 one per weight row (siblings' biases back to back)
override ACT: u32 = 0u;    // fused epilogue: 1 gelu (erf), 2 gelu (tanh)
override RES: bool = false; // fused epilogue: + R(m, n), R float32 [M][n_per]
override NC: u32 = 1u;     // linears in this product (siblings)
// Every override is declared before the workgroup arrays sized by overrides: naga 29 (wgpu 0.32)
// panics in its pipeline-constant pass (handlevec.rs) when an override the entry point uses is
// declared after such an array.
// qgemv:
override TPR: u32 = 32u;   // threads per weight row
override TP2: u32 = 32u;   // TPR rounded up to a power of two (the tree reduction's first stride is TP2 / 2)
override ROWS: u32 = 8u;   // weight rows per workgroup (TPR * ROWS <= 256)
override UPL: u32 = 2u;    // units a lane loads per loop trip before its math: 2, or 3 / 4 (quant_mm_sg.wgsl)
override RPT: u32 = 1u;    // qgemv: weight rows per thread row, 1 or 2 (2: one-trip rows, GM <= 4; gemv_two)
// Rows of X (M <= 8) as a pipeline constant: row m's accumulator is a named component, touched
// only under `GM > m` tests of that constant (no loop-indexed register array: docs/NOTES.md).
override GM: u32 = 1u;
// qmm:
override WX: u32 = 16u;   // threads along n (4 WX columns per tile)
override WY: u32 = 16u;   // threads along m (4 WY rows per tile)
override KSPLIT: u32 = 1u; // qmm: workgroups along z, each a range of the blocks; > 1 writes partial sums (qmm_sum adds them)
override CAT: u32 = 0u;    // qgemv_cat: 1 concatenated row, 2 silu(gate) * up; 0 every other entry (W only)
override NORM: u32 = 0u;   // qgemv_cat_norm: 1 rms_norm prologue, 2 add + rms_norm; qgemv_attn: 3 (X rows are then `hs4`); 0 X
override HS: u32 = 1u;     // qgemv_cat_norm: vec4s of the normalized rows in workgroup memory (GM * K / 4)
override HAS_W: bool = false; // qgemv_cat_norm: the norm has a weight (BIASV)
override RK: bool = false;  // qgemv_rope: the prologue's src / y / s and the epilogue's tensors are words of S

@group(0) @binding(0) var<uniform> P: QParams;
@group(0) @binding(2) var<storage, read_write> X: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> W: array<u32>;
@group(0) @binding(4) var<storage, read_write> BIASV: array<f32>;
@group(0) @binding(5) var<storage, read_write> R: array<f32>;
@group(0) @binding(6) var<storage, read_write> OUT1: array<u32>;
@group(0) @binding(7) var<storage, read_write> OUT2: array<u32>;
@group(0) @binding(8) var<storage, read_write> S: array<u32>;   // qgemv_cat_norm NORM 2: the sum s

var<private> q_slot: u32;   // qgemv_cat: the binding holding this thread's weight row

// Word i of the weight bytes (quant.wgsl's hook): W, or for qgemv_cat the current row's binding
// (a run-time choice: the two-unit loop, gemv_pair, and qmm read through it).
fn q_word(i: u32) -> u32 {
    return q_word_in(q_slot, i);
}

// Word i of weight binding `slot` (0 W, 1 OUT1, 2 OUT2). The UPL 3 / 4 row loops take the slot as an
// argument and are entered once per slot with it as a literal (gemv_row, gemv_start), so that the
// compiler's inlined copy of each has loads that name one binding: no run-time branch over three
// bindings (and merge of their results) around every load, which held qgemv_cat's loads back
// (docs/NOTES.md). One source text; the shader compiler makes the copies.
fn q_word_in(slot: u32, i: u32) -> u32 {
    if (CAT == 0u || slot == 0u) {
        return W[i];
    }
    if (slot == 1u) {
        return OUT1[i];
    }
    return OUT2[i];
}

// OUT(m, n) of weight row n (of all NC linears): bias, epilogue, and the store into its linear's output.
fn q_store(m: u32, n: u32, acc: f32) {
    var z = 0u;
    if (NC > 1u) {
        z = n / P.n_per;
    }
    let col = n - z * P.n_per;
    var v = acc;
    if (BIAS == 1u) {
        v += BIASV[P.bias_base + col];
    }
    if (BIAS == 3u) {
        v += BIASV[P.bias_base + n];
    }
    if (ACT == 1u) {
        v = 0.5 * v * (1.0 + erf_f(v * 0.70710678118654752));
    }
    if (ACT == 2u) {
        v = 0.5 * v * (1.0 + tanh_f(0.79788456080286536 * (v + 0.044715 * v * v * v)));
    }
    if (RES) {
        v += R[P.r_base + m * P.n_per + col];
    }
    let e = m * P.c_sm + col;
    if (z == 0u) {
        OUT[P.c_base0 + e] = bitcast<u32>(v);
    } else if (z == 1u) {
        OUT1[P.c_base1 + e] = bitcast<u32>(v);
    } else {
        OUT2[P.c_base2 + e] = bitcast<u32>(v);
    }
}

// ------------------------------------------------------------------------------------------ qgemv

var<workgroup> red: array<vec4<f32>, 2u * TPR * ROWS>;   // [row][lane][2]: X rows 0..3, 4..7

var<workgroup> hs4: array<vec4<f32>, HS>;   // NORM > 0: the normalized X rows [GM][K / 4] (x_base 0, x_sm K / 4)

var<private> acc_a: vec4<f32>;   // X rows 0..3
var<private> acc_b: vec4<f32>;   // X rows 4..7

// vec4 i of X, or of the normalized rows.
fn gemv_x(i: u32) -> vec4<f32> {
    if (NORM > 0u) {
        return hs4[i];
    }
    return X[i];
}

// acc(m) += X(m, 4c..4c+3) . w for every X row m < GM (c: vec4 column relative to X(0, 0)).
fn gemv_rows(c: u32, w: vec4<f32>) {
    let i = P.x_base + c;
    let s = P.x_sm;
    acc_a.x += dot(gemv_x(i), w);
    if (GM > 1u) { acc_a.y += dot(gemv_x(i + s), w); }
    if (GM > 2u) { acc_a.z += dot(gemv_x(i + 2u * s), w); }
    if (GM > 3u) { acc_a.w += dot(gemv_x(i + 3u * s), w); }
    if (GM > 4u) { acc_b.x += dot(gemv_x(i + 4u * s), w); }
    if (GM > 5u) { acc_b.y += dot(gemv_x(i + 5u * s), w); }
    if (GM > 6u) { acc_b.z += dot(gemv_x(i + 6u * s), w); }
    if (GM > 7u) { acc_b.w += dot(gemv_x(i + 7u * s), w); }
}

// Units u0 and (when has1) u1 of a weight row, each a quarter of block u / 4 (8 values: q4 qs word
// u % 4's low and high nibbles, q8_0 qs words 2 (u % 4) and + 1), times X's matching columns.
// Every load of both comes before any math, so a lane has two units' bytes in flight at once
// (u1's loads read u0's bytes when there is no second unit). Lanes of one row take consecutive
// units, so a warp reads consecutive weight bytes and X's columns as 16-byte runs.
fn gemv_pair(row_a: u32, u0: u32, has1: bool, u1_: u32) {
    let u1 = select(u0, u1_, has1);
    let b0 = u0 >> 2u;
    let j0 = u0 & 3u;
    let b1 = u1 >> 2u;
    let j1 = u1 & 3u;
    let a0 = row_a + b0 * q_block_bytes();
    let a1 = row_a + b1 * q_block_bytes();
    let s0 = q_scale(a0);
    let s1 = q_scale(a1);
    if (QT == 2u) {
        let q00 = q_ld32(a0 + 2u + 8u * j0);
        let q01 = q_ld32(a0 + 6u + 8u * j0);
        let q10 = q_ld32(a1 + 2u + 8u * j1);
        let q11 = q_ld32(a1 + 6u + 8u * j1);
        gemv_rows(8u * b0 + 2u * j0, q8_vals(q00, s0));
        gemv_rows(8u * b0 + 2u * j0 + 1u, q8_vals(q01, s0));
        if (has1) {
            gemv_rows(8u * b1 + 2u * j1, q8_vals(q10, s1));
            gemv_rows(8u * b1 + 2u * j1 + 1u, q8_vals(q11, s1));
        }
        return;
    }
    let off = select(2u, 4u, QT == 1u);
    let q0 = q_ld32(a0 + off + 4u * j0);
    let q1 = q_ld32(a1 + off + 4u * j1);
    gemv_rows(8u * b0 + j0, q4_lo(q0, s0));
    gemv_rows(8u * b0 + 4u + j0, q4_hi(q0, s0));
    if (has1) {
        gemv_rows(8u * b1 + j1, q4_lo(q1, s1));
        gemv_rows(8u * b1 + 4u + j1, q4_hi(q1, s1));
    }
}

// Unit u's contribution (a quarter block: its scale and q words already loaded).
fn gemv_unit(u: u32, s: vec2<f32>, qa: u32, qb: u32) {
    let b = u >> 2u;
    let j = u & 3u;
    if (QT == 2u) {
        gemv_rows(8u * b + 2u * j, q8_vals(qa, s));
        gemv_rows(8u * b + 2u * j + 1u, q8_vals(qb, s));
        return;
    }
    gemv_rows(8u * b + j, q4_lo(qa, s));
    gemv_rows(8u * b + 4u + j, q4_hi(qa, s));
}

// The raw words of one unit (a quarter block) of a weight row, loaded but not yet used: its block's
// scale word and the q word(s) as the (one or two) aligned words holding them. Decoding waits for
// unit_math, so a lane can issue the loads of a whole trip (or of the first trip before a prologue:
// gemv_start) and use none of them until they are needed: every load of a trip is in flight at
// once and the next trip's loads go out before this trip's math.
struct UnitW {
    s: u32,    // the word holding the scale(s): q4_1's d|m, q4_0's / q8_0's d in its half (a & 2)
    a0: u32,   // q word (q8_0: the first of two): the word at its byte, and the next one when that
    a1: u32,   // byte is 2 mod 4 (q4_0 / q8_0 blocks are 2-byte aligned); q4_1 needs one word
    b0: u32,   // q8_0's second q word, the same way
    b1: u32,
}

fn unit_load(row_a: u32, u: u32, slot: u32) -> UnitW {
    let a = row_a + (u >> 2u) * q_block_bytes();
    let j = u & 3u;
    if (QT == 1u) {
        return UnitW(q_word_in(slot, a >> 2u), q_word_in(slot, (a >> 2u) + 1u + j), 0u, 0u, 0u);
    }
    let ea = a + 2u + select(4u, 8u, QT == 2u) * j;
    let ia = ea >> 2u;
    let oa = select(0u, 1u, (ea & 2u) != 0u);
    if (QT == 2u) {
        // q8_0's 8 bytes lie in words ia..ia + 1 + oa: three loads, the middle word serving as
        // both the first q word's upper half (a1, used where oa is 1) and the second's start (b0).
        let w1 = q_word_in(slot, ia + 1u);
        return UnitW(q_word_in(slot, a >> 2u), q_word_in(slot, ia), w1, w1, q_word_in(slot, ia + 1u + oa));
    }
    return UnitW(q_word_in(slot, a >> 2u), q_word_in(slot, ia), q_word_in(slot, ia + oa), 0u, 0u);
}

// Unit u's contribution from its raw words (unit_load's).
fn unit_math(row_a: u32, u: u32, w: UnitW) {
    let a = row_a + (u >> 2u) * q_block_bytes();
    var s: vec2<f32>;
    if (QT == 1u) {
        s = unpack2x16float(w.s);
        gemv_unit(u, s, w.a0, 0u);
        return;
    }
    let d = unpack2x16float((w.s >> ((a & 2u) * 8u)) & 0xffffu).x;
    s = vec2<f32>(d, select(0.0, -8.0 * d, QT == 0u));
    let odd = (a & 2u) == 0u;   // the q words start at a + 2 (+ 4 or 8 j): 2 mod 4 where a is aligned
    gemv_unit(u, s, select(w.a0, (w.a0 >> 16u) | (w.a1 << 16u), odd), select(w.b0, (w.b0 >> 16u) | (w.b1 << 16u), odd));
}

// The trip in flight: units u, u + TPR, u + 2 TPR and (UPL 4) u + 3 TPR of a weight row (UPL 3 or
// 4; units past the row load unit u again and add nothing). quad_load fills it from binding `slot`,
// quad_math uses a copy of it.
var<private> tw0: UnitW;
var<private> tw1: UnitW;
var<private> tw2: UnitW;
var<private> tw3: UnitW;
var<private> tw_ready: bool;   // gemv_start loaded the first trip already

fn quad_load(row_a: u32, u: u32, units: u32, slot: u32) {
    tw0 = unit_load(row_a, u, slot);
    tw1 = unit_load(row_a, select(u, u + TPR, u + TPR < units), slot);
    tw2 = unit_load(row_a, select(u, u + 2u * TPR, u + 2u * TPR < units), slot);
    if (UPL == 4u) {
        tw3 = unit_load(row_a, select(u, u + 3u * TPR, u + 3u * TPR < units), slot);
    }
}

fn quad_math(row_a: u32, u: u32, units: u32, w0: UnitW, w1: UnitW, w2: UnitW, w3: UnitW) {
    unit_math(row_a, u, w0);
    if (u + TPR < units) { unit_math(row_a, u + TPR, w1); }
    if (u + 2u * TPR < units) { unit_math(row_a, u + 2u * TPR, w2); }
    if (UPL == 4u && u + 3u * TPR < units) { unit_math(row_a, u + 3u * TPR, w3); }
}

// The first trip's loads of weight row `row_a` (UPL 3 / 4: the subgroup module), issued by the entry
// points with a prologue (qgemv_cat_norm's and qgemv_rope's norm, qgemv_attn's merge) before it, so
// that the weights' latency runs under the prologue's (measured against loading them after it in
// docs/NOTES.md); gemv_row then starts from them. Only for a row that exists.
fn gemv_start(row_a: u32, lane: u32) {
    if (CAT == 0u) {
        gemv_start_in(row_a, lane, q_slot);
    } else if (q_slot == 0u) {
        gemv_start_in(row_a, lane, 0u);
    } else if (q_slot == 1u) {
        gemv_start_in(row_a, lane, 1u);
    } else {
        gemv_start_in(row_a, lane, 2u);
    }
}

fn gemv_start_in(row_a: u32, lane: u32, slot: u32) {
    if (UPL >= 3u && lane < 4u * P.nb) {
        quad_load(row_a, lane, 4u * P.nb, slot);
        tw_ready = true;
    }
}

// acc_a / acc_b = the dot products of weight row `row_a` (byte offset) with the GM rows of X, this
// lane's share (lanes of a row take consecutive units), UPL units per lane and trip; the weight's
// binding (q_slot, uniform over a subgroup) picks one of three calls with a literal slot.
fn gemv_row(row_a: u32, lane: u32) {
    if (CAT == 0u) {
        gemv_row_in(row_a, lane, q_slot);
    } else if (q_slot == 0u) {
        gemv_row_in(row_a, lane, 0u);
    } else if (q_slot == 1u) {
        gemv_row_in(row_a, lane, 1u);
    } else {
        gemv_row_in(row_a, lane, 2u);
    }
}

fn gemv_row_in(row_a: u32, lane: u32, slot: u32) {
    let units = 4u * P.nb;
    if (UPL >= 3u) {
        if (!tw_ready && lane < units) {
            quad_load(row_a, lane, units, slot);
        }
        for (var u = lane; u < units; u += UPL * TPR) {
            let w0 = tw0;
            let w1 = tw1;
            let w2 = tw2;
            let w3 = tw3;
            if (u + UPL * TPR < units) {
                quad_load(row_a, u + UPL * TPR, units, slot);
            }
            quad_math(row_a, u, units, w0, w1, w2, w3);
        }
        return;
    }
    for (var u = lane; u < units; u += 2u * TPR) {
        gemv_pair(row_a, u, u + TPR < units, u + TPR);
    }
}

// RPT 2: weight rows ra and rb (byte offsets; rb may repeat ra where the second row does not exist)
// of one trip each (units <= UPL TPR, GM <= 4: ops_quant.py's rule), every load of both issued
// before either's math, so a lane has twice the bytes in flight; rb's sums go to acc_b (free at
// GM <= 4), ra's to acc_a, each in the order gemv_row adds them.
fn gemv_two(ra: u32, rb: u32, lane: u32) {
    let units = 4u * P.nb;
    if (lane >= units) {
        return;
    }
    quad_load(rb, lane, units, 0u);
    let b0 = tw0;
    let b1 = tw1;
    let b2 = tw2;
    let b3 = tw3;
    quad_load(ra, lane, units, 0u);
    quad_math(rb, lane, units, b0, b1, b2, b3);
    acc_b = acc_a;
    acc_a = vec4<f32>(0.0);
    quad_math(ra, lane, units, tw0, tw1, tw2, tw3);
}

@compute @workgroup_size(TPR, ROWS)
fn qgemv(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
           @builtin(num_workgroups) nwg: vec3<u32>) {
    qg_main(lid, wid, nwg);
}

// ------------------------------------------------------------------------------------------ qgemv_attn
// qgemv whose X rows are the split-key attention's output, merged from attn_flash's partials
// (attention_flash.wgsl: outputs [rows][nc][Dv], then (maximum, exp-sum) pairs [rows][nc][2], bound
// at X) by every workgroup into hs4 first: the planner's sdpa_linear group (core/plan/fusion.py),
// one dispatch instead of attn_flash_combine's and the product's. Attention row r = (b H + h) T + t
// is X row b T + t, columns h Dv.. (T or H is 1). Each thread merges a (row, column quad) over the
// row's chunks in order, online (attn_flash_combine's flash_merge: a part that kept nothing changes
// nothing, a NaN maximum makes the row NaN, a row with nothing kept gives zeros), the loads of eight
// chunks issued before their merges.

fn ar_rows() -> u32 { return P.rk_d; }
fn ar_nc() -> u32 { return P.rk_t; }
fn ar_dv4() -> u32 { return P.rk_s; }
fn ar_heads() -> u32 { return P.rk_cos; }
fn ar_tq() -> u32 { return P.rk_sin; }
fn ar_base() -> u32 { return P.rk_pos; }
fn ar_hdr() -> u32 { return P.rk_dst0; }

// Word w of the partials (from their first vec4 in X).
fn ar_word(w: u32) -> f32 {
    let i = 4u * ar_base() + w;
    return X[i / 4u][i % 4u];
}

// Weight of a part with maximum m against the merged maximum mx (0 for a part that kept nothing).
fn ar_weight(m: f32, mx: f32) -> f32 {
    if (m == neg_inf()) {
        return 0.0;
    }
    return exp_f(m - mx);
}

// Merge part (mc, lc, oc) into the running (m, l, o), both rescaled to the larger maximum.
fn ar_merge(m: ptr<function, f32>, l: ptr<function, f32>, o: ptr<function, vec4<f32>>, mc: f32, lc: f32,
            oc: vec4<f32>) {
    if (ne_f(mc, neg_inf())) {
        let mn = nmax(*m, mc);
        let a = ar_weight(*m, mn);
        let b = exp_f(mc - mn);
        *l = *l * a + lc * b;
        *o = *o * a + oc * b;
        *m = mn;
    }
}

// Part c of partial row pr: (maximum, exp-sum) and output quad dq; a part past nc keeps nothing.
fn ar_part(pr: u32, c: u32, dq: u32, m: ptr<function, f32>, l: ptr<function, f32>, o: ptr<function, vec4<f32>>) {
    *m = neg_inf();
    *l = 0.0;
    *o = vec4<f32>(0.0);
    if (c < ar_nc()) {
        let e = pr * ar_nc() + c;
        *m = ar_word(ar_hdr() + 2u * e);
        *l = ar_word(ar_hdr() + 2u * e + 1u);
        *o = X[ar_base() + e * ar_dv4() + dq];
    }
}

// hs4 = the merged attention rows, over the workgroup's nt threads from li. Called in uniform
// control flow (its last barrier orders the stores before the product reads them).
fn ar_prologue(li: u32, nt: u32) {
    let nc = ar_nc();
    let dv4 = ar_dv4();
    let H = ar_heads();
    let T = ar_tq();
    let K4 = P.K / 4u;
    for (var e = li; e < ar_rows() * dv4; e += nt) {
        let r = e / dv4;
        let dq = e % dv4;
        var m = neg_inf();
        var l = 0.0;
        var o = vec4<f32>(0.0);
        for (var c = 0u; c < nc; c += 8u) {
            // Eight chunks' loads (a 256-row cache in 32-key chunks: all of them) before their merges.
            var m0: f32; var l0: f32; var o0: vec4<f32>;
            var m1: f32; var l1: f32; var o1: vec4<f32>;
            var m2: f32; var l2: f32; var o2: vec4<f32>;
            var m3: f32; var l3: f32; var o3: vec4<f32>;
            var m4: f32; var l4: f32; var o4: vec4<f32>;
            var m5: f32; var l5: f32; var o5: vec4<f32>;
            var m6: f32; var l6: f32; var o6: vec4<f32>;
            var m7: f32; var l7: f32; var o7: vec4<f32>;
            ar_part(r, c, dq, &m0, &l0, &o0);
            ar_part(r, c + 1u, dq, &m1, &l1, &o1);
            ar_part(r, c + 2u, dq, &m2, &l2, &o2);
            ar_part(r, c + 3u, dq, &m3, &l3, &o3);
            ar_part(r, c + 4u, dq, &m4, &l4, &o4);
            ar_part(r, c + 5u, dq, &m5, &l5, &o5);
            ar_part(r, c + 6u, dq, &m6, &l6, &o6);
            ar_part(r, c + 7u, dq, &m7, &l7, &o7);
            ar_merge(&m, &l, &o, m0, l0, o0);
            ar_merge(&m, &l, &o, m1, l1, o1);
            ar_merge(&m, &l, &o, m2, l2, o2);
            ar_merge(&m, &l, &o, m3, l3, o3);
            ar_merge(&m, &l, &o, m4, l4, o4);
            ar_merge(&m, &l, &o, m5, l5, o5);
            ar_merge(&m, &l, &o, m6, l6, o6);
            ar_merge(&m, &l, &o, m7, l7, o7);
        }
        var res = o / l;
        if (l == 0.0) {   // every chunk kept nothing (a NaN maximum makes l NaN instead): zeros, as torch
            res = vec4<f32>(0.0);
        }
        let b = r / (H * T);
        hs4[(b * T + r % T) * K4 + ((r / T) % H) * dv4 + dq] = res;
    }
    workgroupBarrier();
}

@compute @workgroup_size(TPR, ROWS)
fn qgemv_attn(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
              @builtin(num_workgroups) nwg: vec3<u32>) {
    let n = qg_row0(wid, nwg) + lid.y;
    if (n < P.n_hi) {
        gemv_start(qg_addr(n), lid.x);
    }
    ar_prologue(lid.y * TPR + lid.x, TPR * ROWS);
    qg_main(lid, wid, nwg);
}

// qgemv's first weight row of a workgroup, and the byte offset of weight row n.
fn qg_row0(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return P.n_lo + (wid.x + wid.y * nwg.x) * ROWS * RPT;
}

fn qg_addr(n: u32) -> u32 {
    return P.w_base + (n - P.n_lo) * P.nb * q_block_bytes();
}

// qgemv's product: ROWS weight rows per workgroup against X (or hs4).
fn qg_main(lid: vec3<u32>, wid: vec3<u32>, nwg: vec3<u32>) {
    let lane = lid.x;
    let r = lid.y;
    let row0 = qg_row0(wid, nwg);
    let n = row0 + r;
    acc_a = vec4<f32>(0.0);
    acc_b = vec4<f32>(0.0);
    if (RPT == 2u) {
        // thread row r takes rows row0 + r and row0 + ROWS + r
        let n2 = row0 + ROWS + r;
        if (n < P.n_hi) {
            gemv_two(qg_addr(n), qg_addr(select(n, n2, n2 < P.n_hi)), lane);
        }
    } else if (n < P.n_hi) {
        gemv_row(qg_addr(n), lane);
    }
    gemv_reduce(r, lane);
    qg_store(r, lane, row0);
}

// The workgroup's outputs (weight rows row0.., every X row) after gemv_reduce: row rr's sums are
// thread row rr % ROWS's, its X row m in component m (first row) or m + 4 (RPT 2's second).
fn qg_store(r: u32, lane: u32, row0: u32) {
    for (var o = r * TPR + lane; o < RPT * ROWS * GM; o += TPR * ROWS) {
        let rr = o / GM;
        let m = o % GM;
        if (row0 + rr < P.n_hi) {
            q_store(m, row0 + rr, gemv_sum(rr % ROWS, m + 4u * (rr / ROWS)));
        }
    }
}

// Weight p's binding (0 W, 1 OUT1, 2 OUT2) and the byte offset of its row 0 there.
fn cat_slot(p: u32) -> u32 {
    return (P.w_slots >> (2u * p)) & 3u;
}

fn cat_base(p: u32) -> u32 {
    if (p == 1u) {
        return P.w_base1;
    }
    if (p == 2u) {
        return P.w_base2;
    }
    return P.w_base;
}

@compute @workgroup_size(TPR, ROWS)
fn qgemv_cat(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
             @builtin(num_workgroups) nwg: vec3<u32>) {
    qc_main(lid, wid, nwg);
}

// Vec4 c of row m: src (+ y, stored to s by the `first` workgroup), into hs4; returns its squares'
// sum.
fn qn_pre(m: u32, c: u32, first: bool) -> f32 {
    let i = m * (P.K / 4u) + c;
    var v: vec4<f32>;
    if (RK) {
        v = rk_vec4(P.c_base1 + 4u * i);
    } else {
        v = X[P.c_base1 + i];
    }
    if (NORM == 2u) {
        let e = 4u * i;
        if (RK) {
            v += rk_vec4(P.r_base + e);
        } else {
            v += vec4<f32>(R[P.r_base + e], R[P.r_base + e + 1u], R[P.r_base + e + 2u], R[P.r_base + e + 3u]);
        }
        if (first) {
            let sb = P.c_base2 + e;
            S[sb] = bitcast<u32>(v.x);
            S[sb + 1u] = bitcast<u32>(v.y);
            S[sb + 2u] = bitcast<u32>(v.z);
            S[sb + 3u] = bitcast<u32>(v.w);
        }
    }
    hs4[i] = v;
    return dot(v, v);
}

// The norm prologue's sums of squares so far: X rows 0..3 in sq_a, 4..7 in sq_b (qn_column adds to them).
var<private> sq_a: vec4<f32>;
var<private> sq_b: vec4<f32>;

// Vec4 column c of every X row through qn_pre, its squares added to sq_a / sq_b (both modules'
// qn_prologue loop over their columns with it).
fn qn_column(c: u32, first: bool) {
    sq_a.x += qn_pre(0u, c, first);
    if (GM > 1u) { sq_a.y += qn_pre(1u, c, first); }
    if (GM > 2u) { sq_a.z += qn_pre(2u, c, first); }
    if (GM > 3u) { sq_a.w += qn_pre(3u, c, first); }
    if (GM > 4u) { sq_b.x += qn_pre(4u, c, first); }
    if (GM > 5u) { sq_b.y += qn_pre(5u, c, first); }
    if (GM > 6u) { sq_b.z += qn_pre(6u, c, first); }
    if (GM > 7u) { sq_b.w += qn_pre(7u, c, first); }
}

@compute @workgroup_size(TPR, ROWS)
fn qgemv_cat_norm(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
                  @builtin(num_workgroups) nwg: vec3<u32>) {
    let g = wid.x + wid.y * nwg.x;
    let at = qc_place(lid.y, g);
    if (at.ok) {
        gemv_start(at.row_a, lid.x);
    }
    qn_prologue(lid.y * TPR + lid.x, wid.x == 0u && wid.y == 0u);
    qc_main(lid, wid, nwg);
}

// Where thread row r of qgemv_cat's workgroup g works (q_slot is set to its weight's binding):
// its weight row's byte offset (ok: the row exists); CAT 1 also its weight's first workgroup row
// (row0), its columns' base in OUT's row (colbase) and the weight's rows (np).
struct QcPlace {
    row_a: u32,
    ok: bool,
    row0: u32,
    colbase: u32,
    np: u32,
}

fn qc_place(r: u32, g: u32) -> QcPlace {
    let rb = P.nb * q_block_bytes();
    if (CAT == 2u) {
        // columns g ROWS/2 ..: thread row r takes column r / 2's gate (even r) or up (odd r) row
        let col0 = g * (ROWS / 2u);
        let p = select(P.g_part, P.u_part, (r & 1u) == 1u);
        q_slot = cat_slot(p);
        return QcPlace(cat_base(p) + (col0 + r / 2u) * rb, col0 + r / 2u < P.n_hi, col0, 0u, 0u);
    }
    // CAT 1: weight p has ceil(n_p / ROWS) workgroups, in weight order; columns of weight p
    // follow those of the weights before it
    let g0 = (P.n0 + ROWS - 1u) / ROWS;
    let g1 = (P.n1 + ROWS - 1u) / ROWS;
    var p = 0u;
    var first = g;
    var colbase = 0u;
    var np = P.n0;
    if (g >= g0 + g1) {
        p = 2u;
        first = g - g0 - g1;
        colbase = P.n0 + P.n1;
        np = P.n_hi - P.n0 - P.n1;
    } else if (g >= g0) {
        p = 1u;
        first = g - g0;
        colbase = P.n0;
        np = P.n1;
    }
    let row0 = first * ROWS;
    q_slot = cat_slot(p);
    return QcPlace(cat_base(p) + (row0 + r) * rb, row0 + r < np, row0, colbase, np);
}

// The product of qgemv_cat (X from its binding, or from hs4 after qgemv_cat_norm's prologue).
fn qc_main(lid: vec3<u32>, wid: vec3<u32>, nwg: vec3<u32>) {
    let lane = lid.x;
    let r = lid.y;
    let g = wid.x + wid.y * nwg.x;
    let at = qc_place(r, g);
    acc_a = vec4<f32>(0.0);
    acc_b = vec4<f32>(0.0);
    if (at.ok) {
        gemv_row(at.row_a, lane);
    }
    gemv_reduce(r, lane);
    if (CAT == 2u) {
        let col0 = at.row0;
        for (var o = r * TPR + lane; o < (ROWS / 2u) * GM; o += TPR * ROWS) {
            let c = o / GM;
            let m = o % GM;
            if (col0 + c < P.n_hi) {
                let a = gemv_sum(2u * c, m);
                OUT[P.c_base0 + m * P.c_sm + col0 + c] = bitcast<u32>(a * sigmoid_f(a) * gemv_sum(2u * c + 1u, m));
            }
        }
        return;
    }
    let row0 = at.row0;
    for (var o = r * TPR + lane; o < ROWS * GM; o += TPR * ROWS) {
        let rr = o / GM;
        let m = o % GM;
        if (row0 + rr < at.np) {
            OUT[P.c_base0 + m * P.c_sm + at.colbase + row0 + rr] = bitcast<u32>(gemv_sum(rr, m));
        }
    }
}

// ------------------------------------------------------------------------------------------ qgemv_rope
// qgemv_cat_norm (CAT 1 over q, k, v) whose epilogue is the planner's rope_kv group: one dispatch
// for the norm, the three products, q's and k's rotation and the cache writes (rope_kv's own
// dispatch otherwise). Weight p's rows are the H_p heads of D values of its job ([B, H_p, T, D],
// X row m = b T + t). Thread rows pair row h D + i (even r) with row h D + i + D/2 (odd r) of one
// head, as CAT 2 pairs gate and up rows, so a workgroup holds both values of each rotation it
// owns: ROWS / 2 pairs per workgroup, each weight ceil(N_p / ROWS) workgroups in weight order.
// Stores rotate the pair when weight p's rope bit is set (fused.wgsl rk_pair's arithmetic) and
// write rows t of the contiguous destination or rows clamp(pos, 0, S - T) + t of the cache
// (rope_kv's clamp), all in S.

fn rk_f(i: u32) -> f32 {
    return bitcast<f32>(S[i]);
}

fn rk_vec4(i: u32) -> vec4<f32> {
    return vec4<f32>(rk_f(i), rk_f(i + 1u), rk_f(i + 2u), rk_f(i + 3u));
}

@compute @workgroup_size(TPR, ROWS)
fn qgemv_rope(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
              @builtin(num_workgroups) nwg: vec3<u32>) {
    let lane = lid.x;
    let r = lid.y;
    let g = wid.x + wid.y * nwg.x;
    let hp = ROWS / 2u;
    let D = P.rk_d;
    let half = D / 2u;
    let g0 = (P.n0 / 2u + hp - 1u) / hp;
    let g1 = (P.n1 / 2u + hp - 1u) / hp;
    var p = 0u;
    var first = g;
    var np = P.n0;
    var dst = P.rk_dst0;
    if (g >= g0 + g1) {
        p = 2u;
        first = g - g0 - g1;
        np = P.n_hi - P.n0 - P.n1;
        dst = P.rk_dst2;
    } else if (g >= g0) {
        p = 1u;
        first = g - g0;
        np = P.n1;
        dst = P.rk_dst1;
    }
    let pairs = np / 2u;
    let q = first * hp + r / 2u;
    q_slot = cat_slot(p);
    let row_a = cat_base(p) + ((q / half) * D + q % half + select(0u, half, (r & 1u) == 1u)) * P.nb * q_block_bytes();
    if (q < pairs) {
        gemv_start(row_a, lane);
    }
    qn_prologue(lid.y * TPR + lid.x, wid.x == 0u && wid.y == 0u);
    acc_a = vec4<f32>(0.0);
    acc_b = vec4<f32>(0.0);
    if (q < pairs) {
        gemv_row(row_a, lane);
    }
    gemv_reduce(r, lane);
    let cache = ((P.rk_flags >> (2u * p)) & 1u) != 0u;
    let rope = ((P.rk_flags >> (2u * p + 1u)) & 1u) != 0u;
    let T = P.rk_t;
    let H = np / D;
    var rows = T;   // rows of a head in the destination, and the first one written
    var at = 0u;
    if (cache) {
        rows = P.rk_s;
        at = u32(clamp(bitcast<i32>(S[P.rk_pos]), 0, i32(P.rk_s) - i32(T)));
    }
    for (var o = r * TPR + lane; o < hp * GM; o += TPR * ROWS) {
        let c = o / GM;
        let m = o % GM;
        let qq = first * hp + c;
        if (qq < pairs) {
            let h = qq / half;
            let i = qq % half;
            let a = gemv_sum(2u * c, m);
            let b = gemv_sum(2u * c + 1u, m);
            let t = m % T;
            var y = vec2<f32>(a, b);
            if (rope) {
                let cb = P.rk_cos + t * D;
                let sb = P.rk_sin + t * D;
                y = vec2<f32>(a * rk_f(cb + i) - b * rk_f(sb + i), b * rk_f(cb + i + half) + a * rk_f(sb + i + half));
            }
            let db = dst + (((m / T) * H + h) * rows + at + t) * D + i;
            S[db] = bitcast<u32>(y.x);
            S[db + half] = bitcast<u32>(y.y);
        }
    }
}

// ------------------------------------------------------------------------------------------ qmm

var<workgroup> As: array<vec4<f32>, 32u * WY>;   // X tile [k 0..31][4 WY / 4]: As[k WY + i] = rows 4i..4i+3 at k
var<workgroup> Bs: array<vec4<f32>, 32u * WX>;   // weight tile [k 0..31][4 WX / 4], dequantized

@compute @workgroup_size(WX, WY)
fn qmm(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let tx = lid.x;
    let ty = lid.y;
    let li = ty * WX + tx;
    let nt = WX * WY;
    let bm = 4u * WY;
    let bn = 4u * WX;
    let m0 = wid.y * bm;
    let n0 = P.n_lo + wid.x * bn;
    let qb = q_block_bytes();
    // Split-K: this workgroup's blocks b0..b1-1.
    let per = (P.nb + KSPLIT - 1u) / KSPLIT;
    let b0 = min(P.nb, wid.z * per);
    let b1 = min(P.nb, b0 + per);
    var c0 = vec4<f32>(0.0);
    var c1 = vec4<f32>(0.0);
    var c2 = vec4<f32>(0.0);
    var c3 = vec4<f32>(0.0);
    for (var b = b0; b < b1; b++) {
        // X(m0 + m, 32b + 4q..4q+3), m fastest across threads: their transposed stores into As
        // are consecutive words (no bank conflicts).
        for (var i = li; i < bm * 8u; i += nt) {
            let m = i % bm;
            let q = i / bm;
            var v = vec4<f32>(0.0);
            if (m0 + m < P.M) {
                v = X[P.x_base + (m0 + m) * P.x_sm + 8u * b + q];
            }
            let at = 4u * q * WY + m / 4u;
            let comp = m % 4u;
            As[at][comp] = v.x;
            As[at + WY][comp] = v.y;
            As[at + 2u * WY][comp] = v.z;
            As[at + 3u * WY][comp] = v.w;
        }
        // Weight row n0 + n's block b, a quarter (8 values) per thread, n fastest.
        for (var u = li; u < bn * 4u; u += nt) {
            let n = u % bn;
            let j = u / bn;
            var part = QPart(vec4<f32>(0.0), vec4<f32>(0.0));
            if (n0 + n < P.n_hi) {
                part = q_part(P.w_base + ((n0 + n - P.n_lo) * P.nb + b) * qb, j);
            }
            let col = n / 4u;
            let comp = n % 4u;
            let lo = q_klo(j) * WX + col;
            let hi = q_khi(j) * WX + col;
            Bs[lo][comp] = part.lo.x;
            Bs[lo + WX][comp] = part.lo.y;
            Bs[lo + 2u * WX][comp] = part.lo.z;
            Bs[lo + 3u * WX][comp] = part.lo.w;
            Bs[hi][comp] = part.hi.x;
            Bs[hi + WX][comp] = part.hi.y;
            Bs[hi + 2u * WX][comp] = part.hi.z;
            Bs[hi + 3u * WX][comp] = part.hi.w;
        }
        workgroupBarrier();
        for (var k = 0u; k < 32u; k++) {
            let a = As[k * WY + ty];
            let w = Bs[k * WX + tx];
            c0 += a.x * w;
            c1 += a.y * w;
            c2 += a.z * w;
            c3 += a.w * w;
        }
        workgroupBarrier();
    }
    let m = m0 + 4u * ty;
    let n = n0 + 4u * tx;
    qmm_store(wid.z, m, n, c0);
    qmm_store(wid.z, m + 1u, n, c1);
    qmm_store(wid.z, m + 2u, n, c2);
    qmm_store(wid.z, m + 3u, n, c3);
}

// OUT(m, n..n+3) = v, the columns inside this call's weight rows; with KSPLIT > 1 the raw partial
// sums of split z instead, into OUT laid out [KSPLIT][M][n_hi - n_lo] (a scratch: qmm_sum reads it).
fn qmm_store(z: u32, m: u32, n: u32, v: vec4<f32>) {
    if (m >= P.M) {
        return;
    }
    if (KSPLIT > 1u) {
        let cols = P.n_hi - P.n_lo;
        let row = (z * P.M + m) * cols + n - P.n_lo;
        if (n < P.n_hi) { OUT[row] = bitcast<u32>(v.x); }
        if (n + 1u < P.n_hi) { OUT[row + 1u] = bitcast<u32>(v.y); }
        if (n + 2u < P.n_hi) { OUT[row + 2u] = bitcast<u32>(v.z); }
        if (n + 3u < P.n_hi) { OUT[row + 3u] = bitcast<u32>(v.w); }
        return;
    }
    if (n < P.n_hi) { q_store(m, n, v.x); }
    if (n + 1u < P.n_hi) { q_store(m, n + 1u, v.y); }
    if (n + 2u < P.n_hi) { q_store(m, n + 2u, v.z); }
    if (n + 3u < P.n_hi) { q_store(m, n + 3u, v.w); }
}

// Split-K sum: OUT(m, n) = the KSPLIT partials of qmm (bound at binding 2 as X, laid out
// [KSPLIT][M][n_hi - n_lo]), then bias and epilogue; one thread per output of the call.
@compute @workgroup_size(256)
fn qmm_sum(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_id(gid, nwg, 256u);
    let cols = P.n_hi - P.n_lo;
    let total = P.M * cols;
    if (i >= total) {
        return;
    }
    var acc = 0.0;
    for (var z = 0u; z < KSPLIT; z++) {
        let e = z * total + i;
        acc += X[e >> 2u][e & 3u];
    }
    q_store(i / cols, P.n_lo + i % cols, acc);
}

// The norm prologue's last step, shared by both modules' qn_prologue: hs4 (the rows' sums, stored
// by qn_pre) scaled by each row's 1 / rms (ra: rows 0..3, rb: 4..7) and the norm's weight, the
// vec4 columns shared by the workgroup's nt threads from li.
fn qn_scale(li: u32, nt: u32, ra: vec4<f32>, rb: vec4<f32>) {
    let K4 = P.K / 4u;
    for (var c = li; c < K4; c += nt) {
        var w = vec4<f32>(1.0);
        if (HAS_W) {
            let e = P.bias_base + 4u * c;
            w = vec4<f32>(BIASV[e], BIASV[e + 1u], BIASV[e + 2u], BIASV[e + 3u]);
        }
        hs4[c] = hs4[c] * ra.x * w;
        if (GM > 1u) { hs4[K4 + c] = hs4[K4 + c] * ra.y * w; }
        if (GM > 2u) { hs4[2u * K4 + c] = hs4[2u * K4 + c] * ra.z * w; }
        if (GM > 3u) { hs4[3u * K4 + c] = hs4[3u * K4 + c] * ra.w * w; }
        if (GM > 4u) { hs4[4u * K4 + c] = hs4[4u * K4 + c] * rb.x * w; }
        if (GM > 5u) { hs4[5u * K4 + c] = hs4[5u * K4 + c] * rb.y * w; }
        if (GM > 6u) { hs4[6u * K4 + c] = hs4[6u * K4 + c] * rb.z * w; }
        if (GM > 7u) { hs4[7u * K4 + c] = hs4[7u * K4 + c] * rb.w * w; }
    }
}
