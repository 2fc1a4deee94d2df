"""Thin ``flax.nnx`` wrappers: :class:`KANLinear` and :class:`KAN` over the functional layer.

The modules only *hold* the arrays; the math is :func:`jaxgrad.kan.layer.kan_linear` (hand-written VJP), so the
functional API (:func:`~jaxgrad.kan.network.kan_init` / :func:`~jaxgrad.kan.network.kan_apply`) stays the primary
way in and the two are interchangeable: :meth:`KANLinear.to_params` / :meth:`KAN.to_params` export the plain
dicts, :meth:`KANLinear.from_params` / :meth:`KAN.from_params` wrap existing ones.

Trained arrays (``base_weight``, ``spline_weight``, ``spline_scaler``, optional ``bias``) are ``nnx.Param``. The knot
``grid`` is a :class:`KANGrid` variable -- not an ``nnx.Param``, so ``nnx.grad`` and
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` leave it alone (grid updates replace it explicitly).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrad.kan.layer import KANConfig, check_params, kan_linear
from jaxgrad.kan.network import _init_jit, kan_widths

__all__ = ["KAN", "KANGrid", "KANLinear"]

_PARAM_NAMES = ("base_weight", "spline_weight", "spline_scaler", "bias")


class KANGrid(nnx.Variable):
    """Knot grid ``[in, G+2k+1]`` of a KAN layer: module state that is not trained."""


class KANLinear(nnx.Module):
    """efficient-kan's ``KANLinear`` as an ``nnx.Module``; ``__call__`` is :func:`~jaxgrad.kan.layer.kan_linear`.

    Args:
      in_features, out_features: layer widths.
      rngs: ``nnx.Rngs``; one ``rngs.params()`` key initialises the layer (:func:`jaxgrad.kan.layer.init`).
      grid_size, spline_order, grid_range, scale_noise, scale_base, scale_spline, grid_eps, bias: as in
        :class:`~jaxgrad.kan.layer.KANConfig`.
      dtype: parameter dtype.
      backend, precision, interpret: passed to :func:`~jaxgrad.kan.layer.kan_linear` on every call.
    """

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs | None = None, grid_size: int = 5,
                 spline_order: int = 3, grid_range: tuple[float, float] = (-1.0, 1.0), scale_noise: float = 0.1,
                 scale_base: float = 1.0, scale_spline: float = 1.0, grid_eps: float = 0.02, bias: bool = False,
                 dtype=jnp.float32, backend: str = "xla", precision=None, interpret: bool | None = None,
                 params: Mapping[str, jax.Array] | None = None):
        params_given = params is not None
        if params is None:
            if rngs is None:
                raise TypeError("KANLinear: pass 'rngs' (nnx.Rngs) to initialise, or use KANLinear.from_params")
            cfg = KANConfig(in_features, out_features, grid_size=grid_size, spline_order=spline_order,
                            grid_range=tuple(grid_range), scale_noise=scale_noise, scale_base=scale_base,
                            scale_spline=scale_spline, grid_eps=grid_eps, bias=bias)
            params = _init_jit(rngs.params(), cfg, dtype)  # jitted layer.init
        else:
            check_params(params)
            if params["base_weight"].shape != (out_features, in_features):
                raise ValueError(f"KANLinear: params are for {params['base_weight'].shape[1]} -> "
                                 f"{params['base_weight'].shape[0]} features, not {in_features} -> {out_features}")
        if backend not in ("xla", "pallas", "reference"):
            raise ValueError(f"KANLinear: backend must be 'xla', 'pallas' or 'reference', got {backend!r}")
        self.in_features, self.out_features = in_features, out_features
        self.backend, self.precision, self.interpret = backend, precision, interpret
        # the declared order, checked against the grid on every call (a grid missing a knot would otherwise read as a
        # valid layer of order k - 1); None when wrapping given params, whose order follows from their shapes
        self.spline_order = int(spline_order) if params_given is False else None
        self.base_weight = nnx.Param(params["base_weight"])
        self.spline_weight = nnx.Param(params["spline_weight"])
        self.spline_scaler = nnx.Param(params["spline_scaler"])
        self.bias = nnx.Param(params["bias"]) if "bias" in params else None
        self.grid = KANGrid(params["grid"])

    @classmethod
    def from_params(cls, params: Mapping[str, jax.Array], *, backend: str = "xla", precision=None,
                    interpret: bool | None = None) -> KANLinear:
        """Wrap a layer dict of :func:`jaxgrad.kan.layer.init` (arrays are shared, not copied)."""
        check_params(params)
        out_f, in_f = params["base_weight"].shape
        return cls(in_f, out_f, params=params, backend=backend, precision=precision, interpret=interpret)

    def to_params(self) -> dict[str, jax.Array]:
        """The layer dict for the functional API (:func:`~jaxgrad.kan.layer.kan_linear`)."""
        out = {name: getattr(self, name)[...] for name in _PARAM_NAMES if getattr(self, name) is not None}
        out["grid"] = self.grid[...]
        return out

    def __call__(self, x: jax.Array) -> jax.Array:
        return kan_linear(self.to_params(), x, backend=self.backend, precision=self.precision,
                          interpret=self.interpret, spline_order=self.spline_order)


class KAN(nnx.Module):
    """``KAN([in, h_1, ..., out])``: a stack of :class:`KANLinear` sharing one configuration.

    Args:
      widths: ``[in, h_1, ..., out]``.
      rngs: ``nnx.Rngs`` (one ``params`` key per layer).
      **layer_kwargs: keyword arguments of :class:`KANLinear` (``grid_size``, ``spline_order``, ``bias``,
        ``backend``, ...).
    """

    def __init__(self, widths: Sequence[int], *, rngs: nnx.Rngs | None = None,
                 layers: Sequence[KANLinear] | None = None, **layer_kwargs):
        if layers is None:
            widths = list(widths)
            if len(widths) < 2:
                raise ValueError(f"KAN: 'widths' needs at least [in, out], got {widths}")
            layers = [KANLinear(a, b, rngs=rngs, **layer_kwargs) for a, b in zip(widths[:-1], widths[1:])]
        self.widths = list(widths)
        self.layers = nnx.List(layers)

    @classmethod
    def from_params(cls, params: Sequence[Mapping[str, jax.Array]], **call_kwargs) -> KAN:
        """Wrap the list of layer dicts of :func:`~jaxgrad.kan.network.kan_init`."""
        widths = kan_widths(params)
        return cls(widths, layers=[KANLinear.from_params(p, **call_kwargs) for p in params])

    def to_params(self) -> list[dict[str, jax.Array]]:
        """The list of layer dicts for :func:`~jaxgrad.kan.network.kan_apply`."""
        return [layer.to_params() for layer in self.layers]

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x
