"""pykan-style plots of the learned edge activations of a KAN (matplotlib, Agg; no pyplot global state).

Edge ``(o, i)`` of a layer is :math:`\\varphi_{oi}(x) = W_b[o,i]\\,\\mathrm{silu}(x) + s_{oi} \\sum_m w_{oim} B_m(x)`
(what pykan draws on each edge, base branch included; the bias, if any, belongs to the node and is not drawn).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.kan.layer import check_params
from jaxgrad.kan.spline import bspline_basis

__all__ = ["edge_activations", "plot_activations"]


def edge_activations(params: dict[str, jax.Array], x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(phi[n, out, in], spline_part[n, out, in])`` at ``x[n, in]`` (materialised: meant for plotting)."""
    k = check_params(params, x)
    basis = bspline_basis(x, params["grid"], k)  # [n, in, G+k]
    coef = params["spline_weight"] * params["spline_scaler"][..., None]
    spline = jnp.einsum("nim,oim->noi", basis, coef)
    phi = params["base_weight"][None] * jax.nn.silu(x)[:, None, :] + spline
    return phi, spline


_edge_activations_jit = jax.jit(edge_activations)


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
