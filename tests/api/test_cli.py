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
