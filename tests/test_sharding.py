"""Data parallelism under ``jax.jit``: the fp32 gradient reduction, and the sharded (ZeRO) state
of ``jaxamp.parallel.state_sharding``, on 8 virtual CPU devices.

``pytest tests/test_sharding.py -s -k equals_replicated`` prints the per-device state bytes of
each layout."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_tree_bitwise_equal
from helpers import reference_sequence
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._jaxpr import walk

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
N = 8
BATCH = 32
LAYOUTS = ("replicated", "zero1", "zero3")


# --------------------------------------------------------------------------------------------
# A model with leaves above and below the sharding threshold, its loss and batches
# --------------------------------------------------------------------------------------------

def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "l1": {"kernel": jnp.asarray(rng.normal(size=(16, 256)) * 0.25, F32),   # 4096: split
               "bias": jnp.zeros((256,), F32)},                                  # replicated
        "l2": {"kernel": jnp.asarray(rng.normal(size=(256, 64)) * 0.06, F32),   # split
               "bias": jnp.zeros((64,), F32)},
        "out": {"kernel": jnp.asarray(rng.normal(size=(64, 1)) * 0.1, F32)},    # replicated
    }


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["l1"]["kernel"] + params["l1"]["bias"])
    h = jnp.tanh(h @ params["l2"]["kernel"] + params["l2"]["bias"])
    pred = (h @ params["out"]["kernel"])[:, 0].astype(F32)
    return jnp.mean(batch["poison"].astype(F32) * (pred - batch["y"].astype(F32)) ** 2)


def make_batch(seed=1, n=BATCH):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    y = (np.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2]).astype(np.float32)
    return {"x": x, "y": y, "poison": np.ones((n,), np.float32)}


def poisoned(batch, row):
    out = {k: np.array(v) for k, v in batch.items()}
    out["poison"][row] = np.inf
    return out


def make_state(policy="mixed_float16", inner=None, loss_scale=None, **kwargs):
    tx = jaxamp.mixed_precision(optax.adamw(1e-2) if inner is None else inner, policy,
                                loss_scale=loss_scale)
    return jaxamp.TrainState.create(params=init_params(), tx=tx, **kwargs)


def mesh_of(n=N, kind=AxisType.Explicit, name="batch"):
    return jax.make_mesh((n,), (name,), axis_types=(kind,), devices=jax.devices()[:n])


def shardings(state, mesh, layout):
    if layout == "replicated":
        return jax.tree.map(lambda _: NamedSharding(mesh, P()), state)
    return jaxamp.parallel.state_sharding(state, mesh,
                                 params="sharded" if layout == "zero3" else "replicated")


def jit_step(state, mesh, layout, **step_kwargs):
    """``(placed state, jitted step, batch sharding)`` for ``layout`` on ``mesh``."""
    sh = shardings(state, mesh, layout)
    batch_sh = jaxamp.parallel.batch_sharding(mesh)
    step = jax.jit(jaxamp.make_train_step(loss_fn, **step_kwargs),
                   in_shardings=(sh, batch_sh),
                   out_shardings=(sh, NamedSharding(mesh, P())), donate_argnums=0)
    # A copy: the step donates it, and device_put may share the buffers of ``state``.
    return jax.device_put(jax.tree.map(jnp.copy, state), sh), step, batch_sh


def master_of(state):
    return jax.device_get(state.master_params)


def host_leaves(state):
    """The state's leaves on the host, PRNG keys as their raw data."""
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree.leaves(state)]


# --------------------------------------------------------------------------------------------
# The rule and state_sharding
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, expected", [
    ((16, 256), P(None, "batch")),        # the largest dimension that 8 divides
    ((256, 64), P("batch")),
    ((64, 64), P("batch")),               # a tie: the first
    ((30522, 1024), P(None, "batch")),    # 30522 is not a multiple of 8
    ((4095,), P()),                       # below min_size: replicated
    ((4096,), P("batch")),
    ((4100, 3), P()),                     # no dimension divisible by 8
    ((), P()),
])
def test_zero_spec_rule(shape, expected):
    assert jaxamp.parallel.zero_spec(shape, "batch", 8) == expected


def test_zero_spec_keeps_another_axis_and_takes_a_free_dimension():
    assert jaxamp.parallel.zero_spec((256, 64), "data", 4, base=P("model")) == P("model", "data")
    assert (jaxamp.parallel.zero_spec((256, 64), "data", 4, base=P(None, "model"))
            == P("data", "model"))
    # Already split over the axis: kept as it is.
    assert jaxamp.parallel.zero_spec((256, 64), "data", 4, base=P("data")) == P("data")
    assert jaxamp.parallel.zero_spec((512, 512), ("a", "b"), 8) == P(("a", "b"))


@pytest.mark.parametrize("params_mode", ["replicated", "sharded"])
def test_state_sharding_splits_the_master_and_the_moments(params_mode):
    state = make_state("mixed_bfloat16", rng=jax.random.key(0),
                       model_state={"mean": jnp.zeros((4096,))})
    mesh = mesh_of()
    for tree in (state, jax.eval_shape(lambda: state)):   # concrete or abstract
        sh = jaxamp.parallel.state_sharding(tree, mesh, params=params_mode)
        assert jax.tree.structure(sh) == jax.tree.structure(state)
        mp = jaxamp.state.find_state(sh.opt_state)
        adam = mp.inner_state[0]
        for tree_of_specs in (mp.master.params, adam.mu, adam.nu):
            assert tree_of_specs["l1"]["kernel"].spec == P(None, "batch")
            assert tree_of_specs["l2"]["kernel"].spec == P("batch")
            assert tree_of_specs["l1"]["bias"].spec == P()
            assert tree_of_specs["out"]["kernel"].spec == P()
        want = P(None, "batch") if params_mode == "sharded" else P()
        assert sh.params["l1"]["kernel"].spec == want
        for replicated in (sh.step, sh.rng, sh.model_state["mean"], adam.count,
                           mp.health.applied_steps, mp.health.skipped_steps):
            assert replicated.spec == P()
        assert all(s.mesh == mesh for s in jax.tree.leaves(sh))


def test_state_sharding_bad_input_names_the_value_and_the_fix():
    state = make_state()
    with pytest.raises(ValueError, match=r"axis='data' is not an axis of the mesh.*'batch'"):
        jaxamp.parallel.state_sharding(state, mesh_of(), axis="data")
    with pytest.raises(ValueError, match="params must be 'replicated'.*'sharded'.*got 'all'"):
        jaxamp.parallel.state_sharding(state, mesh_of(), params="all")
    with pytest.raises(TypeError, match="expects a jaxamp.TrainState"):
        jaxamp.parallel.state_sharding(state.params, mesh_of())
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        jaxamp.parallel.state_sharding(state, "batch")
    with pytest.raises(ValueError, match="min_size"):
        jaxamp.parallel.state_sharding(state, mesh_of(), min_size=0)


# --------------------------------------------------------------------------------------------
# The gradient reduction is an explicit fp32 collective
# --------------------------------------------------------------------------------------------

_REDUCTIONS = ("psum", "psum_invariant", "reduce_scatter", "psum_scatter")


def collectives(step_fn, state, batch):
    """``(primitive, operand dtype, operand shape)`` of every collective in the step's jaxpr."""
    jaxpr = jax.make_jaxpr(step_fn)(state, batch)
    return [(eqn.primitive.name, jnp.dtype(eqn.invars[0].aval.dtype),
             tuple(eqn.invars[0].aval.shape))
            for eqn, _ in walk(jaxpr) if eqn.primitive.name in _REDUCTIONS + ("all_gather",)]


@pytest.mark.parametrize("kind, layout", [(AxisType.Auto, "replicated"),
                                          (AxisType.Explicit, "replicated"),
                                          (AxisType.Explicit, "zero1"),
                                          (AxisType.Explicit, "zero3")])
@pytest.mark.parametrize("reduce_dtype", [F32, BF16])
def test_the_gradients_of_bf16_params_are_reduced_in_reduce_dtype(kind, layout, reduce_dtype):
    mesh = mesh_of(kind=kind)
    state = make_state("mixed_bfloat16")
    state, _, batch_sh = jit_step(state, mesh, layout)
    batch = jaxamp.parallel.put_sharded(make_batch(), batch_sh)
    found = collectives(jaxamp.make_train_step(loss_fn, reduce_dtype=reduce_dtype), state, batch)
    master = jaxamp.state.find_state(state.opt_state).master.params
    shapes = {tuple(x.shape) for x in jax.tree.leaves(master)}
    shards = {tuple(s.data.shape) for x in jax.tree.leaves(master) for s in x.addressable_shards}
    grads = [f for f in found if f[0] in _REDUCTIONS and f[2] in shapes]
    # Every param leaf's gradient goes through one explicit reduction, in reduce_dtype.
    assert len(grads) == len(jax.tree.leaves(master)), found
    assert {dtype for _, dtype, _ in grads} == {jnp.dtype(reduce_dtype)}, found
    scattered = [f for f in grads if f[0] in ("reduce_scatter", "psum_scatter")]
    if layout == "replicated":
        assert not scattered
    else:   # the two split kernels go straight onto their shards
        assert len(scattered) == 2 and shards >= {(16, 32), (32, 64)}
    gathers = [f for f in found if f[0] == "all_gather"]
    assert len(gathers) == (2 if layout == "zero3" else 0)
    assert all(dtype == BF16 for _, dtype, _ in gathers)   # params gathered in bf16


def test_the_working_params_are_cast_on_the_master_shards_and_gathered_in_half():
    """ZeRO-1/2: each device casts its shard of the master, and the fp16 shards are gathered,
    not the fp32 master. XLA:CPU keeps fp16 collectives (it computes bf16 ones in fp32), so the
    compiled HLO shows the dtype."""
    placed, step, batch_sh = jit_step(make_state("mixed_float16"), mesh_of(), "zero1")
    batch = jaxamp.parallel.put_sharded(make_batch(), batch_sh)
    text = step.lower(placed, batch).compile().as_text()
    gathers = [line for line in text.splitlines() if re.search(r" all-gather(-start)?\(", line)]
    assert len(gathers) == 2, gathers   # the two split kernels
    assert all(re.search(r"= f16\[", line) for line in gathers), gathers


def test_without_a_data_axis_the_reduction_is_left_to_xla():
    """``data_axis=None`` is the implicit reduction (no collective in the jaxpr)."""
    mesh = mesh_of(kind=AxisType.Auto)
    state, _, batch_sh = jit_step(make_state("mixed_bfloat16"), mesh, "replicated")
    batch = jaxamp.parallel.put_sharded(make_batch(), batch_sh)
    assert not collectives(jaxamp.make_train_step(loss_fn, data_axis=None), state, batch)


# --------------------------------------------------------------------------------------------
# Sharded state equals replicated state
# --------------------------------------------------------------------------------------------

def run_layout(layout, kind, steps=20, skip_at=11):
    mesh = mesh_of(kind=kind)
    scale = jaxamp.DynamicLossScale(loss_scale=2.0**20, growth_interval=3)
    state, step, batch_sh = jit_step(make_state(loss_scale=scale), mesh, layout)
    history = []
    for i in range(steps):
        batch = make_batch(seed=i)
        batch = poisoned(batch, 5) if i == skip_at else batch
        state, m = step(state, jaxamp.parallel.put_sharded(batch, batch_sh))
        history.append((float(m["loss_scale"]), bool(m["grads_finite"]), float(m["loss"])))
    return state, history


def small_leaf_bytes(state, sh):
    """The bytes of the leaves ``sh`` leaves replicated."""
    return sum(x.nbytes for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(sh), strict=True)
               if s.spec == P())


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_sharded_state_equals_replicated_state_over_20_steps(kind, capsys):
    states, histories = {}, {}
    for layout in LAYOUTS:
        states[layout], histories[layout] = run_layout(layout, kind)
    ref = histories["replicated"]
    # The scale grows, backs off on fp16 overflows and on the injected inf: GradScaler's rule.
    finite = [f for _, f, _ in ref]
    scales = [s for s, _, _ in ref]
    expected = reference_sequence(2.0**20, finite, growth_interval=3, growth_factor=2.0,
                                  backoff_factor=0.5, min_scale=None, max_scale=None,
                                  hysteresis=1, hysteresis_refill="growth")
    assert scales == [2.0**20] + [s for s, _, _ in expected[:-1]]
    assert not finite[11] and finite.count(True) >= 8
    assert any(b > a for a, b in zip(scales, scales[1:], strict=False))   # a growth
    for layout in ("zero1", "zero3"):
        assert [h[:2] for h in histories[layout]] == [h[:2] for h in ref]
        np.testing.assert_allclose([h[2] for h in histories[layout]], [h[2] for h in ref],
                                   rtol=1e-6)
        for a, b in zip(jax.tree.leaves(master_of(states[layout])),
                        jax.tree.leaves(master_of(states["replicated"])), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # Per-device bytes: at most 1/8 of the replicated state plus its replicated small leaves.
    rep = states["replicated"]
    full = jaxamp.parallel.per_device_bytes(rep)
    with capsys.disabled():
        print()
        for layout in LAYOUTS:
            sh = shardings(rep, mesh_of(kind=kind), layout)
            got = jaxamp.parallel.per_device_bytes(states[layout])
            assert got == jaxamp.parallel.per_device_bytes(rep, sh)   # as the shardings predict
            assert got <= full / N + small_leaf_bytes(rep, sh), layout
            print(f"  {kind.name} {layout}: {got} bytes per device ({got / full:.3f}x replicated;"
                  f" the small replicated leaves: {small_leaf_bytes(rep, sh)})")
    per_device = jaxamp.parallel.per_device_bytes
    assert per_device(states["zero3"]) < per_device(states["zero1"])


def test_an_inf_on_one_device_skips_the_step_everywhere_with_the_sharded_state_unchanged():
    mesh = mesh_of()
    state, step, batch_sh = jit_step(make_state(), mesh, "zero3")
    state, _ = step(state, jaxamp.parallel.put_sharded(make_batch(), batch_sh))
    before = jax.device_get(state)
    for row in (0, 13, 31):   # on device 0, 3 and 7
        state, m = step(state, jaxamp.parallel.put_sharded(poisoned(make_batch(seed=2), row),
                                                           batch_sh))
        assert not bool(m["grads_finite"])
        after = jax.device_get(state)
        mp_before, mp_after = (jaxamp.state.find_state(s.opt_state) for s in (before, after))
        assert_tree_bitwise_equal(after.params, before.params)
        assert_tree_bitwise_equal(mp_after.master.params, mp_before.master.params)
        assert_tree_bitwise_equal(mp_after.inner_state, mp_before.inner_state)
        assert float(mp_after.loss_scale.loss_scale) == float(mp_before.loss_scale.loss_scale) / 2
        before = after
    # Every shard of every device holds the same (skipped) state.
    for x in jax.tree.leaves(state):
        assert x.sharding.mesh == mesh


# --------------------------------------------------------------------------------------------
# The three layouts agree: pmap, a data-parallel jit, and one device
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "plain optax"])
def test_pmap_and_the_data_parallel_jit_are_bit_identical(policy):
    if policy == "plain optax":   # no mixed_precision: the params are the master
        state = jaxamp.TrainState.create(params=init_params(), tx=optax.adamw(1e-2))
    else:
        state = make_state(policy)
    batch = make_batch()
    pstep = jax.pmap(jaxamp.make_train_step(loss_fn, axis_name="batch"), axis_name="batch")
    pstate = jaxamp.parallel.replicate(state)
    jstate, jstep, batch_sh = jit_step(state, mesh_of(), "zero1")
    single = state
    sstep = jax.jit(jaxamp.make_train_step(loss_fn, accum_steps=N))
    for _ in range(4):
        pstate, pm = pstep(pstate, jaxamp.parallel.shard_batch(batch))
        jstate, jm = jstep(jstate, jaxamp.parallel.put_sharded(batch, batch_sh))
        single, sm = sstep(single, batch)
        assert float(pm["loss"][0]) == float(jm["loss"])
    pstate = jaxamp.parallel.unreplicate(pstate)
    assert_tree_bitwise_equal(jax.device_get(pstate.params), jax.device_get(jstate.params))
    assert_tree_bitwise_equal(master_of(pstate), master_of(jstate))
    # One device taking the same 8 micro-batches, summed in fp32: the same gradients (the
    # fp32 sum may associate differently).
    for a, b in zip(jax.tree.leaves(master_of(single)), jax.tree.leaves(master_of(jstate)),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_model_state_rng_aux_and_accumulation_under_a_data_parallel_jit_equal_pmap():
    def bn_loss(params, batch, model_state, rng):
        keep = jax.random.bernoulli(rng, 0.9, batch["x"].shape)
        x = jnp.where(keep, batch["x"], 0)
        mean = x.mean(0).astype(F32)
        new_state = {"mean": 0.9 * model_state["mean"] + 0.1 * mean,
                     "count": model_state["count"] + 1}
        loss = loss_fn(params, {**batch, "x": x})
        return loss, new_state, {"mean_x": jnp.mean(mean), "pred": x[:, 0]}

    flags = dict(has_model_state=True, has_rng=True, has_aux=True, accum_steps=2)
    state = make_state(model_state={"mean": jnp.zeros((16,)), "count": jnp.zeros((), jnp.int32)},
                       rng=jax.random.key(3))
    pstep = jax.pmap(jaxamp.make_train_step(bn_loss, axis_name="batch", **flags),
                     axis_name="batch")
    pstate = jaxamp.parallel.replicate(state)
    mesh = mesh_of()
    sh = jaxamp.parallel.state_sharding(state, mesh, params="sharded")
    jstep = jax.jit(jaxamp.make_train_step(bn_loss, **flags))
    jstate = jax.device_put(state, sh)
    for i in range(3):
        batch = make_batch(seed=i)
        pstate, pm = pstep(pstate, jaxamp.parallel.shard_batch(batch))
        jstate, jm = jstep(jstate, jaxamp.parallel.put_sharded(
            batch, jaxamp.parallel.batch_sharding(mesh)))
    # Aux: one entry per micro-batch of each device (device-major), as pmap gives them.
    assert jm["aux"]["mean_x"].shape == (N * 2,)
    assert jm["aux"]["pred"].shape == (N * 2, BATCH // N // 2)
    np.testing.assert_array_equal(np.asarray(pm["aux"]["mean_x"]).reshape(-1),
                                  np.asarray(jm["aux"]["mean_x"]))
    pstate = jaxamp.parallel.unreplicate(pstate)
    assert_tree_bitwise_equal(jax.device_get(pstate.model_state),
                              jax.device_get(jstate.model_state))
    # Integer leaves are not averaged: 2 micro-batches per applied step (skips discard it).
    applied = int(jaxamp.state.find_state(jstate.opt_state).health.applied_steps)
    assert applied >= 1 and int(jstate.model_state["count"]) == 2 * applied
    assert_tree_bitwise_equal(master_of(pstate), master_of(jstate))


def test_a_two_axis_mesh_reduces_over_the_data_axis():
    """A (data, model) mesh: the batch is split over 'data', the state over 'data' too."""
    state = make_state("mixed_bfloat16")
    batch = make_batch()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    sh = jaxamp.parallel.state_sharding(state, mesh, axis="data", params="sharded")
    batch_sh = NamedSharding(mesh, P("data"))
    step = jax.jit(jaxamp.make_train_step(loss_fn, data_axis="data"))
    two = jax.device_put(state, sh)
    mesh4 = mesh_of(4)
    one, step4, batch_sh4 = jit_step(state, mesh4, "zero3")
    for _ in range(3):
        two, _ = step(two, jaxamp.parallel.put_sharded(batch, batch_sh))
        one, _ = step4(one, jaxamp.parallel.put_sharded(batch, batch_sh4))
    assert two.opt_state.master.params["l2"]["kernel"].sharding.is_equivalent_to(
        NamedSharding(mesh, P("data")), 2)
    for a, b in zip(jax.tree.leaves(master_of(two)), jax.tree.leaves(master_of(one)),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # Without data_axis the step cannot tell which axis splits a batch on Auto axes: XLA
    # reduces, in bf16, and a warning names the fix.
    auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    args = (jax.device_put(state, NamedSharding(auto, P())),
            jaxamp.parallel.put_sharded(batch, NamedSharding(auto, P("data"))))
    with pytest.warns(UserWarning, match=r"no axis named 'batch'.*data_axis='data'"):
        jax.jit(jaxamp.make_train_step(loss_fn))(*args)
    assert not collectives(jaxamp.make_train_step(loss_fn, data_axis=None), *args)
    # On Explicit axes the batch's type names the axis: no data_axis needed.
    found = collectives(jaxamp.make_train_step(loss_fn), two,
                        jaxamp.parallel.put_sharded(batch, batch_sh))
    assert found and {d for name, d, _ in found if name != "all_gather"} == {jnp.dtype(F32)}


def test_tensor_parallel_params_keep_their_axis_and_gain_the_data_axis():
    """Params split over 'model' (tensor parallelism, on Auto axes, where XLA partitions the
    model): state_sharding keeps that and splits a free dimension over 'data'; the step
    reduces over 'data' only, and trains as data parallelism over 4 devices does. Plain SGD,
    whose update is the gradient itself: Adam's normalized update would hide a gradient off
    by a factor (a reduction over the wrong axes) and magnify rounding differences."""
    state = make_state("mixed_bfloat16", inner=optax.sgd(0.1))
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    tp = {"l1": {"kernel": P(None, "model"), "bias": P("model")},
          "l2": {"kernel": P("model"), "bias": P()}, "out": {"kernel": P()}}

    def on_model_axis(tree):
        return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
                            tree, tp)
    mp = jaxamp.state.find_state(state.opt_state)
    state = state.replace(params=on_model_axis(state.params), opt_state=mp._replace(
        master=mp.master._replace(params=on_model_axis(mp.master.params))))
    sh = jaxamp.parallel.state_sharding(state, mesh, axis="data", params="sharded")
    assert sh.opt_state.master.params["l1"]["kernel"].spec == P("data", "model")
    assert sh.params["l2"]["kernel"].spec == P("model", "data")
    batch_sh = NamedSharding(mesh, P("data"))
    step = jax.jit(jaxamp.make_train_step(loss_fn, data_axis="data"),
                   in_shardings=(sh, batch_sh), out_shardings=(sh, NamedSharding(mesh, P())))
    two = jax.device_put(state, sh)
    one, step4, batch_sh4 = jit_step(make_state("mixed_bfloat16", inner=optax.sgd(0.1)),
                                     mesh_of(4), "zero3")
    start = master_of(one)
    for i in range(3):
        two, _ = step(two, jaxamp.parallel.put_sharded(make_batch(seed=i), batch_sh))
        one, _ = step4(one, jaxamp.parallel.put_sharded(make_batch(seed=i), batch_sh4))
    assert two.opt_state.master.params["l1"]["kernel"].sharding.spec == P("data", "model")
    # XLA may split the model's matmuls over 'model' too (from jax 0.11 it does): bf16
    # partial sums, so not the bits of data parallelism. What three steps moved each leaf
    # agrees to bf16 rounding (measured: within 2%, the most in a bias, whose gradient sums
    # the batch with cancellation; DP itself is 0.5-5% from an fp32 run), where a reduction
    # over the wrong axes would be off by half or more.
    for a, b, s in zip(jax.tree.leaves(master_of(two)), jax.tree.leaves(master_of(one)),
                       jax.tree.leaves(start), strict=True):
        moved = np.asarray(b, np.float64) - s
        assert np.linalg.norm(np.asarray(a, np.float64) - b) <= 0.05 * np.linalg.norm(moved)


def test_tensor_parallel_on_explicit_axes_reduce_scatters_each_block():
    """On Explicit (data, model) axes a gradient split over 'model' is reduce-scattered over
    'data' on each device's own block, in fp32 (a nested shard_map: JAX cannot lower
    psum_scatter in a shard_map that leaves an Explicit axis), and trains as data
    parallelism over 4 devices does, bit for bit: the model splits l1's columns, no sum."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    tp = {"l1": {"kernel": P(None, "model"), "bias": P("model")},
          "l2": {"kernel": P(), "bias": P()}, "out": {"kernel": P()}}

    def tp_loss(params, batch):  # loss_fn, with l1's output gathered from its 'model' split
        h = jnp.tanh(batch["x"] @ params["l1"]["kernel"] + params["l1"]["bias"])
        h = jnp.tanh(jax.sharding.reshard(h, P()) @ params["l2"]["kernel"] + params["l2"]["bias"])
        pred = (h @ params["out"]["kernel"])[:, 0].astype(F32)
        return jnp.mean(batch["poison"].astype(F32) * (pred - batch["y"].astype(F32)) ** 2)

    def on_model_axis(tree):
        return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
                            tree, tp)
    state = make_state("mixed_bfloat16")
    mp = jaxamp.state.find_state(state.opt_state)
    state = state.replace(params=on_model_axis(state.params), opt_state=mp._replace(
        master=mp.master._replace(params=on_model_axis(mp.master.params))))
    sh = jaxamp.parallel.state_sharding(state, mesh, axis="data", params="sharded")
    assert sh.opt_state.master.params["l1"]["kernel"].spec == P("data", "model")
    batch_sh = NamedSharding(mesh, P("data"))
    step = jax.jit(jaxamp.make_train_step(tp_loss, data_axis="data"))
    two = jax.device_put(state, sh)
    one, step4, batch_sh4 = jit_step(make_state("mixed_bfloat16"), mesh_of(4), "zero3")
    for i in range(3):
        two, _ = step(two, jaxamp.parallel.put_sharded(make_batch(seed=i), batch_sh))
        one, _ = step4(one, jaxamp.parallel.put_sharded(make_batch(seed=i), batch_sh4))
    assert two.opt_state.master.params["l1"]["kernel"].sharding.spec == P("data", "model")
    for a, b in zip(jax.tree.leaves(master_of(two)), jax.tree.leaves(master_of(one)),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    found = collectives(jaxamp.make_train_step(tp_loss, data_axis="data"), two,
                        jaxamp.parallel.put_sharded(make_batch(), batch_sh))
    assert {d for name, d, _ in found if name == "reduce_scatter"} == {jnp.dtype(F32)}


# How far the split params' masters may end from the unsharded ones, as a share of how far
# those moved. bf16: XLA:CPU keeps some bf16 intermediates in fp32 inside a fusion, and fuses
# the two programs differently (measured: within 1.5%, where a gradient lost or doubled by the
# split would be off by 100%).
@pytest.mark.parametrize("policy, tolerance", [("float32", 1e-5), ("mixed_bfloat16", 3e-2)])
def test_params_split_over_an_explicit_model_axis_train_without_a_data_axis(policy, tolerance):
    """Params split over the 'model' axis of an Explicit (data, model) mesh, the batch whole
    (``data_axis=None``): the finite check's sum of squares contracts a split axis, whose
    result JAX types only with an output sharding. The step trains as the same step on
    unsharded params does and skips the same poisoned step: the same finite flags and loss
    scale, step by step. Plain SGD, whose update is the gradient: Adam's normalized update
    would magnify rounding differences."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    tp = {"l1": {"kernel": P(None, "model"), "bias": P("model")}, "out": P("model")}

    def tp_loss(params, batch):  # the sum over the split axis in fp32: no bf16 partial sums
        h = jnp.tanh(batch["x"] @ params["l1"]["kernel"] + params["l1"]["bias"])
        pred = jnp.sum((h * params["out"]).astype(F32), axis=-1)
        return jnp.mean(batch["poison"].astype(F32) * (pred - batch["y"].astype(F32)) ** 2)

    rng = np.random.default_rng(0)
    params = {"l1": {"kernel": jnp.asarray(rng.normal(size=(16, 256)) * 0.25, F32),
                     "bias": jnp.zeros((256,), F32)},
              "out": jnp.asarray(rng.normal(size=(256,)) * 0.06, F32)}

    def make(params):
        tx = jaxamp.mixed_precision(optax.sgd(0.1), policy,
                                    loss_scale=jaxamp.DynamicLossScale())
        return jaxamp.TrainState.create(params=params, tx=tx)
    batches = [make_batch(seed=1), make_batch(seed=2), poisoned(make_batch(seed=3), 5),
               make_batch(seed=4)]
    one = make(params)
    start = master_of(one)
    with jax.set_mesh(mesh):
        split = make(jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
                                  params, tp))
        step = jax.jit(jaxamp.make_train_step(tp_loss, data_axis=None))
        for batch in batches:
            split, m_split = step(split, batch)
            one, m_one = step(one, batch)
            assert bool(m_split["grads_finite"]) == bool(m_one["grads_finite"])
            assert float(split.loss_scale) == float(one.loss_scale)
    assert [bool(m_one["grads_finite"]), float(one.loss_scale)] == [True, 2.0 ** 15]
    assert split.params["l1"]["kernel"].sharding.spec == P(None, "model")
    for a, b, s in zip(jax.tree.leaves(master_of(split)), jax.tree.leaves(master_of(one)),
                       jax.tree.leaves(start), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= tolerance * np.linalg.norm(b - s)


def test_the_mesh_can_come_from_set_mesh_with_a_host_batch():
    state = make_state("mixed_bfloat16")
    mesh = mesh_of()
    step = jax.jit(jaxamp.make_train_step(loss_fn))
    with jax.set_mesh(mesh):
        placed = jax.device_put(state, jaxamp.parallel.state_sharding(state, mesh))
        placed, m = step(placed, make_batch())
    assert m["loss"].shape == ()
    ref, jstep, batch_sh = jit_step(state, mesh, "zero1")
    ref, _ = jstep(ref, jaxamp.parallel.put_sharded(make_batch(), batch_sh))
    assert_tree_bitwise_equal(master_of(placed), master_of(ref))


# --------------------------------------------------------------------------------------------
# Checkpoints: saved sharded on 8 devices, restored onto 4 and 1
# --------------------------------------------------------------------------------------------

def restored_onto(path, template, n, layout="zero3"):
    mesh = mesh_of(n)
    abstract = jax.eval_shape(lambda: template)
    sh = shardings(abstract, mesh, layout)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          abstract, sh)
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path, target), mesh


def test_a_sharded_checkpoint_restores_onto_4_and_1_devices_and_training_continues(tmp_path):
    template = make_state(rng=jax.random.key(1))
    state, step, batch_sh = jit_step(template, mesh_of(), "zero3")
    for i in range(4):
        state, _ = step(state, jaxamp.parallel.put_sharded(make_batch(seed=i), batch_sh))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
    saved = host_leaves(state)
    straight = state
    for i in range(4, 8):
        straight, _ = step(straight, jaxamp.parallel.put_sharded(make_batch(seed=i), batch_sh))

    for n in (8, 4, 1):
        restored, mesh = restored_onto(tmp_path / "ckpt", template, n)
        assert_tree_bitwise_equal(host_leaves(restored), saved)
        assert restored.opt_state.master.params["l2"]["kernel"].sharding.mesh == mesh
        # n devices x accum_steps 8/n take the same 8 micro-batches: the same training.
        state_n, step_n, batch_sh_n = jit_step(template, mesh, "zero3", accum_steps=N // n)
        for i in range(4, 8):
            restored, _ = step_n(restored,
                                 jaxamp.parallel.put_sharded(make_batch(seed=i), batch_sh_n))
        if n == N:   # resumed on the same layout: bit for bit
            assert_tree_bitwise_equal(host_leaves(restored), host_leaves(straight))
        for a, b in zip(jax.tree.leaves(master_of(restored)),
                        jax.tree.leaves(master_of(straight)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert int(restored.step) == int(straight.step) == 8


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

def test_bad_layouts_give_errors_that_name_the_value_and_the_fix():
    state = make_state("mixed_bfloat16")
    mesh = mesh_of()
    with pytest.raises(ValueError, match=r"data_axis='data' is not an axis of the mesh.*batch"):
        jaxamp.make_train_step(loss_fn, mesh=mesh, data_axis="data")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        jaxamp.make_train_step(loss_fn, mesh="batch")
    with pytest.raises(TypeError, match="data_axis must be"):
        jaxamp.make_train_step(loss_fn, data_axis=3)
    placed, step, batch_sh = jit_step(state, mesh, "zero1")
    step = jax.jit(jaxamp.make_train_step(loss_fn))
    # A batch that does not split over the 8 devices.
    with pytest.raises(ValueError, match=r"shape \(12,\).*the 8 devices of the data axis "
                                         r"'batch'; use a batch size that is a multiple of 8"):
        step(placed, jaxamp.parallel.put_sharded(make_batch(n=12), NamedSharding(mesh, P())))
    accum = jax.jit(jaxamp.make_train_step(loss_fn, accum_steps=4))
    with pytest.raises(ValueError, match=r"'batch' x accum_steps 4 = 32.*multiple of 32"):
        accum(placed, jaxamp.parallel.put_sharded(make_batch(n=16), batch_sh))
    # A state placed for another mesh.
    mesh4 = mesh_of(4)
    with pytest.raises(ValueError, match=r"state\.step lives on a mesh \{'batch': 8\} but the "
                                         r"step runs on the mesh \{'batch': 4\}.*state_sharding"):
        step(placed, jaxamp.parallel.put_sharded(make_batch(),
                                                 jaxamp.parallel.batch_sharding(mesh4)))
    on_mesh4 = jaxamp.make_train_step(loss_fn, mesh=mesh4)
    with pytest.raises(ValueError, match=r"mesh \{'batch': 8\} but the step runs on the mesh "
                                         r"\{'batch': 4\}"):
        jax.jit(on_mesh4)(placed, make_batch())



def test_autocast_runs_inside_the_data_parallel_step():
    """An fp32 model under ``make_train_step(autocast=True)`` on a sharded state: bf16 matmuls
    inside the ``shard_map``, fp32 reductions, and the same result as ``pmap``."""
    state = make_state("mixed_bfloat16")
    batch = make_batch()
    placed, _, batch_sh = jit_step(state, mesh_of(), "zero3")
    step = jaxamp.make_train_step(loss_fn, autocast=True)
    sharded_batch = jaxamp.parallel.put_sharded(batch, batch_sh)
    report = jaxamp.audit(step, placed, sharded_batch)
    # Every matmul of the model is bf16; the fp32 ones are the gradient norm's sums of squares
    # (a dot of each fp32-reduced gradient with itself).
    assert report.share("bfloat16") > 0.98
    assert report.fp32_matmuls and all("gradients.py" in site.where
                                       for site in report.fp32_matmuls)
    found = collectives(step, placed, sharded_batch)
    assert {d for name, d, _ in found if name != "all_gather"} == {jnp.dtype(F32)}
    jstate, _ = jax.jit(step)(placed, sharded_batch)
    pstep = jax.pmap(jaxamp.make_train_step(loss_fn, autocast=True, axis_name="batch"),
                     axis_name="batch")
    pstate, _ = pstep(jaxamp.parallel.replicate(state), jaxamp.parallel.shard_batch(batch))
    assert_tree_bitwise_equal(master_of(jaxamp.parallel.unreplicate(pstate)), master_of(jstate))
