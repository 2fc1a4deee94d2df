"""The one place that knows how jaxgrad's Pallas kernels are compiled.

Every kernel in the package calls :func:`pallas_call`, :func:`masked_load` and :func:`masked_store` from here and
nothing else from ``jax.experimental.pallas.triton``. When JAX drops the Triton backend (deprecated in 0.11), this
module is what gets ported (to Mosaic GPU or jax-triton); kernel bodies stay as they are.

Policy:

* **CPU** (CI, laptops): ``interpret=True`` automatically. Pallas refuses to compile for CPU, and interpret mode
  runs the grid serially as ordinary XLA, in any dtype including float64 (which the verifier uses).
* **GPU**: the Triton backend, chosen by passing ``pltriton.CompilerParams`` explicitly (JAX 0.11's default for a
  bare ``pallas_call`` would be Mosaic GPU, whose matmuls need ``plgpu.wgmma``).
* **Bounds**: Triton masks nothing by itself. A block that hangs over the array edge reads garbage and writes out
  of bounds; interpret mode instead pads reads with NaN and drops writes, so CPU tests cannot see the bug. Kernels
  therefore load and store edge blocks through :func:`masked_load` / :func:`masked_store` with the mask from
  :func:`block_mask`, which behave identically on both.
* **Shapes**: Triton needs power-of-two element counts for every in-kernel array; :func:`block_size` picks one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = [
    "block_mask",
    "block_size",
    "compiler_params",
    "default_interpret",
    "masked_load",
    "masked_store",
    "pallas_call",
]


def default_interpret() -> bool:
    """True when the default JAX backend cannot compile Pallas kernels (anything but a GPU)."""
    return jax.default_backend() != "gpu"


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` means "decide from the platform"; an explicit bool is honoured (tests force ``True``)."""
    return default_interpret() if interpret is None else bool(interpret)


def compiler_params(num_warps: int = 4, num_stages: int = 2) -> pltriton.CompilerParams:
    """Triton compiler parameters; passing them is what selects the Triton backend in JAX 0.11."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def block_size(n: int, max_block: int, min_block: int = 16) -> int:
    """Smallest power of two >= ``n``, clipped to ``[min_block, max_block]`` (Triton needs powers of two)."""
    if n < 1:
        raise ValueError(f"block_size: n must be >= 1, got {n}")
    return max(min_block, min(max_block, pl.next_power_of_2(n)))


def pallas_call(
    kernel: Callable[..., None],
    *,
    out_shape: Any,
    grid: tuple[int, ...],
    in_specs: Any,
    out_specs: Any,
    name: str,
    interpret: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Callable[..., Any]:
    """``pl.pallas_call`` with jaxgrad's backend policy applied (see the module docstring).

    The result is callable inside ``jit``, ``vmap`` and ``shard_map`` (on per-device shards): the kernel holds no
    state and closes over no arrays.
    """
    interp = resolve_interpret(interpret)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=interp,
        compiler_params=None if interp else compiler_params(num_warps, num_stages),
        name=name,
    )


def block_mask(block_shape: Sequence[int], full_shape: Sequence[int]) -> jax.Array:
    """Boolean mask of the elements of the current grid block that lie inside the array.

    Assumes the grid axis ``d`` walks array axis ``d`` in blocks of ``block_shape[d]`` (the usual
    ``BlockSpec(block_shape, lambda *ids: ids)`` layout).
    """
    mask = None
    for axis, (b, n) in enumerate(zip(block_shape, full_shape, strict=True)):
        idx = pl.program_id(axis) * b + jnp.arange(b)
        shape = [1] * len(block_shape)
        shape[axis] = b
        m = (idx < n).reshape(shape)
        mask = m if mask is None else (mask & m)
    return jnp.broadcast_to(mask, tuple(block_shape))


def masked_load(ref: Any, mask: jax.Array, other: float = 0.0) -> jax.Array:
    """Load a whole block ref; lanes where ``mask`` is False read ``other`` instead of out-of-bounds memory."""
    return pltriton.load(ref, mask=mask, other=other)


def masked_store(ref: Any, value: jax.Array, mask: jax.Array) -> None:
    """Store a whole block ref; lanes where ``mask`` is False are not written."""
    pltriton.store(ref, value.astype(ref.dtype), mask=mask)


@functools.cache
def describe() -> str:
    """One line naming the backend in force, for reports and benchmark headers."""
    if default_interpret():
        return f"pallas interpret mode on {jax.default_backend()} (no GPU)"
    return "pallas Triton backend (explicit pltriton.CompilerParams)"
