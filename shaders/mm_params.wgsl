// The uniform parameters and batch addressing shared by the matrix-product kernels
// (matmul.wgsl, matmul_fast.wgsl; core/kernels.py packs MMParams). `P` is declared by the includer.

struct MMParams {
    M: u32,
    N: u32,
    K: u32,
    nb1: u32,
    a_base: u32,
    b_base: u32,
    c_base: u32,
    bias_base: u32,
    a_sm: u32,
    a_sk: u32,
    b_sk: u32,
    b_sn: u32,
    c_sm: u32,
    c_sn: u32,
    group: u32,
    nb0: u32,
    a_sb0: u32,
    a_sb1: u32,
    b_sb0: u32,
    b_sb1: u32,
    c_sb0: u32,
    c_sb1: u32,
    alpha: f32,
    r_base: u32,     // matmul_fast.wgsl RES: element offset of R (otherwise unused)
}

// Operand offsets of batch z: (a, b, c), in elements.
fn batch_offsets(z: u32) -> vec3<u32> {
    let b0 = z / P.nb1;
    let b1 = z % P.nb1;
    return vec3<u32>(P.a_base + b0 * P.a_sb0 + b1 * P.a_sb1,
                     P.b_base + b0 * P.b_sb0 + (b1 / P.group) * P.b_sb1,
                     P.c_base + b0 * P.c_sb0 + b1 * P.c_sb1);
}
