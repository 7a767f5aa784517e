// Row-wise fused kernels: one block per row of `cols` contiguous elements, fp32 accumulation.
// Templates: T = storage of x/y, W = storage of weight/bias (float or half_t).

template <typename T, typename W>
__global__ void rms_norm(const T* __restrict__ x, const W* __restrict__ w, T* __restrict__ y,
                         int cols, float eps, int has_w GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    grid_dep_wait();  // first: see cuda_common.cu
    __shared__ float red[32];
    const T* xr = x + (size_t)blockIdx.x * cols;
    T* yr = y + (size_t)blockIdx.x * cols;
    float s = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) { float v = ld(xr[c]); s += v * v; }
    s = block_sum(s, red);
    float r = rsqrtf(s / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = ld(xr[c]) * r;
        if (has_w) v *= ld(w[c]);
        st(&yr[c], v);
    }
}

// Two passes over the row (mean, then centred variance) rather than E[x^2]-E[x]^2: the row is
// re-read from L1/L2 and the variance does not cancel catastrophically for large means.
template <typename T, typename W>
__global__ void layer_norm(const T* __restrict__ x, const W* __restrict__ w, const W* __restrict__ b,
                           T* __restrict__ y, int cols, float eps, int has_w, int has_b GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    grid_dep_wait();  // first: see cuda_common.cu
    __shared__ float red[32];
    const T* xr = x + (size_t)blockIdx.x * cols;
    T* yr = y + (size_t)blockIdx.x * cols;
    float s = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += ld(xr[c]);
    float mean = block_sum(s, red) / (float)cols;
    float q = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) { float d = ld(xr[c]) - mean; q += d * d; }
    float r = rsqrtf(block_sum(q, red) / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = (ld(xr[c]) - mean) * r;
        if (has_w) v *= ld(w[c]);
        if (has_b) v += ld(b[c]);
        st(&yr[c], v);
    }
}

// softmax / log_softmax over the last dim (the executor moves another dim last first).
template <typename T>
__global__ void softmax_rows(const T* __restrict__ x, T* __restrict__ y, int cols, int log_out GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    grid_dep_wait();  // first: see cuda_common.cu
    __shared__ float red[32];
    const T* xr = x + (size_t)blockIdx.x * cols;
    T* yr = y + (size_t)blockIdx.x * cols;
    float m = neg_inf();
    for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, ld(xr[c]));
    m = block_max(m, red);
    float s = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += expf(ld(xr[c]) - m);
    s = block_sum(s, red);
    if (log_out) {
        float ls = logf(s);
        for (int c = threadIdx.x; c < cols; c += blockDim.x) st(&yr[c], ld(xr[c]) - m - ls);
    } else {
        float inv = 1.f / s;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) st(&yr[c], expf(ld(xr[c]) - m) * inv);
    }
}
