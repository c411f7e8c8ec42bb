"""optax's recipe: bf16 compute, no loss scaling, and ``apply_if_finite`` around the optimizer."""

from __future__ import annotations

import jax
import optax


def train_step(loss, tx: optax.GradientTransformation, *, max_consecutive_errors: int = 5):
    """``(init, step)`` around a ``loss(params, batch)`` that already computes in bf16."""
    safe_tx = optax.apply_if_finite(tx, max_consecutive_errors=max_consecutive_errors)

    def init(params):
        return params, safe_tx.init(params)

    def step(state, batch):
        p, opt_state = state
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, opt_state = safe_tx.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), value

    return init, step
