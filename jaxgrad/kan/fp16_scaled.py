r"""Matrix products with float16 operands scaled by powers of two: TF32's mantissa at the 16-bit tensor-core rate.

For ``a[M, K] @ b[K, N]`` in float32, each operand is multiplied by a power of two per slice of its *free* axis
(``a`` per row, ``b`` per column), rounded to float16, multiplied with float32 accumulation
(``preferred_element_type=float32``), and the product is unscaled exactly:

.. math::

    s_m = 2^{\,15 - e_m},\quad \max_k |a_{mk}| = \mu_m 2^{e_m},\ \mu_m \in [\tfrac12, 1) \qquad
    (\text{so } \max_k |s_m a_{mk}| \in [2^{14}, 2^{15})) \\
    \hat a_{mk} = \mathrm{fl}_{16}(s_m a_{mk}), \quad \hat b_{kn} = \mathrm{fl}_{16}(t_n b_{kn}), \qquad
    c_{mn} = s_m^{-1} t_n^{-1} \textstyle\sum_k \hat a_{mk} \hat b_{kn}\ \ (\text{float32 sum})

**Why per row of ``a`` and per column of ``b``.** Those axes are not summed over, so
:math:`\sum_k (s_m a_{mk})(t_n b_{kn}) = s_m t_n (ab)_{mn}` and the unscaling is one multiplication of each output
entry by a power of two: exact (:func:`unscale` splits the exponent in two so that no intermediate overflows).
A scale along the summed axis ``k`` would not factor out. Per slice rather than per tensor, because an output entry
only sees its own row of ``a`` and column of ``b``: a row whose values are all ``1e-9`` times the tensor's largest
(a B-spline basis touched only by the tail of its support, a cotangent column of a nearly unused output) is brought
to float16's normal range by its own scale instead of falling into the subnormals.

**Error model.** The largest value of a slice lands in ``[2^14, 2^15)``, below float16's largest finite value
65504 even after rounding up: no overflow. A scaled value ``v`` with ``|v| >= 2^-14`` (float16's smallest normal;
guaranteed for ``|a| >= max|slice| 2^-28``) is rounded with relative error at most ``2^-11`` (10 stored mantissa
bits, as TF32). Below that it is a float16 subnormal with absolute error at most ``2^-25`` in scaled units, i.e.
``<= max|slice| 2^-39``; values below ``max|slice| 2^-40`` flush to zero (underflow is relative to the slice's
largest value, never absolute). Products of two float16 values are exact
in float32, and the sum is float32. So an entry of the product obeys, with :math:`u = 2^{-11}`,
:math:`u_{32} = 2^{-24}` and :math:`M_{mn} = \sum_k |a_{mk}||b_{kn}|`:

.. math::

    |\hat c_{mn} - c_{mn}| \le (2u + u^2 + K u_{32}) M_{mn}
        + 2^{-39}\bigl(\max_k|a_{mk}| \textstyle\sum_k |b_{kn}| + \max_k|b_{kn}| \sum_k |a_{mk}|\bigr)

(up to the second-order ``u K u32`` terms). The first term is TF32's model; the second, the subnormal part,
matters only for an entry whose terms all involve values more than ``2^28`` below their slice's largest. The
verifier's TF32 model (:mod:`jaxgrad.verify.precision`, ``check_vjp(..., precision="tf32")``) applies: the same
operand rounding, and no exponent-range limit that the scaling does not already remove.

A known bound replaces the maximum (``a_bound``). B-spline bases lie in ``[0, 1]``, so the KAN forward scales them
by ``2^14`` with no reduction over them; a basis value below ``2^-28`` (the tail of a basis within a few percent
of its knot, at k = 5) is then a subnormal, with absolute error ``<= 2^-39 |C|``, negligible against an output's
other terms. The coefficient gradient ``g^T B`` scales each basis column by its own maximum instead: there every
term of an entry shares the column, and a column holding only tails would otherwise be flushed.

Zero, infinite and NaN maxima get scale 1 (the product is then what an unscaled product gives: zeros, or the
non-finite values propagated). Float64 operands (the verifier's float64 re-run under ``jax_enable_x64``) take the
same scales and products without the float16 rounding, so a float64 run checks the equations and the exact
unscaling to float64 accuracy.

:func:`matmul` is a ``jax.custom_vjp``: its cotangents are products of the same kind (``da = g b^T``,
``db = a^T g``, each scaled from its own operands), so a function built from it (the KAN layer's backward) can be
differentiated again without an unscaled float16 cast of a cotangent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["FP16_SCALED", "TOP_EXPONENT", "matmul", "scale_exponents", "pow2", "unscale"]

#: the ``precision`` value that selects these products
FP16_SCALED = "fp16_scaled"
#: a slice's largest magnitude is scaled into ``[2^(TOP - 1), 2^TOP)``
TOP_EXPONENT = 15
_MIN_EXP, _MAX_EXP = -126, 127  # powers of two that are normal float32 numbers


def pow2(e: jax.Array, dtype) -> jax.Array:
    """``2^e`` exactly, for integer ``e`` in ``[-126, 127]``, built from its exponent bits (no ``pow``)."""
    e = jnp.clip(e, _MIN_EXP, _MAX_EXP)
    if jnp.dtype(dtype) == jnp.float64:
        return lax.bitcast_convert_type((e.astype(jnp.int64) + 1023) << 52, jnp.float64)
    return lax.bitcast_convert_type((e.astype(jnp.int32) + 127) << 23, jnp.float32).astype(dtype)


def scale_exponents(amax: jax.Array) -> jax.Array:
    """``s`` (int32) with ``amax 2^s`` in ``[2^14, 2^15)``; 0 where ``amax`` is 0, infinite or NaN; clipped to
    ``[-126, 127]`` (only an ``amax`` below ``2^-112`` is affected: it stays below ``2^15`` after scaling)."""
    _, e = jnp.frexp(amax)  # amax = mu 2^e, mu in [1/2, 1): exact, subnormals included
    s = TOP_EXPONENT - e.astype(jnp.int32)
    s = jnp.where(jnp.isfinite(amax) & (amax > 0), s, 0)
    return jnp.clip(s, _MIN_EXP, _MAX_EXP)


def unscale(acc: jax.Array, e: jax.Array) -> jax.Array:
    """``acc * 2^e`` exactly for any int ``e`` (split into two normal powers of two: ``e`` may leave float32's
    exponent range while the product does not)."""
    e1 = jnp.clip(e, _MIN_EXP, _MAX_EXP)
    return acc * pow2(e1, acc.dtype) * pow2(e - e1, acc.dtype)


def _scaled_operand(a, summed_axis: int, bound: float | None):
    """``(fl16(a * 2^s), s)``, ``s`` one exponent per slice of ``a``'s free axis (from its max |value| over
    ``summed_axis``, or from ``bound``)."""
    free = 1 - summed_axis
    if bound is None:
        amax = jnp.max(jnp.abs(a), axis=summed_axis, initial=0.0)
    else:
        amax = jnp.full((a.shape[free],), bound, a.dtype)
    s = scale_exponents(amax)
    scaled = a * jnp.expand_dims(pow2(s, a.dtype), summed_axis)
    return (scaled if a.dtype == jnp.float64 else scaled.astype(jnp.float16)), s


def _check(a, b):
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp16_scaled.matmul: needs a[M, K] and b[K, N], got {a.shape} and {b.shape}")
    if a.dtype != b.dtype or a.dtype not in (jnp.float32, jnp.float64):
        raise TypeError(f"fp16_scaled.matmul: operands must both be float32 (float64: no float16 rounding), got "
                        f"{a.dtype} and {b.dtype}")


def _product(a, b, a_bound):
    _check(a, b)
    a16, sa = _scaled_operand(a, 1, a_bound)
    b16, sb = _scaled_operand(b, 0, None)
    acc = lax.dot_general(a16, b16, (((1,), (0,)), ((), ())), precision=lax.Precision.DEFAULT,
                          preferred_element_type=a.dtype)
    return unscale(acc, -(sa[:, None] + sb[None, :]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(a: jax.Array, b: jax.Array, a_bound: float | None = None) -> jax.Array:
    """``a[M, K] @ b[K, N]`` from power-of-two scaled float16 operands, float32 sums (module docstring).

    Args:
      a, b: float32 (or both float64: the same scales, no float16 rounding).
      a_bound: a known bound on ``|a|`` (a Python float), used in place of the per-row maxima.
    """
    return _product(a, b, a_bound)


def _matmul_fwd(a, b, a_bound):
    return _product(a, b, a_bound), (a, b)


def _matmul_bwd(a_bound, res, g):
    a, b = res
    g = g.astype(a.dtype)
    return matmul(g, b.T), matmul(a.T, g)


matmul.defvjp(_matmul_fwd, _matmul_bwd)

