"""Microbenchmark: WGSL matmul kernel variants and weight-upload strategies on one wgpu device,
against cuBLAS fp32 and a pinned host-to-device copy in torch (when CUDA is there), in one table.

    python benchmarks/bench_wgsl_matmul.py [--small] [--out DIR] [--sections mm,upload]

Matmul: square fp32 products (2048^3, 4096^3; 256^3 with --small) through
- ``mm``: matmul.wgsl's general kernel with the constants core/webgpu/ops_matmul.py gives it (u32
  storage, per-element dtype decode), 128x128 tiles, K step 8 and 16;
- ``mm_f32``: matmul_fast.wgsl (vec4 float32 storage, named registers), tile 128 or 64, K step
  8/16/32 (32 only where maxComputeWorkgroupStorageSize >= 32 KiB), B along n and (``kmaj``) B = W^T.
TFLOP/s from the wall time of back-to-back dispatches in one submit (median of repeats, after a
warm-up), so launch overhead is amortized. Every variant's result is checked against float64
numpy on 64 rows (relative max error); one odd shape (M, N, K not multiples of the tile) is
checked in full for each fast variant.

Upload: 1 GiB (64 MiB with --small) of float32 into device-local STORAGE buffers:
- ``write_buffer``: queue.write_buffer in pieces (what the executor's prepack does);
- ``mapped_new``: a fresh MAP_WRITE | COPY_SRC buffer per piece, mapped at creation, filled,
  unmapped, copy_buffer_to_buffer;
- ``mapped_pool_tN``: a pool of such staging buffers reused (map_async for write once the GPU
  copy that read it has run), each filled by N host threads copying slices with numpy (which
  releases the GIL), so filling piece k + 1 overlaps the GPU copy of piece k;
- ``executor Uploader``: the executor's own staging ring (native/wgpu_device.py) at several
  piece sizes (a fresh ring per repeat: its first pass allocates).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_wgpu import _import_gpudelegate  # noqa: E402  (imports the package from the tree)

_import_gpudelegate()

from gpudelegate import shaders  # noqa: E402
from gpudelegate.native.wgpu_device import WgpuContext  # noqa: E402

ROWS: List[tuple] = []


def row(section, variant, value, baseline="", ratio="", note=""):
    ROWS.append((section, variant, value, baseline, ratio, note))
    print(f"  {section} | {variant} | {value} | {baseline} | {ratio} | {note}", flush=True)


def median_time(fn: Callable[[], None], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# ============================================================================ matmul

def mm_uniform(M, N, K, a_sk, b_sk, b_sn):
    import struct
    a_sm = K
    vals = [M, N, K, 1, 0, 0, 0, 0, a_sm, a_sk, b_sk, b_sn, N, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    return struct.pack(f"<{len(vals)}I", *vals) + struct.pack("<fI", 1.0, 0)


class MMBench:
    def __init__(self, ctx: WgpuContext):
        self.ctx = ctx
        self.dev = ctx.device
        self.wgpu = ctx.wgpu
        self.smem = int(self.dev.limits["max-compute-workgroup-storage-size"])

    def buf(self, data: Optional[np.ndarray], nbytes: int = 0):
        w = self.wgpu
        u = w.BufferUsage
        n = data.nbytes if data is not None else nbytes
        b = self.dev.create_buffer(size=max(16, (n + 15) // 16 * 16),
                                   usage=u.STORAGE | u.COPY_DST | u.COPY_SRC)
        if data is not None:
            self.dev.queue.write_buffer(b, 0, data)
        return b

    def pipeline(self, shader, entry, consts):
        _, pl = self.ctx.layout((1, 2, 3, 4))
        mod = self.ctx.module(shader)
        return self.dev.create_compute_pipeline(layout=pl, compute={"module": mod, "entry_point": entry,
                                                                   "constants": consts})

    def run(self, shader, entry, consts, M, N, K, a, b, b_kmajor: bool, tile: int, reps: int):
        """Returns (seconds per product, C)."""
        w = self.wgpu
        u = w.BufferUsage
        A = self.buf(a)
        B = self.buf(b)
        C = self.buf(None, M * N * 4)
        bias = self.buf(None, 16)
        uni = mm_uniform(M, N, K, 1, 1 if b_kmajor else N, K if b_kmajor else 1)
        ub = self.dev.create_buffer(size=256, usage=u.UNIFORM | u.COPY_DST)
        self.dev.queue.write_buffer(ub, 0, uni)
        pipe = self.pipeline(shader, entry, consts)
        bgl, _ = self.ctx.layout((1, 2, 3, 4))
        bg = self.dev.create_bind_group(layout=bgl, entries=[
            {"binding": 0, "resource": {"buffer": ub, "offset": 0, "size": len(uni)}},
            {"binding": 1, "resource": {"buffer": C, "offset": 0, "size": C.size}},
            {"binding": 2, "resource": {"buffer": A, "offset": 0, "size": A.size}},
            {"binding": 3, "resource": {"buffer": B, "offset": 0, "size": B.size}},
            {"binding": 4, "resource": {"buffer": bias, "offset": 0, "size": bias.size}}])
        groups = (-(-N // tile), -(-M // tile), 1)

        def launch(n):
            enc = self.dev.create_command_encoder()
            cp = enc.begin_compute_pass()
            cp.set_pipeline(pipe)
            cp.set_bind_group(0, bg)
            for _ in range(n):
                cp.dispatch_workgroups(*groups)
            cp.end()
            self.dev.queue.submit([enc.finish()])
            self.ctx.fence()

        launch(1)
        t = median_time(lambda: launch(reps), 3, warmup=0) / reps
        out = np.frombuffer(self.dev.queue.read_buffer(C), np.float32)[:M * N].reshape(M, N).copy()
        for x in (A, B, C, bias, ub):
            x.destroy()
        return t, out


def variants(smem: int, small: bool):
    """(name, shader, entry, constants, tile, B as W^T)."""
    out = []
    for bk in (8, 16):
        if 2 * bk * 32 * 16 <= smem:
            out.append((f"mm 128 bk{bk}", "matmul.wgsl", "mm",
                        dict(DT_OUT=0, DTA=0, DTB=0, DTBIAS=0, BIAS=0, A_KMAJOR=True, B_NMAJOR=True,
                             WX=16, WY=16, BK=bk, TM=8), 128, False))
    for tile, bks in ((128, (8, 16, 32)), (64, (8, 16))):
        w = tile // 8
        for bk in bks:
            if bk * 2 * w * 2 * 16 > smem:
                continue
            for kmaj in (False, True):
                if kmaj and (tile, bk) != (128, 16):
                    continue
                out.append((f"mm_f32 {tile} bk{bk}{' kmaj' if kmaj else ''}", "matmul_fast.wgsl", "mm_f32",
                            dict(WX=w, WY=w, BK=bk, B_KMAJOR=kmaj), tile, kmaj))
    return out


def bench_mm(ctx, small: bool, torch_dev) -> dict:
    mb = MMBench(ctx)
    rng = np.random.default_rng(0)
    sizes = (256,) if small else (2048, 4096)
    best = {}
    cublas = {}
    for n in sizes:
        if torch_dev is not None:
            import torch
            torch.backends.cuda.matmul.allow_tf32 = False
            x = torch.randn(n, n, device="cuda")
            y = torch.randn(n, n, device="cuda")

            def f():
                for _ in range(10):
                    torch.mm(x, y)
                torch.cuda.synchronize()
            cublas[n] = 2 * n ** 3 / (median_time(f, 5) / 10) / 1e12
            row("matmul", f"cuBLAS fp32 {n}^3", f"{cublas[n]:.2f} TFLOP/s", note="TF32 off")
    for name, shader, entry, consts, tile, kmaj in variants(mb.smem, small):
        # Odd shape, checked in full (fast kernels need K, N multiples of 4).
        try:
            M, N, K = (67, 36, 44) if small else (1031, 1004, 1020)
            a = rng.standard_normal((M, K), dtype=np.float32)
            b = rng.standard_normal((K, N), dtype=np.float32)
            bb = np.ascontiguousarray(b.T) if kmaj else b
            _, c = mb.run(shader, entry, consts, M, N, K, a, bb, kmaj, tile, 1)
            ref = a.astype(np.float64) @ b.astype(np.float64)
            odd_err = float(np.abs(c - ref).max() / np.abs(ref).max())
            for n in sizes:
                a = rng.standard_normal((n, n), dtype=np.float32)
                b = rng.standard_normal((n, n), dtype=np.float32)
                bb = np.ascontiguousarray(b.T) if kmaj else b
                reps = 4 if n >= 4096 else 10
                t, c = mb.run(shader, entry, consts, n, n, n, a, bb, kmaj, tile, reps)
                ref = a[:64].astype(np.float64) @ b.astype(np.float64)
                err = float(np.abs(c[:64] - ref).max() / np.abs(ref).max())
                tf = 2 * n ** 3 / t / 1e12
                base = cublas.get(n)
                row("matmul", f"{name} {n}^3", f"{tf:.2f} TFLOP/s",
                    f"{base:.2f}" if base else "", f"{100 * tf / base:.0f} %" if base else "",
                    f"rel err {err:.1e}; odd {M}x{N}x{K} rel err {odd_err:.1e}")
                if err < 1e-4 and odd_err < 1e-4 and tf > best.get(n, ("", 0))[1]:
                    best[n] = (name, tf)
        except Exception as e:
            row("matmul", name, "FAILED", note=f"{type(e).__name__}: {str(e)[:300]}")
    return {"best": best, "cublas": cublas}


# ============================================================================ upload

def bench_upload(ctx, small: bool, torch_dev) -> dict:
    w = ctx.wgpu
    u = w.BufferUsage
    dev = ctx.device
    total = (64 << 20) if small else (1 << 30)
    host = np.random.default_rng(1).standard_normal(total // 4, dtype=np.float32)
    hb = host.view(np.uint8)
    dst_piece = (32 << 20) if small else (128 << 20)
    dsts = [dev.create_buffer(size=dst_piece, usage=u.STORAGE | u.COPY_DST | u.COPY_SRC)
            for _ in range(total // dst_piece)]
    res = {}
    if torch_dev is not None:
        import torch
        pin = torch.from_numpy(host).pin_memory()
        g = torch.empty_like(pin, device="cuda")

        def h2d():
            g.copy_(pin, non_blocking=True)
            torch.cuda.synchronize()
        res["pinned"] = total / median_time(h2d, 3) / 1e9
        row("upload", "torch pinned H2D", f"{res['pinned']:.1f} GB/s")
        del g, pin

    def check():
        # First and last 4 KiB of the last piece made it.
        d = dsts[-1]
        got = np.frombuffer(dev.queue.read_buffer(d, dst_piece - 4096, 4096), np.uint8)
        exp = hb[total - 4096:]
        return bool(np.array_equal(got, exp))

    def via_write_buffer(piece):
        def go():
            for i, d in enumerate(dsts):
                base = i * dst_piece
                for s in range(0, dst_piece, piece):
                    dev.queue.write_buffer(d, s, hb[base + s:base + s + piece])
            ctx.fence()
        return go

    def via_mapped_new(piece):
        def go():
            for i, d in enumerate(dsts):
                enc = dev.create_command_encoder()
                tmps = []
                for s in range(0, dst_piece, piece):
                    st = dev.create_buffer(size=piece, usage=u.MAP_WRITE | u.COPY_SRC, mapped_at_creation=True)
                    st.write_mapped(hb[i * dst_piece + s:i * dst_piece + s + piece])
                    st.unmap()
                    enc.copy_buffer_to_buffer(st, 0, d, s, piece)
                    tmps.append(st)
                dev.queue.submit([enc.finish()])
                for t in tmps:
                    t.destroy()
            ctx.fence()
        return go

    pool_exec = cf.ThreadPoolExecutor(16)

    def fill(mv, src, threads):
        dst = np.frombuffer(mv, np.uint8)
        n = src.nbytes
        step = -(-n // threads)
        step = (step + 4095) // 4096 * 4096
        futs = [pool_exec.submit(np.copyto, dst[s:s + step], src[s:s + step]) for s in range(0, n, step)]
        for f in futs:
            f.result()

    def via_mapped_pool(piece, nbuf, threads):
        pool = [dev.create_buffer(size=piece, usage=u.MAP_WRITE | u.COPY_SRC, mapped_at_creation=True)
                for _ in range(nbuf)]

        def go():
            k = 0
            for i, d in enumerate(dsts):
                for s in range(0, dst_piece, piece):
                    st = pool[k % nbuf]
                    if st.map_state != "mapped":
                        st.map_sync(w.MapMode.WRITE)   # waits for the copy that last read it
                    fill(st._experimental_get_mapped_range(), hb[i * dst_piece + s:i * dst_piece + s + piece],
                         threads)
                    st.unmap()
                    enc = dev.create_command_encoder()
                    enc.copy_buffer_to_buffer(st, 0, d, s, piece)
                    dev.queue.submit([enc.finish()])
                    k += 1
            ctx.fence()
        return go

    def via_uploader(piece, count):
        # The executor's staging ring (native/wgpu_device.py Uploader) with other piece sizes.
        from gpudelegate.native.wgpu_staging import Uploader

        up = Uploader(ctx, piece=piece, count=count)   # persistent, like the context's ring
        closers.append(up.close)

        def go():
            for i, d in enumerate(dsts):
                up.write(d, 0, hb[i * dst_piece:(i + 1) * dst_piece])
            ctx.fence()
        return go

    closers = []

    cands = [("write_buffer 64MiB", via_write_buffer(min(dst_piece, 64 << 20))),
             ("mapped_new 64MiB", via_mapped_new(min(dst_piece, 64 << 20)))]
    for piece, nbuf, thr in ((16 << 20, 4, 8), (64 << 20, 3, 8), (64 << 20, 4, 12), (128 << 20, 3, 8)):
        if piece <= dst_piece:
            cands.append((f"mapped_pool {piece >> 20}MiB x{nbuf} t{thr}", via_mapped_pool(piece, nbuf, thr)))
    for piece, count in ((32 << 20, 3), (64 << 20, 3), (128 << 20, 3)):
        if piece <= dst_piece:
            cands.append((f"executor Uploader {piece >> 20}MiB x{count}", via_uploader(piece, count)))
    best = ("", 0.0)
    for name, fn in cands:
        try:
            for d in dsts:   # clear so a strategy's check sees its own bytes
                enc = dev.create_command_encoder()
                enc.clear_buffer(d)
                dev.queue.submit([enc.finish()])
            ctx.fence()
            t = median_time(fn, 3)
            gbs = total / t / 1e9
            ok = check()
            pin = res.get("pinned")
            row("upload", name, f"{gbs:.1f} GB/s", f"{pin:.1f}" if pin else "",
                f"{100 * gbs / pin:.0f} %" if pin else "", "bytes ok" if ok else "WRONG BYTES")
            if ok and gbs > best[1]:
                best = (name, gbs)
        except Exception as e:
            row("upload", name, "FAILED", note=f"{type(e).__name__}: {str(e)[:300]}")
    res["best"] = best
    pool_exec.shutdown()
    for c in closers:
        c()
    for d in dsts:
        d.destroy()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sections", default="mm,upload")
    args = ap.parse_args(argv)
    torch_dev = None
    try:
        import torch
        if torch.cuda.is_available():
            torch_dev = torch.cuda.get_device_name()
    except ImportError:
        pass
    ctx = WgpuContext()
    print(f"device: {ctx.limits.name}; workgroup storage {ctx.device.limits['max-compute-workgroup-storage-size']}; "
          f"cuda: {torch_dev}", flush=True)
    data = {"device": ctx.limits.name, "cuda": torch_dev}
    secs = args.sections.split(",")
    for name, fn in (("mm", bench_mm), ("upload", bench_upload)):
        if name in secs:
            try:
                data[name] = fn(ctx, args.small, torch_dev)
            except Exception:
                traceback.print_exc()
                row(name, "section", "FAILED", note=traceback.format_exc().splitlines()[-1][:300])
    lines = ["| section | variant | ours | baseline | ours / baseline | note |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in ROWS]
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        slug = "".join(c if c.isalnum() else "_" for c in ctx.limits.name).strip("_").lower()[:60] + \
            ("_small" if args.small else "")
        (Path(args.out) / f"wgsl_matmul_{slug}.md").write_text(
            f"# WGSL matmul / upload variants: {ctx.limits.name}\n\n`python benchmarks/bench_wgsl_matmul.py`; "
            f"medians of timed repeats after warm-up; one run.\n\n{table}\n")
        (Path(args.out) / f"wgsl_matmul_{slug}.json").write_text(json.dumps({"rows": ROWS, **data}, indent=1, default=str))
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
