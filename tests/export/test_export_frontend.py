"""Export frontend and ATen table: every table entry against PyTorch in float64, plus the graph
form (folded transposes, export-time constant folding, dtype narrowing) and the errors.

Each case is exported, written to bytes, loaded back (so the loader's checks run), executed on the
numpy reference executor on fresh random inputs, and compared with the same module run by torch
in float64. Tolerance: max |err| <= 2e-5 * max(1, max |ref|): float32 has a unit roundoff of 6e-8
and the deepest reduction here sums ~100 terms, so ~1e-5 relative is the expected worst case.
Integer and bool outputs must match exactly.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gpudelegate
from gpudelegate.errors import ExportError
from gpudelegate.export import GpuDelegatePartitioner, export_method, export_program, lower

FP32_TOL = 2e-5


# ------------------------------------------------------------------------------ helpers (shared)

def run_reference(program, inputs, method="forward"):
    """Round-trip ``program`` through bytes and run ``method`` on the reference executor."""
    prog = gpudelegate.loads(program.to_bytes())
    with gpudelegate.Environment() as env:
        sess = env.session(prog, device="reference")
        outs = sess.run(method, [np.ascontiguousarray(x) for x in inputs])
        return [np.asarray(o) for o in outs]


def torch_float64(module, inputs):
    """The module's outputs computed in float64 (integer/bool inputs unchanged) as numpy arrays."""
    m64 = copy.deepcopy(module).double()
    xs = [x.double() if x.is_floating_point() else x for x in inputs]
    with torch.no_grad():
        out = m64(*xs)
    out = out if isinstance(out, (tuple, list)) else (out,)
    return [o.detach().numpy() for o in out]


def assert_close(got, ref, tol=FP32_TOL, what=""):
    assert len(got) == len(ref), f"{what}: {len(got)} outputs, torch has {len(ref)}"
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == r.shape, f"{what} output {i}: shape {g.shape} vs torch {r.shape}"
        if r.dtype.kind in "biu":
            np.testing.assert_array_equal(g.astype(np.int64), r.astype(np.int64), err_msg=f"{what} output {i}")
        else:
            err = np.abs(g.astype(np.float64) - r).max() if r.size else 0.0
            bound = tol * max(1.0, np.abs(r).max() if r.size else 0.0)
            assert err <= bound, f"{what} output {i}: max |err| {err:.3g} > {bound:.3g}"


def check_against_torch(module, inputs, tol=FP32_TOL, **kw):
    module = module.eval()
    prog = export_program(module, tuple(inputs), **kw)
    got = run_reference(prog, [x.numpy() for x in inputs])
    assert_close(got, torch_float64(module, inputs), tol, type(module).__name__)
    return prog


class Fn(nn.Module):
    """A module around a function, with optional named parameters/buffers for constants."""

    def __init__(self, fn, **tensors):
        super().__init__()
        self.fn = fn
        for k, v in tensors.items():
            if v.is_floating_point():
                setattr(self, k, nn.Parameter(v, requires_grad=False))
            else:
                self.register_buffer(k, v)

    def forward(self, *xs):
        return self.fn(self, *xs)


def rnd(*shape, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else hash(shape) % 10_000)
    return torch.randn(*shape, generator=g)


# ------------------------------------------------------------------------------ table vs torch

CASES = {
    "add_sub_alpha_rsub": (lambda m, x, y: (torch.add(x, y, alpha=2.5), torch.sub(x, y, alpha=0.5), 3.0 - x - 2),
                           lambda: [rnd(5, 7), rnd(7)]),
    "div_pow": (lambda m, x, y: (x / (y.abs() + 1), x ** 2, (x.abs() + 1) ** 0.5, (x.abs() + 1) ** -0.5,
                                 (x.abs() + 1) ** 3.0, x.abs() ** y, 1 / (x.abs() + 2), 2 ** x, x / 4),
                lambda: [rnd(3, 11), rnd(3, 11)]),
    "clamp_where_maskfill": (lambda m, x, y: (torch.where(x > y, x.clamp(-0.5, 0.7), y.clamp(min=0.1)),
                                              x.clamp(max=0.2), x.masked_fill(y < 0, -1e4), x.clamp(min=y), x.clamp(y, y + 1), torch.maximum(x, y),
                                              torch.minimum(x, 0.3 * y)),
                             lambda: [rnd(5, 13), rnd(5, 13)]),
    "compare_logic": (lambda m, x, y: (((x > 0) & (y <= 0.3)) | ~(x < y), x >= y, x != y, (x == x).float() * x,
                                       torch.logical_xor(x > 0, y > 0), (x > 0) ^ (y > 0), x <= y, x == 2, x >= 0.5,
                                       x != 1, torch.logical_and(x > 0, y > 0), torch.logical_or(x > 0, y > 0),
                                       torch.logical_not(x > y)),
                      lambda: [rnd(7, 5), rnd(7, 5)]),
    "unary": (lambda m, x: (x.exp(), (x.abs() + 1).log(), x.sin(), x.cos(), x.tanh(), torch.sigmoid(x), torch.relu(x),
                            F.silu(x), torch.erf(x), torch.reciprocal(x.abs() + 1), (x.abs() + 1).rsqrt(), -x, x.abs(),
                            (x.abs() + 1).sqrt()),
              lambda: [rnd(3, 5, 7)]),
    "activations": (lambda m, x: (F.gelu(x), F.gelu(x, approximate="tanh"), F.hardtanh(x, -0.3, 0.6), F.relu6(4 * x),
                                  F.leaky_relu(x, 0.1), F.hardsigmoid(4 * x), F.hardswish(4 * x)),
                    lambda: [rnd(11, 13)]),
    "softmax": (lambda m, x: (F.softmax(x, -1), F.log_softmax(x, 1), torch.softmax(x, 0)), lambda: [rnd(3, 7, 5)]),
    "norms": (lambda m, x: (F.layer_norm(x, (13,), m.w, m.b, 1e-5), F.layer_norm(x, (7, 13)),
                            F.rms_norm(x, (13,), m.w, 1e-6), F.rms_norm(x, (13,))),
              lambda: [rnd(3, 7, 13)], dict(w=rnd(13, seed=1), b=rnd(13, seed=2))),
    "reductions": (lambda m, x: (x.mean((0, 2)), x.sum(1, keepdim=True), x.amax(-1), x.argmax(1), x.argmax(),
                                 x.max(dim=1).values, x.max(dim=2).indices, x.mean(), x.sum(), x.max()),
                   lambda: [rnd(5, 7, 11)]),
    "shapes": (lambda m, x: (x.permute(2, 0, 1), x.transpose(0, 1).reshape(7, -1), x[:, 1:6:2, -3:], x[:, 2],
                             torch.cat([x, x * 2], 1), torch.stack([x, x + 1], 0), x.split([2, 3], 0)[1],
                             x.unbind(2)[3], x[:1].expand(3, 7, 11), x.repeat(1, 2, 1), x.unsqueeze(1).squeeze(1),
                             x.flatten(1), x.chunk(3, dim=2)[2], x[..., None, :].expand(5, 7, 2, 11), x.clone() * 2,
                             x.t() if x.dim() == 2 else x.mT),
               lambda: [rnd(5, 7, 11)]),
    "gather": (lambda m, ids, x: (F.embedding(ids, m.w), m.w.index_select(0, ids.flatten()), m.w[ids],
                                  x.index_select(1, ids[0]), x[:, ids[1]]),
               lambda: [torch.randint(0, 13, (3, 5)), rnd(2, 13, 3)], dict(w=rnd(13, 7, seed=3))),
    "matmul": (lambda m, x, y, z: (x @ m.w, torch.bmm(x, y), torch.mm(x[0], m.w), torch.addmm(m.b, x[0], m.w, beta=0.5,
                                                                                               alpha=2.0),
                                   F.linear(x, m.w.t(), m.b), x @ z, torch.matmul(x[0, 0], m.w), x @ y.transpose(1, 2).transpose(1, 2)),
               lambda: [rnd(3, 5, 7), rnd(3, 7, 11), rnd(7, 2)], dict(w=rnd(7, 11, seed=4), b=rnd(11, seed=5))),
    "conv": (lambda m, x, s: (F.conv2d(x, m.w1, m.b1, stride=2, padding=1, groups=3),
                              F.conv2d(x, m.w2, None, padding=(1, 2), dilation=2),
                              F.conv1d(s, m.w3, m.b3, stride=2, padding=1)),
             lambda: [rnd(2, 3, 11, 13), rnd(2, 3, 17)],
             dict(w1=rnd(6, 1, 3, 3, seed=6), b1=rnd(6, seed=7), w2=rnd(5, 3, 3, 5, seed=8), w3=rnd(5, 3, 3, seed=9),
                  b3=rnd(5, seed=10))),
    "pool": (lambda m, x: (F.max_pool2d(x, 3, 2, 1, ceil_mode=True), F.avg_pool2d(x, 2, padding=1, count_include_pad=False),
                           F.adaptive_avg_pool2d(x, 1), F.adaptive_avg_pool2d(x, (5, 2)), F.max_pool2d(x[0], 2),
                           F.avg_pool2d(x, 3, 2)),
             lambda: [rnd(2, 3, 10, 14)]),
    "batchnorm_pad": (lambda m, x: (F.batch_norm(x, m.mean, m.var, m.w, m.b, False, 0.1, 1e-3),
                                    F.pad(x, (1, 2, 0, 3), value=0.5), F.pad(x, (2, 0))),
                      lambda: [rnd(2, 5, 7, 3)],
                      dict(mean=rnd(5, seed=11), var=rnd(5, seed=12).abs() + 0.5, w=rnd(5, seed=13), b=rnd(5, seed=14))),
    "sdpa": (lambda m, q, k, v, kk, vv, mask: (
        F.scaled_dot_product_attention(q, kk, vv, is_causal=True),
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True),
        F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[:, :, :, :5] > 0),
        F.scaled_dot_product_attention(q[0], kk[0], vv[0])),
        lambda: [rnd(2, 4, 5, 8), rnd(2, 2, 7, 8), rnd(2, 2, 7, 3), rnd(2, 4, 5, 8, seed=20), rnd(2, 4, 5, 8, seed=21),
                 rnd(1, 1, 5, 7)]),
    "kv_update_rope": (lambda m, cache, new, pos, x, cos, sin: (torch.ops.gpudelegate.kv_update(cache, new, pos),
                                                                torch.ops.gpudelegate.rope(x, cos, sin)),
                       lambda: [rnd(1, 2, 11, 4), rnd(1, 2, 3, 4), torch.tensor([5], dtype=torch.int32), rnd(1, 2, 3, 6),
                                rnd(3, 6), rnd(3, 6)]),
    "integers_and_casts": (lambda m, ids, x: ((ids + 2) * ids - 7, ids.float() / 3, ids > 4, (ids * 2).to(torch.float32) + x,
                                              x.half().float(), x.to(torch.int32), torch.div(ids, 3, rounding_mode="trunc")),
                           lambda: [torch.randint(-9, 9, (3, 5)), rnd(3, 5) * 4]),
    "folded_constants": (lambda m, x: (x + torch.arange(5) * 0.5, x * torch.full((5,), 2.0) + torch.ones_like(x),
                                       torch.arange(7), x, torch.triu(torch.ones(5, 5), 1).bool() | (x > 0)),
                         lambda: [rnd(5, 5)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_table_matches_torch_float64(name):
    fn, make_inputs, *consts = CASES[name]
    module = Fn(fn, **(consts[0] if consts else {}))
    check_against_torch(module, make_inputs())


def test_cases_reach_every_table_handler(monkeypatch):
    """Every handler of the ATen table is exercised by the cases above (so each is held to torch)."""
    from gpudelegate.export import aten_table

    handlers = dict(aten_table.TABLE)
    hit = set()
    for target, fn in handlers.items():
        def spy(L, a, fn=fn):
            hit.add(fn)
            return fn(L, a)
        monkeypatch.setitem(aten_table.TABLE, target, spy)
    for name, (fn, make_inputs, *consts) in CASES.items():
        lower(export_method(Fn(fn, **(consts[0] if consts else {})), tuple(make_inputs())))
    untested = sorted({fn.__qualname__ for fn in handlers.values() if fn not in hit})
    assert not untested, f"table handlers that no case reaches: {untested}"


# ------------------------------------------------------------------------------ graph form

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(13, 31)
        self.fc2 = nn.Linear(31, 7)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _addmm_graph(module, x):
    """Export with linear decomposed (the default table turns it into permute + addmm)."""
    ep = export_method(module, (x,)).run_decompositions()
    assert any("addmm" in str(n.target) for n in ep.graph.nodes)
    return lower(ep, decompose=False)


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch's own pytree noise
def test_addmm_with_transposed_weight_becomes_linear_on_the_original_weight():
    torch.manual_seed(0)
    m = MLP().eval()
    g = _addmm_graph(m, torch.randn(3, 13))
    assert [n.op for n in g.nodes] == ["linear", "relu", "linear"]
    consts = [v for v in g.values if v.is_constant]
    # the weight stored is the parameter itself (not its transpose): same bytes, same shape
    stored = {v.shape: v.data for v in consts}
    np.testing.assert_array_equal(stored[(31, 13)], m.fc1.weight.detach().numpy())
    np.testing.assert_array_equal(stored[(7, 31)], m.fc2.weight.detach().numpy())
    assert sum(v.nbytes for v in consts) == sum(p.numel() * 4 for p in m.parameters())


def test_constant_subgraphs_are_folded_at_export_time():
    m = Fn(lambda m, x: x + (torch.arange(7) * 2 + 1).float() * torch.ones(7).cumsum(0))
    g = lower(export_method(m, (rnd(3, 7),)))
    assert [n.op for n in g.nodes] == ["add"]  # arange/mul/add/ones/cumsum were evaluated by torch
    c = [v for v in g.values if v.is_constant]
    np.testing.assert_array_equal(c[0].data, ((np.arange(7) * 2 + 1) * np.arange(1, 8)).astype(np.float32))


def test_constants_are_narrowed_to_program_dtypes():
    m = Fn(lambda m, x, ids: (x + m.f64, ids + m.i64, (ids > 0) & m.flag),
           f64=torch.arange(5, dtype=torch.float64) / 3, i64=torch.tensor([1, -2, 3, 2**31 - 1, -2**31]),
           flag=torch.tensor([True, False, True, True, False]))
    g = lower(export_method(m, (rnd(5), torch.zeros(5, dtype=torch.int64))))
    by_name = {v.name: v for v in g.values if v.is_constant}
    assert by_name["f64"].dtype == "float32" and by_name["f64"].data.dtype == np.float32
    assert by_name["i64"].dtype == "int32" and by_name["i64"].data.tolist() == [1, -2, 3, 2**31 - 1, -2**31]
    assert by_name["flag"].dtype == "bool" and by_name["flag"].data.dtype == np.uint32  # 32-bit 0/1 storage
    assert by_name["flag"].data.tolist() == [1, 0, 1, 1, 0]
    assert g.values[g.inputs[1]].dtype == "int32"  # int64 inputs become int32 (sessions narrow them)


# ------------------------------------------------------------------------------ errors

class UsesCumsum(nn.Module):
    def forward(self, x):
        y = x * 2
        return torch.cumsum(y, 0)  # MARKER-unsupported-op


def test_unsupported_op_names_op_node_and_model_source():
    with pytest.raises(ExportError) as ei:
        export_program(UsesCumsum(), (rnd(3, 5),))
    msg = str(ei.value)
    assert "aten.cumsum.default" in msg
    assert "node cumsum" in msg
    assert "test_export_frontend.py" in msg and "MARKER-unsupported-op" in msg  # the user's source line
    assert "forward:" in msg  # the method


def test_int64_constant_outside_int32_is_refused():
    m = Fn(lambda m, ids: ids + m.big, big=torch.tensor([2**40]))
    with pytest.raises(ExportError, match=r"constant big.*outside int32"):
        export_program(m, (torch.zeros(1, dtype=torch.int64),))


def test_dynamic_shapes_are_refused():
    ep = torch.export.export(MLP(), (rnd(4, 13),), dynamic_shapes={"x": {0: torch.export.Dim("batch", min=2, max=64)}})
    with pytest.raises(ExportError, match="dynamic dimension"):
        export_program(ep)


class MutatesBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x):
        self.count.add_(x)
        return x * 2


def test_buffer_mutation_is_refused_with_advice():
    with pytest.raises(ExportError, match="BUFFER_MUTATION.*method input"):
        export_program(MutatesBuffer(), (rnd(3),))


def test_bad_arguments_are_export_errors():
    with pytest.raises(ExportError, match=r"example_inputs\[0\] is list"):
        export_program(MLP(), ([1.0, 2.0],))
    with pytest.raises(ExportError, match="example_inputs are needed"):
        export_program(MLP())
    with pytest.raises(ExportError, match="weights_dtype='bfloat16'"):
        export_program(MLP(), (rnd(2, 13),), weights_dtype="bfloat16")
    with pytest.raises(ExportError, match="2 input names given for 1 inputs"):
        export_program(MLP(), (rnd(2, 13),), input_names=["a", "b"])
    with pytest.raises(ExportError, match="unknown ops \\['conv3d'\\]"):
        GpuDelegatePartitioner(exclude_ops=["conv3d"])


def test_names_reach_the_method_signature():
    prog = export_program(MLP(), (rnd(2, 13),), input_names=["features"], output_names=["scores"])
    m = prog.methods["forward"]
    assert [m.values[v].name for v in m.inputs] == ["features"]
    assert [m.values[v].name for v in m.outputs] == ["scores"]
    assert prog.metadata["producer"] == "gpudelegate.export" and prog.metadata["weights_dtype"] == "float32"
