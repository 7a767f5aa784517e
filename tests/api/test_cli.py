"""The command line: --help everywhere, inspect, run (reference), devices, clear errors."""

import pytest

from gpudelegate.cli import _parse_budget, main
from progbuild import sample_program


@pytest.fixture(scope="module")
def program_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "sample.gdp"
    sample_program().save(path)
    return path


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"], ["run", "--help"], ["devices", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert "usage: gpudelegate" in capsys.readouterr().out


def test_inspect_reports_methods_constants_and_plans(program_file, capsys):
    assert main(["inspect", str(program_file), "--budget", "1KB"]) == 0
    out = capsys.readouterr().out
    for words in ("forward", "decode", "step", "constants", "arena", "prepack", "offload"):
        assert words in out, words


def test_run_on_the_reference(program_file, capsys):
    assert main(["run", str(program_file), "--device", "reference", "--method", "forward", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "device: reference" in out and "method forward" in out and "output" in out


def test_errors_are_one_line_not_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.gdp"
    bad.write_bytes(b"not a program at all, not even close to one" * 3)
    assert main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "PayloadError: header.magic" in err and "Traceback" not in err


def test_budget_units():
    assert _parse_budget("300MB") == 300_000_000
    assert _parse_budget("1.5GiB") == 1.5 * (1 << 30)
    assert _parse_budget("4096") == 4096


def _q8_0_program():
    """forward(x float32[2, 64]) -> linear(x, w) with w a q8_0[48, 64] constant (blocks written by
    hand: scale 1/64, values -16..15), and a float32 bias."""
    import struct

    from progbuild import ProgramBuilder

    block = struct.pack("<e", 1 / 64) + bytes((v - 16) & 0xFF for v in range(32))
    b = ProgramBuilder()
    w = b.constant("q8_0", (48, 64), block * (48 * 2))
    bias = b.constant("float32", (48,), [0.5] * 48)
    p = b.payload()
    x = p.input("float32", (2, 64), "x")
    p.output(p.op("linear", [x, p.prepack(p.constant(w, "w")), p.prepack(p.constant(bias, "b"))]))
    p.schedule_offload()
    m = b.method("forward")
    (y,) = m.delegate(p, [m.input("float32", (2, 64), "x")])
    m.output(y)
    return b.build()


def test_inspect_shows_constants_and_weights_by_type(tmp_path, capsys):
    path = tmp_path / "q8.gdp"
    _q8_0_program().save(path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  by type: q8_0: 1 constants, 3.2 KiB; float32: 1, 192 B" in out  # 48 rows x 2 blocks x 34 bytes
    assert "weights on the device by type: q8_0: 1 buffers, 3.2 KiB; float32: 1, 192 B" in out
    assert "q8_0[48, 64] 3.2 KiB" in out  # the largest constants, with their type
    assert main(["run", str(path), "--device", "reference", "--repeat", "1"]) == 0  # the reference decodes it
    assert "output ? float32[2, 48]" in capsys.readouterr().out


def test_export_weights_dtypes_and_gguf_only_for_gguf_models(tmp_path, capsys):
    pytest.importorskip("torch")
    with pytest.raises(SystemExit) as e:
        main(["export", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help at the terminal width
    assert "{float32,float16,q4_0,q4_1,q8_0,gguf}" in out and "gguf keeps the blocks of the GGUF" in out
    assert "(--model smollm2, or a script whose export() reads a GGUF)" in out
    # refused before anything is exported: minilm's weights come from safetensors, not a GGUF
    assert main(["export", "--model", "minilm", str(tmp_path / "m.gdp"), "--weights-dtype", "gguf"]) == 1
    err = capsys.readouterr().err
    assert "--weights-dtype gguf keeps a GGUF file's own blocks, and minilm is not read from a GGUF" in err
    assert "use q4_0, q4_1 or q8_0" in err and not (tmp_path / "m.gdp").exists()
