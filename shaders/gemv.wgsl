// Matrix-vector products for M <= 8 rows with 16-byte loads: `gemv` (see gemv_common.wgsl for
// the work split, the reduction and the epilogues). A is float32 and B float32 or float16 (a
// linear's weight [N, K], fp16-packed or not), both bound as arrays of 16-byte vectors: a chunk is
// one vec4<u32> of B, 4 float32 or 8 float16 elements (unpack2x16float; no `shader-f16` needed),
// against one or two vec4<f32> of each row of A. core/webgpu/ops_matmul.py sends only products
// whose rows are whole chunks at chunk-aligned offsets (K, b_sn, the bases and batch strides) and
// whose A rows are vec4-aligned (a_sk == 1); everything else runs gemv_any.wgsl.

//! include common.wgsl

//! include mm_params.wgsl

//! include gemv_common.wgsl

override DTB: u32 = 0u;   // 0 float32, 1 float16

@group(0) @binding(2) var<storage, read_write> A4: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> B4: array<vec4<u32>>;

fn f16_lo(q: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y));
}

fn f16_hi(q: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(q.z), unpack2x16float(q.w));
}

// One row of A (vec4 index xb of k = 0) against weight chunks c, c + LANES, c + 2 LANES,
// c + 3 LANES (q0..q3; chunk i > 0 only where u_i: past the row they were not loaded, and A is not
// read there either, so nothing non-finite from outside the row can reach the sum).
fn gemv_row(xb: u32, c: u32, q0: vec4<u32>, q1: vec4<u32>, q2: vec4<u32>, q3: vec4<u32>,
            u1: bool, u2: bool, u3: bool) -> vec4<f32> {
    if (DTB == DT_F16) {
        let i = xb + 2u * c;
        let s = 2u * LANES;
        var r = A4[i] * f16_lo(q0) + A4[i + 1u] * f16_hi(q0);
        if (u1) { r += A4[i + s] * f16_lo(q1) + A4[i + s + 1u] * f16_hi(q1); }
        if (u2) { r += A4[i + 2u * s] * f16_lo(q2) + A4[i + 2u * s + 1u] * f16_hi(q2); }
        if (u3) { r += A4[i + 3u * s] * f16_lo(q3) + A4[i + 3u * s + 1u] * f16_hi(q3); }
        return r;
    }
    let i = xb + c;
    var r = A4[i] * bitcast<vec4<f32>>(q0);
    if (u1) { r += A4[i + LANES] * bitcast<vec4<f32>>(q1); }
    if (u2) { r += A4[i + 2u * LANES] * bitcast<vec4<f32>>(q2); }
    if (u3) { r += A4[i + 3u * LANES] * bitcast<vec4<f32>>(q3); }
    return r;
}

@compute @workgroup_size(WGS)
fn gemv(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let n = gemv_column(li, wid.x + wid.y * nwg.x);
    let z = wid.z;
    let offs = batch_offsets(z);
    let ch = select(4u, 8u, DTB == DT_F16);   // elements per chunk (one vec4<u32> of B)
    let nch = P.K / ch;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
    if (n < P.N) {
        let wb = (offs.y + n * P.b_sn) / ch;
        let xb = offs.x / 4u;
        let xs = P.a_sm / 4u;
        for (var c = li % LANES; c < nch; c += 4u * LANES) {
            // Every weight load of the trip is issued before the first is used.
            let u1 = c + LANES < nch;
            let u2 = c + 2u * LANES < nch;
            let u3 = c + 3u * LANES < nch;
            let q0 = B4[wb + c];
            var q1 = vec4<u32>(0u);
            var q2 = vec4<u32>(0u);
            var q3 = vec4<u32>(0u);
            if (u1) { q1 = B4[wb + c + LANES]; }
            if (u2) { q2 = B4[wb + c + 2u * LANES]; }
            if (u3) { q3 = B4[wb + c + 3u * LANES]; }
            a0 += gemv_row(xb, c, q0, q1, q2, q3, u1, u2, u3);
            if (GM > 1u) { a1 += gemv_row(xb + xs, c, q0, q1, q2, q3, u1, u2, u3); }
            if (GM > 2u) { a2 += gemv_row(xb + 2u * xs, c, q0, q1, q2, q3, u1, u2, u3); }
            if (GM > 3u) { a3 += gemv_row(xb + 3u * xs, c, q0, q1, q2, q3, u1, u2, u3); }
            if (GM > 4u) { a4 += gemv_row(xb + 4u * xs, c, q0, q1, q2, q3, u1, u2, u3); }
            if (GM > 5u) { a5 += gemv_row(xb + 5u * xs, c, q0, q1, q2, q3, u1, u2, u3); }
            if (GM > 6u) { a6 += gemv_row(xb + 6u * xs, c, q0, q1, q2, q3, u1, u2, u3); }
            if (GM > 7u) { a7 += gemv_row(xb + 7u * xs, c, q0, q1, q2, q3, u1, u2, u3); }
        }
    }
    gemv_finish(li, n, z, offs.z, hsum(a0), hsum(a1), hsum(a2), hsum(a3), hsum(a4), hsum(a5), hsum(a6),
                hsum(a7));
}
