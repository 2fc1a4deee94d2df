r"""Mixed-precision policy: the dtype parameters are stored in, the dtype the loss is computed in, the loss's dtype.

``Policy(param_dtype, compute_dtype, output_dtype)``: the optimiser updates parameters in ``param_dtype`` (keep it
float32/float64: an update smaller than half an ulp of a bf16 weight is lost); the loss function sees parameters
and floating batch leaves cast to ``compute_dtype``; the summed loss is cast to ``output_dtype`` before it is
reduced and divided. The cast is differentiable, so gradients arrive in ``param_dtype``
(:math:`\bar p = \mathrm{cast}_{param}(\bar p_{compute})`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = ("float64", "float32", "bfloat16", "float16")


def _dtype(name: str | None, field: str):
    if name is None:
        return None
    if str(name) not in DTYPES:
        raise ValueError(f"precision policy: '{field}' must be one of {DTYPES} or None, got {name!r}")
    return jnp.dtype(str(name))


@dataclasses.dataclass(frozen=True)
class Policy:
    """``None`` keeps what is there (the params' own dtype, the batch's dtype, the loss's dtype)."""

    param_dtype: str | None = None
    compute_dtype: str | None = None
    output_dtype: str | None = None

    def __post_init__(self):
        for f in ("param_dtype", "compute_dtype", "output_dtype"):
            _dtype(getattr(self, f), f)

    def cast_params(self, params):
        """Storage dtype (at init and after a transition)."""
        return _cast_floats(params, _dtype(self.param_dtype, "param_dtype"))

    def to_compute(self, tree):
        return _cast_floats(tree, _dtype(self.compute_dtype, "compute_dtype"))

    def to_output(self, x):
        dt = _dtype(self.output_dtype, "output_dtype")
        return x if dt is None else x.astype(dt)


def _cast_floats(tree, dtype):
    if dtype is None:
        return tree

    def cast(a):
        if isinstance(a, (jax.Array, np.ndarray)) and jnp.issubdtype(a.dtype, jnp.floating):
            return a.astype(dtype)
        return a

    return jax.tree.map(cast, tree)
