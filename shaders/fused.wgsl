// Kernels that carry out several ops of the op set in one dispatch: the WebGPU side of the fusions
// that core/plan/fusion.py `match` finds (the CUDA side is cuda_fused.cu). core/webgpu/ops_fused.py
// lowers a `Fusion` to these entry points; each computes what its unfused ops compute, rounding to
// the storage dtype wherever the unfused chain stores an intermediate.
//
// - `add_rms`   (add_rms_norm): s = x + y (kept: the residual stream goes on), h = rms_norm(s) * w.
//   One workgroup of RWG threads per row of L elements. A thread reads x, y and writes s, h only
//   at its own columns and reads s back only where it wrote it, so s or h may be the very tensor
//   x or y is (X_AT / Y_AT: read it from that output's binding, WebGPU refuses two overlapping
//   writable bindings). float32 arithmetic in the order of norm.wgsl's norm_rows.
// - `silu_mul`  (silu_mul): out = silu(g) * u, g and u rows `gs` / `us` elements apart (the parts
//   of a concatenated gate/up product in one scratch, or plain tensors). Workgroups over
//   (256-column blocks, rows): one row for decode, T rows for a prefill.
// - `rope_kv`   (rope_kv): up to three jobs of one attention layer in one dispatch, one workgroup
//   per (job, batch, head, row t). Job j reads x[b, h, t, d] at src + b*sb + h*sh + t*st + d (the
//   permutes and reshapes between the projection and the rope folded into the strides), rotates
//   it when its rope flag is set (Llama's half rotation, cos/sin [T, D]) and writes either a
//   contiguous [B, H, T, D] tensor or rows clamp(pos, 0, S - T) + t of a [B, H, S, D] cache (the
//   clamp of elementwise.wgsl's kv_update map, so fused and unfused runs write the same rows).
//   Jobs write OUT, B2, B3 (job 0, 1, 2) and read one source binding B4.
// - `gemv_cat`  (gemm_cat, M <= 4 rows: decode): the product of x with up to three weights [N_p, K]
//   (each its own binding, so nothing needs placing back to back), either stored as one
//   concatenated row [N_0 + N_1 + N_2] (EPI 0: the scratch a rope_kv reads) or, for gate/up,
//   out[n] = silu(x . Wg[n]) * (x . Wu[n]) (EPI 1: the whole MLP front in one dispatch). LANES
//   threads split K for each column in 16-byte chunks, then a shared-memory tree.
// - `gemv_cat_norm` (gemm_cat with the planner's norm prologue, `Fusion.norm`): gemv_cat whose x
//   is h = rms_norm(src) * w, or with the add s = x + y before it (NORM 2: workgroup 0 writes s),
//   computed by every workgroup into workgroup memory (HS = GM * K floats) before its products:
//   the add_rms_norm kernel a decoder layer would otherwise run between its products. float32
//   throughout, in the order of `add_rms` (sum of squares per row, then s * rstd * w).
//
// Every entry reads the same uniform, an array of words whose layout the lowering documents per
// entry (core/webgpu/ops_fused.py); the storage slots are named by number for the same reason.

//! include common.wgsl

struct FusedParams {
    w: array<vec4<u32>, 8>,
}

@group(0) @binding(0) var<uniform> P: FusedParams;
@group(0) @binding(2) var<storage, read_write> B2: array<u32>;
@group(0) @binding(3) var<storage, read_write> B3: array<u32>;
@group(0) @binding(4) var<storage, read_write> B4: array<u32>;
@group(0) @binding(5) var<storage, read_write> B5: array<u32>;
@group(0) @binding(6) var<storage, read_write> B6: array<u32>;
@group(0) @binding(7) var<storage, read_write> B7: array<u32>;
@group(0) @binding(8) var<storage, read_write> B8: array<u32>;

override DTX: u32 = 0u;      // dtype of the inputs (x, y / g, u / rope sources)
override DTW: u32 = 0u;      // dtype of the norm weight / rope tables / gemv_cat weights
override HAS_W: bool = false;
override X_AT: u32 = 0u;     // add_rms: x read from 0 its own slot (3), 1 OUT (h), 2 B2 (s)
override Y_AT: u32 = 0u;     // add_rms: y read from 0 its own slot (4), 1 OUT, 2 B2
override G_AT: u32 = 0u;     // silu_mul: g read from 0 its own slot (2), 1 OUT (out is the very tensor)
override U_AT: u32 = 0u;     // silu_mul: u read from 0 its own slot (3), 1 OUT, 2 B2 (g's scratch)
override PAIR: bool = false; // float16 outputs: each thread owns whole words (two adjacent elements)
override RWG: u32 = 64u;     // add_rms: threads per row
override GM: u32 = 1u;       // gemv_cat: rows of x (1..4)
override NP: u32 = 1u;       // gemv_cat: weights (1..3)
override EPI: u32 = 0u;      // gemv_cat: 0 store the concatenated row, 1 silu(part g) * part u
override VEC: bool = false;  // gemv_cat: weights, bases and x in whole 16-byte chunks
override LANES: u32 = 32u;   // gemv_cat: threads per output column (32..256)
override WGS: u32 = 256u;    // gemv_cat: threads per workgroup (WGS / LANES columns)
override NORM: u32 = 0u;     // gemv_cat: 0 x read from B2; gemv_cat_norm: 1 rms_norm prologue, 2 add + rms_norm
override HS: u32 = 4u;       // gemv_cat_norm: floats of the normalized rows in workgroup memory (GM * K)

// Word i of the uniform.
fn pu(i: u32) -> u32 {
    return P.w[i >> 2u][i & 3u];
}

// Element i (dtype dt) of the tensor bound at slot 1..6. One function per slot: an entry point
// statically uses exactly the bindings its functions name (Dawn checks that against the layout).
fn ld1(i: u32, dt: u32) -> f32 { return word_f32(OUT[widx(i, dt)], i, dt); }
fn ld2(i: u32, dt: u32) -> f32 { return word_f32(B2[widx(i, dt)], i, dt); }
fn ld3(i: u32, dt: u32) -> f32 { return word_f32(B3[widx(i, dt)], i, dt); }
fn ld4(i: u32, dt: u32) -> f32 { return word_f32(B4[widx(i, dt)], i, dt); }
fn ld5(i: u32, dt: u32) -> f32 { return word_f32(B5[widx(i, dt)], i, dt); }
fn ld6(i: u32, dt: u32) -> f32 { return word_f32(B6[widx(i, dt)], i, dt); }

// v rounded to float16 and back: the value an unfused op storing float16 hands to the next one.
fn rnd16(v: f32) -> f32 {
    return unpack2x16float(f16_bits(v)).x;
}

fn rnd(v: f32, dt: u32) -> f32 {
    return select(v, rnd16(v), dt == DT_F16);
}

// Store float32 results into slot 1, 2 or 3 as dtype DT_OUT: element i alone (float32), or the
// word holding elements i (even) and i + 1 (PAIR, float16).
fn st_slot(slot: u32, i: u32, v0: f32, v1: f32) {
    if (PAIR) {
        let w = (f16_bits(v1) << 16u) | f16_bits(v0);
        switch slot {
            case 1u: { OUT[i >> 1u] = w; }
            case 2u: { B2[i >> 1u] = w; }
            default: { B3[i >> 1u] = w; }
        }
        return;
    }
    let w = f32_word(v0, DT_OUT);
    switch slot {
        case 1u: { OUT[i] = w; }
        case 2u: { B2[i] = w; }
        default: { B3[i] = w; }
    }
}

// -------------------------------------------------------------------------------------- add_rms
// Uniform: rows, L, x_base, y_base, s_base, h_base, w_base, eps (f32 bits). s has x's dtype (DTX),
// h DT_OUT; PAIR when either is float16 (then L and every base are even: ops_fused.py).

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

fn ar_x(i: u32) -> f32 {
    switch X_AT {
        case 1u: { return ld1(i, DTX); }
        case 2u: { return ld2(i, DTX); }
        default: { return ld3(i, DTX); }
    }
}

fn ar_y(i: u32) -> f32 {
    switch Y_AT {
        case 1u: { return ld1(i, DTX); }
        case 2u: { return ld2(i, DTX); }
        default: { return ld4(i, DTX); }
    }
}

// s[i] (and s[i + 1] with PAIR) = x + y, rounded to s's dtype; returns the sum of their squares.
fn ar_add(i: u32, xb: u32, yb: u32, sb: u32) -> f32 {
    let v0 = rnd(ar_x(xb + i) + ar_y(yb + i), DTX);
    if (PAIR) {
        let v1 = rnd(ar_x(xb + i + 1u) + ar_y(yb + i + 1u), DTX);
        if (DTX == DT_F16) {
            B2[(sb + i) >> 1u] = (f16_bits(v1) << 16u) | f16_bits(v0);
        } else {
            B2[sb + i] = bitcast<u32>(v0);
            B2[sb + i + 1u] = bitcast<u32>(v1);
        }
        return v0 * v0 + v1 * v1;
    }
    B2[sb + i] = f32_word(v0, DTX);
    return v0 * v0;
}

fn ar_w(j: u32) -> f32 {
    if (HAS_W) {
        return ld5(pu(6u) + j, DTW);
    }
    return 1.0;
}

@compute @workgroup_size(RWG)
fn add_rms(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
           @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= pu(0u)) {
        return;
    }
    let L = pu(1u);
    let xb = pu(2u) + row * L;
    let yb = pu(3u) + row * L;
    let sb = pu(4u) + row * L;
    let hb = pu(5u) + row * L;
    let step = select(1u, 2u, PAIR);
    var q = 0.0;
    for (var j = li * step; j < L; j += RWG * step) {
        q += ar_add(j, xb, yb, sb);
    }
    let rstd = 1.0 / sqrt(wg_sum(q, li) / f32(L) + bitcast<f32>(pu(7u)));
    // s is read back only at the columns this thread wrote (its own writes, in program order).
    for (var j = li * step; j < L; j += RWG * step) {
        let v0 = ld2(sb + j, DTX) * rstd * ar_w(j);
        var v1 = 0.0;
        if (PAIR) {
            v1 = ld2(sb + j + 1u, DTX) * rstd * ar_w(j + 1u);
        }
        if (PAIR && DT_OUT != DT_F16) {
            OUT[hb + j] = bitcast<u32>(v0);
            OUT[hb + j + 1u] = bitcast<u32>(v1);
        } else {
            st_slot(1u, hb + j, v0, v1);
        }
    }
}

// -------------------------------------------------------------------------------------- silu_mul
// Uniform: rows, cols, g_base, gs, u_base, us, out_base (out rows are cols apart). g, u: DTX.

fn sm_at(e: u32, r: u32) -> f32 {
    let gi = pu(2u) + r * pu(3u) + e;
    let ui = pu(4u) + r * pu(5u) + e;
    var g = 0.0;
    if (G_AT == 1u) { g = ld1(gi, DTX); } else { g = ld2(gi, DTX); }
    var u = 0.0;
    switch U_AT {
        case 1u: { u = ld1(ui, DTX); }
        case 2u: { u = ld2(ui, DTX); }
        default: { u = ld3(ui, DTX); }
    }
    // The unfused chain stores silu(g) in the output dtype before the product reads it.
    return rnd(g * sigmoid_f(g), DT_OUT) * u;
}

@compute @workgroup_size(256)
fn silu_mul(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = wid.y + wid.z * nwg.y;
    let cols = pu(1u);
    if (r >= pu(0u)) {
        return;
    }
    let ob = pu(6u) + r * cols;
    if (PAIR) {
        let e = 2u * gid.x;
        if (e < cols) {
            st_slot(1u, ob + e, sm_at(e, r), sm_at(e + 1u, r));
        }
        return;
    }
    let e = gid.x;
    if (e < cols) {
        st_slot(1u, ob + e, sm_at(e, r), 0.0);
    }
}

// -------------------------------------------------------------------------------------- rope_kv
// Uniform: T, D, S (cache rows), cos_base, sin_base, pos_base, rows (all jobs), jobs; then job j
// at word 8 + 8j: first row, H, src_base, sb, sh, st, dst_base, flags (1 cache, 2 rope). Sources
// have dtype DTX, tables DTW, destinations DT_OUT. PAIR: float16 destinations, D % 4 == 0.

fn rk_cos(t: u32, d: u32) -> f32 { return ld5(pu(3u) + t * pu(1u) + d, DTW); }
fn rk_sin(t: u32, d: u32) -> f32 { return ld6(pu(4u) + t * pu(1u) + d, DTW); }

// The rotated pair (x[d], x[d + D/2]) of row t, or the pair itself without rope.
fn rk_pair(sb: u32, t: u32, d: u32, half: u32, rope: bool) -> vec2<f32> {
    let a = ld4(sb + d, DTX);
    let c = ld4(sb + d + half, DTX);
    if (!rope) {
        return vec2<f32>(a, c);
    }
    return vec2<f32>(a * rk_cos(t, d) - c * rk_sin(t, d), c * rk_cos(t, d + half) + a * rk_sin(t, d + half));
}

@compute @workgroup_size(64)
fn rope_kv(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
           @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= pu(6u)) {
        return;
    }
    var j = 0u;
    if (pu(7u) > 1u && row >= pu(16u)) { j = 1u; }
    if (pu(7u) > 2u && row >= pu(24u)) { j = 2u; }
    let jb = 8u + 8u * j;
    let T = pu(0u);
    let D = pu(1u);
    let half = D / 2u;
    let r = row - pu(jb);
    let H = pu(jb + 1u);
    let t = r % T;
    let bh = r / T;
    let b = bh / H;
    let h = bh % H;
    let flags = pu(jb + 7u);
    let rope = (flags & 2u) != 0u;
    let sb = pu(jb + 2u) + b * pu(jb + 3u) + h * pu(jb + 4u) + t * pu(jb + 5u);
    var db = pu(jb + 6u) + r * D;
    if ((flags & 1u) != 0u) {
        let p = u32(clamp(bitcast<i32>(B7[pu(5u)]), 0, i32(pu(2u) - T)));
        db = pu(jb + 6u) + (bh * pu(2u) + p + t) * D;
    }
    if (PAIR) {
        for (var i = 2u * li; i < half; i += 128u) {
            let lo = rk_pair(sb, t, i, half, rope);
            let hi = rk_pair(sb, t, i + 1u, half, rope);
            st_slot(j + 1u, db + i, lo.x, hi.x);
            st_slot(j + 1u, db + i + half, lo.y, hi.y);
        }
        return;
    }
    for (var i = li; i < half; i += 64u) {
        let y = rk_pair(sb, t, i, half, rope);
        st_slot(j + 1u, db + i, y.x, 0.0);
        st_slot(j + 1u, db + i + half, y.y, 0.0);
    }
}

// -------------------------------------------------------------------------------------- gemv_cat
// Uniform: K, x_base, x_sm (row stride of x), out_base, out_sm (row stride of the output), N (its
// columns), n0, n1 (columns of weights 0, 1; weight 2 has the rest), w0_base, w1_base, w2_base,
// g_part, u_part (EPI 1: which weights are gate and up; both have N rows). x and the output are
// float32, the weights DTW. A workgroup owns WGS / LANES output columns and every row of x; the
// LANES threads of a column walk its weight row(s) in 16-byte chunks (VEC: rows, bases and x in
// whole chunks; else one element at a time), four chunks per loop trip loaded before any is used
// so a thread has its weight loads in flight together, as matmul's gemv.wgsl does.

var<workgroup> red_a: array<vec4<f32>, WGS>;   // [thread], component m = row m
var<workgroup> red_b: array<vec4<f32>, WGS>;   // EPI 1: the up product
var<workgroup> hs: array<f32, HS>;              // NORM > 0: the normalized rows [GM][K] (x_base 0, x_sm K)

fn gc_x4(i: u32) -> vec4<f32> {
    if (NORM > 0u) {
        return vec4<f32>(hs[i], hs[i + 1u], hs[i + 2u], hs[i + 3u]);
    }
    return bitcast<vec4<f32>>(vec4<u32>(B2[i], B2[i + 1u], B2[i + 2u], B2[i + 3u]));
}

// Words wi..wi+3 of weight p (slots 3, 4, 5).
fn gc_chunk(p: u32, wi: u32) -> vec4<u32> {
    switch p {
        case 0u: { return vec4<u32>(B3[wi], B3[wi + 1u], B3[wi + 2u], B3[wi + 3u]); }
        case 1u: { return vec4<u32>(B4[wi], B4[wi + 1u], B4[wi + 2u], B4[wi + 3u]); }
        default: { return vec4<u32>(B5[wi], B5[wi + 1u], B5[wi + 2u], B5[wi + 3u]); }
    }
}

// Element i of weight p, any alignment.
fn gc_w(p: u32, i: u32) -> f32 {
    switch p {
        case 0u: { return ld3(i, DTW); }
        case 1u: { return ld4(i, DTW); }
        default: { return ld5(i, DTW); }
    }
}

// A weight chunk against x at element xo (4 float32 or 8 float16 weights).
fn gc_dot(xo: u32, q: vec4<u32>) -> f32 {
    if (DTW == DT_F16) {
        return dot(gc_x4(xo), vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)))
            + dot(gc_x4(xo + 4u), vec4<f32>(unpack2x16float(q.z), unpack2x16float(q.w)));
    }
    return dot(gc_x4(xo), bitcast<vec4<f32>>(q));
}

// The chunk against rows 0..GM-1 of x (component m = row m).
fn gc_rows(xo: u32, q: vec4<u32>) -> vec4<f32> {
    var a = vec4<f32>(0.0);
    a.x = gc_dot(xo, q);
    if (GM > 1u) { a.y = gc_dot(xo + pu(2u), q); }
    if (GM > 2u) { a.z = gc_dot(xo + 2u * pu(2u), q); }
    if (GM > 3u) { a.w = gc_dot(xo + 3u * pu(2u), q); }
    return a;
}

// Element k of rows 0..GM-1 of x.
fn gc_x(k: u32) -> vec4<f32> {
    let xb = pu(1u) + k;
    var a = vec4<f32>(0.0);
    if (NORM > 0u) {
        a.x = hs[xb];
        if (GM > 1u) { a.y = hs[xb + pu(2u)]; }
        if (GM > 2u) { a.z = hs[xb + 2u * pu(2u)]; }
        if (GM > 3u) { a.w = hs[xb + 3u * pu(2u)]; }
        return a;
    }
    a.x = bitcast<f32>(B2[xb]);
    if (GM > 1u) { a.y = bitcast<f32>(B2[xb + pu(2u)]); }
    if (GM > 2u) { a.z = bitcast<f32>(B2[xb + 2u * pu(2u)]); }
    if (GM > 3u) { a.w = bitcast<f32>(B2[xb + 3u * pu(2u)]); }
    return a;
}

// x . W_p[row] for rows 0..GM-1, this thread's share (lane of LANES); `row` is the element index
// of the weight row's first element.
fn gc_part(p: u32, row: u32, lane: u32) -> vec4<f32> {
    let K = pu(0u);
    var acc = vec4<f32>(0.0);
    if (!VEC) {
        for (var k = lane; k < K; k += LANES) {
            acc += gc_x(k) * gc_w(p, row + k);
        }
        return acc;
    }
    let ch = select(4u, 8u, DTW == DT_F16);   // elements per 16-byte chunk
    let nch = K / ch;
    let wb = row / (ch / 4u);                 // the row's first word
    for (var c = lane; c < nch; c += 4u * LANES) {
        let u1 = c + LANES < nch;
        let u2 = c + 2u * LANES < nch;
        let u3 = c + 3u * LANES < nch;
        let q0 = gc_chunk(p, wb + 4u * c);
        var q1 = vec4<u32>(0u);
        var q2 = vec4<u32>(0u);
        var q3 = vec4<u32>(0u);
        if (u1) { q1 = gc_chunk(p, wb + 4u * (c + LANES)); }
        if (u2) { q2 = gc_chunk(p, wb + 4u * (c + 2u * LANES)); }
        if (u3) { q3 = gc_chunk(p, wb + 4u * (c + 3u * LANES)); }
        let xo = pu(1u) + c * ch;
        acc += gc_rows(xo, q0);
        if (u1) { acc += gc_rows(xo + LANES * ch, q1); }
        if (u2) { acc += gc_rows(xo + 2u * LANES * ch, q2); }
        if (u3) { acc += gc_rows(xo + 3u * LANES * ch, q3); }
    }
    return acc;
}

@compute @workgroup_size(WGS)
fn gemv_cat(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(num_workgroups) nwg: vec3<u32>) {
    gc_main(li, wid, nwg);
}

// ------------------------------------------------------------------------------- gemv_cat_norm
// Uniform: gemv_cat's words (x_base 0, x_sm K: x is `hs`), then 13 src_base (x of the add, or the
// norm's input), 14 y_base, 15 s_base, 16 w_base, 17 eps (f32 bits). Bindings: B2 src, B6 y,
// B7 the norm weight (HAS_W), B8 s; every row K elements, all float32.

// Element k of row m: src (+ y, stored to s by the `first` workgroup) into hs; returns its square.
fn gn_pre(m: u32, k: u32, first: bool) -> f32 {
    let i = m * pu(0u) + k;
    var v = bitcast<f32>(B2[pu(13u) + i]);
    if (NORM == 2u) {
        v += bitcast<f32>(B6[pu(14u) + i]);
        if (first) {
            B8[pu(15u) + i] = bitcast<u32>(v);
        }
    }
    hs[i] = v;
    return v * v;
}

// hs = rms_norm(src) * w for the GM rows. Called in uniform control flow (it has barriers); its
// last barrier also orders the reads of red_a[0] before gc_main reuses red_a.
fn gn_prologue(li: u32, first: bool) {
    let K = pu(0u);
    var q = vec4<f32>(0.0);
    for (var k = li; k < K; k += WGS) {
        q.x += gn_pre(0u, k, first);
        if (GM > 1u) { q.y += gn_pre(1u, k, first); }
        if (GM > 2u) { q.z += gn_pre(2u, k, first); }
        if (GM > 3u) { q.w += gn_pre(3u, k, first); }
    }
    red_a[li] = q;
    workgroupBarrier();
    for (var s = WGS / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            red_a[li] += red_a[li + s];
        }
        workgroupBarrier();
    }
    let eps = bitcast<f32>(pu(17u));
    let rstd = vec4<f32>(1.0) / sqrt(red_a[0] / f32(K) + vec4<f32>(eps));
    for (var k = li; k < K; k += WGS) {
        var w = 1.0;
        if (HAS_W) {
            w = bitcast<f32>(B7[pu(16u) + k]);
        }
        hs[k] = hs[k] * rstd.x * w;
        if (GM > 1u) { hs[K + k] = hs[K + k] * rstd.y * w; }
        if (GM > 2u) { hs[2u * K + k] = hs[2u * K + k] * rstd.z * w; }
        if (GM > 3u) { hs[3u * K + k] = hs[3u * K + k] * rstd.w * w; }
    }
    workgroupBarrier();
}

@compute @workgroup_size(WGS)
fn gemv_cat_norm(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
                 @builtin(num_workgroups) nwg: vec3<u32>) {
    gn_prologue(li, wid.x == 0u && wid.y == 0u);
    gc_main(li, wid, nwg);
}

// The product of gemv_cat (x from B2, or from hs after gemv_cat_norm's prologue).
fn gc_main(li: u32, wid: vec3<u32>, nwg: vec3<u32>) {
    let lane = li % LANES;
    let n = (wid.x + wid.y * nwg.x) * (WGS / LANES) + li / LANES;
    let K = pu(0u);
    let N = pu(5u);
    var acc = vec4<f32>(0.0);
    var acc_u = vec4<f32>(0.0);
    if (n < N) {
        if (EPI == 1u) {
            acc = gc_part(pu(11u), pu(8u + pu(11u)) + n * K, lane);
            acc_u = gc_part(pu(12u), pu(8u + pu(12u)) + n * K, lane);
        } else {
            // column n of the concatenation: row n - (columns before) of weight p
            var p = 0u;
            var nn = n;
            if (NP > 1u && nn >= pu(6u)) { nn -= pu(6u); p = 1u; }
            if (NP > 2u && p == 1u && nn >= pu(7u)) { nn -= pu(7u); p = 2u; }
            acc = gc_part(p, pu(8u + p) + nn * K, lane);
        }
    }
    red_a[li] = acc;
    if (EPI == 1u) {
        red_b[li] = acc_u;
    }
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            red_a[li] += red_a[li + s];
            if (EPI == 1u) {
                red_b[li] += red_b[li + s];
            }
        }
        workgroupBarrier();
    }
    // thread `lane` m < GM of column n stores row m
    if (lane < GM && n < N) {
        let c0 = li - lane;
        var v = red_a[c0][lane];
        if (EPI == 1u) {
            v = v * sigmoid_f(v) * red_b[c0][lane];
        }
        OUT[pu(3u) + lane * pu(4u) + n] = bitcast<u32>(v);
    }
}
