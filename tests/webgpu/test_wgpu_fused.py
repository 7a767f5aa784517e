"""The planner's fusions on WebGPU: core/plan/fusion.py ``match`` (add_rms_norm, silu_mul, rope_kv,
gemm_cat) carried out by core/webgpu/ops_fused.py with shaders/fused.wgsl, the groups the CUDA
executor runs with cuda_fused.cu.

Each kernel runs on wgpu against the float64 answer of the reference kernels (conformance
tolerances: float32 rtol 1e-4, atol 1e-5 sqrt(K); float16 storage rtol 1e-2, atol 2e-3 sqrt(K)),
with prime row lengths, one row (decode) and 17 rows (a prefill), grouped-query heads, and the
fused entry points asserted in the recorded chain, so a pattern that silently stopped fusing fails
too; the concatenated products also on packed weights (q4_0, q4_1, q8_0: quant_mm.wgsl's
qgemv_cat, or one packed product per weight) with 1, 3, 8 and 17 rows. A SmolLM2-shaped model (2 layers, 512-token vocabulary, random weights) then runs prefill and
decode steps on wgpu and on the reference executor: logits and KV caches within 1e-4 of the
reference's largest magnitude (both compute in float32 from the same bytes; only summation order
differs), and a decode layer in at most 7 dispatches (the norms before the q/k/v and gate/up
products are their prologues: test_wgpu_norm_prologue.py), fewer than the same lowering makes
without the planner's fusions (both numbers printed; 15 with the gemv kernels' sibling linears and
residual epilogues, 19 before those).

Runs on any wgpu adapter (software Vulkan in CI).
"""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest

from gpudelegate import shaders
from gpudelegate.plan import plan_session
from gpudelegate.plan.fusion import sibling_groups
from gpudelegate.plan.types import DeviceLimits
from gpudelegate.webgpu import kernel, lowering, ops_fused

from conformance.cases import Case, Leaf, Op, build_program, golden, make_data, tolerance
from conformance.executors import environment_fixture

pytestmark = pytest.mark.wgpu

env = environment_fixture("wgpu")

LIM = DeviceLimits(name="test")


def _run(env, case: Case):
    """Run ``case`` on wgpu and check every output against its float64 golden at the conformance
    tolerances; returns the recorded chain as [(op, [entry points])], one per dispatch."""
    import gpudelegate

    data = make_data(case)
    prog, names = build_program(case, data)
    prog = gpudelegate.loads(prog.to_bytes())
    with env.session(prog, device="wgpu") as s:
        outs = s.run("forward", [data[n] for n in names])
        chain = [(n.op, [L.pipeline.label.split(":")[-1].strip() for L in n.launches])
                 for n in s.executor.recorded[0].nodes]
    rtol, atol = tolerance(case)
    for i, (g, w) in enumerate(zip(outs, golden(case, data))):
        np.testing.assert_allclose(np.asarray(g).astype(np.float64), w, rtol=rtol, atol=atol,
                                   err_msg=f"{case.id} output {i} ({chain})")
    return chain


def _of(chain, op: str):
    """The entry points of each dispatch of ``op``, in order."""
    return [e for o, e in chain if o == op]


def _fused_calls(case: Case):
    """The lowering's calls of ``case`` per dispatch (op, [KernelCall]), as the executor records
    them, for constants the recorded chain does not show."""
    data = make_data(case)
    prog, _ = build_program(case, data)
    plan = plan_session(prog, LIM)
    pp = plan.payloads[0]
    calls = lowering.select_all(pp, LIM, contiguous=sibling_groups(plan, LIM), fusions=ops_fused.plan_fusions(plan, 0))
    return [(d.op, c) for d, c in zip(pp.dispatches, calls)]


# ---------------------------------------------------------------------------- the WGSL side

_FUSED = ("add_rms", "silu_mul", "rope_kv", "gemv_cat")


def test_fused_entries_are_registered_and_fill_their_uniform():
    """Dawn refuses a pipeline constant the entry point does not use and a layout that differs from
    what it statically uses: tests/core/test_webgpu_lowering.py checks every ENTRIES row against
    the WGSL (these included). Here: the rows exist, every call of them (from the cases below)
    packs exactly the WGSL's FusedParams and binds exactly the declared slots."""
    src = shaders.source("fused.wgsl")
    for e in _FUSED:
        assert kernel.ENTRIES[e].shader == "fused.wgsl" and re.search(r"fn\s+" + e + r"\s*\(", src), e
        assert max(kernel.ENTRIES[e].slots) <= kernel.MAX_SLOT
    n = int(re.search(r"struct FusedParams\s*\{\s*w:\s*array<vec4<u32>,\s*(\d+)>", src).group(1))
    assert 4 * n == ops_fused.UNIFORM_WORDS
    seen = set()
    for case in (_add_rms_case(17, 67), _silu_mul_case(1, 37), _gate_up_case(1), _attention_front(1)):
        for _, calls in _fused_calls(case):
            for c in calls:
                if c.shader == "fused.wgsl":
                    assert len(c.uniform) == 16 * n, c.entry
                    assert tuple(b.binding for b in c.bindings) == kernel.ENTRIES[c.entry].slots
                    seen.add(c.entry)
    assert seen == set(_FUSED)


# ---------------------------------------------------------------------------- add + rms_norm

def _add_rms_case(T, L, storage="float32", weight=True, lead=()):
    shape = tuple(lead) + (T, L)
    leaves = [Leaf("x", "float", shape), Leaf("y", "float", shape)]
    args = ["s"]
    if weight:
        leaves.append(Leaf("w", "float", (L,), gen="positive", kind="prepack"))
        args.append("w")
    return Case(f"fused/add_rms_{T}x{L}_{storage}_{'w' if weight else 'nw'}", leaves,
                [Op("add", ["x", "y"], out="s"), Op("rms_norm", args, {"eps": 1e-5}, out="h")], ["h", "s"],
                storage=storage, red=L)


@pytest.mark.parametrize("T", [1, 17])
@pytest.mark.parametrize("storage,L", [("float32", 67), ("float16", 58)])
@pytest.mark.parametrize("weight", [True, False])
def test_add_rms_norm(env, T, storage, L, weight):
    chain = _run(env, _add_rms_case(T, L, storage, weight, lead=(1,) if T == 17 else ()))
    assert _of(chain, "add") == [[]] and _of(chain, "rms_norm") == [["add_rms"]], chain


def test_add_rms_norm_float16_odd_rows_run_apart(env):
    # rows of 67 float16 elements share words between workgroups: the kernel declines, the ops run
    chain = _run(env, _add_rms_case(17, 67, "float16"))
    assert _of(chain, "add") == [["map"]] and "add_rms" not in _of(chain, "rms_norm")[0], chain


@pytest.mark.parametrize("x_first", [True, False])
def test_add_rms_norm_output_over_an_input(env, x_first):
    """The planner gives h the storage of an addend whose last reader is the add: the kernel reads
    that addend through h's binding (one binding, no overlapping pair), position by position."""
    L = 29
    leaves = [Leaf("a", "float", (17, L)), Leaf("y", "float", (17, L)), Leaf("w", "float", (L,), kind="prepack")]
    add = ["x", "y"] if x_first else ["y", "x"]
    case = Case(f"fused/add_rms_alias_{x_first}", leaves,
                [Op("neg", ["a"], out="x"), Op("add", add, out="s"), Op("rms_norm", ["s", "w"], out="h"),
                 Op("mul", ["h", "y"], out="z"), Op("mul", ["z", "a"], out="z2")], ["z2", "s"], red=L)
    (_, (call,)), = [(op, c) for op, c in _fused_calls(case) if op == "rms_norm"]
    assert call.entry == "add_rms" and 1 in (call.constants["X_AT"], call.constants["Y_AT"]), call.constants
    chain = _run(env, case)
    assert _of(chain, "rms_norm") == [["add_rms"]] and _of(chain, "add") == [[]], chain


# ---------------------------------------------------------------------------- silu * mul

def _silu_mul_case(T, N, storage="float32", silu_first=True):
    mul = ["a", "u"] if silu_first else ["u", "a"]
    return Case(f"fused/silu_mul_{T}x{N}_{storage}_{silu_first}", [Leaf("g", "float", (T, N)), Leaf("u", "float", (T, N))],
                [Op("silu", ["g"], out="a"), Op("mul", mul, out="o")], ["o"], storage=storage)


@pytest.mark.parametrize("T", [1, 17])
@pytest.mark.parametrize("storage,N", [("float32", 37), ("float16", 38)])
@pytest.mark.parametrize("silu_first", [True, False])
def test_silu_mul(env, T, storage, N, silu_first):
    chain = _run(env, _silu_mul_case(T, N, storage, silu_first))
    assert _of(chain, "silu") == [[]] and _of(chain, "mul") == [["silu_mul"]], chain


def test_silu_mul_output_over_its_gate(env):
    case = Case("fused/silu_mul_alias", [Leaf("a", "float", (17, 29)), Leaf("u", "float", (17, 29))],
                [Op("neg", ["a"], out="g"), Op("silu", ["g"], out="sg"), Op("mul", ["sg", "u"], out="o"),
                 Op("neg", ["o"], out="z")], ["z"])
    (_, (call,)), = [(op, c) for op, c in _fused_calls(case) if op == "mul"]
    assert call.constants["G_AT"] == 1, call.constants  # out is g's storage: read where written
    chain = _run(env, case)
    assert _of(chain, "silu") == [[]] and _of(chain, "mul") == [["silu_mul"]], chain


# ---------------------------------------------------------------------------- gate / up (gemm_cat)

def _gate_up_case(T, weights="prepack", x_live=True, N=37, K=72):
    """silu(x @ wg^T) * (x @ wu^T). N = 37 (prime) with K = 72 keeps each weight a 16-byte
    multiple (cat_candidates) in float16 too; K = 67 (N = 44) is no whole number of 16-byte chunks.
    ``x_live``: x is read after the MLP (as a residual stream is), so the planner cannot give the
    output x's storage."""
    ops = [Op("linear", ["x", "wg", None], out="g"), Op("linear", ["x", "wu", None], out="u"),
           Op("silu", ["g"], out="a"), Op("mul", ["a", "u"], out="o")]
    if x_live:
        ops.append(Op("neg", ["x"], out="xn"))
    return Case(f"fused/gate_up_{T}_{weights}_{x_live}_{N}x{K}",
                [Leaf("x", "float", (1, T, K)), Leaf("wg", "float", (N, K), kind=weights),
                 Leaf("wu", "float", (N, K), kind=weights)], ops, ["o", "xn"] if x_live else ["o"], red=K)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("weights,N,K", [("prepack", 37, 72), ("prepack_fp16", 37, 72), ("prepack", 44, 67)])
def test_gate_up_decode_is_one_dispatch(env, T, weights, N, K):
    case = _gate_up_case(T, weights, N=N, K=K)
    (_, (call,)), = [(op, c) for op, c in _fused_calls(case) if op == "mul"]
    assert call.constants["VEC"] == (K == 72) and call.constants["GM"] == T, call.constants
    chain = _run(env, case)
    assert _of(chain, "linear") == [[], []] and _of(chain, "silu") == [[]], chain
    assert _of(chain, "mul") == [["gemv_cat"]], chain  # both products and silu * mul


def test_gate_up_decode_over_its_input_takes_two_dispatches(env):
    """The planner may give the output x's storage (x dies at the products): one dispatch would
    overwrite x while other workgroups still read it, so the products go to scratch first."""
    case = _gate_up_case(1, x_live=False)
    (_, calls), = [(op, c) for op, c in _fused_calls(case) if op == "mul"]
    chain = _run(env, case)
    assert _of(chain, "mul") == [["gemv_cat", "silu_mul"]], chain
    assert [c.constants["EPI"] for c in calls[:1]] == [0]


def test_gate_up_prefill_reads_the_concatenated_product(env):
    chain = _run(env, _gate_up_case(17))
    assert _of(chain, "linear") == [[], []] and _of(chain, "silu") == [[]], chain
    (mul,) = _of(chain, "mul")
    assert mul[-1] == "silu_mul" and all(e.startswith("mm") for e in mul[:-1]) and len(mul) > 1, chain
    (_, calls), = [(op, c) for op, c in _fused_calls(_gate_up_case(17)) if op == "mul"]
    assert calls[-1].constants["U_AT"] == 2  # gate and up in one scratch, one binding


# ---------------------------------------------------------------------------- rope + KV cache

def _attention_front(T, storage="float32", bias=False, D=22, H=6, Hk=2, S=37, E=68, weights="float"):
    """x -> q/k/v linears -> [1, T, heads, D] -> [1, heads, T, D] -> rope(q), rope(k) -> k and v
    written into caches at pos 5 (grouped-query heads: H = 3 Hk). ``weights``: their dtype (a
    packed type needs E a multiple of 32)."""
    leaves = [Leaf("x", "float", (1, T, E)), Leaf("kc", "float", (1, Hk, S, D)), Leaf("vc", "float", (1, Hk, S, D)),
              Leaf("pos", "int32", (1,), gen="value", lo=5),
              Leaf("cos", "float", (T, D), gen="angle"), Leaf("sin", "float", (T, D), gen="angle")]
    ops = []
    for name, heads in (("q", H), ("k", Hk), ("v", Hk)):
        leaves.append(Leaf(f"w{name}", weights, (heads * D, E), kind="prepack"))
        args = ["x", f"w{name}", None]
        if bias:
            leaves.append(Leaf(f"b{name}", "float", (heads * D,), kind="prepack"))
            args[2] = f"b{name}"
        ops += [Op("linear", args, out=f"{name}l"), Op("reshape", [f"{name}l"], {"shape": [1, T, heads, D]}, out=f"{name}4"),
                Op("permute", [f"{name}4"], {"dims": [0, 2, 1, 3]}, out=f"{name}h")]
    ops += [Op("rope", ["qh", "cos", "sin"], out="qr"), Op("rope", ["kh", "cos", "sin"], out="kr"),
            Op("kv_update", ["kc", "kr", "pos"], out="kc2"), Op("kv_update", ["vc", "vh", "pos"], out="vc2")]
    return Case(f"fused/rope_kv_{T}_{storage}_{'bias' if bias else 'cat'}_{D}_{weights}", leaves, ops,
                ["qr", "kc2", "vc2"], storage=storage, red=E)


@pytest.mark.parametrize("T", [1, 17])
def test_rope_kv_with_gemm_cat(env, T):
    chain = _run(env, _attention_front(T))
    first, last = _of(chain, "kv_update")  # the group runs at its last member, the rest run nothing
    assert first == [] and _of(chain, "rope") == [[], []] and _of(chain, "permute") == [[], [], []], chain
    assert _of(chain, "linear") == [[], [], []], chain
    if T == 1:  # the three products into the concatenated row, then rope_kv
        assert last == ["gemv_cat", "rope_kv"], chain
    else:  # the products (q; k and v as one batched product) into the scratch, then rope_kv
        assert last[-1] == "rope_kv" and all(e.startswith("mm") for e in last[:-1]), chain


def _projected_front(T, D=22, H=6, Hk=2, S=37):
    """The projections as inputs [1, T, heads * D] (no product to concatenate): rope_kv jobs read
    them through the reshape and permute, each from its own tensor."""
    leaves = [Leaf("kc", "float", (1, Hk, S, D)), Leaf("vc", "float", (1, Hk, S, D)),
              Leaf("pos", "int32", (1,), gen="value", lo=5),
              Leaf("cos", "float", (T, D), gen="angle"), Leaf("sin", "float", (T, D), gen="angle")]
    ops = []
    for name, heads in (("q", H), ("k", Hk), ("v", Hk)):
        leaves.append(Leaf(f"{name}l", "float", (1, T, heads * D)))
        ops += [Op("reshape", [f"{name}l"], {"shape": [1, T, heads, D]}, out=f"{name}4"),
                Op("permute", [f"{name}4"], {"dims": [0, 2, 1, 3]}, out=f"{name}h")]
    ops += [Op("rope", ["qh", "cos", "sin"], out="qr"), Op("rope", ["kh", "cos", "sin"], out="kr"),
            Op("kv_update", ["kc", "kr", "pos"], out="kc2"), Op("kv_update", ["vc", "vh", "pos"], out="vc2")]
    return Case(f"fused/rope_kv_inputs_{T}", leaves, ops, ["qr", "kc2", "vc2"], red=D)


def _groups(case: Case):
    data = make_data(case)
    prog, _ = build_program(case, data)
    plan = plan_session(prog, LIM)
    return ops_fused.plan_fusions(plan, 0)


@pytest.mark.parametrize("T", [1, 17])
def test_rope_kv_reads_its_jobs_own_sources(env, T):
    """Without a concatenated product each job reads its projection where the plan put it (one
    binding over the buffer they share). Whatever jobs the planner groups run as one dispatch at
    the group's last member; a job it leaves out runs its ops."""
    case = _projected_front(T)
    fs = [f for f in _groups(case) if f.kind == "rope_kv"]
    assert fs and all(not f.cat for f in fs)
    chain = _run(env, case)
    for f in fs:
        assert chain[f.at][1] == ["rope_kv"], chain
        assert all(chain[k][1] == [] for k in f.members if k != f.at), chain


def test_rope_kv_refused_by_the_planner_runs_apart(env):
    """Biased projections take no part in a concatenated product, and here the memory planner gave
    the k projection the storage of q's (dead once q's permute copied it): ``match`` refuses a
    rope_kv group reading them at its end, and the ops run apart, still right."""
    case = _attention_front(17, bias=True)
    assert not [f for f in _groups(case) if f.kind == "rope_kv"]
    chain = _run(env, case)
    assert _of(chain, "rope") == [["rope"], ["rope"]], chain


@pytest.mark.parametrize("T", [1, 17])
def test_rope_kv_float16(env, T):
    chain = _run(env, _attention_front(T, storage="float16", D=20))
    assert _of(chain, "kv_update")[-1][-1] == "rope_kv" and _of(chain, "rope") == [[], []], chain


def test_rope_kv_uniform_and_jobs():
    """One dispatch writes q (contiguous), k and v (cache rows): three jobs, q's six heads three
    per kv head, read from the concatenated product's scratch at its column blocks."""
    (_, calls), = [(op, c) for op, c in _fused_calls(_attention_front(1)) if op == "kv_update" and c]
    gemv, rope = calls
    assert gemv.entry == "gemv_cat" and gemv.constants["NP"] == 3 and rope.entry == "rope_kv"
    w = struct.unpack(f"<{ops_fused.UNIFORM_WORDS}I", rope.uniform)
    assert w[:3] == (1, 22, 37) and w[7] == 3  # T, D, S; jobs
    jobs = [w[8 + 8 * j: 16 + 8 * j] for j in range(3)]
    assert [j[1] for j in jobs] == [6, 2, 2]  # heads
    assert [j[7] for j in jobs] == [2, 3, 1]  # q: rope; k: rope + cache; v: cache
    assert [j[0] for j in jobs] == [0, 6, 8] and w[6] == 10  # first rows, all rows
    assert [j[2] for j in jobs] == [0, 132, 176]  # column blocks of the row [6D | 2D | 2D] ...
    assert [j[4] for j in jobs] == [22, 22, 22]  # ... a head D further along it
    assert len(rope.uniform) == 4 * ops_fused.UNIFORM_WORDS


# ---------------------------------------------------------------------------- packed weights (gemm_cat)
# The planner concatenates packed (GGUF block) weights of one type and K as it does float ones;
# ops_quant's kernels carry the group out: qgemv_cat for up to 8 rows (the concatenated row the
# rope_kv reads, or silu(g) * u in the same dispatch), one qgemv / qmm product per weight into its
# column block of the scratch for more. K = 256 keeps every weight a 16-byte multiple in all three
# types (cat_candidates); tolerances are the conformance ones of float32 activations (the golden
# reads gguf's dequantized float32 weights: conformance.cases.tolerance).

PACKED = ("q4_0", "q4_1", "q8_0")


def _packed_gate_up_case(qt, T, N=37, K=256, x_live=True):
    ops = [Op("linear", ["x", "wg", None], out="g"), Op("linear", ["x", "wu", None], out="u"),
           Op("silu", ["g"], out="a"), Op("mul", ["a", "u"], out="o")]
    if x_live:
        ops.append(Op("neg", ["x"], out="xn"))
    return Case(f"fused/gate_up_packed_{qt}_{T}_{x_live}_{N}x{K}",
                [Leaf("x", "float", (1, T, K)), Leaf("wg", qt, (N, K), kind="prepack"),
                 Leaf("wu", qt, (N, K), kind="prepack")], ops, ["o", "xn"] if x_live else ["o"], red=K)


@pytest.mark.parametrize("qt", PACKED)
@pytest.mark.parametrize("T", [1, 3, 8, 17])
def test_packed_gate_up(env, qt, T):
    case = _packed_gate_up_case(qt, T)
    chain = _run(env, case)
    assert _of(chain, "linear") == [[], []] and _of(chain, "silu") == [[]], chain
    (mul,) = _of(chain, "mul")
    if T <= 8:  # both products and silu * mul in one dispatch
        assert mul == ["qgemv_cat"], chain
    else:  # a packed product per weight into the concatenation, then silu * mul reading it
        assert mul[-1] == "silu_mul" and len(mul) >= 3 and all(e.startswith("qmm") for e in mul[:-1]), chain
        (_, calls), = [(op, c) for op, c in _fused_calls(case) if op == "mul"]
        assert calls[-1].constants["U_AT"] == 2  # gate and up in one scratch, one binding


def test_packed_gate_up_over_its_input_takes_two_dispatches(env):
    """out over x's storage: the products go to the scratch first (concatenated qgemv_cat), then
    silu_mul, as for float weights."""
    chain = _run(env, _packed_gate_up_case("q4_1", 1, x_live=False))
    assert _of(chain, "mul") == [["qgemv_cat", "silu_mul"]], chain


@pytest.mark.parametrize("qt", PACKED)
@pytest.mark.parametrize("T", [1, 3, 8, 17])
def test_packed_rope_kv_with_gemm_cat(env, qt, T):
    chain = _run(env, _attention_front(T, E=256, weights=qt))
    first, last = _of(chain, "kv_update")
    assert first == [] and _of(chain, "rope") == [[], []] and _of(chain, "linear") == [[], [], []], chain
    if T <= 8:  # q, k and v in one dispatch into the concatenated row, then rope_kv
        assert last == ["qgemv_cat", "rope_kv"], chain
    else:
        assert last[-1] == "rope_kv" and all(e.startswith("qmm") for e in last[:-1]) and len(last) >= 4, chain


def test_packed_cat_uniform():
    """qgemv_cat's QParams: 36 words as quant_mm.wgsl declares them; three weights in bindings
    W, OUT1, OUT2 (slots 3, 6, 7), rows 132 / 44 / 44, the concatenated row 220 long."""
    (_, calls), = [(op, c) for op, c in _fused_calls(_attention_front(1, E=256, weights="q8_0")) if op == "kv_update" and c]
    gemv, rope = calls
    assert gemv.entry == "qgemv_cat" and gemv.constants["CAT"] == 1 and gemv.constants["QT"] == 2
    src = shaders.source("quant_mm.wgsl")
    body = re.search(r"struct QParams\s*\{([^}]*)\}", src).group(1)
    assert len(gemv.uniform) == 4 * len(re.findall(r":\s*u32", body)) == 144
    w = struct.unpack("<36I", gemv.uniform)
    assert w[:6] == (1, 256, 8, 0, 220, 220) and w[14] == 220  # M, K, blocks, columns 0..220, c_sm
    assert w[15] == (0 | 1 << 2 | 2 << 4) and w[18:20] == (132, 44)  # weight p in binding p; rows of q, k
    assert sorted(b.binding for b in gemv.bindings) == [1, 2, 3, 6, 7]


# ---------------------------------------------------------------------------- a SmolLM2-shaped model

@pytest.fixture(scope="module")
def smollm2_program():
    torch = pytest.importorskip("torch")
    S = pytest.importorskip("gpudelegate.export.models.smollm2")
    from gpudelegate.export.writer import export_program

    import gpudelegate

    torch.manual_seed(0)
    cfg = S.SmolLM2Config(vocab_size=512, layers=2, max_context=64, prefill_chunk=16)
    m = S.SmolLM2(cfg).eval()
    with torch.no_grad():  # norm weights away from 1, so a dropped weight shows
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    prog = export_program({"prefill": (S.Prefill(m), S.example_inputs(cfg, "prefill")),
                           "decode": (S.Decode(m), S.example_inputs(cfg, "decode"))})
    return cfg, gpudelegate.loads(prog.to_bytes())


def _generate(s, cfg):
    """One 16-token prefill chunk (12 real tokens), then 3 greedy decode steps on session ``s``;
    the logits of each call and the final caches."""
    caches = [np.zeros((1, cfg.kv_heads, cfg.max_context, cfg.head_dim), np.float32) for _ in range(2 * cfg.layers)]
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, cfg.prefill_chunk)).astype(np.int32)
    outs = s.run("prefill", [ids, np.array([0], np.int32), np.array([11], np.int32)] + caches)
    logits = [np.asarray(outs[0], np.float64)]
    caches = [np.asarray(c) for c in outs[1:]]
    for pos in range(12, 15):
        tok = np.array([[int(logits[-1].argmax())]], np.int32)
        outs = s.run("decode", [tok, np.array([pos], np.int32)] + caches)
        logits.append(np.asarray(outs[0], np.float64))
        caches = [np.asarray(c) for c in outs[1:]]
    return logits, caches


def _per_layer(pp, calls) -> int:
    """Kernel calls of one decoder layer: from the first attention to the second (the layer's
    attention, its MLP, and the next layer's norm and projections)."""
    at = [k for k, d in enumerate(pp.dispatches) if d.op == "sdpa"]
    return sum(len(c) for c in calls[at[0]:at[1]])


def test_smollm2_matches_the_reference_with_fewer_dispatches(env, smollm2_program):
    cfg, prog = smollm2_program
    with env.session(prog, device="reference") as s:
        ref_logits, ref_caches = _generate(s, cfg)
    with env.session(prog, device="wgpu") as s:
        logits, caches = _generate(s, cfg)
        _check_dispatches(s.executor, prog, cfg)
    for i, (a, b) in enumerate(zip(ref_logits, logits)):
        rel = np.abs(a - b).max() / np.abs(a).max()
        assert rel <= 1e-4, f"call {i} ({'prefill' if i == 0 else 'decode'}): logits off by {rel:.3g} of their scale"
        assert a.argmax() == b.argmax()
    for a, b in zip(ref_caches, caches):
        assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()


def _check_dispatches(ex, prog, cfg):
    plan = ex.plan
    for method, want in (("decode", 7), ("prefill", None)):
        p = _payload_of(prog, method)
        pp = plan.payloads[p]
        fs = ops_fused.plan_fusions(plan, p)
        kinds = sorted(f.kind + ("+gemm_cat" if f.cat else "") for f in fs)
        members = [k for f in fs for k in f.members]
        assert len(members) == len(set(members)), "a dispatch in two fusions"
        after = lowering.select_all(pp, ex.limits, ex.device.features, ex.tuning, contiguous=ex._contiguous, fusions=fs)
        before = lowering.select_all(pp, ex.limits, ex.device.features, ex.tuning, contiguous=ex._contiguous,
                                     fusions=[])
        assert sum(map(len, after)) == ex.recorded[p].dispatch_count  # what the session recorded
        b, a = _per_layer(pp, before), _per_layer(pp, after)
        print(f"SmolLM2 {method}: {b} dispatches per layer without the planner's fusions, {a} with them "
              f"({sum(map(len, before))} -> {sum(map(len, after))} per call; fusions {kinds})")
        assert a < b
        if want is not None:
            assert a <= want
            # every norm before a product is that product's prologue (layer 0's without an add);
            # only the final add + norm, before the lone LM head, is a kernel of its own
            assert kinds.count("add_rms_norm") == 1 and sum(1 for f in fs if f.norm) == 2 * cfg.layers
            assert kinds.count("rope_kv+gemm_cat") == kinds.count("silu_mul+gemm_cat") == cfg.layers
            entries = [c.entry for calls in after for c in calls]
            assert entries.count("add_rms") == 1 and "add_rms" not in entries[:-3]  # the final norm alone
            assert entries.count("gemv_cat_norm") + entries.count("qgemv_cat_norm") == 2 * cfg.layers
        else:
            assert not any(f.norm for f in fs)  # prefill rows: more than PROLOGUE_MAX_ROWS
        for f in fs:  # a group runs at its last member; the others run nothing
            assert all(after[k] == [] for k in f.members if k != f.at), f


def _payload_of(prog, method: str) -> int:
    (node,) = [n for n in prog.methods[method].nodes if n.op == "delegate"]
    return node.attrs["payload"]
