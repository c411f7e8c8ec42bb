"""Puts tests/ on ``sys.path`` (pytest inserts a conftest's folder), so that the test modules in
tests/train/ and tests/benchmarks/ import the shared ``helpers`` module too."""

import jax
import pytest

# A test that reads one of these module fixtures is slow (see pyproject.toml's markers): each
# runs benchmark suites end to end at their tiny size (test_bench.py's every suite but numerics,
# test_gpu_suite.py's gpu suite in a process without jmp, equinox and torch).
SLOW_FIXTURES = {"tiny_runs", "gpu_tiny"}


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def strict_promotion():
    """Runs a test under ``jax.numpy_dtype_promotion("strict")``: any implicit promotion in the
    library's own arithmetic (an fp32 scale meeting a bf16 gradient, a weak Python scalar
    widening an int32 counter) is an error rather than a silent dtype change."""
    with jax.numpy_dtype_promotion("strict"):
        yield
