"""Launch configuration of the KAN spline kernels (:mod:`jaxgrad.kan.kernels`): default tiles per precision,
argument checks and the dtype policy.

**Default blocks** (:data:`FWD_DEFAULTS`, :data:`DCOEF_DEFAULTS`, :data:`DX_DEFAULTS`) are the fastest of a timed
sweep on an H100 (f32, TF32 dots, ``B=16384, in=out=512, G=5, k=3``;
``benchmarks/logs/kan-wide-probe-nvidia-h100-80gb-hbm3-tf32-20261123-015550.log``): forward (128, 128, 256),
8 warps, 2 stages 0.89-0.95 ms; dcoef (64, 128, 128), 8 warps, 1 split 1.45 ms; dx (128, 128, 64), 8 warps,
2 stages 1.51 ms. The kernels they
replaced (one ``K = 16`` dot per basis) took 1.21 / 1.61 / 1.77 ms in the same run. Larger tiles run out of
shared memory (the forward at ``bo = 512``: 256 KB > 227 KB) or registers (``bb = bo = 256`` at 16 warps); read
the error and shrink the block.
Exact-f32 dots use :data:`EXACT_F32_DEFAULTS` (small tiles, 4 warps, one stage): IEEE dots are FMA loops in
registers on Triton, where the TF32 tiles spill (forward 37.8 ms vs 6.15 ms with the small tiles), and 3-pass TF32
keeps hi/lo operand copies in shared memory, where the TF32 tiles ask for ~400 KB
(``benchmarks/logs/kan-kernels-sweep-nvidia-h100-80gb-hbm3-highest-20261123-024231.log``).

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

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

__all__ = [
    "DCOEF_DEFAULTS",
    "DX_DEFAULTS",
    "EXACT_F32_DEFAULTS",
    "FWD_DEFAULTS",
    "SMEM_BUDGET",
    "check_args",
    "check_pos_int",
    "contraction_width",
    "is_exact_f32",
    "kernel_dtypes",
    "launch_config",
    "launch_defaults",
    "pipeline_stages",
]

# Upper bounds of the batch and output tiles (clipped to next_power_of_2 of each dimension, floor 16), the
# contraction width block_k = bk * nbp, and Triton's launch parameters: the fastest of a timed H100 sweep (module
# docstring; f32 TF32, B=16384, 512->512, G=5, k=3).
# min_inputs: the contraction widens to min_inputs * nbp when block_k would leave fewer inputs per tile. At G=20
# (nbp=32) eight inputs per tile (block_k=256) took dcoef from 6.21 to 3.12 ms; dx did not gain (5.15 vs 5.29 ms)
# (benchmarks/logs/kan-kernels-sweep-g20-nvidia-h100-80gb-hbm3-tf32-20261123-030537.log). The forward gained too
# (3.86 -> 3.31 ms), but only with block_out=128 and one stage: its [block_out, K] coefficient tiles at 256 x 256 and
# two stages need ~400 KB of shared memory (the block has 227 KB), so it stays at K=128 by default.
FWD_DEFAULTS = {"block_b": 128, "block_k": 128, "block_out": 256, "num_warps": 8, "num_stages": 2, "min_inputs": 1}
DCOEF_DEFAULTS = {"block_b": 64, "block_k": 128, "block_out": 128, "num_warps": 8, "num_stages": 2, "min_inputs": 8}
DX_DEFAULTS = {"block_b": 128, "block_k": 128, "block_out": 64, "num_warps": 8, "num_stages": 2, "min_inputs": 1}
# Exact-f32 dots. IEEE (precision=HIGHEST) is an FMA loop in registers on Triton: the TF32 tiles spill and ran
# 2.6-9x slower (fwd 37.8 ms, dcoef 24.2, dx 8.5); these are the fastest of
# benchmarks/logs/kan-kernels-sweep-nvidia-h100-80gb-hbm3-highest-20261123-024231.log: fwd 6.15 ms, dcoef 2.79,
# dx 2.42 (H100, same shapes).
# 3-pass TF32 keeps hi/lo copies of the operands in shared memory: with the TF32 tiles it asked for ~400 KB of the
# 227 KB a block has, so it uses these small tiles too.
EXACT_F32_DEFAULTS = {
    "fwd": {"block_b": 64, "block_k": 32, "block_out": 64, "num_warps": 4, "num_stages": 1, "min_inputs": 1},
    "dcoef": {"block_b": 32, "block_k": 64, "block_out": 64, "num_warps": 4, "num_stages": 1, "min_inputs": 1},
    "dx": {"block_b": 32, "block_k": 128, "block_out": 32, "num_warps": 4, "num_stages": 1, "min_inputs": 1},
}
SMEM_BUDGET = 200 * 1024  # bytes of shared memory a 2-stage pipeline may take (the hardware has 227 KB)


def check_args(fn: str, x, grid, coef, spline_order, g=None) -> tuple[int, int, int, int]:
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


def check_pos_int(fn: str, name: str, value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{fn}: '{name}' ({what}) must be a positive int, got {value!r}")
    return value


def is_exact_f32(precision) -> bool:
    """True when ``precision`` asks for ~f32-accurate dots: IEEE (``HIGHEST``, ``F32_F32_F32``) or 3-pass TF32."""
    if precision in (lax.DotAlgorithmPreset.F32_F32_F32, lax.DotAlgorithmPreset.TF32_TF32_F32_X3):
        return True
    return lax.Precision.HIGHEST in (precision if isinstance(precision, tuple) else (precision,))


def launch_defaults(kernel: str, precision) -> dict:
    """The launch defaults of ``kernel`` ("fwd", "dcoef", "dx") for this precision."""
    if is_exact_f32(precision):
        return EXACT_F32_DEFAULTS[kernel]
    return {"fwd": FWD_DEFAULTS, "dcoef": DCOEF_DEFAULTS, "dx": DX_DEFAULTS}[kernel]


def launch_config(fn: str, defaults: dict, **given) -> dict:
    """Merge non-None arguments over ``defaults`` and validate them."""
    cfg = dict(defaults)
    cfg.update({name: v for name, v in given.items() if v is not None})
    for name, least, what in (("block_b", 16, " (Triton tl.dot)"), ("block_k", 16, " (Triton tl.dot)"),
                              ("block_out", 16, " (Triton tl.dot)"), ("min_inputs", 1, "")):
        v = cfg[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < least or v & (v - 1):
            label = f"'{name}' (inputs per basis tile, at least)" if name == "min_inputs" else f"'{name}'"
            raise ValueError(f"{fn}: {label} must be a power of two >= {least}{what}, got {v!r}")
    check_pos_int(fn, "num_warps", cfg["num_warps"], "Triton warps")
    if cfg.get("num_stages") is not None:
        check_pos_int(fn, "num_stages", cfg["num_stages"], "Triton pipeline stages")
    return cfg


def pipeline_stages(num_stages: int | None, per_stage_bytes: int) -> int:
    """``num_stages`` if given, else 2 when two copies of the pipelined tiles fit the shared-memory budget."""
    if num_stages is not None:
        return num_stages
    return 2 if 2 * per_stage_bytes <= SMEM_BUDGET else 1


def kernel_dtypes(*arrays) -> tuple[jnp.dtype, jnp.dtype]:
    """(matrix-unit operand dtype, compute/accumulate dtype)."""
    mdt = jnp.result_type(*[a.dtype for a in arrays])
    return jnp.dtype(mdt), jnp.dtype(jnp.promote_types(mdt, jnp.float32))



def contraction_width(cfg: dict, nb: int) -> int:
    """``block_k``, widened to ``min_inputs * nbp`` for a large grid."""
    return max(cfg["block_k"], cfg["min_inputs"] * pl.next_power_of_2(nb))

