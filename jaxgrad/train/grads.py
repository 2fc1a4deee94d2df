r"""The loss and gradient over a device mesh, reduced by JAX.

For a batch split over the ``D`` devices of the ``data`` axis, each device ``d`` evaluates the family's loss on its
shard, ``(S_d, n_d)`` = (sum of item losses, item count), and its gradient :math:`\nabla S_d` -- through the family's
custom VJPs or Pallas kernels, which therefore only ever see a local shard -- inside :func:`jax.shard_map`; then

.. math::

    S = \operatorname{psum}_d S_d, \qquad n = \operatorname{psum}_d n_d, \qquad
    \nabla S = \operatorname{psum}_d \nabla S_d .

:func:`global_sum_loss` packages this as one differentiable function ``(params, batch) -> (S, n)`` (a
``jax.custom_vjp`` whose backward returns ``ct_S * psum_d grad S_d``), so ``jax.value_and_grad`` of it and of
:func:`global_mean_loss` (``S / n``) work anywhere -- in the engine's step, in gradient accumulation and inside
``optax.lbfgs``'s line search (``optax.value_and_grad_from_state``). One device: ``psum`` over an axis of one.

On a mesh with an ``fsdp`` axis (:func:`jaxgrad.train.mesh.train_mesh`) the batch is split over ``data`` and
``fsdp`` alike, and a model with a :class:`~jaxgrad.train.mesh.ShardPlan` enters the ``shard_map`` as shards:
:func:`plan_sum_loss` hands the plan's loss the frozen weights as the device's ``1/F`` shards (it all-gathers a
layer's weights just before the layer, :mod:`jaxgrad.lora.sharding`), the trainable leaves whole (all-gathered
first when they are stored sharded), and reduces the gradient of a sharded trainable leaf ``p`` to its shard:

.. math::

    \nabla S\,[\text{shard } f] = \operatorname{psum}_{\text{data}}\,
        \operatorname{psum\_scatter}_{\text{fsdp}} \nabla_{\text{full}} S_d ,

(``psum`` over both axes for a replicated leaf): the same sum as on one device, in another order.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxgrad.train.mesh import DATA_AXIS, FSDP_AXIS, ShardPlan, batch_axes, gather, spec_axis
from jaxgrad.train.precision import Policy


def _shard_key(key_data, axes: tuple[str, ...]):
    """``fold_in(key, batch shard index)``: each batch shard draws its own numbers (the index runs over the batch
    axes in mesh order, so a layout with the same batch split draws the same masks)."""
    index = jax.lax.axis_index(axes[0] if len(axes) == 1 else axes)
    return jax.random.fold_in(jax.random.wrap_key_data(key_data), index)


def _local(loss: Callable, policy: Policy, axes: tuple[str, ...] = (DATA_AXIS,)) -> Callable:
    def local(params, batch, *key):
        if key:  # key data, replicated: each shard draws its own numbers, fold_in(key, shard index)
            key = (_shard_key(key[0], axes),)
        s, n = loss(policy.to_compute(params), policy.to_compute(batch), *key)
        return policy.to_output(jnp.asarray(s)), jnp.asarray(n, jnp.result_type(float))
    return local


def _zero_cotangent(x):
    x = jnp.asarray(x) if not hasattr(x, "dtype") else x
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros(x.shape, x.dtype)
    return np.zeros(x.shape, jax.dtypes.float0)


def global_sum_loss(loss: Callable, mesh: Mesh, policy: Policy = Policy(), *, keyed: bool = False) -> Callable:
    """``(params, batch) -> (S, n)`` summed over the mesh; differentiable in ``params`` (first order).

    ``keyed``: ``loss(params, batch, key)`` takes a PRNG key (``None`` for no randomness, e.g. no dropout); the
    result is then ``(params, batch, key=None) -> (S, n)`` with ``key`` as key data (replicated, not
    differentiated), and shard ``d`` of the ``data`` axis gets ``fold_in(key, d)``.
    """
    if keyed:
        plain = _global_sum(_local(lambda p, b: loss(p, b, None), policy, batch_axes(mesh)), mesh, 0)
        with_key = _global_sum(_local(loss, policy, batch_axes(mesh)), mesh, 1)

        def total(params, batch, key=None):
            return plain(params, batch) if key is None else with_key(params, batch, key)
        return total
    return _global_sum(_local(loss, policy, batch_axes(mesh)), mesh, 0)


def _global_sum(local: Callable, mesh: Mesh, n_extra: int) -> Callable:
    """``local(params, batch, *extra)`` psummed over the batch axes; the ``n_extra`` trailing arguments are
    replicated and get zero cotangents."""
    axes = batch_axes(mesh)
    rep, dat = PartitionSpec(), PartitionSpec(axes)

    def values(params, batch, *extra):
        s, n = local(params, batch, *extra)
        return jax.lax.psum(s, axes), jax.lax.psum(n, axes)

    def values_and_grads(params, batch, *extra):
        (s, n), g = jax.value_and_grad(local, has_aux=True)(params, batch, *extra)
        return jax.lax.psum(s, axes), jax.lax.psum(n, axes), jax.lax.psum(g, axes)

    # check_vma=False: Pallas calls and custom VJPs do not annotate how their outputs vary over the mesh; the
    # reductions are the explicit psums above.
    in_specs = (rep, dat) + (rep,) * n_extra
    values_sm = jax.shard_map(values, mesh=mesh, in_specs=in_specs, out_specs=(rep, rep), check_vma=False)
    vg_sm = jax.shard_map(values_and_grads, mesh=mesh, in_specs=in_specs, out_specs=(rep, rep, rep),
                          check_vma=False)

    @jax.custom_vjp
    def total(params, batch, *extra):
        return values_sm(params, batch, *extra)

    def fwd(params, batch, *extra):
        s, n, g = vg_sm(params, batch, *extra)
        return (s, n), (g, jax.tree.map(_zero_cotangent, (batch, *extra)))

    def bwd(res, ct):
        g, zeros = res
        ct_s, _ = ct
        return (jax.tree.map(lambda a: (ct_s * a).astype(a.dtype), g), *zeros)

    total.defvjp(fwd, bwd)
    return total


def global_mean_loss(loss: Callable, mesh: Mesh, policy: Policy = Policy()) -> Callable:
    """``(params, batch) -> S / n``: the mean item loss over the whole (sharded) batch."""
    total = global_sum_loss(loss, mesh, policy)

    def mean(params, batch):
        s, n = total(params, batch)
        return s / n.astype(s.dtype)

    return mean


def plan_sum_loss(plan: ShardPlan, mesh: Mesh, policy: Policy = Policy(), *, keyed: bool = False,
                  grad_path: str = "custom_vjp") -> Callable:
    """``((train, frozen), consts, batch[, key]) -> (S, n)`` summed over the mesh for a sharded model (module
    docstring); differentiable in ``train`` (first order). ``train`` / ``frozen``: the params split by the task's
    trainable mask (``None`` at the other part's leaves), laid out as :func:`jaxgrad.train.mesh.param_shardings`
    puts them; ``consts``: ``plan.consts``. ``frozen``, ``consts``, the batch and the key get zero cotangents."""
    loss = plan.loss_for(grad_path)
    axes = batch_axes(mesh)
    rep, dat = PartitionSpec(), PartitionSpec(axes)

    def train_specs_of(train):
        if not plan.shard_trainable:
            return jax.tree.map(lambda _: rep, train)
        return _specs_like(train, plan.param_specs)

    def local(train_full, frozen, consts, batch, *key):
        if key:
            key = (_shard_key(key[0], axes),)
        params = jax.tree.map(lambda t, f: f if t is None else t, train_full, frozen, is_leaf=lambda x: x is None)
        s, n = loss(policy.to_compute(params), consts, policy.to_compute(batch), *key)
        return policy.to_output(jnp.asarray(s)), jnp.asarray(n, jnp.result_type(float))

    def reduce_grad(g, spec):
        axis = spec_axis(spec)
        if axis is None:
            return jax.lax.psum(g, axes)
        g = jax.lax.psum_scatter(g, FSDP_AXIS, scatter_dimension=axis, tiled=True)
        return jax.lax.psum(g, DATA_AXIS) if DATA_AXIS in axes else g

    def build(train_specs, frozen_specs, consts_specs, n_extra):
        in_specs = (train_specs, frozen_specs, consts_specs, dat) + (rep,) * n_extra

        def values(train, frozen, consts, batch, *extra):
            full = _map_present(gather, train, train_specs)
            s, n = local(full, frozen, consts, batch, *extra)
            return jax.lax.psum(s, axes), jax.lax.psum(n, axes)

        def values_and_grads(train, frozen, consts, batch, *extra):
            full = _map_present(gather, train, train_specs)
            (s, n), g = jax.value_and_grad(lambda t: local(t, frozen, consts, batch, *extra), has_aux=True)(full)
            g = _map_present(reduce_grad, g, train_specs)
            return jax.lax.psum(s, axes), jax.lax.psum(n, axes), g

        values_sm = jax.shard_map(values, mesh=mesh, in_specs=in_specs, out_specs=(rep, rep), check_vma=False)
        vg_sm = jax.shard_map(values_and_grads, mesh=mesh, in_specs=in_specs, out_specs=(rep, rep, train_specs),
                              check_vma=False)
        return values_sm, vg_sm

    @jax.custom_vjp
    def total(tf, consts, batch, *extra):
        train, frozen = tf
        values_sm, _ = build(train_specs_of(train), _specs_like(frozen, plan.param_specs),
                             _specs_like(consts, plan.consts_specs), len(extra))
        return values_sm(train, frozen, consts, batch, *extra)

    def fwd(tf, consts, batch, *extra):
        train, frozen = tf
        _, vg_sm = build(train_specs_of(train), _specs_like(frozen, plan.param_specs),
                         _specs_like(consts, plan.consts_specs), len(extra))
        s, n, g = vg_sm(train, frozen, consts, batch, *extra)
        zeros = jax.tree.map(_zero_cotangent, (frozen, consts, batch, *extra))
        return (s, n), (g, zeros)

    def bwd(res, ct):
        g, (z_frozen, z_consts, z_batch, *z_extra) = res
        ct_s, _ = ct
        return ((jax.tree.map(lambda a: (ct_s * a).astype(a.dtype), g), z_frozen), z_consts, z_batch, *z_extra)

    total.defvjp(fwd, bwd)

    def call(tf, consts, batch, *key):
        if keyed and key and key[0] is None:
            key = ()
        return total(tf, consts, batch, *key)
    return call


def _map_present(fn, tree, specs):
    """``fn(leaf, spec)`` over ``tree``'s arrays, ``None`` kept."""
    return jax.tree.map(lambda x, s: None if x is None else fn(x, s), tree, specs, is_leaf=lambda x: x is None)


def _specs_like(tree, specs):
    """``specs`` (a tree of PartitionSpecs over the params or the constants) cut to ``tree``'s leaves (``None``
    where ``tree`` has ``None``: the other part of a trainable / frozen split)."""
    if tree is None:
        return None
    return jax.tree.map(lambda x, s: None if x is None else s, tree, specs, is_leaf=lambda x: x is None)
