r"""The column maxima of a KAN layer's bases over the batch, in one Pallas kernel: the row scales of the float16
weight-gradient products (:mod:`jaxgrad.kan.dcoef_mgpu`, :mod:`jaxgrad.kan.dcoef_wide_mgpu`),

.. math::

    M_{mi} = \max_b |A^{(m)}_{bi}|, \qquad A^{(m)}_{bi} = B_m(x_{bi})\ (m < NB), \quad
    A^{(NB)}_{bi} = \operatorname{silu}(x_{bi}).

:func:`jaxgrad.kan.dcoef_mgpu.left_maxima` computes the same in XLA, 2048 batch rows at a time, which evaluates every
basis per entry (:func:`jaxgrad.kan.spline.bspline_basis_elementwise`) and runs one reduction per chunk. Here each
program owns ``bk`` inputs and a chunk of the batch, walks it ``bb`` rows at a time with the diagonal Cox-de Boor
sweep (:func:`jaxgrad.kan.basis_tiles.sweep`: :math:`O(k)` operations per basis, relative rounding, so a column of
tails keeps its magnitude), and keeps one running ``[bb, bk]`` maximum per basis, elementwise (no reduction across
threads in the loop); its rows are reduced once at the end, and XLA takes the maximum over the chunks.
Rows past the batch count as 0 (no basis is negative, so 0 never raises a maximum).

The sweep multiplies by reciprocal knot widths where the XLA form divides: per degree a basis value takes at most 5
roundings in either form (difference, reciprocal or quotient, products, sum), each relative to a sum of
non-negative terms, so the two agree to :math:`10 k u` relative (:math:`u = 2^{-24}` in float32), and SiLU to a
few ulps of two ``exp`` implementations (the tests allow :math:`(10k + 8) u`). The scales derived from them
(:func:`jaxgrad.kan.fp16_scaled.scale_exponents`) are powers of two whose choice only needs the magnitude.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxgrad import pallas_backend as pb
from jaxgrad.kan.basis_tiles import KnotTable, interleave, knot_tables, mask2, sweep

__all__ = ["bspline_basis_maxima", "tile_shape"]


def _kernel(x_ref, t_ref, o_ref, *, n_batch, n_in, bb, bk, steps, k, nb, nbp, n_rows):
    start = pl.program_id(0) * bk
    chunk0 = pl.program_id(1) * steps * bb
    col_ok = (start + jnp.arange(bk)) < n_in
    tab = KnotTable(lambda p, r: t_ref[p * n_rows + r, :])

    def body(j, maxima):
        row_ok = (chunk0 + j * bb + jnp.arange(bb)) < n_batch
        ok = mask2(row_ok, col_ok)
        x = pb.masked_load(x_ref.at[pl.ds(pl.multiple_of(j * bb, bb), bb), :], ok)
        out = list(maxima)
        # each basis is folded into its running maximum as the sweep makes it: only the sweep's k + 1 working tiles
        # and the maxima are live, whatever G
        for m, basis in sweep(x, tab, nb + k, k):
            out[m] = jnp.maximum(out[m], jnp.where(ok, jnp.abs(basis), 0.0))
        out[nb] = jnp.maximum(out[nb], jnp.where(ok, jnp.abs(x * jax.nn.sigmoid(x)), 0.0))
        return tuple(out)

    # elementwise running maxima of whole [bb, bk] tiles: the rows are reduced once, after the walk
    maxima = lax.fori_loop(0, steps, body, tuple(jnp.zeros((bb, bk), x_ref.dtype) for _ in range(nb + 1)))
    tiles = [jnp.max(m, axis=0)[None, :] for m in maxima] + [jnp.zeros((1, bk), x_ref.dtype)] * (nbp - nb - 1)
    o_ref[...] = interleave(tiles)  # [1, bk * nbp]: column i * nbp + m is basis m's maximum at input i


@functools.partial(jax.jit, static_argnames=("k", "bb", "bk", "steps", "interpret"))
def _call(x, grid, *, k, bb, bk, steps, interpret):
    n_batch, n_in = x.shape
    nb = grid.shape[-1] - k - 1
    nbp = pl.next_power_of_2(nb + 1)
    n_rows = nb + k + 1
    in_pad = pl.cdiv(n_in, bk) * bk
    n_chunks = pl.cdiv(n_batch, steps * bb)
    t = knot_tables(grid, x.dtype, k, n_rows, in_pad)
    kernel = functools.partial(_kernel, n_batch=n_batch, n_in=n_in, bb=bb, bk=bk, steps=steps, k=k, nb=nb,
                               nbp=nbp, n_rows=n_rows)
    out = pb.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_chunks, in_pad * nbp), x.dtype),
        grid=(in_pad // bk, n_chunks),
        in_specs=[pl.BlockSpec((steps * bb, bk), lambda i, c: (c, i)),
                  pl.BlockSpec(((k + 1) * n_rows, bk), lambda i, c: (0, i))],
        out_specs=pl.BlockSpec((1, bk * nbp), lambda i, c: (c, i)),
        name="kan_basis_maxima",
        interpret=interpret,
    )(x, t)
    return jnp.max(out.reshape(n_chunks, in_pad, nbp), axis=0)[:n_in, :nb + 1].T


def tile_shape(n_values: int) -> tuple[int, int]:
    """``(block_b, block_in)`` for ``n_values`` running maxima (``G + k + 1``): ``[16, 32]`` tiles (4 values a thread
    of 4 warps, 4 registers a maximum) up to 16 maxima, ``[16, 16]`` beyond, so that the maxima stay near 64
    registers a thread."""
    return (16, 32) if n_values <= 16 else (16, 16)


def bspline_basis_maxima(x, grid, spline_order: int, *, block_b: int | None = None, block_in: int | None = None,
                         chunks: int | None = None, interpret: bool | None = None):
    """``max_b |A^{(m)}_{bi}|`` ``[NB+1, in]`` (module doc), as :func:`jaxgrad.kan.dcoef_mgpu.left_maxima` returns it.

    Args:
      x: ``[B, in]`` float32 or float64 (interpret mode).
      grid: ``[in, G + 2k + 1]`` knots (non-decreasing rows).
      spline_order: ``k``.
      block_b, block_in: the rows and inputs of a sweep's tile (powers of two >= 16; default :func:`tile_shape`).
      chunks: how many parts the batch is cut into, each a program's own walk (default: enough that the programs
        fill an H100's 132 SMs twice over).
      interpret: as :func:`jaxgrad.pallas_backend.resolve_interpret`.
    """
    if x.ndim != 2 or grid.ndim != 2 or grid.shape[0] != x.shape[1]:
        raise ValueError(f"bspline_basis_maxima: needs x [B, in] and grid [in, knots], got {x.shape}, {grid.shape}")
    k = int(spline_order)
    if not 0 <= k <= grid.shape[-1] - 2:
        raise ValueError(f"bspline_basis_maxima: spline_order must be in [0, {grid.shape[-1] - 2}], got {k}")
    default_b, default_in = tile_shape(grid.shape[-1] - k)
    block_b, block_in = block_b or default_b, block_in or default_in
    for name, v in (("block_b", block_b), ("block_in", block_in)):
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"bspline_basis_maxima: '{name}' must be a power of two >= 16, got {v}")
    n_batch, n_in = x.shape
    if n_batch == 0:
        return jnp.zeros((grid.shape[-1] - k, n_in), x.dtype)
    bb = pb.block_size(n_batch, block_b)
    bk = pb.block_size(n_in, block_in)
    blocks = pl.cdiv(n_batch, bb)
    if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"bspline_basis_maxima: 'chunks' must be a positive int or None, got {chunks!r}")
    if chunks is None:
        chunks = max(1, -(-264 // pl.cdiv(n_in, bk)))
    steps = pl.next_power_of_2(pl.cdiv(blocks, min(int(chunks), blocks)))  # a block's rows: a power of two
    return _call(x, grid.astype(x.dtype), k=k, bb=bb, bk=bk, steps=steps, interpret=pb.resolve_interpret(interpret))
