#!/usr/bin/env bash
# The whole CPU/software-GPU suite: unit, property, fuzz, conformance (reference + wgpu on
# software Vulkan), model accuracy, core-in-Pyodide and the Playwright browser tests.
# pytest exits non-zero when no test ran (exit 5), so an empty run fails here too.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$PWD/.cache/xdg}"
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$PY" -m pytest -q -rs --durations=15 -p no:cacheprovider tests "$@"
