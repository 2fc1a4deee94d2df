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

so :math:`B^k_{r-k}` is complete after step :math:`r` and is consumed (one ``dot``) at once: :math:`O(k)`
elementwise ops per basis and :math:`k+1` live ``[bb, bk]`` tiles, whatever ``G``. The knots :math:`t_r` and the
safe reciprocal widths :math:`w^{-1}_{p,r}` are per-column tables built by the wrapper (``[(k+1) rows, in]``, from
parameters only) and read by the kernel one ``[bk]`` row at a time, at first use. The arithmetic matches the
plain-JAX reference up to the rounding of ``a * (1/w)`` versus ``a / w``.

**Kernels** (``bb, bk, bo``: batch, input and output block sizes, powers of two >= 16 because Triton needs
power-of-two arrays and ``tl.dot`` every dimension >= 16; each is clipped to ``next_power_of_2`` of its dimension):

* forward: grid ``(cdiv(B, bb), cdiv(out, bo))``; each program loops over the input blocks (``fori_loop``),
  sweeps the ``NB`` bases of its ``[bb, bk]`` tile and accumulates ``y^T[bo, bb] += c_m^T[bo, bk] @ B_m^T[bk, bb]``
  (``coef`` re-arranged by the wrapper as ``[NB, in, out]``). The bases are the dot's second operand, which the
  Hopper ``wgmma`` reads from shared memory, so they are computed in a plain blocked layout (as the first operand
  they were computed in the ``wgmma`` register-operand layout, which costs more registers). The bases are
  recomputed once per output block: ``bo`` trades the accumulator's registers against that recomputation.
* dcoef: grid ``(S, cdiv(in, bk), cdiv(out, bo), cdiv(NB, bm))``; a program owns bases ``m0 .. m0+bm-1`` of an
  ``[out, in]`` tile (``bm`` accumulators ``[bo, bk]``), loops over its share of the batch blocks and adds
  ``g^T[bo, bb] @ B_m[bb, bk]`` (bases again the second operand: with them first, Triton replicated the whole
  sweep in every warp). The sweep of a chunk starts at interval ``m0`` and runs ``bm + k`` steps. ``S`` splits the
  batch when the other axes give too few programs (``batch_splits``); the ``S`` f32 partials are summed by XLA
  (deterministic: no atomics). The output is written as ``[NB, out, in]`` and transposed by XLA.
* dx: grid ``(cdiv(B, bb), cdiv(in, bk))``; for each chunk of ``bm`` bases (static loop) the program loops over the
  output blocks accumulating ``h_m[bb, bk] += g[bb, bo] @ c_m[bo, bk]`` (``coef`` re-arranged as
  ``[NB, out, in]``), then sweeps the degree ``k-1`` bases once and adds ``B'_m * h_m``. ``bm`` bounds the
  accumulators' registers.

**Default blocks** (:data:`FWD_DEFAULTS`, :data:`DCOEF_DEFAULTS`, :data:`DX_DEFAULTS`) were chosen by compiling
the kernels offline for sm_90a (the TTIR Pallas emits, compiled by pip ``triton`` 3.6 and ``ptxas -v``; not the
Triton inside XLA, and not timed) at ``B=16384, in=out=512, G=5, k=3``, f32, to avoid register spills: forward
(64, 16, 128), 8 warps: 233 registers, no spill; dcoef (64, 16, 128, bm=8), 8 warps: 174, no spill; dx
(64, 16, 64, bm=8), 8 warps: 106, no spill (bf16: 147 / 175 / 107). With 4 warps or larger tiles all three hit
255 registers and spill; k=5 spills a little in fwd and dx. ``precision=HIGHEST`` (no tensor cores) spills in
dcoef (~2 KB per thread at the defaults; ``block_m=4`` is the first thing to try there).
Shared memory grows with ``num_stages * NB * bk * bo`` (the pipelined coefficient tiles): ``num_stages=None``
picks 2 when that fits in ~200 KB (an H100/H200 block has 227 KB) and 1 otherwise; e.g. the forward at
(64, 32, 128) with 2 stages needs 276 KB and would not launch.

**Edges.** Batch rows and input/output columns beyond the arrays are masked on load (read as 0) and on store.
``coef`` is re-arranged and zero-padded to whole blocks by the wrapper (parameters only: cheap), so a padded input
or output column contributes exactly 0; padded knot-table columns are 0 (every basis there is 0) and rows past the
last knot (the last chunk of ``bm`` bases) repeat it (empty intervals: bases 0).

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
    "kan_spline_backward",
    "kan_spline_backward_reference",
    "kan_spline_dcoef",
    "kan_spline_dx",
    "kan_spline_forward",
    "kan_spline_forward_reference",
]

# Upper bounds of the tiles (clipped to next_power_of_2 of each dimension, floor 16) and Triton warps; see the
# module docstring for how they were chosen. ``num_stages`` defaults to None: 2 when the pipelined tiles fit.
# Tuned on an H200 (benchmarks/logs/kan-kernels-sweep-h200-20261122.log, f32 TF32, B=16384, 512->512, G=5, k=3):
# forward with one pipeline stage 1.23 ms vs 1.72 ms with two; dx with 128-row batch blocks 1.57 ms vs 2.27 ms.
FWD_DEFAULTS = {"block_b": 64, "block_in": 16, "block_out": 128, "num_warps": 8, "num_stages": 1}
DCOEF_DEFAULTS = {"block_b": 64, "block_in": 16, "block_out": 128, "block_m": 8, "num_warps": 8}
DX_DEFAULTS = {"block_b": 128, "block_in": 16, "block_out": 64, "block_m": 8, "num_warps": 8}
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


def _config(fn: str, defaults: dict, **given) -> dict:
    """Merge non-None arguments over ``defaults`` and validate them."""
    cfg = dict(defaults)
    cfg.update({name: v for name, v in given.items() if v is not None})
    for name in ("block_b", "block_in", "block_out"):
        v = cfg[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{fn}: '{name}' must be a power of two >= 16 (Triton tl.dot), got {v!r}")
    if "block_m" in cfg:
        _check_pos_int(fn, "block_m", cfg["block_m"], "bases per program")
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
    """Rows of :func:`_knot_tables` for one block of input columns, as ``[1, bk]`` vectors indexed relative to the
    first basis of the sweep: ``t(r)`` and ``inv(p, r)``. Each row is loaded at first use (once per trace), so only
    the few rows the sweep currently needs are live: all ``(k+1)(NB+k+1)`` of them held at once cost a few
    registers each per thread, which is what made the first versions spill."""

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
    """Yield ``(j, B^degree_j(x))`` for ``j = 0 .. n_intervals-1-degree`` (relative indices) by the diagonal
    Cox-de Boor sweep of the module docstring, walking the degree-0 intervals ``0 .. n_intervals-1``."""
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


def _dot(a, b, precision, acc_dtype, contract=((1,), (0,))):
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=acc_dtype)


def _mask2(rows_ok, cols_ok):
    return jnp.broadcast_to(rows_ok[:, None] & cols_ok[None, :], (rows_ok.shape[0], cols_ok.shape[0]))


# ---------------------------------------------------------------------------------------------------------------
# Forward kernel
# ---------------------------------------------------------------------------------------------------------------
def _fwd_kernel(x_ref, t_ref, c_ref, y_ref, *, n_batch, n_in, n_out, bb, bk, bo, n_kb, k, nb, precision, cdt, mdt):
    row_ok = (pl.program_id(0) * bb + jnp.arange(bb)) < n_batch

    def body(kb, acc):
        start = pl.multiple_of(kb * bk, bk)
        col_ok = (start + jnp.arange(bk)) < n_in
        x = pb.masked_load(x_ref.at[:, pl.ds(start, bk)], _mask2(row_ok, col_ok)).astype(cdt)
        tab = _KnotTable(lambda p, r: t_ref[p * (nb + k + 1) + r, pl.ds(start, bk)])  # depends on kb: not hoisted
        for m, b_m in _sweep(x, tab, nb + k, k):
            # y^T[bo, bb] += c_m^T[bo, bk] @ B_m^T[bk, bb]
            acc = acc + _dot(c_ref[m, pl.ds(start, bk), :], b_m.astype(mdt), precision, cdt, contract=((0,), (1,)))
        return acc

    acc = lax.fori_loop(0, n_kb, body, jnp.zeros((bo, bb), cdt))
    pb.masked_store(y_ref, acc.T, pb.block_mask((bb, bo), (n_batch, n_out)))


@functools.partial(jax.jit, static_argnames=("k", "precision", "interpret", "bb", "bk", "bo", "num_warps",
                                             "num_stages"))
def _fwd_call(x, grid, coef, *, k, precision, interpret, bb, bk, bo, num_warps, num_stages):
    n_batch, n_in = x.shape
    n_out, _, nb = coef.shape
    mdt, cdt = _dtypes(x, coef)
    n_kb, n_ob = pl.cdiv(n_in, bk), pl.cdiv(n_out, bo)
    in_pad, out_pad = n_kb * bk, n_ob * bo
    t = _knot_tables(grid, cdt, k, nb + k + 1, in_pad)  # [(k+1) NK, in_pad]
    c = _pad_to(jnp.transpose(coef, (2, 1, 0)).astype(mdt), (nb, in_pad, out_pad))  # [NB, in_pad, out_pad]
    kernel = functools.partial(_fwd_kernel, n_batch=n_batch, n_in=n_in, n_out=n_out, bb=bb, bk=bk, bo=bo,
                               n_kb=n_kb, k=k, nb=nb, precision=precision, cdt=cdt, mdt=mdt)
    per_stage = (nb * bk * bo * mdt.itemsize + (k + 1) * (nb + k + 1) * bk * cdt.itemsize
                 + bb * bk * x.dtype.itemsize)
    return pb.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_batch, n_out), x.dtype),
        grid=(pl.cdiv(n_batch, bb), n_ob),
        in_specs=[
            pl.BlockSpec((bb, in_pad), lambda b, o: (b, 0)),
            pl.BlockSpec(((k + 1) * (nb + k + 1), in_pad), lambda b, o: (0, 0)),
            pl.BlockSpec((nb, in_pad, bo), lambda b, o: (0, 0, o)),
        ],
        out_specs=pl.BlockSpec((bb, bo), lambda b, o: (b, o)),
        name="kan_spline_fwd",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=_stages(num_stages, per_stage),
    )(x, t, c)


def kan_spline_forward(
    x: jax.Array,
    grid: jax.Array,
    coef: jax.Array,
    spline_order: int,
    *,
    precision: Any = None,
    interpret: bool | None = None,
    block_b: int = FWD_DEFAULTS["block_b"],
    block_in: int = FWD_DEFAULTS["block_in"],
    block_out: int = FWD_DEFAULTS["block_out"],
    num_warps: int = FWD_DEFAULTS["num_warps"],
    num_stages: int | None = FWD_DEFAULTS["num_stages"],
) -> jax.Array:
    r"""Spline part of a KAN layer, :math:`y[b,o] = \sum_i \sum_m B_m(x_{bi})\, c[o,i,m]`, in one fused kernel.

    Args:
      x: ``[B, in]`` inputs (bf16, f32 or f64).
      grid: ``[in, G+2k+1]`` non-decreasing knot rows (any float dtype; used in ``promote(x, coef, f32)``).
      coef: ``[out, in, G+k]`` coefficients (efficient-kan layout; fold ``spline_scaler`` in first).
      spline_order: the degree ``k`` (3 = cubic).
      precision: ``None`` (platform default: TF32 for f32 on the GPU), ``jax.lax.Precision.HIGHEST`` (IEEE f32)
        or a ``jax.lax.DotAlgorithmPreset`` the Triton lowering accepts (e.g. ``TF32_TF32_F32_X3``).
      interpret: force Pallas interpret mode (``None``: on unless running on a GPU).
      block_b, block_in, block_out: tile upper bounds (powers of two >= 16), see the module docstring.
      num_warps, num_stages: Triton launch parameters (ignored in interpret mode); ``num_stages=None`` picks 2
        when the pipelined coefficient tiles fit in shared memory, else 1.
    Returns:
      ``y[B, out]`` in ``x.dtype``. The ``[B, in, G+k]`` basis is never materialised.
    """
    fn = "kan_spline_forward"
    n_batch, n_in, n_out, _ = _check_args(fn, x, grid, coef, spline_order)
    cfg = _config(fn, FWD_DEFAULTS, block_b=block_b, block_in=block_in, block_out=block_out, num_warps=num_warps,
                  num_stages=num_stages)
    if n_batch == 0 or n_out == 0 or n_in == 0:
        return jnp.zeros((n_batch, n_out), x.dtype)
    return _fwd_call(
        x, grid, coef, k=spline_order, precision=precision, interpret=pb.resolve_interpret(interpret),
        bb=pb.block_size(n_batch, cfg["block_b"]), bk=pb.block_size(n_in, cfg["block_in"]),
        bo=pb.block_size(n_out, cfg["block_out"]), num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages"))


# ---------------------------------------------------------------------------------------------------------------
# dcoef kernel
# ---------------------------------------------------------------------------------------------------------------
def _dcoef_kernel(x_ref, g_ref, t_ref, o_ref, *, n_batch, n_in, n_out, bb, bk, bo, per, k, bm, n_rows, precision,
                  cdt, mdt):
    split, ib, ob, chunk = (pl.program_id(a) for a in range(4))
    col_ok = (ib * bk + jnp.arange(bk)) < n_in
    out_ok = (ob * bo + jnp.arange(bo)) < n_out
    m0 = chunk * bm

    def body(step, accs):
        start = pl.multiple_of((split * per + step) * bb, bb)
        row_ok = (start + jnp.arange(bb)) < n_batch
        x = pb.masked_load(x_ref.at[pl.ds(start, bb), :], _mask2(row_ok, col_ok)).astype(cdt)
        g = pb.masked_load(g_ref.at[pl.ds(start, bb), :], _mask2(row_ok, out_ok)).astype(mdt)
        # Knot rows are re-read per batch block (L1/L2 hits). The mask ties the loads to the loop so that the
        # compiler cannot hoist them (hoisted, every row becomes a live [bb, bk] broadcast: hundreds of registers).
        # A batch block wholly past the end reads zero knots: all its bases are then 0 (and its g rows are 0).
        live = jnp.broadcast_to(start < n_batch, (bk,))
        tab = _KnotTable(lambda p, r: pb.masked_load(t_ref.at[p * n_rows + m0 + r, :], live))
        new = list(accs)
        for s, b_s in _sweep(x, tab, bm + k, k):
            new[s] = new[s] + _dot(g, b_s.astype(mdt), precision, cdt, contract=((0,), (0,)))  # g^T[bo,bb] @ B
        return tuple(new)

    accs = lax.fori_loop(0, per, body, tuple(jnp.zeros((bo, bk), cdt) for _ in range(bm)))
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
    t = _knot_tables(grid, cdt, k, nb_pad + k + 1, in_pad)
    kernel = functools.partial(_dcoef_kernel, n_batch=n_batch, n_in=n_in, n_out=n_out, bb=bb, bk=bk, bo=bo,
                               per=per, k=k, bm=bm, n_rows=nb_pad + k + 1, precision=precision, cdt=cdt, mdt=mdt)
    per_stage = bb * bk * x.dtype.itemsize + bb * bo * mdt.itemsize + (k + 1) * (bm + k + 1) * bk * cdt.itemsize
    part = pb.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, nb_pad, out_pad, in_pad), cdt),
        grid=(splits, n_ib, n_ob, n_chunks),
        in_specs=[
            pl.BlockSpec((rows, bk), lambda s, i, o, c: (0, i)),
            pl.BlockSpec((rows, bo), lambda s, i, o, c: (0, o)),
            pl.BlockSpec(((k + 1) * (nb_pad + k + 1), bk), lambda s, i, o, c: (0, i)),
        ],
        out_specs=pl.BlockSpec((pl.squeezed, bm, bo, bk), lambda s, i, o, c: (s, c, o, i)),
        name="kan_spline_dcoef",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=_stages(num_stages, per_stage),
    )(x, g.astype(mdt), t)
    dcoef = part.sum(0) if splits > 1 else part[0]  # [NB_pad, out_pad, in_pad]
    return jnp.transpose(dcoef[:nb, :n_out, :n_in], (1, 2, 0)).astype(out_dtype)


def _dcoef(fn, x, grid, g, k, nb, out_dtype, precision, interpret, cfg, batch_splits):
    n_batch, n_in = x.shape
    n_out = g.shape[1]
    if batch_splits is not None:
        _check_pos_int(fn, "batch_splits", batch_splits, "deterministic partial sums over the batch")
    if n_batch == 0 or n_in == 0 or n_out == 0:
        return jnp.zeros((n_out, n_in, nb), out_dtype)
    interp = pb.resolve_interpret(interpret)
    bb, bk = pb.block_size(n_batch, cfg["block_b"]), pb.block_size(n_in, cfg["block_in"])
    bo, bm = pb.block_size(n_out, cfg["block_out"]), min(cfg["block_m"], nb)
    n_bblocks = pl.cdiv(n_batch, bb)
    if batch_splits is None:
        batch_splits = _auto_splits(pl.cdiv(n_in, bk) * pl.cdiv(n_out, bo) * pl.cdiv(nb, bm), n_bblocks, interp)
    return _dcoef_call(x, grid, g, nb=nb, k=k, precision=precision, interpret=interp, bb=bb, bk=bk, bo=bo, bm=bm,
                       splits=min(batch_splits, n_bblocks), num_warps=cfg["num_warps"],
                       num_stages=cfg.get("num_stages"), out_dtype=jnp.dtype(out_dtype))


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
    block_b: int = DCOEF_DEFAULTS["block_b"],
    block_in: int = DCOEF_DEFAULTS["block_in"],
    block_out: int = DCOEF_DEFAULTS["block_out"],
    block_m: int = DCOEF_DEFAULTS["block_m"],
    batch_splits: int | None = None,
    num_warps: int = DCOEF_DEFAULTS["num_warps"],
    num_stages: int | None = None,
) -> jax.Array:
    r""":math:`\bar c[o,i,m] = \sum_b g[b,o]\, B_m(x_{bi})`: ``[out, in, num_bases]`` in ``coef_dtype`` (default
    ``result_type(x, g)``). ``num_bases = G + k``; ``block_m`` bases per program; ``batch_splits`` (``None``:
    automatic) splits the batch reduction into deterministic f32 partials summed by XLA."""
    fn = "kan_spline_dcoef"
    _check_pos_int(fn, "num_bases", num_bases, "G+k")
    out_dtype = jnp.dtype(coef_dtype) if coef_dtype is not None else None
    n_out = g.shape[-1] if getattr(g, "ndim", 0) == 2 else 0
    n_in = x.shape[-1] if getattr(x, "ndim", 0) == 2 else 0
    coef_like = jax.ShapeDtypeStruct((n_out, n_in, num_bases), out_dtype or jnp.float32)
    _check_args(fn, x, grid, coef_like, spline_order, g)
    cfg = _config(fn, DCOEF_DEFAULTS, block_b=block_b, block_in=block_in, block_out=block_out, block_m=block_m,
                  num_warps=num_warps, num_stages=num_stages)
    return _dcoef(fn, x, grid, g, spline_order, num_bases, out_dtype or jnp.result_type(x.dtype, g.dtype),
                  precision, interpret, cfg, batch_splits)


# ---------------------------------------------------------------------------------------------------------------
# dx kernel
# ---------------------------------------------------------------------------------------------------------------
def _dx_kernel(x_ref, g_ref, t_ref, c_ref, o_ref, *, n_batch, n_in, n_out, bb, bk, bo, n_ob, k, bm, n_chunks,
               precision, cdt, mdt):
    nb_pad = n_chunks * bm
    row_ok = (pl.program_id(0) * bb + jnp.arange(bb)) < n_batch
    col_ok = (pl.program_id(1) * bk + jnp.arange(bk)) < n_in
    mask = _mask2(row_ok, col_ok)
    x = pb.masked_load(x_ref, mask).astype(cdt)
    dx = jnp.zeros((bb, bk), cdt)
    for chunk in range(n_chunks):  # static: bm accumulators live at a time
        m0 = chunk * bm

        def body(ob, hs, m0=m0):
            start = pl.multiple_of(ob * bo, bo)
            out_ok = (start + jnp.arange(bo)) < n_out
            g = pb.masked_load(g_ref.at[:, pl.ds(start, bo)], _mask2(row_ok, out_ok)).astype(mdt)
            return tuple(hs[s] + _dot(g, c_ref[m0 + s, pl.ds(start, bo), :], precision, cdt) for s in range(bm))

        hs = lax.fori_loop(0, n_ob, body, tuple(jnp.zeros((bb, bk), cdt) for _ in range(bm)))
        tab = _KnotTable(lambda p, r, m0=m0: t_ref[p * (nb_pad + k + 1) + m0 + r, :])
        prev = None
        for s, low in _sweep(x, tab, bm + k, k - 1):  # B^{k-1}_{m0+s}, s = 0 .. bm, consumed as they come
            if s > 0:  # B'_{m0+s-1} = k [B^{k-1}_{m0+s-1} / w_{k,m0+s-1} - B^{k-1}_{m0+s} / w_{k,m0+s}]
                dx = dx + k * (prev * tab.inv(k, s - 1) - low * tab.inv(k, s)) * hs[s - 1]
            prev = low
    pb.masked_store(o_ref, dx, mask)


@functools.partial(jax.jit, static_argnames=("k", "precision", "interpret", "bb", "bk", "bo", "bm", "num_warps",
                                             "num_stages"))
def _dx_call(x, grid, coef, g, *, k, precision, interpret, bb, bk, bo, bm, num_warps, num_stages):
    n_batch, n_in = x.shape
    n_out, _, nb = coef.shape
    mdt, cdt = _dtypes(x, coef, g)
    n_ib, n_ob, n_chunks = pl.cdiv(n_in, bk), pl.cdiv(n_out, bo), pl.cdiv(nb, bm)
    in_pad, out_pad, nb_pad = n_ib * bk, n_ob * bo, n_chunks * bm
    t = _knot_tables(grid, cdt, k, nb_pad + k + 1, in_pad)
    c = _pad_to(jnp.transpose(coef, (2, 0, 1)).astype(mdt), (nb_pad, out_pad, in_pad))  # [NB_pad, out, in]
    kernel = functools.partial(_dx_kernel, n_batch=n_batch, n_in=n_in, n_out=n_out, bb=bb, bk=bk, bo=bo, n_ob=n_ob,
                               k=k, bm=bm, n_chunks=n_chunks, precision=precision, cdt=cdt, mdt=mdt)
    per_stage = bb * bo * mdt.itemsize + bm * bo * bk * mdt.itemsize
    return pb.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_batch, n_in), x.dtype),
        grid=(pl.cdiv(n_batch, bb), n_ib),
        in_specs=[
            pl.BlockSpec((bb, bk), lambda b, i: (b, i)),
            pl.BlockSpec((bb, out_pad), lambda b, i: (b, 0)),
            pl.BlockSpec(((k + 1) * (nb_pad + k + 1), bk), lambda b, i: (0, i)),
            pl.BlockSpec((nb_pad, out_pad, bk), lambda b, i: (0, 0, i)),
        ],
        out_specs=pl.BlockSpec((bb, bk), lambda b, i: (b, i)),
        name="kan_spline_dx",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=_stages(num_stages, per_stage),
    )(x, g.astype(mdt), t, c)


def _dx(x, grid, coef, g, k, precision, interpret, cfg):
    n_batch, n_in = x.shape
    n_out, _, nb = coef.shape
    if n_batch == 0 or n_in == 0 or n_out == 0:
        return jnp.zeros((n_batch, n_in), x.dtype)
    return _dx_call(x, grid, coef, g, k=k, precision=precision, interpret=pb.resolve_interpret(interpret),
                    bb=pb.block_size(n_batch, cfg["block_b"]), bk=pb.block_size(n_in, cfg["block_in"]),
                    bo=pb.block_size(n_out, cfg["block_out"]), bm=min(cfg["block_m"], nb),
                    num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages"))


def kan_spline_dx(
    x: jax.Array,
    grid: jax.Array,
    coef: jax.Array,
    g: jax.Array,
    spline_order: int,
    *,
    precision: Any = None,
    interpret: bool | None = None,
    block_b: int = DX_DEFAULTS["block_b"],
    block_in: int = DX_DEFAULTS["block_in"],
    block_out: int = DX_DEFAULTS["block_out"],
    block_m: int = DX_DEFAULTS["block_m"],
    num_warps: int = DX_DEFAULTS["num_warps"],
    num_stages: int | None = None,
) -> jax.Array:
    r""":math:`\bar x[b,i] = \sum_m B'_m(x_{bi}) \sum_o g[b,o]\, c[o,i,m]`: ``[B, in]`` in ``x.dtype``."""
    fn = "kan_spline_dx"
    _check_args(fn, x, grid, coef, spline_order, g)
    cfg = _config(fn, DX_DEFAULTS, block_b=block_b, block_in=block_in, block_out=block_out, block_m=block_m,
                  num_warps=num_warps, num_stages=num_stages)
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
    :data:`DCOEF_DEFAULTS` / :data:`DX_DEFAULTS` (``block_b``, ``block_in``, ``block_out``, ``block_m``,
    ``num_warps``, ``num_stages``). ``dx`` is in ``x.dtype``, ``dcoef`` in ``coef.dtype``; the dots run in
    ``result_type(x, coef, g)``.
    """
    fn = "kan_spline_backward"
    _check_args(fn, x, grid, coef, spline_order, g)
    configs = []
    for name, defaults, given in (("dcoef_config", DCOEF_DEFAULTS, dcoef_config), ("dx_config", DX_DEFAULTS,
                                                                                   dx_config)):
        given = dict(given or {})
        unknown = set(given) - set(defaults) - {"num_stages"}
        if unknown:
            raise ValueError(f"{fn}: '{name}' has unknown keys {sorted(unknown)}; allowed: "
                             f"{sorted(set(defaults) | {'num_stages'})}")
        configs.append(_config(fn, defaults, **given))
    mdt, _ = _dtypes(x, coef, g)
    dcoef = _dcoef(fn, x, grid, g.astype(mdt), spline_order, coef.shape[2], coef.dtype, precision, interpret,
                   configs[0], batch_splits)
    dx = _dx(x, grid, coef, g, spline_order, precision, interpret, configs[1])
    return dx, dcoef
