"""An Equinox model with ``eqx.nn.BatchNorm`` and ``eqx.nn.Dropout``, trained by
``jaxamp.make_train_step`` under autocast.

    python examples/equinox_batchnorm.py

``eqx.nn.make_with_state`` gives the model and its ``eqx.nn.State`` (BatchNorm's running
statistics): the state is the step's ``model_state``, kept in fp32, and the model's inexact
arrays (``eqx.partition(model, eqx.is_inexact_array)``) are the params the optimizer trains,
bf16 working copies of an fp32 master. The model runs per example under ``jax.vmap`` with
the axis name BatchNorm reduces over; the state goes in and comes back out once per batch.
Dropout's key comes in as ``rng`` (``has_rng=True``), one per example.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp


class Net(eqx.Module):
    hidden: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    drop: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.hidden = eqx.nn.Linear(8, 64, key=k1)
        self.norm = eqx.nn.BatchNorm(64, axis_name="batch", mode="batch")
        self.drop = eqx.nn.Dropout(0.1)
        self.out = eqx.nn.Linear(64, 3, key=k2)

    def __call__(self, x, state, *, key=None, inference=False):
        h, state = self.norm(self.hidden(x), state, inference=inference)
        h = self.drop(jax.nn.relu(h), key=key, inference=inference)
        return self.out(h), state


def data(n: int = 256, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return {"x": x, "y": x[:, :3].argmax(-1).astype(np.int32)}


def main(steps: int = 60, seed: int = 0) -> dict:
    model, model_state = eqx.nn.make_with_state(Net)(jax.random.key(seed))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_fn(params, batch, model_state, rng):
        net = eqx.combine(params, static)
        keys = jax.random.split(rng, batch["x"].shape[0])
        logits, model_state = jax.vmap(lambda x, k, s: net(x, s, key=k), axis_name="batch",
                                       in_axes=(0, 0, None), out_axes=(0, None))(
            batch["x"], keys, model_state)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, model_state

    tx = jaxamp.mixed_precision(optax.adam(3e-3), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=params, tx=tx, model_state=model_state,
                                     rng=jax.random.key(seed + 1))
    step = jax.jit(jaxamp.make_train_step(loss_fn, has_model_state=True, has_rng=True,
                                          autocast=True), donate_argnums=0)
    batch = data()
    before = jax.tree.map(np.asarray, state.model_state)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    audit = jaxamp.audit(step, state, batch)
    net = eqx.nn.inference_mode(eqx.combine(state.master_params, static))
    logits, _ = jax.vmap(lambda x: net(x, state.model_state, inference=True))(
        jnp.asarray(batch["x"]))  # eval: the running statistics, no dropout
    moved = [float(np.abs(np.asarray(a) - b).max()) for a, b in
             zip(jax.tree.leaves(state.model_state), jax.tree.leaves(before), strict=True)
             if np.issubdtype(b.dtype, np.floating)]  # not BatchNorm's first-call flag
    return {"first_loss": losses[0], "last_loss": losses[-1],
            "accuracy": float(jnp.mean(logits.argmax(-1) == batch["y"])),
            "bf16_share": audit.share("bfloat16"),
            "params_dtypes": sorted({str(p.dtype) for p in jax.tree.leaves(state.params)}),
            "batch_stats_dtypes": sorted({str(s.dtype) for s in
                                          jax.tree.leaves(state.model_state)
                                          if jnp.issubdtype(s.dtype, jnp.floating)}),
            "batch_stats_moved": min(moved)}


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key}: {value}")
