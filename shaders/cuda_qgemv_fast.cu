// qgemv41x: the q4_1 decode GEMV with two instructions of its own a weight, about three with a
// half block's loads and scales (launched by native/cuda_qgemv_fast.py; cuda_quant.cu's qgemv41
// spends about six: a byte permute, a subtraction and two FMAs a weight, plus masks and loads).
//
// The trick: a nibble q at bit position 4p of a 32-bit word w (p <= 5), with every other bit of w
// masked off, is as a float32 bit pattern exactly q * 2^(4p) * 2^-149 (a denormal, or for p = 5
// and q >= 8 a pattern with exponent field 1, whose value follows the same formula). So
// `__uint_as_float(w & (0xF << 4p))` is one LOP3 and needs no conversion; one FFMA then multiplies
// it by an activation pre-scaled by 2^(149 - 4p - c): the product is q * x * 2^-c, the same scale
// for every position. Those FMAs are inline PTX `fma.rn.f32`, which keeps denormal operands
// whatever the compiler flags: CuPy compiles RawModules with -ftz=true (after the caller's
// options), which makes every compiler-emitted float instruction flush them to zero. Nibbles at
// positions 6 and 7 (the top byte) are read from w >> 16 at positions 2 and 3.
//
// The pre-scaled activations are made once per block of threads (shared by all its rows) into
// shared memory: for each half block of 16 values a lane decodes, the 16 scaled values, 2^c and
// the plain float32 sum of the 16 values. c follows the largest exponent E of those 16 values
// (c = E + 22, so the largest one, scaled for p = 0, stays below 2^128), so the scaling is an
// exact exponent shift for every value within 2^104 of the largest; smaller ones are dropped
// (their share is below 2^-128 of the largest term, far under float32's rounding). E is clamped at
// 100: activations of magnitude 2^101 (~2.5e30) or more give infinite outputs; a non-finite
// activation gives a non-finite output.
//
// A lane then sums s = sum q * x * 2^-c over its 16 values (16 FFMAs on the two nibble words) and
// adds d * (s * 2^c) + m * sum(x) (q4_1: value = d q + m): float32 products and sums in another
// order than the per-value dequantizing sum, the same error class (q, d, m and the scaling are
// exact).
//
// Layout. A row's q4_1 blocks (20 bytes, 4-byte aligned: d|m word, 4 nibble words; byte j of the
// nibbles holds value j low, j + 16 high) go in groups of 16 blocks, one warp step: lane l takes
// block l / 2 of the group, half h = l % 2: nibble words 1 + 2h and 2 + 2h, i.e. values
// A = 8h .. 8h + 7 and B = 16 + 8h .. 16 + 8h + 7 of the block (word t0 = 2h holds A[b] at bits
// 8b and B[b] at bits 8b + 4, b < 4; word t1 = 2h + 1 the same for A[4 + b], B[4 + b]). A word's
// slot j < 8 (A[j/2] for even j, B[j/2] for odd j, plus 4 for t1) sits at position p(j) = j for
// j < 6, j - 4 for the two read from w >> 16.
//
// NVRTC is given no include path: cuda_common.cu (ld, st, warp_sum, grid_dep_wait) and
// cuda_norm_prologue.cu (PlainSrc) are prepended.

#define QX_GROUP_BYTES 2304  // shared bytes of one group of one x row: 4 float4 + 1 float2 per lane
// Warps an SM should hold at once (the launch bounds' register cap): 40 keeps the 1-row kernel
// at 48 registers without spills for S <= 2 (ptxas -v); more x rows need more registers
#define QX_MIN_WARPS(MM) ((MM) == 1 ? 40 : (MM) == 2 ? 32 : 24)
#define QX_MIN_BLOCKS(MM, W) (QX_MIN_WARPS(MM) / (W) > 0 ? QX_MIN_WARPS(MM) / (W) : 1)

__device__ __forceinline__ int qx_pos(int j) { return j < 6 ? j : j - 4; }

// 2^e as a float32 (e within the normal range, -126 <= e <= 127)
__device__ __forceinline__ float qx_pow2(int e) { return __uint_as_float((unsigned int)(e + 127) << 23); }

// Stage groups g0 .. g0 + kcg - 1 of every x row into shared memory, by the whole block: for
// lane-item (m, g, l) the 16 scaled values at xs[((m kcg + g) 4 + i) 32 + l], i < 4 (i = 0, 1:
// word t0's slots 0-3, 4-7; i = 2, 3: word t1's), and (2^c, sum of the 16 values) at
// aux[(m kcg + g) 32 + l]. Lanes of blocks past the row (kb >= KB) and rows m >= M are not written
// (never read).
template <typename T, int MM, typename Src>
__device__ __forceinline__ void qx_stage(const Src& src, const T* __restrict__ x, float4* xs, float2* aux, int M, int KB,
                                         int g0, int kcg) {
    const int per_m = kcg * 32;
    for (int it = threadIdx.x; it < MM * per_m; it += blockDim.x) {
        const int m = it / per_m, rest = it - m * per_m;
        const int g = rest >> 5, l = rest & 31;
        const int kb = (g0 + g) * 16 + (l >> 1), h = l & 1;
        if (m >= M || kb >= KB) continue;
        const int k = kb * 32;
        float a[8], b[8];
        src.load4(x, m, k, 8 * h, a);
        src.load4(x, m, k, 8 * h + 4, a + 4);
        src.load4(x, m, k, 16 + 8 * h, b);
        src.load4(x, m, k, 20 + 8 * h, b + 4);
        int emax = 1;
        float sx = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            emax = max(emax, (int)((__float_as_uint(a[i]) >> 23) & 0xFFu));
            emax = max(emax, (int)((__float_as_uint(b[i]) >> 23) & 0xFFu));
        }
#pragma unroll
        for (int i = 0; i < 8; i += 2) sx += (a[i] + a[i + 1]) + (b[i] + b[i + 1]);
        const int E = min(emax - 127, 100);
        // x * 2^(127 - 4p - E) as two multiplications by powers of two, 2^(h1 - 2p) then
        // 2^(h2 - 2p) with h1 + h2 = 127 - E: 27 <= 127 - E <= 253, so each factor's exponent lies
        // in [3, 127] (a normal float) and, x's exponent being at most E (else E was clamped), each
        // product of a normal x is normal, hence exact (an exponent shift). A denormal x gives
        // +-0 (the -ftz=true multiply flushes it: its share is below float32's rounding), an
        // infinite or NaN x stays so, and only past the clamp (|x| >= 2^101) can a product overflow
        // to infinity: the values of an exponent shift done on the bits, at two FMULs a value.
        const int h1 = (127 - E) >> 1, h2 = 127 - E - h1;
        float v[16];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float val = (j & 1) ? b[4 * u + j / 2] : a[4 * u + j / 2];
                v[8 * u + j] = (val * qx_pow2(h1 - 2 * qx_pos(j))) * qx_pow2(h2 - 2 * qx_pos(j));
            }
        float4* o = xs + (long long)((m * kcg + g) * 4) * 32 + l;
#pragma unroll
        for (int i = 0; i < 4; ++i) o[32 * i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
        aux[(m * kcg + g) * 32 + l] = make_float2(__uint_as_float((unsigned int)(E + 22 + 127) << 23), sx);
    }
}

// a * x + s with the masked bits a as a float, denormal kept (see the top: not fmaf)
__device__ __forceinline__ float qx_fma(unsigned int a, float x, float s) {
    float r;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(__uint_as_float(a)), "f"(x), "f"(s));
    return r;
}

// sum over the 8 slots of word w: q * x * 2^-c (lo: slots 0-3, hi: slots 4-7, pre-scaled)
__device__ __forceinline__ float qx_dot8(unsigned int w, float4 lo, float4 hi) {
    const unsigned int u = w >> 16;
    float s = qx_fma(w & 0xFu, lo.x, 0.f);
    s = qx_fma(w & 0xF0u, lo.y, s);
    s = qx_fma(w & 0xF00u, lo.z, s);
    s = qx_fma(w & 0xF000u, lo.w, s);
    s = qx_fma(w & 0xF0000u, hi.x, s);
    s = qx_fma(w & 0xF00000u, hi.y, s);
    s = qx_fma(u & 0xF00u, hi.z, s);
    s = qx_fma(u & 0xF000u, hi.w, s);
    return s;
}

// out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) for m < M <= MM, W q4_1 [N, K] (K a multiple of
// 32, 4-byte aligned). A warp computes R consecutive rows (each staged activation read once for
// them), KS warps share a row group (warp kw takes groups kw, kw + KS, ...; their sums meet in
// shared memory in warp order); a block of WARPS warps holds WARPS / KS row groups. The block
// walks the rows in chunks of kcg groups (a multiple of KS * S): stage the chunk's activations,
// barrier, each warp runs its trips of S groups, the next trip's weight words loaded before this
// one is summed (their loads span the barriers). Dynamic shared memory: MM * kcg * QX_GROUP_BYTES.
// The first trip's loads go out before the wait for the kernel ahead (grid_dep_wait): a weight is
// a constant of the program, which no kernel of a step writes, so under PDL (native/cuda_pdl.py)
// its fetch overlaps that kernel's tail; the activations, which that kernel may write, are read
// only after the wait.
template <typename T, int MM, int R, int S, int KS, int WARPS, typename Src>
__device__ __forceinline__ void q41x_body(const unsigned char* __restrict__ w, const T* __restrict__ x, const Src& src,
                                          T* __restrict__ out, const void* __restrict__ bias, int bias_kind, int N,
                                          int K, int M, long long ldo, int kcg) {
    static_assert(WARPS % KS == 0, "a block holds whole row groups");
    static_assert(R * MM <= 32, "one lane writes each output of the warp");
    extern __shared__ float4 qx_smem[];
    float4* xs = qx_smem;
    float2* aux = reinterpret_cast<float2*>(qx_smem + MM * kcg * 128);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kw = warp % KS;
    const int row0 = (blockIdx.x * (WARPS / KS) + warp / KS) * R;
    const int KB = K / 32;  // >= 1: the host launches nothing for K == 0
    const bool active = row0 < N;  // uniform over the KS warps of a row group
    const int nr = min(R, N - row0);
    const int G = (KB + 15) / 16;
    const int nch = (G + kcg - 1) / kcg, tpc = kcg / (KS * S);
    const unsigned int* __restrict__ wq = reinterpret_cast<const unsigned int*>(w) + (long long)row0 * KB * 5;
    const long long rw = (long long)KB * 5;  // words of a row
    const int h = lane & 1, bl = lane >> 1;

    float acc[R][MM];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MM; ++m) acc[r][m] = 0.f;

    // trip j: groups kw + KS (S j + s), s < S; words past the rows stay 0 and are never summed
    unsigned int dm[S][R], q0[S][R], q1[S][R];
    auto load = [&](int j, unsigned int (&a)[S][R], unsigned int (&b)[S][R], unsigned int (&c)[S][R]) {
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const int kb = 16 * (kw + KS * (S * j + s)) + bl;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                a[s][r] = b[s][r] = c[s][r] = 0u;
                if (active && r < nr && kb < KB) {
                    const unsigned int* p = wq + r * rw + (long long)kb * 5;
                    a[s][r] = __ldg(p);
                    b[s][r] = __ldg(p + 1 + 2 * h);
                    c[s][r] = __ldg(p + 2 + 2 * h);
                }
            }
        }
    };
    load(0, dm, q0, q1);
    grid_dep_wait();  // see above: only weights were read before it
    src.prologue(x);  // a block-wide prologue runs while the first trip's loads are in flight
    for (int ch = 0; ch < nch; ++ch) {
        if (ch > 0) __syncthreads();  // every warp is done with the previous chunk
        qx_stage<T, MM>(src, x, xs, aux, M, KB, ch * kcg, kcg);
        __syncthreads();
        if (!active) continue;
        for (int jj = 0; jj < tpc; ++jj) {
            const int j = ch * tpc + jj;
            unsigned int ndm[S][R], nq0[S][R], nq1[S][R];
            load(j + 1, ndm, nq0, nq1);
#pragma unroll
            for (int s = 0; s < S; ++s) {
                const int g = kw + KS * (S * j + s);
                if (16 * g + bl < KB) {
                    const int gl = g - ch * kcg;
                    float d[R], mn[R];
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        d[r] = ld((half_t)(dm[s][r] & 0xFFFFu));
                        mn[r] = ld((half_t)(dm[s][r] >> 16));
                    }
#pragma unroll
                    for (int m = 0; m < MM; ++m)
                        if (m < M) {
                            const float4* xp = xs + (long long)((m * kcg + gl) * 4) * 32 + lane;
                            const float4 x0 = xp[0], x1 = xp[32], x2 = xp[64], x3 = xp[96];
                            const float2 ax = aux[(m * kcg + gl) * 32 + lane];
#pragma unroll
                            for (int r = 0; r < R; ++r)
                                if (r < nr) {
                                    const float sq = qx_dot8(q0[s][r], x0, x1) + qx_dot8(q1[s][r], x2, x3);
                                    acc[r][m] = fmaf(mn[r], ax.y, acc[r][m]);
                                    acc[r][m] = fmaf(d[r], sq * ax.x, acc[r][m]);
                                }
                        }
                }
            }
#pragma unroll
            for (int s = 0; s < S; ++s)
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    dm[s][r] = ndm[s][r];
                    q0[s][r] = nq0[s][r];
                    q1[s][r] = nq1[s][r];
                }
        }
    }
    // the row group's KS partial sums into its first warp (cuda_common.cu)
    if (KS > 1 && !ks_partials<R, MM, KS, WARPS>(acc, warp, lane, active, kw)) return;
    if (!active) return;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < MM; ++m) {
            const float v = warp_sum(acc[r][m]);
            if (lane == r * MM + m && r < nr && m < M) {
                const int n = row0 + r;
                float y = v;
                if (bias_kind == 1) y += reinterpret_cast<const float*>(bias)[n];
                else if (bias_kind == 2) y += ld(reinterpret_cast<const half_t*>(bias)[n]);
                st(out + (long long)m * ldo + n, y);
            }
        }
}

// x [M, K] contiguous from a 16-byte aligned start (8-byte for half), out row m at out + m * ldo;
// bias_kind: 0 none, 1 float, 2 half.
template <typename T, int MM, int R, int S, int KS, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, QX_MIN_BLOCKS(MM * R, WARPS))
qgemv41x(const unsigned char* __restrict__ w, const T* __restrict__ x, T* __restrict__ out,
         const void* __restrict__ bias, int bias_kind, int N, int K, int M, long long ldo, int kcg GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    // grid_dep_wait() in the body, after the first weight loads (see q41x_body)
    q41x_body<T, MM, R, S, KS, WARPS>(w, x, PlainSrc<T>{K}, out, bias, bias_kind, N, K, M, ldo, kcg);
}
