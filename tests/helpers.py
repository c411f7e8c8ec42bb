"""Helpers shared by the test modules: bitwise comparison, a tiny MLP with its losses and
batch, the reference loss-scale model, and paths. Test files import from here, never from
one another."""

import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

F32 = jnp.float32
BATCH = 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126


def covering_grid(*axes):
    """The product of ``axes`` as pytest params, every combination but a covering set marked
    slow: the i-th combination of the set takes each axis's i-th value (modulo its length), so
    `make test` runs each value of each axis once and `make test-all` the whole product."""
    width = max(len(axis) for axis in axes)
    covering = {tuple(axis[i % len(axis)] for axis in axes) for i in range(width)}
    return [pytest.param(*combo, marks=() if combo in covering else pytest.mark.slow,
                         id="-".join(map(str, combo))) for combo in itertools.product(*axes)]


def straight_and_resumed(tmp_path, step, batches, at, make_state, restore_target=None):
    """Two runs of ``step`` over ``batches`` from ``make_state()``: one straight through, one
    saved with orbax after ``at`` batches, restored onto ``restore_target`` (default: a fresh
    ``make_state()``) and run on. Returns ``(straight, resumed)``."""
    import orbax.checkpoint as ocp
    straight = make_state()
    for batch in batches:
        straight, _ = step(straight, batch)
    interrupted = make_state()
    for batch in batches[:at]:
        interrupted, _ = step(interrupted, batch)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "mid", interrupted)
    del interrupted
    with ocp.StandardCheckpointer() as ckpt:
        resumed = ckpt.restore(tmp_path / "mid", (restore_target or make_state)())
    for batch in batches[at:]:
        resumed, _ = step(resumed, batch)
    return straight, resumed


# --------------------------------------------------------------------------------------------
# Bit-for-bit comparison
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# A tiny MLP, its loss and a batch
# --------------------------------------------------------------------------------------------

def init_params(seed=0, n_out=1):
    rng = np.random.default_rng(seed)
    return {
        "dense1": {"kernel": jnp.asarray(rng.normal(size=(4, 8)) * 0.5, F32),
                   "bias": jnp.asarray(rng.normal(size=(8,)) * 0.1, F32)},
        "dense2": {"kernel": jnp.asarray(rng.normal(size=(8, n_out)) * 0.5, F32),
                   "bias": jnp.zeros((n_out,), F32)},
    }


def make_batch(seed=1, n=BATCH):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (np.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2] - x[:, 3]).astype(np.float32)
    return {"x": x, "y": y, "poison": np.ones((n,), np.float32)}


def hidden(params, x):
    return jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])


def mlp(params, x):
    return (hidden(params, x) @ params["dense2"]["kernel"] + params["dense2"]["bias"])[:, 0]


def per_example_loss(params, batch):
    pred = mlp(params, batch["x"]).astype(F32)
    return (pred - batch["y"].astype(F32)) ** 2


def mse_loss(params, batch):
    """Mean squared error in fp32, multiplied by ``batch['poison']`` (ones, or an inf)."""
    return jnp.mean(batch["poison"].astype(F32) * per_example_loss(params, batch))


def replicated_sharding():
    return NamedSharding(Mesh(np.array(jax.devices()), ("batch",)), PartitionSpec())


# --------------------------------------------------------------------------------------------
# A plain python model of GradScaler's _amp_update_scale_, with bounds and hysteresis.
# --------------------------------------------------------------------------------------------

def reference_sequence(init_scale, finite_seq, *, growth_interval, growth_factor,
                       backoff_factor, min_scale, max_scale, hysteresis, hysteresis_refill,
                       tracker=0, left=None):
    """``(scale, growth_tracker, hysteresis_left)`` after each step, from a state that starts at
    ``init_scale`` with ``tracker`` and ``left`` (default: the full hysteresis budget)."""
    scale = np.float32(init_scale)
    lo = np.float32(F32_TINY if min_scale is None else min_scale)
    hi = np.float32(F32_MAX if max_scale is None else max_scale)
    growth, backoff = np.float32(growth_factor), np.float32(backoff_factor)
    left = hysteresis if left is None else left
    out = []
    with np.errstate(over="ignore", under="ignore"):
        for finite in finite_seq:
            if finite:
                tracker += 1
                if hysteresis_refill == "finite":
                    left = hysteresis
                if tracker == growth_interval:
                    grown = np.float32(scale * growth)
                    if np.isfinite(grown):
                        scale = min(grown, hi)
                    tracker = 0
                    left = hysteresis
            else:
                tracker = 0
                left = max(left - 1, 0)
                if left == 0:
                    scale = max(np.float32(scale * backoff), lo)
            out.append((float(scale), tracker, left))
    return out


# --------------------------------------------------------------------------------------------
# The CLI's checkpoints
# --------------------------------------------------------------------------------------------

def final_state(workdir, step):
    """The raw state saved by the CLI at ``step`` under ``workdir``."""
    path = os.path.join(workdir, "checkpoints", str(step), "state")
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path)


# --------------------------------------------------------------------------------------------
# Strict dtype promotion
# --------------------------------------------------------------------------------------------

def standard_promotion(inner):
    """``inner`` with its own arithmetic under standard promotion: optax's (``1 - b1**count``
    with an int32 count) is not ours to make strict, while jaxamp's around it is."""
    inner = optax.with_extra_args_support(inner)

    def init(params):
        with jax.numpy_dtype_promotion("standard"):
            return inner.init(params)

    def update(updates, state, params=None, **extra):
        with jax.numpy_dtype_promotion("standard"):
            return inner.update(updates, state, params, **extra)
    return optax.GradientTransformationExtraArgs(init, update)


def nnx_scaled_step(loss_of_model):
    """An ``nnx.jit`` step ``step(model, optimizer) -> loss``: the gradient of
    ``jaxamp.state.scale_loss(loss_of_model(model), optimizer.opt_state)``, then
    ``optimizer.update``."""
    from flax import nnx

    import jaxamp

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            loss = loss_of_model(model)
            return jaxamp.state.scale_loss(loss, optimizer.opt_state), loss
        (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss
    return step


def read_jsonl(path):
    """The records of a JSON-lines file (what the benchmark suites write)."""
    with open(path) as f:
        return [json.loads(line) for line in f]


from processes import dying_with_its_parent  # noqa: E402, F401 - light, for child processes
