"""The packed-weight decode products with subgroup sums (shaders/quant_mm_sg.wgsl: qgemv,
qgemv_cat, qgemv_cat_norm) beside quant_mm.wgsl's workgroup trees, against the float64 reference.

quant_mm_sg.wgsl checks at run time that a lane's subgroup is exactly its weight row and sums
through workgroup memory where it is not; the lowering gives a row as many lanes as the device's
subgroups have (``GPUDevice.subgroup_size()``, measured: llvmpipe runs 8 on 256-bit vectors, NVIDIA
32). These layouts cover both paths:

- ``measured``: the default: a row per subgroup, two rows per workgroup (the barrier-free sum);
- ``lanes-32``: ``Tuning(qgemv_sg_lanes=32)``, one row per workgroup: on llvmpipe a row spans
  four subgroups (on NVIDIA it is one);
- ``lanes-4x4``: 4 lanes, 4 rows: a subgroup spans several rows (both take the workgroup-memory sum);
- ``lanes-8x3``: 3 rows (gate / up pairs round it to 4);
- ``tree``: ``Tuning(qgemv_subgroups=False)``, quant_mm.wgsl;
- ``pairs`` / ``pairs-4x3``: ``qgemv_pair_min_groups=1``: a plain qgemv whose rows take one loop
  trip, with at most 4 rows of x, gives each thread row two weight rows (RPT 2; the LM head's
  default): on NVIDIA at K = 544 (one subgroup a row), with 4 lanes at K = 96 (3 rows a workgroup:
  N = 37 leaves a last workgroup with a thread row whose second row does not exist).

The loop trip shapes come with them: three units a lane and trip (measured layout at K = 544 on
NVIDIA: one trip; on llvmpipe's 8 lanes: three trips; 4 lanes at K = 96), four (4 lanes at
K = 544), two (K = 96 elsewhere).

Shapes: M = 1, 3 and 8 rows, K = 96 and 544 (3 and 17 blocks: one and several loop trips per
lane), N = 37 (prime; gate / up 44: rows whose weights the executor can place back to back).
Tolerances are the conformance suite's (float32 rtol 1e-4, atol 1e-5
sqrt(K)): the kernels differ from the reference only in the order of the sums. Greedy decoding
of a q4_1 model on the subgroup kernels gives the reference's ids. test_dawn_quant_subgroups.py
runs the same cases on Dawn (Tint, which needs ``enable subgroups;``).
"""

from __future__ import annotations

import numpy as np
import pytest

import gpudelegate
from gpudelegate.environment import Environment
from gpudelegate.webgpu import lowering
from gpudelegate.webgpu.device import wgsl_dialect

from conformance.cases import Case, Leaf, Op, build_program, golden, make_data, tolerance
from test_wgpu_norm_prologue import _attention, _gate_up

pytestmark = pytest.mark.wgpu

SG = "quant_mm_sg.wgsl"
PLAIN = "quant_mm.wgsl"
T = lowering.Tuning
# (id, device kind, tuning, module the packed decode products run in)
LAYOUTS = [("measured", "{kind}", None, SG),
           ("lanes-32", "{kind}", T(qgemv_sg_lanes=32, qgemv_sg_rows=1), SG),
           ("lanes-4x4", "{kind}", T(qgemv_sg_lanes=4, qgemv_sg_rows=4), SG),
           ("lanes-8x3", "{kind}", T(qgemv_sg_lanes=8, qgemv_sg_rows=3), SG),
           ("tree", "{kind}", T(qgemv_subgroups=False), PLAIN),
           ("pairs", "{kind}", T(qgemv_pair_min_groups=1), SG),
           ("pairs-4x3", "{kind}", T(qgemv_sg_lanes=4, qgemv_sg_rows=3, qgemv_pair_min_groups=1), SG)]
LAYOUT_IDS = [lay[0] for lay in LAYOUTS]


@pytest.fixture(scope="module")
def env(wgpu_adapter):
    e = Environment()
    yield e
    e.close()


def run_case(env, case: Case, device: str, tuning=None):
    """Run ``case``, check every output against its float64 golden; returns {op: [shader:entry]}."""
    data = make_data(case)
    prog, names = build_program(case, data)
    prog = gpudelegate.loads(prog.to_bytes())
    with env.session(prog, device=device, **({"tuning": tuning} if tuning else {})) as s:
        outs = [np.asarray(o).astype(np.float64) for o in s.run("forward", [data[n] for n in names])]
        entries = {}
        for n in s.executor.recorded[0].nodes:
            entries.setdefault(n.op, []).extend(L.pipeline.label for L in n.launches)
    rtol, atol = tolerance(case)
    for i, (g, w) in enumerate(zip(outs, golden(case, data))):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{case.id} output {i} on {device} {tuning}")
    return entries


def linear_case(qt: str, m: int, k: int, n: int = 37, gelu: bool = False) -> Case:
    leaves = [Leaf("x", "float", (m, k)), Leaf("w", qt, (n, k), kind="prepack"),
              Leaf("b", "float", (n,), kind="prepack")]
    ops = [Op("linear", ["x", "w", "b" if m % 2 else None], out="h")]
    if gelu:
        ops.append(Op("gelu", ["h"], {"approximate": "none"}, out="y"))
    return Case(f"quant_sg/linear/{qt}_{m}x{k}_{n}{'_gelu' if gelu else ''}", leaves, ops, ["y" if gelu else "h"], red=k)


def check_layout(env, kind: str, layout, case: Case, op: str, entry: str) -> None:
    _id, device, tuning, module = layout
    entries = run_case(env, case, device.format(kind=kind), tuning)
    assert entries[op][0] == f"{module}:{entry}", (layout, entries)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("qt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("m,k", [(1, 96), (3, 544), (8, 96)])
def test_qgemv(env, layout, qt, m, k):
    check_layout(env, "wgpu", layout, linear_case(qt, m, k, gelu=m == 3), "linear", "qgemv")


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("k", [96, 544])
def test_gate_up_and_qkv_with_the_norm_prologue(env, layout, rows, k):
    """qgemv_cat_norm CAT 2 (silu(gate) * up after add + rms_norm) and qgemv_rope (q | k | v with
    the rope and the cache writes as its stores); a plain norm (no add) for one shape."""
    check_layout(env, "wgpu", layout, _gate_up(rows, k, 44, "q4_1"), "mul", "qgemv_cat_norm")
    check_layout(env, "wgpu", layout, _attention(rows, k, "q4_1", add=rows != 3), "kv_update", "qgemv_rope")


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_concatenated_products_without_a_prologue(env, layout):
    """qgemv_cat over q, k and v whose input is no norm's output (CAT 1 without NORM)."""
    case = _attention(3, 96, "q8_0", add=False)
    case.ops[:] = [o for o in case.ops if o.op != "rms_norm"]
    for o in case.ops:
        o.args[:] = ["x" if a == "h" else a for a in o.args]
    case.leaves[:] = [lf for lf in case.leaves if lf.name != "wn"]
    check_layout(env, "wgpu", layout, case, "kv_update", "qgemv_cat")


def test_the_default_follows_the_measured_subgroup_size(env):
    """The device measures its subgroups (a power of two in 4..128 on a device with the feature);
    rows get that many lanes by default."""
    size = env.context("wgpu").subgroup_size()
    assert size in (4, 8, 16, 32, 64, 128), size
    case = linear_case("q4_1", 1, 96)
    data = make_data(case)
    prog, _names = build_program(case, data)
    ctx = env.context("wgpu")
    with env.session(gpudelegate.loads(prog.to_bytes()), device="wgpu") as s:
        launches = [L for n in s.executor.recorded[0].nodes for L in n.launches]
        assert [L.pipeline.label for L in launches] == [f"{SG}:qgemv"]
        keys = [k for k, p in ctx._pipelines.items() if p is launches[0].pipeline]  # (shader, entry, constants, slots)
        assert len(keys) == 1 and dict(keys[0][2])["TPR"] == size and dict(keys[0][2])["ROWS"] == lowering.Tuning().qgemv_sg_rows, keys


# ---------------------------------------------------------------------------- pure parts

def test_the_enable_line_is_dropped_for_naga_only():
    code = "enable subgroups;\nfn f() {}\n"
    assert wgsl_dialect(code, {"subgroup"}) == "// enable subgroups;\nfn f() {}\n"  # wgpu-native's feature name
    assert wgsl_dialect(code, {"subgroups"}) == code  # Dawn and browsers: WebGPU's
    assert wgsl_dialect(code, {"subgroups", "subgroup"}) == code
    assert wgsl_dialect(code, ()) == code  # never chosen there; left as written


def test_units_a_trip_are_the_fewest_for_the_fewest_trips():
    from gpudelegate.webgpu.ops_quant import _row_consts

    assert _row_consts(32, 3, SG) == {"UPL": 2}  # 12 units: one trip of two
    assert _row_consts(32, 18, SG) == {"UPL": 3}  # K = 576: 72 units, one trip of three (not four)
    assert _row_consts(32, 48, SG) == {"UPL": 3}  # K = 1536: 192 units, two trips of three
    assert _row_consts(32, 128, SG) == {"UPL": 4}  # K = 4096: four trips of four (six of three)
    assert _row_consts(36, 18, None) == {"TP2": 64}


def test_bad_lane_counts_are_refused(env):
    for lanes, rows in ((12, 1), (2, 1), (256, 1), (64, 8)):
        with pytest.raises(ValueError, match="qgemv_sg_lanes"):
            run_case(env, linear_case("q4_1", 1, 96), "wgpu", T(qgemv_sg_lanes=lanes, qgemv_sg_rows=rows))


# ---------------------------------------------------------------------------- greedy decoding

def tiny_q4_1_lm():
    """tests/greedy_program.py's one-layer SmolLM2-shaped LM with its linears in q4_1."""
    from greedy_program import tiny_causal_lm

    return tiny_causal_lm(weights_dtype="q4_1")


def check_greedy(env, device: str, tuning=None) -> None:
    """A 20-token prompt decoded to the context's end: the reference's ids; the decode step's
    packed products ran in the subgroup module."""
    pytest.importorskip("torch")
    from gpudelegate.llm import generate
    from greedy_program import CONTEXT, V, IdsTokenizer

    prog = gpudelegate.loads(tiny_q4_1_lm().to_bytes())
    tok = IdsTokenizer()
    prompt = [int(x) for x in np.random.default_rng(2).integers(0, V, 20)]
    opts = {"tuning": tuning} if tuning else {}
    with env.session(prog, device=device, **opts) as g, env.session(prog, device="reference") as r:
        want = generate(r, tok, prompt, max_new_tokens=CONTEXT + 1, stop_ids=(), lookahead=None)
        for la in (None, 0, 2):  # host-picked, and picked on the device with 0 and 2 steps ahead
            got = generate(g, tok, prompt, max_new_tokens=CONTEXT + 1, stop_ids=(), lookahead=la)
            assert got.ids == want.ids, (la, got.ids, want.ids)
        assert len(set(want.ids)) >= 3, want.ids  # tokens that vary
        pid = prog.methods["decode"].nodes[0].attrs["payload"]
        labels = [L.pipeline.label for n in g.executor.recorded[pid].nodes for L in n.launches]
        assert {f"{SG}:qgemv", f"{SG}:qgemv_cat_norm"} <= set(labels), labels


def test_greedy_ids_on_the_subgroup_kernels(env):
    check_greedy(env, "wgpu")


def test_greedy_ids_with_two_rows_a_thread_row(env):
    """Every qgemv that can pairs its rows (the LM head's RPT 2, on NVIDIA's 32 lanes at K = 576)."""
    check_greedy(env, "wgpu", T(qgemv_pair_min_groups=1))


def test_a_failed_measurement_leaves_the_plain_kernels(wgpu_adapter, monkeypatch):
    """Where the measuring dispatch fails (a page that can only await), the size is 0 and the
    packed decode products run quant_mm.wgsl."""
    from gpudelegate.native.wgpu_device import WgpuContext

    def refuse(*_a, **_k):
        raise RuntimeError("no synchronous runs here")

    with Environment() as e:
        ctx = e.context("wgpu")  # a fresh context: nothing measured yet
        assert isinstance(ctx, WgpuContext)
        with monkeypatch.context() as m:
            m.setattr(ctx, "run_chain", refuse)
            assert ctx.subgroup_size() == 0
        assert ctx.subgroup_size() == 0  # measured once: the failure stays for the device
        assert run_case(e, linear_case("q4_1", 1, 96), "wgpu")["linear"] == [f"{PLAIN}:qgemv"]
