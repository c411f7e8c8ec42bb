"""The ``default`` preset: a small-image ResNet-18 on scikit-learn's digits, and the ``Config``
every preset overrides."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Config:
    """A training run. Each preset in ``train.configs`` overrides :func:`get_config`."""

    task: str = "digits"  # digits | text | mlm | synthetic_images | synthetic_text
    model: str = "resnet18_small"
    precision: str = "auto"
    batch_size: int = 64
    accum_steps: int = 1
    # Run the loss under jaxamp.autocast (per-op dtype rules) instead of the model's own dtypes.
    autocast: bool = False
    steps: int = 300
    lr: float = 1e-3
    weight_decay: float = 1e-4
    warmup_steps: int = 20
    # Clip the unscaled fp32 gradients to this global norm before adamw (0: no clipping).
    grad_clip: float = 0.0
    seed: int = 0
    parallel: str = "none"  # none | pmap | jit
    # parallel="jit" only: 0 replicates the state on every device; 1 shards the fp32 master and
    # the optimizer state over the devices (ZeRO-1/2); 3 shards the working params too (ZeRO-3).
    zero: int = 0
    # Where the fp32 value of each half-precision param lives (jaxamp.mixed_precision's master=):
    # float32 | kahan | stochastic | none; and how adamw's moments are stored: float32 |
    # bfloat16 | 8bit, or per state field, "mu=bfloat16" (the first moment in bf16).
    master: str = "float32"
    moments_dtype: str = "float32"
    # precision="mixed_fp8" only: "current" runs every matmul of the model in FP8 through
    # jaxamp.autocast, each tensor scaled by its own amax; "delayed" builds the model with
    # jaxamp.fp8's delayed-scaling layers (amax histories in the model state; bert_*, gpt_*).
    fp8_recipe: str = "current"
    # current only: jaxamp.fp8.CurrentScaling's granularity (tensor | rowwise | blocks | mxfp8)
    # and where the weight-gradient GEMM runs (fp8 | high: the compute dtype).
    fp8_granularity: str = "tensor"
    fp8_weight_grad: str = "fp8"
    # current only: False quantizes every matmul, the embeddings' and head's
    # (jaxamp.fp8.CurrentScaling.KEEP) and the attention's batched ones too; True (default)
    # keeps those in the compute dtype.
    fp8_keep_bf16: bool = True
    fp8_history: int = 16
    fp8_margin: int = 0  # delayed: each scale is divided by 2**fp8_margin
    fp8_algo: str = "max"  # delayed: "max" of the amax history, or its "most_recent" entry
    loss_scale: str = "auto"  # auto | dynamic | static | none
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    # Stop after this many consecutive non-finite steps at the minimum loss scale (0: never).
    stall_after: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    log_every: int = 10
    eval_batches: int = 8  # 0: the whole held-out split (every target once; not mlm)
    seq_len: int = 64
    image_size: int = 32  # synthetic images
    num_classes: int = 10
    data: str | None = None
    progress: bool = True
    # Config fields per model family ("resnet", "bert", "gpt"), e.g. {"resnet": {"width": 8}}.
    model_overrides: dict = dataclasses.field(default_factory=dict)


def get_config() -> Config:
    return Config(task="digits", model="resnet18_small", batch_size=64, steps=300, lr=3e-3,
                  checkpoint_every=100, log_every=10, model_overrides={"resnet": {"width": 16}})


def moments_dtype(text: str) -> str | dict[str, str]:
    """``Config.moments_dtype`` as ``jaxamp.mixed_precision`` takes it: one format
    (``"bfloat16"``), or ``"mu=bfloat16,nu=8bit"`` as a mapping of adamw's state fields."""
    if "=" not in text:
        return text
    return dict(pair.split("=", 1) for pair in text.split(","))
