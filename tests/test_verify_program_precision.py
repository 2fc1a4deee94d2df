"""A gradient's precision is read from the program that computed it (jaxgrad/verify/program_precision.py).

The false alarm this prevents: a correct conv whose backward rounds to bf16 while its forward computes finer (an
explicit f32 forward, or an explicit bf16 cast that XLA's GPU compiler drops: excess precision) was judged at the
forward's precision and reported as a bug. Specification:
- the precision of each output is the coarsest rounding on its way: dtypes, ``reduce_precision``, products (f32 at
  the default precision take the platform's), Pallas kernels through their bodies; read from the jaxpr (what fn
  asks) and from XLA's optimized HLO (what XLA kept);
- a forward in f32 with a backward that rounds the cotangent to bf16 passes, each gradient judged at bf16, and the
  report says the gradients' precision differs from the forward's;
- the same backward with a 2% or 10% scale error in one gradient fails on that gradient;
- where XLA kept a finer precision than fn asks (excess precision), the coarser is used and the report says so;
- the same conv tests run on a GPU (``gpu`` marker), where XLA may drop the casts of the bf16-cast forward.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxgrad.verify import check_vjp
from jaxgrad.verify import core
from jaxgrad.verify.program_precision import OutputPrecision, hlo_precisions, jaxpr_precisions

QUIET = dict(float64=False, fd=False, adjoint=False, structural=False, seed=3)
DN = ("NHWC", "HWIO", "NHWC")
HI = lax.Precision.HIGHEST


def _conv(x, w, dtype=None, precision=HI):
    out = x.dtype  # f32 as called, f64 in the verifier's oracle
    if dtype is not None:
        x, w = x.astype(dtype), w.astype(dtype)
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=DN, precision=precision)
    return y.astype(out)


def conv_f32_forward_bf16_backward(scale_dx=1.0, scale_dw=1.0, bf16_forward=False):
    """f32 in and out. Forward: the conv in f32 (or cast to bf16 inside, ``bf16_forward``); backward: ``jax.vjp`` of
    the bf16 conv at the cotangent rounded to bf16, as a user writes a mixed-precision VJP."""
    @jax.custom_vjp
    def conv(x, w):
        return _conv(x, w, jnp.bfloat16 if bf16_forward else None)

    def fwd(x, w):
        return conv(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        _, pb = jax.vjp(lambda a, b: _conv(a, b, jnp.bfloat16, None), x, w)
        dx, dw = pb(g.astype(jnp.bfloat16).astype(jnp.float32))
        return scale_dx * dx, scale_dw * dw

    conv.defvjp(fwd, bwd)
    return conv


def reference(x, w):
    return _conv(x, w)


@pytest.fixture
def args():
    rng = np.random.default_rng(11)
    return (jnp.asarray(rng.standard_normal((2, 9, 7, 5)), jnp.float32),
            jnp.asarray(rng.standard_normal((3, 3, 5, 6)) / 4, jnp.float32))


# ----------------------------------------------------------------------------------------- reading the program
def test_a_bf16_backward_behind_an_f32_forward_reads_as_bf16_for_each_gradient(args):
    def vjp(a, c):
        y, pb = jax.vjp(conv_f32_forward_bf16_backward(), *a)
        return y, pb(c)

    ct = jnp.ones((2, 9, 7, 6), jnp.float32)
    read = jaxpr_precisions(vjp, args, ct, platform="f32")
    assert [p for p, _ in read] == ["f32", "bf16", "bf16"]
    assert "bf16" in read[1][1]


def test_the_compiled_program_is_read_too(args):
    def vjp(a, c):
        y, pb = jax.vjp(conv_f32_forward_bf16_backward(), *a)
        return y, pb(c)

    ct = jnp.ones((2, 9, 7, 6), jnp.float32)
    text = jax.jit(vjp).lower(args, ct).compile().as_text()
    assert [p for p, _ in hlo_precisions(text, platform="f32")] == ["f32", "bf16", "bf16"]


def test_a_pallas_kernel_declares_its_precision_through_its_body():
    from jaxgrad.ops.swiglu import swiglu_fwd_pallas

    g = jnp.ones((16, 256), jnp.bfloat16)
    read = jaxpr_precisions(lambda a, b: swiglu_fwd_pallas(a, b, interpret=True), g, g)
    assert [p for p, _ in read] == ["bf16"]


def test_excess_precision_is_judged_at_what_the_function_asks():
    o = OutputPrecision(asked="bf16", asked_why="bf16 operands of conv_general_dilated", kept="f32",
                        kept_why="f32 values")
    assert o.judged == "bf16" and o.excess
    assert "excess precision" in o.describe()
    assert not OutputPrecision("f32", "", "tf32", "cuBLAS").excess
    assert OutputPrecision("f32", "", "tf32", "cuBLAS").judged == "tf32"  # a coarser compiled program counts


# ----------------------------------------------------------------------------------------------------- verdicts
def test_a_correct_bf16_backward_behind_an_f32_forward_passes(args):
    rep = check_vjp(conv_f32_forward_bf16_backward(), reference, *args, **QUIET)
    assert rep.passed, rep
    assert rep.precision.precision == "f32"
    assert [lf.run for lf in rep.leaves] == ["bf16", "bf16"]
    assert any("coarser than the forward's f32" in n for n in rep.notes), rep.notes


def test_the_bf16_cast_forward_twin_passes(args):
    rep = check_vjp(conv_f32_forward_bf16_backward(bf16_forward=True), reference, *args, **QUIET)
    assert rep.passed, rep
    assert [lf.run for lf in rep.leaves] == ["bf16", "bf16"]


@pytest.mark.parametrize("scale", [0.02, 0.10])
@pytest.mark.parametrize("where", ["dx", "dw"])
def test_a_planted_scale_error_in_the_bf16_backward_is_caught(args, where, scale):
    kw = {"scale_dx": 1 + scale} if where == "dx" else {"scale_dw": 1 + scale}
    rep = check_vjp(conv_f32_forward_bf16_backward(**kw), reference, *args, **QUIET)
    assert not rep.passed and not rep.undetermined, rep
    assert [lf.name for lf in rep.failures] == ["args[0]" if where == "dx" else "args[1]"]
    assert all(lf.run == "bf16" for lf in rep.leaves)


def test_excess_precision_in_the_compiled_program_is_reported(args, monkeypatch):
    """As on a GPU that drops the bf16 casts: the HLO reads f32 where the jaxpr asks bf16; bf16 is used."""
    monkeypatch.setattr("jaxgrad.verify.program_precision.hlo_precisions",
                        lambda text, platform="f32": [("f32", "f32 values")] * 3)
    rep = check_vjp(conv_f32_forward_bf16_backward(bf16_forward=True), reference, *args, **QUIET)
    assert rep.passed, rep
    assert [lf.run for lf in rep.leaves] == ["bf16", "bf16"]
    assert any("excess precision" in n for n in rep.notes), rep.notes
    assert "excess precision" in dict(rep.program_precision)["args[0]"]


def test_an_unreadable_program_leaves_the_forward_s_precision_and_says_so(args, monkeypatch):
    monkeypatch.setattr(core, "program_precisions", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("x")))
    rep = check_vjp(conv_f32_forward_bf16_backward(), reference, *args, **QUIET)
    assert not rep.passed  # judged at the forward's f32, as before
    assert any("could not be read" in n for n in rep.notes)


# ---------------------------------------------------------------------------------------------------- the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("bf16_forward", [False, True], ids=["f32-forward", "bf16-cast-forward"])
def test_on_the_gpu_a_correct_bf16_conv_backward_passes_and_a_wrong_one_fails(bf16_forward):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((4, 17, 13, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 3, 8, 12)) / 6, jnp.float32)
    rep = check_vjp(conv_f32_forward_bf16_backward(bf16_forward=bf16_forward), reference, x, w, seed=3)
    assert rep.passed, rep
    assert [lf.run for lf in rep.leaves if lf.run != "f64"] == ["bf16", "bf16"]
    for kw in ({"scale_dx": 1.02}, {"scale_dw": 1.10}):
        bad = check_vjp(conv_f32_forward_bf16_backward(bf16_forward=bf16_forward, **kw), reference, x, w,
                        **QUIET)
        assert not bad.passed and not bad.undetermined, bad
