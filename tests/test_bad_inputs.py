"""Bad inputs to the public KAN and CNN functions raise a clear error naming the argument, or (NaN in the KAN
regulariser) propagate; valid inputs next to them still work.

Shape/dtype checks run at trace time, so they also fire inside ``jax.jit``; value checks (the knot order) only
where the grid is concrete.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.cnn.conv import conv2d
from jaxgrad.kan.layer import kan_linear, kan_linear_reference
from jaxgrad.kan.regularization import kan_regularization
from jaxgrad.kan.spline import bspline_basis, bspline_basis_and_derivative, bspline_basis_derivative, make_grid

G, K = 5, 3  # grid size and spline order of the test layer: G+2K+1 = 12 knots, G+K = 8 bases


def _layer(in_f=2, out_f=3, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "base_weight": jnp.asarray(rng.standard_normal((out_f, in_f)), jnp.float32),
        "spline_weight": jnp.asarray(rng.standard_normal((out_f, in_f, G + K)), jnp.float32),
        "spline_scaler": jnp.asarray(rng.standard_normal((out_f, in_f)), jnp.float32),
        "grid": make_grid(in_f, G, K),
    }


def _x(n=16, in_f=2, seed=1):
    return jnp.asarray(np.random.default_rng(seed).uniform(-1, 1, (n, in_f)), jnp.float32)


# jitted, as in a training loss (eager, every small op compiles on its own); the same math as the eager call
_reg = jax.jit(kan_regularization, static_argnames=("include_base",))


# ------------------------------------------------------------------------------------------ kan_regularization
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_kan_regularization_propagates_nonfinite_x_as_nan(bad):
    params, x = _layer(), _x()
    assert np.isfinite(_reg(params, x))
    x_bad = x.at[3, 0].set(bad)
    assert np.isnan(_reg(params, x_bad))  # under jit it cannot raise: it propagates, as pykan's torch.std does
    assert np.isnan(_reg(params, x_bad, include_base=False))


def test_kan_regularization_propagates_nan_params():
    params = _layer()
    params["spline_weight"] = params["spline_weight"].at[0, 1, 2].set(jnp.nan)
    assert np.isnan(_reg(params, _x()))


def test_kan_regularization_gradient_stays_finite_at_a_constant_edge():
    # the zero-safe square root is kept for valid input: a zero weight edge has v = 0 and gradient 0, not NaN
    params = _layer()
    params = {**params, "base_weight": params["base_weight"].at[0, 0].set(0.0),
              "spline_weight": params["spline_weight"].at[0, 0].set(0.0)}
    trainable = {n: v for n, v in params.items() if n != "grid"}
    grads = jax.jit(jax.grad(lambda t: kan_regularization({**t, "grid": params["grid"]}, _x())))(trainable)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


# ------------------------------------------------------------------------------------------ bspline_basis
def test_bspline_basis_rejects_integer_x():
    grid = make_grid(2, G, K)
    with pytest.raises(TypeError, match="bspline_basis: 'x' must be a floating-point array.*int32"):
        bspline_basis(jnp.zeros((4, 2), jnp.int32), grid, K)
    with pytest.raises(TypeError, match="'x'"):
        jax.jit(bspline_basis, static_argnums=2)(jnp.zeros((4, 2), jnp.int32), grid, K)  # at trace time
    with pytest.raises(TypeError, match="'x'"):
        bspline_basis_derivative(jnp.zeros((4, 2), jnp.int32), grid, K)


@pytest.mark.parametrize("order", [-1, 6, 3.0, True, "3"])
def test_bspline_basis_rejects_orders_outside_0_to_5(order):
    with pytest.raises(ValueError, match=r"bspline_basis: 'spline_order' \(the degree k\) must be an int in 0\.\.5"):
        bspline_basis(_x(), make_grid(2, G, K), order)


def test_bspline_basis_derivative_needs_order_1_to_5():
    grid = make_grid(2, G, K)
    for fn in (bspline_basis_derivative, bspline_basis_and_derivative):
        with pytest.raises(ValueError, match=r"'spline_order' \(the degree k\) must be an int in 1\.\.5"):
            fn(_x(), grid, 0)


def test_bspline_basis_accepts_orders_0_to_5_and_numpy_ints():
    grid = make_grid(2, G, K)  # 12 knots: degree p gives 12 - 1 - p bases
    for order in range(6):
        assert jax.eval_shape(lambda x, t: bspline_basis(x, t, order), _x(), grid).shape == (16, 2, 11 - order)
    assert bspline_basis(_x(), grid, np.int64(K)).shape == (16, 2, G + K)


def test_bspline_basis_rejects_a_grid_too_short_for_the_order():
    with pytest.raises(ValueError, match=r"'grid' must have shape \[in, G\+2k\+1\] with at least k\+2 = 7 knots"):
        bspline_basis(_x(), make_grid(2, G, K)[:, :6], 5)


# ------------------------------------------------------------------------------------------ kan_linear
@pytest.mark.parametrize("fn", [kan_linear, kan_linear_reference])
def test_kan_linear_rejects_a_decreasing_grid(fn):
    params = _layer()
    params["grid"] = params["grid"][:, ::-1]
    with pytest.raises(ValueError, match=r"'grid' must be non-decreasing along the knot axis.*; "
                                         r"row 0 goes from 2\.2 to 1\.8 at knots 0->1"):
        fn(params, _x())


def test_kan_linear_rejects_one_swapped_pair_of_knots():
    params = _layer()
    params["grid"] = params["grid"].at[1, 4].set(params["grid"][1, 6])
    with pytest.raises(ValueError, match=r"'grid'.*row 1 goes from .* at knots 4->5"):
        kan_linear(params, _x())


def test_kan_linear_rejects_nan_knots_and_a_constant_row():
    params = _layer()
    with pytest.raises(ValueError, match="'grid' must be non-decreasing"):
        kan_linear({**params, "grid": params["grid"].at[0, 3].set(jnp.nan)}, _x())
    with pytest.raises(ValueError, match="'grid' row 1 has all its knots equal"):
        kan_linear({**params, "grid": params["grid"].at[1].set(0.5)}, _x())


def test_kan_linear_accepts_coincident_knots():
    # a zero-width interval is valid (grid updates with grid_eps=0 and repeated samples make them)
    params = _layer()
    params["grid"] = params["grid"].at[0, 5].set(params["grid"][0, 4])
    np.testing.assert_allclose(kan_linear(params, _x()), kan_linear_reference(params, _x()), rtol=1e-5, atol=1e-5)


def test_kan_linear_checks_knot_values_only_where_they_are_concrete():
    # under jit the grid is a tracer: shapes are checked at trace time, the knot order is not (no host sync)
    params, x = _layer(), _x()
    np.testing.assert_allclose(jax.jit(kan_linear)(params, x), kan_linear(params, x), rtol=1e-6, atol=1e-6)


def test_kan_linear_with_declared_order_rejects_a_grid_missing_a_knot():
    params = _layer()
    params["grid"] = params["grid"][:, :-1]  # 11 knots: read from the shapes alone, a valid k=2, G=6 layer
    assert kan_linear(params, _x()).shape == (16, 3)  # undetectable without the declared order
    with pytest.raises(ValueError, match=r"'grid' has 11 knots per row, but spline_order=3 with spline_weight's 8 "
                                         r"bases \(G = 8 - 3 = 5\) needs G\+2k\+1 = 12"):
        kan_linear(params, _x(), spline_order=K)
    with pytest.raises(ValueError, match="'grid' has 11 knots"):  # a shape check: also at trace time
        jax.jit(lambda p, x: kan_linear(p, x, spline_order=K))(params, _x())


def test_kan_linear_with_declared_order_accepts_the_right_grid_and_checks_the_order():
    params, x = _layer(), _x()
    np.testing.assert_array_equal(kan_linear(params, x, spline_order=K), kan_linear(params, x))
    with pytest.raises(ValueError, match=r"'spline_order' must be an int in 1\.\.5, got 0"):
        kan_linear(params, x, spline_order=0)
    with pytest.raises(ValueError, match="'grid' has 12 knots per row, but spline_order=2"):
        kan_linear(params, x, spline_order=2)


def test_the_nnx_layer_declares_its_order_so_a_missing_knot_is_an_error():
    from flax import nnx

    from jaxgrad.kan.nnx import KANLinear

    layer = KANLinear(3, 2, rngs=nnx.Rngs(0), grid_size=5, spline_order=3)
    x = jnp.full((4, 3), 0.3)
    assert layer(x).shape == (4, 2)
    layer.grid.value = layer.grid[...][:, 1:]  # one knot fewer: the shapes alone would read spline order 2
    with pytest.raises(ValueError, match="'grid' has 11 knots per row, but spline_order=3"):
        layer(x)


# ------------------------------------------------------------------------------------------ conv2d
@pytest.mark.parametrize("backend", ["xla", "pallas", "reference"])
def test_conv2d_rejects_mixed_x_and_w_dtypes(backend):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((1, 6, 6, 2)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 3, 2, 4)), jnp.float32)
    with pytest.raises(TypeError, match="conv2d: x and w must have the same dtype, got x bfloat16 and w float32"):
        conv2d(x, w, backend=backend)
    with pytest.raises(TypeError, match="x bfloat16 and w float32"):
        jax.jit(conv2d)(x, w)  # at trace time


def test_conv2d_same_dtype_bf16_still_works():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((1, 6, 6, 2)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 3, 2, 4)), jnp.float32)
    assert conv2d(x, w.astype(x.dtype)).dtype == jnp.bfloat16
