"""The decode attention that reads its cache rows before griddepcontrol.wait (``sdpa_early_keys``
in shaders/cuda_attention.cu, ``CudaKernels.sdpa_early_keys``) and the executor's fact that allows
it (``cuda_fused_ops.fresh_rows``: the caches are what the run began with but for the rows the
kv_update writes at a position no kernel of the run writes).

The fact and the shape rule are pure Python and are checked everywhere, the fact on the plans of
a packed decoder (the decode's attentions have it; a dispatch writing the cache or the position
before the attention, or a cache updated out of place, takes it away). On the GPU (``-m gpu``)
the kernel runs after the kv_update kernels that write the step's row, eager and replayed from a
captured graph (there with programmatic dependent launch: the attention's blocks load the other
rows while the kv_updates run), at position 0 (one visible key: the other 7 warps see none), a
prime position, the last row, the last but one, with a keep-mask, a causal bound or an additive
float mask, float32 and float16 caches, a cache of 131 rows (a partly filled last warp), against
float64 numpy. The row at the position holds large stale values before each run, so an attention
that used the early load of that row would be far off.

Tolerances: float32 storage computes in float32 with float32 inputs, so it differs from float64 by
rounding of 64-term sums and of the softmax (relative 1e-5 of the output norm); float16 storage
rounds the output to float16 (2^-11 relative), against a reference on the same float16 inputs.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import gpudelegate
from gpudelegate.native.cuda_fused_ops import fresh_rows
from gpudelegate.native.cuda_kernels import SDPA_EARLY_KEYS, early_keys_fit
from gpudelegate.plan import plan_session
from gpudelegate.plan.types import DeviceLimits, TensorRef

from cuda_env import REASON, cp
from packed_program import pack_program

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_cuda as bc  # noqa: E402

LIMITS = DeviceLimits(max_buffer_size=1 << 34, max_binding_size=1 << 34, offset_alignment=256, name="test")
CFG = bc.LlamaConfig(vocab=263, dim=96, layers=2, heads=6, kv_heads=2, hidden=160, max_ctx=131)


# ---------------------------------------------------------------------------- the rule and the fact (no GPU)

def test_the_kernel_takes_decode_rows_of_short_caches_only():
    assert early_keys_fit(1, 256, 64, 64, 4) and early_keys_fit(1, 256, 64, 64, 2)  # SmolLM2, both caches
    assert early_keys_fit(1, 1, 32, 32, 2)
    assert not early_keys_fit(2, 256, 64, 64, 4)  # a chunk of rows: each block would read every key
    assert not early_keys_fit(1, SDPA_EARLY_KEYS + 1, 64, 64, 4)  # a thread a key
    assert not early_keys_fit(1, 256, 128, 128, 2)  # registers: the block would fill an SM
    assert not early_keys_fit(1, 256, 64, 48, 4)  # Dv: the transpose-reduce takes multiples of 32
    assert not early_keys_fit(1, 256, 36, 64, 2)  # a float16 row of 36: not whole 16-byte words


def _plan():
    ws = bc.random_weights(CFG, 3, np.float32)
    prog = bc.llama_program(CFG, ws, {"prefill": 7, "decode": 1}, act_dtype="float32")
    names = {f"l{i}.{n}": "q4_1" for i in range(CFG.layers) for n in ("q", "k", "v", "o", "gate", "up", "down")}
    names["embed"] = "q8_0"
    pack_program(prog, names)
    return plan_session(gpudelegate.loads(prog.to_bytes()), LIMITS)


def _view(ref: TensorRef):
    """What fresh_rows reads of a device view (its address and bytes), from the plan's buffer:
    memory objects of one payload are disjoint, so object index and offset stand for the address."""
    b = ref.buf
    return SimpleNamespace(data=SimpleNamespace(ptr=({"arena": 1, "resident": 2, "slot": 3}[b.space] << 56)
                                                + (b.index << 40) + b.offset), nbytes=b.nbytes)


def _sdpas(pp):
    return [k for k, d in enumerate(pp.dispatches) if d.op == "sdpa"]


def test_the_decode_attentions_read_caches_the_run_began_with():
    plan = _plan()
    for p, pp in plan.payloads.items():
        at = _sdpas(pp)
        assert len(at) == CFG.layers
        pos = {d.args[2].value for d in pp.dispatches if d.op == "kv_update"}
        assert len(pos) == 1 and pos <= {r.value for r in pp.inputs}
        for k in at:
            got = fresh_rows(pp.dispatches, k, _view)
            assert got is not None, (p, k)
            assert got.n == pp.dispatches[k].args[0].shape[2]  # the chunk's rows (1 in decode)
            assert got.pos.data.ptr == _view(next(r for r in pp.inputs if r.value in pos)).data.ptr


def _with(disp, k, d):
    out = list(disp)
    out[k] = d
    return out


def test_a_write_before_the_attention_or_an_update_out_of_place_takes_the_fact_away():
    pp = _plan().payloads[1]
    disp = pp.dispatches
    at = _sdpas(pp)[1]
    upd = [k for k in range(at) if disp[k].op == "kv_update"][-2:]
    cache = disp[upd[0]].args[0]
    pos = disp[upd[0]].args[2]
    first = _sdpas(pp)[0]
    # a dispatch before the attention (the first layer's o product) writing into the cache or the position
    for ref in (cache, pos):
        lin = next(k for k in range(first, at) if disp[k].op == "linear")
        clash = dataclasses.replace(disp[lin].outputs[0], buf=dataclasses.replace(disp[lin].outputs[0].buf,
                                                                                 offset=ref.buf.offset, nbytes=4))
        assert fresh_rows(_with(disp, lin, dataclasses.replace(disp[lin], outputs=[clash])), at, _view) is None
    # the same write after the attention does not matter
    later = next(k for k in range(at + 1, len(disp)) if disp[k].op == "linear")
    clash = dataclasses.replace(disp[later].outputs[0], buf=dataclasses.replace(disp[later].outputs[0].buf,
                                                                               offset=cache.buf.offset, nbytes=4))
    assert fresh_rows(_with(disp, later, dataclasses.replace(disp[later], outputs=[clash])), at, _view) is not None
    # the kv_update's output somewhere else than its cache: the run copies the whole cache
    u = disp[upd[0]]
    moved = dataclasses.replace(u.outputs[0], buf=dataclasses.replace(u.outputs[0].buf, offset=1 << 30))
    assert fresh_rows(_with(disp, upd[0], dataclasses.replace(u, outputs=[moved])), at, _view) is None


# ---------------------------------------------------------------------------- the kernel on the GPU

def _reference(q, k, v, keep, bias, scale):
    """float64 attention of one query row per head; rows that see no key give zeros."""
    B, H, _, D = q.shape
    G = H // k.shape[1]
    kk, vv = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q, kk) * scale + bias
    s = np.where(keep, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = p.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", p, vv) / np.where(l == 0, 1, l)


# (B, H, Hk, Tk, D, Dv, position, mask kind)
SHAPES = [(1, 9, 3, 256, 64, 64, pos, m) for pos in (0, 131, 254, 255) for m in ("keep", "causal", "float")]
SHAPES += [(2, 6, 2, 131, 32, 32, 67, "keep"), (1, 4, 4, 131, 64, 32, 130, "causal")]
PARAMS = [(s, st) for s in SHAPES for st in ("float32", "float16")]


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
@pytest.mark.parametrize("shape,storage", PARAMS, ids=[f"{'x'.join(map(str, s[:6]))}-pos{s[6]}-{s[7]}-{st}"
                                                      for s, st in PARAMS])
def test_early_keys_against_float64(env, shape, storage):
    B, H, Hk, Tk, D, Dv, pos, mk = shape
    dt = np.float32 if storage == "float32" else np.float16
    kernels = env.context("cuda").kernels
    rng = np.random.default_rng(pos + 7 * Tk + D)
    q = rng.standard_normal((B, H, 1, D)).astype(dt)
    kc = rng.standard_normal((B, Hk, Tk, D)).astype(dt)
    vc = rng.standard_normal((B, Hk, Tk, Dv)).astype(dt)
    kn = rng.standard_normal((B, Hk, 1, D)).astype(dt)  # the step's row, written by kv_update
    vn = rng.standard_normal((B, Hk, 1, Dv)).astype(dt)
    keep = np.arange(Tk)[None, None, None, :] <= pos
    bias = np.zeros((1, 1, 1, Tk))
    attrs, mask = {}, None
    if mk == "keep":
        mask = cp.asarray(keep.reshape(1, Tk).astype(np.uint32))  # SmolLM2's [1, Tk] bool mask
    elif mk == "causal":
        attrs = {"causal": True, "causal_offset": pos}
    else:  # additive: -inf past the position, small values before it
        bias = np.where(keep, rng.uniform(-2, 2, (1, 1, 1, Tk)), -np.inf)
        mask = cp.asarray(bias.astype(np.float32))
        attrs = {"scale": 0.2}
    scale = attrs.get("scale", 1 / np.sqrt(D))
    kf, vf = kc.astype(np.float64), vc.astype(np.float64)
    kf[:, :, pos], vf[:, :, pos] = kn[:, :, 0], vn[:, :, 0]
    want = _reference(q.astype(np.float64), kf, vf, keep, np.where(keep, bias, 0), scale)

    dq, dk, dv = cp.asarray(q), cp.asarray(kc), cp.asarray(vc)
    dkn, dvn, dpos = cp.asarray(kn), cp.asarray(vn), cp.asarray(np.array([pos], np.int32))
    out = cp.empty((B, H, 1, Dv), dt)
    stale = np.full((B, Hk, D), 50, dt)  # what the early load of the position's row sees
    from gpudelegate.native.cuda_kernels import FreshRows
    att = kernels.sdpa_early_keys([dq, dk, dv, mask], out, attrs, "test", FreshRows(dpos, 1))
    assert att is not None
    upd_k = kernels.bind("kv_update", [dk, dkn, dpos], [dk], {}, "test")
    upd_v = kernels.bind("kv_update", [dv, dvn, dpos], [dv], {}, "test")

    def step():
        upd_k()
        upd_v()
        att()

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        got = {}
        for mode in ("eager", "graph"):
            for run in range(3):
                dk[:, :, pos] = cp.asarray(stale)
                dv[:, :, pos] = cp.asarray(stale[..., :Dv])
                out.fill(np.nan)
                if mode == "eager":
                    step()
                else:
                    if run == 0:
                        stream.begin_capture()
                        step()
                        graph = stream.end_capture()
                    graph.launch(stream)
                stream.synchronize()
                got.setdefault(mode, []).append(cp.asnumpy(out))
    y = got["eager"][0].astype(np.float64)
    assert np.isfinite(y).all()
    err = np.linalg.norm(y - want) / np.linalg.norm(want)
    assert err < (1e-5 if storage == "float32" else 2e-3), err
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 if storage == "float32" else 4e-3)
    for mode in ("eager", "graph"):
        for r in got[mode]:
            np.testing.assert_array_equal(r, got["eager"][0], err_msg=f"{mode}: differs from the first eager run")


# ---------------------------------------------------------------------------- a packed decoder on the GPU

# test_cuda_decode_fusion's decoder with heads of 32 (its heads of 16 are below the kernel's Dv)
WIDE = bc.LlamaConfig(vocab=263, dim=192, layers=2, heads=6, kv_heads=2, hidden=160, max_ctx=131)
PROMPT = [5, 17, 3, 250, 9, 101, 42]
FEED = [33, 0, 262, 12, 12, 190]


def _wide_program(seed: int = 11, scale: float = 20.0):
    """WIDE with q4_1 linears and a q8_0 embedding; ``scale`` multiplies every weight but the
    norms' (larger weights: greedy tokens that vary)."""
    ws = bc.random_weights(WIDE, seed, np.float32)
    ws = {n: w if n.endswith("norm") else w * np.float32(scale) for n, w in ws.items()}
    prog = bc.llama_program(WIDE, ws, {"prefill": len(PROMPT), "decode": 1}, act_dtype="float32")
    names = {f"l{i}.{n}": "q4_1" for i in range(WIDE.layers) for n in ("q", "k", "v", "o", "gate", "up", "down")}
    names["embed"] = "q8_0"
    pack_program(prog, names)
    return gpudelegate.loads(prog.to_bytes())


def _steps(sess, greedy: int):
    """Prefill PROMPT, a decode step per token of FEED, then ``greedy`` steps feeding each argmax:
    (logits of every step, greedy ids)."""
    out = sess.run("prefill", bc.step_inputs(WIDE, PROMPT, 0) + bc.empty_caches(WIDE, np.float32), keep_on_device=True)
    logits, caches = [out[0].numpy()], out[1:]
    ids, n = [], len(PROMPT)
    for tok in list(FEED) + [None] * greedy:
        if tok is None:
            tok = int(np.argmax(logits[-1].reshape(-1)))
            ids.append(tok)
        out = sess.run("decode", bc.step_inputs(WIDE, [tok], n) + list(caches), keep_on_device=True)
        logits.append(out[0].numpy())
        caches, n = out[1:], n + 1
    return logits, ids


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_a_packed_decoder_with_early_keys_matches_the_reference_and_sdpa_tile(env):
    """A packed decoder (131 cache rows, heads of 32) with the decode attention read early (eager
    and replayed from graphs: the graph bit-identical to eager) and with it off (sdpa_tile +
    sdpa_combine), against the reference executor (relative 1e-4 over the decoder, the bound of
    test_cuda_decode_fusion), and 12 greedy ids equal to the reference's."""
    prog = _wide_program()
    kernels = env.context("cuda").kernels
    runs = {}
    try:
        for on in (True, False):
            kernels.sdpa_early_keys_on = on
            for graph in (False, True):
                with env.session(prog, device="cuda", capture_graph=graph) as s:
                    runs[on, graph] = _steps(s, greedy=12)
                    assert s.executor.stats.get("sdpa_early_keys") == (WIDE.layers if on else None), s.executor.stats
    finally:
        kernels.sdpa_early_keys_on = True
    with env.session(prog, device="reference") as s:
        ref_logits, ref_ids = _steps(s, greedy=12)
    assert len(set(ref_ids)) > 1, ref_ids
    for (on, graph), (logits, ids) in runs.items():
        assert ids == ref_ids, (on, graph, ids, ref_ids)
        for i, (a, r) in enumerate(zip(logits, ref_logits)):
            assert bc.rel_err(a, r) < 1e-4, (on, graph, i, bc.rel_err(a, r))
    for on in (True, False):
        for i, (a, b) in enumerate(zip(runs[on, False][0], runs[on, True][0])):
            np.testing.assert_array_equal(a, b, err_msg=f"early keys {on}, step {i}: graph differs from eager")


def test_the_wide_decoders_attentions_take_the_kernel():
    """(No GPU) the decoder of the GPU test above reaches sdpa_early_keys: the fact holds for its
    decode attentions and the kernel takes their shapes."""
    plan = plan_session(_wide_program(), LIMITS)
    pp = plan.payloads[1]
    for k in _sdpas(pp):
        q, kc, vc = (pp.dispatches[k].args[i].shape for i in range(3))
        assert fresh_rows(pp.dispatches, k, _view) is not None
        assert early_keys_fit(q[2], kc[2], q[3], vc[3], 4), (q, kc, vc)
