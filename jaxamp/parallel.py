"""Laying a state and a batch out for ``jax.pmap`` or a sharded ``jax.jit``.

``replicate``/``shard_batch`` prepare ``pmap``; ``batch_sharding``/``put_sharded`` split a batch
over a mesh axis for ``jit``; :func:`state_sharding` shards the optimizer state (ZeRO-1/2) and
optionally the working params (ZeRO-3) over that axis, by the rule of :func:`zero_spec`.
"""

from jaxamp._step._parallel import batch_sharding
from jaxamp._step._parallel import per_device_bytes
from jaxamp._step._parallel import put_sharded
from jaxamp._step._parallel import replicate
from jaxamp._step._parallel import shard_batch
from jaxamp._step._parallel import state_sharding
from jaxamp._step._parallel import unreplicate
from jaxamp._step._parallel import zero_spec

__all__ = ["batch_sharding", "per_device_bytes", "put_sharded", "replicate", "shard_batch",
           "state_sharding", "unreplicate", "zero_spec"]
