"""A catalogue of bad inputs. Each one raises a ``ValueError`` or ``TypeError`` whose message
names the argument, the value given and the fix, and leaves nothing half-updated."""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_tree_bitwise_equal
from helpers import init_params
from helpers import make_batch
from helpers import mse_loss

import jaxamp
from jaxamp import DynamicLossScale
from jaxamp import Policy
from jaxamp import StaticLossScale
from jaxamp import get_policy

F32 = jnp.float32


def _state(policy="mixed_float16", **kwargs):
    tx = jaxamp.mixed_precision(optax.sgd(0.1), policy, **kwargs)
    return jaxamp.TrainState.create(params=init_params(), tx=tx)


def _update_with(grads):
    tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_bfloat16")
    params = {"w": jnp.ones(4), "b": jnp.zeros(2)}
    return tx.update(grads, tx.init(params), params)


def _step(loss_fn=mse_loss, batch=None, state=None, **kwargs):
    step = jax.jit(jaxamp.make_train_step(loss_fn, **kwargs))
    return step(_state() if state is None else state, make_batch() if batch is None else batch)


def _vector_loss(params, batch):
    return mse_loss(params, batch) * jnp.ones(8)


def _int_loss(params, batch):
    return jnp.sum(batch["x"] > 0).astype(jnp.int32)


def _loss_with_rng(params, batch, rng):
    return mse_loss(params, batch)


# (id, call, exception, fragments the message must contain: the argument, the value, the fix)
CASES = [
    # Policy strings.
    ("policy_unknown_dtype", lambda: get_policy("p=f32,c=bf61"), ValueError,
     ["compute dtype", "'bf61'", "expected one of f32"]),
    ("policy_unknown_key", lambda: get_policy("p=f32,x=bf16"), ValueError,
     ["key 'x'", "'p=f32,x=bf16'", "expected one of p/params, c/compute, o/output"]),
    ("policy_empty", lambda: get_policy(""), ValueError,
     ["empty policy string ''", "accepted: a preset"]),
    ("policy_blank", lambda: get_policy("   "), ValueError,
     ["empty policy string '   '", "accepted: a preset"]),
    ("policy_duplicated_key", lambda: get_policy("p=f32,c=bf16,c=f16"), ValueError,
     ["duplicated key 'c'", "'p=f32,c=bf16,c=f16'", "at most once"]),
    ("policy_malformed_part", lambda: get_policy("p=f32,bf16"), ValueError,
     ["malformed part 'bf16'", "'p=f32,bf16'", "'key=dtype'"]),
    ("policy_unknown_preset", lambda: get_policy("mixed_float8"), ValueError,
     ["unknown policy 'mixed_float8'", "accepted: a preset (float32"]),
    ("policy_not_a_string", lambda: get_policy(3), TypeError,
     ["policy must be a string", "int 3", "accepted"]),
    ("policy_int_dtype_in_string", lambda: get_policy("p=f32,c=int8"), ValueError,
     ["compute dtype 'int8'", "expected one of f32"]),
    # Integer and bool dtypes as compute dtypes.
    ("compute_dtype_int", lambda: Policy(F32, jnp.int32, F32), TypeError,
     ["compute dtype must be floating", "'int32'", "Use float32, bfloat16 or float16"]),
    ("compute_dtype_bool", lambda: Policy(F32, jnp.bool_, F32), TypeError,
     ["compute dtype must be floating", "'bool'", "Use float32, bfloat16 or float16"]),
    ("override_dtype_int", lambda: get_policy("mixed_bfloat16", overrides={"norm": jnp.int8}),
     TypeError, ["override dtype must be floating", "'int8'", "pattern 'norm'", "Use float32"]),
    ("override_bad_regex", lambda: get_policy("mixed_bfloat16", overrides={"(": "f32"}),
     ValueError, ["override pattern '('", "not a valid regex", "re.escape"]),
    ("override_not_a_pair", lambda: Policy(overrides=("norm",)), TypeError,
     ["overrides must be (regex, dtype) pairs", "'norm'", "{r'norm': 'float32'}"]),
    # Compute dtypes the platform cannot run.
    ("compute_dtype_float64_without_x64", lambda: Policy(F32, jnp.float64, F32), ValueError,
     ["compute dtype 'float64'", "64-bit mode is off", "jax_enable_x64", "or use float32"]),
    ("compute_dtype_float8", lambda: Policy(F32, jnp.float8_e4m3fn, F32), ValueError,
     ["compute dtype 'float8_e4m3fn'", "8 bits", "Use bfloat16 or float16"]),
    # Loss scales: negative, zero, inf, nan, and the hyperparameters.
    ("scale_negative", lambda: DynamicLossScale(loss_scale=-1.0), ValueError,
     ["loss_scale must be a finite number > 0", "-1.0", "such as 2.0**16"]),
    ("scale_zero", lambda: StaticLossScale(0.0), ValueError,
     ["loss_scale must be a finite number > 0", "0.0", "such as 2.0**16"]),
    ("scale_inf", lambda: DynamicLossScale(loss_scale=math.inf), ValueError,
     ["loss_scale", "inf", "such as 2.0**16"]),
    ("scale_nan", lambda: StaticLossScale(math.nan), ValueError,
     ["loss_scale", "nan", "such as 2.0**16"]),
    ("scale_bool", lambda: DynamicLossScale(loss_scale=True), TypeError,
     ["loss_scale must be a number", "True", "2.0**16"]),
    ("growth_factor_one", lambda: DynamicLossScale(growth_factor=1.0), ValueError,
     ["growth_factor must be > 1", "1.0", "use 2.0"]),
    ("growth_factor_below_one", lambda: DynamicLossScale(growth_factor=0.5), ValueError,
     ["growth_factor must be > 1", "0.5", "use 2.0"]),
    ("growth_factor_inf", lambda: DynamicLossScale(growth_factor=math.inf), ValueError,
     ["growth_factor must be a finite number", "inf", "use 2.0"]),
    ("backoff_one", lambda: DynamicLossScale(backoff_factor=1.0), ValueError,
     ["backoff_factor must be in (0, 1)", "1.0", "use 0.5"]),
    ("backoff_above_one", lambda: DynamicLossScale(backoff_factor=2.0), ValueError,
     ["backoff_factor must be in (0, 1)", "2.0", "use 0.5"]),
    ("hysteresis_zero", lambda: DynamicLossScale(hysteresis=0), ValueError,
     ["hysteresis must be an int >= 1", "got 0", "1 (the default)"]),
    ("hysteresis_float", lambda: DynamicLossScale(hysteresis=1.5), ValueError,
     ["hysteresis must be an int >= 1", "1.5", "1 (the default)"]),
    ("min_above_max", lambda: DynamicLossScale(min_scale=4.0, max_scale=2.0), ValueError,
     ["min_scale (4.0) must be <= max_scale (2.0)", "swap them"]),
    ("min_scale_zero", lambda: DynamicLossScale(min_scale=0.0), ValueError,
     ["min_scale must be > 0", "0.0", "min_scale=1.0"]),
    ("max_scale_negative", lambda: DynamicLossScale(max_scale=-1.0), ValueError,
     ["max_scale must be > 0", "-1.0", "max_scale=2.0**24"]),
    ("growth_interval_zero", lambda: DynamicLossScale(growth_interval=0), ValueError,
     ["growth_interval must be an int >= 1", "got 0", "default is 2000"]),
    ("hysteresis_refill_unknown", lambda: DynamicLossScale(hysteresis_refill="never"),
     ValueError, ["hysteresis_refill must be 'growth' or 'finite'", "'never'", "(the default)"]),
    # mixed_precision.
    ("inner_not_a_transform", lambda: jaxamp.mixed_precision(optax.sgd, "mixed_float16"),
     TypeError, ["inner must be an optax.GradientTransformation", "function", "optax.adamw"]),
    ("loss_scale_a_number", lambda: jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16",
                                                           loss_scale=2.0**15),
     TypeError, ["loss_scale must be a", "float 32768.0", "StaticLossScale(2.0**15)"]),
    ("stall_after_zero", lambda: jaxamp.mixed_precision(optax.sgd(0.1), stall_after=0),
     ValueError, ["stall_after must be an int >= 1 or None", "got 0", "None never"]),
    ("stall_after_bool", lambda: jaxamp.mixed_precision(optax.sgd(0.1), stall_after=True),
     ValueError, ["stall_after must be an int >= 1 or None", "True", "default 10"]),
    # Trees that do not match between params and grads.
    ("grads_tree_mismatch", lambda: _update_with({"w": jnp.ones(4)}), ValueError,
     ["gradient tree does not match the params tree", "PyTreeDef({'w': *})",
      "Differentiate the loss with respect to the same params"]),
    ("grads_shape_mismatch", lambda: _update_with({"w": jnp.ones(3), "b": jnp.ones(2)}),
     ValueError, ["gradient of 'w' has shape (3,)", "shape (4,)",
                  "differentiate the loss with respect to the same params"]),
    ("update_without_params", lambda: jaxamp.mixed_precision(optax.sgd(0.1)).update(
        {"w": jnp.ones(2)}, jaxamp.mixed_precision(optax.sgd(0.1)).init({"w": jnp.ones(2)})),
     ValueError, ["needs params", "tx.update(grads, state, params)"]),
    # Losses that are not a floating scalar.
    ("loss_not_scalar", lambda: _step(_vector_loss), ValueError,
     ["loss_fn must return a scalar loss", "shape (8,)", "jnp.mean"]),
    ("loss_not_floating", lambda: _step(_int_loss), TypeError,
     ["loss_fn must return a floating loss", "int32", "in float32"]),
    ("scale_loss_not_scalar", lambda: jaxamp.scale_loss(jnp.ones(3), _state().opt_state),
     ValueError, ["the loss must be a scalar", "(3,)", "jnp.mean"]),
    ("scale_loss_not_floating", lambda: jaxamp.scale_loss(jnp.int32(3), _state().opt_state),
     TypeError, ["the loss must be floating", "int32", "in float32"]),
    # Batches that do not divide.
    ("batch_not_divisible_by_devices", lambda: jaxamp.shard_batch({"x": np.zeros((10, 2))}),
     ValueError, ["batch leaf ['x']", "(10, 2)", "device count 8", "multiple of 8"]),
    ("sharded_batch_not_divisible", lambda: jaxamp.put_sharded({"x": np.zeros((12, 2))}),
     ValueError, ["batch leaf ['x']", "(12, 2)", "multiple of 8"]),
    ("batch_not_divisible_by_accum_steps", lambda: _step(accum_steps=3), ValueError,
     ["accum_steps=3 does not divide the batch size 16", "multiple of 3"]),
    ("accum_steps_zero", lambda: jaxamp.make_train_step(mse_loss, accum_steps=0), ValueError,
     ["accum_steps must be an int >= 1", "got 0", "1 (the default)"]),
    # An axis name that is not bound, or not a name.
    ("axis_name_unbound", lambda: _step(axis_name="batch"), ValueError,
     ["axis_name='batch' is not bound", "jax.pmap(step, axis_name='batch')"]),
    ("axis_name_not_a_string", lambda: jaxamp.make_train_step(mse_loss, axis_name=3), TypeError,
     ["axis_name must be a string or None", "got 3", "None under jax.jit"]),
    # The rest of the step's surface.
    ("loss_fn_not_callable", lambda: jaxamp.make_train_step(3), TypeError,
     ["loss_fn must be callable", "int 3", "loss_fn(params, batch)"]),
    ("reduce_dtype_int", lambda: jaxamp.make_train_step(mse_loss, reduce_dtype=jnp.int32),
     TypeError, ["reduce_dtype must be floating", "int32", "use float32"]),
    ("has_rng_without_a_key", lambda: _step(_loss_with_rng, has_rng=True), ValueError,
     ["has_rng=True but state.rng is None", "rng=jax.random.key(0)"]),
    ("aux_missing", lambda: _step(has_aux=True), ValueError,
     ["loss_fn must return (loss, aux)", "has_aux=True", "got a single float32[] array",
      "set the flags to what loss_fn returns"]),
    ("policy_differs_from_tx", lambda: jaxamp.TrainState.create(
        params=init_params(), tx=jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16"),
        policy="mixed_bfloat16"), ValueError,
     ["policy p=f32,c=bf16,o=f32 differs", "p=f32,c=f16,o=f32", "pass the same policy"]),
    ("mixed_policy_plain_optax", lambda: jaxamp.TrainState.create(
        params=init_params(), tx=optax.sgd(0.1), policy="mixed_float16"), ValueError,
     ["policy p=f32,c=f16,o=f32 keeps a master copy", "jaxamp.mixed_precision(tx, policy)"]),
]


def test_the_catalogue_is_large_and_its_ids_unique():
    assert len(CASES) >= 25
    assert len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize("call, error, fragments", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(call, error, fragments):
    with pytest.raises(error) as info:
        call()
    assert type(info.value) in (ValueError, TypeError) or issubclass(type(info.value), error)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# --------------------------------------------------------------------------------------------
# Nothing is half-updated
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, batch_fn", [
    (dict(accum_steps=3), make_batch),
    (dict(axis_name="batch"), make_batch),
    (dict(), lambda: {k: v for k, v in make_batch().items() if k != "y"}),
], ids=["accum_steps", "unbound_axis", "missing_batch_field"])
def test_a_rejected_donated_step_leaves_the_state_intact_and_usable(kwargs, batch_fn):
    state = _state()
    snapshot = jax.device_get(jax.tree.leaves(state))
    bad = jax.jit(jaxamp.make_train_step(mse_loss, **kwargs), donate_argnums=0)
    with pytest.raises((ValueError, TypeError, KeyError)):
        bad(state, batch_fn())
    # Rejected at trace time: nothing was donated, nothing changed.
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    assert_tree_bitwise_equal(jax.device_get(jax.tree.leaves(state)), snapshot)
    good = jax.jit(jaxamp.make_train_step(mse_loss), donate_argnums=0)
    new, _ = good(state, make_batch())
    fresh, _ = good(_state(), make_batch())
    assert_tree_bitwise_equal(jax.tree.leaves(new), jax.tree.leaves(fresh))


def test_a_rejected_update_leaves_the_optimizer_state_usable():
    tx = jaxamp.mixed_precision(optax.adam(0.1), "mixed_bfloat16")
    params = {"w": jnp.ones(4), "b": jnp.zeros(2)}
    opt_state = tx.init(params)
    snapshot = jax.device_get(opt_state)
    with pytest.raises(ValueError, match="gradient of 'w' has shape"):
        tx.update({"w": jnp.ones(3), "b": jnp.ones(2)}, opt_state, params)
    assert_tree_bitwise_equal(jax.device_get(opt_state), snapshot)
    _, new = tx.update({"w": jnp.ones(4), "b": jnp.ones(2)}, opt_state, params)
    assert int(new.applied_steps) == 1


def test_rejected_replacements_leave_the_originals_unchanged():
    scale = DynamicLossScale(loss_scale=8.0, growth_interval=2, hysteresis=2)
    with pytest.raises(ValueError, match="growth_factor"):
        scale.replace(growth_factor=1.0)
    with pytest.raises(ValueError, match="loss_scale"):
        scale.replace(loss_scale=-1.0)
    assert (scale.growth_factor, float(scale.loss_scale), scale.hysteresis) == (2.0, 8.0, 2)
    assert float(scale.adjust(True).adjust(True).loss_scale) == 16.0
    policy = get_policy("mixed_bfloat16", overrides={"norm": "f32"})
    with pytest.raises(TypeError):
        policy.with_overrides({"head": jnp.int32})
    assert policy.overrides == (("norm", jnp.dtype(F32)),)
    with pytest.raises(ValueError, match="float64"):
        dataclasses.replace(policy, compute_dtype=jnp.float64)
    assert policy.compute_dtype == jnp.bfloat16


# --------------------------------------------------------------------------------------------
# A checkpoint from another model, restored
# --------------------------------------------------------------------------------------------

def _tree_bytes(root):
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def _save_checkpoint(checkpoints, state, step=2):
    """A checkpoint laid out as the training CLI writes them."""
    with ocp.CheckpointManager(checkpoints, item_names=("state", "data")) as manager:
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   data=ocp.args.JsonSave([0, step])))


def test_a_checkpoint_with_other_shapes_is_named_leaf_by_leaf(tmp_path):
    from train import train as train_lib
    _save_checkpoint(tmp_path, _state())
    path = str(tmp_path / "2" / "state")
    train_lib.check_checkpoint_matches(path, _state())  # the same layout passes
    other = jaxamp.TrainState.create(params=init_params(n_out=3), tx=jaxamp.mixed_precision(
        optax.sgd(0.1), "mixed_float16"))
    with pytest.raises(ValueError) as info:
        train_lib.check_checkpoint_matches(path, other)
    message = str(info.value)
    assert f"--resume: the checkpoint {path}" in message
    assert ("'params/dense2/bias' is float16[1] in the checkpoint but float16[3] in this run"
            in message)
    assert "(and 1 more)" in message  # dense2/bias and kernel, in the params and the master
    assert "another --workdir" in message


def test_resuming_from_another_models_checkpoint_fails_clearly_and_touches_nothing(tmp_path):
    from train import train as train_lib
    from train.configs import get_config
    config = get_config("tiny", task="synthetic_text", model="gpt_tiny", seq_len=16,
                        precision="mixed_float16", progress=False)
    # Where the CLI keeps its checkpoints: one of this file's MLP instead of the GPT.
    checkpoints = tmp_path / "checkpoints"
    _save_checkpoint(checkpoints, _state())
    before = _tree_bytes(tmp_path)
    with pytest.raises(ValueError) as info:
        train_lib.train_and_evaluate(config, str(tmp_path), resume=True)
    message = str(info.value)
    assert isinstance(info.value, train_lib.CheckpointMismatch)
    assert f"--resume: the checkpoint {checkpoints / '2' / 'state'}" in message
    assert "was written by another model or state layout" in message
    assert "is missing from the checkpoint" in message
    assert "Resume with the --config, --model and --precision" in message
    assert "another --workdir" in message
    # Nothing written: no log, no summary, no new or changed checkpoint.
    assert _tree_bytes(tmp_path) == before
