"""A one-axis device mesh for data parallelism: the batch is split over ``data``, everything else is replicated.

One device is a mesh of one; 8 GPUs (or 8 fake CPU devices) need no other code. The per-device gradient is
computed inside :func:`jax.shard_map` (so custom VJPs and Pallas kernels see their local shard, as on one device)
and summed over ``data`` with :func:`jax.lax.psum` (:mod:`jaxgrad.train.grads`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxgrad.train.errors import ConfigError

DATA_AXIS = "data"


def data_mesh(devices=None) -> Mesh:
    """``Mesh(devices, ("data",))``; ``devices``: a sequence of devices, an int (the first n), or None (all)."""
    all_devices = jax.devices()
    if devices is None:
        devices = all_devices
    elif isinstance(devices, int):
        if not 1 <= devices <= len(all_devices):
            raise ConfigError(f"data_mesh: 'devices' = {devices} but {len(all_devices)} device(s) are available")
        devices = all_devices[:devices]
    return Mesh(np.asarray(list(devices)), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def check_divisible(batch, mesh: Mesh) -> int:
    """The number of items (leading axis, the same for every leaf); raises if it does not split over the mesh."""
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("batch: no arrays in the batch")
    sizes = {int(np.shape(a)[0]) if np.ndim(a) else -1 for a in leaves}
    if len(sizes) != 1 or -1 in sizes:
        raise ValueError(f"batch: every leaf needs the same leading (item) axis, got leading sizes "
                         f"{sorted(np.shape(a)[0] if np.ndim(a) else 'scalar' for a in leaves)}")
    (n,) = sizes
    d = mesh.shape[DATA_AXIS]
    if n % d:
        raise ConfigError(f"batch size {n} does not divide over the {d} devices of the '{DATA_AXIS}' mesh axis; "
                         f"use a batch size that is a multiple of {d} (e.g. {max(d, n - n % d)}) or fewer devices")
    return n


def shard_batch(batch, mesh: Mesh):
    """Put ``batch`` on the mesh, split along its leading axis over ``data`` (checks divisibility first)."""
    check_divisible(batch, mesh)
    return jax.device_put(batch, batch_sharded(mesh))


def replicate(tree, mesh: Mesh):
    """Put ``tree`` (params, optimiser state) on every device of the mesh."""
    return jax.device_put(tree, replicated(mesh))
