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

**Wide contractions.** The kernels do not issue one small dot per basis. The ``NB`` bases of a ``[bb, bk]`` tile
of ``x`` are zero-padded to ``nbp = next_power_of_2(NB)`` tiles, interleaved by a tree of two-way stacks (the
Triton lowering joins two tensors along a new last axis) into ``[bb, bk, nbp]`` and reshaped to the **basis tile**
``A[bb, bk * nbp]`` with column ``i * nbp + m`` = :math:`B_m(x_{b,i})`. That is the row-major flattening of
efficient-kan's ``spline_weight[out, in, NB]`` (padded to ``nbp``), so each contraction over (input, basis) is one
dot of depth ``K = bk * nbp`` against ``coef`` reshaped ``[out, in * nbp]`` with no transpose. ``bk`` is chosen
from the contraction width ``block_k`` (default 128): ``bk = block_k // nbp`` (at least ``16 // nbp`` so that
``K >= 16``, at most ``next_power_of_2(in)``); so a larger grid (``G = 20``: ``nbp = 32``, ``bk = 4``) keeps the
same tile sizes and registers instead of growing them.

**Kernels** (``bb, bo``: batch and output block sizes, powers of two >= 16 because Triton needs power-of-two
arrays and ``tl.dot`` every dimension >= 16; each is clipped to ``next_power_of_2`` of its dimension):

* forward: grid ``(cdiv(B, bb), cdiv(out, bo))``; each program loops over the input blocks (``fori_loop``),
  builds the basis tile and accumulates ``y^T[bo, bb] += C[bo, K] @ A^T[K, bb]``. The bases are the dot's second
  operand, which Hopper's ``wgmma`` reads from shared memory (measured faster than the other orientation). They
  are recomputed once per output block: ``bo`` trades accumulator registers against that recomputation.
* dcoef: grid ``(S, cdiv(in, bk), cdiv(out, bo))``; a program owns a ``[bo, K]`` block of ``coef``'s gradient,
  loops over its share of the batch blocks and adds ``g^T[bo, bb] @ A[bb, K]``. ``S`` splits the batch when the
  other axes give too few programs (``batch_splits``); the ``S`` f32 partials are summed by XLA (deterministic: no
  atomics). The output is written directly in the ``[out, in * nbp]`` layout.
* dx: grid ``(cdiv(B, bb), cdiv(in, bk))``; the program loops over the output blocks accumulating
  ``h[bb, K] += g[bb, bo] @ C[bo, K]``, then builds the derivative tile ``A'`` (same layout, from the degree
  ``k-1`` sweep) and reduces ``(A' * h)`` over the ``nbp`` bases of each input.

**Default blocks** (:data:`FWD_DEFAULTS`, :data:`DCOEF_DEFAULTS`, :data:`DX_DEFAULTS`) are the fastest of a timed
sweep on an H100 (f32, TF32 dots, ``B=16384, in=out=512, G=5, k=3``;
``benchmarks/logs/kan-wide-probe-h100-20261123-1.log``): forward (128, 128, 256), 8 warps, 2 stages 0.89-0.95 ms;
dcoef (64, 128, 128), 8 warps, 1 split 1.45 ms; dx (128, 128, 64), 8 warps, 2 stages 1.51 ms. The kernels they
replaced (one ``K = 16`` dot per basis) took 1.21 / 1.61 / 1.77 ms in the same run. Larger tiles run out of
shared memory (the forward at ``bo = 512``: 256 KB > 227 KB) or registers (``bb = bo = 256`` at 16 warps); read
the error and shrink the block.
Exact-f32 dots use :data:`EXACT_F32_DEFAULTS` (small tiles, 4 warps, one stage): IEEE dots are FMA loops in
registers on Triton, where the TF32 tiles spill (forward 37.8 ms vs 6.15 ms with the small tiles), and 3-pass TF32
keeps hi/lo operand copies in shared memory, where the TF32 tiles ask for ~400 KB
(``benchmarks/logs/kan-kernels-sweep-highest-h100-20261123.log``).

**Where the time goes** (same H100 run, ``benchmarks/logs/kan-wide-probe-h100-20261123-2-ablation.log``): the
forward with the bases replaced by a copy of ``x`` (dots and layout only) takes 0.61 ms, ~110 TFLOP/s, against a
TF32 floor of 0.14 ms; with the dot replaced by a row sum (bases and layout only) it takes 0.62 ms. Both halves
are far from their floors and they only partly overlap: Triton's software pipeline does not overlap the
register-computed operand with the previous ``wgmma``. Reaching the TF32 floor needs warp-specialised kernels
(producer warps computing bases into shared memory while consumer warps issue ``wgmma``), i.e. Mosaic GPU.

**Edges.** Batch rows and input/output columns beyond the arrays are masked on load (read as 0) and on store.
``coef`` is reshaped and zero-padded to whole blocks by the wrapper (parameters only: cheap), so a padded input,
output or basis column contributes exactly 0; padded knot-table columns are 0 (every basis there is 0) and the
padding bases ``m >= NB`` are zero tiles.

**Dtypes and precision.** ``mdt = result_type(x, coef[, g])`` is the matrix-unit operand dtype and
``cdt = promote_types(mdt, float32)`` the dtype of the bases, knots and accumulators: f32 for bf16/f32, f64 for
f64 (interpret mode; the verifier's re-run). For bf16 the bases are evaluated in f32 and rounded to bf16 only as a
``dot`` operand; accumulation is f32. ``precision`` goes to every in-kernel ``dot``: ``None`` is the platform
default (TF32 for f32 on the GPU: operands rounded to 10 mantissa bits), ``jax.lax.Precision.HIGHEST`` is IEEE
f32 (on Triton an FMA loop without tensor cores: exact but several times slower), and
``jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3`` is the ~f32-accurate 3-pass TF32 on tensor cores. Outputs: ``y``
and ``dx`` in ``x.dtype``, ``dcoef`` in ``coef.dtype``.
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
    "DCOEF_DEFAULTS",
    "DX_DEFAULTS",
    "FWD_DEFAULTS",
    "EXACT_F32_DEFAULTS",
    "kan_spline_backward",
    "kan_spline_backward_reference",
    "kan_spline_dcoef",
    "kan_spline_dx",
    "kan_spline_forward",
    "kan_spline_forward_reference",
]

# Upper bounds of the batch and output tiles (clipped to next_power_of_2 of each dimension, floor 16), the
# contraction width block_k = bk * nbp, and Triton's launch parameters: the fastest of a timed H100 sweep (module
# docstring; benchmarks/logs/kan-wide-probe-h100-20261123-1.log, f32 TF32, B=16384, 512->512, G=5, k=3).
# min_inputs: the contraction widens to min_inputs * nbp when block_k would leave fewer inputs per tile. At G=20
# (nbp=32) eight inputs per tile (block_k=256) took dcoef from 6.21 to 3.12 ms; dx did not gain (5.15 vs 5.29 ms)
# (benchmarks/logs/kan-kernels-sweep-G20-h100-20261123.log). The forward gained too (3.86 -> 3.31 ms), but only with
# block_out=128 and one stage: its [block_out, K] coefficient tiles at 256 x 256 and two stages need ~400 KB of shared
# memory (the block has 227 KB), so it stays at K=128 by default.
FWD_DEFAULTS = {"block_b": 128, "block_k": 128, "block_out": 256, "num_warps": 8, "num_stages": 2, "min_inputs": 1}
DCOEF_DEFAULTS = {"block_b": 64, "block_k": 128, "block_out": 128, "num_warps": 8, "num_stages": 2, "min_inputs": 8}
DX_DEFAULTS = {"block_b": 128, "block_k": 128, "block_out": 64, "num_warps": 8, "num_stages": 2, "min_inputs": 1}
# Exact-f32 dots. IEEE (precision=HIGHEST) is an FMA loop in registers on Triton: the TF32 tiles spill and ran
# 2.6-9x slower (fwd 37.8 ms, dcoef 24.2, dx 8.5); these are the fastest of
# benchmarks/logs/kan-kernels-sweep-highest-h100-20261123.log: fwd 6.15 ms, dcoef 2.79, dx 2.42 (H100, same shapes).
# 3-pass TF32 keeps hi/lo copies of the operands in shared memory: with the TF32 tiles it asked for ~400 KB of the
# 227 KB a block has, so it uses these small tiles too.
EXACT_F32_DEFAULTS = {
    "fwd": {"block_b": 64, "block_k": 32, "block_out": 64, "num_warps": 4, "num_stages": 1, "min_inputs": 1},
    "dcoef": {"block_b": 32, "block_k": 64, "block_out": 64, "num_warps": 4, "num_stages": 1, "min_inputs": 1},
    "dx": {"block_b": 32, "block_k": 128, "block_out": 32, "num_warps": 4, "num_stages": 1, "min_inputs": 1},
}
_SMEM_BUDGET = 200 * 1024  # bytes of shared memory a 2-stage pipeline may take (the hardware has 227 KB)


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
# Validation, dtype policy, launch configuration
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
        raise ValueError(f"{fn}: 'grid' must have shape ({n_in}, {nb + k + 1}) = [in_features, G+2k+1] with "
                         f"G={nb - k}, k={k} (from 'coef' {coef.shape} and 'x' {x.shape}), got {grid.shape}")
    if g is not None and g.shape != (n_batch, n_out):
        raise ValueError(f"{fn}: 'g' (the cotangent of y) must have shape ({n_batch}, {n_out}) = "
                         f"[batch, out_features], got {g.shape}")
    return n_batch, n_in, n_out, nb


def _check_pos_int(fn: str, name: str, value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{fn}: '{name}' ({what}) must be a positive int, got {value!r}")
    return value


def _is_exact_f32(precision) -> bool:
    """True when ``precision`` asks for ~f32-accurate dots: IEEE (``HIGHEST``, ``F32_F32_F32``) or 3-pass TF32."""
    if precision in (lax.DotAlgorithmPreset.F32_F32_F32, lax.DotAlgorithmPreset.TF32_TF32_F32_X3):
        return True
    return lax.Precision.HIGHEST in (precision if isinstance(precision, tuple) else (precision,))


def _defaults(kernel: str, precision) -> dict:
    """The launch defaults of ``kernel`` ("fwd", "dcoef", "dx") for this precision."""
    if _is_exact_f32(precision):
        return EXACT_F32_DEFAULTS[kernel]
    return {"fwd": FWD_DEFAULTS, "dcoef": DCOEF_DEFAULTS, "dx": DX_DEFAULTS}[kernel]


def _config(fn: str, defaults: dict, **given) -> dict:
    """Merge non-None arguments over ``defaults`` and validate them."""
    cfg = dict(defaults)
    cfg.update({name: v for name, v in given.items() if v is not None})
    for name, least, what in (("block_b", 16, " (Triton tl.dot)"), ("block_k", 16, " (Triton tl.dot)"),
                              ("block_out", 16, " (Triton tl.dot)"), ("min_inputs", 1, "")):
        v = cfg[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < least or v & (v - 1):
            label = f"'{name}' (inputs per basis tile, at least)" if name == "min_inputs" else f"'{name}'"
            raise ValueError(f"{fn}: {label} must be a power of two >= {least}{what}, got {v!r}")
    _check_pos_int(fn, "num_warps", cfg["num_warps"], "Triton warps")
    if cfg.get("num_stages") is not None:
        _check_pos_int(fn, "num_stages", cfg["num_stages"], "Triton pipeline stages")
    return cfg


def _stages(num_stages: int | None, per_stage_bytes: int) -> int:
    """``num_stages`` if given, else 2 when two copies of the pipelined tiles fit the shared-memory budget."""
    if num_stages is not None:
        return num_stages
    return 2 if 2 * per_stage_bytes <= _SMEM_BUDGET else 1


def _dtypes(*arrays) -> tuple[jnp.dtype, jnp.dtype]:
    """(matrix-unit operand dtype, compute/accumulate dtype)."""
    mdt = jnp.result_type(*[a.dtype for a in arrays])
    return jnp.dtype(mdt), jnp.dtype(jnp.promote_types(mdt, jnp.float32))


def _pad_to(a, shape, mode="constant"):
    pads = [(0, s - d) for s, d in zip(shape, a.shape, strict=True)]
    return a if all(p == (0, 0) for p in pads) else jnp.pad(a, pads, mode=mode)


def _knot_tables(grid, cdt, k: int, n_rows: int, in_pad: int):
    """Per-column tables ``[(k+1) * n_rows, in_pad]`` in ``cdt`` that the kernels read row by row: row ``r`` is
    ``t_r`` (the knots) and row ``p * n_rows + r`` is ``w^{-1}_{p,r}``, the safe reciprocal of ``t_{r+p} - t_r``
    (0 for a zero-width interval), for ``p = 1..k``. Rows past the ``G+2k+1`` knots repeat the last knot (empty
    intervals, reciprocal 0); columns past ``in`` are 0 (every basis there is 0). Parameters only: cheap XLA."""
    t = grid.T.astype(cdt)  # [NK, in]
    t = _pad_to(t, (n_rows, t.shape[1]), mode="edge")
    rows = [t]
    for p in range(1, k + 1):
        w = t[p:] - t[:-p]
        nz = w != 0
        inv = jnp.where(nz, 1 / jnp.where(nz, w, 1), 0).astype(cdt)
        rows.append(_pad_to(inv, t.shape))
    return _pad_to(jnp.concatenate(rows), ((k + 1) * n_rows, in_pad))


# ---------------------------------------------------------------------------------------------------------------
# In-kernel basis evaluation (shared by the three kernels)
# ---------------------------------------------------------------------------------------------------------------
class _KnotTable:
    """Rows of :func:`_knot_tables` for one block of input columns, as ``[1, bk]`` vectors: ``t(r)`` and
    ``inv(p, r)``. Each row is loaded at first use (once per trace), so only the few rows the sweep currently needs
    are live: all ``(k+1)(NB+k+1)`` of them held at once cost a few registers each per thread, which is what made
    the first versions spill."""

    def __init__(self, load_row):
        self._load = load_row  # (p, r) -> [bk]
        self._rows = {}

    def _get(self, p: int, r: int):
        if (p, r) not in self._rows:
            self._rows[(p, r)] = self._load(p, r)[None, :]
        return self._rows[(p, r)]

    def t(self, r: int):
        return self._get(0, r)

    def inv(self, p: int, r: int):
        return self._get(p, r)


def _sweep(x, tab: _KnotTable, n_intervals: int, degree: int):
    """Yield ``(j, B^degree_j(x))`` for ``j = 0 .. n_intervals-1-degree`` by the diagonal Cox-de Boor sweep of the
    module docstring, walking the degree-0 intervals ``0 .. n_intervals-1``."""
    prev: list[Any] = [None] * (degree + 1)  # prev[p] = B^p_{r-1-p}
    for r in range(n_intervals):
        new: list[Any] = [None] * (degree + 1)
        new[0] = ((x >= tab.t(r)) & (x < tab.t(r + 1))).astype(x.dtype)
        for p in range(1, min(r, degree) + 1):
            j = r - p
            new[p] = ((x - tab.t(j)) * tab.inv(p, j) * prev[p - 1]
                      + (tab.t(j + p + 1) - x) * tab.inv(p, j + 1) * new[p - 1])
        prev = new
        if r >= degree:
            yield r - degree, new[degree]


def _interleave(tiles):
    """``[bb, bk]`` tiles ``T_0 .. T_{n-1}`` (``n`` a power of two) -> ``[bb, bk * n]`` with column ``i * n + m`` =
    ``T_m[:, i]``, from two-way stacks only. Stacking ``T_j`` with ``T_{j + n/2}`` first puts the most significant
    bit of ``m`` on the first new axis, so the final row-major reshape lands every basis in its column."""
    bb, bk = tiles[0].shape
    level = list(tiles)
    while len(level) > 1:
        half = len(level) // 2
        level = [jnp.stack([level[j], level[j + half]], axis=-1) for j in range(half)]
    return level[0].reshape(bb, bk * len(tiles))


def _basis_tile(x, tab: _KnotTable, nb: int, nbp: int, k: int, *, derivative: bool = False):
    """The basis tile ``A[bb, bk * nbp]`` of the module docstring (``B_m(x)``, or ``B'_m(x)`` when
    ``derivative``), zero for the padding bases ``m >= nb``."""
    tiles = []
    if derivative:
        prev = None
        for s, low in _sweep(x, tab, nb + k, k - 1):  # B^{k-1}_s, s = 0 .. nb
            if s > 0:  # B'_{s-1} = k [B^{k-1}_{s-1} w^{-1}_{k,s-1} - B^{k-1}_s w^{-1}_{k,s}]
                tiles.append(k * (prev * tab.inv(k, s - 1) - low * tab.inv(k, s)))
            prev = low
    else:
        tiles = [b for _, b in _sweep(x, tab, nb + k, k)]
    tiles += [jnp.zeros_like(x)] * (nbp - nb)
    return _interleave(tiles)


def _dot(a, b, precision, acc_dtype, contract=((1,), (0,))):
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=acc_dtype)


def _mask2(rows_ok, cols_ok):
    return jnp.broadcast_to(rows_ok[:, None] & cols_ok[None, :], (rows_ok.shape[0], cols_ok.shape[0]))


def _contraction_width(cfg: dict, nb: int) -> int:
    """``block_k``, widened to ``min_inputs * nbp`` for a large grid."""
    return max(cfg["block_k"], cfg["min_inputs"] * pl.next_power_of_2(nb))


def _input_block(n_in: int, nbp: int, block_k: int) -> int:
    """Inputs per basis tile: ``block_k // nbp``, at least ``16 // nbp`` (``tl.dot`` needs ``K >= 16``), at most
    ``next_power_of_2(in)`` unless that minimum asks for more; a power of two."""
    return max(1, 16 // nbp, min(block_k // nbp, pl.next_power_of_2(n_in)))


def _coef_flat(coef, nbp: int, in_pad: int, out_pad: int, mdt):
    """``coef[out, in, NB]`` -> ``[out_pad, in_pad * nbp]``, zero padded (parameters only: cheap XLA)."""
    return _pad_to(coef.astype(mdt), (out_pad, in_pad, nbp)).reshape(out_pad, in_pad * nbp)


class _Geometry:
    """Static sizes shared by the three kernel wrappers."""

    def __init__(self, n_in: int, nb: int, k: int, block_k: int):
        self.nb, self.nbp = nb, pl.next_power_of_2(nb)
        self.bk = _input_block(n_in, self.nbp, block_k)
        self.kw = self.bk * self.nbp  # contraction width K of every dot
        self.n_kb = pl.cdiv(n_in, self.bk)
        self.in_pad = self.n_kb * self.bk
        self.n_rows = nb + k + 1  # knot-table rows per p (the G+2k+1 knots)


# ---------------------------------------------------------------------------------------------------------------
# Forward kernel
# ---------------------------------------------------------------------------------------------------------------
def _fwd_kernel(x_ref, t_ref, c_ref, y_ref, *, n_batch, n_in, n_out, bb, bk, n_kb, k, nb, nbp, n_rows, precision,
                cdt, mdt):
    row_ok = (pl.program_id(0) * bb + jnp.arange(bb)) < n_batch
    kw = bk * nbp

    def body(kb, acc):
        start = pl.multiple_of(kb * bk, bk)
        col_ok = (start + jnp.arange(bk)) < n_in
        x = pb.masked_load(x_ref.at[:, pl.ds(start, bk)], _mask2(row_ok, col_ok)).astype(cdt)
        tab = _KnotTable(lambda p, r: t_ref[p * n_rows + r, pl.ds(start, bk)])  # depends on kb: not hoisted
        a = _basis_tile(x, tab, nb, nbp, k).astype(mdt)  # [bb, K]
        c = c_ref[:, pl.ds(pl.multiple_of(kb * kw, kw), kw)]  # [bo, K]
        return acc + _dot(c, a, precision, cdt, contract=((1,), (1,)))  # y^T[bo, bb] += C[bo, K] @ A^T[K, bb]

    acc = lax.fori_loop(0, n_kb, body, jnp.zeros((c_ref.shape[0], bb), cdt))
    pb.masked_store(y_ref, acc.T, pb.block_mask(y_ref.shape, (n_batch, n_out)))


@functools.partial(jax.jit, static_argnames=("k", "precision", "interpret", "bb", "block_k", "bo", "num_warps",
                                             "num_stages"))
def _fwd_call(x, grid, coef, *, k, precision, interpret, bb, block_k, bo, num_warps, num_stages):
    n_batch, n_in = x.shape
    n_out, _, nb = coef.shape
    mdt, cdt = _dtypes(x, coef)
    geo = _Geometry(n_in, nb, k, block_k)
    n_ob = pl.cdiv(n_out, bo)
    t = _knot_tables(grid, cdt, k, geo.n_rows, geo.in_pad)  # [(k+1) n_rows, in_pad]
    c = _coef_flat(coef, geo.nbp, geo.in_pad, n_ob * bo, mdt)  # [out_pad, in_pad * nbp]
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
        num_stages=_stages(num_stages, bo * geo.kw * mdt.itemsize),
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
    n_batch, n_in, n_out, _ = _check_args(fn, x, grid, coef, spline_order)
    cfg = _config(fn, _defaults("fwd", precision), block_b=block_b, block_k=block_k, block_out=block_out,
                  num_warps=num_warps, num_stages=num_stages, min_inputs=min_inputs)
    if n_batch == 0 or n_out == 0 or n_in == 0:
        return jnp.zeros((n_batch, n_out), x.dtype)
    return _fwd_call(
        x, grid, coef, k=spline_order, precision=precision, interpret=pb.resolve_interpret(interpret),
        bb=pb.block_size(n_batch, cfg["block_b"]), block_k=_contraction_width(cfg, coef.shape[2]),
        bo=pb.block_size(n_out, cfg["block_out"]), num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages"))


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
        x = pb.masked_load(x_ref.at[pl.ds(start, bb), :], _mask2(row_ok, col_ok)).astype(cdt)
        g = pb.masked_load(g_ref.at[pl.ds(start, bb), :], _mask2(row_ok, out_ok)).astype(mdt)
        # Knot rows are re-read per batch block (L1/L2 hits). The mask ties the loads to the loop so that the
        # compiler cannot hoist them (hoisted, every row becomes a live [bb, bk] broadcast: hundreds of registers).
        # A batch block wholly past the end reads zero knots: all its bases are then 0 (and its g rows are 0).
        live = jnp.broadcast_to(start < n_batch, (1, bk))
        tab = _KnotTable(lambda p, r: pb.masked_load(t_ref.at[pl.ds(p * n_rows + r, 1), :], live)[0])
        a = _basis_tile(x, tab, nb, nbp, k).astype(mdt)  # [bb, K]
        return acc + _dot(g, a, precision, cdt, contract=((0,), (0,)))  # dC[bo, K] += g^T[bo, bb] @ A[bb, K]

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
    mdt, cdt = _dtypes(x, g)
    geo = _Geometry(n_in, nb, k, block_k)
    n_ob = pl.cdiv(n_out, bo)
    n_bblocks = pl.cdiv(n_batch, bb)
    per = pl.cdiv(n_bblocks, splits)
    splits = pl.cdiv(n_bblocks, per)  # no empty split
    rows = splits * per * bb
    t = _knot_tables(grid, cdt, k, geo.n_rows, geo.in_pad)
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
        num_stages=_stages(num_stages, per_stage),
    )(x, g.astype(mdt), t)
    dcoef = part.sum(0) if splits > 1 else part[0]  # [out_pad, in_pad * nbp]
    return dcoef.reshape(n_ob * bo, geo.in_pad, geo.nbp)[:n_out, :n_in, :nb].astype(out_dtype)


def _dcoef(fn, x, grid, g, k, nb, out_dtype, precision, interpret, cfg, batch_splits):
    n_batch, n_in = x.shape
    n_out = g.shape[1]
    if batch_splits is not None:
        _check_pos_int(fn, "batch_splits", batch_splits, "deterministic partial sums over the batch")
    if n_batch == 0 or n_in == 0 or n_out == 0:
        return jnp.zeros((n_out, n_in, nb), out_dtype)
    interp = pb.resolve_interpret(interpret)
    bb, bo = pb.block_size(n_batch, cfg["block_b"]), pb.block_size(n_out, cfg["block_out"])
    n_bblocks = pl.cdiv(n_batch, bb)
    block_k = _contraction_width(cfg, nb)
    if batch_splits is None:
        n_kb = _Geometry(n_in, nb, k, block_k).n_kb
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
    _check_pos_int(fn, "num_bases", num_bases, "G+k")
    out_dtype = jnp.dtype(coef_dtype) if coef_dtype is not None else None
    n_out = g.shape[-1] if getattr(g, "ndim", 0) == 2 else 0
    n_in = x.shape[-1] if getattr(x, "ndim", 0) == 2 else 0
    coef_like = jax.ShapeDtypeStruct((n_out, n_in, num_bases), out_dtype or jnp.float32)
    _check_args(fn, x, grid, coef_like, spline_order, g)
    cfg = _config(fn, _defaults("dcoef", precision), block_b=block_b, block_k=block_k, block_out=block_out,
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
    mask = _mask2(row_ok, col_ok)

    def body(ob, h):
        start = pl.multiple_of(ob * bo, bo)
        out_ok = (start + jnp.arange(bo)) < n_out
        g = pb.masked_load(g_ref.at[:, pl.ds(start, bo)], _mask2(row_ok, out_ok)).astype(mdt)
        return h + _dot(g, c_ref[pl.ds(start, bo), :], precision, cdt)  # h[bb, K] += g[bb, bo] @ C[bo, K]

    h = lax.fori_loop(0, n_ob, body, jnp.zeros((bb, bk * nbp), cdt))
    x = pb.masked_load(x_ref, mask).astype(cdt)
    tab = _KnotTable(lambda p, r: t_ref[p * n_rows + r, :])
    d = _basis_tile(x, tab, nb, nbp, k, derivative=True)  # A'[bb, K]
    pb.masked_store(o_ref, (d * h).reshape(bb, bk, nbp).sum(axis=-1), mask)  # dx[b, i] = sum_m A' h


@functools.partial(jax.jit, static_argnames=("k", "precision", "interpret", "bb", "block_k", "bo", "num_warps",
                                             "num_stages"))
def _dx_call(x, grid, coef, g, *, k, precision, interpret, bb, block_k, bo, num_warps, num_stages):
    n_batch, n_in = x.shape
    n_out, _, nb = coef.shape
    mdt, cdt = _dtypes(x, coef, g)
    geo = _Geometry(n_in, nb, k, block_k)
    n_ob = pl.cdiv(n_out, bo)
    t = _knot_tables(grid, cdt, k, geo.n_rows, geo.in_pad)
    c = _coef_flat(coef, geo.nbp, geo.in_pad, n_ob * bo, mdt)  # [out_pad, in_pad * nbp]
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
        num_stages=_stages(num_stages, bb * bo * mdt.itemsize + bo * geo.kw * mdt.itemsize),
    )(x, g.astype(mdt), t, c)


def _dx(x, grid, coef, g, k, precision, interpret, cfg):
    n_batch, n_in = x.shape
    n_out, _, nb = coef.shape
    if n_batch == 0 or n_in == 0 or n_out == 0:
        return jnp.zeros((n_batch, n_in), x.dtype)
    return _dx_call(x, grid, coef, g, k=k, precision=precision, interpret=pb.resolve_interpret(interpret),
                    bb=pb.block_size(n_batch, cfg["block_b"]), block_k=_contraction_width(cfg, nb),
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
    _check_args(fn, x, grid, coef, spline_order, g)
    cfg = _config(fn, _defaults("dx", precision), block_b=block_b, block_k=block_k, block_out=block_out,
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
    _check_args(fn, x, grid, coef, spline_order, g)
    configs = []
    for name, defaults, given in (("dcoef_config", _defaults("dcoef", precision), dcoef_config),
                                  ("dx_config", _defaults("dx", precision), dx_config)):
        given = dict(given or {})
        unknown = set(given) - set(defaults)
        if unknown:
            raise ValueError(f"{fn}: '{name}' has unknown keys {sorted(unknown)}; allowed: {sorted(defaults)}")
        configs.append(_config(fn, defaults, **given))
    mdt, _ = _dtypes(x, coef, g)
    dcoef = _dcoef(fn, x, grid, g.astype(mdt), spline_order, coef.shape[2], coef.dtype, precision, interpret,
                   configs[0], batch_splits)
    dx = _dx(x, grid, coef, g, spline_order, precision, interpret, configs[1])
    return dx, dcoef
