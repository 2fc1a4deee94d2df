r"""The LM head's logits with the softmax's per-tile statistics in the epilogue: one Mosaic GPU kernel on Hopper
(``wgmma``), the ``mosaic`` backend of :func:`jaxgrad.ops.lm_head_loss.lm_head_loss` with a frozen head.

For hidden rows ``h [M, H]`` and the head ``W [V, H]`` (16-bit), with the vocabulary cut into tiles
:math:`\tau` of ``tile_n`` columns, the kernel computes each output tile :math:`Z_\tau = h W_\tau^\top` in fp32
registers (the K loop of :mod:`jaxgrad.ops.lora_linear_mgpu`: two compute warpgroups on ``wgmma``, a memory
warpgroup streaming ``h`` and ``W`` tiles by TMA) and, instead of storing ``Z``, its epilogue writes

.. math::

    m_{i\tau} = \max_{v \in \tau} z_{iv}, \qquad
    P_{iv} = e^{z_{iv} - m_{i\tau}} \;(v \in \tau), \qquad
    s_{i\tau} = \sum_{v \in \tau} P_{iv},

``P [M, V]`` in fp32 and ``m``, ``s`` as ``[V / tile_n, M]`` fp32 (a row per vocabulary tile, so that each
warpgroup's store is contiguous). Columns past ``V`` (the head padded to a whole tile) are ``-inf`` logits: they add
nothing to ``s`` and their ``P`` is 0. The row's statistics follow on XLA from the ``[V / tile_n, M]`` partials:

.. math::

    m_i = \max_\tau m_{i\tau}, \qquad s_i = \sum_\tau s_{i\tau} e^{m_{i\tau} - m_i}, \qquad
    \operatorname{softmax}(z_i)_v = P_{iv}\, \frac{e^{m_{i\tau(v)} - m_i}}{s_i},

and ``lse_i = m_i + log s_i``. What this saves against XLA's chunked form (cuBLAS's fp32 ``Z``, then a pass for
the row maximum, one for the sum of exponentials and one forming ``dZ``): two reads of the fp32 ``[M, V]`` block.
``P`` is the same bytes as ``Z``, and ``dZ = P e^{m_\tau - m} / s - onehot`` is one pass over it. The target logit
is not in the epilogue: ``z_{i y_i} = h_i \cdot W_{y_i}`` is one ``[M, H]`` product by XLA (fp32 accumulation of
the same bf16 products, in another order).

Exponentials are ``exp2`` of ``(z - m) \log_2 e`` (the GPU's ``ex2``, relative error about ``2^{-22}``), far below
the bf16 rounding ``dZ`` gets for its product.

Scope: bf16 or f16 operands; shapes padded to the tiles (rows to ``2 tile_m``, ``H`` to ``tile_k``, ``V`` to
``tile_n``) by :func:`lm_head_softmax_tiles_mgpu` (zero rows of ``h`` give rows of ``P`` that are sliced off; zero
columns of ``H`` add exact zeros). It needs a Hopper GPU (Mosaic GPU has no public interpreter): GPU tests compare it
with the formulas at fresh random inputs and odd sizes; on a CPU its lowering is checked.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxgrad.ops import mgpu_common
from jaxgrad.ops.dtypes import compute_dtype
from jaxgrad.ops.mgpu_common import num_sms as _num_sms, pad_to_multiple

__all__ = ["TileConfig", "lm_head_softmax_tiles_mgpu", "row_statistics", "softmax_tiles_reference", "supported"]


@dataclasses.dataclass(frozen=True)
class TileConfig(mgpu_common.GemmTiles):
    """Tiles of :func:`lm_head_softmax_tiles_mgpu` (a CTA computes ``2 tile_m x tile_n`` of ``P``): 3 stages of
    48 KiB of operands, and 32 KiB of fp32 epilogue slots."""

    epi_tile_n: int = 32  # fp32: 128 bytes a row


def supported(h, w) -> str | None:
    """``None`` when :func:`lm_head_softmax_tiles_mgpu` can run these operands, else why not (naming the
    argument)."""
    if getattr(h, "ndim", None) != 2 or getattr(w, "ndim", None) != 2:
        return f"'h' and 'w' must be 2-D ([M, H], [V, H]), got shapes {jnp.shape(h)} and {jnp.shape(w)}"
    if h.shape[1] != w.shape[1]:
        return f"'h' [M, H] and 'w' [V, H] must share H, got {h.shape} and {w.shape}"
    dts = {jnp.dtype(h.dtype), jnp.dtype(w.dtype)}
    if len(dts) != 1 or dts.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"'h' and 'w' must share one 16-bit dtype (bf16 or f16), got {h.dtype} and {w.dtype}"
    return None


def _kernel(h_gmem, w_gmem, p_gmem, m_gmem, s_gmem, *, cfg: TileConfig, vocab: int):
    """``P``, ``m``, ``s`` of the module doc for the padded operands; ``vocab`` is the unpadded ``V``."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    dtype = h_gmem.dtype
    m, k = h_gmem.shape
    n = p_gmem.shape[1]
    tile_m, tile_n, tile_k = cfg.tile_m, cfg.tile_n, cfg.tile_k
    epi_m, epi_n = cfg.epi_tile_m, cfg.epi_tile_n
    cta_m = 2 * tile_m  # warpgroup i owns rows [i tile_m, (i + 1) tile_m) of the CTA's tile
    m_iters, n_iters, k_iters = m // cta_m, n // tile_n, k // tile_k
    log2e = math.log2(math.e)

    def smem_transforms(minor, dt=dtype):  # TMA/wgmma layout of a [rows, minor] tile
        return mgpu_common.smem_transforms(minor, dt)

    pipeline = mgpu_common.k_pipeline(dtype, (cta_m, tile_k), (tile_n, tile_k), lambda kk: (0, kk), k_iters,
                                      cfg.max_concurrent_steps)

    ignore = lambda *_, **__: None  # noqa: E731 - the bodies do not change the pipeline's allocations
    slots = min(2, (tile_m // epi_m) * (tile_n // epi_n))

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline(ignore, ignore).get_allocations(h_gmem, w_gmem),
        p_smem=plgpu.SMEM((2, slots, epi_m, epi_n), jnp.float32, transforms=smem_transforms(epi_n, jnp.float32)),
        m_smem=plgpu.SMEM((2, tile_m), jnp.float32),
        s_smem=plgpu.SMEM((2, tile_m), jnp.float32),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, p_smem, m_smem, s_smem):
        wg = lax.axis_index("wg")

        @mgpu_common.persistent_tiles((m_iters, n_iters), cfg.grid_tile_width)
        def _tile(m_idx, n_idx):
            cta_m_slice = pl.ds(m_idx * cta_m, cta_m)
            n_slice = pl.ds(n_idx * tile_n, tile_n)
            wg_m_slice = pl.ds(wg * tile_m, tile_m)
            rows = pl.ds(m_idx * cta_m + wg * tile_m, tile_m)

            def compute_context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                def _acc_scope(acc_ref):
                    eval_pipeline(acc_ref)
                    z = acc_ref[...]
                    cols = plgpu.broadcasted_iota(jnp.int32, (tile_m, tile_n), 1, layout=plgpu.Layout.WGMMA)
                    z = jnp.where(cols + n_idx * tile_n < vocab, z, -jnp.inf)  # the head's padding columns
                    m_t = z.max(axis=1)
                    p = jnp.exp2(z * log2e - lax.broadcast_in_dim(m_t * log2e, z.shape, [0]))
                    s_t = p.sum(axis=1)
                    # the previous tile's stores have read their shared memory before it is written again
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    m_smem[wg] = m_t
                    s_smem[wg] = s_t
                    mgpu_common.store_tile(p, p_smem, wg, p_gmem.at[cta_m_slice, n_slice].at[wg_m_slice],
                                           epi_m, epi_n)
                    plgpu.copy_smem_to_gmem(m_smem.at[wg], m_gmem.at[n_idx, rows])
                    plgpu.copy_smem_to_gmem(s_smem.at[wg], s_gmem.at[n_idx, rows])

            def mma_body(_, h_smem, w_smem, acc_ref):
                plgpu.wgmma(acc_ref, h_smem.at[wg_m_slice], w_smem.transpose((1, 0)))  # Z += h_k W_k^T
                plgpu.wgmma_wait(0)  # this step's product before the next step is issued
                return acc_ref

            pipeline(mma_body, compute_context)(h_gmem.at[cta_m_slice, :], w_gmem.at[n_slice, :],
                                                allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("vocab", "config", "num_sms"))
def _call(h, w, *, vocab, config, num_sms):
    m, n = h.shape[0], w.shape[0]
    tiles = n // config.tile_n
    f = mgpu_common.persistent_kernel(
        functools.partial(_kernel, cfg=config, vocab=vocab),
        (jax.ShapeDtypeStruct((m, n), jnp.float32), jax.ShapeDtypeStruct((tiles, m), jnp.float32),
         jax.ShapeDtypeStruct((tiles, m), jnp.float32)),
        num_sms)
    return f(h, w)


def lm_head_softmax_tiles_mgpu(h, w, config: TileConfig = TileConfig(), num_sms: int | None = None):
    r"""``(P, m_tiles, s_tiles)`` of the module doc for ``h [M, H]`` and ``w [V, H]`` (one 16-bit dtype).

    Returns:
      ``P`` ``[M, V_pad]`` fp32 (``V_pad = V`` rounded up to ``tile_n``; its columns past ``V`` are 0),
      ``m_tiles`` and ``s_tiles`` ``[V_pad / tile_n, M]`` fp32: each vocabulary tile's row maximum and sum of
      ``P``. :func:`row_statistics` turns them into the rows' ``m``, ``s`` and the softmax's per-tile factor.
    """
    why = supported(h, w)
    if why is not None:
        raise ValueError(f"lm_head_softmax_tiles_mgpu: {why}")
    c = config
    m, v = h.shape[0], w.shape[0]
    p, m_t, s_t = _call(pad_to_multiple(h, (2 * c.tile_m, c.tile_k)), pad_to_multiple(w, (c.tile_n, c.tile_k)),
                        vocab=int(v), config=c, num_sms=int(num_sms or _num_sms()))
    return p[:m], m_t[:, :m], s_t[:, :m]


def row_statistics(m_tiles, s_tiles):
    r"""``(m, s, factor)`` from the per-tile partials ``[tiles, M]``: the row maximum ``m_i = max_tau m_{i tau}``,
    the sum ``s_i = sum_tau s_{i tau} e^{m_{i tau} - m_i}`` (so ``lse = m + log s``), and ``factor [M, tiles] =
    e^{m_{i tau} - m_i} / s_i``, by which a tile's ``P`` becomes the softmax."""
    m = jnp.max(m_tiles, axis=0)
    rel = jnp.exp(m_tiles - m[None, :])
    s = jnp.sum(s_tiles * rel, axis=0)
    return m, s, (rel / s[None, :]).T


def softmax_tiles_reference(h, w, tile_n: int = TileConfig.tile_n):
    """What :func:`lm_head_softmax_tiles_mgpu` returns, in plain JAX (logits in ``promote_types(dtype, float32)``,
    ``exp`` instead of ``exp2``): the oracle of the kernel's GPU tests, and its stand-in where the kernel cannot run
    (the float64 CPU tests of the code around it)."""
    v = w.shape[0]
    vp = -(-v // tile_n) * tile_n
    z = jnp.einsum("mh,vh->mv", h, w, preferred_element_type=compute_dtype(h.dtype))
    z = jnp.pad(z, ((0, 0), (0, vp - v)), constant_values=-jnp.inf).reshape(h.shape[0], vp // tile_n, tile_n)
    m_t = jnp.max(z, axis=-1)
    p = jnp.exp(z - m_t[..., None])
    return p.reshape(h.shape[0], vp), m_t.T, jnp.sum(p, axis=-1).T
