r"""KAN layer (efficient-kan formulation): parameters, initialisation and the plain-JAX reference.

.. math::

    y = \operatorname{silu}(x)\, W_b^\top + \Phi(x)\, C^\top \;(+\, b), \qquad
    C[o, i, m] = \text{spline\_weight}[o, i, m]\; \text{spline\_scaler}[o, i]

with :math:`\Phi(x)[b, (i, m)] = B_m(x_{bi})` the ``G + k`` B-spline bases of input ``i``
(:mod:`jaxgrad.kan.spline`). Parameters are a plain dict with efficient-kan's names and layouts, so a PyTorch
``state_dict`` converts with ``np.asarray`` alone:

=================  ===================  ====================================
``base_weight``    ``[out, in]``        trained
``spline_weight``  ``[out, in, G+k]``   trained
``spline_scaler``  ``[out, in]``        trained
``grid``           ``[in, G+2k+1]``     not trained: ``stop_gradient``; changed only by grid updates
``bias``           ``[out]``            optional (jaxKAN has one, efficient-kan does not)
=================  ===================  ====================================

``spline_order`` is never stored: it follows from the shapes (``grid`` has ``G + 2k + 1`` knots per row,
``spline_weight`` has ``G + k`` bases).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxgrad.kan.spline import bspline_basis, curve_to_coefficients, make_grid, spline_order_of

__all__ = ["KANConfig", "check_params", "init", "kan_linear_reference", "spline_order", "trainable_mask"]


@dataclasses.dataclass(frozen=True)
class KANConfig:
    """Hyper-parameters of one KAN layer (names and defaults of efficient-kan's ``KANLinear``)."""

    in_features: int
    out_features: int
    grid_size: int = 5
    spline_order: int = 3
    grid_range: tuple[float, float] = (-1.0, 1.0)
    scale_noise: float = 0.1
    scale_base: float = 1.0
    scale_spline: float = 1.0
    grid_eps: float = 0.02
    bias: bool = False

    def __post_init__(self):
        for name in ("in_features", "out_features"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"KANConfig: {name} must be >= 1, got {getattr(self, name)}")
        if int(self.grid_size) < 1:
            raise ValueError(f"KANConfig: grid_size must be >= 1, got {self.grid_size}")
        if not 1 <= int(self.spline_order) <= 5:
            raise ValueError(f"KANConfig: spline_order must be in 1..5, got {self.spline_order}")
        lo, hi = self.grid_range
        if not float(lo) < float(hi):
            raise ValueError(f"KANConfig: grid_range must satisfy lo < hi, got {tuple(self.grid_range)}")
        if not 0.0 <= float(self.grid_eps) <= 1.0:
            raise ValueError(f"KANConfig: grid_eps must be in [0, 1], got {self.grid_eps}")


def _kaiming_uniform(key, shape, fan_in, a, dtype):
    # torch.nn.init.kaiming_uniform_(w, a): bound = gain * sqrt(3 / fan_in), gain = sqrt(2 / (1 + a^2))
    bound = math.sqrt(2.0 / (1.0 + a * a)) * math.sqrt(3.0 / fan_in)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def init(key: jax.Array, cfg: KANConfig, dtype=jnp.float32) -> dict[str, jax.Array]:
    """efficient-kan's initialisation: Kaiming-uniform base weight and scaler, spline weights fitted to small noise."""
    k_base, k_noise, k_scaler = jax.random.split(key, 3)
    G, k = cfg.grid_size, cfg.spline_order
    grid = make_grid(cfg.in_features, G, k, cfg.grid_range, dtype)
    # noise curves sampled at the G+1 interior knots, fitted by least squares (efficient-kan's curve2coeff)
    noise = (jax.random.uniform(k_noise, (G + 1, cfg.in_features, cfg.out_features), dtype) - 0.5) \
        * cfg.scale_noise / G
    samples = grid.T[k:-k]  # [G+1, in]
    params = {
        "base_weight": _kaiming_uniform(k_base, (cfg.out_features, cfg.in_features), cfg.in_features,
                                        math.sqrt(5) * cfg.scale_base, dtype),
        "spline_weight": curve_to_coefficients(samples, noise, grid, k).astype(dtype),
        "spline_scaler": _kaiming_uniform(k_scaler, (cfg.out_features, cfg.in_features), cfg.in_features,
                                          math.sqrt(5) * cfg.scale_spline, dtype),
        "grid": grid,
    }
    if cfg.bias:
        params["bias"] = jnp.zeros((cfg.out_features,), dtype)
    return params


def spline_order(params: dict[str, jax.Array]) -> int:
    """The degree ``k`` implied by the shapes of ``grid`` and ``spline_weight``."""
    return spline_order_of(params["grid"], params["spline_weight"].shape[-1])


def check_params(params: dict[str, jax.Array], x: jax.Array | None = None) -> int:
    """Validate shapes/dtypes (and ``x`` against them); return ``spline_order``. Errors name the argument."""
    for name in ("base_weight", "spline_weight", "spline_scaler", "grid"):
        if name not in params:
            raise KeyError(f"KAN params: missing '{name}' (have {sorted(params)})")
    out_f, in_f = params["base_weight"].shape
    nb = params["spline_weight"].shape[-1]
    expect = {"spline_weight": (out_f, in_f, nb), "spline_scaler": (out_f, in_f)}
    for name, shape in expect.items():
        if params[name].shape != shape:
            raise ValueError(f"KAN params: '{name}' must have shape {shape} (from base_weight {out_f}x{in_f}), got "
                             f"{params[name].shape}")
    if params["grid"].ndim != 2 or params["grid"].shape[0] != in_f:
        raise ValueError(f"KAN params: 'grid' must have shape [{in_f}, G+2k+1], got {params['grid'].shape}")
    if "bias" in params and params["bias"].shape != (out_f,):
        raise ValueError(f"KAN params: 'bias' must have shape ({out_f},), got {params['bias'].shape}")
    k = spline_order(params)
    if x is not None:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"KAN layer: input 'x' must be floating point, got {x.dtype}")
        if x.ndim < 1 or x.shape[-1] != in_f:
            raise ValueError(f"KAN layer: input 'x' must have shape [..., {in_f}] (in_features), got {x.shape}")
    return k


def trainable_mask(params: dict[str, jax.Array]) -> dict[str, bool]:
    """``True`` for trained leaves, ``False`` for ``grid`` -- for ``optax.masked`` (e.g. keep AdamW's decay off it)."""
    return {name: name != "grid" for name in params}


def kan_linear_reference(params: dict[str, jax.Array], x: jax.Array, precision=None) -> jax.Array:
    """Plain-JAX KAN layer, ``x[..., in] -> [..., out]``; ``jax.grad`` of this is the oracle of the custom VJP."""
    k = check_params(params, x)
    out_f, in_f = params["base_weight"].shape
    grid = jax.lax.stop_gradient(params["grid"])
    base = jnp.matmul(jax.nn.silu(x), params["base_weight"].T, precision=precision)
    phi = bspline_basis(x, grid, k)  # [..., in, G+k]
    coef = params["spline_weight"] * params["spline_scaler"][..., None]  # [out, in, G+k]
    spline = jnp.matmul(phi.reshape(*x.shape[:-1], -1), coef.reshape(out_f, -1).T, precision=precision)
    y = base + spline
    if "bias" in params:
        y = y + params["bias"]
    return y
