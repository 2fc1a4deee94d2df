"""sum|terms| (``M``) stays a first-order error scale through products of computed values and masked softmax shifts.

``M`` of a product of two computed values is :math:`M(a)|b| + |a|(M(b) - |b|)`, not :math:`M(a) M(b)` (whose
cross term is second order and compounds: ``x * x`` squares ``M/|x|``, and a Llama block's RMSNorms and attention
products raised ``M`` past 1e100 -- a per-entry bound that admits anything). The maximum of a masked softmax shift
takes ``M`` only from the entries a rounded run can select, never from the ``-1e30`` fill; a ``-inf`` fill gives
``exp(-inf) = 0`` with ``M = 0``, not ``0 * inf = nan``.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.verify import audit, check_vjp, magnitudes
from jaxgrad.verify.planted import with_backward_edit


def _noise(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float64)


def _kappa(m, g) -> float:
    return float(np.linalg.norm(np.asarray(m)) / np.linalg.norm(np.asarray(g)))


class TestProductsOfComputedValues:
    def test_square_of_a_cancelling_sum_is_first_order(self):
        # x = a + b = 1 with M(x) = 2e4 - 1: the computed x*x errs by 2|x| dx, so M(x*x) = 2 M(x)|x| - |x|^2
        with jax.enable_x64(True):
            a, b = jnp.array([1e4]), jnp.array([1.0 - 1e4])
            res = magnitudes(lambda a, b: (a + b) * (a + b), a, b)
            m_x = 2e4 - 1
            assert float(res.magnitudes[0][0]) == pytest.approx(2 * m_x - 1, rel=1e-12)

    def test_matmul_of_computed_operands_is_first_order(self):
        # C = (A1 + A2)(B1 + B2): M(C) = M(A)|B| + |A|(M(B) - |B|)
        with jax.enable_x64(True):
            a1, a2, b1, b2 = _noise(0, 4, 6), _noise(1, 4, 6), _noise(2, 6, 3), _noise(3, 6, 3)
            res = magnitudes(lambda a1, a2, b1, b2: (a1 + a2) @ (b1 + b2), a1, a2, b1, b2)
            a, b = np.asarray(a1 + a2), np.asarray(b1 + b2)
            m_a, m_b = np.abs(a1) + np.abs(a2), np.abs(b1) + np.abs(b2)
            want = m_a @ np.abs(b) + np.abs(a) @ (m_b - np.abs(b))
            np.testing.assert_allclose(res.magnitudes[0], want, rtol=1e-13)
            assert np.all(np.asarray(res.magnitudes[0]) >= np.abs(np.asarray(res.values[0])))

    def test_a_chain_of_rms_norms_grows_polynomially(self):
        # twelve linear + RMSNorm layers: M/|y| grows about sqrt(fan in) per layer (|W| |x| against |W x|), never
        # by squaring (before: ~1e300 and beyond)
        def chain(x, ws):
            for w in ws:
                h = x @ w
                x = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-5)
            return x

        with jax.enable_x64(True):
            x = _noise(0, 5, 16)
            ws = [_noise(1 + i, 16, 16) / 4 for i in range(12)]
            res = magnitudes(chain, x, ws)
            assert 1 < _kappa(res.magnitudes[0], res.values[0]) < 1e12


def _causal_attention(q, k, v, fill, shift_gradient):
    t = q.shape[0]
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), q @ k.T / np.sqrt(q.shape[1]), fill)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - (m if shift_gradient else jax.lax.stop_gradient(m)))
    return (e / jnp.sum(e, axis=-1, keepdims=True)) @ v


class TestMaskedSoftmax:
    @pytest.mark.parametrize("fill", [-1e30, float(np.finfo(np.float64).min), -np.inf])
    @pytest.mark.parametrize("shift_gradient", [True, False])
    def test_the_mask_fill_adds_no_magnitude(self, fill, shift_gradient):
        with jax.enable_x64(True):
            q, k, v, c = (_noise(i, 9, 8) for i in range(4))
            res = magnitudes(lambda q, k, v, c: jax.vjp(
                lambda *a: _causal_attention(*a, fill, shift_gradient), q, k, v)[1](c), q, k, v, c)
            kappas = [_kappa(m, g) for m, g in zip(res.magnitudes, res.values)]
            assert all(np.isfinite(kappas)) and max(kappas) < 1e4, kappas

    def test_a_maximum_keeps_the_magnitude_of_its_close_runner_up(self):
        # 1.0 (M = 1) on top, 1 - 1e-9 computed with M = 2e4 + 1 just below it (a rounded run may select it), and
        # the -1e30 fill far below (never selected)
        with jax.enable_x64(True):
            a = jnp.array([1.0, 1e4, -1e30])
            res = magnitudes(lambda a: jnp.max(jnp.concatenate([a[:1], (a[1:2] + (1 - 1e-9)) - a[1:2], a[2:]])), a)
            assert float(res.magnitudes[0]) == pytest.approx(2e4 + 1, rel=1e-12)


@pytest.fixture(scope="module")
def block_case():
    """The audit's ``lora_block[xla]`` case at its smallest size, (2, 7, 24), in float64: ``(fn, reference, args)``."""
    from jaxgrad.lora import audit as lora_audit

    with jax.enable_x64(True):
        args = lora_audit._make_args(jnp.float64)(jax.random.key(0), (2, 7, 24))
    return lora_audit._fn("xla", "xla"), lora_audit._reference, args


class TestLlamaBlock:
    """The whole-block VJP of the LoRA Llama block: M finite and of a sane size, and the per-entry gate catches a 10%
    scale error in one gradient."""

    def test_block_magnitudes_are_of_a_sane_size(self, block_case):
        _, reference, args = block_case
        with jax.enable_x64(True):
            ct = _noise(9, *args[0].shape)
            res = magnitudes(lambda a, c: jax.vjp(reference, *a)[1](c), args, ct)
            kappas = [_kappa(m, g) for m, g in zip(res.magnitudes, res.values)]
        # componentwise |W2||W1|... over a block's forward and backward chain: ~1e5..1e9 at this size (before:
        # 1e60..1e130)
        assert all(np.isfinite(kappas)) and max(kappas) < 1e11, kappas

    def test_entry_gate_catches_a_scale_error_in_the_block_gradient(self, block_case):
        fn, reference, args = block_case
        with jax.enable_x64(True):
            assert check_vjp(fn, reference, *args, seed=0).passed
            planted = with_backward_edit(fn, lambda gx, gl, gn: (1.1 * gx, gl, gn))
            rep = check_vjp(planted, reference, *args, seed=0)
        assert not rep.passed
        assert not rep.leaves[0].per_entry_passed and rep.leaves[0].normalized_err > 2 * rep.leaves[0].bound


@pytest.fixture(scope="module")
def report():
    """A float64 matmul audit at two sizes: every per-entry bound meaningful."""
    def make_args(key, size):
        k1, k2 = jax.random.split(key)
        return jax.random.normal(k1, size, jnp.float64), jax.random.normal(k2, size[::-1], jnp.float64)

    with jax.enable_x64(True):
        return audit(jnp.matmul, jnp.matmul, make_args, [(3, 4), (5, 6)], name="matmul")


class TestAuditSummary:
    """A summary never reads better than the check it summarises: a per-entry bound that cannot fail is named."""

    @staticmethod
    def _with_kappa(report, kappa, rows):
        reps = [dataclasses.replace(r, leaves=[dataclasses.replace(lf, kappa=kappa) if (i, j) in rows else lf
                                               for j, lf in enumerate(r.leaves)])
                for i, r in enumerate(report.reports)]
        return dataclasses.replace(report, reports=reps)

    def test_a_meaningful_bound_reports_the_worst_fraction(self, report):
        assert report.vacuous_leaves() == []
        worst = max(lf.normalized_err / lf.bound for r in report.reports for lf in r.leaves)
        assert report.worst_fraction_of_bound == worst
        assert report.summary() == f"worst {worst:8.3f} of bound"

    @pytest.mark.parametrize("kappa", [1e200, math.inf, math.nan])
    def test_vacuous_rows_are_named_and_left_out_of_the_worst(self, report, kappa):
        n = sum(len(r.leaves) for r in report.reports)
        partly = self._with_kappa(report, kappa, {(0, 0)})
        assert [(s, name) for s, name, _, _ in partly.vacuous_leaves()] == [((3, 4), report.reports[0].leaves[0].name)]
        assert partly.summary().endswith(f"(1/{n} leaf rows: bound vacuous)")
        assert f"per-entry bound vacuous at 1 of {n} leaf rows" in str(partly)
        every = self._with_kappa(report, kappa, {(i, j) for i, r in enumerate(report.reports)
                                                 for j in range(len(r.leaves))})
        assert math.isnan(every.worst_fraction_of_bound)
        assert every.summary() == f"per-entry bound vacuous at all {n} leaf rows (bound x kappa >= 1)"
        assert "of bound" not in every.summary()
