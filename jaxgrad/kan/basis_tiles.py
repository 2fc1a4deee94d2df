r"""In-kernel B-spline basis tiles of the KAN spline kernels (:mod:`jaxgrad.kan.kernels`): the knot tables,
the diagonal Cox-de Boor sweep, the interleaved basis tile ``A[bb, bk * nbp]`` and the static tile geometry shared
by the forward and backward kernels.

**Basis evaluation: a diagonal Cox-de Boor sweep.** The kernel walks the degree-0 intervals :math:`r = 0, 1,
\dots` in order. At step :math:`r` it forms :math:`B^0_r = [t_r \le x < t_{r+1}]` and then, for
:math:`p = 1..k`, the single new value :math:`B^p_{r-p}` from :math:`B^{p-1}_{r-p}` (kept from step
:math:`r-1`) and :math:`B^{p-1}_{r-p+1}` (just made):

.. math::

    B^p_j = (x - t_j)\,w^{-1}_{p,j}\, B^{p-1}_j + (t_{j+p+1} - x)\,w^{-1}_{p,j+1}\, B^{p-1}_{j+1},
    \qquad w^{-1}_{p,j} = \begin{cases} 1/(t_{j+p} - t_j) & t_{j+p} > t_j \\ 0 & \text{otherwise} \end{cases}

so :math:`B^k_{r-k}` is complete after step :math:`r`: :math:`O(k)` elementwise ops per basis, and besides the
finished bases only :math:`k+1` working ``[bb, bk]`` tiles are live, whatever ``G``. The knots :math:`t_r` and the
safe reciprocal widths :math:`w^{-1}_{p,r}` are per-column tables built by the wrapper (``[(k+1) rows, in]``, from
parameters only) and read by the kernel one ``[bk]`` row at a time, at first use. The arithmetic matches the
plain-JAX reference up to the rounding of ``a * (1/w)`` versus ``a / w``.

**The affine form** (:func:`affine_sweep`, the Mosaic kernels'): with :math:`\alpha_{p,j} = x\,w^{-1}_{p,j} +
c_{p,j}`, :math:`c_{p,j} = -t_j w^{-1}_{p,j}` (a per-column table, :func:`affine_knot_tables`), the second factor
is :math:`(t_{j+p+1} - x)\,w^{-1}_{p,j+1} = 1 - \alpha_{p,j+1}` (where the width is zero, :math:`B^{p-1}_{j+1}`
is identically zero, so the product is 0 either way), and each :math:`\alpha` serves two steps of the sweep:

.. math::

    B^p_j = \alpha_{p,j}\, B^{p-1}_j + (1 - \alpha_{p,j+1})\, B^{p-1}_{j+1}, \qquad
    B^0_r = s_r - s_{r+1}, \quad s_r = [x \ge t_r]

(the knots are non-decreasing, so :math:`s_{r+1} \le s_r`): four operations per new value instead of seven, and
one comparison per interval instead of two. The price is an absolute rounding error of a few float32 ulps of 1 in
a basis (``1 - alpha`` cancels near the support's end) instead of a relative one: negligible against a sum of
bases that make a partition of unity (the forward, the input gradient), but not for a coefficient gradient whose
column holds only tails, so the coefficient gradient keeps :func:`sweep`.

**Wide contractions.** The kernels do not issue one small dot per basis. The ``NB`` bases of a ``[bb, bk]`` tile
of ``x`` are zero-padded to ``nbp = next_power_of_2(NB)`` tiles, interleaved by a tree of two-way stacks (the
Triton lowering joins two tensors along a new last axis) into ``[bb, bk, nbp]`` and reshaped to the **basis tile**
``A[bb, bk * nbp]`` with column ``i * nbp + m`` = :math:`B_m(x_{b,i})`. That is the row-major flattening of
efficient-kan's ``spline_weight[out, in, NB]`` (padded to ``nbp``), so each contraction over (input, basis) is one
dot of depth ``K = bk * nbp`` against ``coef`` reshaped ``[out, in * nbp]`` with no transpose. ``bk`` is chosen
from the contraction width ``block_k`` (default 128): ``bk = block_k // nbp`` (at least ``16 // nbp`` so that
``K >= 16``, at most ``next_power_of_2(in)``); so a larger grid (``G = 20``: ``nbp = 32``, ``bk = 4``) keeps the
same tile sizes and registers instead of growing them.

**Edges.** Batch rows and input/output columns beyond the arrays are masked on load (read as 0) and on store.
``coef`` is reshaped and zero-padded to whole blocks by the wrapper (parameters only: cheap), so a padded input,
output or basis column contributes exactly 0; padded knot-table columns are 0 (every basis there is 0) and the
padding bases ``m >= NB`` are zero tiles.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

__all__ = ["Geometry", "KnotTable", "affine_knot_tables", "affine_sweep", "basis_tile", "coef_flat", "input_block",
           "interleave", "knot_tables", "mask2", "pad_to", "sweep", "tile_dot"]


def pad_to(a, shape, mode="constant"):
    pads = [(0, s - d) for s, d in zip(shape, a.shape, strict=True)]
    return a if all(p == (0, 0) for p in pads) else jnp.pad(a, pads, mode=mode)


def knot_tables(grid, cdt, k: int, n_rows: int, in_pad: int):
    """Per-column tables ``[(k+1) * n_rows, in_pad]`` in ``cdt`` that the kernels read row by row: row ``r`` is
    ``t_r`` (the knots) and row ``p * n_rows + r`` is ``w^{-1}_{p,r}``, the safe reciprocal of ``t_{r+p} - t_r``
    (0 for a zero-width interval), for ``p = 1..k``. Rows past the ``G+2k+1`` knots repeat the last knot (empty
    intervals, reciprocal 0); columns past ``in`` are 0 (every basis there is 0). Parameters only: cheap XLA."""
    t = grid.T.astype(cdt)  # [NK, in]
    t = pad_to(t, (n_rows, t.shape[1]), mode="edge")
    rows = [t]
    for p in range(1, k + 1):
        w = t[p:] - t[:-p]
        nz = w != 0
        inv = jnp.where(nz, 1 / jnp.where(nz, w, 1), 0).astype(cdt)
        rows.append(pad_to(inv, t.shape))
    return pad_to(jnp.concatenate(rows), ((k + 1) * n_rows, in_pad))



def affine_knot_tables(grid, cdt, k: int, n_rows: int, in_pad: int):
    """:func:`knot_tables`' rows, then for ``p = 1..k`` the rows ``c_{p,r} = -t_r w^{-1}_{p,r}`` of the affine
    form: ``[(2k+1) n_rows, in_pad]``; :meth:`KnotTable.shift` reads them."""
    base = knot_tables(grid, cdt, k, n_rows, in_pad)
    t = base[:n_rows]
    return jnp.concatenate([base] + [-t * base[p * n_rows:(p + 1) * n_rows] for p in range(1, k + 1)])


class KnotTable:
    """Rows of :func:`knot_tables` for one block of input columns, as ``[1, bk]`` vectors: ``t(r)`` and
    ``inv(p, r)``. Each row is loaded at first use (once per trace), so only the few rows the sweep currently needs
    are live: all ``(k+1)(NB+k+1)`` of them held at once cost a few registers each per thread, which is what made
    the first versions spill. ``expand`` makes a loaded row broadcastable against the ``[bb, bk]`` tile (default
    ``[1, bk]``; the Mosaic kernel loads rows already broadcast)."""

    def __init__(self, load_row, expand=lambda row: row[None, :]):
        self._load = load_row  # (p, r) -> [bk]
        self._expand = expand
        self._rows = {}

    def _get(self, p: int, r: int):
        if (p, r) not in self._rows:
            self._rows[(p, r)] = self._expand(self._load(p, r))
        return self._rows[(p, r)]

    def t(self, r: int):
        return self._get(0, r)

    def inv(self, p: int, r: int):
        return self._get(p, r)

    def shift(self, p: int, r: int, k: int):
        """``c_{p,r}`` of :func:`affine_knot_tables` built for order ``k``."""
        return self._get(k + p, r)


def affine_sweep(x, tab: KnotTable, n_intervals: int, degree: int, table_k: int):
    """:func:`sweep`'s ``(j, B^degree_j(x))`` in the affine form of the module docstring; ``tab`` reads
    :func:`affine_knot_tables` built for order ``table_k``."""
    prev: list[Any] = [None] * (degree + 1)  # prev[p] = B^p_{r-1-p}
    alpha: list[Any] = [None] * (degree + 1)  # alpha[p] = alpha_{p, r-p}, made at step r - 1
    s_r = (x >= tab.t(0)).astype(x.dtype)
    for r in range(n_intervals):
        s_next = (x >= tab.t(r + 1)).astype(x.dtype)
        new: list[Any] = [None] * (degree + 1)
        new[0] = s_r - s_next
        s_r = s_next
        made: list[Any] = [None] * (degree + 1)
        for p in range(1, min(r, degree) + 1):
            j = r - p
            a_j = alpha[p] if alpha[p] is not None else x * tab.inv(p, j) + tab.shift(p, j, table_k)
            made[p] = x * tab.inv(p, j + 1) + tab.shift(p, j + 1, table_k)
            new[p] = a_j * prev[p - 1] + (1 - made[p]) * new[p - 1]
        alpha, prev = made, new
        if r >= degree:
            yield r - degree, new[degree]


def sweep(x, tab: KnotTable, n_intervals: int, degree: int, start: int = 0):
    """Yield ``(j, B^degree_j(x))`` for ``j = start .. n_intervals-1-degree`` by the diagonal Cox-de Boor sweep of the
    module docstring, walking the degree-0 intervals ``start .. n_intervals-1``. ``B^p_j`` depends on the intervals
    ``j .. j+p`` only, so a walk that starts at interval ``start`` makes every basis from ``j = start`` on exactly
    (the values it would need below ``start`` are never formed)."""
    prev: list[Any] = [None] * (degree + 1)  # prev[p] = B^p_{r-1-p}
    for r in range(start, n_intervals):
        new: list[Any] = [None] * (degree + 1)
        new[0] = ((x >= tab.t(r)) & (x < tab.t(r + 1))).astype(x.dtype)
        for p in range(1, min(r - start, degree) + 1):
            j = r - p
            new[p] = ((x - tab.t(j)) * tab.inv(p, j) * prev[p - 1]
                      + (tab.t(j + p + 1) - x) * tab.inv(p, j + 1) * new[p - 1])
        prev = new
        if r >= start + degree:
            yield r - degree, new[degree]


def interleave(tiles):
    """``[bb, bk]`` tiles ``T_0 .. T_{n-1}`` (``n`` a power of two) -> ``[bb, bk * n]`` with column ``i * n + m`` =
    ``T_m[:, i]``, from two-way stacks only. Stacking ``T_j`` with ``T_{j + n/2}`` first puts the most significant
    bit of ``m`` on the first new axis, so the final row-major reshape lands every basis in its column."""
    bb, bk = tiles[0].shape
    level = list(tiles)
    while len(level) > 1:
        half = len(level) // 2
        level = [jnp.stack([level[j], level[j + half]], axis=-1) for j in range(half)]
    return level[0].reshape(bb, bk * len(tiles))


def basis_tile(x, tab: KnotTable, nb: int, nbp: int, k: int, *, derivative: bool = False):
    """The basis tile ``A[bb, bk * nbp]`` of the module docstring (``B_m(x)``, or ``B'_m(x)`` when
    ``derivative``), zero for the padding bases ``m >= nb``."""
    tiles = []
    if derivative:
        prev = None
        for s, low in sweep(x, tab, nb + k, k - 1):  # B^{k-1}_s, s = 0 .. nb
            if s > 0:  # B'_{s-1} = k [B^{k-1}_{s-1} w^{-1}_{k,s-1} - B^{k-1}_s w^{-1}_{k,s}]
                tiles.append(k * (prev * tab.inv(k, s - 1) - low * tab.inv(k, s)))
            prev = low
    else:
        tiles = [b for _, b in sweep(x, tab, nb + k, k)]
    tiles += [jnp.zeros_like(x)] * (nbp - nb)
    return interleave(tiles)


def tile_dot(a, b, precision, acc_dtype, contract=((1,), (0,))):
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=acc_dtype)


def mask2(rows_ok, cols_ok):
    return jnp.broadcast_to(rows_ok[:, None] & cols_ok[None, :], (rows_ok.shape[0], cols_ok.shape[0]))



def input_block(n_in: int, nbp: int, block_k: int) -> int:
    """Inputs per basis tile: ``block_k // nbp``, at least ``16 // nbp`` (``tl.dot`` needs ``K >= 16``), at most
    ``next_power_of_2(in)`` unless that minimum asks for more; a power of two."""
    return max(1, 16 // nbp, min(block_k // nbp, pl.next_power_of_2(n_in)))


def coef_flat(coef, nbp: int, in_pad: int, out_pad: int, mdt):
    """``coef[out, in, NB]`` -> ``[out_pad, in_pad * nbp]``, zero padded (parameters only: cheap XLA)."""
    return pad_to(coef.astype(mdt), (out_pad, in_pad, nbp)).reshape(out_pad, in_pad * nbp)


class Geometry:
    """Static sizes shared by the three kernel wrappers."""

    def __init__(self, n_in: int, nb: int, k: int, block_k: int):
        self.nb, self.nbp = nb, pl.next_power_of_2(nb)
        self.bk = input_block(n_in, self.nbp, block_k)
        self.kw = self.bk * self.nbp  # contraction width K of every dot
        self.n_kb = pl.cdiv(n_in, self.bk)
        self.in_pad = self.n_kb * self.bk
        self.n_rows = nb + k + 1  # knot-table rows per p (the G+2k+1 knots)

