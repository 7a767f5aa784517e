"""The wgpu benchmark scripts still run (their --small shapes, on whatever adapter is here) and
what they print holds together: every attention variant agrees with float64, every upload path
moves bytes. No timing is asserted: speed is measured on the GPU machine, not here."""

import os
import re
import sys

import pytest

from conformance.executors import probe_device

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))

pytestmark = pytest.mark.wgpu
_avail = probe_device("wgpu")


@pytest.fixture(scope="module", autouse=True)
def _adapter():
    ok, reason = _avail()
    if not ok:
        pytest.skip(reason)


def _rows(text):
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("|---")]


def test_bench_wgpu_attention_variants_agree_with_float64(capsys):
    import bench_wgpu_attention

    assert bench_wgpu_attention.main(["--small"]) == 0
    rows = [r for r in _rows(capsys.readouterr().out) if r[0] != "shape"]
    # the table is printed twice (as measured, then whole): 2 shapes x every variant in the last one
    n = len(bench_wgpu_attention.VARIANTS)
    # (with CUDA the table also has torch's SDPA as an anchor row per shape)
    last = [r for r in rows if "(anchor)" not in r[1]][-2 * n:]
    assert {r[1].split(" [")[0] for r in last} == set(bench_wgpu_attention.VARIANTS)
    for r in last:
        assert float(r[2]) > 0, r
        assert float(r[4]) < 1e-5, r  # max relative error against the float64 reference


def test_bench_wgpu_tiles_every_variant_agrees_with_float64(capsys):
    import bench_wgpu_tiles

    assert bench_wgpu_tiles.main(["--small"]) == 0
    rows = [r for r in _rows(capsys.readouterr().out) if r[0] != "shape" and r[2] and "cuBLAS" not in r[2]]
    # printed twice (as measured, then the whole table): the last third x two layouts x variants
    n = 2 * len(bench_wgpu_tiles.SMALL) * len(bench_wgpu_tiles.VARIANTS)
    last = rows[-n:]
    assert len(last) == n and {r[2].split(" [")[0] for r in last} == set(bench_wgpu_tiles.VARIANTS)
    for r in last:
        assert float(r[3]) > 0, r
        assert float(r[6]) < 1e-5, r  # max relative error against the float64 reference


def test_bench_wgpu_upload_every_path_moves_bytes(capsys):
    import bench_wgpu_upload

    assert bench_wgpu_upload.main(["--small"]) == 0
    out = capsys.readouterr().out
    rows = {r[0]: r[1] for r in _rows(out) if not r[0].startswith(("|", "torch"))
            and re.match(r"^[\d.]+$", r[1] or "")}
    wanted = ["fill 8 MiB, 4 threads", "DMA 8 MiB pieces", "ring 8 MiB x3", "premapped ring 8 MiB x3",
              "mapped_at_creation destinations, 8 MiB", "session prepack, ring 8 MiB x3, cold",
              "session prepack, ring 8 MiB x3, warm"]
    if "host-memory staging: yes" in out:  # software Vulkan offers mappable-primary-buffers
        wanted += ["host staging: " + w for w in wanted if not w.startswith(("premapped", "mapped_at"))]
    for what in wanted:  # every ring row also read its destination back and compared the bytes
        assert float(rows[what]) > 0, what


def test_make_bench_says_what_it_skips(capsys):
    import run as bench_run

    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here: `make bench` would run the CUDA benchmark")
    except ImportError:
        pass
    assert bench_run.main(["--only", "cuda"]) == 1
    assert "no CUDA device" in capsys.readouterr().out


def test_probe_wgpu_coopmat_says_what_it_found(capsys):
    import probe_wgpu_coopmat

    assert probe_wgpu_coopmat.main(["--small"]) == 0
    out = capsys.readouterr().out
    # Either the adapter does not offer the feature, or wgpu refuses a device with it (wgpu 0.32),
    # or it measured: each is said in so many words, never a silent exit.
    assert ("cooperative-matrix: not offered" in out or "cooperative-matrix: advertised" in out
            or "| coop-matrix" in out), out
