"""A small BERT-style encoder written with plain jax.numpy, used by the demo and benchmarks.

The params are a dict of fp32 arrays; the forward runs in the dtype of the params it is given
(the working params of a policy). Normalization statistics, the attention softmax and the loss
run in fp32, and every fp32 result is cast back to the compute dtype before the next matmul,
so no matmul is promoted to fp32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    vocab: int = 8192
    width: int = 256
    depth: int = 4
    heads: int = 4
    mlp: int = 1024
    seq_len: int = 128


def init_params(key: jax.Array, cfg: EncoderConfig) -> dict:
    keys = iter(jax.random.split(key, 4 + 6 * cfg.depth))

    def dense(n_in, n_out):
        return jax.random.normal(next(keys), (n_in, n_out), jnp.float32) * (n_in ** -0.5)

    params = {
        "embed": jax.random.normal(next(keys), (cfg.vocab, cfg.width), jnp.float32) * 0.02,
        "pos": jax.random.normal(next(keys), (cfg.seq_len, cfg.width), jnp.float32) * 0.02,
        "final_norm": {"scale": jnp.ones(cfg.width), "bias": jnp.zeros(cfg.width)},
        "head": {"kernel": dense(cfg.width, cfg.vocab), "bias": jnp.zeros(cfg.vocab)},
        "layers": [],
    }
    for _ in range(cfg.depth):
        params["layers"].append({
            "norm1": {"scale": jnp.ones(cfg.width), "bias": jnp.zeros(cfg.width)},
            "qkv": {"kernel": dense(cfg.width, 3 * cfg.width), "bias": jnp.zeros(3 * cfg.width)},
            "out": {"kernel": dense(cfg.width, cfg.width), "bias": jnp.zeros(cfg.width)},
            "norm2": {"scale": jnp.ones(cfg.width), "bias": jnp.zeros(cfg.width)},
            "mlp_in": {"kernel": dense(cfg.width, cfg.mlp), "bias": jnp.zeros(cfg.mlp)},
            "mlp_out": {"kernel": dense(cfg.mlp, cfg.width), "bias": jnp.zeros(cfg.width)},
        })
    return params


def layer_norm(x_BxLxD, p, eps=1e-6):
    dtype = x_BxLxD.dtype
    x = x_BxLxD.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(dtype)


def _dense(x, p):
    return x @ p["kernel"] + p["bias"]


def forward(params, tokens_BxL, cfg: EncoderConfig):
    """Returns fp32 logits ``(B, L, vocab)``."""
    dtype = params["embed"].dtype
    B, L = tokens_BxL.shape
    H = cfg.heads
    x = params["embed"][tokens_BxL] + params["pos"][:L]
    for lp in params["layers"]:
        h = layer_norm(x, lp["norm1"])
        q, k, v = jnp.split(_dense(h, lp["qkv"]), 3, axis=-1)
        q, k, v = (t.reshape(B, L, H, -1) for t in (q, k, v))
        logits_BxHxLxL = jnp.einsum("blhd,bmhd->bhlm", q, k) * (q.shape[-1] ** -0.5)
        probs = jax.nn.softmax(logits_BxHxLxL.astype(jnp.float32), axis=-1).astype(dtype)
        att = jnp.einsum("bhlm,bmhd->blhd", probs, v).reshape(B, L, -1)
        x = x + _dense(att, lp["out"])
        h = layer_norm(x, lp["norm2"])
        x = x + _dense(jax.nn.gelu(_dense(h, lp["mlp_in"])), lp["mlp_out"])
    x = layer_norm(x, params["final_norm"])
    return _dense(x, params["head"]).astype(jnp.float32)


def loss_fn(params, batch, cfg: EncoderConfig):
    """Mean token cross-entropy, in fp32."""
    logits = forward(params, batch["tokens"], cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return nll.mean()


def synthetic_batch(key, batch_size: int, cfg: EncoderConfig) -> dict:
    k1, k2 = jax.random.split(key)
    shape = (batch_size, cfg.seq_len)
    return {"tokens": jax.random.randint(k1, shape, 0, cfg.vocab, jnp.int32),
            "targets": jax.random.randint(k2, shape, 0, cfg.vocab, jnp.int32)}
