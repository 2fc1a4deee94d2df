r"""The checks of :func:`jaxgrad.verify.check_vjp` that need no rounding model: finite differences, the adjoint
identity, the structure of the VJP, and notes on inputs that would hide a bug.

* **Finite differences**: central differences in float64 along random directions per argument leaf, at a sweep of
  steps with Richardson extrapolation, on ``fn``'s own float64 forward where it has one (else the reference's), so
  a wrong reference cannot hide a wrong VJP.
* **Adjoint**: :math:`\langle J t, \bar y\rangle = \langle t, J^\top \bar y\rangle` for a white-noise ``t``.
* **Structure**: a zero cotangent gives zero gradients, a repeated call the same gradients,
  :math:`\mathrm{vjp}(2\bar y) = 2\,\mathrm{vjp}(\bar y)` (a stale accumulator breaks both), and every cotangent
  has its primal's shape and dtype.
* **Same function in float64**: the float64 runs are an oracle only if they compute the function that was called.
  ``fn``'s forward as called and ``fn``'s float64 forward at the same inputs (the inputs as called are exact in
  float64), and the reference emulated at the adopted precision and its float64 run at the same points, must agree
  to a worst-case rounding bound of the precision (:func:`same_function_check`). A value made inside a function
  that does not come from its inputs -- a random draw or a constant in the default dtype, float64 under x64 -- is
  another value in float64: the oracle then tests another function, and its rounding model, computed with it,
  explains any error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.verify import cost
from jaxgrad.verify import precision as prec
from jaxgrad.verify.inputs import _white_noise_like
from jaxgrad.verify.leaves import _normalized_error
from jaxgrad.verify.report import Check

FD_STEPS = (1e-2, 1e-3, 1e-4, 1e-5)  # relative to the argument's RMS
FD_TOL = 1e-6  # finite differences in f64 with Richardson: truncation + cancellation stay below this
SAME_FUNCTION_SAFETY = 64.0  # the constant C of the same-function bound C (u_op + u_f32 sqrt(N)): 8x the verdict's


def _directional_fd(loss, args64, leaf_index, v, steps):
    """Richardson-extrapolated central differences of ``loss`` along ``v`` on one leaf, for each step (the points
    are formed on the host; ``loss`` is one compiled program)."""
    leaves, treedef = jax.tree.flatten(args64)
    x = np.asarray(leaves[leaf_index], np.float64)
    v = np.asarray(v, np.float64)
    scale = float(np.sqrt(np.mean(x * x))) or 1.0

    def at(h):
        new = list(leaves)
        new[leaf_index] = x + h * v
        return float(loss(*jax.tree.unflatten(treedef, new)))

    out = []
    for rel_h in steps:
        h = rel_h * scale
        d_h = (at(h) - at(-h)) / (2 * h)
        d_h2 = (at(h / 2) - at(-h / 2)) / h
        out.append((rel_h, float((4 * d_h2 - d_h) / 3)))
    return out


def finite_difference_checks(fd_fn, fd_on: str, which: str, args64, ct64, names, tested, ref_g, m_g, tols,
                             directions: int, rng: np.random.Generator) -> tuple[list[Check], list[str]]:
    """One check per gradient leaf: ``tested[i]`` (and, for a note, the reference's ``ref_g[i]``) against central
    differences of ``<ct64, fd_fn(args64)>`` along ``directions`` random directions, each error over
    ``sum(m_g[i] |v|)`` within ``tols[i]``. Returns ``(checks, notes)``."""
    checks, notes = [], []
    ct_leaves = jax.tree.leaves(ct64)
    arg_leaves = jax.tree.leaves(args64)

    @cost.jit
    def loss(*a):
        ys = jax.tree.leaves(fd_fn(*a))
        return sum(jnp.vdot(c, y.astype(jnp.float64)) for c, y in zip(ct_leaves, ys))

    for i, nm in enumerate(names):
        worst_fn, worst_ref, best_h = 0.0, 0.0, None
        for _ in range(directions):
            vn = rng.standard_normal(np.shape(arg_leaves[i]))
            scale = float(np.sum(m_g[i] * np.abs(vn))) or 1.0
            fds = _directional_fd(loss, args64, i, vn, FD_STEPS)
            exact_fn = float(np.vdot(tested[i].ravel(), vn.ravel()))
            exact_ref = float(np.vdot(ref_g[i].ravel(), vn.ravel()))
            errs = [(abs(dv - exact_fn) / scale, h) for h, dv in fds]
            e_fn, h_fn = min(errs)
            e_ref = min(abs(dv - exact_ref) / scale for _, dv in fds)
            if e_fn >= worst_fn:
                worst_fn, best_h = e_fn, h_fn
            worst_ref = max(worst_ref, e_ref)
        checks.append(Check(f"finite differences {nm}", worst_fn <= tols[i],
                            f"{which} VJP vs central FD on {fd_on}: {worst_fn:.1e} (tol {tols[i]:.0e}, best "
                            f"h={best_h:g}*rms); reference VJP vs FD: {worst_ref:.1e}"))
        if worst_ref > FD_TOL and worst_ref > 10 * worst_fn:
            notes.append(f"{nm}: the reference's own VJP disagrees with finite differences ({worst_ref:.1e});"
                         " the reference may be wrong (stop_gradient? custom rule?)")
    return checks, notes


def adjoint_check(fn, reference, args64, ct64, tested, m_g, tol: float, which: str,
                  rng: np.random.Generator) -> Check:
    """``<J t, c> = <t, J^T c>`` with ``J t`` from ``fn``'s own JVP (the reference's where ``fn`` has no forward
    mode) and ``J^T c`` the tested gradients; the error over ``sum |t| m_g`` within ``tol``."""
    t = _white_noise_like(args64, rng, jnp.float64)
    try:
        jt = cost.jit(lambda a, d: jax.jvp(fn, a, d)[1])(tuple(args64), tuple(t))
        jvp_src = "fn's own JVP"
    except Exception:
        jt = cost.jit(lambda a, d: jax.jvp(reference, a, d)[1])(tuple(args64), tuple(t))
        jvp_src = "the reference's JVP (fn has no forward mode)"
    lhs = sum(float(np.vdot(np.asarray(c, np.float64).ravel(), np.asarray(y, np.float64).ravel()))
              for c, y in zip(jax.tree.leaves(ct64), jax.tree.leaves(jt)))
    t_leaves = [np.asarray(x) for x in jax.tree.leaves(t)]
    rhs = sum(float(np.vdot(tl.ravel(), g.ravel())) for tl, g in zip(t_leaves, tested))
    scale = sum(float(np.sum(np.abs(tl) * m)) for tl, m in zip(t_leaves, m_g)) or 1.0
    err = abs(lhs - rhs) / scale
    return Check("adjoint <J t, c> = <t, J^T c>", err <= tol,
                 f"{which} VJP of fn against {jvp_src}: {err:.1e}*sum|terms| (tol {tol:.0e})")


def _structural_checks(pullback, ct, grads, args, names, model, n_g, m_g) -> list[Check]:
    out = []
    g_leaves = jax.tree.leaves(grads)
    bad = [f"{nm}: {np.shape(g)}/{jnp.result_type(g)} for {np.shape(a)}/{jnp.result_type(a)}"
           for nm, g, a in zip(names, g_leaves, jax.tree.leaves(args))
           if np.shape(g) != np.shape(a) or jnp.result_type(g) != jnp.result_type(a)]
    out.append(Check("cotangent shapes and dtypes", not bad, "; ".join(bad) or "every gradient has its primal's "
                                                                               "shape and dtype"))
    zero = pullback(jax.tree.map(lambda c: np.zeros(np.shape(c), jnp.result_type(c)), ct))
    nz = [nm for nm, g in zip(names, jax.tree.leaves(zero)) if bool(np.any(np.asarray(g) != 0))]
    out.append(Check("zero cotangent -> zero gradient", not nz, ("non-zero: " + ", ".join(nz)) if nz else "exact zeros"))
    again = jax.tree.leaves(pullback(ct))
    twice = jax.tree.leaves(pullback(jax.tree.map(lambda c: 2 * np.asarray(c), ct)))
    rep_bad, hom_bad = [], []
    for nm, g1, g2, g3, n, m in zip(names, g_leaves, again, twice, n_g, m_g):
        a1, a2, a3 = (np.asarray(x, np.float64) for x in (g1, g2, g3))
        b = model.bound(n)
        if float(np.max(_normalized_error(a1, a2, m), initial=0.0)) > b:
            rep_bad.append(nm)
        if float(np.max(_normalized_error(a3, 2 * a1, 2 * m), initial=0.0)) > b:
            hom_bad.append(nm)
    out.append(Check("repeat call -> same gradient", not rep_bad,
                     ("differs: " + ", ".join(rep_bad)) if rep_bad else "reproducible (no hidden accumulation)"))
    out.append(Check("vjp(2c) = 2 vjp(c)", not hom_bad,
                     ("not linear in the cotangent: " + ", ".join(hom_bad)) if hom_bad else "linear in the cotangent"))
    return out


def _coverage_notes(names, leaves) -> list[str]:
    notes = []
    for nm, x in zip(names, leaves):
        shape = np.shape(x)
        sizes = [s for s in shape if s > 1]
        dup = sorted({s for s in sizes if sizes.count(s) > 1})
        if dup:
            notes.append(f"{nm} {shape}: axes of equal length {dup} -- a transpose between them is invisible; use "
                         "asymmetric shapes")
        a = np.asarray(x, np.float64)
        if a.size > 1 and float(np.std(a)) == 0.0:
            notes.append(f"{nm}: constant values -- paths through it are barely exercised; use white noise")
            continue
        for ax, s in enumerate(shape):
            if s >= 8:
                u, w = np.take(a, range(s - 1), axis=ax), np.take(a, range(1, s), axis=ax)
                u, w = u - u.mean(), w - w.mean()
                den = float(np.sqrt(np.sum(u * u) * np.sum(w * w)))
                if den > 0 and float(np.sum(u * w)) / den > 0.9:
                    notes.append(f"{nm}: smooth along axis {ax} (lag-1 correlation > 0.9) -- flip/shift bugs can hide "
                                 "(0.7-2% on smooth images vs ~100% on noise); use white noise")
                    break
    return notes


def same_function_check(what: str, called: str, y_called, y64, m_y, n_y, kinks, precision: str,
                        replicas: bool = False) -> Check:
    r"""``what`` (``"fn"`` or ``"the reference"``) evaluated in float64 is the function called at ``called``.

    ``y_called[j]``: flat forward output ``j`` as called (``replicas``: ``[K, *shape]``, at K points); ``y64[j]``:
    the same in float64 at the same inputs; ``m_y[j]``, ``n_y[j]``: its sum|terms| and longest accumulation;
    ``kinks[j]``: the absolute jump of a branch its rounding may flip (or ``None``). Per entry, with
    :math:`b_j = C (u_p + u_{f32}\sqrt{N_j})` (:data:`SAME_FUNCTION_SAFETY`, ``precision`` p),

    .. math:: |y_i - y^{64}_i| \le b_j M_i + K_i,

    a worst-case rounding bound, 8x the per-entry bound of the verdict. Entries not finite as called are left to the
    forward check. A rounding model cannot explain an error beyond it: the float64 run computes another function.
    """
    model = prec.ErrorModel(precision, SAME_FUNCTION_SAFETY, "")
    worst, at = 0.0, None
    for j, (y, r, m, n, k) in enumerate(zip(y_called, y64, m_y, n_y, kinks)):
        y, r, m = (np.asarray(x, np.float64) for x in (y, r, m))
        b = model.bound(n)
        mm = m + (np.asarray(k, np.float64) / b if k is not None else 0.0)
        with np.errstate(invalid="ignore"):
            e = np.where(np.isfinite(y), _normalized_error(y, r, mm), 0.0) / b  # in units of the bound
        if e.size and float(np.max(e)) > worst:
            worst = float(np.max(e))
            at = (j, tuple(int(i) for i in np.unravel_index(int(np.argmax(e)), e.shape)), n, b)
    name = f"same function in float64 ({what})"
    if at is None or worst <= 1.0:
        return Check(name, True, f"{what}'s forward in {called} and in float64 at the same inputs agree to "
                     f"{worst:.2g}x the bound {model.formula()}*sum|terms| of {precision} rounding")
    j, idx, n, b = at
    entry, point = (idx[1:], f" at point {idx[0]}") if replicas else (idx, "")
    where = ", ".join(w for w in (f"output {j}" if len(y_called) > 1 else "", f"entry {entry}" if entry else "",
                                  point.strip()) if w)
    return Check(name, False,
                 f"{what} evaluated in float64 is not the function called in {called}: its forward differs by "
                 f"{worst * b:.1e}*sum|terms|{f' ({where})' if where else ''}, {worst:.3g}x the bound of "
                 f"{precision} rounding ({model.formula()} = {b:.1e}, N={n}); a value inside {what} that does not "
                 "come from its inputs "
                 "depends on the dtype, e.g. a random draw or a constant in the default dtype (float64 under x64): "
                 "create it in an explicit dtype. The float64 runs and the rounding model test another function "
                 "until then")
