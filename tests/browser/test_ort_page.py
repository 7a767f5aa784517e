"""The onnxruntime-web side of the browser benchmark (web/app/ort.html, benchmarks/bench_browser.py):
the page loads onnxruntime-web from the bundle (npm, never a CDN), runs the ONNX that
benchmarks/minilm_onnx.py exports from the same module and weights as our MiniLM program on its
WebGPU execution provider, and gives the embeddings our reference executor gives for the same
token ids. Small shapes (SwiftShader): [4, 16]."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gpudelegate

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "web"))
sys.path.insert(0, str(ROOT / "examples"))

import build as web_build  # noqa: E402

SENTENCES = ["A man is playing a guitar.", "Someone strums an acoustic guitar on stage.",
             "Stock markets fell sharply after the announcement.", "Ein Hund läuft über die Wiese"]
B, T = 4, 16


@pytest.fixture(scope="module")
def onnx_in_bundle(bundle):
    import minilm_onnx  # benchmarks/minilm_onnx.py (reused from .cache/onnx when up to date)

    t0 = time.perf_counter()
    dst = web_build.copy_onnx(bundle, minilm_onnx.export())
    print(f"\nONNX ready in {time.perf_counter() - t0:.1f} s")
    return dst


def test_ort_webgpu_page_offline_matches_ours(page, server, offline, onnx_in_bundle, tmp_path):
    from gpudelegate.export.models import minilm as minilm_model

    tok = minilm_model.load_tokenizer()
    ids, mask = tok.encode_batch(SENTENCES, T)
    page.set_default_timeout(300_000)
    page.goto(server + "ort.html")
    page.wait_for_function("window.ortBench !== undefined")
    assert page.evaluate("() => window.ortBench.version") == "1.30.0"
    created = page.evaluate("(ep) => window.ortBench.create(ep)", "webgpu")
    r = page.evaluate("([ep, a]) => window.ortBench.run(ep, a)",
                      ["webgpu", {"ids": sum(ids, []), "mask": sum(mask, []), "B": B, "T": T, "runs": 1}])
    got = np.asarray(r["embedding"], np.float64).reshape(B, 384)

    # Ours: the same module and weights exported to a program, on the reference executor.
    import minilm as minilm_example  # examples/minilm.py
    prog = tmp_path / "minilm.gdp"
    minilm_example.export(prog, batch=B, seq_len=T)
    with gpudelegate.Environment() as env, env.session(prog, device="reference") as sess:
        want = np.asarray(sess.run("forward", {"ids": np.asarray(ids, np.int32), "mask": np.asarray(mask, np.int32)})[0],
                          np.float64)
    print(f"onnxruntime-web WebGPU: session {created['seconds']:.1f} s, first run {r['first']:.1f} s, "
          f"run {r['runs'][0]:.2f} s; max |diff| vs ours {np.abs(got - want).max():.1e}")
    # Unit vectors from the same float32 weights; ORT's WebGPU kernels sum in another order (and
    # its Gelu/LayerNorm are its own), which moves components by ~1e-7..1e-6. 1e-4 absolute leaves
    # room for that and catches any real difference (a wrong op moves them by >1e-2).
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
