"""The floor computation of jaxgrad.kan.fit_floor on cases whose answer is known: a target every edge represents
exactly (floor 0), and an additive target whose floor is one edge's least-squares residual."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.kan.fit_floor import Placement, joint_fit, linearised_floor, start_network
from jaxgrad.kan.grid import grid_from_samples
from jaxgrad.kan.network import kan_apply_reference


def _data(f, n=200, seed=0):
    rng = np.random.default_rng(seed)
    xtr, xte = rng.uniform(-1, 1, (n, 2)), rng.uniform(-1, 1, (n, 2))
    return xtr, f(xtr)[:, None], xte, f(xte)[:, None]


def test_an_overhang_leaves_that_many_intervals_of_the_samples_outside_the_knots(x64):
    x = jnp.linspace(-1.0, 1.0, 11)[:, None]
    pykan, _ = grid_from_samples(x, 3, 3, grid_eps=1.0, margin=0.0)
    np.testing.assert_allclose(pykan[0, 3:7], [-1.0, -1 / 3, 1 / 3, 1.0], atol=1e-12)
    one, h = grid_from_samples(x, 3, 3, grid_eps=1.0, margin=0.0, overhang=1)
    np.testing.assert_allclose(h, [0.4])                                              # the range is 3 + 2 intervals
    np.testing.assert_allclose(one[0, 3:7], [-0.6, -0.2, 0.2, 0.6], atol=1e-12)
    np.testing.assert_allclose(np.diff(one[0]), 0.4, atol=1e-12)                      # extension at the same step
    with pytest.raises(ValueError, match="'overhang' must be a number in \\[0, spline_order = 3\\]"):
        grid_from_samples(x, 3, 3, overhang=4)


def test_a_target_every_edge_represents_has_floor_zero(x64):
    # (x^2 + y)^2: the inner curves are polynomials of degree <= 3 and the outer one s^2, all in the cubic splines'
    # span on their knots' core (the uniform placement covers the samples)
    data = _data(lambda x: (x[:, 0] ** 2 + x[:, 1]) ** 2)
    inner, outer = (lambda t: t ** 2, lambda t: t), (lambda s: s ** 2)
    grids = grid_from_samples(jnp.asarray(data[0]), 3, 3, grid_eps=1.0)[0]
    assert linearised_floor(data[0], inner, lambda s: 2 * s, grids, 3)["rmse"] < 1e-12
    start = start_network(data[0], inner, outer, 3, 3, Placement())
    assert float(jnp.sqrt(jnp.mean((kan_apply_reference(start, jnp.asarray(data[0])) - data[1]) ** 2))) < 1e-10
    res = joint_fit(data, inner, outer, restarts=1, random_inits=0, rounds=1, max_iter=200)
    assert res["best"]["train_rmse"] < 1e-9 and res["best"]["test_rmse"] < 1e-8


def test_an_additive_target_has_the_floor_of_its_one_inexact_edge(x64):
    # sin(pi x) + y^2: y^2 is exact, the outer edge can be the identity, so the floor is sin's least-squares residual
    # in span{B_m(x), silu(x)}, computed here with numpy alone
    data = _data(lambda x: np.sin(np.pi * x[:, 0]) + x[:, 1] ** 2)
    xtr = data[0]
    grids = np.asarray(grid_from_samples(jnp.asarray(xtr), 3, 3, grid_eps=1.0)[0])
    from jaxgrad.kan.spline import bspline_basis

    basis = np.asarray(bspline_basis(jnp.asarray(xtr[:, :1]), jnp.asarray(grids[:1]), 3))[:, 0, :]
    a = np.concatenate([basis, (xtr[:, 0] / (1 + np.exp(-xtr[:, 0])))[:, None]], axis=1)
    target = np.sin(np.pi * xtr[:, 0])
    residual = a @ np.linalg.lstsq(a, target, rcond=None)[0] - target
    expected = float(np.sqrt(np.mean(residual ** 2)))
    assert 1e-3 < expected < 3e-2  # G = 3 does not represent sin(pi x)

    lin = linearised_floor(xtr, (lambda t: jnp.sin(jnp.pi * t), lambda t: t ** 2), jnp.ones_like, grids, 3)
    np.testing.assert_allclose(lin["edge_rmse"][0], expected, rtol=1e-8)
    # jointly, the y edge's space takes the part of the x residual that the 200 samples correlate with y
    assert 0.95 * expected <= lin["rmse"] <= expected
    assert lin["edge_rmse"][1] < 1e-12

    res = joint_fit(data, (lambda t: jnp.sin(jnp.pi * t), lambda t: t ** 2), lambda s: s, restarts=2,
                    random_inits=0, rounds=2, max_iter=2000)
    # the whole network may bend its outer edge against the x edge's residual, but only a little
    assert 0.8 * expected <= res["best"]["train_rmse"] <= 1.0001 * expected, (res["best"], expected)
