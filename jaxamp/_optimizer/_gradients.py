"""The code of :mod:`jaxamp.gradients`: one pass over the gradients (the finite check, the
global norm, the first non-finite leaf)."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxamp._tree import floating_leaves
from jaxamp._tree import floating_leaves_with_path
from jaxamp._tree import tree_path_str

__all__ = ["GradStats", "all_finite", "grad_stats", "nonfinite_leaf_path", "tree_path_str"]


def all_finite(tree: Any) -> jax.Array:
    """A scalar bool: True when every element of every floating leaf of ``tree`` is finite.

    Non-floating leaves are ignored; an empty tree is finite.

    >>> import jax.numpy as jnp
    >>> bool(all_finite({"a": jnp.ones(3), "b": jnp.arange(2)}))
    True
    >>> bool(all_finite([jnp.ones(3), jnp.array([1.0, jnp.inf])]))
    False
    """
    leaves = floating_leaves(tree)
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


class GradStats(NamedTuple):
    """What one pass over the gradients tells: see :func:`grad_stats`.

    >>> import jax.numpy as jnp
    >>> grad_stats({"w": jnp.array([3.0, 4.0])})._fields
    ('finite', 'norm', 'nonfinite_leaves', 'first_nonfinite_leaf')
    """

    finite: jax.Array
    """A bool scalar: True when the fp32 sum of squares of all the gradients is finite (no inf
    or nan, and no overflow)."""
    norm: jax.Array
    """The global L2 norm of the gradients, an fp32 scalar, divided by ``scale`` when one is
    given."""
    nonfinite_leaves: jax.Array
    """An int32 scalar: the number of floating leaves whose sum of squares is inf or nan."""
    first_nonfinite_leaf: jax.Array
    """An int32 scalar: the index of the first non-finite floating leaf in tree order, or -1;
    :func:`nonfinite_leaf_path` gives its path."""


def _sum_of_squares(x: jax.Array) -> jax.Array:
    """``sum(x**2)`` accumulated in fp32, as one dot that contracts every axis.

    A dot with fp32 accumulation reads the leaf once in its own dtype (on XLA:CPU a
    convert-square-sum materialises an fp32 copy first), and fp16 inputs are multiplied in
    fp32, so squares of large scaled fp16 gradients do not overflow. No reshape: flattening a
    gradient sharded along a minor axis would all-gather it, while a contraction over a
    sharded axis leaves a partial sum per device and one scalar all-reduce.

    On a mesh's ``Explicit`` axes the leaf's type names its split, and JAX asks a contraction
    over a split axis where its result goes: a replicated scalar, on the leaf's mesh.
    """
    x = jnp.asarray(x)
    axes = tuple(range(x.ndim))
    sharding = jax.typeof(x).sharding
    split = any(p is not None for p in sharding.spec)  # only Explicit axes appear in a type
    return lax.dot_general(x, x, ((axes, axes), ((), ())), preferred_element_type=jnp.float32,
                           out_sharding=NamedSharding(sharding.mesh, P()) if split else None)


def grad_stats(grads: Any, scale: Any = None) -> GradStats:
    """``(finite, norm, nonfinite_leaves, first_nonfinite_leaf)`` from one pass over ``grads``.

    ``grads`` may be in any floating dtype and may still be multiplied by a loss ``scale``: the
    sums of squares are accumulated in fp32 and the norm is divided by ``scale``. A leaf is
    non-finite when its sum of squares is inf or nan: exactly when it holds an inf or nan, or
    when its (scaled) norm exceeds ~1.8e19, which is treated as an overflow too. One reduction
    that reads each gradient once serves the check, the norm and the per-leaf diagnosis.
    ``first_nonfinite_leaf`` is the index of the first non-finite floating leaf in tree order
    (-1 when all are finite); :func:`nonfinite_leaf_path` maps it back to its path.

    >>> import jax.numpy as jnp
    >>> ok, norm, bad, first = grad_stats({"a": jnp.array([3.0, 4.0]), "b": jnp.array([jnp.nan])})
    >>> bool(ok), int(bad), int(first)
    (False, 1, 1)
    >>> float(grad_stats({"a": jnp.array([30.0, 40.0])}, scale=10.0).norm)
    5.0
    """
    leaves = floating_leaves(grads)
    if not leaves:
        return GradStats(jnp.array(True), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32),
                         jnp.full((), -1, jnp.int32))
    sumsq = jnp.stack([_sum_of_squares(x) for x in leaves])
    total = jnp.sum(sumsq)
    bad = ~jnp.isfinite(sumsq)
    norm = jnp.sqrt(total)
    if scale is not None:
        norm = norm / jnp.asarray(scale, jnp.float32)
    first = jnp.where(bad.any(), jnp.argmax(bad), -1).astype(jnp.int32)
    return GradStats(jnp.isfinite(total), norm.astype(jnp.float32),
                     jnp.sum(bad).astype(jnp.int32), first)


def nonfinite_leaf_path(tree: Any, index: Any) -> str | None:
    """Maps ``first_nonfinite_leaf`` (from metrics or the optimizer state) to a tree path.

    ``tree`` is anything with the params' structure (the params, the master, the grads).
    Returns ``None`` for -1 (all finite). Host-side: call it on a fetched value.

    >>> nonfinite_leaf_path({"dense": {"bias": 0.0, "kernel": 0.0}}, 1)
    'dense/kernel'
    >>> nonfinite_leaf_path({"w": 0.0}, -1) is None
    True
    """
    index = int(np.asarray(index).reshape(-1)[0])
    if index < 0:
        return None
    leaves = floating_leaves_with_path(tree)
    if index >= len(leaves):
        raise ValueError(f"leaf index {index} is out of range for a tree with {len(leaves)} "
                         "floating leaves; pass the params the step was run with")
    return tree_path_str(leaves[index][0])
