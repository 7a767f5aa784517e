// linear with a packed GGUF weight (quant.wgsl): OUT(m, n) = sum_k X(m, k) W(n, k) + bias(n), then
// the fused consumer of core/plan/fusion.py `epilogue_fusions` (gelu, or + R) when there is one.
// X, the bias, R and every output are float32 (core/webgpu/ops_quant.py routes other storage
// through float32 scratch); X is bound as vec4s (its rows start at vec4 boundaries, K is a
// multiple of 32). W is the raw GGUF bytes of weight rows n_lo..n_hi-1 as u32 words.
//
// Sibling linears (NC > 1: the same input, same-shaped weights the executor placed back to back)
// are one product over NC * n_per weight rows: row n belongs to linear n / n_per, whose output
// (OUT, OUT1 or OUT2) gets column n % n_per.
//
// Entry points (ops_quant.py picks one):
// - `qgemv`, M <= 8 (decode): a workgroup of TPR x ROWS threads owns ROWS weight rows. A row is cut
//   into units, quarters of a block (8 values); its TPR lanes take consecutive units, two per
//   loop trip with both units' words loaded first, and read the matching vec4s of every X row
//   (coalesced: 4 lanes cover a block's 32 columns), accumulating the GM rows' dot products in
//   registers; a tree over workgroup memory then sums each (row, m)'s TPR partials. TPR = the
//   units divided evenly into trips of at most 64 lanes x 2 units (K = 576: 72 units, 36 lanes
//   of 2). Measured on an H100 against a block per lane (whose X reads were 128 bytes apart
//   across a warp): the same at SmolLM2's 576-wide rows (7 us, launch-bound), about 2x (up to 6x)
//   faster from K = 4096 on; on a quiet host it read 480-1200 GB/s of weights from K = 4096 on
//   and SmolLM2's q8_0 lm_head (49152 x 576) in 39 us (770 GB/s).
// - `qmm`, M > 8 (prefill): (4 WY) x (4 WX) output tiles, 4 x 4 per thread. Per K step of one block
//   (32 values) the workgroup stages X's 4 WY x 32 tile and dequantizes the weight's 4 WX x 32
//   tile into workgroup memory once (four threads per block, eight values each), then every
//   thread multiplies from there. With too few tiles to fill the GPU, KSPLIT workgroups per tile
//   each take a range of the blocks and `qmm_sum` adds their partials (split-K). H100, 128 rows:
//   SmolLM2's 576 x 576 in 23 us, 1536 x 576 in 42 us, 576 x 1536 in 36 us (the float32 kernels
//   on float32 weights: 20, 27, 36 us); 14336 x 4096 (q4_0) at 12 TFLOP/s.
// - `qgemv_cat`, M <= 8 (decode): the planner's concatenated product (core/plan/fusion.py gemm_cat)
//   over up to three packed weights of one type and K, each in its own binding (W, OUT1, OUT2:
//   the executor places only same-shaped siblings back to back, so q, k and v may lie in separate
//   buffers). qgemv's row loop and reduction, with the binding picked per weight row (`q_slot`):
//   CAT 1 writes the concatenated row [x.W_0 | x.W_1 | x.W_2] at row stride c_sm (the scratch a
//   rope_kv reads), each workgroup inside one weight so its binding choice is uniform; CAT 2 writes
//   silu(x.W_g) * (x.W_u) (the MLP front in one dispatch), thread rows pairing a gate row (even)
//   with the same up row (odd), ROWS even.
// - `qgemv_cat_norm`: qgemv_cat whose X is h = rms_norm(src) * w, or with the add s = x + y before
//   it (NORM 2: workgroup 0 writes s), the planner's norm prologue (core/plan/fusion.py
//   `Fusion.norm`): every workgroup computes h into workgroup memory (HS = GM * K / 4 vec4s)
//   before its products, in the order of fused.wgsl's add_rms (sum of squares per row, then
//   s * rstd * w). A decoder layer then runs no add_rms_norm kernel between its products.
// - `qgemv_rope`: qgemv_cat_norm over q, k and v whose stores are the planner's rope_kv group
//   (q and k rotated, k and v into their caches at the position): the attention's whole front in
//   one dispatch. Its tensors other than the weights share one binding, S (RK).
// - `qgemv_attn`: qgemv whose X rows every workgroup first merges from the split-key attention's
//   partials (attention_flash.wgsl attn_flash's), the planner's sdpa_linear group: the decode
//   attention's combine inside the o product, no dispatch of its own (quant_mm_body.wgsl).
//
// Two modules share the kernels' text (quant_mm_body.wgsl): this one reduces with workgroup
// memory trees (any device), quant_mm_sg.wgsl with subgroup sums (devices with the `subgroups`
// feature; ops_quant.py picks). Each defines the reductions the body calls: gemv_reduce,
// gemv_sum and the norm prologue qn_prologue.

//! include quant_mm_body.wgsl

// ------------------------------------------------------------------------------------------ tree reductions

// Sums each thread row's TPR partials (acc_a, acc_b) into red[2 r TPR] (X rows 0..3) and
// red[2 r TPR + 1] (4..7). Called in uniform control flow (it has barriers).
fn gemv_reduce(r: u32, lane: u32) {
    let me = 2u * (r * TPR + lane);
    red[me] = acc_a;
    red[me + 1u] = acc_b;
    workgroupBarrier();
    // Tree over the row's lanes: stride TP2 / 2 first folds lanes TP2/2..TPR-1 onto 0.., then halves.
    for (var st = TP2 / 2u; st > 0u; st >>= 1u) {
        if (lane < st && lane + st < TPR) {
            red[me] += red[me + 2u * st];
            red[me + 1u] += red[me + 2u * st + 1u];
        }
        workgroupBarrier();
    }
}

// The reduced dot product of thread row rr with X row m.
fn gemv_sum(rr: u32, m: u32) -> f32 {
    return red[2u * rr * TPR + m / 4u][m % 4u];
}

// hs4 = rms_norm(src) * w for the GM rows, over all TPR * ROWS threads (`red` holds the sums of
// squares: rows 0..3 at even, 4..7 at odd entries). Called in uniform control flow (barriers);
// its last barrier also orders the reads of red[0..1] before gemv_reduce reuses red.
fn qn_prologue(li: u32, first: bool) {
    let K4 = P.K / 4u;
    let nt = TPR * ROWS;
    for (var c = li; c < K4; c += nt) {
        qn_column(c, first);
    }
    red[2u * li] = sq_a;
    red[2u * li + 1u] = sq_b;
    workgroupBarrier();
    var p2 = 1u;   // nt rounded up to a power of two: the tree's first stride is half of it
    while (p2 < nt) {
        p2 <<= 1u;
    }
    for (var st = p2 / 2u; st > 0u; st >>= 1u) {
        if (li < st && li + st < nt) {
            red[2u * li] += red[2u * (li + st)];
            red[2u * li + 1u] += red[2u * (li + st) + 1u];
        }
        workgroupBarrier();
    }
    let kf = f32(P.K);
    let eps = vec4<f32>(bitcast<f32>(P.eps));
    let ra = vec4<f32>(1.0) / sqrt(red[0] / kf + eps);
    let rb = vec4<f32>(1.0) / sqrt(red[1] / kf + eps);
    qn_scale(li, nt, ra, rb);
    workgroupBarrier();
}
