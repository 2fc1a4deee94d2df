"""``precision="fp16_scaled"``: the KAN layer's products from float16 operands scaled by powers of two, float32 sums.

The claim (``jaxgrad/kan/fp16_scaled.py``): each operand is rounded once with relative error ``2^-11`` (TF32's),
the scaling keeps every slice in float16's range and is undone exactly. So the forward and every gradient (the
trained params and ``x``) must pass ``check_vjp`` under the verifier's TF32 model (``precision="tf32"``: the
reference's product operands rounded to 10 mantissa bits, no exponent limit) against the float64 reference, at odd
sizes and at a dynamic range float16 cannot hold unscaled; the same check must fail when the operands are cast to
float16 without the scaling. The float64 re-run of the same code (no float16 rounding) matches the reference to
1e-10, which checks the equations and the exact unscaling.
"""

import functools
import math

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.kan import fp16_scaled
from jaxgrad.kan.layer import kan_linear, kan_linear_reference
from jaxgrad.kan.network import kan_apply, kan_apply_reference
from jaxgrad.kan.task import CLI_SCHEMA, KANFit, make_task
from jaxgrad.train.errors import ConfigError
from jaxgrad.verify import check_vjp

U16 = 2.0**-11  # float16 / TF32 unit roundoff
U32 = 2.0**-24


def _layer(seed, in_f, out_f, *, grid_size=5, spline_order=3, row_scales=None):
    """White-noise trained leaves (bias included), uniform extended grid on [-1, 1]. ``row_scales[o]`` multiplies
    output ``o``'s base_weight, spline_weight and bias: a dynamic range across the rows of one tensor."""
    rng = np.random.default_rng(seed)
    G, k = grid_size, spline_order
    knots = -1.0 + np.arange(-k, G + k + 1) * (2.0 / G)
    s = np.ones(out_f) if row_scales is None else np.asarray(row_scales, np.float64)
    p = {
        "base_weight": rng.standard_normal((out_f, in_f)) / math.sqrt(in_f) * s[:, None],
        "spline_weight": rng.standard_normal((out_f, in_f, G + k)) * s[:, None, None],
        "spline_scaler": rng.standard_normal((out_f, in_f)) / math.sqrt(in_f),
        "bias": rng.standard_normal((out_f,)) * s,
    }
    trainable = {n: jnp.asarray(v, jnp.float32) for n, v in p.items()}
    return trainable, jnp.asarray(np.broadcast_to(knots, (in_f, knots.size)), jnp.float32)


def _x(seed, batch, in_f, lo=-1.2, hi=1.2):
    return jnp.asarray(np.random.default_rng(1000 + seed).uniform(lo, hi, (batch, in_f)), jnp.float32)


def _check(trainable, grid, x, **options):
    fn = jax.jit(lambda t, x: kan_linear({**t, "grid": grid}, x, precision="fp16_scaled"))
    ref = jax.jit(lambda t, x: kan_linear_reference({**t, "grid": grid}, x))
    return check_vjp(fn, ref, trainable, x, arg_names=("params", "x"), precision="tf32", **options)


def _unscaled(a, b, a_bound=None):
    """The same product with a plain float16 cast of each operand: no scaling."""
    return jax.lax.dot_general(a.astype(jnp.float16), b.astype(jnp.float16), (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------------------------
# the scaled product itself
# ---------------------------------------------------------------------------------------------------------------
def test_scale_puts_each_slices_largest_value_in_2_14_to_2_15():
    amax = jnp.asarray([1.0, 3.0, 2.0**14, 2.0**15 - 1, 1e-30, 1e30, 0.0, np.inf, np.nan], jnp.float32)
    s = np.asarray(fp16_scaled.scale_exponents(amax))
    scaled = np.asarray(amax, np.float64)[:6] * 2.0 ** s[:6].astype(np.float64)
    assert np.all((scaled >= 2.0**14) & (scaled < 2.0**15)), scaled
    assert list(s[6:]) == [0, 0, 0]  # zero and non-finite maxima: scale 1
    # 2^e built from its bits, and an unscaling beyond float32's exponent range done in two exact steps
    e = jnp.arange(-126, 128)
    assert np.array_equal(np.asarray(fp16_scaled.pow2(e, jnp.float32), np.float64), 2.0 ** np.arange(-126, 128))
    assert float(fp16_scaled.unscale(jnp.float32(2.0**30), jnp.int32(-140))) == 2.0**-110
    assert float(fp16_scaled.unscale(jnp.float32(2.0**-100), jnp.int32(200))) == 2.0**100


def test_product_error_is_tf32s_at_any_row_and_column_scale():
    """|c - ab| <= (2u + u^2 + K u32) sum|a||b| per entry, with rows of a and columns of b from 1e-15 to 1e15
    (the subnormal term of the bound is zero here: every slice's values are within 2^28 of its largest)."""
    rng = np.random.default_rng(0)
    m, k, n = 9, 130, 11
    a = rng.standard_normal((m, k)) * np.logspace(-15, 15, m)[:, None]
    b = rng.standard_normal((k, n)) * np.logspace(15, -15, n)[None, :]
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    a, b = np.asarray(a32, np.float64), np.asarray(b32, np.float64)
    exact, mag = a @ b, np.abs(a) @ np.abs(b)
    bound = (2 * U16 + U16**2 + k * U32) * mag
    err = np.abs(np.asarray(fp16_scaled.matmul(a32, b32), np.float64) - exact)
    assert np.all(err <= bound), float(np.max(err / bound))
    assert np.max(err / mag) > U16 / 8  # it does round to float16 (a float32 product would be ~1e-7)
    # the plain cast overflows (inf) or flushes to zero on most rows and columns
    plain = np.asarray(_unscaled(a32, b32), np.float64)
    assert np.mean(~(np.abs(plain - exact) <= bound)) > 0.5


def test_float64_operands_take_the_same_scales_without_rounding():
    with jax.enable_x64(True):
        rng = np.random.default_rng(1)
        a, b = rng.standard_normal((5, 40)) * 1e20, rng.standard_normal((40, 3)) * 1e-25
        c = np.asarray(fp16_scaled.matmul(jnp.asarray(a), jnp.asarray(b)))
        assert c.dtype == np.float64
        np.testing.assert_allclose(c, a @ b, rtol=1e-13, atol=1e-13 * np.max(np.abs(a) @ np.abs(b)))


def test_the_products_cotangents_are_scaled_products_too():
    """grad through matmul (second-order use of the layer's backward) matches the exact cotangents to TF32's
    model, at a range a plain float16 cotangent could not hold."""
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.standard_normal((6, 50)) * 1e6, jnp.float32)
    b = jnp.asarray(rng.standard_normal((50, 4)) * 1e-6, jnp.float32)
    g = jnp.asarray(rng.standard_normal((6, 4)) * 1e5, jnp.float32)
    da, db = jax.vjp(fp16_scaled.matmul, a, b)[1](g)
    a64, b64, g64 = (np.asarray(v, np.float64) for v in (a, b, g))
    for got, want, mag, depth in ((da, g64 @ b64.T, np.abs(g64) @ np.abs(b64.T), 4),
                                  (db, a64.T @ g64, np.abs(a64.T) @ np.abs(g64), 6)):
        assert np.all(np.abs(np.asarray(got, np.float64) - want) <= (2 * U16 + U16**2 + depth * U32) * mag)


def test_operands_must_be_float32_or_float64_matrices():
    with pytest.raises(TypeError, match="float32"):
        fp16_scaled.matmul(jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 2), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"a\[M, K\] and b\[K, N\]"):
        fp16_scaled.matmul(jnp.ones((2, 3)), jnp.ones((2, 3)))


# ---------------------------------------------------------------------------------------------------------------
# the layer: check_vjp under the TF32 model at odd sizes
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch, in_f, out_f, grid_size, order", [
    (1, 96, 520, 3, 5),
    (7, 520, 96, 20, 1),
    (129, 9, 6, 20, 5),
    (129, 7, 5, 3, 1),
])
def test_forward_and_every_gradient_pass_the_tf32_model(batch, in_f, out_f, grid_size, order):
    trainable, grid = _layer(batch + in_f, in_f, out_f, grid_size=grid_size, spline_order=order)
    # finite differences, and 16 or 32 rounding samples, only where cheap (CPU time): the float64 re-run of the
    # same code already checks the equations
    wide = in_f * out_f > 10_000
    report = _check(trainable, grid, _x(batch, batch, in_f), fd=not wide, replicas=8 if wide else None)
    assert report.passed, str(report)
    assert report.precision.precision == "tf32"
    assert "fn runs in float64" in report.float64_status  # the same code in float64: equations and unscaling


def _forward_error_over_model(trainable, grid, x):
    """Per output entry: |y - y*| over the product model (2u + u^2 + K u32) sum|terms|, in float64; sum|terms| =
    |silu(x)| |W|^T + B(x) |C|^T + |bias| (bases are >= 0) and K = in * (G + 2k + 1) bounds the longest sum."""
    with jax.enable_x64(True):
        p64 = {n: jnp.asarray(v, jnp.float64) for n, v in {**trainable, "grid": grid}.items()}
        x64 = jnp.asarray(x, jnp.float64)
        exact = np.asarray(kan_linear_reference(p64, x64))
        abs_spline = {**{n: jnp.abs(v) for n, v in p64.items()}, "grid": p64["grid"],
                      "base_weight": jnp.zeros_like(p64["base_weight"])}
        mag = np.asarray(kan_linear_reference(abs_spline, x64)) + \
            np.abs(np.asarray(jax.nn.silu(x64))) @ np.abs(np.asarray(p64["base_weight"])).T
    got = np.asarray(kan_linear({**trainable, "grid": grid}, x, precision="fp16_scaled"), np.float64)
    depth = x.shape[1] * grid.shape[1]
    return np.abs(got - exact) / ((2 * U16 + U16**2 + depth * U32) * mag)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the overflowed run's inf - inf
def test_rows_1e11_apart_pass_scaled_and_fail_a_plain_float16_cast(monkeypatch):
    """Outputs alternate between weights scaled by 1e5 and by 1e-6: one tensor spans 1e11, wider than float16's
    whole range (65504 down to subnormals below 6.1e-5). Per-row scaling passes the TF32 model and the per-entry
    product bound; the plain cast overflows on the 1e5 rows (the check fails) and rounds the 1e-6 rows among the
    subnormals (~5 significant bits: the per-entry bound fails there)."""
    out_f = 6
    trainable, grid = _layer(5, 24, out_f, row_scales=[1e5 if o % 2 else 1e-6 for o in range(out_f)])
    x = _x(5, 33, 24)
    report = _check(trainable, grid, x, fd=False)
    assert report.passed, str(report)
    assert np.max(_forward_error_over_model(trainable, grid, x)) <= 1.0
    monkeypatch.setattr(fp16_scaled, "matmul", _unscaled)
    jax.clear_caches()  # the custom VJP's traced forward and backward would be reused otherwise
    report = _check(trainable, grid, x, fd=False, float64=False)
    assert not report.passed and "non-finite" in str(report), str(report)
    small_rows = _forward_error_over_model(trainable, grid, x)[:, ::2]
    assert np.isfinite(small_rows).all() and np.max(small_rows) > 10.0, np.max(small_rows)


def test_bases_touched_only_by_their_tails_keep_tf32_accuracy():
    """batch 1, k = 5: a sample 0.05% to 2% of an interval past a knot gives the basis starting there
    B ~ 1e-17 .. 1e-9, below float16's range at the bases' forward scale 2^14 (flushed or subnormal). dcoef scales
    each basis column by its own maximum, so every entry of d spline_weight = g_o B_m(x_i) scaler_oi (one product
    at batch 1) keeps TF32's relative error; a fixed scale would flush them (error 100%). check_vjp passes too."""
    trainable, grid = _layer(11, 64, 3, grid_size=4, spline_order=5)
    x = jnp.asarray(-1.0 + 0.5 * (np.arange(64) % 5) + 0.5 * np.linspace(1e-3, 0.04, 64), jnp.float32)[None]
    g = jnp.asarray(np.random.default_rng(0).standard_normal((1, 3)), jnp.float32)
    def dweight(layer, t, grid, x, g):
        return jax.vjp(lambda t: layer({**t, "grid": grid}, x), t)[1](g)[0]["spline_weight"]

    scaled = functools.partial(kan_linear, precision="fp16_scaled")
    got = np.asarray(jax.jit(functools.partial(dweight, scaled))(trainable, grid, x, g), np.float64)
    with jax.enable_x64(True):
        want = np.asarray(jax.jit(functools.partial(dweight, kan_linear_reference))(
            *jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (trainable, grid, x, g))))
    assert np.sum((want != 0) & (np.abs(want) < 1e-9)) > 20  # the tails are there
    # one product of two float16-rounded operands, then two float32 roundings (the scaler, the bases in float32)
    np.testing.assert_array_less(np.abs(got - want), (2 * U16 + U16**2 + 16 * U32) * np.abs(want) + 1e-300)
    report = _check(trainable, grid, x, fd=False)
    assert report.passed, str(report)


# ---------------------------------------------------------------------------------------------------------------
# the network, the training config, and what is refused
# ---------------------------------------------------------------------------------------------------------------
def _f16_products(jaxpr) -> int:
    """The ``dot_general`` equations with float16 operands in a jaxpr and its sub-jaxprs."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and all(v.aval.dtype == jnp.float16 for v in eqn.invars):
            count += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    count += _f16_products(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    count += _f16_products(sub)
    return count


def test_network_passes_the_precision_to_every_layer():
    t1, g1 = _layer(0, 5, 4)
    t2, g2 = _layer(1, 4, 3)
    params = [{**t1, "grid": g1}, {**t2, "grid": g2}]
    x = _x(0, 17, 5)
    network = jax.jit(lambda p, x: kan_apply(p, x, precision="fp16_scaled"))
    # every layer's two forward products (SiLU branch, splines) take float16 operands
    assert _f16_products(jax.make_jaxpr(network)(params, x).jaxpr) == 2 * len(params)
    assert _f16_products(jax.make_jaxpr(lambda p, x: kan_apply(p, x))(params, x).jaxpr) == 0
    # and its four backward products (dC, g C, dW, g W)
    loss_grad = jax.grad(lambda p, x: jnp.sum(network(p, x)), argnums=(0, 1))
    assert _f16_products(jax.make_jaxpr(loss_grad)(params, x).jaxpr) == 6 * len(params)
    np.testing.assert_allclose(network(params, x), jax.jit(kan_apply_reference)(params, x), rtol=0, atol=1e-2)


def test_bad_precision_bf16_arrays_and_other_backends_are_refused_by_name():
    trainable, grid = _layer(0, 5, 4)
    params, x = {**trainable, "grid": grid}, _x(0, 3, 5)
    with pytest.raises(ValueError, match="'precision' must be .* or 'fp16_scaled'"):
        kan_linear(params, x, precision="fp16")
    with pytest.raises(ValueError, match="'precision' must be"):
        kan_apply([params], x, precision="FP16_SCALED")
    # bf16 (and f16) arrays are refused, not passed through: their operands are 16-bit already
    with pytest.raises(TypeError, match="takes float32 'x' .* got x bfloat16"):
        kan_linear(params, x.astype(jnp.bfloat16), precision="fp16_scaled")
    bf16_params = {**params, "spline_weight": params["spline_weight"].astype(jnp.bfloat16)}
    with pytest.raises(TypeError, match=r"got params\['spline_weight'\] bfloat16"):
        kan_linear(bf16_params, x, precision="fp16_scaled")
    for backend in ("pallas", "reference"):
        with pytest.raises(ValueError, match=f"backend='xla' .* only, got backend='{backend}'"):
            kan_linear(params, x, backend=backend, precision="fp16_scaled")


def test_training_config_key_selects_and_validates_the_precision():
    assert CLI_SCHEMA["model"]["precision"] == ("str", "default", ("default", "highest", "fp16_scaled"))
    with pytest.raises(ConfigError, match="'precision' must be one of"):
        KANFit(precision="fp16")
    with pytest.raises(ConfigError, match="needs backend 'xla' and dtype 'float32'"):
        KANFit(precision="fp16_scaled", backend="pallas")
    task = make_task(KANFit(precision="fp16_scaled", n_train=16, n_test=4), 1)
    params = task.init(jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (16, 2)), jnp.float32)
    batch = (x, jnp.zeros((16, 1), jnp.float32))
    assert "f16[" in str(jax.make_jaxpr(jax.grad(lambda p: task.loss(p, batch)[0]))(params))
    assert "precision fp16_scaled" in task.describe


def test_second_order_goes_through_scaled_products_at_any_row_scale():
    """grad of a loss on dy/dx (a physics-informed loss's shape): the layer's backward is differentiated again, its
    products' own VJPs are scaled products too, so rows 1e5 and 1e-6 apart neither overflow nor flush. Normwise
    error of the second-order gradient against float64: TF32 rounding compounded over a few products
    (measured ~2e-4; <= 2e-3)."""
    trainable, grid = _layer(3, 6, 4, row_scales=[1e5, 1e-6, 1e5, 1e-6])
    x = _x(3, 9, 6)

    def second(f, t, x):
        return jax.grad(lambda t: jnp.sum(jax.grad(lambda x: jnp.sum(f({**t, "grid": grid.astype(x.dtype)}, x)))(x)
                                          ** 2))(t)

    got = jax.jit(lambda t, x: second(lambda p, x: kan_linear(p, x, precision="fp16_scaled"), t, x))(trainable, x)
    with jax.enable_x64(True):
        want = jax.jit(lambda t, x: second(kan_linear_reference, t, x))(
            {n: jnp.asarray(v, jnp.float64) for n, v in trainable.items()}, jnp.asarray(x, jnp.float64))
    for name in trainable:
        g, w = np.asarray(got[name], np.float64), np.asarray(want[name])
        assert np.all(np.isfinite(g)), name
        assert np.linalg.norm(g - w) <= 2e-3 * np.linalg.norm(w), name  # bias: 0 (dy/dx does not depend on it)
