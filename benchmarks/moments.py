"""Suite ``moments``: Adam's second moment kept in fewer bits, against its fp32 value.

    python -m benchmarks moments [--tiny]

``nu`` follows ``b2 * nu + (1 - b2) * g**2`` on gaussian gradients (1024 values, 8000 steps,
one key), once in fp32 and once stored after every step in each format of
``mixed_precision(moments_dtype=...)``: bf16 rounded to the nearest (what a plain cast does),
bf16 rounded stochastically (``"bfloat16"``), and block-wise 8-bit codes (``"8bit"``, blocks of
256, the unsigned map). Two gradient streams: stationary (unit variance) and shrinking (the
scale falls by e**-2 over the run, so ``g**2`` by 55x). Per format, ``b2`` and stream: the mean
and the standard deviation over the values of the stored ``nu`` over the fp32 ``nu`` at the
last step. A mean above 1 lowers each param's step by its square root. Deterministic (the same
numbers on every run); ``tests/test_moments.py`` holds its bounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from jaxamp.rounding import dequantize_blockwise
from jaxamp.rounding import quantize_blockwise
from jaxamp.rounding import stochastic_round

ROUNDS = None  # nothing is timed
BETAS = (0.95, 0.99, 0.999)
STEPS, VALUES = 8000, 1024

STORES = {
    "bf16, nearest": lambda x, t: x.astype(jnp.bfloat16).astype(jnp.float32),
    "bf16, stochastic": lambda x, t: stochastic_round(
        x, jnp.bfloat16, jax.random.fold_in(jax.random.key(1), t)).astype(jnp.float32),
    "8bit": lambda x, t: dequantize_blockwise(quantize_blockwise(x, signed=False)),
}


def stored_nu(store, b2: float, shrinking: bool, steps: int = STEPS,
              n: int = VALUES) -> tuple[float, float]:
    """The mean and the standard deviation of ``nu`` kept by ``store`` over the fp32 ``nu``."""
    key = jax.random.key(0)

    def body(carry, t):
        exact, stored = carry
        g = jax.random.normal(jax.random.fold_in(key, t), (n,))
        g = g * jnp.exp(-2.0 * t / steps) if shrinking else g
        return (b2 * exact + (1 - b2) * g * g, store(b2 * stored + (1 - b2) * g * g, t)), None

    (exact, stored), _ = jax.jit(lambda: jax.lax.scan(
        body, (jnp.ones(n), jnp.ones(n)), jnp.arange(steps)))()
    ratio = np.asarray(stored / exact)
    return float(ratio.mean()), float(ratio.std())


def run(args) -> dict:
    steps = 200 if args.tiny else STEPS
    rows = []
    for b2 in BETAS:
        for name, store in STORES.items():
            for shrinking in (False, True):
                mean, spread = stored_nu(store, b2, shrinking, steps)
                rows.append({"format": name, "b2": b2,
                             "gradients": "shrinking 55x" if shrinking else "stationary",
                             "nu_over_fp32": round(mean, 4), "spread": round(spread, 4)})
    harness.write_outputs(
        "moments", rows, ["format", "b2", "gradients", "nu_over_fp32", "spread"], args.out,
        None, f"{harness.machine()}; {VALUES} gaussian gradients, {steps} steps; nu_over_fp32: "
              "the mean over the values of the stored nu over the fp32 nu at the last step; "
              "spread: its standard deviation.")
    return {"moments": rows}
