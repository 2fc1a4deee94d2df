"""KAN (B-spline Kolmogorov-Arnold) layers with a hand-written VJP and fused Pallas kernels.

Functional API (params are plain dicts with efficient-kan's names; networks are lists of them):

* :func:`init`, :func:`kan_linear` (custom VJP; ``backend="xla" | "pallas" | "reference"``),
  :func:`kan_linear_reference` (plain JAX, the oracle);
* :func:`kan_init`, :func:`kan_apply`, :func:`kan_apply_reference` for ``KAN([in, hidden..., out])``;
* :func:`update_grid`, :func:`refine` (and the network versions), :func:`kan_regularization`;
* :func:`from_efficient_kan`, :func:`to_efficient_kan`; :mod:`jaxgrad.kan.nnx` for flax.nnx modules;
  :func:`jaxgrad.kan.plot.plot_activations` (needs matplotlib).
"""

from jaxgrad.kan.convert import from_efficient_kan, to_efficient_kan
from jaxgrad.kan.grid import refine, refine_network, update_grid, update_grids
from jaxgrad.kan.layer import KANConfig, init, kan_linear, kan_linear_reference, trainable_mask
from jaxgrad.kan.network import kan_apply, kan_apply_reference, kan_init
from jaxgrad.kan.regularization import kan_regularization
from jaxgrad.kan.spline import bspline_basis, bspline_basis_derivative, curve_to_coefficients, make_grid

__all__ = ["KANConfig", "bspline_basis", "bspline_basis_derivative", "curve_to_coefficients", "from_efficient_kan",
           "init", "kan_apply", "kan_apply_reference", "kan_init", "kan_linear", "kan_linear_reference",
           "kan_regularization", "make_grid", "refine", "refine_network", "to_efficient_kan", "trainable_mask",
           "update_grid", "update_grids"]
