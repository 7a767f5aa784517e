"""``load(path, data_memory=alloc)``: the data segment read into the caller's memory instead of
mapping the file (core/program.py). The program must be the mapped one's, byte for byte; a bad
file fails as it does mapped (PayloadError); a bad ``alloc`` or what it returns is InputError."""

import os
import sys

import pytest

import gpudelegate
from gpudelegate import InputError, PayloadError
from gpudelegate import program as program_mod
from gpudelegate.program import program_document, read_header
from gpudelegate.session import check_source_unchanged
from progbuild import ProgramBuilder, rand_floats, sample_program


def _file(tmp_path, prog=None, name="p.gdp"):
    p = tmp_path / name
    (prog or sample_program()).save(p)
    return p


class Allocs:
    """An ``alloc`` that remembers what it was asked for and hands out bytearrays."""

    def __init__(self, extra: int = 0):
        self.asked = []
        self.extra = extra

    def __call__(self, nbytes):
        self.asked.append(nbytes)
        return bytearray(nbytes + self.extra)


def _same_program(a, b):
    assert program_document(a) == program_document(b)
    for i in range(len(a.constants)):
        assert a.constant_bytes(i).tobytes() == b.constant_bytes(i).tobytes(), f"constants[{i}]"


@pytest.mark.parametrize("extra", [0, 4096 + 3])
def test_the_program_is_the_mapped_one_and_its_data_lies_in_the_callers_memory(tmp_path, extra):
    path = _file(tmp_path)
    alloc = Allocs(extra)
    got = gpudelegate.load(path, data_memory=alloc)
    mapped = gpudelegate.load(path)
    _same_program(got, mapped)
    data_size = read_header(path.read_bytes())[4]
    assert alloc.asked == [data_size]
    assert got.data.nbytes == data_size and got.data.readonly
    assert got.data.obj is not None and isinstance(got.data.obj, bytearray)  # a view of alloc's buffer
    assert getattr(got, "source_file", None) is None


def test_a_large_segment_is_read_in_parts_by_threads_and_arrives_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(program_mod, "READ_PART", 4096)  # parts of a page: several threads here
    b = ProgramBuilder()
    for k in range(3):
        b.constant("float32", (1031 + k, 7), rand_floats((1031 + k) * 7, seed=k))  # prime-ish dims
    pl = b.payload()
    pl.output(pl.op("relu", [pl.input("float32", (3,))]))
    m = b.method("forward")
    (y,) = m.delegate(pl, [m.input("float32", (3,))])
    m.output(y)
    path = _file(tmp_path, b.build())
    seen = []
    real = program_mod._read_exactly
    monkeypatch.setattr(program_mod, "_read_exactly",
                        lambda f, off, into, *a: (seen.append((off, into.nbytes)), real(f, off, into, *a))[1])
    got = gpudelegate.load(path, data_memory=bytearray)
    _same_program(got, gpudelegate.load(path))
    if hasattr(os, "preadv") and (os.cpu_count() or 1) > 1 and sys.platform != "emscripten":
        assert len(seen) > 3, seen  # the head, then the segment in parts
    data_off = read_header(path.read_bytes())[3]
    assert sum(n for off, n in seen if off >= data_off) == got.data.nbytes


def test_a_program_without_constants_asks_for_no_memory(tmp_path):
    b = ProgramBuilder()
    pl = b.payload()
    pl.output(pl.op("relu", [pl.input("float32", (3,))]))
    m = b.method("forward")
    (y,) = m.delegate(pl, [m.input("float32", (3,))])
    m.output(y)
    alloc = Allocs()
    got = gpudelegate.load(_file(tmp_path, b.build()), data_memory=alloc)
    assert alloc.asked == [] and got.data.nbytes == 0


def test_the_file_is_not_read_again_so_a_change_to_it_is_not_a_change_of_the_program(tmp_path):
    path = _file(tmp_path)
    got = gpudelegate.load(path, data_memory=bytearray)
    mapped = gpudelegate.load(path)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # in place: same inode, same size
    with open(path, "r+b") as f:
        f.write(raw)
    os.utime(path, ns=(1, 1))
    check_source_unchanged(got)  # its bytes are its own: nothing to check
    with pytest.raises(PayloadError, match="changed"):
        check_source_unchanged(mapped)


def test_every_truncation_is_refused_as_when_mapped(tmp_path):
    path = _file(tmp_path)
    raw = path.read_bytes()
    for n in range(0, len(raw), 7):
        path.write_bytes(raw[:n])
        with pytest.raises(PayloadError) as mapped:
            gpudelegate.load(path)
        with pytest.raises(PayloadError) as read:
            gpudelegate.load(path, data_memory=bytearray)
        assert (read.value.path, str(read.value)) == (mapped.value.path, str(mapped.value)), n


def test_a_file_cut_while_it_is_read_names_the_file(tmp_path):
    path = _file(tmp_path)
    data_off = read_header(path.read_bytes())[3]

    def cut_then_alloc(nbytes):  # the head was read; the segment is read after this returns
        os.truncate(path, data_off + 64)
        return bytearray(nbytes)

    want = gpudelegate.loads(path.read_bytes())
    try:
        got = gpudelegate.load(path, data_memory=cut_then_alloc)
    except PayloadError as e:
        assert str(path) in str(e) and "truncated while loading" in str(e)
        return
    # Pyodide's in-memory file system keeps the bytes of a file open while it is cut: then they
    # must be the whole program, its hashes checked
    assert sys.platform == "emscripten", "a read past the new end of the file returned bytes"
    _same_program(got, want)


def test_a_flipped_bit_in_the_data_is_caught_by_the_hashes(tmp_path):
    path = _file(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[read_header(raw)[3] + 5] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(PayloadError) as ei:
        gpudelegate.load(path, data_memory=bytearray)
    assert ei.value.path.startswith("constants[") and "hash" in str(ei.value)
    gpudelegate.load(path, data_memory=bytearray, verify_hashes=False)  # as when mapped


def test_a_missing_file_is_the_payload_error_of_a_mapped_load(tmp_path):
    with pytest.raises(PayloadError, match="cannot read program file"):
        gpudelegate.load(tmp_path / "nope.gdp", data_memory=bytearray)


@pytest.mark.parametrize("alloc,words", [
    (lambda n: bytes(n), "read-only"),
    (lambda n: memoryview(bytes(n)), "read-only"),
    (lambda n: bytearray(n - 1), "fewer than"),
    (lambda n: bytearray(0), "fewer than"),
    (lambda n: memoryview(bytearray(2 * n))[::2], "non-contiguous"),
    (lambda n: None, "not a buffer"),
    (lambda n: n, "not a buffer"),
])
def test_what_alloc_returns_must_be_writable_contiguous_and_large_enough(tmp_path, alloc, words):
    with pytest.raises(InputError, match=words):
        gpudelegate.load(_file(tmp_path), data_memory=alloc)


def test_data_memory_must_be_callable(tmp_path):
    with pytest.raises(InputError, match="data_memory must be a callable"):
        gpudelegate.load(_file(tmp_path), data_memory=bytearray(64))


def test_an_error_of_alloc_itself_reaches_the_caller(tmp_path):
    def no_memory(nbytes):
        raise MemoryError(f"{nbytes} bytes")

    with pytest.raises(MemoryError):
        gpudelegate.load(_file(tmp_path), data_memory=no_memory)
