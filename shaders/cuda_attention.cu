// Fused scaled-dot-product attention (docs/OPS.md `sdpa`), flash-attention style:
//   scores_j = scale * q_i . k_j (+ mask), causal keeps j <= i + causal_offset,
//   p = softmax(scores), out_i = sum_j p_j v_j.
//
// One block serves BR (16, or 8 / 4 where larger blocks would leave SMs idle) query rows of ONE kv head: with grouped-query attention the G = H/Hk
// query heads sharing kv head hk are rows (g, i) -> g * Tq + i of one group, which is also how
// they lie in memory (q [B,H,Tq,D] contiguous), so a decode step (Tq = 1) reads each key and value
// once for all G heads. Keys stream through shared memory in tiles of BK with an online softmax
// (running max m, running sum l, rescaled accumulators), so any key length fits.
//
// Split-K (flash-decoding): blockIdx.z takes `tiles_per_split` key tiles. With one split the
// block writes the normalized output; with several it writes unnormalized partial outputs and
// (m, l) per row to part_o / part_ml, and sdpa_combine merges the splits. Decode has few rows
// (B*Hk groups of G*Tq rows), so without the split only a handful of blocks would walk all keys.
//
// Masking: a key tile that no row of the block may see (causal bound, bool mask, the end of the
// keys) is skipped before its keys are loaded, so causal prefill over a long cache costs what
// its visible part costs. A fully masked row ends with l = 0 and gives zeros (safe_div), as
// torch's scaled_dot_product_attention (its _safe_softmax) and the reference do; a NaN score
// still makes its row NaN (l is NaN then, not 0).
// Mask: mkind 0 none, 1 bool (uint32 0/1 keep-mask), 2 float32 additive, 3 float16 additive;
// ms0..ms3 are its element strides over [B, H, Tq, Tk] (0 where broadcast).
//
// fp32 arithmetic throughout (fp16 storage is widened on load). Shared memory, in floats:
// BR*(D+1) + BK*(D+1) + BK*Dv + BR*(BK+1) + 3*BR (the +1 pads keep the column reads of the score
// loop on distinct banks); native/cuda_kernels.py picks BK so that this fits.
// vec4: D and Dv multiples of 4 and k, v aligned to 4 elements, so tiles load 4 elements at once.
// Thread layout (128 threads): scores: thread t owns key column t % BK of rows t / BK + n*(128/BK);
// softmax: warp w owns rows w, w+4, ...; P.V: thread t owns output entries t + n*128 of [BR][Dv]
// (NO >= BR*Dv/128 accumulators in registers).

// Four consecutive elements, widened to fp32, in one load (p aligned to 4 elements).
__device__ __forceinline__ void ld4(const float* p, float* x) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
}
__device__ __forceinline__ void ld4(const half_t* p, float* x) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    x[0] = ld((half_t)(v.x & 0xffffu)); x[1] = ld((half_t)(v.x >> 16));
    x[2] = ld((half_t)(v.y & 0xffffu)); x[3] = ld((half_t)(v.y >> 16));
}

#define SDPA_NT 128
#define SDPA_BR 16

// Output row of q/out row `row` = (b*H + h)*Tq + i: the same row in [B,H,Tq,Dv], or with
// out_bthd (a following permute(0,2,1,3) fused in by the executor) row (b*Tq + i)*H + h of
// [B,Tq,H,Dv], so the attention writes the layout the output projection reads.
// a / l with l = 0 (a fully masked row: every key dropped or -inf, a = 0 too) giving 0, as torch's
// scaled_dot_product_attention does; a NaN l (a NaN score) still gives NaN.
__device__ __forceinline__ float safe_div(float a, float l) { return l == 0.f ? 0.f : a / l; }

__device__ __forceinline__ size_t sdpa_out_row(size_t row, int H, int Tq, int out_bthd) {
    if (!out_bthd) return row;
    const size_t bh = row / Tq, i = row - bh * Tq, b = bh / H, h = bh - b * H;
    return (b * Tq + i) * H + h;
}

template <typename T, int BK, int NO, int BR>
__global__ void __launch_bounds__(SDPA_NT)
sdpa_tile(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
          const void* __restrict__ mask, T* __restrict__ out,
          float* __restrict__ part_o, float* __restrict__ part_ml,
          int H, int Hk, int Tq, int Tk, int D, int Dv, int tiles_per_split, int vec4,
          int mkind, long long ms0, long long ms1, long long ms2, long long ms3,
          int causal, int causal_offset, float scale, int out_bthd GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    {   // The block's first key tile into L2 before the wait (cuda_common.cu l2_prefetch_block): in
        // a decode step the cache rows were last read a whole step ago, and the step's weights
        // have streamed through L2 since; the tile's loads after the wait then hit L2.
        const int j0 = blockIdx.z * tiles_per_split * BK;
        if (j0 < Tk) {
            const size_t first = (size_t)blockIdx.y * Tk + j0;
            const long long nk = Tk - j0 < BK ? Tk - j0 : BK;
            l2_prefetch_block(k + first * D, nk * D * (long long)sizeof(T));
            l2_prefetch_block(v + first * Dv, nk * Dv * (long long)sizeof(T));
        }
    }
    grid_dep_wait();  // see cuda_common.cu: only L2 prefetches before it
    constexpr int RSTEP = SDPA_NT / BK;   // rows between one thread's score entries
    constexpr int NS = BR / RSTEP;   // score entries per thread
    extern __shared__ float sm[];
    const int QS = D + 1, KS = D + 1, SS = BK + 1;
    float* qs = sm;                      // [BR][D+1] queries times scale
    float* ks = qs + BR * QS;       // [BK][D+1]
    float* vs = ks + BK * KS;            // [BK][Dv]
    float* ss = vs + BK * Dv;            // [BR][BK+1] scores, then probabilities
    float* rm = ss + BR * SS;       // [BR] running max
    float* rl = rm + BR;            // [BR] running sum
    float* ra = rl + BR;            // [BR] rescale of the accumulators by this tile

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = H / Hk, R = G * Tq;
    const int bk = blockIdx.y, b = bk / Hk, hk = bk - b * Hk;
    const int r_first = blockIdx.x * BR;
    const size_t row0 = (size_t)(b * H + hk * G) * Tq + r_first;  // first q/out row of this block
    const T* kp = k + (size_t)bk * Tk * D;
    const T* vp = v + (size_t)bk * Tk * Dv;

    for (int e = tid; e < BR * D; e += SDPA_NT) {
        const int r = e / D, d = e - r * D;
        qs[r * QS + d] = r_first + r < R ? ld(q[row0 * D + e]) * scale : 0.f;
    }
    if (tid < BR) { rm[tid] = neg_inf(); rl[tid] = 0.f; ra[tid] = 1.f; }

    // Head and query index of this thread's score rows (irow -1: past the group's rows).
    const int c = tid % BK, r0 = tid / BK;
    int hrow[NS], irow[NS];
#pragma unroll
    for (int n = 0; n < NS; ++n) {
        const int rr = r_first + r0 + n * RSTEP;
        const int g = rr / Tq;
        irow[n] = rr < R ? rr - g * Tq : -1;
        hrow[n] = hk * G + g;
    }
    float acc[NO];
#pragma unroll
    for (int n = 0; n < NO; ++n) acc[n] = 0.f;

    const int ntiles = (Tk + BK - 1) / BK;
    const int t_begin = blockIdx.z * tiles_per_split;
    const int t_end = ntiles < t_begin + tiles_per_split ? ntiles : t_begin + tiles_per_split;
    for (int t = t_begin; t < t_end; ++t) {
        const int j0 = t * BK, j = j0 + c;
        // Visibility (causal, mask, key range) of this thread's entries, before any key is read.
        float bias[NS];
        int any = 0;
#pragma unroll
        for (int n = 0; n < NS; ++n) {
            bool keep = irow[n] >= 0 && j < Tk && (!causal || j <= irow[n] + causal_offset);
            float bv = 0.f;
            if (keep && mkind != 0) {
                const long long off = b * ms0 + hrow[n] * ms1 + irow[n] * ms2 + j * ms3;
                if (mkind == 1) keep = ((const unsigned int*)mask)[off] != 0u;
                else if (mkind == 2) bv = ((const float*)mask)[off];
                else bv = ld(((const half_t*)mask)[off]);
            }
            bias[n] = keep ? bv : neg_inf();
            any |= (int)keep;
        }
        // Also the barrier that ends the previous tile's reads of ks/vs/ss.
        if (!__syncthreads_or(any)) continue;

        const int nk = Tk - j0 < BK ? Tk - j0 : BK;
        // Keys past Tk are zeros: their probability is 0, and 0 * garbage could be NaN.
        if (vec4) {  // 4 elements per load: a quarter of the load instructions in flight
            const int D4 = D >> 2, Dv4 = Dv >> 2;
            for (int e = tid; e < BK * D4; e += SDPA_NT) {
                const int cc = e / D4, d = (e - cc * D4) * 4;
                float x[4] = {0.f, 0.f, 0.f, 0.f};
                if (cc < nk) ld4(kp + (size_t)(j0 + cc) * D + d, x);
                float* dst = ks + cc * KS + d;
                dst[0] = x[0]; dst[1] = x[1]; dst[2] = x[2]; dst[3] = x[3];
            }
            for (int e = tid; e < BK * Dv4; e += SDPA_NT) {
                float x[4] = {0.f, 0.f, 0.f, 0.f};
                if (e / Dv4 < nk) ld4(vp + (size_t)j0 * Dv + 4 * e, x);
                vs[4 * e] = x[0]; vs[4 * e + 1] = x[1]; vs[4 * e + 2] = x[2]; vs[4 * e + 3] = x[3];
            }
        } else {
            for (int e = tid; e < BK * D; e += SDPA_NT) {
                const int cc = e / D, d = e - cc * D;
                ks[cc * KS + d] = cc < nk ? ld(kp[(size_t)j0 * D + e]) : 0.f;
            }
            for (int e = tid; e < BK * Dv; e += SDPA_NT) vs[e] = e / Dv < nk ? ld(vp[(size_t)j0 * Dv + e]) : 0.f;
        }
        __syncthreads();

        float s[NS];
#pragma unroll
        for (int n = 0; n < NS; ++n) s[n] = 0.f;
        const float* kr = ks + c * KS;
        for (int d = 0; d < D; ++d) {
            const float kv = kr[d];
#pragma unroll
            for (int n = 0; n < NS; ++n) s[n] += qs[(r0 + n * RSTEP) * QS + d] * kv;
        }
#pragma unroll
        for (int n = 0; n < NS; ++n) ss[(r0 + n * RSTEP) * SS + c] = s[n] + bias[n];
        __syncthreads();

        // Online softmax, one warp per row: a lane holds keys lane and lane + 32 (8 <= BK <= 64).
        for (int r = warp; r < BR; r += SDPA_NT / 32) {
            const float x0 = lane < BK ? ss[r * SS + lane] : neg_inf();
            const float x1 = lane + 32 < BK ? ss[r * SS + lane + 32] : neg_inf();
            const float mo = rm[r];
            const float mn = fmaxf(mo, warp_max(fmaxf(x0, x1)));
            float p0 = 0.f, p1 = 0.f, alpha = 1.f;
            if (mn != neg_inf()) {
                alpha = expf(mo - mn);
                p0 = expf(x0 - mn);
                p1 = expf(x1 - mn);
            } else {  // nothing seen yet: l stays 0 (a dead row, zeros), but fmaxf skipped NaN scores
                p0 = isnan(x0) ? x0 : 0.f;  // and they must still make the row NaN
                p1 = isnan(x1) ? x1 : 0.f;
            }
            const float ps = warp_sum(p0 + p1);  // every lane has read rm[r] before this
            if (lane < BK) ss[r * SS + lane] = p0;
            if (lane + 32 < BK) ss[r * SS + lane + 32] = p1;
            if (lane == 0) {
                rm[r] = mn;
                rl[r] = rl[r] * alpha + ps;
                ra[r] = alpha;
            }
        }
        __syncthreads();

#pragma unroll
        for (int n = 0; n < NO; ++n) {
            const int e = tid + n * SDPA_NT;
            if (e < BR * Dv) {
                const int r = e / Dv, d = e - r * Dv;
                const float* pr = ss + r * SS;
                float a = acc[n] * ra[r];
                for (int cc = 0; cc < nk; ++cc) a += pr[cc] * vs[cc * Dv + d];
                acc[n] = a;
            }
        }
    }
    __syncthreads();  // rm/rl final for every row, also when every tile was skipped

    const size_t rows_total = (size_t)(gridDim.y / Hk) * H * Tq;
#pragma unroll
    for (int n = 0; n < NO; ++n) {
        const int e = tid + n * SDPA_NT;
        if (e < BR * Dv) {
            const int r = e / Dv, d = e - r * Dv;
            if (r_first + r < R) {
                const size_t row = row0 + r;
                if (gridDim.z == 1) {
                    st(&out[sdpa_out_row(row, H, Tq, out_bthd) * Dv + d], safe_div(acc[n], rl[r]));
                } else {
                    const size_t pr = (size_t)blockIdx.z * rows_total + row;
                    part_o[pr * Dv + d] = acc[n];
                    if (d == 0) {
                        part_ml[2 * pr] = rm[r];
                        part_ml[2 * pr + 1] = rl[r];
                    }
                }
            }
        }
    }
}

// Splits whose partials sdpa_combine loads together (see there).
#define SDPA_COMBINE_CHUNK 16

// A chunk of SDPA_COMBINE_CHUNK splits' partials of (row, e) from split s0 on: m, l and o, the
// loads all issued before any is used (past the last split: m = -inf, l = o = 0).
__device__ __forceinline__ void sdpa_partials(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                              long long rows, long long row, long long e, int Dv, int splits,
                                              int s0, float* m, float* l, float* o) {
#pragma unroll
    for (int i = 0; i < SDPA_COMBINE_CHUNK; ++i) {
        const int s = s0 + i;
        const bool in = s < splits;
        m[i] = in ? part_ml[2 * (s * rows + row)] : neg_inf();
        l[i] = in ? part_ml[2 * (s * rows + row) + 1] : 0.f;
        o[i] = in ? part_o[s * rows * Dv + e] : 0.f;
    }
}

// Merges the splits of sdpa_tile: out = sum_s w_s o_s / sum_s w_s l_s with w_s = exp(m_s - M),
// M the largest m_s; a split that saw no key (m_s = -inf) weighs 0, a row no split saw gives zeros.
// The partials are loaded a chunk of splits at a time, each chunk's loads issued together: one
// split after another, a thread would wait one L2 round trip per load (~32 of them at 16
// splits, most of this launch's time); up to 16 splits it is one round trip. The arithmetic keeps
// its order: the max over every split, then both fmaf chains in split order.
template <typename T>
__global__ void sdpa_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                             T* __restrict__ out, long long rows, int Dv, int splits,
                             int H, int Tq, int out_bthd GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    grid_dep_wait();  // first: see cuda_common.cu
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= rows * Dv) return;
    const long long row = e / Dv;
    constexpr int C = SDPA_COMBINE_CHUNK;
    float m0[C], l0[C], o0[C];  // the first chunk, kept for the sums
    sdpa_partials(part_o, part_ml, rows, row, e, Dv, splits, 0, m0, l0, o0);
    float M = neg_inf();
#pragma unroll
    for (int i = 0; i < C; ++i) M = fmaxf(M, m0[i]);
    for (int s0 = C; s0 < splits; s0 += C) {
        float m[C], l[C], o[C];
        sdpa_partials(part_o, part_ml, rows, row, e, Dv, splits, s0, m, l, o);
#pragma unroll
        for (int i = 0; i < C; ++i) M = fmaxf(M, m[i]);
    }
    float L = 0.f, a = 0.f;
    // explicit fmaf: the o product's merge (cuda_quant.cu AttnSrc) rounds alike
#pragma unroll
    for (int i = 0; i < C; ++i)
        if (i < splits) {
            const float w = m0[i] == neg_inf() ? 0.f : expf(m0[i] - M);
            L = fmaf(w, l0[i], L);
            a = fmaf(w, o0[i], a);
        }
    for (int s0 = C; s0 < splits; s0 += C) {
        float m[C], l[C], o[C];
        sdpa_partials(part_o, part_ml, rows, row, e, Dv, splits, s0, m, l, o);
#pragma unroll
        for (int i = 0; i < C; ++i)
            if (s0 + i < splits) {
                const float w = m[i] == neg_inf() ? 0.f : expf(m[i] - M);
                L = fmaf(w, l[i], L);
                a = fmaf(w, o[i], a);
            }
    }
    st(&out[sdpa_out_row(row, H, Tq, out_bthd) * Dv + (e - row * Dv)], safe_div(a, L));
}

// ---------------------------------------------------------------------------------------------
// Decode attention whose keys are read before the wait (one query row, Tq = 1; the executor's
// fact, cuda_fused_ops.fresh_rows): the k and v caches hold, when the run begins, what the
// attention reads, except rows fresh_pos[0] .. fresh_pos[0] + fresh_n - 1, which a kernel of this
// run before it writes; fresh_pos is a run input no kernel of the run writes. So every other row
// is loaded while the kernel ahead still runs, and after griddepcontrol.wait only q, the mask and
// the fresh rows are read: one L2 round trip, where sdpa_tile waits for q, the mask and then its
// key tile, and sdpa_combine for the partials after a launch of its own.
//
// One block per (query head, batch), a thread per key (Tk <= SDPA_EK_KEYS), the key's k and v
// rows in the thread's registers (16-byte words, ld.global.cg: L2 only, so the fresh rows'
// reload after the wait cannot meet a line the early load left in L1). A warp's 32 keys give a
// softmax over the warp (its max m_w, sum l_w: shuffles) and their p v summed over the warp by a
// transpose-reduce (each of 5 steps halves the vector a lane holds and swaps the other half with
// the lane o apart: lane l ends with dims DV/32 l .. DV/32 (l+1) - 1); the warps' (m_w, l_w, o_w)
// merge as sdpa_combine merges splits. Two block barriers: q into shared memory, the warps'
// partials. A key no row may see (mask, causal, past Tk) adds nothing, not even 0 * v.
#define SDPA_EK_KEYS 256

__device__ __forceinline__ uint4 ld_cg16(const void* p) {
    uint4 r;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ int ld_cg_s32(const int* p) {
    int r;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}
// The elements of one 16-byte word, widened: 4 floats or 8 halves.
__device__ __forceinline__ void widen16(const uint4& w, float* x, float) {
    x[0] = __uint_as_float(w.x); x[1] = __uint_as_float(w.y); x[2] = __uint_as_float(w.z); x[3] = __uint_as_float(w.w);
}
__device__ __forceinline__ void widen16(const uint4& w, float* x, half_t) {
    const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        x[2 * i] = ld((half_t)(u[i] & 0xffffu));
        x[2 * i + 1] = ld((half_t)(u[i] >> 16));
    }
}

// Sums a[0 .. N-1] of the warp's lanes, transposed: the step of lane distance O keeps the half
// of the vector that lane's bit O selects and adds the other half of the lane O apart, so after
// the steps O = 16 .. 1 lane l holds the warp's sums of dims N/32 l .. N/32 (l+1) - 1 in
// a[0 .. N/32 - 1] (N/2 + N/4 + ... shuffles, not N x 5). A template, so that every index is a
// constant and a stays in registers.
template <int N, int O>
struct WarpTransposeSum {
    static __device__ __forceinline__ void run(float* a, int lane) {
        constexpr int n = N / 2;
        const bool up = (lane & O) != 0;
#pragma unroll
        for (int i = 0; i < n; ++i) {
            const float send = up ? a[i] : a[i + n];
            const float mine = up ? a[i + n] : a[i];
            a[i] = mine + __shfl_xor_sync(0xffffffffu, send, O);
        }
        WarpTransposeSum<n, O / 2>::run(a, lane);
    }
};
template <int N>
struct WarpTransposeSum<N, 0> {
    static __device__ __forceinline__ void run(float*, int) {}
};

template <typename T, int D, int DV>
__global__ void __launch_bounds__(SDPA_EK_KEYS)
sdpa_early_keys(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                const void* __restrict__ mask, T* __restrict__ out, const int* __restrict__ fresh_pos,
                int H, int Hk, int Tk, int fresh_n, int mkind, long long ms0, long long ms1, long long ms2,
                long long ms3, int causal, int causal_offset, float scale, int out_bthd GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    constexpr int EW = 16 / sizeof(T);            // elements of a 16-byte word
    constexpr int KW = D / EW, VW = DV / EW;      // words of a k / v row
    constexpr int NW = SDPA_EK_KEYS / 32, R = DV / 32;
    __shared__ float qs[D];                       // q times scale
    __shared__ float po[NW][DV];                  // each warp's sum of p v
    __shared__ float pml[NW][2];                  // each warp's max and sum of p
    const int j = threadIdx.x, lane = j & 31, warp = j >> 5;
    const int h = blockIdx.x, b = blockIdx.y, hk = h / (H / Hk);
    const size_t row = (size_t)b * H + h;         // q / out row (Tq = 1)
    const size_t kv = ((size_t)b * Hk + hk) * Tk + j;
    const bool in = j < Tk;
    uint4 kw[KW], vw[VW];
    const int p0 = ld_cg_s32(fresh_pos);
#pragma unroll
    for (int i = 0; i < KW; ++i) kw[i] = in ? ld_cg16(k + kv * D + i * EW) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int i = 0; i < VW; ++i) vw[i] = in ? ld_cg16(v + kv * DV + i * EW) : make_uint4(0u, 0u, 0u, 0u);
    grid_dep_wait();  // see cuda_common.cu; only rows and the position the run does not write before it
    if (in && j >= p0 && (long long)j - p0 < fresh_n) {  // written by a kernel ahead: read again
#pragma unroll
        for (int i = 0; i < KW; ++i) kw[i] = ld_cg16(k + kv * D + i * EW);
#pragma unroll
        for (int i = 0; i < VW; ++i) vw[i] = ld_cg16(v + kv * DV + i * EW);
    }
    for (int d = j; d < D; d += blockDim.x) qs[d] = ld(q[row * D + d]) * scale;
    bool keep = in && (!causal || j <= causal_offset);
    float bias = 0.f;
    if (keep && mkind != 0) {
        const long long off = b * ms0 + h * ms1 + j * ms3;  // query index 0: ms2 unused
        if (mkind == 1) keep = ((const unsigned int*)mask)[off] != 0u;
        else if (mkind == 2) bias = ((const float*)mask)[off];
        else bias = ld(((const half_t*)mask)[off]);
    }
    __syncthreads();

    float s4[4] = {0.f, 0.f, 0.f, 0.f};  // four chains: the dot is latency, not issue, bound
#pragma unroll
    for (int i = 0; i < KW; ++i) {
        float x[EW];
        widen16(kw[i], x, T());
#pragma unroll
        for (int e = 0; e < EW; ++e) s4[e & 3] = fmaf(qs[i * EW + e], x[e], s4[e & 3]);
    }
    const float s = keep ? (s4[0] + s4[1]) + (s4[2] + s4[3]) + bias : neg_inf();
    const float m = warp_max(s);
    // nothing seen by the warp: its l stays 0 (weight 0 in the merge), but fmaxf skipped NaN
    // scores and they must still make the row NaN
    const float p = m != neg_inf() ? expf(s - m) : (isnan(s) ? s : 0.f);
    const float l = warp_sum(p);

    float a[DV];
#pragma unroll
    for (int i = 0; i < VW; ++i) {
        float x[EW];
        widen16(vw[i], x, T());
#pragma unroll
        for (int e = 0; e < EW; ++e) a[i * EW + e] = keep ? p * x[e] : 0.f;
    }
    WarpTransposeSum<DV, 16>::run(a, lane);
#pragma unroll
    for (int i = 0; i < R; ++i) po[warp][R * lane + i] = a[i];
    if (lane == 0) { pml[warp][0] = m; pml[warp][1] = l; }
    __syncthreads();

    const int nw = blockDim.x >> 5;
    for (int d = j; d < DV; d += blockDim.x) {
        float M = neg_inf();
        for (int w = 0; w < nw; ++w) M = fmaxf(M, pml[w][0]);
        float L = 0.f, A = 0.f;
        for (int w = 0; w < nw; ++w) {
            const float wt = pml[w][0] == neg_inf() ? 0.f : expf(pml[w][0] - M);
            L = fmaf(wt, pml[w][1], L);
            A = fmaf(wt, po[w][d], A);
        }
        st(&out[sdpa_out_row(row, H, 1, out_bthd) * DV + d], safe_div(A, L));
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core variant for float16 storage (prefill: many query rows per kv head, one split).
// Same contract and visit order as sdpa_tile; the two products run on mma.sync.m16n8k16
// (fp16 operands, fp32 accumulation), FlashAttention-2 style: 4 warps, each owns 16 of the
// block's 64 query rows; Q fragments stay in registers for the whole key loop; S = Q K^T lands in
// accumulator fragments that, scaled, masked and exponentiated in fp32, are rounded to fp16 and
// reused in registers as the A operand of P V (the C layout of two n8 tiles is the A layout of
// one k16 step). Softmax statistics live in registers: a row is spread over the 4 lanes of a quad.
// Fragment layouts (PTX ISA, mma.m16n8k16 .f16): with g = lane / 4, t = lane % 4,
//   A (16x16, row): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8, col):  b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C (16x8, f32):  c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
// Shared memory (halves): Q [64][D+8], K [64][D+8], V transposed [Dv][64+8]; the +8 pads put the
// 32-bit fragment reads of a warp on 32 distinct banks. Needs D % 16 == 0, Dv % 16 == 0,
// D, Dv <= 128 and 16-byte aligned q, k, v (native/cuda_kernels.py checks).

#define SDPA_MMA_BR 64
#define SDPA_MMA_BK 64

__device__ __forceinline__ void mma_16816(float* c, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
    half_t l, h;
    st(&l, lo);
    st(&h, hi);
    return (unsigned)l | ((unsigned)h << 16);
}

template <int DK, int DV>  // head dims rounded up to 16 (register arrays); D, Dv at run time
__global__ void __launch_bounds__(128)
sdpa_mma(const half_t* __restrict__ q, const half_t* __restrict__ k, const half_t* __restrict__ v,
         const void* __restrict__ mask, half_t* __restrict__ out,
         int H, int Hk, int Tq, int Tk, int D, int Dv,
         int mkind, long long ms0, long long ms1, long long ms2, long long ms3,
         int causal, int causal_offset, float scale, int out_bthd GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    grid_dep_wait();  // first: see cuda_common.cu
    constexpr int BR = SDPA_MMA_BR, BK = SDPA_MMA_BK, NT = BK / 8;
    extern __shared__ float sm[];
    half_t* qs = reinterpret_cast<half_t*>(sm);
    const int QS = D + 8, VS = BK + 8;
    half_t* ks = qs + BR * QS;
    half_t* vt = ks + BK * QS;  // [Dv][BK+8]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int G = H / Hk, R = G * Tq;
    const int bk = blockIdx.y, b = bk / Hk, hk = bk - b * Hk;
    const int r_first = blockIdx.x * BR;
    const size_t row0 = (size_t)(b * H + hk * G) * Tq + r_first;
    const half_t* kp = k + (size_t)bk * Tk * D;
    const half_t* vp = v + (size_t)bk * Tk * Dv;

    // Q tile, 8 halves per load; rows past the group are zeros.
    const int D8 = D >> 3, Dv8 = Dv >> 3;
    for (int e = tid; e < BR * D8; e += 128) {
        const int r = e / D8, d = (e - r * D8) * 8;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (r_first + r < R) x = *reinterpret_cast<const uint4*>(q + (row0 + r) * D + d);
        *reinterpret_cast<uint4*>(qs + r * QS + d) = x;
    }
    __syncthreads();
    unsigned qf[DK / 16][4];
    const int wr = warp * 16;  // this warp's first row in the block
#pragma unroll
    for (int s = 0; s < DK / 16; ++s) {
        if (s * 16 < D) {
            qf[s][0] = *reinterpret_cast<const unsigned*>(qs + (wr + g) * QS + s * 16 + 2 * t);
            qf[s][1] = *reinterpret_cast<const unsigned*>(qs + (wr + g + 8) * QS + s * 16 + 2 * t);
            qf[s][2] = *reinterpret_cast<const unsigned*>(qs + (wr + g) * QS + s * 16 + 2 * t + 8);
            qf[s][3] = *reinterpret_cast<const unsigned*>(qs + (wr + g + 8) * QS + s * 16 + 2 * t + 8);
        }
    }
    // Head and query index of this lane's two rows (g and g + 8 of the warp's 16).
    int hrow[2], irow[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int rr = r_first + wr + g + 8 * u;
        const int gg = rr / Tq;
        irow[u] = rr < R ? rr - gg * Tq : -1;
        hrow[u] = hk * G + gg;
    }
    float o[DV / 8][4];
#pragma unroll
    for (int n = 0; n < DV / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float mrow[2] = {neg_inf(), neg_inf()}, lrow[2] = {0.f, 0.f};  // l: this lane's partial sum

    const int ntiles = (Tk + BK - 1) / BK;
    for (int tile = 0; tile < ntiles; ++tile) {
        const int j0 = tile * BK;
        // Visibility of this lane's entries: [n-tile][c index], c = 2 * row half + column.
        float bias[NT][4];
        int any = 0;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int u = c >> 1, j = j0 + n * 8 + 2 * t + (c & 1);
                bool keep = irow[u] >= 0 && j < Tk && (!causal || j <= irow[u] + causal_offset);
                float bv = 0.f;
                if (keep && mkind != 0) {
                    const long long off = b * ms0 + hrow[u] * ms1 + irow[u] * ms2 + j * ms3;
                    if (mkind == 1) keep = ((const unsigned int*)mask)[off] != 0u;
                    else if (mkind == 2) bv = ((const float*)mask)[off];
                    else bv = ld(((const half_t*)mask)[off]);
                }
                bias[n][c] = keep ? bv : neg_inf();
                any |= (int)keep;
            }
        }
        if (!__syncthreads_or(any)) continue;  // also ends the previous tile's reads of ks / vt

        const int nk = Tk - j0 < BK ? Tk - j0 : BK;
        for (int e = tid; e < BK * D8; e += 128) {
            const int c = e / D8, d = (e - c * D8) * 8;
            uint4 x = make_uint4(0u, 0u, 0u, 0u);
            if (c < nk) x = *reinterpret_cast<const uint4*>(kp + (size_t)(j0 + c) * D + d);
            *reinterpret_cast<uint4*>(ks + c * QS + d) = x;
        }
        for (int e = tid; e < BK * Dv8; e += 128) {
            const int c = e / Dv8, d = (e - c * Dv8) * 8;
            uint4 x = make_uint4(0u, 0u, 0u, 0u);  // keys past Tk: zeros (0 * garbage could be NaN)
            if (c < nk) x = *reinterpret_cast<const uint4*>(vp + (size_t)(j0 + c) * Dv + d);
            const unsigned w4[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                vt[(d + 2 * i) * VS + c] = (half_t)(w4[i] & 0xffffu);
                vt[(d + 2 * i + 1) * VS + c] = (half_t)(w4[i] >> 16);
            }
        }
        __syncthreads();

        // S = Q K^T for this warp's 16 rows x BK keys.
        float s[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < DK / 16; ++kk) {
                if (kk * 16 < D) {
                    const half_t* kr = ks + (n * 8 + g) * QS + kk * 16 + 2 * t;
                    const unsigned bf[2] = {*reinterpret_cast<const unsigned*>(kr),
                                            *reinterpret_cast<const unsigned*>(kr + 8)};
                    mma_16816(s[n], qf[kk], bf);
                }
            }
        }
        // Online softmax over the tile; a row's 64 scores sit in the 4 lanes of a quad.
        float alpha[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            float mt = neg_inf();
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                s[n][2 * u] = s[n][2 * u] * scale + bias[n][2 * u];
                s[n][2 * u + 1] = s[n][2 * u + 1] * scale + bias[n][2 * u + 1];
                mt = fmaxf(mt, fmaxf(s[n][2 * u], s[n][2 * u + 1]));
            }
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
            const float mn = fmaxf(mrow[u], mt);
            float ps = 0.f;
            alpha[u] = 1.f;
            if (mn != neg_inf()) {
                alpha[u] = expf(mrow[u] - mn);
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    s[n][2 * u] = expf(s[n][2 * u] - mn);
                    s[n][2 * u + 1] = expf(s[n][2 * u + 1] - mn);
                    ps += s[n][2 * u] + s[n][2 * u + 1];
                }
            } else {  // nothing seen yet: zeros, except NaN scores (fmaxf skipped them), kept NaN
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    s[n][2 * u] = isnan(s[n][2 * u]) ? s[n][2 * u] : 0.f;
                    s[n][2 * u + 1] = isnan(s[n][2 * u + 1]) ? s[n][2 * u + 1] : 0.f;
                    ps += s[n][2 * u] + s[n][2 * u + 1];
                }
            }
            mrow[u] = mn;
            lrow[u] = lrow[u] * alpha[u] + ps;
        }
#pragma unroll
        for (int n = 0; n < DV / 8; ++n) {
            o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
            o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
        }
        // O += P V: P's k16 step kk is the C fragments of n-tiles 2kk and 2kk+1.
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            const unsigned pa[4] = {pack_half2(s[2 * kk][0], s[2 * kk][1]), pack_half2(s[2 * kk][2], s[2 * kk][3]),
                                    pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < DV / 8; ++n) {
                if (n * 8 < Dv) {
                    const half_t* vr = vt + (n * 8 + g) * VS + kk * 16 + 2 * t;
                    const unsigned bf[2] = {*reinterpret_cast<const unsigned*>(vr),
                                            *reinterpret_cast<const unsigned*>(vr + 8)};
                    mma_16816(o[n], pa, bf);
                }
            }
        }
    }

#pragma unroll
    for (int u = 0; u < 2; ++u) {
        float l = lrow[u];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int r = wr + g + 8 * u;
        if (r_first + r < R) {
            half_t* op = out + sdpa_out_row(row0 + r, H, Tq, out_bthd) * Dv;
#pragma unroll
            for (int n = 0; n < DV / 8; ++n) {
                if (n * 8 < Dv) {
                    st(&op[n * 8 + 2 * t], safe_div(o[n][2 * u], l));  // l = 0 (row fully masked): 0
                    st(&op[n * 8 + 2 * t + 1], safe_div(o[n][2 * u + 1], l));
                }
            }
        }
    }
}
