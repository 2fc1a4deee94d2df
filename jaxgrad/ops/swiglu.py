r"""SwiGLU gate: ``swiglu(gate, up) = silu(gate) * up`` — reference, custom VJP and Pallas kernels side by side.

The smallest op with a kernel: it exercises the kernel backend shim (:mod:`jaxgrad.pallas_backend`) and the verifier,
and it is the gate of the LoRA block's Llama MLP (:mod:`jaxgrad.lora.block`).

Math (elementwise, :math:`\sigma` the logistic function):

.. math::

    y &= \operatorname{silu}(a)\, u = a\,\sigma(a)\, u \\
    \operatorname{silu}'(a) &= \sigma(a)\,\bigl(1 + a\,(1 - \sigma(a))\bigr) \\
    \bar a &= \bar y\, u\, \operatorname{silu}'(a), \qquad \bar u = \bar y\, \operatorname{silu}(a)

The backward recomputes :math:`\sigma(a)` from the saved inputs (cheaper than saving it). Arithmetic runs in
``promote_types(dtype, float32)``: float32 for bf16/f32 inputs, float64 for f64 inputs (the verifier's re-run).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxgrad import pallas_backend as pb
from jaxgrad.ops.dtypes import compute_dtype

Backend = Literal["xla", "pallas"]
__all__ = ["swiglu", "swiglu_bwd_pallas", "swiglu_fwd_pallas", "swiglu_reference"]


def swiglu_reference(gate: jax.Array, up: jax.Array) -> jax.Array:
    """Plain-JAX definition, differentiated by ``jax.grad``: the oracle for the custom VJP and the kernels."""
    return jax.nn.silu(gate) * up


def _check_inputs(gate, up) -> None:
    for name, x in (("gate", gate), ("up", up)):
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"swiglu: '{name}' must be a floating-point array, got {getattr(x, 'dtype', type(x))}")
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: 'gate' and 'up' must have the same shape, got {gate.shape} and {up.shape}")
    if gate.dtype != up.dtype:
        raise TypeError(f"swiglu: 'gate' and 'up' must have the same dtype, got {gate.dtype} and {up.dtype}")


# ---------------------------------------------------------------------------------------------------------------
# XLA path: the same equations as the kernels, in plain jnp.
# ---------------------------------------------------------------------------------------------------------------
def _fwd_math(a, u):
    return a * jax.nn.sigmoid(a) * u


def _bwd_math(a, u, dy):
    s = jax.nn.sigmoid(a)
    dsilu = s * (1 + a * (1 - s))  # silu'(a)
    return dy * u * dsilu, dy * a * s  # (d gate, d up)


# ---------------------------------------------------------------------------------------------------------------
# Pallas path: 2-D tiles over a [rows, cols] view, edge tiles masked.
# ---------------------------------------------------------------------------------------------------------------
def _as_2d(x):
    return x.reshape(-1, x.shape[-1]) if x.ndim >= 2 else x.reshape(1, -1)


def _tiling(shape2d, block_rows, block_cols):
    rows, cols = shape2d
    bm = pb.block_size(rows, block_rows, min_block=1)
    bn = pb.block_size(cols, block_cols, min_block=16)
    return (bm, bn), (pl.cdiv(rows, bm), pl.cdiv(cols, bn))


def _fwd_kernel(a_ref, u_ref, y_ref, *, shape, block):
    mask = pb.block_mask(block, shape)
    cdt = compute_dtype(a_ref.dtype)
    a = pb.masked_load(a_ref, mask).astype(cdt)
    u = pb.masked_load(u_ref, mask).astype(cdt)
    pb.masked_store(y_ref, _fwd_math(a, u), mask)


def _bwd_kernel(a_ref, u_ref, dy_ref, da_ref, du_ref, *, shape, block):
    mask = pb.block_mask(block, shape)
    cdt = compute_dtype(a_ref.dtype)
    a = pb.masked_load(a_ref, mask).astype(cdt)
    u = pb.masked_load(u_ref, mask).astype(cdt)
    dy = pb.masked_load(dy_ref, mask).astype(cdt)
    da, du = _bwd_math(a, u, dy)
    pb.masked_store(da_ref, da, mask)
    pb.masked_store(du_ref, du, mask)


def _elementwise_call(kernel, inputs, n_out, name, interpret, block_rows, block_cols):
    x0 = inputs[0]
    shape2d = _as_2d(x0).shape
    block, grid = _tiling(shape2d, block_rows, block_cols)
    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    out = jax.ShapeDtypeStruct(shape2d, x0.dtype)
    call = pb.pallas_call(
        functools.partial(kernel, shape=shape2d, block=block),
        out_shape=[out] * n_out,
        grid=grid,
        in_specs=[spec] * len(inputs),
        out_specs=[spec] * n_out,
        name=name,
        interpret=interpret,
    )
    return [o.reshape(x0.shape) for o in call(*[_as_2d(x) for x in inputs])]


def swiglu_fwd_pallas(gate, up, *, interpret=None, block_rows: int = 16, block_cols: int = 256):
    """``silu(gate) * up`` by the forward kernel (fp32 arithmetic, one rounding to gate's dtype); no VJP: the
    LoRA block's ``backend="pallas"`` calls it and :func:`swiglu_bwd_pallas` from its own VJP."""
    return _elementwise_call(_fwd_kernel, (gate, up), 1, "swiglu_fwd", interpret, block_rows, block_cols)[0]


def swiglu_bwd_pallas(gate, up, dy, *, interpret=None, block_rows: int = 16, block_cols: int = 256):
    """``(d gate, d up)`` by the backward kernel, written in gate's dtype; ``dy`` is read in its own dtype (the
    LoRA block passes its fp32 sums unrounded), all arithmetic in ``promote_types(dtype, float32)``."""
    return tuple(_elementwise_call(_bwd_kernel, (gate, up, dy), 2, "swiglu_bwd", interpret, block_rows, block_cols))


# ---------------------------------------------------------------------------------------------------------------
# Public op
# ---------------------------------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _swiglu(gate, up, backend, interpret, block_rows, block_cols):
    return _swiglu_fwd(gate, up, backend, interpret, block_rows, block_cols)[0]


def _swiglu_fwd(gate, up, backend, interpret, block_rows, block_cols):
    if backend == "pallas":
        (y,) = _elementwise_call(_fwd_kernel, (gate, up), 1, "swiglu_fwd", interpret, block_rows, block_cols)
    else:
        cdt = compute_dtype(gate.dtype)
        y = _fwd_math(gate.astype(cdt), up.astype(cdt)).astype(gate.dtype)
    return y, (gate, up)


def _swiglu_bwd(backend, interpret, block_rows, block_cols, residuals, dy):
    gate, up = residuals
    dy = dy.astype(gate.dtype)
    if backend == "pallas":
        da, du = _elementwise_call(
            _bwd_kernel, (gate, up, dy), 2, "swiglu_bwd", interpret, block_rows, block_cols
        )
    else:
        cdt = compute_dtype(gate.dtype)
        da, du = _bwd_math(gate.astype(cdt), up.astype(cdt), dy.astype(cdt))
    return da.astype(gate.dtype), du.astype(up.dtype)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def swiglu(
    gate: jax.Array,
    up: jax.Array,
    *,
    backend: Backend = "pallas",
    interpret: bool | None = None,
    block_rows: int = 16,
    block_cols: int = 256,
) -> jax.Array:
    """``silu(gate) * up`` with a hand-written VJP.

    Args:
      gate, up: floating arrays of one shape and dtype (any rank; bf16, f16, f32 or f64).
      backend: ``"pallas"`` (fused kernels; interpret mode off-GPU) or ``"xla"`` (the same equations in jnp).
      interpret: force Pallas interpret mode (``None``: on unless running on a GPU).
      block_rows, block_cols: upper bounds of the kernel tile (rounded to powers of two).
    """
    _check_inputs(gate, up)
    if backend not in ("xla", "pallas"):
        raise ValueError(f"swiglu: backend must be 'xla' or 'pallas', got {backend!r}")
    if gate.size == 0:
        return swiglu_reference(gate, up)
    return _swiglu(gate, up, backend, interpret, block_rows, block_cols)


def audit_cases():
    """Cases for ``jaxgrad audit``: both backends, white-noise inputs, sizes with odd, unequal axes."""
    from jaxgrad.ops.registry import OpAudit

    def make_args(key, size):
        rows, cols = size
        k1, k2 = jax.random.split(key)
        return jax.random.normal(k1, (rows, cols)), jax.random.normal(k2, (rows, cols))

    sizes = ((7, 129), (33, 257), (129, 1031))
    return tuple(
        OpAudit(f"swiglu[{b}]", functools.partial(swiglu, backend=b), swiglu_reference, make_args, sizes,
                arg_names=("gate", "up"), backend=b)
        for b in ("pallas", "xla")
    )
