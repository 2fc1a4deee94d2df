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

from jax.extend import core as jex_core

from jaxgrad.kan import basis_tiles, kernel_config
from jaxgrad.kan import kernels as K
from jaxgrad.kan.spline import bspline_basis, bspline_basis_derivative

# On a GPU machine the interpret-mode tests run on its CPU (exact-f32 tolerances); ``gpu`` tests on the GPU.
pytestmark = pytest.mark.usefixtures("exact_f32_tests_run_on_the_cpu")

BF16_U = 2.0**-8  # bf16 unit roundoff
TF32_U = 2.0**-11  # TF32 unit roundoff (10 explicit mantissa bits)


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------
def make_grid_nonuniform(rng, n_in, grid_size, k, coincident=True):
    """Non-uniform non-decreasing knot rows ``[in, G+2k+1]`` (f32) with ``t_k = -1``; row 0 has a zero-width
    interval (coincident knots)."""
    h = 2.0 / grid_size
    widths = rng.uniform(0.4 * h, 1.6 * h, (n_in, grid_size + 2 * k))
    if coincident:
        widths[0, k + 1] = 0.0
    t = np.concatenate([np.zeros((n_in, 1)), np.cumsum(widths, axis=1)], axis=1)
    return (t - t[:, k:k + 1] - 1.0).astype(np.float32)


def make_inputs(seed, n_batch, n_in, n_out, grid_size, k, dtype=jnp.float32):
    """x (up to 15% of the knot span beyond each end of its row, row 0 exactly on knots, two entries on the first
    and last knot), grid, coef, g: fresh random, never zeros. Numpy-generated (no per-shape XLA compiles)."""
    rng = np.random.default_rng(seed)
    grid = make_grid_nonuniform(rng, n_in, grid_size, k)
    lo, hi = grid[:, 0], grid[:, -1]
    x = (lo + rng.uniform(-0.15, 1.15, (n_batch, n_in)) * (hi - lo)).astype(np.float32)
    x[0] = grid[:, k + 1]  # on an interior knot
    if n_batch > 2:
        x[-1, 0], x[-1, 1 % n_in] = grid[0, 0], grid[1 % n_in, -1]  # first knot (inside), last knot (outside)
    coef = rng.standard_normal((n_out, n_in, grid_size + k))
    g = rng.standard_normal((n_batch, n_out))
    return (jnp.asarray(x, dtype), jnp.asarray(grid), jnp.asarray(coef, dtype), jnp.asarray(g, dtype))


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


def check_all(x, grid, coef, g, k, tol, *, backward=True, interpret=True, precision=None, blocks=None, fwd=None,
              dcoef=None, dx=None, batch_splits=None):
    """Forward, dx and dcoef against the float64 reference. ``blocks`` applies to all three kernels; ``fwd``,
    ``dcoef``, ``dx`` add kernel-specific settings."""
    (y_w, dx_w, dc_w), (m_y, m_dx, m_dc) = reference64(x, grid, coef, g, k)
    blocks = blocks or {}
    y = K.kan_spline_forward(x, grid, coef, k, interpret=interpret, precision=precision, **blocks, **(fwd or {}))
    assert y.dtype == x.dtype and y.shape == y_w.shape
    assert_close_to_magnitude("y", y, y_w, m_y, tol)
    if backward:
        dx, dcoef = K.kan_spline_backward(x, grid, coef, g, k, interpret=interpret, precision=precision,
                                          dcoef_config={**blocks, **(dcoef or {})}, dx_config={**blocks, **(dx or {})},
                                          batch_splits=batch_splits)
        assert dx.dtype == x.dtype and dcoef.dtype == coef.dtype
        assert_close_to_magnitude("dx", dx, dx_w, m_dx, tol)
        assert_close_to_magnitude("dcoef", dcoef, dc_w, m_dc, tol)


F32_TOL = 2e-5  # interpret mode: exact f32 dots; bases by a*(1/w) instead of a/w
BF16_TOL = 3 * BF16_U  # basis rounded to bf16 for the dot (u), output rounded to bf16 (u), slack


# ---------------------------------------------------------------------------------------------------------------
# CPU (interpret mode)
# ---------------------------------------------------------------------------------------------------------------
# Small configurations (interpret mode compiles each kernel per shape/config in a few seconds, so tests share them).
BASE = dict(n_batch=7, n_in=5, n_out=3, grid_size=3, k=3)  # every dim smaller than its block


@pytest.mark.parametrize(
    "n_batch, n_in, n_out, grid_size, k, kw",
    [
        (*BASE.values(), {}),
        # NB=3 padded to 4 bases, 4 inputs per tile: 5 input blocks (the last ragged), 3 output blocks
        (1, 17, 33, 2, 1, dict(blocks=dict(block_b=16, block_k=16, block_out=16))),
        (7, 17, 3, 1, 5, dict(blocks=dict(block_k=16))),  # NB=6 padded to 8, 2 inputs per tile: 9 input blocks
        # 9 batch blocks in 2 deterministic splits, 4 inputs per tile
        (129, 17, 33, 3, 3, dict(blocks=dict(block_b=16, block_k=32, block_out=16), batch_splits=2)),
    ],
    ids=["B7-in5-out3-k3", "B1-in17-out33-k1", "B7-in17-out3-k5-G1", "B129-in17-out33-k3-split"],
)
def test_f32_matches_reference(n_batch, n_in, n_out, grid_size, k, kw):
    x, grid, coef, g = make_inputs(n_batch * 100 + k, n_batch, n_in, n_out, grid_size, k)
    check_all(x, grid, coef, g, k, F32_TOL, **kw)


def test_f32_forward_batch_129_default_blocks():
    x, grid, coef, g = make_inputs(5, 129, 17, 33, 3, 3)
    check_all(x, grid, coef, g, 3, F32_TOL, backward=False)


def test_bf16_matches_reference_on_rounded_inputs():
    x, grid, coef, g = make_inputs(11, 7, 17, 33, 3, 2, jnp.bfloat16)
    assert x.dtype == coef.dtype == g.dtype == jnp.bfloat16  # grid stays f32: bases are evaluated in f32
    check_all(x, grid, coef, g, 2, BF16_TOL, blocks=dict(block_k=16))


def test_f64_matches_reference_to_1e12():
    with jax.enable_x64(True):
        x, grid, coef, g = make_inputs(21, 7, 17, 3, 3, 3)
        x, grid, coef, g = (a.astype(jnp.float64) for a in (x, grid, coef, g))
        check_all(x, grid, coef, g, 3, 1e-12, blocks=dict(block_k=16))


def test_large_grid_pads_the_bases_and_widens_the_contraction():
    """G=20, k=5: NB=25 bases padded to 32 with zero tiles; the default tables ask for 8 inputs per tile in dcoef
    (K=256) and allow 4 in the forward and dx (K=128); min_inputs=1 with block_k=32 is the narrowest case."""
    x, grid, coef, g = make_inputs(23, 9, 11, 6, 20, 5)
    assert kernel_config.contraction_width(K.DCOEF_DEFAULTS, 25) == 256
    assert kernel_config.contraction_width(K.DX_DEFAULTS, 25) == 128
    assert kernel_config.contraction_width(K.FWD_DEFAULTS, 25) == 128
    assert kernel_config.contraction_width(K.DCOEF_DEFAULTS, 8) == 128  # G=5, k=3: unchanged
    check_all(x, grid, coef, g, 5, F32_TOL)
    check_all(x, grid, coef, g, 5, F32_TOL, blocks=dict(min_inputs=1, block_k=32))


def test_basis_tile_puts_basis_m_of_input_i_in_column_i_times_nbp_plus_m():
    """The layout every dot relies on: the row-major flattening of efficient-kan's [out, in, NB] coefficients."""
    n, bb, bk = 8, 3, 4
    tiles = [jnp.full((bb, bk), 10.0 * m) + jnp.arange(bk)[None, :] for m in range(n)]  # T_m[:, i] = 10 m + i
    tile = np.asarray(basis_tiles.interleave(tiles))
    want = np.array([[10.0 * m + i for i in range(bk) for m in range(n)]] * bb)
    np.testing.assert_array_equal(tile, want)


@pytest.mark.parametrize("n_in, nbp, block_k, bk", [(512, 8, 128, 16), (512, 32, 128, 4), (3, 8, 128, 4),
                                                    (512, 256, 128, 1), (1, 4, 128, 4), (17, 2, 16, 8)])
def test_input_tile_keeps_the_contraction_at_block_k_and_at_least_16(n_in, nbp, block_k, bk):
    assert basis_tiles.input_block(n_in, nbp, block_k) == bk
    assert bk * nbp >= 16


def test_mixed_dtypes_follow_the_documented_policy():
    """bf16 x with f32 coef: bases and dot in f32; y in x.dtype."""
    x, grid, coef, g = make_inputs(31, **BASE)
    xb = x.astype(jnp.bfloat16)
    y = K.kan_spline_forward(xb, grid, coef, BASE["k"], interpret=True)
    assert y.dtype == jnp.bfloat16
    (y_w, _, _), (m_y, _, _) = reference64(xb, grid, coef, g, BASE["k"])
    assert_close_to_magnitude("y", y, y_w, m_y, 2 * BF16_U)


def test_out_of_range_inputs_contribute_nothing():
    """Beyond the outer knots every basis is 0: y = 0, dx = 0, and such rows add nothing to dcoef."""
    x, grid, coef, g = make_inputs(41, **BASE)
    k = BASE["k"]
    far = x.at[3:5].set(-50.0).at[5:].set(50.0)
    y = K.kan_spline_forward(far, grid, coef, k, interpret=True)
    dx, dcoef = K.kan_spline_backward(far, grid, coef, g, k, interpret=True)
    assert np.all(np.asarray(y[3:]) == 0) and np.all(np.asarray(dx[3:]) == 0)
    _, dcoef_near = K.kan_spline_backward(far, grid, coef, g.at[3:].set(0.0), k, interpret=True)
    np.testing.assert_array_equal(dcoef, dcoef_near)


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
            for sub in jex_core.jaxprs_in_params(eqn.params):
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
    with pytest.raises(ValueError, match="'min_inputs' .* must be a power of two >= 1, got 3"):
        K.kan_spline_forward(x, grid, coef, 3, min_inputs=3)
    with pytest.raises(ValueError, match="'block_k' must be a power of two >= 16"):
        K.kan_spline_backward(x, grid, coef, g, 3, dx_config=dict(block_k=24))
    with pytest.raises(ValueError, match="'dcoef_config' has unknown keys \\['block_in'\\]"):
        K.kan_spline_backward(x, grid, coef, g, 3, dcoef_config=dict(block_in=16))


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
    # both dot operands reduced to TF32 (10 mantissa bits; the tensor cores may truncate rather than round, so up
    # to 2u relative per operand): <= 4u per product; slack 2x
    "f32-tf32": (jnp.float32, None, 8 * TF32_U),
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
    check_all(x, grid, coef, g, k, 8 * TF32_U, interpret=False)
    check_all(x, grid, coef, g, k, 3e-5, interpret=False, precision=jax.lax.Precision.HIGHEST,
              blocks=dict(block_k=32), batch_splits=2)


def test_pipeline_stages_fall_back_to_one_when_shared_memory_would_overflow():
    assert kernel_config.pipeline_stages(None, 64 * 1024) == 2
    # two copies would exceed the ~200 KB budget (227 KB per block)
    assert kernel_config.pipeline_stages(None, 120 * 1024) == 1
    assert kernel_config.pipeline_stages(3, 120 * 1024) == 3  # an explicit value is honoured


def test_exact_f32_precisions_pick_their_own_launch_defaults():
    """IEEE f32 dots are FMA loops on Triton (the TF32 tiles spill) and 3-pass TF32 keeps hi/lo operand copies in
    shared memory (the TF32 tiles overflow it), so both use smaller tiles."""
    hi = jax.lax.Precision.HIGHEST
    for kernel, tf32 in (("fwd", K.FWD_DEFAULTS), ("dcoef", K.DCOEF_DEFAULTS), ("dx", K.DX_DEFAULTS)):
        assert kernel_config.launch_defaults(kernel, None) is tf32
        assert kernel_config.launch_defaults(kernel, jax.lax.DotAlgorithmPreset.TF32_TF32_F32) is tf32
        for p in (hi, (hi, hi), jax.lax.DotAlgorithmPreset.F32_F32_F32, jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3):
            assert kernel_config.launch_defaults(kernel, p) is K.EXACT_F32_DEFAULTS[kernel]


def test_the_kernels_module_names_every_public_kernel_and_its_defaults():
    """The split modules stay one public surface: everything in ``jaxgrad.kan.kernels.__all__`` is importable from it,
    and the kernels and defaults are the objects of the modules that define them."""
    from jaxgrad.kan import backward_kernels, forward_kernel
    assert all(hasattr(K, name) for name in K.__all__)
    assert K.kan_spline_forward is forward_kernel.kan_spline_forward
    assert (K.kan_spline_backward, K.kan_spline_dcoef, K.kan_spline_dx) == (
        backward_kernels.kan_spline_backward, backward_kernels.kan_spline_dcoef, backward_kernels.kan_spline_dx)
    assert K.FWD_DEFAULTS is kernel_config.FWD_DEFAULTS and K.EXACT_F32_DEFAULTS is kernel_config.EXACT_F32_DEFAULTS
