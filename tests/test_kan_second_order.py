"""Second (and third) derivatives through the KAN layer's custom VJP, in float64 against the plain-JAX reference
and against finite differences: reverse-over-reverse (``jax.grad`` of a loss built from ``jax.grad``/``jax.vjp``
w.r.t. ``x``), forward-over-reverse (``jax.hessian``), forward mode on ``backend="reference"``, and a 1-D Poisson
(physics-informed) loss whose parameter gradient contains ``u''``.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.kan.layer import kan_linear, kan_linear_reference
from jaxgrad.kan.network import kan_apply, kan_apply_reference

RTOL = 1e-10  # float64: both paths agree to rounding (~1e-14); this leaves room for cancellation


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _layer(rng, in_f, out_f, *, grid_size=4, spline_order=3, bias=True, spline_scale=1.0):
    """Float64 layer dict with white-noise trained leaves (numpy: no per-shape compiles of eager jax.random)."""
    G, k = grid_size, spline_order
    knots = -1.0 + np.arange(-k, G + k + 1) * (2.0 / G)
    p = {
        "base_weight": rng.standard_normal((out_f, in_f)) / math.sqrt(in_f),
        "spline_weight": spline_scale * rng.standard_normal((out_f, in_f, G + k)),
        "spline_scaler": rng.standard_normal((out_f, in_f)) / math.sqrt(in_f),
        "grid": np.broadcast_to(knots, (in_f, knots.size)),
    }
    if bias:
        p["bias"] = rng.standard_normal((out_f,))
    return {name: jnp.asarray(v, jnp.float64) for name, v in p.items()}


def _net(seed, widths, **cfg):
    rng = np.random.default_rng(seed)
    return [_layer(rng, a, b, **cfg) for a, b in zip(widths[:-1], widths[1:])]


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float64)


def _split(params):
    return [{k: v for k, v in p.items() if k != "grid"} for p in params], [p["grid"] for p in params]


def _merge(trainable, grids):
    return [{**t, "grid": g} for t, g in zip(trainable, grids)]


def _close(a, b, rtol=RTOL, what=""):
    """Trees equal to ``rtol`` relative to each leaf's largest entry."""
    for (path, u), v in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        u, v = np.asarray(u), np.asarray(v)
        scale = max(float(np.max(np.abs(v), initial=0.0)), 1e-300)
        err = float(np.max(np.abs(u - v), initial=0.0)) / scale
        assert err <= rtol, f"{what}{jax.tree_util.keystr(path)}: relative error {err:.2e} > {rtol:.0e}"


def _x(seed, shape):
    return jnp.asarray(np.random.default_rng(500 + seed).uniform(-1.4, 1.4, shape), jnp.float64)


# ---------------------------------------------------------------------------------------------------------------
# reverse-over-reverse
# ---------------------------------------------------------------------------------------------------------------
def _input_gradient_penalty(apply):
    """sum_b |d/dx sum_o w_o u_o(x_b)|^2: a gradient penalty / PINN-style term, differentiated again below."""
    def loss(trainable, grids, x, w):
        u = lambda x: jnp.sum(apply(_merge(trainable, grids), x) * w)  # noqa: E731
        return jnp.sum(jax.grad(u)(x) ** 2)
    return loss


@pytest.mark.parametrize("widths", [[3, 4], [2, 3, 2]])
def test_grad_of_input_gradient_matches_reference(widths):
    params = _net(1, widths)
    trainable, grids = _split(params)
    x = _x(1, (9, widths[0]))
    w = _normal(11, (widths[-1],))
    got = jax.jit(jax.grad(_input_gradient_penalty(kan_apply), argnums=(0, 2)))(trainable, grids, x, w)
    want = jax.jit(jax.grad(_input_gradient_penalty(kan_apply_reference), argnums=(0, 2)))(trainable, grids, x, w)
    _close(got, want)
    assert float(jnp.max(jnp.abs(got[1]))) > 0 and not any(bool(jnp.any(jnp.isnan(a))) for a in jax.tree.leaves(got))


def test_grad_of_vjp_matches_reference():
    params = _net(2, [3, 4])
    trainable, grids = _split(params)
    x = _x(2, (2, 5, 3))
    c = _normal(21, (2, 5, 4))
    r = _normal(22, (2, 5, 3))

    def loss(apply):
        def f(trainable, x):
            _, pb = jax.vjp(lambda x: apply(_merge(trainable, grids), x), x)
            (dx,) = pb(c)
            return jnp.sum(jnp.sin(dx) * r)
        return jax.jit(jax.grad(f, argnums=(0, 1)))

    _close(loss(kan_apply)(trainable, x), loss(kan_apply_reference)(trainable, x))


def test_grad_of_input_gradient_matches_finite_differences():
    """Ground truth that does not depend on the reference: central differences of the custom-VJP path's own
    second-order gradient along random directions."""
    params = _net(3, [2, 3, 2])
    trainable, grids = _split(params)
    x = _x(3, (5, 2))
    w = jnp.array([0.7, -1.3])
    loss = jax.jit(_input_gradient_penalty(kan_apply))
    gt, gx = jax.jit(jax.grad(_input_gradient_penalty(kan_apply), argnums=(0, 2)))(trainable, grids, x, w)
    rng = np.random.default_rng(33)
    vt = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape)), trainable)
    vx = jnp.asarray(rng.standard_normal(x.shape))
    exact = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(gt), jax.tree.leaves(vt))) + jnp.vdot(gx, vx)
    eps = 1e-5
    move = lambda s: loss(jax.tree.map(lambda a, v: a + s * v, trainable, vt), grids, x + s * vx, w)  # noqa: E731
    fd = (move(eps) - move(-eps)) / (2 * eps)
    assert abs(float(fd - exact)) <= 1e-6 * max(1.0, abs(float(exact))), (float(fd), float(exact))


def test_single_layer_all_orders_second_order():
    for order in range(1, 6):
        p = _layer(np.random.default_rng(70 + order), 2, 3, grid_size=3, spline_order=order)
        x = _x(7 + order, (4, 2))
        w = jnp.array([1.0, -0.5, 2.0])

        def loss(f):
            penalty = lambda p, x: jnp.sum(jax.grad(lambda x: jnp.sum(f(p, x) * w))(x) ** 3)  # noqa: E731
            return jax.jit(jax.grad(penalty, argnums=(0, 1)))

        got, want = loss(kan_linear)(p, x), loss(kan_linear_reference)(p, x)
        _close(got, want, what=f"order {order}: ")
        assert not bool(jnp.any(got[0]["grid"]))  # not trained, to second order too


# ---------------------------------------------------------------------------------------------------------------
# forward-over-reverse (hessian) and forward mode
# ---------------------------------------------------------------------------------------------------------------
def test_hessian_wrt_x_through_custom_vjp():
    params = _net(4, [3, 4, 1])
    x = _x(4, (3,))
    f = lambda x: kan_apply(params, x)[0]  # noqa: E731
    f_ref = lambda x: kan_apply_reference(params, x)[0]  # noqa: E731
    h = jax.jit(jax.hessian(f))(x)  # jacfwd(jacrev(f)): forward mode over the hand-written (differentiable) backward
    h_ref = jax.jit(jax.hessian(f_ref))(x)
    _close(h, h_ref)
    np.testing.assert_allclose(h, h.T, rtol=1e-12, atol=1e-12)
    # and against central differences of the custom VJP's gradient
    g = jax.jit(jax.grad(f))
    eps = 1e-6
    fd = jnp.stack([(g(x + eps * e) - g(x - eps * e)) / (2 * eps) for e in jnp.eye(3)])
    np.testing.assert_allclose(h, fd, rtol=1e-6, atol=1e-6)


def test_batched_second_derivative_wrt_x():
    """sum_i d^2 u/dx_i^2 per sample (a Laplacian), vmapped, custom VJP vs reference."""
    params = _net(5, [2, 4, 1], spline_order=2)
    xs = _x(5, (11, 2))

    def laplacian(apply):
        u = lambda x: apply(params, x)[0]  # noqa: E731
        return jax.jit(jax.vmap(lambda x: jnp.trace(jax.hessian(u)(x))))

    _close(laplacian(kan_apply)(xs), laplacian(kan_apply_reference)(xs))


def test_forward_mode_uses_reference_backend():
    params = _net(6, [3, 4, 2])
    x = _x(6, (5, 3))
    f = lambda x: kan_apply(params, x, backend="reference")  # noqa: E731
    jf = jax.jit(jax.jacfwd(f))(x)
    jr = jax.jit(jax.jacrev(lambda x: kan_apply(params, x)))(x)  # reverse mode through the custom VJP
    _close(jf, jr)
    t = _normal(60, x.shape)
    jvp = lambda f: jax.jit(lambda x, t: jax.jvp(f, (x,), (t,))[1])  # noqa: E731
    _close(jvp(f)(x, t), jvp(lambda x: kan_apply_reference(params, x))(x, t))
    # forward mode directly on the custom-VJP backend is refused by JAX (documented in kan_linear)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jacfwd(lambda x: kan_apply(params, x))(x)


# ---------------------------------------------------------------------------------------------------------------
# physics-informed: 1-D Poisson u''(x) + pi^2 sin(pi x) = 0 on (0, 1), u(0) = u(1) = 0
# ---------------------------------------------------------------------------------------------------------------
def _poisson_loss(apply, grids, xs):
    def u(trainable, x):  # scalar -> scalar
        return apply(_merge(trainable, grids), x[None])[0]

    def loss(trainable):
        u_xx = jax.vmap(jax.grad(jax.grad(u, argnums=1), argnums=1), in_axes=(None, 0))(trainable, xs)
        residual = u_xx + jnp.pi**2 * jnp.sin(jnp.pi * xs)
        boundary = u(trainable, jnp.float64(0.0)) ** 2 + u(trainable, jnp.float64(1.0)) ** 2
        return jnp.mean(residual**2) + boundary

    return loss


_XS = np.linspace(0.0, 1.0, 17)[1:-1] + 0.013  # interior collocation points, off the knots


def test_poisson_pinn_gradient_matches_reference():
    params = _net(8, [1, 5, 1], grid_size=5, spline_order=3)
    trainable, grids = _split(params)
    xs = jnp.asarray(_XS)
    loss_vjp = jax.jit(jax.value_and_grad(_poisson_loss(kan_apply, grids, xs)))
    loss_ref = jax.jit(jax.value_and_grad(_poisson_loss(kan_apply_reference, grids, xs)))
    (l1, g1), (l2, g2) = loss_vjp(trainable), loss_ref(trainable)
    np.testing.assert_allclose(l1, l2, rtol=1e-12)
    _close(g1, g2)
    assert all(float(jnp.max(jnp.abs(a))) > 0 for a in jax.tree.leaves(g1))
    # independent check: central difference of the custom-VJP loss along a random direction
    rng = np.random.default_rng(81)
    v = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape)), trainable)
    loss = jax.jit(_poisson_loss(kan_apply, grids, xs))
    eps = 1e-6
    fd = (loss(jax.tree.map(lambda a, b: a + eps * b, trainable, v))
          - loss(jax.tree.map(lambda a, b: a - eps * b, trainable, v))) / (2 * eps)
    exact = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(v)))
    assert abs(float(fd - exact)) <= 1e-6 * abs(float(exact)), (float(fd), float(exact))


def test_poisson_pinn_training_steps_agree():
    """20 gradient-descent steps on the Poisson loss: same trajectory on both paths, and the loss goes down."""
    params = _net(9, [1, 5, 1], grid_size=5, spline_order=3, spline_scale=0.1)
    trainable, grids = _split(params)
    xs = jnp.asarray(_XS)

    def run(apply):
        grad = jax.value_and_grad(_poisson_loss(apply, grids, xs))

        def step(t, _):
            value, g = grad(t)
            return jax.tree.map(lambda a, b: a - 2e-3 * b, t, g), value

        return jax.jit(lambda t: jax.lax.scan(step, t, length=20))(trainable)

    (t1, losses1), (t2, losses2) = run(kan_apply), run(kan_apply_reference)
    np.testing.assert_allclose(losses1, losses2, rtol=1e-9)
    _close(t1, t2, rtol=1e-9)
    assert float(losses1[-1]) < float(losses1[0])
