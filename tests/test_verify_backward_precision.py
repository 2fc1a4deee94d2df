"""The backward may run in another precision than the forward (cuDNN/cuBLAS choose each product's algorithm).

Specification, with the platform's default precision for f32 products patched to TF32 (as on a GPU):
- a dense layer whose forward is exact f32 and whose backward rounds its operands to TF32 passes, judged as TF32,
  and the report says why;
- on a platform whose default is f32 (the CPU) the same function fails: nothing allows a TF32 backward there;
- a TF32 backward with a 1% weight-gradient error still fails under the TF32 platform default;
- the fallback never goes coarser than the platform default (a bf16 backward is not excused by it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxgrad.verify import check_vjp
from jaxgrad.verify import core
from jaxgrad.verify import precision as prec

QUIET = dict(float64=False, fd=False, adjoint=False, structural=False, seed=7)
HI = lax.Precision.HIGHEST


def _reference(x, w):
    return jnp.dot(x, w, precision=HI)


def _forward_f32_backward_at(fmt, dw_scale=1.0):
    rnd = lambda a: lax.reduce_precision(a, *fmt)  # noqa: E731

    @jax.custom_vjp
    def f(x, w):
        return jnp.dot(x, w, precision=HI)

    def fwd(x, w):
        return f(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        return jnp.dot(rnd(g), rnd(w).T, precision=HI), dw_scale * jnp.dot(rnd(x).T, rnd(g), precision=HI)

    f.defvjp(fwd, bwd)
    return f


@pytest.fixture
def args():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((64, 96)), jnp.float32),
            jnp.asarray(rng.standard_normal((96, 80)) / 10, jnp.float32))


@pytest.fixture
def gpu_default(monkeypatch):
    monkeypatch.setattr(core.prec, "platform_precision", lambda: ("tf32", "patched: a GPU's default"))


def test_a_tf32_backward_behind_an_f32_forward_is_judged_as_tf32_on_a_gpu(args, gpu_default):
    rep = check_vjp(_forward_f32_backward_at((8, 10)), _reference, *args, **QUIET)
    assert rep.passed, rep
    assert rep.precision.precision == "tf32"
    assert any("the gradients only with tf32" in n for n in rep.notes), rep.notes


def test_the_same_function_fails_where_the_platform_computes_f32(args):
    assert prec.platform_precision()[0] == "f32"  # the CPU
    rep = check_vjp(_forward_f32_backward_at((8, 10)), _reference, *args, **QUIET)
    assert not rep.passed and rep.precision.precision == "f32", rep


def test_a_wrong_tf32_backward_still_fails_on_a_gpu(args, gpu_default):
    rep = check_vjp(_forward_f32_backward_at((8, 10), dw_scale=1.01), _reference, *args, **QUIET)
    assert not rep.passed and not rep.undetermined, rep


def test_a_bf16_backward_is_not_excused_by_the_tf32_default(args, gpu_default):
    rep = check_vjp(_forward_f32_backward_at((8, 7)), _reference, *args, **QUIET)
    assert not rep.passed, rep
