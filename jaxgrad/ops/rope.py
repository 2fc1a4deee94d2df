r"""Rotary position embeddings, Hugging Face ``rotate_half`` convention, with the Llama-3 frequency rule.

Frequencies (HF ``_compute_default_rope_parameters``), :math:`d` = head_dim, :math:`i = 0 .. d/2 - 1`:

.. math:: f_i = \theta^{-2i/d}

Llama-3 ``rope_scaling`` (HF ``_compute_llama3_parameters``), with ``factor`` :math:`F`, ``low_freq_factor``
:math:`l`, ``high_freq_factor`` :math:`h`, ``original_max_position_embeddings`` :math:`L` and wavelength
:math:`\lambda_i = 2\pi / f_i`: keep :math:`f_i` where :math:`\lambda_i < L/h`; use :math:`f_i / F` where
:math:`\lambda_i > L/l`; in between, :math:`(1 - s) f_i / F + s f_i` with :math:`s = (L/\lambda_i - l)/(h - l)`.

Angles :math:`\phi_{t,i} = p_t f_i`, duplicated over the two halves (HF's ``emb = cat(freqs, freqs)``):
``cos = cos(cat(phi, phi))``, ``sin = sin(cat(phi, phi))``, both ``[..., seq, d]``.

Rotation of ``x = [x1, x2]`` (halves of the head dimension), ``rotate_half(x) = [-x2, x1]``:

.. math::

    y = x \odot \cos + \mathrm{rotate\_half}(x) \odot \sin

Backward. ``rotate_half`` is the matrix :math:`R` with :math:`R^\top = -R`, so

.. math::

    \bar x = \bar y \odot \cos - \mathrm{rotate\_half}(\bar y \odot \sin), \qquad
    \bar{\cos} = \textstyle\sum_{\text{heads}} \bar y \odot x, \qquad
    \bar{\sin} = \textstyle\sum_{\text{heads}} \bar y \odot \mathrm{rotate\_half}(x)

With equal halves of ``sin`` (always, for ``rope_cos_sin``), :math:`\bar x` is the inverse rotation: the same
formula with ``sin -> -sin``. Nothing is saved but ``x``, ``cos``, ``sin`` (the latter two are recomputable from
positions). Layout: ``x`` is ``[batch, seq, heads, head_dim]`` and ``cos``/``sin`` ``[batch, seq, head_dim]`` (or
``[seq, head_dim]``); the heads axis is broadcast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["apply_rope", "apply_rope_reference", "rope_cos_sin", "rope_inv_freq", "rotate_half"]

ROPE_SCALING_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: Mapping | None = None) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` in float64 (numpy; static), with the optional Llama-3 rule."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rope: 'head_dim' must be a positive even number, got {head_dim}")
    if not theta > 0:
        raise ValueError(f"rope: 'theta' (rope_theta) must be > 0, got {theta}")
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if not rope_scaling:
        return inv
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type == "default":
        return inv
    if rope_type != "llama3":
        raise ValueError(f"rope: rope_scaling['rope_type'] = {rope_type!r} is not supported (only 'llama3' and "
                         "'default'); refusing rather than ignoring it")
    missing = [k for k in ROPE_SCALING_KEYS[1:] if k not in rope_scaling]
    if missing:
        raise ValueError(f"rope: rope_scaling of type 'llama3' is missing {missing}")
    factor = float(rope_scaling["factor"])
    lo, hi = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
    old_len = float(rope_scaling["original_max_position_embeddings"])
    if not (factor > 0 and hi > lo > 0 and old_len > 0):
        raise ValueError(f"rope: rope_scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0, got "
                         f"{dict(rope_scaling)}")
    wavelen = 2 * math.pi / inv
    low_freq_wavelen, high_freq_wavelen = old_len / lo, old_len / hi
    out = np.where(wavelen > low_freq_wavelen, inv / factor, inv)  # long wavelengths: divided by factor
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, out)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, rope_scaling: Mapping | None = None,
                 dtype=jnp.float32):
    """``(cos, sin)`` of shape ``positions.shape + (head_dim,)``, computed in ``promote_types(dtype, f32)``."""
    cdt = jnp.promote_types(dtype, jnp.float32)
    inv = jnp.asarray(rope_inv_freq(head_dim, theta, rope_scaling), cdt)
    phi = jnp.asarray(positions).astype(cdt)[..., None] * inv
    emb = jnp.concatenate([phi, phi], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    """``[x1, x2] -> [-x2, x1]`` over the last axis."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def _check(x, cos, sin):
    if x.ndim < 2 or x.shape[-1] % 2:
        raise ValueError(f"apply_rope: 'x' must be [..., seq, heads, head_dim] with an even head_dim, got {x.shape}")
    for name, c in (("cos", cos), ("sin", sin)):
        if c.ndim != x.ndim - 1 or c.shape[-1] != x.shape[-1]:
            raise ValueError(f"apply_rope: '{name}' must be [..., seq, head_dim] = x.shape without the heads axis "
                             f"(broadcastable), got {c.shape} for x {x.shape}")


def apply_rope_reference(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Plain JAX: ``x cos + rotate_half(x) sin`` (HF ``apply_rotary_pos_emb``), heads axis broadcast."""
    c, s = cos[..., None, :].astype(x.dtype), sin[..., None, :].astype(x.dtype)
    return x * c + rotate_half(x) * s


def rope_fwd(x, cos, sin):
    return apply_rope_reference(x, cos, sin)


def rope_bwd_x(dy, cos, sin):
    """``dx = dy cos - rotate_half(dy sin)``: the transposed (inverse) rotation."""
    c, s = cos[..., None, :].astype(dy.dtype), sin[..., None, :].astype(dy.dtype)
    return dy * c - rotate_half(dy * s)


def _sum_to(t, shape):
    """Sum ``t`` over the axes that ``shape`` broadcasts (leading extra axes and size-1 axes)."""
    lead = t.ndim - len(shape)
    t = jnp.sum(t, axis=tuple(range(lead))) if lead else t
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and t.shape[i] != 1)
    return jnp.sum(t, axis=axes, keepdims=True) if axes else t


@jax.custom_vjp
def _apply_rope(x, cos, sin):
    return rope_fwd(x, cos, sin)


def _fwd(x, cos, sin):
    return rope_fwd(x, cos, sin), (x, cos, sin)


def _bwd(res, dy):
    x, cos, sin = res
    dx = rope_bwd_x(dy, cos, sin)
    # d cos = sum_heads dy * x, d sin = sum_heads dy * rotate_half(x)  (heads axis is -2)
    dcos = _sum_to(jnp.sum(dy * x, axis=-2), cos.shape).astype(cos.dtype)
    dsin = _sum_to(jnp.sum(dy * rotate_half(x), axis=-2), sin.shape).astype(sin.dtype)
    return dx.astype(x.dtype), dcos, dsin


_apply_rope.defvjp(_fwd, _bwd)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [batch, seq, heads, head_dim]`` by ``cos``/``sin`` ``[batch, seq, head_dim]`` (hand-written VJP)."""
    _check(x, cos, sin)
    return _apply_rope(x, cos, sin)


def audit_cases():
    """Cases for ``jaxgrad audit``: x ``[B, T, heads, d]`` and ``cos``, ``sin`` ``[B, T, d]`` all white noise (the
    VJP is the exact transpose for any ``cos``/``sin``; rotation tables from :func:`rope_cos_sin` are smooth along
    the sequence, which hides shifts)."""
    from jaxgrad.ops.registry import OpAudit

    def make_args(key, size):
        b, t, h, d = size
        kx, kc, ks = jax.random.split(key, 3)
        return (jax.random.normal(kx, (b, t, h, d)), jax.random.normal(kc, (b, t, d)),
                jax.random.normal(ks, (b, t, d)))

    sizes = ((2, 7, 3, 8), (3, 19, 5, 16), (2, 61, 6, 32))
    return (OpAudit("apply_rope[xla]", apply_rope, apply_rope_reference, make_args, sizes,
                    arg_names=("x", "cos", "sin")),)
