"""What the Mosaic GPU kernels (:mod:`jaxgrad.ops.lora_linear_mgpu`, :mod:`jaxgrad.ops.lm_head_loss_mgpu`, the KAN
layer's :mod:`jaxgrad.kan.forward_mgpu` and :mod:`jaxgrad.kan.dx_mgpu`) share: the shared-memory layout of a
``wgmma`` / TMA tile, the warp-specialised K loop, the epilogue's tiled store, zero padding to whole tiles, and the
persistent grid: its size and its walk over the output tiles."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax.numpy as jnp

__all__ = ["GemmTiles", "k_pipeline", "kernel_traces", "num_sms", "pad_to_multiple", "persistent_kernel",
           "persistent_tiles", "rhs_transforms", "smem_spec", "smem_transforms", "store_tile", "warp_specialized",
           "whole_kib_rows"]

SMEM_ALIGN = 1024  # bytes: a 128-byte swizzle's atom (8 rows x 128 B); TMA needs at least 128


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """Tiles of a GEMM kernel on :func:`k_pipeline`: a CTA computes ``2 tile_m x tile_n`` of the output (one
    ``tile_m`` row block per compute warpgroup), streaming ``tile_k`` of the contraction per stage, and stores it in
    ``epi_tile_m x epi_tile_n`` pieces (:func:`store_tile`); the persistent grid walks the output tiles in a planar
    snake ``grid_tile_width`` wide (L2 reuse of both operands)."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 3  # 3 x 48 KiB of bf16 operand stages; the epilogue's tiles take the rest of 227 KiB
    epi_tile_m: int = 64
    epi_tile_n: int = 64
    grid_tile_width: int = 8


def smem_transforms(minor: int, dtype):
    """The TMA / ``wgmma`` layout of a ``[rows, minor]`` shared-memory tile of ``dtype``: 8-row tiles as wide as the
    largest swizzle that ``minor`` elements fill, and that swizzle."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    size = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * size * 8)
    return (plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle))


def whole_kib_rows(rows: int, row_bytes: int) -> int:
    """``rows`` rounded up so that ``rows x row_bytes`` is a whole number of :data:`SMEM_ALIGN` bytes.

    Shared-memory buffers are laid out one after the other (and a pipeline's stages of one block side by side), so a
    buffer of any other size moves every later one off the alignment that TMA (128 B) and a swizzled ``wgmma``
    operand (the swizzle's atom, up to 1 KiB) need: the device reports a misaligned address. Tables whose row count
    follows the grid or the order are padded with zero rows to this many."""
    unit = SMEM_ALIGN // math.gcd(SMEM_ALIGN, row_bytes)
    return -(-rows // unit) * unit


def rhs_transforms(k: int):
    """The shared-memory layout of a float16 ``wgmma`` right operand ``[k, n]`` (``n`` minor) for a contraction of
    ``k`` per step: ``wgmma`` consumes it in K groups as wide as the swizzle (in elements), so the swizzle is ``k``
    float16 elements wide, whatever ``n``."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return (plgpu.TilingTransform((8, k)), plgpu.SwizzleTransform(2 * k))


def pad_to_multiple(t, multiples):
    """``t`` zero-padded at the end of each axis to a multiple of ``multiples[axis]`` (unchanged where it is one).
    Zero rows and columns add exact zeros to every fp32 sum, so the padded product's leading block is the product."""
    widths = [(0, (-n) % m) for n, m in zip(t.shape, multiples)]
    return t if not any(p for _, p in widths) else jnp.pad(t, widths)


def num_sms() -> int:
    """The default device's multiprocessor count: the CTAs of a persistent grid."""
    from jax.extend import backend

    return backend.get_default_device().core_count


#: ``(directory, regions)`` while :func:`kernel_traces` is active, else ``None``
_TRACES: tuple[str, int] | None = None


@contextlib.contextmanager
def kernel_traces(directory: str, regions: int = 256):
    """Within the block, kernels made by :func:`persistent_kernel` record Mosaic GPU's on-device trace: each
    warpgroup's first ``regions`` entries into the ``jax.named_scope`` regions of its body, their enter and exit
    stamped with the SM's clock, written to ``directory`` as a Chrome trace (``*-trace.json``) when the kernel returns.

    The trace lives in shared memory (16 bytes a region and warpgroup: ``48 regions`` bytes a CTA of three
    warpgroups) until the kernel ends, so a kernel whose stages fill shared memory may no longer fit. JAX's
    compilation caches are cleared on entry and on exit: kernels compiled outside the block record nothing, and the
    traced ones are not reused after it."""
    import jax

    global _TRACES
    before = _TRACES
    _TRACES = (str(directory), int(regions))
    jax.clear_caches()
    try:
        yield
    finally:
        _TRACES = before
        jax.clear_caches()


def persistent_kernel(body, out_type, num_sms: int):
    """``body`` as a Mosaic GPU kernel on the persistent grid (``num_sms`` CTAs, axis ``"cluster_grid"``) of three
    warpgroups (axis ``"wg"``: two compute warpgroups and the memory warpgroup of :func:`warp_specialized`), lowered
    with warpgroup semantics; ``out_type`` as for :func:`jax.experimental.pallas.mosaic_gpu.kernel`. Inside
    :func:`kernel_traces` the kernel records its on-device trace."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    trace = {} if _TRACES is None else dict(profile_dir=_TRACES[0], profile_space=_TRACES[1],
                                            profile_bounds_check=True)
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=(num_sms,),
        grid_names=("cluster_grid",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup, **trace),
    )


def persistent_tiles(tiles: tuple[int, int], grid_tile_width: int):
    """Decorator: run ``body(m_idx, n_idx)`` for every tile of a ``tiles = (m_tiles, n_tiles)`` output, the CTAs of
    the persistent grid (axis ``"cluster_grid"``) taking the tiles in turn along a planar snake ``grid_tile_width``
    wide (L2 reuse of both operands)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    def run(body):
        @plgpu.nd_loop((tiles[0] * tiles[1],), collective_axes="cluster_grid")
        def _loop(info):
            (lin,) = info.index
            body(*plgpu.planar_snake(lin, tiles, 1, grid_tile_width))
        return body
    return run


def smem_spec(shape, index, transforms=()):
    """A pipeline input's block: ``shape`` at block ``index(k)``, in shared memory with ``transforms``."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.BlockSpec(shape, index, transforms=transforms, memory_space=plgpu.SMEM)


def warp_specialized(in_specs, k_iters: int, max_concurrent_steps: int):
    """``pipeline(body, compute_context)``: a K loop of ``k_iters`` steps in which a memory warpgroup streams the
    blocks of ``in_specs`` into shared memory by TMA, ``max_concurrent_steps`` stages deep, and two compute
    warpgroups (axis ``"wg"``) run ``body`` on each stage (after JAX's ``hopper_matmul_mgpu.py``)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=list(in_specs),
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=max_concurrent_steps,
            compute_context=compute_context,
        )
    return pipeline


def k_pipeline(dtype, lhs_block: tuple[int, int], rhs_block: tuple[int, int], rhs_index, k_iters: int,
               max_concurrent_steps: int):
    """:func:`warp_specialized` for a GEMM tile: for K-step ``k``, the left operand's ``lhs_block`` (``[rows,
    tile_k]``, block ``(0, k)``) and the right one's ``rhs_block`` (block ``rhs_index(k)``), each in its ``wgmma``
    layout."""
    def spec(shape, index):
        return smem_spec(shape, index, smem_transforms(shape[1], dtype))

    return warp_specialized([spec(lhs_block, lambda kk: (0, kk)), spec(rhs_block, rhs_index)], k_iters,
                            max_concurrent_steps)


def store_tile(value, slots_smem, wg, dst, epi_m: int, epi_n: int) -> None:
    """Store warpgroup ``wg``'s ``[tile_m, tile_n]`` register tile ``value`` to ``dst`` in ``[epi_m, epi_n]`` pieces
    through its slots ``slots_smem[wg]`` (``[2, slots, epi_m, epi_n]``): each piece waits until the store that last
    used its slot has read it, is written, and goes out by TMA while the next is written."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tile_m, tile_n = value.shape
    slots = slots_smem.shape[1]
    for ei in range(tile_m // epi_m):
        for ej in range(tile_n // epi_n):
            em, en = slice(ei * epi_m, (ei + 1) * epi_m), slice(ej * epi_n, (ej + 1) * epi_n)
            slot = (ei * (tile_n // epi_n) + ej) % slots
            plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
            slots_smem[wg, slot] = value[em, en]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(slots_smem.at[wg, slot], dst.at[em, en])
