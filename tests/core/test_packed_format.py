"""Packed (GGUF block) weight types in the program format: sizes, the reader's checks, and which
ops may read them. Pure core (no numpy): it runs in Pyodide with the other core tests."""

import pytest

import gpudelegate
from gpudelegate import PayloadError, dtypes, ops
from gpudelegate.program import Value, program_document
from progbuild import ProgramBuilder, file_bytes, split_file

BLOCKS = {"q4_0": 18, "q4_1": 20, "q8_0": 34}


def _packed_program(dtype="q4_1", n=3, k=64, out_packed=False):
    """x[2, k] -> linear with a prepacked packed weight [n, k] -> y (or, with ``out_packed``, the
    weight itself returned as an output, which the reader must refuse)."""
    b = ProgramBuilder()
    raw = bytes((7 * i) % 251 for i in range(n * k // 32 * BLOCKS[dtype]))
    w = b.constant(dtype, (n, k), raw)
    pl = b.payload()
    x = pl.input("float32", (2, k))
    wd = pl.prepack(pl.constant(w))
    y = pl.op("linear", [x, wd])
    pl.output(wd if out_packed else y)
    pl.schedule_offload()
    m = b.method("forward")
    mx = m.input("float32", (2, k))
    (my,) = m.delegate(pl, [mx])
    m.output(my)
    return b.build()


@pytest.mark.parametrize("dtype", sorted(BLOCKS))
def test_sizes_are_whole_blocks(dtype):
    assert dtypes.nbytes(dtype, (5, 96)) == 5 * 3 * BLOCKS[dtype]
    assert dtypes.packed_row_bytes(dtype, 576) == 18 * BLOCKS[dtype]
    assert dtypes.packed_shape_error(dtype, (5, 40)).startswith(f"{dtype} last dim 40")
    assert dtypes.packed_shape_error(dtype, ()) != ""


@pytest.mark.parametrize("dtype", sorted(BLOCKS))
def test_a_packed_program_round_trips(dtype):
    prog = _packed_program(dtype)
    back = gpudelegate.loads(prog.to_bytes())
    c = back.constants[0]
    assert (c.dtype, c.shape, c.nbytes) == (dtype, (3, 64), 3 * 2 * BLOCKS[dtype])
    assert bytes(back.constant_bytes(0)) == bytes(prog.constant_bytes(0))


def test_block_count_mismatch_is_a_payload_error_naming_the_constant():
    doc, data = split_file(_packed_program().to_bytes())
    doc["constants"][0]["shape"] = [3, 48]  # 48 values: not whole 32-value blocks
    with pytest.raises(PayloadError, match=r"constants\[0\]\.shape: q4_1 last dim 48"):
        gpudelegate.loads(file_bytes(doc, data))
    doc, data = split_file(_packed_program().to_bytes())
    doc["constants"][0]["nbytes"] = doc["constants"][0]["nbytes"] - 20  # one block short
    with pytest.raises(PayloadError, match=r"constants\[0\]"):
        gpudelegate.loads(file_bytes(doc, data))


def test_packed_values_are_weights_only():
    with pytest.raises(PayloadError, match=r"payloads\[0\]\.outputs\[0\].*q4_1, which only constants may be"):
        gpudelegate.loads(_packed_program(out_packed=True).to_bytes())
    doc, data = split_file(_packed_program().to_bytes())
    doc["payloads"][0]["values"][0]["dtype"] = "q4_1"  # the payload's input x
    with pytest.raises(PayloadError, match=r"payloads\[0\]"):
        gpudelegate.loads(file_bytes(doc, data))


def test_only_linear_and_embedding_read_packed_weights():
    w = Value("q8_0", (5, 64))
    assert ops.infer("linear", [Value("float32", (2, 64)), w, None], {}) == [("float32", (2, 5))]
    assert ops.infer("embedding", [w, Value("int32", (4,))], {}) == [("float32", (4, 64))]
    with pytest.raises(PayloadError, match="only linear arg 1 and embedding arg 0 read packed weights"):
        ops.infer("matmul", [Value("float32", (2, 5)), w], {})
    with pytest.raises(PayloadError, match="only linear arg 1"):
        ops.infer("linear", [w, Value("float32", (3, 64)), None], {})
