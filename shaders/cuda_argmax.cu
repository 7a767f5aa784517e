// The greedy pick on the device in one launch (native/cuda_argmax.py, CudaExecutor.argmax_device):
// out[0] = the index of the largest of x[0..n), with torch.argmax's rule: the first NaN if there
// is one, else the first of equal maxima. One block: thread t scans t, t + blockDim, ... in
// increasing order (so a thread's own candidate is already the first of its equals), then the
// block merges the candidates with warp shuffles and one pass over the warps' winners in shared
// memory. A vocabulary of 49152 float32 logits is 192 KiB: one SM reads it in about the time a
// second launch would cost, so no second pass over blocks.
// host_out, when not null, is a word of pinned host memory mapped into the device's address space
// (CUDA's unified addressing maps every cudaHostAlloc block): the pick is stored there too, so
// reading it back needs no copy after the kernel, only the event recorded behind it
// (native/cuda_index_reads.py); a finished kernel's stores are visible to the host.

// Whether candidate (va, ia) wins over (vb, ib) under torch.argmax's rule.
__device__ __forceinline__ bool am_better(float va, int ia, float vb, int ib) {
    const bool na = isnan(va), nb = isnan(vb);
    if (na != nb) return na;
    if (!na && va != vb) return va > vb;
    return ia < ib;  // both NaN, or equal: the first
}

template <typename T>
__global__ void __launch_bounds__(1024) argmax_first(const T* __restrict__ x, long long n, int* __restrict__ out,
                                                     int* __restrict__ host_out) {
    grid_dep_wait();  // first: see cuda_common.cu
    __shared__ float sv[32];
    __shared__ int si[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float bv = neg_inf();
    int bi = 0x7fffffff;  // no candidate yet: loses to any element (-inf ties go to a smaller index)
#pragma unroll 8
    for (long long i = tid; i < n; i += blockDim.x) {
        const float v = ld(x[i]);
        if (am_better(v, (int)i, bv, bi)) { bv = v; bi = (int)i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, bv, o);
        const int i = __shfl_xor_sync(0xffffffffu, bi, o);
        if (am_better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        bv = lane < nw ? sv[lane] : neg_inf();
        bi = lane < nw ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            const float v = __shfl_xor_sync(0xffffffffu, bv, o);
            const int i = __shfl_xor_sync(0xffffffffu, bi, o);
            if (am_better(v, i, bv, bi)) { bv = v; bi = i; }
        }
        if (lane == 0) {
            out[0] = bi;
            if (host_out != nullptr) host_out[0] = bi;
        }
    }
}
