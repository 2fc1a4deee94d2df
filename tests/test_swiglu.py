"""SwiGLU: the Pallas kernels and the XLA path agree with the reference, forward and backward, and the custom VJP
is proven by jaxgrad.verify. Kernels run in interpret mode on CPU; the `gpu` tests compile them with Triton."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.ops.swiglu import swiglu, swiglu_reference
from jaxgrad.verify import assert_vjp_matches

ODD_SHAPES = [(1, 1), (1, 7), (7, 129), (129, 33), (3, 5, 17), (300,)]


def _inputs(shape, dtype, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k1, shape, dtype), jax.random.normal(k2, shape, dtype),
            jax.random.normal(k3, shape, dtype))


def _grads(f, a, u, g):
    return jax.vjp(f, a, u)[1](g)


@pytest.mark.parametrize("backend", ["pallas", "xla"])
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_forward_and_grads_match_reference_f32(backend, shape):
    a, u, g = _inputs(shape, jnp.float32)
    f = functools.partial(swiglu, backend=backend)
    np.testing.assert_allclose(f(a, u), swiglu_reference(a, u), rtol=2e-6, atol=2e-6)
    for got, want in zip(_grads(f, a, u, g), _grads(swiglu_reference, a, u, g)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["pallas", "xla"])
@pytest.mark.parametrize("shape", [(1, 7), (7, 129), (129, 33)])
def test_bf16_is_computed_in_f32_and_rounded_once(backend, shape):
    a, u, g = _inputs(shape, jnp.bfloat16)
    f = functools.partial(swiglu, backend=backend)
    y = f(a, u)
    assert y.dtype == jnp.bfloat16
    # one bf16 rounding of an f32-exact result: |err| <= 2^-8 |y|
    want = swiglu_reference(a.astype(jnp.float32), u.astype(jnp.float32))
    np.testing.assert_array_less(np.abs(np.float32(y) - want), 2.0**-8 * np.abs(want) + 1e-30)
    da, du = _grads(f, a, u, g)
    assert da.dtype == du.dtype == jnp.bfloat16


@pytest.mark.parametrize("backend", ["pallas", "xla"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_custom_vjp_is_verified(backend, dtype):
    a, u, _ = _inputs((7, 129), dtype, seed=3)
    assert_vjp_matches(functools.partial(swiglu, backend=backend), swiglu_reference, a, u)


def test_pallas_path_runs_in_float64_for_the_verifier():
    with jax.enable_x64(True):
        a, u, g = _inputs((7, 33), jnp.float64)
        y = swiglu(a, u, backend="pallas")
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(y, swiglu_reference(a, u), rtol=1e-15)


def test_jit_vmap_and_blocks_smaller_than_the_array():
    a, u, g = _inputs((4, 9, 70), jnp.float32)
    f = jax.jit(functools.partial(swiglu, backend="pallas", block_rows=2, block_cols=16))
    np.testing.assert_allclose(jax.vmap(f)(a, u), swiglu_reference(a, u), rtol=2e-6, atol=2e-6)


def test_bad_input_is_named():
    a = jnp.ones((3, 4))
    with pytest.raises(ValueError, match=r"'gate' and 'up' must have the same shape, got \(3, 4\) and \(4, 3\)"):
        swiglu(a, a.T)
    with pytest.raises(TypeError, match="'up' must be a floating-point array, got int32"):
        swiglu(a, jnp.ones((3, 4), jnp.int32))
    with pytest.raises(TypeError, match="same dtype"):
        swiglu(a, a.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="backend must be 'xla' or 'pallas'"):
        swiglu(a, a, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(1, 7), (7, 129), (129, 4099), (4096, 1024)])
def test_gpu_triton_kernels_match_reference(shape, dtype):
    a, u, _ = _inputs(shape, dtype, seed=5)
    f = functools.partial(swiglu, backend="pallas", interpret=False)
    assert_vjp_matches(f, swiglu_reference, a, u, fd=shape[0] * shape[1] < 100_000)
