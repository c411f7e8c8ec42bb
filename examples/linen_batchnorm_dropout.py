"""A Flax Linen model with ``nn.BatchNorm`` and ``nn.Dropout``, trained by
``jaxamp.make_train_step`` under autocast.

    python examples/linen_batchnorm_dropout.py

Linen keeps the params and the running statistics in two collections of one variables dict:
``variables["params"]`` is what the optimizer trains (bf16 working copies of an fp32 master)
and ``variables["batch_stats"]`` is the step's ``model_state``, kept in fp32. The loss applies
the module with ``mutable=["batch_stats"]`` and returns the updated statistics; a skipped step
keeps the old ones. Dropout's key comes in as ``rng`` (``has_rng=True``: the state's key folded
with the step) and goes to ``apply`` as ``rngs={"dropout": rng}``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp


class Net(nn.Module):
    @nn.compact
    def __call__(self, x_BxD, *, train: bool):
        h = nn.Dense(64)(x_BxD)
        h = nn.relu(nn.BatchNorm(use_running_average=not train)(h))
        h = nn.Dropout(0.1, deterministic=not train)(h)
        return nn.Dense(3)(h)


def data(n: int = 256, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return {"x": x, "y": x[:, :3].argmax(-1).astype(np.int32)}


def main(steps: int = 60, seed: int = 0) -> dict:
    model = Net()
    variables = model.init(jax.random.key(seed), jnp.zeros((2, 8)), train=False)

    def loss_fn(params, batch, model_state, rng):
        logits, updates = model.apply({"params": params, "batch_stats": model_state},
                                      batch["x"], train=True, mutable=["batch_stats"],
                                      rngs={"dropout": rng})
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, updates["batch_stats"]

    tx = jaxamp.mixed_precision(optax.adam(3e-3), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=variables["params"], tx=tx,
                                     model_state=variables["batch_stats"],
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
    logits = model.apply({"params": state.master_params, "batch_stats": state.model_state},
                         jnp.asarray(batch["x"]), train=False)  # eval: running statistics
    moved = [float(np.abs(np.asarray(a) - b).max()) for a, b in
             zip(jax.tree.leaves(state.model_state), jax.tree.leaves(before), strict=True)]
    return {"first_loss": losses[0], "last_loss": losses[-1],
            "accuracy": float(jnp.mean(logits.argmax(-1) == batch["y"])),
            "bf16_share": audit.share("bfloat16"),
            "params_dtypes": sorted({str(p.dtype) for p in jax.tree.leaves(state.params)}),
            "batch_stats_dtypes": sorted({str(s.dtype) for s in
                                          jax.tree.leaves(state.model_state)}),
            "batch_stats_moved": min(moved)}


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key}: {value}")
