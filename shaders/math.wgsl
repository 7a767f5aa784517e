// Element functions the WGSL builtins lack, binding-free: included by common.wgsl and by the
// kernels that do not take common's prelude (matmul_fast.wgsl's fused epilogues).

// erf with |error| < 1.2e-7 (W. J. Cody's rational approximations would be exact to float32;
// this Abramowitz-Stegun 7.1.26 variant with a refined tail is enough for a float32 result).
fn erf_f(x: f32) -> f32 {
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

// tanh that never divides inf by inf (tanh(10) is 1 in float32).
fn tanh_f(x: f32) -> f32 {
    let c = clamp(x, -10.0, 10.0);
    if (abs(c) < 0.0005) {
        return c - c * c * c / 3.0;
    }
    let e = exp(2.0 * c);
    return (e - 1.0) / (e + 1.0);
}

// sigmoid split by sign so exp never overflows.
fn sigmoid_f(x: f32) -> f32 {
    let e = exp(-abs(x));
    return select(e / (1.0 + e), 1.0 / (1.0 + e), x >= 0.0);
}
