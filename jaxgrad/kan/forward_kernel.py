r"""The forward kernel of a KAN layer's spline part (:mod:`jaxgrad.kan.kernels`),
:math:`y[b, o] = \sum_i \sum_m B_m(x_{bi})\, c[o, i, m]`, without the ``[B, in, G+k]`` basis tensor in HBM.

Grid ``(cdiv(B, bb), cdiv(out, bo))``; each program loops over the input blocks (``fori_loop``),
builds the basis tile and accumulates ``y^T[bo, bb] += C[bo, K] @ A^T[K, bb]``. The bases are the dot's second
operand, which Hopper's ``wgmma`` reads from shared memory (measured faster than the other orientation). They
are recomputed once per output block: ``bo`` trades accumulator registers against that recomputation.
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
from jaxgrad.kan.kernel_config import (check_args, contraction_width, kernel_dtypes, launch_config, launch_defaults,
                                       pipeline_stages)

__all__ = ["kan_spline_forward"]


def _fwd_kernel(x_ref, t_ref, c_ref, y_ref, *, n_batch, n_in, n_out, bb, bk, n_kb, k, nb, nbp, n_rows, precision,
                cdt, mdt):
    row_ok = (pl.program_id(0) * bb + jnp.arange(bb)) < n_batch
    kw = bk * nbp

    def body(kb, acc):
        start = pl.multiple_of(kb * bk, bk)
        col_ok = (start + jnp.arange(bk)) < n_in
        x = pb.masked_load(x_ref.at[:, pl.ds(start, bk)], mask2(row_ok, col_ok)).astype(cdt)
        tab = KnotTable(lambda p, r: t_ref[p * n_rows + r, pl.ds(start, bk)])  # depends on kb: not hoisted
        a = basis_tile(x, tab, nb, nbp, k).astype(mdt)  # [bb, K]
        c = c_ref[:, pl.ds(pl.multiple_of(kb * kw, kw), kw)]  # [bo, K]
        return acc + tile_dot(c, a, precision, cdt, contract=((1,), (1,)))  # y^T[bo, bb] += C[bo, K] @ A^T[K, bb]

    acc = lax.fori_loop(0, n_kb, body, jnp.zeros((c_ref.shape[0], bb), cdt))
    pb.masked_store(y_ref, acc.T, pb.block_mask(y_ref.shape, (n_batch, n_out)))


@functools.partial(jax.jit, static_argnames=("k", "precision", "interpret", "bb", "block_k", "bo", "num_warps",
                                             "num_stages"))
def _fwd_call(x, grid, coef, *, k, precision, interpret, bb, block_k, bo, num_warps, num_stages):
    n_batch, n_in = x.shape
    n_out, _, nb = coef.shape
    mdt, cdt = kernel_dtypes(x, coef)
    geo = Geometry(n_in, nb, k, block_k)
    n_ob = pl.cdiv(n_out, bo)
    t = knot_tables(grid, cdt, k, geo.n_rows, geo.in_pad)  # [(k+1) n_rows, in_pad]
    c = coef_flat(coef, geo.nbp, geo.in_pad, n_ob * bo, mdt)  # [out_pad, in_pad * nbp]
    kernel = functools.partial(_fwd_kernel, n_batch=n_batch, n_in=n_in, n_out=n_out, bb=bb, bk=geo.bk,
                               n_kb=geo.n_kb, k=k, nb=nb, nbp=geo.nbp, n_rows=geo.n_rows, precision=precision,
                               cdt=cdt, mdt=mdt)
    return pb.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_batch, n_out), x.dtype),
        grid=(pl.cdiv(n_batch, bb), n_ob),
        in_specs=[
            pl.BlockSpec((bb, geo.in_pad), lambda b, o: (b, 0)),
            pl.BlockSpec(((k + 1) * geo.n_rows, geo.in_pad), lambda b, o: (0, 0)),
            pl.BlockSpec((bo, geo.in_pad * geo.nbp), lambda b, o: (o, 0)),
        ],
        out_specs=pl.BlockSpec((bb, bo), lambda b, o: (b, o)),
        name="kan_spline_fwd",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=pipeline_stages(num_stages, bo * geo.kw * mdt.itemsize),
    )(x, t, c)


def kan_spline_forward(
    x: jax.Array,
    grid: jax.Array,
    coef: jax.Array,
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
    r"""Spline part of a KAN layer, :math:`y[b,o] = \sum_i \sum_m B_m(x_{bi})\, c[o,i,m]`, in one fused kernel.

    Args:
      x: ``[B, in]`` inputs (bf16, f32 or f64).
      grid: ``[in, G+2k+1]`` non-decreasing knot rows (any float dtype; used in ``promote(x, coef, f32)``).
      coef: ``[out, in, G+k]`` coefficients (efficient-kan layout; fold ``spline_scaler`` in first).
      spline_order: the degree ``k`` (3 = cubic).
      precision: ``None`` (platform default: TF32 for f32 on the GPU), ``jax.lax.Precision.HIGHEST`` (IEEE f32)
        or ``jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3`` (3-pass TF32).
      interpret: ``None`` picks interpret mode off the GPU (see :mod:`jaxgrad.pallas_backend`); ``True`` forces it
        (CPU tests, float64; slow, and meant for small sizes: on a GPU the float64 reference is the thing to use).
      block_b, block_out: batch and output tile upper bounds (powers of two >= 16); block_k: contraction width
        ``bk * nbp`` of each dot (power of two >= 16), see the module docstring.
      num_warps, num_stages: Triton launch parameters (ignored in interpret mode).
      min_inputs: the contraction widens to ``min_inputs * nbp`` when ``block_k`` would hold fewer inputs.
        Every launch argument left ``None`` comes from :data:`FWD_DEFAULTS`, or from :data:`EXACT_F32_DEFAULTS` when
        ``precision`` asks for exact-f32 dots.
    Returns:
      ``y[B, out]`` in ``x.dtype``. The ``[B, in, G+k]`` basis is never materialised.
    """
    fn = "kan_spline_forward"
    n_batch, n_in, n_out, _ = check_args(fn, x, grid, coef, spline_order)
    cfg = launch_config(fn, launch_defaults("fwd", precision), block_b=block_b, block_k=block_k, block_out=block_out,
                  num_warps=num_warps, num_stages=num_stages, min_inputs=min_inputs)
    if n_batch == 0 or n_out == 0 or n_in == 0:
        return jnp.zeros((n_batch, n_out), x.dtype)
    return _fwd_call(
        x, grid, coef, k=spline_order, precision=precision, interpret=pb.resolve_interpret(interpret),
        bb=pb.block_size(n_batch, cfg["block_b"]), block_k=contraction_width(cfg, coef.shape[2]),
        bo=pb.block_size(n_out, cfg["block_out"]), num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages"))
