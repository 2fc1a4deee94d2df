r"""The KAN layer's weight gradients, spline coefficients and SiLU weights, in one Mosaic GPU kernel on Hopper
(``wgmma``), computed transposed so that the bases are the left operand, built in registers from tiles of
:math:`x^\top`, against float16 operands scaled by powers of two.

With ``A^{(m)}_{bi} = B_m(x_{bi})`` (``m < NB``), ``A^{(NB)} = \operatorname{silu}(x)`` and the output cotangent
``g [B, out]``, the gradients of ``C_{oim}`` and ``W^b_{oi}`` are the columns of

.. math::

    \bar V^{(m)}_{io} = \sum_b A^{(m)}_{bi}\, g_{bo} = \bigl(A^{(m)\top} g\bigr)_{io},
    \qquad \bar C_{oim} = \bar V^{(m)}_{io} \ (m < NB), \qquad \bar W^b_{oi} = \bar V^{(NB)}_{io}.

Written this way the contraction runs over the batch and the left operand's rows are inputs: a tile of
:math:`x^\top` (``[64 inputs, bb rows]``, XLA transposes ``x`` once) gives, by the diagonal Cox-de Boor sweep of
:mod:`jaxgrad.kan.basis_tiles`, the left operands :math:`A^{(m)\top}` of the tile in registers, as the forward kernel
builds its own; ``g`` tiles (``[bb, tile_o]``) come by TMA as the right operand. No operand is transposed in shared
memory and the ``[B, in, NB]`` basis is never written.

**Scaling** (:mod:`jaxgrad.kan.fp16_scaled`'s model for ``a [M, K] @ b [K, N]``, applied to ``a = A^{(m)\top}``,
``b = g``: the operands of ``fp16_scaled.matmul(g.T, phi)`` of the XLA path, transposed): row ``(m, i)`` of ``a`` by
:math:`2^{u_{mi}}` from :math:`\max_b |A^{(m)}_{bi}|` (the maxima over the batch come first: on a GPU from
:func:`jaxgrad.kan.basis_maxima.bspline_basis_maxima`, one sweep per x value; elsewhere XLA's :func:`left_maxima`),
column ``o`` of ``g`` by :math:`2^{t_o}` from its largest magnitude; the kernel accumulates the float16 products in
fp32 and XLA unscales by :math:`2^{-u_{mi} - t_o}` exactly. The sweep is the plain one (:func:`basis_tiles.sweep`),
not the affine form: a coefficient's column may hold only tails of its basis, where the affine form's absolute
rounding would be the whole value.

**The kernel.** A CTA owns ``2 x 64`` inputs (one 64-input block per compute warpgroup) by ``tile_o`` outputs and a
group of at most ``max_group`` accumulators ``[64, tile_o]`` (bases ``m_lo .. m_hi - 1``); a memory warpgroup
streams, per block of ``bb`` batch rows, the :math:`x^\top` tile (fp32) and the ``g`` tile (fp16) by TMA. Each
compute warpgroup brings its inputs' knot table and row factors into shared memory once per output tile, and per
step runs the sweep up to ``m_hi`` and issues one ``wgmma`` per basis of the group. Groups are separate kernel calls
(each walks the sweep from the first interval); XLA joins them. With ``splits > 1`` (:func:`batch_splits`) a CTA
contracts one chunk of the batch and XLA adds the chunks' partial sums: a 512 -> 512 layer has only 32 tiles of
``128 inputs x 64 outputs``, which would leave three quarters of an H100's SMs idle. The error model is the same
(the ``K u32`` term bounds any summation order).

Scope: float32; shapes padded to the tiles (:func:`kernel_operands`: padded batch rows repeat the last row against
zero rows of ``g``, so that their scaled bases stay finite in float16; padded inputs have zero knot-table columns
and factors). It needs a Hopper GPU: the GPU tests compare it with :func:`kan_dcoef_scaled_reference`; on a CPU its
lowering and its operands are checked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxgrad import pallas_backend as pb
from jaxgrad.kan import fp16_scaled
from jaxgrad.kan.basis_maxima import bspline_basis_maxima
from jaxgrad.kan.basis_tiles import KnotTable, knot_tables, pad_to, sweep
from jaxgrad.kan.spline import bspline_basis_elementwise
from jaxgrad.ops import mgpu_common
from jaxgrad.ops.mgpu_common import num_sms as _num_sms

__all__ = ["DcoefTiles", "batch_splits", "check_operands", "kan_dcoef_mgpu", "kan_dcoef_scaled_reference",
           "kernel_operands", "left_maxima", "left_operand", "padded_operands",
           "scaled_operands", "weight_cotangents"]

_ROWS = 64  # inputs per compute warpgroup: the wgmma M


@dataclasses.dataclass(frozen=True)
class DcoefTiles:
    """Tiles of :func:`kan_dcoef_mgpu`: ``bb`` batch rows per pipeline stage (the contraction; a multiple of 16),
    ``tile_o`` outputs per CTA, ``stages`` in flight, at most ``max_group`` accumulators ``[64, tile_o]`` per call,
    the epilogue's pieces, and ``splits``: the batch cut into that many chunks, each a CTA's own contraction whose
    partial sums XLA adds (``None``: enough chunks that the tiles fill the GPU's SMs, :func:`batch_splits`)."""

    bb: int = 32
    tile_o: int = 64
    stages: int = 3
    max_group: int = 3
    epi_tile_m: int = 64
    epi_tile_n: int = 16
    grid_tile_width: int = 8
    splits: int | None = None


def batch_splits(config: DcoefTiles, batch: int, in_f: int, out_f: int, num_sms: int) -> int:
    """How many chunks the batch is cut into: ``config.splits``, or (``None``) the fewest that give every SM a tile,
    ``ceil(num_sms / (input blocks x output tiles))``, at most one chunk per ``stages`` batch blocks. Without a split
    a layer of 512 -> 512 has 4 x 8 = 32 tiles: a quarter of an H100's 132 SMs would run the whole contraction."""
    if config.splits is not None:
        return int(config.splits)
    tiles = -(-in_f // (2 * _ROWS)) * -(-out_f // config.tile_o)
    steps = -(-batch // config.bb)
    return max(1, min(-(-num_sms // tiles), steps // config.stages))


def _silu(x):
    return x * jax.nn.sigmoid(x)


def left_operand(x, grid, spline_order: int):
    """``A [NB+1, in, B]`` (float32, unscaled): the bases and ``silu(x)``, transposed."""
    phi = bspline_basis_elementwise(x, grid, spline_order)  # [B, in, NB]
    return jnp.concatenate([jnp.transpose(phi, (2, 1, 0)), _silu(x).T[None]], axis=0)


def left_maxima(x, grid, spline_order: int, chunk: int = 2048):
    """``max_b |A^{(m)}_{bi}|`` ``[NB+1, in]``, ``chunk`` rows of ``x`` at a time, so that no ``[B, in, NB]`` basis
    is held (the batch is padded with copies of its first row, which leave every maximum as it is)."""
    b = x.shape[0]
    if b <= chunk:
        return jnp.max(jnp.abs(left_operand(x, grid, spline_order)), axis=2)
    n = -(-b // chunk)
    xs = jnp.concatenate([x, jnp.broadcast_to(x[:1], (n * chunk - b, x.shape[1]))]).reshape(n, chunk, x.shape[1])
    return jnp.max(lax.map(lambda c: jnp.max(jnp.abs(left_operand(c, grid, spline_order)), axis=2), xs), axis=0)


def scaled_operands(x, grid, g, spline_order: int, maxima=None):
    """``u [NB+1, in]`` (rows ``(m, i)`` of the left operand, from their ``maxima``, default :func:`left_maxima`)
    and ``t [out]`` (columns of ``g``, from their largest magnitudes)."""
    u = fp16_scaled.scale_exponents(left_maxima(x, grid, spline_order) if maxima is None else maxima)
    t = fp16_scaled.scale_exponents(jnp.max(jnp.abs(g), axis=0, initial=0.0))
    return u, t


def _round16(a):
    return a if a.dtype == jnp.float64 else a.astype(jnp.float16)


def kan_dcoef_scaled_reference(x, grid, g, spline_order: int):
    """What :func:`kan_dcoef_mgpu` computes, in plain JAX: ``V̄ [NB+1, in, out]`` from the same float16 operands,
    float32 sums in another order, the same exact unscaling (float64 arrays: no float16 rounding)."""
    u, t = scaled_operands(x, grid, g, spline_order)
    a = left_operand(x, grid, spline_order)
    a16 = _round16(a * fp16_scaled.pow2(u, a.dtype)[:, :, None])
    g16 = _round16(g * fp16_scaled.pow2(t, g.dtype)[None, :])
    acc = jnp.einsum("mib,bo->mio", a16, g16, preferred_element_type=x.dtype, precision=lax.Precision.HIGHEST)
    return fp16_scaled.unscale(acc, -(u[:, :, None] + t[None, None, :]))


def _kernel(xt_gmem, g_gmem, tab_gmem, f_gmem, out_gmem, *, cfg: DcoefTiles, m_lo: int, m_hi: int, nb: int, k: int,
            n_rows: int, splits: int):
    """``acc [splits * cnt * in_pad, out_pad]`` (fp32): row block ``s * cnt + j`` holds basis ``m_lo + j``'s scaled
    products over batch chunk ``s``."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    n_in, m_rows = xt_gmem.shape
    n_out = g_gmem.shape[1]
    bb, tile_o = cfg.bb, cfg.tile_o
    epi_m, epi_n = cfg.epi_tile_m, cfg.epi_tile_n
    cnt = m_hi - m_lo
    cta_i = 2 * _ROWS
    chunk = m_rows // splits  # batch rows per chunk (a multiple of bb)
    i_iters, o_iters, b_iters = n_in // cta_i, n_out // tile_o, chunk // bb
    tab_rows, f_rows = tab_gmem.shape[0], f_gmem.shape[0]

    spec = mgpu_common.smem_spec
    pipeline = mgpu_common.warp_specialized([
        spec((cta_i, bb), lambda kk: (0, kk), mgpu_common.smem_transforms(bb, jnp.float32)),
        spec((bb, tile_o), lambda kk: (kk, 0), mgpu_common.rhs_transforms(bb)),
    ], b_iters, cfg.stages)

    ignore = lambda *_, **__: None  # noqa: E731 - the bodies do not change the pipeline's allocations
    slots = min(2, (_ROWS // epi_m) * (tile_o // epi_n))

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline(ignore, ignore).get_allocations(xt_gmem, g_gmem),
        # every buffer whole KiB (the tables padded by the wrapper), so each starts aligned
        out_smem=plgpu.SMEM((2, slots, epi_m, epi_n), jnp.float32,
                            transforms=mgpu_common.smem_transforms(epi_n, jnp.float32)),
        tab_smem=plgpu.SMEM((2, tab_rows, _ROWS), jnp.float32),
        f_smem=plgpu.SMEM((2, f_rows, _ROWS), jnp.float32),
        bars=plgpu.Barrier(num_barriers=4),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem, tab_smem, f_smem, bars):
        wg = lax.axis_index("wg")

        @mgpu_common.persistent_tiles((i_iters * splits, o_iters), cfg.grid_tile_width)
        def _tile(is_idx, o_idx):
            i_idx, s_idx = is_idx // splits, is_idx % splits
            b_slice = pl.ds(s_idx * chunk, chunk)
            cta_i_slice = pl.ds(i_idx * cta_i, cta_i)
            wg_cols = pl.ds(i_idx * cta_i + wg * _ROWS, _ROWS)  # the warpgroup's inputs: table columns
            wg_i_slice = pl.ds(wg * _ROWS, _ROWS)
            o_slice = pl.ds(o_idx * tile_o, tile_o)

            def bcast(row):  # a per-input [64] vector against a [64, bb] tile (inputs are its rows)
                return lax.broadcast_in_dim(row, (_ROWS, bb), [0])

            def compute_context(eval_pipeline):
                # the previous tile's steps have read the tables: its last step's products were waited for
                plgpu.copy_gmem_to_smem(tab_gmem.at[:, wg_cols], tab_smem.at[wg], bars.at[wg])
                plgpu.copy_gmem_to_smem(f_gmem.at[:, wg_cols], f_smem.at[wg], bars.at[2 + wg])
                plgpu.barrier_wait(bars.at[wg])
                plgpu.barrier_wait(bars.at[2 + wg])

                @functools.partial(pl.run_scoped,
                                   accs=[plgpu.ACC((_ROWS, tile_o), jnp.float32) for _ in range(cnt)])
                def _acc_scope(accs):
                    eval_pipeline(accs)
                    for j in range(cnt):
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        rows = pl.ds((s_idx * cnt + j) * n_in + i_idx * cta_i, cta_i)
                        mgpu_common.store_tile(accs[j][...], out_smem, wg,
                                               out_gmem.at[rows, o_slice].at[wg_i_slice], epi_m, epi_n)

            def mma_body(_, xt_smem, g_smem, accs):
                xt = xt_smem[wg_i_slice]  # [64 inputs, bb rows] fp32

                def knot_row(p, r):
                    return bcast(tab_smem[wg, p * n_rows + r])

                tab = KnotTable(knot_row, expand=lambda row: row)
                if m_lo < nb:
                    for m, basis in sweep(xt, tab, nb + k, k):
                        if m >= m_lo:
                            a16 = (basis * bcast(f_smem[wg, m - m_lo])).astype(jnp.float16)
                            plgpu.wgmma(accs[m - m_lo], a16, g_smem)
                        if m + 1 >= min(m_hi, nb):
                            break
                if m_hi > nb:
                    a16 = (_silu(xt) * bcast(f_smem[wg, nb - m_lo])).astype(jnp.float16)
                    plgpu.wgmma(accs[nb - m_lo], a16, g_smem)
                plgpu.wgmma_wait(0)
                return accs

            pipeline(mma_body, compute_context)(
                xt_gmem.at[cta_i_slice, b_slice], g_gmem.at[b_slice, o_slice], allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("config", "m_lo", "m_hi", "nb", "k", "n_rows", "num_sms", "splits"))
def _call(xt, g16, tab, f, *, config, m_lo, m_hi, nb, k, n_rows, num_sms, splits):
    fn = mgpu_common.persistent_kernel(
        functools.partial(_kernel, cfg=config, m_lo=m_lo, m_hi=m_hi, nb=nb, k=k, n_rows=n_rows, splits=splits),
        jax.ShapeDtypeStruct((splits * (m_hi - m_lo) * xt.shape[0], g16.shape[1]), jnp.float32),
        num_sms)
    return fn(xt, g16, tab, f)


def kernel_operands(x, grid, g, spline_order: int, config: DcoefTiles, splits: int = 1) -> dict:
    """The kernel's padded operands (the batch padded to whole ``bb`` blocks in each of ``splits`` chunks):
    ``xt [in_pad, b_pad]`` (fp32), ``g16 [b_pad, out_pad]`` (the scaled cotangent),
    ``f [NB+1, in_pad]`` (the row factors :math:`2^{u}`), ``tab`` (the knot tables, whole KiB), and the exponents
    ``u [NB+1, in]``, ``t [out]``.

    Padded batch rows repeat the batch's last row, with zero rows of ``g``: their products vanish, and their bases
    stay within the batch's maxima. (A zero row would not: its bases may exceed every real row's, and scaled by
    :math:`2^{u}` overflow float16, where ``inf * 0`` is NaN.) Padded inputs have zero knot tables and factors."""
    c = config
    b_pad = -(-x.shape[0] // (c.bb * splits)) * c.bb * splits
    in_pad = -(-x.shape[1] // (2 * _ROWS)) * 2 * _ROWS
    out_pad = -(-g.shape[1] // c.tile_o) * c.tile_o
    ops = padded_operands(x, grid, g, spline_order, (b_pad, in_pad, out_pad), 4 * _ROWS)
    return dict(xt=ops.pop("x").T, **ops)


def padded_operands(x, grid, g, spline_order: int, padded: tuple[int, int, int], row_bytes: int) -> dict:
    """What both weight-gradient kernels take, padded to ``padded = (b_pad, in_pad, out_pad)``: ``x [b_pad,
    in_pad]`` (fp32), ``g16 [b_pad, out_pad]`` (the scaled cotangent), ``f [NB+1, in_pad]`` (the row factors
    :math:`2^{u}`), ``tab`` (the knot tables, rows padded to whole KiB at ``row_bytes`` a row), and the exponents
    ``u [NB+1, in]``, ``t [out]`` (:func:`kernel_operands` says why padded batch rows repeat the last row)."""
    k = int(spline_order)
    nb = grid.shape[-1] - k - 1
    b_pad, in_pad, out_pad = padded
    # on a GPU the row maxima come from one sweep per x value (basis_maxima), not XLA's chunked reductions
    maxima = None if pb.default_interpret() else bspline_basis_maxima(x, grid, k)
    u, t = scaled_operands(x, grid, g, k, maxima)
    tab = knot_tables(grid, jnp.float32, k, nb + k + 1, in_pad)
    return dict(
        x=pad_to(pad_to(x, (b_pad, x.shape[1]), mode="edge"), (b_pad, in_pad)),
        g16=pad_to((g * fp16_scaled.pow2(t, g.dtype)[None, :]).astype(jnp.float16), (b_pad, out_pad)),
        f=pad_to(fp16_scaled.pow2(u, jnp.float32), (nb + 1, in_pad)),
        tab=pad_to(tab, (mgpu_common.whole_kib_rows(tab.shape[0], row_bytes), in_pad)),
        u=u, t=t)


def check_operands(fn_name: str, x, grid, g) -> None:
    """Raise, naming the argument, unless ``x [B, in]``, ``grid [in, knots]`` and ``g [B, out]`` are float32."""
    for name, a in (("x", x), ("grid", grid), ("g", g)):
        if jnp.dtype(a.dtype) != jnp.dtype(jnp.float32):
            raise ValueError(f"{fn_name}: '{name}' must be float32, got {a.dtype}")
    if x.ndim != 2 or g.ndim != 2 or g.shape[0] != x.shape[0] or grid.shape[0] != x.shape[1]:
        raise ValueError(f"{fn_name}: needs x [B, in], grid [in, knots], g [B, out]; got {x.shape}, "
                         f"{grid.shape}, {g.shape}")


def kan_dcoef_mgpu(x, grid, g, spline_order: int, config: DcoefTiles | None = None, num_sms: int | None = None):
    r"""``V̄ [NB+1, in, out]`` (float32) of the module doc: ``V̄[m] = A^{(m)\top} g`` from the scaled float16 operands,
    on the Hopper kernel (``V̄[:NB]`` transposed is the coefficients' gradient, ``V̄[NB]`` transposed the SiLU
    weights').

    Args:
      x: ``[B, in]`` float32.
      grid: ``[in, G + 2k + 1]`` float32 knots (non-decreasing rows).
      g: ``[B, out]`` float32, the output cotangent.
      spline_order: ``k``.
      config: the kernel's tiles (default :class:`DcoefTiles`).
    """
    from jaxgrad.kan.forward_mgpu import knot_table_limit

    check_operands("kan_dcoef_mgpu", x, grid, g)
    k = int(spline_order)
    nb = grid.shape[-1] - k - 1
    why = knot_table_limit(grid, jax.ShapeDtypeStruct((1, 1, nb), jnp.float32))
    if why is not None:
        raise ValueError(f"kan_dcoef_mgpu: {why}")
    c = config or DcoefTiles()
    sms = int(num_sms or _num_sms())
    splits = batch_splits(c, x.shape[0], x.shape[1], g.shape[1], sms)
    ops = kernel_operands(x, grid, g, k, c, splits)
    in_f, out_f = x.shape[1], g.shape[1]
    in_pad, out_pad = ops["xt"].shape[0], ops["g16"].shape[1]
    row_bytes = 4 * _ROWS  # a table row as a warpgroup copies it: its 64 inputs
    parts = []
    for m_lo in range(0, nb + 1, c.max_group):
        m_hi = min(nb + 1, m_lo + c.max_group)
        f_group = pad_to(ops["f"][m_lo:m_hi], (mgpu_common.whole_kib_rows(m_hi - m_lo, row_bytes), in_pad))
        acc = _call(ops["xt"], ops["g16"], ops["tab"], f_group, config=c, m_lo=m_lo, m_hi=m_hi, nb=nb, k=k,
                    n_rows=nb + k + 1, num_sms=sms, splits=splits)
        parts.append(jnp.sum(acc.reshape(splits, m_hi - m_lo, in_pad, out_pad), axis=0))
    acc = jnp.concatenate(parts)[:, :in_f, :out_f]
    return fp16_scaled.unscale(acc, -(ops["u"][:, :, None] + ops["t"][None, None, :]))


def weight_cotangents(v):
    """``(dC [out, in, NB], dW^b [out, in])`` from ``V̄ [NB+1, in, out]``."""
    return jnp.transpose(v[:-1], (2, 1, 0)), v[-1].T
