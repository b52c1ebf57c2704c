# Every target builds its own virtual environment first. The pinned CPU build of torch is
# installed before the package, so the package's "torch>=2.1" is already met and pip never
# pulls the multi-gigabyte CUDA build. Override for other hardware, e.g.
#   make test TORCH_SPEC=torch==2.13.0 TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=
# test workers (pytest-xdist): the suite mostly waits on the processes it starts, so two at once on two cores
# take 3.6 minutes where one takes 6.2 (docs/perf.md); TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2
BENCH_ARGS ?=

BIN := $(VENV)/bin

.PHONY: setup test test-full bench clean gpu-test

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

# every point of the test matrices (each transport under every case), a few minutes more than test
test-full: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "" $(PYTEST_ARGS)

bench: setup
	$(BIN)/commlab bench $(BENCH_ARGS)

# The GPU suite in one command, with a python that already holds a CUDA build of torch (a GPU image's
# python3; pyzmq and msgpack must be importable there: docs/gpu.md says how to carry them as wheels).
gpu-test:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m commlab.tools.doctor
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -q -rs -p no:cacheprovider tests/gpu tests/test_doctor.py

clean:
	rm -rf $(VENV) build *.egg-info
