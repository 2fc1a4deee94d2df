r"""Which precision does ``fn`` compute in? Test each hypothesis; adopt the finest one its forward agrees with.

A low-precision run cannot be re-run in float64, so its verdict rests on a model of the rounding it should have,
and the model depends on the precision. The old rule -- take the coarsest precision that the forward mismatch
*could* reveal -- let a wrong gradient pass by loosening the bound until it fit. Here each hypothesis ``p`` is
tested instead, finest first (``f32``, ``tf32``, ``bf16``; ``f16`` only when the arrays are f16 or the caller says
so): the reference is run at ``p`` (:func:`jaxgrad.verify.emulate.at_precision`) at ``K`` perturbed points, and
``fn``'s forward error must be distributed like those samples (:func:`jaxgrad.verify.stats.leaf_statistics`: norm,
scale, entries, slices). The first ``p`` whose forward passes is adopted, and the gradients must then agree with
*that* ``p``; a coarser precision is never adopted to explain a gradient. A caller who knows the kernel's precision
states it (``check_vjp(..., precision="tf32")``), and the claim is checked the same way: a forward that rounds more
than the stated precision fails.

The arrays' dtypes set the finest candidate (bf16 arrays cannot compute finer than bf16); the platform's default
matmul precision (TF32 on a GPU) is reported but no longer assumed: a kernel that forces exact f32 dots is judged as
f32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.verify import cost
from jaxgrad.verify.emulate import at_precision, perturb_host
from jaxgrad.verify.magnitude import evaluate
from jaxgrad.verify.precision import UNIT_ROUNDOFF, dtype_precision

__all__ = ["RoundingSamples", "candidate_precisions", "float64_oracle", "sample_rounding"]

_LADDER = ("f32", "tf32", "bf16")


def candidate_precisions(dtypes: Sequence[Any], stated: str | None = None) -> list[str]:
    """The hypotheses to test, finest first: the stated one alone, else those no finer than the arrays allow."""
    if stated is not None:
        if stated not in ("f64", "f32", "tf32", "f16", "bf16"):
            raise ValueError(f"check_vjp: precision must be one of 'f32', 'tf32', 'f16', 'bf16' (the compute "
                             f"precision of fn), got {stated!r}")
        return [stated]
    names = {dtype_precision(d) for d in dtypes}
    if names == {"f64"}:
        return ["f64"]  # a float64 run: its own rounding, nothing coarser to hypothesise
    names -= {"f64"}
    floor = max(names, key=lambda p: UNIT_ROUNDOFF[p], default="f32")
    if floor == "f16":
        return ["f16", "bf16"]
    return [p for p in _LADDER if UNIT_ROUNDOFF[p] >= UNIT_ROUNDOFF[floor]]


@dataclasses.dataclass
class RoundingSamples:
    """``errors[j]``: ``[K, *shape]`` samples of the rounding error of flat output ``j`` (forward outputs, then
    gradients) of the reference run at ``precision``, each against the float64 oracle at its own point."""

    precision: str
    errors: list[np.ndarray]
    not_emulated: set[str]


def float64_oracle(fwd_and_vjp: Callable[..., Any]) -> Callable[..., list[np.ndarray]]:
    """``(args, ct) -> flat float64 outputs`` of ``fwd_and_vjp`` at HIGHEST precision.

    The values come from the magnitude program of ``fwd_and_vjp`` at those shapes
    (:func:`jaxgrad.verify.magnitude.evaluate`: the reference's own operations, with their sums of |terms| beside),
    compiled once for the magnitudes of ``check_vjp`` and shared by the oracle at the replicas' points and by the
    float64 re-run: one compilation, not three."""

    def oracle(args, ct):
        with jax.enable_x64(True), jax.default_matmul_precision("highest"):
            return [np.asarray(v, np.float64) for v in evaluate(fwd_and_vjp, _host64(args), _host64(ct))]

    return oracle


def _host64(tree):
    """Every leaf in float64, converted on the host (exact from any narrower float; no device program per dtype)."""
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) and x.dtype == jnp.float64
                        else np.asarray(x).astype(np.float64), tree)


def sample_rounding(fwd_and_vjp: Callable[..., Any], args: tuple, ct: Any, precision: str, replicas: int,
                    rng: np.random.Generator, oracle: Callable[..., list[np.ndarray]] | None = None
                    ) -> RoundingSamples:
    """K rounding-error samples of ``fwd_and_vjp(args, ct)`` (returning ``(outputs, gradients)``) at ``precision``.

    The emulated runs use the caller's dtypes; the oracle (:func:`float64_oracle`, shared across hypotheses) runs
    in float64 at HIGHEST precision at the same perturbed points.
    """
    oracle = oracle or float64_oracle(fwd_and_vjp)
    # The emulated runs see exactly the caller's dtypes: x64 off unless the caller passed float64 (in x64 mode a
    # dtype-less jnp.zeros inside the reference would be float64 and promote the whole computation).
    any64 = any(jnp.result_type(x) == jnp.float64 for x in jax.tree.leaves((args, ct)))
    with jax.enable_x64(any64), cost.stage("replicas"):
        emulated, loops = at_precision(fwd_and_vjp, precision, args, ct, reorder=True)
        points = [(perturb_host(args, precision, rng), perturb_host(ct, precision, rng)) for _ in range(replicas)]
        seeds = rng.integers(0, 2**31 - 1, size=replicas)
        low = emulated.replicas(seeds, points)  # per flat output, [K, *shape]: K runs of one compiled program
    with cost.stage("replicas' float64 oracle"):
        high = [oracle(a, c) for a, c in points]
    errors = [lo - np.stack([hi[j] for hi in high]) for j, lo in enumerate(low)]
    return RoundingSamples(precision, errors, loops)
