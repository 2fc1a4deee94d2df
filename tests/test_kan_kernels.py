"""KAN spline kernels (jaxgrad.kan.kernels): forward, dcoef and dx against a float64 plain-JAX reference built from
``bspline_basis`` / ``bspline_basis_derivative``.

Errors are judged elementwise against the magnitude ``M = sum |terms|`` of each output (the scale rounding error
is bounded by), at fresh random non-zero inputs, on non-uniform knot rows with a coincident knot, with inputs partly
outside the grid and some exactly on knots. CPU tests run the kernels in interpret mode (tiny sizes: interpret mode
compiles slowly); the ``gpu`` tests compile them with Triton and check TF32 / IEEE f32 / bf16 error levels.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.kan import kernels as K
from jaxgrad.kan.spline import bspline_basis, bspline_basis_derivative

BF16_U = 2.0**-8  # bf16 unit roundoff
TF32_U = 2.0**-11  # TF32 unit roundoff (10 explicit mantissa bits)


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------
def make_grid_nonuniform(key, n_in, grid_size, k, coincident=True):
    """Non-uniform non-decreasing knot rows ``[in, G+2k+1]`` around [-1, 1]; row 0 has a zero-width interval."""
    n_knots = grid_size + 2 * k + 1
    h = 2.0 / grid_size
    widths = jax.random.uniform(key, (n_in, n_knots - 1), jnp.float32, 0.4 * h, 1.6 * h)
    if coincident:
        widths = widths.at[0, k + 1].set(0.0)
    t = jnp.concatenate([jnp.zeros((n_in, 1)), jnp.cumsum(widths, axis=1)], axis=1)
    return t - t[:, k:k + 1] - 1.0  # t_k = -1 on every row


def make_inputs(seed, n_batch, n_in, n_out, grid_size, k, dtype=jnp.float32):
    """x (15% beyond each end of every knot row, some rows exactly on knots), grid, coef, g; never zeros."""
    kg, kx, kc, kd = jax.random.split(jax.random.key(seed), 4)
    grid = make_grid_nonuniform(kg, n_in, grid_size, k)
    lo, hi = grid[:, 0], grid[:, -1]
    span = hi - lo
    u = jax.random.uniform(kx, (n_batch, n_in), jnp.float32, -0.15, 1.15)
    x = lo + u * span
    x = x.at[0].set(grid[:, k + 1])  # on an interior knot
    if n_batch > 2:
        x = x.at[-1, 0].set(grid[0, 0]).at[-1, 1 % n_in].set(grid[1 % n_in, -1])  # first knot (in), last (out)
    coef = jax.random.normal(kc, (n_out, n_in, grid_size + k), jnp.float32)
    g = jax.random.normal(kd, (n_batch, n_out), jnp.float32)
    return x.astype(dtype), grid, coef.astype(dtype), g.astype(dtype)


# ---------------------------------------------------------------------------------------------------------------
# float64 reference and magnitudes
# ---------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=4)
def _reference_and_magnitudes(x, grid, coef, g, k):
    phi = bspline_basis(x, grid, k)
    dphi = bspline_basis_derivative(x, grid, k)
    lower = bspline_basis(x, grid, k - 1)  # [B, in, G+k+1], all >= 0
    t = grid.astype(x.dtype)
    w1, w2 = t[:, k:-1] - t[:, :-(k + 1)], t[:, k + 1:] - t[:, 1:-k]
    inv1 = jnp.where(w1 > 0, 1 / jnp.where(w1 > 0, w1, 1), 0)
    inv2 = jnp.where(w2 > 0, 1 / jnp.where(w2 > 0, w2, 1), 0)
    dphi_mag = k * (lower[..., :-1] * inv1 + lower[..., 1:] * inv2)
    hp = jax.lax.Precision.HIGHEST
    y = jnp.einsum("bim,oim->bo", phi, coef, precision=hp)
    dcoef = jnp.einsum("bo,bim->oim", g, phi, precision=hp)
    dx = jnp.einsum("bim,bo,oim->bi", dphi, g, coef, precision=hp)
    ac, ag = jnp.abs(coef), jnp.abs(g)
    m_y = jnp.einsum("bim,oim->bo", phi, ac, precision=hp)
    m_dcoef = jnp.einsum("bo,bim->oim", ag, phi, precision=hp)
    m_dx = jnp.einsum("bim,bo,oim->bi", dphi_mag, ag, ac, precision=hp)
    return (y, dx, dcoef), (m_y, m_dx, m_dcoef)


def reference64(x, grid, coef, g, k):
    """float64 (y, dx, dcoef) and their magnitudes, from the inputs exactly as the kernels see them."""
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, grid, coef, g)]
        vals, mags = _reference_and_magnitudes(*args, k)
        return [np.asarray(v) for v in vals], [np.asarray(m) for m in mags]


def assert_close_to_magnitude(name, got, want, mag, tol):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    err = np.abs(got - want)
    bound = tol * mag + 1e-30
    bad = err > bound
    if bad.any():
        idx = np.unravel_index(np.argmax(err / bound), err.shape)
        raise AssertionError(f"{name}: {bad.sum()} of {err.size} entries exceed tol*M (tol={tol:.3g}); worst at {idx}: "
                             f"got {got[idx]!r}, want {want[idx]!r}, M={mag[idx]!r}, err/M={err[idx] / mag[idx]:.3g}")


def check_all(x, grid, coef, g, k, tol, *, backward=True, **kw):
    (y_w, dx_w, dc_w), (m_y, m_dx, m_dc) = reference64(x, grid, coef, g, k)
    y = K.kan_spline_forward(x, grid, coef, k, **{n: v for n, v in kw.items() if n in _FWD_KW})
    assert y.dtype == x.dtype and y.shape == y_w.shape
    assert_close_to_magnitude("y", y, y_w, m_y, tol)
    if backward:
        dx, dcoef = K.kan_spline_backward(x, grid, coef, g, k, **kw)
        assert dx.dtype == x.dtype and dcoef.dtype == coef.dtype
        assert_close_to_magnitude("dx", dx, dx_w, m_dx, tol)
        assert_close_to_magnitude("dcoef", dcoef, dc_w, m_dc, tol)


_FWD_KW = {"precision", "interpret", "block_b", "block_in", "block_out", "num_warps", "num_stages"}
F32_TOL = 2e-5  # interpret mode: exact f32 dots; bases by a*(1/w) instead of a/w
BF16_TOL = 3 * BF16_U  # basis rounded to bf16 for the dot (u), output rounded to bf16 (u), slack


# ---------------------------------------------------------------------------------------------------------------
# CPU (interpret mode)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n_batch, n_in, n_out, grid_size, k, kw",
    [
        (7, 5, 3, 5, 3, {}),  # defaults; every dim smaller than its block
        (1, 17, 33, 4, 1, dict(block_b=16, block_in=16, block_out=16)),  # 2 in- and 3 out-blocks, ragged
        (7, 17, 3, 3, 5, dict(block_in=16, block_m=4)),  # k=5: NB=8 in 2 chunks of 4
        (129, 17, 33, 5, 3, dict(block_b=16, block_in=16, block_out=16, block_m=3, batch_splits=2)),
    ],
    ids=["B7-in5-out3-k3", "B1-in17-out33-k1", "B7-in17-out3-k5", "B129-in17-out33-k3-split"],
)
def test_f32_matches_reference(n_batch, n_in, n_out, grid_size, k, kw):
    x, grid, coef, g = make_inputs(n_batch * 100 + k, n_batch, n_in, n_out, grid_size, k)
    check_all(x, grid, coef, g, k, F32_TOL, interpret=True, **kw)


def test_f32_forward_batch_129_default_blocks():
    x, grid, coef, g = make_inputs(5, 129, 17, 33, 5, 3)
    check_all(x, grid, coef, g, 3, F32_TOL, backward=False, interpret=True)


@pytest.mark.parametrize("n_batch, n_in, n_out, k", [(7, 17, 33, 3), (1, 5, 3, 2)])
def test_bf16_matches_reference_on_rounded_inputs(n_batch, n_in, n_out, k):
    x, grid, coef, g = make_inputs(11 + k, n_batch, n_in, n_out, 5, k, jnp.bfloat16)
    assert x.dtype == coef.dtype == g.dtype == jnp.bfloat16  # grid stays f32: bases are evaluated in f32
    check_all(x, grid, coef, g, k, BF16_TOL, interpret=True, block_in=16)


@pytest.mark.parametrize("n_batch, n_in, n_out, k", [(7, 5, 3, 3), (7, 17, 3, 1)])
def test_f64_matches_reference_to_1e12(n_batch, n_in, n_out, k):
    with jax.enable_x64(True):
        x, grid, coef, g = make_inputs(21 + k, n_batch, n_in, n_out, 4, k)
        x, grid, coef, g = (a.astype(jnp.float64) for a in (x, grid, coef, g))
        check_all(x, grid, coef, g, k, 1e-12, interpret=True, block_in=16, block_m=3)
        y = K.kan_spline_forward(x, grid, coef, k, interpret=True)
        assert y.dtype == jnp.float64


def test_mixed_dtypes_follow_the_documented_policy():
    """bf16 x with f32 coef: dots in f32; y, dx in x.dtype and dcoef in coef.dtype."""
    x, grid, coef, g = make_inputs(31, 7, 5, 3, 4, 2)
    xb = x.astype(jnp.bfloat16)
    y = K.kan_spline_forward(xb, grid, coef, 2, interpret=True)
    dx, dcoef = K.kan_spline_backward(xb, grid, coef, g, 2, interpret=True)
    assert (y.dtype, dx.dtype, dcoef.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    (y_w, _, dc_w), (m_y, _, m_dc) = reference64(xb, grid, coef, g, 2)
    assert_close_to_magnitude("y", y, y_w, m_y, 2 * BF16_U)
    assert_close_to_magnitude("dcoef", dcoef, dc_w, m_dc, F32_TOL)


def test_out_of_range_inputs_contribute_nothing():
    """Beyond the outer knots every basis is 0: y = 0, dx = 0, and such rows add nothing to dcoef."""
    x, grid, coef, g = make_inputs(41, 7, 5, 3, 4, 3)
    far = jnp.concatenate([x[:3], jnp.full((4, 5), 50.0), ], axis=0).at[3:5].set(-50.0)
    y = K.kan_spline_forward(far, grid, coef, 3, interpret=True)
    dx, dcoef = K.kan_spline_backward(far, grid, coef, g, 3, interpret=True)
    assert np.all(np.asarray(y[3:]) == 0) and np.all(np.asarray(dx[3:]) == 0)
    _, dcoef3 = K.kan_spline_backward(far[:3], grid, coef, g[:3], 3, interpret=True)
    np.testing.assert_allclose(dcoef, dcoef3, rtol=1e-6, atol=1e-6)


def test_basis_tensor_is_not_materialised_outside_the_kernel():
    """No value of the wrapper's jaxpr (outside the kernels) has the B*in*(G+k) elements of the basis."""
    n_batch, n_in, n_out, grid_size, k = 64, 32, 16, 5, 3
    x, grid, coef, g = make_inputs(51, n_batch, n_in, n_out, grid_size, k)
    basis_size = n_batch * n_in * (grid_size + k)

    def sizes(jaxpr, acc):
        for eqn in jaxpr.eqns:
            acc.extend(int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))
            if eqn.primitive.name == "pallas_call":
                continue
            for sub in jax.core.jaxprs_in_params(eqn.params):
                sizes(sub, acc)
        return acc

    for f in (lambda *a: K.kan_spline_forward(*a[:3], k, interpret=True),
              lambda *a: K.kan_spline_backward(*a, k, interpret=True)):
        closed = jax.make_jaxpr(f)(x, grid, coef, g)
        assert basis_size not in sizes(closed.jaxpr, []), "a [B, in, G+k]-sized value escapes the kernels"
        assert "pallas_call" in str(closed)


def test_bad_arguments_are_named():
    x, grid, coef, g = make_inputs(61, 3, 5, 4, 4, 3)
    with pytest.raises(ValueError, match=r"'x' must have shape \[batch, in_features\], got \(15,\)"):
        K.kan_spline_forward(x.reshape(-1), grid, coef, 3)
    with pytest.raises(ValueError, match=r"'coef' must have shape \[out_features, 5, G\+k\]"):
        K.kan_spline_forward(x, grid, coef[:, :4], 3)
    with pytest.raises(ValueError, match=r"'grid' must have shape \(5, 11\) = \[in_features, G\+2k\+1\]"):
        K.kan_spline_forward(x, grid[:, :-1], coef, 3)
    with pytest.raises(ValueError, match=r"'grid' must have shape \(5, 10\)"):  # k=2 implies a different grid
        K.kan_spline_forward(x, grid, coef, 2)
    with pytest.raises(ValueError, match=r"'g' \(the cotangent of y\) must have shape \(3, 4\)"):
        K.kan_spline_backward(x, grid, coef, g.T, 3)
    with pytest.raises(ValueError, match="'spline_order' must be an int >= 1"):
        K.kan_spline_forward(x, grid, coef, 0)
    with pytest.raises(ValueError, match="spline_order k=7 it needs G\\+k >= 8"):
        K.kan_spline_forward(x, jnp.zeros((5, 15)), coef, 7)
    with pytest.raises(TypeError, match="'x' must be a floating-point array, got int32"):
        K.kan_spline_forward(x.astype(jnp.int32), grid, coef, 3)
    with pytest.raises(ValueError, match="'block_out' must be a power of two >= 16"):
        K.kan_spline_forward(x, grid, coef, 3, block_out=48)
    with pytest.raises(ValueError, match="'block_m'"):
        K.kan_spline_backward(x, grid, coef, g, 3, block_m=0)


def test_empty_batch():
    x, grid, coef, g = make_inputs(71, 3, 5, 4, 4, 3)
    assert K.kan_spline_forward(x[:0], grid, coef, 3).shape == (0, 4)
    dx, dcoef = K.kan_spline_backward(x[:0], grid, coef, g[:0], 3)
    assert dx.shape == (0, 5) and dcoef.shape == coef.shape and not np.any(np.asarray(dcoef))


# ---------------------------------------------------------------------------------------------------------------
# GPU (Triton): run by the lead on an H100/H200
# ---------------------------------------------------------------------------------------------------------------
GPU_MODES = {
    # name: (dtype, precision, tolerance against M = sum|terms|)
    "f32-tf32": (jnp.float32, None, 4 * TF32_U),  # both dot operands rounded to TF32: 2u per product, slack 2x
    "f32-highest": (jnp.float32, jax.lax.Precision.HIGHEST, 3e-5),
    "bf16": (jnp.bfloat16, None, BF16_TOL),
}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(GPU_MODES))
@pytest.mark.parametrize("n_batch", [1, 7, 129, 4096])
def test_gpu_triton_matches_reference(mode, n_batch):
    dtype, precision, tol = GPU_MODES[mode]
    x, grid, coef, g = make_inputs(81 + n_batch, n_batch, 512, 512, 5, 3, dtype)
    check_all(x, grid, coef, g, 3, tol, interpret=False, precision=precision)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 5])
def test_gpu_triton_ragged_shapes_and_orders(k):
    x, grid, coef, g = make_inputs(91 + k, 129, 17, 33, 4, k)
    check_all(x, grid, coef, g, k, 4 * TF32_U, interpret=False)
    check_all(x, grid, coef, g, k, 3e-5, interpret=False, precision=jax.lax.Precision.HIGHEST, block_m=3,
              batch_splits=2)
