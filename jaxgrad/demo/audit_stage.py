"""Stage 1 of ``jaxgrad demo``: verify the package's hand-written backward passes (custom VJPs).

The same cases and the same verifier as ``jaxgrad audit`` (:func:`jaxgrad.ops.registry.all_audit_cases`,
:func:`jaxgrad.verify.audit`), at the plan's smallest sizes. Each op's gradient is compared with JAX's autodiff of
its plain-JAX reference in float64; it passes when its error is within the modelled float32 rounding.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from jaxgrad.demo.plan import DemoPlan


@dataclasses.dataclass(frozen=True)
class OpVerdict:
    """One op's audit: ``worst`` is its largest error as a fraction of the rounding bound (< 1 passes)."""

    name: str
    passed: bool
    worst: float
    sizes: list
    seconds: float
    table: str  # the full report (``str(AuditReport)``), for verdicts.txt


@dataclasses.dataclass(frozen=True)
class AuditResult:
    verdicts: tuple[OpVerdict, ...]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts)

    @property
    def n_failed(self) -> int:
        return sum(not v.passed for v in self.verdicts)


def worst_fraction_of_bound(report) -> float:
    """Largest ``error / bound`` of an :class:`~jaxgrad.verify.audit.AuditReport` over the leaf rows whose per-entry
    bound can fail (the number ``jaxgrad audit`` prints in its summary); nan where every row's bound is vacuous and
    the statistics decide."""
    return report.worst_fraction_of_bound


def selected_cases(plan: DemoPlan) -> list:
    """The registry's audit cases the plan names (every case when ``plan.audit_ops`` is ``None``); a name matches
    a case whose name contains it, as with ``jaxgrad audit --op``."""
    from jaxgrad.ops.registry import all_audit_cases

    cases = all_audit_cases()
    if plan.audit_ops is None:
        return list(cases)
    chosen = [c for c in cases if any(op in c.name for op in plan.audit_ops)]
    if len(chosen) < len(plan.audit_ops):
        raise ValueError(f"demo plan {plan.name!r}: 'audit_ops' {plan.audit_ops} names an op that is not in the "
                         f"registry ({', '.join(c.name for c in cases)})")
    return chosen


def run_audit(plan: DemoPlan, on_verdict: Callable[[OpVerdict, int, int], None] = lambda v, i, n: None,
              seed: int = 0) -> AuditResult:
    """Audit the plan's ops; ``on_verdict(verdict, i, n)`` is called as each op finishes (console progress)."""
    from jaxgrad.verify import audit

    t_all = time.perf_counter()
    cases = selected_cases(plan)
    verdicts = []
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        sizes = list(case.sizes[:plan.audit_sizes])
        rep = audit(case.fn, case.reference, case.make_args, sizes, name=case.name, seed=seed,
                    arg_names=case.arg_names)
        v = OpVerdict(name=case.name, passed=bool(rep.passed), worst=float(worst_fraction_of_bound(rep)),
                      sizes=sizes, seconds=time.perf_counter() - t0, table=str(rep))
        verdicts.append(v)
        on_verdict(v, i, len(cases))
    return AuditResult(verdicts=tuple(verdicts), seconds=time.perf_counter() - t_all)
