r"""Fused NF4 dequantise + matmul for a frozen QLoRA base weight: reference and Pallas kernels side by side.

For ``x [..., K]`` and an NF4 weight ``W [O, K]`` (:class:`jaxgrad.lora.nf4.NF4Weight`, bitsandbytes' layout):

.. math::

    W_{ok} &= \mathrm{code}[\,q_f\,]\cdot \mathrm{absmax}[\,\lfloor f / B \rfloor\,], \qquad f = oK + k
        \quad (\text{row-major flat index}, B \text{ the blocksize}) \\
    q_f &= \text{high nibble of } \mathrm{packed}[\lfloor f/2 \rfloor] \text{ if } f \text{ even, else the low one} \\
    Y &= X\, W^\top, \qquad \bar X = \bar Y\, W, \qquad \bar W = 0 \ (\text{frozen})

The kernels read the packed uint8 codes and the per-block absmax inside the kernel, one tile of ``W`` at a time
(``[bn, bk]`` forward, ``[bo, bk]`` backward), so the dequantised weight is never materialised. Two paths:

* **Tiled** (``K`` even and a multiple of ``B``, e.g. every Llama projection at ``B = 64``): row ``o`` of ``W``
  starts on a byte and on a block, so ``packed`` is read as ``[O, K/2]`` and ``absmax`` as ``[O, K/B]`` (free
  reshapes). A tile is one contiguous ``[bn, bk/2]`` byte load; the codes are ``byte >> 4`` (even ``k``: the first
  element sits in the high nibble) and ``byte & 15`` (odd ``k``), the scales a ``[bn, max(1, bk/B)]`` load repeated
  over their blocks, and the two halves are interleaved back into ``k`` order before the dot.
* **General** (any ``K``): indices are computed per element from the flat position ``f``, which handles rows that
  start mid-byte (odd ``K``), blocks that straddle rows (``K`` not a multiple of ``B``) and the partial last block
  alike, at the cost of a byte gather and a scale gather per element of every tile.

Either way each tile is dequantised in float32 (``code * absmax``, as bitsandbytes does), rounded once to ``x``'s
dtype (what ``nf4_dequantize(w, x.dtype)`` gives the XLA path), and multiplied with float32 accumulation (float64
for f64 ``x``); the output is rounded once.

Double quantisation: the second level only touches the ``n/B`` absmax values, so it is decoded outside the kernel
(:func:`jaxgrad.lora.nf4.nf4_absmax`, two roundings as bitsandbytes) and the kernel gets float32 absmax either way.

On a GPU these are Triton kernels (``jaxgrad.pallas_backend``). The code lookup is a 15-select tree on the four
bits (``lut="select"``; ``"gather"``: a pointer gather from the 16-entry table, ~4x slower in the tiled kernels on
an H100). f32 x f32 dots ask for ``HIGHEST`` so Triton does not drop to TF32 (Triton then runs them on CUDA cores,
not tensor cores). Where f32 activations meet a weight rounded to bf16 (the LoRA block's fp32 ``dY`` against its
bf16 forward's weight) the dot is three bf16 tensor-core passes over an exact three-way bf16 split of the f32
operand: the same products, exact in f32, summed in f32 (``f32_split``).

Speed: the kernels are bound by dequantisation -- each program dequantises its own ``W`` tile, which a Triton kernel
cannot keep in shared memory across row blocks -- so at the LoRA block's MLP shapes they stay behind XLA's
dequantise + dot. The timings per kernel and path are measured by ``python -m jaxgrad.bench nf4_matmul``
(``benchmarks/results/nf4-matmul-timing-*``); docs/design.md has the numbers. A Mosaic GPU (``wgmma``) kernel that
stages a dequantised ``W`` panel in shared memory is the step for the matmul-bound shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxgrad import pallas_backend as pb
from jaxgrad.ops.dtypes import compute_dtype
from jaxgrad.ops.nf4 import NF4_CODE, NF4Weight, nf4_absmax, nf4_dequantize

__all__ = ["nf4_matmul", "nf4_matmul_reference"]


def nf4_matmul_reference(x: jax.Array, w: NF4Weight) -> jax.Array:
    """Plain JAX: ``x @ nf4_dequantize(w, x.dtype).T`` accumulated in fp32 (f64 for f64), W frozen."""
    cdt = compute_dtype(x.dtype)
    wd = jax.lax.stop_gradient(nf4_dequantize(w, x.dtype))
    return (x.astype(cdt) @ wd.astype(cdt).T).astype(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------
_CODE32 = tuple(np.float32(c) for c in NF4_CODE)  # Python-side float32 constants (kernels close over no arrays)


def _code_lookup(q, code_ref, lut, shift=0):
    """``NF4_CODE[(q >> shift) & 15]`` in float32 for int32 ``q``: a pointer gather from the 16-entry table
    (``lut="gather"``) or a 15-select tree on the four bits (``lut="select"``, no memory access; the bits are
    tested in place, so a byte's two nibbles need no shift or mask first)."""
    if lut == "gather":
        return code_ref[(q >> shift) & 0xF]
    vals = list(_CODE32)
    for bit in range(4):  # level b picks between entries differing in bit b: 8, 4, 2, 1 selects
        on = (q & (1 << (bit + shift))) != 0
        vals = [jnp.where(on, vals[2 * i + 1], vals[2 * i]) for i in range(len(vals) // 2)]
    return vals[0]


def _dequant_tile(packed_ref, absmax_ref, code_ref, o_idx, k_idx, mask, *, in_features, log2_block, dtype,
                  lut="select"):
    """General path: ``W[o_idx, k_idx]`` (broadcast shapes) in ``dtype``, 0 where ``mask`` is False, from per-element
    flat indices into the packed codes (any K, rows starting mid-byte, blocks straddling rows)."""
    f = jnp.where(mask, o_idx * in_features + k_idx, 0)  # flat index; masked lanes point at element 0 (in bounds)
    byte = packed_ref[f >> 1].astype(jnp.int32)  # gather: two codes per byte
    q = jnp.where((f & 1) == 0, byte >> 4, byte & 0xF)  # first element in the high nibble
    v = _code_lookup(q, code_ref, lut) * absmax_ref[f >> log2_block]  # float32, as bitsandbytes' dequantise
    return jnp.where(mask, v, 0.0).astype(dtype)  # one rounding to x's dtype, like nf4_dequantize(w, x.dtype)


def _dequant_rows(packed_ref, absmax_ref, code_ref, r0, nr, c0, nc, *, out_f, in_f, blocksize, dtype, lut):
    """Tiled path (``K`` even and a multiple of the blocksize): the ``[nr, nc]`` tile ``W[r0:r0+nr, c0:c0+nc]`` in
    ``dtype`` (0 outside ``W``), ``c0`` a multiple of ``nc``. ``packed_ref`` is the packed codes as ``[O, K/2]``
    (row ``o`` starts at byte ``o K / 2``), ``absmax_ref`` the scales as ``[O, K/B]``: one contiguous ``[nr, nc/2]``
    byte load, the nibbles split by shifts (high nibble = even ``k``), the scales loaded ``[nr, max(1, nc/B)]``
    and repeated, the two halves interleaved back into ``k`` order."""
    rmask = (r0 + jnp.arange(nr) < out_f)[:, None]
    half = nc // 2
    bmask = rmask & (c0 // 2 + jnp.arange(half) < in_f // 2)[None, :]
    byte = pb.masked_load(packed_ref.at[pl.ds(r0, nr), pl.ds(c0 // 2, half)], bmask, other=0).astype(jnp.int32)
    na = max(1, nc // blocksize)
    amask = rmask & (c0 // blocksize + jnp.arange(na) < in_f // blocksize)[None, :]
    a = pb.masked_load(absmax_ref.at[pl.ds(r0, nr), pl.ds(c0 // blocksize, na)], amask)  # 0 outside: W = 0 there
    if na > 1:  # each scale covers blocksize/2 bytes of the row
        a = jnp.broadcast_to(a[:, :, None], (nr, na, blocksize // 2)).reshape(nr, half)
    hi = (_code_lookup(byte, code_ref, lut, shift=4) * a).astype(dtype)  # float32 code * absmax, one rounding
    lo = (_code_lookup(byte, code_ref, lut) * a).astype(dtype)
    return jnp.stack([hi, lo], axis=-1).reshape(nr, nc)  # k = 2j from the high nibble, 2j + 1 from the low one


def _dot(a, b, cdt, split):
    """``a @ b`` with ``cdt`` accumulation. f32 x f32 asks for ``HIGHEST`` (Triton would drop to TF32), which Triton
    runs on CUDA cores. ``split``: ``b`` holds bf16 values (the weight rounded to bf16), so ``a`` (f32) is cut into
    three bf16 parts ``a = hi + mid + lo`` (exact: 3 x 8 bits of a 24-bit significand) and the products, exact in
    f32, are summed on the tensor cores: the f32 product at ``HIGHEST``'s accuracy for three bf16 passes."""
    if split:
        bb = b.astype(jnp.bfloat16)
        hi = a.astype(jnp.bfloat16)
        r = a - hi.astype(a.dtype)
        mid = r.astype(jnp.bfloat16)
        lo = (r - mid.astype(a.dtype)).astype(jnp.bfloat16)
        out = jnp.dot(hi, bb, preferred_element_type=jnp.float32)
        out = out + jnp.dot(mid, bb, preferred_element_type=jnp.float32)
        return out + jnp.dot(lo, bb, preferred_element_type=jnp.float32)
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None  # no TF32 for f32 inputs on a GPU
    return jnp.dot(a, b, preferred_element_type=cdt, precision=prec).astype(cdt)


def _split(act_dtype, w_dtype, f32_split):
    """Whether the dots take the three-bf16-pass route: f32 activations against a weight rounded to bf16."""
    return bool(f32_split) and jnp.dtype(act_dtype) == jnp.float32 and jnp.dtype(w_dtype) == jnp.bfloat16


def _fwd_kernel(x_ref, packed_ref, absmax_ref, code_ref, y_ref, *, n_rows, out_f, in_f, log2_block, w_dtype, bk,
                nk, lut, split):
    bm, bn = y_ref.shape
    cdt = compute_dtype(x_ref.dtype)
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
                           dtype=w_dtype, lut=lut).astype(x_ref.dtype)
        return acc + _dot(x, wt, cdt, split)  # Y += X[:, k-tile] W[:, k-tile]^T

    acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), cdt))
    pb.masked_store(y_ref, acc, rmask[:, None] & omask[None, :])


def _bwd_kernel(g_ref, packed_ref, absmax_ref, code_ref, dx_ref, *, n_rows, out_f, in_f, log2_block, w_dtype, bo,
                no, lut, split):
    bm, bk = dx_ref.shape
    cdt = compute_dtype(g_ref.dtype)
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
                          dtype=w_dtype, lut=lut).astype(g_ref.dtype)
        return acc + _dot(g, w, cdt, split)  # dX += dY[:, o-tile] W[o-tile, :]

    acc = jax.lax.fori_loop(0, no, body, jnp.zeros((bm, bk), cdt))
    pb.masked_store(dx_ref, acc, rmask[:, None] & kmask[None, :])


def _fwd_kernel_tiled(x_ref, packed_ref, absmax_ref, code_ref, y_ref, *, n_rows, out_f, in_f, blocksize, w_dtype,
                      bk, nk, lut, split):
    bm, bn = y_ref.shape
    cdt = compute_dtype(x_ref.dtype)
    o0 = pl.program_id(1) * bn
    rmask = (pl.program_id(0) * bm + jnp.arange(bm) < n_rows)[:, None]
    omask = (o0 + jnp.arange(bn) < out_f)[None, :]

    def body(kk, acc):
        x = pb.masked_load(x_ref.at[:, pl.ds(kk * bk, bk)], rmask & (kk * bk + jnp.arange(bk) < in_f)[None, :])
        w = _dequant_rows(packed_ref, absmax_ref, code_ref, o0, bn, kk * bk, bk, out_f=out_f, in_f=in_f,
                          blocksize=blocksize, dtype=w_dtype, lut=lut).astype(x_ref.dtype)  # [bn, bk]
        return acc + _dot(x, w.T, cdt, split)  # Y += X[:, k-tile] W[o-tile, k-tile]^T

    acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), cdt))
    pb.masked_store(y_ref, acc, rmask & omask)


def _bwd_kernel_tiled(g_ref, packed_ref, absmax_ref, code_ref, dx_ref, *, n_rows, out_f, in_f, blocksize, w_dtype,
                      bo, no, lut, split):
    bm, bk = dx_ref.shape
    cdt = compute_dtype(g_ref.dtype)
    k0 = pl.program_id(1) * bk
    rmask = (pl.program_id(0) * bm + jnp.arange(bm) < n_rows)[:, None]
    kmask = (k0 + jnp.arange(bk) < in_f)[None, :]

    def body(oo, acc):
        g = pb.masked_load(g_ref.at[:, pl.ds(oo * bo, bo)], rmask & (oo * bo + jnp.arange(bo) < out_f)[None, :])
        w = _dequant_rows(packed_ref, absmax_ref, code_ref, oo * bo, bo, k0, bk, out_f=out_f, in_f=in_f,
                          blocksize=blocksize, dtype=w_dtype, lut=lut).astype(g_ref.dtype)  # [bo, bk]
        return acc + _dot(g, w, cdt, split)  # dX += dY[:, o-tile] W[o-tile, k-tile]

    acc = jax.lax.fori_loop(0, no, body, jnp.zeros((bm, bk), cdt))
    pb.masked_store(dx_ref, acc, rmask & kmask)


def _full(a, shape=None):
    """The whole array as one block (``shape``: padded up to what the in-kernel loads reach). On Triton a block is
    a base pointer, nothing is copied; interpret mode pads it."""
    shape = a.shape if shape is None else shape
    return pl.BlockSpec(shape, lambda i, j: (0,) * a.ndim)


def tiled_path_applies(shape, blocksize) -> bool:
    """Whether the tiled (contiguous-byte) kernels apply: every row starts on a byte (``K`` even) and on a block
    (``K`` a multiple of the blocksize), so ``packed`` is ``[O, K/2]`` and ``absmax`` ``[O, K/B]``, row-major."""
    _, in_f = shape
    return in_f % 2 == 0 and in_f % blocksize == 0


def _call(kernel, act, packed, absmax, out_cols, red_cols, blocks, name, interpret, static, loop_kw, out_dtype,
          shape, blocksize, tiled, num_warps, num_stages):
    """Grid (row blocks, out-column blocks); each program loops over the reduction axis in tiles of ``bred``."""
    bm, bout, bred = blocks
    n = act.shape[0]
    nred = pl.cdiv(red_cols, bred)
    code = jnp.asarray(NF4_CODE, jnp.float32)
    if tiled:  # the weight's codes / scales as row-major matrices (free reshapes), padded to whole tiles
        out_f, in_f = shape
        packed = packed[: out_f * in_f // 2].reshape(out_f, in_f // 2)
        absmax = absmax[: out_f * in_f // blocksize].reshape(out_f, in_f // blocksize)
        o_tile, k_tile = (bout, bred) if loop_kw == "nk" else (bred, bout)
        o_pad, k_pad = pl.cdiv(out_f, o_tile) * o_tile, pl.cdiv(in_f, k_tile) * k_tile
        w_specs = [_full(packed, (o_pad, k_pad // 2)), _full(absmax, (o_pad, pl.cdiv(k_pad, blocksize)))]
    else:
        w_specs = [_full(packed), _full(absmax)]
    return pb.pallas_call(
        functools.partial(kernel, **static, **{loop_kw: nred}),
        out_shape=jax.ShapeDtypeStruct((n, out_cols), out_dtype or act.dtype),
        grid=(pl.cdiv(n, bm), pl.cdiv(out_cols, bout)),
        # the activation's row block spans the whole reduction axis, rounded up to whole tiles (masked in-kernel;
        # on Triton this is a base pointer, each loop step loads its [bm, bred] tile)
        in_specs=[pl.BlockSpec((bm, nred * bred), lambda i, j: (i, 0)), *w_specs, _full(code)],
        out_specs=pl.BlockSpec((bm, bout), lambda i, j: (i, j)),
        name=name,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )(act, packed, absmax, code)


#: Defaults (block_m, block_n, block_k, num_warps, num_stages) per path and kernel (forward, dx); ``block_*`` are
#: upper bounds. From the ``nf4_matmul`` benchmark's sweep on an H100 at the LoRA block's MLP shapes (8192 rows,
#: 2048 x 5632; ``benchmarks/results/nf4-matmul-timing-nvidia-h100-80gb-hbm3-bf16-20261125-*``): the tiled
#: kernels are bound by dequantisation (each program re-dequantises its W tile, ``M / block_m`` times over the
#: weight), so the forward takes 256 rows (the fastest of the sweep at both shapes); for the dx kernel (three bf16
#: passes per tile) 64x128x64 on 4 warps and 128x128x64 on 8 were within 20% of each other, each ahead at one shape.
TILED_DEFAULTS = {"fwd": (256, 128, 64, 8, 3), "dx": (64, 128, 64, 4, 3)}
GENERAL_DEFAULTS = {"fwd": (64, 64, 64, 4, 2), "dx": (64, 64, 64, 4, 2)}


def _config(kind, shape, blocksize, path, block_m, block_n, block_k, num_warps, num_stages):
    if path not in (None, "tiled", "general"):
        raise ValueError(f"nf4_matmul: path must be None, 'tiled' or 'general', got {path!r}")
    tiled = tiled_path_applies(shape, blocksize) if path is None else path == "tiled"
    if tiled and not tiled_path_applies(shape, blocksize):
        raise ValueError(f"nf4_matmul: the tiled path needs K even and a multiple of the blocksize; got shape "
                         f"{tuple(shape)}, blocksize {blocksize}")
    d = (TILED_DEFAULTS if tiled else GENERAL_DEFAULTS)[kind]
    pick = lambda v, i: d[i] if v is None else v  # noqa: E731
    return (tiled, pick(block_m, 0), pick(block_n, 1), pick(block_k, 2), pick(num_warps, 3),
            pick(num_stages, 4))


def _blocks(n, a, b, block_m, block_n, block_k, tiled):
    bm, ba, bb = pb.block_size(n, block_m), pb.block_size(a, block_n), pb.block_size(b, block_k)
    if tiled:  # the reduction / column tile loads whole bytes: at least 32 columns (16 bytes) either way
        ba, bb = max(ba, 32), max(bb, 32)
    return bm, ba, bb


def nf4_matmul_fwd_pallas(x, packed, absmax, shape, blocksize, *, interpret=None, block_m=None, block_n=None,
                          block_k=None, w_dtype=None, out_dtype=None, path=None, lut="select", f32_split=True,
                          num_warps=None, num_stages=None):
    """Kernel ``x @ W^T`` (x ``[..., K]``, ``shape = (O, K)``) from packed codes and float32 absmax.

    ``w_dtype``: the dtype each dequantised weight element is rounded to (default x's; what ``nf4_dequantize(w,
    w_dtype)`` gives). ``out_dtype``: the output's (default x's; the LoRA block asks for its fp32 accumulator so
    that the base product and the LoRA term are rounded once, together). ``path``: ``"tiled"`` (contiguous byte
    tiles; needs :func:`tiled_path_applies`), ``"general"`` (per-element gathers, any shape) or ``None`` (tiled
    where it applies). ``lut``: the code lookup, ``"gather"`` or ``"select"``. ``f32_split``: f32 ``x`` against a
    bf16-rounded weight runs as three bf16 tensor-core passes (exact products) instead of an f32 ``HIGHEST`` dot.
    ``block_*`` (upper bounds, powers of two), ``num_warps``, ``num_stages``: ``None`` takes the path's defaults."""
    out_f, in_f = shape
    tiled, block_m, block_n, block_k, nw, ns = _config("fwd", shape, blocksize, path, block_m, block_n, block_k,
                                                       num_warps, num_stages)
    x2 = x.reshape(-1, in_f)
    bm, bn, bk = _blocks(x2.shape[0], out_f, in_f, block_m, block_n, block_k, tiled)
    wdt = jnp.dtype(w_dtype or x.dtype)
    static = dict(n_rows=x2.shape[0], out_f=out_f, in_f=in_f, w_dtype=wdt, bk=bk, lut=lut,
                  split=_split(x.dtype, wdt, f32_split))
    static |= dict(blocksize=blocksize) if tiled else dict(log2_block=blocksize.bit_length() - 1)
    y = _call(_fwd_kernel_tiled if tiled else _fwd_kernel, x2, packed, absmax, out_f, in_f, (bm, bn, bk),
              "nf4_matmul_fwd", interpret, static, "nk", out_dtype, shape, blocksize, tiled, nw, ns)
    return y.reshape(*x.shape[:-1], out_f)


def nf4_matmul_dx_pallas(g, packed, absmax, shape, blocksize, *, interpret=None, block_m=None, block_n=None,
                         block_k=None, w_dtype=None, out_dtype=None, path=None, lut="select", f32_split=True,
                         num_warps=None, num_stages=None):
    """Kernel ``g @ W`` (g ``[..., O]``): x's gradient of ``x @ W^T``. ``w_dtype`` (default g's): the rounding of the
    dequantised weight, i.e. the forward's activation dtype when ``g`` is wider (the LoRA block's fp32 ``dY`` with a
    bf16 forward: the gradient of the bf16-rounded weight the forward used); ``out_dtype`` default g's. The other
    options as :func:`nf4_matmul_fwd_pallas` (``block_n`` bounds the output's K tile, ``block_k`` the O loop's)."""
    out_f, in_f = shape
    tiled, block_m, block_n, block_k, nw, ns = _config("dx", shape, blocksize, path, block_m, block_n, block_k,
                                                       num_warps, num_stages)
    g2 = g.reshape(-1, out_f)
    bm, bk, bo = _blocks(g2.shape[0], in_f, out_f, block_m, block_n, block_k, tiled)
    wdt = jnp.dtype(w_dtype or g.dtype)
    static = dict(n_rows=g2.shape[0], out_f=out_f, in_f=in_f, w_dtype=wdt, bo=bo, lut=lut,
                  split=_split(g.dtype, wdt, f32_split))
    static |= dict(blocksize=blocksize) if tiled else dict(log2_block=blocksize.bit_length() - 1)
    dx = _call(_bwd_kernel_tiled if tiled else _bwd_kernel, g2, packed, absmax, in_f, out_f, (bm, bk, bo),
               "nf4_matmul_dx", interpret, static, "no", out_dtype, shape, blocksize, tiled, nw, ns)
    return dx.reshape(*g.shape[:-1], in_f)


# ---------------------------------------------------------------------------------------------------------------
# XLA path (the same equations in jnp, dequantising the whole weight) and the public op
# ---------------------------------------------------------------------------------------------------------------
def _dequant_xla(packed, absmax, shape, blocksize, dtype):
    w = NF4Weight(packed=packed, absmax=absmax, absmax2=None, offset=None, shape=shape, blocksize=blocksize,
                  dtype="float32")
    return nf4_dequantize(w, dtype)


def compiled_f64(dtype, interpret) -> bool:
    """Whether a float64 product would be compiled for the GPU (not interpreted). The compiled kernels do not take
    float64: on the H100 the bf16-NF4 pallas block's float64 run came back wrong (relative error 1.14 in dx; the
    cause inside Triton's float64 path was not isolated), so float64 takes the XLA path there (dequantise, then ``dot``), as ``backend="xla"`` does."""
    return jnp.dtype(dtype) == jnp.float64 and not pb.resolve_interpret(interpret)


def _fwd_any(x, packed, absmax, shape, blocksize, backend, interpret, blocks):
    if backend == "pallas" and not compiled_f64(x.dtype, interpret):
        return nf4_matmul_fwd_pallas(x, packed, absmax, shape, blocksize, interpret=interpret, block_m=blocks[0],
                                     block_n=blocks[1], block_k=blocks[2])
    cdt = compute_dtype(x.dtype)
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
    if backend == "pallas" and not compiled_f64(dy.dtype, interpret):
        dx = nf4_matmul_dx_pallas(dy, packed, absmax, shape, blocksize, interpret=interpret, block_m=blocks[0],
                                  block_n=blocks[1], block_k=blocks[2])
    else:
        w = _dequant_xla(packed, absmax, shape, blocksize, dy.dtype)
        dx = jnp.matmul(dy, w, preferred_element_type=compute_dtype(dy.dtype)).astype(dy.dtype)
    return dx, None, None  # dX = dY W; no gradient for the frozen weight's codes or scales


_nf4_matmul.defvjp(_vfwd, _vbwd)


def nf4_matmul(x: jax.Array, w: NF4Weight, *, backend: str = "pallas", interpret: bool | None = None,
               block_m: int | None = None, block_n: int | None = None, block_k: int | None = None) -> jax.Array:
    """``x @ dequant(w).T`` with a hand-written VJP for ``x`` (``w`` frozen: no gradient).

    Args:
      x: ``[..., in]`` floating array (bf16, f16, f32 or f64); the output has x's dtype.
      w: an :class:`NF4Weight` ``[out, in]`` (any blocksize; double-quantised or not).
      backend: ``"pallas"`` (fused kernels; interpret mode off-GPU; float64 compiled for a GPU takes the XLA path,
        :func:`compiled_f64`) or ``"xla"`` (dequantise, then ``dot``).
      interpret: force Pallas interpret mode (``None``: on unless running on a GPU).
      block_m, block_n, block_k: upper bounds of the kernel tile (rows, output columns, reduction), powers of two;
        ``None``: the kernel path's defaults (:data:`TILED_DEFAULTS` / :data:`GENERAL_DEFAULTS`).
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


# The audit's shapes: x [rows, K] against a frozen [O, K] weight, O fixed by K (the weight is closed over, not an
# argument: its codes have no gradient). K a multiple of the 64-element blocks (the tiled kernels, every Llama
# projection's path), O not a multiple of any tile.
_AUDIT_OUT = {64: 40, 128: 72, 512: 392}


@functools.lru_cache(maxsize=8)
def _audit_weight(n_in: int) -> NF4Weight:
    """The audit's NF4 weight for inputs of width ``n_in``: ``0.05 N(0, 1)`` quantised once, on the host."""
    from jaxgrad.ops.nf4 import nf4_quantize
    from jaxgrad.ops.registry import frozen_normal

    return nf4_quantize(frozen_normal((_AUDIT_OUT[n_in], n_in), 2, 0.05))


def _audit_reference(x):
    return nf4_matmul_reference(x, _audit_weight(x.shape[-1]))


def audit_cases():
    """Cases for ``jaxgrad audit``: ``x`` white noise against the frozen weight of :func:`_audit_weight`, both
    backends; in interpret mode with small kernel tiles (the grid and the reduction loop take several steps)."""
    from jaxgrad.ops.registry import OpAudit

    def make_args(key, size):
        rows, n_in = size
        return (jax.random.normal(key, (rows, n_in)),)

    def fn_for(backend):
        def fn(x):
            tiles = dict(block_m=16, block_n=32, block_k=32) if pb.resolve_interpret(None) else {}
            return nf4_matmul(x, _audit_weight(x.shape[-1]), backend=backend, **tiles)
        fn.__name__ = f"nf4_matmul_{backend}"
        return fn

    sizes = ((16, 64), (48, 128), (256, 512))
    return tuple(OpAudit(f"nf4_matmul[{b}]", fn_for(b), _audit_reference, make_args, sizes, arg_names=("x",),
                         backend=b, interpret_sizes=sizes[:2]) for b in ("xla", "pallas"))
