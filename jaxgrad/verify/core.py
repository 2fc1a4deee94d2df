r"""``check_vjp``: prove a backward pass, or say which gradient is wrong and how.

Procedure (each step is what the report shows):

1. **Oracle.** The reference's VJP in float64 at HIGHEST precision, at the caller's arguments and a white-noise
   cotangent :math:`\bar y`. Alongside, the sum of |terms| :math:`M_i` of every gradient entry and forward output
   (:mod:`jaxgrad.verify.magnitude`).
2. **As called.** ``fn``'s VJP in the caller's dtypes and the platform's default precision. Its error per entry,
   divided by :math:`M_i`, is judged against the rounding model of :mod:`jaxgrad.verify.precision`, whose precision
   comes from the dtypes, the platform (TF32 on GPU) and the forward mismatch. A second, normwise gate (the
   **rounding witness**) runs the reference's own VJP at the same dtypes and precision: a leaf whose normwise error
   is far above what rounding does to the reference itself fails even when every entry is within its bound
   (:func:`witness_limit`).
3. **Float64 re-run.** Where ``fn`` runs in float64 (its forward then matches to ~1e-16), its float64 VJP must match
   the oracle to 1e-10 of :math:`M_i`: with rounding gone, anything left is a bug (a 1e-4 scale, say).
4. **Independent ground truth.** Central finite differences in float64 along random directions per argument, with
   a step sweep and Richardson extrapolation, on ``fn``'s own forward when it runs in float64 (else on the
   reference's), so a wrong reference cannot hide a wrong VJP; and the adjoint identity
   :math:`\langle J t, \bar y\rangle = \langle t, J^\top \bar y\rangle`.
5. **Structure.** A zero cotangent gives zero gradients, a repeated call gives the same gradients,
   :math:`\mathrm{vjp}(2\bar y) = 2\,\mathrm{vjp}(\bar y)` (a stale accumulator breaks both), and every cotangent has
   its primal's shape and dtype.
6. **Diagnosis.** A failing gradient is searched for a flip, transpose, shift, constant factor or zero
   (:mod:`jaxgrad.verify.diagnose`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.verify import precision as prec
from jaxgrad.verify.diagnose import diagnose
from jaxgrad.verify.magnitude import magnitudes
from jaxgrad.verify.report import Check, LeafResult, VJPReport, environment

__all__ = ["VJPUnavailableError", "assert_vjp_matches", "check_vjp"]

FD_STEPS = (1e-2, 1e-3, 1e-4, 1e-5)  # relative to the argument's RMS
FD_TOL = 1e-6  # finite differences in f64 with Richardson: truncation + cancellation stay below this
# Rounding witness (normwise gate of the as-called run): fail when ||g - g*||/||g*|| exceeds
#   max(WITNESS_FACTOR * ref_rel_err, WITNESS_FACTOR * u_op, WITNESS_FLOOR)
# ref_rel_err: the same error of the reference's own VJP run at the same dtypes and precision.
WITNESS_FACTOR = 100.0
WITNESS_FLOOR = 1e-2


class VJPUnavailableError(TypeError):
    """``fn`` cannot be differentiated in reverse mode (no VJP rule)."""


# ---------------------------------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------------------------------
def _leaf_names(args, arg_names=None) -> list[str]:
    """``x``, ``params['w']`` (with ``arg_names``) or ``args[0]``, ``args[1]['w']`` (without)."""
    if arg_names is not None and len(arg_names) != len(args):
        raise ValueError(f"check_vjp: 'arg_names' names {len(arg_names)} arguments but {len(args)} were passed")
    paths, _ = jax.tree_util.tree_flatten_with_path(args)
    names = []
    for path, _ in paths:
        i = path[0].idx  # the positional index of the argument
        head = arg_names[i] if arg_names is not None else f"args[{i}]"
        names.append(head + jax.tree_util.keystr(path[1:]))
    return names


def _validate_args(fn, reference, args) -> None:
    for what, f in (("fn", fn), ("reference", reference)):
        if not callable(f):
            raise TypeError(f"check_vjp: '{what}' must be callable, got {type(f).__name__}")
    if not args:
        raise ValueError("check_vjp: pass the arguments to differentiate, e.g. check_vjp(fn, ref, x, w)")
    leaves = jax.tree.leaves(args)
    if not leaves:
        raise ValueError("check_vjp: the arguments contain no arrays to differentiate")
    for name, leaf in zip(_leaf_names(args), leaves, strict=True):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            raise TypeError(f"check_vjp: argument leaf {name} is a {type(leaf).__name__}, not an array; close over "
                            "non-array arguments with functools.partial")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"check_vjp: argument leaf {name} has dtype {dtype}; every argument leaf is "
                            "differentiated and must be floating point (bf16/f16/f32/f64). Close over integer or "
                            "boolean inputs (indices, masks, NF4 codes) with functools.partial.")
        if np.size(leaf) and not bool(jnp.all(jnp.isfinite(jnp.asarray(leaf, jnp.float32)))):
            raise ValueError(f"check_vjp: argument leaf {name} contains NaN or Inf")


def _call(f, what, args):
    """Abstract evaluation (shapes and dtypes only, nothing compiled) with a readable error."""
    try:
        return jax.eval_shape(f, *args)
    except Exception as e:  # surface the user's error with context
        raise ValueError(f"check_vjp: calling {what}(*args) failed: {type(e).__name__}: {e}") from e


def _check_outputs(out, ref_out) -> None:
    s1, s2 = jax.tree.structure(out), jax.tree.structure(ref_out)
    if s1 != s2:
        raise ValueError(f"check_vjp: fn and reference return different structures: fn -> {s1}, reference -> {s2}")
    for i, (a, b) in enumerate(zip(jax.tree.leaves(out), jax.tree.leaves(ref_out), strict=True)):
        if a.shape != b.shape:
            raise ValueError(f"check_vjp: output leaf {i}: fn returns shape {a.shape} but reference returns "
                             f"shape {b.shape}")
        for who, x in (("fn", a), ("reference", b)):
            if not jnp.issubdtype(x.dtype, jnp.inexact):
                raise TypeError(f"check_vjp: output leaf {i} of {who} has dtype {x.dtype}; only "
                                "floating outputs can carry a cotangent")


def _vjp(f, what, args, ct):
    """(output, gradients, pullback) of ``f`` at ``args``; the pullback is jit-compiled once and reused."""
    fwd_and_vjp = jax.jit(lambda a, c: (lambda y_pb: (y_pb[0], y_pb[1](c)))(jax.vjp(f, *a)))
    try:
        out, grads = fwd_and_vjp(args, ct)
    except Exception as e:
        raise VJPUnavailableError(f"check_vjp: {what} has no VJP: jax.vjp({what}) failed with "
                                  f"{type(e).__name__}: {e}") from e
    return out, grads, lambda c: fwd_and_vjp(args, c)[1]


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------
def _rng(seed: int, stream: int) -> np.random.Generator:
    # NumPy streams rather than jax.random: no compilation per new shape/dtype (~0.6 s each on CPU).
    return np.random.default_rng([seed, stream])


def _white_noise_like(tree, rng: np.random.Generator, dtype=None):
    leaves, treedef = jax.tree.flatten(tree)
    out = [jnp.asarray(rng.standard_normal(x.shape), dtype or x.dtype) for x in leaves]
    return jax.tree.unflatten(treedef, out)


def _fill_low_bits(tree, rng: np.random.Generator):
    """x * (1 + 2^-26 xi): the same point to f32 precision, with the mantissa bits below f32 populated."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [x * (1 + 2.0**-26 * jnp.asarray(rng.standard_normal(x.shape), x.dtype))
                                        for x in leaves])


def _to64(tree):
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), tree)


def _np64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def _normalized_error(a: np.ndarray, b: np.ndarray, m: np.ndarray) -> np.ndarray:
    tiny = 1e-300 + 1e-30 * float(np.max(m, initial=0.0))
    return np.abs(a - b) / (m + tiny)


def _rel_err(g: np.ndarray, r: np.ndarray) -> float:
    """Normwise relative error ||g - r|| / ||r|| (0 when both are zero, inf when only r is)."""
    rn, gn = float(np.linalg.norm(r)), float(np.linalg.norm(g))
    return float(np.linalg.norm(g - r)) / rn if rn > 0 else (0.0 if gn == 0 else math.inf)


def witness_limit(ref_rel_err: float, u_op: float) -> float:
    """The largest normwise relative error the rounding witness lets pass.

    ``max(W ref_rel_err, W u_op, floor)`` with ``W = WITNESS_FACTOR`` (100) and ``floor = WITNESS_FLOOR`` (0.01):

    * ``W ref_rel_err``: two correct implementations of the same math at the same precision round differently
      (summation order, blocking, fused vs separate casts) by small factors: correct VJPs of the planted catalogue
      measured <= 2.1x their reference (CPU, f32 and bf16); layout bugs 6e2x (bf16) .. 1e7x (f32) and more.
    * ``W u_op``: ``fn`` may compute more coarsely than the reference (a bf16 kernel behind f32 arrays, TF32 vs a
      reference that forces HIGHEST); ``u_op`` is the error model's precision, which the forward mismatch already
      raises to what fn really computes in. The seed CNN's TF32 weight gradients measured <= 1.1e-2 = 22 u_tf32 on
      an H100 (limit 0.049); bf16: 0.39.
    * ``floor``: accumulation-order differences with f32 accumulators grow like ``u_f32 sqrt(N)``, which reaches
      1% only at N ~ 3e10; layout bugs on white noise are O(1) (0.69..1.47 measured on the CNN).
    """
    return max(WITNESS_FACTOR * ref_rel_err, WITNESS_FACTOR * u_op, WITNESS_FLOOR)


def _leaf_result(name, run, g, r, m, model: prec.ErrorModel, n_terms: int, g_ref_lo=None,
                 kink=None) -> LeafResult:
    """Compare ``g`` with the float64 reference ``r`` (sum|terms| ``m``). ``g_ref_lo``: the reference's own
    gradient at the as-called dtypes/precision (the rounding witness), or ``None`` to skip the normwise gate.
    ``kink``: the absolute branch-flip term ``K`` (magnitude.py), or ``None``; an entry passes when
    ``|g - r| <= bound m + K``, i.e. ``m`` is replaced by ``m + K / bound`` throughout."""
    g, r, m = (np.asarray(x, np.float64) for x in (g, r, m))
    if kink is not None:
        # Per entry only. K is a worst case (every uncertain comparison flips, all in the same direction); summed
        # normwise it would swamp the witness (TF32 denoiser on an H100: ||K||/||g|| = 104 with 6% of the ReLUs
        # inside the radius), while the flips that really happen are few and random in sign (8 flips: 1.1e-2
        # normwise, Pallas conv, TF32), below the witness's 100 u_op.
        m = m + np.asarray(kink, np.float64) / model.bound(n_terms)
    diff = g - r
    rn, gn = float(np.linalg.norm(r)), float(np.linalg.norm(g))
    rel = _rel_err(g, r)
    cos = float(np.vdot(g.ravel(), r.ravel()) / (gn * rn)) if gn > 0 and rn > 0 else (1.0 if gn == rn else 0.0)
    maxg = float(np.max(np.abs(r), initial=0.0))
    maxabs = float(np.max(np.abs(diff), initial=0.0)) / maxg if maxg > 0 else float(np.max(np.abs(diff), initial=0))
    if np.any(~np.isfinite(g)):
        ne = np.full(g.shape, np.inf)
    else:
        ne = _normalized_error(g, r, m)
    worst = float(np.max(ne, initial=0.0))
    bound = model.bound(n_terms)
    passed = worst <= bound
    # The rounding witness: only where the reference's own low-precision gradient exists and is meaningful.
    ref_rel, limit, witness_ok = None, None, True
    if g_ref_lo is not None:
        g_ref_lo = np.asarray(g_ref_lo, np.float64)
        ref_rel = _rel_err(g_ref_lo, r) if np.all(np.isfinite(g_ref_lo)) else math.inf
        if rn > 0 and math.isfinite(ref_rel):
            limit = witness_limit(ref_rel, model.u_op)
            witness_ok = rel <= limit  # rel is inf (fails) for non-finite g
    if passed and witness_ok:
        verdict = "matches to rounding"
        diag = None
    elif not passed:
        d = diagnose(g, r, m, bound) if np.all(np.isfinite(g)) else None
        diag = d
        what = d.message if d is not None else "non-finite values"
        verdict = f"BUG: {worst:.2e}*sum|terms| is {worst / bound:.0f}x the rounding bound; {what}"
    else:
        # Every entry is within the (loose) per-entry bound, so diagnose against the witness's scale instead: a
        # transform explains the error when what remains is at most limit/rel_err of it (the rounding it allows).
        d = diagnose(g, r, m, min(bound, worst * limit / rel)) if np.all(np.isfinite(g)) else None
        diag = d
        what = d.message if d is not None else "non-finite values"
        verdict = (f"BUG (rounding witness): normwise {rel:.3g} = {_witness_ratio_text(rel, ref_rel)} the reference's "
                   f"own rounding ({ref_rel:.1e} at {model.precision}), above the witness limit {limit:.2g}; every "
                   f"entry is within the per-entry bound ({worst:.2e} <= {bound:.1e} x sum|terms|: this gradient is "
                   f"a cancelling sum, kappa {float(np.linalg.norm(m)) / rn:.1e}); {what}")
    worst_idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(ne)), ne.shape)) if ne.size else ()
    return LeafResult(name=name, run=run, shape=tuple(g.shape), rel_err=rel, max_abs_ratio=maxabs, cosine=cos,
                      normalized_err=worst, median_normalized_err=float(np.median(ne)) if ne.size else 0.0,
                      worst_index=worst_idx, bound=bound, bound_source=model.formula(), n_terms=n_terms,
                      kappa=float(np.linalg.norm(m)) / rn if rn > 0 else math.inf, passed=passed and witness_ok,
                      verdict=verdict, diagnosis=diag, ref_rel_err=ref_rel, witness_limit=limit,
                      witness_passed=witness_ok)


def _witness_ratio_text(rel: float, ref_rel: float | None) -> str:
    if ref_rel is None or ref_rel <= 0:
        return "infinitely many times (the reference is exact here)"
    return f"{rel / ref_rel:.1e}x"


def _directional_fd(loss, args64, leaf_index, v, steps):
    """Richardson-extrapolated central differences of ``loss`` along ``v`` on one leaf, for each step."""
    leaves, treedef = jax.tree.flatten(args64)
    x = leaves[leaf_index]
    scale = float(jnp.sqrt(jnp.mean(x * x))) or 1.0

    def at(h):
        new = list(leaves)
        new[leaf_index] = x + h * v
        return loss(*jax.tree.unflatten(treedef, new))

    out = []
    for rel_h in steps:
        h = rel_h * scale
        d_h = (at(h) - at(-h)) / (2 * h)
        d_h2 = (at(h / 2) - at(-h / 2)) / h
        out.append((rel_h, float((4 * d_h2 - d_h) / 3)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# check_vjp
# ---------------------------------------------------------------------------------------------------------------
def check_vjp(
    fn: Callable[..., Any],
    reference: Callable[..., Any],
    *args: Any,
    seed: int = 0,
    cotangent: Any = None,
    safety: float = 8.0,
    precision: str | None = None,
    float64: bool = True,
    fd: bool = True,
    fd_directions: int = 2,
    adjoint: bool = True,
    structural: bool = True,
    name: str | None = None,
    arg_names: Sequence[str] | None = None,
) -> VJPReport:
    """Verify ``fn``'s VJP against ``reference`` (plain JAX computing the same forward).

    Each gradient leaf of the as-called run passes two gates. Per entry: ``|g_i - g*_i| / sum|terms_i|`` within the
    rounding bound ``C (u_op + u_f32 sqrt(N))``. Normwise (the *rounding witness*): the reference's own VJP is run at
    the same dtypes, matmul-precision context and cotangent, and its normwise error ``ref_rel_err`` against the
    float64 oracle measures what rounding does to this gradient; the leaf fails when
    ``||g - g*|| / ||g*|| > max(100 ref_rel_err, 100 u_op, 0.01)`` (:func:`witness_limit`). The second gate catches
    layout bugs in gradients that are heavily cancelling sums (kappa 1e3..1e5), whose O(|g|) error divided by
    sum|terms| falls below the per-entry bound. If the reference cannot run as called, the witness is skipped with a
    note. The float64 re-run (when ``fn`` allows it) is judged per entry against the 1e-10 bound.

    Args:
      fn: the function under test (a ``jax.custom_vjp``, a Pallas-backed op, or any JAX function).
      reference: plain-JAX code computing the same forward; its autodiff VJP is the oracle.
      *args: arrays or pytrees of arrays, as a user would pass them; every leaf is differentiated and must be
        floating point (close over the rest with ``functools.partial``).
      seed: seeds the white-noise cotangent and the random directions.
      cotangent: the output cotangent (default: white noise in fn's output dtypes).
      safety: the constant C of the rounding model (see :mod:`jaxgrad.verify.precision`).
      precision: force the precision of the as-called run ("f32", "tf32", "f16", "bf16"); default: inferred.
      float64: also re-run ``fn`` in float64 when it allows it.
      fd, fd_directions: finite-difference checks (float64, per argument leaf).
      adjoint: the dot-product test ``<J t, c> = <t, J^T c>``.
      structural: zero / repeat / homogeneity / dtype checks of the VJP.
      name: label for the report.
      arg_names: names of the positional arguments for the report (default ``args[0]``, ``args[1]``, ...).

    Returns:
      A :class:`~jaxgrad.verify.report.VJPReport`; ``report.passed`` is the verdict, ``print(report)`` the table.
    """
    _validate_args(fn, reference, args)
    label = name or f"{getattr(fn, '__name__', 'fn')} vs {getattr(reference, '__name__', 'reference')}"
    names = _leaf_names(args, arg_names)
    arg_leaves = jax.tree.leaves(args)
    rng_ct, rng_dir, rng_adj, rng_fill = (_rng(seed, i) for i in range(4))

    out = _call(fn, "fn", args)
    ref_out = _call(reference, "reference", args)
    _check_outputs(out, ref_out)
    if cotangent is None:
        cotangent = _white_noise_like(out, rng_ct)  # out holds ShapeDtypeStructs: shapes and dtypes only
    elif jax.tree.structure(cotangent) != jax.tree.structure(out) or any(
            np.shape(c) != o.shape for c, o in zip(jax.tree.leaves(cotangent), jax.tree.leaves(out))):
        raise ValueError("check_vjp: 'cotangent' must have fn's output structure and shapes "
                         f"({jax.tree.map(lambda o: o.shape, out)})")

    # 2. fn as called (and the matmul precision it ran under, before the verifier forces HIGHEST below)
    out_lo, grads_lo, pullback_lo = _vjp(fn, "fn", args, cotangent)
    platform = prec.platform_precision()
    checks: list[Check] = []
    notes: list[str] = []
    # The rounding witness: the reference's own VJP under the same conditions (dtypes, matmul precision context,
    # cotangent), to measure what rounding alone does to this gradient at this precision.
    ref_grads_lo = None
    try:
        ct_ref = jax.tree.map(lambda c, o: jnp.asarray(c, o.dtype), cotangent, ref_out)
        _, ref_grads_lo, _ = _vjp(reference, "reference", args, ct_ref)
        ref_grads_lo = [_np64(g) for g in jax.tree.leaves(ref_grads_lo)]
        if len(ref_grads_lo) != len(arg_leaves):
            raise ValueError(f"the reference returns {len(ref_grads_lo)} gradient leaves for {len(arg_leaves)} "
                             "arguments")
    except Exception as e:  # the reference cannot run as called: per-entry gate only
        ref_grads_lo = None
        notes.append(f"rounding witness skipped: the reference's VJP at the as-called dtypes/precision failed "
                     f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); as-called gradients "
                     "are judged per entry only")

    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        args64 = _to64(args)
        ct64 = _to64(cotangent)

        # 1. oracle and magnitudes: forward outputs and gradients of the reference in one interpreted pass
        def ref_fwd_and_vjp(a, c):
            y, pb = jax.vjp(reference, *a)
            return y, pb(c)

        mags = magnitudes(ref_fwd_and_vjp, args64, ct64)
        n_out = len(jax.tree.leaves(out))
        ref_y = [np.asarray(v, np.float64) for v in mags.values[:n_out]]
        ref_g = [np.asarray(v, np.float64) for v in mags.values[n_out:]]
        m_y = [np.asarray(v, np.float64) for v in mags.magnitudes[:n_out]]
        m_g = [np.asarray(v, np.float64) for v in mags.magnitudes[n_out:]]
        n_y, n_g = mags.terms[:n_out], mags.terms[n_out:]
        if mags.approximated:
            notes.append("sum|terms| is approximate through: " + ", ".join(mags.approximated))

        def forward_error(y_list):
            errs = [float(np.max(_normalized_error(np.asarray(y, np.float64), r, m), initial=0.0))
                    for y, r, m in zip(y_list, ref_y, m_y)]
            return max(errs, default=0.0)

        # precision of the as-called run
        fwd_err_lo = forward_error([_np64(y) for y in jax.tree.leaves(out_lo)])
        dtypes = [jnp.result_type(x) for x in arg_leaves] + [jnp.result_type(y) for y in jax.tree.leaves(out_lo)]
        model_lo, forward_ok = prec.model_for(dtypes, fwd_err_lo, max(n_y, default=0), safety, precision,
                                              platform)
        checks.append(Check("forward (as called)", forward_ok,
                            f"max |y - y64|/sum|terms| = {fwd_err_lo:.2e} (bound {model_lo.bound(max(n_y, default=0)):.1e}"
                            f", {model_lo.precision})"
                            + ("" if forward_ok else " -- fn's forward disagrees with the reference: fix it first")))

        # Kinks: where the reference compares rounded values (ReLU's z > 0, max, knot tests on hidden values), the
        # run under test may take the other branch within its rounding radius; the per-entry bound then includes
        # the jump K (magnitude.py). A second interpreted pass, now that the run's precision is known.
        kink_g: list[np.ndarray | None] = [None] * len(names)
        if mags.rounded_comparisons:
            mk = magnitudes(ref_fwd_and_vjp, args64, ct64, kink_bound=model_lo.bound)
            counts = mk.kink_counts[n_out:]
            kink_g = [np.asarray(k, np.float64) if c else None for k, c in zip(mk.kinks[n_out:], counts)]
            if any(counts):
                notes.append(f"kinks: {mk.uncertain_comparisons} comparison entries "
                             f"({', '.join(mags.rounded_comparisons)}) have operands within {model_lo.precision} "
                             "rounding of each other, so the run may take the other branch there; the bound of the "
                             "gradient entries they feed (" + ", ".join(f"{nm} {c}/{int(np.size(m))}" for nm, c, m in
                                                                      zip(names, counts, m_g) if c)
                             + ") adds the jump between the branches")

        leaves_out: list[LeafResult] = []
        g_lo = [_np64(g) for g in jax.tree.leaves(grads_lo)]
        for i, nm in enumerate(names):
            leaves_out.append(_leaf_result(nm, model_lo.precision, g_lo[i], ref_g[i], m_g[i], model_lo, n_g[i],
                                           None if ref_grads_lo is None else ref_grads_lo[i], kink=kink_g[i]))

        # 3. float64 re-run
        # Run at a point whose values fill all 53 bits: bf16/f32-representable inputs make the products of a
        # low-precision kernel exact, which would pass its forward off as float64 while its backward is not.
        fn64_ok, grads64, f64_reason = False, None, "disabled (float64=False)"
        if float64:
            args64e, ct64e = _fill_low_bits(args64, rng_fill), _fill_low_bits(ct64, rng_fill)
            ref_y_e, ref_g_e, _ = _vjp(reference, "reference", args64e, ct64e)
            ref_g_e = [np.asarray(g, np.float64) for g in jax.tree.leaves(ref_g_e)]
            try:
                out64, grads64_tree, _ = _vjp(fn, "fn", args64e, ct64e)
                out64_leaves = jax.tree.leaves(out64)
                if any(jnp.result_type(y) != jnp.float64 for y in out64_leaves):
                    f64_reason = "fn returns lower precision for float64 inputs"
                else:
                    e64 = max((float(np.max(_normalized_error(np.asarray(y, np.float64), np.asarray(r), m),
                                            initial=0.0))
                               for y, r, m in zip(out64_leaves, jax.tree.leaves(ref_y_e), m_y)), default=0.0)
                    model64 = prec.f64_model(safety)
                    if e64 <= model64.bound(max(n_y, default=0)):
                        fn64_ok, grads64 = True, [np.asarray(g, np.float64) for g in jax.tree.leaves(grads64_tree)]
                        f64_reason = f"fn runs in float64: forward matches to {e64:.1e}*sum|terms|"
                    else:
                        f64_reason = (f"fn accepts float64 but computes coarser inside (forward mismatch "
                                      f"{e64:.1e}*sum|terms|): judged by the error model only")
            except Exception as e:  # the function refuses float64: error model only
                f64_reason = f"fn does not run in float64 ({type(e).__name__}): judged by the error model only"
        if fn64_ok:
            model64 = prec.f64_model(safety)
            for i, nm in enumerate(names):
                leaves_out.append(_leaf_result(nm, "f64", grads64[i], ref_g_e[i], m_g[i], model64, n_g[i]))

        # The float64 checks below run where the tested gradients were computed: the low-bit-filled point for the
        # float64 re-run, the caller's point for the as-called run.
        pt_args, pt_ct, pt_ref_g = (args64e, ct64e, ref_g_e) if fn64_ok else (args64, ct64, ref_g)

        # 4a. finite differences
        fd_fn = fn if fn64_ok else reference
        fd_on = "fn's float64 forward" if fn64_ok else "the reference's float64 forward"
        if fd:
            ct64_leaves = jax.tree.leaves(pt_ct)

            @jax.jit
            def loss(*a):
                ys = jax.tree.leaves(fd_fn(*a))
                return sum(jnp.vdot(c, y.astype(jnp.float64)) for c, y in zip(ct64_leaves, ys))

            for i, nm in enumerate(names):
                tested = grads64[i] if fn64_ok else g_lo[i]
                tol = FD_TOL if fn64_ok else max(FD_TOL, model_lo.bound(n_g[i]))
                worst_fn, worst_ref, best_h = 0.0, 0.0, None
                for d in range(fd_directions):
                    v = jnp.asarray(rng_dir.standard_normal(np.shape(arg_leaves[i])), jnp.float64)
                    vn = np.asarray(v)
                    scale = float(np.sum(m_g[i] * np.abs(vn))) or 1.0
                    fds = _directional_fd(loss, pt_args, i, v, FD_STEPS)
                    exact_fn = float(np.vdot(tested.ravel(), vn.ravel()))
                    exact_ref = float(np.vdot(pt_ref_g[i].ravel(), vn.ravel()))
                    errs = [(abs(dv - exact_fn) / scale, h) for h, dv in fds]
                    e_fn, h_fn = min(errs)
                    e_ref = min(abs(dv - exact_ref) / scale for _, dv in fds)
                    if e_fn >= worst_fn:
                        worst_fn, best_h = e_fn, h_fn
                    worst_ref = max(worst_ref, e_ref)
                which = "fn f64" if fn64_ok else f"fn {model_lo.precision}"
                checks.append(Check(f"finite differences {nm}", worst_fn <= tol,
                                    f"{which} VJP vs central FD on {fd_on}: {worst_fn:.1e} (tol {tol:.0e}, best "
                                    f"h={best_h:g}*rms); reference VJP vs FD: {worst_ref:.1e}"))
                if worst_ref > FD_TOL and worst_ref > 10 * worst_fn:
                    notes.append(f"{nm}: the reference's own VJP disagrees with finite differences ({worst_ref:.1e});"
                                 " the reference may be wrong (stop_gradient? custom rule?)")

        # 4b. adjoint (dot-product) test
        if adjoint:
            t = _white_noise_like(pt_args, rng_adj, jnp.float64)
            try:
                _, jt = jax.jvp(fn, tuple(pt_args), tuple(t))
                jvp_src = "fn's own JVP"
            except Exception:
                _, jt = jax.jvp(reference, tuple(pt_args), tuple(t))
                jvp_src = "the reference's JVP (fn has no forward mode)"
            lhs = sum(float(jnp.vdot(c, y)) for c, y in zip(jax.tree.leaves(pt_ct), jax.tree.leaves(jt)))
            tested = grads64 if fn64_ok else g_lo
            t_leaves = [np.asarray(x) for x in jax.tree.leaves(t)]
            rhs = sum(float(np.vdot(tl.ravel(), g.ravel())) for tl, g in zip(t_leaves, tested))
            scale = sum(float(np.sum(np.abs(tl) * m)) for tl, m in zip(t_leaves, m_g)) or 1.0
            err = abs(lhs - rhs) / scale
            tol = prec.f64_model(safety).bound(max(n_g, default=0)) if fn64_ok else model_lo.bound(max(n_g, default=0))
            checks.append(Check("adjoint <J t, c> = <t, J^T c>", err <= tol,
                                f"{'f64' if fn64_ok else model_lo.precision} VJP of fn against {jvp_src}: "
                                f"{err:.1e}*sum|terms| (tol {tol:.0e})"))

    # 5. structural checks (as called)
    if structural:
        checks.extend(_structural_checks(pullback_lo, cotangent, grads_lo, args, names, model_lo, n_g, m_g))

    # coverage notes
    notes.extend(_coverage_notes(names, arg_leaves))
    return VJPReport(name=label, passed=all(lf.passed for lf in leaves_out) and all(c.passed for c in checks),
                     leaves=leaves_out, checks=checks, precision=model_lo, float64_status=f64_reason,
                     notes=notes, environment=environment(), seed=seed)


def _structural_checks(pullback, ct, grads, args, names, model, n_g, m_g) -> list[Check]:
    out = []
    g_leaves = jax.tree.leaves(grads)
    bad = [f"{nm}: {np.shape(g)}/{jnp.result_type(g)} for {np.shape(a)}/{jnp.result_type(a)}"
           for nm, g, a in zip(names, g_leaves, jax.tree.leaves(args))
           if np.shape(g) != np.shape(a) or jnp.result_type(g) != jnp.result_type(a)]
    out.append(Check("cotangent shapes and dtypes", not bad, "; ".join(bad) or "every gradient has its primal's "
                                                                               "shape and dtype"))
    zero = pullback(jax.tree.map(jnp.zeros_like, ct))
    nz = [nm for nm, g in zip(names, jax.tree.leaves(zero)) if bool(jnp.any(g != 0))]
    out.append(Check("zero cotangent -> zero gradient", not nz, ("non-zero: " + ", ".join(nz)) if nz else "exact zeros"))
    again = jax.tree.leaves(pullback(ct))
    twice = jax.tree.leaves(pullback(jax.tree.map(lambda c: 2 * c, ct)))
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


def assert_vjp_matches(fn: Callable[..., Any], reference: Callable[..., Any], *args: Any, **options: Any) -> VJPReport:
    """chex-style assertion: raise ``AssertionError`` with the full report unless ``check_vjp`` passes."""
    report = check_vjp(fn, reference, *args, **options)
    if not report.passed:
        raise AssertionError("VJP check failed:\n" + str(report))
    return report
