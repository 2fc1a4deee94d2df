r"""One gradient leaf against its float64 reference: the per-entry gate and the verdict (:class:`LeafResult`).

Per entry, the error over the entry's sum of |terms| :math:`M_i` must stay within the rounding bound of the run's
precision (plus, behind kinks, the jump of a branch the rounding may flip); the statistical verdict of
:mod:`jaxgrad.verify.stats` decides where a rounding model exists. A failing leaf is searched for a structured error
(:mod:`jaxgrad.verify.diagnose`). Norms are taken without overflow (:func:`norm2`).
"""

from __future__ import annotations

import math

import numpy as np

from jaxgrad.verify import precision as prec
from jaxgrad.verify.diagnose import diagnose
from jaxgrad.verify.report import LeafResult


def _normalized_error(a: np.ndarray, b: np.ndarray, m: np.ndarray) -> np.ndarray:
    tiny = 1e-300 + 1e-30 * float(np.max(m, initial=0.0))
    return np.abs(a - b) / (m + tiny)


def norm2(x) -> float:
    """``||x||_2`` in float64 without overflow or underflow: scaled by ``max|x|`` first. ``np.linalg.norm`` squares
    the entries, so past ~1e154 its sum is inf: the magnitudes ``sum|terms|`` of a bf16 LoRA block on the GPU (RMSNorm
    and softmax chains, plus kink jumps) got there, and a leaf's ``kappa`` read inf with numpy's overflow warning.
    Non-finite entries give inf (or nan), as ``np.linalg.norm`` does."""
    x = np.asarray(x, np.float64).ravel()
    s = float(np.max(np.abs(x), initial=0.0))
    if s == 0.0 or not math.isfinite(s):
        return float(np.linalg.norm(x)) if not math.isfinite(s) else 0.0
    return s * float(np.linalg.norm(x / s))


def _rel_err(g: np.ndarray, r: np.ndarray) -> float:
    """Normwise relative error ||g - r|| / ||r|| (0 when both are zero, inf when only r is)."""
    rn, gn = norm2(r), norm2(g)
    return norm2(g - r) / rn if rn > 0 else (0.0 if gn == 0 else math.inf)


def _leaf_result(name, run, g, r, m, model: prec.ErrorModel, n_terms: int, stats=None, kink=None,
                 modelled_rel=None) -> LeafResult:
    """Compare ``g`` with the float64 reference ``r`` (sum|terms| ``m``).

    Two gates. Per entry: ``|g - r| <= bound m + K`` (``kink``: the absolute branch-flip term ``K`` of
    magnitude.py, or ``None``; ``m`` is replaced by ``m + K / bound`` throughout). Statistical (``stats``, a
    :class:`~jaxgrad.verify.stats.LeafStatistics` of the as-called run, or ``None`` for float64 rows): the error must
    be distributed like rounding at the run's precision (norm, scale, entries, slices). ``modelled_rel``: the
    emulated reference's RMS normwise error at that precision, for the report."""
    g, r, m = (np.asarray(x, np.float64) for x in (g, r, m))
    if kink is not None:
        m = m + np.asarray(kink, np.float64) / model.bound(n_terms)
    diff = g - r
    rn, gn = norm2(r), norm2(g)
    rel = _rel_err(g, r)
    cos = (float(np.vdot(g.ravel() / gn, r.ravel() / rn))
           if gn > 0 and rn > 0 and math.isfinite(gn) and math.isfinite(rn) else (1.0 if gn == rn else 0.0))
    maxg = float(np.max(np.abs(r), initial=0.0))
    maxabs = float(np.max(np.abs(diff), initial=0.0)) / maxg if maxg > 0 else float(np.max(np.abs(diff), initial=0))
    if np.any(~np.isfinite(g)):
        ne = np.full(g.shape, np.inf)
    else:
        ne = _normalized_error(g, r, m)
    worst = float(np.max(ne, initial=0.0))
    bound = model.bound(n_terms)
    passed = worst <= bound
    stats_ok = stats is None or stats.passed
    if stats is not None and stats_ok and not passed:
        # The statistics judge every entry against the modelled rounding of that entry at this precision, with a
        # threshold from the stated false-alarm rate; the per-entry sum|terms| bound is a hand-set worst case that
        # does not model f16's range (flushed tiny operands) or a kernel's own summation. Where a model exists it
        # decides; the exceedance is still reported.
        passed = True
        verdict, diag = (f"matches to rounding (per-entry bound exceeded, {worst / bound:.1f}x at "
                         f"{tuple(int(i) for i in np.unravel_index(int(np.argmax(ne)), ne.shape))}, but every entry "
                         "is within its modelled rounding)"), None
    elif passed and stats_ok and stats is not None and stats.undetermined:
        verdict, diag = f"UNDETERMINED at {model.precision}: {stats.undetermined_text()}", None
    elif passed and stats_ok:
        verdict, diag = "matches to rounding", None
    elif not passed:
        diag = diagnose(g, r, m, bound) if np.all(np.isfinite(g)) else None
        what = diag.message if diag is not None else "non-finite values"
        verdict = f"BUG: {worst:.2e}*sum|terms| is {worst / bound:.0f}x the rounding bound; {what}"
    else:
        # Every entry is within the (loose) per-entry bound: diagnose on the scale the statistics allow, i.e. a
        # transform explains the error when what remains is at most the modelled rounding of this leaf.
        scale = min(bound, worst * (modelled_rel or 0.0) / rel) if rel > 0 else bound
        diag = diagnose(g, r, m, max(scale, 1e-300)) if np.all(np.isfinite(g)) else None
        what = f"; {diag.message}" if diag is not None else ""
        verdict = (f"BUG (statistics at {model.precision}): {stats.failure_text()}; every entry is within the "
                   f"per-entry bound ({worst:.2e} <= {bound:.1e} x sum|terms|){what}")
    worst_idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(ne)), ne.shape)) if ne.size else ()
    undetermined = bool(passed and stats_ok and stats is not None and stats.undetermined)
    return LeafResult(name=name, run=run, shape=tuple(g.shape), rel_err=rel, max_abs_ratio=maxabs, cosine=cos,
                      normalized_err=worst, median_normalized_err=float(np.median(ne)) if ne.size else 0.0,
                      worst_index=worst_idx, bound=bound, bound_source=model.formula(), n_terms=n_terms,
                      kappa=norm2(m) / rn if rn > 0 else math.inf, passed=passed and stats_ok and not
                      undetermined, verdict=verdict, diagnosis=diag, ref_rel_err=modelled_rel, stats=stats,
                      undetermined=undetermined)
