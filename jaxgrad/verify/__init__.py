"""jaxgrad.verify: prove a backward pass correct, or say which gradient is wrong and how.

Public API:

* :func:`check_vjp` -- compare a function's VJP with a plain-JAX reference, in float64 and against a rounding-error
  model; returns a :class:`VJPReport` (``report.passed``, ``print(report)``).
* :func:`assert_vjp_matches` -- the same, raising ``AssertionError`` with the report (for tests).
* :func:`audit` -- check_vjp at several problem sizes plus one optimizer step compared.
* :func:`magnitudes` -- the sum of |terms| of every output entry of any JAX function.
"""

from jaxgrad.verify.audit import AuditReport, audit
from jaxgrad.verify.core import VJPUnavailableError, assert_vjp_matches, check_vjp
from jaxgrad.verify.magnitude import magnitudes
from jaxgrad.verify.report import VJPReport

__all__ = ["AuditReport", "VJPReport", "VJPUnavailableError", "assert_vjp_matches", "audit", "check_vjp",
           "magnitudes"]
