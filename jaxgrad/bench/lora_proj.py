"""The ``lora_proj`` suite: one LoRA projection ``Y = X W^T + s (X A^T) B^T`` at the LoRA block's four shapes (q/o,
k/v, gate/up, down at batch 4 x seq 2048, hidden 2048, intermediate 5632; r = 16), forward and (suite name
``lora_proj_dx``) the backward's ``dX``: the Mosaic GPU kernels (GPU only) against XLA's forms and the base GEMM alone.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxgrad.bench import harness as bm


# (M, K, N): q/o, k/v, gate/up, down of the block at batch 4 x seq 2048, hidden 2048, intermediate 5632; r = 16
LORA_PROJ_SHAPES = {"small": [(512, 256, 128)],
                    "full": [(8192, 2048, 2048), (8192, 2048, 1024), (8192, 2048, 5632), (8192, 5632, 2048)]}
LORA_PROJ_RANK = 16


def lora_proj_cost(m: int, k: int, n: int, r: int) -> tuple[float, float]:
    """(flops, bytes) of ``Y = X W^T + s (X A^T) B^T``: ``2 M K N`` base, ``2 M K r + 2 M r N`` LoRA; bytes: X, W,
    A, B read and Y written once (bf16)."""
    return 2.0 * m * k * (n + r) + 2.0 * m * r * n, 2.0 * (m * k + n * k + r * k + n * r + m * n)


def _lora_proj_variants(on_gpu: bool) -> dict[str, Callable]:
    from jaxgrad.ops.lora_linear import lora_linear_fwd
    from jaxgrad.ops.lora_linear_mgpu import lora_linear_fwd_mgpu

    s = 2.0
    v = {"xla fold-b (block default)": lambda x, w, a, b: lora_linear_fwd(x, w, a, b, s, fold_b=True),
         "xla unfolded": lambda x, w, a, b: lora_linear_fwd(x, w, a, b, s),
         "x W^T alone (cuBLAS, no LoRA)": lambda x, w, a, b: lora_linear_fwd(x, w, None, None, s)}
    if on_gpu:
        v = {"mosaic-gpu (sU from XLA, default)": lambda x, w, a, b: lora_linear_fwd_mgpu(x, w, a, b, s), **v}
    return v


def _lora_proj_dx_variants(on_gpu: bool) -> dict[str, Callable]:
    from jaxgrad.ops.lora_linear import lora_linear_bwd
    from jaxgrad.ops.lora_linear_mgpu import lora_linear_dx_mgpu

    s, f32 = 2.0, jnp.float32

    def xla_dx(dy, w, a, b):  # the block's XLA dX: dY W in fp32 + s (G A), G = dY B kept in fp32
        x = jnp.zeros((dy.shape[0], w.shape[1]), dy.dtype)  # dX does not read x; dA / dB are dead code here
        return lora_linear_bwd(x, w, a, b, s, None, dy, f32)[0]

    v = {"xla dX (block default)": xla_dx,
         "dY W alone (cuBLAS, no LoRA)": lambda dy, w, a, b: jnp.matmul(dy, w, preferred_element_type=f32)}
    if on_gpu:
        bf16 = jnp.bfloat16
        v = {"mosaic-gpu dX, fp32 out": lambda dy, w, a, b: lora_linear_dx_mgpu(dy, w, a, b, s),
             "mosaic-gpu dX, bf16 out (sG from XLA; mosaic block default)":
                 lambda dy, w, a, b: lora_linear_dx_mgpu(dy, w, a, b, s, out_dtype=bf16),
             **_mosaic_example_variants(), **v}
    return v


def _mosaic_example_variants() -> dict[str, Callable]:
    """``dY W`` alone (no LoRA, bf16 out) by JAX's own Hopper matmul example (``hopper_matmul_mgpu``): the same
    warp-specialised pipeline as our kernel without its rank-r work, at our CTA tile (2 x 128 rows x 128 columns,
    k 64) with 3 and 4 stages, and at 128 rows x 2 x 128 columns -- what the LoRA terms cost our kernel, and what
    a plain Mosaic GPU GEMM reaches against cuBLAS at these shapes."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    def cfg(stages, wg_dim):
        return hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=stages, epi_tile_m=64,
                               epi_tile_n=64, grid_minor_dim=hm.MatmulDimension.N, grid_tile_width=8,
                               wg_dimension=wg_dim)

    m_, n_ = hm.MatmulDimension.M, hm.MatmulDimension.N
    return {f"jax example mosaic dY W (no LoRA), {name}": (lambda c: lambda dy, w, a, b: hm.matmul(dy, w, None, c))(c)
            for name, c in (("CTA 256x128, 3 stages", cfg(3, m_)), ("CTA 256x128, 4 stages", cfg(4, m_)),
                            ("CTA 128x256, 4 stages", cfg(4, n_)))}


def suite_lora_proj(sizes: str, precision: str, *, repeats: int = 20, warmup: int = 3) -> list[bm.Row]:
    """One LoRA projection's forward ``X W^T + s (X A^T) B^T`` (bf16, r = 16) at the block's four shapes: the Mosaic
    GPU kernel (:mod:`jaxgrad.ops.lora_linear_mgpu`; GPU only), XLA's fold-b and unfolded forms, and the base GEMM
    alone (what cuBLAS does without the LoRA terms); then (suite name ``lora_proj_dx``) its backward's
    ``dX = dY W + (s dY B) A`` in fp32: the Mosaic GPU kernel, the block's XLA form and ``dY W`` alone."""
    variants = _lora_proj_variants(jax.default_backend() == "gpu")
    dx_variants = _lora_proj_dx_variants(jax.default_backend() == "gpu")
    rows: list[bm.Row] = []
    for m, k, n in LORA_PROJ_SHAPES[sizes]:
        r = LORA_PROJ_RANK
        keys = jax.random.split(jax.random.key(m + k + n), 4)
        x, w, a, b = (jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16) * sd
                      for kk, shape, sd in zip(keys, [(m, k), (n, k), (r, k), (n, r)],
                                               [1.0, k ** -0.5, k ** -0.5, r ** -0.5]))
        flops, bytes_moved = lora_proj_cost(m, k, n, r)
        rows += bm.run_variants("lora_proj", variants, (x, w, a, b), sizes={"M": m, "K": k, "N": n, "r": r},
                                flops=flops, bytes_moved=bytes_moved, precision=precision, floor_precision="tf32",
                                warmup=warmup, repeats=repeats)
        # the backward's dX = dY W + (s dY B) A of the same projection (fp32 out, as the block keeps it)
        dy = jax.random.normal(jax.random.fold_in(keys[0], 1), (m, n), jnp.float32).astype(jnp.bfloat16)
        flops, bytes_moved = lora_proj_cost(m, n, k, r)
        bytes_moved += 2.0 * m * k  # dX written in fp32
        rows += bm.run_variants("lora_proj_dx", dx_variants, (dy, w, a, b), sizes={"M": m, "K": k, "N": n, "r": r},
                                flops=flops, bytes_moved=bytes_moved, precision=precision, floor_precision="tf32",
                                warmup=warmup, repeats=repeats)
    return rows
