"""``check_vjp`` at several problem sizes, and the trend of the error across them.

1. **Each size** (:func:`check_vjp`): the float64 re-run, the rounding model and the statistical verdict.
2. **Error vs problem size**, an independent check: at every size the gradient's normwise error is divided by the
   modelled rounding of that size (the reference emulated at the run's precision), which already grows as rounding
   does (about sqrt(N)). That ratio must not grow across the sizes beyond its sampling band and a stated drift
   (``TREND_DRIFT``): an error that grows faster than rounding is flagged even when every size passes on its own.

There is no one-optimizer-step comparison: with plain SGD it is ``-lr (g_fn - g_ref)``, the pooled normwise error
of the leaves again, and its tolerance (bound x kappa) reached 0.85 on the H100 conv2d audit; no planted bug was
caught by it and missed by the per-leaf checks.

The cases ``jaxgrad audit`` runs, one per op and backend, are :mod:`jaxgrad.ops.registry`'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxgrad.verify.core import check_vjp
from jaxgrad.verify.report import Check, VJPReport, _fmt_table
from jaxgrad.verify.stats import IMPLEMENTATION_FACTOR

__all__ = ["AuditReport", "audit"]


@dataclasses.dataclass(frozen=True)
class AuditReport:
    name: str
    sizes: list[Any]
    reports: list[VJPReport]
    trend: list[Check]
    passed: bool

    def __str__(self) -> str:
        out = [f"audit: {self.name}"]
        rows = []
        for size, rep in zip(self.sizes, self.reports):
            for lf in rep.leaves:
                rows.append([str(size), lf.name, lf.run, f"{lf.normalized_err:.2e}", f"{lf.bound:.1e}",
                             f"{lf.rel_err:.2e}", f"{lf.kappa:.3g}", "ok" if lf.passed else "FAIL"])
        out += _fmt_table(["size", "leaf", "run", "max err/sum|t|", "bound", "rel.err(norm)", "kappa", ""], rows)
        out.append("  checks:")
        for size, rep in zip(self.sizes, self.reports):
            bad = [c for c in rep.checks if not c.passed]
            out.append(f"    [{'ok' if not bad else 'FAIL'}] size {size}: {len(rep.checks) - len(bad)}/"
                       f"{len(rep.checks)} FD/adjoint/structure checks pass"
                       + ("" if not bad else " -- failed: " + ", ".join(c.name for c in bad)))
        for c in self.trend:
            out.append(f"    [{'ok' if c.passed else 'FAIL'}] {c.name}: {c.detail}")
        failing = [f"size {s}: {lf.name} ({lf.run}): {lf.verdict}" for s, r in zip(self.sizes, self.reports)
                   for lf in r.failures]
        if failing:
            out.append("  failures:")
            out += [f"    - {f}" for f in failing]
        vacuous = self.vacuous_leaves()
        if vacuous:
            rows = ", ".join(f"{s} {n} ({r})" for s, n, r, _ in vacuous)
            out.append(f"  per-entry bound vacuous at {len(vacuous)} of {self._n_leaves()} leaf rows (bound x kappa "
                       ">= 1: it admits an error as large as the gradient; there only the statistics and the "
                       f"FD/adjoint/structure checks judge): {rows}")
        out.append(f"  VERDICT: {'PASS' if self.passed else 'FAIL'}")
        return "\n".join(out)

    def _n_leaves(self) -> int:
        return sum(len(r.leaves) for r in self.reports)

    def _rows(self):
        """``(size, leaf row, bound * kappa, vacuous)`` over every size and leaf row."""
        for size, rep in zip(self.sizes, self.reports):
            for lf in rep.leaves:
                slack = lf.bound * lf.kappa
                yield size, lf, slack, not math.isfinite(slack) or slack >= 1

    def vacuous_leaves(self) -> list[tuple[Any, str, str, float]]:
        """``(size, leaf, run, bound * kappa)`` of each leaf row whose per-entry bound cannot fail: ``bound * kappa
        >= 1`` (the tolerance ``bound * sum|terms|`` is normwise at least the gradient itself) or a non-finite
        ``kappa``."""
        return [(size, lf.name, lf.run, slack) for size, lf, slack, vacuous in self._rows() if vacuous]

    @property
    def worst_fraction_of_bound(self) -> float:
        """The largest per-entry error as a fraction of its rounding bound (< 1 passes), over the leaf rows whose
        bound can fail and any row that failed it; nan where every row's bound is vacuous and held
        (:meth:`vacuous_leaves`)."""
        ratios = [lf.normalized_err / lf.bound for _, lf, _, vacuous in self._rows()
                  if not vacuous or not lf.per_entry_passed]
        return max(ratios, default=math.nan)

    def summary(self) -> str:
        """``worst 0.227 of bound``, and how many leaf rows had a vacuous bound: a summary never reads better than
        the check behind it."""
        vacuous, n = len(self.vacuous_leaves()), self._n_leaves()
        if vacuous == n and math.isnan(self.worst_fraction_of_bound):
            return f"per-entry bound vacuous at all {n} leaf rows (bound x kappa >= 1)"
        text = f"worst {self.worst_fraction_of_bound:8.3f} of bound"
        return text if not vacuous else f"{text} ({vacuous}/{n} leaf rows: bound vacuous)"


TREND_DRIFT = 2.0  # a correct kernel's error relative to the modelled rounding may drift this much across sizes
TREND_ALPHA = 1e-4  # false-alarm rate of one leaf's trend check under the model


def _trend_ratio(lf) -> float:
    """``q`` of one leaf at one size: its normwise error over the modelled rounding's, without the flips behind kinks
    where the leaf has any."""
    if lf.stats.kink_spread > 0 and math.isfinite(lf.stats.flip_free_ratio):
        return lf.stats.flip_free_ratio
    return lf.rel_err / lf.ref_rel_err


def _size_trend(sizes, reports) -> list[Check]:
    """Per leaf: the normwise error over the modelled rounding, ``q_s = rel_err / model_rel_err`` (behind kinks the
    part no branch flip explains, :func:`_trend_ratio`), must not grow from
    the smallest to the largest size by more than ``TREND_DRIFT`` times the band of two independent ratio estimates
    (``sqrt(F^-1(d_last, K d_last)) * sqrt(F^-1(K d_first, d_first))`` at ``TREND_ALPHA / 2`` each)."""
    from scipy import stats as sps

    checks = []
    names = [lf.name for lf in reports[0].leaves if lf.run != "f64"]
    for name in names:
        leaves = [r.as_called(name) for r in reports]
        run = "/".join(dict.fromkeys(lf.run for lf in leaves))
        if len(leaves) < 2 or any(lf.stats is None or not lf.ref_rel_err for lf in leaves):
            checks.append(Check(f"error vs size {name}", True, "not judged (needs two sizes with a modelled "
                                                               "rounding)"))
            continue
        # a run that rounds far less than modelled at one size (q << 1: the model rounds a sum the kernel keeps in
        # f32) is no baseline for growth: q is floored at 1 / IMPLEMENTATION_FACTOR. Behind kinks the normwise errors
        # hold branch flips -- whole terms, as many as the rounding happens to flip, in fn and in the replicas alike
        # -- so q is the part no flip explains (LeafStatistics.flip_free_ratio, as the norm test judges it). On the
        # H100, conv2d[pallas]'s dx read 0.25 then 1.8 with flips in: a 7.2x "growth" (limit 5.9) made of flips
        q = [max(_trend_ratio(lf), 1 / IMPLEMENTATION_FACTOR) for lf in leaves]
        first, last = leaves[0].stats, leaves[-1].stats
        band = math.sqrt(float(sps.f.isf(TREND_ALPHA / 2, last.dof, last.replicas * last.dof))
                         * float(sps.f.isf(TREND_ALPHA / 2, first.replicas * first.dof, first.dof)))
        limit = TREND_DRIFT * band
        growth = q[-1] / q[0] if q[0] > 0 else (1.0 if q[-1] == 0 else math.inf)
        series = ", ".join(f"{s}: {v:.2g}" for s, v in zip(sizes, q))
        ok = growth <= limit
        detail = (f"error / modelled {run} rounding {series}; growth {growth:.2g}x (limit {limit:.2g})"
                  + ("" if ok else ": grows faster than rounding -- a bug that scales with the problem"))
        checks.append(Check(f"error vs size {name}", ok, detail))
    return checks


def audit(
    fn: Callable[..., Any],
    reference: Callable[..., Any],
    make_args: Callable[[jax.Array, Any], tuple],
    sizes: Sequence[Any],
    *,
    seed: int = 0,
    name: str | None = None,
    **check_options: Any,
) -> AuditReport:
    """Run :func:`check_vjp` at each size, then the size trend.

    Args:
      fn, reference: as for :func:`check_vjp`.
      make_args: ``(key, size) -> tuple of args``; should draw white noise with asymmetric shapes.
      sizes: increasing problem sizes (whatever ``make_args`` understands).
    """
    if not sizes:
        raise ValueError("audit: 'sizes' must name at least one problem size")
    label = name or f"{getattr(fn, '__name__', 'fn')} vs {getattr(reference, '__name__', 'reference')}"
    reports = []
    for i, size in enumerate(sizes):
        args = tuple(make_args(jax.random.key(seed + 1000 * i), size))
        reports.append(check_vjp(fn, reference, *args, seed=seed, name=f"{label} @ {size}", **check_options))
    trend = _size_trend(list(sizes), reports)
    passed = all(r.passed for r in reports) and all(c.passed for c in trend)
    return AuditReport(name=label, sizes=list(sizes), reports=reports, trend=trend, passed=passed)
