"""Each gradient is judged at the precision of the program that computed it, not at its forward's alone.

A backward may round more coarsely than its forward (a bf16 cotangent behind an exact f32 forward, cuBLAS / cuDNN
choosing TF32 for the backward's products, a bf16 flash-attention backward). Specification:
- a dense layer whose forward is exact f32 and whose backward rounds its operands to TF32 or bf16 passes: the
  forward is judged f32, each gradient at the precision its own program rounds to, and the report says which;
- the same coarse backward with a weight-gradient error (1% at TF32, 5% at bf16) fails: a backward is judged at
  its own precision, never excused beyond it;
- f32 products at the default precision count as the platform's default (TF32 on a GPU, f32 on the CPU);
- where fn's program cannot be read, the old rule stands: a gradient may be judged at the platform's default when
  the forward agrees with it too, never coarser.
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
    """Exact f32 forward; the backward's products with operands rounded to ``fmt`` (at HIGHEST), or at the default
    precision (``fmt=None``)."""
    rnd = (lambda a: a) if fmt is None else (lambda a: lax.reduce_precision(a, *fmt))  # noqa: E731
    prec = None if fmt is None else HI

    @jax.custom_vjp
    def f(x, w):
        return jnp.dot(x, w, precision=HI)

    def fwd(x, w):
        return f(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        return jnp.dot(rnd(g), rnd(w).T, precision=prec), dw_scale * jnp.dot(rnd(x).T, rnd(g), precision=prec)

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


def test_a_tf32_backward_behind_an_f32_forward_is_judged_as_tf32_from_its_program(args):
    rep = check_vjp(_forward_f32_backward_at((8, 10)), _reference, *args, **QUIET)
    assert rep.passed, rep
    assert rep.precision.precision == "f32"  # the forward
    assert [lf.run for lf in rep.leaves] == ["tf32", "tf32"]
    assert "reduce_precision to tf32" in dict(rep.program_precision)["args[0]"], rep.program_precision
    assert "judged at tf32, not the forward's f32" in str(rep)


def test_a_bf16_backward_behind_an_f32_forward_is_judged_as_bf16(args):
    rep = check_vjp(_forward_f32_backward_at((8, 7)), _reference, *args, **QUIET)
    assert rep.passed, rep
    assert [lf.run for lf in rep.leaves] == ["bf16", "bf16"]


@pytest.mark.parametrize(("fmt", "scale"), [((8, 10), 1.01), ((8, 7), 1.05)], ids=["tf32-1pct", "bf16-5pct"])
def test_a_wrong_coarse_backward_still_fails(args, fmt, scale):
    rep = check_vjp(_forward_f32_backward_at(fmt, dw_scale=scale), _reference, *args, **QUIET)
    assert not rep.passed and not rep.undetermined, rep
    assert [lf.name for lf in rep.failures] == ["args[1]"]


def test_default_precision_products_take_the_platform_default(args):
    from jaxgrad.verify.program_precision import jaxpr_precisions

    def vjp(a, c):
        y, pb = jax.vjp(_forward_f32_backward_at(None), *a)
        return y, pb(c)

    ct = jnp.ones((64, 80), jnp.float32)
    assert [p for p, _ in jaxpr_precisions(vjp, args, ct, platform="tf32")] == ["f32", "tf32", "tf32"]
    assert [p for p, _ in jaxpr_precisions(vjp, args, ct, platform="f32")] == ["f32", "f32", "f32"]


@pytest.fixture
def unreadable_program(monkeypatch):
    monkeypatch.setattr(core, "_program_precision", lambda *a: None)


def test_without_the_program_a_tf32_backward_is_judged_at_the_platform_default(args, gpu_default,
                                                                                unreadable_program):
    rep = check_vjp(_forward_f32_backward_at((8, 10)), _reference, *args, **QUIET)
    assert rep.passed, rep
    assert rep.precision.precision == "tf32"
    assert any("the gradients only with tf32" in n for n in rep.notes), rep.notes


def test_without_the_program_a_tf32_backward_fails_where_the_platform_computes_f32(args, unreadable_program):
    assert prec.platform_precision()[0] == "f32"  # the CPU
    rep = check_vjp(_forward_f32_backward_at((8, 10)), _reference, *args, **QUIET)
    assert not rep.passed and rep.precision.precision == "f32", rep


def test_without_the_program_a_bf16_backward_is_not_excused_by_the_tf32_default(args, gpu_default,
                                                                                 unreadable_program):
    rep = check_vjp(_forward_f32_backward_at((8, 7)), _reference, *args, **QUIET)
    assert not rep.passed, rep
