# The two commands of the README:
#   make demo   set up (isolated .venv, CPU torch if missing, the extension) and run the demo
#   make test   set up (the same, plus the test-only packages) and run the whole test suite
# PYTHON=python3 make test uses an existing interpreter that already has torch (e.g. a CUDA torch
# on a GPU machine) instead of creating .venv. Both are quick when nothing has changed.
#   make test-newest   the adapter tests against the newest transformers and TransformerLens
# Every install takes constraints.txt (known-good versions), so that a fresh machine is reproducible.

PYTHON ?=
TORCH_CPU_PIN := torch==2.13.0
BUILD_TOOLS := scikit-build-core>=0.10 pybind11>=2.12 cmake>=3.27 ninja
# The demo's packages: the analysis extra, and transformers for its trained fixtures (section 6).
ANALYSIS_TOOLS := pandas matplotlib tqdm transformers>=5.24
# Only the tests need these (the adapters' oracle tests build models from configs). transformer-lens
# 3.x still has HookedTransformer; 4.0 removed it (TransformerBridge remains). The tests run against
# both: 3.x in the environment, and 4.x beside it in $(TL4_DIR) (its dependencies are a subset of
# 3.x's, so --no-deps), where tests/test_transformer_lens_versions.py runs the adapter tests again.
# It pulls in wandb, datasets and pyarrow, so the demo's set-up leaves it out.
TEST_TOOLS := pytest hypothesis transformers>=5.24 transformer-lens>=3.9,<4 triton>=3.6
# 4.x beside 3.x: pinned here, as constraints.txt pins 3.x (test-newest takes the newest 4.x).
TL4_PIN := transformer-lens==4.3.0
CONSTRAINTS := -c constraints.txt
TL4_DIR := build/transformer-lens-4
INSTALL_TL4 = rm -rf $(TL4_DIR) && $(PY) -m pip install --quiet --no-deps --target $(TL4_DIR) "$(TL4_PIN)"
# A failed install: an error where the CI variable is set (CI must run the tests against 4.x), a
# note elsewhere (an offline machine skips them).
TL4_FAILED = { if [ -n "$$CI" ]; then echo "error: $(TL4_PIN) could not be installed into $(TL4_DIR); CI=$$CI \
	needs the tests against it" >&2; exit 1; fi; echo "note: $(TL4_PIN) not installed; the tests against it will be skipped"; }

ifeq ($(strip $(PYTHON)),)
# Our own environment: install everything it needs. numpy comes before torch, which would otherwise
# warn "Failed to initialize NumPy" until numpy arrives.
PY := .venv/bin/python
VENV := .venv/bin/python
INSTALL_TORCH = $(PY) -c "import torch" 2>/dev/null || ($(PY) -m pip install --quiet numpy && \
	echo "== installing $(TORCH_CPU_PIN) (CPU) into .venv" && $(PY) -m pip install "$(TORCH_CPU_PIN)")
INSTALL_TOOLS = $(PY) -m pip install --quiet -c $(STAMPS)/torch.txt $(CONSTRAINTS) \
	$(foreach t,numpy $(BUILD_TOOLS) $(ANALYSIS_TOOLS),"$(t)")
INSTALL_TEST_TOOLS = $(PY) -m pip install --quiet -c $(STAMPS)/torch.txt $(CONSTRAINTS) $(foreach t,$(TEST_TOOLS),"$(t)")
else
# The caller's environment (maybe offline, e.g. a GPU machine): install only what is missing; the
# analysis and adapter packages are optional there (their tests are skipped without them).
PY := $(PYTHON)
VENV :=
INSTALL_TORCH = $(PY) -c "import torch" || (echo "PYTHON=$(PYTHON) has no torch" && false)
INSTALL_TOOLS = ($(PY) -c "import scikit_build_core, pybind11, numpy" 2>/dev/null || \
	$(PY) -m pip install --quiet $(foreach t,numpy $(BUILD_TOOLS),"$(t)")) && \
	($(PY) -c "import pandas, matplotlib, tqdm, transformers" 2>/dev/null || \
	$(PY) -m pip install --quiet --retries 0 --timeout 10 -c $(STAMPS)/torch.txt $(CONSTRAINTS) \
	$(foreach t,$(ANALYSIS_TOOLS),"$(t)") || \
	echo "note: $(ANALYSIS_TOOLS) not installed; their tests will be skipped")
INSTALL_TEST_TOOLS = ($(PY) -c "import pytest, hypothesis" 2>/dev/null || $(PY) -m pip install --quiet pytest hypothesis) && \
	($(PY) -c "import transformers, transformer_lens" 2>/dev/null || \
	$(PY) -m pip install --quiet --retries 0 --timeout 10 -c $(STAMPS)/torch.txt $(CONSTRAINTS) \
	$(foreach t,$(filter-out pytest hypothesis,$(TEST_TOOLS)),"$(t)") || \
	echo "note: transformers / transformer-lens not installed; the adapter tests will be skipped")
endif
STAMPS := build/stamps/$(subst /,_,$(PY))
SOURCES := CMakeLists.txt pyproject.toml $(shell find csrc cmake -type f 2>/dev/null)

.PHONY: demo test test-newest build setup bench lint clean

demo: build
	$(PY) -m pathkernels demo

test: build $(STAMPS)/test-env
	$(PY) -m pytest -q tests

# The newest transformers and TransformerLens (3.x's HookedTransformer and 4.x's bridge) beside the
# pinned environment, each in a folder of its own first on the path, and the adapter tests against
# them: the window docs/BUILD.md states, tried forwards. Their other dependencies stay as pinned.
NEWEST_DIR := build/newest
ADAPTER_TESTS := tests/test_adapters.py tests/test_capture_self_check.py tests/test_causal.py tests/test_masking.py \
	tests/test_model_families.py tests/test_real_models.py tests/test_real_models_transformer_lens.py tests/test_scores.py \
	tests/test_transcoder_paths.py tests/test_causal_features.py tests/test_score_features.py tests/test_cross_layer_paths.py \
	tests/test_parallel_block_paths.py tests/test_post_norm_paths.py
test-newest: build $(STAMPS)/test-env
	rm -rf $(NEWEST_DIR) && $(PY) -m pip install --quiet --no-deps --target $(NEWEST_DIR)/3 transformers "transformer-lens<4" \
		&& $(PY) -m pip install --quiet --no-deps --target $(NEWEST_DIR)/4 "transformer-lens>=4"
	PYTHONPATH=$(NEWEST_DIR)/3 $(PY) -c "import importlib.metadata as m; print('== newest: transformers', \
		m.version('transformers'), '| transformer-lens', m.version('transformer-lens'))"
	PYTHONPATH=$(NEWEST_DIR)/4 $(PY) -c "import importlib.metadata as m; print('== and transformer-lens', m.version('transformer-lens'))"
	PYTHONPATH=$(NEWEST_DIR)/3 $(PY) -m pytest -q -p no:cacheprovider $(ADAPTER_TESTS)
	PYTHONPATH=$(NEWEST_DIR)/4:$(NEWEST_DIR)/3 PATHKERNELS_EXPECT_TRANSFORMER_LENS=4 $(PY) -m pytest -q -p no:cacheprovider \
		$(ADAPTER_TESTS) tests/test_readme.py -k "transformer_lens or bridge"

bench: build
	$(PY) bench/bench_norms.py
	$(PY) bench/bench_paths.py --quick

lint: $(STAMPS)/env
	$(PY) -m pip install --quiet "ruff==0.17.6"
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

build: $(STAMPS)/built
setup: $(STAMPS)/env

.venv/bin/python:
	@echo "== creating .venv"
	python3 -m venv .venv

$(STAMPS)/env: pyproject.toml Makefile constraints.txt | $(VENV)
	@$(INSTALL_TORCH)
	@mkdir -p $(STAMPS) && $(PY) -c "import torch; print('torch==' + torch.__version__)" > $(STAMPS)/torch.txt
	@echo "== installing the build tools and the analysis packages ($(ANALYSIS_TOOLS))"
	@$(INSTALL_TOOLS)
	@mkdir -p $(STAMPS) && touch $@

$(STAMPS)/test-env: $(STAMPS)/env
	@echo "== installing the test packages (pytest, hypothesis, transformers, transformer-lens: a few minutes the first time)"
	@$(INSTALL_TEST_TOOLS)
	@echo "== installing $(TL4_PIN) beside it, into $(TL4_DIR), for the adapter tests against 4.x"
	@$(INSTALL_TL4) || $(TL4_FAILED)
	@touch $@

$(STAMPS)/built: $(STAMPS)/env $(SOURCES)
	@echo "== compiling the C++ extension (about 1-4 minutes on 2 cores; CUDA kernels too when torch has CUDA)"
	$(PY) -m pip install --no-build-isolation --no-deps -e .
	@mkdir -p $(STAMPS) && touch $@

clean:
	rm -rf build .venv
