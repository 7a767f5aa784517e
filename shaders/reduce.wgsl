// Reductions over one contiguous block of dims: sum, mean, amax, argmax. One workgroup per output
// element (row); rows are laid out as in softmax.wgsl ([outer, L, inner], element j of row r at
// base + (r / inner) * L * inner + r % inner + j * inner). core/kernels.py first permutes into a
// scratch when the reduced dims are not one block. The result of row r goes to OUT[out_base + r]
// (32-bit output dtypes only: float16 results go through a float32 scratch and a cast).
//
// OP: 0 sum, 1 mean, 2 amax, 3 argmax (first maximal index; NaN counts as the maximum, as numpy).
// INT_MATH: int32 input, exact int32 sum/amax and int comparisons for argmax.

//! include common.wgsl

struct ReduceParams {
    rows: u32,
    L: u32,
    inner: u32,
    x_base: u32,
    out_base: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override DTX: u32 = 0u;
override OP: u32 = 0u;
override INT_MATH: bool = false;
override RWG: u32 = 64u;

@group(0) @binding(0) var<uniform> P: ReduceParams;
@group(0) @binding(2) var<storage, read_write> X: array<u32>;

var<workgroup> rv: array<f32, RWG>;
var<workgroup> ri: array<i32, RWG>;
var<workgroup> rj: array<u32, RWG>;

fn ldf(i: u32) -> f32 { return word_f32(X[widx(i, DTX)], i, DTX); }
fn ldi(i: u32) -> i32 { return word_i32(X[widx(i, DTX)], i, DTX); }

// Is candidate (v, j) a better argmax than (bv, bj)? Float compare; NaN wins; ties: lower index.
fn better_f(v: f32, j: u32, bv: f32, bj: u32) -> bool {
    let vn = is_nan(v);
    let bn = is_nan(bv);
    if (vn != bn) {
        return vn;
    }
    if (vn || v == bv) {
        return j < bj;
    }
    return v > bv;
}

fn better_i(v: i32, j: u32, bv: i32, bj: u32) -> bool {
    return v > bv || (v == bv && j < bj);
}

@compute @workgroup_size(RWG)
fn reduce_rows(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= P.rows) {
        return;
    }
    let xb = P.x_base + (r / P.inner) * P.L * P.inner + r % P.inner;
    // Per-thread partials: float value, int value, index.
    var fv = 0.0;
    var iv = 0;
    var bj = 0xffffffffu;
    if (OP == 2u || OP == 3u) {
        fv = neg_inf();
        iv = i32(0x80000000u);
    }
    for (var j = li; j < P.L; j += RWG) {
        let e = xb + j * P.inner;
        if (INT_MATH) {
            let v = ldi(e);
            switch OP {
                case 2u: { iv = max(iv, v); }
                case 3u: { if (bj == 0xffffffffu || better_i(v, j, iv, bj)) { iv = v; bj = j; } }
                default: { iv = iv + v; }
            }
        } else {
            let v = ldf(e);
            switch OP {
                case 2u: { if (v > fv || is_nan(v)) { fv = v; } }
                case 3u: { if (bj == 0xffffffffu || better_f(v, j, fv, bj)) { fv = v; bj = j; } }
                default: { fv = fv + v; }
            }
        }
    }
    rv[li] = fv;
    ri[li] = iv;
    rj[li] = bj;
    workgroupBarrier();
    for (var s = RWG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            let ov = rv[li + s];
            let oi = ri[li + s];
            let oj = rj[li + s];
            switch OP {
                case 2u: {
                    if (INT_MATH) { ri[li] = max(ri[li], oi); }
                    else if (ov > rv[li] || is_nan(ov)) { rv[li] = ov; }
                }
                case 3u: {
                    if (oj != 0xffffffffu) {
                        let mine = rj[li];
                        var take = mine == 0xffffffffu;
                        if (!take) {
                            if (INT_MATH) { take = better_i(oi, oj, ri[li], mine); }
                            else { take = better_f(ov, oj, rv[li], mine); }
                        }
                        if (take) { rv[li] = ov; ri[li] = oi; rj[li] = oj; }
                    }
                }
                default: {
                    rv[li] = rv[li] + ov;
                    ri[li] = ri[li] + oi;
                }
            }
        }
        workgroupBarrier();
    }
    if (li != 0u) {
        return;
    }
    let o = P.out_base + r;
    switch OP {
        case 1u: { store_f(o, rv[0] / f32(P.L)); }
        case 3u: { OUT[o] = select(rj[0], 0u, rj[0] == 0xffffffffu); }
        default: {
            if (INT_MATH) { OUT[o] = i32_word(ri[0], DT_OUT); }
            else { store_f(o, rv[0]); }
        }
    }
}
