// What gemv.wgsl and gemv_any.wgsl share (pasted by `//! include gemv_common.wgsl` after
// common.wgsl and mm_params.wgsl): the overrides that shape the workgroup, the epilogue bindings,
// and `gemv_finish`, which sums each output column's per-thread partials and stores C.
//
// The kernels compute C(m, n) = alpha * sum_k A(m, k) B(k, n) + bias for M <= 8 rows with B read
// along k (b_sk == 1: a linear layer's weight row n, W[n, :]). A workgroup owns WGS / LANES output
// columns n and all M rows; the LANES threads of a column walk its weight row in consecutive
// 16-byte chunks (neighbouring threads, neighbouring chunks: the loads coalesce), up to four chunks
// per loop trip loaded into named registers before any is used, so a thread has all of its weight
// loads in flight at once (core/webgpu/ops_matmul.py picks LANES so that one trip covers the row).
// Each thread keeps its M partial sums in named registers (`GM > m` tests of a pipeline constant,
// never a loop-indexed array: docs/NOTES.md), then the column's LANES partials are summed in
// workgroup memory, eight at a time (one barrier per factor of 8 instead of one per halving).
//
// Epilogues as matmul_fast.wgsl's: ACT gelu (1 erf, 2 tanh), RES + R(m, n) (R float32 [M][N] at
// P.r_base), NC > 1 sibling linears (batch entry z writes OUT, OUT1 or OUT2; their weights and,
// with BIAS == 3, biases lie back to back). Output dtypes of 32-bit words only: the lowering routes
// float16 C elsewhere (a thread owns one column; a float16 word holds two).

override DTBIAS: u32 = 0u;
override BIAS: u32 = 0u;      // 0 none, 1 per column n, 2 per row m, 3 per column of batch entry z
override GM: u32 = 1u;        // rows of A: 1..8
override LANES: u32 = 64u;    // threads per output column: 32, 64, 128 or 256
override WGS: u32 = 256u;     // threads per workgroup (WGS / LANES columns)
override ACT: u32 = 0u;
override RES: bool = false;
override NC: u32 = 1u;

@group(0) @binding(0) var<uniform> P: MMParams;
@group(0) @binding(4) var<storage, read_write> BIASV: array<u32>;
@group(0) @binding(5) var<storage, read_write> R: array<u32>;
@group(0) @binding(6) var<storage, read_write> OUT1: array<u32>;
@group(0) @binding(7) var<storage, read_write> OUT2: array<u32>;

// [m][thread]. Sized for GM = 8 and 256 threads whatever the pipeline's: naga 29 (wgpu 0.32)
// panicked compiling this module with an override-sized workgroup array (e.g. GM * 256u).
var<workgroup> red: array<f32, 2048>;

// Output column of thread li in the workgroup whose linear index is g (2-D grids past 65535).
fn gemv_column(li: u32, g: u32) -> u32 {
    return g * (WGS / LANES) + li / LANES;
}

fn gemv_bias(m: u32, n: u32, z: u32) -> f32 {
    if (BIAS == 0u) {
        return 0.0;
    }
    var i = P.bias_base + n;
    if (BIAS == 2u) {
        i = P.bias_base + m;
    } else if (BIAS == 3u) {
        i = P.bias_base + z * P.N + n;
    }
    return word_f32(BIASV[widx(i, DTBIAS)], i, DTBIAS);
}

fn gemv_gelu(x: f32) -> f32 {
    if (ACT == 2u) {
        let inner = 0.79788456080286536 * (x + 0.044715 * x * x * x);
        return 0.5 * x * (1.0 + tanh_f(inner));
    }
    return 0.5 * x * (1.0 + erf_f(x * 0.70710678118654752));
}

fn hsum(v: vec4<f32>) -> f32 {
    return (v.x + v.y) + (v.z + v.w);
}

// Sum thread li's partials p0..p7 (row m: p_m) with the rest of its column's, then thread `lane m`
// of column n stores C(m, n) of batch entry z (C's element offset c_off). Every thread of the
// workgroup calls it (barriers), also those whose column is past N (their partials are zeros).
fn gemv_finish(li: u32, n: u32, z: u32, c_off: u32, p0: f32, p1: f32, p2: f32, p3: f32, p4: f32, p5: f32,
               p6: f32, p7: f32) {
    let lane = li % LANES;
    let cb = li - lane;   // the column's first thread
    red[li] = p0;
    if (GM > 1u) { red[WGS + li] = p1; }
    if (GM > 2u) { red[2u * WGS + li] = p2; }
    if (GM > 3u) { red[3u * WGS + li] = p3; }
    if (GM > 4u) { red[4u * WGS + li] = p4; }
    if (GM > 5u) { red[5u * WGS + li] = p5; }
    if (GM > 6u) { red[6u * WGS + li] = p6; }
    if (GM > 7u) { red[7u * WGS + li] = p7; }
    workgroupBarrier();
    // s partials per column and row remain; each step folds 8 of them into one. Entry `lane < t`
    // is written only by its own thread, after it read it: no other thread of the step reads it.
    var s = LANES;
    loop {
        if (s <= 8u) {
            break;
        }
        let t = s / 8u;
        if (lane < t) {
            for (var m = 0u; m < GM; m++) {
                let b = m * WGS + cb + lane;
                red[b] = ((red[b] + red[b + t]) + (red[b + 2u * t] + red[b + 3u * t]))
                    + ((red[b + 4u * t] + red[b + 5u * t]) + (red[b + 6u * t] + red[b + 7u * t]));
            }
        }
        workgroupBarrier();
        s = t;
    }
    if (lane >= GM || n >= P.N) {
        return;
    }
    let m = lane;
    var v = 0.0;
    for (var j = 0u; j < s; j++) {
        v += red[m * WGS + cb + j];
    }
    var r = P.alpha * v + gemv_bias(m, n, z);
    if (ACT != 0u) {
        r = gemv_gelu(r);
    }
    if (RES) {
        r += bitcast<f32>(R[P.r_base + m * P.N + n]);
    }
    let e = c_off + m * P.c_sm + n * P.c_sn;
    let w = f32_word(r, DT_OUT);
    if (NC == 1u || z == 0u) {
        OUT[e] = w;
    } else if (z == 1u) {
        OUT1[e] = w;
    } else {
        OUT2[e] = w;
    }
}
