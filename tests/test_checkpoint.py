"""Checkpoints: the whole TrainState round-trips through orbax, and a resumed run is
bit-identical to one that was never interrupted."""

import pathlib

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
    assert int(jaxamp.find_state(restored.opt_state).skipped_steps) == 2
    assert [x.dtype for x in jax.tree.leaves(restored)] == [x.dtype for x in jax.tree.leaves(state)]


def _by_path(tree):
    return {jaxamp.gradients.tree_path_str(p): x
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# Saved by orbax before MixedPrecisionState was nested (its fields flat): _state() and
# _state(master="kahan", moments_dtype="bfloat16") after the first 6 of _batches, 2 skipped.
FLAT_CHECKPOINTS = pathlib.Path(__file__).parent / "data" / "checkpoint-0.1"


@pytest.mark.parametrize("name, options", [
    ("float32", {}), ("kahan", {"master": "kahan", "moments_dtype": "bfloat16"})])
def test_a_checkpoint_of_the_flat_state_still_restores(step, name, options):
    """A checkpoint in the state's flat layout restores into ``flat_layout(target)``; nested
    again, each field holds the bits the checkpoint holds under its old name, and it trains
    on. (Its bits are not compared with a recomputation: they were computed by another build
    of the same program, which may round differently.)"""
    path = FLAT_CHECKPOINTS / name
    target = jaxamp.MixedPrecisionState.flat_layout(_state(**options))
    with ocp.StandardCheckpointer() as ckpt:
        restored = jaxamp.MixedPrecisionState.nested_layout(ckpt.restore(path, target))
        raw = ckpt.restore(path)  # nested dicts, by the names the checkpoint holds
    mp = jaxamp.find_state(restored.opt_state)
    assert isinstance(mp, jaxamp.MixedPrecisionState)
    assert int(mp.health.skipped_steps) == 2 and int(mp.health.applied_steps) == 4
    old = raw["opt_state"]
    assert "master" not in old and {"master_params", "skipped_steps", "stalled"} <= set(old)
    pairs = [(raw["params"], restored.params), (raw["model_state"], restored.model_state),
             (old["master_params"], mp.master.params),
             (old["inner_state"], mp.inner_state), (old["loss_scale"], mp.loss_scale)]
    pairs += [(old[f], getattr(mp.health, f)) for f in type(mp.health)._fields]
    if options:
        pairs += [(old["compensation"], mp.master.compensation),
                  (old["rounding_key"], mp.master.rounding_key)]
    for saved, now in pairs:  # leaf by leaf, by path: a checkpoint's dicts are sorted by key
        saved, now = _by_path(saved), _by_path(now)
        names = sorted(saved)
        assert names == sorted(now)
        assert_tree_bitwise_equal([saved[k] for k in names], [now[k] for k in names])
    state, metrics = step(restored, _batches(7)[6])
    assert bool(metrics["grads_finite"])
    assert int(jaxamp.find_state(state.opt_state).health.applied_steps) == 5
    # Into the nested layout itself it is refused: its paths are not the checkpoint's.
    with ocp.StandardCheckpointer() as ckpt, pytest.raises(Exception):  # noqa: B017
        ckpt.restore(path, _state(**options))


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, step):
    straight, resumed = straight_and_resumed(tmp_path, step, _batches(16), 8, _state)
    _assert_bit_identical(straight, resumed)
    assert int(jaxamp.find_state(straight.opt_state).skipped_steps) == 3


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


def test_resume_from_a_checkpoint_of_the_flat_state(tmp_path):
    """``--resume`` (``train.checkpointing.restore_latest``) reads a run's checkpoint written in
    the flat layout as it reads its own."""
    import shutil

    from train import checkpointing

    class Batches:
        position = None

        def restore(self, position):
            self.position = position

    manager = checkpointing.manager(str(tmp_path), keep=2)
    checkpointing.save(manager, 6, _state(), (6, 0))
    state_dir = tmp_path / "checkpoints" / "6" / "state"
    shutil.rmtree(state_dir)
    shutil.copytree(FLAT_CHECKPOINTS / "float32", state_dir)
    batches = Batches()
    restored, at = checkpointing.restore_latest(manager, _state(), batches)
    manager.close()
    with ocp.StandardCheckpointer() as ckpt:
        flat = ckpt.restore(FLAT_CHECKPOINTS / "float32",
                            jaxamp.MixedPrecisionState.flat_layout(_state()))
    assert (at, batches.position) == (6, (6, 0))
    _assert_bit_identical(restored, jaxamp.MixedPrecisionState.nested_layout(flat))
    assert int(jaxamp.find_state(restored.opt_state).health.skipped_steps) == 2
