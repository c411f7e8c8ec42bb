"""Tests of jaxamp.gradients: one pass over the gradients, and the path of the first bad leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp

# The library's own arithmetic must be promotion-clean (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("strict_promotion")


def test_the_index_and_the_path_count_the_same_leaves():
    """A Python float, an int array and a None sit before the bad leaf: ``grad_stats`` and
    ``nonfinite_leaf_path`` must skip or count each the same way, or the path is wrong."""
    grads = {"a": 0.5, "b": jnp.array([1.0]), "c": jnp.arange(3), "d": None,
             "e": jnp.array([jnp.inf], jnp.bfloat16)}
    stats = jaxamp.grad_stats(grads)
    assert not bool(stats.finite) and int(stats.nonfinite_leaves) == 1
    assert int(stats.first_nonfinite_leaf) == 2  # a, b, e are the floating leaves
    assert jaxamp.nonfinite_leaf_path(grads, stats.first_nonfinite_leaf) == "e"
    assert float(jaxamp.grad_stats({"a": 3.0, "b": jnp.array([4.0])}).norm) == 5.0


def test_the_norm_of_a_scaled_fp16_gradient_does_not_overflow():
    grads = {"w": jnp.full((4,), 30000.0, jnp.float16)}  # squares overflow fp16
    stats = jaxamp.grad_stats(grads, scale=jnp.float32(1000.0))
    assert bool(stats.finite)
    np.testing.assert_allclose(float(stats.norm), 60.0, rtol=1e-6)


@pytest.mark.parametrize("spec", [P(None, "x"), P("x", None), P("x", "y")])
def test_a_sharded_gradient_is_reduced_without_gathering_it(spec):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    g = jax.device_put(jnp.arange(64.0).reshape(8, 8) - 30.0, NamedSharding(mesh, spec))
    compiled = jax.jit(lambda t: jaxamp.grad_stats(t)).lower({"g": g}).compile()
    assert " all-gather(" not in compiled.as_text()
    np.testing.assert_allclose(float(compiled({"g": g}).norm),
                               float(np.linalg.norm(np.asarray(g))), rtol=1e-6)


def test_out_of_range_index_raises():
    with pytest.raises(ValueError, match="out of range for a tree with 1 floating leaves"):
        jaxamp.nonfinite_leaf_path({"w": jnp.ones(2)}, 3)
