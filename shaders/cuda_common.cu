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
// read of a predecessor's output. Two exceptions, by design: the packed-weight products (qgemv41x in
// cuda_qgemv_fast.cu, q41_body and qgemv_body in cuda_quant.cu) issue their first weight loads
// before the wait, so that latency overlaps the kernel before them; weights are prepacked
// constants (or ring slots filled by copies the stream waits for as full dependencies), never a
// kernel's output; and the decode attention sdpa_early_keys (cuda_attention.cu) loads the cache
// rows and the position that the executor knows no kernel of the run writes (FreshRows), and
// loads again after the wait the rows a kernel ahead writes. Every thread of such a kernel still
// waits before it may exit: a grid whose threads all left without waiting could end before its
// predecessor, and the kernel after it (whose wait covers only this grid) would read the
// predecessor's outputs too early.
// Then it lets the next kernel launch at once (rather than when this one ends): that one's blocks
// are placed while this one runs and wait here in turn, so at most two grids are in flight and
// each still starts its work only after the one before it has finished.
// Launched the ordinary way both return at once.

// The step's timeline (a probe's switch, off by default; native/cuda_pdl.py Timeline): compiled
// with GD_TIMELINE defined (to the record's SM slots, a power of two), every kernel takes one
// more argument, the address of its launch's record (null for launches the timeline does not
// follow), and GD_KERNEL_ENTER, each kernel's first statement, keeps the block's start and stamps
// the block's end when its last thread leaves (a destructor: every return path). A record holds
// GD_TIMELINE slots of 4 x 64-bit %globaltimer values (the first block's start, the first and
// the last return from grid_dep_wait, the last block's end), a slot per SM (%smid), so the four
// atomics of each block contend only with the blocks of its own SM (into one slot, the blocks
// of a 6,144-block launch serialized at one L2 address); the host takes the min / max over the
// slots. Without GD_TIMELINE both macros are empty: the kernels compile exactly as before.
#ifdef GD_TIMELINE
#define GD_TL_PARAM , unsigned long long* __restrict__ gd_tl_slot
#define GD_KERNEL_ENTER GdTimelineScope gd_tl_scope(gd_tl_slot)
__device__ __forceinline__ unsigned long long gd_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
struct GdTimelineBlock {
    unsigned long long* slot;  // this SM's slot of the launch's record, or null
    unsigned long long t0;     // the block's start (thread 0's first statement)
    int left;                  // threads of the block still running
};
__device__ __forceinline__ GdTimelineBlock& gd_tl_block() {
    __shared__ GdTimelineBlock b;  // one per block: a function's __shared__ variable is static
    return b;
}
__device__ __forceinline__ bool gd_tl_first_thread() { return (threadIdx.x | threadIdx.y | threadIdx.z) == 0; }
struct GdTimelineScope {
    unsigned long long* slot;
    __device__ __forceinline__ explicit GdTimelineScope(unsigned long long* s) : slot(s) {
        GdTimelineBlock& b = gd_tl_block();
        if (gd_tl_first_thread()) {
            unsigned sm;
            asm("mov.u32 %0, %%smid;" : "=r"(sm));
            b.slot = s != nullptr ? s + 4 * (sm & (GD_TIMELINE - 1)) : nullptr;
            b.t0 = gd_now();
            b.left = (int)(blockDim.x * blockDim.y * blockDim.z);
        }
        __syncthreads();  // the kernel's first statement: every thread is here
    }
    // the block's end: the threads leave at different returns, so each converged group counts
    // itself off and the group that takes the count to zero stamps
    __device__ __forceinline__ ~GdTimelineScope() {
        if (slot == nullptr) return;
        GdTimelineBlock& b = gd_tl_block();
        const unsigned m = __activemask();
        unsigned lane;
        asm("mov.u32 %0, %%laneid;" : "=r"(lane));
        const int lead = __ffs(m) - 1, n = __popc(m);
        int old = 0;
        if ((int)lane == lead) old = atomicSub(&b.left, n);
        old = __shfl_sync(m, old, lead);
        if ((int)lane == lead && old == n) atomicMax(b.slot + 3, gd_now());
    }
};
// after the wait: the block's start and its wait's return, by its first thread
__device__ __forceinline__ void gd_tl_waited() {
    GdTimelineBlock& b = gd_tl_block();
    if (!gd_tl_first_thread() || b.slot == nullptr) return;
    const unsigned long long t = gd_now();
    atomicMin(b.slot, b.t0);
    atomicMin(b.slot + 1, t);
    atomicMax(b.slot + 2, t);
}
#else
#define GD_TL_PARAM
#define GD_KERNEL_ENTER
#endif

__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#ifdef GD_TIMELINE
    gd_tl_waited();
#endif
}

// [p, p + bytes) into L2, a 128-byte line per thread of the block (prefetch.global.L2). Nothing
// lands in the block's registers or L1: the loads after grid_dep_wait still read what the kernel
// ahead wrote (L2 is where its writes go), so a kernel may issue this before its wait, even for
// memory that kernel writes. For constants and data of earlier runs that the step's weight
// stream has pushed out of L2: their loads after the wait become L2 hits instead of DRAM trips.
__device__ __forceinline__ void l2_prefetch_block(const void* p, long long bytes) {
    const unsigned long long end = reinterpret_cast<unsigned long long>(p) + (unsigned long long)bytes;
    const unsigned long long step = 128ull * (blockDim.x * blockDim.y * blockDim.z);
    unsigned long long a = (reinterpret_cast<unsigned long long>(p) & ~127ull) +
                           128ull * (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
    for (; a < end; a += step) asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
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
