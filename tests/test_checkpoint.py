"""Checkpoints: the whole TrainState round-trips through orbax, and a resumed run is
bit-identical to one that was never interrupted."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_tree_bitwise_equal
from helpers import straight_and_resumed

import jaxamp

# Under pytest-xdist, the tests sharing a module-scoped fixture run on one worker.
pytestmark = pytest.mark.xdist_group("checkpoint")


def _loss_fn(params, batch, model_state, rng):
    keep = jax.random.bernoulli(rng, 0.9, batch["x"].shape)
    x = jnp.where(keep, batch["x"], 0) / 0.9
    h = jnp.tanh(x @ params["w1"])
    pred = (h @ params["w2"])[:, 0].astype(jnp.float32)
    new_state = {"mean": 0.9 * model_state["mean"] + 0.1 * batch["x"].mean(0).astype(jnp.float32)}
    # Poisoned examples (x == inf) overflow the loss: the step is skipped.
    return jnp.mean((pred - batch["y"]) ** 2), new_state


def _state(policy="mixed_float16", **options):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {"w1": jax.random.normal(k1, (4, 8)), "w2": jax.random.normal(k2, (8, 1))}
    scale = jaxamp.DynamicLossScale(loss_scale=2.0**10, growth_interval=3, hysteresis=2,
                                    min_scale=1.0, max_scale=2.0**14)
    tx = jaxamp.mixed_precision(optax.adamw(optax.cosine_decay_schedule(1e-2, 20)), policy,
                                loss_scale=scale, **options)
    return jaxamp.TrainState.create(params=params, tx=tx, model_state={"mean": jnp.zeros(4)},
                                    rng=jax.random.PRNGKey(1))


def _batches(n):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        x = rng.normal(size=(16, 4)).astype(np.float32)
        if i in (4, 5, 11):
            x[3, 1] = np.inf
        out.append({"x": x, "y": rng.normal(size=(16,)).astype(np.float32)})
    return out


def _assert_bit_identical(a, b):
    """Every leaf, bit for bit (the static tx differs between two created states)."""
    assert_tree_bitwise_equal(jax.tree.leaves(a), jax.tree.leaves(b))


@pytest.fixture(scope="module")
def step():
    return jax.jit(jaxamp.make_train_step(_loss_fn, has_model_state=True, has_rng=True))


def test_train_state_round_trips_through_orbax(tmp_path, step):
    state = _state()
    for batch in _batches(6):
        state, _ = step(state, batch)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", _state())
    assert isinstance(restored, jaxamp.TrainState)
    _assert_bit_identical(state, restored)
    scale = jaxamp.state.get_loss_scale(restored.opt_state)
    # Static hyperparameters come from the target; array fields from the checkpoint.
    assert (scale.hysteresis, scale.min_scale, scale.max_scale, scale.growth_interval) == (
        2, 1.0, 2.0**14, 3)
    assert int(jaxamp.state.find_state(restored.opt_state).health.skipped_steps) == 2
    assert [x.dtype for x in jax.tree.leaves(restored)] == [x.dtype for x in jax.tree.leaves(state)]


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, step):
    straight, resumed = straight_and_resumed(tmp_path, step, _batches(16), 8, _state)
    _assert_bit_identical(straight, resumed)
    assert int(jaxamp.state.find_state(straight.opt_state).health.skipped_steps) == 3


def test_restoring_another_models_checkpoint_fails_clearly(tmp_path):
    state = _state()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
    other = jaxamp.TrainState.create(
        params={"w1": jnp.zeros((4, 8)), "w2": jnp.zeros((8, 2))},
        tx=jaxamp.mixed_precision(optax.adamw(1e-2), "mixed_float16"),
        model_state={"mean": jnp.zeros(4)}, rng=jax.random.PRNGKey(1))
    with ocp.StandardCheckpointer() as ckpt, pytest.raises(Exception):  # noqa: B017
        ckpt.restore(tmp_path / "ckpt", other)
