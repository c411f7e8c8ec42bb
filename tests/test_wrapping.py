"""Wrapping ``jaxamp.mixed_precision`` in other optax and flax machinery: the policy is found in
the state wherever a harmless wrapper put it, and a wrapping that cannot be correct is a
``ValueError`` that says what to write instead. Never a silent fp32 run."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state as flax_train_state
from helpers import init_params
from helpers import make_batch
from helpers import mse_loss

import jaxamp

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def mp(policy="mixed_bfloat16", inner=None):
    return jaxamp.mixed_precision(optax.adam(1e-3) if inner is None else inner, policy)


def half_with_fp32_master(state: jaxamp.TrainState, half=BF16):
    assert all(p.dtype == half for p in jax.tree.leaves(state.params))
    assert all(m.dtype == F32 for m in jax.tree.leaves(state.master_params))


def trains(state, steps=3):
    step = jax.jit(jaxamp.make_train_step(mse_loss, warn_fp32_matmuls=False))
    losses = []
    for _ in range(steps):
        state, m = step(state, make_batch())
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0]
    return state


# --------------------------------------------------------------------------------------------
# Harmless wrappings keep working, in half precision with an fp32 master
# --------------------------------------------------------------------------------------------

HARMLESS = {
    "bare": lambda: mp(),
    "chain_of_one": lambda: optax.chain(mp()),
    "named_chain_of_one": lambda: optax.named_chain(("amp", mp())),
    "inject_hyperparams_inside": lambda: jaxamp.mixed_precision(
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), "mixed_bfloat16"),
    "clip_inside": lambda: jaxamp.mixed_precision(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "mixed_bfloat16"),
    "multisteps_inside": lambda: jaxamp.mixed_precision(optax.MultiSteps(optax.adam(1e-3), 2),
                                                        "mixed_bfloat16"),
}


@pytest.mark.parametrize("name", sorted(HARMLESS))
def test_a_harmless_wrapping_trains_in_half_precision_with_an_fp32_master(name):
    tx = HARMLESS[name]()
    assert str(jaxamp.state.policy_of(tx)) == "p=f32,c=bf16,o=f32"
    state = jaxamp.TrainState.create(params=init_params(), tx=tx)
    assert state.policy.compute_dtype == BF16
    half_with_fp32_master(state)
    half_with_fp32_master(trains(state))


def test_inject_hyperparams_inside_changes_the_learning_rate_through_the_state():
    tx = jaxamp.mixed_precision(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
                                "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=init_params(), tx=tx)
    mps = jaxamp.state.find_state(state.opt_state)
    frozen = mps._replace(inner_state=mps.inner_state._replace(
        hyperparams={"learning_rate": jnp.zeros((), F32)}))
    state = state.replace(opt_state=frozen)
    new_state, _ = jax.jit(jaxamp.make_train_step(mse_loss, warn_fp32_matmuls=False))(
        state, make_batch())
    for a, b in zip(jax.tree.leaves(new_state.master_params),
                    jax.tree.leaves(state.master_params), strict=True):
        np.testing.assert_array_equal(a, b)  # lr 0: nothing moves


@pytest.mark.parametrize("policy,half", [("mixed_bfloat16", BF16), ("mixed_float16", F16)])
def test_the_policy_comes_from_the_state_not_from_a_function_attribute(policy, half):
    tx = optax.chain(jaxamp.mixed_precision(optax.adam(1e-3), policy))
    assert not hasattr(tx.update, "jaxamp_policy")
    state = jaxamp.TrainState.create(params=init_params(), tx=tx)
    assert state.policy == jaxamp.get_policy(policy)
    half_with_fp32_master(state, half)
    assert jaxamp.state.find_state(state.opt_state).policy == jaxamp.get_policy(policy)


# --------------------------------------------------------------------------------------------
# Wrappings that cannot be correct are errors, with what to write instead
# --------------------------------------------------------------------------------------------

HARMFUL = {
    "clip_before": (lambda: optax.chain(optax.clip_by_global_norm(1.0), mp()),
                    ["optax.chain", "clip would clip the scaled norm", "put it inside",
                     "mixed_precision(optax.chain(optax.clip_by_global_norm(1.0), optax.adam"]),
    "scale_after": (lambda: optax.chain(mp(), optax.scale(0.5)),
                    ["optax.chain", "changes the updates", "put it inside"]),
    "multisteps_outside": (lambda: optax.MultiSteps(mp("mixed_float16"), 4),
                           ["optax.MultiSteps", "changing loss scales",
                            "make_train_step(loss_fn, accum_steps=k)"]),
    "named_chain_with_clip": (lambda: optax.named_chain(("clip", optax.clip(1.0)),
                                                       ("amp", mp())),
                              ["optax.named_chain", "put it inside"]),
    "inject_hyperparams_outside": (
        lambda: optax.inject_hyperparams(
            lambda learning_rate: jaxamp.mixed_precision(optax.sgd(learning_rate),
                                                         "mixed_bfloat16"))(learning_rate=0.1),
        ["optax.inject_hyperparams", "optax.inject_hyperparams(optax.adam)"]),
    "masked_outside": (lambda: optax.masked(mp(), {"dense1": True, "dense2": False}),
                       ["MaskedState", "put it inside"]),
    "twice": (lambda: jaxamp.mixed_precision(mp(), "mixed_bfloat16"),
              ["exactly one MixedPrecisionState", "found 2"]),
}


@pytest.mark.parametrize("name", sorted(HARMFUL))
def test_a_harmful_wrapping_raises_at_create_with_the_fix(name):
    make, words = HARMFUL[name]
    with pytest.raises(ValueError) as info:
        jaxamp.TrainState.create(params=init_params(), tx=make())
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("name", sorted(HARMFUL))
def test_a_harmful_wrapping_raises_in_scale_loss_and_policy_of(name):
    make, words = HARMFUL[name]
    tx = make()
    opt_state = tx.init(init_params())
    for call in (lambda: jaxamp.state.scale_loss(jnp.float32(1.0), opt_state),
                 lambda: jaxamp.state.policy_of(tx, init_params()),
                 lambda: jaxamp.state.policy_of(opt_state)):
        with pytest.raises(ValueError, match=words[0].replace("(", r"\(").replace(".", r"\.")):
            call()


def test_the_issue_examples_no_longer_train_in_fp32_silently():
    params = init_params()
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     jaxamp.mixed_precision(optax.adam(1e-3), "mixed_bfloat16"))
    with pytest.raises(ValueError, match="put it inside"):
        jaxamp.TrainState.create(params=params, tx=tx)
    tx = optax.MultiSteps(jaxamp.mixed_precision(optax.adam(1e-3), "mixed_float16"), 4)
    with pytest.raises(ValueError, match="accum_steps"):
        jaxamp.TrainState.create(params=params, tx=tx)


def test_the_policy_is_stored_once_in_the_optimizer_state():
    state = jaxamp.TrainState.create(params=init_params(), tx=mp("mixed_float16"))
    assert state.policy is jaxamp.state.find_state(state.opt_state).policy
    assert "policy" not in {f.name for f in dataclasses.fields(state)}
    with pytest.raises(ValueError, match="differs from the policy p=f32,c=f16"):
        jaxamp.TrainState.create(params=init_params(), tx=mp("mixed_float16"),
                                 policy="mixed_bfloat16")
    # A plain transform is wrapped at float32 by create (or at the master-less policy given).
    plain = jaxamp.TrainState.create(params=init_params(), tx=optax.sgd(0.1))
    assert plain.policy == jaxamp.get_policy("float32")
    assert jaxamp.TrainState.create(params=init_params(), tx=optax.sgd(0.1),
                                    policy="bfloat16").policy == jaxamp.get_policy("bfloat16")
    with pytest.raises(ValueError, match="keeps a master copy in float32 but tx is a plain"):
        jaxamp.TrainState.create(params=init_params(), tx=optax.sgd(0.1),
                                 policy="mixed_bfloat16")


# --------------------------------------------------------------------------------------------
# flax's TrainState and nnx.Optimizer
# --------------------------------------------------------------------------------------------

def _flax_step(state, batch):
    def loss(p):
        return jaxamp.state.scale_loss(mse_loss(p, batch), state.opt_state)
    return state.apply_gradients(grads=jax.grad(loss)(state.params))


def test_flax_train_state_with_working_params_trains_in_bf16():
    policy = jaxamp.get_policy("mixed_bfloat16")
    params = policy.cast_params_to_compute(init_params())
    state = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=mp())
    for _ in range(2):
        state = jax.jit(_flax_step)(state, make_batch())
    assert all(p.dtype == BF16 for p in jax.tree.leaves(state.params))
    master = jaxamp.state.get_master_params(state.opt_state)
    assert all(m.dtype == F32 for m in jax.tree.leaves(master))


def test_flax_train_state_with_fp32_params_is_an_error_not_an_fp32_run():
    state = flax_train_state.TrainState.create(apply_fn=None, params=init_params(), tx=mp())
    with pytest.raises(ValueError, match="is float32 but policy p=f32,c=bf16,o=f32 works in "
                                         "bfloat16.*cast_params_to_compute"):
        jax.jit(_flax_step)(state, make_batch())


def test_flax_train_state_with_a_clip_outside_is_an_error():
    tx = optax.chain(optax.clip_by_global_norm(1.0), mp())
    params = jaxamp.get_policy("mixed_bfloat16").cast_params_to_compute(init_params())
    state = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    with pytest.raises(ValueError, match="clip would clip the scaled norm"):
        jax.jit(_flax_step)(state, make_batch())


class _Mlp(nnx.Module):
    def __init__(self, rngs):  # nnx.Linear's defaults: fp32 params, no dtype=
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))[:, 0]


def _nnx_step(model, optimizer, batch):
    def loss_fn(model):
        pred = model(batch["x"].astype(BF16)).astype(F32)
        return jaxamp.state.scale_loss(jnp.mean((pred - batch["y"]) ** 2), optimizer.opt_state)
    optimizer.update(model, nnx.grad(loss_fn)(model))


def test_nnx_optimizer_with_a_cast_model_trains_in_bf16():
    model = _Mlp(nnx.Rngs(0))
    fp32 = jax.tree.leaves(nnx.state(model, nnx.Param))
    optimizer = nnx.Optimizer(model, mp(), wrt=nnx.Param)  # the master: the fp32 values
    policy = jaxamp.get_policy("mixed_bfloat16")
    nnx.update(model, policy.cast_params_to_compute(nnx.state(model, nnx.Param)))
    for m, p in zip(jax.tree.leaves(jaxamp.state.get_master_params(optimizer.opt_state)), fp32,
                    strict=True):
        np.testing.assert_array_equal(m, p)
    batch = make_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            nnx.jit(_nnx_step)(model, optimizer, batch)
    assert all(p.dtype == BF16 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert all(m.dtype == F32
               for m in jax.tree.leaves(jaxamp.state.get_master_params(optimizer.opt_state)))


def test_nnx_optimizer_with_an_fp32_model_is_an_error_not_an_fp32_run():
    model = _Mlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, mp(), wrt=nnx.Param)
    with pytest.raises(ValueError, match="is float32 but policy .* works in bfloat16"):
        nnx.jit(_nnx_step)(model, optimizer, make_batch())


def test_nnx_optimizer_with_a_clip_outside_is_an_error():
    model = _Mlp(nnx.Rngs(0))
    policy = jaxamp.get_policy("mixed_bfloat16")
    nnx.update(model, policy.cast_params_to_compute(nnx.state(model, nnx.Param)))
    optimizer = nnx.Optimizer(model, optax.chain(optax.clip(1.0), mp()), wrt=nnx.Param)
    with pytest.raises(ValueError, match="put it inside"):
        nnx.jit(_nnx_step)(model, optimizer, make_batch())
