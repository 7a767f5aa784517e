"""The wgpu upload ring (native/wgpu_staging.py ``Uploader``) with both kinds of staging: ``bar``
(WebGPU's MAP_WRITE | COPY_SRC, the default) and ``host`` (MAP_READ | COPY_SRC under
wgpu-native's mappable-primary-buffers, written through the raw mapped range). Every byte that
goes in must come out of the destination, whatever the sizes, offsets and piece boundaries; a
model prepacked through host staging matches the float64 reference; bad settings are clear errors.

Runs on any wgpu adapter (software Vulkan in CI, which offers mappable-primary-buffers); skipped,
with the reason printed by -rs, where none starts.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpudelegate.environment import Environment
from gpudelegate.errors import DeviceError

from conformance.cases import golden
from test_wgpu_executor import _check, _mlp_case, _program

pytestmark = pytest.mark.wgpu


@pytest.fixture(scope="module")
def host_ctx(wgpu_adapter):
    from gpudelegate.native.wgpu_device import WgpuContext

    try:
        ctx = WgpuContext(upload_staging="host")
    except DeviceError as e:  # an adapter without mappable-primary-buffers: only "bar" exists there
        pytest.skip(f"host-memory staging unavailable: {e}")
    yield ctx
    ctx.close()


def _read(ctx, buf) -> np.ndarray:
    return np.frombuffer(ctx.queue.read_buffer(buf), np.uint8)


@pytest.mark.parametrize("staging", ["bar", "host"])
def test_every_byte_arrives_across_pieces_and_tails(host_ctx, staging):
    from gpudelegate.native.wgpu_staging import Uploader

    ctx = host_ctx
    U = ctx.wgpu.BufferUsage
    piece = 1 << 16
    up = Uploader(ctx, piece=piece, count=3, staging=staging)
    assert up.staging == staging
    rng = np.random.default_rng(7)
    # Writes of odd sizes (tails padded to 4 bytes), one over three pieces, deferred small ones
    # sharing a staging buffer, into two destinations at 4-byte-aligned offsets.
    sizes = [1, 3, 4, 4099, 3 * piece + 7, 12_289, 65_521, 2]
    total = sum((n + 3) // 4 * 4 for n in sizes)
    dsts = [ctx.device.create_buffer(size=total + 64, usage=U.STORAGE | U.COPY_DST | U.COPY_SRC) for _ in range(2)]
    want = [np.zeros(total + 64, np.uint8) for _ in range(2)]
    try:
        for rnd in range(3):  # the ring comes round: buffers are re-mapped and refilled
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
                np.testing.assert_array_equal(_read(ctx, dsts[d]), want[d], err_msg=f"round {rnd}, destination {d}")
        assert up.bytes == 3 * sum(sizes)
    finally:
        up.close()
        for b in dsts:
            b.destroy()


def test_the_ring_accounts_for_its_bytes_pieces_and_time(host_ctx):
    """``stats`` (UploadStats) counts every byte written, every staging buffer handed to the GPU
    and the seconds spent filling; ``since`` gives the share of a later stretch of writes."""
    from gpudelegate.native.wgpu_staging import Uploader

    ctx = host_ctx
    U = ctx.wgpu.BufferUsage
    piece = 1 << 16
    up = Uploader(ctx, piece=piece, count=2, staging="host", threads=2, min_part=1 << 14)
    dst = ctx.device.create_buffer(size=4 * piece, usage=U.STORAGE | U.COPY_DST | U.COPY_SRC)
    rng = np.random.default_rng(3)
    try:
        up.write(dst, 0, rng.integers(0, 256, 3 * piece, dtype=np.uint8))  # three full staging buffers
        first = up.stats.copy()
        assert (first.bytes, first.pieces) == (3 * piece, 3) and first.fill_s > 0
        assert first.since(first) == type(first)()
        tail = rng.integers(0, 256, 4097, dtype=np.uint8)
        up.write(dst, 3 * piece, tail, defer=True)
        up.write(dst, 3 * piece + 4100, tail[:8], defer=True)
        up.flush()  # the two deferred writes share one staging buffer
        later = up.stats.since(first)
        assert (later.bytes, later.pieces) == (4097 + 8, 1) and up.bytes == 3 * piece + 4105
        assert min(later.fill_s, later.wait_s, later.make_s, later.submit_s) >= 0
        assert later.wait_s > 0  # a ring of two: the fourth buffer waited for the second's copies
    finally:
        up.close()
        dst.destroy()


def test_discarded_writes_never_reach_the_destination(host_ctx):
    from gpudelegate.native.wgpu_staging import Uploader

    ctx = host_ctx
    U = ctx.wgpu.BufferUsage
    up = Uploader(ctx, piece=1 << 14, count=2, staging="host")
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


@pytest.mark.parametrize("layout", ["prepack", "prepack_fp16"])
def test_a_model_prepacked_through_host_staging_matches_the_reference(host_ctx, monkeypatch, layout):
    monkeypatch.setenv("GPUDELEGATE_WGPU_STAGING", "host")
    case = _mlp_case(width=31, depth=3, layout=layout)
    prog, names, data = _program(case)
    with Environment() as env:
        with env.session(prog, device="wgpu") as s:
            assert s.executor.ctx.uploader.staging == "host"
            (y,) = s.run("forward", [data["x"]])
    tol = (2e-3, 2e-3) if layout == "prepack_fp16" else (1e-4, 1e-4)
    _check(case, [y], golden(case, data), *tol)


def test_bad_staging_settings_are_clear_errors(host_ctx, monkeypatch):
    from gpudelegate.native.wgpu_device import WgpuContext
    from gpudelegate.native.wgpu_staging import Uploader

    with pytest.raises(ValueError, match="staging must be 'bar' or 'host'"):
        Uploader(host_ctx, staging="pinned")
    monkeypatch.setenv("GPUDELEGATE_WGPU_STAGING", "pinned")
    with Environment() as env:
        with pytest.raises(DeviceError, match="staging must be 'bar' or 'host'"):
            env.context("wgpu")
    monkeypatch.delenv("GPUDELEGATE_WGPU_STAGING")
    bar = WgpuContext()  # the default: no mappable-primary-buffers asked for
    try:
        assert bar.uploader.staging == "bar" and "mappable-primary-buffers" not in bar.features
        with pytest.raises(DeviceError, match="mappable-primary-buffers"):
            Uploader(bar, staging="host")
    finally:
        bar.close()
    with pytest.raises(DeviceError, match=r"lacks features \['no-such-feature'\]"):
        WgpuContext(extra_features=["no-such-feature"])
