"""Tests of jaxamp.parallel: laying a state and a batch out for pmap or a sharded jit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import BATCH
from helpers import init_params
from helpers import make_batch
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp

N_DEVICES = 8


def test_shard_batch_that_does_not_divide_raises():
    with pytest.raises(ValueError, match="8"):
        jaxamp.parallel.shard_batch(make_batch(n=10))
    with pytest.raises(ValueError, match="8"):
        jaxamp.parallel.put_sharded(make_batch(n=10))
    sharded = jaxamp.parallel.shard_batch(make_batch())
    assert sharded["x"].shape == (N_DEVICES, BATCH // N_DEVICES, 4)


def test_replicate_and_unreplicate_round_trip_a_whole_train_state():
    tx = jaxamp.mixed_precision(optax.adam(1e-3), "mixed_float16")
    state = jaxamp.TrainState.create(params=init_params(), tx=tx, rng=jax.random.key(3))
    replicated = jaxamp.parallel.replicate(state)
    assert jax.tree.structure(replicated) == jax.tree.structure(state)
    for x, y in zip(jax.tree.leaves(replicated), jax.tree.leaves(state), strict=True):
        assert x.shape == (N_DEVICES, *jnp.shape(y))
        assert len(x.sharding.device_set) == N_DEVICES
    back = jaxamp.parallel.unreplicate(replicated)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert back.policy == state.policy  # static data survives


def test_put_sharded_on_a_two_axis_mesh_splits_over_the_named_axes():
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    batch = jaxamp.parallel.put_sharded(make_batch(), NamedSharding(mesh, P(("data", "model"))))
    assert batch["x"].sharding.spec == P(("data", "model"))
    assert batch["x"].addressable_shards[0].data.shape == (BATCH // 8, 4)
    batch = jaxamp.parallel.put_sharded(make_batch(), jaxamp.parallel.batch_sharding(mesh, "data"))
    assert batch["x"].addressable_shards[0].data.shape == (BATCH // 4, 4)
    with pytest.raises(ValueError, match="does not split over the number of devices"):
        jaxamp.parallel.put_sharded(make_batch(n=6), jaxamp.parallel.batch_sharding(mesh, "data"))
