"""check_vjp refuses bad input with an error that names the problem."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxgrad.verify import VJPUnavailableError, check_vjp

X = jax.random.normal(jax.random.key(0), (5, 3))
W = jax.random.normal(jax.random.key(1), (3, 4))


def matmul(x, w):
    return x @ w


def test_reference_with_transposed_output_shape_is_named():
    with pytest.raises(ValueError, match=r"fn returns shape \(5, 4\) but reference returns shape \(4, 5\)"):
        check_vjp(matmul, lambda x, w: (x @ w).T, X, W)


def test_reference_with_different_output_structure_is_named():
    with pytest.raises(ValueError, match="different structures"):
        check_vjp(matmul, lambda x, w: (x @ w, x), X, W)


def test_integer_argument_is_named_with_its_path():
    idx = jnp.arange(3)
    with pytest.raises(TypeError, match=r"args\[1\]\['idx'\] has dtype int32.*functools.partial"):
        check_vjp(lambda x, p: x[:, p["idx"]], lambda x, p: x[:, p["idx"]], X, {"idx": idx})


def test_non_array_argument_is_refused():
    with pytest.raises(TypeError, match=r"args\[1\] is a str"):
        check_vjp(lambda x, s: x, lambda x, s: x, X, "relu")


def test_nan_argument_is_refused():
    with pytest.raises(ValueError, match=r"args\[0\] contains NaN"):
        check_vjp(matmul, matmul, X.at[0, 0].set(jnp.nan), W)


def test_integer_output_is_refused():
    with pytest.raises(TypeError, match="output leaf 0 of fn has dtype int32"):
        check_vjp(lambda x: jnp.argmax(x, 0), lambda x: jnp.argmax(x, 0), X)


def test_no_arguments_and_non_callables_are_refused():
    with pytest.raises(ValueError, match="pass the arguments"):
        check_vjp(matmul, matmul)
    with pytest.raises(TypeError, match="'reference' must be callable"):
        check_vjp(matmul, 3, X, W)


def test_failing_forward_is_reported_with_context():
    with pytest.raises(ValueError, match=r"calling reference\(\*args\) failed"):
        check_vjp(matmul, lambda x, w: x @ w.T, X, W)


def test_function_without_vjp_pure_callback():
    def host_tanh(x):
        return jax.pure_callback(lambda a: np.tanh(a), jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    with pytest.raises(VJPUnavailableError, match="fn has no VJP"):
        check_vjp(host_tanh, jnp.tanh, X)


def test_function_without_vjp_raw_pallas_call():
    def double_kernel(x_ref, o_ref):
        o_ref[...] = 2 * x_ref[...]

    raw = functools.partial(pl.pallas_call(double_kernel, out_shape=jax.ShapeDtypeStruct((8, 16), jnp.float32),
                                           interpret=True))
    x = jax.random.normal(jax.random.key(2), (8, 16))
    with pytest.raises(VJPUnavailableError, match="fn has no VJP"):
        check_vjp(raw, lambda x: 2 * x, x)


def test_bad_cotangent_shape_is_named():
    with pytest.raises(ValueError, match="'cotangent' must have fn's output structure"):
        check_vjp(matmul, matmul, X, W, cotangent=jnp.ones((4, 5)))


def test_bad_precision_name_is_named():
    with pytest.raises(ValueError, match="precision must be one of"):
        check_vjp(matmul, matmul, X, W, precision="fp8")
