"""jaxgrad.verify: prove a backward pass correct, or say which gradient is wrong and how.

Public API:

* :func:`check_vjp` -- compare a function's VJP with a plain-JAX reference, in float64 and against a rounding-error
  model; returns a :class:`VJPReport` (``report.passed``, ``print(report)``).
* :func:`assert_vjp_matches` -- the same, raising ``AssertionError`` with the report (for tests).
* :func:`audit` -- check_vjp at several problem sizes plus the error-vs-size trend.
* :func:`magnitudes` -- the sum of |terms| of every output entry of any JAX function.
* :func:`assert_tree_matches_reference` -- a pytree against a float64 reference, each entry to its rounding bound
  (for chex suites; :func:`reference_bounds` computes the tolerances once, :func:`value_and_vjp` wraps an op).
"""

from jaxgrad.verify.audit import AuditReport, audit
from jaxgrad.verify.chex_helpers import assert_tree_matches_reference, reference_bounds, value_and_vjp
from jaxgrad.verify.core import VJPUnavailableError, assert_vjp_matches, check_vjp
from jaxgrad.verify.magnitude import magnitudes
from jaxgrad.verify.report import VJPReport

__all__ = ["AuditReport", "VJPReport", "VJPUnavailableError", "assert_vjp_matches", "assert_tree_matches_reference",
           "audit", "check_vjp", "magnitudes", "reference_bounds", "value_and_vjp"]
