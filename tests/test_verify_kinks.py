"""Kinks: a low-precision run may take the other side of a ReLU (or any comparison) that the float64 reference takes.

Where a pre-activation lies within rounding of zero, TF32 and float64 can disagree on its sign; the gradient then
differs by the whole term ``g * x`` that the mask lets through or stops, O(1) times the terms, not O(u). That is
rounding, not a bug (on an H100 the Pallas conv's TF32 gradients were 1.1e-2 off the float64 reference normwise
with 8 flipped masks, and 2.9e-4 off a float64 reference that used the kernel's own mask). The verifier's bound
therefore adds, per gradient entry, the jump ``K`` the uncertain comparisons can cause (jaxgrad/verify/magnitude.py),
and a real bug still fails next to such flips.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.verify import check_vjp, magnitudes
from jaxgrad.verify.precision import ErrorModel

B, K_IN, OUT = 64, 24, 16
N_NEAR_ZERO = 32  # rows given a pre-activation at exactly zero (in float64): its sign in TF32 is a coin toss


def _tf32(a):
    """Round to TF32 operands (10 mantissa bits), as tensor cores do with f32 inputs."""
    return jax.lax.reduce_precision(a, exponent_bits=8, mantissa_bits=10)


def relu_layer_tf32(x, w):
    """A correct TF32 layer: its VJP (by autodiff) applies the mask of its *own* rounded pre-activation."""
    return jax.nn.relu(_tf32(x) @ _tf32(w))


def relu_layer(x, w):
    return jax.nn.relu(x @ w)


def _near_zero_inputs(seed=0):
    """x, w, g with N_NEAR_ZERO pre-activations z[b, o] = 0 exactly in float64 (x[b] projected off w[:, o])."""
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = np.asarray(jax.random.normal(kx, (B, K_IN)), np.float64)
    w = np.asarray(jax.random.normal(kw, (K_IN, OUT)) / K_IN ** 0.5, np.float64)
    for r in range(N_NEAR_ZERO):
        col = w[:, r % OUT]
        x[r] -= (x[r] @ col) / (col @ col) * col
    g = jax.random.normal(kg, (B, OUT))
    return jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), g


@pytest.fixture(scope="module")
def inputs():
    return _near_zero_inputs()


def test_the_tf32_layer_really_flips_masks(inputs):
    x, w, _ = inputs
    z64 = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    y = np.asarray(relu_layer_tf32(x, w))
    assert int(np.sum((y > 0) != (z64 > 0))) >= 5


def test_flips_within_rounding_pass_with_the_kink_term(inputs):
    x, w, g = inputs
    # At the TF32 bound (the tightest that applies; left to itself the verifier may judge the run coarser, bf16,
    # from the forward mismatch, which only loosens the bound).
    rep = check_vjp(relu_layer_tf32, relu_layer, x, w, cotangent=g, precision="tf32")
    assert rep.passed, str(rep)
    assert any(n.startswith("kinks:") for n in rep.notes)
    assert check_vjp(relu_layer_tf32, relu_layer, x, w, cotangent=g).passed


def test_without_the_kink_term_the_same_run_would_fail(inputs):
    """The test above is not trivially true: sum|terms| alone would call these flips a bug."""
    x, w, g = inputs
    _, pull = jax.vjp(relu_layer_tf32, x, w)
    dx, dw = pull(g)
    with jax.enable_x64(True):
        a64 = [jnp.asarray(a, jnp.float64) for a in (x, w, g)]

        def ref_vjp(x, w, g):
            return jax.vjp(relu_layer, x, w)[1](g)

        plain = magnitudes(ref_vjp, *a64)
        kinked = magnitudes(ref_vjp, *a64, kink_bound=ErrorModel("tf32", 8.0, "").bound)
    model = ErrorModel("tf32", 8.0, "")
    worst = []
    for got, r, m, n, k in zip((dx, dw), plain.values, plain.magnitudes, plain.terms, kinked.kinks):
        err = np.abs(np.asarray(got, np.float64) - np.asarray(r))
        worst.append(float(np.max(err / np.asarray(m))) / model.bound(n))
        assert np.all(err <= model.bound(n) * np.asarray(m) + np.asarray(k))  # what check_vjp now applies
    assert max(worst) > 3.0  # several times the first-order bound


def test_a_missing_relu_derivative_still_fails_next_to_flips(inputs):
    x, w, g = inputs

    @jax.custom_vjp
    def layer(x, w):
        return relu_layer_tf32(x, w)

    def fwd(x, w):
        return layer(x, w), (x, w)

    def bwd(res, ct):
        x, w = res
        return ct @ _tf32(w).T, _tf32(x).T @ ct  # BUG: ReLU' (the mask) skipped

    layer.defvjp(fwd, bwd)
    rep = check_vjp(layer, relu_layer, x, w, cotangent=g, precision="tf32")
    assert not rep.passed
    assert {lf.name for lf in rep.failures if lf.run == "tf32"} == {"args[0]", "args[1]"}


def test_kink_term_of_a_relu_matmul_is_the_stopped_terms():
    """K(dW) = |x|^T (U * |g|), U = the pre-activations within r(N) sum|terms| of zero (exact formula)."""
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    with jax.enable_x64(True):
        x = jax.random.normal(k1, (40, 8), jnp.float64)
        w = jax.random.normal(k2, (8, 12), jnp.float64)
        g = jax.random.normal(k3, (40, 12), jnp.float64)
        radius = 2e-2
        res = magnitudes(lambda x, w, g: jax.vjp(relu_layer, x, w)[1](g), x, w, g, kink_bound=lambda n: radius)
        z, m = np.asarray(x @ w), np.asarray(jnp.abs(x) @ jnp.abs(w))
    u = np.abs(z) <= radius * m
    assert 0 < u.sum() < u.size
    np.testing.assert_allclose(np.asarray(res.kinks[1]), np.abs(np.asarray(x)).T @ (u * np.abs(np.asarray(g))))
    np.testing.assert_allclose(np.asarray(res.kinks[0]), (u * np.abs(np.asarray(g))) @ np.abs(np.asarray(w)).T)
    assert res.uncertain_comparisons == int(u.sum())


def test_comparisons_of_exact_inputs_are_never_uncertain():
    """An input compared with a constant (a B-spline knot test on the layer's own input) is not rounded: no kink."""
    with jax.enable_x64(True):
        x = jnp.linspace(-1.0, 1.0, 101)
        res = magnitudes(lambda x: jnp.where(x > 0.0, x * x, -x), x, kink_bound=lambda n: 0.1)
        assert res.rounded_comparisons == ()
        assert res.uncertain_comparisons == 0 and res.kink_counts == [0]
        rounded = magnitudes(lambda x: jnp.where(x + 0.3 > 0.0, x * x, -x), x, kink_bound=lambda n: 0.1)
        assert rounded.rounded_comparisons == ("gt",) and rounded.uncertain_comparisons > 0


def test_without_comparisons_there_is_no_kink_pass(monkeypatch):
    """A smooth function costs one interpreted pass, as before."""
    import jaxgrad.verify.core as core

    calls = []
    real = core.magnitudes

    def counting(*a, **k):
        calls.append(k.get("kink_bound"))
        return real(*a, **k)

    monkeypatch.setattr(core, "magnitudes", counting)
    x = jax.random.normal(jax.random.key(2), (7, 5))
    assert check_vjp(jnp.tanh, jnp.tanh, x).passed
    assert calls == [None]


@pytest.mark.gpu
def test_pallas_conv_relu_audit_passes_on_the_gpu():
    """The case that failed on an H100 in TF32 (2.7x the bound at (2, 13, 10)) before the kink term: ReLU masks of
    pre-activations within TF32 rounding of zero, flipped relative to float64."""
    from jaxgrad.cnn.conv import audit_cases
    from jaxgrad.verify import audit

    (case,) = [c for c in audit_cases() if "pallas" in c.name]
    rep = audit(case.fn, case.reference, case.make_args, case.sizes, name=case.name, arg_names=case.arg_names)
    assert rep.passed, str(rep)


def test_comparison_radius_is_the_first_order_error_of_a_nonlinear_chain():
    """The radius of ``exp(x w) > c`` is Wilkinson's running error bound E, linear in the operands' errors:
    E(xw) = r|xw|, E(e) = |e| E(xw) + r|e|, E(e - c) = E(e) + r(|e| + |c|) -- not r M with M(exp a) = |e|(1 + M(a)),
    whose products of magnitudes compound through every nonlinear step (~1e150 over a transformer block)."""
    r, c = 0.01, 1.5
    with jax.enable_x64(True):
        x = jnp.linspace(-1.0, 1.5, 401)
        w = jnp.float64(0.7)
        res = magnitudes(lambda x, w: jnp.where(jnp.exp(x * w) - c > 0.0, x, 0.0), x, w, kink_bound=lambda n: r)
        xw = np.abs(np.asarray(x * w))
        e = np.exp(np.asarray(x * w))
        err = e * r * xw + r * e + r * (e + c)
    u = np.abs(e - c) <= err
    assert 0 < u.sum() < 40
    assert res.uncertain_comparisons == int(u.sum())


def test_a_sum_of_positive_terms_compared_with_zero_is_never_uncertain():
    """A softmax denominator ``sum exp(s) > 0`` keeps its sign under any rounding, however large its error bound
    (a bf16 bound through RMSNorm and attention is O(1) of it): not a kink. ``sum exp(s) > 3`` can flip."""
    with jax.enable_x64(True):
        s = jax.random.normal(jax.random.key(3), (6, 9), jnp.float64)

        def attn(s, t):
            e = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
            den = jnp.sum(e, axis=-1, keepdims=True)
            return e / jnp.where(den > t, den, 1.0)

        at_zero = magnitudes(lambda s: attn(s, 0.0), s, kink_bound=lambda n: 0.5)
        assert "gt" in at_zero.rounded_comparisons and at_zero.kink_counts == [0]
        den = np.sum(np.exp(np.asarray(s) - np.asarray(s).max(-1, keepdims=True)), -1)
        t = float(np.median(den))
        at_t = magnitudes(lambda s: attn(s, t), s, kink_bound=lambda n: 0.5)
        assert at_t.kink_counts[0] > 0


@pytest.mark.parametrize("movement", ["optimization_barrier", "split"])
def test_sign_certainty_passes_through_data_movement_with_a_list_result(movement):
    """``optimization_barrier`` and ``split`` return a list even for one result (the NF4 block's barrier did, and
    crashed the interpreter on the H100): the sign of a positive sum carried through them stays certain."""
    move = {"optimization_barrier": lambda v: jax.lax.optimization_barrier(v),
            "split": lambda v: jnp.split(v, [4], axis=-1)[1]}[movement]
    with jax.enable_x64(True):
        s = jax.random.normal(jax.random.key(4), (6, 9), jnp.float64)

        def attn(s):
            e = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
            den = move(jnp.sum(e, axis=-1, keepdims=True) * jnp.ones((1, 9)))
            return jnp.where(den > 0.0, 1.0 / den, 0.0)

        m = magnitudes(attn, s, kink_bound=lambda n: 0.5)
        assert "gt" in m.rounded_comparisons and m.kink_counts == [0]


def _trend_reports(rel_errs, ref_rel_errs, flip_free, kink_spread):
    """Fake per-size reports of one tf32 leaf 'x' (what audit's size trend reads of them)."""
    from types import SimpleNamespace as NS

    from jaxgrad.verify.stats import LeafStatistics

    reports = []
    for rel, ref, ff in zip(rel_errs, ref_rel_errs, flip_free):
        st = LeafStatistics(n=252, replicas=32, alpha=1e-4, rho=1.0, norm_ratio=1.0, norm_limit=4.4, dof=40.0,
                            beta=0.0, beta_sigma=1e-4, beta_limit=1e-3, entry_z=1.0, entry_limit=7.0, entry_index=(0,),
                            slice_ratio=0.1, slice_where="", failed=(), kink_spread=kink_spread, flip_free_ratio=ff)
        leaf = NS(name="x", run="tf32", rel_err=rel, ref_rel_err=ref, stats=st)
        reports.append(NS(precision=NS(precision="tf32"), leaves=[leaf], as_called=lambda name, lf=leaf: lf))
    return reports


def test_the_size_trend_behind_kinks_judges_what_no_flip_explains():
    # conv2d[pallas] on the H100: dx's normwise error over the replicas' read 0.25 at the small size (the
    # replicas flipped ReLUs, fn did not) and 1.8 at the larger (fn flipped more): a 7.2x "growth" made of whole-term
    # flips, not of rounding. Behind kinks the trend compares the part no flip explains
    from jaxgrad.verify.audit import _size_trend

    sizes = [(1, 7, 9), (2, 13, 10)]
    (check,) = _size_trend(sizes, _trend_reports([3.45e-4, 2.35e-2], [1.38e-3, 1.3e-2], [0.9, 1.1], 0.3))
    assert check.passed, check.detail
    # the same numbers without kinks are judged on the plain normwise ratio, as before: that growth fails
    (plain,) = _size_trend(sizes, _trend_reports([3.45e-4, 2.35e-2], [1.38e-3, 1.3e-2], [0.9, 1.1], 0.0))
    assert not plain.passed and "grows faster than rounding" in plain.detail
    # and behind kinks an error beyond the flips that grows 10x still fails
    (grows,) = _size_trend(sizes, _trend_reports([3.45e-4, 2.35e-2], [1.38e-3, 1.3e-2], [0.9, 9.0], 0.3))
    assert not grows.passed, grows.detail


def test_the_flip_free_ratio_is_the_plain_ratio_without_kinks_and_drops_the_flips_with_them():
    from jaxgrad.verify.stats import leaf_statistics

    rng = np.random.default_rng(3)
    g = rng.standard_normal((12, 9))
    r = 1e-4 * rng.standard_normal((32, 12, 9))
    e = 1e-4 * rng.standard_normal((12, 9))
    st = leaf_statistics(e, r, g, "tf32")
    assert st.flip_free_ratio == pytest.approx(np.linalg.norm(e) / np.sqrt(np.mean(np.sum(r**2, axis=(1, 2)))))
    # fn flips three masks the replicas did not: whole terms of 1e-2 at entries whose jump K allows them
    kink = np.zeros_like(g)
    kink[[0, 3, 7], [1, 4, 8]] = 2e-2
    e_flip = e.copy()
    e_flip[[0, 3, 7], [1, 4, 8]] += 1e-2
    st_flip = leaf_statistics(e_flip, r, g, "tf32", kink=kink)
    assert st_flip.flip_free_ratio < 1.5 * st.flip_free_ratio  # the flips are not counted as rounding
    assert np.linalg.norm(e_flip) / np.linalg.norm(e) > 10  # though they dominate the plain normwise error
