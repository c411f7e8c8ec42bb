"""A small GPT written as a user writes it: flax NNX's layers with their defaults.

``nnx.Embed`` (tokens and learned positions), ``nnx.MultiHeadAttention`` with
``nnx.make_causal_mask``, ``nnx.LayerNorm`` and ``nnx.Linear``: fp32 params and no ``dtype=``
anywhere. Casting its params to bf16 does not make it
compute in bf16 (the causal mask and the norms promote the matmuls back to fp32);
``jaxamp.autocast`` does. Used by the autocast tests and ``python -m benchmarks autocast``.
``dtype=jnp.bfloat16`` passes ``dtype=`` to every layer: the same model with hand-written mixed
precision, what ``python -m benchmarks compile_time`` compares autocast's step with.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class Block(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs, dtype: Any = None):
        self.ln1 = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=width, decode=False,
                                           dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
        self.fc1 = nnx.Linear(width, 4 * width, dtype=dtype, rngs=rngs)
        self.fc2 = nnx.Linear(4 * width, width, dtype=dtype, rngs=rngs)

    def __call__(self, x_BxLxD, mask):
        x_BxLxD = x_BxLxD + self.attn(self.ln1(x_BxLxD), mask=mask)
        return x_BxLxD + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x_BxLxD))))


class GPT(nnx.Module):
    def __init__(self, vocab: int = 256, width: int = 64, depth: int = 2, heads: int = 4,
                 max_len: int = 512, *, rngs: nnx.Rngs, dtype: Any = None):
        self.embed = nnx.Embed(vocab, width, dtype=dtype, rngs=rngs)
        self.positions = nnx.Embed(max_len, width, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(width, heads, rngs, dtype) for _ in range(depth)])
        self.ln = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(width, vocab, dtype=dtype, rngs=rngs)

    def __call__(self, tokens_BxL):
        x_BxLxD = self.embed(tokens_BxL) + self.positions(jnp.arange(tokens_BxL.shape[1]))
        mask = nnx.make_causal_mask(tokens_BxL)
        for block in self.blocks:
            x_BxLxD = block(x_BxLxD, mask)
        return self.head(self.ln(x_BxLxD))


def loss_and_params(vocab: int = 256, width: int = 64, depth: int = 2, heads: int = 4,
                    max_len: int = 512, seed: int = 0, dtype: Any = None):
    """``(loss_fn(params, batch), fp32 params)``: next-token cross-entropy in fp32 on
    ``batch["tokens"]`` (``[B, L + 1]`` int32); ``dtype``: every layer's compute dtype."""
    graphdef, params = nnx.split(GPT(vocab, width, depth, heads, max_len, rngs=nnx.Rngs(seed),
                                     dtype=dtype), nnx.Param)

    def loss_fn(params, batch):
        logits_BxLxV = nnx.merge(graphdef, params)(batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits_BxLxV.astype(jnp.float32), batch["tokens"][:, 1:]).mean()
    return loss_fn, params
