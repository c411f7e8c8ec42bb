"""The inner optimizer's moments in fewer bytes: ``mixed_precision(moments_dtype=...)``,
:func:`jaxamp.quantized_moments` and the block-wise 8-bit quantizer behind it
(:func:`jaxamp.rounding.quantize_blockwise`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_bitwise_equal
from helpers import init_params
from helpers import make_batch
from helpers import mse_loss
from helpers import straight_and_resumed
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from benchmarks import moments as moments_suite
from jaxamp.rounding import Blockwise8bit
from jaxamp.rounding import dequantize_blockwise
from jaxamp.rounding import dynamic_map
from jaxamp.rounding import quantize_blockwise

F32, BF16 = jnp.float32, jnp.bfloat16


# --------------------------------------------------------------------------------------------
# The dynamic maps
# --------------------------------------------------------------------------------------------

def test_the_signed_map_is_symmetric_with_zero_and_the_unsigned_has_no_zero():
    m = dynamic_map(signed=True)
    assert m.dtype == np.float32 and m.shape == (256,)
    assert np.all(np.diff(m) >= 0)
    values = np.unique(m)
    assert values.size == 255 and m[-1] == m[-2] == 1.0  # the spare code repeats the max
    np.testing.assert_array_equal(values, -values[::-1])
    assert 0.0 in values and -1.0 in values
    u = dynamic_map(signed=False)
    assert np.unique(u).size == 255 and np.all(u > 0) and u[0] == np.float32(1e-7)
    assert u[-1] == 1.0
    # Finest near the max: the top decade's step is 0.9/64 (signed) and 0.9/128 (unsigned).
    np.testing.assert_allclose(np.diff(values[-5:]), 0.9 / 64, rtol=1e-5)
    np.testing.assert_allclose(np.diff(np.unique(u)[-5:]), 0.9 / 128, rtol=1e-5)
    # Seven decades: the smallest nonzero magnitude is within 1e-6 of the max.
    assert 1e-7 < np.min(np.abs(values[values != 0])) < 1e-6


# --------------------------------------------------------------------------------------------
# The quantizer
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_values_on_the_map_round_trip_bit_for_bit(signed):
    table = np.unique(dynamic_map(signed))
    rng = np.random.default_rng(0)
    block = 32
    scale = 2.0 ** rng.integers(-20, 20, size=(8, 1))  # a power of two: the products are exact
    values = table[rng.integers(0, table.size, size=(8, block))] * scale
    values[:, 0] = scale[:, 0] * (1.0 if not signed else rng.choice([-1.0, 1.0], size=8))
    x = jnp.asarray(values.astype(np.float32))
    q = quantize_blockwise(x, signed=signed, block_size=block)
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == (8, block)
    np.testing.assert_array_equal(np.asarray(q.absmax), scale[:, 0].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(dequantize_blockwise(q)), values)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_each_value_goes_to_the_nearest_entry_and_the_max_is_exact(signed):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((5, 64)) * 10.0 ** rng.integers(-4, 4, (5, 64))).astype(np.float32)
    if not signed:
        x = np.abs(x)
    q = quantize_blockwise(jnp.asarray(x), signed=signed, block_size=64)
    got = np.asarray(dequantize_blockwise(q))
    absmax = np.abs(x).max(axis=1, keepdims=True)
    table = dynamic_map(signed).astype(np.float64)
    scaled = x / absmax
    nearest = table[np.abs(table[None, None, :] - scaled[..., None]).argmin(-1)] * absmax
    np.testing.assert_allclose(got, nearest, rtol=1e-6)
    # The largest magnitude of each block comes back exactly, nothing exceeds it.
    rows = np.arange(5)
    top = np.abs(x).argmax(axis=1)
    np.testing.assert_array_equal(got[rows, top], x[rows, top])
    assert np.all(np.abs(got) <= absmax)


def test_zero_and_non_finite_blocks():
    x = np.zeros((4, 8), np.float32)
    x[1] = np.linspace(-1, 2, 8)
    x[2, 3], x[3, 5] = np.inf, np.nan
    x[2, 0] = x[3, 0] = 1.0
    for signed in (True, False):
        got = np.asarray(dequantize_blockwise(quantize_blockwise(jnp.asarray(x), signed=signed,
                                                                 block_size=8)))
        np.testing.assert_array_equal(got[0], np.zeros(8))  # an all-zero block stays zero
        assert np.all(np.isnan(got[2])) and np.all(np.isnan(got[3]))  # never a finite guess
        assert np.all(np.isfinite(got[:2]))
    # The unsigned map has no zero: a zero beside a nonzero value is 1e-7 of the block's max.
    y = jnp.array([0.0, 3.0, 1.0, 0.5])
    got = dequantize_blockwise(quantize_blockwise(y, signed=False, block_size=4))
    assert float(got[0]) == pytest.approx(3e-7, rel=1e-6) and float(got[1]) == 3.0
    got = dequantize_blockwise(quantize_blockwise(y, signed=True, block_size=4))
    assert float(got[0]) == 0.0


@pytest.mark.parametrize("shape", [(), (1,), (3, 5, 7), (256,), (257,), (2, 128)])
def test_shapes_that_do_not_divide_the_block(shape):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    q = quantize_blockwise(x, block_size=128)
    size = int(np.prod(shape))
    assert q.codes.shape == (max(1, -(-size // 128)), 128) and q.shape == shape
    got = dequantize_blockwise(q)
    assert got.shape == shape and got.dtype == F32
    # The padding takes no part: each value is within half the top decade's step (0.9 / 128)
    # of its block's own max, and the largest one comes back exactly.
    top = float(np.abs(np.asarray(x)).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(x), rtol=0, atol=0.9 / 128 * top)
    assert float(np.abs(np.asarray(got)).max()) == top
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        quantize_blockwise(x, block_size=0)


def test_a_quantized_array_is_a_pytree_of_two_arrays_through_jit():
    x = jnp.linspace(-3.0, 5.0, 1000)
    q = jax.jit(lambda x: quantize_blockwise(x, block_size=256))(x)
    assert isinstance(q, Blockwise8bit) and q.shape == (1000,) and q.signed
    assert [leaf.dtype for leaf in jax.tree.leaves(q)] == [jnp.uint8, F32]
    np.testing.assert_array_equal(np.asarray(jax.jit(dequantize_blockwise)(q)),
                                  np.asarray(dequantize_blockwise(q)))


# --------------------------------------------------------------------------------------------
# Adam's second moment stored in fewer bits: the ratchet
# --------------------------------------------------------------------------------------------

STORES = {"nearest": moments_suite.STORES["bf16, nearest"],
          "stochastic": moments_suite.STORES["bf16, stochastic"],
          "8bit": moments_suite.STORES["8bit"]}


def _stored_nu(store, b2, decaying):
    """The mean and spread of nu kept by ``store`` over the fp32 nu (``python -m benchmarks
    moments``, whose table is in BENCHMARKS.md)."""
    return moments_suite.stored_nu(store, b2, decaying)


def test_a_bf16_second_moment_ratchets_up_when_rounded_to_the_nearest():
    # At b2 = 0.999 a step's decay (0.1%) is below half a bf16 ulp (0.2-0.4%): nu only grows.
    mean, _ = _stored_nu(STORES["nearest"], 0.999, decaying=False)
    assert mean > 1.8  # measured 2.05x the fp32 average on stationary gradients
    mean, _ = _stored_nu(STORES["nearest"], 0.999, decaying=True)
    assert mean > 10  # frozen near its start while the gradients shrink 55x (measured 31x)
    # At b2 = 0.95 (a 5% step) it does not.
    mean, _ = _stored_nu(STORES["nearest"], 0.95, decaying=True)
    assert abs(mean - 1) < 0.01


def test_stochastic_rounding_and_8bit_blocks_keep_the_second_moment():
    for decaying in (False, True):
        mean, spread = _stored_nu(STORES["stochastic"], 0.999, decaying)
        assert abs(mean - 1) < 0.01 and spread < 0.08  # unbiased; 4.1-6.0% noise
        # The block's max is kept exactly and the rest move with it: a bias, no ratchet
        # (measured +8.6% stationary, +32% while the gradients shrink 55x, where nearest
        # bf16 is 31x).
        mean, spread = _stored_nu(STORES["8bit"], 0.999, decaying)
        assert 1 < mean < (1.45 if decaying else 1.15) and spread < 0.2


# --------------------------------------------------------------------------------------------
# moments_dtype= and quantized_moments
# --------------------------------------------------------------------------------------------

def _adam_leaves(state):
    adam = jaxamp.state.find_state(state).inner_state[0]  # adam's (count, mu, nu)
    return adam.mu, adam.nu


def test_first_moment_in_bf16_and_second_in_fp32():
    tx = jaxamp.mixed_precision(optax.adam(1e-3), master="kahan",
                                moments_dtype={"mu": "bfloat16"})
    state = tx.init(init_params())
    mu, nu = _adam_leaves(state)
    assert {x.dtype for x in jax.tree.leaves(mu)} == {jnp.dtype(BF16)}
    assert {x.dtype for x in jax.tree.leaves(nu)} == {jnp.dtype(F32)}
    n = sum(x.size for x in jax.tree.leaves(init_params()))
    # the bf16 working param (2) + its compensation (2) + mu (2) + nu (4)
    stored = jax.tree.leaves((mu, nu, state.master.compensation))
    assert (sum(x.nbytes for x in stored) + 2 * n) / n == 10


def test_the_8bit_option_and_the_wrapper_store_the_same_state():
    params = {"embed": jnp.ones((64, 128)), "bias": jnp.zeros((128,))}
    via_option = jaxamp.mixed_precision(optax.adam(1e-3), moments_dtype="8bit").init(params)
    via_wrapper = jaxamp.mixed_precision(jaxamp.quantized_moments(optax.adam(1e-3))).init(params)
    assert_tree_bitwise_equal(via_option.inner_state, via_wrapper.inner_state)
    mu, nu = _adam_leaves(via_option)
    # 8192 values: quantized, blocks of 256; 128 values: below min_size, fp32.
    assert isinstance(mu["embed"], Blockwise8bit) and mu["embed"].codes.shape == (32, 256)
    assert mu["embed"].signed and not nu["embed"].signed
    assert mu["bias"].dtype == F32 and nu["bias"].dtype == F32
    n = 64 * 128
    assert (mu["embed"].codes.nbytes + mu["embed"].absmax.nbytes) / n == 1 + 4 / 256


def test_bad_moments_options_are_clear_errors():
    with pytest.raises(ValueError, match=r"moments_dtype must be one of 'float32', "
                                         r"'bfloat16', '8bit', got 'int8'"):
        jaxamp.mixed_precision(optax.adam(1e-3), moments_dtype="int8")
    with pytest.raises(ValueError, match="moments_dtype must be one of"):
        jaxamp.mixed_precision(optax.adam(1e-3), moments_dtype=jnp.float16)
    with pytest.raises(ValueError, match=r"moments_dtype\['nu'\] must be one of"):
        jaxamp.mixed_precision(optax.adam(1e-3), moments_dtype={"nu": "fp8"})
    tx = jaxamp.mixed_precision(optax.adam(1e-3), moments_dtype={"m": "bfloat16"})
    with pytest.raises(ValueError, match=r"names the field\(s\) 'm', which hold no moments.*"
                                         r"'mu', 'nu'"):
        tx.init(init_params())
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        jaxamp.quantized_moments(optax.adam(1e-3), block_size=0)


# --------------------------------------------------------------------------------------------
# 8-bit states compose: the skip, accumulation, pmap and the sharded jit, resume
# --------------------------------------------------------------------------------------------

def _q8_state(master="kahan", seed=0):
    # Blocks of 8 and no minimum size, so that the test MLP's small leaves are quantized.
    tx = jaxamp.mixed_precision(jaxamp.quantized_moments(optax.adam(1e-2), block_size=8,
                                                         min_size=0),
                                "mixed_bfloat16", master=master, seed=seed)
    return jaxamp.TrainState.create(params=init_params(), tx=tx)


@pytest.fixture(scope="module")
def step():
    return jax.jit(jaxamp.make_train_step(mse_loss))


def test_8bit_state_keeps_its_dtypes_and_a_skipped_step_is_bit_identical(step):
    state = _q8_state()
    dtypes = [x.dtype for x in jax.tree.leaves(state)]
    assert jnp.dtype(jnp.uint8) in dtypes
    batch = make_batch()
    for _ in range(3):
        state, metrics = step(state, batch)
        assert bool(metrics["grads_finite"])
    before = state
    poison = np.ones_like(batch["poison"])
    poison[0] = np.inf
    state, metrics = step(state, dict(batch, poison=poison))
    assert not bool(metrics["grads_finite"])
    assert [x.dtype for x in jax.tree.leaves(state)] == dtypes
    find_state = jaxamp.state.find_state
    assert_tree_bitwise_equal((state.params, find_state(state.opt_state).inner_state),
                              (before.params, find_state(before.opt_state).inner_state))


def test_8bit_adam_trains_the_mlp_as_fp32_moments_do(step):
    losses = {}
    for name in ("float32", "8bit"):
        state = _q8_state() if name == "8bit" else jaxamp.TrainState.create(
            params=init_params(), tx=jaxamp.mixed_precision(optax.adam(1e-2), master="kahan"))
        for i in range(300):
            state, metrics = step(state, make_batch(i % 8))
        losses[name] = float(metrics["loss"])
    assert losses["8bit"] == pytest.approx(losses["float32"], rel=0.1), losses


def test_8bit_state_under_pmap_the_sharded_jit_and_accumulation_agree():
    batch = make_batch(n=64)
    pstep = jax.pmap(jaxamp.make_train_step(mse_loss, axis_name="d"), axis_name="d")
    state = jaxamp.parallel.replicate(_q8_state())
    for _ in range(3):
        state, _ = pstep(state, jaxamp.parallel.shard_batch(batch))
    ref = jaxamp.parallel.unreplicate(state)
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))
    state = _q8_state()
    shardings = jaxamp.parallel.state_sharding(state, mesh, params="sharded", min_size=8)
    state = jax.device_put(state, shardings)
    jstep = jax.jit(jaxamp.make_train_step(mse_loss), out_shardings=(shardings, None))
    placed = jax.device_put(batch, NamedSharding(mesh, P("batch")))
    for _ in range(3):
        state, _ = jstep(state, placed)
    accum = _q8_state()
    astep = jax.jit(jaxamp.make_train_step(mse_loss, accum_steps=8))
    for _ in range(3):
        accum, _ = astep(accum, batch)
    def moments(state):  # the moments' values, a quantized one dequantized
        inner = jaxamp.state.find_state(state.opt_state).inner_state
        return jax.tree.leaves(jax.tree.map(
            lambda x: dequantize_blockwise(x) if isinstance(x, Blockwise8bit) else x,
            inner, is_leaf=lambda x: isinstance(x, Blockwise8bit)))

    for got in (jax.device_get(state), accum):
        for a, b in zip(moments(ref), moments(got), strict=True):
            # the same to within one step of the map (a value a hair's breadth from a
            # midpoint may take the code on its other side)
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            np.testing.assert_allclose(a, b, rtol=0, atol=0.9 / 64 * np.abs(a).max() + 1e-9)
        np.testing.assert_allclose(
            np.asarray(jax.tree.leaves(got.params)[0], np.float32),
            np.asarray(jax.tree.leaves(ref.params)[0], np.float32), rtol=2e-2)


def test_8bit_state_resumes_bit_for_bit(tmp_path, step):
    straight, resumed = straight_and_resumed(
        tmp_path, step, [make_batch(seed) for seed in range(6)], 3, _q8_state)
    assert_tree_bitwise_equal((straight.step, straight.params, straight.opt_state),
                              (resumed.step, resumed.params, resumed.opt_state))


def test_8bit_state_inside_multisteps():
    tx = jaxamp.mixed_precision(optax.MultiSteps(jaxamp.quantized_moments(
        optax.adam(1e-2), block_size=8, min_size=0), every_k_schedule=2), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=init_params(), tx=tx)
    step = jax.jit(jaxamp.make_train_step(mse_loss))
    params0 = state.params
    state, _ = step(state, make_batch(0))
    assert_tree_bitwise_equal(state.params, params0)  # the first micro-step applies nothing
    state, _ = step(state, make_batch(1))
    assert not np.array_equal(np.asarray(state.params["dense1"]["kernel"], np.float32),
                              np.asarray(params0["dense1"]["kernel"], np.float32))


def test_an_inner_optimizer_keeping_a_half_second_moment_is_warned_about():
    def half_adam():  # an optax transform that builds its own bf16 state
        inner = optax.scale_by_adam()

        def init(params):
            return jax.tree.map(lambda x: x.astype(BF16) if x.ndim else x, inner.init(params))
        return optax.GradientTransformation(init, inner.update)

    with pytest.warns(UserWarning, match=r"keeps its second moment .*nu.* in bfloat16 and "
                                         r"rounds it to the nearest"):
        jaxamp.mixed_precision(half_adam()).init(init_params())
    # Stored by mixed_precision, stochastically: no warning.
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxamp.mixed_precision(half_adam(), moments_dtype={"nu": "bfloat16"}).init(init_params())
        jaxamp.mixed_precision(optax.adam(1e-3, mu_dtype=BF16)).init(init_params())


def test_the_training_cli_reads_a_format_or_field_pairs():
    from train.configs.default import moments_dtype
    assert moments_dtype("8bit") == "8bit"
    assert moments_dtype("mu=bfloat16,nu=8bit") == {"mu": "bfloat16", "nu": "8bit"}
    tx = jaxamp.mixed_precision(optax.adam(1e-3), moments_dtype=moments_dtype("mu=bfloat16"))
    mu, nu = _adam_leaves(tx.init(init_params()))
    assert {x.dtype for x in jax.tree.leaves(mu)} == {jnp.dtype(BF16)}


def test_the_second_moment_under_inject_hyperparams_takes_the_map_without_zero():
    tx = jaxamp.quantized_moments(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
                                  min_size=0)
    state = tx.init({"w": jnp.ones((8, 64))})
    adam = state.inner_state[0]
    assert adam.mu["w"].signed and not adam.nu["w"].signed
    assert state.hyperparams["learning_rate"].dtype == F32  # a scalar: kept as it is
