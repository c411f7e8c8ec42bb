"""The jax versions jaxamp is tested with, and a warning for a newer one (private).

jaxamp reads jaxprs (primitives' params, ``get_bind_params``, custom derivative rules) as
each jax release writes them, and pins what it reads in ``tests/test_jax_apis.py``; a jax
release after the newest tested one may have changed them. An upper bound in pyproject.toml
would keep users from a newer jax that works; a warning names the tested range instead, once.
"""

from __future__ import annotations

import warnings

import jax

# The floor (`make test`) and the newest minor release `make test-newest` runs on.
TESTED = ("0.10.2", "0.12")


def _parts(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def check(version: str = jax.__version__) -> bool:
    """Warns (once per process, by Python's default filter) when ``version`` is newer than the
    newest minor release tested; returns whether it is within the tested range."""
    newest = _parts(TESTED[1])
    if _parts(version)[:2] <= newest:
        return True
    warnings.warn(f"jaxamp is tested with jax {TESTED[0]} to {TESTED[1]}.x, and jax {version} "
                  "is newer: it reads jax's jaxprs, which a release may change; if something "
                  "breaks, install jax<" + f"{newest[0]}.{newest[1] + 1}", UserWarning,
                  stacklevel=3)
    return False
