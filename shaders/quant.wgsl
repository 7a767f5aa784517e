// Packed GGUF weight blocks (core/dtypes.py QUANT_BLOCKS), decoded from the raw file bytes. A file
// that includes this one defines `fn q_word(i: u32) -> u32`, word i of the weight bytes being decoded
// (one binding `W`, or for quant_mm.wgsl's qgemv_cat the binding of the current weight); no
// `shader-f16` is needed (scales go through unpack2x16float).
//
//   QT 0 q4_0: f16 d, 16 bytes of nibbles           (18 bytes)  x = (q - 8) * d
//   QT 1 q4_1: f16 d, f16 m, 16 bytes of nibbles    (20 bytes)  x = q * d + m
//   QT 2 q8_0: f16 d, 32 int8                       (34 bytes)  x = q * d
//
// Nibble byte j holds value j (low nibble) and value j + 16 (high nibble), so the qs word j
// (bytes 4j..4j+3) holds values 4j..4j+3 and 16+4j..16+4j+3; a q8_0 qs word j holds 4j..4j+3.
// q4_1's blocks are word aligned; q4_0's and q8_0's are 2-byte aligned only (18 and 34 bytes), so
// every read takes a byte address that is even and combines half words where it is 2 mod 4.
//
// Every value is decoded as q * d + m with m = -8 d for q4_0 and 0 for q8_0: q * d is exact in
// float32 (a 4- or 8-bit integer times an 11-bit f16 mantissa), and so is -8 d, so a compiler
// that contracts it into an fma or not gives the same single rounding (none for q4_0, whose
// (q - 8) d is representable; one for q4_1's + m): the values are gguf's float32 ones bit for bit.

override QT: u32 = 0u;

// Bytes of one block.
fn q_block_bytes() -> u32 {
    if (QT == 1u) {
        return 20u;
    }
    if (QT == 2u) {
        return 34u;
    }
    return 18u;
}

// The 16 bits at even byte address e.
fn q_ld16(e: u32) -> u32 {
    return (q_word(e >> 2u) >> ((e & 2u) * 8u)) & 0xffffu;
}

// The 32 bits at even byte address e (a multiple of 4 for q4_1): one word, or the halves of two
// when e is 2 mod 4. Both reads stay inside the bytes e..e+3 (the second index is the first one
// when e is aligned), so the last block of a binding never reads past it.
fn q_ld32(e: u32) -> u32 {
    if (QT == 1u) {   // q4_1's blocks (20 bytes) and their words are word aligned: one load
        return q_word(e >> 2u);
    }
    let i = e >> 2u;
    let odd = (e & 2u) != 0u;
    let w0 = q_word(i);
    let w1 = q_word(i + select(0u, 1u, odd));
    return select(w0, (w0 >> 16u) | (w1 << 16u), odd);
}

// (d, m) of the block at byte a: every value is q * d + m.
fn q_scale(a: u32) -> vec2<f32> {
    if (QT == 1u) {
        return unpack2x16float(q_word(a >> 2u));
    }
    let d = unpack2x16float(q_ld16(a)).x;
    if (QT == 0u) {
        return vec2<f32>(d, -8.0 * d);
    }
    return vec2<f32>(d, 0.0);
}

// Values 4j..4j+3 (low nibbles) and 16+4j..16+4j+3 (high nibbles) of a q4 qs word.
fn q4_lo(qw: u32, s: vec2<f32>) -> vec4<f32> {
    let q = (vec4<u32>(qw) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u);
    return vec4<f32>(q) * s.x + s.y;
}

fn q4_hi(qw: u32, s: vec2<f32>) -> vec4<f32> {
    let q = (vec4<u32>(qw) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(15u);
    return vec4<f32>(q) * s.x + s.y;
}

// The four signed bytes of a q8_0 qs word, times d.
fn q8_vals(qw: u32, s: vec2<f32>) -> vec4<f32> {
    let q = bitcast<vec4<i32>>(vec4<u32>(qw) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u);
    return vec4<f32>(q) * s.x;
}

// A quarter j (0..3) of the block at byte a: 8 values, `lo` at positions q_klo(j).., `hi` at
// q_khi(j)... (q4: qs word j's low and high nibbles; q8_0: qs words 2j and 2j + 1). The tiled
// product and the embedding gather decode a block in four threads this way.
struct QPart {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

fn q_part(a: u32, j: u32) -> QPart {
    let s = q_scale(a);
    if (QT == 2u) {
        return QPart(q8_vals(q_ld32(a + 2u + 8u * j), s), q8_vals(q_ld32(a + 6u + 8u * j), s));
    }
    let qw = q_ld32(a + select(2u, 4u, QT == 1u) + 4u * j);
    return QPart(q4_lo(qw, s), q4_hi(qw, s));
}

fn q_klo(j: u32) -> u32 {
    return select(4u * j, 8u * j, QT == 2u);
}

fn q_khi(j: u32) -> u32 {
    return select(16u + 4u * j, 8u * j + 4u, QT == 2u);
}
