"""Tree helpers and constants shared by the modules of jaxamp (private: the public names are
re-exported).

One definition of a "floating leaf" for the whole library, so that every count of leaves (the
finite check, the norm, ``first_nonfinite_leaf`` and its path) agrees. ``None`` is never used
as a sentinel inside a ``jax.tree.map``: JAX treats it as an empty subtree, and params with
``None`` where a field holds no array (Equinox's ``eqx.partition``) are common.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

# The half-precision dtypes a policy computes in (a master copy or compensation is kept for
# params of these), and the largest int32: the saturating counters stop there.
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
INT32_MAX = 2**31 - 1


def is_floating_array(x: Any) -> bool:
    """True for an array (or numpy scalar, or tracer) of a floating dtype."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def is_floating(x: Any) -> bool:
    """:func:`is_floating_array`, or a Python float: the leaves that are counted (in the
    gradient statistics and ``first_nonfinite_leaf``'s path) and unscaled."""
    return isinstance(x, float) or is_floating_array(x)


def is_inexact_array(x: Any) -> bool:
    """True for an array of a floating or complex dtype."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def floating_leaves_with_path(tree: Any) -> list[tuple[Any, Any]]:
    """``(path, leaf)`` for every floating leaf of ``tree``, in tree order."""
    return [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if is_floating(x)]


def floating_leaves(tree: Any) -> list[Any]:
    """Every floating leaf of ``tree``, in tree order."""
    return [x for _, x in floating_leaves_with_path(tree)]


def map_floating(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Applies ``fn`` to the floating array leaves of ``tree``; other leaves (Python numbers,
    ints, bools; ``None`` is an empty subtree) are kept as they are."""
    return jax.tree.map(lambda x: fn(x) if is_floating_array(x) else x, tree)


def cast_floating(tree: Any, dtype: DTypeLike) -> Any:
    """Casts the floating array leaves of ``tree`` to ``dtype``; the others are untouched."""
    return map_floating(lambda x: x.astype(dtype), tree)


def cast_like(new: Any, old: Any) -> Any:
    """Casts ``new``'s array leaves to the dtypes of ``old``'s (state dtypes are invariant)."""
    return jax.tree.map(lambda n, o: n.astype(o.dtype) if hasattr(o, "dtype") else n, new, old)


def select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Per-leaf ``jnp.where(pred, a, b)`` for array leaves; other (equal) leaves pass through."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b) if hasattr(a, "dtype") else a,
                        on_true, on_false)


def tree_path_str(path: Sequence[Any]) -> str:
    """Formats a ``jax.tree_util`` key path as ``'a/b/0/c'``, the form override regexes see.

    >>> import jax
    >>> paths = [tree_path_str(p) for p, _ in
    ...          jax.tree_util.tree_flatten_with_path({"dense": {"kernel": 1, "bias": 2}})[0]]
    >>> paths
    ['dense/bias', 'dense/kernel']
    """
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def find_with_path(tree: Any, cls: type) -> list[tuple[Any, Any]]:
    """``(path, node)`` for every node of type ``cls`` inside ``tree``, in tree order."""
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, cls))[0]
    return [(path, node) for path, node in found if isinstance(node, cls)]


def parents_along(tree: Any, path: Sequence[Any]) -> list[Any]:
    """The nodes that ``path`` walks through from the root of ``tree`` (the root first, the
    parent of the node at ``path`` last)."""
    nodes, node = [], tree
    for key in path:
        nodes.append(node)
        if isinstance(key, jax.tree_util.SequenceKey):
            node = node[key.idx]
        elif isinstance(key, jax.tree_util.DictKey):
            node = node[key.key]
        elif isinstance(key, jax.tree_util.GetAttrKey):
            node = getattr(node, key.name)
        else:  # FlattenedIndexKey of a custom node: its direct children, in order
            node = _children(node)[key.key]
    return nodes


def _children(node: Any) -> list[Any]:
    return jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0]
