"""Casts and broadcasts under autocast's rules (private)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._tree import convert_floating
from jaxamp._tree import is_floating_array

if TYPE_CHECKING:
    from jaxamp._autocast._context import _Context


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _as_written(x: Any) -> Any:
    """What ``fn`` is traced with for the argument ``x``: a bf16 or fp16 array as fp32, the
    model as written (the train step hands it half-precision working params). Traced with
    half-precision arguments, JAX's own casts (``jnp.sum`` and ``jnp.mean`` of a half array
    sum in fp32 and round the sum back to half) and the dtypes of custom derivatives and of
    :func:`full_precision` regions would be the half ones. It is ``x``'s type with the dtype
    changed (its sharding and varying axes kept), not a cast: ``fn`` is evaluated on ``x``
    itself, and a cast would be differentiated for nothing (0.4 s of the NNX GPT's trace)."""
    if not (is_floating_array(x) and x.dtype in _HALF):
        return x
    return jax.typeof(x).update(dtype=jnp.dtype(jnp.float32), weak_type=False)


_cast = convert_floating


def _cast_constant(x: Any, dtype: Any) -> Any:
    """A compile-time constant in ``dtype``: a finite value past ``dtype``'s range becomes its
    finite extreme, as a mask constant is meant (Gemma masks logits with ``-2.3819763e38``,
    which fp16 would turn into ``-inf``, and a fully masked row into nan); an infinity stays
    one. A concrete value is clipped in numpy, at trace time, with no warning."""
    if not is_floating_array(x) or jnp.dtype(x.dtype) == jnp.dtype(dtype):
        return x
    big = float(jnp.finfo(dtype).max)
    if float(jnp.finfo(x.dtype).max) <= big:
        return _cast(x, dtype)
    if isinstance(x, np.ndarray | np.generic):
        x = np.where(np.isfinite(x), np.clip(x, -big, big), x)
        return np.asarray(x).astype(dtype)
    return _cast(jnp.where(jnp.isfinite(x), jnp.clip(x, -big, big), x), dtype)


def _downcast_source(ctx: _Context, x: Any) -> Any:
    """An fp32 value that ``fn`` upcast from the compute dtype goes back to that value rather
    than through a second cast: exact, and the matmul then saves the original (often a param,
    an argument) instead of a new copy for the backward pass."""
    source = ctx.call.facts.upcast_from(x)
    if source is not None and jnp.dtype(source.dtype) == ctx.compute:
        return source
    return x


def _broadcast(x: jax.Array, shape: tuple, dims: tuple, sharding: Any = None) -> jax.Array:
    """``broadcast_in_dim`` whose gradient, a sum over the broadcast axes, runs in fp32: the
    gradient of a bias sums a whole batch of half-precision cotangents. The broadcast is of
    ``x`` in fp32, rounded back: exact, and XLA drops the pair of casts; the transpose casts
    the cotangent to fp32, sums it there, and rounds the sum once."""
    wide = lax.broadcast_in_dim(x.astype(jnp.float32), shape, dims, out_sharding=sharding)
    return wide.astype(x.dtype)


def _is_half_broadcast(eqn: Any, invals: list) -> bool:
    if eqn.primitive.name != "broadcast_in_dim" or len(invals) != 1:
        return False
    x = invals[0]
    return (is_floating_array(x) and jnp.dtype(x.dtype) != jnp.float32
            and math.prod(eqn.outvars[0].aval.shape) > math.prod(x.shape))


_ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem",
                          "nextafter", "select_n", "clamp"})


def _broadcast_operands(eqn: Any, invals: list) -> list:
    """An elementwise op broadcasts size-1 axes implicitly, and its gradient sums them in the
    cotangent's dtype: broadcast half-precision operands first, through ``_broadcast``."""
    shape = tuple(eqn.outvars[0].aval.shape)
    out = []
    for x in invals:
        if (is_floating_array(x) and jnp.dtype(x.dtype) != jnp.float32 and x.ndim == len(shape)
                and tuple(x.shape) != shape):
            x = _broadcast(x, shape, tuple(range(len(shape))))
        out.append(x)
    return out
