"""A catalogue of bad inputs. Each one raises a ``ValueError`` or ``TypeError`` whose message
names the argument, the value given and the fix, and leaves nothing half-updated."""

import dataclasses
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import ROOT
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
    ("scale_loss_not_scalar", lambda: jaxamp.state.scale_loss(jnp.ones(3), _state().opt_state),
     ValueError, ["the loss must be a scalar", "(3,)", "jnp.mean"]),
    ("scale_loss_not_floating", lambda: jaxamp.state.scale_loss(jnp.int32(3), _state().opt_state),
     TypeError, ["the loss must be floating", "int32", "in float32"]),
    # Batches that do not divide.
    ("batch_not_divisible_by_devices",
     lambda: jaxamp.parallel.shard_batch({"x": np.zeros((10, 2))}),
     ValueError, ["batch leaf ['x']", "(10, 2)", "device count 8", "multiple of 8"]),
    ("sharded_batch_not_divisible", lambda: jaxamp.parallel.put_sharded({"x": np.zeros((12, 2))}),
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
    master = {"w": jnp.ones(4), "b": jnp.zeros(2)}
    opt_state = tx.init(master)
    params = get_policy("mixed_bfloat16").cast_params_to_compute(master)  # the working params
    snapshot = jax.device_get(opt_state)
    with pytest.raises(ValueError, match="gradient of 'w' has shape"):
        tx.update({"w": jnp.ones(3), "b": jnp.ones(2)}, opt_state, params)
    assert_tree_bitwise_equal(jax.device_get(opt_state), snapshot)
    _, new = tx.update({"w": jnp.ones(4), "b": jnp.ones(2)}, opt_state, params)
    assert int(new.health.applied_steps) == 1


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


# --------------------------------------------------------------------------------------------
# A bad --data file, through the CLI: one line, exit status 2, no workdir
# --------------------------------------------------------------------------------------------

def _images(n=40):
    return np.random.default_rng(0).integers(0, 256, (n, 8, 8), dtype=np.uint8)


def _npz(name="data.npz", **arrays):
    def write(tmp_path):
        path = tmp_path / name
        with open(path, "wb") as f:  # a file object: np.savez appends no .npz to the name
            np.savez(f, **arrays)
        return path
    return write


def _raw(name, content):
    def write(tmp_path):
        path = tmp_path / name
        path.write_bytes(content)
        return path
    return write


def _truncated(tmp_path):
    path = _npz(image=_images(), label=np.arange(40) % 3)(tmp_path)
    content = path.read_bytes()
    path.write_bytes(content[:len(content) // 2])
    return path


def _bad_crc(tmp_path):
    path = _npz(image=_images(), label=np.arange(40) % 3)(tmp_path)
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 0xFF  # in the middle of the (stored, uncompressed) pixels
    path.write_bytes(bytes(content))
    return path


def _npy_as_npz(tmp_path):
    path = tmp_path / "data.npz"
    with open(path, "wb") as f:
        np.save(f, _images())
    return path


def _directory(tmp_path):
    (tmp_path / "data.npz").mkdir()
    return tmp_path / "data.npz"


_TEXT = ["--task", "text", "--model", "gpt_tiny", "--seq-len", "16"]
_LABELS = np.arange(40) % 3
_EXPECTED_NPZ = "expected a .npz archive with images under 'image'"

# (id, writes the file into tmp_path and returns its path, extra CLI arguments, fragments of the
# one line after "<file>: ")
DATA_CASES = [
    ("negative_labels", _npz(image=_images(), label=np.r_[-1, _LABELS[1:]]), [],
     ["labels 'label' include -1 (1 of 40 are negative)",
      "expected class ids in [0, num_classes)"]),
    ("labels_beyond_num_classes", _npz(image=_images(), label=np.arange(40) % 12),
     ["--num-classes", "10"],
     ["labels 'label' go up to 11, outside num_classes=10", "expected class ids in [0, 10)"]),
    ("fractional_float_labels", _npz(image=_images(), label=np.arange(40) * 0.5), [],
     ["labels 'label' are float64[40] and include 0.5, not a class id",
      "expected one integer class per image, shaped [N]"]),
    ("whole_float_labels", _npz(image=_images(), label=_LABELS.astype(np.float64)), [],
     ["labels 'label' are float64[40], whole numbers stored as floats",
      "labels.astype(np.int64)", "expected one integer class per image"]),
    ("one_hot_labels", _npz(image=_images(), label=np.eye(3, dtype=np.int64)[_LABELS]), [],
     ["labels 'label' are int64[40, 3]", "labels.argmax(axis=1)",
      "expected one integer class per image, shaped [N]"]),
    ("truncated_npz", _truncated, [],
     ["is truncated or corrupt (BadZipFile", "expected a complete .npz archive"]),
    ("npz_with_a_bad_crc", _bad_crc, [],
     ["is truncated or corrupt (BadZipFile: Bad CRC-32", "expected a complete .npz archive"]),
    ("object_array", _npz(image=_images(), label=np.array([1, "a"] * 20, dtype=object)), [],
     ["array 'label' holds Python objects (dtype=object)", "pickle",
      "expected numeric arrays"]),
    ("missing_label_key", _npz(image=_images(), targets=_LABELS), [],
     ["has arrays ['image', 'targets']", "expected labels under one of 'label', 'labels', 'y'",
      "np.savez(path, image=images, label=labels)"]),
    ("missing_image_key", _npz(pixels=_images(), label=_LABELS), [],
     ["has arrays ['label', 'pixels']", "expected images under one of 'image', 'images', 'x'"]),
    ("length_mismatch", _npz(image=_images(), label=_LABELS[:39]), [],
     ["40 images 'image' but 39 labels 'label'", "expected one label per image"]),
    ("images_of_wrong_rank", _npz(image=np.zeros((40, 64)), label=_LABELS), [],
     ["images 'image' have shape (40, 64)", "expected [N, H, W] or [N, H, W, C]"]),
    ("empty_arrays", _npz(image=np.zeros((0, 8, 8), np.uint8), label=np.zeros(0, np.int64)), [],
     ["images 'image' have shape (0, 8, 8, 1), no pixels", "expected at least one image"]),
    ("nonfinite_images", _npz(image=np.where(np.arange(40)[:, None, None] == 5, np.nan,
                                             np.full((40, 8, 8), 0.5)), label=_LABELS), [],
     ["images 'image' hold 64 values that are inf or nan", "the first in image 5",
      "expected finite pixel values"]),
    ("string_images", _npz(image=np.full((40, 8, 8), "a"), label=_LABELS), [],
     ["images 'image' are <U1", "expected real numbers"]),
    ("too_few_examples", _npz(image=_images(10), label=np.arange(10) % 3), [],
     ["holds 10 examples, 8 for training and 2 held out for eval", "expected at least 20",
      "--batch-size 16", "or a smaller --batch-size"]),
    ("empty_file", _raw("data.npz", b""), [], ["is empty (0 bytes)", _EXPECTED_NPZ]),
    ("not_a_zip", _raw("data.npz", b"image,label\n0,1\n"), [],
     ["is not a .npz archive (a .npz is a zip file", _EXPECTED_NPZ]),
    ("npy_named_npz", _npy_as_npz, [], ["holds a single array (a .npy file), not a .npz archive",
                                        _EXPECTED_NPZ]),
    ("nonexistent_path", lambda tmp_path: tmp_path / "nowhere.npz", [],
     ["no such file", _EXPECTED_NPZ]),
    ("directory", _directory, [], ["is a directory", _EXPECTED_NPZ]),
    ("wrong_extension", _raw("data.csv", b"0,1\n"), [],
     ["has the extension .csv", "expected a .npz archive for --task digits"]),
    ("text_not_utf8", _raw("corpus.txt", b"hello \xff world " * 100), _TEXT,
     ["is not UTF-8 text (byte 6 is 0xff", "expected a UTF-8 text file"]),
    ("text_empty", _raw("corpus.txt", b""), _TEXT, ["is empty", "expected a UTF-8 text file"]),
    ("text_too_short", _raw("corpus.txt", b"hello"), _TEXT,
     ["holds 5 bytes, 5 for training and 0 held out for eval", "expected at least 170 bytes",
      "--seq-len 16 + 1 bytes", "or a smaller --seq-len"]),
    ("text_given_an_npz", _npz(image=_images(), label=_LABELS), _TEXT,
     ["is a numpy .npz file", "expected a UTF-8 text file for --task text"]),
    ("text_nonexistent", lambda tmp_path: tmp_path / "corpus.txt", _TEXT,
     ["no such file", "expected a UTF-8 text file"]),
    ("text_directory", lambda tmp_path: tmp_path, _TEXT,
     ["is a directory", "expected a UTF-8 text file"]),
]


def _cli_error(tmp_path, capsys, path, *args):
    from train import cli
    workdir = tmp_path / "workdir"
    with pytest.raises(SystemExit) as info:
        cli.main(["--config", "tiny", "--no-progress", "--data", str(path), "--workdir",
                  str(workdir), *args])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert not workdir.exists()
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err


def test_the_data_catalogue_ids_are_unique():
    assert len({case[0] for case in DATA_CASES}) == len(DATA_CASES) >= 25


@pytest.mark.parametrize("write, args, fragments", [c[1:] for c in DATA_CASES],
                         ids=[c[0] for c in DATA_CASES])
def test_a_bad_data_file_is_one_line_and_writes_nothing(tmp_path, capsys, write, args, fragments):
    path = write(tmp_path)
    err = _cli_error(tmp_path, capsys, path, *args)
    assert err.startswith(f"python -m train: error: {path}: "), err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"


def test_data_with_a_task_that_makes_its_own_is_refused(tmp_path, capsys):
    path = _npz(image=_images(), label=_LABELS)(tmp_path)
    err = _cli_error(tmp_path, capsys, path, "--task", "synthetic_images")
    assert err.startswith(f"python -m train: error: --data {path} with --task synthetic_images")
    assert "expected --task digits for .npz images, or text or mlm for a text file" in err


def test_num_classes_below_one_is_refused(tmp_path, capsys):
    path = _npz(image=_images(), label=_LABELS)(tmp_path)
    err = _cli_error(tmp_path, capsys, path, "--num-classes", "0")
    assert "--num-classes 0; expected a positive number of classes" in err


@pytest.mark.parametrize("norm", ["-1", "nan"])
def test_a_negative_or_nan_grad_clip_is_refused(tmp_path, capsys, norm):
    path = _npz(image=_images(), label=_LABELS)(tmp_path)
    err = _cli_error(tmp_path, capsys, path, "--grad-clip", norm)
    assert f"--grad-clip {float(norm)}; expected a norm >= 0 (0: no clipping)" in err


@pytest.mark.parametrize("value", ["int8", "mu=fp8", "=bfloat16", "mu=bfloat16,nu"])
def test_a_bad_moments_dtype_is_refused(capsys, value):
    from train import cli
    with pytest.raises(SystemExit) as info:  # argparse's usage, then the one-line error
        cli.parser().parse_args(["--moments-dtype", value])
    assert info.value.code == 2
    assert (f"error: argument --moments-dtype: {value!r}: expected one of float32, bfloat16, "
            "8bit, or FIELD=FORMAT pairs") in capsys.readouterr().err
    assert cli.parser().parse_args(["--moments-dtype", "mu=bfloat16,nu=8bit"]).moments_dtype \
        == "mu=bfloat16,nu=8bit"


def test_a_good_data_file_is_summarized_with_its_inferred_classes(tmp_path, capsys):
    from train import cli
    from train.configs import get_config
    path = _npz(image=_images(), label=np.arange(40) % 12)(tmp_path)
    config = cli.check_data(get_config("tiny", data=str(path)))
    assert config.num_classes == 12
    assert capsys.readouterr().out == (f"data: {path}: 40 examples, image shape 8x8x1, "
                                       "num_classes=12 (inferred from labels)\n")
    assert cli.check_data(get_config("tiny", data=str(path)), num_classes=20).num_classes == 20
    assert "num_classes=20 (from --num-classes)" in capsys.readouterr().out
    text = _raw("corpus.txt", "naïve text ".encode() * 20)(tmp_path)
    cli.check_data(get_config("tiny", task="text", seq_len=16, data=str(text)))
    assert capsys.readouterr().out == f"data: {text}: 240 bytes of UTF-8 text, vocab=256 (bytes)\n"


@pytest.mark.parametrize("case", ["negative_labels", "truncated_npz"])
def test_a_bad_data_file_end_to_end(tmp_path, case):
    _, write, args, fragments = next(c for c in DATA_CASES if c[0] == case)
    path, workdir = write(tmp_path), tmp_path / "workdir"
    proc = subprocess.run([sys.executable, "-m", "train", "--config", "tiny", "--data", str(path),
                           "--workdir", str(workdir), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"python -m train: error: {path}: ")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(fragment in proc.stderr for fragment in fragments), proc.stderr
    assert not workdir.exists()
