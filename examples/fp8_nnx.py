"""FP8 training of a Flax NNX model, with both recipes.

    python examples/fp8_nnx.py

* **current** scaling: the model uses ``nnx.Linear`` with its defaults; ``make_train_step(...,
  autocast=True)`` under the ``mixed_fp8`` policy runs every matmul in FP8 (e4m3 forward, e5m2
  gradients), each tensor scaled by its own amax. Nothing in the model changes.
* **delayed** scaling: the model uses ``jaxamp.fp8.Linear``, whose amax history and scales are
  ``jaxamp.fp8.Fp8Meta`` variables. They are split from the params and kept in the train
  state's model state; the step updates them (the optimizer never sees them).

The audit confirms where the matmuls run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxamp


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, recipe: jaxamp.fp8.DelayedScaling | None = None):
        def linear(n_in, n_out):
            if recipe is None:
                return nnx.Linear(n_in, n_out, rngs=rngs)
            return jaxamp.fp8.Linear(n_in, n_out, recipe=recipe, rngs=rngs)
        self.hidden = linear(4, 64)
        self.out = linear(64, 1)

    def __call__(self, x_BxD):
        return self.out(nnx.relu(self.hidden(x_BxD)))


def regression_data(n: int = 256):
    x_Nx4 = jax.random.normal(jax.random.key(0), (n, 4))
    return {"x": x_Nx4, "y": jnp.sin(x_Nx4.sum(-1, keepdims=True))}


def train(recipe: str, steps: int, seed: int = 0) -> dict:
    delayed = jaxamp.fp8.DelayedScaling(history_length=16) if recipe == "delayed" else None
    graphdef, params, fp8_meta = nnx.split(MLP(nnx.Rngs(seed), delayed), nnx.Param,
                                           jaxamp.fp8.Fp8Meta)

    def loss_fn(params, batch, model_state):
        model = nnx.merge(graphdef, params, model_state)
        loss = jnp.mean((model(batch["x"]).astype(jnp.float32) - batch["y"]) ** 2)
        return loss, nnx.state(model, jaxamp.fp8.Fp8Meta)  # the metadata, for the step

    tx = jaxamp.mixed_precision(optax.adam(1e-2), "mixed_fp8")
    state = jaxamp.TrainState.create(params=params, tx=tx, model_state=fp8_meta)
    step = jax.jit(jaxamp.make_train_step(loss_fn, has_model_state=True,
                                          autocast=recipe == "current"))
    batch = regression_data()
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))

    def loss_only(params, batch, model_state):
        return loss_fn(params, state.policy.cast_to_compute(batch), model_state)[0]
    audited = jaxamp.autocast(loss_only, "mixed_fp8") if recipe == "current" else loss_only
    report = jaxamp.audit_grad(audited, state.params, batch, state.model_state)
    metas = jaxamp.fp8.Fp8State.find_all(state.model_state)
    return {"first_loss": losses[0], "last_loss": losses[-1],
            "fp8_share": report.fp8_matmul_share, "fp8_states": len(metas),
            "input_amax_history": [float(a) for a in metas[0].amax_history[0, :3]]
            if metas else [],
            "skipped_steps": int(jaxamp.state.find_state(state.opt_state).health.skipped_steps)}


def main(steps: int = 200) -> dict:
    out = {recipe: train(recipe, steps) for recipe in ("current", "delayed")}
    for recipe, figures in out.items():
        print(f"{recipe:8s} loss {figures['first_loss']:.4f} -> {figures['last_loss']:.4f}, "
              f"matmul FLOPs in FP8: {100 * figures['fp8_share']:.1f}%, "
              f"FP8 states: {figures['fp8_states']}")
    return out


if __name__ == "__main__":
    main()
