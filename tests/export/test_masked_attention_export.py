"""Issue 14, items 5 and 6: exported attention with a fully masked row gives PyTorch's answer
(zeros, not NaN) on every executor, and ``export_program`` leaves the caller's model in the
training mode it was given in."""

from __future__ import annotations

import numpy as np
import pytest

import gpudelegate

from conformance.cases import CASES, make_data
from conformance.executors import probe_device

torch = pytest.importorskip("torch")


def _need_wgpu():
    ok, reason = probe_device("wgpu")()
    if not ok:
        pytest.skip(reason)


def test_dead_row_conformance_cases_reach_dead_and_live_rows():
    """The conformance cases for fully masked rows (cases.py) really have both kinds of rows."""
    seen = 0
    for case in CASES:
        if "sdpa_dead_rows" in case.id:
            rows = make_data(case)["rows"].reshape(-1)
            assert rows.any() and not rows.all(), case.id
            seen += 1
    assert seen == 6


def test_reference_sdpa_matches_torch_on_fully_masked_rows():
    """torch 2.13's F.scaled_dot_product_attention (the op export lowers) gives zeros for a row
    whose keys are all masked, for a bool keep-mask and an additive -inf mask alike."""
    import torch.nn.functional as F

    from gpudelegate.native.reference_kernels import KERNELS

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 7, 8, generator=g),
               torch.randn(2, 3, 7, 4, generator=g))
    keep = torch.rand(2, 1, 5, 7, generator=g) < 0.6
    keep[0, :, 1] = False
    keep[1, :, 4] = False
    additive = torch.where(keep, 0.0, float("-inf"))
    for mask in (keep, additive):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert (want[0, :, 1] == 0).all() and (want[1, :, 4] == 0).all()
        (got,) = KERNELS["sdpa"]([q.numpy(), k.numpy(), v.numpy(), mask.numpy()],
                                 {"causal": False, "scale": 8 ** -0.5, "causal_offset": 0})
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
    # a plain softmax of an all -inf row stays NaN, as torch.softmax
    (s,) = KERNELS["softmax"]([np.full((2, 3), -np.inf, np.float32)], {"dim": -1})
    assert np.isnan(s).all() and torch.softmax(torch.full((2, 3), float("-inf")), -1).isnan().all()


class _MaskedEncoder(torch.nn.Module):
    """A MiniLM-shaped attention block: padded keys masked out of every query row."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(13, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, ids, mask):
        b, t = ids.shape
        h = self.emb(ids)
        q, k, v = self.qkv(h).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        keep = (mask != 0).view(b, 1, 1, t)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(self.drop(a.transpose(1, 2).reshape(b, t, 16)))


@pytest.mark.parametrize("dev", ["reference", pytest.param("wgpu", marks=pytest.mark.wgpu)])
def test_exported_attention_with_an_all_zero_mask_row_matches_pytorch(dev):
    if dev == "wgpu":
        _need_wgpu()
    from gpudelegate.export import export_program

    model = _MaskedEncoder().eval()
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], dtype=torch.int32)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.int32)  # row 1: all padding
    prog = export_program(model, (ids, mask), input_names=["ids", "mask"])
    with torch.no_grad():
        want = model(ids, mask).numpy()
    assert np.isfinite(want).all()
    with gpudelegate.Environment() as env, env.session(prog, device=dev) as s:
        (got,) = s.run("forward", [ids.numpy(), mask.numpy()])
    assert np.isfinite(got).all(), "a fully masked row must not turn into NaN"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ 6. export leaves the model as it was

def test_export_program_restores_training_mode():
    from gpudelegate.export import export_program

    model = _MaskedEncoder()
    model.train()
    model.out.eval()  # a mixed state comes back as it was, submodule by submodule
    before = {n: m.training for n, m in model.named_modules()}
    ids = torch.zeros(1, 5, dtype=torch.int32)
    export_program(model, (ids, torch.ones(1, 5, dtype=torch.int32)))
    assert {n: m.training for n, m in model.named_modules()} == before
    assert model.training and not model.out.training


