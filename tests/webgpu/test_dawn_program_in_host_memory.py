"""A program read at load into Dawn host memory (``gpudelegate.load(path,
data_memory=ctx.gpu_readable_memory)``): its prepack is the GPU's copies out of that memory
(``dawn_staging.GpuReadableMemory``), with the same device bytes and outputs as the mapped
program's, and the memory lives as long as anything uses it.

Tolerances against the float64 reference are the conformance suite's (``cases.tolerance``:
float32 rtol 1e-4 + atol 1e-5*sqrt(K); float16 storage rtol 1e-2 + atol 2e-3*sqrt(K)); against
the mapped program the outputs and every resident byte must be identical (same plan, same
kernels, same bytes). Runs where Dawn offers ``host-mapped-pointer`` (lavapipe of Mesa 25 in CI:
VK_DRIVER_FILES=.cache/mesa25/lvp25.json, the GPU machine)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import gpudelegate
from gpudelegate.environment import Environment
from gpudelegate.errors import DeviceError
from gpudelegate.document import verify_constant_hashes

from conformance.cases import golden, tolerance
from test_wgpu_executor import _check, _mlp_case, _program

pytestmark = pytest.mark.dawn


@pytest.fixture(scope="module")
def env(dawn_env):
    return dawn_env


@pytest.fixture(scope="module")
def ctx(env):
    c = env.context("dawn")
    if "host-mapped-pointer" not in c.features:
        pytest.skip(f"this Dawn adapter ({c.limits.name}) has no host-mapped-pointer feature")
    return c


def _read(ctx, buf) -> np.ndarray:
    return np.frombuffer(ctx.queue.read_buffer(buf), np.uint8)


def _saved(tmp_path, case):
    prog, names, data = _program(case)
    path = tmp_path / "model.gdp"
    prog.save(path)
    return path, names, data


def _resident_bytes(ctx, session):
    ex = session.executor
    return {i: _read(ctx, b).copy() for i, b in ex.resident.items()}


# ---------------------------------------------------------------------------- a model

@pytest.mark.parametrize("layout,storage", [("prepack", "float32"), ("prepack_fp16", "float32"),
                                            ("prepack", "float16")])
def test_outputs_and_device_bytes_are_the_mapped_programs(ctx, env, tmp_path, layout, storage):
    # width 23, float16 storage: 46-byte biases, whose copies round up over the zero padding
    case = _mlp_case(width=23, depth=3, layout=layout, storage=storage)
    path, names, data = _saved(tmp_path, case)
    loaded = gpudelegate.load(path, data_memory=ctx.gpu_readable_memory)
    mapped = gpudelegate.load(path)
    assert isinstance(loaded.data.obj, np.ndarray) and getattr(loaded, "source_file", None) is None
    up = ctx.uploader
    with env.session(mapped, device="dawn") as a:
        want_y = a.run("forward", [data[n] for n in names])
        want_bytes = _resident_bytes(ctx, a)
    before = up.stats.copy()
    with env.session(loaded, device="dawn") as b:
        st = up.stats.since(before)
        got_y = b.run("forward", [data[n] for n in names])
        got_bytes = _resident_bytes(ctx, b)
    # every constant straight from host memory: nothing through the ring
    assert st.bytes == 0 and st.direct == loaded.constant_bytes_total, st
    assert want_bytes.keys() == got_bytes.keys()
    for i in want_bytes:
        np.testing.assert_array_equal(got_bytes[i], want_bytes[i], err_msg=f"resident buffer {i}")
    for g, w in zip(got_y, want_y):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    _check(case, got_y, golden(case, data), *tolerance(case))


def test_the_session_holds_the_memory_and_the_memory_outlives_the_context(tmp_path):
    case = _mlp_case(width=29, depth=2)
    path, names, data = _saved(tmp_path, case)
    with Environment() as e:
        c = e.context("dawn")
        prog = gpudelegate.load(path, data_memory=c.gpu_readable_memory)
        s = e.session(prog, device="dawn")
        arr = prog.data.obj
        alive = weakref.ref(arr)
        del prog, arr
        gc.collect()
        assert alive() is not None  # the session's program holds it
        _check(case, s.run("forward", [data[n] for n in names]), golden(case, data), *tolerance(case))
        keep = s.program
        s.close()
        gc.collect()
        assert alive() is not None and len(c.uploader.data_memory.regions) == 1
    # the context is gone; the program's bytes are still its own
    verify_constant_hashes(keep)
    del keep, s
    gc.collect()
    assert alive() is None


def test_collected_memory_loses_its_buffers_at_the_next_write(ctx, tmp_path):
    path, _, _ = _saved(tmp_path, _mlp_case(width=7, depth=1))
    mem = ctx.uploader.data_memory
    n = len(mem.regions)
    prog = gpudelegate.load(path, data_memory=ctx.gpu_readable_memory)
    assert len(mem.regions) == n + 1
    del prog
    gc.collect()
    assert len(mem.regions) == n and mem.collected
    U = ctx.wgpu.BufferUsage
    dst = ctx.device.create_buffer(size=16, usage=U.COPY_DST | U.COPY_SRC)
    try:
        ctx.uploader.write(dst, 0, np.arange(16, dtype=np.uint8))
        assert not mem.collected
        np.testing.assert_array_equal(_read(ctx, dst), np.arange(16, dtype=np.uint8))
    finally:
        dst.destroy()


def test_a_session_on_another_context_goes_through_its_ring(ctx, tmp_path):
    case = _mlp_case(width=19, depth=2)
    path, names, data = _saved(tmp_path, case)
    prog = gpudelegate.load(path, data_memory=ctx.gpu_readable_memory)
    with Environment() as e:
        up = e.context("dawn").uploader
        with e.session(prog, device="dawn") as s:
            assert up.stats.direct == 0 and up.stats.bytes == prog.constant_bytes_total
            _check(case, s.run("forward", [data[n] for n in names]), golden(case, data), *tolerance(case))


# ---------------------------------------------------------------------------- the copies themselves

def _fresh_memory(ctx, pages: int, buffer_pages: int):
    """Memory of ``pages`` pages covered by buffers of ``buffer_pages`` pages each, through a
    GpuReadableMemory of its own (the context's keeps the device's limit)."""
    from gpudelegate.native.dawn_staging import GpuReadableMemory

    mem = GpuReadableMemory(ctx, buffer_limit=buffer_pages * 4096)
    arr = mem.allocate(pages * mem.alignment)
    return mem, arr


def test_sources_across_buffer_bounds_odd_sizes_and_dirty_tails_arrive_exactly(ctx):
    from gpudelegate.native.dawn_staging import HostMemoryUploader

    up = HostMemoryUploader(ctx, piece=1 << 16, count=2)
    mem, arr = _fresh_memory(ctx, pages=7, buffer_pages=2)
    up.data_memory.close()
    up.data_memory = mem
    assert len(mem.regions) == 1 and len(next(iter(mem.regions.values()))[2]) == 4  # 2+2+2+1 pages
    a = mem.alignment
    rng = np.random.default_rng(3)
    arr[:] = rng.integers(1, 256, arr.size, dtype=np.uint8)  # no zero byte: every tail is dirty
    arr[5 * a + 4001:5 * a + 4004] = 0  # ...but this one
    U = ctx.wgpu.BufferUsage
    # (offset, size, copied without the ring): across one and three buffer bounds, an odd size
    # whose padding is not zero (its tail through the ring), two whose padding is, one at an
    # offset that is not a multiple of 4 (all through the ring)
    cases = [(a - 64, 3 * a + 128, True), (8, 6 * a, True), (1000, 4099, False),
             (5 * a + 4000, 1, True), (5 * a + 3000, 1001, True), (13, 300, False)]
    try:
        for off, n, direct in cases:
            dst = ctx.device.create_buffer(size=(n + 3) // 4 * 4 + 8, usage=U.STORAGE | U.COPY_DST | U.COPY_SRC)
            before = up.stats.copy()
            up.write(dst, 8, memoryview(arr)[off:off + n])
            st = up.stats.since(before)
            got = _read(ctx, dst)
            np.testing.assert_array_equal(got[8:8 + n], arr[off:off + n], err_msg=f"{off}+{n}")
            assert (got[8 + n:] == 0).all() and (got[:8] == 0).all(), f"{off}+{n}: padding"
            if direct:
                assert st.direct == n and st.bytes == 0, (off, n, st)
            else:
                assert st.bytes + st.direct == n and st.bytes > 0, (off, n, st)
            dst.destroy()
    finally:
        up.close()


def test_direct_and_ring_copies_of_one_flush_keep_their_order(ctx):
    from gpudelegate.native.dawn_staging import HostMemoryUploader

    up = HostMemoryUploader(ctx, piece=1 << 16, count=2)
    mem, arr = _fresh_memory(ctx, pages=1, buffer_pages=1)
    up.data_memory.close()
    up.data_memory = mem
    arr[:] = 7
    U = ctx.wgpu.BufferUsage
    dst = ctx.device.create_buffer(size=256, usage=U.STORAGE | U.COPY_DST | U.COPY_SRC)
    try:
        up.write(dst, 0, np.full(256, 1, np.uint8), defer=True)  # ring
        up.write(dst, 64, memoryview(arr)[:64], defer=True)  # direct, over it
        up.write(dst, 96, np.full(16, 2, np.uint8), defer=True)  # ring, over that
        up.flush()
        want = np.full(256, 1, np.uint8)
        want[64:128] = 7
        want[96:112] = 2
        np.testing.assert_array_equal(_read(ctx, dst), want)
        up.write(dst, 0, memoryview(arr)[:256], defer=True)  # direct only: a flush without staging
        up.flush()
        np.testing.assert_array_equal(_read(ctx, dst), np.full(256, 7, np.uint8))
    finally:
        up.close()
        dst.destroy()


# ---------------------------------------------------------------------------- errors

def test_without_host_memory_staging_there_is_no_gpu_readable_memory(dawn_adapter):
    with Environment(device_options={"dawn": {"upload_staging": "bar"}}) as e:
        c = e.context("dawn")
        with pytest.raises(DeviceError, match="gpu_readable_memory needs uploads staged in host memory"):
            c.gpu_readable_memory(4096)


def test_a_closed_context_or_a_bad_size_is_a_device_error(ctx):
    with pytest.raises(DeviceError, match="positive size"):
        ctx.gpu_readable_memory(0)
    e = Environment()
    c = e.context("dawn")
    e.close()
    with pytest.raises(DeviceError, match="closed"):
        c.gpu_readable_memory(64)
