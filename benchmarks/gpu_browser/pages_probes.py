"""Where MiniLM's GPU time in Chromium goes, and the host time per dispatch apart from a run's fixed
cost (issue 18): the probes pages_chromium.py adds to its pages.

- ``LIMITS_PAGE``: every limit of the page's adapter and device, the adapter's info (subgroup sizes
  included) and features, what the planner and the lowering got from them (DeviceLimits, the
  measured subgroup size, the default Tuning), for comparison with desktop Dawn's in the same call.
- ``kernel_choices``: the kernel each recorded step runs (shader, entry, pipeline constants,
  workgroups), written once and run both in the page (``KERNELS_PAGE``) and in CPython on the
  desktop sessions, so ``compare_kernels`` shows whether the browser lowered anything differently.
- ``SLOPE_PAGE``: the host time of one run's encoding with the recorded chain replayed 1, 2, 4 and 8
  times over in the same run, ours (the executor's inputs + the adapter's one JS call) and the plain
  JS loop: the slope of a least-squares line is the marginal host time per dispatch, its intercept
  the fixed cost of a run (inputs, the bridge call, encoder creation and finish).
- ``Clocks``: the GPU's SM clock, P-state and utilization sampled by ``nvidia-smi`` (read only) while
  the pages run, summarized per step, so a slow step can be told apart from a slow clock.
- ``variant_flags``: Chromium's flags with extra Dawn toggles, for the same MiniLM pages in a second
  browser (``--enable-webgpu-developer-features``: timestamps not rounded; ``disable_robustness``:
  Tint's bounds checks off) to measure what each costs in the browser itself.
"""

from __future__ import annotations

import datetime
import inspect
import shutil
import statistics
import subprocess
import time
from typing import Dict, List, Optional


def kernel_choices(ex) -> list:
    """[payload, node, op, [[shader, entry, constants, workgroups], ...]] for each recorded step with
    a launch (runs in Pyodide and CPython alike: the executor and the device caches are shared)."""
    key_of = {id(p): k for k, p in ex.device._pipelines.items()}
    out = []
    for p in sorted(ex.recorded):
        for st in ex.recorded[p].nodes:
            if not st.launches:
                continue
            calls = []
            for L in st.launches:
                k = key_of.get(id(L.pipeline))
                calls.append([k[0], k[1], repr(k[2]), list(L.workgroups)] if k else [L.entry, "?", "", list(L.workgroups)])
            out.append([p, st.node, st.op, calls])
    return out


KERNELS_PAGE = inspect.getsource(kernel_choices) + r"""
from gpudelegate.web import demo
ex = demo._loaded["session"].executor
{"kernels": kernel_choices(ex), "subgroup_size": ex.device.subgroup_size(), "tuning": repr(ex.tuning)}
"""

LIMITS_PAGE = r"""
import js, json
from gpudelegate.web import demo, webgpu
st = await webgpu.init()
ctx = demo.environment().context("webgpu")
dump = js.Function.new("o", "const r = {}; for (const k in o) { const v = o[k]; "
                       "if (['number', 'string', 'boolean'].includes(typeof v)) r[k] = v; } return JSON.stringify(r);")
{"adapter_limits": json.loads(dump(st.adapter.limits)), "device_limits": json.loads(dump(st.device.limits)),
 "adapter_info": json.loads(dump(st.adapter.info)),
 "adapter_features": sorted(json.loads(js.JSON.stringify(js.Array.from_(st.adapter.features)))),
 "device_features": sorted(json.loads(js.JSON.stringify(js.Array.from_(st.device.features)))),
 "planner_limits": dict(ctx.limits.__dict__), "subgroup_size": ctx.subgroup_size(),
 "default_tuning": repr(getattr(ctx, "default_tuning", None)),
 "subgroup_matrix_configs": len(ctx.subgroup_matrix_configs), "user_agent": str(js.navigator.userAgent)}
"""

# The chain repeated k times: ours replays the recorded passes k times over in one JS call; the
# plain JS encodes the same dispatches in the same passes. Everything else as in HOST_PAGE, with
# K // k runs per timed batch.
SLOPE_PAGE = r"""
import asyncio, js, time
from gpudelegate.web import demo
from gpudelegate.web.webgpu import to_js, _Chain, UPLOAD_PIECE
s = demo._loaded["session"]; ex = s.executor; dev = ex.device
xs = [demo.int_tensor(ARGS["ids"]), demo.int_tensor(ARGS["mask"])]
p = next(iter(s.plan.payloads)); rec = ex.recorded[p]; pp = s.plan.payloads[p]
K, R, REPS = int(ARGS.get("K", 48)), int(ARGS.get("rounds", 7)), list(ARGS.get("reps", [1, 2, 4, 8]))
passes = []
for st in rec.nodes:
    if st.copies or not passes:
        passes.append(([v for c in st.copies for v in (c.src, c.src_offset, c.dst, c.dst_offset, c.size)], []))
    passes[-1][1].extend(v for L in st.launches for v in (L.pipeline, L.bind_group, *L.workgroups))
rep = js.Function.new("a", "k", "let o = []; for (let i = 0; i < k; i++) o = o.concat(a); return o;")
ins = to_js([v for ref, x in zip(pp.inputs, xs) for v in (ex.buffer_of(p, ref.buf), ref.buf.offset, to_js(memoryview(x.data)))])
plain = js.Function.new("device", "queue", "segs", "ins", "K", "withInputs", PLAIN_JS)
# the adapter's replay function alone (no inputs), called K times from a JS loop: its own cost per
# dispatch against the plain loop's, without the bridge
replay_loop = js.Function.new("f", "device", "queue", "P", "cmds", "e", "K",
    "const t0 = performance.now(); for (let k = 0; k < K; k++) f(device, queue, P, cmds, e, e, e, null, false); "
    "return (performance.now() - t0) / 1000 / K;")
none = dev._empty

def timed(f, n):
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n

out = {"dispatches": rec.dispatch_count, "segments": len(passes), "reps": REPS, "ours": {}, "js": {},
       "replay_js": {}, "replay_py": {}, "js_no_inputs": {}}
for k in REPS:
    chain = _Chain(rec.chain.steps, rep(rec.chain.cmds, k))
    segs = to_js([[c, l] for c, l in passes] * k)

    def ours():
        _, io = ex._io(p, xs, True, [])
        dev.encode_only(chain, io)

    # The same number of dispatches per timed batch for every k: a batch encodes faster than
    # the GPU process decodes it, and past some backlog the page waits for it (measured here as
    # times growing faster than k), which is the GPU process's rate, not the page's host cost.
    n = max(4, K // k)
    ours(); plain(dev.device, dev.queue, segs, ins, n, True)
    t_o, t_j, t_r, t_p, t_n = [], [], [], [], []

    def replay_py():  # the same replay function, called from Python (one bridge call a run)
        dev._run_js(dev.device, dev.queue, UPLOAD_PIECE, chain.cmds, none, none, none, None, False)

    for _ in range(R):
        await asyncio.sleep(0.03); t_o.append(timed(ours, n))
        await asyncio.sleep(0.03); t_j.append(plain(dev.device, dev.queue, segs, ins, n, True))
        await asyncio.sleep(0.03); t_r.append(replay_loop(dev._run_js, dev.device, dev.queue, UPLOAD_PIECE, chain.cmds, none, n))
        await asyncio.sleep(0.03); t_p.append(timed(replay_py, n))
        await asyncio.sleep(0.03); t_n.append(plain(dev.device, dev.queue, segs, ins, n, False))
    out["ours"][str(k)], out["js"][str(k)] = sorted(t_o), sorted(t_j)
    out["replay_js"][str(k)], out["js_no_inputs"][str(k)] = sorted(t_r), sorted(t_n)
    out["replay_py"][str(k)] = sorted(t_p)
out
"""


def slope_page(plain_js: str) -> str:
    return SLOPE_PAGE.replace("PLAIN_JS", repr(plain_js))


def fit(xs: List[float], ys: List[float]):
    """Least-squares line y = a + b x: (intercept a, slope b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def slope_summary(sl: dict) -> dict:
    """Per side: intercept (fixed per run, s) and slope (s per dispatch) of the per-k minima."""
    xs = [int(k) * sl["dispatches"] for k in sl["reps"]]
    out = {}
    for side in ("ours", "js", "replay_js", "replay_py", "js_no_inputs"):
        if sl.get(side):
            out[side] = fit(xs, [sl[side][str(k)][0] for k in sl["reps"]])
    return out


def compare_kernels(a: list, b: list) -> dict:
    """Steps whose kernels (shader, entry, constants, workgroups) differ between two sessions of the
    same program; steps matched by (payload, node)."""
    bm = {(s[0], s[1]): s for s in b}
    diffs, same = [], 0
    for s in a:
        t = bm.get((s[0], s[1]))
        if t is not None and t[3] == s[3]:
            same += 1
        else:
            diffs.append({"node": s[1], "op": s[2], "a": s[3], "b": t[3] if t else None})
    return {"steps": len(a), "same": same, "diffs": diffs}


def variant_flags(flags: List[str], enable=(), extra=()) -> List[str]:
    """``flags`` with Dawn toggles ``enable`` added to its ``--enable-dawn-features`` and ``extra``
    flags appended."""
    out = []
    for f in flags:
        if f.startswith("--enable-dawn-features=") and enable:
            f = f + "," + ",".join(enable)
        out.append(f)
    return out + list(extra)


# The variants of the second browser: name, Dawn toggles added, other flags added.
VARIANTS = (
    ("timestamps exact", (), ("--enable-webgpu-developer-features",)),
    ("timestamps exact, disable_robustness", ("disable_robustness",), ("--enable-webgpu-developer-features",)),
    # robustness on, but storage-buffer bounds left to the driver's robustBufferAccess2 (Tint then
    # clamps only workgroup arrays and the rest): whether the storage clamps are the cost
    ("timestamps exact, vulkan_use_buffer_robust_access_2", ("vulkan_use_buffer_robust_access_2",),
     ("--enable-webgpu-developer-features",)),
)


class Clocks:
    """nvidia-smi's samples every ``period_ms`` in a file while the pages run (query only: nothing on
    the GPU is set), and named marks in this process; ``summary()`` gives each step between two marks
    its median and minimum SM clock, P-states and mean utilization. Nothing where nvidia-smi is
    missing."""

    FIELDS = "timestamp,clocks.sm,clocks.mem,pstate,utilization.gpu,power.draw"

    def __init__(self, path, period_ms: int = 50):
        self.path, self.proc, self.marks = path, None, []
        self.static = ""
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        try:
            self.static = subprocess.run([exe, "--query-gpu=clocks.max.sm,clocks.max.mem,clocks_event_reasons.active,"
                                          "persistence_mode,compute_mode", "--format=csv"],
                                         capture_output=True, text=True, timeout=20).stdout.strip()
            self._fh = open(path, "w")
            self.proc = subprocess.Popen([exe, f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
                                          f"-lms={period_ms}"], stdout=self._fh, stderr=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            self.proc = None

    def mark(self, name: str) -> None:
        self.marks.append((name, time.time()))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self._fh.close()
            self.proc = None

    def samples(self) -> list:
        rows = []
        try:
            lines = open(self.path).read().splitlines()
        except OSError:
            return rows
        for line in lines:
            f = [x.strip() for x in line.split(",")]
            try:
                t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append((t, float(f[1]), float(f[2]), f[3], float(f[4])))
            except (ValueError, IndexError):
                continue
        return rows

    def summary(self) -> Dict[str, dict]:
        s = self.samples()
        out = {}
        for (name, t0), (_, t1) in zip(self.marks, self.marks[1:] + [("end", time.time())]):
            got = [r for r in s if t0 <= r[0] < t1]
            if got:
                sm = sorted(r[1] for r in got)
                out[name] = {"samples": len(got), "sm_median": statistics.median(sm), "sm_min": sm[0], "sm_max": sm[-1],
                             "pstates": sorted({r[3] for r in got}), "util_mean": statistics.fmean(r[4] for r in got)}
        return out


def _us(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e6:.2f} us"


def _ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.2f} ms"


KEY_LIMITS = ("maxComputeWorkgroupStorageSize", "maxStorageBuffersPerShaderStage", "maxStorageBufferBindingSize",
              "maxBufferSize", "minStorageBufferOffsetAlignment", "minUniformBufferOffsetAlignment",
              "maxComputeInvocationsPerWorkgroup", "maxComputeWorkgroupSizeX", "maxComputeWorkgroupsPerDimension")


def rows(res: dict) -> list:
    """(what, value, note) rows of the probes in ``res`` (pages_chromium.run's results)."""
    out = []
    lim = res.get("limits") or {}
    if lim:
        dl, al = lim.get("device_limits") or {}, lim.get("adapter_limits") or {}
        dd = (res.get("desktop_dawn") or {}).get("info", {}).get("limits_raw") or {}
        parts = []
        for k in KEY_LIMITS:
            snake = "".join("-" + c.lower() if c.isupper() else c for c in k)
            parts.append(f"{k} {dl.get(k)} (adapter {al.get(k)}{', desktop Dawn ' + str(dd.get(snake)) if dd else ''})")
        info = lim.get("adapter_info") or {}
        out.append(("the page's device limits (its adapter's; desktop Dawn's device, same GPU)", "; ".join(parts),
                    f"subgroups {info.get('subgroupMinSize')}..{info.get('subgroupMaxSize')}, measured "
                    f"{lim.get('subgroup_size')}; features {', '.join(lim.get('device_features') or [])}; "
                    f"planner {lim.get('planner_limits')}; default tuning {lim.get('default_tuning')}"))
    for key in res.get("shapes", []):
        k = (res.get("kernels") or {}).get(key) or {}
        for other in ("desktop wgpu", "desktop Dawn"):
            c = k.get(other)
            if c:
                d = c["diffs"][:3]
                out.append((f"kernels, MiniLM {key}: the page vs {other} (shader, entry, constants, workgroups)",
                            f"{c['same']}/{c['steps']} steps the same",
                            "; ".join(f"node {x['node']} {x['op']}: {x['a']} vs {x['b']}" for x in d) or "no difference"))
    for key in res.get("shapes", []):
        g = res["gpu"].get(key)
        if not g:
            continue
        cols = [("Chromium", g)]
        for name, v in (res.get("variants") or {}).items():
            if (v.get("gpu") or {}).get(key):
                cols.append((f"Chromium, {name}", v["gpu"][key]))
        for name in ("desktop", "desktop_dawn"):
            d = (res.get(name) or {}).get(key)
            if d and d.get("ops"):
                cols.append(({"desktop": "desktop wgpu", "desktop_dawn": "desktop Dawn"}[name], {"gpu": d["gpu"], "ops": d["ops"]}))
        ops = sorted(g["ops"], key=lambda o: -g["ops"][o])[:5]
        out.append((f"GPU time by op, MiniLM {key} (best of 4 profiled runs): " + " / ".join(c[0] for c in cols),
                    " / ".join(_ms(c[1]["gpu"]) for c in cols),
                    "; ".join(f"{o} " + " / ".join(_ms((c[1]["ops"] or {}).get(o)) for c in cols) for o in ops)))
    for name, v in (res.get("variants") or {}).items():
        for key in res.get("shapes", []):
            r = (v.get("ours") or {}).get(key)
            o = res["ours"].get(key)
            if r and o:
                out.append((f"MiniLM {key} in Chromium, {name}: best (median) of {len(r['runs'])} runs",
                            f"{_ms(min(r['runs']))} ({_ms(statistics.median(r['runs']))})",
                            f"the main browser: {_ms(min(o['runs']))} ({_ms(statistics.median(o['runs']))})"))
    for key, sl in (res.get("slope") or {}).items():
        f = slope_summary(sl)
        (ao, bo), (aj, bj) = f["ours"], f["js"]
        pts = ", ".join(f"x{k}: {sl['ours'][str(k)][0] * 1e6:.1f} / {sl['js'][str(k)][0] * 1e6:.1f} us" for k in sl["reps"])
        out.append((f"host, MiniLM {key}: marginal time per dispatch, ours / plain JS (slope over the chain "
                    f"replayed {'/'.join(map(str, sl['reps']))} times, {sl['dispatches']} dispatches each)",
                    f"{_us(bo)} / {_us(bj)} ({bo / bj:.2f}x; goal <= 1.3x)" if bj > 0 else f"{_us(bo)} / {_us(bj)}",
                    f"fixed per run (intercept) ours {_us(ao)} / JS {_us(aj)}; min of 7 rounds of 48 // k runs, ours / JS: {pts}"
                    + (f"; without inputs, the adapter's replay from a JS loop / from Python / the plain loop: "
                       f"{_us(f['replay_js'][1])} / {_us(f['replay_py'][1])} / {_us(f['js_no_inputs'][1])} a dispatch, "
                       f"{_us(f['replay_js'][0])} / {_us(f['replay_py'][0])} / {_us(f['js_no_inputs'][0])} fixed"
                       if "replay_js" in f and "replay_py" in f and "js_no_inputs" in f else "")))
    cl = res.get("clocks") or {}
    if cl.get("steps"):
        out.append(("GPU clocks while the pages ran (nvidia-smi every 50 ms, read only)",
                    "; ".join(f"{n}: SM {v['sm_median']:.0f} MHz (min {v['sm_min']:.0f}) {'/'.join(v['pstates'])} "
                              f"util {v['util_mean']:.0f}%" for n, v in cl["steps"].items()),
                    cl.get("static", "").replace("\n", " ; ")))
    return out
