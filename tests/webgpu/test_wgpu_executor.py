"""The wgpu executor beyond the per-op conformance suite: tensors over a (test-lowered) binding
limit, over maxBufferSize, prepack chunks and progress, the offload ring, device tensors chained
between runs and sessions, profiling, kernel variants the small conformance shapes do not reach
(128x128 tiles, gemv, float16 through scratch), and the no-adapter error.

Runs on any wgpu adapter (software Vulkan in CI); skipped, with the reason printed by -rs, where
none starts. Shapes are small and prime-sized: the software adapter does 1-2 GFLOP/s.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpudelegate
from gpudelegate.webgpu import lowering, ops_attention
from gpudelegate.environment import Environment, register_device
from gpudelegate.errors import DeviceError, PayloadError
from gpudelegate.executor import DeviceTensor
from gpudelegate.plan import plan_session

from conformance.cases import Case, Leaf, Op, build_program, golden, make_data

pytestmark = pytest.mark.wgpu


@pytest.fixture(scope="module")
def env(wgpu_adapter):
    register_device("wgpu-small-limits", _small_context)
    e = Environment()
    yield e
    e.close()


# A context whose reported limits are tiny, so small tensors exercise the binding splits.
SMALL_BINDING = 1024
SMALL_BUFFER = 1 << 16


def _small_context(env_):
    from gpudelegate.native.wgpu_device import WgpuContext

    return WgpuContext(env_, limits_override={"max_binding_size": SMALL_BINDING, "max_buffer_size": SMALL_BUFFER})



def _program(case: Case, run: int = 0):
    data = make_data(case, run)
    prog, names = build_program(case, data)
    return gpudelegate.loads(prog.to_bytes()), names, data


def _check(case: Case, outs, want, rtol=1e-4, atol=1e-5, what=""):
    for i, (g, w) in enumerate(zip(outs, want)):
        g = np.asarray(g)
        if g.dtype.kind in "biu" or g.dtype == np.bool_:
            np.testing.assert_array_equal(g, w, err_msg=f"{case.id} output {i} {what}")
        else:
            np.testing.assert_allclose(g.astype(np.float64), w, rtol=rtol, atol=atol, err_msg=f"{case.id} output {i} {what}")


def _run_case(env, case: Case, device: str, rtol=1e-4, atol=1e-5, **opts):
    prog, names, data = _program(case)
    with env.session(prog, device=device, **opts) as s:
        outs = s.run("forward", [data[n] for n in names])
        _check(case, outs, golden(case, data), rtol, atol)
        return s, outs


# ---------------------------------------------------------------------------- binding splits

# Every tensor of these cases is several times the 1 KiB binding limit of "wgpu-small-limits".
SPLIT_CASES = [
    Case("split/add_broadcast", [Leaf("a", "float", (37, 41)), Leaf("b", "float", (41,))],
         [Op("add", ["a", "b"], out="y")], ["y"]),
    Case("split/add_broadcast_f16", [Leaf("a", "float", (37, 41)), Leaf("b", "float", (37, 1))],
         [Op("mul", ["a", "b"], out="y")], ["y"], storage="float16"),
    Case("split/permute_slice_cat", [Leaf("a", "float", (13, 17, 11))],
         [Op("permute", ["a"], {"dims": [2, 0, 1]}, out="p"),
          Op("slice", ["p"], {"dim": 2, "start": 1, "end": 16, "step": 2}, out="s"),
          Op("cat", ["s", "s"], {"dim": 1}, out="y")], ["y"]),
    Case("split/linear_weight", [Leaf("x", "float", (5, 13)), Leaf("w", "float", (97, 13), kind="prepack"),
                                 Leaf("b", "float", (97,), kind="const")],
         [Op("linear", ["x", "w", "b"], out="y")], ["y"], red=13),
    Case("split/linear_gemv", [Leaf("x", "float", (1, 29)), Leaf("w", "float", (61, 29), kind="prepack")],
         [Op("linear", ["x", "w"], out="y")], ["y"], red=29),
    Case("split/matmul_batch", [Leaf("a", "float", (3, 19, 11)), Leaf("b", "float", (11, 23))],
         [Op("matmul", ["a", "b"], out="y")], ["y"], red=11),
    Case("split/embedding", [Leaf("w", "float", (101, 7), kind="prepack"), Leaf("i", "int32", (5, 3), gen="ids", lo=0, hi=101)],
         [Op("embedding", ["w", "i"], out="y")], ["y"]),
    Case("split/embedding_f16_table", [Leaf("w", "float", (101, 7), kind="prepack_fp16"),
                                       Leaf("i", "int32", (13,), gen="ids", lo=0, hi=101)],
         [Op("embedding", ["w", "i"], out="y")], ["y"]),
    Case("split/softmax_rows", [Leaf("a", "float", (29, 31))], [Op("softmax", ["a"], {"dim": -1}, out="y")], ["y"], red=31),
    Case("split/layer_norm_rows", [Leaf("a", "float", (29, 31))],
         [Op("layer_norm", ["a"], {"normalized_shape": [31]}, out="y")], ["y"], red=31),
    Case("split/sum_rows", [Leaf("a", "float", (29, 31))], [Op("sum", ["a"], {"dims": [1]}, out="y")], ["y"], red=31),
    Case("split/sdpa_heads_and_rows", [Leaf("q", "float", (1, 2, 23, 8)), Leaf("k", "float", (1, 2, 17, 8)),
                                       Leaf("v", "float", (1, 2, 17, 8))],
         [Op("sdpa", ["q", "k", "v"], {"causal": True, "causal_offset": 3}, out="y")], ["y"], red=17),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c.id)
def test_tensors_over_the_binding_limit_are_split(env, case):
    prog, names, data = _program(case)
    limits = env.context("wgpu-small-limits").limits
    assert limits.max_binding_size == SMALL_BINDING
    plan = plan_session(prog, limits)
    big = [r for pp in plan.payloads.values() for d in pp.dispatches for r in d.args + d.outputs
           if r is not None and r.buf.nbytes > SMALL_BINDING]
    assert big, f"{case.id}: no tensor is over the limit, the test would prove nothing"
    # Every binding the kernel selection makes fits, and the tensors over it took several calls.
    for pp in plan.payloads.values():
        for d in pp.dispatches:
            calls = lowering.select(d, limits)
            for c in calls:
                for b in c.bindings:
                    assert b.buf.nbytes <= SMALL_BINDING and b.buf.offset % limits.offset_alignment == 0, (d.op, b)
    tol = (1e-2, 2e-3) if case.storage == "float16" else (1e-4, 1e-5 * case.red ** 0.5)
    _run_case(env, case, "wgpu-small-limits", *tol)


def test_a_tensor_that_cannot_be_split_names_itself_and_the_limit(env):
    case = Case("split/conv_too_big", [Leaf("x", "float", (1, 3, 17, 19)), Leaf("w", "float", (5, 3, 3, 3), kind="const")],
                [Op("conv2d", ["x", "w"], {"padding": [1, 1]}, out="y")], ["y"])
    prog, names, data = _program(case)
    with pytest.raises(DeviceError, match=r"maxStorageBufferBindingSize 1024"):
        env.session(prog, device="wgpu-small-limits")


def test_over_max_buffer_size_is_a_device_error_naming_the_tensor(env):
    # 160 x 128 float32 = 80 KiB > the 64 KiB maxBufferSize of the small-limits context.
    case = Case("big/weight", [Leaf("x", "float", (2, 128)), Leaf("w", "float", (160, 128), kind="prepack")],
                [Op("linear", ["x", "w"], out="y")], ["y"])
    prog, names, data = _program(case)
    with pytest.raises(DeviceError, match=r"(?i)max.?buffer.?size") as ei:
        env.session(prog, device="wgpu-small-limits")
    msg = str(ei.value)
    assert "w" in msg and str(SMALL_BUFFER) in msg, msg


def test_lowered_limits_cannot_exceed_the_device(env):
    from gpudelegate.native.wgpu_device import WgpuContext

    real = env.context("wgpu").limits
    with pytest.raises(DeviceError, match="above the device"):
        WgpuContext(None, limits_override={"max_binding_size": real.max_binding_size * 2})


# ---------------------------------------------------------------------------- prepack

def _mlp_case(width=23, depth=4, layout="prepack", storage="float32") -> Case:
    leaves = [Leaf("x", "float", (3, width), gen="small")]
    ops_ = []
    h = "x"
    for i in range(depth):
        leaves.append(Leaf(f"w{i}", "float", (width, width), gen="small", kind=layout))
        leaves.append(Leaf(f"b{i}", "float", (width,), gen="small", kind="prepack"))
        ops_.append(Op("linear", [h, f"w{i}", f"b{i}"], out=f"l{i}"))
        ops_.append(Op("tanh", [f"l{i}"], out=f"h{i}"))
        h = f"h{i}"
    return Case(f"mlp/{layout}/{storage}", leaves, ops_, [h], storage=storage, red=width)


@pytest.mark.parametrize("layout", ["prepack", "prepack_fp16"])
def test_prepack_chunks_report_progress(env, layout):
    case = _mlp_case(layout=layout)
    prog, names, data = _program(case)
    ctx = env.context("wgpu")
    plan = plan_session(prog, ctx.limits, chunk_bytes=1500)
    assert len(plan.prepack.chunks) >= 3
    ex = ctx.create_executor(prog)
    calls = []
    try:
        ex.allocate(plan)
        ex.record(plan)
        ex.prepack(plan, lambda done, total: calls.append((done, total)))
        total = sum(b.nbytes for b in plan.prepack.buffers)
        assert len(calls) == len(plan.prepack.chunks)
        assert [t for _, t in calls] == [total] * len(calls)
        dones = [d for d, _ in calls]
        assert dones == sorted(dones) and dones[-1] == total and dones[0] > 0
        assert ex.upload_bytes == total and ex.upload_seconds > 0
        (y,) = ex.run(0, [data["x"]])
        tol = (2e-3, 2e-3) if layout == "prepack_fp16" else (1e-4, 1e-4)
        _check(case, [y], golden(case, data), *tol)
    finally:
        ex.close()


def test_prepack_refuses_a_plan_that_disagrees_with_the_program(env):
    case = _mlp_case(depth=1)
    prog, names, data = _program(case)
    ctx = env.context("wgpu")
    plan = plan_session(prog, ctx.limits)
    rb = plan.prepack.buffers[0]
    plan.prepack.buffers[0] = type(rb)(rb.constant, rb.layout, rb.dtype, tuple(rb.shape) + (1,), rb.nbytes, rb.src_nbytes + 4)
    ex = ctx.create_executor(prog)
    try:
        ex.allocate(plan)
        ex.record(plan)
        with pytest.raises(PayloadError, match=r"prepack\.buffers\[0\]"):
            ex.prepack(plan)
    finally:
        ex.close()


# ---------------------------------------------------------------------------- offload

@pytest.mark.parametrize("layout", ["prepack", "prepack_fp16"])
def test_offloaded_run_equals_resident_run(env, layout):
    case = _mlp_case(width=29, depth=5, layout=layout)
    prog, names, data = _program(case)
    with env.session(prog, device="wgpu") as s:
        want = s.run("forward", [data["x"]])[0]
    floor = plan_session(prog, env.context("wgpu").limits, weight_budget=1 << 40, prefetch_depth=1).offload.floor
    with env.session(prog, device="wgpu", weight_budget=floor, prefetch_depth=1) as s:
        off = s.plan.offload
        assert off.streamed and off.peak_bytes <= floor
        ex = s.executor
        per_run = []
        for run in range(3):
            got = s.run("forward", [data["x"]])[0]
            np.testing.assert_array_equal(got, want)  # same kernels on the same bytes: identical
            per_run.append(ex.bytes_streamed - sum(per_run))
        # Counted per submitted run, not per chain encoded ahead.
        assert per_run == [sum(ex.mirrors[i].size for i in off.streamed)] * 3
        # Streamed weights never got a device buffer of their own.
        assert not set(off.streamed) & set(ex.resident)


# ---------------------------------------------------------------------------- device tensors

def _affine_case() -> Case:
    return Case("chain/affine", [Leaf("x", "float", (7, 11)), Leaf("w", "float", (11, 11), kind="prepack", gen="small")],
                [Op("linear", ["x", "w"], out="y")], ["y"], red=11)


def test_device_tensors_chain_between_runs_and_sessions(env):
    case = _affine_case()
    prog, names, data = _program(case)
    w = data["w"].astype(np.float64)
    x = data["x"].astype(np.float64)
    with env.session(prog, device="wgpu") as s1, env.session(prog, device="wgpu") as s2:
        (t1,) = s1.run("forward", [data["x"]], keep_on_device=True)
        assert isinstance(t1, DeviceTensor) and t1.device == "wgpu" and t1.shape == (7, 11)
        np.testing.assert_allclose(t1.numpy(), x @ w.T, rtol=1e-4, atol=1e-5)
        # Into another session (a device copy, never the host) ...
        (t2,) = s2.run("forward", [t1], keep_on_device=True)
        np.testing.assert_allclose(t2.numpy(), x @ w.T @ w.T, rtol=1e-4, atol=1e-5)
        # ... and back into the first one's next run.
        (y3,) = s1.run("forward", [t2])
        np.testing.assert_allclose(y3, x @ w.T @ w.T @ w.T, rtol=1e-4, atol=1e-4)
        # Environment transfers: device -> host and host -> device tensor.
        host = np.zeros((7, 11), np.float32)
        env.copy_tensors([t2], [host])
        np.testing.assert_allclose(host, x @ w.T @ w.T, rtol=1e-4, atol=1e-5)
        env.copy_tensors([np.ones((7, 11), np.float32)], [t2])
        np.testing.assert_array_equal(t2.numpy(), np.ones((7, 11), np.float32))


def test_chain_encoded_ahead_runs_with_each_runs_inputs(env):
    # run() submits the chain encoded after the previous submit; every run still sees its own
    # inputs (host arrays and device tensors alike), and profiling encodes per run instead.
    case = _affine_case()
    prog, names, data = _program(case)
    w = data["w"].astype(np.float64)
    rng = np.random.default_rng(7)
    with env.session(prog, device="wgpu") as s:
        ex = s.executor
        for run in range(3):
            x = rng.standard_normal((7, 11)).astype(np.float32) + 0.5
            assert (ex.recorded[0].chain.ahead is not None) == (run > 0)
            np.testing.assert_allclose(s.run("forward", [x])[0], x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-5)
        (t,) = s.run("forward", [x], keep_on_device=True)
        (y,) = s.run("forward", [t])
        np.testing.assert_allclose(y, x.astype(np.float64) @ w.T @ w.T, rtol=1e-4, atol=1e-4)
    assert not ex.recorded  # the chains (and their encoded-ahead command buffers) go with the session
    if "timestamp-query" in env.context("wgpu").features:
        with env.session(prog, device="wgpu", profile=True) as s:
            s.run("forward", [x])
            assert s.executor.recorded[0].chain.ahead is None


def test_run_inputs_are_staged_after_a_read_back_and_written_otherwise(env, monkeypatch):
    # wgpu-native: after a read-back (the queue idle) a run's small inputs go through the
    # persistent run-input staging; pipelined runs, inputs over its size and a failing staging
    # take write_buffer. Every run sees its own inputs either way.
    case = _affine_case()
    prog, names, data = _program(case)
    w = data["w"].astype(np.float64)
    rng = np.random.default_rng(11)
    ctx = env.context("wgpu")
    monkeypatch.setattr(ctx, "run_inputs", ctx.run_inputs)  # the module's context gets it back
    writes = []
    real_write = type(ctx).write_buffer
    monkeypatch.setattr(type(ctx), "write_buffer", lambda self, *a: (writes.append(a[2]), real_write(self, *a))[1])
    with env.session(prog, device="wgpu") as s:
        s.run("forward", [data["x"]])  # a read-back: the queue is idle after it
        writes.clear()  # (the session's build wrote its parameters)
        for _ in range(4):  # a greedy-decode pattern: run, read back
            x = rng.standard_normal((7, 11)).astype(np.float32)
            np.testing.assert_allclose(s.run("forward", [x])[0], x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-5)
        assert ctx.run_inputs is not None and len(ctx.run_inputs.bufs) == ctx.run_inputs.COUNT
        assert writes == []  # all staged
        # several inputs of odd sizes in one run (each placed at a multiple of 8 in the staging)
        kv = Case("kv/staged", [Leaf("kc", "float", (1, 2, 11, 5)), Leaf("new", "float", (1, 2, 3, 5)),
                                Leaf("pos", "int32", (1,), gen="value", lo=2)],
                  [Op("kv_update", ["kc", "new", "pos"], out="kc2")], ["kc2"])
        kprog, knames, kdata = _program(kv)
        with env.session(kprog, device="wgpu") as ks:
            ks.run("forward", [kdata[n] for n in knames])
            writes.clear()
            for p in (2, 6, 8, 0):
                new = rng.standard_normal((1, 2, 3, 5)).astype(np.float32)
                (got,) = ks.run("forward", [kdata["kc"], new, np.array([p], np.int32)])
                want = kdata["kc"].copy()
                want[:, :, p:p + 3] = new
                np.testing.assert_array_equal(got, want)
        assert writes == [] and ctx.run_inputs is not None
        writes.clear()
        xs = [rng.standard_normal((7, 11)).astype(np.float32) for _ in range(3)]
        ts = [s.run("forward", [x], keep_on_device=True)[0] for x in xs[:1]]
        ts.append(s.run("forward", [xs[1]], keep_on_device=True)[0])  # the queue busy: write_buffer
        assert len(writes) == 1
        np.testing.assert_allclose(ts[-1].numpy(), xs[1].astype(np.float64) @ w.T, rtol=1e-4, atol=1e-5)
        writes.clear()

        def broken(self, _writes):
            raise RuntimeError("staging failed")

        monkeypatch.setattr(type(ctx.run_inputs), "encode", broken)
        np.testing.assert_allclose(s.run("forward", [xs[2]])[0], xs[2].astype(np.float64) @ w.T, rtol=1e-4, atol=1e-5)
        assert ctx.run_inputs is None and len(writes) == 1  # written, and staging off for good


def test_kv_cache_fed_back_is_not_copied(env):
    case = Case("kv/feed_back", [Leaf("kc", "float", (1, 2, 11, 5)), Leaf("new", "float", (1, 2, 3, 5)),
                                 Leaf("pos", "int32", (1,), gen="value", lo=2)],
                [Op("kv_update", ["kc", "new", "pos"], out="kc2")], ["kc2"])
    prog, names, data = _program(case)
    with env.session(prog, device="wgpu") as s:
        (c1,) = s.run("forward", [data[n] for n in names], keep_on_device=True)
        pp = s.plan.payloads[0]
        assert c1.handle[1] == pp.inputs[0].buf.offset and c1.handle[0] is s.executor.arena[0][pp.inputs[0].buf.index]
        new2 = np.full((1, 2, 3, 5), 7.0, np.float32)
        (c2,) = s.run("forward", [c1, new2, np.array([6], np.int32)], keep_on_device=True)
        want = data["kc"].copy()
        want[:, :, 2:5] = data["new"]
        want[:, :, 6:9] = 7.0
        np.testing.assert_array_equal(c2.numpy(), want)


# ---------------------------------------------------------------------------- profiling

def test_profile_gives_gpu_time_per_node(env):
    case = _mlp_case(depth=2)
    prog, names, data = _program(case)
    if "timestamp-query" not in env.context("wgpu").features:
        pytest.skip("this adapter has no timestamp-query feature")
    with env.session(prog, device="wgpu", profile=True) as s:
        y = s.run("forward", [data["x"]])[0]
        _check(case, [y], golden(case, data), 1e-4, 1e-4)
        prof = s.executor.last_profile
        assert [(op, node) for op, node, _ in prof] == [(n.op, i) for i, n in enumerate(prog.payloads[0].nodes)]
        assert all(sec >= 0 for _, _, sec in prof) and sum(sec for _, _, sec in prof) > 0


# ---------------------------------------------------------------------------- kernel variants

VARIANT_CASES = [
    # float16 products whose N is odd go through a float32 scratch and a cast.
    Case("variant/matmul_f16_odd_n", [Leaf("a", "float", (2, 13, 11)), Leaf("b", "float", (11, 7))],
         [Op("matmul", ["a", "b"], out="y")], ["y"], storage="float16", red=11),
    Case("variant/gemv_n_f16", [Leaf("a", "float", (3, 17)), Leaf("b", "float", (17, 10))],
         [Op("matmul", ["a", "b"], out="y")], ["y"], storage="float16", red=17),
    Case("variant/gemv_k_bias", [Leaf("x", "float", (2, 37)), Leaf("w", "float", (19, 37), kind="prepack"),
                                 Leaf("b", "float", (19,), kind="prepack")],
         [Op("linear", ["x", "w", "b"], out="y")], ["y"], red=37),
    Case("variant/pointwise_conv_as_product", [Leaf("x", "float", (2, 5, 7, 3)), Leaf("w", "float", (11, 5, 1, 1), kind="prepack"),
                                               Leaf("b", "float", (11,), kind="prepack")],
         [Op("conv2d", ["x", "w", "b"], out="y")], ["y"], red=5),
    Case("variant/reduce_non_block_dims", [Leaf("a", "float", (3, 5, 7))],
         [Op("amax", ["a"], {"dims": [0, 2], "keepdim": True}, out="y")], ["y"]),
    Case("variant/gqa_mask_f16", [Leaf("q", "float", (1, 4, 5, 6)), Leaf("k", "float", (1, 2, 7, 6)),
                                  Leaf("v", "float", (1, 2, 7, 3)), Leaf("m", "bool", (5, 7), gen="keep")],
         [Op("sdpa", ["q", "k", "v", "m"], out="y")], ["y"], storage="float16", red=7),
]


@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: c.id)
def test_kernel_variants(env, case):
    tol = (1e-2, 2e-3) if case.storage == "float16" else (1e-4, 1e-5 * case.red ** 0.5)
    _run_case(env, case, "wgpu", *tol)


@pytest.mark.parametrize("tile,bk", [(128, 8), (128, 16), (64, 8), (32, 8)])
def test_every_tile_variant_with_odd_edges(env, tile, bk):
    # Each tile variant forced (the automatic choice depends on the output size), on a shape with
    # partial tiles in M, N and K, transposed B (linear) and plain B (matmul).
    case = Case(f"variant/mm{tile}", [Leaf("a", "float", (131, 67)), Leaf("w", "float", (137, 67), kind="prepack"),
                                  Leaf("b", "float", (67, 131))],
                [Op("linear", ["a", "w"], out="y"), Op("matmul", ["a", "b"], out="z")], ["y", "z"], red=67)
    if bk * tile * 16 > env.context("wgpu").device.limits["max-compute-workgroup-storage-size"]:
        pytest.skip(f"this adapter's workgroup memory is too small for a K step of {bk} with {tile}x{tile} tiles")
    _run_case(env, case, "wgpu", 1e-4, 1e-4, tuning=lowering.Tuning(mm_tile=tile, mm_bk=bk))


# ---------------------------------------------------------------------------- no adapter

def test_no_adapter_is_a_clear_device_error(monkeypatch):
    import wgpu

    from gpudelegate.native.wgpu_device import WgpuContext

    monkeypatch.setattr(wgpu.gpu, "request_adapter_sync", lambda **kw: None)
    with pytest.raises(DeviceError, match="no WebGPU adapter"):
        WgpuContext(None)


# ---------------------------------------------------------------------------- attention paths

def _sdpa_cases():
    from conformance.cases import CASES

    return [c for c in CASES if c.op_names == ["sdpa"]]


# The four sdpa lowerings: split-K (attn_split + attn_combine, the default for short query
# blocks), the one-workgroup-per-row fused kernel (attn_rows), the one-pass tile kernel for longer
# float32 blocks over <= 128 keys (attn_tile), and matmul + softmax + matmul.
_ATTN_PATHS = {
    "flash": (lowering.Tuning(attn_fused_max_tq=1 << 20), {"attn_flash", "attn_flash_combine"}),
    "split": (lowering.Tuning(attn_fused_max_tq=1 << 20, attn_flash=False), {"attn_split", "attn_combine"}),
    "rows": (lowering.Tuning(attn_fused_max_tq=1 << 20, attn_flash=False, attn_split=False), {"attn_rows"}),
    "tile": (lowering.Tuning(attn_fused_max_tq=0), {"attn_tile"}),
    "composed": (lowering.Tuning(attn_fused_max_tq=0, attn_tile=False), set()),
}
_ATTN_ENTRIES = {"attn_flash", "attn_flash_combine", "attn_split", "attn_combine", "attn_rows", "attn_tile"}


def _flash_applies(case) -> bool:
    """Whether flash-decoding takes ``case``'s sdpa (ops_attention): float32, head and value dims
    multiples of 4 up to 256; otherwise the split-K kernels do."""
    shapes = {lf.name: lf.shape for lf in case.leaves}
    args = next(op.args for op in case.ops if op.op == "sdpa")
    d, dv = shapes[args[0]][3], shapes[args[2]][3]
    return case.storage == "float32" and d % 4 == 0 and dv % 4 == 0 and d <= 256 and dv <= 256


def _tile_applies(case) -> bool:
    """Whether attn_tile takes ``case``'s sdpa (ops_attention._sdpa_tile): float32, <= 128 keys, a value
    dim that is a multiple of 4 up to 64."""
    shapes = {lf.name: lf.shape for lf in case.leaves}
    args = next(op.args for op in case.ops if op.op == "sdpa")
    tk, dv = shapes[args[1]][2], shapes[args[2]][3]
    return case.storage == "float32" and tk <= ops_attention.ATTN_TILE_MAX_KEYS and dv % 4 == 0 and dv <= 64


def _attn_entries(env, prog, tuning):
    limits = env.context("wgpu").limits
    return {c.entry for d in plan_session(prog, limits).payloads[0].dispatches
            for c in lowering.select(d, limits, tuning=tuning)} & _ATTN_ENTRIES


@pytest.mark.parametrize("path", sorted(_ATTN_PATHS))
@pytest.mark.parametrize("case", _sdpa_cases(), ids=lambda c: c.id)
def test_every_attention_path(env, case, path):
    """sdpa runs split-K (or, forced, as one fused kernel per row) for short query blocks and as
    matmul + softmax + matmul otherwise; every conformance attention case goes through each."""
    from conformance.cases import tolerance

    tuning, want = _ATTN_PATHS[path]
    if path == "tile" and not _tile_applies(case):
        want = set()  # the composite path takes it
    if path == "flash" and not _flash_applies(case):
        want = _ATTN_PATHS["split"][1]
    shapes = {lf.name: lf.shape for lf in case.leaves}
    q, k, v = (shapes[a] for a in case.ops[0].args[:3])
    if 0 in q[:3] or v[3] == 0 or k[2] == 0:
        # an edge case (edges.py): an empty output runs nothing, no keys (Tk = 0) is a product
        # over K = 0 (zeros) on the composite path
        want = set()
    prog, names, data = _program(case)
    assert _attn_entries(env, prog, tuning) == want
    _run_case(env, case, "wgpu", *tolerance(case), tuning=tuning)


@pytest.mark.parametrize("path", sorted(_ATTN_PATHS))
def test_fully_masked_attention_rows_are_zeros(env, path):
    # causal_offset -2: query rows 0 and 1 keep no key; torch's scaled_dot_product_attention gives
    # zeros there (its _safe_softmax), and so must every path.
    case = Case("sdpa/dead_rows", [Leaf("q", "float", (1, 2, 4, 8)), Leaf("k", "float", (1, 2, 6, 8)),
                                  Leaf("v", "float", (1, 2, 6, 4))],
                [Op("sdpa", ["q", "k", "v"], {"causal": True, "causal_offset": -2}, out="y")], ["y"], red=8)
    _, outs = _run_case(env, case, "wgpu", 1e-4, 1e-5, tuning=_ATTN_PATHS[path][0])
    y = outs[0]
    assert (y[:, :, :2] == 0).all() and np.isfinite(y[:, :, 2:]).all()


# Split-K shapes past the conformance cases: several key chunks (a chunk that keeps no key under
# causality or the mask sits next to ones that do), 8+ query rows per kv head (two row blocks),
# keys past attn_rows' 2048, float16 storage, bool and float masks broadcast over heads/batch.
SPLIT_CASES = [
    Case("split/decode_gqa_many_chunks", [Leaf("q", "float", (2, 9, 1, 64)), Leaf("k", "float", (2, 3, 263, 64)),
                                          Leaf("v", "float", (2, 3, 263, 64))],
         [Op("sdpa", ["q", "k", "v"], {"causal": True, "causal_offset": 131}, out="y")], ["y"], red=263),
    Case("split/two_row_blocks_bool_mask", [Leaf("q", "float", (1, 6, 3, 17)), Leaf("k", "float", (1, 2, 101, 17)),
                                            Leaf("v", "float", (1, 2, 101, 11)), Leaf("m", "bool", (1, 1, 3, 101), gen="keep")],
         [Op("sdpa", ["q", "k", "v", "m"], out="y")], ["y"], red=101),
    Case("split/float_mask_f16", [Leaf("q", "float", (2, 4, 2, 13)), Leaf("k", "float", (2, 2, 71, 13)),
                                  Leaf("v", "float", (2, 2, 71, 6)), Leaf("m", "float", (2, 1, 1, 71))],
         [Op("sdpa", ["q", "k", "v", "m"], out="y")], ["y"], storage="float16", red=71),
    Case("split/long_cache", [Leaf("q", "float", (1, 2, 1, 8)), Leaf("k", "float", (1, 1, 2203, 8)),
                              Leaf("v", "float", (1, 1, 2203, 5))],
         [Op("sdpa", ["q", "k", "v"], out="y")], ["y"], red=2203),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c.id)
def test_split_k_attention(env, case):
    tuning = _ATTN_PATHS["split"][0]
    prog, names, data = _program(case)
    assert _attn_entries(env, prog, tuning) == {"attn_split", "attn_combine"}
    # float16 storage rounds q, k, v and the output (1e-2 relative); float32 sums of up to 2203
    # products of unit-scale values in a different order than float64 (1e-5 * sqrt(keys)).
    tol = (1e-2, 2e-3) if case.storage == "float16" else (1e-4, 1e-5 * case.red ** 0.5)
    _run_case(env, case, "wgpu", *tol, tuning=tuning)


# One-pass tile attention (attention_tile.wgsl) past the conformance cases: query blocks that end
# mid-workgroup (prime Tq), prime key counts up to the 128 limit, prime head dims (the 16-wide
# steps end short), value dims from 4 to 64 (up to 32: 8 vec4 column groups per row, some idle;
# 44 and 64: 16), grouped-query heads, causal offsets, bool and float masks broadcast over heads and
# rows; over 128 keys or a value dim over 64, the composite path takes them.
TILE_CASES = [
    Case("tile/plain_dv4", [Leaf("q", "float", (2, 3, 37, 19)), Leaf("k", "float", (2, 3, 53, 19)),
                            Leaf("v", "float", (2, 3, 53, 4))], [Op("sdpa", ["q", "k", "v"], out="y")], ["y"], red=53),
    Case("tile/gqa_causal_dv12", [Leaf("q", "float", (1, 6, 41, 23)), Leaf("k", "float", (1, 2, 41, 23)),
                                  Leaf("v", "float", (1, 2, 41, 12))],
         [Op("sdpa", ["q", "k", "v"], {"causal": True}, out="y")], ["y"], red=41),
    Case("tile/causal_offset_dv20", [Leaf("q", "float", (2, 2, 17, 31)), Leaf("k", "float", (2, 2, 127, 31)),
                                     Leaf("v", "float", (2, 2, 127, 20))],
         [Op("sdpa", ["q", "k", "v"], {"causal": True, "causal_offset": 101, "scale": 0.21}, out="y")], ["y"], red=127),
    Case("tile/bool_mask_dv32", [Leaf("q", "float", (2, 3, 29, 32)), Leaf("k", "float", (2, 3, 128, 32)),
                                 Leaf("v", "float", (2, 3, 128, 32)), Leaf("m", "bool", (2, 1, 29, 128), gen="keep")],
         [Op("sdpa", ["q", "k", "v", "m"], out="y")], ["y"], red=128),
    Case("tile/float_mask_dv44", [Leaf("q", "float", (3, 2, 23, 37)), Leaf("k", "float", (3, 2, 67, 37)),
                                  Leaf("v", "float", (3, 2, 67, 44)), Leaf("m", "float", (3, 1, 1, 67))],
         [Op("sdpa", ["q", "k", "v", "m"], out="y")], ["y"], red=67),
    Case("tile/gqa_dv64", [Leaf("q", "float", (1, 9, 19, 64)), Leaf("k", "float", (1, 3, 113, 64)),
                           Leaf("v", "float", (1, 3, 113, 64))],
         [Op("sdpa", ["q", "k", "v"], {"causal": True, "causal_offset": 94}, out="y")], ["y"], red=113),
    Case("tile/over_the_key_limit", [Leaf("q", "float", (1, 2, 19, 16)), Leaf("k", "float", (1, 2, 131, 16)),
                                     Leaf("v", "float", (1, 2, 131, 8))], [Op("sdpa", ["q", "k", "v"], out="y")],
         ["y"], red=131),
    # longer key ranges than one tile: the composite path, also for a prefill in a long cache
    Case("tile/long_keys_causal_gqa", [Leaf("q", "float", (1, 6, 37, 24)), Leaf("k", "float", (1, 2, 307, 24)),
                                       Leaf("v", "float", (1, 2, 307, 16))],
         [Op("sdpa", ["q", "k", "v"], {"causal": True, "causal_offset": 241}, out="y")], ["y"], red=307),
    Case("tile/prefill_in_a_long_cache", [Leaf("q", "float", (1, 3, 41, 32)), Leaf("k", "float", (1, 3, 521, 32)),
                                          Leaf("v", "float", (1, 3, 521, 32)), Leaf("m", "float", (1, 1, 1, 521))],
         [Op("sdpa", ["q", "k", "v", "m"], {"causal": True, "causal_offset": 130}, out="y")], ["y"], red=521),
    Case("tile/dv_over_64", [Leaf("q", "float", (1, 2, 19, 16)), Leaf("k", "float", (1, 2, 31, 16)),
                             Leaf("v", "float", (1, 2, 31, 68))], [Op("sdpa", ["q", "k", "v"], out="y")], ["y"], red=31),
]


@pytest.mark.parametrize("case", TILE_CASES, ids=lambda c: c.id)
def test_tile_attention(env, case):
    from conformance.cases import tolerance

    prog, names, data = _program(case)
    want = {"attn_tile"} if _tile_applies(case) else set()
    assert _attn_entries(env, prog, lowering.Tuning()) == want  # the default lowering for these shapes
    _run_case(env, case, "wgpu", *tolerance(case))


def test_tile_attention_dead_rows_and_nan_scores(env):
    # Rows 0-2 keep no key (causal_offset -3): zeros, as torch's sdpa. A NaN in q makes its row
    # NaN, nothing else.
    case = Case("tile/nan_rows", [Leaf("q", "float", (1, 2, 21, 8)), Leaf("k", "float", (1, 2, 21, 8)),
                                  Leaf("v", "float", (1, 2, 21, 8))],
                [Op("sdpa", ["q", "k", "v"], {"causal": True, "causal_offset": -3}, out="y")], ["y"], red=21)
    prog, names, data = _program(case)
    assert _attn_entries(env, prog, lowering.Tuning()) == {"attn_tile"}
    data["q"][0, 1, 17, 5] = np.nan
    want = golden(case, data)[0]
    with env.session(prog, device="wgpu") as s:
        y = s.run("forward", [data[n] for n in names])[0]
    assert (y[:, :, :3] == 0).all() and (want[:, :, :3] == 0).all() and np.isnan(y[0, 1, 17]).all()
    finite = np.isfinite(want)
    assert finite.sum() == y.size - 8 and np.isfinite(y[finite]).all()
    np.testing.assert_allclose(y[finite], want[finite], rtol=1e-4, atol=1e-5 * 21 ** 0.5)
