"""Overflow diagnostics: ``explain_overflow`` re-runs one step, op by op, outside the fast path.

The fast path only says *that* a step's gradients were non-finite (and which param leaf, see
``metrics["first_nonfinite_leaf"]``). ``explain_overflow(state, batch, loss_fn)`` evaluates the
scaled loss and its gradient equation by equation, eagerly, and records where the first inf or
nan appears in each layer (its name scope, or else its source line), in forward order and then
in backward order, plus every param whose gradient is non-finite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._autocast import autocast as _autocast
from jaxamp._jaxpr import evaluate
from jaxamp._jaxpr import is_backward
from jaxamp._jaxpr import scope
from jaxamp._jaxpr import where
from jaxamp._loss import split_outputs
from jaxamp._master_weights import maybe_find_state
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


def explain_overflow(state: Any, batch: Any, loss_fn: Callable, *, has_aux: bool = False,
                     has_model_state: bool = False, has_rng: bool = False,
                     autocast: bool = False) -> OverflowReport:
    """Re-runs one step of ``loss_fn`` eagerly and reports where inf or nan first appear.

    Takes the same ``loss_fn`` and flags as :func:`jaxamp.make_train_step` (``has_aux``,
    ``has_model_state``, ``has_rng``, ``autocast``), a :class:`jaxamp.TrainState` and one
    (unsharded) batch, and evaluates the program the step runs: with ``autocast=True``,
    ``loss_fn`` under :func:`jaxamp.autocast` with the state's policy, its fp32 regions and
    recomputation included, so an op that the rules keep in fp32 is not reported as an fp16
    overflow. The loss is scaled by the state's current loss scale, as in the step, so fp16
    overflows caused by the scale show up.

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
    >>> report = explain_overflow(state, {"x": jnp.ones((2, 4))}, loss_fn)
    >>> report.first_forward.layer, report.first_forward.primitive
    ('layer2', 'exp')
    """
    policy = state.policy
    if autocast:
        loss_fn = _autocast(loss_fn, policy)
    mp = maybe_find_state(state.opt_state)
    scale = jnp.ones((), jnp.float32) if mp is None else mp.loss_scale.loss_scale
    batch = policy.cast_to_compute(batch)
    kwargs: dict[str, Any] = {}
    if has_model_state:
        kwargs["model_state"] = state.model_state
    if has_rng:
        kwargs["rng"] = jax.random.fold_in(state.rng, state.step)

    def scaled_loss(params):
        loss, _, _ = split_outputs(loss_fn(params, batch, **kwargs), has_aux, has_model_state)
        loss = jnp.asarray(loss).astype(jnp.float32)
        return loss * scale, loss

    closed = jax.make_jaxpr(jax.value_and_grad(scaled_loss, has_aux=True))(state.params)
    events: list[OverflowEvent] = []
    seen: set[tuple[str, str]] = set()

    def on_eqn(eqn, outs, outer):
        for out in outs:
            kind = _kind(out)
            if kind is None:
                continue
            phase = "backward" if is_backward(eqn, outer) else "forward"
            layer = _layer(eqn, outer)
            if (phase, layer) in seen:
                return
            seen.add((phase, layer))
            events.append(OverflowEvent(phase, layer, eqn.primitive.name, where(eqn),
                                        jnp.dtype(out.dtype).name, tuple(out.shape), kind))
            return

    leaves = jax.tree.leaves(state.params)
    outs = evaluate(closed.jaxpr, list(closed.consts), leaves, on_eqn)
    out_tree = jax.tree.structure(((0.0, 0.0), state.params))
    (_, loss), grads = jax.tree.unflatten(out_tree, outs)
    bad = [tree_path_str(path) for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
           if _kind(g) is not None]
    events.sort(key=lambda e: e.phase != "forward")  # forward first, each in execution order
    return OverflowReport(events, bad, float(loss), float(scale))
