"""Hostile bytes: whatever a file holds, ``gpudelegate.loads`` raises PayloadError or returns a
program that writes back and loads again; it never raises anything else, never hangs, and never
allocates more than the file's size justifies.

The hypothesis tests are bounded (about 20 s in all on a slow core): max_examples per test, a
per-example deadline (a hang or a quadratic blow-up fails it), and no example database (the run
is hermetic; a failure prints the example and the seed to reproduce it). For a long local hunt,
``GPUDELEGATE_FUZZ_SCALE=50 pytest tests/test_fuzz_program.py`` multiplies every example count.
"""

import copy
import os
import time
import tracemalloc

import msgpack
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install -e '.[test]')")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import gpudelegate  # noqa: E402
from gpudelegate import PayloadError, dtypes, ops  # noqa: E402
from gpudelegate.program import HEADER_SIZE, program_document  # noqa: E402
from progbuild import ProgramBuilder, file_bytes, rand_floats, sample_program, split_file  # noqa: E402


def chain_program():
    """A second, differently shaped program (fp16 prepack, several nodes, two prepacked weights
    read twice) so splices mix two real layouts."""
    b = ProgramBuilder(metadata={"name": "chain", "vocab": ["a", "b"], "nested": {"x": [1, 2.5, None]}})
    w1 = b.constant("float32", (11, 13), rand_floats(143, seed=21))
    w2 = b.constant("float32", (11, 13), rand_floats(143, seed=22))
    g = b.constant("float32", (13,), rand_floats(13, seed=23))
    p = b.payload()
    x = p.input("float32", (3, 11))
    a = p.prepack(p.constant(w1), "fp16")
    c = p.prepack(p.constant(w2))
    gd = p.prepack(p.constant(g))
    h = p.op("matmul", [x, p.op("cast", [a], {"dtype": "float32"})])
    h = p.op("rms_norm", [h, gd], {"eps": 1e-6})
    h = p.op("silu", [h])
    y = p.op("linear", [h, c])
    p.output(p.op("add", [y, x]))
    p.schedule_offload()
    m = b.method("forward")
    (o,) = m.delegate(p, [m.input("float32", (3, 11))])
    m.output(m.op("softmax", [o], {"dim": 1}))
    return b.build()


BASES = [sample_program().to_bytes(), chain_program().to_bytes()]
DOCS = [split_file(raw) for raw in BASES]
SCALE = float(os.environ.get("GPUDELEGATE_FUZZ_SCALE", "1"))


def fuzz(n):
    return settings(max_examples=max(1, int(n * SCALE)), deadline=2000, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def load_or_refuse(raw: bytes):
    """The property: PayloadError, or a program that round-trips."""
    try:
        prog = gpudelegate.loads(raw)
    except PayloadError as e:
        assert str(e), "a PayloadError must say what is wrong"
        return None
    again = gpudelegate.loads(prog.to_bytes())
    # Compared as bytes: a NaN attribute is legal and NaN != NaN.
    assert msgpack.packb(program_document(again)) == msgpack.packb(program_document(prog))
    return prog


def test_bases_are_valid():
    for raw in BASES:
        assert load_or_refuse(raw) is not None


# ------------------------------------------------------------------ byte-level mutations

@fuzz(1000)
@given(st.sampled_from(range(len(BASES))), st.data())
def test_byte_flips(which, data):
    raw = bytearray(BASES[which])
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(1, 255)), min_size=1, max_size=6))
    for pos, xor in flips:
        raw[pos] ^= xor
    load_or_refuse(bytes(raw))


@fuzz(300)
@given(st.sampled_from(range(len(BASES))), st.data())
def test_truncation_and_junk(which, data):
    raw = BASES[which]
    cut = data.draw(st.integers(0, len(raw)))
    junk = data.draw(st.binary(max_size=200))
    out = raw[:cut] + junk
    if out == raw:
        return
    assert load_or_refuse(out) is None or cut == len(raw) and not junk


@fuzz(600)
@given(st.data())
def test_splices_of_two_files(data):
    a, b = data.draw(st.permutations(BASES))
    i = data.draw(st.integers(0, len(a)))
    j = data.draw(st.integers(0, len(b)))
    load_or_refuse(a[:i] + b[j:])


# ------------------------------------------------------------------ document-level mutations

KEYS = ["version", "constants", "payloads", "methods", "metadata", "key", "dtype", "shape", "nbytes",
        "offset", "values", "inputs", "outputs", "ops", "op", "args", "attrs", "constant", "name",
        "backend", "prepack", "src", "dst", "layout", "offload", "reads", "payload", "dim", "forward"]
WORDS = list(dtypes.DTYPES) + list(ops.OP_NAMES) + ["identity", "fp16", "", "forward", "gpudelegate", "float64"]
EDGE_INTS = [-(1 << 63), -2, -1, 0, 1, 2, 3, 5, 7, 63, 64, 65, 128, (1 << 31), (1 << 32), (1 << 40), (1 << 63), (1 << 64) - 1]

scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EDGE_INTS), st.integers(-3, 20),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(WORDS), st.text(max_size=6), st.binary(max_size=6),
)
plausible = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.sampled_from(KEYS), inner, max_size=6)),
    max_leaves=24,
)


def _paths(node, prefix=()):
    """Every (container path, key) of a document, to pick mutation sites from."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append(prefix + (i,))
            out += _paths(v, prefix + (i,))
    return out


SITES = [_paths(doc) for doc, _ in DOCS]


def _parent(doc, path):
    for k in path[:-1]:
        doc = doc[k]
    return doc


@fuzz(1500)
@given(st.sampled_from(range(len(BASES))), st.data())
def test_structural_mutations(which, data):
    doc, seg = copy.deepcopy(DOCS[which][0]), DOCS[which][1]
    for _ in range(data.draw(st.integers(1, 3))):
        site = data.draw(st.sampled_from(SITES[which]))
        try:
            parent = _parent(doc, site)
            key = site[-1]
            action = data.draw(st.sampled_from(["replace", "delete", "grow", "int", "dup"]))
            if action == "replace":
                parent[key] = data.draw(plausible)
            elif action == "delete":
                del parent[key]
            elif action == "grow" and isinstance(parent[key], (list, dict)):
                if isinstance(parent[key], list):
                    parent[key].append(data.draw(plausible))
                else:
                    parent[key][data.draw(st.sampled_from(KEYS))] = data.draw(plausible)
            elif action == "int" and type(parent[key]) is int:
                parent[key] += data.draw(st.sampled_from([-65, -64, -2, -1, 1, 2, 64, 1 << 32]))
            elif action == "dup" and isinstance(parent, list):
                parent.insert(key, copy.deepcopy(parent[key]))
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or retyped this site
    try:
        raw = file_bytes(doc, seg)
    except (ValueError, OverflowError, TypeError):
        return  # not representable in msgpack (e.g. an int past 64 bits after "int")
    load_or_refuse(raw)


@fuzz(600)
@given(st.fixed_dictionaries({k: st.one_of(st.just(v), plausible) for k, v in DOCS[0][0].items()}),
       st.integers(0, 2))
def test_random_documents_with_plausible_keys(doc, blocks):
    data = bytes(range(256))[: 64 * blocks] if blocks else b""
    try:
        raw = file_bytes(doc, data)
    except (ValueError, OverflowError, TypeError):
        return
    load_or_refuse(raw)


@fuzz(400)
@given(plausible)
def test_arbitrary_documents(doc):
    try:
        raw = file_bytes(doc)
    except (ValueError, OverflowError, TypeError):
        return
    with pytest.raises(PayloadError):
        gpudelegate.loads(raw)


# ------------------------------------------------------------------ size claims: fail fast, allocate nothing

def _measure(raw):
    """(exception, seconds, peak bytes allocated by Python) of loading ``raw``."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        gpudelegate.loads(raw)
        err = None
    except Exception as e:  # the caller asserts the type
        err = e
    dt = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return err, dt, peak


# Loading the ~1.7 kB sample takes well under 100 kB of Python allocations; a claim about a
# terabyte-sized tensor must not change that. 1 MiB and 1 s leave room for slow CI machines.
PEAK_LIMIT = 1 << 20
TIME_LIMIT = 1.0


@pytest.mark.parametrize("where", ["constant", "value"])
def test_a_2_pow_40_element_tensor_fails_fast_without_allocating(where):
    doc, data = copy.deepcopy(DOCS[0])
    if where == "constant":
        doc["constants"][0].update(shape=[1 << 20, 1 << 20], nbytes=4 << 40)
        path = "constants[0].shape"
    else:
        doc["methods"]["step"]["values"][0]["shape"] = [1 << 10, 1 << 10, 1 << 10, 1 << 10]
        path = "methods.step.values[0].shape"
    err, dt, peak = _measure(file_bytes(doc, data))
    assert isinstance(err, PayloadError) and err.path == path, repr(err)
    assert "over the" in str(err)
    assert dt < TIME_LIMIT and peak < PEAK_LIMIT, (dt, peak)


def test_a_large_but_legal_intermediate_is_only_described():
    # 2**38 bytes is under the per-tensor limit: validation accepts it without allocating it
    # (planning decides later whether a device can hold it).
    b = ProgramBuilder()
    m = b.method("big")
    x = m.input("float32", (1 << 12, 1 << 12, 1 << 12))
    m.output(m.op("relu", [x]))
    err, dt, peak = _measure(b.build().to_bytes())
    assert err is None and dt < TIME_LIMIT and peak < PEAK_LIMIT, (err, dt, peak)


def _with_document(doc_bytes: bytes) -> bytes:
    """A file with a correct header around raw (possibly hostile) document bytes."""
    from gpudelegate.program import FORMAT_VERSION, align_up, pack_header

    data_off = align_up(HEADER_SIZE + len(doc_bytes))
    header = pack_header(FORMAT_VERSION, doc_bytes, 0)
    return header + doc_bytes + bytes(data_off - HEADER_SIZE - len(doc_bytes))


@pytest.mark.parametrize("blob,what", [
    (b"\xdd\xff\xff\xff\xff", "array claiming 2**32-1 elements"),
    (b"\xdf\xff\xff\xff\xff", "map claiming 2**32-1 entries"),
    (b"\xc6\xff\xff\xff\xff", "bin claiming 4 GiB"),
    (b"\xdb\xff\xff\xff\xff", "str claiming 4 GiB"),
    (b"\x91" * 100000 + b"\xc0", "100000 nested arrays"),
    (b"\x81\xa7version" * 3000 + b"\x01", "3000 nested maps"),
])
def test_msgpack_bombs(blob, what):
    err, dt, peak = _measure(_with_document(blob))
    assert isinstance(err, PayloadError) and err.path == "document", (what, repr(err))
    # The nested cases hold ~100 kB of input; the limit is about the claims, not the input.
    assert dt < TIME_LIMIT and peak < PEAK_LIMIT + 20 * len(blob), (what, dt, peak)


def test_deep_but_decodable_nesting_is_refused_by_validation():
    # 1000 levels decode (msgpack's limit is 1024) but are no plain attribute/metadata value.
    doc, data = copy.deepcopy(DOCS[0])
    deep = 1
    for _ in range(1000):
        deep = [deep]
    doc["metadata"]["deep"] = deep
    err, dt, peak = _measure(file_bytes(doc, data))
    assert isinstance(err, PayloadError) and err.path.startswith("metadata.deep"), repr(err)


# ------------------------------------------------------------------ never hangs: validation is linear

def _wide_file(n: int) -> bytes:
    """A method with n inputs, n relu nodes and n outputs (every per-value check runs n times)."""
    values = [{"dtype": "float32", "shape": [3]} for _ in range(2 * n)]
    ops_ = [{"op": "relu", "args": [i], "outputs": [n + i], "attrs": {}} for i in range(n)]
    doc = {"version": 1, "constants": [], "payloads": [], "metadata": {},
           "methods": {"wide": {"values": values, "inputs": list(range(n)), "outputs": list(range(n, 2 * n)),
                                "ops": ops_}}}
    return file_bytes(doc)


def test_validation_time_grows_linearly():
    # A quadratic check (e.g. `x in some_list` per value) would make the 8x larger file take ~64x
    # longer; linear checks take ~8x. The slack absorbs timer noise on a busy machine.
    # Both sides take the best of several loads: one load of the big file once took 0.92 s against
    # a best small load of 24 ms (38x, a collector pause or a busy core), which no quadratic check
    # explains; the minimum of a few loads is the load's own cost.
    small, big = _wide_file(2500), _wide_file(20000)
    t_small = min(_timed_load(small) for _ in range(3))
    t_big = min(_timed_load(big) for _ in range(3))
    assert t_big < 24 * t_small + 0.2, (t_small, t_big)
    assert t_big < 10.0, t_big


def _timed_load(raw: bytes) -> float:
    t0 = time.perf_counter()
    prog = gpudelegate.loads(raw)
    dt = time.perf_counter() - t0
    assert len(prog.methods["wide"].nodes) > 0
    return dt
