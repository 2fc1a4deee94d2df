r"""The hand-written VJPs of the planted-bug catalogue (:mod:`jaxgrad.verify.planted`), one section per op.

Each section has the op's plain-JAX ``*_reference``, a factory ``_make_<op>(bug)`` returning its ``jax.custom_vjp``
(``bug=None``: the correct backward; otherwise the named bug, one planted line) and ``_<op>_args(key, dtype)``,
white-noise inputs of asymmetric shapes. Every function computes in its inputs' dtype (float64 under
``jax.enable_x64(True)``, float32, bfloat16) except the deliberately low-precision ones, which say so.

Notation: :math:`\bar y` is the output cotangent ``g``; :math:`\bar x` the cotangent of input ``x``.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


def _normals(key: jax.Array, dtype, *shapes) -> tuple[jax.Array, ...]:
    """Independent standard-normal arrays of the given shapes, drawn directly in ``dtype``."""
    sizes = [math.prod(s) for s in shapes]
    # One draw, its length rounded up to a power of two >= 128, so that most makers share one compiled sampler.
    flat = jax.random.normal(key, (max(128, 1 << (sum(sizes) - 1).bit_length()),), dtype=dtype)
    ends = itertools.accumulate(sizes)
    return tuple(flat[e - n:e].reshape(s) for e, n, s in zip(ends, sizes, shapes))


def _layout_transposed(g: jax.Array) -> jax.Array:
    """The true gradient with its axes reversed, reinterpreted (C-order reshape) as the argument's shape."""
    return g.transpose(tuple(reversed(range(g.ndim)))).reshape(g.shape)



# ----------------------------------------------------------------------------------------------------------------
# 1. conv2d: NHWC input, HWIO kernel, stride 1, SAME padding.
# ----------------------------------------------------------------------------------------------------------------

_CONV_DN = ("NHWC", "HWIO", "NHWC")


def _same_pads(kh: int, kw: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """XLA's SAME padding for stride 1: total k-1, the extra element (even k) at the end."""
    return ((kh - 1) // 2, kh - 1 - (kh - 1) // 2), ((kw - 1) // 2, kw - 1 - (kw - 1) // 2)


def conv2d_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    r"""Plain conv: :math:`y_{nhwo} = \sum_{ijc} \tilde x_{n,h+i,w+j,c}\, W_{ijco}` (:math:`\tilde x` zero-padded)."""
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=_CONV_DN,
                                    precision=lax.Precision.HIGHEST)


def _make_conv2d(bug: str | None) -> Callable:
    r"""conv2d with a hand-written backward; ``bug`` plants one error.

    With :math:`\tilde x` the input zero-padded by :math:`(p_t, p_b)` rows and :math:`(p_l, p_r)` columns:

    .. math::

        y_{nhwo} &= \sum_{i,j,c} \tilde x_{n,h+i,w+j,c}\, W_{ijco} \\
        \bar W_{ijco} &= \sum_{n,h,w} \tilde x_{n,h+i,w+j,c}\, \bar y_{nhwo}
            \quad\text{(correlation of } x \text{ with } \bar y\text{)} \\
        \bar x_{nhwc} &= \sum_{i,j,o} \bar y_{n,h+p_t-i,w+p_l-j,o}\, W_{ijco}
            \quad\text{(full correlation of } \bar y \text{ with the 180°-flipped, I/O-swapped kernel)}

    :math:`\bar W` is computed as a conv whose "batch" is :math:`c` and whose contracted "feature" is :math:`n`;
    :math:`\bar x` as a conv of :math:`\bar y` with ``rev(W)`` read as HWOI, padded by :math:`(k-1-p_{lo}, k-1-p_{hi})`.
    """

    @jax.custom_vjp
    def conv2d(x, w):
        return conv2d_reference(x, w)

    def fwd(x, w):
        return conv2d_reference(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        kh, kw = w.shape[0], w.shape[1]
        (pt, pb), (pl, pr) = _same_pads(kh, kw)
        # dW[i,j,c,o] = sum_{n,h,w} xpad[n,h+i,w+j,c] g[n,h,w,o]: lhs x with batch=c, feature=n; rhs g with I=n.
        dw_cijo = lax.conv_general_dilated(
            x, g, (1, 1), ((pt, pb), (pl, pr)),
            dimension_numbers=("CHWN", "IHWO", "NHWC"), precision=lax.Precision.HIGHEST)  # [c, i, j, o]
        dw = dw_cijo.transpose(1, 2, 0, 3)  # HWIO
        # dx[n,h,w,c] = sum_{i,j,o} gpad[n, h+(kh-1-i), w+(kw-1-j), o] W[i,j,c,o]
        dx = lax.conv_general_dilated(
            g, jnp.flip(w, (0, 1)), (1, 1), ((kh - 1 - pt, kh - 1 - pb), (kw - 1 - pl, kw - 1 - pr)),
            dimension_numbers=("NHWC", "HWOI", "NHWC"), precision=lax.Precision.HIGHEST)
        if bug == "flip":
            dw = jnp.flip(dw, (0, 1))  # BUG: kernel gradient rotated by 180 degrees
        elif bug == "transpose":
            dw = _layout_transposed(dw)  # BUG: computed as [O,I,W,H], reshaped (not transposed) to HWIO
        elif bug == "shift":
            dx = jnp.roll(dx, 1, axis=1)  # BUG: input gradient off by one pixel along H (circular)
        elif bug == "scale":
            dw = dw * (1 + 1e-4)  # BUG: systematic 1e-4 relative scale
        return dx.astype(x.dtype), dw.astype(w.dtype)

    conv2d.defvjp(fwd, bwd)
    return conv2d


def _conv2d_args(key, dtype):
    return _normals(key, dtype, (2, 9, 7, 3), (3, 5, 3, 4))


# ----------------------------------------------------------------------------------------------------------------
# 2. linear layer y = x @ w + b.
# ----------------------------------------------------------------------------------------------------------------


def linear_reference(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    r""":math:`y = x W + b`, ``x [B, in]``, ``w [in, out]``, ``b [out]``."""
    return jnp.dot(x, w, precision=lax.Precision.HIGHEST) + b


def _make_linear(bug: str | None) -> Callable:
    r"""Linear layer with a hand-written backward.

    .. math::

        \bar x = \bar y W^\top, \qquad \bar W = x^\top \bar y, \qquad \bar b_o = \sum_{n} \bar y_{no}

    Bugs: ``"bias-mean"`` uses :math:`\frac1B\sum_n` (violates :math:`\bar b = \sum_n \bar y_n`, off by a factor
    :math:`1/B`); ``"dx-zero"`` returns :math:`\bar x = 0`.
    """
    hi = lax.Precision.HIGHEST

    @jax.custom_vjp
    def linear(x, w, b):
        return linear_reference(x, w, b)

    def fwd(x, w, b):
        return linear_reference(x, w, b), (x, w)

    def bwd(res, g):
        x, w = res
        dx = jnp.dot(g, w.T, precision=hi)
        dw = jnp.dot(x.T, g, precision=hi)
        db = jnp.sum(g, axis=0)
        if bug == "bias-mean":
            db = jnp.mean(g, axis=0)  # BUG: averaged over the batch instead of summed
        elif bug == "dx-zero":
            dx = jnp.zeros_like(dx)  # BUG: input gradient dropped
        return dx, dw, db

    linear.defvjp(fwd, bwd)
    return linear


def _linear_args(key, dtype):
    return _normals(key, dtype, (6, 5), (5, 4), (4,))


def _make_linear_f32_only() -> Callable:
    r"""Linear layer whose forward *and* backward run in float32 whatever the input dtype (like an f32-only
    Pallas kernel), results cast back to the input dtypes. Same math as :func:`_make_linear`; correct, but it
    never computes in float64, so its float64 re-run differs from the reference at the :math:`2^{-24}` level."""
    hi = lax.Precision.HIGHEST
    f32 = jnp.float32

    @jax.custom_vjp
    def linear_f32(x, w, b):
        return (jnp.dot(x.astype(f32), w.astype(f32), precision=hi) + b.astype(f32)).astype(x.dtype)

    def fwd(x, w, b):
        return linear_f32(x, w, b), (x, w, b)

    def bwd(res, g):
        x, w, b = res
        g32 = g.astype(f32)
        dx = jnp.dot(g32, w.astype(f32).T, precision=hi)
        dw = jnp.dot(x.astype(f32).T, g32, precision=hi)
        db = jnp.sum(g32, axis=0)
        return dx.astype(x.dtype), dw.astype(w.dtype), db.astype(b.dtype)

    linear_f32.defvjp(fwd, bwd)
    return linear_f32


def _long_sum_args(key, dtype):
    return _normals(key, dtype, (1_000_000, 2), (2, 3), (3,))


# ----------------------------------------------------------------------------------------------------------------
# 3. 1-D B-spline with learnable coefficients.
# ----------------------------------------------------------------------------------------------------------------

_SPLINE_G = 5  # intervals on [-1, 1]
_SPLINE_K = 3  # degree (cubic); the grid is extended by k knots on each side


def _spline_knots(dtype) -> jax.Array:
    """Uniform knots :math:`t_i = -1 + (i - k)\\,h`, :math:`h = 2/G`, :math:`i = 0..G+2k` (``G + 2k + 1`` knots)."""
    h = 2.0 / _SPLINE_G
    return (-1.0 + (jnp.arange(_SPLINE_G + 2 * _SPLINE_K + 1) - _SPLINE_K) * h).astype(dtype)


@functools.partial(jax.jit, static_argnums=2)
def _spline_bases(x: jax.Array, t: jax.Array, p: int) -> jax.Array:
    r"""Cox-de Boor: all degree-``p`` B-splines at ``x [B]`` -> ``[B, len(t) - 1 - p]``.

    .. math::

        B_i^0(x) = [t_i \le x < t_{i+1}], \qquad
        B_i^q(x) = \frac{x - t_i}{t_{i+q} - t_i} B_i^{q-1}(x)
            + \frac{t_{i+q+1} - x}{t_{i+q+1} - t_{i+1}} B_{i+1}^{q-1}(x)
    """
    xc = x[:, None]
    bases = ((xc >= t[:-1]) & (xc < t[1:])).astype(x.dtype)
    for q in range(1, p + 1):
        left = (xc - t[: -(q + 1)]) / (t[q:-1] - t[: -(q + 1)]) * bases[:, :-1]
        right = (t[q + 1:] - xc) / (t[q + 1:] - t[1:-q]) * bases[:, 1:]
        bases = left + right
    return bases


def bspline_reference(x: jax.Array, c: jax.Array) -> jax.Array:
    r""":math:`y_b = \sum_m c_m B_m^k(x_b)`, ``x [B]``, ``c [G + k]``; ``jax.vjp`` differentiates the recursion."""
    return _spline_bases(x, _spline_knots(x.dtype), _SPLINE_K) @ c


def _make_bspline(bug: str | None) -> Callable:
    r"""B-spline evaluation with a hand-written backward.

    .. math::

        \frac{d B_j^p}{dx} &= p \left[ \frac{B_j^{p-1}}{t_{j+p} - t_j} - \frac{B_{j+1}^{p-1}}{t_{j+p+1} - t_{j+1}}
            \right] \\
        \bar x_b &= \bar y_b \sum_m c_m \frac{d B_m^k}{dx}(x_b), \qquad \bar c_m = \sum_b \bar y_b\, B_m^k(x_b)

    Bugs: ``"missing-p"`` drops the factor :math:`p` (:math:`\bar x` off by :math:`1/p = 1/3`); ``"wrong-sign"``
    keeps it but flips the bracket's sign (:math:`\bar x` off by :math:`-1`).
    """
    p = _SPLINE_K

    @jax.custom_vjp
    def bspline(x, c):
        return bspline_reference(x, c)

    def fwd(x, c):
        t = _spline_knots(x.dtype)
        lower = _spline_bases(x, t, p - 1)  # [B, G + k + 1]
        xc = x[:, None]
        # degree-p step of Cox-de Boor, reusing the degree p-1 bases
        bases = ((xc - t[: -(p + 1)]) / (t[p:-1] - t[: -(p + 1)]) * lower[:, :-1]
                 + (t[p + 1:] - xc) / (t[p + 1:] - t[1:-p]) * lower[:, 1:])
        return bases @ c, (bases, lower, c)

    def bwd(res, g):
        bases, lower, c = res
        t = _spline_knots(c.dtype)
        bracket = lower[:, :-1] / (t[p:-1] - t[: -(p + 1)]) - lower[:, 1:] / (t[p + 1:] - t[1:-p])
        factor = p
        if bug == "missing-p":
            factor = 1  # BUG: derivative of B^p without the factor p
        elif bug == "wrong-sign":
            factor = -p  # BUG: the bracket's terms in the wrong order
        dbases = factor * bracket  # [B, G + k]: dB_m/dx at x_b
        dx = g * (dbases @ c)
        dc = bases.T @ g
        return dx, dc

    bspline.defvjp(fwd, bwd)
    return bspline


def _bspline_args(key, dtype):
    kx, kc = jax.random.split(key)
    x = jax.random.uniform(kx, (13,), dtype=dtype, minval=-0.95, maxval=0.95)
    (c,) = _normals(kc, dtype, (_SPLINE_G + _SPLINE_K,))
    return _push_off_knots(x), c


@jax.jit
def _push_off_knots(x: jax.Array) -> jax.Array:
    """Moves points within 1e-3 of a knot to 2e-3 from it (the derivative jumps at knots)."""
    dtype = x.dtype
    knots = _spline_knots(dtype)
    d = x[:, None] - knots  # push points within 1e-3 of a knot to 2e-3 away from it
    near = jnp.argmin(jnp.abs(d), axis=1)
    dn = jnp.take_along_axis(d, near[:, None], axis=1)[:, 0]
    pushed = knots[near] + jnp.where(dn >= 0, 2e-3, -2e-3).astype(dtype)
    return jnp.where(jnp.abs(dn) < 1e-3, pushed, x)


# ----------------------------------------------------------------------------------------------------------------
# 4. SwiGLU gate.
# ----------------------------------------------------------------------------------------------------------------


def swiglu_reference(a: jax.Array, u: jax.Array) -> jax.Array:
    r""":math:`y = \operatorname{silu}(a)\, u = a\,\sigma(a)\, u`."""
    return jax.nn.silu(a) * u


def _make_swiglu(bug: str | None) -> Callable:
    r"""SwiGLU with a hand-written backward.

    .. math::

        \bar a = \bar y\, u\, \sigma(a)\,\bigl(1 + a(1 - \sigma(a))\bigr), \qquad \bar u = \bar y\, a\, \sigma(a)

    Bug ``"silu-prime-sigmoid"``: :math:`\operatorname{silu}'(a)` replaced by :math:`\sigma(a)` (drops the
    :math:`a\sigma(a)(1-\sigma(a))` term), violating :math:`\operatorname{silu}' = \sigma(1 + a(1-\sigma))`.
    """

    @jax.custom_vjp
    def swiglu(a, u):
        return swiglu_reference(a, u)

    def fwd(a, u):
        return swiglu_reference(a, u), (a, u)

    def bwd(res, g):
        a, u = res
        s = jax.nn.sigmoid(a)
        dsilu = s * (1 + a * (1 - s))
        if bug == "silu-prime-sigmoid":
            dsilu = s  # BUG: silu'(a) taken as sigmoid(a)
        return g * u * dsilu, g * a * s

    swiglu.defvjp(fwd, bwd)
    return swiglu


def _swiglu_args(key, dtype):
    return _normals(key, dtype, (5, 7), (5, 7))


# ----------------------------------------------------------------------------------------------------------------
# 5. RMSNorm over the last axis.
# ----------------------------------------------------------------------------------------------------------------

_RMS_EPS = 1e-6


def rmsnorm_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    r""":math:`y = x\, r\, w`, :math:`r = (\operatorname{mean}_d x_d^2 + \epsilon)^{-1/2}`; ``x [B, D]``, ``w [D]``."""
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + _RMS_EPS) * w


def _make_rmsnorm(bug: str | None) -> Callable:
    r"""RMSNorm with a hand-written backward (per row, :math:`D` the last axis):

    .. math::

        \bar x = r\,(\bar y \odot w) - \frac{r^3}{D}\, x \sum_d \bar y_d w_d x_d, \qquad
        \bar w = \sum_{b} \bar y_b \odot x_b\, r_b

    Bug ``"dx-no-mean-term"``: :math:`\bar x = r\,(\bar y \odot w)` — drops the second term, the derivative of
    :math:`r` through :math:`\operatorname{mean}(x^2)`.
    """

    @jax.custom_vjp
    def rmsnorm(x, w):
        return rmsnorm_reference(x, w)

    def fwd(x, w):
        r = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + _RMS_EPS)
        return x * r * w, (x, w, r)

    def bwd(res, g):
        x, w, r = res
        gw = g * w
        dx = r * gw - (r ** 3 / x.shape[-1]) * x * jnp.sum(gw * x, axis=-1, keepdims=True)
        if bug == "dx-no-mean-term":
            dx = r * gw  # BUG: the mean(x^2) term of d rstd / dx dropped
        dw = jnp.sum(g * x * r, axis=0)
        return dx, dw

    rmsnorm.defvjp(fwd, bwd)
    return rmsnorm


def _rmsnorm_args(key, dtype):
    return _normals(key, dtype, (5, 7), (7,))


# ----------------------------------------------------------------------------------------------------------------
# 6. Residual block y = x + tanh(x @ w).
# ----------------------------------------------------------------------------------------------------------------


def residual_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    r""":math:`y = x + \tanh(x W)`, ``x [B, D]``, ``w [D, D]``."""
    return x + jnp.tanh(jnp.dot(x, w, precision=lax.Precision.HIGHEST))


def _make_residual(bug: str | None) -> Callable:
    r"""Residual block with a hand-written backward; :math:`h = \tanh(xW)`, :math:`\bar z = \bar y (1 - h^2)`:

    .. math::

        \bar x = \bar y + \bar z W^\top, \qquad \bar W = x^\top \bar z

    Bug ``"dx-no-residual"``: :math:`\bar x = \bar z W^\top` (the identity path's :math:`\bar y` dropped).
    """
    hi = lax.Precision.HIGHEST

    @jax.custom_vjp
    def residual(x, w):
        return residual_reference(x, w)

    def fwd(x, w):
        h = jnp.tanh(jnp.dot(x, w, precision=hi))
        return x + h, (x, w, h)

    def bwd(res, g):
        x, w, h = res
        gz = g * (1 - h * h)
        dx = g + jnp.dot(gz, w.T, precision=hi)
        if bug == "dx-no-residual":
            dx = jnp.dot(gz, w.T, precision=hi)  # BUG: residual (identity) path dropped
        dw = jnp.dot(x.T, gz, precision=hi)
        return dx, dw

    residual.defvjp(fwd, bwd)
    return residual


def _residual_args(key, dtype):
    x, w = _normals(key, dtype, (5, 6), (6, 6))
    return x, w * (0.5 / 6 ** 0.5)  # keep tanh out of saturation so both paths matter


# ----------------------------------------------------------------------------------------------------------------
# 7. Softmax over the last axis.
# ----------------------------------------------------------------------------------------------------------------


def softmax_reference(x: jax.Array) -> jax.Array:
    r""":math:`y_i = e^{x_i - \max x} / \sum_j e^{x_j - \max x}` over the last axis."""
    return jax.nn.softmax(x, axis=-1)


def _make_softmax(bug: str | None) -> Callable:
    r"""Softmax with a hand-written backward:

    .. math::

        \bar x = y \odot \Bigl(\bar y - \sum_j y_j \bar y_j\Bigr)

    Bug ``"no-rowsum"``: :math:`\bar x = y \odot \bar y` (drops the row-sum term from the Jacobian
    :math:`\operatorname{diag}(y) - y y^\top`).
    """

    @jax.custom_vjp
    def softmax(x):
        return softmax_reference(x)

    def fwd(x):
        y = softmax_reference(x)
        return y, y

    def bwd(y, g):
        dx = y * (g - jnp.sum(y * g, axis=-1, keepdims=True))
        if bug == "no-rowsum":
            dx = y * g  # BUG: row-sum term dropped
        return (dx,)

    softmax.defvjp(fwd, bwd)
    return softmax


def _softmax_args(key, dtype):
    return _normals(key, dtype, (5, 7))


# ----------------------------------------------------------------------------------------------------------------
# 8. LoRA-style low-rank linear y = x @ (w + a @ b).
# ----------------------------------------------------------------------------------------------------------------


def lora_reference(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    r""":math:`y = x (W + A B)`, ``x [N, in]``, ``w [in, out]``, ``a [in, r]``, ``b [r, out]``."""
    hi = lax.Precision.HIGHEST
    return jnp.dot(x, w, precision=hi) + jnp.dot(jnp.dot(x, a, precision=hi), b, precision=hi)


def _make_lora(bug: str | None) -> Callable:
    r"""Low-rank adapted linear layer with a hand-written backward:

    .. math::

        \bar x = \bar y W^\top + (\bar y B^\top) A^\top, \qquad \bar W = x^\top \bar y, \qquad
        \bar A = x^\top \bar y B^\top, \qquad \bar B = (x A)^\top \bar y

    Bug ``"a-grad-layout"``: :math:`\bar A` computed as :math:`B \bar y^\top x = \bar A^\top` (shape ``[r, in]``)
    and reshaped instead of transposed to ``[in, r]``.
    """
    hi = lax.Precision.HIGHEST

    @jax.custom_vjp
    def lora(x, w, a, b):
        return lora_reference(x, w, a, b)

    def fwd(x, w, a, b):
        xa = jnp.dot(x, a, precision=hi)
        return jnp.dot(x, w, precision=hi) + jnp.dot(xa, b, precision=hi), (x, w, a, b, xa)

    def bwd(res, g):
        x, w, a, b, xa = res
        gbt = jnp.dot(g, b.T, precision=hi)  # [N, r]
        dx = jnp.dot(g, w.T, precision=hi) + jnp.dot(gbt, a.T, precision=hi)
        dw = jnp.dot(x.T, g, precision=hi)
        da = jnp.dot(x.T, gbt, precision=hi)
        if bug == "a-grad-layout":
            da = jnp.dot(jnp.dot(b, g.T, precision=hi), x, precision=hi).reshape(a.shape)  # BUG: reshape, not .T
        db = jnp.dot(xa.T, g, precision=hi)
        return dx, dw, da, db

    lora.defvjp(fwd, bwd)
    return lora


def _lora_args(key, dtype):
    x, w, a, b = _normals(key, dtype, (6, 5), (5, 4), (5, 2), (2, 4))
    return x, w, a, b  # b is white noise, hence non-zero (unlike LoRA's zero init, which would hide dA)


# ----------------------------------------------------------------------------------------------------------------
# 9. Matmul with bf16 operands inside (correct, low precision).
# ----------------------------------------------------------------------------------------------------------------


def matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """:math:`y = x W` in the input dtype."""
    return jnp.dot(x, w, precision=lax.Precision.HIGHEST)


def _make_matmul_bf16_inside() -> Callable:
    r"""Matmul that rounds its operands to bfloat16 and accumulates in float32, forward and backward
    (:math:`\bar x = \bar y W^\top`, :math:`\bar W = x^\top \bar y`, each with bf16 operands), results cast back
    to the input dtype. Correct math; it computes in bf16 even when handed float64."""
    bf16, f32 = jnp.bfloat16, jnp.float32

    def mm(p, q):
        return jnp.dot(p.astype(bf16), q.astype(bf16), preferred_element_type=f32)

    @jax.custom_vjp
    def matmul(x, w):
        return mm(x, w).astype(x.dtype)

    def fwd(x, w):
        return matmul(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        return mm(g, w.T).astype(x.dtype), mm(x.T, g).astype(w.dtype)

    matmul.defvjp(fwd, bwd)
    return matmul


def _matmul_args(key, dtype):
    return _normals(key, dtype, (6, 5), (5, 4))

