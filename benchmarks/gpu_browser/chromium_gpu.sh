#!/usr/bin/env bash
# The demo page in headless Chromium on the GPU machine, over consecutive calls that each carry
# one part of .chromecarry/ (chromium_carry.py pack; benchmarks/README.md, GPU browser), or of the
# folder CARRY_DIR names (e.g. CARRY_DIR=.chromecarry_pages with `run --pages`: pages_chromium.py):
#
#   bash benchmarks/gpu_browser/chromium_gpu.sh stage       # a call carrying an early part: kept in /tmp
#   bash benchmarks/gpu_browser/chromium_gpu.sh run [ARGS]  # the call carrying the last part: unpack
#                                                           # everything, run demo_chromium.py ARGS
#
# Each call must come while the machine is still warm from the last (its files last ~30 s).
# `run` also needs .gl/ carried (the Vulkan and glvnd loader debs: the NVIDIA ICD needs glvnd),
# as benchmarks/gpu_machine.sh uses them; its setup lines are repeated here.
set -uo pipefail
cd "$(dirname "$0")/../.."
carry_dir=${CARRY_DIR:-.chromecarry}
parts=$(ls -d "$carry_dir"/part* 2>/dev/null)
[ -n "$parts" ] || { echo "no $carry_dir/partN carried" >&2; exit 2; }
what=${1:-}
shift || true
case "$what" in
  stage)
    python3 benchmarks/gpu_browser/chromium_carry.py stage $parts ;;
  run)
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    export XDG_RUNTIME_DIR=/tmp/xdg PYTHONUNBUFFERED=1
    mkdir -p /tmp/xdg && chmod 700 /tmp/xdg
    # --upgrade: a warm machine keeps /tmp/gd_new from an earlier call, which pip would leave as it is
    python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-compile --target /tmp/gd_new . 2>/dev/null
    # desktop wgpu beside the page (demo_chromium.py desktop_decode): the wheels of .whl/ when carried
    site=/tmp/gd_new
    if ls .whl/wgpu-*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      site=/tmp/gd_new:/tmp/site
    fi
    python3 benchmarks/gpu_browser/chromium_carry.py unpack $parts || exit
    dest=$(python3 benchmarks/gpu_browser/chromium_carry.py where "$carry_dir")
    out=${OUT:-/tmp/demo-chromium}
    mkdir -p "$out"
    # what the headless shell would still miss here (none expected): the first thing to read if it fails
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
      LD_LIBRARY_PATH=$dest/chrome/ldpath ldd $dest/chrome/chromium-headless-shell | grep "not found"
      ls /usr/local/nvidia/share/vulkan/icd.d/ 2>&1; } | tee "$out/gpu.txt"
    PYTHONPATH=$site python3 benchmarks/gpu_browser/demo_chromium.py --carried "$dest" \
      --out "$out" "$@" 2> "$out/chrome.log"
    rc=$?
    grep -v "pw:browser" "$out/chrome.log" | tail -15
    exit $rc ;;
  *)
    echo "usage: [CARRY_DIR=.chromecarry_pages] $0 stage|run [demo_chromium.py ARGS, e.g. --pages]" >&2; exit 2 ;;
esac
