"""Tests of ``jaxamp.TrainState`` and ``jaxamp.make_train_step`` under jit, sharded jit and pmap."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import BATCH
from helpers import assert_tree_bitwise_equal
from helpers import bits
from helpers import hidden
from helpers import init_params
from helpers import make_batch
from helpers import mlp
from helpers import mse_loss
from helpers import per_example_loss
from helpers import replicated_sharding
from helpers import standard_promotion

import jaxamp
from jaxamp import _jaxpr
from jaxamp.gradients import nonfinite_leaf_path

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
N_DEVICES = 8


# --------------------------------------------------------------------------------------------
# Helpers: a tiny MLP, its losses and a batch
# --------------------------------------------------------------------------------------------

def assert_tree_allclose(a, b, **tol):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b),
                            strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   err_msg=jax.tree_util.keystr(path), **tol)


def xent_loss(params, batch):
    h = hidden(params, batch["x"])
    logits = (h @ params["dense2"]["kernel"] + params["dense2"]["bias"]).astype(F32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return jnp.mean(batch["poison"].astype(F32) * loss)


def make_state(policy="float32", inner=None, loss_scale=None, **kwargs):
    inner = optax.sgd(0.1) if inner is None else inner
    tx = jaxamp.mixed_precision(inner, policy, loss_scale=loss_scale)
    return jaxamp.TrainState.create(params=init_params(kwargs.pop("seed", 0),
                                                       kwargs.pop("n_out", 1)),
                                    tx=tx, **kwargs)


def poisoned(batch, index, value=np.inf, field="poison"):
    out = {k: np.array(v) for k, v in batch.items()}
    out[field][index] = value
    return out


def mp_state(state):
    return jaxamp.state.find_state(state.opt_state)


# --------------------------------------------------------------------------------------------
# The three layouts agree
# --------------------------------------------------------------------------------------------

def run_pmap(state, batch, steps, loss_fn=mse_loss, **step_kwargs):
    step = jax.pmap(jaxamp.make_train_step(loss_fn, axis_name="batch", **step_kwargs),
                    axis_name="batch")
    rstate = jaxamp.parallel.replicate(state)
    metrics = []
    for _ in range(steps):
        rstate, m = step(rstate, jaxamp.parallel.shard_batch(batch))
        metrics.append(m)
    return rstate, metrics


def run_jit_sharded(state, batch, steps, loss_fn=mse_loss, **step_kwargs):
    step = jax.jit(jaxamp.make_train_step(loss_fn, **step_kwargs))
    state = jax.device_put(state, replicated_sharding())
    sharded = jaxamp.parallel.put_sharded(batch)
    assert len(sharded["x"].sharding.device_set) == N_DEVICES
    metrics = []
    for _ in range(steps):
        state, m = step(state, sharded)
        metrics.append(m)
    return state, metrics


def run_jit(state, batch, steps, loss_fn=mse_loss, **step_kwargs):
    step = jax.jit(jaxamp.make_train_step(loss_fn, **step_kwargs))
    metrics = []
    for _ in range(steps):
        state, m = step(state, batch)
        metrics.append(m)
    return state, metrics


def assert_replicas_identical(rstate):
    for leaf in jax.tree.leaves(rstate):
        leaf = np.asarray(leaf)
        for i in range(1, leaf.shape[0]):
            np.testing.assert_array_equal(bits(leaf[i]), bits(leaf[0]))


@pytest.mark.parametrize("policy, master_tol, params_tol", [
    ("float32", dict(rtol=1e-5, atol=1e-6), dict(rtol=1e-5, atol=1e-6)),
    # One device rounds the whole batch's bf16 gradient once; 8 devices round their 8 partial
    # gradients to bf16 before the fp32 mean (as each rank does under PyTorch DDP), so one
    # device agrees to ~1e-3 on the master. With accum_steps=8 it takes the same 8 partials
    # and agrees to fp32 rounding (tests/test_sharding.py).
    ("mixed_bfloat16", dict(rtol=0, atol=2e-3), dict(rtol=1e-2, atol=1e-3)),
])
def test_pmap_sharded_jit_and_single_device_jit_agree(policy, master_tol, params_tol):
    batch = make_batch()
    state = make_state(policy)
    steps = 5
    p_state, p_metrics = run_pmap(state, batch, steps)
    s_state, s_metrics = run_jit_sharded(state, batch, steps)
    j_state, j_metrics = run_jit(state, batch, steps)

    assert_replicas_identical(p_state)
    p_state = jaxamp.parallel.unreplicate(p_state)
    # pmap and the sharded jit reduce the same per-device gradients in fp32: bit for bit.
    assert_tree_bitwise_equal(jax.device_get(p_state.params), jax.device_get(s_state.params))
    assert_tree_bitwise_equal(jax.device_get(p_state.opt_state),
                              jax.device_get(s_state.opt_state))
    assert_tree_allclose(p_state.master_params, j_state.master_params, **master_tol)
    assert_tree_allclose(p_state.params, j_state.params, **params_tol)
    for s in (p_state, s_state, j_state):
        assert int(s.step) == steps
        assert int(mp_state(s).health.applied_steps) == steps
        for leaf in jax.tree.leaves(s.master_params):
            assert leaf.dtype == F32
        compute = jaxamp.get_policy(policy).compute_dtype
        for leaf in jax.tree.leaves(s.params):
            assert leaf.dtype == compute
        assert_tree_bitwise_equal(s.params,
                                  jaxamp.get_policy(policy).cast_params_to_compute(
                                      s.master_params))
    # Training happened, and the three agree on the loss.
    for ms in (p_metrics, s_metrics, j_metrics):
        assert float(np.mean(ms[-1]["loss"])) < float(np.mean(ms[0]["loss"]))
    for a, b, c in zip(p_metrics, s_metrics, j_metrics, strict=True):
        np.testing.assert_allclose(np.asarray(a["loss"]), float(c["loss"]), rtol=1e-2 if
                                   policy != "float32" else 1e-5)
        np.testing.assert_allclose(float(b["loss"]), float(c["loss"]),
                                   rtol=1e-2 if policy != "float32" else 1e-5)
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                         j_state.master_params, state.master_params)
    assert max(jax.tree.leaves(moved)) > 1e-2


# --------------------------------------------------------------------------------------------
# A non-finite value on one device skips the step everywhere
# --------------------------------------------------------------------------------------------

def test_inf_in_one_device_shard_skips_the_step_on_every_device():
    scale = jaxamp.DynamicLossScale(loss_scale=2.0**8)
    state = make_state("mixed_float16", inner=optax.adam(1e-2), loss_scale=scale)
    step = jax.pmap(jaxamp.make_train_step(mse_loss, axis_name="batch"), axis_name="batch")
    rstate = jaxamp.parallel.replicate(state)
    batch = make_batch()

    rstate, m = step(rstate, jaxamp.parallel.shard_batch(batch))
    assert np.all(np.asarray(m["grads_finite"]))
    before = rstate
    # Example 5 sits on device 2 (two examples per device).
    bad = poisoned(batch, 5)
    rstate, m = step(rstate, jaxamp.parallel.shard_batch(bad))

    assert np.asarray(m["grads_finite"]).shape == (N_DEVICES,)
    assert not np.any(np.asarray(m["grads_finite"]))
    np.testing.assert_array_equal(np.asarray(m["skipped_steps"]), np.ones(N_DEVICES))
    np.testing.assert_array_equal(np.asarray(m["loss_scale"]), np.full(N_DEVICES, 2.0**8))
    assert_tree_bitwise_equal(rstate.params, before.params)
    assert_tree_bitwise_equal(mp_state(rstate).master.params, mp_state(before).master.params)
    assert_tree_bitwise_equal(mp_state(rstate).inner_state, mp_state(before).inner_state)
    np.testing.assert_array_equal(np.asarray(mp_state(rstate).loss_scale.loss_scale),
                                  np.full(N_DEVICES, 2.0**7))
    np.testing.assert_array_equal(np.asarray(rstate.step), np.full(N_DEVICES, 2))
    assert_replicas_identical(rstate)

    # The next clean step is applied again, on every device.
    rstate, m = step(rstate, jaxamp.parallel.shard_batch(batch))
    assert np.all(np.asarray(m["grads_finite"]))
    np.testing.assert_array_equal(np.asarray(m["loss_scale"]), np.full(N_DEVICES, 2.0**7))
    assert_replicas_identical(rstate)


# --------------------------------------------------------------------------------------------
# Gradient accumulation
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss_name", ["mse", "xent"])
def test_accumulation_equals_one_step_on_the_full_batch(loss_name):
    batch = make_batch()
    if loss_name == "mse":
        loss_fn, n_out = mse_loss, 1
    else:
        loss_fn, n_out = xent_loss, 3
        batch["label"] = (np.arange(BATCH) % 3).astype(np.int32)
    state = make_state("float32", inner=optax.sgd(0.5), n_out=n_out)
    acc_state, acc_metrics = run_jit(state, batch, 3, loss_fn=loss_fn, accum_steps=4)
    full_state, full_metrics = run_jit(state, batch, 3, loss_fn=loss_fn)
    assert_tree_allclose(acc_state.master_params, full_state.master_params, rtol=1e-5, atol=1e-6)
    assert_tree_allclose(acc_state.params, full_state.params, rtol=1e-5, atol=1e-6)
    for a, f in zip(acc_metrics, full_metrics, strict=True):
        np.testing.assert_allclose(float(a["loss"]), float(f["loss"]), rtol=1e-5)
        np.testing.assert_allclose(float(a["grad_norm"]), float(f["grad_norm"]), rtol=1e-5)
        assert bool(a["grads_finite"])
    assert int(acc_state.step) == 3
    assert int(mp_state(acc_state).health.applied_steps) == 3
    assert float(acc_metrics[-1]["loss"]) < float(acc_metrics[0]["loss"])


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_overflow_in_one_micro_batch_skips_the_whole_step(policy):
    state = make_state(policy, inner=optax.adam(1e-2))
    step = jax.jit(jaxamp.make_train_step(mse_loss, accum_steps=4))
    batch = make_batch()
    state, m = step(state, batch)
    assert bool(m["grads_finite"])
    before = state
    # Example 9 belongs to the third of four micro-batches.
    state, m = step(state, poisoned(batch, 9))
    assert not bool(m["grads_finite"])
    assert int(m["skipped_steps"]) == 1
    assert_tree_bitwise_equal(state.params, before.params)
    assert_tree_bitwise_equal(mp_state(state).master.params, mp_state(before).master.params)
    assert_tree_bitwise_equal(mp_state(state).inner_state, mp_state(before).inner_state)
    assert int(mp_state(state).health.applied_steps) == 1
    assert int(state.step) == 2


def loss_with_a_blind_term(params, batch):
    """The MSE plus a term no gradient flows through: inf where ``blind`` holds an inf, so the
    loss is inf while every gradient is finite (a masked fp16 sum that overflowed)."""
    blind = jax.lax.stop_gradient(jnp.mean(batch["blind"].astype(F32)))
    return mse_loss(params, batch) + blind


@pytest.mark.parametrize("layout", ["jit", "pmap", "accumulation", "plain optax"])
@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_a_nonfinite_loss_with_finite_gradients_skips_the_step(layout, value):
    plain = layout == "plain optax"
    scale = jaxamp.DynamicLossScale(loss_scale=2.0**8)
    state = (jaxamp.TrainState.create(params=init_params(), tx=optax.adam(1e-2)) if plain
             else make_state("mixed_float16", inner=optax.adam(1e-2), loss_scale=scale))
    batch = {**make_batch(), "blind": np.zeros((BATCH,), np.float32)}
    if layout == "pmap":
        step = jax.pmap(jaxamp.make_train_step(loss_with_a_blind_term, axis_name="batch"),
                        axis_name="batch")
        state, shard = jaxamp.parallel.replicate(state), jaxamp.parallel.shard_batch
    else:
        step = jax.jit(jaxamp.make_train_step(loss_with_a_blind_term,
                                              accum_steps=4 if layout == "accumulation" else 1))
        shard = lambda b: b  # noqa: E731
    state, m = step(state, shard(batch))
    assert np.all(np.asarray(m["grads_finite"]))
    before = state
    state, m = step(state, shard(poisoned(batch, 9, value, field="blind")))
    loss = np.asarray(m["loss"])
    assert np.all(np.isnan(loss) if np.isnan(value) else np.isinf(loss))
    assert np.all(np.isfinite(np.asarray(m["grad_norm"])))  # the gradients were finite
    assert not np.any(np.asarray(m["grads_finite"]))  # and the step is skipped all the same
    assert np.all(np.asarray(m["nonfinite_leaves"]) == 0)
    assert_tree_bitwise_equal(state.params, before.params)
    assert_tree_bitwise_equal(mp_state(state).inner_state, mp_state(before).inner_state)
    assert np.all(np.asarray(m["skipped_steps"]) == 1)  # one path: the plain transform too
    if not plain:
        assert_tree_bitwise_equal(mp_state(state).master.params, mp_state(before).master.params)
        np.testing.assert_array_equal(np.asarray(mp_state(state).loss_scale.loss_scale),
                                      np.full_like(np.asarray(m["loss_scale"]), 2.0**7))
    state, m = step(state, shard(batch))  # the next finite step is applied
    assert np.all(np.asarray(m["grads_finite"]))


# --------------------------------------------------------------------------------------------
# aux, model state, rng
# --------------------------------------------------------------------------------------------

def stats_loss(params, batch, model_state):
    """A fake BatchNorm: running mean of x in the model state, plus a step counter."""
    x = batch["x"].astype(F32)
    new_state = {"mean": 0.9 * model_state["mean"] + 0.1 * jnp.mean(x, axis=0),
                 "count": model_state["count"] + 1}
    loss = mse_loss(params, batch)
    aux = {"pred_mean": jnp.mean(mlp(params, batch["x"]).astype(F32))}
    return loss, new_state, aux


def initial_model_state():
    return {"mean": jnp.array([0.5, -0.25, 1.0, 0.0], F32), "count": jnp.zeros((), jnp.int32)}


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_model_state_is_updated_on_applied_steps_and_kept_on_skips(policy):
    state = make_state(policy, model_state=initial_model_state())
    step = jax.jit(jaxamp.make_train_step(stats_loss, has_aux=True, has_model_state=True))
    batch = make_batch()
    ms0 = state.model_state
    state, m = step(state, batch)
    assert bool(m["grads_finite"])
    x = np.asarray(jaxamp.get_policy(policy).cast_to_compute(batch)["x"], np.float32)
    expected = 0.9 * np.asarray(ms0["mean"]) + 0.1 * x.mean(axis=0)
    np.testing.assert_allclose(np.asarray(state.model_state["mean"]), expected, rtol=1e-6,
                               atol=1e-7)
    assert int(state.model_state["count"]) == 1
    assert state.model_state["mean"].dtype == F32
    assert set(m) >= {"loss", "loss_scale", "grads_finite", "skipped_steps", "grad_norm",
                      "nonfinite_leaves", "aux"}
    assert m["aux"]["pred_mean"].shape == ()

    before = state
    state, m = step(state, poisoned(batch, 0))
    assert not bool(m["grads_finite"])
    assert_tree_bitwise_equal(state.model_state, before.model_state)
    assert_tree_bitwise_equal(state.params, before.params)
    assert int(state.model_state["count"]) == 1


def test_model_state_is_threaded_through_micro_batches():
    state = make_state("float32", model_state=initial_model_state())
    step = jax.jit(jaxamp.make_train_step(stats_loss, has_aux=True, has_model_state=True,
                                          accum_steps=2))
    batch = make_batch()
    ms0 = np.asarray(state.model_state["mean"])
    state, m = step(state, batch)
    x = batch["x"]
    first = 0.9 * ms0 + 0.1 * x[:8].mean(axis=0)
    expected = 0.9 * first + 0.1 * x[8:].mean(axis=0)
    np.testing.assert_allclose(np.asarray(state.model_state["mean"]), expected, rtol=1e-6,
                               atol=1e-7)
    assert int(state.model_state["count"]) == 2
    # aux is stacked over the micro-batches.
    assert m["aux"]["pred_mean"].shape == (2,)

    before = state
    state, m = step(state, poisoned(batch, 12))
    assert not bool(m["grads_finite"])
    assert_tree_bitwise_equal(state.model_state, before.model_state)


@pytest.mark.parametrize("sync", [True, False])
def test_model_state_is_averaged_over_devices_under_pmap(sync):
    """BatchNorm-style statistics stay identical on every replica, and equal the global ones."""
    state = make_state("float32", model_state=initial_model_state())
    batch = make_batch()
    step = jaxamp.make_train_step(stats_loss, has_aux=True, has_model_state=True)
    ref, _ = jax.jit(step)(state, batch)

    pstep = jax.pmap(jaxamp.make_train_step(stats_loss, has_aux=True, has_model_state=True,
                                            axis_name="batch", sync_model_state=sync),
                     axis_name="batch")
    out, _ = pstep(jaxamp.parallel.replicate(state), jaxamp.parallel.shard_batch(batch))
    means = np.asarray(out.model_state["mean"])
    assert means.shape == (N_DEVICES, 4)
    assert np.asarray(out.model_state["count"]).tolist() == [1] * N_DEVICES
    if sync:
        assert (means == means[0]).all()
        np.testing.assert_allclose(means[0], np.asarray(ref.model_state["mean"]), rtol=1e-6)
    else:
        assert not (means == means[0]).all()


def test_a_second_init_survives_the_donation_of_the_first_state():
    """Each init hands out its own buffers, the loss scale's included."""
    tx = jaxamp.mixed_precision(optax.adam(1e-2), "mixed_float16",
                                loss_scale=jaxamp.DynamicLossScale(2.0 ** 4))
    step = jax.jit(jaxamp.make_train_step(mse_loss), donate_argnums=0)
    batch = make_batch()
    first, _ = step(jaxamp.TrainState.create(params=init_params(), tx=tx), batch)
    second, m = step(jaxamp.TrainState.create(params=init_params(), tx=tx), batch)
    assert bool(m["grads_finite"])
    assert_tree_bitwise_equal(first, second)


def test_loss_with_model_state_only():
    def loss_fn(params, batch, model_state):
        loss, new_state, _ = stats_loss(params, batch, model_state)
        return loss, new_state

    state = make_state("mixed_bfloat16", model_state=initial_model_state())
    state, m = jax.jit(jaxamp.make_train_step(loss_fn, has_model_state=True))(state,
                                                                               make_batch())
    assert int(state.model_state["count"]) == 1
    assert "aux" not in m


def dropout_loss(params, batch, rng):
    h = hidden(params, batch["x"])
    keep = jax.random.bernoulli(rng, 0.5, h.shape)
    h = jnp.where(keep, h * 2, jnp.zeros_like(h))
    pred = (h @ params["dense2"]["kernel"] + params["dense2"]["bias"])[:, 0].astype(F32)
    loss = jnp.mean((pred - batch["y"].astype(F32)) ** 2)
    return loss, {"key": jax.random.key_data(rng), "kept": jnp.mean(keep.astype(F32))}


def test_rng_differs_between_steps_and_the_state_key_is_unchanged():
    key = jax.random.key(42)
    state = make_state("mixed_bfloat16", rng=key)
    step = jax.jit(jaxamp.make_train_step(dropout_loss, has_aux=True, has_rng=True))
    batch = make_batch()
    keys = []
    for _ in range(3):
        state, m = step(state, batch)
        keys.append(np.asarray(m["aux"]["key"]))
        assert bool(m["grads_finite"])
        assert 0.0 < float(m["aux"]["kept"]) < 1.0
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(state.rng)),
                                      np.asarray(jax.random.key_data(key)))
    assert not np.array_equal(keys[0], keys[1])
    assert not np.array_equal(keys[1], keys[2])
    assert not np.array_equal(keys[0], np.asarray(jax.random.key_data(key)))

    # The same state and batch give the same key: the step is a pure function.
    fresh = make_state("mixed_bfloat16", rng=key)
    _, m1 = step(fresh, batch)
    _, m2 = step(fresh, batch)
    np.testing.assert_array_equal(np.asarray(m1["aux"]["key"]), keys[0])
    np.testing.assert_array_equal(np.asarray(m2["aux"]["key"]), keys[0])


def test_rng_differs_between_micro_batches_and_devices():
    key = jax.random.key(7)
    state = make_state("float32", rng=key)
    batch = make_batch()
    step = jax.jit(jaxamp.make_train_step(dropout_loss, has_aux=True, has_rng=True,
                                          accum_steps=2))
    _, m = step(state, batch)
    keys = np.asarray(m["aux"]["key"])
    assert keys.shape[0] == 2
    assert not np.array_equal(keys[0], keys[1])

    rstate, metrics = run_pmap(state, batch, 1, loss_fn=dropout_loss, has_aux=True,
                               has_rng=True)
    device_keys = np.asarray(metrics[0]["aux"]["key"])
    assert device_keys.shape[0] == N_DEVICES
    assert len({k.tobytes() for k in device_keys}) == N_DEVICES
    # Gradients are still averaged: every replica holds the same params.
    assert_replicas_identical(rstate.params)


def test_has_rng_without_a_key_raises():
    state = make_state("float32")
    step = jax.jit(jaxamp.make_train_step(dropout_loss, has_aux=True, has_rng=True))
    with pytest.raises(ValueError, match="rng"):
        step(state, make_batch())


# --------------------------------------------------------------------------------------------
# reduce_dtype
# --------------------------------------------------------------------------------------------

def test_bfloat16_reduction_under_pmap_is_close_to_fp32():
    batch = make_batch()
    state = make_state("float32")
    f32_state, _ = run_pmap(state, batch, 5)
    bf16_state, m = run_pmap(state, batch, 5, reduce_dtype=jnp.bfloat16)
    assert np.all(np.asarray(m[-1]["grads_finite"]))
    f32_state = jaxamp.parallel.unreplicate(f32_state)
    bf16_state = jaxamp.parallel.unreplicate(bf16_state)
    assert_tree_allclose(bf16_state.master_params, f32_state.master_params, rtol=0, atol=2e-3)
    for leaf in jax.tree.leaves(bf16_state.master_params):
        assert leaf.dtype == F32


# --------------------------------------------------------------------------------------------
# Compiled once, whatever the loss scale does
# --------------------------------------------------------------------------------------------

def expected_scales(initial, poisoned_steps, n, growth_interval, max_scale):
    """The scale used at each step, by the documented rule (x2 on the n-th finite, /2 on inf)."""
    scale, tracker, used = initial, 0, []
    for i in range(n):
        used.append(scale)
        if i in poisoned_steps:
            scale, tracker = scale / 2, 0
        else:
            tracker += 1
            if tracker >= growth_interval:
                scale, tracker = min(scale * 2, max_scale), 0
    return used


def test_step_compiles_once_while_the_scale_grows_backs_off_and_skips():
    scale = jaxamp.DynamicLossScale(loss_scale=2.0**4, growth_interval=3, max_scale=2.0**10)
    state = make_state("mixed_float16", inner=optax.adam(1e-3), loss_scale=scale)
    jitted = jax.jit(jaxamp.make_train_step(mse_loss))
    batch = make_batch()
    poisoned_steps = {5, 6, 17, 30, 31, 32, 45}
    bad = poisoned(batch, 3)
    scales, finite = [], []
    for i in range(50):
        state, m = jitted(state, bad if i in poisoned_steps else batch)
        scales.append(float(m["loss_scale"]))
        finite.append(bool(m["grads_finite"]))
    assert jitted._cache_size() == 1
    assert finite == [i not in poisoned_steps for i in range(50)]
    assert scales == expected_scales(2.0**4, poisoned_steps, 50, 3, 2.0**10)
    assert max(scales) == 2.0**10
    assert any(b < a for a, b in zip(scales, scales[1:], strict=False))
    assert int(m["skipped_steps"]) == len(poisoned_steps)
    assert int(mp_state(state).health.applied_steps) == 50 - len(poisoned_steps)
    assert int(state.step) == 50


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------

def test_metric_values():
    scale = jaxamp.DynamicLossScale(loss_scale=8.0, growth_interval=1)
    state = make_state("float32", inner=optax.sgd(0.1), loss_scale=scale)
    step = jax.jit(jaxamp.make_train_step(mse_loss))
    batch = make_batch()
    reference = jax.jit(lambda p, b: (mse_loss(p, b), optax.tree.norm(jax.grad(mse_loss)(p, b))))
    for expected_scale in (8.0, 16.0, 32.0):
        true_loss, true_norm = reference(state.params, batch)
        state, m = step(state, batch)
        np.testing.assert_allclose(float(m["loss"]), float(true_loss), rtol=1e-6)
        assert float(m["loss_scale"]) == expected_scale
        assert m["loss_scale"].dtype == F32
        np.testing.assert_allclose(float(m["grad_norm"]), float(true_norm), rtol=1e-5)
        assert bool(m["grads_finite"])
        assert int(m["skipped_steps"]) == 0
        assert int(m["nonfinite_leaves"]) == 0
        assert m["loss"].dtype == F32 and m["grad_norm"].dtype == F32


def test_loss_metric_is_the_unscaled_fp32_loss_of_the_working_params():
    policy = jaxamp.get_policy("mixed_float16")
    state = make_state(policy, loss_scale=jaxamp.StaticLossScale(2.0**6))
    batch = make_batch()
    expected = mse_loss(state.params, policy.cast_to_compute(batch))
    _, m = jax.jit(jaxamp.make_train_step(mse_loss))(state, batch)
    assert m["loss"].dtype == F32
    np.testing.assert_allclose(float(m["loss"]), float(expected), rtol=1e-3)
    assert float(m["loss_scale"]) == 2.0**6


def nan_two_leaves_loss(params, batch):
    """A loss whose gradient is nan in exactly two leaves (dense2's kernel and bias)."""
    term = jnp.mean(batch["nanfield"].astype(F32)) * (
        jnp.sum(params["dense2"]["kernel"].astype(F32))
        + jnp.sum(params["dense2"]["bias"].astype(F32)))
    return mse_loss(params, batch) + term


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_nonfinite_leaves_counts_the_leaves_with_inf_or_nan(policy):
    state = make_state(policy)
    step = jax.jit(jaxamp.make_train_step(nan_two_leaves_loss))
    batch = dict(make_batch(), nanfield=np.zeros((BATCH,), np.float32))
    state, m = step(state, batch)
    assert bool(m["grads_finite"]) and int(m["nonfinite_leaves"]) == 0
    before = state
    state, m = step(state, poisoned(batch, 4, np.nan, field="nanfield"))
    assert int(m["nonfinite_leaves"]) == 2
    assert not bool(m["grads_finite"])
    assert int(m["skipped_steps"]) == 1
    assert_tree_bitwise_equal(state.params, before.params)
    assert_tree_bitwise_equal(state.master_params, before.master_params)


# --------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------

def test_accum_steps_that_do_not_divide_the_batch_raise():
    step = jax.jit(jaxamp.make_train_step(mse_loss, accum_steps=3))
    with pytest.raises(ValueError) as info:
        step(make_state(), make_batch())
    assert "accum_steps" in str(info.value)
    assert "16" in str(info.value)


@pytest.mark.parametrize("accum_steps", [0, -1])
def test_accum_steps_below_one_raise(accum_steps):
    with pytest.raises(ValueError, match="accum_steps"):
        jaxamp.make_train_step(mse_loss, accum_steps=accum_steps)


def test_non_scalar_loss_raises():
    step = jax.jit(jaxamp.make_train_step(per_example_loss))
    with pytest.raises(ValueError, match="scalar"):
        step(make_state(), make_batch())


def test_integer_loss_raises():
    def int_loss(params, batch):
        return jnp.sum(batch["label"])

    step = jax.jit(jaxamp.make_train_step(int_loss))
    batch = dict(make_batch(), label=np.arange(BATCH, dtype=np.int32))
    with pytest.raises(TypeError):
        step(make_state(), batch)


def test_unbound_axis_name_under_jit_raises():
    step = jax.jit(jaxamp.make_train_step(mse_loss, axis_name="batch"))
    with pytest.raises(ValueError, match="batch"):
        step(make_state(), make_batch())


def test_train_state_policy_must_match_the_transform():
    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_bfloat16")
    with pytest.raises(ValueError):
        jaxamp.TrainState.create(params=init_params(), tx=tx, policy="mixed_float16")
    with pytest.raises(ValueError):
        jaxamp.TrainState.create(params=init_params(), tx=tx, policy="float32")
    state = jaxamp.TrainState.create(params=init_params(), tx=tx, policy="mixed_bfloat16")
    assert state.params["dense1"]["kernel"].dtype == BF16
    assert state.master_params["dense1"]["kernel"].dtype == F32


def test_create_casts_params_and_keeps_the_master_in_fp32():
    params = init_params()
    state = make_state("mixed_float16")
    assert_tree_bitwise_equal(state.master_params, params)
    assert_tree_bitwise_equal(state.params,
                              jax.tree.map(lambda x: x.astype(F16), params))
    assert float(state.loss_scale) == 2.0**16
    assert int(state.step) == 0


# --------------------------------------------------------------------------------------------
# The half-precision promotion warning
# --------------------------------------------------------------------------------------------

def promoting_loss(params, batch):
    h = hidden(params, batch["x"])
    h = h * jnp.ones((8,), F32)  # an fp32 constant promotes the next matmul to fp32
    pred = (h @ params["dense2"]["kernel"] + params["dense2"]["bias"])[:, 0]
    return jnp.mean((pred.astype(F32) - batch["y"].astype(F32)) ** 2)


def clean_loss(params, batch):
    return jnp.mean(per_example_loss(params, batch))


def _trace_and_collect_warnings(loss_fn, policy, **kwargs):
    state = make_state(policy)
    step = jax.jit(jaxamp.make_train_step(loss_fn, **kwargs))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(state, make_batch())
    return [w for w in caught if issubclass(w.category, UserWarning)]


def test_fp32_matmul_under_a_half_precision_policy_warns():
    caught = _trace_and_collect_warnings(promoting_loss, "mixed_bfloat16")
    assert caught, "expected a UserWarning about an fp32 matmul"
    assert any("float32" in str(w.message) for w in caught)


def promoting_grouped_loss(params, batch):
    """The second layer as a two-expert grouped matmul (``ragged_dot``), promoted to fp32."""
    h = hidden(params, batch["x"]) * jnp.ones((8,), F32)
    experts = jnp.stack([params["dense2"]["kernel"]] * 2)
    half = h.shape[0] // 2
    pred = jax.lax.ragged_dot(h, experts.astype(F32),
                              jnp.array([half, h.shape[0] - half], jnp.int32))[:, 0]
    return jnp.mean((pred - batch["y"].astype(F32)) ** 2)


def test_fp32_grouped_matmul_warns_too():
    caught = _trace_and_collect_warnings(promoting_grouped_loss, "mixed_bfloat16")
    assert any("ragged_dot" in str(w.message) for w in caught), [str(w.message) for w in caught]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_clean_loss_does_not_warn(policy):
    assert _trace_and_collect_warnings(clean_loss, policy) == []


@pytest.mark.parametrize("autocast", [False, True])
def test_the_step_traces_the_loss_once_with_the_fp32_matmul_warning_on(autocast):
    calls = []

    def loss_fn(params, batch):
        calls.append(1)
        return mse_loss(params, batch)

    state = make_state("mixed_bfloat16")
    jax.jit(jaxamp.make_train_step(loss_fn, autocast=autocast)).lower(state, make_batch())
    assert len(calls) == 1


def _remats_and_matmul_dtypes(autocast):
    state = make_state("mixed_bfloat16")
    step = jaxamp.make_train_step(mse_loss, autocast=autocast, warn_fp32_matmuls=False)
    jaxpr = jax.make_jaxpr(step)(state, make_batch())
    eqns = [e for e, _ in _jaxpr.walk(jaxpr.jaxpr)]
    remats = sum(e.primitive.name in ("checkpoint", "remat", "remat2") for e in eqns)
    dtypes = {str(e.invars[0].aval.dtype) for e in eqns if e.primitive.name == "dot_general"
              and "helpers.py" in _jaxpr.where(e)}           # the loss's, forward and backward
    return remats, dtypes


def test_the_step_takes_autocasts_options_as_a_dict():
    remats, dtypes = _remats_and_matmul_dtypes(True)
    assert remats > 0 and dtypes == {"bfloat16"}
    remats, _ = _remats_and_matmul_dtypes({"recompute": False})   # the model's remat decides
    assert remats == 0
    _, dtypes = _remats_and_matmul_dtypes({"rules": {"dot_general": "float32"}})
    assert dtypes == {"float32"}
    objective = jaxamp.make_train_step(mse_loss, autocast={"recompute": False}).objective
    assert objective.autocast == {"recompute": False}


@pytest.mark.parametrize("autocast,error,match", [
    ({"policy": "mixed_float16"}, TypeError, r"options rules, fp32_scopes, recompute; got "
                                             r"'policy' \(the policy is the train state's\)"),
    ({"rules": {"exp": "fast"}}, ValueError, "unknown autocast rule 'fast'"),
    ("yes", TypeError, "autocast must be True, False or a dict"),
])
def test_bad_autocast_options_are_refused_when_the_step_is_built(autocast, error, match):
    with pytest.raises(error, match=match):
        jaxamp.make_train_step(mse_loss, autocast=autocast)


def test_promotion_warning_can_be_turned_off_and_is_silent_in_fp32():
    assert _trace_and_collect_warnings(promoting_loss, "mixed_bfloat16",
                                       warn_fp32_matmuls=False) == []
    assert _trace_and_collect_warnings(promoting_loss, "float32") == []


def test_a_mixed_policy_needs_a_mixed_precision_transform():
    with pytest.raises(ValueError, match="mixed_precision"):
        jaxamp.TrainState.create(params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
                                 policy="mixed_bfloat16")


def test_a_plain_optax_transform_trains_in_float32_and_skips_non_finite_steps():
    """``TrainState.create`` wraps a plain optax transform in ``mixed_precision(tx,
    "float32")``: one path for every step, with the same skip and counters; the inner state is
    optax's own."""
    sgd = optax.sgd(0.1)
    state = jaxamp.TrainState.create(params={"w": jnp.ones(3)}, tx=sgd)
    mp = mp_state(state)
    assert str(mp.policy) == str(jaxamp.get_policy("float32"))
    assert isinstance(mp.loss_scale, jaxamp.NoOpLossScale)
    assert jax.tree.structure(mp.inner_state) == jax.tree.structure(sgd.init({"w": jnp.ones(3)}))

    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    step = jax.jit(jaxamp.make_train_step(loss_fn))
    batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros(4)}
    state, m = step(state, batch)
    assert bool(m["grads_finite"]) and float(m["loss_scale"]) == 1.0
    np.testing.assert_allclose(state.params["w"], 1.0 - 0.1 * 2 * 3.0, rtol=1e-6)
    before = state
    state, m = step(state, {"x": batch["x"].at[0, 0].set(jnp.inf), "y": batch["y"]})
    assert not bool(m["grads_finite"]) and int(m["skipped_steps"]) == 1
    assert_tree_bitwise_equal(state.params, before.params)
    assert_tree_bitwise_equal(mp_state(state).inner_state, mp_state(before).inner_state)


def test_a_state_built_by_hand_around_a_plain_optax_state_is_refused():
    params = {"w": jnp.ones(3)}
    state = jaxamp.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                              opt_state=optax.sgd(0.1).init(params), tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match="holds no jaxamp.mixed_precision state: build the "
                                         "state with jaxamp.TrainState.create"):
        jaxamp.make_train_step(mse_loss)(state, make_batch())


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_the_state_can_be_donated(policy):
    # With equal dtypes the master must still be its own buffer, or donation fails.
    state = jaxamp.TrainState.create(params={"w": jnp.ones(3)},
                                     tx=jaxamp.mixed_precision(optax.sgd(0.1), policy))

    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"]).astype(jnp.float32) ** 2)

    step = jax.jit(jaxamp.make_train_step(loss_fn), donate_argnums=0)
    for _ in range(2):
        state, m = step(state, {"x": jnp.ones((4, 3))})
    assert bool(m["grads_finite"]) and int(state.step) == 2


# --------------------------------------------------------------------------------------------
# Params with None leaves (Equinox's eqx.partition, hand-written trees)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["float32", "bfloat16", "mixed_bfloat16", "mixed_float16"])
def test_params_with_none_leaves_train_under_every_policy(policy):
    params = {"w": jnp.full((4,), 0.5, F32), "act": None, "layer": {"b": jnp.zeros(()),
                                                                    "name": None}}

    def loss_fn(p, batch):
        assert p["act"] is None and p["layer"]["name"] is None
        pred = (batch["x"] @ p["w"] + p["layer"]["b"]).astype(F32)
        return jnp.mean((pred - batch["y"].astype(F32)) ** 2)

    tx = optax.adam(1e-2)
    tx = tx if policy in ("float32", "bfloat16") else jaxamp.mixed_precision(tx, policy)
    state = jaxamp.TrainState.create(params=params, tx=tx, policy=policy)
    step = jax.jit(jaxamp.make_train_step(loss_fn, warn_fp32_matmuls=False))
    first = None
    for _ in range(20):
        state, m = step(state, make_batch())
        first = float(m["loss"]) if first is None else first
    assert float(m["loss"]) < first
    assert state.params["act"] is None and state.params["layer"]["name"] is None
    assert state.master_params["act"] is None
    compute = jaxamp.get_policy(policy).compute_dtype
    assert state.params["w"].dtype == compute
    # Non-finite gradients are found, and their leaf named, with the None leaves left out.
    state, m = step(state, {**make_batch(), "poison": None,
                            "y": np.full((16,), np.inf, np.float32)})
    assert not bool(m["grads_finite"])
    assert nonfinite_leaf_path(state.params, m["first_nonfinite_leaf"]) == "layer/b"


def test_an_equinox_mlp_trains_through_mixed_precision_and_make_train_step():
    import equinox as eqx

    model = eqx.nn.MLP(in_size=4, out_size=1, width_size=16, depth=2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    assert any(x is None for x in jax.tree.leaves(params, is_leaf=lambda x: x is None))

    def loss_fn(params, batch):
        net = eqx.combine(params, static)
        pred = jax.vmap(net)(batch["x"])[:, 0].astype(F32)
        return jnp.mean((pred - batch["y"]) ** 2)

    tx = jaxamp.mixed_precision(optax.adam(1e-2), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=params, tx=tx)
    assert all(x.dtype == BF16 for x in jax.tree.leaves(state.params))
    assert all(x.dtype == F32 for x in jax.tree.leaves(state.master_params))
    step = jax.jit(jaxamp.make_train_step(loss_fn))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every matmul runs in bf16: no promotion warning
        losses = []
        for _ in range(60):
            state, m = step(state, make_batch())
            losses.append(float(m["loss"]))
    assert losses[-1] < 0.5 * losses[0]
    report = jaxamp.audit_grad(loss_fn, state.params, policy_batch(make_batch()))
    assert report.share("bfloat16") == 1.0
    trained = eqx.combine(jaxamp.get_policy("mixed_bfloat16").cast_to_param(state.params),
                          static)
    assert trained(jnp.ones(4)).dtype == F32


def policy_batch(batch):
    return jaxamp.get_policy("mixed_bfloat16").cast_to_compute(batch)


@pytest.mark.usefixtures("strict_promotion")
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_the_step_is_promotion_clean(policy, accum_steps):
    """jaxamp's own arithmetic in the step (scaling, accumulation, the skip, the metrics) runs
    under strict promotion; optax's inside the inner transform runs under standard."""
    tx = jaxamp.mixed_precision(standard_promotion(optax.adam(1e-2)), policy)
    state = jaxamp.TrainState.create(params=init_params(), tx=tx)
    step = jax.jit(jaxamp.make_train_step(mse_loss, accum_steps=accum_steps,
                                          warn_fp32_matmuls=False))
    for _ in range(2):
        state, m = step(state, make_batch())
    assert bool(m["grads_finite"]) and np.isfinite(float(m["loss"]))


# --------------------------------------------------------------------------------------------
# The gradients in the order the backward pass makes them
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nested", [False, True], ids=["inline", "jitted_model"])
def test_made_order_follows_the_backward_pass(nested):
    """The last layer's gradients are made first, the first layer's last, also when the
    whole backward pass is one nested jitted call."""
    from jaxamp import _jaxpr

    model = jax.jit(mlp) if nested else mlp

    def loss(params, x):
        return jnp.sum(model(params, x) ** 2)

    params, x = init_params(n_out=3), make_batch()["x"]
    _, order = _jaxpr.run_traced(jax.value_and_grad(loss), params, x)
    # The same values as the gradient itself, compiled (eagerly, each op runs on its own, and
    # a newer JAX's eager gradient rounds one kernel entry differently by an ulp).
    ran = jax.jit(lambda p, x: _jaxpr.run_traced(jax.value_and_grad(loss), p, x)[0])(params, x)
    assert_tree_bitwise_equal(ran, jax.jit(jax.value_and_grad(loss))(params, x))
    ranks = order[1]
    # dense2's bias, then its kernel (the dot's transpose), then dense1's bias and kernel
    assert (ranks["dense2"]["bias"] < ranks["dense2"]["kernel"] < ranks["dense1"]["bias"]
            < ranks["dense1"]["kernel"]), ranks


def _barrier_operand_shapes(lowered_text: str) -> list[list[str]]:
    import re
    return [re.findall(r"tensor<([0-9x]+)x(?:f32|bf16|f16)>", line.split(" : ")[-1])
            for line in lowered_text.splitlines() if "stablehlo.optimization_barrier" in line]


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_the_step_hands_on_its_gradients_in_the_order_they_are_made(policy):
    """Each gradient waits for the one made before it (an optimization barrier), so that
    XLA's scheduler makes each weight gradient as the backward pass reaches its layer even
    though the update waits for all of them (BENCHMARKS.md: ResNet-50 on an H200). The
    values are the step's as before: the barriers are identities."""
    tx = jaxamp.mixed_precision(optax.adam(1e-2), policy)
    state = jaxamp.TrainState.create(params=init_params(n_out=3), tx=tx)
    batch = make_batch()
    batch["y"] = np.repeat(batch["y"][:, None], 3, axis=1)

    def loss_fn(params, batch):
        h = jnp.tanh(batch["x"] @ params["dense1"]["kernel"] + params["dense1"]["bias"])
        pred = (h @ params["dense2"]["kernel"] + params["dense2"]["bias"]).astype(F32)
        return jnp.mean((pred - batch["y"]) ** 2)

    step = jaxamp.make_train_step(loss_fn, warn_fp32_matmuls=False)
    text = jax.jit(step).lower(state, batch).as_text()
    # b2 is made first; then W2 waits for b2, b1 for W2, W1 for b1
    assert _barrier_operand_shapes(text) == [["8x3", "3"], ["8", "8x3"], ["4x8", "8"]]
    new_state, m = jax.jit(step)(state, batch)
    grads = jax.grad(lambda p: loss_fn(jaxamp.get_policy(policy).cast_to_compute(p),
                                       jaxamp.get_policy(policy).cast_to_compute(batch)))(
        state.params)
    assert bool(m["grads_finite"])
    norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
    np.testing.assert_allclose(float(m["grad_norm"]), norm,
                               rtol=1e-6 if policy == "float32" else 1e-2)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_the_gradient_order_changes_no_value(policy, monkeypatch):
    """Three steps with the gradients handed on in order equal, bit for bit, the same steps
    with them handed on as they come (the barriers are identities)."""
    from jaxamp._step import _train_step
    tx = jaxamp.mixed_precision(optax.adam(1e-2), policy)

    def run():
        state = jaxamp.TrainState.create(params=init_params(), tx=tx)
        step = jax.jit(jaxamp.make_train_step(mse_loss, warn_fp32_matmuls=False))
        metrics = []
        for seed in range(3):
            state, m = step(state, make_batch(seed=seed))
            metrics.append(m)
        return state, metrics

    ordered = run()
    monkeypatch.setattr(_train_step, "in_made_order", lambda grads, order: grads)
    assert_tree_bitwise_equal(run(), ordered)


def test_each_build_of_a_step_is_traced_on_its_own():
    """A step is its own function, as a closure is: ``jax.jit`` of two builds of one loss
    traces each (a loss that reads global state, as a test's patch, gets its new value)."""
    traces = []

    def loss_fn(params, batch):
        traces.append(1)
        return mse_loss(params, batch)

    state = jaxamp.TrainState.create(
        params=init_params(), tx=jaxamp.mixed_precision(optax.sgd(0.1), "mixed_bfloat16"))
    objective = jaxamp.Objective(loss_fn)
    steps = [jaxamp.make_train_step(objective) for _ in range(2)]  # both alive
    for step in steps:
        jax.jit(step)(state, make_batch())
    assert len(traces) == 2


def test_autocast_with_an_optimizer_mixed_precision_does_not_wrap_warns_at_trace_time():
    """It trained silently in fp32 (the audit's bf16 share 0.0)."""
    state = jaxamp.TrainState.create(params=init_params(), tx=optax.sgd(0.1))
    step = jaxamp.make_train_step(mse_loss, autocast=True)
    with pytest.warns(UserWarning, match=r"does not wrap: the state's policy is float32.*"
                                         r"jaxamp.mixed_precision\(tx, \"mixed_bfloat16\"\)"):
        jax.jit(step).lower(state, make_batch())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(jaxamp.make_train_step(mse_loss)).lower(state, make_batch())


def _stateful(params, batch, model_state):
    return mse_loss(params, batch), model_state


def _with_rng(params, batch, *, rng):
    return mse_loss(params, batch)


@pytest.mark.parametrize("loss_fn,flags,match", [
    (_stateful, {}, r"_stateful\(params, batch, model_state\) requires model_state=, which the "
                    r"step hands it only with has_model_state=True: pass has_model_state=True"),
    (_with_rng, {}, r"requires rng=.*pass has_rng=True"),
    (mse_loss, {"has_model_state": True}, r"has_model_state=True hands loss_fn model_state=, "
                                          r"but mse_loss\(params, batch\) takes no model_state"),
    (mse_loss, {"has_rng": True}, r"has_rng=True hands loss_fn rng=.*takes no rng argument"),
])
def test_a_flag_the_loss_signature_contradicts_is_named_when_the_step_is_built(loss_fn, flags,
                                                                               match):
    """A BatchNorm model without has_model_state=True gave nine frames of internals and
    ``TypeError: loss_fn() missing 1 required positional argument: 'model_state'``."""
    with pytest.raises(TypeError, match=match):
        jaxamp.make_train_step(loss_fn, **flags)


def test_a_loss_that_returns_a_tuple_without_has_aux_is_named():
    def loss_fn(params, batch):
        return mse_loss(params, batch), {"mae": 0.0}
    state = make_state("mixed_bfloat16")
    with pytest.raises(ValueError, match=r"returned a tuple of 2 with has_aux=False and "
                                         r"has_model_state=False.*needs has_aux=True"):
        jax.jit(jaxamp.make_train_step(loss_fn)).lower(state, make_batch())
    # a loss with **kwargs, or a default, is taken as it is
    jaxamp.make_train_step(lambda params, batch, **kw: mse_loss(params, batch))
    jaxamp.make_train_step(lambda params, batch, model_state=None: mse_loss(params, batch))


# --------------------------------------------------------------------------------------------
# retry_on_overflow: an overflow that costs no update
# --------------------------------------------------------------------------------------------

def _overflowing_state(scale=2.0**20, **kw):
    """fp16 gradients of the MLP overflow at 2**20 and at each half of it down to 2**17: the
    step at 2**16 is the first finite one (four backoffs)."""
    return make_state("mixed_float16", inner=optax.adam(1e-2),
                      loss_scale=jaxamp.DynamicLossScale(loss_scale=scale, **kw))


def test_the_overflowing_scale_needs_four_backoffs():
    _, metrics = run_jit(_overflowing_state(), make_batch(), 6)
    assert [bool(m["grads_finite"]) for m in metrics] == [False] * 4 + [True] * 2
    assert float(metrics[-1]["loss_scale"]) == 2.0**16


@pytest.mark.parametrize("layout", ["jit", "pmap", "sharded jit", "accumulation"])
def test_retry_on_overflow_applies_every_step_as_fp32_does(layout):
    """Each overflow is retried within its step: the run applies as many updates as the fp32
    run, where the run without retries skips its first steps; the scale backs off as those
    skips backed it off, and the retries are counted."""
    batch, steps = make_batch(), 4
    run = {"jit": run_jit, "pmap": run_pmap, "sharded jit": run_jit_sharded,
           "accumulation": lambda *a, **k: run_jit(*a, accum_steps=2, **k)}[layout]

    def on_one(state, metrics):
        if layout != "pmap":
            return state, metrics
        assert_replicas_identical(state)
        return jaxamp.parallel.unreplicate(state), [jax.tree.map(lambda x: x[0], m)
                                                    for m in metrics]
    skipping, skip_metrics = on_one(*run(_overflowing_state(), batch, steps + 8))
    skips = int(mp_state(skipping).health.skipped_steps)
    assert skips >= 4 and not any(bool(m["grads_finite"]) for m in skip_metrics[:skips])
    state, metrics = on_one(*run(_overflowing_state(), batch, steps, retry_on_overflow=8))
    fp32, _ = run_jit(make_state("float32", inner=optax.adam(1e-2)), batch, steps)
    health = mp_state(state).health
    assert int(health.applied_steps) == int(mp_state(fp32).health.applied_steps) == steps
    assert int(health.skipped_steps) == 0
    assert [int(m["retries"]) for m in metrics] == [skips, 0, 0, 0]
    assert [float(m["loss_scale"]) for m in metrics] == [
        float(skip_metrics[skips]["loss_scale"])] * steps
    assert all(bool(m["grads_finite"]) for m in metrics)
    # A retry is the step it stands for: the first step is the one taken at the backed-off
    # scale outright (up to XLA's fusion of the loop's body: fp16 gradients).
    retried, _ = on_one(*run(_overflowing_state(), batch, 1, retry_on_overflow=8))
    outright, _ = on_one(*run(_overflowing_state(2.0**20 / 2**skips), batch, 1))
    mp_r, mp_o = mp_state(retried), mp_state(outright)
    assert float(mp_r.loss_scale.loss_scale) == float(mp_o.loss_scale.loss_scale)
    assert_tree_allclose((retried.params, mp_r.master.params, mp_r.inner_state),
                         (outright.params, mp_o.master.params, mp_o.inner_state),
                         rtol=2e-3, atol=1e-6)


def test_overflow_retry_counts_zero_on_a_step_at_the_scale_that_holds():
    state, metrics = run_jit(_overflowing_state(2.0**10), make_batch(), 2,
                             retry_on_overflow=3)
    assert [int(m["retries"]) for m in metrics] == [0, 0]
    assert int(mp_state(state).health.applied_steps) == 2


def test_a_step_that_still_overflows_after_its_retries_is_skipped_bit_for_bit():
    """An inf in the batch overflows at every scale: after 2 retries the step is skipped, its
    state as it was but the scale, backed off three times (twice retrying, once skipping)."""
    state = _overflowing_state(2.0**10)
    step = jax.jit(jaxamp.make_train_step(mse_loss, retry_on_overflow=2))
    new, m = step(state, poisoned(make_batch(), 0))
    assert not bool(m["grads_finite"]) and int(m["retries"]) == 2
    assert float(m["loss_scale"]) == 2.0**8  # the scale of the last try
    mp0, mp1 = mp_state(state), mp_state(new)
    assert float(mp1.loss_scale.loss_scale) == 2.0**7
    assert_tree_bitwise_equal((new.params, mp1.master, mp1.inner_state),
                              (state.params, mp0.master, mp0.inner_state))
    assert int(mp1.health.skipped_steps) == 1 and int(mp1.health.applied_steps) == 0


def test_no_retry_where_the_overflow_does_not_lower_the_scale():
    """With a hysteresis budget left, an overflow does not back off: the step is skipped
    (computing again at the same scale would overflow again); the next one retries."""
    state = _overflowing_state(2.0**17, hysteresis=2)
    state, metrics = run_jit(state, make_batch(), 2, retry_on_overflow=True)
    assert [bool(m["grads_finite"]) for m in metrics] == [False, True]
    assert [int(m["retries"]) for m in metrics] == [0, 1]


@pytest.mark.parametrize("value", [-1, 1.5, "yes", None])
def test_bad_retry_on_overflow_is_refused(value):
    with pytest.raises(ValueError, match="retry_on_overflow must be True, False or an int"):
        jaxamp.make_train_step(mse_loss, retry_on_overflow=value)
