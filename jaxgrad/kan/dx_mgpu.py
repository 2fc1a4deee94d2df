r"""The KAN layer's input gradient, spline and SiLU branches in one Mosaic GPU kernel on Hopper (``wgmma``), from
float16 operands scaled by powers of two; the derivative bases are computed in registers in the epilogue.

With the output cotangent ``g [B, out]`` and ``U^{(m)} = C_{\cdot\cdot m}`` (``m < NB``), ``U^{(NB)} = W^b``
(``[out, in]`` each):

.. math::

    \bar x_{bi} = \sum_{m \le NB} D_m(x_{bi})\, H^{(m)}_{bi}, \qquad H^{(m)} = g\, U^{(m)}, \qquad
    D_m = \begin{cases} B'_m & m < NB \\ \operatorname{silu}' & m = NB \end{cases}

:math:`H^{(m)}` are ``NB + 1`` products with the same left operand; :math:`D_m` depends on ``(b, i)`` and is
applied entrywise, so the sum over ``m`` is the epilogue's, not the matrix units'.

**Scaling** (:mod:`jaxgrad.kan.fp16_scaled`'s model for each :math:`g\,U^{(m)}`): row ``b`` of ``g`` by
:math:`2^{s_b}` (its largest magnitude), column ``i`` of :math:`U^{(m)}` by :math:`2^{t_{mi}}`. The epilogue
multiplies each accumulator by :math:`2^{-t_{mi}} D_m(x_{bi})` (a power of two per column: exact) and sums over
``m``; XLA unscales the sum by :math:`2^{-s_b}` exactly.

**The kernel.** A CTA owns ``2 x 64`` rows by ``bk`` inputs of :math:`\bar x` and ``NB + 1`` fp32 accumulators
(``[64, bk]`` per compute warpgroup); a memory warpgroup streams, per block of ``tile_o`` outputs, the ``g`` tile
and the block's ``NB + 1`` slabs by TMA; each compute warpgroup issues one ``wgmma`` per slab and step. In the
epilogue it brings in its ``x`` rows, the block's knot tables and the column factors, runs the diagonal Cox-de Boor
sweep of degree ``k - 1`` of :mod:`jaxgrad.kan.basis_tiles` in its affine form (``B'_m = k (B^{k-1}_m w^{-1}_{k,m} -
B^{k-1}_{m+1} w^{-1}_{k,m+1})``) and forms the sum, ``epi_cols`` inputs at a time (:class:`DxTiles`: the sweep at
the accumulators' full width spilled). Where the ``NB + 1`` accumulators do not fit the registers, the
bases are split into groups of at most ``max_group`` and each group is one kernel call; XLA adds their sums.

Scope: float32; shapes padded to the tiles (zero rows of ``g`` and zero slab rows and columns add exact zeros). It
needs a Hopper GPU: the GPU tests compare it with :func:`kan_dx_scaled_reference`; on a CPU its lowering is checked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxgrad.kan import fp16_scaled
from jaxgrad.kan.basis_tiles import KnotTable, affine_sweep, pad_to
from jaxgrad.kan.spline import bspline_basis_derivative
from jaxgrad.ops import mgpu_common
from jaxgrad.ops.mgpu_common import num_sms as _num_sms

__all__ = ["DxTiles", "kan_dx", "kan_dx_mgpu", "kan_dx_scaled_reference", "scaled_operands"]

_ROWS = 64


@dataclasses.dataclass(frozen=True)
class DxTiles:
    """Tiles of :func:`kan_dx_mgpu`: ``bk`` inputs per CTA (the accumulators' width), ``tile_o`` outputs per
    pipeline stage, ``stages`` in flight, at most ``max_group`` accumulators per call, and the epilogue's pieces of
    ``epi_cols`` inputs (at most 16, dividing ``bk``). The epilogue holds every accumulator while it sweeps, so its
    sweep works on pieces narrower than the accumulators: at ``bk`` 32, 9 accumulators take 144 registers a thread,
    and the sweep over all 32 inputs beside them took 23,300 cycles a tile against 2 x 3,400 in pieces of 16 (G=5,
    k=3, B 16384, 512 -> 512 on an H100: ``python -m jaxgrad.bench kan_trace``)."""

    bk: int = 32
    tile_o: int = 64
    stages: int = 3
    max_group: int = 9
    epi_cols: int = 16

    @property
    def piece(self) -> int:
        """Inputs of one epilogue piece."""
        return min(self.epi_cols, self.bk)

    def __post_init__(self):
        if not (0 < self.epi_cols <= 16 and self.bk % min(self.epi_cols, self.bk) == 0):
            raise ValueError(f"DxTiles: epi_cols must divide bk = {self.bk} and be at most 16, got {self.epi_cols}")

    @classmethod
    def for_layer(cls, nb: int) -> DxTiles:
        """``bk`` 32 with groups of up to 9 accumulators (16 registers each); more bases: ``bk`` 16, 12 a group."""
        return cls() if nb + 1 <= 9 else cls(bk=16, max_group=12)


def _silu_slope(x):
    s = jax.nn.sigmoid(x)
    return s * (1 + x * (1 - s))


def scaled_operands(g, coef, base_weight):
    """``s [B]`` (rows of ``g``), ``t [NB+1, in]`` (columns of each ``U^{(m)}``) and ``U [NB+1, out, in]``
    float32 (unscaled)."""
    s = fp16_scaled.scale_exponents(jnp.max(jnp.abs(g), axis=1, initial=0.0))
    u = jnp.concatenate([jnp.transpose(coef, (2, 0, 1)), base_weight[None]], axis=0)
    t = fp16_scaled.scale_exponents(jnp.max(jnp.abs(u), axis=1, initial=0.0))
    return s, t, u


def _round16(a):
    return a if a.dtype == jnp.float64 else a.astype(jnp.float16)


def kan_dx_scaled_reference(x, grid, coef, base_weight, g, spline_order: int):
    """What :func:`kan_dx_mgpu` computes, in plain JAX: the same float16 operands and column factors, float32
    sums in another order, the same exact unscaling (float64 arrays: no float16 rounding)."""
    s, t, u = scaled_operands(g, coef, base_weight)
    g16 = _round16(g * fp16_scaled.pow2(s, g.dtype)[:, None])
    u16 = _round16(u * fp16_scaled.pow2(t, u.dtype)[:, None, :])
    h = jnp.einsum("bo,moi->mbi", g16, u16, preferred_element_type=x.dtype, precision=lax.Precision.HIGHEST)
    d = jnp.concatenate([jnp.transpose(bspline_basis_derivative(x, grid, spline_order), (2, 0, 1)),
                         _silu_slope(x)[None]], axis=0)  # [NB+1, B, in]
    total = jnp.sum(d * fp16_scaled.pow2(-t, x.dtype)[:, None, :] * h, axis=0)
    return fp16_scaled.unscale(total, -s[:, None])


def _kernel(g_gmem, u_gmem, x_gmem, tab_gmem, f_gmem, out_gmem, *, cfg: DxTiles, m_lo: int, m_hi: int, nb: int,
            k: int, n_rows: int, split: int):
    """``sum_{m_lo <= m < m_hi} 2^{-t_mi} D_m(x) acc_m`` for the padded arrays (module doc); the knot table's
    blocks split at row ``split`` (:func:`jaxgrad.kan.forward_mgpu.knot_table_blocks`), the column factors ``f``
    padded with zero rows to whole KiB."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m_rows, n_out = g_gmem.shape
    n_in = out_gmem.shape[1]
    bk, tile_o, piece = cfg.bk, cfg.tile_o, cfg.piece
    cnt = m_hi - m_lo
    cta_m = 2 * _ROWS
    m_iters, i_iters, o_iters = m_rows // cta_m, n_in // bk, n_out // tile_o
    rows_shift = tab_gmem.shape[0] - split
    f_rows = f_gmem.shape[0]

    spec = mgpu_common.smem_spec
    pipeline = mgpu_common.warp_specialized([
        spec((cta_m, tile_o), lambda kk: (0, kk), mgpu_common.smem_transforms(tile_o, jnp.float16)),
        spec((cnt, bk, tile_o), lambda kk: (0, 0, kk), mgpu_common.smem_transforms(tile_o, jnp.float16)),
    ], o_iters, cfg.stages)

    ignore = lambda *_, **__: None  # noqa: E731 - the bodies do not change the pipeline's allocations

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline(ignore, ignore).get_allocations(g_gmem, u_gmem.at[:cnt]),
        # every buffer whole KiB (mgpu_common.whole_kib_rows), so each starts at the alignment TMA and its swizzle
        # need
        x_smem=plgpu.SMEM((2, _ROWS, bk), jnp.float32, transforms=mgpu_common.smem_transforms(bk, jnp.float32)),
        out_smem=plgpu.SMEM((2, bk // piece, _ROWS, piece), jnp.float32,
                            transforms=mgpu_common.smem_transforms(piece, jnp.float32)),
        tab_smem=plgpu.SMEM((2, split, bk), jnp.float32),
        shift_smem=plgpu.SMEM((2, rows_shift, bk), jnp.float32),
        f_smem=plgpu.SMEM((2, f_rows, bk), jnp.float32),
        bars=plgpu.Barrier(num_barriers=8),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, x_smem, out_smem, tab_smem, shift_smem, f_smem, bars):
        wg = lax.axis_index("wg")

        @mgpu_common.persistent_tiles((m_iters, i_iters), 8)
        def _tile(m_idx, i_idx):
            cta_m_slice = pl.ds(m_idx * cta_m, cta_m)
            rows = pl.ds(m_idx * cta_m + wg * _ROWS, _ROWS)
            cols = pl.ds(i_idx * bk, bk)
            wg_m_slice = pl.ds(wg * _ROWS, _ROWS)

            def epilogue_piece(q, x_all, acc_all):
                """Columns ``q piece .. (q + 1) piece`` of the tile's sum into ``out_smem[wg, q]``."""
                cs = slice(q * piece, (q + 1) * piece)
                x = x_all[:, cs]

                def bcast(row):
                    return lax.broadcast_in_dim(row, (_ROWS, piece), [1])

                def knot_row(p, r):
                    return bcast(tab_smem[wg, p * n_rows + r, pl.ds(q * piece, piece)] if p <= k else
                                 shift_smem[wg, (p - k - 1) * n_rows + r, pl.ds(q * piece, piece)])

                tab = KnotTable(knot_row, expand=lambda row: row)
                total = None

                def add(m, d):
                    nonlocal total
                    term = d * bcast(f_smem[wg, m - m_lo, pl.ds(q * piece, piece)]) * acc_all[m - m_lo][:, cs]
                    total = term if total is None else total + term

                prev = None
                with jax.named_scope("epilogue: derivative bases"):
                    for sidx, low in affine_sweep(x, tab, nb + k, k - 1, k):  # B^{k-1}_s, s = 0 .. nb
                        if sidx > 0 and m_lo <= sidx - 1 < m_hi:
                            add(sidx - 1, k * (prev * tab.inv(k, sidx - 1) - low * tab.inv(k, sidx)))
                        prev = low
                        if sidx >= min(m_hi, nb):
                            break
                    if m_hi > nb:
                        add(nb, _silu_slope(x))
                with jax.named_scope("store"):
                    out_smem[wg, q] = total

            def compute_context(eval_pipeline):
                # the epilogue's x rows, knot tables and column factors, in flight during the K loop (the previous
                # tile's epilogue has read them: it ended with its store)
                plgpu.copy_gmem_to_smem(x_gmem.at[rows, cols], x_smem.at[wg], bars.at[wg])
                plgpu.copy_gmem_to_smem(tab_gmem.at[:split, cols], tab_smem.at[wg], bars.at[2 + wg])
                plgpu.copy_gmem_to_smem(tab_gmem.at[split:, cols], shift_smem.at[wg], bars.at[6 + wg])
                plgpu.copy_gmem_to_smem(f_gmem.at[:, cols], f_smem.at[wg], bars.at[4 + wg])

                @functools.partial(pl.run_scoped, accs=[plgpu.ACC((_ROWS, bk), jnp.float32) for _ in range(cnt)])
                def _acc_scope(accs):
                    eval_pipeline(accs)
                    with jax.named_scope("epilogue: tables wait"):
                        plgpu.barrier_wait(bars.at[wg])
                        plgpu.barrier_wait(bars.at[2 + wg])
                        plgpu.barrier_wait(bars.at[4 + wg])
                        plgpu.barrier_wait(bars.at[6 + wg])
                    x_all = x_smem[wg]
                    acc_all = [acc[...] for acc in accs]
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's pieces have left out_smem
                    for q in range(bk // piece):
                        epilogue_piece(q, x_all, acc_all)
                    plgpu.commit_smem()
                    for q in range(bk // piece):
                        plgpu.copy_smem_to_gmem(out_smem.at[wg, q],
                                                out_gmem.at[rows, pl.ds(i_idx * bk + q * piece, piece)])

            def mma_body(_, g_smem, u_smem, accs):
                with jax.named_scope("products"):
                    for j in range(cnt):
                        plgpu.wgmma(accs[j], g_smem.at[wg_m_slice], u_smem.at[j].transpose((1, 0)))
                with jax.named_scope("products wait"):
                    plgpu.wgmma_wait(0)
                return accs

            pipeline(mma_body, compute_context)(
                g_gmem.at[cta_m_slice, :], u_gmem.at[pl.ds(i_idx * cnt, cnt)], allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("config", "m_lo", "m_hi", "nb", "k", "n_rows", "split", "num_sms"))
def _call(g16, u16, x, tab, f, *, config, m_lo, m_hi, nb, k, n_rows, split, num_sms):
    fn = mgpu_common.persistent_kernel(
        functools.partial(_kernel, cfg=config, m_lo=m_lo, m_hi=m_hi, nb=nb, k=k, n_rows=n_rows, split=split),
        jax.ShapeDtypeStruct(x.shape, jnp.float32),
        num_sms)
    return fn(g16, u16, x, tab, f)


def kan_dx_mgpu(x, grid, coef, base_weight, g, spline_order: int, config: DxTiles | None = None,
                num_sms: int | None = None):
    r"""``dx [B, in]`` (float32) of the module doc from the scaled float16 operands, on the Hopper kernel.

    Args:
      x: ``[B, in]``, grid ``[in, G + 2k + 1]``, coef ``[out, in, G + k]``, base_weight ``[out, in]``, g
        ``[B, out]``: float32.
    """
    for name, a in (("x", x), ("grid", grid), ("coef", coef), ("base_weight", base_weight), ("g", g)):
        if jnp.dtype(a.dtype) != jnp.dtype(jnp.float32):
            raise ValueError(f"kan_dx_mgpu: '{name}' must be float32, got {a.dtype}")
    from jaxgrad.kan.forward_mgpu import knot_table_blocks, knot_table_limit

    why = knot_table_limit(grid, coef)
    if why is not None:
        raise ValueError(f"kan_dx_mgpu: {why}")
    k = int(spline_order)
    out_f, in_f, nb = coef.shape
    c = config or DxTiles.for_layer(nb)
    s, t, u = scaled_operands(g, coef, base_weight)
    b = x.shape[0]
    m_pad = -(-b // (2 * _ROWS)) * 2 * _ROWS
    in_pad = -(-in_f // c.bk) * c.bk
    out_pad = -(-out_f // c.tile_o) * c.tile_o
    n_rows = nb + k + 1
    g16 = pad_to((g * fp16_scaled.pow2(s, g.dtype)[:, None]).astype(jnp.float16), (m_pad, out_pad))
    u16 = pad_to((u * fp16_scaled.pow2(t, u.dtype)[:, None, :]).astype(jnp.float16), (nb + 1, out_pad, in_pad))
    f = pad_to(fp16_scaled.pow2(-t, jnp.float32), (nb + 1, in_pad))
    tab, split = knot_table_blocks(grid, k, n_rows, in_pad, c.bk)
    xp = pad_to(x, (m_pad, in_pad))
    total = None
    for m_lo in range(0, nb + 1, c.max_group):
        m_hi = min(nb + 1, m_lo + c.max_group)
        # [input tiles * group, bk, out]: a CTA's slabs are one block of rows, each transposed (out minor)
        slabs = u16[m_lo:m_hi].reshape(m_hi - m_lo, out_pad, in_pad // c.bk, c.bk).transpose(2, 0, 3, 1)
        f_group = pad_to(f[m_lo:m_hi], (mgpu_common.whole_kib_rows(m_hi - m_lo, 4 * c.bk), in_pad))
        part = _call(g16, slabs.reshape(-1, c.bk, out_pad), xp, tab, f_group, config=c, m_lo=m_lo, m_hi=m_hi,
                     nb=nb, k=k, n_rows=n_rows, split=split, num_sms=int(num_sms or _num_sms()))
        total = part if total is None else total + part
    return fp16_scaled.unscale(total[:b, :in_f], -s[:, None])


def kan_dx(x, grid, coef, base_weight, g, spline_order: int):
    """``dx`` on ``backend="mosaic"``: :func:`kan_dx_mgpu` for float32 on a Hopper GPU; float64 (the verifier's
    re-run, CPU tests) takes :func:`kan_dx_scaled_reference` (the same scaled products, no float16 rounding)."""
    from jaxgrad.kan.forward_mgpu import require_hopper

    if x.dtype == jnp.float64:
        return kan_dx_scaled_reference(x, grid, coef, base_weight, g, spline_order)
    require_hopper()
    return kan_dx_mgpu(x, grid, coef, base_weight, g, spline_order)
