// Element functions the WGSL builtins lack, binding-free: included by common.wgsl and by the
// kernels that do not take common's prelude (matmul_fast.wgsl's fused epilogues).

// ---------------------------------------------------------------- NaN, explicitly
// WGSL leaves NaN behaviour of max/min/clamp undefined, and compilers that assume no NaNs act on
// it: lavapipe (Mesa's software Vulkan) folds `x != x` to false and compiles `a != b` as an
// ordered comparison (false when either side is NaN), so max(NaN, 0) is 0, clamp(NaN) a bound and
// `NaN != 0.0` false (measured: tests/webgpu/test_wgsl_nan.py). Every kernel tests NaN through
// these helpers, which look at the bits (integer operations no float assumption can fold), and
// propagates it where PyTorch does.

fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

fn sign_bit(x: f32) -> bool {
    return (bitcast<u32>(x) >> 31u) == 1u;
}

// a != b with IEEE semantics (true when either is NaN).
fn ne_f(a: f32, b: f32) -> bool {
    return is_nan(a) || is_nan(b) || a != b;
}

// x != 0 with IEEE semantics: NaN is nonzero (true, as torch's bool()), -0.0 is zero.
fn nz_f(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) != 0u;
}

// max / min / clamp that return NaN when an operand is NaN (torch.maximum, clamp, hardtanh).
fn max_n(a: f32, b: f32) -> f32 {
    if (is_nan(a) || is_nan(b)) {
        return a + b;
    }
    return max(a, b);
}

fn min_n(a: f32, b: f32) -> f32 {
    if (is_nan(a) || is_nan(b)) {
        return a + b;
    }
    return min(a, b);
}

fn clamp_n(x: f32, lo: f32, hi: f32) -> f32 {
    if (is_nan(x)) {
        return x;
    }
    return clamp(x, lo, hi);
}

// A float from its bits at run time (a const-expression that is NaN or inf is a shader-creation
// error in WGSL; common.wgsl's nan_f32/neg_inf are not available to every includer of this file).
fn from_bits(b: u32) -> f32 {
    var v = b;
    return bitcast<f32>(v);
}

// exp and log with IEEE special values: WGSL does not define the builtins' results there, and
// SwiftShader (the browser's software WebGPU) gives exp(NaN) = inf, log(x < 0) and log(0) finite.
fn exp_f(x: f32) -> f32 {
    if (is_nan(x)) {
        return x;
    }
    return exp(x);
}

fn exp4_f(v: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(exp_f(v.x), exp_f(v.y), exp_f(v.z), exp_f(v.w));
}

fn log_f(x: f32) -> f32 {
    if (is_nan(x) || x < 0.0) {
        return from_bits(0x7fc00000u);            // NaN (log of a negative number)
    }
    if (x == 0.0) {
        return from_bits(0xff800000u);            // -inf (log(-0.0) too)
    }
    if (x == from_bits(0x7f800000u)) {
        return x;                                 // log(inf) = inf
    }
    return log(x);
}

// ---------------------------------------------------------------- functions

// erf with |error| < 1.2e-7 (W. J. Cody's rational approximations would be exact to float32;
// this Abramowitz-Stegun 7.1.26 variant with a refined tail is enough for a float32 result).
fn erf_f(x: f32) -> f32 {
    if (is_nan(x)) {
        return x;
    }
    let a = abs(x);
    if (a < 0.5) {
        // Taylor series around 0 keeps relative precision for small x.
        let x2 = x * x;
        return x * (1.1283791670955126 + x2 * (-0.37612638903183754 + x2 * (0.11283791670955126
            + x2 * (-0.026866170645131252 + x2 * (0.005223977625442188 + x2 * -0.0008548327023450853)))));
    }
    // erfc(a) = t * exp(-a^2 + P(t)) (Numerical Recipes erfcc, fractional error < 1.2e-7).
    let t = 1.0 / (1.0 + 0.5 * a);
    let p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806
        + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))));
    let r = 1.0 - t * exp(-a * a + p);
    return select(r, -r, x < 0.0);
}

// tanh that never divides inf by inf (tanh(10) is 1 in float32), and NaN for NaN (clamp would
// make it a bound).
fn tanh_f(x: f32) -> f32 {
    if (is_nan(x)) {
        return x;
    }
    let c = clamp(x, -10.0, 10.0);
    if (abs(c) < 0.0005) {
        return c - c * c * c / 3.0;
    }
    let e = exp(2.0 * c);
    return (e - 1.0) / (e + 1.0);
}

// sigmoid split by sign so exp never overflows.
fn sigmoid_f(x: f32) -> f32 {
    if (is_nan(x)) {
        return x;
    }
    let e = exp(-abs(x));
    return select(e / (1.0 + e), 1.0 / (1.0 + e), x >= 0.0);
}
