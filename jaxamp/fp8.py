"""FP8 matmuls: current scaling for any model, delayed scaling for Flax NNX.

An FP8 matmul quantizes each operand to an 8-bit float after multiplying it by a per-tensor
``scale``, multiplies the 8-bit values with an fp32 accumulator, and multiplies the result by
``1 / (scale_lhs * scale_rhs)``. The forward pass quantizes the operands to ``e4m3`` (max 448,
3 mantissa bits) and the backward pass the incoming gradient to ``e5m2`` (max 57344, 2 bits):
the ``"hybrid"`` format of Transformer Engine. A scale is ``fp8_max / amax / 2**margin``, with
``amax`` the largest magnitude of the tensor; a zero, infinite or NaN ``amax`` (or a scale that
overflows fp32, from a tiny ``amax``) keeps the previous scale.

Two recipes:

* :class:`CurrentScaling` (stateless): each tensor's ``amax`` is computed on the fly; or each
  row's, tile's or block's (``granularity``, one of ``CurrentScaling.GRANULARITIES``).
  :func:`fp8_dot_general` is a drop-in ``lax.dot_general``; ``jaxamp.autocast`` under the
  ``mixed_fp8`` policy runs every ``dot_general`` of any model through it.
* :class:`DelayedScaling`: the scales come from a history of the ``amax`` of past steps, kept in
  an :class:`Fp8State` (the NNX variable kind :class:`Fp8Meta`; ``Fp8State.find_all`` finds
  them in a model state). :class:`DotGeneral`, :class:`EinsumOp`, :class:`Linear` and
  :class:`Einsum` are the NNX layers that hold one; :func:`delayed_dot_general` is their
  functional core.
  The step updates it, never the optimizer: :func:`jaxamp.make_train_step` differentiates with
  respect to each ``Fp8State`` in the model state (the cotangent of its ``scale`` is the
  ``amax`` this step saw), takes the maximum over micro-batches and devices, rolls the history
  and recomputes the scale, and keeps it bit-identical on a skipped step.

Loss scaling: the gradient's ``amax`` is kept in the units of the unscaled gradient. The step
hands the model a gradient scale divided by the loss scale and divides the ``amax`` it sees by
the loss scale, so the whole state is the same whatever the loss scale, and a change of loss
scale does not make the next steps' scales stale. The forward tensors' metadata never meets the
loss scale (keras#21706 divided it by the loss scale).

Non-finite values are never hidden by saturation: a matmul whose operand or incoming gradient
holds an inf or a NaN returns NaN, so an fp16 overflow still skips the step.

:func:`error_report` measures what FP8 costs each matmul of a loss (an :class:`Fp8ErrorReport`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import jax

from jaxamp._autocast import autocast
from jaxamp._fp8 import CurrentScaling
from jaxamp._fp8 import DelayedScaling
from jaxamp._fp8 import Fp8State
from jaxamp._fp8 import delayed_dot_general
from jaxamp._fp8 import fp8_dot_general
from jaxamp._fp8._errors import Fp8ErrorReport
from jaxamp._fp8._errors import probing
from jaxamp._precision._policy import get_policy

if TYPE_CHECKING:  # loaded lazily by __getattr__ (they import flax.nnx)
    from jaxamp._fp8._nnx import DotGeneral
    from jaxamp._fp8._nnx import Einsum
    from jaxamp._fp8._nnx import EinsumOp
    from jaxamp._fp8._nnx import Fp8Meta
    from jaxamp._fp8._nnx import Linear

__all__ = ["CurrentScaling", "DelayedScaling", "DotGeneral", "Einsum", "EinsumOp",
           "Fp8ErrorReport", "Fp8Meta", "Fp8State", "Linear", "delayed_dot_general",
           "error_report", "fp8_dot_general"]


def error_report(fn: Callable, *args: Any, policy: Any = "mixed_fp8",
                 argnums: int | tuple[int, ...] = 0, has_aux: bool = False) -> Fp8ErrorReport:
    """Each FP8 matmul of ``fn``'s loss and gradient under ``jaxamp.autocast(fn, policy)``,
    with the relative error of its three GEMMs against the same matmul in fp32.

    ``fn`` returns a scalar loss (with ``has_aux``, ``(loss, aux)``); ``argnums`` are the
    arguments differentiated, as in ``jax.grad``. A matmul is named by the argument it reads
    (``args[0]/blocks/0/mlp/kernel``, the rhs's first) or else by the line of code that made
    it; a matmul run many times (a layer in a ``scan``) reports its largest errors.
    ``policy`` is an FP8 policy: ``"mixed_fp8"`` or ``Policy(..., fp8=CurrentScaling(...))``,
    whose recipe (granularity, the matmuls it keeps in the compute dtype) the report follows.
    The matmuls the recipe keeps in the compute dtype are not FP8 and not in the report.

    >>> import jax.numpy as jnp, jaxamp
    >>> def loss(p, x):
    ...     return jnp.mean((x @ p["w"]) ** 2)
    >>> p, x = {"w": jnp.linspace(-1, 1, 64).reshape(8, 8)}, jnp.linspace(0, 3, 32).reshape(4, 8)
    >>> report = jaxamp.fp8.error_report(loss, p, x)
    >>> [(m.calls, m.forward < 0.1, m.grad_lhs < 0.1, m.grad_rhs < 0.1) for m in report.matmuls]
    [(1, True, True, True)]
    """
    policy = get_policy(policy)
    if not policy.fp8:
        raise ValueError(f"error_report measures FP8 matmuls, and policy {policy} has none; "
                         "use policy='mixed_fp8' or Policy(..., fp8=CurrentScaling(...))")
    with probing() as probe:
        # A fresh autocast and a fresh jit: the probe is read while the loss is traced.
        cast = autocast(fn, policy, recompute=False)
        grads = jax.jit(lambda *a: jax.value_and_grad(cast, argnums, has_aux=has_aux)(*a))
        jax.block_until_ready(grads(*args))
        jax.effects_barrier()
    return probe.report()


# The NNX layers load flax.nnx, which ``import jaxamp`` and ``autocast`` do not need: they live
# in a module of their own, imported on the first access to one of them.
_NNX_LAYERS = ("DotGeneral", "Einsum", "EinsumOp", "Fp8Meta", "Linear")


def __getattr__(name: str) -> Any:
    if name in _NNX_LAYERS:
        from jaxamp._fp8 import _nnx as _fp8_nnx
        return getattr(_fp8_nnx, name)
    raise AttributeError(f"module 'jaxamp.fp8' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_NNX_LAYERS})
