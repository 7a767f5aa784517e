// Kernels that carry out several ops of the op set in one launch, for the fusion step of the CUDA
// executor's recording (native/cuda_fusion.py finds where they apply and proves it safe). Each
// computes exactly what its unfused ops compute, rounding to the storage type wherever the
// unfused chain stores an intermediate, so fused and unfused runs agree bit for bit (the tests
// compare them for equality, and both against float64).
// T = storage of activations, W / C = storage of the norm weight / rope tables (float or half_t).

// v rounded to T's precision (the value an unfused op would have stored and re-read).
__device__ __forceinline__ float rnd(float v, float*) { return v; }
__device__ __forceinline__ float rnd(float v, half_t*) {
    half_t h;
    st(&h, v);
    return ld(h);
}

// s = x + y (stored: the residual stream goes on), h = rms_norm(s) * w. One block per row of
// `cols` contiguous elements. Each thread reads x, y and writes s, h only at its own columns, and
// reads s back only where it wrote it, so s or h may share storage with x or y exactly.
template <typename T, typename W>
__global__ void add_rms_norm(const T* __restrict__ x, const T* __restrict__ y, const W* __restrict__ w,
                             T* s, T* h, int cols, float eps, int has_w GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    grid_dep_wait();  // first: see cuda_common.cu
    __shared__ float red[32];
    const size_t base = (size_t)blockIdx.x * cols;
    float q = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = rnd(ld(x[base + c]) + ld(y[base + c]), (T*)0);
        st(&s[base + c], v);
        q += v * v;
    }
    q = block_sum(q, red);
    const float r = rsqrtf(q / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = ld(s[base + c]) * r;
        if (has_w) v *= ld(w[c]);
        st(&h[base + c], v);
    }
}

// out = silu(g) * u over [rows, cols]; g and u rows are `gs` / `us` elements apart (the halves
// of a concatenated gate/up product, or plain contiguous tensors), out is contiguous.
template <typename T>
__global__ void silu_mul(const T* g, long long gs, const T* u, long long us, T* out, long long rows,
                         int cols GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    grid_dep_wait();  // first: see cuda_common.cu
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    const long long r = i / cols, c = i - r * cols;
    const float a = ld(g[r * gs + c]);
    const float sv = rnd(a / (1.f + expf(-a)), (T*)0);  // the stored silu output
    st(&out[i], sv * ld(u[r * us + c]));
}

// Up to three "rope / KV-cache" jobs in one launch (q, k and v of one attention layer). Job j
// reads x_j[b, h, t, d] at src_j + b*sb_j + h*sh_j + t*st_j + d (any permute or row stride of
// the projection output folded into the strides), rotates it when rope_j (Llama half rotation
// with cos/sin [T, D]) and writes it either to a contiguous [B, H_j, T, D] tensor (mode 0) or to
// rows pos[0] + t of a [B, H_j, S, D] cache (mode 1; rows outside [0, S) are skipped, as
// kv_update does). One thread per (row, d < D/2) pair: it reads both halves before writing both,
// and writes only the row and pair it read.
struct RopeJob {
    unsigned long long src, dst;
    long long sb, sh, st;
    int H, mode, rope, pad;
};

template <typename T, typename C>
__device__ __forceinline__ void rope_job(const RopeJob& J, long long i, const C* cs, const C* sn,
                                         const int* pos, int Tn, int D, int S) {
    const int half = D >> 1;
    const int d = (int)(i % half);
    const long long row = i / half;
    const int t = (int)(row % Tn);
    const long long bh = row / Tn;
    const long long b = bh / J.H, h = bh - b * J.H;
    const T* x = reinterpret_cast<const T*>(J.src) + b * J.sb + h * J.sh + (long long)t * J.st;
    float a = ld(x[d]), c = ld(x[d + half]);
    float ya = a, yc = c;
    if (J.rope) {
        ya = a * ld(cs[t * D + d]) - c * ld(sn[t * D + d]);
        yc = c * ld(cs[t * D + d + half]) + a * ld(sn[t * D + d + half]);
    }
    T* y;
    if (J.mode == 0) {
        y = reinterpret_cast<T*>(J.dst) + row * D;
    } else {
        const long long s = (long long)pos[0] + t;
        if (s < 0 || s >= S) return;
        y = reinterpret_cast<T*>(J.dst) + (bh * S + s) * D;
    }
    st(&y[d], ya);
    st(&y[d + half], yc);
}

// Jobs are passed flat (CuPy passes scalars and pointers, not structs); job j's fields are
// src_j, dst_j (raw addresses), sb_j, sh_j, st_j (element strides), hmr_j = H | mode << 24 |
// rope << 25, and n_j threads (0: no job).
#define GD_JOB_PARAMS(j) unsigned long long src##j, unsigned long long dst##j, long long sb##j, long long sh##j, \
    long long st##j, int hmr##j, long long n##j
#define GD_JOB(j) RopeJob{src##j, dst##j, sb##j, sh##j, st##j, hmr##j & 0xffffff, (hmr##j >> 24) & 1, (hmr##j >> 25) & 1, 0}

template <typename T, typename C>
__global__ void rope_kv(GD_JOB_PARAMS(0), GD_JOB_PARAMS(1), GD_JOB_PARAMS(2),
                        const C* __restrict__ cs, const C* __restrict__ sn, const int* __restrict__ pos,
                        int Tn, int D, int S GD_TL_PARAM) {
    GD_KERNEL_ENTER;
    grid_dep_wait();  // first: see cuda_common.cu
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n0) { rope_job<T, C>(GD_JOB(0), i, cs, sn, pos, Tn, D, S); return; }
    i -= n0;
    if (i < n1) { rope_job<T, C>(GD_JOB(1), i, cs, sn, pos, Tn, D, S); return; }
    i -= n1;
    if (i < n2) rope_job<T, C>(GD_JOB(2), i, cs, sn, pos, Tn, D, S);
}
