"""Precision policies: which dtype params, computation and outputs use.

A :class:`Policy` holds three dtypes:

* ``param_dtype``: the master copy of the params (fp32 for every mixed preset);
* ``compute_dtype``: the working params and the activations;
* ``output_dtype``: what the model returns.

Policies are parsed from preset names (``"mixed_bfloat16"``), from jmp's grammar
(``"p=f32,c=bf16,o=f32"``), from a ``jmp.Policy`` or passed through as a :class:`Policy`.
Per-parameter overrides pick a different working dtype for the params whose tree path
matches a regular expression.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxamp._fp8 import CurrentScaling
from jaxamp._tree import cast_floating
from jaxamp._tree import is_floating_array
from jaxamp._tree import tree_path_str

__all__ = ["Policy", "get_policy"]

# Names accepted for a dtype in a policy string (jmp's names plus a few common ones).
_DTYPE_NAMES: dict[str, Any] = {
    "f32": jnp.float32,
    "fp32": jnp.float32,
    "float32": jnp.float32,
    "full": jnp.float32,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "fp16": jnp.float16,
    "float16": jnp.float16,
    "half": jnp.float16,
}
_SHORT_NAME = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16",
               jnp.dtype(jnp.float16): "f16"}
_KEYS = {"p": "param", "params": "param", "param": "param",
         "c": "compute", "compute": "compute",
         "o": "output", "output": "output"}
# The presets: (param, compute, output) dtypes. "auto" resolves to one of them per device.
_PRESET_DTYPES: dict[str, tuple[Any, Any, Any]] = {
    "float32": (jnp.float32, jnp.float32, jnp.float32),
    "bfloat16": (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    "mixed_bfloat16": (jnp.float32, jnp.bfloat16, jnp.float32),
    "mixed_float16": (jnp.float32, jnp.float16, jnp.float32),
    "mixed_fp8": (jnp.float32, jnp.bfloat16, jnp.float32),
}
# Presets whose matmuls run in FP8 (under jaxamp.autocast, with current scaling).
_FP8_PRESETS = ("mixed_fp8",)
_PRESETS: tuple[str, ...] = (*_PRESET_DTYPES, "auto")  # public as Policy.PRESETS
_ACCEPTED = ("a preset (" + ", ".join(_PRESETS) + "), a dtype name ("
             + ", ".join(_DTYPE_NAMES) + "), jmp's grammar 'p=f32,c=bf16,o=f32', "
             "a jmp.Policy or a jaxamp.Policy")


def _as_float_dtype(value: Any, *, what: str, context: str = "") -> np.dtype:
    """Returns ``value`` as a floating numpy dtype, or raises a clear error."""
    if isinstance(value, str):
        key = value.strip().lower()
        if key not in _DTYPE_NAMES:
            raise ValueError(
                f"unknown {what} dtype {value!r}{context}; expected one of "
                f"{', '.join(_DTYPE_NAMES)}")
        return jnp.dtype(_DTYPE_NAMES[key])
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(f"{what} dtype must be a dtype or a dtype name, got {value!r}{context}; "
                        f"use one of {', '.join(_DTYPE_NAMES)}") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{what} dtype must be floating, got {dtype.name!r}{context}; integer and bool "
            "dtypes cannot hold params or activations. Use float32, bfloat16 or float16.")
    if dtype.itemsize < 2:
        raise ValueError(
            f"{what} dtype {dtype.name!r}{context} has {8 * dtype.itemsize} bits; a policy casts "
            "whole params and activations, which needs at least 16. Use bfloat16 or float16 "
            "(for FP8 matmuls, with per-tensor scaling, use the 'mixed_fp8' policy under "
            "jaxamp.autocast, or the layers of jaxamp.fp8).")
    if dtype == jnp.float64 and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            f"{what} dtype 'float64'{context} cannot run: 64-bit mode is off, so JAX would "
            "silently compute in float32. Enable it with jax.config.update('jax_enable_x64', "
            "True) before building the policy, or use float32.")
    return dtype


def _check_fp8(fp8: Any) -> None:
    if not isinstance(fp8, bool | CurrentScaling):
        raise TypeError(f"Policy(fp8=...) takes True, False or a jaxamp.fp8.CurrentScaling "
                        f"recipe, got {fp8!r}; delayed scaling keeps state in the model: use "
                        "the layers of jaxamp.fp8")


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy.

    Attributes:
      param_dtype: dtype of the master params (kept in the optimizer state).
      compute_dtype: dtype of the working params and of activations.
      output_dtype: dtype of what the model returns. The loss is always reduced in fp32.
      overrides: ``(regex, dtype)`` pairs. A param whose path (see :func:`tree_path_str`)
        matches ``regex`` (``re.search``) has ``dtype`` as its working dtype instead of
        ``compute_dtype``. The first matching rule wins.
      name: the preset or string this policy was parsed from (informational).
      fp8: run matmuls (``dot_general``) in FP8 under :func:`jaxamp.autocast`: ``True`` for
        e4m3 operands in the forward pass, e5m2 gradients, each tensor scaled by its own amax
        (:func:`jaxamp.fp8.fp8_dot_general`), or a :class:`jaxamp.fp8.CurrentScaling` recipe
        (rowwise or block scales, a weight gradient in high precision). Everything else follows
        ``compute_dtype``. The ``mixed_fp8`` preset sets ``True``.

    >>> import jax.numpy as jnp
    >>> p = Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    >>> p.cast_to_compute({"x": jnp.ones(2), "n": jnp.arange(2)})["x"].dtype
    dtype(bfloat16)
    >>> str(p)
    'p=f32,c=bf16,o=f32'
    """

    param_dtype: Any = jnp.float32
    """The dtype of the master params, kept in the optimizer state (a numpy dtype once
    built)."""
    compute_dtype: Any = jnp.float32
    """The dtype of the working params and of activations."""
    output_dtype: Any = jnp.float32
    """The dtype of what the model returns; the loss is always reduced in fp32."""
    overrides: tuple[tuple[str, Any], ...] = ()
    """``(regex, dtype)`` pairs: a param whose path matches ``regex`` works in ``dtype``
    instead of ``compute_dtype``; the first matching rule wins."""
    name: str = dataclasses.field(default="", compare=False)
    """The preset or string this policy was parsed from; informational, ignored by ``==``."""
    fp8: Any = False
    """Whether :func:`jaxamp.autocast` runs matmuls in FP8 with current scaling: ``False``,
    ``True`` (per-tensor scales) or a :class:`jaxamp.fp8.CurrentScaling` recipe; the
    ``mixed_fp8`` preset sets ``True``."""

    PRESETS: ClassVar[tuple[str, ...]] = _PRESETS
    """Every preset name that :func:`get_policy` accepts (the CLI's ``--precision`` choices).

    >>> Policy.PRESETS
    ('float32', 'bfloat16', 'mixed_bfloat16', 'mixed_float16', 'mixed_fp8', 'auto')
    """

    @staticmethod
    def resolve_auto(device: Any = None) -> str:
        """The preset that ``"auto"`` resolves to on ``device`` (default: the first local
        device).

        * TPU, and GPUs with compute capability >= 8.0 (Ampere and later): ``mixed_bfloat16``;
        * older GPUs: ``mixed_float16`` (with dynamic loss scaling);
        * CPU: ``float32``, because XLA:CPU upcasts bf16 and runs it slower (see the README).

        >>> import jax
        >>> Policy.resolve_auto(jax.devices("cpu")[0])
        'float32'
        """
        device = device if device is not None else jax.local_devices()[0]
        platform = device.platform.lower()
        if platform == "tpu":
            return "mixed_bfloat16"
        if platform in ("gpu", "cuda", "rocm"):
            capability = getattr(device, "compute_capability", None)
            if platform == "rocm" or capability is None:
                return "mixed_bfloat16"
            major = int(str(capability).split(".")[0])
            return "mixed_bfloat16" if major >= 8 else "mixed_float16"
        return "float32"

    def __post_init__(self):
        _check_fp8(self.fp8)
        for field in ("param", "compute", "output"):
            dtype = _as_float_dtype(getattr(self, f"{field}_dtype"), what=field)
            object.__setattr__(self, f"{field}_dtype", dtype)
        rules = []
        items = self.overrides.items() if isinstance(self.overrides, Mapping) else self.overrides
        for item in items:
            if not (isinstance(item, tuple | list) and len(item) == 2):
                raise TypeError(f"overrides must be (regex, dtype) pairs or a dict, got {item!r}; "
                                "for example {r'norm': 'float32'}")
            pattern, dtype = item
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise ValueError(f"override pattern {pattern!r} is not a valid regex: {e}; "
                                 "escape a literal name with re.escape") from e
            rules.append((pattern, _as_float_dtype(dtype, what="override",
                                                   context=f" for pattern {pattern!r}")))
        object.__setattr__(self, "overrides", tuple(rules))

    def __str__(self) -> str:
        def short(d):
            return _SHORT_NAME.get(jnp.dtype(d), jnp.dtype(d).name)
        s = (f"p={short(self.param_dtype)},c={short(self.compute_dtype)},"
             f"o={short(self.output_dtype)}")
        if self.fp8 is True:
            s += ",matmul=fp8"
        elif self.fp8:
            s += f",matmul=fp8({self.fp8.granularity})"
        if self.overrides:
            s += " overrides=" + ",".join(f"{p!r}:{short(d)}" for p, d in self.overrides)
        return s

    @property
    def is_mixed(self) -> bool:
        """True when the working dtype differs from the master dtype."""
        return self.compute_dtype != self.param_dtype

    @property
    def needs_loss_scaling(self) -> bool:
        """True when the compute dtype is float16, whose narrow range needs a dynamic loss
        scale: the one place that decides :func:`jaxamp.mixed_precision`'s default.

        >>> [get_policy(p).needs_loss_scaling for p in ("mixed_float16", "mixed_bfloat16")]
        [True, False]
        """
        return self.compute_dtype == jnp.float16

    def cast_to_param(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``param_dtype``; other leaves are untouched."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``compute_dtype`` (no overrides).

        Use it for inputs and activations. For params use :meth:`cast_params_to_compute`,
        which applies the per-parameter overrides.
        """
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``output_dtype``."""
        return cast_floating(tree, self.output_dtype)

    def working_dtypes(self, params: Any) -> list[Any]:
        """Each leaf's working dtype, in tree order: ``compute_dtype`` or an override's dtype
        for floating leaves, ``None`` for the others (a list, not a tree).

        >>> import jax.numpy as jnp
        >>> get_policy("mixed_float16").working_dtypes({"n": jnp.arange(2), "w": jnp.ones(2)})
        [None, dtype('float16')]
        """
        return [self._working_dtype(tree_path_str(path)) if is_floating_array(x) else None
                for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]

    def _working_dtype(self, where: str) -> Any:
        for pattern, dtype in self.overrides:
            if re.search(pattern, where):
                return dtype
        return self.compute_dtype

    def param_compute_dtypes(self, params: Any) -> Any:
        """A tree like ``params`` holding each floating leaf's working dtype (``None`` elsewhere).

        >>> import jax.numpy as jnp
        >>> p = get_policy("mixed_bfloat16", overrides={r"norm": "f32"})
        >>> p.param_compute_dtypes({"norm": {"scale": jnp.ones(2)}, "w": jnp.ones(2)})
        {'norm': {'scale': dtype('float32')}, 'w': dtype(bfloat16)}
        """
        return jax.tree.unflatten(jax.tree.structure(params), self.working_dtypes(params))

    def cast_params_to_compute(self, params: Any) -> Any:
        """Casts params to their working dtype: ``compute_dtype`` or an override's dtype."""
        if not self.overrides:
            return self.cast_to_compute(params)
        leaves, treedef = jax.tree.flatten(params)
        return jax.tree.unflatten(treedef, [
            x if d is None else jnp.asarray(x).astype(d)
            for x, d in zip(leaves, self.working_dtypes(params), strict=True)])

    def with_overrides(self, overrides: Mapping[str, DTypeLike] | Sequence) -> Policy:
        """Returns a copy with these per-parameter overrides added after the existing ones."""
        extra = tuple(overrides.items()) if isinstance(overrides, Mapping) else tuple(overrides)
        return dataclasses.replace(self, overrides=self.overrides + extra)


def _parse_jmp_grammar(spec: str) -> Policy:
    found: dict[str, np.dtype] = {}
    for part in spec.split(","):
        part = part.strip()
        if "=" not in part:
            raise ValueError(f"malformed part {part!r} in policy {spec!r}; every part must be "
                             "'key=dtype', for example 'p=f32,c=bf16,o=f32'")
        key, value = (s.strip() for s in part.split("=", 1))
        if key.lower() not in _KEYS:
            raise ValueError(f"unknown key {key!r} in policy {spec!r}; expected one of "
                             "p/params, c/compute, o/output")
        field = _KEYS[key.lower()]
        if field in found:
            raise ValueError(f"duplicated key {key!r} ({field} dtype) in policy {spec!r}; "
                             "give each of params, compute and output at most once")
        found[field] = _as_float_dtype(value, what=field, context=f" in policy {spec!r}")
    # jmp's defaults: params f32, compute follows params, output follows compute.
    param = found.get("param", jnp.dtype(jnp.float32))
    compute = found.get("compute", param)
    output = found.get("output", compute)
    return Policy(param, compute, output, name=spec)


def get_policy(spec: Any = "mixed_bfloat16", *,
               overrides: Mapping[str, DTypeLike] | Sequence | None = None,
               device: Any = None) -> Policy:
    """Builds a :class:`Policy` from a preset, a jmp string, a ``jmp.Policy`` or a ``Policy``.

    Presets (:attr:`Policy.PRESETS`), with ``auto`` resolved here on the CPU:

    >>> for name in Policy.PRESETS:
    ...     print(f"{name:15s}", get_policy(name))
    float32         p=f32,c=f32,o=f32
    bfloat16        p=bf16,c=bf16,o=bf16
    mixed_bfloat16  p=f32,c=bf16,o=f32
    mixed_float16   p=f32,c=f16,o=f32
    mixed_fp8       p=f32,c=bf16,o=f32,matmul=fp8
    auto            p=f32,c=f32,o=f32

    ``auto`` picks a preset per device (see :meth:`Policy.resolve_auto`).
    A bare dtype name (``"bf16"``) sets all three dtypes, as in jmp; jmp's grammar
    ``"p=f32,c=bf16,o=f32"`` takes the keys ``p/params``, ``c/compute`` and ``o/output``,
    and an omitted compute dtype follows params, an omitted output follows compute.

    Args:
      spec: the policy description.
      overrides: optional ``{regex: dtype}`` working dtypes for params whose path matches.
      device: the device ``"auto"`` resolves for (default: the first local device).

    >>> p = get_policy("mixed_bfloat16")
    >>> p.param_dtype, p.compute_dtype, p.output_dtype
    (dtype('float32'), dtype(bfloat16), dtype('float32'))
    >>> str(get_policy("p=f32,c=f16"))
    'p=f32,c=f16,o=f16'
    >>> get_policy("p=f32,c=bf61")
    Traceback (most recent call last):
    ...
    ValueError: unknown compute dtype 'bf61' in policy 'p=f32,c=bf61'; expected one of ...
    """
    policy = _parse(spec, device)
    if overrides:
        policy = policy.with_overrides(overrides)
    return policy


def _parse(spec: Any, device: Any) -> Policy:
    if isinstance(spec, Policy):
        return spec
    if _is_jmp_policy(spec):
        return Policy(spec.param_dtype, spec.compute_dtype, spec.output_dtype, name=str(spec))
    if not isinstance(spec, str):
        raise TypeError(f"policy must be a string, a jmp.Policy or a jaxamp.Policy, got "
                        f"{type(spec).__name__} {spec!r}; accepted: {_ACCEPTED}")
    name = spec.strip()
    if not name:
        raise ValueError(f"empty policy string {spec!r}; accepted: {_ACCEPTED}")
    lowered = name.lower()
    if lowered == "auto":
        resolved = _parse(Policy.resolve_auto(device), device)
        return dataclasses.replace(resolved, name=f"auto:{resolved.name}")
    if lowered in _PRESET_DTYPES:
        return Policy(*_PRESET_DTYPES[lowered], name=lowered, fp8=lowered in _FP8_PRESETS)
    if "=" in name:
        return _parse_jmp_grammar(name)
    if lowered in _DTYPE_NAMES:
        dtype = jnp.dtype(_DTYPE_NAMES[lowered])
        return Policy(dtype, dtype, dtype, name=name)
    raise ValueError(f"unknown policy {spec!r}; accepted: {_ACCEPTED}")


# A policy is static data inside a pytree: the mixed-precision state carries the policy it was
# built with as a node without leaves, so any optax wrapper keeps it, and it is part of the
# treedef (a jit cache key), never a traced value.
jax.tree_util.register_static(Policy)


def _is_jmp_policy(obj: Any) -> bool:
    cls = type(obj)
    return cls.__name__ == "Policy" and cls.__module__.startswith("jmp")
