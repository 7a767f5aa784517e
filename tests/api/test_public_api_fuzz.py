"""Property test over argument types (issue 14): every public entry point (the CLI subcommands,
``load``, ``Environment.session``, ``Session.run``, ``export_program``) either works or raises a
documented ``gpudelegate.errors`` type (a GpuDelegateError) for bad arguments, files and inputs:
never TypeError, KeyError, IndexError, OSError, a numpy error or a crash. The CLI exits with a
status code (argparse's 2 for usage errors) and prints no traceback.

Hypothesis draws the arguments from wide strategies (None, numbers, strings, bytes, lists, dicts,
arrays of every dtype and shape, real and broken files), so a new code path that lets a raw
exception through fails here with the smallest example that reaches it.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpudelegate
from gpudelegate.cli import main
from gpudelegate.errors import GpuDelegateError

from progbuild import sample_program
from test_user_robustness import embed_program

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Real paths of every kind a user may pass: a valid program, garbage, an empty file, a
    truncated program, a directory and a path that does not exist."""
    d = tmp_path_factory.mktemp("fuzz")
    good = d / "good.gdp"
    sample_program().save(good)
    (d / "garbage.gdp").write_bytes(b"\x00\xffGPUDLGT garbage" * 9)
    (d / "empty.gdp").write_bytes(b"")
    (d / "short.gdp").write_bytes(good.read_bytes()[:200])
    np.savez(d / "inputs.npz", x=np.ones((7, 3), np.float32))
    np.savez(d / "positional.npz", np.ones((7, 3), np.float32))
    (d / "sub").mkdir()
    return {"good": good, "garbage": d / "garbage.gdp", "empty": d / "empty.gdp", "short": d / "short.gdp",
            "npz": d / "inputs.npz", "positional": d / "positional.npz", "dir": d / "sub", "missing": d / "nope.gdp"}


@pytest.fixture(scope="module")
def env():
    e = gpudelegate.Environment()
    yield e
    e.close()


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12), st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                      max_leaves=6)
DTYPES = [np.float32, np.float16, np.float64, np.int32, np.int64, np.int8, np.uint32, np.bool_, np.complex64]


@st.composite
def arrays(draw):
    shape = draw(st.one_of(st.just((7, 3)), st.just((2, 5)), st.lists(st.integers(0, 4), max_size=3).map(tuple)))
    dt = draw(st.sampled_from(DTYPES))
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.lists(st.integers(-50000, 50000), min_size=n, max_size=n))
    return np.asarray(raw).reshape(shape).astype(dt)


def _path_choice(files):
    return st.sampled_from(sorted(files)).map(lambda k: files[k])


def _documented(fn, *a, **k):
    try:
        return fn(*a, **k)
    except GpuDelegateError:
        return None


# ------------------------------------------------------------------ load / loads

def test_load_takes_anything(files):
    @SETTINGS
    @given(st.one_of(values, _path_choice(files), _path_choice(files).map(str)))
    def check(arg):
        _documented(gpudelegate.load, arg)

    check()


@SETTINGS
@given(st.binary(max_size=300))
def test_loads_takes_any_bytes(data):
    _documented(gpudelegate.loads, data)


# ------------------------------------------------------------------ Environment.session

def test_session_takes_anything(files, env):
    program = st.one_of(values, _path_choice(files), st.just(sample_program()))

    @SETTINGS
    @given(program=program, device=st.one_of(st.sampled_from(["reference", "auto-ish", "", "wgpu!"]), values),
           weight_budget=st.one_of(st.none(), st.integers(-10, 10**6), values),
           prefetch_depth=st.one_of(st.integers(-3, 5), values), pinned=st.one_of(st.just(()), values),
           methods=st.one_of(st.none(), st.lists(st.sampled_from(["forward", "decode", "x"]), max_size=3), values))
    def check(program, device, weight_budget, prefetch_depth, pinned, methods):
        s = _documented(env.session, program, device=device, weight_budget=weight_budget,
                        prefetch_depth=prefetch_depth, pinned=pinned, methods=methods)
        if s is not None:
            s.close()

    check()


# ------------------------------------------------------------------ Session.run

def test_run_takes_anything(env):
    sess = env.session(embed_program(), device="reference")
    inputs = st.one_of(values, arrays(), st.lists(st.one_of(arrays(), values), max_size=3),
                       st.dictionaries(st.sampled_from(["ids", "cache", "new", "pos", "x"]),
                                       st.one_of(arrays(), values), max_size=4))

    @SETTINGS
    @given(method=st.one_of(st.sampled_from(["forward", "step", "nope"]), values), inputs=inputs,
           keep=st.booleans())
    def check(method, inputs, keep):
        _documented(sess.run, method, inputs, keep_on_device=keep)

    check()
    sess.close()


# ------------------------------------------------------------------ the command line

def test_cli_takes_anything(files):
    word = st.one_of(st.text(max_size=8), st.sampled_from(["0", "-1", "1", "7", "1.5GiB", "300MB", "x", ""]),
                     _path_choice(files).map(str))
    argv = st.one_of(
        st.tuples(st.just("inspect"), word, st.sampled_from([(), ("--budget",)]), word),
        st.tuples(st.just("run"), word, st.sampled_from(["--device", "--method", "--budget", "--repeat", "--seed",
                                                         "--inputs"]), word,
                  st.sampled_from([(), ("--device", "reference"), ("--inputs", str(files["npz"])),
                                   ("--inputs", str(files["positional"]))])),
        st.tuples(st.just("devices"), st.sampled_from([(), ("--nope",)])),
        st.tuples(st.just("export"), st.sampled_from(["--help", "--model", "--weights-dtype", "x"]), word),
        st.lists(word, max_size=3),
    ).map(lambda t: [a for x in t for a in (x if isinstance(x, (tuple, list)) else (x,))])

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(argv)
    def check(args):
        if args[:1] == ["run"] and "--device" not in args:
            args = args + ["--device", "reference", "--repeat", "1"]  # no device probing per example
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                rc = main(list(args))
            except SystemExit as e:  # argparse: --help (0) or a usage error (2)
                rc = e.code
        assert rc in (0, 1, 2), (args, rc)
        assert "Traceback" not in err.getvalue(), (args, err.getvalue())

    check()


# ------------------------------------------------------------------ export_program

def test_export_program_takes_anything(tmp_path):
    torch = pytest.importorskip("torch")
    from gpudelegate.export import export_program

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            return torch.relu(self.lin(x))

    model = Tiny()
    good = (torch.ones(4, 3),)
    tensors = st.sampled_from([torch.ones(4, 3), torch.ones(2), torch.zeros(4, 3, dtype=torch.int64),
                               torch.ones(0, 3)])
    inputs = st.one_of(st.just(good), values, tensors, st.lists(st.one_of(tensors, values), max_size=2).map(tuple))

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(m=st.one_of(st.just(model), values, st.dictionaries(st.text(max_size=4), st.one_of(values, st.just(
               (model, good))), max_size=2)),
           example_inputs=inputs, path=st.one_of(st.none(), st.just(tmp_path), st.just(tmp_path / "o.gdp"), values),
           weights_dtype=st.one_of(st.sampled_from(["float32", "float16"]), values),
           names=st.one_of(st.none(), values))
    def check(m, example_inputs, path, weights_dtype, names):
        kwargs = {} if isinstance(m, dict) else {"example_inputs": example_inputs}
        _documented(export_program, m, path=path, weights_dtype=weights_dtype, input_names=names, progress=False,
                    **kwargs)
        assert model.training  # whatever happened, the caller's mode is back

    check()
