"""The offline bundle in headless Chromium: Python boots from 127.0.0.1 only, the demo page
reaches its ready state with the WebGPU adapter shown, and without WebGPU it says so clearly."""

import pytest

from conftest import launch_without_webgpu


def test_harness_boots_python_and_webgpu_offline(harness):
    r = harness("""
import sys, gpudelegate
from gpudelegate.web import webgpu
st = await webgpu.init()
import importlib.util
{"platform": sys.platform, "version": gpudelegate.__version__, "numpy": importlib.util.find_spec("numpy") is not None,
 "vendor": st.info["vendor"], "arch": st.info["architecture"], "jspi": webgpu.can_run_sync()}
""")
    assert r["platform"] == "emscripten"
    assert r["numpy"] is False  # the browser side works without numpy
    assert r["vendor"] == "google" and r["arch"] == "swiftshader", r
    assert r["jspi"] is True  # Chromium 156 has JSPI: the synchronous Session.run API works


def test_demo_page_ready_offline(page, server, bundle, offline):
    import json
    page.set_default_timeout(120_000)
    page.goto(server + "index.html")
    page.wait_for_selector("body[data-ready='1']")
    assert "google" in page.inner_text("#adapter-text")
    assert page.is_hidden("#fatal")
    index = json.loads((bundle / "programs" / "index.json").read_text())["programs"]
    if index:  # one card per bundled program (the model tests publish theirs)
        assert page.locator("button.model").count() == len(index)
    else:  # a bundle without exported programs tells the user how to get them
        assert "make demo" in page.inner_text("#models")


def test_missing_webgpu_is_explained(playwright, server):
    browser = launch_without_webgpu(playwright)
    try:
        page = browser.new_page()
        page.set_default_timeout(120_000)
        page.goto(server + "index.html")
        page.wait_for_selector("#fatal:not([hidden])")
        text = page.inner_text("#fatal")
        assert "WebGPU is not available" in text
        assert "requestAdapter() returned no adapter" in text or "navigator.gpu is undefined" in text
        assert "--enable-unsafe-webgpu" in text
        assert "no WebGPU" in page.inner_text("#adapter-text")
        assert page.is_disabled("#load")
    finally:
        browser.close()


def test_missing_webgpu_raises_device_error_in_python(playwright, server):
    browser = launch_without_webgpu(playwright)
    try:
        page = browser.new_page()
        page.set_default_timeout(120_000)
        page.goto(server + "harness.html")
        page.wait_for_function("window.harness !== undefined")
        page.evaluate("() => window.harness.ready")
        r = page.evaluate("(c) => window.harness.run(c)", """
from gpudelegate import DeviceError, Environment
try:
    env = Environment()
    env.context("webgpu")
    out = "no error"
except DeviceError as e:
    out = "DeviceError: " + str(e)
except Exception as e:
    out = type(e).__name__ + ": " + str(e)
out
""")
        assert r.startswith("DeviceError: "), r
        assert "adapter" in r or "navigator.gpu" in r
    finally:
        browser.close()
