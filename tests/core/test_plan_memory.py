"""The memory planner: arena placement of a payload's activations (gpudelegate.plan.memory).

Property tests build random valid chains (random prime sizes, lifetimes, reshape views and
in-place kv_update aliases, weights read directly or through prepack), plan them under random
device limits, then check the plan against an independent model of the run: lifetimes recomputed
here by brute force, and a byte-level simulation that writes every value where the plan puts it
and checks each value still holds its own bytes whenever a node reads it.

Pure core: no numpy (this file also runs inside Pyodide, see tests/core_tests.txt).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from gpudelegate import ops
from gpudelegate.errors import DeviceError, PayloadError
from gpudelegate.plan import plan_session
from gpudelegate.plan.memory import plan_memory
from gpudelegate.plan.prepack import plan_prepack
from gpudelegate.plan.types import DeviceLimits
from gpudelegate.program import Node, Payload, Value
from progbuild import ProgramBuilder, rand_floats

PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97,
          101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 157, 163, 167, 173, 179, 181, 191, 193, 197]


# ----------------------------------------------------------------------------- program builders

def single_payload_program(build):
    """A program whose method 'forward' calls one payload built by ``build(b, pl)``."""
    b = ProgramBuilder()
    pl = b.payload()
    build(b, pl)
    m = b.method("forward")
    ins = [m.input(pl.values[i].dtype, pl.values[i].shape) for i in pl.inputs]
    outs = m.delegate(pl, ins)
    m.output(*outs)
    return b.build()


def draw_chain(data, b, pl):
    """A random chain: linear (weights direct, prepacked, fp16-packed), add, relu, reshape views
    and kv_update into a cache input; random values become payload outputs."""
    k0 = data.draw(st.sampled_from(PRIMES), label="K0")
    x = pl.input("float32", (1, k0), name="x")
    pool = [x]  # activations usable as linear/add inputs: shape [1, K] or [K]
    pos = None
    n_ops = data.draw(st.integers(1, 14), label="n_ops")
    for i in range(n_ops):
        kind = data.draw(st.sampled_from(["linear", "linear", "add", "relu", "reshape", "kv_update"]), label="op")
        src = data.draw(st.sampled_from(pool), label="src")
        k = pl.values[src].shape[-1]
        if kind == "linear":
            n = data.draw(st.sampled_from(PRIMES), label="N")
            c = b.constant("float32", (n, k), rand_floats(n * k, seed=i))
            w = pl.constant(c, name=f"w{i}")
            how = data.draw(st.sampled_from(["direct", "identity", "fp16"]), label="weight")
            if how != "direct":
                w = pl.prepack(w, how)
            pool.append(pl.op("linear", [src, w]))
        elif kind == "add":
            same = [v for v in pool if pl.values[v].shape[-1] == k]
            other = data.draw(st.sampled_from(same), label="other")
            pool.append(pl.op("add", [src, other]))
        elif kind == "relu":
            pool.append(pl.op("relu", [src]))
        elif kind == "reshape":
            shape = [k] if len(pl.values[src].shape) == 2 else [1, k]
            pool.append(pl.op("reshape", [src], {"shape": shape}))
        else:  # kv_update: the updated cache aliases the cache input, in place
            s = data.draw(st.sampled_from(PRIMES[:6]), label="S")
            cache = pl.input("float32", (1, 1, s, k), name=f"cache{i}")
            if pos is None:
                pos = pl.input("int32", (1,), name="pos")
            new = pl.op("reshape", [src], {"shape": [1, 1, 1, k]})
            upd = pl.op("kv_update", [cache, new, pos])
            if data.draw(st.booleans(), label="return cache"):
                pl.output(upd)
            pool.append(pl.op("reshape", [upd], {"shape": [1, s * k]}))
    outs = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=min(3, len(pool)), unique=True), label="outputs")
    for o in outs:
        if o not in pl.outputs:
            pl.output(o)


# ----------------------------------------------------------------------------- independent model

def alias_groups(payload):
    """Value -> representative of its storage, from the op schemas' alias (brute force)."""
    rep = {i: i for i in range(len(payload.values))}

    def find(v):
        while rep[v] != v:
            v = rep[v]
        return v

    for node in payload.nodes:
        a = ops.get(node.op).alias
        if a is not None and node.args[a] != -1:
            ra, ro = find(node.args[a]), find(node.outputs[0])
            rep[max(ra, ro)] = min(ra, ro)
    return {v: find(v) for v in rep}


def live_intervals(payload, arena_values):
    """Storage representative -> (first, last) node time it must hold its bytes."""
    n = len(payload.nodes)
    group = alias_groups(payload)
    times = {}
    for v in payload.inputs:
        times.setdefault(group[v], []).append(-1)
    for k, node in enumerate(payload.nodes):
        for v in list(node.args) + list(node.outputs):
            if v != -1:
                times.setdefault(group[v], []).append(k)
    for v in payload.outputs:
        times.setdefault(group[v], []).append(n)
    return {g: (min(t), max(t)) for g, t in times.items() if any(group[v] == g for v in arena_values)}


def check_memory_plan(payload, mp, limits):
    arena_values = set(mp.locations)
    group = alias_groups(payload)
    # every offset aligned, every tensor inside its object, objects within the device's limit
    assert mp.arena_bytes == sum(mp.objects)
    for v, ref in mp.locations.items():
        assert ref.space == "arena"
        assert ref.offset % limits.offset_alignment == 0, (v, ref)
        assert ref.nbytes == payload.values[v].nbytes
        assert ref.offset + ref.nbytes <= mp.objects[ref.index], (v, ref, mp.objects)
    assert all(0 < size <= limits.max_buffer_size for size in mp.objects)
    # aliases share one location
    for v in arena_values:
        r = group[v]
        if r in arena_values:
            assert (mp.locations[v].index, mp.locations[v].offset) == (mp.locations[r].index, mp.locations[r].offset)
    # no two storages live at the same time share a byte
    iv = live_intervals(payload, arena_values)
    span = {}
    for v in arena_values:
        ref = mp.locations[v]
        _, lo, hi = span.get(group[v], (ref.index, ref.offset, ref.offset))
        span[group[v]] = (ref.index, min(lo, ref.offset), max(hi, ref.offset + ref.nbytes))
    gs = sorted(span)
    for i, g in enumerate(gs):
        for h in gs[i + 1:]:
            (o1, a1, b1), (o2, a2, b2) = span[g], span[h]
            t_overlap = iv[g][0] <= iv[h][1] and iv[h][0] <= iv[g][1]
            if t_overlap and o1 == o2:
                assert b1 <= a2 or b2 <= a1, f"storages {g} and {h} are live together and overlap in memory"
    # the bound: max bytes live at once, recomputed here (exact nbytes; the planner rounds up to 4)
    sizes = {g: max(payload.values[v].nbytes for v in arena_values if group[v] == g) for g in span}
    times = range(-1, len(payload.nodes) + 1)
    peak = max(sum(sizes[g] for g in span if iv[g][0] <= t <= iv[g][1]) for t in times)
    assert mp.lower_bound >= peak
    assert mp.arena_bytes >= mp.lower_bound


def simulate(payload, mp, weights):
    """Write each value's bytes where the plan puts it (owner = its storage) and check, at every
    read, that the bytes still belong to it: a value clobbered before its last use fails here."""
    group = alias_groups(payload)
    mem = [[None] * size for size in mp.objects]

    def write(v):
        ref = mp.locations[v]
        mem[ref.index][ref.offset:ref.offset + ref.nbytes] = [group[v]] * ref.nbytes

    def read(v, where):
        if v in weights:
            return
        ref = mp.locations[v]
        got = set(mem[ref.index][ref.offset:ref.offset + ref.nbytes])
        assert got == {group[v]}, f"{where}: value {v} was overwritten by storage(s) {got - {group[v]}}"

    for v in payload.inputs:
        write(v)
    for k, node in enumerate(payload.nodes):
        for a in node.args:
            if a != -1:
                read(a, f"node {k} ({node.op})")
        for o in node.outputs:
            if o not in weights:
                write(o)
    for v in payload.outputs:
        read(v, "payload output")


# ----------------------------------------------------------------------------- property tests

@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_chains_never_overlap_live_values(data):
    prog = single_payload_program(lambda b, pl: draw_chain(data, b, pl))
    pl = prog.payloads[0]
    biggest = max(v.nbytes for i, v in enumerate(pl.values) if v.constant is None)
    align = data.draw(st.sampled_from([4, 16, 64, 256]), label="alignment")
    # From "everything fits in one object" down to "barely the biggest tensor": exercises the
    # opening of extra memory objects.
    max_buf = data.draw(st.integers(-(-biggest // 4) * 4, 4 * biggest + 4 * align), label="max_buffer_size")
    limits = DeviceLimits(max_buffer_size=max_buf, max_binding_size=max(4, max_buf // 2), offset_alignment=align)
    # The memory planner alone: weights may exceed these small limits (plan_session refuses
    # that), and the point here is the arena.
    _, pw, _ = plan_prepack(prog, [0])
    weights = set(pw[0].buffer_of)
    mp = plan_memory(pl, limits, external=weights, where="payloads[0]")
    assert not weights & set(mp.locations), "weights never live in the arena"
    event(f"memory objects: {min(len(mp.objects), 3)}{'+' if len(mp.objects) >= 3 else ''}")
    event(f"nodes: {'>=8' if len(pl.nodes) >= 8 else '<8'}")
    event(f"kv_update: {any(n.op == 'kv_update' for n in pl.nodes)}")
    check_memory_plan(pl, mp, limits)
    simulate(pl, mp, weights)
    # Through plan_session (roomy limits): every dispatch ref points where the plans put it.
    plan = plan_session(prog, DeviceLimits(offset_alignment=align))
    pp = plan.payloads[0]
    refs = [r for d in pp.dispatches for r in d.args + d.outputs if r is not None] + pp.inputs + pp.outputs
    for r in refs:
        v = pl.values[r.value]
        assert (r.dtype, r.shape, r.buf.nbytes) == (v.dtype, v.shape, v.nbytes)
        if r.value in weights:
            assert (r.buf.space, r.buf.index) == ("resident", plan.prepack.value_buffer[(0, r.value)])
        else:
            assert r.buf == pp.memory.locations[r.value]
    check_memory_plan(pl, pp.memory, plan.limits)


# ----------------------------------------------------------------------------- unit tests

def _relu_chain(n, k=37):
    def build(b, pl):
        h = pl.input("float32", (1, k))
        for _ in range(n):
            h = pl.op("relu", [h])
        pl.output(h)
    return single_payload_program(build)


def test_chain_reuses_two_buffers():
    # x -> relu -> relu -> ...: each value dies when the next is written, so two places suffice.
    prog = _relu_chain(9)
    limits = DeviceLimits(offset_alignment=256)
    mp = plan_session(prog, limits).payloads[0].memory
    assert mp.lower_bound == 2 * 37 * 4
    assert mp.objects == [256 + 37 * 4]
    assert len({(r.index, r.offset) for r in mp.locations.values()}) == 2


def test_aliases_share_storage_and_extend_lifetime():
    def build(b, pl):
        cache = pl.input("float32", (1, 1, 5, 3), name="cache")
        pos = pl.input("int32", (1,), name="pos")
        x = pl.input("float32", (1, 3), name="x")
        new = pl.op("reshape", [x], {"shape": [1, 1, 1, 3]})
        upd = pl.op("kv_update", [cache, new, pos])
        y = pl.op("relu", [x])
        flat = pl.op("reshape", [upd], {"shape": [1, 15]})
        pl.output(flat, y)
    prog = single_payload_program(build)
    pl = prog.payloads[0]
    mp = plan_session(prog, DeviceLimits(offset_alignment=16)).payloads[0].memory
    cache, x, new, upd, flat, y = 0, 2, 3, 4, 6, 5
    assert mp.locations[upd] == mp.locations[cache]
    assert (mp.locations[flat].index, mp.locations[flat].offset) == (mp.locations[cache].index, mp.locations[cache].offset)
    assert mp.locations[new] == mp.locations[x]
    # y is written while the cache storage is live (it is a payload output): they must not share
    check_memory_plan(pl, mp, DeviceLimits(offset_alignment=16))


def test_objects_split_at_max_buffer_size():
    # Three tensors live at once, each 404 bytes, in objects of at most 1024: two objects.
    def build(b, pl):
        a = pl.input("float32", (1, 101))
        c = pl.input("float32", (1, 101))
        d = pl.op("add", [a, c])
        pl.output(a, c, d)
    prog = single_payload_program(build)
    limits = DeviceLimits(max_buffer_size=1024, max_binding_size=512, offset_alignment=256)
    mp = plan_session(prog, limits).payloads[0].memory
    assert len(mp.objects) == 2 and all(s <= 1024 for s in mp.objects)
    check_memory_plan(prog.payloads[0], mp, limits)


def test_tensor_over_max_buffer_size_names_value_and_limit():
    def build(b, pl):
        x = pl.input("float32", (1, 301), name="big_input")
        pl.output(pl.op("relu", [x]))
    prog = single_payload_program(build)
    with pytest.raises(DeviceError, match=r"value 0 \(big_input\).*1204 bytes.*max_buffer_size of 1000"):
        plan_session(prog, DeviceLimits(max_buffer_size=1000, max_binding_size=1000, offset_alignment=4))


def test_tensor_over_binding_size_is_allowed_at_an_aligned_offset():
    def build(b, pl):
        x = pl.input("float32", (1, 263))
        y = pl.op("relu", [x])
        pl.output(x, y)
    prog = single_payload_program(build)
    limits = DeviceLimits(max_buffer_size=1 << 20, max_binding_size=256, offset_alignment=256)
    mp = plan_session(prog, limits).payloads[0].memory
    assert all(r.nbytes > limits.max_binding_size and r.offset % 256 == 0 for r in mp.locations.values())


def test_read_before_definition_raises_payload_error():
    pl = Payload(values=[Value("float32", (3,)), Value("float32", (3,)), Value("float32", (3,))],
                 inputs=[0], outputs=[2], nodes=[Node("add", [0, 1], [2])])
    with pytest.raises(PayloadError, match=r"payloads\[4\]\.ops\[0\]\.args\[1\]: value 1 is read before"):
        plan_memory(pl, DeviceLimits(), where="payloads[4]")


def test_unknown_op_raises_unsupported_with_path():
    from gpudelegate.errors import UnsupportedOpError
    pl = Payload(values=[Value("float32", (3,)), Value("float32", (3,))], inputs=[0], outputs=[1],
                 nodes=[Node("frobnicate", [0], [1])])
    with pytest.raises(UnsupportedOpError, match=r"payloads\[0\]\.ops\[0\]\.op: unknown op 'frobnicate'"):
        plan_memory(pl, DeviceLimits(), where="payloads[0]")


def test_bad_limits_raise_device_error():
    with pytest.raises(DeviceError, match="offset_alignment must be a positive int"):
        plan_session(_relu_chain(2), DeviceLimits(offset_alignment=0))
