"""Where each param's value in ``param_dtype`` lives between steps: the ``master=`` options.

One small class per way of keeping a param leaf, each with the same five operations:

* ``init(value, work_dtype)``: what the state keeps beside the working param, built from the
  param's value in ``param_dtype``, as ``(master, compensation)`` slots;
* ``view(param, master, compensation)``: the value the inner optimizer works on;
* ``split(new, param, key)``: the new slots and the new working param (the *target*) of the
  inner optimizer's new value;
* ``skip(param, master, compensation)``: the same of a skipped step (everything stays);
* ``update(param, master, target)``: the update handed out, which lands the working param on
  its new value bit for bit.

A :class:`Storage` holds one of them per param leaf. It is built once from the policy, the
params and the ``master=`` option, and the mixed-precision state carries it as static data (a
pytree node without leaves, as it carries the policy), so that every reader of the state asks
it rather than guessing the option from the slots.

An empty slot is ``optax.MaskedNode()``: an empty pytree, so that the state and the branches of
the skip keep one structure under every option.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.typing import DTypeLike

from jaxamp._optimizer._rounding import kahan_join
from jaxamp._optimizer._rounding import kahan_split
from jaxamp._optimizer._rounding import stochastic_round
from jaxamp._tree import HALF_DTYPES

__all__ = [
    "ABSENT",
    "MASTERS",
    "Storage",
    "is_absent",
    "nudge_ties",
]

MASTERS = ("float32", "kahan", "stochastic", "none")
"""The ``master=`` options of :func:`jaxamp.mixed_precision`: where the fp32 value of each
half-precision param lives between steps (``"float32"``, the default, keeps an fp32 copy)."""

ABSENT = optax.MaskedNode()
"""The empty slot: a param that keeps no master (or no compensation)."""


def is_absent(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def _working_update(target: jax.Array, param: jax.Array) -> jax.Array:
    """An fp32 update ``u`` with ``(param + u).astype(param.dtype) == target``.

    ``target - param`` is exact in fp32 whenever a half-precision param does not shrink by more
    than ~2**15x in one step, so the sum reproduces ``target`` bit for bit. A zero difference
    becomes ``-0.0``, the additive identity that also keeps the sign of a zero param.
    """
    t32, p32 = target.astype(jnp.float32), param.astype(jnp.float32)
    diff = t32 - p32
    plus_zero = jnp.signbit(p32) & ~jnp.signbit(t32)  # -0 -> +0 needs +0.
    zero = jnp.where(plus_zero, jnp.float32(0.0), jnp.float32(-0.0))
    return jnp.where(diff == 0, zero, diff)


def nudge_ties(x: jax.Array, dtype: DTypeLike) -> jax.Array:
    """``x`` moved by one fp32 ulp where it lies exactly halfway between two ``dtype``
    values, toward the one that round-to-nearest-even picks; unchanged elsewhere. Then
    :func:`kahan_split`'s ``high`` equals ``x.astype(dtype)``: a compensation made at init
    agrees with params cast the usual way."""
    dtype = jnp.dtype(dtype)
    x = jnp.asarray(x).astype(jnp.float32)
    if dtype != jnp.bfloat16:
        return x
    raw = lax.bitcast_convert_type(x, jnp.uint32)
    tie = (raw & jnp.uint32(0xFFFF)) == 0x8000
    up = ((raw >> 16) & 1) == 1  # round-to-nearest-even rounds an odd upper half up
    nudged = jnp.where(up, raw + 1, raw - 1)
    return lax.bitcast_convert_type(jnp.where(tie & jnp.isfinite(x), nudged, raw), jnp.float32)


def _split_as_cast(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """:func:`kahan_split` after an exact tie moves by one fp32 ulp toward the side that
    round-to-nearest-even takes: the param is then the usual cast of the value, as with a
    master (at init too, where the params are cast the usual way)."""
    return kahan_split(nudge_ties(x, dtype), dtype)


# --------------------------------------------------------------------------------------------
# One class per way of keeping a leaf
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Own:
    """A floating param that works in ``param_dtype``: its own master, nothing beside it."""

    keeps_master = False
    keeps_compensation = False
    needs_key = False

    def init(self, value: jax.Array, work_dtype: Any) -> tuple[Any, Any]:
        del value, work_dtype
        return ABSENT, ABSENT

    def view(self, param: jax.Array, master: Any, comp: Any) -> jax.Array:
        del master, comp
        return param

    def split(self, new: jax.Array, param: jax.Array, key: Any) -> tuple[Any, Any, Any]:
        del key
        return ABSENT, ABSENT, new.astype(param.dtype)

    def skip(self, param: jax.Array, master: Any, comp: Any) -> tuple[Any, Any, Any]:
        return master, comp, param

    def update(self, param: jax.Array, master: Any, target: Any, work_dtype: Any) -> jax.Array:
        del master, work_dtype
        return _working_update(target, param)

    def next_param(self, param: jax.Array, master: Any, target: Any,
                   work_dtype: Any) -> jax.Array:
        """The new working param, from the step's new values (what :meth:`update` lands on)."""
        del param, master, work_dtype
        return target

    def holder(self, param: jax.Array, master: Any, comp: Any) -> jax.Array:
        """The array this leaf's value is updated on (where the grads are reduced to)."""
        del master, comp
        return param

    def next_working(self, param: jax.Array, update: jax.Array, master: Any,
                     work_dtype: Any) -> jax.Array:
        """What ``optax.apply_updates`` gives, without promoting bf16 + fp32."""
        del master, work_dtype
        return (param.astype(jnp.float32) + update.astype(jnp.float32)).astype(param.dtype)


@dataclasses.dataclass(frozen=True)
class _Master(_Own):
    """``master="float32"`` (and any param working in a non-half dtype): a copy in
    ``param_dtype``; the working param is its cast."""

    keeps_master = True

    def init(self, value, work_dtype):
        del work_dtype
        return value, ABSENT

    def view(self, param, master, comp):
        del param, comp
        return master

    def split(self, new, param, key):
        del param, key
        return new, ABSENT, None

    def skip(self, param, master, comp):
        del param
        return master, comp, None

    def update(self, param, master, target, work_dtype):
        del target
        return _working_update(master.astype(work_dtype), param)

    def next_param(self, param, master, target, work_dtype):
        del param, target
        return master.astype(work_dtype)

    def holder(self, param, master, comp):
        del param, comp
        return master

    def next_working(self, param, update, master, work_dtype):
        del param, update
        return master.astype(work_dtype)


@dataclasses.dataclass(frozen=True)
class _Kahan(_Own):
    """``master="kahan"``: a half-precision compensation; the value is ``param + comp``."""

    keeps_compensation = True

    def init(self, value, work_dtype):
        return ABSENT, _split_as_cast(value, work_dtype)[1]

    def view(self, param, master, comp):
        del master
        return kahan_join(param, comp)

    def split(self, new, param, key):
        del key
        high, low = _split_as_cast(new, param.dtype)
        return ABSENT, low, high

    def holder(self, param, master, comp):
        del param, master
        return comp


@dataclasses.dataclass(frozen=True)
class _Stochastic(_Own):
    """``master="stochastic"``: nothing kept; the new value is rounded stochastically."""

    needs_key = True

    def view(self, param, master, comp):
        del master, comp
        return param.astype(jnp.float32)

    def split(self, new, param, key):
        return ABSENT, ABSENT, stochastic_round(new, param.dtype, key)


@dataclasses.dataclass(frozen=True)
class _Nearest(_Own):
    """``master="none"``: nothing kept; the new value is rounded to the nearest."""


    def view(self, param, master, comp):
        del master, comp
        return param.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Other(_Own):
    """A leaf that is not floating: the optimizer sees it and never updates it."""


    def split(self, new, param, key):
        del new, param, key
        return ABSENT, ABSENT, None

    def skip(self, param, master, comp):
        del param
        return master, comp, None

    def update(self, param, master, target, work_dtype):
        del master, target, work_dtype
        return jnp.zeros_like(param)

    def next_param(self, param, master, target, work_dtype):
        del master, target, work_dtype
        return param

    def next_working(self, param, update, master, work_dtype):
        del update, master, work_dtype
        return param


_HALF_KINDS = {"float32": _Master(), "kahan": _Kahan(), "stochastic": _Stochastic(),
               "none": _Nearest()}


# --------------------------------------------------------------------------------------------
# The kinds of a whole params tree
# --------------------------------------------------------------------------------------------

def _slots(tree: Any, n: int) -> list:
    """The leaves of a tree laid out like the params, where ``MaskedNode`` marks a param
    without an entry; ``n`` absent slots for ``None`` (a field this option does not keep)."""
    return [ABSENT] * n if tree is None else jax.tree.leaves(tree, is_leaf=is_absent)


@dataclasses.dataclass(frozen=True)
class Storage:
    """How each param leaf's value in ``param_dtype`` is kept: one kind per leaf, in tree
    order, with the leaf's working dtype; and how the inner optimizer's moments are
    (``moments_dtype=``). Static data (hashable, no leaves)."""

    option: str
    kinds: tuple[_Own, ...]
    work_dtypes: tuple[Any, ...]
    moments: Any = None
    """The :class:`jaxamp._optimizer._moments.Moments` of ``moments_dtype=``, or ``None`` (as
    ``inner`` builds them)."""

    @classmethod
    def build(cls, policy: Any, params: Any, option: str, moments: Any = None) -> Storage:
        """The storage of ``params`` under ``policy``, the ``master=`` option and the
        moments' storage."""
        work_dtypes = policy.working_dtypes(params)
        param_dtype = jnp.dtype(policy.param_dtype)
        kinds: list[_Own] = []
        for d in work_dtypes:
            if d is None:
                kinds.append(_Other())
            elif jnp.dtype(d) == param_dtype:
                kinds.append(_Own())
            elif jnp.dtype(d) not in HALF_DTYPES:
                kinds.append(_Master())
            else:
                kinds.append(_HALF_KINDS[option])
        return cls(option, tuple(kinds), tuple(work_dtypes), moments)

    @property
    def rounds_moments(self) -> bool:
        """Whether the moments are rounded stochastically (bf16 moments)."""
        return self.moments is not None and self.moments.rounds_stochastically

    @property
    def needs_key(self) -> bool:
        """Whether anything is rounded stochastically: a param's storage or the moments."""
        return self.rounds_moments or any(k.needs_key for k in self.kinds)

    @property
    def keeps_compensation(self) -> bool:
        """Whether the state has a compensation field (``master="kahan"``), even an empty
        one."""
        return self.option == "kahan"

    def _zip(self, params: Any, master: Any, comp: Any):
        n = len(self.kinds)
        return zip(self.kinds, jax.tree.leaves(params), _slots(master, n), _slots(comp, n),
                   strict=True)

    def _trees(self, treedef: Any, masters: list, comps: list) -> tuple[Any, Any]:
        master = jax.tree.unflatten(treedef, masters)
        comp = jax.tree.unflatten(treedef, comps) if self.keeps_compensation else None
        return master, comp

    def _assemble(self, params: Any, out: list) -> tuple[Any, Any, list]:
        """``(master, compensation, targets)`` of per-leaf ``(master, comp, target)``."""
        master, comp = self._trees(jax.tree.structure(params), [m for m, _, _ in out],
                                   [c for _, c, _ in out])
        return master, comp, [t for _, _, t in out]

    def init(self, values: Any) -> tuple[Any, Any]:
        """``(master, compensation)`` trees of the values in ``param_dtype`` (compensation
        ``None`` unless ``master="kahan"``)."""
        leaves, treedef = jax.tree.flatten(values)
        slots = [k.init(v, d) for k, v, d in zip(self.kinds, leaves, self.work_dtypes,
                                                  strict=True)]
        return self._trees(treedef, [m for m, _ in slots], [c for _, c in slots])

    def view(self, params: Any, master: Any, comp: Any) -> Any:
        """The tree the inner optimizer works on: each param's value in ``param_dtype``."""
        return jax.tree.unflatten(jax.tree.structure(params),
                                  [k.view(p, m, c) for k, p, m, c in
                                   self._zip(params, master, comp)])

    def holders(self, params: Any, master: Any, comp: Any) -> Any:
        """A tree like the params holding, per param, the array its value is updated on: the
        master copy, else the compensation, else the param itself."""
        return jax.tree.unflatten(jax.tree.structure(params),
                                  [k.holder(p, m, c) for k, p, m, c in
                                   self._zip(params, master, comp)])

    def split(self, new_view: Any, params: Any, key: Any) -> tuple[Any, Any, list]:
        """``(master, compensation, targets)`` of the new values; a target is a leaf's new
        working param (in its dtype: the branch hands out 2 bytes per bf16 param, not a
        4-byte update), ``None`` where the master or nothing is the new value."""
        out = [k.split(n, p, jax.random.fold_in(key, i) if k.needs_key else None)
               for i, (k, n, p) in enumerate(zip(self.kinds, jax.tree.leaves(new_view),
                                                 jax.tree.leaves(params), strict=True))]
        return self._assemble(params, out)

    def skip(self, params: Any, master: Any, comp: Any) -> tuple[Any, Any, list]:
        """:meth:`split` of a skipped step: everything as it is."""
        return self._assemble(params, [k.skip(p, m, c) for k, p, m, c in
                                       self._zip(params, master, comp)])

    def updates(self, params: Any, master: Any, targets: list) -> Any:
        """Updates that land each working param on its new value: the exact difference to the
        cast master where there is one, to the target elsewhere (``-0.0`` where it did not
        move, so that even signed zeros are kept)."""
        return self._landed(params, master, targets, lambda k, *leaf: k.update(*leaf))

    def next_params(self, params: Any, master: Any, targets: list) -> Any:
        """The new working params: each leaf's target, else its master's cast, else the param
        (a leaf the optimizer never updates)."""
        return self._landed(params, master, targets, lambda k, *leaf: k.next_param(*leaf))

    def _landed(self, params: Any, master: Any, targets: list,
                each: Callable[..., Any]) -> Any:
        """A tree like the params of ``each(kind, param, master, target, work_dtype)`` per
        leaf: what a step's new values (:meth:`split`'s) make of each working param."""
        n = len(self.kinds)
        return jax.tree.unflatten(jax.tree.structure(params), [
            each(k, p, m, t, d) for k, p, m, t, d in
            zip(self.kinds, jax.tree.leaves(params), _slots(master, n), targets,
                self.work_dtypes, strict=True)])

    def next_working(self, params: Any, updates: Any, master: Any) -> Any:
        """The working params after ``updates``."""
        n = len(self.kinds)
        return jax.tree.unflatten(jax.tree.structure(params), [
            k.next_working(p, u, m, d) for k, p, u, m, d in
            zip(self.kinds, jax.tree.leaves(params), jax.tree.leaves(updates),
                _slots(master, n), self.work_dtypes, strict=True)])

    def mismatch(self, paths: list[str], master: Any, comp: Any) -> str | None:
        """What a state's slots hold that this storage does not expect, or ``None``."""
        n = len(self.kinds)
        for k, path, m, c in zip(self.kinds, paths, _slots(master, n), _slots(comp, n),
                                 strict=True):
            has_m, has_c = not is_absent(m), not is_absent(c)
            if has_m != k.keeps_master or has_c != k.keeps_compensation:
                held = ("an fp32 master" if has_m else "a compensation buffer" if has_c
                        else "neither master nor compensation")
                return f"holds {held} for param {path!r}"
        return None


# The state carries its storage as it carries the policy: part of the treedef, never a leaf.
jax.tree_util.register_static(Storage)
