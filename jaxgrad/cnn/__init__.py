"""CNNs with a hand-written conv2d VJP: the cryo-EM denoiser, PyTorch layouts, MRC data that does not fit in RAM.

Functional API (params are lists of ``{"w": HWIO, "b": [Cout]}`` dicts):

* :func:`conv2d` (custom VJP; ``backend="xla" | "pallas" | "reference"``), :func:`conv2d_reference` (plain JAX,
  the oracle), :func:`conv2d_input_grad`, :func:`conv2d_weight_grad` (the two backward products);
* :mod:`jaxgrad.cnn.layout`: PyTorch OIHW/NCHW <-> HWIO/NHWC, and when a kernel flip is (not) needed;
* :mod:`jaxgrad.cnn.denoiser`: :class:`DenoiserConfig`, ``init``, ``apply``, ``mse_loss``, ``make_train_step``,
  ``train``; :mod:`jaxgrad.cnn.nnx` for the flax.nnx wrapper;
* :mod:`jaxgrad.cnn.kernels`: fused Pallas 3x3 kernels (forward with bias + ReLU, input and weight gradients);
* :mod:`jaxgrad.cnn.data` (MRC stacks, bounded-memory shuffled streams, Noise2Noise pairs; defined in
  :mod:`jaxgrad.cnn.mrc` and :mod:`jaxgrad.cnn.stream`) and
  :mod:`jaxgrad.cnn.synthetic` (projections of random 3-D densities).
"""

from jaxgrad.cnn import layout
from jaxgrad.cnn.conv import conv2d, conv2d_input_grad, conv2d_reference, conv2d_weight_grad
from jaxgrad.cnn.denoiser import DenoiserConfig

__all__ = ["DenoiserConfig", "conv2d", "conv2d_input_grad", "conv2d_reference", "conv2d_weight_grad", "layout"]
