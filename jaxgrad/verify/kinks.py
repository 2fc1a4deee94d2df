r"""Kinks: rounded comparisons a low-precision run may decide the other way, and the jumps they cause.

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
  through normalisations as the worst case :math:`M` does (1e6-1e15 over a transformer block, where every softmax
  comparison would look uncertain). Operands that are inputs or pure data movement of inputs are
  exact (E = 0). Against an exact zero, a value whose *sign* rounding cannot change is certain however large E:
  products and quotients of such values, ``exp``/``logistic``, sign-keeping functions of them, and sums of terms of
  one sign (a softmax denominator ``den > 0``);
* ``select_n(p, a, b)`` on an uncertain ``p`` adds the jump :math:`|a - b|`; a bool converted to float adds 1;
* :math:`K` then propagates like a first-order error: :math:`K(a \pm b) = K(a) + K(b)`,
  :math:`K(ab) = K(a)|b| + |a|K(b)` (dots and convs alike), :math:`K(f(a)) = |f'(a)|K(a)`, data movement moves it.

* ``exp(a)`` leaves first order where the rounding radius of its argument, :math:`\delta = r(N) L(a) + K(a)`,
  reaches ``EXP_SATURATION`` (8, i.e. one unit roundoff of :math:`L(a)` is 1 at the C = 8 bound), with :math:`L` the
  *local* sum of |terms| (of the last products, their operands taken as exact: the logits' own
  :math:`\sum |q_i k_i|`; :math:`M` grows multiplicatively through normalisations and would be vacuous): a softmax on
  logits of size :math:`1/u`, whose rounded run picks the row's winner by its rounding. There the value is known only
  within a factor :math:`e^{\delta}`, and it is marked undetermined with :math:`K(\exp a) = |\exp a|\,e^{60}`
  (``SATURATED_JUMP``): every entry it feeds carries a jump of that order, far beyond any comparison's (whose jump is
  the difference of two first-order branches), and the statistics call such a leaf undetermined, not right or
  wrong.

The rules are methods of :class:`KinkRules`, mixed into the magnitude interpreter (:mod:`jaxgrad.verify.magnitude`),
which calls them only when ``kink_bound`` is given.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from jaxgrad.verify.interpreted import (_DATA_MOVEMENT, _MULTILINEAR, _NEGATING, _PRODUCTS, _REDUCE_SELECT, _State,
                                        _bind_nonneg, _zeros_like_kink, is_float)

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


class KinkRules:
    """Comparison, K, E and sign rules; the host sets ``kink_bound``, ``rounded_comparisons`` (a set) and
    ``uncertain`` (a list of traced counts)."""

    def _comparison_kink(self, prim, ins):
        """Uncertain mask of a float comparison (None when certain everywhere or kinks are off)."""
        a, b = ins
        if not (is_float(a.val) and is_float(b.val)) or (a.exact and b.exact and a.kink is None
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
            if not is_float(outvals[0]):
                return [k] if k.dtype == jnp.bool_ else None
            return [k.astype(outvals[0].dtype)]  # an uncertain bool becomes a 0/1 mask that may flip: K = 1 there
        if not any(is_float(o) for o in outvals):
            return None
        float_kinks = [s.kink if (s.kink is not None and is_float(s.val)) else None for s in ins]
        if all(k is None for k in float_kinks):
            return None
        if prim in _PRODUCTS:  # bilinear: sum over operands of f(|.|, ..., K_i, ..., |.|)
            total = None
            for i, k in enumerate(float_kinks):
                if k is None:
                    continue
                ops = [k if j == i else (jnp.abs(s.val) if is_float(s.val) else s.val) for j, s in enumerate(ins)]
                t = bind(*ops)
                total = t if total is None else total + t
            return [jnp.abs(total)]
        if prim in _MULTILINEAR or prim in _NEGATING or prim in _REDUCE_SELECT:
            ops = [(k if k is not None else _zeros_like_kink(s.val)) if is_float(s.val) else s.val
                   for s, k in zip(ins, float_kinks)]
            ks = _bind_nonneg(primitive, params, ops)
            return [jnp.abs(kk) if is_float(o) else None for kk, o in zip(ks, outvals, strict=True)]
        return None  # elementwise nonlinear: handled with the JVPs in eqn()

    # -- first-order error and sign certainty (kink mode) ---------------------------------------------------
    def _err_linear(self, primitive, params, ins, vals, outvals, n_local: int, exact_out: bool):
        r"""E of a linear primitive's outputs: the operands' errors moved through it (a product: its operands' errors
        times the other operands' |values|, :math:`E(ab) = E(a)|b| + |a|E(b)`), plus the local rounding
        :math:`r(n)\,\mathrm{op}(|a|, |b|)` of a rounded sum or product over ``n`` terms. List, None = 0."""
        if exact_out:
            return [None] * len(outvals)
        prim = primitive.name
        errs_in = [s.err if is_float(s.val) else None for s in ins]
        if prim in _PRODUCTS:
            total = None
            for i, e in enumerate(errs_in):
                if e is not None:
                    ops = [e if j == i else (jnp.abs(v) if is_float(v) else v) for j, v in enumerate(vals)]
                    t = primitive.bind(*ops, **params)
                    total = t if total is None else total + t
            errs = [total]
        elif all(e is None for e in errs_in):
            errs = [None] * len(outvals)
        else:
            errs = _bind_nonneg(primitive, params, [(e if e is not None else _zeros_like_kink(v)) if is_float(v)
                                                    else v for v, e in zip(vals, errs_in)])
        rounds = prim in _ROUNDING or (prim == "convert_element_type" and any(is_float(v) for v in vals)
                                       and jnp.dtype(params["new_dtype"]) != jnp.float64)
        if rounds:
            r = self.kink_bound(max(n_local, 1))
            local = _bind_nonneg(primitive, params, [jnp.abs(v) if is_float(v) else v for v in vals])
            errs = [r * jnp.abs(lc) if e is None else jnp.abs(e) + r * jnp.abs(lc) for e, lc in zip(errs, local)]
        return [jnp.abs(e) if (e is not None and is_float(o)) else None for e, o in zip(errs, outvals, strict=True)]

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
        if primitive.multiple_results and prim in _DATA_MOVEMENT:  # split, optimization_barrier: one list out
            known = [self._sign_known(s) if is_float(s.val) else v for s, v in zip(ins, vals)]
            if any(k is None for k in known):
                return [None] * len(outvals)
            try:
                outs = primitive.bind(*known, **params)
            except Exception:  # a rule that does not take bool operands: unknown, the safe side
                return [None] * len(outvals)
            return [jnp.broadcast_to(k, jnp.shape(o)) if is_float(o) else None for k, o in zip(outs, outvals)]
        if len(outvals) != 1 or not is_float(outvals[0]):
            return [None] * len(outvals)
        shape = jnp.shape(outvals[0])
        known = [self._sign_known(s) if is_float(s.val) else None for s in ins]
        fl = [i for i, v in enumerate(vals) if is_float(v)]
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
