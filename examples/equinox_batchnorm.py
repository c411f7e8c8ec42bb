"""An Equinox model with ``eqx.nn.BatchNorm`` and ``eqx.nn.Dropout``, trained as itself by
``jaxamp.equinox.make_step`` under autocast.

    python examples/equinox_batchnorm.py

``eqx.nn.make_with_state`` gives the model and its ``eqx.nn.State`` (BatchNorm's running
statistics, kept in fp32); ``jaxamp.equinox.init`` gives the working model (its inexact arrays
in bf16) and the optimizer state holding their fp32 master. The loss is written against the
model, as for ``eqx.filter_value_and_grad``: the model runs per example under ``jax.vmap``
with the axis name BatchNorm reduces over, the state goes in and comes back out once per
batch, and dropout takes one key per example, split from the step's key.
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


def loss_fn(model, state, batch, key):
    keys = jax.random.split(key, batch["x"].shape[0])
    logits, state = jax.vmap(lambda x, k, s: model(x, s, key=k), axis_name="batch",
                             in_axes=(0, 0, None), out_axes=(0, None))(batch["x"], keys, state)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, state


def main(steps: int = 60, seed: int = 0) -> dict:
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(seed))
    tx = jaxamp.mixed_precision(optax.adam(3e-3), "mixed_bfloat16")
    model, opt_state = jaxamp.equinox.init(model, tx)
    step = eqx.filter_jit(jaxamp.equinox.make_step(loss_fn, tx, has_state=True, autocast=True))
    batch, key = data(), jax.random.key(seed + 1)
    before = jax.tree.map(np.asarray, state)
    losses = []
    for i in range(steps):
        model, state, opt_state, metrics = step(model, state, opt_state, batch,
                                                jax.random.fold_in(key, i))
        losses.append(float(metrics["loss"]))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    audit = jaxamp.audit(  # a function of arrays: the module's other leaves held fixed
        lambda p, *rest: eqx.filter(step(eqx.combine(p, static), *rest), eqx.is_array),
        params, state, opt_state, batch, key)
    # Eval: the fp32 master in the model, the running statistics, no dropout.
    master = jaxamp.state.get_master_params(opt_state, params)
    net = eqx.nn.inference_mode(eqx.combine(master, model))
    logits, _ = jax.vmap(lambda x: net(x, state, inference=True))(jnp.asarray(batch["x"]))
    moved = [float(np.abs(np.asarray(a) - b).max()) for a, b in
             zip(jax.tree.leaves(state), jax.tree.leaves(before), strict=True)
             if np.issubdtype(b.dtype, np.floating)]  # not BatchNorm's step counter
    return {"first_loss": losses[0], "last_loss": losses[-1],
            "accuracy": float(jnp.mean(logits.argmax(-1) == batch["y"])),
            "bf16_share": audit.share("bfloat16"),
            "params_dtypes": sorted({str(p.dtype) for p in jax.tree.leaves(params)}),
            "batch_stats_dtypes": sorted({str(s.dtype) for s in jax.tree.leaves(state)
                                          if jnp.issubdtype(s.dtype, jnp.floating)}),
            "batch_stats_moved": min(moved)}


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key}: {value}")
