"""The CUDA executor on a real GPU (``make test-cuda`` = ``pytest -m gpu``).

Where CUDA is absent every GPU test is skipped with the reason ("no CUDA device: ..."), which
``pytest -rs`` prints; the one test that runs everywhere checks that this absence is a clear
DeviceError. The conformance suite (tests/conformance) covers every op at small prime shapes on
this executor; the cases here use shapes that reach the parts of the fused kernels small shapes
miss (rows longer than a block, keys longer than a warp loop, head dims above the block size,
the composite attention fallback, fp32 accumulation of fp16 products), then graphs, offload,
IO binding, prepack and failure paths.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import gpudelegate
from gpudelegate.errors import BudgetError, DeviceError, InputError
from gpudelegate.executor import DeviceTensor
from gpudelegate.plan import plan_session

from conformance.cases import Case, L, Op, build_program, golden, make_data, tolerance
from cuda_env import REASON, cp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_cuda as bc  # noqa: E402  (llama_program: the benchmark's model builder, small shapes here)


def test_missing_cuda_is_a_device_error():
    if cp is not None:
        pytest.skip("CUDA is present here: the missing-CUDA path cannot be exercised")
    e = gpudelegate.Environment()
    try:
        with pytest.raises(DeviceError, match="no CUDA device"):
            e.context("cuda")
        with pytest.raises(DeviceError, match="no CUDA device"):
            e.session(bc.llama_program(TINY, bc.random_weights(TINY, 0), {"decode": 1}), device="cuda")
    finally:
        e.close()


# ---------------------------------------------------------------------------- kernels at larger shapes

def _case(cid, leaves, op, attrs=None, storage="float32", red=1, args=None):
    names = args if args is not None else [l.name for l in leaves]
    return Case(cid, list(leaves), [Op(op, names, dict(attrs or {}), "y")], ["y"], storage, red)


BIG_CASES = []
for st in ("float32", "float16"):
    BIG_CASES += [
        _case(f"rms_norm/1031/{st}", [L("x", (3, 1031)), L("w", (1031,), kind="const")], "rms_norm", storage=st, red=1031),
        _case(f"layer_norm/1031/{st}", [L("x", (2, 5, 1031)), L("w", (1031,), kind="const"), L("b", (1031,), kind="const")],
              "layer_norm", {"normalized_shape": [1031]}, storage=st, red=1031),
        _case(f"softmax/2053/{st}", [L("x", (7, 2053))], "softmax", storage=st, red=2053),
        _case(f"softmax/dim1/{st}", [L("x", (3, 257, 5))], "softmax", {"dim": 1}, storage=st, red=257),
        _case(f"log_softmax/2053/{st}", [L("x", (5, 2053))], "log_softmax", storage=st, red=2053),
        _case(f"rope/64/{st}", [L("x", (1, 3, 7, 64)), L("cos", (7, 64), gen="angle"), L("sin", (7, 64), gen="angle")],
              "rope", storage=st),
        _case(f"sdpa/gqa_causal_offset/{st}", [L("q", (1, 9, 5, 64)), L("k", (1, 3, 257, 64)), L("v", (1, 3, 257, 64))],
              "sdpa", {"causal": True, "causal_offset": 252}, storage=st, red=257 * 64),
        _case(f"sdpa/bool_mask/{st}", [L("q", (2, 6, 3, 32)), L("k", (2, 2, 131, 32)), L("v", (2, 2, 131, 48)),
                                       L("m", (1, 1, 3, 131), "bool", "keep")], "sdpa", storage=st, red=131 * 32),
        _case(f"sdpa/float_mask/{st}", [L("q", (1, 4, 7, 16)), L("k", (1, 4, 67, 16)), L("v", (1, 4, 67, 16)),
                                        L("m", (4, 7, 67), gen="small")], "sdpa", {"scale": 0.3}, storage=st, red=67 * 16),
        _case(f"sdpa/head_dim_160/{st}", [L("q", (1, 2, 3, 160)), L("k", (1, 1, 67, 160)), L("v", (1, 1, 67, 160))],
              "sdpa", {"causal": True, "causal_offset": 64}, storage=st, red=67 * 160),
        _case(f"kv_update/{st}", [L("c", (1, 3, 257, 64)), L("n", (1, 3, 5, 64)), L("p", (1,), "int32", "value", lo=250)],
              "kv_update", storage=st),
    ]
# a long key range: the split-K attention kernel with ~100 splits (no longer the composite fallback;
# tests/test_cuda_sdpa.py reaches that with head dim 300)
BIG_CASES.append(_case("sdpa/composite_13001/float32", [L("q", (1, 2, 2, 16)), L("k", (1, 1, 13001, 16)),
                                                        L("v", (1, 1, 13001, 16))], "sdpa", {"causal": True,
                                                                                             "causal_offset": 13000},
                       red=13001 * 16))


def _compare(case, outs, want, where=""):
    rtol, atol = tolerance(case)
    for got, w in zip(outs, want):
        got = np.asarray(got)
        if got.dtype.kind in "biu":
            np.testing.assert_array_equal(got, w, err_msg=case.id + where)
        else:
            np.testing.assert_allclose(got.astype(np.float64), w, rtol=rtol, atol=atol, err_msg=case.id + where)


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("case", BIG_CASES, ids=lambda c: c.id)
def test_fused_kernels_at_larger_shapes(env, case, graph):
    data = make_data(case, 0)
    prog, names = build_program(case, data)
    prog = gpudelegate.loads(prog.to_bytes())
    inputs = [l.name for l in case.leaves if l.kind == "input"]
    with env.session(prog, device="cuda", capture_graph=graph) as sess:
        for run in range(3):  # with graphs: run 0 eager + capture, runs 1-2 replay on fresh inputs
            d = data if run == 0 else {**data, **{k: v for k, v in make_data(case, run).items() if k in inputs}}
            outs = sess.run("forward", {n: d[n] for n in names})
            _compare(case, outs, golden(case, d), f" (run {run})")


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_fp16_products_accumulate_in_fp32(env):
    # K = 4099 products of O(1) fp16 values: fp16 accumulation would be off by ~1e-2 relative
    # (sqrt(K) * 2^-11), fp32 accumulation leaves only the output rounding (~2.4e-4).
    case = _case("linear/k4099/float16", [L("x", (3, 4099)), L("w", (7, 4099), kind="const")], "linear",
                 storage="float16", args=["x", "w", None])
    data = make_data(case, 0)
    prog, names = build_program(case, data)
    with env.session(prog, device="cuda") as sess:
        (got,) = sess.run("forward", {n: data[n] for n in names})
    (want,) = golden(case, data)
    err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
    assert err < 1e-3, err


# ---------------------------------------------------------------------------- model-shaped chains

TINY = bc.LlamaConfig(vocab=257, dim=96, layers=2, heads=6, kv_heads=2, hidden=160, max_ctx=37)


def _generate(sess, cfg, prompt, n, dtype, keep=True):
    """Greedy prefill + n decode steps; returns the logits of every step (host arrays)."""
    np_dt = np.float32 if dtype == "float32" else np.float16
    out = sess.run("prefill", bc.step_inputs(cfg, prompt, 0) + bc.empty_caches(cfg, np_dt), keep_on_device=keep)
    logits = [out[0].numpy() if keep else out[0]]
    caches = out[1:]
    for i in range(n):
        tok = int(np.argmax(logits[-1]))
        out = sess.run("decode", bc.step_inputs(cfg, [tok], len(prompt) + i) + list(caches), keep_on_device=keep)
        logits.append(out[0].numpy() if keep else out[0])
        caches = out[1:]
    return logits, caches


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_graph_replay_of_a_decoder_matches_eager_and_reference(env, dtype):
    w = bc.random_weights(TINY, 3, np.float32 if dtype == "float32" else np.float16)
    prog = bc.llama_program(TINY, w, {"prefill": 7, "decode": 1}, act_dtype=dtype)
    prompt = [5, 17, 3, 250, 9, 101, 42]
    with env.session(prog, device="cuda") as eager, env.session(prog, device="cuda", capture_graph=True) as graph, \
            env.session(prog, device="reference") as ref:
        a, _ = _generate(eager, TINY, prompt, 6, dtype)
        b, caches = _generate(graph, TINY, prompt, 6, dtype)
        c, _ = _generate(ref, TINY, prompt, 6, dtype)
        assert sorted(graph.executor.stats["graphs"]) == sorted(graph.plan.payloads)  # both methods captured
        # The KV cache fed back stays where the decode payload wants it: zero copy.
        st = graph.executor._states[graph.program.methods["decode"].nodes[0].attrs["payload"]]
        assert st.runs == 6
        assert all(isinstance(t, DeviceTensor) and isinstance(t.handle, cp.ndarray) for t in caches)
        assert caches[0].handle.data.ptr == st.inputs[4].data.ptr
    for i, (x, y, z) in enumerate(zip(a, b, c)):
        np.testing.assert_array_equal(x, y, err_msg=f"step {i}: replayed graph differs from eager")
        tol = 1e-4 if dtype == "float32" else 2e-2  # fp16: storage rounding per op, 2 layers
        assert bc.rel_err(x, z) < tol, (i, bc.rel_err(x, z))


OFFLOAD_CFG = bc.LlamaConfig(vocab=1031, dim=256, layers=4, heads=8, kv_heads=2, hidden=512, max_ctx=41)


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("depth", [1, 2])
def test_offload_matches_resident_within_budget(env, graph, depth):
    cfg = OFFLOAD_CFG
    w = bc.random_weights(cfg, 4, np.float16)
    prog = bc.llama_program(cfg, w, {"prefill": 5, "decode": 1})
    prompt = [1, 2, 3, 500, 1000]
    with env.session(prog, device="cuda") as full:
        want, _ = _generate(full, cfg, prompt, 4, "float16")
    total = sum(b.nbytes for b in plan_session(prog, env.context("cuda").limits).prepack.buffers)
    floor = plan_session(prog, env.context("cuda").limits, weight_budget=total, prefetch_depth=depth).offload.floor
    assert floor < total // 2
    for budget in (floor, (floor + total) // 2):
        with env.session(prog, device="cuda", weight_budget=budget, prefetch_depth=depth, capture_graph=graph) as s:
            off = s.plan.offload
            assert off.streamed and off.loads
            for rep in range(2):  # a second generation reuses every slot across runs
                got, _ = _generate(s, cfg, prompt, 4, "float16")
                for i, (x, y) in enumerate(zip(got, want)):
                    np.testing.assert_array_equal(x, y, err_msg=f"budget {budget} pass {rep} step {i}")
            mem = s.executor.memory_report()
            assert mem["weight_pool_bytes"] <= mem["weight_pool_limit"]
            # real-model weights are 16-byte multiples: no padding, so the pool holds at most the budget
            assert mem["weight_pool_bytes"] <= -(-budget // 512) * 512, mem
    with pytest.raises(BudgetError, match="floor"):
        env.session(prog, device="cuda", weight_budget=floor - 1, prefetch_depth=depth)


# ---------------------------------------------------------------------------- IO binding

@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_device_inputs_and_outputs(env):
    case = _case("io", [L("a", (5, 7)), L("b", (7,))], "lt")
    data = make_data(case, 0)
    prog, names = build_program(case, data)
    with env.session(prog, device="cuda") as sess:
        a = cp.asarray(data["a"])
        b = cp.asarray(data["b"].astype(np.float64))  # float64 on the device: narrowed to float32
        (y,) = sess.run("forward", [a, b], keep_on_device=True)
        assert isinstance(y, DeviceTensor) and isinstance(y.handle, cp.ndarray) and y.device == "cuda"
        host = y.numpy()
        assert host.dtype == np.bool_
        np.testing.assert_array_equal(host, data["a"] < data["b"])
        (h,) = sess.run("forward", [a, b])
        np.testing.assert_array_equal(h, host)
        with pytest.raises(InputError):
            sess.run("forward", [a.astype(np.complex64), b])
        # torch CUDA tensors through DLPack, at the executor (the session's dtype check reads
        # numpy dtype names)
        torch = pytest.importorskip("torch")
        ta = torch.from_numpy(data["a"]).cuda()
        tb = torch.from_numpy(data["b"]).cuda()
        (z,) = sess.executor.run(0, [ta, tb])
        np.testing.assert_array_equal(z, host)
    case = _case("ids", [L("w", (11, 5), kind="const"), L("i", (3,), "int32", "ids", lo=0, hi=11)], "embedding")
    data = make_data(case, 0)
    prog, names = build_program(case, data)
    with env.session(prog, device="cuda") as sess:
        ids64 = cp.asarray(data["i"].astype(np.int64))
        (y,) = sess.run("forward", [ids64])
        np.testing.assert_array_equal(y, data["w"][data["i"]])
        with pytest.raises(InputError, match="int32 range|out of range"):  # the session checks ids first
            sess.run("forward", [ids64 + 2**40])


# ---------------------------------------------------------------------------- prepack

@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_prepack_in_small_chunks_with_progress_and_fp16_packing(env):
    case = Case("prepack", [L("x", (3, 113)), L("w1", (37, 113), kind="prepack_fp16"), L("w2", (29, 37), kind="prepack"),
                            L("b2", (29,), kind="prepack_fp16")],
                [Op("linear", ["x", "w1", None], {}, "h"), Op("linear", ["h", "w2", "b2"], {}, "y")], ["y"], red=113)
    data = make_data(case, 0)
    prog, names = build_program(case, data)
    ctx = env.context("cuda")
    plan = plan_session(prog, ctx.limits, chunk_bytes=4096)  # w1 (16.7 KB) goes up in 5 staged pieces
    seen = []
    ex = ctx.create_executor(prog)
    try:
        ex.allocate(plan)
        ex.record(plan)
        ex.prepack(plan, lambda done, total: seen.append((done, total)))
        total = sum(b.src_nbytes for b in plan.prepack.buffers)
        assert seen and seen[-1] == (total, total) and all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
        (y,) = ex.run(0, [data["x"]])
    finally:
        ex.close()
    _compare(case, [y], golden(case, data))


# ---------------------------------------------------------------------------- failures leak nothing

@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_out_of_memory_is_a_device_error_and_leaks_nothing(env):
    ctx = env.context("cuda")
    n = int(ctx.total_memory * 0.6) // 4  # two of these live at once: 1.2x the device
    from gpudelegate.program import Method, Node, Payload, Program, Value
    vals = [Value("float32", (1,), name="x"), Value("float32", (n,)), Value("float32", (n,)), Value("float32", (n,)),
            Value("float32", (1,))]
    nodes = [Node("expand", [0], [1], {"shape": [n]}), Node("exp", [1], [2]), Node("add", [1, 2], [3]),
             Node("sum", [3], [4], {"dims": [0], "keepdim": True})]
    prog = Program([], [Payload(vals, [0], [4], nodes)], {})
    prog.methods["forward"] = Method([Value("float32", (1,), name="x"), Value("float32", (1,))], [0], [1],
                                     [Node("delegate", [0], [1], {"payload": 0})], name="forward")
    cp.get_default_memory_pool().free_all_blocks()
    free0 = cp.cuda.runtime.memGetInfo()[0]
    with pytest.raises(DeviceError, match="out of CUDA memory allocating the activation arena"):
        env.session(prog, device="cuda")
    plan = plan_session(prog, ctx.limits)
    ex = ctx.create_executor(prog)
    with pytest.raises(DeviceError, match="out of CUDA memory"):
        ex.allocate(plan)
    assert ex.closed
    for pool in (ex.pool_act, ex.pool_weights):
        assert pool.used_bytes() == 0 and pool.total_bytes() == 0
    free1 = cp.cuda.runtime.memGetInfo()[0]
    assert free0 - free1 < (64 << 20), (free0, free1)


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_budget_below_floor_is_refused_before_any_allocation(env):
    w = bc.random_weights(TINY, 0)
    prog = bc.llama_program(TINY, w, {"decode": 1})
    free0 = cp.cuda.runtime.memGetInfo()[0]
    with pytest.raises(BudgetError, match="below the offload floor"):
        env.session(prog, device="cuda", weight_budget=1000)
    assert abs(cp.cuda.runtime.memGetInfo()[0] - free0) < (16 << 20)


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason=REASON or "CUDA present")
def test_device_outputs_are_ordered_for_the_callers_stream(env):
    # Milliseconds of GPU work behind the output: read on the caller's (default) stream right
    # after run(), without any sync, it must already hold this run's values.
    ops, prev = [], "a"
    for i in range(8):
        ops += [Op("matmul", [prev, "b"], {}, f"m{i}"), Op("tanh", [f"m{i}"], {}, f"h{i}")]
        prev = f"h{i}"
    case = Case("order", [L("a", (1031, 1031)), L("b", (1031, 1031), gen="small", kind="const")], ops, [prev], red=1031)
    data = make_data(case, 0)
    prog, names = build_program(case, data)
    with env.session(prog, device="cuda", profile=True) as sess:
        for run in range(3):
            a = make_data(case, run)["a"]
            (y,) = sess.run("forward", [a], keep_on_device=True)
            early = cp.asnumpy(y.handle)  # the default stream, ordered by the executor's event
            np.testing.assert_array_equal(early, y.numpy(), err_msg=f"run {run}: output read before it was written")
        prof = sess.executor.profile_ms
        assert prof["matmul"][1] == 3 * 8 and prof["matmul"][0] > 0 and prof["tanh"][1] == 3 * 8
