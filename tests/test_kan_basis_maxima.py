"""The bases' column maxima over the batch in one Pallas kernel (:mod:`jaxgrad.kan.basis_maxima`), the row scales of
the float16 weight-gradient products: (1) they are XLA's chunked maxima (``dcoef_mgpu.left_maxima``) to float32
rounding (float64: to its own; the module's model, (10k + 8) ulps) at odd sizes, G 3 / 20, k 1 / 5, whatever the
chunking; (2) rows past the batch never raise a maximum; (3) what it refuses is named; (4) on a GPU (marked
``gpu``) the compiled kernel agrees as well."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kan_mosaic import _layer, _x

from jaxgrad.kan import dcoef_mgpu as C
from jaxgrad.kan.basis_maxima import bspline_basis_maxima


def _rtol(order, dtype=jnp.float32):
    """basis_maxima's model: 5 roundings a degree in each form, a few ulps for SiLU's exp."""
    return (10 * order + 8) * float(jnp.finfo(dtype).eps) / 2


@pytest.mark.parametrize("batch,in_f,grid_size,order,chunks", [
    (7, 5, 3, 1, None),
    (129, 40, 5, 3, 3),    # 5 blocks of 32 rows in 3 chunks: the last chunk partly past the batch
    (33, 17, 20, 5, None),
])
def test_the_maxima_are_xlas_to_float32_rounding(batch, in_f, grid_size, order, chunks):
    _, grid = _layer(batch, in_f, 3, grid_size=grid_size, spline_order=order)
    x = _x(batch, batch, in_f, -1.3, 1.3)
    got = bspline_basis_maxima(x, grid, order, chunks=chunks, interpret=True)
    want = C.left_maxima(x, grid, order)
    assert got.shape == want.shape == (grid_size + order + 1, in_f)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=_rtol(order), atol=0)


def test_in_float64_the_maxima_are_xlas_to_float64_rounding():
    with jax.enable_x64(True):
        _, grid = _layer(0, 6, 3, grid_size=4, spline_order=3)
        grid = jnp.asarray(grid, jnp.float64)
        x = _x(3, 50, 6, -1.3, 1.3, dtype=jnp.float64)
        got = bspline_basis_maxima(x, grid, 3, interpret=True)
        want = C.left_maxima(x, grid, 3)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=_rtol(3, jnp.float64), atol=0)
        assert got.dtype == jnp.float64


def test_rows_past_the_batch_never_raise_a_maximum():
    # one row at 0.9: the bases around x = 0 are 0 there, and the 31 padding rows of the block (read as x = 0)
    # would make them positive if they counted
    _, grid = _layer(0, 3, 2, grid_size=5, spline_order=3)
    x = jnp.full((1, 3), 0.9, jnp.float32)
    got = np.asarray(bspline_basis_maxima(x, grid, 3, interpret=True))
    want = np.asarray(C.left_maxima(x, grid, 3))
    assert (want[2:4] == 0).all()  # the check can fail: B_2, B_3 are positive at x = 0
    np.testing.assert_allclose(got, want, rtol=_rtol(3), atol=0)


def test_what_it_refuses_is_named():
    _, grid = _layer(0, 4, 2, grid_size=5, spline_order=3)
    x = jnp.zeros((8, 4), jnp.float32)
    with pytest.raises(ValueError, match="x \\[B, in\\] and grid"):
        bspline_basis_maxima(x[:, :3], grid, 3)
    with pytest.raises(ValueError, match="spline_order"):
        bspline_basis_maxima(x, grid, 11)
    with pytest.raises(ValueError, match="'block_b'"):
        bspline_basis_maxima(x, grid, 3, block_b=24)
    with pytest.raises(ValueError, match="'chunks'"):
        bspline_basis_maxima(x, grid, 3, chunks=0)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,in_f,grid_size,order", [(1, 96, 5, 3), (129, 520, 3, 1), (16384, 512, 5, 3),
                                                        (4097, 96, 20, 5), (16384, 512, 20, 3)])
def test_gpu_kernel_gives_xlas_maxima(batch, in_f, grid_size, order):
    _, grid = _layer(batch, in_f, 3, grid_size=grid_size, spline_order=order)
    x = _x(batch, batch, in_f, -1.3, 1.3)
    got = jax.jit(lambda x: bspline_basis_maxima(x, grid, order))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(C.left_maxima(x, grid, order)), rtol=_rtol(order),
                               atol=0)
