"""Overflow diagnostics: ``explain_overflow`` re-runs one step, op by op, outside the fast path.

The fast path only says *that* a step's gradients were non-finite (and which param leaf, see
``metrics["first_nonfinite_leaf"]``). ``explain_overflow(state, batch, step)`` evaluates the
scaled loss of the step's objective and its gradient equation by equation, eagerly, and records
where the first inf or nan appears in each layer (its name scope, or else its source line), in
forward order and then in backward order, plus every param whose gradient is non-finite.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._jaxpr import Interpreter
from jaxamp._jaxpr import is_backward
from jaxamp._jaxpr import scope
from jaxamp._jaxpr import where
from jaxamp._step._objective import objective_of
from jaxamp._step._train_step import TrainStep
from jaxamp._step._train_step import device_gradients
from jaxamp._step._train_step import make_train_step
from jaxamp._step._train_step import step_rng
from jaxamp._tree import is_floating_array
from jaxamp._tree import tree_path_str

__all__ = ["OverflowEvent", "OverflowReport", "explain_overflow"]

@dataclasses.dataclass(frozen=True)
class OverflowEvent:
    """The first non-finite value produced inside one layer (see :func:`explain_overflow`).

    >>> e = OverflowEvent("forward", "layer2", "exp", "model.py:12:8 (f)", "float16", (2, 1),
    ...                   "inf")
    >>> e.phase, e.kind
    ('forward', 'inf')
    """

    phase: str
    """``"forward"`` or ``"backward"``."""
    layer: str
    """The op's name scope (``"Encoder/layer0/mlp"``), or its source line when it has none."""
    primitive: str
    """The JAX primitive that produced the value (``"exp"``, ``"dot_general"``)."""
    where: str
    """The source line of the user code that ran the op, ``file:line:col (function)``, or
    ``"<unknown>"``."""
    dtype: str
    """The dtype of the op's output (``"float16"``)."""
    shape: tuple[int, ...]
    """The shape of the op's output."""
    kind: str
    """``"inf"``, ``"nan"`` or ``"inf+nan"``: what the output holds."""


@dataclasses.dataclass
class OverflowReport:
    """What :func:`explain_overflow` found.

    >>> r = OverflowReport(events=[], nonfinite_grads=[], loss=0.5, loss_scale=1.0)
    >>> print(r)
    jaxamp overflow report: loss 0.5 at loss scale 1
      every activation and gradient is finite
    """

    events: list[OverflowEvent]
    """The first non-finite value of each layer: the forward pass's in execution order, then
    the backward pass's."""
    nonfinite_grads: list[str]
    """The paths (as :func:`jaxamp.gradients.tree_path_str` writes them) of the params whose
    gradient holds an inf or nan."""
    loss: float
    """The step's unscaled loss (computed in fp32), as a python float."""
    loss_scale: float
    """The loss scale the step ran with (1 without a :func:`jaxamp.mixed_precision` state)."""
    micro_batch: int | None = None
    """With ``accum_steps``: the first micro-batch whose evaluation held an inf or nan (the
    :attr:`events` are its), or ``None``."""

    @property
    def first_forward(self) -> OverflowEvent | None:
        """The first :class:`OverflowEvent` of the forward pass, or ``None``."""
        return next((e for e in self.events if e.phase == "forward"), None)

    @property
    def first_backward(self) -> OverflowEvent | None:
        """The first :class:`OverflowEvent` of the backward pass, or ``None``."""
        return next((e for e in self.events if e.phase == "backward"), None)

    def __str__(self) -> str:
        lines = [f"jaxamp overflow report: loss {self.loss:g} at loss scale {self.loss_scale:g}"]
        if self.micro_batch is not None:
            lines[0] += f", first in micro-batch {self.micro_batch}"
        if not self.events:
            lines.append("  every activation and gradient is finite")
        for e in self.events:
            lines.append(f"  {e.phase:8s} {e.layer}: {e.kind} from {e.primitive} "
                         f"{e.dtype}{list(e.shape)} at {e.where}")
        if self.nonfinite_grads:
            lines.append("  non-finite gradients: " + ", ".join(self.nonfinite_grads))
        return "\n".join(lines)


def _kind(x: Any) -> str | None:
    if not is_floating_array(x):
        return None
    x = np.asarray(x)
    has_nan, has_inf = bool(np.isnan(x).any()), bool(np.isinf(x).any())
    if not (has_nan or has_inf):
        return None
    return "inf+nan" if has_nan and has_inf else ("nan" if has_nan else "inf")


def _layer(eqn: Any, outer: str) -> str:
    return scope(eqn, outer).removesuffix(" [backward]") or where(eqn)


def _train_step_of(step: Any) -> TrainStep:
    """The :class:`TrainStep` whose program is explained: ``step`` itself (under ``jax.jit``
    or ``jax.pmap``, which keep it as ``__wrapped__``), or the step of an
    :class:`Objective` or a loss function (called as ``loss_fn(params, batch)``), one
    micro-batch; without the fp32-matmul warning (the step warns)."""
    unwrapped = inspect.unwrap(step)
    if not isinstance(unwrapped, TrainStep):
        unwrapped = make_train_step(objective_of(step, {}))
    return dataclasses.replace(unwrapped, warn_fp32_matmuls=False)


def explain_overflow(state: Any, batch: Any, step: Callable) -> OverflowReport:
    """Re-runs one step eagerly and reports where inf or nan first appear.

    ``step`` is the step from :func:`jaxamp.make_train_step` (or ``jax.jit`` of it), which
    holds its :class:`~jaxamp.Objective`; an :class:`~jaxamp.Objective`, which says how the
    loss is called (``jaxamp.Objective(loss_fn, has_aux=True, autocast=True)``); or a loss
    function called as ``loss_fn(params, batch)``. With a :class:`jaxamp.TrainState` and one
    (unsharded) batch it evaluates the program the step runs, equation by equation: the loss under
    :func:`jaxamp.autocast` with the state's policy when the objective asks for it (its fp32
    regions and recomputation included, so an op that the rules keep in fp32 is not reported as
    an fp16 overflow), the FP8 metadata handed as the step hands it, and with ``accum_steps``
    each micro-batch in turn (the report names the first that held an inf or nan). The loss is
    scaled by the state's current loss scale, as in the step, so fp16 overflows caused by the
    scale show up. (Under ``pmap`` or a sharded ``jit`` the step folds each device's index into
    the rng and averages over devices; one batch here is one device's program.)

    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> def loss_fn(params, batch):
    ...     with jax.named_scope("layer1"):
    ...         h = batch["x"] @ params["w1"]
    ...     with jax.named_scope("layer2"):
    ...         h = jnp.exp(h) @ params["w2"]
    ...     return jnp.mean(h.astype(jnp.float32))
    >>> tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16")
    >>> state = jaxamp.TrainState.create(
    ...     params={"w1": jnp.full((4, 4), 4.0), "w2": jnp.ones((4, 1))}, tx=tx)
    >>> step = jaxamp.make_train_step(loss_fn)
    >>> report = explain_overflow(state, {"x": jnp.ones((2, 4))}, step)
    >>> report.first_forward.layer, report.first_forward.primitive
    ('layer2', 'exp')
    """
    step = _train_step_of(step)
    policy, scale, rng = state.policy, state.loss_scale, step_rng(step.objective, state)
    # The step's own gradients (its micro-batching, its rngs, its model state threaded), each
    # micro-batch's program evaluated eagerly by its own watch.
    watches: list[_FirstNonfinite] = []

    def watch() -> _FirstNonfinite:
        watches.append(_FirstNonfinite())
        return watches[-1]

    loss, grads, *_ = device_gradients(step, policy, state.params, scale, state.model_state,
                                       step.objective.batch_under(policy, batch), rng, watch)
    at = next((i for i, w in enumerate(watches) if w.events), None)
    found = [] if at is None else sorted(watches[at].events, key=lambda e: e.phase != "forward")
    bad = [tree_path_str(path) for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
           if _kind(g) is not None]
    return OverflowReport(found, bad, float(loss), float(scale),
                          micro_batch=at if step.accum_steps > 1 else None)


class _FirstNonfinite(Interpreter):
    """Binds each primitive as it is and records the first inf or nan of each layer (a name
    scope, or else a source line), in each phase."""

    def __init__(self):
        self.events: list[OverflowEvent] = []
        self.layers: set[tuple[str, str]] = set()

    def seen(self, eqn: Any, outs: list, outer: str) -> None:
        for out in outs:
            kind = _kind(out)
            if kind is None:
                continue
            phase = "backward" if is_backward(eqn, outer) else "forward"
            layer = _layer(eqn, outer)
            if (phase, layer) not in self.layers:
                self.layers.add((phase, layer))
                self.events.append(OverflowEvent(phase, layer, eqn.primitive.name, where(eqn),
                                                 jnp.dtype(out.dtype).name, tuple(out.shape),
                                                 kind))
            return
