r"""The symbolic function library and pykan's affine fit :math:`y \approx c\, f(a x + b) + d` (NumPy, float64).

The library (:data:`SYMBOLIC_LIBRARY`) has pykan's ``SYMBOLIC_LIB`` names and complexities. Each entry carries its
function (written once for NumPy and ``jax.numpy``) and its **domain** as a test on an interval: the fit samples
``x`` uniformly on ``[lo, hi]``, so the argument :math:`u = a x + b` sweeps the interval
:math:`[\min(a\,lo + b, a\,hi + b), \max(\dots)]`, and a pair ``(a, b)`` is admissible only if the whole interval lies
in the domain (``log``: :math:`u > 0`; ``sqrt``, ``x^1.5``: :math:`u \ge 0`; ``1/x^n``, ``1/sqrt(x)``: no pole
inside; ``arcsin``: :math:`|u| \le 1`; ``arctanh``: :math:`|u| < 1`; ``tan``: no pole :math:`\pi/2 + k\pi` inside).
pykan instead lets ``torch`` return NaN outside the domain and sets NaN scores to 0, which also admits an
``(a, b)`` whose pole falls between two samples.

The fit (pykan's ``fit_params``): a grid of ``grid_number`` x ``grid_number`` values of ``(a, b)`` on ``a_range`` x
``b_range``; for each admissible pair the score is the squared correlation of :math:`f(a x + b)` with ``y`` (the
:math:`R^2` of the best ``c, d`` for that pair); the window then shrinks to the neighbours of the best pair
(``iterations`` times, pykan's zoom; a best pair on the window's edge shrinks the window to that edge's cell, as in
pykan). Finally ``c, d`` by linear least squares on :math:`f(a x + b)`, and

.. math::

    R^2 = 1 - \frac{\sum_n (y_n - c f(a x_n + b) - d)^2}{\sum_n (y_n - \bar y)^2}
        = \operatorname{corr}\bigl(f(a x + b), y\bigr)^2 .

(pykan adds :math:`10^{-4}` to the denominator of the correlation; here a constant :math:`f` scores 0 exactly.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

__all__ = ["DEFAULT_LIBRARY", "SYMBOLIC_LIBRARY", "AffineFit", "SymbolicFunction", "fit_affine", "library"]


@dataclasses.dataclass(frozen=True)
class SymbolicFunction:
    """One library entry: ``fn(u, xp)`` with ``xp`` = ``numpy`` or ``jax.numpy``; ``domain(lo, hi)`` is True where
    the closed interval ``[lo, hi]`` (arrays) lies in the function's domain; ``complexity`` is pykan's."""

    name: str
    fn: Callable
    complexity: int
    domain: Callable | None = None
    template: str = "{}"

    def formula(self, a: float, b: float, c: float, d: float, var: str = "x", digits: int = 4) -> str:
        """``c*f(a*var + b) + d`` as text, e.g. ``1.0*sin(3.142*x + 0) + 0``."""
        g = lambda v: f"{v:.{digits}g}"  # noqa: E731
        return f"{g(c)}*{self.template.format(f'({g(a)}*{var} + {g(b)})')} + {g(d)}"


def _positive(lo, hi):
    return lo > 0


def _nonnegative(lo, hi):
    return lo >= 0


def _no_zero_inside(lo, hi):
    return (lo > 0) | (hi < 0)


def _unit_closed(lo, hi):
    return (lo >= -1) & (hi <= 1)


def _unit_open(lo, hi):
    return (lo > -1) & (hi < 1)


def _no_tan_pole_inside(lo, hi):
    # poles at pi/2 + k pi: the same k below lo and hi, and neither end on a pole
    k_lo = np.floor((lo - math.pi / 2) / math.pi)
    k_hi = np.floor((hi - math.pi / 2) / math.pi)
    on_pole = np.isclose(np.mod(hi - math.pi / 2, math.pi), 0.0) | np.isclose(np.mod(lo - math.pi / 2, math.pi), 0.0)
    return (k_lo == k_hi) & ~on_pole


def _entry(name, fn, complexity, domain=None, template=None):
    return name, SymbolicFunction(name, fn, complexity, domain, template or (name + "{}"))


SYMBOLIC_LIBRARY: dict[str, SymbolicFunction] = dict([
    _entry("x", lambda u, xp: u, 1, template="{}"),
    _entry("x^2", lambda u, xp: u ** 2, 2, template="{}^2"),
    _entry("x^3", lambda u, xp: u ** 3, 3, template="{}^3"),
    _entry("x^4", lambda u, xp: u ** 4, 3, template="{}^4"),
    _entry("x^5", lambda u, xp: u ** 5, 3, template="{}^5"),
    _entry("1/x", lambda u, xp: 1 / u, 2, _no_zero_inside, "1/{}"),
    _entry("1/x^2", lambda u, xp: 1 / u ** 2, 2, _no_zero_inside, "1/{}^2"),
    _entry("1/x^3", lambda u, xp: 1 / u ** 3, 3, _no_zero_inside, "1/{}^3"),
    _entry("1/x^4", lambda u, xp: 1 / u ** 4, 4, _no_zero_inside, "1/{}^4"),
    _entry("1/x^5", lambda u, xp: 1 / u ** 5, 5, _no_zero_inside, "1/{}^5"),
    _entry("sqrt", lambda u, xp: xp.sqrt(u), 2, _nonnegative),
    _entry("x^0.5", lambda u, xp: xp.sqrt(u), 2, _nonnegative, "sqrt{}"),
    _entry("x^1.5", lambda u, xp: xp.sqrt(u) ** 3, 4, _nonnegative, "{}^1.5"),
    _entry("1/sqrt(x)", lambda u, xp: 1 / xp.sqrt(u), 2, _positive, "1/sqrt{}"),
    _entry("1/x^0.5", lambda u, xp: 1 / xp.sqrt(u), 2, _positive, "1/sqrt{}"),
    _entry("exp", lambda u, xp: xp.exp(u), 2),
    _entry("log", lambda u, xp: xp.log(u), 2, _positive),
    _entry("abs", lambda u, xp: xp.abs(u), 3),
    _entry("sin", lambda u, xp: xp.sin(u), 2),
    _entry("cos", lambda u, xp: xp.cos(u), 2),
    _entry("tan", lambda u, xp: xp.tan(u), 3, _no_tan_pole_inside),
    _entry("tanh", lambda u, xp: xp.tanh(u), 3),
    _entry("sgn", lambda u, xp: xp.sign(u), 3),
    _entry("arcsin", lambda u, xp: xp.arcsin(u), 4, _unit_closed),
    _entry("arccos", lambda u, xp: xp.arccos(u), 4, _unit_closed),
    _entry("arctan", lambda u, xp: xp.arctan(u), 4),
    _entry("arctanh", lambda u, xp: xp.arctanh(u), 4, _unit_open),
    _entry("0", lambda u, xp: u * 0, 0, template="0*{}"),
    _entry("gaussian", lambda u, xp: xp.exp(-u ** 2), 3, template="exp(-{}^2)"),
])

#: pykan's library without the entries that are the same family under ``c f(a x + b) + d`` as an earlier one
#: (``cos(u) = sin(u + pi/2)``, ``arccos(u) = pi/2 - arcsin(u)``, ``x^0.5`` = ``sqrt``, ``1/x^0.5`` = ``1/sqrt(x)``:
#: two members of one family tie up to the grid's resolution, so the ranking between them would be noise) and
#: without ``0`` (a constant edge is reported as ``0`` directly).
DEFAULT_LIBRARY: tuple[str, ...] = tuple(n for n in SYMBOLIC_LIBRARY
                                         if n not in ("cos", "arccos", "x^0.5", "1/x^0.5", "0"))


def library(names=None) -> dict[str, SymbolicFunction]:
    """The entries named by ``names`` (``None``: :data:`DEFAULT_LIBRARY`), in that order. A name may also be a
    :class:`SymbolicFunction` of one's own."""
    if names is None:
        names = DEFAULT_LIBRARY
    if isinstance(names, (str, bytes)):
        raise TypeError(f"symbolic library: 'lib' must be a list of names, got the string {names!r}")
    out = {}
    for n in names:
        if isinstance(n, SymbolicFunction):
            out[n.name] = n
        elif n in SYMBOLIC_LIBRARY:
            out[n] = SYMBOLIC_LIBRARY[n]
        else:
            raise ValueError(f"symbolic library: unknown function {n!r} in 'lib' (known: {list(SYMBOLIC_LIBRARY)})")
    if not out:
        raise ValueError("symbolic library: 'lib' is empty")
    return out


@dataclasses.dataclass(frozen=True)
class AffineFit:
    """``y ~ c * f(a x + b) + d`` with its ``r2`` (NaN if no ``(a, b)`` in the ranges keeps ``a x + b`` in the
    domain on the whole sample interval)."""

    a: float
    b: float
    c: float
    d: float
    r2: float


def _check_range(name, r):
    if (isinstance(r, (str, bytes)) or not hasattr(r, "__len__") or len(r) != 2
            or not all(np.isfinite(float(v)) for v in r) or not float(r[0]) < float(r[1])):
        raise ValueError(f"fit_affine: '{name}' must be a pair (lo, hi) of finite numbers with lo < hi, got {r!r}")
    return float(r[0]), float(r[1])


def fit_affine(x, y, fun: SymbolicFunction | str, *, a_range=(-10.0, 10.0), b_range=(-10.0, 10.0),
               grid_number: int = 101, iterations: int = 3) -> AffineFit:
    """pykan's ``fit_params`` (module docstring): grid search of ``(a, b)`` with zoom, then least squares for
    ``c, d``. ``x``, ``y``: 1-D samples of equal length >= 3 (finite). Runs in float64 NumPy whatever JAX's
    precision is."""
    fun = library([fun])[fun] if isinstance(fun, str) else fun
    if not isinstance(fun, SymbolicFunction):
        raise TypeError(f"fit_affine: 'fun' must be a library name or a SymbolicFunction, got {type(fun).__name__}")
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if x.shape != y.shape or x.size < 3:
        raise ValueError(f"fit_affine: 'x' and 'y' must be 1-D of the same length >= 3, got {x.shape} and {y.shape}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("fit_affine: 'x' and 'y' must be finite")
    if isinstance(grid_number, bool) or not isinstance(grid_number, int) or grid_number < 3:
        raise ValueError(f"fit_affine: 'grid_number' must be an int >= 3, got {grid_number!r}")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"fit_affine: 'iterations' must be an int >= 1, got {iterations!r}")
    a_lo, a_hi = _check_range("a_range", a_range)
    b_lo, b_hi = _check_range("b_range", b_range)
    x_lo, x_hi = float(x.min()), float(x.max())
    yc = y - y.mean()
    syy = float(yc @ yc)
    if syy == 0.0:  # a constant edge: c = 0, d = y; every f fits it
        return AffineFit(1.0, 0.0, 0.0, float(y[0]), 1.0)

    best = None
    for _ in range(iterations):
        a_ = np.linspace(a_lo, a_hi, grid_number)
        b_ = np.linspace(b_lo, b_hi, grid_number)
        r2 = _r2_grid(x, yc, syy, fun, a_, b_, x_lo, x_hi)
        if not np.isfinite(r2).any():
            if best is None:
                return AffineFit(math.nan, math.nan, math.nan, math.nan, math.nan)
            break
        ia, ib = np.unravel_index(np.nanargmax(np.where(np.isfinite(r2), r2, -np.inf)), r2.shape)
        best = (a_[ia], b_[ib])
        a_lo, a_hi = _zoom(a_, ia)
        b_lo, b_hi = _zoom(b_, ib)
    a, b = best
    with np.errstate(all="ignore"):
        f = fun.fn(a * x + b, np)
    fc = f - f.mean()
    sff = float(fc @ fc)
    if not np.isfinite(sff) or sff == 0.0:
        return AffineFit(float(a), float(b), 0.0, float(y.mean()), 0.0)
    c = float(fc @ yc) / sff
    d = float(y.mean() - c * f.mean())
    resid = y - (c * f + d)
    return AffineFit(float(a), float(b), c, d, float(1.0 - (resid @ resid) / syy))


def _zoom(grid, i):
    """pykan's window update: the neighbours of the best point, or the edge cell if it is on the edge."""
    n = grid.shape[0]
    if i == 0:
        return grid[0], grid[1]
    if i == n - 1:
        return grid[-2], grid[-1]
    return grid[i - 1], grid[i + 1]


def _r2_grid(x, yc, syy, fun, a_, b_, x_lo, x_hi):
    """``corr(f(a x + b), y)^2`` on the ``(a, b)`` grid; NaN where ``(a, b)`` leaves the domain."""
    A, Bv = a_[:, None], b_[None, :]
    u1, u2 = A * x_lo + Bv, A * x_hi + Bv
    ok = np.ones((a_.size, b_.size), bool) if fun.domain is None else \
        np.asarray(fun.domain(np.minimum(u1, u2), np.maximum(u1, u2)), bool)
    r2 = np.full(ok.shape, np.nan)
    if not ok.any():
        return r2
    with np.errstate(all="ignore"):
        f = fun.fn(a_[:, None, None] * x[None, None, :] + b_[None, :, None], np)  # [A, B, n]
        f = np.broadcast_to(f, (a_.size, b_.size, x.size))
        fc = f - f.mean(axis=-1, keepdims=True)
        sfy = fc @ yc
        sff = np.einsum("abn,abn->ab", fc, fc)
        val = np.where(sff > 0, sfy * sfy / np.where(sff > 0, sff, 1.0) / syy, 0.0)
    val = np.where(ok & np.isfinite(val), np.minimum(val, 1.0), np.nan)
    return val
