r"""Symbolic edges for a KAN (pykan's ``suggest_symbolic`` / ``fix_symbolic`` / ``auto_symbolic``), as pure
functions over the params list.

Suggestion. Edge ``(l, o, i)`` (layer ``l``, input ``i``, output ``o``) computes
:math:`\varphi_{oi}(u) = W_b[o,i]\,\mathrm{silu}(u) + s_{oi}\sum_m w_{oim} B_m(u)`. Its input ``u`` is node ``i`` of
layer ``l``: the data ``x`` propagated through layers ``0 .. l-1``. The edge is sampled at ``num`` points spread
uniformly over that input's range on the data, ``[min_n u_n, max_n u_n]``, and every library function is fitted as
:math:`c\,f(a u + b) + d` by :func:`jaxgrad.kan.symbolic_fit.fit_affine` (pykan's grid search over ``(a, b)`` then
least squares for ``(c, d)``, domains respected). The suggestions come back best first: by :math:`R^2`, where
candidates within ``r2_tol`` of the best remaining one count as a tie and go simplest first (pykan's complexity,
then library order). A tie is real, not only rounding: other families contain limits of the true one.
:math:`e^{-(a u + b)^2}` near its peak is a parabola (on the ``y`` edge of a trained ``exp(sin(pi x) + y^2)``
network ``gaussian`` scores :math:`1 - R^2 = 7.7 \cdot 10^{-7}` against ``x^2``'s :math:`1.9 \cdot 10^{-6}`), and
:math:`\tanh` far in its lower tail is :math:`-1 + 2 e^{2(a u + b)}` (on the output edge ``tanh`` ties or beats
``exp`` on some seeds); ranked by :math:`R^2` alone, the simpler true function would lose to noise.

Fixing. A fixed edge lives in a :class:`SymbolicEdges` table next to the params: per edge its place
``(layer, out, in)``, its :class:`~jaxgrad.kan.symbolic_fit.SymbolicFunction` (static) and the trainable
``affine[e] = (a, b, c, d)``. :func:`fix_symbolic` zeroes the numerical edge in the params (``base_weight[o, i]``,
``spline_weight[o, i, :]``, ``spline_scaler[o, i]``), and :func:`kan_apply_symbolic` adds the table's edges to each
layer's output:

.. math::

    x^{(l+1)}_o = \mathrm{KANLinear}_l(x^{(l)})_o + \sum_{e = (l, o, i)} c_e\, f_e(a_e x^{(l)}_i + b_e) + d_e .

The table is a pytree (the edges are static aux data, ``affine`` the one leaf), so ``jit``, ``grad`` and optax see
``(params, symbolic)`` as ordinary parameters. Gradients: plain autodiff through :math:`c f(a u + b) + d`
(:math:`\partial/\partial a = c f'(a u + b) u`, :math:`\partial/\partial b = c f'`, :math:`\partial/\partial c = f`,
:math:`\partial/\partial d = 1`, :math:`\partial/\partial u = c a f'`), and the layer's own VJP for the numerical
part. A zeroed numerical edge keeps ``spline_weight`` and ``spline_scaler`` at zero under optimisers whose update
of a zero gradient is zero (SGD, Adam, AdamW: each one's gradient has the other as a factor), but ``base_weight[o, i]``'s gradient :math:`g^\top
\mathrm{silu}(u)` is not zero: mask it with :func:`jaxgrad.kan.prune.freeze_edges` and
:func:`numerical_edge_masks`. Outside a function's domain (a later input leaving the fitted range of ``log``,
``sqrt``, ``1/x``, ...) the forward returns what ``jax.numpy`` returns (NaN or inf), never a clipped value.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.kan.edges import (SymbolicEdges, _edge_activations_jit, check_symbolic, layer_inputs, network_layers,
                               symbolic_term)
from jaxgrad.kan.layer import kan_linear
from jaxgrad.kan.symbolic_fit import SYMBOLIC_LIBRARY, SymbolicFunction, fit_affine, library

# SymbolicEdges and layer_inputs live in jaxgrad.kan.edges (shared with prune and plot) and are re-exported here
__all__ = ["Suggestion", "SymbolicEdges", "auto_symbolic", "edge_samples", "fix_symbolic", "kan_apply_symbolic",
           "layer_inputs", "numerical_edge_masks", "suggest_symbolic", "unfix_symbolic"]


# ---------------------------------------------------------------------------------------------------------------
# The forward with symbolic edges
# ---------------------------------------------------------------------------------------------------------------
def kan_apply_symbolic(params, symbolic: SymbolicEdges | None, x: jax.Array, *, backend: str = "xla",
                       precision=None, interpret: bool | None = None) -> jax.Array:
    """``KAN(widths)(x)`` with the symbolic edges of ``symbolic`` added to each layer (module docstring); with
    ``symbolic=None`` or an empty table, exactly :func:`jaxgrad.kan.network.kan_apply`."""
    layers = network_layers(params)
    symbolic = check_symbolic(symbolic, layers)
    for l, p in enumerate(layers):
        y = kan_linear(p, x, backend=backend, precision=precision, interpret=interpret)
        extra = symbolic_term(symbolic, l, x, y.shape[-1])
        x = y if extra is None else y + extra.astype(y.dtype)
    return x


def numerical_edge_masks(params, symbolic: SymbolicEdges | None) -> list[np.ndarray]:
    """Per layer ``bool[out, in]``: ``False`` on the edges ``symbolic`` holds (their numerical part must stay zero),
    for :func:`jaxgrad.kan.prune.freeze_edges` (combine with pruning masks by ``&``)."""
    layers = network_layers(params)
    symbolic = check_symbolic(symbolic, layers)
    masks = [np.ones(p["base_weight"].shape, bool) for p in layers]
    for l, o, i, _ in symbolic.edges:
        masks[l][o, i] = False
    return masks


# ---------------------------------------------------------------------------------------------------------------
# Suggestions
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One candidate for an edge: ``c * fun(a u + b) + d`` and its ``r2`` on the edge's samples."""

    name: str
    r2: float
    a: float
    b: float
    c: float
    d: float
    complexity: int
    fun: SymbolicFunction

    @property
    def affine(self) -> tuple[float, float, float, float]:
        return (self.a, self.b, self.c, self.d)

    def formula(self, var: str = "x", digits: int = 4) -> str:
        return self.fun.formula(self.a, self.b, self.c, self.d, var=var, digits=digits)


def _edge_index(layers, edge):
    if not (isinstance(edge, (tuple, list)) and len(edge) == 3
            and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in edge)):
        raise TypeError(f"'edge' must be a triple of ints (layer, out, in), got {edge!r}")
    l, o, i = (int(v) for v in edge)
    if not 0 <= l < len(layers):
        raise ValueError(f"'edge' layer {l} is out of range: the network has {len(layers)} layers")
    out_f, in_f = layers[l]["base_weight"].shape
    if not (0 <= o < out_f and 0 <= i < in_f):
        raise ValueError(f"'edge' ({l}, {o}, {i}): layer {l} has out in 0..{out_f - 1} and in in 0..{in_f - 1}")
    return l, o, i


def _check_num(num):
    if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or num < 3:
        raise ValueError(f"'num' (samples per edge) must be an int >= 3, got {num!r}")
    return int(num)


def edge_samples(params, x: jax.Array, edge, *, num: int = 100, symbolic: SymbolicEdges | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``(u[num], phi(u)[num])``: edge ``(layer, out, in)``'s numerical activation at ``num`` points spread
    uniformly over its input's range on the data ``x`` (float64 NumPy)."""
    layers = network_layers(params)
    l, o, i = _edge_index(layers, edge)
    num = _check_num(num)
    h = np.asarray(layer_inputs(layers, x, symbolic)[l])
    if not np.isfinite(h).all():
        raise ValueError(f"edge_samples: the inputs of layer {l} on 'x' are not all finite")
    lo, hi = h.min(axis=0), h.max(axis=0)
    grid = np.linspace(0.0, 1.0, num)[:, None] * (hi - lo)[None, :] + lo[None, :]  # [num, in]
    p = layers[l]
    phi, _ = _edge_activations_jit(p, jnp.asarray(grid, dtype=p["spline_weight"].dtype))
    return grid[:, i].astype(np.float64), np.asarray(phi[:, o, i], dtype=np.float64)


def _rank(cands: list[Suggestion], order: dict[str, int], r2_tol: float) -> list[Suggestion]:
    """Best first: take the best remaining R^2; everything within ``r2_tol`` of it is a tie, simplest first."""
    finite = sorted((s for s in cands if np.isfinite(s.r2)), key=lambda s: -s.r2)
    out = []
    while finite:
        top = finite[0].r2
        tie = [s for s in finite if s.r2 >= top - r2_tol]
        finite = [s for s in finite if s.r2 < top - r2_tol]
        out.extend(sorted(tie, key=lambda s: (s.complexity, order[s.name])))
    return out + [s for s in cands if not np.isfinite(s.r2)]


def suggest_symbolic(params, x: jax.Array, edge, *, lib=None, num: int = 100, a_range=(-10.0, 10.0),
                     b_range=(-10.0, 10.0), grid_number: int = 101, iterations: int = 3, r2_tol: float = 1e-4,
                     symbolic: SymbolicEdges | None = None) -> list[Suggestion]:
    """Fit every function of ``lib`` (names; default :data:`~jaxgrad.kan.symbolic_fit.DEFAULT_LIBRARY`) to edge
    ``(layer, out, in)`` on the data ``x`` and return the candidates best first (module docstring). A candidate
    with no admissible ``(a, b)`` has ``r2 = nan`` and comes last. An edge that is constant on the data (a pruned
    or zeroed edge) gets the single suggestion ``"0"`` (``c = 0``, ``d`` = the constant, ``r2 = 1``).

    ``a_range``, ``b_range``, ``grid_number``, ``iterations``: pykan's ``fit_params`` settings (its defaults).
    """
    if not (isinstance(r2_tol, (int, float)) and not isinstance(r2_tol, bool) and 0 <= r2_tol < 1):
        raise ValueError(f"suggest_symbolic: 'r2_tol' must be a number in [0, 1), got {r2_tol!r}")
    funs = library(lib)
    u, y = edge_samples(params, x, edge, num=num, symbolic=symbolic)
    if np.ptp(y) == 0.0:
        zero = SYMBOLIC_LIBRARY["0"]
        return [Suggestion("0", 1.0, 1.0, 0.0, 0.0, float(y[0]), zero.complexity, zero)]
    cands = []
    for name, f in funs.items():
        fit = fit_affine(u, y, f, a_range=a_range, b_range=b_range, grid_number=grid_number, iterations=iterations)
        cands.append(Suggestion(name, fit.r2, fit.a, fit.b, fit.c, fit.d, f.complexity, f))
    return _rank(cands, {n: k for k, n in enumerate(funs)}, float(r2_tol))


# ---------------------------------------------------------------------------------------------------------------
# Fixing edges
# ---------------------------------------------------------------------------------------------------------------
def _zero_edge(p, o, i):
    q = dict(p)
    q["base_weight"] = p["base_weight"].at[o, i].set(0)
    q["spline_weight"] = p["spline_weight"].at[o, i, :].set(0)
    q["spline_scaler"] = p["spline_scaler"].at[o, i].set(0)
    return q


def fix_symbolic(params, symbolic: SymbolicEdges | None, edge, fun, *, x: jax.Array | None = None, **fit_kwargs):
    """Make edge ``(layer, out, in)`` symbolic: returns ``(params, symbolic)`` with the numerical edge zeroed and
    the edge in the table (replacing an earlier entry for it).

    ``fun``: a :class:`Suggestion` (its ``a, b, c, d`` are used), or a library name / :class:`SymbolicFunction`:
    fitted on the data ``x`` by :func:`suggest_symbolic`'s sampling (``fit_kwargs``: ``num``, ``a_range``, ...), or
    with ``x=None`` set to ``(a, b, c, d) = (1, 0, 1, 0)`` (pykan's ``fit_params_bool=False``).
    """
    layers = network_layers(params)
    symbolic = check_symbolic(symbolic, layers)
    l, o, i = _edge_index(layers, edge)
    if isinstance(fun, Suggestion):
        f, aff = fun.fun, fun.affine
    else:
        f = library([fun])[fun if isinstance(fun, str) else fun.name] if isinstance(fun, (str, SymbolicFunction)) \
            else None
        if f is None:
            raise TypeError(f"fix_symbolic: 'fun' must be a Suggestion, a library name or a SymbolicFunction, got "
                            f"{type(fun).__name__}")
        if x is None:
            aff = (1.0, 0.0, 1.0, 0.0)
        else:
            u, y = edge_samples(layers, x, (l, o, i), num=fit_kwargs.pop("num", 100), symbolic=symbolic)
            fit = fit_affine(u, y, f, **fit_kwargs)
            if not np.isfinite(fit.r2):
                raise ValueError(f"fix_symbolic: no (a, b) in the ranges keeps {f.name}'s argument in its domain on "
                                 f"edge {(l, o, i)}'s input range [{u.min():.4g}, {u.max():.4g}]")
            aff = (fit.a, fit.b, fit.c, fit.d)
    dtype = layers[l]["base_weight"].dtype
    k = symbolic.index(l, o, i)
    edges = list(symbolic.edges)
    old = jnp.asarray(symbolic.affine, dtype)
    row = jnp.asarray(aff, dtype)[None]
    if k is None:
        edges.append((l, o, i, f))
        affine = jnp.concatenate([old, row], axis=0)
    else:
        edges[k] = (l, o, i, f)
        affine = old.at[k].set(row[0])
    layers = list(layers)
    layers[l] = _zero_edge(layers[l], o, i)
    return layers, SymbolicEdges(edges, affine)


def unfix_symbolic(symbolic: SymbolicEdges, edge) -> SymbolicEdges:
    """The table without edge ``(layer, out, in)``. The numerical edge stays zero (pykan's ``unfix_symbolic``
    restores its mask but the coefficients were trained on without it): retrain it, or keep the old params."""
    k = symbolic.index(*edge)
    if k is None:
        raise ValueError(f"unfix_symbolic: edge {tuple(edge)} is not symbolic")
    keep = [j for j in range(len(symbolic.edges)) if j != k]
    return SymbolicEdges([symbolic.edges[j] for j in keep], jnp.asarray(symbolic.affine)[np.asarray(keep, int)]
                         if keep else np.zeros((0, 4)))


def auto_symbolic(params, x: jax.Array, *, symbolic: SymbolicEdges | None = None, lib=None,
                  r2_threshold: float = 0.0, **suggest_kwargs):
    """pykan's ``auto_symbolic``: every numerical edge that is not identically zero gets its best suggestion fixed
    if that suggestion's ``r2 >= r2_threshold``. Edges are taken layer by layer, so a later layer's samples see the
    earlier layers' symbolic edges. Returns ``(params, symbolic, report)`` with ``report[(layer, out, in)]`` = the
    ranked suggestions of each edge tried (the first one was fixed when its ``r2`` reached the threshold).
    Zeroed (pruned) edges are left alone."""
    layers = network_layers(params)
    symbolic = check_symbolic(symbolic, layers)
    report = {}
    for l in range(len(layers)):
        out_f, in_f = layers[l]["base_weight"].shape
        for i in range(in_f):
            for o in range(out_f):
                p = layers[l]
                if symbolic.index(l, o, i) is not None:
                    continue
                if not (float(p["base_weight"][o, i]) != 0.0
                        or bool(jnp.any(p["spline_weight"][o, i] * p["spline_scaler"][o, i] != 0))):
                    continue
                ranked = suggest_symbolic(layers, x, (l, o, i), lib=lib, symbolic=symbolic, **suggest_kwargs)
                report[(l, o, i)] = ranked
                if ranked and np.isfinite(ranked[0].r2) and ranked[0].r2 >= r2_threshold:
                    layers, symbolic = fix_symbolic(layers, symbolic, (l, o, i), ranked[0])
    return layers, symbolic, report
