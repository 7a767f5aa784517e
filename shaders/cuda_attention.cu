// Fused scaled-dot-product attention, one block per query row (b, h, i):
//   scores_j = scale * q_i . k_j (+ mask), causal keeps j <= i + causal_offset,
//   p = softmax(scores), out_i = sum_j p_j v_j.
// Grouped-query attention: query head h reads kv head h / (H / Hk).
// The scores of a row stay in shared memory (Tk floats), so this serves decode (Tq = 1) and
// moderate prefill lengths; the executor falls back to matmul+softmax+matmul when Tk is larger
// than shared memory allows.
// Mask: mkind 0 none, 1 bool (uint32 0/1 keep-mask), 2 float32 additive, 3 float16 additive;
// ms0..ms3 are its element strides over [B, H, Tq, Tk] (0 where broadcast).
// Shared memory: D (q row) + Tk (scores) + 32 (reductions) + blockDim (partial outputs) floats.
template <typename T>
__global__ void sdpa_rows(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          const void* __restrict__ mask, T* __restrict__ out,
                          int H, int Hk, int Tq, int Tk, int D, int Dv,
                          int mkind, long long ms0, long long ms1, long long ms2, long long ms3,
                          int causal, int causal_offset, float scale) {
    extern __shared__ float sm[];
    float* qs = sm;
    float* sc = qs + D;
    float* red = sc + Tk;
    float* part = red + 32;

    const int row = blockIdx.x;
    const int i = row % Tq;
    const int bh = row / Tq;
    const int h = bh % H;
    const int b = bh / H;
    const int hk = h / (H / Hk);
    const T* qp = q + (size_t)row * D;
    const T* kp = k + (size_t)(b * Hk + hk) * Tk * D;
    const T* vp = v + (size_t)(b * Hk + hk) * Tk * Dv;

    for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = ld(qp[d]) * scale;
    __syncthreads();

    // Scores: one warp per key, lanes split the head dim (coalesced reads of the key row).
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int j = warp; j < Tk; j += nw) {
        float s = 0.f;
        for (int d = lane; d < D; d += 32) s += qs[d] * ld(kp[(size_t)j * D + d]);
        s = warp_sum(s);
        if (lane == 0) {
            bool keep = !causal || j <= i + causal_offset;
            if (mkind != 0) {
                long long off = b * ms0 + h * ms1 + i * ms2 + j * ms3;
                if (mkind == 1) keep = keep && ((const unsigned int*)mask)[off] != 0u;
                else if (mkind == 2) s += ((const float*)mask)[off];
                else s += ld(((const half_t*)mask)[off]);
            }
            sc[j] = keep ? s : neg_inf();
        }
    }
    __syncthreads();

    float m = neg_inf();
    for (int j = threadIdx.x; j < Tk; j += blockDim.x) m = fmaxf(m, sc[j]);
    m = block_max(m, red);
    float l = 0.f;
    for (int j = threadIdx.x; j < Tk; j += blockDim.x) {
        // A fully masked row gives exp(-inf - -inf) = NaN, as the reference (and torch) do.
        float p = expf(sc[j] - m);
        sc[j] = p;
        l += p;
    }
    l = block_sum(l, red);  // ends with a barrier: every sc[j] is written

    T* op = out + (size_t)row * Dv;
    const float inv = 1.f / l;
    if (Dv <= (int)blockDim.x) {
        // G groups of Dv threads split the keys; partial sums meet in shared memory.
        const int G = blockDim.x / Dv;
        const int g = threadIdx.x / Dv, d = threadIdx.x % Dv;
        float acc = 0.f;
        if (g < G)
            for (int j = g; j < Tk; j += G) acc += sc[j] * ld(vp[(size_t)j * Dv + d]);
        if (g < G) part[g * Dv + d] = acc;
        __syncthreads();
        if ((int)threadIdx.x < Dv) {
            float t = 0.f;
            for (int gg = 0; gg < G; ++gg) t += part[gg * Dv + threadIdx.x];
            st(&op[threadIdx.x], t * inv);
        }
    } else {
        for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
            float acc = 0.f;
            for (int j = 0; j < Tk; ++j) acc += sc[j] * ld(vp[(size_t)j * Dv + d]);
            st(&op[d], acc * inv);
        }
    }
}
