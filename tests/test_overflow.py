"""Tests of overflow provenance: ``first_nonfinite_leaf`` in the fast path and the eager
diagnosis ``jaxamp.explain_overflow`` (``grad_stats`` and ``nonfinite_leaf_path``: in
test_gradients.py)."""

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp.gradients import nonfinite_leaf_path

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
N_DEVICES = 8
BATCH = 16
# Leaves in tree order: layer0/bias, layer0/kernel, layer1/bias, layer1/kernel, layer2/...
LAYER1_KERNEL = 3


def line_of(fn, offset):
    """``test_overflow.py:N:`` for the line ``offset`` lines below ``fn``'s ``def``."""
    return f"test_overflow.py:{inspect.unwrap(fn).__code__.co_firstlineno + offset}:"


# --------------------------------------------------------------------------------------------
# A three-layer MLP
# --------------------------------------------------------------------------------------------

def init_params(seed=0):
    rng = np.random.default_rng(seed)
    sizes = [(4, 8), (8, 8), (8, 1)]
    return {f"layer{i}": {"kernel": jnp.asarray(rng.normal(size=s) * 0.5, F32),
                          "bias": jnp.zeros((s[1],), F32)}
            for i, s in enumerate(sizes)}


def forward(params, x):
    h = x
    for i in range(3):
        p = params[f"layer{i}"]
        with jax.named_scope(f"layer{i}"):
            h = h @ p["kernel"] + p["bias"]
            if i < 2:
                h = jnp.tanh(h)
    return h[:, 0]


def poisoned_loss(params, batch):
    """MSE, plus ``mean(poison) * sum(layer1 kernel)``: an inf poison makes exactly the
    gradient of layer1/kernel infinite, a zero one leaves the gradients alone."""
    mse = jnp.mean((forward(params, batch["x"]).astype(F32) - batch["y"].astype(F32)) ** 2)
    poison = jnp.mean(batch["poison"].astype(F32))
    return mse + poison * jnp.sum(params["layer1"]["kernel"].astype(F32))


def make_batch(seed=1, n=BATCH):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, 0]).astype(np.float32),
            "poison": np.zeros((n,), np.float32)}


def poisoned(batch, index, value=np.inf):
    out = {k: np.array(v) for k, v in batch.items()}
    out["poison"][index] = value
    return out


def make_state(policy="mixed_float16", inner=None, loss_scale=None, params=None):
    """A state whose loss scale (2**8) keeps the fp16 gradients of the MLP finite."""
    inner = optax.sgd(0.1) if inner is None else inner
    if loss_scale is None:
        loss_scale = jaxamp.DynamicLossScale(loss_scale=2.0**8)
    tx = (jaxamp.mixed_precision(inner, policy, loss_scale=loss_scale) if policy != "plain"
          else inner)
    return jaxamp.TrainState.create(params=init_params() if params is None else params, tx=tx)


# --------------------------------------------------------------------------------------------
# The fast path names the first non-finite leaf
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16", "float32", "plain"])
def test_step_metrics_name_the_poisoned_leaf(policy):
    state = make_state(policy)
    step = jax.jit(jaxamp.make_train_step(poisoned_loss))
    batch = make_batch()

    state, m = step(state, batch)
    assert bool(m["grads_finite"])
    assert int(m["nonfinite_leaves"]) == 0
    assert int(m["first_nonfinite_leaf"]) == -1
    assert m["first_nonfinite_leaf"].dtype == jnp.int32
    assert nonfinite_leaf_path(state.params, m["first_nonfinite_leaf"]) is None

    state, m = step(state, poisoned(batch, 5))
    assert not bool(m["grads_finite"])
    assert int(m["nonfinite_leaves"]) == 1
    assert int(m["first_nonfinite_leaf"]) == LAYER1_KERNEL
    assert nonfinite_leaf_path(state.params, m["first_nonfinite_leaf"]) == "layer1/kernel"
    assert nonfinite_leaf_path(state.master_params,
                                      m["first_nonfinite_leaf"]) == "layer1/kernel"

    state, m = step(state, batch)
    assert bool(m["grads_finite"]) and int(m["first_nonfinite_leaf"]) == -1


def test_first_of_several_nonfinite_leaves_is_reported():
    def loss(params, batch):
        poison = jnp.mean(batch["poison"].astype(F32))
        return poisoned_loss(params, batch) + poison * (
            jnp.sum(params["layer2"]["bias"].astype(F32))
            + jnp.sum(params["layer0"]["kernel"].astype(F32)))

    step = jax.jit(jaxamp.make_train_step(loss))
    _, m = step(make_state(), poisoned(make_batch(), 0))
    assert int(m["nonfinite_leaves"]) == 3
    assert int(m["first_nonfinite_leaf"]) == 1
    assert nonfinite_leaf_path(init_params(), m["first_nonfinite_leaf"]) == "layer0/kernel"


def test_optimizer_state_holds_the_first_nonfinite_leaf():
    state = make_state()
    assert int(jaxamp.state.find_state(state.opt_state).health.first_nonfinite_leaf) == -1
    step = jax.jit(jaxamp.make_train_step(poisoned_loss))
    state, _ = step(state, poisoned(make_batch(), 2, np.nan))
    mp = jaxamp.state.find_state(state.opt_state)
    assert isinstance(mp, jaxamp.state.MixedPrecisionState)
    assert int(mp.health.first_nonfinite_leaf) == LAYER1_KERNEL
    assert int(mp.health.nonfinite_leaves) == 1
    assert nonfinite_leaf_path(state.params, mp.health.first_nonfinite_leaf) == "layer1/kernel"
    state, _ = step(state, make_batch())
    assert int(jaxamp.state.find_state(state.opt_state).health.first_nonfinite_leaf) == -1


def test_accumulated_micro_batches_name_the_poisoned_leaf():
    step = jax.jit(jaxamp.make_train_step(poisoned_loss, accum_steps=4))
    _, m = step(make_state(), poisoned(make_batch(), 13))
    assert int(m["first_nonfinite_leaf"]) == LAYER1_KERNEL
    assert int(m["nonfinite_leaves"]) == 1


def test_every_pmap_replica_names_the_same_leaf():
    state = make_state("mixed_float16")
    step = jax.pmap(jaxamp.make_train_step(poisoned_loss, axis_name="batch"), axis_name="batch")
    rstate = jaxamp.parallel.replicate(state)
    batch = make_batch()

    rstate, m = step(rstate, jaxamp.parallel.shard_batch(batch))
    np.testing.assert_array_equal(np.asarray(m["first_nonfinite_leaf"]), [-1] * N_DEVICES)
    # Example 5 sits on device 2 (two examples per device): only its gradient is infinite
    # before the cross-device mean.
    rstate, m = step(rstate, jaxamp.parallel.shard_batch(poisoned(batch, 5)))
    np.testing.assert_array_equal(np.asarray(m["grads_finite"]), [False] * N_DEVICES)
    np.testing.assert_array_equal(np.asarray(m["nonfinite_leaves"]), [1] * N_DEVICES)
    firsts = np.asarray(m["first_nonfinite_leaf"])
    np.testing.assert_array_equal(firsts, [LAYER1_KERNEL] * N_DEVICES)
    params = jaxamp.parallel.unreplicate(rstate).params
    assert {nonfinite_leaf_path(params, i) for i in firsts} == {"layer1/kernel"}
    mp = jaxamp.state.find_state(rstate.opt_state)
    np.testing.assert_array_equal(np.asarray(mp.health.first_nonfinite_leaf), firsts)


# --------------------------------------------------------------------------------------------
# explain_overflow
# --------------------------------------------------------------------------------------------

def scoped_loss(params, batch):
    h = batch["x"]
    for i in range(3):
        p = params[f"layer{i}"]
        with jax.named_scope(f"layer{i}"):
            h = h @ p["kernel"] + p["bias"]
            if i < 2:
                h = jnp.tanh(h)
    return jnp.mean(h.astype(F32))


def constant_params(w0=0.5, w1=0.5, w2=0.5):
    """Layers 4 -> 4 -> 4 -> 1 with constant kernels and zero biases."""
    return {f"layer{i}": {"kernel": jnp.full((4, 4) if i < 2 else (4, 1), w, F32),
                          "bias": jnp.zeros((4,) if i < 2 else (1,), F32)}
            for i, w in enumerate((w0, w1, w2))}


X = {"x": np.ones((2, 4), np.float32)}


def fp16_state(params, scale=1.0, **kwargs):
    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16",
                                loss_scale=jaxamp.DynamicLossScale(loss_scale=scale))
    return jaxamp.TrainState.create(params=params, tx=tx, **kwargs)


def test_forward_overflow_is_located_in_its_layer():
    # layer0: tanh(4 * 0.5) = 0.96; layer1: 4 * 0.96 * 30000 = 115000 > 65504.
    report = jaxamp.explain_overflow(fp16_state(constant_params(w1=3e4)), X, scoped_loss)
    assert isinstance(report, jaxamp.reports.OverflowReport)
    first = report.first_forward
    assert (first.phase, first.layer, first.primitive, first.kind) == (
        "forward", "layer1", "dot_general", "inf")
    assert (first.dtype, first.shape) == ("float16", (2, 4))
    assert line_of(scoped_loss, 5) in first.where
    assert all(e.layer != "layer0" for e in report.events)
    # tanh(inf) = 1: the rest of the step is finite, and so are the gradients
    # (tanh' = 0 there).
    assert [e.layer for e in report.events] == ["layer1"]
    assert report.nonfinite_grads == []
    assert report.first_backward is None
    assert report.loss == 2.0 and report.loss_scale == 1.0
    text = str(report)
    assert "layer1" in text and "inf from dot_general" in text and "forward" in text


def norm_then_overflow_loss(params, batch):
    """An fp32 model: a hand-written RMS norm whose sum of squares is past fp16's range on
    activations near 300 (autocast keeps it in fp32), then a layer whose fp16 matmul overflows
    in the step that trains."""
    with jax.named_scope("embed"):
        h = batch["x"] @ params["embed"]                                  # ~300
    with jax.named_scope("norm"):
        h = h * jax.lax.rsqrt(jnp.sum(h * h, -1, keepdims=True) / h.shape[-1] + 1e-6)
    with jax.named_scope("proj"):
        h = h @ params["proj"]                                            # 64 * 2e3 > 65504
    return jnp.mean(h)


def test_explain_overflow_with_autocast_reports_the_program_that_trained():
    params = {"embed": jnp.full((4, 64), 75.0, F32), "proj": jnp.full((64, 8), 2e3, F32)}
    state = fp16_state(params)
    step = jax.jit(jaxamp.make_train_step(norm_then_overflow_loss, autocast=True))
    _, m = step(state, X)
    assert not bool(m["grads_finite"])  # the autocast step overflows: in proj
    report = jaxamp.explain_overflow(
        state, X, jaxamp.Objective(norm_then_overflow_loss, autocast=True))
    first = report.first_forward
    assert (first.layer, first.primitive, first.dtype) == ("proj", "dot_general", "float16")
    assert all(e.layer != "norm" for e in report.events)
    # Without autocast the diagnosis runs another program, whose fp16 norm overflows first.
    plain = jaxamp.explain_overflow(state, X, norm_then_overflow_loss)
    assert plain.first_forward.layer == "norm"


def test_finite_model_reports_nothing():
    report = jaxamp.explain_overflow(fp16_state(constant_params(), 2.0**10), X, scoped_loss)
    assert report.events == []
    assert report.nonfinite_grads == []
    assert report.first_forward is None and report.first_backward is None
    assert report.loss_scale == 2.0**10
    expected = float(jnp.tanh(4 * jnp.tanh(jnp.float16(2.0)) * F16(0.5)) * 4 * 0.5)
    np.testing.assert_allclose(report.loss, expected, rtol=1e-3)
    assert "every activation and gradient is finite" in str(report)


def test_backward_overflow_caused_by_the_loss_scale():
    # Forward: |out| <= 400. Backward at scale 2**13: the output cotangent is 2**13 / 2 = 4096
    # (finite), layer2's dW (<= 2 * 4096) too, but its input cotangent 4096 * 100 overflows:
    # layers 0 and 1 get non-finite gradients, layer2 keeps finite ones.
    params = constant_params(w2=100.0)
    report = jaxamp.explain_overflow(fp16_state(params, 2.0**13), X, scoped_loss)
    assert report.first_forward is None
    back = report.first_backward
    assert back is not None
    assert (back.phase, back.layer, back.primitive, back.kind, back.dtype) == (
        "backward", "layer2", "dot_general", "inf", "float16")
    assert back.shape == (2, 4)
    assert line_of(scoped_loss, 5) in back.where
    assert [e.layer for e in report.events] == ["layer2", "layer1", "layer0"]
    assert {e.phase for e in report.events} == {"backward"}
    assert report.nonfinite_grads == ["layer0/bias", "layer0/kernel", "layer1/bias",
                                      "layer1/kernel"]
    assert report.loss_scale == 2.0**13
    assert "non-finite gradients: layer0/bias, layer0/kernel, layer1/bias, layer1/kernel" in (
        str(report))
    # At scale 1 the same step is finite.
    assert jaxamp.explain_overflow(fp16_state(params, 1.0), X, scoped_loss).events == []


def test_a_huge_loss_scale_overflows_the_first_cotangent():
    report = jaxamp.explain_overflow(fp16_state(constant_params(), 2.0**24), X, scoped_loss)
    assert report.first_forward is None
    back = report.first_backward
    # The fp32 cotangent 2**23 is cast back to fp16 by the loss's astype, outside any scope:
    # the layer is the source line.
    assert (back.primitive, back.kind, back.dtype) == ("convert_element_type", "inf", "float16")
    assert line_of(scoped_loss, 8) in back.layer
    assert back.layer == back.where
    assert report.nonfinite_grads == [f"layer{i}/{n}" for i in range(3)
                                      for n in ("bias", "kernel")]


def test_explain_overflow_with_model_state_and_aux():
    def loss_fn(params, batch, model_state):
        loss = scoped_loss(params, batch)
        new_state = {"count": model_state["count"] + 1}
        return loss, new_state, {"loss": loss}

    state = fp16_state(constant_params(w1=3e4), model_state={"count": jnp.zeros((), F32)})
    report = jaxamp.explain_overflow(
        state, X, jaxamp.Objective(loss_fn, has_aux=True, has_model_state=True))
    assert (report.first_forward.layer, report.first_forward.primitive) == (
        "layer1", "dot_general")
    # The same with has_aux only, and with has_model_state only.
    report = jaxamp.explain_overflow(
        fp16_state(constant_params(w1=3e4)), X,
        jaxamp.Objective(lambda p, b: (scoped_loss(p, b), {"n": 1.0}), has_aux=True))
    assert report.first_forward.layer == "layer1"
    report = jaxamp.explain_overflow(state, X, jaxamp.Objective(
        lambda p, b, model_state: (scoped_loss(p, b), model_state), has_model_state=True))
    assert report.first_forward.layer == "layer1"


def test_explain_overflow_with_rng():
    def loss_fn(params, batch, rng):
        keep = jax.random.bernoulli(rng, 1.0, batch["x"].shape)
        return scoped_loss(params, {"x": jnp.where(keep, batch["x"], 0)})

    state = fp16_state(constant_params(w1=3e4), rng=jax.random.key(0))
    report = jaxamp.explain_overflow(state, X, jaxamp.Objective(loss_fn, has_rng=True))
    assert report.first_forward.layer == "layer1"


def test_explain_overflow_agrees_with_the_step():
    """The step that skips is the one explain_overflow diagnoses, with the same leaf."""
    state = make_state()
    bad = poisoned(make_batch(), 5)
    _, m = jax.jit(jaxamp.make_train_step(poisoned_loss))(state, bad)
    report = jaxamp.explain_overflow(state, bad, poisoned_loss)
    assert report.nonfinite_grads == [
        nonfinite_leaf_path(state.params, m["first_nonfinite_leaf"])] == ["layer1/kernel"]


def test_explain_overflow_takes_the_step_and_runs_what_it_trains():
    """The step holds its objective: ``explain_overflow(state, batch, step)`` runs autocast as
    the step did, for the step and for ``jax.jit`` of it; the loss's flags are the
    objective's alone."""
    params = {"embed": jnp.full((4, 64), 75.0, F32), "proj": jnp.full((64, 8), 2e3, F32)}
    state = fp16_state(params)
    step = jaxamp.make_train_step(jaxamp.Objective(norm_then_overflow_loss, autocast=True))
    assert step.objective == jaxamp.Objective(norm_then_overflow_loss, autocast=True)
    for traced in (step, jax.jit(step)):
        first = jaxamp.explain_overflow(state, X, traced).first_forward
        assert (first.layer, first.primitive, first.dtype) == ("proj", "dot_general", "float16")
    with pytest.raises(TypeError, match="autocast"):
        jaxamp.explain_overflow(state, X, step, autocast=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="has_aux=True is the objective's"):
        jaxamp.make_train_step(step.objective, has_aux=True)


def test_explain_overflow_of_an_accumulating_step_names_the_micro_batch():
    """With ``accum_steps`` the step takes each micro-batch's gradients in turn: the diagnosis
    evaluates them in turn too, and names the first that overflowed."""
    state = make_state()
    step = jaxamp.make_train_step(poisoned_loss, accum_steps=2)
    bad = poisoned(make_batch(), 13)  # in the second of two micro-batches of 8
    _, m = jax.jit(step)(state, bad)
    assert not bool(m["grads_finite"])
    report = jaxamp.explain_overflow(state, bad, step)
    assert report.micro_batch == 1
    assert report.first_forward is not None
    assert report.nonfinite_grads == [
        nonfinite_leaf_path(state.params, m["first_nonfinite_leaf"])] == ["layer1/kernel"]
    assert "first in micro-batch 1" in str(report)
    # A finite batch: no micro-batch named, and the step's loss (the mean of the micro-batches').
    _, m = jax.jit(step)(state, make_batch())
    report = jaxamp.explain_overflow(state, make_batch(), step)
    assert report.events == [] and report.micro_batch is None
    np.testing.assert_allclose(report.loss, float(m["loss"]), rtol=1e-6)


def test_explain_overflow_runs_the_steps_own_micro_batches():
    """The diagnosis takes the step's gradients as the step does (its micro-batch split, each
    micro-batch's rng, the model state threaded from one to the next), evaluated eagerly: its
    loss is the step's, to the last bit that an eager evaluation keeps."""
    def loss_fn(params, batch, model_state, rng):
        keep = jax.random.bernoulli(rng, 0.5, batch["x"].shape)
        x = jnp.where(keep, batch["x"], 0) * (1.0 + model_state["count"]).astype(F16)
        loss = poisoned_loss(params, {**batch, "x": x})
        return loss, {"count": model_state["count"] + 1}

    state = make_state()
    state = state.replace(model_state={"count": jnp.zeros((), F32)}, rng=jax.random.key(3))
    step = jaxamp.make_train_step(loss_fn, has_model_state=True, has_rng=True, accum_steps=4)
    new, m = jax.jit(step)(state, make_batch())
    report = jaxamp.explain_overflow(state, make_batch(), step)
    assert report.events == [] and int(new.model_state["count"]) == 4
    np.testing.assert_allclose(report.loss, float(m["loss"]), rtol=1e-6)
    # Another key or no threading of the model state gives another loss.
    other = jaxamp.explain_overflow(state.replace(rng=jax.random.key(4)), make_batch(), step)
    assert abs(other.loss - report.loss) > 1e-3 * abs(report.loss)


def test_forward_overflow_inside_remat_is_located():
    def loss_fn(params, batch):
        with jax.named_scope("layer0"):
            h = jnp.tanh(batch["x"] @ params["layer0"]["kernel"])
        with jax.named_scope("layer1"):
            h = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, params["layer1"]["kernel"])
        with jax.named_scope("layer2"):
            h = h @ params["layer2"]["kernel"]
        return jnp.mean(h.astype(F32))

    report = jaxamp.explain_overflow(fp16_state(constant_params(w1=3e4)), X, loss_fn)
    first = report.first_forward
    assert (first.layer, first.primitive, first.kind) == ("layer1", "dot_general", "inf")
    assert line_of(loss_fn, 4) in first.where
    assert report.nonfinite_grads == []


@jax.jit
def jitted_matmul(h, w):
    return h @ w


def test_forward_overflow_inside_a_jitted_helper_is_named_by_the_enclosing_scope():
    def loss_fn(params, batch):
        with jax.named_scope("layer0"):
            h = jnp.tanh(jitted_matmul(batch["x"], params["layer0"]["kernel"]))
        with jax.named_scope("layer1"):
            h = jitted_matmul(h, params["layer1"]["kernel"])
        return jnp.mean(h.astype(F32))

    report = jaxamp.explain_overflow(fp16_state(constant_params(w1=3e4)), X, loss_fn)
    first = report.first_forward
    assert (first.primitive, first.kind) == ("dot_general", "inf")
    assert line_of(jitted_matmul, 2) in first.where
    assert first.layer == "layer1"


def test_backward_overflow_inside_a_jitted_helper_is_a_backward_event():
    # As in test_backward_overflow_caused_by_the_loss_scale, with layer0's matmul in a jitted
    # helper: the forward is finite, layer1's input cotangent overflows, and then layer0's
    # kernel gradient (computed inside the helper's transpose) is non-finite too.
    def loss_fn(params, batch):
        with jax.named_scope("layer0"):
            h = jitted_matmul(batch["x"], params["layer0"]["kernel"])
        with jax.named_scope("layer1"):
            h = jnp.tanh(h) @ params["layer1"]["kernel"]
        return jnp.mean(h.astype(F32))

    params = {"layer0": {"kernel": jnp.full((4, 4), 0.5, F32)},
              "layer1": {"kernel": jnp.full((4, 4), 100.0, F32)}}
    report = jaxamp.explain_overflow(fp16_state(params, 2.0**12), X, loss_fn)
    assert report.nonfinite_grads == ["layer0/kernel"]
    assert report.first_forward is None
    assert [(e.phase, e.layer) for e in report.events] == [("backward", "layer1"),
                                                           ("backward", "layer0")]


# --------------------------------------------------------------------------------------------
# explain_overflow on Flax models
# --------------------------------------------------------------------------------------------

class Exp(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.constant(3.0), (x.shape[-1],))
        return jnp.exp(x * w)


class LinenMlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(4, kernel_init=nn.initializers.constant(0.5), name="layer0")(x))
        x = nn.Dense(4, kernel_init=nn.initializers.constant(3.0), name="layer1")(x)
        x = Exp(name="activation")(x)
        return nn.Dense(1, name="head")(x)


def linen_state(kernel1):
    model = LinenMlp()
    params = model.init(jax.random.key(0), X["x"])["params"]
    params = {**params, "layer1": {**params["layer1"],
                                   "kernel": jnp.full((4, 4), kernel1, F32)}}

    def loss_fn(params, batch):
        return jnp.mean(model.apply({"params": params}, batch["x"]).astype(F32))

    return fp16_state(params), loss_fn


def test_linen_overflow_in_a_dense_layer_is_named_by_the_module_path():
    state, loss_fn = linen_state(3e4)
    report = jaxamp.explain_overflow(state, X, loss_fn)
    first = report.first_forward
    assert (first.layer, first.primitive, first.kind) == ("LinenMlp/layer1", "dot_general", "inf")
    # The model's line that calls the Dense (not flax's source), and the name stack says which.
    assert line_of(LinenMlp.__call__, 3) in first.where
    assert "LinenMlp/layer0" not in {e.layer for e in report.events if e.phase == "forward"}


def test_linen_overflow_in_a_custom_module_points_at_its_source_line():
    # layer1: 4 * tanh(2) * 3 = 11.6; x * w = 34.8; exp(34.8) > 65504.
    state, loss_fn = linen_state(3.0)
    report = jaxamp.explain_overflow(state, X, loss_fn)
    first = report.first_forward
    assert (first.layer, first.primitive, first.kind) == ("LinenMlp/activation", "exp", "inf")
    assert line_of(Exp.__call__, 3) in first.where
    assert "Exp.__call__" in first.where
    assert [e.layer for e in report.events if e.phase == "forward"][0] == "LinenMlp/activation"
    assert "LinenMlp/activation" in str(report)


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.layer0 = nnx.Linear(4, 4, kernel_init=nnx.initializers.constant(0.5), rngs=rngs)
        self.layer1 = nnx.Linear(4, 4, kernel_init=nnx.initializers.constant(3e4), rngs=rngs)
        self.layer2 = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        x = jnp.tanh(self.layer0(x))
        x = jnp.tanh(self.layer1(x))
        return self.layer2(x)


def nnx_state():
    graphdef, params = nnx.split(NnxMlp(nnx.Rngs(0)), nnx.Param)

    def loss_fn(params, batch):
        return jnp.mean(nnx.merge(graphdef, params)(batch["x"]).astype(F32))

    return fp16_state(params), loss_fn


def test_nnx_overflow_is_found():
    state, loss_fn = nnx_state()
    report = jaxamp.explain_overflow(state, X, loss_fn)
    first = report.first_forward
    assert (first.primitive, first.kind, first.dtype) == ("dot_general", "inf", "float16")
    assert report.nonfinite_grads == []


class NnxExp(nnx.Module):
    def __init__(self, rngs):
        self.layer0 = nnx.Linear(4, 4, kernel_init=nnx.initializers.constant(0.5), rngs=rngs)

    def __call__(self, x):
        return jnp.exp(30.0 * jnp.tanh(self.layer0(x)))


def test_nnx_overflow_in_the_models_own_code_points_at_its_line():
    graphdef, params = nnx.split(NnxExp(nnx.Rngs(0)), nnx.Param)

    def loss_fn(params, batch):
        return jnp.mean(nnx.merge(graphdef, params)(batch["x"]).astype(F32))

    report = jaxamp.explain_overflow(fp16_state(params), X, loss_fn)
    first = report.first_forward
    # exp(30 * tanh(2)) = exp(28.9) > 65504.
    assert (first.primitive, first.kind) == ("exp", "inf")
    assert line_of(NnxExp.__call__, 1) in first.where
    # No name scope: the layer is the source line.
    assert first.layer == first.where


def test_nnx_overflow_points_at_the_models_source_line():
    """NNX pushes no name scope: the event must point at the model's line that called the
    overflowing layer, not at the line inside nnx.Linear shared by every Linear."""
    state, loss_fn = nnx_state()
    first = jaxamp.explain_overflow(state, X, loss_fn).first_forward
    assert line_of(NnxMlp.__call__, 2) in first.where or line_of(NnxMlp.__call__, 2) in (
        first.layer)
