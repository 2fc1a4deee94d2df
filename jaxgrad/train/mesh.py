r"""The device mesh: the batch over ``data`` (and ``fsdp``), a model's frozen weights sharded over ``fsdp``.

Layouts (:func:`train_mesh`; ``mesh.axes`` of ``jaxgrad train``):

* ``"data"``: every device holds every parameter; the batch is split over the devices (data parallelism).
* ``"fsdp"``: the batch is split over the devices as well, and a model that has a :class:`ShardPlan` keeps only
  ``1/N`` of each large weight on each device (fully sharded data parallelism); a layer's weights are all-gathered
  just before that layer runs and dropped after it (re-gathered for its backward).
* ``"data,fsdp"``: both: ``D`` groups of ``F`` devices (``D F`` devices); the weights are sharded over the ``F``
  devices of a group and replicated over the ``D`` groups (so a gather never leaves its group), the batch is split
  over all ``D F`` devices.

The mesh is always ``Mesh(devices.reshape(D, F), ("data", "fsdp"))`` (``F = 1`` for ``"data"``, ``D = 1`` for
``"fsdp"``), so one code path serves every layout; :func:`data_mesh` keeps the one-axis mesh of the plain data
parallel path. Per device, the family's loss runs inside :func:`jax.shard_map` on its local batch shard (custom
VJPs and Pallas kernels see local arrays, as on one device) and the sums are reduced by JAX's collectives
(:mod:`jaxgrad.train.grads`).

Arrays are put on the mesh with :func:`jax.make_array_from_callback`, which every process of a multi-process run
(:mod:`jaxgrad.train.distributed`) calls with the same global value: each process fills only the shards of its own
devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxgrad.train.errors import ConfigError

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
LAYOUTS = ("data", "fsdp", "data,fsdp")


def data_mesh(devices=None) -> Mesh:
    """``Mesh(devices, ("data",))``; ``devices``: a sequence of devices, an int (the first n), or None (all)."""
    return Mesh(np.asarray(_devices(devices, "data_mesh: 'devices'")), (DATA_AXIS,))


def _devices(devices, name: str) -> list:
    all_devices = jax.devices()
    if devices is None:
        return list(all_devices)
    if isinstance(devices, int):
        if not 1 <= devices <= len(all_devices):
            raise ConfigError(f"{name} = {devices} but {len(all_devices)} device(s) are available")
        return list(all_devices[:devices])
    return list(devices)


def train_mesh(layout: str = "data", devices=None, fsdp: int | None = None) -> Mesh:
    """The ``("data", "fsdp")`` mesh of a layout (module docstring).

    ``layout``: ``"data"``, ``"fsdp"`` or ``"data,fsdp"``; ``devices``: how many (the first n; None: all) or the
    devices themselves; ``fsdp``: the size of the ``fsdp`` axis, required with ``"data,fsdp"`` (a divisor of the
    device count), optional with ``"fsdp"`` (then it must equal the device count) and refused with ``"data"``.
    """
    if layout not in LAYOUTS:
        raise ConfigError(f"mesh.axes must be one of {', '.join(repr(x) for x in LAYOUTS)}, got {layout!r}")
    devs = _devices(devices, "train.devices")
    n = len(devs)
    if fsdp is not None and (not isinstance(fsdp, int) or isinstance(fsdp, bool) or fsdp < 1):
        raise ConfigError(f"mesh.fsdp must be an int >= 1 (the size of the 'fsdp' axis), got {fsdp!r}")
    if layout == "data":
        if fsdp not in (None, 1):
            raise ConfigError(f"mesh.fsdp = {fsdp} is not used with mesh.axes = 'data' (nothing is sharded); use "
                              f"mesh.axes = 'fsdp' or 'data,fsdp', or leave mesh.fsdp unset")
        d, f = n, 1
    elif layout == "fsdp":
        if fsdp not in (None, n):
            raise ConfigError(f"mesh.fsdp = {fsdp} but mesh.axes = 'fsdp' shards over all {n} devices; use "
                              f"mesh.axes = 'data,fsdp' for {fsdp}-device groups, or leave mesh.fsdp unset")
        d, f = 1, n
    else:
        if fsdp is None:
            raise ConfigError(f"mesh.axes = 'data,fsdp' needs mesh.fsdp, the devices per fsdp group (a divisor of "
                              f"the {n} devices)")
        if n % fsdp:
            raise ConfigError(f"mesh.fsdp = {fsdp} does not divide the {n} devices; use a divisor of {n}")
        d, f = n // fsdp, fsdp
    return Mesh(np.asarray(devs, dtype=object).reshape(d, f), (DATA_AXIS, FSDP_AXIS))


def fsdp_size(mesh: Mesh) -> int:
    """Devices along ``fsdp`` (1 when the mesh has no such axis)."""
    return int(dict(mesh.shape).get(FSDP_AXIS, 1))


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes the batch is split over: ``("data",)`` or ``("data", "fsdp")``."""
    return tuple(a for a in (DATA_AXIS, FSDP_AXIS) if a in mesh.axis_names)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(batch_axes(mesh)))


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
    d = math.prod(mesh.shape[a] for a in batch_axes(mesh))
    if n % d:
        raise ConfigError(f"batch size {n} does not divide over the {d} devices of the "
                          f"'{','.join(batch_axes(mesh))}' mesh axes; use a batch size that is a multiple of {d} "
                          f"(e.g. {max(d, n - n % d)}) or fewer devices")
    return n


def put(tree, shardings):
    """``tree`` on the mesh with ``shardings`` (one sharding, or a tree of them matching ``tree``).

    One process: :func:`jax.device_put`. Several (:mod:`jaxgrad.train.distributed`): every process passes the same
    global value and fills the shards of its own devices (:func:`jax.make_array_from_callback`)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def one(x, sharding):
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        host = np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) else np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def shard_batch(batch, mesh: Mesh):
    """Put ``batch`` on the mesh, split along its leading axis over the batch axes (checks divisibility first)."""
    check_divisible(batch, mesh)
    return put(batch, batch_sharded(mesh))


def replicate(tree, mesh: Mesh):
    """Put ``tree`` (params, optimiser state) on every device of the mesh."""
    return put(tree, replicated(mesh))


def shard_axis(shape, n: int) -> int | None:
    """The axis a weight of ``shape`` is split along over ``n`` devices: the largest axis whose length ``n``
    divides (the first of equals), or ``None`` (kept whole on every device: too small or indivisible)."""
    if n <= 1:
        return None
    best = None
    for i, length in enumerate(shape):
        if length % n == 0 and length >= n and (best is None or length > shape[best]):
            best = i
    return best


def axis_spec(ndim: int, axis: int | None) -> PartitionSpec:
    """``PartitionSpec`` sharding ``axis`` of an ``ndim``-array over ``fsdp`` (``None``: replicated)."""
    if axis is None:
        return PartitionSpec()
    return PartitionSpec(*([None] * axis + [FSDP_AXIS]))


def spec_axis(spec: PartitionSpec) -> int | None:
    """The axis a :func:`axis_spec` shards over ``fsdp``, or ``None``."""
    for i, entry in enumerate(spec):
        if entry == FSDP_AXIS:
            return i
    return None


def gather(x, spec: PartitionSpec):
    """Inside :func:`jax.shard_map`: the whole array from its ``fsdp`` shards (``all_gather``, tiled), or ``x``
    itself when ``spec`` keeps it whole."""
    axis = spec_axis(spec)
    return x if axis is None else jax.lax.all_gather(x, FSDP_AXIS, axis=axis, tiled=True)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class GatheredWeight:
    """A frozen weight held as this device's ``fsdp`` shards inside :func:`jax.shard_map` and all-gathered where it
    is used (:func:`whole`), not before: a custom VJP that takes it saves the shards as its residual and gathers
    again in its backward, so no device keeps a layer's whole weight from the forward to the backward, and the VJP's
    own recompute is kept (``jax.checkpoint``, the other way to drop a gathered weight, recomputes a custom VJP's
    whole forward). With ``reshard_after_forward`` false the backward uses the forward's gathered weight instead
    (one gather a step, the whole weight kept from the forward to the backward: PyTorch FSDP2's option of that name).

    Attributes:
      value: an array, or a pytree of arrays (an NF4 weight's bytes and scales), each leaf this device's piece.
      axes: static, one per leaf of ``value`` (flattening order): the axis the leaf is split along, ``None`` whole.
      shape: static, the whole weight's shape (what ``value`` gathers to; an NF4 weight's ``[out, in]``).
      reshard_after_forward: static; whether the backward gathers the weight again (see above).
    """

    value: Any
    axes: tuple
    shape: tuple
    reshard_after_forward: bool = True

    def tree_flatten(self):
        return (self.value,), (self.axes, self.shape, self.reshard_after_forward)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def gather(self):
        """The whole weight (inside :func:`jax.shard_map`; ``all_gather``, tiled, of each split leaf)."""
        leaves, tree = jax.tree.flatten(self.value)
        return jax.tree.unflatten(tree, [x if a is None else jax.lax.all_gather(x, FSDP_AXIS, axis=a, tiled=True)
                                         for x, a in zip(leaves, self.axes, strict=True)])


def gathered_weight(x, spec, fsdp: int, reshard_after_forward: bool = True):
    """``x`` (an array, or an NF4 weight whose leaves' specs ``spec`` gives leaf for leaf) as a
    :class:`GatheredWeight` on an ``fsdp`` axis of ``fsdp`` devices, or ``x`` itself where nothing of it is split."""
    leaves = jax.tree.leaves(x)
    axes = tuple(spec_axis(s) for s in jax.tree.leaves(spec, is_leaf=is_spec))
    if len(axes) != len(leaves):
        raise ValueError(f"gathered_weight: {len(axes)} specs for {len(leaves)} leaves")
    if all(a is None for a in axes):
        return x
    if isinstance(x, (jax.Array, np.ndarray)):  # an array: its shard's shape, times fsdp along the split axis
        shape = tuple(d * (fsdp if i == axes[0] else 1) for i, d in enumerate(np.shape(x)))
    else:  # a structured weight (NF4) states its whole shape
        shape = x.shape
    return GatheredWeight(x, axes, tuple(int(d) for d in shape), bool(reshard_after_forward))


def whole(w):
    """``w.gather()`` for a :class:`GatheredWeight`, else ``w``."""
    return w.gather() if isinstance(w, GatheredWeight) else w


def is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How a model lies on a mesh with an ``fsdp`` axis, and the loss that runs on its shards.

    Attributes:
      param_specs: a tree of :class:`~jax.sharding.PartitionSpec` matching the params (over ``fsdp`` only; the
        ``data`` axis replicates). Frozen leaves are stored so; trainable leaves too when ``shard_trainable``, else
        whole on every device.
      loss: ``loss(params, consts, batch[, key]) -> (S, n)``, run per device inside :func:`jax.shard_map`:
        ``params`` has the trainable leaves whole (the engine gathers sharded ones first) and the frozen leaves as
        the device's shards (the loss gathers each where it needs it, e.g. a layer's weights just before the
        layer); ``consts`` likewise (the frozen arrays that are not params, e.g. NF4 projections).
      reference_loss: the same for ``grad_path = "reference"``.
      consts, consts_specs: a tree of global arrays already on the mesh, and its specs (``None``: no constants).
      shard_trainable: the trainable params and the optimiser state are sharded by ``param_specs`` too (the engine
        gathers them before the loss and reduce-scatters their gradients); else replicated.
      describe: one line for the log (what is sharded, bytes per device).
    """

    param_specs: Any
    loss: Callable
    reference_loss: Callable | None = None
    consts: Any = None
    consts_specs: Any = None
    shard_trainable: bool = False
    describe: str = ""

    def loss_for(self, grad_path: str) -> Callable:
        return self.reference_loss if grad_path == "reference" and self.reference_loss is not None else self.loss


def param_shardings(mesh: Mesh, params, mask, plan: ShardPlan | None):
    """The ``NamedSharding`` of every params leaf: the plan's spec for frozen leaves (``mask`` False) and, with
    ``plan.shard_trainable``, for trainable ones; replicated otherwise (and everywhere without a plan)."""
    rep = replicated(mesh)
    if plan is None:
        return jax.tree.map(lambda _: rep, params)
    mask = jax.tree.map(lambda _: True, params) if mask is None else mask
    return jax.tree.map(lambda m, s: NamedSharding(mesh, s) if (not m or plan.shard_trainable) else rep,
                        mask, plan.param_specs, is_leaf=is_spec)


def bytes_per_device(tree) -> int:
    """The bytes of ``tree``'s arrays held by one device (the first), from their shardings."""
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            shape = x.sharding.shard_shape(x.shape)
            total += int(np.prod(shape)) * x.dtype.itemsize
        else:
            total += int(np.size(x)) * np.dtype(getattr(x, "dtype", np.float64)).itemsize
    return total
