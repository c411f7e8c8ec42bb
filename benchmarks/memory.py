"""Suite ``memory``: saved activations and the bytes of the training state (abstract traces,
nothing runs).

    python -m benchmarks memory

ResNet-50 and BERT-Large: jaxamp on the NNX reference models of ``train/models/``, the peers on
standard Linen models (``train/models/linen_resnet.py``, ``train/models/linen_encoder.py``) built
the way their documentation builds them. Ratios are against the fp32 model of the same code.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxamp
from benchmarks import harness
from benchmarks.harness import tree_bytes

ROUNDS = None  # nothing is timed

# The Linen variants, in the order of the table.
LINEN_VARIANTS = ("flax fp32 (Linen)", "jmp recipe (Linen)", "flax dtype=bf16 (Linen)")


def linen_variant(name: str) -> tuple[dict, Any]:
    """``(the dtypes its layers are built with, how its loss is wrapped)`` of a Linen variant;
    the peers (jmp) are imported here, when the suite runs."""
    if name == "flax fp32 (Linen)":
        return {"norm_dtype": jnp.float32}, None
    if name == "jmp recipe (Linen)":
        from benchmarks.peers import jmp_recipe
        return jmp_recipe.MODEL_DTYPES, jmp_recipe.cast_to_compute
    from benchmarks.peers import flax_recipe
    return flax_recipe.MODEL_DTYPES, None


def _cases(tiny: bool):
    from train.models import linen_encoder
    from train.models import linen_resnet
    if tiny:
        img, batch, seq = 32, 2, 16
        resnet_kw = dict(stage_sizes=(1, 1), width=8, num_classes=10)
        bert_kw = dict(vocab=128, width=32, depth=1, heads=2, mlp=64)
        nnx_resnet = ("resnet50_small", dict(stage_sizes=(1, 1), width=8))
        nnx_bert = ("bert_tiny", dict(depth=1, width=32))
    else:
        img, batch, seq = 224, 8, 128
        resnet_kw = dict(num_classes=1000)
        bert_kw = dict(vocab=30522, width=1024, depth=24, heads=16, mlp=4096)
        nnx_resnet = ("resnet50", {})
        nnx_bert = ("bert_large", {})
    return {
        f"ResNet-50 ({img}x{img}, batch {batch})" if not tiny else "ResNet (tiny)": dict(
            kind="image", nnx=nnx_resnet, shape=(batch, img, img, 3),
            linen=lambda **kw: linen_resnet.ResNet(**resnet_kw, **kw)),
        f"BERT-Large ({seq} tokens, batch {batch})" if not tiny else "BERT (tiny)": dict(
            kind="text", nnx=nnx_bert, shape=(batch, seq),
            linen=lambda **kw: linen_encoder.Encoder(**bert_kw, **kw)),
    }


def _linen_loss(model, case: dict):
    """``(loss(params, x), params, x)``: a Linen model's cross-entropy in fp32, on zeros."""
    kind, shape = case["kind"], case["shape"]
    rng = jax.random.key(0)
    if kind == "image":
        x = jnp.zeros(shape, jnp.float32)
        labels = jnp.zeros(shape[:1], jnp.int32)
        variables = model.init(rng, x[:1], train=False)
        params, stats = variables["params"], variables["batch_stats"]

        def logits_of(p, x):
            out, _ = model.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
            return out, labels
    else:
        x = jnp.zeros(shape, jnp.int32)
        variables = model.init(rng, x[:1])
        params = variables["params"]

        def logits_of(p, x):
            return model.apply({"params": p}, x), x

    def loss(p, x):
        logits, labels = logits_of(p, x)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1))

    return loss, params, x


def _linen_memory(case: dict, variant: str) -> tuple[int, int]:
    """``(saved activation bytes, params + adamw state bytes)`` of a Linen peer variant."""
    layer_dtypes, wrap = linen_variant(variant)
    loss, params, x = _linen_loss(case["linen"](**layer_dtypes), case)
    if wrap is not None:
        loss = wrap(loss)
    saved = jaxamp.audit_grad(loss, params, x).saved_bytes
    state = tree_bytes(params) + tree_bytes(jax.eval_shape(optax.adamw(1e-3).init, params))
    return saved, state


def reference_loss(name: str, kw: dict, kind: str, shape: tuple, policy: str):
    """``(params, loss(params, batch), batch)`` of the NNX reference model ``name`` built under
    ``policy``: its cross-entropy (``kind`` "image") or masked-LM loss ("text") on zeros."""
    from train import models
    graphdef, params, model_state = models.split(models.build(name, policy, **kw))
    if kind == "image":
        batch = {"image": jnp.zeros(shape, jnp.float32), "label": jnp.zeros(shape[:1], jnp.int32)}
        closs = models.classification_loss(graphdef)

        def loss(p, b):
            return closs(p, b, model_state=model_state)[0]
    else:
        batch = {"tokens": jnp.zeros(shape, jnp.int32), "targets": jnp.zeros(shape, jnp.int32)}
        mlm = models.mlm_loss(graphdef)

        def loss(p, b):
            return mlm(p, b)[0]
    return params, loss, batch


def _jaxamp_memory(case: dict, policy: str) -> tuple[int, int]:
    """``(saved activation bytes, params + master + adamw state bytes)`` of a reference model."""
    name, kw = case["nnx"]
    params, loss, batch = reference_loss(name, kw, case["kind"], case["shape"], policy)
    if policy == "float32":  # what an fp32 user holds: params and adamw's moments
        state_bytes = tree_bytes(params) + tree_bytes(
            jax.eval_shape(optax.adamw(1e-3).init, params))
    else:  # working params, and the fp32 master with adamw's moments in the optimizer state
        tx = jaxamp.mixed_precision(optax.adamw(1e-3), policy)
        state = jax.eval_shape(lambda p: jaxamp.TrainState.create(params=p, tx=tx), params)
        state_bytes = tree_bytes(state.params) + tree_bytes(state.opt_state)
    working = jaxamp.get_policy(policy).cast_params_to_compute(params)
    return jaxamp.audit_grad(loss, working, batch).saved_bytes, state_bytes


def run(args) -> list[dict]:
    rows = []
    for label, case in _cases(args.tiny).items():
        measured = {
            "fp32 (reference model)": _jaxamp_memory(case, "float32"),
            "jaxamp mixed_bfloat16": _jaxamp_memory(case, "mixed_bfloat16"),
            **{variant: _linen_memory(case, variant) for variant in LINEN_VARIANTS},
        }
        for variant, (saved, state) in measured.items():
            base = measured["flax fp32 (Linen)" if "Linen" in variant
                            else "fp32 (reference model)"]
            rows.append({"model": label, "variant": variant, "saved_mb": saved / 1e6,
                         "saved_vs_fp32": saved / base[0], "state_mb": state / 1e6,
                         "state_vs_fp32": state / base[1],
                         "label": f"{label.split(' ')[0]} {variant.split(' (')[0]}"})
    header = (f"{harness.machine()}; abstract trace, nothing runs. Ratios are against the fp32 "
              "model of the same code: jaxamp against the reference model in float32, the "
              "Linen peers against the Linen model in fp32. State = params (+ master) + adamw "
              "moments.")
    harness.write_outputs("memory", rows, ["model", "variant", "saved_mb", "saved_vs_fp32",
                                           "state_mb", "state_vs_fp32"], args.out,
                          ("label", "saved_vs_fp32"), header)
    return rows
