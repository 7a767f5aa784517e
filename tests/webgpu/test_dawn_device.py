"""The Dawn adapter (native/dawn_device.py, device kind ``dawn``): device lifecycle, what it reports
(features, subgroup-matrix configs, toggles), the host-memory upload ring (native/dawn_staging.py)
and the mapped ring with every byte checked across pieces and tails, a model prepacked through
each matching the float64 reference, errors of a missing package, a dead device and conflicting
toggles as DeviceError, and ``gpudelegate devices``.

Runs where a Dawn adapter starts: tests/run_all.sh runs the ``dawn`` tests in a process whose
Vulkan driver is Mesa 25's lavapipe (Dawn finds no adapter on Mesa 22), the GPU machine on its GPU.
tests/conftest.py gives the process the toggles ``allow_unsafe_apis`` (and f16 on NVIDIA).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gpudelegate.environment import Environment
from gpudelegate.errors import DeviceError

from conformance.cases import golden
from test_wgpu_executor import _check, _mlp_case, _program

pytestmark = pytest.mark.dawn


@pytest.fixture(scope="module")
def env(dawn_env):
    return dawn_env


@pytest.fixture(scope="module")
def ctx(env):
    return env.context("dawn")


def _read(ctx, buf) -> np.ndarray:
    return np.frombuffer(ctx.queue.read_buffer(buf), np.uint8)


def _uploader(ctx, staging, piece, count):
    from gpudelegate.native.dawn_staging import HOST_MEMORY_FEATURE, HostMemoryUploader
    from gpudelegate.native.wgpu_staging import Uploader

    if staging == "bar":
        return Uploader(ctx, piece=piece, count=count, staging="bar")
    if HOST_MEMORY_FEATURE not in ctx.features:
        pytest.skip(f"this Dawn adapter ({ctx.limits.name}) has no {HOST_MEMORY_FEATURE} feature")
    return HostMemoryUploader(ctx, piece=piece, count=count)


# ---------------------------------------------------------------------------- what it reports

def test_context_reports_its_features_configs_and_toggles(ctx):
    from gpudelegate.native.dawn_device import DAWN_OPTIONAL_FEATURES, SUBGROUP_MATRIX_FEATURE

    info = ctx.info()
    assert info["kind"] == "dawn" and ctx.kind == "dawn"
    offered = set(ctx.adapter.features)
    # every optional feature the adapter offers is asked for, and nothing it does not offer
    assert {f for f in DAWN_OPTIONAL_FEATURES if f in offered} <= set(ctx.features) <= offered
    assert info["features"] == sorted(ctx.features)
    assert tuple(info["toggles"]) == ctx.toggles == tuple(os.environ["GPUDELEGATE_DAWN_TOGGLES"].split(","))
    configs = ctx.subgroup_matrix_configs
    assert isinstance(configs, tuple)
    if SUBGROUP_MATRIX_FEATURE in ctx.features:
        assert configs, "the subgroup-matrix feature without a single config"
        from wgpudawn.backends.dawn import extras

        raw = extras.get_adapter_properties(ctx.adapter)["subgroup_matrix_configs"]
        assert [(c["M"], c["N"], c["K"]) for c in configs] == [(r["m"], r["n"], r["k"]) for r in raw]
    else:
        assert configs == ()
    for c in configs:
        assert set(c) == {"component", "result", "M", "N", "K"} and all(c[k] > 0 for k in "MNK")
    assert info["subgroup_matrix_configs"] == [dict(c) for c in configs]
    staging = "host-memory" if "host-mapped-pointer" in ctx.features else "bar"
    assert info["upload_staging"] == ctx.uploader.staging == staging


def test_without_toggles_dawn_offers_no_experimental_features(dawn_adapter):
    """Toggles are opt-in: a process without GPUDELEGATE_DAWN_TOGGLES gets no unsafe features and
    stages uploads through the mapped ring (a subprocess: the toggles are per process)."""
    code = ("import json; from gpudelegate.native.dawn_device import DawnContext; c = DawnContext(); "
            "print(json.dumps([sorted(c.features), c.uploader.staging, list(c.toggles)])); c.close()")
    envv = {k: v for k, v in os.environ.items() if k != "GPUDELEGATE_DAWN_TOGGLES"}
    out = subprocess.run([sys.executable, "-c", code], env=envv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    feats, staging, toggles = json.loads(out.stdout.strip().splitlines()[-1])
    assert toggles == []
    assert "host-mapped-pointer" not in feats and "chromium-experimental-subgroup-matrix" not in feats
    assert staging == "bar"


def test_devices_cli_lists_dawn_with_features_and_configs(ctx, capsys):
    from gpudelegate.cli import main

    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    k = next(i for i, ln in enumerate(lines) if ln.startswith("dawn "))
    assert "available" in lines[k] and ctx.limits.name.split(" (")[0] in lines[k]
    assert lines[k + 1].split() == ["features:"] + [f + "," for f in sorted(ctx.features)[:-1]] + sorted(ctx.features)[-1:]
    assert lines[k + 2].strip().startswith("subgroup-matrix configs:")
    for c in ctx.subgroup_matrix_configs:
        assert f"{c['M']}x{c['N']}x{c['K']}" in lines[k + 2]


def test_auto_passes_over_a_software_dawn_adapter(ctx):
    with Environment() as e:
        got = e.resolve_device("auto")
        if ctx.is_fallback_adapter:
            assert got != "dawn"
            assert any(r.startswith("dawn: a software adapter") for r in e.auto_skipped), e.auto_skipped
        else:
            assert got in ("cuda", "dawn")


# ---------------------------------------------------------------------------- uploads

@pytest.mark.parametrize("staging", ["host-memory", "bar"])
def test_every_byte_arrives_across_pieces_and_tails(ctx, staging):
    U = ctx.wgpu.BufferUsage
    up = _uploader(ctx, staging, piece=1 << 16, count=3)
    piece = up.piece  # the host-memory ring rounds it to the host memory alignment (a page)
    rng = np.random.default_rng(11)
    # odd sizes (tails padded to 4 bytes), one write over three pieces, deferred small writes
    # sharing a piece, two destinations at 4-byte-aligned offsets; three rounds so every buffer
    # of the ring is refilled (after waiting for its previous copies)
    sizes = [1, 3, 4, 4099, 3 * piece + 7, 12_289, 65_521, 2, piece - 4, 5]
    total = sum((n + 3) // 4 * 4 for n in sizes)
    dsts = [ctx.device.create_buffer(size=total + 64, usage=U.STORAGE | U.COPY_DST | U.COPY_SRC) for _ in range(2)]
    want = [np.zeros(total + 64, np.uint8) for _ in range(2)]
    try:
        for rnd in range(3):
            off = [8, 0]
            for k, n in enumerate(sizes):
                d = k % 2
                src = rng.integers(0, 256, n, dtype=np.uint8)
                up.write(dsts[d], off[d], src, defer=n < 5000)
                want[d][off[d]:off[d] + n] = src
                want[d][off[d] + n:off[d] + (n + 3) // 4 * 4] = 0
                off[d] += (n + 3) // 4 * 4
            up.flush()
            for d in range(2):
                np.testing.assert_array_equal(_read(ctx, dsts[d]), want[d], err_msg=f"{staging} round {rnd}, destination {d}")
        assert up.bytes == 3 * sum(sizes)
    finally:
        up.close()
        for b in dsts:
            b.destroy()


def test_a_large_write_is_filled_by_threads_and_arrives_whole(ctx):
    """A write of several 8 MiB parts is copied into host memory by the thread pool."""
    U = ctx.wgpu.BufferUsage
    up = _uploader(ctx, "host-memory", piece=16 << 20, count=2)
    n = (40 << 20) + 6
    src = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
    dst = ctx.device.create_buffer(size=(n + 3) // 4 * 4, usage=U.STORAGE | U.COPY_DST | U.COPY_SRC)
    try:
        up.write(dst, 0, src)
        got = _read(ctx, dst)
        np.testing.assert_array_equal(got[:n], src)
        assert (got[n:] == 0).all()
    finally:
        up.close()
        dst.destroy()


def test_discarded_writes_never_reach_the_destination(ctx):
    U = ctx.wgpu.BufferUsage
    up = _uploader(ctx, "host-memory", piece=1 << 14, count=2)
    dst = ctx.device.create_buffer(size=4096, usage=U.STORAGE | U.COPY_DST | U.COPY_SRC)
    try:
        up.write(dst, 0, np.full(4096, 5, np.uint8), defer=True)
        up.discard()
        up.write(dst, 1024, np.full(1024, 9, np.uint8))
        got = _read(ctx, dst)
        assert (got[:1024] == 0).all() and (got[1024:2048] == 9).all() and (got[2048:] == 0).all()
    finally:
        up.close()
        dst.destroy()


@pytest.mark.parametrize("staging", ["host-memory", "bar"])
@pytest.mark.parametrize("layout", ["prepack", "prepack_fp16"])
def test_a_model_prepacked_through_each_ring_matches_the_reference(ctx, monkeypatch, staging, layout):
    if staging == "host-memory" and "host-mapped-pointer" not in ctx.features:
        pytest.skip(f"this Dawn adapter ({ctx.limits.name}) has no host-mapped-pointer feature")
    case = _mlp_case(width=31, depth=3, layout=layout)
    prog, names, data = _program(case)
    monkeypatch.setenv("GPUDELEGATE_DAWN_STAGING", staging)
    with Environment() as e:
        with e.session(prog, device="dawn") as s:
            assert s.executor.ctx.uploader.staging == staging
            (y,) = s.run("forward", [data["x"]])
    tol = (2e-3, 2e-3) if layout == "prepack_fp16" else (1e-4, 1e-4)
    _check(case, [y], golden(case, data), *tol)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_device_toggles_reach_the_device_and_a_model_still_matches(ctx, monkeypatch, how):
    # Device toggles (per context, opt-in): disable_robustness drops Dawn's shader bounds checks;
    # a program's kernels stay in bounds, so the results are the same.
    case = _mlp_case(width=31, depth=3, layout="prepack")
    prog, names, data = _program(case)
    if how == "environment":
        monkeypatch.setenv("GPUDELEGATE_DAWN_DEVICE_TOGGLES", "disable_robustness")
        options = {}
    else:
        options = {"dawn": {"device_toggles": ["disable_robustness"]}}
    with Environment(device_options=options) as e:
        c = e.context("dawn")
        assert c.device_toggles == ("disable_robustness",) and c.info()["device_toggles"] == ["disable_robustness"]
        with e.session(prog, device="dawn") as s:
            (y,) = s.run("forward", [data["x"]])
    _check(case, [y], golden(case, data), 1e-4, 1e-4)


@pytest.mark.parametrize("spin", [0.0, 1e-6, 0.05])
def test_a_read_back_spun_for_or_blocked_on_returns_each_runs_results(env, monkeypatch, spin):
    # A run's read-back spins on ProcessEvents for map_spin_s, then blocks in WaitAny (1e-6: the
    # spin ends first; 0: blocks at once, as on software adapters by default).
    case = _mlp_case(width=29, depth=3, layout="prepack")
    prog, names, data = _program(case)
    with env.session(prog, device="dawn") as s:
        monkeypatch.setattr(s.executor.device, "map_spin_s", spin)
        for _ in range(3):
            (y,) = s.run("forward", [data["x"]])
            _check(case, [y], golden(case, data), 1e-4, 1e-5)


def test_spinning_is_off_on_a_software_adapter(ctx):
    assert (ctx.map_spin_s == 0) == ctx.is_fallback_adapter


def test_device_toggle_sets_disable_with_a_dash_and_keep_timestamps_unrounded():
    from gpudelegate.native.dawn_device import device_toggle_sets

    known = {"disable_robustness": {}, "timestamp_quantization": {}}
    assert device_toggle_sets((), known) == ([], ["timestamp_quantization"])
    assert device_toggle_sets(("disable_robustness",), known) == (["disable_robustness"], ["timestamp_quantization"])
    # named: the caller's choice wins either way
    assert device_toggle_sets(("timestamp_quantization",), known) == (["timestamp_quantization"], [])
    assert device_toggle_sets(("-timestamp_quantization", "-x"), known) == ([], ["timestamp_quantization", "x"])
    # a Dawn that does not know the default-off toggle is not asked to disable it
    assert device_toggle_sets((), {}) == ([], [])


def test_timestamps_are_not_rounded_unless_asked(ctx):
    # Chrome's rounding of timestamp queries (a page's timing-attack defence) turned every
    # per-dispatch profile on Dawn into steps of ~65 us; a desktop context turns it off.
    from wgpudawn.backends.dawn import extras

    with Environment() as e:
        assert "timestamp_quantization" not in extras.get_toggles(e.context("dawn").device)
    with Environment(device_options={"dawn": {"device_toggles": ["timestamp_quantization"]}}) as e:
        assert "timestamp_quantization" in extras.get_toggles(e.context("dawn").device)


# ---------------------------------------------------------------------------- errors

def test_missing_wgpudawn_is_a_device_error_with_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "wgpudawn", None)  # import wgpudawn raises ImportError
    with Environment() as e:
        with pytest.raises(DeviceError, match=r"pip install 'gpudelegate\[dawn\]'"):
            e.context("dawn")


def test_no_adapter_is_a_device_error_naming_the_driver_dawn_needs(ctx, monkeypatch):
    from gpudelegate.native.dawn_device import DawnContext

    monkeypatch.setattr(ctx.wgpu.gpu, "request_adapter_sync", lambda **kw: None)
    with pytest.raises(DeviceError, match=r"dawn: no WebGPU adapter found.*Mesa 25"):
        DawnContext()


def test_bad_settings_are_device_errors(ctx, monkeypatch):
    from gpudelegate.native.dawn_device import DawnContext

    with pytest.raises(DeviceError, match="upload_staging must be 'host-memory' or 'bar'"):
        DawnContext(upload_staging="pinned")
    # the process's instance has its toggles: other toggles need another process
    with pytest.raises(DeviceError, match="need a new process"):
        DawnContext(toggles=["disable_robustness"])
    with pytest.raises(DeviceError, match=r"lacks features \['no-such-feature'\]"):
        DawnContext(extra_features=["no-such-feature"])
    with pytest.raises(DeviceError, match="device_toggles must be a list"):
        DawnContext(device_toggles="disable_robustness")
    with pytest.raises(DeviceError, match="Unknown Dawn toggle 'no_such_toggle'"):
        DawnContext(device_toggles=["no_such_toggle"])
    with pytest.raises(DeviceError, match="Unknown Dawn toggle 'no_such_toggle'"):
        DawnContext(device_toggles=["-no_such_toggle"])
    with pytest.raises(DeviceError, match="device_toggles must be a list"):
        DawnContext(device_toggles=["-"])
    with Environment(device_options={"dawn": {"upload_staging": "pinned"}}) as e:
        with pytest.raises(DeviceError, match="upload_staging must be"):
            e.context("dawn")


_DEAD_DEVICE = """
import sys
sys.path[:0] = {paths!r}
from gpudelegate.environment import Environment
from gpudelegate.errors import DeviceError
from gpudelegate.webgpu.device import RunIO
from test_wgpu_executor import _mlp_case, _program

case = _mlp_case(width=15, depth=2)
prog, names, data = _program(case)
e = Environment()
s = e.session(prog, device="dawn")
s.run("forward", [data["x"]])
e.context("dawn").device.destroy()  # what a driver reset does to the device
try:
    s.run("forward", [data["x"]])
    print("RESULT no error")
except DeviceError as err:
    print("RESULT DeviceError", str(err).splitlines()[0])
s.close()
ctx = e.context("dawn")
e.close()
try:
    ctx.run_chain(None, RunIO())
    print("RESULT no error")
except DeviceError as err:
    print("RESULT DeviceError", err)
sys.stdout.flush()
"""


def test_a_dead_device_raises_device_error_not_a_library_error(dawn_adapter):
    """Runs on a destroyed device (what a driver reset leaves) and on a closed context raise
    DeviceError. In a subprocess: after an error from a call on a destroyed device, wgpudawn
    0.32.0.4 crashes the interpreter at exit (a minimal wgpudawn-only script does too:
    docs/NOTES.md, "Dawn backend"), so only the lines the script printed are checked."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = _DEAD_DEVICE.format(paths=[here, os.path.dirname(here)])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    results = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert len(results) == 2, (out.stdout, out.stderr[-2000:])
    assert results[0].startswith("RESULT DeviceError dawn: ") and "lost" in results[0], results[0]
    assert results[1].startswith("RESULT DeviceError dawn: run: the device context is closed"), results[1]
