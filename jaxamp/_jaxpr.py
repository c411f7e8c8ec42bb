"""Small jaxpr walkers shared by the train step's promotion check (and the audit to come)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp

MATMUL_PRIMITIVES = ("dot_general", "conv_general_dilated")


def _subjaxprs(params: dict[str, Any]) -> Iterator[Any]:
    def visit(v):
        if hasattr(v, "eqns"):
            yield v
        elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
            yield v.jaxpr
        elif isinstance(v, tuple | list):
            for item in v:
                yield from visit(item)
    for value in params.values():
        yield from visit(value)


def iter_eqns(jaxpr: Any) -> Iterator[Any]:
    """Yields every equation of ``jaxpr`` and of the jaxprs nested in its equations."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _subjaxprs(eqn.params):
            yield from iter_eqns(sub)


def fp32_matmul_sites(jaxpr: Any) -> tuple[int, list[str]]:
    """Counts matmuls/convs in ``jaxpr`` and lists those with a float32 operand.

    Returns ``(total, sites)`` where each site is ``"primitive at file:line"``.
    """
    total, sites = 0, []
    for eqn in iter_eqns(jaxpr):
        if eqn.primitive.name not in MATMUL_PRIMITIVES:
            continue
        total += 1
        dtypes = [getattr(v.aval, "dtype", None) for v in eqn.invars]
        if any(d is not None and d == jnp.float32 for d in dtypes):
            sites.append(f"{eqn.primitive.name} at {_where(eqn)}")
    return total, sites


def _where(eqn: Any) -> str:
    try:
        from jax._src import source_info_util
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 - best effort, for messages only
        return "<unknown>"
