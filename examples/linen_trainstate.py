"""A Flax Linen model trained through ``jaxamp.mixed_precision`` with flax's own ``TrainState``.

    python examples/linen_trainstate.py

jaxamp's optimizer wrapper is a plain optax transform: flax's ``TrainState.apply_gradients``
drives it. The only change to a standard Linen loop is the loss: differentiate
``jaxamp.state.scale_loss(loss, state.opt_state)``; skipped steps and the loss scale happen inside.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits

import jaxamp


class MLP(nn.Module):
    dtype: jnp.dtype = jnp.float16  # the compute dtype: no fp32 layer promotes the matmuls

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(128, dtype=self.dtype, param_dtype=jnp.float32)(x))
        return nn.Dense(10, dtype=self.dtype, param_dtype=jnp.float32)(x)


def main(steps: int = 200, seed: int = 0) -> dict:
    digits = load_digits()  # 1,797 8x8 images, shipped with scikit-learn
    x = (digits.data / 16.0).astype(np.float32)  # pixels are 0..16
    y = digits.target.astype(np.int32)
    policy = jaxamp.get_policy("mixed_float16")
    model = MLP(dtype=policy.compute_dtype)
    params = model.init(jax.random.key(seed), x[:1])["params"]
    tx = jaxamp.mixed_precision(optax.adam(1e-3), policy)  # fp32 master + dynamic loss scale
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=policy.cast_params_to_compute(params), tx=tx)

    @jax.jit
    def step(state, xb, yb):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, policy.cast_to_compute(xb))
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), yb).mean()
            return jaxamp.state.scale_loss(loss, state.opt_state), loss
        grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), loss

    rng = jax.random.key(seed + 1)
    for _ in range(steps):
        rng, sub = jax.random.split(rng)
        idx = jax.random.randint(sub, (128,), 0, len(x))
        state, loss = step(state, x[idx], y[idx])
    mp = jaxamp.state.find_state(state.opt_state)
    logits = model.apply({"params": state.params}, policy.cast_to_compute(x))
    out = {"loss": float(loss), "accuracy": float(jnp.mean(jnp.argmax(logits, -1) == y)),
           "loss_scale": float(mp.loss_scale.loss_scale),
           "skipped_steps": int(mp.health.skipped_steps),
           "params_dtype": str(jax.tree.leaves(state.params)[0].dtype),
           "master_dtype": str(jax.tree.leaves(mp.master.params)[0].dtype)}
    print(out)
    return out


if __name__ == "__main__":
    main()
