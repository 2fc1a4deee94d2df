"""What a verdict costs: ``check_vjp`` reports its time per stage, and the work it compiles stays bounded.

The cost of a verdict on a GPU is mostly XLA compilation (several times slower per program than on the CPU), so the
number of programs a ``check_vjp`` compiles is what these tests pin down (docs/verify.md, "The cost of a verdict";
``scripts/verify_cost.py`` measures the yardstick block).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrad.verify import check_vjp


def _op(x, w):
    return jnp.tanh(x @ w) * 2.0


def _args(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((6, 5)), dtype), jnp.asarray(rng.standard_normal((5, 3)), dtype))


def test_the_report_says_where_the_time_went():
    report = check_vjp(_op, _op, *_args())
    assert report.passed
    t = report.timings
    for stage in ("setup", "as called", "magnitudes", "replicas", "replicas' float64 oracle",
                  "precision and statistics", "float64 re-run", "finite differences", "adjoint", "structural",
                  "total"):
        assert stage in t and t[stage] >= 0.0, stage
    # the stages are disjoint parts of the call (the kink pass, where it runs, is one of them)
    parts = sum(v for k, v in t.items() if k != "total")
    assert parts <= t["total"] * 1.001 + 1e-3
    assert parts >= 0.9 * t["total"]
    assert str(report).splitlines()[-1].startswith("  time (s, compilation included): setup ")
