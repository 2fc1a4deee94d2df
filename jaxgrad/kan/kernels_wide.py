"""PROTOTYPE (session 4): KAN spline kernels whose dots contract over the flattened (input, basis) pair.

The bases of a ``[bb, bk]`` tile of ``x`` are swept as in :mod:`jaxgrad.kan.kernels`, zero-padded to ``nbp``
(the next power of two of ``NB``), interleaved by a tree of two-way stacks into ``[bb, bk, nbp]`` and reshaped to
``[bb, bk * nbp]``: column ``i * nbp + m`` holds ``B_m(x_{b,i})``, which is the row-major flattening of
efficient-kan's ``spline_weight[out, in, NB]`` (padded). So every dot has ``K = bk * nbp`` (128 at bk=16, NB=8).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxgrad import pallas_backend as pb
from jaxgrad.kan.kernels import _dot, _dtypes, _knot_tables, _KnotTable, _mask2, _pad_to, _sweep


def _interleave(tiles):
    """``[bb, bk]`` tiles ``T_0 .. T_{n-1}`` (n a power of two) -> ``[bb, bk * n]`` with column ``i*n + m`` =
    ``T_m[:, i]``, built from two-way stacks only (the Triton lowering joins two tensors along a new last axis).
    Pairing ``T_j`` with ``T_{j + n/2}`` first puts the most significant bit of ``m`` on the first new axis."""
    bb, bk = tiles[0].shape
    n = len(tiles)
    level = list(tiles)
    while len(level) > 1:
        half = len(level) // 2
        level = [jnp.stack([level[j], level[j + half]], axis=-1) for j in range(half)]
    return level[0].reshape(bb, bk * n) if n > 1 else level[0]


def _basis_tile(x, tab, nb, nbp, k, *, derivative=False):
    """``[bb, bk * nbp]`` tile of ``B_m(x)`` (or ``B'_m(x)``), zero for ``m >= nb``."""
    tiles = []
    if not derivative:
        for _, b in _sweep(x, tab, nb + k, k):
            tiles.append(b)
    else:
        prev = None
        for s, low in _sweep(x, tab, nb + k, k - 1):  # B^{k-1}_s, s = 0 .. nb
            if s > 0:  # B'_{s-1} = k [B^{k-1}_{s-1} / w_{k,s-1} - B^{k-1}_s / w_{k,s}]
                tiles.append(k * (prev * tab.inv(k, s - 1) - low * tab.inv(k, s)))
            prev = low
    zero = jnp.zeros_like(x)
    tiles += [zero] * (nbp - nb)
    return _interleave(tiles)


def _coef_flat(coef, nbp, in_pad, out_pad, mdt):
    """``coef[out, in, NB]`` -> ``[out_pad, in_pad * nbp]`` (zero padded)."""
    n_out, n_in, nb = coef.shape
    c = _pad_to(coef.astype(mdt), (out_pad, in_pad, nbp))
    return c.reshape(out_pad, in_pad * nbp)


def _fwd_kernel(x_ref, t_ref, c_ref, y_ref, *, n_batch, n_in, bb, bk, n_kb, k, nb, nbp, n_rows, precision, cdt,
                mdt, bases_second, ablate=None):
    row_ok = (pl.program_id(0) * bb + jnp.arange(bb)) < n_batch
    kw = bk * nbp

    def body(kb, acc):
        start = pl.multiple_of(kb * bk, bk)
        col_ok = (start + jnp.arange(bk)) < n_in
        x = pb.masked_load(x_ref.at[:, pl.ds(start, bk)], _mask2(row_ok, col_ok)).astype(cdt)
        tab = _KnotTable(lambda p, r: t_ref[p * n_rows + r, pl.ds(start, bk)])
        if ablate == "no_basis":  # layout + dot only: the x tile repeated nbp times
            a = _interleave([x * (m + 1) for m in range(nbp)]).astype(mdt)
        else:
            a = _basis_tile(x, tab, nb, nbp, k).astype(mdt)  # [bb, K]
        if ablate == "no_dot":  # basis + layout only
            s = jnp.sum(a.astype(cdt), axis=1)
            return acc + (s[None, :] if bases_second else s[:, None])
        w = c_ref[:, pl.ds(pl.multiple_of(kb * kw, kw), kw)]  # [bo, K]
        if bases_second:  # y^T[bo, bb] += W[bo, K] @ A^T[K, bb]
            return acc + _dot(w, a, precision, cdt, contract=((1,), (1,)))
        return acc + _dot(a, w, precision, cdt, contract=((1,), (1,)))  # y[bb, bo] += A @ W^T

    bo = c_ref.shape[0]
    acc = lax.fori_loop(0, n_kb, body, jnp.zeros((bo, bb) if bases_second else (bb, bo), cdt))
    y = acc.T if bases_second else acc
    pb.masked_store(y_ref, y, jnp.broadcast_to(row_ok[:, None], y.shape))


@functools.partial(jax.jit, static_argnames=("k", "precision", "interpret", "bb", "bk", "bo", "num_warps",
                                             "num_stages", "bases_second", "ablate"))
def forward(x, grid, coef, *, k, precision=None, interpret=None, bb=64, bk=16, bo=128, num_warps=8, num_stages=2,
            bases_second=False, ablate=None):
    n_batch, n_in = x.shape
    n_out, _, nb = coef.shape
    nbp = pl.next_power_of_2(nb)
    mdt, cdt = _dtypes(x, coef)
    bb, bk, bo = pb.block_size(n_batch, bb), pb.block_size(n_in, bk), pb.block_size(n_out, bo)
    n_kb, n_ob = pl.cdiv(n_in, bk), pl.cdiv(n_out, bo)
    in_pad, out_pad = n_kb * bk, n_ob * bo
    n_rows = nb + k + 1
    t = _knot_tables(grid, cdt, k, n_rows, in_pad)
    c = _coef_flat(coef, nbp, in_pad, out_pad, mdt)
    kernel = functools.partial(_fwd_kernel, n_batch=n_batch, n_in=n_in, bb=bb, bk=bk, n_kb=n_kb, k=k, nb=nb,
                               nbp=nbp, n_rows=n_rows, precision=precision, cdt=cdt, mdt=mdt,
                               bases_second=bases_second, ablate=ablate)
    y = pb.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_batch, out_pad), x.dtype),
        grid=(pl.cdiv(n_batch, bb), n_ob),
        in_specs=[
            pl.BlockSpec((bb, in_pad), lambda b, o: (b, 0)),
            pl.BlockSpec(((k + 1) * n_rows, in_pad), lambda b, o: (0, 0)),
            pl.BlockSpec((bo, in_pad * nbp), lambda b, o: (o, 0)),
        ],
        out_specs=pl.BlockSpec((bb, bo), lambda b, o: (b, o)),
        name="kan_spline_fwd_wide",
        interpret=pb.resolve_interpret(interpret),
        num_warps=num_warps,
        num_stages=num_stages,
    )(x, t, c)
    return y[:, :n_out]


def _dcoef_kernel(x_ref, g_ref, t_ref, o_ref, *, n_batch, n_in, n_out, bb, bk, bo, per, k, nb, nbp, n_rows,
                  precision, cdt, mdt, bases_second):
    split, ib, ob = (pl.program_id(a) for a in range(3))
    col_ok = (ib * bk + jnp.arange(bk)) < n_in
    out_ok = (ob * bo + jnp.arange(bo)) < n_out

    def body(step, acc):
        start = pl.multiple_of((split * per + step) * bb, bb)
        row_ok = (start + jnp.arange(bb)) < n_batch
        x = pb.masked_load(x_ref.at[pl.ds(start, bb), :], _mask2(row_ok, col_ok)).astype(cdt)
        g = pb.masked_load(g_ref.at[pl.ds(start, bb), :], _mask2(row_ok, out_ok)).astype(mdt)
        live = jnp.broadcast_to(start < n_batch, (1, bk))
        tab = _KnotTable(lambda p, r: pb.masked_load(t_ref.at[pl.ds(p * n_rows + r, 1), :], live)[0])
        a = _basis_tile(x, tab, nb, nbp, k).astype(mdt)  # [bb, K]
        if bases_second:  # dC[bo, K] += g^T[bo, bb] @ A[bb, K]
            return acc + _dot(g, a, precision, cdt, contract=((0,), (0,)))
        return acc + _dot(a, g, precision, cdt, contract=((0,), (0,)))  # dC^T[K, bo] += A^T @ g

    kw = bk * nbp
    acc = lax.fori_loop(0, per, body, jnp.zeros((bo, kw) if bases_second else (kw, bo), cdt))
    o_ref[...] = acc.T if not bases_second else acc


@functools.partial(jax.jit, static_argnames=("k", "nb", "precision", "interpret", "bb", "bk", "bo", "splits",
                                             "num_warps", "num_stages", "bases_second"))
def dcoef(x, grid, g, *, k, nb, precision=None, interpret=None, bb=64, bk=16, bo=128, splits=1, num_warps=8,
          num_stages=2, bases_second=True):
    n_batch, n_in = x.shape
    n_out = g.shape[1]
    nbp = pl.next_power_of_2(nb)
    mdt, cdt = _dtypes(x, g)
    bb, bk, bo = pb.block_size(n_batch, bb), pb.block_size(n_in, bk), pb.block_size(n_out, bo)
    n_ib, n_ob = pl.cdiv(n_in, bk), pl.cdiv(n_out, bo)
    in_pad, out_pad = n_ib * bk, n_ob * bo
    n_bblocks = pl.cdiv(n_batch, bb)
    per = pl.cdiv(n_bblocks, splits)
    splits = pl.cdiv(n_bblocks, per)
    rows = splits * per * bb
    n_rows = nb + k + 1
    t = _knot_tables(grid, cdt, k, n_rows, in_pad)
    kw = bk * nbp
    kernel = functools.partial(_dcoef_kernel, n_batch=n_batch, n_in=n_in, n_out=n_out, bb=bb, bk=bk, bo=bo,
                               per=per, k=k, nb=nb, nbp=nbp, n_rows=n_rows, precision=precision, cdt=cdt, mdt=mdt,
                               bases_second=bases_second)
    part = pb.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, out_pad, in_pad * nbp), cdt),
        grid=(splits, n_ib, n_ob),
        in_specs=[
            pl.BlockSpec((rows, bk), lambda s, i, o: (0, i)),
            pl.BlockSpec((rows, bo), lambda s, i, o: (0, o)),
            pl.BlockSpec(((k + 1) * n_rows, bk), lambda s, i, o: (0, i)),
        ],
        out_specs=pl.BlockSpec((pl.squeezed, bo, kw), lambda s, i, o: (s, o, i)),
        name="kan_spline_dcoef_wide",
        interpret=pb.resolve_interpret(interpret),
        num_warps=num_warps,
        num_stages=num_stages,
    )(x, g.astype(mdt), t)
    d = part.sum(0) if splits > 1 else part[0]
    return d.reshape(out_pad, in_pad, nbp)[:n_out, :n_in, :nb]


def _dx_kernel(x_ref, g_ref, t_ref, c_ref, o_ref, *, n_batch, n_in, n_out, bb, bk, bo, n_ob, k, nb, nbp, n_rows,
               precision, cdt, mdt):
    row_ok = (pl.program_id(0) * bb + jnp.arange(bb)) < n_batch
    col_ok = (pl.program_id(1) * bk + jnp.arange(bk)) < n_in
    mask = _mask2(row_ok, col_ok)

    def body(ob, h):
        start = pl.multiple_of(ob * bo, bo)
        out_ok = (start + jnp.arange(bo)) < n_out
        g = pb.masked_load(g_ref.at[:, pl.ds(start, bo)], _mask2(row_ok, out_ok)).astype(mdt)
        return h + _dot(g, c_ref[pl.ds(start, bo), :], precision, cdt)  # h[bb, K] += g[bb, bo] @ C[bo, K]

    h = lax.fori_loop(0, n_ob, body, jnp.zeros((bb, bk * nbp), cdt))
    x = pb.masked_load(x_ref, mask).astype(cdt)
    tab = _KnotTable(lambda p, r: t_ref[p * n_rows + r, :])
    d = _basis_tile(x, tab, nb, nbp, k, derivative=True)  # [bb, K]
    dx = (d * h).reshape(bb, bk, nbp).sum(axis=-1)
    pb.masked_store(o_ref, dx, mask)


@functools.partial(jax.jit, static_argnames=("k", "precision", "interpret", "bb", "bk", "bo", "num_warps",
                                             "num_stages"))
def dx(x, grid, coef, g, *, k, precision=None, interpret=None, bb=64, bk=16, bo=64, num_warps=8, num_stages=2):
    n_batch, n_in = x.shape
    n_out, _, nb = coef.shape
    nbp = pl.next_power_of_2(nb)
    mdt, cdt = _dtypes(x, coef, g)
    bb, bk, bo = pb.block_size(n_batch, bb), pb.block_size(n_in, bk), pb.block_size(n_out, bo)
    n_ib, n_ob = pl.cdiv(n_in, bk), pl.cdiv(n_out, bo)
    in_pad, out_pad = n_ib * bk, n_ob * bo
    n_rows = nb + k + 1
    t = _knot_tables(grid, cdt, k, n_rows, in_pad)
    c = _coef_flat(coef, nbp, in_pad, out_pad, mdt)  # [out_pad, in_pad * nbp]
    kernel = functools.partial(_dx_kernel, n_batch=n_batch, n_in=n_in, n_out=n_out, bb=bb, bk=bk, bo=bo, n_ob=n_ob,
                               k=k, nb=nb, nbp=nbp, n_rows=n_rows, precision=precision, cdt=cdt, mdt=mdt)
    return pb.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_batch, n_in), x.dtype),
        grid=(pl.cdiv(n_batch, bb), n_ib),
        in_specs=[
            pl.BlockSpec((bb, bk), lambda b, i: (b, i)),
            pl.BlockSpec((bb, out_pad), lambda b, i: (b, 0)),
            pl.BlockSpec(((k + 1) * n_rows, bk), lambda b, i: (0, i)),
            pl.BlockSpec((out_pad, bk * nbp), lambda b, i: (0, i)),
        ],
        out_specs=pl.BlockSpec((bb, bk), lambda b, i: (b, i)),
        name="kan_spline_dx_wide",
        interpret=pb.resolve_interpret(interpret),
        num_warps=num_warps,
        num_stages=num_stages,
    )(x, g.astype(mdt), t, c)
