r"""A catalogue of hand-written VJPs with planted bugs: the verifier's own test set, shipped so that you can run it.

Why a user wants it: a gradient verifier is only as good as what it catches and what it lets pass on *your*
hardware and precision. ``jaxgrad audit --planted`` (or :func:`all_cases` with :func:`jaxgrad.verify.check_vjp`)
runs the catalogue where you run your ops -- your GPU, its TF32 / bf16 defaults, your JAX version -- and shows the
verifier failing every planted bug, with its diagnosis, and passing every correct twin (including low-precision
kernels, where a careless verifier raises false alarms). :func:`with_backward_edit` plants a bug of your own in any
function's backward, to see whether the verifier would catch it in your op. The verifier's tests
(``tests/test_verify_planted.py``) run the same catalogue.

Each :class:`PlantedCase` pairs a ``jax.custom_vjp`` function ``fn`` (written by hand, either *correct* or with one
*planted bug*) with a plain-JAX ``reference`` of the same signature, whose VJP ``jax.vjp`` derives. A gradient
verifier must

* PASS every correct case (``buggy=False``): the hand-written backward equals ``jax.vjp(reference)`` up to rounding,
  including the low-precision ones (bf16 operands inside, a 10^6-term reduction, a float32-only kernel), where the
  verifier has to find the precision the function really computes in instead of raising a false alarm;
* FAIL every buggy case (``buggy=True``) on the argument leaves listed in ``bad_leaves`` and, where ``expect`` is
  not ``None``, diagnose the structure of the error: ``"flip"`` (spatially reversed), ``"transpose"`` (a layout
  reinterpretation: the true gradient transposed and reshaped C-order to the argument's shape), ``"scale"`` (a
  constant factor, including a sign), ``"zero"`` (gradient identically zero), ``"shift"`` (rolled by one element
  along one axis).

Every buggy backward is a full ``custom_vjp`` built by the same factory as the correct one; only the planted line
differs (the factories: :mod:`jaxgrad.verify.planted_ops`). ``make_args(key, dtype)`` draws white noise
(``jax.random.normal``) of asymmetric shapes, never zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jaxgrad.verify.planted_ops import (_bspline_args, _conv2d_args, _linear_args, _long_sum_args, _lora_args,
                                        _make_bspline, _make_conv2d, _make_linear, _make_linear_f32_only,
                                        _make_lora, _make_matmul_bf16_inside, _make_residual, _make_rmsnorm,
                                        _make_softmax, _make_swiglu, _matmul_args, _residual_args, _rmsnorm_args,
                                        _softmax_args, _swiglu_args, bspline_reference, conv2d_reference,
                                        linear_reference, lora_reference, matmul_reference, residual_reference,
                                        rmsnorm_reference, softmax_reference, swiglu_reference)

__all__ = ["PlantedCase", "all_cases", "buggy_cases", "correct_cases", "with_backward_edit", "bspline_reference",
           "conv2d_reference", "linear_reference", "lora_reference", "matmul_reference", "residual_reference",
           "rmsnorm_reference", "softmax_reference", "swiglu_reference"]


def with_backward_edit(fn: Callable, edit: Callable) -> Callable:
    """``fn`` with the same forward and its VJP's gradients passed through ``edit(*grads) -> grads``: a bug planted
    in a correct backward (``edit`` returns the gradients of every argument, one changed)."""

    @jax.custom_vjp
    def planted(*args):
        return fn(*args)

    def fwd(*args):
        return jax.vjp(fn, *args)

    def bwd(pullback, g):
        return tuple(edit(*pullback(g)))

    planted.defvjp(fwd, bwd)
    return planted


@dataclasses.dataclass(frozen=True)
class PlantedCase:
    """One hand-written VJP (correct or with a planted bug) and its plain-JAX oracle.

    Attributes:
      name: unique case name, ``"<op>/<variant>"``, e.g. ``"conv2d/weight-grad-flipped"``.
      op: the operation, e.g. ``"conv2d"``.
      fn: the ``jax.custom_vjp`` function under test.
      reference: plain-JAX forward with the same signature, differentiated by ``jax.vjp``.
      make_args: ``(key, dtype) -> tuple`` of positional arguments (arrays) in ``dtype``.
      arg_names: names of the positional arguments, e.g. ``("x", "w", "b")``.
      buggy: ``True`` if the verifier must FAIL the case.
      bad_leaves: names (from ``arg_names``) of the arguments whose gradient carries the bug; ``()`` if correct.
      expect: diagnosis the verifier should give: ``"flip"``, ``"transpose"``, ``"scale"``, ``"zero"``,
        ``"shift"``, or ``None`` (no specific structural diagnosis, e.g. a missing term).
      note: one line: the bug and the equation it violates (or, for correct cases, what makes them interesting).
      tags: free-form labels; ``"bf16-inside"``, ``"f32-only"`` (the function never computes in float64, so a
        float64 re-run still carries bf16 / f32 rounding) and ``"large"`` (expensive inputs; run once, in f32).
    """

    name: str
    op: str
    fn: Callable
    reference: Callable
    make_args: Callable[[jax.Array, Any], tuple]
    arg_names: tuple[str, ...]
    buggy: bool
    bad_leaves: tuple[str, ...]
    expect: str | None
    note: str
    tags: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = set(self.bad_leaves) - set(self.arg_names)
        if unknown:
            raise ValueError(f"{self.name}: bad_leaves {sorted(unknown)} not in arg_names {self.arg_names}")
        if self.buggy != bool(self.bad_leaves):
            raise ValueError(f"{self.name}: buggy={self.buggy} but bad_leaves={self.bad_leaves}")
        if self.expect not in (None, "flip", "transpose", "scale", "zero", "shift"):
            raise ValueError(f"{self.name}: unknown expect {self.expect!r}")


def correct_cases() -> list[PlantedCase]:
    """Correct hand-written VJPs: the verifier must PASS every one (no false alarms)."""
    C = PlantedCase
    return [
        C("conv2d/correct", "conv2d", _make_conv2d(None), conv2d_reference, _conv2d_args, ("x", "w"),
          False, (), None, "dW = corr(xpad, g); dx = full corr(g, rot180(W) with I<->O)"),
        C("linear/correct", "linear", _make_linear(None), linear_reference, _linear_args, ("x", "w", "b"),
          False, (), None, "dx = g W^T, dW = x^T g, db = sum_n g"),
        C("bspline/correct", "bspline", _make_bspline(None), bspline_reference, _bspline_args, ("x", "c"),
          False, (), None, "dx = g sum_m c_m p[B_m^{p-1}/(t_{m+p}-t_m) - B_{m+1}^{p-1}/(t_{m+p+1}-t_{m+1})]"),
        C("swiglu/correct", "swiglu", _make_swiglu(None), swiglu_reference, _swiglu_args, ("a", "u"),
          False, (), None, "da = g u sigma(a)(1 + a(1 - sigma(a))), du = g silu(a)"),
        C("rmsnorm/correct", "rmsnorm", _make_rmsnorm(None), rmsnorm_reference, _rmsnorm_args, ("x", "w"),
          False, (), None, "dx = r g w - r^3/D x sum(g w x), dw = sum_b g x r"),
        C("residual/correct", "residual", _make_residual(None), residual_reference, _residual_args, ("x", "w"),
          False, (), None, "dx = g + (g(1-h^2)) W^T, dW = x^T (g(1-h^2))"),
        C("softmax/correct", "softmax", _make_softmax(None), softmax_reference, _softmax_args, ("x",),
          False, (), None, "dx = y (g - sum_j y_j g_j)"),
        C("lora/correct", "lora", _make_lora(None), lora_reference, _lora_args, ("x", "w", "a", "b"),
          False, (), None, "dA = x^T g B^T, dB = (xA)^T g, dx = g W^T + g B^T A^T"),
        C("matmul-bf16-inside", "matmul", _make_matmul_bf16_inside(), matmul_reference, _matmul_args, ("x", "w"),
          False, (), None, "correct math with bf16 operands / f32 accumulation, even for f64 inputs",
          tags=("bf16-inside",)),
        C("long-sum-1e6", "linear", _make_linear(None), linear_reference, _long_sum_args, ("x", "w", "b"),
          False, (), None, "correct linear layer; dW and db reduce over 10^6 rows (run in f32)",
          tags=("large",)),
        C("f32-only", "linear", _make_linear_f32_only(), linear_reference, _linear_args, ("x", "w", "b"),
          False, (), None, "correct linear layer computed in f32 whatever the input dtype (f32-only kernel)",
          tags=("f32-only",)),
    ]


def buggy_cases() -> list[PlantedCase]:
    """Hand-written VJPs with one planted bug each: the verifier must FAIL every one, on ``bad_leaves``."""
    C = PlantedCase
    return [
        C("conv2d/weight-grad-flipped", "conv2d", _make_conv2d("flip"), conv2d_reference, _conv2d_args,
          ("x", "w"), True, ("w",), "flip",
          "dW returned rotated 180 deg: dW'[i,j] = dW[kh-1-i, kw-1-j]; violates dW = corr(xpad, g)"),
        C("conv2d/weight-grad-transposed", "conv2d", _make_conv2d("transpose"), conv2d_reference, _conv2d_args,
          ("x", "w"), True, ("w",), "transpose",
          "dW computed in [O,I,W,H] order and reshaped C-order to HWIO; violates dW[i,j,c,o] = corr(xpad, g)"),
        C("conv2d/input-grad-shifted", "conv2d", _make_conv2d("shift"), conv2d_reference, _conv2d_args,
          ("x", "w"), True, ("x",), "shift",
          "dx rolled by one pixel along H: dx'[:, h] = dx[:, h-1]; violates the (kh-1-p_t) padding offset"),
        C("conv2d/weight-grad-scaled", "conv2d", _make_conv2d("scale"), conv2d_reference, _conv2d_args,
          ("x", "w"), True, ("w",), "scale",
          "dW * (1 + 1e-4): systematic relative error far above f64 rounding"),
        C("linear/bias-grad-mean", "linear", _make_linear("bias-mean"), linear_reference, _linear_args,
          ("x", "w", "b"), True, ("b",), "scale",
          "db = mean_n g instead of sum_n g: off by 1/B; violates db = sum_n dy_n"),
        C("linear/input-grad-zero", "linear", _make_linear("dx-zero"), linear_reference, _linear_args,
          ("x", "w", "b"), True, ("x",), "zero",
          "dx = 0; violates dx = g W^T"),
        C("bspline/missing-p", "bspline", _make_bspline("missing-p"), bspline_reference, _bspline_args,
          ("x", "c"), True, ("x",), "scale",
          "dB^p/dx without the factor p (dx off by 1/3); violates dB_j^p = p[B_j^{p-1}/.. - B_{j+1}^{p-1}/..]"),
        C("bspline/wrong-sign", "bspline", _make_bspline("wrong-sign"), bspline_reference, _bspline_args,
          ("x", "c"), True, ("x",), "scale",
          "dB^p/dx with the bracket reversed (dx off by -1); violates dB_j^p = p[B_j^{p-1}/.. - B_{j+1}^{p-1}/..]"),
        C("swiglu/silu-prime-sigmoid", "swiglu", _make_swiglu("silu-prime-sigmoid"), swiglu_reference,
          _swiglu_args, ("a", "u"), True, ("a",), None,
          "silu'(a) replaced by sigma(a); violates silu'(a) = sigma(a)(1 + a(1 - sigma(a)))"),
        C("rmsnorm/dx-no-mean-term", "rmsnorm", _make_rmsnorm("dx-no-mean-term"), rmsnorm_reference,
          _rmsnorm_args, ("x", "w"), True, ("x",), None,
          "dx = r g w only; violates dx = r g w - r^3/D x sum(g w x) (the d r/dx term)"),
        C("residual/dx-no-residual", "residual", _make_residual("dx-no-residual"), residual_reference,
          _residual_args, ("x", "w"), True, ("x",), None,
          "dx = (g(1-h^2)) W^T; violates dx = g + (g(1-h^2)) W^T (identity path dropped)"),
        C("softmax/no-rowsum", "softmax", _make_softmax("no-rowsum"), softmax_reference, _softmax_args,
          ("x",), True, ("x",), None,
          "dx = y g; violates dx = y (g - sum_j y_j g_j) (Jacobian diag(y) - y y^T)"),
        C("lora/a-grad-layout", "lora", _make_lora("a-grad-layout"), lora_reference, _lora_args,
          ("x", "w", "a", "b"), True, ("a",), "transpose",
          "dA computed as B g^T x = dA^T [r, in] and reshaped to [in, r]; violates dA = x^T g B^T"),
    ]


def all_cases() -> list[PlantedCase]:
    """Correct cases followed by buggy ones; names are unique."""
    cases = correct_cases() + buggy_cases()
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "duplicate case names"
    return cases
