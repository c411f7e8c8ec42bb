"""Layers that compute in fp32 and keep half-precision tensors for the backward pass.

Normalization statistics, softmaxes, GELU and the cross-entropy run in fp32 and their results
are cast back to the input's dtype, so the next matmul runs in the compute dtype. Each op has a
``jax.custom_vjp`` whose residuals are its half-precision input or output plus small fp32
statistics: with plain autodiff, the fp32 intermediates (``x - mean``, the fp32 softmax, the
fp32 logits) would be what is saved for backward, and a mixed-precision model would keep
almost as many activation bytes as an fp32 one. The backward rules recompute what they need
in fp32.

Under an fp32 policy every op is the usual fp32 computation.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

F32 = jnp.float32


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(F32)


# --------------------------------------------------------------------------- batch norm


def _bn_normalize(x32, mean, rstd, scale, bias, residual, relu):
    y = (x32 - mean) * (rstd * _f32(scale)) + _f32(bias)
    if residual is not None:
        y = y + _f32(residual)
    return jnp.maximum(y, 0.0) if relu else y


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _batch_norm_train(x, scale, bias, residual, epsilon, relu):
    return _batch_norm_train_fwd(x, scale, bias, residual, epsilon, relu)[0]


def _batch_norm_train_fwd(x, scale, bias, residual, epsilon, relu):
    axes = tuple(range(x.ndim - 1))
    x32 = _f32(x)
    mean = x32.mean(axes)
    var = jnp.square(x32 - mean).mean(axes)
    rstd = jax.lax.rsqrt(var + epsilon)
    y = _bn_normalize(x32, mean, rstd, scale, bias, residual, relu).astype(x.dtype)
    # The output is saved only to mask the ReLU (it is the next layer's input anyway); an
    # empty array stands for the residual branch, to give its cotangent the right dtype.
    res_like = None if residual is None else jnp.zeros((0,), residual.dtype)
    return (y, mean, var), (x, scale, bias, mean, rstd, y if relu else None, res_like)


def _batch_norm_train_bwd(epsilon, relu, res, cts):
    del epsilon
    x, scale, bias, mean, rstd, y, res_like = res
    g = _f32(cts[0])  # the statistics' cotangents are ignored: they feed running averages
    if relu:
        g = jnp.where(y > 0, g, 0.0)
    axes = tuple(range(x.ndim - 1))
    n = math.prod(x.shape[:-1])
    xhat = (_f32(x) - mean) * rstd
    dbias = g.sum(axes)
    dscale = (g * xhat).sum(axes)
    dx = (rstd * _f32(scale)) * (g - dbias / n - xhat * (dscale / n))
    dres = None if res_like is None else g.astype(res_like.dtype)
    return dx.astype(x.dtype), dscale.astype(scale.dtype), dbias.astype(bias.dtype), dres


_batch_norm_train.defvjp(_batch_norm_train_fwd, _batch_norm_train_bwd)


def batch_norm_train(x: jax.Array, scale: jax.Array, bias: jax.Array, *,
                     epsilon: float = 1e-5, residual: jax.Array | None = None,
                     relu: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Batch norm with batch statistics over all axes but the last (channels-last).

    Computes ``relu?(normalize(x) * scale + bias + residual?)`` in fp32 and returns it in
    ``x``'s dtype, with the fp32 batch mean and (biased) variance. The statistics are not
    differentiable (they feed the running averages). Saved for backward: ``x``, the output
    when ``relu`` (the next layer keeps it anyway), and per-channel fp32 statistics.
    """
    if residual is not None:
        residual = residual.astype(x.dtype)
    y, mean, var = _batch_norm_train(x, scale, bias, residual, float(epsilon), bool(relu))
    return y, jax.lax.stop_gradient(mean), jax.lax.stop_gradient(var)


def batch_norm_eval(x: jax.Array, scale: jax.Array, bias: jax.Array, mean: jax.Array,
                    var: jax.Array, *, epsilon: float = 1e-5,
                    residual: jax.Array | None = None, relu: bool = False) -> jax.Array:
    """Batch norm with given (running) statistics, in fp32, returned in ``x``'s dtype."""
    rstd = jax.lax.rsqrt(_f32(var) + epsilon)
    return _bn_normalize(_f32(x), _f32(mean), rstd, scale, bias, residual, relu).astype(x.dtype)


# --------------------------------------------------------------------------- layer norm


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, scale, bias, epsilon):
    return _layer_norm_fwd(x, scale, bias, epsilon)[0]


def _layer_norm_fwd(x, scale, bias, epsilon):
    x32 = _f32(x)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    rstd = jax.lax.rsqrt(var + epsilon)
    y = ((x32 - mean) * rstd * _f32(scale) + _f32(bias)).astype(x.dtype)
    return y, (x, scale, bias, mean, rstd)


def _layer_norm_bwd(epsilon, res, g):
    del epsilon
    x, scale, bias, mean, rstd = res
    g = _f32(g)
    xhat = (_f32(x) - mean) * rstd
    lead = tuple(range(x.ndim - 1))
    dscale = (g * xhat).sum(lead)
    dbias = g.sum(lead)
    dxhat = g * _f32(scale)
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True)
                 - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    return dx.astype(x.dtype), dscale.astype(scale.dtype), dbias.astype(bias.dtype)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, *,
               epsilon: float = 1e-6) -> jax.Array:
    """Layer norm over the last axis, computed in fp32 and returned in ``x``'s dtype.

    Saved for backward: ``x`` and the per-row fp32 mean and inverse standard deviation.
    """
    return _layer_norm(x, scale, bias, float(epsilon))


# --------------------------------------------------------------------------- softmax, GELU


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _attention_softmax(scores, mask, scale):
    return _attention_softmax_fwd(scores, mask, scale)[0]


def _attention_softmax_fwd(scores, mask, scale):
    s = _f32(scores) * scale
    if mask is not None:
        s = jnp.where(mask, s, jnp.finfo(F32).min)
    probs = jax.nn.softmax(s, axis=-1).astype(scores.dtype)
    return probs, (probs,)


def _attention_softmax_bwd(scale, res, g):
    (probs,) = res
    p, g = _f32(probs), _f32(g)
    ds = p * (g - (g * p).sum(-1, keepdims=True)) * scale
    return ds.astype(probs.dtype), None


_attention_softmax.defvjp(_attention_softmax_fwd, _attention_softmax_bwd)


def attention_softmax(scores: jax.Array, mask: jax.Array | None = None, *,
                      scale: float = 1.0) -> jax.Array:
    """``softmax(scores * scale)`` over the last axis where ``mask`` is True, in fp32.

    The probabilities come back in ``scores``' dtype, ready for the value matmul, and are the
    only thing saved for backward (the fp32 softmax is not kept).
    """
    return _attention_softmax(scores, mask, float(scale))


_GELU_C = math.sqrt(2.0 / math.pi)


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """GELU (tanh approximation) computed in fp32, returned in ``x``'s dtype; saves ``x``."""
    return _gelu_fwd(x)[0]


def _gelu_fwd(x):
    return jax.nn.gelu(_f32(x), approximate=True).astype(x.dtype), (x,)


def _gelu_bwd(res, g):
    (x,) = res
    x32 = _f32(x)
    t = jnp.tanh(_GELU_C * (x32 + 0.044715 * x32 ** 3))
    dy = 0.5 * (1.0 + t) + 0.5 * x32 * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * x32 ** 2)
    return ((_f32(g) * dy).astype(x.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


# --------------------------------------------------------------------------- bias


@jax.custom_vjp
def bias_add(x: jax.Array, bias: jax.Array) -> jax.Array:
    """``x + bias`` (``bias`` broadcast over ``x``'s leading axes), whose gradient for
    ``bias`` is summed in fp32 and returned in ``bias``' dtype.

    Plain autodiff sums the gradient over the batch in the compute dtype.
    """
    return x + bias


def _bias_add_fwd(x, bias):
    # An empty array carries the bias' shape and dtype to the backward pass.
    return x + bias, jnp.zeros((0,) + bias.shape, bias.dtype)


def _bias_add_bwd(bias_like, g):
    lead = tuple(range(g.ndim - (bias_like.ndim - 1)))
    dbias = _f32(g).sum(lead).reshape(bias_like.shape[1:])
    return g, dbias.astype(bias_like.dtype)


bias_add.defvjp(_bias_add_fwd, _bias_add_bwd)


# --------------------------------------------------------------------------- loss, embedding


@jax.custom_vjp
def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example ``-log softmax(logits)[label]`` in fp32, for logits of any float dtype.

    Saved for backward: the logits in their own dtype and the fp32 log-sum-exp per example;
    the fp32 softmax is recomputed.
    """
    return _xent_fwd(logits, labels)[0]


def _xent_fwd(logits, labels):
    l32 = _f32(logits)
    lse = jax.nn.logsumexp(l32, axis=-1)
    picked = jnp.take_along_axis(l32, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return lse - picked, (logits, labels, lse)


def _xent_bwd(res, g):
    logits, labels, lse = res
    p = jnp.exp(_f32(logits) - lse[..., None])
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=F32)
    return ((p - onehot) * _f32(g)[..., None]).astype(logits.dtype), None


softmax_cross_entropy.defvjp(_xent_fwd, _xent_bwd)


@jax.custom_vjp
def embed_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]``, whose gradient is accumulated in fp32 and returned in ``table``'s dtype.

    With half-precision working params, plain autodiff scatter-adds the gradient rows of
    repeated ids in half precision.
    """
    return table[ids]


def _embed_fwd(table, ids):
    return table[ids], (table, ids)


def _embed_bwd(res, g):
    table, ids = res
    d = jnp.zeros(table.shape, F32).at[ids].add(_f32(g))
    return d.astype(table.dtype), None


embed_lookup.defvjp(_embed_fwd, _embed_bwd)


# --------------------------------------------------------------------------- modules


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
            return batch_norm_eval(x, self.scale[...], self.bias[...], self.mean[...],
                                   self.var[...], epsilon=self.epsilon, residual=residual,
                                   relu=relu)
        y, mean, var = batch_norm_train(x, self.scale[...], self.bias[...],
                                        epsilon=self.epsilon, residual=residual, relu=relu)
        m = self.momentum
        self.mean[...] = m * self.mean[...] + (1.0 - m) * mean
        self.var[...] = m * self.var[...] + (1.0 - m) * var
        return y


class Dense(nnx.Module):
    """``x @ kernel + bias`` in ``dtype`` with fp32 params (the layout of ``nnx.Linear``);
    the bias gradient is summed in fp32."""

    def __init__(self, in_features: int, out_features: int, *, dtype: Any = F32,
                 kernel_init: Any = None, use_bias: bool = True, rngs: nnx.Rngs):
        self.dtype = dtype
        init = kernel_init or jax.nn.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), F32))
        self.bias = nnx.Param(jnp.zeros((out_features,), F32)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(self.dtype) @ self.kernel[...].astype(self.dtype)
        if self.bias is None:
            return y
        return bias_add(y, self.bias[...].astype(self.dtype))


class LayerNorm(nnx.Module):
    """Layer norm with fp32 params; statistics in fp32, output in ``dtype``."""

    def __init__(self, features: int, *, dtype: Any = F32, epsilon: float = 1e-6):
        self.dtype = dtype
        self.epsilon = epsilon
        self.scale = nnx.Param(jnp.ones((features,), F32))
        self.bias = nnx.Param(jnp.zeros((features,), F32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x.astype(self.dtype), self.scale[...], self.bias[...],
                          epsilon=self.epsilon)


class Embed(nnx.Module):
    """An embedding table (fp32 param) looked up in ``dtype``; ``attend`` is the tied
    output projection ``x @ table.T``."""

    def __init__(self, num_embeddings: int, features: int, *, dtype: Any = F32,
                 stddev: float = 0.02, rngs: nnx.Rngs):
        self.dtype = dtype
        init = jax.nn.initializers.normal(stddev)
        self.embedding = nnx.Param(init(rngs.params(), (num_embeddings, features), F32))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return embed_lookup(self.embedding[...].astype(self.dtype), ids)

    def attend(self, x: jax.Array) -> jax.Array:
        return x.astype(self.dtype) @ self.embedding[...].astype(self.dtype).T
