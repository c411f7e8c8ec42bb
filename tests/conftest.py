"""Puts tests/ on ``sys.path`` (pytest inserts a conftest's folder), so that the test modules in
tests/train/ and tests/benchmarks/ import the shared ``helpers`` module too."""
