"""jaxamp: mixed-precision training for JAX and Flax.

A precision policy casts params and activations to bf16 or fp16, FP32 master weights live in
the optax optimizer state, and a jit-compiled dynamic loss scale runs inside the train step.

One module per concept:

* ``policy``: :class:`Policy`, :func:`get_policy` and the presets;
* ``loss_scale``: the three loss scales;
* ``master_weights``: :func:`mixed_precision`, the optax transform that holds the fp32 master,
  and the functions that find its state;
* ``gradients``: one pass over the gradients (finite check, norm, the first bad leaf);
* ``train_step``: :class:`TrainState` and :func:`make_train_step`;
* ``ops``: fp32 norms, softmaxes, GELU and the loss that save half-precision tensors for
  the backward pass, for hand-built models (reached as ``jaxamp.ops.layer_norm``);
* ``parallel``: laying a state and a batch out for ``pmap`` or a sharded ``jit``, and the
  sharded (ZeRO) state;
* ``autocasting``: :func:`autocast`, per-op dtype rules for any unmodified model;
* ``fp8``: FP8 matmuls, with current scaling (autocast's ``mixed_fp8``) or delayed scaling
  (NNX layers whose amax histories the train step updates), reached as ``jaxamp.fp8.Linear``;
* ``auditing`` and ``overflow``: the precision audit and the overflow diagnosis;
* ``_gpu_memory``: :func:`gpu_memory`, the memory a step needs on a GPU, compiled by XLA:GPU
  on a machine without one.
"""

from jaxamp import fp8
from jaxamp import ops
from jaxamp._gpu_memory import GPU_TARGETS
from jaxamp._gpu_memory import GpuMemoryReport
from jaxamp._gpu_memory import gpu_memory
from jaxamp._gpu_memory import gpu_mesh
from jaxamp._tree import tree_path_str
from jaxamp.auditing import AuditReport
from jaxamp.auditing import audit
from jaxamp.auditing import audit_grad
from jaxamp.autocasting import autocast
from jaxamp.autocasting import full_precision
from jaxamp.gradients import GradStats
from jaxamp.gradients import grad_stats
from jaxamp.gradients import nonfinite_leaf_path
from jaxamp.loss_scale import DynamicLossScale
from jaxamp.loss_scale import LossScale
from jaxamp.loss_scale import NoOpLossScale
from jaxamp.loss_scale import StaticLossScale
from jaxamp.loss_scale import all_finite
from jaxamp.master_weights import MASTERS
from jaxamp.master_weights import MixedPrecisionState
from jaxamp.master_weights import find_state
from jaxamp.master_weights import get_loss_scale
from jaxamp.master_weights import get_master_params
from jaxamp.master_weights import mixed_precision
from jaxamp.master_weights import next_working_params
from jaxamp.master_weights import policy_of
from jaxamp.master_weights import scale_loss
from jaxamp.master_weights import working_params
from jaxamp.overflow import OverflowEvent
from jaxamp.overflow import OverflowReport
from jaxamp.overflow import explain_overflow
from jaxamp.parallel import batch_sharding
from jaxamp.parallel import per_device_bytes
from jaxamp.parallel import put_sharded
from jaxamp.parallel import replicate
from jaxamp.parallel import shard_batch
from jaxamp.parallel import state_sharding
from jaxamp.parallel import unreplicate
from jaxamp.parallel import zero_spec
from jaxamp.policy import PRESETS
from jaxamp.policy import Policy
from jaxamp.policy import get_policy
from jaxamp.policy import resolve_auto
from jaxamp.rounding import kahan_join
from jaxamp.rounding import kahan_split
from jaxamp.rounding import stochastic_round
from jaxamp.train_step import TrainState
from jaxamp.train_step import make_train_step

__version__ = "0.1.0"

__all__ = (
    "AuditReport",
    "DynamicLossScale",
    "GPU_TARGETS",
    "GpuMemoryReport",
    "GradStats",
    "LossScale",
    "MASTERS",
    "MixedPrecisionState",
    "NoOpLossScale",
    "OverflowEvent",
    "OverflowReport",
    "PRESETS",
    "Policy",
    "StaticLossScale",
    "TrainState",
    "all_finite",
    "audit",
    "audit_grad",
    "autocast",
    "batch_sharding",
    "explain_overflow",
    "find_state",
    "fp8",
    "full_precision",
    "get_loss_scale",
    "get_master_params",
    "get_policy",
    "gpu_memory",
    "gpu_mesh",
    "grad_stats",
    "kahan_join",
    "kahan_split",
    "make_train_step",
    "mixed_precision",
    "next_working_params",
    "nonfinite_leaf_path",
    "ops",
    "per_device_bytes",
    "policy_of",
    "put_sharded",
    "replicate",
    "resolve_auto",
    "scale_loss",
    "shard_batch",
    "state_sharding",
    "stochastic_round",
    "tree_path_str",
    "unreplicate",
    "working_params",
    "zero_spec",
)
