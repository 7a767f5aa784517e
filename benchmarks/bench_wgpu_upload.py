"""Where the wgpu weight upload's time goes: host fill into mapped staging, the DMA, and the
waits between them, each measured alone and then together, against torch's pinned H2D copy.

    python benchmarks/bench_wgpu_upload.py [--total-mib 1024] [--pieces 64,128] [--small]

Prints one table; with ``--record`` writes benchmarks/results/wgpu_upload_<device>.md. Rows, for
both kinds of staging the executor's Uploader can use (``bar``: WebGPU's MAP_WRITE | COPY_SRC;
``host``: MAP_READ | COPY_SRC under wgpu-native's mappable-primary-buffers, placed in host
memory): the host fill alone (threads copying into a mapped buffer), the copy alone (from filled
staging into a device buffer), the Uploader ring (3/4/6 buffers) and a session's prepack in a
fresh context (cold) and the next one (warm); for ``bar`` also a variant that maps the next buffer
ahead, destinations created mapped_at_creation and the ring with the blocking marker waits
prepack used to make. Every ring's destination is read back and compared with its source.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_wgpu import weights_program  # noqa: E402  (imports gpudelegate from the tree when not installed)

import gpudelegate  # noqa: E402
from gpudelegate.native.wgpu_device import WgpuContext  # noqa: E402
from gpudelegate.native.wgpu_staging import Uploader, host_staging_possible  # noqa: E402


def _gbps(nbytes: int, sec: float) -> float:
    return nbytes / sec / 1e9


def _staging_buffer(ctx: WgpuContext, piece: int, staging: str):
    """One mapped staging buffer of the kind the Uploader makes for ``staging``."""
    up = Uploader(ctx, piece=piece, count=1, staging=staging)
    return up._new()


def fill_rate(ctx: WgpuContext, piece: int, threads: int, reps: int, staging: str = "bar") -> float:
    """Host copies into one mapped staging buffer (no DMA): the fill ceiling."""
    buf = _staging_buffer(ctx, piece, staging)
    dst = np.frombuffer(buf._experimental_get_mapped_range(0, piece), np.uint8)
    src = np.random.default_rng(0).integers(0, 255, piece, dtype=np.uint8)
    pool = ThreadPoolExecutor(threads)
    step = -(-piece // threads)

    def one():
        list(pool.map(lambda i: np.copyto(dst[i:i + step], src[i:i + step]), range(0, piece, step)))
    one()
    t = time.perf_counter()
    for _ in range(reps):
        one()
    sec = time.perf_counter() - t
    del dst
    buf.unmap()
    buf.destroy()
    pool.shutdown()
    return _gbps(piece * reps, sec)


def dma_rate(ctx: WgpuContext, piece: int, count: int, total: int, staging: str = "bar") -> float:
    """copy_buffer_to_buffer from filled, unmapped staging buffers into one device buffer."""
    w = ctx.wgpu
    bufs = []
    for _ in range(count):
        b = _staging_buffer(ctx, piece, staging)
        np.frombuffer(b._experimental_get_mapped_range(0, piece), np.uint8)[:] = 7
        b.unmap()
        bufs.append(b)
    dst = ctx.device.create_buffer(size=total, usage=w.BufferUsage.STORAGE | w.BufferUsage.COPY_DST)

    def go():
        enc = ctx.device.create_command_encoder()
        for k, s in enumerate(range(0, total, piece)):
            enc.copy_buffer_to_buffer(bufs[k % count], 0, dst, s, piece)
        ctx.queue.submit([enc.finish()])
        ctx.fence()
    go()
    t = time.perf_counter()
    go()
    sec = time.perf_counter() - t
    for b in bufs:
        b.destroy()
    dst.destroy()
    return _gbps(total, sec)


def check_bytes(ctx: WgpuContext, dst, src: np.ndarray) -> None:
    """Read ``dst`` back and compare it with ``src``: a rate is only worth printing if the bytes arrived."""
    got = np.frombuffer(ctx.queue.read_buffer(dst), np.uint8)
    if not np.array_equal(got[:src.nbytes], src):
        bad = int(np.flatnonzero(got[:src.nbytes] != src)[0])
        raise AssertionError(f"upload corrupted: first differing byte at {bad} of {src.nbytes}")


def ring_rate(ctx: WgpuContext, src: np.ndarray, piece: int, count: int, marker_every: int = 0,
              staging: str = "bar") -> float:
    """The executor's Uploader end to end (fill + unmap + copy per piece, one fence at the end);
    with ``marker_every`` > 0, a blocking marker wait every that many pieces (what prepack did
    between chunks) on the marker one behind."""
    w = ctx.wgpu
    dst = ctx.device.create_buffer(size=src.nbytes, usage=w.BufferUsage.STORAGE | w.BufferUsage.COPY_DST | w.BufferUsage.COPY_SRC)
    up = Uploader(ctx, piece=piece, count=count, staging=staging)
    up.write(dst, 0, src[:piece])  # the ring's buffers exist before timing
    ctx.fence()
    rates = []
    for _ in range(2):
        t = time.perf_counter()
        prev = None
        for k, s in enumerate(range(0, src.nbytes, piece)):
            up.write(dst, s, src[s:s + piece])
            if marker_every and (k + 1) % marker_every == 0:
                m = ctx.marker()
                if prev is not None:
                    ctx.wait(prev)
                prev = m
        if prev is not None:
            ctx.wait(prev)
        ctx.fence()
        rates.append(_gbps(src.nbytes, time.perf_counter() - t))
    up.close()
    check_bytes(ctx, dst, src)
    dst.destroy()
    return max(rates)


def prepack_rates(total: int, piece: int, count: int, staging: str = "bar"):
    """A session's prepack (the executor's path) through a ring of ``count`` x ``piece``: the
    first session of a fresh Environment (cold: the ring's buffers are made on the way) and the
    second (warm)."""
    os.environ["GPUDELEGATE_WGPU_STAGING"] = staging  # the context the Environment makes
    try:
        env = gpudelegate.Environment()
        ctx = env.context("wgpu")
    finally:
        del os.environ["GPUDELEGATE_WGPU_STAGING"]
    ctx.uploader.close()
    ctx.uploader = Uploader(ctx, piece=piece, count=count, staging=staging)
    prog = weights_program(total, 64 << 20)
    rates = []
    for _ in range(2):
        with env.session(prog, device="wgpu") as s:
            rates.append(_gbps(s.executor.upload_bytes, s.executor.upload_seconds))
    env.close()
    return rates


class PremapUploader(Uploader):
    """Experimental: asks for the map of the buffer two turns ahead right after each submit, so
    the poll thread resolves it while the host fills the current one."""

    def __init__(self, ctx, piece, count, threads=8):
        super().__init__(ctx, piece=piece, count=count, staging="bar")
        self.promises = {}
        self.nthreads = threads

    def _take(self):
        w = self.ctx.wgpu
        if len(self.bufs) < self.count:
            return super()._take()
        buf = self.bufs[self.turn]
        self.turn = (self.turn + 1) % self.count
        pr = self.promises.pop(id(buf), None)
        if pr is None:
            buf.map_sync(w.MapMode.WRITE, 0, self.piece)
        else:
            pr.sync_wait()
        return buf

    def _write(self, dst, dst_offset, mv):
        super()._write(dst, dst_offset, mv)
        if len(self.bufs) == self.count:
            nxt = self.bufs[(self.turn + 1) % self.count]
            if id(nxt) not in self.promises and nxt.map_state == "unmapped":
                self.promises[id(nxt)] = nxt.map_async(self.ctx.wgpu.MapMode.WRITE, 0, self.piece)


def premap_rate(ctx, src, piece, count):
    w = ctx.wgpu
    dst = ctx.device.create_buffer(size=src.nbytes, usage=w.BufferUsage.STORAGE | w.BufferUsage.COPY_DST)
    up = PremapUploader(ctx, piece, count)
    for s in range(0, min(src.nbytes, count * piece), piece):
        up.write(dst, s, src[s:s + piece])
    ctx.fence()
    rates = []
    for _ in range(2):
        t = time.perf_counter()
        for s in range(0, src.nbytes, piece):
            up.write(dst, s, src[s:s + piece])
        ctx.fence()
        rates.append(_gbps(src.nbytes, time.perf_counter() - t))
    for pr in up.promises.values():
        pr.sync_wait()
    up.close()
    dst.destroy()
    return max(rates)


def mapped_dst_rate(ctx, src, piece, threads=8):
    """Destination buffers created mapped_at_creation (wgpu stages them itself): fill + unmap."""
    w = ctx.wgpu
    pool = ThreadPoolExecutor(threads)
    rates = []
    for _ in range(2):
        bufs = []
        t = time.perf_counter()
        for s in range(0, src.nbytes, piece):
            b = ctx.device.create_buffer(size=piece, usage=w.BufferUsage.STORAGE | w.BufferUsage.COPY_DST,
                                         mapped_at_creation=True)
            d = np.frombuffer(b._experimental_get_mapped_range(0, piece), np.uint8)
            step = -(-piece // threads)
            list(pool.map(lambda i: np.copyto(d[i:i + step], src[s + i:s + i + step]), range(0, piece, step)))
            del d
            b.unmap()
            bufs.append(b)
        ctx.fence()
        rates.append(_gbps(src.nbytes, time.perf_counter() - t))
        for b in bufs:
            b.destroy()
    pool.shutdown()
    return max(rates)


def torch_pinned(total: int):
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, _gbps(total, time.perf_counter() - t))
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--pieces", default="64,128", help="staging piece sizes in MiB, comma-separated")
    ap.add_argument("--small", action="store_true", help="small sizes (software adapter)")
    ap.add_argument("--record", action="store_true", help="write benchmarks/results/wgpu_upload_<device>.md")
    a = ap.parse_args(argv)
    total = (32 << 20) if a.small else (a.total_mib << 20)
    pieces = [8 << 20] if a.small else [int(p) << 20 for p in a.pieces.split(",")]
    try:  # a device that may stage in host memory (it is the other rows' device too)
        ctx = WgpuContext(upload_staging="host")
        host = host_staging_possible(ctx)
    except Exception as e:
        print("host-memory staging:", e)
        ctx, host = WgpuContext(), False
    print("device:", ctx.limits.name, "| host-memory staging:", "yes" if host else "no (mappable-primary-buffers missing)")
    stagings = ["bar", "host"] if host else ["bar"]
    src = np.random.default_rng(1).integers(0, 255, total, dtype=np.uint8)
    rows = []
    cpus = os.cpu_count() or 1
    for piece in pieces:
        for th in sorted({4, 8, 12, min(16, cpus)}):
            rows.append((f"fill {piece >> 20} MiB, {th} threads", fill_rate(ctx, piece, th, 4 if a.small else 8)))
            if host:
                rows.append((f"host staging: fill {piece >> 20} MiB, {th} threads",
                             fill_rate(ctx, piece, th, 4 if a.small else 8, "host")))
        rows.append((f"DMA {piece >> 20} MiB pieces", dma_rate(ctx, piece, 3, total)))
        if host:
            rows.append((f"host staging: DMA {piece >> 20} MiB pieces", dma_rate(ctx, piece, 3, total, "host")))
        for count in (3, 4, 6):
            rows.append((f"ring {piece >> 20} MiB x{count}", ring_rate(ctx, src, piece, count)))
            if host:
                rows.append((f"host staging: ring {piece >> 20} MiB x{count}",
                             ring_rate(ctx, src, piece, count, staging="host")))
        for count in (3, 4):
            rows.append((f"premapped ring {piece >> 20} MiB x{count}", premap_rate(ctx, src, piece, count)))
        rows.append((f"mapped_at_creation destinations, {piece >> 20} MiB", mapped_dst_rate(ctx, src, piece)))
        rows.append((f"ring {piece >> 20} MiB x3, marker wait per piece", ring_rate(ctx, src, piece, 3, 1)))
        rows.append((f"ring {piece >> 20} MiB x3, marker wait per 4", ring_rate(ctx, src, piece, 3, 4)))
    for piece in pieces:
        for count in (3, 4):
            for staging in stagings:
                cold, warm = prepack_rates(total, piece, count, staging)
                tag = "host staging: " if staging == "host" else ""
                rows.append((f"{tag}session prepack, ring {piece >> 20} MiB x{count}, cold", cold))
                rows.append((f"{tag}session prepack, ring {piece >> 20} MiB x{count}, warm", warm))
    pinned = torch_pinned(total)
    lines = [f"| {ctx.limits.name}: {total >> 20} MiB | GB/s | of torch pinned H2D |", "|---|---:|---:|"]
    for name, r in rows:
        lines.append(f"| {name} | {r:.2f} | {'' if pinned is None else f'{100 * r / pinned:.0f} %'} |")
    lines.append(f"| torch pinned H2D (anchor) | {'n/a' if pinned is None else f'{pinned:.2f}'} | |")
    print("\n" + "\n".join(lines))
    if a.record:
        slug = "".join(c if c.isalnum() else "_" for c in ctx.limits.name).strip("_").lower()[:60]
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"wgpu_upload_{slug}.md")
        with open(path, "w") as f:
            f.write(f"# wgpu upload probe: {ctx.limits.name}\n\n`python benchmarks/bench_wgpu_upload.py"
                    f"{' --small' if a.small else ''}`, {os.cpu_count()} CPUs\n\n" + "\n".join(lines) + "\n")
        print("recorded", path)
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
