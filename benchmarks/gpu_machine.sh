#!/usr/bin/env bash
# Prepare a bare GPU machine (NVIDIA driver, Python with torch/cupy/pytest, no network) for this
# project's tests and benchmarks, then run what is asked. The checkout must carry:
#   .whl/  wheels the machine lacks: wgpu, wgpudawn, cffi, pycparser, rendercanvas, gguf (py3) for cp312 manylinux
#   .gl/   Debian's libvulkan1 libglvnd0 libgl1 libglx0 libegl1 libopengl0 libgles2 (.deb): the
#          NVIDIA Vulkan ICD is libGLX_nvidia, which needs the glvnd loaders
#   .old/  (optional) a source tree of the baseline commit, for A/B benchmarks
#   .ortwhl/ (optional) the onnxruntime-webgpu wheel (cp312 manylinux), installed into /tmp/ort, a
#          folder of its own (the image's CPU onnxruntime has the same module name); bench_dawn.py
#          finds it through GPUDELEGATE_ORT_WEBGPU
#
#   bash benchmarks/gpu_machine.sh tests            # the GPU test suite (CUDA, wgpu and Dawn on the GPU;
#                                                   # Dawn's whole conformance suite, not CI's sample)
#   bash benchmarks/gpu_machine.sh ab ARGS...       # benchmarks/ab_compare.py, old vs new tree
#   bash benchmarks/gpu_machine.sh run CMD...       # any command in the prepared environment
set -euo pipefail
cd "$(dirname "$0")/.."
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
if [ -d .ortwhl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ort .ortwhl/*.whl
  export GPUDELEGATE_ORT_WEBGPU=/tmp/ort
fi
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export XDG_RUNTIME_DIR=/tmp/xdg PYTHONUNBUFFERED=1
mkdir -p /tmp/xdg && chmod 700 /tmp/xdg
# Each tree installed on its own, so a benchmark imports the gpudelegate of the tree it runs from.
# A warm machine still has the last call's trees: pip --target would keep them (it replaces an
# existing package only with --upgrade), so they go first.
rm -rf /tmp/gd_new /tmp/gd_old
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/gd_new . 2>/dev/null
if [ -d .old ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/gd_old .old 2>/dev/null
fi
export PYTHONPATH=/tmp/site
what=${1:-tests}
shift || true
case "$what" in
  tests)
    PYTHONPATH=/tmp/gd_new:/tmp/site python3 -m pytest -q -p no:cacheprovider --maxfail=25 -rf \
      -m "gpu or wgpu or dawn" tests "$@" ;;
  ab)
    python3 benchmarks/ab_compare.py --old .old --new . --old-pythonpath /tmp/gd_old \
      --new-pythonpath /tmp/gd_new "$@" ;;
  run)
    PYTHONPATH=/tmp/gd_new:/tmp/site "$@" ;;
  *)
    echo "usage: $0 tests|ab|run ..." >&2; exit 2 ;;
esac
