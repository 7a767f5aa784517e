"""Every executor x every case, compared with the float64 reference kernels.

Each case becomes a real program file (written, read back and validated, as a user's would be),
runs through ``env.session(...).run`` on the executor, twice with fresh inputs (stale buffers or
results cached across runs would show), and is compared with the golden answer within the case's
stated tolerance (see cases.tolerance). Integer and bool outputs must match exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpudelegate
from gpudelegate import ops
from gpudelegate.environment import Environment
from gpudelegate.executor import DeviceTensor
from gpudelegate.plan import plan_session

from .cases import CASES, Case, build_program, golden, make_data, ops_covered, tolerance
from .executors import EXECUTORS

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


@pytest.mark.parametrize("spec,case", list(_params(CASES)))
def test_case(env, spec, case):
    _need(spec)
    data = make_data(case, 0)
    prog, names = _program(case, data)
    with env.session(prog, device=spec.device_kind, **spec.session_options) as sess:
        for run in (0, 1):
            d = data if run == 0 else _fresh_inputs(case, run, data)
            outs = sess.run("forward", [d[n] for n in names])
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


def test_cases_cover_both_storages_and_prepack_layouts():
    assert {c.storage for c in CASES} == {"float32", "float16"}
    kinds = {l.kind for c in CASES for l in c.leaves}
    assert {"input", "const", "prepack", "prepack_fp16"} <= kinds
