"""A standard Flax Linen Transformer encoder, for the precision audit (the promotion trap).

``Encoder(dtype=..., norm_dtype=...)``: the Dense and attention layers compute in ``dtype``
and the LayerNorms in ``norm_dtype``. The common recipe, LayerNorms in fp32 with params cast by
jmp's ``cast_to_compute``, silently runs every matmul in fp32: each fp32 LayerNorm output
promotes the next Dense back to fp32. ``jaxamp.audit`` shows it.

    python -m train.models.linen_encoder     # prints the audits of the three variants
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp


class Block(nn.Module):
    width: int
    heads: int
    mlp: int
    dtype: Any = None
    norm_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(dtype=self.norm_dtype, name="norm1")(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype,
                                            name="attention")(h, h)
        x = x + h
        h = nn.LayerNorm(dtype=self.norm_dtype, name="norm2")(x)
        h = nn.Dense(self.mlp, dtype=self.dtype, name="mlp_in")(h)
        h = nn.Dense(self.width, dtype=self.dtype, name="mlp_out")(nn.gelu(h))
        return x + h


class Encoder(nn.Module):
    vocab: int = 8192
    width: int = 256
    depth: int = 4
    heads: int = 4
    mlp: int = 1024
    dtype: Any = None
    norm_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens_BxL):
        x = nn.Embed(self.vocab, self.width, dtype=self.dtype, name="embed")(tokens_BxL)
        for i in range(self.depth):
            x = Block(self.width, self.heads, self.mlp, self.dtype, self.norm_dtype,
                      name=f"layer{i}")(x)
        x = nn.LayerNorm(dtype=self.norm_dtype, name="final_norm")(x)
        return nn.Dense(self.vocab, dtype=self.dtype, name="head")(x)


def variants(vocab=8192, width=256, depth=4, heads=4, mlp=1024, batch=16, seq_len=128):
    """The three encoders of the audit table: ``(name, loss(params, tokens), params, tokens)``."""
    tokens = jax.random.randint(jax.random.key(1), (batch, seq_len), 0, vocab)
    dims = dict(vocab=vocab, width=width, depth=depth, heads=heads, mlp=mlp)
    fp32 = Encoder(**dims)
    params = fp32.init(jax.random.key(0), tokens[:1])
    jmp_policy = jmp.get_policy("p=f32,c=bf16,o=f32")
    bf16 = Encoder(**dims, dtype=jnp.bfloat16, norm_dtype=jnp.bfloat16)

    def xent(logits, tokens):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1))

    def loss_fp32(p, t):
        return xent(fp32.apply(p, t), t)

    def loss_jmp(p, t):  # jmp's recipe: cast the params, keep LayerNorm(dtype=float32)
        return xent(fp32.apply(jmp_policy.cast_to_compute(p), t), t)

    def loss_bf16(p, t):  # layers built with dtype=bfloat16 (fp32 statistics inside LayerNorm)
        return xent(bf16.apply(p, t), t)

    return [("fp32", loss_fp32, params, tokens), ("jmp recipe", loss_jmp, params, tokens),
            ("dtype=bfloat16", loss_bf16, params, tokens)]


def main():
    import jaxamp
    rows = []
    for name, loss, params, tokens in variants():
        report = jaxamp.audit_grad(loss, params, tokens)
        print(f"===== {name}\n{report}\n")
        rows.append((name, report))
    fp32_saved = rows[0][1].saved_bytes
    print("| encoder (4x256, batch 16x128) | matmul GFLOP (fwd+bwd) | fp32 share | bf16 share | "
          "fp32 matmul sites | saved activations MB | vs fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r.total_matmul_flops / 1e9:.2f} | {100 * r.fp32_matmul_share:.1f}% | "
              f"{100 * r.share('bfloat16'):.1f}% | {len(r.fp32_matmuls)} | "
              f"{r.saved_bytes / 1e6:.1f} | {r.saved_bytes / fp32_saved:.2f}x |")


if __name__ == "__main__":
    main()
