# The two commands of the README:
#   make demo   set up (isolated .venv, CPU torch if missing, the extension) and run the demo
#   make test   set up and run the whole test suite
# PYTHON=python3 make test uses an existing interpreter that already has torch (e.g. a CUDA torch
# on a GPU machine) instead of creating .venv. Both are quick when nothing has changed.

PYTHON ?=
TORCH_CPU_PIN := torch==2.13.0
PY_TOOLS := scikit-build-core>=0.10 pybind11>=2.12 numpy pytest
ANALYSIS_TOOLS := pandas matplotlib tqdm
# transformer-lens 3.x still has HookedTransformer (the adapters' oracle tests build one); 4.0 removed it.
ADAPTER_TOOLS := transformers>=5.9 transformer-lens>=3.9,<4
BUILD_TOOLS := cmake>=3.27 ninja

ifeq ($(strip $(PYTHON)),)
# Our own environment: install everything it needs.
PY := .venv/bin/python
VENV := .venv/bin/python
INSTALL_TOOLS = $(PY) -m pip install --quiet -c $(STAMPS)/torch.txt \
	$(foreach t,$(PY_TOOLS) $(ANALYSIS_TOOLS) $(ADAPTER_TOOLS) $(BUILD_TOOLS),"$(t)")
else
# The caller's environment (maybe offline, e.g. a GPU machine): install only what is missing; the
# analysis extras are optional there (their tests are skipped without them).
PY := $(PYTHON)
VENV :=
INSTALL_TOOLS = ($(PY) -c "import scikit_build_core, pybind11, numpy, pytest" 2>/dev/null || \
	$(PY) -m pip install --quiet $(foreach t,$(PY_TOOLS),"$(t)")) && \
	($(PY) -c "import pandas, matplotlib, tqdm" 2>/dev/null || \
	$(PY) -m pip install --quiet --retries 0 --timeout 10 $(ANALYSIS_TOOLS) || \
	echo "note: $(ANALYSIS_TOOLS) not installed; their tests will be skipped") && \
	($(PY) -c "import transformers, transformer_lens" 2>/dev/null || \
	$(PY) -m pip install --quiet --retries 0 --timeout 10 -c $(STAMPS)/torch.txt $(foreach t,$(ADAPTER_TOOLS),"$(t)") || \
	echo "note: transformers / transformer-lens not installed; the adapter tests will be skipped")
endif
STAMPS := build/stamps/$(subst /,_,$(PY))
SOURCES := CMakeLists.txt pyproject.toml $(shell find csrc -type f 2>/dev/null)

.PHONY: demo test build setup bench clean

demo: build
	$(PY) -m pathkernels demo

test: build
	$(PY) -m pytest -q tests

bench: build
	$(PY) bench/bench_norms.py
	$(PY) bench/bench_paths.py --quick

build: $(STAMPS)/built
setup: $(STAMPS)/env

.venv/bin/python:
	python3 -m venv .venv

$(STAMPS)/env: pyproject.toml | $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_CPU_PIN)"
	@mkdir -p $(STAMPS) && $(PY) -c "import torch; print('torch==' + torch.__version__)" > $(STAMPS)/torch.txt
	$(INSTALL_TOOLS)
	@mkdir -p $(STAMPS) && touch $@

$(STAMPS)/built: $(STAMPS)/env $(SOURCES)
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	@mkdir -p $(STAMPS) && touch $@

clean:
	rm -rf build .venv
