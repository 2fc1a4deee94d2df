r"""``check_vjp``: prove a backward pass, or say which gradient is wrong and how.

Procedure (each step is what the report shows):

1. **Oracle.** The reference's VJP in float64 at HIGHEST precision, at the caller's arguments and a white-noise
   cotangent :math:`\bar y`. Alongside, the sum of |terms| :math:`M_i` of every gradient entry and forward output
   (:mod:`jaxgrad.verify.magnitude`).
2. **As called.** ``fn``'s VJP in the caller's dtypes and the platform's default precision. Its precision is not
   assumed: each hypothesis (f32, TF32, bf16; f16 where asked) is tested, finest first, by running the reference
   *at* that precision (operands of every product rounded, :mod:`jaxgrad.verify.emulate`) at K perturbed points,
   and the finest one whose rounding explains ``fn``'s forward is adopted (:mod:`jaxgrad.verify.hypothesis`); a
   caller may state it (``precision="tf32"``) and the claim is checked. Each gradient leaf then passes two gates:
   per entry, ``|g_i - g*_i| / sum|terms_i|`` within ``C (u_op + u_f32 sqrt(N))``
   (:mod:`jaxgrad.verify.precision`); and **statistically** (:mod:`jaxgrad.verify.stats`), its error must be
   distributed like those K samples of rounding -- normwise, in its projection on the true gradient (a scale or
   sign bias), per entry and per slice (a border row, a stale column) -- with thresholds from the model and a
   stated false-alarm rate.
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

The steps live beside this module: the arguments and the host-side draws in :mod:`jaxgrad.verify.inputs`, the
per-leaf gate and verdict in :mod:`jaxgrad.verify.leaves`, finite differences, the adjoint and the structural checks
in :mod:`jaxgrad.verify.ground_truth`; :func:`check_vjp` runs them in this order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.verify import cost
from jaxgrad.verify import precision as prec
from jaxgrad.verify.ground_truth import (FD_STEPS, FD_TOL, _coverage_notes, _structural_checks, adjoint_check,
                                         finite_difference_checks, same_function_check)
from jaxgrad.verify.hypothesis import candidate_precisions, float64_oracle, sample_rounding
from jaxgrad.verify.inputs import (_call, _check_outputs, _fill_low_bits, _leaf_names, _rng, _to64, _validate_args,
                                   _validate_options, _white_noise_like)
from jaxgrad.verify.leaves import _leaf_result, _normalized_error, _rel_err, norm2
from jaxgrad.verify.magnitude import magnitudes
from jaxgrad.verify.program_precision import coarser, program_precisions
from jaxgrad.verify.report import Check, LeafResult, VJPReport, environment
from jaxgrad.verify.stats import leaf_statistics, replicas_for

__all__ = ["VJPUnavailableError", "assert_vjp_matches", "check_vjp"]
# importable from here too: norm2 (chex_helpers), _leaf_result and _rel_err (the statistics tests), FD_STEPS, FD_TOL


class VJPUnavailableError(TypeError):
    """``fn`` cannot be differentiated in reverse mode (no VJP rule)."""


def _vjp(f, what, args, ct, internal: bool = False):
    """(output, gradients, pullback) of ``f`` at ``args``; the pullback is compiled once and reused.

    The program is compiled ahead of time, and ``pullback.compiled`` is that executable (``.as_text()``: XLA's
    optimized HLO), so reading the program costs no second compilation; a cotangent of other types than ``ct``
    (a Python scalar's weak type, say) recompiles. ``internal``: a program of the verifier's own (the float64
    re-run), compiled with :data:`jaxgrad.verify.cost.COMPILER_OPTIONS`; else as the user's code is."""
    jit = cost.jit if internal else jax.jit
    fwd_and_vjp = jit(lambda a, c: (lambda y_pb: (y_pb[0], y_pb[1](c)))(jax.vjp(f, *a)))
    try:
        compiled = fwd_and_vjp.lower(args, ct).compile()
        out, grads = compiled(args, ct)
    except Exception as e:
        raise VJPUnavailableError(f"check_vjp: {what} has no VJP: jax.vjp({what}) failed with "
                                  f"{type(e).__name__}: {e}") from e

    def pullback(c):
        try:
            return compiled(args, c)[1]
        except TypeError:  # not the types it was compiled for
            return fwd_and_vjp(args, c)[1]

    pullback.compiled = compiled
    return out, grads, pullback


def _program_precision(f, args, ct, platform: str, notes: list[str], compiled=None):
    """The precision of each flat output of ``f``'s forward and VJP as called (forward outputs, then gradients),
    from its jaxpr and XLA's optimized HLO (:mod:`jaxgrad.verify.program_precision`); None, with a note, where the
    program cannot be read (the forward's precision then stands for every gradient)."""
    try:
        text = compiled.as_text() if compiled is not None else None  # the as-called program: not compiled again
        return program_precisions(lambda a, c: (lambda y_pb: (y_pb[0], y_pb[1](c)))(jax.vjp(f, *a)), args, ct,
                                  platform=platform, hlo_text=text)
    except Exception as e:  # a program the analysis cannot read: judged as before, at the forward's precision
        notes.append(f"the precision of each gradient could not be read from fn's program ({type(e).__name__}: "
                     f"{str(e).splitlines()[0][:120] if str(e) else ''}); every gradient is judged at the forward's")
        return None



class _Not64(Exception):
    """fn's forward returns less than float64 for float64 inputs (found abstractly, nothing compiled)."""


def _abstract_forward(fn, args):
    """fn's outputs as shapes and dtypes at ``args`` (nothing compiled); an empty list where that fails (the
    compiled run then raises the error the report names)."""
    try:
        return jax.eval_shape(fn, *args)
    except Exception:  # noqa: BLE001 - reported by the compiled run below
        return []


def _np64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)



# ---------------------------------------------------------------------------------------------------------------
# check_vjp
# ---------------------------------------------------------------------------------------------------------------
def _timed(check):
    """``check``'s report with ``timings``: wall seconds per stage (:mod:`jaxgrad.verify.cost`) and the total."""
    @functools.wraps(check)
    def wrapper(*args, **kwargs):
        with cost.recording() as times:
            t0 = time.perf_counter()
            report = check(*args, **kwargs)
            times["total"] = time.perf_counter() - t0
        return dataclasses.replace(report, timings=dict(times))
    return wrapper


@_timed
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
    replicas: int | None = None,
) -> VJPReport:
    """Verify ``fn``'s VJP against ``reference`` (plain JAX computing the same forward).

    Each gradient leaf of the as-called run passes two gates. Per entry: ``|g_i - g*_i| / sum|terms_i|`` within the
    rounding bound ``C (u_op + u_f32 sqrt(N))``. Statistically (:func:`jaxgrad.verify.stats.leaf_statistics`): the
    error must be distributed like the rounding of the reference run at the adopted precision (module doc, step 2):
    norm, scale bias, entries and slices, each at a false-alarm rate derived from the model. If the reference cannot
    run at the caller's dtypes, the statistics are skipped with a note. The float64 re-run (when ``fn`` allows it)
    is judged per entry against the 1e-10 bound.

    Args:
      fn: the function under test (a ``jax.custom_vjp``, a Pallas-backed op, or any JAX function).
      reference: plain-JAX code computing the same forward; its autodiff VJP is the oracle.
      *args: arrays or pytrees of arrays, as a user would pass them; every leaf is differentiated and must be
        floating point (close over the rest with ``functools.partial``).
      seed: seeds the white-noise cotangent and the random directions.
      cotangent: the output cotangent (default: white noise in fn's output dtypes).
      safety: the constant C of the rounding model (see :mod:`jaxgrad.verify.precision`).
      precision: the compute precision of ``fn`` ("f32", "tf32", "f16", "bf16"); checked against its forward.
        Default: the finest precision whose rounding explains the forward.
      float64: also re-run ``fn`` in float64 when it allows it.
      fd, fd_directions: finite-difference checks (float64, per argument leaf).
      adjoint: the dot-product test ``<J t, c> = <t, J^T c>``.
      structural: zero / repeat / homogeneity / dtype checks of the VJP.
      name: label for the report.
      arg_names: names of the positional arguments for the report (default ``args[0]``, ``args[1]``, ...).
      replicas: K, the number of rounding samples of the statistical verdict (at least 8). Default: 16, or 32 when
        every gradient and output leaf has at most 4096 entries (:func:`jaxgrad.verify.stats.replicas_for`).

    Returns:
      A :class:`~jaxgrad.verify.report.VJPReport`; ``report.passed`` is the verdict, ``print(report)`` the table.
    """
    _validate_args(fn, reference, args)
    _validate_options(seed, safety, fd, fd_directions, replicas)
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
    cost.lap("setup")

    # 2. fn as called (and the matmul precision it ran under, before the verifier forces HIGHEST below)
    out_lo, grads_lo, pullback_lo = _vjp(fn, "fn", args, cotangent)
    jax.block_until_ready((out_lo, grads_lo))
    cost.lap("as called")
    platform = prec.platform_precision()
    checks: list[Check] = []
    notes: list[str] = []
    prog = _program_precision(fn, args, cotangent, platform[0], notes, getattr(pullback_lo, "compiled", None))
    cost.lap("program precision")
    ct_ref = jax.tree.map(lambda c, o: c if jnp.result_type(c) == o.dtype else
                          jax.device_put(np.asarray(c).astype(o.dtype)), cotangent, ref_out)

    def ref_fwd_and_vjp(a, c):
        y, pb = jax.vjp(reference, *a)
        return y, pb(c)

    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        args64 = _to64(args)
        ct64 = _to64(cotangent)

        # 1. oracle and magnitudes: forward outputs and gradients of the reference in one interpreted pass
        mags = magnitudes(ref_fwd_and_vjp, args64, ct64)
        n_out = len(jax.tree.leaves(out))
        ref_y = [np.asarray(v, np.float64) for v in mags.values[:n_out]]
        ref_g = [np.asarray(v, np.float64) for v in mags.values[n_out:]]
        m_y = [np.asarray(v, np.float64) for v in mags.magnitudes[:n_out]]
        m_g = [np.asarray(v, np.float64) for v in mags.magnitudes[n_out:]]
        n_y, n_g = mags.terms[:n_out], mags.terms[n_out:]
        if mags.approximated:
            notes.append("sum|terms| is approximate through: " + ", ".join(mags.approximated))
    cost.lap("magnitudes")

    # precision of the as-called run: test each hypothesis, finest first (hypothesis.py); never the looser one to
    # explain a mismatch
    y_lo = [_np64(y) for y in jax.tree.leaves(out_lo)]
    g_lo = [_np64(g) for g in jax.tree.leaves(grads_lo)]
    dtypes = [jnp.result_type(x) for x in arg_leaves] + [jnp.result_type(y) for y in jax.tree.leaves(out_lo)]
    tried: list[str] = []
    results = []  # (p, model, samples, kinks, kink pass, forward statistics) per hypothesis
    oracle = float64_oracle(ref_fwd_and_vjp)
    candidates = candidate_precisions(dtypes, precision)
    def hypothesis(p, record=True):
        """(p, model, samples, kinks, kink magnitudes, forward statistics) of one precision hypothesis; samples None
        where no statistics exist (a float64 run, or a reference that cannot run at the as-called dtypes).
        ``record``: a hypothesis about the forward (listed in the report's "tested"), not a gradient's own."""
        model_p = prec.ErrorModel(p, safety, "")
        kinks = [None] * (n_out + len(names))
        mk = None
        if mags.rounded_comparisons:
            with jax.enable_x64(True), jax.default_matmul_precision("highest"):
                mk = magnitudes(ref_fwd_and_vjp, args64, ct64, kink_bound=model_p.bound)
            kinks = [np.asarray(k, np.float64) if c else None for k, c in zip(mk.kinks, mk.kink_counts)]
        if p == "f64":  # called in float64: rounding is settled by the float64 bound itself, no statistics needed
            return (p, model_p, None, kinks, mk, [])
        try:
            k = replicas if replicas is not None else replicas_for(max(int(np.size(a)) for a in [*y_lo, *g_lo]))
            samples = sample_rounding(ref_fwd_and_vjp, args, ct_ref, p, k, _rng(seed, 10 + len(tried)), oracle)
        except Exception as e:  # the reference cannot run at the as-called dtypes: per-entry gate only
            notes.append(f"statistical verdict skipped: the reference at the as-called dtypes failed "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); as-called "
                         "gradients are judged per entry only")
            return (p, model_p, None, kinks, mk, [])
        fwd_stats = [leaf_statistics(y - r, s, r, p, kinks[j]) for j, (y, r, s) in
                     enumerate(zip(y_lo, ref_y, samples.errors[:n_out]))]
        ratio = max((st.norm_ratio for st in fwd_stats), default=1.0)
        if record:
            tried.append(f"{p}: " + (f"agrees, error {ratio:.2g}x its rounding" if all(st.passed for st in fwd_stats)
                                     else "; ".join(st.failure_text() for st in fwd_stats if not st.passed)))
        return (p, model_p, samples, kinks, mk, fwd_stats)

    for ci, p in enumerate(candidates):
        h = hypothesis(p)
        if h[2] is None:
            results = [h]
            break
        fwd_stats = h[5]
        ratio = max((st.norm_ratio for st in fwd_stats), default=1.0)
        results.append(h)
        # The next hypothesis rounds u_next/u_p times more; it can explain the forward better (in log scale) only if
        # this one's error ratio is above the geometric mean of the two: otherwise stop here.
        if all(st.passed for st in fwd_stats) and ci + 1 < len(candidates) and \
                ratio <= math.sqrt(prec.UNIT_ROUNDOFF[candidates[ci + 1]] / prec.UNIT_ROUNDOFF[p]):
            break
    # Adopt the hypothesis whose rounding explains the forward best (error closest to 1x its modelled rounding in
    # log scale) among those the forward passes; never the looser one because it is looser. None passes: the
    # finest, whose forward test then fails the verdict.
    agreeing = [r for r in results if r[5] and all(st.passed for st in r[5])]
    chosen = min(agreeing, key=lambda r: abs(math.log(max(max(st.norm_ratio for st in r[5]), 1e-30)))) \
        if agreeing else results[0]
    p, model_p, samples, kinks, mk, fwd_stats = chosen
    forward_ok = all(st.passed for st in fwd_stats)
    forward_undetermined = forward_ok and any(st.undetermined for st in fwd_stats)
    stated = "stated by the caller" if precision is not None else "the precision whose rounding explains the " \
                                                                    "forward best"
    source = (f"{stated} (tested: {' | '.join(tried)})" if samples is not None else stated) + \
        f"; platform default: {platform[0]}"
    model_lo = prec.ErrorModel(p, safety, source)
    fwd_detail = "; ".join(f"{st.summary()}" for st in fwd_stats) if fwd_stats else "not tested"
    checks.append(Check("forward (as called)", forward_ok and not forward_undetermined,
                        f"{p}: {fwd_detail}" + ("" if forward_ok else
                                                " -- fn's forward disagrees with the reference beyond the rounding "
                                                f"of {p}: fix it first")
                        + (" -- undetermined: " + "; ".join(st.undetermined_text() for st in fwd_stats
                                                            if st.undetermined) if forward_undetermined else ""),
                        undetermined=forward_undetermined))
    if samples is not None and samples.not_emulated:
        notes.append("operands inside " + ", ".join(sorted(samples.not_emulated)) + " were not rounded by the "
                     "precision emulation: the modelled rounding is too small there")
    if mk is not None and any(mk.kink_counts[n_out:]):
        counts = mk.kink_counts[n_out:]
        notes.append(f"kinks: {mk.uncertain_comparisons} comparison or exp entries "
                     f"({', '.join(mags.rounded_comparisons)}) have operands within {p} rounding of each other (or an "
                     "exp argument whose rounding moves it by a factor e or more), so the run may take the other "
                     "branch there; "
                     "the bound of the gradient entries they feed (" + ", ".join(
                         f"{nm} {c}/{int(np.size(m))}" for nm, c, m in zip(names, counts, m_g) if c)
                     + ") adds the jump between the branches")

    def judge_leaves(p, model, samples, kinks, only=None) -> list[LeafResult]:
        out = []
        for i, nm in enumerate(names):
            if only is not None and i not in only:
                out.append(None)
                continue
            st, rel_model = None, None
            if samples is not None:
                r_i = samples.errors[n_out + i]
                st = leaf_statistics(g_lo[i] - ref_g[i], r_i, ref_g[i], p, kinks[n_out + i])
                gn = norm2(ref_g[i])
                rel_model = float(np.sqrt(np.mean([norm2(rk) ** 2 for rk in r_i]))) / gn if gn > 0 else None
            out.append(_leaf_result(nm, p, g_lo[i], ref_g[i], m_g[i], model, n_g[i], st, kink=kinks[n_out + i],
                                    modelled_rel=rel_model))
        return out

    def hypothesis_at(q):
        return chosen if q == chosen[0] else (next((r for r in results if r[0] == q), None) or
                                                hypothesis(q, record=False))

    def judge_each(leaf_prec, source_of) -> list[LeafResult]:
        """Each leaf at its own precision (``leaf_prec[i]``), against that hypothesis' rounding samples."""
        out: list[LeafResult | None] = [None] * len(names)
        for q in dict.fromkeys(leaf_prec):
            hq = hypothesis_at(q)
            idx = {i for i, qi in enumerate(leaf_prec) if qi == q}
            for i, lf in enumerate(judge_leaves(q, prec.ErrorModel(q, safety, source_of(q)), hq[2], hq[3], idx)):
                if lf is not None:
                    out[i] = lf
        return out

    # 2b. each gradient's own precision, from the program that computed it (program_precision.py): a gradient is
    # judged at the coarser of the adopted precision and the precision its own program rounds to, never finer.
    leaf_prec = [p] * len(names)
    if precision is None and p != "f64" and prog is not None:
        leaf_prec = [coarser(p, prog[n_out + i].judged) or p for i in range(len(names))]
        for i, q in enumerate(leaf_prec):
            if q != p and hypothesis_at(q)[2] is None:  # the reference cannot run there: the adopted one
                leaf_prec[i] = p
    program_lines = []
    if prog is not None:
        program_lines = [("forward", prog[0].describe() if n_out == 1 else
                          "; ".join(o.describe() for o in prog[:n_out]))]
        program_lines += [(nm, prog[n_out + i].describe() + (f" -- judged at {leaf_prec[i]}, not the forward's {p}"
                                                               if leaf_prec[i] != p else ""))
                          for i, nm in enumerate(names)]
        if any(q != p for q in leaf_prec):
            notes.append("gradients judged at their own program's precision, coarser than the forward's " + p + ": "
                         + ", ".join(f"{nm} {q}" for nm, q in zip(names, leaf_prec) if q != p))
        excess = [nm for nm, o in zip(["forward"] * n_out + list(names), prog) if o.excess]
        if excess:
            notes.append("XLA kept a finer precision than fn asks for (excess precision) on the way to "
                         + ", ".join(dict.fromkeys(excess)) + ": judged at fn's own, the coarser")

    def source_of(q):
        return source if q == p else source + f"; {q}: the precision of the gradient's own program"

    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        leaves_out: list[LeafResult] = judge_each(leaf_prec, source_of)
        # The forward does not fix the backward's precision: cuDNN and cuBLAS pick the algorithm of every product
        # separately, so a conv whose forward ran exactly in f32 may take its weight gradient in TF32, the platform's
        # default. When the forward agrees with both, the gradients decide between them: the finer one is kept
        # unless only the platform default explains them (never a precision coarser than the platform default).
        q = platform[0]
        if (precision is None and samples is not None and forward_ok and any(not lf.passed for lf in leaves_out)
                and q in candidates and prec.UNIT_ROUNDOFF[q] > prec.UNIT_ROUNDOFF[p]):
            hq = next((r for r in results if r[0] == q), None) or hypothesis(q)
            if hq[2] is not None and hq[5] and all(st.passed for st in hq[5]):
                model_q = prec.ErrorModel(q, safety, source + f"; the gradients only agree with {q}, the "
                                          f"platform default, which the forward also agrees with: judged as {q}")
                prec_q = [coarser(q, qi) for qi in leaf_prec]
                leaves_q = judge_each(prec_q, lambda r: model_q.source)
                if all(lf.passed or lf.undetermined for lf in leaves_q):
                    p, model_p, samples, kinks, mk, fwd_stats = hq
                    model_lo, leaves_out, leaf_prec = model_q, leaves_q, prec_q
                    notes.append(f"the forward agrees with {chosen[0]} and {q}; the gradients only with {q} (the "
                                 "platform's default for f32 products: the backward may run another algorithm than "
                                 f"the forward): judged as {q}")

        # An undetermined forward (fed by a saturated exp: its test passes on the jumps under every hypothesis) does
        # not tell which precision fn computes in. A leaf that fails at the adopted precision but agrees with a
        # coarser hypothesis (whose forward also agrees) is then undetermined: neither a pass (that would adopt the
        # looser precision to explain it) nor a bug (fn may round that coarsely).
        if precision is None and samples is not None and forward_undetermined and \
                any(not lf.passed and not lf.undetermined for lf in leaves_out):
            for q in [c for c in candidates if prec.UNIT_ROUNDOFF[c] > prec.UNIT_ROUNDOFF[p]]:
                hq = next((r for r in results if r[0] == q), None) or hypothesis(q)
                if hq[2] is None or not (hq[5] and all(st.passed for st in hq[5])):
                    continue
                leaves_q = judge_each([coarser(q, qi) for qi in leaf_prec], lambda r: source)
                leaves_out = [dataclasses.replace(
                    lf, undetermined=True,
                    verdict=f"UNDETERMINED: fails at {p} but agrees with {q}, and the forward (undetermined: a "
                            "saturated softmax) cannot tell which of them fn computes in")
                    if not lf.passed and not lf.undetermined and (lq.passed or lq.undetermined) else lf
                    for lf, lq in zip(leaves_out, leaves_q)]

        cost.lap("precision and statistics")
        # 3a. the float64 runs compute the function called: the reference's emulated rounding against its float64
        # run (the oracle), and fn as called against fn in float64 at the caller's (exactly representable) inputs
        fn_same = None
        if p != "f64":
            q = functools.reduce(coarser, [prec.dtype_precision(d) for d in dtypes], p)
            if samples is not None:
                checks.append(same_function_check(
                    "the reference", f"{p} (emulated, at {samples.errors[0].shape[0]} perturbed points)",
                    samples.errors[:n_out], [0.0] * n_out, m_y, n_y, kinks[:n_out], q, replicas=True))
            if float64 and all(y.dtype == jnp.float64 for y in jax.tree.leaves(_abstract_forward(fn, args64))):
                try:
                    y64_fn = [_np64(y) for y in jax.tree.leaves(cost.jit(fn)(*args64))]
                except Exception:  # noqa: BLE001 - fn refuses float64: the re-run below says so
                    y64_fn = None
                if y64_fn is not None:  # at the coarsest rounding fn's own program shows on its way to the outputs
                    q_fn = functools.reduce(coarser, [o.judged for o in prog[:n_out]], q) if prog is not None else q
                    fn_same = same_function_check("fn", p, y_lo, y64_fn, m_y, n_y, kinks[:n_out], q_fn)
        # 3. float64 re-run
        # Run at a point whose values fill all 53 bits: bf16/f32-representable inputs make the products of a
        # low-precision kernel exact, which would pass its forward off as float64 while its backward is not.
        fn64_ok, grads64, f64_reason = False, None, "disabled (float64=False)"
        if float64:
            args64e, ct64e = _fill_low_bits(args64, rng_fill), _fill_low_bits(ct64, rng_fill)
            # the reference's float64 VJP: the program of the replicas' oracle (float64_oracle keeps one per function)
            ref_e = float64_oracle(ref_fwd_and_vjp)(args64e, ct64e)
            ref_y_e, ref_g_e = ref_e[:n_out], ref_e[n_out:]
            try:
                # fn's output dtypes decide without compiling anything: a forward that returns less than float64
                # for float64 inputs (a Pallas kernel of f32 / bf16) is not re-run
                if any(y.dtype != jnp.float64 for y in jax.tree.leaves(_abstract_forward(fn, args64e))):
                    raise _Not64
                out64, grads64_tree, _ = _vjp(fn, "fn", args64e, ct64e, internal=True)
                out64_leaves = jax.tree.leaves(out64)
                if any(jnp.result_type(y) != jnp.float64 for y in out64_leaves):
                    f64_reason = "fn returns lower precision for float64 inputs"
                else:
                    e64 = max((float(np.max(_normalized_error(np.asarray(y, np.float64), np.asarray(r), m),
                                            initial=0.0))
                               for y, r, m in zip(out64_leaves, ref_y_e, m_y)), default=0.0)
                    model64 = prec.f64_model(safety)
                    if e64 <= model64.bound(max(n_y, default=0)):
                        fn64_ok, grads64 = True, [np.asarray(g, np.float64) for g in jax.tree.leaves(grads64_tree)]
                        f64_reason = f"fn runs in float64: forward matches to {e64:.1e}*sum|terms|"
                    else:
                        f64_reason = (f"fn accepts float64 but computes coarser inside (forward mismatch "
                                      f"{e64:.1e}*sum|terms|): judged by the error model only")
            except _Not64:
                f64_reason = "fn returns lower precision for float64 inputs"
            except Exception as e:  # the function refuses float64: error model only
                f64_reason = f"fn does not run in float64 ({type(e).__name__}): judged by the error model only"
        if fn64_ok:
            model64 = prec.f64_model(safety)
            for i, nm in enumerate(names):
                leaves_out.append(_leaf_result(nm, "f64", grads64[i], ref_g_e[i], m_g[i], model64, n_g[i]))

        # fn's float64 run is evidence (a failing check) only where it is used: the float64 re-run, finite
        # differences and the adjoint below; else the as-called run is judged against the reference alone (a note)
        if fn_same is not None and (fn64_ok or fn_same.passed):
            checks.append(fn_same)
        elif fn_same is not None:
            notes.append(fn_same.detail.split("; a value inside")[0] + " (not used: the as-called run is judged "
                         "against the reference alone); a value inside fn that does not come from its inputs "
                         "depends on the dtype, e.g. a random draw or a constant in the default dtype")
        cost.lap("float64 re-run")
        # The float64 checks below run where the tested gradients were computed: the low-bit-filled point for the
        # float64 re-run, the caller's point for the as-called run.
        pt_args, pt_ct, pt_ref_g = (args64e, ct64e, ref_g_e) if fn64_ok else (args64, ct64, ref_g)

        # 4a. finite differences
        tested = grads64 if fn64_ok else g_lo
        if fd:
            tols = [FD_TOL if fn64_ok else max(FD_TOL, model_lo.bound(n)) for n in n_g]
            fd_checks, fd_notes = finite_difference_checks(
                fn if fn64_ok else reference, "fn's float64 forward" if fn64_ok else "the reference's float64 forward",
                "fn f64" if fn64_ok else f"fn {model_lo.precision}", pt_args, pt_ct, names, tested, pt_ref_g, m_g,
                tols, fd_directions, rng_dir)
            checks += fd_checks
            notes += fd_notes

        cost.lap("finite differences")
        # 4b. adjoint (dot-product) test
        if adjoint:
            tol = prec.f64_model(safety).bound(max(n_g, default=0)) if fn64_ok else model_lo.bound(max(n_g, default=0))
            checks.append(adjoint_check(fn, reference, pt_args, pt_ct, tested, m_g, tol,
                                        "f64" if fn64_ok else model_lo.precision, rng_adj))

    cost.lap("adjoint")
    # 5. structural checks (as called)
    if structural:
        checks.extend(_structural_checks(pullback_lo, cotangent, grads_lo, args, names, model_lo, n_g, m_g))
    cost.lap("structural")

    # coverage notes
    notes.extend(_coverage_notes(names, arg_leaves))
    cost.lap("notes")
    return VJPReport(name=label, passed=all(lf.passed for lf in leaves_out) and all(c.passed for c in checks),
                     leaves=leaves_out, checks=checks, precision=model_lo, float64_status=f64_reason,
                     notes=notes, environment=environment(), seed=seed, program_precision=program_lines)


def assert_vjp_matches(fn: Callable[..., Any], reference: Callable[..., Any], *args: Any, **options: Any) -> VJPReport:
    """chex-style assertion: raise ``AssertionError`` with the full report unless ``check_vjp`` passes."""
    report = check_vjp(fn, reference, *args, **options)
    if not report.passed:
        raise AssertionError("VJP check failed:\n" + str(report))
    return report
