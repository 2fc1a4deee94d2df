"""KAN (B-spline Kolmogorov-Arnold) layers with a hand-written VJP and fused Pallas kernels."""

from jaxgrad.kan.layer import KANConfig, init, kan_linear_reference, trainable_mask
from jaxgrad.kan.spline import bspline_basis, bspline_basis_derivative, curve_to_coefficients, make_grid

__all__ = ["KANConfig", "bspline_basis", "bspline_basis_derivative", "curve_to_coefficients", "init",
           "kan_linear_reference", "make_grid", "trainable_mask"]
