"""The FP8 layers of Flax NNX: :class:`Fp8Meta`, :class:`DotGeneral`, :class:`EinsumOp`,
:class:`Linear` and :class:`Einsum` (private: reached as ``jaxamp.fp8.Linear`` and so on).

They live apart from :mod:`jaxamp.fp8` so that ``import jaxamp`` and ``autocast`` never import
``flax.nnx``: :mod:`jaxamp.fp8` loads this module on the first access to one of them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike
from jax.typing import DTypeLike

from jaxamp._fp8 import DelayedScaling
from jaxamp._fp8 import Fp8State
from jaxamp._fp8 import delayed_dot_general

__all__ = ["DotGeneral", "Einsum", "EinsumOp", "Fp8Meta", "Linear"]

class Fp8Meta(nnx.Variable):
    """The NNX variable kind of FP8 metadata: each holds an :class:`Fp8State`. Split it from
    the params with ``nnx.split(model, nnx.Param, Fp8Meta, ...)`` and keep it in the model
    state of :func:`jaxamp.make_train_step` (``has_model_state=True``): the step updates it.
    """


class DotGeneral(nnx.Module):
    """A ``dot_general`` with delayed FP8 scaling and its own :class:`Fp8Meta`, for any NNX
    layer that takes one: ``nnx.Linear(..., dot_general=DotGeneral())``,
    ``nnx.MultiHeadAttention(..., qkv_dot_general=...)`` (one instance per matmul).

    Each instance must run once per forward pass (a second call would add its ``amax`` to the
    first's); under ``nnx.scan``/``nnx.vmap`` over layers each layer has its own slice.

    >>> from flax import nnx
    >>> layer = nnx.Linear(4, 2, dot_general=DotGeneral(DelayedScaling(history_length=8)),
    ...                    rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((3, 4))).shape
    (3, 2)
    >>> [s.amax_history.shape for s in Fp8State.find_all(nnx.state(layer, Fp8Meta))]
    [(3, 8)]
    """

    def __init__(self, recipe: DelayedScaling = DelayedScaling()):
        if not isinstance(recipe, DelayedScaling):
            raise TypeError(f"DotGeneral takes a DelayedScaling recipe, got {recipe!r}; for "
                            "current scaling pass dot_general=jaxamp.fp8.fp8_dot_general")
        self.fp8 = Fp8Meta(Fp8State.create(recipe))
        """The :class:`Fp8Meta` variable holding this matmul's :class:`Fp8State`, which the
        train step updates."""

    def __call__(self, lhs: ArrayLike, rhs: ArrayLike, dimension_numbers: Any,
                 precision: Any = None, preferred_element_type: DTypeLike | None = None,
                 out_sharding: Any = None) -> jax.Array:
        del precision, out_sharding
        return delayed_dot_general(lhs, rhs, dimension_numbers, self.fp8.get_value(),
                                   preferred_element_type)


class EinsumOp(nnx.Module):
    """``jnp.einsum`` of two operands through a delayed-scaling :class:`DotGeneral` (for the
    attention's ``q·k`` and ``p·v``, or ``nnx.Einsum(..., einsum_op=EinsumOp())``).

    >>> op = EinsumOp(DelayedScaling(history_length=4))
    >>> op("bd,de->be", jnp.ones((2, 3)), jnp.ones((3, 5))).shape
    (2, 5)
    """

    def __init__(self, recipe: DelayedScaling = DelayedScaling()):
        self.dot = DotGeneral(recipe)
        """The :class:`DotGeneral` that runs the contraction and holds its FP8 metadata."""

    def __call__(self, subscripts: str, *operands: ArrayLike, precision: Any = None,
                 preferred_element_type: DTypeLike | None = None, **kwargs: Any) -> jax.Array:
        del precision, kwargs
        if len(operands) != 2:
            raise ValueError(f"an FP8 einsum takes two operands (one matmul), got "
                             f"{len(operands)} for {subscripts!r}")
        # ``_dot_general`` is jnp.einsum's hook for another dot_general (flax's Linen
        # attention and fp8_ops pass theirs the same way).
        return jnp.einsum(subscripts, *operands, preferred_element_type=preferred_element_type,
                          _dot_general=self._dot)

    def _dot(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
             **kwargs):
        del kwargs
        return self.dot(lhs, rhs, dimension_numbers, precision, preferred_element_type)


class Linear(nnx.Linear):
    """``nnx.Linear`` whose matmul runs in FP8 with delayed scaling: the same arguments, plus
    ``recipe``.

    >>> from flax import nnx
    >>> Linear(4, 2, rngs=nnx.Rngs(0))(jnp.ones((3, 4))).dtype
    dtype('float32')
    """

    def __init__(self, in_features: int, out_features: int, *,
                 recipe: DelayedScaling = DelayedScaling(), rngs: nnx.Rngs, **kwargs: Any):
        super().__init__(in_features, out_features, dot_general=DotGeneral(recipe), rngs=rngs,
                         **kwargs)


class Einsum(nnx.Einsum):
    """``nnx.Einsum`` whose contraction runs in FP8 with delayed scaling: the same
    arguments, plus ``recipe``.

    >>> from flax import nnx
    >>> Einsum("bd,dhk->bhk", (4, 2, 3), rngs=nnx.Rngs(0))(jnp.ones((5, 4))).shape
    (5, 2, 3)
    """

    def __init__(self, einsum_str: str, kernel_shape: Any, bias_shape: Any = None, *,
                 recipe: DelayedScaling = DelayedScaling(), rngs: nnx.Rngs, **kwargs: Any):
        super().__init__(einsum_str, kernel_shape, bias_shape, einsum_op=EinsumOp(recipe),
                         rngs=rngs, **kwargs)
