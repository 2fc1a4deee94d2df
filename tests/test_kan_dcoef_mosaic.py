"""The KAN layer's weight gradients as one Mosaic GPU kernel (:mod:`jaxgrad.kan.dcoef_mgpu`): the transposed product
``V̄[m] = A^{(m)T} g`` of the bases (and silu) with the output cotangent, from float16 operands scaled by powers of two.

(1) Its formulas (:func:`kan_dcoef_scaled_reference`, plain JAX) are the XLA path's scaled products and, in float64,
exactly the layer's coefficient and SiLU-weight gradients; in float32 they stay within TF32's product model of each
entry. (2) The kernel lowers for Hopper on any machine at odd sizes, grids and orders. (3) What it refuses is named.
(4) On a Hopper GPU (marked ``gpu``) the kernel is within the same model at odd sizes, G 3 / 5 / 20, k 1 / 3 / 5."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kan_mosaic import U16, U32, _cotangent, _layer, _x

from jaxgrad.kan import dcoef_mgpu as C
from jaxgrad.kan.layer import kan_linear, kan_linear_reference


def _exact_and_bound(x, grid, g, order):
    """``(V̄, bound)`` in float64, ``[NB+1, in, out]`` each: the exact products and :mod:`jaxgrad.kan.fp16_scaled`'s
    error model of an entry, TF32's ``(2u + u^2 + K u32) sum_b |A||g|`` plus the float16 subnormals' part
    ``2^-39 (max_b |A| sum_b |g| + max_b |g| sum_b |A|)`` (values more than 2^28 below their slice's largest: a
    cotangent column spanning 1e8 over the batch, a basis touched by its support's tail)."""
    from jaxgrad.kan.spline import bspline_basis

    with jax.enable_x64(True):
        x64, g64, t64 = (jnp.asarray(a, jnp.float64) for a in (x, g, grid))
        phi = bspline_basis(x64, t64, order)
        signed = jnp.concatenate([jnp.transpose(phi, (2, 1, 0)), jax.nn.silu(x64).T[None]], axis=0)  # [NB+1, in, B]
        a, ga = jnp.abs(signed), jnp.abs(g64)
        exact = jnp.einsum("mib,bo->mio", signed, g64)
        mag = jnp.einsum("mib,bo->mio", a, ga)
        subnormal = 2.0**-39 * (jnp.max(a, axis=2)[:, :, None] * jnp.sum(ga, axis=0)[None, None, :]
                                + jnp.sum(a, axis=2)[:, :, None] * jnp.max(ga, axis=0)[None, None, :])
        return np.asarray(exact), np.asarray((2 * U16 + U16**2 + x.shape[0] * U32) * mag + subnormal)


def _over_model(x, grid, g, order, got):
    """Per entry: |got - exact| over its error model (float64)."""
    exact, bound = _exact_and_bound(x, grid, g, order)
    return np.abs(np.asarray(got, np.float64) - exact) / (bound + 1e-300)


# ---------------------------------------------------------------------------------------------------------------
# (1) the formulas
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order", [(7, 5, 3, 5, 3), (33, 9, 4, 20, 1), (1, 6, 7, 3, 5)])
def test_in_float64_the_formulas_are_the_layers_weight_gradients(batch, in_f, out_f, grid_size, order):
    with jax.enable_x64(True):
        trainable, grid = _layer(batch, in_f, out_f, grid_size=grid_size, spline_order=order, dtype=jnp.float64)
        x = _x(batch, batch, in_f, dtype=jnp.float64)
        g = jnp.asarray(np.random.default_rng(3).standard_normal((batch, out_f)))
        coef = trainable["spline_weight"] * trainable["spline_scaler"][..., None]
        p = {"grid": grid, "spline_weight": coef, "spline_scaler": jnp.ones_like(trainable["spline_scaler"]),
             "base_weight": trainable["base_weight"]}
        _, vjp = jax.vjp(lambda p: kan_linear_reference({**p, "grid": grid}, x),
                         {n: v for n, v in p.items() if n != "grid"})
        want = vjp(g)[0]
        got = C.kan_dcoef_scaled_reference(x, grid, g, order)
        np.testing.assert_allclose(np.transpose(got[:-1], (2, 1, 0)), want["spline_weight"], rtol=1e-12,
                                   atol=1e-14)
        np.testing.assert_allclose(got[-1].T, want["base_weight"], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order", [(7, 96, 33, 5, 3), (129, 17, 9, 20, 1),
                                                               (33, 9, 52, 3, 5)])
def test_in_float32_the_formulas_stay_within_tf32s_product_model(batch, in_f, out_f, grid_size, order):
    _, grid = _layer(batch, in_f, out_f, grid_size=grid_size, spline_order=order)
    x, g = _x(batch, batch, in_f, -1.3, 1.3), _cotangent(batch, batch, out_f)
    ratio = _over_model(x, grid, g, order, C.kan_dcoef_scaled_reference(x, grid, g, order))
    assert ratio.max() <= 1.0, ratio.max()
    assert ratio.max() > 1e-3  # the float16 rounding is there: the check can fail


def test_the_formulas_take_the_xla_paths_scaled_operands():
    # the XLA custom VJP at precision="fp16_scaled" forms the same float16 operands (g^T per output, the bases per
    # (input, basis) column); the two differ in the float32 sums' order only
    trainable, grid = _layer(0, 17, 9)
    x, g = _x(0, 65, 17), _cotangent(1, 65, 9)
    p = {**trainable, "grid": grid}
    _, vjp = jax.vjp(lambda t: kan_linear({**t, "grid": grid}, x, backend="xla", precision="fp16_scaled"),
                     {n: v for n, v in p.items() if n != "grid"})
    want = vjp(g)[0]
    got = C.kan_dcoef_scaled_reference(x, grid, g, 3)
    dcoef = np.transpose(np.asarray(got[:-1]), (2, 1, 0))
    np.testing.assert_allclose(dcoef * np.asarray(trainable["spline_scaler"])[..., None], want["spline_weight"],
                               rtol=1e-5, atol=1e-6 * np.abs(want["spline_weight"]).max())
    np.testing.assert_allclose(np.asarray(got[-1]).T, want["base_weight"], rtol=1e-5,
                               atol=1e-6 * np.abs(want["base_weight"]).max())


def test_the_row_maxima_are_taken_a_chunk_of_rows_at_a_time_without_changing_them():
    _, grid = _layer(0, 7, 3, grid_size=4, spline_order=3)
    x = _x(0, 200, 7, -1.3, 1.3)
    whole = jax.jit(lambda x: jnp.max(jnp.abs(C.left_operand(x, grid, 3)), axis=2))(x)
    chunked = jax.jit(lambda x: C.left_maxima(x, grid, 3, chunk=64))(x)  # 4 chunks, the last padded
    np.testing.assert_allclose(chunked, whole, rtol=1e-6)
    assert chunked.shape == (4 + 3 + 1, 7)


def test_the_benchs_xla_dc_row_is_the_formulas_products():
    from jaxgrad.bench.kan import _dcoef_variants

    trainable, grid = _layer(0, 17, 9)
    x, g = _x(0, 33, 17), _cotangent(1, 33, 9)
    dcoef, dwb = _dcoef_variants()["xla dC fp16_scaled"]({**trainable, "grid": grid}, x, g)
    v = np.asarray(C.kan_dcoef_scaled_reference(x, grid, g, 3))
    np.testing.assert_allclose(np.transpose(v[:-1], (2, 1, 0)), dcoef, rtol=1e-5, atol=1e-6 * np.abs(v).max())
    np.testing.assert_allclose(v[-1].T, dwb, rtol=1e-5, atol=1e-6 * np.abs(v).max())


@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order", [(1, 96, 520, 5, 3), (7, 520, 96, 20, 1),
                                                               (129, 17, 9, 5, 5)])
def test_every_scaled_left_operand_the_kernel_forms_is_finite_in_float16_padded_rows_included(
        batch, in_f, out_f, grid_size, order):
    # the kernel multiplies the bases of every row of x^T it is given, padded ones included, by the factors 2^u
    # taken from the real rows' maxima; a padded row of zeros has bases above those maxima (x = 0 sits inside the
    # grid), which overflow float16, and inf * (a zero row of g) is NaN. Repeating the last row keeps them within.
    _, grid = _layer(batch, in_f, out_f, grid_size=grid_size, spline_order=order)
    x, g = _x(batch, batch, in_f), _cotangent(3, batch, out_f)
    ops = C.kernel_operands(x, grid, g, order, C.DcoefTiles())

    def scaled(xt):
        a = C.left_operand(xt[:in_f].T, grid, order)  # [NB+1, in, b_pad]
        return np.asarray((a * ops["f"][:, :in_f, None]).astype(jnp.float16))

    assert ops["xt"].shape[1] > batch and np.all(np.asarray(ops["g16"])[batch:] == 0)
    assert np.isfinite(scaled(ops["xt"])).all()
    zero_padded = jnp.zeros_like(ops["xt"]).at[:in_f, :batch].set(x.T)
    assert batch == 129 or not np.isfinite(scaled(zero_padded)).all()  # where the check bites


# ---------------------------------------------------------------------------------------------------------------
# (2) the kernel lowers for Hopper on any machine; (3) what it refuses is named
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order", [
    (7, 96, 520, 5, 3),
    (129, 520, 96, 20, 1),
    (1, 17, 9, 5, 5),
    (4096, 512, 512, 5, 3),
])
def test_the_kernel_lowers_for_hopper_at_any_grid_order_and_odd_size(monkeypatch, batch, in_f, out_f, grid_size,
                                                                     order):
    monkeypatch.setattr(C, "_num_sms", lambda: 132)
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = (sd(batch, in_f), sd(in_f, grid_size + 2 * order + 1), sd(batch, out_f))
    fn = jax.jit(lambda *a: C.kan_dcoef_mgpu(*a, order))
    assert jax.eval_shape(fn, *args).shape == (grid_size + order + 1, in_f, out_f)
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("tiles", [dict(splits=None), dict(splits=3), dict(splits=1), dict(max_group=5)])
def test_the_kernel_with_the_batch_split_lowers_at_odd_sizes(monkeypatch, tiles):
    monkeypatch.setattr(C, "_num_sms", lambda: 132)
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    cfg = dataclasses.replace(C.DcoefTiles(), **tiles)
    args = (sd(1000, 96), sd(96, 5 + 2 * 3 + 1), sd(1000, 33))
    fn = jax.jit(lambda *a: C.kan_dcoef_mgpu(*a, 3, config=cfg))
    assert jax.eval_shape(fn, *args).shape == (5 + 3 + 1, 96, 33)
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_the_batch_is_split_until_the_tiles_fill_the_sms_keeping_stages_blocks_a_chunk():
    auto = dataclasses.replace(C.DcoefTiles(), splits=None)
    assert C.batch_splits(auto, 16384, 512, 512, 132) == 5  # 32 tiles -> 160
    assert C.batch_splits(auto, 16384, 512, 4096, 132) == 1  # 256 tiles already
    assert C.batch_splits(auto, 129, 512, 512, 132) == 1  # 5 blocks of 32 rows: one chunk of >= 3
    assert C.batch_splits(auto, 1000, 96, 33, 132) == 10  # 32 blocks, 1 tile: 10 chunks of >= 3 blocks
    assert C.batch_splits(C.DcoefTiles(), 16384, 512, 512, 132) == 5  # the default: the split that fills the SMs
    assert C.batch_splits(dataclasses.replace(C.DcoefTiles(), splits=1), 16384, 512, 512, 132) == 1
    ops = C.kernel_operands(_x(0, 100, 5), _layer(0, 5, 3)[1], _cotangent(1, 100, 3), 3, C.DcoefTiles(), splits=3)
    assert ops["xt"].shape[1] == 192 and ops["g16"].shape[0] == 192  # whole blocks of 32 in each of 3 chunks


def test_a_wrong_dtype_shape_or_grid_is_named():
    sd = lambda *shape, dt=jnp.float32: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    with pytest.raises(ValueError, match="'g' must be float32"):
        C.kan_dcoef_mgpu(sd(8, 4), sd(4, 12), sd(8, 3, dt=jnp.bfloat16), 3)
    with pytest.raises(ValueError, match="needs x \\[B, in\\], grid \\[in, knots\\], g \\[B, out\\]"):
        C.kan_dcoef_mgpu(sd(8, 4), sd(4, 12), sd(9, 3), 3)
    with pytest.raises(ValueError, match="grid_size <= 57 at this order"):
        C.kan_dcoef_mgpu(sd(8, 4), sd(4, 60 + 7), sd(8, 3), 3)


# ---------------------------------------------------------------------------------------------------------------
# (4) on the GPU
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order", [
    (1, 96, 520, 5, 3),
    (7, 520, 96, 20, 1),
    (129, 96, 96, 3, 5),
    (129, 96, 96, 5, 5),
    (4096, 512, 512, 5, 3),
    (1000, 512, 512, 20, 3),
])
def test_gpu_kernel_is_within_tf32s_product_model(batch, in_f, out_f, grid_size, order):  # default tiles (split)
    _, grid = _layer(batch, in_f, out_f, grid_size=grid_size, spline_order=order)
    x, g = _x(batch, batch, in_f), _cotangent(3, batch, out_f)
    got = jax.jit(lambda *a: C.kan_dcoef_mgpu(*a, order))(x, grid, g)
    assert got.shape == (grid_size + order + 1, in_f, out_f)
    ratio = _over_model(x, grid, g, order, got)
    assert ratio.max() <= 1.0, ratio.max()


@pytest.mark.gpu
@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order,splits", [
    (4096, 512, 512, 5, 3, None),
    (1000, 512, 520, 20, 3, None),
    (129, 96, 96, 5, 5, 2),
    (7, 96, 33, 3, 1, 3),
    (4096, 512, 512, 5, 3, 1),  # one chunk: the whole batch in each tile's contraction
    (7, 520, 96, 20, 1, 1),
])
def test_gpu_kernel_with_the_batch_split_is_within_tf32s_product_model(batch, in_f, out_f, grid_size, order, splits):
    _, grid = _layer(batch, in_f, out_f, grid_size=grid_size, spline_order=order)
    x, g = _x(batch, batch, in_f), _cotangent(3, batch, out_f)
    cfg = dataclasses.replace(C.DcoefTiles(), splits=splits)
    got = jax.jit(lambda *a: C.kan_dcoef_mgpu(*a, order, config=cfg))(x, grid, g)
    ratio = _over_model(x, grid, g, order, got)
    assert ratio.max() <= 1.0, ratio.max()

