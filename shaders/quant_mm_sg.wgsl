enable subgroups;
// quant_mm.wgsl's kernels (qgemv, qgemv_cat, qgemv_cat_norm, qgemv_rope; the same entry points, parameters
// and bindings, and qmm unchanged) with their reductions done by subgroup sums: the module for
// devices with the `subgroups` feature (core/webgpu/ops_quant.py picks it, with TPR = 32 lanes
// per weight row by default). wgpu-native's WGSL front end (naga) rejects the `enable` line
// above; core/webgpu/device.py drops it there (its feature is named `subgroup`).
//
// A subgroup's size (and which invocations it holds) is not fixed by WebGPU: 4 to 128, and
// nothing says which invocations of a workgroup share one. So each reduction checks that the
// lane's subgroup is exactly its thread row (TPR active invocations, all of the row); where it is
// not (a device with smaller subgroups), the row is summed through workgroup memory instead.
// A row's lanes agree on that check (a subgroup equal to the row holds all of them), so the
// result never mixes the two. The one barrier that path needs is taken by every thread.
//
// The tree of quant_mm.wgsl takes 1 + log2(TPR) barriers per reduction and the norm prologue as
// many over the whole workgroup; here a row reduces with no barrier in its sum, and the norm's
// sums of squares are exchanged between thread rows at the one barrier that publishes its rows.
//
// Row loops: a lane loads 3 or 4 units a trip (UPL, ops_quant.py picks the fewer that give the
// fewest trips) before their math; a big plain qgemv whose rows take one trip (the LM head) gives
// a thread row two weight rows (RPT 2), both rows' loads issued before either's math.

//! include quant_mm_body.wgsl

// ------------------------------------------------------------------------------------------ subgroup reductions

var<workgroup> rtot: array<vec4<f32>, 2u * ROWS>;   // [row][2]: each thread row's sums (X rows 0..3, 4..7)

var<private> tot_a: vec4<f32>;
var<private> tot_b: vec4<f32>;

// The subgroup sums of v's first n components (n <= 4; the others 0).
fn sg_sum(v: vec4<f32>, n: u32) -> vec4<f32> {
    if (n == 1u) {
        return vec4<f32>(subgroupAdd(v.x), 0.0, 0.0, 0.0);
    }
    if (n == 2u) {
        return vec4<f32>(subgroupAdd(v.xy), 0.0, 0.0);
    }
    if (n == 3u) {
        return vec4<f32>(subgroupAdd(v.xyz), 0.0);
    }
    return subgroupAdd(v);
}

// tot_a / tot_b = the sums of va / vb over thread row r's TPR lanes, in every lane of the row.
// Called in uniform control flow (a barrier); red is free again after the caller's next barrier.
fn row_total(r: u32, lane: u32, va: vec4<f32>, vb: vec4<f32>) {
    // Only the components of the GM rows: a decode step (GM 1) sums one float, not four. vb holds
    // X rows 4..7, or at RPT 2 (GM <= 4) the thread row's second weight row.
    var sa = sg_sum(va, min(GM, 4u));
    var sb = vec4<f32>(0.0);
    if (GM > 4u) {
        sb = sg_sum(vb, GM - 4u);
    } else if (RPT > 1u) {
        sb = sg_sum(vb, GM);
    }
    let whole = subgroupAdd(1u) == TPR && subgroupAll(subgroupBroadcastFirst(r) == r);
    let me = 2u * (r * TPR + lane);
    if (!whole) {
        red[me] = va;
        red[me + 1u] = vb;
    }
    workgroupBarrier();
    if (!whole) {
        sa = vec4<f32>(0.0);
        sb = vec4<f32>(0.0);
        let r0 = 2u * r * TPR;
        for (var i = 0u; i < TPR; i++) {
            sa += red[r0 + 2u * i];
            sb += red[r0 + 2u * i + 1u];
        }
    }
    tot_a = sa;
    tot_b = sb;
}

// Each thread row's sums of (acc_a, acc_b) into rtot, for every thread (the gate / up pairs of
// qgemv_cat CAT 2 read another row's). Called in uniform control flow (barriers).
fn gemv_reduce(r: u32, lane: u32) {
    row_total(r, lane, acc_a, acc_b);
    if (lane == 0u) {
        rtot[2u * r] = tot_a;
        rtot[2u * r + 1u] = tot_b;
    }
    workgroupBarrier();
}

// The reduced dot product of thread row rr with X row m.
fn gemv_sum(rr: u32, m: u32) -> f32 {
    return rtot[2u * rr + m / 4u][m % 4u];
}

// hs4 = rms_norm(src) * w for the GM rows. The thread rows share the columns by loop trip (trip t
// by row t % ROWS): each loads, stores into hs4 (and s) and sums the squares of its share only, a
// subgroup sum each, then every thread adds the ROWS shares from rtot after the barrier that also
// publishes hs4 (one barrier, as when each row summed all K itself, with 1 / ROWS of the loads: at
// 4 rows a workgroup the gate / up product's 768 workgroups read 3.5 MB of src and y, not 14).
// Called in uniform control flow (barriers); its last barrier also orders the reads of red and
// rtot before gemv_reduce reuses them.
fn qn_prologue(li: u32, first: bool) {
    let K4 = P.K / 4u;
    let nt = TPR * ROWS;
    let r = li / TPR;
    let lane = li % TPR;
    for (var c = r * TPR + lane; c < K4; c += nt) {
        qn_column(c, first);
    }
    row_total(r, lane, sq_a, sq_b);
    if (lane == 0u) {
        rtot[2u * r] = tot_a;
        rtot[2u * r + 1u] = tot_b;
    }
    workgroupBarrier();   // every row's share of hs4 and of the sums stored
    var sa = rtot[0];
    var sb = rtot[1];
    for (var i = 1u; i < ROWS; i++) {
        sa += rtot[2u * i];
        sb += rtot[2u * i + 1u];
    }
    let kf = f32(P.K);
    let eps = vec4<f32>(bitcast<f32>(P.eps));
    let ra = vec4<f32>(1.0) / sqrt(sa / kf + eps);
    let rb = vec4<f32>(1.0) / sqrt(sb / kf + eps);
    qn_scale(li, nt, ra, rb);
    workgroupBarrier();
}
