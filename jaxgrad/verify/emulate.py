r"""Run plain JAX code the way a low-precision kernel computes it, to model the rounding error it *should* have.

A tensor-core kernel in TF32, f16 or bf16 rounds the operands of every matrix product to that format and accumulates
in f32. :func:`at_precision` re-interprets a function's jaxpr and does exactly that: the floating operands of every
contraction -- ``dot_general``, ``conv_general_dilated`` and ``reduce_sum`` (a kernel often sums a bias gradient as
a product with ones, or from the same rounded tile that feeds its GEMM) -- pass through ``lax.reduce_precision`` to
the named format, and products run at HIGHEST precision (exact f32 products and accumulation, also on a GPU), so the
only rounding added is the operand rounding of the hypothesis. Elementwise work stays in the arrays' own dtype: a
bf16 array program already rounds every intermediate to bf16.

=========  ==========================  ======================================================================
precision  operand format (exp, mant)  notes
=========  ==========================  ======================================================================
``f32``    unchanged                   exact f32 products, f32 accumulation
``tf32``   (8, 10)                     round to nearest even, f32's exponent range
``f16``    (5, 10)                     same unit roundoff as TF32, but overflow above 65504 and no range
                                       below 2^-24: part of its model (an operand that overflows gives inf)
``bf16``   (8, 7)                      round to nearest even
=========  ==========================  ======================================================================

:func:`perturb` draws the independent rounding realisations: the same point moved by a few units in the last place
of the hypothesis (``x (1 + 2 u_p xi)``, rounded back to the arrays' dtype), which re-randomises where every
rounded operand falls in its rounding interval while the exact result moves by O(u_p), and is recomputed exactly
by the float64 oracle at the moved point. With ``reorder=True`` (what the replicas use) every sum also runs in a random
order (:func:`_reorder`: the reduced axes of ``reduce_sum``, the contracting dimensions of ``dot_general`` and the
input features of an ungrouped convolution, permuted alike in both operands): the exact result is unchanged and its
rounding re-drawn, so a replica does not inherit the reference's summation order and that order's luck on each row
(a kernel sums in its own order: a tree over padded lanes, split-K partials).

Calls (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``) are entered; loops (``scan``, ``while``,
``cond``) are evaluated as they are, and :func:`at_precision` reports them in ``not_emulated`` so the report can
say that the operands inside them were not rounded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

__all__ = ["OPERAND_FORMAT", "at_precision", "perturb"]

# (exponent bits, mantissa bits) of the operand format of each precision hypothesis; None: left as it is.
OPERAND_FORMAT: dict[str, tuple[int, int] | None] = {"f64": None, "f32": None, "tf32": (8, 10), "f16": (5, 10), "bf16": (8, 7)}
_PRODUCTS = {"dot_general", "conv_general_dilated"}
_CONTRACTIONS = _PRODUCTS | {"reduce_sum"}
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr"}
_LOOPS = {"scan", "while", "cond"}
_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


def _round_operand(x, fmt: tuple[int, int] | None):
    if fmt is None or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    e, m = fmt
    if jnp.finfo(x.dtype).nmant <= m and jnp.finfo(x.dtype).nexp <= e:
        return x  # already no finer than the format (bf16 arrays under the bf16 hypothesis)
    return lax.reduce_precision(x, exponent_bits=e, mantissa_bits=m)


def _permute(x, axis: int, key):
    """``x`` with its ``axis`` in a random order (the same ``key`` gives the same order)."""
    return jnp.take(x, jax.random.permutation(key, x.shape[axis]), axis=axis)


def _reorder(prim: str, ins: list, params: dict, key) -> list:
    """The operands of a sum in a random summation order: the exact result is unchanged, its rounding re-drawn.

    A reduction's rounding depends on the order its terms meet, and a kernel sums in its own (a tree over padded
    lanes, split-K partials); a replica that keeps the reference's order keeps that order's luck on every row. The
    reduced axes of ``reduce_sum``, the contracting dimensions of ``dot_general`` (both operands alike) and the input
    features of an ungrouped ``conv_general_dilated`` (lhs and rhs alike) are permuted."""
    if prim == "reduce_sum":
        x = ins[0]
        for j, ax in enumerate(params["axes"]):
            if x.shape[ax] > 1:
                x = _permute(x, ax, jax.random.fold_in(key, j))
        return [x]
    if prim == "dot_general":
        (lc, rc), _ = params["dimension_numbers"]
        a, b = ins
        for j, (la, ra) in enumerate(zip(lc, rc, strict=True)):
            if a.shape[la] > 1:
                perm = jax.random.permutation(jax.random.fold_in(key, j), a.shape[la])
                a, b = jnp.take(a, perm, axis=la), jnp.take(b, perm, axis=ra)
        return [a, b]
    if prim == "conv_general_dilated" and params["feature_group_count"] == 1 and params["batch_group_count"] == 1:
        dn = params["dimension_numbers"]
        la, ra = dn.lhs_spec[1], dn.rhs_spec[1]
        a, b = ins
        if a.shape[la] > 1:
            perm = jax.random.permutation(key, a.shape[la])
            a, b = jnp.take(a, perm, axis=la), jnp.take(b, perm, axis=ra)
        return [a, b]
    return ins


def _eval(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any], fmt, loops: set[str],
          key=None) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for var, c in zip(jaxpr.constvars, consts, strict=True):
        env[var] = c
    for var, a in zip(jaxpr.invars, args, strict=True):
        env[var] = a
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [read(v) for v in eqn.invars]
        prim = eqn.primitive.name
        sub = eqn.params.get(_CALLS[prim]) if prim in _CALLS else None
        k_i = None if key is None else jax.random.fold_in(key, i)
        if sub is not None:
            outs = (_eval(sub.jaxpr, sub.consts, ins, fmt, loops, k_i) if isinstance(sub, jcore.ClosedJaxpr)
                    else _eval(sub, [], ins, fmt, loops, k_i))
        else:
            params = dict(eqn.params)
            if prim in _CONTRACTIONS and fmt is not None:
                ins = [_round_operand(x, fmt) for x in ins]
            if prim in _CONTRACTIONS and k_i is not None:
                ins = _reorder(prim, ins, params, k_i)
            if prim in _PRODUCTS:
                params["precision"] = _HIGHEST
            if prim in _LOOPS:
                loops.add(prim)
            outs = eqn.primitive.bind(*ins, **params)
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
        for var, o in zip(eqn.outvars, outs, strict=True):
            env[var] = o
    return [read(v) for v in jaxpr.outvars]


_CACHE: dict[Any, tuple[Callable[..., Any], set[str]]] = {}
_CACHE_SIZE = 64


def at_precision(fn: Callable[..., Any], precision: str, *example_args: Any,
                 reorder: bool = False) -> tuple[Callable[..., Any], set[str]]:
    """``fn`` as a ``precision`` kernel would compute it (module doc), jit-compiled for ``example_args``' shapes.

    Returns:
      ``(emulated, not_emulated)``: ``emulated(*args)`` returns ``fn(*args)``'s flat output leaves (with
      ``reorder=True``, ``emulated(seed, *args)``: every sum in a random order drawn from the integer ``seed``,
      :func:`_reorder`); ``not_emulated`` names the loop primitives whose bodies ran unrounded. Memoised on ``(fn,
      precision, reorder, shapes, dtypes, x64)`` (a few dozen entries), so repeated checks of one function compile
      once.
    """
    if precision not in OPERAND_FORMAT:
        raise ValueError(f"at_precision: precision must be one of {sorted(OPERAND_FORMAT)}, got {precision!r}")
    leaves, treedef = jax.tree.flatten(example_args)
    key = (fn, precision, bool(reorder), treedef, tuple((np.shape(x), jnp.result_type(x)) for x in leaves),
           bool(jax.config.jax_enable_x64))
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = _build(fn, precision, reorder, *example_args)
    return _CACHE[key]


def _build(fn, precision, reorder, *example_args):
    fmt = OPERAND_FORMAT[precision]
    closed = jax.make_jaxpr(fn)(*example_args)
    loops: set[str] = set()
    jax.make_jaxpr(lambda *a: _eval(closed.jaxpr, closed.consts, jax.tree.leaves(a), fmt, loops))(*example_args)

    if reorder:
        @jax.jit
        def emulated(seed, *args):
            return _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), fmt, set(), jax.random.key(seed))
    else:
        @jax.jit
        def emulated(*args):
            return _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), fmt, set())

    return emulated, loops


def perturb(tree: Any, precision: str, rng: np.random.Generator) -> Any:
    """The same point moved by a few units in the last place of ``precision``: ``x (1 + 2 u_p xi)``, ``xi ~ N(0, 1)``,
    rounded back to each leaf's dtype (a bf16 leaf moves by whole bf16 ulps)."""
    fmt = OPERAND_FORMAT[precision]
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for x in leaves:
        dt = jnp.result_type(x)
        mant = fmt[1] if fmt is not None else jnp.finfo(dt).nmant
        mant = min(mant, jnp.finfo(dt).nmant)
        u = 2.0 ** -(mant + 1)
        xi = rng.standard_normal(np.shape(x))
        moved = np.asarray(x, np.float64) * (1.0 + 2.0 * u * xi)
        out.append(jnp.asarray(moved, dt))
    return jax.tree.unflatten(treedef, out)
