"""Suite ``gpu``: throughput, MFU and memory of ResNet-50, BERT-Large and a user's GPT on a GPU.

    bash benchmarks/gpu.sh                       # the core set, within 9 minutes, under $OUT
    SET=extended bash benchmarks/gpu.sh          # the other rows, appended
    python -m benchmarks gpu [--set core|extended|all] [--models resnet50,bert_large,nnx_gpt]
                             [--precisions ...] [--budget SECONDS] [--compile-workers N]
                             [--steps 20] [--seconds 5] [--append] [--render-only]
    python -m benchmarks gpu --tiny              # every configuration at a tiny size, any device
    make gpu-memory                              # every JAX row compiled for an H200, no GPU:
    python -m benchmarks gpu --deviceless h200   # memory by part, dtype, shape (gpu_deviceless.py)

One row per configuration (model x precision), measured and appended to ``OUT/gpu.jsonl`` as soon
as it is done; a configuration that fails writes a row with its error and the suite goes on. Each
run also appends its versions, devices and measured matmul peaks to ``OUT/gpu_runs.jsonl``; at the
end (or with ``--render-only``) the rows get their ratios and ``OUT/gpu.md`` and ``OUT/gpu.png``
are written from both files.

Precisions (each model runs its own in the order of ``MODEL_PRECISIONS``, what matters most
first, so that a budget or a timeout cuts the least; ``--set core`` is the rows that decide the
GPU goals, ``--set extended`` the rest):

* ``mixed_bfloat16``: ``make_train_step`` on ``jaxamp.mixed_precision(adamw, "mixed_bfloat16")``
  with ``skip="cond"`` (what ``skip="auto"`` is); ``mixed_bfloat16_select``: the same with
  ``skip="select"``; ``bare_bf16``: ``jax.value_and_grad`` and ``optax.adamw`` on the fp32 params
  cast to bf16 in the loss: no master copy, no loss scale, no finite check, no skip;
* ``fp32_default``: float32 under whatever default matmul precision the process has (read back
  and printed); ``mixed_float16`` (dynamic loss scale); ``fp32_highest``: float32 under
  ``jax.default_matmul_precision("highest")``;
* ``mixed_bfloat16_explicit`` (BERT-Large only): ``mixed_bfloat16`` with the explicit attention
  (two einsums around ``jaxamp.ops.attention_softmax``) instead of cuDNN's fused kernel, which
  BERT-Large's half-precision rows use (``jax.nn.dot_product_attention(implementation="cudnn")``;
  its fp32 rows run the explicit path);
* ``autocast_bf16`` (the user's GPT only): ``make_train_step(..., autocast=True)``;
* ``mixed_bfloat16_zero3`` (BERT-Large only): ``mixed_bfloat16`` under ``jax.jit`` with the state
  of ``jaxamp.parallel.state_sharding(params="sharded")`` on a mesh of every device: on one GPU
  the cost of the data-parallel path (``shard_map``, the explicit fp32 reduction, the sharded
  update) over the plain step; on several, ZeRO-3 itself;
* ``mixed_bfloat16_kahan``: ``mixed_bfloat16`` with ``master="kahan"`` and bf16 moments (8
  bytes of state per param against 14); ``mixed_bfloat16_stochastic`` (BERT-Large only):
  ``master="stochastic"`` and bf16 moments (6 bytes): their peak memory against
  ``mixed_bfloat16``'s is the whole step's saving;
* ``mixed_fp8_current`` and ``mixed_fp8_delayed`` (BERT-Large only): every matmul in FP8 (e4m3
  forward, e5m2 gradients), through ``make_train_step(autocast=True)`` under the ``mixed_fp8``
  policy (current scaling), or with the model built from ``jaxamp.fp8``'s delayed-scaling layers;
  their MFU is quoted against the FP8 peak (1,979 TFLOP/s dense on an H100/H200);
* ``torch_amp_bf16``, ``torch_amp_fp16``, ``torch_compile_bf16`` (ResNet-50 only):
  torchvision's ResNet-50 under ``torch.autocast``, eager with ``torch.optim.AdamW``'s defaults,
  and one row under ``torch.compile``.

Without a GPU and without ``--tiny`` the suite exits with an error (under ``all`` it says so and
skips).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import gc
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import signal
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from benchmarks import harness
from benchmarks.peers import pytorch_recipe

ROUNDS = None  # timed in consecutive steps: --steps and --seconds
SUITE = "gpu"
WARMUP = 2  # untimed steps after the compile
ROWS_FILE, RUNS_FILE = "gpu.jsonl", "gpu_runs.jsonl"

# Dense datasheet peaks (FLOP/s) of the H100 and H200 SXM, which share the chip: FP8, bf16 and
# fp16 tensor cores, TF32 tensor cores, and fp32 without tensor cores.
DATASHEET = {kind: {"float8": 1979e12, "bfloat16": 989e12, "float16": 989e12, "tf32": 494e12,
                    "float32": 67e12} for kind in ("H100", "H200")}


@dataclasses.dataclass(frozen=True)
class Precision:
    """One way of training a model: what it runs, and which peak its MFU is quoted against."""

    description: str
    kind: str  # "jaxamp", "bare", "autocast", "torch"
    policy: str | None = None  # the jaxamp policy (None: torch)
    matmul_precision: str | None = None  # jax.default_matmul_precision(...); None: untouched
    skip: str | None = None  # mixed_precision(skip=...)
    peak: str = "bfloat16"  # the dtype of the matmuls: float8, bfloat16, float16, float32
    torch_compile: bool = False
    zero: int = 0  # 0: one device, as the user jits it; 3: state_sharding(params="sharded")
    master: str = "float32"  # mixed_precision(master=...)
    moments_dtype: str | None = None  # mixed_precision(moments_dtype=...), as the CLI's flag
    fp8_recipe: str | None = None  # "delayed": the model built with jaxamp.fp8's layers
    fp8_every_matmul: bool = False  # current scaling of every matmul, the head's too
    attention: str | None = None  # TransformerConfig.attention; None: the case's


PRECISIONS = {
    "mixed_bfloat16": Precision("jaxamp mixed_bfloat16, skip='cond' (what 'auto' is)", "jaxamp",
                                "mixed_bfloat16", skip="cond"),
    "mixed_bfloat16_select": Precision("jaxamp mixed_bfloat16, skip='select'", "jaxamp",
                                       "mixed_bfloat16", skip="select"),
    "mixed_bfloat16_explicit": Precision("jaxamp mixed_bfloat16 with the explicit attention "
                                         "(two einsums around an fp32 softmax, the bf16 "
                                         "probabilities kept), skip='cond'", "jaxamp",
                                         "mixed_bfloat16", skip="cond", attention="explicit"),
    "bare_bf16": Precision("jax.value_and_grad + optax.adamw, params cast to bf16 in the loss; "
                           "no master, scale, check or skip", "bare", "mixed_bfloat16"),
    "fp32_default": Precision("float32, the process's default matmul precision", "jaxamp",
                              "float32", skip="auto", peak="float32"),
    "mixed_float16": Precision("jaxamp mixed_float16, dynamic loss scale, skip='auto'", "jaxamp",
                               "mixed_float16", skip="auto", peak="float16"),
    "fp32_highest": Precision("float32, jax.default_matmul_precision('highest')", "jaxamp",
                              "float32", "highest", skip="auto", peak="float32"),
    "autocast_bf16": Precision("make_train_step(autocast=True), mixed_bfloat16", "autocast",
                               "mixed_bfloat16", skip="auto"),
    "mixed_bfloat16_zero3": Precision("jaxamp mixed_bfloat16 on a mesh of every device, state "
                                      "sharded (ZeRO-3), skip='auto'", "jaxamp",
                                      "mixed_bfloat16", skip="auto", zero=3),
    "mixed_bfloat16_kahan": Precision("jaxamp mixed_bfloat16, master='kahan', bf16 moments (8 "
                                      "bytes of state per param), skip='auto'", "jaxamp",
                                      "mixed_bfloat16", skip="auto", master="kahan",
                                      moments_dtype="bfloat16"),
    "mixed_bfloat16_stochastic": Precision("jaxamp mixed_bfloat16, master='stochastic', bf16 "
                                           "moments (6 bytes per param), skip='auto'", "jaxamp",
                                           "mixed_bfloat16", skip="auto", master="stochastic",
                                           moments_dtype="bfloat16"),
    "mixed_bfloat16_kahan_mu": Precision("jaxamp mixed_bfloat16, master='kahan', adamw's mu in "
                                         "bf16 and nu in fp32 (10 bytes per param), "
                                         "skip='auto'", "jaxamp", "mixed_bfloat16",
                                         skip="auto", master="kahan",
                                         moments_dtype="mu=bfloat16"),
    "mixed_bfloat16_kahan_8bit": Precision("jaxamp mixed_bfloat16, master='kahan', block-wise "
                                           "8-bit moments (about 6 bytes per param), "
                                           "skip='auto'", "jaxamp", "mixed_bfloat16",
                                           skip="auto", master="kahan", moments_dtype="8bit"),
    "mixed_fp8_current": Precision("jaxamp mixed_fp8 through make_train_step(autocast=True): "
                                   "every matmul in FP8, current scaling, skip='auto'",
                                   "autocast", "mixed_fp8", skip="auto", peak="float8",
                                   fp8_every_matmul=True),
    "mixed_fp8_default": Precision("jaxamp mixed_fp8's default through make_train_step("
                                   "autocast=True): current scaling, the embeddings, the head "
                                   "and the attention's batched matmuls in bf16, skip='auto'",
                                   "autocast", "mixed_fp8", skip="auto", peak="float8"),
    "mixed_fp8_delayed": Precision("jaxamp mixed_fp8 with delayed scaling: the model built "
                                   "with jaxamp.fp8 layers (amax history 16), skip='auto'",
                                   "jaxamp", "mixed_fp8", skip="auto", peak="float8",
                                   fp8_recipe="delayed"),
    "torch_amp_bf16": Precision("PyTorch eager, torch.autocast(bfloat16), AdamW defaults",
                                "torch"),
    "torch_amp_fp16": Precision("PyTorch eager, torch.autocast(float16) + GradScaler, AdamW "
                                "defaults", "torch", peak="float16"),
    "torch_compile_bf16": Precision("PyTorch torch.compile, torch.autocast(bfloat16), AdamW "
                                    "defaults", "torch", torch_compile=True),
}
# The rows that decide the GPU goals, in the order they run (what matters most first, so that a
# budget or a timeout cuts the least): `bash benchmarks/gpu.sh` runs these in one command.
CORE = {
    "resnet50": ("mixed_bfloat16", "bare_bf16", "mixed_bfloat16_select", "torch_amp_bf16",
                 "fp32_default", "fp32_highest", "torch_compile_bf16"),
    "bert_large": ("mixed_bfloat16", "bare_bf16", "mixed_bfloat16_select", "fp32_default",
                   "fp32_highest", "mixed_fp8_current", "mixed_bfloat16_kahan"),
    "nnx_gpt": ("autocast_bf16", "fp32_default"),
}
# The rest, for a second command (`SET=extended bash benchmarks/gpu.sh`).
EXTENDED = {
    "resnet50": ("mixed_float16", "torch_amp_fp16", "mixed_bfloat16_kahan"),
    "bert_large": ("mixed_bfloat16_explicit", "mixed_float16", "mixed_fp8_default",
                   "mixed_fp8_delayed",
                   "mixed_bfloat16_zero3", "mixed_bfloat16_stochastic",
                   "mixed_bfloat16_kahan_mu", "mixed_bfloat16_kahan_8bit"),
    "nnx_gpt": (),
}
SETS = {"core": CORE, "extended": EXTENDED,
        "all": {m: CORE[m] + EXTENDED[m] for m in CORE}}
MODEL_PRECISIONS = SETS["all"]  # every row of each model, in the order they run

# Seconds one row takes on an H200 (jax 0.11.2), for --budget: its compile (autotuning
# included; "measured": the compile_s of the first H200 run, BENCHMARKS.md's GPU section) and
# the rest (building the state, the FLOP count's trace, 3 warm-up steps and the timed steps,
# at most --seconds 5: 8 s for a ResNet-50 row, 10 s for BERT-Large's, 16 s for its 1.6 s
# fp32_highest step). "est": not measured there, estimated from the nearest measured row (the
# same model's program with the named change).
H200_SECONDS = {  # (model, precision): (compile s, rest s, measured or est)
    ("resnet50", "mixed_bfloat16"): (21.2, 8.0, "measured"),
    ("resnet50", "bare_bf16"): (8.3, 8.0, "measured"),
    ("resnet50", "mixed_bfloat16_select"): (21.2, 8.0, "est: as mixed_bfloat16"),
    ("resnet50", "torch_amp_bf16"): (12.9, 8.0, "measured"),
    ("resnet50", "fp32_default"): (23.8, 8.0, "measured"),
    ("resnet50", "fp32_highest"): (26.7, 8.0, "measured"),
    ("resnet50", "torch_compile_bf16"): (90.0, 8.0, "est: inductor, 2-3x eager's warm-up"),
    ("resnet50", "mixed_float16"): (21.2, 8.0, "est: as mixed_bfloat16"),
    ("resnet50", "torch_amp_fp16"): (12.9, 8.0, "est: as torch_amp_bf16"),
    ("resnet50", "mixed_bfloat16_kahan"): (23.0, 8.0, "est: mixed_bfloat16 + 10%"),
    ("bert_large", "mixed_bfloat16"): (43.7, 10.0, "measured"),
    ("bert_large", "bare_bf16"): (27.9, 10.0, "measured"),
    ("bert_large", "mixed_bfloat16_select"): (43.7, 10.0, "est: as mixed_bfloat16"),
    ("bert_large", "fp32_default"): (36.5, 10.0, "measured"),
    ("bert_large", "fp32_highest"): (73.4, 16.0, "measured"),
    ("bert_large", "mixed_fp8_current"): (60.0, 12.0, "est: mixed_bfloat16 + 40% (autocast)"),
    ("bert_large", "mixed_bfloat16_kahan"): (48.0, 10.0, "est: mixed_bfloat16 + 10%"),
    ("bert_large", "mixed_float16"): (43.7, 10.0, "est: as mixed_bfloat16"),
    ("bert_large", "mixed_fp8_delayed"): (60.0, 12.0, "est: as mixed_fp8_current"),
    ("bert_large", "mixed_fp8_default"): (55.0, 12.0, "est: mixed_fp8_current, fewer FP8 "
                                                      "matmuls"),
    ("bert_large", "mixed_bfloat16_zero3"): (50.0, 10.0, "est: mixed_bfloat16 + 15%"),
    ("bert_large", "mixed_bfloat16_stochastic"): (48.0, 10.0, "est: as mixed_bfloat16_kahan"),
    ("bert_large", "mixed_bfloat16_kahan_mu"): (48.0, 10.0, "est: as mixed_bfloat16_kahan"),
    ("bert_large", "mixed_bfloat16_kahan_8bit"): (55.0, 10.0, "est: mixed_bfloat16_kahan + 15%"),
    ("bert_large", "mixed_bfloat16_explicit"): (43.7, 10.0,
                                                "measured: mixed_bfloat16 before fused attention"),
    ("nnx_gpt", "autocast_bf16"): (28.4, 8.0, "measured"),
    ("nnx_gpt", "fp32_default"): (25.0, 8.0, "est: autocast_bf16 - its casts"),
}
# Seconds before the rows on an H200: the process (imports, devices, the matmul peaks) and each
# model's init. In the first run a process with its peaks and ResNet-50's init took 66 s over
# its 5 rows' compiles, BERT-Large's 100 s over its 4 (arg-less inits, compiled by XLA:GPU);
# the inits now run on the host's XLA:CPU (on this project's 2-core machine: ResNet-50 6.3 s,
# BERT-Large 17 s, the GPT 7 s, compile and run).
H200_STARTUP_SECONDS = {"process": 35.0, "resnet50": 6.0, "bert_large": 15.0, "nnx_gpt": 6.0}
UNITS = {"image": "img/s", "text": "seq/s", "lm": "seq/s"}
# The columns of gpu.md, in order (gpu.jsonl holds these and more).
COLUMNS = ["model", "precision", "batch", "step_ms", "per_s", "unit", "time_vs_bare_bf16",
           "vs_fp32_highest", "vs_fp32_default", "jaxamp_vs_torch", "tflops", "mfu_measured",
           "mfu_datasheet", "vs_mixed_bf16", "fp8_share", "xla_tflops", "mem_gb",
           "live_peak_gb", "skipped_steps", "matmul_precision", "compile_s", "error"]


def _names(choices) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(choices)}")
        return names
    return parse


def add_arguments(parser) -> None:
    parser.add_argument("--models", type=_names(MODEL_PRECISIONS), default=list(MODEL_PRECISIONS),
                        help=f"comma list of {', '.join(MODEL_PRECISIONS)} (default: all)")
    parser.add_argument("--precisions", type=_names(PRECISIONS), default=list(PRECISIONS),
                        help="comma list of " + ", ".join(PRECISIONS) + " (default: all; each "
                        "model runs those that apply to it)")
    parser.add_argument("--set", dest="row_set", choices=list(SETS), default="all",
                        help="core: the rows that decide the GPU goals (one command of gpu.sh); "
                        "extended: the rest; all (default)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="stop before SECONDS from the start: a row whose estimate does not "
                        "fit in what is left is written as not run, and the run ends with every "
                        "finished row on disk")
    parser.add_argument("--compile-workers", type=int, default=None, metavar="N",
                        help="compile up to N of a model's JAX rows at once (threads) before "
                        "timing them one by one (default: 4 on a GPU, 1 elsewhere)")
    parser.add_argument("--deviceless", metavar="GPU", default=None,
                        help="compile every JAX row for GPU (h200, h100) on this machine with "
                        "XLA:GPU and run nothing: memory by part, dtype and shape, and compile "
                        "times, in OUT/gpu_deviceless_GPU.jsonl and .md (needs jax's CUDA "
                        "plugin and JAX_PLATFORMS=cpu: make gpu-memory)")
    parser.add_argument("--zero-devices", type=int, default=8, metavar="N",
                        help="with --deviceless: the GPUs the ZeRO rows are sharded over "
                        "(default 8, one host)")
    parser.add_argument("--steps", type=int, default=20, help="most timed steps per row")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="fewer timed steps (at least 3) when they would take longer")
    parser.add_argument("--append", action="store_true",
                        help=f"append to OUT/{ROWS_FILE} instead of starting it afresh")
    parser.add_argument("--render-only", action="store_true",
                        help=f"measure nothing: write gpu.md and gpu.png from OUT/{ROWS_FILE}")


# --------------------------------------------------------------------------------------------
# The models
# --------------------------------------------------------------------------------------------

def _cases(tiny: bool) -> dict[str, dict]:
    if tiny:
        return {
            "resnet50": dict(model="resnet18_small", kind="image", batch=2, shape=(8, 8, 3),
                             kw=dict(stage_sizes=(1,), width=8), torch_image=32),
            "bert_large": dict(model="bert_tiny", kind="text", batch=2, seq=8,
                               kw=dict(depth=1, width=16, heads=2, mlp=32)),
            "nnx_gpt": dict(model="nnx_gpt_tiny", kind="lm", batch=2, seq=8,
                            kw=dict(vocab=64, width=16, depth=1, heads=2, mlp=64, max_len=8)),
        }
    return {
        "resnet50": dict(model="resnet50", kind="image", batch=256, shape=(224, 224, 3), kw={},
                         torch_image=224),
        # cuDNN's fused attention in half precision (its fp32 and FP8 rows run the explicit
        # path), named rather than "auto" so that the deviceless compile builds the same program.
        "bert_large": dict(model="bert_large", kind="text", batch=64, seq=512,
                           kw=dict(attention="cudnn")),
        # The user's GPT of train/models/nnx_gpt.py (flax NNX layers, no dtype=) at GPT-2 small's
        # shape with an 8192-token vocabulary, as in the autocast suite.
        "nnx_gpt": dict(model="nnx_gpt_tiny", kind="lm", batch=16, seq=1024,
                        kw=dict(vocab=8192, width=768, depth=12, heads=12, mlp=3072,
                                max_len=1024)),
    }


def _batch(case: dict) -> dict:
    """A random batch, drawn on the host (no little programs to compile)."""
    from train import models
    b, rng = case["batch"], np.random.default_rng(1)
    if case["kind"] == "image":
        classes = models.config_of(case["model"], **case["kw"]).num_classes
        return {"image": jnp.asarray(rng.normal(size=(b, *case["shape"])), jnp.float32),
                "label": jnp.asarray(rng.integers(0, classes, (b,)), jnp.int32)}
    vocab = models.config_of(case["model"], **case["kw"]).vocab
    if case["kind"] == "text":
        tokens = jnp.asarray(rng.integers(0, vocab, (b, case["seq"])), jnp.int32)
        return {"tokens": tokens, "targets": tokens}
    return {"tokens": jnp.asarray(rng.integers(0, vocab, (b, case["seq"] + 1)), jnp.int32)}


def _init(case: dict, tiny: bool, policy: str = "float32",
          fp8: jaxamp.fp8.DelayedScaling | None = None) -> tuple[Any, Any]:
    """``(fp32 params, model state)`` of ``case``'s model, initialised in one jitted program
    (op by op, a ResNet's init compiles dozens of little programs).

    The key is the program's argument: with a seed fixed at trace time every random draw is a
    compile-time constant for XLA to fold (the user's GPT at 768 x 12 took 2 min 56 s to
    compile on an H200 that way). Where the process also has a CPU backend (gpu.sh sets
    ``JAX_PLATFORMS=cuda,cpu``) the init runs there and its result moves to the GPU: XLA:GPU
    spends 25-45 s on this program even with the key as an argument (a deviceless H200 compile
    of the GPT's init on this project's 2-core machine), XLA:CPU 3-5 s."""
    init = _init_fn(case, policy, fp8)

    def on(device):
        with jax.default_device(device) if device is not None else contextlib.nullcontext():
            key = jax.random.key(0)
            options = None if device is not None else harness.tiny_compiler_options(tiny)
            return jax.jit(init).lower(key).compile(options)(key)
    host, target = _host_device(), jax.devices()[0]
    if host is not None:
        try:
            return jax.device_put(on(host), target)
        except Exception as e:  # the rows matter more than where their init ran
            print(f"  init of {case['model']} on the host failed ({error_text(e)}); "
                  f"initialising on {target.platform}", flush=True)
    return on(None)


def _init_fn(case: dict, policy: str, fp8) -> Callable[[Any], tuple[Any, Any]]:
    """``init(key) -> (params, model state)`` of ``case``'s model."""
    from train import models

    def init(key):
        _, params, model_state = models.split(models.build(case["model"], policy, seed=key,
                                                           fp8=fp8, **case["kw"]))
        return params, model_state
    return init


def abstract_init(case: dict, tiny: bool, policy: str = "float32",
                  fp8: jaxamp.fp8.DelayedScaling | None = None) -> tuple[Any, Any]:
    """:func:`_init`'s shapes and dtypes, allocating nothing (``--deviceless``)."""
    del tiny
    return jax.eval_shape(_init_fn(case, policy, fp8), jax.random.key(0))


def _host_device():
    """The CPU device, where the default device is a GPU and the process has a CPU backend."""
    if jax.default_backend() == "cpu":
        return None
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS=cuda: no CPU backend
        return None


def _loss(case: dict, graphdef, fp8_state: bool = False) -> tuple[Callable, dict]:
    """``(loss_fn, make_train_step keywords)`` of the model's family; ``fp8_state``: the model
    keeps FP8 metadata in its model state."""
    from train import models
    if case["kind"] == "image":
        return models.classification_loss(graphdef), dict(has_aux=True, has_model_state=True)
    if case["kind"] == "text":
        return (models.mlm_loss(graphdef, has_model_state=fp8_state),
                dict(has_aux=True, has_model_state=fp8_state))
    return (models.lm_loss(graphdef, has_model_state=fp8_state),
            dict(has_aux=True, has_model_state=fp8_state))


def _fp8_recipe(prec: Precision):
    return jaxamp.fp8.DelayedScaling() if prec.fp8_recipe == "delayed" else None


@dataclasses.dataclass
class Built:
    step: Callable[[Any, Any], tuple[Any, dict]]  # (state, batch) -> (state, metrics)
    state: Any  # abstract (jax.ShapeDtypeStruct leaves, with their shardings on a mesh)
    batch: Any
    # the scalar loss of (working params, batch, model state)
    audited: Callable[[Any, Any, Any], jax.Array]
    working: Any  # the working params, for the audit
    make_state: Callable[[], Any]  # the concrete state, built when the row is timed
    compile_state: Callable[[], Any]  # compiles make_state's program
    model_state: Any = None  # the audit's (its leaves are arguments: abstract ones trace too)


def _build(case: dict, prec: Precision, params, model_state, options: dict | None,
           init: Callable[..., tuple[Any, Any]] = _init) -> Built:
    from flax import nnx

    from train import models
    if prec.attention is not None:
        case = dict(case, kw={**case["kw"], "attention": prec.attention})
    recipe = _fp8_recipe(prec)
    abstract = nnx.eval_shape(lambda: models.build(case["model"], prec.policy, fp8=recipe,
                                                   **case["kw"]))
    graphdef = models.split(abstract)[0]
    if recipe is not None:  # the FP8 metadata, fresh (the init of everything else is dropped)
        model_state = init(case, False, prec.policy, fp8=recipe)[1]
    loss_fn, keywords = _loss(case, graphdef, fp8_state=recipe is not None)
    has_model_state = keywords.get("has_model_state", False)
    policy = jaxamp.get_policy(prec.policy)
    if prec.fp8_every_matmul:
        policy = dataclasses.replace(policy, fp8=jaxamp.fp8.CurrentScaling(keep="",
                                                                           batched=True))
    working = jax.eval_shape(policy.cast_params_to_compute, params)  # the audit traces it

    def audited(p, b, ms):
        if has_model_state:
            return loss_fn(p, b, ms)[0]
        return loss_fn(p, b)[0]
    if prec.kind == "autocast":
        audited = jaxamp.autocast(audited, policy)
    if prec.kind == "bare":
        step, make_state = _bare_step(loss_fn, has_model_state, policy)
    else:
        from train.configs.default import moments_dtype
        tx = jaxamp.mixed_precision(
            optax.adamw(1e-4), policy, skip=prec.skip or "auto", master=prec.master,
            moments_dtype=None if prec.moments_dtype is None else moments_dtype(prec.moments_dtype))
        step = jaxamp.make_train_step(loss_fn, autocast=prec.kind == "autocast",
                                      warn_fp32_matmuls=False, **keywords)

        def make_state(p, ms):
            return jaxamp.TrainState.create(params=p, tx=tx, model_state=ms)

    def fresh(p, ms):  # copies: the steps donate their state, the params serve every row
        return make_state(jax.tree.map(jnp.copy, p), jax.tree.map(jnp.copy, ms))

    lowered_fresh, compiled_fresh = jax.jit(fresh).lower(params, model_state), []

    def compile_state():  # with the step: concurrently, where the step is
        if not compiled_fresh:
            compiled_fresh.append(lowered_fresh.compile(options))
        return compiled_fresh[0]

    def concrete():
        return compile_state()(params, model_state)
    return Built(step, jax.eval_shape(fresh, params, model_state), _batch(case), audited,
                 working, concrete, compile_state, model_state)


def _bare_step(loss_fn, has_model_state: bool, policy):
    """``benchmarks.overhead.plain_variant``'s bare step: fp32 params, cast to the compute
    dtype in the loss; plain ``value_and_grad`` and ``optax.adamw``."""
    tx = optax.adamw(1e-4)

    def step(state, batch):
        p, opt_state, ms = state
        batch = policy.cast_to_compute(batch)

        def loss(q):
            if has_model_state:
                value, new_ms, _ = loss_fn(policy.cast_params_to_compute(q), batch, ms)
                return value, new_ms
            return loss_fn(policy.cast_params_to_compute(q), batch)[0], ms
        (value, new_ms), grads = jax.value_and_grad(loss, has_aux=True)(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state, new_ms), {"loss": value}

    def make_state(p, ms):
        return p, tx.init(p), ms
    return step, make_state


# --------------------------------------------------------------------------------------------
# What XLA and the device say
# --------------------------------------------------------------------------------------------

def _precision_context(matmul_precision: str | None):
    if matmul_precision is None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(matmul_precision)


def effective_matmul_precision() -> str:
    """``jax_default_matmul_precision`` as the process has it now (``None``: XLA's DEFAULT)."""
    try:
        value = jax.config.jax_default_matmul_precision
    except AttributeError:
        return "unknown"
    return "unset (DEFAULT)" if value is None else str(value)


def dot_precisions(lowered_text: str) -> str:
    """The precisions (and algorithms) of the dots and convolutions of a lowered module."""
    found = set(re.findall(r"precision = \[(\w+), (\w+)\]", lowered_text))
    found |= set(re.findall(r"#stablehlo<precision (\w+)>", lowered_text))
    found |= set(re.findall(r"algorithm = <([^>]*)>", lowered_text))
    names = sorted({n for f in found for n in (f if isinstance(f, tuple) else (f,))})
    return "+".join(names) or "none"


def xla_flops(compiled) -> float | None:
    """XLA's ``cost_analysis()`` flops where it gave a positive figure, else ``None``."""
    try:
        c = compiled.cost_analysis()
        if isinstance(c, list | tuple):
            c = c[0] if c else None
        flops = None if c is None else c.get("flops")
        return float(flops) if flops is not None and math.isfinite(flops) and flops > 0 else None
    except Exception:
        return None


def compiled_memory(compiled) -> dict[str, float | None]:
    """``mem_gb``: arguments + outputs - aliased (donated) + temporaries of the compiled step,
    from ``memory_analysis()``; ``xla_peak_gb``: its ``peak_memory_in_bytes`` where positive."""
    try:
        m = compiled.memory_analysis()
        if isinstance(m, list | tuple):
            m = m[0] if m else None
    except Exception:
        m = None
    parts = [getattr(m, f"{n}_size_in_bytes", None) for n in ("argument", "output", "alias",
                                                               "temp")]
    total = None if m is None or None in parts else parts[0] + parts[1] - parts[2] + parts[3]
    peak = getattr(m, "peak_memory_in_bytes", None)
    return {"mem_gb": None if total is None else total / 1e9,
            "xla_peak_gb": peak / 1e9 if isinstance(peak, int | float) and peak > 0 else None}


def _live_peak() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


# --------------------------------------------------------------------------------------------
# Peaks: a measured matmul, and the datasheet
# --------------------------------------------------------------------------------------------

def _peak_key(prec: Precision) -> str:
    return f"{prec.peak}/{prec.matmul_precision or 'default'}"


def measure_matmul_peak(dtype_name: str, matmul_precision: str | None, n: int,
                        reps: int) -> float:
    """FLOP/s of an ``n``-cubed matmul in ``dtype_name``, the best of three runs of ``reps``."""
    # FP8: e4m3 operands into a bf16 result (an FP8 tensor-core GEMM).
    fp8 = dtype_name == "float8"
    dtype = jnp.dtype(jnp.float8_e4m3fn if fp8 else dtype_name)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)

    def matmul(x, y):
        return jnp.matmul(x, y, preferred_element_type=jnp.bfloat16 if fp8 else None)
    with _precision_context(matmul_precision):
        f = jax.jit(matmul).lower(a, b).compile(
            harness.tiny_compiler_options(jax.default_backend() == "cpu"))
    jax.block_until_ready(f(a, b))
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        out = [f(a, b) for _ in range(reps)]
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - t0)
        del out
    return 2.0 * n**3 * reps / best


def _datasheet(device_kind: str) -> dict[str, float] | None:
    return next((v for k, v in DATASHEET.items() if k in device_kind), None)


def datasheet_peak(prec: Precision, device_kind: str,
                   measured: dict[str, float | None]) -> tuple[float | None, str]:
    """``(peak FLOP/s, what it is)`` from the datasheet for ``prec``'s matmuls, where known.

    fp32 under the default precision runs on the TF32 tensor cores only if XLA chooses so: the
    measured fp32 matmul tells (faster than the strict fp32 datasheet peak: TF32)."""
    sheet = _datasheet(device_kind)
    if sheet is None:
        return None, f"no datasheet for {device_kind!r}"
    if prec.peak != "float32":
        return sheet[prec.peak], f"{prec.peak} dense"
    if prec.matmul_precision in ("highest", "float32"):
        return sheet["float32"], "fp32 (no tensor cores)"
    if prec.matmul_precision in ("high", "tensorfloat32"):
        return sheet["tf32"], "TF32 dense"
    rate = measured.get(_peak_key(prec))
    if rate is None:
        return None, "TF32 or fp32: unknown (no measured fp32 matmul)"
    if rate > 1.5 * sheet["float32"]:
        return sheet["tf32"], "TF32 dense (the fp32 matmul ran faster than fp32 can)"
    return sheet["float32"], "fp32 (the fp32 matmul ran at fp32 speed)"


# --------------------------------------------------------------------------------------------
# Measuring one configuration
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Context:
    """What the rows of one run share."""

    args: Any
    cases: dict[str, dict]
    device_kind: str
    measured_peaks: dict[str, float | None]
    model_cache: dict = dataclasses.field(default_factory=dict)
    flops_cache: dict = dataclasses.field(default_factory=dict)
    # (model, Precision) -> a Future of compile_jax's result, while compiled concurrently
    compiling: dict = dataclasses.field(default_factory=dict)
    init: Callable[..., tuple[Any, Any]] = _init  # (case, tiny) -> (params, model state)

    @property
    def compiler_options(self) -> dict | None:
        return harness.tiny_compiler_options(self.args.tiny)

    def params(self, model: str):
        if model not in self.model_cache:
            self.model_cache.clear()  # one model's params on the device at a time
            self.model_cache[model] = self.init(self.cases[model], self.args.tiny)
        return self.model_cache[model]

    def trace_flops(self, model: str, prec: Precision, built: Built) -> float | None:
        """Matmul and convolution FLOPs of the loss's forward and backward pass, from the trace
        (``jaxamp.audit_grad``), once per model (and once more under autocast)."""
        key = (model, prec.kind == "autocast")
        if key not in self.flops_cache:
            try:
                with warnings.catch_warnings():  # abstract params: no saved residuals, no matter
                    warnings.simplefilter("ignore")
                    report = jaxamp.audit_grad(built.audited, *_audit_args(built))
                self.flops_cache[key] = report.total_matmul_flops
            except Exception as e:
                print(f"  trace FLOPs of {model}: {error_text(e)}", flush=True)
                self.flops_cache[key] = None
        return self.flops_cache[key]



def _audit_args(built: Built) -> tuple[Any, Any, Any]:
    """``(working params, batch, model state)`` for the audit: the params abstract (their
    gradient is traced), the rest concrete, zeros where abstract (``--deviceless``)."""
    def concrete(x):
        return jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x
    return built.working, jax.tree.map(concrete, built.batch), jax.tree.map(
        concrete, built.model_state)


def fp8_share(built: Built) -> float | None:
    """The share of the loss's matmul FLOPs that run in FP8 (``jaxamp.audit_grad``)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return jaxamp.audit_grad(built.audited, *_audit_args(built)).fp8_matmul_share
    except Exception as e:
        print(f"  FP8 share: {error_text(e)}", flush=True)
        return None


def _timed_steps(args, one_step_s: float) -> int:
    if args.tiny:
        return 3
    return max(3, min(args.steps, int(args.seconds / max(one_step_s, 1e-9))))


@dataclasses.dataclass
class Compiled:
    """One JAX row, lowered and compiled, waiting to be timed."""

    built: Built
    compiled: Any
    compile_s: float
    dots: str  # the precisions of the lowered dots
    effective: str  # the default matmul precision inside the row's context


def compile_jax(model: str, prec: Precision, ctx: Context,
                compile_fn: Callable[[Any], Any] | None = None) -> Compiled:
    """Builds one JAX row and compiles its step (``compile_fn(lowered)``: where it runs;
    default: here, now). Lowering runs here: it traces Python."""
    params, model_state = ctx.params(model)
    built = _build(ctx.cases[model], prec, params, model_state, ctx.compiler_options)
    jit_kwargs: dict[str, Any] = {}
    if prec.zero:
        built, jit_kwargs = _on_mesh(built, prec.zero)
    with _precision_context(prec.matmul_precision):
        effective = effective_matmul_precision()
        t0 = time.perf_counter()
        lowered = jax.jit(built.step, donate_argnums=0, **jit_kwargs).lower(built.state,
                                                                             built.batch)
        lower_s = time.perf_counter() - t0
        dots = dot_precisions(lowered.as_text())
        options = ctx.compiler_options

        def timed_compile():
            t1 = time.perf_counter()
            out = lowered.compile(options)
            compile_s = lower_s + time.perf_counter() - t1
            built.compile_state()
            return out, compile_s
        if compile_fn is None:
            compiled, compile_s = timed_compile()
        else:  # a Future of (compiled, compile_s)
            compiled, compile_s = compile_fn(timed_compile), math.nan
    return Compiled(built, compiled, compile_s, dots, effective)


def kernel_fingerprint(compiled) -> dict[str, Any]:
    """``hlo_sha``: a hash of the optimized HLO, which on a GPU holds the autotuner's choice for
    every matmul and convolution (the custom calls' and Triton fusions' configs, counted in
    ``kernels``): two compiles of one program, concurrent or one at a time, picked the same
    kernels when their hashes agree. Also what the program runs: its ``fusions`` (XLA's own
    kernels) and its cuDNN fused-attention calls, forward and backward (``cudnn_attention``)."""
    try:
        text = compiled.as_text()
    except Exception:
        return {"kernels": None, "hlo_sha": None, "fusions": None, "cudnn_attention": None}
    # The instructions alone, without their source metadata (an executable loaded from JAX's
    # persistent cache carries the source locations of the process that compiled it).
    program = [_METADATA.sub("", line.strip()) for line in text.splitlines() if " = " in line]
    kernels = sum("custom_call_target=" in line or '"__triton' in line for line in program)
    return {"kernels": kernels,
            "hlo_sha": hashlib.sha256("\n".join(program).encode()).hexdigest()[:16],
            "fusions": sum(bool(_FUSION.match(line)) for line in program),
            "cudnn_attention": sum('custom_call_target="__cudnn$fmha' in line
                                   for line in program)}


_METADATA = re.compile(r",? metadata=\{[^{}]*\}")
# An instruction whose opcode is fusion (its shape may be a tuple, with spaces).
_FUSION = re.compile(r"(?:ROOT )?%\S+ = [^=]*? fusion\(")


def measure_jax(model: str, prec: Precision, ctx: Context) -> dict:
    """The measured fields of one JAX configuration (compiled now, or taken from the
    concurrent compile of its model's rows)."""
    pending = ctx.compiling.pop((model, prec), None)
    ready = pending.result() if pending is not None else compile_jax(model, prec, ctx)
    built, compiled = ready.built, ready.compiled
    fields = {"compile_s": ready.compile_s, "matmul_precision": ready.effective,
              "dot_precision": ready.dots, "compiled_concurrently": pending is not None}
    flops = ctx.trace_flops(model, prec, built)
    share = fp8_share(built) if prec.peak == "float8" else None
    batch, state = built.batch, built.make_state()
    del built, ready
    peak_before = _live_peak()
    for _ in range(WARMUP):
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    steps = _timed_steps(ctx.args, time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    dt = (time.perf_counter() - t0) / steps
    peak_after = _live_peak()
    skipped = metrics.get("skipped_steps")
    row = {"step_ms": 1e3 * dt, "steps": steps, **fields, "flops": flops,
           "xla_flops": xla_flops(compiled), **compiled_memory(compiled),
           # The process-lifetime peak cannot be reset: it is this configuration's only where
           # this configuration raised it.
           "live_peak_gb": (peak_after / 1e9 if peak_after is not None and peak_before is not None
                            and peak_after > peak_before else None),
           "loss": float(metrics["loss"]),
           "skipped_steps": None if skipped is None else int(skipped),
           **kernel_fingerprint(compiled)}
    if share is not None:
        row["fp8_share"] = share
    del state, metrics, compiled
    return row


def _on_mesh(built: Built, zero: int, devices: list | None = None) -> tuple[Built, dict]:
    """``built`` with its state and batch on a mesh of every device (or of ``devices``:
    compile-only GPUs under ``--deviceless``, where the state and batch stay abstract, laid out
    by their shardings), the state sharded by :func:`jaxamp.parallel.state_sharding`; and the
    ``jax.jit`` shardings of its step."""
    batch = jax.tree.leaves(built.batch)[0].shape[0]
    pool = list(jax.devices() if devices is None else devices)
    # Every device (the largest count that splits the batch: the --tiny batch on 8 CPUs).
    n = max(d for d in range(1, len(pool) + 1) if batch % d == 0)
    mesh = jax.sharding.Mesh(np.array(pool[:n]), ("batch",))
    shardings = jaxamp.parallel.state_sharding(built.state, mesh,
                                      params="sharded" if zero == 3 else "replicated")
    batch_sharding = jaxamp.parallel.batch_sharding(mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if devices is not None:
        def laid_out(tree, sharding):
            return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                tree, sharding)
        placed = dataclasses.replace(
            built, state=laid_out(built.state, shardings),
            batch=laid_out(built.batch, jax.tree.map(lambda _: batch_sharding, built.batch)))
    else:
        placed = dataclasses.replace(
            built, make_state=lambda: jax.device_put(built.make_state(), shardings),
            batch=jaxamp.parallel.put_sharded(built.batch, batch_sharding))
    return placed, {"in_shardings": (shardings, batch_sharding),
                    "out_shardings": (shardings, replicated)}


def measure_torch(model: str, prec: Precision, ctx: Context) -> dict:
    """torchvision's ResNet-50 under PyTorch AMP (CUDA; on a CPU only at ``--tiny``)."""
    if ctx.args.tiny and prec.torch_compile:
        raise RuntimeError("not run at --tiny: inductor's compile takes minutes")
    case = ctx.cases[model]
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    if device == "cpu" and not ctx.args.tiny:
        raise RuntimeError("torch rows run on CUDA")
    stats = pytorch_recipe.resnet50_step_stats(
        case["batch"], "float16" if prec.peak == "float16" else "bfloat16",
        steps=3 if ctx.args.tiny else ctx.args.steps, seconds=ctx.args.seconds,
        compiled=prec.torch_compile, device=device, image_size=case["torch_image"],
        warmup=1 if ctx.args.tiny else 5)
    if stats["flops"] is None:  # torch.compile's row: the eager step's count, the same model
        stats["flops"] = ctx.flops_cache.get((model, "torch"))
    else:
        ctx.flops_cache[(model, "torch")] = stats["flops"]
    return {**stats, "matmul_precision": "torch.autocast"}


def measure(model: str, precision: str, ctx: Context) -> dict:
    """The measured fields of one configuration; raises on failure."""
    prec = PRECISIONS[precision]
    return (measure_torch if prec.kind == "torch" else measure_jax)(model, prec, ctx)


def error_text(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".strip()


def _row_head(model: str, precision: str, ctx: Context) -> dict[str, Any]:
    """What a configuration's row says of it before it runs."""
    prec, case = PRECISIONS[precision], ctx.cases[model]
    return {"model": model, "precision": precision, "label": f"{model} {precision}",
            "description": prec.description,
            "built_as": "torchvision resnet50" if prec.kind == "torch" else case["model"],
            "batch": case["batch"], "unit": UNITS[case["kind"]], "policy": prec.policy,
            "skip": prec.skip, "error": None}


def _row(model: str, precision: str, ctx: Context) -> dict:
    """One configuration's row, an error row if it fails."""
    prec, case = PRECISIONS[precision], ctx.cases[model]
    row = _row_head(model, precision, ctx)
    t0 = time.perf_counter()
    try:
        row.update(measure(model, precision, ctx))
    except Exception as e:
        row["error"] = error_text(e)
    finally:
        gc.collect()
    row["seconds"] = time.perf_counter() - t0
    if row.get("step_ms"):
        dt = row["step_ms"] / 1e3
        row["per_s"] = case["batch"] / dt
        flops = row.get("flops")
        row["tflops"] = None if flops is None else flops / dt / 1e12
        row["xla_tflops"] = None if row.get("xla_flops") is None else row["xla_flops"] / dt / 1e12
        measured = ctx.measured_peaks.get(_peak_key(prec))
        sheet, sheet_what = datasheet_peak(prec, ctx.device_kind, ctx.measured_peaks)
        row.update({
            "peak_class": _peak_key(prec),
            "peak_measured_tflops": None if measured is None else measured / 1e12,
            "mfu_measured": None if flops is None or measured is None else flops / dt / measured,
            "peak_datasheet_tflops": None if sheet is None else sheet / 1e12,
            "peak_datasheet": sheet_what,
            "mfu_datasheet": None if flops is None or sheet is None else flops / dt / sheet})
    return row


# --------------------------------------------------------------------------------------------
# The run: versions first, then the rows one by one
# --------------------------------------------------------------------------------------------

def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Any]:
    """Python, jax, jaxlib, flax, optax, torch and torchvision (where present), the devices."""
    import jaxlib
    info: dict[str, Any] = {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": _version("flax"),
        "optax": _version("optax"), "numpy": np.__version__, "torch": _version("torch"),
        "torchvision": _version("torchvision"),
        "jax_devices": [f"{d.platform}:{d.id} {d.device_kind}"
                        + (f" (compute capability {d.compute_capability})"
                           if getattr(d, "compute_capability", None) else "")
                        for d in jax.devices()],
        "env": {k: os.environ.get(k) for k in ("JAX_PLATFORMS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                               "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS",
                                               "JAX_DEFAULT_MATMUL_PRECISION",
                                               "CUDA_VISIBLE_DEVICES")},
        "default_matmul_precision": effective_matmul_precision(),
    }
    try:
        stats = jax.devices()[0].memory_stats() or {}
        info["bytes_limit_gb"] = stats.get("bytes_limit", 0) / 1e9 or None
    except Exception:
        info["bytes_limit_gb"] = None
    if info["torch"] is not None:
        try:
            import torch
            info["torch_cuda"] = (f"CUDA {torch.version.cuda}, "
                                  + ", ".join(torch.cuda.get_device_name(i)
                                              for i in range(torch.cuda.device_count()))
                                  if torch.cuda.is_available() else "no CUDA device")
        except Exception as e:
            info["torch_cuda"] = error_text(e)
    return info


def _plan(args) -> list[tuple[str, str]]:
    rows = SETS[getattr(args, "row_set", "all")]
    return [(m, p) for m in args.models for p in rows[m] if p in args.precisions]


def _measure_peaks(plan, tiny: bool) -> dict[str, float | None]:
    """FLOP/s of one large matmul per kind of matmul the plan runs (8192 cubed on a GPU)."""
    n, reps = (256, 3) if tiny or jax.default_backend() == "cpu" else (8192, 20)
    peaks: dict[str, float | None] = {}
    for prec in sorted({PRECISIONS[p] for _, p in plan} | {PRECISIONS["mixed_bfloat16"]},
                       key=_peak_key):
        key = _peak_key(prec)
        if key in peaks:
            continue
        try:
            peaks[key] = measure_matmul_peak(prec.peak, prec.matmul_precision, n, reps)
        except Exception as e:
            print(f"  matmul peak {key}: {error_text(e)}", flush=True)
            peaks[key] = None
        rate = peaks[key]
        print(f"  measured matmul peak {key} ({n}^3): "
              f"{'n/a' if rate is None else f'{rate / 1e12:.1f} TFLOP/s'}", flush=True)
    return peaks


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _first_device():
    try:
        return jax.devices()[0]
    except RuntimeError as e:  # JAX_PLATFORMS=cuda without a CUDA device or a CUDA jaxlib
        raise SystemExit(f"gpu suite: JAX found no device ({error_text(e)}); "
                         f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')}, jax "
                         f"{jax.__version__}") from e


def _check_device(args) -> bool:
    """``True`` to go on; exits (non-zero) when JAX is not on a GPU and not ``--tiny``."""
    dev = _first_device()
    if dev.platform == "gpu" or args.tiny:
        return True
    message = (f"gpu suite: JAX is on {dev.platform} ({dev.device_kind}), not on a GPU. Run it "
               "on the GPU machine with JAX_PLATFORMS=cuda (bash benchmarks/gpu.sh), or add "
               "--tiny to try every configuration here at a tiny size.")
    if getattr(args, "via_all", False):
        print(f"## {SUITE}\n\n{message} Skipped under `all`.\n", flush=True)
        return False
    raise SystemExit(message)


def run(args) -> list[dict]:
    out = args.out
    os.makedirs(out, exist_ok=True)
    if getattr(args, "deviceless", None):
        raise ValueError("gpu --deviceless runs in benchmarks.gpu_deviceless "
                         "(python -m benchmarks gpu --deviceless TARGET)")
    if args.render_only:
        return render(out)
    dev = _first_device()
    info = versions()
    print(f"## {SUITE}: {harness.machine()}\n", flush=True)
    for k, v in info.items():
        print(f"- {k}: {v}", flush=True)
    if not _check_device(args):
        return []
    rows_path, runs_path = os.path.join(out, ROWS_FILE), os.path.join(out, RUNS_FILE)
    if not args.append:
        for path in (rows_path, runs_path):
            if os.path.exists(path):
                os.remove(path)
    plan = _plan(args)
    by_model = {m: tuple(p for m2, p in plan if m2 == m) for m in dict.fromkeys(m for m, _ in plan)}
    print(f"- plan: {len(plan)} configurations: "
          + ", ".join(f"{m}/{p}" for m, p in plan)
          + f" (on an H200: about {h200_estimate(by_model, args.compile_workers or 4):.0f} s)",
          flush=True)
    peaks = _measure_peaks(plan, args.tiny)
    _append(runs_path, {"suite": SUITE, "started": datetime.datetime.now(
        datetime.UTC).isoformat(timespec="seconds"), "argv": sys.argv[1:],
        "tiny": bool(args.tiny), "models": args.models, "precisions": args.precisions,
        "machine": harness.machine(), "device_kind": dev.device_kind, **info,
        "measured_peaks_tflops": {k: None if v is None else v / 1e12 for k, v in peaks.items()},
        "environment_info": _environment_info()})
    ctx = Context(args, _cases(args.tiny), dev.device_kind, peaks)
    budget = Budget(args.budget, START, dev.platform == "gpu")
    workers = args.compile_workers or (4 if dev.platform == "gpu" else 1)

    def write(row):
        _append(rows_path, {"suite": SUITE, **row})
        print(_summary(row), flush=True)
    current = None
    with budget.alarm():
        try:
            for model, precisions in by_model.items():
                group = budget.fit(list(precisions), model, workers)
                current = (model, group[0][0])
                with _compiling_concurrently(ctx, model, [p for p, fits in group if fits],
                                             workers):
                    for precision, fits in group:
                        budget.check()
                        current = (model, precision)
                        if not fits:
                            write(_not_run(model, precision, ctx, budget.why_not(model,
                                                                                  precision)))
                            continue
                        row = _row(model, precision, ctx)
                        budget.check()  # a row the alarm cut short is not a finished row
                        budget.done(row)
                        write(row)
            current = None
        except BudgetExceeded:
            if current is not None:
                write(_not_run(*current, ctx, f"stopped: --budget {args.budget:g} s ran out "
                                              "in this row"))
            print(f"  --budget {args.budget:g} s reached: stopped; every finished row is in "
                  f"{rows_path}", flush=True)
    ctx.model_cache.clear()
    return render(out)


# When the process started (the budget counts from here: the imports are part of the lease).
START = time.monotonic()


def h200_estimate(rows: dict[str, tuple[str, ...]], workers: int = 4) -> float:
    """Seconds that running ``rows`` (model -> precisions) in one process takes on an H200, by
    :data:`H200_SECONDS` and :data:`H200_STARTUP_SECONDS`: what makes the core set fit."""
    total = H200_STARTUP_SECONDS["process"]
    for model, precisions in rows.items():
        speedup = _speedup(precisions, workers)
        total += H200_STARTUP_SECONDS[model] + sum(h200_row_seconds(model, p, speedup)
                                                  for p in precisions)
    return total


def h200_row_seconds(model: str, precision: str, speedup: int) -> float:
    """One row's seconds on an H200 (:data:`H200_SECONDS`), a JAX row's compile divided by the
    ``speedup`` of its model's concurrent compiles."""
    compile_s, rest_s, _ = H200_SECONDS.get((model, precision), (60.0, 10.0, "unknown"))
    if PRECISIONS[precision].kind != "torch":
        compile_s /= speedup
    return compile_s + rest_s


def _speedup(precisions, workers: int) -> int:
    """What concurrent compiles of a model's JAX rows count as: they share the GPU (autotuning)
    and the host, so at most 3, whatever the workers."""
    return max(1, min(workers, sum(PRECISIONS[p].kind != "torch" for p in precisions), 3))


class BudgetExceeded(BaseException):
    """Raised in the main thread when ``--budget`` runs out in the middle of a row."""


@dataclasses.dataclass
class Budget:
    """``--budget SECONDS``: which rows fit, by their estimated seconds, and an alarm at the end.

    On a GPU a row's estimate is :data:`H200_SECONDS` (its compile divided by the concurrent
    compiles' speed-up, plus the rest); elsewhere, the longest row measured so far."""

    seconds: float | None
    start: float
    on_gpu: bool
    history: list[float] = dataclasses.field(default_factory=list)
    estimates: dict = dataclasses.field(default_factory=dict)
    rung: bool = False  # the alarm went off

    def check(self) -> None:
        """Raises :class:`BudgetExceeded` once the alarm went off (its own raise can land in a
        callback whose exceptions Python ignores, such as a garbage-collection hook)."""
        if self.rung:
            raise BudgetExceeded

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - (time.monotonic()
                                                                      - self.start)

    def estimate(self, model: str, precision: str, speedup: int) -> float:
        if not self.on_gpu:
            return max(self.history, default=0.0)
        return h200_row_seconds(model, precision, speedup)

    def fit(self, precisions: list[str], model: str, workers: int) -> list[tuple[str, bool]]:
        """``(precision, fits)`` for a model's rows, in order: a row fits while the estimates
        of it and of the rows before it that fit are within what is left."""
        speedup = _speedup(precisions, workers)
        used, left, out = 0.0, self.left(), []
        if self.on_gpu:  # its init, before its rows
            used = H200_STARTUP_SECONDS.get(model, 15.0)
        for p in precisions:
            need = self.estimate(model, p, speedup)
            self.estimates[(model, p)] = (need, left - used)
            fits = used + need <= left
            used += need if fits else 0.0
            out.append((p, fits))
        return out

    def done(self, row: dict) -> None:
        self.history.append(row.get("seconds", 0.0))

    def why_not(self, model: str, precision: str) -> str:
        if (model, precision) not in self.estimates:
            return f"not run: --budget {self.seconds:g} s"
        need, left = self.estimates[(model, precision)]
        return (f"not run: --budget {self.seconds:g} s (estimate {need:.0f} s, "
                f"{max(left, 0):.0f} s left)")

    @contextlib.contextmanager
    def alarm(self):
        """Raises :class:`BudgetExceeded` in the main thread when the budget runs out."""
        if self.seconds is None or not hasattr(signal, "setitimer"):
            yield
            return

        def ring(signum, frame):
            self.rung = True
            raise BudgetExceeded
        previous = signal.signal(signal.SIGALRM, ring)
        signal.setitimer(signal.ITIMER_REAL, max(self.left(), 1e-3))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _not_run(model: str, precision: str, ctx: Context, why: str) -> dict:
    return {**_row_head(model, precision, ctx), "error": why, "not_run": True, "seconds": 0.0}


@contextlib.contextmanager
def _compiling_concurrently(ctx: Context, model: str, precisions: list[str], workers: int):
    """Compiles the JAX rows of ``model`` on ``workers`` threads, then yields: the rows are
    timed one by one afterwards, each taking its compiled step from ``ctx.compiling``.

    Lowering (Python tracing) runs here, one row after another, while the rows lowered before
    compile (XLA's compile releases the GIL). On a GPU the autotuner times candidate kernels
    on the device, so no row is timed until every compile of the model is done (see
    ``kernel_fingerprint`` to compare the kernels against ``--compile-workers 1``)."""
    jax_rows = [p for p in precisions if PRECISIONS[p].kind != "torch"]
    if workers <= 1 or len(jax_rows) <= 1:
        yield
        return
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile")
    try:
        lowered, t0 = [], time.perf_counter()
        for p in jax_rows:
            prec = PRECISIONS[p]
            future: concurrent.futures.Future = concurrent.futures.Future()
            try:
                ready = compile_jax(model, prec, ctx, compile_fn=pool.submit)
                lowered.append((ready, future))
            except Exception as e:  # its row fails when it is measured
                future.set_exception(e)
            ctx.compiling[(model, prec)] = future
        for ready, future in lowered:
            try:
                compiled, compile_s = ready.compiled.result()
                future.set_result(dataclasses.replace(ready, compiled=compiled,
                                                      compile_s=compile_s))
            except Exception as e:
                future.set_exception(e)
        print(f"  {model}: {len(jax_rows)} JAX rows lowered and compiled on {workers} threads "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
        yield
    finally:
        for key in [k for k in ctx.compiling if k[0] == model]:
            ctx.compiling.pop(key)
        pool.shutdown(wait=False, cancel_futures=True)


def _environment_info() -> str | None:
    try:
        return jax.print_environment_info(return_string=True)
    except Exception as e:
        return error_text(e)


def _summary(row: dict) -> str:
    head = f"  {row['model']} / {row['precision']}:"
    if row.get("error"):
        return f"{head} ERROR {row['error']}"
    def f(key, fmt):
        v = row.get(key)
        return "n/a" if v is None else format(v, fmt)
    return (f"{head} {f('step_ms', '.2f')} ms, {f('per_s', '.1f')} {row['unit']}, "
            f"{f('tflops', '.1f')} TFLOP/s, MFU {f('mfu_measured', '.3f')} (measured peak) "
            f"{f('mfu_datasheet', '.3f')} (datasheet), mem {f('mem_gb', '.2f')} GB, "
            f"skipped {row.get('skipped_steps')}, matmul precision "
            f"{row.get('matmul_precision')}, compile {f('compile_s', '.1f')} s")


# --------------------------------------------------------------------------------------------
# Rendering: ratios, gpu.md, gpu.png
# --------------------------------------------------------------------------------------------

def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def add_ratios(rows: list[dict]) -> None:
    """Ratios between the rows of a model, where both rows are there and measured."""
    def find(model, precision):
        return next((r for r in rows if r.get("model") == model
                     and r.get("precision") == precision and r.get("per_s")), None)
    for r in rows:
        r["vs_fp32_highest"] = r["vs_fp32_default"] = None
        r["time_vs_bare_bf16"] = r["jaxamp_vs_torch"] = r["time_vs_cond"] = None
        r["vs_mixed_bf16"] = None
        if not r.get("per_s"):
            continue
        if PRECISIONS.get(r["precision"], PRECISIONS["torch_amp_bf16"]).kind == "torch":
            ours = find(r["model"], "mixed_float16" if r["precision"] == "torch_amp_fp16"
                        else "mixed_bfloat16")
            r["jaxamp_vs_torch"] = None if ours is None else ours["per_s"] / r["per_s"]
            continue
        for key, ref in (("vs_fp32_highest", "fp32_highest"), ("vs_fp32_default", "fp32_default")):
            other = find(r["model"], ref)
            r[key] = None if other is None else r["per_s"] / other["per_s"]
        bare = find(r["model"], "bare_bf16")
        r["time_vs_bare_bf16"] = None if bare is None else r["step_ms"] / bare["step_ms"]
        cond = find(r["model"], "mixed_bfloat16")
        if r["precision"] == "mixed_bfloat16_select" and cond is not None:
            r["time_vs_cond"] = r["step_ms"] / cond["step_ms"]
        if r["precision"].startswith("mixed_fp8") and cond is not None:
            r["vs_mixed_bf16"] = r["per_s"] / cond["per_s"]  # FP8's speedup (goal >= 1.3)


def header(runs: list[dict]) -> str:
    """What the table's figures are, and on which machine and versions they were taken."""
    lines = []
    for i, run_ in enumerate(runs):
        peaks = ", ".join(f"{k} {'n/a' if v is None else f'{v:.1f}'}"
                          for k, v in run_.get("measured_peaks_tflops", {}).items())
        fraction = run_.get("env", {}).get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        lines.append(
            f"- Run {i + 1} ({run_.get('started')}, models {','.join(run_.get('models', []))}"
            f"{', tiny' if run_.get('tiny') else ''}): {run_.get('machine')}; python "
            f"{run_.get('python')}, jax {run_.get('jax')}, jaxlib {run_.get('jaxlib')}, flax "
            f"{run_.get('flax')}, optax {run_.get('optax')}, torch {run_.get('torch')}, "
            f"torchvision {run_.get('torchvision')} ({run_.get('torch_cuda', 'n/a')}); default "
            f"matmul precision {run_.get('default_matmul_precision')}; "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction}, JAX pool "
            f"{run_.get('bytes_limit_gb')} GB; measured matmul peaks (TFLOP/s): "
            f"{peaks}.")
    lines += [
        f"- Timing: after the compile and {WARMUP} warm-up steps, up to `--steps` consecutive "
        "steps (fewer, at least 3, past `--seconds`), dispatched back to back and waited for at "
        "the end: step_ms is their mean. The state is donated.",
        "- FLOPs (`tflops`): the matmul and convolution FLOPs of the loss's forward and backward "
        "pass counted on the trace (`jaxamp.audit_grad(...).total_matmul_flops`, the same on "
        "every backend); torch rows: `torch.utils.flop_counter` on one eager step. `xla_tflops`: "
        "XLA's `cost_analysis()` figure where it gave one; on a GPU it leaves out the "
        "cuBLAS/cuDNN custom calls, so it is no MFU numerator.",
        "- MFU: `mfu_measured` against the measured matmul peak of the row's kind (FP8, bf16, "
        "fp16, or fp32 under the row's matmul precision); `mfu_datasheet` against the H100/H200 "
        "dense datasheet: 1,979 TFLOP/s FP8, 989 bf16/fp16, 494 TF32, 67 fp32 (fp32 rows: TF32 "
        "only where "
        "the measured fp32 matmul ran faster than fp32 can, `peak_datasheet` in the JSON says "
        "which). fp32 rows are never divided by a bf16 peak.",
        "- Memory: `mem_gb` is the compiled step's arguments + outputs - aliased (donated) + "
        "temporaries (`memory_analysis()`). JAX cannot reset its process-lifetime "
        "`peak_bytes_in_use`: `live_peak_gb` is given only for rows that raised it (their peak, "
        "leftovers of earlier rows included), empty otherwise; torch rows: "
        "`torch.cuda.max_memory_allocated()` after a reset.",
        "- `skipped_steps`: non-finite steps skipped in the whole run of the row (jaxamp: the "
        "state's count; torch fp16: GradScaler's backoffs); empty where nothing can skip.",
        "- `matmul_precision`: `jax_default_matmul_precision` as read back inside the row's "
        "context; the JSON's `dot_precision` holds the precisions of the lowered dots.",
        "- torch: eager (one row under `torch.compile`), `torch.optim.AdamW` with its defaults, "
        "channels_last, `torch.backends.cudnn.benchmark = True`, in the same process as JAX "
        "(which holds its preallocated pool).",
        "- `vs_mixed_bf16` (FP8 rows): throughput over the `mixed_bfloat16` row of the same "
        "model; `fp8_share`: the share of the matmul FLOPs in FP8 (`jaxamp.audit_grad`).\n"
        "- `time_vs_bare_bf16`: step time over the bare bf16 step of the same model (jaxamp's "
        "overhead); `vs_fp32_*`: throughput over the fp32 rows; `jaxamp_vs_torch`: jaxamp's "
        "throughput over torch's at the same dtype; the JSON's `time_vs_cond` is "
        "skip='select' over skip='cond'.",
    ]
    return "\n".join(lines)


def render(out: str) -> list[dict]:
    """Adds the ratios to ``OUT/gpu.jsonl`` and writes ``OUT/gpu.md`` and ``OUT/gpu.png``."""
    rows_path = os.path.join(out, ROWS_FILE)
    rows = _read(rows_path)
    runs = _read(os.path.join(out, RUNS_FILE))
    add_ratios(rows)
    tmp = rows_path + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, rows_path)
    text = f"## {SUITE}\n\n{header(runs)}\n\n{harness.markdown(rows, COLUMNS)}\n"
    with open(os.path.join(out, "gpu.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
    if any(r.get("vs_fp32_default") for r in rows):
        harness._bar_chart(SUITE, rows, ("label", "vs_fp32_default"),
                           os.path.join(out, "gpu.png"))
    return rows
