"""Every executor x every case, compared with the float64 reference kernels.

Each case becomes a real program file (written, read back and validated, as a user's would be),
runs through ``env.session(...).run`` on the executor, twice with fresh inputs (stale buffers or
results cached across runs would show), and is compared with the golden answer within the case's
stated tolerance (see cases.tolerance). Integer and bool outputs must match exactly; NaN and inf
positions too (``assert_allclose`` compares them as values). The cases include every op's edge
samples (edges.py: empty dims, 0-d tensors, broadcasting, non-contiguous inputs, NaN/inf/-0.0,
integer extremes), and the golden answers of all one-op cases are held to eager PyTorch in float64
(``test_golden_matches_torch``); the terminal summary prints the edge samples per op.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpudelegate
from gpudelegate import ops
from gpudelegate.environment import Environment
from gpudelegate.executor import DeviceTensor
from gpudelegate.native.quant import PackedWeight
from gpudelegate.plan import plan_session

from .cases import CASES, PACKED, Case, build_program, golden, leaf_dtype, leaf_value, make_data, ops_covered, tolerance
from .executors import EXECUTORS
from gpudelegate.program import Value

_NP = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "bool": np.bool_}


def _params(cases):
    for spec in EXECUTORS:
        marks = [getattr(pytest.mark, m) for m in spec.marks]
        for case in cases:
            yield pytest.param(spec, case, id=f"{spec.name}:{case.id}", marks=marks)


@pytest.fixture(scope="module")
def env():
    e = Environment()
    yield e
    e.close()


def _need(spec):
    ok, reason = spec.available()
    if not ok:
        pytest.skip(reason)


def _program(case: Case, data):
    prog, names = build_program(case, data)
    return gpudelegate.loads(prog.to_bytes()), names


def _fresh_inputs(case: Case, run: int, data0):
    """New random method inputs for ``run``; constants stay those baked into the program."""
    fresh = make_data(case, run)
    return {l.name: (fresh[l.name] if l.kind == "input" else data0[l.name]) for l in case.leaves}


def check_outputs(case: Case, prog, outs, expected, where: str = "") -> None:
    m = prog.methods["forward"]
    rtol, atol = tolerance(case)
    assert len(outs) == len(expected)
    for i, (got, want) in enumerate(zip(outs, expected)):
        v = m.values[m.outputs[i]]
        what = f"{case.id}{where} output {i} ({case.outputs[i]}, {v.dtype}{list(v.shape)})"
        got = np.asarray(got)
        assert got.shape == tuple(v.shape), what
        assert got.dtype == _NP[v.dtype], f"{what}: returned {got.dtype}"
        if v.dtype in ("int32", "bool"):
            np.testing.assert_array_equal(got, want, err_msg=what)
        else:
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol, err_msg=what)


def noncontiguous(x: np.ndarray) -> np.ndarray:
    """The values of ``x`` as a view that is not C-contiguous (every other element of a buffer
    twice as wide along the last dim); ``x`` itself when it has fewer than 2 elements."""
    if x.ndim == 0 or x.size < 2:
        return x
    big = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
    big[..., ::2] = x
    v = big[..., ::2]
    assert not v.flags.c_contiguous and np.array_equal(v, x, equal_nan=x.dtype.kind == "f")
    return v


def run_inputs(case: Case, d, names):
    """The method inputs of ``case`` as run() gets them: non-contiguous views for strided cases."""
    xs = [d[n] for n in names]
    return [noncontiguous(x) for x in xs] if case.strided else xs


@pytest.mark.parametrize("spec,case", list(_params(CASES)))
def test_case(env, spec, case):
    _need(spec)
    data = make_data(case, 0)
    prog, names = _program(case, data)
    with env.session(prog, device=spec.device_kind, **spec.session_options) as sess:
        for run in (0, 1):
            d = data if run == 0 else _fresh_inputs(case, run, data)
            outs = sess.run("forward", run_inputs(case, d, names))
            check_outputs(case, prog, outs, golden(case, d), f" run {run}")


# Chains whose weights go through prepack entries: run them again with the weight budget at the
# offload floor, so the executor streams weights through the slot ring. Streaming can only save
# memory when more nodes read weights than the ring holds at once (prefetch depth + 1 groups), so
# a depth is used for the chains that have more weight-reading nodes than that.
def _weight_nodes(case: Case) -> int:
    packed = {l.name for l in case.leaves if l.kind.startswith("prepack")}
    return sum(any(a in packed for a in o.args) for o in case.ops)


OFFLOAD_PARAMS = [pytest.param(spec, case, depth, id=f"{spec.name}:{case.id}:depth{depth}",
                               marks=[getattr(pytest.mark, m) for m in spec.marks])
                  for spec in EXECUTORS for case in CASES if case.id.startswith("chain/")
                  for depth in (0, 1) if _weight_nodes(case) > depth + 1]


@pytest.mark.parametrize("spec,case,depth", OFFLOAD_PARAMS)
def test_case_offloaded_at_floor(env, spec, case, depth):
    _need(spec)
    data = make_data(case, 0)
    prog, names = _program(case, data)
    limits = env.context(spec.device_kind).limits
    floor = plan_session(prog, limits, weight_budget=1 << 40, prefetch_depth=depth).offload.floor
    with env.session(prog, device=spec.device_kind, weight_budget=floor, prefetch_depth=depth,
                     **spec.session_options) as sess:
        assert sess.plan.offload.streamed, f"{case.id}: nothing streamed at the floor ({floor} bytes)"
        for run in (0, 1):
            d = data if run == 0 else _fresh_inputs(case, run, data)
            check_outputs(case, prog, sess.run("forward", [d[n] for n in names]), golden(case, d),
                          f" offloaded (budget {floor}, depth {depth}) run {run}")


_DECODE = [c for c in CASES if c.id.startswith("chain/decode_step/")]


@pytest.mark.parametrize("spec,case", list(_params(_DECODE)))
def test_kv_cache_stays_on_device(env, spec, case):
    """Three decode steps feeding the updated caches back as DeviceTensors (IO binding): the cache
    never visits the host, and the results match the golden chain step by step."""
    _need(spec)
    data = make_data(case, 0)
    prog, names = _program(case, data)
    with env.session(prog, device=spec.device_kind, **spec.session_options) as sess:
        host = dict(data)
        dev_caches = None
        for step in range(3):
            d = _fresh_inputs(case, step + 1, data)
            d["pos"] = np.array([4 + step], np.int32)
            d["kc"], d["vc"] = host["kc"], host["vc"]
            want = golden(case, d)
            args = [d[n] for n in names]
            if dev_caches is not None:
                args[names.index("kc")], args[names.index("vc")] = dev_caches
            y, kc2, vc2 = sess.run("forward", args, keep_on_device=True)
            assert all(isinstance(t, DeviceTensor) for t in (y, kc2, vc2))
            check_outputs(case, prog, [t.numpy() for t in (y, kc2, vc2)], want, f" step {step}")
            host["kc"], host["vc"] = want[1].astype(d["kc"].dtype), want[2].astype(d["vc"].dtype)
            dev_caches = (kc2, vc2)


def test_every_op_has_cases():
    missing = set(ops.KERNEL_OPS) - ops_covered()
    assert not missing, f"ops without conformance cases: {sorted(missing)}"


def test_every_op_has_a_torch_spelling():
    from .torch_ops import TORCH

    assert set(TORCH) == set(ops.KERNEL_OPS), sorted(set(TORCH) ^ set(ops.KERNEL_OPS))


def test_every_op_has_edge_samples():
    """Each op gets edge cases (edges.py), among them special float values for every op with a
    float input."""
    edge_ops = {c.ops[0].op for c in CASES if "/edge-" in c.id}
    assert edge_ops == set(ops.KERNEL_OPS), sorted(set(ops.KERNEL_OPS) - edge_ops)


def test_cases_cover_both_storages_and_prepack_layouts():
    assert {c.storage for c in CASES} == {"float32", "float16"}
    kinds = {l.kind for c in CASES for l in c.leaves}
    assert {"input", "const", "prepack", "prepack_fp16"} <= kinds


def test_cases_cover_every_packed_type_in_both_ops():
    """Each packed weight type is read by linear (as a prepacked and a plain constant, with and
    without bias, by the decode and the tiled kernels' M) and by embedding, with edge samples."""
    for qt in PACKED:
        lin = [c for c in CASES if c.ops[0].op == "linear" and any(l.dtype == qt for l in c.leaves)]
        got = {(l.kind, c.ops[0].args[2] is not None) for c in lin for l in c.leaves if l.dtype == qt}
        assert got == {(k, b) for k in ("const", "prepack") for b in (False, True)}, (qt, got)
        ms = {int(np.prod(l.shape[:-1])) for c in lin for l in c.leaves if l.name == "x"}
        assert {1, 3, 5, 8, 17, 33, 0} <= ms, (qt, sorted(ms))
        assert any("/edge-special-x/" in c.id for c in lin), qt
        emb = [c for c in CASES if c.ops[0].op == "embedding" and any(l.dtype == qt for l in c.leaves)]
        assert {l.kind for c in emb for l in c.leaves if l.dtype == qt} == {"const", "prepack"}, qt


# The golden answers against eager PyTorch in float64, on every one-op case (the edge samples and
# their seeds): the executors are held to the reference kernels, so these must be PyTorch's
# answers, NaN and inf positions included. Both sides compute in float64; rtol 1e-9 and atol 1e-10
# cover different summation orders (a length-131 dot of O(1) terms: ~1e-13) and erf/tanh
# implementations (libm vs torch's own, a few ulp), and are far below any float32 result's error.
ONE_OP = [c for c in CASES if len(c.ops) == 1]


@pytest.mark.parametrize("case", ONE_OP, ids=[c.id for c in ONE_OP])
def test_golden_matches_torch(case):
    torch = pytest.importorskip("torch", reason="the golden answers are checked against PyTorch (extra 'export')")
    from .torch_ops import TORCH

    data = make_data(case, 0)
    (want,) = golden(case, data)
    (o,) = case.ops
    specs = {l.name: Value(leaf_dtype(case, l), l.shape) for l in case.leaves}
    attrs = ops.normalize_attrs(o.op, o.attrs, [None if a is None else specs[a] for a in o.args])
    leaves = {}
    for l in case.leaves:
        x = leaf_value(case, l, data[l.name])  # what the device holds, as golden() reads it
        if isinstance(x, PackedWeight):  # torch gets gguf's dequantized float32 values
            x = x.dequantize().astype(np.float64)
        leaves[l.name] = torch.from_numpy(np.array(x))
    args = [None if a is None else leaves[a] for a in o.args]
    args += [None] * ((ops.get(o.op).max_args or 0) - len(args))  # absent trailing optionals
    try:
        got = TORCH[o.op](args, attrs).numpy()
    except (RuntimeError, IndexError) as e:
        # PyTorch refuses a few empty tensors whose result is empty anyway (a pooling over zero
        # channels, a batch_norm or conv2d with zero output channels): no value to compare, the
        # empty output's shape is the op schema's.
        if want.size == 0:
            return
        raise AssertionError(f"{case.id}: torch refuses what the op set accepts: {e}") from None
    assert got.shape == want.shape, f"{case.id}: torch gives {got.shape}, the reference {want.shape}"
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(want, got, err_msg=case.id)
        return
    # A float result of integer operands (int32 / int32) is float32 in the golden too, as on the
    # devices: compare it at its own precision.
    rtol = 1e-9 if want.dtype == np.float64 else 2 * float(np.finfo(want.dtype).eps)
    np.testing.assert_allclose(want.astype(np.float64), got.astype(np.float64), rtol=rtol, atol=1e-10,
                               err_msg=case.id)
