r"""2-D convolution with a hand-written VJP: reference, custom_vjp (XLA) and the Pallas 3x3 path side by side.

Layout inside jaxgrad: activations ``x[N, H, W, Cin]`` (NHWC), weights ``w[kh, kw, Cin, Cout]`` (HWIO), bias
``b[Cout]``. Like PyTorch's ``nn.Conv2d``, cuDNN's ``CUDNN_CROSS_CORRELATION`` mode and ``lax.conv_general_dilated``,
the op is a **cross-correlation** (no kernel flip); :mod:`jaxgrad.cnn.layout` converts PyTorch's OIHW/NCHW.

With stride ``s``, dilation ``d`` and explicit padding ``(p_t, p_b), (p_l, p_r)`` (``xp`` = x zero-padded):

.. math::

    z[n, h, w, o] &= \sum_{u, v, i} xp[n,\; h s + u d,\; w s + v d,\; i]\; w[u, v, i, o] + b[o]
                     \qquad y = \sigma(z)                                                           \\
    \bar z &= \bar y \odot \sigma'(z) \qquad (\text{ReLU: } \bar z = \bar y\, [y > 0])             \\
    \bar b[o] &= \sum_{n, h, w} \bar z[n, h, w, o]                                                  \\
    \bar w[u, v, i, o] &= \sum_{n, h, w} xp[n,\; h s + u d,\; w s + v d,\; i]\; \bar z[n, h, w, o]
                     \quad \text{(correlation of x with } \bar z\text{)}                            \\
    \bar x[n, r, c, i] &= \sum_{u, v, o} \bar z_s[n,\; r + p_t - u d,\; c + p_l - v d,\; o]\; w[u, v, i, o]
                     \quad \text{(transposed convolution)}

where :math:`\bar z_s` is :math:`\bar z` with ``s - 1`` zeros inserted between its entries (indices not on the
stride lattice, or outside, contribute 0). The last line is a correlation of the zero-padded, dilated
:math:`\bar z` with the kernel **flipped in space and transposed in channels**, ``w[::-1, ::-1].swap(I, O)``:
that is the one place a flip belongs, and it is internal to the VJP.

Backends (``backend=``): ``"xla"`` (default) — the custom VJP above, each product one
``lax.conv_general_dilated`` (cuDNN on the GPU); ``"pallas"`` — the same custom VJP whose three products run
in the fused Pallas kernels of :mod:`jaxgrad.cnn.kernels` (3x3, stride 1, dilation 1, padding 1, <= 32
channels; bias and ReLU fused, ReLU' fused into the backward loads, no im2col in HBM); ``"reference"`` —
plain JAX, differentiated by ``jax.grad`` (the oracle).

Precision: ``precision=None`` is JAX's default, i.e. **TF32** for f32 convolutions on the GPU (exact f32 on the
CPU); ``jax.lax.Precision.HIGHEST`` gives exact f32. The backward products use the forward's precision.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxgrad.checks import check_precision

Padding = str | int | Sequence[tuple[int, int]]
DIMENSION_NUMBERS = ("NHWC", "HWIO", "NHWC")
ACTIVATIONS = (None, "relu")
BACKENDS = ("xla", "pallas", "reference")


# ----------------------------------------------------------------------------------------------- arguments
def _pair(value: Any, name: str, minimum: int) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    try:
        pair = tuple(int(v) for v in value)
    except TypeError:
        raise ValueError(f"conv2d: {name} must be an int or a pair of ints, got {value!r}") from None
    if len(pair) != 2 or any(v < minimum for v in pair) or any(int(v) != v for v in value):
        raise ValueError(f"conv2d: {name} must be an int or a pair of ints >= {minimum}, got {value!r}")
    return pair


def resolve_padding(padding: Padding, in_hw: Sequence[int], kernel_hw: Sequence[int],
                    stride: Sequence[int], dilation: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Explicit ``((p_t, p_b), (p_l, p_r))`` for ``"SAME"``, ``"VALID"``, an int or explicit pairs.

    ``"SAME"`` follows TensorFlow/JAX: output size ``ceil(H / s)``, total padding
    ``max((ceil(H/s) - 1) s + (k - 1) d + 1 - H, 0)``, the odd pixel at the bottom/right. (PyTorch's
    ``padding="same"`` pads the same way for stride 1, the only stride it allows.)
    """
    if isinstance(padding, str):
        mode = padding.upper()
        if mode == "VALID":
            return ((0, 0), (0, 0))
        if mode != "SAME":
            raise ValueError(f"conv2d: padding must be 'SAME', 'VALID', an int or ((top, bottom), (left, right)), "
                             f"got {padding!r}")
        pads = []
        for n, k, s, d in zip(in_hw, kernel_hw, stride, dilation):
            out = -(-n // s)
            total = max((out - 1) * s + (k - 1) * d + 1 - n, 0)
            pads.append((total // 2, total - total // 2))
        return tuple(pads)  # type: ignore[return-value]
    if isinstance(padding, int) and not isinstance(padding, bool):
        if padding < 0:
            raise ValueError(f"conv2d: padding must be >= 0, got {padding}")
        return ((padding, padding), (padding, padding))
    try:
        pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    except (TypeError, ValueError):
        raise ValueError(f"conv2d: padding must be 'SAME', 'VALID', an int or ((top, bottom), (left, right)), "
                         f"got {padding!r}") from None
    if len(pads) != 2 or any(p < 0 for pair in pads for p in pair):
        raise ValueError(f"conv2d: explicit padding must be two (lo, hi) pairs of ints >= 0, got {padding!r}")
    return pads  # type: ignore[return-value]


WEIGHT_LAYOUTS = (None, "HWIO")
_TO_HWIO = "jaxgrad.cnn.layout.torch_weight_to_hwio"


def _reads_as_oihw(w_shape: Sequence[int], cin: int) -> bool:
    """Whether ``w_shape`` is also PyTorch's OIHW ``[Cout, Cin, kh, kw]`` for ``cin`` input channels, read as the
    likelier of the two: ``w.shape[1] == Cin`` and a square ``kh x kw`` kernel, where the HWIO reading is a
    non-square ``w.shape[0] x w.shape[1]`` kernel. (Given a consistent HWIO reading, ``w.shape[2] == Cin``, this
    is ``w.shape[1:] == (Cin, Cin, Cin) != w.shape[0]``: e.g. ``[8, 3, 3, 3]``, 8 filters of 3x3 on RGB.)"""
    return w_shape[1] == cin and w_shape[2] == w_shape[3] and w_shape[0] != w_shape[1]


def check_conv_args(x: Any, w: Any, b: Any = None, *, layout: str | None = None) -> None:
    """Shape/dtype checks with messages that name the argument and the expected layout.

    ``layout``: see :func:`conv2d` (``None``: HWIO, refusing a weight whose shape reads more plausibly as PyTorch's
    OIHW; ``"HWIO"``: HWIO, as stated by the caller).
    """
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"conv2d: layout must be None or 'HWIO' (w is [kh, kw, Cin, Cout]; convert PyTorch's OIHW "
                         f"with {_TO_HWIO}), got {layout!r}")
    for name, arr, rank in (("x", x, 4), ("w", w, 4)):
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise ValueError(f"conv2d: {name} must be an array, got {type(arr).__name__}")
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise ValueError(f"conv2d: {name} must be floating point (float32, bfloat16, float64), got {arr.dtype}")
        if arr.ndim != rank:
            layout_name = "[N, H, W, C] (NHWC)" if name == "x" else "[kh, kw, Cin, Cout] (HWIO)"
            raise ValueError(f"conv2d: {name} must have rank {rank}, {layout_name}; got shape {tuple(arr.shape)}")
    cin, ws = w.shape[2], tuple(w.shape)
    if min(ws[:2]) < 1:
        raise ValueError(f"conv2d: w's kernel must be at least 1x1 (w is HWIO [kh, kw, Cin, Cout] = {ws})")
    if x.shape[-1] != cin:
        hint = ""
        if x.shape[1] == cin:
            hint = (" x looks like NCHW (PyTorch); convert it with jaxgrad.cnn.layout.nchw_to_nhwc.")
        elif w.shape[1] == x.shape[-1] or w.shape[0] == x.shape[-1] or w.shape[3] == x.shape[-1]:
            hint = f" w looks like PyTorch's OIHW [Cout, Cin, kh, kw]; convert it with {_TO_HWIO}."
        raise ValueError(f"conv2d: x has {x.shape[-1]} channels (NHWC, last axis) but w expects Cin={cin} "
                         f"(w is HWIO [kh, kw, Cin, Cout] = {ws}).{hint}")
    if b is not None:
        if not hasattr(b, "shape") or tuple(b.shape) != (w.shape[3],):
            b_shape = tuple(getattr(b, "shape", ()))
            if b_shape == (w.shape[0],) and w.shape[1] == cin:
                raise ValueError(f"conv2d: w {ws} with b {b_shape} reads as PyTorch's OIHW [Cout={ws[0]}, "
                                 f"Cin={ws[1]}, {ws[2]}x{ws[3]}] (as HWIO [kh, kw, Cin, Cout], b would need shape "
                                 f"({ws[3]},)); convert w with {_TO_HWIO}")
            raise ValueError(f"conv2d: b must have shape (Cout,) = ({w.shape[3]},), got {b_shape}")
        if not jnp.issubdtype(b.dtype, jnp.floating):
            raise ValueError(f"conv2d: b must be floating point, got {b.dtype}")
    elif layout is None and _reads_as_oihw(ws, cin):
        raise ValueError(f"conv2d: w {ws} is ambiguous: as HWIO, kernel {ws[0]}x{ws[1]} with Cout={ws[3]}; as "
                         f"PyTorch's OIHW, {ws[0]} filters of {ws[2]}x{ws[3]}; convert a PyTorch weight with "
                         f"{_TO_HWIO}, or pass layout='HWIO' if w is HWIO")


def _check_geometry(x_shape, w_shape, stride, pads, dilation) -> None:
    for axis, n, k, (lo, hi), d in zip(("H", "W"), x_shape[1:3], w_shape[:2], pads, dilation):
        span = (k - 1) * d + 1
        if n + lo + hi < span:
            raise ValueError(f"conv2d: the kernel spans {span} pixels along {axis} (k={k}, dilation={d}) but the "
                             f"padded input has only {n + lo + hi} (size {n} + padding {lo}+{hi}); pad more or use "
                             f"a smaller kernel")


def _acc_dtype(dtype) -> Any:
    """Accumulate in f32 at least (bf16 inputs), f64 for f64 inputs (the verifier's oracle runs)."""
    return jnp.promote_types(dtype, jnp.float32)


def _apply_activation(z: jax.Array, activation: str | None) -> jax.Array:
    if activation is None:
        return z
    return jax.nn.relu(z)


def _activation_grad(g: jax.Array, y: jax.Array, activation: str | None) -> jax.Array:
    """``z_bar = y_bar * sigma'(z)``; for ReLU ``sigma'(z) = [z > 0] = [y > 0]`` (0 at the kink, like jax.nn.relu)."""
    if activation is None:
        return g
    return jnp.where(y > 0, g, jnp.zeros_like(g))


# ----------------------------------------------------------------------------------------------- reference
def conv2d_reference(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, stride: int | Sequence[int] = 1,
                     padding: Padding = "SAME", dilation: int | Sequence[int] = 1, activation: str | None = None,
                     precision: Any = None, layout: str | None = None) -> jax.Array:
    r"""Plain JAX, differentiated by JAX itself: the oracle for the VJPs. Arguments as :func:`conv2d`.

    Written as the sum over taps of the definition, ``z = sum_{u,v} xp[:, u d :: s, v d :: s, :] @ w[u, v]``
    (strided slices and one ``einsum`` per tap), not with ``lax.conv_general_dilated``: the oracle then shares no
    code with the convolution primitive whose transposes the custom VJP calls (and ``jax.grad`` of a
    ``lax.conv_general_dilated`` aborts XLA's CPU compiler for some strided geometries, see
    :func:`conv2d_input_grad`).
    """
    check_conv_args(x, w, b, layout=layout)
    check_precision(precision, "conv2d_reference")
    stride, dilation = _pair(stride, "stride", 1), _pair(dilation, "dilation", 1)
    pads = resolve_padding(padding, x.shape[1:3], w.shape[:2], stride, dilation)
    _check_geometry(x.shape, w.shape, stride, pads, dilation)
    xp = jnp.pad(x, ((0, 0), *pads, (0, 0)))
    out_hw = [(n - ((k - 1) * d + 1)) // s + 1 for n, k, s, d in zip(xp.shape[1:3], w.shape[:2], stride, dilation)]
    z = None
    for u in range(w.shape[0]):
        for v in range(w.shape[1]):
            r0, c0 = u * dilation[0], v * dilation[1]
            patch = xp[:, r0:r0 + (out_hw[0] - 1) * stride[0] + 1:stride[0],
                       c0:c0 + (out_hw[1] - 1) * stride[1] + 1:stride[1], :]
            term = jnp.einsum("nhwi,io->nhwo", patch, w[u, v], precision=precision,
                              preferred_element_type=_acc_dtype(x.dtype))
            z = term if z is None else z + term
    if b is not None:
        z = z + b.astype(z.dtype)
    return _apply_activation(z, activation).astype(x.dtype)


# ----------------------------------------------------------------------------------------------- XLA VJP products
def conv2d_input_grad(gz: jax.Array, w: jax.Array, x_hw: Sequence[int], *, stride, pads, dilation,
                      precision=None) -> jax.Array:
    r"""``x_bar``: correlation of the stride-dilated, padded ``z_bar`` with ``w`` flipped in space, I<->O swapped.

    Padding of the transposed problem: ``lo' = (k-1) d - p_lo`` and ``hi' = H + p_lo - (H_out - 1) s - 1`` so that
    the result has exactly ``H`` rows (rows the forward never read get 0; negative values crop).
    """
    k_hw = w.shape[:2]
    pads_t = []
    for n, k, (lo, _), s, d, n_out in zip(x_hw, k_hw, pads, stride, dilation, gz.shape[1:3]):
        lo_t = (k - 1) * d - lo
        pads_t.append((lo_t, n + lo - (n_out - 1) * s - 1))
    w_t = jnp.swapaxes(w[::-1, ::-1], 2, 3)  # [kh, kw, Cout, Cin], flipped in space
    lhs_dilation = stride
    if stride != (1, 1):
        # Insert the stride's zeros and the padding with one lax.pad instead of lhs_dilation: XLA's CPU
        # algebraic simplifier (jax 0.11.2) aborts the process on some lhs-dilated convolutions whose kernel
        # is wider than the dilated input (e.g. 2x4 kernel, stride 2, 10x5 input, padding 1) -- and so does
        # jax.grad of the plain reference there. Mathematically identical; the optimization barrier stops XLA
        # from folding the pad back into the convolution.
        gz = lax.pad(gz, jnp.zeros((), gz.dtype),
                     ((0, 0, 0), (*pads_t[0], stride[0] - 1), (*pads_t[1], stride[1] - 1), (0, 0, 0)))
        gz = lax.optimization_barrier(gz)
        pads_t, lhs_dilation = ((0, 0), (0, 0)), (1, 1)
    return lax.conv_general_dilated(gz, w_t, (1, 1), pads_t, lhs_dilation=lhs_dilation, rhs_dilation=dilation,
                                    dimension_numbers=DIMENSION_NUMBERS, precision=precision,
                                    preferred_element_type=_acc_dtype(gz.dtype)).astype(gz.dtype)


def conv2d_weight_grad(x: jax.Array, gz: jax.Array, k_hw: Sequence[int], *, stride, pads, dilation,
                       precision=None) -> jax.Array:
    r"""``w_bar[u, v, i, o] = sum_{n,h,w} xp[n, h s + u d, w s + v d, i] z_bar[n, h, w, o]``.

    One convolution whose *batch* is the input channel and whose *contracted feature* is the image index:
    lhs ``x`` read as "CHWN", rhs ``z_bar`` as "IHWO" (I = n), window stride = the forward's dilation, rhs
    dilation = the forward's stride, output "HWNC" = ``[kh, kw, Cin, Cout]``. The high padding is trimmed so the
    output has exactly ``kh x kw`` taps.
    """
    pads_w = []
    for n, k, (lo, _), s, d, n_out in zip(x.shape[1:3], k_hw, pads, stride, dilation, gz.shape[1:3]):
        pads_w.append((lo, (k - 1) * d + (n_out - 1) * s + 1 - n - lo))
    return lax.conv_general_dilated(x, gz, dilation, pads_w, rhs_dilation=stride,
                                    dimension_numbers=("CHWN", "IHWO", "HWNC"), precision=precision,
                                    preferred_element_type=_acc_dtype(x.dtype))


# ----------------------------------------------------------------------------------------------- custom VJP
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _conv2d(x, w, b, geometry, options):
    return _conv2d_fwd(x, w, b, geometry, options)[0]


def _conv2d_fwd(x, w, b, geometry, options):
    stride, pads, dilation = geometry
    activation, precision, backend = options
    if backend == "pallas":
        from jaxgrad.cnn import kernels

        y = kernels.conv3x3_forward(x, w, b, relu=activation == "relu", precision=precision)
    else:
        z = lax.conv_general_dilated(x, w, stride, pads, rhs_dilation=dilation,
                                     dimension_numbers=DIMENSION_NUMBERS, precision=precision,
                                     preferred_element_type=_acc_dtype(x.dtype))
        if b is not None:
            z = z + b.astype(z.dtype)
        y = _apply_activation(z, activation).astype(x.dtype)
    # Saved: the inputs of the two products and the *post*-activation output (its sign is ReLU'; saving z would
    # also do, but y is what the next layer keeps anyway).
    return y, (x, w, b is not None, y if activation is not None else None)


def _conv2d_bwd(geometry, options, residuals, g):
    stride, pads, dilation = geometry
    activation, precision, backend = options
    x, w, has_bias, y = residuals
    if backend == "pallas":
        from jaxgrad.cnn import kernels

        mask = y if activation == "relu" else None
        dx = kernels.conv3x3_input_grad(g, w, y=mask, precision=precision)
        dw, db = kernels.conv3x3_weight_grad(x, g, y=mask, precision=precision)
    else:
        gz = _activation_grad(g, y, activation)
        dx = conv2d_input_grad(gz, w, x.shape[1:3], stride=stride, pads=pads, dilation=dilation,
                               precision=precision)
        dw = conv2d_weight_grad(x, gz, w.shape[:2], stride=stride, pads=pads, dilation=dilation,
                                precision=precision)
        db = jnp.sum(gz.astype(_acc_dtype(gz.dtype)), axis=(0, 1, 2))
    return (dx.astype(x.dtype), dw.astype(w.dtype), db.astype(w.dtype) if has_bias else None)


_conv2d.defvjp(_conv2d_fwd, _conv2d_bwd)


def _pallas_supported(x_shape, w_shape, stride, pads, dilation) -> str | None:
    if tuple(w_shape[:2]) != (3, 3):
        return f"a 3x3 kernel (w is {tuple(w_shape)})"
    if stride != (1, 1) or dilation != (1, 1):
        return f"stride 1 and dilation 1 (got stride={stride}, dilation={dilation})"
    if pads != ((1, 1), (1, 1)):
        return f"padding 1 on every side ('SAME' for 3x3; got {pads})"
    if max(w_shape[2], w_shape[3]) > 32:
        return f"at most 32 channels (w has Cin={w_shape[2]}, Cout={w_shape[3]})"
    return None


def conv2d(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, stride: int | Sequence[int] = 1,
           padding: Padding = "SAME", dilation: int | Sequence[int] = 1, activation: str | None = None,
           precision: Any = None, backend: str = "xla", layout: str | None = None) -> jax.Array:
    """``activation(correlate(x, w) + b)`` in NHWC/HWIO with the hand-written VJP documented in the module.

    Args:
      x: ``[N, H, W, Cin]`` float. w: ``[kh, kw, Cin, Cout]`` (HWIO). b: ``[Cout]`` or ``None``.
      stride, dilation: int or ``(sh, sw)``, >= 1. padding: ``"SAME"``, ``"VALID"``, an int, or
        ``((top, bottom), (left, right))``.
      activation: ``None`` or ``"relu"`` (fused: the backward uses the saved output's sign).
      precision: ``None`` (JAX default: TF32 on GPU) or a ``jax.lax.Precision``.
      backend: ``"xla"`` | ``"pallas"`` | ``"reference"``.
      layout: ``None`` (default) or ``"HWIO"``, see below.
    Returns ``[N, H_out, W_out, Cout]`` in x's dtype.

    **PyTorch weights.** ``nn.Conv2d.weight`` is OIHW ``[Cout, Cin, kh, kw]``; convert it with
    :func:`jaxgrad.cnn.layout.torch_weight_to_hwio`. An OIHW weight passed as it is fails the channel check and the
    error names that function -- except when its shape also reads as a valid HWIO weight for ``x``: ``kh == Cin``
    (e.g. ``[8, 3, 3, 3]``, 8 filters of 3x3 on RGB, reads as an 8x3 HWIO kernel with 3 outputs). With a bias the
    two readings are told apart by ``b``'s length (an OIHW one is named as such). Without one, a weight
    ``[k, C, C, C]`` with ``C = Cin`` and ``k != C`` (HWIO: a non-square ``k x C`` kernel with ``Cout = Cin``;
    OIHW: ``k`` filters of ``C x C``) is refused with ``layout=None``, since no shape check can tell which it is and
    a wrong guess is a silently wrong result; a caller whose weight really is that HWIO kernel says so with
    ``layout="HWIO"``. Square HWIO kernels, and any weight whose OIHW reading is impossible for ``x``, never
    trip this. The one shape no rule can decide is ``[C, C, C, C]`` (a CxC kernel, ``Cin == Cout == C``): it is
    the same shape in both layouts, so convert PyTorch weights always, whatever their shape.

    ``x`` and ``w`` must have the same dtype (as in PyTorch's ``nn.Conv2d``; there is no implicit promotion): cast
    one of them, e.g. ``w.astype(x.dtype)`` for bf16 activations with f32 master weights. A mismatch raises
    ``TypeError`` naming both dtypes, on every backend.
    """
    check_conv_args(x, w, b, layout=layout)
    if x.dtype != w.dtype:
        raise TypeError(f"conv2d: x and w must have the same dtype, got x {x.dtype} and w {w.dtype}; cast one, e.g. "
                        f"w.astype(x.dtype)")
    if backend not in BACKENDS:
        raise ValueError(f"conv2d: backend must be one of {BACKENDS}, got {backend!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"conv2d: activation must be one of {ACTIVATIONS}, got {activation!r}")
    check_precision(precision, "conv2d")
    stride, dilation = _pair(stride, "stride", 1), _pair(dilation, "dilation", 1)
    pads = resolve_padding(padding, x.shape[1:3], w.shape[:2], stride, dilation)
    _check_geometry(x.shape, w.shape, stride, pads, dilation)
    if backend == "reference":
        return conv2d_reference(x, w, b, stride=stride, padding=pads, dilation=dilation, activation=activation,
                                precision=precision, layout=layout)
    if backend == "pallas":
        unsupported = _pallas_supported(x.shape, w.shape, stride, pads, dilation)
        if unsupported:
            raise ValueError(f"conv2d: backend='pallas' needs {unsupported}; use backend='xla' for this layer")
    if isinstance(precision, (tuple, list)):
        precision = tuple(precision)
    return _conv2d(x, w, b, (stride, pads, dilation), (activation, precision, backend))


# ----------------------------------------------------------------------------------------------- audit
def audit_cases():
    """``jaxgrad audit`` cases: white noise, H != W, Cin != Cout, a non-square kernel, every stride/padding mode."""
    from jaxgrad.ops.registry import OpAudit

    def case(name, kernel, cin, cout, backend="xla", **geometry):
        def make_args(key, size):
            n, h, wd = size
            kx, kw_, kb = jax.random.split(key, 3)
            x = jax.random.normal(kx, (n, h, wd, cin))
            w = jax.random.normal(kw_, (*kernel, cin, cout)) / (kernel[0] * kernel[1] * cin) ** 0.5
            return x, w, jax.random.normal(kb, (cout,)) * 0.1

        def fn(x, w, b):
            return conv2d(x, w, b, backend=backend, **geometry)

        def reference(x, w, b):
            return conv2d_reference(x, w, b, **geometry)

        fn.__name__ = name
        sizes = ((1, 7, 9), (2, 17, 13)) if backend == "xla" else ((1, 7, 9), (2, 13, 10))
        return OpAudit(name, fn, reference, make_args, sizes, arg_names=("x", "w", "b"), backend=backend)

    return (
        case("conv2d[xla] 3x5 stride (1,2) dilation 2 relu", (3, 5), 2, 3, stride=(1, 2), dilation=2,
             padding=((2, 1), (0, 3)), activation="relu"),
        case("conv2d[pallas] 3x3 SAME relu", (3, 3), 3, 16, backend="pallas", activation="relu"),
    )
