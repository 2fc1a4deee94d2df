r"""RMSNorm (Llama / Hugging Face ``LlamaRMSNorm``): reference, hand-written VJP, and the pieces the LoRA block reuses.

Math, per row :math:`x \in \mathbb{R}^H` (statistics in ``promote_types(dtype, float32)``: fp32 for bf16/f32, f64 for
f64):

.. math::

    r &= \bigl(\tfrac1H \textstyle\sum_j x_j^2 + \varepsilon\bigr)^{-1/2}, \qquad n = x\, r, \qquad
    y = w \odot n \\
    g &= \bar y \odot w \\
    \bar x &= r\,\bigl(g - n\, \tfrac1H \textstyle\sum_j g_j n_j\bigr) \\
    \bar w &= \textstyle\sum_{\text{rows}} \bar y \odot n

Hugging Face casts ``n`` back to the input dtype before multiplying by ``w``; so do we (it is the identity in
f32/f64). The backward saves ``x``, ``w`` and the fp32 row statistic ``r`` (one float per row, never in bf16, unlike
Pallas' ``rms_norm.py``) and recomputes ``n``. Unsloth never returns :math:`\bar w`; we always do.

Kernels (``backend="pallas"``; the XLA path stays the default): one block of ``block_rows`` whole rows per program
(the row padded to a power of two and masked, as Triton needs). The forward writes ``y`` and the fp32 ``r``; the
backward writes ``dx`` and, per program, the partial sum of ``dy * n`` over its rows (fp32), which are summed
outside the kernel (no atomics, so the result is deterministic). Through :mod:`jaxgrad.pallas_backend`: Triton on a
GPU, interpret mode elsewhere (any dtype, f64 included).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxgrad import pallas_backend as pb
from jaxgrad.ops.dtypes import compute_dtype

__all__ = ["rms_norm", "rms_norm_reference", "rms_norm_rstd", "rms_norm_apply", "rms_norm_bwd",
           "rms_norm_fwd_pallas", "rms_norm_bwd_pallas"]


def _check(x, weight, eps):
    for name, a in (("x", x), ("weight", weight)):
        if not hasattr(a, "dtype") or not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"rms_norm: '{name}' must be a floating-point array, got {getattr(a, 'dtype', type(a))}")
    if weight.ndim != 1 or x.shape[-1:] != weight.shape:
        raise ValueError(f"rms_norm: 'weight' must have shape (x.shape[-1],) = ({x.shape[-1]},), got {weight.shape}")
    if not eps > 0:
        raise ValueError(f"rms_norm: 'eps' must be > 0, got {eps}")


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Plain JAX, differentiated by ``jax.grad``: ``w * (x * rsqrt(mean(x^2) + eps)).astype(x.dtype)``."""
    xf = x.astype(compute_dtype(x.dtype))
    n = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * n.astype(x.dtype)


def rms_norm_rstd(x: jax.Array, eps: float) -> jax.Array:
    """The row statistic ``r = rsqrt(mean(x^2) + eps)`` in fp32 (f64 for f64 input), shape ``x.shape[:-1]``."""
    xf = x.astype(compute_dtype(x.dtype))
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps)


def rms_norm_apply(x: jax.Array, weight: jax.Array, rstd: jax.Array) -> jax.Array:
    """``y = w * n`` with ``n = x r`` from a saved ``rstd`` (the forward given its statistic)."""
    n = x.astype(rstd.dtype) * rstd[..., None]
    return weight.astype(x.dtype) * n.astype(x.dtype)


def rms_norm_bwd(x: jax.Array, weight: jax.Array, rstd: jax.Array, dy: jax.Array, dx_dtype=None):
    """``(dx, dw)`` of ``y = w * x r`` from the saved fp32 ``rstd``; ``dw`` summed over all leading axes.

    ``dx`` is returned in ``dx_dtype`` (default x's dtype; the block keeps its gradient sums in fp32)."""
    cdt = rstd.dtype
    n = x.astype(cdt) * rstd[..., None]  # recomputed, not saved
    dyf = dy.astype(cdt)
    g = dyf * weight.astype(cdt)  # g = dy * w
    # dx = r (g - n mean(g n))
    dx = rstd[..., None] * (g - n * jnp.mean(g * n, axis=-1, keepdims=True))
    # dw = sum_rows dy * n
    dw = jnp.sum((dyf * n).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(dx_dtype or x.dtype), dw.astype(weight.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Pallas kernels: grid over row blocks; each program holds `bm` whole rows padded to `bh = next_pow2(H)` lanes.
# ---------------------------------------------------------------------------------------------------------------
def _row_col_masks(bm, bh, rows, hidden):
    """(row mask [bm, 1], column mask [1, bh]) of the current program's block (1-D grid over row blocks)."""
    r = (pl.program_id(0) * bm + jnp.arange(bm)) < rows
    c = jnp.arange(bh) < hidden
    return r[:, None], c[None, :]


def _fwd_kernel(x_ref, w_ref, y_ref, r_ref, *, rows, hidden, eps):
    bm, bh = x_ref.shape
    rmask, cmask = _row_col_masks(bm, bh, rows, hidden)
    cdt = compute_dtype(x_ref.dtype)
    # Padding lanes and rows read 0: they add nothing to sum(x^2), and their outputs are never stored.
    x = pb.masked_load(x_ref, rmask & cmask).astype(cdt)
    w = pb.masked_load(w_ref, cmask[0])
    # r = rsqrt(mean(x^2) + eps), in fp32 (f64 for f64): divide by the true H, not the padded width.
    r = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / hidden + eps)
    # y = w * n with n cast to x's dtype first, as Hugging Face does; the product is rounded once (it is exact
    # in cdt, bf16 x bf16 fits in f32), so every backend gives the same bits.
    n = (x * r[:, None]).astype(x_ref.dtype).astype(cdt)
    pb.masked_store(y_ref, w.astype(x_ref.dtype).astype(cdt)[None, :] * n, rmask & cmask)
    pb.masked_store(r_ref, r, rmask[:, 0])


def _bwd_kernel(x_ref, w_ref, r_ref, dy_ref, dx_ref, dwp_ref, *, rows, hidden):
    bm, bh = x_ref.shape
    rmask, cmask = _row_col_masks(bm, bh, rows, hidden)
    cdt = r_ref.dtype
    m = rmask & cmask
    x = pb.masked_load(x_ref, m).astype(cdt)
    dy = pb.masked_load(dy_ref, m).astype(cdt)
    w = pb.masked_load(w_ref, cmask[0]).astype(cdt)
    r = pb.masked_load(r_ref, rmask[:, 0]).astype(cdt)
    n = x * r[:, None]  # x_hat, recomputed from the saved fp32 r (never saved itself)
    wg = w[None, :] * dy
    # With g = dy:  dx = rstd * (w*g - x_hat * mean(x_hat * w * g)),  dw = sum_rows(g * x_hat).
    # Padded lanes have x_hat = w*g = 0, so the sum over the padded row is the true row's sum; divide by H.
    dx = r[:, None] * (wg - n * (jnp.sum(n * wg, axis=1, keepdims=True) / hidden))
    pb.masked_store(dx_ref, dx, m)
    # dw = sum_rows(g * x_hat): this program's partial sum over its rows (masked rows are 0), reduced outside.
    pb.masked_store(dwp_ref, jnp.sum(dy * n, axis=0, keepdims=True), cmask)


# At most this many elements per program and tensor: 16 rows x 2048 lanes in fp32 over 4 warps held 256 values per
# thread and tensor (the backward keeps six such tiles), far past the register file; the block with it measured
# 10.7 ms against 7.5 ms for the XLA norms on the H100
# (benchmarks/results/lora-nvidia-h100-80gb-hbm3-bf16-20261123-172130.json).
# Capping the tile and giving wide rows more warps keeps ~16 values per thread and tensor.
_TILE_ELEMENTS = 4096


def _row_tiling(rows, hidden, block_rows):
    """(rows per program, padded row width, programs, warps): whole rows, at most _TILE_ELEMENTS per tile."""
    bh = pb.block_size(hidden, max(hidden, 1) * 2, min_block=16)  # the whole row, padded to a power of two
    bm = pb.block_size(rows, max(1, min(block_rows, _TILE_ELEMENTS // bh)), min_block=1)
    warps = min(16, max(4, bm * bh // 512))
    return bm, bh, pl.cdiv(rows, bm), warps


def rms_norm_fwd_pallas(x, weight, eps: float, *, interpret=None, block_rows: int = 16):
    """Kernel forward: ``(y, rstd)`` with ``rstd`` fp32 (f64 for f64), shape ``x.shape[:-1]``."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    rows = x2.shape[0]
    bm, bh, nblk, warps = _row_tiling(rows, hidden, block_rows)
    cdt = compute_dtype(x.dtype)
    call = pb.pallas_call(
        functools.partial(_fwd_kernel, rows=rows, hidden=hidden, eps=float(eps)),
        out_shape=[jax.ShapeDtypeStruct(x2.shape, x.dtype), jax.ShapeDtypeStruct((rows,), cdt)],
        grid=(nblk,),
        in_specs=[pl.BlockSpec((bm, bh), lambda i: (i, 0)), pl.BlockSpec((bh,), lambda i: (0,))],
        out_specs=[pl.BlockSpec((bm, bh), lambda i: (i, 0)), pl.BlockSpec((bm,), lambda i: (i,))],
        name="rms_norm_fwd",
        interpret=interpret,
        num_warps=warps,
    )
    y, r = call(x2, weight)
    return y.reshape(x.shape), r.reshape(x.shape[:-1])


def rms_norm_bwd_pallas(x, weight, rstd, dy, dx_dtype=None, *, interpret=None, block_rows: int = 16):
    """Kernel backward: ``(dx, dw)`` as :func:`rms_norm_bwd` (dx in ``dx_dtype``, default x's dtype). ``dy`` is read
    in its own dtype, like :func:`rms_norm_bwd` (the LoRA block passes its fp32 gradient sums with bf16 ``x``;
    rounding them to bf16 first would add a rounding the XLA path does not have)."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    rows = x2.shape[0]
    bm, bh, nblk, warps = _row_tiling(rows, hidden, block_rows)
    cdt = rstd.dtype
    row_spec = pl.BlockSpec((bm, bh), lambda i: (i, 0))
    dx, dwp = pb.pallas_call(
        functools.partial(_bwd_kernel, rows=rows, hidden=hidden),
        out_shape=[jax.ShapeDtypeStruct(x2.shape, dx_dtype or x.dtype), jax.ShapeDtypeStruct((nblk, hidden), cdt)],
        grid=(nblk,),
        in_specs=[row_spec, pl.BlockSpec((bh,), lambda i: (0,)), pl.BlockSpec((bm,), lambda i: (i,)), row_spec],
        out_specs=[row_spec, pl.BlockSpec((1, bh), lambda i: (i, 0))],
        name="rms_norm_bwd",
        interpret=interpret,
        num_warps=warps,
    )(x2, weight, rstd.reshape(-1), dy.reshape(x2.shape))
    # The per-program partial sums of dw, reduced here (fp32, nblk x H: small) and rounded once.
    return dx.reshape(x.shape), jnp.sum(dwp, axis=0).astype(weight.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Public op
# ---------------------------------------------------------------------------------------------------------------
@jax.custom_vjp
def _rms_norm(x, weight, eps):
    return _fwd(x, weight, eps)[0]


def _fwd(x, weight, eps):
    rstd = rms_norm_rstd(x, eps)
    return rms_norm_apply(x, weight, rstd), (x, weight, rstd, eps)


def _bwd(res, dy):
    x, weight, rstd, eps = res
    dx, dw = rms_norm_bwd(x, weight, rstd, dy)
    return dx, dw, jnp.zeros_like(eps)


_rms_norm.defvjp(_fwd, _bwd)


# The kernel path takes eps as a static float (it is baked into the kernel); rms_norm's eps is always concrete.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rms_norm_pallas(x, weight, eps, interpret, block_rows):
    return _pfwd(x, weight, eps, interpret, block_rows)[0]


def _pfwd(x, weight, eps, interpret, block_rows):
    y, rstd = rms_norm_fwd_pallas(x, weight, eps, interpret=interpret, block_rows=block_rows)
    return y, (x, weight, rstd)


def _pbwd(eps, interpret, block_rows, res, dy):
    x, weight, rstd = res
    return rms_norm_bwd_pallas(x, weight, rstd, dy, interpret=interpret, block_rows=block_rows)


_rms_norm_pallas.defvjp(_pfwd, _pbwd)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6, *, backend: str = "xla",
             interpret: bool | None = None, block_rows: int = 16) -> jax.Array:
    """RMSNorm over the last axis with a hand-written VJP returning ``dx`` and ``dw``.

    Args:
      x: ``[..., H]`` floating array (bf16, f16, f32 or f64).
      weight: ``[H]`` scale.
      eps: the epsilon inside the square root (HF's ``rms_norm_eps``), > 0. Not differentiated.
      backend: ``"xla"`` (default; the equations in jnp) or ``"pallas"`` (the fused kernels; interpret mode off-GPU).
      interpret: force Pallas interpret mode (``None``: on unless running on a GPU).
      block_rows: rows per kernel program (rounded to a power of two).
    """
    _check(x, weight, eps)
    if backend not in ("xla", "pallas"):
        raise ValueError(f"rms_norm: backend must be 'xla' or 'pallas', got {backend!r}")
    if backend == "pallas" and x.size > 0:
        return _rms_norm_pallas(x, weight, float(eps), interpret, block_rows)
    return _rms_norm(x, weight, jnp.asarray(eps, compute_dtype(x.dtype)))


def audit_cases():
    """Cases for ``jaxgrad audit``: both custom VJPs (``backend="xla"`` and the kernels' ``"pallas"``), x white
    noise ``[2, rows, H]`` with H not a power of two, weight ``1 + N(0, 0.2^2)``; several kernel programs (8 rows
    each)."""
    from jaxgrad.ops.registry import OpAudit

    def make_args(key, size):
        rows, hidden = size
        kx, kw = jax.random.split(key)
        return jax.random.normal(kx, (2, rows, hidden)), 1 + 0.2 * jax.random.normal(kw, (hidden,))

    def fn_for(backend):
        def fn(x, weight):
            return rms_norm(x, weight, 1e-5, backend=backend, block_rows=8)
        fn.__name__ = f"rms_norm_{backend}"
        return fn

    def reference(x, weight):
        return rms_norm_reference(x, weight, 1e-5)

    sizes = ((7, 24), (19, 72), (61, 200))
    return tuple(OpAudit(f"rms_norm[{b}]", fn_for(b), reference, make_args, sizes, arg_names=("x", "weight"),
                         backend=b) for b in ("xla", "pallas"))
