"""The code of :mod:`jaxamp.ops`: ops that compute in fp32 and save half-precision tensors
for the backward pass."""

from __future__ import annotations

import functools
import math
from typing import cast

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.typing import ArrayLike

__all__ = [
    "attention_softmax",
    "batch_norm_eval",
    "batch_norm_train",
    "bias_add",
    "embed_lookup",
    "gelu",
    "layer_norm",
    "linear_softmax_cross_entropy",
    "softmax_cross_entropy",
]

_F32 = jnp.float32


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(_F32)


def _empty_like(x: jax.Array) -> jax.Array:
    """A zero-byte array that carries ``x``'s shape and dtype to a backward rule."""
    return jnp.zeros((0,) + x.shape, x.dtype)


def _is_half(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32


def _unshared(res: tuple) -> tuple:
    """A backward rule's residuals, behind an optimization barrier where the first of them (the
    op's input or output) is half precision.

    A backward rule recomputes fp32 values from a half-precision residual (``xhat`` from ``x``,
    ``tanh`` of GELU's input). Without the barrier XLA sees the same expression as in the
    forward pass, computes it once and keeps the forward's fp32 result alive until the
    backward pass: the fp32 activation memory these ops exist to avoid (24 fp32 tanh tensors of
    BERT-Large's GELU on an H200). ``jax.checkpoint`` guards its recomputation the same way. In
    fp32 there is no half-precision tensor to keep instead, and the rules run as written.
    """
    return jax.lax.optimization_barrier(res) if _is_half(res[0]) else res


# --------------------------------------------------------------------------- batch norm


def _bn_normalize(x32: jax.Array, mean: jax.Array, rstd: jax.Array, scale: jax.Array,
                  bias: jax.Array, residual: jax.Array | None, relu: bool) -> jax.Array:
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
    x, scale, bias, mean, rstd, y, res_like = _unshared(res)
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


def batch_norm_train(x: ArrayLike, scale: ArrayLike, bias: ArrayLike, *,
                     epsilon: float = 1e-5, residual: ArrayLike | None = None,
                     relu: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Batch norm with the batch statistics, over every axis but the last (channels last).

    Computes ``relu?((x - mean) / sqrt(var + epsilon) * scale + bias + residual?)`` in fp32, with
    ``mean`` and the biased ``var`` of ``x`` in fp32 over all axes but the last, and returns it
    in ``x``'s dtype, with ``mean`` and ``var`` (fp32, shape ``(C,)``) for the running averages.
    ``residual`` (cast to ``x``'s dtype) and the ReLU are fused in: a ResNet block's tail. The
    returned statistics carry no gradient (they feed running averages); the gradient of ``y``
    is the full batch-norm gradient, through the batch statistics.

    Saved for backward: ``x`` (its half-precision input), the output when ``relu`` (to mask the
    gradient; it is the next layer's input anyway), and two fp32 statistics per channel.

    Args:
      x: the activations, ``(..., C)``, in the compute dtype.
      scale: ``(C,)``, any float dtype (an fp32 param); its gradient comes back in its dtype.
      bias: ``(C,)``, like ``scale``.
      epsilon: added to the variance.
      residual: an optional tensor of ``x``'s shape added before the ReLU.
      relu: whether to apply a ReLU to the sum.

    Returns:
      ``(y, mean, var)``: ``y`` in ``x``'s dtype, the batch ``mean`` and ``var`` in fp32.

    >>> import jax.numpy as jnp
    >>> from jaxamp import ops
    >>> x = jnp.array([[1.0, 10.0], [3.0, 30.0]], jnp.bfloat16)
    >>> y, mean, var = ops.batch_norm_train(x, jnp.ones(2), jnp.zeros(2))
    >>> y
    Array([[-1, -1],
           [1, 1]], dtype=bfloat16)
    >>> mean, var
    (Array([ 2., 20.], dtype=float32), Array([  1., 100.], dtype=float32))
    """
    x, scale, bias = jnp.asarray(x), jnp.asarray(scale), jnp.asarray(bias)
    res = None if residual is None else jnp.asarray(residual).astype(x.dtype)
    # ``functools.partial(jax.custom_vjp, ...)`` loses the wrapped function's return type.
    y, mean, var = cast(tuple[jax.Array, jax.Array, jax.Array],
                        _batch_norm_train(x, scale, bias, res, float(epsilon), bool(relu)))
    return y, jax.lax.stop_gradient(mean), jax.lax.stop_gradient(var)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _batch_norm_eval(x, scale, bias, mean, var, residual, epsilon, relu):
    return _batch_norm_eval_fwd(x, scale, bias, mean, var, residual, epsilon, relu)[0]


def _batch_norm_eval_fwd(x, scale, bias, mean, var, residual, epsilon, relu):
    rstd = jax.lax.rsqrt(_f32(var) + epsilon)
    y = _bn_normalize(_f32(x), _f32(mean), rstd, scale, bias, residual, relu).astype(x.dtype)
    res_like = None if residual is None else jnp.zeros((0,), residual.dtype)
    return y, (x, scale, bias, mean, var, rstd, y if relu else None, res_like)


def _batch_norm_eval_bwd(epsilon, relu, res, g):
    del epsilon
    x, scale, bias, mean, var, rstd, y, res_like = _unshared(res)
    g = _f32(g)
    if relu:
        g = jnp.where(y > 0, g, 0.0)
    axes = tuple(range(x.ndim - 1))
    a = rstd * _f32(scale)
    dbias = g.sum(axes)
    gxc = (g * (_f32(x) - _f32(mean))).sum(axes)
    dx = g * a
    dscale = gxc * rstd
    dmean = -dbias * a
    dvar = -0.5 * gxc * _f32(scale) * rstd * rstd * rstd
    dres = None if res_like is None else g.astype(res_like.dtype)
    return (dx.astype(x.dtype), dscale.astype(scale.dtype), dbias.astype(bias.dtype),
            dmean.astype(mean.dtype), dvar.astype(var.dtype), dres)


_batch_norm_eval.defvjp(_batch_norm_eval_fwd, _batch_norm_eval_bwd)


def batch_norm_eval(x: ArrayLike, scale: ArrayLike, bias: ArrayLike, mean: ArrayLike,
                    var: ArrayLike, *, epsilon: float = 1e-5,
                    residual: ArrayLike | None = None, relu: bool = False) -> jax.Array:
    """Batch norm with given (running) statistics, channels last.

    Computes ``relu?((x - mean) / sqrt(var + epsilon) * scale + bias + residual?)`` in fp32 and
    returns it in ``x``'s dtype. Differentiable in every array argument (fine-tuning with frozen
    statistics), each gradient in its argument's dtype.

    Saved for backward: ``x`` (its half-precision input), the output when ``relu``, and one fp32
    statistic per channel (plus the ``(C,)`` arguments themselves).

    Args:
      x: the activations, ``(..., C)``, in the compute dtype.
      scale: ``(C,)``, any float dtype.
      bias: ``(C,)``.
      mean: ``(C,)``, the running mean.
      var: ``(C,)``, the running variance.
      epsilon: added to the variance.
      residual: an optional tensor of ``x``'s shape, added before the ReLU.
      relu: whether to apply a ReLU to the sum.

    Returns:
      The normalized ``x``, in ``x``'s dtype.

    >>> import jax.numpy as jnp
    >>> from jaxamp import ops
    >>> x = jnp.array([[1.0, 10.0], [3.0, 30.0]], jnp.bfloat16)
    >>> ops.batch_norm_eval(x, jnp.ones(2), jnp.zeros(2), jnp.array([1.0, 10.0]),
    ...                     jnp.array([4.0, 100.0]), epsilon=0.0, relu=True)
    Array([[0, 0],
           [1, 2]], dtype=bfloat16)
    """
    x = jnp.asarray(x)
    res = None if residual is None else jnp.asarray(residual)
    return _batch_norm_eval(x, jnp.asarray(scale), jnp.asarray(bias), jnp.asarray(mean),
                            jnp.asarray(var), res, float(epsilon), bool(relu))


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
    x, scale, bias, mean, rstd = _unshared(res)
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


def layer_norm(x: ArrayLike, scale: ArrayLike, bias: ArrayLike, *,
               epsilon: float = 1e-6) -> jax.Array:
    """Layer norm over the last axis: ``(x - mean) / sqrt(var + epsilon) * scale + bias``.

    The statistics and the normalization run in fp32; the result is in ``x``'s dtype.

    Saved for backward: ``x`` (its half-precision input) and two fp32 statistics per row (the
    mean and the inverse standard deviation): ``2 + 8 / D`` bytes per bf16 element of a row of
    ``D``, against at least 4 for an fp32 ``x - mean``.

    Args:
      x: ``(..., D)``, in the compute dtype.
      scale: ``(D,)``, any float dtype (an fp32 param); its gradient comes back in its dtype.
      bias: ``(D,)``, like ``scale``.
      epsilon: added to the variance.

    Returns:
      The normalized ``x``, in ``x``'s dtype.

    >>> import jax.numpy as jnp
    >>> from jaxamp import ops
    >>> x = jnp.array([[1.0, 2.0, 3.0, 4.0]], jnp.bfloat16)
    >>> ops.layer_norm(x, jnp.ones(4), jnp.zeros(4))
    Array([[-1.34375, -0.447266, 0.447266, 1.34375]], dtype=bfloat16)
    """
    return _layer_norm(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(bias), float(epsilon))


# --------------------------------------------------------------------------- softmax, GELU


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _attention_softmax(scores, mask, scale):
    return _attention_softmax_fwd(scores, mask, scale)[0]


def _attention_softmax_fwd(scores, mask, scale):
    s = _f32(scores) * scale
    if mask is not None:
        s = jnp.where(mask, s, jnp.finfo(_F32).min)
    # In half precision the barrier keeps the probabilities, not the fp32 softmax they are cast
    # from: XLA would otherwise fuse the cast into each consumer (the value matmul, the backward
    # rule) and keep the fp32 exponentials until the backward pass (24 x 1.07 GB in BERT-Large
    # on an H200).
    probs = jax.nn.softmax(s, axis=-1).astype(scores.dtype)
    if _is_half(probs):
        probs = jax.lax.optimization_barrier(probs)
    return probs, (probs,)


def _attention_softmax_bwd(scale, res, g):
    (probs,) = _unshared(res)
    p, g = _f32(probs), _f32(g)
    ds = p * (g - (g * p).sum(-1, keepdims=True)) * scale
    return ds.astype(probs.dtype), None


_attention_softmax.defvjp(_attention_softmax_fwd, _attention_softmax_bwd)


def attention_softmax(scores: ArrayLike, mask: ArrayLike | None = None, *,
                      scale: float = 1.0) -> jax.Array:
    """``softmax(scores * scale)`` over the last axis, where ``mask`` is True, in fp32.

    Masked-out positions get probability 0 (a row masked everywhere is uniform). The
    probabilities come back in ``scores``' dtype, ready for the value matmul.

    Saved for backward: the probabilities only, in ``scores``' half precision (the fp32 softmax
    is not kept, and the backward rule rebuilds it from them in fp32).

    Args:
      scores: ``(..., Lq, Lk)`` attention logits, in the compute dtype.
      mask: an optional boolean array broadcastable to ``scores``; False masks a position out.
        Not differentiated.
      scale: multiplies ``scores`` first (``1 / sqrt(head_dim)``).

    Returns:
      The probabilities, in ``scores``' dtype.

    >>> import jax.numpy as jnp
    >>> from jaxamp import ops
    >>> scores = jnp.zeros((2, 2), jnp.bfloat16)
    >>> ops.attention_softmax(scores, jnp.tril(jnp.ones((2, 2), bool)), scale=0.5)
    Array([[1, 0],
           [0.5, 0.5]], dtype=bfloat16)
    """
    m = None if mask is None else jnp.asarray(mask)
    return _attention_softmax(jnp.asarray(scores), m, float(scale))


_GELU_C = math.sqrt(2.0 / math.pi)


@jax.custom_vjp
def _gelu(x):
    return _gelu_fwd(x)[0]


def _gelu_fwd(x):
    return jax.nn.gelu(_f32(x), approximate=True).astype(x.dtype), (x,)


def _gelu_bwd(res, g):
    (x,) = _unshared(res)
    x32 = _f32(x)
    t = jnp.tanh(_GELU_C * (x32 + 0.044715 * x32 ** 3))
    dy = 0.5 * (1.0 + t) + 0.5 * x32 * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * x32 ** 2)
    return ((_f32(g) * dy).astype(x.dtype),)


_gelu.defvjp(_gelu_fwd, _gelu_bwd)


def gelu(x: ArrayLike) -> jax.Array:
    """GELU, tanh approximation (``jax.nn.gelu(x, approximate=True)``), computed in fp32.

    The result is in ``x``'s dtype. Saved for backward: ``x`` (its half-precision input) alone;
    the backward rule recomputes the derivative from it in fp32.

    Args:
      x: any shape, in the compute dtype.

    Returns:
      ``gelu(x)``, in ``x``'s dtype.

    >>> import jax.numpy as jnp
    >>> from jaxamp import ops
    >>> ops.gelu(jnp.array([-1.0, 0.0, 1.0, 2.0], jnp.bfloat16))
    Array([-0.15918, 0, 0.839844, 1.95312], dtype=bfloat16)
    """
    return _gelu(jnp.asarray(x))


# --------------------------------------------------------------------------- bias


@jax.custom_vjp
def _bias_add(x, bias):
    return x + bias


def _bias_add_fwd(x, bias):
    return x + bias, _empty_like(bias)


def _bias_add_bwd(bias_like, g):
    lead = tuple(range(g.ndim - (bias_like.ndim - 1)))
    dbias = _f32(g).sum(lead).reshape(bias_like.shape[1:])
    return g, dbias.astype(bias_like.dtype)


_bias_add.defvjp(_bias_add_fwd, _bias_add_bwd)


def bias_add(x: ArrayLike, bias: ArrayLike) -> jax.Array:
    """``x + bias`` (``bias`` broadcast over ``x``'s leading axes), in ``x``'s dtype.

    The gradient of ``bias`` is summed over the batch in fp32 and returned in ``bias``' dtype;
    plain autodiff sums it in the compute dtype. Saved for backward: nothing (``x + bias`` is
    linear); only the shape and dtype of ``bias``, in a zero-byte array.

    Args:
      x: ``(..., *bias.shape)``.
      bias: of ``x``'s dtype (cast a param first: ``bias.astype(x.dtype)``).

    Returns:
      ``x + bias``, in ``x``'s dtype.

    Raises:
      TypeError: if ``x`` and ``bias`` have different dtypes.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from jaxamp import ops
    >>> x, b = jnp.ones((3, 2), jnp.bfloat16), jnp.array([0.5, -1.0], jnp.bfloat16)
    >>> ops.bias_add(x, b)
    Array([[1.5, 0],
           [1.5, 0],
           [1.5, 0]], dtype=bfloat16)
    >>> jax.grad(lambda b: ops.bias_add(x, b).astype(jnp.float32).sum())(b)
    Array([3, 3], dtype=bfloat16)
    """
    x, bias = jnp.asarray(x), jnp.asarray(bias)
    if x.dtype != bias.dtype:
        raise TypeError(f"bias_add: bias is {bias.dtype} but x is {x.dtype}; expected the same "
                        f"dtype. Cast the bias first: bias_add(x, bias.astype(x.dtype)).")
    return _bias_add(x, bias)


# --------------------------------------------------------------------------- loss, embedding


@jax.custom_vjp
def _softmax_cross_entropy(logits, labels):
    return _xent_fwd(logits, labels)[0]


def _xent_fwd(logits, labels):
    l32 = _f32(logits)
    lse = jax.nn.logsumexp(l32, axis=-1)
    picked = jnp.take_along_axis(l32, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return lse - picked, (logits, labels, lse)


def _xent_bwd(res, g):
    logits, labels, lse = _unshared(res)
    p = jnp.exp(_f32(logits) - lse[..., None])
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=_F32)
    return ((p - onehot) * _f32(g)[..., None]).astype(logits.dtype), None


_softmax_cross_entropy.defvjp(_xent_fwd, _xent_bwd)


def softmax_cross_entropy(logits: ArrayLike, labels: ArrayLike) -> jax.Array:
    """Per-example ``logsumexp(logits) - logits[label]``, in fp32, for logits of any float dtype.

    The loss comes back in fp32 (reduce it in fp32 too); the gradient of ``logits`` in their
    dtype. Saved for backward: the logits in their own (half) precision, the labels, and one
    fp32 log-sum-exp per example; the fp32 softmax is recomputed, not kept.

    Args:
      logits: ``(..., K)``.
      labels: ``(...)`` integer class indices in ``[0, K)``. Not differentiated.

    Returns:
      The loss per example, ``(...)``, fp32.

    >>> import jax.numpy as jnp
    >>> from jaxamp import ops
    >>> logits = jnp.array([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]], jnp.bfloat16)
    >>> ops.softmax_cross_entropy(logits, jnp.array([0, 2]))
    Array([0.23954487, 1.0986123 ], dtype=float32)
    """
    return _softmax_cross_entropy(jnp.asarray(logits), jnp.asarray(labels))


# The name of residuals that a recompute policy should keep (``jax.checkpoint_policies.
# save_only_these_names``; autocast's policy keeps them): the fused head's gradients, which
# three matmuls per chunk computed.
SAVED_NAME = "jaxamp_saved_residual"

# At most this many logits (rows x classes) of one chunk at a time: 256 MB in fp32.
_CHUNK_LOGITS = 2**26


def _chunk_rows(rows: int, classes: int) -> int:
    """Rows per chunk: at most ``_CHUNK_LOGITS`` logits, the chunks as even as can be (the last
    one is padded, and padding is work)."""
    limit = max(1, _CHUNK_LOGITS // max(classes, 1))
    n = -(-rows // limit)  # rows >= 1: n >= 1
    return -(-rows // n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _linear_xent(x, w, bias, labels, weights, chunk):
    return _linear_xent_fwd(x, w, bias, labels, weights, chunk)[0]


def _linear_xent_fwd(x, w, bias, labels, weights, chunk):
    """One pass over the rows, ``chunk`` at a time: each chunk's logits, its loss and argmax,
    and right away its gradients (``dlogits`` is ``softmax - onehot`` times the row's weight
    over the total, the loss being their weighted mean), so that no chunk is computed twice.
    The gradients wait, unscaled, for the loss's cotangent."""
    rows, classes = x.shape[0], w.shape[0]
    n = -(-rows // chunk)
    pad = n * chunk - rows
    total = jnp.maximum(_f32(weights).sum(), 1.0)

    def chunks(a):
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(n, chunk, *a.shape[1:])

    def one(carry, xs):
        dw, dbias, loss = carry
        xc, lc, wc = xs
        logits = jax.lax.dot_general(xc, w, (((1,), (1,)), ((), ())),
                                     preferred_element_type=_F32)
        if bias is not None:
            logits = logits + _f32(bias)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, lc[:, None], axis=-1)[:, 0]
        loss = loss + (_f32(wc) * (lse - picked)).sum()
        probs = jnp.exp(logits - lse[:, None])
        dlogits = (probs - jax.nn.one_hot(lc, classes, dtype=_F32)) * (_f32(wc) / total)[:, None]
        g = dlogits.astype(x.dtype)
        dx = jax.lax.dot_general(g, w, (((1,), (0,)), ((), ())), preferred_element_type=_F32)
        dw = dw + jax.lax.dot_general(g, xc, (((0,), (0,)), ((), ())),
                                      preferred_element_type=_F32)
        if bias is not None:
            dbias = dbias + dlogits.sum(0)
        return (dw, dbias, loss), (dx.astype(x.dtype), jnp.argmax(logits, -1).astype(jnp.int32))
    # Under shard_map the body's outputs vary over the manual axes its inputs vary over, and a
    # scan's carry must match.
    init = _with_axes_of((jnp.zeros(w.shape, _F32),
                          None if bias is None else jnp.zeros(bias.shape, _F32),
                          jnp.zeros((), _F32)), x, w, labels, weights)
    (dw, dbias, loss), (dx, predicted) = jax.lax.scan(
        one, init, (chunks(x), chunks(labels.astype(jnp.int32)), chunks(weights)))
    dx, predicted = dx.reshape(-1, x.shape[1])[:rows], predicted.reshape(-1)[:rows]
    grads = (dx, dw.astype(w.dtype), None if bias is None else dbias.astype(bias.dtype))
    return (loss / total, predicted), checkpoint_name(grads, SAVED_NAME)


def _with_axes_of(values, *sources):
    """``values`` plus a zero computed from ``sources``: under ``shard_map`` they then vary
    over every manual axis the sources vary over (elsewhere XLA folds the zero away)."""
    zero = jax.lax.stop_gradient(
        jnp.where(False, sum(_f32(a.reshape(-1)[:1]).sum() for a in sources), 0.0))
    return jax.tree.map(lambda v: v + zero.astype(v.dtype), values)


def _linear_xent_bwd(chunk, res, cts):
    """The forward pass's gradients (of x, w and the bias, or None), scaled by the loss's
    cotangent; the labels and weights get none."""
    del chunk
    g = _f32(cts[0])
    dx, dw, dbias = jax.tree.map(lambda d: (g * _f32(d)).astype(d.dtype), res)
    return dx, dw, dbias, None, None


_linear_xent.defvjp(_linear_xent_fwd, _linear_xent_bwd)


def linear_softmax_cross_entropy(x: ArrayLike, w: ArrayLike, labels: ArrayLike, *,
                                 bias: ArrayLike | None = None,
                                 weights: ArrayLike | None = None,
                                 chunk_rows: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The cross-entropy of the logits ``x @ w.T + bias``, their weighted mean over the rows,
    without the logits: a fused output projection and loss for a large vocabulary.

    The rows go through in chunks of at most 2**26 logits, as even as can be (BERT-Large's
    32768 rows of a 30522-word vocabulary: 15 chunks of 2185). Each chunk's logits are
    computed in ``x``'s dtype with fp32 accumulation, its log-softmax in fp32, and its
    gradients right away, in the forward pass: the gradient of the mean loss is
    ``softmax - onehot`` per row, scaled by the row's weight, so nothing waits for the
    backward pass but the gradients themselves, scaled there by the loss's cotangent. Saved
    for backward: the gradients of ``x`` (``x``'s shape and
    dtype), of ``w`` and of ``bias``; not the ``(rows, classes)`` logits and their gradient,
    which a plain head keeps (4 GB in BERT-Large's step at 64 x 512). The matmuls are the
    plain head's, none twice.

    Args:
      x: ``(rows, features)``, the hidden states (in the compute dtype).
      w: ``(classes, features)``, the output projection (a tied embedding table), of ``x``'s
        dtype.
      labels: ``(rows,)`` integer classes in ``[0, classes)``. Not differentiated.
      bias: ``(classes,)``, optional.
      weights: ``(rows,)`` per-row weights (a mask); the loss is ``sum(weights * loss) /
        max(sum(weights), 1)``. Default: the plain mean. Not differentiated.
      chunk_rows: rows per chunk; default: at most 2**26 logits per chunk.

    Returns:
      ``(loss, predicted)``: the weighted mean loss, fp32, and each row's argmax class
      (int32, for an accuracy).

    >>> import jax, jax.numpy as jnp
    >>> from jaxamp import ops
    >>> x = jax.random.normal(jax.random.key(0), (6, 4))
    >>> w = jax.random.normal(jax.random.key(1), (5, 4))
    >>> labels = jnp.array([0, 1, 2, 3, 4, 0])
    >>> loss, predicted = ops.linear_softmax_cross_entropy(x, w, labels, chunk_rows=4)
    >>> plain = ops.softmax_cross_entropy(x @ w.T, labels).mean()
    >>> bool(jnp.allclose(loss, plain)), bool((predicted == (x @ w.T).argmax(-1)).all())
    (True, True)
    """
    x, w, labels = jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear_softmax_cross_entropy: x must be (rows, features) and w "
                         f"(classes, features); got {x.shape} and {w.shape}")
    if x.shape[0] < 1:
        raise ValueError("linear_softmax_cross_entropy: x has no rows")
    if labels.shape != x.shape[:1]:
        raise ValueError(f"linear_softmax_cross_entropy: labels must be ({x.shape[0]},), one "
                         f"class per row; got {labels.shape}")
    if w.dtype != x.dtype:
        raise TypeError(f"linear_softmax_cross_entropy: w is {w.dtype} but x is {x.dtype}; "
                        f"cast the param first: w.astype(x.dtype)")
    weights = jnp.ones(x.shape[:1], _F32) if weights is None else jnp.asarray(weights)
    if weights.shape != x.shape[:1]:
        raise ValueError(f"linear_softmax_cross_entropy: weights must be ({x.shape[0]},); got "
                         f"{weights.shape}")
    chunk = _chunk_rows(x.shape[0], w.shape[0]) if chunk_rows is None else int(chunk_rows)
    if chunk < 1:
        raise ValueError(f"linear_softmax_cross_entropy: chunk_rows must be >= 1, got {chunk}")
    bias = None if bias is None else jnp.asarray(bias)
    # The params vary with the rows inside shard_map, as a plain head's matmul makes them
    # (their gradient is then summed over the rows' axis, as autodiff sums it there).
    w, bias = _with_axes_of((w, bias), x, labels, weights)
    return _linear_xent(x, w, bias, labels, weights, chunk)


@jax.custom_vjp
def _embed_lookup(table, ids):
    return table[ids]


def _embed_fwd(table, ids):
    return table[ids], (_empty_like(table), ids)


def _embed_bwd(res, g):
    table_like, ids = res
    d = jnp.zeros(table_like.shape[1:], _F32).at[ids].add(_f32(g))
    return d.astype(table_like.dtype), None


_embed_lookup.defvjp(_embed_fwd, _embed_bwd)


def embed_lookup(table: ArrayLike, ids: ArrayLike) -> jax.Array:
    """``table[ids]``, the rows of an embedding table, in ``table``'s dtype.

    The gradient of ``table`` is accumulated in fp32 and returned in ``table``'s dtype: with a
    half-precision working table, plain autodiff scatter-adds the gradient rows of repeated ids
    in half precision. Saved for backward: the ids alone (the table's shape and dtype travel in
    a zero-byte array).

    Args:
      table: ``(V, D)``, in the compute dtype.
      ids: integer array of indices in ``[0, V)``. Not differentiated.

    Returns:
      ``table[ids]``, ``(*ids.shape, D)``.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from jaxamp import ops
    >>> table = jnp.arange(6.0).reshape(3, 2).astype(jnp.bfloat16)
    >>> ids = jnp.array([2, 0, 2])
    >>> ops.embed_lookup(table, ids)
    Array([[4, 5],
           [0, 1],
           [4, 5]], dtype=bfloat16)
    >>> jax.grad(lambda t: ops.embed_lookup(t, ids).astype(jnp.float32).sum())(table)
    Array([[1, 1],
           [0, 0],
           [2, 2]], dtype=bfloat16)
    """
    return _embed_lookup(jnp.asarray(table), jnp.asarray(ids))
