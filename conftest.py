"""Runs every test and doctest on 8 virtual CPU devices (set before jax is imported).

The tests share JAX's persistent compilation cache (in .cache/, which `make clean` removes):
the many subprocesses (the CLI, the examples, the notebooks) compile the same tiny models, and
an executable compiled once is loaded from disk by the next process. It changes no result: an
entry is keyed by the program, the jax version and the compiler flags.

`make test` adds XLA flags of its own (LLVM -O0, and XLA:CPU's legacy fusion emitters where
jaxlib has them: the Makefile's TEST_XLA_FLAGS and FAST_CPU_COMPILE); whatever XLA_FLAGS holds
reaches every subprocess the tests start.
"""

import os
import pathlib

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(__file__).resolve().parent / ".cache" / "jax-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

# The old module paths (jaxamp/policy.py and the like) warn on import: they hold no doctest, and
# tests/test_package.py imports them under pytest.warns.
collect_ignore = [str(p) for p in (pathlib.Path(__file__).resolve().parent / "jaxamp").glob("*.py")
                  if "_deprecated.alias(__name__)" in p.read_text()]
