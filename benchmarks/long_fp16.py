"""Suite ``long_fp16``: thousands of steps of an MLP on digits under ``mixed_float16``, with a short
growth interval so that the dynamic loss scale grows into real fp16 overflows and backs off,
again and again. Reports the skipped steps, the scale's range (it must never reach 0, inf or
nan) and the final loss against the same run in fp32.

    python -m benchmarks long_fp16                      # 5000 steps, growth every 20
    python -m benchmarks long_fp16 --steps 600 --growth-interval 10 --json
"""

from __future__ import annotations

import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jaxamp
from train import data as data_lib

ROUNDS = None  # one timed run per precision
HIDDEN = 128
STEPS, TINY_STEPS = 5000, 200


def _init(seed: int) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"dense1": {"kernel": jax.random.normal(k1, (64, HIDDEN)) / 8.0,
                       "bias": jnp.zeros((HIDDEN,))},
            "dense2": {"kernel": jax.random.normal(k2, (HIDDEN, 10)) / np.sqrt(HIDDEN),
                       "bias": jnp.zeros((10,))}}


def _logits(params: dict, x_BxD: jax.Array) -> jax.Array:
    h_BxH = jax.nn.relu(x_BxD @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    return (h_BxH @ params["dense2"]["kernel"] + params["dense2"]["bias"]).astype(jnp.float32)


def loss_fn(params: dict, batch: dict) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        _logits(params, batch["x"]), batch["y"]).mean()


def train_run(precision: str, *, steps: int, growth_interval: int, batch_size: int = 64,
        lr: float = 1e-3, seed: int = 0, chunk: int = 250) -> dict:
    """Trains ``steps`` steps; returns the per-step losses, scales and finite flags, and the
    final state's eval loss and accuracy on the held-out digits."""
    train, held_out = data_lib.split(data_lib.load_digits(), 0.2, seed)
    x_NxD = jnp.asarray(train["image"].reshape(len(train["image"]), -1))
    y_N = jnp.asarray(train["label"])
    policy = jaxamp.get_policy(precision)
    scale = jaxamp.DynamicLossScale(growth_interval=growth_interval) \
        if policy.compute_dtype == jnp.float16 else jaxamp.NoOpLossScale()
    tx = jaxamp.mixed_precision(optax.adam(lr), policy, loss_scale=scale, stall_after=None)
    state = jaxamp.TrainState.create(params=_init(seed), tx=tx)
    step = jaxamp.make_train_step(loss_fn)

    @jax.jit
    def steps_of(state, index_SxB):
        def body(state, index_B):
            state, m = step(state, {"x": x_NxD[index_B], "y": y_N[index_B]})
            return state, (m["loss"], m["loss_scale"], m["grads_finite"])
        return lax.scan(body, state, index_SxB)

    index = np.random.default_rng(seed).integers(0, len(y_N), (steps, batch_size))
    losses, scales, finite = [], [], []
    t0 = time.perf_counter()
    for start in range(0, steps, chunk):
        state, (loss, used, ok) = steps_of(state, jnp.asarray(index[start:start + chunk]))
        losses.append(np.asarray(loss))
        scales.append(np.asarray(used))
        finite.append(np.asarray(ok))
    seconds = time.perf_counter() - t0
    logits = _logits(state.params, policy.cast_to_compute(
        jnp.asarray(held_out["image"].reshape(len(held_out["image"]), -1))))
    labels = jnp.asarray(held_out["label"])
    final_scale = jaxamp.state.get_loss_scale(state.opt_state)
    return {
        "precision": precision,
        "losses": np.concatenate(losses),
        "scales": np.concatenate(scales),  # the scale used at each step
        "finite": np.concatenate(finite),
        "final_scale": float(final_scale.loss_scale),
        "scale_config": {name: getattr(final_scale, name, None) for name in (
            "growth_interval", "growth_factor", "backoff_factor", "min_scale", "max_scale",
            "hysteresis", "hysteresis_refill")},
        "skipped_steps": int(jaxamp.state.find_state(state.opt_state).health.skipped_steps),
        "eval_loss": float(optax.softmax_cross_entropy_with_integer_labels(logits, labels)
                           .mean()),
        "eval_accuracy": float((logits.argmax(-1) == labels).mean()),
        "seconds": seconds,
    }


def report(steps: int = 5000, growth_interval: int = 20, batch_size: int = 64,
           seed: int = 0) -> dict:
    """The fp16 run against the fp32 run, with the same batches."""
    fp16 = train_run("mixed_float16", steps=steps, growth_interval=growth_interval,
               batch_size=batch_size, seed=seed)
    fp32 = train_run("float32", steps=steps, growth_interval=growth_interval, batch_size=batch_size,
               seed=seed)
    scales = np.append(fp16["scales"], fp16["final_scale"])
    change = np.diff(scales)
    window = min(100, steps)
    tail16 = fp16["losses"][-window:][fp16["finite"][-window:]]
    return {
        "steps": steps, "growth_interval": growth_interval, "batch_size": batch_size,
        "skipped_steps": fp16["skipped_steps"],
        "growths": int((change > 0).sum()), "backoffs": int((change < 0).sum()),
        "scale_min": float(scales.min()), "scale_max": float(scales.max()),
        "scale_ever_zero_inf_or_nan": bool(np.any((scales <= 0) | ~np.isfinite(scales))),
        "final_train_loss_fp16": float(tail16.mean()),
        "final_train_loss_fp32": float(fp32["losses"][-window:].mean()),
        "eval_loss_fp16": fp16["eval_loss"], "eval_loss_fp32": fp32["eval_loss"],
        "eval_accuracy_fp16": fp16["eval_accuracy"],
        "eval_accuracy_fp32": fp32["eval_accuracy"],
        "seconds_fp16": fp16["seconds"], "seconds_fp32": fp32["seconds"],
        "runs": {"mixed_float16": fp16, "float32": fp32},
    }


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps per run (default {STEPS}; {TINY_STEPS} with --tiny)")
    parser.add_argument("--growth-interval", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args) -> dict:
    """Prints the figures (as JSON with ``--json``), without the runs; returns them with the
    runs (``"runs"``: each precision's per-step scales, losses and finite flags)."""
    steps = args.steps or (TINY_STEPS if args.tiny else STEPS)
    with_runs = report(steps, args.growth_interval, args.batch_size, args.seed)
    figures = {k: v for k, v in with_runs.items() if k != "runs"}
    if args.json:
        print(json.dumps(figures, indent=2))
        return with_runs
    print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, "
          f"{jax.devices()[0].platform}")
    print(f"MLP 64-{HIDDEN}-10 on digits, batch {args.batch_size}, adam 1e-3, "
          f"{steps} steps, mixed_float16 with DynamicLossScale(growth_interval="
          f"{args.growth_interval}) against float32")
    for key, value in figures.items():
        print(f"  {key:28s} {value:.6g}" if isinstance(value, float) else f"  {key:28s} {value}")
    return with_runs
