"""The weight-gradient kernel with the bases as wgmma's right operand (:mod:`jaxgrad.kan.dcoef_wide_mgpu`): its
operands and output arrangement give :mod:`jaxgrad.kan.dcoef_mgpu`'s ``V̄`` (checked on the CPU with the kernel's
products written in jnp), at any grid (bases beyond one ``wgmma``'s columns in groups), it lowers for Hopper at odd
sizes, its tiles follow the registers and the SMs, and on the GPU it stays within TF32's product model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kan_dcoef_mosaic import _over_model
from test_kan_mosaic import _cotangent, _layer, _x

from jaxgrad.kan import dcoef_mgpu as C
from jaxgrad.kan import dcoef_wide_mgpu as W
from jaxgrad.kan.basis_tiles import KnotTable, sweep


def _products_in_jnp(gt, x, tab, f, *, config, nb, k, n_rows, num_sms, m_lo, m_hi):
    """What the kernel computes, in jnp: the same sweep (from interval ``m_lo``) over the same tables and factors,
    the float16 operands, float32 sums, in the kernel's output arrangement (``W._kernel``'s docstring)."""
    del num_sms
    tables = KnotTable(lambda p, r: tab[p * n_rows + r])
    bases = [b for _, b in sweep(x, tables, min(m_hi, nb) + k, k, start=m_lo)]  # each [b_pad, in_pad]
    bases += [C._silu(x)] if m_hi > nb else []
    cnt = m_hi - m_lo
    assert len(bases) == cnt
    a16 = (jnp.stack(bases) * f[m_lo:m_hi][:, None, :]).astype(jnp.float16)  # [cnt, b_pad, in_pad]
    acc = jnp.einsum("ob,mbi->omi", gt.astype(jnp.float32), a16.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)  # [out_pad, cnt, in_pad]
    out_pad, in_pad = gt.shape[0], x.shape[1]
    acc = acc.reshape(out_pad, cnt, in_pad // config.bi, config.bi).transpose(0, 2, 1, 3)
    return jnp.tile(acc.reshape(out_pad, -1) / config.splits, (config.splits, 1))


@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order,splits", [
    (100, 17, 9, 5, 3, 1),
    (129, 40, 300, 3, 1, 2),
    (7, 33, 520, 3, 5, 1),
    (65, 20, 70, 20, 3, 2),  # 24 rows of V̄ in two groups of 12
])
def test_the_operands_and_the_output_arrangement_give_the_scaled_reference(monkeypatch, batch, in_f, out_f,
                                                                           grid_size, order, splits):
    monkeypatch.setattr(W, "_call", _products_in_jnp)
    _, grid = _layer(batch, in_f, out_f, grid_size=grid_size, spline_order=order)
    x, g = _x(batch, batch, in_f), _cotangent(3, batch, out_f)
    got = W.kan_dcoef_wide_mgpu(x, grid, g, order, config=W.WideTiles(splits=splits), num_sms=132)
    want = C.kan_dcoef_scaled_reference(x, grid, g, order)
    assert got.shape == want.shape == (grid_size + order + 1, in_f, out_f)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-6 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order", [
    (1000, 96, 33, 5, 3),
    (7, 520, 96, 3, 1),
    (129, 17, 520, 3, 5),
    (65, 40, 70, 20, 3),
])
def test_the_kernel_lowers_for_hopper_at_odd_sizes(monkeypatch, batch, in_f, out_f, grid_size, order):
    monkeypatch.setattr(W, "_num_sms", lambda: 132)
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = (sd(batch, in_f), sd(in_f, grid_size + 2 * order + 1), sd(batch, out_f))
    fn = jax.jit(functools.partial(W.kan_dcoef_wide_mgpu, spline_order=order))
    assert jax.eval_shape(fn, *args).shape == (grid_size + order + 1, in_f, out_f)
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_two_row_blocks_where_their_accumulators_fit_and_a_batch_split_that_fills_the_sms():
    t = W.WideTiles()
    g5k3 = t.resolved(8, 16384, 512, 512, 132)  # 2 x 72 accumulator registers a thread
    # 32 x 2 tiles: 2 chunks give 128 work items, one per SM (3 would give 192, two rounds of a third each)
    assert (g5k3.rb, g5k3.tile_o, g5k3.splits) == (2, 256, 2)
    g5k5 = t.resolved(10, 16384, 512, 512, 132)  # 2 x 88 would spill: one row block, 32 x 4 tiles already 128
    assert (g5k5.rb, g5k5.tile_o, g5k5.splits) == (1, 128, 1)
    assert t.resolved(8, 16384, 96, 96, 132).splits == 20  # 6 x 1 tiles: 120 work items, within 10 % of 132
    assert t.resolved(8, 129, 512, 512, 132).splits == 1  # 3 blocks of 64 rows: one chunk of >= 3
    assert W.WideTiles(rb=1, splits=1).resolved(8, 16384, 512, 512, 132) == W.WideTiles(rb=1, splits=1)
    g20 = t.resolved(23, 16384, 512, 512, 132)  # two groups of 12 bases: 2 x 96 registers would not fit
    assert (g20.rb, g20.splits) == (1, 1)


def test_bases_beyond_one_wgmmas_columns_go_in_equal_groups_each_a_sweep_from_its_first_interval():
    t = W.WideTiles()
    assert t.groups(8) == [(0, 9)]  # G=5, k=3: 9 x 16 = 144 columns
    assert t.groups(15) == [(0, 16)]  # 256: one wgmma
    assert t.groups(16) == [(0, 9), (9, 17)]
    assert t.groups(23) == [(0, 12), (12, 24)]  # G=20, k=3
    assert t.groups(40) == [(0, 14), (14, 28), (28, 41)]


def test_the_layers_weight_gradients_take_the_wide_kernel_at_any_grid(monkeypatch):
    from jaxgrad.kan import forward_mgpu

    called = []
    monkeypatch.setattr(forward_mgpu, "require_hopper", lambda: None)
    monkeypatch.setattr(W, "kan_dcoef_wide_mgpu", lambda x, grid, g, k: called.append(grid.shape[1]) or
                        C.kan_dcoef_scaled_reference(x, grid, g, k))
    for grid_size in (5, 20):
        _, grid = _layer(0, 6, 4, grid_size=grid_size, spline_order=3)
        dc, dwb = W.kan_weight_cotangents(_x(0, 9, 6), grid, _cotangent(1, 9, 4), 3)
        assert dc.shape == (4, 6, grid_size + 3) and dwb.shape == (4, 6)
    assert called == [12, 27]


def test_the_kernel_without_a_shared_sweep_lowers_for_hopper(monkeypatch):
    monkeypatch.setattr(W, "_num_sms", lambda: 132)
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    fn = jax.jit(functools.partial(W.kan_dcoef_wide_mgpu, spline_order=3,
                                   config=W.WideTiles(shared_sweep=False)))
    assert "mosaic_gpu" in fn.trace(sd(65, 40), sd(40, 47), sd(65, 70)).lower(lowering_platforms=("cuda",)).as_text()


def test_the_warpgroups_share_a_groups_sweep_in_two_halves_of_equal_work():
    # a half's work: the intervals its walk visits (its bases + k), one more for SiLU (row NB)
    assert W.sweep_halves(0, 9, 8, 3) == ((0, 4), (4, 9))  # G=5, k=3: 7 and 8 intervals, not 11 each
    assert W.sweep_halves(0, 12, 23, 3) == ((0, 6), (6, 12))  # G=20, k=3, first group
    assert W.sweep_halves(12, 24, 23, 3) == ((12, 18), (18, 24))  # second group, with SiLU
    assert W.sweep_halves(0, 2, 1, 0) == ((0, 1), (1, 2))  # one basis of order 0 and SiLU
    for m_lo, m_hi, nb, k in [(0, 9, 8, 3), (0, 11, 10, 5), (9, 17, 16, 1), (0, 1, 0, 0)]:
        (a, b), (c, d) = W.sweep_halves(m_lo, m_hi, nb, k)
        assert a == m_lo and b == c and d == m_hi and a <= b <= d


def test_a_shared_sweep_pads_the_batch_to_an_even_number_of_steps_a_chunk():
    # the two bases buffers alternate by step; a tile of an odd number of steps would start the next tile on the
    # buffer its last step used while the other warpgroup may still be reading it
    t = W.WideTiles(rb=2, splits=3)
    assert t.batch_multiple() == 64 * 3 * 2
    assert W.WideTiles(rb=2, splits=3, shared_sweep=False).batch_multiple() == 64 * 3
    _, grid = _layer(0, 17, 9, grid_size=5, spline_order=3)
    ops = W.kernel_operands(_x(0, 100, 17), grid, _cotangent(1, 100, 9), 3, t)
    assert ops["x"].shape[0] == 384 and (ops["x"].shape[0] // 3 // 64) % 2 == 0


def test_a_wrong_dtype_or_order_is_named():
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    with pytest.raises(ValueError, match="'g' must be float32"):
        W.kan_dcoef_wide_mgpu(sd(8, 4), sd(4, 12), jax.ShapeDtypeStruct((8, 3), jnp.bfloat16), 3)
    with pytest.raises(ValueError, match="spline_order must be in"):
        W.kan_dcoef_wide_mgpu(sd(8, 4), sd(4, 12), sd(8, 3), 11)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,in_f,out_f,grid_size,order,shared_sweep", [
    (1, 96, 520, 5, 3, True),
    (7, 520, 96, 3, 1, True),
    (129, 96, 96, 5, 5, True),
    (4096, 512, 512, 5, 3, True),
    (1000, 96, 520, 20, 3, True),  # two groups of bases
    (33, 520, 96, 20, 1, True),
    (4096, 512, 512, 5, 3, False),  # each warpgroup sweeping every basis (the bench's comparison)
])
def test_gpu_kernel_is_within_tf32s_product_model(batch, in_f, out_f, grid_size, order, shared_sweep):
    _, grid = _layer(batch, in_f, out_f, grid_size=grid_size, spline_order=order)
    x, g = _x(batch, batch, in_f), _cotangent(3, batch, out_f)
    config = W.WideTiles(shared_sweep=shared_sweep)
    got = jax.jit(functools.partial(W.kan_dcoef_wide_mgpu, spline_order=order, config=config))(x, grid, g)
    assert got.shape == (grid_size + order + 1, in_f, out_f)
    ratio = _over_model(x, grid, g, order, got)
    assert ratio.max() <= 1.0, ratio.max()
