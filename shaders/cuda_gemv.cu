// GEMV on float16-stored weights with float32 activations, launched by native/cuda_kernels.py
// (CudaKernels.linear) for linears over at most 8 rows (decode). cuBLAS takes one dtype for both
// operands, so a float16 weight against float32 activations was converted to float32 on every
// call (a read and a write of the whole weight, plus a launch); this kernel reads the float16
// bytes once and accumulates in float32, as the dequantizing GEMV of cuda_quant.cu does.
//
// NVRTC is given no include path: the helpers of cuda_common.cu (ld, warp_sum) are prepended.

#define HV_WARPS 4  // warps of one hgemv block (HV_WARPS in native/cuda_kernels.py)

// acc[m] += the 8 weights of chunk q . x[m, k0 .. k0+7] for every x row m < M.
template <int MM>
__device__ __forceinline__ void hdot8(uint4 q, const float* __restrict__ x, long long k0, int K, int M, float* acc) {
    float w[8];
    w[0] = ld((half_t)(q.x & 0xffffu)); w[1] = ld((half_t)(q.x >> 16));
    w[2] = ld((half_t)(q.y & 0xffffu)); w[3] = ld((half_t)(q.y >> 16));
    w[4] = ld((half_t)(q.z & 0xffffu)); w[5] = ld((half_t)(q.z >> 16));
    w[6] = ld((half_t)(q.w & 0xffffu)); w[7] = ld((half_t)(q.w >> 16));
#pragma unroll
    for (int m = 0; m < MM; ++m)
        if (m < M) {
            const float4 a = __ldg(reinterpret_cast<const float4*>(x + (long long)m * K + k0));
            const float4 b = __ldg(reinterpret_cast<const float4*>(x + (long long)m * K + k0 + 4));
            float s = acc[m];
            s = fmaf(w[0], a.x, s); s = fmaf(w[1], a.y, s); s = fmaf(w[2], a.z, s); s = fmaf(w[3], a.w, s);
            s = fmaf(w[4], b.x, s); s = fmaf(w[5], b.y, s); s = fmaf(w[6], b.z, s); s = fmaf(w[7], b.w, s);
            acc[m] = s;
        }
}

// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for m < M <= MM: x float32 [M, K] contiguous
// from a 16-byte aligned start, w float16 [N, K] with K % 8 == 0 from a 16-byte aligned start
// (every row then starts at one too), out row m at out + m * ldo, bias float32 or null. One warp
// per output row, HV_WARPS a block: lane l takes the row's 16-byte chunks l, l + 32, ... (a warp
// reads 512 consecutive bytes per step), two chunks' loads issued before either is used; a
// warp-shuffle sum ends the row and lane m writes x row m's output.
template <int MM>
__global__ void __launch_bounds__(HV_WARPS * 32)
hgemv(const uint4* __restrict__ w, const float* __restrict__ x, float* __restrict__ out,
      const float* __restrict__ bias, int N, int K, int M, long long ldo) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * HV_WARPS + (threadIdx.x >> 5);
    if (n >= N) return;  // warp-uniform
    const int nch = K >> 3;
    const uint4* row = w + (long long)n * nch;
    float acc[MM];
#pragma unroll
    for (int m = 0; m < MM; ++m) acc[m] = 0.f;
    for (int c = lane; c < nch; c += 64) {
        const bool two = c + 32 < nch;
        const uint4 a = __ldg(row + c);
        uint4 b = make_uint4(0u, 0u, 0u, 0u);
        if (two) b = __ldg(row + c + 32);
        hdot8<MM>(a, x, 8ll * c, K, M, acc);
        if (two) hdot8<MM>(b, x, 8ll * (c + 32), K, M, acc);
    }
#pragma unroll
    for (int m = 0; m < MM; ++m) {
        const float v = warp_sum(acc[m]);
        if (lane == m && m < M) out[(long long)m * ldo + n] = bias != nullptr ? v + bias[n] : v;
    }
}
