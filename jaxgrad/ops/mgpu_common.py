"""What the Mosaic GPU kernels (:mod:`jaxgrad.ops.lora_linear_mgpu`, :mod:`jaxgrad.ops.lm_head_loss_mgpu`) share: the
shared-memory layout of a ``wgmma`` / TMA tile, zero padding to whole tiles, and the persistent grid's size."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["num_sms", "pad_to_multiple", "smem_transforms"]


def smem_transforms(minor: int, dtype):
    """The TMA / ``wgmma`` layout of a ``[rows, minor]`` shared-memory tile of ``dtype``: 8-row tiles as wide as the
    largest swizzle that ``minor`` elements fill, and that swizzle."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    size = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * size * 8)
    return (plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle))


def pad_to_multiple(t, multiples):
    """``t`` zero-padded at the end of each axis to a multiple of ``multiples[axis]`` (unchanged where it is one).
    Zero rows and columns add exact zeros to every fp32 sum, so the padded product's leading block is the product."""
    widths = [(0, (-n) % m) for n, m in zip(t.shape, multiples)]
    return t if not any(p for _, p in widths) else jnp.pad(t, widths)


def num_sms() -> int:
    """The default device's multiprocessor count: the CTAs of a persistent grid."""
    from jax.extend import backend

    return backend.get_default_device().core_count
