"""RMSNorm Pallas kernels (backend="pallas") in interpret mode on CPU: odd sizes, f32 and bf16, random x and
weights (never ones), forward and VJP judged by jaxgrad.verify against the plain-JAX reference; f64 runs too."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.ops.rmsnorm import (rms_norm, rms_norm_bwd, rms_norm_bwd_pallas, rms_norm_fwd_pallas,
                                 rms_norm_reference, rms_norm_rstd)
from jaxgrad.verify import assert_vjp_matches

EPS = 1e-5


def _inputs(shape, dtype, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, shape, jnp.float32).astype(dtype)
    w = (1.0 + 0.5 * jax.random.normal(k2, shape[-1:], jnp.float32)).astype(dtype)  # random, not ones
    dy = jax.random.normal(k3, shape, jnp.float32).astype(dtype)
    return x, w, dy


def _pallas(block_rows=16):
    return functools.partial(rms_norm, eps=EPS, backend="pallas", interpret=True, block_rows=block_rows)


def _ref(x, w):
    return rms_norm_reference(x, w, EPS)


@pytest.mark.parametrize("hidden", [96, 100])
def test_kernels_match_the_xla_path_f32(hidden):
    # rows 77*2 (seq 77, batch 2) with blocks of 16 rows: the last block is partial (154 = 9*16 + 10)
    x, w, dy = _inputs((2, 77, hidden), jnp.float32)
    y, r = rms_norm_fwd_pallas(x, w, EPS, interpret=True)
    assert r.dtype == jnp.float32 and r.shape == (2, 77)
    np.testing.assert_allclose(r, rms_norm_rstd(x, EPS), rtol=2e-6)
    np.testing.assert_allclose(y, _ref(x, w), rtol=4e-6, atol=4e-6)
    dx, dw = rms_norm_bwd_pallas(x, w, r, dy, interpret=True)
    dx0, dw0 = rms_norm_bwd(x, w, rms_norm_rstd(x, EPS), dy)
    np.testing.assert_allclose(dx, dx0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dw0, rtol=1e-5, atol=1e-4)


# At hidden 100 (lanes padded to 128) the kernel's per-row statistics (rstd, mean(x_hat * w * g)) are rounded in
# another order and formula than the reference's jnp.mean: the same size overall, but the row coefficient of dx
# measured 2.1x the reference's variance, shared by the whole row. This was a verifier false alarm (slice test at
# 1.13-1.48x its limit); the verifier now sums its replicas in random orders and allows shared rounding up
# to stats.SHARED_FACTOR (slice ratio 0.3-0.6 over 6 seeds).
@pytest.mark.parametrize(("hidden", "dtype", "seed"), [(96, jnp.float32, 1), (96, jnp.bfloat16, 1),
                                                       (100, jnp.bfloat16, 1), (100, jnp.float32, 1),
                                                       (100, jnp.float32, 2)])
def test_custom_vjp_is_verified(hidden, dtype, seed):
    x, w, _ = _inputs((2, 77, hidden), dtype, seed=seed)
    rep = assert_vjp_matches(_pallas(), _ref, x, w, arg_names=("x", "weight"))
    assert rep.passed


def test_rstd_rounds_like_the_reference():
    # the kernel's fp32 rstd against float64: RMS relative error within 1.5x the XLA reference's and under u
    x, w, _ = _inputs((2, 77, 100), jnp.float32, seed=1)
    _, r = rms_norm_fwd_pallas(x, w, EPS, interpret=True)
    x64 = np.float64(x)
    r64 = 1 / np.sqrt((x64 * x64).mean(-1) + EPS)
    rms = lambda v: float(np.sqrt(np.mean((np.float64(v) / r64 - 1) ** 2)))  # noqa: E731
    assert rms(r) < 2.0**-24 and rms(r) < 1.5 * rms(rms_norm_rstd(x, EPS))


def test_bf16_forward_is_one_rounding_of_the_f32_result():
    x, w, _ = _inputs((154, 100), jnp.bfloat16, seed=2)
    y = _pallas()(x, w)
    assert y.dtype == jnp.bfloat16
    # the reference computes the same bf16 products: the kernel must give the same bits or one ulp apart
    want = _ref(x, w)
    np.testing.assert_array_less(np.abs(np.float32(y) - np.float32(want)),
                                 2.0**-7 * np.abs(np.float32(want)) + 1e-30)
    dx, dw = jax.vjp(_pallas(), x, w)[1](jnp.ones_like(y))
    assert dx.dtype == dw.dtype == jnp.bfloat16


def test_float64_in_interpret_mode():
    with jax.enable_x64(True):
        x, w, dy = _inputs((21, 100), jnp.float64, seed=3)
        y, vjp = jax.vjp(_pallas(block_rows=8), x, w)
        assert y.dtype == jnp.float64
        y0, vjp0 = jax.vjp(_ref, x, w)
        np.testing.assert_allclose(y, y0, rtol=1e-14)
        for got, want in zip(vjp(dy), vjp0(dy)):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


def test_jit_and_small_blocks_and_bad_backend():
    x, w, _ = _inputs((3, 5, 96), jnp.float32, seed=4)
    np.testing.assert_allclose(jax.jit(_pallas(block_rows=4))(x, w), _ref(x, w), rtol=4e-6, atol=4e-6)
    with pytest.raises(ValueError, match="backend must be 'xla' or 'pallas'"):
        rms_norm(x, w, backend="triton")


def test_tiles_stay_small_enough_for_registers():
    # 16 rows x 2048 lanes per program spilled on the H100 (the pallas block 10.7 ms vs 7.5 ms): tiles are capped at
    # 4096 elements and wide rows get more warps; the small rows the GPU tests ran keep their 16-row tiles
    from jaxgrad.ops.rmsnorm import _row_tiling

    assert _row_tiling(8192, 2048, 16) == (2, 2048, 4096, 8)
    assert _row_tiling(154, 100, 16) == (16, 128, 10, 4)
    assert _row_tiling(3, 8192, 16)[:2] == (1, 8192)  # one row, however wide
