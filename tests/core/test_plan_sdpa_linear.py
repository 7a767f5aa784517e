"""The planner's ``sdpa_linear`` group (core/plan/fusion.py): a decode attention whose output only
the linear after it reads (through no-op reshapes), with that linear's residual add where no other
group took it, and its WGSL lowering (core/webgpu/ops_fused.py: attn_flash, then the packed
product merging the partials in its prologue, quant_mm_body.wgsl ``qgemv_attn``), on plans and
kernel calls alone.

Pure core: no numpy (this file also runs inside Pyodide). Shapes: H = 8 query heads on Hk = 2 kv
heads (GQA) of D = 12 (K = 96, three q4_1 blocks), S = 23 cache rows (prime: two 16-key chunks),
N = 37 outputs (prime).
"""

from __future__ import annotations

import random
import struct

import pytest

from gpudelegate import dtypes
from gpudelegate.plan import plan_session
from gpudelegate.plan.fusion import match
from gpudelegate.plan.types import DeviceLimits
from gpudelegate.webgpu import lowering, ops_fused
from gpudelegate.webgpu.ops_quant import QPARAMS_WORDS

from progbuild import ProgramBuilder

LIM = DeviceLimits(offset_alignment=256, name="test")
H, HK, D, S, N = 8, 2, 12, 23, 37


def _program(B: int, T: int, heads: int = H, kv: int = HK, res: bool = True, also_out: bool = False,
             permute: bool = False):
    """q [B, heads, T, d] attending over k, v [B, kv, S, d] (d = D, or 32 for one head: whole
    blocks); the output as [B, T, heads d] rows into a q4_1 linear of N outputs (+ r [B, T, N]
    with ``res``). ``also_out``: the attention output is a payload output too; ``permute``:
    [0, 2, 1, 3] before the reshape (sdpa_bthd's)."""
    d = D if heads > 1 else 32
    K = heads * d
    b = ProgramBuilder()
    p = b.payload()
    shapes = {"q": (B, heads, T, d), "k": (B, kv, S, d), "v": (B, kv, S, d), "r": (B, T, N)}
    ins = {n: p.input("float32", s, n) for n, s in shapes.items()}
    blocks = bytes(random.Random(1).randrange(256) for _ in range(dtypes.nbytes("q4_1", (N, K))))
    w = p.prepack(p.constant(b.constant("q4_1", (N, K), blocks), "w"))
    a = p.op("sdpa", [ins["q"], ins["k"], ins["v"]])
    if permute:
        a2 = p.op("permute", [a], {"dims": [0, 2, 1, 3]})
        x = p.op("reshape", [a2], {"shape": [B, T, K]})
    else:
        x = p.op("reshape", [a], {"shape": [B, T, K]})
    y = p.op("linear", [x, w])
    outs = [p.op("add", [y, ins["r"]]) if res else y] + ([a] if also_out else [])
    p.output(*outs)
    p.schedule_offload()
    m = b.method("forward")
    ys = m.delegate(p, [m.input("float32", s, n) for n, s in shapes.items()])
    m.output(*ys)
    return b.build()


def _groups(prog):
    plan = plan_session(prog, LIM)
    return plan, [f for f in plan.fusions[0] if f.kind == "sdpa_linear"]


@pytest.mark.parametrize("B,T,heads,kv", [(1, 1, H, HK), (8, 1, H, HK), (1, 5, 1, 1)])
def test_a_decode_attention_joins_its_product_and_residual(B, T, heads, kv):
    plan, found = _groups(_program(B, T, heads, kv))
    (f,) = found
    ops = [plan.payloads[0].dispatches[k].op for k in f.members]
    assert ops == ["sdpa", "reshape", "linear", "add"], ops
    assert f.roles["add"] == f.at and f.roles["res"] is not None and len(f.eliminated) == 2


def test_without_a_residual_the_group_ends_at_the_product():
    plan, (f,) = _groups(_program(1, 1, res=False))
    assert plan.payloads[0].dispatches[f.at].op == "linear" and f.roles["add"] is None


@pytest.mark.parametrize("what", ["rows of several heads", "nine rows", "output read elsewhere", "permuted"])
def test_what_stays_apart(what):
    """Several query rows of several heads (the reshape is no head concatenation), more rows than
    a decode prologue takes, an attention output read outside the group: no group. With the
    head permute sdpa_bthd (the group CUDA carries) takes the attention instead."""
    prog = {"rows of several heads": lambda: _program(1, 2),
            "nine rows": lambda: _program(9, 1),
            "output read elsewhere": lambda: _program(1, 1, also_out=True),
            "permuted": lambda: _program(1, 3, permute=True)}[what]()
    plan, found = _groups(prog)
    assert found == []
    if what == "permuted":
        assert "sdpa_bthd" in [f.kind for f in match(plan.payloads[0], 0, plan.prepack.value_buffer)]


def test_the_lowering_merges_the_partials_in_the_product():
    """attn_flash then qgemv_attn at the add (the product's residual epilogue), nothing at the
    attention's, reshape's and linear's places; QParams words 24..30 locate the partials: rows,
    chunks, Dv / 4, heads, query rows, first vec4, the word of the first (maximum, sum) pair.
    With Tuning.attn_in_product off: attn_flash + attn_flash_combine, then qgemv + residual."""
    B = 3
    plan, (f,) = _groups(_program(B, 1))
    pp = plan.payloads[0]
    fus = ops_fused.plan_fusions(plan, 0)
    calls = lowering.select_all(pp, LIM, tuning=lowering.Tuning(attn_flash_keys=16), fusions=fus)
    assert [c.entry for c in calls[f.at]] == ["attn_flash", "qgemv_attn"]
    assert all(calls[k] == [] for k in f.members[:-1])
    call = calls[f.at][1]
    assert call.constants["NORM"] == 3 and call.constants["RES"] is True and call.constants["HS"] == B * H * D // 4
    w = struct.unpack(f"<{QPARAMS_WORDS}I", call.uniform)
    nc = -(-S // 16)
    assert w[:2] == (B, H * D) and w[24:31] == (B * H, nc, D // 4, H, 1, 0, B * H * nc * D)
    by_slot = {b.binding: b.buf for b in call.bindings}
    assert by_slot[2].space == "scratch" and by_slot[2] == {b.binding: b.buf for b in calls[f.at][0].bindings}[1]
    off = lowering.select_all(pp, LIM, tuning=lowering.Tuning(attn_flash_keys=16, attn_in_product=False), fusions=fus)
    k_sdpa = f.roles["sdpa"]
    assert [c.entry for c in off[k_sdpa]] == ["attn_flash", "attn_flash_combine"]
    assert [c.entry for c in off[f.roles["linear"]]] == ["qgemv"] and off[f.roles["add"]] == []
