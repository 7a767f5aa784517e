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

# The chain repeated k times in one run (k = 1, 2, 4, ..., 32): ours replays the recorded passes k
# times over in one JS call; the plain JS encodes the same dispatches in the same passes. The design,
# fixed before any ratio was looked at (the old 1/2/4/8 x min-of-7 fit was noise: points far off a
# line):
# - every timed batch holds about the same number of dispatches (``D``: n = D / (k * dispatches)
#   runs, rounded, at least 1), long enough that the page's 5 us timer steps are ~1% of it, short enough
#   that the GPU process keeps up (a batch of ~20,000 dispatches made the page wait for it);
# - before every batch the page waits for ``queue.onSubmittedWorkDone()``: its answer comes back
#   after the GPU process has worked through every command sent before it, so no batch starts
#   behind another's backlog (encode_only submits nothing, so this waits for no GPU work);
# - every round times every side at every k, sides interleaved (their order alternates between
#   rounds, and the ks go up in one round and down in the next), so drifts hit all alike;
# - each round gets its own least-squares line per side; the summary is the median over rounds of
#   slope and intercept with their spread, and the median of the per-round ours/JS slope ratios.
# Besides ours and the plain loop (both writing the inputs), three without inputs: the adapter's
# replay function from Python (one bridge call a run) and from a JS loop, and the plain loop.
SLOPE_PAGE = r"""
import js, time
from gpudelegate.web import demo
from gpudelegate.web.webgpu import to_js, _Chain, UPLOAD_PIECE
s = demo._loaded["session"]; ex = s.executor; dev = ex.device
xs = [demo.int_tensor(ARGS["ids"]), demo.int_tensor(ARGS["mask"])]
p = next(iter(s.plan.payloads)); rec = ex.recorded[p]; pp = s.plan.payloads[p]
D, R = int(ARGS.get("D", 3072)), int(ARGS.get("rounds", 9))
REPS = list(ARGS.get("reps", [1, 2, 4, 8, 16, 32]))
passes = []
for st in rec.nodes:
    if st.copies or not passes:
        passes.append(([v for c in st.copies for v in (c.src, c.src_offset, c.dst, c.dst_offset, c.size)], []))
    passes[-1][1].extend(v for L in st.launches for v in (L.pipeline, L.bind_group, *L.workgroups))
rep = js.Function.new("a", "k", "let o = []; for (let i = 0; i < k; i++) o = o.concat(a); return o;")
ins = to_js([v for ref, x in zip(pp.inputs, xs) for v in (ex.buffer_of(p, ref.buf), ref.buf.offset, to_js(memoryview(x.data)))])
plain = js.Function.new("device", "queue", "segs", "ins", "K", "withInputs", PLAIN_JS)
replay_loop = js.Function.new("f", "device", "queue", "P", "cmds", "e", "K",
    "const t0 = performance.now(); for (let k = 0; k < K; k++) f(device, queue, P, cmds, e, e, e, null, false); "
    "return (performance.now() - t0) / 1000 / K;")
none = dev._empty
d = rec.dispatch_count

def timed(f, n):
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n

async def drain():
    await dev.queue.onSubmittedWorkDone()

sides = {}
for k in REPS:
    chain = _Chain(rec.chain.steps, rep(rec.chain.cmds, k))
    segs = to_js([[c, l] for c, l in passes] * k)
    n = max(1, round(D / (k * d)))

    def ours(chain=chain):
        _, io = ex._io(p, xs, True, [])
        dev.encode_only(chain, io)

    def replay_py(chain=chain):
        dev._run_js(dev.device, dev.queue, UPLOAD_PIECE, chain.cmds, none, none, none, None, False)

    sides[k] = {
        "ours": lambda n=n, f=ours: timed(f, n),
        "js": lambda n=n, segs=segs: plain(dev.device, dev.queue, segs, ins, n, True),
        "replay_py": lambda n=n, f=replay_py: timed(f, n),
        "replay_js": lambda n=n, chain=chain: replay_loop(dev._run_js, dev.device, dev.queue, UPLOAD_PIECE, chain.cmds, none, n),
        "js_no_inputs": lambda n=n, segs=segs: plain(dev.device, dev.queue, segs, ins, n, False),
    }
    ours(); sides[k]["js"](); sides[k]["replay_py"]()  # first calls (bound closures, JIT) untimed
NAMES = ["ours", "js", "replay_py", "replay_js", "js_no_inputs"]
out = {"dispatches": d, "segments": len(passes), "reps": REPS, "D": D, "rounds": R,
       "runs_per_batch": {str(k): max(1, round(D / (k * d))) for k in REPS}, **{nm: {str(k): [] for k in REPS} for nm in NAMES}}
for r in range(R):
    order = NAMES if r % 2 == 0 else ["js", "ours"] + NAMES[2:]
    for k in (REPS if r % 2 == 0 else REPS[::-1]):
        for nm in order:
            await drain()
            out[nm][str(k)].append(sides[k][nm]())
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


SLOPE_SIDES = ("ours", "js", "replay_py", "replay_js", "js_no_inputs")


def _spread(vals: List[float]) -> dict:
    v = sorted(vals)
    return {"median": statistics.median(v), "min": v[0], "max": v[-1],
            "q1": v[len(v) // 4], "q3": v[(3 * len(v)) // 4]}


def slope_summary(sl: dict) -> dict:
    """Per side: each round's least-squares line over the reps (time per run against dispatches per
    run), as {"slope", "intercept", "whole"}: the median over rounds with min, max and quartiles of
    the slope (s per dispatch), the intercept (s per run) and the smallest k's run time per dispatch;
    "ratio" and "whole_ratio": the per-round ours/JS ratios of slope and of that run time alike."""
    reps, d, k0 = sl["reps"], sl["dispatches"], str(sl["reps"][0])
    xs = [int(k) * d for k in reps]
    out, lines = {}, {}
    for side in SLOPE_SIDES:
        if sl.get(side):
            lines[side] = [fit(xs, [sl[side][str(k)][r] for k in reps]) for r in range(sl["rounds"])]
            out[side] = {"slope": _spread([b for _, b in lines[side]]), "intercept": _spread([a for a, _ in lines[side]]),
                         "whole": _spread([t / (int(k0) * d) for t in sl[side][k0]])}
    if "ours" in lines and "js" in lines:
        out["ratio"] = _spread([o[1] / j[1] for o, j in zip(lines["ours"], lines["js"]) if j[1] > 0])
        out["whole_ratio"] = _spread([o / j for o, j in zip(sl["ours"][k0], sl["js"][k0]) if j > 0])
    return out


def _med(x: dict, scale: float = 1e6, unit: str = " us") -> str:
    return f"{x['median'] * scale:.2f}{unit} ({x['q1'] * scale:.2f}..{x['q3'] * scale:.2f})"


def slope_rows(what: str, sl: dict, goal: float = 1.3) -> list:
    """(what, value, note) rows of one SLOPE_PAGE result: the slope, the intercept and the whole
    run's time per dispatch, ours against plain JS, each the median over rounds (quartiles)."""
    f = slope_summary(sl)
    o, j, r, wr = f["ours"], f["js"], f["ratio"], f["whole_ratio"]
    how = (f"median over {sl['rounds']} rounds of a least-squares line each (quartiles), the chain replayed "
           f"{'/'.join(map(str, sl['reps']))} times in a run, {sl['dispatches']} dispatches each, ~{sl['D']} "
           f"dispatches a timed batch, ours and JS interleaved, the GPU process drained before each batch")
    noin = ""
    if all(s in f for s in ("replay_py", "replay_js", "js_no_inputs")):
        noin = (f"; without inputs, the adapter's replay from Python / from a JS loop / the plain loop: "
                f"{_med(f['replay_py']['slope'])} / {_med(f['replay_js']['slope'])} / {_med(f['js_no_inputs']['slope'])} a dispatch, "
                f"{_med(f['replay_py']['intercept'])} / {_med(f['replay_js']['intercept'])} / "
                f"{_med(f['js_no_inputs']['intercept'])} fixed")
    pts = ", ".join(f"x{k}: {statistics.median(sl['ours'][str(k)]) * 1e6:.1f} / {statistics.median(sl['js'][str(k)]) * 1e6:.1f}"
                    for k in sl["reps"])
    return [
        (f"host, {what}: marginal time per dispatch (slope), ours / plain JS",
         f"{_med(o['slope'])} / {_med(j['slope'])}; ours/JS {_med(r, 1, 'x')}",
         f"goal <= {goal}x: {'met' if r['median'] <= goal else 'NOT met'}; {how}{noin}"),
        (f"host, {what}: fixed time per run (intercept), ours / plain JS",
         f"{_med(o['intercept'])} / {_med(j['intercept'])}",
         f"median run time per k, ours / JS (us): {pts}"),
        (f"host, {what}: whole run's time per dispatch (x{sl['reps'][0]}), ours / plain JS",
         f"{_med(o['whole'])} / {_med(j['whole'])}; ours/JS {_med(wr, 1, 'x')}",
         f"the same batches as the x{sl['reps'][0]} points of the fit"),
    ]


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
        out += slope_rows(f"MiniLM {key}", sl)
    cl = res.get("clocks") or {}
    if cl.get("steps"):
        out.append(("GPU clocks while the pages ran (nvidia-smi every 50 ms, read only)",
                    "; ".join(f"{n}: SM {v['sm_median']:.0f} MHz (min {v['sm_min']:.0f}) {'/'.join(v['pstates'])} "
                              f"util {v['util_mean']:.0f}%" for n, v in cl["steps"].items()),
                    cl.get("static", "").replace("\n", " ; ")))
    return out
