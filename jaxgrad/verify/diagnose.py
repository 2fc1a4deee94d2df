"""Name the bug: search the layout transforms that turn the reference gradient into the one under test.

The seed users lost weeks to gradients that were right up to a layout: a spatially flipped kernel (convolution vs
cross-correlation), axes transposed or memory reinterpreted in the wrong order (OIHW vs HWIO, row- vs
column-major), a one-pixel shift (padding offset), a constant factor (a missing spline order ``p``, a mean instead
of a sum, a sign), or simply zeros. For a failing gradient ``g`` and reference ``r`` we score each candidate
``T(r)`` by ``max |g - T(r)| / T(M)`` (the same normalisation as the verdict); one that falls to rounding level
names the bug. Nothing matching points to a missing or extra term.
"""

from __future__ import annotations

import dataclasses
import itertools
from fractions import Fraction

import numpy as np

__all__ = ["Diagnosis", "diagnose"]

_MAX_SEARCH_SIZE = 4_000_000  # elements; larger leaves get only the cheap checks


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    kind: str | None  # "zero", "scale", "flip", "transpose", "shift", "permutation" or None
    message: str
    error: float  # normalized error remaining after the transform


def _err(g, t, m):
    tiny = 1e-300 + 1e-30 * float(np.max(m, initial=0.0))
    return float(np.max(np.abs(g - t) / (m + tiny), initial=0.0))


def _fraction_text(alpha: float) -> str:
    if abs(alpha) < 1e-12:
        return "0"
    for value, text in ((alpha, None), (1 / alpha, "1/")):
        fr = Fraction(value).limit_denominator(64)
        if abs(float(fr) - value) <= 1e-6 * abs(value) and abs(fr.numerator) <= 4096:
            s = str(fr) if text is None else f"1/({fr})" if fr.denominator != 1 else f"1/{fr.numerator}"
            return s.replace("1/(-", "-1/(").replace("1/-", "-1/")
    return f"{alpha:.6g}"


def _scale_message(alpha: float) -> str:
    text = _fraction_text(alpha)
    hint = ""
    if alpha < 0:
        hint = " (sign flipped" + ("" if abs(alpha + 1) < 1e-9 else " and scaled") + ")"
    elif abs(alpha - 1) < 1e-2:
        hint = f" (a systematic {alpha - 1:+.2e} relative error)"
    elif alpha < 1 and abs(1 / alpha - round(1 / alpha)) < 1e-6:
        hint = f" (averaged over {round(1 / alpha)} instead of summed? a missing factor?)"
    elif abs(alpha - round(alpha)) < 1e-6:
        hint = f" (a factor {round(alpha)} too many? e.g. a spline order p counted twice)"
    return f"matches the reference times {text}{hint}"


def _candidates(r: np.ndarray, m: np.ndarray, shape: tuple[int, ...]):
    """Yield (kind, description, T(r), T(m)) for the layout transforms."""
    nd = r.ndim
    axes = [a for a in range(nd) if r.shape[a] > 1]
    for k in range(1, len(axes) + 1):
        for sub in itertools.combinations(axes, k):
            yield "flip", f"a spatial flip of axes {sub}", np.flip(r, sub), np.flip(m, sub)
    if 2 <= nd <= 5:
        for perm in itertools.permutations(range(nd)):
            if perm == tuple(range(nd)):
                continue
            rt, mt = r.transpose(perm), m.transpose(perm)
            if rt.shape == shape:
                yield "transpose", f"an axis transpose {perm}", rt, mt
            else:
                yield ("transpose", f"a memory-order reinterpretation (reference transposed {perm} then reshaped "
                                    f"to {shape})", rt.reshape(shape), mt.reshape(shape))
        # Column-major (Fortran) reading of row-major memory.
        yield ("transpose", "a Fortran/C memory-order mix-up (column-major reshape)",
               r.reshape(shape[::-1]).T if r.size == int(np.prod(shape)) else r,
               m.reshape(shape[::-1]).T if m.size == int(np.prod(shape)) else m)
    for a in axes:
        for s in (1, -1):
            rs, ms = np.roll(r, s, axis=a), np.roll(m, s, axis=a)
            yield "shift", f"a circular shift by {s:+d} along axis {a}", rs, ms
            rs = rs.copy()
            idx = [slice(None)] * nd
            idx[a] = slice(0, 1) if s == 1 else slice(-1, None)
            rs[tuple(idx)] = 0.0
            yield "shift", f"a shift by {s:+d} along axis {a} (zero fill: a padding offset)", rs, ms


def diagnose(g: np.ndarray, r: np.ndarray, m: np.ndarray, bound: float) -> Diagnosis:
    """Explain why ``g`` (under test) differs from ``r`` (reference); ``m`` is sum|terms| of ``r``."""
    g, r, m = (np.asarray(a, np.float64) for a in (g, r, m))
    e0 = _err(g, r, m)
    accept = max(4 * bound, 1e-3 * e0)
    rn = float(np.linalg.norm(r))
    gn = float(np.linalg.norm(g))
    if gn <= 1e-6 * rn:
        return Diagnosis("zero", "the gradient is (almost) zero: the term was dropped, never written, or masked out",
                         _err(g, np.zeros_like(r), m))
    if rn == 0.0:
        return Diagnosis(None, "the reference gradient is zero but this one is not: an extra term", e0)
    alpha = float(np.vdot(g.ravel(), r.ravel()) / (rn * rn))
    e_scale = _err(g, alpha * r, abs(alpha) * m)
    if e_scale <= accept and abs(alpha - 1) > 0:
        return Diagnosis("scale", _scale_message(alpha), e_scale)
    best = None
    if r.size <= _MAX_SEARCH_SIZE and r.ndim >= 1:
        for kind, text, rt, mt in _candidates(r, m, g.shape):
            e = _err(g, rt, mt)
            if best is None or e < best[0]:
                best = (e, kind, text)
            if e <= accept:
                return Diagnosis(kind, f"matches the reference after {text}", e)
        gs, rs = np.sort(g.ravel()), np.sort(r.ravel())
        if _err(gs, rs, np.full_like(rs, float(np.max(m)))) <= accept:
            return Diagnosis("permutation", "holds the right values in the wrong places (sorted values match): an "
                                            "indexing or layout bug", 0.0)
    cos = float(np.vdot(g.ravel(), r.ravel()) / (gn * rn))
    msg = (f"no layout transform or constant factor explains it (cosine {cos:.4f}, norm ratio {gn / rn:.4f}): "
           "a missing, extra or wrong term")
    return Diagnosis(None, msg, e0)
