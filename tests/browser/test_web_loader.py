"""web/loader.py (pure Python, runs here too): a program decoded from its head bytes alone, the
data segment left where it is (in the browser: JS memory)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import progbuild  # noqa: E402
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
