"""The names and modules that moved, with an alias that warns, for one release (private).

``jaxamp.put_sharded`` is now ``jaxamp.parallel.put_sharded``, ``jaxamp.master_weights`` is
the private ``jaxamp._master_weights``, and so on: each old spelling still works, with a
``DeprecationWarning`` that names the new one. The next release deletes this module.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

__all__ = ["MOVED_MODULES", "MOVED_NAMES", "alias", "module_getattr"]

MOVED_NAMES = {
    **{name: "jaxamp.parallel" for name in (
        "batch_sharding", "per_device_bytes", "put_sharded", "replicate", "shard_batch",
        "state_sharding", "unreplicate", "zero_spec")},
    **{name: "jaxamp.rounding" for name in ("kahan_join", "kahan_split", "stochastic_round")},
    **{name: "jaxamp.gradients" for name in (
        "GradStats", "all_finite", "grad_stats", "nonfinite_leaf_path", "tree_path_str")},
    **{name: "jaxamp.memory" for name in (
        "GPU_TARGETS", "GpuMemoryReport", "gpu_memory", "gpu_mesh")},
    **{name: "jaxamp.state" for name in (
        "get_loss_scale", "next_working_params", "policy_of", "working_params")},
}
"""Top-level name -> the public module it now lives in."""

MOVED_MODULES = {
    "jaxamp.policy": "jaxamp._policy",
    "jaxamp.loss_scale": "jaxamp._loss_scale",
    "jaxamp.master_weights": "jaxamp._master_weights",
    "jaxamp.train_step": "jaxamp._train_step",
    "jaxamp.autocasting": "jaxamp._autocast",
    "jaxamp.auditing": "jaxamp._audit",
    "jaxamp.overflow": "jaxamp._overflow",
}
"""Old module -> the private module it became (its names are exported by ``jaxamp``); each old
path is a file that calls :func:`alias`."""


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}",
                  DeprecationWarning, stacklevel=3)


def module_getattr(name: str) -> Any:
    """``jaxamp.__getattr__``: a moved name or module, with a warning."""
    if name in MOVED_NAMES:
        new = MOVED_NAMES[name]
        _warn(f"jaxamp.{name}", f"{new}.{name}")
        return getattr(importlib.import_module(new), name)
    if f"jaxamp.{name}" in MOVED_MODULES:  # its file warns
        return importlib.import_module(f"jaxamp.{name}")
    raise AttributeError(f"module 'jaxamp' has no attribute {name!r}")


def alias(name: str) -> None:
    """Run by the file left at an old module path: warns, and puts the private module it became
    in its place in ``sys.modules``, so the import hands on that module itself."""
    _warn(name, "the names that jaxamp exports")
    sys.modules[name] = importlib.import_module(MOVED_MODULES[name])
