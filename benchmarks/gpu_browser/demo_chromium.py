"""The demo page (web/app) in a real headless Chromium, WebGPU on the machine's GPU: the 4-bit
SmolLM2 chat answers, its greedy tokens are checked against the reference executor on the same
program and prompt, a screenshot is taken, a longer answer times the decode; then a MiniLM ranking,
checked the same way. Driven with Playwright as tests/browser/test_models_browser.py drives it (the
bundle served from 127.0.0.1, a 1100x900 viewport).

    bash benchmarks/gpu_browser/chromium_gpu.sh run         (the GPU machine: runs this with --carried)
    .venv/bin/python benchmarks/gpu_browser/demo_chromium.py --small --allow-software --out OUT   (here)

``--carried DIR``: what ``chromium_carry.py unpack`` extracted (the headless shell, the libraries
this machine lacks, fonts, Node for Playwright's driver, Playwright, the bundle's pyodide/ folder,
the tokenizers, carried programs); without it, Chromium is ``--chromium`` and the bundle is built
here (web/build.py). SmolLM2 is the carried demo program when there is one (``pack --program``),
else one built here with torch: SmolLM2-135M's architecture and tokenizer, the demo's shapes
(256-token context, 32-token prefill chunks) and seeded random weights (bench_decode.random_model:
N(0, 0.02) quantized to the GGUF's Q4_1/Q8_0 blocks), which answer with a repeated token. MiniLM
is always built here that way (the real one is another 90 MB), for the demo's [8, 32] inputs.

The page's own prefill and decode figures are recorded as shown; beside them, when each token
reached the screen (a MutationObserver in the page), which gives the time to the first token and
the decode rate a user sees.

Chromium is tried with each flag set of ``--flag-sets`` in turn until the page's adapter is not a
software one (unless ``--allow-software``); every attempt's adapter (or error) is recorded.
Chromium's own log (``--enable-logging=stderr``, through Playwright's ``DEBUG=pw:browser``) goes to
this script's stderr. Writes OUT/result.json, OUT/report.md and OUT/demo-smollm2-4bit-chat.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (ROOT / "benchmarks", ROOT / "web", ROOT / "examples", HERE):
    sys.path.insert(0, str(p))

import chromium_carry  # noqa: E402  benchmarks/gpu_browser/chromium_carry.py

SMOLLM2 = "smollm2-random-gguf.gdp"
MINILM = "minilm-random.gdp"
SCREENSHOT = "demo-smollm2-4bit-chat.png"
# Playwright passes --enable-features with these; a second --enable-features replaces the first,
# so ours repeats them.
PLAYWRIGHT_FEATURES = ("CDPScreenshotNewSurface", "SkipListAccountsWithoutGaiaCookies")
COMMON_FLAGS = ["--enable-unsafe-webgpu", "--ignore-gpu-blocklist", "--disable-gpu-sandbox",
                "--enable-dawn-features=allow_unsafe_apis,vulkan_enable_f16_on_nvidia",
                "--disable-quic", "--enable-logging=stderr", "--v=0"]
# Tried in this order; the first whose adapter is a GPU runs the demo. "vulkan": Dawn and ANGLE
# both on Vulkan (the headless-GPU recipe of Chrome's developer blog, with --disable-vulkan-surface:
# no display); "vulkan-gl-swiftshader": WebGPU on Vulkan, GL (compositing) on SwiftShader;
# "default": Chromium's own choice.
FLAG_SETS = {
    "vulkan": ["--enable-features=Vulkan," + ",".join(PLAYWRIGHT_FEATURES), "--use-vulkan", "--use-angle=vulkan",
               "--disable-vulkan-surface"],
    "vulkan-gl-swiftshader": ["--enable-features=Vulkan," + ",".join(PLAYWRIGHT_FEATURES), "--use-angle=swiftshader"],
    "default": [],
}
MINILM_QUERY = "How do I get to the train station?"


def log(*a) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


# ============================================================================ programs (torch)

def smollm2_program(path: Path, tokenizer: dict, small: bool) -> Path:
    """SmolLM2-135M's architecture and tokenizer, seeded random weights as 4-bit GGUF blocks, the
    demo's metadata (llm layout, tokenizer with its chat template, weights_dtype "gguf")."""
    import torch

    import bench_decode  # benchmarks/bench_decode.py: random_model
    from gpudelegate.export.frontend import export_method
    from gpudelegate.export.models import smollm2
    from gpudelegate.export.writer import export_program
    from gpudelegate.text.bpe import BPETokenizer

    tok = BPETokenizer.from_metadata(tokenizer)
    # The demo's program: 256-token context in 32-token chunks. --small: 2 layers (SwiftShader).
    cfg = smollm2.SmolLM2Config(vocab_size=tok.vocab_size, max_context=256, prefill_chunk=32,
                                **({"layers": 2} if small else {}))
    model, packed = bench_decode.random_model(cfg)
    names = smollm2.cache_names(cfg)
    meta = {**smollm2.llm_metadata(cfg, tok), "weights_dtype": "gguf",
            "model": f"SmolLM2-135M-Instruct architecture{' (2 layers)' if small else ''}, seeded random weights"}
    with torch.no_grad():
        methods = {"prefill": export_method(smollm2.Prefill(model), smollm2.example_inputs(cfg, "prefill")),
                   "decode": export_method(smollm2.Decode(model), smollm2.example_inputs(cfg, "decode"))}
        export_program(methods, path=path, weights_dtype="float32", packed_weights=packed, progress=False,
                       metadata=meta, input_names={"prefill": ["ids", "pos", "last", *names], "decode": ["ids", "pos", *names]},
                       output_names={m: ["logits", *names] for m in methods})
    return path


def minilm_program(path: Path, tokenizer: dict, small: bool) -> Path:
    """all-MiniLM-L6-v2's architecture and WordPiece tokenizer, the module's own init after
    torch.manual_seed(0), for the demo's [8, 32] inputs."""
    import torch

    from gpudelegate.export.models import minilm
    from gpudelegate.export.writer import export_program

    cfg = minilm.MiniLMConfig(layers=2) if small else minilm.MiniLMConfig()
    torch.manual_seed(0)
    model = minilm.MiniLM(cfg).eval()
    meta = {"model": f"all-MiniLM-L6-v2 architecture{' (2 layers)' if small else ''}, seeded random weights",
            "task": "sentence-embedding", "batch": 8, "seq_len": 32, "tokenizer": tokenizer}
    with torch.no_grad():
        export_program(model, minilm.example_inputs(8, 32), path=path, progress=False, metadata=meta,
                       input_names=["ids", "mask"], output_names=["embedding"])
    return path


def bundle(dist: Path, programs, pyodide: Path = None) -> Path:
    """The demo bundle: web/build.py's, or (GPU machine: no wheel downloads there) this tree's
    web/app with the carried pyodide/ folder (interpreter + wheelhouse built by the pack)."""
    import build as web_build  # web/build.py

    if pyodide is None:
        web_build.build_dist(dist, programs=None)
    else:
        shutil.copytree(ROOT / "web" / "app", dist, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(pyodide, dist / "pyodide", dirs_exist_ok=True)
        refresh_our_wheel(dist / "pyodide")
    web_build.copy_programs(dist, programs)
    return dist


def refresh_our_wheel(wheelhouse: Path) -> None:
    """The carried wheelhouse holds the gpudelegate wheel of the tree it was packed from: build
    this tree's (pure Python, no download) in its place and give the lock its file name and
    sha256 (Pyodide checks it), so the page runs the code beside web/app's."""
    import hashlib

    import build as web_build  # web/build.py

    lock_path = wheelhouse / "pyodide-lock.json"
    lock = json.loads(lock_path.read_text())
    entry = lock["packages"]["gpudelegate"]
    (wheelhouse / entry["file_name"]).unlink(missing_ok=True)
    whl = web_build.build_our_wheel(wheelhouse)
    entry["file_name"], entry["sha256"] = whl.name, hashlib.sha256(whl.read_bytes()).hexdigest()
    lock_path.write_text(json.dumps(lock, indent=1, sort_keys=True))
    log(f"the page's gpudelegate wheel: {whl.name}, built from this tree")


# ============================================================================ the page

def is_software(adapter: dict) -> bool:
    return bool(adapter.get("software")) or "swiftshader" in json.dumps(adapter).lower()


def open_demo(browser, url: str, boot_s: float, timeout_s: float):
    """A 1100x900 page on the demo, booted (body[data-ready]) or failed (#fatal) within ``boot_s``
    (a GPU process that cannot composite leaves the page unpainted: no answer at all): (context,
    page, adapter dict or None, error text or None); later steps may take ``timeout_s`` each."""
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    page = context.new_page()
    page.on("console", lambda m: m.type in ("error", "warning") and log(f"page console {m.type}: {m.text}"))
    page.set_default_timeout(boot_s * 1000)
    page.goto(url + "index.html")
    page.wait_for_selector("body[data-ready='1'], #fatal:not([hidden])")
    page.set_default_timeout(timeout_s * 1000)
    if page.is_visible("#fatal"):
        return context, page, None, page.inner_text("#fatal")
    return context, page, json.loads(page.get_attribute("#adapter", "title")), None


def _text(page, sel: str) -> str:
    return page.inner_text(sel).strip()


def generate(page, n: int) -> dict:
    """One chat answer of at most ``n`` tokens: the page's ids, text and stats, and when each
    token reached the screen (a MutationObserver on the answer's text: the worker posts each
    token as it is picked, and the page appends it), from the click on Generate."""
    page.fill("#max-tokens", str(n))
    page.evaluate("""() => {
      const out = document.getElementById("chat-output");
      delete out.dataset.ids;
      window.__stamps = [];
      window.__clicked = performance.now();
      // app.js empties #chat-output, then appends "you: ...", the answer's span and a cursor; each
      // token sets the answer span's textContent (a childList mutation of that span).
      window.__obs = new MutationObserver((records) => {
        const t = performance.now();
        for (const r of records)
          if (r.type === "childList" && r.target.parentNode === out && !r.target.classList.length) {
            window.__stamps.push(t); break; }
      });
      window.__obs.observe(out, {childList: true, subtree: true});
    }""")
    page.click("#generate")
    page.wait_for_selector("#chat-output[data-ids], #fatal:not([hidden])")
    if page.is_visible("#fatal"):
        raise RuntimeError(f"generation failed: {_text(page, '#fatal')}")
    stamps, clicked = page.evaluate("() => { window.__obs.disconnect(); return [window.__stamps, window.__clicked]; }")
    ids = json.loads(page.get_attribute("#chat-output", "data-ids"))
    r = {"ids": ids, "lookahead": page.get_attribute("#chat-output", "data-lookahead"),
         "shown": _text(page, "#chat-output"), "prefill": _text(page, "#stat-prefill"),
         "rate": _text(page, "#stat-tps"), "ntok": _text(page, "#stat-ntok"),
         "token_ms": [round(t - clicked, 2) for t in stamps]}
    if stamps:
        r["first_token_s"] = (stamps[0] - clicked) / 1e3
    if len(stamps) == len(ids) and len(ids) > 1:
        # tokens 2..n each cost one decode step (the first comes from the prefill)
        r["decode_tok_s"] = (len(ids) - 1) / ((stamps[-1] - stamps[0]) / 1e3)
    return r


def set_lookahead(page, value: str) -> None:
    """The page's greedy loop for the next answers (app.js reads ``?lookahead=`` at each click):
    "host" (logits read back, picked in the page), or decode steps submitted ahead (0, 1, 2)."""
    page.evaluate("(v) => history.replaceState(null, '', v ? '?lookahead=' + v : location.pathname)", value)


def chat(page, smol: Path, tokens: int, rate_tokens: int, shot: Path, rate_prompt: str = "",
         lookaheads=(), rounds: int = 2) -> dict:
    """The test's steps (test_smollm2_4bit_chat_in_demo_matches_reference): the preselected 4-bit
    SmolLM2 loaded, a ``tokens``-token answer, the screenshot; then a ``rate_tokens`` answer for a
    steadier decode rate, with the page's default loop; then, for each of ``lookaheads`` in turn,
    ``rounds`` times over, the same answer with that greedy loop (``rates``: setting -> answers)."""
    card = page.locator(f"button.model[data-file='{smol.name}']")
    r = {"preselected": card.get_attribute("aria-checked") == "true", "card": card.inner_text()}
    t0 = time.perf_counter()
    page.click("#load")
    page.wait_for_selector("#chat-card:not([hidden]), #fatal:not([hidden])")
    if page.is_visible("#fatal"):
        raise RuntimeError(f"loading failed: {_text(page, '#fatal')}")
    r["load_s"] = time.perf_counter() - t0
    for k in ("source", "download", "weights", "load", "resident"):
        r[f"stat_{k}"] = _text(page, f"#stat-{k}")
    r["prompt"] = page.input_value("#prompt")
    r["first"] = generate(page, tokens)
    page.screenshot(path=str(shot), full_page=True)
    if rate_tokens:
        if rate_prompt:  # a question whose answer runs past rate_tokens (the default one ends after 8)
            page.fill("#prompt", rate_prompt)
        r["rate"] = generate(page, rate_tokens)
        r["rates"] = {}
        for _ in range(rounds if lookaheads else 0):
            for la in lookaheads:
                set_lookahead(page, la)
                r["rates"].setdefault(la, []).append(generate(page, rate_tokens))
        set_lookahead(page, "")
    return r


def rank(page, mini: Path) -> dict:
    page.click(f"button.model[data-file='{mini.name}']")
    t0 = time.perf_counter()
    page.click("#load")
    page.wait_for_selector("#sim-card:not([hidden]), #fatal:not([hidden])")
    if page.is_visible("#fatal"):
        raise RuntimeError(f"loading MiniLM failed: {_text(page, '#fatal')}")
    load_s = time.perf_counter() - t0
    page.fill("#query", MINILM_QUERY)
    page.click("#rank")
    page.wait_for_selector("#sim-stats:not([hidden]), #fatal:not([hidden])")
    if page.is_visible("#fatal"):
        raise RuntimeError(f"ranking failed: {_text(page, '#fatal')}")
    return {"load_s": load_s, "query": page.input_value("#query"),
            "sentences": [s.strip() for s in page.input_value("#sentences").splitlines() if s.strip()],
            "ranked": page.locator("#ranking li .sent span:last-child").all_inner_texts(),
            "scores": [float(x) for x in page.locator("#ranking li .score").all_inner_texts()],
            "embed": _text(page, "#stat-embed")}


# ============================================================================ reference

def reference_chat(path: Path, prompt: str, n: int) -> dict:
    import gpudelegate
    from gpudelegate import llm
    from gpudelegate.text import tokenizer_from_metadata

    t = time.perf_counter()
    with gpudelegate.Environment() as env, env.session(path, device="reference") as sess:
        tok = tokenizer_from_metadata(sess.program.metadata["tokenizer"])
        want = llm.generate(sess, tok, [{"role": "user", "content": prompt}], n)
    return {"ids": list(want.ids), "text": tok.decode(want.ids), "seconds": time.perf_counter() - t}


def desktop_decode(path: Path, prompt: str, n: int, lookaheads, rounds: int = 2) -> dict:
    """The same program, prompt and loop on desktop wgpu (CPython, wgpu-native, the same GPU), in
    this process: per greedy loop ("host": logits read back; 0: the pick on the GPU), the
    answers' ids and decode rates (GenerationResult.tokens_per_second, the page's own figure)."""
    import gpudelegate
    from gpudelegate import llm
    from gpudelegate.text import tokenizer_from_metadata

    out = {}
    with gpudelegate.Environment() as env, env.session(path, device="wgpu") as sess:
        out["device"] = env.context("wgpu").info().get("name") or env.context("wgpu").info()
        tok = tokenizer_from_metadata(sess.program.metadata["tokenizer"])
        msgs = [{"role": "user", "content": prompt}]
        llm.generate(sess, tok, msgs, 8)  # warm-up
        for _ in range(rounds):
            for la in lookaheads:
                r = llm.generate(sess, tok, msgs, n, lookahead=None if la == "host" else int(la))
                d = out.setdefault(la, {"ids": list(r.ids), "tok_s": []})
                d["tok_s"].append(r.tokens_per_second)
                d["same_ids"] = d.get("same_ids", True) and d["ids"] == list(r.ids)
    return out


def reference_rank(path: Path, query: str, sentences) -> list:
    import gpudelegate
    import minilm as minilm_example  # examples/minilm.py

    with gpudelegate.Environment() as env, env.session(path, device="reference") as sess:
        return minilm_example.rank(sess, query, sentences)


# ============================================================================ main

def _one_line(text) -> str:
    return " · ".join(str(text).split("\n")).replace("|", "/")


def _answer_rows(label: str, g: dict) -> list:
    n = len(g.get("ids", []))
    first = g.get("first_token_s")
    rate = g.get("decode_tok_s")
    return [f"| {label}: the page's prefill / decode figures | {_one_line(g.get('prefill'))} / {_one_line(g.get('rate'))} |",
            f"| {label}: click on Generate to the first token on screen | {f'{first:.3f} s' if first is not None else '-'} |",
            f"| {label}: decode, tokens 2..{n} as they reach the screen | "
            f"{'-' if not rate else f'{rate:.1f} tok/s' if rate >= 1 else f'{1 / rate:.1f} s per token'} |"]


def _lookahead_rows(res: dict) -> list:
    """The greedy loops side by side: the page's figure and the rate on screen per answer, the
    desktop's figure for the same program and prompt, and whether every answer had the same ids."""
    rates = (res.get("chat") or {}).get("rates") or {}
    desk = res.get("desktop") or {}
    if not rates:
        return []
    out = ["", "| greedy loop (`?lookahead=`) | the page's decode figure | decode on screen | desktop wgpu (same GPU) | same ids |",
           "|---|---|---|---|---|"]
    for la, answers in rates.items():
        d = desk.get(la if la == "host" else "0") if isinstance(desk, dict) else None
        dtxt = " / ".join(f"{x:.0f}" for x in d["tok_s"]) + " tok/s" if d else "-"
        shown = " / ".join(f"{g['decode_tok_s']:.0f}" if g.get("decode_tok_s") else "-" for g in answers)
        out.append(f"| {la} | {' / '.join(_one_line(g.get('rate')) for g in answers)} | {shown} tok/s | {dtxt} | "
                   f"{res.get('lookahead_ids_equal')} |")
    return out


def report(res: dict) -> str:
    a = res.get("adapter") or {}
    c = res.get("chat") or {}
    f, rr = c.get("first") or {}, c.get("rate") or {}
    gpu = a.get("device") or a.get("description") or str(res.get("gpu", "")).split(",")[0] or a.get("architecture") or "?"
    lines = [f"# The demo in headless Chromium {res.get('chromium_version')} on {gpu}",
             "", f"{res['date']}; `{res['command']}` (benchmarks/README.md, GPU browser); GPU: {res.get('gpu') or '-'}", "",
             f"- Chromium: Debian 12's chromium-headless-shell {res.get('chromium_package', '')}, driven by Playwright "
             f"{res.get('playwright', '')} (`headless=True`)",
             f"- flags (set `{res.get('flag_set')}`, after Playwright's own): `{' '.join(res.get('flags', []))}`",
             f"- adapter the page sees: `{json.dumps({k: a.get(k) for k in ('vendor', 'architecture', 'device', 'description', 'software')})}`",
             f"- its features: {', '.join(a.get('features', []))}; subgroup-matrix configs: "
             f"{len(a.get('subgroup_matrix_configs') or [])}; max binding {a.get('max_binding_size')}",
             "- attempts: " + "; ".join(f"`{p['set']}`: {p.get('adapter_short') or p.get('error')}" for p in res["probes"]),
             f"- SmolLM2 program: {res.get('smollm2_kind')}", ""]
    if c:
        ref = res.get("reference") or {}
        n = len(f.get("ids", []))
        lines += ["| what | value |", "|---|---|",
                  f"| program | {res['smollm2_mb']:.1f} MB; {_one_line(c.get('stat_weights'))} |",
                  f"| load: click on Load to the chat card | {c['load_s']:.2f} s (the page: download {_one_line(c.get('stat_download'))}; "
                  f"build {_one_line(c.get('stat_load'))}) |"]
        lines += _answer_rows(f"{n}-token answer", f)
        if rr:
            lines += _answer_rows(f"{len(rr['ids'])}-token answer", rr)
        lines += [f"| greedy ids, page | {f.get('ids')} |", f"| greedy ids, reference executor (same program, prompt) | {ref.get('ids')} |",
                  f"| equal | {res.get('tokens_equal')} |"]
        if rr and res.get("rate_prefix_equal") is not None:  # the same prompt: the same first tokens
            lines += [f"| the {len(rr['ids'])}-token answer starts with them | {res['rate_prefix_equal']} |"]
        lines += [f"| the ids as text | {_one_line(ref.get('text', ''))!r} |", f"| screenshot | {res.get('screenshot')} |"]
    m = res.get("minilm")
    if m:
        lines += [f"| MiniLM ({res.get('minilm_kind')}): rank {len(m['sentences'])} sentences | {_one_line(m['embed'])}; "
                  f"load {m['load_s']:.2f} s; order equal to the reference's: {res.get('minilm_order_equal')}, "
                  f"max score diff {res.get('minilm_score_diff', 0):.1e} |"]
    lines += _lookahead_rows(res)
    if res.get("pages"):
        import pages_chromium
        lines += pages_chromium.report_lines(res["pages"])
    if res.get("errors"):
        lines += ["", "Errors:", ""] + [f"- {e}" for e in res["errors"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--carried", type=Path, help="what chromium_carry.py unpack extracted (GPU machine)")
    ap.add_argument("--chromium", default="/usr/bin/chromium", help="Chromium binary when not --carried")
    ap.add_argument("--out", type=Path, required=True, help="folder for result.json, report.md and the screenshot")
    ap.add_argument("--small", action="store_true", help="2-layer models (a software adapter)")
    ap.add_argument("--tokens", type=int, default=8, help="the checked answer's length (the test's 8)")
    ap.add_argument("--rate-tokens", type=int, default=64, help="a second, longer answer for the decode rate (0: none)")
    ap.add_argument("--rate-prompt", default="Write a long story about a robot who learns to paint.",
                    help="the longer answer's question (empty: the page's own)")
    ap.add_argument("--lookaheads", default="host,0,1,2",
                    help="greedy loops to compare on the longer answer (the page's ?lookahead=), comma list")
    ap.add_argument("--rounds", type=int, default=2, help="answers per greedy loop (interleaved)")
    ap.add_argument("--no-desktop", dest="desktop", action="store_false",
                    help="leave out desktop wgpu on the same program (host pick and GPU pick)")
    ap.add_argument("--flag-sets", default=",".join(FLAG_SETS), help=f"comma list of {', '.join(FLAG_SETS)}")
    ap.add_argument("--allow-software", action="store_true", help="run the demo on a software adapter too")
    ap.add_argument("--no-minilm", action="store_true")
    ap.add_argument("--pages", action="store_true", help="after the demo, in the same browser: pages_chromium.py "
                    "(conformance ops, MiniLM vs onnxruntime-web, dispatch overhead, desktop wgpu)")
    ap.add_argument("--smollm2", default="auto",
                    help="auto: a carried program (chromium_carry.py pack --program) if any, else random; "
                         "random: built here with seeded weights; or a program file")
    ap.add_argument("--boot-timeout", type=float, default=60.0,
                    help="seconds for Chromium's start and the page's boot (Pyodide, the adapter) per flag set")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds any later page step may take")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    res = {"date": str(datetime.date.today()), "command": "python3 benchmarks/gpu_browser/demo_chromium.py "
           + " ".join(argv if argv is not None else sys.argv[1:]), "probes": [], "errors": []}

    if a.carried:
        rt = chromium_carry.runtime(a.carried)
        os.environ.update(rt["env"])  # for the processes started below: Node (Playwright's driver), Chromium
        sys.path.append(rt["site"])  # after any installed copy (a local run: the carried greenlet is cp312)
        chromium, pyodide = rt["chromium"], Path(rt["pyodide"])
        toks = json.loads(Path(rt["tokenizers"]).read_text())
        res["carried_libraries"] = rt["manifest"].get("ldpath")
        res["chromium_package"], res["playwright"] = rt["manifest"]["chromium"], rt["manifest"]["playwright"]
        carried = [Path(p) for p in rt["programs"] if Path(p).name.startswith("smollm2")]
    else:
        chromium, pyodide, carried = a.chromium, None, []
        toks = chromium_carry.tokenizers()
    try:
        res["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        res["gpu"] = ""  # no NVIDIA driver here
    os.environ["DEBUG"] = "pw:browser"  # Chromium's stdout/stderr (its log) onto ours, through Playwright
    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp(prefix="demo-chromium-"))
    t = time.perf_counter()
    if a.smollm2 == "random" or (a.smollm2 == "auto" and not carried):
        smol = smollm2_program(work / SMOLLM2, toks["smollm2"], a.small)
        res["smollm2_kind"] = (f"SmolLM2-135M's architecture{' (2 layers)' if a.small else ''} and tokenizer, seeded "
                               "random weights as Q4_1/Q8_0 blocks, built on this machine")
    else:
        smol = carried[0] if a.smollm2 == "auto" else Path(a.smollm2)
        res["smollm2_kind"] = f"{smol.name}: the demo's own program (SmolLM2-135M-Instruct, its GGUF's 4-bit blocks)"
    programs = [smol]
    res["minilm_kind"] = "all-MiniLM-L6-v2's architecture and tokenizer, seeded random weights"
    if not a.no_minilm:
        programs.append(minilm_program(work / MINILM, toks["minilm"], a.small))
    res["smollm2_mb"] = smol.stat().st_size / 1e6
    res["export_s"] = time.perf_counter() - t
    log(f"programs in {res['export_s']:.1f} s: " + ", ".join(f"{p.name} {p.stat().st_size / 1e6:.1f} MB" for p in programs))
    dist = bundle(work / "dist", programs, pyodide)

    from serve import BundleServer  # web/serve.py

    with BundleServer(dist) as url, sync_playwright() as pw:
        browser = page = context = None
        for name in a.flag_sets.split(","):
            flags = COMMON_FLAGS + FLAG_SETS[name]
            probe = {"set": name}
            res["probes"].append(probe)
            log(f"Chromium with flag set {name}: {' '.join(flags)}")
            try:
                b = None
                b = pw.chromium.launch(executable_path=chromium, args=flags, headless=True, timeout=a.boot_timeout * 1000)
                probe["version"] = b.version
                ctx, pg, adapter, err = open_demo(b, url, a.boot_timeout, a.timeout)
            except Exception as e:  # a launch or page failure: say which and try the next set
                probe["error"] = f"{type(e).__name__}: {str(e).strip()[:600]}"
                log(probe["error"])
                if b is not None:
                    b.close()
                continue
            probe["adapter"] = adapter
            if adapter is None:
                probe["error"] = f"no WebGPU device: {err}"
            else:
                probe["adapter_short"] = " / ".join(str(adapter.get(k) or "-") for k in ("vendor", "architecture", "device", "description"))
            log(f"  {probe.get('adapter_short') or probe['error']}")
            if adapter is not None and (a.allow_software or not is_software(adapter)):
                browser, context, page, res["flag_set"], res["flags"] = b, ctx, pg, name, flags
                res["chromium_version"], res["adapter"] = b.version, adapter
                break
            b.close()
        if page is None:
            res["errors"].append("no flag set gave the page a GPU adapter: see the attempts and Chromium's log")
        else:
            try:
                las = [x for x in a.lookaheads.split(",") if x]
                c = res["chat"] = chat(page, smol, a.tokens, a.rate_tokens, a.out / SCREENSHOT, a.rate_prompt,
                                       las, a.rounds)
                answers = [g["ids"] for gs in (c.get("rates") or {}).values() for g in gs]
                if answers:
                    res["lookahead_ids_equal"] = all(x == c["rate"]["ids"] for x in answers)
                res["screenshot"] = SCREENSHOT
                log(f"SmolLM2 page: {c['first']['ids']} ({c['first']['rate']}, prefill {c['first']['prefill']})")
                ref = res["reference"] = reference_chat(smol, c["prompt"], a.tokens)
                res["tokens_equal"] = c["first"]["ids"] == ref["ids"]
                if c.get("rate") and not a.rate_prompt:
                    res["rate_prefix_equal"] = c["rate"]["ids"][:len(ref["ids"])] == ref["ids"]
                log(f"reference: {ref['ids']} in {ref['seconds']:.1f} s; equal: {res['tokens_equal']}")
            except Exception as e:
                res["errors"].append(f"SmolLM2: {type(e).__name__}: {str(e).strip()[:800]}")
                page.screenshot(path=str(a.out / SCREENSHOT), full_page=True)
            if a.desktop and a.rate_tokens:
                try:
                    res["desktop"] = desktop_decode(smol, a.rate_prompt or res.get("chat", {}).get("prompt", ""), a.rate_tokens,
                                                    ["host", "0"], a.rounds)
                    log(f"desktop wgpu: {res['desktop']}")
                except Exception as e:
                    res["errors"].append(f"desktop wgpu: {type(e).__name__}: {str(e).strip()[:800]}")
            if not a.no_minilm:
                try:
                    m = res["minilm"] = rank(page, programs[1])
                    want = reference_rank(programs[1], m["query"], m["sentences"])
                    res["minilm_order_equal"] = m["ranked"] == [s for _, s in want]
                    res["minilm_score_diff"] = max(abs(x - sc) for x, (sc, _) in zip(m["scores"], want))
                except Exception as e:
                    res["errors"].append(f"MiniLM: {type(e).__name__}: {str(e).strip()[:800]}")
            context.close()
            if a.pages:  # issue 18's other pages, in this same browser (benchmarks/gpu_browser/pages_chromium.py)
                try:
                    import pages_chromium
                    import pages_probes

                    def relaunch(enable, extra):  # the same browser with more Dawn toggles / flags (its variants)
                        return pw.chromium.launch(executable_path=chromium, headless=True, timeout=a.boot_timeout * 1000,
                                                  args=pages_probes.variant_flags(res["flags"], enable, extra))
                    res["pages"] = pages_chromium.run(browser, url, dist, small=a.small, out=a.out, budget_s=300.0,
                                                      ort_dir=chromium_carry.runtime(a.carried)["ort"] if a.carried else None,
                                                      relaunch=relaunch)
                except Exception as e:
                    res["errors"].append(f"pages: {type(e).__name__}: {str(e).strip()[:800]}")
            browser.close()
    res["total_s"] = time.perf_counter() - t_all
    (a.out / "result.json").write_text(json.dumps(res, indent=1, default=str))
    text = report(res)
    (a.out / "report.md").write_text(text)
    print(text)
    ok = page is not None and res.get("tokens_equal") and not res["errors"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
