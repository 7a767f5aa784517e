// Matrix product on the subgroup-matrix units (tensor cores) of a device with Dawn's
// `chromium-experimental-subgroup-matrix` feature and its f16 x f16 -> f32 16x16x16 config:
// C[z] = alpha * A[z] @ B[z] (+ bias, gelu, + R) with the parameters and binding slots of
// matmul_fast.wgsl (MMParams). Inputs are rounded to float16 as they are staged; products are
// accumulated in float32 (the session's precision="fast"; core/webgpu/ops_sgmat.py chooses it).
//
// A workgroup computes a BM x BN tile of C with several subgroups of 32 threads (the kernel
// assumes subgroups of 32, which the 16x16x16 f16 config implies on the devices that report it,
// NVIDIA's; it needs the `subgroups` feature for subgroup_id). Each subgroup keeps its part of the
// tile as 16x16 result matrices in named registers (a loop-indexed array of them would be placed
// in local memory; docs/NOTES.md). Each K step stages A's BM x BK and B's BK x BN tile in
// workgroup memory as float16; the next step's global loads are issued into registers before
// this step's multiply-accumulates and stored after them (STAGES = 2: into the other of two
// shared tiles, one barrier per step). Staged rows are padded by 8 halves (16 bytes) so the
// rows of one matrix load start on different banks.
//
// The entry points are written out per tile shape by matmul_sgmat.py (the `//! generate` line
// at the end); everything they share is here.
//
// Storage: A and B are bound as array<vec2<u32>> and read in quads of 4 elements along their
// contiguous axis (float32: two vec2s, float16: one), so K (and N where B runs along n) are
// multiples of 4 and every base and stride of those rows is too (ops_sgmat.py checks it); rows
// past M or N and k past K read zeros. The entries with 16-byte loads (matmul_sgmat.py's unit 0
// and 8) read the same bindings as array<vec4<u32>>: float16 operands in octets of 8 (then K, N
// where B runs along n, and those bases and strides are multiples of 8), float32 ones in quads.
// R and the bias are float32, C float32 or float16.

enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;
// The matrix offsets depend on the subgroup id only, so they are uniform within each subgroup,
// which is what the hardware needs; Tint's analysis asks for workgroup uniformity.
diagnostic(off, chromium.subgroup_matrix_uniformity);

//! include mm_params.wgsl
//! include math.wgsl

override DT_OUT: u32 = 0u;        // C storage: 0 float32, 1 float16 (then c_sn == 1, bases and N even)
override DTA: u32 = 0u;           // A storage: 0 float32, 1 float16
override DTB: u32 = 0u;           // B storage: 0 float32, 1 float16
override B_KMAJOR: bool = true;   // B(k, n) at n * b_sn + k (a linear's weight), else at k * b_sk + n
override BIAS: u32 = 0u;          // 0 none, 1 per column n, 2 per row m, 3 per column and batch entry
override ACT: u32 = 0u;           // fused epilogue: 1 gelu (erf), 2 gelu (tanh)
override RES: bool = false;       // fused epilogue: + R(m, n) (float32 [M][N] at P.r_base, one batch)
override NC: u32 = 1u;            // sibling linears: batch entry z writes C, C1 or C2
override STAGES: u32 = 1u;        // shared tiles: 1 (two barriers per step) or 2 (one)

@group(0) @binding(0) var<uniform> P: MMParams;
@group(0) @binding(1) var<storage, read_write> C: array<u32>;
@group(0) @binding(2) var<storage, read_write> A2: array<vec2<u32>>;
@group(0) @binding(3) var<storage, read_write> B2: array<vec2<u32>>;
@group(0) @binding(4) var<storage, read_write> BIASV: array<f32>;
@group(0) @binding(5) var<storage, read_write> R: array<f32>;
@group(0) @binding(6) var<storage, read_write> C1: array<u32>;
@group(0) @binding(7) var<storage, read_write> C2: array<u32>;

// The same bindings as 16-byte words, for the entries that stage octets (matmul_sgmat.py's unit 8;
// each entry point uses one view of a binding, never both).
@group(0) @binding(2) var<storage, read_write> A4: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> B4: array<vec4<u32>>;

// C, C1, C2 as float32 for the direct entries (matmul_sgmat.py's Shape.direct), which store
// result matrices into them (a matrix store needs an array of the matrix's f32); those
// entries never use the u32 views, the others never these.
@group(0) @binding(1) var<storage, read_write> CF: array<f32>;
@group(0) @binding(6) var<storage, read_write> CF1: array<f32>;
@group(0) @binding(7) var<storage, read_write> CF2: array<f32>;

// Quad (4 elements along the contiguous axis) at element e (a multiple of 4) of a tensor of dtype dt.
fn quad_a(e: u32) -> vec4<u32> {
    if (DTA == 1u) {
        return vec4<u32>(A2[e >> 2u], 0u, 0u);
    }
    return vec4<u32>(A2[e >> 1u], A2[(e >> 1u) + 1u]);
}

fn quad_b(e: u32) -> vec4<u32> {
    if (DTB == 1u) {
        return vec4<u32>(B2[e >> 2u], 0u, 0u);
    }
    return vec4<u32>(B2[e >> 1u], B2[(e >> 1u) + 1u]);
}

// The quad q (a quad_a/quad_b word pattern of dtype dt) as four halves for a workgroup tile.
fn halves(q: vec4<u32>, dt: u32) -> vec4<f16> {
    if (dt == 1u) {
        return vec4<f16>(bitcast<vec2<f16>>(q.x), bitcast<vec2<f16>>(q.y));
    }
    return vec4<f16>(bitcast<vec4<f32>>(q));
}

// A loaded quad q of dtype dt as the staging registers of a shape whose regs are "f32" (float32
// bits, float16 widened) or "f16" (packed float16 pairs, float32 rounded once, as halves() does).
fn regs_f32(q: vec4<u32>, dt: u32) -> vec4<u32> {
    if (dt == 1u) {
        return bitcast<vec4<u32>>(vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)));
    }
    return q;
}

fn regs_f16(q: vec4<u32>, dt: u32) -> vec2<u32> {
    if (dt == 1u) {
        return q.xy;
    }
    return bitcast<vec2<u32>>(vec4<f16>(bitcast<vec4<f32>>(q)));
}

// Quad i of A's BM x (4 qpr) tile at (m0, k0): row i / qpr, k (i % qpr) * 4.
fn load_a(i: u32, m0: u32, k0: u32, a_off: u32, qpr: u32) -> vec4<u32> {
    let m = m0 + i / qpr;
    let k = k0 + (i % qpr) * 4u;
    if (m < P.M && k < P.K) {
        return quad_a(a_off + m * P.a_sm + k);
    }
    return vec4<u32>(0u);
}

// Quad i of B's tile: k-major BN (n) x (4 qpr) (k) like A, or n-major K step (k) x (4 qprn) (n).
fn load_b(i: u32, n0: u32, k0: u32, b_off: u32, qpr: u32, qprn: u32) -> vec4<u32> {
    if (B_KMAJOR) {
        let n = n0 + i / qpr;
        let k = k0 + (i % qpr) * 4u;
        if (n < P.N && k < P.K) {
            return quad_b(b_off + n * P.b_sn + k);
        }
        return vec4<u32>(0u);
    }
    let k = k0 + i / qprn;
    let n = n0 + (i % qprn) * 4u;
    if (k < P.K && n < P.N) {
        return quad_b(b_off + k * P.b_sk + n);
    }
    return vec4<u32>(0u);
}

// Octet (8 elements along the contiguous axis) at element e (a multiple of 8) as packed halves:
// one 16-byte load of float16, two of float32 rounded to float16.
fn oct_a(e: u32) -> vec4<u32> {
    if (DTA == 1u) {
        return A4[e >> 3u];
    }
    return vec4<u32>(regs_f16(A4[e >> 2u], 0u), regs_f16(A4[(e >> 2u) + 1u], 0u));
}

fn oct_b(e: u32) -> vec4<u32> {
    if (DTB == 1u) {
        return B4[e >> 3u];
    }
    return vec4<u32>(regs_f16(B4[e >> 2u], 0u), regs_f16(B4[(e >> 2u) + 1u], 0u));
}

// Quads of float32 operands as one 16-byte word (the unit-0 entries' float32 path, which reads
// the binding only through A4/B4; e a multiple of 4).
fn load16_a(i: u32, m0: u32, k0: u32, a_off: u32, qpr: u32) -> vec4<u32> {
    let m = m0 + i / qpr;
    let k = k0 + (i % qpr) * 4u;
    if (m < P.M && k < P.K) {
        return A4[(a_off + m * P.a_sm + k) >> 2u];
    }
    return vec4<u32>(0u);
}

fn load16_b(i: u32, n0: u32, k0: u32, b_off: u32, qpr: u32, qprn: u32) -> vec4<u32> {
    if (B_KMAJOR) {
        let n = n0 + i / qpr;
        let k = k0 + (i % qpr) * 4u;
        if (n < P.N && k < P.K) {
            return B4[(b_off + n * P.b_sn + k) >> 2u];
        }
        return vec4<u32>(0u);
    }
    let k = k0 + i / qprn;
    let n = n0 + (i % qprn) * 4u;
    if (k < P.K && n < P.N) {
        return B4[(b_off + k * P.b_sk + n) >> 2u];
    }
    return vec4<u32>(0u);
}

// load_a / load_b by octets (K, and N where B runs along n, multiples of 8, as are the bases and
// strides of those rows). Kept apart from load_a / load16_a rather than one function with a unit
// argument: a function that named both A2 and A4 would make every entry point calling it use
// both views of binding 2, which Tint rejects.
fn load8_a(i: u32, m0: u32, k0: u32, a_off: u32, opr: u32) -> vec4<u32> {
    let m = m0 + i / opr;
    let k = k0 + (i % opr) * 8u;
    if (m < P.M && k < P.K) {
        return oct_a(a_off + m * P.a_sm + k);
    }
    return vec4<u32>(0u);
}

fn load8_b(i: u32, n0: u32, k0: u32, b_off: u32, opr: u32, oprn: u32) -> vec4<u32> {
    if (B_KMAJOR) {
        let n = n0 + i / opr;
        let k = k0 + (i % opr) * 8u;
        if (n < P.N && k < P.K) {
            return oct_b(b_off + n * P.b_sn + k);
        }
        return vec4<u32>(0u);
    }
    let k = k0 + i / oprn;
    let n = n0 + (i % oprn) * 8u;
    if (k < P.K && n < P.N) {
        return oct_b(b_off + k * P.b_sk + n);
    }
    return vec4<u32>(0u);
}

fn gelu1(x: f32) -> f32 {
    if (ACT == 2u) {
        return 0.5 * x * (1.0 + tanh_f(0.79788456080286536 * (x + 0.044715 * x * x * x)));
    }
    return 0.5 * x * (1.0 + erf_f(x * 0.70710678118654752));
}

// Value v of C(mm, nn) as stored: scaled, biased and through the fused epilogue.
fn result(v0: f32, z: u32, mm: u32, nn: u32) -> f32 {
    var v = P.alpha * v0;
    if (BIAS == 1u) {
        v += BIASV[P.bias_base + nn];
    } else if (BIAS == 2u) {
        v += BIASV[P.bias_base + mm];
    } else if (BIAS == 3u) {
        v += BIASV[P.bias_base + z * P.N + nn];
    }
    if (ACT != 0u) {
        v = gelu1(v);
    }
    if (RES) {
        v += R[P.r_base + mm * P.N + nn];
    }
    return v;
}

fn put_word(z: u32, w: u32, bits: u32) {
    if (NC > 1u && z == 1u) {
        C1[w] = bits;
    } else if (NC > 2u && z == 2u) {
        C2[w] = bits;
    } else {
        C[w] = bits;
    }
}

// The bias of column nn (BIAS 1), or of column nn of batch entry z (BIAS 3: sibling linears).
fn bias_at(z: u32, nn: u32) -> f32 {
    if (BIAS == 3u) {
        return BIASV[P.bias_base + z * P.N + nn];
    }
    return BIASV[P.bias_base + nn];
}

// Element w of C, C1 or C2 (by batch entry z, as put_word) through the float32 views.
fn put_f32(z: u32, w: u32, v: f32) {
    if (NC > 1u && z == 1u) {
        CF1[w] = v;
    } else if (NC > 2u && z == 2u) {
        CF2[w] = v;
    } else {
        CF[w] = v;
    }
}

// C(mm, nn) and C(mm, nn + 1) from the accumulated v0, v1 (a pair of neighbouring columns, so
// a float16 C is written in whole words: the lowering routes float16 outputs whose pairs are not
// words through float32). Each entry point's out_* function hands its result matrices here,
// two elements per lane at a time, through its workgroup tile tC_*.
fn write_pair(z: u32, c_off: u32, mm: u32, nn: u32, v0: f32, v1: f32) {
    if (mm < P.M && nn < P.N) {
        let idx = c_off + mm * P.c_sm + nn * P.c_sn;
        let r0 = result(v0, z, mm, nn);
        if (DT_OUT == 1u) {
            put_word(z, idx >> 1u, pack2x16float(vec2<f32>(r0, result(v1, z, mm, nn + 1u))));
        } else {
            put_word(z, idx, bitcast<u32>(r0));
            if (nn + 1u < P.N) {
                put_word(z, idx + P.c_sn, bitcast<u32>(result(v1, z, mm, nn + 1u)));
            }
        }
    }
}

//! generate matmul_sgmat
