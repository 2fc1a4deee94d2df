"""KAN (B-spline Kolmogorov-Arnold) layers with a hand-written VJP and fused Pallas kernels.

Functional API (params are plain dicts with efficient-kan's names; networks are lists of them):

* :func:`init`, :func:`kan_linear` (custom VJP; ``backend="xla" | "pallas" | "reference"``),
  :func:`kan_linear_reference` (plain JAX, the oracle);
* :func:`kan_init`, :func:`kan_apply`, :func:`kan_apply_reference` for ``KAN([in, hidden..., out])``;
* :func:`update_grid`, :func:`refine` (and the network versions), :func:`kan_regularization`;
* :func:`from_efficient_kan`, :func:`to_efficient_kan`; :mod:`jaxgrad.kan.nnx` for flax.nnx modules;
  :func:`jaxgrad.kan.plot.plot_activations` (needs matplotlib);
* :func:`trainable_mask` (``False`` for the knot grids) of a layer dict or of a network's list of them;
* pykan's workflow: :func:`create_dataset`, :func:`dataset_from_file` (CSV / NPY / NPZ), :func:`fit` (the training
  engine on a dataset), :class:`Standardizer` (imported on first use: they load the training engine);
* interpretability, as pykan defines it: :func:`attribution`, :func:`prune_nodes`, :func:`prune_edges` and
  ``jaxgrad.kan.prune.prune`` (both at once; the module's name, so not re-exported here);
  :func:`suggest_symbolic`, :func:`fix_symbolic`, :func:`auto_symbolic`, :func:`kan_apply_symbolic`
  (:mod:`jaxgrad.kan.symbolic`); :func:`jaxgrad.kan.plot.plot_network` (imported on first use).

``init(key, cfg)`` takes a :class:`KANConfig` (one layer); ``init(key, 4, 3)`` is refused with the two spellings
that mean it (``init(key, KANConfig(4, 3))``, ``kan_init(key, [4, 3])``): the third positional argument is the
dtype, so reading it as a width would be a silent guess.
"""

from jaxgrad.kan.convert import from_efficient_kan, to_efficient_kan
from jaxgrad.kan.grid import refine, refine_network, update_grid, update_grids
from jaxgrad.kan.layer import INITS, KANConfig, init, kan_linear, kan_linear_reference
from jaxgrad.kan.network import kan_apply, kan_apply_reference, kan_init, trainable_mask
from jaxgrad.kan.regularization import kan_regularization
from jaxgrad.kan.spline import bspline_basis, bspline_basis_derivative, curve_to_coefficients, make_grid

_LAZY = {"create_dataset": "jaxgrad.kan.data", "dataset_from_file": "jaxgrad.kan.data",
         "read_table": "jaxgrad.kan.data", "Standardizer": "jaxgrad.kan.data", "fit": "jaxgrad.kan.fitting",
         **{name: "jaxgrad.kan.prune" for name in ("Attribution", "Pruned", "apply_edge_masks", "attribution",
                                                   "freeze_edges", "prune_edges", "prune_nodes")},
         **{name: "jaxgrad.kan.symbolic" for name in ("Suggestion", "SymbolicEdges", "auto_symbolic", "fix_symbolic",
                                                      "kan_apply_symbolic", "numerical_edge_masks",
                                                      "suggest_symbolic", "unfix_symbolic")},
         **{name: "jaxgrad.kan.symbolic_fit" for name in ("DEFAULT_LIBRARY", "SYMBOLIC_LIBRARY", "fit_affine")}}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxgrad.kan' has no attribute {name!r}")


__all__ = ["Attribution", "DEFAULT_LIBRARY", "Pruned", "SYMBOLIC_LIBRARY", "Suggestion", "SymbolicEdges",
           "apply_edge_masks", "attribution", "auto_symbolic", "INITS", "KANConfig", "Standardizer", "bspline_basis", "bspline_basis_derivative", "create_dataset",
           "curve_to_coefficients", "dataset_from_file", "fit", "from_efficient_kan", "init", "kan_apply",
           "kan_apply_reference", "kan_init", "kan_linear", "kan_linear_reference", "kan_regularization", "make_grid",
           "read_table", "refine", "refine_network", "to_efficient_kan", "trainable_mask", "update_grid",
           "update_grids", "fit_affine", "fix_symbolic", "freeze_edges", "kan_apply_symbolic",
           "numerical_edge_masks", "prune_edges", "prune_nodes", "suggest_symbolic", "unfix_symbolic"]
