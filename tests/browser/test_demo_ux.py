"""What a new user of the demo page sees (issue 14, item 11), with the small MiniLM program the
model tests use ([2, 16] inputs, so a ranking takes seconds on SwiftShader):

- loading shows each phase in turn (download, verify, store in Cache Storage, plan, allocate,
  compile/record, upload with bytes, ready; from Cache Storage: cache read, verify with bytes,
  then the same), never a finished download bar while planning or compiling runs;
- ranking an empty sentence list is refused at once with a message, without running the model;
- a sentence longer than the model's window is embedded (truncated, as the reference executor
  embeds it) with a note saying how many of its tokens were kept;
- programs of one model with different weights (MiniLM in float32 and q8_0 here, as SmolLM2 comes
  in 4-bit and float32) are one choice on the page, each with its weights and download size, the
  smallest preselected; the float32 one stays a click away, and is what these tests load.

The page's phase display is recorded by a MutationObserver installed before the page's own
scripts, so the test sees every state the page put on screen, in order.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gpudelegate
from gpudelegate.text import tokenizer_from_metadata

from conftest import _guard

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "web"))

import build as web_build  # noqa: E402
import minilm as minilm_example  # noqa: E402  (examples/minilm.py)

FILE = "minilm-ux.gdp"
Q8_FILE = "minilm-ux-q8_0.gdp"  # the same model with q8_0 weights: only listed, never loaded here
SEQ_LEN = 16
NETWORK_PHASES = ["download", "verify", "store", "plan", "allocate", "record", "prepack", "ready"]
CACHE_PHASES = ["cache", "verify", "plan", "allocate", "record", "prepack", "ready"]
LONG = ("The old lighthouse keeper climbed the spiral staircase every evening to light the lamp "
        "that guided fishing boats safely past the rocky northern coast.")

# Runs before the page's scripts (and again after a reload): records every state of the progress
# block (which phase, its line of text, the byte count, the bar) and the type of every message
# the page sends its worker.
RECORDER = r"""
(() => {
  window.__shown = [];
  window.__sent = [];
  const post = Worker.prototype.postMessage;
  Worker.prototype.postMessage = function (m, ...rest) {
    window.__sent.push(m && m.type);
    return post.call(this, m, ...rest);
  };
  document.addEventListener("DOMContentLoaded", () => {
    const box = document.getElementById("progress");
    const snap = () => {
      const s = {
        t: Math.round(performance.now()), phase: box.dataset.phase || null, hidden: box.hidden,
        label: document.getElementById("progress-label").textContent,
        bytes: document.getElementById("progress-bytes").textContent,
        fill: document.getElementById("progress-fill").style.width, busy: box.classList.contains("busy"),
      };
      const last = window.__shown[window.__shown.length - 1];
      if (!last || JSON.stringify({ ...last, t: 0 }) !== JSON.stringify({ ...s, t: 0 })) window.__shown.push(s);
    };
    new MutationObserver(snap).observe(box, { attributes: true, childList: true, subtree: true, characterData: true });
  });
})();
"""


@pytest.fixture(scope="module")
def program(bundle, tmp_path_factory):
    d = tmp_path_factory.mktemp("ux-programs")
    minilm_example.export(d / FILE, batch=2, seq_len=SEQ_LEN)
    minilm_example.export(d / Q8_FILE, batch=2, seq_len=SEQ_LEN, weights_dtype="q8_0")
    web_build.copy_programs(bundle, d)
    yield d / FILE
    for name in (FILE, Q8_FILE):
        (d / name).unlink()
        (bundle / "programs" / name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def demo(browser, server, program):
    """The demo page with MiniLM loaded from the network (the first test checks how)."""
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    outside = _guard(context, server)
    context.add_init_script(RECORDER)
    page = context.new_page()
    page.set_default_timeout(600_000)
    try:
        page.goto(server + "index.html")
        page.wait_for_selector("body[data-ready='1']")
        load(page)
        yield page
    finally:
        context.close()
    assert outside == [], f"the page tried to reach outside 127.0.0.1: {outside}"


def load(page):
    page.evaluate("window.__shown = []")
    page.click(f"button.model[data-file='{FILE}']")
    page.click("#load")
    page.wait_for_selector("#sim-card:not([hidden]), #fatal:not([hidden])")
    assert page.is_hidden("#fatal"), page.inner_text("#fatal")


def phases_shown(page):
    shown = page.evaluate("window.__shown")
    order = []
    for s in shown:
        if s["phase"] and (not order or order[-1] != s["phase"]):
            order.append(s["phase"])
    return shown, order


def check_phase_display(page, expected, progress_phase):
    shown, order = phases_shown(page)
    chips = page.locator("#phases li").all_inner_texts()
    starts = {}
    for s in shown:
        starts.setdefault(s["phase"], s["t"])
    print(f"phases shown: {order}; steps: {[c.replace(chr(10), ' ') for c in chips]}; "
          f"ms from load: {[(p, t - shown[0]['t']) for p, t in starts.items()]}; upload bytes at ms: "
          f"{[(s['bytes'], s['t'] - shown[0]['t']) for s in shown if s['phase'] == 'prepack' and s['bytes']]}")
    assert order == expected, (order, shown)
    by_phase = {}
    for s in shown:
        if s["phase"]:
            by_phase.setdefault(s["phase"], []).append(s)
    # Each phase says in words what runs; none of them is the finished download's bar.
    words = {"cache": "Cache Storage", "download": "downloading", "verify": "verifying", "store": "Cache Storage",
             "plan": "planning", "allocate": "allocating", "record": "compiling", "prepack": "uploading weights",
             "ready": "ready"}
    for name in expected:
        assert all(words[name] in s["label"] for s in by_phase[name]), (name, by_phase[name])
    for name in ("plan", "allocate", "record"):
        for s in by_phase[name]:
            assert not s["hidden"] and "downloading" not in s["label"], s
            # No byte count and no full bar: the bar is striped ("busy"), not "100% downloaded".
            assert s["bytes"] == "" and s["fill"] == "0%" and s["busy"], s
    # The upload (and a cached file's verification) count bytes up to the whole.
    counted = [s for s in by_phase[progress_phase] if " MB / " in s["bytes"]]
    assert counted and float(counted[-1]["fill"].rstrip("%")) == 100, by_phase[progress_phase]
    assert [s for s in by_phase["prepack"] if " MB / " in s["bytes"]], by_phase["prepack"]
    # The steps list keeps every phase with its duration once done.
    assert page.get_attribute("#phases", "aria-label") == "load phases"
    done = page.locator("#phases li.done").count()
    assert done == len(expected) and page.locator("#phases li.active").count() == 0, chips
    assert page.inner_text("#progress-label").startswith("ready")


def test_load_shows_each_phase_in_turn(demo):
    assert "network" in demo.inner_text("#stat-source")
    check_phase_display(demo, NETWORK_PHASES, "download")
    stat = demo.inner_text("#stat-load")
    assert "compile" in stat and "upload" in stat, stat


def check_weights_choice(page, program, checked):
    """MiniLM's two programs are one group: q8_0 (the smaller download) listed first, then float32,
    each with its weights and download size; ``checked`` is the file selected now."""
    q8 = program.parent / Q8_FILE
    groups = page.locator("#models .model-group")
    assert groups.count() == 1, page.inner_text("#models")
    assert groups.first.locator(".name").inner_text() == "all-MiniLM-L6-v2"
    buttons = groups.first.locator("button.model")
    assert [buttons.nth(i).get_attribute("data-file") for i in range(buttons.count())] == [Q8_FILE, FILE]
    assert [buttons.nth(i).get_attribute("data-weights") for i in range(2)] == ["q8_0", "float32"]
    texts = buttons.all_inner_texts()
    assert "8-bit (Q8_0)" in texts[0] and f"{q8.stat().st_size / 1e6:.0f} MB download" in texts[0], texts
    assert "float32" in texts[1] and f"{program.stat().st_size / 1e6:.0f} MB download" in texts[1], texts
    assert [buttons.nth(i).get_attribute("aria-checked") for i in range(2)] == [
        str(f == checked).lower() for f in (Q8_FILE, FILE)]
    choice = page.inner_text("#choice")
    assert ("8-bit (Q8_0)" if checked == Q8_FILE else "float32") in choice, choice
    return texts


def test_weights_are_a_choice_with_download_sizes(demo, program):
    """The float32 program the fixture chose is checked, loaded and says so; q8_0 sits next to it."""
    texts = check_weights_choice(demo, program, FILE)
    assert "cached" in texts[1] and "cached" not in texts[0], texts
    weights = demo.inner_text("#stat-weights")
    assert weights.startswith("float32"), weights
    assert f"{program.stat().st_size / 1e6:.0f} MB in" in demo.inner_text("#stat-download")


def test_empty_sentence_list_is_refused_at_once(demo):
    demo.fill("#sentences", "  \n\n   \n")
    sent = demo.evaluate("window.__sent.length")
    t0 = time.perf_counter()
    demo.click("#rank")
    # At once: the old page spent ~7 s embedding the query alone, then showed nothing.
    demo.wait_for_selector("#sim-message:not([hidden])", timeout=3000)
    seconds = time.perf_counter() - t0
    msg = demo.inner_text("#sim-message")
    assert "Nothing to rank" in msg and "at least one sentence" in msg, msg
    assert demo.evaluate("n => window.__sent.slice(n)", sent) == [], "the page asked its worker to run the model"
    assert demo.locator("#ranking li").count() == 0 and demo.is_hidden("#sim-stats")
    assert demo.is_enabled("#rank")
    print(f"empty list refused in {seconds:.2f} s: {msg!r}")


def test_long_sentence_is_embedded_with_a_truncation_note(demo, program, artifacts):
    short = "A cat sleeps on a sunny windowsill."
    demo.fill("#query", "A lighthouse on the coast.")
    demo.fill("#sentences", f"{LONG}\n{short}")
    demo.click("#rank")
    demo.wait_for_selector("#sim-stats:not([hidden]), #fatal:not([hidden])")
    assert demo.is_hidden("#fatal"), demo.inner_text("#fatal")
    with gpudelegate.Environment() as env, env.session(program, device="reference") as sess:
        tok = tokenizer_from_metadata(sess.program.metadata["tokenizer"])
        tokens = len(tok.encode(LONG, max_length=1 << 30))  # [CLS] + every piece + [SEP]
        want = minilm_example.rank(sess, "A lighthouse on the coast.", [LONG, short])
    assert tokens > SEQ_LEN and len(tok.encode(short, max_length=1 << 30)) <= SEQ_LEN
    rows = demo.locator("#ranking li")
    assert rows.count() == 2
    notes = {}
    for i in range(2):
        row = rows.nth(i)
        sentence = row.locator(".sent span:last-child").inner_text()
        notes[sentence] = row.locator(".trunc").all_inner_texts()
    assert notes[LONG] == [f"truncated to {SEQ_LEN} of {tokens} tokens"], notes
    assert notes[short] == [], notes
    msg = demo.inner_text("#sim-message")
    assert f"{SEQ_LEN}-token window" in msg and "1 of 2 sentences" in msg and "query" not in msg, msg
    # Embedded as the reference executor embeds it: its first SEQ_LEN tokens.
    ranked = rows.locator(".sent span:last-child").all_inner_texts()
    scores = [float(x) for x in rows.locator(".score").all_inner_texts()]
    assert ranked == [s for _, s in want], (ranked, want)
    np.testing.assert_allclose(scores, [sc for sc, _ in want], atol=1e-3)  # 3 decimals shown
    demo.screenshot(path=str(artifacts / "demo-minilm-phases.png"), full_page=True)
    print(f"long sentence: {tokens} tokens, note {notes[LONG]}, message {msg!r}")


def test_cached_load_shows_cache_read_then_each_phase(demo, program):
    demo.reload()
    demo.wait_for_selector("body[data-ready='1']")
    # A fresh page preselects the smallest download (as it does the 4-bit SmolLM2); the float32
    # program, chosen next, comes from Cache Storage.
    check_weights_choice(demo, program, Q8_FILE)
    load(demo)
    assert "Cache Storage" in demo.inner_text("#stat-source")
    check_phase_display(demo, CACHE_PHASES, "verify")


def test_rank_refuses_nothing_to_rank_in_python():
    """``demo.rank`` itself refuses an empty list or query before anything runs (the page checks
    first; a script calling the worker must get the same answer, not a silent empty ranking)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from gpudelegate.errors import InputError
    from gpudelegate.web import demo as web_demo

    def run(query, sentences):
        # In a thread of its own: Playwright's sync API keeps an event loop running in this one.
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, web_demo.rank(query, sentences)).result()

    with pytest.raises(InputError, match="at least one sentence"):
        run("A man is playing a guitar.", ["", "   "])
    with pytest.raises(InputError, match="write a query"):
        run("  ", ["A cat sleeps."])


def test_weights_summary_counts_what_runs(program):
    """``demo.weights_summary`` (the page's weights line and each program's entry in index.json)
    counts the weights the device holds, each constant once: float32 weights packed to float16 at
    load are float16 there, and q8_0 blocks stay q8_0 next to the float32 norms."""
    import torch

    from gpudelegate.export import export_program
    from gpudelegate.web.demo import weights_summary

    f32, q8 = gpudelegate.load(program), gpudelegate.load(program.parent / Q8_FILE)
    s32, s8 = weights_summary(f32), weights_summary(q8)
    assert (s32["kind"], s32["label"], list(s32["types"])) == ("float32", "float32", ["float32", "int32"]), s32
    assert (s8["kind"], s8["label"]) == ("q8_0", "8-bit (Q8_0)"), s8
    assert s8["types"]["q8_0"] == sum(c.nbytes for c in q8.constants if c.dtype == "q8_0")
    # Every weight is counted once, in the file's dtype: the float32 program's constants exactly.
    assert sum(s32["types"].values()) == sum(c.nbytes for c in f32.constants)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).eval()
    x = (torch.randn(2, 64),)
    dense = weights_summary(export_program(model, x))
    half = weights_summary(export_program(model, x, weights_dtype="float16"))  # fp16_at="load": float32 in the file
    assert dense["kind"] == "float32" and half["kind"] == half["label"] == "float16", (dense, half)
    assert half["types"].get("float16", 0) * 2 == dense["types"]["float32"] - half["types"].get("float32", 0), (dense, half)
