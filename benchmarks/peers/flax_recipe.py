"""flax's recipe: layers built with ``dtype=bfloat16`` and ``DynamicScale.value_and_grad``, with
a ``jnp.where`` per leaf that keeps the old state on an overflow."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax.training import dynamic_scale

# Every layer of a Linen model built with dtype=bfloat16, the norms included; the params stay fp32.
MODEL_DTYPES = {"dtype": jnp.bfloat16, "norm_dtype": jnp.bfloat16}


def train_step(loss, tx: optax.GradientTransformation):
    """``(init, step)`` around a ``loss(params, batch)`` that already computes in bf16."""

    def init(params):
        return params, tx.init(params), dynamic_scale.DynamicScale()

    def step(state, batch):
        p, opt_state, ds = state
        ds, finite, value, grads = ds.value_and_grad(loss)(p, batch)
        updates, new_opt = tx.update(grads, opt_state, p)
        new_p = optax.apply_updates(p, updates)
        select = functools.partial(jnp.where, finite)
        p = jax.tree.map(select, new_p, p)
        opt_state = jax.tree.map(select, new_opt, opt_state)
        return (p, opt_state, ds), value

    return init, step
