r"""Grid updates and refinement of KAN layers (pykan's ``update_grid_from_samples`` / ``refine``, efficient-kan's
``update_grid``), with an exact treatment of ``spline_scaler``.

New knots from samples
----------------------
For every input feature ``i`` the ``n`` samples are sorted and two knot rows of ``G + 1`` knots are mixed
(pykan / efficient-kan):

* adaptive: the sample quantiles ``x_sorted[int(n / G * j)]`` for ``j < G``, plus the last (largest) sample;
* uniform: ``min - margin + j * h`` with ``h = (max - min + 2 * margin) / G``;
* ``grid = grid_eps * uniform + (1 - grid_eps) * adaptive``, extended by ``k`` knots on each side with the uniform
  step ``h`` (efficient-kan's extension).

``overhang = J`` (0 in pykan and efficient-kan) shrinks the uniform knots so that the samples reach ``J`` intervals
past them into the extension on each side: ``h = (max - min + 2 * margin) / (G + 2J)``, knots ``min - margin + (J +
j) h``. On its core ``[t_k, t_{G+k}]`` a knot row's B-splines sum to 1, so an edge's space holds the constants; with
``J > 0`` the samples' ends lie where they do not, and that dimension goes to the shape instead (a node sums its
edges, so one constant is enough). ``J`` is at most ``k``: further out no basis reaches.

Both rows are non-decreasing, so the mix is sorted; with ``grid_eps > 0`` and ``h > 0`` it is strictly increasing
even when samples repeat. If an input has no spread at all (``h == 0``: every sample equal *and* ``margin == 0``)
there is nothing to adapt to, and that input keeps its old grid row and its old coefficients.

Refit, and the scaler
---------------------
The spline part of edge ``(o, i)`` is :math:`s_{oi} \sum_m w_{oim} B_m(x_i)` with ``s = spline_scaler`` and
``w = spline_weight``. The new weights are the least-squares fit, on the samples and on the *new* bases, of the
**unscaled** old curves :math:`\sum_m w_{oim} B^{old}_m(x_i)`, and ``spline_scaler`` is left unchanged. Since
least squares is linear in the target, ``s * lstsq(B_new, curve_unscaled) == lstsq(B_new, s * curve_unscaled)``:
this is exactly the fit of the layer's scaled spline output, with no division by ``s`` (edges whose scaler is 0
keep a meaningful weight and still contribute 0). efficient-kan instead fits the *scaled* curves and stores the
result in the unscaled ``spline_weight``, so after its update the scaler is applied twice and edge ``(o, i)``'s
spline output is multiplied by ``s_oi``; we do not reproduce that.

The least-squares solve is :func:`jaxgrad.kan.spline.curve_to_coefficients` (SVD ``lstsq``, minimum-norm), so
duplicate samples, a single distinct sample, or fewer samples than the ``G + k`` bases give a valid
(minimum-norm) fit instead of an error. The base branch (``base_weight * silu``) and ``bias`` do not depend on the
grid and are unchanged; the layer output on the samples is therefore preserved up to the least-squares residual of
the spline part (exactly where the old spline lies in the new spline space, e.g. on the samples when there are at
most ``G + k`` distinct ones per input, or after a nested refinement).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.kan.layer import check_params, kan_linear_reference
from jaxgrad.kan.spline import bspline_basis, curve_to_coefficients

__all__ = ["grid_from_samples", "refine", "refine_network", "update_grid", "update_grids"]


def _check_finite(x, name: str = "x") -> None:
    if isinstance(x, jax.core.Tracer):  # under jit the check is the caller's business
        return
    finite = np.isfinite(np.asarray(x))
    if not finite.all():
        bad = int(finite.size - finite.sum())
        raise ValueError(f"KAN grid update: '{name}' contains {bad} non-finite value(s) (NaN/Inf); the knots are "
                         f"sample quantiles and would be NaN")


def _as_samples(params, x, name="x"):
    x = jnp.asarray(x)
    check_params(params, x)
    x = x.reshape(-1, x.shape[-1])
    if x.shape[0] < 1:
        raise ValueError(f"KAN grid update: '{name}' has no samples")
    _check_finite(x, name)
    return x


def _extend(core: jax.Array, h: jax.Array, k: int) -> jax.Array:
    """``core[in, G+1]`` -> ``[in, G+2k+1]``: ``k`` knots of step ``h[in]`` added on each side."""
    steps = jnp.arange(1, k + 1, dtype=core.dtype)
    left = core[:, :1] - h[:, None] * steps[::-1]
    right = core[:, -1:] + h[:, None] * steps
    return jnp.concatenate([left, core, right], axis=1)


def grid_from_samples(x: jax.Array, grid_size: int, spline_order: int, *, grid_eps: float = 0.02,
                      margin: float = 0.01, overhang: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """pykan's adaptive/uniform knot mix from samples ``x[n, in]``; ``overhang`` (a number in ``[0, k]``): the
    intervals by which the samples reach past the uniform knots on each side (module docstring).

    Returns ``(grid[in, G+2k+1], h[in])``; ``h == 0`` marks an input without spread (see the module docstring).
    """
    n = x.shape[0]
    G, k = int(grid_size), int(spline_order)
    _check_overhang(overhang, k)
    xs = jnp.sort(x, axis=0)  # [n, in]
    ids = [int(n / G * j) for j in range(G)] + [n - 1]
    adaptive = xs[np.asarray(ids)].T  # [in, G+1]
    lo, hi = xs[0], xs[-1]
    h = (hi - lo + 2 * margin) / (G + 2 * overhang)  # [in]
    uniform = (lo - margin)[:, None] + h[:, None] * (overhang + jnp.arange(G + 1, dtype=x.dtype))
    core = grid_eps * uniform + (1 - grid_eps) * adaptive
    return _extend(core, h, k), h


def _check_overhang(overhang, k) -> None:
    if isinstance(overhang, jax.core.Tracer):  # under jit the caller checked it
        return
    if isinstance(overhang, bool) or not isinstance(overhang, (int, float, np.integer, np.floating)) \
            or not 0 <= float(overhang) <= k:
        raise ValueError(f"KAN grid update: 'overhang' must be a number in [0, spline_order = {k}] (knot intervals "
                         f"by which the samples reach past the uniform knots), got {overhang!r}")


def _refit(params, x, new_grid, keep_rows=None):
    """New ``spline_weight`` on ``new_grid`` reproducing the unscaled spline curves of ``params`` at ``x``."""
    k = check_params(params, x)
    sw = params["spline_weight"]
    dt = jnp.result_type(x.dtype, sw.dtype)
    x = x.astype(dt)
    old = bspline_basis(x, params["grid"].astype(dt), k)  # [n, in, nb_old]
    curves = jnp.einsum("nim,oim->nio", old, sw.astype(dt))  # unscaled spline curve of every edge
    new_sw = curve_to_coefficients(x, curves, new_grid.astype(dt), k)  # [out, in, nb_new]
    if keep_rows is not None:
        new_sw = jnp.where(keep_rows[None, :, None], sw.astype(dt), new_sw)
    return new_sw.astype(sw.dtype)


@jax.jit
def _update_grid_impl(params, x, grid_eps, margin, overhang=0.0):
    k = check_params(params)
    G = params["spline_weight"].shape[-1] - k
    grid = params["grid"]
    dt = jnp.result_type(x.dtype, grid.dtype)
    new_grid, h = grid_from_samples(x.astype(dt), G, k, grid_eps=grid_eps, margin=margin, overhang=overhang)
    degenerate = ~(h > 0)
    new_grid = jnp.where(degenerate[:, None], grid.astype(dt), new_grid)
    out = dict(params)
    out["spline_weight"] = _refit(params, x, new_grid, keep_rows=degenerate)
    out["grid"] = new_grid.astype(grid.dtype)
    return out


def update_grid(params: dict[str, jax.Array], x: jax.Array, *, grid_eps: float = 0.02,
                margin: float = 0.01, overhang: float = 0.0) -> dict[str, jax.Array]:
    """Adapt the layer's grid to samples ``x[..., in]`` and refit ``spline_weight`` (see the module docstring;
    ``overhang``: the samples reach that many intervals past the uniform knots, 0 as pykan).

    Returns a new params dict (same shapes and dtypes; ``spline_scaler``, ``base_weight``, ``bias`` unchanged).
    Raises ``ValueError`` naming ``'x'`` when ``x`` has NaN/Inf (checked when ``x`` is concrete; under an outer
    ``jit`` that check is skipped). Compiled once per shape.
    """
    x = _as_samples(params, x)
    _check_overhang(overhang, check_params(params))
    return _update_grid_impl(params, x, grid_eps, margin, overhang)


def _interpolate_knots(grid: jax.Array, k: int, new_G: int) -> tuple[jax.Array, jax.Array]:
    """New interior knots by piecewise-linear interpolation of the old interior knots (keeps the range and the
    knot density of an adapted grid; a uniform grid stays uniform). Returns ``(grid[in, new_G+2k+1], h[in])``."""
    core = grid[:, k:grid.shape[1] - k]  # [in, G+1]
    G = core.shape[1] - 1
    pos = jnp.linspace(0.0, G, new_G + 1, dtype=grid.dtype)
    new_core = jax.vmap(lambda row: jnp.interp(pos, jnp.arange(G + 1, dtype=grid.dtype), row))(core)
    h = (core[:, -1] - core[:, 0]) / new_G
    return _extend(new_core, h, k), h


@functools.partial(jax.jit, static_argnums=(1,))
def _refine_samples_impl(params, new_G, x, grid_eps, margin):
    k = check_params(params)
    grid = params["grid"]
    dt = jnp.result_type(x.dtype, grid.dtype)
    new_grid, h = grid_from_samples(x.astype(dt), new_G, k, grid_eps=grid_eps, margin=margin)
    # an input without spread: fall back to the interpolated old grid
    interp, _ = _interpolate_knots(grid.astype(dt), k, new_G)
    new_grid = jnp.where((h > 0)[:, None], new_grid, interp)
    out = dict(params)
    out["spline_weight"] = _refit(params, x, new_grid)
    out["grid"] = new_grid.astype(grid.dtype)
    return out


@functools.partial(jax.jit, static_argnums=(1, 2))
def _refine_dense_impl(params, new_G, n):
    k = check_params(params)
    grid = params["grid"]
    new_grid, _ = _interpolate_knots(grid, k, new_G)
    lo, hi = grid[:, k], grid[:, grid.shape[1] - k - 1]
    u = jnp.linspace(0.0, 1.0, n, dtype=grid.dtype)
    samples = lo[None, :] + u[:, None] * (hi - lo)[None, :]
    out = dict(params)
    out["spline_weight"] = _refit(params, samples, new_grid)
    out["grid"] = new_grid
    return out


def refine(params: dict[str, jax.Array], new_grid_size: int, x: jax.Array | None = None, *,
           grid_eps: float = 0.02, margin: float = 0.01, num_samples: int | None = None) -> dict[str, jax.Array]:
    """Grid refinement (pykan's ``refine``): the same layer on ``new_grid_size`` intervals, function preserved by a
    least-squares refit.

    * ``x`` given: the new grid is built from the samples like :func:`update_grid` (pykan's
      ``initialize_grid_from_parent(parent, x)``) and the fit is on ``x``.
    * ``x`` is None: the new interior knots interpolate the old ones (same range ``[t_k, t_{G+k}]`` per input, same
      density), and the fit uses ``num_samples`` (default ``max(201, 8 * (new_G + k))``) evenly spaced points of
      that range. When the old knots are a subset of the new ones (uniform grid, ``new_G`` a multiple of ``G``) the
      function is reproduced exactly on the range.

    The shapes of ``spline_weight`` and ``grid`` change; everything else is unchanged. Refining to a *smaller* grid
    is allowed (a least-squares coarsening).
    """
    k = check_params(params)
    new_G = int(new_grid_size)
    if new_G < 1:
        raise ValueError(f"refine: new_grid_size must be >= 1, got {new_grid_size}")
    if x is not None:
        x = _as_samples(params, x)
        return _refine_samples_impl(params, new_G, x, grid_eps, margin)
    n = int(num_samples) if num_samples is not None else max(201, 8 * (new_G + k))
    return _refine_dense_impl(params, new_G, n)


def _as_list(net_params):
    if isinstance(net_params, dict):
        return [net_params], True
    return list(net_params), False


_forward_layer = jax.jit(kan_linear_reference)


def update_grids(net_params: Sequence[dict[str, jax.Array]], x: jax.Array, *, grid_eps: float = 0.02,
                 margin: float = 0.01, input_overhang: float = 0.0) -> list[dict[str, jax.Array]]:
    """:func:`update_grid` for every layer of a network, each on its own input: ``x`` is propagated through the
    layers *after* each update (so every layer adapts to the inputs it will actually see; since an update preserves
    the output on the samples, this differs from pykan's propagate-once only by the refit residual).

    ``input_overhang``: :func:`update_grid`'s ``overhang`` for the first layer, whose inputs' range the data fix;
    the hidden layers' values move as the network trains, and their knots keep spanning them (overhang 0)."""
    layers, single = _as_list(net_params)
    x = jnp.asarray(x)
    _check_finite(x, "x")
    h = x.reshape(-1, x.shape[-1])
    new = []
    for i, p in enumerate(layers):
        p = update_grid(p, h, grid_eps=grid_eps, margin=margin, overhang=input_overhang if i == 0 else 0.0)
        new.append(p)
        h = _forward_layer(p, h)
    return new[0] if single else new


def refine_network(net_params: Sequence[dict[str, jax.Array]], new_grid_size: int, x: jax.Array | None = None, *,
                   grid_eps: float = 0.02, margin: float = 0.01) -> list[dict[str, jax.Array]]:
    """:func:`refine` for every layer. With ``x``, the samples are propagated through the refined layers;
    without, each layer refines on its own grid range."""
    layers, single = _as_list(net_params)
    if x is None:
        new = [refine(p, new_grid_size) for p in layers]
        return new[0] if single else new
    x = jnp.asarray(x)
    _check_finite(x, "x")
    h = x.reshape(-1, x.shape[-1])
    new = []
    for p in layers:
        p = refine(p, new_grid_size, h, grid_eps=grid_eps, margin=margin)
        new.append(p)
        h = _forward_layer(p, h)
    return new[0] if single else new
