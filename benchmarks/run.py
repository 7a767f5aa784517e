"""`make bench`: run the benchmarks this machine can run and record them under benchmarks/results/.

CUDA (CuPy sees a GPU): bench_cuda.py. A hardware WebGPU adapter (wgpu): bench_wgpu.py and
bench_wgpu_upload.py. With neither, says so and exits 1 (the software adapter's figures are not
benchmarks; `--small` runs the scripts' smoke shapes there anyway).

    python benchmarks/run.py [--small] [--only cuda|wgpu]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _has_cuda() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _wgpu_adapter():
    """(name, software) of the default adapter, or None."""
    try:
        import wgpu

        a = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    except Exception:
        return None
    if a is None:
        return None
    return a.info.get("device", "?"), str(a.info.get("adapter_type", "")).upper() == "CPU"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run the benchmarks this machine can run (make bench).")
    ap.add_argument("--small", action="store_true", help="smoke shapes; also runs on a software adapter")
    ap.add_argument("--only", choices=["cuda", "wgpu"], help="one family only")
    a = ap.parse_args(argv)
    runs = []
    if a.only in (None, "cuda"):
        if _has_cuda():
            runs.append(["bench_cuda.py"] + (["--quick"] if a.small else []))
        else:
            print("bench: no CUDA device (CuPy) here: bench_cuda.py skipped")
    if a.only in (None, "wgpu"):
        ad = _wgpu_adapter()
        if ad is None:
            print("bench: no WebGPU adapter (wgpu) here: bench_wgpu.py skipped")
        elif ad[1] and not a.small:
            print(f"bench: the only adapter is software ({ad[0]}): bench_wgpu.py skipped (--small runs it)")
        else:
            runs.append(["bench_wgpu.py"] + (["--small"] if a.small else []))
            runs.append(["bench_wgpu_upload.py"] + (["--small"] if a.small else ["--record"]))
    if not runs:
        print("bench: nothing to run on this machine (see `make bench-browser` for the browser comparison)")
        return 1
    rc = 0
    for r in runs:
        print(f"\n=== {' '.join(r)}", flush=True)
        rc |= subprocess.call([sys.executable, os.path.join(HERE, r[0])] + r[1:])
    return rc


if __name__ == "__main__":
    sys.exit(main())
