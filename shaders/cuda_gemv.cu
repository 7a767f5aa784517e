// GEMV on float16-stored weights with float32 activations, launched by native/cuda_kernels.py
// (CudaKernels.linear) for linears over at most 8 rows (decode). cuBLAS takes one dtype for both
// operands, so a float16 weight against float32 activations was converted to float32 on every
// call (a read and a write of the whole weight, plus a launch); this kernel reads the float16
// bytes once and accumulates in float32, as the dequantizing GEMV of cuda_quant.cu does.
//
// NVRTC is given no include path: the helpers of cuda_common.cu (ld, warp_sum) are prepended, and
// those of cuda_norm_prologue.cu for hgemv_norm.

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

// hdot8 with the activations from a source (cuda_norm_prologue.cu NormSrc: h computed on the
// fly): the same FMA order over the same values.
template <int MM, typename Src>
__device__ __forceinline__ void hdot8_src(uint4 q, const float* __restrict__ x, const Src& src, int k0, int M,
                                          float* acc) {
    float w[8];
    w[0] = ld((half_t)(q.x & 0xffffu)); w[1] = ld((half_t)(q.x >> 16));
    w[2] = ld((half_t)(q.y & 0xffffu)); w[3] = ld((half_t)(q.y >> 16));
    w[4] = ld((half_t)(q.z & 0xffffu)); w[5] = ld((half_t)(q.z >> 16));
    w[6] = ld((half_t)(q.w & 0xffffu)); w[7] = ld((half_t)(q.w >> 16));
#pragma unroll
    for (int m = 0; m < MM; ++m)
        if (m < M) {
            float a[8];
            src.load4(x, m, k0, 0, a);
            src.load4(x, m, k0, 4, a + 4);
            float s = acc[m];
#pragma unroll
            for (int i = 0; i < 8; ++i) s = fmaf(w[i], a[i], s);
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
      const float* __restrict__ bias, int N, int K, int M, long long ldo GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    grid_dep_wait();  // first: see cuda_common.cu
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

// hgemv with the rms-norm prologue (cuda_norm_prologue.cu, prepended with cuda_common.cu): the
// activations are h = rms_norm(nx + ny) * nw (ny null: rms_norm(nx); nw null: no weight), float32
// like x above, computed by each warp from the block's inverse rms of the rows instead of read;
// block 0 writes the sum to ns (null: not kept). Each warp issues its first trip's weight loads
// before the block-wide prologue, so the prologue runs while they are in flight. Otherwise hgemv: the same loads of w, the same
// FMA order over the same h values, so its outputs equal hgemv's on the unfused chain's h.
template <int MM, typename W>
__global__ void __launch_bounds__(HV_WARPS * 32)
hgemv_norm(const uint4* __restrict__ w, float* __restrict__ out, const float* __restrict__ bias, int N, int K,
           int M, long long ldo, const float* __restrict__ nx, const float* __restrict__ ny,
           const W* __restrict__ nw, float* __restrict__ ns, float eps, int vb GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    grid_dep_wait();  // first: see cuda_common.cu
    __shared__ float rinv[NP_MAX_ROWS];
    const NormSrc<float, W> src{ny, nw, rinv, K, ns, M, vb, eps};
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * HV_WARPS + (threadIdx.x >> 5);
    const int nch = K >> 3;
    const uint4* row = w + (long long)n * nch;
    // the first trip's weight loads are issued before the prologue, which runs while they fly
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const uint4 a0 = n < N && lane < nch ? __ldg(row + lane) : zero;
    const uint4 b0 = n < N && lane + 32 < nch ? __ldg(row + lane + 32) : zero;
    src.prologue(nx);  // the whole block, before any return
    if (n >= N) return;  // warp-uniform
    float acc[MM];
#pragma unroll
    for (int m = 0; m < MM; ++m) acc[m] = 0.f;
    for (int c = lane; c < nch; c += 64) {
        const bool two = c + 32 < nch;
        uint4 a = a0, b = b0;
        if (c != lane) {
            a = __ldg(row + c);
            b = two ? __ldg(row + c + 32) : zero;
        }
        hdot8_src<MM>(a, nx, src, 8 * c, M, acc);
        if (two) hdot8_src<MM>(b, nx, src, 8 * (c + 32), M, acc);
    }
#pragma unroll
    for (int m = 0; m < MM; ++m) {
        const float v = warp_sum(acc[m]);
        if (lane == m && m < M) out[(long long)m * ldo + n] = bias != nullptr ? v + bias[n] : v;
    }
}
