r"""Fused Pallas kernels for the spline part of a KAN layer: forward, coefficient gradient and input gradient.

Notation: ``x[B, in]``, knots ``grid[in, G+2k+1]`` (one non-decreasing row per input; uniform or not),
coefficients ``coef[out, in, G+k]`` (efficient-kan's ``spline_weight`` layout, scaler already folded in),
``k = spline_order`` (the degree), ``NB = G + k`` bases per input, :math:`B_m` the Cox-de Boor bases of
:mod:`jaxgrad.kan.spline` and :math:`B'_m` their derivative.

.. math::

    y[b, o] &= \sum_i \sum_m B_m(x_{bi})\, c[o, i, m]                                     && \text{(forward)} \\
    \bar c[o, i, m] &= \sum_b \bar y[b, o]\, B_m(x_{bi})                                  && \text{(dcoef)} \\
    \bar x[b, i] &= \sum_m B'_m(x_{bi}) \sum_o \bar y[b, o]\, c[o, i, m]                  && \text{(dx)} \\
    B'^{\,k}_m &= k \left[\frac{B^{k-1}_m}{t_{m+k} - t_m}
                 - \frac{B^{k-1}_{m+1}}{t_{m+k+1} - t_{m+1}}\right]

(a zero-width knot interval contributes 0 instead of dividing by zero, as in :mod:`jaxgrad.kan.spline`).

**No basis tensor in HBM.** Every kernel evaluates the bases of its ``[bb, bk]`` tile of ``x`` in registers and
feeds them straight to the matrix units; the ``[B, in, NB]`` tensor that autodiff would tape is never written.

The kernels are split along that design (every public name is importable from here):

* :mod:`jaxgrad.kan.basis_tiles`: the bases of a tile (the diagonal Cox-de Boor sweep over per-column knot tables)
  interleaved into one wide contraction operand ``A[bb, bk * nbp]``, and the tile geometry;
* :mod:`jaxgrad.kan.forward_kernel`: :func:`kan_spline_forward`;
* :mod:`jaxgrad.kan.backward_kernels`: :func:`kan_spline_dcoef`, :func:`kan_spline_dx` and
  :func:`kan_spline_backward` (both);
* :mod:`jaxgrad.kan.kernel_config`: the default tiles per precision (:data:`FWD_DEFAULTS`,
  :data:`DCOEF_DEFAULTS`, :data:`DX_DEFAULTS`, :data:`EXACT_F32_DEFAULTS`), the argument checks and the dtype
  policy;
* this module: the plain-JAX references (the tests' oracle).

**Where the time goes** (H100, f32 with TF32 dots, ``B=16384, in=out=512, G=5, k=3``;
``benchmarks/logs/kan-wide-probe-ablation-nvidia-h100-80gb-hbm3-tf32-20261123-020930.log``): the forward with
the bases replaced by a copy of ``x`` (dots and layout only) takes 0.61 ms, ~110 TFLOP/s, against a TF32 floor of
0.14 ms; with the dot replaced by a row sum (bases and layout only) it takes 0.62 ms. Both halves
are far from their floors and they only partly overlap: Triton's software pipeline does not overlap the
register-computed operand with the previous ``wgmma``. Reaching the TF32 floor needs warp-specialised kernels
(producer warps computing bases into shared memory while consumer warps issue ``wgmma``), i.e. Mosaic GPU.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxgrad.kan.backward_kernels import kan_spline_backward, kan_spline_dcoef, kan_spline_dx
from jaxgrad.kan.forward_kernel import kan_spline_forward
from jaxgrad.kan.kernel_config import DCOEF_DEFAULTS, DX_DEFAULTS, EXACT_F32_DEFAULTS, FWD_DEFAULTS
from jaxgrad.kan.spline import bspline_basis, bspline_basis_derivative

__all__ = [
    "DCOEF_DEFAULTS",
    "DX_DEFAULTS",
    "FWD_DEFAULTS",
    "EXACT_F32_DEFAULTS",
    "kan_spline_backward",
    "kan_spline_backward_reference",
    "kan_spline_dcoef",
    "kan_spline_dx",
    "kan_spline_forward",
    "kan_spline_forward_reference",
]


def kan_spline_forward_reference(x, grid, coef, spline_order, *, precision=None):
    """``einsum('bim,oim->bo', bspline_basis(x), coef)``: materialises the ``[B, in, NB]`` basis."""
    phi = bspline_basis(x, grid, spline_order)
    return jnp.einsum("bim,oim->bo", phi, coef.astype(phi.dtype), precision=precision)


def kan_spline_backward_reference(x, grid, coef, g, spline_order, *, precision=None):
    """``(dx, dcoef)`` by the equations of the module docstring, in plain JAX."""
    phi = bspline_basis(x, grid, spline_order)
    dphi = bspline_basis_derivative(x, grid, spline_order)
    g = g.astype(phi.dtype)
    dcoef = jnp.einsum("bo,bim->oim", g, phi, precision=precision)
    h = jnp.einsum("bo,oim->bim", g, coef.astype(phi.dtype), precision=precision)
    return (dphi * h).sum(-1), dcoef
