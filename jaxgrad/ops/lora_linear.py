r"""LoRA linear layer in PEFT's layout: reference and hand-written VJP (frozen base weight, no dW).

Shapes: ``x [..., in]``, frozen ``W [out, in]``, ``A [r, in]``, ``B [out, r]``, scale ``s`` (``alpha / r``, or
``alpha / sqrt(r)`` with rsLoRA), dropout keep-mask :math:`m \in \{0, 1/(1-p)\}` on the LoRA input only (PEFT's
``lora_B(lora_A(dropout(x))) * scaling``). With :math:`\tilde X = m \odot X`:

.. math::

    U &= \tilde X A^\top \quad [N, r], \qquad Y = X W^\top + s\, U B^\top \\
    G &= \bar Y B \quad [N, r] \\
    \bar A &= s\, G^\top \tilde X, \qquad \bar B = s\, \bar Y^\top U, \qquad
    \bar X = \bar Y W + s\, m \odot (G A)

There is no :math:`\bar W`: ``W`` is frozen, i.e. treated as ``stop_gradient(W)`` (its cotangent is zero, in the
reference too). ``W + s B A`` is never formed. The backward saves ``x``, ``W``, ``A``, ``B`` (inputs, no new memory)
and the dropout *key*, not the mask: it regenerates the same mask from the key and recomputes ``U`` (rank r, cheap).
Matmuls take their operands in ``x``'s dtype (the backward rounds the incoming fp32 :math:`\bar Y` to it once, and
``U`` and ``G`` once for :math:`\bar B` and :math:`\bar A`) and accumulate in ``promote_types(dtype, float32)``; the output is rounded once to
``x``'s dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxgrad.ops.dtypes import compute_dtype

__all__ = ["lora_linear", "lora_linear_reference", "lora_linear_fwd", "lora_linear_bwd", "dropout_keep_scale"]


def dropout_keep_scale(key, rate: float, shape, dtype) -> jax.Array | None:
    """The dropout multiplier ``bernoulli(1 - rate) / (1 - rate)``; ``None`` when ``rate == 0`` or no key."""
    if rate == 0.0 or key is None:
        return None
    keep = jax.random.bernoulli(key, 1.0 - rate, shape)
    return jnp.where(keep, 1.0 / (1.0 - rate), 0.0).astype(dtype)


def _mm(a, b_t, cdt):
    """``a @ b_t.T`` contracting the last axes, accumulating in ``cdt``."""
    return jax.lax.dot_general(a, b_t, (((a.ndim - 1,), (1,)), ((), ())), preferred_element_type=cdt)


def lora_linear_reference(x, w, a, b, scale: float, keep_scale=None):
    """Plain JAX: ``x W^T + s (drop(x) A^T) B^T`` with W frozen (``stop_gradient``)."""
    cdt = compute_dtype(x.dtype)
    w = jax.lax.stop_gradient(w)
    xd = x if keep_scale is None else x * keep_scale
    y = x.astype(cdt) @ w.astype(cdt).T + scale * ((xd.astype(cdt) @ a.astype(cdt).T) @ b.astype(cdt).T)
    return y.astype(x.dtype)


def lora_linear_fwd(x, w, a, b, scale, keep_scale=None, *, xw=None, fold_b=False):
    r"""``Y`` (in x's dtype). ``a``/``b`` may be ``None``: then plain ``x W^T``. ``xw``: the base product ``x W^T``
    computed elsewhere, unrounded (the LoRA block's NF4 kernel; ``w`` is then unused).

    ``fold_b``: the LoRA term joins the base GEMM along its contraction, :math:`Y = [X \,|\, sU] [W \,|\, B]^\top`
    (``sU`` rounded to x's dtype as an operand, fp32 accumulation, one rounding of ``Y``), instead of a separate
    ``U B^T`` product written at ``[N, out]`` in fp32 and added (issue #13; the LoRA block's default)."""
    cdt = compute_dtype(x.dtype)
    if fold_b and a is not None and xw is None:
        xd = x if keep_scale is None else x * keep_scale.astype(x.dtype)
        su = (scale * _mm(xd, a, cdt)).astype(x.dtype)  # s U = s drop(X) A^T, one rounding to the operand dtype
        wb = jnp.concatenate([w.astype(x.dtype), b.astype(x.dtype)], axis=1)  # [out, in + r]
        return _mm(jnp.concatenate([x, su], axis=-1), wb, cdt).astype(x.dtype)
    y = _mm(x, w, cdt) if xw is None else xw.astype(cdt)
    if a is not None:
        xd = x if keep_scale is None else x * keep_scale.astype(x.dtype)
        u = _mm(xd, a, cdt)  # U = drop(X) A^T
        y = y + scale * _mm(u, b.astype(cdt), cdt)
    return y.astype(x.dtype)


def lora_linear_bwd(x, w, a, b, scale, keep_scale, dy, dx_dtype=None, *, dyw=None, dx_full=None, su=None, sg=None):
    """``(dx, dA, dB)`` of the LoRA linear (``dA = dB = None`` without an adapter); dx in ``dx_dtype`` (default
    x's dtype; the block keeps its gradient sums in fp32). ``dyw``: the base term ``dY W`` computed elsewhere,
    unrounded (the LoRA block's NF4 kernel; ``w`` is then unused). ``dx_full``: the whole ``dX = dY W + s (G A)``
    computed elsewhere (the Mosaic GPU kernel, :func:`jaxgrad.ops.lora_linear_mgpu.lora_linear_dx_mgpu`): only
    ``dA`` and ``dB`` are computed here. ``su`` / ``sg``: ``s U`` / ``s G`` ``[..., r]`` as the Mosaic GPU kernels
    wrote them (rounded once to x's dtype); then ``dB = dY^T (sU)`` and ``dA = (sG)^T drop(X)`` without recomputing
    ``U`` or ``G`` (the same products: ``s`` moves inside the one rounding, exact for a power-of-two ``s``)."""
    cdt = compute_dtype(x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    # The products take dY in the layer's own dtype: a bf16 layer multiplies bf16 operands with fp32 accumulation
    # (tensor cores at full rate, half the bytes of an fp32 dY), as PEFT's bf16 autograd does; the sums that follow
    # stay in fp32. An f32 / f64 layer is unchanged (dY is already in its dtype).
    dy2 = dy.reshape(-1, dy.shape[-1]).astype(x.dtype)
    # dX = dY W  (+ the LoRA term below)
    if dx_full is not None:
        dx = dx_full.reshape(dy2.shape[0], -1).astype(cdt)
    else:
        dx = _mm(dy2, w.T, cdt) if dyw is None else dyw.reshape(dy2.shape[0], -1).astype(cdt)
    if a is None:
        return dx.reshape(*lead, -1).astype(dx_dtype or x.dtype), None, None
    xd = x2 if keep_scale is None else x2 * keep_scale.reshape(x2.shape).astype(x.dtype)
    # dA = s G^T drop(X) ; dB = s dY^T U  (G = dY B; U = drop(X) A^T recomputed, or the kernels' sG / sU)
    if sg is not None:
        da = _mm(sg.reshape(-1, sg.shape[-1]).astype(x.dtype).T, xd.T, cdt)
    else:
        g = _mm(dy2, b.astype(x.dtype).T, cdt)
        da = scale * _mm(g.astype(x.dtype).T, xd.T, cdt)
    if su is not None:
        db = _mm(dy2.T, su.reshape(-1, su.shape[-1]).astype(x.dtype).T, cdt)
    else:
        db = scale * _mm(dy2.T, _mm(xd, a, cdt).astype(x.dtype).T, cdt)
    # dX += s m * (G A)
    if dx_full is None:
        g = _mm(dy2, b.astype(x.dtype).T, cdt) if sg is not None else g
        dlora = scale * jnp.matmul(g, a.astype(cdt))
        dx = dx + (dlora if keep_scale is None else dlora * keep_scale.reshape(x2.shape).astype(cdt))
    return dx.reshape(*lead, -1).astype(dx_dtype or x.dtype), da.astype(a.dtype), db.astype(b.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _lora_linear(x, w, a, b, scale, rate, key):
    return lora_linear_fwd(x, w, a, b, scale, dropout_keep_scale(key, rate, x.shape, x.dtype))


def _fwd(x, w, a, b, scale, rate, key):
    y = lora_linear_fwd(x, w, a, b, scale, dropout_keep_scale(key, rate, x.shape, x.dtype))
    return y, (x, w, a, b, key)


def _bwd(scale, rate, res, dy):
    x, w, a, b, key = res
    keep = dropout_keep_scale(key, rate, x.shape, x.dtype)  # the forward's mask, regenerated from its key
    dx, da, db = lora_linear_bwd(x, w, a, b, scale, keep, dy)
    return dx, jnp.zeros_like(w), da, db, None


_lora_linear.defvjp(_fwd, _bwd)


def _check(x, w, a, b, scale, dropout_rate):
    for name, t in (("x", x), ("w", w), ("a", a), ("b", b)):
        if not hasattr(t, "dtype") or not jnp.issubdtype(t.dtype, jnp.floating):
            raise TypeError(f"lora_linear: '{name}' must be a floating-point array, got "
                            f"{getattr(t, 'dtype', type(t))}")
    if w.ndim != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"lora_linear: 'w' must be [out, in] with in = x.shape[-1] = {x.shape[-1]}, got {w.shape}")
    if a.ndim != 2 or a.shape[1] != x.shape[-1]:
        raise ValueError(f"lora_linear: 'a' (lora_A) must be [r, in] = [r, {x.shape[-1]}], got {a.shape}")
    if b.shape != (w.shape[0], a.shape[0]):
        raise ValueError(f"lora_linear: 'b' (lora_B) must be [out, r] = {(w.shape[0], a.shape[0])}, got {b.shape}")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"lora_linear: 'dropout_rate' must be in [0, 1), got {dropout_rate}")


def lora_linear(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array, *, scale: float,
                dropout_rate: float = 0.0, dropout_key: jax.Array | None = None) -> jax.Array:
    """``x W^T + s (drop(x) A^T) B^T`` with a hand-written VJP (dx, dA, dB; W frozen).

    Args:
      x: ``[..., in]``; w: frozen ``[out, in]``; a: ``lora_A [r, in]``; b: ``lora_B [out, r]``.
      scale: the LoRA scale ``s`` (``lora_alpha / r`` or ``lora_alpha / sqrt(r)``).
      dropout_rate, dropout_key: PEFT's ``lora_dropout`` on the LoRA input; the key is saved and the mask
        regenerated in the backward. Without a key no dropout is applied (evaluation).
    """
    _check(x, w, a, b, scale, dropout_rate)
    if dropout_rate > 0 and dropout_key is None:
        dropout_rate = 0.0
    return _lora_linear(x, w, a, b, float(scale), float(dropout_rate), dropout_key)


def audit_cases():
    """Cases for ``jaxgrad audit``: ``x [B, T, in]``, random non-zero ``A`` and ``B``, the frozen ``W`` closed over
    (fixed white noise per shape). No dropout here: the mask's bits depend on JAX's x64 mode, so the float64
    reference would draw another mask than the float32 run (``tests/test_op_variants.py`` checks dropout in
    float64)."""
    from jaxgrad.ops.registry import OpAudit, frozen_normal

    rank = 4

    def make_args(key, size):
        b, t, n_in, n_out = size
        kx, ka, kb = jax.random.split(key, 3)
        return (jax.random.normal(kx, (b, t, n_in)), jax.random.normal(ka, (rank, n_in)) * n_in ** -0.5,
                jax.random.normal(kb, (n_out, rank)) * rank ** -0.5)

    def frozen_w(x, b):
        return jnp.asarray(frozen_normal((b.shape[0], x.shape[-1]), 1, x.shape[-1] ** -0.5), x.dtype)

    def fn(x, a, b):
        return lora_linear(x, frozen_w(x, b), a, b, scale=2.0)

    def reference(x, a, b):
        return lora_linear_reference(x, frozen_w(x, b), a, b, 2.0)

    sizes = ((2, 7, 24, 40), (2, 19, 72, 56), (3, 41, 136, 200))
    return (OpAudit("lora_linear[xla]", fn, reference, make_args, sizes, arg_names=("x", "lora_A", "lora_B")),)
