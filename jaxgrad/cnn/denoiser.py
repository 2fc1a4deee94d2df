r"""The cryo-EM denoiser: a plain stack of 3x3 convolutions with ReLUs, MSE loss, an optax training step.

The seed network is ``1 -> 16 -> 16 -> 1`` channels (:class:`DenoiserConfig` default), 3x3 kernels, ``SAME``
padding, ReLU after every layer but the last:

.. math::

    a_0 = x, \qquad a_l = \mathrm{ReLU}(w_l \star a_{l-1} + b_l)\ (l < L), \qquad
    \hat y = w_L \star a_{L-1} + b_L \;(+\,x \text{ if residual}), \qquad
    \mathcal L = \frac{1}{N H W C} \sum (\hat y - t)^2

with :math:`\star` the cross-correlation of :func:`jaxgrad.cnn.conv.conv2d` (hand-written VJP; bias and ReLU
fused into each layer, so the backward of layer ``l`` multiplies by :math:`[a_l > 0]` itself).

Params are a pytree: a list of ``{"w": [3, 3, Cin, Cout] (HWIO), "b": [Cout]}``, PyTorch's default ``Conv2d``
initialisation (``kaiming_uniform(a=sqrt(5))`` = U(+-1/sqrt(fan_in)) for weights and biases), so the same seed
network can be built on both sides (:mod:`jaxgrad.cnn.layout` converts state dicts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxgrad.checks import check_float_dtype, check_key
from jaxgrad.cnn.conv import conv2d

Params = list[dict[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class DenoiserConfig:
    """Widths ``channels = (C_in, hidden..., C_out)``; ``kernel_size`` odd; ``residual``: predict ``x + net(x)``."""

    channels: tuple[int, ...] = (1, 16, 16, 1)
    kernel_size: int = 3
    residual: bool = False

    def __post_init__(self):
        if isinstance(self.channels, (str, bytes)) or not isinstance(self.channels, Iterable):
            raise TypeError(f"DenoiserConfig: channels must be a sequence of >= 2 positive ints (in, hidden..., "
                            f"out), got {type(self.channels).__name__} {self.channels!r}")
        chans = tuple(self.channels)
        if len(chans) < 2 or any(_not_int(c) or c < 1 for c in chans):
            raise ValueError(f"DenoiserConfig: channels must be >= 2 positive ints (in, hidden..., out), "
                             f"got {self.channels!r}")
        if _not_int(self.kernel_size) or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"DenoiserConfig: kernel_size must be a positive odd int, got {self.kernel_size!r}")
        if not isinstance(self.residual, (bool, np.bool_)):
            raise TypeError(f"DenoiserConfig: residual must be True or False, got {self.residual!r}")
        if self.residual and chans[0] != chans[-1]:
            raise ValueError(f"DenoiserConfig: residual=True needs channels[0] == channels[-1], got {chans}")
        object.__setattr__(self, "channels", chans)


def _not_int(v: Any) -> bool:
    return isinstance(v, bool) or not isinstance(v, (int, np.integer))


def init(key: jax.Array, cfg: DenoiserConfig = DenoiserConfig(), dtype: Any = jnp.float32) -> Params:
    """PyTorch ``Conv2d`` default initialisation: ``w, b ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))``.

    ``cfg`` is a :class:`DenoiserConfig` (e.g. ``DenoiserConfig(channels=(1, 32, 32, 1))``)."""
    check_key(key, "denoiser.init")
    if not isinstance(cfg, DenoiserConfig):
        raise TypeError(f"denoiser.init: 'cfg' must be a DenoiserConfig, got {type(cfg).__name__} {cfg!r}"
                        + (f"; e.g. DenoiserConfig(channels={tuple(cfg)!r})" if isinstance(cfg, (tuple, list))
                           else ""))
    check_float_dtype(dtype, "denoiser.init")
    k = cfg.kernel_size
    params = []
    for key_l, (cin, cout) in zip(jax.random.split(key, len(cfg.channels) - 1),
                                  zip(cfg.channels[:-1], cfg.channels[1:])):
        bound = 1.0 / np.sqrt(cin * k * k)
        kw, kb = jax.random.split(key_l)
        params.append({"w": jax.random.uniform(kw, (k, k, cin, cout), dtype, -bound, bound),
                       "b": jax.random.uniform(kb, (cout,), dtype, -bound, bound)})
    return params


def check_params(params: Any) -> None:
    """Params must be a non-empty list of ``{"w": [k, k, Cin, Cout], "b": [Cout]}`` whose widths chain."""
    if not isinstance(params, (list, tuple)) or not params:
        raise ValueError("denoiser params must be a non-empty list of {'w', 'b'} dicts (see denoiser.init)")
    for i, layer in enumerate(params):
        if not isinstance(layer, dict) or "w" not in layer:
            raise ValueError(f"denoiser params[{i}] must be a dict with 'w' (HWIO) and optional 'b'")
        w = layer["w"]
        if getattr(w, "ndim", None) != 4:
            raise ValueError(f"denoiser params[{i}]['w'] must be [kh, kw, Cin, Cout] (HWIO), got shape "
                             f"{tuple(getattr(w, 'shape', ()))}")
        if w.shape[0] != w.shape[1] or w.shape[0] % 2 == 0:
            hint = (" (it looks like PyTorch's OIHW [Cout, Cin, k, k]: convert it with "
                    "jaxgrad.cnn.layout.torch_weight_to_hwio or layout.from_torch_state_dict)"
                    if w.shape[2] == w.shape[3] and w.shape[2] % 2 else "")
            raise ValueError(f"denoiser params[{i}]['w'] {tuple(w.shape)} has a {w.shape[0]}x{w.shape[1]} kernel; "
                             f"the denoiser's kernels are square and odd, HWIO [k, k, Cin, Cout]{hint}")
        if i and w.shape[2] != params[i - 1]["w"].shape[3]:
            raise ValueError(f"denoiser params[{i}]['w'] expects Cin={w.shape[2]} but layer {i - 1} outputs "
                             f"{params[i - 1]['w'].shape[3]} channels")


def config_of(params: Params, residual: bool = False) -> DenoiserConfig:
    """The :class:`DenoiserConfig` that ``params`` were built for."""
    check_params(params)
    chans = (params[0]["w"].shape[2], *(layer["w"].shape[3] for layer in params))
    return DenoiserConfig(chans, params[0]["w"].shape[0], residual)


def apply(params: Params, x: jax.Array, *, residual: bool = False, backend: str = "xla",
          precision: Any = None) -> jax.Array:
    """Denoise ``x[N, H, W, C_in]`` (NHWC; PyTorch's NCHW via :func:`jaxgrad.cnn.layout.nchw_to_nhwc`)."""
    check_params(params)
    cin = params[0]["w"].shape[2]
    if getattr(x, "ndim", None) != 4 or x.shape[-1] != cin:
        raise ValueError(f"denoiser: x must be [N, H, W, {cin}] (NHWC, {cin} channel(s)), got shape "
                         f"{tuple(getattr(x, 'shape', ()))}" +
                         (" -- looks like NCHW; use jaxgrad.cnn.layout.nchw_to_nhwc" if
                          getattr(x, "ndim", None) == 4 and x.shape[1] == cin else ""))
    h = x
    for i, layer in enumerate(params):
        last = i == len(params) - 1
        h = conv2d(h, layer["w"], layer.get("b"), padding="SAME", activation=None if last else "relu",
                   precision=precision, backend=backend)
    return x + h if residual else h


def apply_lax(params: Params, x: jax.Array, *, precision: Any = None) -> jax.Array:
    """The same network as plain ``lax.conv_general_dilated`` + bias + ReLU, no custom VJP: what a JAX user would
    write, differentiated by JAX's own transpose rules (the benchmark's baseline, the precision study's oracle)."""
    h = x
    for i, layer in enumerate(params):
        h = jax.lax.conv_general_dilated(h, layer["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                         precision=precision) + layer["b"]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return h


def mse_loss(params: Params, x: jax.Array, target: jax.Array, *, residual: bool = False, backend: str = "xla",
             precision: Any = None) -> jax.Array:
    """Mean squared error of the denoised ``x`` against ``target`` (same shape)."""
    if getattr(target, "shape", None) != getattr(x, "shape", None):
        raise ValueError(f"denoiser: target must have x's shape {tuple(x.shape)}, got "
                         f"{tuple(getattr(target, 'shape', ()))}")
    y = apply(params, x, residual=residual, backend=backend, precision=precision)
    acc = jnp.promote_types(y.dtype, jnp.float32)  # bf16 activations: f32 loss; f64 stays f64
    return jnp.mean(jnp.square(y.astype(acc) - target.astype(acc)))


def make_train_step(optimizer: optax.GradientTransformation, *, residual: bool = False, backend: str = "xla",
                    precision: Any = None) -> Callable:
    """``step(params, opt_state, x, target) -> (params, opt_state, loss)``, jitted, donating params/state."""

    def step(params, opt_state, x, target):
        loss, grads = jax.value_and_grad(mse_loss)(params, x, target, residual=residual, backend=backend,
                                                   precision=precision)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def check_batch(x: Any, name: str = "x") -> np.ndarray:
    """Host-side guard before a batch goes to the device: finite float pixels, NHWC rank 4."""
    arr = np.asarray(x)
    if arr.ndim != 4:
        raise ValueError(f"{name} must be a [N, H, W, C] batch, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{name} must be floating point, got {arr.dtype}")
    bad = ~np.isfinite(arr)
    if bad.any():
        n = int(np.argwhere(bad)[0][0])
        raise ValueError(f"{name} has {int(bad.sum())} non-finite pixel(s) (first in image {n} of the batch)")
    return arr


def train(params: Params, batches: Iterable[tuple[Any, Any]], optimizer: optax.GradientTransformation, *,
          opt_state: Any = None, residual: bool = False, backend: str = "xla", precision: Any = None,
          callback: Callable[[int, float], None] | None = None) -> tuple[Params, Any, list[float]]:
    """Run one optax step per ``(x, target)`` batch; returns ``(params, opt_state, losses)``.

    The minimal loop; ``jaxgrad train cnn`` (:mod:`jaxgrad.cnn.task`) adds streaming data, progress, checkpoints
    and images.
    """
    step = make_train_step(optimizer, residual=residual, backend=backend, precision=precision)
    params = jax.tree.map(jnp.array, params)  # own copies: the step donates its inputs
    opt_state = optimizer.init(params) if opt_state is None else opt_state
    losses = []
    for i, (x, target) in enumerate(batches):
        x, target = check_batch(x, "x"), check_batch(target, "target")
        params, opt_state, loss = step(params, opt_state, jnp.asarray(x), jnp.asarray(target))
        losses.append(float(loss))
        if callback is not None:
            callback(i, losses[-1])
    return params, opt_state, losses


def parameter_count(params: Params) -> int:
    return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(params)))


def layer_names(params: Sequence[dict]) -> list[str]:
    """``conv1 (1->16)``, ... for reports."""
    return [f"conv{i + 1} ({layer['w'].shape[2]}->{layer['w'].shape[3]})" for i, layer in enumerate(params)]
