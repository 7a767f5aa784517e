"""The demo's download check in the page (web/app/worker.js + web/loader.py): every constant's
hash is checked as the file arrives and when it comes from Cache Storage. One byte flipped in the
cached copy gives a PayloadError naming the constant, shown on the page; the corrupt copy is
deleted, so the next load downloads the file again and runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import gpudelegate
from gpudelegate.web import loader

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "web"))

import build as web_build  # noqa: E402

FILE = "check-test.gdp"


@pytest.fixture(scope="module")
def program_in_bundle(bundle, tmp_path_factory):
    """A small exported program published in the served bundle; the bundle's previous program
    index is put back afterwards (other modules publish their own)."""
    import torch

    from gpudelegate.export import export_program

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("check-programs")
    export_program(Net().eval(), (torch.randn(2, 32),), path=d / FILE, progress=False,
                   metadata={"model": "download-check test net"})
    index = bundle / "programs" / "index.json"
    before = index.read_text() if index.exists() else None
    web_build.copy_programs(bundle, d)
    yield d / FILE
    (bundle / "programs" / FILE).unlink(missing_ok=True)
    if before is not None:
        index.write_text(before)


# Flip one byte of the cached copy of FILE in the page's Cache Storage (the worker's cache).
CORRUPT_JS = """
async ([file, at]) => {
  const cache = await caches.open("gpudelegate-programs-v1");
  const keys = (await cache.keys()).filter((r) => new URL(r.url).pathname.endsWith("/programs/" + file));
  if (keys.length !== 1) throw new Error(`expected one cached copy of ${file}, found ${keys.length}`);
  const resp = await cache.match(keys[0]);
  const bytes = new Uint8Array(await resp.arrayBuffer());
  bytes[at] ^= 0x01;
  await cache.put(keys[0], new Response(bytes, { headers: { "Content-Type": "application/octet-stream" } }));
  return keys[0].url;
}
"""
CACHED_JS = """
async (file) => (await (await caches.open("gpudelegate-programs-v1")).keys())
  .filter((r) => new URL(r.url).pathname.endsWith("/programs/" + file)).length
"""


def _load(page):
    page.click(f"button.model[data-file='{FILE}']")
    page.click("#load")
    page.wait_for_selector("#sim-card:not([hidden]), #chat-card:not([hidden]), #fatal:not([hidden])")


def test_corrupt_cached_constant_is_a_payload_error(browser, server, program_in_bundle, artifacts):
    prog = gpudelegate.load(program_in_bundle)
    names = loader.constant_names(prog)
    i = max(range(len(prog.constants)), key=lambda k: prog.constants[k].nbytes)
    c = prog.constants[i]
    at = loader.head_size(program_in_bundle.read_bytes()[:64]) + c.offset + c.nbytes // 2

    context = browser.new_context()
    downloads = []
    context.on("request", lambda req: req.url.split("?")[0].endswith("/programs/" + FILE) and downloads.append(req.url))
    page = context.new_page()
    page.set_default_timeout(300_000)
    try:
        page.goto(server + "index.html")
        page.wait_for_selector("body[data-ready='1']")
        _load(page)  # downloaded, checked, cached
        assert page.is_hidden("#fatal"), page.inner_text("#fatal")
        assert "network" in page.inner_text("#stat-source")
        assert page.evaluate(CACHED_JS, FILE) == 1

        page.evaluate(CORRUPT_JS, [FILE, at])
        page.reload()
        page.wait_for_selector("body[data-ready='1']")
        assert "cached" in page.inner_text(f"button.model[data-file='{FILE}']")
        _load(page)
        assert page.is_visible("#fatal"), "a corrupt cached program was loaded without an error"
        text = page.inner_text("#fatal")
        page.screenshot(path=str(artifacts / "demo-corrupt-cache.png"), full_page=True)
        assert "PayloadError" in text, text
        assert f"constants[{i}] ({names[i]!r})" in text, text
        assert "corrupt" in text and "Cache Storage" in text, text
        assert len(downloads) == 1  # the corrupt copy was read from the cache, not the network
        assert page.evaluate(CACHED_JS, FILE) == 0, "the corrupt cached copy was kept"

        _load(page)  # downloaded again, checked, runs
        assert page.is_hidden("#fatal"), page.inner_text("#fatal")
        assert "network" in page.inner_text("#stat-source")
        assert len(downloads) == 2
        log = page.text_content("#log")  # a collapsed <details>: inner_text would be empty
        facts = json.loads(log.split(f"loaded {FILE}: ")[-1].splitlines()[0])
        assert facts["verifySeconds"] >= 0 and facts["source"] == "network", facts
    finally:
        context.close()
