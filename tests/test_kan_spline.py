"""The B-spline bases written per output basis (``bspline_basis_elementwise``, and ``bspline_basis_and_derivative``
which the layer's backward uses): the same values as efficient-kan's recursion (``bspline_basis``,
``bspline_basis_derivative``) to rounding, on uniform and updated grids with coincident knots, at knots and outside
the grid, orders 0..5; and a program that never slices an array it computed (only the knots), so that XLA can fuse
the bases into their consumer instead of writing each level of the recursion to memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

from jaxgrad.kan.spline import (bspline_basis, bspline_basis_and_derivative, bspline_basis_derivative,
                                bspline_basis_elementwise, make_grid)


def _grid_and_x(seed, grid_size, order, dtype):
    rng = np.random.default_rng(seed)
    grid = np.sort(rng.uniform(-1.5, 1.5, (7, grid_size + 2 * order + 1)), axis=1)
    grid[:, 3] = grid[:, 2]  # a zero-width interval, as a grid update can leave
    x = np.concatenate([rng.uniform(-2.0, 2.0, (40, 7)),  # inside, and outside the knots
                        grid.T[: min(9, grid.shape[1])]])  # exactly on knots
    return jnp.asarray(grid, dtype), jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype,ulps", [(jnp.float32, 8), (jnp.float64, 8)])
@pytest.mark.parametrize("order", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("grid_size", [3, 20])
def test_the_elementwise_bases_are_efficient_kans_to_rounding(order, grid_size, dtype, ulps):
    with jax.enable_x64(dtype == jnp.float64):
        grid, x = _grid_and_x(order * 31 + grid_size, grid_size, order, dtype)
        want = np.asarray(jax.jit(lambda x: bspline_basis(x, grid, order))(x))
        got = np.asarray(jax.jit(lambda x: bspline_basis_elementwise(x, grid, order))(x))
        eps = float(jnp.finfo(dtype).eps)
        assert got.shape == want.shape == (x.shape[0], 7, grid_size + order)
        np.testing.assert_allclose(got, want, rtol=0, atol=ulps * eps)  # bases lie in [0, 1]
        assert np.any(want > 0.5) and np.all(got[want == 0] == 0)  # the check can fail; support is kept exactly


@pytest.mark.parametrize("order", [1, 2, 3, 5])
def test_the_basis_and_derivative_pair_equals_the_separate_functions_to_rounding(order):
    with jax.enable_x64(True):
        grid, x = _grid_and_x(order, 5, order, jnp.float64)
        basis, deriv = jax.jit(lambda x: bspline_basis_and_derivative(x, grid, order))(x)
        np.testing.assert_allclose(basis, bspline_basis(x, grid, order), rtol=0, atol=1e-14)
        want = np.asarray(bspline_basis_derivative(x, grid, order))
        np.testing.assert_allclose(deriv, want, rtol=1e-13, atol=1e-13 * np.abs(want).max())


def _computed_from_x(jaxpr, x_var) -> set:
    """The variables of ``jaxpr`` that depend on ``x_var``."""
    dep = {x_var}
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jex_core.Var) and v in dep for v in eqn.invars):
            dep.update(eqn.outvars)
    return dep


@pytest.mark.parametrize("fn", [bspline_basis_elementwise,
                                lambda x, g, k: bspline_basis_and_derivative(x, g, k)])
def test_no_array_computed_from_x_is_sliced_only_the_knots(fn):
    grid = make_grid(4, 5, 3)
    closed = jax.make_jaxpr(lambda x, g: fn(x, g, 3))(jnp.zeros((8, 4)), grid)
    x_var = closed.jaxpr.invars[0]
    dep = _computed_from_x(closed.jaxpr, x_var)
    slices = [e for e in closed.jaxpr.eqns if e.primitive.name in ("slice", "dynamic_slice", "gather")]
    assert slices  # the knots t_{m+j} are slices of the grid
    assert not [e for e in slices if e.invars[0] in dep]
    # efficient-kan's recursion, by contrast, slices each level it computed
    closed = jax.make_jaxpr(lambda x, g: bspline_basis(x, g, 3))(jnp.zeros((8, 4)), grid)
    dep = _computed_from_x(closed.jaxpr, closed.jaxpr.invars[0])
    assert [e for e in closed.jaxpr.eqns if e.primitive.name == "slice" and e.invars[0] in dep]
