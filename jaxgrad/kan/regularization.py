r"""KAN regularisers: pykan's sample-based one (``reg_metric='edge_forward_spline_n'``) without the
``[B, in, out]`` activation tensor, and efficient-kan's weight-based ``regularization_loss``.

pykan's per-edge scale
----------------------
pykan (``MultKAN.forward`` with ``save_act=True``) stores, for every layer, the ``[out, in]`` matrix

.. math::

    v_{oi} = \frac{\operatorname{std}_b \varphi_{oi}(x_{bi})}{\operatorname{std}_b x_{bi} + 0.1}

(``torch.std``: unbiased, ``n - 1``). For ``edge_forward_spline_n`` the activation is pykan's
``postacts_numerical``, the output of ``KANLayer.forward``: ``scale_base * silu(x) + scale_sp * spline(x)``, i.e.
the whole *numerical* edge (base branch included); "spline" in pykan's comment means numerical as opposed to
symbolic. In our (efficient-kan) parametrisation that is

.. math::

    \varphi_{oi}(x) = W_b[o,i]\,\operatorname{silu}(x) + s_{oi} \sum_m w_{oim} B_m(x).

``include_base=False`` drops the first term (spline-only edges). ``MultKAN.reg`` then adds, per layer,

.. math::

    \lambda_{l1} \sum_{oi} v_{oi}
    + \lambda_{ent} (H_{row} + H_{col})
    + \lambda_{coef} \sum_{i,m} \operatorname{mean}_o |w_{oim}|
    + \lambda_{coefdiff} \sum_{i,m} \operatorname{mean}_o |w_{oi,m+1} - w_{oim}|

with :math:`p^{row}_{oi} = v_{oi} / (\sum_{i'} v_{oi'} + 1)`,
:math:`H_{row} = -\operatorname{mean}_o \sum_i p^{row}_{oi} \log_2(p^{row}_{oi} + 10^{-4})`, and the column terms
with the roles of ``o`` and ``i`` swapped. (pykan's ``coef`` is ``[in, out, G+k]`` and the ``mean`` is over ``out``;
we use the unscaled ``spline_weight`` in its place.)

The variance identity (no ``[B, in, out]`` tensor)
------------------------------------------------
Each edge is linear in a per-*input* feature vector: with
:math:`F_i(x) = [\operatorname{silu}(x), B_1(x), \dots, B_{G+k}(x)] \in \mathbb{R}^{K}` and
:math:`a_{oi} = [W_b[o,i], s_{oi} w_{oi1}, \dots, s_{oi} w_{oi,G+k}]`, :math:`\varphi_{oi}(x) = a_{oi}^\top F_i(x)`,
so

.. math::

    \operatorname{Var}_b[\varphi_{oi}(x_{bi})] = a_{oi}^\top \, \Sigma_i \, a_{oi}, \qquad
    \Sigma_i = \operatorname{Cov}_b[F_i(x_{bi})] = \frac{1}{B-1} \sum_b (F_{bi} - \bar F_i)(F_{bi} - \bar F_i)^\top .

This needs the ``[B, in, K]`` features (the size of the basis tensor any KAN forward builds), the
``[in, K, K]`` covariances and an ``[out, in]`` quadratic form: ``O(B in K^2 + out in K^2)`` work and no
``[B, in, out]`` tensor, where pykan materialises ``[B, out, in]`` three times. The features are centred before
the product, so there is no ``E[x^2] - E[x]^2`` cancellation. The square root is taken with a zero-safe
gradient (a constant edge has ``v = 0`` and gradient 0 instead of NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxgrad.kan.layer import check_params, kan_linear_reference
from jaxgrad.kan.spline import bspline_basis

__all__ = ["edge_scale", "edge_scale_materialized", "efficient_kan_regularization_loss", "kan_regularization",
           "layer_regularization", "regularization_loss"]

_INPUT_EPS = 0.1


def _safe_sqrt(v):
    """``sqrt(max(v, 0))`` with gradient 0 (not NaN) at ``v <= 0``; a NaN ``v`` stays NaN (never read as 0)."""
    pos = v > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, v, 1.0)), jnp.where(jnp.isnan(v), v, 0.0))


def _features_and_coefs(params, x, include_base):
    k = check_params(params, x)
    grid = jax.lax.stop_gradient(params["grid"])
    feats = bspline_basis(x, grid, k)  # [B, in, G+k]
    coef = params["spline_weight"] * params["spline_scaler"][..., None]  # [out, in, G+k]
    if include_base:
        feats = jnp.concatenate([jax.nn.silu(x)[..., None], feats], axis=-1)
        coef = jnp.concatenate([params["base_weight"][..., None], coef], axis=-1)
    return feats, coef


def _std_unbiased(x, axis=0):
    n = x.shape[axis]
    xc = x - jnp.mean(x, axis=axis, keepdims=True)
    return _safe_sqrt(jnp.sum(xc * xc, axis=axis) / max(n - 1, 1))


def edge_scale(params: dict[str, jax.Array], x: jax.Array, *, include_base: bool = True) -> jax.Array:
    """pykan's ``acts_scale_spline`` for one layer: ``v[out, in]``, by the covariance identity (module docstring).

    ``x``: ``[B, in]`` (or ``[..., in]``, flattened) inputs of the layer.
    """
    x = x.reshape(-1, x.shape[-1])
    n = x.shape[0]
    feats, coef = _features_and_coefs(params, x, include_base)  # [B, in, K], [out, in, K]
    fc = feats - jnp.mean(feats, axis=0, keepdims=True)
    cov = jnp.einsum("bik,bil->ikl", fc, fc) / max(n - 1, 1)  # [in, K, K]
    var = jnp.einsum("oik,ikl,oil->oi", coef, cov, coef)
    std_phi = _safe_sqrt(var)
    return std_phi / (_std_unbiased(x)[None, :] + _INPUT_EPS)


def edge_scale_materialized(params: dict[str, jax.Array], x: jax.Array, *, include_base: bool = True) -> jax.Array:
    """The same ``v[out, in]`` from the materialised ``[B, in, out]`` edge activations (test oracle)."""
    x = x.reshape(-1, x.shape[-1])
    feats, coef = _features_and_coefs(params, x, include_base)
    phi = jnp.einsum("bik,oik->bio", feats, coef)  # [B, in, out]
    return _std_unbiased(phi).T / (_std_unbiased(x)[None, :] + _INPUT_EPS)


def _entropy_terms(v):
    p_row = v / (jnp.sum(v, axis=1, keepdims=True) + 1)
    p_col = v / (jnp.sum(v, axis=0, keepdims=True) + 1)
    h_row = -jnp.mean(jnp.sum(p_row * jnp.log2(p_row + 1e-4), axis=1))
    h_col = -jnp.mean(jnp.sum(p_col * jnp.log2(p_col + 1e-4), axis=0))
    return h_row + h_col


def layer_regularization(params: dict[str, jax.Array], x: jax.Array, *, lamb_l1: float = 1.0,
                         lamb_entropy: float = 2.0, lamb_coef: float = 0.0, lamb_coefdiff: float = 0.0,
                         include_base: bool = True, materialize: bool = False) -> jax.Array:
    """pykan's ``MultKAN.reg`` terms for one layer with inputs ``x`` (defaults: pykan ``fit``'s lambdas)."""
    v = (edge_scale_materialized if materialize else edge_scale)(params, x, include_base=include_base)
    reg = lamb_l1 * jnp.sum(v) + lamb_entropy * _entropy_terms(v)
    w = params["spline_weight"]
    reg = reg + lamb_coef * jnp.sum(jnp.mean(jnp.abs(w), axis=0))
    reg = reg + lamb_coefdiff * jnp.sum(jnp.mean(jnp.abs(jnp.diff(w, axis=-1)), axis=0))
    return reg


def kan_regularization(net_params: Sequence[dict[str, jax.Array]] | dict[str, jax.Array], x: jax.Array, *,
                       lamb_l1: float = 1.0, lamb_entropy: float = 2.0, lamb_coef: float = 0.0,
                       lamb_coefdiff: float = 0.0, include_base: bool = True,
                       materialize: bool = False) -> jax.Array:
    """pykan's sample-based regulariser for a network: ``x`` is propagated through the layers
    (``kan_linear_reference``) and :func:`layer_regularization` is summed over layers. Multiply by pykan's ``lamb``
    and add to the data loss.

    Non-finite values propagate: a NaN or Inf in ``x`` or in the params makes the result NaN (as pykan's
    ``torch.std``-based ``reg`` does), never a silent 0, so a diverged model shows in the loss. It does not raise,
    because the regulariser normally runs inside a jitted loss where values are unknown; run with
    ``jax.config.update("jax_debug_nans", True)`` to find where the NaN starts."""
    layers = [net_params] if isinstance(net_params, dict) else list(net_params)
    h = x.reshape(-1, x.shape[-1])
    total = jnp.zeros((), h.dtype)
    for p in layers:
        total = total + layer_regularization(p, h, lamb_l1=lamb_l1, lamb_entropy=lamb_entropy, lamb_coef=lamb_coef,
                                             lamb_coefdiff=lamb_coefdiff, include_base=include_base,
                                             materialize=materialize)
        h = kan_linear_reference(p, h)
    return total


def _xlogx(p):
    pos = p > 0
    return jnp.where(pos, p * jnp.log(jnp.where(pos, p, 1.0)), 0.0)


def regularization_loss(params: dict[str, jax.Array] | Sequence[dict[str, jax.Array]],
                        regularize_activation: float = 1.0, regularize_entropy: float = 1.0) -> jax.Array:
    """efficient-kan's weight-based ``regularization_loss`` (summed over layers for a list).

    ``l1[o, i] = mean_m |spline_weight[o, i, m]|``, ``p = l1 / sum(l1)``,
    ``loss = regularize_activation * sum(l1) - regularize_entropy * sum(p log p)`` (natural log; ``0 log 0 = 0``,
    where efficient-kan would return NaN for an all-zero layer).
    """
    layers = [params] if isinstance(params, dict) else list(params)
    total = 0.0
    for p in layers:
        l1 = jnp.mean(jnp.abs(p["spline_weight"]), axis=-1)
        s = jnp.sum(l1)
        prob = l1 / jnp.where(s > 0, s, 1.0)
        total = total + regularize_activation * s - regularize_entropy * jnp.sum(_xlogx(prob))
    return jnp.asarray(total)


efficient_kan_regularization_loss = regularization_loss
