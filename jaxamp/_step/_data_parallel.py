"""Data parallelism under ``jax.jit``: the mesh, the data axis and the explicit collectives.

Under ``jit`` with a batch split over a mesh axis, XLA's partitioner inserts the gradient
all-reduce itself, in the gradient's dtype: bf16 for bf16 working params. The train step
instead computes each device's gradient inside ``jax.shard_map`` over the data axis and reduces
it with an explicit ``psum`` (replicated optimizer state) or ``psum_scatter`` (sharded
optimizer state) in ``reduce_dtype``, fp32 by default, as ``pmap`` with ``axis_name`` does.

How the step finds its layout (:func:`find`), at trace time:

1. the mesh: ``make_train_step(mesh=...)``; else the mesh set with ``jax.set_mesh``; else the
   mesh of the batch's arrays (their type carries it); else the mesh of the state's arrays.
   No mesh: one device, nothing to reduce.
2. the data axis: ``make_train_step(data_axis=...)``; by default (``"auto"``) the mesh axis
   that the batch's leading dimension is split over when its type says so (an ``Explicit``
   mesh axis), else the axis named ``"batch"``. Else the batch is taken as not split (a
   tensor-parallel mesh): XLA reduces whatever needs it, and a warning says so when the batch
   sits on an ``Auto`` mesh under a half-precision policy, where it may be split unseen.
3. the shardings: on ``Explicit`` mesh axes (``jax.make_mesh``'s default) every array's type
   carries its ``PartitionSpec``, so the gradients are reduce-scattered straight onto the
   master's sharding and ZeRO-3 params are all-gathered inside. On ``Auto`` axes the specs are
   not visible at trace time: the gradients are all-reduced (in fp32 all the same) and XLA
   slices them to the master's sharding; sharded params are gathered by XLA before the
   ``shard_map``, in their own (compute) dtype.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

__all__ = ["DataParallel", "axis_names", "check_batch", "check_divisible", "check_mesh_axis",
           "find", "gather", "reduce", "spec_entry", "stack", "sync", "to_varying"]

# The mesh helpers of this module and of jaxamp.parallel.

def check_divisible(batch: Any, n: int, over: str) -> None:
    """Every leaf's leading (batch) axis must split into ``n`` equal parts: ``over`` names
    them in the error (``"the device count 8"``)."""
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = np.shape(x)
        if not shape or shape[0] % n:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or '<root>'} has shape {shape}, whose "
                f"leading (batch) axis does not split over {over}; use a batch size that is a "
                f"multiple of {n}")


def axis_names(axis: str | tuple[str, ...]) -> tuple[str, ...]:
    """``"batch"`` -> ``("batch",)``; a tuple of names stays as it is."""
    return (axis,) if isinstance(axis, str) else tuple(axis)


def spec_entry(axis: str | tuple[str, ...]) -> str | tuple[str, ...]:
    names = axis_names(axis)
    return names[0] if len(names) == 1 else names


def check_mesh_axis(mesh: Any, axis: Any, argument: str) -> tuple[str, ...]:
    """The names of ``axis``, each checked to be an axis of ``mesh``."""
    if isinstance(axis, str):
        names: tuple[str, ...] = (axis,)
    elif isinstance(axis, tuple) and axis and all(isinstance(a, str) for a in axis):
        names = axis
    else:
        raise TypeError(f"{argument} must be a mesh axis name or a tuple of names, got "
                        f"{axis!r}; e.g. {argument}='batch'")
    missing = [a for a in names if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"{argument}={axis!r} is not an axis of the mesh, whose axes are "
            f"{tuple(mesh.axis_names)} with sizes {tuple(mesh.axis_sizes)}; pass one of them "
            f"({argument}={mesh.axis_names[0]!r}), or build the mesh with that name: "
            f"jax.make_mesh((jax.device_count(),), ({names[0]!r},))")
    return names


AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """The layout of a data-parallel step: the mesh, the data axis and whether the arrays'
    types carry their shardings (``Explicit`` axes)."""

    mesh: Any  # jax.sharding.Mesh or AbstractMesh
    names: tuple[str, ...]
    size: int
    explicit: bool

    def data_spec(self, spec: Any, ndim: int) -> PartitionSpec:
        """``spec`` restricted to the data axis (the only axes ``shard_map`` is manual over)."""
        if not self.explicit or spec is None:
            return PartitionSpec()
        out = []
        for entry in tuple(spec) + (None,) * (ndim - len(tuple(spec))):
            names = () if entry is None else axis_names(entry)
            ours = tuple(a for a in names if a in self.names)
            if ours and len(ours) != len(names):
                raise ValueError(
                    f"a dimension is split over {names}, the data axis {self.names} together "
                    "with another mesh axis; shard it over the data axis or the other axes, "
                    "not both on one dimension")
            out.append(None if not ours else ours[0] if len(ours) == 1 else ours)
        while out and out[-1] is None:
            out.pop()
        return PartitionSpec(*out)

    def spec_of(self, x: Any) -> PartitionSpec:
        """The data-axis part of ``x``'s sharding, read from its type (``P()`` on Auto axes)."""
        if not self.explicit:
            return PartitionSpec()
        sharding = getattr(jax.typeof(x), "sharding", None)
        return self.data_spec(getattr(sharding, "spec", None), jnp.ndim(x))

    def sharding_of(self, x: Any) -> NamedSharding:
        """``x``'s whole sharding as its type carries it, on this mesh (``P()`` if none)."""
        sharding = getattr(jax.typeof(x), "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
            return NamedSharding(self.abstract_mesh, PartitionSpec())
        return sharding

    def place(self, tree: Any, spec: PartitionSpec) -> Any:
        """``tree`` resharded to ``spec`` where the types carry shardings (``shard_map``'s
        ``in_specs`` must then match them); as it is on Auto axes."""
        if not self.explicit:
            return tree
        return jax.sharding.reshard(tree, NamedSharding(self.abstract_mesh, spec))

    @property
    def abstract_mesh(self) -> Any:
        return getattr(self.mesh, "abstract_mesh", self.mesh)


def _mesh_of(x: Any) -> Any:
    """The (abstract) mesh in the type of an array or tracer, or ``None``."""
    if not isinstance(x, jax.Array):
        return None
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return None if mesh is None or mesh.empty else mesh


def on_one_device(tree: Any) -> bool:
    """Whether no array of ``tree`` lies on a mesh of several devices, read from the arrays'
    types (under ``jit`` the type of an input placed on a mesh names it, ``Auto`` axes too)."""
    return all(m is None or m.size == 1 for m in map(_mesh_of, jax.tree.leaves(tree)))


def _sizes(mesh: Any) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def _describe(mesh: Any) -> str:
    return "{" + ", ".join(f"{a!r}: {n}" for a, n in _sizes(mesh).items()) + "}"


def _check_on_mesh(tree: Any, mesh: Any, what: str, fix: str) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        other = _mesh_of(x)
        if other is not None and _sizes(other) != _sizes(mesh):
            raise ValueError(
                f"{what}{jax.tree_util.keystr(path)} lives on a mesh {_describe(other)} but the "
                f"step runs on the mesh {_describe(mesh)}; {fix}")


def _leading_spec(batch: Any) -> tuple[bool, Any]:
    """``(known, entry)``: whether the batch's type says how its leading axis is split (on
    ``Explicit`` axes), and the mesh axis (or axes) it names there, ``None`` for none."""
    known = False
    for x in jax.tree.leaves(batch):
        sharding = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else None
        if not isinstance(sharding, NamedSharding) or sharding.mesh.empty \
                or not sharding.mesh.explicit_axes:
            continue
        known = True
        spec = tuple(sharding.spec)
        if spec and spec[0] is not None:
            return True, spec[0]
    return known, None


def _pick_axis(mesh: Any, batch: Any, batch_on_mesh: bool,
               warn_implicit: bool) -> tuple[str, ...] | None:
    """The data axis of ``data_axis="auto"``, or ``None`` when the batch is not split."""
    known, leading = _leading_spec(batch)
    if leading is not None:
        return axis_names(leading)
    if "batch" in mesh.axis_names:
        return ("batch",)
    if batch_on_mesh and not known and warn_implicit:
        warnings.warn(
            f"the batch is on a mesh {_describe(mesh)} with no axis named 'batch', and its type "
            "does not say which axis splits it (Auto mesh axes): the step leaves the gradient "
            "reduction to XLA, in the gradients' dtype. Name the data axis for an fp32 "
            "reduction, jaxamp.make_train_step(loss_fn, data_axis='data'), or pass "
            "data_axis=None if the batch is not split (tensor parallelism only).",
            stacklevel=5)
    return None


def find(mesh: Any, data_axis: Any, state: Any, batch: Any, *,
         warn_implicit: bool = True) -> DataParallel | None:
    """The data-parallel layout of a step at trace time, or ``None`` for one device (or a
    batch that is not split). ``warn_implicit``: warn when the batch is on a mesh whose data
    axis cannot be found (the gradients are then reduced by XLA, in their dtype)."""
    if data_axis is None:
        return None
    found, batch_on_mesh = mesh, mesh is not None
    if found is None:
        context = jax.sharding.get_abstract_mesh()
        found = None if context.empty else context
    if found is None:
        found = next((m for m in map(_mesh_of, jax.tree.leaves(batch)) if m is not None), None)
        batch_on_mesh = found is not None
    if found is None:
        found = next((m for m in map(_mesh_of, jax.tree.leaves(state)) if m is not None), None)
    if found is None:
        return None
    if data_axis == AUTO:
        names = _pick_axis(found, batch, batch_on_mesh, warn_implicit)
        if names is None:
            return None
    else:
        names = check_mesh_axis(found, data_axis, "data_axis")
    types = dict(zip(found.axis_names, found.axis_types, strict=True))
    if any(types[a] == AxisType.Manual for a in names):
        return None  # inside the user's own shard_map over the data axis: run as written
    fix = ("put it on the step's mesh: jax.device_put(state, jaxamp.parallel.state_sharding(state, "
           "mesh)) (orbax restores a checkpoint onto any mesh given such shardings)")
    _check_on_mesh(state, found, "state", fix)
    _check_on_mesh(batch, found, "batch",
                   "put it on the step's mesh: jaxamp.parallel.put_sharded(batch, "
                   "jaxamp.parallel.batch_sharding(mesh))")
    size = math.prod(_sizes(found)[a] for a in names)
    explicit = all(types[a] == AxisType.Explicit for a in names)
    return DataParallel(found, names, size, explicit)


def check_batch(dp: DataParallel, batch: Any, accum_steps: int) -> None:
    """Every batch leaf's leading axis must split evenly over the devices (and micro-batches)."""
    n = dp.size * accum_steps
    over = f"the {dp.size} devices of the data axis {spec_entry(dp.names)!r}"
    if accum_steps > 1:
        over += f" x accum_steps {accum_steps} = {n}"
    check_divisible(batch, n, over)


def _dim(spec: PartitionSpec) -> int | None:
    return next((d for d, s in enumerate(spec) if s is not None), None)


def to_varying(tree: Any, names: tuple[str, ...]) -> Any:
    """Marks each leaf as varying over ``names``: the gradient of a replicated param inside
    ``shard_map`` is then each device's own, with no implicit (half-precision) ``psum``."""
    def vary(x):
        try:
            return lax.pcast(x, names, to="varying")
        except ValueError:  # already varying (computed from the batch, or all-gathered)
            return x
    return jax.tree.map(vary, tree)


def gather(dp: DataParallel, tree: Any, specs: Any) -> Any:
    """All-gathers the leaves split over the data axis (ZeRO-3 params), in their own dtype."""
    def one(x, spec):
        dim = _dim(spec)
        return x if dim is None else lax.all_gather(x, dp.names, axis=dim, tiled=True)
    return jax.tree.map(one, tree, specs)


def reduce(dp: DataParallel, grads: Any, specs: Any, dtype: Any) -> Any:
    """The mean over the data axis in ``dtype``: ``psum_scatter`` onto a sharded leaf's shard,
    ``pmean`` for a replicated one."""
    def one(g, spec):
        g = g.astype(dtype)
        dim = _dim(spec)
        if dim is None:
            return lax.pmean(g, dp.names)
        return _psum_scatter(dp, g, dim) / dp.size
    return jax.tree.map(one, grads, specs)


def _psum_scatter(dp: DataParallel, g: jax.Array, dim: int) -> jax.Array:
    """The sum of ``g`` over the data axis, each device keeping its tile of dimension ``dim``.

    On a mesh with other ``Explicit`` axes (data x model), the ``shard_map`` over the data axis
    is partly manual, and JAX cannot lower ``psum_scatter`` there: jax 0.11 and 0.12 build the
    reducer's scalar type from the operand's type, sharding spec and all ("Length of
    sharding.spec (2) must be equal to aval's ndim (0)"), and jax 0.10 fails on an operand
    split over the other axes. The collective then runs in a nested ``shard_map`` that is
    manual over those axes too: on each device's own block, so that the result keeps the
    operand's split over them, with ``dim`` made whole over them first (the master is split
    there over the data axis alone).
    """
    def scatter(x):
        return lax.psum_scatter(x, dp.names, scatter_dimension=dim, tiled=True)
    mesh = jax.sharding.get_abstract_mesh()
    others = frozenset(a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                       if t == AxisType.Explicit)
    if not others:
        return scatter(g)
    given = tuple(dp.sharding_of(g).spec)
    entries = list(given + (None,) * (g.ndim - len(given)))
    entries[dim] = None
    spec = PartitionSpec(*entries)
    if given != tuple(entries):
        g = jax.sharding.reshard(g, NamedSharding(mesh, spec))
    return jax.shard_map(scatter, mesh=mesh, in_specs=spec, out_specs=spec,
                         axis_names=others)(g)


def sync(dp: DataParallel, tree: Any) -> Any:
    """One model state for all devices: floating leaves averaged, other leaves (counters) the
    maximum over the devices (equal when every device updates them alike)."""
    def one(x):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return lax.pmean(x, dp.names)
        return lax.pmax(x, dp.names)
    return jax.tree.map(one, tree)


def stack(dp: DataParallel, tree: Any, stacked: bool) -> Any:
    """Aux outputs with a leading axis of one entry per device (``stacked``: per micro-batch,
    already stacked), concatenated over the data axis as ``pmap`` would return them."""
    def one(x):
        x = jnp.asarray(x)
        return to_varying(x if stacked else x[None], dp.names)
    return jax.tree.map(one, tree)
