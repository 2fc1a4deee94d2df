r"""The rounding-error model that separates bugs from rounding.

For a gradient entry :math:`g_i` with sum of |terms| :math:`M_i` (:mod:`jaxgrad.verify.magnitude`) and an
accumulation chain of :math:`N` additions, a correct computation satisfies, with high probability,

.. math::

    |\hat g_i - g_i| \le C\,\bigl(u_{\text{op}} + u_{\text{acc}}\sqrt{N}\bigr)\,M_i

* :math:`u_{\text{op}}`: unit roundoff of the operands and stored intermediates — 2^-24 (f32), 2^-11 (TF32:
  tensor-core operands keep 10 mantissa bits; also f16), 2^-8 (bf16), 2^-53 (f64).
* :math:`u_{\text{acc}}`: unit roundoff of the accumulator (f32 for every low-precision path on GPU and CPU, f64 in
  the float64 re-run). :math:`\sqrt{N}` is the probabilistic growth of a long sum (Higham & Mary, SISC 2019);
  blocked/pairwise sums as in GEMM, cuDNN and XLA grow more slowly, so this is conservative.
* :math:`C` (``safety``, default 8) absorbs the constant of the probabilistic bound and a few chained roundings.

Calibration (measured on an H100 and an H200 for the seed's 3-layer CNN, per gradient entry, divided by
:math:`M_i`): exact f32 <= 3.4e-6 at N = 2.1e6, TF32 <= 6.4e-4, every simulated layout or missing-term bug >=
0.075. The model's bounds for that N are 9e-4 (f32) and 4.6e-3 (TF32), and 3.2e-2 for bf16 at small N: all above
rounding and below every bug. A systematic bug smaller than that (a 1e-4 scale) is caught by the float64 re-run,
whose bound is 1e-10.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

__all__ = ["ErrorModel", "UNIT_ROUNDOFF", "LADDER", "dtype_precision", "f64_model", "model_for"]

UNIT_ROUNDOFF = {"f64": 2.0**-53, "f32": 2.0**-24, "tf32": 2.0**-11, "f16": 2.0**-11, "bf16": 2.0**-8}
# Precisions a low-precision run may have, finest first. (f16 shares TF32's unit roundoff.)
LADDER = ("f32", "tf32", "bf16")
F64_FLOOR = 1e-10  # the float64 re-run: any normalized error above this is a bug, not rounding


@dataclasses.dataclass(frozen=True)
class ErrorModel:
    """Bound on |error| / sum|terms| for one precision."""

    precision: str  # "f64", "f32", "tf32", "f16" or "bf16"
    safety: float
    source: str  # why this precision was assumed

    @property
    def u_op(self) -> float:
        return UNIT_ROUNDOFF[self.precision]

    @property
    def u_acc(self) -> float:
        return UNIT_ROUNDOFF["f64"] if self.precision == "f64" else UNIT_ROUNDOFF["f32"]

    def bound(self, n_terms: int) -> float:
        b = self.safety * (self.u_op + self.u_acc * math.sqrt(max(int(n_terms), 1)))
        return max(b, F64_FLOOR) if self.precision == "f64" else b

    def formula(self) -> str:
        if self.precision == "f64":
            return f"max({self.safety:g}*2^-53*(1+sqrt(N)), 1e-10)"
        return f"{self.safety:g}*(2^{round(math.log2(self.u_op))} + 2^-24*sqrt(N))"


def dtype_precision(dtype) -> str:
    """Precision name of a floating dtype."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float64:
        return "f64"
    if dtype == jnp.bfloat16:
        return "bf16"
    if dtype == jnp.float16:
        return "f16"
    return "f32"


def _coarser(a: str, b: str) -> str:
    return a if UNIT_ROUNDOFF[a] >= UNIT_ROUNDOFF[b] else b


def platform_precision() -> tuple[str, str]:
    """The precision f32 dots and convs get by default on the current platform, and why."""
    setting = jax.config.jax_default_matmul_precision
    if jax.default_backend() == "gpu" and setting in (None, "default", "bfloat16", "tensorfloat32", "fastest"):
        return "tf32", f"JAX's default f32 matmul/conv precision on GPU is TF32 (jax_default_matmul_precision={setting})"
    return "f32", f"f32 dots are exact on {jax.default_backend()} (jax_default_matmul_precision={setting})"


def f64_model(safety: float) -> ErrorModel:
    return ErrorModel("f64", safety, "float64 re-run of fn against the float64 reference")


def model_for(dtypes, forward_error: float, forward_terms: int, safety: float,
              override: str | None = None, platform: tuple[str, str] | None = None) -> tuple[ErrorModel, bool]:
    """Pick the error model of a low-precision run.

    The prior is the coarsest of the arrays' dtypes and the platform's default matmul precision; the forward
    mismatch against the float64 reference then reveals whether the function computes more coarsely than that
    (a bf16 kernel behind f32 arguments, say).

    ``platform`` is :func:`platform_precision` read where ``fn`` ran (default: now). Read it outside any
    ``default_matmul_precision`` context the verifier itself opens.

    Returns:
      (model, forward_ok): ``forward_ok`` is False when the forward mismatch exceeds even the bf16 bound — the
      forward itself is wrong, not rounded.
    """
    if override is not None:
        if override not in UNIT_ROUNDOFF:
            raise ValueError(f"check_vjp: precision must be one of {sorted(UNIT_ROUNDOFF)}, got {override!r}")
        return ErrorModel(override, safety, "given by the caller (precision=...)"), True
    prior, why = "f32", "float32 arrays"
    names = sorted({dtype_precision(d) for d in dtypes})
    for name in names:
        if name != "f64":
            prior = _coarser(prior, name)
    if prior != "f32":
        why = f"{prior} arrays"
    plat, plat_why = platform if platform is not None else platform_precision()
    if UNIT_ROUNDOFF[plat] > UNIT_ROUNDOFF[prior]:
        prior, why = plat, plat_why
    if forward_error > ErrorModel("bf16", safety, "").bound(forward_terms):
        return ErrorModel("bf16", safety, f"forward mismatch {forward_error:.1e}*sum|terms| exceeds every rounding "
                                          "model"), False
    # The coarsest precision whose unit roundoff the forward error reaches (within a factor 16): forward errors
    # sit near u/2 per rounding, so a bf16 kernel shows >= ~1e-3, TF32 >= ~1e-4, exact f32 ~1e-7. Erring coarse
    # only loosens the bound, which stays below the ~0.075 of real bugs.
    revealed = next((p for p in reversed(LADDER) if forward_error >= UNIT_ROUNDOFF[p] / 16), "f32")
    if UNIT_ROUNDOFF[revealed] > UNIT_ROUNDOFF[prior]:
        # A finer precision p explains the mismatch too when it is within p's worst case, ~2 u_p per entry (both
        # operands of every product rounded): say so rather than claim the coarse one (a TF32 run at 0.65 u_tf32
        # would otherwise read as "bf16 compute").
        finer = [p for p in LADDER if UNIT_ROUNDOFF[prior] <= UNIT_ROUNDOFF[p] < UNIT_ROUNDOFF[revealed]
                 and forward_error <= 2 * UNIT_ROUNDOFF[p]]
        if finer:
            return ErrorModel(revealed, safety, f"forward mismatch {forward_error:.1e}*sum|terms| = "
                                                f"{forward_error / UNIT_ROUNDOFF[finer[0]]:.2g} u_{finer[0]} is "
                                                f"consistent with {finer[0]} or {revealed} compute; judged as "
                                                f"{revealed}, the looser bound (arrays suggested {prior})"), True
        return ErrorModel(revealed, safety, f"forward mismatch {forward_error:.1e}*sum|terms| reveals {revealed} "
                                            f"compute (arrays suggested {prior})"), True
    return ErrorModel(prior, safety, f"{why}; forward mismatch {forward_error:.1e}*sum|terms| agrees"), True
