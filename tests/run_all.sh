#!/usr/bin/env bash
# The whole CPU/software-GPU suite: unit, property, fuzz, conformance (reference + wgpu on
# software Vulkan), model accuracy, core-in-Pyodide and the Playwright browser tests; then the
# Dawn tests (-m dawn) in a second pytest process.
# Why two processes: the Vulkan loader reads VK_DRIVER_FILES once per process, Dawn needs Mesa 25's
# lavapipe (make setup unpacks it into .cache/mesa25; Dawn finds no adapter on Debian 12's Mesa 22),
# and the wgpu-native tests keep the Mesa 22 lavapipe their tolerances and timings were set on.
# The Dawn process runs a deterministic sample of the conformance cases (tests/conftest.py,
# GPUDELEGATE_CONFORMANCE_SUBSET); GPUDELEGATE_DAWN_FULL=1 runs them all.
# pytest exits non-zero when no test ran (exit 5), so an empty run fails here too.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$PWD/.cache/xdg}"
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Both processes run whatever the first one's outcome; the exit status is the first failure's.
rc=0
"$PY" -m pytest -q -rs --durations=15 -p no:cacheprovider -m "not dawn" tests "$@" || rc=$?
DAWN_ICD=${DAWN_ICD:-$PWD/.cache/mesa25/lvp25.json}
subset=dawn
[ "${GPUDELEGATE_DAWN_FULL:-0}" = 1 ] && subset=
dawn_rc=0
if [ -f "$DAWN_ICD" ]; then
  VK_DRIVER_FILES="$DAWN_ICD" GPUDELEGATE_CONFORMANCE_SUBSET=$subset \
    "$PY" -m pytest -q -rs --durations=10 -p no:cacheprovider -m dawn tests "$@" || dawn_rc=$?
else
  # No Mesa 25 here (make setup unpacks it on Debian 12): the Dawn tests still run, and skip saying
  # that no Dawn adapter starts, unless the machine has a Vulkan driver Dawn accepts.
  GPUDELEGATE_CONFORMANCE_SUBSET=$subset "$PY" -m pytest -q -rs -p no:cacheprovider -m dawn tests "$@" || dawn_rc=$?
fi
[ "$rc" = 0 ] && rc=$dawn_rc
exit "$rc"
