r"""What the magnitude interpreter knows of one value, and the classes of primitives it dispatches on.

Shared by :mod:`jaxgrad.verify.magnitude` (sum of |terms| ``M``, accumulation length ``N``) and
:mod:`jaxgrad.verify.kinks` (uncertain comparisons, their jumps ``K``, the first-order error ``E``, sign certainty).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Primitives that are linear in each floating operand separately with non-negative coefficients once the magnitudes
# are non-negative: applying the primitive to the magnitudes gives the magnitude. (sub/neg are handled separately.)
_MULTILINEAR = {
    "add", "add_any", "mul", "dot_general", "conv_general_dilated", "reduce_sum", "broadcast_in_dim", "reshape",
    "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice", "dynamic_update_slice", "gather",
    "concatenate", "pad", "rev", "select_n", "convert_element_type", "copy", "copy_p", "reduce_precision",
    "cumsum", "scatter-add", "scatter_add", "real", "reduce_window_sum", "split", "sharding_constraint",
    "optimization_barrier", "device_put",
}
_NEGATING = {"sub", "neg"}  # magnitudes add; applied as add / identity
_REDUCE_SELECT = {"reduce_max", "reduce_min", "cummax", "cummin"}  # one selected term: take the largest magnitude
_ELEMENTWISE_SELECT = {"max", "min"}  # likewise, elementwise
# Pure data movement: the output is exact when every floating input is (an input, a literal, or data moved from them).
_DATA_MOVEMENT = {
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice",
    "dynamic_update_slice", "gather", "concatenate", "pad", "rev", "select_n", "copy", "copy_p", "real", "split",
    "sharding_constraint", "optimization_barrier", "device_put",
}
_PRODUCTS = {"mul", "dot_general", "conv_general_dilated"}  # bilinear: K(ab) = K(a)|b| + |a|K(b)
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr", "custom_lin": None}




def is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _contraction_size(prim: str, params: dict, invals: Sequence[Any]) -> int:
    if prim == "dot_general":
        (lhs_contract, _), _ = params["dimension_numbers"]
        return int(np.prod([invals[0].shape[d] for d in lhs_contract], dtype=np.int64)) if lhs_contract else 1
    if prim == "conv_general_dilated":
        dn = params["dimension_numbers"]
        rhs = invals[1].shape
        rhs_spec = dn.rhs_spec  # (out feature, in feature, spatial...)
        return int(rhs[rhs_spec[1]] * np.prod([rhs[d] for d in rhs_spec[2:]], dtype=np.int64))
    if prim in ("reduce_sum", "reduce_window_sum"):
        axes = params.get("axes", ())
        if axes:
            return int(np.prod([invals[0].shape[a] for a in axes], dtype=np.int64))
        return int(np.prod(params.get("window_dimensions", (1,)), dtype=np.int64))
    if prim == "cumsum":
        return int(invals[0].shape[params["axis"]])
    if prim in ("add", "add_any", "sub", "scatter-add", "scatter_add"):
        return 1
    return 0


def _broadcasts_to(shape, target) -> bool:
    try:
        return np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False


class _State(NamedTuple):
    """What the interpreter knows of one value: the value, its sum of |terms| (None for non-floats), its
    accumulation length N, its kink term (None = none; a float array K >= 0 for floats, a bool array "uncertain"
    for comparison results) and whether it is exact (an input or data moved from inputs: never rounded)."""

    val: Any
    mag: Any
    n: int
    kink: Any = None
    exact: bool = False
    # (kink mode only) the *local* sum of |terms|: of the last products, with their operands taken as exact (None:
    # |val|). The rounding radius of an exp's argument is judged on it, not on ``mag``, a layer-by-layer worst case
    # that grows about sqrt(fan-in) per linear layer (1e6..1e15 over a transformer block) and would call every
    # softmax saturated.
    loc: Any = None
    # (kink mode only) the first-order rounding error bound E of the run under test (None: 0, an exact value):
    # Wilkinson's running error analysis, linear in the operands' errors, local to the run under test rather than a
    # worst case over every term as ``mag`` is. A comparison's radius is judged on it.
    err: Any = None
    # (kink mode only) where the computed value's sign is certain (bool array; None: nowhere known; exact values
    # always): products, exps and sums of same-signed terms keep their sign under any rounding, so ``den > 0`` on a
    # softmax denominator never flips however large E is.
    sgn: Any = None


def _zeros_like_kink(v):
    return jnp.zeros(jnp.shape(v), jnp.result_type(v))


def _bind_nonneg(primitive, params: dict, ops: Sequence[Any]) -> list[Any]:
    """Apply a multilinear, negating or selecting primitive to non-negative operands (magnitudes or kink terms):
    ``sub`` adds, ``neg`` is the identity, ``reduce_min`` takes the largest. Returns a list of outputs."""
    name = primitive.name
    if name == "sub":
        out = jax.lax.add(ops[0], ops[1])
    elif name == "neg":
        out = ops[0]
    elif name == "reduce_min":
        out = jax.lax.reduce_max_p.bind(*ops, **params)
    else:
        out = primitive.bind(*ops, **params)
    return list(out) if primitive.multiple_results else [out]
