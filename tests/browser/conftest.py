"""Playwright fixtures: Debian's Chromium (never `playwright install`), the bundle built into a
temporary folder and served from 127.0.0.1, and a harness page with Pyodide + gpudelegate.

Chromium flags: the set that gives headless Chromium WebGPU here (--enable-unsafe-webgpu is the
one it needs); WebGPU there is SwiftShader (slow: small shapes).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "web"))
sys.path.insert(0, str(ROOT / "tests"))

import build as web_build  # noqa: E402
from serve import BundleServer  # noqa: E402

CHROMIUM = os.environ.get("GPUDELEGATE_CHROMIUM", "/usr/bin/chromium")
BASE_ARGS = ["--headless=new", "--no-sandbox", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--disable-quic"]
WEBGPU_ARGS = BASE_ARGS + ["--enable-unsafe-webgpu"]
ARTIFACTS = ROOT / "artifacts"


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here and not any(n in str(item.fspath) for n in ("test_web_loader", "test_pyodide_core")):
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: `make apt` installs Debian's chromium"
    return {**browser_type_launch_args, "executable_path": CHROMIUM, "args": WEBGPU_ARGS, "headless": True}


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args):
    return {**browser_context_args, "viewport": {"width": 1100, "height": 900}}


@pytest.fixture(scope="session")
def programs_dir(tmp_path_factory):
    """Programs for the demo page: the ones `make demo` exported, when present."""
    return ROOT / ".cache" / "programs"


@pytest.fixture(scope="session")
def bundle(tmp_path_factory, programs_dir):
    assert web_build.PYODIDE_NPM.exists(), (
        f"{web_build.PYODIDE_NPM} is missing: run `npm ci --prefix web` (make setup does it)")
    dist = tmp_path_factory.mktemp("dist")
    web_build.build_dist(dist, programs=None)
    return dist


@pytest.fixture(scope="session")
def server(bundle):
    with BundleServer(bundle) as url:
        yield url


def _guard(context, server):
    """Abort (and record) every request that does not go to our server."""
    outside = []

    def route(r):
        url = r.request.url
        if url.startswith(server) or url.startswith("data:") or url.startswith("blob:"):
            return r.continue_()
        outside.append(url)
        return r.abort()

    context.route("**/*", route)
    return outside


@pytest.fixture()
def offline(page, server):
    """Every request of the page must go to our server: anything else is aborted and recorded."""
    outside = _guard(page.context, server)
    yield outside
    assert outside == [], f"the page tried to reach outside 127.0.0.1: {outside}"


def _boot_harness(page, server):
    page.set_default_timeout(600_000)
    page.goto(server + "harness.html")
    page.wait_for_function("window.harness !== undefined")
    page.evaluate("() => window.harness.ready")

    def run(code: str, args=None):
        return page.evaluate("([c, a]) => window.harness.run(c, a)", [code, args])

    run.page = page
    return run


@pytest.fixture(scope="module")
def harness(browser, server):
    """The harness page (one per test module), booted: ``harness(code, args)`` runs Python
    (await allowed, ``ARGS`` bound to args) in the page and returns its result as plain data."""
    context = browser.new_context()
    outside = _guard(context, server)
    page = context.new_page()
    page.on("console", lambda m: m.type == "error" and print("page console:", m.text))
    try:
        yield _boot_harness(page, server)
    finally:
        context.close()
    assert outside == [], f"the page tried to reach outside 127.0.0.1: {outside}"


@pytest.fixture(scope="session")
def artifacts():
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


def launch_without_webgpu(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=BASE_ARGS, headless=True)

