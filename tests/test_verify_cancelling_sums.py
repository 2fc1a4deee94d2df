"""Cancelling sums: layout bugs the per-entry gate cannot see are caught by the statistical verdict.

For a gradient that is itself a heavily cancelling sum (the seed CNN's weight gradients on white noise: kappa =
||sum|terms| || / ||g|| ~ 1e4..1e5), a flipped weight gradient's error divided by sum|terms| falls below the
per-entry bound. Its normwise error stays O(1), thousands of times the modelled rounding (the reference run at the
same precision at perturbed points), and the statistics fail it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.cnn import denoiser
from jaxgrad.cnn.conv import conv2d
from jaxgrad.verify import check_vjp
from jaxgrad.verify.planted import with_backward_edit
from jaxgrad.verify.report import LeafResult

SIZE = 128  # per-entry misses a flipped conv1/conv3 weight gradient from here on (kappa ~ 1e5)


def _flipped_dw_conv(**options):
    """The package's conv2d, whose backward returns the weight gradient rotated by 180 degrees (planted bug)."""

    def f(x, w, b):
        return conv2d(x, w, b, **options)

    return with_backward_edit(f, lambda dx, dw, db: (dx, dw[::-1, ::-1], db))  # BUG: dW rotated by 180 degrees


def _denoiser_loss(bad_layer=None):
    """``denoiser.mse_loss`` (channels 1-16-16-1, hand-written conv VJPs); with ``bad_layer``, the same network
    with that layer's weight gradient flipped."""
    if bad_layer is None:
        return denoiser.mse_loss

    def loss(params, x, t):
        h = x
        for i, layer in enumerate(params):
            act = None if i == len(params) - 1 else "relu"
            conv = _flipped_dw_conv(padding="SAME", activation=act) if i == bad_layer else functools.partial(
                conv2d, padding="SAME", activation=act)
            h = conv(h, layer["w"], layer["b"])
        return jnp.mean(jnp.square(h - t))

    return loss


def _reference_loss(params, x, t):
    """The same network in plain JAX (lax.conv + bias + ReLU, differentiated by JAX)."""
    h = x
    for i, layer in enumerate(params):
        h = jax.lax.conv_general_dilated(h, layer["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                         precision=jax.lax.Precision.HIGHEST) + layer["b"]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return jnp.mean(jnp.square(h - t))


@pytest.fixture(scope="module")
def cnn_args():
    params = denoiser.init(jax.random.key(0))
    rng = np.random.default_rng([0, SIZE])
    x = jnp.asarray(rng.standard_normal((2, SIZE, SIZE, 1)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((2, SIZE, SIZE, 1)), jnp.float32)
    return params, x, t


def _check(fn, args):
    # float64=False: the situation of a kernel that cannot run in float64 (a GPU kernel), where the float64 re-run
    # cannot resolve what the as-called run leaves open. fd=False: the FD check adds nothing to this point.
    return check_vjp(fn, _reference_loss, *args, fd=False, float64=False, arg_names=("params", "x", "t"))


def test_correct_denoiser_passes_both_gates(cnn_args):
    rep = _check(_denoiser_loss(None), cnn_args)
    assert rep.passed, str(rep)
    for lf in rep.leaves:
        assert lf.stats is not None and lf.stats.passed and lf.ref_rel_err is not None
    assert "model rel.err" in str(rep) and "false-alarm rate" in str(rep)


@pytest.mark.parametrize("layer", [0])
def test_flipped_weight_gradient_passes_per_entry_but_fails_the_statistics(cnn_args, layer):
    rep = _check(_denoiser_loss(layer), cnn_args)
    bad = rep.as_called(f"params[{layer}]['w']")
    assert bad.kappa > 1e4  # the cancelling-sum regime
    assert bad.normalized_err < bad.bound, "per-entry gate caught it: this case no longer shows the gap"
    assert bad.per_entry_passed and not bad.statistics_passed and not bad.passed
    assert bad.rel_err > 0.5 and bad.model_ratio > 1e3
    assert bad.diagnosis_kind == "flip", bad.verdict
    assert not rep.passed
    text = str(rep)
    assert f"params[{layer}]['w'] ({rep.precision.precision}, statistics)" in text
    assert "spatial flip" in text
    for lf in rep.leaves:  # every other leaf (dx is correct) passes
        if lf is not bad:
            assert lf.passed, str(rep)


def test_flipped_last_layer_weight_gradient_fails_both_gates(cnn_args):
    """The last layer's dW (activations times the loss cotangent, both computed) cancels less once sum|terms| is
    first order in the rounding of each factor (kappa ~ 1e4): the per-entry gate catches its flip as well."""
    rep = _check(_denoiser_loss(2), cnn_args)
    bad = rep.as_called("params[2]['w']")
    assert bad.normalized_err > bad.bound and not bad.per_entry_passed
    assert not bad.statistics_passed and not bad.passed and not rep.passed
    assert bad.diagnosis_kind == "flip", bad.verdict
    for lf in rep.leaves:  # every other leaf (dx is correct) passes
        if lf is not bad:
            assert lf.passed, str(rep)


def test_statistics_are_skipped_with_a_note_when_the_reference_cannot_run_as_called():
    @jax.custom_vjp
    def ref(x):
        return jnp.sin(x)

    def ref_fwd(x):
        return jnp.sin(x), x

    def ref_bwd(x, g):
        if x.dtype != jnp.float64:
            raise TypeError("this reference differentiates in float64 only")
        return (g * jnp.cos(x),)

    ref.defvjp(ref_fwd, ref_bwd)
    x = jnp.linspace(0.1, 1.0, 7, dtype=jnp.float32)
    rep = check_vjp(jnp.sin, ref, x, fd=False, adjoint=False)
    assert rep.passed, str(rep)
    assert all(lf.ref_rel_err is None and lf.stats is None for lf in rep.leaves)
    assert any("statistical verdict skipped" in n for n in rep.notes), rep.notes


def test_leaf_result_keeps_its_old_constructor():
    lf = LeafResult(name="w", run="f32", shape=(2,), rel_err=0.0, max_abs_ratio=0.0, cosine=1.0, normalized_err=0.0,
                    median_normalized_err=0.0, worst_index=(0,), bound=1e-5, bound_source="", n_terms=1, kappa=1.0,
                    passed=True, verdict="matches to rounding", diagnosis=None)
    assert lf.ref_rel_err is None and lf.stats is None and lf.statistics_passed and lf.model_ratio is None
