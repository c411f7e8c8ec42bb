"""jaxamp: mixed-precision training for JAX and Flax.

A precision policy casts params and activations to bf16 or fp16, FP32 master weights live in
the optax optimizer state, and a jit-compiled dynamic loss scale runs inside the train step.

The core is re-exported here. The private code is grouped by concern, each folder over the
ones below it:

* ``_precision``: :class:`Policy` (its presets, ``Policy.PRESETS``, and what ``"auto"`` means
  on a device, ``Policy.resolve_auto``), :func:`get_policy` and the three loss scales;
* ``_fp8``: the FP8 formats, quantizers and recipes that a policy may name;
* ``_optimizer``: :func:`mixed_precision`, the optax transform that holds the fp32 master, and
  its state and readers; where the master lives (``master=``), how the inner optimizer's
  moments are stored (``moments_dtype=``, :func:`quantized_moments`), the rounding they use
  and the one pass over the gradients;
* ``_autocast``: :func:`autocast`, per-op dtype rules for any unmodified model, attention found
  by its structure and the fp32 ops that save half-precision tensors;
* ``_step``: :class:`Objective` (the loss and how it is called, which the step and its
  diagnosis share), :class:`TrainState` and :func:`make_train_step`, the step's distribution
  over devices and Equinox's entry points;
* ``_diagnoses``: the precision audit, the overflow diagnosis and the GPU memory of a step;
* under them all, ``_tree``, ``_jaxpr``, ``_loss``, ``_model_state`` and ``_versions``: pytree
  helpers, the walk of a jaxpr, the loss's checks, the model state's nodes, the jax versions.

The rest lives in public modules, each a face over that private code:

* ``jaxamp.state``: the state of :func:`mixed_precision` and its readers, for a train step
  written by hand (``MixedPrecisionState``, ``find_state``, ``scale_loss``,
  ``get_master_params``, ``next_working_params``, ...) and the ``master=`` options
  (``MASTERS``);
* ``jaxamp.reports``: the reports the diagnostics return (``AuditReport``, ``OverflowReport``
  and its ``OverflowEvent``), to name in annotations;
* ``jaxamp.parallel``: laying a state and a batch out for ``pmap`` or a sharded ``jit``, and
  the sharded (ZeRO) state;
* ``jaxamp.fp8``: FP8 matmuls, with current scaling (autocast's ``mixed_fp8``) or delayed
  scaling (NNX layers, loaded with flax.nnx on first use, whose amax histories the train step
  updates);
* ``jaxamp.ops``: fp32 norms, softmaxes, GELU and the loss that save half-precision tensors for
  the backward pass, for hand-built models;
* ``jaxamp.rounding``: stochastic rounding and the Kahan split of the ``"kahan"`` master;
* ``jaxamp.gradients``: one pass over the gradients (finite check, norm, the first bad leaf);
* ``jaxamp.memory``: the memory planner, :func:`jaxamp.memory.gpu_memory`: the memory a step
  needs on a GPU, compiled by XLA:GPU on a machine without one;
* ``jaxamp.equinox``: training an Equinox module itself (``init``, ``make_step``,
  ``filter_value_and_grad``), loaded on first use: Equinox is an optional dependency.
"""

from typing import TYPE_CHECKING
from typing import Any

from jaxamp import _versions
from jaxamp import fp8
from jaxamp import gradients
from jaxamp import memory
from jaxamp import ops
from jaxamp import parallel
from jaxamp import reports
from jaxamp import rounding
from jaxamp import state
from jaxamp._autocast import autocast
from jaxamp._autocast import full_precision
from jaxamp._diagnoses._audit import audit
from jaxamp._diagnoses._audit import audit_grad
from jaxamp._diagnoses._overflow import explain_overflow
from jaxamp._optimizer._master_weights import mixed_precision
from jaxamp._optimizer._moments import quantized_moments
from jaxamp._precision._loss_scale import DynamicLossScale
from jaxamp._precision._loss_scale import LossScale
from jaxamp._precision._loss_scale import NoOpLossScale
from jaxamp._precision._loss_scale import StaticLossScale
from jaxamp._precision._policy import Policy
from jaxamp._precision._policy import get_policy
from jaxamp._step._objective import Objective
from jaxamp._step._train_step import TrainState
from jaxamp._step._train_step import make_train_step

if TYPE_CHECKING:  # loaded by __getattr__ on first use (it imports equinox)
    from jaxamp import equinox as equinox

__version__ = "0.1.0"
# ``jaxamp.equinox`` (an optional dependency's module, loaded on first use) is public but not in
# ``__all__``: ``from jaxamp import *`` works without equinox installed.

__all__ = (
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "Objective",
    "Policy",
    "StaticLossScale",
    "TrainState",
    "audit",
    "audit_grad",
    "autocast",
    "explain_overflow",
    "fp8",
    "full_precision",
    "get_policy",
    "gradients",
    "make_train_step",
    "memory",
    "mixed_precision",
    "ops",
    "parallel",
    "quantized_moments",
    "reports",
    "rounding",
    "state",
)

_versions.check()


def __getattr__(name: str) -> Any:
    if name == "equinox":  # an optional dependency: imported on first use, never by jaxamp
        import importlib
        return importlib.import_module("jaxamp.equinox")
    raise AttributeError(f"module 'jaxamp' has no attribute {name!r}")
