"""Tests for jaxamp.loss_scale: exact scale sequences, GradScaler's rule, pytree behaviour."""

import math

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import F32_MAX
from helpers import F32_TINY
from helpers import reference_sequence
from hypothesis import assume
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jaxamp
from jaxamp import DynamicLossScale
from jaxamp import NoOpLossScale
from jaxamp import StaticLossScale
from jaxamp.gradients import all_finite

# The library's own arithmetic must be promotion-clean (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("strict_promotion")


@jax.jit
def _adjust(state, finite):
    return state.adjust(finite)


@jax.jit
def _run(state, finite_seq):
    """Applies ``adjust`` along ``finite_seq``; returns every intermediate state (stacked)."""
    def body(carry, finite):
        carry = carry.adjust(finite)
        return carry, carry
    return jax.lax.scan(body, state, finite_seq)[1]


def run_sequence(state, finite_seq):
    """(scales, growth trackers, hysteresis budgets) after each step, as python lists."""
    out = _run(state, jnp.asarray(finite_seq, jnp.bool_))
    return (np.asarray(out.loss_scale).tolist(), np.asarray(out.growth_tracker).tolist(),
            np.asarray(out.hysteresis_left).tolist())


def adjust_loop(state, finite_seq):
    """The same with a python loop over the jitted adjust."""
    scales, trackers, left = [], [], []
    for finite in finite_seq:
        state = _adjust(state, jnp.asarray(finite))
        scales.append(float(state.loss_scale))
        trackers.append(int(state.growth_tracker))
        left.append(int(state.hysteresis_left))
    return scales, trackers, left


T, F = True, False


# --------------------------------------------------------------------------------------------
# Exact sequences.
# --------------------------------------------------------------------------------------------


def test_growth_on_the_interval_th_consecutive_finite_step():
    state = DynamicLossScale(loss_scale=4.0, growth_interval=3)
    seq = [T, T, T, T, T, T, T]
    expected = ([4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0], [1, 2, 0, 1, 2, 0, 1],
                [1, 1, 1, 1, 1, 1, 1])
    assert run_sequence(state, seq) == expected
    assert adjust_loop(state, seq) == expected


def test_growth_interval_one_grows_every_finite_step():
    state = DynamicLossScale(loss_scale=1.0, growth_interval=1)
    scales, trackers, _ = run_sequence(state, [T, T, T, T])
    assert scales == [2.0, 4.0, 8.0, 16.0]
    assert trackers == [0, 0, 0, 0]


def test_backoff():
    state = DynamicLossScale(loss_scale=1024.0, growth_interval=3)
    assert run_sequence(state, [F, F, F]) == ([512.0, 256.0, 128.0], [0, 0, 0], [0, 0, 0])


def test_overflow_resets_the_growth_counter():
    state = DynamicLossScale(loss_scale=8.0, growth_interval=3)
    seq = [T, T, F, T, T, T, T, T, F, F, T, T, T]
    scales, trackers, _ = run_sequence(state, seq)
    assert scales == [8.0, 8.0, 4.0, 4.0, 4.0, 8.0, 8.0, 8.0, 4.0, 2.0, 2.0, 2.0, 4.0]
    assert trackers == [1, 2, 0, 1, 2, 0, 1, 2, 0, 0, 1, 2, 0]


def test_custom_factors():
    state = DynamicLossScale(loss_scale=64.0, growth_interval=2, growth_factor=3.0,
                             backoff_factor=0.25)
    scales, _, _ = run_sequence(state, [T, T, F, T, T, F, F])
    assert scales == [64.0, 192.0, 48.0, 48.0, 144.0, 36.0, 9.0]


def test_max_scale_caps_growth():
    state = DynamicLossScale(loss_scale=8.0, growth_interval=1, max_scale=20.0)
    scales, _, _ = run_sequence(state, [T, T, T, F, T, T])
    assert scales == [16.0, 20.0, 20.0, 10.0, 20.0, 20.0]


def test_min_scale_bounds_backoff():
    state = DynamicLossScale(loss_scale=8.0, growth_interval=1, min_scale=3.0)
    scales, _, _ = run_sequence(state, [F, F, F, T, F, F])
    assert scales == [4.0, 3.0, 3.0, 6.0, 3.0, 3.0]


def test_default_min_scale_keeps_the_scale_positive_after_200_overflows():
    state = DynamicLossScale()  # 2**16
    scales, _, _ = run_sequence(state, [F] * 200)
    scales = np.asarray(scales, np.float32)
    assert np.all(scales > 0)
    assert np.all(np.isfinite(scales))
    # 2**16 * 0.5**k until 2**-126, the smallest normal fp32, which it never goes below.
    expected = [max(2.0 ** (16 - k), 2.0**-126) for k in range(1, 201)]
    assert scales.tolist() == expected
    assert scales[-1] == np.finfo(np.float32).tiny
    # And it still grows back from there.
    last = jax.tree.map(lambda x: x[-1], _run(state, jnp.zeros(200, jnp.bool_)))
    assert float(_adjust(last.replace(growth_tracker=jnp.int32(1999)), True).loss_scale) \
        == 2.0**-125


def test_growth_stops_where_the_scale_would_overflow():
    state = DynamicLossScale(loss_scale=2.0**127, growth_interval=1)
    scales, trackers, _ = run_sequence(state, [T, T, T])
    assert scales == [2.0**127] * 3
    assert trackers == [0, 0, 0]
    assert 2.0**127 <= F32_MAX < 2.0**128


def test_growth_to_a_finite_value_near_the_fp32_max():
    # 3 * 2**126 = 1.5 * 2**127 < fp32 max: it grows once, then 4.5 * 2**127 would be inf.
    state = DynamicLossScale(loss_scale=2.0**126, growth_interval=1, growth_factor=3.0)
    scales, _, _ = run_sequence(state, [T, T])
    assert scales == [3.0 * 2.0**126, 3.0 * 2.0**126]
    assert math.isfinite(scales[0])


def test_hysteresis_refill_modes_differ():
    # F, T, F: 'finite' refills on the finite step, so the second overflow does not back off;
    # 'growth' only refills on growth, so the second overflow spends the last unit.
    seq = [F, T, F]
    finite = DynamicLossScale(loss_scale=64.0, growth_interval=10, hysteresis=2,
                              hysteresis_refill="finite")
    growth = DynamicLossScale(loss_scale=64.0, growth_interval=10, hysteresis=2,
                              hysteresis_refill="growth")
    assert run_sequence(finite, seq) == ([64.0, 64.0, 64.0], [0, 1, 0], [1, 2, 1])
    assert run_sequence(growth, seq) == ([64.0, 64.0, 32.0], [0, 1, 0], [1, 1, 0])


def test_hysteresis_growth_refill_sequence():
    state = DynamicLossScale(loss_scale=64.0, growth_interval=2, hysteresis=2,
                             hysteresis_refill="growth")
    seq = [F, T, F, F, T, T, F, F]
    expected = ([64.0, 64.0, 32.0, 16.0, 16.0, 32.0, 32.0, 16.0],
                [0, 1, 0, 0, 1, 0, 0, 0],
                [1, 1, 0, 0, 0, 2, 1, 0])
    assert run_sequence(state, seq) == expected
    assert adjust_loop(state, seq) == expected


def test_hysteresis_finite_refill_sequence():
    state = DynamicLossScale(loss_scale=64.0, growth_interval=2, hysteresis=2,
                             hysteresis_refill="finite")
    seq = [F, T, F, F, T, T, F, F]
    expected = ([64.0, 64.0, 64.0, 32.0, 32.0, 64.0, 64.0, 32.0],
                [0, 1, 0, 0, 1, 0, 0, 0],
                [1, 2, 1, 0, 2, 2, 1, 0])
    assert run_sequence(state, seq) == expected
    assert adjust_loop(state, seq) == expected


def test_hysteresis_three_backs_off_at_the_third_overflow():
    state = DynamicLossScale(loss_scale=64.0, growth_interval=100, hysteresis=3)
    assert run_sequence(state, [F, F, F, F]) == ([64.0, 64.0, 32.0, 16.0], [0, 0, 0, 0],
                                                [2, 1, 0, 0])


# --------------------------------------------------------------------------------------------
# torch.amp.GradScaler's defaults and timing.
# --------------------------------------------------------------------------------------------


def test_defaults_match_torch_grad_scaler():
    # torch.amp.GradScaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
    #                      growth_interval=2000)
    state = DynamicLossScale()
    assert float(state.loss_scale) == 2.0**16
    assert state.growth_factor == 2.0
    assert state.backoff_factor == 0.5
    assert state.growth_interval == 2000
    assert int(state.growth_tracker) == 0
    assert state.hysteresis == 1
    assert int(state.hysteresis_left) == 1
    assert state.min_scale is None
    assert state.max_scale is None
    assert state.hysteresis_refill == "growth"


@jax.jit
def _finite_steps_1999(state):
    return jax.lax.fori_loop(0, 1999, lambda i, s: s.adjust(jnp.array(True)), state)


def test_default_growth_on_the_2000th_consecutive_finite_step():
    state = _finite_steps_1999(DynamicLossScale())
    assert float(state.loss_scale) == 2.0**16
    assert int(state.growth_tracker) == 1999
    grown = _adjust(state, jnp.array(True))
    assert float(grown.loss_scale) == 2.0**17
    assert int(grown.growth_tracker) == 0
    # An overflow instead of the 2000th finite step halves the scale and restarts the count.
    backed = _adjust(state, jnp.array(False))
    assert float(backed.loss_scale) == 2.0**15
    assert int(backed.growth_tracker) == 0


# --------------------------------------------------------------------------------------------
# A plain python model of GradScaler's _amp_update_scale_, with bounds and hysteresis.
# --------------------------------------------------------------------------------------------


def _compare_with_reference(init_scale, seq, **config):
    state = DynamicLossScale(loss_scale=init_scale, **config)
    # Pad to a fixed length so that each configuration compiles once.
    padded = list(seq) + [True] * (60 - len(seq))
    scales, trackers, left = run_sequence(state, padded)
    got = list(zip(scales, trackers, left, strict=True))[:len(seq)]
    assert got == reference_sequence(init_scale, seq, **config)


_INIT_SCALES = [2.0**16, 1.0, 3.0, 1000.0, 2.0**126, 2.0**-120]


@settings(max_examples=200, deadline=None)
@given(
    seq=st.lists(st.booleans(), min_size=1, max_size=60),
    init_scale=st.sampled_from(_INIT_SCALES),
    growth_interval=st.integers(1, 5),
    hysteresis=st.integers(1, 3),
    hysteresis_refill=st.sampled_from(["growth", "finite"]),
    min_scale=st.sampled_from([None, 2.0**-3, 1.0, 3.0]),
    max_scale=st.sampled_from([None, 3.0, 2.0**10, 2.0**100]),
)
def test_matches_reference_model(seq, init_scale, growth_interval, hysteresis,
                                 hysteresis_refill, min_scale, max_scale):
    assume(min_scale is None or max_scale is None or min_scale <= max_scale)
    _compare_with_reference(init_scale, seq, growth_interval=growth_interval, growth_factor=2.0,
                            backoff_factor=0.5, min_scale=min_scale, max_scale=max_scale,
                            hysteresis=hysteresis, hysteresis_refill=hysteresis_refill)


@settings(max_examples=30, deadline=None)
@given(
    seq=st.lists(st.booleans(), min_size=1, max_size=60),
    init_scale=st.sampled_from(_INIT_SCALES),
    growth_interval=st.integers(1, 3),
    growth_factor=st.sampled_from([1.5, 3.0, 4.0]),
    backoff_factor=st.sampled_from([0.25, 0.75, 0.1]),
    hysteresis=st.integers(1, 2),
)
def test_matches_reference_model_with_other_factors(seq, init_scale, growth_interval,
                                                    growth_factor, backoff_factor, hysteresis):
    _compare_with_reference(init_scale, seq, growth_interval=growth_interval,
                            growth_factor=growth_factor, backoff_factor=backoff_factor,
                            min_scale=None, max_scale=None, hysteresis=hysteresis,
                            hysteresis_refill="growth")


# Many sequences at once: one vmapped, scanned call per configuration against the python model.

_BOUNDS = {"none": (None, None), "min": (1.0, None), "max": (None, 2.0**10),
           "both": (1.0, 2.0**10)}
_HYSTERESIS = {"1-growth": (1, "growth"), "1-finite": (1, "finite"),
               "3-growth": (3, "growth"), "3-finite": (3, "finite")}
_MANY_INIT = np.array([F32_TINY, 2.0**-3, 0.75, 1.0, 3.0, 1000.0, 2.0**10, 2.0**11, 2.0**16,
                       2.0**126, 2.0**127], np.float32)
_SEQUENCES, _LENGTH, _GROWTH_INTERVAL = 128, 48, 2


def random_overflow_sequences(rng, n, length):
    """Overflow patterns: independent steps at rates from 1% to 95%, and sticky runs (bursts
    of overflows, long finite stretches). True is a finite step."""
    seqs = np.empty((n, length), bool)
    for i in range(n):
        if i % 2:
            seqs[i] = rng.random(length) >= rng.choice([0.01, 0.1, 0.3, 0.6, 0.95])
        else:
            stay = rng.choice([0.7, 0.9, 0.97])
            state = bool(rng.random() < 0.5)
            for t in range(length):
                seqs[i, t] = state
                if rng.random() > stay:
                    state = not state
    return seqs


@jax.jit
def _run_many(states, finite_seqs):
    return jax.vmap(_run)(states, finite_seqs)


@pytest.mark.parametrize("hysteresis", sorted(_HYSTERESIS))
@pytest.mark.parametrize("bounds", sorted(_BOUNDS))
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_many_random_sequences_match_the_reference_model(bounds, hysteresis, seed):
    # 16 configurations x 5 examples x 128 sequences: 10,240 sequences of 48 steps.
    min_scale, max_scale = _BOUNDS[bounds]
    hyst, refill = _HYSTERESIS[hysteresis]
    config = dict(growth_interval=_GROWTH_INTERVAL, growth_factor=2.0, backoff_factor=0.5,
                  min_scale=min_scale, max_scale=max_scale, hysteresis=hyst,
                  hysteresis_refill=refill)
    rng = np.random.default_rng(seed)
    n = _SEQUENCES
    seqs = random_overflow_sequences(rng, n, _LENGTH)
    inits = rng.choice(_MANY_INIT, n)
    trackers = rng.integers(0, _GROWTH_INTERVAL, n)
    lefts = rng.integers(0, hyst + 1, n)
    states = DynamicLossScale(**config).replace(
        loss_scale=jnp.asarray(inits, jnp.float32), growth_tracker=jnp.asarray(trackers, jnp.int32),
        hysteresis_left=jnp.asarray(lefts, jnp.int32))
    out = _run_many(states, jnp.asarray(seqs))
    got = np.stack([np.asarray(out.loss_scale, np.float64), np.asarray(out.growth_tracker),
                    np.asarray(out.hysteresis_left)], axis=-1)
    for i in range(n):
        want = reference_sequence(float(inits[i]), seqs[i].tolist(), tracker=int(trackers[i]),
                                  left=int(lefts[i]), **config)
        if not np.array_equal(got[i], np.asarray(want, np.float64)):
            t = int(np.argmax(np.any(got[i] != np.asarray(want), axis=-1)))
            raise AssertionError(
                f"sequence {i} (init {inits[i]}, tracker {trackers[i]}, left {lefts[i]}) first "
                f"differs at step {t}: got {got[i][t].tolist()}, reference {list(want[t])}; "
                f"finite {seqs[i][:t + 1].astype(int).tolist()}")
    # The sequences exercise every branch: growth, backoff, both bounds, spent hysteresis.
    scales = got[..., 0]
    assert (np.diff(scales, axis=1) > 0).any() and (np.diff(scales, axis=1) < 0).any()
    if min_scale is not None:
        assert (scales == min_scale).any()
    if max_scale is not None:
        assert (scales == max_scale).any()
    assert np.all(np.isfinite(scales)) and np.all(scales > 0)


def test_the_many_sequences_test_fails_on_a_wrong_rule():
    # The same check against a rule that backs off one overflow too late must fail.
    config = dict(growth_interval=2, growth_factor=2.0, backoff_factor=0.5, min_scale=None,
                  max_scale=None, hysteresis=1, hysteresis_refill="growth")
    seqs = random_overflow_sequences(np.random.default_rng(0), 8, _LENGTH)
    wrong = DynamicLossScale(**{**config, "hysteresis": 2})
    out = _run_many(jax.tree.map(lambda x: jnp.stack([x] * 8), wrong), jnp.asarray(seqs))
    got = np.asarray(out.loss_scale).tolist()
    want = [[s for s, _, _ in reference_sequence(2.0**16, q.tolist(), **config)] for q in seqs]
    assert got != want


def test_reference_model_agrees_with_the_hand_computed_sequences():
    config = dict(growth_interval=2, growth_factor=2.0, backoff_factor=0.5, min_scale=None,
                  max_scale=None, hysteresis=2)
    seq = [F, T, F, F, T, T, F, F]
    assert reference_sequence(64.0, seq, hysteresis_refill="growth", **config) == list(zip(
        [64.0, 64.0, 32.0, 16.0, 16.0, 32.0, 32.0, 16.0], [0, 1, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 2, 1, 0], strict=True))
    assert reference_sequence(64.0, seq, hysteresis_refill="finite", **config) == list(zip(
        [64.0, 64.0, 64.0, 32.0, 32.0, 64.0, 64.0, 32.0], [0, 1, 0, 0, 1, 0, 0, 0],
        [1, 2, 1, 0, 2, 2, 1, 0], strict=True))


# --------------------------------------------------------------------------------------------
# The state is a pytree of arrays; hyperparameters are static.
# --------------------------------------------------------------------------------------------


def _configured_state():
    state = DynamicLossScale(loss_scale=1024.0, growth_interval=7, growth_factor=4.0,
                             backoff_factor=0.25, min_scale=2.0**-3, max_scale=2.0**20,
                             hysteresis=3, hysteresis_refill="finite")
    # Move every leaf off its initial value: scale 1024, tracker 1, budget 2.
    state = state.adjust(jnp.array(False)).adjust(jnp.array(True)).adjust(jnp.array(False))
    state = state.adjust(jnp.array(True))
    return state


_HYPERPARAMETERS = ("growth_interval", "growth_factor", "backoff_factor", "min_scale",
                    "max_scale", "hysteresis", "hysteresis_refill")


def _check_same_state(got, want):
    assert type(got) is type(want)
    for name in _HYPERPARAMETERS:
        assert getattr(got, name) == getattr(want, name), name
    for name in ("loss_scale", "growth_tracker", "hysteresis_left"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype, name
        assert g.shape == w.shape, name
        assert np.asarray(g).tolist() == np.asarray(w).tolist(), name


def test_configured_state_values():
    state = _configured_state()
    assert float(state.loss_scale) == 1024.0
    assert int(state.growth_tracker) == 1
    assert int(state.hysteresis_left) == 3


def test_leaves_are_exactly_the_three_arrays():
    state = _configured_state()
    leaves, treedef = jax.tree.flatten(state)
    assert len(leaves) == 3
    assert [x.dtype for x in leaves] == [jnp.float32, jnp.int32, jnp.int32]
    assert [x.shape for x in leaves] == [(), (), ()]
    assert leaves[0] is state.loss_scale
    assert leaves[1] is state.growth_tracker
    assert leaves[2] is state.hysteresis_left
    assert all(isinstance(x, jax.Array) for x in leaves)
    _check_same_state(jax.tree.unflatten(treedef, leaves), state)


def test_tree_map_keeps_hyperparameters():
    state = _configured_state()
    doubled = jax.tree.map(lambda x: x * 2, state)
    assert float(doubled.loss_scale) == 2048.0
    for name in _HYPERPARAMETERS:
        assert getattr(doubled, name) == getattr(state, name)


@pytest.mark.parametrize("fn", [lambda x: None, lambda x: 0, lambda x: 0.0, lambda x: False,
                                lambda x: x.ndim, lambda x: "spec"],
                         ids=["none", "int_zero", "float_zero", "false", "ndim", "str"])
def test_tree_map_to_non_array_leaves(fn):
    # Prefix trees of in_axes, shardings, masks and checkpoint arguments are built this way.
    state = _configured_state()
    mapped = jax.tree.map(fn, state)
    for name in ("loss_scale", "growth_tracker", "hysteresis_left"):
        want = fn(getattr(state, name))
        got = getattr(mapped, name)
        assert type(got) is type(want), name
        assert got == want, name
    for name in _HYPERPARAMETERS:
        assert getattr(mapped, name) == getattr(state, name)


@pytest.mark.parametrize("leaves", [["a", "b", "c"], ["a", "b", -1], [0.5, 7, -1], [0, 0, 0]],
                         ids=["str", "minus_one", "numbers", "zeros"])
def test_unflatten_returns_exactly_the_given_leaves(leaves):
    treedef = jax.tree.structure(_configured_state())
    state = jax.tree.unflatten(treedef, leaves)
    got = [state.loss_scale, state.growth_tracker, state.hysteresis_left]
    assert [type(x) for x in got] == [type(x) for x in leaves]
    assert got == leaves
    assert state.hysteresis == 3


@pytest.mark.parametrize("value", [None, 0, 0.0, False])
def test_static_tree_map_to_non_array_leaves(value):
    mapped = jax.tree.map(lambda x: value, StaticLossScale(2.0**15))
    assert type(mapped.loss_scale) is type(value)
    assert mapped.loss_scale == value


def test_vmap_with_an_in_axes_tree():
    state = _configured_state()
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), state)
    in_axes = jax.tree.map(lambda _: 0, state)
    out = jax.vmap(lambda s, f: s.adjust(f), in_axes=(in_axes, 0))(stacked,
                                                                  jnp.array([True, False]))
    assert np.asarray(out.loss_scale).tolist() == [1024.0, 1024.0]
    assert np.asarray(out.hysteresis_left).tolist() == [3, 2]


def test_jit_identity_keeps_everything():
    state = _configured_state()
    _check_same_state(jax.jit(lambda s: s)(state), state)


def test_jit_adjust_keeps_hyperparameters():
    state = _configured_state()
    out = jax.jit(lambda s: s.adjust(jnp.array(False)))(state)
    for name in _HYPERPARAMETERS:
        assert getattr(out, name) == getattr(state, name)
    assert float(out.loss_scale) == 1024.0
    assert int(out.growth_tracker) == 0
    assert int(out.hysteresis_left) == 2


def test_min_scale_survives_jit():
    # jmp's DynamicLossScale drops min_loss_scale when flattened, so it is 1.0 after jit.
    state = DynamicLossScale(loss_scale=2.0**11, min_scale=2.0**10)
    passed = jax.jit(lambda s: s)(state)
    assert passed.min_scale == 2.0**10
    scales, _, _ = run_sequence(state, [F, F, F])
    assert scales == [2.0**10, 2.0**10, 2.0**10]
    out = jax.jit(lambda s: s.adjust(False).adjust(False))(state)
    assert out.min_scale == 2.0**10
    assert float(out.loss_scale) == 2.0**10


def test_pmap_over_eight_devices():
    assert jax.device_count() == 8
    state = _configured_state()
    stacked = jax.tree.map(lambda x: jnp.stack([x] * 8), state)
    finite = jnp.array([True, False] * 4)
    out = jax.pmap(lambda s, f: s.adjust(f))(stacked, finite)
    for name in _HYPERPARAMETERS:
        assert getattr(out, name) == getattr(state, name)
    assert out.loss_scale.dtype == jnp.float32
    assert out.loss_scale.shape == (8,)
    assert np.asarray(out.loss_scale).tolist() == [1024.0] * 8
    assert np.asarray(out.growth_tracker).tolist() == [2, 0] * 4
    assert np.asarray(out.hysteresis_left).tolist() == [3, 2] * 4


def test_jit_lower_compile():
    state = _configured_state()

    def step(s):
        return s.adjust(jnp.array(False))

    compiled = jax.jit(step).lower(state).compile()
    out = compiled(state)
    _check_same_state(out, step(state))
    _check_same_state(jax.jit(lambda s: s).lower(state).compile()(state), state)


def test_jmp_dynamic_loss_scale_cannot_be_lowered():
    # For contrast: jmp's class runs array checks in __init__, which fails on lowering.
    state = jmp.DynamicLossScale(jnp.float32(2.0**15))
    with pytest.raises(TypeError, match="not a valid JAX type"):
        jax.jit(lambda s: s).lower(state).compile()


def _save_restore_standard(path, state):
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            checkpointer.save(path, state)
            checkpointer.wait_until_finished()
        except Exception as e:
            # Orbax's traceback runs through asyncio and is long; report the error itself.
            pytest.fail(f"StandardCheckpointer.save failed: {type(e).__name__}: {e}",
                        pytrace=False)
        restored = checkpointer.restore(path, state)
        abstract = checkpointer.restore(path, jax.eval_shape(lambda: state))
    return restored, abstract


def _save_restore_pytree(path, state):
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(path, state)
        restored = checkpointer.restore(path, item=state)
    return restored, restored


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
@pytest.mark.parametrize("save_restore", [_save_restore_standard, _save_restore_pytree],
                         ids=["standard", "pytree"])
def test_orbax_save_restore(tmp_path, save_restore):
    state = _configured_state()
    restored, abstract = save_restore(tmp_path / "checkpoint", state)
    _check_same_state(restored, state)
    _check_same_state(abstract, state)
    # The restored state keeps working.
    _check_same_state(_adjust(restored, jnp.array(True)), _adjust(state, jnp.array(True)))


# --------------------------------------------------------------------------------------------
# Scaling and unscaling.
# --------------------------------------------------------------------------------------------


def test_scale_an_fp32_loss_above_the_fp16_range():
    state = DynamicLossScale(loss_scale=2.0**20)
    loss = jnp.float32(1e-3)
    scaled = state.scale(loss)
    assert scaled.dtype == jnp.float32
    assert np.asarray(scaled).tobytes() == (np.float32(1e-3) * np.float32(2.0**20)).tobytes()
    assert float(state.unscale(scaled)) == float(np.float32(1e-3))


def test_scale_an_fp16_value_above_the_fp16_range():
    # 2**20 does not fit in fp16, but fp16(1e-3) * 2**20 = 1049 does.
    state = DynamicLossScale(loss_scale=2.0**20)
    scaled = state.scale(jnp.float16(1e-3))
    assert scaled.dtype == jnp.float16
    assert float(scaled) == 1049.0


def test_scale_fp16_with_the_default_dynamic_scale():
    # The default initial scale, 2**16, is above the fp16 max (65504).
    scaled = DynamicLossScale().scale({"x": jnp.array([2.0**-10, -1.0], jnp.float16)})
    assert scaled["x"].dtype == jnp.float16
    # 2**-10 * 2**16 = 64 fits; -1 * 2**16 genuinely overflows fp16.
    assert np.asarray(scaled["x"], np.float32).tolist() == [64.0, -math.inf]


def test_static_scale_above_the_fp16_range_with_fp16_grads():
    state = StaticLossScale(2.0**17)
    grads = {"w": jnp.array([1.0, 65504.0, -2.0], jnp.float16), "n": jnp.array([3])}
    unscaled = jax.jit(lambda s, g: s.unscale(g))(state, grads)
    assert unscaled["w"].dtype == jnp.float32
    assert np.asarray(unscaled["w"]).tolist() == [2.0**-17, 65504.0 * 2.0**-17, -(2.0**-16)]
    assert unscaled["n"] is not None and unscaled["n"].dtype == jnp.int32
    for finite in (True, False):
        out = _adjust(state, jnp.array(finite))
        assert float(out.loss_scale) == 2.0**17
        assert out.loss_scale.dtype == jnp.float32


def test_unscale_returns_fp32_for_every_floating_dtype():
    state = DynamicLossScale(loss_scale=2.0**20)
    tree = {"f16": jnp.array([1024.0], jnp.float16), "bf16": jnp.array([2.0**30], jnp.bfloat16),
            "f32": jnp.array([3.0], jnp.float32), "i": jnp.array([5], jnp.int32)}
    out = state.unscale(tree)
    assert out["f16"].dtype == out["bf16"].dtype == out["f32"].dtype == jnp.float32
    assert np.asarray(out["f16"]).tolist() == [2.0**-10]
    assert np.asarray(out["bf16"]).tolist() == [2.0**10]
    assert np.asarray(out["f32"]).tolist() == [3.0 * 2.0**-20]
    assert out["i"] is tree["i"]


def test_noop_scale_and_unscale():
    state = NoOpLossScale()
    x = jnp.array([1.5], jnp.bfloat16)
    assert state.scale(x).dtype == jnp.bfloat16
    assert np.asarray(state.scale(x), np.float32).tolist() == [1.5]
    assert state.unscale(x).dtype == jnp.float32
    assert state.adjust(jnp.array(False)) is state


# --------------------------------------------------------------------------------------------
# Validation.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 0.0, -1, -1.0, math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("cls", [DynamicLossScale, StaticLossScale])
def test_bad_loss_scale(cls, value):
    with pytest.raises(ValueError, match="loss_scale"):
        cls(loss_scale=value)


@pytest.mark.parametrize("kwargs, name", [
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(growth_factor=0.5), "growth_factor"),
    (dict(growth_factor=math.inf), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=0), "backoff_factor"),
    (dict(backoff_factor=1.5), "backoff_factor"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(hysteresis=-1), "hysteresis"),
    (dict(min_scale=2.0, max_scale=1.0), "min_scale"),
    (dict(min_scale=0.0), "min_scale"),
    (dict(max_scale=-1.0), "max_scale"),
    (dict(max_scale=math.nan), "max_scale"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_interval=-3), "growth_interval"),
    (dict(growth_interval=2.5), "growth_interval"),
    (dict(hysteresis_refill="never"), "hysteresis_refill"),
])
def test_bad_hyperparameters(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DynamicLossScale(**kwargs)


# --------------------------------------------------------------------------------------------
# all_finite.
# --------------------------------------------------------------------------------------------


_all_finite_jit = jax.jit(all_finite)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_all_finite_detects_non_finite_values(dtype, bad):
    bad_leaf = jnp.array([1.0, bad, 2.0], dtype)
    ok = [jnp.ones(3, jnp.float32), jnp.array([4.0], jnp.bfloat16), jnp.array([5.0], jnp.float16)]
    ints = jnp.array([2**31 - 1, -(2**31)], jnp.int32)
    for position in range(4):  # the bad leaf first, in the middle and last
        leaves = ok[:position] + [bad_leaf] + ok[position:]
        tree = {"leaves": leaves, "ints": ints}
        for fn in (all_finite, _all_finite_jit):
            result = fn(tree)
            assert result.dtype == jnp.bool_
            assert result.shape == ()
            assert not bool(result), position
        assert bool(all_finite({"leaves": ok, "ints": ints}))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_all_finite_true_for_finite_values(dtype):
    big = float(jnp.finfo(dtype).max)
    tree = [jnp.array([big, -big, 0.0], dtype), {"x": jnp.array([[1e-30]], jnp.float32)}]
    assert bool(all_finite(tree))
    assert bool(_all_finite_jit(tree))


def test_all_finite_ignores_non_floating_leaves():
    tree = {"i": jnp.array([1, 2], jnp.int32), "b": jnp.array([True]), "u": np.uint8(255),
            "n": None}
    assert bool(all_finite(tree))
    assert bool(_all_finite_jit(tree))


@pytest.mark.parametrize("tree", [{}, [], (), None, {"a": None}])
def test_all_finite_on_an_empty_tree(tree):
    result = all_finite(tree)
    assert result.dtype == jnp.bool_
    assert bool(result)


def test_all_finite_single_bad_element_in_a_large_array():
    x = jnp.zeros((64, 64), jnp.bfloat16).at[63, 17].set(jnp.inf)
    assert not bool(_all_finite_jit({"w": x}))


# --------------------------------------------------------------------------------------------
# dtypes stay put.
# --------------------------------------------------------------------------------------------


def _leaf_types(tree):
    return [(x.dtype, x.shape, x.weak_type) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("finite", [True, False])
@pytest.mark.parametrize("state", [
    DynamicLossScale(),
    DynamicLossScale(loss_scale=3.0, growth_interval=1, hysteresis=2, min_scale=1.0,
                     max_scale=4.0, hysteresis_refill="finite"),
    StaticLossScale(2.0**15),
    StaticLossScale(),
], ids=["dynamic", "dynamic_configured", "static", "static_default"])
def test_adjust_keeps_dtypes_and_strong_types(state, finite):
    before = _leaf_types(state)
    assert all(not weak for _, _, weak in before)
    out = _adjust(state, jnp.array(finite))
    assert _leaf_types(out) == before
    assert out.loss_scale.dtype == jnp.float32
    assert not out.loss_scale.weak_type


def test_dynamic_leaf_dtypes():
    assert _leaf_types(DynamicLossScale()) == [(jnp.float32, (), False), (jnp.int32, (), False),
                                               (jnp.int32, (), False)]


@pytest.mark.parametrize("finite", [True, False])
def test_noop_adjust_keeps_a_strong_fp32_scale(finite):
    state = NoOpLossScale()
    out = _adjust(state, jnp.array(finite))
    assert jax.tree.leaves(out) == []
    assert out.loss_scale.dtype == jnp.float32
    assert not out.loss_scale.weak_type
    assert float(out.loss_scale) == 1.0


def test_loss_scale_union_and_exports():
    assert jaxamp.LossScale == NoOpLossScale | StaticLossScale | DynamicLossScale
    assert jaxamp.gradients.all_finite is all_finite
