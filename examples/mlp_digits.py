"""An MLP on scikit-learn's digits under ``mixed_bfloat16`` and ``mixed_float16``.

    python examples/mlp_digits.py [--steps 300] [--precision mixed_bfloat16 mixed_float16]

The whole loop through the public API: a policy, ``jaxamp.mixed_precision`` around
``optax.adam`` (fp32 master weights and, under fp16, a dynamic loss scale), a
``jaxamp.TrainState`` and the step of ``jaxamp.make_train_step``. Prints the loss, the loss
scale and the skipped steps as it trains, then the held-out accuracy.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import jaxamp


def digits(seed: int = 0):
    """Flattened digits in [0, 1], 80/20 at random: ``((x_train, y_train), (x_eval, y_eval))``."""
    data = load_digits()  # 1,797 8x8 images, shipped with scikit-learn
    x_Nx64 = (data.data / 16.0).astype(np.float32)  # pixels are 0..16
    y_N = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y_N))
    n_eval = round(0.2 * len(y_N))
    held_out, train = np.sort(order[:n_eval]), np.sort(order[n_eval:])
    return (x_Nx64[train], y_N[train]), (x_Nx64[held_out], y_N[held_out])


def init_mlp(key, sizes=(64, 256, 256, 10)):
    params = []
    keys = jax.random.split(key, len(sizes) - 1)
    for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:], strict=True):
        params.append({"kernel": jax.random.normal(k, (n_in, n_out)) * (2.0 / n_in) ** 0.5,
                       "bias": jnp.zeros(n_out)})
    return params


def logits_fn(params, x_BxD):
    for layer in params[:-1]:
        x_BxD = jax.nn.relu(x_BxD @ layer["kernel"] + layer["bias"])
    return x_BxD @ params[-1]["kernel"] + params[-1]["bias"]


def loss_fn(params, batch):
    logits_BxK = logits_fn(params, batch["x"]).astype(jnp.float32)  # the loss runs in fp32
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxK, batch["y"]).mean()


def train(precision: str, steps: int, batch_size: int = 128, seed: int = 0,
          log_every: int = 25) -> dict:
    """Trains the MLP under ``precision``; returns its losses, loss scale and accuracy."""
    (x_tr, y_tr), (x_te, y_te) = digits(seed)
    policy = jaxamp.get_policy(precision)
    # A short growth interval so that a few hundred steps show the scale grow and back off.
    loss_scale = jaxamp.DynamicLossScale(growth_interval=50) \
        if policy.needs_loss_scaling else None
    tx = jaxamp.mixed_precision(optax.adam(1e-3), policy, loss_scale=loss_scale)
    state = jaxamp.TrainState.create(params=init_mlp(jax.random.key(seed)), tx=tx)
    step = jax.jit(jaxamp.make_train_step(loss_fn), donate_argnums=0)
    rng = np.random.default_rng(seed)
    scale_kind = type(jaxamp.state.get_loss_scale(state.opt_state)).__name__
    print(f"== {precision} ({policy}), loss scale {scale_kind}")
    losses = []
    for i in range(1, steps + 1):
        idx = rng.integers(0, len(x_tr), batch_size)
        state, m = step(state, {"x": x_tr[idx], "y": y_tr[idx]})
        losses.append(float(m["loss"]))
        if i % log_every == 0 or i == 1:
            print(f"step {i:4d}  loss {losses[-1]:.4f}  scale {float(m['loss_scale']):9.1f}"
                  f"  skipped {int(m['skipped_steps'])}  grad_norm {float(m['grad_norm']):.3f}")
    logits = logits_fn(state.params, policy.cast_to_compute(x_te))
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_te))
    print(f"{precision}: held-out accuracy {accuracy:.3f} after {steps} steps")
    return {"first_loss": losses[0], "last_loss": losses[-1], "accuracy": accuracy,
            "loss_scale": float(m["loss_scale"]), "skipped_steps": int(m["skipped_steps"]),
            "params_dtype": str(jax.tree.leaves(state.params)[0].dtype),
            "logits_dtype": str(logits.dtype)}


def main(steps: int = 300, precisions=("mixed_bfloat16", "mixed_float16")) -> dict:
    """``{precision: figures}`` for each precision."""
    return {precision: train(precision, steps) for precision in precisions}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--precision", nargs="+", default=["mixed_bfloat16", "mixed_float16"])
    args = ap.parse_args()
    main(args.steps, args.precision)
