"""Reports of the verifier: a readable table for people, JSON for machines."""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
from typing import Any

import jax

from jaxgrad.verify.diagnose import Diagnosis
from jaxgrad.verify.precision import ErrorModel
from jaxgrad.verify.stats import LeafStatistics

__all__ = ["Check", "LeafResult", "VJPReport", "environment"]


def environment() -> dict[str, Any]:
    """Device, versions and the precision flags in force."""
    dev = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "default_matmul_precision": str(jax.config.jax_default_matmul_precision),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str
    undetermined: bool = False  # not passed, but no evidence of a bug either (stats.LeafStatistics.undetermined)


@dataclasses.dataclass(frozen=True)
class LeafResult:
    """How one gradient leaf compares with the float64 reference."""

    name: str  # argument leaf, e.g. "args[1]['w']"
    run: str  # "f64" for the float64 re-run, else the precision of the as-called run
    shape: tuple[int, ...]
    rel_err: float  # ||g - g*|| / ||g*||
    max_abs_ratio: float  # max|g - g*| / max|g*|
    cosine: float
    normalized_err: float  # max_i |g_i - g*_i| / sum|terms_i|  -- the gated quantity
    median_normalized_err: float
    worst_index: tuple[int, ...]
    bound: float
    bound_source: str
    n_terms: int
    kappa: float  # ||sum|terms| || / ||g*||: the normwise condition number of this gradient
    passed: bool  # both gates: per entry (normalized_err <= bound) and, for as-called rows, the statistics
    verdict: str
    diagnosis: Diagnosis | None
    # The modelled rounding (as-called rows only; None for float64 rows or where the reference cannot run as called):
    ref_rel_err: float | None = None  # RMS ||r_k|| / ||g*|| of the reference emulated at the run's precision
    stats: LeafStatistics | None = None  # the statistical verdict (stats.py)
    undetermined: bool = False  # not passed: at these inputs the run's precision does not determine the leaf

    @property
    def per_entry_passed(self) -> bool:
        return self.normalized_err <= self.bound

    @property
    def statistics_passed(self) -> bool:
        return self.stats is None or self.stats.passed

    @property
    def model_ratio(self) -> float | None:
        """rel_err / ref_rel_err: how far above the modelled rounding this gradient's normwise error is."""
        if self.ref_rel_err is None:
            return None
        return self.rel_err / self.ref_rel_err if self.ref_rel_err > 0 else float("inf")

    @property
    def diagnosis_kind(self) -> str | None:
        return self.diagnosis.kind if self.diagnosis is not None else None


def _fmt_table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [line(header), "  " + "  ".join("-" * w for w in widths), *[line(r) for r in rows]]


def _verdict_cell(lf: LeafResult) -> str:
    if lf.passed:
        return "matches to rounding"
    if not lf.per_entry_passed:
        return f"BUG ({lf.normalized_err / lf.bound:.1e}x bound)"
    if lf.undetermined:
        return "UNDETERMINED (jumps)"
    return "BUG (statistics: " + ", ".join(lf.stats.failed) + ")"


@dataclasses.dataclass(frozen=True)
class VJPReport:
    """The result of :func:`jaxgrad.verify.check_vjp`. ``passed`` is the verdict; ``str(report)`` the table."""

    name: str
    passed: bool
    leaves: list[LeafResult]
    checks: list[Check]
    precision: ErrorModel
    float64_status: str
    notes: list[str]
    environment: dict[str, Any]
    seed: int
    # Wall seconds per stage of check_vjp, compilation included (jaxgrad.verify.cost; "total" the whole call)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    # The precision of the forward and of each gradient read from fn's own program (program_precision.py):
    # (output, description); empty where the program could not be read
    program_precision: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def leaf(self, name: str, run: str | None = None) -> LeafResult:
        """The result for an argument leaf (by its name or a suffix of it, e.g. ``"[1]"``)."""
        for lf in self.leaves:
            if (lf.name == name or lf.name.endswith(name)) and (run is None or lf.run == run):
                return lf
        raise KeyError(f"no leaf {name!r} (run={run}) in report; leaves: {[lf.name for lf in self.leaves]}")

    def as_called(self, name: str) -> LeafResult:
        """The as-called row of an argument leaf, at whatever precision it was judged (each gradient is judged at
        its own program's precision: :mod:`jaxgrad.verify.program_precision`)."""
        for lf in self.leaves:
            if (lf.name == name or lf.name.endswith(name)) and lf.run != "f64":
                return lf
        raise KeyError(f"no as-called leaf {name!r} in report; leaves: {[lf.name for lf in self.leaves]}")

    @property
    def failures(self) -> list[LeafResult]:
        return [lf for lf in self.leaves if not lf.passed]

    @property
    def undetermined(self) -> bool:
        """Not passed, and everything that did not pass is undetermined rather than wrong: the inputs do not
        determine the function at the precision it runs in (choose a better-conditioned point)."""
        bad = self.failures + [c for c in self.checks if not c.passed]
        return (not self.passed) and bool(bad) and all(x.undetermined for x in bad)

    def __str__(self) -> str:
        env = self.environment
        out = [f"check_vjp: {self.name}",
               f"  environment: {env['device']} ({env['backend']}), jax {env['jax']}, "
               f"default matmul precision {env['default_matmul_precision']}, seed {self.seed}",
               f"  as called: precision {self.precision.precision} -- {self.precision.source}",
               f"  float64 re-run: {self.float64_status}",
               *([f"  precision read from fn's program (coarsest rounding on the way to each output):"]
                 + [f"    {name}: {desc}" for name, desc in self.program_precision] if self.program_precision else []),
               "  gradients vs the float64 reference (error per entry divided by its sum of |terms|):"]
        rows = [[lf.name, "x".join(map(str, lf.shape)) or "()", lf.run, f"{lf.rel_err:.2e}",
                 "-" if lf.ref_rel_err is None else f"{lf.ref_rel_err:.1e}", f"{lf.cosine:.6f}",
                 f"{lf.normalized_err:.2e}", str(lf.n_terms), f"{lf.bound:.1e}", _verdict_cell(lf)]
                for lf in self.leaves]
        out += _fmt_table(["leaf", "shape", "run", "rel.err(norm)", "model rel.err", "cosine", "max err/sum|t|", "N",
                           "bound", "verdict"], rows)
        sources = {lf.run: lf.bound_source for lf in self.leaves}
        out.append("  bound = " + "; ".join(f"{run} run: {src}" for run, src in sources.items())
                   + "  (N: longest accumulation behind the gradient)")
        with_stats = [lf for lf in self.leaves if lf.stats is not None]
        if with_stats:
            st0 = with_stats[0].stats
            out.append(f"  statistics (each row at its run's precision; the reference emulated at that precision "
                       f"at {st0.replicas} perturbed points is the rounding the run should have; false-alarm rate "
                       f"{st0.alpha:g} per leaf under that model; model rel.err = its RMS normwise error):")
            out += [f"    {lf.name}: {lf.stats.summary()}" for lf in with_stats]
        if self.failures:
            out.append("  diagnosis:")
            out += [f"    - {lf.name} ({lf.run}): "
                    + (lf.verdict if lf.per_entry_passed or not lf.diagnosis else lf.diagnosis.message)
                    for lf in self.failures]
        out.append("  checks:")
        out += [f"    [{'ok' if c.passed else 'FAIL'}] {c.name}: {c.detail}" for c in self.checks]
        if self.notes:
            out.append("  notes:")
            out += [f"    - {n}" for n in self.notes]
        if self.passed:
            out.append("  VERDICT: PASS -- every gradient matches the reference to rounding")
        elif self.undetermined:
            out.append("  VERDICT: UNDETERMINED -- at these inputs the rounding of " + self.precision.precision
                       + " may move " + ", ".join([lf.name for lf in self.failures] + [c.name for c in self.checks
                                                                                      if not c.passed])
                       + " by as much as its size (branch flips, saturated softmax): nothing can be told from "
                       "rounding here; no bug was found. Verify at better-conditioned inputs.")
        else:
            bad = [f"{lf.name} ({lf.run}{'' if not lf.per_entry_passed else ', statistics'})"
                   for lf in self.failures] + [c.name for c in self.checks if not c.passed]
            out.append("  VERDICT: FAIL -- " + ", ".join(bad))
        if self.timings:
            out.append("  time (s, compilation included): "
                       + ", ".join(f"{k} {v:.2f}" for k, v in self.timings.items()))
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["precision"] = {"precision": self.precision.precision, "safety": self.precision.safety,
                          "source": self.precision.source}
        return d

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), default=str, **kwargs)
