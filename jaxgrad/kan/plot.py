"""pykan-style plots of a KAN (matplotlib, Agg; no pyplot global state): every edge's learned activation in a grid
of panels (:func:`plot_activations`), and the network diagram with the activations drawn on its edges and their
opacity from the edge scores (:func:`plot_network`).

Edge ``(o, i)`` of a layer is :math:`\\varphi_{oi}(x) = W_b[o,i]\\,\\mathrm{silu}(x) + s_{oi} \\sum_m w_{oim} B_m(x)`
(what pykan draws on each edge, base branch included; the bias, if any, belongs to the node and is not drawn).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jaxgrad.kan.edges import _edge_activations_jit, check_symbolic, edge_activations, layer_inputs
from jaxgrad.kan.layer import check_params

__all__ = ["edge_activations", "network_figure", "plot_activations", "plot_network"]




def plot_activations(params_list: dict | Sequence[dict], path, x_range=None, num: int = 200,
                     panel_size: float = 1.3, title: str | None = None):
    """Save a PNG with one small panel per edge ``phi_oi``, a block of ``out x in`` panels per layer.

    ``x_range``: ``(lo, hi)`` for every input, or ``None`` for each input's grid range ``[t_k, t_{G+k}]`` (after
    grid updates, the range of the samples the layer was adapted to). The dashed line is the spline part alone.
    Returns ``path``.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plot_activations needs matplotlib (pip install matplotlib)") from e

    layers = [params_list] if isinstance(params_list, dict) else list(params_list)
    if not layers:
        raise ValueError("plot_activations: no layers")
    shapes = [tuple(p["base_weight"].shape) for p in layers]  # (out, in)
    ncols = max(s[1] for s in shapes)
    nrows = sum(s[0] for s in shapes)
    fig = Figure(figsize=(max(3.0, panel_size * ncols + 0.6), panel_size * nrows + 0.5 * len(layers) + 0.4),
                 layout="constrained")
    FigureCanvasAgg(fig)
    subfigs = fig.subfigures(len(layers), 1, height_ratios=[s[0] + 0.4 for s in shapes], squeeze=False)[:, 0]
    for li, (p, sub) in enumerate(zip(layers, subfigs)):
        k = check_params(p)
        out_f, in_f = p["base_weight"].shape
        grid = np.asarray(p["grid"], dtype=np.float64)
        if x_range is None:
            lo, hi = grid[:, k], grid[:, grid.shape[1] - k - 1]
        else:
            lo = np.full(in_f, float(x_range[0]))
            hi = np.full(in_f, float(x_range[1]))
        u = np.linspace(0.0, 1.0, int(num))
        xs = lo[None, :] + u[:, None] * (hi - lo)[None, :]  # [num, in]
        phi, spline = _edge_activations_jit(p, jnp.asarray(xs, dtype=p["spline_weight"].dtype))
        phi, spline = np.asarray(phi), np.asarray(spline)
        axes = sub.subplots(out_f, ncols, squeeze=False)
        sub.suptitle(f"layer {li}: {in_f} -> {out_f}", fontsize=9)
        for o in range(out_f):
            for i in range(ncols):
                ax = axes[o, i]
                if i >= in_f:
                    ax.set_axis_off()
                    continue
                ax.plot(xs[:, i], phi[:, o, i], lw=1.2, color="k")
                ax.plot(xs[:, i], spline[:, o, i], lw=0.8, ls="--", color="tab:blue")
                ax.set_title(f"phi[{o},{i}]", fontsize=7, pad=2)
                ax.tick_params(labelsize=5, length=2, pad=1)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    return path


def plot_network(params_list: Sequence[dict], x, path, *, symbolic=None, beta: float = 3.0, num: int = 100,
                 in_vars: Sequence[str] | None = None, out_vars: Sequence[str] | None = None,
                 title: str | None = None, scale: float = 1.0, dpi: int = 110):
    """Save :func:`network_figure` (same arguments) as a PNG at ``path``; returns ``path``."""
    fig = network_figure(params_list, x, symbolic=symbolic, beta=beta, num=num, in_vars=in_vars, out_vars=out_vars,
                         title=title, scale=scale)
    fig.savefig(path, dpi=dpi)
    return path


def network_figure(params_list: Sequence[dict], x, *, symbolic=None, beta: float = 3.0, num: int = 100,
                   in_vars: Sequence[str] | None = None, out_vars: Sequence[str] | None = None,
                   title: str | None = None, scale: float = 1.0):
    r"""The network as pykan's ``plot`` draws it (a matplotlib ``Figure``, no pyplot state): the nodes of every layer in a row (inputs at the
    bottom), and on every edge a small panel with its activation :math:`\varphi_{oi}` over its input's range on the
    data ``x[n, in]``. Line and panel opacity is pykan's :math:`\tanh(\beta E_{oi})`, ``E`` the edge score of
    :func:`jaxgrad.kan.prune.attribution` on ``x``; pruned (zeroed) edges have score 0 and vanish. Edges of the
    ``symbolic`` table (:class:`jaxgrad.kan.symbolic.SymbolicEdges`) are drawn in red, ``c f(a u + b) + d`` itself,
    with the function's name. The figure's first axes hold the diagram; every drawn edge adds one panel axes
    (``fig.axes[1:]``, layer by layer, input-major), whose ``edge`` attribute is ``(layer, out, in)``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("network_figure needs matplotlib (pip install matplotlib)") from e
    from jaxgrad.kan.prune import attribution

    if isinstance(params_list, dict):
        params_list = [params_list]
    layers = list(params_list)
    if not (isinstance(beta, (int, float)) and not isinstance(beta, bool) and beta > 0):
        raise ValueError(f"network_figure: 'beta' must be a number > 0, got {beta!r}")
    if isinstance(num, bool) or not isinstance(num, int) or num < 2:
        raise ValueError(f"network_figure: 'num' must be an int >= 2, got {num!r}")
    att = attribution(layers, x, symbolic)  # checks params and x
    symbolic = check_symbolic(symbolic, layers)
    acts = [np.asarray(h, dtype=np.float64) for h in layer_inputs(layers, x, symbolic)]
    widths = [layers[0]["base_weight"].shape[1]] + [p["base_weight"].shape[0] for p in layers]
    for name, names, n in (("in_vars", in_vars, widths[0]), ("out_vars", out_vars, widths[-1])):
        if names is not None and len(names) != n:
            raise ValueError(f"network_figure: '{name}' must name {n} variables, got {len(names)}")
    depth = len(layers)
    n_edges = max(a * b for a, b in zip(widths[:-1], widths[1:]))
    fig_w = scale * min(max(4.0, 0.9 * n_edges + 1.0), 24.0)
    fig_h = scale * (2.2 * depth + 0.9)
    fig = Figure(figsize=(fig_w, fig_h))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    y_lo, y_hi = -0.25, depth + (0.45 if title else 0.25)
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(y_lo, y_hi)
    ax.set_axis_off()
    to_fy = lambda y: (y - y_lo) / (y_hi - y_lo)  # noqa: E731  (the axes fill the figure)
    side_in = min(0.8 * fig_w / n_edges, 1.1 * scale, 0.55 * fig_h / depth)  # panel side, inches
    pw, ph = side_in / fig_w, side_in / fig_h

    def node_x(n, i):
        return (i + 0.5) / n

    for l, n in enumerate(widths):
        ax.scatter([node_x(n, i) for i in range(n)], [l] * n, s=60 * scale, color="black", zorder=3)
    sym_at = {(l, o, i): (k, f) for k, (l, o, i, f) in enumerate(symbolic.edges)}
    aff = np.asarray(symbolic.affine, dtype=np.float64)
    for l, p in enumerate(layers):
        n_in, n_out = widths[l], widths[l + 1]
        N = n_in * n_out
        h = acts[l]
        lo, hi = h.min(axis=0), h.max(axis=0)
        grid = np.linspace(0.0, 1.0, num)[:, None] * (hi - lo)[None, :] + lo[None, :]
        phi, _ = _edge_activations_jit(p, jnp.asarray(grid, dtype=p["spline_weight"].dtype))
        phi = np.asarray(phi, dtype=np.float64)
        alpha = np.tanh(beta * np.asarray(att.edge_scores[l], dtype=np.float64))
        for i in range(n_in):
            for o in range(n_out):
                a_ = float(np.clip(alpha[o, i], 0.0, 1.0))
                if a_ <= 0.0:
                    continue
                cx, cy = (i * n_out + o + 0.5) / N, l + 0.5
                sym = sym_at.get((l, o, i))
                color = "tab:red" if sym is not None else "black"
                ax.plot([node_x(n_in, i), cx], [l, cy - 0.5 * ph * (y_hi - y_lo)], color=color, lw=1.2 * scale,
                        alpha=a_)
                ax.plot([cx, node_x(n_out, o)], [cy + 0.5 * ph * (y_hi - y_lo), l + 1], color=color, lw=1.2 * scale,
                        alpha=a_)
                u = grid[:, i]
                v = phi[:, o, i]
                if sym is not None:
                    k, f = sym
                    a, b, c, d = aff[k]
                    with np.errstate(all="ignore"):
                        v = v + c * f.fn(a * u + b, np) + d
                inset = fig.add_axes((cx - pw / 2, to_fy(cy) - ph / 2, pw, ph))
                inset.edge = (l, o, i)
                inset.plot(u, v, color=color, lw=1.5 * scale, alpha=a_)
                inset.set_xticks([])
                inset.set_yticks([])
                for spine in inset.spines.values():
                    spine.set_alpha(a_)
                    spine.set_color(color)
                inset.patch.set_alpha(0.0)
                if sym is not None:
                    inset.set_title(sym[1].name, fontsize=7 * scale, color=color, pad=1)
    for names, l, dy in ((in_vars, 0, -0.15), (out_vars, depth, 0.15)):
        for i, name in enumerate(names or ()):
            ax.text(node_x(widths[l], i), l + dy, str(name), ha="center", va="center", fontsize=10 * scale)
    if title:
        ax.text(0.5, y_hi - 0.04, title, ha="center", va="top", fontsize=10 * scale)
    return fig
