"""Tests of jaxamp.gradients: one pass over the gradients, and the path of the first bad leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16

# The library's own arithmetic must be promotion-clean (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("strict_promotion")


def test_the_index_and_the_path_count_the_same_leaves():
    """A Python float, an int array and a None sit before the bad leaf: ``grad_stats`` and
    ``nonfinite_leaf_path`` must skip or count each the same way, or the path is wrong."""
    grads = {"a": 0.5, "b": jnp.array([1.0]), "c": jnp.arange(3), "d": None,
             "e": jnp.array([jnp.inf], jnp.bfloat16)}
    stats = jaxamp.gradients.grad_stats(grads)
    assert not bool(stats.finite) and int(stats.nonfinite_leaves) == 1
    assert int(stats.first_nonfinite_leaf) == 2  # a, b, e are the floating leaves
    assert jaxamp.gradients.nonfinite_leaf_path(grads, stats.first_nonfinite_leaf) == "e"
    assert float(jaxamp.gradients.grad_stats({"a": 3.0, "b": jnp.array([4.0])}).norm) == 5.0


def test_the_norm_of_a_scaled_fp16_gradient_does_not_overflow():
    grads = {"w": jnp.full((4,), 30000.0, jnp.float16)}  # squares overflow fp16
    stats = jaxamp.gradients.grad_stats(grads, scale=jnp.float32(1000.0))
    assert bool(stats.finite)
    np.testing.assert_allclose(float(stats.norm), 60.0, rtol=1e-6)


@pytest.mark.parametrize("spec", [P(None, "x"), P("x", None), P("x", "y")])
def test_a_sharded_gradient_is_reduced_without_gathering_it(spec):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    g = jax.device_put(jnp.arange(64.0).reshape(8, 8) - 30.0, NamedSharding(mesh, spec))
    compiled = jax.jit(lambda t: jaxamp.gradients.grad_stats(t)).lower({"g": g}).compile()
    assert " all-gather(" not in compiled.as_text()
    np.testing.assert_allclose(float(compiled({"g": g}).norm),
                               float(np.linalg.norm(np.asarray(g))), rtol=1e-6)


def test_out_of_range_index_raises():
    with pytest.raises(ValueError, match="out of range for a tree with 1 floating leaves"):
        jaxamp.gradients.nonfinite_leaf_path({"w": jnp.ones(2)}, 3)


# --------------------------------------------------------------------------------------------
# grad_stats and nonfinite_leaf_path
# --------------------------------------------------------------------------------------------

def test_grad_stats_of_a_finite_tree():
    grads = {"a": jnp.array([30.0, 40.0]), "b": {"c": jnp.array([[0.0]]), "d": jnp.zeros(3)}}
    stats = jaxamp.gradients.grad_stats(grads)
    assert isinstance(stats, jaxamp.gradients.GradStats)
    assert bool(stats.finite)
    assert float(stats.norm) == 50.0
    assert int(stats.nonfinite_leaves) == 0
    assert int(stats.first_nonfinite_leaf) == -1
    assert stats.norm.dtype == F32
    assert stats.first_nonfinite_leaf.dtype == jnp.int32 == stats.nonfinite_leaves.dtype
    # The norm is divided by the loss scale.
    assert float(jaxamp.gradients.grad_stats(grads, scale=10.0).norm) == 5.0
    assert float(jaxamp.gradients.grad_stats(grads, scale=jnp.float32(2.0**-2)).norm) == 200.0


def test_grad_stats_counts_and_finds_the_first_nonfinite_leaf():
    grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([jnp.nan]),
             "c": jnp.array([1.0, -jnp.inf]), "d": jnp.ones(2)}
    finite, norm, count, first = jaxamp.gradients.grad_stats(grads)
    assert not bool(finite)
    assert np.isnan(float(norm))
    assert int(count) == 2
    assert int(first) == 1
    assert jaxamp.gradients.nonfinite_leaf_path(grads, first) == "b"
    stats = jaxamp.gradients.grad_stats(
        {"a": jnp.ones(2), "b": jnp.ones(1), "c": jnp.array([jnp.inf])})
    assert (int(stats.nonfinite_leaves), int(stats.first_nonfinite_leaf)) == (1, 2)
    assert float(stats.norm) == np.inf


def test_grad_stats_skips_integer_leaves_in_the_index():
    grads = {"a": jnp.arange(3), "b": jnp.ones(2), "c": jnp.array([jnp.nan], F16)}
    stats = jaxamp.gradients.grad_stats(grads)
    assert int(stats.first_nonfinite_leaf) == 1
    assert jaxamp.gradients.nonfinite_leaf_path(grads, stats.first_nonfinite_leaf) == "c"
    assert int(jaxamp.gradients.grad_stats({"n": jnp.arange(3)}).first_nonfinite_leaf) == -1


def test_grad_stats_sums_half_precision_squares_in_fp32():
    # 60000**2 overflows fp16, but the squares are accumulated in fp32.
    grads = {"a": jnp.array([60000.0], F16), "b": jnp.array([3.0, 4.0], BF16)}
    stats = jaxamp.gradients.grad_stats(grads, scale=2.0)
    assert bool(stats.finite)
    assert int(stats.first_nonfinite_leaf) == -1
    np.testing.assert_allclose(float(stats.norm), np.sqrt(60000.0**2 + 25.0) / 2, rtol=1e-6)


def test_grad_stats_treats_a_huge_norm_as_an_overflow():
    stats = jaxamp.gradients.grad_stats({"a": jnp.ones(2), "b": jnp.array([2e19], F32)})
    assert not bool(stats.finite)
    assert (int(stats.nonfinite_leaves), int(stats.first_nonfinite_leaf)) == (1, 1)


def test_grad_stats_of_an_empty_tree():
    stats = jaxamp.gradients.grad_stats({})
    assert bool(stats.finite)
    assert (float(stats.norm), int(stats.nonfinite_leaves), int(stats.first_nonfinite_leaf)) == (
        0.0, 0, -1)


def test_nonfinite_leaf_path():
    tree = {"dense": {"bias": jnp.zeros(2), "kernel": jnp.zeros((2, 2))},
            "embed": [jnp.zeros(3), jnp.zeros(3, BF16)]}
    assert [jaxamp.gradients.nonfinite_leaf_path(tree, i) for i in range(4)] == [
        "dense/bias", "dense/kernel", "embed/0", "embed/1"]
    assert jaxamp.gradients.nonfinite_leaf_path(tree, -1) is None
    # Device arrays and replicated (stacked) indices are accepted.
    assert jaxamp.gradients.nonfinite_leaf_path(tree, jnp.int32(1)) == "dense/kernel"
    assert jaxamp.gradients.nonfinite_leaf_path(tree, np.array([2, 2, 2])) == "embed/0"


@pytest.mark.parametrize("index", [4, 5, 100])
def test_nonfinite_leaf_path_out_of_range_raises(index):
    tree = {"dense": {"bias": jnp.zeros(2), "kernel": jnp.zeros((2, 2))},
            "embed": [jnp.zeros(3), jnp.zeros(3)]}
    with pytest.raises(ValueError, match="out of range"):
        jaxamp.gradients.nonfinite_leaf_path(tree, index)
