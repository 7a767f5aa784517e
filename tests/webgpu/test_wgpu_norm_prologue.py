"""The norm prologue of the concatenated decode products on WebGPU (core/plan/fusion.py
``Fusion.norm``, carried out by core/webgpu/ops_fused.py: fused.wgsl ``gemv_cat_norm`` for float
weights, quant_mm.wgsl ``qgemv_cat_norm`` for packed ones).

A llama block front, s = x + r, h = rms_norm(s) * w, then gate/up (silu * up) or q/k/v (rope and
cache writes), runs on wgpu with and without the planner's fusions; both against the float64
reference at the conformance tolerances (float32 rtol 1e-4, atol 1e-5 sqrt(K): the prologue
sums the squares in another order than the add_rms kernel, nothing else changes; float16 storage
rtol 1e-2, atol 2e-3 sqrt(K)). Row lengths K = 48 and 96 (float) or 64 and 96 (packed: whole
32-value blocks), N = 37 or 44 columns, M = 1..4 rows (8 on packed weights). The recorded chain
shows the whole front as one dispatch (plus rope_kv for float weights; packed ones rotate and
write the caches in the product, qgemv_rope), the add and the norm running nothing.
Float16 activations have no prologue kernel: the norm runs into a scratch first, still right.

Runs on any wgpu adapter (software Vulkan in CI); test_dawn_norm_prologue.py runs the same cases
on Dawn.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpudelegate.plan import plan_session
from gpudelegate.plan.types import DeviceLimits
from gpudelegate.webgpu import lowering, ops_fused

from conformance.cases import Case, Leaf, Op, build_program, golden, make_data, tolerance
from conformance.executors import environment_fixture

pytestmark = pytest.mark.wgpu

env = environment_fixture("wgpu")

LIM = DeviceLimits(name="test")


def _norm_front(rows_k, add: bool):
    """Leaves and ops of s = x + r (``add``) and h = rms_norm(s or x) * wn, x and r [1, T, K]
    (``rows_k`` = (T, K))."""
    leaves = [Leaf("x", "float", (1, *rows_k)), Leaf("wn", "float", (rows_k[-1],), gen="positive", kind="prepack")]
    ops = []
    src = "x"
    if add:
        leaves.append(Leaf("r", "float", (1, *rows_k)))
        ops.append(Op("add", ["x", "r"], out="s"))
        src = "s"
    ops.append(Op("rms_norm", [src, "wn"], {"eps": 1e-5}, out="h"))
    return leaves, ops


def _gate_up(T, K, N, weights, storage="float32", add=True):
    leaves, ops = _norm_front((T, K), add)
    kind, dt = ("prepack_fp16", "float") if weights == "float16" else ("prepack", "float" if weights == "float32" else weights)
    leaves += [Leaf("wg", dt, (N, K), kind=kind), Leaf("wu", dt, (N, K), kind=kind)]
    ops += [Op("linear", ["h", "wg", None], out="g"), Op("linear", ["h", "wu", None], out="u"),
            Op("silu", ["g"], out="a"), Op("mul", ["a", "u"], out="o")]
    outs = ["o", "s"] if add else ["o"]
    return Case(f"prologue/gate_up_{T}x{K}_{N}_{weights}_{storage}_{'add' if add else 'norm'}", leaves, ops, outs,
                storage=storage, red=K)


def _attention(T, K, weights, storage="float32", add=True, D=12, H=4, Hk=2, S=23, pos=5):
    leaves, ops = _norm_front((T, K), add)
    kind, dt = ("prepack_fp16", "float") if weights == "float16" else ("prepack", "float" if weights == "float32" else weights)
    leaves += [Leaf("kc", "float", (1, Hk, S, D)), Leaf("vc", "float", (1, Hk, S, D)),
               Leaf("pos", "int32", (1,), gen="value", lo=pos),
               Leaf("cos", "float", (T, D), gen="angle"), Leaf("sin", "float", (T, D), gen="angle")]
    for name, heads in (("q", H), ("k", Hk), ("v", Hk)):
        leaves.append(Leaf(f"w{name}", dt, (heads * D, K), kind=kind))
        ops += [Op("linear", ["h", f"w{name}", None], out=f"{name}l"),
                Op("reshape", [f"{name}l"], {"shape": [1, T, heads, D]}, out=f"{name}4"),
                Op("permute", [f"{name}4"], {"dims": [0, 2, 1, 3]}, out=f"{name}h")]
    ops += [Op("rope", ["qh", "cos", "sin"], out="qr"), Op("rope", ["kh", "cos", "sin"], out="kr"),
            Op("kv_update", ["kc", "kr", "pos"], out="kc2"), Op("kv_update", ["vc", "vh", "pos"], out="vc2")]
    outs = ["qr", "kc2", "vc2"] + (["s"] if add else [])
    return Case(f"prologue/attention_{T}x{K}_{weights}_{storage}_{'add' if add else 'norm'}", leaves, ops, outs,
                storage=storage, red=K)


def _run(env, case: Case, fuse: bool = True, device: str = "wgpu"):
    """Run ``case`` on ``device``, check every output against its float64 golden; returns the outputs
    and the recorded chain [(op, [entry points])], one per dispatch."""
    import gpudelegate

    data = make_data(case)
    prog, names = build_program(case, data)
    prog = gpudelegate.loads(prog.to_bytes())
    with env.session(prog, device=device, tuning=lowering.Tuning(fuse=fuse)) as s:
        outs = [np.asarray(o).astype(np.float64) for o in s.run("forward", [data[n] for n in names])]
        chain = [(n.op, [L.pipeline.label.split(":")[-1].strip() for L in n.launches])
                 for n in s.executor.recorded[0].nodes]
    rtol, atol = tolerance(case)
    for i, (g, w) in enumerate(zip(outs, golden(case, data))):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{case.id} output {i} fuse={fuse} ({chain})")
    return outs, chain


def _of(chain, op: str):
    return [e for o, e in chain if o == op]


def _check(env, case: Case, last_op: str, want, device: str = "wgpu"):
    """Fused and unfused runs against the golden and each other; the group's dispatch runs
    ``want`` (the entry points) and its other members nothing."""
    fused, chain = _run(env, case, device=device)
    apart, chain_apart = _run(env, case, fuse=False, device=device)
    rtol, atol = tolerance(case)
    for a, b in zip(fused, apart):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
    assert _of(chain, "rms_norm") == [[]] and _of(chain, "add") in ([], [[]]), chain
    assert _of(chain, last_op)[-1] == want, chain
    assert "add_rms" not in str(chain) and _of(chain_apart, "rms_norm") != [[]], (chain, chain_apart)


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("weights,K,N", [("float32", 48, 37), ("float32", 96, 37), ("float16", 48, 37),
                                         ("q4_1", 64, 44), ("q4_1", 96, 44)])
def test_gate_up_takes_the_add_and_norm(env, T, weights, K, N):
    want = ["qgemv_cat_norm"] if weights.startswith("q") else ["gemv_cat_norm"]
    _check(env, _gate_up(T, K, N, weights), "mul", want)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("weights,K", [("float32", 48), ("float16", 96), ("q4_1", 64), ("q8_0", 96), ("q4_0", 64)])
def test_qkv_takes_the_add_and_norm(env, T, weights, K):
    want = ["qgemv_rope"] if weights.startswith("q") else ["gemv_cat_norm", "rope_kv"]
    _check(env, _attention(T, K, weights), "kv_update", want)


@pytest.mark.parametrize("weights,K", [("float32", 48), ("q4_1", 64)])
def test_a_plain_norm_is_a_prologue_too(env, weights, K):
    """Layer 0's norm reads the embedding, no add before it: NORM 1, nothing written but h."""
    want = ["qgemv_rope"] if weights.startswith("q") else ["gemv_cat_norm", "rope_kv"]
    _check(env, _attention(1, K, weights, add=False), "kv_update", want)
    _check(env, _gate_up(2, K, 44, weights, add=False), "mul", ["qgemv_cat_norm" if weights.startswith("q") else "gemv_cat_norm"])


def test_eight_rows_of_packed_weights(env):
    _check(env, _gate_up(8, 96, 44, "q4_1"), "mul", ["qgemv_cat_norm"])


@pytest.mark.parametrize("maker", [lambda: _gate_up(1, 48, 37, "float32", storage="float16"),
                                   lambda: _attention(2, 48, "float32", storage="float16")])
def test_float16_activations_run_the_norm_as_a_kernel_of_its_own(env, maker):
    """No prologue kernel reads float16 rows: the add + norm run as one add_rms dispatch before
    the products, into a scratch the concatenated product reads (q/k/v), or, where no kernel
    takes the concatenated float16 gate/up at all, as the planner's add_rms_norm group with the
    products apart: never more dispatches than without the prologue."""
    case = maker()
    _, chain = _run(env, case)
    entries = [e for _, es in chain for e in es]
    assert entries.count("add_rms") == 1 and _of(chain, "add") == [[]], chain
    if "attention" in case.id:
        assert _of(chain, "rms_norm") == [[]] and _of(chain, "kv_update")[-1][0] == "add_rms", chain
    else:
        assert _of(chain, "rms_norm") == [["add_rms"]], chain


def test_uniform_of_the_float_prologue():
    """gemv_cat_norm's words 13..17 (src, y, s, weight bases, eps) and its bindings: src at
    slot 2, y 6, the norm weight 7, s 8."""
    import struct

    case = _gate_up(1, 48, 37, "float32")
    data = make_data(case)
    prog, _ = build_program(case, data)
    plan = plan_session(prog, LIM)
    pp = plan.payloads[0]
    (f,) = [f for f in ops_fused.plan_fusions(plan, 0) if f.cat]
    assert f.norm is not None and f.norm["add"] is not None
    calls = lowering.select_all(pp, LIM, fusions=ops_fused.plan_fusions(plan, 0))
    (call,) = calls[f.at]
    assert call.entry == "gemv_cat_norm" and call.constants["NORM"] == 2 and call.constants["HS"] == 48
    w = struct.unpack("<32I", call.uniform)
    assert w[0] == 48 and w[1] == 0 and w[2] == 48  # K; x from workgroup memory, rows K apart
    assert struct.unpack("<f", struct.pack("<I", w[17]))[0] == pytest.approx(1e-5)
    by_slot = {b.binding: b.buf for b in call.bindings}
    n = f.norm
    for slot, ref, word in ((2, n["x"], 13), (6, n["y"], 14), (8, n["s"], 15), (7, n["w"], 16)):
        b = by_slot[slot]
        assert (b.space, b.index) == (ref.buf.space, ref.buf.index)
        assert b.offset + 4 * w[word] == ref.buf.offset  # the element base inside the binding


def test_rows_over_workgroup_memory_run_the_norm_into_a_scratch(env):
    """4 float32 rows of a K chosen past the device's workgroup memory (maxComputeWorkgroupStorageSize,
    which the desktop device requests at the adapter's value) do not fit qgemv_cat_norm: add_rms
    writes h to a scratch, qgemv_cat reads it there (the unfused dispatch count)."""
    room = env.context("wgpu").limits.max_workgroup_storage
    K = (room // (4 * 4) // 32 + 1) * 32  # whole q4_1 blocks, 4 * 4 * K bytes > room
    case = _gate_up(4, K, 44, "q4_1")
    _, chain = _run(env, case)
    assert _of(chain, "rms_norm") == [[]] and _of(chain, "add") == [[]], chain
    assert _of(chain, "mul") == [["add_rms", "qgemv_cat"]], chain
