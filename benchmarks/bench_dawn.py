"""Dawn (wgpudawn) against wgpu-native and PyTorch on the same GPU: one run, one table, recorded
under benchmarks/results/.

    python benchmarks/bench_dawn.py [--out DIR] [--small] [--sections upload,minilm,smollm2] [--ort-path DIR]

Dawn runs with the toggles of its fast paths (``allow_unsafe_apis``, ``vulkan_enable_f16_on_nvidia``:
host-memory uploads, subgroup matrices, f16 on NVIDIA) unless GPUDELEGATE_DAWN_TOGGLES says
otherwise. Seeded random weights everywhere.

1. **upload**: prepack bandwidth of the same float32 weights (1 GiB in 64 MiB constants) on Dawn
   (its host-memory ring, ``native/dawn_staging.py``) and on wgpu-native (its mapped ring), against
   a pinned CUDA copy of the same bytes (torch) in the same run; a fresh context each (cold) and a
   second build (warm); where each prepack's time went (the ring's ``UploadStats``: host fill,
   waits for a buffer's turn, making buffers, submits, the rest); the same weights saved to a file
   and loaded into Dawn host memory (``load(path, data_memory=ctx.gpu_readable_memory)``): prepack
   is then the GPU's copies alone (cold / warm, beside the ring from the mapped file), and the
   loads timed apart, since the host's copy moved there; the host-memory ring's two halves each
   alone.
2. **minilm**: MiniLM-L6 shape (seeded, as ``bench_wgpu.py``) at 1x128 and 32x128 on dawn
   (precision exact, and ``precision="fast"`` where the session accepts that option) and wgpu,
   against PyTorch eager fp32 and fp16 and ONNX Runtime's native WebGPU EP (``ort-webgpu``, Dawn
   inside); every pair of our runs alternated; dispatches and the host time of encoding one run.
   ORT runs the same random-weight module, exported to ONNX as ``minilm_onnx.py`` does, in a child
   process before ours (its median ``session.run``: inputs up, embeddings down, like ours), and its
   embeddings must have a cosine >= 0.9999 to ours. It needs the ``onnxruntime-webgpu`` wheel in a
   folder of its own (the CPU ``onnxruntime`` has the same module name): ``--ort-path DIR`` or
   GPUDELEGATE_ORT_WEBGPU=DIR, after ``pip install --no-deps --target DIR onnxruntime_webgpu-*.whl``
   (it needs numpy, flatbuffers, packaging and protobuf beside it). On the GPU machine: ``pip
   download --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64
   onnxruntime-webgpu -d .ortwhl``, carry ``.ortwhl`` and ``benchmarks/gpu_machine.sh`` installs it
   into /tmp/ort and sets GPUDELEGATE_ORT_WEBGPU. Without it the ort-webgpu cells stay empty and
   the note says why.
3. **smollm2**: SmolLM2-135M architecture (seeded, float32 weights, as ``bench_decode.py``):
   prefill of one 128-token chunk and greedy decode tok/s on dawn and wgpu against PyTorch eager
   fp32 (static KV cache); dispatches per step and host ms per step in ``run()``.

``--small`` (32 MiB, 2-layer models, short sequences) checks the script on a software adapter
(Dawn on Mesa 25's lavapipe: VK_DRIVER_FILES=.cache/mesa25/lvp25.json); its numbers say nothing
about speed.
"""

from __future__ import annotations

import os
import re
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

ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # ORT colours its log lines
ORT_ENV = "GPUDELEGATE_ORT_WEBGPU"  # a folder that onnxruntime-webgpu was pip-installed into (--target)

COLUMNS = [("section", "section"), ("metric", "metric"), ("dawn", "dawn"), ("wgpu", "wgpu-native"),
           ("torch", "torch"), ("ort", "ort-webgpu"), ("note", "note")]
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
    cells, parts = {}, {}
    for device in DEVICES:
        fresh = gpudelegate.Environment()  # a context of its own: "cold" makes its staging ring
        try:
            why = _available(fresh, device)
            if why:
                cells[device] = ("skipped", why)
                parts[device] = {"cold": "skipped", "warm": "skipped"}
                continue
            got, parts[device] = [], {}
            up = fresh.context(device).uploader
            for run in ("cold", "warm"):
                before = up.stats.copy()
                with fresh.session(prog, device=device) as s:
                    ex = s.executor
                    got.append(ex.upload_bytes / ex.upload_seconds / 1e9)
                    parts[device][run] = _breakdown(up.stats.since(before), ex.upload_seconds)
            cells[device] = (f"{got[0]:.1f} / {got[1]:.1f} GB/s", up.staging)
        finally:
            fresh.close()
    base, pinned = "n/a (no CUDA here)", None
    if tch is not None and tch.cuda:
        t = tch.torch
        host = t.empty(total, dtype=t.uint8, pin_memory=True)
        host.fill_(7)
        dev = t.empty(total, dtype=t.uint8, device="cuda")
        sec = tch.timed(lambda: dev.copy_(host, non_blocking=True), 5)
        pinned = total / sec / 1e9
        base = f"{pinned:.1f} GB/s pinned H2D"
        del host, dev
    rep.row("upload", f"prepack of {total >> 20} MiB float32 weights (cold / warm)", cells["dawn"][0],
            cells["wgpu"][0], base, note=f"dawn staging: {cells['dawn'][1]}; wgpu staging: {cells['wgpu'][1]}")
    for run in ("cold", "warm"):
        rep.row("upload", f"prepack time, {run}: fill / wait / make / submit / rest", parts["dawn"][run],
                parts["wgpu"][run], "", note=BREAKDOWN_NOTE)
    rep.data["upload"] = {"bytes": total, "dawn": cells["dawn"], "wgpu": cells["wgpu"], "torch": base,
                          "breakdown": parts}
    if _available(env, "dawn") is None and "host-mapped-pointer" in env.context("dawn").features:
        _loaded_into_host_memory(rep, prog, total, base, pinned)
        _host_ring_parts(rep, env.context("dawn"), (8 << 20) if small else None, 4 if small else 16,
                         [prog.constant_bytes(i) for i in range(len(prog.constants))])


def _loaded_into_host_memory(rep: Report, prog, total: int, base: str, pinned) -> None:
    """Prepack of the same weights saved to a file and loaded into Dawn host memory
    (``load(path, data_memory=ctx.gpu_readable_memory)``): the GPU's copies alone, cold (a fresh
    context) and warm, beside the ring from the mapped file; and the loads themselves, timed apart,
    since the host's copy of the weights moved there. The file was just written: it is read from
    the page cache, not the disk."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.gdp"
        prog.save(path)
        runs, loads, notes = {}, {}, []
        for how in ("mmap", "host-memory"):
            fresh = gpudelegate.Environment()
            try:
                ctx = fresh.context("dawn")
                up = ctx.uploader
                if how == "mmap":
                    t0 = time.perf_counter()
                    p = gpudelegate.load(path)
                else:
                    t0 = time.perf_counter()
                    p = gpudelegate.load(path, data_memory=ctx.gpu_readable_memory)
                loads[how] = time.perf_counter() - t0
                got = []
                for run in ("cold", "warm"):
                    before = up.stats.copy()
                    with fresh.session(p, device="dawn") as s:
                        ex = s.executor
                        got.append(ex.upload_bytes / ex.upload_seconds / 1e9)
                        st = up.stats.since(before)
                    notes.append(f"{how} {run}: {st.direct >> 20} MiB copied from host memory, "
                                 f"{st.bytes >> 20} MiB through the ring")
                runs[how] = got
                del p
            finally:
                fresh.close()
        # the load's parts, in one more context: the read alone (no hash check) by 1, the default
        # and 16 threads, and the memory (allocate + import into Dawn) alone
        from gpudelegate import program as program_mod

        fresh = gpudelegate.Environment()
        default_threads = program_mod.READ_THREADS
        reads = {}
        try:
            ctx = fresh.context("dawn")
            for threads in (1, default_threads, 16):
                program_mod.READ_THREADS = threads
                t0 = time.perf_counter()
                p = gpudelegate.load(path, data_memory=ctx.gpu_readable_memory, verify_hashes=False)
                reads[threads] = time.perf_counter() - t0
                del p
            t0 = time.perf_counter()
            mem = ctx.gpu_readable_memory(total)
            alloc = time.perf_counter() - t0
            del mem
        finally:
            program_mod.READ_THREADS = default_threads
            fresh.close()
        read_only = reads[default_threads]
    ring, host = runs["mmap"], runs["host-memory"]
    share = f"; warm {host[1] / pinned:.0%} of pinned" if pinned else ""
    rep.row("upload", f"prepack of the {total >> 20} MiB file loaded into Dawn host memory (cold / warm): "
                      f"GPU copies only, the host's copy moved to load",
            f"{host[0]:.1f} / {host[1]:.1f} GB/s", "", base,
            note=f"load(path, data_memory=ctx.gpu_readable_memory){share}; the same file mapped, through the ring: "
                 f"{ring[0]:.1f} / {ring[1]:.1f} GB/s; " + "; ".join(notes))
    rep.row("upload", f"load of the {total >> 20} MiB file (page cache): mapped / into host memory "
                      f"(read without hash check; memory alone)",
            f"{loads['mmap'] * 1e3:.0f} / {loads['host-memory'] * 1e3:.0f} ms "
            f"({read_only * 1e3:.0f}; {alloc * 1e3:.0f} ms)", "", "",
            note=f"both check every constant's SHA-256 (the mapped load reads the file there too); "
                 f"read without it (memory included) by " + ", ".join(f"{k} threads {total / v / 1e9:.1f}"
                                                                       for k, v in reads.items())
                 + f" GB/s; memory = allocate_host_memory + its COPY_SRC buffers")
    rep.data["loaded_into_host_memory"] = {"prepack_gbps": host, "ring_mmap_gbps": ring, "load_s": loads,
                                           "read_only_s": reads, "alloc_s": alloc, "pinned_gbps": pinned}


BREAKDOWN_NOTE = ("ms in the staging ring (UploadStats): fill = host copy into staging (its GB/s), wait = for a "
                  "buffer's previous copies, make = new staging buffers, submit = encode + queue.submit + the "
                  "ring's marker or work-done future; "
                  "rest = the executor's own time and the final wait for the GPU")


def _breakdown(st, seconds: float) -> str:
    """A prepack's ``UploadStats`` as the cell of the breakdown rows."""
    fill = f"{st.fill_s * 1e3:.1f}" + (f" ({st.bytes / st.fill_s / 1e9:.1f} GB/s)" if st.fill_s else "")
    rest = seconds - st.fill_s - st.wait_s - st.make_s - st.submit_s
    return " / ".join([fill] + [f"{x * 1e3:.1f}" for x in (st.wait_s, st.make_s, st.submit_s, rest)]) + " ms"


def _host_ring_parts(rep: Report, ctx, piece, reps: int, sources) -> None:
    """The two halves of the host-memory ring, each alone: the ring's own fill (``_fill``: its
    threads, its parts) of one buffer from ``sources`` (the program's constants, as prepack reads
    them) and from one cache-warm source, and the GPU's copy_buffer_to_buffer out of a host-memory
    buffer (``reps`` pieces in one submit). ``piece`` None: the ring's default."""
    from gpudelegate.native.dawn_staging import HostMemoryUploader

    up = HostMemoryUploader(ctx, count=1) if piece is None else HostMemoryUploader(ctx, piece=piece, count=1)
    buf = up._new()
    up.view = np.frombuffer(up.memory[id(buf)], np.uint8)
    srcs = [mv[:up.piece] for mv in sources]

    def fill(batch) -> float:
        t0 = time.perf_counter()
        for mv in batch:
            up._fill(0, mv)
        return (time.perf_counter() - t0) / sum(mv.nbytes for mv in batch)

    fill(srcs[:1])
    cold_gbps = 1 / bw._median(lambda: fill(srcs), 3) / 1e9
    warm_gbps = 1 / bw._median(lambda: fill(srcs[:1] * reps), 3) / 1e9
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
    up.view = None
    dst.destroy()
    buf.destroy()
    up.close()
    rep.row("upload", f"host-memory ring halves, {up.piece >> 20} MiB pieces: fill (program's bytes / cache-warm) / GPU copy",
            f"{cold_gbps:.1f} / {warm_gbps:.1f} / {copy_gbps:.1f} GB/s", "", "",
            note=f"fill: the ring's copy by {up.fill_threads} threads into host memory, from the {len(srcs)} constants "
                 f"prepack reads or {reps} times from the first; copy: {reps} copy_buffer_to_buffer in one submit")
    rep.data["host_ring_parts"] = {"fill_gbps": cold_gbps, "fill_warm_gbps": warm_gbps, "copy_gbps": copy_gbps,
                                   "piece": up.piece, "threads": up.fill_threads}


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


# onnxruntime-webgpu runs in a child process whose sys.path starts with its own folder: the GPU
# machine's image has the CPU onnxruntime under the same module name, and a second Dawn in the
# process that holds ours is asking for trouble. argv: model, inputs (.npz of ids<i>, mask<i>),
# outputs (.npz of emb<i>), timed repeats. Prints one JSON line last.
ORT_WORKER = r"""
import json, statistics, sys, time
import numpy as np
import onnxruntime as ort

model, inputs, outputs, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if "WebGpuExecutionProvider" not in ort.get_available_providers():
    sys.exit(f"onnxruntime {ort.__version__} at {ort.__file__} has no WebGpuExecutionProvider")
t0 = time.perf_counter()
sess = ort.InferenceSession(model, providers=["WebGpuExecutionProvider"])
res = {"version": ort.__version__, "providers": sess.get_providers(), "load_s": time.perf_counter() - t0,
       "first_s": [], "median_s": []}
data, embs = np.load(inputs), {}
for i in range(len(data.files) // 2):
    feed = {"ids": data[f"ids{i}"], "mask": data[f"mask{i}"]}
    t0 = time.perf_counter()
    embs[f"emb{i}"] = sess.run(None, feed)[0]
    res["first_s"].append(time.perf_counter() - t0)
    sess.run(None, feed)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t0)
    res["median_s"].append(statistics.median(times))
np.savez(outputs, **embs)
print(json.dumps(res))
"""


def _ort_webgpu(rep: Report, model, feeds, reps: int, ort_path: str) -> dict:
    """ONNX Runtime's WebGPU EP on ``model`` (our random-weight MiniLM module, exported to ONNX as
    minilm_onnx.py does) for each ``(ids, mask)`` of ``feeds``: median seconds of ``session.run``
    (inputs up, embeddings down, as ours are timed) and the embeddings. Without ``--ort-path`` the
    cells say so; a failure with one is an error of the run."""
    import json
    import subprocess
    import tempfile

    out = {"cells": [""] * len(feeds), "embeddings": None, "note": ""}
    if not ort_path:
        out["note"] = f"ort-webgpu: not run (no --ort-path or {ORT_ENV})"
        return out
    from gpu_browser.bench import minilm_onnx_file  # minilm_onnx.py's recipe for a module of our own

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        onnx = minilm_onnx_file(model, folder)
        np.savez(folder / "in.npz", **{f"{n}{i}": a for i, f in enumerate(feeds) for n, a in zip(("ids", "mask"), f)})
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ort_path, os.environ.get("PYTHONPATH")) if p))
        proc = subprocess.run([sys.executable, "-c", ORT_WORKER, str(onnx), str(folder / "in.npz"),
                               str(folder / "out.npz"), str(reps)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            why = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
            rep.errors.append(f"minilm ort-webgpu: exit {proc.returncode}: {why[0][:300]}")
            out["note"] = "ort-webgpu: failed (see errors)"
            return out
        for line in proc.stderr.strip().splitlines()[-10:]:  # ORT's warnings (nodes it left on the CPU, say)
            print("    ort-webgpu: " + ANSI_COLOUR.sub("", line)[:240])
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        embs = np.load(folder / "out.npz")
        out["embeddings"] = [embs[f"emb{i}"] for i in range(len(feeds))]
    out["cells"] = [bw._fmt_ms(sec) for sec in res["median_s"]]
    out["note"] = (f"ort-webgpu: onnxruntime {res['version']} {res['providers'][0]}, session "
                   f"{res['load_s']:.1f} s")
    rep.data["ort_webgpu"] = res
    return out


def _check_ort(rep: Report, shape: str, theirs, ours, device: str, note: str) -> str:
    """The note with ORT's embeddings' cosine to ours (row by row, the smallest); below 0.9999
    (both float32) the comparison is of different models: an error of the run."""
    a, b = np.asarray(theirs, np.float64), np.asarray(ours, np.float64)
    cos = float(((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))).min())
    if not cos >= 0.9999:
        rep.errors.append(f"minilm {shape} ort-webgpu: cosine to ours {cos:.6f}")
    return f"{note}, cosine to {device}'s {cos:.6f}"


def bench_minilm(rep: Report, env, tch, small: bool, ort_path: str = "") -> None:
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
    feeds = []
    for b, t in shapes:
        rng = np.random.default_rng(b * 1000 + t)
        ids = rng.integers(1000, cfg.vocab_size, (b, t)).astype(np.int32)
        mask = np.ones((b, t), np.int32)
        mask[b // 2:, t - t // 4:] = 0
        feeds.append((ids, mask))
    ort = _ort_webgpu(rep, ours, feeds, reps, ort_path)  # a process of its own, before ours hold the GPU
    hf32 = hf.to(tch.dev)
    hf16 = bw._hf_bert(cfg, seed=0).to(tch.dev).half() if tch.cuda else None
    for k, ((b, t), (ids, mask)) in enumerate(zip(shapes, feeds)):
        with torch.no_grad():
            prog = export_program(ours, minilm.example_inputs(b, t), progress=False)
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
        ort_cell, ort_note = ort["cells"][k], ort["note"]
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
                    if precision is None and ort["embeddings"] is not None and "cosine" not in ort_note:
                        ort_note = _check_ort(rep, f"{b}x{t}", ort["embeddings"][k], got, device, ort_note)
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
            rep.row("minilm", label, cells.get("dawn", ""), cells.get("wgpu", ""), torch_cell, ort_cell,
                    note="; ".join(notes + [ort_note]))
            rep.data.setdefault("minilm", {})[label] = {"cells": cells, "torch": torch_cell, "ort": ort_cell,
                                                        "notes": notes + [ort_note]}


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
            f"{bw._fmt_ms(a['prefill_s'])} {where}", note="; ".join(notes))
    rep.row("smollm2", f"greedy decode ({wl.n_dec} steps)", decode["dawn"], decode["wgpu"],
            f"{a['decode_tok_s']:.0f} tok/s {where}", note="KV cache on the device, argmax read back each step")
    rep.data["smollm2"] = {d: {k: v for k, v in r.items() if k != "logits0"} for d, r in res.items()}
    rep.data["smollm2"]["torch"] = {k: v for k, v in a.items() if k != "logits0"}


# ============================================================================ main

def _ort_path_arg(argv):
    """``--ort-path DIR`` taken out of ``argv`` (the other options are bench_report's)."""
    import argparse

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--ort-path", default=None)
    known, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    return known.ort_path, rest


def main(argv=None) -> int:
    ort_path, argv = _ort_path_arg(argv)
    if ort_path is None:
        ort_path = os.environ.get(ORT_ENV, "")
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
             "minilm": lambda: bench_minilm(rep, env, tch, args.small, ort_path),
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
