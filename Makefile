# `make test` and `make demo` work on a fresh machine: each creates .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

export JAX_PLATFORMS := cpu
export MPLBACKEND := Agg

.PHONY: test demo bench lint typecheck clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[dev,train,bench]'
	touch $(STAMP)

# The suite runs on TEST_WORKERS processes (pytest-xdist); a module whose tests share a
# module-scoped fixture is one xdist group, run by one worker.
TEST_WORKERS ?= 2

test: $(STAMP) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15 jaxamp tests

lint: $(STAMP)
	$(VENV)/bin/ruff check jaxamp tests train benchmarks examples
	$(VENV)/bin/mypy jaxamp

demo: $(STAMP)
	$(PY) -m train --compare auto,mixed_float16 --workdir runs/demo

bench: $(STAMP)
	$(PY) -m benchmarks overhead
	$(PY) -m benchmarks memory
	$(PY) -m benchmarks torch

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis runs
