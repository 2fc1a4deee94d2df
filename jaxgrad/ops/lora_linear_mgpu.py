r"""The LoRA projection's forward and input gradient as Mosaic GPU kernels on Hopper (``wgmma``).

Forward :math:`Y = X W^\top + s (X A^\top) B^\top`; backward :math:`dX = dY\, W + (s\, dY B) A` -- the same kernel,
``L R_1 + P R_3`` with ``L`` (``X`` or ``dY``) streamed through the K loop, ``R_1`` the frozen weight (``W^T``
forward, ``W`` backward), ``P = s L R_2`` the rank-r product (``R_2`` = ``A^T`` forward, ``B`` backward) formed by
XLA first, and ``R_3`` (``B^T`` forward, ``A`` backward, passed transposed: a 16-wide untransposed ``wgmma``
operand does not lower).

What it computes is :func:`jaxgrad.ops.lora_linear.lora_linear_fwd` with ``fold_b=True`` (the LoRA block's default),
:math:`Y = [X \,|\, sU] [W \,|\, B]^\top` with :math:`U = X A^\top`: one fp32 accumulator per output tile, ``sU``
rounded once to the operand dtype, one rounding of ``Y``. XLA runs that as three kernels (the skinny ``X A^T``, the
concatenations ``[X | sU]`` and ``[W | B]``, written to HBM each step, and the GEMM). Here:

* ``sU`` (``[M, r]``) comes from a skinny XLA GEMM beforehand (fp32 accumulation, rounded once to the operand
  dtype), so the K loop is a plain GEMM: a warp-specialised pipeline (``plgpu.emit_pipeline_warp_specialized``,
  after JAX's ``hopper_matmul_mgpu.py``) streams, for K-step ``k``, the tiles ``X[m, k]`` and ``W[n, k]`` into
  shared memory (TMA);
* each of the two compute warpgroups owns ``tile_m`` rows of the CTA's ``2 tile_m`` and issues one ``wgmma`` per
  step, ``acc += X_k W_k^T`` (``tile_m x tile_n``, fp32 in registers), and waits for it before the next;
* the epilogue brings the warpgroup's rows of ``sU`` and ``B[n, :]`` (``tile_n x r``) in by TMA (in flight during
  the K loop), issues one more ``wgmma`` ``acc += (sU) B^T`` (contraction ``r``) and stores ``Y`` through shared
  memory in ``epi_tile`` pieces.

Why ``sU`` from XLA rather than a second ``wgmma`` ``u += X_k A_k^T`` (``tile_m x r``) in every K step from the
same ``X`` tiles (``X`` read once): that 16-wide ``wgmma`` beside the main one cost the kernel ~20%, more than the
extra read of ``X`` by XLA (docs/design.md has the measurement).

Registers per compute thread: the accumulator ``tile_m tile_n / 128`` fp32 (128 at 128 x 128). Shared memory:
``max_concurrent_steps`` stages of ``(2 tile_m + tile_n) tile_k`` operands (3 x 48 KiB at 128/128/64), ``sU`` and
``B`` tiles (16 KiB), two epilogue slots per warpgroup (32 KiB): 192 KiB of the 227.

The backward kernel writes ``dX`` in fp32 by default here (the LoRA block asks for the operand dtype: its sums stay
fp32); ``s G`` (``G = dY B``) is rounded once to the operand dtype before ``G A``, as ``sU`` is forward. ``dA`` and
``dB`` stay on XLA; each kernel can also return its rank-r product as rounded (``sU`` forward, ``sG`` for dX,
``[M, r]``), so that ``dB = dY^T (sU)`` and ``dA = (sG)^T X`` need no second pass over ``X`` or ``dY``.

Scope: bf16 or f16 operands (``wgmma`` on 16-bit types; f32 would be TF32), no dropout mask. The kernel itself
takes shapes divisible by its tiles (rows ``% 2 tile_m``, output columns ``% tile_n``, contraction ``% tile_k``,
``r % 16``); the public functions zero-pad the operands up to them where a size is not (zeros add exact zeros to
every fp32 sum) and slice the results, so any size runs -- seq 77, hidden 96, r = 4 -- at the cost of the padded
copies (none at the LoRA block's benchmark shape). :func:`supported` / :func:`supported_dx` say whether a call
qualifies (shapes that fit together, one 16-bit dtype) and the kernels raise a ``ValueError`` naming the argument
otherwise. It needs a Hopper GPU (Mosaic GPU has no public interpreter): the tests on the H100 compare it with the
reference at fresh random inputs, odd sizes included, and on a CPU its lowering is checked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxgrad.ops import mgpu_common
from jaxgrad.ops.mgpu_common import num_sms as _num_sms, pad_to_multiple

__all__ = ["TileConfig", "lora_linear_dx_mgpu", "lora_linear_fwd_mgpu", "supported", "supported_dx"]


@dataclasses.dataclass(frozen=True)
class TileConfig(mgpu_common.GemmTiles):
    """Tiles of :func:`lora_linear_fwd_mgpu` (the CTA computes ``2 tile_m x tile_n`` of ``Y``): 3 stages of 48 KiB
    of operands, and 48 KiB of epilogue and rank-r tiles."""


def _problem(x, w, a, b):
    m, k = x.shape
    n = w.shape[0]
    r = a.shape[0]
    return m, n, k, r


def _why_not(arrays) -> str | None:
    dts = {jnp.dtype(t.dtype) for t in arrays}
    if len(dts) != 1 or dts.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the operands must share one 16-bit dtype (bf16 or f16), got {[str(t.dtype) for t in arrays]}"
    return None


def supported(x, w, a, b, config: TileConfig = TileConfig()) -> str | None:
    """``None`` when :func:`lora_linear_fwd_mgpu` can run these operands, else why not (naming the argument)."""
    if x.ndim != 2 or w.ndim != 2 or a.ndim != 2 or b.ndim != 2:
        return f"x, w, a, b must be 2-D ([M, K], [N, K], [r, K], [N, r]), got {x.ndim}, {w.ndim}, {a.ndim}, {b.ndim}"
    _, n, k, r = _problem(x, w, a, b)
    if w.shape[1] != k or a.shape[1] != k or b.shape != (n, r):
        return (f"shapes must be x [M, K], w [N, K], a [r, K], b [N, r]; got x {x.shape}, w {w.shape}, a {a.shape}, "
                f"b {b.shape}")
    return _why_not((x, w, a, b))


def supported_dx(dy, w, a, b, config: TileConfig = TileConfig()) -> str | None:
    """``None`` when :func:`lora_linear_dx_mgpu` can run these operands, else why not (naming the argument)."""
    if dy.ndim != 2 or w.ndim != 2 or a.ndim != 2 or b.ndim != 2:
        return (f"dy, w, a, b must be 2-D ([M, N], [N, K], [r, K], [N, r]), got {dy.ndim}, {w.ndim}, {a.ndim}, "
                f"{b.ndim}")
    n, k, r = dy.shape[1], w.shape[1], a.shape[0]
    if w.shape[0] != n or a.shape[1] != k or b.shape != (n, r):
        return (f"shapes must be dy [M, N], w [N, K], a [r, K], b [N, r]; got dy {dy.shape}, w {w.shape}, "
                f"a {a.shape}, b {b.shape}")
    return _why_not((dy, w, a, b))


def _kernel(lhs_gmem, r1_gmem, rank_gmem, r3t_gmem, y_gmem, *, cfg: TileConfig, t1: bool):
    """``Y = L R1 + P R3`` (module doc), ``L`` [M, Kc]; ``R1`` [Kc, N] (stored transposed, [N, Kc], when ``t1``);
    ``P = s (L R2)`` [M, r], the rank-r product computed beforehand and rounded to the operand dtype; ``R3`` stored
    transposed, ``R3^T`` [N, r]. Forward: ``R1^T = W``, ``P = sU``, ``R3^T = B``; dX: ``R1 = W``, ``P = sG``,
    ``R3^T = A^T``. The K loop streams ``L`` and ``R1`` only; the epilogue brings the warpgroup's rows of ``P`` and
    the CTA's tile of ``R3^T`` in by TMA."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    dtype, out_dtype = lhs_gmem.dtype, y_gmem.dtype
    m, k = lhs_gmem.shape
    n = y_gmem.shape[1]
    r = rank_gmem.shape[1]
    tile_m, tile_n, tile_k = cfg.tile_m, cfg.tile_n, cfg.tile_k
    epi_m = cfg.epi_tile_m
    epi_n = cfg.epi_tile_n * 2 // jnp.dtype(out_dtype).itemsize  # the same bytes per epilogue row: 64 bf16, 32 f32
    cta_m = 2 * tile_m  # warpgroup i owns rows [i tile_m, (i + 1) tile_m) of the CTA's tile
    m_iters, n_iters, k_iters = m // cta_m, n // tile_n, k // tile_k

    def smem_transforms(minor, dt=dtype):  # TMA/wgmma layout of a [rows, minor] tile
        return mgpu_common.smem_transforms(minor, dt)

    r1_block, r1_index = ((tile_n, tile_k), lambda kk: (0, kk)) if t1 else ((tile_k, tile_n), lambda kk: (kk, 0))
    pipeline = mgpu_common.k_pipeline(dtype, (cta_m, tile_k), r1_block, r1_index, k_iters, cfg.max_concurrent_steps)

    ignore = lambda *_, **__: None  # noqa: E731 - the bodies do not change the pipeline's allocations
    slots = min(2, (tile_m // epi_m) * (tile_n // epi_n))

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline(ignore, ignore).get_allocations(lhs_gmem, r1_gmem),
        y_smem=plgpu.SMEM((2, slots, epi_m, epi_n), out_dtype, transforms=smem_transforms(epi_n, out_dtype)),
        p_smem=plgpu.SMEM((2, tile_m, r), dtype, transforms=smem_transforms(r)),
        r3_smem=plgpu.SMEM((2, tile_n, r), dtype, transforms=smem_transforms(r)),
        r3_barrier=plgpu.Barrier(num_barriers=2),
        p_barrier=plgpu.Barrier(num_barriers=2),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, y_smem, p_smem, r3_smem, r3_barrier, p_barrier):
        wg = lax.axis_index("wg")

        @mgpu_common.persistent_tiles((m_iters, n_iters), cfg.grid_tile_width)
        def _tile(m_idx, n_idx):
            cta_m_slice = pl.ds(m_idx * cta_m, cta_m)
            n_slice = pl.ds(n_idx * tile_n, tile_n)
            wg_m_slice = pl.ds(wg * tile_m, tile_m)

            def compute_context(eval_pipeline):
                # R3's tile and this warpgroup's rows of P for the epilogue, in flight while the K loop runs (the
                # previous tile's wgmma on them was waited for before its epilogue ended)
                plgpu.copy_gmem_to_smem(r3t_gmem.at[n_slice], r3_smem.at[wg], r3_barrier.at[wg])
                plgpu.copy_gmem_to_smem(rank_gmem.at[cta_m_slice].at[wg_m_slice], p_smem.at[wg], p_barrier.at[wg])

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                def _acc_scope(acc_ref):
                    eval_pipeline(acc_ref)
                    # Y += P R3 (lora_linear_fwd's fold_b: [L | P] [R1 | R3] in one fp32 accumulator)
                    plgpu.barrier_wait(p_barrier.at[wg])
                    plgpu.barrier_wait(r3_barrier.at[wg])
                    plgpu.wgmma(acc_ref, p_smem.at[wg], r3_smem.at[wg].transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    y = acc_ref[...].astype(out_dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    mgpu_common.store_tile(y, y_smem, wg, y_gmem.at[cta_m_slice, n_slice].at[wg_m_slice],
                                           epi_m, epi_n)

            def mma_body(_, l_smem, r1_smem, acc_ref):
                plgpu.wgmma(acc_ref, l_smem.at[wg_m_slice], r1_smem.transpose((1, 0)) if t1 else r1_smem)  # L R1
                plgpu.wgmma_wait(0)  # this step's product before the next step is issued
                return acc_ref

            r1_tile = r1_gmem.at[n_slice, :] if t1 else r1_gmem.at[:, n_slice]
            pipeline(mma_body, compute_context)(lhs_gmem.at[cta_m_slice, :], r1_tile, allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("scale", "config", "num_sms", "mode", "out_dtype", "emit_rank"))
def _call(lhs, w, a, b, *, scale, config, num_sms, mode="fwd", out_dtype=None, emit_rank=False):
    """``mode="fwd"``: ``X W^T + s (X A^T) B^T`` (lhs = X); ``mode="dx"``: ``dY W + s (dY B) A`` (lhs = dY).
    ``emit_rank``: also return the rank-r product the epilogue used, ``s X A^T`` / ``s dY B`` [M, r] in the operand
    dtype."""
    fwd = mode == "fwd"
    n = w.shape[0] if fwd else w.shape[1]
    # R2^T [r, Kc] (A forward, B^T for dX) and R3^T (B [N, r] forward, A^T [K, r] for dX: a 16-wide untransposed
    # wgmma operand does not lower, so it goes in transposed; tiny copies)
    r2t, r3t = (a, b) if fwd else (b.T, a.T)
    # P = s (L R2) by XLA, fp32 accumulation, rounded once to the operand dtype (lora_linear_fwd's sU)
    rank = (scale * lax.dot_general(lhs, r2t, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)).astype(lhs.dtype)
    f = mgpu_common.persistent_kernel(
        functools.partial(_kernel, cfg=config, t1=fwd),
        jax.ShapeDtypeStruct((lhs.shape[0], n), out_dtype or lhs.dtype),
        num_sms)
    out = f(lhs, w, rank, r3t)
    return (out, rank) if emit_rank else out


def lora_linear_fwd_mgpu(x, w, a, b, scale: float, config: TileConfig = TileConfig(), num_sms: int | None = None,
                         *, return_su: bool = False):
    r"""``Y = X W^T + s (X A^T) B^T`` in one Mosaic GPU kernel (module doc); ``x`` may have leading batch axes.

    Args:
      x: ``[..., K]`` activations; w: ``[N, K]`` frozen weight (HF layout); a: ``[r, K]`` LoRA A; b: ``[N, r]`` LoRA
        B; all one 16-bit dtype.
      scale: ``s = lora_alpha / r`` (a Python float: it is compiled in).
      config: the tiles.
      num_sms: CTAs of the persistent grid (default: the device's multiprocessor count).
      return_su: also return ``sU = s X A^T`` ``[..., r]`` as the epilogue used it (rounded once to the operand
        dtype): the backward's ``dB = dY^T (sU)`` then needs no second pass over ``X`` (the LoRA block's mosaic
        backend).
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    why = supported(x2, w, a, b, config)
    if why is not None:
        raise ValueError(f"lora_linear_fwd_mgpu: {why}")
    m, n, r = x2.shape[0], w.shape[0], a.shape[0]
    c = config
    pad = pad_to_multiple
    out = _call(pad(x2, (2 * c.tile_m, c.tile_k)), pad(w, (c.tile_n, c.tile_k)), pad(a, (16, c.tile_k)),
                pad(b, (c.tile_n, 16)), scale=float(scale), config=config, num_sms=int(num_sms or _num_sms()),
                emit_rank=return_su)
    if return_su:
        return out[0][:m, :n].reshape(*lead, n), out[1][:m, :r].reshape(*lead, r)
    return out[:m, :n].reshape(*lead, n)


def lora_linear_dx_mgpu(dy, w, a, b, scale: float, out_dtype=jnp.float32, config: TileConfig = TileConfig(),
                        num_sms: int | None = None, *, return_sg: bool = False):
    r"""``dX = dY W + (s dY B) A`` in one Mosaic GPU kernel: the backward's input gradient of the LoRA projection,
    the forward kernel's loop with ``dY`` for ``X`` and ``W`` read untransposed (``sG = s dY B`` by XLA first,
    rounded once to the operand dtype, like ``sU`` forward).

    Args:
      dy: ``[..., N]`` output cotangent (16-bit); w: ``[N, K]``; a: ``[r, K]``; b: ``[N, r]``, one dtype.
      scale: ``s`` (a Python float).
      out_dtype: of ``dX`` (fp32 by default; the LoRA block asks for the operand dtype, its sums stay fp32).
      return_sg: also return ``sG = s dY B`` ``[..., r]`` as the epilogue used it (rounded once to the operand
        dtype): the backward's ``dA = (sG)^T X`` then needs no second pass over ``dY``.
    """
    lead = dy.shape[:-1]
    d2 = dy.reshape(-1, dy.shape[-1])
    why = supported_dx(d2, w, a, b, config)
    if why is not None:
        raise ValueError(f"lora_linear_dx_mgpu: {why}")
    (m, _), k, r = d2.shape, w.shape[1], a.shape[0]
    c = config
    pad = pad_to_multiple
    out = _call(pad(d2, (2 * c.tile_m, c.tile_k)), pad(w, (c.tile_k, c.tile_n)), pad(a, (16, c.tile_n)),
                pad(b, (c.tile_k, 16)), scale=float(scale), config=config, num_sms=int(num_sms or _num_sms()),
                mode="dx", out_dtype=jnp.dtype(out_dtype), emit_rank=return_sg)
    if return_sg:
        return out[0][:m, :k].reshape(*lead, k), out[1][:m, :r].reshape(*lead, r)
    return out[:m, :k].reshape(*lead, k)
