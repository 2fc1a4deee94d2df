r"""The edges of a KAN on data: each edge's activation, the table of symbolic edges, and the nodes of every layer.

Edge ``(o, i)`` of a layer is :math:`\varphi_{oi}(x) = W_b[o,i]\,\mathrm{silu}(x) + s_{oi} \sum_m w_{oim} B_m(x)`
(pykan's ``postacts``: base branch included; a layer's output is :math:`\sum_i \varphi_{oi}(x_i)` plus its bias).
A symbolic edge ``(layer, out, in)`` adds :math:`c f(a x_i + b) + d` to output ``out`` of ``layer``
(:class:`SymbolicEdges`; :mod:`jaxgrad.kan.symbolic` fits and fixes them). Shared by :mod:`jaxgrad.kan.prune`,
:mod:`jaxgrad.kan.symbolic` and :mod:`jaxgrad.kan.plot`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.kan.layer import check_params, kan_linear_reference
from jaxgrad.kan.network import kan_widths
from jaxgrad.kan.spline import bspline_basis
from jaxgrad.kan.symbolic_fit import SymbolicFunction

__all__ = ["SymbolicEdges", "check_symbolic", "edge_activations", "layer_inputs", "network_layers", "symbolic_term"]


def edge_activations(params: dict[str, jax.Array], x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(phi[n, out, in], spline_part[n, out, in])`` at ``x[n, in]`` (materialised: meant for plotting)."""
    k = check_params(params, x)
    basis = bspline_basis(x, params["grid"], k)  # [n, in, G+k]
    coef = params["spline_weight"] * params["spline_scaler"][..., None]
    spline = jnp.einsum("nim,oim->noi", basis, coef)
    phi = params["base_weight"][None] * jax.nn.silu(x)[:, None, :] + spline
    return phi, spline


_edge_activations_jit = jax.jit(edge_activations)


# ---------------------------------------------------------------------------------------------------------------
# The table of symbolic edges
# ---------------------------------------------------------------------------------------------------------------
@jax.tree_util.register_pytree_node_class
class SymbolicEdges:
    """Symbolic edges ``(layer, out, in, fun)`` (static) with their ``affine[n, 4] = (a, b, c, d)`` (the leaf)."""

    def __init__(self, edges: Sequence[tuple[int, int, int, SymbolicFunction]] = (), affine=None):
        self.edges = tuple((int(l), int(o), int(i), f) for l, o, i, f in edges)
        if affine is None:
            affine = np.zeros((len(self.edges), 4))
        self.affine = affine
        if getattr(affine, "shape", None) != (len(self.edges), 4):
            raise ValueError(f"SymbolicEdges: 'affine' must have shape ({len(self.edges)}, 4) (a, b, c, d per edge), "
                             f"got {getattr(affine, 'shape', type(affine).__name__)}")
        if len({e[:3] for e in self.edges}) != len(self.edges):
            raise ValueError("SymbolicEdges: an edge (layer, out, in) appears twice")

    def tree_flatten(self):
        return (self.affine,), self.edges

    @classmethod
    def tree_unflatten(cls, edges, children):
        obj = cls.__new__(cls)
        obj.edges, obj.affine = edges, children[0]
        return obj

    def index(self, layer: int, out: int, inp: int) -> int | None:
        """Row of edge ``(layer, out, inp)`` in ``affine``, or ``None``."""
        for k, (l, o, i, _) in enumerate(self.edges):
            if (l, o, i) == (layer, out, inp):
                return k
        return None

    def formulas(self, digits: int = 4) -> dict[tuple[int, int, int], str]:
        """``{(layer, out, in): "c*f(a*x + b) + d"}`` with the current affine values."""
        aff = np.asarray(self.affine, dtype=np.float64)
        return {(l, o, i): f.formula(*aff[k], var=f"x{l}_{i}", digits=digits)
                for k, (l, o, i, f) in enumerate(self.edges)}

    def __repr__(self):
        return f"SymbolicEdges({list(self.formulas().values())})"


def network_layers(params) -> list[dict[str, jax.Array]]:
    """``params`` as a list of layer dicts (one dict is a one-layer network), after checking that they chain."""
    layers = [params] if isinstance(params, dict) else list(params)
    kan_widths(layers)
    return layers


def check_symbolic(symbolic, layers) -> SymbolicEdges:
    """``symbolic`` (``None``: an empty table) after checking that its edges exist in ``layers``."""
    if symbolic is None:
        return SymbolicEdges()
    if not isinstance(symbolic, SymbolicEdges):
        raise TypeError(f"'symbolic' must be a SymbolicEdges table (or None), got {type(symbolic).__name__}")
    for l, o, i, _ in symbolic.edges:
        if not 0 <= l < len(layers) or not (0 <= o < layers[l]["base_weight"].shape[0]
                                            and 0 <= i < layers[l]["base_weight"].shape[1]):
            raise ValueError(f"'symbolic' has edge (layer={l}, out={o}, in={i}), which the params do not have "
                             f"(widths {kan_widths(layers)})")
    return symbolic


def symbolic_term(symbolic: SymbolicEdges, layer: int, x: jax.Array, out_f: int) -> jax.Array | None:
    """``sum_e c f(a x_i + b) + d`` into output ``o`` for the edges of ``layer``: ``[..., out_f]`` or ``None``."""
    rows = [(k, o, i, f) for k, (l, o, i, f) in enumerate(symbolic.edges) if l == layer]
    if not rows:
        return None
    aff = jnp.asarray(symbolic.affine)
    cols = []
    for k, _, i, f in rows:
        a, b, c, d = aff[k, 0], aff[k, 1], aff[k, 2], aff[k, 3]
        cols.append(c * f.fn(a * x[..., i] + b, jnp) + d)
    onehot = np.zeros((len(rows), out_f))
    onehot[np.arange(len(rows)), [o for _, o, _, _ in rows]] = 1.0
    vals = jnp.stack(cols, axis=-1)
    return vals @ jnp.asarray(onehot, vals.dtype)


def layer_inputs(params, x: jax.Array, symbolic: SymbolicEdges | None = None) -> list[jax.Array]:
    """``[x^(0), ..., x^(L)]``: the nodes of every layer on the data ``x[n, in]`` (reference forward, jitted)."""
    layers = network_layers(params)
    symbolic = check_symbolic(symbolic, layers)
    for p in layers:
        check_params(p)  # the knot values too, which jit cannot see
    x = jnp.asarray(x)
    if x.ndim < 1 or x.shape[-1] != layers[0]["base_weight"].shape[1]:
        raise ValueError(f"'x' must have shape [n, {layers[0]['base_weight'].shape[1]}] (the network's inputs), got "
                         f"{tuple(x.shape)}")
    return _layer_inputs_jit(layers, x.reshape(-1, x.shape[-1]), symbolic)


@jax.jit
def _layer_inputs_jit(layers, h, symbolic):
    out = [h]
    for l, p in enumerate(layers):
        y = kan_linear_reference(p, h)
        extra = symbolic_term(symbolic, l, h, y.shape[-1])
        h = y if extra is None else y + extra.astype(y.dtype)
        out.append(h)
    return out
