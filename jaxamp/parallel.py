"""Helpers to lay a state and a batch out for ``jax.pmap`` or a sharded ``jax.jit``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

__all__ = ["replicate", "unreplicate", "shard_batch", "batch_sharding", "put_sharded"]


def _check_divisible(batch: Any, n: int, what: str) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = np.shape(x)
        if not shape or shape[0] % n:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or '<root>'} has shape {shape}, whose "
                f"leading (batch) axis is not divisible by the {what} {n}; use a batch size "
                f"that is a multiple of {n}")


def replicate(tree: Any, devices: list | None = None) -> Any:
    """Stacks ``tree`` once per device (default: all local devices) for ``jax.pmap``.

    >>> import jax.numpy as jnp
    >>> replicate({"w": jnp.ones(3)}, jax.local_devices()[:2])["w"].shape
    (2, 3)
    """
    devices = devices if devices is not None else jax.local_devices()
    sharding = NamedSharding(Mesh(np.array(devices), ("devices",)), PartitionSpec("devices"))

    def stack(x):  # host-side, one transfer per device: no per-shape compilation
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
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
    _check_divisible(batch, n, "device count")
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
    _check_divisible(batch, n, "number of devices the batch is split over")
    return jax.device_put(batch, sharding)

