"""The promotion trap, caught by ``jaxamp.audit_grad``.

    python examples/promotion_trap.py

A common recipe keeps LayerNorm in fp32 (``LayerNorm(dtype=float32)``) and casts the params to
bf16. The LayerNorm's fp32 output then promotes the next Dense back to fp32: its matmul, and
the backward matmuls behind it, run in fp32 although every param is bf16. Nothing fails; the
step is just as slow as fp32. ``jaxamp.audit_grad`` counts the matmul FLOPs of the forward and
backward pass by operand dtype and names the scopes whose outputs brought fp32 in.

The fix is to build the layers with ``dtype=bfloat16`` (LayerNorm still computes its statistics
in fp32 inside and returns bf16): every matmul runs in bf16.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxamp


class Net(nn.Module):
    """Dense, LayerNorm, Dense, LayerNorm, Dense. ``dtype=None``: each layer computes in the
    dtype its inputs and params promote to."""

    dtype: Any = None
    norm_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_BxD):
        h = nn.Dense(256, dtype=self.dtype, name="dense1")(x_BxD)
        h = nn.LayerNorm(dtype=self.norm_dtype, name="norm1")(h)
        h = nn.Dense(256, dtype=self.dtype, name="dense2")(nn.gelu(h))
        h = nn.LayerNorm(dtype=self.norm_dtype, name="norm2")(h)
        return nn.Dense(10, dtype=self.dtype, name="head")(h)


def _xent(logits_BxK, labels_B):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits_BxK.astype(jnp.float32), labels_B).mean()


def _figures(report: jaxamp.reports.AuditReport) -> dict:
    return {"bf16_share": report.share("bfloat16"), "fp32_share": report.fp32_matmul_share,
            "fp32_sources": list(report.fp32_sources), "matmul_flops": report.total_matmul_flops}


def main(batch: int = 32, seed: int = 0) -> dict:
    policy = jaxamp.get_policy("mixed_bfloat16")
    x_Bx64 = jax.random.normal(jax.random.key(seed), (batch, 64))
    labels_B = jax.random.randint(jax.random.key(seed + 1), (batch,), 0, 10)
    params = Net().init(jax.random.key(seed + 2), x_Bx64)  # fp32

    trap, fixed = Net(), Net(dtype=jnp.bfloat16, norm_dtype=jnp.bfloat16)

    def loss_cast_params(params, x):  # bf16 params and inputs, LayerNorm(dtype=float32)
        return _xent(trap.apply(policy.cast_params_to_compute(params),
                                policy.cast_to_compute(x)), labels_B)

    def loss_built_bf16(params, x):  # every layer built with dtype=bfloat16
        return _xent(fixed.apply(params, x), labels_B)

    out = {}
    for name, loss in (("cast_params", loss_cast_params), ("dtype_bf16", loss_built_bf16)):
        report = jaxamp.audit_grad(loss, params, x_Bx64)
        out[name] = _figures(report)
        print(f"===== {name}\n{report}\n")
    for name, f in out.items():
        print(f"{name:12s} matmul FLOPs in bf16: {100 * f['bf16_share']:5.1f}%   "
              f"with an fp32 operand: {100 * f['fp32_share']:5.1f}%")
    return out


if __name__ == "__main__":
    main()
