"""The norm prologue of concatenated products (core/plan/fusion.py ``_norm_prologue``,
``_prologue_lifetimes``): on a llama-like decoder planned for decode, the q/k/v and gate/up
products take the rms norm (and the residual add) before them, so a layer runs no add_rms_norm
kernel; never for prefill rows, a second reader of the norm, or when the memory plan would let
the group write over what it reads.

Pure core: no numpy (this file also runs inside Pyodide).
"""

from __future__ import annotations

import random

import pytest

from gpudelegate import dtypes
from gpudelegate.plan import plan_session
from gpudelegate.plan.fusion import PROLOGUE_MAX_ROWS, _Graph, _overlap, fusion_lifetimes, match, validate
from gpudelegate.plan.types import DeviceLimits

from progbuild import ProgramBuilder, rand_floats

LIM = DeviceLimits(offset_alignment=256, name="test")
H, HK, S = 4, 2, 17


def _dims(wdtype: str):
    """(D, DH, HID): K = 48 and 96 for float weights; whole 32-value blocks for packed ones."""
    return (64, 16, 96) if dtypes.is_packed(wdtype) else (48, 12, 96)


def _weight(b, p, dtype, shape, seed):
    if dtypes.is_packed(dtype):
        r = random.Random(seed)
        data = bytes(r.randrange(256) for _ in range(dtypes.nbytes(dtype, shape)))
        return p.constant(b.constant(dtype, shape, data))
    return p.constant(b.constant(dtype, shape, rand_floats(dtypes.numel(shape), seed)))


def llama(T: int, layers: int = 2, wdtype: str = "float32", act: str = "float32", second_reader: bool = False):
    """A llama-like decoder payload (bench_cuda.llama_program's graph without the embedding):
    inputs x [1, T, D], cos/sin [T, DH], pos, mask, caches; outputs the logits and caches.
    ``second_reader``: layer 0's attention norm output is also read by an extra op."""
    D, DH, HID = _dims(wdtype)
    b = ProgramBuilder()
    p = b.payload()
    seed = iter(range(1, 1 << 20))
    x = p.input(act, (1, T, D), "x")
    cs, sn = p.input(act, (T, DH), "cos"), p.input(act, (T, DH), "sin")
    pos = p.input("int32", (1,), "pos")
    mask = p.input("bool", (1, 1, T, S), "mask")
    caches = [(p.input(act, (1, HK, S, DH), f"k{i}"), p.input(act, (1, HK, S, DH), f"v{i}")) for i in range(layers)]

    def perm(t, dims):  # export's form: a permute moving only size-1 dims is a reshape
        shp = p.values[t].shape
        moved = [d for d in dims if shp[d] != 1]
        if moved == sorted(moved):
            return p.op("reshape", [t], {"shape": [shp[d] for d in dims]})
        return p.op("permute", [t], {"dims": dims})

    def heads(t, n):
        return perm(p.op("reshape", [t], {"shape": [1, T, n, DH]}), [0, 2, 1, 3])

    def lin(t, n, k):
        return p.op("linear", [t, _weight(b, p, wdtype, (n, k), next(seed))])

    def norm(t):
        return p.op("rms_norm", [t, _weight(b, p, act, (D,), next(seed))], {"eps": 1e-5})

    extra, new_caches = [], []
    for i in range(layers):
        h = norm(x)
        if second_reader and i == 0:
            extra.append(p.op("neg", [h]))
        q = p.op("rope", [heads(lin(h, H * DH, D), H), cs, sn])
        k = p.op("rope", [heads(lin(h, HK * DH, D), HK), cs, sn])
        v = heads(lin(h, HK * DH, D), HK)
        kc = p.op("kv_update", [caches[i][0], k, pos])
        vc = p.op("kv_update", [caches[i][1], v, pos])
        new_caches += [kc, vc]
        a = p.op("sdpa", [q, kc, vc, mask])
        a = p.op("reshape", [perm(a, [0, 2, 1, 3])], {"shape": [1, T, D]})
        x = p.op("add", [x, lin(a, D, D)])
        h = norm(x)
        m = p.op("mul", [p.op("silu", [lin(h, HID, D)]), lin(h, HID, D)])
        x = p.op("add", [x, lin(m, D, HID)])
    logits = lin(norm(x), 31, D)
    p.output(logits, *new_caches, *extra)
    p.schedule_offload()
    mth = b.method("decode")
    ins = [mth.input(p.values[v].dtype, p.values[v].shape) for v in p.inputs]
    mth.output(*mth.delegate(p, ins))
    return b.build()


def _fusions(prog):
    plan = plan_session(prog, LIM)
    return plan, plan.payloads[0], plan.fusions[0]


def _kinds(fs):
    return sorted(f.kind + ("+cat" if f.cat else "") + ("+norm" if f.norm else "") for f in fs)


@pytest.mark.parametrize("wdtype,act", [("float32", "float32"), ("float16", "float16"), ("q4_1", "float32"),
                                        ("q8_0", "float32")])
@pytest.mark.parametrize("T", [1, 4])
def test_decode_layers_take_their_norms(wdtype, act, T):
    plan, pp, fs = _fusions(llama(T, wdtype=wdtype, act=act))
    kinds = _kinds(fs)
    # layer 0's attention norm reads the input (no add); every other norm before a product is
    # an add + norm; the final one feeds the lone LM head and stays a kernel of its own
    assert kinds.count("rope_kv+cat+norm") == 2 and kinds.count("silu_mul+cat+norm") == 2
    assert kinds.count("add_rms_norm") == 1
    ds = pp.dispatches
    taken = [k for f in fs for k in f.members]
    assert len(taken) == len(set(taken)), "a dispatch in two groups"
    for f in fs:
        if not f.norm:
            continue
        n = f.norm
        nd = ds[n["norm"]]
        assert nd.op == "rms_norm" and n["norm"] in f.members and f.at == max(f.members)
        assert n["eps"] == pytest.approx(1e-5) and n["w"].value == nd.args[1].value
        assert nd.outputs[0].value in f.eliminated
        x = ds[f.cat[0]].args[0]
        assert x.value == nd.outputs[0].value
        if n["add"] is None:
            assert n["src"].value == nd.args[0].value and n["x"] is n["y"] is n["s"] is None
            assert n["src"].value == pp.inputs[0].value  # layer 0 reads the payload input
            continue
        ad = ds[n["add"]]
        assert ad.op == "add" and n["add"] in f.members
        assert [n["x"].value, n["y"].value] == [a.value for a in ad.args] and n["s"].value == ad.outputs[0].value
        assert n["src"].value == n["s"].value and n["s"].value not in f.eliminated
        # the kept sum and the group's other outputs never share bytes with what it reads
        for r in (n["x"], n["y"]):
            assert not _overlap(n["s"].buf, r.buf)
            for k in f.members:
                for o in ds[k].outputs:
                    if o.value not in f.eliminated and o.buf.space == "arena" and ds[k].op != "kv_update":
                        assert not _overlap(o.buf, r.buf), (f.kind, k, o.value, r.value)


@pytest.mark.parametrize("wdtype", ["float32", "q4_1"])
def test_prefill_rows_keep_the_norm_apart(wdtype):
    T = PROLOGUE_MAX_ROWS + 1
    _, _, fs = _fusions(llama(T, wdtype=wdtype))
    kinds = _kinds(fs)
    assert not any(f.norm for f in fs)
    assert kinds.count("rope_kv+cat") == 2 and kinds.count("silu_mul+cat") == 2
    assert kinds.count("add_rms_norm") == 4  # every add (two a layer) with the norm after it


def test_a_second_reader_of_the_norm_keeps_it_apart():
    _, pp, fs = _fusions(llama(1, second_reader=True))
    first = min((f for f in fs if f.kind == "rope_kv"), key=lambda f: f.at)
    assert first.cat and first.norm is None
    assert sum(1 for f in fs if f.norm) == 3  # the other layer's and both MLP fronts


def test_match_without_the_prologue_kind_is_the_plain_grouping():
    plan, pp, fs = _fusions(llama(1, wdtype="q4_1"))
    kinds = {"add_rms_norm", "silu_mul", "rope_kv", "sdpa_bthd", "gemm_cat"}
    plain = match(pp, 0, plan.prepack.value_buffer, contiguous=plan.layout.adjacent, kinds=kinds)
    assert not any(f.norm for f in plain)
    assert _kinds(plain).count("add_rms_norm") == 4 and _kinds(plain).count("rope_kv+cat") == 2
    # the same groups, the prologue members added
    assert sorted(tuple(f.cat) for f in plain if f.cat) == sorted(tuple(f.cat) for f in fs if f.cat)


def test_lifetimes_keep_the_norm_operands_until_the_consumer():
    prog = llama(1)
    payload = prog.payloads[0]
    nodes = payload.nodes
    _, pairs = fusion_lifetimes(payload)
    late = {}
    for v, k in pairs:  # the memory planner keeps the latest use
        late[v] = max(late.get(v, k), k)
    adds = [k for k, n in enumerate(nodes) if n.op == "add"]
    # the add before layer 1's q/k/v: its operands live until that layer's last cache write
    a = adds[1]
    kv = [k for k, n in enumerate(nodes) if n.op == "kv_update" and k > a][1]
    assert all(late.get(v) == kv for v in nodes[a].args)
    # the add before the MLP front: until the silu * up
    a = adds[0]
    mul = next(k for k, n in enumerate(nodes) if n.op == "mul" and k > a)
    assert all(late.get(v) == mul for v in nodes[a].args)
    # layer 0's plain norm: its input until that layer's cache writes
    n0 = next(k for k, n in enumerate(nodes) if n.op == "rms_norm")
    kv0 = [k for k, n in enumerate(nodes) if n.op == "kv_update"][1]
    assert (nodes[n0].args[0], kv0) in pairs  # (the first add reads it later still)
    # the final add feeds the LM head's norm alone (one linear): nothing lengthened for it
    assert all(v not in late for v in nodes[adds[-1]].args)
    # prefill rows: nothing lengthened
    _, late_p = fusion_lifetimes(llama(PROLOGUE_MAX_ROWS + 1).payloads[0])
    assert not set(dict(late_p)) & set(v for k in adds for v in prog.payloads[0].nodes[k].args)


def test_an_overlapping_sum_is_refused():
    """Where the memory plan puts the sum over an operand of its add (a plan built without the
    lengthened lifetimes), validate refuses the group with the prologue: the workgroup writing s
    would race with the others still reading x."""
    plan, pp, fs = _fusions(llama(1))
    g = _Graph(pp)
    f = next(f for f in fs if f.norm and f.norm["add"] is not None)
    n = f.norm
    # move s onto x: the same bytes
    from dataclasses import replace
    ad = pp.dispatches[n["add"]]
    s2 = replace(ad.outputs[0], buf=n["x"].buf)
    g.d[n["add"]] = replace(ad, outputs=[s2])
    assert validate(g, f.members, f.eliminated) is not None
