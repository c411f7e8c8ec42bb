"""jaxamp.equinox: an Equinox module trained as itself (init, make_step, filter_value_and_grad).

The step is jaxamp.make_train_step's on the module's inexact arrays: each run here is checked
bit for bit against the same model trained through ``eqx.partition`` and
``jaxamp.make_train_step``, on the same batches, skipped steps included.
"""

import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_bitwise_equal

import jaxamp

F32, BF16, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
DTYPES = {"float32": F32, "mixed_bfloat16": BF16, "mixed_float16": F16}
V, D, L = 16, 16, 8  # vocabulary, width, sequence length


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
        self.attention = eqx.nn.MultiheadAttention(2, D, key=k1)
        self.up = eqx.nn.Linear(D, 2 * D, key=k2)
        self.down = eqx.nn.Linear(2 * D, D, key=k3)

    def __call__(self, x_LxD, mask_LxL):
        h_LxD = jax.vmap(self.norm1)(x_LxD)
        x_LxD = x_LxD + self.attention(h_LxD, h_LxD, h_LxD, mask=mask_LxL)
        h_LxD = jax.vmap(self.norm2)(x_LxD)
        return x_LxD + jax.vmap(lambda v: self.down(jax.nn.gelu(self.up(v))))(h_LxD)


class Transformer(eqx.Module):
    """A causal language model: embedding, one attention block, a final norm and a head."""

    embed: eqx.nn.Embedding
    pos_LxD: jax.Array
    block: Block
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(V, D, key=k[0])
        self.pos_LxD = 0.1 * jax.random.normal(k[1], (L, D))
        self.block = Block(k[2])
        self.norm = eqx.nn.LayerNorm(D)
        self.head = eqx.nn.Linear(D, V, key=k[3])

    def __call__(self, tokens_L):
        x_LxD = jax.vmap(self.embed)(tokens_L) + self.pos_LxD
        x_LxD = self.block(x_LxD, jnp.tril(jnp.ones((L, L), bool)))
        return jax.vmap(self.head)(jax.vmap(self.norm)(x_LxD))


def lm_loss(model, tokens_BxL):
    logits_BxLxV = jax.vmap(model)(tokens_BxL).astype(F32)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits_BxLxV[:, :-1], tokens_BxL[:, 1:]).mean()


def lm_tokens(n=32):
    """Sequences that count up modulo V from a random start: the next token is learnable."""
    start = np.random.default_rng(0).integers(0, V, (n, 1))
    return jnp.asarray((start + np.arange(L)) % V, jnp.int32)


class BatchNormNet(eqx.Module):
    hidden: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    drop: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, key, mode):
        k1, k2 = jax.random.split(key)
        self.hidden = eqx.nn.Linear(4, 16, key=k1)
        self.norm = eqx.nn.BatchNorm(16, axis_name="batch", mode=mode)
        self.drop = eqx.nn.Dropout(0.1)
        self.out = eqx.nn.Linear(16, 1, key=k2)

    def __call__(self, x, state, *, key):
        h, state = self.norm(self.hidden(x), state)
        return self.out(self.drop(jax.nn.relu(h), key=key))[0], state


def bn_loss(model, state, x_BxF, y_B, *, key):
    keys = jax.random.split(key, x_BxF.shape[0])
    pred_B, state = jax.vmap(lambda x, s, k: model(x, s, key=k), axis_name="batch",
                             in_axes=(0, None, 0), out_axes=(0, None))(x_BxF, state, keys)
    return jnp.mean((pred_B.astype(F32) - y_B) ** 2), state


def bn_batches(steps, poisoned=()):
    """``(x, y, key)`` per step; at the steps in ``poisoned``, one inf in x."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    y = (x[:, 0] - 2 * x[:, 1]).astype(np.float32)
    out = []
    for i in range(steps):
        xi = x.copy()
        if i in poisoned:
            xi[3, 0] = np.inf
        out.append((xi, y, jax.random.key(i)))
    return out


def arrays(model):
    return eqx.filter(model, eqx.is_array)


# --------------------------------------------------------------------------------------------
# The transformer, trained under each policy: with make_step, and through eqx.partition and
# jaxamp.make_train_step
# --------------------------------------------------------------------------------------------

LM_STEPS = 12


def _train_lm(policy):
    tx = jaxamp.mixed_precision(optax.adam(1e-2), policy)
    model, opt_state = jaxamp.equinox.init(Transformer(jax.random.key(0)), tx)
    step = eqx.filter_jit(jaxamp.equinox.make_step(lm_loss, tx))
    tokens = lm_tokens()
    losses = []
    for _ in range(LM_STEPS):
        model, opt_state, metrics = step(model, opt_state, tokens)
        losses.append(float(metrics["loss"]))
    return {"losses": losses, "model": model, "opt_state": opt_state, "metrics": metrics}


def _train_lm_partitioned(policy):
    tx = jaxamp.mixed_precision(optax.adam(1e-2), policy)
    params, static = eqx.partition(Transformer(jax.random.key(0)), eqx.is_inexact_array)

    def loss_fn(params, batch):
        return lm_loss(eqx.combine(params, static), *batch[0], **batch[1])

    state = jaxamp.TrainState.create(params=params, tx=tx)
    step = jax.jit(jaxamp.make_train_step(loss_fn))
    losses = []
    for _ in range(LM_STEPS):
        state, metrics = step(state, ((lm_tokens(),), {}))
        losses.append(float(metrics["loss"]))
    return {"losses": losses, "model": eqx.combine(state.params, static),
            "opt_state": state.opt_state}


@pytest.fixture(scope="module")
def lm_runs():
    return {policy: _train_lm(policy) for policy in DTYPES}


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_transformer_learns_in_half_precision_as_in_fp32(lm_runs, policy):
    """Every matmul in the half dtype (the step's fp32-matmul warning is an error here), an
    fp32 master, no skipped step, and a loss that falls as the fp32 run's does."""
    run, reference = lm_runs[policy], lm_runs["float32"]
    losses = np.array(run["losses"])
    assert losses[-1] < 0.35 * losses[0]
    np.testing.assert_allclose(losses, reference["losses"], rtol=2e-2)
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(run["model"], eqx.is_inexact_array))} \
        == {DTYPES[policy]}
    master = jaxamp.state.get_master_params(run["opt_state"])
    assert {x.dtype for x in jax.tree.leaves(master)} == {F32}
    assert int(run["metrics"]["skipped_steps"]) == 0
    assert float(run["metrics"]["loss_scale"]) == (2.0**16 if policy == "mixed_float16" else 1.0)


def test_the_fp32_run_keeps_the_model_in_fp32(lm_runs):
    model = lm_runs["float32"]["model"]
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))} == {F32}


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_make_step_trains_bit_for_bit_as_partition_and_make_train_step(lm_runs, policy):
    run, other = lm_runs[policy], _train_lm_partitioned(policy)
    assert run["losses"] == other["losses"]
    assert_tree_bitwise_equal(arrays(run["model"]), arrays(other["model"]))
    assert_tree_bitwise_equal(run["opt_state"], other["opt_state"])


def test_the_working_model_is_the_cast_of_the_master(lm_runs):
    run = lm_runs["mixed_bfloat16"]
    params = eqx.filter(run["model"], eqx.is_inexact_array)
    assert_tree_bitwise_equal(params, jaxamp.state.working_params(run["opt_state"]))
    master = jaxamp.state.get_master_params(run["opt_state"], params)
    fp32 = eqx.combine(master, run["model"])
    assert fp32.head.weight.dtype == F32 and fp32.embed.weight.dtype == F32


# --------------------------------------------------------------------------------------------
# BatchNorm's state, dropout's key, and skipped steps
# --------------------------------------------------------------------------------------------

BN_CASES = [("mixed_bfloat16", "batch", False), ("mixed_float16", "ema", True)]


def _train_bn(policy, mode, autocast, batches):
    tx = jaxamp.mixed_precision(optax.adam(1e-2), policy)
    model, state = eqx.nn.make_with_state(BatchNormNet)(jax.random.key(0), mode)
    model, opt_state = jaxamp.equinox.init(model, tx)
    step = eqx.filter_jit(jaxamp.equinox.make_step(bn_loss, tx, has_state=True,
                                                   autocast=autocast))
    history = []
    for x, y, key in batches:
        before = (model, state, opt_state)
        model, state, opt_state, metrics = step(model, state, opt_state, x, y, key=key)
        history.append((before, (model, state, opt_state), metrics))
    return history


def _train_bn_partitioned(policy, mode, autocast, batches):
    tx = jaxamp.mixed_precision(optax.adam(1e-2), policy)
    model, state = eqx.nn.make_with_state(BatchNormNet)(jax.random.key(0), mode)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_fn(params, batch, model_state):
        (x, y), kwargs = batch
        return bn_loss(eqx.combine(params, static), model_state, x, y, **kwargs)

    train_state = jaxamp.TrainState.create(params=params, tx=tx, model_state=state)
    step = jax.jit(jaxamp.make_train_step(loss_fn, has_model_state=True, autocast=autocast))
    history = []
    for x, y, key in batches:
        train_state, metrics = step(train_state, ((x, y), {"key": key}))
        history.append((eqx.combine(train_state.params, static), train_state.model_state,
                        train_state.opt_state, metrics))
    return history


@pytest.fixture(scope="module")
def bn_runs():
    """Each case over 12 steps, the 8th with an inf in the batch; and the same through
    eqx.partition and make_train_step."""
    batches = bn_batches(12, poisoned={7})
    return {case: (_train_bn(*case, batches), _train_bn_partitioned(*case, batches))
            for case in BN_CASES}


@pytest.mark.parametrize("case", BN_CASES, ids=lambda c: "-".join(map(str, c)))
def test_a_batchnorm_model_learns_its_state_kept_in_fp32(bn_runs, case):
    history, _ = bn_runs[case]
    losses = [float(m["loss"]) for _, _, m in history if bool(m["grads_finite"])]
    assert losses[-1] < 0.5 * losses[0]
    (_, state0, _), _, _ = history[0]
    _, (model, state, _), _ = history[-1]
    floating = [(a, b) for a, b in zip(jax.tree.leaves(state0), jax.tree.leaves(state),
                                       strict=True) if jnp.issubdtype(a.dtype, jnp.floating)]
    assert {b.dtype for _, b in floating} == {F32}  # never cast
    assert all(float(jnp.abs(a - b).max()) > 0 for a, b in floating)  # moved
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))} \
        == {DTYPES[case[0]]}


@pytest.mark.parametrize("case", BN_CASES, ids=lambda c: "-".join(map(str, c)))
def test_a_batchnorm_model_trains_bit_for_bit_as_partition_and_make_train_step(bn_runs, case):
    history, other = bn_runs[case]
    for (_, (model, state, opt_state), metrics), (model2, state2, opt_state2, metrics2) in zip(
            history, other, strict=True):
        assert_tree_bitwise_equal(arrays(model), arrays(model2))
        assert_tree_bitwise_equal(state, state2)
        assert_tree_bitwise_equal(opt_state, opt_state2)
        assert_tree_bitwise_equal(metrics, metrics2)


@pytest.mark.parametrize("case", BN_CASES, ids=lambda c: "-".join(map(str, c)))
def test_a_skipped_step_leaves_model_state_and_master_bit_identical(bn_runs, case):
    history, _ = bn_runs[case]
    (model, state, opt_state), (new_model, new_state, new_opt_state), metrics = history[7]
    assert not bool(metrics["grads_finite"])
    assert_tree_bitwise_equal(arrays(new_model), arrays(model))
    assert_tree_bitwise_equal(new_state, state)
    old, new = jaxamp.state.find_state(opt_state), jaxamp.state.find_state(new_opt_state)
    assert_tree_bitwise_equal((new.master, new.inner_state), (old.master, old.inner_state))
    assert int(new.health.skipped_steps) == int(old.health.skipped_steps) + 1
    scale, new_scale = float(old.loss_scale.loss_scale), float(new.loss_scale.loss_scale)
    assert float(metrics["loss_scale"]) == scale
    assert new_scale == (scale / 2 if case[0] == "mixed_float16" else 1.0)


def test_the_fp16_loss_scale_backs_off_at_each_skip_as_make_train_step_does(bn_runs):
    """fp16 from 2**16: the first two steps overflow, the 8th holds an inf; each skip halves
    the scale and no step grows it (growth_interval 2000)."""
    history, other = bn_runs[("mixed_float16", "ema", True)]
    scales = [float(m["loss_scale"]) for _, _, m in history]
    finite = [bool(m["grads_finite"]) for _, _, m in history]
    assert finite == [False, False] + [True] * 5 + [False] + [True] * 4
    assert scales == [2.0**16, 2.0**15] + [2.0**14] * 6 + [2.0**13] * 4
    assert scales == [float(m["loss_scale"]) for *_, m in other]
    assert int(history[-1][2]["skipped_steps"]) == 3


def test_a_skipped_first_step_keeps_batchnorm_s_first_call_flag_under_autocast(bn_runs):
    """BatchNorm's ema mode keeps a bool "first call" flag in the state, which the loss
    returns as a constant under autocast: a skipped first step keeps it True, as an array."""
    history, _ = bn_runs[("mixed_float16", "ema", True)]
    (_, state, _), (_, new_state, _), metrics = history[0]
    assert not bool(metrics["grads_finite"])
    flags = [x for x in jax.tree.leaves(new_state) if x.dtype == jnp.bool_]
    assert len(flags) == 1 and bool(flags[0]) is True
    (_, _, _), (_, later, _), _ = history[2]
    assert [bool(x) for x in jax.tree.leaves(later) if x.dtype == jnp.bool_] == [False]


def test_batchnorm_s_ema_mode_needs_autocast_under_a_cast_batch():
    """Equinox's BatchNorm(mode="ema") mixes the batch statistics (bf16, from a cast batch) with
    the fp32 running ones in a lax.select, which takes one dtype: docs/how-to/equinox.md says
    to train it under autocast (fp32 statistics), as the "ema" case above does."""
    with pytest.raises(TypeError, match="lax.select requires arguments to have the same"):
        _train_bn("mixed_bfloat16", "ema", False, bn_batches(1))


def test_has_aux_with_has_state_nests_as_eqx_filter_value_and_grad_does():
    """``(loss, (state, aux))``: the same loss serves eqx.filter_value_and_grad(has_aux=True)."""
    def loss_fn(model, state, x, y, *, key):
        loss, state = bn_loss(model, state, x, y, key=key)
        return loss, (state, {"twice": 2 * loss})

    tx = jaxamp.mixed_precision(optax.adam(1e-2), "mixed_bfloat16")
    model, state = eqx.nn.make_with_state(BatchNormNet)(jax.random.key(0), "batch")
    (x, y, key), = bn_batches(1)
    (_, (_, aux)), _ = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, state, x, y,
                                                                        key=key)
    model, opt_state = jaxamp.equinox.init(model, tx)
    step = jaxamp.equinox.make_step(loss_fn, tx, has_aux=True, has_state=True)
    _, new_state, _, metrics = step(model, state, opt_state, x, y, key=key)
    assert float(metrics["aux"]["twice"]) == 2 * float(metrics["loss"])
    assert jax.tree.structure(new_state) == jax.tree.structure(state)


# --------------------------------------------------------------------------------------------
# What the step leaves alone, and what it compiles
# --------------------------------------------------------------------------------------------

class Odd(eqx.Module):
    """A module with every kind of leaf an Equinox model may hold."""

    linear: eqx.nn.Linear
    drop: eqx.nn.Dropout
    key: jax.Array
    counts: jax.Array
    gain: float
    activation: object
    width: int = eqx.field(static=True)

    def __call__(self, x, *, key):
        h = self.activation(self.linear(x)) * self.gain
        return self.drop(h, key=key).sum() + 0 * self.counts.sum()


def test_the_step_leaves_every_leaf_but_the_inexact_arrays_untouched():
    model = Odd(eqx.nn.Linear(3, 4, key=jax.random.key(0)), eqx.nn.Dropout(0.5),
                jax.random.key(7), jnp.arange(3, dtype=jnp.int32), 0.5, jax.nn.relu, 4)
    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_bfloat16")
    model, opt_state = jaxamp.equinox.init(model, tx)

    def loss_fn(model, x, *, key):
        keys = jax.random.split(key, x.shape[0])
        return jnp.mean(jax.vmap(lambda xi, k: model(xi, key=k))(x, keys) ** 2)

    step = eqx.filter_jit(jaxamp.equinox.make_step(loss_fn, tx))
    new, _, metrics = step(model, opt_state, jnp.ones((8, 3)), key=jax.random.key(1))
    assert bool(metrics["grads_finite"])
    assert new.linear.weight.dtype == BF16 and not bool((new.linear.weight ==
                                                         model.linear.weight).all())
    assert new.drop.p == 0.5 and new.drop.inference is False
    assert new.gain == 0.5 and type(new.gain) is float
    assert new.activation is jax.nn.relu and new.width == 4
    assert new.counts.dtype == jnp.int32 and new.counts.tolist() == [0, 1, 2]
    assert jnp.issubdtype(new.key.dtype, jax.dtypes.prng_key)
    assert (jax.random.key_data(new.key) == jax.random.key_data(model.key)).all()
    assert jax.tree.structure(new) == jax.tree.structure(model)


def test_the_step_traces_once_whatever_the_loss_scale_and_the_skips():
    traces = []

    def loss_fn(model, x):
        traces.append(1)
        return jnp.mean(jax.vmap(model)(x) ** 2)

    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16")
    model, opt_state = jaxamp.equinox.init(eqx.nn.Linear(2, 1, key=jax.random.key(0)), tx)
    step = eqx.filter_jit(jaxamp.equinox.make_step(loss_fn, tx))
    step(model, opt_state, jnp.ones((4, 2)))
    once = len(traces)
    for x in (jnp.ones((4, 2)), jnp.full((4, 2), jnp.inf, F32), jnp.ones((4, 2))):
        model, opt_state, _ = step(model, opt_state, x)
    assert once >= 1 and len(traces) == once


# --------------------------------------------------------------------------------------------
# filter_value_and_grad
# --------------------------------------------------------------------------------------------

def _linear_f16():
    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16")
    linear = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    model, opt_state = jaxamp.equinox.init(linear, tx)
    return tx, model, opt_state


def test_filter_value_and_grad_is_the_gradient_of_the_scaled_loss():
    tx, model, opt_state = _linear_f16()
    x = jnp.linspace(-1.0, 1.0, 12, dtype=F32).reshape(4, 3) * 1e-3

    def loss_fn(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    loss, grads = jaxamp.equinox.filter_value_and_grad(loss_fn, opt_state)(model, x)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    expected_loss, expected = jax.value_and_grad(
        lambda p: jaxamp.state.scale_loss(loss_fn(eqx.combine(p, static), x.astype(F16)),
                                    opt_state))(params)
    assert loss.dtype == F32 and float(loss) == float(expected_loss) / 2.0**16
    assert_tree_bitwise_equal(grads, expected)
    assert grads.weight.dtype == F16
    assert jax.tree.structure(grads) == jax.tree.structure(params)  # None off the params


def test_a_step_written_with_filter_value_and_grad_equals_make_step():
    """tx.update and jaxamp.state.next_working_params, the model and the BatchNorm state kept
    on a skipped step by hand: bit for bit make_step's."""
    tx = jaxamp.mixed_precision(optax.adam(1e-2), "mixed_float16")
    model, state = eqx.nn.make_with_state(BatchNormNet)(jax.random.key(0), "batch")
    model, opt_state = jaxamp.equinox.init(model, tx)

    @eqx.filter_jit
    def by_hand(model, state, opt_state, x, y, key):
        (loss, new_state), grads = jaxamp.equinox.filter_value_and_grad(
            bn_loss, opt_state, has_aux=True)(model, state, x, y, key=key)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = tx.update(grads, opt_state, params, value=loss)
        model = eqx.combine(jaxamp.state.next_working_params(opt_state, params, updates), model)
        finite = jaxamp.state.find_state(opt_state).health.grads_finite
        state = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_state, state)
        return model, state, opt_state

    step = eqx.filter_jit(jaxamp.equinox.make_step(bn_loss, tx, has_state=True))
    mine = theirs = (model, state, opt_state)
    for x, y, key in bn_batches(5, poisoned={3}):
        mine = by_hand(*mine, x, y, key)
        *theirs, _ = step(*theirs, x, y, key=key)
        assert_tree_bitwise_equal(arrays(mine[0]), arrays(theirs[0]))
        assert_tree_bitwise_equal(mine[1:], tuple(theirs[1:]))


def test_filter_value_and_grad_casts_floating_arguments_only():
    tx, model, opt_state = _linear_f16()
    _, state = eqx.nn.make_with_state(BatchNormNet)(jax.random.key(0), "batch")
    seen = {}

    def loss_fn(model, x, n, state, key, scale):
        seen.update(x=x.dtype, n=n.dtype, state={a.dtype for a in jax.tree.leaves(state)},
                    key=key.dtype, scale=scale)
        return jnp.mean(jax.vmap(model)(x) ** 2), x.dtype

    (loss, aux), _ = jaxamp.equinox.filter_value_and_grad(loss_fn, opt_state, has_aux=True)(
        model, jnp.ones((2, 3)), jnp.arange(2), state, jax.random.key(0), scale=0.5)
    assert aux == F16 and loss.dtype == F32
    assert seen["x"] == F16 and seen["n"] == jnp.int32 and seen["scale"] == 0.5
    assert seen["state"] == {jnp.dtype(jnp.int32), jnp.dtype(F32)}
    assert jnp.issubdtype(seen["key"], jax.dtypes.prng_key)


def test_filter_value_and_grad_under_autocast_keeps_the_arguments_as_given():
    tx, model, opt_state = _linear_f16()
    seen = {}

    def loss_fn(model, x):
        seen["x"] = x.dtype
        return jnp.mean(jax.vmap(model)(x) ** 2)

    loss, grads = jaxamp.equinox.filter_value_and_grad(loss_fn, opt_state, autocast=True)(
        model, jnp.full((2, 3), 1e-3))
    assert seen["x"] == F32 and loss.dtype == F32 and grads.weight.dtype == F16


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

def _plain():
    return eqx.nn.Linear(2, 1, key=jax.random.key(0))


def _mixed(policy="mixed_bfloat16"):
    return jaxamp.mixed_precision(optax.sgd(0.1), policy)


def _loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


def _call_step(step_kwargs, *args):
    tx = _mixed()
    model, opt_state = jaxamp.equinox.init(_plain(), tx)
    step = jaxamp.equinox.make_step(step_kwargs.pop("loss_fn", _loss), tx, **step_kwargs)
    return step(*[{"model": model, "opt_state": opt_state}.get(a, a) if isinstance(a, str)
                  else a for a in args])


def _state():
    return eqx.nn.make_with_state(BatchNormNet)(jax.random.key(0), "batch")[1]


ERRORS = {
    "init, a params dict": (
        lambda: jaxamp.equinox.init({"w": jnp.ones(2)}, _mixed()), TypeError,
        ["model must be an equinox.Module", "dict", "jaxamp.TrainState"]),
    "init, a plain optax transform": (
        lambda: jaxamp.equinox.init(_plain(), optax.adam(1e-3)), ValueError,
        ["tx is a plain optax transform", "jaxamp.mixed_precision(optax.adamw"]),
    "init, not a transform": (
        lambda: jaxamp.equinox.init(_plain(), "adam"), TypeError,
        ["tx must be an optax transform wrapped by jaxamp.mixed_precision", "str 'adam'"]),
    "make_step, a plain optax transform": (
        lambda: jaxamp.equinox.make_step(_loss, optax.sgd(0.1)), ValueError,
        ["tx is a plain optax transform", "wrap it"]),
    "make_step, a loss that is not callable": (
        lambda: jaxamp.equinox.make_step("loss", _mixed()), TypeError,
        ["loss_fn must be callable", "str 'loss'", "loss_fn(model, *args) -> loss"]),
    "make_step, autocast's options": (
        lambda: jaxamp.equinox.make_step(_loss, _mixed(), autocast={"policy": "bf16"}),
        TypeError, ["autocast={...} takes jaxamp.autocast's options", "'policy'"]),
    "step, a model that is not a module": (
        lambda: _call_step({}, {"w": jnp.ones(2)}, "opt_state", jnp.ones((2, 2))), TypeError,
        ["model must be an equinox.Module", "dict"]),
    "step, an fp32 model": (
        lambda: _call_step({}, _plain(), "opt_state", jnp.ones((2, 2))), ValueError,
        ["model is not the working model", "'weight' is float32", "works in bfloat16",
         "jaxamp.equinox.init(model, tx)"]),
    "step, an opt_state of plain optax": (
        lambda: _call_step({}, "model", optax.sgd(0.1).init({}), jnp.ones((2, 2))),
        ValueError, ["opt_state holds no jaxamp.mixed_precision state", "jaxamp.equinox.init"]),
    "step, no opt_state": (
        lambda: _call_step({}, "model"), TypeError,
        ["step(model, opt_state, *args)", "got 1 positional argument"]),
    "step, a state without has_state": (
        lambda: _call_step({}, "model", "opt_state", _state()), ValueError,
        ["an eqx.nn.State is among the step's arguments", "has_state=True",
         "step(model, state, opt_state, *args)"]),
    "step, the states swapped": (
        lambda: _call_step({"has_state": True}, "model", "opt_state", _state()), TypeError,
        ["step(model, state, opt_state, *args)", "the state first"]),
    "step, opt_state where the state goes": (
        lambda: _call_step({"has_state": True}, "model", _state(), _state()), TypeError,
        ["opt_state is an eqx.nn.State", "step(model, state, opt_state, *args)"]),
    "step, a stateful loss that returns the loss alone": (
        lambda: _call_step({"has_state": True, "loss_fn": lambda m, s, x: _loss(m, x)},
                           "model", _state(), "opt_state", jnp.ones((2, 2))),
        ValueError, ["loss_fn must return (loss, state) with has_aux=False and "
                     "has_state=True", "got a single bfloat16[] array"]),
    "step, a tuple with no flag": (
        lambda: _call_step({"loss_fn": lambda m, x: (_loss(m, x), 0)}, "model", "opt_state",
                           jnp.ones((2, 2))),
        ValueError, ["loss_fn returned a tuple of 2", "has_aux=True", "has_state=True"]),
    "filter_value_and_grad, an opt_state of plain optax": (
        lambda: jaxamp.equinox.filter_value_and_grad(_loss, optax.sgd(0.1).init({})),
        ValueError, ["opt_state holds no jaxamp.mixed_precision state"]),
    "filter_value_and_grad, an fp32 model": (
        lambda: jaxamp.equinox.filter_value_and_grad(_loss, _mixed().init({}))(
            _plain(), jnp.ones((2, 2))),
        ValueError, ["model is not the working model", "'weight' is float32"]),
}


@pytest.mark.parametrize("case", ERRORS)
def test_each_error_names_the_argument_the_value_and_the_fix(case):
    call, kind, words = ERRORS[case]
    with pytest.raises(kind) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# --------------------------------------------------------------------------------------------
# The optional dependency
# --------------------------------------------------------------------------------------------

def test_import_jaxamp_works_without_equinox_and_jaxamp_equinox_names_the_fix():
    code = ("import sys\n"
            "sys.modules['equinox'] = None  # as if not installed\n"
            "import jaxamp\n"
            "from jaxamp import *  # noqa\n"
            "try:\n"
            "    import jaxamp.equinox\n"
            "except ImportError as e:\n"
            "    assert 'pip install equinox' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('no ImportError')\n"
            "try:\n"
            "    jaxamp.equinox\n"
            "except ImportError as e:\n"
            "    assert 'pip install equinox' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('no ImportError')\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_jaxamp_equinox_is_loaded_on_first_use():
    code = ("import sys, jaxamp\n"
            "assert 'equinox' not in sys.modules and 'jaxamp.equinox' not in sys.modules\n"
            "assert jaxamp.equinox.make_step is sys.modules['jaxamp.equinox'].make_step\n"
            "assert 'equinox' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_face_exports_three_names():
    assert jaxamp.equinox.__all__ == ["filter_value_and_grad", "init", "make_step"]
    # Not in jaxamp.__all__: a star import works without equinox installed.
    assert "equinox" not in jaxamp.__all__
