r"""RMSNorm (Llama / Hugging Face ``LlamaRMSNorm``): reference, hand-written VJP, and the pieces the LoRA block reuses.

Math, per row :math:`x \in \mathbb{R}^H` (statistics in ``promote_types(dtype, float32)``: fp32 for bf16/f32, f64 for
f64):

.. math::

    r &= \bigl(\tfrac1H \textstyle\sum_j x_j^2 + \varepsilon\bigr)^{-1/2}, \qquad n = x\, r, \qquad
    y = w \odot n \\
    g &= \bar y \odot w \\
    \bar x &= r\,\bigl(g - n\, \tfrac1H \textstyle\sum_j g_j n_j\bigr) \\
    \bar w &= \textstyle\sum_{\text{rows}} \bar y \odot n

Hugging Face casts ``n`` back to the input dtype before multiplying by ``w``; so do we (it is the identity in
f32/f64). The backward saves ``x``, ``w`` and the fp32 row statistic ``r`` (one float per row, never in bf16, unlike
Pallas' ``rms_norm.py``) and recomputes ``n``. Unsloth never returns :math:`\bar w`; we always do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["rms_norm", "rms_norm_reference", "rms_norm_rstd", "rms_norm_apply", "rms_norm_bwd"]


def _cdt(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _check(x, weight, eps):
    for name, a in (("x", x), ("weight", weight)):
        if not hasattr(a, "dtype") or not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"rms_norm: '{name}' must be a floating-point array, got {getattr(a, 'dtype', type(a))}")
    if weight.ndim != 1 or x.shape[-1:] != weight.shape:
        raise ValueError(f"rms_norm: 'weight' must have shape (x.shape[-1],) = ({x.shape[-1]},), got {weight.shape}")
    if not eps > 0:
        raise ValueError(f"rms_norm: 'eps' must be > 0, got {eps}")


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Plain JAX, differentiated by ``jax.grad``: ``w * (x * rsqrt(mean(x^2) + eps)).astype(x.dtype)``."""
    xf = x.astype(_cdt(x.dtype))
    n = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * n.astype(x.dtype)


def rms_norm_rstd(x: jax.Array, eps: float) -> jax.Array:
    """The row statistic ``r = rsqrt(mean(x^2) + eps)`` in fp32 (f64 for f64 input), shape ``x.shape[:-1]``."""
    xf = x.astype(_cdt(x.dtype))
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps)


def rms_norm_apply(x: jax.Array, weight: jax.Array, rstd: jax.Array) -> jax.Array:
    """``y = w * n`` with ``n = x r`` from a saved ``rstd`` (the forward given its statistic)."""
    n = x.astype(rstd.dtype) * rstd[..., None]
    return weight.astype(x.dtype) * n.astype(x.dtype)


def rms_norm_bwd(x: jax.Array, weight: jax.Array, rstd: jax.Array, dy: jax.Array, dx_dtype=None):
    """``(dx, dw)`` of ``y = w * x r`` from the saved fp32 ``rstd``; ``dw`` summed over all leading axes.

    ``dx`` is returned in ``dx_dtype`` (default x's dtype; the block keeps its gradient sums in fp32)."""
    cdt = rstd.dtype
    n = x.astype(cdt) * rstd[..., None]  # recomputed, not saved
    dyf = dy.astype(cdt)
    g = dyf * weight.astype(cdt)  # g = dy * w
    # dx = r (g - n mean(g n))
    dx = rstd[..., None] * (g - n * jnp.mean(g * n, axis=-1, keepdims=True))
    # dw = sum_rows dy * n
    dw = jnp.sum((dyf * n).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(dx_dtype or x.dtype), dw.astype(weight.dtype)


@jax.custom_vjp
def _rms_norm(x, weight, eps):
    return _fwd(x, weight, eps)[0]


def _fwd(x, weight, eps):
    rstd = rms_norm_rstd(x, eps)
    return rms_norm_apply(x, weight, rstd), (x, weight, rstd, eps)


def _bwd(res, dy):
    x, weight, rstd, eps = res
    dx, dw = rms_norm_bwd(x, weight, rstd, dy)
    return dx, dw, jnp.zeros_like(eps)


_rms_norm.defvjp(_fwd, _bwd)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    """RMSNorm over the last axis with a hand-written VJP returning ``dx`` and ``dw``.

    Args:
      x: ``[..., H]`` floating array (bf16, f16, f32 or f64).
      weight: ``[H]`` scale.
      eps: the epsilon inside the square root (HF's ``rms_norm_eps``), > 0. Not differentiated.
    """
    _check(x, weight, eps)
    return _rms_norm(x, weight, jnp.asarray(eps, _cdt(x.dtype)))
