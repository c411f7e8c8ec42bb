# `make test` and `make demo` work on a fresh machine: each creates .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

# pip without byte-compiling what it installs (Python compiles a module when it is first
# imported): the newest jax's environment installs in half the time.
PIP_INSTALL := -m pip install --quiet --no-compile

export JAX_PLATFORMS := cpu
export MPLBACKEND := Agg
export NO_MKDOCS_2_WARNING := 1

.PHONY: test test-all test-newest install-newest install-gpu-memory test-gpu-memory gpu-memory demo bench \
	lint typecheck docs dist clean install-zoo test-zoo

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL) --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) $(PIP_INSTALL) -e '.[dev,train,bench,docs]'
	touch $(STAMP)

# The suite runs on TEST_WORKERS processes (pytest-xdist); a module whose tests share a
# module-scoped fixture is one xdist group, run by one worker.
TEST_WORKERS ?= 2

# XLA:CPU compiles the floor's and the newest jax's tests at LLVM -O0 (a quarter of the
# suite's time, a third of the newest lane's): every test compares programs built the same
# way, or within a stated tolerance. `make test-zoo` trains third-party models at XLA's
# defaults, the code generation users get.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true
# Where jaxlib still has XLA:CPU's legacy fusion emitters (before 0.11; a later XLA aborts on
# the flag), the tests compile with them, in one LLVM module: 3x less compile time than the
# fusion emitters at -O0, half the floor's cold `make test`. $(call FAST_CPU_COMPILE,python).
FAST_CPU_COMPILE = $(shell $(1) -c 'import jaxlib.version as v; print("--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1" if v.__version_info__ < (0, 11) else "")')

# `make test` (CI) leaves out the tests marked slow (pyproject.toml's markers): the benchmark
# suites' tiny passes but the numerics protocol's, four of the five notebooks, the kill -9
# crash test, the CLI's parallel layouts, 600 fp16 steps. `make test-all` runs every test.
TEST_SELECT ?= -m "not slow"

test: $(STAMP) lint
	@echo "make test: about 8 minutes on a 2-core machine from a fresh clone, the install of .venv included (lint and type checks, then the tests on 2 workers)"
	XLA_FLAGS="$(XLA_FLAGS) $(TEST_XLA_FLAGS) $(call FAST_CPU_COMPILE,$(PY))" \
		$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25 $(TEST_SELECT) \
		jaxamp tests $(GPU_MEMORY_TESTS:%=--ignore=%) --ignore=$(ZOO_TESTS)

test-all:
	$(MAKE) test TEST_SELECT=

# Third-party model packages as they ship, under autocast in bf16 and fp16: Google DeepMind's
# recurrentgemma (Griffin) and penzai's Llama-like transformer, on the floor's jax, flax and
# optax (Python 3.11), in their own environment, .venv-zoo: recurrentgemma pins numpy < 2.4,
# which the floor's environment does not hold.
VENV_ZOO := .venv-zoo
STAMP_ZOO := $(VENV_ZOO)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
ZOO_TESTS := tests/zoo
ZOO_PACKAGES := recurrentgemma==1.0.1 penzai==0.2.5

$(STAMP_ZOO): pyproject.toml Makefile
	rm -rf $(VENV_ZOO)
	$(PYTHON) -m venv $(VENV_ZOO)
	$(VENV_ZOO)/bin/python $(PIP_INSTALL) --upgrade pip
	$(VENV_ZOO)/bin/python $(PIP_INSTALL) -e '.[dev]' $(ZOO_PACKAGES)
	$(VENV_ZOO)/bin/python -c "import jax, flax, recurrentgemma, penzai; print('zoo:', 'jax', jax.__version__, 'flax', flax.__version__)"
	touch $(STAMP_ZOO)

install-zoo: $(STAMP_ZOO)

test-zoo: $(STAMP_ZOO)
	$(VENV_ZOO)/bin/python -m pytest -q -s -p no:cacheprovider --durations=5 $(ZOO_TESTS)

# The library's unit tests and doctests on the newest jax, flax and optax the registry serves,
# on Python 3.12 (jax 0.12 needs it), in their own environment: .venv-newest, built when it is
# missing or pyproject.toml changes, with `pip install --upgrade` of the four. `make test` runs
# everything on the pinned floor (jax 0.10.2 on this machine's Python 3.11).
PYTHON_NEWEST ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python) \
                             $(shell python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null))
VENV_NEWEST := .venv-newest
STAMP_NEWEST := $(VENV_NEWEST)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# The unit tests of the code that reaches into jax's own machinery, which a jax release can
# change: jaxpr interpretation (autocast, the audit, the overflow report), sharding, pmap and
# shard_map, FP8 dtypes and dot_general, custom derivatives, the step's transformations, and
# the private APIs pinned in test_jax_apis.py. The optimizer wrappers' arithmetic (the loss
# scale, the master weights and their storage, the policies, the wrapping) is plain jnp and
# lax and runs once, on the floor.
UNIT_TESTS := tests/test_gradients.py tests/test_overflow.py tests/test_autocast.py \
	tests/test_autocast_programs.py tests/test_attention_structure.py \
	tests/test_auditing.py tests/test_train_step.py tests/test_sharding.py \
	tests/test_parallel.py tests/test_fp8.py tests/test_ops.py tests/test_jax_apis.py

$(STAMP_NEWEST): pyproject.toml
	@test -n "$(PYTHON_NEWEST)" || { echo "make test-newest: no python3.12 found; set PYTHON_NEWEST" >&2; exit 2; }
	rm -rf $(VENV_NEWEST)
	$(PYTHON_NEWEST) -m venv $(VENV_NEWEST)
	$(VENV_NEWEST)/bin/python $(PIP_INSTALL) --upgrade pip
	$(VENV_NEWEST)/bin/python $(PIP_INSTALL) -e '.[dev,train]'
	$(VENV_NEWEST)/bin/python $(PIP_INSTALL) --upgrade jax jaxlib flax optax
	$(VENV_NEWEST)/bin/python -c "import jax, flax, optax; print('newest:', 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__)"
	touch $(STAMP_NEWEST)

install-newest: $(STAMP_NEWEST)

test-newest: $(STAMP_NEWEST)
	XLA_FLAGS="$(XLA_FLAGS) $(TEST_XLA_FLAGS)" \
		$(VENV_NEWEST)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup \
		--durations=10 -p no:cacheprovider $(TEST_SELECT) jaxamp $(UNIT_TESTS) \
		--ignore=jaxamp/_diagnoses/_memory.py

# XLA:GPU's compiler on this machine, no GPU: jax's CUDA 13 plugin (it installs on Linux without a
# GPU or a driver) at the versions of the H200 run (Python 3.12, jax 0.11.2, flax 0.12.10), in
# .venv-gpu. `make gpu-memory` compiles every JAX row of the gpu suite for an H200 and reports
# its memory; `make test-gpu-memory` runs jaxamp.memory's tests and doctests there (the other
# lanes have no XLA:GPU, and leave these files out).
VENV_GPU := .venv-gpu
STAMP_GPU := $(VENV_GPU)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
GPU_MEMORY_TESTS := jaxamp/_diagnoses/_memory.py tests/gpu_memory
GPU_MEMORY_OUT ?= runs/gpu-memory

# A Python 3.12 venv ($(1)) with the GPU machine's jax (0.11.2, and its CUDA 13 plugin for
# XLA:GPU's compiler), flax and optax, and jaxamp's dev, train and gpu-memory extras; $(2) is
# the make target that builds it, for the error without python3.12.
define GPU_VENV
	@test -n "$(PYTHON_NEWEST)" || { echo "make $(2): no python3.12 found; set PYTHON_NEWEST" >&2; exit 2; }
	rm -rf $(1)
	$(PYTHON_NEWEST) -m venv $(1)
	$(1)/bin/python $(PIP_INSTALL) --upgrade pip
	$(1)/bin/python $(PIP_INSTALL) -e '.[dev,train,gpu-memory]' \
		'jax[cuda13]==0.11.2' flax==0.12.10 optax==0.2.8 equinox
endef

$(STAMP_GPU): pyproject.toml
	$(call GPU_VENV,$(VENV_GPU),install-gpu-memory)
	$(VENV_GPU)/bin/python -c "import jax, jaxlib, flax; print('gpu-memory:', 'jax', jax.__version__, 'flax', flax.__version__)"
	touch $(STAMP_GPU)

install-gpu-memory: $(STAMP_GPU)

# `.ci/run` leaves out the memory goals (GPU_MEMORY_SELECT='-k "not memory_goal"'): their ten
# compiles take 3 minutes on 2 cores, which CI's 15 do not hold; the full models' figures are
# committed in benchmarks/results/gpu-deviceless-h200/ (`make gpu-memory`).
GPU_MEMORY_SELECT ?=

test-gpu-memory: $(STAMP_GPU)
	$(VENV_GPU)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=10 \
		-p no:cacheprovider $(GPU_MEMORY_SELECT) $(GPU_MEMORY_TESTS)

gpu-memory: $(STAMP_GPU)
	$(VENV_GPU)/bin/python -m benchmarks gpu --deviceless h200 --out $(GPU_MEMORY_OUT)

# MaxText's llama2 decoder under autocast against MaxText's own mixed precision
# (benchmarks/maxtext.py), in .venv-maxtext: .venv-gpu's packages (Python 3.12, jax 0.11.2 with
# its CUDA 13 plugin, for the H200 compile), maxtext 0.2.5 without its dependencies (its extras
# pin hundreds of packages and another jax), and the packages its config and model code import,
# each pinned and installed without its own dependencies, so that none of them moves jax.
# `make maxtext` trains and compiles every remat policy MaxText names under six arms (on 2
# cores: about 26 minutes).
VENV_MAXTEXT := .venv-maxtext
MAXTEXT_OUT ?= runs/maxtext
MAXTEXT_PACKAGES := maxtext==0.2.5 \
	omegaconf==2.4.0 jinja2==3.1.6 markupsafe==3.0.4 \
	pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	huggingface-hub==2.4.0 anyio==4.16.0 click==8.5.1 filelock==4.3.2 h11==0.16.0 \
	httpcore2==2.17.0 httpx2==2.17.0 truststore==0.10.5 \
	pathwaysutils==0.1.13 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 \
	annotated-doc==0.0.7 opentelemetry-api==1.45.3 \
	qwix==0.1.8 aqtp==0.9.0 \
	tokamax==0.0.17 immutabledict==4.3.1 xprof==2.24.2 fire==0.7.1 termcolor==3.3.0 six==1.17.0 \
	einshape==1.0 \
	transformers==5.25.0 tokenizers==0.23.3 safetensors==0.8.0 regex==2026.12.2 \
	grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 \
	drjax==0.2.1 tiktoken==0.14.0 sentencepiece==0.2.3 sympy==1.14.0 mpmath==1.3.0
STAMP_MAXTEXT := $(VENV_MAXTEXT)/.installed-$(shell { cat pyproject.toml; echo '$(MAXTEXT_PACKAGES)'; } | cksum | cut -d' ' -f1)

.PHONY: install-maxtext maxtext

$(STAMP_MAXTEXT): pyproject.toml
	$(call GPU_VENV,$(VENV_MAXTEXT),install-maxtext)
	$(VENV_MAXTEXT)/bin/python $(PIP_INSTALL) --no-deps $(MAXTEXT_PACKAGES)
	$(VENV_MAXTEXT)/bin/python -c "import jax, flax, maxtext; from maxtext.configs import pyconfig; from maxtext.utils import model_creation_utils; print('maxtext:', maxtext.__version__, 'jax', jax.__version__, 'flax', flax.__version__)"
	touch $(STAMP_MAXTEXT)

install-maxtext: $(STAMP_MAXTEXT)

maxtext: $(STAMP_MAXTEXT)
	$(VENV_MAXTEXT)/bin/python -m benchmarks maxtext --out $(MAXTEXT_OUT)

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
	rm -rf $(VENV) $(VENV_NEWEST) $(VENV_GPU) $(VENV_ZOO) .pytest_cache .hypothesis runs site \
		dist .cache
