"""The pieces of the verifier: sum|terms|, the rounding model, the diagnosis search."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.verify import magnitudes
from jaxgrad.verify.diagnose import diagnose
from jaxgrad.verify.precision import ErrorModel, model_for


def _noise(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float64)


def conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


class TestSumOfAbsTerms:
    def test_matmul_vjp_is_the_vjp_on_absolute_values(self):
        with jax.enable_x64(True):
            x, w, c = _noise(0, 6, 5), _noise(1, 5, 4), _noise(2, 6, 4)
            res = magnitudes(lambda x, w, c: jax.vjp(jnp.matmul, x, w)[1](c), x, w, c)
            np.testing.assert_allclose(res.magnitudes[0], np.abs(c) @ np.abs(w).T, rtol=1e-14)
            np.testing.assert_allclose(res.magnitudes[1], np.abs(x).T @ np.abs(c), rtol=1e-14)
            assert res.terms == [4, 6]  # contraction lengths: out features for dx, batch for dw
            assert res.approximated == ()

    def test_conv_vjp_is_the_vjp_on_absolute_values(self):
        with jax.enable_x64(True):
            x, w, c = _noise(0, 2, 9, 7, 3), _noise(1, 3, 5, 3, 4), _noise(2, 2, 9, 7, 4)
            res = magnitudes(lambda x, w, c: jax.vjp(conv, x, w)[1](c), x, w, c)
            want = jax.vjp(conv, jnp.abs(x), jnp.abs(w))[1](jnp.abs(c))
            for got, ref in zip(res.magnitudes, want):
                np.testing.assert_allclose(got, ref, rtol=1e-13)

    def test_elementwise_rule_propagates_slope(self):
        # M(tanh(a)) = |tanh(a)| + |tanh'(a)| M(a), with M(a) = |a| for an input
        with jax.enable_x64(True):
            a = _noise(3, 17)
            res = magnitudes(jnp.tanh, a)
            want = np.abs(np.tanh(a)) + (1 - np.tanh(a) ** 2) * np.abs(a)
            np.testing.assert_allclose(res.magnitudes[0], want, rtol=1e-14)

    def test_cancelling_sum_keeps_its_scale(self):
        with jax.enable_x64(True):
            a = jnp.array([1e8, 1.0, -1e8])
            res = magnitudes(jnp.sum, a)
            assert float(res.values[0]) == 1.0
            assert float(res.magnitudes[0]) == pytest.approx(2e8 + 1)


class TestRoundingModel:
    def test_bounds_separate_measured_rounding_from_measured_bugs(self):
        # H100/H200 measurements (shared/reference/gradcheck.md): per-entry error / sum|terms| of the seed CNN's
        # weight gradients at N = 2.1e6: exact f32 <= 3.4e-6, TF32 <= 6.4e-4; simulated bugs >= 0.075.
        n = 2_097_152
        assert 3.4e-6 < ErrorModel("f32", 8, "").bound(n) < 0.075
        assert 6.4e-4 < ErrorModel("tf32", 8, "").bound(n) < 0.075
        assert ErrorModel("bf16", 8, "").bound(64) < 0.075
        assert ErrorModel("f64", 8, "").bound(n) == pytest.approx(1e-10)

    def test_forward_mismatch_reveals_bf16_compute_behind_f32_arrays(self):
        model, ok = model_for([jnp.float32], forward_error=2e-3, forward_terms=64, safety=8)
        assert ok and model.precision == "bf16"
        assert "reveals bf16" in model.source

    def test_a_tf32_sized_mismatch_is_judged_coarse_but_reported_as_consistent_with_tf32(self):
        # H100, Pallas conv in TF32: 3.2e-4 = 0.65 u_tf32 per entry; bf16's bound is used (looser, never a false
        # alarm), and the report does not claim bf16 compute
        model, ok = model_for([jnp.float32], forward_error=3.2e-4, forward_terms=27, safety=8,
                              platform=("tf32", "GPU default"))
        assert ok and model.precision == "bf16"
        assert "consistent with tf32 or bf16" in model.source and "reveals" not in model.source

    def test_f32_arrays_with_f32_agreement_stay_f32_on_cpu(self):
        model, ok = model_for([jnp.float32], forward_error=1e-7, forward_terms=64, safety=8)
        assert ok and model.precision == ("f32" if jax.default_backend() != "gpu" else "tf32")

    def test_forward_beyond_every_model_is_a_forward_bug(self):
        _, ok = model_for([jnp.float32], forward_error=0.3, forward_terms=64, safety=8)
        assert not ok


class TestDiagnosis:
    r = np.asarray(jax.random.normal(jax.random.key(7), (3, 5, 2, 4)), np.float64)
    m = np.abs(r) + 0.5

    @pytest.mark.parametrize(
        "transform, kind",
        [
            (lambda r: np.flip(r, (0, 1)), "flip"),
            (lambda r: r.transpose(3, 2, 0, 1).reshape(r.shape), "transpose"),
            (lambda r: np.concatenate([np.zeros_like(r[:1]), r[:-1]], 0), "shift"),
            (lambda r: r / 7, "scale"),
            (lambda r: -r, "scale"),
            (lambda r: r * (1 + 1e-4), "scale"),
            (lambda r: np.zeros_like(r), "zero"),
            (lambda r: np.random.default_rng(0).permutation(r.ravel()).reshape(r.shape), "permutation"),
        ],
    )
    def test_names_the_transform(self, transform, kind):
        d = diagnose(transform(self.r), self.r, self.m, bound=1e-10)
        assert d.kind == kind, d.message

    def test_averaged_instead_of_summed_is_spelled_out(self):
        d = diagnose(self.r / 7, self.r, self.m, bound=1e-10)
        assert "1/7" in d.message and "averaged over 7" in d.message

    def test_missing_term_is_not_mistaken_for_a_layout_bug(self):
        other = np.asarray(jax.random.normal(jax.random.key(8), self.r.shape), np.float64)
        d = diagnose(self.r + 0.5 * other, self.r, self.m, bound=1e-10)
        assert d.kind is None and "missing, extra or wrong term" in d.message


def test_gpu_default_precision_is_assumed_tf32_for_f32_arrays():
    tf32 = ("tf32", "JAX's default f32 matmul/conv precision on GPU is TF32")
    model, ok = model_for([jnp.float32], forward_error=1e-7, forward_terms=64, safety=8, platform=tf32)
    assert ok and model.precision == "tf32" and "TF32" in model.source


def test_platform_precision_is_read_where_fn_ran_not_inside_the_verifier(monkeypatch):
    # check_vjp forces HIGHEST for its float64 oracle; the as-called model must not see that setting.
    from jaxgrad.verify import check_vjp, precision

    seen = []
    real = precision.platform_precision
    monkeypatch.setattr(precision, "platform_precision",
                        lambda: seen.append(str(jax.config.jax_default_matmul_precision)) or real())
    check_vjp(jnp.sin, jnp.sin, jnp.linspace(0.1, 1.0, 5), fd=False, adjoint=False, structural=False)
    assert seen and all(s != "highest" for s in seen)


def test_calibration_native_reference_runs_at_the_platform_default_precision():
    # the GPU false-alarm sweep and `verify_detection_limits.py --hardware` judge case.native: the reference at
    # DEFAULT precision (TF32 dots/convs on a GPU), not the HIGHEST-precision reference the replicas emulate from
    from jaxgrad.verify.calibration import make_case

    for op in ("dense", "conv_relu", "attention"):
        case = make_case(op, 100, "f32", np.random.default_rng(0))
        hi, native = (str(jax.make_jaxpr(f)(*case.args)) for f in (case.reference, case.native))
        assert "HIGHEST" in hi and "HIGHEST" not in native, op


def test_attention_leaves_above_262144_entries_are_multi_head():
    # 10^6 entries of dQ as a transformer holds them ([heads, seq, 128]), not one head of 7,812 queries
    from jaxgrad.verify.calibration import _attention, make_case

    case = make_case("attention", 1_000_000, "bf16", np.random.default_rng(0))
    assert case.args[0].shape == (8, 976, 128) and case.args[1].shape == (8, 979, 128)
    assert make_case("attention", 262144, "bf16", np.random.default_rng(0)).args[0].shape == (2048, 128)
    # the batched kernel is the per-head kernel, head by head (f32: no rounding emulated)
    f, ref = _attention("f32")
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((3, 5, 4), (3, 6, 4), (3, 6, 5)))
    ct = jnp.asarray(rng.standard_normal((3, 5, 5)), jnp.float32)
    whole = jax.vjp(f, q, k, v)[1](ct)
    for h in range(3):
        per_head = jax.vjp(ref, q[h], k[h], v[h])[1](ct[h])
        for a, b in zip(whole, per_head):
            np.testing.assert_allclose(np.asarray(a[h]), np.asarray(b), rtol=1e-5, atol=1e-5)
