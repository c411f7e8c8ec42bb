"""Flax NNX layers built on ``jaxamp.ops``: fp32 params, compute in ``dtype``.

Normalization statistics run in fp32 and their results are cast back to the compute dtype, so
the next matmul runs in it; what is saved for backward is the half-precision activations plus
small fp32 statistics (see ``jaxamp.ops``). Under an fp32 policy every layer is the usual fp32
computation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxamp import fp8 as fp8_lib
from jaxamp import ops

F32 = jnp.float32


def weighted_mean(values: jax.Array, weights: jax.Array | None) -> jax.Array:
    """The mean of ``values`` in fp32, weighted by ``weights`` (a mask) where given:
    ``sum(weights * values) / max(sum(weights), 1)``, as ``jaxamp.ops``' fused head computes it."""
    values = values.astype(F32)
    if weights is None:
        return values.mean()
    weights = weights.astype(F32)
    return (values * weights).sum() / jnp.maximum(weights.sum(), 1.0)


class BatchNorm(nnx.Module):
    """Batch norm over the channels (last) axis with fp32 params and running statistics.

    ``train=True`` normalizes with the batch statistics (computed in fp32) and updates the
    running averages; ``train=False`` uses the running averages. The output is in
    ``dtype``, the compute dtype, so the next convolution runs in it. ``residual`` is added
    and ``relu`` applied inside the same op (a ResNet block's tail).
    """

    def __init__(self, features: int, *, dtype: Any = F32, momentum: float = 0.9,
                 epsilon: float = 1e-5, zero_scale: bool = False):
        self.dtype = dtype
        self.momentum = momentum
        self.epsilon = epsilon
        self.scale = nnx.Param((jnp.zeros if zero_scale else jnp.ones)((features,), F32))
        self.bias = nnx.Param(jnp.zeros((features,), F32))
        self.mean = nnx.BatchStat(jnp.zeros((features,), F32))
        self.var = nnx.BatchStat(jnp.ones((features,), F32))

    def __call__(self, x: jax.Array, *, train: bool, residual: jax.Array | None = None,
                 relu: bool = False) -> jax.Array:
        x = x.astype(self.dtype)
        if not train:
            return ops.batch_norm_eval(x, self.scale[...], self.bias[...], self.mean[...],
                                       self.var[...], epsilon=self.epsilon, residual=residual,
                                       relu=relu)
        y, mean, var = ops.batch_norm_train(x, self.scale[...], self.bias[...],
                                            epsilon=self.epsilon, residual=residual, relu=relu)
        m = self.momentum
        self.mean[...] = m * self.mean[...] + (1.0 - m) * mean
        self.var[...] = m * self.var[...] + (1.0 - m) * var
        return y


def _matmul(dot: fp8_lib.DotGeneral | None, x: jax.Array, w: jax.Array,
            w_axis: int) -> jax.Array:
    """``x`` contracted on its last axis with ``w``'s ``w_axis``: a plain matmul, or a delayed
    FP8 one through ``dot``."""
    dims = (((x.ndim - 1,), (w_axis,)), ((), ()))
    if dot is None:
        return jax.lax.dot_general(x, w, dims)
    return dot(x, w, dims)


class Dense(nnx.Module):
    """``x @ kernel + bias`` in ``dtype`` with fp32 params (the layout of ``nnx.Linear``);
    the bias gradient is summed in fp32. ``fp8``: a ``jaxamp.fp8.DelayedScaling`` recipe runs
    the matmul in FP8 with its own amax history."""

    def __init__(self, in_features: int, out_features: int, *, dtype: Any = F32,
                 kernel_init: Any = None, use_bias: bool = True,
                 fp8: fp8_lib.DelayedScaling | None = None, rngs: nnx.Rngs):
        self.dtype = dtype
        init = kernel_init or jax.nn.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), F32))
        self.bias = nnx.Param(jnp.zeros((out_features,), F32)) if use_bias else None
        self.dot = None if fp8 is None else fp8_lib.DotGeneral(fp8)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = _matmul(self.dot, x.astype(self.dtype), self.kernel[...].astype(self.dtype), 0)
        if self.bias is None:
            return y
        return ops.bias_add(y, self.bias[...].astype(self.dtype))


class LayerNorm(nnx.Module):
    """Layer norm with fp32 params; statistics in fp32, output in ``dtype``."""

    def __init__(self, features: int, *, dtype: Any = F32, epsilon: float = 1e-6):
        self.dtype = dtype
        self.epsilon = epsilon
        self.scale = nnx.Param(jnp.ones((features,), F32))
        self.bias = nnx.Param(jnp.zeros((features,), F32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return ops.layer_norm(x.astype(self.dtype), self.scale[...], self.bias[...],
                          epsilon=self.epsilon)


class Embed(nnx.Module):
    """An embedding table (fp32 param) looked up in ``dtype``; ``attend`` is the tied
    output projection ``x @ table.T``."""

    def __init__(self, num_embeddings: int, features: int, *, dtype: Any = F32,
                 stddev: float = 0.02, fp8: fp8_lib.DelayedScaling | None = None,
                 rngs: nnx.Rngs):
        self.dtype = dtype
        init = jax.nn.initializers.normal(stddev)
        self.embedding = nnx.Param(init(rngs.params(), (num_embeddings, features), F32))
        self.dot = None if fp8 is None else fp8_lib.DotGeneral(fp8)  # for attend

    def __call__(self, ids: jax.Array) -> jax.Array:
        return ops.embed_lookup(self.embedding[...].astype(self.dtype), ids)

    def attend(self, x: jax.Array) -> jax.Array:
        return _matmul(self.dot, x.astype(self.dtype), self.embedding[...].astype(self.dtype), 1)
