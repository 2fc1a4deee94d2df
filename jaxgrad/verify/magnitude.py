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
* ``max``/``min`` (and their reductions) select one operand, and a rounded run may select the other:
  :math:`M(\max(a, b)) = \max(M(a), M(b))`.
* elementwise nonlinear primitives :math:`f` start a fresh rounding at their output and pass input errors through
  their slope: :math:`M(f(a)) = |f(a)| + |f'(a)|\,M(a)` (one JVP per input).
* call primitives (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``) are entered recursively.
* anything else (loops, sorts, opaque kernels) falls back to :math:`|y| + |J M|` and is listed in
  ``MagnitudeResult.approximated`` so the report can say the model is approximate there.

Alongside :math:`M` it tracks :math:`N(v)`, the length of the longest chain of additions that produced ``v``
(contraction sizes of dots and convs, reduced element counts), from which the error model takes its
:math:`\sqrt{N}` growth of accumulated rounding.

**Kinks** (``kink_bound`` given). A comparison on *rounded* values (``z > 0`` in ReLU's derivative, ``x == max(x,
y)`` in ``max``'s, a knot test on a hidden activation) can come out the other way in a low-precision run when its
operands differ by less than their rounding error. The branch a ``select`` (or a bool-to-float mask) then takes
differs, and the result changes by the *jump* between the branches -- O(1) times the terms, not O(u). First-order
rounding analysis has no such term, so it is tracked separately, as an absolute bound :math:`K(v)`:

* a comparison ``a < b`` (``>``, ``<=``, ``>=``, ``==``, ``!=``) is *uncertain* where
  :math:`|a - b| \le E(a) + E(b) + K(a) + K(b)`. :math:`E` is the first-order running error bound of the run under
  test (Wilkinson), with :math:`r(N) =` ``kink_bound(N)`` its relative rounding radius over N terms:
  :math:`E(a \pm b) = E(a) + E(b) + r(1)(|a| + |b|)`, :math:`E(ab) = E(a)|b| + |a|E(b) + r(1)|ab|` (a dot or conv:
  the same with :math:`r(N)` and the product of magnitudes), :math:`E(f(a)) = |f'(a)| E(a) + r(1)|f(a)|`, max/min
  and data movement move it. Unlike :math:`r(N) M`, it is linear in the operands' errors and does not compound
  through normalisations (:math:`M(\exp a) = |e|(1 + M(a))` multiplies magnitudes: ~1e150 over a transformer block,
  where every softmax comparison looked uncertain). Operands that are inputs or pure data movement of inputs are
  exact (E = 0). Against an exact zero, a value whose *sign* rounding cannot change is certain however large E:
  products and quotients of such values, ``exp``/``logistic``, sign-keeping functions of them, and sums of terms of
  one sign (a softmax denominator ``den > 0``);
* ``select_n(p, a, b)`` on an uncertain ``p`` adds the jump :math:`|a - b|`; a bool converted to float adds 1;
* :math:`K` then propagates like a first-order error: :math:`K(a \pm b) = K(a) + K(b)`,
  :math:`K(ab) = K(a)|b| + |a|K(b)` (dots and convs alike), :math:`K(f(a)) = |f'(a)|K(a)`, data movement moves it.

* ``exp(a)`` leaves first order where the rounding radius of its argument, :math:`\delta = r(N) L(a) + K(a)`,
  reaches ``EXP_SATURATION`` (8, i.e. one unit roundoff of :math:`L(a)` is 1 at the C = 8 bound), with :math:`L` the
  *local* sum of |terms| (of the last products, their operands taken as exact: the logits' own
  :math:`\sum |q_i k_i|`; :math:`M` grows multiplicatively through normalisations and would be vacuous): a softmax on logits
  of size :math:`1/u`, whose rounded run picks the row's winner by its rounding. There the value is known only within
  a factor :math:`e^{\delta}`, and it is marked undetermined with :math:`K(\exp a) = |\exp a|\,e^{60}`
  (``SATURATED_JUMP``): every entry it feeds carries a jump of that order, far beyond any comparison's (whose jump is
  the difference of two first-order branches), and the statistics call such a leaf undetermined, not right or
  wrong.

A correct low-precision gradient then satisfies :math:`|\hat g - g| \le r(N) M(g) + K(g)`. The first-order
propagation treats flips of different comparisons as independent, so where jumps cancel (two indicator bases of a
B-spline flipping together at a knot) :math:`K` overestimates: the bound loosens at those few entries only.

The interpreter is itself ordinary JAX code and is jit-compiled; run it in float64 for a faithful scale.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

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
_ELEMENTWISE_SELECT = {"max", "min"}  # likewise, elementwise
# Pure data movement: the output is exact when every floating input is (an input, a literal, or data moved from them).
_DATA_MOVEMENT = {
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice",
    "dynamic_update_slice", "gather", "concatenate", "pad", "rev", "select_n", "copy", "copy_p", "real", "split",
    "sharding_constraint", "optimization_barrier", "device_put",
}
_PRODUCTS = {"mul", "dot_general", "conv_general_dilated"}  # bilinear: K(ab) = K(a)|b| + |a|K(b)
_COMPARISONS = {"lt", "le", "gt", "ge", "eq", "ne"}
# Linear primitives whose output is a rounded sum or product: they add a local rounding r(n) * (their op on |operands|)
# to the propagated first-order error E
_ROUNDING = {"add", "add_any", "sub", "mul", "dot_general", "conv_general_dilated", "reduce_sum", "cumsum",
             "scatter-add", "scatter_add", "reduce_window_sum", "reduce_precision"}
# Elementwise primitives whose output keeps the sign of their (first) operand under rounding (zero iff it is zero),
# and those whose output is positive whatever the operand
_SIGN_KEEPING = {"sqrt", "cbrt", "abs", "tanh", "sign", "integer_pow", "square", "erf", "sinh", "atan", "asinh",
                 "rsqrt", "copy", "copy_p", "reduce_precision", "neg", "convert_element_type", "real"}
_POSITIVE = {"exp", "exp2", "logistic"}
_BOOL_LOGIC = {"and", "or", "not", "xor"}
# exp leaves first order where r(N) M(a) + K(a) >= this (at the C = 8 bound: u M(a) >= 1, a factor e per rounding)
EXP_SATURATION = 8.0
SATURATED_JUMP = float(np.exp(60.0))  # K / |exp a| of a saturated exp: "unknown", kept finite for the propagation
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
    # Comparison primitives seen on rounded floating operands (where a low-precision run may take the other branch)
    rounded_comparisons: tuple[str, ...] = ()
    # K per output (absolute bound of the branch-flip error; zeros without kink_bound), and per output the number of
    # entries with K > 0
    kinks: list[jax.Array] | None = None
    kink_counts: list[int] | None = None
    # Entries of rounded comparisons that may come out the other way (summed over the comparisons), with kink_bound
    uncertain_comparisons: int = 0


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


class _State(NamedTuple):
    """What the interpreter knows of one value: the value, its sum of |terms| (None for non-floats), its
    accumulation length N, its kink term (None = none; a float array K >= 0 for floats, a bool array "uncertain"
    for comparison results) and whether it is exact (an input or data moved from inputs: never rounded)."""

    val: Any
    mag: Any
    n: int
    kink: Any = None
    exact: bool = False
    # (kink mode only) the *local* sum of |terms|: of the last products, with their operands taken as exact (None:
    # |val|). The rounding radius of an exp's argument is judged on it, not on ``mag``, which grows multiplicatively
    # through normalisations (~1e150 over a transformer block) and would call every softmax saturated.
    loc: Any = None
    # (kink mode only) the first-order rounding error bound E of the run under test (None: 0, an exact value):
    # Wilkinson's running error analysis, linear in the operands' errors (no M(a) M(b) products), so it does not grow
    # multiplicatively through normalisations as ``mag`` does. A comparison's radius is judged on it.
    err: Any = None
    # (kink mode only) where the computed value's sign is certain (bool array; None: nowhere known; exact values
    # always): products, exps and sums of same-signed terms keep their sign under any rounding, so ``den > 0`` on a
    # softmax denominator never flips however large E is.
    sgn: Any = None


def _zeros_like_kink(v):
    return jnp.zeros(jnp.shape(v), jnp.result_type(v))


def _bind_nonneg(primitive, params: dict, ops: Sequence[Any]) -> list[Any]:
    """Apply a multilinear, negating or selecting primitive to non-negative operands (magnitudes or kink terms):
    ``sub`` adds, ``neg`` is the identity, ``reduce_min`` takes the largest. Returns a list of outputs."""
    name = primitive.name
    if name == "sub":
        out = jax.lax.add(ops[0], ops[1])
    elif name == "neg":
        out = ops[0]
    elif name == "reduce_min":
        out = jax.lax.reduce_max_p.bind(*ops, **params)
    else:
        out = primitive.bind(*ops, **params)
    return list(out) if primitive.multiple_results else [out]


class _Interpreter:
    def __init__(self, kink_bound: Callable[[int], float] | None = None):
        self.approximated: set[str] = set()
        self.rounded_comparisons: set[str] = set()
        self.kink_bound = kink_bound
        self.uncertain: list[jax.Array] = []  # per comparison: how many of its entries are uncertain (traced)

    def run(self, jaxpr: jcore.Jaxpr, consts, args: Sequence[_State]) -> list[_State]:
        env: dict[Any, _State] = {}

        def read(v) -> _State:
            if isinstance(v, jcore.Literal):
                val = np.asarray(v.val, dtype=v.aval.dtype)
                return _State(val, np.abs(val) if _is_float(val) else None, 0, None, True)
            return env[v]

        for var, c in zip(jaxpr.constvars, consts, strict=True):
            env[var] = _State(c, jnp.abs(c) if _is_float(c) else None, 0, None, True)
        for var, a in zip(jaxpr.invars, args, strict=True):
            env[var] = a
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            outs = self.eqn(eqn, ins)
            for var, o in zip(eqn.outvars, outs, strict=True):
                if not isinstance(var, jcore.DropVar):
                    env[var] = o
        return [read(v) for v in jaxpr.outvars]

    # -- kinks ------------------------------------------------------------------------------------------------
    def _comparison_kink(self, prim, ins):
        """Uncertain mask of a float comparison (None when certain everywhere or kinks are off)."""
        a, b = ins
        if not (_is_float(a.val) and _is_float(b.val)) or (a.exact and b.exact and a.kink is None
                                                           and b.kink is None):
            return None
        self.rounded_comparisons.add(prim)
        if self.kink_bound is None:
            return None
        radius = 0.0
        for s in (a, b):
            if not s.exact and s.err is not None:
                radius = radius + s.err
            if s.kink is not None:
                radius = radius + s.kink
        mask = jnp.abs(a.val - b.val) <= radius
        for s, o in ((a, b), (b, a)):  # against an exact zero, a value whose sign is certain cannot flip
            if o.exact and s.sgn is not None:
                certain = s.sgn & (s.val != 0) & (o.val == 0)
                if s.kink is not None:
                    certain = certain & (jnp.abs(s.val) > s.kink)
                mask = mask & ~certain
        self.uncertain.append(jnp.count_nonzero(mask))
        return mask

    def _kink_out(self, primitive, params, ins, vals, outvals):
        """K of a primitive's outputs (list, None entries = no kink), or None when no input carries one."""
        if all(s.kink is None for s in ins) or self.kink_bound is None:
            return None
        prim = primitive.name

        def bind(*ops):
            return primitive.bind(*ops, **params)

        if prim in _BOOL_LOGIC:
            u = None
            for s in ins:
                if s.kink is not None:
                    u = s.kink if u is None else (u | s.kink)
            return [u]
        if prim == "select_n":
            pred, cases = ins[0], ins[1:]
            ks = [s.kink if s.kink is not None else _zeros_like_kink(s.val) for s in cases]
            k = bind(pred.val, *ks)
            if pred.kink is not None:
                cv = [jnp.asarray(s.val) for s in cases]
                jump = functools.reduce(jnp.maximum, [jnp.abs(x - y) for x in cv for y in cv])
                kmax = functools.reduce(jnp.maximum, ks)
                k = k + jnp.where(pred.kink, jump + kmax, jnp.zeros_like(k))
            return [k]
        if prim == "convert_element_type":
            k = ins[0].kink
            if k is None:
                return None
            if not _is_float(outvals[0]):
                return [k] if k.dtype == jnp.bool_ else None
            return [k.astype(outvals[0].dtype)]  # an uncertain bool becomes a 0/1 mask that may flip: K = 1 there
        if not any(_is_float(o) for o in outvals):
            return None
        float_kinks = [s.kink if (s.kink is not None and _is_float(s.val)) else None for s in ins]
        if all(k is None for k in float_kinks):
            return None
        if prim in _PRODUCTS:  # bilinear: sum over operands of f(|.|, ..., K_i, ..., |.|)
            total = None
            for i, k in enumerate(float_kinks):
                if k is None:
                    continue
                ops = [k if j == i else (jnp.abs(s.val) if _is_float(s.val) else s.val) for j, s in enumerate(ins)]
                t = bind(*ops)
                total = t if total is None else total + t
            return [jnp.abs(total)]
        if prim in _MULTILINEAR or prim in _NEGATING or prim in _REDUCE_SELECT:
            ops = [(k if k is not None else _zeros_like_kink(s.val)) if _is_float(s.val) else s.val
                   for s, k in zip(ins, float_kinks)]
            ks = _bind_nonneg(primitive, params, ops)
            return [jnp.abs(kk) if _is_float(o) else None for kk, o in zip(ks, outvals, strict=True)]
        return None  # elementwise nonlinear: handled with the JVPs in eqn()

    # -- first-order error and sign certainty (kink mode) ---------------------------------------------------
    def _err_linear(self, primitive, params, ins, vals, outvals, n_local: int, exact_out: bool):
        r"""E of a linear primitive's outputs: the operands' errors moved through it (a product: its operands' errors
        times the other operands' |values|, :math:`E(ab) = E(a)|b| + |a|E(b)`), plus the local rounding
        :math:`r(n)\,\mathrm{op}(|a|, |b|)` of a rounded sum or product over ``n`` terms. List, None = 0."""
        if exact_out:
            return [None] * len(outvals)
        prim = primitive.name
        errs_in = [s.err if _is_float(s.val) else None for s in ins]
        if prim in _PRODUCTS:
            total = None
            for i, e in enumerate(errs_in):
                if e is not None:
                    ops = [e if j == i else (jnp.abs(v) if _is_float(v) else v) for j, v in enumerate(vals)]
                    t = primitive.bind(*ops, **params)
                    total = t if total is None else total + t
            errs = [total]
        elif all(e is None for e in errs_in):
            errs = [None] * len(outvals)
        else:
            errs = _bind_nonneg(primitive, params, [(e if e is not None else _zeros_like_kink(v)) if _is_float(v)
                                                    else v for v, e in zip(vals, errs_in)])
        rounds = prim in _ROUNDING or (prim == "convert_element_type" and any(_is_float(v) for v in vals)
                                       and jnp.dtype(params["new_dtype"]) != jnp.float64)
        if rounds:
            r = self.kink_bound(max(n_local, 1))
            local = _bind_nonneg(primitive, params, [jnp.abs(v) if _is_float(v) else v for v in vals])
            errs = [r * jnp.abs(lc) if e is None else jnp.abs(e) + r * jnp.abs(lc) for e, lc in zip(errs, local)]
        return [jnp.abs(e) if (e is not None and _is_float(o)) else None for e, o in zip(errs, outvals, strict=True)]

    @staticmethod
    def _sign_known(s: _State):
        if s.exact:
            return jnp.ones(jnp.shape(s.val), jnp.bool_)
        return s.sgn

    def _sgn_out(self, primitive, params, ins, vals, outvals):
        """Where each output's computed sign is certain (bool array) or None: products and quotients of
        sign-certain values, sums of sign-certain terms of one sign, exp/logistic (always positive), data movement
        and sign-keeping elementwise functions of sign-certain values; a select on an uncertain predicate only where
        every case is sign-certain with one strict sign."""
        prim = primitive.name
        if len(outvals) != 1 or not _is_float(outvals[0]):
            return [None] * len(outvals)
        shape = jnp.shape(outvals[0])
        known = [self._sign_known(s) if _is_float(s.val) else None for s in ins]
        fl = [i for i, v in enumerate(vals) if _is_float(v)]
        try:
            if prim in _POSITIVE:
                out = jnp.ones(shape, jnp.bool_)
            elif prim == "convert_element_type" and not fl:  # a bool or int mask made float: 0/1, certain unless flips
                out = jnp.ones(shape, jnp.bool_) if ins[0].kink is None else ~ins[0].kink
            elif any(known[i] is None for i in fl):
                return [None]
            elif prim in _SIGN_KEEPING and len(fl) == 1:
                out = known[fl[0]]
            elif prim in ("mul", "div"):
                out = known[0] & known[1]
            elif prim in ("add", "add_any", "sub"):
                a, b = vals[0], -vals[1] if prim == "sub" else vals[1]
                out = known[0] & known[1] & (((a >= 0) & (b >= 0)) | ((a <= 0) & (b <= 0)))
            elif prim == "reduce_sum":
                v, axes = vals[0], tuple(params["axes"])
                out = jnp.all(known[0] & (v >= 0), axis=axes) | jnp.all(known[0] & (v <= 0), axis=axes)
            elif prim == "select_n":
                pred, cases = ins[0], [known[i] for i in range(1, len(ins))]
                out = primitive.bind(pred.val, *cases, **params)
                if pred.kink is not None:
                    cv = [jnp.asarray(vals[i]) for i in range(1, len(ins))]
                    one_sign = functools.reduce(jnp.logical_and, [c > 0 for c in cv]) | \
                        functools.reduce(jnp.logical_and, [c < 0 for c in cv])
                    out = out & (~pred.kink | (functools.reduce(jnp.logical_and, cases) & one_sign))
            elif prim in _DATA_MOVEMENT:
                ops = [known[i] if i in fl else v for i, v in enumerate(vals)]
                out = primitive.bind(*ops, **params)
            else:
                return [None]
        except Exception:  # a data-movement rule that does not take bool operands: unknown, the safe side
            return [None]
        return [jnp.broadcast_to(out, shape)]

    def eqn(self, eqn, ins: list[_State]) -> list[_State]:
        prim = eqn.primitive.name
        params = dict(eqn.params)
        vals = [s.val for s in ins]
        n_in = max([s.n for s in ins], default=0)
        float_ins = [s for s in ins if _is_float(s.val)]
        exact_in = all(s.exact for s in float_ins)

        if prim in _CALLS:
            sub = params.get(_CALLS[prim]) if _CALLS[prim] else None
            if sub is not None:
                if isinstance(sub, jcore.ClosedJaxpr):
                    return self.run(sub.jaxpr, sub.consts, ins)
                return self.run(sub, [], ins)

        outvals = eqn.primitive.bind(*vals, **params)
        outvals = list(outvals) if eqn.primitive.multiple_results else [outvals]
        if not any(_is_float(o) for o in outvals):
            if prim in _COMPARISONS:
                return [_State(outvals[0], None, 0, self._comparison_kink(prim, ins), False)]
            kinks = self._kink_out(eqn.primitive, params, ins, vals, outvals) if prim in _BOOL_LOGIC or \
                prim == "convert_element_type" else None
            return [_State(o, None, 0, (kinks[i] if kinks else None), False) for i, o in enumerate(outvals)]

        def mag_or_abs(i):
            m = ins[i].mag
            return m if m is not None else (jnp.abs(vals[i]) if _is_float(vals[i]) else vals[i])

        n_out = n_in + _contraction_size(prim, params, vals)
        exact_out = exact_in and (prim in _DATA_MOVEMENT or (
            prim == "convert_element_type" and jnp.dtype(params["new_dtype"]) == jnp.float64))
        kinks = self._kink_out(eqn.primitive, params, ins, vals, outvals)
        if kinks is None:
            kinks = [None] * len(outvals)
        def loc_or_abs(i):
            lc = ins[i].loc
            return lc if lc is not None else (jnp.abs(vals[i]) if _is_float(vals[i]) else vals[i])

        if prim in _MULTILINEAR or prim in _NEGATING:
            ms = _bind_nonneg(eqn.primitive, params, [mag_or_abs(i) for i in range(len(ins))])
            locs = [None] * len(outvals)
            if self.kink_bound is not None:  # products restart the local terms from |operands|; sums carry them
                ops = [jnp.abs(v) if _is_float(v) else v for v in vals] if prim in _PRODUCTS else \
                    [loc_or_abs(i) for i in range(len(ins))]
                locs = [jnp.abs(lc) if _is_float(o) else None
                        for o, lc in zip(outvals, _bind_nonneg(eqn.primitive, params, ops), strict=True)]
            errs = sgns = [None] * len(outvals)
            if self.kink_bound is not None:
                errs = self._err_linear(eqn.primitive, params, ins, vals, outvals,
                                        _contraction_size(prim, params, vals), exact_out)
                sgns = self._sgn_out(eqn.primitive, params, ins, vals, outvals)
            return [_State(o, jnp.abs(mm) if _is_float(o) else None, n_out, k, exact_out, lc, e, sg)
                    for o, mm, k, lc, e, sg in zip(outvals, ms, kinks, locs, errs, sgns, strict=True)]
        if prim in _REDUCE_SELECT:
            (m,) = _bind_nonneg(eqn.primitive, params, [mag_or_abs(0)])
            lc = jnp.abs(_bind_nonneg(eqn.primitive, params, [loc_or_abs(0)])[0]) if self.kink_bound is not None \
                else None
            err = None
            if self.kink_bound is not None and ins[0].err is not None:
                err = jnp.abs(_bind_nonneg(eqn.primitive, params, [ins[0].err])[0])
            return [_State(outvals[0], jnp.abs(m), n_in, kinks[0], exact_out, lc, err)]
        if prim in _ELEMENTWISE_SELECT and len(float_ins) == len(ins) == 2:
            # max(a, b) picks one operand, and a rounded run may pick the other one: M = max(M(a), M(b)) (>= |y|;
            # the slope rule would give M = 0 to max(z, 0) at z < 0, where a TF32 z can come out positive).
            # Continuous, so the kink term is max(K(a), K(b)).
            m = jnp.maximum(mag_or_abs(0), mag_or_abs(1))
            k = None
            if self.kink_bound is not None and any(s.kink is not None for s in ins):
                ka, kb = (s.kink if s.kink is not None else _zeros_like_kink(s.val) for s in ins)
                k = jnp.maximum(ka, kb)
            err = None
            if self.kink_bound is not None and any(s.err is not None for s in ins):
                err = jnp.maximum(*(s.err if s.err is not None else _zeros_like_kink(s.val) for s in ins))
                err = jnp.broadcast_to(err, np.shape(outvals[0]))
            return [_State(outvals[0], jnp.broadcast_to(m, np.shape(outvals[0])), n_in, k, exact_out, None, err)]

        # Elementwise (or unknown) nonlinear primitive: M(y) = |y| + sum_k |dy/dx_k| M(x_k), one JVP per input;
        # the same for the kink term, K(y) = sum_k |dy/dx_k| K(x_k).
        float_idx = [i for i, v in enumerate(vals) if _is_float(v)]
        out_shape = np.shape(outvals[0])
        elementwise = (not eqn.primitive.multiple_results) and all(
            _broadcasts_to(np.shape(vals[i]), out_shape) for i in float_idx)
        if not elementwise:
            self.approximated.add(prim)

        def f(*xs):
            return eqn.primitive.bind(*xs, **params)

        def abs_jvp(i, t):
            tangents = [jnp.zeros_like(v) if _is_float(v) else np.zeros(np.shape(v), jax.dtypes.float0)
                        for v in vals]
            tangents[i] = jnp.broadcast_to(t, np.shape(vals[i])).astype(vals[i].dtype)
            _, t_out = jax.jvp(f, vals, tangents)
            return list(t_out) if eqn.primitive.multiple_results else [t_out]

        mags_out = [jnp.abs(o) if _is_float(o) else None for o in outvals]
        kinks_out = [None] * len(outvals)
        # E(f(a)) = sum_k |df/da_k| E(a_k) + r(1) |f(a)|: propagated, plus the fresh rounding of the output
        errs_out = [None] * len(outvals)
        if self.kink_bound is not None:
            errs_out = [self.kink_bound(1) * jnp.abs(o) if _is_float(o) else None for o in outvals]

        def add_abs(acc, t_out):
            return [a if (a is None or not _is_float(t)) else a + jnp.abs(t) for a, t in zip(acc, t_out, strict=True)]
        try:
            for i in float_idx:
                mags_out = add_abs(mags_out, abs_jvp(i, mag_or_abs(i)))
                if self.kink_bound is not None and ins[i].err is not None:
                    errs_out = add_abs(errs_out, abs_jvp(i, ins[i].err))
                if ins[i].kink is not None and self.kink_bound is not None:
                    k_out = abs_jvp(i, ins[i].kink)
                    kinks_out = [None if not _is_float(t) else (jnp.abs(t) if k is None else k + jnp.abs(t))
                                 for k, t in zip(kinks_out, k_out, strict=True)]
        except Exception:  # no JVP rule: keep |y| only, and say so
            self.approximated.add(prim)
        sgns = self._sgn_out(eqn.primitive, params, ins, vals, outvals) if self.kink_bound is not None \
            else [None] * len(outvals)
        if prim == "exp" and not ins[0].exact:
            kinks_out = [self._exp_saturation(ins[0], outvals[0], kinks_out[0])]
        return [_State(o, m, n_in + 1, k, False, None, e, sg)
                for o, m, k, e, sg in zip(outvals, mags_out, kinks_out, errs_out, sgns, strict=True)]

    def _exp_saturation(self, a: _State, y, k_first_order):
        """K of ``exp(a)`` where the argument's rounding radius reaches ``EXP_SATURATION`` (module doc)."""
        self.rounded_comparisons.add("exp")
        if self.kink_bound is None:
            return k_first_order
        delta = self.kink_bound(a.n) * (a.loc if a.loc is not None else jnp.abs(a.val))
        if a.kink is not None:
            delta = delta + a.kink
        saturated = delta >= EXP_SATURATION
        self.uncertain.append(jnp.count_nonzero(saturated))
        jump = jnp.abs(y) * SATURATED_JUMP
        base = k_first_order if k_first_order is not None else jnp.zeros_like(jump)
        return jnp.where(saturated, jump, base)


def magnitudes(fn: Callable[..., Any], *args: Any, kink_bound: Callable[[int], float] | None = None
               ) -> MagnitudeResult:
    """Evaluate ``fn(*args)`` together with the sum of |terms| of every output entry.

    Args:
      fn: any JAX-traceable function (e.g. ``lambda *a: jax.vjp(ref, *a[:-1])[1](a[-1])`` for a VJP).
      *args: pytrees of arrays. Run under ``jax.enable_x64(True)`` with float64 arrays for a faithful scale.
      kink_bound: ``N -> r(N)``, the relative forward rounding radius of the run under test (e.g.
        ``ErrorModel.bound``). Given, the result also carries the kink term ``K`` of every output (module doc).

    Returns:
      A :class:`MagnitudeResult` over the flattened outputs.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    flat_args = jax.tree.leaves(args)
    interp = _Interpreter(kink_bound)
    n_holder: list[list[int]] = []

    def run(consts, flat):
        ins = [_State(a, jnp.abs(a) if _is_float(a) else None, 0, None, True) for a in flat]
        outs = interp.run(closed.jaxpr, consts, ins)
        n_holder.append([s.n for s in outs])
        kinks = [s.kink.astype(jnp.result_type(s.val)) if (s.kink is not None and _is_float(s.val))
                 else jnp.zeros(jnp.shape(s.val)) for s in outs]
        uncertain = sum(interp.uncertain, jnp.zeros((), jnp.int32))
        return ([s.val for s in outs], [s.mag if s.mag is not None else jnp.zeros(jnp.shape(s.val)) for s in outs],
                kinks, uncertain)

    values, mags, kinks, uncertain = jax.jit(run)(closed.consts, flat_args)
    result = MagnitudeResult(values=list(values), magnitudes=list(mags), terms=n_holder[-1],
                             approximated=tuple(sorted(interp.approximated)),
                             rounded_comparisons=tuple(sorted(interp.rounded_comparisons)))
    if kink_bound is not None:
        result = dataclasses.replace(result, kinks=list(kinks),
                                     kink_counts=[int(np.count_nonzero(np.asarray(k))) for k in kinks],
                                     uncertain_comparisons=int(uncertain))
    return result
