"""Bit-for-bit comparison helpers shared by the tests."""

import jax
import numpy as np


def bits(x):
    """The raw bits of an array, as unsigned integers of the same width."""
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def assert_tree_bitwise_equal(a, b):
    """Same structure, same dtypes and shapes, and the same bits in every leaf."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b),
                            strict=True):
        x, y = np.asarray(x), np.asarray(y)
        where = jax.tree_util.keystr(path)
        assert x.dtype == y.dtype, where
        assert x.shape == y.shape, where
        np.testing.assert_array_equal(bits(x), bits(y), err_msg=where)
