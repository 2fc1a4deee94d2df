r"""Sum of |terms|: the condition scale against which rounding error is judged.

A computed quantity :math:`s = \sum_k t_k` carries a rounding error bounded by :math:`c\,u\,\sum_k |t_k|`, never by
:math:`c\,u\,|s|` (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3-4). A gradient entry whose terms
cancel (:math:`|s| \ll \sum|t_k|`) therefore shows a huge *relative* error from pure rounding; divided by
:math:`\sum|t_k|` it does not. This module computes that scale, :math:`M(v)`, for every value of any JAX function,
by re-interpreting its jaxpr with a running error bound (Wilkinson's running error analysis, first order):

* multilinear primitives (``add``, ``mul``, ``dot_general``, ``conv_general_dilated``, ``reduce_sum``, reshapes,
  slices, selects ...) are applied to the magnitudes: :math:`M(a \pm b) = M(a) + M(b)`, and a product of an exact
  operand (an input, a constant) :math:`M(A B) = |A|\,M(B)` (the matrix product of magnitudes is exactly
  :math:`\sum|a_{ik} b_{kj}|` at the top level; for a conv or matmul VJP this is the "one extra VJP on absolute
  values"). A product of two computed operands is first order, :math:`M(a b) = M(a)|b| + |a|(M(b) - |b|)`
  (:func:`_product_magnitude`): the cross term of :math:`M(a) M(b)` is second order and compounds through
  normalisations and attention (``x * x`` squares ``M/|x|``).
* ``max``/``min`` select one operand, and a rounded run may select the other:
  :math:`M(\max(a, b)) = \max(M(a), M(b))`; their reductions take the largest ``M`` over the entries a rounded run
  can select (:func:`_reachable_extremum_magnitude`: not the ``-1e30`` fill of a masked softmax shift).
* elementwise nonlinear primitives :math:`f` start a fresh rounding at their output and pass input errors through
  their slope: :math:`M(f(a)) = |f(a)| + |f'(a)|\,M(a)` (one JVP per input; a zero slope at an infinite
  :math:`M(a)` adds 0: ``exp`` of a ``-inf``-filled score).
* call primitives (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``) are entered recursively.
* anything else (loops, sorts, opaque kernels) falls back to :math:`|y| + |J M|` and is listed in
  ``MagnitudeResult.approximated`` so the report can say the model is approximate there.

Alongside :math:`M` it tracks :math:`N(v)`, the length of the longest chain of additions that produced ``v``
(contraction sizes of dots and convs, reduced element counts), from which the error model takes its
:math:`\sqrt{N}` growth of accumulated rounding.

**Kinks** (``kink_bound`` given): the uncertain comparisons of a low-precision run, their jumps :math:`K(v)`, the
first-order error :math:`E(v)` that judges them, and sign certainty are tracked alongside (:mod:`jaxgrad.verify.kinks`).

A correct low-precision gradient then satisfies :math:`|\hat g - g| \le r(N) M(g) + K(g)`. The first-order
propagation treats flips of different comparisons as independent, so where jumps cancel (two indicator bases of a
B-spline flipping together at a knot) :math:`K` overestimates: the bound loosens at those few entries only.

The interpreter is itself ordinary JAX code and is jit-compiled; run it in float64 for a faithful scale.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lax import lax as lax_internal
from jax.extend import core as jcore

from jaxgrad.verify import cost
from jaxgrad.verify.interpreted import (_CALLS, _DATA_MOVEMENT, _ELEMENTWISE_SELECT, _MULTILINEAR, _NEGATING,
                                        _PRODUCTS, _REDUCE_SELECT, _State, _bind_nonneg, _broadcasts_to,
                                        _contraction_size, _zeros_like_kink, is_float)
from jaxgrad.verify.kinks import _BOOL_LOGIC, _COMPARISONS, EXP_SATURATION, SATURATED_JUMP, KinkRules

__all__ = ["MagnitudeResult", "evaluate", "magnitudes", "EXP_SATURATION", "SATURATED_JUMP"]


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


class _Interpreter(KinkRules):
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
                return _State(val, np.abs(val) if is_float(val) else None, 0, None, True)
            return env[v]

        for var, c in zip(jaxpr.constvars, consts, strict=True):
            env[var] = _State(c, jnp.abs(c) if is_float(c) else None, 0, None, True)
        for var, a in zip(jaxpr.invars, args, strict=True):
            env[var] = a
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            outs = self.eqn(eqn, ins)
            for var, o in zip(eqn.outvars, outs, strict=True):
                if not isinstance(var, jcore.DropVar):
                    env[var] = o
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn, ins: list[_State]) -> list[_State]:
        prim = eqn.primitive.name
        params = dict(eqn.params)
        vals = [s.val for s in ins]
        n_in = max([s.n for s in ins], default=0)
        float_ins = [s for s in ins if is_float(s.val)]
        exact_in = all(s.exact for s in float_ins)

        if prim in _CALLS:
            sub = params.get(_CALLS[prim]) if _CALLS[prim] else None
            if sub is not None:
                if isinstance(sub, jcore.ClosedJaxpr):
                    return self.run(sub.jaxpr, sub.consts, ins)
                return self.run(sub, [], ins)

        outvals = eqn.primitive.bind(*vals, **params)
        outvals = list(outvals) if eqn.primitive.multiple_results else [outvals]
        if not any(is_float(o) for o in outvals):
            if prim in _COMPARISONS:
                return [_State(outvals[0], None, 0, self._comparison_kink(prim, ins), False)]
            kinks = self._kink_out(eqn.primitive, params, ins, vals, outvals) if prim in _BOOL_LOGIC or \
                prim == "convert_element_type" else None
            return [_State(o, None, 0, (kinks[i] if kinks else None), False) for i, o in enumerate(outvals)]

        def mag_or_abs(i):
            m = ins[i].mag
            return m if m is not None else (jnp.abs(vals[i]) if is_float(vals[i]) else vals[i])

        n_out = n_in + _contraction_size(prim, params, vals)
        exact_out = exact_in and (prim in _DATA_MOVEMENT or (
            prim == "convert_element_type" and jnp.dtype(params["new_dtype"]) == jnp.float64))
        kinks = self._kink_out(eqn.primitive, params, ins, vals, outvals)
        if kinks is None:
            kinks = [None] * len(outvals)
        def loc_or_abs(i):
            lc = ins[i].loc
            return lc if lc is not None else (jnp.abs(vals[i]) if is_float(vals[i]) else vals[i])

        if prim in _MULTILINEAR or prim in _NEGATING:
            ms = _product_magnitude(eqn.primitive, params, ins, [mag_or_abs(i) for i in range(len(ins))]) \
                if prim in _PRODUCTS else _bind_nonneg(eqn.primitive, params, [mag_or_abs(i) for i in range(len(ins))])
            locs = [None] * len(outvals)
            if self.kink_bound is not None:  # products restart the local terms from |operands|; sums carry them
                ops = [jnp.abs(v) if is_float(v) else v for v in vals] if prim in _PRODUCTS else \
                    [loc_or_abs(i) for i in range(len(ins))]
                locs = [jnp.abs(lc) if is_float(o) else None
                        for o, lc in zip(outvals, _bind_nonneg(eqn.primitive, params, ops), strict=True)]
            errs = sgns = [None] * len(outvals)
            if self.kink_bound is not None:
                errs = self._err_linear(eqn.primitive, params, ins, vals, outvals,
                                        _contraction_size(prim, params, vals), exact_out)
                sgns = self._sgn_out(eqn.primitive, params, ins, vals, outvals)
            return [_State(o, jnp.abs(mm) if is_float(o) else None, n_out, k, exact_out, lc, e, sg)
                    for o, mm, k, lc, e, sg in zip(outvals, ms, kinks, locs, errs, sgns, strict=True)]
        if prim in _REDUCE_SELECT:
            (m,) = _reachable_extremum_magnitude(prim, params, vals[0], mag_or_abs(0), outvals[0]) \
                if prim in ("reduce_max", "reduce_min") else _bind_nonneg(eqn.primitive, params, [mag_or_abs(0)])
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
        float_idx = [i for i, v in enumerate(vals) if is_float(v)]
        out_shape = np.shape(outvals[0])
        elementwise = (not eqn.primitive.multiple_results) and all(
            _broadcasts_to(np.shape(vals[i]), out_shape) for i in float_idx)
        if not elementwise:
            self.approximated.add(prim)

        def f(*xs):
            return eqn.primitive.bind(*xs, **params)

        def abs_jvp(i, t):
            tangents = [jnp.zeros_like(v) if is_float(v) else np.zeros(np.shape(v), jax.dtypes.float0)
                        for v in vals]
            tangents[i] = jnp.broadcast_to(t, np.shape(vals[i])).astype(vals[i].dtype)
            _, t_out = jax.jvp(f, vals, tangents)
            return list(t_out) if eqn.primitive.multiple_results else [t_out]

        mags_out = [jnp.abs(o) if is_float(o) else None for o in outvals]
        kinks_out = [None] * len(outvals)
        # E(f(a)) = sum_k |df/da_k| E(a_k) + r(1) |f(a)|: propagated, plus the fresh rounding of the output
        errs_out = [None] * len(outvals)
        if self.kink_bound is not None:
            errs_out = [self.kink_bound(1) * jnp.abs(o) if is_float(o) else None for o in outvals]

        def add_abs(acc, t_out):
            return [a if (a is None or not is_float(t)) else a + jnp.abs(t) for a, t in zip(acc, t_out, strict=True)]
        try:
            for i in float_idx:
                t_out = abs_jvp(i, mag_or_abs(i))
                if elementwise:
                    t_out = [_no_slope_at_infinity(t, mag_or_abs(i)) if is_float(t) else t for t in t_out]
                mags_out = add_abs(mags_out, t_out)
                if self.kink_bound is not None and ins[i].err is not None:
                    errs_out = add_abs(errs_out, abs_jvp(i, ins[i].err))
                if ins[i].kink is not None and self.kink_bound is not None:
                    k_out = abs_jvp(i, ins[i].kink)
                    kinks_out = [None if not is_float(t) else (jnp.abs(t) if k is None else k + jnp.abs(t))
                                 for k, t in zip(kinks_out, k_out, strict=True)]
        except Exception:  # no JVP rule: keep |y| only, and say so
            self.approximated.add(prim)
        sgns = self._sgn_out(eqn.primitive, params, ins, vals, outvals) if self.kink_bound is not None \
            else [None] * len(outvals)
        if prim == "exp" and not ins[0].exact:
            kinks_out = [self._exp_saturation(ins[0], outvals[0], kinks_out[0])]
        return [_State(o, m, n_in + 1, k, False, None, e, sg)
                for o, m, k, e, sg in zip(outvals, mags_out, kinks_out, errs_out, sgns, strict=True)]


def _no_slope_at_infinity(t, m):
    r"""``|f'(a)| M(a)`` where ``M(a)`` is infinite and the slope 0 is 0, not ``0 * inf = nan``: ``exp(-inf)`` (a masked
    score, ``-inf`` filled) is exactly 0 whatever the rounding of its argument, and carries no error. Any other nan
    (a nan slope) stays."""
    at_infinity = jnp.broadcast_to(jnp.isinf(m), jnp.shape(t))
    return jnp.where(jnp.isnan(t) & at_infinity, jnp.zeros_like(t), t)


def _reachable_extremum_magnitude(prim: str, params: dict, x, m, y) -> list[Any]:
    r"""``M`` of ``y = max_i x_i`` (``reduce_max``; ``reduce_min`` mirrored): the largest ``M_i`` over the entries a
    rounded run can select. The computed maximum is within :math:`\max_i |\hat x_i - x_i|` of ``y`` (max is
    1-Lipschitz), and entry ``i`` can come out on top only if :math:`x_i + r M_i \ge y - r M_*` (``M_*``: ``M`` at the
    maximum). Any meaningful radius has :math:`r \le 1/2` (a larger one admits every value), so the candidates are
    :math:`x_i + M_i/2 \ge y - M_*/2`. This drops the fill of a masked softmax shift, ``max(where(mask, s,
    -1e30))``: ``M = 1e30`` there, never a candidate; taking it would put ``1e30`` into every ``exp(s - max)``
    (a ``-inf`` fill, ``M = inf``, drops out as well: ``-inf + inf`` is no candidate)."""
    axes = tuple(params["axes"])
    sign = 1.0 if prim == "reduce_max" else -1.0
    y_b = jnp.expand_dims(y, axes)
    at_top = x == y_b
    m_star = jnp.expand_dims(jnp.max(jnp.where(at_top, m, 0), axis=axes), axes)
    reachable = sign * (x - y_b) + (m + m_star) / 2 >= 0
    return [jnp.max(jnp.where(reachable | at_top, m, 0), axis=axes)]


def _product_magnitude(primitive, params: dict, ins: Sequence[_State], mags: Sequence[Any]) -> list[Any]:
    r"""``M`` of a product (``mul``, ``dot_general``, ``conv_general_dilated``) of ``a`` and ``b``, to first order:

    .. math:: M(a b) = M(a)\,|b| + |a|\,\bigl(M(b) - |b|\bigr)
              = M(a) M(b) - \bigl(M(a) - |a|\bigr)\bigl(M(b) - |b|\bigr)

    (contractions and convolutions apply the same to magnitude arrays). With an exact operand (``M = |.|``) it is
    the product of magnitudes, :math:`\sum_k |a_k b_k|` at the top level. Of two computed operands, the computed
    product carries :math:`b\,\delta a + a\,\delta b + \delta a\,\delta b` with :math:`|\delta v| \le r\,M(v)`:
    the dropped cross term is :math:`r^2`, second order, as everywhere else in this running error analysis. Kept,
    it compounds: ``x * x`` squares ``M(x) / |x|``, and a block of RMSNorms and softmaxes (``q k^T``, ``P V``)
    raises ``M`` past 1e100 at gradients of order one -- a per-entry bound that admits anything.
    Both forms are sums of non-negative arrays (``M(b) - |b|`` clamped at 0), so ``M >= |a b|`` entrywise."""
    a, b = ins
    if not (is_float(a.val) and is_float(b.val)) or a.exact or b.exact:
        return _bind_nonneg(primitive, params, list(mags))
    abs_a, abs_b = jnp.abs(a.val), jnp.abs(b.val)
    slack_b = jnp.maximum(mags[1] - abs_b, 0)
    out = primitive.bind(mags[0], abs_b, **params) + primitive.bind(abs_a, slack_b, **params)
    return [out]


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

    One program per ``fn`` and argument shapes serves every call: the interpreter is traced once with the kink
    rules on and the radii ``r(N)`` as arguments (a call without ``kink_bound`` reads its values and magnitudes,
    which the kink rules do not touch), and compiled once; the program is kept while ``fn`` lives, so the plain pass
    of ``check_vjp`` and its kink pass under each precision hypothesis share one compilation.
    """
    with cost.stage("magnitudes" if kink_bound is None else "kink magnitudes"):
        return _program(fn, args).result(args, kink_bound)


def evaluate(fn: Callable[..., Any], *args: Any) -> list[jax.Array]:
    """``fn(*args)``'s flat outputs, computed by the magnitude program of ``fn`` at these argument shapes (the same
    operations; compiled once and shared with :func:`magnitudes`): the float64 oracle at many points without a
    compilation of its own."""
    return _program(fn, args).values(args)


class _Radii:
    """``kink_bound`` while tracing: ``r(N)`` is entry ``slot(N)`` of the radii argument, weakly typed like the
    Python float it stands for (it takes each operand's dtype), so one compiled program serves every bound."""

    def __init__(self, vector, capacity: int):
        self.vector, self.capacity = vector, capacity
        self.slots: dict[int, int] = {}  # N -> entry of the radii argument, in the order first asked

    def __call__(self, n) -> Any:
        n = int(n)
        if n not in self.slots:
            if len(self.slots) >= self.capacity:
                raise AssertionError(f"magnitudes: more than {self.capacity} distinct accumulation lengths")
            self.slots[n] = len(self.slots)
        r = self.vector[self.slots[n]]
        return lax_internal._convert_element_type(r, r.dtype, weak_type=True)


class _KinkInterpreter(_Interpreter):
    """The interpreter in kink mode that also records which comparisons the plain mode would call rounded (a
    comparison of two exact operands that carry a jump counts in kink mode only)."""

    def __init__(self, kink_bound):
        super().__init__(kink_bound)
        self.plain_rounded: set[str] = set()

    def _comparison_kink(self, prim, ins):
        a, b = ins
        if is_float(a.val) and is_float(b.val) and not (a.exact and b.exact):
            self.plain_rounded.add(prim)
        return super()._comparison_kink(prim, ins)

    def _exp_saturation(self, a, y, k_first_order):
        self.plain_rounded.add("exp")
        return super()._exp_saturation(a, y, k_first_order)


def _count_eqns(jaxpr: jcore.Jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for sub in jcore.jaxprs_in_params(eqn.params):
            n += _count_eqns(sub)
    return n


def _convolves(jaxpr: jcore.Jaxpr) -> bool:
    """Whether ``jaxpr`` (or a jaxpr inside it) has a convolution (the compiler options depend on it: cost.jit)."""
    return any(eqn.primitive.name == "conv_general_dilated"
               or any(_convolves(sub) for sub in jcore.jaxprs_in_params(eqn.params)) for eqn in jaxpr.eqns)


class _Program:
    """The magnitude interpreter of one ``fn`` at one argument signature, traced and compiled once (module doc of
    :func:`magnitudes`)."""

    def __init__(self, fn, args):
        closed = jax.make_jaxpr(fn)(*args)
        self.consts = closed.consts
        self.capacity = 2 * _count_eqns(closed.jaxpr) + 2  # r(N) is asked at most twice per equation
        self.dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
        interp: _KinkInterpreter | None = None
        radii: _Radii | None = None
        n_holder: list[list[int]] = []

        def run(consts, flat, vector):
            nonlocal interp, radii
            radii = _Radii(vector, self.capacity)
            interp = _KinkInterpreter(radii)
            ins = [_State(a, jnp.abs(a) if is_float(a) else None, 0, None, True) for a in flat]
            outs = interp.run(closed.jaxpr, consts, ins)
            n_holder.append([s.n for s in outs])
            kinks = [s.kink.astype(jnp.result_type(s.val)) if (s.kink is not None and is_float(s.val))
                     else jnp.zeros(jnp.shape(s.val)) for s in outs]
            uncertain = sum(interp.uncertain, jnp.zeros((), jnp.int32))
            return ([s.val for s in outs],
                    [s.mag if s.mag is not None else jnp.zeros(jnp.shape(s.val)) for s in outs], kinks, uncertain)

        flat = jax.tree.leaves(args)
        self.compiled = cost.jit(run, convolves=_convolves(closed.jaxpr)).trace(self.consts, flat, np.zeros(self.capacity, self.dtype)).lower().compile()
        self.terms = n_holder[-1]
        self.slots = dict(radii.slots)
        self.approximated = tuple(sorted(interp.approximated))
        self.rounded = tuple(sorted(interp.rounded_comparisons))
        self.plain_rounded = tuple(sorted(interp.plain_rounded))

    def values(self, args) -> list[jax.Array]:
        return list(self.compiled(self.consts, jax.tree.leaves(args), np.ones(self.capacity, self.dtype))[0])

    def result(self, args, kink_bound) -> MagnitudeResult:
        vector = np.ones(self.capacity, self.dtype)
        if kink_bound is not None:
            for n, slot in self.slots.items():
                vector[slot] = kink_bound(n)
        values, mags, kinks, uncertain = self.compiled(self.consts, jax.tree.leaves(args), vector)
        if kink_bound is None:
            return MagnitudeResult(values=list(values), magnitudes=list(mags), terms=list(self.terms),
                                   approximated=self.approximated, rounded_comparisons=self.plain_rounded)
        return MagnitudeResult(values=list(values), magnitudes=list(mags), terms=list(self.terms),
                               approximated=self.approximated, rounded_comparisons=self.rounded, kinks=list(kinks),
                               kink_counts=[int(np.count_nonzero(np.asarray(k))) for k in kinks],
                               uncertain_comparisons=int(uncertain))


# fn -> {argument signature and configuration: its program}; an entry goes with its fn
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _program(fn, args) -> _Program:
    leaves, treedef = jax.tree.flatten(args)
    key = (treedef, tuple((np.shape(x), jnp.result_type(x), getattr(x, "weak_type", False)) for x in leaves),
           bool(jax.config.jax_enable_x64), str(jax.config.jax_default_matmul_precision))
    try:
        per_fn = _PROGRAMS.setdefault(fn, {})
    except TypeError:  # not weakly referenceable (a builtin): no memo
        return _Program(fn, args)
    if key not in per_fn:
        per_fn[key] = _Program(fn, args)
    return per_fn[key]
