r"""Layouts, handled once: PyTorch's OIHW/NCHW <-> jaxgrad's HWIO/NHWC, and when a kernel flip is (not) needed.

**Axis order only — no flip — between PyTorch and jaxgrad.** ``torch.nn.Conv2d`` computes the cross-correlation
:math:`y[n,o,h,w] = \sum_{i,u,v} x[n,i,h+u,w+v]\, W[o,i,u,v]` and ``jaxgrad.cnn.conv2d`` the same sum with
``x[n,h+u,w+v,i] w[u,v,i,o]``. So ``w = W.transpose(2, 3, 1, 0)`` and ``W = w.transpose(3, 2, 0, 1)``; pixel
``(u, v)`` of the kernel stays pixel ``(u, v)``. The same holds for cuDNN in ``CUDNN_CROSS_CORRELATION`` mode (what
PyTorch uses), ``lax.conv_general_dilated``, Flax (``nnx.Conv`` kernels are HWIO) and TensorFlow (``[H, W, in,
out]``).

**A PyTorch weight passed unconverted is refused**, naming :func:`torch_weight_to_hwio`: by the channel check,
by the bias's length (``b`` of ``w.shape[0]`` entries), or, for the shapes that also pass as HWIO without a bias,
``[k, C, C, C]`` with ``C = Cin != k``, as ambiguous (:func:`jaxgrad.cnn.conv.conv2d`'s ``layout="HWIO"`` states a
genuine non-square HWIO kernel). ``[C, C, C, C]`` is the same shape in both layouts: always convert.

**Gradients come back in the parameter's own layout.** ``W.grad`` in PyTorch is OIHW like ``W``; ``jax.grad`` with
respect to an HWIO ``w`` is HWIO. Compare them after :func:`torch_weight_to_hwio` — *never* flip a gradient to make it
match: if a flip (or an O<->I swap, or a reshape instead of a transpose) is what makes two gradients agree, one side
has a bug (``jaxgrad.verify`` names which transform fits).

**When a flip IS needed** (``flip_kernel``: ``w[::-1, ::-1]``, an involution):

* importing a kernel from code that computes a *true convolution* :math:`\sum x[h-u, w-v] k[u, v]`:
  ``scipy.signal.convolve2d``, ``numpy.convolve``, MATLAB ``conv2``, cuDNN's ``CUDNN_CONVOLUTION`` mode, FFT
  convolution (pointwise product of spectra);
* inside the input gradient of a correlation, which is a correlation with the flipped, I<->O-transposed kernel
  (:func:`jaxgrad.cnn.conv.conv2d_input_grad` does it; nothing outside it should);
* ``torch.nn.ConvTranspose2d`` weights (``[Cin, Cout, kh, kw]``, IOHW) used as the equivalent forward conv
  (:func:`torch_transpose_weight_to_hwio`).

**Memory order is not axis order.** A Fortran array ``W(KW, KH, C, K)`` has the memory of the C-order array
``[K][C][KH][KW]`` (OIHW); reading it as ``W(K, C, KH, KW)`` silently reverses the axes. Convert with
``np.asfortranarray``/``transpose``, never ``reshape``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def _as_4d(name: str, a: Any, where: str) -> Any:
    if not hasattr(a, "ndim"):
        a = np.asarray(a)
    if a.ndim != 4:
        raise ValueError(f"{where}: '{name}' must be a 4-D array, got shape {tuple(a.shape)}")
    return a


def torch_weight_to_hwio(w_oihw: Any) -> Any:
    """PyTorch ``Conv2d.weight`` ``[Cout, Cin, kh, kw]`` (OIHW) -> ``[kh, kw, Cin, Cout]`` (HWIO). No flip."""
    return _as_4d("w_oihw", w_oihw, "torch_weight_to_hwio").transpose(2, 3, 1, 0)


def hwio_to_torch_weight(w_hwio: Any) -> Any:
    """``[kh, kw, Cin, Cout]`` (HWIO) -> PyTorch ``[Cout, Cin, kh, kw]`` (OIHW). No flip."""
    return _as_4d("w_hwio", w_hwio, "hwio_to_torch_weight").transpose(3, 2, 0, 1)


def torch_transpose_weight_to_hwio(w_iohw: Any) -> Any:
    """``ConvTranspose2d.weight`` ``[Cin, Cout, kh, kw]`` -> the HWIO kernel of the *forward* correlation with
    stride 1 whose input gradient that transposed conv computes: flipped in space (see the module docstring)."""
    w = _as_4d("w_iohw", w_iohw, "torch_transpose_weight_to_hwio").transpose(2, 3, 0, 1)  # [kh, kw, Cin_t, Cout_t]
    return flip_kernel(w)


def flip_kernel(w_hwio: Any) -> Any:
    """Rotate a kernel by 180 degrees in space (``w[::-1, ::-1]``): converts convolution <-> cross-correlation."""
    return _as_4d("w_hwio", w_hwio, "flip_kernel")[::-1, ::-1]


def nchw_to_nhwc(x: Any) -> Any:
    """PyTorch activations ``[N, C, H, W]`` -> ``[N, H, W, C]``."""
    return _as_4d("x", x, "nchw_to_nhwc").transpose(0, 2, 3, 1)


def nhwc_to_nchw(x: Any) -> Any:
    """``[N, H, W, C]`` -> PyTorch ``[N, C, H, W]``."""
    return _as_4d("x", x, "nhwc_to_nchw").transpose(0, 3, 1, 2)


def from_torch_state_dict(state_dict: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
    """A PyTorch conv stack's ``state_dict`` -> jaxgrad's ``[{"w": HWIO, "b": [Cout] or None}, ...]``.

    The conv layers are the 4-D ``*.weight`` entries, in the state dict's (insertion) order, each with its
    ``*.bias`` if present. Works for ``nn.Sequential(Conv2d, ReLU, ...)`` and for modules with named convs.
    Values may be torch tensors (``.detach().cpu().numpy()`` is applied) or arrays.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"from_torch_state_dict: 'state_dict' must be a mapping {{name: tensor}} (model.state_dict()), "
                        f"got {type(state_dict).__name__}")
    layers = []
    for key, value in state_dict.items():
        if not isinstance(key, str) or not key.endswith("weight"):
            continue
        value = _to_numpy(value)
        if value.ndim != 4:
            continue
        prefix = key[: -len("weight")]
        bias = state_dict.get(prefix + "bias")
        if bias is not None:
            bias = np.asarray(_to_numpy(bias))
            if bias.shape != (value.shape[0],):
                raise ValueError(f"from_torch_state_dict: '{prefix}bias' has shape {bias.shape}, but '{key}' "
                                 f"{value.shape} (OIHW) has Cout={value.shape[0]}")
        layers.append({"w": np.ascontiguousarray(torch_weight_to_hwio(value)), "b": bias})
    if not layers:
        raise ValueError("from_torch_state_dict: state_dict has no 4-D '*.weight' entries (no Conv2d layers)")
    return layers


def to_torch_state_dict(layers: Any, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """jaxgrad conv layers -> a state dict of NumPy arrays (OIHW). ``names`` default to ``nn.Sequential``'s
    ``0, 2, 4, ...`` (a conv every other module, ReLUs between). Load with
    ``model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})``."""
    if not isinstance(layers, (list, tuple)) or not all(isinstance(la, Mapping) and "w" in la for la in layers):
        raise TypeError("to_torch_state_dict: 'layers' must be a list of {'w': HWIO, 'b': [Cout] or None} dicts, got "
                        f"{type(layers).__name__}")
    names = names or [str(2 * i) for i in range(len(layers))]
    if len(names) != len(layers):
        raise ValueError(f"to_torch_state_dict: {len(layers)} layers but {len(names)} names")
    sd = {}
    for name, layer in zip(names, layers):
        sd[f"{name}.weight"] = np.ascontiguousarray(hwio_to_torch_weight(np.asarray(layer["w"])))
        if layer.get("b") is not None:
            sd[f"{name}.bias"] = np.asarray(layer["b"])
    return sd


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)
