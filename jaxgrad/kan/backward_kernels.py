r"""The backward kernels of a KAN layer's spline part (:mod:`jaxgrad.kan.kernels`), for the cotangent
``g[B, out]`` of ``y``:

.. math::

    \bar c[o, i, m] = \sum_b g[b, o]\, B_m(x_{bi}) \quad \text{(dcoef)}, \qquad
    \bar x[b, i] = \sum_m B'_m(x_{bi}) \sum_o g[b, o]\, c[o, i, m] \quad \text{(dx)}

* dcoef: grid ``(S, cdiv(in, bk), cdiv(out, bo))``; a program owns a ``[bo, K]`` block of ``coef``'s gradient,
  loops over its share of the batch blocks and adds ``g^T[bo, bb] @ A[bb, K]``. ``S`` splits the batch when the
  other axes give too few programs (``batch_splits``); the ``S`` f32 partials are summed by XLA (deterministic: no
  atomics). The output is written directly in the ``[out, in * nbp]`` layout.
* dx: grid ``(cdiv(B, bb), cdiv(in, bk))``; the program loops over the output blocks accumulating
  ``h[bb, K] += g[bb, bo] @ C[bo, K]``, then builds the derivative tile ``A'`` (same layout, from the degree
  ``k-1`` sweep) and reduces ``(A' * h)`` over the ``nbp`` bases of each input.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxgrad import pallas_backend as pb
from jaxgrad.kan.basis_tiles import Geometry, KnotTable, basis_tile, coef_flat, knot_tables, mask2, tile_dot
from jaxgrad.kan.kernel_config import (check_args, check_pos_int, contraction_width, kernel_dtypes, launch_config,
                                       launch_defaults, pipeline_stages)

__all__ = ["kan_spline_backward", "kan_spline_dcoef", "kan_spline_dx"]


# ---------------------------------------------------------------------------------------------------------------
# dcoef kernel
# ---------------------------------------------------------------------------------------------------------------
def _dcoef_kernel(x_ref, g_ref, t_ref, o_ref, *, n_batch, n_in, n_out, bb, bk, bo, per, k, nb, nbp, n_rows,
                  precision, cdt, mdt):
    split, ib, ob = (pl.program_id(a) for a in range(3))
    col_ok = (ib * bk + jnp.arange(bk)) < n_in
    out_ok = (ob * bo + jnp.arange(bo)) < n_out

    def body(step, acc):
        start = pl.multiple_of((split * per + step) * bb, bb)
        row_ok = (start + jnp.arange(bb)) < n_batch
        x = pb.masked_load(x_ref.at[pl.ds(start, bb), :], mask2(row_ok, col_ok)).astype(cdt)
        g = pb.masked_load(g_ref.at[pl.ds(start, bb), :], mask2(row_ok, out_ok)).astype(mdt)
        # Knot rows are re-read per batch block (L1/L2 hits). The mask ties the loads to the loop so that the
        # compiler cannot hoist them (hoisted, every row becomes a live [bb, bk] broadcast: hundreds of registers).
        # A batch block wholly past the end reads zero knots: all its bases are then 0 (and its g rows are 0).
        live = jnp.broadcast_to(start < n_batch, (1, bk))
        tab = KnotTable(lambda p, r: pb.masked_load(t_ref.at[pl.ds(p * n_rows + r, 1), :], live)[0])
        a = basis_tile(x, tab, nb, nbp, k).astype(mdt)  # [bb, K]
        return acc + tile_dot(g, a, precision, cdt, contract=((0,), (0,)))  # dC[bo, K] += g^T[bo, bb] @ A[bb, K]

    o_ref[...] = lax.fori_loop(0, per, body, jnp.zeros((bo, bk * nbp), cdt))


def _auto_splits(programs: int, n_bblocks: int, interpret: bool) -> int:
    """Batch splits for dcoef: enough programs to fill ~2 waves of an H100/H200 (132 SMs), each split keeping >= 8
    batch blocks. Interpret mode runs the grid serially, so it never splits."""
    if interpret or programs >= 128:
        return 1
    return max(1, min(pl.cdiv(256, programs), n_bblocks // 8))


@functools.partial(jax.jit, static_argnames=("nb", "k", "precision", "interpret", "bb", "block_k", "bo",
                                             "splits", "num_warps", "num_stages", "out_dtype"))
def _dcoef_call(x, grid, g, *, nb, k, precision, interpret, bb, block_k, bo, splits, num_warps, num_stages,
                out_dtype):
    n_batch, n_in = x.shape
    n_out = g.shape[1]
    mdt, cdt = kernel_dtypes(x, g)
    geo = Geometry(n_in, nb, k, block_k)
    n_ob = pl.cdiv(n_out, bo)
    n_bblocks = pl.cdiv(n_batch, bb)
    per = pl.cdiv(n_bblocks, splits)
    splits = pl.cdiv(n_bblocks, per)  # no empty split
    rows = splits * per * bb
    t = knot_tables(grid, cdt, k, geo.n_rows, geo.in_pad)
    kernel = functools.partial(_dcoef_kernel, n_batch=n_batch, n_in=n_in, n_out=n_out, bb=bb, bk=geo.bk, bo=bo,
                               per=per, k=k, nb=nb, nbp=geo.nbp, n_rows=geo.n_rows, precision=precision, cdt=cdt,
                               mdt=mdt)
    per_stage = bb * geo.bk * x.dtype.itemsize + bb * bo * mdt.itemsize
    part = pb.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, n_ob * bo, geo.in_pad * geo.nbp), cdt),
        grid=(splits, geo.n_kb, n_ob),
        in_specs=[
            pl.BlockSpec((rows, geo.bk), lambda s, i, o: (0, i)),
            pl.BlockSpec((rows, bo), lambda s, i, o: (0, o)),
            pl.BlockSpec(((k + 1) * geo.n_rows, geo.bk), lambda s, i, o: (0, i)),
        ],
        out_specs=pl.BlockSpec((pl.squeezed, bo, geo.kw), lambda s, i, o: (s, o, i)),
        name="kan_spline_dcoef",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=pipeline_stages(num_stages, per_stage),
    )(x, g.astype(mdt), t)
    dcoef = part.sum(0) if splits > 1 else part[0]  # [out_pad, in_pad * nbp]
    return dcoef.reshape(n_ob * bo, geo.in_pad, geo.nbp)[:n_out, :n_in, :nb].astype(out_dtype)


def _dcoef(fn, x, grid, g, k, nb, out_dtype, precision, interpret, cfg, batch_splits):
    n_batch, n_in = x.shape
    n_out = g.shape[1]
    if batch_splits is not None:
        check_pos_int(fn, "batch_splits", batch_splits, "deterministic partial sums over the batch")
    if n_batch == 0 or n_in == 0 or n_out == 0:
        return jnp.zeros((n_out, n_in, nb), out_dtype)
    interp = pb.resolve_interpret(interpret)
    bb, bo = pb.block_size(n_batch, cfg["block_b"]), pb.block_size(n_out, cfg["block_out"])
    n_bblocks = pl.cdiv(n_batch, bb)
    block_k = contraction_width(cfg, nb)
    if batch_splits is None:
        n_kb = Geometry(n_in, nb, k, block_k).n_kb
        batch_splits = _auto_splits(n_kb * pl.cdiv(n_out, bo), n_bblocks, interp)
    return _dcoef_call(x, grid, g, nb=nb, k=k, precision=precision, interpret=interp, bb=bb,
                       block_k=block_k, bo=bo, splits=min(batch_splits, n_bblocks),
                       num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages"), out_dtype=jnp.dtype(out_dtype))


def kan_spline_dcoef(
    x: jax.Array,
    grid: jax.Array,
    g: jax.Array,
    spline_order: int,
    num_bases: int,
    *,
    coef_dtype: Any = None,
    precision: Any = None,
    interpret: bool | None = None,
    block_b: int | None = None,
    block_k: int | None = None,
    block_out: int | None = None,
    batch_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_inputs: int | None = None,
) -> jax.Array:
    r""":math:`\bar c[o,i,m] = \sum_b g[b,o]\, B_m(x_{bi})`: ``[out, in, num_bases]`` in ``coef_dtype`` (default
    ``result_type(x, g)``). ``num_bases = G + k``; ``batch_splits`` (``None``: automatic) splits the batch
    reduction into deterministic f32 partials summed by XLA."""
    fn = "kan_spline_dcoef"
    check_pos_int(fn, "num_bases", num_bases, "G+k")
    out_dtype = jnp.dtype(coef_dtype) if coef_dtype is not None else None
    n_out = g.shape[-1] if getattr(g, "ndim", 0) == 2 else 0
    n_in = x.shape[-1] if getattr(x, "ndim", 0) == 2 else 0
    coef_like = jax.ShapeDtypeStruct((n_out, n_in, num_bases), out_dtype or jnp.float32)
    check_args(fn, x, grid, coef_like, spline_order, g)
    cfg = launch_config(fn, launch_defaults("dcoef", precision), block_b=block_b, block_k=block_k, block_out=block_out,
                  num_warps=num_warps, num_stages=num_stages, min_inputs=min_inputs)
    return _dcoef(fn, x, grid, g, spline_order, num_bases, out_dtype or jnp.result_type(x.dtype, g.dtype),
                  precision, interpret, cfg, batch_splits)


# ---------------------------------------------------------------------------------------------------------------
# dx kernel
# ---------------------------------------------------------------------------------------------------------------
def _dx_kernel(x_ref, g_ref, t_ref, c_ref, o_ref, *, n_batch, n_in, n_out, bb, bk, bo, n_ob, k, nb, nbp, n_rows,
               precision, cdt, mdt):
    row_ok = (pl.program_id(0) * bb + jnp.arange(bb)) < n_batch
    col_ok = (pl.program_id(1) * bk + jnp.arange(bk)) < n_in
    mask = mask2(row_ok, col_ok)

    def body(ob, h):
        start = pl.multiple_of(ob * bo, bo)
        out_ok = (start + jnp.arange(bo)) < n_out
        g = pb.masked_load(g_ref.at[:, pl.ds(start, bo)], mask2(row_ok, out_ok)).astype(mdt)
        return h + tile_dot(g, c_ref[pl.ds(start, bo), :], precision, cdt)  # h[bb, K] += g[bb, bo] @ C[bo, K]

    h = lax.fori_loop(0, n_ob, body, jnp.zeros((bb, bk * nbp), cdt))
    x = pb.masked_load(x_ref, mask).astype(cdt)
    tab = KnotTable(lambda p, r: t_ref[p * n_rows + r, :])
    d = basis_tile(x, tab, nb, nbp, k, derivative=True)  # A'[bb, K]
    pb.masked_store(o_ref, (d * h).reshape(bb, bk, nbp).sum(axis=-1), mask)  # dx[b, i] = sum_m A' h


@functools.partial(jax.jit, static_argnames=("k", "precision", "interpret", "bb", "block_k", "bo", "num_warps",
                                             "num_stages"))
def _dx_call(x, grid, coef, g, *, k, precision, interpret, bb, block_k, bo, num_warps, num_stages):
    n_batch, n_in = x.shape
    n_out, _, nb = coef.shape
    mdt, cdt = kernel_dtypes(x, coef, g)
    geo = Geometry(n_in, nb, k, block_k)
    n_ob = pl.cdiv(n_out, bo)
    t = knot_tables(grid, cdt, k, geo.n_rows, geo.in_pad)
    c = coef_flat(coef, geo.nbp, geo.in_pad, n_ob * bo, mdt)  # [out_pad, in_pad * nbp]
    kernel = functools.partial(_dx_kernel, n_batch=n_batch, n_in=n_in, n_out=n_out, bb=bb, bk=geo.bk, bo=bo,
                               n_ob=n_ob, k=k, nb=nb, nbp=geo.nbp, n_rows=geo.n_rows, precision=precision,
                               cdt=cdt, mdt=mdt)
    return pb.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_batch, n_in), x.dtype),
        grid=(pl.cdiv(n_batch, bb), geo.n_kb),
        in_specs=[
            pl.BlockSpec((bb, geo.bk), lambda b, i: (b, i)),
            pl.BlockSpec((bb, n_ob * bo), lambda b, i: (b, 0)),
            pl.BlockSpec(((k + 1) * geo.n_rows, geo.bk), lambda b, i: (0, i)),
            pl.BlockSpec((n_ob * bo, geo.kw), lambda b, i: (0, i)),
        ],
        out_specs=pl.BlockSpec((bb, geo.bk), lambda b, i: (b, i)),
        name="kan_spline_dx",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=pipeline_stages(num_stages, bb * bo * mdt.itemsize + bo * geo.kw * mdt.itemsize),
    )(x, g.astype(mdt), t, c)


def _dx(x, grid, coef, g, k, precision, interpret, cfg):
    n_batch, n_in = x.shape
    n_out, _, nb = coef.shape
    if n_batch == 0 or n_in == 0 or n_out == 0:
        return jnp.zeros((n_batch, n_in), x.dtype)
    return _dx_call(x, grid, coef, g, k=k, precision=precision, interpret=pb.resolve_interpret(interpret),
                    bb=pb.block_size(n_batch, cfg["block_b"]), block_k=contraction_width(cfg, nb),
                    bo=pb.block_size(n_out, cfg["block_out"]), num_warps=cfg["num_warps"],
                    num_stages=cfg.get("num_stages"))


def kan_spline_dx(
    x: jax.Array,
    grid: jax.Array,
    coef: jax.Array,
    g: jax.Array,
    spline_order: int,
    *,
    precision: Any = None,
    interpret: bool | None = None,
    block_b: int | None = None,
    block_k: int | None = None,
    block_out: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_inputs: int | None = None,
) -> jax.Array:
    r""":math:`\bar x[b,i] = \sum_m B'_m(x_{bi}) \sum_o g[b,o]\, c[o,i,m]`: ``[B, in]`` in ``x.dtype``."""
    fn = "kan_spline_dx"
    check_args(fn, x, grid, coef, spline_order, g)
    cfg = launch_config(fn, launch_defaults("dx", precision), block_b=block_b, block_k=block_k, block_out=block_out,
                  num_warps=num_warps, num_stages=num_stages, min_inputs=min_inputs)
    return _dx(x, grid, coef, g, spline_order, precision, interpret, cfg)


# ---------------------------------------------------------------------------------------------------------------
# Backward: both kernels
# ---------------------------------------------------------------------------------------------------------------
def kan_spline_backward(
    x: jax.Array,
    grid: jax.Array,
    coef: jax.Array,
    g: jax.Array,
    spline_order: int,
    *,
    precision: Any = None,
    interpret: bool | None = None,
    dcoef_config: dict | None = None,
    dx_config: dict | None = None,
    batch_splits: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""VJP of :func:`kan_spline_forward` for the cotangent ``g[B, out]``: ``(dx[B, in], dcoef[out, in, G+k])``.

    .. math::

        \bar x[b,i] = \sum_o g[b,o] \sum_m c[o,i,m]\, B'_m(x_{bi}), \qquad
        \bar c[o,i,m] = \sum_b g[b,o]\, B_m(x_{bi})

    Runs the dcoef kernel (batch reduction inside each program, or ``batch_splits`` f32 partials summed by XLA:
    deterministic) and the dx kernel. ``dcoef_config`` / ``dx_config`` override entries of
    :data:`DCOEF_DEFAULTS` / :data:`DX_DEFAULTS` (``block_b``, ``block_k``, ``block_out``, ``num_warps``,
    ``num_stages``, ``min_inputs``), or of :data:`EXACT_F32_DEFAULTS` when ``precision`` asks for exact-f32
    dots. ``dx`` is in ``x.dtype``, ``dcoef`` in ``coef.dtype``; the dots run in ``result_type(x, coef, g)``.
    """
    fn = "kan_spline_backward"
    check_args(fn, x, grid, coef, spline_order, g)
    configs = []
    for name, defaults, given in (("dcoef_config", launch_defaults("dcoef", precision), dcoef_config),
                                  ("dx_config", launch_defaults("dx", precision), dx_config)):
        given = dict(given or {})
        unknown = set(given) - set(defaults)
        if unknown:
            raise ValueError(f"{fn}: '{name}' has unknown keys {sorted(unknown)}; allowed: {sorted(defaults)}")
        configs.append(launch_config(fn, defaults, **given))
    mdt, _ = kernel_dtypes(x, coef, g)
    dcoef = _dcoef(fn, x, grid, g.astype(mdt), spline_order, coef.shape[2], coef.dtype, precision, interpret,
                   configs[0], batch_splits)
    dx = _dx(x, grid, coef, g, spline_order, precision, interpret, configs[1])
    return dx, dcoef
