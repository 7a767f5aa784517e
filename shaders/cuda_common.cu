// Shared helpers of gpudelegate's CUDA kernels (prepended to every RawModule by
// native/cuda_kernels.py; NVRTC is given no include path, so nothing here includes a header).
//
// Storage types: float32 is `float`, float16 is carried as its 16-bit pattern (`half_t`) and
// converted with the PTX cvt instructions, so no cuda_fp16.h is needed. All arithmetic is fp32.

typedef unsigned short half_t;

__device__ __forceinline__ float ld(float v) { return v; }
__device__ __forceinline__ float ld(half_t h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(half_t* p, float v) {
    half_t h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(v));
    *p = h;
}

// Programmatic dependent launch (native/cuda_pdl.py): a kernel launched with that attribute may
// start while the kernel before it in the stream is still running; this waits until that one has
// finished and its writes are visible. Every kernel here calls it before touching memory written
// in the run, so such an early start only overlaps the launch and the blocks' scheduling, never a
// read of a predecessor's output. One exception, by design: the packed-weight products (qgemv41x in
// cuda_qgemv_fast.cu, q41_body and qgemv_body in cuda_quant.cu) issue their first weight loads
// before the wait, so that latency overlaps the kernel before them; weights are prepacked
// constants (or ring slots filled by copies the stream waits for as full dependencies), never a
// kernel's output. Every thread of such a kernel still waits before it may exit: a grid whose
// threads all left without waiting could end before its predecessor, and the kernel after it
// (whose wait covers only this grid) would read the predecessor's outputs too early.
// Then it lets the next kernel launch at once (rather than when this one ends): that one's blocks
// are placed while this one runs and wait here in turn, so at most two grids are in flight and
// each still starts its work only after the one before it has finished.
// Launched the ordinary way both return at once.
__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// A GEMV row group's KS partial sums (KS warps share the group, warp kw of it holding ``acc``),
// added in warp order by the group's first warp, whose lane 0 then holds each total and the
// others 0, so a warp sum after it is the total. Returns false on every other warp (and
// inactive ones): they are done. One __shared__ array per instantiation.
template <int R, int MM, int KS, int WARPS>
__device__ __forceinline__ bool ks_partials(float (&acc)[R][MM], int warp, int lane, bool active, int kw) {
    __shared__ float part[WARPS][R * MM];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MM; ++m) {
            const float v = warp_sum(acc[r][m]);
            if (lane == 0) part[warp][r * MM + m] = v;
        }
    __syncthreads();
    if (!active || kw != 0) return false;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MM; ++m) {
            float v = part[warp][r * MM + m];
#pragma unroll
            for (int i = 1; i < KS; ++i) v += part[warp + i][r * MM + m];
            acc[r][m] = lane == 0 ? v : 0.f;
        }
    return true;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide reductions; blockDim.x must be a multiple of 32. `red` is >= 32 floats of shared
// memory. The leading barrier lets callers reuse `red` back to back.
__device__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    if (w == 0) {
        float t = lane < nw ? red[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) red[0] = t;
    }
    __syncthreads();
    return red[0];
}
__device__ float block_max(float v, float* red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    if (w == 0) {
        float t = lane < nw ? red[lane] : neg_inf();
        t = warp_max(t);
        if (lane == 0) red[0] = t;
    }
    __syncthreads();
    return red[0];
}
