# The two commands of the README:
#   make demo   set up (isolated .venv, CPU torch if missing, the extension) and run the demo
#   make test   set up and run the whole test suite
# PYTHON=python3 make test uses an existing interpreter that already has torch (e.g. a CUDA torch
# on a GPU machine) instead of creating .venv. Both are quick when nothing has changed.

PYTHON ?=
TORCH_CPU_PIN := torch==2.13.0
BUILD_TOOLS := scikit-build-core>=0.10 pybind11>=2.12 cmake>=3.27 ninja numpy pytest

ifeq ($(strip $(PYTHON)),)
PY := .venv/bin/python
else
PY := $(PYTHON)
endif
STAMPS := build/stamps/$(subst /,_,$(PY))
SOURCES := CMakeLists.txt pyproject.toml $(shell find csrc pathkernels -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' -o -name '*.py' \) 2>/dev/null)

.PHONY: demo test build setup bench clean

demo: build
	$(PY) -m pathkernels demo

test: build
	$(PY) -m pytest -q tests

bench: build
	$(PY) bench/bench_norms.py

build: $(STAMPS)/built
setup: $(STAMPS)/env

.venv/bin/python:
	python3 -m venv .venv

$(STAMPS)/env: pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_CPU_PIN)"
	$(PY) -m pip install --quiet $(foreach t,$(BUILD_TOOLS),"$(t)")
	@mkdir -p $(STAMPS) && touch $@

$(STAMPS)/built: $(STAMPS)/env $(SOURCES)
	$(PY) -m pip install --no-build-isolation --no-deps -e .
	@mkdir -p $(STAMPS) && touch $@

clean:
	rm -rf build .venv
