// Llama rotary embedding (half rotation): y = x*cos + rotate_half(x)*sin, with
// rotate_half(x)[d] = -x[d + D/2] for d < D/2 and x[d - D/2] otherwise.
// x, y: [B, H, T, D] contiguous; cos, sin: [T, D]. One thread per element.
template <typename T, typename C>
__global__ void rope(const T* __restrict__ x, const C* __restrict__ cs, const C* __restrict__ sn,
                     T* __restrict__ y, long long n, int T_, int D GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    grid_dep_wait();  // first: see cuda_common.cu
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int d = (int)(i % D);
    long long t = (i / D) % T_;
    int half = D / 2;
    float xv = ld(x[i]);
    float rot = d < half ? -ld(x[i + half]) : ld(x[i - half]);
    st(&y[i], xv * ld(cs[t * D + d]) + rot * ld(sn[t * D + d]));
}

// In-place KV-cache update: cache[b, h, pos + t, :] = new[b, h, t, :]. `pos` is read on the
// device (an int32[1] tensor), so a captured CUDA graph replays with the current position.
// Rows that would fall outside [0, S) are skipped (a device kernel cannot raise).
// E is the element type moved as raw bits (cache and new have one dtype here).
template <typename E>
__global__ void kv_update(E* __restrict__ cache, const E* __restrict__ nw, const int* __restrict__ pos,
                          long long n, int S, int Tn, int D GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    grid_dep_wait();  // first: see cuda_common.cu
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int d = (int)(i % D);
    long long t = (i / D) % Tn;
    long long bh = i / ((long long)D * Tn);
    long long s = (long long)pos[0] + t;
    if (s < 0 || s >= S) return;
    cache[(bh * S + s) * D + d] = nw[i];
}
