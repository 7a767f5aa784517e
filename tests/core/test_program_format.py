"""The program file on disk: round trips, header checks, truncation and bit flips.

Pure core (listed in tests/core_tests.txt): no numpy, runs in Pyodide too.
"""

import random
import struct

import pytest

import gpudelegate
from gpudelegate import PayloadError
from gpudelegate.program import ALIGN, HEADER_SIZE, MAGIC, iter_program_chunks, program_document, read_header
from progbuild import ProgramBuilder, file_bytes, pack, rand_floats, sample_program, reseal, split_file, unpack


def _doc_without_offsets(p):
    d = program_document(p)
    for c in d["constants"]:
        c.pop("offset")
    return d


# ------------------------------------------------------------------ round trips

def test_round_trip_two_methods_share_one_copy_of_the_constants(tmp_path):
    prog = sample_program()
    before = _doc_without_offsets(prog)  # offsets are assigned by the writer
    path = tmp_path / "m.gdp"
    seen = []
    size = prog.save(path, progress=lambda done, total: seen.append((done, total)))
    raw = path.read_bytes()
    assert size == len(raw) and raw == prog.to_bytes()  # deterministic writer
    assert seen and seen[-1] == (prog.constant_bytes_total, prog.constant_bytes_total)

    back = gpudelegate.load(path)
    assert _doc_without_offsets(back) == before
    assert program_document(back) == program_document(prog)
    # forward and decode both run payload 0 (which prepacks w and bias) and decode also reads the
    # bias directly: two constants, stored once, each at a 64-byte aligned offset.
    assert len(back.constants) == 2
    assert all(c.offset % ALIGN == 0 for c in back.constants)
    _, _, _, data_off, data_size = read_header(raw)
    assert data_off % ALIGN == 0
    assert data_size == sum(-(-c.nbytes // ALIGN) * ALIGN for c in back.constants)
    for i in range(len(prog.constants)):
        assert bytes(back.constant_bytes(i)) == bytes(prog.constant_bytes(i))
    assert unpack("float32", back.constant_bytes(1)) == unpack("float32", pack("float32", rand_floats(5, seed=2)))
    assert back.methods["step"].values[back.methods["step"].outputs[0]].shape == (1, 2, 11, 3)


def test_loads_keeps_constants_as_views_of_the_buffer():
    raw = bytearray(sample_program().to_bytes())
    prog = gpudelegate.loads(raw)
    _, _, _, data_off, _ = read_header(raw)
    c = prog.constants[0]
    raw[data_off + c.offset] ^= 0xFF  # mutate the underlying buffer: the view must see it
    assert prog.constant_bytes(0)[0] == raw[data_off + c.offset]


def test_second_round_trip_is_byte_identical():
    raw = sample_program().to_bytes()
    assert gpudelegate.loads(raw).to_bytes() == raw


def test_identical_constants_are_stored_once_and_other_dtype_views_are_not():
    b = ProgramBuilder()
    blob = pack("float32", rand_floats(13, seed=5))
    i = b.constant("float32", (13,), blob)
    j = b.constant("float32", (13,), blob)
    k = b.constant("int32", (13,), blob)  # same bytes, another view: another key
    assert i == j != k
    m = b.method("f")
    m.output(m.op("neg", [m.constant(i)]))
    prog = gpudelegate.loads(b.build().to_bytes())
    assert len(prog.constants) == 2 and prog.constants[0].key != prog.constants[1].key


def test_program_without_constants_or_payloads():
    b = ProgramBuilder()
    m = b.method("f")
    m.output(m.op("exp", [m.input("float32", (3,))]))
    raw = b.build().to_bytes()
    assert read_header(raw)[4] == 0  # empty data segment
    assert gpudelegate.loads(raw).method_names == ["f"]


def test_empty_constant_round_trips():
    b = ProgramBuilder()
    e = b.constant("float32", (0, 3), b"")
    w = b.constant("float32", (3,), rand_floats(3, seed=9))
    m = b.method("f")
    m.output(m.op("add", [m.input("float32", (3,)), m.constant(w)]), m.constant(e))
    prog = gpudelegate.loads(b.build().to_bytes())
    assert [c.nbytes for c in prog.constants] == [0, 12]


def test_large_constant_is_written_in_chunks():
    b = ProgramBuilder()
    blob = pack("float32", rand_floats(1031, seed=3))  # 4124 bytes, prime element count
    i = b.constant("float32", (1031,), blob)
    m = b.method("f")
    m.output(m.op("relu", [m.constant(i)]))
    prog = b.build()
    chunks = list(iter_program_chunks(prog, chunk_bytes=1000))
    assert len(chunks) >= 1 + 5  # header+doc, then five pieces of the constant, then padding
    assert b"".join(chunks) == prog.to_bytes()
    assert bytes(gpudelegate.loads(b"".join(chunks)).constant_bytes(0)) == blob


# ------------------------------------------------------------------ header

def _patch_header(raw: bytes, fmt: str, offset: int, value) -> bytes:
    out = bytearray(raw)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


RAW = sample_program().to_bytes()


@pytest.mark.parametrize("raw,path,words", [
    (b"", "header", "shorter than"),
    (RAW[:HEADER_SIZE - 1], "header", "shorter than"),
    (b"PK\x03\x04" + RAW[4:], "header.magic", "not a gpudelegate program"),
    (_patch_header(RAW, "<I", 8, 2), "header.version", "not supported"),
    (_patch_header(RAW, "<I", 8, 0), "header.version", "not supported"),
    (_patch_header(RAW, "<I", 12, 32), "header.header_size", "expected 64"),
    (_patch_header(RAW, "<Q", 16, 128), "header.document_offset", "expected 64"),
    (_patch_header(RAW, "<Q", 24, 0), "header.document_size", "empty"),
    (_patch_header(RAW, "<Q", 24, 1 << 62), "header.document_size", "overlaps"),
    (_patch_header(RAW, "<Q", 32, struct.unpack_from("<Q", RAW, 32)[0] + 1), "header.data_offset", "aligned"),
    (_patch_header(RAW, "<Q", 32, struct.unpack_from("<Q", RAW, 32)[0] + 64), "header.data_offset", "next 64-byte boundary"),
    (_patch_header(RAW, "<Q", 40, struct.unpack_from("<Q", RAW, 40)[0] + 8), "header.data_size", "multiple of 64"),
    (_patch_header(RAW, "<Q", 40, 1 << 63), "header.data_size", "runs past the end"),
    (_patch_header(RAW, "<Q", 40, struct.unpack_from("<Q", RAW, 40)[0] - 64), "header.data_size", "trailing bytes"),
    (RAW + bytes(64), "header.data_size", "trailing bytes"),
    (_patch_header(RAW, "<B", 50, 1), "header.document_sha256", "does not match the document"),
])
def test_bad_header(raw, path, words):
    with pytest.raises(PayloadError) as ei:
        gpudelegate.loads(raw)
    assert ei.value.path == path and words in str(ei.value), str(ei.value)


def test_nonzero_padding_after_document_is_refused():
    _, _, doc_size, data_off, _ = read_header(RAW)
    assert HEADER_SIZE + doc_size < data_off, "sample document must leave padding for this test"
    bad = bytearray(RAW)
    bad[HEADER_SIZE + doc_size] = 1
    with pytest.raises(PayloadError) as ei:
        gpudelegate.loads(bytes(bad))
    assert ei.value.path == "header.document_size" and "not zero" in str(ei.value)


def test_document_that_is_not_msgpack():
    doc, data = split_file(RAW)
    raw = bytearray(file_bytes(doc, data))
    raw[HEADER_SIZE] = 0xC1  # the one byte msgpack never uses
    with pytest.raises(PayloadError) as ei:
        gpudelegate.loads(raw)
    assert ei.value.path == "header.document_sha256"
    with pytest.raises(PayloadError) as ei:
        gpudelegate.loads(reseal(raw))
    assert ei.value.path == "document" and "msgpack" in str(ei.value)


def test_document_version_must_match_the_header():
    doc, data = split_file(RAW)
    doc["version"] = 7
    with pytest.raises(PayloadError) as ei:
        gpudelegate.loads(file_bytes(doc, data))
    assert ei.value.path == "version" and "not supported" in str(ei.value)


def test_empty_file_on_disk(tmp_path):
    p = tmp_path / "empty.gdp"
    p.write_bytes(b"")
    with pytest.raises(PayloadError) as ei:
        gpudelegate.load(p)
    assert ei.value.path == "header"


def test_magic_constant_is_what_the_file_starts_with():
    assert RAW[:8] == MAGIC


# ------------------------------------------------------------------ truncation and bit flips

def test_every_truncation_is_refused():
    # Every cut point of a small file (~1.7 kB): header, document and data segment.
    for n in range(len(RAW)):
        with pytest.raises(PayloadError):
            gpudelegate.loads(RAW[:n])


def test_every_bit_flip_in_the_header_is_refused():
    # The header has no free bits: every field is checked against the file's actual layout.
    for byte in range(HEADER_SIZE):
        for bit in range(8):
            bad = bytearray(RAW)
            bad[byte] ^= 1 << bit
            with pytest.raises(PayloadError):
                gpudelegate.loads(bytes(bad))


def test_every_byte_of_the_data_segment_is_covered():
    # One random bit in every byte of the data segment, constants and padding alike: the
    # SHA-256 keys catch the constants, the zero-padding check catches the rest.
    _, _, _, data_off, data_size = read_header(RAW)
    rng = random.Random(11)
    for pos in range(data_off, data_off + data_size):
        bad = bytearray(RAW)
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(PayloadError) as ei:
            gpudelegate.loads(bytes(bad))
        assert ei.value.path.startswith(("constants[", "data")), str(ei.value)


def test_bit_flips_in_the_document_never_escape_as_other_errors():
    # The document has no checksum, so a flip may leave a valid (different) program, e.g. a
    # changed name; it must never raise anything but PayloadError.
    _, _, doc_size, _, _ = read_header(RAW)
    rng = random.Random(12)
    refused = 0
    for pos in range(HEADER_SIZE, HEADER_SIZE + doc_size):
        bad = bytearray(RAW)
        bad[pos] ^= 1 << rng.randrange(8)
        try:
            gpudelegate.loads(bytes(bad))
        except PayloadError:
            refused += 1
    assert refused > doc_size // 2  # most flips hit structure, ids, sizes or keys


def test_verify_hashes_can_be_skipped_but_catches_a_flip_by_default():
    _, _, _, data_off, _ = read_header(RAW)
    bad = bytearray(RAW)
    bad[data_off + 3] ^= 0x10
    gpudelegate.loads(bytes(bad), verify_hashes=False)  # structure is fine
    with pytest.raises(PayloadError) as ei:
        gpudelegate.loads(bytes(bad))
    assert ei.value.path == "constants[0]" and "corrupt data segment" in str(ei.value)


# ------------------------------------------------------------------ the inspect report (gpudelegate inspect FILE)

def _layer_chain(layers=6, width=13):
    """x -> `layers` linears, each with its own prepacked [width, width] weight, in one payload
    called by two methods; plus one constant no method reads."""
    b = ProgramBuilder(metadata={"model": "chain"})
    ws = [b.constant("float32", (width, width), rand_floats(width * width, seed=40 + i)) for i in range(layers)]
    b.constant("float32", (3,), rand_floats(3, seed=99))  # unused
    p = b.payload()
    h = p.input("float32", (3, width), "x")
    for i, w in enumerate(ws):
        h = p.op("linear", [h, p.prepack(p.constant(w, f"w{i}"))])
    p.output(h)
    p.schedule_offload()
    for name in ("prefill", "decode"):
        m = b.method(name)
        (o,) = m.delegate(p, [m.input("float32", (3, width), "x")])
        m.output(m.op("tanh", [o]))
    return b.build()


def test_describe_counts_methods_ops_payloads_and_constants():
    import json

    from gpudelegate.inspect import describe

    raw = sample_program().to_bytes()
    prog = gpudelegate.loads(raw)
    d = describe(prog, file_size=len(raw))
    json.dumps(d)  # plain data, for a --json flag or a web page
    assert describe(prog)["file"] == d["file"]  # computed layout == the real file
    assert d["file"]["file_bytes"] == len(raw) and d["file"]["constant_bytes"] == 80
    assert d["file"]["data_segment_bytes"] == read_header(raw)[4]

    fwd, dec = d["methods"]["forward"], d["methods"]["decode"]
    assert [t["shape"] for t in fwd["inputs"]] == [[7, 3]] and fwd["inputs"][0]["name"] == "x"
    assert fwd["ops"] == {"delegate": 2} and fwd["payloads"] == [0, 1]
    assert fwd["delegated_ops"] == {"linear": 1, "relu": 1, "softmax": 1}
    assert dec["ops"] == {"add": 1, "delegate": 1} and dec["payloads"] == [0]
    assert d["methods"]["step"]["ops"] == {"kv_update": 1} and d["methods"]["step"]["payloads"] == []

    assert [(p["backend"], p["methods"], p["prepack"], p["offload_schedule"]) for p in d["payloads"]] == [
        ("gpudelegate", ["forward", "decode"], 2, True), ("other", ["forward"], 0, False)]
    c = d["constants"]
    assert (c["count"], c["total_bytes"], c["shared_count"], c["shared_bytes"], c["unused_count"]) == (2, 80, 2, 80, 0)
    assert c["largest"][0]["shape"] == [5, 3] and c["largest"][0]["methods"] == ["forward", "decode"]

    plan = d["plan"]
    assert set(plan["payloads"]) == {"0", "1"}
    for mem in plan["payloads"].values():
        assert 0 < mem["lower_bound"] <= mem["arena_bytes"] == sum(mem["objects"])
    assert plan["prepack"]["buffers"] == 2 and plan["prepack"]["device_bytes"] == 80
    assert plan["offload"]["floor"] > 0 and "with_budget" not in plan["offload"]


def test_describe_offload_floor_and_budget():
    from gpudelegate.inspect import describe, format_report, human_bytes

    prog = gpudelegate.loads(_layer_chain().to_bytes())
    d = describe(prog)
    off = d["plan"]["offload"]
    total, floor = off["all_resident_bytes"], off["floor"]
    assert off["weights"] == 6 and total == 6 * 13 * 13 * 4
    assert 0 < floor < total  # streaming six weights needs less than keeping them all

    ok = describe(prog, weight_budget=floor)["plan"]["offload"]["with_budget"]
    assert ok["fits"] and ok["streamed"] > 0 and ok["peak_bytes"] <= floor
    assert ok["resident"] + ok["streamed"] == 6 and ok["loads_per_run"] >= ok["streamed"]

    low = describe(prog, weight_budget=floor - 1)
    b = low["plan"]["offload"]["with_budget"]
    assert not b["fits"] and "BudgetError" in b["error"] and str(floor) in b["error"]
    text = format_report(low)
    assert f"offload: floor {human_bytes(floor)} = {floor} bytes (the smallest --budget) at prefetch depth 2" in text
    assert "does not fit" in text and str(floor) in text

    c = d["constants"]
    assert c["unused_count"] == 1 and c["unused_bytes"] == 12 and c["shared_count"] == 6
    assert d["payloads"][0]["methods"] == ["prefill", "decode"]


def test_format_report_names_every_section():
    from gpudelegate.inspect import describe, format_report

    raw = sample_program().to_bytes()
    text = format_report(describe(gpudelegate.loads(raw), weight_budget=4096, file_size=len(raw)))
    for words in ("program v1:", f"({len(raw)} bytes)", "metadata: dims, model", "methods (3):",
                  "forward(x: float32[7, 3]) -> (%2: float32[7, 5])", "payloads [0, 1] run: linear 1, relu 1, softmax 1",
                  "[1] other: 1 nodes", "called by forward, decode", "constants: 2, 80 B",
                  "(forward, decode)", "payload 0: arena", "lower bound", "prepack: 2 buffers",
                  "offload: floor", "budget 4.0 KiB: peak 80 B; 2 resident"):
        assert words in text, f"{words!r} not in:\n{text}"


def test_describe_reports_a_plan_that_cannot_be_made():
    from gpudelegate.inspect import describe, format_report
    from gpudelegate.plan.types import DeviceLimits

    tiny = DeviceLimits(max_buffer_size=64, max_binding_size=64, name="tiny")
    d = describe(gpudelegate.loads(sample_program().to_bytes()), limits=tiny)
    assert "DeviceError" in d["plan"]["error"]
    text = format_report(d)
    assert "plan for tiny limits" in text and "cannot plan: DeviceError" in text
