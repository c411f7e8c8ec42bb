"""Tree helpers and constants shared by the modules of jaxamp (private: the public names are
re-exported).

One definition of a "floating leaf" for the whole library, so that every count of leaves (the
finite check, the norm, ``first_nonfinite_leaf`` and its path) agrees. ``None`` is never used
as a sentinel inside a ``jax.tree.map``: JAX treats it as an empty subtree, and params with
``None`` where a field holds no array (Equinox's ``eqx.partition``) are common.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Self
from typing import dataclass_transform

import jax
import jax.numpy as jnp
from jax import lax
from jax.core import Tracer
from jax.experimental.layout import Layout
from jax.experimental.layout import with_layout_constraint
from jax.typing import DTypeLike

# The half-precision dtypes a policy computes in (a master copy or compensation is kept for
# params of these), and the largest int32: the saturating counters stop there.
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
INT32_MAX = 2**31 - 1


def is_floating_array(x: Any) -> bool:
    """True for an array (or numpy scalar, or tracer) of a floating dtype."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def convert_floating(x: Any, dtype: Any) -> Any:
    """``x`` converted to ``dtype`` when it is a floating array of another dtype, else ``x``."""
    if is_floating_array(x) and jnp.dtype(x.dtype) != jnp.dtype(dtype):
        return lax.convert_element_type(x, dtype)
    return x


def wider_float(a: Any, b: Any) -> Any:
    """The floating dtype that holds both ``a`` and ``b`` (float32 for bfloat16 and float16),
    without JAX's promotion, which strict promotion refuses."""
    a, b = jnp.dtype(a), jnp.dtype(b)
    if a == b:
        return a
    if jnp.finfo(a).bits != jnp.finfo(b).bits:
        return a if jnp.finfo(a).bits > jnp.finfo(b).bits else b
    return jnp.dtype(jnp.float32)


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


def row_major_grads(grads: Any) -> Any:
    """Pins traced gradients of rank >= 2 to the default row-major layout.

    XLA:CPU emits a weight gradient ``x.T @ dy`` as the product ``dy.T @ x`` read through a
    column-major bitcast. Elementwise fusions read that layout for free, but the finite check
    (a reduction) and the ``lax.cond`` boundary of the skip each insert a transposing copy of
    every such gradient: two extra passes over the grads. Pinning the layout moves the
    transpose into the fusion that produces the gradient (its cast to the param dtype), so the
    step reads the grads once. On the encoder of ``python -m benchmarks overhead`` this takes
    the bytes accessed from 1.022x to 1.012x the bare bf16 step. The constraint changes no
    update; only the reported grad norm, an fp32 sum whose order follows the layout, may
    differ in its last bit. XLA's partitioner all-gathers a gradient sharded over a mesh to
    pin it, and TPUs have tiled layouts: the train step pins only on XLA:CPU, for params on
    one device (``make_train_step(pin_grad_layout=None)``).
    """
    def pin(g):
        if isinstance(g, Tracer) and getattr(g, "ndim", 0) >= 2:
            return with_layout_constraint(g, Layout(tuple(range(g.ndim))))
        return g
    return jax.tree.map(pin, grads)


def in_made_order(tree: Any, order: Any) -> Any:
    """``tree`` with each leaf held back (an optimization barrier) until the leaf made before
    it is made: ``order`` ranks the leaves (:func:`jaxamp._jaxpr.made_order`). The values are
    unchanged.

    The train step orders its gradients this way, in the order the backward pass makes them.
    Every gradient goes to one finite check before the update may use any of them, and
    without an order XLA:GPU's scheduler is free to run the whole chain of input gradients
    first and every weight gradient at the end, keeping each layer's activations alive until
    then: ResNet-50's bf16 step at batch 256 needed 12.40 GB on an H200 that way, 11.04 with
    its gradients in order (the same step with no finite check: 11.00)."""
    leaves, treedef = jax.tree.flatten(tree)
    ranks = jax.tree.leaves(order)
    if len(ranks) != len(leaves):
        raise ValueError(f"{len(ranks)} ranks for {len(leaves)} leaves")
    before = None
    for i in sorted(range(len(leaves)), key=lambda i: ranks[i]):
        if before is not None:
            leaves[i], _ = lax.optimization_barrier((leaves[i], before))
        before = leaves[i]
    return jax.tree.unflatten(treedef, leaves)


def static_field(default: Any = dataclasses.MISSING) -> Any:
    """A field of a :class:`State` that is treedef metadata, not a leaf."""
    return dataclasses.field(default=default, metadata={"static": True})


@dataclass_transform(frozen_default=True, field_specifiers=(static_field,))
class State:
    """The one way jaxamp defines a state class: a subclass is a frozen dataclass registered
    as a pytree, whose fields made with :func:`static_field` are treedef metadata and the
    others children (the loss scales, :class:`~jaxamp.TrainState`,
    :class:`~jaxamp.fp8.Fp8State`; the optax state :class:`~jaxamp.state.MixedPrecisionState` is a
    ``NamedTuple``, as optax's own states are). ``class S(State, kw_only=True)`` makes every
    field keyword-only.

    Unlike ``flax.struct`` (``register_dataclass``), rebuilding from leaves does not call
    ``__init__``: ``jax.tree.map(lambda x: 0, state)`` or a vmap ``in_axes`` tree must give
    back exactly the leaves it was handed, while a caller's values are still checked and
    converted at construction. Both functions derive the field lists from the dataclass, so no
    field can be dropped.
    """

    def __init_subclass__(cls, *, kw_only: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True, eq=False, kw_only=kw_only)(cls)
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        data = tuple(f.name for f in fields if not f.metadata.get("static"))
        meta = tuple(f.name for f in fields if f.metadata.get("static"))

        def flatten_with_keys(obj):
            children = [(jax.tree_util.GetAttrKey(n), getattr(obj, n)) for n in data]
            return children, tuple(getattr(obj, n) for n in meta)

        def flatten(obj):
            return [getattr(obj, n) for n in data], tuple(getattr(obj, n) for n in meta)

        def unflatten(aux, children):
            obj = object.__new__(cls)
            for name, value in zip(data, children, strict=True):
                object.__setattr__(obj, name, value)
            for name, value in zip(meta, aux, strict=True):
                object.__setattr__(obj, name, value)
            return obj

        jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields changed (``dataclasses.replace``: ``__init__`` runs, so the
        values are checked again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]
