"""Transformers in Flax NNX: a BERT-style encoder with an MLM head and a GPT-style decoder.

Every matmul runs in the compute dtype ``dtype`` with fp32 params. LayerNorm statistics, the
attention softmax, GELU and the logits' loss run in fp32, and each fp32 result is cast back to
``dtype`` before the next matmul, so no matmul is promoted to fp32 (see
``train/models/linen_encoder.py`` for what happens otherwise). The models return fp32 logits;
``logits_dtype=None`` keeps them in the compute dtype, which is what the losses use: the
cross-entropy upcasts them inside and saves the half-precision logits for the backward pass
instead of an fp32 copy (the (B, L, vocab) logits are a large activation). GELU is the tanh
approximation.

* :class:`BertMLM`: post-LN encoder (Devlin et al., 2019) with learned position and segment
  embeddings, an embedding LayerNorm, and the masked-LM head (dense, GELU, LayerNorm, then the
  tied word embeddings plus a bias).
* :class:`GPT`: pre-LN causal decoder (GPT-2) with learned positions, a final LayerNorm and the
  tied word embeddings as output projection. Byte-level (vocabulary 256) by default.

``fp8=jaxamp.fp8.DelayedScaling(...)`` runs every matmul (the projections, the two attention
matmuls, the tied output projection) in FP8 with delayed scaling, each with its own
``jaxamp.fp8.Fp8Meta`` (in the model state of ``train.models.split``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxamp import fp8 as fp8_lib
from jaxamp.ops import attention_softmax
from jaxamp.ops import bias_add
from jaxamp.ops import gelu
from jaxamp.ops import linear_softmax_cross_entropy
from jaxamp.ops import softmax_cross_entropy
from train.models.layers import F32
from train.models.layers import Dense
from train.models.layers import Embed
from train.models.layers import LayerNorm
from train.models.layers import weighted_mean

ATTENTION = ("auto", "explicit", "cudnn")
# What ``attention="cudnn"`` asks of ``jax.nn.dot_product_attention`` (the tests check the
# call's layout and masks on a CPU by asking for "xla", which computes the same function).
FUSED_IMPLEMENTATION = "cudnn"


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The shape of an encoder or decoder.

    Attributes:
      vocab: vocabulary size (256 for byte-level text).
      width: model width (hidden size).
      depth: number of blocks.
      heads: attention heads; ``width`` must be a multiple.
      mlp: hidden size of the feed-forward block.
      max_len: longest sequence (learned position embeddings).
      type_vocab: segment types (2 for BERT; 0: no segment embeddings).
      epsilon: LayerNorm epsilon.
      attention: how the attention softmax and its two matmuls run. ``"explicit"``: two
        einsums around ``jaxamp.ops.attention_softmax`` (fp32 softmax, the half-precision
        probabilities kept for the backward pass). ``"cudnn"``: cuDNN's fused flash attention
        through ``jax.nn.dot_product_attention(implementation="cudnn")``, which keeps no
        probabilities (only the output and fp32 row statistics); it compiles only for a GPU,
        and layers in fp32 or FP8 run the explicit path (cuDNN's fused kernel takes fp16 or
        bf16). ``"auto"``: ``"cudnn"`` when JAX's default backend is a GPU, else
        ``"explicit"``.
      fused_loss: the losses' output projection and cross-entropy in one chunked op
        (``jaxamp.ops.linear_softmax_cross_entropy``), which never holds the ``(batch, length,
        vocab)`` logits or their gradient; ``False``: the logits, then the cross-entropy. FP8
        models keep the logits (their projection is an FP8 matmul): an FP8 recipe's layers, and
        ``train.models.build`` under an FP8 policy, where autocast makes every matmul FP8.
    """

    vocab: int = 256
    width: int = 768
    depth: int = 12
    heads: int = 12
    mlp: int = 3072
    max_len: int = 512
    type_vocab: int = 0
    epsilon: float = 1e-5
    attention: str = "auto"
    fused_loss: bool = True

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not a multiple of heads {self.heads}")
        for field in ("vocab", "width", "depth", "heads", "mlp", "max_len"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")


BERT_CONFIGS = {
    # BERT-Tiny's shape (Turc et al., 2019) with a byte vocabulary.
    "bert_tiny": TransformerConfig(vocab=256, width=128, depth=2, heads=2, mlp=512,
                                   max_len=128, type_vocab=2, epsilon=1e-12),
    "bert_base": TransformerConfig(vocab=30522, width=768, depth=12, heads=12, mlp=3072,
                                   max_len=512, type_vocab=2, epsilon=1e-12),
    "bert_large": TransformerConfig(vocab=30522, width=1024, depth=24, heads=16, mlp=4096,
                                    max_len=512, type_vocab=2, epsilon=1e-12),
}

GPT_CONFIGS = {
    "gpt_tiny": TransformerConfig(vocab=256, width=64, depth=2, heads=2, mlp=256, max_len=128),
    "gpt_small": TransformerConfig(vocab=256, width=768, depth=12, heads=12, mlp=3072,
                                   max_len=1024),
}


def _linear(n_in: int, n_out: int, *, dtype: Any, rngs: nnx.Rngs, stddev: float = 0.02,
            fp8: fp8_lib.DelayedScaling | None = None) -> Dense:
    return Dense(n_in, n_out, dtype=dtype, kernel_init=jax.nn.initializers.normal(stddev),
                 fp8=fp8, rngs=rngs)


def causal_mask(length: int) -> jax.Array:
    """``(L, L)`` bool: position ``i`` attends to positions ``<= i``."""
    return jnp.tril(jnp.ones((length, length), jnp.bool_))


def fused_attention(attention: str, dtype: Any, fp8: fp8_lib.DelayedScaling | None,
                    head_size: int) -> bool:
    """Whether ``TransformerConfig.attention`` runs cuDNN's fused kernel for layers computing
    in ``dtype``: fp16 and bf16 only, and not under FP8's delayed scaling (whose two
    attention matmuls carry their own metadata). ``"auto"`` also wants a head size that every
    GPU's kernel takes (a multiple of 8, at most 128); an explicit ``"cudnn"`` leaves that
    check to JAX, which allows 256 on Hopper."""
    if attention == "auto":
        on_gpu = jax.default_backend() == "gpu"
        attention = "cudnn" if on_gpu and head_size % 8 == 0 and head_size <= 128 else "explicit"
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return attention == "cudnn" and half and fp8 is None


class SelfAttention(nnx.Module):
    """Multi-head self-attention with a fused QKV projection; ``causal``: position ``i``
    attends to positions ``<= i``."""

    def __init__(self, width: int, heads: int, *, dtype: Any, rngs: nnx.Rngs,
                 out_stddev: float = 0.02, fp8: fp8_lib.DelayedScaling | None = None,
                 causal: bool = False, attention: str = "explicit"):
        self.heads = heads
        self.causal = causal
        self.qkv = _linear(width, 3 * width, dtype=dtype, rngs=rngs, fp8=fp8)
        self.out = _linear(width, width, dtype=dtype, rngs=rngs, stddev=out_stddev, fp8=fp8)
        self.fused = fused_attention(attention, dtype, fp8, width // heads)
        # The two activation-by-activation matmuls, each with its own FP8 metadata.
        self.scores = None if fp8 is None else fp8_lib.EinsumOp(fp8)
        self.mix = None if fp8 is None else fp8_lib.EinsumOp(fp8)

    def __call__(self, x_BxLxD: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """``mask``: True where a position may attend, broadcastable to ``(B, H, L, L)``."""
        B, L, D = x_BxLxD.shape
        H = self.heads
        q, k, v = (t.reshape(B, L, H, D // H) for t in jnp.split(self.qkv(x_BxLxD), 3, -1))
        if self.fused:
            att_BxLxHxK = jax.nn.dot_product_attention(
                q, k, v, mask=None if mask is None else jnp.broadcast_to(mask, (B, H, L, L)),
                is_causal=self.causal, implementation=FUSED_IMPLEMENTATION)
            return self.out(att_BxLxHxK.reshape(B, L, D))
        if self.causal:
            mask = causal_mask(L) if mask is None else mask & causal_mask(L)
        scores_BxHxLxL = (self.scores or jnp.einsum)("blhd,bmhd->bhlm", q, k)
        # fp32 softmax; the probabilities come back in the compute dtype for the value matmul.
        probs_BxHxLxL = attention_softmax(scores_BxHxLxL, mask, scale=1.0 / math.sqrt(D // H))
        att_BxLxD = (self.mix or jnp.einsum)("bhlm,bmhd->blhd", probs_BxHxLxL, v).reshape(B, L, D)
        return self.out(att_BxLxD)


class Block(nnx.Module):
    """Attention and feed-forward sublayers with residuals: pre-LN (GPT) or post-LN (BERT)."""

    def __init__(self, config: TransformerConfig, *, pre_norm: bool, dtype: Any,
                 rngs: nnx.Rngs, out_stddev: float = 0.02,
                 fp8: fp8_lib.DelayedScaling | None = None, causal: bool = False):
        c = config
        self.pre_norm = pre_norm
        self.attention = SelfAttention(c.width, c.heads, dtype=dtype, rngs=rngs,
                                       out_stddev=out_stddev, fp8=fp8, causal=causal,
                                       attention=c.attention)
        self.norm1 = LayerNorm(c.width, dtype=dtype, epsilon=c.epsilon)
        self.mlp_in = _linear(c.width, c.mlp, dtype=dtype, rngs=rngs, fp8=fp8)
        self.mlp_out = _linear(c.mlp, c.width, dtype=dtype, rngs=rngs, stddev=out_stddev,
                               fp8=fp8)
        self.norm2 = LayerNorm(c.width, dtype=dtype, epsilon=c.epsilon)

    def _mlp(self, x: jax.Array) -> jax.Array:
        return self.mlp_out(gelu(self.mlp_in(x)))

    def __call__(self, x_BxLxD: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        x = x_BxLxD
        if self.pre_norm:
            x = x + self.attention(self.norm1(x), mask)
            return x + self._mlp(self.norm2(x))
        x = self.norm1(x + self.attention(x, mask))
        return self.norm2(x + self._mlp(x))


def _head_loss(model: BertMLM | GPT, h_BxLxD: jax.Array, targets_BxL: jax.Array,
               mask_BxL: jax.Array | None, bias_V: jax.Array | None
               ) -> tuple[jax.Array, jax.Array]:
    """The tied projection of ``h_BxLxD`` and its cross-entropy: fused
    (``linear_softmax_cross_entropy``) unless the config says not or the projection is FP8."""
    embed = model.token_embed
    if model.config.fused_loss and embed.dot is None:
        B, L, D = h_BxLxD.shape
        loss, predicted = linear_softmax_cross_entropy(
            h_BxLxD.reshape(B * L, D), embed.embedding[...].astype(model.dtype),
            targets_BxL.reshape(B * L), bias=bias_V,
            weights=None if mask_BxL is None else mask_BxL.reshape(B * L))
        return loss, predicted.reshape(B, L)
    logits_BxLxV = embed.attend(h_BxLxD)
    if bias_V is not None:
        logits_BxLxV = bias_add(logits_BxLxV, bias_V)
    loss = weighted_mean(softmax_cross_entropy(logits_BxLxV, targets_BxL), mask_BxL)
    return loss, logits_BxLxV.argmax(-1)


def _check_tokens(tokens_BxL: jax.Array, max_len: int) -> None:
    if tokens_BxL.ndim != 2:
        raise ValueError(f"tokens must have shape (batch, length), got {tokens_BxL.shape}")
    if tokens_BxL.shape[1] > max_len:
        raise ValueError(f"sequence length {tokens_BxL.shape[1]} exceeds max_len {max_len}; "
                         "build the model with a larger max_len")


class BertMLM(nnx.Module):
    """BERT encoder with the masked-LM head.

    ``model(tokens_BxL, segments=None)`` returns fp32 logits ``(B, L, vocab)`` at every
    position; the loss picks the masked ones.
    """

    def __init__(self, config: TransformerConfig, *, dtype: Any = F32,
                 fp8: fp8_lib.DelayedScaling | None = None, rngs: nnx.Rngs):
        c = config
        self.config = config
        self.dtype = dtype
        self.token_embed = Embed(c.vocab, c.width, dtype=dtype, fp8=fp8, rngs=rngs)
        self.position_embed = Embed(c.max_len, c.width, dtype=dtype, rngs=rngs)
        self.type_embed = (Embed(c.type_vocab, c.width, dtype=dtype, rngs=rngs)
                           if c.type_vocab else None)
        self.embed_norm = LayerNorm(c.width, dtype=dtype, epsilon=c.epsilon)
        self.layers = nnx.List([Block(c, pre_norm=False, dtype=dtype, rngs=rngs, fp8=fp8)
                                for _ in range(c.depth)])
        self.mlm_dense = _linear(c.width, c.width, dtype=dtype, rngs=rngs, fp8=fp8)
        self.mlm_norm = LayerNorm(c.width, dtype=dtype, epsilon=c.epsilon)
        self.mlm_bias = nnx.Param(jnp.zeros((c.vocab,), F32))

    def __call__(self, tokens_BxL: jax.Array, segments_BxL: jax.Array | None = None, *,
                 logits_dtype: Any = F32) -> jax.Array:
        """Logits in ``logits_dtype`` (fp32; ``None`` keeps the compute dtype)."""
        h = self.hidden(tokens_BxL, segments_BxL)
        logits_BxLxV = bias_add(self.token_embed.attend(h), self.mlm_bias[...].astype(self.dtype))
        return logits_BxLxV if logits_dtype is None else logits_BxLxV.astype(logits_dtype)

    def loss(self, tokens_BxL: jax.Array, targets_BxL: jax.Array,
             mask_BxL: jax.Array | None = None, segments_BxL: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array]:
        """``(mean cross-entropy over the positions weighted by mask_BxL, predicted tokens)``,
        through the fused head where the config asks for it (see :func:`_head_loss`)."""
        return _head_loss(self, self.hidden(tokens_BxL, segments_BxL), targets_BxL, mask_BxL,
                          self.mlm_bias[...].astype(self.dtype))

    def hidden(self, tokens_BxL: jax.Array, segments_BxL: jax.Array | None = None) -> jax.Array:
        """What the tied output projection reads: the MLM head's normalized features."""
        _check_tokens(tokens_BxL, self.config.max_len)
        L = tokens_BxL.shape[1]
        x = bias_add(self.token_embed(tokens_BxL),
                     self.position_embed.embedding[...][:L].astype(self.dtype))
        if self.type_embed is not None:
            if segments_BxL is None:
                segments_BxL = jnp.zeros_like(tokens_BxL)
            x = x + self.type_embed(segments_BxL)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x)
        return self.mlm_norm(gelu(self.mlm_dense(x)))


class GPT(nnx.Module):
    """GPT-2-style causal decoder.

    ``model(tokens_BxL)`` returns fp32 next-token logits ``(B, L, vocab)``: position ``i``
    sees tokens ``0..i``.
    """

    def __init__(self, config: TransformerConfig, *, dtype: Any = F32,
                 fp8: fp8_lib.DelayedScaling | None = None, rngs: nnx.Rngs):
        c = config
        self.config = config
        self.dtype = dtype
        # GPT-2 scales the init of the projections that write to the residual stream.
        out_stddev = 0.02 / math.sqrt(2 * c.depth)
        self.token_embed = Embed(c.vocab, c.width, dtype=dtype, fp8=fp8, rngs=rngs)
        self.position_embed = Embed(c.max_len, c.width, dtype=dtype, stddev=0.01, rngs=rngs)
        self.layers = nnx.List([Block(c, pre_norm=True, dtype=dtype, rngs=rngs,
                                      out_stddev=out_stddev, fp8=fp8, causal=True)
                                for _ in range(c.depth)])
        self.final_norm = LayerNorm(c.width, dtype=dtype, epsilon=c.epsilon)

    def __call__(self, tokens_BxL: jax.Array, *, logits_dtype: Any = F32) -> jax.Array:
        """Logits in ``logits_dtype`` (fp32; ``None`` keeps the compute dtype)."""
        logits_BxLxV = self.token_embed.attend(self.hidden(tokens_BxL))
        return logits_BxLxV if logits_dtype is None else logits_BxLxV.astype(logits_dtype)

    def loss(self, tokens_BxL: jax.Array, targets_BxL: jax.Array,
             mask_BxL: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """``(mean next-token cross-entropy over the positions weighted by mask_BxL, predicted
        tokens)``, through the fused head where the config asks for it."""
        return _head_loss(self, self.hidden(tokens_BxL), targets_BxL, mask_BxL, None)

    def hidden(self, tokens_BxL: jax.Array) -> jax.Array:
        """What the tied output projection reads: the final LayerNorm's output."""
        _check_tokens(tokens_BxL, self.config.max_len)
        L = tokens_BxL.shape[1]
        x = bias_add(self.token_embed(tokens_BxL),
                     self.position_embed.embedding[...][:L].astype(self.dtype))
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x)
