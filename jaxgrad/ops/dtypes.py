"""The dtype the ops compute in."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["compute_dtype"]


def compute_dtype(dtype) -> jnp.dtype:
    """``promote_types(dtype, float32)``: float32 for bf16, f16 and f32 inputs, float64 for float64 ones (the
    verifier's re-run). The dtype of every op's accumulators, statistics and saved row quantities (``lse``, ``rstd``);
    the outputs are rounded once to the input dtype."""
    return jnp.promote_types(dtype, jnp.float32)
