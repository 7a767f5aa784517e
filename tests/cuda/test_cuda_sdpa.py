"""The fused CUDA attention (shaders/cuda_attention.cu, ``sdpa`` in native/cuda_kernels.py).

Launch geometry (``sdpa_launch``: tile sizes against shared memory, the key split of decode) is
pure Python and is checked everywhere. The kernels run only on a CUDA device (``pytest -m gpu``;
elsewhere they are skipped with the reason, which ``pytest -rs`` prints): shapes that reach the
split-K decode path with its combine, the one-split prefill path with causal/mask tile skipping,
the float16 tensor-core prefill kernel (and the same cases with it switched off), every key-tile
size (head dims 16 to 256), fully masked rows (zeros, as torch's sdpa and the reference), additive float masks in
both storage dtypes, the composite fallback (head dim 300), all against float64 numpy on fresh
random inputs, eager and replayed from a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpudelegate
from gpudelegate.native.cuda_kernels import SDPA_FILL4, SDPA_MMA_ROWS, SDPA_ROWS, sdpa_launch, sdpa_mma_smem, sdpa_smem

from conformance.cases import Case, L, Op, build_program, golden, make_data, tolerance
from cuda_env import REASON, cp

H100 = dict(max_shared=48 * 1024, sm_count=132)


# ---------------------------------------------------------------------------- launch geometry (no GPU)

@pytest.mark.parametrize("shape", [
    (1, 9, 3, 1, 512, 64, 64),      # SmolLM2 decode
    (1, 9, 3, 128, 512, 64, 64),    # SmolLM2 prefill over the whole cache
    (1, 32, 8, 1, 257, 64, 64),     # Llama-1B decode
    (2, 6, 2, 3, 131, 32, 48),
    (1, 2, 1, 2, 13001, 16, 16),
    (1, 2, 1, 3, 67, 160, 160),
    (1, 2, 1, 3, 67, 256, 256),
    (3, 5, 5, 7, 1, 7, 3),
])
def test_launch_fits_shared_memory_and_covers_every_key_tile(shape):
    B, H, Hk, Tq, Tk, D, Dv = shape
    lp = sdpa_launch(*shape, **H100)
    assert lp is not None
    assert lp.smem == sdpa_smem(lp.bk, D, Dv, lp.br) <= H100["max_shared"]
    assert lp.no * 128 >= lp.br * Dv  # every output entry of a row tile has an accumulator
    ntiles = -(-Tk // lp.bk)
    # splits x tiles_per_split covers the keys, and the last split is not empty
    assert (lp.splits - 1) * lp.tiles_per_split < ntiles <= lp.splits * lp.tiles_per_split
    assert lp.br in (4, 8, SDPA_ROWS) and (lp.br == SDPA_ROWS or lp.bk >= 16) and (lp.br != 4 or lp.bk >= 32)
    assert lp.br != 4 or (H // Hk) * Tq > 8  # decode keeps 8-row blocks
    assert lp.grid == (-(-(H // Hk) * Tq // lp.br), B * Hk, lp.splits)
    assert lp.rows == B * H * Tq


def test_decode_splits_keys_and_prefill_does_not():
    dec = sdpa_launch(1, 9, 3, 1, 512, 64, 64, **H100)
    assert dec.kernel == "tile" and dec.grid[:2] == (1, 3)  # the 3 query heads of a kv head share a row tile
    # 16-key tiles, one a block: 96 blocks instead of 3 (decode_key_tile)
    assert dec.bk == 16 and dec.splits == 32 and dec.tiles_per_split == 1
    pre = sdpa_launch(1, 9, 3, 128, 512, 64, 64, **H100)
    # 8-row blocks: 16-row ones would give 72 blocks on 132 SMs; 4-row ones where 8-row ones give
    # fewer than SDPA_FILL4 blocks per SM (144 of 8 rows -> 288 of 4)
    if SDPA_FILL4 >= 2:
        assert pre.kernel == "tile" and pre.splits == 1 and pre.br == 4 and pre.grid == (96, 3, 1)
    else:
        assert pre.kernel == "tile" and pre.splits == 1 and pre.br == 8 and pre.grid == (48, 3, 1)


def test_float16_prefill_takes_tensor_cores_where_they_pay():
    # auto: a long prefill fills the GPU with 64-row blocks; SmolLM2's 128 rows x 3 kv heads do not
    big = sdpa_launch(1, 32, 8, 1024, 1024, 64, 64, fp16=True, **H100)
    assert big.kernel == "mma" and big.grid == (4 * 1024 // SDPA_MMA_ROWS, 8, 1) and big.splits == 1
    assert big.smem == sdpa_mma_smem(64, 64) <= H100["max_shared"]
    assert sdpa_launch(1, 9, 3, 128, 512, 64, 64, fp16=True, **H100).kernel == "tile"
    forced = sdpa_launch(1, 9, 3, 128, 512, 64, 64, fp16=True, tensor_cores=True, **H100)
    assert forced.kernel == "mma" and forced.grid == (384 // SDPA_MMA_ROWS, 3, 1)
    assert sdpa_launch(1, 32, 8, 1024, 1024, 64, 64, fp16=True, tensor_cores=False, **H100).kernel == "tile"
    assert sdpa_launch(1, 32, 8, 1024, 1024, 64, 64, fp16=False, **H100).kernel == "tile"  # float32
    for shape in [(1, 9, 3, 1, 512, 64, 64),  # decode: split-K
                  (1, 9, 3, 128, 512, 72, 64),  # 72 % 16
                  (1, 9, 3, 128, 512, 128, 128)]:  # tiles over 48 KiB
        assert sdpa_launch(*shape, fp16=True, tensor_cores=True, **H100).kernel == "tile", shape


def test_decode_takes_the_shortest_key_tile_its_splits_cover():
    # SmolLM2's cache of 256 rows: 16 tiles of 16 keys, one per block (3 kv heads: up to 44 splits)
    lp = sdpa_launch(1, 9, 3, 1, 256, 64, 64, **H100)
    assert (lp.bk, lp.splits, lp.tiles_per_split, lp.br) == (16, 16, 1, 8)
    # 1,024 keys: 16-key tiles would outnumber the splits, 32-key ones do not
    assert sdpa_launch(1, 9, 3, 1, 1024, 64, 64, **H100).bk == 32
    # 2,048 keys: the largest tile, as before (32 splits of one 64-key tile)
    assert sdpa_launch(1, 9, 3, 1, 2048, 64, 64, **H100).bk == 64
    # not decode: more than 8 query rows per kv head, or enough blocks without a split
    assert sdpa_launch(1, 9, 3, 3, 256, 64, 64, **H100).bk == 64
    assert sdpa_launch(40, 9, 3, 1, 256, 64, 64, **H100).bk == 64


def test_larger_heads_take_smaller_key_tiles_and_huge_heads_fall_back():
    # 16 query rows: not a decode shape, so the largest tile that fits shared memory
    assert sdpa_launch(1, 1, 1, 16, 100, 64, 64, **H100).bk == 64
    assert sdpa_launch(1, 1, 1, 16, 100, 128, 128, **H100).bk == 32
    assert sdpa_launch(1, 1, 1, 16, 100, 160, 160, **H100).bk == 16
    assert sdpa_launch(1, 1, 1, 16, 100, 256, 256, **H100).bk == 8
    assert sdpa_launch(1, 1, 1, 1, 100, 300, 64, **H100) is None  # composite matmul/softmax/matmul
    assert sdpa_launch(1, 1, 1, 1, 100, 64, 64, max_shared=4096, sm_count=132) is None
    assert sdpa_launch(1, 1, 1, 1, 0, 64, 64, **H100) is None


# ---------------------------------------------------------------------------- kernels on the GPU

def _case(cid, q, k, dv, storage, attrs=None, mask=None):
    leaves = [L("q", q), L("k", k), L("v", k[:3] + (dv,))]
    names = ["q", "k", "v"]
    if mask is not None:
        leaves.append(L("m", *mask))
        names.append("m")
    return Case(f"{cid}/{storage}", leaves, [Op("sdpa", names, dict(attrs or {}), "y")], ["y"], storage,
                red=max(q[3], k[2]))


CASES = []
for st in ("float32", "float16"):
    CASES += [
        # decode: Tq = 1, 3 heads per kv head, keys split over 9 blocks per kv head, then combined
        _case("decode_gqa_mask", (1, 9, 1, 64), (1, 3, 521, 64), 64, st, mask=((1, 1, 1, 521), "bool", "keep")),
        _case("decode_gqa8_causal", (1, 32, 1, 64), (1, 8, 263, 64), 64, st, {"causal": True, "causal_offset": 250}),
        # a 256-row cache in 16 one-tile splits (decode_key_tile): position 0 (one key seen, 15
        # splits see none and weigh 0 in the combine), the last row, and 255 (all but the last)
        _case("decode_cache_pos0", (1, 9, 1, 64), (1, 3, 256, 64), 64, st, {"causal": True, "causal_offset": 0}),
        _case("decode_cache_last", (1, 9, 1, 64), (1, 3, 256, 64), 64, st, {"causal": True, "causal_offset": 255}),
        _case("decode_cache_pos254", (1, 9, 1, 64), (1, 3, 256, 64), 64, st, {"causal": True, "causal_offset": 254}),
        # prefill: one split, causal + keep-mask (key tiles past the visible part are skipped)
        _case("prefill_causal_mask", (1, 9, 131, 64), (1, 3, 263, 64), 64, st, {"causal": True},
              mask=((1, 1, 131, 263), "bool", "keep")),
        # fully masked rows (i < 5) give zeros like torch's sdpa and the reference: with splits and without
        _case("masked_rows_split", (1, 4, 37, 24), (1, 2, 101, 24), 5, st, {"causal": True, "causal_offset": -5}),
        _case("masked_rows_one_split", (1, 2, 1031, 8), (1, 2, 11, 8), 8, st, {"causal": True, "causal_offset": -7}),
        _case("float_mask", (2, 6, 7, 32), (2, 3, 67, 32), 48, st, {"scale": 0.3}, mask=((2, 1, 7, 67), "float", "small")),
        _case("head_dim_128", (1, 4, 19, 128), (1, 2, 97, 128), 128, st, {"causal": True, "causal_offset": 78}),
        _case("head_dim_256", (1, 2, 3, 256), (1, 1, 67, 256), 256, st, mask=((1, 1, 3, 67), "bool", "keep")),
        _case("composite_head_dim_300", (1, 2, 3, 300), (1, 1, 29, 300), 7, st, {"causal": True, "causal_offset": 26}),
        # enough rows for one split: float16 runs these on tensor cores (sdpa_mma) when forced
        _case("mma_float_mask", (1, 4, 300, 32), (1, 2, 67, 32), 48, st, {"scale": 0.3},
              mask=((1, 4, 300, 67), "float", "small")),
        _case("mma_masked_rows", (1, 2, 1031, 16), (1, 2, 11, 16), 16, st, {"causal": True, "causal_offset": -7}),
        # 33 key tiles: two chunks of sdpa_tile's visibility prescan; the keep-mask also hides
        # whole tiles of the first chunk (see _hide_tiles), the causal bound cuts the last one
        _case("chunked_mask", (1, 6, 23, 64), (1, 3, 2111, 64), 64, st, {"causal": True, "causal_offset": 2090},
              mask=((1, 1, 23, 2111), "bool", "keep")),
        _case("chunked_mask_dv", (1, 2, 37, 32), (1, 1, 2111, 32), 13, st, mask=((1, 1, 37, 2111), "bool", "keep")),
    ]
MMA_IDS = {"prefill_causal_mask/float16", "mma_float_mask/float16", "mma_masked_rows/float16"}


def _hide_tiles(m):
    """Keys 64..1899 hidden from every row (whole key tiles skipped in the first prescan chunk),
    and a band of keys kept again for odd rows only (a tile some rows of a block see)."""
    m[..., 64:1900] = False
    m[..., 1::2, 700:760] = True


def test_mma_cases_reach_the_tensor_core_kernel():
    for c in CASES:
        q, k, v = c.leaves[0].shape, c.leaves[1].shape, c.leaves[2].shape
        lp = sdpa_launch(q[0], q[1], k[1], q[2], k[2], q[3], v[3], fp16=c.storage == "float16", tensor_cores=True,
                         **H100)
        assert (lp is not None and lp.kernel == "mma") == (c.id in MMA_IDS), c.id


# tensor_cores: None = the automatic choice; True forces sdpa_mma on the MMA_IDS cases (too few
# rows for the automatic choice to take it on one GPU), False runs them on sdpa_tile.
PARAMS = [(c, g, tc) for c in CASES for g in (False, True) for tc in ((True, False) if c.id in MMA_IDS else (None,))]


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
@pytest.mark.parametrize("case,graph,tensor_cores", PARAMS,
                         ids=[f"{c.id}-{'graph' if g else 'eager'}{ {None: '', True: '-tc', False: '-no_tc'}[tc]}"
                              for c, g, tc in PARAMS])
def test_sdpa_against_float64(env, case, graph, tensor_cores):
    data = make_data(case, 0)
    prog, names = build_program(case, data)
    prog = gpudelegate.loads(prog.to_bytes())
    rtol, atol = tolerance(case)
    kernels = env.context("cuda").kernels
    kernels.sdpa_tensor_cores = tensor_cores  # read when the session binds its dispatches
    try:
        sess = env.session(prog, device="cuda", capture_graph=graph)
    finally:
        kernels.sdpa_tensor_cores = None
    with sess:
        for run in range(3):  # with graphs: run 0 eager + capture, runs 1-2 replay on fresh inputs
            d = data if run == 0 else make_data(case, run)
            if case.id.startswith("chunked"):
                _hide_tiles(d["m"])
            (got,) = sess.run("forward", {n: d[n] for n in names})
            (want,) = golden(case, d)
            nan = np.isnan(want)
            if "masked_rows" in case.id:  # the case does reach fully masked rows: zeros, not NaN
                assert not nan.any() and (want == 0).all(axis=-1).any()
                assert ((np.asarray(got) == 0).all(axis=-1) == (want == 0).all(axis=-1)).all()
            np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{case.id} (run {run}): NaN rows")
            np.testing.assert_allclose(np.asarray(got, np.float64)[~nan], want[~nan], rtol=rtol, atol=atol,
                                       err_msg=f"{case.id} (run {run})")
