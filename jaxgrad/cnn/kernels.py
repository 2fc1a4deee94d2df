r"""Pallas kernels for a small-channel 3x3 convolution (stride 1, SAME padding, dilation 1): forward with bias and
ReLU fused, input gradient and weight/bias gradient with ReLU' fused on load.

Notation: activations NHWC, ``x[N, H, W, Cin]``; weights HWIO, ``w[3, 3, Cin, Cout]``; ``b[Cout]``;
``1 <= Cin, Cout <= 32``; ``x_pad`` is ``x`` with one zero row/column around each image. Taps
``t = (dy, dx) in {0,1,2}^2``.

.. math::

    y[n,h,w,o] &= \mathrm{act}\Big(b_o + \sum_{dy,dx,i} x_{pad}[n, h+dy, w+dx, i]\, w[dy,dx,i,o]\Big)
                 && \text{(forward; act = ReLU or identity; a correlation, like lax.conv)} \\
    g_z &= g \odot [y > 0] \ \text{(if } y \text{ is given, else } g) \\
    \bar x[n,h,w,i] &= \sum_{dy,dx,o} g_{z,pad}[n, h+2-dy, w+2-dx, o]\, w[dy,dx,i,o]
                 && \text{(input grad: the forward with } w \text{ flipped in space and } I \leftrightarrow O) \\
    \bar w[dy,dx,i,o] &= \sum_{n,h,w} x_{pad}[n, h+dy, w+dx, i]\, g_z[n,h,w,o], \qquad
    \bar b[o] = \sum_{n,h,w} g_z[n,h,w,o]  && \text{(weight grad)}

**Layout: flat positions, shifted contiguous windows, masks instead of padding.** The kernels see an activation
as the free reshape ``[P, C]`` with ``P = N*H*W`` positions ``p = (n*H + h)*W + w``. Tap ``(dy, dx)`` of output
position ``p`` is input position ``p + (dy-1)*W + (dx-1)``, so a block of ``bp`` consecutive output positions
needs 9 *contiguous* ``[bp, C]`` windows, each a plain 2-D masked load from the whole array (its BlockSpec is the
whole array; nothing is padded, copied or sliced by XLA, and no halo BlockSpec is needed). The mask of a tap is
``p < P`` & ``0 <= h+dy-1 < H`` & ``0 <= w+dx-1 < W`` (``h = (p // W) % H``, ``w = p % W``), which is exactly the
zero padding of SAME, and also what keeps a window from reading the neighbouring image. Consecutive programs
read overlapping windows (the rows above/below a block are the blocks ``W/bp`` programs away), so HBM traffic
is ~1 read per input and 1 write per output; the 9-fold re-reads hit L1/L2.

*Interpret mode* (CPU) slices refs with ``lax.dynamic_slice``, which clamps a negative start instead of reading
out of bounds. There (only) the wrapper front-pads the flat input by ``W+1`` zero rows and the kernel adds that
``guard`` to every window start; on the GPU the guard is 0 and the windows of the first rows start at negative
offsets whose lanes are all masked (Triton dereferences no masked lane). Everything else is the same code.

**Channel mixing.** Channels are padded *in registers* to ``cp = max(16, next_power_of_2(C))`` (the masked load
reads 0 in the padded columns; the weights are zero-padded by the wrapper, parameters only), so every tap is one
``tl.dot`` with all dimensions >= 16 (Triton's minimum), also for the 1-channel first and last layers:

* forward / input grad: grid ``(cdiv(P, bp),)``; per tap ``acc[bp, cop] += X_t[bp, cip] @ W_t[cip, cop]``;
  epilogue ``+ b``, ``ReLU``; masked store of the real ``[rows, Cout]``. The input grad runs the same kernel on
  ``g`` with ``W'_t = W_{8-t}^T`` and, if ``y`` is given, loads the 9 ``y`` windows as well and uses
  ``where(y > 0, g, 0)`` (ReLU' fused on load; no ``g_z`` array is written).
* weight grad: grid ``(S,)``; program ``s`` walks the position blocks ``s, s+S, s+2S, ...`` (interleaved, so
  concurrently running programs touch neighbouring rows: L2 reuse of the shifted windows), loads ``g_z`` once per
  block (unshifted) and the 9 shifted ``x`` windows, and accumulates ``dW_t^T[cop, cip] += g_z^T @ X_t`` (a dot
  contracting the position axis of both operands) and ``db += sum_p g_z`` in registers. Oriented this way the one
  transposed dot operand, ``g_z^T``, is shared by the 9 dots (with ``X_t^T @ g_z`` every tap transposed its own
  f32 window, 3-5x slower per layer on an H100 in TF32). Each program writes one
  ``[9, cop, cip]`` (+ ``[1, cop]``) f32 partial; XLA sums the ``S`` partials (deterministic: no atomics; no
  im2col matrix is ever written). ``S`` (``num_splits``) defaults to ``min(blocks, 512)`` on the GPU (2-4
  programs per SM of an H100/H200) and ``min(blocks, 3)`` in interpret mode (serial grid).

**Dtypes and precision.** ``mdt = result_type`` of the data operands (``x, w`` / ``g, w`` / ``x, g``) is the dot
operand dtype and ``cdt = promote_types(mdt, float32)`` the accumulator: bf16 inputs are multiplied in bf16
(exact products) and accumulated in f32; f64 works in interpret mode (the verifier's re-run). ``precision`` goes
to every in-kernel dot: ``None`` / ``Precision.DEFAULT`` is the platform default, i.e. **TF32** operands on the
GPU for f32 (10 mantissa bits; Triton ``input_precision="tf32"``); ``Precision.HIGHEST`` (or
``DotAlgorithmPreset.F32_F32_F32``) is **IEEE f32** (Triton ``input_precision="ieee"``: an FMA loop without
tensor cores; exact, slower); ``DotAlgorithmPreset.TF32_TF32_F32_X3`` is 3xTF32 on tensor cores (~f32 accuracy).
Interpret mode on the CPU always computes exact products. Outputs: ``y`` in ``x.dtype``, ``dx`` in ``g.dtype``
(the cotangent's dtype, i.e. ``x.dtype`` inside a VJP), ``dw`` and ``db`` in ``result_type(x, g)`` (the KAN
kernels' policy for ``dcoef``), reduced in f32 before the final cast. Bias, ReLU and the ReLU' mask are applied
in ``cdt``.

* row-strip variant of the forward / input grad (``rows_per_program=R``, off by default): grid
  ``(cdiv(W, bp), cdiv(N*H, R))``; a program walks ``R`` image rows of one ``bp``-wide column strip and keeps the
  three column-shifted windows of the two previous rows in registers, so each input row is loaded 3 times instead
  of 9. It meets the same error bound as the flat kernel but is not faster on an H100: the flat kernel's re-reads
  are served by L1/L2.

**Default blocks** (:data:`FWD_DEFAULTS`, :data:`INPUT_GRAD_DEFAULTS`, :data:`WEIGHT_GRAD_DEFAULTS`):
``block_p`` positions per block (a power of two >= 16), Triton ``num_warps`` / ``num_stages``, picked by timing
the launch configurations of ``tests/test_cnn_kernels_gpu.py`` (which checks each one's accuracy) on an H100 at
N=2, 1024x1024, 16->16, f32 TF32: forward and input grad are flat within noise for ``block_p`` 128-512 and 4/8
warps; the weight grad wants ``block_p=128``, 4 warps, 2 stages (``block_p=512`` spills, and with 2 stages exceeds
shared memory).

**Measured**: the whole denoiser's loss + gradient from these kernels against ``jax.value_and_grad`` of the XLA
(cuDNN) network and PyTorch is the ``cnn`` benchmark suite (``python -m jaxgrad.bench cnn``; tables and result
files in ``docs/benchmarks.md``). The kernels are bound by the 9 (forward, weight grad) or 18 (input grad with
``y``) window loads per block through L1/L2 and by the padded-to-16-channel dots of the 1-channel layers, not by
HBM. With ``HIGHEST`` the 1->16 weight grad is slow: an IEEE FMA dot whose padded ``K=16`` is 15/16 zeros.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxgrad import pallas_backend as pb

__all__ = [
    "FWD_DEFAULTS",
    "INPUT_GRAD_DEFAULTS",
    "MAX_CHANNELS",
    "WEIGHT_GRAD_DEFAULTS",
    "conv3x3_forward",
    "conv3x3_input_grad",
    "conv3x3_weight_grad",
]

MAX_CHANNELS = 32
# Upper bounds of the position block (clipped to next_power_of_2(P), floor 16) and Triton launch parameters.
FWD_DEFAULTS = {"block_p": 256, "num_warps": 4, "num_stages": 1, "rows_per_program": None}
INPUT_GRAD_DEFAULTS = {"block_p": 256, "num_warps": 4, "num_stages": 1, "rows_per_program": None}
WEIGHT_GRAD_DEFAULTS = {"block_p": 128, "num_splits": None, "num_warps": 4, "num_stages": 2}
_GPU_SPLITS = 512  # weight-grad programs on the GPU (an H100/H200 has 132 SMs)
_INTERPRET_SPLITS = 3  # interpret mode: still exercises the partial sums

_TAPS = tuple((dy, dx) for dy in range(3) for dx in range(3))


class ConvArgumentError(TypeError, ValueError):
    """A non-floating-point argument: both a ``TypeError`` (like the KAN kernels) and a ``ValueError``."""


# ---------------------------------------------------------------------------------------------------------------
# Validation and configuration
# ---------------------------------------------------------------------------------------------------------------
def _check_float(fn: str, name: str, a) -> None:
    if not hasattr(a, "dtype") or not hasattr(a, "shape") or not jnp.issubdtype(a.dtype, jnp.floating):
        raise ConvArgumentError(f"{fn}: '{name}' must be a floating-point array, got "
                                f"{getattr(a, 'dtype', type(a).__name__)}")


def _check_act(fn: str, name: str, a, what: str) -> tuple[int, int, int, int]:
    _check_float(fn, name, a)
    if a.ndim != 4:
        raise ValueError(f"{fn}: '{name}' must have shape [N, H, W, {what}] (NHWC), got {tuple(a.shape)}")
    c = a.shape[3]
    if not 1 <= c <= MAX_CHANNELS:
        raise ValueError(f"{fn}: '{name}' has {c} channels ({what}); these kernels support 1..{MAX_CHANNELS}, "
                         f"got shape {tuple(a.shape)}")
    return tuple(int(s) for s in a.shape)


def _check_weight(fn: str, w, cin: int | None, cout: int | None) -> tuple[int, int]:
    _check_float(fn, "w", w)
    if w.ndim != 4 or w.shape[:2] != (3, 3):
        raise ValueError(f"{fn}: 'w' must have shape [3, 3, Cin, Cout] (HWIO, a 3x3 kernel), got {tuple(w.shape)}")
    wi, wo = int(w.shape[2]), int(w.shape[3])
    for name, v in (("Cin", wi), ("Cout", wo)):
        if not 1 <= v <= MAX_CHANNELS:
            raise ValueError(f"{fn}: 'w' has {name}={v}; these kernels support 1..{MAX_CHANNELS} channels, got "
                             f"shape {tuple(w.shape)}")
    if cin is not None and wi != cin:
        raise ValueError(f"{fn}: channel mismatch: 'w' has Cin={wi} (shape {tuple(w.shape)}) but 'x' has {cin} "
                         f"channels")
    if cout is not None and wo != cout:
        raise ValueError(f"{fn}: channel mismatch: 'w' has Cout={wo} (shape {tuple(w.shape)}) but 'g' has {cout} "
                         f"channels")
    return wi, wo


def _check_y(fn: str, y, shape) -> None:
    if y is None:
        return
    _check_float(fn, "y", y)
    if tuple(y.shape) != tuple(shape):
        raise ValueError(f"{fn}: 'y' (the forward output whose ReLU mask y > 0 is applied to 'g') must have the "
                         f"shape of 'g' {tuple(shape)}, got {tuple(y.shape)}")


def _config(fn: str, defaults: dict, blocks: dict) -> dict:
    unknown = set(blocks) - set(defaults)
    if unknown:
        raise ValueError(f"{fn}: unknown keyword arguments {sorted(unknown)}; block options are {sorted(defaults)}")
    cfg = dict(defaults)
    cfg.update({k: v for k, v in blocks.items() if v is not None})
    v = cfg["block_p"]
    if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
        raise ValueError(f"{fn}: 'block_p' (positions per block) must be a power of two >= 16, got {v!r}")
    for name in ("num_warps", "num_stages", "num_splits", "rows_per_program"):
        v = cfg.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{fn}: '{name}' must be a positive int, got {v!r}")
    return cfg


def _cpad(c: int) -> int:
    """Channels padded in registers: a power of two >= 16 (tl.dot needs every dimension >= 16)."""
    return max(16, pl.next_power_of_2(c))


def _dtypes(*dts) -> tuple[jnp.dtype, jnp.dtype]:
    mdt = jnp.dtype(jnp.result_type(*dts))
    return mdt, jnp.dtype(jnp.promote_types(mdt, jnp.float32))


# ---------------------------------------------------------------------------------------------------------------
# In-kernel helpers
# ---------------------------------------------------------------------------------------------------------------
def _dot(a, b, precision, acc_dtype, contract=((1,), (0,))):
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=acc_dtype)


def _tap_row_col_masks(p, n_pos: int, height: int, width: int):
    """Per-position validity of the three row offsets (dy) and three column offsets (dx); ``None`` = all true
    (besides ``p < P``, which is folded into the row masks)."""
    in_range = p < n_pos
    wcol = lax.rem(p, jnp.int32(width))
    hrow = lax.rem(lax.div(p, jnp.int32(width)), jnp.int32(height))
    rows = (in_range & (hrow >= 1), in_range, in_range & (hrow < height - 1))
    cols = (wcol >= 1, None, wcol < width - 1)
    return rows, cols


def _mask2(row_ok, n_cols: int, n_valid: int):
    """``[bp, n_cols]`` mask: ``row_ok`` per row, columns ``< n_valid`` (no column test when all are valid, which
    keeps the mask constant along a row so Triton can vectorise the load)."""
    m = row_ok[:, None]
    if n_valid < n_cols:
        m = m & (jnp.arange(n_cols) < n_valid)[None, :]
    return jnp.broadcast_to(m, (row_ok.shape[0], n_cols))


# ---------------------------------------------------------------------------------------------------------------
# Forward / input-grad kernel (one body)
# ---------------------------------------------------------------------------------------------------------------
def _shift_conv_kernel(*refs, has_bias, has_ymask, relu, n_pos, height, width, bp, ci, co, cip, cop, guard,
                       precision, cdt, mdt):
    it = iter(refs)
    x_ref, w_ref = next(it), next(it)
    b_ref = next(it) if has_bias else None
    y_ref = next(it) if has_ymask else None
    o_ref = next(it)
    p0 = pl.multiple_of(pl.program_id(0) * bp, bp)
    p = p0 + jnp.arange(bp, dtype=jnp.int32)
    rows, cols = _tap_row_col_masks(p, n_pos, height, width)
    acc = jnp.zeros((bp, cop), cdt)
    for t, (dy, dx) in enumerate(_TAPS):
        ok = rows[dy] if cols[dx] is None else rows[dy] & cols[dx]
        mask = _mask2(ok, cip, ci)
        start = p0 + ((dy - 1) * width + (dx - 1) + guard)
        a = pb.masked_load(x_ref.at[pl.ds(start, bp), :], mask)
        if has_ymask:
            yv = pb.masked_load(y_ref.at[pl.ds(start, bp), :], mask)
            a = jnp.where(yv > 0, a, jnp.zeros_like(a))
        acc = acc + _dot(a.astype(mdt), w_ref[t, :, :].astype(mdt), precision, cdt)
    if has_bias:
        acc = acc + b_ref[...].astype(cdt)
    if relu:
        acc = jnp.maximum(acc, jnp.zeros_like(acc))
    pb.masked_store(o_ref, acc, _mask2(p < n_pos, cop, co))


def _strip_conv_kernel(*refs, has_bias, has_ymask, relu, n_rows, height, width, bp, rpp, ci, co, cip, cop,
                       guard, precision, cdt, mdt):
    """Row-strip variant: program (s, c) owns columns ``s*bp .. s*bp+bp-1`` (flat, within a row of width W) of the
    image rows ``c*rpp .. c*rpp+rpp-1`` (rows of all images stacked: ``N*H`` rows). It walks its rows keeping the
    three column-shifted windows of the previous two rows in registers, so each input row is loaded 3 times
    (dx = -1, 0, +1) instead of 9 (+2 halo rows per program)."""
    it = iter(refs)
    x_ref, w_ref = next(it), next(it)
    b_ref = next(it) if has_bias else None
    y_ref = next(it) if has_ymask else None
    o_ref = next(it)
    col0 = pl.program_id(0) * bp
    r0 = pl.program_id(1) * rpp
    wcol = col0 + jnp.arange(bp, dtype=jnp.int32)
    owned = wcol < width
    col_ok = (owned & (wcol >= 1), owned, owned & (wcol < width - 1))
    wts = [w_ref[t, :, :].astype(mdt) for t in range(len(_TAPS))]
    bias = b_ref[...].astype(cdt) if has_bias else None

    def load_row(k):  # the three dx-shifted windows of flat row k (zeros outside 0 <= k < N*H)
        row_in = (k >= 0) & (k < n_rows)
        tiles = []
        for dx in range(3):
            mask = _mask2(col_ok[dx] & row_in, cip, ci)
            start = k * width + col0 + (dx - 1 + guard)
            a = pb.masked_load(x_ref.at[pl.ds(start, bp), :], mask)
            if has_ymask:
                yv = pb.masked_load(y_ref.at[pl.ds(start, bp), :], mask)
                a = jnp.where(yv > 0, a, jnp.zeros_like(a))
            tiles.append(a.astype(mdt))
        return tuple(tiles)

    def body(i, carry):
        above, mid = carry
        k = r0 + i
        below = load_row(k + 1)
        h = lax.rem(k, jnp.int32(height))
        acc = jnp.zeros((bp, cop), cdt)
        for dy, rowt in enumerate((above, mid, below)):
            part = jnp.zeros((bp, cop), cdt)
            for dx in range(3):
                part = part + _dot(rowt[dx], wts[dy * 3 + dx], precision, cdt)
            if dy == 0:
                part = jnp.where(h >= 1, part, jnp.zeros_like(part))
            elif dy == 2:
                part = jnp.where(h < height - 1, part, jnp.zeros_like(part))
            acc = acc + part
        if has_bias:
            acc = acc + bias
        if relu:
            acc = jnp.maximum(acc, jnp.zeros_like(acc))
        start = k * width + col0
        pb.masked_store(o_ref.at[pl.ds(start, bp), :], acc, _mask2(owned & (k < n_rows), cop, co))
        return mid, below

    lax.fori_loop(0, rpp, body, (load_row(r0 - 1), load_row(r0)))


@functools.partial(jax.jit, static_argnames=("relu", "precision", "interpret", "bp", "num_warps", "num_stages",
                                             "out_dtype", "name", "rpp"))
def _shift_conv_call(x, w9, b, y, *, relu, precision, interpret, bp, num_warps, num_stages, out_dtype, name,
                     rpp=None):
    """``x[N,H,W,ci]`` (or ``g``), ``w9[9, ci, co]`` (already flipped/transposed for the input grad), ``b[co]`` or
    None, ``y[N,H,W,ci]`` (ReLU' mask source) or None -> ``[N,H,W,co]``."""
    n, height, width, ci = x.shape
    co = w9.shape[2]
    cip, cop = _cpad(ci), _cpad(co)
    mdt, cdt = _dtypes(x.dtype, w9.dtype)
    n_pos = n * height * width
    n_blocks = pl.cdiv(n_pos, bp)
    guard = width + 1 if interpret else 0
    rows = guard + n_blocks * bp + guard  # covers every window start + bp (interpret mode pads the array to it)
    if rpp is not None:
        n_chunks = pl.cdiv(n * height, rpp)
        rows = guard + (n_chunks * rpp + 1) * width + bp + guard

    def flat(a):
        a = a.reshape(n_pos, a.shape[3])
        return jnp.pad(a, ((guard, guard), (0, 0))) if guard else a

    wp = jnp.pad(w9.astype(mdt), ((0, 0), (0, cip - ci), (0, cop - co)))
    args = [flat(x), wp]
    in_specs = [pl.BlockSpec((rows, cip), lambda i: (0, 0)), pl.BlockSpec((9, cip, cop), lambda i: (0, 0, 0))]
    if b is not None:
        args.append(jnp.pad(b.astype(cdt), (0, cop - co)).reshape(1, cop))
        in_specs.append(pl.BlockSpec((1, cop), lambda i: (0, 0)))
    if y is not None:
        args.append(flat(y))
        in_specs.append(pl.BlockSpec((rows, cip), lambda i: (0, 0)))
    if rpp is None:
        kernel = functools.partial(_shift_conv_kernel, has_bias=b is not None, has_ymask=y is not None, relu=relu,
                                   n_pos=n_pos, height=height, width=width, bp=bp, ci=ci, co=co, cip=cip, cop=cop,
                                   guard=guard, precision=precision, cdt=cdt, mdt=mdt)
        grid, out_spec = (n_blocks,), pl.BlockSpec((bp, cop), lambda i: (i, 0))
    else:
        kernel = functools.partial(_strip_conv_kernel, has_bias=b is not None, has_ymask=y is not None, relu=relu,
                                   n_rows=n * height, height=height, width=width, bp=bp, rpp=rpp, ci=ci, co=co,
                                   cip=cip, cop=cop, guard=guard, precision=precision, cdt=cdt, mdt=mdt)
        grid = (pl.cdiv(width, bp), n_chunks)
        out_spec = pl.BlockSpec(((n_chunks * rpp + 1) * width + bp, cop), lambda s, c: (0, 0))
        in_specs = [pl.BlockSpec(sp.block_shape, lambda s, c, nd=len(sp.block_shape): (0,) * nd) for sp in in_specs]
    out = pb.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_pos, co), out_dtype),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        name=name,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )(*args)
    return out.reshape(n, height, width, co)


def conv3x3_forward(x, w, b=None, *, relu: bool = False, precision: Any = None, interpret: bool | None = None,
                    **blocks) -> jax.Array:
    r"""``y = act(correlate(x, w) + b)``: 3x3, stride 1, SAME (zero padding 1), NHWC / HWIO.

    Args:
      x: ``[N, H, W, Cin]`` (bf16, f32; f64 in interpret mode), ``1 <= Cin <= 32``.
      w: ``[3, 3, Cin, Cout]`` (HWIO, not flipped: ``lax.conv_general_dilated`` semantics), ``1 <= Cout <= 32``.
      b: ``[Cout]`` bias or ``None``.
      relu: apply ``max(., 0)`` in the epilogue.
      precision: ``None``/``DEFAULT`` (TF32 on the GPU), ``HIGHEST`` (IEEE f32) or a ``DotAlgorithmPreset``.
      interpret: force Pallas interpret mode (``None``: on unless running on a GPU).
      **blocks: ``block_p`` (positions per program, power of two >= 16), ``num_warps``, ``num_stages``;
        defaults :data:`FWD_DEFAULTS`.
    Returns:
      ``y[N, H, W, Cout]`` in ``x.dtype`` (accumulated in f32, or f64 for f64 inputs).
    """
    fn = "conv3x3_forward"
    n, height, width, cin = _check_act(fn, "x", x, "Cin")
    _, cout = _check_weight(fn, w, cin, None)
    if b is not None:
        _check_float(fn, "b", b)
        if tuple(b.shape) != (cout,):
            raise ValueError(f"{fn}: 'b' must have shape ({cout},) = [Cout] or be None, got {tuple(b.shape)}")
    if not isinstance(relu, bool):
        raise ValueError(f"{fn}: 'relu' must be a bool, got {relu!r}")
    cfg = _config(fn, FWD_DEFAULTS, blocks)
    n_pos = n * height * width
    if n_pos == 0:
        return jnp.zeros((n, height, width, cout), x.dtype)
    rpp = cfg["rows_per_program"]
    return _shift_conv_call(x, w.reshape(9, cin, cout), b, None, relu=relu, precision=precision,
                            interpret=pb.resolve_interpret(interpret),
                            bp=pb.block_size(width if rpp else n_pos, cfg["block_p"]), num_warps=cfg["num_warps"],
                            num_stages=cfg["num_stages"], out_dtype=jnp.dtype(x.dtype), name="conv3x3_fwd", rpp=rpp)


def conv3x3_input_grad(g, w, *, y=None, precision: Any = None, interpret: bool | None = None,
                       **blocks) -> jax.Array:
    r"""``dx[n,h,w,i] = sum_{dy,dx,o} gz_pad[n, h+2-dy, w+2-dx, o] w[dy,dx,i,o]`` with ``gz = g * (y > 0)`` when
    ``y`` (the forward's ReLU output, shape of ``g``) is given, else ``gz = g``; the mask is applied on load.

    ``g``: ``[N, H, W, Cout]``; ``w``: ``[3, 3, Cin, Cout]``. Returns ``[N, H, W, Cin]`` in ``g.dtype``.
    ``precision``, ``interpret`` as in :func:`conv3x3_forward`; ``**blocks``: ``block_p``, ``num_warps``,
    ``num_stages`` (defaults :data:`INPUT_GRAD_DEFAULTS`).
    """
    fn = "conv3x3_input_grad"
    n, height, width, cout = _check_act(fn, "g", g, "Cout")
    cin, _ = _check_weight(fn, w, None, cout)
    _check_y(fn, y, g.shape)
    cfg = _config(fn, INPUT_GRAD_DEFAULTS, blocks)
    n_pos = n * height * width
    if n_pos == 0:
        return jnp.zeros((n, height, width, cin), g.dtype)
    # tap t' = (dy', dx') of the transposed conv reads g at offset -(offset of tap (2-dy', 2-dx')) with W^T.
    w9 = jnp.transpose(w[::-1, ::-1], (0, 1, 3, 2)).reshape(9, cout, cin)
    rpp = cfg["rows_per_program"]
    return _shift_conv_call(g, w9, None, y, relu=False, precision=precision,
                            interpret=pb.resolve_interpret(interpret),
                            bp=pb.block_size(width if rpp else n_pos, cfg["block_p"]), num_warps=cfg["num_warps"],
                            num_stages=cfg["num_stages"], out_dtype=jnp.dtype(g.dtype), name="conv3x3_input_grad",
                            rpp=rpp)


# ---------------------------------------------------------------------------------------------------------------
# Weight-grad kernel
# ---------------------------------------------------------------------------------------------------------------
def _wgrad_kernel(*refs, has_ymask, n_pos, height, width, bp, per, splits, ci, co, cip, cop, guard, precision,
                  cdt, mdt):
    it = iter(refs)
    x_ref, g_ref = next(it), next(it)
    y_ref = next(it) if has_ymask else None
    dw_ref, db_ref = next(it), next(it)
    s = pl.program_id(0)

    def body(j, carry):
        accs, db = carry
        p0 = pl.multiple_of((j * splits + s) * bp, bp)
        p = p0 + jnp.arange(bp, dtype=jnp.int32)
        rows, cols = _tap_row_col_masks(p, n_pos, height, width)
        gmask = _mask2(rows[1], cop, co)  # rows[1] = p < P
        gv = pb.masked_load(g_ref.at[pl.ds(p0, bp), :], gmask)
        if has_ymask:
            yv = pb.masked_load(y_ref.at[pl.ds(p0, bp), :], gmask)
            gv = jnp.where(yv > 0, gv, jnp.zeros_like(gv))
        db = db + jnp.sum(gv.astype(cdt), axis=0, keepdims=True)
        gm = gv.astype(mdt)
        new = []
        for t, (dy, dx) in enumerate(_TAPS):
            ok = rows[dy] if cols[dx] is None else rows[dy] & cols[dx]
            start = p0 + ((dy - 1) * width + (dx - 1) + guard)
            a = pb.masked_load(x_ref.at[pl.ds(start, bp), :], _mask2(ok, cip, ci))
            # dW_t^T[cop, cip] += gz^T @ X_t: the one transposed operand (gz) is shared by the 9 dots; X_t is the
            # dot's B operand in its natural [K=positions, N=channels] row-major layout.
            new.append(accs[t] + _dot(gm, a.astype(mdt), precision, cdt, contract=((0,), (0,))))
        return tuple(new), db

    init = (tuple(jnp.zeros((cop, cip), cdt) for _ in _TAPS), jnp.zeros((1, cop), cdt))
    accs, db = lax.fori_loop(0, per, body, init)
    for t in range(len(_TAPS)):
        dw_ref[t, :, :] = accs[t].astype(dw_ref.dtype)
    db_ref[...] = db.astype(db_ref.dtype)


@functools.partial(jax.jit, static_argnames=("precision", "interpret", "bp", "splits", "num_warps", "num_stages",
                                             "out_dtype"))
def _wgrad_call(x, g, y, *, precision, interpret, bp, splits, num_warps, num_stages, out_dtype):
    n, height, width, ci = x.shape
    co = g.shape[3]
    cip, cop = _cpad(ci), _cpad(co)
    mdt, cdt = _dtypes(x.dtype, g.dtype)
    n_pos = n * height * width
    n_blocks = pl.cdiv(n_pos, bp)
    splits = min(splits, n_blocks)
    per = pl.cdiv(n_blocks, splits)
    guard = width + 1 if interpret else 0
    span = splits * per * bp  # positions walked (the last ones masked)
    x_rows = guard + span + guard
    xf = x.reshape(n_pos, ci)
    if guard:
        xf = jnp.pad(xf, ((guard, guard), (0, 0)))
    args = [xf, g.reshape(n_pos, co)]
    in_specs = [pl.BlockSpec((x_rows, cip), lambda s: (0, 0)), pl.BlockSpec((span, cop), lambda s: (0, 0))]
    if y is not None:
        args.append(y.reshape(n_pos, co))
        in_specs.append(pl.BlockSpec((span, cop), lambda s: (0, 0)))
    kernel = functools.partial(_wgrad_kernel, has_ymask=y is not None, n_pos=n_pos, height=height, width=width,
                               bp=bp, per=per, splits=splits, ci=ci, co=co, cip=cip, cop=cop, guard=guard,
                               precision=precision, cdt=cdt, mdt=mdt)
    dw_part, db_part = pb.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((splits, 9, cop, cip), cdt), jax.ShapeDtypeStruct((splits, 1, cop), cdt)),
        grid=(splits,),
        in_specs=in_specs,
        out_specs=(pl.BlockSpec((pl.squeezed, 9, cop, cip), lambda s: (s, 0, 0, 0)),
                   pl.BlockSpec((pl.squeezed, 1, cop), lambda s: (s, 0, 0))),
        name="conv3x3_weight_grad",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )(*args)
    dw = jnp.transpose(dw_part.sum(0)[:, :co, :ci], (0, 2, 1)).reshape(3, 3, ci, co)
    db = db_part.sum((0, 1))[:co]
    return dw.astype(out_dtype), db.astype(out_dtype)


def conv3x3_weight_grad(x, g, *, y=None, precision: Any = None, interpret: bool | None = None,
                        **blocks) -> tuple[jax.Array, jax.Array]:
    r"""``(dw[3,3,Cin,Cout], db[Cout])``: ``dw[dy,dx,i,o] = sum_{n,h,w} x_pad[n,h+dy,w+dx,i] gz[n,h,w,o]``,
    ``db[o] = sum gz[..., o]``, ``gz = g * (y > 0)`` if ``y`` is given (applied on load), else ``g``.

    ``x``: ``[N, H, W, Cin]``; ``g`` (and ``y``): ``[N, H, W, Cout]``. Each program reduces its position blocks to
    ``[9, Cin, Cout]`` + ``[Cout]`` f32 partials in registers; XLA sums the ``num_splits`` partials
    (deterministic). Returns both in ``result_type(x, g)``. ``**blocks``: ``block_p``, ``num_splits`` (``None``:
    automatic), ``num_warps``, ``num_stages`` (defaults :data:`WEIGHT_GRAD_DEFAULTS`).
    """
    fn = "conv3x3_weight_grad"
    n, height, width, cin = _check_act(fn, "x", x, "Cin")
    gshape = _check_act(fn, "g", g, "Cout")
    if gshape[:3] != (n, height, width):
        raise ValueError(f"{fn}: 'g' must have shape [{n}, {height}, {width}, Cout] (N, H, W of 'x' "
                         f"{tuple(x.shape)}), got {tuple(g.shape)}")
    cout = gshape[3]
    _check_y(fn, y, g.shape)
    cfg = _config(fn, WEIGHT_GRAD_DEFAULTS, blocks)
    out_dtype = jnp.dtype(jnp.result_type(x.dtype, g.dtype))
    n_pos = n * height * width
    if n_pos == 0:
        return jnp.zeros((3, 3, cin, cout), out_dtype), jnp.zeros((cout,), out_dtype)
    interp = pb.resolve_interpret(interpret)
    splits = cfg["num_splits"] or (_INTERPRET_SPLITS if interp else _GPU_SPLITS)
    return _wgrad_call(x, g, y, precision=precision, interpret=interp, bp=pb.block_size(n_pos, cfg["block_p"]),
                       splits=splits, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                       out_dtype=out_dtype)
