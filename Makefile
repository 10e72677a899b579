# The two entry points of the README; everything else is their plumbing.
#   make bench   set up .venv, build, run the operator benchmark on the default device
#   make test    set up .venv, build, run the test suite
# TORCH_SPEC picks the torch to install (the default is the CPU build this project's CI uses;
# on a GPU machine pass a CUDA build, e.g. TORCH_SPEC=torch==2.11.0).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
DEPS := $(VENV)/.deps-installed

.PHONY: bench test build setup clean

bench: build
	$(BIN)/python tools/benchmark_op.py

test: build
	$(BIN)/python -m pytest -q

build: $(DEPS)
	$(BIN)/python setup.py -q build_ext --inplace

setup: $(DEPS)

# mmcv has no wheels on PyPI: it builds its ops from the sdist against the installed torch, which
# needs --no-build-isolation and a setuptools that still has pkg_resources (about 10 minutes).
$(DEPS):
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip "setuptools>=77,<82" wheel ninja
	$(BIN)/pip install -q "$(TORCH_SPEC)" numpy
	$(BIN)/pip install -q --no-build-isolation "mmcv==2.1.0"
	$(BIN)/pip install -q "mmengine>=0.10,<1" "mmdet==3.3.0" pytest hypothesis matplotlib tqdm
	$(BIN)/pip install -q --no-build-isolation --no-deps -e .
	touch $@

clean:
	rm -rf build *.egg-info mmdeform_tma/_C*.so
