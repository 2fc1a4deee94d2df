r"""Sum of |terms|: the condition scale against which rounding error is judged.

A computed quantity :math:`s = \sum_k t_k` carries a rounding error bounded by :math:`c\,u\,\sum_k |t_k|`, never by
:math:`c\,u\,|s|` (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3-4). A gradient entry whose terms
cancel (:math:`|s| \ll \sum|t_k|`) therefore shows a huge *relative* error from pure rounding; divided by
:math:`\sum|t_k|` it does not. This module computes that scale, :math:`M(v)`, for every value of any JAX function,
by re-interpreting its jaxpr with a running error bound (Wilkinson's running error analysis, first order):

* multilinear primitives (``add``, ``mul``, ``dot_general``, ``conv_general_dilated``, ``reduce_sum``, reshapes,
  slices, selects ...) are applied to the magnitudes: :math:`M(a b) = M(a) M(b)`, :math:`M(a \pm b) = M(a) + M(b)`,
  :math:`M(A B) = M(A) M(B)` (the matrix product of magnitudes is exactly :math:`\sum|a_{ik} b_{kj}|` at the top
  level). For a conv or matmul VJP this is the "one extra VJP on absolute values".
* elementwise nonlinear primitives :math:`f` start a fresh rounding at their output and pass input errors through
  their slope: :math:`M(f(a)) = |f(a)| + |f'(a)|\,M(a)` (one JVP per input).
* call primitives (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``) are entered recursively.
* anything else (loops, sorts, opaque kernels) falls back to :math:`|y| + |J M|` and is listed in
  ``MagnitudeResult.approximated`` so the report can say the model is approximate there.

Alongside :math:`M` it tracks :math:`N(v)`, the length of the longest chain of additions that produced ``v``
(contraction sizes of dots and convs, reduced element counts), from which the error model takes its
:math:`\sqrt{N}` growth of accumulated rounding.

The interpreter is itself ordinary JAX code and is jit-compiled; run it in float64 for a faithful scale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

__all__ = ["MagnitudeResult", "magnitudes"]

# Primitives that are linear in each floating operand separately with non-negative coefficients once the magnitudes
# are non-negative: applying the primitive to the magnitudes gives the magnitude. (sub/neg are handled separately.)
_MULTILINEAR = {
    "add", "add_any", "mul", "dot_general", "conv_general_dilated", "reduce_sum", "broadcast_in_dim", "reshape",
    "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice", "dynamic_update_slice", "gather",
    "concatenate", "pad", "rev", "select_n", "convert_element_type", "copy", "copy_p", "reduce_precision",
    "cumsum", "scatter-add", "scatter_add", "real", "reduce_window_sum", "split", "sharding_constraint",
    "optimization_barrier", "device_put",
}
_NEGATING = {"sub", "neg"}  # magnitudes add; applied as add / identity
_REDUCE_SELECT = {"reduce_max", "reduce_min", "cummax", "cummin"}  # one selected term: take the largest magnitude
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr", "custom_lin": None}


@dataclasses.dataclass(frozen=True)
class MagnitudeResult:
    """Values, magnitudes (sum of |terms|) and accumulation lengths of a function's outputs (flat lists)."""

    values: list[jax.Array]
    magnitudes: list[jax.Array]
    terms: list[int]  # N: longest accumulation chain behind each output (max over its entries)
    approximated: tuple[str, ...]  # primitives whose magnitude rule is the generic fallback


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _contraction_size(prim: str, params: dict, invals: Sequence[Any]) -> int:
    if prim == "dot_general":
        (lhs_contract, _), _ = params["dimension_numbers"]
        return int(np.prod([invals[0].shape[d] for d in lhs_contract], dtype=np.int64)) if lhs_contract else 1
    if prim == "conv_general_dilated":
        dn = params["dimension_numbers"]
        rhs = invals[1].shape
        rhs_spec = dn.rhs_spec  # (out feature, in feature, spatial...)
        return int(rhs[rhs_spec[1]] * np.prod([rhs[d] for d in rhs_spec[2:]], dtype=np.int64))
    if prim in ("reduce_sum", "reduce_window_sum"):
        axes = params.get("axes", ())
        if axes:
            return int(np.prod([invals[0].shape[a] for a in axes], dtype=np.int64))
        return int(np.prod(params.get("window_dimensions", (1,)), dtype=np.int64))
    if prim == "cumsum":
        return int(invals[0].shape[params["axis"]])
    if prim in ("add", "add_any", "sub", "scatter-add", "scatter_add"):
        return 1
    return 0


def _broadcasts_to(shape, target) -> bool:
    try:
        return np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False


class _Interpreter:
    def __init__(self):
        self.approximated: set[str] = set()

    def run(self, jaxpr: jcore.Jaxpr, consts, args):
        """args: list of (value, magnitude or None, N). Returns list of the same for the outputs."""
        env: dict[Any, tuple[Any, Any, int]] = {}

        def read(v):
            if isinstance(v, jcore.Literal):
                val = np.asarray(v.val, dtype=v.aval.dtype)
                return val, (np.abs(val) if _is_float(val) else None), 0
            return env[v]

        for var, c in zip(jaxpr.constvars, consts, strict=True):
            env[var] = (c, jnp.abs(c) if _is_float(c) else None, 0)
        for var, a in zip(jaxpr.invars, args, strict=True):
            env[var] = a
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            outs = self.eqn(eqn, ins)
            for var, o in zip(eqn.outvars, outs, strict=True):
                if not isinstance(var, jcore.DropVar):
                    env[var] = o
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn, ins):
        prim = eqn.primitive.name
        params = dict(eqn.params)
        vals = [v for v, _, _ in ins]
        n_in = max([n for _, _, n in ins], default=0)

        if prim in _CALLS:
            sub = params.get(_CALLS[prim]) if _CALLS[prim] else None
            if sub is not None:
                if isinstance(sub, jcore.ClosedJaxpr):
                    return self.run(sub.jaxpr, sub.consts, ins)
                return self.run(sub, [], ins)

        outvals = eqn.primitive.bind(*vals, **params)
        outvals = list(outvals) if eqn.primitive.multiple_results else [outvals]
        if not any(_is_float(o) for o in outvals):
            return [(o, None, 0) for o in outvals]

        def mag_or_abs(i):
            _, m, _ = ins[i]
            return m if m is not None else (jnp.abs(vals[i]) if _is_float(vals[i]) else vals[i])

        n_out = n_in + _contraction_size(prim, params, vals)
        if prim in _MULTILINEAR or prim in _NEGATING:
            mags = [mag_or_abs(i) for i in range(len(ins))]
            if prim == "sub":
                m = jax.lax.add(mags[0], mags[1])
            elif prim == "neg":
                m = mags[0]
            else:
                m = eqn.primitive.bind(*mags, **params)
            ms = list(m) if eqn.primitive.multiple_results else [m]
            return [(o, jnp.abs(mm) if _is_float(o) else None, n_out) for o, mm in zip(outvals, ms, strict=True)]
        if prim in _REDUCE_SELECT:
            m = eqn.primitive.bind(mag_or_abs(0), **params) if prim != "reduce_min" else \
                jax.lax.reduce_max_p.bind(mag_or_abs(0), **params)
            return [(outvals[0], jnp.abs(m), n_in)]

        # Elementwise (or unknown) nonlinear primitive: M(y) = |y| + sum_k |dy/dx_k| M(x_k), one JVP per input.
        float_idx = [i for i, v in enumerate(vals) if _is_float(v)]
        out_shape = np.shape(outvals[0])
        elementwise = (not eqn.primitive.multiple_results) and all(
            _broadcasts_to(np.shape(vals[i]), out_shape) for i in float_idx)
        if not elementwise:
            self.approximated.add(prim)

        def f(*xs):
            return eqn.primitive.bind(*xs, **params)

        mags_out = [jnp.abs(o) if _is_float(o) else None for o in outvals]
        try:
            for i in float_idx:
                tangents = [jnp.zeros_like(v) if _is_float(v) else np.zeros(np.shape(v), jax.dtypes.float0)
                            for v in vals]
                tangents[i] = jnp.broadcast_to(mag_or_abs(i), np.shape(vals[i])).astype(vals[i].dtype)
                _, t_out = jax.jvp(f, vals, tangents)
                t_out = list(t_out) if eqn.primitive.multiple_results else [t_out]
                mags_out = [m if m is None or not _is_float(t) else m + jnp.abs(t)
                            for m, t in zip(mags_out, t_out, strict=True)]
        except Exception:  # no JVP rule: keep |y| only, and say so
            self.approximated.add(prim)
        return [(o, m, n_in + 1) for o, m in zip(outvals, mags_out, strict=True)]


def magnitudes(fn: Callable[..., Any], *args: Any) -> MagnitudeResult:
    """Evaluate ``fn(*args)`` together with the sum of |terms| of every output entry.

    Args:
      fn: any JAX-traceable function (e.g. ``lambda *a: jax.vjp(ref, *a[:-1])[1](a[-1])`` for a VJP).
      *args: pytrees of arrays. Run under ``jax.enable_x64(True)`` with float64 arrays for a faithful scale.

    Returns:
      A :class:`MagnitudeResult` over the flattened outputs.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    flat_args = jax.tree.leaves(args)
    interp = _Interpreter()
    n_holder: list[list[int]] = []

    def run(consts, flat):
        ins = [(a, jnp.abs(a) if _is_float(a) else None, 0) for a in flat]
        outs = interp.run(closed.jaxpr, consts, ins)
        n_holder.append([n for _, _, n in outs])
        return [v for v, _, _ in outs], [m if m is not None else jnp.zeros(jnp.shape(v)) for v, m, _ in outs]

    values, mags = jax.jit(run)(closed.consts, flat_args)
    return MagnitudeResult(values=list(values), magnitudes=list(mags), terms=n_holder[-1],
                           approximated=tuple(sorted(interp.approximated)))
