"""The command line on everyday mistakes (issue 14, items 4, 8 and 10): one line naming the
problem and a non-zero exit, never a traceback; --inputs matched by name; inspect's numbers usable
as they are printed."""

from __future__ import annotations

import re

import numpy as np
import pytest

import gpudelegate
from gpudelegate.cli import main

from progbuild import ProgramBuilder, sample_program, weight_op_program


def two_input_program():
    """forward(ids int32[2,3], mask int32[2,3]) -> (ids * 10 + mask) as float, so a swap shows."""
    b = ProgramBuilder()
    p = b.payload()
    ids = p.input("int32", (2, 3), "ids")
    mask = p.input("int32", (2, 3), "mask")
    ten = p.constant(b.constant("int32", (), [10]))
    y = p.op("add", [p.op("mul", [ids, ten]), mask])
    p.output(p.op("cast", [y], {"dtype": "float32"}))
    m = b.method("forward")
    (o,) = m.delegate(p, [m.input("int32", (2, 3), "ids"), m.input("int32", (2, 3), "mask")])
    m.output(o)
    return b.build()


@pytest.fixture()
def sample(tmp_path):
    p = tmp_path / "sample.gdp"
    sample_program().save(p)
    return p


def _fails(capsys, argv, code=1):
    with pytest.raises(SystemExit) if code == 2 else _nothing():
        rc = main(argv)
        assert rc == code, rc
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_inspect_of_a_missing_file_or_a_directory(tmp_path, capsys):
    err = _fails(capsys, ["inspect", str(tmp_path / "nope.gdp")])
    assert "PayloadError" in err and "nope.gdp" in err and "No such file" in err
    err = _fails(capsys, ["inspect", str(tmp_path)])
    assert "PayloadError" in err and "Is a directory" in err


def test_run_repeat_must_be_positive(sample, capsys):
    err = _fails(capsys, ["run", str(sample), "--device", "reference", "--repeat", "0"], code=2)
    assert "--repeat: invalid positive integer value: '0'" in err


def test_run_inputs_file_errors(sample, tmp_path, capsys):
    err = _fails(capsys, ["run", str(sample), "--device", "reference", "--inputs", str(tmp_path / "missing.npz")])
    assert "InputError" in err and "missing.npz" in err
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file")
    err = _fails(capsys, ["run", str(sample), "--device", "reference", "--inputs", str(junk)])
    assert "InputError" in err and "cannot read it as an .npz" in err
    arr = tmp_path / "one.npy"
    np.save(arr, np.zeros((7, 3), np.float32))
    err = _fails(capsys, ["run", str(sample), "--device", "reference", "--inputs", str(arr)])
    assert "InputError" in err and "np.savez(path, x=...)" in err


def test_run_inputs_are_matched_by_name(tmp_path, capsys):
    prog_path = tmp_path / "two.gdp"
    two_input_program().save(prog_path)
    ids = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    mask = np.array([[1, 1, 0], [1, 0, 0]], np.int32)
    f = tmp_path / "in.npz"
    np.savez(f, mask=mask, ids=ids)  # not in signature order
    assert main(["run", str(prog_path), "--device", "reference", "--inputs", str(f), "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    want = (ids * 10 + mask).astype(np.float32).reshape(-1)[:5].tolist()
    assert f"first {want}" in out, out

    bad = tmp_path / "positional.npz"
    np.savez(bad, ids, mask)  # arr_0, arr_1: names that match nothing
    err = _fails(capsys, ["run", str(prog_path), "--device", "reference", "--inputs", str(bad)])
    assert "matched to forward's inputs by name" in err and "['ids', 'mask']" in err and "arr_0" in err


def test_run_on_auto_says_why_it_skipped_devices(sample, capsys, monkeypatch):
    from gpudelegate import environment as envmod

    monkeypatch.setattr(envmod, "AUTO_ORDER", ("cuda", "reference"))
    monkeypatch.setitem(envmod._DEVICE_FACTORIES, "cuda", "gpudelegate_no_cupy_here:create_context")
    assert main(["run", str(sample), "--method", "forward", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"auto: passed over cuda: device 'cuda' is not available here: .*gpudelegate\[cuda\]", out), out
    # one build figure: the session build, with its parts; load and device start apart
    line = next(l for l in out.splitlines() if l.startswith("device:"))
    assert line.count("build") == 1 and "load" in line and "device start" in line, line


def test_inspect_floor_is_exact_and_works_as_budget(tmp_path, capsys):
    prog = weight_op_program("linear", (5, 7), (333, 7), seed=4)  # a weight size that rounds in MiB/KiB
    path = tmp_path / "w.gdp"
    prog.save(path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    floor = int(re.search(r"floor .* = (\d+) bytes \(the smallest --budget\)", out).group(1))
    assert main(["inspect", str(path), "--budget", str(floor)]) == 0
    assert "does not fit" not in capsys.readouterr().out
    assert main(["run", str(path), "--device", "reference", "--budget", str(floor), "--repeat", "1"]) == 0
    assert main(["inspect", str(path), "--budget", str(floor - 1)]) == 0
    assert "does not fit" in capsys.readouterr().out


def test_inspect_summarizes_long_signatures_and_chunks():
    from gpudelegate.inspect import _sig, format_report, describe

    ts = [{"id": 0, "name": "ids", "dtype": "int32", "shape": [1, 1]}]
    ts += [{"id": i + 1, "name": f"k{i}", "dtype": "float32", "shape": [1, 3, 256, 64]} for i in range(60)]
    assert _sig(ts) == "ids: int32[1, 1], k0..k59 (60 x float32[1, 3, 256, 64])"
    report = format_report(describe(sample_program()))
    assert " dispatches" not in report and "planned ops" in report
    d = describe(sample_program())
    d["plan"]["prepack"].update(chunks=9, chunk_bytes=64 << 20, largest_chunk_bytes=108 << 20)
    line = next(l for l in format_report(d).splitlines() if "prepack:" in l)
    assert "<= 64.0 MiB" not in line and "a buffer bigger than that is a chunk of its own (largest 108.0 MiB)" in line


def test_load_then_inspect_without_reading_the_size_twice(sample):
    prog = gpudelegate.load(sample)
    assert prog.source_file[1][2] == sample.stat().st_size
