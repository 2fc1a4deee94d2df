"""``kan_linear(backend="mosaic")``: the KAN forward and the input gradient (spline and SiLU branches each) in Mosaic
GPU kernels with the bases computed in registers (jaxgrad/kan/forward_mgpu.py, jaxgrad/kan/dx_mgpu.py); the weight
gradients' kernel (jaxgrad/kan/dcoef_mgpu.py) has its own tests (test_kan_dcoef_mosaic.py), the layer's are here.

The kernels' operands are :mod:`jaxgrad.kan.fp16_scaled`'s: forward ``[bases | silu(x)]`` scaled per row and
``[C; W^b]`` per column; dx ``g`` per row and each ``C_{..m}`` / ``W^b`` per column; float16, float32 sums, exact
unscaling. So (1) their plain-JAX formulas stay within TF32's product model of the exact float64 results at odd
sizes and at any row scale; (2) in float64 (no float16 rounding) the layer and
every gradient equal jax.grad of the reference to 1e-12; (3) the kernel lowers for Hopper at every grid, order and
odd size on any machine; (4) what the backend does not take is named; and, on the GPU, (5) the kernel equals its
formulas (the same float16 products, summed in another order) and the layer passes the verifier's TF32 model.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.kan import dx_mgpu as D
from jaxgrad.kan import forward_mgpu as F
from jaxgrad.kan.layer import kan_linear, kan_linear_reference

U16 = 2.0**-11
U32 = 2.0**-24


def _layer(seed, in_f, out_f, *, grid_size=5, spline_order=3, out_scales=None, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    G, k = grid_size, spline_order
    knots = -1.0 + np.arange(-k, G + k + 1) * (2.0 / G)
    s = np.ones(out_f) if out_scales is None else np.asarray(out_scales, np.float64)
    p = {
        "base_weight": rng.standard_normal((out_f, in_f)) / math.sqrt(in_f) * s[:, None],
        "spline_weight": rng.standard_normal((out_f, in_f, G + k)) * s[:, None, None],
        "spline_scaler": rng.standard_normal((out_f, in_f)) / math.sqrt(in_f),
        "bias": rng.standard_normal((out_f,)) * s,
    }
    trainable = {n: jnp.asarray(v, dtype) for n, v in p.items()}
    return trainable, jnp.asarray(np.broadcast_to(knots, (in_f, knots.size)), dtype)


def _x(seed, batch, in_f, lo=-1.2, hi=1.2, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(1000 + seed).uniform(lo, hi, (batch, in_f)), dtype)


def _operands(trainable, grid):
    coef = trainable["spline_weight"] * trainable["spline_scaler"][..., None]
    return grid, coef, trainable["base_weight"]


# ---------------------------------------------------------------------------------------------------------------
# (1) the kernel's formulas: TF32's product model
# ---------------------------------------------------------------------------------------------------------------
def _forward_over_model(trainable, grid, x, order, got):
    """Per output entry: |got - exact| over TF32's product model (2u + u^2 + K u32) sum|terms| (float64)."""
    grid_size = grid.shape[1] - 2 * order - 1
    with jax.enable_x64(True):
        p64 = {n: jnp.asarray(v, jnp.float64) for n, v in {**trainable, "grid": grid}.items()}
        p64.pop("bias")
        x64 = jnp.asarray(x, jnp.float64)
        exact = np.asarray(kan_linear_reference(p64, x64))
        absp = {**{n: jnp.abs(v) for n, v in p64.items()}, "grid": p64["grid"]}
        phi_part = {**absp, "base_weight": jnp.zeros_like(absp["base_weight"])}
        mag = (np.asarray(kan_linear_reference(phi_part, x64))
               + np.abs(np.asarray(jax.nn.silu(x64))) @ np.abs(np.asarray(p64["base_weight"])).T)
    depth = x.shape[1] * (grid_size + order + 1)
    return np.abs(np.asarray(got, np.float64) - exact) / ((2 * U16 + U16**2 + depth * U32) * mag)


def _dx_over_model(trainable, grid, x, g, order, got):
    """Per input entry: |got - exact dx| over TF32's product model of its sum of |terms| (float64)."""
    from jaxgrad.kan.spline import bspline_basis_derivative

    grid_size = grid.shape[1] - 2 * order - 1
    with jax.enable_x64(True):
        p64 = {n: jnp.asarray(v, jnp.float64) for n, v in {**trainable, "grid": grid}.items()}
        x64, g64 = jnp.asarray(x, jnp.float64), jnp.asarray(g, jnp.float64)
        _, vjp = jax.vjp(lambda x: kan_linear_reference(p64, x), x64)
        exact = np.asarray(vjp(g64)[0])
        c64 = jnp.abs(p64["spline_weight"] * p64["spline_scaler"][..., None])
        dphi = jnp.abs(bspline_basis_derivative(x64, p64["grid"], order))
        s = jax.nn.sigmoid(x64)
        mag = np.asarray(jnp.einsum("bo,oim,bim->bi", jnp.abs(g64), c64, dphi)
                         + (jnp.abs(g64) @ jnp.abs(p64["base_weight"])) * jnp.abs(s * (1 + x64 * (1 - s))))
    depth = g.shape[1] * (grid_size + order + 2)
    return np.abs(np.asarray(got, np.float64) - exact) / ((2 * U16 + U16**2 + depth * U32) * mag + 1e-300)


@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order,x_range", [
    (7, 96, 33, 5, 3, (-1.2, 1.2)),
    (129, 17, 9, 20, 1, (-1.2, 1.2)),
    (33, 9, 520, 3, 5, (-40.0, 40.0)),  # silu rows up to 40: the row scale comes from silu, not the bases' bound
])
def test_the_kernels_formulas_stay_within_tf32s_product_model(batch, in_f, out_f, grid_size, order, x_range):
    trainable, grid = _layer(batch, in_f, out_f, grid_size=grid_size, spline_order=order,
                             out_scales=[1e4 if o % 3 == 0 else 1e-3 for o in range(out_f)])
    x = _x(batch, batch, in_f, *x_range)
    g, coef, wb = _operands(trainable, grid)
    ratio = _forward_over_model(trainable, grid, x, order, F.kan_forward_scaled_reference(x, g, coef, wb, order))
    assert ratio.max() <= 1.0, ratio.max()
    assert ratio.max() > 1e-3  # the float16 rounding is there: the check can fail


def _cotangent(seed, batch, out_f):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((batch, out_f)) * np.logspace(-4, 4, batch)[:, None], jnp.float32)


@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order", [(7, 96, 33, 5, 3), (129, 17, 9, 20, 1),
                                                               (33, 9, 520, 3, 5)])
def test_the_dx_kernels_formulas_stay_within_tf32s_product_model(batch, in_f, out_f, grid_size, order):
    trainable, grid = _layer(batch, in_f, out_f, grid_size=grid_size, spline_order=order)
    x, g = _x(batch, batch, in_f), _cotangent(batch, batch, out_f)
    _, coef, wb = _operands(trainable, grid)
    ratio = _dx_over_model(trainable, grid, x, g, order, D.kan_dx_scaled_reference(x, grid, coef, wb, g, order))
    assert ratio.max() <= 1.0, ratio.max()
    assert ratio.max() > 1e-3


@pytest.mark.parametrize("order,grid_size", [(1, 3), (3, 5), (5, 4), (3, 20)])
def test_the_affine_sweep_gives_the_bases_at_any_knots(order, grid_size):
    # non-uniform rows with a zero-width interval and a triple knot: float64 equals the reference to rounding, float32
    # is off by a few ulps of 1 at most (the form's absolute error)
    from jaxgrad.kan.basis_tiles import KnotTable, affine_knot_tables, affine_sweep
    from jaxgrad.kan.spline import bspline_basis

    rng = np.random.default_rng(order * 100 + grid_size)
    n_in, nb = 7, grid_size + order
    t = np.sort(rng.uniform(-1, 1, (n_in, grid_size + 2 * order + 1)), axis=1)
    t[2, 4] = t[2, 5]
    t[3, 3:6] = t[3, 3]
    x = rng.uniform(-1.3, 1.3, (50, n_in))
    with jax.enable_x64(True):
        want = np.asarray(bspline_basis(jnp.asarray(x), jnp.asarray(t), order))
        for dtype, tol in ((jnp.float64, 1e-13), (jnp.float32, 4e-6)):
            tab = affine_knot_tables(jnp.asarray(t, dtype), dtype, order, nb + order + 1, n_in)
            rows = KnotTable(lambda p, r: tab[p * (nb + order + 1) + r])
            got = np.stack([b for _, b in affine_sweep(jnp.asarray(x, dtype), rows, nb + order, order, order)], -1)
            np.testing.assert_allclose(got, want, rtol=0, atol=tol)


def test_a_grid_past_the_kernels_knot_table_is_named():
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    grid = jax.ShapeDtypeStruct((4, 60 + 7), jnp.float32)
    coef = jax.ShapeDtypeStruct((3, 4, 63), jnp.float32)
    assert "grid_size <= 57 at this order" in F.supported(x, grid, coef, jax.ShapeDtypeStruct((3, 4), jnp.float32))
    assert F.knot_table_limit(jax.ShapeDtypeStruct((4, 57 + 7), jnp.float32),
                              jax.ShapeDtypeStruct((3, 4, 60), jnp.float32)) is None


def test_a_rows_scale_comes_from_its_largest_silu_and_the_bases_bound():
    x = jnp.array([[0.0, 0.0], [40.0, -3.0], [1e-3, 0.5]], jnp.float32)
    trainable, grid = _layer(0, 2, 3)
    _, coef, wb = _operands(trainable, grid)
    s, t, v = F.scaled_operands(x, coef, wb)
    # row bound max(1, max|silu|): 1 -> 2^14 * 1; 40 -> 2^14 <= 40 * 2^s < 2^15
    assert list(np.asarray(s)) == [14, 9, 14]
    assert v.shape == (coef.shape[-1] + 1, 2, 3)
    top = np.max(np.abs(np.asarray(v)), axis=(0, 1)) * 2.0 ** np.asarray(t)
    assert np.all((top >= 2**14) & (top < 2**15))


# ---------------------------------------------------------------------------------------------------------------
# (2) float64: the layer on backend="mosaic" is jax.grad of the reference
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order", [(7, 5, 3, 5, 3), (33, 9, 4, 20, 1), (1, 6, 7, 3, 5)])
def test_float64_value_and_every_gradient_equal_jax_grad_of_the_reference(batch, in_f, out_f, grid_size, order):
    with jax.enable_x64(True):
        trainable, grid = _layer(batch, in_f, out_f, grid_size=grid_size, spline_order=order, dtype=jnp.float64)
        x = _x(batch, batch, in_f, dtype=jnp.float64)
        w = jnp.asarray(np.random.default_rng(7).standard_normal((batch, out_f)))

        def loss(t, x, backend):
            p = {**t, "grid": grid}
            y = kan_linear(p, x, backend=backend) if backend != "ref" else kan_linear_reference(p, x)
            return jnp.sum(jnp.sin(y) * w)

        val, grads = jax.value_and_grad(loss, argnums=(0, 1))(trainable, x, "mosaic")
        want, grads_want = jax.value_and_grad(loss, argnums=(0, 1))(trainable, x, "ref")
        np.testing.assert_allclose(val, want, rtol=1e-12)
        for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_want)):
            np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# (3) the kernel lowers for Hopper on any machine
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order", [
    (7, 96, 520, 5, 3),
    (129, 520, 96, 20, 3),
    (1, 17, 9, 5, 5),
    (256, 64, 128, 3, 1),
])
def test_the_kernel_lowers_for_hopper_at_any_grid_order_and_odd_size(monkeypatch, batch, in_f, out_f, grid_size,
                                                                     order):
    monkeypatch.setattr(F, "_num_sms", lambda: 132)
    nb = grid_size + order
    x = jax.ShapeDtypeStruct((batch, in_f), jnp.float32)
    grid = jax.ShapeDtypeStruct((in_f, grid_size + 2 * order + 1), jnp.float32)
    coef = jax.ShapeDtypeStruct((out_f, in_f, nb), jnp.float32)
    wb = jax.ShapeDtypeStruct((out_f, in_f), jnp.float32)
    fn = jax.jit(lambda x, g, c, w: F.kan_forward_mgpu(x, g, c, w, order))
    assert jax.eval_shape(fn, x, grid, coef, wb).shape == (batch, out_f)
    assert "mosaic_gpu" in fn.trace(x, grid, coef, wb).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order", [
    (7, 96, 520, 5, 3),
    (129, 520, 96, 20, 3),
    (1, 17, 9, 5, 5),
    (256, 64, 128, 3, 1),
])
def test_the_dx_kernel_lowers_for_hopper_at_any_grid_order_and_odd_size(monkeypatch, batch, in_f, out_f,
                                                                        grid_size, order):
    monkeypatch.setattr(D, "_num_sms", lambda: 132)
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = (sd(batch, in_f), sd(in_f, grid_size + 2 * order + 1), sd(out_f, in_f, grid_size + order),
            sd(out_f, in_f), sd(batch, out_f))
    fn = jax.jit(lambda *a: D.kan_dx_mgpu(*a, order))
    assert jax.eval_shape(fn, *args).shape == (batch, in_f)
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("grid_size,order", [(3, 1), (5, 3), (5, 5), (20, 1), (20, 3), (3, 5), (50, 3)])
@pytest.mark.parametrize("bk", [16, 32])
def test_knot_table_blocks_are_whole_kib_so_every_later_shared_memory_buffer_stays_aligned(grid_size, order, bk):
    # shared-memory buffers sit one after another: a table of any other size moves the next TMA destination or
    # swizzled wgmma operand off its alignment (a misaligned-address fault on the device, at G 20 k 1 and G 5 k 5)
    n_rows = grid_size + 2 * order + 1
    first, second = F.knot_block_rows(n_rows, order, bk)
    assert (first * bk * 4) % 1024 == 0 and (second * bk * 4) % 1024 == 0
    assert (order + 1) * n_rows <= first <= 256 and order * n_rows <= second <= 256
    in_pad = 2 * bk
    grid = jnp.sort(jax.random.uniform(jax.random.key(grid_size), (in_pad, n_rows), minval=-2, maxval=2), axis=1)
    tab, split = F.knot_table_blocks(grid, order, n_rows, in_pad, bk)
    plain = np.asarray(F.affine_knot_tables(grid, jnp.float32, order, n_rows, in_pad))
    tab = np.asarray(tab)
    assert split == first and tab.shape == (first + second, in_pad)
    head = (order + 1) * n_rows
    np.testing.assert_array_equal(tab[:head], plain[:head])  # the rows the kernels index are the table's own
    np.testing.assert_array_equal(tab[split:split + order * n_rows], plain[head:])
    assert not tab[head:split].any() and not tab[split + order * n_rows:].any()


@pytest.mark.parametrize("rows,row_bytes,expected", [(1, 128, 8), (8, 128, 8), (9, 128, 16), (11, 64, 16),
                                                     (23, 64, 32), (5, 1024, 5), (3, 4096, 3), (7, 96, 32)])
def test_whole_kib_rows_rounds_a_table_up_to_whole_kib(rows, row_bytes, expected):
    from jaxgrad.ops.mgpu_common import whole_kib_rows

    assert whole_kib_rows(rows, row_bytes) == expected
    assert (expected * row_bytes) % 1024 == 0


@pytest.mark.parametrize("probe", ["products", "bases", "plain"])
def test_the_benchs_breakdown_probes_lower_for_hopper(monkeypatch, probe):
    import dataclasses

    monkeypatch.setattr(F, "_num_sms", lambda: 132)
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    tiles = dataclasses.replace(F.ForwardTiles.for_layer(8, 3), probe=probe)
    fn = jax.jit(lambda *a: F.kan_forward_mgpu(*a, 3, config=tiles))
    args = (sd(129, 96), sd(96, 12), sd(520, 96, 8), sd(520, 96))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_the_benchs_xla_dx_row_is_the_layers_input_gradient():
    from jaxgrad.bench.kan import _dx_variants

    trainable, grid = _layer(0, 17, 9)
    x, g = _x(0, 33, 17), _cotangent(1, 33, 9)
    p = {**trainable, "grid": grid}
    _, vjp = jax.vjp(lambda x: kan_linear(p, x, backend="xla", precision="fp16_scaled"), x)
    # the same products; XLA may fuse the two programs' float32 sums in another order
    np.testing.assert_allclose(np.asarray(_dx_variants()["xla dx fp16_scaled"](p, x, g)), np.asarray(vjp(g)[0]),
                               rtol=1e-5)


def test_forward_tiles_are_256_outputs_wide_where_the_layer_has_them_and_they_fit():
    # each CTA evaluates its basis tiles once per tile_n outputs: the widest tile that fits halves the sweeps
    assert F.ForwardTiles.for_layer(8, 3, out_f=512).tile_n == 256  # G 5, k 3
    assert F.ForwardTiles.for_layer(10, 5, out_f=520).tile_n == 128  # G 5, k 5: 11 slabs of 256 do not fit twice
    assert F.ForwardTiles.for_layer(8, 3, out_f=96).tile_n == 128  # fewer outputs than one wide tile
    assert F.ForwardTiles.for_layer(23, 3, out_f=512).tile_n == 64  # G 20: nor 24 slabs of 128
    assert F.ForwardTiles.for_layer(8, 3, tile_n=128).tile_n == 128  # the width asked for
    for nb, k, out_f in ((8, 3, 512), (10, 5, 520), (23, 3, 512), (4, 1, 96)):
        t = F.ForwardTiles.for_layer(nb, k, out_f=out_f)
        assert t.smem_bytes(nb, k) <= 227 * 1024 and t.stages == 2, (nb, k, t)


def test_tiles_fit_shared_memory_for_every_grid_the_benchmarks_use():
    for nb, k in ((8, 3), (23, 3), (10, 5), (4, 1), (53, 3), (105, 5)):
        t = F.ForwardTiles.for_layer(nb, k)
        assert t.smem_bytes(nb, k) <= 227 * 1024 and t.bk % 16 == 0


# ---------------------------------------------------------------------------------------------------------------
# (4) what the backend does not take is named
# ---------------------------------------------------------------------------------------------------------------
def test_a_lax_precision_is_refused_on_the_mosaic_backend():
    trainable, grid = _layer(0, 4, 3)
    with pytest.raises(ValueError, match="backend='mosaic' computes every product from float16 operands"):
        kan_linear({**trainable, "grid": grid}, _x(0, 5, 4), backend="mosaic", precision="highest")


@pytest.mark.skipif(F.on_hopper(), reason="the refusal is for devices without the kernel")
def test_float32_off_hopper_is_refused_with_the_portable_alternative():
    trainable, grid = _layer(0, 4, 3)
    with pytest.raises(ValueError, match="runs on a Hopper GPU .* backend='xla', precision='fp16_scaled'"):
        kan_linear({**trainable, "grid": grid}, _x(0, 5, 4), backend="mosaic")


def test_the_kernel_names_a_wrong_dtype():
    trainable, grid = _layer(0, 4, 3)
    g, coef, wb = _operands(trainable, grid)
    with pytest.raises(ValueError, match="'x' must be float32"):
        F.kan_forward_mgpu(_x(0, 5, 4).astype(jnp.bfloat16), g, coef, wb, 3)


# ---------------------------------------------------------------------------------------------------------------
# (5) on the GPU
# ---------------------------------------------------------------------------------------------------------------
GPU_SIZES = [
    (1, 96, 520, 5, 3),
    (7, 520, 96, 20, 1),
    (129, 96, 96, 3, 5),
    (129, 96, 96, 5, 5),
    (4096, 512, 512, 5, 3),
    (1000, 512, 512, 20, 3),
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order", GPU_SIZES)
def test_gpu_forward_kernel_is_within_tf32s_product_model(batch, in_f, out_f, grid_size, order):
    # the kernel's bases (the sweep, a * (1/w)) and the formulas' round to float16 the same way but for rare ties,
    # so the kernel is judged as its formulas are: against the exact float64 forward, under TF32's product model
    trainable, grid = _layer(batch, in_f, out_f, grid_size=grid_size, spline_order=order)
    x = _x(batch, batch, in_f)
    g, coef, wb = _operands(trainable, grid)
    got = jax.jit(lambda *a: F.kan_forward_mgpu(*a, order))(x, g, coef, wb)
    assert got.shape == (batch, out_f)
    ratio = _forward_over_model(trainable, grid, x, order, got)
    assert ratio.max() <= 1.0, ratio.max()


@pytest.mark.gpu
@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order", [(7, 520, 96, 20, 1), (129, 96, 96, 5, 5)])
def test_gpu_forward_kernel_with_the_plain_sweep_is_within_tf32s_product_model(batch, in_f, out_f, grid_size, order):
    import dataclasses

    trainable, grid = _layer(batch, in_f, out_f, grid_size=grid_size, spline_order=order)
    x = _x(batch, batch, in_f)
    g, coef, wb = _operands(trainable, grid)
    tiles = dataclasses.replace(F.ForwardTiles.for_layer(grid_size + order, order), probe="plain")
    got = jax.jit(lambda *a: F.kan_forward_mgpu(*a, order, config=tiles))(x, g, coef, wb)
    ratio = _forward_over_model(trainable, grid, x, order, got)
    assert ratio.max() <= 1.0, ratio.max()


@pytest.mark.gpu
@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order", GPU_SIZES)
def test_gpu_dx_kernel_is_within_tf32s_product_model(batch, in_f, out_f, grid_size, order):
    trainable, grid = _layer(batch, in_f, out_f, grid_size=grid_size, spline_order=order)
    x, g = _x(batch, batch, in_f), _cotangent(3, batch, out_f)
    _, coef, wb = _operands(trainable, grid)
    got = jax.jit(lambda *a: D.kan_dx_mgpu(*a, order))(x, grid, coef, wb, g)
    assert got.shape == (batch, in_f)
    ratio = _dx_over_model(trainable, grid, x, g, order, got)
    assert ratio.max() <= 1.0, ratio.max()


def test_the_dx_epilogues_pieces_divide_the_tile_and_are_at_most_16_inputs():
    assert D.DxTiles().piece == 16 and D.DxTiles(bk=16).piece == 16 and D.DxTiles(epi_cols=8).piece == 8
    for bad in (dict(epi_cols=32), dict(epi_cols=12), dict(epi_cols=0)):
        with pytest.raises(ValueError, match="epi_cols must divide"):
            D.DxTiles(**bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_layer_passes_the_tf32_model_and_its_backward_is_the_xla_scaled_one(dtype):
    from jaxgrad.verify import check_vjp

    trainable, grid = _layer(0, 512, 512)
    x = _x(1, 4096, 512)
    trainable, x, grid = jax.tree.map(lambda a: a.astype(dtype), (trainable, x, grid))
    fn = jax.jit(lambda t, x: kan_linear({**t, "grid": grid}, x, backend="mosaic"))
    if dtype == jnp.float32:
        ref = jax.jit(lambda t, x: kan_linear_reference({**t, "grid": grid}, x))
        report = check_vjp(fn, ref, trainable, x, arg_names=("params", "x"), precision="tf32", fd=False)
        print(report)
        assert report.passed, str(report)
    xla = jax.jit(lambda t, x: kan_linear({**t, "grid": grid}, x, backend="xla",
                                          precision="fp16_scaled" if dtype == jnp.float32 else None))
    loss = lambda f: lambda t, x: jnp.sum(f(t, x).astype(jnp.float32) ** 2)  # noqa: E731
    y, y_xla = fn(trainable, x), xla(trainable, x)
    assert y.dtype == dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_xla, np.float32), rtol=2e-2, atol=2e-2)
    grads = jax.jit(jax.grad(loss(fn), argnums=(0, 1)))(trainable, x)
    assert all(np.isfinite(np.asarray(a, np.float32)).all() for a in jax.tree.leaves(grads))
