"""The code of :mod:`jaxamp.parallel`: laying a state and a batch out for ``jax.pmap`` or a
sharded ``jax.jit``."""

from __future__ import annotations

import collections
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from jaxamp._step._data_parallel import axis_names
from jaxamp._step._data_parallel import check_divisible
from jaxamp._step._data_parallel import check_mesh_axis
from jaxamp._step._data_parallel import spec_entry

__all__ = ["batch_sharding", "per_device_bytes", "put_sharded", "replicate", "shard_batch",
           "state_sharding", "unreplicate", "zero_spec"]


def replicate(tree: Any, devices: list | None = None) -> Any:
    """Stacks ``tree`` once per device (default: all local devices) for ``jax.pmap``.

    >>> import jax.numpy as jnp
    >>> replicate({"w": jnp.ones(3)}, jax.local_devices()[:2])["w"].shape
    (2, 3)
    """
    devices = devices if devices is not None else jax.local_devices()
    sharding = NamedSharding(Mesh(np.array(devices), ("devices",)), PartitionSpec("devices"))

    def stack(x):  # host-side, one transfer per device: no per-shape compilation
        dtype = getattr(x, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
            return jax.device_put(jnp.stack([x] * len(devices)), sharding)
        x = np.asarray(x)
        return jax.make_array_from_callback((len(devices), *x.shape), sharding,
                                            lambda index: x[None])
    return jax.tree.map(stack, tree)


def unreplicate(tree: Any) -> Any:
    """Takes the first device's copy of a replicated tree.

    >>> import jax.numpy as jnp
    >>> unreplicate(replicate({"w": jnp.ones(3)}))["w"].shape
    (3,)
    """
    return jax.tree.map(lambda x: x[0], tree)


def shard_batch(batch: Any, num_devices: int | None = None) -> Any:
    """Reshapes each leaf ``(B, ...)`` to ``(num_devices, B // num_devices, ...)`` for pmap.

    >>> import numpy as np
    >>> shard_batch({"x": np.zeros((8, 3))}, 4)["x"].shape
    (4, 2, 3)
    """
    n = num_devices if num_devices is not None else jax.local_device_count()
    check_divisible(batch, n, f"the device count {n}")
    return jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + tuple(x.shape[1:])), batch)


def batch_sharding(mesh: Mesh | None = None, axis_name: str = "batch") -> NamedSharding:
    """A ``NamedSharding`` that splits the leading axis over ``axis_name`` of ``mesh``.

    The default mesh is every device on one axis named ``axis_name``.

    >>> batch_sharding().spec
    P('batch',)
    """
    if mesh is None:
        mesh = Mesh(np.array(jax.devices()), (axis_name,))
    return NamedSharding(mesh, PartitionSpec(axis_name))


def put_sharded(batch: Any, sharding: NamedSharding | None = None) -> Any:
    """``jax.device_put`` of a batch split along its leading axis, with a clear error first.

    >>> import numpy as np
    >>> x = put_sharded({"x": np.zeros((16, 3))})["x"]
    >>> x.shape, len(x.sharding.device_set) == jax.device_count()
    ((16, 3), True)
    """
    sharding = sharding if sharding is not None else batch_sharding()
    spec = sharding.spec[0] if sharding.spec else None
    names = (spec,) if isinstance(spec, str) else tuple(spec or ())
    n = int(np.prod([sharding.mesh.shape[a] for a in names])) if names else 1
    check_divisible(batch, n, f"the number of devices the batch is split over, {n}")
    return jax.device_put(batch, sharding)



# --------------------------------------------------------------------------------------------
# Sharded state: ZeRO-1/2 and ZeRO-3
# --------------------------------------------------------------------------------------------

MIN_SHARD_SIZE = 2**12
_PARAMS_MODES = ("replicated", "sharded")


def _mesh_sizes(mesh: Any) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def zero_spec(shape: tuple[int, ...], axis: str | tuple[str, ...], axis_size: int, *,
              base: PartitionSpec | None = None,
              min_size: int = MIN_SHARD_SIZE) -> PartitionSpec:
    """The spec of one leaf of a sharded state: ``base`` with ``axis`` added on one dimension.

    The rule: a leaf of at least ``min_size`` elements is split over ``axis`` along its
    largest dimension that ``axis_size`` divides and that ``base`` leaves unsharded (the first
    such on ties). A smaller leaf (a bias, a norm's scale, a scalar) or one with no such
    dimension keeps ``base`` (replicated over ``axis``).

    >>> zero_spec((1024, 4096), "batch", 8)
    P(None, 'batch')
    >>> zero_spec((30522, 1024), "batch", 8)   # 30522 is not a multiple of 8
    P(None, 'batch')
    >>> zero_spec((1024,), "batch", 8)         # fewer than 4096 elements: replicated
    P()
    """
    base = PartitionSpec() if base is None else base
    spec = list(base) + [None] * (len(shape) - len(base))
    used = {a for s in spec if s is not None for a in axis_names(s)}
    free = [d for d, n in enumerate(shape) if spec[d] is None and n % axis_size == 0
            and n >= axis_size]
    if free and not used & set(axis_names(axis)) and math.prod(shape) >= min_size:
        spec[max(free, key=lambda d: (shape[d], -d))] = spec_entry(axis)
    while spec and spec[-1] is None:  # P('batch') rather than P('batch', None)
        spec.pop()
    return PartitionSpec(*spec)


def _base_spec(leaf: Any, mesh: Any) -> PartitionSpec:
    """The spec ``leaf`` already has on a mesh with ``mesh``'s axes (tensor parallelism over
    another axis is kept), else ``P()``."""
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and _mesh_sizes(sharding.mesh) == _mesh_sizes(mesh):
        return sharding.spec
    return PartitionSpec()


def state_sharding(state: Any, mesh: Mesh, *, axis: str | tuple[str, ...] = "batch",
                   params: str = "replicated", min_size: int = MIN_SHARD_SIZE) -> Any:
    """``NamedSharding`` s for every leaf of a :class:`jaxamp.TrainState`: ZeRO over ``axis``.

    - The optimizer state (the fp32 master and the inner optimizer's state, the Adam moments)
      is split over ``axis``, each leaf along one dimension by the rule of :func:`zero_spec`:
      leaves of at least ``min_size`` elements (default 4096) along their largest dimension
      that the axis size divides; smaller or indivisible leaves are replicated. This is
      ZeRO-1/2: under :func:`jaxamp.make_train_step` the gradients are reduce-scattered in
      fp32 onto this sharding, and the update runs on each device's shard.
    - ``params="replicated"`` keeps the working params whole on every device (cast from the
      master shards and all-gathered in the compute dtype after each update);
      ``params="sharded"`` splits them like the master (ZeRO-3, FSDP), and the step
      all-gathers them in the compute dtype for the forward and backward pass.
    - The step counter, the loss scale and counters, the rng and the model state (BatchNorm
      statistics) are replicated.

    A leaf that is already sharded over another axis of the same mesh (tensor parallelism)
    keeps that and gets ``axis`` on a free dimension. ``state`` may be concrete or abstract
    (``jax.eval_shape``); the result is a ``TrainState`` of shardings for ``jax.jit``'s
    ``in_shardings``/``out_shardings``, ``jax.device_put`` and orbax's restore targets.

    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> mesh = jax.make_mesh((8,), ("batch",))
    >>> tx = jaxamp.mixed_precision(optax.adam(1e-3), "mixed_bfloat16")
    >>> state = jaxamp.TrainState.create(params={"w": jnp.ones((64, 128))}, tx=tx)
    >>> shardings = state_sharding(state, mesh)
    >>> shardings.opt_state.master.params["w"].spec, shardings.params["w"].spec
    (P(None, 'batch'), P())
    >>> state_sharding(state, mesh, params="sharded").params["w"].spec
    P(None, 'batch')
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__} "
                        f"{mesh!r}; build one with jax.make_mesh((jax.device_count(),), "
                        "('batch',))")
    names = check_mesh_axis(mesh, axis, "axis")
    if params not in _PARAMS_MODES:
        raise ValueError(f"params must be 'replicated' (ZeRO-1/2) or 'sharded' (ZeRO-3), got "
                         f"{params!r}")
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_size must be an int >= 1, got {min_size!r}; leaves with fewer "
                         "elements stay replicated (default 4096)")
    for field in ("params", "opt_state", "step"):
        if not hasattr(state, field):
            raise TypeError(f"state_sharding expects a jaxamp.TrainState, got "
                            f"{type(state).__name__}; build it with "
                            "jaxamp.TrainState.create(params=..., tx=...)")
    size = math.prod(_mesh_sizes(mesh)[a] for a in names)

    def zero(x):
        spec = zero_spec(tuple(np.shape(x)), axis, size, base=_base_spec(x, mesh),
                         min_size=min_size)
        return NamedSharding(mesh, spec)

    def kept(x):
        return NamedSharding(mesh, _base_spec(x, mesh))

    return type(state).replace(
        jax.tree.map(kept, state),
        params=jax.tree.map(zero if params == "sharded" else kept, state.params),
        opt_state=jax.tree.map(zero, state.opt_state))


def per_device_bytes(tree: Any, shardings: Any = None) -> int:
    """The bytes of ``tree`` that the fullest device holds.

    Concrete arrays are counted from their ``addressable_shards``; abstract leaves
    (``jax.ShapeDtypeStruct``, or any leaf with ``shardings`` given) from the shard shape of
    their sharding, as on every device. A leaf without a sharding counts whole.

    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("batch",))
    >>> x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    >>> per_device_bytes(x), per_device_bytes(x, NamedSharding(mesh, PartitionSpec("batch")))
    (4194304, 524288)
    """
    leaves = jax.tree.leaves(tree)
    if shardings is None:
        shards = [getattr(x, "sharding", None) for x in leaves]
    else:
        shards = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    if len(shards) != len(leaves):
        raise ValueError(f"shardings has {len(shards)} leaves but tree has {len(leaves)}; pass "
                         "a tree of shardings with the structure of tree, e.g. "
                         "jaxamp.parallel.state_sharding(state, mesh)")
    per_device: collections.Counter = collections.Counter()
    whole = 0
    for x, sharding in zip(leaves, shards, strict=True):
        itemsize = np.dtype(x.dtype).itemsize if not jnp.issubdtype(
            x.dtype, jax.dtypes.prng_key) else x.dtype.itemsize
        if isinstance(x, jax.Array) and shardings is None and not isinstance(x, Tracer):
            for shard in x.addressable_shards:
                per_device[shard.device] += math.prod(shard.data.shape) * itemsize
        elif isinstance(sharding, jax.sharding.Sharding):
            nbytes = math.prod(sharding.shard_shape(tuple(x.shape))) * itemsize
            for device in sharding.device_set:
                per_device[device] += nbytes
        else:
            whole += math.prod(np.shape(x)) * itemsize
    return whole + max(per_device.values(), default=0)
