"""The examples of issue 15 ("fidelity at the edges") end to end: single-op models exported with
``export_program``, written to bytes and loaded back, run on the reference executor and on wgpu
(software Vulkan in CI), and compared with eager PyTorch in float64; the ones PyTorch itself
refuses, or that the op set cannot take, give a specific, documented error naming the op and the
argument.

Tolerance (the suite's float32 bound, tests/conformance/cases.py): rtol 1e-4, atol 1e-5; NaN and
inf positions must match exactly (``assert_allclose`` compares them as values), and so must shapes
(0-d stays 0-d, empty stays empty) and integer/bool results.
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
from gpudelegate.export import export_program

from conformance.executors import probe_device

NAN, INF = float("nan"), float("inf")
# Every special float and a few ordinary ones: what the NaN/inf rules are about.
SPECIAL = torch.tensor([NAN, INF, -INF, -0.0, 0.0, 0.5, -2.0, 3.0, 7.0, -7.0])


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def _m(fn):
    return fn if isinstance(fn, nn.Module) else Fn(fn)


EXAMPLES = {
    # zero-size dims (rank >= 2) and the ops that crashed on them
    "add_scalar_empty": (lambda x: x + 1.0, [torch.zeros(0, 3)]),
    "linear_empty_rows": (nn.Linear(3, 4), [torch.zeros(0, 3)]),
    "pad_empty": (lambda x: F.pad(x, (1, 1)), [torch.zeros(0, 3)]),
    "layer_norm_empty": (lambda x: F.layer_norm(x, (3,)), [torch.zeros(0, 3)]),
    "reshape_empty": (lambda x: x.reshape(3, 0) * 2.0, [torch.zeros(0, 3)]),
    "matmul_k0": (lambda a, b: a @ b, [torch.zeros(2, 0), torch.zeros(0, 3)]),
    "linear_k0_bias": (nn.Linear(0, 4), [torch.zeros(2, 0)]),
    "empty_constant": (lambda x: x * torch.ones_like(torch.zeros(0, 5, 0)), [torch.randn(5, 1)]),
    "softmax_empty_dim": (lambda x: torch.softmax(x, dim=1), [torch.zeros(2, 0)]),
    "sum_empty_dim": (lambda x: x.sum(dim=1), [torch.zeros(2, 0)]),
    "mean_empty_dim": (lambda x: x.mean(dim=1), [torch.zeros(2, 0)]),  # NaN, as torch
    # 0-d tensors
    "full_like_0d": (lambda x: torch.full_like(x, 7.0), [torch.tensor(1.5)]),
    "mul_0d": (lambda x: x * 2.0, [torch.tensor(1.5)]),
    "sum_0d": (lambda x: torch.sum(x), [torch.tensor(1.5)]),
    "mean_0d": (lambda x: torch.mean(x), [torch.tensor(1.5)]),
    "amax_0d": (lambda x: torch.amax(x), [torch.tensor(1.5)]),
    "max_0d": (lambda x: torch.max(x), [torch.tensor(1.5)]),
    "max_all": (lambda x: torch.max(x), [SPECIAL.reshape(2, 5)]),
    "sum_0d_dim0": (lambda x: x.sum(dim=0), [torch.tensor(1.5)]),
    "index_select_0d": (lambda x: torch.index_select(x, 0, torch.tensor([0])), [torch.tensor(1.5)]),
    "broadcast_0d": (lambda x, s: x * s, [torch.randn(3, 1, 4), torch.tensor(-2.5)]),
    "cat_empty": (lambda a, b: torch.cat([a, b]), [torch.zeros(0), torch.zeros(0)]),
    "cat_empty_part": (lambda a, b: torch.cat([a, b]), [torch.zeros(0, 3), torch.ones(2, 3)]),
    # NaN and inf semantics
    "tanh": (torch.tanh, [SPECIAL]),
    "clamp": (lambda x: torch.clamp(x, -1.0, 1.0), [SPECIAL]),
    "hardtanh": (F.hardtanh, [SPECIAL]),
    "relu6": (F.relu6, [SPECIAL]),
    "relu": (torch.relu, [SPECIAL]),
    "maximum": (lambda x: torch.maximum(x, torch.zeros(10)), [SPECIAL]),
    "minimum": (lambda x: torch.minimum(x, torch.zeros(10)), [SPECIAL]),
    "to_bool": (lambda x: x.bool(), [SPECIAL]),
    "logical_not": (torch.logical_not, [SPECIAL]),
    "ne": (lambda x: x != x, [SPECIAL]),
    "pow": (torch.pow, [SPECIAL.reshape(10, 1), SPECIAL.reshape(1, 10)]),  # every pair of specials
    "maximum_pairs": (torch.maximum, [SPECIAL.reshape(10, 1), SPECIAL.reshape(1, 10)]),
    "eq_pairs": (torch.eq, [SPECIAL.reshape(10, 1), SPECIAL.reshape(1, 10)]),
    "softmax_nan": (lambda x: torch.softmax(x, -1), [SPECIAL.reshape(2, 5)]),
    "amax_nan": (lambda x: torch.amax(x, dim=1), [SPECIAL.reshape(2, 5)]),
    "argmax_nan": (lambda x: torch.argmax(x, dim=1), [SPECIAL.reshape(2, 5)]),
    # shapes PyTorch accepts that were refused with an internal message
    "sdpa_3d_query_4d_kv": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                            [torch.randn(2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)]),
    "sdpa_one_query_head": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                            [torch.randn(2, 1, 3, 4), torch.randn(2, 4, 5, 4), torch.randn(2, 4, 5, 4)]),
}

DEVICES = ["reference", "wgpu"]


def _torch64(fn, xs):
    m = copy.deepcopy(_m(fn)).double()
    with torch.no_grad():
        return m(*[x.double() if x.is_floating_point() else x for x in xs]).numpy()


@pytest.fixture(scope="module")
def env():
    e = gpudelegate.Environment()
    yield e
    e.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_matches_torch(env, device, name):
    ok, reason = probe_device(device)()
    if not ok:
        pytest.skip(reason)
    fn, xs = EXAMPLES[name]
    want = _torch64(fn, xs)
    prog = gpudelegate.loads(export_program(_m(fn), tuple(xs)).to_bytes())
    with env.session(prog, device=device) as sess:
        (got,) = sess.run("forward", [x.numpy() for x in xs])
    got = np.asarray(got)
    assert got.shape == want.shape, f"{name} on {device}: shape {got.shape}, torch {want.shape}"
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got.astype(np.int64), want.astype(np.int64), err_msg=f"{name} on {device}")
    else:
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-4, atol=1e-5, err_msg=f"{name} on {device}")


def test_zero_d_constants_keep_their_shape():
    """Export used to store a 0-d constant as shape [1] (np.ascontiguousarray promotes 0-d)."""
    prog = export_program(Fn(lambda x: torch.full_like(x, 7.0)), (torch.tensor(1.5),))
    m = prog.methods["forward"]
    assert tuple(m.values[m.outputs[0]].shape) == ()
    assert all(len(c.shape) == 0 for c in prog.constants), [c.shape for c in prog.constants]


# ------------------------------------------------------------------ errors: the op, the argument, why

def test_attention_with_two_batch_dims_names_the_argument():
    q = torch.randn(2, 2, 2, 3, 4)  # [B1, B2, H, T, D]: the op set's sdpa has one batch dim
    with pytest.raises(ExportError) as e:
        export_program(Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v)), (q, q, q))
    msg = str(e.value)
    assert "scaled_dot_product_attention" in msg and "'query' is 5-D" in msg and "IndexError" not in msg, msg


def test_conv_with_an_empty_kernel_is_refused_as_torch_does():
    with pytest.raises(ExportError) as e:
        export_program(Fn(lambda x, w: F.conv2d(x, w)), (torch.randn(1, 3, 5, 5), torch.randn(2, 3, 0, 3)))
    assert "conv" in str(e.value)


def test_slice_of_a_0d_tensor_is_refused_by_the_schema():
    from gpudelegate import ops
    from gpudelegate.errors import PayloadError
    from gpudelegate.program import Value

    with pytest.raises(PayloadError) as e:
        ops.infer("slice", [Value("float32", ())], {"dim": 0, "start": 0, "end": 1})
    assert "0-d" in str(e.value) and "slice" in str(e.value)
