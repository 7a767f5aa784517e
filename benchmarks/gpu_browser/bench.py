"""The browser executor on a real GPU, without a browser: Pyodide in Node with Dawn for Node (npm
``webgpu``) as ``navigator.gpu`` (runner.mjs), driving gpudelegate's own browser adapter
(web/webgpu.py) and the page's Python code, against desktop wgpu (``device="wgpu"``, CPython) on the
same GPU in the same call, and onnxruntime-web's WebGPU EP in the same Node process.

    python3 benchmarks/gpu_browser/bench.py [--carry .nodecarry] [--out benchmarks/results] [--small]

What runs, in one Node process (one Pyodide, one Dawn device):
  1. the conformance suite as tests/browser/test_conformance_browser.py runs it in the page (its
     own job builder, page code and tolerances), checked here against the float64 reference;
  2. MiniLM-L6 (seeded random weights) at 1x128, 8x128, 32x128: bench_browser.py's page code
     (load, first run, timed runs) and its host-side comparison (ours vs a plain-JS loop
     encoding the same recorded plan);
  3. a SmolLM2-135M-architecture model (seeded random weights, bench_decode.py's recipe) with
     4-bit (Q4_1 linears, Q8_0 embedding) and float16 weights: load, time to first token (the
     first prefill, pipelines compiled then), steady prefill, greedy decode tok/s;
  4. onnxruntime-web (WebGPU EP) on the ONNX of the same MiniLM module (minilm_onnx.py's recipe).
Then desktop wgpu runs 2 and 3 on the same programs. Real weights cannot travel to the GPU
machine (no network, 64 MiB per call): programs are built there with torch. ``--small`` shrinks
the models for a run on software Vulkan. The table goes to OUT/browser_<adapter>.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (ROOT / "benchmarks", ROOT / "tests", ROOT / "tests" / "browser", ROOT / "web", HERE):
    sys.path.insert(0, str(p))

import carry  # noqa: E402  benchmarks/gpu_browser/carry.py
import pages_probes  # noqa: E402  benchmarks/gpu_browser/pages_probes.py: the host-slope page

# Dawn toggles for Node: allow_unsafe_apis exposes what Chromium's --enable-unsafe-webgpu does
# (subgroups, timestamps without quantization); NVIDIA's f16 is behind a Dawn toggle too.
CONFORMANCE_PIECE = 150  # sessions per Node step

DAWN_TOGGLES = ["enable-dawn-features=allow_unsafe_apis,vulkan_enable_f16_on_nvidia"]

# The SmolLM2 loop in the page: the demo's greedy pick (llm.greedy_token on the read-back), caches fed
# back as DeviceTensors, the same prompt and step count as the desktop loop below.
SMOL_PAGE = r"""
import js, statistics, time
from gpudelegate import llm
from gpudelegate.web import demo
resp = await js.fetch("programs/" + ARGS["file"])
buf = js.Uint8Array.new(await resp.arrayBuffer())
t = time.perf_counter()
info = await demo.load(ARGS["file"], buf)
load = time.perf_counter() - t
s = demo._loaded["session"]
cache = [llm.zeros("float32", tuple(ARGS["cache_shape"])) for _ in range(ARGS["n_cache"])]
prompt = llm.int32_tensor(ARGS["prompt"], (1, len(ARGS["prompt"])))
pos0, last = llm.int32_tensor([0], (1,)), llm.int32_tensor([len(ARGS["prompt"]) - 1], (1,))

split = {"wait": 0.0, "pick": 0.0}

async def top(t):
    t0 = time.perf_counter()
    h = await t.owner.to_host_async(t)  # the GPU's work and the read-back's mapAsync
    t1 = time.perf_counter()
    k = llm.greedy_token(h)  # the demo's pick: a JavaScript argmax over the read-back (web/webgpu.py PageTensor)
    split["wait"] += t1 - t0
    split["pick"] += time.perf_counter() - t1
    return k

t = time.perf_counter()
out = await s.run_async("prefill", [prompt, pos0, last, *cache], keep_on_device=True)
tok = await top(out[0])
ttft = time.perf_counter() - t
prefill = []
for _ in range(ARGS["reps"]):
    t = time.perf_counter()
    out = await s.run_async("prefill", [prompt, pos0, last, *out[1:]], keep_on_device=True)
    tok = await top(out[0])
    prefill.append(time.perf_counter() - t)
toks, host = [tok], 0.0
for i in range(ARGS["n_dec"] + 2):  # 2 warm-up steps
    if i == 2:
        t_start, host = time.perf_counter(), 0.0
        split.update(wait=0.0, pick=0.0)
    t = time.perf_counter()
    out = await s.run_async("decode", [llm.int32_tensor([tok], (1, 1)), llm.int32_tensor([len(ARGS["prompt"]) + i], (1,)),
                                       *out[1:]], keep_on_device=True)
    host += time.perf_counter() - t
    tok = await top(out[0])
    toks.append(tok)
dec = ARGS["n_dec"] / (time.perf_counter() - t_start)
pid = s.program.methods["decode"].nodes[0].attrs["payload"]
disp = s.executor.recorded[pid].dispatch_count
demo.close()
{"load": load, "timings": info.to_py()["timings"] if hasattr(info, "to_py") else None, "ttft": ttft,
 "prefill": statistics.median(prefill) if prefill else None, "decode_tok_s": dec, "host_ms_per_step": host / ARGS["n_dec"] * 1e3,
 "tokens": toks, "dispatches": disp, "wait_ms_per_step": split["wait"] / ARGS["n_dec"] * 1e3,
 "argmax_ms_per_step": split["pick"] / ARGS["n_dec"] * 1e3}
"""

# GPU time of one MiniLM run in the page: the executor's profiled path (each step between two
# timestamp queries), summed; best of 4. Desktop wgpu sums the same profile.
GPU_PAGE = r"""
import js
from gpudelegate.web import demo
resp = await js.fetch("programs/" + ARGS["file"])
await demo.load(ARGS["file"], js.Uint8Array.new(await resp.arrayBuffer()), profile=True)
s = demo._loaded["session"]
feeds = {"ids": demo.int_tensor(ARGS["ids"]), "mask": demo.int_tensor(ARGS["mask"])}
import time
t = time.perf_counter()
while time.perf_counter() - t < float(ARGS.get("warm_s", 0)):  # clocks up first (bench_browser.RUN_PAGE)
    await s.run_async("forward", feeds)
best, ops = None, {}
for _ in range(4):
    await s.run_async("forward", feeds)
    t = sum(p[2] for p in s.executor.last_profile)
    if best is None or t < best:
        best, ops = t, {}
        for op, _, sec in s.executor.last_profile:
            ops[op] = ops.get(op, 0.0) + sec
n = len(s.executor.last_profile)
demo.close()
{"gpu": best, "steps": n, "ops": ops}
"""

# The wait for GPU results as dawn.node delivers it: a submit of one 4-byte copy and a mapAsync
# of those 4 bytes, and queue.onSubmittedWorkDone() after an empty submit, timed in JS.
LATENCY_JS = """return (async () => {
  const U = GPUBufferUsage;
  const src = device.createBuffer({size: 4, usage: U.COPY_SRC | U.STORAGE});
  const dst = device.createBuffer({size: 4, usage: U.COPY_DST | U.MAP_READ});
  const map = [], done = [];
  for (let i = 0; i < N; i++) {
    const t0 = performance.now();
    const enc = device.createCommandEncoder();
    enc.copyBufferToBuffer(src, 0, dst, 0, 4);
    device.queue.submit([enc.finish()]);
    await dst.mapAsync(GPUMapMode.READ, 0, 4);
    dst.unmap();
    map.push(performance.now() - t0);
    const t1 = performance.now();
    device.queue.submit([]);
    await device.queue.onSubmittedWorkDone();
    done.push(performance.now() - t1);
  }
  src.destroy(); dst.destroy();
  map.sort((a, b) => a - b); done.sort((a, b) => a - b);
  return [map[0] / 1e3, map[N >> 1] / 1e3, done[0] / 1e3, done[N >> 1] / 1e3];
})();"""
LATENCY_PAGE = r"""
import js
from gpudelegate.web import webgpu
st = await webgpu.init()
r = (await js.Function.new("device", "N", ARGS["js"])(st.device, 200)).to_py()
{"map_min": r[0], "map_median": r[1], "done_min": r[2], "done_median": r[3]}
"""


def log(*a) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


# ============================================================================ programs (torch)

def minilm_programs(small: bool, shapes, folder: Path):
    """MiniLM with seeded random weights (the module's own init after torch.manual_seed(0)), one
    program per shape, and the torch module (for the ONNX export)."""
    import torch

    from gpudelegate.export.models import minilm
    from gpudelegate.export.writer import export_program

    cfg = minilm.MiniLMConfig(layers=2) if small else minilm.MiniLMConfig()
    torch.manual_seed(0)
    model = minilm.MiniLM(cfg).eval()
    files = {}
    for b, t in shapes:
        path = folder / f"minilm-{b}x{t}.gdp"
        with torch.no_grad():
            export_program(model, minilm.example_inputs(b, t), path=path, progress=False,
                           metadata={"model": "MiniLM-L6 (random weights)", "task": "sentence-embedding"},
                           input_names=["ids", "mask"], output_names=["embedding"])
        files[(b, t)] = path
    return model, cfg, files


def minilm_feeds(cfg, b: int, t: int):
    rng = np.random.default_rng(b * 1000 + t)
    ids = rng.integers(1000, cfg.vocab_size, (b, t)).astype(np.int32)
    ids[:, 0], ids[:, -1] = 101, 102
    mask = np.ones((b, t), np.int32)
    mask[b // 2:, t - t // 4:] = 0  # padded tails in the second half of a batch (bench_wgpu.py's)
    return ids, mask


def minilm_onnx_file(model, folder: Path) -> Path:
    """minilm_onnx.py's export (dynamo, the written-out attention) of our random-weight module."""
    from unittest import mock

    import torch

    import minilm_onnx
    from gpudelegate.export.models import minilm

    out = folder / "minilm.onnx"
    ids, mask = minilm.example_inputs(2, 16)
    b, t = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=512)
    with torch.no_grad(), mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", minilm_onnx._attention):
        torch.onnx.export(model, (ids, mask), str(out), dynamo=True, input_names=["ids", "mask"],
                          output_names=["sentence_embedding"], dynamic_shapes=({0: b, 1: t}, {0: b, 1: t}),
                          external_data=False, optimize=True, verify=False)
    return out


def smollm_programs(small: bool, folder: Path):
    """bench_decode.py's SmolLM2-architecture model (seeded N(0, 0.02) weights), exported with the
    GGUF mix (Q4_1 linears, Q8_0 embedding) and with float16 weights."""
    import torch

    import bench_decode
    from gpudelegate.export.frontend import export_method
    from gpudelegate.export.models import smollm2
    from gpudelegate.export.writer import export_program

    cfg = bench_decode.model_config(small)
    model, packed = bench_decode.random_model(cfg)
    names = smollm2.cache_names(cfg)
    with torch.no_grad():
        methods = {"prefill": export_method(smollm2.Prefill(model), smollm2.example_inputs(cfg, "prefill")),
                   "decode": export_method(smollm2.Decode(model), smollm2.example_inputs(cfg, "decode"))}
    kw = dict(progress=False, input_names={"prefill": ["ids", "pos", "last", *names], "decode": ["ids", "pos", *names]},
              output_names={m: ["logits", *names] for m in methods},
              metadata={"model": "SmolLM2-135M architecture (random weights)", "task": "causal-lm"})
    files = {}
    with torch.no_grad():
        p = export_program(methods, weights_dtype="float32", packed_weights=packed, **kw)
        files["q4_1"] = folder / "smollm2-q4.gdp"
        p.save(files["q4_1"])
        p = export_program(methods, weights_dtype="float16", fp16_at="export", **kw)
        files["float16"] = folder / "smollm2-f16.gdp"
        p.save(files["float16"])
    return cfg, files, bench_decode.Workload(cfg, small)


# ============================================================================ conformance jobs

def conformance_jobs(limit: int = 0):
    """tests/browser/test_conformance_browser.py's jobs and page code (the sync/JSPI run and the
    KV chains' synchronous read-back become async ones where Pyodide has no JSPI: Node 20's V8
    lacks it)."""
    import test_conformance_browser as tcb

    spec = tcb.SPECS[0]
    jobs, meta = [], {}
    cases = tcb.CASES[:limit] if limit else tcb.CASES
    for case in cases:
        job, prog, runs = tcb._job(spec, case, case.id)
        jobs.append(job)
        meta[case.id] = (case, prog, runs)
    for case, depth in tcb.OFFLOAD[:limit] if limit else tcb.OFFLOAD:
        data = tcb.make_data(case, 0)
        prog, _ = tcb.build_program(case, data)
        floor = tcb.plan_session(prog, tcb.DeviceLimits(), weight_budget=1 << 40, prefetch_depth=depth).offload.floor
        key = f"{case.id}:offload-depth{depth}"
        job, prog, runs = tcb._job(spec, case, key, budget=floor, depth=depth)
        jobs.append(job)
        meta[key] = (case, prog, runs)
    kv_jobs = []
    for case in tcb.DECODE[:limit] if limit else tcb.DECODE:
        data = tcb.make_data(case, 0)
        prog, names = tcb.build_program(case, data)
        host = dict(data)
        steps, wants = [], []
        for step in range(3):
            d = tcb._fresh_inputs(case, step + 1, data)
            d["pos"] = np.array([4 + step], np.int32)
            d["kc"], d["vc"] = host["kc"], host["vc"]
            want = tcb.golden(case, d)
            steps.append(tcb._feed(case, d, names))
            wants.append(want)
            host["kc"], host["vc"] = want[1].astype(d["kc"].dtype), want[2].astype(d["vc"].dtype)
        key = f"{case.id}:kv"
        kv_jobs.append({"key": key, "program": tcb._b64(prog.to_bytes()), "steps": steps, "device": spec.device_kind,
                        "options": dict(spec.session_options), "kc": names.index("kc"), "vc": names.index("vc")})
        meta[key] = (case, prog, wants)
    sync_run = 'if r == 0 else sess.run("forward", xs)'
    kv_read = "[o.numpy() for o in outs[1:]]"  # a synchronous read-back: JSPI too
    assert sync_run in tcb.PAGE_CODE and kv_read in tcb.PAGE_CODE, "test_conformance_browser.PAGE_CODE changed: update bench.py"
    code = ("from gpudelegate.web.webgpu import can_run_sync\nJSPI = can_run_sync()\n" + tcb.PAGE_CODE.replace(
        sync_run, 'if r == 0 or not JSPI else sess.run("forward", xs)').replace(
        '"executors": sorted(executors)}', '"executors": sorted(executors), "jspi": JSPI}').replace(
        kv_read, '[(o.numpy() if JSPI else await o.owner.to_host_async(o)) for o in outs[1:]]'))
    return code, {"jobs": jobs, "kv_jobs": kv_jobs}, meta


def check_conformance(res: dict, meta: dict):
    """(passed, failed: [(key, why)]) with the page test's comparisons and tolerances."""
    import test_conformance_browser as tcb

    passed, failed = 0, []
    for key, (case, prog, runs) in meta.items():
        r = res["results"].get(key)
        try:
            assert r is not None, "no result"
            assert "error" not in r, r.get("error")
            if key.endswith(":kv"):
                assert len(r["steps"]) == 3
                for step, (got, want) in enumerate(zip(r["steps"], runs)):
                    assert got["kinds"] == ["DeviceTensor"] * 3, got["kinds"]
                    tcb._compare(case, prog, got["outs"], want, f"{key} step {step}")
            else:
                for i, (outs, d) in enumerate(zip(r["runs"], runs)):
                    tcb._compare(case, prog, outs, tcb.golden(case, d), f"{key} run {i}")
                if ":offload" in key:
                    assert r["streamed"] > 0, "nothing streamed at the floor"
            passed += 1
        except AssertionError as e:
            failed.append((key, str(e).strip().splitlines()[0][:200] if str(e).strip() else "assertion"))
    return passed, failed


# ============================================================================ desktop wgpu

def desktop_minilm(env, path: Path, ids, mask, runs: int, device: str = "wgpu", inspect=None,
                   warm_s: float = 0.0) -> dict:
    """MiniLM on a desktop device (``wgpu`` or ``dawn``): load, first and timed runs, then the best of
    4 profiled runs by op; ``inspect(executor)`` adds its result as ``"kernels"`` (pages_probes);
    ``warm_s`` seconds of back-to-back runs before each timed part (the page's warm-up: GPU clocks)."""
    from gpudelegate import load

    t = time.perf_counter()
    s = env.session(load(path), device=device)
    build = time.perf_counter() - t
    try:
        t = time.perf_counter()
        s.run("forward", [ids, mask])
        first = time.perf_counter() - t
        _warm(lambda: s.run("forward", [ids, mask]), warm_s)
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            out = s.run("forward", [ids, mask])
            times.append(time.perf_counter() - t)
    finally:
        s.close()
    s = env.session(load(path), device=device, profile=True)
    kernels = inspect(s.executor) if inspect is not None else None
    try:
        _warm(lambda: s.run("forward", [ids, mask]), warm_s)
        gpu, ops = None, {}
        for _ in range(4):
            s.run("forward", [ids, mask])
            t = sum(p[2] for p in s.executor.last_profile)
            if gpu is None or t < gpu:
                gpu, ops = t, {}
                for op, _, sec in s.executor.last_profile:
                    ops[op] = ops.get(op, 0.0) + sec
    finally:
        s.close()
    return {"load": build, "first": first, "runs": times, "embedding": np.asarray(out[0]).tolist(), "gpu": gpu,
            "ops": ops, "kernels": kernels}


def _warm(run, seconds: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        run()


def desktop_smollm(env, path: Path, cfg, wl, n_cache: int) -> dict:
    """SMOL_PAGE's loop in CPython on desktop wgpu (numpy argmax of the logits read back)."""
    from gpudelegate import load

    shape = (1, cfg.kv_heads, cfg.max_context, cfg.head_dim)
    cache = [np.zeros(shape, np.float32) for _ in range(n_cache)]
    prompt = wl.prompt
    pos0, last = np.array([0], np.int32), np.array([prompt.shape[1] - 1], np.int32)
    t = time.perf_counter()
    s = env.session(load(path), device="wgpu")
    build = time.perf_counter() - t
    try:
        top = lambda x: int(np.argmax(x.numpy()))  # noqa: E731
        t = time.perf_counter()
        out = s.run("prefill", [prompt, pos0, last, *cache], keep_on_device=True)
        tok = top(out[0])
        ttft = time.perf_counter() - t
        prefill = []
        for _ in range(wl.reps):
            t = time.perf_counter()
            out = s.run("prefill", [prompt, pos0, last, *out[1:]], keep_on_device=True)
            tok = top(out[0])
            prefill.append(time.perf_counter() - t)
        toks, host = [tok], 0.0
        for i in range(wl.n_dec + 2):
            if i == 2:
                t_start, host = time.perf_counter(), 0.0
            t = time.perf_counter()
            out = s.run("decode", [np.array([[tok]], np.int32), np.array([prompt.shape[1] + i], np.int32), *out[1:]],
                        keep_on_device=True)
            host += time.perf_counter() - t
            tok = top(out[0])
            toks.append(tok)
        dec = wl.n_dec / (time.perf_counter() - t_start)
        return {"load": build, "ttft": ttft, "prefill": statistics.median(prefill) if prefill else None,
                "decode_tok_s": dec, "host_ms_per_step": host / wl.n_dec * 1e3, "tokens": toks}
    finally:
        s.close()


# ============================================================================ report

def _ms(s) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.2f} ms" if s < 0.1 else f"{s * 1e3:.0f} ms" if s < 10 else f"{s:.1f} s"


def slug(info: dict) -> str:
    name = info.get("device") or info.get("description") or info.get("vendor") or "unknown"
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")[:48]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--carry", type=Path, default=ROOT / ".nodecarry", help="the folder carry.py pack wrote")
    ap.add_argument("--unpacked", type=Path, default=Path(tempfile.gettempdir()) / "gpu_browser",
                    help="where the carried files are decompressed")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="folder for browser_<gpu>.md")
    ap.add_argument("--logs", type=Path, default=None, help="folder for the raw JSON and Node's log")
    ap.add_argument("--small", action="store_true", help="2-layer models, small shapes (software Vulkan)")
    ap.add_argument("--runs", type=int, default=10, help="timed MiniLM runs after the first")
    ap.add_argument("--skip", default="", help="comma list of parts to leave out: conformance,minilm,smollm,ort,desktop")
    ap.add_argument("--conformance-max", type=int, default=0, help="only the first N cases of each kind (0: all)")
    ap.add_argument("--toggles-pass", default="", metavar="TOGGLES",
                    help="also time MiniLM's GPU work in a second Node process with these extra Dawn toggles "
                         "(comma list, e.g. disable_robustness)")
    ap.add_argument("--node-timeout", type=int, default=420, help="seconds for the Node process")
    ap.add_argument("--warm", type=float, default=3.0, help="seconds of back-to-back MiniLM runs before each timed "
                    "series, browser and desktop alike (an idle H100 took ~1.5-2 s of steady load to go from "
                    "345 to 1980 MHz)")
    a = ap.parse_args(argv)
    skip = {s for s in a.skip.split(",") if s}
    logs = a.logs or Path(tempfile.mkdtemp(prefix="gpu-browser-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()

    unpacked = carry.unpack(a.carry, a.unpacked)
    log(f"carry unpacked to {unpacked}")
    work = Path(tempfile.mkdtemp(prefix="gpu-browser-"))
    shapes = [(1, 16), (2, 16)] if a.small else [(1, 128), (8, 128), (32, 128)]

    import bench_browser  # its page code: RUN_PAGE (load + timed runs), HOST_PAGE (ours vs plain JS)

    steps, meta, notes = [], None, []
    steps.append({"name": "latency", "kind": "python", "code": LATENCY_PAGE, "args": {"js": LATENCY_JS}})
    steps.append({"name": "adapter", "kind": "python", "code": (
        "from gpudelegate.web import demo, webgpu\ninfo = await demo.init_gpu()\n"
        "{'info': info.to_py() if hasattr(info, 'to_py') else info, 'jspi': webgpu.can_run_sync()}")})
    conf_steps = []
    if "conformance" not in skip:
        # In pieces, run after the benchmarks: a Node timeout then loses one piece, not the suite.
        code, args, meta = conformance_jobs(a.conformance_max)
        n = max(1, -(-len(args["jobs"]) // CONFORMANCE_PIECE))
        for i in range(n):
            part = {"jobs": args["jobs"][i * CONFORMANCE_PIECE:(i + 1) * CONFORMANCE_PIECE],
                    "kv_jobs": args["kv_jobs"] if i == n - 1 else []}
            conf_steps.append({"name": f"conformance {i + 1}/{n}", "kind": "python", "code": code, "args": part})
        log(f"conformance: {len(args['jobs'])} sessions + {len(args['kv_jobs'])} KV chains in {n} steps")
    mini = {}
    if "minilm" not in skip:
        t = time.perf_counter()
        model, mcfg, files = minilm_programs(a.small, shapes, work)
        log(f"MiniLM programs in {time.perf_counter() - t:.1f} s")
        for (b, tt), path in files.items():
            ids, mask = minilm_feeds(mcfg, b, tt)
            mini[(b, tt)] = (path, ids, mask)
            feeds = {"ids": ids.tolist(), "mask": mask.tolist()}
            steps.append({"name": f"minilm {b}x{tt}", "kind": "python", "code": bench_browser.RUN_PAGE,
                          "args": {"file": path.name, "runs": a.runs, "warm_s": a.warm, **feeds}})
            steps.append({"name": f"host {b}x{tt}", "kind": "python", "code": bench_browser.HOST_PAGE,
                          "args": {**feeds, "K": 50, "rounds": 9}})
            steps.append({"name": f"slope {b}x{tt}", "kind": "python",
                          "code": pages_probes.slope_page(bench_browser.PLAIN_JS), "args": feeds})
            steps.append({"name": f"close {b}x{tt}", "kind": "python",
                          "code": "from gpudelegate.web import demo\ndemo.close()"})
            steps.append({"name": f"gpu {b}x{tt}", "kind": "python", "code": GPU_PAGE,
                          "args": {"file": path.name, "warm_s": a.warm, **feeds}})
        if "ort" not in skip:
            try:
                t = time.perf_counter()
                onnx = minilm_onnx_file(model, work)
                log(f"ONNX export in {time.perf_counter() - t:.1f} s")
                steps.append({"name": "ort", "kind": "ort", "model": onnx.name, "ep": "webgpu", "runs": a.runs,
                              "shapes": [{"B": b, "T": tt, "ids": mini[(b, tt)][1].tolist(), "mask": mini[(b, tt)][2].tolist()}
                                         for b, tt in shapes]})
            except Exception as e:  # say exactly why, go on with the rest
                notes.append(f"onnxruntime-web not run: the ONNX export failed here ({type(e).__name__}: {str(e)[:200]})")
                log(notes[-1])
    smol = {}
    if "smollm" not in skip:
        t = time.perf_counter()
        scfg, sfiles, wl = smollm_programs(a.small, work)
        log(f"SmolLM2 programs in {time.perf_counter() - t:.1f} s")
        from gpudelegate.export.models import smollm2
        n_cache = len(smollm2.cache_names(scfg))
        for wd, path in sfiles.items():
            smol[wd] = path
            steps.append({"name": f"smollm {wd}", "kind": "python", "code": SMOL_PAGE, "args": {
                "file": path.name, "prompt": wl.prompt[0].tolist(), "reps": wl.reps, "n_dec": wl.n_dec,
                "n_cache": n_cache, "cache_shape": [1, scfg.kv_heads, scfg.max_context, scfg.head_dim]}})

    steps += conf_steps
    jobs_file, res_file = work / "jobs.json", logs / "node_results.json"
    jobs_file.write_text(json.dumps({"dawn_toggles": DAWN_TOGGLES, "steps": steps}))
    log(f"Node: {len(steps)} steps")
    env = dict(os.environ)
    with open(logs / "node.log", "w") as nlog:
        node = subprocess.Popen([str(unpacked / "bin" / "node"), str(HERE / "runner.mjs"), "--carry", str(unpacked),
                                 "--jobs", str(jobs_file), "--out", str(res_file), "--programs", str(work)],
                                stdout=nlog, stderr=subprocess.STDOUT, env=env)
        try:
            rc = node.wait(timeout=a.node_timeout)
        except subprocess.TimeoutExpired:  # keep what finished: the runner saves after every step
            node.kill()
            rc = node.wait()
            notes.append(f"Node stopped after --node-timeout {a.node_timeout} s; later steps are missing")
    log(f"Node exited {rc}")
    res = json.loads(res_file.read_text()) if res_file.exists() else {"steps": {}, "error": "no results file"}
    if a.toggles_pass and mini:
        # The same profiled MiniLM runs in a second Node process whose Dawn device has more toggles
        # (e.g. disable_robustness: Chromium never sets it; this says what robustness costs).
        extra = [{"name": "init +toggles", "kind": "python", "code": "from gpudelegate.web import webgpu\nawait webgpu.init()\nNone"}]
        extra += [dict(st, name=st["name"] + " +toggles") for st in steps if st["name"].startswith("gpu ")]
        jobs2, res2 = work / "jobs_toggles.json", logs / "node_results_toggles.json"
        jobs2.write_text(json.dumps({"dawn_toggles": [DAWN_TOGGLES[0] + "," + a.toggles_pass], "steps": extra}))
        with open(logs / "node_toggles.log", "w") as nlog:
            subprocess.run([str(unpacked / "bin" / "node"), str(HERE / "runner.mjs"), "--carry", str(unpacked),
                            "--jobs", str(jobs2), "--out", str(res2), "--programs", str(work)],
                           stdout=nlog, stderr=subprocess.STDOUT, env=env, timeout=120)
        if res2.exists():
            res["steps"].update(json.loads(res2.read_text())["steps"])
    if res.get("error"):
        log("Node error:", res["error"][:2000])
    S = res["steps"]

    def got(name):
        s = S.get(name) or {}
        if "error" in s:
            notes.append(f"{name}: {s['error'].strip().splitlines()[-1][:300]}")
        return s.get("result")

    adapter = got("adapter") or {"info": {}}
    info = adapter["info"]

    desk = {}
    if "desktop" not in skip:
        from gpudelegate.environment import Environment
        denv = Environment()
        dctx = denv.context("wgpu")
        desk["info"] = dctx.info()
        for key, (path, ids, mask) in mini.items():
            desk[key] = desktop_minilm(denv, path, ids, mask, a.runs, warm_s=a.warm)
            log(f"desktop MiniLM {key}: best {min(desk[key]['runs']) * 1e3:.2f} ms")
        if smol:
            for wd, path in smol.items():
                desk[wd] = desktop_smollm(denv, path, scfg, wl, n_cache)
                log(f"desktop SmolLM2 {wd}: {desk[wd]['decode_tok_s']:.1f} tok/s")
        denv.close()

    # ---------------------------------------------------------------- the table
    rows = []
    conf = None
    for st in conf_steps:
        c = got(st["name"])
        if c is None:
            continue
        if conf is None:
            conf = {"results": {}, "seconds": 0.0, "executors": [], "jspi": c.get("jspi")}
        conf["results"].update(c["results"])
        conf["seconds"] += c["seconds"]
        conf["executors"] = sorted(set(conf["executors"]) | set(c["executors"]))
    if conf is not None and meta is not None:
        passed, failed = check_conformance(conf, meta)
        rows.append(("conformance (the page's suite, float64 reference)", f"{passed}/{len(meta)} pass",
                     f"{len(conf['results'])} sessions in {conf['seconds']:.1f} s; second run "
                     f"{'sync (JSPI)' if conf.get('jspi') else 'async again (no JSPI in this Node)'}; executors "
                     f"{', '.join(conf['executors'])}"))
        for key, why in failed[:12]:
            notes.append(f"conformance failure {key}: {why}")
    ortr = got("ort")
    for (b, t), (path, ids, mask) in mini.items():
        o = got(f"minilm {b}x{t}")
        if o is None:
            continue
        best = min(o["runs"])
        d = desk.get((b, t))
        ratio = f"; desktop wgpu {_ms(min(d['runs']))}, browser/desktop {best / min(d['runs']):.2f}x" if d else ""
        rows.append((f"MiniLM-L6 {b}x{t}: ours, browser executor (Pyodide + Dawn/Node)", _ms(best),
                     f"first run {_ms(o['first'])}, load {_ms(o['load'])}{ratio}"))
        if d:
            diff = float(np.abs(np.asarray(o["embedding"]).reshape(-1) - np.asarray(d["embedding"]).reshape(-1)).max())
            rows.append((f"MiniLM-L6 {b}x{t}: ours, desktop wgpu (CPython)", _ms(min(d["runs"])),
                         f"first run {_ms(d['first'])}, load {_ms(d['load'])}; max abs diff vs browser {diff:.1e}"))
        if ortr and f"{b}x{t}" in ortr["shapes"]:
            r_ = ortr["shapes"][f"{b}x{t}"]
            ob = min(r_["runs"])
            diff = float(np.abs(np.asarray(o["embedding"]).reshape(-1) - np.asarray(r_["embedding"]).reshape(-1)).max())
            rows.append((f"MiniLM-L6 {b}x{t}: onnxruntime-web {ortr.get('version')} WebGPU EP (Dawn/Node)", _ms(ob),
                         f"ours/ORT time {best / ob:.2f}x; first run {_ms(r_['first'])}, session {_ms(ortr['create'])}; "
                         f"max abs diff vs ours {diff:.1e}"))
    for (b, t) in mini:
        g, d = got(f"gpu {b}x{t}"), desk.get((b, t))
        if g is not None:
            dg = f"; desktop wgpu {_ms(d['gpu'])}, browser/desktop {g['gpu'] / d['gpu']:.2f}x" if d else ""
            rows.append((f"GPU time, MiniLM {b}x{t}: browser (timestamps around each of {g['steps']} steps)",
                         _ms(g["gpu"]), f"best of 4 profiled runs{dg}"))
            if d and g.get("ops") and d.get("ops"):
                gap = sorted(g["ops"], key=lambda op: d["ops"].get(op, 0.0) - g["ops"][op])[:4]
                rows.append((f"GPU time, MiniLM {b}x{t}: ops with the largest gap", "browser / desktop",
                             "; ".join(f"{op} {_ms(g['ops'][op])} / {_ms(d['ops'].get(op))}" for op in gap)))
        g2 = got(f"gpu {b}x{t} +toggles")
        if g2 is not None:
            rows.append((f"GPU time, MiniLM {b}x{t}: browser with Dawn toggles +{a.toggles_pass}", _ms(g2["gpu"]),
                         f"a second Node process; without them {_ms(g['gpu']) if g else '-'}"))
    lat = got("latency")
    if lat is not None:
        rows.append(("dawn.node: submit + mapAsync of 4 bytes, round trip", f"{lat['map_median'] * 1e6:.0f} us",
                     f"median of 200 (min {lat['map_min'] * 1e6:.0f} us); empty submit + onSubmittedWorkDone "
                     f"{lat['done_median'] * 1e6:.0f} us (min {lat['done_min'] * 1e6:.0f} us)"))
    for (b, t) in mini:
        h = got(f"host {b}x{t}")
        if h is None:
            continue
        dn = h["dispatches"]
        o, j, jn = h["ours"][0], h["js"][0], h["js_no_inputs"][0]
        rows.append((f"host, MiniLM {b}x{t}: ours per run ({dn} dispatches, {h['segments']} passes)", f"{o * 1e6:.1f} us",
                     f"{o / dn * 1e6:.2f} us/dispatch: inputs + one JS call, encoded, not submitted"))
        rows.append((f"host, MiniLM {b}x{t}: plain JS per run, same work", f"{j * 1e6:.1f} us",
                     f"{j / dn * 1e6:.2f} us/dispatch; ours/JS {o / j:.2f}x; without the input writes {jn * 1e6:.1f} us"))
        rows.append((f"host, MiniLM {b}x{t}: Python loop (3 bridge calls a dispatch)", f"{h['py'] * 1e6:.0f} us",
                     f"{h['py'] / dn * 1e6:.1f} us/dispatch"))
        sl = got(f"slope {b}x{t}")
        if sl is not None:
            rows += pages_probes.slope_rows(f"MiniLM {b}x{t}", sl)
    for wd in smol:
        o = got(f"smollm {wd}")
        d = desk.get(wd)
        label = {"q4_1": "4-bit (Q4_1 + Q8_0)", "float16": "float16"}[wd]
        if o is not None:
            ratio = f"; desktop {d['decode_tok_s']:.1f} tok/s, browser/desktop {o['decode_tok_s'] / d['decode_tok_s']:.2f}x" if d else ""
            rows.append((f"SmolLM2-135M arch {label}: browser decode", f"{o['decode_tok_s']:.1f} tok/s",
                         f"{wl.n_dec} greedy steps, {o['dispatches']} dispatches a step; per step: run_async {o['host_ms_per_step']:.2f} ms, "
                         f"wait for the logits {o.get('wait_ms_per_step', 0):.2f} ms, argmax in Python {o.get('argmax_ms_per_step', 0):.2f} ms{ratio}"))
            dt = f"; desktop {_ms(d['ttft'])} / {_ms(d['prefill'])} / load {_ms(d['load'])}" if d else ""
            rows.append((f"SmolLM2-135M arch {label}: browser time to first token / prefill", f"{_ms(o['ttft'])}",
                         f"{wl.chunk}-token prompt; steady prefill {_ms(o['prefill'])}; load {_ms(o['load'])}{dt}"))
            if d:
                same = sum(x == y for x, y in zip(o["tokens"], d["tokens"]))
                rows.append((f"SmolLM2-135M arch {label}: greedy tokens browser vs desktop", f"{same}/{len(d['tokens'])} equal",
                             "random weights: near-ties can flip a token, and the rest follows"))
        if d:
            rows.append((f"SmolLM2-135M arch {label}: desktop wgpu decode", f"{d['decode_tok_s']:.1f} tok/s",
                         f"host {d['host_ms_per_step']:.2f} ms/step"))

    dinfo = desk.get("info", {})
    head = [f"# Browser executor on {info.get('device') or info.get('description')} (Node + Dawn, no browser)", "",
            f"{datetime.date.today()}; `python3 benchmarks/gpu_browser/bench.py{' --small' if a.small else ''}"
            f"{' --toggles-pass ' + a.toggles_pass if a.toggles_pass else ''}` "
            f"(benchmarks/README.md). Node {res.get('node')} + npm webgpu (Dawn for Node) + Pyodide: boot "
            f"{res.get('boot_seconds', 0):.1f} s. Best of {a.runs} runs after a first; host rows: min over interleaved rounds.",
            "", f"- browser adapter: `{json.dumps({k: info.get(k) for k in ('vendor', 'architecture', 'device', 'description', 'is_fallback_adapter', 'features', 'max_binding_size')})}`",
            f"- desktop adapter (wgpu-py): `{json.dumps({k: dinfo.get(k) for k in ('adapter', 'backend', 'vendor', 'device', 'description', 'name') if k in dinfo}) or dinfo}`",
            f"- JSPI in this Node: {adapter.get('jspi')}; total {time.perf_counter() - t_all:.0f} s", ""]
    if info.get("is_fallback_adapter") or "llvmpipe" in str(info) or "swiftshader" in str(info).lower():
        head.append("**The browser adapter is a software one: these are not GPU numbers.**\n")
    w = max([len(r[0]) for r in rows] + [4])
    lines = head + [f"| {'what'.ljust(w)} | value | note |", f"|{'-' * (w + 2)}|---|---|"]
    lines += [f"| {r[0].ljust(w)} | {r[1]} | {r[2].replace('|', '/')} |" for r in rows]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    text = "\n".join(lines) + "\n"
    (logs / "bench.json").write_text(json.dumps({"node": res, "desktop": {str(k): v for k, v in desk.items()}}, default=str)[:50_000_000])
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / f"browser_{slug(info)}{'_small' if a.small else ''}.md"
    out.write_text(text)
    print(text)
    print(f"wrote {out}", file=sys.stderr)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
