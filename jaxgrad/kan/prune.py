r"""Magnitude-based pruning of a KAN, as pykan defines it (``MultKAN.attribute``, ``prune_node``, ``prune_edge``,
``prune``), over the params list.

Scores (pykan's ``attribute``, on data ``x``). With :math:`x^{(l)}` the nodes of layer ``l`` (``x^{(0)} = x``) and
:math:`\varphi^{(l)}_{oi}` the edge from node ``i`` of layer ``l`` to node ``o`` of layer ``l + 1`` (base branch,
spline and any symbolic edge together), ``std`` the unbiased standard deviation over the samples:

.. math::

    S^{(L)}_o = 1 / n_L, \qquad
    E^{(l)}_{oi} = \frac{\operatorname{std}\,\varphi^{(l)}_{oi}\bigl(x^{(l)}_i\bigr)}
                        {\operatorname{std}\,x^{(l+1)}_o + 10^{-4}}\; S^{(l+1)}_o, \qquad
    S^{(l)}_i = \sum_o E^{(l)}_{oi} .

``S`` are the node scores (``S^{(0)}``: pykan's ``feature_score`` of the inputs), ``E`` the edge scores: the share of
the outputs' spread that flows through each edge, averaged over the outputs.

Pruning (pykan's ``prune(node_th=1e-2, edge_th=3e-2)``): hidden nodes with :math:`S \le` ``node_threshold`` are
removed (the row of the layer before, the column and knot row of the layer after: the network gets smaller); the
scores are computed again on the smaller network and edges with :math:`E \le` ``edge_threshold`` are zeroed
(``base_weight[o, i]``, ``spline_weight[o, i, :]``, ``spline_scaler[o, i]``) and reported in a mask. Inputs and
outputs are never removed.

The constant of a removed edge. The scores measure spread only, so a removed edge may carry a non-zero mean
:math:`\mu_{oi} = \operatorname{mean}_n \varphi_{oi}`, which pykan drops (the output shifts by it). With
``keep_mean=True`` (default) it is added to the receiving node's ``bias`` (created if the layer has none), so what
is lost is only the removed edges' deviation from their mean: the output changes by at most the sum of the removed
spreads times the downstream slopes. :class:`Pruned` reports the change measured on ``x``.

A zeroed edge keeps ``spline_weight`` and ``spline_scaler`` at zero under optimisers whose update of a zero gradient
is zero (SGD, Adam, AdamW: each one's gradient has the other as a factor); ``base_weight[o, i]`` gets the gradient :math:`g^\top \mathrm{silu}(x_i)`, so chain
:func:`freeze_edges` (``masks``) into the optimiser to keep pruned edges pruned.

Pruning is eager (its shapes depend on the data) and not differentiated; :func:`attribution` is plain ``jnp``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.kan.layer import check_params
from jaxgrad.kan.network import kan_apply_reference, kan_widths
from jaxgrad.kan.edges import check_symbolic, edge_activations

__all__ = ["Attribution", "Pruned", "apply_edge_masks", "attribution", "freeze_edges", "prune", "prune_edges",
           "prune_nodes"]

_STD_EPS = 1e-4


@dataclasses.dataclass(frozen=True)
class Attribution:
    """pykan's attribution scores: ``node_scores[l]`` (``[width_l]``, ``l = 0 .. L``), ``edge_scores[l]``
    (``[out, in]`` of layer ``l``), and each edge's mean activation ``edge_means[l]`` (``[out, in]``)."""

    node_scores: list[jax.Array]
    edge_scores: list[jax.Array]
    edge_means: list[jax.Array]


@dataclasses.dataclass(frozen=True)
class Pruned:
    """The result of :func:`prune`: the smaller ``params``, per layer ``edge_masks`` (``bool[out, in]``, ``False``
    = pruned), ``kept_nodes[l]`` (indices of the original nodes of layer ``l`` that remain, ``l = 0 .. L``), and the
    output change on the data: ``max_abs_change`` and ``rms_change`` of ``f_pruned(x) - f(x)``."""

    params: list[dict[str, jax.Array]]
    edge_masks: list[np.ndarray]
    kept_nodes: list[np.ndarray]
    max_abs_change: float
    rms_change: float


def _layers(params):
    if isinstance(params, dict):
        raise TypeError("pruning needs a network: 'params' must be a list of layer dicts (see kan_init), got one "
                        "layer dict; wrap it as [params]")
    layers = list(params)
    kan_widths(layers)
    return layers


def _as_data(layers, x):
    if not hasattr(x, "shape") or getattr(x, "ndim", 0) != 2 or x.shape[1] != layers[0]["base_weight"].shape[1]:
        raise ValueError(f"'x' must be data of shape [n, {layers[0]['base_weight'].shape[1]}] (n >= 2 samples of "
                         f"the network's inputs), got {getattr(x, 'shape', type(x).__name__)}")
    if x.shape[0] < 2:
        raise ValueError(f"'x' needs at least 2 samples (the scores are standard deviations), got {x.shape[0]}")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"'x' must be floating point, got {x.dtype}")
    return x


def _std(v, axis=0):
    return jnp.std(v, axis=axis, ddof=1)


def attribution(params: Sequence[dict[str, jax.Array]], x: jax.Array, symbolic=None) -> Attribution:
    """pykan's node and edge scores (module docstring) on the data ``x[n, in]``. ``symbolic``: a
    :class:`jaxgrad.kan.symbolic.SymbolicEdges` table whose edges count as part of the network."""

    layers = _layers(params)
    x = _as_data(layers, x)
    for p in layers:
        check_params(p)  # the knot values too, which jit cannot see
    return Attribution(*_attribution_jit(layers, x, check_symbolic(symbolic, layers)))


@jax.jit
def _attribution_jit(layers, h, symbolic):
    edge_std, edge_mean, node_std = [], [], []
    for l, p in enumerate(layers):
        phi, _ = edge_activations(p, h)  # [n, out, in]
        for k, (ll, o, i, f) in enumerate(symbolic.edges):
            if ll == l:
                a, b, c, d = (jnp.asarray(symbolic.affine)[k, j] for j in range(4))
                phi = phi.at[:, o, i].add((c * f.fn(a * h[:, i] + b, jnp) + d).astype(phi.dtype))
        out = phi.sum(axis=-1) + (p["bias"] if "bias" in p else 0.0)
        edge_std.append(_std(phi))
        edge_mean.append(jnp.mean(phi, axis=0))
        node_std.append(_std(out))
        h = out
    n_out = layers[-1]["base_weight"].shape[0]
    score = jnp.full((n_out,), 1.0 / n_out, dtype=h.dtype)
    node_scores, edge_scores = [score], []
    for l in range(len(layers) - 1, -1, -1):
        e = edge_std[l] * (score / (node_std[l] + _STD_EPS))[:, None]
        score = jnp.sum(e, axis=0)
        edge_scores.append(e)
        node_scores.append(score)
    return node_scores[::-1], edge_scores[::-1], edge_mean


def _check_threshold(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not np.isfinite(value) or value < 0:
        raise ValueError(f"'{name}' must be a finite number >= 0, got {value!r}")
    return float(value)


def _add_bias(p, add):
    add = jnp.asarray(add, p["base_weight"].dtype)
    q = dict(p)
    q["bias"] = (p["bias"] if "bias" in p else jnp.zeros_like(add)) + add
    return q


def prune_nodes(params: Sequence[dict[str, jax.Array]], x: jax.Array, *, threshold: float = 1e-2,
                keep_mean: bool = True) -> tuple[list[dict[str, jax.Array]], list[np.ndarray]]:
    """pykan's ``prune_node``: remove the hidden nodes whose score is ``<= threshold``. Returns ``(params,
    kept_nodes)``, ``kept_nodes[l]`` the original indices of the nodes of layer ``l`` that remain (all of them for
    the inputs and outputs). ``keep_mean``: the removed nodes' outgoing edges' means go into the next layer's bias."""
    layers = _layers(params)
    threshold = _check_threshold("threshold", threshold)
    att = attribution(layers, _as_data(layers, x))
    widths = kan_widths(layers)
    kept = [np.arange(widths[0])]
    for l in range(1, len(layers)):
        scores = np.asarray(att.node_scores[l])
        kept.append(np.flatnonzero(scores > threshold))
        if kept[-1].size == 0:
            raise ValueError(f"prune_nodes: every node of hidden layer {l} scores <= threshold={threshold:g} (the "
                             f"highest is {scores.max():.3g}); removing them all would cut the network: lower "
                             f"'threshold'")
    kept.append(np.arange(widths[-1]))
    new = [dict(p) for p in layers]
    for l in range(1, len(layers)):  # node layer l: rows of layers[l-1], columns of layers[l]
        keep = kept[l]
        if keep.size == widths[l]:
            continue
        if keep_mean:
            dropped = np.setdiff1d(np.arange(widths[l]), keep)
            mu = jnp.sum(att.edge_means[l][:, dropped], axis=1)
            new[l] = _add_bias(new[l], mu)
        below, above = new[l - 1], new[l]
        for name in ("base_weight", "spline_weight", "spline_scaler", "bias"):
            if name in below:
                below[name] = below[name][keep]
        for name in ("base_weight", "spline_weight", "spline_scaler"):
            above[name] = above[name][:, keep]
        above["grid"] = above["grid"][keep]
    return new, kept


def prune_edges(params: Sequence[dict[str, jax.Array]], x: jax.Array, *, threshold: float = 3e-2,
                masks: Sequence[np.ndarray] | None = None, keep_mean: bool = True
                ) -> tuple[list[dict[str, jax.Array]], list[np.ndarray]]:
    """pykan's ``prune_edge``: zero the edges whose score is ``<= threshold`` (and those already ``False`` in
    ``masks``). Returns ``(params, masks)``, ``masks[l]`` ``bool[out, in]`` with ``False`` for pruned edges.
    ``keep_mean``: each pruned edge's mean goes into its output node's bias."""
    layers = _layers(params)
    threshold = _check_threshold("threshold", threshold)
    att = attribution(layers, _as_data(layers, x))
    new_masks = []
    for l, p in enumerate(layers):
        m = np.asarray(att.edge_scores[l]) > threshold
        if masks is not None:
            if np.shape(masks[l]) != m.shape:
                raise ValueError(f"'masks'[{l}] must have shape {m.shape} (out, in), got {np.shape(masks[l])}")
            m &= np.asarray(masks[l], bool)
        new_masks.append(m)
    new = apply_edge_masks(layers, new_masks)
    if keep_mean:
        for l, m in enumerate(new_masks):
            if not m.all():
                mu = jnp.sum(jnp.where(jnp.asarray(m), 0.0, att.edge_means[l]), axis=1)
                new[l] = _add_bias(new[l], mu)
    return new, new_masks


def apply_edge_masks(params: Sequence[dict[str, jax.Array]], masks: Sequence[np.ndarray]
                     ) -> list[dict[str, jax.Array]]:
    """Zero ``base_weight``, ``spline_weight`` and ``spline_scaler`` of every edge that is ``False`` in ``masks``."""
    layers = _layers(params)
    if len(masks) != len(layers):
        raise ValueError(f"'masks' must have one [out, in] mask per layer ({len(layers)}), got {len(masks)}")
    out = []
    for l, (p, m) in enumerate(zip(layers, masks)):
        m = jnp.asarray(m)
        if m.shape != p["base_weight"].shape:
            raise ValueError(f"'masks'[{l}] must have shape {tuple(p['base_weight'].shape)}, got {tuple(m.shape)}")
        q = dict(p)
        q["base_weight"] = jnp.where(m, p["base_weight"], 0)
        q["spline_weight"] = jnp.where(m[..., None], p["spline_weight"], 0)
        q["spline_scaler"] = jnp.where(m, p["spline_scaler"], 0)
        out.append(q)
    return out


def freeze_edges(masks: Sequence[np.ndarray]):
    """An optax transformation that zeroes the updates of ``base_weight``, ``spline_weight`` and ``spline_scaler``
    on the edges that are ``False`` in ``masks`` (chain it last: ``optax.chain(optax.adam(lr),
    freeze_edges(masks))``). Updates are a list of layer dicts like the params; other leaves pass through."""
    import optax

    ms = [jnp.asarray(np.asarray(m, bool)) for m in masks]

    def update(updates, state, params=None):
        del params
        if len(updates) != len(ms):
            raise ValueError(f"freeze_edges: the updates have {len(updates)} layers, the masks {len(ms)}")
        out = []
        for u, m in zip(updates, ms):
            u = dict(u)
            for name, mm in (("base_weight", m), ("spline_weight", m[..., None]), ("spline_scaler", m)):
                if name in u and u[name] is not None:
                    u[name] = jnp.where(mm, u[name], jnp.zeros_like(u[name]))
            out.append(u)
        return type(updates)(out) if isinstance(updates, (list, tuple)) else out, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def prune(params: Sequence[dict[str, jax.Array]], x: jax.Array, *, node_threshold: float = 1e-2,
          edge_threshold: float = 3e-2, keep_mean: bool = True) -> Pruned:
    """pykan's ``prune``: :func:`prune_nodes` (``node_threshold``), then the scores again on the smaller network
    and :func:`prune_edges` (``edge_threshold``); defaults are pykan's. Returns a :class:`Pruned` with the output
    change measured on ``x`` (``kan_apply_reference``)."""
    layers = _layers(params)
    x = _as_data(layers, x)
    small, kept = prune_nodes(layers, x, threshold=node_threshold, keep_mean=keep_mean)
    small, masks = prune_edges(small, x, threshold=edge_threshold, keep_mean=keep_mean)
    diff = kan_apply_reference(small, x) - kan_apply_reference(layers, x)
    return Pruned(small, masks, kept, float(jnp.max(jnp.abs(diff))), float(jnp.sqrt(jnp.mean(diff * diff))))
