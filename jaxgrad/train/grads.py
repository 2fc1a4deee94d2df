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
    def local(params, batch):
        s, n = loss(policy.to_compute(params), policy.to_compute(batch))
        return policy.to_output(jnp.asarray(s)), jnp.asarray(n, jnp.result_type(float))
    return local


def _zero_cotangent(x):
    x = jnp.asarray(x) if not hasattr(x, "dtype") else x
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros(x.shape, x.dtype)
    return np.zeros(x.shape, jax.dtypes.float0)


def global_sum_loss(loss: Callable, mesh: Mesh, policy: Policy = Policy()) -> Callable:
    """``(params, batch) -> (S, n)`` summed over the mesh; differentiable in ``params`` (first order)."""
    local = _local(loss, policy)
    rep, dat = PartitionSpec(), PartitionSpec(DATA_AXIS)

    def values(params, batch):
        s, n = local(params, batch)
        return jax.lax.psum(s, DATA_AXIS), jax.lax.psum(n, DATA_AXIS)

    def values_and_grads(params, batch):
        (s, n), g = jax.value_and_grad(local, has_aux=True)(params, batch)
        return jax.lax.psum(s, DATA_AXIS), jax.lax.psum(n, DATA_AXIS), jax.lax.psum(g, DATA_AXIS)

    # check_vma=False: Pallas calls and custom VJPs do not annotate how their outputs vary over the mesh; the
    # reductions are the explicit psums above.
    values_sm = jax.shard_map(values, mesh=mesh, in_specs=(rep, dat), out_specs=(rep, rep), check_vma=False)
    vg_sm = jax.shard_map(values_and_grads, mesh=mesh, in_specs=(rep, dat), out_specs=(rep, rep, rep),
                          check_vma=False)

    @jax.custom_vjp
    def total(params, batch):
        return values_sm(params, batch)

    def fwd(params, batch):
        s, n, g = vg_sm(params, batch)
        return (s, n), (g, jax.tree.map(_zero_cotangent, batch))

    def bwd(res, ct):
        g, zero_batch = res
        ct_s, _ = ct
        return jax.tree.map(lambda a: (ct_s * a).astype(a.dtype), g), zero_batch

    total.defvjp(fwd, bwd)
    return total


def global_mean_loss(loss: Callable, mesh: Mesh, policy: Policy = Policy()) -> Callable:
    """``(params, batch) -> S / n``: the mean item loss over the whole (sharded) batch."""
    total = global_sum_loss(loss, mesh, policy)

    def mean(params, batch):
        s, n = total(params, batch)
        return s / n.astype(s.dtype)

    return mean
