"""Values near the kept matmul outputs: recomputed in the backward pass, not saved (private)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._autocast._recompute import _VIEWS
from jaxamp._autocast._rules import rule_for
from jaxamp._jaxpr import MATMULS
from jaxamp._jaxpr import body as _jaxpr_body
from jaxamp._jaxpr import nested_stack
from jaxamp._jaxpr import sub_jaxprs
from jaxamp._tree import is_floating_array

if TYPE_CHECKING:
    from jaxamp._autocast._context import _Context


def _near_depth(ctx: _Context, values: Sequence[Any], const_in: Sequence[bool]) -> int | None:
    """How many elementwise ops ``values`` are from saved matmul outputs and cheap values
    (the deepest of them); ``None`` where one of them is not near."""
    facts = ctx.call.facts
    depth = 0
    for x, c in zip(values, const_in, strict=True):
        if c or not is_floating_array(x) or facts.cheap(x):
            continue
        near = facts.near(x)
        if near is None:
            return None
        depth = max(depth, near)
    return depth


def _mark_near(ctx: _Context, eqn: Any, invals: list, outs: list, outer: str,
               const_in: Sequence[bool]) -> None:
    """Records the outputs of an elementwise op on near values as near."""
    if not ctx.call.facts.recompute or (eqn.primitive.name not in _VIEWS
                            and not _pure_elementwise_like(ctx, eqn, outer)):
        return
    depth = _near_depth(ctx, invals, const_in)
    if depth is None:
        return
    ctx.call.facts.set_near_all(outs, depth + (0 if eqn.primitive.name in _VIEWS else 1))


def _pure_elementwise_like(ctx: _Context, eqn: Any, outer: str) -> bool:
    """An equation a region may hold: no effect, no matmul, no key, and no nested jaxpr but
    a jitted function (``jnp.take_along_axis``, ``jnp.where``) whose body is such equations."""
    if eqn.effects:
        return False
    # A jitted function, and a custom_jvp (``jax.nn.softmax``, ``relu``) whose primal is such
    # equations: in a region it is bound as it is, in fp32, its rule kept.
    body = _jaxpr_body(eqn, ("call", "custom") if eqn.primitive.name == "custom_jvp_call"
                       else ("call",))
    if body is not None:
        stack = nested_stack(eqn, outer)
        return all(_pure_elementwise_like(ctx, e, stack)
                   for e in getattr(body, "jaxpr", body).eqns)
    if next(sub_jaxprs(eqn), None) is not None or eqn.primitive.name in MATMULS:
        return False
    dtypes = (getattr(v.aval, "dtype", None) for v in (*eqn.invars, *eqn.outvars))
    if any(d is not None and jnp.issubdtype(d, jax.dtypes.prng_key) for d in dtypes):
        return False
    return rule_for(ctx, eqn, nested_stack(eqn, outer)).joins_region
