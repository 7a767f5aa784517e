// The rms-norm prologue of the decode products (native/cuda_norm_prologue.py; the planner's
// Fusion.norm, core/plan/fusion.py): a GEMV whose activations are h = rms_norm(s) * w, with
// s = x + y (or s = x, a plain rms_norm), computes h itself instead of reading it, so the
// add_rms_norm / rms_norm launch before the product goes away.
//
// Every block first computes the inverse rms of each of the M <= NP_MAX_ROWS rows (K values
// each, read from L2: cheap for a few rows), summing in exactly the order of the unfused kernels
// (cuda_fused.cu add_rms_norm, cuda_norms.cu rms_norm): a block of VB threads in which thread v
// sums columns v, v + VB, ... and block_sum adds the warps' sums; here the block's NP_WARPS warps
// play the VB / 32 warps of that block. The product then reads h on the fly, each value rounded
// where the unfused chain stores it (s, then h, to T), so the products see h bit for bit.
// Block 0 also writes s (a kept output: the residual stream goes on). s never overlaps x, y or
// w and the product's output never overlaps x or y (the host checks, else it runs the unfused
// chain), so no block's writes change what another block reads.
//
// Prepended after cuda_common.cu to the RawModules of cuda_gemv.cu and cuda_quant.cu.

#define NP_MAX_ROWS 8  // rows of the product (PROLOGUE_MAX_ROWS of core/plan/fusion.py)
#define NP_WARPS 4     // warps of the blocks that run it (HV_WARPS, QV_WARPS)

// v rounded to T's precision (the value an unfused op stores and the next one re-reads).
__device__ __forceinline__ float np_rnd(float v, const float*) { return v; }
__device__ __forceinline__ float np_rnd(float v, const half_t*) {
    half_t h;
    st(&h, v);
    return ld(h);
}

// 4 consecutive values as floats (p 16-byte aligned for float, 8-byte for half).
__device__ __forceinline__ void np_ld4(const float* p, float* v) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
}
__device__ __forceinline__ void np_ld4(const half_t* p, float* v) {
    const uint2 a = *reinterpret_cast<const uint2*>(p);
    v[0] = ld((half_t)(a.x & 0xffffu)); v[1] = ld((half_t)(a.x >> 16));
    v[2] = ld((half_t)(a.y & 0xffffu)); v[3] = ld((half_t)(a.y >> 16));
}

// rinv[m] = 1 / rms(s row m) for m < M (s = x + y rounded to T, or x when y is null), by the
// whole block (every thread calls it, before any early return); block 0 writes s when s is not
// null. x, y, s are [M, K] contiguous; vb is the unfused kernel's block (a multiple of 32, <= 256).
template <typename T>
__device__ void norm_prologue(const T* __restrict__ x, const T* __restrict__ y, T* __restrict__ s, int K, int M,
                              int vb, float eps, float* rinv) {
    __shared__ float red[NP_MAX_ROWS][8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nvw = vb >> 5;
    const bool write_s = s != nullptr && y != nullptr && blockIdx.x == 0;
    // warp j plays virtual warps j and j + 4 in one loop (each value's loads issued together);
    // each virtual thread still sums its own columns in the unfused order
    const int vw0 = warp, vw1 = warp + NP_WARPS;
    for (int m = 0; m < M; ++m) {
        if (vw0 >= nvw) break;  // warp-uniform
        float q0 = 0.f, q1 = 0.f;
        const T* xr = x + (long long)m * K;
        const T* yr = y != nullptr ? y + (long long)m * K : nullptr;
        T* sr = write_s ? s + (long long)m * K : nullptr;
#pragma unroll 2
        for (int c0 = vw0 * 32 + lane; c0 < K; c0 += vb) {
            const int c1 = c0 + NP_WARPS * 32;  // < c0 + vb exactly when vw1 < nvw
            const bool two = vw1 < nvw && c1 < K;
            float a0 = ld(xr[c0]), a1 = two ? ld(xr[c1]) : 0.f;
            if (yr != nullptr) {
                const float b0 = ld(yr[c0]), b1 = two ? ld(yr[c1]) : 0.f;
                a0 = np_rnd(a0 + b0, x);
                a1 = np_rnd(a1 + b1, x);
                if (sr != nullptr) {
                    st(&sr[c0], a0);
                    if (two) st(&sr[c1], a1);
                }
            }
            q0 += a0 * a0;
            if (two) q1 += a1 * a1;
        }
        q0 = warp_sum(q0);
        q1 = warp_sum(q1);
        if (lane == 0) {
            red[m][vw0] = q0;
            if (vw1 < nvw) red[m][vw1] = q1;
        }
    }
    __syncthreads();
    for (int m = warp; m < M; m += NP_WARPS) {
        float t = lane < nvw ? red[m][lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) rinv[m] = rsqrtf(t / (float)K + eps);
    }
    __syncthreads();
}

// The activations of a product that reads x directly (the kernels without the prologue). A
// source's load4(x, m, k, p, v) loads values k + p .. k + p + 3 of row m and gets x as the
// kernel's own __restrict__ parameter (the product's loads then compile as they did before
// sources existed).
template <typename T>
struct PlainSrc {
    enum { PROLOGUE = 0 };
    int K;
    __device__ __forceinline__ void prefetch() const {}
    __device__ __forceinline__ void prologue(const T* __restrict__) const {}
    __device__ __forceinline__ void load4(const T* __restrict__ x, int m, int k, int p, float* v) const {
        np_ld4(x + (long long)m * K + k + p, v);
    }
};

// h[m, k + p .. k + p + 3] computed from x (the add's first operand, or the norm's input), y, w and the
// block's rinv (k + p a multiple of 4; x, y, w with 16-byte aligned starts and K % 4 == 0).
template <typename T, typename W>
struct NormSrc {
    enum { PROLOGUE = 1 };
    const T* y;  // null: no add
    const W* w;  // null: no weight
    float* rinv;  // NP_MAX_ROWS floats of the block's shared memory
    int K;
    T* s;  // null: the sum is not kept
    int M, vb;
    float eps;
    // The norm's weight (a constant) into L2 before the products' grid_dep_wait: its first
    // read follows the wait and the prologue, and the step's weight stream has pushed it out of
    // L2 since the last step (cuda_common.cu l2_prefetch_block).
    __device__ __forceinline__ void prefetch() const {
        if (w != nullptr) l2_prefetch_block(w, (long long)K * (long long)sizeof(W));
    }
    // by every thread of the block, before any load4
    __device__ __forceinline__ void prologue(const T* __restrict__ x) const { norm_prologue<T>(x, y, s, K, M, vb, eps, rinv); }
    __device__ __forceinline__ void load4(const T* __restrict__ x, int m, int k, int p, float* v) const {
        const long long i = (long long)m * K + k + p;
        float a[4], b[4], g[4];
        np_ld4(x + i, a);
        if (y != nullptr) np_ld4(y + i, b);
        if (w != nullptr) np_ld4(w + (k + p), g);
        const float r = rinv[m];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float sv = y != nullptr ? np_rnd(a[j] + b[j], x) : a[j];
            float h = sv * r;
            if (w != nullptr) h *= g[j];
            v[j] = np_rnd(h, x);
        }
    }
};
