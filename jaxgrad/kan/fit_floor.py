r"""The least error a ``[d, 1, 1]`` KAN of a fixed grid reaches on ``f(x) = F(sum_i u_i(x_i))``: the floor of pykan's
Example 1 (``exp(sin(pi x) + y^2)``) at ``G = 3``, computed rather than searched for with training schedules.

Edge spaces. An edge of input ``x_i`` computes an element of
:math:`V_i = \operatorname{span}\{B_0(x_i), \dots, B_{G+k-1}(x_i), \operatorname{silu}(x_i)\}`: the layer's ``G + k``
B-splines on its knot row and its SiLU base term (:func:`jaxgrad.kan.layer.kan_linear_reference`; the scaler only
rescales). The knots are not trained; a *placement* says where grid updates put them
(:func:`jaxgrad.kan.grid.update_grids`): ``grid_eps`` mixes uniform knots over the samples' range (1, pykan's
default) with their quantiles (0), and ``input_overhang = J`` > 0 shrinks the input layer's uniform knots so that the
samples reach ``J`` intervals past them into the ``k`` extension intervals on each side.

1. **Linearised floor** (:func:`linearised_floor`). The hidden node's offset is free (the outer edge's knots follow
   the hidden values, so ``h + c`` through knots moved by ``c`` is the same network), hence each inner edge
   approximates ``u_i`` up to a constant. With the outer function exact, the network's error is, to first order in
   the inner edges' residuals :math:`r_i = v_i - u_i`, :math:`F'(s) \sum_i r_i(x_i)`, whose least mean square over
   the samples is one weighted least-squares problem over the stacked edge spaces and a constant:

   .. math::

       \min_{v_i \in V_i,\, c} \frac1n \sum_n F'(s_n)^2 \Bigl(\sum_i v_i(x_{ni}) + c - s_n\Bigr)^2, \qquad
       s_n = \sum_i u_i(x_{ni}).

   Its square root estimates the floor and says which edge limits it. It is not a bound: the outer edge, itself a
   spline, may trade its error against the inner ones. (On the knots' core the B-splines sum to 1, so the constant
   is in :math:`V_i` already; it matters when the samples reach the extension intervals.)
2. **Joint fit** (:func:`joint_fit`). The network's edges start at least-squares fits (inner edges to ``u_i``, the
   outer edge to ``F`` on the hidden values, each on knots placed from its samples), or at a perturbation of them,
   or at :func:`jaxgrad.kan.kan_init`'s pykan init. Then ``rounds`` times: L-BFGS over every trained parameter with
   the grids fixed (scipy's L-BFGS-B in float64, to a gradient of ``1e-14`` or ``max_iter`` iterations), then a
   grid update of every layer from the samples (the placement), so the outer grid follows the hidden node; a last
   L-BFGS ends it. The best of the restarts is what this model reaches with that placement.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.kan.grid import grid_from_samples, update_grids
from jaxgrad.kan.network import kan_apply_reference, kan_init
from jaxgrad.kan.spline import bspline_basis

__all__ = ["Placement", "edge_design", "joint_fit", "linearised_floor", "place_grids", "start_network"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where grid updates put the knots: ``grid_eps`` and ``input_overhang`` as
    :func:`~jaxgrad.kan.grid.update_grids` takes them (``grid_eps`` 1: uniform over the samples' range, 0: their
    quantiles; ``input_overhang`` in ``[0, k]``: intervals of the inputs' range outside the input layer's knots on
    each side, 0 as pykan)."""

    grid_eps: float = 1.0
    input_overhang: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.grid_eps <= 1.0:
            raise ValueError(f"Placement: 'grid_eps' must be in [0, 1], got {self.grid_eps}")
        if not 0.0 <= self.input_overhang:
            raise ValueError(f"Placement: 'input_overhang' must be >= 0, got {self.input_overhang}")


def edge_design(x: jax.Array, grid_row: jax.Array, spline_order: int) -> jax.Array:
    """``[n, G+k+1]``: an edge's ``G + k`` bases at ``x[n]`` on ``grid_row[G+2k+1]``, then ``silu(x)``."""
    basis = bspline_basis(x[:, None], grid_row[None, :], spline_order)[:, 0, :]
    return jnp.concatenate([basis, jax.nn.silu(x)[:, None]], axis=1)


def linearised_floor(x: jax.Array, inner: Sequence[Callable], outer_slope: Callable, grids: jax.Array,
                     spline_order: int) -> dict:
    """The linearised floor (module docstring, 1.) on samples ``x[n, d]`` with ``grids[d, G+2k+1]``.

    ``inner[i]`` is ``u_i`` (vectorised), ``outer_slope`` is ``F'``. Returns ``{"rmse": ...}`` and, per input,
    ``"edge_rmse"``: the plain (unweighted) least-squares residual of ``u_i`` in ``V_i`` plus a constant alone."""
    x = jnp.asarray(x)
    u = [f(x[:, i]) for i, f in enumerate(inner)]
    s = sum(u)
    one = jnp.ones((x.shape[0], 1), x.dtype)
    designs = [jnp.concatenate([edge_design(x[:, i], grids[i], spline_order), one], axis=1)
               for i in range(x.shape[1])]
    w = outer_slope(s)
    a = jnp.concatenate(designs, axis=1) * w[:, None]
    coef = jnp.linalg.lstsq(a, s * w)[0]
    edge = []
    for d, ui in zip(designs, u):
        c = jnp.linalg.lstsq(d, ui)[0]
        edge.append(float(jnp.sqrt(jnp.mean((d @ c - ui) ** 2))))
    return {"rmse": float(jnp.sqrt(jnp.mean((a @ coef - s * w) ** 2))), "edge_rmse": edge}


def _layer(grid, coef):
    """A layer of one output from ``coef[in, G+k+1]`` (spline coefficients, then the base weight); scaler 1."""
    return {"base_weight": coef[None, :, -1], "spline_weight": coef[None, :, :-1],
            "spline_scaler": jnp.ones((1, coef.shape[0]), coef.dtype), "grid": grid}


def place_grids(params, x, placement: Placement):
    """Every layer's grid updated from its samples (:func:`~jaxgrad.kan.grid.update_grids`)."""
    return update_grids(params, x, grid_eps=placement.grid_eps, input_overhang=placement.input_overhang)


def start_network(x, inner: Sequence[Callable], outer: Callable, grid_size: int, spline_order: int,
                  placement: Placement):
    """``[d, 1, 1]`` parameters whose edges are least-squares fits: input ``i``'s edge to ``u_i`` up to a constant
    (the constant is dropped: the outer edge's knots follow the hidden values), the outer edge to ``F`` at the
    hidden values; each layer's knots placed from its samples."""
    x = jnp.asarray(x)
    k = spline_order
    g0 = grid_from_samples(x, grid_size, k, grid_eps=placement.grid_eps, overhang=placement.input_overhang)[0]
    one = jnp.ones((x.shape[0], 1), x.dtype)
    coefs = [jnp.linalg.lstsq(jnp.concatenate([edge_design(x[:, i], g0[i], k), one], axis=1), f(x[:, i]))[0][:-1]
             for i, f in enumerate(inner)]
    first = _layer(g0, jnp.stack(coefs))
    hidden = kan_apply_reference([first], x)
    g1 = grid_from_samples(hidden, grid_size, k, grid_eps=placement.grid_eps)[0]
    c1 = jnp.linalg.lstsq(edge_design(hidden[:, 0], g1[0], k), outer(sum(f(x[:, i]) for i, f in enumerate(inner))))[0]
    return [first, _layer(g1, c1[None])]


def _flat(params):
    return jnp.concatenate([jnp.concatenate([p["spline_weight"][0] * p["spline_scaler"][0][:, None],
                                             p["base_weight"][0][:, None]], axis=1).ravel() for p in params])


def _unflat(v, grids, nb):
    out, at = [], 0
    for g in grids:
        n = g.shape[0] * (nb + 1)
        out.append(_layer(g, v[at:at + n].reshape(g.shape[0], nb + 1)))
        at += n
    return out


def _rmse(params, x, y):
    return float(jnp.sqrt(jnp.mean((kan_apply_reference(params, x) - y) ** 2)))


@functools.partial(jax.jit, static_argnums=2)
def _mse_and_grad(v, grids, nb, x, y):
    return jax.value_and_grad(lambda v: jnp.mean((kan_apply_reference(_unflat(v, grids, nb), x) - y) ** 2))(v)


def _lbfgs(params, x, y, max_iter: int):
    """scipy L-BFGS-B on the train MSE over every trained coefficient, the grids fixed."""
    from scipy.optimize import minimize

    grids = [p["grid"] for p in params]
    nb = params[0]["spline_weight"].shape[-1]

    def f(v):
        val, g = _mse_and_grad(jnp.asarray(v), grids, nb, x, y)
        return float(val), np.asarray(g, dtype=np.float64)

    res = minimize(f, np.asarray(_flat(params), np.float64), jac=True, method="L-BFGS-B",
                   options={"maxiter": max_iter, "maxfun": 2 * max_iter, "ftol": 1e-16, "gtol": 1e-14, "maxcor": 30})
    return _unflat(jnp.asarray(res.x), grids, nb), int(res.nit)


def joint_fit(data, inner: Sequence[Callable], outer: Callable, *, grid_size: int = 3, spline_order: int = 3,
              placement: Placement = Placement(), restarts: int = 8, random_inits: int = 4, noise: float = 0.1,
              rounds: int = 4, max_iter: int = 5000, seed: int = 0) -> dict:
    """The joint fit (module docstring, 2.) on ``data = (x_train, y_train, x_test, y_test)`` (float64).

    Starts: the least-squares network, ``restarts - 1`` copies of it with every coefficient ``c`` moved by
    ``noise * |c| * N(0, 1)``, and ``random_inits`` pykan inits. Returns the best start's ``train_rmse`` /
    ``test_rmse`` (best by train RMSE, as a fit would choose), every start's, and the least-squares start's RMSE."""
    xtr, ytr, xte, yte = (jnp.asarray(a, jnp.float64) for a in data)
    k = spline_order
    base = start_network(xtr, inner, outer, grid_size, k, placement)
    rng = np.random.default_rng(seed)
    starts = [("least_squares", base)]
    for r in range(1, restarts):
        v = _flat(base)
        v = v + noise * jnp.abs(v) * jnp.asarray(rng.standard_normal(v.shape))
        starts.append((f"perturbed_{r}", _unflat(v, [p["grid"] for p in base], base[0]["spline_weight"].shape[-1])))
    for r in range(random_inits):
        net = kan_init(jax.random.key(seed + r), [xtr.shape[1], 1, 1], dtype=jnp.float64, grid_size=grid_size,
                       spline_order=k, init="pykan")
        starts.append((f"pykan_init_{r}", place_grids(net, xtr, placement)))
    runs = []
    for name, params in starts:
        t0 = time.perf_counter()
        iters = 0
        for _ in range(rounds):
            params, n = _lbfgs(params, xtr, ytr, max_iter)
            iters += n
            params = place_grids(params, xtr, placement)
        params, n = _lbfgs(params, xtr, ytr, max_iter)
        runs.append({"start": name, "train_rmse": _rmse(params, xtr, ytr), "test_rmse": _rmse(params, xte, yte),
                     "lbfgs_iterations": iters + n, "seconds": time.perf_counter() - t0})
    best = min(runs, key=lambda r: r["train_rmse"])
    return {"placement": dataclasses.asdict(placement), "grid_size": grid_size, "spline_order": k,
            "least_squares_start": {"train_rmse": _rmse(base, xtr, ytr), "test_rmse": _rmse(base, xte, yte)},
            "best": best, "runs": runs}
