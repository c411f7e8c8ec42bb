"""jaxamp: mixed-precision training for JAX and Flax.

A precision policy casts params and activations to bf16 or fp16, FP32 master weights live in
the optax optimizer state, and a jit-compiled dynamic loss scale runs inside the train step.
"""

from jaxamp.auditing import AuditReport
from jaxamp.auditing import audit
from jaxamp.auditing import audit_grad
from jaxamp.loss_scale import DynamicLossScale
from jaxamp.loss_scale import LossScale
from jaxamp.loss_scale import NoOpLossScale
from jaxamp.loss_scale import StaticLossScale
from jaxamp.loss_scale import all_finite
from jaxamp.master import GradStats
from jaxamp.master import MixedPrecisionState
from jaxamp.master import find_state
from jaxamp.master import get_loss_scale
from jaxamp.master import get_master_params
from jaxamp.master import grad_stats
from jaxamp.master import mixed_precision
from jaxamp.master import nonfinite_leaf_path
from jaxamp.master import scale_loss
from jaxamp.master import working_params
from jaxamp.overflow import OverflowReport
from jaxamp.overflow import explain_overflow
from jaxamp.parallel import batch_sharding
from jaxamp.parallel import put_sharded
from jaxamp.parallel import replicate
from jaxamp.parallel import shard_batch
from jaxamp.parallel import unreplicate
from jaxamp.policy import Policy
from jaxamp.policy import get_policy
from jaxamp.policy import resolve_auto
from jaxamp.policy import tree_path_str
from jaxamp.train_step import TrainState
from jaxamp.train_step import make_train_step
from jaxamp.train_step import policy_of

__version__ = "0.1.0"

__all__ = (
    "AuditReport",
    "DynamicLossScale",
    "GradStats",
    "LossScale",
    "MixedPrecisionState",
    "NoOpLossScale",
    "OverflowReport",
    "Policy",
    "StaticLossScale",
    "TrainState",
    "all_finite",
    "audit",
    "audit_grad",
    "batch_sharding",
    "explain_overflow",
    "find_state",
    "get_loss_scale",
    "get_master_params",
    "get_policy",
    "grad_stats",
    "make_train_step",
    "mixed_precision",
    "nonfinite_leaf_path",
    "policy_of",
    "put_sharded",
    "replicate",
    "resolve_auto",
    "scale_loss",
    "shard_batch",
    "tree_path_str",
    "unreplicate",
    "working_params",
)
