"""Puts tests/ on ``sys.path`` (pytest inserts a conftest's folder), so that the test modules in
tests/train/ and tests/benchmarks/ import the shared ``helpers`` module too."""

import jax
import pytest


@pytest.fixture
def strict_promotion():
    """Runs a test under ``jax.numpy_dtype_promotion("strict")``: any implicit promotion in the
    library's own arithmetic (an fp32 scale meeting a bf16 gradient, a weak Python scalar
    widening an int32 counter) is an error rather than a silent dtype change."""
    with jax.numpy_dtype_promotion("strict"):
        yield
