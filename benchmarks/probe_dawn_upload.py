"""Where the Dawn prepack's time goes: the host-memory upload ring (native/dawn_staging.py) in
variants, on the same float32 weights bench_dawn.py prepacks, beside torch's pinned copy measured
in the same process.

    python benchmarks/probe_dawn_upload.py [--set explore|confirm] [--small] [--reps 3] [--out FILE.json]

Each variant streams the program's constants (``bench_wgpu.weights_program``: 16 constants of
64 MiB) through a ``HostMemoryUploader`` into device buffers the way prepack does (one deferred
write per constant, a flush, a fence) and reports GB/s with the ring's own accounting
(``UploadStats``: fill, waits for a buffer's turn, making buffers, submits). Modes:

- ``full``: the ring as prepack uses it;
- ``fill``: no GPU work: the host's threaded copy into the ring's buffers alone;
- ``copy``: no host copy: the GPU's copies out of the ring, with the submits and the waits for
  a buffer's turn that ``full`` has.

``--set explore`` (the default) spans pieces (4-64 MiB), ring sizes and fill threads;
``--set confirm`` compares the ring's defaults with its earlier ones (``old``: 8 threads, parts of
8 MiB at least) and a few neighbours (128 MiB pieces, 12-16 threads).

Sources: ``prog`` (the constants as ``Program.constant_bytes`` gives them: distinct memory, read
from DRAM) and ``hot`` (the first constant every time: what a cache-warm fill measures). Then whole
sessions with the default ring and with the fastest ``full`` variant: prepack cold, warm, warm
after letting Dawn process its events, warm after a fence between the previous session's close and
the next build (and after a fence and an empty submit; and 0.3 s later instead); ``queue_ms`` is
the part of ``submit`` spent in the copies' queue.submit (the rest: encoding, and asking for the
work-done future). Every ``full`` variant's destinations are checked at
sampled offsets against the source bytes. ``--small`` (every size divided by 16: the variants keep
their full-size names) checks the script on a software adapter (Dawn on Mesa 25's lavapipe); its
numbers say nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("GPUDELEGATE_DAWN_TOGGLES", "allow_unsafe_apis,vulkan_enable_f16_on_nvidia")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_wgpu as bw  # noqa: E402  (imports gpudelegate, from the tree when not installed)

import gpudelegate  # noqa: E402
from gpudelegate.native.dawn_staging import HostMemoryUploader  # noqa: E402

M = 1 << 20


class ProbeRing(HostMemoryUploader):
    """The ring with one half switched off: ``fill`` submits nothing, ``copy`` copies nothing
    on the host (the GPU copies whatever the buffers hold); ``queue_s`` sums the time spent in
    the copies' queue.submit (the driver's share of ``stats.submit_s``)."""

    def __init__(self, ctx, mode: str = "full", **kw):
        HostMemoryUploader.__init__(self, ctx, **kw)
        self.mode = mode
        self.queue_s = 0.0

    def _fill(self, off, src):
        if self.mode != "copy":
            HostMemoryUploader._fill(self, off, src)

    def _submit(self):
        if self.mode == "fill":
            self.copies = []
            return
        if not self.copies:
            return
        t0 = time.perf_counter()
        enc = self.ctx.device.create_command_encoder()
        for src, src_off, dst, dst_off, size in self.copies:
            enc.copy_buffer_to_buffer(src, src_off, dst, dst_off, size)
        cb = enc.finish()
        t1 = time.perf_counter()
        self.ctx.queue.submit([cb])
        self.queue_s += time.perf_counter() - t1
        self.copies = []
        self.stats.submit_s += time.perf_counter() - t0

    def _submitted(self, buf):
        if self.mode != "fill":
            HostMemoryUploader._submitted(self, buf)


def ring_defaults(scale: int) -> dict:
    """HostMemoryUploader's default options, sizes divided by ``scale``."""
    import inspect

    sig = inspect.signature(HostMemoryUploader.__init__)
    d = {k: sig.parameters[k].default for k in ("piece", "count", "threads", "min_part")}
    return dict(d, piece=d["piece"] // scale, min_part=max(1, d["min_part"] // scale))


def confirm_variants(scale: int):
    """The ring's defaults against its earlier ones and a few neighbours."""
    m = M // scale
    old = dict(piece=64 * m, count=3, threads=8, min_part=8 * m)
    default = ring_defaults(scale)
    out = [("old: 64 MiB x3, 8 threads", "full", "prog", old), ("default", "full", "prog", default),
           ("default", "fill", "prog", default), ("default", "copy", "prog", default)]
    for piece, count, threads in ((128, 3, 16), (128, 3, 12), (128, 2, 16), (64, 4, 16), (64, 3, 14), (64, 3, 12)):
        out.append((f"{piece} MiB x{count}, threads {threads}", "full", "prog",
                    dict(default, piece=piece * m, count=count, threads=threads, min_part=m)))
    out += [("128 MiB x3, threads 16", "fill", "prog", dict(default, piece=128 * m, threads=16, min_part=m)),
            ("old: 64 MiB x3, 8 threads, again", "full", "prog", old), ("default, again", "full", "prog", default)]
    return out


def variants(scale: int):
    """(name, mode, source, ring options); sizes divided by ``scale`` (--small)."""
    m = M // scale
    old = dict(piece=64 * m, count=3, threads=8, min_part=8 * m)  # the ring's earlier defaults
    base = dict(old, min_part=m)
    out = [("old: 64 MiB x3, 8 threads", "full", "prog", old),
           ("old", "fill", "prog", old),
           ("old", "copy", "prog", old),
           ("old", "full", "hot", old),
           ("old", "fill", "hot", old)]
    out += [(f"threads {t}", "full", "prog", dict(base, threads=t)) for t in (4, 12, 16)]
    out += [(f"threads {t}", "fill", "prog", dict(base, threads=t)) for t in (4, 16)]
    out += [(f"count {c}", "full", "prog", dict(base, count=c)) for c in (4, 6)]
    for piece, count in ((32, 3), (16, 3), (16, 4), (8, 4), (8, 6), (8, 8), (4, 8)):
        out.append((f"{piece} MiB x{count}", "full", "prog", dict(base, piece=piece * m, count=count)))
    out += [("8 MiB x4", "fill", "prog", dict(base, piece=8 * m, count=4)),
            ("8 MiB x4", "copy", "prog", dict(base, piece=8 * m, count=4))]
    out += [(f"8 MiB x4, threads {t}", "full", "prog", dict(base, piece=8 * m, count=4, threads=t)) for t in (4, 16)]
    return out


def sampled_check(ctx, dsts, sources, nbytes: int) -> None:
    """The first, a middle and the last 4 KiB of every other destination equal the source."""
    for i in range(0, len(dsts), 2):
        src = np.frombuffer(sources[i], np.uint8)
        for off in (0, (nbytes // 2) // 4096 * 4096, nbytes - 4096):
            got = np.frombuffer(ctx.queue.read_buffer(dsts[i], off, 4096), np.uint8)
            if not np.array_equal(got, src[off:off + 4096]):
                raise AssertionError(f"destination {i} differs from its source at offset {off}")


def ring_run(ctx, mode, sources, dsts, opts, reps: int) -> dict:
    from wgpudawn.backends.dawn import extras

    up = ProbeRing(ctx, mode, **opts)
    total = sum(s.nbytes for s in sources)

    def one() -> float:
        t0 = time.perf_counter()
        for d, s in zip(dsts, sources):
            up.write(d, 0, s, defer=True)
        up.flush()
        ctx.fence()
        return time.perf_counter() - t0

    try:
        first = one()  # makes the ring's buffers
        before = up.stats.copy()
        secs = [one() for _ in range(reps)]
        st = up.stats.since(before)
        if mode == "full":
            sampled_check(ctx, dsts, sources, sources[0].nbytes)
    finally:
        up.close()
        extras.process_events()
    sec = statistics.median(secs)
    n = reps
    return {"gbps": total / sec / 1e9, "first_gbps": total / first / 1e9, "ms": sec * 1e3,
            "fill_ms": st.fill_s / n * 1e3, "fill_gbps": (st.bytes / st.fill_s / 1e9) if st.fill_s else 0.0,
            "wait_ms": st.wait_s / n * 1e3, "make_ms": st.make_s / n * 1e3, "submit_ms": st.submit_s / n * 1e3,
            "pieces": st.pieces // n, "fill_threads": up.fill_threads}


def sessions(prog, opts: dict) -> list:
    """Prepack of ``prog`` through a ring with ``opts`` in a fresh context (cold), again (warm),
    again after Dawn processed its events, and again after a fence between the previous
    session's close (its buffers destroyed) and the next build."""
    from wgpudawn.backends.dawn import extras

    env = gpudelegate.Environment()
    out = []
    try:
        ctx = env.context("dawn")
        ctx.uploader.close()
        ctx.uploader = up = ProbeRing(ctx, **opts)
        between = {"cold": lambda: None, "warm": lambda: None, "warm, events processed": extras.process_events,
                   "warm, fence after close": ctx.fence,
                   "warm, fence + empty submit": lambda: (ctx.fence(), ctx.queue.submit([])),
                   "warm, 0.3 s after close": lambda: time.sleep(0.3)}
        for label, step in between.items():
            step()
            before, queue0 = up.stats.copy(), up.queue_s
            with env.session(prog, device="dawn") as s:
                ex = s.executor
                st = up.stats.since(before)
                out.append({"run": label, "gbps": ex.upload_bytes / ex.upload_seconds / 1e9,
                            "ms": ex.upload_seconds * 1e3, "fill_ms": st.fill_s * 1e3, "wait_ms": st.wait_s * 1e3,
                            "make_ms": st.make_s * 1e3, "submit_ms": st.submit_s * 1e3,
                            "queue_ms": (up.queue_s - queue0) * 1e3,
                            "other_ms": (ex.upload_seconds - st.fill_s - st.wait_s - st.make_s - st.submit_s) * 1e3})
    finally:
        env.close()
    return out


def pinned_gbps(tch, total: int):
    if tch is None or not tch.cuda:
        return None
    t = tch.torch
    host = t.empty(total, dtype=t.uint8, pin_memory=True)
    host.fill_(7)
    dev = t.empty(total, dtype=t.uint8, device="cuda")
    sec = tch.timed(lambda: dev.copy_(host, non_blocking=True), 5)
    del host, dev
    t.cuda.empty_cache()
    return total / sec / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", choices=("explore", "confirm"), default="explore")
    ap.add_argument("--small", action="store_true",
                    help="every size divided by 16: checks the script on a software adapter")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="", help="write every number as JSON here")
    a = ap.parse_args(argv)
    scale = 16 if a.small else 1
    total, piece = (1 << 30) // scale, (64 << 20) // scale
    try:
        tch = bw.Torch()
    except ImportError:
        tch = None
    prog = bw.weights_program(total, piece)
    sources = [prog.constant_bytes(i) for i in range(len(prog.constants))]
    env = gpudelegate.Environment()
    ctx = env.context("dawn")
    info = ctx.info()
    print(f"dawn: {info.get('device')}; staging {info.get('upload_staging')}; cpus {os.cpu_count()}; "
          f"{tch.label if tch else 'no torch'}", flush=True)
    res = {"device": str(info.get("device")), "cpus": os.cpu_count(), "bytes": total, "variants": []}
    res["pinned_gbps_before"] = pinned_gbps(tch, total)
    U = ctx.wgpu.BufferUsage
    dsts = [ctx.device.create_buffer(size=s.nbytes, usage=U.STORAGE | U.COPY_DST | U.COPY_SRC) for s in sources]
    hot = [sources[0]] * len(sources)
    for name, mode, source, opts in (variants if a.set == "explore" else confirm_variants)(scale):
        r = ring_run(ctx, mode, sources if source == "prog" else hot, dsts, opts, a.reps)
        r.update(name=name, mode=mode, source=source, opts=opts)
        res["variants"].append(r)
        print(f"  {name:32s} {mode:4s} {source:4s} {r['gbps']:6.1f} GB/s (first {r['first_gbps']:5.1f}) | "
              f"fill {r['fill_ms']:6.1f} ms ({r['fill_gbps']:5.1f} GB/s, {r['fill_threads']} thr) wait {r['wait_ms']:6.1f} "
              f"make {r['make_ms']:5.1f} submit {r['submit_ms']:5.1f} | {r['pieces']} pieces", flush=True)
    for d in dsts:
        d.destroy()
    env.close()
    full = [r for r in res["variants"] if r["mode"] == "full" and r["source"] == "prog"]
    best = max(full, key=lambda r: r["gbps"])
    res["best"] = best["name"]
    res["sessions"] = {"default": sessions(prog, ring_defaults(scale)), "best": sessions(prog, best["opts"])}
    res["pinned_gbps_after"] = pinned_gbps(tch, total)
    pin = res["pinned_gbps_before"]
    print(f"\npinned H2D (torch): {pin} / {res['pinned_gbps_after']} GB/s (before / after)")
    print(f"fastest full variant: {best['name']} {best['gbps']:.1f} GB/s"
          + (f" = {best['gbps'] / pin:.0%} of pinned" if pin else ""))
    for which, rows in res["sessions"].items():
        for r in rows:
            print(f"  session prepack, {which:7s} {r['run']:26s} {r['gbps']:6.1f} GB/s {r['ms']:6.1f} ms: "
                  f"fill {r['fill_ms']:.1f} wait {r['wait_ms']:.1f} make {r['make_ms']:.1f} submit {r['submit_ms']:.1f} (queue.submit "
                  f"{r['queue_ms']:.1f}) other {r['other_ms']:.1f}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
