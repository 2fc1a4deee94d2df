"""The console side of ``jaxgrad demo``: one line per step of progress, one screen in all (about 20 lines).

Each function returns text; :class:`Console` prints it (flushed: the lines appear as the stages finish).
"""

from __future__ import annotations

import math
import pathlib
import sys

from jaxgrad.demo.audit_stage import AuditResult, OpVerdict
from jaxgrad.demo.denoiser_stage import DenoiserResult
from jaxgrad.demo.kan_stage import TARGET_TEXT, WIDTHS, KANResult
from jaxgrad.demo.plan import DemoPlan

INDENT = "      "


class Console:
    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stdout

    def say(self, text: str = "") -> None:
        print(text, file=self.stream, flush=True)


def duration(seconds: float) -> str:
    """``"42 s"`` or ``"3 min 05 s"``."""
    s = int(round(seconds))
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s"


def intro(device: dict, plan: DemoPlan, out: pathlib.Path) -> str:
    if device["platform"] == "gpu":
        where = f"GPU ({device['kind']}): JAX found a GPU and uses it"
    elif device["platform"] == "cpu":
        where = f"CPU ({device['cpu_cores']} cores): JAX found no GPU"
    else:
        where = f"{device['platform'].upper()} ({device['kind']})"
    return (f"jaxgrad demo: checks jaxgrad's hand-written gradients, then trains two small models with them.\n"
            f"device: {where}; {plan.name} sizes\n"
            f"report folder: {out}\n")


def audit_header(n_ops: int) -> str:
    return (f"[1/3] Audit: {n_ops} ops' hand-written gradients vs float64 autodiff "
            f"(PASS: error within float32 rounding)")


def audit_line(v: OpVerdict) -> str:
    worst = f"worst error {v.worst:5.2f} of its bound" if math.isfinite(v.worst) else "per-entry bound vacuous    "
    return f"{INDENT}{'PASS' if v.passed else 'FAIL'}  {v.name:<46.46} {worst}  {duration(v.seconds):>6}"


def audit_done(a: AuditResult) -> str:
    n = len(a.verdicts)
    verdict = f"all {n} pass" if a.passed else f"{a.n_failed} of {n} FAIL (details: verdicts.txt)"
    return f"{INDENT}{verdict} ({duration(a.seconds)})"


def kan_header(plan: DemoPlan) -> str:
    return (f"[2/3] KAN: fit {TARGET_TEXT} with a {list(WIDTHS)} KAN, refining its grid "
            f"{' -> '.join(map(str, plan.kan_grids))}")


def kan_done(k: KANResult) -> str:
    per_grid = ", ".join(f"G={g.grid} {g.test_rmse:.1e}" for g in k.per_grid)
    gain = k.rmse_before_refinement / k.rmse_after_refinement
    return f"{INDENT}test RMSE {per_grid}: refinement cut the error {gain:.0f}x ({duration(k.seconds)})"


def denoiser_header(plan: DemoPlan) -> str:
    return (f"[3/3] Denoiser: Noise2Noise on {plan.cnn_particles} synthetic particles, {plan.cnn_size} x "
            f"{plan.cnn_size} pixels, SNR {plan.cnn_snr:g} (noise {1 / plan.cnn_snr:.0f}x the signal's power)")


def denoiser_done(d: DenoiserResult) -> str:
    ev = d.evaluation
    return (f"{INDENT}PSNR vs clean: noisy input {ev['psnr_noisy_db']:.1f} dB -> denoised {ev['psnr_denoised_db']:.1f} "
            f"dB; MSE {ev['mse_noisy_vs_clean']:.3f} -> {ev['mse_vs_clean_final']:.3f} ({duration(d.seconds)})")


def closing(a: AuditResult, total_s: float, index: pathlib.Path) -> str:
    checks = (f"all {len(a.verdicts)} gradient checks pass" if a.passed else
              f"{a.n_failed} of {len(a.verdicts)} gradient checks FAIL (exit status 1)")
    return (f"\nDone in {duration(total_s)}: {checks}; both models trained.\n"
            f"Report: {index}\n"
            f"{INDENT}open it in a browser; metrics.json, verdicts.txt and the PNGs are beside it")
