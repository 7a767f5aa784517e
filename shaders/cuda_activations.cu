// Device functions for the elementwise activations, used as the preamble of CuPy
// ElementwiseKernels (which handle broadcasting, dtype dispatch and the `out` argument).
// Every function takes and returns fp32: float16 storage is widened before and narrowed after.
// NaN propagates where torch propagates it: fmaxf/fminf return the other operand for a NaN, and
// a `x > 0 ? x : 0` drops it, so relu and hardtanh test for NaN explicitly.

__device__ __forceinline__ float gd_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float gd_silu(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float gd_relu(float x) { return x < 0.f ? 0.f : x; }  // NaN stays NaN
__device__ __forceinline__ float gd_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ float gd_reciprocal(float x) { return 1.f / x; }
__device__ __forceinline__ float gd_gelu_erf(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ float gd_gelu_tanh(float x) {
    const float c = 0.79788456080286536f;  // sqrt(2/pi)
    return 0.5f * x * (1.f + tanhf(c * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float gd_hardtanh(float x, float lo, float hi) {
    return isnan(x) ? x : fminf(fmaxf(x, lo), hi);
}
