// Kernels on packed GGUF block weights (core/dtypes.py QUANT_BLOCKS), launched by
// native/cuda_quant.py. Blocks of 32 values of one row, stored as llama.cpp's ggml-common.h lays
// them out (QT is the template index of the type):
//   QT 0  q4_0: f16 d, 16 bytes of nibbles          (18 bytes)  x = (q - 8) * d
//   QT 1  q4_1: f16 d, f16 m, 16 bytes of nibbles   (20 bytes)  x = q * d + m
//   QT 2  q8_0: f16 d, 32 int8                      (34 bytes)  x = q * d
// Byte j of the nibbles holds value j (low nibble) and value j + 16 (high nibble).
//
// Blocks of 18 and 34 bytes are only 2-byte aligned (q4_1's 20 bytes are 4-byte aligned: qgemv41
// reads those as 32-bit words), so a block is read as 16-bit words, and a block is cut into 4 "items" of 8 values that one thread
// decodes from 4 or 8 bytes:
//   q4: item t = nibble bytes 4t..4t+3: values 4t..4t+3 (low nibbles), 16+4t..16+4t+3 (high)
//   q8: item t = bytes 8t..8t+7:        values 8t..8t+3, 8t+4..8t+7
// Every dequantized value is exactly gguf's float32 one: d * q is exact in float32 (an 11-bit
// significand times at most 8 bits), so q4_1's d * q + m rounds once, fused or not.
//
// NVRTC is given no include path: the helpers of cuda_common.cu (ld, st, warp_sum) and of
// cuda_norm_prologue.cu (norm_prologue, PlainSrc, NormSrc) are prepended.

#define QK 32
#define QV_WARPS 4   // warps of one qgemv block (QV_WARPS in native/cuda_quant.py)

template <int QT> struct QBlock;
template <> struct QBlock<0> { enum { BYTES = 18 }; };
template <> struct QBlock<1> { enum { BYTES = 20 }; };
template <> struct QBlock<2> { enum { BYTES = 34 }; };

// Byte i of v as an exact float minus `bias`: 0x4B0000bb is the float 2^23 + bb, and the
// subtraction of 2^23 + bias is exact for these small integers (cheaper than an I2F per value).
template <int I>
__device__ __forceinline__ float byte_f(unsigned int v, float bias) {
    return __int_as_float(__byte_perm(v, 0x4B000000u, 0x7440u | I)) - bias;
}

// The bytes of a (v[0..3]) and then of b (v[4..7]) as exact floats minus `bias`.
__device__ __forceinline__ void bytes8(unsigned int a, unsigned int b, float bias, float v[8]) {
    v[0] = byte_f<0>(a, bias); v[1] = byte_f<1>(a, bias); v[2] = byte_f<2>(a, bias); v[3] = byte_f<3>(a, bias);
    v[4] = byte_f<0>(b, bias); v[5] = byte_f<1>(b, bias); v[6] = byte_f<2>(b, bias); v[7] = byte_f<3>(b, bias);
}

// sum v[i] * x[i] over 8 values in two interleaved chains (halves the chain of dependent FMAs a
// lane waits on), added at the end.
__device__ __forceinline__ float dot8(const float v[8], const float x[8]) {
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
        s0 = fmaf(v[i], x[i], s0);
        s1 = fmaf(v[i + 1], x[i + 1], s1);
    }
    return s0 + s1;
}

// The 16-bit words hw[i], hw[i + 1] as one 32-bit little-endian word.
__device__ __forceinline__ unsigned int word32(const unsigned short* hw, int i) {
    return (unsigned int)hw[i] | ((unsigned int)hw[i + 1] << 16);
}

// Item t of the block at b (2-byte aligned, global or shared memory): w[0..3] are the values at
// pos0(t).., w[4..7] those at pos1(t)..
template <int QT> __device__ __forceinline__ void decode(const unsigned char* b, int t, float w[8]);

template <> __device__ __forceinline__ void decode<0>(const unsigned char* b, int t, float w[8]) {
    const unsigned short* hw = reinterpret_cast<const unsigned short*>(b);
    const float d = ld((half_t)hw[0]);
    const unsigned int q = word32(hw, 1 + 2 * t);
    const unsigned int lo = q & 0x0F0F0F0Fu, hi = (q >> 4) & 0x0F0F0F0Fu;
    bytes8(lo, hi, 8388616.f, w);  // 2^23 + 8: the value q - 8
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] *= d;
}

template <> __device__ __forceinline__ void decode<1>(const unsigned char* b, int t, float w[8]) {
    const unsigned short* hw = reinterpret_cast<const unsigned short*>(b);
    const float d = ld((half_t)hw[0]), m = ld((half_t)hw[1]);
    const unsigned int q = word32(hw, 2 + 2 * t);
    const unsigned int lo = q & 0x0F0F0F0Fu, hi = (q >> 4) & 0x0F0F0F0Fu;
    bytes8(lo, hi, 8388608.f, w);  // 2^23: the value q
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = fmaf(w[i], d, m);
}

template <> __device__ __forceinline__ void decode<2>(const unsigned char* b, int t, float w[8]) {
    const unsigned short* hw = reinterpret_cast<const unsigned short*>(b);
    const float d = ld((half_t)hw[0]);
    // int8 q xor 0x80 is the unsigned q + 128
    const unsigned int q0 = word32(hw, 1 + 4 * t) ^ 0x80808080u, q1 = word32(hw, 3 + 4 * t) ^ 0x80808080u;
    bytes8(q0, q1, 8388736.f, w);  // 2^23 + 128: the value q
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] *= d;
}

// Where item t's two runs of 4 values start inside the block.
template <int QT> __device__ __forceinline__ int pos0(int t) { return QT == 2 ? 8 * t : 4 * t; }
template <int QT> __device__ __forceinline__ int pos1(int t) { return QT == 2 ? 8 * t + 4 : 16 + 4 * t; }

// The 16 bytes at p (16-byte aligned) that lie inside [lo, hi), zeros elsewhere: the first and
// last word of a matrix whose start or end is not 16-byte aligned (the bytes beyond it may not
// belong to any allocation).
__device__ __noinline__ uint4 load_edge(const unsigned char* p, const unsigned char* lo, const unsigned char* hi) {
    unsigned int v[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < 16; ++i)
        if (p + i >= lo && p + i < hi) v[i >> 2] |= (unsigned int)p[i] << (8 * (i & 3));
    return make_uint4(v[0], v[1], v[2], v[3]);
}

// One chunk of a warp's rows into registers: blocks kb0 .. kb0+nb-1 of its nr rows, row r starting
// at byte w + base + r * rs (consecutive rows: rs = the row bytes; a gate row and its up row of a
// concatenated gate/up weight: rs = the distance between them, either sign; [w, wend) bounds the
// whole weight). Row r (a contiguous byte span) goes to words r*SW .. r*SW+SW-1 of the warp's stage, starting at the
// 16-byte word that holds its first byte, so the stage keeps every address's offset modulo 16
// (and with it the blocks' 2-byte alignment). Word q of the stage is lane q % 32's buf[q / 32]:
// each load is one coalesced 16-byte access, all of a lane's loads are issued before any is used.
template <int B, int SW, int U>
__device__ __forceinline__ void stage_load(uint4 buf[U], const unsigned char* w, const unsigned char* wend,
                                           long long base, long long rs, int nr, int kb0, int nb, int lane) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int q = lane + 32 * u;
        const int r = q / SW, j = q % SW;
        buf[u] = make_uint4(0u, 0u, 0u, 0u);
        if (r < nr) {
            const unsigned char* g = w + base + (long long)r * rs + (long long)kb0 * B;
            const unsigned char* p = reinterpret_cast<const unsigned char*>(
                (reinterpret_cast<unsigned long long>(g) & ~15ull) + 16ull * (unsigned long long)j);
            if (p < g + (long long)nb * B) {
                if (p >= w && p + 16 <= wend) buf[u] = __ldg(reinterpret_cast<const uint4*>(p));
                else buf[u] = load_edge(p, w, wend);
            }
        }
    }
}

// acc[m] += item t of the block at b (in the stage) . xv[m], for m < M. q4_0 and q8_0 sum q * x
// over the item and scale the sum by d once (one multiply per item instead of one per value);
// q4_1 dequantizes each value (d * q + m) first. Two partial sums halve the chain of dependent
// FMAs a lane waits on.
template <int QT, int MM>
__device__ __forceinline__ void item_dot(const unsigned char* b, int t, const float (*xv)[8], int M, float* acc) {
    const unsigned short* hw = reinterpret_cast<const unsigned short*>(b);
    float v[8];
    float d = ld((half_t)hw[0]);
    if (QT == 1) {
        decode<1>(b, t, v);
        d = 1.f;
    } else if (QT == 0) {
        const unsigned int q = word32(hw, 1 + 2 * t);
        const unsigned int lo = q & 0x0F0F0F0Fu, hi = (q >> 4) & 0x0F0F0F0Fu;
        bytes8(lo, hi, 8388616.f, v);  // q - 8
    } else {
        const unsigned int q0 = word32(hw, 1 + 4 * t) ^ 0x80808080u, q1 = word32(hw, 3 + 4 * t) ^ 0x80808080u;
        bytes8(q0, q1, 8388736.f, v);  // q
    }
#pragma unroll
    for (int m = 0; m < MM; ++m)
        if (m < M) {
            const float sum = dot8(v, xv[m]);
            acc[m] = QT == 1 ? acc[m] + sum : fmaf(sum, d, acc[m]);
        }
}

// The stores of a product without rotation pairs (EPI 0 and 1): nothing to place, nothing to store.
struct NoRope {
    struct Pre {};
    __device__ __forceinline__ void rows(int, long long&, long long&) const {}
    __device__ __forceinline__ Pre prefetch(int, int, int) const { return Pre{}; }
    __device__ __forceinline__ void store(int, int, float, float, const Pre&) const {}
};

// EPI 2: the planner's rope_kv group done by the q/k/v product itself (its q, k and v weights back
// to back, each a run of heads of D rows). Warp p owns rotation pair p: rows i and i + D/2 of head
// p / (D/2), i = p % (D/2), as its R = 2 rows. The lane that ends output m of the pair rounds both
// sums to T (the values the unfused chain stores in the product's scratch), rotates them as
// cuda_fused.cu rope_job does (rope jobs) and writes them where its job says: job j takes the
// heads after those of jobs < j (hmr_j = H_j | mode << 24 | rope << 25, dst_j a raw address); mode 0
// a contiguous [B, H_j, T, D] tensor, mode 1 rows pos[0] + t of a [B, H_j, S, D] cache (rows
// outside [0, S) skipped, as rope_job and kv_update do). Output row m of x is (b, t) = (m / T, m % T).
template <typename T, typename C>
struct RopeSink {
    unsigned long long dst[3];
    int hmr[3];
    const C* cs;
    const C* sn;
    const int* pos;
    int Tn, D, S;
    // the pair's first row and the distance to its second, in weight rows
    __device__ __forceinline__ void rows(int p, long long& first, long long& dist) const {
        const int half = D >> 1, h = p / half;
        first = (long long)h * D + (p - h * half);
        dist = half;
    }
    // What the lane that ends output row `lane` of pair p stores with, loaded before the product
    // so the tables' and the position's latency is not on the product's tail: the job's head,
    // destination and flags, the rotation's cos / sin values, the destination row.
    struct Pre {
        float ca, sa, cb, sb;  // cos / sin at (t, d) and (t, d + D/2)
        T* y;                  // the row's first element (null: a cache row outside [0, S))
        int d, rope;
    };
    __device__ __forceinline__ Pre prefetch(int p, int lane, int M) const {
        Pre q{1.f, 0.f, 1.f, 0.f, nullptr, 0, 0};
        const int half = D >> 1, hg = p / half;
        q.d = p - hg * half;
        if (lane >= M) return q;
        // the job of head hg (constant indices only: the fields stay in registers)
        int h = hg, hm = hmr[0];
        unsigned long long dj = dst[0];
        if (h >= (hmr[0] & 0xffffff)) {
            h -= hmr[0] & 0xffffff;
            hm = hmr[1];
            dj = dst[1];
            if (h >= (hmr[1] & 0xffffff)) {
                h -= hmr[1] & 0xffffff;
                hm = hmr[2];
                dj = dst[2];
            }
        }
        const int H = hm & 0xffffff, mode = (hm >> 24) & 1;
        const int b = lane / Tn, t = lane - b * Tn, d = q.d;
        q.rope = (hm >> 25) & 1;
        if (q.rope) {
            q.ca = ld(cs[t * D + d]);
            q.sa = ld(sn[t * D + d]);
            q.cb = ld(cs[t * D + d + half]);
            q.sb = ld(sn[t * D + d + half]);
        }
        if (mode == 0) {
            q.y = reinterpret_cast<T*>(dj) + ((long long)(b * H + h) * Tn + t) * D;
        } else {
            const long long s = (long long)pos[0] + t;
            if (s >= 0 && s < S) q.y = reinterpret_cast<T*>(dj) + ((long long)(b * H + h) * S + s) * D;
        }
        return q;
    }
    __device__ __forceinline__ void store(int, int, float a, float c, const Pre& q) const {
        if (q.y == nullptr) return;
        a = np_rnd(a, (const T*)0);  // the product's outputs as the unfused chain stores them
        c = np_rnd(c, (const T*)0);
        float ya = a, yc = c;
        if (q.rope) {  // rope_job's arithmetic, term for term
            ya = a * q.ca - c * q.sa;
            yc = c * q.cb + a * q.sb;
        }
        st(&q.y[q.d], ya);
        st(&q.y[q.d + (D >> 1)], yc);
    }
};

// The first weight row of a warp's row group and the distance between its rows (in rows): R
// consecutive rows from r0 (EPI 0), gate row g_row + r0 and up row u_row + r0 (EPI 1), the
// rotation pair r0 (EPI 2, rp's rows).
template <int EPI, typename Rp>
__device__ __forceinline__ void group_rows(int r0, int g_row, int u_row, const Rp& rp, long long& first,
                                           long long& dist) {
    first = r0;
    dist = 1;
    if (EPI == 1) {
        first = (long long)g_row + r0;
        dist = (long long)u_row - g_row;
    } else if (EPI == 2) {
        rp.rows(r0, first, dist);
    }
}

// The end of a warp's rows: warp-shuffle sums of acc, written by one lane each (+ bias), or for
// EPI 1 silu(gate) * up (see qgemv_body), for EPI 2 the rotated pair stored by rp (RopeSink).
template <typename T, int R, int MM, int EPI, typename Rp>
__device__ __forceinline__ void qgemv_store(const float (&acc)[R][MM], T* __restrict__ out, const void* __restrict__ bias,
                                            int bias_kind, int M, long long ldo, int r0, int nr, int lane,
                                            const Rp& rp, const typename Rp::Pre& pre) {
    if (EPI == 2) {
#pragma unroll
        for (int m = 0; m < MM; ++m) {
            const float a = warp_sum(acc[0][m]), c = warp_sum(acc[R - 1][m]);
            if (lane == m && m < M) rp.store(m, r0, a, c, pre);
        }
        return;
    }
    if (EPI == 1) {
#pragma unroll
        for (int m = 0; m < MM; ++m) {
            const float g = warp_sum(acc[0][m]), u = warp_sum(acc[R - 1][m]);
            if (lane == m && m < M) st(out + (long long)m * ldo + r0, g / (1.f + expf(-g)) * u);  // silu_mul's order
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MM; ++m) {
            const float v = warp_sum(acc[r][m]);  // every lane holds the row's sum
            if (lane == r * MM + m && r < nr && m < M) {
                const int n = r0 + r;
                float y = v;
                if (bias_kind == 1) y += reinterpret_cast<const float*>(bias)[n];
                else if (bias_kind == 2) y += ld(reinterpret_cast<const half_t*>(bias)[n]);
                st(out + (long long)m * ldo + n, y);
            }
        }
}

// out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for m < M <= MM (at most 8 rows of x), W packed
// [N, K] (K a multiple of 32, rows back to back). One warp computes R consecutive output rows
// (one block per QV_WARPS groups of R rows: many small blocks, so the hardware balances them over
// the SMs): it stages a chunk of their bytes (whole rows when they fit, else KC blocks of each)
// into shared memory with 16-byte loads, U per lane, then each lane decodes items (4 per block,
// strided over the lanes) of all R rows from there, each item's activations loaded once for the
// R rows, into fp32 accumulators; a warp-shuffle reduction ends the rows. When a row takes
// several chunks, the next chunk's loads are issued before the current one is decoded. The weight
// is read once for all M rows. x is [M, K] contiguous (16-byte aligned base); out row m starts at
// out + m * ldo. bias_kind: 0 none, 1 float, 2 half.
//
// EPI 1 (the planner's gate/up group, core/plan/fusion.py gemm_cat + silu_mul): W holds nw rows
// (gate and up back to back); warp n takes gate row g_row + n and up row u_row + n as its R = 2
// rows and writes out[m, n] = silu(x.gate) * (x.up) for n < N: both products and the MLP's
// silu * mul in one launch. EPI 0: N rows from row 0 (nw = N, g_row = u_row = 0).
//
// The body is qgemv_body, whose activations come from `src` (cuda_norm_prologue.cu): PlainSrc
// reads x (qgemv), NormSrc computes the rms-normed activations (qgemv_norm) after its
// block-wide prologue, which runs while each warp's first weight chunk is being loaded.
template <int QT, typename T, int R, int MM, int U, int EPI, typename Src, typename Rp>
__device__ __forceinline__ void qgemv_body(const unsigned char* __restrict__ w, const T* __restrict__ x, const Src& src,
                                           T* __restrict__ out,
                                           const void* __restrict__ bias, int bias_kind, int N, int K, int M,
                                           long long ldo, int nw, int g_row, int u_row, const Rp& rp) {
    enum { B = QBlock<QT>::BYTES, SW = 32 * U / R };
    // blocks per chunk: the span of nb blocks starts up to 15 bytes into its first word and ends
    // up to 15 bytes before the end of its last one
    enum { KC = (SW * 16 - 30) / B };
    static_assert(R * MM <= 32, "one lane writes each output of the warp");
    static_assert(KC >= 1, "a chunk holds at least one block");
    static_assert(EPI == 0 || R == 2, "silu * mul and a rotation pair a row with another");
    __shared__ uint4 stage[QV_WARPS][32 * U];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = (blockIdx.x * QV_WARPS + warp) * (EPI != 0 ? 1 : R);  // EPI 1: the output column, 2: the pair
    const int KB = K / QK;  // >= 1: the host handles K == 0 without a launch
    const bool active = r0 < N && KB != 0;  // warp-uniform
    const int nr = EPI != 0 ? 2 : min(R, N - r0);
    const long long rb = (long long)KB * B;
    long long first, dist;
    group_rows<EPI>(r0, g_row, u_row, rp, first, dist);
    const long long base = first * rb;  // the warp's row 0
    const long long rs = dist * rb;     // row r at base + r rs
    const unsigned char* wend = w + (long long)nw * rb;
    const unsigned char* sm = reinterpret_cast<const unsigned char*>(stage[warp]);

    float acc[R][MM];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MM; ++m) acc[r][m] = 0.f;

    uint4 buf[U];
    // the first chunk's weight loads before the wait, every thread waiting: as in q41_body
    if (active) stage_load<B, SW, U>(buf, w, wend, base, rs, nr, 0, min((int)KC, KB), lane);
    src.prefetch();  // the source's constants into L2 (NormSrc: the norm's weight)
    grid_dep_wait();
    if (!Src::PROLOGUE && !active) return;  // no block-wide barrier below without a prologue
    const typename Rp::Pre pre = rp.prefetch(r0, lane, active ? M : 0);  // EPI 2: its stores' operands
    // the source's block-wide prologue runs while the first chunk's loads are in flight
    src.prologue(x);
    if (!active) return;
    for (int kb0 = 0; kb0 < KB; kb0 += KC) {
        const int nb = min((int)KC, KB - kb0);
        __syncwarp();  // every lane is done reading the previous chunk
#pragma unroll
        for (int u = 0; u < U; ++u) stage[warp][lane + 32 * u] = buf[u];
        __syncwarp();
        if (kb0 + KC < KB) stage_load<B, SW, U>(buf, w, wend, base, rs, nr, kb0 + KC, min((int)KC, KB - kb0 - KC), lane);
        int soff[R];  // where row r's span begins in the stage
#pragma unroll
        for (int r = 0; r < R; ++r)
            soff[r] = r * SW * 16 +
                      (int)(reinterpret_cast<unsigned long long>(w + base + (long long)r * rs + (long long)kb0 * B) & 15ull);
#pragma unroll 2
        for (int it = lane; it < nb * 4; it += 32) {
            const int kb = it >> 2, t = it & 3;
            const int k = (kb0 + kb) * QK;
            float xv[MM][8];
#pragma unroll
            for (int m = 0; m < MM; ++m)
                if (m < M) {
                    src.load4(x, m, k, pos0<QT>(t), xv[m]);
                    src.load4(x, m, k, pos1<QT>(t), xv[m] + 4);
                }
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (r < nr) item_dot<QT, MM>(sm + soff[r] + kb * B, t, xv, M, acc[r]);
        }
    }
    qgemv_store<T, R, MM, EPI>(acc, out, bias, bias_kind, M, ldo, r0, nr, lane, rp, pre);
}

// qgemv for q4_1 without the shared-memory stage ("direct"). q4_1 blocks are 20 bytes, so every
// block, and its d|m half pair, starts 4-byte aligned: a lane reads the words it decodes straight
// from global memory. Lane l takes item t = l % 4 of block l / 4 of a group of 8 blocks (a warp
// instruction reads 8 consecutive blocks: 160 contiguous bytes), S groups per trip with all their
// loads (2 words per row per group: the d|m word, shared by the block's 4 lanes, and the item's
// nibble word) issued before any is used, and the next trip's loads issued before this trip is
// decoded (registers instead of the stage: no shared memory, no warp barrier).
// KS warps share a row group (KS > 1 for weights with few rows: more warps streaming): warp kw
// of them takes groups kw, kw + KS, kw + 2 KS, ...; their row sums meet in shared memory after a
// block barrier and the first adds them in order. The rows, the activations (src) and the
// epilogues are qgemv_body's.
// SPLIT 0 dequantizes each value (d * q + m, exactly gguf's float32 value) and sums value * x as
// qgemv_body does; SPLIT 1 sums q * x and x over the item and adds d * sum(q x) + m * sum(x)
// (the sum of x shared by the warp's R rows): a float32 rounding per term in another order, the
// same error class as the accumulation itself.
template <typename T, int R, int MM, int S, int KS, int EPI, int SPLIT, typename Src, typename Rp>
__device__ __forceinline__ void q41_body(const unsigned char* __restrict__ w, const T* __restrict__ x, const Src& src,
                                         T* __restrict__ out, const void* __restrict__ bias, int bias_kind, int N,
                                         int K, int M, long long ldo, int nw, int g_row, int u_row, const Rp& rp) {
    static_assert(R * MM <= 32, "one lane writes each output of the warp");
    static_assert(EPI == 0 || R == 2, "silu * mul and a rotation pair a row with another");
    static_assert(QV_WARPS % KS == 0, "a block holds whole row groups");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kw = warp % KS;  // the warp's share of the row group's blocks
    const int r0 = (blockIdx.x * (QV_WARPS / KS) + warp / KS) * (EPI != 0 ? 1 : R);
    const int KB = K / QK;
    const bool active = r0 < N && KB != 0;  // uniform over the KS warps of a row group
    const int nr = EPI != 0 ? 2 : min(R, N - r0);
    const long long rw = (long long)KB * 5;  // 32-bit words of a row
    long long first, dist;
    group_rows<EPI>(r0, g_row, u_row, rp, first, dist);
    const long long base = first * rw;
    const long long rs = dist * rw;
    const unsigned int* __restrict__ wq = reinterpret_cast<const unsigned int*>(w);
    const int t = lane & 3, bl = lane >> 2;
    const int G = (KB + 7) / 8;  // groups of 8 blocks in a row

    float acc[R][MM];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MM; ++m) acc[r][m] = 0.f;

    // trip j: groups kw + KS * (S j + s), s < S
    unsigned int dm[S][R], nq[S][R];
    auto load = [&](int j, unsigned int (&a)[S][R], unsigned int (&b)[S][R]) {
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const int kb = 8 * (kw + KS * (S * j + s)) + bl;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                a[s][r] = 0u;
                b[s][r] = 0u;
                if (kb < KB && r < nr) {
                    const unsigned int* p = wq + base + (long long)r * rs + (long long)kb * 5;
                    a[s][r] = __ldg(p);
                    b[s][r] = __ldg(p + 1 + t);
                }
            }
        }
    };
    const int trips = active && kw < G ? (G - kw + KS * S - 1) / (KS * S) : 0;
    // The first trip's weight loads go out BEFORE the wait (weights are never a kernel's output:
    // cuda_common.cu), so their DRAM latency overlaps the kernel before this one instead of
    // following it; for rows of at most S * KS groups of 8 blocks (SmolLM2's 576 and 1536) that
    // is every weight word the warp reads. Every thread waits (idle warps included, before they
    // leave) so the grid still ends only after its predecessor has: see grid_dep_wait.
    if (trips > 0) load(0, dm, nq);
    src.prefetch();  // the source's constants into L2 (NormSrc: the norm's weight)
    grid_dep_wait();
    // no block-wide barrier below without a prologue or a split row: idle warps may leave
    if (!Src::PROLOGUE && KS == 1 && !active) return;
    // EPI 2: its stores' operands (the position, the tables: run-written, so after the wait)
    const typename Rp::Pre pre = rp.prefetch(r0, lane, active && kw == 0 ? M : 0);
    src.prologue(x);  // the block-wide prologue runs while the first trip's loads are in flight
    if (!active && KS == 1) return;
    for (int j = 0; j < trips; ++j) {
        unsigned int ndm[S][R], nnq[S][R];
        if (j + 1 < trips) load(j + 1, ndm, nnq);
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const int kb = 8 * (kw + KS * (S * j + s)) + bl;
            if (kb < KB) {
                const int k = kb * QK;
                float xv[MM][8];
                float sx[MM];
#pragma unroll
                for (int m = 0; m < MM; ++m)
                    if (m < M) {
                        src.load4(x, m, k, 4 * t, xv[m]);
                        src.load4(x, m, k, 16 + 4 * t, xv[m] + 4);
                        if (SPLIT) sx[m] = ((xv[m][0] + xv[m][1]) + (xv[m][2] + xv[m][3])) +
                                           ((xv[m][4] + xv[m][5]) + (xv[m][6] + xv[m][7]));
                    }
#pragma unroll
                for (int r = 0; r < R; ++r)
                    if (r < nr) {
                        const float d = ld((half_t)(dm[s][r] & 0xffffu)), mn = ld((half_t)(dm[s][r] >> 16));
                        const unsigned int q = nq[s][r];
                        const unsigned int lo = q & 0x0F0F0F0Fu, hi = (q >> 4) & 0x0F0F0F0Fu;
                        float v[8];
                        bytes8(lo, hi, 8388608.f, v);  // 2^23: the value q
                        if (!SPLIT) {
#pragma unroll
                            for (int i = 0; i < 8; ++i) v[i] = fmaf(v[i], d, mn);
                        }
#pragma unroll
                        for (int m = 0; m < MM; ++m)
                            if (m < M) {
                                const float sum = dot8(v, xv[m]);
                                acc[r][m] = SPLIT ? fmaf(d, sum, fmaf(mn, sx[m], acc[r][m])) : acc[r][m] + sum;
                            }
                    }
            }
        }
#pragma unroll
        for (int s = 0; s < S; ++s)
#pragma unroll
            for (int r = 0; r < R; ++r) {
                dm[s][r] = ndm[s][r];
                nq[s][r] = nnq[s][r];
            }
    }
    // the row group's KS partial sums into its first warp (cuda_common.cu)
    if (KS > 1 && !ks_partials<R, MM, KS, QV_WARPS>(acc, warp, lane, active, kw)) return;
    qgemv_store<T, R, MM, EPI>(acc, out, bias, bias_kind, M, ldo, r0, nr, lane, rp, pre);
}

template <int QT, typename T, int R, int MM, int U, int EPI>
__global__ void __launch_bounds__(QV_WARPS * 32)
qgemv(const unsigned char* __restrict__ w, const T* __restrict__ x, T* __restrict__ out,
      const void* __restrict__ bias, int bias_kind, int N, int K, int M, long long ldo, int nw, int g_row,
      int u_row GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    // grid_dep_wait: in the body, after the first weight loads
    qgemv_body<QT, T, R, MM, U, EPI>(w, x, PlainSrc<T>{K}, out, bias, bias_kind, N, K, M, ldo, nw, g_row, u_row,
                                     NoRope{});
}

// qgemv with the rms-norm prologue (cuda_norm_prologue.cu): the activations are
// h = rms_norm(nx + ny) * nwt (ny null: rms_norm(nx); nwt null: no weight), computed by each lane
// from the block's inverse rms of the rows instead of read; block 0 writes the sum to ns (null:
// not kept). The same weight loads and FMA order over the same h values as qgemv on the unfused
// chain's h, so the outputs are equal.
template <int QT, typename T, typename W, int R, int MM, int U, int EPI>
__global__ void __launch_bounds__(QV_WARPS * 32)
qgemv_norm(const unsigned char* __restrict__ w, T* __restrict__ out, const void* __restrict__ bias, int bias_kind,
           int N, int K, int M, long long ldo, int nw, int g_row, int u_row, const T* __restrict__ nx,
           const T* __restrict__ ny, const W* __restrict__ nwt, T* __restrict__ ns, float eps, int vb GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    // grid_dep_wait: in the body, after the first weight loads
    __shared__ float rinv[NP_MAX_ROWS];
    qgemv_body<QT, T, R, MM, U, EPI>(w, nx, NormSrc<T, W>{ny, nwt, rinv, K, ns, M, vb, eps}, out, bias, bias_kind, N,
                                     K, M, ldo, nw, g_row, u_row, NoRope{});
}

// qgemv / qgemv_norm on q4_1 weights through q41_body (w 4-byte aligned). S: groups of 8 blocks a
// lane's loads cover per trip; KS: warps per row group.
template <typename T, int R, int MM, int S, int KS, int EPI, int SPLIT>
__global__ void __launch_bounds__(QV_WARPS * 32)
qgemv41(const unsigned char* __restrict__ w, const T* __restrict__ x, T* __restrict__ out,
        const void* __restrict__ bias, int bias_kind, int N, int K, int M, long long ldo, int nw, int g_row,
        int u_row GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    // grid_dep_wait: in the body, after the first weight loads
    q41_body<T, R, MM, S, KS, EPI, SPLIT>(w, x, PlainSrc<T>{K}, out, bias, bias_kind, N, K, M, ldo, nw, g_row, u_row,
                                          NoRope{});
}

template <typename T, typename W, int R, int MM, int S, int KS, int EPI, int SPLIT>
__global__ void __launch_bounds__(QV_WARPS * 32)
qgemv41_norm(const unsigned char* __restrict__ w, T* __restrict__ out, const void* __restrict__ bias, int bias_kind,
             int N, int K, int M, long long ldo, int nw, int g_row, int u_row, const T* __restrict__ nx,
             const T* __restrict__ ny, const W* __restrict__ nwt, T* __restrict__ ns, float eps, int vb GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    // grid_dep_wait: in the body, after the first weight loads
    __shared__ float rinv[NP_MAX_ROWS];
    q41_body<T, R, MM, S, KS, EPI, SPLIT>(w, nx, NormSrc<T, W>{ny, nwt, rinv, K, ns, M, vb, eps}, out, bias, bias_kind,
                                      N, K, M, ldo, nw, g_row, u_row, NoRope{});
}

// The q/k/v product with its rope_kv group (EPI 2, RopeSink): N rotation pairs (half the weight's
// rows), one a warp, no output but the sink's. qgemv41_rope / qgemv_rope read x, the _norm_
// variants compute it with the rms-norm prologue (NormSrc). The rope_kv launch after the product
// goes away, and with it the product's scratch.
#define ROPE_PARAMS unsigned long long dst0, unsigned long long dst1, unsigned long long dst2, int hmr0, int hmr1, \
    int hmr2, const C* __restrict__ cs, const C* __restrict__ sn, const int* __restrict__ pos, int Tn, int D, int Sc
#define ROPE_SINK RopeSink<T, C>{{dst0, dst1, dst2}, {hmr0, hmr1, hmr2}, cs, sn, pos, Tn, D, Sc}

template <typename T, typename C, int MM, int ST, int KS, int SPLIT>
__global__ void __launch_bounds__(QV_WARPS * 32)
qgemv41_rope(const unsigned char* __restrict__ w, const T* __restrict__ x, int N, int K, int M, int nw,
             ROPE_PARAMS GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    // grid_dep_wait: in the body, after the first weight loads
    q41_body<T, 2, MM, ST, KS, 2, SPLIT>(w, x, PlainSrc<T>{K}, (T*)0, nullptr, 0, N, K, M, 0, nw, 0, 0, ROPE_SINK);
}

template <typename T, typename W, typename C, int MM, int ST, int KS, int SPLIT>
__global__ void __launch_bounds__(QV_WARPS * 32)
qgemv41_norm_rope(const unsigned char* __restrict__ w, int N, int K, int M, int nw, const T* __restrict__ nx,
                  const T* __restrict__ ny, const W* __restrict__ nwt, T* __restrict__ ns, float eps, int vb,
                  ROPE_PARAMS GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    // grid_dep_wait: in the body, after the first weight loads
    __shared__ float rinv[NP_MAX_ROWS];
    q41_body<T, 2, MM, ST, KS, 2, SPLIT>(w, nx, NormSrc<T, W>{ny, nwt, rinv, K, ns, M, vb, eps}, (T*)0, nullptr, 0, N,
                                         K, M, 0, nw, 0, 0, ROPE_SINK);
}

template <int QT, typename T, typename C, int MM, int U>
__global__ void __launch_bounds__(QV_WARPS * 32)
qgemv_rope(const unsigned char* __restrict__ w, const T* __restrict__ x, int N, int K, int M, int nw,
           ROPE_PARAMS GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    // grid_dep_wait: in the body, after the first weight loads
    qgemv_body<QT, T, 2, MM, U, 2>(w, x, PlainSrc<T>{K}, (T*)0, nullptr, 0, N, K, M, 0, nw, 0, 0, ROPE_SINK);
}

template <int QT, typename T, typename W, typename C, int MM, int U>
__global__ void __launch_bounds__(QV_WARPS * 32)
qgemv_norm_rope(const unsigned char* __restrict__ w, int N, int K, int M, int nw, const T* __restrict__ nx,
                const T* __restrict__ ny, const W* __restrict__ nwt, T* __restrict__ ns, float eps, int vb,
                ROPE_PARAMS GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    // grid_dep_wait: in the body, after the first weight loads
    __shared__ float rinv[NP_MAX_ROWS];
    qgemv_body<QT, T, 2, MM, U, 2>(w, nx, NormSrc<T, W>{ny, nwt, rinv, K, ns, M, vb, eps}, (T*)0, nullptr, 0, N, K, M,
                                   0, nw, 0, 0, ROPE_SINK);
}

// The activations of the o projection after a split-key decode attention (the planner's
// sdpa_linear group): the attention's partials (cuda_attention.cu sdpa_tile with several splits:
// part_o [splits, rows, Dv], part_ml [splits, rows, 2]) merged by every block into its shared
// memory, so sdpa_combine has no launch of its own. x row m is the attention output's rows as the
// product reads them ([B, H, T, Dv] with T or H 1: element e of x is element e of the output),
// M * K = rows * Dv values. The merge is sdpa_combine's, operation for operation (its max, its
// weights, the same fmaf chains in split order, its division), then rounded to T as the
// unfused chain stores the attention output, so the product sees the same x bit for bit.
// Shared memory (dynamic, in floats): x [M * K], then per row its weights [rows][splits] and its
// sum L [rows]. Needs Dv % 4 == 0 and a 16-byte aligned part_o (4 values a load).
template <typename T>
struct AttnSrc {
    enum { PROLOGUE = 1 };
    __device__ __forceinline__ void prefetch() const {}
    const float* po;
    const float* pml;
    float* xs;
    long long rows;
    int Dv, splits, K, M;
    __device__ __forceinline__ void prologue(const T* __restrict__) const {
        float* ws = xs + (long long)M * K;
        float* ls = ws + rows * splits;
        // each row's split weights and sum, a thread a row (its loads independent of one another)
        for (long long row = threadIdx.x; row < rows; row += blockDim.x) {
            float* wr = ws + row * splits;
            float mx = neg_inf();
#pragma unroll 4
            for (int s = 0; s < splits; ++s) {
                wr[s] = pml[2 * (s * rows + row)];
                mx = fmaxf(mx, wr[s]);
            }
            float L = 0.f;
#pragma unroll 4
            for (int s = 0; s < splits; ++s) {
                const float m = wr[s];
                const float wt = m == neg_inf() ? 0.f : expf(m - mx);
                L = fmaf(wt, pml[2 * (s * rows + row) + 1], L);
                wr[s] = wt;
            }
            ls[row] = L;
        }
        __syncthreads();
        // the rows, 4 values a thread (Dv % 4 == 0: one row each), each value's chain in split order
        const long long n4 = (long long)M * K / 4;
        for (long long e4 = threadIdx.x; e4 < n4; e4 += blockDim.x) {
            const long long e = 4 * e4, row = e / Dv;
            const float* wr = ws + row * splits;
            float a[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
            for (int s = 0; s < splits; ++s) {
                const float4 o = *reinterpret_cast<const float4*>(po + s * rows * Dv + e);
                a[0] = fmaf(wr[s], o.x, a[0]);
                a[1] = fmaf(wr[s], o.y, a[1]);
                a[2] = fmaf(wr[s], o.z, a[2]);
                a[3] = fmaf(wr[s], o.w, a[3]);
            }
            const float L = ls[row];
#pragma unroll
            for (int j = 0; j < 4; ++j) xs[e + j] = np_rnd(L == 0.f ? 0.f : a[j] / L, (const T*)0);
        }
        __syncthreads();
    }
    __device__ __forceinline__ void load4(const T* __restrict__, int m, int k, int p, float* v) const {
        const float4 a = *reinterpret_cast<const float4*>(xs + (long long)m * K + k + p);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    }
};

// The o product on the attention's partials (AttnSrc), EPI 0 (+ bias): qgemv41 / qgemv with the
// merge as their prologue, which runs while the first weight loads are in flight.
template <typename T, int R, int MM, int ST, int KS, int SPLIT>
__global__ void __launch_bounds__(QV_WARPS * 32)
qgemv41_attn(const unsigned char* __restrict__ w, T* __restrict__ out, const void* __restrict__ bias, int bias_kind,
             int N, int K, int M, long long ldo, const float* __restrict__ po, const float* __restrict__ pml,
             long long rows, int Dv, int splits GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    // grid_dep_wait: in the body, after the first weight loads
    extern __shared__ float4 attn_x4[];  // float4: 16-byte aligned for load4
    float* attn_x = reinterpret_cast<float*>(attn_x4);
    q41_body<T, R, MM, ST, KS, 0, SPLIT>(w, (const T*)0, AttnSrc<T>{po, pml, attn_x, rows, Dv, splits, K, M}, out, bias,
                                         bias_kind, N, K, M, ldo, N, 0, 0, NoRope{});
}

template <int QT, typename T, int R, int MM, int U>
__global__ void __launch_bounds__(QV_WARPS * 32)
qgemv_attn(const unsigned char* __restrict__ w, T* __restrict__ out, const void* __restrict__ bias, int bias_kind,
           int N, int K, int M, long long ldo, const float* __restrict__ po, const float* __restrict__ pml,
           long long rows, int Dv, int splits GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    // grid_dep_wait: in the body, after the first weight loads
    extern __shared__ float4 attn_x4[];  // float4: 16-byte aligned for load4
    float* attn_x = reinterpret_cast<float*>(attn_x4);
    qgemv_body<QT, T, R, MM, U, 0>(w, (const T*)0, AttnSrc<T>{po, pml, attn_x, rows, Dv, splits, K, M}, out, bias,
                                   bias_kind, N, K, M, ldo, N, 0, 0, NoRope{});
}

// Dequantized rows: out[i, :] = W[src(i), :] for i < rows, src(i) = ids[i] (wrapped into
// [0, V) as cupy.take does; the session rejects out-of-range ids before a run) or i when ids is
// null (a whole matrix, for the GEMM path of longer inputs). One thread per item: it reads the
// block's 16-bit words straight from global memory and writes its 8 values. out row i starts at
// out + i * ldo.
template <int QT, typename O>
__global__ void qrows(const unsigned char* __restrict__ w, const int* __restrict__ ids, O* __restrict__ out,
                      long long rows, int V, int K, long long ldo GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    grid_dep_wait();  // first: see cuda_common.cu
    enum { B = QBlock<QT>::BYTES };
    const int items = K / 8;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * items) return;
    const long long row = i / items;
    const int it = (int)(i - row * items);
    long long src = row;
    if (ids != nullptr) {
        src = (long long)ids[row] % V;
        if (src < 0) src += V;
    }
    const int kb = it >> 2, t = it & 3;
    float v[8];
    decode<QT>(w + src * (long long)(K / QK) * B + (long long)kb * B, t, v);
    O* o = out + row * ldo + kb * QK;
    const int p0 = pos0<QT>(t), p1 = pos1<QT>(t);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        st(o + p0 + j, v[j]);
        st(o + p1 + j, v[4 + j]);
    }
}
