// The argmax of one float32 vector, kept on the GPU: a greedy decode's pick of the next token,
// written where the next decode step reads its `ids` input (Executor.argmax_device), so the
// token never has to come back to the host before that step is submitted.
//
// Two dispatches in one pass (storage writes of one dispatch are visible to the next):
//   argmax_part:  P.parts workgroups of WG threads; each thread walks X[x_base + i] for
//                 i = wid * WG + li, then every P.parts * WG (adjacent threads read adjacent
//                 words), the workgroup reduces its threads' candidates and writes the best
//                 (value bits, index) pair to S[2 wid], S[2 wid + 1];
//   argmax_final: one workgroup reduces the P.parts pairs and writes the index to OUT[0] (i32).
// torch.argmax's rule: the first NaN wins, else the first of equal maxima (-inf included: an
// all -inf vector gives 0). Candidates carry their index, so the reduction order does not matter.

//! include math.wgsl

struct ArgmaxParams {
    n: u32,  // elements
    x_base: u32,  // element offset of X[0] of the vector inside the binding (binding offsets are aligned)
    parts: u32,  // workgroups of argmax_part (at most WG: argmax_final reduces one pair per thread)
    _pad0: u32,
}

const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;  // no candidate yet

@group(0) @binding(0) var<uniform> P: ArgmaxParams;
@group(0) @binding(1) var<storage, read_write> S: array<u32>;
@group(0) @binding(2) var<storage, read_write> X: array<f32>;
@group(0) @binding(3) var<storage, read_write> OUT: array<i32>;

var<workgroup> bv: array<f32, WG>;
var<workgroup> bi: array<u32, WG>;

// Does candidate (v, j) beat (w, k)? NaN is tested on the bits (math.wgsl: compilers fold x != x).
fn better(v: f32, j: u32, w: f32, k: u32) -> bool {
    if (j == NONE) {
        return false;
    }
    if (k == NONE) {
        return true;
    }
    let vn = is_nan(v);
    let wn = is_nan(w);
    if (vn != wn) {
        return vn;
    }
    if (vn || v == w) {
        return j < k;
    }
    return v > w;
}

// Tree reduction of the workgroup's WG candidates into bv[0], bi[0].
fn reduce_workgroup(li: u32) {
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        workgroupBarrier();
        if (li < s && better(bv[li + s], bi[li + s], bv[li], bi[li])) {
            bv[li] = bv[li + s];
            bi[li] = bi[li + s];
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(WG)
fn argmax_part(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    var v = 0.0;
    var j = NONE;
    let stride = P.parts * WG;
    for (var i = wid.x * WG + li; i < P.n; i += stride) {
        let x = X[P.x_base + i];
        if (better(x, i, v, j)) {
            v = x;
            j = i;
        }
    }
    bv[li] = v;
    bi[li] = j;
    reduce_workgroup(li);
    if (li == 0u) {
        S[2u * wid.x] = bitcast<u32>(bv[0]);
        S[2u * wid.x + 1u] = bi[0];
    }
}

@compute @workgroup_size(WG)
fn argmax_final(@builtin(local_invocation_index) li: u32) {
    var v = 0.0;
    var j = NONE;
    for (var w = li; w < P.parts; w += WG) {
        let x = bitcast<f32>(S[2u * w]);
        let k = S[2u * w + 1u];
        if (better(x, k, v, j)) {
            v = x;
            j = k;
        }
    }
    bv[li] = v;
    bi[li] = j;
    reduce_workgroup(li);
    if (li == 0u) {
        OUT[0] = i32(bi[0]);
    }
}
