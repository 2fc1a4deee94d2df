r"""The KAN layer's forward, spline and SiLU branches in one Mosaic GPU kernel on Hopper (``wgmma``), with the bases
computed in registers and float16 operands scaled by powers of two (TF32's significand at the float16 rate).

The layer's forward is one product over the concatenated contraction axis ``(m, i)``, ``m = 0..NB`` (``NB = G + k``
bases and the SiLU branch as an ``(NB+1)``-th "basis"):

.. math::

    y_{bo} = \sum_i \Bigl(\sum_{m < NB} B_m(x_{bi})\, C_{oim} + \operatorname{silu}(x_{bi})\, W^b_{oi}\Bigr)
           = \sum_{m \le NB} \sum_i A^{(m)}_{bi}\, V^{(m)}_{io}, \qquad
    A^{(m)} = \begin{cases} B_m(x) & m < NB \\ \operatorname{silu}(x) & m = NB \end{cases}, \quad
    V^{(m)} = \begin{cases} C_{\cdot\cdot m}^\top & m < NB \\ W^{b\top} & m = NB \end{cases}

**Scaling** (:mod:`jaxgrad.kan.fp16_scaled`'s model for ``a [M, K] @ b [K, N]``, ``a`` per row and ``b`` per
column, applied to ``a = [A^{(0)} | .. | A^{(NB)}]`` and ``b = [V^{(0)}; .. ; V^{(NB)}]``): row ``b`` of ``a`` is
scaled by :math:`2^{s_b}` from the bound :math:`\max(1, \max_i |\operatorname{silu}(x_{bi})|)` (bases lie in
``[0, 1]``), column ``o`` of ``b`` by :math:`2^{t_o}` from its largest magnitude over ``(m, i)``; both exponents
put the slice's bound in ``[2^14, 2^15)``. The kernel accumulates :math:`\sum \mathrm{fl}_{16}(2^{s_b} a)
\mathrm{fl}_{16}(2^{t_o} b)` in fp32 and XLA unscales exactly by :math:`2^{-s_b - t_o}` (one elementwise pass,
fused with the bias). The error model is :mod:`~jaxgrad.kan.fp16_scaled`'s: TF32's operand rounding, fp32 sums.

**The kernel.** A CTA computes ``2 x 64`` rows by ``tile_n`` outputs (one 64-row block per compute warpgroup); a
memory warpgroup streams, for each block of ``bk`` inputs, the ``x`` tile (fp32), the block's knot tables (fp32,
:func:`jaxgrad.kan.basis_tiles.affine_knot_tables`, in two copies) and the ``NB + 1`` scaled coefficient slabs
``V^{(m)}`` (fp16, ``[NB+1, bk, tile_n]``) into shared memory by TMA. Each compute warpgroup loads its ``x`` rows
into registers, walks the diagonal Cox-de Boor sweep of :mod:`jaxgrad.kan.basis_tiles` in its affine form (``k + 1``
live tiles) and, as each basis ``A^{(m)}`` is complete, issues ``acc += fl16(2^{s} A^{(m)}) V^{(m)}`` with the left
operand in registers; the tensor cores run while the next basis is computed. The ``[B, in, NB]`` basis is never
written anywhere.

Scope: float32 ``x`` and parameters (bf16 / f16 layers are computed in float32, as the XLA path does); the kernel's
shapes are padded to its tiles by :func:`kan_forward_mgpu` (zero rows of ``x``, zero knot-table columns and zero
coefficient rows add exact zeros). It needs a Hopper GPU (Mosaic GPU has no interpreter): the GPU tests compare it
with :func:`kan_forward_scaled_reference` at fresh random inputs and odd sizes; on a CPU its lowering is checked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxgrad.kan import fp16_scaled
from jaxgrad.kan.basis_tiles import KnotTable, affine_knot_tables, affine_sweep, pad_to, sweep
from jaxgrad.kan.spline import bspline_basis
from jaxgrad.ops import mgpu_common
from jaxgrad.ops.mgpu_common import num_sms as _num_sms

__all__ = ["ForwardTiles", "kan_forward", "kan_forward_mgpu", "kan_forward_scaled_reference", "knot_block_rows",
           "knot_table_blocks", "knot_table_limit", "on_hopper", "require_hopper", "scaled_operands", "supported"]

_ROWS = 64  # rows of x per compute warpgroup: the wgmma M
_SMEM_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True)
class ForwardTiles:
    """Tiles of :func:`kan_forward_mgpu`: ``bk`` inputs per pipeline stage (a multiple of 16: the ``wgmma``
    contraction of 16-bit operands), ``tile_n`` outputs per CTA, ``stages`` in flight, the epilogue's pieces."""

    bk: int = 32
    tile_n: int = 128
    stages: int = 2
    epi_tile_m: int = 64
    epi_tile_n: int = 16  # 16 KiB of fp32 epilogue slots: room for two stages of bk = 32 at G = 5, k = 3
    grid_tile_width: int = 8
    # the kan bench's breakdown of the kernel's time (the result is then not the layer's): "products" issues the
    # NB + 1 products of every step with silu(x) as each left operand (no Cox-de Boor sweep); "bases" runs the sweep
    # and issues one product a step, of the bases' sum (the ALU work without NB of the NB + 1 products). "plain"
    # is the layer's result by the plain sweep (basis_tiles.sweep) instead of the affine one
    probe: str = ""

    def smem_bytes(self, nb: int, k: int) -> int:
        """Shared memory of one CTA: the stages (``x``, knot tables, ``NB + 1`` slabs) and the epilogue slots."""
        rows = sum(knot_block_rows(nb + k + 1, k, self.bk))
        stage = 2 * _ROWS * self.bk * 4 + rows * self.bk * 4 + (nb + 1) * self.bk * self.tile_n * 2 + 2 * _ROWS * 4
        return self.stages * stage + 2 * 2 * self.epi_tile_m * self.epi_tile_n * 4

    @classmethod
    def for_layer(cls, nb: int, k: int, tile_n: int | None = None, out_f: int | None = None) -> ForwardTiles:
        """The widest tiles whose shared memory fits: two stages if they can, ``tile_n`` 256 (at least 256 outputs,
        or ``out_f`` not given), 128, 64 then 32, ``bk`` 32 then 16 (or only the ``tile_n`` given). Each CTA
        evaluates its basis tiles once for ``tile_n`` outputs, so 256 halves the sweeps of 128 for twice the
        accumulator registers: the forward of B 16384, 512 -> 512, G 5, k 3 took 0.48 ms at 256 (``bk`` 16) and
        1.01 at 128 (``bk`` 32) on an H100, one run."""
        if tile_n is not None:
            widths = (tile_n,)
        else:
            widths = (256, 128, 64, 32) if out_f is None or out_f >= 256 else (128, 64, 32)
        for stages in (2, 1):
            for tn in widths:
                for bk in (32, 16):
                    t = cls(bk=bk, tile_n=tn, stages=stages)
                    if t.smem_bytes(nb, k) <= _SMEM_BYTES:
                        return t
        raise ValueError(f"kan_forward_mgpu: {nb} bases of order {k} do not fit one CTA's shared memory")


def supported(x, grid, coef, base_weight) -> str | None:
    """``None`` when :func:`kan_forward_mgpu` runs these arrays, else why not (naming the argument)."""
    if getattr(x, "ndim", None) != 2:
        return f"'x' must be 2-D [B, in], got shape {jnp.shape(x)}"
    why = knot_table_limit(grid, coef)
    if why is not None:
        return why
    for name, a in (("x", x), ("grid", grid), ("coef", coef), ("base_weight", base_weight)):
        if jnp.dtype(a.dtype) != jnp.dtype(jnp.float32):
            return f"'{name}' must be float32 (the kernel's operands are scaled float16 from float32), got {a.dtype}"
    return None


def knot_table_limit(grid, coef) -> str | None:
    """The kernels copy a block's knots and reciprocal widths, ``(k + 1) (G + 2k + 1)`` rows, in one copy of at most
    256 rows: ``None`` when ``grid`` fits, else why not."""
    n_knots, k = grid.shape[-1], grid.shape[-1] - coef.shape[-1] - 1
    if (k + 1) * n_knots <= 256:
        return None
    return (f"'grid' has {n_knots} knots a row at order {k}: the kernel's knot table would exceed 256 rows "
            f"(grid_size <= {256 // (k + 1) - 2 * k - 1} at this order)")


def knot_block_rows(n_rows: int, k: int, bk: int) -> tuple[int, int]:
    """Rows of the knot table's two blocks in shared memory (:func:`knot_table_blocks`): ``(k + 1) n_rows`` knots
    and reciprocal widths, ``k n_rows`` affine shifts, each padded to whole KiB of ``bk`` float32 columns
    (:func:`jaxgrad.ops.mgpu_common.whole_kib_rows`)."""
    row_bytes = 4 * bk
    return (mgpu_common.whole_kib_rows((k + 1) * n_rows, row_bytes),
            mgpu_common.whole_kib_rows(k * n_rows, row_bytes))


def knot_table_blocks(grid, k: int, n_rows: int, in_pad: int, bk: int):
    """:func:`jaxgrad.kan.basis_tiles.affine_knot_tables` as the kernels copy it: the knots and reciprocal widths,
    zero rows, the affine shifts, zero rows (:func:`knot_block_rows`); ``(table, rows of the first block)``."""
    tab = affine_knot_tables(grid, jnp.float32, k, n_rows, in_pad)
    split = (k + 1) * n_rows
    first, second = knot_block_rows(n_rows, k, bk)
    return jnp.concatenate([pad_to(tab[:split], (first, in_pad)), pad_to(tab[split:], (second, in_pad))]), first


def _silu(x):
    return x * jax.nn.sigmoid(x)


def scaled_operands(x, coef, base_weight):
    """The exponents of the module doc: ``s [B]`` (rows of ``[bases | silu(x)]``, from the bound
    ``max(1, max_i |silu(x_bi)|)``) and ``t [out]`` (columns of ``[C; W^b]``, from their largest magnitude), and
    ``V [NB+1, in, out]`` float32 = the unscaled slabs ``[C_{..m}^T ..., W^{bT}]``."""
    amax_a = jnp.maximum(jnp.max(jnp.abs(_silu(x)), axis=1, initial=0.0), 1.0)
    v = jnp.concatenate([jnp.transpose(coef, (2, 1, 0)), base_weight.T[None]], axis=0)  # [NB+1, in, out]
    amax_b = jnp.max(jnp.abs(v), axis=(0, 1), initial=0.0)
    return fp16_scaled.scale_exponents(amax_a), fp16_scaled.scale_exponents(amax_b), v


def kan_forward_scaled_reference(x, grid, coef, base_weight, spline_order: int):
    """What :func:`kan_forward_mgpu` computes, in plain JAX: the same float16 operands, their products summed in
    float32 (another order), the same exact unscaling. The oracle of the kernel's GPU tests, and the kernel's
    stand-in where it cannot run (a CPU)."""
    s, t, v = scaled_operands(x, coef, base_weight)
    phi = bspline_basis(x, grid, spline_order)  # [B, in, NB]
    a = jnp.concatenate([jnp.transpose(phi, (0, 2, 1)), _silu(x)[:, None, :]], axis=1)  # [B, NB+1, in]
    a16 = _round16(a * fp16_scaled.pow2(s, a.dtype)[:, None, None])
    v16 = _round16(v * fp16_scaled.pow2(t, v.dtype)[None, None, :])
    acc = jnp.einsum("bmi,mio->bo", a16, v16, preferred_element_type=x.dtype,
                     precision=jax.lax.Precision.HIGHEST)
    return fp16_scaled.unscale(acc, -(s[:, None] + t[None, :]))


def _round16(a):
    """float16 operands of float32 arrays; float64 arrays (the verifier's re-run) keep their values, as in
    :mod:`jaxgrad.kan.fp16_scaled`."""
    return a if a.dtype == jnp.float64 else a.astype(jnp.float16)


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x), where the kernel runs."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def kan_forward(x, grid, coef, base_weight, spline_order: int):
    """The layer's forward on ``backend="mosaic"``: :func:`kan_forward_mgpu` for float32 arrays on a Hopper GPU;
    float64 arrays (the verifier's float64 re-run, CPU tests) take :func:`kan_forward_scaled_reference`, the same
    scaled products without the float16 rounding. Float32 elsewhere raises: the kernel needs Hopper, and the same
    products on any device are ``backend="xla", precision="fp16_scaled"``."""
    if x.dtype == jnp.float64:
        return kan_forward_scaled_reference(x, grid, coef, base_weight, spline_order)
    require_hopper()
    return kan_forward_mgpu(x, grid, coef, base_weight, spline_order)


def require_hopper() -> None:
    """Raise, naming the portable alternative, unless the default device is a Hopper GPU."""
    if not on_hopper():
        raise ValueError(f"kan_linear: backend='mosaic' runs on a Hopper GPU (sm_90), the default device is "
                         f"{jax.devices()[0].device_kind!r}; the same scaled products run anywhere with "
                         f"backend='xla', precision='{fp16_scaled.FP16_SCALED}'")


def _kernel(x_gmem, tab_gmem, v_gmem, rs_gmem, out_gmem, *, cfg: ForwardTiles, nb: int, k: int, n_rows: int,
            split: int):
    """``acc [M, N]`` (fp32) of the scaled operands for the padded arrays (module doc). The knot table travels as
    two blocks (a copy moves at most 256 rows), split at row ``split`` (:func:`knot_table_blocks`)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, n_in = x_gmem.shape
    n = out_gmem.shape[1]
    bk, tile_n = cfg.bk, cfg.tile_n
    epi_m, epi_n = cfg.epi_tile_m, cfg.epi_tile_n
    cta_m = 2 * _ROWS
    m_iters, n_iters, k_iters = m // cta_m, n // tile_n, n_in // bk
    rows_shift = tab_gmem.shape[0] - split

    spec = mgpu_common.smem_spec
    pipeline = mgpu_common.warp_specialized([
        spec((cta_m, bk), lambda kk: (0, kk), mgpu_common.smem_transforms(bk, jnp.float32)),
        spec((split, bk), lambda kk: (0, kk)),
        spec((rows_shift, bk), lambda kk: (0, kk)),
        spec((nb + 1, bk, tile_n), lambda kk: (0, kk, 0), mgpu_common.rhs_transforms(bk)),
        spec((1, cta_m), lambda kk: (kk, 0)),  # the row scales, one copy per step
    ], k_iters, cfg.stages)

    ignore = lambda *_, **__: None  # noqa: E731 - the bodies do not change the pipeline's allocations
    slots = min(2, (_ROWS // epi_m) * (tile_n // epi_n))

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline(ignore, ignore).get_allocations(x_gmem, tab_gmem.at[:split], tab_gmem.at[split:],
                                                                 v_gmem.at[:nb + 1], rs_gmem),
        out_smem=plgpu.SMEM((2, slots, epi_m, epi_n), jnp.float32,
                            transforms=mgpu_common.smem_transforms(epi_n, jnp.float32)),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem):
        wg = lax.axis_index("wg")

        @mgpu_common.persistent_tiles((m_iters, n_iters), cfg.grid_tile_width)
        def _tile(m_idx, n_idx):
            cta_m_slice = pl.ds(m_idx * cta_m, cta_m)
            wg_m_slice = pl.ds(wg * _ROWS, _ROWS)

            def compute_context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((_ROWS, tile_n), jnp.float32))
                def _acc_scope(acc_ref):
                    eval_pipeline(acc_ref)
                    with jax.named_scope("store"):
                        acc = acc_ref[...]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        mgpu_common.store_tile(acc, out_smem, wg,
                                               out_gmem.at[cta_m_slice, pl.ds(n_idx * tile_n, tile_n)].at[wg_m_slice],
                                               epi_m, epi_n)

            def mma_body(_, x_smem, tab_smem, shift_smem, v_smem, rs_smem, acc_ref):
                with jax.named_scope("bases and products"):
                    issue(x_smem, tab_smem, shift_smem, v_smem, rs_smem, acc_ref)
                with jax.named_scope("products wait"):
                    plgpu.wgmma_wait(0)
                return acc_ref

            def issue(x_smem, tab_smem, shift_smem, v_smem, rs_smem, acc_ref):
                """The step's bases and its NB + 1 products (or a probe's share of them), left in flight."""
                x = x_smem[wg_m_slice]  # [64, bk] fp32
                rs = lax.broadcast_in_dim(rs_smem.at[0][wg_m_slice], (_ROWS, bk), [0])  # 2^{s_b} per row

                def knot_row(p, r):
                    row = tab_smem[p * n_rows + r] if p <= k else shift_smem[(p - k - 1) * n_rows + r]
                    return lax.broadcast_in_dim(row, (_ROWS, bk), [1])

                tab = KnotTable(knot_row, expand=lambda row: row)
                if cfg.probe == "products":
                    a16 = (_silu(x) * rs).astype(jnp.float16)
                    for mb in range(nb + 1):
                        plgpu.wgmma(acc_ref, a16, v_smem.at[mb])
                elif cfg.probe == "bases":
                    total = _silu(x)
                    for _, basis in affine_sweep(x, tab, nb + k, k, k):
                        total = total + basis
                    plgpu.wgmma(acc_ref, (total * rs).astype(jnp.float16), v_smem.at[nb])
                elif cfg.probe == "plain":
                    for mb, basis in sweep(x, tab, nb + k, k):
                        plgpu.wgmma(acc_ref, (basis * rs).astype(jnp.float16), v_smem.at[mb])
                    plgpu.wgmma(acc_ref, (_silu(x) * rs).astype(jnp.float16), v_smem.at[nb])
                else:
                    for mb, basis in affine_sweep(x, tab, nb + k, k, k):
                        plgpu.wgmma(acc_ref, (basis * rs).astype(jnp.float16), v_smem.at[mb])
                    plgpu.wgmma(acc_ref, (_silu(x) * rs).astype(jnp.float16), v_smem.at[nb])

            pipeline(mma_body, compute_context)(
                x_gmem.at[cta_m_slice, :], tab_gmem.at[:split], tab_gmem.at[split:],
                v_gmem.at[pl.ds(n_idx * (nb + 1), nb + 1)], rs_gmem.at[:, cta_m_slice],
                allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("config", "nb", "k", "n_rows", "split", "num_sms"))
def _call(x, tab, v, rs, *, config, nb, k, n_rows, split, num_sms):
    m, n = x.shape[0], v.shape[0] // (nb + 1) * v.shape[-1]
    f = mgpu_common.persistent_kernel(
        functools.partial(_kernel, cfg=config, nb=nb, k=k, n_rows=n_rows, split=split),
        jax.ShapeDtypeStruct((m, n), jnp.float32),
        num_sms)
    return f(x, tab, v, rs)


def kan_forward_mgpu(x, grid, coef, base_weight, spline_order: int, config: ForwardTiles | None = None,
                     num_sms: int | None = None):
    r"""``y [B, out] = silu(x) W^{bT} + \sum_{i,m} B_m(x_{bi}) C_{oim}`` (float32) from the scaled float16 operands
    of the module doc, on the Hopper kernel.

    Args:
      x: ``[B, in]`` float32.
      grid: ``[in, G + 2k + 1]`` float32 knots (non-decreasing rows).
      coef: ``[out, in, G + k]`` float32 (``spline_weight * spline_scaler``).
      base_weight: ``[out, in]`` float32.
      spline_order: ``k``.
      config: the kernel's tiles (default :meth:`ForwardTiles.for_layer`).
    """
    why = supported(x, grid, coef, base_weight)
    if why is not None:
        raise ValueError(f"kan_forward_mgpu: {why}")
    k = int(spline_order)
    out_f, in_f, nb = coef.shape
    c = config or ForwardTiles.for_layer(nb, k, out_f=out_f)
    s, t, v = scaled_operands(x, coef, base_weight)
    b = x.shape[0]
    m_pad = -(-b // (2 * _ROWS)) * 2 * _ROWS
    in_pad = -(-in_f // c.bk) * c.bk
    out_pad = -(-out_f // c.tile_n) * c.tile_n
    n_rows = nb + k + 1
    tab, split = knot_table_blocks(grid, k, n_rows, in_pad, c.bk)
    v16 = (v * fp16_scaled.pow2(t, v.dtype)[None, None, :]).astype(jnp.float16)
    v16 = pad_to(v16, (nb + 1, in_pad, out_pad))
    # [out tiles * (NB+1), in, tile_n]: a CTA's NB+1 slabs are one block of rows (a copy of at most 5 strided
    # dimensions once tiled)
    v16 = v16.reshape(nb + 1, in_pad, out_pad // c.tile_n, c.tile_n).transpose(2, 0, 1, 3)
    v16 = v16.reshape(-1, in_pad, c.tile_n)
    # [in blocks, B]: the row scales repeated for each pipeline step (its inputs must all move with the step)
    rs = jnp.broadcast_to(pad_to(fp16_scaled.pow2(s, jnp.float32), (m_pad,)), (in_pad // c.bk, m_pad))
    acc = _call(pad_to(x, (m_pad, in_pad)), tab, v16, rs, config=c, nb=nb, k=k, n_rows=n_rows, split=split,
                num_sms=int(num_sms or _num_sms()))
    return fp16_scaled.unscale(acc[:b, :out_f], -(s[:, None] + t[None, :]))
