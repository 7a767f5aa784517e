"""Dawn (wgpudawn) against wgpu-native and PyTorch on the same GPU: one run, one table, recorded
under benchmarks/results/.

    python benchmarks/bench_dawn.py [--out DIR] [--small] [--sections upload,minilm,smollm2]

Dawn runs with the toggles of its fast paths (``allow_unsafe_apis``, ``vulkan_enable_f16_on_nvidia``:
host-memory uploads, subgroup matrices, f16 on NVIDIA) unless GPUDELEGATE_DAWN_TOGGLES says
otherwise. Seeded random weights everywhere.

1. **upload**: prepack bandwidth of the same float32 weights (1 GiB in 64 MiB constants) on Dawn
   (its host-memory ring, ``native/dawn_staging.py``) and on wgpu-native (its mapped ring), against
   a pinned CUDA copy of the same bytes (torch) in the same run; a fresh context each (cold) and a
   second build (warm).
2. **minilm**: MiniLM-L6 shape (seeded, as ``bench_wgpu.py``) at 1x128 and 32x128 on dawn
   (precision exact, and ``precision="fast"`` where the session accepts that option) and wgpu,
   against PyTorch eager fp32 and fp16; every pair of runs alternated; dispatches and the host time
   of encoding one run.
3. **smollm2**: SmolLM2-135M architecture (seeded, float32 weights, as ``bench_decode.py``):
   prefill of one 128-token chunk and greedy decode tok/s on dawn and wgpu against PyTorch eager
   fp32 (static KV cache); dispatches per step and host ms per step in ``run()``.

``--small`` (32 MiB, 2-layer models, short sequences) checks the script on a software adapter
(Dawn on Mesa 25's lavapipe: VK_DRIVER_FILES=.cache/mesa25/lvp25.json); its numbers say nothing
about speed.
"""

from __future__ import annotations

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
from gpudelegate.errors import DeviceError, GpuDelegateError  # noqa: E402

import bench_decode as bd  # noqa: E402
from bench_report import Report, finish, parse_args, result_writer, section  # noqa: E402

COLUMNS = [("section", "section"), ("metric", "metric"), ("dawn", "dawn"), ("wgpu", "wgpu-native"),
           ("torch", "torch"), ("note", "note")]
DEVICES = ("dawn", "wgpu")


def _available(env, device: str):
    """None where ``device`` starts, else why not."""
    try:
        env.context(device)
        return None
    except DeviceError as e:
        return str(e)[:160]


# ============================================================================ upload

def bench_upload(rep: Report, env, tch, small: bool) -> None:
    total = (32 << 20) if small else (1 << 30)
    piece = (8 << 20) if small else (64 << 20)
    prog = bw.weights_program(total, piece)
    cells = {}
    for device in DEVICES:
        fresh = gpudelegate.Environment()  # a context of its own: "cold" makes its staging ring
        try:
            why = _available(fresh, device)
            if why:
                cells[device] = ("skipped", why)
                continue
            got = []
            for _ in ("cold", "warm"):
                with fresh.session(prog, device=device) as s:
                    ex = s.executor
                    got.append(ex.upload_bytes / ex.upload_seconds / 1e9)
            staging = fresh.context(device).uploader.staging
            cells[device] = (f"{got[0]:.1f} / {got[1]:.1f} GB/s", staging)
        finally:
            fresh.close()
    base = "n/a (no CUDA here)"
    if tch is not None and tch.cuda:
        t = tch.torch
        host = t.empty(total, dtype=t.uint8, pin_memory=True)
        host.fill_(7)
        dev = t.empty(total, dtype=t.uint8, device="cuda")
        sec = tch.timed(lambda: dev.copy_(host, non_blocking=True), 5)
        base = f"{total / sec / 1e9:.1f} GB/s pinned H2D"
        del host, dev
    rep.row("upload", f"prepack of {total >> 20} MiB float32 weights (cold / warm)", cells["dawn"][0],
            cells["wgpu"][0], base, f"dawn staging: {cells['dawn'][1]}; wgpu staging: {cells['wgpu'][1]}")
    rep.data["upload"] = {"bytes": total, "dawn": cells["dawn"], "wgpu": cells["wgpu"], "torch": base}
    if _available(env, "dawn") is None and "host-mapped-pointer" in env.context("dawn").features:
        _host_ring_parts(rep, env.context("dawn"), (8 << 20) if small else (64 << 20), 4 if small else 16)


def _host_ring_parts(rep: Report, ctx, piece: int, reps: int) -> None:
    """The two halves of the host-memory ring, each alone: the host's threaded copy into host
    memory (what ``HostMemoryUploader`` fills a piece with) and the GPU's copy_buffer_to_buffer
    out of a host-memory buffer (``reps`` pieces in one submit)."""
    from concurrent.futures import ThreadPoolExecutor

    from gpudelegate.native.dawn_staging import HostMemoryUploader

    up = HostMemoryUploader(ctx, piece=piece, count=1)
    buf = up._new()
    view = np.frombuffer(up.memory[id(buf)], np.uint8)
    src = np.random.default_rng(0).integers(0, 256, up.piece, dtype=np.uint8)
    threads = min(8, os.cpu_count() or 1)
    step = -(-up.piece // threads)
    pool = ThreadPoolExecutor(max_workers=threads)

    def fill() -> float:
        t0 = time.perf_counter()
        list(pool.map(lambda i: np.copyto(view[i:i + step], src[i:i + step]), range(0, up.piece, step)))
        return time.perf_counter() - t0

    fill()
    fill_gbps = up.piece / bw._median(fill, reps) / 1e9
    U = ctx.wgpu.BufferUsage
    dst = ctx.device.create_buffer(size=up.piece, usage=U.STORAGE | U.COPY_DST)

    def copy() -> float:
        enc = ctx.device.create_command_encoder()
        for _ in range(reps):
            enc.copy_buffer_to_buffer(buf, 0, dst, 0, up.piece)
        ctx.fence()
        t0 = time.perf_counter()
        ctx.queue.submit([enc.finish()])
        ctx.fence()
        return time.perf_counter() - t0

    copy()
    copy_gbps = reps * up.piece / bw._median(copy, 3) / 1e9
    pool.shutdown()
    dst.destroy()
    buf.destroy()
    up.close()
    rep.row("upload", f"host-memory ring halves, {up.piece >> 20} MiB pieces: fill / GPU copy",
            f"{fill_gbps:.1f} / {copy_gbps:.1f} GB/s", "", "",
            f"fill: numpy copy by {threads} threads into host memory; copy: {reps} copy_buffer_to_buffer in one submit")
    rep.data["host_ring_parts"] = {"fill_gbps": fill_gbps, "copy_gbps": copy_gbps, "piece": up.piece}


# ============================================================================ MiniLM

def _session(env, prog, device: str, precision):
    """A session, or None where this tree's sessions do not take ``precision`` (an older tree)."""
    opts = {} if precision is None else {"precision": precision}
    try:
        return env.session(prog, device=device, **opts)
    except (TypeError, GpuDelegateError) as e:
        if precision is not None and "precision" in str(e):
            return None
        raise


def bench_minilm(rep: Report, env, tch, small: bool) -> None:
    import torch

    from gpudelegate.export.models import minilm
    from gpudelegate.export.writer import export_program

    cfg = minilm.MiniLMConfig(layers=2) if small else minilm.MiniLMConfig()
    hf = bw._hf_bert(cfg, seed=0)
    ours = minilm.MiniLM(cfg)
    ours.load_state_dict(hf.state_dict(), strict=False)
    ours.eval()
    shapes = [(1, 16), (2, 16)] if small else [(1, 128), (32, 128)]
    reps = 3 if small else 20
    hf32 = hf.to(tch.dev)
    hf16 = bw._hf_bert(cfg, seed=0).to(tch.dev).half() if tch.cuda else None
    for b, t in shapes:
        with torch.no_grad():
            prog = export_program(ours, minilm.example_inputs(b, t), progress=False)
        rng = np.random.default_rng(b * 1000 + t)
        ids = rng.integers(1000, cfg.vocab_size, (b, t)).astype(np.int32)
        mask = np.ones((b, t), np.int32)
        mask[b // 2:, t - t // 4:] = 0
        tid, tmask = torch.from_numpy(ids.astype(np.int64)).to(tch.dev), torch.from_numpy(mask).to(tch.dev)

        def hf_run(m):
            with torch.no_grad():
                h = m(input_ids=tid, attention_mask=tmask).last_hidden_state.float()
                mm = tmask.unsqueeze(-1).float()
                return torch.nn.functional.normalize((h * mm).sum(1) / mm.sum(1).clamp(min=1e-9), dim=-1)

        want = hf_run(hf32).float().cpu().numpy()
        torch_cells = []
        for label, m in (("fp32", hf32), ("fp16", hf16)):
            if m is None:
                continue
            hf_run(m)
            torch_cells.append(f"{label} {bw._fmt_ms(tch.timed(lambda: hf_run(m), reps))}")
        torch_cell = ", ".join(torch_cells) + f" ({'eager' if tch.cuda else 'CPU'})"
        for precision in (None, "fast"):
            cells, notes = {}, []
            sessions = {}
            for device in DEVICES:
                why = _available(env, device)
                if why:
                    cells[device] = "skipped"
                    notes.append(f"{device}: {why}")
                    continue
                s = _session(env, prog, device, precision)
                if s is None:
                    cells[device] = "n/a"
                    notes.append(f"{device}: sessions here take no precision option")
                    continue
                sessions[device] = s
            if not sessions:
                if precision is not None:
                    continue
            try:
                for device, s in sessions.items():
                    got = s.run("forward", [ids, mask])[0]
                    s.run("forward", [ids, mask])
                    err = float(np.abs(np.asarray(got, np.float64) - want).max())
                    calls = sum(len(n.launches) for n in s.executor.recorded[0].nodes)
                    host = bw._median(lambda: bw._encode_seconds(s.executor), 5)
                    notes.append(f"{device}: {calls} dispatches, encode {host * 1e3:.2f} ms, max |diff| {err:.1e}")
                # every device's runs alternated with the others' (a lent GPU's speed drifts)
                times = {d: [] for d in sessions}
                for _ in range(reps):
                    for device, s in sessions.items():
                        times[device].append(bw._timed_run(s, "forward", [ids, mask]))
                for device in sessions:
                    cells[device] = bw._fmt_ms(statistics.median(times[device]))
            finally:
                for s in sessions.values():
                    s.close()
            label = f"{b}x{t} embeddings" + (f", precision={precision!r}" if precision else ", exact")
            rep.row("minilm", label, cells.get("dawn", ""), cells.get("wgpu", ""), torch_cell, "; ".join(notes))
            rep.data.setdefault("minilm", {})[label] = {"cells": cells, "torch": torch_cell, "notes": notes}


# ============================================================================ SmolLM2

def _export_float32(model, cfg):
    import torch

    from gpudelegate.export.frontend import export_method
    from gpudelegate.export.models import smollm2
    from gpudelegate.export.writer import export_program

    names = smollm2.cache_names(cfg)
    with torch.no_grad():
        methods = {"prefill": export_method(smollm2.Prefill(model), smollm2.example_inputs(cfg, "prefill")),
                   "decode": export_method(smollm2.Decode(model), smollm2.example_inputs(cfg, "decode"))}
        return export_program(methods, weights_dtype="float32", progress=False,
                              input_names={"prefill": ["ids", "pos", "last", *names], "decode": ["ids", "pos", *names]},
                              output_names={m: ["logits", *names] for m in methods})


def bench_smollm2(rep: Report, env, tch, small: bool) -> None:
    import torch

    cfg = bd.model_config(small)
    wl = bd.Workload(cfg, small)
    model, _packed = bd.random_model(cfg)
    prog = _export_float32(model, cfg)
    lc, tw = bd.torch_weights(model, cfg)
    a = bd.run_torch(torch, lc, tw, torch.float32, tch.dev, wl)
    gold = a["logits0"]
    res = {}
    for device in DEVICES:
        why = _available(env, device)
        res[device] = {"skipped": why} if why else bd.run_ours(env, prog, device, wl)
    prefill, decode, notes = {}, {}, []
    for device, r in res.items():
        if "skipped" in r:
            prefill[device] = decode[device] = "skipped"
            notes.append(f"{device}: {r['skipped']}")
            continue
        err = bd.bc.rel_err(r["logits0"], gold)
        prefill[device] = bw._fmt_ms(r["prefill_s"])
        decode[device] = f"{r['decode_tok_s']:.0f} tok/s"
        notes.append(f"{device}: logits rel err {err:.1e}, {r['dispatches']} dispatches/step, "
                     f"host {r['host_ms_per_step']:.3f} ms/step")
        if err > bd.LOGITS_TOL["float32"]:
            rep.errors.append(f"smollm2 {device}: prefill logits rel err {err:.1e}")
    where = "eager fp32" + ("" if tch.cuda else " (CPU)")
    rep.row("smollm2", f"prefill {wl.chunk} tokens", prefill["dawn"], prefill["wgpu"],
            f"{bw._fmt_ms(a['prefill_s'])} {where}", "; ".join(notes))
    rep.row("smollm2", f"greedy decode ({wl.n_dec} steps)", decode["dawn"], decode["wgpu"],
            f"{a['decode_tok_s']:.0f} tok/s {where}", "KV cache on the device, argmax read back each step")
    rep.data["smollm2"] = {d: {k: v for k, v in r.items() if k != "logits0"} for d, r in res.items()}
    rep.data["smollm2"]["torch"] = {k: v for k, v in a.items() if k != "logits0"}


# ============================================================================ main

def main(argv=None) -> int:
    args = parse_args(argv, __doc__, "dawn", "--small", "small shapes: checks the script on a software adapter",
                      "upload,minilm,smollm2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    env = gpudelegate.Environment()
    tch = bw.Torch()
    rep = Report(COLUMNS)
    infos = {}
    for device in DEVICES:
        why = _available(env, device)
        infos[device] = env.context(device).info() if why is None else {"device": f"unavailable: {why}"}
    d = infos["dawn"]
    rep.data["device"] = {k: {kk: str(vv) for kk, vv in v.items()} for k, v in infos.items()}
    print(f"dawn: {d.get('device')}; features {d.get('features')}; subgroup-matrix configs "
          f"{d.get('subgroup_matrix_configs')}; toggles {d.get('toggles')}")
    print(f"wgpu: {infos['wgpu'].get('device')}; {tch.label}", flush=True)
    name = d.get("device") if "features" in d else infos["wgpu"].get("device", "unknown")
    write = result_writer(rep, args.out, "dawn", name, "--small" if args.small else "",
                          "Dawn against wgpu-native and torch", tch.label)
    steps = {"upload": lambda: bench_upload(rep, env, tch, args.small),
             "minilm": lambda: bench_minilm(rep, env, tch, args.small),
             "smollm2": lambda: bench_smollm2(rep, env, tch, args.small)}
    for sec in args.sections.split(","):
        if sec not in steps:
            print(f"unknown section {sec!r} (known: {', '.join(steps)})")
            return 2
        section(rep, sec, steps[sec])
        write()
    env.close()
    return finish(rep, write)


if __name__ == "__main__":
    sys.exit(main())
