"""Symbolic edges: pykan's affine fit ``c f(a x + b) + d`` over its function library (domains respected), the
ranked suggestions per edge, fixed symbolic edges in the forward and their gradients, and the recovery of
``exp(sin(pi x) + y^2)``'s structure from a [2, 1, 1] network trained here."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

from jaxgrad.kan.grid import update_grids
from jaxgrad.kan.network import kan_apply, kan_apply_reference, kan_init
from jaxgrad.kan.prune import freeze_edges
from jaxgrad.kan.symbolic import (SymbolicEdges, auto_symbolic, edge_samples, fix_symbolic, kan_apply_symbolic,
                                  numerical_edge_masks, suggest_symbolic, unfix_symbolic)
from jaxgrad.kan.symbolic_fit import DEFAULT_LIBRARY, SYMBOLIC_LIBRARY, fit_affine, library


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)  # restored by conftest's x64_as_it_was


# ---------------------------------------------------------------------------------------------------------------
# The affine fit
# ---------------------------------------------------------------------------------------------------------------
def test_fit_affine_recovers_pykans_docstring_example():
    # pykan fit_params' example: y = 5 sin(3x + 2) + 0.7 + noise(0.02)
    x = np.linspace(-1, 1, 100)
    y = 5.0 * np.sin(3.0 * x + 2.0) + 0.7 + np.random.default_rng(0).normal(0, 0.02, x.shape)
    fit = fit_affine(x, y, "sin")
    assert fit.r2 > 0.9999
    assert abs(abs(fit.a) - 3.0) < 0.02 and abs(abs(fit.c) - 5.0) < 0.02 and abs(fit.d - 0.7) < 0.01
    pred = fit.c * np.sin(fit.a * x + fit.b) + fit.d
    assert np.max(np.abs(pred - (5.0 * np.sin(3.0 * x + 2.0) + 0.7))) < 0.02
    # the reported R^2 is 1 - SSE/SST of that prediction
    assert fit.r2 == pytest.approx(1 - np.sum((y - pred) ** 2) / np.sum((y - y.mean()) ** 2), abs=1e-12)


@pytest.mark.parametrize("name, truth", [("log", lambda x: np.log(0.5 * x + 0.7)),
                                         ("sqrt", lambda x: np.sqrt(2.0 * x + 2.5)),
                                         ("1/x", lambda x: 1.0 / (x + 1.3)),
                                         ("arcsin", lambda x: np.arcsin(0.8 * x)),
                                         ("arctanh", lambda x: np.arctanh(0.6 * x - 0.2)),
                                         ("tan", lambda x: np.tan(1.2 * x))])
def test_fit_affine_stays_in_the_domain_on_the_whole_interval(name, truth):
    x = np.linspace(-1, 1, 101)
    fit = fit_affine(x, truth(x), name)
    assert fit.r2 > 0.9999, (name, fit)
    u = np.array([fit.a * -1 + fit.b, fit.a * 1 + fit.b])  # the argument's interval ends
    f = SYMBOLIC_LIBRARY[name]
    assert bool(f.domain(u.min(), u.max()))
    with np.errstate(all="raise"):  # finite on a dense sample of the interval, not just the fit's points
        v = f.fn(np.linspace(u.min(), u.max(), 10001), np)
    assert np.isfinite(v).all()


def test_fit_affine_reports_nan_when_no_pair_is_admissible():
    x = np.linspace(-1, 1, 50)
    fit = fit_affine(x, x ** 3, "arcsin", a_range=(5, 10), b_range=(5, 10))  # |a x + b| > 1 for every pair
    assert np.isnan(fit.r2)


def test_fit_affine_of_a_constant_is_exact():
    fit = fit_affine(np.linspace(0, 1, 10), np.full(10, 2.5), "exp")
    assert (fit.c, fit.d, fit.r2) == (0.0, 2.5, 1.0)


def test_fit_affine_refuses_bad_arguments():
    x = np.linspace(-1, 1, 10)
    with pytest.raises(ValueError, match="unknown function 'cosh'"):
        fit_affine(x, x, "cosh")
    with pytest.raises(ValueError, match="'a_range'"):
        fit_affine(x, x, "x", a_range=(1, 1))
    with pytest.raises(ValueError, match="same length"):
        fit_affine(x, x[:5], "x")
    with pytest.raises(ValueError, match="finite"):
        fit_affine(x, x * np.nan, "x")
    with pytest.raises(ValueError, match="'grid_number'"):
        fit_affine(x, x, "x", grid_number=2)


def test_library_is_pykans_with_the_duplicate_families_folded():
    assert set(SYMBOLIC_LIBRARY) == {"x", "x^2", "x^3", "x^4", "x^5", "1/x", "1/x^2", "1/x^3", "1/x^4", "1/x^5",
                                     "sqrt", "x^0.5", "x^1.5", "1/sqrt(x)", "1/x^0.5", "exp", "log", "abs", "sin",
                                     "cos", "tan", "tanh", "sgn", "arcsin", "arccos", "arctan", "arctanh", "0",
                                     "gaussian"}
    assert {"cos", "arccos", "x^0.5", "1/x^0.5", "0"}.isdisjoint(DEFAULT_LIBRARY)
    assert SYMBOLIC_LIBRARY["sin"].complexity == 2 and SYMBOLIC_LIBRARY["arctanh"].complexity == 4  # pykan's
    assert list(library(["exp", "sin"])) == ["exp", "sin"]
    with pytest.raises(TypeError, match="list of names"):
        library("sin")


# ---------------------------------------------------------------------------------------------------------------
# Suggestions, fixing, the forward
# ---------------------------------------------------------------------------------------------------------------
def _net(seed=0, widths=(2, 3, 1)):
    return kan_init(jax.random.key(seed), list(widths), grid_size=5, dtype=jnp.float64)


def _data(n=200, d=2, seed=0):
    return jnp.asarray(np.random.default_rng(seed).uniform(-1, 1, (n, d)))


def test_edge_samples_span_the_edge_inputs_range_on_the_data(x64):
    params, x = _net(), _data()
    u, phi = edge_samples(params, x, (1, 0, 2), num=50)
    h = jax.jit(kan_apply_reference)(params[:1], x)[:, 2]
    assert u.shape == phi.shape == (50,)
    assert u[0] == pytest.approx(float(h.min())) and u[-1] == pytest.approx(float(h.max()))
    # phi is edge (o=0, i=2) of layer 1: the layer's output with only that input moving
    from jaxgrad.kan.plot import edge_activations

    full, _ = edge_activations(params[1], jnp.broadcast_to(jnp.asarray(u)[:, None], (50, 3)))
    np.testing.assert_allclose(phi, np.asarray(full[:, 0, 2]), rtol=1e-12, atol=1e-14)


def test_a_zeroed_edge_is_suggested_as_zero(x64):
    params, x = _net(), _data()
    params, sym = fix_symbolic(params, None, (0, 1, 0), "x")  # zeroes the numerical edge
    (only,) = suggest_symbolic(params, x, (0, 1, 0))
    assert only.name == "0" and only.c == 0.0


def test_kan_apply_symbolic_adds_c_f_ax_plus_b_plus_d(x64):
    params, x = _net(), _data(50)
    new, sym = fix_symbolic(params, None, (0, 2, 1), "sin")
    sym = SymbolicEdges(sym.edges, jnp.asarray([[1.5, -0.3, 0.7, 0.2]]))
    # the numerical edge is zero in the new params, everything else unchanged
    assert float(jnp.abs(new[0]["base_weight"][2, 1])) == 0.0
    assert float(jnp.abs(new[0]["spline_weight"][2, 1]).max()) == 0.0
    np.testing.assert_array_equal(np.asarray(new[0]["base_weight"][:2]), np.asarray(params[0]["base_weight"][:2]))
    h = kan_apply(new[:1], x)
    h = h.at[:, 2].add(0.7 * jnp.sin(1.5 * x[:, 1] - 0.3) + 0.2)
    want = kan_apply(new[1:], h)
    got = jax.jit(kan_apply_symbolic)(new, sym, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)
    # an empty table is exactly kan_apply
    np.testing.assert_array_equal(np.asarray(kan_apply_symbolic(params, None, x)), np.asarray(kan_apply(params, x)))


def test_symbolic_edges_train_with_the_params(x64):
    params, x = _net(), _data(40)
    new, sym = fix_symbolic(params, None, (1, 0, 0), "tanh")
    sym = SymbolicEdges(sym.edges, jnp.asarray([[0.8, 0.1, 1.3, -0.2]]))

    def loss(p, s, x):
        return jnp.sum(jnp.sin(kan_apply_symbolic(p, s, x)))

    # the affine parameters and the input: plain autodiff, checked against finite differences
    check_grads(lambda aff, x: loss(new, SymbolicEdges(sym.edges, aff), x), (sym.affine, x), order=1,
                modes=["rev"], atol=1e-6, rtol=1e-6)
    g_params, g_sym = jax.grad(loss, argnums=(0, 1))(new, sym, x)
    assert isinstance(g_sym, SymbolicEdges) and g_sym.edges == sym.edges
    # d/dd = sum_b g_b (the output cotangent of node 0); d/dc = sum_b g_b tanh(a u_b + b)
    y = kan_apply_symbolic(new, sym, x)[:, 0]
    u = kan_apply(new[:1], x)[:, 0]
    g = jnp.cos(y)
    np.testing.assert_allclose(float(g_sym.affine[0, 3]), float(jnp.sum(g)), rtol=1e-12)
    np.testing.assert_allclose(float(g_sym.affine[0, 2]), float(jnp.sum(g * jnp.tanh(0.8 * u + 0.1))), rtol=1e-12)
    # the zeroed numerical edge: spline_weight and spline_scaler get zero gradients, base_weight does not ...
    assert float(jnp.abs(g_params[1]["spline_weight"][0, 0]).max()) == 0.0
    assert float(g_params[1]["spline_scaler"][0, 0]) == 0.0
    assert float(jnp.abs(g_params[1]["base_weight"][0, 0])) > 0.0
    # ... so freeze_edges(numerical_edge_masks) keeps it zero through optimiser steps
    opt = optax.chain(optax.adam(1e-2), freeze_edges(numerical_edge_masks(new, sym)))
    p, s = new, sym
    state = opt.init(p)
    for _ in range(3):
        gp, gs = jax.grad(loss, argnums=(0, 1))(p, s, x)
        upd, state = opt.update(gp, state, p)
        p = optax.apply_updates(p, upd)
        s = jax.tree.map(lambda a, g: a - 1e-2 * g, s, gs)  # the table is a pytree like the params
    assert float(p[1]["base_weight"][0, 0]) == 0.0
    assert float(jnp.abs(p[1]["spline_weight"][0, 0]).max()) == 0.0
    assert float(jnp.abs(p[0]["base_weight"] - new[0]["base_weight"]).max()) > 0  # the others did train


def test_fix_symbolic_fits_on_the_data_like_the_suggestion(x64):
    params, x = _net(), _data()
    (sin,) = [s for s in suggest_symbolic(params, x, (0, 2, 0), lib=["sin", "x"]) if s.name == "sin"]
    _, sym = fix_symbolic(params, None, (0, 2, 0), "sin", x=x)
    np.testing.assert_allclose(np.asarray(sym.affine[0]), sin.affine, rtol=1e-12)
    _, sym = fix_symbolic(params, None, (0, 2, 0), sin)  # a Suggestion is taken as is
    np.testing.assert_allclose(np.asarray(sym.affine[0]), sin.affine, rtol=1e-12)
    assert sym.formulas()[(0, 2, 0)].startswith(f"{sin.c:.4g}*sin(")
    with pytest.raises(ValueError, match="no \\(a, b\\) in the ranges keeps arcsin's argument in its domain"):
        fix_symbolic(params, None, (0, 2, 0), "arcsin", x=x, a_range=(5, 10), b_range=(5, 10))


def test_unfix_and_bad_edges(x64):
    params = _net()
    new, sym = fix_symbolic(params, None, (0, 1, 1), "exp")
    new, sym = fix_symbolic(new, sym, (0, 0, 0), "sin")
    new, sym = fix_symbolic(new, sym, (0, 1, 1), "x^2")  # replaces the earlier entry
    assert [(e[:3], e[3].name) for e in sym.edges] == [((0, 1, 1), "x^2"), ((0, 0, 0), "sin")]
    assert unfix_symbolic(sym, (0, 1, 1)).edges == sym.edges[1:]
    with pytest.raises(ValueError, match="not symbolic"):
        unfix_symbolic(sym, (1, 0, 0))
    with pytest.raises(ValueError, match="layer 2 is out of range"):
        fix_symbolic(params, None, (2, 0, 0), "x")
    with pytest.raises(ValueError, match=r"layer 0 has out in 0\.\.2"):
        fix_symbolic(params, None, (0, 3, 0), "x")
    with pytest.raises(TypeError, match="triple of ints"):
        suggest_symbolic(params, _data(), (0, 0))
    with pytest.raises(ValueError, match="'num'"):
        suggest_symbolic(params, _data(), (0, 0, 0), num=2)
    with pytest.raises(ValueError, match="which the params do not have"):
        kan_apply_symbolic(params[:1], sym.__class__([(1, 0, 0, sym.edges[0][3])], jnp.zeros((1, 4))), _data())


# ---------------------------------------------------------------------------------------------------------------
# pykan's example: exp(sin(pi x) + y^2) from a trained [2, 1, 1]
# ---------------------------------------------------------------------------------------------------------------
def _train_211(x, y, *, seed=0, grid_size=5, steps=2000, lr=1e-2, update_every=200):
    """Full-batch Adam on the MSE, pykan-style grid updates every ``update_every`` steps (optimiser restarted)."""
    params = kan_init(jax.random.key(seed), [2, 1, 1], grid_size=grid_size, dtype=jnp.float64)
    opt = optax.adam(lr)

    def loss(p):
        return jnp.mean((kan_apply_reference(p, x) - y) ** 2)

    @jax.jit
    def phase(p):
        def step(carry, _):
            p, s = carry
            l, g = jax.value_and_grad(loss)(p)
            u, s = opt.update(g, s, p)
            q = optax.apply_updates(p, u)
            return ([{**a, "grid": b["grid"]} for a, b in zip(q, p)], s), l  # the grid is not trained

        (p, _), losses = jax.lax.scan(step, (p, opt.init(p)), None, length=update_every)
        return p, losses

    for _ in range(steps // update_every):
        params, losses = phase(update_grids(params, x))
    return params, float(jnp.sqrt(losses[-1]))


def test_recovers_the_structure_of_exp_sin_pi_x_plus_y2(x64):
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(-1, 1, (500, 2)))
    y = jnp.exp(jnp.sin(jnp.pi * x[:, :1]) + x[:, 1:] ** 2)
    params, train_rmse = _train_211(x, y)
    t_train = time.perf_counter() - t0
    assert train_rmse < 1e-2

    new, sym, report = auto_symbolic(params, x, r2_threshold=0.99)
    t_sym = time.perf_counter() - t0 - t_train
    best = {edge: ranked[0] for edge, ranked in report.items()}
    assert {e: s.name for e, s in best.items()} == {(0, 0, 0): "sin", (0, 0, 1): "x^2", (1, 0, 0): "exp"}
    assert all(s.r2 >= 0.99 for s in best.values()), {e: s.r2 for e, s in best.items()}
    # sin's frequency is pi (up to the sign, absorbed by b and c)
    assert abs(abs(best[(0, 0, 0)].a) - np.pi) < 1e-2
    # every edge is now symbolic and the formula network fits the data at least as well as the splines
    assert sorted(e[:3] for e in sym.edges) == [(0, 0, 0), (0, 0, 1), (1, 0, 0)]
    sym_rmse = float(jnp.sqrt(jnp.mean((kan_apply_symbolic(new, sym, x) - y) ** 2)))
    assert sym_rmse < 1.5 * train_rmse

    # the formula's a, b, c, d train by gradient through kan_apply_symbolic (pykan's fit after auto_symbolic)
    def loss(affine):
        return jnp.mean((kan_apply_symbolic(new, SymbolicEdges(sym.edges, affine), x) - y) ** 2)

    opt = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(loss)

    @jax.jit
    def fit(affine):
        def step(carry, _):
            affine, state = carry
            value, grad = value_and_grad(affine, state=state)
            upd, state = opt.update(grad, state, affine, value=value, grad=grad, value_fn=loss)
            return (optax.apply_updates(affine, upd), state), value

        return jax.lax.scan(step, (affine, opt.init(affine)), None, length=100)[0][0]

    tuned_rmse = float(jnp.sqrt(loss(fit(sym.affine))))
    assert tuned_rmse < 0.2 * sym_rmse  # measured: 1.9e-3 -> 1.1e-4
    print(f"\n[2,1,1] trained in {t_train:.1f} s to RMSE {train_rmse:.2e}; auto_symbolic {t_sym:.1f} s; "
          + "; ".join(f"{e}: {s.name} 1-R^2={1 - s.r2:.1e}" for e, s in best.items())
          + f"; symbolic RMSE {sym_rmse:.2e}, after 100 L-BFGS steps on (a, b, c, d) {tuned_rmse:.2e}; "
          + f"total {time.perf_counter() - t0:.1f} s")
