"""KAN grid update / refinement (jaxgrad.kan.grid) and the sample-based regulariser (jaxgrad.kan.regularization)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.kan.grid import grid_from_samples, refine, refine_network, update_grid, update_grids
from jaxgrad.kan.layer import KANConfig, init, kan_linear_reference
from jaxgrad.kan.regularization import (edge_scale, edge_scale_materialized, kan_regularization,
                                        layer_regularization, regularization_loss)
from jaxgrad.kan.spline import bspline_basis, curve_to_coefficients


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


# Eager JAX compiles every op for every new shape; with x64 on this CPU that dominates the run time, so the
# helpers below are jit'd and the tests share a few shapes.
_fwd = jax.jit(kan_linear_reference)
_edge_scale = jax.jit(edge_scale, static_argnames="include_base")
_edge_scale_mat = jax.jit(edge_scale_materialized, static_argnames="include_base")
_layer_reg = jax.jit(layer_regularization, static_argnames=("include_base", "materialize"))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 5))
def _smooth_layer_jit(in_f, out_f, G, k, scaler, seed):
    p = init(jax.random.key(seed), KANConfig(in_f, out_f, grid_size=G, spline_order=k), jnp.float64)
    xs = jnp.linspace(-1, 1, 200)[:, None].repeat(in_f, 1)
    freqs = jnp.arange(1, out_f + 1) * 0.7
    ys = jnp.sin(xs[..., None] * freqs) + 0.3 * xs[..., None] ** 2 * jnp.arange(1, in_f + 1)[:, None]
    p["spline_weight"] = curve_to_coefficients(xs, ys, p["grid"], k)
    p["spline_scaler"] = scaler * jnp.linspace(-1.0, 1.5, out_f * in_f).reshape(out_f, in_f)
    return p


def _smooth_layer(in_f=3, out_f=4, G=5, k=3, scaler=3.0, seed=0):
    """A layer whose spline parts are smooth curves (fitted to sines), with non-unit, signed scalers."""
    return dict(_smooth_layer_jit(in_f, out_f, G, k, jnp.float64(scaler), seed))


def _spline_part(p, x):
    k = p["grid"].shape[1] - p["spline_weight"].shape[-1] - 1
    coef = p["spline_weight"] * p["spline_scaler"][..., None]
    return jnp.einsum("nim,oim->no", bspline_basis(x, p["grid"], k), coef)


def test_new_grid_is_sorted_nonuniform_and_follows_the_quantiles():
    x = jax.random.uniform(jax.random.key(1), (1000, 2), jnp.float64, -1, 1) ** 3  # dense near 0
    grid, h = grid_from_samples(x, 6, 3, grid_eps=0.02, margin=0.01)
    assert grid.shape == (2, 6 + 2 * 3 + 1)
    assert bool(jnp.all(jnp.diff(grid, axis=1) > 0))
    steps = jnp.diff(grid[:, 3:-3], axis=1)
    assert float(jnp.max(steps) / jnp.min(steps)) > 3  # adapted, not uniform
    xs = jnp.sort(x, axis=0)
    ids = [int(1000 / 6 * j) for j in range(6)] + [999]
    lo, hi = xs[0], xs[-1]
    uni = (lo - 0.01) + (hi - lo + 0.02) / 6 * jnp.arange(7)[:, None]
    np.testing.assert_allclose(grid[:, 3:-3].T, 0.02 * uni + 0.98 * xs[jnp.array(ids)], rtol=0, atol=1e-14)
    np.testing.assert_allclose(jnp.diff(grid[:, :4], axis=1), jnp.broadcast_to(h[:, None], (2, 3)), atol=1e-14)


def test_update_grid_is_exact_when_the_new_grid_equals_the_old_one_and_scaler_is_applied_once():
    # x = -1 + 2j/(G m), n = G m + 1 samples: adaptive quantiles == uniform knots == the old grid (margin 0)
    G, m = 5, 40
    p = _smooth_layer(G=G)
    x = jnp.linspace(-1, 1, G * m + 1)[:, None].repeat(3, 1)
    q = update_grid(p, x, margin=0.0)
    np.testing.assert_allclose(q["grid"], p["grid"], atol=1e-13)
    np.testing.assert_allclose(_fwd(q, x), _fwd(p, x), atol=1e-11)
    np.testing.assert_array_equal(q["spline_scaler"], p["spline_scaler"])
    # efficient-kan stores the fit of the *scaled* curves into spline_weight: the scaler would act twice
    ek = dict(p, spline_weight=p["spline_weight"] * p["spline_scaler"][..., None])
    err_ek = jnp.abs(_spline_part(ek, x) - _spline_part(p, x)).max()
    assert float(err_ek) > 1.0


def test_update_grid_preserves_layer_output_on_samples_with_nonunit_scaler():
    p = _smooth_layer(G=5, scaler=3.0)
    x = jax.random.uniform(jax.random.key(2), (2000, 3), jnp.float64, -0.9, 0.9)
    y0 = _fwd(p, x)
    q = update_grid(p, x)
    assert q["grid"].shape == p["grid"].shape and q["spline_weight"].shape == p["spline_weight"].shape
    assert not np.allclose(q["grid"], p["grid"])
    y1 = _fwd(q, x)
    assert float(jnp.abs(y1 - y0).max()) < 3e-3 * float(jnp.abs(y0).max())
    # it is the least-squares optimum: the residual of every edge's spline part is orthogonal to the new bases
    k = 3
    bn = bspline_basis(x, q["grid"], k)
    bo = bspline_basis(x, p["grid"], k)
    res = jnp.einsum("nim,oim->nio", bn, q["spline_weight"]) - jnp.einsum("nim,oim->nio", bo, p["spline_weight"])
    assert float(jnp.abs(jnp.einsum("nim,nio->oim", bn, res)).max()) < 1e-9


def test_update_grid_rank_deficient_samples():
    p = _smooth_layer(G=5)
    # all samples equal: a narrow grid around the value, output at the sample kept
    xe = jnp.full((10, 3), 0.3)
    q = update_grid(p, xe)
    assert bool(jnp.all(jnp.isfinite(q["grid"]))) and bool(jnp.all(jnp.isfinite(q["spline_weight"])))
    assert bool(jnp.all(jnp.diff(q["grid"], axis=1) > 0))
    np.testing.assert_allclose(_fwd(q, xe), _fwd(p, xe), atol=1e-10)
    # ... and with margin 0 there is no spread at all: the grid row and weights are kept
    q0 = update_grid(p, xe, margin=0.0)
    np.testing.assert_array_equal(q0["grid"], p["grid"])
    np.testing.assert_array_equal(q0["spline_weight"], p["spline_weight"])
    # fewer samples (3) than bases (G + k = 8): interpolated exactly
    x3 = jnp.array([[-0.5, 0.1, 0.7], [0.2, -0.3, 0.0], [0.9, 0.4, -0.8]])
    q3 = update_grid(p, x3)
    np.testing.assert_allclose(_fwd(q3, x3), _fwd(p, x3), atol=1e-10)
    # duplicates among many samples
    xd = jnp.concatenate([jnp.full((50, 3), -0.2), jnp.full((50, 3), 0.6)])
    qd = update_grid(p, xd)
    np.testing.assert_allclose(_fwd(qd, xd), _fwd(p, xd), atol=1e-10)


def test_update_grid_float32_params_stay_float32():
    p = jax.jit(init, static_argnums=1)(jax.random.key(0), KANConfig(3, 4))
    x = jax.random.normal(jax.random.key(1), (64, 3), jnp.float32)
    q = update_grid(p, x)
    assert q["grid"].dtype == q["spline_weight"].dtype == jnp.float32


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_x_raises(bad):
    p = _smooth_layer()
    x = jnp.zeros((5, 3)).at[2, 1].set(bad)
    with pytest.raises(ValueError, match="'x'"):
        update_grid(p, x)
    with pytest.raises(ValueError, match="'x'"):
        refine(p, 10, x)
    with pytest.raises(ValueError, match="'x'"):
        update_grids([p], x)


def test_refine_nested_grid_is_exact_on_the_range():
    p = _smooth_layer(G=5)
    r = refine(p, 10)
    assert r["spline_weight"].shape == (4, 3, 13) and r["grid"].shape == (3, 17)
    x = jnp.linspace(-1, 1, 301)[:, None].repeat(3, 1)
    np.testing.assert_allclose(_fwd(r, x), _fwd(p, x), atol=1e-12)


def test_refine_preserves_the_function():
    p = _smooth_layer(G=5)
    x = jnp.linspace(-1, 1, 301)[:, None].repeat(3, 1)
    y0 = _fwd(p, x)
    for G in (7, 50):
        r = refine(p, G)
        assert float(jnp.abs(_fwd(r, x) - y0).max()) < 1e-2 * float(jnp.abs(y0).max())
    xs = jax.random.uniform(jax.random.key(3), (1000, 3), jnp.float64, -1, 1)
    r = refine(p, 20, xs)
    assert r["spline_weight"].shape == (4, 3, 23)
    assert float(jnp.abs(_fwd(r, xs) - _fwd(p, xs)).max()) < 2e-3


def test_network_helpers_propagate_samples():
    ka, kb = jax.random.split(jax.random.key(4))
    # small scalers on layer 0 keep its outputs (layer 1's inputs) mostly inside layer 1's grid range, where the
    # old layer-1 function is representable on the adapted grid
    net = [_smooth_layer(3, 3, G=5, seed=1, scaler=0.15), _smooth_layer(3, 3, G=5, seed=3)]
    x = jax.random.uniform(ka, (800, 3), jnp.float64, -1, 1)

    def fwd(ps, h):
        for p in ps:
            h = _fwd(p, h)
        return h

    y0 = fwd(net, x)
    h1 = _fwd(net[0], x)
    new = update_grids(net, x)
    # layer 1's grid was adapted to (approximately) layer 0's outputs
    lo = float(new[1]["grid"][0, 3])
    assert abs(lo - float(h1[:, 0].min())) < 0.05 * float(h1[:, 0].max() - h1[:, 0].min())
    assert float(jnp.abs(fwd(new, x) - y0).max()) < 0.05 * float(jnp.abs(y0).max())
    ref = refine_network(net, 12, x)
    assert [p["spline_weight"].shape[-1] for p in ref] == [15, 15]
    ref2 = refine_network(net, 12)
    assert [p["grid"].shape[-1] for p in ref2] == [19, 19]


# ---- regularisation --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("include_base", [True, False])
def test_edge_scale_covariance_identity_matches_materialized(include_base):
    p = _smooth_layer(3, 4, G=5)
    x = jax.random.normal(jax.random.key(5), (300, 3), jnp.float64) * 0.7
    v = _edge_scale(p, x, include_base=include_base)
    w = _edge_scale_mat(p, x, include_base=include_base)
    assert v.shape == (4, 3)
    np.testing.assert_allclose(v, w, rtol=1e-10, atol=1e-12)
    # the materialised oracle is pykan's formula: std (n-1) of phi over the batch / (std x + 0.1)
    k = 3
    phi = jnp.einsum("nim,oim->nio", bspline_basis(x, p["grid"], k), p["spline_weight"] * p["spline_scaler"][..., None])
    if include_base:
        phi = phi + jax.nn.silu(x)[..., None] * p["base_weight"].T[None]
    want = np.std(np.asarray(phi), axis=0, ddof=1).T / (np.std(np.asarray(x), axis=0, ddof=1) + 0.1)
    np.testing.assert_allclose(v, want, rtol=1e-10)
    # gradients agree as well
    g1 = jax.jit(jax.grad(lambda q: jnp.sum(edge_scale(q, x, include_base=include_base) ** 1.5)))(p)
    g2 = jax.jit(jax.grad(lambda q: jnp.sum(edge_scale_materialized(q, x, include_base=include_base) ** 1.5)))(p)
    for name in ("base_weight", "spline_weight", "spline_scaler"):
        np.testing.assert_allclose(g1[name], g2[name], rtol=1e-8, atol=1e-12)


def test_pykan_reg_terms_and_zero_edges_are_nan_free():
    p = _smooth_layer(3, 4, G=5)
    p["spline_scaler"] = p["spline_scaler"].at[0, 0].set(0.0)
    p["base_weight"] = p["base_weight"].at[0, 0].set(0.0)  # edge (0, 0) is identically zero
    x = jax.random.uniform(jax.random.key(6), (200, 3), jnp.float64, -1, 1)
    v = _edge_scale(p, x)
    assert float(v[0, 0]) == 0.0
    p_row = v / (v.sum(1, keepdims=True) + 1)
    p_col = v / (v.sum(0, keepdims=True) + 1)
    ent = -jnp.mean(jnp.sum(p_row * jnp.log2(p_row + 1e-4), 1)) - jnp.mean(jnp.sum(p_col * jnp.log2(p_col + 1e-4), 0))
    w = p["spline_weight"]
    want = (1.0 * v.sum() + 2.0 * ent + 0.5 * jnp.sum(jnp.mean(jnp.abs(w), 0))
            + 0.25 * jnp.sum(jnp.mean(jnp.abs(jnp.diff(w, axis=-1)), 0)))
    got = _layer_reg(p, x, lamb_l1=1.0, lamb_entropy=2.0, lamb_coef=0.5, lamb_coefdiff=0.25)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(got, _layer_reg(p, x, lamb_coef=0.5, lamb_coefdiff=0.25, materialize=True),
                               rtol=1e-10)
    g = jax.jit(jax.grad(lambda q: layer_regularization(q, x)))(p)
    assert all(bool(jnp.all(jnp.isfinite(g[n]))) for n in ("base_weight", "spline_weight", "spline_scaler"))
    net = [p, _smooth_layer(4, 2, G=5, seed=3)]
    total = jax.jit(kan_regularization)(net, x)
    h = _fwd(p, x)
    np.testing.assert_allclose(total, _layer_reg(net[0], x) + _layer_reg(net[1], h), rtol=1e-12)


def test_efficient_kan_regularization_loss():
    p = _smooth_layer(3, 4, G=5)
    l1 = np.mean(np.abs(np.asarray(p["spline_weight"])), -1)
    prob = l1 / l1.sum()
    want = 0.7 * l1.sum() - 0.3 * np.sum(prob * np.log(prob))
    np.testing.assert_allclose(regularization_loss(p, 0.7, 0.3), want, rtol=1e-12)
    np.testing.assert_allclose(regularization_loss([p, p], 0.7, 0.3), 2 * want, rtol=1e-12)
    z = dict(p, spline_weight=jnp.zeros_like(p["spline_weight"]))
    assert float(regularization_loss(z)) == 0.0


def test_spline_shape_checks_fire_at_trace_time_under_jit():
    """Shapes that do not agree are refused while tracing, so a jit'd caller gets the same named error."""
    from jaxgrad.kan.spline import make_grid

    grid = make_grid(2, 5, 3)
    with pytest.raises(ValueError, match=r"bspline_basis: 'x' must have shape \[\.\.\., in\] with in = 2"):
        jax.jit(bspline_basis, static_argnums=2)(jnp.zeros((4, 3)), grid, 3)
    with pytest.raises(ValueError, match=r"curve_to_coefficients: 'y' must have shape \[n, in, out\]"):
        jax.jit(curve_to_coefficients, static_argnums=3)(jnp.zeros((6, 2)), jnp.zeros((6, 3, 1)), grid, 3)
    coef = jax.jit(curve_to_coefficients, static_argnums=3)(jnp.zeros((6, 2)), jnp.zeros((6, 2, 4)), grid, 3)
    assert coef.shape == (4, 2, 8)
