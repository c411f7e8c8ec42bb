"""Reference models (Flax NNX) and their bridge to ``jaxamp.make_train_step``.

    model = models.build("resnet18_small", "mixed_bfloat16", num_classes=10)
    graphdef, params, model_state = models.split(model)
    tx = jaxamp.mixed_precision(optax.adamw(1e-3), "mixed_bfloat16")
    state = jaxamp.TrainState.create(params=params, tx=tx, model_state=model_state)
    step = jax.jit(jaxamp.make_train_step(models.classification_loss(graphdef),
                                          has_model_state=True, has_aux=True))

Every model is built with fp32 params (the master copy; ``TrainState`` casts the working copy)
and computes in the policy's compute dtype, with normalization statistics, softmaxes, GELU and
the losses in fp32. Losses and accuracies come back in fp32.

Batches: images ``{"image": (B, H, W, C) float, "label": (B,) int}``; text
``{"tokens": (B, L) int32, "targets": (B, L) int32}``, plus an optional ``"mask"`` ``(B, L)``
float that weights the positions of the loss (the masked positions for MLM, padding for a
language model) and, for BERT, optional ``"segments"`` ``(B, L)`` int32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxamp
from jaxamp.ops import softmax_cross_entropy
from train.models import nnx_gpt
from train.models.layers import F32
from train.models.layers import weighted_mean
from train.models.resnet import CONFIGS as RESNET_CONFIGS
from train.models.resnet import ResNet
from train.models.resnet import ResNetConfig
from train.models.transformer import BERT_CONFIGS
from train.models.transformer import GPT
from train.models.transformer import GPT_CONFIGS
from train.models.transformer import BertMLM
from train.models.transformer import TransformerConfig

__all__ = ["MODELS", "build", "classification_loss", "config_of", "lm_loss", "merge",
           "mlm_loss", "param_count", "split"]

# name -> (family, config)
MODELS: dict[str, tuple[str, Any]] = {
    "resnet18": ("resnet", RESNET_CONFIGS["resnet18"]),
    "resnet50": ("resnet", RESNET_CONFIGS["resnet50"]),
    "resnet18_small": ("resnet", dataclasses.replace(RESNET_CONFIGS["resnet18"], stem="small",
                                                     num_classes=10)),
    "resnet50_small": ("resnet", dataclasses.replace(RESNET_CONFIGS["resnet50"], stem="small",
                                                     num_classes=10)),
    **{name: ("bert", cfg) for name, cfg in BERT_CONFIGS.items()},
    **{name: ("gpt", cfg) for name, cfg in GPT_CONFIGS.items()},
    # The user's GPT (train/models/nnx_gpt.py: flax NNX layers with their defaults, fp32, no
    # dtype=) at gpt_tiny's shape: what --autocast is for.
    "nnx_gpt_tiny": ("nnx_gpt", GPT_CONFIGS["gpt_tiny"]),
}


def config_of(name: str, *, num_classes: int | None = None, vocab: int | None = None,
              **overrides: Any) -> ResNetConfig | TransformerConfig:
    """The config of model ``name`` with ``num_classes``/``vocab`` and field overrides."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    family, config = MODELS[name]
    if family == "resnet":
        if vocab is not None:
            raise ValueError(f"vocab is for transformers; {name!r} takes num_classes")
        if num_classes is not None:
            overrides["num_classes"] = num_classes
    else:
        if num_classes is not None:
            raise ValueError(f"num_classes is for ResNets; {name!r} takes vocab")
        if vocab is not None:
            overrides["vocab"] = vocab
    fields = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown} for {name!r}; its config "
                         f"{type(config).__name__} has {sorted(fields)}")
    if "stage_sizes" in overrides:
        overrides["stage_sizes"] = tuple(overrides["stage_sizes"])
    return dataclasses.replace(config, **overrides)


def build(name: str, policy: Any = "float32", *, num_classes: int | None = None,
          vocab: int | None = None, seed: int | jax.Array = 0,
          fp8: jaxamp.fp8.DelayedScaling | None = None, **overrides: Any) -> nnx.Module:
    """Builds model ``name`` computing in ``policy``'s compute dtype, with fp32 params.

    Args:
      name: one of ``MODELS``: ``resnet18``, ``resnet50`` (ImageNet stem, 1000 classes),
        ``resnet18_small``, ``resnet50_small`` (3x3 stem without pooling, 10 classes),
        ``bert_tiny``, ``bert_base``, ``bert_large`` (MLM head; vocabulary 30522 for base and
        large, 256 for tiny), ``gpt_tiny``, ``gpt_small`` (byte vocabulary 256), and
        ``nnx_gpt_tiny``: a GPT written as a user writes it (``train/models/nnx_gpt.py``),
        which computes in fp32 whatever the policy unless the loss runs under
        ``jaxamp.autocast``.
      policy: anything ``jaxamp.get_policy`` accepts.
      num_classes: the ResNet classifier's size.
      vocab: a transformer's vocabulary size.
      seed: seeds the param init: an int, or a ``jax.random.key``. Under ``jax.jit`` pass
        the key as an argument of the jitted function: a seed fixed at trace time makes
        every random draw a compile-time constant, and XLA then folds the whole
        initialisation into constants (minutes to compile a GPT on a GPU).
      fp8: a ``jaxamp.fp8.DelayedScaling`` recipe: every matmul of a BERT or GPT runs in FP8
        with delayed scaling (its metadata is in :func:`split`'s model state). ResNets are
        convolutions, which FP8 does not cover.
      **overrides: fields of the config (``ResNetConfig`` or ``TransformerConfig``), for
        example ``stage_sizes=(1, 1), width=8`` or ``depth=2, width=64``.

    To build without allocating (for shapes and param counts), wrap it:
    ``nnx.eval_shape(lambda: build("bert_large"))``.
    """
    if jaxamp.get_policy(policy).fp8 and MODELS.get(name, ("",))[0] in ("bert", "gpt"):
        # Under an FP8 policy autocast runs every matmul in FP8, the head's too: the fused
        # head's matmuls (inside a custom_vjp) would stay bf16.
        overrides.setdefault("fused_loss", False)
    config = config_of(name, num_classes=num_classes, vocab=vocab, **overrides)
    dtype = jaxamp.get_policy(policy).compute_dtype
    rngs = nnx.Rngs(seed)
    family = MODELS[name][0]
    if fp8 is not None and family not in ("bert", "gpt"):
        raise ValueError(f"delayed-scaling FP8 layers exist for the bert_* and gpt_* models, not "
                         f"{name!r}: " + ("a ResNet is convolutions, and FP8 convolutions are "
                                          "not supported" if family == "resnet" else
                                          "it is built from flax's own layers; run it in FP8 "
                                          "with the current recipe (jaxamp.autocast)"))
    if family == "resnet":
        return ResNet(config, dtype=dtype, rngs=rngs)
    if family == "bert":
        return BertMLM(config, dtype=dtype, fp8=fp8, rngs=rngs)
    if family == "nnx_gpt":
        if config.mlp != 4 * config.width:
            raise ValueError(f"{name!r} has mlp = 4 * width; got mlp={config.mlp}, "
                             f"width={config.width}")
        return nnx_gpt.GPT(config.vocab, config.width, config.depth, config.heads,
                           config.max_len, rngs=rngs)
    return GPT(config, dtype=dtype, fp8=fp8, rngs=rngs)


def split(model: nnx.Module) -> tuple[nnx.GraphDef, dict, dict | None]:
    """``(graphdef, params, model_state)``: the functional form of ``model``.

    ``params`` is the ``nnx.Param`` state as a nested dict of arrays (what ``TrainState``
    and the optimizer take); ``model_state`` holds the batch-norm statistics and the FP8
    metadata (``jaxamp.fp8.Fp8Meta``), as a nested dict, or is ``None`` when the model has
    neither (transformers without FP8).
    """
    graphdef, params, stats, rest = nnx.split(model, nnx.Param, MODEL_STATE, ...)
    if jax.tree.leaves(rest):
        raise ValueError("the model holds state that is neither nnx.Param, nnx.BatchStat nor "
                         f"jaxamp.fp8.Fp8Meta ({sorted(nnx.to_pure_dict(rest))}); split it by "
                         "hand")
    model_state = nnx.to_pure_dict(stats)
    return graphdef, nnx.to_pure_dict(params), (model_state if jax.tree.leaves(model_state)
                                             else None)


MODEL_STATE = (nnx.BatchStat, jaxamp.fp8.Fp8Meta)
"""The variable kinds of the model state: batch-norm statistics and FP8 metadata."""


def merge(graphdef: nnx.GraphDef, params: Any, model_state: Any = None) -> nnx.Module:
    """The module back from :func:`split`'s parts (params in any dtype)."""
    return nnx.merge(graphdef, params, *(() if model_state is None else (model_state,)))


def param_count(tree: Any) -> int:
    """Number of params of a module (its ``nnx.Param`` leaves) or of a params tree.

    Works on abstract modules and trees (``nnx.eval_shape``, ``jax.ShapeDtypeStruct``).
    """
    if isinstance(tree, nnx.Module):
        tree = nnx.to_pure_dict(nnx.state(tree, nnx.Param))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def classification_loss(graphdef: nnx.GraphDef, *, train: bool = True) -> Callable:
    """``loss_fn(params, batch, model_state=...) -> (loss, new_model_state, aux)``.

    For ``jaxamp.make_train_step(loss_fn, has_model_state=True, has_aux=True)``. Mean softmax
    cross-entropy of the fp32 logits against ``batch["label"]``; ``aux`` is
    ``{"accuracy": ...}``. With ``train=True`` batch norm uses and updates the batch
    statistics; with ``train=False`` it uses the running averages and returns them unchanged.
    """
    def loss_fn(params, batch, model_state):
        model = merge(graphdef, params, model_state)
        logits_BxK = model(batch["image"], train=train)
        labels_B = batch["label"]
        loss = softmax_cross_entropy(logits_BxK, labels_B).mean()
        accuracy = (logits_BxK.argmax(-1) == labels_B).astype(F32).mean()
        new_state = nnx.to_pure_dict(nnx.state(model, MODEL_STATE))
        return loss, new_state, {"accuracy": accuracy}
    return loss_fn


def _with_model_state(loss_of_model: Callable, graphdef: nnx.GraphDef,
                      has_model_state: bool) -> Callable:
    """``loss_fn(params, batch) -> (loss, aux)``; with ``has_model_state`` (FP8 metadata),
    ``loss_fn(params, batch, model_state) -> (loss, new_model_state, aux)``."""
    if not has_model_state:
        return lambda params, batch: loss_of_model(merge(graphdef, params), batch)

    def loss_fn(params, batch, model_state):
        model = merge(graphdef, params, model_state)
        loss, aux = loss_of_model(model, batch)
        return loss, nnx.to_pure_dict(nnx.state(model, MODEL_STATE)), aux
    return loss_fn


def mlm_loss(graphdef: nnx.GraphDef, *, has_model_state: bool = False) -> Callable:
    """``loss_fn(params, batch) -> (loss, aux)`` for a :class:`BertMLM` (``has_aux=True``);
    with ``has_model_state`` (a model with FP8 metadata) it takes and returns the model state.

    Cross-entropy of ``batch["targets"]`` at the positions weighted by ``batch["mask"]`` (all
    positions when there is no mask), in fp32; ``aux`` is ``{"accuracy": ...}`` over the same
    positions.
    """
    def loss_of_model(model, batch):
        targets, mask = batch["targets"], batch.get("mask")
        loss, predicted = model.loss(batch["tokens"], targets, mask, batch.get("segments"))
        return loss, {"accuracy": weighted_mean(predicted == targets, mask)}
    return _with_model_state(loss_of_model, graphdef, has_model_state)


def lm_loss(graphdef: nnx.GraphDef, *, has_model_state: bool = False) -> Callable:
    """``loss_fn(params, batch) -> (loss, aux)``: next-token loss for a :class:`GPT`; with
    ``has_model_state`` (a model with FP8 metadata) it takes and returns the model state.

    ``batch["targets"][:, i]`` is the token that follows ``batch["tokens"][:, : i + 1]``.
    Without ``"targets"``, the tokens are shifted: inputs ``tokens[:, :-1]``, targets
    ``tokens[:, 1:]``. An optional ``batch["mask"]`` weights the positions.
    """
    def loss_of_model(model, batch):
        tokens, mask = batch["tokens"], batch.get("mask")
        if "targets" in batch:
            targets = batch["targets"]
        else:
            tokens, targets = tokens[:, :-1], tokens[:, 1:]
            mask = None if mask is None else mask[:, 1:]
        if isinstance(model, nnx_gpt.GPT):   # the user's model, with the user's loss
            logits = model(tokens).astype(jnp.float32)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
            return (weighted_mean(losses, mask),
                    {"accuracy": weighted_mean(logits.argmax(-1) == targets, mask)})
        loss, predicted = model.loss(tokens, targets, mask)
        return loss, {"accuracy": weighted_mean(predicted == targets, mask)}
    return _with_model_state(loss_of_model, graphdef, has_model_state)
