"""The reference models in ``train/models``: dtypes under every policy, one jaxamp train step,
skipped steps, the precision audit, param counts of the published configs, learning on a tiny
task, and the batch-norm layer's running statistics (the fp32 ops under the layers are tested
in tests/test_ops.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_tree_bitwise_equal
from helpers import covering_grid

import jaxamp
from train import models
from train.models import layers

F32, BF16 = jnp.float32, jnp.bfloat16
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
HALF = {"mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}

# family -> (model name, config overrides, batch shape)
FAMILIES = {
    "resnet18_small": ("resnet18_small", dict(stage_sizes=(1, 1), width=8), (8, 8, 8, 3)),
    "resnet18_imagenet_stem": ("resnet18", dict(stage_sizes=(1, 1), width=8, num_classes=10),
                               (4, 32, 32, 3)),
    "resnet50_bottleneck": ("resnet50_small", dict(stage_sizes=(1, 1), width=8),
                            (4, 8, 8, 3)),
    "bert_tiny": ("bert_tiny", {}, (4, 16)),
    "gpt_tiny": ("gpt_tiny", {}, (4, 16)),
}


def is_resnet(family):
    return family.startswith("resnet")


def make_batch(family, seed=0):
    """A learnable batch: class-dependent images, or periodic byte sequences."""
    shape = FAMILIES[family][2]
    rng = np.random.default_rng(seed)
    if is_resnet(family):
        labels = np.arange(shape[0]) % 4
        images = rng.normal(size=shape) * 0.5 + labels[:, None, None, None] * 0.5
        return {"image": jnp.asarray(images, F32), "label": jnp.asarray(labels, jnp.int32)}
    b, length = shape
    windows = (np.arange(length + 1)[None, :] * 3 + np.arange(b)[:, None]) % 11 + 65
    return {"tokens": jnp.asarray(windows[:, :-1], jnp.int32),
            "targets": jnp.asarray(windows[:, 1:], jnp.int32),
            "mask": jnp.ones((b, length), F32)}


def loss_of(family, graphdef):
    if is_resnet(family):
        return models.classification_loss(graphdef), dict(has_model_state=True, has_aux=True)
    if family.startswith("bert"):
        return models.mlm_loss(graphdef), dict(has_aux=True)
    return models.lm_loss(graphdef), dict(has_aux=True)


# The tests check dtypes and values, not speed: compile at XLA's lowest backend optimization
# level, which halves the compile time of these small graphs.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def jit(fn):
    return jax.jit(fn, compiler_options=FAST_COMPILE)


@functools.cache
def setup(family, policy):
    """The model, its split, a fresh TrainState and the jitted step (compiled once per case)."""
    name, overrides, _ = FAMILIES[family]
    model = models.build(name, policy, **overrides)
    graphdef, params, model_state = models.split(model)
    # A small initial scale: fp16 steps go through on the first try.
    scale = jaxamp.DynamicLossScale(loss_scale=2.0**8) if policy == "mixed_float16" else None
    tx = jaxamp.mixed_precision(optax.adam(3e-3), policy, loss_scale=scale)
    state = jaxamp.TrainState.create(params=params, tx=tx, model_state=model_state)
    loss_fn, flags = loss_of(family, graphdef)
    step = jit(jaxamp.make_train_step(loss_fn, **flags))
    return model, graphdef, state, step


def dtypes(tree):
    return {str(x.dtype) for x in jax.tree.leaves(tree)}


def assert_trees_differ(a, b):
    assert any(not np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


# --------------------------------------------------------------------------------------------
# Every family x every policy: forward, one step, a skipped step
# --------------------------------------------------------------------------------------------

# `make test`: each family and each policy once; `make test-all`: the product.
@pytest.mark.parametrize(("family", "policy"), covering_grid(list(FAMILIES), POLICIES))
def test_forward_and_step(family, policy):
    model, graphdef, state, step = setup(family, policy)
    compute = jnp.dtype(jaxamp.get_policy(policy).compute_dtype)
    batch = make_batch(family)

    # The module holds the fp32 master params; its forward computes in the compute dtype.
    assert dtypes(nnx.state(model, nnx.Param)) == {"float32"}
    if is_resnet(family):
        logits = jit(lambda p, s, x: models.merge(graphdef, p, s)(x, train=False))(
            state.params, state.model_state, batch["image"])
        assert logits.shape == (batch["image"].shape[0], 10)
    else:
        logits = jit(lambda p, t: models.merge(graphdef, p)(t))(state.params, batch["tokens"])
        assert logits.shape == batch["tokens"].shape + (256,)
    assert logits.dtype == F32
    assert np.isfinite(np.asarray(logits)).all()

    new, metrics = step(state, batch)
    assert metrics["loss"].dtype == F32 and np.isfinite(float(metrics["loss"]))
    assert metrics["aux"]["accuracy"].dtype == F32
    assert bool(metrics["grads_finite"])
    assert dtypes(new.params) == {compute.name}
    assert dtypes(new.master_params) == {"float32"}
    assert_trees_differ(new.master_params, state.master_params)
    if is_resnet(family):
        assert dtypes(new.model_state) == {"float32"}
        assert_trees_differ(new.model_state, state.model_state)  # applied: statistics move
    else:
        assert new.model_state is None

    # A batch with an inf gives non-finite gradients: the step is skipped and the params, the
    # master and the batch-norm statistics stay bit for bit.
    poisoned = dict(batch)
    if is_resnet(family):
        poisoned["image"] = batch["image"].at[0, 0, 0, 0].set(jnp.inf)
    else:
        poisoned["mask"] = batch["mask"].at[0, 0].set(jnp.inf)
    skipped, metrics = step(new, poisoned)
    assert not bool(metrics["grads_finite"])
    assert int(metrics["skipped_steps"]) == 1
    assert_tree_bitwise_equal(skipped.params, new.params)
    assert_tree_bitwise_equal(skipped.master_params, new.master_params)
    if is_resnet(family):
        assert_tree_bitwise_equal(skipped.model_state, new.model_state)
        assert dtypes(skipped.model_state) == {"float32"}
    if policy == "mixed_float16":
        assert float(skipped.loss_scale) == float(new.loss_scale) / 2


# --------------------------------------------------------------------------------------------
# The precision audit: no matmul promoted to fp32, half the saved activations
# --------------------------------------------------------------------------------------------

def audit(family, policy):
    _, graphdef, state, _ = setup(family, policy)
    loss_fn, _ = loss_of(family, graphdef)
    batch = jaxamp.get_policy(policy).cast_to_compute(make_batch(family))
    if is_resnet(family):
        return jaxamp.audit_grad(lambda p, b, s: loss_fn(p, b, model_state=s)[0],
                                 state.params, batch, state.model_state)
    return jaxamp.audit_grad(lambda p, b: loss_fn(p, b)[0], state.params, batch)


@pytest.mark.parametrize("family", FAMILIES)
def test_audit(family):
    fp32 = audit(family, "float32")
    assert fp32.share("float32") == 1.0
    assert set(fp32.saved_bytes_by_dtype) <= {"float32", "int32"}
    for policy, half in HALF.items():
        report = audit(family, policy)
        assert report.total_matmul_flops == fp32.total_matmul_flops
        assert report.share(half) >= 0.99, report
        assert report.fp32_matmuls == [], report
        # Statistics, softmaxes, GELU, bias gradients and the loss reduce in fp32.
        assert report.half_sensitive_ops == [], report
        # What is saved for backward is the half-precision activations plus small fp32
        # statistics: about half of the fp32 model's bytes.
        assert report.saved_bytes <= 0.55 * fp32.saved_bytes, report
        fp32_saved = report.saved_bytes_by_dtype.get("float32", 0)
        assert fp32_saved <= 0.05 * report.saved_bytes, report


# --------------------------------------------------------------------------------------------
# Published configs: built abstractly, param counts
# --------------------------------------------------------------------------------------------

def bert_mlm_params(vocab, width, depth, mlp, max_len=512, type_vocab=2):
    """BERT with the MLM head and tied decoder (HF ``BertForMaskedLM``), by hand."""
    embeddings = (vocab + max_len + type_vocab) * width + 2 * width
    layer = 4 * (width * width + width) + 2 * (2 * width) + width * mlp + mlp + mlp * width + width
    head = width * width + width + 2 * width + vocab
    return embeddings + depth * layer + head


def gpt_params(vocab, width, depth, mlp, max_len):
    """GPT-2 with tied embeddings, by hand."""
    layer = 4 * (width * width + width) + 2 * (2 * width) + width * mlp + mlp + mlp * width + width
    return (vocab + max_len) * width + depth * layer + 2 * width


@pytest.mark.parametrize("name, overrides, expected, published", [
    ("resnet18", {}, 11_689_512, 11.7e6),        # torchvision resnet18
    ("resnet50", {}, 25_557_032, 25.6e6),        # torchvision resnet50
    ("bert_base", {}, bert_mlm_params(30522, 768, 12, 3072), 110e6),
    ("bert_large", {}, bert_mlm_params(30522, 1024, 24, 4096), 335e6),
    ("gpt_small", {"vocab": 50257}, 124_439_808, 124e6),   # GPT-2 small (BPE vocabulary)
    ("gpt_small", {}, gpt_params(256, 768, 12, 3072, 1024), 86e6),
])
def test_published_param_counts(name, overrides, expected, published):
    model = nnx.eval_shape(lambda: models.build(name, "mixed_bfloat16", **overrides))
    leaves = jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    assert all(isinstance(x, jax.ShapeDtypeStruct) and x.dtype == F32 for x in leaves)
    count = models.param_count(model)
    assert count == expected
    assert abs(count - published) / published < 0.02


def test_config_shapes():
    cfg = models.config_of("bert_large")
    assert (cfg.depth, cfg.width, cfg.heads, cfg.mlp) == (24, 1024, 16, 4096)
    cfg = models.config_of("bert_base")
    assert (cfg.depth, cfg.width, cfg.heads, cfg.mlp) == (12, 768, 12, 3072)
    cfg = models.config_of("gpt_small")
    assert (cfg.depth, cfg.width, cfg.heads, cfg.mlp, cfg.vocab) == (12, 768, 12, 3072, 256)
    assert models.config_of("gpt_tiny").vocab == 256
    assert models.config_of("resnet50_small", num_classes=100).num_classes == 100


# --------------------------------------------------------------------------------------------
# Learning, the functional bridge, errors
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["resnet18_small", "gpt_tiny"])
def test_loss_decreases_mixed_bfloat16(family):
    _, _, state, step = setup(family, "mixed_bfloat16")
    batch = make_batch(family)
    losses = []
    for _ in range(20):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert int(metrics["skipped_steps"]) == 0
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.7 * losses[0], losses
    assert np.mean(losses[-5:]) < np.mean(losses[5:10]) < np.mean(losses[:5]), losses
    assert float(metrics["aux"]["accuracy"]) > 0.5


def test_split_merge_round_trip():
    model, graphdef, state, _ = setup("resnet18_small", "float32")
    _, params, model_state = models.split(model)
    assert isinstance(params, dict) and isinstance(model_state, dict)
    paths = {jaxamp.gradients.tree_path_str(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert {"stem/kernel", "blocks/0/conv1/kernel", "blocks/1/downsample/norm/scale",
            "head/kernel", "head/bias"} <= paths
    stats = {jaxamp.gradients.tree_path_str(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(model_state)[0]}
    assert "stem_norm/mean" in stats and "stem_norm/var" in stats
    assert not any(p.endswith(("/mean", "/var")) for p in paths)
    assert models.param_count(params) == models.param_count(model)
    assert_tree_bitwise_equal(models.split(models.merge(graphdef, params, model_state))[1],
                              params)
    assert models.split(setup("gpt_tiny", "float32")[0])[2] is None


def test_eval_loss_keeps_running_statistics():
    _, graphdef, state, _ = setup("resnet18_small", "mixed_bfloat16")
    batch = state.policy.cast_to_compute(make_batch("resnet18_small"))
    eval_fn = jit(models.classification_loss(graphdef, train=False))
    loss, new_state, aux = eval_fn(state.params, batch, model_state=state.model_state)
    assert loss.dtype == F32 and aux["accuracy"].dtype == F32
    assert_tree_bitwise_equal(new_state, state.model_state)


@pytest.mark.parametrize("task", ["text", "digits"])
def test_the_whole_split_eval_weighs_every_example_alike(task):
    """``eval_batches=0``: the whole held-out split, its last, smaller batch weighted by its size
    (a mean of the batches' means would count the one window of the last batch 1456 times)."""
    from train import train as train_lib
    from train.configs import get_config
    batch_size = {"text": 1456, "digits": 100}[task]  # 2913 windows; 360 images: 3 x 100 + 60
    config = get_config("text" if task == "text" else "default", precision="float32",
                        batch_size=batch_size, seq_len=16, eval_batches=0,
                        model_overrides={"gpt": {"depth": 1, "width": 32, "mlp": 64},
                                         "resnet": {"width": 8, "stage_sizes": (1, 1)}})
    policy = jaxamp.get_policy("float32")
    _, evals, meta = train_lib.build_data(config)
    params, model_state, _, eval_fn, flags = train_lib.build_model(config, policy, meta)
    state = train_lib.create_train_state(config, policy, params, model_state)
    evals = list(evals)
    sizes = [len(b["label" if task == "digits" else "tokens"]) for b in evals]
    assert sizes[:-1] == [batch_size] * (len(sizes) - 1) and 0 < sizes[-1] < batch_size
    got = train_lib.evaluate(config, state, eval_fn, flags, evals)
    whole = jax.tree.map(lambda *x: np.concatenate(x), *evals)
    kwargs = {"model_state": state.model_state} if flags.get("has_model_state") else {}
    out = jax.jit(eval_fn)(state.params, whole, **kwargs)
    np.testing.assert_allclose(got["eval_loss"], float(out[0]), rtol=2e-6)
    if task == "digits":
        np.testing.assert_allclose(got["eval_accuracy"], float(out[-1]["accuracy"]), rtol=2e-6)


def test_gpt_is_causal():
    _, graphdef, state, _ = setup("gpt_tiny", "float32")
    forward = jit(lambda p, t: models.merge(graphdef, p)(t))
    tokens = make_batch("gpt_tiny")["tokens"]
    changed = tokens.at[:, 10].set(0)
    a, b = forward(state.params, tokens), forward(state.params, changed)
    np.testing.assert_array_equal(np.asarray(a[:, :10]), np.asarray(b[:, :10]))
    assert not np.allclose(np.asarray(a[:, 10:]), np.asarray(b[:, 10:]))


@pytest.mark.parametrize("name", ["bert_tiny", "gpt_tiny"])
def test_fused_attention_computes_the_explicit_attention(name, monkeypatch):
    """``attention="cudnn"`` hands q, k, v to ``jax.nn.dot_product_attention`` in its layout,
    with its default scale and BERT's full or GPT's causal mask: asked for the XLA
    implementation (cuDNN's compiles for a GPU only), the logits and gradients are the explicit
    path's within bf16 rounding."""
    from train.models import transformer
    monkeypatch.setattr(transformer, "FUSED_IMPLEMENTATION", "xla")
    batch = make_batch(name)
    out = {}
    for attention in ("explicit", "cudnn"):
        model = models.build(name, "mixed_bfloat16", attention=attention)
        assert all(layer.attention.fused == (attention == "cudnn") for layer in model.layers)
        graphdef, params, _ = models.split(model)
        params = jaxamp.get_policy("mixed_bfloat16").cast_params_to_compute(params)

        def loss(p, graphdef=graphdef):
            logits = models.merge(graphdef, p)(batch["tokens"])
            return jnp.mean(logits ** 2), logits
        (_, logits), grads = jit(jax.value_and_grad(loss, has_aux=True))(params)
        out[attention] = logits, grads
    (a, ga), (b, gb) = out["explicit"], out["cudnn"]
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=0.05, rtol=0.05)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        scale = float(jnp.abs(x.astype(F32)).max()) + 1e-6
        np.testing.assert_allclose(np.asarray(y, F32) / scale, np.asarray(x, F32) / scale,
                                   atol=0.05)


@pytest.mark.parametrize("name", ["bert_tiny", "gpt_tiny"])
def test_the_fused_loss_head_is_the_logits_and_their_loss(name):
    """``fused_loss=True`` (the default) computes the tied projection and the cross-entropy in
    chunks: the same loss, accuracy and gradients as the logits' path, masked positions
    included."""
    batch = dict(make_batch(name))
    batch["mask"] = (jnp.arange(batch["tokens"].shape[1]) % 3 != 0).astype(F32)[None].repeat(
        batch["tokens"].shape[0], 0)
    out = {}
    for fused in (True, False):
        model = models.build(name, "mixed_bfloat16", fused_loss=fused)
        graphdef, params, _ = models.split(model)
        loss_fn = (models.mlm_loss if name.startswith("bert") else models.lm_loss)(graphdef)
        params = jaxamp.get_policy("mixed_bfloat16").cast_params_to_compute(params)
        out[fused] = jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)
    ((lf, af), gf), ((lp, ap), gp) = out[True], out[False]
    np.testing.assert_allclose(float(lf), float(lp), rtol=1e-3)
    np.testing.assert_allclose(float(af["accuracy"]), float(ap["accuracy"]), atol=0.02)
    for x, y in zip(jax.tree.leaves(gf), jax.tree.leaves(gp), strict=True):
        scale = float(jnp.abs(y.astype(F32)).max()) + 1e-6
        np.testing.assert_allclose(np.asarray(x, F32) / scale, np.asarray(y, F32) / scale,
                                   atol=0.02)


def test_attention_choice():
    from train.models.transformer import fused_attention
    assert not fused_attention("auto", BF16, None, 64)  # the CPU backend
    assert fused_attention("cudnn", BF16, None, 64)
    assert fused_attention("cudnn", jnp.float16, None, 64)
    assert not fused_attention("cudnn", F32, None, 64)  # no fp32 kernel: the explicit path
    assert not fused_attention("cudnn", BF16, jaxamp.fp8.DelayedScaling(), 64)
    assert not fused_attention("explicit", BF16, None, 64)
    with pytest.raises(ValueError, match="attention must be one of"):
        models.build("gpt_tiny", attention="flash")


def test_lm_loss_shifts_tokens_without_targets():
    _, graphdef, state, _ = setup("gpt_tiny", "float32")
    batch = make_batch("gpt_tiny")
    window = jnp.concatenate([batch["tokens"], batch["targets"][:, -1:]], axis=1)
    loss_fn = jit(models.lm_loss(graphdef))
    with_targets, _ = loss_fn(state.params, {"tokens": batch["tokens"],
                                             "targets": batch["targets"]})
    shifted, _ = loss_fn(state.params, {"tokens": window})
    np.testing.assert_allclose(float(shifted), float(with_targets), rtol=1e-6)


def test_build_errors():
    with pytest.raises(ValueError, match="unknown model 'resnet7'"):
        models.build("resnet7")
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['depht'\]"):
        models.build("gpt_tiny", depht=3)
    with pytest.raises(ValueError, match="num_classes is for ResNets"):
        models.build("bert_tiny", num_classes=3)
    with pytest.raises(ValueError, match="not a multiple of heads"):
        models.build("gpt_tiny", width=30, heads=4)
    with pytest.raises(ValueError, match="block must be"):
        models.build("resnet18", block="wide")
    model = nnx.eval_shape(lambda: models.build("gpt_tiny", max_len=8))
    with pytest.raises(ValueError, match="exceeds max_len 8"):
        model(jnp.zeros((1, 9), jnp.int32))


# --------------------------------------------------------------------------------------------
# The layers (the ops themselves are tested in tests/test_ops.py)
# --------------------------------------------------------------------------------------------

def normal(seed, shape, scale=1.0, shift=0.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale + shift, F32)


def test_batch_norm_running_statistics():
    norm = layers.BatchNorm(3, dtype=BF16, momentum=0.9)
    x = normal(20, (6, 2, 2, 3), 2.0, 1.0)
    y = norm(x, train=True)
    assert y.dtype == BF16
    assert norm.mean[...].dtype == F32 and norm.var[...].dtype == F32
    x32 = np.asarray(x.astype(BF16).astype(F32))
    np.testing.assert_allclose(norm.mean[...], 0.1 * x32.mean((0, 1, 2)), rtol=1e-5)
    np.testing.assert_allclose(norm.var[...], 0.9 + 0.1 * x32.var((0, 1, 2)), rtol=1e-5)
    # Eval mode normalizes with the fp32 running statistics and leaves them alone.
    before = np.asarray(norm.mean[...])
    y = norm(x, train=False)
    assert y.dtype == BF16
    np.testing.assert_array_equal(norm.mean[...], before)


@pytest.mark.parametrize("name", ["nnx_gpt_tiny", "resnet18_small"])
def test_a_jitted_init_takes_its_key_as_an_argument(name):
    """`build(seed=key)` inside `jax.jit` with the key as the argument: the same draws as an
    int seed built op by op (to an ulp: the jitted program fuses the scaling of the draws), and
    no random draw left for XLA to fold into constants."""
    kw = dict(depth=1, width=16, heads=2, mlp=64, max_len=8, vocab=32) if "gpt" in name else \
        dict(stage_sizes=(1,), width=8)

    def init(key):
        return models.split(models.build(name, seed=key, **kw))[1]
    key = jax.random.key(3)
    lowered = jax.jit(init).lower(key)
    assert "rng" in lowered.as_text() or "threefry" in lowered.as_text()  # drawn at run time
    jitted, eager = lowered.compile()(key), models.split(models.build(name, seed=3, **kw))[1]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(jitted), jax.tree.leaves(eager),
                            strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_the_fp8_options_give_the_current_recipe_and_bad_combinations_are_errors(tmp_path):
    from train import train as train_lib
    from train.configs import get_config
    tiny = dict(steps=2, batch_size=4, seq_len=16, eval_batches=1, log_every=1, progress=False,
                model_overrides={"gpt": {"depth": 1, "width": 32, "mlp": 64}})
    config = get_config("text", precision="mixed_fp8", fp8_granularity="rowwise",
                        fp8_weight_grad="high", **tiny)
    policy = train_lib.policy_of(config)
    assert policy.fp8 == jaxamp.fp8.CurrentScaling(granularity="rowwise", weight_grad="high")
    assert train_lib.policy_of(get_config("text", precision="mixed_fp8")).fp8 is True
    summary = train_lib.train_and_evaluate(config, str(tmp_path))
    assert np.isfinite(summary["eval_loss"])
    for bad, message in [({"fp8_recipe": "delayed", "fp8_granularity": "blocks"},
                          "current recipe's"),
                         ({"fp8_granularity": "columns"}, "unknown FP8 granularity")]:
        with pytest.raises(ValueError, match=message):
            train_lib.check_fp8(get_config("text", precision="mixed_fp8", **bad))


def test_grad_clip_clips_the_unscaled_fp32_gradients_before_adamw():
    """``grad_clip``: adamw sees the gradients after unscaling (fp16's loss scale is 2**16
    here) and clipping to the global norm: 0.01 on each of 4 params, norm 0.02, clipped to
    0.005, is 0.0025 each, and adam's first moment after one step is 0.1 of it."""
    from train import train as train_lib
    from train.configs import get_config
    policy = jaxamp.get_policy("mixed_float16")
    step = jaxamp.make_train_step(lambda p, b: jnp.sum(p["w"].astype(F32) * b))
    mu = {}
    for clip in (0.0, 0.005):
        config = get_config("text", precision="mixed_float16", grad_clip=clip, steps=10)
        state = train_lib.create_train_state(config, policy, {"w": jnp.ones(4, F32)}, None)
        state, _ = step(state, jnp.full(4, 0.01, F32))
        adam, = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: isinstance(
            s, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
        mu[clip] = np.asarray(adam.mu["w"])
    np.testing.assert_allclose(mu[0.0], 0.1 * 0.01, rtol=1e-3)
    np.testing.assert_allclose(mu[0.005], 0.1 * 0.0025, rtol=1e-3)


@pytest.mark.parametrize("lr, master, warns", [
    (None, "stochastic", False),      # the text preset as it ships: 0.07% predicted
    (3e-6, "stochastic", False),      # 28%, the largest measured to train as the master
    (1e-6, "stochastic", True),       # 49%: beyond what was measured
    (1e-6, "kahan", False),           # exact: nothing to predict
])
def test_master_stochastic_warns_where_its_rounding_noise_is_predicted_to_matter(lr, master,
                                                                                  warns):
    """``--master stochastic`` predicts its rounding noise from the run's learning rates and
    the params' magnitudes (``jaxamp.rounding.rounding_noise``) when the state is built, and
    warns above ``STOCHASTIC_NOISE_WARNING``, naming ``--master kahan``."""
    import warnings

    from train import train as train_lib
    from train.configs import get_config
    config = get_config("text", precision="mixed_bfloat16", master=master, seed=0,
                        progress=False, **({} if lr is None else {"lr": lr}))
    policy = train_lib.policy_of(config)
    _, _, meta = train_lib.build_data(config)
    params, model_state = train_lib.build_model(config, policy, meta)[:2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_lib.create_train_state(config, policy, params, model_state)
    said = [str(w.message) for w in caught if "--master stochastic" in str(w.message)]
    assert len(said) == warns, said
    if warns:
        assert "--master kahan" in said[0] and "49%" in said[0]
