"""web/loader.py (pure Python, runs here too): a program decoded from its head bytes alone, and
the streaming checker (``Download``) that verifies every constant's hash as the file arrives in
pieces, as the browser's download loop feeds it (there: a JS Uint8Array; here: Python bytes, the
same code past the copy)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "core"))

import progbuild  # noqa: E402  (tests/core/progbuild.py)
from gpudelegate import PayloadError, loads  # noqa: E402
from gpudelegate.program import constant_key, program_document  # noqa: E402
from gpudelegate.web import loader  # noqa: E402


@pytest.fixture(scope="module")
def blob():
    return progbuild.sample_program().to_bytes()


def test_head_decodes_like_the_whole_file(blob):
    n = loader.head_size(blob[:64])
    head = blob[:n]
    p = loader.loads_head(head, len(blob))
    full = loads(blob)
    assert p.data is None
    assert program_document(p) == program_document(full)
    # The constants' bytes are where the data segment starts + their offsets, and their keys are
    # the salted hashes the browser can check with crypto.subtle.
    for i, c in enumerate(p.constants):
        raw = blob[n + c.offset:n + c.offset + c.nbytes]
        assert raw == bytes(full.constant_bytes(i))
        import hashlib
        assert hashlib.sha256(raw + loader.key_salt(c.dtype, c.shape)).hexdigest() == c.key == \
            constant_key(c.dtype, c.shape, raw)


def test_wrong_total_size_is_refused(blob):
    n = loader.head_size(blob[:64])
    with pytest.raises(PayloadError, match=r"header\.data_size.*truncated"):
        loader.loads_head(blob[:n], len(blob) - 64)
    with pytest.raises(PayloadError, match=r"header\.data_size"):
        loader.loads_head(blob[:n], len(blob) + 64)


def test_foreign_and_short_heads(blob):
    with pytest.raises(PayloadError, match=r"header\.magic"):
        loader.head_size(b"NOTAPROG" + blob[8:64])
    with pytest.raises(PayloadError, match=r"^header: file is 10 bytes"):
        loader.head_size(blob[:10])
    n = loader.head_size(blob[:64])
    with pytest.raises(PayloadError, match=r"header\.data_offset.*head bytes"):
        loader.loads_head(blob[:n - 1], len(blob))


def test_corrupt_document_is_a_payload_error(blob):
    n = loader.head_size(blob[:64])
    bad = bytearray(blob[:n])
    bad[64] = 0xC1  # a byte msgpack never uses
    with pytest.raises(PayloadError, match=r"^header\.document_sha256"):
        loader.loads_head(bytes(bad), len(blob))  # the header's digest catches it first
    from progbuild import reseal
    with pytest.raises(PayloadError, match=r"^document"):
        loader.loads_head(reseal(bad), len(blob))


@pytest.fixture(scope="module")
def big():
    """A file whose constants span many 64-byte pieces, with padding between them (sizes that
    are not multiples of 64) and an empty constant."""
    b = progbuild.ProgramBuilder()
    a = b.constant("float32", (37, 5), progbuild.rand_floats(185, seed=3))
    c = b.constant("float32", (3,), progbuild.rand_floats(3, seed=4))
    e = b.constant("float32", (0, 4), b"")
    d = b.constant("float32", (29, 37), progbuild.rand_floats(1073, seed=5))
    pl = b.payload()
    x = pl.input("float32", (2, 5), "x")
    y = pl.op("linear", [x, pl.prepack(pl.constant(a, "layer.w"))])
    pl.output(pl.op("linear", [y, pl.prepack(pl.constant(d, "proj.w"))]))
    pl.schedule_offload()
    m = b.method("forward")
    (o,) = m.delegate(pl, [m.input("float32", (2, 5), "x")])
    m.output(o)
    m.output(m.op("add", [m.input("float32", (3,), "z"), m.constant(c, "bias3")]))
    m.output(m.op("reshape", [m.constant(e, "empty")], {"shape": [0, 4]}))
    return b.build().to_bytes()


def _steps(total, sizes):
    """Arrival points: irregular network chunks."""
    at, k = 0, 0
    while at < total:
        at = min(total, at + sizes[k % len(sizes)])
        k += 1
        yield at


@pytest.mark.parametrize("piece", [64, 192, 1 << 20])
def test_download_in_pieces_gives_the_program(big, piece):
    full = loads(big)
    dl = loader.Download(big, len(big), piece=piece)
    for at in _steps(len(big), [1, 63, 500, 7, 64, 129]):
        dl.advance(at)
    prog = dl.program()
    assert dl.pos == len(big) and dl.verified == len(full.constants)
    assert program_document(prog) == program_document(full)
    for i in range(len(full.constants)):
        assert bytes(prog.constant_bytes(i)) == bytes(full.constant_bytes(i))
    assert loader.program_from_bytes(big, piece=piece).constants == full.constants


def test_corrupt_constant_names_it(big):
    full = loads(big)
    names = loader.constant_names(full)
    data_off = loader.head_size(big[:64])
    for i, c in enumerate(full.constants):
        if not c.nbytes:
            continue
        bad = bytearray(big)
        bad[data_off + c.offset + c.nbytes // 2] ^= 0x10
        dl = loader.Download(bytes(bad), piece=64)
        want = rf"^constants\[{i}\] \({names[i]!r}\): bytes at data\[{c.offset}:{c.offset + c.nbytes}\] hash to"
        with pytest.raises(PayloadError, match=want):
            for at in _steps(len(bad), [100]):
                dl.advance(at)
        # before the end of the file: the check runs as the constant's bytes complete
        assert dl.pos <= data_off + c.offset + c.nbytes + 64


def test_corrupt_padding_truncation_and_size(big):
    full = loads(big)
    data_off = loader.head_size(big[:64])
    last = max(full.constants, key=lambda c: c.offset + c.nbytes)
    bad = bytearray(big)
    bad[data_off + last.offset + last.nbytes] = 1  # the zero padding after the last constant
    with pytest.raises(PayloadError, match=r"^data: padding bytes"):
        loader.program_from_bytes(bytes(bad), piece=64)
    dl = loader.Download(big[:len(big) - 64] + bytes(64), len(big), piece=64)
    dl.advance(len(big) - 64)
    with pytest.raises(PayloadError, match=r"truncated download"):
        dl.program()
    with pytest.raises(PayloadError, match=r"holds 10 bytes but the file is 20"):
        loader.Download(bytes(10), 20)
    with pytest.raises(PayloadError, match=r"^header\.data_size.*truncated"):
        loader.program_from_bytes(big[:-64])
