"""Third-party model packages as they ship, at tiny sizes: each builder returns
``(loss_fn(params, batch), fp32 params, batch)`` for next-token prediction on real text (the
bytes of Python's own reference documentation, ``pydoc_data.topics``)."""

from pydoc_data import topics

import jax
import jax.numpy as jnp
import numpy as np
import optax

VOCAB, BATCH, LENGTH = 256, 8, 32


def text_batch(seed: int = 0) -> dict:
    """``BATCH`` windows of ``LENGTH + 1`` bytes of the documentation, as token ids."""
    data = np.frombuffer("".join(topics.topics.values()).encode(), np.uint8)
    starts = np.random.default_rng(seed).integers(0, len(data) - LENGTH - 1, BATCH)
    return {"tokens": jnp.asarray(np.stack([data[s:s + LENGTH + 1] for s in starts]), jnp.int32)}


def _next_token_loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), tokens[:, 1:]).mean()


def griffin():
    """Google DeepMind's ``recurrentgemma`` (Griffin, Linen): RG-LRU blocks with their scan
    and ``custom_vjp``, local attention, and the package's default gradient checkpointing of
    every residual block (``nn.remat``)."""
    from recurrentgemma import common
    from recurrentgemma.jax import griffin as rg

    config = common.GriffinConfig(
        vocab_size=VOCAB, width=64, mlp_expanded_width=192, num_heads=2,
        block_types=(common.TemporalBlockType.RECURRENT, common.TemporalBlockType.RECURRENT,
                     common.TemporalBlockType.ATTENTION),
        embeddings_scale_by_sqrt_dim=True, attention_window_size=16, logits_soft_cap=30.0)
    model = rg.Griffin(config)  # gradient_checkpointing=True: the package's default
    batch = text_batch()
    tokens = jnp.asarray(batch["tokens"][:, :-1])
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    params = model.init(jax.random.key(0), tokens, positions)["params"]

    def loss_fn(params, batch):
        tokens = batch["tokens"]
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        logits, _ = model.apply({"params": params}, tokens, pos)
        return _next_token_loss(logits, tokens)
    return loss_fn, params, batch


def penzai_llamalike():
    """``penzai``'s Llama-like transformer: named axes, RoPE, grouped-query attention with a
    causal mask constant, SwiGLU, RMS norms; its params unbound with ``pz.unbind_params``."""
    from penzai import pz
    from penzai.models.transformer.variants import llamalike_common as ll

    config = ll.LlamalikeTransformerConfig(
        num_kv_heads=2, query_head_multiplier=2, embedding_dim=64, projection_dim=16,
        mlp_hidden_dim=128, num_decoder_blocks=2, vocab_size=VOCAB, mlp_variant="swiglu",
        tie_embedder_and_logits=False)
    model = ll.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))
    unbound, params = pz.unbind_params(model, freeze=True)

    def loss_fn(params, batch):
        tokens = batch["tokens"]
        bound = pz.bind_variables(unbound, params)
        logits = bound(pz.nx.wrap(tokens).tag("batch", "seq"))
        return _next_token_loss(logits.unwrap("batch", "seq", "vocabulary"), tokens)
    return loss_fn, params, text_batch()


MODELS = {"recurrentgemma Griffin": griffin, "penzai llamalike": penzai_llamalike}
