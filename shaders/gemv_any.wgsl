// Matrix-vector products for M <= 8 rows, any layout with B read along k (b_sk == 1): `gemv_any`,
// the same work split, reduction and epilogues as gemv.wgsl (gemv_common.wgsl) for the products its
// 16-byte loads cannot take: K or a row stride that is not a whole number of chunks (a prime K),
// bases off a chunk boundary, A strided along k or of another dtype, B of any dtype. Operands are
// arrays of 32-bit words read element by element (float16 halves through `word_f32`); a chunk is
// 4 consecutive elements of k, with the elements past K read as zeros.

//! include common.wgsl

//! include mm_params.wgsl

//! include gemv_common.wgsl

override DTA: u32 = 0u;
override DTB: u32 = 0u;

@group(0) @binding(2) var<storage, read_write> A: array<u32>;
@group(0) @binding(3) var<storage, read_write> B: array<u32>;

// Elements k0..k0+3 of weight row wr (element offset of k = 0), zeros past K.
fn gemv_w(wr: u32, k0: u32) -> vec4<f32> {
    var r = vec4<f32>(0.0);
    if (k0 < P.K) { r.x = word_f32(B[widx(wr + k0, DTB)], wr + k0, DTB); }
    if (k0 + 1u < P.K) { r.y = word_f32(B[widx(wr + k0 + 1u, DTB)], wr + k0 + 1u, DTB); }
    if (k0 + 2u < P.K) { r.z = word_f32(B[widx(wr + k0 + 2u, DTB)], wr + k0 + 2u, DTB); }
    if (k0 + 3u < P.K) { r.w = word_f32(B[widx(wr + k0 + 3u, DTB)], wr + k0 + 3u, DTB); }
    return r;
}

// A(m, k0..k0+3) of the row at element offset xr, zeros past K.
fn gemv_x(xr: u32, k0: u32) -> vec4<f32> {
    var r = vec4<f32>(0.0);
    if (k0 < P.K) { r.x = gemv_a(xr + k0 * P.a_sk); }
    if (k0 + 1u < P.K) { r.y = gemv_a(xr + (k0 + 1u) * P.a_sk); }
    if (k0 + 2u < P.K) { r.z = gemv_a(xr + (k0 + 2u) * P.a_sk); }
    if (k0 + 3u < P.K) { r.w = gemv_a(xr + (k0 + 3u) * P.a_sk); }
    return r;
}

fn gemv_a(i: u32) -> f32 {
    return word_f32(A[widx(i, DTA)], i, DTA);
}

// One row of A against weight chunks c .. c + 3 LANES (w0..w3; chunk i > 0 only where u_i).
fn gemv_row_any(xr: u32, c: u32, w0: vec4<f32>, w1: vec4<f32>, w2: vec4<f32>, w3: vec4<f32>,
                u1: bool, u2: bool, u3: bool) -> vec4<f32> {
    var r = gemv_x(xr, 4u * c) * w0;
    if (u1) { r += gemv_x(xr, 4u * (c + LANES)) * w1; }
    if (u2) { r += gemv_x(xr, 4u * (c + 2u * LANES)) * w2; }
    if (u3) { r += gemv_x(xr, 4u * (c + 3u * LANES)) * w3; }
    return r;
}

@compute @workgroup_size(WGS)
fn gemv_any(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(num_workgroups) nwg: vec3<u32>) {
    let n = gemv_column(li, wid.x + wid.y * nwg.x);
    let z = wid.z;
    let offs = batch_offsets(z);
    let nch = (P.K + 3u) / 4u;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
    if (n < P.N) {
        let wr = offs.y + n * P.b_sn;
        let xs = P.a_sm;
        for (var c = li % LANES; c < nch; c += 4u * LANES) {
            let u1 = c + LANES < nch;
            let u2 = c + 2u * LANES < nch;
            let u3 = c + 3u * LANES < nch;
            let w0 = gemv_w(wr, 4u * c);
            var w1 = vec4<f32>(0.0);
            var w2 = vec4<f32>(0.0);
            var w3 = vec4<f32>(0.0);
            if (u1) { w1 = gemv_w(wr, 4u * (c + LANES)); }
            if (u2) { w2 = gemv_w(wr, 4u * (c + 2u * LANES)); }
            if (u3) { w3 = gemv_w(wr, 4u * (c + 3u * LANES)); }
            a0 += gemv_row_any(offs.x, c, w0, w1, w2, w3, u1, u2, u3);
            if (GM > 1u) { a1 += gemv_row_any(offs.x + xs, c, w0, w1, w2, w3, u1, u2, u3); }
            if (GM > 2u) { a2 += gemv_row_any(offs.x + 2u * xs, c, w0, w1, w2, w3, u1, u2, u3); }
            if (GM > 3u) { a3 += gemv_row_any(offs.x + 3u * xs, c, w0, w1, w2, w3, u1, u2, u3); }
            if (GM > 4u) { a4 += gemv_row_any(offs.x + 4u * xs, c, w0, w1, w2, w3, u1, u2, u3); }
            if (GM > 5u) { a5 += gemv_row_any(offs.x + 5u * xs, c, w0, w1, w2, w3, u1, u2, u3); }
            if (GM > 6u) { a6 += gemv_row_any(offs.x + 6u * xs, c, w0, w1, w2, w3, u1, u2, u3); }
            if (GM > 7u) { a7 += gemv_row_any(offs.x + 7u * xs, c, w0, w1, w2, w3, u1, u2, u3); }
        }
    }
    gemv_finish(li, n, z, offs.z, hsum(a0), hsum(a1), hsum(a2), hsum(a3), hsum(a4), hsum(a5), hsum(a6),
                hsum(a7));
}
