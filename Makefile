# `make test` and `make demo` work on a fresh machine: each creates .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

export JAX_PLATFORMS := cpu
export MPLBACKEND := Agg
export NO_MKDOCS_2_WARNING := 1

.PHONY: test demo bench lint typecheck docs dist clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[dev,train,bench,docs]'
	touch $(STAMP)

# The suite runs on TEST_WORKERS processes (pytest-xdist); a module whose tests share a
# module-scoped fixture is one xdist group, run by one worker.
TEST_WORKERS ?= 2

test: $(STAMP) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15 jaxamp tests

lint: $(STAMP) typecheck
	$(VENV)/bin/ruff check jaxamp tests train benchmarks examples docs/_ext

# Both type checkers gate: mypy, and pyright in basic mode ([tool.pyright] in pyproject.toml).
typecheck: $(STAMP)
	$(VENV)/bin/mypy jaxamp
	$(VENV)/bin/pyright

# The documentation site, built into site/ in strict mode (mkdocs.yml): a broken reference, a
# public name without a docstring or an API entry, or a notebook that fails to render fails it.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --clean

# The wheel and the sdist, built in an isolated environment and checked for PyPI.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(VENV)/bin/twine check --strict dist/*

demo: $(STAMP)
	$(PY) -m train --compare auto,mixed_float16 --workdir runs/demo

bench: $(STAMP)
	$(PY) -m benchmarks overhead
	$(PY) -m benchmarks memory
	$(PY) -m benchmarks torch

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis runs site dist .cache
