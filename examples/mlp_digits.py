"""A minimal end-to-end run: an MLP on scikit-learn's digits under mixed_bfloat16 and mixed_float16.

    python -m train.demo [--steps 300]

Prints loss, loss scale and skipped steps as it trains, then the held-out accuracy.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from train import data


def load_digits(seed: int = 0):
    """Flattened digits, split 80/20: ``((x_train, y_train), (x_eval, y_eval))``."""
    train, held_out = data.split(data.load_digits(), 0.2, seed)
    return tuple((d["image"].reshape(len(d["image"]), -1), d["label"]) for d in (train, held_out))


def init_mlp(key, sizes=(64, 256, 256, 10)):
    params = []
    keys = jax.random.split(key, len(sizes) - 1)
    for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:], strict=True):
        params.append({"kernel": jax.random.normal(k, (n_in, n_out)) * (2.0 / n_in) ** 0.5,
                       "bias": jnp.zeros(n_out)})
    return params


def logits_fn(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["kernel"] + layer["bias"])
    return x @ params[-1]["kernel"] + params[-1]["bias"]


def loss_fn(params, batch):
    logits = logits_fn(params, batch["x"]).astype(jnp.float32)  # the loss runs in fp32
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def train(precision: str, steps: int, batch_size: int = 128, seed: int = 0, log_every: int = 25):
    (x_tr, y_tr), (x_te, y_te) = load_digits(seed)
    policy = jaxamp.get_policy(precision)
    # A short growth interval so that a few hundred steps show the scale grow and back off.
    loss_scale = jaxamp.DynamicLossScale(growth_interval=50) \
        if policy.compute_dtype == jnp.float16 else None
    tx = jaxamp.mixed_precision(optax.adam(1e-3), policy, loss_scale=loss_scale)
    state = jaxamp.TrainState.create(params=init_mlp(jax.random.key(seed)), tx=tx)
    step = jax.jit(jaxamp.make_train_step(loss_fn), donate_argnums=0)
    rng = np.random.default_rng(seed)
    scale_kind = type(jaxamp.get_loss_scale(state.opt_state)).__name__
    print(f"== {precision} ({policy}), loss scale {scale_kind}")
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        idx = rng.integers(0, len(x_tr), batch_size)
        state, m = step(state, {"x": x_tr[idx], "y": y_tr[idx]})
        if i % log_every == 0 or i == 1:
            print(f"step {i:4d}  loss {float(m['loss']):.4f}  scale {float(m['loss_scale']):9.1f}"
                  f"  skipped {int(m['skipped_steps'])}  grad_norm {float(m['grad_norm']):.3f}")
    params = state.params
    acc = float(jnp.mean(jnp.argmax(logits_fn(params, policy.cast_to_compute(x_te)), -1) == y_te))
    print(f"{precision}: held-out accuracy {acc:.3f} after {steps} steps "
          f"({time.perf_counter() - t0:.1f} s)")
    return acc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--precision", nargs="+", default=["mixed_bfloat16", "mixed_float16"])
    args = ap.parse_args(argv)
    for precision in args.precision:
        train(precision, args.steps)


if __name__ == "__main__":
    main()
