"""The conformance ops, MiniLM against onnxruntime-web and the dispatch-overhead comparison in a
real headless Chromium (issue 18): the same browser as the demo (demo_chromium.py ``--pages`` calls
``run`` with the browser it launched, after the demo), on the same bundle server.

What runs, all in that one browser, each in a fresh page of its own:
  (a) the conformance suite as tests/browser/test_conformance_browser.py runs it in the page (bench.py's
      ``conformance_jobs``: its job builder, page code and JSPI/async handling), checked here against
      the float64 reference with the page test's own tolerances (``check_conformance``);
  (b) MiniLM-L6 (seeded random weights) at 1x128, 8x128, 32x128 in the harness page
      (bench_browser.py's ``RUN_PAGE``), and onnxruntime-web's WebGPU EP in ort.html on the ONNX of the
      same torch module (bench.py's ``minilm_onnx_file``), the same token ids on both sides;
  (c) host time of one run's encoding, ours (Python, one JS call) against a plain-JavaScript loop on
      the same recorded plan (bench_browser.py's ``HOST_PAGE``), and the GPU time of one run
      (bench.py's ``GPU_PAGE``: timestamps around each step);
  (d) desktop wgpu (CPython, ``device="wgpu"``) on the same MiniLM programs in the same process.
Programs and the ONNX are built where this runs, with torch (real weights do not travel to the GPU
machine). Results are saved after each step to OUT/pages.json (a call cut short keeps what finished).

    .venv/bin/python benchmarks/gpu_browser/pages_chromium.py --small --conformance-max 4 --out /tmp/pages   (here)
    CARRY_DIR=.chromecarry_pages bash benchmarks/gpu_browser/chromium_gpu.sh run --pages                    (GPU)
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (ROOT / "benchmarks", ROOT / "tests", ROOT / "tests" / "browser", ROOT / "web", HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import bench  # noqa: E402  benchmarks/gpu_browser/bench.py: programs, ONNX, conformance jobs, page code
import bench_browser  # noqa: E402  benchmarks/bench_browser.py: RUN_PAGE, HOST_PAGE
import pages_probes  # noqa: E402  benchmarks/gpu_browser/pages_probes.py: limits, kernels, slope, clocks

SHAPES = ((1, 128), (8, 128), (32, 128))
SMALL_SHAPES = ((1, 16), (2, 16))  # SwiftShader: a 6-layer 32x128 run takes minutes there
# What issue 18 asks of these pages: ours no slower than onnxruntime-web's WebGPU EP, and the host
# time per dispatch from Python in the page within this factor of a plain-JavaScript loop.
HOST_RATIO_GOAL = 1.3
# Seconds of back-to-back runs before each timed series, ours and onnxruntime-web's alike: an idle
# GPU's clock comes up only under sustained work (an H100 sat at 345 of 1980 MHz through the
# pages' short bursts, and took ~1.5-2 s of steady load to reach 1980; docs/NOTES.md), and a
# series that starts cold is timed at a lower clock.
WARM_S = 3.0
ADAPTER_PAGE = ("from gpudelegate.web import demo, webgpu\ninfo = await demo.init_gpu()\n"
                "{'info': info.to_py() if hasattr(info, 'to_py') else info, 'jspi': webgpu.can_run_sync()}")
CLOSE_PAGE = "from gpudelegate.web import demo\ndemo.close()"
# Where ours' host time goes (HOST_PAGE's ``ours`` in two halves, on the session it left loaded):
# the executor's input handling alone (``_io``: core Python) and the adapter's one JS call alone
# (``encode_only`` with that io: the arrays handed to _RUN_JS, the call, its encoding), beside the
# price of one call from Python into an empty JS function of five arguments (the bridge's floor),
# and the adapter's replay function (_RUN_JS) on the recorded chain without input writes, called
# from Python and from a JS loop (against HOST_PAGE's plain JS without the input writes: what the
# generic replay costs beyond a hand-written loop, and what calling it from Python adds).
HOST_SPLIT_PAGE = r"""
import asyncio, js, time
from gpudelegate.web import demo
from gpudelegate.web.webgpu import UPLOAD_PIECE
s = demo._loaded["session"]; ex = s.executor; dev = ex.device
xs = [demo.int_tensor(ARGS["ids"]), demo.int_tensor(ARGS["mask"])]
p = next(iter(s.plan.payloads)); rec = ex.recorded[p]
K, R = 50, 9

def io_only():
    return ex._io(p, xs, True, [])[1]

io = io_only()

def encode():
    dev.encode_only(rec.chain, io)

empty = js.Function.new("a", "b", "c", "d", "e", "return null")
buf = dev.device  # any JS object as an argument

def call():
    empty(buf, 0, buf, 0, 4)

cmds, none = rec.chain.cmds, dev._empty

def replay():
    dev._run_js(dev.device, dev.queue, UPLOAD_PIECE, cmds, none, none, none, None, False)

replay_loop = js.Function.new("f", "device", "queue", "P", "cmds", "e", "K",
    "const t0 = performance.now(); for (let k = 0; k < K; k++) f(device, queue, P, cmds, e, e, e, null, false); "
    "return (performance.now() - t0) / 1000 / K;")

def timed(f):
    t = time.perf_counter()
    for _ in range(K):
        f()
    return (time.perf_counter() - t) / K

encode()
t_io, t_enc, t_call, t_rpy, t_rjs = [], [], [], [], []
for _ in range(R):
    await asyncio.sleep(0.03); t_io.append(timed(io_only))
    await asyncio.sleep(0.03); t_enc.append(timed(encode))
    t_call.append(timed(call))
    await asyncio.sleep(0.03); t_rpy.append(timed(replay))
    await asyncio.sleep(0.03); t_rjs.append(replay_loop(dev._run_js, dev.device, dev.queue, UPLOAD_PIECE, cmds, none, K))
{"io": sorted(t_io), "encode": sorted(t_enc), "call": sorted(t_call), "replay_py": sorted(t_rpy), "replay_js": sorted(t_rjs)}
"""


def _log(*a) -> None:
    print(f"[pages {time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


class _Harness:
    """harness.html in a fresh context of ``browser``, booted: ``run(code, args)`` runs Python in
    the page (ARGS bound) and returns plain data, as tests/browser/conftest.py's fixture does."""

    def __init__(self, browser, url: str, timeout_s: float):
        self.context = browser.new_context()
        self.page = self.context.new_page()
        self.page.on("console", lambda m: m.type == "error" and _log(f"harness console: {m.text[:300]}"))
        self.page.set_default_timeout(timeout_s * 1000)
        self.page.goto(url + "harness.html")
        self.page.wait_for_function("window.harness !== undefined")
        self.page.evaluate("() => window.harness.ready")

    def run(self, code: str, args=None):
        return self.page.evaluate("([c, a]) => window.harness.run(c, a)", [code, args])

    def close(self) -> None:
        self.context.close()


def prepare(dist: Path, work: Path, small: bool, ort_dir=None) -> dict:
    """MiniLM programs (one per shape) and their ONNX, built here with torch, put into the served
    bundle (``dist/programs``, ``dist/onnx/minilm.onnx``) with onnxruntime-web's files
    (``dist/ort``: from ``ort_dir``, the carried ones, else web/node_modules)."""
    import build as web_build  # web/build.py

    shapes = SMALL_SHAPES if small else SHAPES
    t = time.perf_counter()
    model, cfg, files = bench.minilm_programs(small, shapes, work)
    (dist / "programs").mkdir(parents=True, exist_ok=True)
    for path in files.values():
        shutil.copy2(path, dist / "programs" / path.name)
    out = {"shapes": list(shapes), "files": {k: str(v) for k, v in files.items()}, "cfg": cfg,
           "programs_s": time.perf_counter() - t, "notes": []}
    t = time.perf_counter()
    try:
        web_build.copy_onnx(dist, bench.minilm_onnx_file(model, work))
        out["onnx_s"] = time.perf_counter() - t
    except Exception as e:  # say exactly why; ours and the rest still run
        out["notes"].append(f"onnxruntime-web not run: the ONNX export failed ({type(e).__name__}: {str(e)[:300]})")
    if ort_dir:
        shutil.copytree(ort_dir, dist / "ort", dirs_exist_ok=True)
    else:
        web_build.copy_ort(dist)
    return out


def _save(res: dict, out: Path) -> None:
    if out is not None:
        (out / "pages.json").write_text(json.dumps(res, indent=1, default=str))


def run(browser, url: str, dist: Path, *, small: bool = False, runs: int = 10, conformance_max: int = 0,
        ort_dir=None, desktop: bool = True, out: Path = None, budget_s: float = 330.0, timeout_s: float = 240.0,
        relaunch=None) -> dict:
    """(a)-(d) in ``browser`` (Playwright, already launched) on the bundle ``dist`` served at
    ``url``; returns the raw results (``report_lines`` makes the table). Steps that would start
    after ``budget_s`` are left out and say so (the GPU machine's call has a wall-clock limit).
    With ``relaunch(enable_toggles, extra_flags)`` (a second browser of the same binary and
    flags plus those), MiniLM's pages run again in each of ``pages_probes.VARIANTS``; the probes
    of pages_probes.py (limits, kernels, host slope, GPU clocks) run in any case."""
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="pages-chromium-"))
    clocks = pages_probes.Clocks(work / "clocks.csv")
    clocks.mark("programs")
    prep = prepare(dist, work, small, ort_dir)
    shapes, cfg = prep["shapes"], prep["cfg"]
    res = {"date": str(datetime.date.today()), "small": small, "runs": runs, "shapes": [f"{b}x{t}" for b, t in shapes],
           "programs_s": prep["programs_s"], "onnx_s": prep.get("onnx_s"), "notes": list(prep["notes"]),
           "ours": {}, "host": {}, "gpu": {}, "desktop": {}, "ort": None, "conformance": None,
           "kernels": {}, "slope": {}, "variants": {}, "desktop_dawn": {}}
    page_kernels = {}
    _log(f"MiniLM programs in {prep['programs_s']:.1f} s, ONNX in {prep.get('onnx_s') or 0:.1f} s")
    feeds = {}
    for b, t in shapes:
        ids, mask = bench.minilm_feeds(cfg, b, t)
        feeds[(b, t)] = (ids, mask)

    def late(what: str) -> bool:
        if time.perf_counter() - t0 > budget_s:
            res["notes"].append(f"{what}: not run, the {budget_s:.0f} s budget of these pages was spent")
            return True
        return False

    def attempt(what: str, f):
        try:
            return f()
        except Exception as e:  # one failed step is reported, the others still run
            res["notes"].append(f"{what}: {type(e).__name__}: {str(e).strip().splitlines()[0][:400] if str(e).strip() else ''}")
            _log(res["notes"][-1])
            return None
        finally:
            _save(res, out)

    # (b, c) ours: one harness page for every shape (load, timed runs, host comparison, GPU time)
    h = attempt("harness page", lambda: _Harness(browser, url, timeout_s))
    if h is not None:
        a = attempt("adapter", lambda: h.run(ADAPTER_PAGE))
        res["adapter"], res["jspi"] = (a or {}).get("info"), (a or {}).get("jspi")
        _log(f"adapter: {res['adapter']}")
        res["limits"] = attempt("limits", lambda: h.run(pages_probes.LIMITS_PAGE))
        for b, t in shapes:
            if late(f"MiniLM {b}x{t}"):
                break
            key, (ids, mask) = f"{b}x{t}", feeds[(b, t)]
            args = {"ids": ids.tolist(), "mask": mask.tolist()}
            name = Path(prep["files"][(b, t)]).name
            clocks.mark(f"ours {key}")
            o = attempt(f"ours {key}", lambda: h.run(bench_browser.RUN_PAGE, {"file": name, "runs": runs, "warm_s": WARM_S, **args}))
            if o is not None:
                o.pop("adapter", None)
                res["ours"][key] = o
                _log(f"ours {key}: best {min(o['runs']) * 1e3:.2f} ms")
                kc = attempt(f"kernels {key}", lambda: h.run(pages_probes.KERNELS_PAGE))
                if kc is not None:
                    page_kernels[key] = kc["kernels"]
                    res.setdefault("page_kernel_notes", {})[key] = {k: v for k, v in kc.items() if k != "kernels"}
                clocks.mark(f"host {key}")
                hr = attempt(f"host {key}", lambda: h.run(bench_browser.HOST_PAGE, {**args, "K": 50, "rounds": 9}))
                if hr is not None:
                    res["host"][key] = hr
                sp = attempt(f"host split {key}", lambda: h.run(HOST_SPLIT_PAGE, args))
                if sp is not None:
                    res.setdefault("host_split", {})[key] = sp
                sl = attempt(f"host slope {key}", lambda: h.run(pages_probes.slope_page(bench_browser.PLAIN_JS), args))
                if sl is not None:
                    res["slope"][key] = sl
            attempt(f"close {key}", lambda: h.run(CLOSE_PAGE))
            clocks.mark(f"GPU time {key}")
            g = attempt(f"GPU time {key}", lambda: h.run(bench.GPU_PAGE, {"file": name, "warm_s": WARM_S, **args}))
            if g is not None:
                res["gpu"][key] = g
        attempt("harness close", h.close)
    res["page_kernels"] = page_kernels

    # (b, c) again in a second browser per variant (Dawn toggles / flags): what each costs in Chromium
    for vname, enable, extra in (pages_probes.VARIANTS if relaunch is not None else ()):
        if late(f"variant {vname}"):
            break
        clocks.mark(f"variant {vname}")
        res["variants"][vname] = attempt(f"variant {vname}", lambda: _variant(relaunch(enable, extra), url, shapes, feeds,
                                                                              prep["files"], runs, timeout_s))

    # (b) onnxruntime-web, WebGPU EP, in ort.html
    if (dist / "onnx" / "minilm.onnx").exists() and not late("onnxruntime-web"):
        res["ort"] = attempt("onnxruntime-web", lambda: _ort(browser, url, shapes, feeds, runs, timeout_s))

    # (a) the conformance suite, in pieces (a failure loses one piece, not the suite)
    clocks.mark("onnxruntime-web / conformance")
    if not late("conformance"):
        res["conformance"] = attempt("conformance", lambda: _conformance(browser, url, conformance_max, timeout_s,
                                                                         t0 + budget_s, res["notes"]))

    # (d) desktop wgpu on the same programs, in this process
    if desktop and not late("desktop wgpu"):
        def _desktop():
            from gpudelegate.environment import Environment

            env = Environment()
            try:
                res["desktop"]["info"] = env.context("wgpu").info()
                for (b, t), path in prep["files"].items():
                    d = bench.desktop_minilm(env, Path(path), *feeds[(b, t)], runs, inspect=pages_probes.kernel_choices,
                                             warm_s=WARM_S)
                    res["desktop"][f"{b}x{t}"] = d
                    _log(f"desktop wgpu {b}x{t}: best {min(d['runs']) * 1e3:.2f} ms")
            finally:
                env.close()
        clocks.mark("desktop wgpu")
        attempt("desktop wgpu", _desktop)

        def _desktop_dawn():
            # Dawn as the page has it (the same toggles as Chromium's flags: subgroup matrices and
            # f16 on NVIDIA), robustness on (its default), timestamps not rounded (DawnContext's).
            import os

            from gpudelegate.environment import Environment

            os.environ.setdefault("GPUDELEGATE_DAWN_TOGGLES", "allow_unsafe_apis,vulkan_enable_f16_on_nvidia")
            env = Environment()
            try:
                ctx = env.context("dawn")
                res["desktop_dawn"]["info"] = {**ctx.info(), "limits_raw": {k: v for k, v in dict(ctx.device.limits).items()
                                                                            if isinstance(v, (int, float))}}
                for (b, t), path in prep["files"].items():
                    d = bench.desktop_minilm(env, Path(path), *feeds[(b, t)], runs, device="dawn",
                                             inspect=pages_probes.kernel_choices, warm_s=WARM_S)
                    res["desktop_dawn"][f"{b}x{t}"] = d
                    _log(f"desktop Dawn {b}x{t}: best {min(d['runs']) * 1e3:.2f} ms")
            finally:
                env.close()
        clocks.mark("desktop Dawn")
        attempt("desktop Dawn", _desktop_dawn)
    clocks.stop()
    res["clocks"] = {"static": clocks.static, "steps": clocks.summary()}
    for key, kern in page_kernels.items():
        for name, side in (("desktop wgpu", "desktop"), ("desktop Dawn", "desktop_dawn")):
            dk = ((res.get(side) or {}).get(key) or {}).get("kernels")
            if dk:
                res["kernels"].setdefault(key, {})[name] = pages_probes.compare_kernels(kern, dk)
    for side in ("desktop", "desktop_dawn"):  # the raw lists are long; the comparison keeps what differs
        for v in (res.get(side) or {}).values():
            if isinstance(v, dict):
                v.pop("kernels", None)
    res["seconds"] = time.perf_counter() - t0
    _save(res, out)
    shutil.rmtree(work, ignore_errors=True)
    return res


def _variant(browser, url: str, shapes, feeds, files, runs: int, timeout_s: float) -> dict:
    """MiniLM's timed runs and GPU time (RUN_PAGE, GPU_PAGE) in ``browser`` (a variant's), then
    closes it."""
    out = {"version": browser.version, "ours": {}, "gpu": {}}
    try:
        h = _Harness(browser, url, timeout_s)
        a = h.run(ADAPTER_PAGE)
        out["adapter"] = (a or {}).get("info")
        for b, t in shapes:
            key, (ids, mask) = f"{b}x{t}", feeds[(b, t)]
            args = {"ids": ids.tolist(), "mask": mask.tolist()}
            name = Path(files[(b, t)]).name
            o = h.run(bench_browser.RUN_PAGE, {"file": name, "runs": runs, "warm_s": WARM_S, **args})
            o.pop("adapter", None)
            o.pop("embedding", None)
            out["ours"][key] = o
            h.run(CLOSE_PAGE)
            out["gpu"][key] = h.run(bench.GPU_PAGE, {"file": name, "warm_s": WARM_S, **args})
            _log(f"variant: ours {key} best {min(o['runs']) * 1e3:.2f} ms, GPU {out['gpu'][key]['gpu'] * 1e3:.2f} ms")
        h.close()
    finally:
        browser.close()
    return out


def _ort(browser, url: str, shapes, feeds, runs: int, timeout_s: float) -> dict:
    """ort.html (the bundle's onnxruntime-web page): one WebGPU EP session, each shape run once
    for shader compilation and then ``runs`` times, each run ending with the output on the CPU."""
    context = browser.new_context()
    try:
        page = context.new_page()
        page.on("console", lambda m: m.type == "error" and _log(f"ort console: {m.text[:300]}"))
        page.set_default_timeout(timeout_s * 1000)
        page.goto(url + "ort.html")
        page.wait_for_function("window.ortBench !== undefined")
        out = {"session": page.evaluate("() => window.ortBench.create('webgpu')"),
               "version": page.evaluate("() => window.ortBench.version"),
               "cross_origin_isolated": page.evaluate("() => window.ortBench.crossOriginIsolated"), "shapes": {}}
        for b, t in shapes:
            ids, mask = feeds[(b, t)]
            a = {"ids": ids.reshape(-1).tolist(), "mask": mask.reshape(-1).tolist(), "B": b, "T": t}
            # the same warm-up as ours (RUN_PAGE's warm_s): runs until WARM_S seconds passed
            t_w = time.perf_counter()
            while time.perf_counter() - t_w < WARM_S:
                page.evaluate("(a) => window.ortBench.run('webgpu', a)", {**a, "runs": 10})
            r = page.evaluate("(a) => window.ortBench.run('webgpu', a)", {**a, "runs": runs})
            out["shapes"][f"{b}x{t}"] = r
            _log(f"onnxruntime-web {b}x{t}: best {min(r['runs']) * 1e3:.2f} ms")
        page.evaluate("() => window.ortBench.release('webgpu')")
        return out
    finally:
        context.close()


def _conformance(browser, url: str, limit: int, timeout_s: float, deadline: float, notes: list) -> dict:
    """bench.py's conformance jobs in one harness page, in pieces of bench.CONFORMANCE_PIECE
    sessions; checked here (float64 reference, the page test's tolerances)."""
    code, args, meta = bench.conformance_jobs(limit)
    n = max(1, -(-len(args["jobs"]) // bench.CONFORMANCE_PIECE))
    _log(f"conformance: {len(args['jobs'])} sessions + {len(args['kv_jobs'])} KV chains in {n} pieces")
    conf = {"results": {}, "seconds": 0.0, "executors": [], "jspi": None}
    h = _Harness(browser, url, timeout_s)
    try:
        for i in range(n):
            if time.perf_counter() > deadline:
                notes.append(f"conformance: pieces {i + 1}..{n} not run, the pages' budget was spent")
                break
            part = {"jobs": args["jobs"][i * bench.CONFORMANCE_PIECE:(i + 1) * bench.CONFORMANCE_PIECE],
                    "kv_jobs": args["kv_jobs"] if i == n - 1 else []}
            try:
                c = h.run(code, part)
            except Exception as e:  # this piece's sessions count as failed (no result)
                notes.append(f"conformance piece {i + 1}/{n}: {type(e).__name__}: {str(e).strip()[:300]}")
                continue
            conf["results"].update(c["results"])
            conf["seconds"] += c["seconds"]
            conf["executors"] = sorted(set(conf["executors"]) | set(c["executors"]))
            conf["jspi"] = c.get("jspi")
            _log(f"conformance piece {i + 1}/{n}: {len(c['results'])} in {c['seconds']:.1f} s")
    finally:
        h.close()
    passed, failed = bench.check_conformance(conf, meta)
    return {"cases": len(meta), "passed": passed, "failed": failed, "sessions": len(conf["results"]),
            "seconds": conf["seconds"], "executors": conf["executors"], "jspi": conf["jspi"]}


# ============================================================================ report

def _ms(s) -> str:
    return bench._ms(s)


def _diff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64).reshape(-1) - np.asarray(b, np.float64).reshape(-1)).max())


def rows(res: dict) -> list:
    """(what, value, note) rows, the goals of issue 18 first."""
    out = []
    c = res.get("conformance")
    if c:
        out.append(("conformance ops in the page (float64 reference, the page test's tolerances)",
                    f"{c['passed']}/{c['cases']} pass",
                    f"{c['sessions']} sessions in {c['seconds']:.1f} s; second run "
                    f"{'sync (JSPI)' if c.get('jspi') else 'async again (no JSPI)'}; executors {', '.join(c['executors'])}"))
    ort = res.get("ort") or {}
    for key in res["shapes"]:
        o, d, r = res["ours"].get(key), res["desktop"].get(key), (ort.get("shapes") or {}).get(key)
        if o is None:
            continue
        # best and median of the timed runs: on the GPU some shapes' runs are bimodal (a few fast
        # runs among slow ones), so a best alone would overstate what a user sees
        best, med = min(o["runs"]), statistics.median(o["runs"])
        note = f"first run {_ms(o['first'])}, load {_ms(o['load'])}"
        if d:
            note += f"; desktop wgpu {_ms(min(d['runs']))}, browser/desktop {best / min(d['runs']):.2f}x"
        out.append((f"MiniLM-L6 {key}: ours in Chromium (Pyodide + WebGPU)", f"{_ms(best)} (median {_ms(med)})", note))
        if r:
            ob, om = min(r["runs"]), statistics.median(r["runs"])
            out.append((f"MiniLM-L6 {key}: onnxruntime-web {ort.get('version')} WebGPU EP in Chromium",
                        f"{_ms(ob)} (median {_ms(om)})",
                        f"ours/ORT time {best / ob:.2f}x best, {med / om:.2f}x median "
                        f"({'ours no slower' if best <= ob and med <= om else 'ours SLOWER'}); "
                        f"first run {_ms(r['first'])}, session {_ms(ort['session']['seconds'])}; "
                        f"max abs diff of embeddings vs ours {_diff(o['embedding'], r['embedding']):.1e}"))
        if d:
            out.append((f"MiniLM-L6 {key}: ours, desktop wgpu (CPython, same program)",
                        f"{_ms(min(d['runs']))} (median {_ms(statistics.median(d['runs']))})",
                        f"first run {_ms(d['first'])}, load {_ms(d['load'])}; "
                        f"max abs diff vs Chromium {_diff(o['embedding'], d['embedding']):.1e}"))
    for key in res["shapes"]:
        h = res["host"].get(key)
        if h is None:
            continue
        dn, o, j, jn = h["dispatches"], h["ours"][0], h["js"][0], h["js_no_inputs"][0]
        om, jm = h["ours"][len(h["ours"]) // 2], h["js"][len(h["js"]) // 2]
        out.append((f"host, MiniLM {key}: ours per run ({dn} dispatches, {h['segments']} passes)", f"{o * 1e6:.1f} us",
                    f"{o / dn * 1e6:.2f} us/dispatch: inputs + one JS call, encoded, not submitted; median {om * 1e6:.1f} us"))
        out.append((f"host, MiniLM {key}: plain JS per run, same work", f"{j * 1e6:.1f} us",
                    f"{j / dn * 1e6:.2f} us/dispatch; ours/JS {o / j:.2f}x (median {om / jm:.2f}x; goal <= {HOST_RATIO_GOAL}x: "
                    f"{'met' if o / j <= HOST_RATIO_GOAL else 'NOT met'}); without the input writes {jn * 1e6:.1f} us"))
        sp = (res.get("host_split") or {}).get(key)
        if sp:
            out.append((f"host, MiniLM {key}: ours in two halves: inputs (`_io`, Python) + the one JS call (`encode_only`)",
                        f"{sp['io'][0] * 1e6:.1f} + {sp['encode'][0] * 1e6:.1f} us",
                        f"min over 9 rounds of 50 each; one call from Python into an empty 5-argument JS function "
                        f"{sp['call'][0] * 1e6:.2f} us"))
            if sp.get("replay_js"):
                out.append((f"host, MiniLM {key}: the adapter's replay (_RUN_JS), no input writes: from a JS loop / from Python",
                            f"{sp['replay_js'][0] * 1e6:.1f} / {sp['replay_py'][0] * 1e6:.1f} us",
                            f"plain JS without the input writes {h['js_no_inputs'][0] * 1e6:.1f} us"))
        out.append((f"host, MiniLM {key}: Python loop (3 bridge calls a dispatch)", f"{h['py'] * 1e6:.0f} us",
                    f"{h['py'] / dn * 1e6:.1f} us/dispatch"))
    for key in res["shapes"]:
        g, d = res["gpu"].get(key), res["desktop"].get(key)
        if g is None:
            continue
        dg = f"; desktop wgpu {_ms(d['gpu'])}, Chromium/desktop {g['gpu'] / d['gpu']:.2f}x" if d and d.get("gpu") else ""
        out.append((f"GPU time, MiniLM {key}: Chromium (timestamps around each of {g['steps']} steps)", _ms(g["gpu"]),
                    f"best of 4 profiled runs{dg}"))
    return out


def report_lines(res: dict) -> list:
    """Markdown: a heading, the adapter, the table, the notes."""
    a = res.get("adapter") or {}
    d = (res.get("desktop") or {}).get("info") or {}
    ort = res.get("ort") or {}
    lines = ["", "## Conformance, MiniLM vs onnxruntime-web, dispatch overhead (pages_chromium.py)", "",
             f"- the pages' adapter: `{json.dumps({k: a.get(k) for k in ('vendor', 'architecture', 'device', 'description', 'is_fallback_adapter', 'features')})}`",
             f"- desktop wgpu (same process, same GPU): `{json.dumps({k: d.get(k) for k in ('adapter', 'backend', 'vendor', 'device', 'description', 'name') if k in d}) or d}`",
             f"- MiniLM-L6 architecture, seeded random weights (torch.manual_seed(0)), programs built here in "
             f"{res.get('programs_s', 0):.0f} s, its ONNX (the same module) in {res.get('onnx_s') or 0:.0f} s; "
             f"best and median of {res['runs']} runs after a first, each ending with the embeddings on the CPU; host rows: min "
             f"over 9 interleaved rounds of 50; onnxruntime-web crossOriginIsolated: {ort.get('cross_origin_isolated')}; "
             f"the pages took {res.get('seconds', 0):.0f} s", ""]
    if a.get("is_fallback_adapter") or "swiftshader" in json.dumps(a).lower():
        lines += ["**The pages' adapter is a software one: these are not GPU numbers.**", ""]
    rs = rows(res) + pages_probes.rows(res)
    if rs:
        lines += ["| what | value | note |", "|---|---|---|"]
        lines += [f"| {r[0]} | {r[1]} | {r[2].replace('|', '/')} |" for r in rs]
    notes = list(res.get("notes") or [])
    c = res.get("conformance") or {}
    notes += [f"conformance failure {k}: {why}" for k, why in (c.get("failed") or [])[:12]]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return lines


# ============================================================================ standalone (here)

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--out", type=Path, required=True, help="folder for pages.json and pages.md")
    ap.add_argument("--small", action="store_true", help="2-layer MiniLM, 1x16 and 2x16 (SwiftShader)")
    ap.add_argument("--runs", type=int, default=10, help="timed runs after the first (each side, each shape)")
    ap.add_argument("--conformance-max", type=int, default=0, help="only the first N cases of each kind (0: all)")
    ap.add_argument("--flag-set", default="default", help="demo_chromium.py's FLAG_SETS name")
    ap.add_argument("--no-desktop", action="store_true", help="leave desktop wgpu out")
    ap.add_argument("--budget", type=float, default=1800.0, help="seconds after which later steps are left out")
    ap.add_argument("--variants", action="store_true", help="MiniLM again in a browser per pages_probes.VARIANTS")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    import demo_chromium  # its flags and bundle (imported here: it imports this module for --pages)
    from playwright.sync_api import sync_playwright
    from serve import BundleServer  # web/serve.py

    dist = demo_chromium.bundle(Path(tempfile.mkdtemp(prefix="pages-dist-")) / "dist", [])
    with BundleServer(dist) as url, sync_playwright() as pw:
        flags = demo_chromium.COMMON_FLAGS + demo_chromium.FLAG_SETS[a.flag_set]
        browser = pw.chromium.launch(executable_path=a.chromium, headless=True, args=flags)

        def relaunch(enable, extra):  # the same browser with more Dawn toggles / flags (pages_probes.VARIANTS)
            return pw.chromium.launch(executable_path=a.chromium, headless=True,
                                      args=pages_probes.variant_flags(flags, enable, extra))
        try:
            res = run(browser, url, dist, small=a.small, runs=a.runs, conformance_max=a.conformance_max,
                      desktop=not a.no_desktop, out=a.out, budget_s=a.budget,
                      relaunch=relaunch if a.variants else None)
            res["chromium_version"] = browser.version
        finally:
            browser.close()
    text = "\n".join([f"# Pages in headless Chromium {res['chromium_version']}"] + report_lines(res)) + "\n"
    (a.out / "pages.md").write_text(text)
    print(text)
    c = res.get("conformance") or {}
    return 0 if c.get("passed") == c.get("cases") and not res["notes"] else 1


if __name__ == "__main__":
    sys.exit(main())
