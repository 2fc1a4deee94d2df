"""KAN layer: the hand-written VJP of ``kan_linear`` is proven against ``jax.grad`` of ``kan_linear_reference`` by
jaxgrad.verify (float64 re-run, finite differences, adjoint and structural checks), over batch sizes, spline
orders, widths, non-uniform grids, out-of-range inputs and bf16; plus a vectorised float64 finite-difference sweep,
hypothesis-driven shapes, exact-zero / independence properties and bad-input errors.

The grid is never differentiated: every verifier call closes over it (``check_vjp`` differentiates every argument
leaf). ``fn`` and ``reference`` are jitted so the verifier's eager passes compile once per case (CPU time).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxgrad.kan.layer import KANConfig, kan_linear, kan_linear_reference
from jaxgrad.kan.network import kan_apply, kan_apply_reference, kan_init
from jaxgrad.verify import assert_vjp_matches


# ---------------------------------------------------------------------------------------------------------------
# helpers (test data come from numpy: eager jax.random / init calls compile per shape and dominate CPU time)
# ---------------------------------------------------------------------------------------------------------------
def _layer(seed, in_f, out_f, *, grid_size=5, spline_order=3, bias=True, dtype=jnp.float32, grid_range=(-1.0, 1.0)):
    """A layer dict with white-noise trained leaves (init's spline weights are ~1e-2 and its bias is 0, so the
    spline and bias paths would barely be exercised) and the uniform extended grid of ``make_grid``."""
    rng = np.random.default_rng(seed)
    G, k = grid_size, spline_order
    lo, hi = grid_range
    knots = lo + np.arange(-k, G + k + 1) * ((hi - lo) / G)
    p = {
        "base_weight": rng.standard_normal((out_f, in_f)) / math.sqrt(in_f),
        "spline_weight": rng.standard_normal((out_f, in_f, G + k)),
        "spline_scaler": rng.standard_normal((out_f, in_f)) / math.sqrt(in_f),
        "grid": np.broadcast_to(knots, (in_f, knots.size)),
    }
    if bias:
        p["bias"] = rng.standard_normal((out_f,))
    return {name: jnp.asarray(v, dtype) for name, v in p.items()}


def _x(seed, shape, lo=-1.6, hi=1.6, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(1000 + seed).uniform(lo, hi, shape), dtype)


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(2000 + seed).standard_normal(shape), dtype)


def _split(params):
    return {k: v for k, v in params.items() if k != "grid"}, params["grid"]


def _verify_layer(params, x, **options):
    """check_vjp of kan_linear (grid closed over) against jax.grad of kan_linear_reference."""
    trainable, grid = _split(params)
    backend = options.pop("backend", "xla")
    interpret = options.pop("interpret", None)
    fn = jax.jit(lambda t, x: kan_linear({**t, "grid": grid}, x, backend=backend, interpret=interpret))
    ref = jax.jit(lambda t, x: kan_linear_reference({**t, "grid": grid}, x))
    return assert_vjp_matches(fn, ref, trainable, x, arg_names=("params", "x"), **options)


@functools.partial(jax.jit, static_argnums=0)
def _vjp(f, params, x, g):
    y, pb = jax.vjp(f, params, x)
    return y, pb(g)


# ---------------------------------------------------------------------------------------------------------------
# the verifier over the brief's grid of cases
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 7, 16, 64, 128])
def test_vjp_verified_over_batch_sizes(batch):
    params = _layer(batch, 3, 5)
    report = _verify_layer(params, _x(batch, (batch, 3)), fd=batch <= 16)
    leaves = {lf.name for lf in report.leaves}
    assert {"params['base_weight']", "params['bias']", "params['spline_scaler']", "params['spline_weight']",
            "x"} <= leaves


@pytest.mark.parametrize("order", [1, 2, 3, 4, 5])
def test_vjp_verified_over_spline_orders(order):
    # grid_size + order = 8 bases for every order: the same leaf shapes as the batch sweep (the verifier's random
    # draws then compile once)
    params = _layer(10 + order, 3, 5, grid_size=8 - order, spline_order=order)
    _verify_layer(params, _x(order, (7, 3)))


def test_vjp_verified_three_layers():
    # biases are verified by the single-layer cases. Leaf shapes repeat those of the single-layer cases (3->5 with
    # 8 bases, x [16, 3]): the verifier's random draws compile once per shape and dominate its CPU time otherwise.
    widths = [(3, 5), (5, 3), (3, 5)]
    params = [_layer(30 + i, a, b, grid_size=6, spline_order=2, bias=False) for i, (a, b) in enumerate(widths)]
    trainable = [_split(p)[0] for p in params]
    grids = [p["grid"] for p in params]
    merge = lambda t: [{**a, "grid": g} for a, g in zip(t, grids)]  # noqa: E731
    fn = jax.jit(lambda t, x: kan_apply(merge(t), x))
    ref = jax.jit(lambda t, x: kan_apply_reference(merge(t), x))
    assert_vjp_matches(fn, ref, trainable, _x(3, (16, 3)), arg_names=("params", "x"), fd_directions=1)


def test_vjp_verified_wide_layer():
    params = _layer(4, 32, 256)
    _verify_layer(params, _x(4, (64, 32)), fd=False, adjoint=False)


def test_vjp_verified_on_non_uniform_grid():
    params = _layer(5, 3, 5)
    grid = params["grid"]
    h = float(grid[0, 1] - grid[0, 0])
    # move every knot by < h/2 (independently per input row): rows stay strictly increasing, no longer uniform
    jitter = jnp.asarray(np.random.default_rng(50).uniform(-0.35 * h, 0.35 * h, grid.shape), grid.dtype)
    params["grid"] = grid + jitter
    assert bool(jnp.all(jnp.diff(params["grid"], axis=-1) > 0))
    assert float(jnp.std(jnp.diff(params["grid"], axis=-1))) > 0.05 * h
    _verify_layer(params, _x(5, (7, 3)))


def test_vjp_verified_with_bf16_inputs():
    params = _layer(6, 3, 5, dtype=jnp.bfloat16)
    x = _x(6, (16, 3), dtype=jnp.bfloat16)
    report = _verify_layer(params, x)
    assert "bf16" in report.precision.precision


def test_bf16_dtypes_and_mixed_precision():
    params = _layer(7, 3, 5, dtype=jnp.bfloat16)
    x = _x(7, (4, 3), dtype=jnp.bfloat16)
    y, (gp, gx) = _vjp(kan_linear, params, x, jnp.ones((4, 5), jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and gx.dtype == jnp.bfloat16
    assert all(gp[k].dtype == params[k].dtype for k in params)
    # one bf16 rounding of an f32-exact result
    p32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    want = kan_linear_reference(p32, x.astype(jnp.float32))
    np.testing.assert_array_less(np.abs(np.float32(y) - want), 2.0**-8 * np.abs(want) + 1e-6)
    # f32 params with bf16 x: the reference promotes to f32, and so does kan_linear; dx stays bf16
    y2, (gp2, gx2) = _vjp(kan_linear, p32, x, jnp.ones((4, 5), jnp.float32))
    assert y2.dtype == jnp.float32 and gx2.dtype == jnp.bfloat16 and gp2["spline_weight"].dtype == jnp.float32
    np.testing.assert_allclose(y2, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# inputs outside the grid
# ---------------------------------------------------------------------------------------------------------------
def test_inputs_outside_grid_range():
    params = _layer(8, 3, 5, grid_size=5, spline_order=3)
    k, h = 3, 2.0 / 5
    far = 1.0 + k * h  # the extended band ends at +-(1 + k h)
    sign = jnp.asarray(np.random.default_rng(80).choice([-1.0, 1.0], (32, 3)), jnp.float32)
    x_far = sign * _x(8, (32, 3), far + 0.01, far + 3.0)
    g = _normal(81, (32, 5))
    y, (gp, gx) = _vjp(kan_linear, params, x_far, g)
    # spline part exactly zero beyond the band: same output with the spline weights zeroed
    no_spline = {**params, "spline_weight": jnp.zeros_like(params["spline_weight"])}
    np.testing.assert_array_equal(y, _vjp(kan_linear, no_spline, x_far, g)[0])
    assert not bool(jnp.any(gp["spline_weight"])) and not bool(jnp.any(gp["spline_scaler"]))
    # the input gradient comes from silu only
    s = jax.nn.sigmoid(x_far)
    np.testing.assert_allclose(gx, (g @ params["base_weight"]) * s * (1 + x_far * (1 - s)), rtol=1e-6, atol=1e-6)
    # and the whole VJP, inside the fading band and beyond, is verified
    x_mix = jnp.concatenate([x_far[:3], sign[:4] * _x(9, (4, 3), 1.0, far)])
    _verify_layer(params, x_mix)


# ---------------------------------------------------------------------------------------------------------------
# structure: zero cotangent, independent calls, leading shapes
# ---------------------------------------------------------------------------------------------------------------
def test_zero_upstream_gradient_gives_exact_zeros():
    params = _layer(11, 3, 5)
    x = _x(11, (7, 3))
    _, (gp, gx) = _vjp(jax.jit(kan_linear), params, x, jnp.zeros((7, 5)))
    for name, leaf in {**gp, "x": gx}.items():
        assert not bool(jnp.any(leaf != 0)), name


@pytest.mark.usefixtures("exact_f32_tests_run_on_the_cpu")  # 1e-5 tolerances: not TF32
def test_two_backward_calls_are_independent():
    params = _layer(12, 3, 5)
    x = _x(12, (7, 3))
    _, pb = jax.vjp(kan_linear, params, x)
    call = jax.jit(lambda pb, g: pb(g))  # the pullback is a pytree: one compile, four calls
    g1, g2 = _normal(120, (2, 7, 5))
    a1, a2, a1_again, a12 = call(pb, g1), call(pb, g2), call(pb, g1), call(pb, g1 + g2)
    jax.tree.map(np.testing.assert_array_equal, a1, a1_again)
    jax.tree.map(lambda u, v, w: np.testing.assert_allclose(u + v, w, rtol=1e-5, atol=1e-5), a1, a2, a12)
    # a second, independent vjp closure gives the same answer
    _, pb2 = jax.vjp(kan_linear, params, x)
    jax.tree.map(np.testing.assert_array_equal, call(pb2, g2), a2)


def test_residuals_are_the_inputs_only():
    """The custom VJP keeps x and the params for the backward, never the [B, in, G+k] basis (autodiff of the
    reference tapes a dozen such tensors)."""
    saved = pytest.importorskip("jax._src.ad_checkpoint").saved_residuals
    params = _layer(15, 3, 5)
    x = _x(15, (16, 3))
    allowed = {tuple(v.shape) for v in params.values()} | {x.shape}
    res = saved(kan_linear, params, x)
    assert res and all(tuple(aval.shape) in allowed for aval, _ in res), [(a.shape, d) for a, d in res]
    ref = saved(kan_linear_reference, params, x)
    assert any(len(aval.shape) == 3 and aval.shape[0] == 16 for aval, _ in ref)  # the check can see a basis


@pytest.mark.parametrize("shape", [(3,), (2, 4, 3), (1, 1, 3)])
def test_any_leading_shape(shape):
    params = _layer(13, 3, 5)
    x = _x(13, shape)
    g = _normal(130, shape[:-1] + (5,))
    y, (gp, gx) = _vjp(kan_linear, params, x, g)
    y_r, (gp_r, gx_r) = _vjp(kan_linear_reference, params, x, g)
    assert y.shape == shape[:-1] + (5,) and gx.shape == shape
    np.testing.assert_allclose(y, y_r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, gx_r, rtol=1e-5, atol=1e-5)
    for name in gp:
        np.testing.assert_allclose(gp[name], gp_r[name], rtol=1e-5, atol=1e-5, err_msg=name)
    assert not bool(jnp.any(gp["grid"]))


@pytest.mark.usefixtures("exact_f32_tests_run_on_the_cpu")  # 1e-5 tolerances: not TF32
def test_backends_agree_and_reference_backend_has_forward_mode():
    params = _layer(14, 3, 5)
    x = _x(14, (6, 3))
    np.testing.assert_allclose(jax.jit(kan_linear)(params, x),
                               jax.jit(functools.partial(kan_linear, backend="reference"))(params, x),
                               rtol=1e-6, atol=1e-6)
    f = lambda x: kan_linear(params, x, backend="reference")  # noqa: E731
    jf = jax.jit(jax.jacfwd(f))(x)
    jr = jax.jit(jax.jacrev(lambda x: kan_linear_reference(params, x)))(x)
    np.testing.assert_allclose(jf, jr, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# finite differences in float64: 50 randomised cases, inputs away from knots, vectorised
# ---------------------------------------------------------------------------------------------------------------
def test_finite_differences_float64_all_cases_pass():
    n_cases, batch, in_f, out_f, G, k = 50, 6, 3, 4, 5, 3
    h = 2.0 / G
    rng = np.random.default_rng(2024)
    # inputs in the middle 80% of a knot interval, over the extended grid and one interval past each end
    j = rng.integers(-1, G + 2 * k + 1, (n_cases, batch, in_f))
    cases = {
        "params": {"base_weight": rng.standard_normal((n_cases, out_f, in_f)),
                   "spline_weight": rng.standard_normal((n_cases, out_f, in_f, G + k)),
                   "spline_scaler": rng.standard_normal((n_cases, out_f, in_f)),
                   "bias": rng.standard_normal((n_cases, out_f))},
        "x": -1.0 - k * h + (j + rng.uniform(0.1, 0.9, j.shape)) * h,
        "g": rng.standard_normal((n_cases, batch, out_f)),
    }
    cases["dirs"] = jax.tree.map(lambda a: rng.standard_normal(a.shape), (cases["params"], cases["x"]))
    knots = -1.0 + np.arange(-k, G + k + 1) * h
    with jax.enable_x64(True):
        grid = jnp.asarray(np.broadcast_to(knots, (in_f, knots.size)))
        cases = jax.tree.map(jnp.asarray, cases)

        def one_case(c):
            params, x, g = c["params"], c["x"], c["g"]
            loss = lambda t, x: jnp.vdot(g, kan_linear({**t, "grid": grid}, x))  # noqa: E731
            gt, gx = jax.grad(loss, argnums=(0, 1))(params, x)
            eps = 1e-5
            errs = []
            for which in range(2):  # params, x: one random direction each
                vt = c["dirs"][0] if which == 0 else jax.tree.map(jnp.zeros_like, params)
                vx = c["dirs"][1] if which == 1 else jnp.zeros_like(x)
                plus = loss(jax.tree.map(lambda a, v: a + eps * v, params, vt), x + eps * vx)
                minus = loss(jax.tree.map(lambda a, v: a - eps * v, params, vt), x - eps * vx)
                fd = (plus - minus) / (2 * eps)
                exact_terms = [gx * vx] + [gt[n] * vt[n] for n in params]
                exact = sum(jnp.sum(t) for t in exact_terms)
                scale = sum(jnp.sum(jnp.abs(t)) for t in exact_terms) + jnp.sum(jnp.abs(g))
                errs.append(jnp.abs(fd - exact) / scale)
            return jnp.stack(errs)

        errs = np.asarray(jax.jit(jax.vmap(one_case))(cases))
    assert errs.shape == (n_cases, 2)
    bad = np.argwhere(errs > 1e-7)
    assert bad.size == 0, f"{len(bad)} of {errs.size} directional FD checks failed; worst {errs.max():.2e} at {bad}"


# ---------------------------------------------------------------------------------------------------------------
# hypothesis: shapes, orders, grid sizes (float64, against jax.grad of the reference)
# ---------------------------------------------------------------------------------------------------------------
@settings(max_examples=10, deadline=None, derandomize=True)
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2), in_f=st.integers(1, 4),
       out_f=st.integers(1, 4), grid_size=st.integers(1, 8), order=st.integers(1, 5), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_hypothesis_shapes_orders_grid_sizes(lead, in_f, out_f, grid_size, order, bias, seed):
    with jax.enable_x64(True):
        params = _layer(seed, in_f, out_f, grid_size=grid_size, spline_order=order, bias=bias, dtype=jnp.float64)
        shape = (*lead, in_f)
        x = _x(seed, shape, -1.5, 1.5, jnp.float64)
        g = _normal(seed, (*lead, out_f), jnp.float64)
        y, (gp, gx) = jax.jit(functools.partial(_vjp, kan_linear))(params, x, g)
        y_r, (gp_r, gx_r) = jax.jit(functools.partial(_vjp, kan_linear_reference))(params, x, g)
        assert y.shape == (*lead, out_f) and y.dtype == jnp.float64
        np.testing.assert_allclose(y, y_r, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(gx, gx_r, rtol=1e-12, atol=1e-12)
        for name in gp:
            assert gp[name].shape == params[name].shape and gp[name].dtype == params[name].dtype
            np.testing.assert_allclose(gp[name], gp_r[name], rtol=1e-12, atol=1e-12, err_msg=name)


# ---------------------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------------------
def test_wrong_feature_count_is_named():
    params = _layer(20, 3, 5)
    with pytest.raises(ValueError, match=r"'x'.*\[\.\.\., 3\].*in_features"):
        kan_linear(params, jnp.zeros((4, 2)))
    with pytest.raises(ValueError, match="'spline_scaler'"):
        kan_linear({**params, "spline_scaler": jnp.zeros((5, 4))}, jnp.zeros((4, 3)))


def test_non_float_dtype_is_named():
    params = _layer(21, 3, 5)
    with pytest.raises(TypeError, match="'x' must be floating"):
        kan_linear(params, jnp.zeros((4, 3), jnp.int32))
    with pytest.raises(TypeError, match="'base_weight' must be floating"):
        kan_linear({**params, "base_weight": jnp.zeros((5, 3), jnp.int32)}, jnp.zeros((4, 3)))


@pytest.mark.parametrize("order", [0, 6, -1])
def test_spline_order_outside_1_to_5_is_named(order):
    with pytest.raises(ValueError, match="spline_order"):
        KANConfig(3, 5, spline_order=order)
    with pytest.raises(ValueError, match="spline_order"):
        kan_init(jax.random.key(0), [3, 5], spline_order=order)
    params = _layer(22, 3, 5, grid_size=5, spline_order=3)  # 8 bases per input
    # a grid whose knot count implies an order outside 1..5 (knots = bases + order + 1)
    params["grid"] = jnp.broadcast_to(jnp.linspace(-2.0, 2.0, 8 + order + 1), (3, 8 + order + 1))
    with pytest.raises(ValueError, match="spline_order"):
        kan_linear(params, jnp.zeros((2, 3)))


def test_grid_size_below_one_is_named():
    with pytest.raises(ValueError, match="grid_size"):
        KANConfig(3, 5, grid_size=0)
    with pytest.raises(ValueError, match="grid_size"):
        kan_init(jax.random.key(0), [3, 5], grid_size=0)


@pytest.mark.parametrize("grid_range", [(1.0, 1.0), (1.0, -1.0)])
def test_grid_range_lo_not_below_hi_is_named(grid_range):
    with pytest.raises(ValueError, match="grid_range"):
        KANConfig(3, 5, grid_range=grid_range)
    with pytest.raises(ValueError, match="grid_range"):
        kan_init(jax.random.key(0), [3, 5], grid_range=grid_range)


def test_init_takes_a_config_and_says_so_when_given_widths():
    from jaxgrad import kan

    with pytest.raises(TypeError,
                       match=r"'cfg' must be a KANConfig, got int 4.*KANConfig\(4, 3\).*kan_init\(key, \[4, 3\]\)"):
        kan.init(jax.random.key(0), 4, 3)
    with pytest.raises(TypeError, match="'cfg' must be a KANConfig, got dict"):
        kan.init(jax.random.key(0), {"in_features": 4, "out_features": 3})
    with pytest.raises(TypeError, match="'dtype' must be a floating dtype"):
        kan.init(jax.random.key(0), KANConfig(4, 3), jnp.int32)
    assert kan.init(jax.random.key(0), KANConfig(4, 3))["base_weight"].shape == (3, 4)


def test_unknown_backend_is_named():
    params = _layer(23, 3, 5)
    with pytest.raises(ValueError, match="backend.*'triton'"):
        kan_linear(params, jnp.zeros((2, 3)), backend="triton")


def test_missing_param_is_named():
    params = _layer(24, 3, 5)
    del params["spline_scaler"]
    with pytest.raises(KeyError, match="spline_scaler"):
        kan_linear(params, jnp.zeros((2, 3)))


# ---------------------------------------------------------------------------------------------------------------
# Pallas backend (needs jaxgrad.kan.kernels; interpret mode on CPU)
# ---------------------------------------------------------------------------------------------------------------
def _kernels():
    kernels = pytest.importorskip("jaxgrad.kan.kernels")
    if not all(hasattr(kernels, f) for f in ("kan_spline_forward", "kan_spline_backward")):
        pytest.skip("jaxgrad.kan.kernels lacks kan_spline_forward / kan_spline_backward")
    return kernels


@pytest.mark.parametrize("order", [1, 3])
def test_pallas_backend_matches_xla(order):
    _kernels()
    params = _layer(40 + order, 3, 5, grid_size=8 - order, spline_order=order)
    x = _x(40, (2, 7, 3))
    g = _normal(400, (2, 7, 5))
    pallas = functools.partial(kan_linear, backend="pallas", interpret=True)
    with jax.default_matmul_precision("highest"):  # exact f32 on both paths, also on a GPU (TF32 otherwise)
        y, (gp, gx) = _vjp(pallas, params, x, g)
        y_x, (gp_x, gx_x) = _vjp(kan_linear, params, x, g)
    np.testing.assert_allclose(y, y_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, gx_x, rtol=1e-5, atol=1e-5)
    for name in gp:
        assert gp[name].dtype == params[name].dtype
        np.testing.assert_allclose(gp[name], gp_x[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_pallas_backend_vjp_verified():
    _kernels()
    params = _layer(44, 3, 5)
    _verify_layer(params, _x(44, (7, 3)), backend="pallas", interpret=True, fd=False)
