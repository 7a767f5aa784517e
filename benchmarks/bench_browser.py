"""Browser benchmark: MiniLM-L6 on WebGPU in headless Chromium through Pyodide, and the host-side
cost of replaying a recorded chain (per dispatch): our run path vs a plain-JS loop over the same
recorded pipelines/bind groups vs the same calls made one by one from Python.

    .venv/bin/python benchmarks/bench_browser.py [--out benchmarks/results/browser.md] [--runs 3]

Prints one table. On this CI-class machine the adapter is SwiftShader (CPU), so GPU times say
little about real GPUs; the host-side rows are the point there. onnxruntime-web is not measured
yet (see the table's last line).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "web"))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests" / "browser"))

PAGE = r"""
import js, time
from gpudelegate.web import demo
from gpudelegate.executor import HostTensor
resp = await js.fetch("programs/" + ARGS["file"])
buf = js.Uint8Array.new(await resp.arrayBuffer())
n = demo.head_size(buf.subarray(0, 64))
t = time.perf_counter()
await demo.load(ARGS["file"], buf.subarray(0, n), buf.subarray(n), buf.byteLength)
load = time.perf_counter() - t
s = demo._loaded["session"]; ex = s.executor
meta = s.program.metadata
B, T = int(meta["batch"]), int(meta["seq_len"])
ids = demo.int_tensor([[101] + [2000 + (i * 7 + j) % 5000 for j in range(T - 2)] + [102] for i in range(B)])
mask = demo.int_tensor([[1] * T for _ in range(B)])
feeds = {"ids": ids, "mask": mask}
await s.run_async("forward", feeds)  # first run: shader JIT
times = []
for _ in range(ARGS["runs"]):
    t = time.perf_counter(); await s.run_async("forward", feeds); times.append(time.perf_counter() - t)
# Host side, no GPU wait: encode (inputs + replay) and finish, many times.
p = next(iter(s.plan.payloads)); rec = ex.recorded[p]
xs = [ids, mask]
K = 20
t = time.perf_counter()
for _ in range(K):
    enc = ex._encode(p, xs); enc.finish()
ours = (time.perf_counter() - t) / K
# The same recorded chain, replayed by the JS loop alone (no inputs, no Python per dispatch).
t = time.perf_counter()
for _ in range(K):
    enc = ex.device.createCommandEncoder()
    for seg in rec.segments:
        cp = enc.beginComputePass(); ex._replay(cp, seg.js_list); cp.end()
    enc.finish()
js_loop = (time.perf_counter() - t) / K
# ... and by Python, three bridge calls per dispatch.
t = time.perf_counter()
for _ in range(K):
    enc = ex.device.createCommandEncoder()
    for seg in rec.segments:
        cp = enc.beginComputePass()
        for (pipe, bg, x, y, z, _op, _n) in seg.launches:
            cp.setPipeline(pipe); cp.setBindGroup(0, bg); cp.dispatchWorkgroups(x, y, z)
        cp.end()
    enc.finish()
py_loop = (time.perf_counter() - t) / K
demo.close()
{"load": load, "runs": times, "dispatches": rec.dispatch_count, "ours": ours, "js": js_loop, "py": py_loop,
 "adapter": ex.ctx.info()}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--shapes", default="1x128,8x128", help="MiniLM batch x seq_len list")
    a = ap.parse_args(argv)

    import build as web_build
    import minilm as minilm_example
    from conftest import CHROMIUM, WEBGPU_ARGS
    from playwright.sync_api import sync_playwright
    from serve import BundleServer

    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        progs = tmp / "programs_src"
        progs.mkdir()
        for b, t in shapes:
            minilm_example.export(progs / f"minilm-{b}x{t}.gdp", batch=b, seq_len=t)
        dist = web_build.build_dist(tmp / "dist", programs=progs)
        with BundleServer(dist) as url, sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=WEBGPU_ARGS, headless=True)
            page = browser.new_page()
            page.set_default_timeout(1_800_000)
            page.goto(url + "harness.html")
            page.wait_for_function("window.harness !== undefined")
            page.evaluate("() => window.harness.ready")
            info = None
            for b, t in shapes:
                r = page.evaluate("([c, a]) => window.harness.run(c, a)",
                                  [PAGE, {"file": f"minilm-{b}x{t}.gdp", "runs": a.runs}])
                info = r["adapter"]
                best = min(r["runs"])
                d = r["dispatches"]
                rows.append((f"MiniLM-L6 {b}x{t} run (best of {a.runs})", f"{best * 1e3:.0f} ms", f"load {r['load']:.1f} s"))
                rows.append((f"  host: our encode per dispatch ({d} dispatches)", f"{r['ours'] / d * 1e6:.1f} us", "inputs + JS replay"))
                rows.append(("  host: plain-JS loop per dispatch", f"{r['js'] / d * 1e6:.1f} us", "same recorded plan"))
                rows.append(("  host: Python loop per dispatch", f"{r['py'] / d * 1e6:.1f} us", "3 bridge calls each"))
            browser.close()
    rows.append(("onnxruntime-web WebGPU EP", "not measured", "npm onnxruntime-web + ONNX export: not done yet"))
    head = f"Browser (Chromium 156 headless, adapter {info.get('vendor')}/{info.get('architecture')}), {datetime.date.today()}"
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
