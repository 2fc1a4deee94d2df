r"""B-splines as pykan / efficient-kan / jaxKAN define them: grids, Cox-de Boor bases, their derivative, and the
least-squares fit of coefficients to curves.

Grid. ``G = grid_size`` intervals on ``grid_range = (a, b)``, :math:`h = (b - a)/G`, extended by ``k`` knots on each
side: :math:`t_j = a + (j - k) h`, :math:`j = 0 \dots G + 2k`, one row of ``G + 2k + 1`` knots per input feature
(``grid[in, G+2k+1]``). After a grid update the rows are no longer uniform; everything here works on any
non-decreasing knot row.

Bases (Cox-de Boor, ``k = spline_order`` is the *degree*; cubic is 3), ``G + k`` of them per input:

.. math::

    B^0_j(x) &= [t_j \le x < t_{j+1}] \\
    B^p_j(x) &= \frac{x - t_j}{t_{j+p} - t_j} B^{p-1}_j(x) + \frac{t_{j+p+1} - x}{t_{j+p+1} - t_{j+1}} B^{p-1}_{j+1}(x)

Derivative (the factor :math:`p` and the minus sign are the ones a public JAX KAN got wrong):

.. math::

    \frac{d}{dx} B^p_j(x) = p \left[ \frac{B^{p-1}_j(x)}{t_{j+p} - t_j} - \frac{B^{p-1}_{j+1}(x)}{t_{j+p+1} - t_{j+1}} \right]

Outside :math:`[t_0, t_{G+2k})` every basis is exactly zero (compact support), so the spline part of a KAN layer
fades to zero over one band of ``k`` intervals beyond ``grid_range`` and contributes nothing further out -- as in
pykan and efficient-kan. A zero-width knot interval (coincident knots after an update) contributes zero instead of
dividing by zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["bspline_basis", "bspline_basis_and_derivative", "bspline_basis_derivative", "bspline_basis_elementwise",
           "curve_to_coefficients", "make_grid", "spline_order_of"]


def _is_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _is_real(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def make_grid(in_features: int, grid_size: int, spline_order: int, grid_range=(-1.0, 1.0),
              dtype=jnp.float32) -> jax.Array:
    """Uniform extended grid ``[in_features, grid_size + 2*spline_order + 1]`` (efficient-kan's ``grid`` buffer).

    ``in_features`` and ``grid_size`` must be ints >= 1, ``spline_order`` an int in 1..5 and ``grid_range`` a pair
    of finite numbers ``(lo, hi)`` with ``lo < hi``; anything else raises, naming the argument."""
    for name, value in (("in_features", in_features), ("grid_size", grid_size), ("spline_order", spline_order)):
        if not _is_int(value):
            raise TypeError(f"make_grid: {name} must be an int, got {type(value).__name__} {value!r}")
    if in_features < 1:
        raise ValueError(f"make_grid: in_features must be >= 1 (one knot row per input feature), got {in_features}")
    if (isinstance(grid_range, (str, bytes)) or not hasattr(grid_range, "__len__") or len(grid_range) != 2
            or not all(_is_real(v) for v in grid_range)):
        raise ValueError(f"make_grid: grid_range must be a pair of numbers (lo, hi), got {grid_range!r}")
    lo, hi = float(grid_range[0]), float(grid_range[1])
    if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
        raise ValueError(f"make_grid: grid_range must satisfy lo < hi (finite), got {tuple(grid_range)}")
    if grid_size < 1:
        raise ValueError(f"make_grid: grid_size must be >= 1, got {grid_size}")
    if not 1 <= spline_order <= 5:
        raise ValueError(f"make_grid: spline_order must be in 1..5, got {spline_order}")
    in_features, grid_size, spline_order = int(in_features), int(grid_size), int(spline_order)
    h = (hi - lo) / grid_size
    knots = lo + jnp.arange(-spline_order, grid_size + spline_order + 1, dtype=dtype) * jnp.asarray(h, dtype)
    return jnp.broadcast_to(knots, (in_features, knots.shape[0]))


def spline_order_of(grid: jax.Array, num_bases: int) -> int:
    """``k`` from shapes: a grid row has ``G + 2k + 1`` knots and there are ``G + k`` bases, so ``k = knots - bases - 1``."""
    k = grid.shape[-1] - num_bases - 1
    if not 1 <= k <= 5:
        raise ValueError(f"grid has {grid.shape[-1]} knots per input and spline_weight {num_bases} bases: that implies "
                         f"spline_order {k}, outside 1..5")
    return k


def _safe_div(num, den):
    return jnp.where(den == 0, 0.0, num / jnp.where(den == 0, 1.0, den))


def _cox_de_boor_step(xe, t, b, p):
    """Degree-``p`` bases from the degree-``p-1`` ones ``b`` (the recursion in the module docstring)."""
    left = _safe_div(xe - t[:, : -(p + 1)], t[:, p:-1] - t[:, : -(p + 1)]) * b[..., :-1]
    right = _safe_div(t[:, p + 1:] - xe, t[:, p + 1:] - t[:, 1:-p]) * b[..., 1:]
    return left + right


def _bases_of_degree(x, grid, degree):
    """All ``G + 2k - degree`` bases of ``degree`` at ``x[..., in]``: ``[..., in, G + 2k - degree]``."""
    xe = x[..., None]
    t = grid
    b = ((xe >= t[:, :-1]) & (xe < t[:, 1:])).astype(x.dtype)
    for p in range(1, degree + 1):
        b = _cox_de_boor_step(xe, t, b, p)
    return b


def _bases_by_offset(x, t, degree: int, top: int, nb: int):
    """The recursion written per output basis: for every ``m < nb`` (one ``[..., in, nb]`` array per offset), the
    degree-``top`` bases :math:`B^{top}_{m+o}(x)`, ``o = 0 .. degree - top``, from the ``degree + 1`` indicators
    :math:`B^0_{m+o}`. Each level takes the same operations per entry as :func:`_cox_de_boor_step`, but no array the
    recursion computes is sliced: only the knots are (``t_{m+j}``, ``[in, nb]``), so the program is elementwise
    over ``[..., in, nb]`` and XLA fuses it into the consumer (no level, and no basis, written to memory). Returns
    ``(bases, shifted knots)``."""
    xe = x[..., None]
    tm = [t[:, j:j + nb] for j in range(degree + 2)]  # tm[j][i, m] = t_{m+j}
    b = [((xe >= tm[o]) & (xe < tm[o + 1])).astype(x.dtype) for o in range(degree + 1)]
    for p in range(1, top + 1):
        b = [_raised_by_offset(xe, tm, b[o], b[o + 1], o, p) for o in range(degree + 1 - p)]
    return b, tm


def _raised_by_offset(xe, tm, lo, hi, o: int, p: int):
    """:math:`B^p_{m+o}` from :math:`B^{p-1}_{m+o}` (``lo``) and :math:`B^{p-1}_{m+o+1}` (``hi``), ``tm[j] =
    t_{m+j}``: the Cox-de Boor step of :func:`_cox_de_boor_step`, per output basis."""
    return (_safe_div(xe - tm[o], tm[o + p] - tm[o]) * lo
            + _safe_div(tm[o + p + 1] - xe, tm[o + p + 1] - tm[o + 1]) * hi)


def _derivative_from_lower(t, lower, k):
    """``dB^k_j/dx = k [B^{k-1}_j/(t_{j+k}-t_j) - B^{k-1}_{j+1}/(t_{j+k+1}-t_{j+1})]`` from the degree-(k-1) bases."""
    return k * (_safe_div(lower[..., :-1], t[:, k:-1] - t[:, : -(k + 1)])
                - _safe_div(lower[..., 1:], t[:, k + 1:] - t[:, 1:-k]))


def _check_basis_args(fn: str, x, grid, spline_order, lowest: int) -> int:
    """Trace-time checks (dtypes, shapes, the static order) naming the argument; returns ``spline_order``."""
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn}: 'x' must be a floating-point array (the knots are cast to x's dtype, so an integer "
                        f"x would truncate them), got {getattr(x, 'dtype', type(x).__name__)}")
    if isinstance(spline_order, bool) or not isinstance(spline_order, (int, np.integer)) \
            or not lowest <= spline_order <= 5:
        raise ValueError(f"{fn}: 'spline_order' (the degree k) must be an int in {lowest}..5, got {spline_order!r}")
    if getattr(grid, "ndim", None) != 2 or grid.shape[-1] < spline_order + 2:
        raise ValueError(f"{fn}: 'grid' must have shape [in, G+2k+1] with at least k+2 = {spline_order + 2} knots "
                         f"per row, got {getattr(grid, 'shape', type(grid).__name__)}")
    if x.ndim < 1 or x.shape[-1] != grid.shape[0]:
        raise ValueError(f"{fn}: 'x' must have shape [..., in] with in = {grid.shape[0]} (one input per row of "
                         f"'grid' {tuple(grid.shape)}), got {tuple(x.shape)}")
    return int(spline_order)


def bspline_basis(x: jax.Array, grid: jax.Array, spline_order: int) -> jax.Array:
    """Cox-de Boor bases ``B_m(x)``: ``x[..., in]``, ``grid[in, G+2k+1]`` -> ``[..., in, G+k]`` (efficient-kan's
    ``b_splines``).

    ``x`` must be floating point and ``spline_order`` an int in 0..5 (0: the piecewise-constant indicator bases the
    recursion starts from; a KAN layer uses 1..5); anything else raises, naming the argument."""
    spline_order = _check_basis_args("bspline_basis", x, grid, spline_order, 0)
    return _bases_of_degree(x, grid.astype(x.dtype), spline_order)


def bspline_basis_elementwise(x: jax.Array, grid: jax.Array, spline_order: int) -> jax.Array:
    """:func:`bspline_basis` with the recursion written per output basis (:func:`_bases_by_offset`): the same
    operations per entry (equal to rounding: XLA may contract a product and a sum differently), and a program that is
    elementwise over ``[..., in, G+k]``, which XLA fuses into whatever consumes the bases. About ``(k+1)(k+2)/2``
    values per entry instead of ``k``, and no intermediate array: the form the layer's XLA path uses."""
    spline_order = _check_basis_args("bspline_basis_elementwise", x, grid, spline_order, 0)
    t = grid.astype(x.dtype)
    nb = t.shape[-1] - spline_order - 1
    return _bases_by_offset(x, t, spline_order, spline_order, nb)[0][0]


def bspline_basis_derivative(x: jax.Array, grid: jax.Array, spline_order: int) -> jax.Array:
    """``dB_m/dx`` by the equation in the module docstring: ``[..., in, G+k]`` (``spline_order`` in 1..5)."""
    spline_order = _check_basis_args("bspline_basis_derivative", x, grid, spline_order, 1)
    t = grid.astype(x.dtype)
    return _derivative_from_lower(t, _bases_of_degree(x, t, spline_order - 1), spline_order)


def bspline_basis_and_derivative(x: jax.Array, grid: jax.Array, spline_order: int) -> tuple[jax.Array, jax.Array]:
    """``(bspline_basis, bspline_basis_derivative)`` sharing one recursion up to degree ``k - 1``, written per output
    basis as :func:`bspline_basis_elementwise` is (the same operations per entry: equal to rounding; elementwise
    over ``[..., in, G+k]``, so XLA fuses both into their consumers)."""
    k = _check_basis_args("bspline_basis_and_derivative", x, grid, spline_order, 1)
    t = grid.astype(x.dtype)
    (b0, b1), tm = _bases_by_offset(x, t, k, k - 1, t.shape[-1] - k - 1)
    basis = _raised_by_offset(x[..., None], tm, b0, b1, 0, k)
    # dB^k_m/dx = k [B^{k-1}_m / (t_{m+k} - t_m) - B^{k-1}_{m+1} / (t_{m+k+1} - t_{m+1})]
    return basis, k * (_safe_div(b0, tm[k] - tm[0]) - _safe_div(b1, tm[k + 1] - tm[1]))


def curve_to_coefficients(x: jax.Array, y: jax.Array, grid: jax.Array, spline_order: int,
                          ridge: float = 0.0) -> jax.Array:
    """Least-squares spline coefficients reproducing curves ``y`` at samples ``x``.

    Solves, independently for every input feature ``i``, :math:`\\min_c \\|B_i c - y_i\\|^2 + \\text{ridge}\\|c\\|^2`
    with ``B_i = bspline_basis(x)[:, i, :]`` (``[n, G+k]``). The SVD-based ``lstsq`` returns the minimum-norm
    solution, so bases without samples (rank deficiency, where pykan's lstsq fails and jaxKAN's normal equations
    are singular) get coefficient 0 instead of an error.

    Args:
      x: ``[n, in]`` samples.
      y: ``[n, in, out]`` curve values.
      grid: ``[in, G+2k+1]``.
      ridge: a number >= 0 (0: plain least squares).
    Returns:
      ``[out, in, G+k]`` coefficients (efficient-kan's ``spline_weight`` layout).

    Shapes that do not agree raise at trace time (so also under ``jit``), naming the argument.
    """
    fn = "curve_to_coefficients"
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"{fn}: 'x' must have shape [n, in], got {getattr(x, 'shape', type(x).__name__)}")
    if getattr(y, "ndim", None) != 3 or tuple(y.shape[:2]) != tuple(x.shape):
        raise ValueError(f"{fn}: 'y' must have shape [n, in, out] = [{x.shape[0]}, {x.shape[1]}, out] (the samples "
                         f"of 'x' {tuple(x.shape)}), got {getattr(y, 'shape', type(y).__name__)}")
    if not hasattr(y, "dtype") or not jnp.issubdtype(y.dtype, jnp.floating):
        raise TypeError(f"{fn}: 'y' must be a floating-point array, got {getattr(y, 'dtype', type(y).__name__)}")
    if not (_is_real(ridge) and np.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"{fn}: 'ridge' must be a finite number >= 0, got {ridge!r}")
    a = bspline_basis(x, grid, spline_order)  # [n, in, G+k]
    a = jnp.moveaxis(a, 1, 0)  # [in, n, G+k]
    b = jnp.moveaxis(y, 1, 0)  # [in, n, out]
    if ridge > 0:
        nb = a.shape[-1]
        eye = jnp.sqrt(ridge) * jnp.eye(nb, dtype=a.dtype)
        a = jnp.concatenate([a, jnp.broadcast_to(eye, (a.shape[0], nb, nb))], axis=1)
        b = jnp.concatenate([b, jnp.zeros((b.shape[0], nb, b.shape[-1]), b.dtype)], axis=1)
    coef = jax.vmap(lambda ai, bi: jnp.linalg.lstsq(ai, bi)[0])(a, b)  # [in, G+k, out]
    return jnp.transpose(coef, (2, 0, 1))
