"""A Flax NNX model with ``nnx.BatchNorm`` and ``nnx.Dropout``, trained by
``jaxamp.make_train_step`` under autocast.

    python examples/nnx_batchnorm_dropout.py

The model is written in fp32 (NNX's defaults). ``nnx.split`` gives three parts: the graph, the
params (``nnx.Param``: what the optimizer trains, bf16 working copies of an fp32 master) and the
rest of the state (``nnx.BatchStat``: BatchNorm's running statistics, the step's
``model_state``, kept in fp32 and replaced by what the loss returns; a skipped step keeps the
old ones). Dropout draws from ``rng``: the state's key folded with the step (and the device,
the micro-batch), handed to the loss with ``has_rng=True`` and given to the model as
``nnx.Rngs(dropout=rng)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxamp


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, 64, rngs=rngs)
        self.norm = nnx.BatchNorm(64, rngs=rngs)
        self.drop = nnx.Dropout(0.1)
        self.out = nnx.Linear(64, 3, rngs=rngs)

    def __call__(self, x_BxD, *, rngs: nnx.Rngs | None = None):
        h = nnx.relu(self.norm(self.hidden(x_BxD)))
        return self.out(self.drop(h, rngs=rngs))


def data(n: int = 256, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x[:, :3].argmax(-1)).astype(np.int32)
    return {"x": x, "y": y}


def main(steps: int = 60, seed: int = 0) -> dict:
    model = Net(nnx.Rngs(seed))
    graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)

    def loss_fn(params, batch, model_state, rng):
        net = nnx.merge(graphdef, params, model_state)
        net.train()  # BatchNorm on the batch's statistics, updating the running ones
        logits = net(batch["x"], rngs=nnx.Rngs(dropout=rng))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, nnx.state(net, nnx.BatchStat)

    tx = jaxamp.mixed_precision(optax.adam(3e-3), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=params, tx=tx, model_state=batch_stats,
                                     rng=jax.random.key(seed))
    step = jax.jit(jaxamp.make_train_step(loss_fn, has_model_state=True, has_rng=True,
                                          autocast=True), donate_argnums=0)
    batch = data()
    before = jax.tree.map(np.asarray, state.model_state)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    audit = jaxamp.audit(step, state, batch)
    # Eval: the running statistics, no dropout.
    net = nnx.merge(graphdef, state.master_params, state.model_state)
    net.eval()
    accuracy = float(jnp.mean(net(jnp.asarray(batch["x"])).argmax(-1) == batch["y"]))
    moved = [float(np.abs(np.asarray(a) - b).max()) for a, b in
             zip(jax.tree.leaves(state.model_state), jax.tree.leaves(before), strict=True)]
    return {"first_loss": losses[0], "last_loss": losses[-1], "accuracy": accuracy,
            "bf16_share": audit.share("bfloat16"),
            "params_dtypes": sorted({str(p.dtype) for p in jax.tree.leaves(state.params)}),
            "batch_stats_dtypes": sorted({str(s.dtype) for s in
                                          jax.tree.leaves(state.model_state)}),
            "batch_stats_moved": min(moved)}


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key}: {value}")
