"""The float64 oracle is an oracle only if it is the function that was called.

``check_vjp`` re-runs ``fn`` and the reference in float64 (x64). A value made inside a function that does not come
from its inputs -- here a frozen head drawn with ``jax.random.normal(key, shape)`` in the default dtype -- is float32
as called and *another draw* (float64 normals) under x64: the float64 runs then compute another function, and the
rounding model, emulated with the same function, "explains" an O(1) error (the gradient of such a frozen LM head
was 1.36 off its oracle normwise, cosine 0.096, and still matched "to rounding"). The verifier compares each
function's forward as called with its float64 forward at the same inputs against a worst-case rounding bound, and
fails the verdict with the cause and its fix. Drawn in an explicit dtype, the same function passes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.verify import check_vjp
from jaxgrad.verify.ground_truth import SAME_FUNCTION_SAFETY, same_function_check
from jaxgrad.verify.precision import ErrorModel

pytestmark = pytest.mark.usefixtures("exact_f32_tests_run_on_the_cpu")

VOCAB = 17


def frozen_head(h, draw_dtype):
    """A constant of ``h`` (a frozen head ``[VOCAB, H]``): drawn in ``draw_dtype``, or the default dtype if None."""
    key, shape = jax.random.key(11), (VOCAB, h.shape[-1])
    w = jax.random.normal(key, shape) if draw_dtype is None else jax.random.normal(key, shape, draw_dtype)
    return w.astype(h.dtype) * h.shape[-1] ** -0.5


def frozen_head_loss(fn_draw, reference_draw):
    """``(fn, reference)``: ``sum tanh(h W^T)`` with ``W`` a frozen draw; ``fn`` has a hand-written VJP
    ``dh = (c (1 - tanh^2)) W``, correct for its own ``W``."""

    @jax.custom_vjp
    def fn(h):
        return jnp.sum(jnp.tanh(h @ frozen_head(h, fn_draw).T))

    def fwd(h):
        return fn(h), h

    def bwd(h, c):
        w = frozen_head(h, fn_draw)
        return ((c * (1 - jnp.tanh(h @ w.T) ** 2)) @ w,)

    fn.defvjp(fwd, bwd)

    def reference(h):
        return jnp.sum(jnp.tanh(h @ frozen_head(h, reference_draw).T))

    return fn, reference


@pytest.fixture
def h():
    return jax.random.normal(jax.random.key(0), (3, 5, 12), jnp.float32)


def checks_named(report, what):
    return [c for c in report.checks if c.name == f"same function in float64 ({what})"]


def test_a_draw_in_the_default_dtype_fails_and_says_why(h):
    """The frozen-head flaw in fn and reference alike: every gradient "matches to rounding" under the flawed model,
    yet the verdict fails on both functions, naming the cause and the fix."""
    fn, reference = frozen_head_loss(None, None)
    report = check_vjp(fn, reference, h, arg_names=("h",))
    assert not report.passed
    (fn_check,), (ref_check,) = checks_named(report, "fn"), checks_named(report, "the reference")
    assert not fn_check.passed and not ref_check.passed
    assert "fn evaluated in float64 is not the function called in f32" in fn_check.detail
    assert "the reference evaluated in float64 is not the function called in f32" in ref_check.detail
    for c in (fn_check, ref_check):
        assert "x the bound of f32 rounding" in c.detail
        assert "a random draw or a constant in the default dtype" in c.detail
        assert "create it in an explicit dtype" in c.detail
    assert "same function in float64 (fn)" in str(report).split("VERDICT")[-1]


def test_the_same_draw_in_an_explicit_float32_passes(h):
    fn, reference = frozen_head_loss(jnp.float32, jnp.float32)
    report = check_vjp(fn, reference, h, arg_names=("h",))
    assert report.passed, str(report)
    (fn_check,), (ref_check,) = checks_named(report, "fn"), checks_named(report, "the reference")
    assert fn_check.passed and ref_check.passed


def test_a_flawed_reference_alone_fails(h):
    """fn draws in float32 (the same function in float64); the reference draws in the default dtype: its float64
    oracle is another function, and its own check says so."""
    fn, reference = frozen_head_loss(jnp.float32, None)
    report = check_vjp(fn, reference, h, arg_names=("h",))
    assert not report.passed
    (fn_check,), (ref_check,) = checks_named(report, "fn"), checks_named(report, "the reference")
    assert fn_check.passed
    assert not ref_check.passed and "the reference evaluated in float64 is not the function" in ref_check.detail


def test_a_flawed_fn_beside_a_sound_reference_is_judged_as_called_with_a_note(h):
    """fn draws in the default dtype, the reference in float32: as called both use the same head and fn's VJP is
    right. fn's float64 run is another function, so it is not used as evidence (its forward disagrees with the
    reference's float64 forward): the verdict rests on the as-called run and a note says what fn does in float64."""
    fn, reference = frozen_head_loss(None, jnp.float32)
    report = check_vjp(fn, reference, h, arg_names=("h",))
    assert report.passed, str(report)
    assert not checks_named(report, "fn") and all(c.passed for c in checks_named(report, "the reference"))
    assert [lf.run for lf in report.leaves] == ["f32"]  # no float64 row: fn's float64 run is not the function called
    (note,) = [n for n in report.notes if "fn evaluated in float64 is not the function called in f32" in n]
    assert "not used" in note and "a random draw or a constant in the default dtype" in note


def test_the_bound_is_the_worst_case_rounding_of_the_precision():
    """Per entry ``|y - y64| <= C (u_p + u_f32 sqrt(N)) sum|terms| + K`` with C = SAME_FUNCTION_SAFETY: at the bound
    it passes, 1.5x beyond it fails; a kink's jump ``K`` widens it where the branch may flip."""
    n, m = 100, np.full(4, 2.0)
    b = ErrorModel("tf32", SAME_FUNCTION_SAFETY, "").bound(n)
    y64 = np.array([1.0, -0.5, 0.25, 0.0])
    at_bound, beyond = y64 + 0.99 * b * m, y64 + 1.5 * b * m
    assert same_function_check("fn", "tf32", [at_bound], [y64], [m], [n], [None], "tf32").passed
    failed = same_function_check("fn", "tf32", [beyond], [y64], [m], [n], [None], "tf32")
    assert not failed.passed and "1.5x the bound of tf32 rounding" in failed.detail
    kink = np.array([0.0, 0.0, 0.0, 4.0 * b])  # one entry may take the other branch: its jump is allowed there
    flipped = y64 + np.array([0.0, 0.0, 0.0, 3.0 * b * 2.0])
    assert same_function_check("fn", "tf32", [flipped], [y64], [m], [n], [kink], "tf32").passed
    assert not same_function_check("fn", "tf32", [flipped], [y64], [m], [n], [None], "tf32").passed


def test_a_closed_over_host_constant_keeps_the_statistical_verdict():
    """A frozen weight held as a NumPy array and closed over (an audit's ``frozen_normal``) is a NumPy-backed literal
    of the traced program; the reference's emulated rounding reorders its sums like any operand's."""
    w = np.random.default_rng(0).standard_normal((12, 7)).astype(np.float32)

    def fn(x):
        return jnp.tanh(x @ jnp.asarray(w, x.dtype))

    x = jax.random.normal(jax.random.key(1), (5, 12))
    report = check_vjp(fn, fn, x)
    assert report.passed
    assert not any("statistical verdict skipped" in note for note in report.notes), report.notes
