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
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxgrad.train.mesh import DATA_AXIS
from jaxgrad.train.precision import Policy


def _local(loss: Callable, policy: Policy) -> Callable:
    def local(params, batch, *key):
        if key:  # key data, replicated: each shard draws its own numbers, fold_in(key, shard index)
            key = (jax.random.fold_in(jax.random.wrap_key_data(key[0]), jax.lax.axis_index(DATA_AXIS)),)
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
        plain = _global_sum(_local(lambda p, b: loss(p, b, None), policy), mesh, 0)
        with_key = _global_sum(_local(loss, policy), mesh, 1)

        def total(params, batch, key=None):
            return plain(params, batch) if key is None else with_key(params, batch, key)
        return total
    return _global_sum(_local(loss, policy), mesh, 0)


def _global_sum(local: Callable, mesh: Mesh, n_extra: int) -> Callable:
    """``local(params, batch, *extra)`` psummed over ``data``; the ``n_extra`` trailing arguments are replicated
    and get zero cotangents."""
    rep, dat = PartitionSpec(), PartitionSpec(DATA_AXIS)

    def values(params, batch, *extra):
        s, n = local(params, batch, *extra)
        return jax.lax.psum(s, DATA_AXIS), jax.lax.psum(n, DATA_AXIS)

    def values_and_grads(params, batch, *extra):
        (s, n), g = jax.value_and_grad(local, has_aux=True)(params, batch, *extra)
        return jax.lax.psum(s, DATA_AXIS), jax.lax.psum(n, DATA_AXIS), jax.lax.psum(g, DATA_AXIS)

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
