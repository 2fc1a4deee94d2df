r"""Fused Pallas kernels for the spline part of a KAN layer: forward, coefficient gradient and input gradient.

Notation: ``x[B, in]``, knots ``grid[in, G+2k+1]`` (one non-decreasing row per input; uniform or not),
coefficients ``coef[out, in, G+k]`` (efficient-kan's ``spline_weight`` layout, scaler already folded in),
``k = spline_order`` (the degree), ``NB = G + k`` bases per input, :math:`B_m` the Cox-de Boor bases of
:mod:`jaxgrad.kan.spline` and :math:`B'_m` their derivative.

.. math::

    y[b, o] &= \sum_i \sum_m B_m(x_{bi})\, c[o, i, m]                                     && \text{(forward)} \\
    \bar c[o, i, m] &= \sum_b \bar y[b, o]\, B_m(x_{bi})                                  && \text{(dcoef)} \\
    \bar x[b, i] &= \sum_m B'_m(x_{bi}) \sum_o \bar y[b, o]\, c[o, i, m]                  && \text{(dx)} \\
    B'^{\,k}_m &= k \left[\frac{B^{k-1}_m}{t_{m+k} - t_m}
                 - \frac{B^{k-1}_{m+1}}{t_{m+k+1} - t_{m+1}}\right]

(a zero-width knot interval contributes 0 instead of dividing by zero, as in :mod:`jaxgrad.kan.spline`).

**No basis tensor in HBM.** Every kernel evaluates the bases of its ``[bb, bk]`` tile of ``x`` in registers and
feeds them straight to the matrix units; the ``[B, in, NB]`` tensor that autodiff would tape is never written.

**Basis evaluation: a diagonal Cox-de Boor sweep.** With knot rows :math:`t_r` (``[bk]`` vectors, one value per
input column) the kernel walks the degree-0 intervals :math:`r = 0, 1, \dots` in order. At step :math:`r` it forms
the indicator :math:`B^0_r = [t_r \le x < t_{r+1}]` and then, for :math:`p = 1..k`, the single new value
:math:`B^p_{r-p}` from :math:`B^{p-1}_{r-p}` (kept from step :math:`r-1`) and :math:`B^{p-1}_{r-p+1}` (just made):

.. math::

    B^p_j = (x - t_j)\,w^{-1}_{p,j}\, B^{p-1}_j + (t_{j+p+1} - x)\,w^{-1}_{p,j+1}\, B^{p-1}_{j+1},
    \qquad w^{-1}_{p,j} = \begin{cases} 1/(t_{j+p} - t_j) & t_{j+p} > t_j \\ 0 & \text{otherwise} \end{cases}

so :math:`B^k_{r-k}` is complete after step :math:`r` and is consumed (one ``dot``) at once. The cost is
:math:`O(k)` elementwise ops per basis and only :math:`k+1` live ``[bb, bk]`` arrays, independent of ``G``. The
reciprocal widths :math:`w^{-1}` are ``[bk]`` vectors computed once per input block. Arithmetic is identical to
the plain-JAX reference up to the rounding of ``a * (1/w)`` vs ``a / w``.

**Kernels** (``bb, bk, bo``: batch, input and output block sizes; powers of two >= 16, since Triton needs
power-of-two arrays and ``tl.dot`` needs every dimension >= 16; clipped to the problem size):

* forward ``y``: grid ``(cdiv(B, bb), cdiv(out, bo))``; each program loops over the input blocks
  (``fori_loop``), sweeps the ``NB`` bases of its ``[bb, bk]`` tile and accumulates
  ``acc[bb, bo] += B_m[bb, bk] @ c_m[bk, bo]`` with ``c_m`` a tile of the wrapper's ``coef`` re-arranged as
  ``[NB, in, out]``. Bases are recomputed once per output block, so ``bo`` trades registers (the accumulator)
  against recomputation.
* dcoef: grid ``(S, cdiv(in, bk), cdiv(out, bo), cdiv(NB, bm))``; each program owns ``bm`` bases
  ``m0 .. m0+bm-1`` of an ``[bk, bo]`` coefficient tile (``bm`` accumulators ``[bk, bo]``), loops over its share
  of the batch blocks and adds ``B_m^T[bk, bb] @ g[bb, bo]``. The sweep for a chunk starts at interval ``m0`` and
  runs ``bm + k`` steps. ``S`` splits the batch when the other axes give too few programs; the ``S`` f32 partials
  are summed by XLA (deterministic: no atomics).
* dx: grid ``(cdiv(B, bb), cdiv(in, bk))``; for each chunk of ``bm`` bases (static loop) the program loops over
  the output blocks accumulating ``h_m[bb, bk] += g[bb, bo] @ c_m^T[bo, bk]`` (``coef`` re-arranged as
  ``[NB, out, in]``), then sweeps the degree ``k-1`` bases once and adds ``B'_m * h_m``. ``bm`` bounds the
  register file use (``bm`` accumulators ``[bb, bk]``).

**Edges.** Batch rows and input/output columns beyond the array are masked on load (read as 0) and on store.
``coef`` is re-arranged and zero-padded to whole blocks in the wrapper (parameters only: cheap), so a padded input
column or output column contributes exactly 0; padded knot columns are 0 (every basis there is 0) and padded knot
rows (the last chunk of ``bm`` bases) repeat the last knot (zero-width intervals: bases 0).

**Dtypes and precision.** ``mdt = result_type(x, coef[, g])`` is the matrix-unit operand dtype and
``cdt = promote_types(mdt, float32)`` the dtype of the bases, knots and accumulators: f32 for bf16/f32, f64 for
f64 (interpret mode; the verifier's re-run). For bf16 the bases are evaluated in f32 and rounded to bf16 only as a
``dot`` operand; accumulation is f32. ``precision`` is passed to every in-kernel ``dot``: ``None`` is the platform
default (TF32 for f32 on the GPU), ``jax.lax.Precision.HIGHEST`` gives IEEE f32. Outputs: ``y`` and ``dx`` in
``x.dtype``, ``dcoef`` in ``coef.dtype``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxgrad import pallas_backend as pb
from jaxgrad.kan.spline import bspline_basis, bspline_basis_derivative

__all__ = [
    "kan_spline_backward",
    "kan_spline_backward_reference",
    "kan_spline_dcoef",
    "kan_spline_dx",
    "kan_spline_forward",
    "kan_spline_forward_reference",
]

# Default block sizes (upper bounds; each is clipped to next_power_of_2(dim), floor 16). Register budget at
# num_warps=4 (128 threads), f32: forward acc 64x64 = 32 regs/thread + k+1 basis tiles 64x32 (16 each);
# dcoef 4 accumulators 32x64 = 64 regs; dx 4 accumulators 64x32 = 64 regs. Shared memory holds only the dot
# operand tiles (a few tens of KB), far below the ~227 KB per block of an H100/H200.
FWD_BLOCKS = {"block_b": 64, "block_in": 32, "block_out": 64}
DCOEF_BLOCKS = {"block_b": 64, "block_in": 32, "block_out": 64, "block_m": 4}
DX_BLOCKS = {"block_b": 64, "block_in": 32, "block_out": 64, "block_m": 4}


# ---------------------------------------------------------------------------------------------------------------
# Plain-JAX references (the tests' oracle and the XLA fallback)
# ---------------------------------------------------------------------------------------------------------------
def kan_spline_forward_reference(x, grid, coef, spline_order, *, precision=None):
    """``einsum('bim,oim->bo', bspline_basis(x), coef)``: materialises the ``[B, in, NB]`` basis."""
    phi = bspline_basis(x, grid, spline_order)
    return jnp.einsum("bim,oim->bo", phi, coef.astype(phi.dtype), precision=precision)


def kan_spline_backward_reference(x, grid, coef, g, spline_order, *, precision=None):
    """``(dx, dcoef)`` by the equations of the module docstring, in plain JAX."""
    phi = bspline_basis(x, grid, spline_order)
    dphi = bspline_basis_derivative(x, grid, spline_order)
    g = g.astype(phi.dtype)
    dcoef = jnp.einsum("bo,bim->oim", g, phi, precision=precision)
    h = jnp.einsum("bo,oim->bim", g, coef.astype(phi.dtype), precision=precision)
    return (dphi * h).sum(-1), dcoef


# ---------------------------------------------------------------------------------------------------------------
# Validation and dtype policy
# ---------------------------------------------------------------------------------------------------------------
def _check_args(fn: str, x, grid, coef, spline_order, g=None) -> tuple[int, int, int, int]:
    """Return ``(B, in, out, NB)``; raise naming the argument and the expected shape."""
    named = [("x", x), ("grid", grid), ("coef", coef)] + ([("g", g)] if g is not None else [])
    for name, a in named:
        if not hasattr(a, "dtype") or not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{fn}: '{name}' must be a floating-point array, got {getattr(a, 'dtype', type(a))}")
    if isinstance(spline_order, bool) or not isinstance(spline_order, int) or spline_order < 1:
        raise ValueError(f"{fn}: 'spline_order' must be an int >= 1 (the degree k), got {spline_order!r}")
    k = spline_order
    if x.ndim != 2:
        raise ValueError(f"{fn}: 'x' must have shape [batch, in_features], got {x.shape}")
    n_batch, n_in = x.shape
    if coef.ndim != 3 or coef.shape[1] != n_in:
        raise ValueError(f"{fn}: 'coef' must have shape [out_features, {n_in}, G+k] (in_features={n_in} from 'x'), "
                         f"got {coef.shape}")
    n_out, _, nb = coef.shape
    if nb - k < 1:
        raise ValueError(f"{fn}: 'coef' has {nb} bases per input; with spline_order k={k} it needs G+k >= {k + 1} "
                         f"(G >= 1), got shape {coef.shape}")
    if grid.shape != (n_in, nb + k + 1):
        raise ValueError(f"{fn}: 'grid' must have shape ({n_in}, {nb + k + 1}) = [in_features, G+2k+1] with G={nb - k}, "
                         f"k={k} (from 'coef' {coef.shape} and 'x' {x.shape}), got {grid.shape}")
    if g is not None and g.shape != (n_batch, n_out):
        raise ValueError(f"{fn}: 'g' (the cotangent of y) must have shape ({n_batch}, {n_out}) = [batch, out_features], "
                         f"got {g.shape}")
    return n_batch, n_in, n_out, nb


def _check_block(fn: str, name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{fn}: '{name}' must be a power of two >= 16 (Triton tl.dot), got {value!r}")
    return value


def _dtypes(*arrays) -> tuple[jnp.dtype, jnp.dtype]:
    """(matrix-unit operand dtype, compute/accumulate dtype)."""
    mdt = jnp.result_type(*[a.dtype for a in arrays])
    return jnp.dtype(mdt), jnp.dtype(jnp.promote_types(mdt, jnp.float32))


def _pad_to(a, shape, mode="constant"):
    pads = [(0, s - d) for s, d in zip(shape, a.shape, strict=True)]
    return a if all(p == (0, 0) for p in pads) else jnp.pad(a, pads, mode=mode)


def _knots_transposed(grid, cdt, n_rows: int, in_pad: int):
    """``grid[in, NK]`` -> ``[n_rows, in_pad]`` in ``cdt``: rows past ``NK`` repeat the last knot (empty
    intervals), columns past ``in`` are 0 (all bases 0)."""
    t = grid.T.astype(cdt)
    t = _pad_to(t, (n_rows, t.shape[1]), mode="edge")
    return _pad_to(t, (n_rows, in_pad))


# ---------------------------------------------------------------------------------------------------------------
# In-kernel basis evaluation (shared by the three kernels)
# ---------------------------------------------------------------------------------------------------------------
class _KnotTable:
    """Knot rows ``t[r]`` (``[1, bk]``, relative to the first basis of the sweep) and the safe reciprocal widths
    ``inv(p, r) = 1/(t[r+p] - t[r])`` (0 for a zero-width interval) for ``p = 1..max_p``, all computed eagerly so
    that a table built outside a loop is loop-invariant."""

    def __init__(self, load_row, n_rows: int, max_p: int):
        self.t = [load_row(r)[None, :] for r in range(n_rows)]
        self._inv = {}
        for p in range(1, max_p + 1):
            for r in range(n_rows - p):
                w = self.t[r + p] - self.t[r]
                nz = w != 0
                self._inv[(p, r)] = jnp.where(nz, 1 / jnp.where(nz, w, 1), 0).astype(w.dtype)

    def inv(self, p: int, r: int):
        return self._inv[(p, r)]


def _sweep(x, tab: _KnotTable, n_intervals: int, degree: int):
    """Yield ``(j, B^degree_j(x))`` for ``j = 0 .. n_intervals-1-degree`` (relative indices) by the diagonal
    Cox-de Boor sweep of the module docstring, walking the degree-0 intervals ``0 .. n_intervals-1``."""
    prev: list[Any] = [None] * (degree + 1)  # prev[p] = B^p_{r-1-p}
    for r in range(n_intervals):
        new: list[Any] = [None] * (degree + 1)
        new[0] = ((x >= tab.t[r]) & (x < tab.t[r + 1])).astype(x.dtype)
        for p in range(1, min(r, degree) + 1):
            j = r - p
            new[p] = ((x - tab.t[j]) * tab.inv(p, j) * prev[p - 1]
                      + (tab.t[j + p + 1] - x) * tab.inv(p, j + 1) * new[p - 1])
        prev = new
        if r >= degree:
            yield r - degree, new[degree]


def _dot(a, b, precision, acc_dtype, contract=((1,), (0,))):
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=acc_dtype)


# ---------------------------------------------------------------------------------------------------------------
# Forward kernel
# ---------------------------------------------------------------------------------------------------------------
def _fwd_kernel(x_ref, t_ref, c_ref, y_ref, *, n_batch, n_in, n_out, bb, bk, bo, n_kb, k, nb, precision, cdt, mdt):
    row_ok = (pl.program_id(0) * bb + jnp.arange(bb)) < n_batch

    def body(kb, acc):
        start = pl.multiple_of(kb * bk, bk)
        col_ok = (start + jnp.arange(bk)) < n_in
        mask = jnp.broadcast_to(row_ok[:, None] & col_ok[None, :], (bb, bk))
        x = pb.masked_load(x_ref.at[:, pl.ds(start, bk)], mask).astype(cdt)
        tab = _KnotTable(lambda r: t_ref[r, pl.ds(start, bk)], nb + k + 1, k)
        for m, b_m in _sweep(x, tab, nb + k, k):
            acc = acc + _dot(b_m.astype(mdt), c_ref[m, pl.ds(start, bk), :], precision, cdt)
        return acc

    acc = lax.fori_loop(0, n_kb, body, jnp.zeros((bb, bo), cdt))
    pb.masked_store(y_ref, acc, pb.block_mask((bb, bo), (n_batch, n_out)))


@functools.partial(jax.jit, static_argnames=("k", "precision", "interpret", "bb", "bk", "bo", "num_warps",
                                             "num_stages"))
def _forward_impl(x, grid, coef, *, k, precision, interpret, bb, bk, bo, num_warps, num_stages):
    n_batch, n_in = x.shape
    n_out, _, nb = coef.shape
    mdt, cdt = _dtypes(x, coef)
    n_kb, n_ob = pl.cdiv(n_in, bk), pl.cdiv(n_out, bo)
    in_pad, out_pad = n_kb * bk, n_ob * bo
    t = _knots_transposed(grid, cdt, nb + k + 1, in_pad)  # [NK, in_pad]
    c = _pad_to(jnp.transpose(coef, (2, 1, 0)).astype(mdt), (nb, in_pad, out_pad))  # [NB, in_pad, out_pad]
    kernel = functools.partial(_fwd_kernel, n_batch=n_batch, n_in=n_in, n_out=n_out, bb=bb, bk=bk, bo=bo,
                               n_kb=n_kb, k=k, nb=nb, precision=precision, cdt=cdt, mdt=mdt)
    return pb.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_batch, n_out), x.dtype),
        grid=(pl.cdiv(n_batch, bb), n_ob),
        in_specs=[
            pl.BlockSpec((bb, in_pad), lambda b, o: (b, 0)),
            pl.BlockSpec((nb + k + 1, in_pad), lambda b, o: (0, 0)),
            pl.BlockSpec((nb, in_pad, bo), lambda b, o: (0, 0, o)),
        ],
        out_specs=pl.BlockSpec((bb, bo), lambda b, o: (b, o)),
        name="kan_spline_fwd",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )(x, t, c)


def kan_spline_forward(
    x: jax.Array,
    grid: jax.Array,
    coef: jax.Array,
    spline_order: int,
    *,
    precision: Any = None,
    interpret: bool | None = None,
    block_b: int = FWD_BLOCKS["block_b"],
    block_in: int = FWD_BLOCKS["block_in"],
    block_out: int = FWD_BLOCKS["block_out"],
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    r"""Spline part of a KAN layer, :math:`y[b,o] = \sum_i \sum_m B_m(x_{bi})\, c[o,i,m]`, in one fused kernel.

    Args:
      x: ``[B, in]`` inputs (bf16, f32 or f64).
      grid: ``[in, G+2k+1]`` non-decreasing knot rows (any float dtype; used in ``promote(x, coef, f32)``).
      coef: ``[out, in, G+k]`` coefficients (efficient-kan layout; fold ``spline_scaler`` in first).
      spline_order: the degree ``k`` (3 = cubic).
      precision: ``None`` (platform default; TF32 for f32 on the GPU) or ``jax.lax.Precision.HIGHEST``.
      interpret: force Pallas interpret mode (``None``: on unless running on a GPU).
      block_b, block_in, block_out: tile upper bounds (powers of two >= 16), see the module docstring.
      num_warps, num_stages: Triton launch parameters (ignored in interpret mode).
    Returns:
      ``y[B, out]`` in ``x.dtype``. The ``[B, in, G+k]`` basis is never materialised.
    """
    fn = "kan_spline_forward"
    n_batch, n_in, n_out, _ = _check_args(fn, x, grid, coef, spline_order)
    for name, v in (("block_b", block_b), ("block_in", block_in), ("block_out", block_out)):
        _check_block(fn, name, v)
    if n_batch == 0 or n_out == 0 or n_in == 0:
        return jnp.zeros((n_batch, n_out), x.dtype)
    return _forward_impl(
        x, grid, coef, k=spline_order, precision=precision, interpret=pb.resolve_interpret(interpret),
        bb=pb.block_size(n_batch, block_b), bk=pb.block_size(n_in, block_in), bo=pb.block_size(n_out, block_out),
        num_warps=num_warps, num_stages=num_stages)


# ---------------------------------------------------------------------------------------------------------------
# dcoef kernel
# ---------------------------------------------------------------------------------------------------------------
def _dcoef_kernel(x_ref, g_ref, t_ref, o_ref, *, n_batch, n_in, n_out, bb, bk, bo, per, k, bm, precision, cdt, mdt):
    split, ib, ob, chunk = (pl.program_id(a) for a in range(4))
    col_ok = (ib * bk + jnp.arange(bk)) < n_in
    out_ok = (ob * bo + jnp.arange(bo)) < n_out
    m0 = chunk * bm
    tab = _KnotTable(lambda r: t_ref[m0 + r, :], bm + k + 1, k)  # loop-invariant: hoisted out of the batch loop

    def body(step, accs):
        blk = split * per + step
        start = pl.multiple_of(blk * bb, bb)
        row_ok = (start + jnp.arange(bb)) < n_batch
        x = pb.masked_load(x_ref.at[pl.ds(start, bb), :],
                           jnp.broadcast_to(row_ok[:, None] & col_ok[None, :], (bb, bk))).astype(cdt)
        g = pb.masked_load(g_ref.at[pl.ds(start, bb), :],
                           jnp.broadcast_to(row_ok[:, None] & out_ok[None, :], (bb, bo))).astype(mdt)
        new = list(accs)
        for s, b_s in _sweep(x, tab, bm + k, k):
            new[s] = new[s] + _dot(b_s.astype(mdt), g, precision, cdt, contract=((0,), (0,)))  # B^T g
        return tuple(new)

    accs = lax.fori_loop(0, per, body, tuple(jnp.zeros((bk, bo), cdt) for _ in range(bm)))
    for s in range(bm):
        o_ref[s, :, :] = accs[s].astype(o_ref.dtype)


def _auto_splits(programs: int, n_bblocks: int, interpret: bool) -> int:
    """Batch splits for dcoef: enough programs to fill ~2 waves of an H100/H200 (132 SMs), each split keeping >= 8
    batch blocks. Interpret mode runs the grid serially, so it never splits."""
    if interpret or programs >= 128:
        return 1
    return max(1, min(pl.cdiv(256, programs), n_bblocks // 8))


@functools.partial(jax.jit, static_argnames=("nb", "k", "precision", "interpret", "bb", "bk", "bo", "bm",
                                             "splits", "num_warps", "num_stages", "out_dtype"))
def _dcoef_call(x, grid, g, *, nb, k, precision, interpret, bb, bk, bo, bm, splits, num_warps, num_stages,
                out_dtype):
    n_batch, n_in = x.shape
    n_out = g.shape[1]
    mdt, cdt = _dtypes(x, g)
    n_ib, n_ob, n_chunks = pl.cdiv(n_in, bk), pl.cdiv(n_out, bo), pl.cdiv(nb, bm)
    in_pad, out_pad, nb_pad = n_ib * bk, n_ob * bo, n_chunks * bm
    n_bblocks = pl.cdiv(n_batch, bb)
    per = pl.cdiv(n_bblocks, splits)
    splits = pl.cdiv(n_bblocks, per)  # no empty split
    rows = splits * per * bb
    t = _knots_transposed(grid, cdt, nb_pad + k + 1, in_pad)
    kernel = functools.partial(_dcoef_kernel, n_batch=n_batch, n_in=n_in, n_out=n_out, bb=bb, bk=bk, bo=bo,
                               per=per, k=k, bm=bm, precision=precision, cdt=cdt, mdt=mdt)
    part = pb.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, nb_pad, in_pad, out_pad), cdt),
        grid=(splits, n_ib, n_ob, n_chunks),
        in_specs=[
            pl.BlockSpec((rows, bk), lambda s, i, o, c: (0, i)),
            pl.BlockSpec((rows, bo), lambda s, i, o, c: (0, o)),
            pl.BlockSpec((nb_pad + k + 1, bk), lambda s, i, o, c: (0, i)),
        ],
        out_specs=pl.BlockSpec((pl.squeezed, bm, bk, bo), lambda s, i, o, c: (s, c, i, o)),
        name="kan_spline_dcoef",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )(x, g.astype(mdt), t)
    dcoef = part.sum(0) if splits > 1 else part[0]
    return jnp.transpose(dcoef[:nb, :n_in, :n_out], (2, 1, 0)).astype(out_dtype)


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
    block_b: int = DCOEF_BLOCKS["block_b"],
    block_in: int = DCOEF_BLOCKS["block_in"],
    block_out: int = DCOEF_BLOCKS["block_out"],
    block_m: int = DCOEF_BLOCKS["block_m"],
    batch_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    r""":math:`\bar c[o,i,m] = \sum_b g[b,o]\, B_m(x_{bi})`: ``[out, in, num_bases]`` in ``coef_dtype``
    (default ``result_type(x, g)``). ``block_m`` bases per program; ``batch_splits`` (``None``: automatic)
    splits the batch reduction into deterministic f32 partials summed by XLA."""
    fn = "kan_spline_dcoef"
    if isinstance(num_bases, bool) or not isinstance(num_bases, int) or num_bases < 1:
        raise ValueError(f"{fn}: 'num_bases' (G+k) must be a positive int, got {num_bases!r}")
    n_out = g.shape[-1] if getattr(g, "ndim", 0) == 2 else 0
    shaped = jax.ShapeDtypeStruct((n_out, x.shape[-1] if getattr(x, "ndim", 0) == 2 else 0, num_bases),
                                  coef_dtype or getattr(x, "dtype", jnp.float32))
    n_batch, n_in, n_out, nb = _check_args(fn, x, grid, shaped, spline_order, g)
    return _dcoef(fn, x, grid, g, spline_order, nb, jnp.dtype(coef_dtype or jnp.result_type(x.dtype, g.dtype)),
                  precision, interpret, block_b, block_in, block_out, block_m, batch_splits, num_warps, num_stages)


def _dcoef(fn, x, grid, g, k, nb, out_dtype, precision, interpret, block_b, block_in, block_out, block_m,
           batch_splits, num_warps, num_stages):
    n_batch, n_in = x.shape
    n_out = g.shape[1]
    for name, v in (("block_b", block_b), ("block_in", block_in), ("block_out", block_out)):
        _check_block(fn, name, v)
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"{fn}: 'block_m' (bases per program) must be a positive int, got {block_m!r}")
    if batch_splits is not None and (isinstance(batch_splits, bool) or not isinstance(batch_splits, int)
                                     or batch_splits < 1):
        raise ValueError(f"{fn}: 'batch_splits' must be None or a positive int, got {batch_splits!r}")
    if n_batch == 0 or n_in == 0 or n_out == 0:
        return jnp.zeros((n_out, n_in, nb), out_dtype)
    interp = pb.resolve_interpret(interpret)
    bb, bk, bo = pb.block_size(n_batch, block_b), pb.block_size(n_in, block_in), pb.block_size(n_out, block_out)
    bm = min(block_m, nb)
    n_bblocks = pl.cdiv(n_batch, bb)
    if batch_splits is None:
        batch_splits = _auto_splits(pl.cdiv(n_in, bk) * pl.cdiv(n_out, bo) * pl.cdiv(nb, bm), n_bblocks, interp)
    return _dcoef_call(x, grid, g, nb=nb, k=k, precision=precision, interpret=interp, bb=bb, bk=bk, bo=bo, bm=bm,
                       splits=min(batch_splits, n_bblocks), num_warps=num_warps, num_stages=num_stages,
                       out_dtype=out_dtype)


# ---------------------------------------------------------------------------------------------------------------
# dx kernel
# ---------------------------------------------------------------------------------------------------------------
def _dx_kernel(x_ref, g_ref, t_ref, c_ref, o_ref, *, n_batch, n_in, n_out, bb, bk, bo, n_ob, k, bm, n_chunks,
               precision, cdt, mdt):
    row_ok = (pl.program_id(0) * bb + jnp.arange(bb)) < n_batch
    col_ok = (pl.program_id(1) * bk + jnp.arange(bk)) < n_in
    mask = jnp.broadcast_to(row_ok[:, None] & col_ok[None, :], (bb, bk))
    x = pb.masked_load(x_ref, mask).astype(cdt)
    dx = jnp.zeros((bb, bk), cdt)
    for chunk in range(n_chunks):  # static: bm accumulators live at a time
        m0 = chunk * bm

        def body(ob, hs, m0=m0):
            start = pl.multiple_of(ob * bo, bo)
            out_ok = (start + jnp.arange(bo)) < n_out
            g = pb.masked_load(g_ref.at[:, pl.ds(start, bo)],
                               jnp.broadcast_to(row_ok[:, None] & out_ok[None, :], (bb, bo))).astype(mdt)
            return tuple(hs[s] + _dot(g, c_ref[m0 + s, pl.ds(start, bo), :], precision, cdt) for s in range(bm))

        hs = lax.fori_loop(0, n_ob, body, tuple(jnp.zeros((bb, bk), cdt) for _ in range(bm)))
        tab = _KnotTable(lambda r, m0=m0: t_ref[m0 + r, :], bm + k + 1, k)
        lower = [b for _, b in _sweep(x, tab, bm + k, k - 1)]  # B^{k-1}_{m0 .. m0+bm}
        for s in range(bm):
            dx = dx + k * (lower[s] * tab.inv(k, s) - lower[s + 1] * tab.inv(k, s + 1)) * hs[s]
    pb.masked_store(o_ref, dx, mask)


@functools.partial(jax.jit, static_argnames=("k", "precision", "interpret", "bb", "bk", "bo", "bm", "num_warps",
                                             "num_stages"))
def _dx_call(x, grid, coef, g, *, k, precision, interpret, bb, bk, bo, bm, num_warps, num_stages):
    n_batch, n_in = x.shape
    n_out, _, nb = coef.shape
    mdt, cdt = _dtypes(x, coef, g)
    n_ib, n_ob, n_chunks = pl.cdiv(n_in, bk), pl.cdiv(n_out, bo), pl.cdiv(nb, bm)
    in_pad, out_pad, nb_pad = n_ib * bk, n_ob * bo, n_chunks * bm
    t = _knots_transposed(grid, cdt, nb_pad + k + 1, in_pad)
    c = _pad_to(jnp.transpose(coef, (2, 0, 1)).astype(mdt), (nb_pad, out_pad, in_pad))  # [NB_pad, out, in]
    kernel = functools.partial(_dx_kernel, n_batch=n_batch, n_in=n_in, n_out=n_out, bb=bb, bk=bk, bo=bo, n_ob=n_ob,
                               k=k, bm=bm, n_chunks=n_chunks, precision=precision, cdt=cdt, mdt=mdt)
    return pb.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_batch, n_in), x.dtype),
        grid=(pl.cdiv(n_batch, bb), n_ib),
        in_specs=[
            pl.BlockSpec((bb, bk), lambda b, i: (b, i)),
            pl.BlockSpec((bb, out_pad), lambda b, i: (b, 0)),
            pl.BlockSpec((nb_pad + k + 1, bk), lambda b, i: (0, i)),
            pl.BlockSpec((nb_pad, out_pad, bk), lambda b, i: (0, 0, i)),
        ],
        out_specs=pl.BlockSpec((bb, bk), lambda b, i: (b, i)),
        name="kan_spline_dx",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )(x, g.astype(mdt), t, c)


def kan_spline_dx(
    x: jax.Array,
    grid: jax.Array,
    coef: jax.Array,
    g: jax.Array,
    spline_order: int,
    *,
    precision: Any = None,
    interpret: bool | None = None,
    block_b: int = DX_BLOCKS["block_b"],
    block_in: int = DX_BLOCKS["block_in"],
    block_out: int = DX_BLOCKS["block_out"],
    block_m: int = DX_BLOCKS["block_m"],
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    r""":math:`\bar x[b,i] = \sum_m B'_m(x_{bi}) \sum_o g[b,o]\, c[o,i,m]`: ``[B, in]`` in ``x.dtype``."""
    fn = "kan_spline_dx"
    _check_args(fn, x, grid, coef, spline_order, g)
    return _dx(fn, x, grid, coef, g, spline_order, precision, interpret, block_b, block_in, block_out, block_m,
               num_warps, num_stages)


def _dx(fn, x, grid, coef, g, k, precision, interpret, block_b, block_in, block_out, block_m, num_warps,
        num_stages):
    n_batch, n_in = x.shape
    n_out, _, nb = coef.shape
    for name, v in (("block_b", block_b), ("block_in", block_in), ("block_out", block_out)):
        _check_block(fn, name, v)
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"{fn}: 'block_m' (bases per accumulator chunk) must be a positive int, got {block_m!r}")
    if n_batch == 0 or n_in == 0 or n_out == 0:
        return jnp.zeros((n_batch, n_in), x.dtype)
    return _dx_call(x, grid, coef, g, k=k, precision=precision, interpret=pb.resolve_interpret(interpret),
                    bb=pb.block_size(n_batch, block_b), bk=pb.block_size(n_in, block_in),
                    bo=pb.block_size(n_out, block_out), bm=min(block_m, nb), num_warps=num_warps,
                    num_stages=num_stages)


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
    block_b: int | None = None,
    block_in: int | None = None,
    block_out: int | None = None,
    block_m: int | None = None,
    batch_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> tuple[jax.Array, jax.Array]:
    r"""VJP of :func:`kan_spline_forward` for the cotangent ``g[B, out]``: ``(dx[B, in], dcoef[out, in, G+k])``.

    .. math::

        \bar x[b,i] = \sum_o g[b,o] \sum_m c[o,i,m]\, B'_m(x_{bi}), \qquad
        \bar c[o,i,m] = \sum_b g[b,o]\, B_m(x_{bi})

    Runs two kernels (module docstring): dcoef (batch reduction inside each program; ``batch_splits`` f32
    partials summed by XLA, deterministic) and dx. A block argument left ``None`` takes each kernel's default
    (``DCOEF_BLOCKS`` / ``DX_BLOCKS``); a value applies to both. ``dx`` is in ``x.dtype``, ``dcoef`` in
    ``coef.dtype``; ``g`` is used in ``result_type(x, coef, g)``.
    """
    fn = "kan_spline_backward"
    _check_args(fn, x, grid, coef, spline_order, g)
    nb = coef.shape[2]

    def pick(defaults, name, value):
        return defaults[name] if value is None else value

    mdt, _ = _dtypes(x, coef, g)
    dcoef = _dcoef(fn, x, grid, g.astype(mdt), spline_order, nb, jnp.dtype(coef.dtype), precision,
                   interpret, pick(DCOEF_BLOCKS, "block_b", block_b), pick(DCOEF_BLOCKS, "block_in", block_in),
                   pick(DCOEF_BLOCKS, "block_out", block_out), pick(DCOEF_BLOCKS, "block_m", block_m),
                   batch_splits, num_warps, num_stages)
    dx = _dx(fn, x, grid, coef, g, spline_order, precision, interpret, pick(DX_BLOCKS, "block_b", block_b),
             pick(DX_BLOCKS, "block_in", block_in), pick(DX_BLOCKS, "block_out", block_out),
             pick(DX_BLOCKS, "block_m", block_m), num_warps, num_stages)
    return dx, dcoef
