"""The report's figures (matplotlib, Agg canvas; no pyplot global state, no display needed).

The denoised examples come from :func:`jaxgrad.cnn.task.write_examples` (stage 3) and the KAN's activations from
:func:`jaxgrad.kan.plot.plot_activations`; this module adds the two loss curves.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

from jaxgrad.demo.denoiser_stage import DenoiserResult
from jaxgrad.demo.kan_stage import TARGET_TEXT, WIDTHS, KANResult


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: pathlib.Path) -> pathlib.Path:
    tmp = path.with_name(f".{path.name}.tmp.png")  # a reader never sees half a PNG
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` finite values (NaN entries, skipped steps, are ignored)."""
    v = np.where(np.isfinite(values), values, 0.0)
    n = np.isfinite(values).astype(np.float64)
    cv, cn = np.concatenate([[0.0], np.cumsum(v)]), np.concatenate([[0.0], np.cumsum(n)])
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (cv[idx] - cv[lo]) / (cn[idx] - cn[lo])


def plot_kan_loss(kan: KANResult, path: pathlib.Path) -> pathlib.Path:
    """Training MSE per step (log scale), a dashed line where each phase (optimiser or grid) starts, and the test
    RMSE reached on each grid."""
    fig = _figure(7.5, 3.6)
    ax = fig.subplots()
    steps = np.arange(1, len(kan.losses) + 1)
    ax.semilogy(steps, kan.losses, lw=1.0, color="k")
    ends = [g.steps for g in kan.per_grid]
    for start, label in kan.phases:
        ax.axvline(start, color="tab:blue", ls="--", lw=0.8)
        ax.text(start, 0.98, f" {label}", transform=ax.get_xaxis_transform(), fontsize=7, va="top", ha="right",
                rotation=90, color="tab:blue")
    for g, end in zip(kan.per_grid, ends):
        ax.plot([end], [g.test_rmse ** 2], "o", color="tab:red", ms=4)
        ax.annotate(f"test RMSE {g.test_rmse:.1e}", (end, g.test_rmse ** 2), textcoords="offset points",
                    xytext=(-4, 6), ha="right", fontsize=7, color="tab:red")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("MSE (red: test RMSE$^2$)")
    ax.set_title(f"KAN {list(WIDTHS)} fitting {TARGET_TEXT}: grids {' -> '.join(str(g.grid) for g in kan.per_grid)}",
                 fontsize=10)
    return _save(fig, path)


def plot_denoiser_loss(den: DenoiserResult, path: pathlib.Path) -> pathlib.Path:
    """Noise2Noise training loss per step (raw and a 20-step average), with the held-out loss before and after."""
    fig = _figure(7.5, 3.4)
    ax = fig.subplots()
    steps = np.arange(1, len(den.losses) + 1)
    ax.plot(steps, den.losses, lw=0.6, color="0.7", label="training loss (one batch)")
    ax.plot(steps, moving_average(den.losses, 20), lw=1.4, color="k", label="20-step average")
    ev = den.evaluation
    ax.axhline(ev["n2n_loss_initial"], color="tab:red", ls=":", lw=1, label="held-out loss, untrained network")
    ax.axhline(ev["n2n_loss_final"], color="tab:green", ls="--", lw=1, label="held-out loss, trained")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("Noise2Noise MSE")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(f"denoiser on {den.particles} synthetic particles ({den.size} x {den.size}, SNR {den.snr:g})",
                 fontsize=10)
    return _save(fig, path)


def plot_kan_activations(kan: KANResult, path: pathlib.Path) -> pathlib.Path:
    """The learned edge functions (float64 params: plotted with float64 enabled)."""
    import jax

    from jaxgrad.kan.plot import plot_activations

    with jax.enable_x64(True):
        tmp = path.with_name(f".{path.name}.tmp.png")
        plot_activations(kan.params, tmp, title=f"learned edge functions, G={kan.per_grid[-1].grid}")
        os.replace(tmp, path)
    return path
