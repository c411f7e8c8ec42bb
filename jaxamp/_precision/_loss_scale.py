"""Loss scales: pytrees of arrays whose hyperparameters are static.

Three kinds, all with the same methods:

* :class:`NoOpLossScale`: a scale of 1 that never changes (the bf16 and fp32 default).
* :class:`StaticLossScale`: a fixed scale.
* :class:`DynamicLossScale`: ``torch.amp.GradScaler``'s rule, plus optional bounds and
  hysteresis.

Each is a frozen dataclass registered as a pytree: its leaves are only arrays (the scale in fp32 and
int32 counters) and every hyperparameter is a static field, so it survives
flatten/unflatten, ``jit``, ``pmap``, ``jit(...).lower()`` and checkpoints whole.
``adjust(grads_finite)`` returns the next state and never reads back to the host.
"""

from __future__ import annotations

import math
from typing import Any
from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxamp._tree import State
from jaxamp._tree import map_floating
from jaxamp._tree import static_field

__all__ = ["NoOpLossScale", "StaticLossScale", "DynamicLossScale", "LossScale"]

_F32_TINY = float(jnp.finfo(jnp.float32).tiny)


def _to_f32_scalar(value: Any, name: str) -> Any:
    """Converts a python number to an fp32 scalar array; leaves traced or abstract values alone."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}; pass a float such as "
                        "2.0**16 (the default initial scale)")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}: a loss scale "
                             "of 0, a negative, inf or nan cannot unscale gradients; pass a "
                             "power of two such as 2.0**16 (the default initial scale)")
        return jnp.asarray(value, jnp.float32)
    return value


def _to_i32_scalar(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return jnp.asarray(value, jnp.int32)
    return value


class _LossScaleMethods:
    """Methods shared by the three loss scales. ``loss_scale`` holds the current fp32 scale."""

    loss_scale: Any

    def scale(self, tree: Any) -> Any:
        """Multiplies the floating leaves of ``tree`` by the scale, keeping their dtypes.

        The product is taken in (at least) fp32 and rounded once, so a scale above 65504
        works on fp16 values. A loss should be scaled in fp32: ``scale(loss.astype(f32))``.
        """
        def mul(x):
            wide = x.dtype if jnp.finfo(x.dtype).bits > 32 else jnp.float32  # explicit
            return (x.astype(wide) * self.loss_scale).astype(x.dtype)
        return map_floating(mul, tree)

    def unscale(self, tree: Any) -> Any:
        """Casts floating leaves to fp32 and multiplies them by ``1 / scale``."""
        inv = 1.0 / self.loss_scale
        return map_floating(lambda x: x.astype(jnp.float32) * inv, tree)

    def at_min_scale(self) -> jax.Array:
        """A scalar bool: True when the scale cannot back off any further.

        A fixed scale (:class:`NoOpLossScale`, :class:`StaticLossScale`) is always at its
        minimum; a :class:`DynamicLossScale` is once it has reached ``min_scale``. A non-finite
        step taken at the minimum scale is one that loss scaling cannot fix.

        >>> import jax.numpy as jnp
        >>> bool(StaticLossScale(2.0**12).at_min_scale())
        True
        >>> s = DynamicLossScale(loss_scale=4.0, min_scale=2.0)
        >>> bool(s.at_min_scale()), bool(s.adjust(jnp.array(False)).at_min_scale())
        (False, True)
        """
        return jnp.array(True)


class NoOpLossScale(_LossScaleMethods, State):
    """No loss scaling: the scale is 1 and ``adjust`` returns ``self``.

    >>> import jax.numpy as jnp
    >>> s = NoOpLossScale()
    >>> float(s.loss_scale), s.adjust(jnp.array(False)) is s
    (1.0, True)
    """

    @property
    def loss_scale(self) -> jax.Array:  # type: ignore[override]
        """Always 1, an fp32 scalar (made on each access: this state has no leaves)."""
        return jnp.ones((), jnp.float32)

    def adjust(self, grads_finite: ArrayLike) -> NoOpLossScale:
        """Returns ``self``: a scale of 1 never changes, whatever ``grads_finite`` is."""
        del grads_finite
        return self


class StaticLossScale(_LossScaleMethods, State):
    """A fixed loss scale.

    >>> import jax.numpy as jnp
    >>> s = StaticLossScale(2.0**12)
    >>> float(s.scale(jnp.float32(1.5))), float(s.adjust(jnp.array(False)).loss_scale)
    (6144.0, 4096.0)
    """

    loss_scale: Any = 2.0**15
    """The fixed scale, an fp32 scalar (a python number is converted at construction)."""

    def __post_init__(self):
        object.__setattr__(self, "loss_scale", _to_f32_scalar(self.loss_scale, "loss_scale"))

    def adjust(self, grads_finite: ArrayLike) -> StaticLossScale:
        """Returns ``self``: the scale stays fixed whether or not the gradients were finite."""
        del grads_finite
        return self


class DynamicLossScale(_LossScaleMethods, State):
    """A dynamic loss scale with ``torch.amp.GradScaler``'s defaults and timing.

    The rule, applied once per step by :meth:`adjust`:

    * on a non-finite step the growth counter resets; the hysteresis budget drops by one and,
      once it is spent, the scale is multiplied by ``backoff_factor`` (not below ``min_scale``);
    * on a finite step the counter advances; on the ``growth_interval``-th consecutive finite
      step the scale is multiplied by ``growth_factor`` when the result is finite (capped at
      ``max_scale``) and the counter resets.

    With ``hysteresis=n`` the scale backs off only at the n-th overflow (DeepSpeed's delayed
    shift). The budget refills at every growth (``hysteresis_refill="growth"``, Megatron-LM and
    DeepSpeed's default) or at every finite step (``"finite"``, DeepSpeed's
    ``consecutive_hysteresis=True``). ``hysteresis=1`` (the default) backs off on every overflow.

    Attributes:
      loss_scale: the current scale, an fp32 scalar (whatever the compute dtype).
      growth_tracker: consecutive finite steps since the last growth or overflow (int32).
      hysteresis_left: overflows still tolerated before the next backoff (int32).

    Defaults match ``GradScaler``: initial scale 2**16, x2 after 2000 consecutive finite steps
    (on the 2000th), x0.5 on overflow. ``min_scale`` defaults to the smallest normal fp32 so
    that the scale can never reach 0; ``max_scale`` defaults to no bound (growth stops only
    where the scale would overflow fp32). 2**24 is a sensible ``max_scale`` for fp16.

    >>> import jax.numpy as jnp
    >>> s = DynamicLossScale(loss_scale=8.0, growth_interval=2)
    >>> seq = []
    >>> for finite in [True, True, False, True]:
    ...     s = s.adjust(jnp.array(finite)); seq.append(float(s.loss_scale))
    >>> seq
    [8.0, 16.0, 8.0, 8.0]
    """

    loss_scale: Any = 2.0**16
    """The current scale, an fp32 scalar (whatever the compute dtype)."""
    growth_tracker: Any = 0
    """Consecutive finite steps since the last growth or overflow, an int32 scalar."""
    hysteresis_left: Any = -1  # -1 (a python int): start with the full `hysteresis` budget
    """Overflows still tolerated before the next backoff, an int32 scalar (``-1`` at
    construction stands for the full ``hysteresis`` budget)."""
    growth_interval: int = static_field(default=2000)
    """Static: the number of consecutive finite steps after which the scale grows (it grows on
    the last of them)."""
    growth_factor: float = static_field(default=2.0)
    """Static: the factor (> 1) the scale is multiplied by when it grows."""
    backoff_factor: float = static_field(default=0.5)
    """Static: the factor, in (0, 1), the scale is multiplied by when it backs off."""
    min_scale: float | None = static_field(default=None)
    """Static: the lowest scale a backoff reaches; ``None`` for the smallest normal fp32."""
    max_scale: float | None = static_field(default=None)
    """Static: the highest scale a growth reaches; ``None`` for no bound but fp32's range."""
    hysteresis: int = static_field(default=1)
    """Static: the overflows (>= 1) it takes to back off once; 1 backs off on every one."""
    hysteresis_refill: Literal["growth", "finite"] = static_field(default="growth")
    """Static: when the hysteresis budget refills: ``"growth"`` at every growth of the scale,
    ``"finite"`` at every finite step."""

    def __post_init__(self):
        self._validate()
        object.__setattr__(self, "loss_scale", _to_f32_scalar(self.loss_scale, "loss_scale"))
        object.__setattr__(self, "growth_tracker", _to_i32_scalar(self.growth_tracker))
        # Only python numbers given by a caller are converted: unflattening calls __init__ too,
        # with tracers, abstract values or None as leaves, and those must pass through as they are.
        left = self.hysteresis_left
        if isinstance(left, int) and not isinstance(left, bool) and left == -1:
            left = self.hysteresis
        object.__setattr__(self, "hysteresis_left", _to_i32_scalar(left))

    def _validate(self):
        def number(name, value, fix):
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}; {fix}")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) \
                or self.growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got "
                             f"{self.growth_interval!r}; it counts the consecutive finite steps "
                             "before the scale grows (GradScaler's default is 2000)")
        grow_fix = "use 2.0 (the default); StaticLossScale is a scale that never grows"
        number("growth_factor", self.growth_factor, grow_fix)
        if self.growth_factor <= 1:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor!r}; "
                             f"{grow_fix}")
        back_fix = "use 0.5 (the default), which halves the scale on overflow"
        number("backoff_factor", self.backoff_factor, back_fix)
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}; "
                             f"{back_fix}")
        for name in ("min_scale", "max_scale"):
            value = getattr(self, name)
            if value is not None:
                bound_fix = (f"pass a positive bound such as {name}="
                             f"{'1.0' if name == 'min_scale' else '2.0**24'}, or None for none")
                number(name, value, bound_fix)
                if value <= 0:
                    raise ValueError(f"{name} must be > 0, got {value!r}; {bound_fix}")
        if self.min_scale is not None and self.max_scale is not None \
                and self.min_scale > self.max_scale:
            raise ValueError(f"min_scale ({self.min_scale!r}) must be <= max_scale "
                             f"({self.max_scale!r}); swap them or drop one bound")
        if isinstance(self.hysteresis, bool) or not isinstance(self.hysteresis, int) \
                or self.hysteresis < 1:
            raise ValueError(f"hysteresis must be an int >= 1, got {self.hysteresis!r}; "
                             "1 (the default) backs off on every overflow, n at the n-th")
        if self.hysteresis_refill not in ("growth", "finite"):
            raise ValueError(f"hysteresis_refill must be 'growth' or 'finite', got "
                             f"{self.hysteresis_refill!r}; 'growth' (the default) refills the "
                             "budget when the scale grows, 'finite' on every finite step")

    def _min_scale(self) -> float:
        return _F32_TINY if self.min_scale is None else self.min_scale

    def at_min_scale(self) -> jax.Array:
        """True when the scale is at ``min_scale`` (by default the smallest normal fp32)."""
        return jnp.asarray(self.loss_scale <= jnp.float32(self._min_scale()), jnp.bool_)

    def adjust(self, grads_finite: ArrayLike) -> DynamicLossScale:
        """Returns the state after a step whose (unscaled) gradients were ``grads_finite``."""
        finite = jnp.asarray(grads_finite, jnp.bool_)
        scale = self.loss_scale
        min_scale = self._min_scale()
        max_scale = float(jnp.finfo(jnp.float32).max) if self.max_scale is None \
            else self.max_scale

        # Finite step: count, and grow on the growth_interval-th consecutive one.
        tracker = self.growth_tracker + 1
        grow = tracker >= self.growth_interval
        grown = scale * jnp.float32(self.growth_factor)
        grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, jnp.float32(max_scale)), scale)
        finite_scale = jnp.where(grow, grown, scale)
        finite_tracker = jnp.where(grow, 0, tracker)
        refill = jnp.bool_(True) if self.hysteresis_refill == "finite" else grow
        finite_left = jnp.where(refill, self.hysteresis, self.hysteresis_left)

        # Overflow: spend one unit of hysteresis; back off once it is spent.
        left = jnp.maximum(self.hysteresis_left - 1, 0)
        backed = jnp.maximum(scale * jnp.float32(self.backoff_factor), jnp.float32(min_scale))
        overflow_scale = jnp.where(left == 0, backed, scale)

        return self.replace(
            loss_scale=jnp.where(finite, finite_scale, overflow_scale).astype(jnp.float32),
            growth_tracker=jnp.where(finite, finite_tracker, 0).astype(jnp.int32),
            hysteresis_left=jnp.where(finite, finite_left, left).astype(jnp.int32),
        )


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale
"""Any of the three loss-scale states, for annotations: :class:`NoOpLossScale`,
:class:`StaticLossScale` or :class:`DynamicLossScale` (a type alias, not a class)."""
