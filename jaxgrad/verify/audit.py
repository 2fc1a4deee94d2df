"""The seed's three proposed checks as one audit.

1. **The float64 re-run** and the rounding model, at several problem sizes (:func:`check_vjp` at each).
2. **Error vs problem size**: rounding grows slowly with the size (at most like sqrt(N)); a bug does not shrink.
3. **One optimizer step compared**: the parameters after one optax step driven by fn's gradients vs by the float64
   reference's, the way a user would first notice a wrong backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxgrad.verify.core import check_vjp
from jaxgrad.verify.report import Check, VJPReport, _fmt_table

__all__ = ["AuditReport", "audit"]


@dataclasses.dataclass(frozen=True)
class AuditReport:
    name: str
    sizes: list[Any]
    reports: list[VJPReport]
    trend: list[Check]
    optimizer: Check
    passed: bool

    def __str__(self) -> str:
        out = [f"audit: {self.name}"]
        rows = []
        for size, rep in zip(self.sizes, self.reports):
            for lf in rep.leaves:
                rows.append([str(size), lf.name, lf.run, f"{lf.normalized_err:.2e}", f"{lf.bound:.1e}",
                             f"{lf.rel_err:.2e}", f"{lf.kappa:.1f}", "ok" if lf.passed else "FAIL"])
        out += _fmt_table(["size", "leaf", "run", "max err/sum|t|", "bound", "rel.err(norm)", "kappa", ""], rows)
        out.append("  checks:")
        for size, rep in zip(self.sizes, self.reports):
            bad = [c for c in rep.checks if not c.passed]
            out.append(f"    [{'ok' if not bad else 'FAIL'}] size {size}: {len(rep.checks) - len(bad)}/"
                       f"{len(rep.checks)} FD/adjoint/structure checks pass"
                       + ("" if not bad else " -- failed: " + ", ".join(c.name for c in bad)))
        for c in [*self.trend, self.optimizer]:
            out.append(f"    [{'ok' if c.passed else 'FAIL'}] {c.name}: {c.detail}")
        failing = [f"size {s}: {lf.name} ({lf.run}): {lf.verdict}" for s, r in zip(self.sizes, self.reports)
                   for lf in r.failures]
        if failing:
            out.append("  failures:")
            out += [f"    - {f}" for f in failing]
        out.append(f"  VERDICT: {'PASS' if self.passed else 'FAIL'}")
        return "\n".join(out)


def _size_trend(sizes, reports) -> list[Check]:
    """Rounding stays under its bound at every size; a bug's normwise error does not shrink as the size grows."""
    checks = []
    names = [lf.name for lf in reports[0].leaves if lf.run != "f64"]
    for name in names:
        leaves = [r.leaf(name, run=r.precision.precision) for r in reports]
        ok = all(lf.passed for lf in leaves)
        rel = [lf.rel_err for lf in leaves]
        series = ", ".join(f"{s}: {lf.normalized_err:.1e} ({lf.normalized_err / lf.bound:.2g} of bound)"
                           for s, lf in zip(sizes, leaves))
        if ok:
            detail = f"rounding-sized at every size: {series}"
        elif rel[-1] >= 0.5 * rel[0]:
            detail = ("does not shrink with size (normwise " + ", ".join(f"{s}: {e:.2g}" for s, e in zip(sizes, rel))
                      + "): a bug, not rounding")
        else:
            detail = f"above the bound but shrinking: {series}; look at the small sizes"
        checks.append(Check(f"error vs size {name}", ok, detail))
    return checks


def _optimizer_step(fn, reference, args, optimizer, seed, reports) -> Check:
    out = fn(*args)
    key = jax.random.key(seed + 1)
    leaves, treedef = jax.tree.flatten(out)
    ct = jax.tree.unflatten(treedef, [jax.random.normal(k, np.shape(y), jnp.result_type(y))
                                      for k, y in zip(jax.random.split(key, len(leaves)), leaves)])
    g_fn = jax.vjp(fn, *args)[1](ct)
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        a64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), args)
        c64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), ct)
        g_ref = jax.vjp(reference, *a64)[1](c64)
        g_fn64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), g_fn)
        p_ref = optax.apply_updates(a64, optimizer.update(g_ref, optimizer.init(a64), a64)[0])
        p_fn = optax.apply_updates(a64, optimizer.update(g_fn64, optimizer.init(a64), a64)[0])
        step = float(optax.tree.norm(jax.tree.map(lambda p, q: p - q, p_ref, a64)))
        diff = float(optax.tree.norm(jax.tree.map(lambda p, q: p - q, p_fn, p_ref)))
    rel = diff / step if step > 0 else (0.0 if diff == 0 else float("inf"))
    rep = reports[0]
    run = rep.precision.precision
    tol = max(lf.bound * lf.kappa for lf in rep.leaves if lf.run == run)
    return Check("one optimizer step", rel <= tol,
                 f"params after one step with fn's gradients vs the float64 reference's: ||dp||/||step|| = "
                 f"{rel:.2e} (tol {tol:.1e} = bound x kappa)")


def audit(
    fn: Callable[..., Any],
    reference: Callable[..., Any],
    make_args: Callable[[jax.Array, Any], tuple],
    sizes: Sequence[Any],
    *,
    optimizer: optax.GradientTransformation | None = None,
    seed: int = 0,
    name: str | None = None,
    **check_options: Any,
) -> AuditReport:
    """Run :func:`check_vjp` at each size, the size trend, and one optimizer step.

    Args:
      fn, reference: as for :func:`check_vjp`.
      make_args: ``(key, size) -> tuple of args``; should draw white noise with asymmetric shapes.
      sizes: increasing problem sizes (whatever ``make_args`` understands).
      optimizer: optax transformation for the step comparison (default ``optax.sgd(1e-2)``: its update is the
        gradient itself, so the comparison is not blurred by Adam's sign-like first step).
    """
    if not sizes:
        raise ValueError("audit: 'sizes' must name at least one problem size")
    optimizer = optimizer or optax.sgd(1e-2)
    label = name or f"{getattr(fn, '__name__', 'fn')} vs {getattr(reference, '__name__', 'reference')}"
    reports, arg_sets = [], []
    for i, size in enumerate(sizes):
        args = tuple(make_args(jax.random.key(seed + 1000 * i), size))
        arg_sets.append(args)
        reports.append(check_vjp(fn, reference, *args, seed=seed, name=f"{label} @ {size}", **check_options))
    trend = _size_trend(list(sizes), reports)
    opt = _optimizer_step(fn, reference, arg_sets[0], optimizer, seed, reports)
    passed = all(r.passed for r in reports) and all(c.passed for c in trend) and opt.passed
    return AuditReport(name=label, sizes=list(sizes), reports=reports, trend=trend, optimizer=opt, passed=passed)
