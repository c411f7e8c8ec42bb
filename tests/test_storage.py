"""A lighter training state: ``mixed_precision(..., master=..., moments_dtype=...)`` and the
rounding functions behind it (:func:`jaxamp.rounding.stochastic_round`,
:func:`jaxamp.rounding.kahan_split`)."""

import flax.training.train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_tree_bitwise_equal
from helpers import bits
from helpers import init_params
from helpers import make_batch
from helpers import mse_loss
from helpers import nnx_scaled_step
from helpers import straight_and_resumed
from jax.extend.core import Literal
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._optimizer._storage import nudge_ties
from jaxamp.rounding import kahan_join

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
MASTERS = jaxamp.state.MASTERS
MOMENTS = [None, "bfloat16"]


def _state(master, moments_dtype=None, policy="mixed_bfloat16", inner=None, seed=0, **kw):
    tx = jaxamp.mixed_precision(inner or optax.adam(1e-2), policy, master=master,
                                moments_dtype=moments_dtype, seed=seed, **kw)
    return jaxamp.TrainState.create(params=init_params(), tx=tx)


def _poisoned(batch, where=0):
    poison = np.ones_like(batch["poison"])
    poison[where] = np.inf
    return dict(batch, poison=poison)


# --------------------------------------------------------------------------------------------
# The rounding functions
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_stochastic_round_picks_a_neighbour_and_is_exact_in_expectation(dtype):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=64) * 10.0 ** rng.integers(-3, 3, 64),
                        [1.0 + 2.0**-10, -(1.0 + 2.0**-10), 3e-5, 6e-8]]).astype(np.float32)
    n = 20_000
    xs = jnp.broadcast_to(jnp.asarray(x), (n, x.size))
    y = np.asarray(jaxamp.rounding.stochastic_round(xs, dtype, jax.random.key(1)))
    y = y.astype(np.float64)
    down = np.asarray(jnp.asarray(x).astype(dtype)).astype(np.float64)
    # Every draw is one of the two values of `dtype` that enclose x.
    lo, hi = np.minimum(y.min(0), down), np.maximum(y.max(0), down)
    assert np.all(lo <= x) and np.all(x <= hi)
    assert all(len(np.unique(y[:, i])) <= 2 for i in range(x.size))
    # The mean is x within 5 standard errors of a Bernoulli draw between the two.
    gap = hi - lo
    p = np.where(gap > 0, (x - lo) / np.where(gap > 0, gap, 1), 0)
    se = gap * np.sqrt(p * (1 - p) / n) + 1e-30
    assert np.all(np.abs(y.mean(0) - x) <= 5 * se + 1e-7 * np.abs(x))


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_stochastic_round_keeps_representable_values_and_non_finite(dtype):
    x = jnp.asarray([0.0, -0.0, 1.0, -2.5, 1024.0, 2.0**-15, np.inf, -np.inf, np.nan], F32)
    y = jaxamp.rounding.stochastic_round(jnp.tile(x, 100), dtype, jax.random.key(0))
    y = y.reshape(100, -1)
    expected = np.asarray(x.astype(dtype))
    for row in np.asarray(y):
        np.testing.assert_array_equal(bits(row[:-1]), bits(expected[:-1]))
        assert np.isnan(row[-1])


def test_stochastic_round_is_reproducible_and_needs_a_half_dtype():
    x = jnp.linspace(0.1, 1.0, 1000)
    a = jaxamp.rounding.stochastic_round(x, BF16, jax.random.key(3))
    assert_tree_bitwise_equal(a, jaxamp.rounding.stochastic_round(x, BF16, jax.random.key(3)))
    assert not np.array_equal(bits(a), bits(jaxamp.rounding.stochastic_round(x, BF16,
                                                                     jax.random.key(4))))
    with pytest.raises(ValueError, match="bfloat16 or float16, got float32"):
        jaxamp.rounding.stochastic_round(x, F32, jax.random.key(0))


def test_kahan_split_of_bf16_is_lossless():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    x = raw.view(np.float32)
    x = np.concatenate([x[np.isfinite(x)], np.float32([0.0, -0.0, 1e-45, -1e-45, 3.3e38])])
    high, low = jaxamp.rounding.kahan_split(jnp.asarray(x), BF16)
    assert high.dtype == BF16 and low.dtype == jnp.uint16
    np.testing.assert_array_equal(bits(kahan_join(high, low)), bits(x))
    # high is the nearest bf16 (ties away from zero, which random words never hit here).
    nearest = np.asarray(jnp.asarray(x).astype(BF16))
    assert np.mean(bits(np.asarray(high)) == bits(nearest)) > 0.9999


def test_kahan_split_of_ties_agrees_with_the_usual_cast_after_nudge_ties():
    # 1 + 2**-8 lies halfway between the bf16 values 1 and 1 + 2**-7: round-to-nearest-even
    # goes down; 1 + 3 * 2**-8 lies halfway between 1 + 2**-7 and 1 + 2**-6: it goes up.
    x = jnp.asarray([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8)], F32)
    nudged = nudge_ties(x, BF16)
    high, low = jaxamp.rounding.kahan_split(nudged, BF16)
    assert_tree_bitwise_equal(high, x.astype(BF16))
    assert np.max(np.abs(np.asarray(kahan_join(high, low)) - np.asarray(x))) <= 2.0**-23


def test_kahan_split_of_f16_keeps_about_22_bits():
    x = jnp.asarray(np.random.default_rng(0).uniform(0.5, 2.0, 10_000), F32)
    high, low = jaxamp.rounding.kahan_split(x, F16)
    assert high.dtype == low.dtype == F16
    err = np.abs(np.asarray(kahan_join(high, low)) - np.asarray(x)) / np.asarray(x)
    assert err.max() < 2.0**-21


# --------------------------------------------------------------------------------------------
# Sub-ulp accumulation: 1000 updates of 1e-4 * |param|, below half a bf16 ulp
# --------------------------------------------------------------------------------------------

def _accumulate(master, seed=0, steps=1000):
    p0 = np.concatenate([np.linspace(0.5, 2.0, 500), -np.linspace(0.5, 2.0, 500)])
    p0 = p0.astype(np.float32)
    grad = jnp.asarray(-1e-4 * np.abs(p0), BF16)  # the update of sgd(1.0) is -grad
    tx = jaxamp.mixed_precision(optax.sgd(1.0), "mixed_bfloat16", master=master, seed=seed)
    state, params = tx.init({"w": jnp.asarray(p0)}), {"w": jnp.asarray(p0).astype(BF16)}

    @jax.jit
    def run(state, params):
        def body(carry, _):
            state, params = carry
            updates, state = tx.update({"w": grad}, state, params)
            return (state, optax.apply_updates(params, updates)), None
        return jax.lax.scan(body, (state, params), None, length=steps)[0]

    state, params = run(state, params)
    reference = p0.copy()
    for _ in range(steps):  # sequential fp32 adds of the same update
        reference = (reference - np.asarray(grad, np.float32)).astype(np.float32)
    value = np.asarray(jaxamp.state.get_master_params(state, params)["w"])
    return p0, params["w"], value, reference


@pytest.mark.parametrize("master", ["float32", "kahan"])
def test_float32_and_kahan_accumulate_sub_ulp_updates_to_fp32_rounding(master):
    p0, params, value, reference = _accumulate(master)
    if master == "float32":
        np.testing.assert_array_equal(bits(value), bits(reference))
    else:  # an exact tie moves by one fp32 ulp: a few values end an ulp or two away
        ulps = np.abs(bits(value).astype(np.int64) - bits(reference).astype(np.int64))
        assert ulps.max() <= 4 and np.mean(ulps == 0) > 0.95
    assert_tree_bitwise_equal(params, jnp.asarray(value).astype(BF16))  # the cast of the value
    assert np.mean(np.abs(reference - p0) / np.abs(p0)) > 0.09  # it moved by ~10%


def test_stochastic_accumulates_sub_ulp_updates_in_expectation():
    errors, moved = [], []
    for seed in range(3):
        p0, params, value, reference = _accumulate("stochastic", seed=seed)
        errors.append((value - reference) / np.abs(reference))
        moved.append(np.mean((np.asarray(params, np.float32) - p0) / np.abs(p0)))
    errors = np.concatenate(errors)
    # Each param is off by a random walk of ~3% (1000 roundings of a 1.3%-of-an-ulp update);
    # their mean is unbiased: within 5 standard errors of zero.
    assert abs(errors.mean()) < 5 * errors.std() / np.sqrt(errors.size)
    assert errors.std() < 0.05
    np.testing.assert_allclose(moved, 0.1, rtol=0.05)


def test_none_loses_sub_ulp_updates_entirely():
    p0, params, value, reference = _accumulate("none")
    assert_tree_bitwise_equal(params, jnp.asarray(p0).astype(BF16))  # never moved
    assert np.mean(np.abs(reference - p0) / np.abs(p0)) > 0.09      # the fp32 run did


# --------------------------------------------------------------------------------------------
# bf16 moments: the second moment needs stochastic rounding
# --------------------------------------------------------------------------------------------

def test_bf16_second_moment_freezes_when_rounded_to_nearest_and_tracks_when_stochastic():
    g = jnp.full((4096,), 0.5, F32)
    steps = 1000
    exact = float(0.25 * (1 - 0.999**steps))  # nu after `steps` steps from zero, in fp32

    nearest = jnp.zeros_like(g, BF16)
    for _ in range(steps):
        nearest = (0.001 * g**2 + 0.999 * nearest.astype(F32)).astype(BF16)
    assert float(nearest[0]) < 0.7 * exact  # frozen where its change fell below half an ulp

    tx = jaxamp.mixed_precision(optax.scale_by_adam(b1=0.9, b2=0.999), "mixed_bfloat16",
                                moments_dtype="bfloat16")
    state, params = tx.init({"w": jnp.zeros_like(g)}), {"w": jnp.zeros_like(g, BF16)}

    @jax.jit
    def run(state):
        def body(state, _):
            return tx.update({"w": g.astype(BF16)}, state, params)[1], None
        return jax.lax.scan(body, state, None, length=steps)[0]

    nu = jax.tree.leaves(run(state).inner_state)[2]  # (count, mu, nu)
    assert nu.dtype == BF16 and nu.shape == g.shape
    np.testing.assert_allclose(float(jnp.mean(nu.astype(F32))), exact, rtol=3e-3)


def test_moments_dtype_stores_rank_1_leaves_and_keeps_scalars():
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    tx = jaxamp.mixed_precision(inner, "mixed_bfloat16", moments_dtype="bfloat16")
    state = tx.init(init_params())
    inner_state = state.inner_state
    assert inner_state.hyperparams["learning_rate"].dtype == F32
    for leaf in jax.tree.leaves(inner_state.inner_state):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == BF16
    # float32 undoes an inner mu_dtype of bf16.
    tx = jaxamp.mixed_precision(optax.adam(1e-3, mu_dtype=BF16), "mixed_bfloat16",
                                moments_dtype="float32")
    assert {x.dtype for x in jax.tree.leaves(tx.init(init_params()).inner_state)
            if x.ndim} == {jnp.dtype(F32)}


# --------------------------------------------------------------------------------------------
# What the state holds, and its bytes
# --------------------------------------------------------------------------------------------

def _bytes_per_param(state):
    n = sum(x.size for x in jax.tree.leaves(state.params))
    big = [x for x in jax.tree.leaves(state) if x.ndim]  # leave out counters and scalars
    key = jaxamp.state.find_state(state.opt_state).master.rounding_key  # 8 bytes, any model
    return (sum(x.nbytes for x in big) - (0 if key is None else key.nbytes)) / n


@pytest.mark.parametrize(("master", "moments_dtype", "expected"), [
    ("float32", None, 14), ("float32", "bfloat16", 10), ("kahan", None, 12),
    ("kahan", "bfloat16", 8), ("stochastic", None, 10), ("stochastic", "bfloat16", 6),
    ("none", None, 10), ("none", "bfloat16", 6)])
def test_state_bytes_per_param_of_adam(master, moments_dtype, expected):
    assert _bytes_per_param(_state(master, moments_dtype)) == expected


def test_a_float32_policy_keeps_no_second_copy():
    state = _state("float32", policy="float32")
    assert _bytes_per_param(state) == 12  # params and adam's two moments
    assert jax.tree.leaves(jaxamp.state.find_state(state.opt_state).master.params) == []
    assert_tree_bitwise_equal(state.master_params, state.params)
    with pytest.raises(ValueError, match="pass the working params"):
        jaxamp.state.get_master_params(state.opt_state)


# --------------------------------------------------------------------------------------------
# Dtypes, skips, resume
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def step():
    return jax.jit(jaxamp.make_train_step(mse_loss))


@pytest.mark.parametrize("moments_dtype", MOMENTS, ids=["moments_f32", "moments_bf16"])
@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_state_dtypes_and_skips_bit_identical(step, policy, master, moments_dtype):
    state = _state(master, moments_dtype, policy=policy)
    dtypes = [x.dtype for x in jax.tree.leaves(state)]
    batch = make_batch()
    for i in range(4):
        state, metrics = step(state, batch)
        assert bool(metrics["grads_finite"]), i
        assert [x.dtype for x in jax.tree.leaves(state)] == dtypes
    before = state
    state, metrics = step(state, _poisoned(batch))
    assert not bool(metrics["grads_finite"])
    assert [x.dtype for x in jax.tree.leaves(state)] == dtypes
    mp, mp0 = jaxamp.state.find_state(state.opt_state), jaxamp.state.find_state(before.opt_state)
    assert_tree_bitwise_equal(state.params, before.params)
    assert_tree_bitwise_equal((mp.master.params, mp.master.compensation, mp.inner_state,
                               mp.master.rounding_key, mp.health.applied_steps),
                              (mp0.master.params, mp0.master.compensation, mp0.inner_state,
                               mp0.master.rounding_key, mp0.health.applied_steps))
    state, metrics = step(state, batch)  # and the next applied step is the one it would be
    assert bool(metrics["grads_finite"])
    again, _ = step(before, batch)
    mp, mp_again = (jaxamp.state.find_state(s.opt_state) for s in (state, again))
    assert_tree_bitwise_equal(
        (state.params, mp.master.params, mp.master.compensation, mp.inner_state),
        (again.params, mp_again.master.params, mp_again.master.compensation, mp_again.inner_state))


@pytest.mark.parametrize("master", MASTERS)
def test_resume_is_bit_identical(tmp_path, step, master):
    # (the restore target's seed is 7: the key comes from the checkpoint)
    straight, resumed = straight_and_resumed(
        tmp_path, step, [make_batch(seed) for seed in range(6)], 3,
        lambda: _state(master, "bfloat16"), lambda: _state(master, "bfloat16", seed=7))
    assert_tree_bitwise_equal((straight.step, straight.params, straight.opt_state),
                              (resumed.step, resumed.params, resumed.opt_state))


def test_stochastic_training_depends_on_the_seed_only():
    step = jax.jit(jaxamp.make_train_step(mse_loss))
    runs = {}
    for seed in (0, 0, 1):
        state = _state("stochastic", "bfloat16", seed=seed)
        for i in range(3):
            state, _ = step(state, make_batch(i))
        runs.setdefault(seed, []).append((state.params, state.opt_state))
    assert_tree_bitwise_equal(runs[0][0], runs[0][1])
    assert not np.array_equal(bits(runs[0][0][0]["dense1"]["kernel"]),
                              bits(runs[1][0][0]["dense1"]["kernel"]))


# --------------------------------------------------------------------------------------------
# Composition: accumulation, pmap and jit, the sharded state, flax and nnx
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("master", ["kahan", "stochastic"])
def test_pmap_jit_sharded_state_and_accumulation_agree(master):
    n = 8
    batch = make_batch(n=64)
    runs = {}
    # pmap over 8 devices, replicated state
    pstep = jax.pmap(jaxamp.make_train_step(mse_loss, axis_name="d"), axis_name="d")
    state = jaxamp.parallel.replicate(_state(master, "bfloat16"))
    for _ in range(3):
        state, _ = pstep(state, jaxamp.parallel.shard_batch(batch))
    runs["pmap"] = jaxamp.parallel.unreplicate(state)
    # jit over a mesh of 8, replicated and ZeRO-3
    mesh = jax.make_mesh((n,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))
    for params in ("replicated", "sharded"):
        state = _state(master, "bfloat16")
        shardings = jaxamp.parallel.state_sharding(state, mesh, params=params, min_size=8)
        state = jax.device_put(state, shardings)
        jstep = jax.jit(jaxamp.make_train_step(mse_loss), out_shardings=(shardings, None))
        placed = jax.device_put(batch, NamedSharding(mesh, P("batch")))
        for _ in range(3):
            state, _ = jstep(state, placed)
        runs[params] = state
    # one device, 8 micro-batches
    state = _state(master, "bfloat16")
    astep = jax.jit(jaxamp.make_train_step(mse_loss, accum_steps=8))
    for _ in range(3):
        state, _ = astep(state, batch)
    runs["accum"] = state
    ref = runs["pmap"]
    for name in ("replicated", "sharded", "accum"):
        got = runs[name]
        for a, b in zip(jax.tree.leaves(ref.master_params), jax.tree.leaves(got.master_params),
                        strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7,
                                       err_msg=name)
    assert_tree_bitwise_equal(jax.device_get(runs["replicated"].params),
                              jax.device_get(runs["pmap"].params))


@pytest.mark.parametrize("master", ["kahan", "stochastic"])
def test_flax_train_state_and_nnx_optimizer(master):
    policy = jaxamp.get_policy("mixed_bfloat16")
    tx = jaxamp.mixed_precision(optax.adam(1e-2), policy, master=master,
                                moments_dtype="bfloat16")
    params = init_params()
    state = flax.training.train_state.TrainState.create(
        apply_fn=None, params=policy.cast_params_to_compute(params), tx=tx)
    state = state.replace(opt_state=tx.init(params))  # the compensation from the fp32 values
    batch = make_batch()
    cast_batch = policy.cast_to_compute(batch)  # as make_train_step casts it

    @jax.jit
    def train_step(state):
        def loss_fn(p):
            return jaxamp.state.scale_loss(mse_loss(p, cast_batch), state.opt_state)
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

    ours = _state(master, "bfloat16")
    ours_step = jax.jit(jaxamp.make_train_step(mse_loss))
    for _ in range(5):
        state = train_step(state)
        ours, _ = ours_step(ours, batch)
    assert_tree_bitwise_equal(state.params, ours.params)
    assert_tree_bitwise_equal(state.opt_state, ours.opt_state)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.l2 = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))[:, 0]

    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    nnx.update(model, policy.cast_params_to_compute(nnx.state(model, nnx.Param)))

    nnx_step = nnx_scaled_step(lambda model: jnp.mean(
        (model(jnp.asarray(batch["x"], BF16)).astype(F32) - batch["y"]) ** 2))

    losses = [float(nnx_step(model, optimizer)) for _ in range(60)]
    assert losses[-1] < 0.5 * losses[0]
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(BF16)}


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match=r"master must be one of 'float32', 'kahan', "
                                         r"'stochastic', 'none', got 'fp16-kahan'"):
        jaxamp.mixed_precision(optax.adam(1e-3), master="fp16-kahan")
    with pytest.raises(TypeError, match="seed must be an int or a PRNG key"):
        jaxamp.mixed_precision(optax.adam(1e-3), seed="zero")


def test_a_state_built_by_another_option_is_a_clear_error():
    params = init_params()
    working = jaxamp.get_policy("mixed_bfloat16").cast_params_to_compute(params)
    grads = jax.tree.map(jnp.zeros_like, working)
    state = jaxamp.mixed_precision(optax.adam(1e-3), master="float32").init(params)
    kahan = jaxamp.mixed_precision(optax.adam(1e-3), master="kahan")
    with pytest.raises(ValueError, match="holds an fp32 master for param 'dense1/bias'"):
        kahan.update(grads, state, working)
    state = jaxamp.mixed_precision(optax.adam(1e-3), master="none").init(params)
    stochastic = jaxamp.mixed_precision(optax.adam(1e-3), master="stochastic")
    with pytest.raises(ValueError, match="holds no rounding key"):
        stochastic.update(grads, state, working)


def test_the_update_reads_the_storage_the_state_carries(monkeypatch):
    """``tx.init`` fixes the storage (the ``master=`` option per param, the moments'); an
    update of that state reads it from the state and builds none."""
    from jaxamp._optimizer._storage import Storage
    params = init_params()
    tx = jaxamp.mixed_precision(optax.adam(1e-3), "mixed_bfloat16", master="kahan",
                                moments_dtype="bfloat16")
    state = tx.init(params)
    assert state.storage.option == "kahan" and state.storage.rounds_moments
    built = []
    original = Storage.build
    monkeypatch.setattr(Storage, "build", classmethod(
        lambda cls, *a, **k: built.append(a) or original(*a, **k)))
    working = jaxamp.get_policy("mixed_bfloat16").cast_params_to_compute(params)
    _, new_state = tx.update(jax.tree.map(jnp.zeros_like, working), state, working)
    assert built == [] and new_state.storage is state.storage


@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_the_steps_new_params_are_what_optax_updates_give(master, policy):
    """The train step takes the new working params from the transform itself
    (``mixed_precision``'s ``apply``); a hand-written step gets them from ``tx.update`` and
    :func:`jaxamp.state.next_working_params`: the same bits from the same gradients, on an
    applied and on a skipped step. (A param that is its own fp32 master, under ``float32``,
    gets the inner optimizer's ``p + u`` in the step, as a plain optax step does; ``update``
    hands out ``(p + u) - p``, which ``p`` plus it gives back to within an ulp.)"""
    from jaxamp._optimizer._master_weights import apply_updates
    tx = jaxamp.mixed_precision(optax.adam(1e-2), policy, master=master)
    state = jaxamp.TrainState.create(params=init_params(), tx=tx)

    def grads_of(state, batch):
        return jax.grad(lambda p: jaxamp.state.scale_loss(mse_loss(p, batch),
                                                           state.opt_state))(state.params)

    @jax.jit
    def by_hand(state, batch):
        updates, opt_state = tx.update(grads_of(state, batch), state.opt_state, state.params)
        params = jaxamp.state.next_working_params(opt_state, state.params, updates)
        return params, opt_state, optax.apply_updates(state.params, updates)

    @jax.jit
    def as_the_step(state, batch):
        params, opt_state, mp = apply_updates(tx, grads_of(state, batch), state.opt_state,
                                              state.params)
        assert mp is jaxamp.state.find_state(opt_state)
        return params, opt_state

    for batch in (make_batch(), _poisoned(make_batch()), make_batch(2)):
        params, opt_state, applied = by_hand(state, batch)
        assert_tree_bitwise_equal(jax.tree.map(lambda a, p: a.astype(p.dtype), applied, params),
                                  params)  # optax's apply_updates promotes; its cast agrees
        assert_tree_bitwise_equal(as_the_step(state, batch), (params, opt_state))
        state = state.replace(params=params, opt_state=opt_state)
    assert int(jaxamp.state.find_state(state.opt_state).health.skipped_steps) == 1


def test_a_skipped_step_reads_no_old_param_after_its_branch():
    """Under ``master="kahan"`` the step's new bf16 params come out of the skip's ``lax.cond``:
    no equation after it reads the old params. (Their exact differences as updates need the
    old params after the branch, and XLA then copied every param the skipped branch passed
    through: 0.62 GB on MaxText's 334M-param llama2 compiled for an H200.)"""
    tx = jaxamp.mixed_precision(optax.adam(1e-2), "mixed_bfloat16", master="kahan")
    state = jaxamp.TrainState.create(params=init_params(), tx=tx)
    jaxpr = jax.make_jaxpr(jaxamp.make_train_step(mse_loss))(state, make_batch()).jaxpr
    leaves = jax.tree_util.tree_leaves_with_path(state)
    params = {v for (path, _), v in zip(leaves, jaxpr.invars[:len(leaves)], strict=True)
              if jax.tree_util.keystr(path).startswith(".params")}
    assert len(params) == len(jax.tree.leaves(state.params))
    conds = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "cond"]
    assert len(conds) == 1
    after = [e for e in jaxpr.eqns[conds[0] + 1:]
             if any(v in params for v in e.invars if not isinstance(v, Literal))]
    assert after == [], after


def test_rounding_noise_is_the_predicted_noise_over_the_movement():
    """A hand-computed case: bf16's spacing at 0.5 is 2**-8; a step of a quarter of it adds a
    variance of s**2 * 3/16 and moves s/4, so over 100 steps the noise is sqrt(100 * 3/16) s
    and the movement 25 s. The median is over elements: three of four at 0.5 decide."""
    from jaxamp.rounding import rounding_noise
    lrs = [2.0**-10] * 100
    want = np.sqrt(100 * 3 / 16) / 25
    assert rounding_noise({"w": np.full(4, 0.5, np.float32)}, lrs) == pytest.approx(want)
    mixed = {"a": np.full(3, 0.5, np.float32), "b": np.full(1, 64.0, np.float32)}
    assert rounding_noise(mixed, lrs) == pytest.approx(want)
    # A step that is a whole number of spacings rounds exactly: no noise.
    assert rounding_noise({"w": np.full(4, 0.5, np.float32)}, [2.0**-8] * 10) == 0.0
    # float16 has 3 more significant bits: 8x finer spacing, a step of 2 spacings exactly.
    assert rounding_noise({"w": np.full(4, 0.5, np.float32)}, lrs, F16) == 0.0
    with pytest.raises(ValueError, match="learning_rates must hold each step's"):
        rounding_noise({"w": np.ones(2, np.float32)}, [0.0, 0.0])
    with pytest.raises(ValueError, match="rounds to bfloat16 or float16"):
        rounding_noise({"w": np.ones(2, np.float32)}, lrs, F32)
