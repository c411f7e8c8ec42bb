"""The names and modules that moved, with an alias that warns, for one release (private).

``jaxamp.put_sharded`` is now ``jaxamp.parallel.put_sharded``, ``jaxamp.master_weights`` is
the private ``jaxamp._master_weights``, and so on: each old spelling still works, with a
``DeprecationWarning`` that names the new one. The next release deletes this module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["MOVED_MODULES", "MOVED_NAMES", "install", "module_getattr"]

MOVED_NAMES = {
    **{name: "jaxamp.parallel" for name in (
        "batch_sharding", "per_device_bytes", "put_sharded", "replicate", "shard_batch",
        "state_sharding", "unreplicate", "zero_spec")},
    **{name: "jaxamp.rounding" for name in ("kahan_join", "kahan_split", "stochastic_round")},
    **{name: "jaxamp.gradients" for name in (
        "GradStats", "all_finite", "grad_stats", "tree_path_str")},
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
"""Old module -> the private module it became (its names are exported by ``jaxamp``)."""


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}",
                  DeprecationWarning, stacklevel=3)


def module_getattr(name: str) -> Any:
    """``jaxamp.__getattr__``: a moved name or module, with a warning."""
    if name in MOVED_NAMES:
        new = MOVED_NAMES[name]
        _warn(f"jaxamp.{name}", f"{new}.{name}")
        return getattr(importlib.import_module(new), name)
    if f"jaxamp.{name}" in MOVED_MODULES:
        _warn(f"jaxamp.{name}", "the names that jaxamp exports")
        return importlib.import_module(MOVED_MODULES[f"jaxamp.{name}"])
    raise AttributeError(f"module 'jaxamp' has no attribute {name!r}")


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the private module it became."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        del path, target
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, "the names that jaxamp exports")
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        del module  # already executed: it is the private module itself


def install() -> None:
    """Puts the old module paths on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
