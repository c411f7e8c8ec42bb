"""Attention found by its structure (``jaxamp._autocast._attention_structure``): each spelling users
write is found, arranged for ``jax.nn.dot_product_attention`` (what cuDNN runs fused on a GPU) with
the same values and gradients as the equations it replaces, and look-alikes are left alone. The
fused kernel itself is compiled for an H200 in tests/gpu_memory."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._autocast import _attention
from jaxamp._autocast import _attention_structure
from jaxamp._jaxpr import Level

B, T, N, H = 2, 8, 4, 16
_K = jax.random.split(jax.random.key(0), 6)
Q, K, V = (jax.random.normal(k, (B, T, N, H)) for k in _K[:3])
BIAS = jax.random.normal(_K[3], (B, N, T, T))
PAD = jnp.arange(T)[None, :] < jnp.array([[5], [T]])         # [B, S]: the first row padded


def hand(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(H)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def causal_scaled_query(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q * H ** -0.5, k)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e10)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s.astype(jnp.float32), -1), v)


def padding_and_bias(q, k, v, bias, pad):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * 0.25 + bias
    s = jnp.where(pad[:, None, None, :], s, jnp.finfo(jnp.float32).min)
    e = jnp.exp(s - s.max(-1, keepdims=True))                 # a softmax written out
    return jnp.einsum("bnts,bsnh->btnh", e / e.sum(-1, keepdims=True), v)


def grouped_query(q, k, v):                                  # 2 kv heads, groups of 2
    qg = q.reshape(B, T, 2, N // 2, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k[:, :, :2]) / jnp.sqrt(H)
    out = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(s, axis=-1), v[:, :, :2])
    return out.reshape(B, T, N, H)


def linen(q, k, v):
    return nn.dot_product_attention(q, k, v)


def single_head(q, k, v):
    q, k, v = q[0, :, 0], k[0, :, 0], v[0, :, 0]
    return jax.nn.softmax(q @ k.T * 0.25, axis=-1) @ v


def maxtext_like(q, k, v):
    """MaxText's ``dot_product`` attention: a [b, kv, g, t, s] layout, the scale on the query,
    a causal mask from ``iota`` comparisons, the softmax in fp32."""
    q = q * (H ** -0.5)
    qg = q.reshape(B, T, 2, N // 2, H)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k[:, :, :2])
    rows = jax.lax.broadcasted_iota(jnp.int32, (T, T), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (T, T), 1)
    s = jnp.where(cols <= rows, s, -0.7 * float(np.finfo(np.float32).max))
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", p, v[:, :, :2]).reshape(B, T, N, H)


SPELLINGS = {
    "einsum": (hand, (Q, K, V), dict(scale=0.25, causal=False, biases=0, masks=0)),
    "causal, scaled query": (causal_scaled_query, (Q, K, V),
                             dict(scale=0.25, causal=True, biases=0, masks=0)),
    "padding mask and bias": (padding_and_bias, (Q, K, V, BIAS, PAD),
                              dict(scale=0.25, causal=False, biases=1, masks=1)),
    "grouped query": (grouped_query, (Q, K, V), dict(scale=0.25, causal=False, biases=0,
                                                     masks=0)),
    "flax linen": (linen, (Q, K, V), dict(scale=0.25, causal=False, biases=0, masks=0)),
    "q @ k.T, one head": (single_head, (Q, K, V), dict(scale=0.25, causal=False, biases=0,
                                                       masks=0)),
    # the query is scaled before its reshape: the kernel reads it scaled, with a scale of 1
    "maxtext": (maxtext_like, (Q, K, V), dict(scale=1.0, causal=True, biases=0, masks=0)),
}


def _found(fn, args):
    closed = jax.make_jaxpr(fn)(*args)
    level = Level(closed.jaxpr)
    chains = [(j, _attention_structure.find(level, j)) for j in range(len(level.eqns))]
    return closed, level, [(j, c) for j, c in chains if c is not None]


def _run(eqns, env):
    """``env`` extended by ``eqns`` bound as traced."""
    env = dict(env)
    for eqn in eqns:
        ins = [v.val if isinstance(v, jax.extend.core.Literal) else env[v] for v in eqn.invars]
        outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs],
                       strict=True))
    return env


def _evaluated(closed, args):
    env = dict(zip(closed.jaxpr.invars, args, strict=True))
    env.update(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    return _run(closed.jaxpr.eqns, env)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_each_spelling_is_found_with_its_options(spelling):
    fn, args, want = SPELLINGS[spelling]
    _, _, found = _found(fn, args)
    assert len(found) == 1, found
    chain = found[0][1]
    got = dict(scale=chain.scale, causal=chain.causal, biases=len(chain.biases),
               masks=len(chain.masks))
    np.testing.assert_allclose(got.pop("scale"), want["scale"], rtol=1e-6)
    assert got == {k: v for k, v in want.items() if k != "scale"}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_the_arranged_call_gives_the_chains_values_and_gradients(spelling):
    """What runs fused on a GPU is ``jax.nn.dot_product_attention`` of the arranged inputs:
    its XLA implementation, run here, gives the chain's output and the gradients of its
    query, key and value, fully masked rows aside (none here but the padded keys)."""
    fn, args, _ = SPELLINGS[spelling]
    closed, level, found = _found(fn, args)
    j, chain = found[0]
    env = _evaluated(closed, args)
    values = [env[v] for v in (chain.query, chain.key, chain.value, *chain.biases,
                               *chain.masks)]
    want = env[level.eqns[j].outvars[0]]
    got = _attention_structure.reference(chain, *values)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    cot = jax.random.normal(_K[5], want.shape)
    chain_eqns = [level.eqns[i] for i in chain.indices]  # what they read is in env

    def chain_of(*qkv):  # the chain's own equations, as a function of its q, k and v
        inputs = dict(zip((chain.query, chain.key, chain.value), qkv, strict=True))
        return _run(chain_eqns, {**env, **inputs})[level.eqns[j].outvars[0]]
    want_grads = jax.vjp(chain_of, *values[:3])[1](cot)
    got_grads = jax.vjp(lambda *qkv: _attention_structure.reference(chain, *qkv, *values[3:]),
                        *values[:3])[1](cot)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def dropout_on_the_weights(q, k, v):
    p = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k), axis=-1)
    p = p * jax.random.bernoulli(jax.random.key(1), 0.9, p.shape) / 0.9
    return jnp.einsum("bnts,bsnh->btnh", p, v)


def softmax_over_the_queries(q, k, v):
    p = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k), axis=-2)
    return jnp.einsum("bnts,bsnh->btnh", p, v)


def scores_read_twice(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v), s.mean()


def bias_before_the_scale(q, k, v):
    s = (jnp.einsum("btnh,bsnh->bnts", q, k) + BIAS) * 0.25
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def a_sigmoid_not_a_softmax(q, k, v):
    return jnp.einsum("bnts,bsnh->btnh",
                      jax.nn.sigmoid(jnp.einsum("btnh,bsnh->bnts", q, k)), v)


@pytest.mark.parametrize("fn", [dropout_on_the_weights, softmax_over_the_queries,
                                scores_read_twice, bias_before_the_scale,
                                a_sigmoid_not_a_softmax], ids=lambda f: f.__name__)
def test_look_alikes_are_not_matched(fn):
    _, _, found = _found(fn, (Q, K, V))
    assert found == []


def test_autocast_runs_a_found_chain_as_written_off_the_gpu():
    """On the CPU the chain's own equations run under the rules (the fused kernel is the CUDA
    branch of a platform-dependent choice): the values and gradients of fp32 within bf16's
    rounding, the probabilities' sums in fp32."""
    def loss(q, k, v, bias, pad):
        return jnp.mean(padding_and_bias(q, k, v, bias, pad) ** 2)
    args = (Q, K, V, BIAS, PAD)
    want = jax.value_and_grad(loss, argnums=(0, 1, 2))(*args)
    got = jax.value_and_grad(jaxamp.autocast(loss), argnums=(0, 1, 2))(*args)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=2e-2)
    for g, w in zip(got[1], want[1], strict=True):
        rel = float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
        assert rel < 0.03, rel
    calls = _attention.find_calls(jax.make_jaxpr(loss)(*args).jaxpr)
    assert [c.options for c in calls.values()] == [
        {"scale": 0.25, "is_causal": False, "bias": True, "mask": True}]


def test_the_audit_lists_attention_it_does_not_fuse_with_the_reason():
    def model(q, k, v):
        return (dropout_on_the_weights(q, k, v) + bias_before_the_scale(q, k, v)
                + hand(q, k, v) + scores_read_twice(q, k, v)[0])
    import optax

    def loss(params, batch):
        return jnp.mean(model(batch * params["s"], K, V) ** 2)
    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params={"s": jnp.ones(())}, tx=tx)
    step = jax.jit(jaxamp.make_train_step(loss, autocast=True))
    for report in (jaxamp.audit(model, Q, K, V),
                   jaxamp.audit_grad(jaxamp.autocast(model), Q, K, V),
                   jaxamp.audit(step, state, Q)):
        reasons = [line.split(": ", 1)[1] for line in report.attention_not_fused]
        assert sorted(reasons) == sorted([
            "the probabilities pass through div, mul before the second matmul (dropout on "
            "the weights?)",
            "the softmax's input is not a matmul's scores, scaled, with a bias added after "
            "the scale, or masked",
            "a value inside the chain is read elsewhere (the scores or the probabilities "
            "kept)"]), report.attention_not_fused   # `hand` is fused: not listed
        assert "attention not fused" in str(report)
    assert jaxamp.audit(hand, Q, K, V).attention_not_fused == []
