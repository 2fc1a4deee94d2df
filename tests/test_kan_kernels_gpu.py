"""The KAN spline kernels (jaxgrad.kan.kernels) compiled by Triton under launch configurations other than the
defaults, and under 3-pass TF32, against the float64 reference (``tests/test_kan_kernels.py``'s error model:
every entry within ``tol * M``, ``M = sum |terms|`` of its sum).

A launch configuration (tile sizes, warps, pipeline stages, batch splits) may change the order of the
accumulation, never the result beyond rounding: each configuration listed here -- the tiles a user or a benchmark
may pick, for the TF32 default, for IEEE f32 and for a large grid (G = 20, whose padded bases widen the
contraction) -- must meet the same tolerance as the defaults. Sizes are odd (no dimension a multiple of a tile).
Their timings belong to the benchmark suites (``jaxgrad.bench``).
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxgrad.kan import kernels as K
from tests.test_kan_kernels import BF16_TOL, TF32_U, assert_close_to_magnitude, make_inputs, reference64

pytestmark = pytest.mark.gpu

HIGHEST = jax.lax.Precision.HIGHEST
TF32_X3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
# name: (dtype, precision, tolerance against M); TF32 operands (possibly truncated) <= 4u per product, slack 2x;
# IEEE f32 and 3-pass TF32 (hi*hi + hi*lo + lo*hi, ~2^-21 per product) as exact-f32 dots
MODES = {"f32-tf32": (jnp.float32, None, 8 * TF32_U), "f32-highest": (jnp.float32, HIGHEST, 3e-5),
         "f32-3xtf32": (jnp.float32, TF32_X3, 3e-5), "bf16": (jnp.bfloat16, None, BF16_TOL)}

# Tiles for the TF32 / bf16 defaults' neighbourhood (block_k = bk * nbp: the contraction over inputs x bases)
TF32_CONFIGS = {
    "fwd": [dict(block_b=128, block_k=128, block_out=256, num_warps=8, num_stages=1),
            dict(block_b=64, block_k=128, block_out=256, num_warps=8, num_stages=1),
            dict(block_b=128, block_k=128, block_out=128, num_warps=8, num_stages=2),
            dict(block_b=128, block_k=256, block_out=128, num_warps=8, num_stages=1)],
    "dcoef": [dict(block_b=128, block_k=128, block_out=128, num_warps=8),
              dict(block_b=64, block_k=256, block_out=128, num_warps=8, num_stages=1),
              dict(block_b=64, block_k=128, block_out=128, num_warps=8, batch_splits=2)],
    "dx": [dict(block_b=128, block_k=128, block_out=128, num_warps=8),
           dict(block_b=128, block_k=128, block_out=32, num_warps=8),
           dict(block_b=128, block_k=256, block_out=64, num_warps=8, num_stages=1),
           dict(block_b=64, block_k=128, block_out=128, num_warps=8)],
}
# IEEE f32 dots are FMA loops in registers: smaller tiles
HIGHEST_CONFIGS = {
    "fwd": [dict(block_b=64, block_k=128, block_out=64, num_warps=8, num_stages=1),
            dict(block_b=64, block_k=64, block_out=128, num_warps=8, num_stages=1),
            dict(block_b=32, block_k=128, block_out=128, num_warps=4, num_stages=1),
            dict(block_b=64, block_k=32, block_out=64, num_warps=4, num_stages=1)],
    "dcoef": [dict(block_b=64, block_k=128, block_out=64, num_warps=8, num_stages=1),
              dict(block_b=32, block_k=64, block_out=64, num_warps=4, num_stages=1),
              dict(block_b=32, block_k=128, block_out=32, num_warps=4, num_stages=1)],
    "dx": [dict(block_b=64, block_k=128, block_out=64, num_warps=8, num_stages=1),
           dict(block_b=64, block_k=64, block_out=64, num_warps=4, num_stages=1),
           dict(block_b=32, block_k=128, block_out=32, num_warps=4, num_stages=1)],
}
# G = 20: 32 padded bases per input, so block_k = 128 holds 4 inputs; wider contractions. The forward's
# coefficient tile (block_k x block_out f32) must leave room in the 227 KiB of shared memory of an H100 block:
# 256 x 256 or 512 x 128 (256 KiB) do not launch (RESOURCE_EXHAUSTED, an error, not a wrong result)
LARGE_GRID_CONFIGS = {
    "fwd": [dict(block_b=128, block_k=256, block_out=128, num_warps=8, num_stages=1),
            dict(block_b=64, block_k=256, block_out=128, num_warps=4, num_stages=1),
            dict(block_b=64, block_k=128, block_out=256, num_warps=8, num_stages=1)],
    "dcoef": [dict(block_b=64, block_k=256, block_out=128, num_warps=8, num_stages=1),
              dict(block_b=64, block_k=512, block_out=64, num_warps=8, num_stages=1)],
    "dx": [dict(block_b=128, block_k=256, block_out=64, num_warps=8, num_stages=1),
           dict(block_b=64, block_k=512, block_out=64, num_warps=8, num_stages=1)],
}


def _cases(configs, modes, grid_size):
    return [pytest.param(kind, cfg, mode, grid_size, id=f"{mode}-G{grid_size}-{kind}-{i}")
            for mode in modes for kind, cfgs in configs.items() for i, cfg in enumerate(cfgs)]


CASES = (_cases(TF32_CONFIGS, ("f32-tf32", "bf16"), 5) + _cases(HIGHEST_CONFIGS, ("f32-highest",), 5)
         + _cases(LARGE_GRID_CONFIGS, ("f32-tf32",), 20))


def _run(kind, cfg, x, grid, coef, g, k, precision):
    if kind == "fwd":
        return K.kan_spline_forward(x, grid, coef, k, precision=precision, interpret=False, **cfg)
    if kind == "dcoef":
        return K.kan_spline_dcoef(x, grid, g, k, coef.shape[-1], coef_dtype=coef.dtype, precision=precision,
                                  interpret=False, **cfg)
    return K.kan_spline_dx(x, grid, coef, g, k, precision=precision, interpret=False, **cfg)


@functools.lru_cache(maxsize=None)
def _case(grid_size, mode, k=3):
    """Odd sizes (B 1031, in 129, out 257) and the float64 reference, once per grid size and mode."""
    x, grid, coef, g = make_inputs(1000 + grid_size, 1031, 129, 257, grid_size, k, MODES[mode][0])
    (y_w, dx_w, dc_w), (m_y, m_dx, m_dc) = reference64(x, grid, coef, g, k)
    return (x, grid, coef, g), {"fwd": (y_w, m_y), "dx": (dx_w, m_dx), "dcoef": (dc_w, m_dc)}


@pytest.mark.parametrize("kind, cfg, mode, grid_size", CASES)
def test_gpu_launch_configuration_meets_the_error_model(kind, cfg, mode, grid_size):
    dtype, precision, tol = MODES[mode]
    k = 3
    (x, grid, coef, g), reference = _case(grid_size, mode, k)
    want, mag = reference[kind]
    got = _run(kind, cfg, x, grid, coef, g, k, precision)
    assert got.dtype == dtype
    assert_close_to_magnitude(kind, got, want, mag, tol)


@pytest.mark.parametrize("n_batch", [129, 4099])
def test_gpu_three_pass_tf32_is_as_accurate_as_ieee_f32(n_batch):
    """``TF32_TF32_F32_X3`` (three TF32 products per f32 product on the tensor cores) keeps the exact-f32 bound."""
    dtype, precision, tol = MODES["f32-3xtf32"]
    k = 3
    x, grid, coef, g = make_inputs(2000 + n_batch, n_batch, 129, 257, 5, k, dtype)
    (y_w, dx_w, dc_w), (m_y, m_dx, m_dc) = reference64(x, grid, coef, g, k)
    assert_close_to_magnitude("y", K.kan_spline_forward(x, grid, coef, k, precision=precision, interpret=False),
                              y_w, m_y, tol)
    dx, dcoef = K.kan_spline_backward(x, grid, coef, g, k, precision=precision, interpret=False)
    assert_close_to_magnitude("dx", dx, dx_w, m_dx, tol)
    assert_close_to_magnitude("dcoef", dcoef, dc_w, m_dc, tol)
