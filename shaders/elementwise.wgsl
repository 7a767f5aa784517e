// The strided map kernel: out[view] = f(in0[view0], in1[view1], in2[view2]) over a rank <= 8 box.
//
// One entry point serves every op whose output element depends on one element of each input:
// unary/binary arithmetic, comparisons, logical ops, where, cast, and (through strides and base
// offsets chosen by core/kernels.py) copy, permute, expand, slice, one piece of cat, pad (a fill
// then a copy into the interior), the fp16 prepack pack kernel, and kv_update (a copy whose
// destination row comes from the int32 `pos` tensor: the DYN override).
//
// Overrides: OP (the element function, codes in core/kernels.py MAP_OPS), NIN (inputs read),
// DT0..DT2 / DT_OUT (dtype codes), INT_MATH (compute in int32: every input and the output are
// int32/bool), DYN (add clamp(pos, 0, dyn_max) * dyn_stride to the output base).
//
// Threads: for a 32-bit output dtype one thread per EPT consecutive elements of the view's last
// dim (EPT = 4 when that dim's extent is a multiple of 4, else 1: the index arithmetic of
// `offsets`, a division and a remainder per dim, is paid once per EPT elements; a permute moved
// 4x fewer elements per second without it). For float16 output the
// view is cut into rows: maximal runs of row_len consecutive view elements that are contiguous in
// OUT. Each thread owns one word of one row: rows * ppr threads, ppr = row_len / 2 + 1 words per
// row (a row may start on an odd element). Two rows never share a word: runs are maximal, so the
// next one starts at least one element past the end of the previous.

//! include common.wgsl

const MAX_RANK: u32 = 8u;

struct MapParams {
    n: u32,          // elements in the view
    rank: u32,       // dims of the view (1..8)
    rows: u32,       // n / row_len
    ppr: u32,        // float16 output: words per row handled by threads
    row_len: u32,    // elements per row (float16 output)
    out_base: u32,   // element offset of the view in OUT
    base0: u32,      // element offset of the view in IN0 (IN1, IN2)
    base1: u32,
    base2: u32,
    dyn_stride: u32, // DYN: elements of OUT per unit of pos
    dyn_max: u32,    // DYN: pos is clamped to 0..dyn_max
    _pad0: u32,
    fa: f32,         // scalar operands of the op (hardtanh bounds, fill value)
    fb: f32,
    _pad1: f32,
    _pad2: f32,
    shape: array<vec4<u32>, 2>,
    ostr: array<vec4<u32>, 2>,  // element strides of OUT per view dim
    str0: array<vec4<u32>, 2>,
    str1: array<vec4<u32>, 2>,
    str2: array<vec4<u32>, 2>,
}

override OP: u32 = 0u;
override NIN: u32 = 1u;
override DT0: u32 = 0u;
override DT1: u32 = 0u;
override DT2: u32 = 0u;
override INT_MATH: bool = false;
override DYN: bool = false;
override EPT: u32 = 1u;   // 32-bit output: elements per thread along the last dim (1 or 4)

@group(0) @binding(0) var<uniform> P: MapParams;
@group(0) @binding(2) var<storage, read_write> IN0: array<u32>;
@group(0) @binding(3) var<storage, read_write> IN1: array<u32>;
@group(0) @binding(4) var<storage, read_write> IN2: array<u32>;
@group(0) @binding(5) var<storage, read_write> POS: array<u32>;

fn dim_of(a: array<vec4<u32>, 2>, d: u32) -> u32 {
    return a[d >> 2u][d & 3u];
}

// Element offsets (out, in0, in1, in2) of element e of the view (row-major over P.shape).
fn offsets(e: u32) -> vec4<u32> {
    var o = vec4<u32>(P.out_base, P.base0, P.base1, P.base2);
    if (DYN) {
        let p = clamp(bitcast<i32>(POS[0]), 0, i32(P.dyn_max));
        o.x += u32(p) * P.dyn_stride;
    }
    var rem = e;
    for (var k = 0u; k < P.rank; k++) {
        let d = P.rank - 1u - k;
        let sz = dim_of(P.shape, d);
        let c = rem % sz;
        rem = rem / sz;
        o += c * vec4<u32>(dim_of(P.ostr, d), dim_of(P.str0, d), dim_of(P.str1, d), dim_of(P.str2, d));
    }
    return o;
}

fn ldf0(i: u32) -> f32 { return word_f32(IN0[widx(i, DT0)], i, DT0); }
fn ldf1(i: u32) -> f32 { return word_f32(IN1[widx(i, DT1)], i, DT1); }
fn ldf2(i: u32) -> f32 { return word_f32(IN2[widx(i, DT2)], i, DT2); }
fn ldi0(i: u32) -> i32 { return word_i32(IN0[widx(i, DT0)], i, DT0); }
fn ldi1(i: u32) -> i32 { return word_i32(IN1[widx(i, DT1)], i, DT1); }
fn ldi2(i: u32) -> i32 { return word_i32(IN2[widx(i, DT2)], i, DT2); }

fn b2f(c: bool) -> f32 { return select(0.0, 1.0, c); }
fn b2i(c: bool) -> i32 { return select(0, 1, c); }

// The float element function. Codes: see MAP_OPS in core/kernels.py (kept in the same order).
fn map_f(o: vec4<u32>) -> f32 {
    var a = 0.0;
    var b = 0.0;
    if (NIN >= 1u) { a = ldf0(o.y); }
    if (NIN >= 2u) { b = ldf1(o.z); }
    switch OP {
        case 0u: { return a; }                              // copy / cast
        case 1u: { return P.fa; }                           // fill
        case 2u: { return a + b; }
        case 3u: { return a - b; }
        case 4u: { return a * b; }
        case 5u: { return a / b; }
        case 6u: { return pow_f(a, b); }
        case 7u: { return max_n(a, b); }                    // NaN propagates (torch.maximum)
        case 8u: { return min_n(a, b); }
        case 9u: { return b2f(a == b); }
        case 10u: { return b2f(ne_f(a, b)); }              // NaN != anything
        case 11u: { return b2f(a < b); }
        case 12u: { return b2f(a <= b); }
        case 13u: { return b2f(a > b); }
        case 14u: { return b2f(a >= b); }
        case 15u: { return b2f(nz_f(a) && nz_f(b)); }
        case 16u: { return b2f(nz_f(a) || nz_f(b)); }
        case 17u: { return b2f(!nz_f(a)); }                 // logical_not
        case 18u: {                                         // where(in0, in1, in2)
            if (nz_f(a)) { return b; }
            return ldf2(o.w);
        }
        case 19u: { return -a; }
        case 20u: { return abs(a); }
        case 21u: { return exp_f(a); }
        case 22u: { return log_f(a); }
        case 23u: { return sqrt(a); }
        case 24u: { return 1.0 / sqrt(a); }
        case 25u: { return sin(a); }
        case 26u: { return cos(a); }
        case 27u: { return tanh_f(a); }
        case 28u: { return sigmoid_f(a); }
        // relu: NaN stays NaN. Tested on the bits: NVIDIA's compiler turned select(a, 0, a < 0)
        // into max(a, 0), which gives 0 for NaN.
        case 29u: { return select(select(a, 0.0, a < 0.0), a, is_nan(a)); }
        case 30u: { return a * sigmoid_f(a); }
        case 31u: { return erf_f(a); }
        case 32u: { return 1.0 / a; }
        case 33u: { return 0.5 * a * (1.0 + erf_f(a * 0.70710678118654752)); }
        case 34u: {
            let inner = 0.79788456080286536 * (a + 0.044715 * a * a * a);
            return 0.5 * a * (1.0 + tanh_f(inner));
        }
        case 35u: { return clamp_n(a, P.fa, P.fb); }        // hardtanh (NaN stays NaN)
        default: { return a; }
    }
}

// The int32 element function (INT_MATH): exact integer arithmetic for int32/bool operands.
fn ipow(x: i32, y: i32) -> i32 {
    if (y < 0) {
        // torch: 1 / x^|y| truncated
        if (x == 1) { return 1; }
        if (x == -1) { return select(-1, 1, (y & 1) == 0); }
        return 0;
    }
    var r = 1;
    var base = x;
    var e = y;
    loop {
        if (e == 0) { break; }
        if ((e & 1) == 1) { r = r * base; }
        base = base * base;
        e = e >> 1u;
    }
    return r;
}

fn map_i(o: vec4<u32>) -> i32 {
    var a = 0;
    var b = 0;
    if (NIN >= 1u) { a = ldi0(o.y); }
    if (NIN >= 2u) { b = ldi1(o.z); }
    switch OP {
        case 0u: { return a; }
        case 1u: { return i32(P.fa); }
        case 2u: { return a + b; }
        case 3u: { return a - b; }
        case 4u: { return a * b; }
        case 6u: { return ipow(a, b); }
        case 7u: { return max(a, b); }
        case 8u: { return min(a, b); }
        case 9u: { return b2i(a == b); }
        case 10u: { return b2i(a != b); }
        case 11u: { return b2i(a < b); }
        case 12u: { return b2i(a <= b); }
        case 13u: { return b2i(a > b); }
        case 14u: { return b2i(a >= b); }
        case 15u: { return b2i(a != 0 && b != 0); }
        case 16u: { return b2i(a != 0 || b != 0); }
        case 17u: { return b2i(a == 0); }
        case 18u: {
            if (a != 0) { return b; }
            return ldi2(o.w);
        }
        case 19u: { return -a; }
        case 20u: { return abs(a); }
        case 29u: { return max(a, 0); }
        default: { return a; }
    }
}

@compute @workgroup_size(256)
fn map(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_id(gid, nwg, 256u);
    if (DT_OUT == DT_F16) {
        let r = t / P.ppr;
        if (r >= P.rows) {
            return;
        }
        let p = t % P.ppr;
        let e_row = r * P.row_len;
        let rs = offsets(e_row).x;                          // OUT element of the row's first element
        let w = (rs >> 1u) + p;
        let j0 = i32(2u * w) - i32(rs);                     // row position of the word's low half
        let has_lo = j0 >= 0 && j0 < i32(P.row_len);
        let has_hi = j0 + 1 >= 0 && j0 + 1 < i32(P.row_len);
        var lo = 0.0;
        var hi = 0.0;
        if (has_lo) { lo = map_f(offsets(e_row + u32(j0))); }
        if (has_hi) { hi = map_f(offsets(e_row + u32(j0 + 1))); }
        store_pair(w, lo, hi, has_lo, has_hi);
        return;
    }
    if (EPT == 1u) {
        if (t >= P.n) {
            return;
        }
        let o = offsets(t);
        if (INT_MATH) {
            OUT[o.x] = i32_word(map_i(o), DT_OUT);
        } else {
            store_f(o.x, map_f(o));
        }
        return;
    }
    // EPT elements along the last dim (its extent is a multiple of EPT): one offsets() call.
    if (t * EPT >= P.n) {
        return;
    }
    let o0 = offsets(t * EPT);
    let d = P.rank - 1u;
    let step = vec4<u32>(dim_of(P.ostr, d), dim_of(P.str0, d), dim_of(P.str1, d), dim_of(P.str2, d));
    for (var j = 0u; j < EPT; j++) {
        let o = o0 + j * step;
        if (INT_MATH) {
            OUT[o.x] = i32_word(map_i(o), DT_OUT);
        } else {
            store_f(o.x, map_f(o));
        }
    }
}
