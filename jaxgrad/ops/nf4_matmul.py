r"""Fused NF4 dequantise + matmul for a frozen QLoRA base weight: reference and Pallas kernels side by side.

For ``x [..., K]`` and an NF4 weight ``W [O, K]`` (:class:`jaxgrad.lora.nf4.NF4Weight`, bitsandbytes' layout):

.. math::

    W_{ok} &= \mathrm{code}[\,q_f\,]\cdot \mathrm{absmax}[\,\lfloor f / B \rfloor\,], \qquad f = oK + k
        \quad (\text{row-major flat index}, B \text{ the blocksize}) \\
    q_f &= \text{high nibble of } \mathrm{packed}[\lfloor f/2 \rfloor] \text{ if } f \text{ even, else the low one} \\
    Y &= X\, W^\top, \qquad \bar X = \bar Y\, W, \qquad \bar W = 0 \ (\text{frozen})

The kernels read the packed uint8 codes and the per-block absmax inside the kernel, one ``[bk, bn]`` (forward) or
``[bo, bk]`` (backward) tile of ``W`` at a time, so the dequantised weight is never materialised. Indices are
computed per element from the flat position ``f``, which handles rows that start mid-byte (odd ``K``), blocks that
straddle rows (``K`` not a multiple of ``B``) and the partial last block alike. Each tile is dequantised in float32
(``code * absmax``, as bitsandbytes does), rounded once to ``x``'s dtype (what ``nf4_dequantize(w, x.dtype)`` gives
the XLA path), and multiplied with float32 accumulation (float64 for f64 ``x``); the output is rounded once.

Double quantisation: the second level only touches the ``n/B`` absmax values, so it is decoded outside the kernel
(:func:`jaxgrad.lora.nf4.nf4_absmax`, two roundings as bitsandbytes) and the kernel gets float32 absmax either way.

On a GPU these are Triton kernels (``jaxgrad.pallas_backend``); the code lookup and the byte reads are pointer
gathers from small refs. f32 dots ask for ``HIGHEST`` so Triton does not drop to TF32. Mosaic GPU (wgmma) versions
are the next step for the matmul-bound shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxgrad import pallas_backend as pb
from jaxgrad.lora.nf4 import NF4_CODE, NF4Weight, nf4_absmax, nf4_dequantize

__all__ = ["nf4_matmul", "nf4_matmul_reference"]


def _cdt(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def nf4_matmul_reference(x: jax.Array, w: NF4Weight) -> jax.Array:
    """Plain JAX: ``x @ nf4_dequantize(w, x.dtype).T`` accumulated in fp32 (f64 for f64), W frozen."""
    cdt = _cdt(x.dtype)
    wd = jax.lax.stop_gradient(nf4_dequantize(w, x.dtype))
    return (x.astype(cdt) @ wd.astype(cdt).T).astype(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------
def _dequant_tile(packed_ref, absmax_ref, code_ref, o_idx, k_idx, mask, *, in_features, log2_block, dtype):
    """``W[o_idx, k_idx]`` (broadcast shapes) in ``dtype``, 0 where ``mask`` is False; read from the packed codes."""
    f = jnp.where(mask, o_idx * in_features + k_idx, 0)  # flat index; masked lanes point at element 0 (in bounds)
    byte = packed_ref[f >> 1].astype(jnp.int32)  # gather: two codes per byte
    q = jnp.where((f & 1) == 0, byte >> 4, byte & 0xF)  # first element in the high nibble
    v = code_ref[q] * absmax_ref[f >> log2_block]  # float32, as bitsandbytes' dequantise
    return jnp.where(mask, v, 0.0).astype(dtype)  # one rounding to x's dtype, like nf4_dequantize(w, x.dtype)


def _dot(a, b, cdt):
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None  # no TF32 for f32 inputs on a GPU
    return jnp.dot(a, b, preferred_element_type=cdt, precision=prec).astype(cdt)


def _fwd_kernel(x_ref, packed_ref, absmax_ref, code_ref, y_ref, *, n_rows, out_f, in_f, log2_block, w_dtype, bk,
                nk):
    bm, bn = y_ref.shape
    cdt = _cdt(x_ref.dtype)
    rows = pl.program_id(0) * bm + jnp.arange(bm)
    outs = pl.program_id(1) * bn + jnp.arange(bn)
    rmask, omask = rows < n_rows, outs < out_f

    def body(kk, acc):
        ks = kk * bk + jnp.arange(bk)
        kmask = ks < in_f
        x = pb.masked_load(x_ref.at[:, pl.ds(kk * bk, bk)], rmask[:, None] & kmask[None, :])
        # W^T tile [bk, bn]: element (k, o) of W^T is W[o, k]
        wt = _dequant_tile(packed_ref, absmax_ref, code_ref, outs[None, :], ks[:, None],
                           kmask[:, None] & omask[None, :], in_features=in_f, log2_block=log2_block,
                           dtype=w_dtype).astype(x_ref.dtype)
        return acc + _dot(x, wt, cdt)  # Y += X[:, k-tile] W[:, k-tile]^T

    acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), cdt))
    pb.masked_store(y_ref, acc, rmask[:, None] & omask[None, :])


def _bwd_kernel(g_ref, packed_ref, absmax_ref, code_ref, dx_ref, *, n_rows, out_f, in_f, log2_block, w_dtype, bo,
                no):
    bm, bk = dx_ref.shape
    cdt = _cdt(g_ref.dtype)
    rows = pl.program_id(0) * bm + jnp.arange(bm)
    ks = pl.program_id(1) * bk + jnp.arange(bk)
    rmask, kmask = rows < n_rows, ks < in_f

    def body(oo, acc):
        os_ = oo * bo + jnp.arange(bo)
        omask = os_ < out_f
        g = pb.masked_load(g_ref.at[:, pl.ds(oo * bo, bo)], rmask[:, None] & omask[None, :])
        # rounded to w_dtype first (the forward's weight), then widened to g's dtype (the block's fp32 dY)
        w = _dequant_tile(packed_ref, absmax_ref, code_ref, os_[:, None], ks[None, :],
                          omask[:, None] & kmask[None, :], in_features=in_f, log2_block=log2_block,
                          dtype=w_dtype).astype(g_ref.dtype)
        return acc + _dot(g, w, cdt)  # dX += dY[:, o-tile] W[o-tile, :]

    acc = jax.lax.fori_loop(0, no, body, jnp.zeros((bm, bk), cdt))
    pb.masked_store(dx_ref, acc, rmask[:, None] & kmask[None, :])


def _full(a):
    return pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # the whole (small or gathered-from) array


def _call(kernel, act, packed, absmax, out_cols, red_cols, blocks, name, interpret, static, loop_kw, out_dtype):
    """Grid (row blocks, out-column blocks); each program loops over the reduction axis in tiles of ``bred``."""
    bm, bout, bred = blocks
    n = act.shape[0]
    nred = pl.cdiv(red_cols, bred)
    code = jnp.asarray(NF4_CODE, jnp.float32)
    return pb.pallas_call(
        functools.partial(kernel, **static, **{loop_kw: nred}),
        out_shape=jax.ShapeDtypeStruct((n, out_cols), out_dtype or act.dtype),
        grid=(pl.cdiv(n, bm), pl.cdiv(out_cols, bout)),
        # the activation's row block spans the whole reduction axis, rounded up to whole tiles (masked in-kernel)
        in_specs=[pl.BlockSpec((bm, nred * bred), lambda i, j: (i, 0)), _full(packed), _full(absmax), _full(code)],
        out_specs=pl.BlockSpec((bm, bout), lambda i, j: (i, j)),
        name=name,
        interpret=interpret,
    )(act, packed, absmax, code)


def _blocks(n, a, b, block_m, block_n, block_k):
    return (pb.block_size(n, block_m), pb.block_size(a, block_n), pb.block_size(b, block_k))


def nf4_matmul_fwd_pallas(x, packed, absmax, shape, blocksize, *, interpret=None, block_m=64, block_n=64,
                          block_k=64, w_dtype=None, out_dtype=None):
    """Kernel ``x @ W^T`` (x ``[..., K]``, ``shape = (O, K)``) from packed codes and float32 absmax.

    ``w_dtype``: the dtype each dequantised weight element is rounded to (default x's; what ``nf4_dequantize(w,
    w_dtype)`` gives). ``out_dtype``: the output's (default x's; the LoRA block asks for its fp32 accumulator so
    that the base product and the LoRA term are rounded once, together)."""
    out_f, in_f = shape
    x2 = x.reshape(-1, in_f)
    bm, bn, bk = _blocks(x2.shape[0], out_f, in_f, block_m, block_n, block_k)
    static = dict(n_rows=x2.shape[0], out_f=out_f, in_f=in_f, log2_block=blocksize.bit_length() - 1,
                  w_dtype=jnp.dtype(w_dtype or x.dtype), bk=bk)
    y = _call(_fwd_kernel, x2, packed, absmax, out_f, in_f, (bm, bn, bk), "nf4_matmul_fwd", interpret, static, "nk",
              out_dtype)
    return y.reshape(*x.shape[:-1], out_f)


def nf4_matmul_dx_pallas(g, packed, absmax, shape, blocksize, *, interpret=None, block_m=64, block_n=64,
                         block_k=64, w_dtype=None, out_dtype=None):
    """Kernel ``g @ W`` (g ``[..., O]``): x's gradient of ``x @ W^T``. ``w_dtype`` (default g's): the rounding of the
    dequantised weight, i.e. the forward's activation dtype when ``g`` is wider (the LoRA block's fp32 ``dY`` with a
    bf16 forward: the gradient of the bf16-rounded weight the forward used); ``out_dtype`` default g's."""
    out_f, in_f = shape
    g2 = g.reshape(-1, out_f)
    bm, bo, bk = _blocks(g2.shape[0], out_f, in_f, block_m, block_n, block_k)
    static = dict(n_rows=g2.shape[0], out_f=out_f, in_f=in_f, log2_block=blocksize.bit_length() - 1,
                  w_dtype=jnp.dtype(w_dtype or g.dtype), bo=bo)
    dx = _call(_bwd_kernel, g2, packed, absmax, in_f, out_f, (bm, bk, bo), "nf4_matmul_dx", interpret, static, "no",
               out_dtype)
    return dx.reshape(*g.shape[:-1], in_f)


# ---------------------------------------------------------------------------------------------------------------
# XLA path (the same equations in jnp, dequantising the whole weight) and the public op
# ---------------------------------------------------------------------------------------------------------------
def _dequant_xla(packed, absmax, shape, blocksize, dtype):
    w = NF4Weight(packed=packed, absmax=absmax, absmax2=None, offset=None, shape=shape, blocksize=blocksize,
                  dtype="float32")
    return nf4_dequantize(w, dtype)


def _fwd_any(x, packed, absmax, shape, blocksize, backend, interpret, blocks):
    if backend == "pallas":
        return nf4_matmul_fwd_pallas(x, packed, absmax, shape, blocksize, interpret=interpret, block_m=blocks[0],
                                     block_n=blocks[1], block_k=blocks[2])
    cdt = _cdt(x.dtype)
    w = _dequant_xla(packed, absmax, shape, blocksize, x.dtype)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=cdt).astype(x.dtype)


# packed (uint8) and absmax are primal inputs with no cotangent (the weight is frozen): the bwd returns None for them
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _nf4_matmul(x, packed, absmax, shape, blocksize, backend, interpret, blocks):
    return _fwd_any(x, packed, absmax, shape, blocksize, backend, interpret, blocks)


def _vfwd(x, packed, absmax, shape, blocksize, backend, interpret, blocks):
    return _fwd_any(x, packed, absmax, shape, blocksize, backend, interpret, blocks), (packed, absmax)


def _vbwd(shape, blocksize, backend, interpret, blocks, res, dy):
    packed, absmax = res
    if backend == "pallas":
        dx = nf4_matmul_dx_pallas(dy, packed, absmax, shape, blocksize, interpret=interpret, block_m=blocks[0],
                                  block_n=blocks[1], block_k=blocks[2])
    else:
        w = _dequant_xla(packed, absmax, shape, blocksize, dy.dtype)
        dx = jnp.matmul(dy, w, preferred_element_type=_cdt(dy.dtype)).astype(dy.dtype)
    return dx, None, None  # dX = dY W; no gradient for the frozen weight's codes or scales


_nf4_matmul.defvjp(_vfwd, _vbwd)


def nf4_matmul(x: jax.Array, w: NF4Weight, *, backend: str = "pallas", interpret: bool | None = None,
               block_m: int = 64, block_n: int = 64, block_k: int = 64) -> jax.Array:
    """``x @ dequant(w).T`` with a hand-written VJP for ``x`` (``w`` frozen: no gradient).

    Args:
      x: ``[..., in]`` floating array (bf16, f16, f32 or f64); the output has x's dtype.
      w: an :class:`NF4Weight` ``[out, in]`` (any blocksize; double-quantised or not).
      backend: ``"pallas"`` (fused kernels; interpret mode off-GPU) or ``"xla"`` (dequantise, then ``dot``).
      interpret: force Pallas interpret mode (``None``: on unless running on a GPU).
      block_m, block_n, block_k: upper bounds of the kernel tile (rows, output columns, reduction), powers of two.
    """
    if not isinstance(w, NF4Weight):
        raise TypeError(f"nf4_matmul: 'w' must be an NF4Weight, got {type(w).__name__}")
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"nf4_matmul: 'x' must be a floating-point array, got {getattr(x, 'dtype', type(x))}")
    if x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"nf4_matmul: 'x' must be [..., in] with in = w.shape[1] = {w.shape[1]}, got {x.shape}")
    if backend not in ("xla", "pallas"):
        raise ValueError(f"nf4_matmul: backend must be 'xla' or 'pallas', got {backend!r}")
    # Double quantisation decodes the n/blocksize absmax values here (tiny); the weight itself stays packed.
    absmax = nf4_absmax(w)
    packed = jnp.asarray(w.packed, jnp.uint8)
    return _nf4_matmul(x, packed, absmax, tuple(w.shape), int(w.blocksize), backend, interpret,
                       (block_m, block_n, block_k))
