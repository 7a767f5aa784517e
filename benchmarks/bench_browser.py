"""Browser benchmark, one table per run: MiniLM-L6 (1x128, 8x128) in one headless Chromium, with our
executor (Pyodide + WebGPU) and with onnxruntime-web (npm, served from the bundle) on its WebGPU
execution provider, plus its wasm EP as a second anchor; the ONNX comes from the same torch module
and the same weights as our program (benchmarks/minilm_onnx.py), and both sides get the same token
ids, so the embeddings are compared too. Then the host-side cost of one run's encoding, ours
against a plain-JavaScript function doing the same work on the same recorded plan, and the cost of
checking every constant's hash while a large program file downloads (web/loader.py).

    .venv/bin/python benchmarks/bench_browser.py [--out benchmarks/results/browser_swiftshader.md] [--runs 2]
    .venv/bin/python benchmarks/bench_browser.py --only-verify --verify-mb 512

On a machine without a GPU the adapter is SwiftShader (WebGPU on the CPU): absolute GPU times say
little about real GPUs, the ratios between the two runtimes in the same browser do.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "web"))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "browser"))

# Ours: load the program, a first run (shader compilation), then timed runs; the last run's
# embeddings come back for the comparison with onnxruntime-web.
RUN_PAGE = r"""
import js, time
from gpudelegate.web import demo
resp = await js.fetch("programs/" + ARGS["file"])
buf = js.Uint8Array.new(await resp.arrayBuffer())
t = time.perf_counter()
await demo.load(ARGS["file"], buf)  # hashes checked, plan, pipelines, upload
load = time.perf_counter() - t
s = demo._loaded["session"]; ex = s.executor
feeds = {"ids": demo.int_tensor(ARGS["ids"]), "mask": demo.int_tensor(ARGS["mask"])}
t = time.perf_counter(); await s.run_async("forward", feeds); first = time.perf_counter() - t
# Optional warm-up (ARGS["warm_s"] seconds of back-to-back runs): a GPU idling between bursts runs
# at its idle clock (an H100 at 345 of 1980 MHz: docs/NOTES.md), so timed runs compare runtimes only
# when each side got the same warm-up.
t = time.perf_counter()
while time.perf_counter() - t < float(ARGS.get("warm_s", 0)):
    await s.run_async("forward", feeds)
times = []
for _ in range(ARGS["runs"]):
    t = time.perf_counter(); out = await s.run_async("forward", feeds); times.append(time.perf_counter() - t)
{"load": load, "first": first, "runs": times, "embedding": out[0].tolist(), "dispatches": ex.recorded[0].dispatch_count,
 "adapter": ex.ctx.info()}
"""

# Host-side cost of one run's encoding, no GPU wait (nothing is submitted): ours (the executor's
# input handling and the adapter's one JS call, WebGPUContext.encode_only: what run_async does
# before it submits) against a plain-JavaScript function written by hand that does the same work
# on the same recorded objects: write the inputs (queue.writeBuffer of typed arrays already in
# JS), the recorded copies, the dispatch loop in the same compute passes, finish. Timed inside JS.
PLAIN_JS = """
const t0 = performance.now();
for (let k = 0; k < K; k++) {
  if (withInputs) for (let i = 0; i < ins.length; i += 3) queue.writeBuffer(ins[i], ins[i + 1], ins[i + 2]);
  const enc = device.createCommandEncoder();
  for (const [copies, list] of segs) {
    for (let i = 0; i < copies.length; i += 5) enc.copyBufferToBuffer(copies[i], copies[i + 1], copies[i + 2], copies[i + 3], copies[i + 4]);
    if (list.length) {
      const pass = enc.beginComputePass();
      for (let i = 0; i < list.length; i += 5) {
        pass.setPipeline(list[i]);
        pass.setBindGroup(0, list[i + 1]);
        pass.dispatchWorkgroups(list[i + 2], list[i + 3], list[i + 4]);
      }
      pass.end();
    }
  }
  enc.finish();
}
return (performance.now() - t0) / 1000 / K;
"""

HOST_PAGE = r"""
import asyncio, js, time
from gpudelegate.web import demo
from gpudelegate.web.webgpu import to_js
if ARGS.get("file"):
    resp = await js.fetch("programs/" + ARGS["file"])
    await demo.load(ARGS["file"], js.Uint8Array.new(await resp.arrayBuffer()))
s = demo._loaded["session"]; ex = s.executor; dev = ex.device
ids, mask = demo.int_tensor(ARGS["ids"]), demo.int_tensor(ARGS["mask"])
p = next(iter(s.plan.payloads)); rec = ex.recorded[p]; pp = s.plan.payloads[p]
xs = [ids, mask]
K = int(ARGS.get("K", 50))
R = int(ARGS.get("rounds", 15))

def ours():
    temps = []
    _, io = ex._io(p, xs, True, temps)  # what run_async does: the inputs' bytes, no read-back
    dev.encode_only(rec.chain, io)  # inputs written, chain encoded, finished; not submitted

# The recorded steps as compute passes: a step with copies ends the pass before it (as in the
# adapter's replay), so the plain JS below encodes exactly the same commands.
passes = []
for st in rec.nodes:
    if st.copies or not passes:
        passes.append(([v for c in st.copies for v in (c.src, c.src_offset, c.dst, c.dst_offset, c.size)], []))
    passes[-1][1].extend(v for L in st.launches for v in (L.pipeline, L.bind_group, *L.workgroups))

def timed(f):
    t = time.perf_counter()
    for _ in range(K):
        f()
    return (time.perf_counter() - t) / K

segs = to_js([[c, l] for c, l in passes])
ins = to_js([v for ref, x in zip(pp.inputs, xs) for v in (ex.buffer_of(p, ref.buf), ref.buf.offset, to_js(memoryview(x.data)))])
plain = js.Function.new("device", "queue", "segs", "ins", "K", "withInputs", PLAIN_JS)
ours(); plain(dev.device, dev.queue, segs, ins, K, True)
# Interleaved rounds (the GPU process shares two cores with everything else): min and median.
t_ours, t_js, t_js_noin = [], [], []
for _ in range(R):
    # A pause before each batch lets the GPU process drain what the last batch encoded (without it
    # every variant sees stalls of hundreds of us at random).
    await asyncio.sleep(0.03); t_ours.append(timed(ours))
    await asyncio.sleep(0.03); t_js.append(plain(dev.device, dev.queue, segs, ins, K, True))
    await asyncio.sleep(0.03); t_js_noin.append(plain(dev.device, dev.queue, segs, ins, K, False))

def py_loop():
    enc = dev.device.createCommandEncoder()
    cp = None
    for st in rec.nodes:
        for c in st.copies:
            if cp is not None:
                cp.end(); cp = None
            enc.copyBufferToBuffer(c.src, c.src_offset, c.dst, c.dst_offset, c.size)
        for L in st.launches:
            if cp is None:
                cp = enc.beginComputePass()
            cp.setPipeline(L.pipeline); cp.setBindGroup(0, L.bind_group); cp.dispatchWorkgroups(*L.workgroups)
    if cp is not None:
        cp.end()
    enc.finish()

t_py = []
for _ in range(3):
    await asyncio.sleep(0.03); t_py.append(timed(py_loop))
t_py = min(t_py)
{"dispatches": rec.dispatch_count, "segments": len(passes), "ours": sorted(t_ours), "js": sorted(t_js),
 "js_no_inputs": sorted(t_js_noin), "py": t_py}
""".replace("PLAIN_JS", repr(PLAIN_JS))

# The download check (web/loader.py) as the demo's worker runs it: a program file streamed from
# 127.0.0.1 into one Uint8Array, without the check (the baseline) and with ``Download.advance``
# every HASH_STEP bytes (web/app/worker.js), then ``verify_all`` over the whole buffer (a Cache
# Storage hit). Timed in JS; the Python side reports its own seconds (copy into the WebAssembly
# heap + SHA-256).
HASH_STEP = 4 << 20
VERIFY_JS = """
async ([file, withCheck, step]) => {
  const loader = window.pyodide.pyimport("gpudelegate.web.loader");
  const t0 = performance.now();
  const resp = await fetch("programs/" + file);
  const total = Number(resp.headers.get("Content-Length"));
  const bytes = new Uint8Array(total);
  const check = withCheck ? loader.Download(bytes, total) : null;
  let got = 0, checked = 0;
  const reader = resp.body.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    bytes.set(value, got);
    got += value.byteLength;
    if (check && (got - checked >= step || got === total)) checked = check.advance(got);
  }
  const out = { total, stream: (performance.now() - t0) / 1000 };
  if (check) { check.program(); out.hash = check.seconds; check.destroy(); }
  else {
    const t1 = performance.now();
    const whole = loader.Download(bytes, total);
    whole.verify_all();
    out.whole = (performance.now() - t1) / 1000;
    out.wholePython = whole.seconds;
    whole.destroy();
  }
  loader.destroy();
  return out;
}
"""


def verify_program(path: Path, mb: int) -> Path:
    """A valid program file of about ``mb`` MB: float32 linear weights of 64 MB each."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests" / "core"))
    import progbuild  # tests/core/progbuild.py

    rows = 4096
    cols = 4096  # 64 MiB per weight
    n = max(1, round(mb / 64))
    rng = np.random.default_rng(0)
    b = progbuild.ProgramBuilder(metadata={"model": f"hash-check {n * 64} MB"})
    pl = b.payload()
    x = pl.input("float32", (1, cols), "x")
    y = x
    for i in range(n):
        w = b.constant("float32", (rows, cols), rng.standard_normal((rows, cols), np.float32).tobytes())
        y = pl.op("linear", [y, pl.prepack(pl.constant(w, f"layers.{i}.weight"))])
    pl.output(y)
    pl.schedule_offload()
    m = b.method("forward")
    (o,) = m.delegate(pl, [m.input("float32", (1, cols), "x")])
    m.output(o)
    b.build().save(path)
    return path


SENTENCES = ["The train station is two blocks north of the market.", "A GPU runs thousands of threads in parallel.",
             "I baked a chocolate cake for her birthday.", "Turn left at the bakery to reach the railway platform.",
             "Cats sleep for most of the day.", "The museum opens at nine and closes at six.",
             "Trains to the airport leave every fifteen minutes.", "Ein Hund läuft über die Wiese."]


def _max_diff(a, b) -> float:
    import numpy as np
    a, b = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    ap.add_argument("--runs", type=int, default=2, help="timed runs after the first (per runtime and shape)")
    ap.add_argument("--shapes", default="1x128,8x128", help="MiniLM batch x seq_len list")
    ap.add_argument("--no-ort", action="store_true", help="ours only")
    ap.add_argument("--verify-mb", type=int, default=512, help="size of the download-check file (0: no check rows)")
    ap.add_argument("--only-verify", action="store_true", help="only the download-check rows")
    a = ap.parse_args(argv)
    if a.only_verify:
        a.no_ort, a.shapes = True, ""

    import build as web_build
    import minilm as minilm_example
    import minilm_onnx
    from conftest import CHROMIUM, WEBGPU_ARGS
    from gpudelegate.export.models import minilm as minilm_model
    from playwright.sync_api import sync_playwright
    from serve import BundleServer

    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
    tok = minilm_model.load_tokenizer() if shapes else None
    feeds = {}
    for b, t in shapes:
        ids, mask = tok.encode_batch([SENTENCES[i % len(SENTENCES)] for i in range(b)], t)
        feeds[(b, t)] = {"ids": ids, "mask": mask}
    ours, host, ort, verify = {}, {}, {}, []
    console = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        progs = tmp / "programs_src"
        progs.mkdir()
        for b, t in shapes:
            minilm_example.export(progs / f"minilm-{b}x{t}.gdp", batch=b, seq_len=t)
        if a.verify_mb:
            verify_program(progs / "hash-check.gdp", a.verify_mb)
        dist = web_build.build_dist(tmp / "dist", programs=progs)
        if not a.no_ort:
            web_build.copy_onnx(dist, minilm_onnx.export())
        with BundleServer(dist) as url, sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=WEBGPU_ARGS, headless=True)
            context = browser.new_context()
            outside = []
            context.route("**/*", lambda r: r.continue_() if r.request.url.startswith(url) else (outside.append(r.request.url), r.abort()))
            page = context.new_page()
            page.set_default_timeout(1_800_000)
            page.goto(url + "harness.html")
            page.wait_for_function("window.harness !== undefined")
            page.evaluate("() => window.harness.ready")
            run = lambda code, args: page.evaluate("([c, a]) => window.harness.run(c, a)", [code, args])  # noqa: E731
            for b, t in shapes:
                f = feeds[(b, t)]
                ours[(b, t)] = run(RUN_PAGE, {"file": f"minilm-{b}x{t}.gdp", "runs": a.runs, **f})
                host[(b, t)] = run(HOST_PAGE, f)
                run("from gpudelegate.web import demo\ndemo.close()", None)
                print(f"ours {b}x{t}: best {min(ours[(b, t)]['runs']):.2f} s", file=sys.stderr)
            if a.verify_mb:
                # Interleaved, so both variants see the same page cache and machine load.
                for _ in range(3):
                    for check in (False, True):
                        verify.append(page.evaluate(VERIFY_JS, ["hash-check.gdp", check, HASH_STEP]))
                        print(f"download check={check}: {verify[-1]}", file=sys.stderr)
            page.close()
            if not a.no_ort:
                page = context.new_page()
                page.set_default_timeout(1_800_000)
                page.on("console", lambda m: m.type in ("error", "warning") and console.append(m.text))
                page.goto(url + "ort.html")
                page.wait_for_function("window.ortBench !== undefined")
                for ep in ("webgpu", "wasm"):
                    try:
                        created = page.evaluate("(ep) => window.ortBench.create(ep)", ep)
                    except Exception as e:  # say exactly why, and go on with what can be measured
                        ort[ep] = {"error": str(e).splitlines()[0]}
                        continue
                    ort[ep + ":session"] = created
                    for b, t in shapes:
                        f = feeds[(b, t)]
                        args = {"ids": [v for r in f["ids"] for v in r], "mask": [v for r in f["mask"] for v in r],
                                "B": b, "T": t, "runs": a.runs}
                        try:
                            r = page.evaluate("([ep, a]) => window.ortBench.run(ep, a)", [ep, args])
                        except Exception as e:
                            r = {"error": str(e).splitlines()[0]}
                        ort[(ep, b, t)] = {**r, "create": created}
                        if "runs" in r:
                            print(f"ort {ep} {b}x{t}: best {min(r['runs']):.2f} s", file=sys.stderr)
                    page.evaluate("(ep) => window.ortBench.release(ep)", ep)
                ort["version"] = page.evaluate("() => window.ortBench.version")
                ort["threads"] = (ort.get("wasm:session") or {}).get("threads")
            browser.close()
            assert not outside, f"the benchmark pages reached outside 127.0.0.1: {outside}"

    info = next(iter(ours.values()))["adapter"] if ours else {"vendor": "-", "architecture": "-"}
    rows = []
    if verify:
        plain = [v for v in verify if "hash" not in v]
        checked = [v for v in verify if "hash" in v]
        mbs = verify[0]["total"] / 1e6
        s0, s1 = min(v["stream"] for v in plain), min(v["stream"] for v in checked)
        h = min(v["hash"] for v in checked)
        w = min(v["whole"] for v in plain)
        rows.append((f"download of {mbs:.0f} MB from 127.0.0.1, no check", f"{s0:.2f} s", f"{mbs / s0:.0f} MB/s"))
        rows.append((f"download of {mbs:.0f} MB, hashes checked as it arrives", f"{s1:.2f} s",
                     f"+{s1 - s0:.2f} s ({(s1 / s0 - 1) * 100:+.0f}%); the check itself {h:.2f} s "
                     f"({mbs / h:.0f} MB/s, {HASH_STEP >> 20} MB steps)"))
        rows.append((f"check of {mbs:.0f} MB already in memory (Cache Storage hit)", f"{w:.2f} s", f"{mbs / w:.0f} MB/s"))
    for b, t in shapes:
        o = ours[(b, t)]
        best = min(o["runs"])
        rows.append((f"MiniLM-L6 {b}x{t}: ours (Pyodide + WebGPU)", f"{best * 1e3:.0f} ms",
                     f"first run {o['first']:.1f} s, load {o['load']:.1f} s"))
        for ep, name in (("webgpu", "onnxruntime-web WebGPU EP"), ("wasm", f"onnxruntime-web wasm EP ({ort.get('threads')} thread)")):
            if a.no_ort:
                continue
            r = ort.get((ep, b, t)) or ort.get(ep) or {"error": "not run"}
            if "error" in r:
                rows.append((f"MiniLM-L6 {b}x{t}: {name}", "failed", r["error"].replace("|", "/")))
                continue
            ob = min(r["runs"])
            d = _max_diff(o["embedding"], r["embedding"])
            rows.append((f"MiniLM-L6 {b}x{t}: {name}", f"{ob * 1e3:.0f} ms",
                         f"ours is {ob / best:.2f}x its speed; first run {r['first']:.1f} s, session {r['create']['seconds']:.1f} s; "
                         f"max abs diff of embeddings vs ours {d:.1e}"))
    for b, t in shapes:
        h = host[(b, t)]
        d = h["dispatches"]
        o, j, jn = h["ours"][0], h["js"][0], h["js_no_inputs"][0]
        om, jm = h["ours"][len(h["ours"]) // 2], h["js"][len(h["js"]) // 2]
        rows.append((f"host, {b}x{t}: ours per run ({d} dispatches, {h['segments']} passes)", f"{o * 1e6:.1f} us",
                     f"{o / d * 1e6:.2f} us/dispatch; inputs + one JS call; median {om * 1e6:.1f} us"))
        rows.append((f"host, {b}x{t}: plain JS per run, same work", f"{j * 1e6:.1f} us",
                     f"{j / d * 1e6:.2f} us/dispatch; ours/JS {o / j:.2f}x (median {om / jm:.2f}x); without the input writes {jn * 1e6:.1f} us"))
        rows.append((f"host, {b}x{t}: Python loop per run", f"{h['py'] * 1e6:.0f} us", f"{h['py'] / d * 1e6:.1f} us/dispatch (3 bridge calls each)"))
    ver = f", onnxruntime-web {ort.get('version')}" if ort else ""
    head = (f"Browser (Chromium headless, adapter {info.get('vendor')}/{info.get('architecture')}{ver}), "
            f"{datetime.date.today()}; best of {a.runs} runs after a first; host rows: min over interleaved rounds")
    w = max(len(r[0]) for r in rows)
    lines = [head, "", f"| {'what'.ljust(w)} | value | note |", f"|{'-' * (w + 2)}|---|---|"]
    lines += [f"| {r[0].ljust(w)} | {r[1]} | {r[2]} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
