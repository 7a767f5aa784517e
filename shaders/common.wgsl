// Prelude shared by every gpudelegate WGSL kernel file: `gpudelegate.shaders.source(name)` pastes it
// where a file says `//! include common.wgsl`. Binding-free helpers, plus the output binding every
// kernel writes (binding 1, `OUT`) and its dtype override `DT_OUT`.
//
// Every storage binding is read_write, also for inputs: WebGPU allows one buffer in several
// writable bindings of a dispatch but not in a read-only and a writable one, and the memory planner
// puts many tensors (an op's inputs and its output among them) at offsets of one buffer.
//
// Storage: every tensor is bound as array<u32> (WGSL storage has no 8/16-bit types without
// optional features). float32 and int32 are one word per element (bitcast), bool is a 32-bit
// 0/1, float16 packs two elements per word (element i is half (i & 1) of word i >> 1) and is
// read/written with unpack2x16float/pack2x16float, so no `shader-f16` feature is needed.
// A thread that writes float16 always writes a whole word: it computes both halves, or reads
// the word back and keeps the half that is not its own (`store_pair`). core/kernels.py arranges
// dispatches so that no two threads of one dispatch own the same word.

const DT_F32: u32 = 0u;
const DT_F16: u32 = 1u;
const DT_I32: u32 = 2u;
const DT_BOOL: u32 = 3u;

override DT_OUT: u32 = 0u;

@group(0) @binding(1) var<storage, read_write> OUT: array<u32>;

// Linear thread id of a 1-D dispatch laid out as a 2-D grid of workgroups (core/kernels.py spills
// past 65535 workgroups into y).
fn linear_id(gid: vec3<u32>, nwg: vec3<u32>, wg: u32) -> u32 {
    return gid.x + gid.y * nwg.x * wg;
}

// -inf, +inf and NaN from runtime variables: a const-expression that evaluates to inf or NaN is
// a shader-creation error in WGSL (Dawn/Tint enforce it; naga does not).
fn neg_inf() -> f32 {
    var bits = 0xff800000u;
    return bitcast<f32>(bits);
}

fn pos_inf() -> f32 {
    var bits = 0x7f800000u;
    return bitcast<f32>(bits);
}

fn nan_f32() -> f32 {
    var bits = 0x7fc00000u;
    return bitcast<f32>(bits);
}

// max that propagates NaN (WGSL's max may drop it), as the reference's softmax does.
fn nmax(a: f32, b: f32) -> f32 {
    if (b > a || is_nan(b)) {
        return b;
    }
    return a;
}

// Index of the word holding element i of a tensor of dtype dt.
fn widx(i: u32, dt: u32) -> u32 {
    return select(i, i >> 1u, dt == DT_F16);
}

// Element i of dtype dt, given the word that holds it, widened to float32.
fn word_f32(w: u32, i: u32, dt: u32) -> f32 {
    switch dt {
        case 1u: {
            let h = unpack2x16float(w);
            return select(h.x, h.y, (i & 1u) == 1u);
        }
        case 2u: { return f32(bitcast<i32>(w)); }
        case 3u: { return select(0.0, 1.0, w != 0u); }
        default: { return bitcast<f32>(w); }
    }
}

// Element i of dtype dt as int32 (floats truncate toward zero, as a cast does).
fn word_i32(w: u32, i: u32, dt: u32) -> i32 {
    switch dt {
        case 0u: { return i32(bitcast<f32>(w)); }
        case 1u: {
            let h = unpack2x16float(w);
            return i32(select(h.x, h.y, (i & 1u) == 1u));
        }
        case 3u: { return select(0, 1, w != 0u); }
        default: { return bitcast<i32>(w); }
    }
}

// Word holding a float result in a 32-bit output dtype (float32, int32 truncating, bool v != 0).
fn f32_word(v: f32, dt: u32) -> u32 {
    switch dt {
        case 2u: { return bitcast<u32>(i32(v)); }
        case 3u: { return select(0u, 1u, nz_f(v)); }   // NaN is true, -0.0 false (torch)
        default: { return bitcast<u32>(v); }
    }
}

fn i32_word(v: i32, dt: u32) -> u32 {
    switch dt {
        case 0u: { return bitcast<u32>(f32(v)); }
        case 3u: { return select(0u, 1u, v != 0); }
        default: { return bitcast<u32>(v); }
    }
}

// float16 helpers on whole words. NaN and values that round past the largest float16 (65504;
// from 65520 on, round-to-nearest-even gives inf) are written as their bit patterns: WGSL does not
// specify pack2x16float for them.
fn f16_bits(v: f32) -> u32 {
    if (is_nan(v)) {
        return 0x7e00u;
    }
    if (abs(v) >= 65520.0) {
        return select(0x7c00u, 0xfc00u, sign_bit(v));
    }
    return pack2x16float(vec2<f32>(v, 0.0)) & 0xffffu;
}

// Store float32 result v as element i of OUT (any output dtype but float16).
fn store_f(i: u32, v: f32) {
    OUT[i] = f32_word(v, DT_OUT);
}

// Store float16 word w of OUT: `lo`/`hi` are its two elements; an element whose `has_*` is false is
// not this thread's, and its old half is kept (read-modify-write of a word no other thread of
// this dispatch writes).
fn store_pair(w: u32, lo: f32, hi: f32, has_lo: bool, has_hi: bool) {
    if (!has_lo && !has_hi) {
        return;
    }
    var word = 0u;
    if (!has_lo || !has_hi) {
        word = OUT[w];
    }
    if (has_lo) {
        word = (word & 0xffff0000u) | f16_bits(lo);
    }
    if (has_hi) {
        word = (word & 0x0000ffffu) | (f16_bits(hi) << 16u);
    }
    OUT[w] = word;
}

// ---------------------------------------------------------------- math the WGSL builtins lack

//! include math.wgsl

// pow with C99 semantics (std::pow, what torch.pow of two tensors and numpy compute): WGSL's pow
// is undefined for x < 0 and says nothing of zeros, infinities and NaN. Annex F, in order: x^0 = 1
// and 1^y = 1 even for NaN; NaN otherwise propagates; |y| = inf gives 0, 1 or inf by |x| vs 1;
// x = 0 or inf gives 0 or inf, negative for an odd integer y and a negative x (-0.0 included);
// a negative x to a non-integer y is NaN; else exp2(y log2|x|), negated for an odd integer y.
fn pow_f(x: f32, y: f32) -> f32 {
    if (y == 0.0 || x == 1.0) {
        return 1.0;
    }
    if (is_nan(x) || is_nan(y)) {
        return x + y;
    }
    let ax = abs(x);
    let ay = abs(y);
    if (ay == pos_inf()) {
        if (ax == 1.0) {
            return 1.0;
        }
        return select(pos_inf(), 0.0, (ax < 1.0) == (y > 0.0));
    }
    let y_int = fract(ay) == 0.0;
    let y_odd = y_int && fract(ay * 0.5) == 0.5;   // every float from 2^24 on is an even integer
    if (ax == 0.0 || ax == pos_inf()) {
        let r = select(0.0, pos_inf(), (ax == 0.0) == (y < 0.0));
        return select(r, -r, y_odd && sign_bit(x));
    }
    if (x < 0.0 && !y_int) {
        return nan_f32();
    }
    if (y == 1.0) {
        return x;
    }
    if (y == 2.0) {
        return x * x;
    }
    if (y == 0.5) {
        return sqrt(x);
    }
    let r = exp2(y * log2(ax));
    return select(r, -r, x < 0.0 && y_odd);
}
