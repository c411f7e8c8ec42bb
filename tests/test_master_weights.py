"""Tests of the master-weights transform: ``jaxamp.mixed_precision`` and
``jaxamp.state.scale_loss``."""

import functools
import math
import warnings

import flax.training.train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_bitwise_equal
from helpers import init_params
from helpers import make_batch
from helpers import mse_loss
from helpers import nnx_scaled_step
from helpers import standard_promotion
from hypothesis import Phase
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jaxamp

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

def inner_counts(inner_state):
    """Every ``count`` leaf of an optax state (schedules, adam, injected hyperparams)."""
    found = optax.tree_utils.tree_get_all_with_path(inner_state, "count")
    assert found
    return [int(v) for _, v in found]


def mixed_policy(compute_dtype):
    return jaxamp.Policy(F32, compute_dtype, F32)


def signed_zeros(x):
    """Masks ``(x is -0.0, x is +0.0)``."""
    x = np.asarray(x, np.float32)
    return (x == 0) & np.signbit(x), (x == 0) & ~np.signbit(x)


# --------------------------------------------------------------------------------------------
# Working params equal the cast master, bit for bit
# --------------------------------------------------------------------------------------------

# Params of moderate magnitude (and signed zeros), moved by small steps: the documented domain
# where the half-precision working params land exactly on the cast master.
_PARAM_ELEMENT = st.one_of(
    st.sampled_from([0.0, -0.0]),
    st.floats(1.0, 100.0, allow_subnormal=False),
    st.floats(-100.0, -1.0, allow_subnormal=False),
)
_GRAD_ELEMENT = st.one_of(
    st.just(0.0),
    st.floats(1e-3, 100.0, allow_subnormal=False),
    st.floats(-100.0, -1e-3, allow_subnormal=False),
)


@st.composite
def _update_cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    n = math.prod(shape)
    compute_dtype = draw(st.sampled_from([BF16, F16, F32]))
    optimizer = draw(st.sampled_from(["sgd", "adam"]))
    lr = draw(st.sampled_from([1e-4, 1e-3]))
    log2_scale = draw(st.one_of(st.none(), st.integers(0, 8)))
    w = np.array(draw(st.lists(_PARAM_ELEMENT, min_size=n, max_size=n)), np.float32)
    b = np.float32(draw(_PARAM_ELEMENT))
    grads = []
    for _ in range(3):
        gw = np.array(draw(st.lists(_GRAD_ELEMENT, min_size=n, max_size=n)), np.float32)
        gb = np.float32(draw(_GRAD_ELEMENT))
        grads.append({"w": gw.reshape(shape), "b": gb})
    # A param that starts at zero keeps one direction of motion, so that it only grows in
    # magnitude (the documented exactness domain: no param shrinks by ~2**15x in one step).
    first = grads[0]
    for g in grads[1:]:
        g["w"] = np.where(w.reshape(shape) == 0, np.abs(g["w"]) * np.sign(first["w"]), g["w"])
        if b == 0:
            g["b"] = np.float32(abs(g["b"]) * np.sign(first["b"]))
    return dict(master={"w": w.reshape(shape), "b": b}, compute_dtype=compute_dtype,
                optimizer=optimizer, lr=lr, log2_scale=log2_scale, grads=grads)


@functools.cache
def _transform(compute_dtype, optimizer, lr, log2_scale):
    """``(policy, tx, jitted tx.update)``, cached so that examples share compilations."""
    policy = mixed_policy(compute_dtype)
    inner = optax.sgd(lr) if optimizer == "sgd" else optax.adam(lr)
    if log2_scale is None:
        loss_scale = jaxamp.NoOpLossScale()
    else:
        loss_scale = jaxamp.StaticLossScale(2.0**log2_scale)
    tx = jaxamp.mixed_precision(inner, policy, loss_scale=loss_scale)
    return policy, tx, jax.jit(tx.update)


def _check_working_params_track_master(case):
    policy, tx, update = _transform(case["compute_dtype"], case["optimizer"], case["lr"],
                                    case["log2_scale"])
    master = jax.tree.map(jnp.asarray, case["master"])
    state = tx.init(master)
    params = policy.cast_params_to_compute(master)
    for step, true_grads in enumerate(case["grads"]):
        scale = float(state.loss_scale.loss_scale)
        scaled = jax.tree.map(
            lambda g, scale=scale: jnp.asarray(g * scale).astype(case["compute_dtype"]),
            true_grads)
        updates, state = update(scaled, state, params)
        params = optax.apply_updates(params, updates)
        assert bool(state.health.grads_finite), step
        assert int(state.health.applied_steps) == step + 1
        for leaf in jax.tree.leaves(params):
            assert leaf.dtype == case["compute_dtype"]
        if case["compute_dtype"] == F32:  # the params are their own master: no copy is kept
            assert jax.tree.leaves(state.master.params) == []
            assert_tree_bitwise_equal(jaxamp.state.get_master_params(state, params), params)
            continue
        expected = policy.cast_params_to_compute(jaxamp.state.get_master_params(state))
        assert_tree_bitwise_equal(params, expected)
        assert_tree_bitwise_equal(jaxamp.state.working_params(state, policy), params)
        assert_tree_bitwise_equal(jaxamp.state.get_master_params(state, params),
                                  jaxamp.state.get_master_params(state))
    for leaf in jax.tree.leaves(jaxamp.state.get_master_params(state, params)):
        assert leaf.dtype == F32


@settings(max_examples=50, deadline=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink])
@given(case=_update_cases())
def test_working_params_equal_cast_master_bitwise(case):
    _check_working_params_track_master(case)


@pytest.mark.parametrize("compute_dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_working_params_equal_cast_master_bitwise_fixed_cases(compute_dtype, optimizer):
    # A param at zero that adam keeps moving on its momentum after the gradient vanishes, and
    # params of several magnitudes under varying gradients.
    cases = [
        dict(master={"w": np.zeros((1,), np.float32), "b": np.float32(0.0)},
             grads=[{"w": np.zeros((1,), np.float32), "b": np.float32(g)}
                    for g in (77.875, 0.0, 0.0)]),
        dict(master={"w": np.array([[1.0, -3.5, 17.25], [-99.0, 2.0, 64.0]], np.float32),
                     "b": np.float32(-5.0)},
             grads=[{"w": np.array([[0.5, -2.0, 30.0], [7.0, -0.25, 1.5]], np.float32) * k,
                     "b": np.float32(3.0 * k)} for k in (1.0, -0.5, 2.0)]),
    ]
    for case in cases:
        _check_working_params_track_master(dict(case, compute_dtype=compute_dtype,
                                                optimizer=optimizer, lr=1e-4, log2_scale=None))


def test_docstring_example_lands_on_the_cast_master():
    tx = jaxamp.mixed_precision(optax.sgd(0.25), "mixed_bfloat16")
    master = {"w": jnp.array([1.0, 2.0])}
    state = tx.init(master)
    params = jaxamp.get_policy("mixed_bfloat16").cast_params_to_compute(master)
    grads = jax.grad(lambda p: jaxamp.state.scale_loss(jnp.sum(p["w"] ** 2), state))(params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    assert params["w"].dtype == BF16
    assert params["w"].tolist() == [0.5, 1.0]
    assert jaxamp.state.get_master_params(state)["w"].tolist() == [0.5, 1.0]


# --------------------------------------------------------------------------------------------
# Skipped steps
# --------------------------------------------------------------------------------------------

def _linear_loss(coeffs):
    """``sum(c * p)`` in fp32: its gradient with respect to ``p`` is ``c`` exactly."""
    def loss(params):
        return sum(jnp.sum(params[k].astype(F32) * coeffs[k]) for k in coeffs)
    return loss


def _scaled_grads(loss, params, state):
    return jax.grad(lambda p: jaxamp.state.scale_loss(loss(p), state))(params)


def _poison(grads, leaf, index, value):
    out = dict(grads)
    out[leaf] = grads[leaf].at[index].set(value)
    return out


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("applied_first", [False, True])
def test_skipped_step_is_bit_identical(bad, applied_first):
    policy = jaxamp.get_policy("mixed_float16")
    tx = jaxamp.mixed_precision(optax.adam(1e-2), "mixed_float16")
    assert isinstance(tx.init({"w": jnp.zeros(1)}).loss_scale, jaxamp.DynamicLossScale)
    master = {"w": jnp.array([1.5, -0.0, 0.0, -2.25, 3e-3], F32),
              "b": jnp.array([0.5, -0.0], F32)}
    # Zero coefficients on the zero params, so an applied step leaves their sign alone.
    coeffs = {"w": jnp.array([0.01, 0.0, 0.0, -0.03, 0.001], F32),
              "b": jnp.array([0.02, 0.0], F32)}
    loss = _linear_loss(coeffs)
    state = tx.init(master)
    params = policy.cast_params_to_compute(master)
    update = jax.jit(tx.update)
    if applied_first:
        updates, state = update(_scaled_grads(loss, params, state), state, params)
        params = optax.apply_updates(params, updates)
        assert bool(state.health.grads_finite)
        assert int(state.health.applied_steps) == 1
    neg, pos = signed_zeros(params["w"])
    assert neg[1] and pos[2]

    grads = _poison(_scaled_grads(loss, params, state), "w", 3, bad)
    before = state
    updates, state = update(grads, state, params)
    new_params = optax.apply_updates(params, updates)

    # The updates are -0.0 everywhere, the additive identity that keeps a zero's sign.
    for u in jax.tree.leaves(updates):
        u = np.asarray(u)
        assert np.all(u == 0) and np.all(np.signbit(u))
    assert_tree_bitwise_equal(new_params, params)
    neg, pos = signed_zeros(new_params["w"])
    assert neg[1] and pos[2]
    assert_tree_bitwise_equal(state.master.params, before.master.params)
    assert_tree_bitwise_equal(state.inner_state, before.inner_state)
    assert inner_counts(state.inner_state) == [int(applied_first)]
    assert int(state.health.skipped_steps) == int(before.health.skipped_steps) + 1
    assert int(state.health.applied_steps) == int(before.health.applied_steps)
    assert not bool(state.health.grads_finite)
    assert int(state.health.nonfinite_leaves) == 1
    assert float(state.loss_scale.loss_scale) == float(before.loss_scale.loss_scale) / 2
    assert float(before.loss_scale.loss_scale) == 2.0**16


def test_never_applies_a_nonfinite_update():
    policy = jaxamp.get_policy("mixed_float16")
    tx = jaxamp.mixed_precision(optax.adam(1e-2), policy)
    master = {"w": jnp.array([1.0, -0.0, 2.5], F32), "b": jnp.array(0.25, F32)}
    state = tx.init(master)
    params = policy.cast_params_to_compute(master)
    update = jax.jit(tx.update)
    bad_values = [np.nan, np.inf, -np.inf]
    for i in range(10):
        grads = {"w": jnp.array([1.0, bad_values[i % 3], 2.0], F16),
                 "b": jnp.array(bad_values[(i + 1) % 3], F16)}
        scale_before = float(state.loss_scale.loss_scale)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        assert_tree_bitwise_equal(state.master.params, master)
        assert_tree_bitwise_equal(params, policy.cast_params_to_compute(master))
        assert int(state.health.skipped_steps) == i + 1
        assert float(state.loss_scale.loss_scale) == scale_before / 2
    assert int(state.health.skipped_steps) == 10
    assert int(state.health.applied_steps) == 0
    assert inner_counts(state.inner_state) == [0]
    assert float(state.loss_scale.loss_scale) == 2.0**6


# Finite (1.0) and non-finite batches, in a row and apart; growth_interval=2 makes the dynamic
# scale grow as well as back off.
_POISON_SEQUENCE = [1.0, 1.0, np.inf, 1.0, np.nan, np.nan, 1.0, 1.0, 1.0, -np.inf, 1.0]


def _poisoned_batch(batch, poison):
    return {**batch, "poison": np.where(np.arange(len(batch["poison"])) == 3,
                                        np.float32(poison), batch["poison"])}


def _skip_loss_scale(policy_name):
    return (jaxamp.DynamicLossScale(growth_interval=2) if policy_name == "mixed_float16"
            else None)


def _sgd_chain():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.add_decayed_weights(1e-2),
                       optax.sgd(optax.linear_schedule(1e-2, 1e-3, 8), momentum=0.9,
                                 nesterov=True))


def _skip_trajectory(skip, policy_name, inner):
    """``(arrays of the TrainState, metrics, params, optax state)`` after each step of
    ``_POISON_SEQUENCE`` under ``skip=``, through ``make_train_step`` and ``tx.update``."""
    tx = jaxamp.mixed_precision(inner, policy_name, loss_scale=_skip_loss_scale(policy_name),
                                skip=skip)
    batch = make_batch()
    step = jax.jit(jaxamp.make_train_step(mse_loss))
    state = jaxamp.TrainState.create(params=init_params(), tx=tx)
    update = jax.jit(tx.update)
    opt_state = tx.init(init_params())
    params = jaxamp.get_policy(policy_name).cast_params_to_compute(init_params())
    trajectory = []
    for poison in _POISON_SEQUENCE:
        b = _poisoned_batch(batch, poison)
        state, metrics = step(state, b)
        grads = jax.grad(lambda p, b=b, o=opt_state: jaxamp.state.scale_loss(mse_loss(p, b), o))(
            params)
        updates, opt_state = update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # The TrainState's tx (static data) differs with skip=: compare its arrays.
        trajectory.append(((state.step, state.params, state.opt_state), metrics, params,
                           opt_state))
    return trajectory


def _check_skips_and_scales(trajectory, policy_name):
    """The steps skipped are the poisoned ones, each leaving every array as it was."""
    skipped = [not bool(m["grads_finite"]) for _, m, _, _ in trajectory]
    assert skipped == [not np.isfinite(p) for p in _POISON_SEQUENCE]
    for before, after, skip in zip(trajectory, trajectory[1:], skipped[1:], strict=False):
        if skip:
            (_, p0, o0), _, q0, s0 = before
            (_, p1, o1), _, q1, s1 = after
            assert_tree_bitwise_equal((p0, q0), (p1, q1))
            for a, b in ((o0, o1), (s0, s1)):
                a, b = jaxamp.state.find_state(a), jaxamp.state.find_state(b)
                assert_tree_bitwise_equal((a.master.params, a.inner_state),
                                          (b.master.params, b.inner_state))
    final = jaxamp.state.find_state(trajectory[-1][0][2])
    assert int(final.health.skipped_steps) == sum(skipped)
    assert set(inner_counts(final.inner_state)) == {len(skipped) - sum(skipped)}
    scales = [float(m["loss_scale"]) for _, m, _, _ in trajectory]
    if policy_name == "mixed_float16":  # the scale grows and backs off along the way
        assert len(set(scales)) > 2
    return skipped, scales


def _is_float(x):
    return jnp.issubdtype(np.asarray(x).dtype, jnp.floating)


def _assert_tree_equal_to_rounding(a, b, eps):
    """Same structure, dtypes and shapes; non-float leaves equal; each float leaf within
    ``eps`` machine epsilons (of its dtype) of its largest magnitude: ``max|a - b| <= eps *
    finfo.eps * max|b|``, the bound of a few roundings of the same math."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b),
                            strict=True):
        x, y, where = np.asarray(x), np.asarray(y), jax.tree_util.keystr(path)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), where
        if not _is_float(x):
            np.testing.assert_array_equal(x, y, err_msg=where)
            continue
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        bound = eps * float(jnp.finfo(x.dtype).eps) * np.max(np.abs(y64), initial=0.0)
        assert np.max(np.abs(x64 - y64), initial=0.0) <= bound, where


def _exact_leaves(tree):
    """The leaves that no rounding touches: counters, flags, keys."""
    return [x for x in jax.tree.leaves(tree) if not _is_float(x)]


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16", "float32"])
def test_select_skip_skips_the_steps_of_the_cond_skip_bit_for_bit(policy_name):
    """skip="select" runs the optimizer on every step and keeps the old leaves with jnp.where;
    skip="cond" branches. Both skip the same steps, each skipped step leaving the params,
    master and inner state bit-identical, with the same loss scales and counters. (float32:
    the params work in their master dtype, the other branch of the update.) "auto" is "cond":
    the same program, the same bits on every step."""
    runs = {skip: _skip_trajectory(skip, policy_name, _sgd_chain())
            for skip in ("cond", "select", "auto")}
    sequences = {skip: _check_skips_and_scales(t, policy_name) for skip, t in runs.items()}
    assert sequences["select"] == sequences["cond"] == sequences["auto"]
    assert_tree_bitwise_equal(runs["auto"], runs["cond"])
    assert_tree_bitwise_equal(_exact_leaves(runs["select"]), _exact_leaves(runs["cond"]))


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16", "float32"])
def test_select_skip_applies_a_step_as_the_cond_skip_does_up_to_rounding(policy_name):
    """One step from the same state under both: a skipped step gives the same bits (zero
    updates, the state as it was); an applied step is the same math in another XLA program,
    whose fusions may round differently (one float32 ulp here and there on XLA:CPU from jax
    0.12): each float leaf within 4 epsilons of its largest magnitude (measured: under 0.25
    on jax 0.10 to 0.12), the counters and the loss scale exact. Not bit for bit."""
    txs = {skip: jaxamp.mixed_precision(_sgd_chain(), policy_name,
                                        loss_scale=_skip_loss_scale(policy_name), skip=skip)
           for skip in ("cond", "select")}
    updates = {skip: jax.jit(tx.update) for skip, tx in txs.items()}
    policy = jaxamp.get_policy(policy_name)
    params = policy.cast_params_to_compute(init_params())
    opt_state = txs["cond"].init(init_params())
    batch = make_batch()
    for poison in _POISON_SEQUENCE:
        b = _poisoned_batch(batch, poison)
        grads = jax.grad(lambda p, b=b, o=opt_state: jaxamp.state.scale_loss(mse_loss(p, b), o))(
            params)
        out = {}
        for skip, update in updates.items():
            new_updates, new_state = update(grads, opt_state, params)
            out[skip] = (new_updates, new_state, optax.apply_updates(params, new_updates))
        if np.isfinite(poison):
            # The state and the new params: each within a few roundings of its own magnitude.
            _assert_tree_equal_to_rounding(out["select"][1:], out["cond"][1:], eps=4)
            # An update is a difference of params (new master minus working param): its
            # rounding is that of the larger of the two (measured: one float32 ulp of a bias
            # near 0.06, on an update 30 times smaller; a bias leaving zero rounds as its new
            # value does).
            for a, b, p, q in zip(jax.tree.leaves(out["select"][0]),
                                  jax.tree.leaves(out["cond"][0]), jax.tree.leaves(params),
                                  jax.tree.leaves(out["cond"][2]), strict=True):
                largest = max(float(jnp.max(jnp.abs(x.astype(F32)))) for x in (p, q, b))
                bound = 4 * float(jnp.finfo(p.dtype).eps) * largest
                assert float(jnp.max(jnp.abs(a.astype(F32) - b.astype(F32)))) <= bound
        else:
            assert_tree_bitwise_equal(out["select"], out["cond"])
            old, new = jaxamp.state.find_state(opt_state), jaxamp.state.find_state(out["select"][1])
            assert_tree_bitwise_equal((new.master.params, new.inner_state, out["select"][2]),
                                      (old.master.params, old.inner_state, params))
        _, opt_state, params = out["cond"]


@pytest.mark.parametrize("policy_name", ["mixed_float16", "float32"])
def test_select_skip_under_adamw_skips_the_same_steps_bit_for_bit(policy_name):
    """Under adamw XLA fuses the moments into the master's update differently in the two
    programs (on XLA:CPU the applied steps then differ in the last bit); the skipped steps
    still keep every array, and the skips, scales and counters are the same."""
    inner = optax.adamw(optax.linear_schedule(1e-2, 1e-3, 8))
    cond = _skip_trajectory("cond", policy_name, inner)
    select = _skip_trajectory("select", policy_name, inner)
    assert _check_skips_and_scales(cond, policy_name) == \
        _check_skips_and_scales(select, policy_name)
    assert_tree_bitwise_equal(_exact_leaves(select), _exact_leaves(cond))
    for a, b in zip(jax.tree.leaves(cond), jax.tree.leaves(select), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=1e-5, atol=1e-7)


def test_skip_modes_differ_in_the_program_and_unknown_ones_are_refused():
    master = {"w": jnp.ones((4,))}

    def lowered(skip):
        tx = jaxamp.mixed_precision(optax.adam(1e-3), "mixed_bfloat16", skip=skip)
        params = jaxamp.get_policy("mixed_bfloat16").cast_params_to_compute(master)
        return jax.jit(tx.update).lower(params, tx.init(master), params).as_text()
    assert "stablehlo.case" in lowered("cond") or "stablehlo.if" in lowered("cond")
    text = lowered("select")
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
    assert lowered("auto") == lowered("cond")
    for bad in ("where", None, True):
        with pytest.raises(ValueError, match="skip must be one of 'auto', 'cond', 'select'"):
            jaxamp.mixed_precision(optax.adam(1e-3), "mixed_bfloat16", skip=bad)


def test_apply_if_finite_applies_a_nonfinite_update_after_max_consecutive_errors():
    # The contrast with optax.apply_if_finite, which gives up after max_consecutive_errors.
    tx = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=3)
    params = {"w": jnp.array([1.0, 2.0], F32)}
    state = tx.init(params)
    nan_grads = {"w": jnp.array([np.nan, 1.0], F32)}
    for _ in range(3):
        updates, state = tx.update(nan_grads, state, params)
        params = optax.apply_updates(params, updates)
        assert np.all(np.isfinite(params["w"]))
    updates, state = tx.update(nan_grads, state, params)
    params = optax.apply_updates(params, updates)
    assert not np.all(np.isfinite(params["w"]))


def _inner_with_schedule(kind):
    schedule = optax.linear_schedule(1.0, 0.0, 10)
    if kind == "sgd":
        return optax.sgd(schedule)
    return optax.inject_hyperparams(optax.adam)(learning_rate=schedule)


@pytest.mark.parametrize("kind", ["sgd", "adam_injected"])
def test_schedule_does_not_advance_on_skipped_steps(kind):
    policy = jaxamp.get_policy("mixed_bfloat16")
    master = {"w": jnp.array([0.5, -1.25, 2.0], F32)}
    good = [jnp.array(v, BF16) for v in ([0.25, -0.5, 1.0], [0.125, 0.75, -0.25],
                                           [-1.0, 0.5, 0.5])]
    bad = [jnp.array(v, BF16) for v in ([np.inf, 0.0, 0.0], [0.0, np.nan, 1.0])]
    with_skips = [good[0], bad[0], good[1], bad[1], bad[0], good[2]]

    def run(seq):
        tx = jaxamp.mixed_precision(_inner_with_schedule(kind), policy)
        state = tx.init(master)
        params = policy.cast_params_to_compute(master)
        history = []
        for g in seq:
            before = state
            updates, state = tx.update({"w": g}, state, params)
            params = optax.apply_updates(params, updates)
            if not bool(state.health.grads_finite):
                assert_tree_bitwise_equal(state.inner_state, before.inner_state)
                counts = inner_counts(state.inner_state)
                assert counts == [int(before.health.applied_steps)] * len(counts)
            else:
                history.append(state)
        return history, params

    clean, clean_params = run(good)
    skipped, skipped_params = run(with_skips)
    assert len(clean) == len(skipped) == 3
    for a, b in zip(clean, skipped, strict=True):
        assert_tree_bitwise_equal(a.master.params, b.master.params)
        assert_tree_bitwise_equal(a.inner_state, b.inner_state)
    assert_tree_bitwise_equal(clean_params, skipped_params)
    assert int(skipped[-1].health.skipped_steps) == 3
    assert set(inner_counts(skipped[-1].inner_state)) == {3}


def test_sgd_schedule_lr_after_skips_matches_a_run_without_them():
    # Spelled out: the third applied step uses lr = schedule(2) = 0.8, not schedule(5) = 0.5.
    policy = jaxamp.get_policy("float32")
    tx = jaxamp.mixed_precision(optax.sgd(optax.linear_schedule(1.0, 0.0, 10)), policy)
    params = {"w": jnp.zeros((1,), F32)}
    state = tx.init(params)
    seq = [1.0, 1.0, np.inf, np.nan, np.inf, 1.0]
    for g in seq:
        updates, state = tx.update({"w": jnp.array([g], F32)}, state, params)
        params = optax.apply_updates(params, updates)
    expected = np.float32(0.0)
    for lr in (1.0, 0.9, 0.8):
        expected = np.float32(expected - np.float32(lr))
    np.testing.assert_allclose(np.asarray(params["w"]), [expected], rtol=1e-6)


# --------------------------------------------------------------------------------------------
# Why master weights
# --------------------------------------------------------------------------------------------

def test_small_updates_accumulate_in_the_master_but_not_in_bf16():
    lr, steps = 1e-4, 100
    grads = {"w": jnp.ones((1,), BF16)}

    # Pure bf16 training: 1.0 - 1e-4 rounds back to 1.0 every step.
    sgd = optax.sgd(lr)
    bf16_params = {"w": jnp.ones((1,), BF16)}
    sgd_state = sgd.init(bf16_params)
    for _ in range(steps):
        updates, sgd_state = sgd.update(grads, sgd_state, bf16_params)
        bf16_params = optax.apply_updates(bf16_params, updates)
    assert bf16_params["w"].dtype == BF16
    assert float(bf16_params["w"][0]) == 1.0

    # Mixed precision: the fp32 master accumulates the updates.
    policy = jaxamp.get_policy("mixed_bfloat16")
    tx = jaxamp.mixed_precision(optax.sgd(lr), policy)
    state = tx.init({"w": jnp.ones((1,), F32)})
    params = policy.cast_params_to_compute(state.master.params)
    update = jax.jit(tx.update)
    first_change = None
    for i in range(steps):
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        if first_change is None and float(params["w"][0]) != 1.0:
            first_change = i + 1
    master = float(state.master.params["w"][0])
    np.testing.assert_allclose(1.0 - master, steps * lr, rtol=1e-3)
    assert params["w"].dtype == BF16
    assert first_change is not None and first_change < steps
    assert float(params["w"][0]) < 1.0
    assert_tree_bitwise_equal(params, policy.cast_params_to_compute(state.master.params))


# --------------------------------------------------------------------------------------------
# Unscaling on a growth step
# --------------------------------------------------------------------------------------------

def test_unscale_uses_the_scale_of_this_step_on_growth_steps():
    policy = jaxamp.get_policy("mixed_bfloat16")
    lr = 0.5
    loss_scale = jaxamp.DynamicLossScale(loss_scale=4.0, growth_interval=1)
    tx = jaxamp.mixed_precision(optax.sgd(lr), policy, loss_scale=loss_scale)
    master = {"w": jnp.array([1.0, -2.0, 0.5], F32)}
    coeffs = {"w": jnp.array([0.75, -1.5, 3.0], F32)}
    loss = _linear_loss(coeffs)
    state = tx.init(master)
    params = policy.cast_params_to_compute(master)

    ref = optax.sgd(lr)
    ref_master = master
    ref_state = ref.init(ref_master)
    scales = [float(state.loss_scale.loss_scale)]
    for _ in range(2):
        grads = _scaled_grads(loss, params, state)
        # The scaled gradient is c * scale, exact in bf16.
        np.testing.assert_array_equal(np.asarray(grads["w"], np.float32),
                                      np.asarray(coeffs["w"]) * scales[-1])
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        scales.append(float(state.loss_scale.loss_scale))

        ref_updates, ref_state = ref.update(coeffs, ref_state, ref_master)
        ref_master = optax.apply_updates(ref_master, ref_updates)
        assert_tree_bitwise_equal(state.master.params, ref_master)
    assert scales == [4.0, 8.0, 16.0]
    np.testing.assert_array_equal(np.asarray(state.master.params["w"]),
                                  np.asarray(master["w"]) - 2 * lr * np.asarray(coeffs["w"]))


# --------------------------------------------------------------------------------------------
# flax.training.train_state.TrainState
# --------------------------------------------------------------------------------------------

def test_works_with_flax_train_state():
    policy = jaxamp.get_policy("mixed_bfloat16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    true_w = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    y = x @ true_w + 0.25

    def apply_fn(params, inputs):
        return inputs @ params["w"] + params["b"]

    master = {"w": jnp.zeros((4,), F32), "b": jnp.zeros((), F32)}
    tx = jaxamp.mixed_precision(optax.adam(1e-2), "mixed_bfloat16")
    state = flax.training.train_state.TrainState.create(apply_fn=apply_fn, params=master, tx=tx)
    state = state.replace(params=policy.cast_params_to_compute(state.params))

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(params):
            pred = state.apply_fn(params, x.astype(BF16))
            loss = jnp.mean((pred.astype(F32) - y) ** 2)
            return jaxamp.state.scale_loss(loss, state.opt_state), loss
        grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), loss

    losses = []
    for _ in range(30):
        state, loss = train_step(state, x, y)
        losses.append(float(loss))
        for leaf in jax.tree.leaves(state.params):
            assert leaf.dtype == BF16
        master = jaxamp.state.get_master_params(state.opt_state)
        assert_tree_bitwise_equal(state.params, policy.cast_params_to_compute(master))
    assert int(state.step) == 30
    assert int(jaxamp.state.find_state(state.opt_state).health.applied_steps) == 30
    assert losses[-1] < 0.8 * losses[0]
    assert all(np.isfinite(losses))


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

def test_grads_tree_mismatch_raises():
    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_bfloat16")
    state = tx.init({"w": jnp.ones(2), "b": jnp.ones(())})
    params = {"w": jnp.ones(2, BF16), "b": jnp.ones((), BF16)}
    with pytest.raises(ValueError):
        tx.update({"w": jnp.ones(2, BF16)}, state, params)
    with pytest.raises(ValueError):
        tx.update({"w": jnp.ones(2, BF16), "c": jnp.ones((), BF16)}, state, params)
    with pytest.raises(ValueError):
        tx.update([jnp.ones(2, BF16), jnp.ones((), BF16)], state, params)


def test_scale_loss_rejects_non_scalar_and_integer_losses():
    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16")
    state = tx.init({"w": jnp.ones(2)})
    with pytest.raises(ValueError):
        jaxamp.state.scale_loss(jnp.ones(3), state)
    with pytest.raises(ValueError):
        jaxamp.state.scale_loss(jnp.ones((1, 1)), state)
    with pytest.raises(TypeError):
        jaxamp.state.scale_loss(jnp.array(3, jnp.int32), state)
    scaled = jaxamp.state.scale_loss(jnp.array(1.5, F16), state)
    assert scaled.dtype == F32 and float(scaled) == 1.5 * 2.0**16


def test_scale_loss_finds_the_state_inside_a_chain():
    mp = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16",
                                loss_scale=jaxamp.StaticLossScale(8.0))
    state = optax.chain(mp).init({"w": jnp.ones(2)})
    assert float(jaxamp.state.scale_loss(jnp.float32(0.5), state)) == 4.0
    # Beside another member, even optax.identity() (its state, EmptyState, is a clip's too),
    # the chain is refused: the state cannot tell a harmless member from a harmful one.
    state = optax.chain(optax.identity(), mp).init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="optax.chain puts other transforms beside"):
        jaxamp.state.scale_loss(jnp.float32(0.5), state)


# --------------------------------------------------------------------------------------------
# Dtype invariance of the state
# --------------------------------------------------------------------------------------------

def _avals(tree):
    """``(path, dtype, shape, weak_type)`` of every leaf."""
    return [(jax.tree_util.keystr(path), jnp.asarray(x).dtype, jnp.shape(x),
             getattr(x, "weak_type", False))
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


# The inner transforms of the table: each one's state must keep its dtypes under the wrapper.
INNERS = {
    "adam": lambda: optax.adam(1e-3),
    "sgd_schedule": lambda: optax.sgd(optax.linear_schedule(0.1, 0.0, 10), momentum=0.9),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-3), 2),
}


@pytest.mark.usefixtures("strict_promotion")
@pytest.mark.parametrize("inner", sorted(INNERS))
@pytest.mark.parametrize("compute_dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("scale_kind", ["noop", "static", "dynamic"])
def test_state_dtypes_are_invariant(compute_dtype, scale_kind, inner):
    loss_scale = {"noop": jaxamp.NoOpLossScale(),
                  "static": jaxamp.StaticLossScale(2.0**4),
                  "dynamic": jaxamp.DynamicLossScale(loss_scale=2.0**4, growth_interval=1)}
    policy = mixed_policy(compute_dtype)
    tx = jaxamp.mixed_precision(standard_promotion(INNERS[inner]()), policy,
                                loss_scale=loss_scale[scale_kind])
    master = {"w": jnp.array([[1.0, -2.0], [0.5, 0.0]], F32), "b": jnp.array([0.1, 0.2], F32)}
    state = tx.init(master)
    params = policy.cast_params_to_compute(master)
    init_avals = _avals(state)
    init_structure = jax.tree.structure(state)
    update = jax.jit(tx.update)
    finite = {"w": jnp.full((2, 2), 0.5, compute_dtype), "b": jnp.ones((2,), compute_dtype)}
    nonfinite = {"w": finite["w"].at[0, 1].set(jnp.inf), "b": finite["b"].at[1].set(jnp.nan)}
    for grads, ok in [(finite, True), (nonfinite, False), (finite, True)]:
        updates, state = update(grads, state, params)
        with jax.numpy_dtype_promotion("standard"):  # bf16 + fp32: optax's add, not ours
            params = optax.apply_updates(params, updates)
        assert bool(state.health.grads_finite) == ok
        assert jax.tree.structure(state) == init_structure
        assert _avals(state) == init_avals
        for leaf in jax.tree.leaves(state.master.params):
            assert leaf.dtype == F32
        for leaf in jax.tree.leaves(params):
            assert leaf.dtype == compute_dtype
    assert int(state.health.applied_steps) == 2 and int(state.health.skipped_steps) == 1


def test_works_as_an_nnx_optimizer():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
            self.l1 = nnx.Linear(4, 8, **kw)
            self.l2 = nnx.Linear(8, 1, **kw)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jaxamp.mixed_precision(optax.adam(1e-2), "mixed_bfloat16"),
                              wrt=nnx.Param)
    x = jnp.linspace(-1, 1, 64).reshape(16, 4)
    y = jnp.sin(x.sum(-1))

    train_step = nnx_scaled_step(
        lambda model: jnp.mean((model(x)[:, 0].astype(jnp.float32) - y) ** 2))

    losses = [float(train_step(model, optimizer)) for _ in range(100)]
    assert losses[-1] < 0.5 * losses[0]
    master = jax.tree.leaves(jaxamp.state.get_master_params(optimizer.opt_state))
    working = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(m.dtype == jnp.float32 for m in master)
    assert_tree_bitwise_equal([w.astype(jnp.bfloat16) for w in working],
                              [m.astype(jnp.bfloat16) for m in master])
    assert all(w.dtype == jnp.bfloat16 for w in working)


# --------------------------------------------------------------------------------------------
# Gradient layout on XLA:CPU
# --------------------------------------------------------------------------------------------

def _mlp_steps(pin: bool):
    """A jitted 2-layer MLP train step under mixed_bfloat16 adamw, with the layout pin on or
    off."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    master = {"w1": jax.random.normal(k1, (64, 256)) * 0.1,
              "w2": jax.random.normal(k2, (256, 32)) * 0.1, "b": jnp.zeros(32)}
    x = jax.random.normal(k3, (128, 64))
    tx = jaxamp.mixed_precision(optax.adamw(1e-2), "mixed_bfloat16",
                                loss_scale=jaxamp.DynamicLossScale(2.0 ** 15))

    def loss(p, batch):
        h = jax.nn.relu(batch["x"] @ p["w1"])
        return jnp.mean((h @ p["w2"] + p["b"]).astype(F32) ** 2)

    step = jaxamp.make_train_step(loss, warn_fp32_matmuls=False, pin_grad_layout=pin)
    state = jaxamp.TrainState.create(params=master, tx=tx)
    compiled = jax.jit(step).lower(state, {"x": x}).compile()
    trajectory = []
    for i in range(4):
        xi = x.at[0, 0].set(jnp.inf) if i == 2 else x * (1 + i)  # step 2 overflows and skips
        state, _ = compiled(state, {"x": xi})
        trajectory.append((state.params, jaxamp.state.find_state(state.opt_state)))
    return compiled, trajectory


def test_the_layout_pin_is_the_steps_alone():
    """The pin lives in ``make_train_step(pin_grad_layout=...)``; the transform has no keyword
    for it (no deprecated alias before the first release)."""
    with pytest.raises(TypeError, match="pin_grad_layout"):
        jaxamp.mixed_precision(optax.sgd(0.5), "mixed_bfloat16", pin_grad_layout=True)


def test_gradient_layout_pin_changes_no_value_and_saves_traffic():
    pinned, with_pin = _mlp_steps(True)
    unpinned, without_pin = _mlp_steps(False)
    assert not bool(jaxamp.state.find_state(with_pin[2][1]).health.grads_finite)
    # Params, master, moments, scale and counters are bit-identical. The reported grad norm is
    # an fp32 sum whose order follows the layout: equal to within an ulp.
    def without_norm(trajectory):
        return [(p, s._replace(health=s.health._replace(grad_norm=None))) for p, s in trajectory]
    assert_tree_bitwise_equal(without_norm(with_pin), without_norm(without_pin))
    for (_, a), (_, b) in zip(with_pin, without_pin, strict=True):
        np.testing.assert_allclose(a.health.grad_norm, b.health.grad_norm, rtol=1e-6)
    if jax.default_backend() == "cpu":
        # The transposing copies of the weight gradients (before the finite check and at
        # the skip's cond boundary) are gone: the step accesses fewer bytes.
        def nbytes(c):
            return c.cost_analysis()["bytes accessed"]
        assert nbytes(pinned) < nbytes(unpinned)


def test_the_default_pins_a_step_on_one_device_of_a_process_that_sees_several():
    """The default reads where the params are from their types at trace time, not from how
    many devices the process sees: a step on one device of this 8-device process is pinned."""
    assert jax.device_count() > 1
    master = {"w1": jnp.full((64, 256), 0.1), "w2": jnp.full((256, 32), 0.1)}
    tx = jaxamp.mixed_precision(optax.adamw(1e-2), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=master, tx=tx)
    x = {"x": jnp.ones((128, 64))}

    def loss(p, batch):
        return jnp.mean((jax.nn.relu(batch["x"] @ p["w1"]) @ p["w2"]).astype(F32) ** 2)

    def pins(pin):
        text = jax.jit(jaxamp.make_train_step(loss, pin_grad_layout=pin)).lower(
            state, x).as_text()
        return text.count("custom_call @LayoutConstraint")
    expected = 2 if jax.default_backend() == "cpu" else 0
    assert pins(True) == 2 and pins(False) == 0
    assert pins(None) == expected


def test_gradient_layout_pin_leaves_eager_and_vmapped_updates_alone():
    tx = jaxamp.mixed_precision(optax.sgd(0.5), "mixed_bfloat16")
    master = {"w": jnp.ones((3, 4))}
    state = tx.init(master)
    params = jaxamp.get_policy("mixed_bfloat16").cast_params_to_compute(master)
    grads = {"w": np.full((3, 4), 2.0, np.float32).astype(BF16)}  # numpy leaves, eagerly
    updates, _ = tx.update(grads, state, params)
    assert optax.apply_updates(params, updates)["w"].tolist() == [[0.0] * 4] * 3
    batched = jax.vmap(lambda g: tx.update({"w": g}, state, params)[0]["w"])(
        jnp.stack([grads["w"], 2 * grads["w"]]))
    assert batched.shape == (2, 3, 4)
    np.testing.assert_array_equal(np.asarray(batched[1], np.float32), -2.0)


def test_gradient_layout_pin_keeps_tensor_parallel_sharding():
    """The default adds no collective on a mesh: a sharded gradient is never gathered for the
    layout pin (XLA's partitioner would all-gather it to pin it, so the default leaves params
    on a mesh alone), and the norm of a sharded gradient is reduced without gathering it."""
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("model",))
    shardings = {"w1": NamedSharding(mesh, P(None, "model")),
                 "w2": NamedSharding(mesh, P("model", None))}
    master = jax.device_put({"w1": jnp.full((16, 32), 0.1), "w2": jnp.full((32, 8), 0.1)},
                            shardings)
    x = {"x": jax.random.normal(jax.random.key(0), (64, 16))}

    def loss(p, b):
        return jnp.mean((jax.nn.relu(b["x"] @ p["w1"]) @ p["w2"]).astype(F32) ** 2)
    state = jaxamp.TrainState.create(
        params=master, tx=jaxamp.mixed_precision(optax.adam(1e-2), "mixed_bfloat16"))

    def collectives(pin):
        step = jaxamp.make_train_step(loss, pin_grad_layout=pin)
        text = jax.jit(step).lower(state, x).compile().as_text()
        return {op: text.count(f" {op}(") for op in
                ("all-gather", "all-reduce", "all-to-all", "collective-permute")}
    assert collectives(None) == collectives(False)
    assert collectives(None)["all-gather"] == 0
    new_state, _ = jax.jit(jaxamp.make_train_step(loss))(state, x)
    assert new_state.params["w1"].sharding.spec == P(None, "model")
    assert jaxamp.state.get_master_params(new_state.opt_state)["w2"].sharding.spec == P("model")


@pytest.mark.parametrize("spec,mixed", [("fp16", "mixed_float16"), ("bfloat16", "mixed_bfloat16")])
def test_a_pure_half_policy_warns_once_that_it_keeps_no_fp32_master(spec, mixed, monkeypatch):
    """A PyTorch user who types "fp16" means AMP: the only hint was Adam's second-moment
    warning, printed twice."""
    from jaxamp._optimizer import _master_weights
    monkeypatch.setattr(_master_weights, "_WARNED_PURE_HALF", set())
    with pytest.warns(UserWarning, match=rf"keeps the params in \w+ with no fp32 master.*"
                                         rf"as PyTorch's AMP, is '{mixed}'"):
        jaxamp.mixed_precision(optax.sgd(0.1), spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxamp.mixed_precision(optax.sgd(0.1), spec)            # once
        jaxamp.mixed_precision(optax.sgd(0.1), mixed)           # and never for mixed ones
