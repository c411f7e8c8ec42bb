"""jmp's recipe: params cast to the compute dtype, a dynamic loss scale, a finite check and a
``select_tree`` that keeps the old state on an overflow."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jmp
import optax

POLICY = "params=float32,compute=bfloat16,output=float32"
# What the recipe does to a Linen model: fp32 layers, fp32 norms; the params are cast instead.
MODEL_DTYPES = {"norm_dtype": jnp.float32}


def train_step(loss, tx: optax.GradientTransformation, *, initial_scale: float = 2 ** 15):
    """``(init, step)`` around an fp32 ``loss(params, batch)``: cast, scale, unscale, check,
    adjust, ``select_tree``.

    The loss scale's arrays live in the state; the ``jmp.DynamicLossScale`` object is rebuilt
    inside the step (a step that takes jmp's object as an argument cannot be lowered on this
    jax).
    """
    policy = jmp.get_policy(POLICY)

    def init(params):
        return params, tx.init(params), (jnp.float32(initial_scale), jnp.int32(0))

    def step(state, batch):
        p, opt_state, (scale_value, counter) = state
        scale = jmp.DynamicLossScale(scale_value, counter)

        def f(p):
            value = loss(policy.cast_to_compute(p), batch)
            return scale.scale(value), value
        grads, value = jax.grad(f, has_aux=True)(p)
        grads = scale.unscale(policy.cast_to_param(grads))
        finite = jmp.all_finite(grads)
        scale = scale.adjust(finite)
        updates, new_opt = tx.update(grads, opt_state, p)
        new_p = optax.apply_updates(p, updates)
        p, opt_state = jmp.select_tree(finite, (new_p, new_opt), (p, opt_state))
        return (p, opt_state, (scale.loss_scale, scale.counter)), value

    return init, step


def cast_to_compute(loss):
    """``loss(params, x)`` with the params and the inputs cast by jmp's ``cast_to_compute``."""
    policy = jmp.get_policy(POLICY)

    def cast_loss(p, x):
        p, x = policy.cast_to_compute((p, x))
        return loss(p, x)
    return cast_loss
