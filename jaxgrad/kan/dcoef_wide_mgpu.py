r"""The KAN layer's weight gradients with the bases as ``wgmma``'s right operand, so that one sweep of a tile of
``x`` serves many outputs (Mosaic GPU, Hopper): the :math:`\bar V` of :mod:`jaxgrad.kan.dcoef_mgpu`, computed as

.. math::

    \bar V^\top [o, (m, i)] = \sum_b g^\top_{ob}\, A^{(m)}_{bi}.

:mod:`jaxgrad.kan.dcoef_mgpu` holds its bases in registers as the left operand, which bounds a CTA to
``[64 inputs, 64 outputs]`` accumulators for three bases at a time, so at 512 outputs each x value's sweep runs 24
times (2.65 ms for B 16384, 512 -> 512 on an H100). Here a CTA owns ``bi`` inputs (default 16) and ``tile_o = 2 x
rb x 64`` outputs (256 at ``rb = 2``), and the sweep of an x value runs once per 256 outputs, its bases shared by the
two compute warpgroups: twice at 512 outputs.

**The kernel.** Per block of ``bb = 64`` batch rows a memory warpgroup brings, by TMA, the ``g^T`` tile ``[tile_o,
bb]`` (float16, scaled per output by XLA, which transposes ``g`` once) and the ``x`` tile ``[bb, bi]`` (float32).
Each compute warpgroup runs the plain Cox-de Boor sweep (:func:`jaxgrad.kan.basis_tiles.sweep`: a column of tails
needs relative accuracy) on the ``[64 rows, bi]`` register tile (knot rows broadcast along its rows) for half of
the step's bases (:func:`sweep_halves`: the first warpgroup the lower bases, the second the rest and SiLU, split
where the intervals each walk visits balance), scales basis ``m`` by :math:`2^{u_{mi}}` and writes it as float16
into columns ``m bi .. (m+1) bi`` of the step's ``[bb, (NB+1) bi]`` shared-memory tile (for one group of bases:
below). The two tiles alternate by step; each warpgroup arrives at the step's barrier once its half is written
and waits there for the other's, then issues, for each of its ``rb`` row blocks of 64 outputs and each 16-row K
group, a ``wgmma`` into that row block's accumulator ``[64, (NB+1) bi]`` (G=5, k=3: ``N = 144``, 72 registers a
thread each), and waits for them before its next step. A tile is written again two steps later, after both
warpgroups passed the other tile's barrier, so after both waited for their products on it; a chunk of the batch
has an even number of steps (:meth:`WideTiles.batch_multiple`) so that this holds across output tiles too. Sharing
the sweep took the weight gradients from 0.91 to 0.69 ms (G=5, k=3 on an H100, one run; ``shared_sweep=False``
keeps a sweep of every basis per warpgroup, into its own tile, for comparison). Both operands take the 32-byte
swizzle of a 16-element K group: a right operand stored ``[K, N]`` takes the swizzle of its K width, and ``N =
(NB+1) bi`` is a multiple of 16, not of 64.

Scope, scaling, padding and error model: those of :mod:`jaxgrad.kan.dcoef_mgpu` (its exponents ``u``, ``t``;
padded batch rows repeat the last row against zero rows of ``g``; padded inputs have zero knot tables, so zero
bases). Its GPU test holds it to TF32's product model against the exact float64 products at odd sizes; on the CPU its
lowering and its operands' arrangement are checked. ``kan_linear(backend="mosaic")`` takes its weight gradients from
it.

**Groups of bases** (:meth:`WideTiles.groups`). A ``wgmma`` has at most 256 columns, 16 bases of 16 inputs: more
bases (G=20, k=3: 24 with SiLU) are made by several kernel calls, each for the rows ``m_lo .. m_hi - 1`` of ``V̄``.
Each call's sweep starts at interval ``m_lo`` (:func:`jaxgrad.kan.basis_tiles.sweep`'s ``start``: a basis depends
on ``k + 1`` intervals only), so the groups share the sweep's work instead of repeating it.

**Tiles** (:meth:`WideTiles.resolved`). Two row blocks a warpgroup hold ``2 x cnt bi / 2`` accumulator registers
a thread for a group of ``cnt`` rows (144 at G=5, k=3); where that exceeds :data:`ACC_REGISTERS` one row block is
used (128 outputs a CTA, twice the sweeps). The batch is split so that the SMs share the work evenly: a 512 -> 512
layer has 32 x 2 tiles of 256 outputs, 128 work items in two chunks (1.04 ms on an H100 against 1.52 unsplit, with
the row maxima).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxgrad.kan import fp16_scaled
from jaxgrad.kan.basis_tiles import KnotTable, pad_to, sweep
from jaxgrad.kan.dcoef_mgpu import (_silu, check_operands, kan_dcoef_scaled_reference, padded_operands,
                                    weight_cotangents)
from jaxgrad.ops import mgpu_common
from jaxgrad.ops.mgpu_common import num_sms as _num_sms

__all__ = ["ACC_REGISTERS", "WideTiles", "kan_dcoef_wide_mgpu", "kan_weight_cotangents", "kernel_operands"]

_ROWS = 64  # outputs per wgmma row block, and batch rows per step (the register tile's rows)


#: accumulator registers a thread may hold: ``rb`` row blocks of ``[64, cnt bi]`` float32 (a group of ``cnt`` bases)
#: take ``rb cnt bi / 2`` of them, beside the sweep's working tiles (G=5, k=3: 2 x 72 = 144 ran at 1.04 ms on an
#: H100, B 16384, 512 -> 512; G=5, k=5: 2 x 88 = 176 spilled, 9.9 ms against 2.9 with one row block;
#: ``kan-...-20261127-192008.json``)
ACC_REGISTERS = 144


@dataclasses.dataclass(frozen=True)
class WideTiles:
    """Tiles of :func:`kan_dcoef_wide_mgpu`: ``bi`` inputs per CTA (a multiple of 16), ``rb`` row blocks of 64
    outputs per compute warpgroup (``None``: 2 where their accumulators fit :data:`ACC_REGISTERS`, else 1), ``bb``
    batch rows per pipeline stage (64: the register tile), ``stages`` in flight, ``splits`` batch chunks whose partial
    sums XLA adds (``None``: the fewest that balance the tiles over the SMs, :meth:`resolved`), the epilogue's piece
    width ``epi_tile_n``."""

    bi: int = 16
    rb: int | None = None
    bb: int = 64
    stages: int = 3
    splits: int | None = None
    epi_tile_n: int = 16
    grid_tile_width: int = 8
    shared_sweep: bool = True

    @property
    def tile_o(self) -> int:
        return 2 * self.rb * _ROWS

    def resolved(self, nb: int, batch: int, in_f: int, out_f: int, num_sms: int) -> "WideTiles":
        """These tiles with ``rb`` and ``splits`` chosen for a layer of ``NB = nb`` bases (class doc)."""
        cnt = max(hi - lo for lo, hi in self.groups(nb))
        rb = self.rb or (2 if 2 * cnt * self.bi // 2 <= ACC_REGISTERS else 1)
        tiles = -(-in_f // self.bi) * -(-out_f // (2 * rb * _ROWS))
        most = max(1, -(-batch // self.bb) // self.stages)  # at least `stages` batch blocks a chunk
        # the persistent CTAs (one per SM) walk tiles x splits work items of 1/splits of the batch each: the time is
        # the busiest SM's, ceil(tiles splits / SMs) / splits. Every chunk writes its own partial sums, so take the
        # fewest chunks within 10 % of that time's minimum
        def busiest(s):
            return -(-tiles * s // num_sms) / s
        best = min(busiest(s) for s in range(1, most + 1))
        splits = self.splits or next(s for s in range(1, most + 1) if busiest(s) <= 1.1 * best)
        return dataclasses.replace(self, rb=rb, splits=splits)

    def batch_multiple(self) -> int:
        """The padded batch is a multiple of this: ``splits`` chunks of whole steps, an even number of steps each
        where the warpgroups share the sweep (its two bases buffers alternate by step, tile after tile)."""
        return self.bb * self.splits * (2 if self.shared_sweep else 1)

    def groups(self, nb: int) -> list[tuple[int, int]]:
        """The rows ``m_lo .. m_hi - 1`` of ``V̄`` each kernel call makes: as few equal groups as keep a group's
        ``(m_hi - m_lo) bi`` columns within one ``wgmma`` (256); G=20, k=3 takes two groups of 12."""
        n = -(-(nb + 1) * self.bi // 256)
        cnt = -(-(nb + 1) // n)
        return [(lo, min(nb + 1, lo + cnt)) for lo in range(0, nb + 1, cnt)]


def sweep_halves(m_lo: int, m_hi: int, nb: int, k: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The rows ``[lo, hi)`` of a group ``[m_lo, m_hi)`` whose bases each compute warpgroup makes when the two share
    the sweep: the first takes the lower bases, the second the rest (and SiLU, row ``NB``, where the group has
    it), split where the larger share of the work is smallest. A warpgroup's work is the intervals its walk
    visits, ``hi - lo + k`` (:func:`jaxgrad.kan.basis_tiles.sweep` from ``start = lo``), plus one for SiLU."""
    def work(lo, hi):
        bases = min(hi, nb) - lo
        return (bases + k if bases > 0 else 0) + (1 if hi > nb else 0)

    mid = min(range(m_lo, m_hi + 1), key=lambda c: (max(work(m_lo, c), work(c, m_hi)), c))
    return (m_lo, mid), (mid, m_hi)


def _kernel(gt_gmem, x_gmem, tab_gmem, f_gmem, out_gmem, *, cfg: WideTiles, nb: int, k: int, n_rows: int,
            m_lo: int, m_hi: int):
    r"""``out [splits * out_pad, in_tiles * cnt * bi]`` (fp32, ``cnt = m_hi - m_lo``): row ``s * out_pad + o``, column
    ``(c cnt + m - m_lo) bi + j`` holds :math:`\sum_b g^\top_{ob} A^{(m)}_{b, c bi + j}` over batch chunk ``s``, both
    factors scaled."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    out_pad, m_rows = gt_gmem.shape
    bi, bb, rb, tile_o, splits = cfg.bi, cfg.bb, cfg.rb, cfg.tile_o, cfg.splits
    n_cols = (m_hi - m_lo) * bi
    n_tab, f_rows = tab_gmem.shape[0], f_gmem.shape[0]
    i_iters, o_iters = x_gmem.shape[1] // bi, out_pad // tile_o
    chunk = m_rows // splits
    b_iters = chunk // bb
    epi_n = cfg.epi_tile_n
    spec = mgpu_common.smem_spec
    pipeline = mgpu_common.warp_specialized([
        spec((tile_o, bb), lambda kk: (0, kk), mgpu_common.rhs_transforms(16)),
        spec((bb, bi), lambda kk: (kk, 0), mgpu_common.smem_transforms(bi, jnp.float32)),
    ], b_iters, cfg.stages)
    ignore = lambda *_, **__: None  # noqa: E731 - the bodies do not change the pipeline's allocations

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline(ignore, ignore).get_allocations(gt_gmem, x_gmem),
        b_smem=plgpu.SMEM((2, bb, n_cols), jnp.float16, transforms=mgpu_common.rhs_transforms(16)),
        out_smem=plgpu.SMEM((2, 2, _ROWS, epi_n), jnp.float32,
                            transforms=mgpu_common.smem_transforms(epi_n, jnp.float32)),
        tab_smem=plgpu.SMEM((2, n_tab, bi), jnp.float32),
        f_smem=plgpu.SMEM((2, f_rows, bi), jnp.float32),
        bars=plgpu.Barrier(num_barriers=4),
        ready=plgpu.Barrier(num_arrivals=2, num_barriers=2),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, b_smem, out_smem, tab_smem, f_smem, bars, ready):
        wg = lax.axis_index("wg")

        @mgpu_common.persistent_tiles((i_iters * splits, o_iters), cfg.grid_tile_width)
        def _tile(is_idx, o_idx):
            i_idx, s_idx = is_idx // splits, is_idx % splits
            b_slice = pl.ds(s_idx * chunk, chunk)
            i_slice = pl.ds(i_idx * bi, bi)
            o_slice = pl.ds(o_idx * tile_o, tile_o)

            def bcast(row):
                return lax.broadcast_in_dim(row, (bb, bi), [1])

            def compute_context(eval_pipeline):
                # the previous tile's steps have read the tables: its last step's products were waited for
                plgpu.copy_gmem_to_smem(tab_gmem.at[:, i_slice], tab_smem.at[wg], bars.at[wg])
                plgpu.copy_gmem_to_smem(f_gmem.at[:, i_slice], f_smem.at[wg], bars.at[2 + wg])
                plgpu.barrier_wait(bars.at[wg])
                plgpu.barrier_wait(bars.at[2 + wg])

                @functools.partial(pl.run_scoped, accs=[plgpu.ACC((_ROWS, n_cols), jnp.float32) for _ in range(rb)])
                def _acc_scope(accs):
                    eval_pipeline(accs)
                    with jax.named_scope("store"):
                        for j in range(rb):
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            rows = pl.ds(s_idx * out_pad + o_idx * tile_o + (wg * rb + j) * _ROWS, _ROWS)
                            cols = pl.ds(i_idx * n_cols, n_cols)
                            mgpu_common.store_tile(accs[j][...], out_smem, wg, out_gmem.at[rows, cols], _ROWS,
                                                   epi_n)

            def write_bases(x_smem, dst, lo, hi):
                """Rows ``lo .. hi - 1`` of the group's bases (scaled, float16) into their columns of ``dst``: the
                walk starts at interval ``lo`` and stops once ``B_{hi - 1}`` is made."""
                x = x_smem[...]  # [bb rows, bi inputs] fp32: a 64-row register tile, as wgmma's layout needs
                tab = KnotTable(lambda p, r: bcast(tab_smem[wg, p * n_rows + r]), expand=lambda row: row)
                if min(hi, nb) > lo:
                    for m, basis in sweep(x, tab, min(hi, nb) + k, k, start=lo):
                        dst[:, pl.ds((m - m_lo) * bi, bi)] = (basis * bcast(f_smem[wg, m])).astype(jnp.float16)
                if hi > nb:
                    dst[:, pl.ds((nb - m_lo) * bi, bi)] = (_silu(x) * bcast(f_smem[wg, nb])).astype(jnp.float16)
                plgpu.commit_smem()

            def mma_body(idx, gt_smem, x_smem, accs):
                if cfg.shared_sweep:
                    # each warpgroup makes half of the step's bases into the buffer of the step's parity and waits
                    # for the other's half; a buffer is written again two steps later, after both warpgroups passed
                    # the other buffer's barrier, so after their products of this step were waited for
                    buf = idx[0] % 2
                    halves = sweep_halves(m_lo, m_hi, nb, k)
                    with jax.named_scope("bases"):
                        for w, (lo, hi) in enumerate(halves):
                            pl.when(wg == w)(functools.partial(write_bases, x_smem, b_smem.at[buf], lo, hi))
                        plgpu.barrier_arrive(ready.at[buf])
                    with jax.named_scope("bases wait"):
                        plgpu.barrier_wait(ready.at[buf])
                    bases = b_smem.at[buf]
                else:
                    with jax.named_scope("bases"):
                        write_bases(x_smem, b_smem.at[wg], m_lo, m_hi)
                    bases = b_smem.at[wg]
                with jax.named_scope("products"):
                    for kq in range(bb // 16):  # wgmma's K groups: the swizzle (16 float16) of both operands
                        for j in range(rb):
                            plgpu.wgmma(accs[j],
                                        gt_smem.at[pl.ds((wg * rb + j) * _ROWS, _ROWS), pl.ds(kq * 16, 16)],
                                        bases.at[pl.ds(kq * 16, 16)])
                with jax.named_scope("products wait"):
                    plgpu.wgmma_wait(0)  # the next step writes b_smem again
                return accs

            pipeline(mma_body, compute_context)(
                gt_gmem.at[o_slice, b_slice], x_gmem.at[b_slice, i_slice], allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("config", "nb", "k", "n_rows", "num_sms", "m_lo", "m_hi"))
def _call(gt, x, tab, f, *, config, nb, k, n_rows, num_sms, m_lo, m_hi):
    out_pad = gt.shape[0]
    fn = mgpu_common.persistent_kernel(
        functools.partial(_kernel, cfg=config, nb=nb, k=k, n_rows=n_rows, m_lo=m_lo, m_hi=m_hi),
        jax.ShapeDtypeStruct((config.splits * out_pad, (x.shape[1] // config.bi) * (m_hi - m_lo) * config.bi),
                             jnp.float32),
        num_sms)
    return fn(gt, x, tab, f)


def kernel_operands(x, grid, g, spline_order: int, config: WideTiles) -> dict:
    """The kernel's padded operands for ``config`` (resolved: :meth:`WideTiles.resolved`): ``gt [out_pad, b_pad]``
    (the scaled cotangent, transposed, float16), ``x [b_pad, in_pad]`` (float32), ``tab`` (the knot tables) and ``f
    [NB+1, in_pad]`` (the factors :math:`2^{u}`), both padded to whole KiB of rows, and the exponents ``u [NB+1,
    in]``, ``t [out]``."""
    c = config
    b_pad = -(-x.shape[0] // c.batch_multiple()) * c.batch_multiple()
    in_pad = -(-x.shape[1] // c.bi) * c.bi
    out_pad = -(-g.shape[1] // c.tile_o) * c.tile_o
    row_bytes = 4 * c.bi  # a table row as a warpgroup copies it
    ops = padded_operands(x, grid, g, spline_order, (b_pad, in_pad, out_pad), row_bytes)
    ops["gt"] = ops.pop("g16").T
    ops["f"] = pad_to(ops["f"], (mgpu_common.whole_kib_rows(ops["f"].shape[0], row_bytes), in_pad))
    return ops


def kan_dcoef_wide_mgpu(x, grid, g, spline_order: int, config: WideTiles | None = None,
                        num_sms: int | None = None):
    r"""``V̄ [NB+1, in, out]`` (float32), as :func:`jaxgrad.kan.dcoef_mgpu.kan_dcoef_mgpu` returns it, on this
    module's kernel (module doc).

    Args:
      x: ``[B, in]`` float32.
      grid: ``[in, G + 2k + 1]`` float32 knots (non-decreasing rows).
      g: ``[B, out]`` float32, the output cotangent.
      spline_order: ``k``.
      config: the kernel's tiles (default :class:`WideTiles`).
    """
    check_operands("kan_dcoef_wide_mgpu", x, grid, g)
    k = int(spline_order)
    if not 0 <= k <= grid.shape[-1] - 2:
        raise ValueError(f"kan_dcoef_wide_mgpu: spline_order must be in [0, {grid.shape[-1] - 2}], got {k}")
    nb = grid.shape[-1] - k - 1
    in_f, out_f = x.shape[1], g.shape[1]
    sms = int(num_sms or _num_sms())
    c = (config or WideTiles()).resolved(nb, x.shape[0], in_f, out_f, sms)
    ops = kernel_operands(x, grid, g, k, c)
    out_pad, in_pad = ops["gt"].shape[0], ops["x"].shape[1]
    parts = []
    for m_lo, m_hi in c.groups(nb):
        acc = _call(ops["gt"], ops["x"], ops["tab"], ops["f"], config=c, nb=nb, k=k, n_rows=nb + k + 1,
                    num_sms=sms, m_lo=m_lo, m_hi=m_hi)
        acc = jnp.sum(acc.reshape(c.splits, out_pad, in_pad // c.bi, m_hi - m_lo, c.bi), axis=0)
        parts.append(jnp.transpose(acc, (2, 1, 3, 0)).reshape(m_hi - m_lo, in_pad, out_pad))
    v = jnp.concatenate(parts)[:, :in_f, :out_f]
    return fp16_scaled.unscale(v, -(ops["u"][:, :, None] + ops["t"][None, None, :]))


def kan_weight_cotangents(x, grid, g, spline_order: int):
    r"""The layer's weight gradients on ``backend="mosaic"``: ``(dC [out, in, NB], dW^b [out, in])`` from
    ``V̄`` (``dC_{oim} = V̄^{(m)}_{io}``, ``dW^b_{oi} = V̄^{(NB)}_{io}``). Float32 arrays on a Hopper GPU take
    :func:`kan_dcoef_wide_mgpu` (the bases as the right operand: one sweep of an x value for 256 outputs;
    :mod:`jaxgrad.kan.dcoef_mgpu`'s kernel, three bases and 64 outputs a sweep, stays as the
    bench's comparison); float64 arrays (the verifier's float64 re-run, CPU tests) take
    :func:`jaxgrad.kan.dcoef_mgpu.kan_dcoef_scaled_reference`, the same scaled products without the float16
    rounding."""
    from jaxgrad.kan.forward_mgpu import require_hopper

    if x.dtype == jnp.float64:
        v = kan_dcoef_scaled_reference(x, grid, g, spline_order)
    else:
        require_hopper()
        v = kan_dcoef_wide_mgpu(x, grid, g, spline_order)
    return weight_cotangents(v)
