"""The report folder's contents: ``metrics.json``, ``verdicts.txt``, the figures and ``index.html``.

:func:`demo_metrics` is the one place the numbers are assembled; the console summary, ``metrics.json`` and
``index.html`` all read them from there.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import platform

import numpy as np

from jaxgrad.demo import outdir, plots
from jaxgrad.demo.audit_stage import AuditResult
from jaxgrad.demo.denoiser_stage import DenoiserResult
from jaxgrad.demo.html import index_html
from jaxgrad.demo.kan_stage import TARGET_TEXT, WIDTHS, KANResult


def device_info() -> dict:
    """The device JAX computes on (the first one: a GPU when JAX has one)."""
    import jax

    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", str(dev))
    if dev.platform == "cpu":  # JAX's CPU device kind is just "cpu"
        kind = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return {"platform": dev.platform, "kind": kind, "count": jax.device_count(), "cpu_cores": os.cpu_count()}


def demo_metrics(plan_name: str, audit: AuditResult, kan: KANResult, den: DenoiserResult, seconds: dict,
                 cpu_seconds: dict) -> dict:
    """Every number of the report (JSON-ready: plain floats, ints, strings). ``seconds``: wall time per stage and
    ``"total"``; ``cpu_seconds``: this process's CPU time (all threads) per stage and ``"total"``."""
    import jax

    import jaxgrad

    ev = den.evaluation
    finite = kan.losses[np.isfinite(kan.losses)]
    return {
        "report": outdir.REPORT_MARK, "complete": True, "plan": plan_name,
        "created": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "device": device_info(),
        "versions": {"jaxgrad": jaxgrad.__version__, "jax": jax.__version__, "python": platform.python_version()},
        "seconds": seconds, "cpu_seconds": cpu_seconds,
        "audit": {"passed": audit.passed, "n_ops": len(audit.verdicts), "n_failed": audit.n_failed,
                  "ops": [{"name": v.name, "passed": v.passed, "worst_fraction_of_bound": v.worst if math.isfinite(v.worst) else None,
                           "sizes": [list(s) if isinstance(s, tuple) else s for s in v.sizes],
                           "seconds": v.seconds} for v in audit.verdicts]},
        "kan": {"target": TARGET_TEXT, "widths": list(WIDTHS), "grids": [g.grid for g in kan.per_grid],
                "n_train": kan.n_train, "n_test": kan.n_test, "steps": int(len(kan.losses)),
                "rmse_before_refinement": kan.rmse_before_refinement,
                "rmse_after_refinement": kan.rmse_after_refinement,
                "refinement_gain": kan.rmse_before_refinement / kan.rmse_after_refinement,
                "final_train_mse": float(finite[-1]) if finite.size else math.nan,
                "per_grid": [{"grid": g.grid, "train_rmse": g.train_rmse, "test_rmse": g.test_rmse, "steps": g.steps}
                             for g in kan.per_grid]},
        "denoiser": {"particles": den.particles, "size": den.size, "snr": den.snr, "n_eval": den.n_eval,
                     "steps": den.steps, "batch_size": den.batch, **ev,
                     "psnr_gain_db": ev["psnr_denoised_db"] - ev["psnr_noisy_db"],
                     "final_train_loss": float(den.losses[-1])},
    }


def verdicts_text(audit: AuditResult, device: dict) -> str:
    """``verdicts.txt``: a header, then every op's full audit table (as ``jaxgrad audit`` prints it)."""
    head = [f"jaxgrad demo: audit of {len(audit.verdicts)} custom VJPs on {device['platform'].upper()} "
            f"({device['kind']})",
            "Each table: every gradient leaf at every size; 'max err/sum|t|' is the worst entry's error divided by",
            "the sum of the magnitudes of the terms that make it, 'bound' the float32 rounding it may show. The",
            "checks below each table are finite differences, the adjoint identity and structural tests. See",
            "docs/verify.md (in a source checkout) for the method.", ""]
    return "\n".join(head + [v.table + "\n" for v in audit.verdicts])


def write_figures(out: pathlib.Path, kan: KANResult, den: DenoiserResult) -> None:
    """The three figures this module draws (the examples PNG was written by stage 3)."""
    plots.plot_kan_loss(kan, out / outdir.KAN_LOSS_PNG)
    plots.plot_kan_activations(kan, out / outdir.KAN_ACTIVATIONS_PNG)
    plots.plot_denoiser_loss(den, out / outdir.DENOISER_LOSS_PNG)


def write_report(out: pathlib.Path, metrics: dict, audit: AuditResult) -> None:
    """``verdicts.txt``, ``index.html`` and, last, ``metrics.json`` (``"complete": true`` marks a finished report)."""
    _write_text(out / outdir.VERDICTS, verdicts_text(audit, metrics["device"]))
    pngs = [name for name in outdir.OWNED if name.endswith(".png") and (out / name).exists()]
    _write_text(out / outdir.INDEX, index_html(metrics, pngs))
    _write_text(out / outdir.METRICS, json.dumps(metrics, indent=1, allow_nan=True) + "\n")


def _write_text(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
