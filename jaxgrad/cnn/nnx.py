"""Thin ``flax.nnx`` wrapper over the functional denoiser (:mod:`jaxgrad.cnn.denoiser`).

The module only *holds* the arrays (one ``nnx.Param`` per weight and bias); ``__call__`` is
:func:`jaxgrad.cnn.denoiser.apply`, i.e. :func:`jaxgrad.cnn.conv.conv2d` with its hand-written VJP.
:meth:`Denoiser.to_params` / :meth:`Denoiser.from_params` convert to and from the plain pytree, so
``nnx.Optimizer`` users and functional users train the same network.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrad.cnn import denoiser

__all__ = ["Denoiser"]


class Denoiser(nnx.Module):
    """The cryo-EM denoiser (default ``1 -> 16 -> 16 -> 1``, 3x3, ReLU) as an ``nnx.Module``.

    Args:
      cfg: :class:`~jaxgrad.cnn.denoiser.DenoiserConfig`.
      rngs: ``nnx.Rngs``; one ``rngs.params()`` key initialises all layers (:func:`denoiser.init`).
      backend, precision: passed to :func:`jaxgrad.cnn.conv.conv2d` on every call.
    """

    def __init__(self, cfg: denoiser.DenoiserConfig = denoiser.DenoiserConfig(), *, rngs: nnx.Rngs | None = None,
                 dtype: Any = jnp.float32, backend: str = "xla", precision: Any = None,
                 params: denoiser.Params | None = None):
        if params is None:
            if rngs is None:
                raise TypeError("Denoiser: pass 'rngs' (nnx.Rngs) to initialise, or use Denoiser.from_params")
            params = denoiser.init(rngs.params(), cfg, dtype)
        else:
            denoiser.check_params(params)
            if denoiser.config_of(params, cfg.residual) != cfg:
                raise ValueError(f"Denoiser: params are for {denoiser.config_of(params, cfg.residual)}, not {cfg}")
        self.cfg, self.backend, self.precision = cfg, backend, precision
        self.weights = nnx.List([nnx.Param(layer["w"]) for layer in params])
        self.biases = nnx.List([nnx.Param(layer["b"]) if layer.get("b") is not None else None for layer in params])

    @classmethod
    def from_params(cls, params: denoiser.Params, *, residual: bool = False, backend: str = "xla",
                    precision: Any = None) -> Denoiser:
        """Wrap a params list of :func:`denoiser.init` (arrays shared, not copied)."""
        return cls(denoiser.config_of(params, residual), params=params, backend=backend, precision=precision)

    def to_params(self) -> denoiser.Params:
        return [{"w": w[...], "b": None if b is None else b[...]} for w, b in zip(self.weights, self.biases)]

    def __call__(self, x: jax.Array) -> jax.Array:
        return denoiser.apply(self.to_params(), x, residual=self.cfg.residual, backend=self.backend,
                              precision=self.precision)
