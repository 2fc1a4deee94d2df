r"""The LoRA projection's forward as one Mosaic GPU kernel on Hopper (``wgmma``): :math:`Y = X W^\top + s (X A^\top) B^\top`.

What it computes is :func:`jaxgrad.ops.lora_linear.lora_linear_fwd` with ``fold_b=True`` (the LoRA block's default),
:math:`Y = [X \,|\, sU] [W \,|\, B]^\top` with :math:`U = X A^\top`: one fp32 accumulator per output tile, ``sU``
rounded once to the operand dtype, one rounding of ``Y``. XLA runs that as three kernels (the skinny ``X A^T``, the
concatenations ``[X | sU]`` and ``[W | B]``, written to HBM each step, and the GEMM). Here one pass over ``X``
feeds both products:

* a warp-specialised pipeline (``plgpu.emit_pipeline_warp_specialized``, after JAX's ``hopper_matmul_mgpu.py``)
  streams, for K-step ``k``, the tiles ``X[m, k]``, ``W[n, k]`` and ``A[:, k]`` into shared memory (TMA);
* each of the two compute warpgroups owns ``tile_m`` rows of the CTA's ``2 tile_m`` and issues two ``wgmma`` per
  step: ``acc += X_k W_k^T`` (``tile_m x tile_n``, fp32 in registers) and ``u += X_k A_k^T`` (``tile_m x r``: the
  LoRA ``U`` of its rows, an extra ``r / tile_n`` = 12.5% of the tensor-core work at r = 16, tile_n = 128; no
  second read of ``X``);
* the epilogue rounds ``sU`` to the operand dtype into shared memory, brings ``B[n, :]`` (``tile_n x r``) in by
  TMA, issues one more ``wgmma`` ``acc += (sU) B^T`` (contraction ``r``) and stores ``Y`` through shared memory in
  ``epi_tile`` pieces.

Registers per compute thread: the accumulator ``tile_m tile_n / 128`` fp32 (128 at 128 x 128) plus ``u``'s
``tile_m r / 128`` (16). Shared memory: ``max_concurrent_steps`` stages of ``(2 tile_m + tile_n + r) tile_k``
operands (3 x 50 KiB at 128/128/64, r = 16), ``sU`` and ``B`` tiles, two epilogue slots per warpgroup.

Scope: bf16 or f16 operands (``wgmma`` on 16-bit types; f32 would be TF32), shapes divisible by the tiles
(``M % 2 tile_m``, ``N % tile_n``, ``K % tile_k``, ``r % 16``), no dropout mask; :func:`supported` says whether a
call qualifies and :func:`lora_linear_fwd_mgpu` raises a ``ValueError`` naming the argument otherwise. It needs a
Hopper GPU (Mosaic GPU has no public interpreter): the tests on the H100 compare it with the reference at fresh
random inputs, and on a CPU its lowering is checked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["TileConfig", "lora_linear_fwd_mgpu", "supported"]


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tiles of :func:`lora_linear_fwd_mgpu` (the CTA computes ``2 tile_m x tile_n`` of ``Y``)."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 3  # 3 x 50 KiB of operand stages + 48 KiB of epilogue: under the 227 KiB
    epi_tile_m: int = 64
    epi_tile_n: int = 64
    grid_tile_width: int = 8  # planar snake over the output tiles: L2 reuse of W and X


def _problem(x, w, a, b):
    m, k = x.shape
    n = w.shape[0]
    r = a.shape[0]
    return m, n, k, r


def supported(x, w, a, b, config: TileConfig = TileConfig()) -> str | None:
    """``None`` when :func:`lora_linear_fwd_mgpu` can run these operands, else why not (naming the argument)."""
    if x.ndim != 2 or w.ndim != 2 or a.ndim != 2 or b.ndim != 2:
        return f"x, w, a, b must be 2-D ([M, K], [N, K], [r, K], [N, r]), got {x.ndim}, {w.ndim}, {a.ndim}, {b.ndim}"
    m, n, k, r = _problem(x, w, a, b)
    if w.shape[1] != k or a.shape[1] != k or b.shape != (n, r):
        return (f"shapes must be x [M, K], w [N, K], a [r, K], b [N, r]; got x {x.shape}, w {w.shape}, a {a.shape}, "
                f"b {b.shape}")
    dts = {jnp.dtype(t.dtype) for t in (x, w, a, b)}
    if len(dts) != 1 or dts.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"x, w, a, b must share one 16-bit dtype (bf16 or f16), got {[str(t.dtype) for t in (x, w, a, b)]}"
    c = config
    for name, size, tile in (("x's rows M", m, 2 * c.tile_m), ("w's rows N", n, c.tile_n),
                             ("the contraction K", k, c.tile_k), ("the rank r", r, 16)):
        if size % tile:
            return f"{name} = {size} must be a multiple of {tile} (TileConfig {c})"
    return None


def _kernel(x_gmem, w_gmem, a_gmem, b_gmem, y_gmem, *, scale: float, cfg: TileConfig):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    dtype = x_gmem.dtype
    m, k = x_gmem.shape
    n, r = b_gmem.shape
    tile_m, tile_n, tile_k = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_m = 2 * tile_m  # warpgroup i owns rows [i tile_m, (i + 1) tile_m) of the CTA's tile
    m_iters, n_iters, k_iters = m // cta_m, n // tile_n, k // tile_k
    itemsize = jnp.dtype(dtype).itemsize

    def smem_transforms(minor):  # TMA/wgmma layout of a [rows, minor] 16-bit tile
        swizzle = plgpu.find_swizzle(minor * itemsize * 8)
        return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))

    in_transforms = smem_transforms(tile_k)
    r_transforms = smem_transforms(r)
    out_transforms = smem_transforms(cfg.epi_tile_n)

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((cta_m, tile_k), lambda kk: (0, kk), transforms=in_transforms,
                                memory_space=plgpu.SMEM),  # X[m, k]
                plgpu.BlockSpec((tile_n, tile_k), lambda kk: (0, kk), transforms=in_transforms,
                                memory_space=plgpu.SMEM),  # W[n, k] (HF layout [out, in])
                plgpu.BlockSpec((r, tile_k), lambda kk: (0, kk), transforms=in_transforms,
                                memory_space=plgpu.SMEM),  # A[:, k]
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None  # noqa: E731 - the bodies do not change the pipeline's allocations
    epi_per_wg = (tile_m // cfg.epi_tile_m) * (tile_n // cfg.epi_tile_n)
    slots = min(2, epi_per_wg)

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem, a_gmem),
        y_smem=plgpu.SMEM((2, slots, cfg.epi_tile_m, cfg.epi_tile_n), dtype, transforms=out_transforms),
        su_smem=plgpu.SMEM((2, tile_m, r), dtype, transforms=r_transforms),
        b_smem=plgpu.SMEM((2, tile_n, r), dtype, transforms=r_transforms),
        b_barrier=plgpu.Barrier(num_barriers=2),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, y_smem, su_smem, b_smem, b_barrier):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
        def _mn_loop(info):
            (lin,) = info.index
            m_idx, n_idx = plgpu.planar_snake(lin, (m_iters, n_iters), 1, cfg.grid_tile_width)
            cta_m_slice = pl.ds(m_idx * cta_m, cta_m)
            n_slice = pl.ds(n_idx * tile_n, tile_n)
            wg_m_slice = pl.ds(wg * tile_m, tile_m)

            def compute_context(eval_pipeline):
                # B[n, :] for the epilogue, in flight while the K loop runs (the previous tile's wgmma on b_smem
                # was waited for before its epilogue ended)
                plgpu.copy_gmem_to_smem(b_gmem.at[n_slice], b_smem.at[wg], b_barrier.at[wg])

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32),
                                   u_ref=plgpu.ACC((tile_m, r), jnp.float32))
                def _acc_scope(acc_ref, u_ref):
                    eval_pipeline((acc_ref, u_ref))
                    # Y += (s U) B^T: sU rounded once to the operand dtype (lora_linear_fwd's fold_b)
                    su_smem[wg] = (u_ref[...] * scale).astype(dtype)
                    plgpu.commit_smem()
                    plgpu.barrier_wait(b_barrier.at[wg])
                    plgpu.wgmma(acc_ref, su_smem.at[wg], b_smem.at[wg].transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    y = acc_ref[...].astype(dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for ei in range(tile_m // cfg.epi_tile_m):
                        for ej in range(tile_n // cfg.epi_tile_n):
                            em = slice(ei * cfg.epi_tile_m, (ei + 1) * cfg.epi_tile_m)
                            en = slice(ej * cfg.epi_tile_n, (ej + 1) * cfg.epi_tile_n)
                            slot = (ei * (tile_n // cfg.epi_tile_n) + ej) % slots
                            plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                            y_smem[wg, slot] = y[em, en]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(
                                y_smem.at[wg, slot],
                                y_gmem.at[cta_m_slice, n_slice].at[wg_m_slice].at[em, en])

            def mma_body(_, x_smem, w_smem, a_smem, carry):
                acc_ref, u_ref = carry
                xs = x_smem.at[wg_m_slice]
                plgpu.wgmma(acc_ref, xs, w_smem.transpose((1, 0)))  # X W^T
                plgpu.wgmma(u_ref, xs, a_smem.transpose((1, 0)))  # U = X A^T, from the same X tile
                plgpu.wgmma_wait(0)
                return carry

            pipeline(mma_body, compute_context)(
                x_gmem.at[cta_m_slice, :], w_gmem.at[n_slice, :], a_gmem, allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _num_sms() -> int:
    from jax.extend import backend

    return backend.get_default_device().core_count


@functools.partial(jax.jit, static_argnames=("scale", "config", "num_sms"))
def _call(x, w, a, b, *, scale, config, num_sms):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, n, _, _ = _problem(x, w, a, b)
    f = plgpu.kernel(
        functools.partial(_kernel, scale=scale, cfg=config),
        out_type=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(num_sms,),
        grid_names=("cluster_grid",),
        num_threads=3,  # two compute warpgroups and the memory warpgroup
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return f(x, w, a, b)


def lora_linear_fwd_mgpu(x, w, a, b, scale: float, config: TileConfig = TileConfig(), num_sms: int | None = None):
    r"""``Y = X W^T + s (X A^T) B^T`` in one Mosaic GPU kernel (module doc); ``x`` may have leading batch axes.

    Args:
      x: ``[..., K]`` activations; w: ``[N, K]`` frozen weight (HF layout); a: ``[r, K]`` LoRA A; b: ``[N, r]`` LoRA
        B; all one 16-bit dtype.
      scale: ``s = lora_alpha / r`` (a Python float: it is compiled in).
      config: the tiles.
      num_sms: CTAs of the persistent grid (default: the device's multiprocessor count).
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    why = supported(x2, w, a, b, config)
    if why is not None:
        raise ValueError(f"lora_linear_fwd_mgpu: {why}")
    y = _call(x2, w, a, b, scale=float(scale), config=config, num_sms=int(num_sms or _num_sms()))
    return y.reshape(*lead, w.shape[0])
