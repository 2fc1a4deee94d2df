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
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.checks import check_float_dtype, check_key, check_precision
from jaxgrad.kan import dcoef_wide_mgpu, dx_mgpu, forward_mgpu, fp16_scaled
from jaxgrad.kan.spline import (bspline_basis, bspline_basis_and_derivative, bspline_basis_elementwise,
                                curve_to_coefficients, make_grid, spline_order_of)

__all__ = ["DEFAULT_SCALE_NOISE", "INITS", "KANConfig", "check_params", "init", "kan_linear", "kan_linear_reference",
           "spline_order", "trainable_mask"]


INITS = ("efficient_kan", "pykan")
#: ``scale_noise`` when it is not given: efficient-kan's ``KANLinear`` default and pykan's ``MultKAN`` default
DEFAULT_SCALE_NOISE = {"efficient_kan": 0.1, "pykan": 0.3}


@dataclasses.dataclass(frozen=True)
class KANConfig:
    """Hyper-parameters of one KAN layer (names and defaults of efficient-kan's ``KANLinear``).

    ``init`` picks the initial ``base_weight`` and ``spline_scaler`` (:func:`init`): ``"efficient_kan"`` (the
    default, so converted efficient-kan layers and existing seeds keep their values) or ``"pykan"`` (pykan's
    ``KANLayer``). ``scale_noise`` ``None`` is that init's default (:data:`DEFAULT_SCALE_NOISE`).
    """

    in_features: int
    out_features: int
    grid_size: int = 5
    spline_order: int = 3
    grid_range: tuple[float, float] = (-1.0, 1.0)
    scale_noise: float | None = None
    scale_base: float = 1.0
    scale_spline: float = 1.0
    grid_eps: float = 0.02
    bias: bool = False
    init: str = "efficient_kan"

    def __post_init__(self):
        if self.init not in INITS:
            raise ValueError(f"KANConfig: init must be one of {INITS}, got {self.init!r}")
        if self.scale_noise is None:
            object.__setattr__(self, "scale_noise", DEFAULT_SCALE_NOISE[self.init])
        for name in ("in_features", "out_features", "grid_size", "spline_order"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"KANConfig: {name} must be an int, got {type(value).__name__} {value!r}")
        for name in ("in_features", "out_features"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"KANConfig: {name} must be >= 1, got {getattr(self, name)}")
        if int(self.grid_size) < 1:
            raise ValueError(f"KANConfig: grid_size must be >= 1, got {self.grid_size}")
        if not 1 <= int(self.spline_order) <= 5:
            raise ValueError(f"KANConfig: spline_order must be in 1..5, got {self.spline_order}")
        gr = self.grid_range
        if (isinstance(gr, (str, bytes)) or not hasattr(gr, "__len__") or len(gr) != 2
                or not all(_is_real(v) for v in gr)):
            raise ValueError(f"KANConfig: grid_range must be a pair of numbers (lo, hi), got {gr!r}")
        lo, hi = (float(v) for v in gr)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"KANConfig: grid_range must satisfy lo < hi (finite), got {tuple(gr)}")
        object.__setattr__(self, "grid_range", (lo, hi))  # a tuple: the config is a static (hashed) jit argument
        for name in ("scale_noise", "scale_base", "scale_spline", "grid_eps"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(float(value)):
                raise ValueError(f"KANConfig: {name} must be a finite number, got {value!r}")
        if not 0.0 <= float(self.grid_eps) <= 1.0:
            raise ValueError(f"KANConfig: grid_eps must be in [0, 1], got {self.grid_eps}")
        if not isinstance(self.bias, (bool, np.bool_)):
            raise TypeError(f"KANConfig: bias must be True or False, got {self.bias!r}")


def _is_real(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def _kaiming_uniform(key, shape, fan_in, a, dtype):
    # torch.nn.init.kaiming_uniform_(w, a): bound = gain * sqrt(3 / fan_in), gain = sqrt(2 / (1 + a^2))
    bound = math.sqrt(2.0 / (1.0 + a * a)) * math.sqrt(3.0 / fan_in)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def init(key: jax.Array, cfg: KANConfig, dtype=jnp.float32) -> dict[str, jax.Array]:
    r"""Initial layer parameters: spline weights fitted to small noise, then ``cfg.init``'s scales.

    Both inits fit ``spline_weight`` by least squares to noise :math:`(U(0, 1) - \tfrac12)\,
    \text{scale\_noise} / G` sampled at the ``G + 1`` grid points (efficient-kan's ``curve2coeff``, pykan's
    ``curve2coef``). With :math:`n = ` ``in_features``:

    * ``"efficient_kan"``: ``base_weight`` and ``spline_scaler`` Kaiming-uniform,
      :math:`U(\pm \text{scale} \cdot \sqrt{3 / n} \cdot \sqrt{2 / (1 + 5\,\text{scale}^2)})` (torch's
      ``kaiming_uniform_(w, a=sqrt(5) * scale)``);
    * ``"pykan"``: ``base_weight`` :math:`= \text{scale\_base}\, U(-1, 1) / \sqrt{n}` (pykan's
      ``scale_base_mu = 0``, ``scale_base_sigma = scale_base``), ``spline_scaler`` :math:`=
      \text{scale\_spline} / \sqrt{n}` for every edge (pykan's ``scale_sp``).

    ``cfg`` is a :class:`KANConfig` (``init(key, KANConfig(4, 3))``); for a network of widths ``[4, 3]`` use
    :func:`jaxgrad.kan.kan_init`. ``dtype`` must be a floating dtype.
    """
    if not isinstance(cfg, KANConfig):
        hint = ""
        if isinstance(cfg, (int, np.integer)) and not isinstance(cfg, bool):
            hint = (f"; for one layer of {cfg} -> {dtype!r} features write init(key, KANConfig({cfg}, {dtype!r})), "
                    f"for a network kan_init(key, [{cfg}, {dtype!r}])" if isinstance(dtype, (int, np.integer))
                    else f"; e.g. init(key, KANConfig(in_features={cfg}, out_features=...))")
        elif isinstance(cfg, (list, tuple)) and all(isinstance(w, (int, np.integer)) for w in cfg):
            hint = f"; for a network of widths {list(cfg)} write kan_init(key, {list(cfg)})"
        raise TypeError(f"KAN init: 'cfg' must be a KANConfig, got {type(cfg).__name__} {cfg!r}{hint}")
    check_key(key, "KAN init")
    check_float_dtype(dtype, "KAN init")
    k_base, k_noise, k_scaler = jax.random.split(key, 3)
    G, k = cfg.grid_size, cfg.spline_order
    grid = make_grid(cfg.in_features, G, k, cfg.grid_range, dtype)
    # noise curves sampled at the G+1 interior knots, fitted by least squares (efficient-kan's curve2coeff)
    noise = (jax.random.uniform(k_noise, (G + 1, cfg.in_features, cfg.out_features), dtype) - 0.5) \
        * cfg.scale_noise / G
    samples = grid.T[k:-k]  # [G+1, in]
    shape = (cfg.out_features, cfg.in_features)
    if cfg.init == "pykan":
        root = math.sqrt(cfg.in_features)
        base = jax.random.uniform(k_base, shape, dtype, -1.0, 1.0) * (cfg.scale_base / root)
        scaler = jnp.full(shape, cfg.scale_spline / root, dtype)
    else:
        base = _kaiming_uniform(k_base, shape, cfg.in_features, math.sqrt(5) * cfg.scale_base, dtype)
        scaler = _kaiming_uniform(k_scaler, shape, cfg.in_features, math.sqrt(5) * cfg.scale_spline, dtype)
    params = {
        "base_weight": base,
        "spline_weight": curve_to_coefficients(samples, noise, grid, k).astype(dtype),
        "spline_scaler": scaler,
        "grid": grid,
    }
    if cfg.bias:
        params["bias"] = jnp.zeros((cfg.out_features,), dtype)
    return params


def spline_order(params: dict[str, jax.Array]) -> int:
    """The degree ``k`` implied by the shapes of ``grid`` and ``spline_weight``."""
    return spline_order_of(params["grid"], params["spline_weight"].shape[-1])


def _check_grid_values(grid) -> None:
    """Every knot row non-decreasing (coincident knots are allowed: a grid update with ``grid_eps=0`` and repeated
    samples makes them, and a zero-width interval contributes zero) and not constant. Only where the values are
    concrete: under ``jit`` / ``grad`` the grid is a tracer and this is skipped."""
    if isinstance(grid, jax.core.Tracer):
        return
    t = np.asarray(grid)
    falls = ~(np.diff(t, axis=-1) >= 0)  # NaN counts as a fall
    if falls.any():
        row, j = (int(v) for v in np.argwhere(falls)[0])
        raise ValueError(f"KAN params: 'grid' must be non-decreasing along the knot axis (one row of G+2k+1 knots "
                         f"per input); row {row} goes from {t[row, j]:.6g} to {t[row, j + 1]:.6g} at knots {j}->{j + 1}")
    flat = ~(t[:, -1] > t[:, 0])
    if flat.any():
        row = int(np.argmax(flat))
        raise ValueError(f"KAN params: 'grid' row {row} has all its knots equal ({t[row, 0]:.6g}); every row must span "
                         f"an interval")


def check_params(params: dict[str, jax.Array], x: jax.Array | None = None, *, spline_order: int | None = None) -> int:
    """Validate shapes/dtypes (and ``x`` against them), and the knot values where they are concrete (not under
    ``jit``); return ``spline_order``. Errors name the argument.

    ``spline_order``: the order the caller declared (e.g. ``KANConfig.spline_order``). The params do not store it
    (it is read from the shapes: ``grid`` has ``G + 2k + 1`` knots per row, ``spline_weight`` has ``G + k`` bases),
    so a grid row missing a knot reads as a valid layer of order ``k - 1`` on ``G + 1`` intervals; only a declared
    order can tell the two apart.
    """
    for name in ("base_weight", "spline_weight", "spline_scaler", "grid"):
        if name not in params:
            raise KeyError(f"KAN params: missing '{name}' (have {sorted(params)})")
    if len(getattr(params["base_weight"], "shape", ())) != 2:
        raise ValueError(f"KAN params: 'base_weight' must have shape [out, in], got "
                         f"{tuple(getattr(params['base_weight'], 'shape', ()))}")
    if len(getattr(params["spline_weight"], "shape", ())) != 3:
        raise ValueError(f"KAN params: 'spline_weight' must have shape [out, in, G+k], got "
                         f"{tuple(getattr(params['spline_weight'], 'shape', ()))}")
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
    if spline_order is not None:
        _check_declared_order(params, spline_order)
    k = spline_order_of(params["grid"], nb)
    _check_grid_values(params["grid"])
    if x is not None:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"KAN layer: input 'x' must be floating point, got {x.dtype}")
        if x.ndim < 1 or x.shape[-1] != in_f:
            raise ValueError(f"KAN layer: input 'x' must have shape [..., {in_f}] (in_features), got {x.shape}")
    return k


def _check_declared_order(params, k) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= 5:
        raise ValueError(f"KAN layer: 'spline_order' must be an int in 1..5, got {k!r}")
    nb, knots = params["spline_weight"].shape[-1], params["grid"].shape[-1]
    G = nb - k
    if G < 1:
        raise ValueError(f"KAN layer: 'spline_order'={k} needs spline_weight to have G+k >= {k + 1} bases per edge, "
                         f"it has {nb}")
    if knots != G + 2 * k + 1:
        raise ValueError(f"KAN params: 'grid' has {knots} knots per row, but spline_order={k} with spline_weight's "
                         f"{nb} bases (G = {nb} - {k} = {G}) needs G+2k+1 = {G + 2 * k + 1}; a knot is missing or "
                         f"extra (the shapes alone would read it as spline order {knots - nb - 1})")


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


# ---------------------------------------------------------------------------------------------------------------
# The layer with a hand-written VJP
# ---------------------------------------------------------------------------------------------------------------
_TRAINABLE = ("base_weight", "spline_weight", "spline_scaler", "bias")
_BACKENDS = ("xla", "pallas", "mosaic", "reference")


def _compute_dtype(*dtypes) -> jnp.dtype:
    """Arithmetic dtype: ``promote_types(dtype, float32)`` -- f32 for bf16/f16/f32, f64 for f64 (the verifier)."""
    return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)


def _silu_and_slope(x):
    r""":math:`\operatorname{silu}(x) = x\sigma(x)` and
    :math:`\operatorname{silu}'(x) = \sigma(x)(1 + x(1-\sigma(x)))`."""
    s = jax.nn.sigmoid(x)
    return x * s, s * (1 + x * (1 - s))


def _coef(p):
    """``C[o, i, m] = spline_weight[o, i, m] * spline_scaler[o, i]``."""
    return p["spline_weight"] * p["spline_scaler"][..., None]


def _is_fp16_scaled(precision) -> bool:
    return isinstance(precision, str) and precision == fp16_scaled.FP16_SCALED


def _check_precision(precision, backend, params, x) -> None:
    """``precision``: a ``lax`` precision, or ``"fp16_scaled"`` on the XLA backend with float32 arrays (float64: the
    verifier's re-run, the same products without the float16 rounding)."""
    if backend == "mosaic":
        if precision is not None and not _is_fp16_scaled(precision):
            raise ValueError(f"kan_linear: backend='mosaic' computes every product from float16 operands scaled by "
                             f"powers of two (precision='{fp16_scaled.FP16_SCALED}'); 'precision' must be None or "
                             f"'{fp16_scaled.FP16_SCALED}', got {precision!r}")
        return
    if not _is_fp16_scaled(precision):
        try:
            check_precision(precision, "kan_linear")
        except ValueError:
            raise ValueError(f"kan_linear: 'precision' must be None, a jax.lax.Precision or one of its names "
                             f"('default', 'high', 'highest', 'tensorfloat32', ...), a pair of them, a "
                             f"jax.lax.DotAlgorithmPreset, or '{fp16_scaled.FP16_SCALED}' (float16 operands scaled "
                             f"by powers of two, float32 sums), got {precision!r}") from None
        return
    if backend != "xla":
        raise ValueError(f"kan_linear: precision='{fp16_scaled.FP16_SCALED}' is implemented by backend='xla' (the "
                         f"custom VJP in jnp) only, got backend={backend!r}")
    dtypes = {"x": jnp.dtype(x.dtype), **{f"params['{n}']": jnp.dtype(jnp.result_type(params[n]))
                                           for n in _TRAINABLE if n in params}}
    wide = {jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)}
    bad = next((n for n, d in dtypes.items() if d not in wide), None)
    if bad is not None or len(set(dtypes.values())) != 1:
        got = (f"{bad} {dtypes[bad]}" if bad is not None else
               "; ".join(f"{n} {d}" for n, d in dtypes.items()) + " (one dtype for all)")
        raise TypeError(f"kan_linear: precision='{fp16_scaled.FP16_SCALED}' takes float32 'x' and trained params "
                        f"(float64 under jax_enable_x64: the same scaled products without the float16 rounding), "
                        f"got {got}; a 16-bit layer rounds its operands already: use precision=None")


def _mm(a, b, precision, a_bound=None):
    """``a @ b`` of two 2-D arrays: at ``precision`` (a ``lax`` precision), or from power-of-two scaled float16
    operands (``"fp16_scaled"``, :func:`jaxgrad.kan.fp16_scaled.matmul`; ``a_bound``: a known bound on ``|a|``)."""
    if _is_fp16_scaled(precision):
        return fp16_scaled.matmul(a, b, a_bound)
    return jnp.matmul(a, b, precision=precision)


def _forward_math(p, x, k, backend, precision, interpret):
    """``y[N, out]`` from ``x[N, in]``; every array already in the compute dtype."""
    out_f, in_f = p["base_weight"].shape
    coef = _coef(p)
    if backend == "mosaic":  # both branches in one kernel
        y = forward_mgpu.kan_forward(x, p["grid"], coef, p["base_weight"], k)
        return y + p["bias"] if "bias" in p else y
    silu, _ = _silu_and_slope(x)
    y = _mm(silu, p["base_weight"].T, precision)
    if backend == "pallas":
        from jaxgrad.kan import kernels  # lazy: the kernels module is optional for the XLA path

        spline = kernels.kan_spline_forward(x, p["grid"], coef, k, precision=precision, interpret=interpret)
        y = y + spline.astype(y.dtype)
    else:
        phi = bspline_basis_elementwise(x, p["grid"], k).reshape(x.shape[0], -1)  # [N, in*(G+k)], fused
        y = y + _mm(phi, coef.reshape(out_f, -1).T, precision, a_bound=1.0)  # bases lie in [0, 1]
    if "bias" in p:
        y = y + p["bias"]
    return y


def _backward_math(p, x, g, k, backend, precision, interpret):
    """The VJP of :func:`_forward_math` written out (module section "Backward"); plain ``jnp`` on the XLA
    backend, so it is itself differentiable (reverse-over-reverse, forward-over-reverse)."""
    out_f, in_f = p["base_weight"].shape
    n = x.shape[0]
    silu, dsilu = _silu_and_slope(x)
    coef = _coef(p)
    nb = coef.shape[-1]
    if backend == "mosaic":  # dx (both branches) in one kernel, the weight gradients (both branches) in another
        dcoef, dbase = dcoef_wide_mgpu.kan_weight_cotangents(x, p["grid"], g, k)
        dx = dx_mgpu.kan_dx(x, p["grid"], coef, p["base_weight"], g, k)
        return _weight_grads(p, g, silu, dcoef, None, dbase=dbase), dx
    if backend == "pallas":
        from jaxgrad.kan import kernels

        dx_spline, dcoef = kernels.kan_spline_backward(x, p["grid"], coef, g, k, precision=precision,
                                                       interpret=interpret)
        dx_spline, dcoef = dx_spline.astype(x.dtype), dcoef.astype(x.dtype)
    else:
        phi, dphi = bspline_basis_and_derivative(x, p["grid"], k)  # recomputed here, never a residual
        if _is_fp16_scaled(precision):
            # computed once into memory: the scaled dC product reads phi twice (its maxima over the batch, then
            # the float16 copy), and XLA would otherwise evaluate the bases inside that column reduction again
            phi, dphi = jax.lax.optimization_barrier((phi, dphi))
        # dC[o,i,m] = sum_b g[b,o] B_m(x_bi)
        dcoef = _mm(g.T, phi.reshape(n, -1), precision).reshape(out_f, in_f, nb)
        # sum_o g[b,o] sum_m C[o,i,m] B'_m(x_bi)
        gc = _mm(g, coef.reshape(out_f, -1), precision).reshape(n, in_f, nb)
        dx_spline = jnp.sum(gc * dphi, axis=-1)
    dx = _mm(g, p["base_weight"], precision) * dsilu + dx_spline
    return _weight_grads(p, g, silu, dcoef, precision), dx


def _weight_grads(p, g, silu, dcoef, precision, dbase=None):
    """The trained leaves' cotangents from ``dC`` and ``dW^b = g^T silu(x)`` (computed here unless given; module
    section "Backward")."""
    grads = {
        "spline_weight": dcoef * p["spline_scaler"][..., None],
        "spline_scaler": jnp.sum(dcoef * p["spline_weight"], axis=-1),
        "base_weight": _mm(g.T, silu, precision) if dbase is None else dbase,
    }
    if "bias" in p:
        grads["bias"] = jnp.sum(g, axis=0)
    return grads


def _to_compute(p, x, cdt):
    return {name: v.astype(cdt) for name, v in p.items()}, x.astype(cdt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _kan_linear_vjp(p, x, k, backend, precision, interpret):
    return _kan_linear_fwd(p, x, k, backend, precision, interpret)[0]


def _kan_linear_fwd(p, x, k, backend, precision, interpret):
    out_dtype = jnp.result_type(x, *(p[n] for n in _TRAINABLE if n in p))
    cdt = _compute_dtype(out_dtype)
    pc, xc = _to_compute(p, x, cdt)
    y = _forward_math(pc, xc, k, backend, precision, interpret).astype(out_dtype)
    return y, (p, x)  # residuals: the inputs only; bases are recomputed in the backward


def _kan_linear_bwd(k, backend, precision, interpret, res, g):
    p, x = res
    cdt = _compute_dtype(x.dtype, g.dtype, *(p[n].dtype for n in _TRAINABLE if n in p))
    pc, xc = _to_compute(p, x, cdt)
    grads, dx = _backward_math(pc, xc, g.astype(cdt), k, backend, precision, interpret)
    cot = {name: grads[name].astype(p[name].dtype) for name in grads}
    cot["grid"] = jnp.zeros_like(p["grid"])  # the grid is not trained: stop_gradient
    return cot, dx.astype(x.dtype)


_kan_linear_vjp.defvjp(_kan_linear_fwd, _kan_linear_bwd)


def _validate(params, x, backend, spline_order=None):
    if backend not in _BACKENDS:
        raise ValueError(f"kan_linear: backend must be one of {_BACKENDS}, got {backend!r}")
    if not isinstance(params, Mapping):
        raise TypeError(f"kan_linear: 'params' must be a dict of arrays (see layer.init), got {type(params).__name__}")
    for name in ("base_weight", "spline_weight", "spline_scaler", "grid", "bias"):
        if name in params and not jnp.issubdtype(jnp.result_type(params[name]), jnp.floating):
            raise TypeError(f"KAN params: '{name}' must be floating point, got {jnp.result_type(params[name])}")
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"kan_linear: input 'x' must be an array, got {type(x).__name__}")
    return check_params(params, x, spline_order=spline_order)


def kan_linear(params: Mapping[str, jax.Array], x: jax.Array, *, backend: str = "xla", precision=None,
               interpret: bool | None = None, spline_order: int | None = None) -> jax.Array:
    r"""KAN layer ``x[..., in] -> [..., out]`` with a hand-written VJP (same forward as :func:`kan_linear_reference`).

    Forward, with :math:`\Phi_{bim} = B_m(x_{bi})` the ``G + k`` bases of input ``i`` and
    :math:`C_{oim} = \text{spline\_weight}_{oim}\,\text{spline\_scaler}_{oi}`:

    .. math::

        y_{bo} = \sum_i W^b_{oi}\operatorname{silu}(x_{bi}) + \sum_{i,m} C_{oim}\,B_m(x_{bi}) \;(+\, \text{bias}_o)

    Backward (``g`` the output cotangent; :math:`B'_m` from
    :func:`~jaxgrad.kan.spline.bspline_basis_derivative`):

    .. math::

        \bar C_{oim} &= \textstyle\sum_b g_{bo}\, B_m(x_{bi}) \\
        \overline{\text{spline\_weight}}_{oim} &= \bar C_{oim}\, \text{spline\_scaler}_{oi}, \qquad
        \overline{\text{spline\_scaler}}_{oi} = \textstyle\sum_m \bar C_{oim}\, \text{spline\_weight}_{oim} \\
        \overline{W^b} &= g^\top \operatorname{silu}(x), \qquad \overline{\text{bias}} = \textstyle\sum_b g_{b\cdot} \\
        \bar x_{bi} &= \textstyle\sum_o g_{bo}\Bigl(W^b_{oi}\operatorname{silu}'(x_{bi})
                       + \sum_m C_{oim}\, B'_m(x_{bi})\Bigr), \qquad
        \operatorname{silu}'(x) = \sigma(x)\bigl(1 + x(1 - \sigma(x))\bigr) \\
        \overline{\text{grid}} &= 0 \quad(\text{not trained; the reference applies } \texttt{stop\_gradient})

    The residuals are ``x`` and ``params`` only: the ``[B, in, G+k]`` basis (what autodiff would tape) is
    recomputed in the backward. Leading dimensions of ``x`` are flattened to one batch axis ``B``. Arithmetic runs in
    ``promote_types(dtype, float32)`` (f32 for bf16/f16/f32 inputs, f64 under ``jax.enable_x64``); the output has
    the dtype the reference would return (``result_type`` of ``x`` and the trained params) and every cotangent its
    primal's dtype.

    Higher derivatives (physics-informed losses):

    * ``backend="xla"``: the backward above is plain differentiable ``jnp``, so **reverse-over-reverse** works
      (``jax.grad`` of a loss built from ``jax.grad``/``jax.vjp`` w.r.t. ``x``, e.g. a PDE residual with
      :math:`u''`), and so does **forward-over-reverse** (``jax.hessian`` = ``jacfwd(jacrev(.))``, or
      ``jax.jvp`` of a ``jax.grad``). Forward mode applied *directly* to the layer (``jax.jvp``, ``jax.jacfwd``,
      ``jax.linearize`` of ``kan_linear`` itself) is refused by JAX for any ``custom_vjp``.
    * ``backend="reference"``: the same forward equations in plain JAX without a custom rule, differentiated by
      JAX autodiff: every transformation works (``jvp``, ``jacfwd``, any order), at autodiff's memory cost (the
      basis is taped). Use it for forward-mode derivatives.
    * ``backend="pallas"``: first-order reverse mode only (the Pallas kernels have no derivative rules).

    Args:
      params: a layer dict from :func:`init` (``base_weight``, ``spline_weight``, ``spline_scaler``, ``grid``,
        optional ``bias``); ``spline_order`` follows from the shapes.
      x: ``[..., in_features]`` floating array (bf16, f16, f32 or f64).
      backend: ``"xla"`` (custom VJP in jnp), ``"pallas"`` (custom VJP; the spline part of forward and backward in
        the fused kernels of :mod:`jaxgrad.kan.kernels`, the base/scaler chain rule in XLA) or ``"reference"``
        (no custom rule).
      precision: ``jax.lax.Precision`` of the matmuls (and passed to the kernels), or ``"fp16_scaled"``
        (``backend="xla"``, float32 arrays): every product of the forward and the backward (the three spline
        contractions and the two SiLU-branch ones) from float16 operands scaled by powers of two, float32 sums and
        exact unscaling (:mod:`jaxgrad.kan.fp16_scaled`: TF32's 11-bit significand at the float16 tensor-core rate;
        bases at the fixed scale ``2^14``, every other operand per slice of its free axis). Float64 arrays take the
        same scaled products without the float16 rounding (the verifier's float64 re-run); bf16 / f16 arrays are
        refused.
      interpret: Pallas interpret mode (``None``: on unless running on a GPU); ignored by the other backends.
      spline_order: optional, the order ``k`` the layer was built with (``KANConfig.spline_order``). The params do
        not store it; given, ``grid`` must have exactly ``G + 2k + 1`` knots per row (``G + k`` = spline_weight's
        bases), so a grid missing a knot raises instead of being read as order ``k - 1``.

    Raises (naming the argument) on bad shapes or dtypes at trace time, and on a ``grid`` row that decreases when
    the grid is concrete (not under ``jit``).
    """
    k = _validate(params, x, backend, spline_order)
    _check_precision(precision, backend, params, x)
    p = {name: params[name] for name in ("base_weight", "spline_weight", "spline_scaler", "bias") if name in params}
    # not trained, to every order: the backward's own use of the knots must not leak a second-order grid gradient
    p["grid"] = jax.lax.stop_gradient(params["grid"])
    out_f, in_f = p["base_weight"].shape
    lead = x.shape[:-1]
    if backend == "reference" or x.size == 0:
        out_dtype = jnp.result_type(x, *(p[n] for n in _TRAINABLE if n in p))
        pc, xc = _to_compute(p, x.reshape(-1, in_f), _compute_dtype(out_dtype))
        y = _forward_math(pc, xc, k, "xla", precision, None).astype(out_dtype)
    else:
        y = _kan_linear_vjp(p, x.reshape(-1, in_f), k, backend, precision, interpret)
    return y.reshape(*lead, out_f)


def audit_cases():
    """Cases for ``jaxgrad audit``: the trained leaves and x are verified; the grid is closed over (not trained)."""
    from jaxgrad.ops.registry import OpAudit

    def make_args(key, size):
        batch, n_in, n_out = size
        k_init, k_x = jax.random.split(key)
        params = init(k_init, KANConfig(n_in, n_out, bias=True))
        params["bias"] = jax.random.normal(k_x, (n_out,)) * 0.1
        trainable = {name: v for name, v in params.items() if name != "grid"}
        x = jax.random.uniform(jax.random.fold_in(k_x, 1), (batch, n_in), minval=-1.2, maxval=1.2)
        return trainable, x

    def fn_for(backend, precision=None):
        def fn(trainable, x):
            grid = make_grid(x.shape[-1], 5, 3, dtype=x.dtype)
            return kan_linear({**trainable, "grid": grid}, x, backend=backend, precision=precision)
        fn.__name__ = f"kan_linear_{backend}" + (f"_{precision}" if precision else "")
        return fn

    def reference(trainable, x):
        return kan_linear_reference({**trainable, "grid": make_grid(x.shape[-1], 5, 3, dtype=x.dtype)}, x)

    return (
        OpAudit("kan_linear[xla]", fn_for("xla"), reference, make_args, ((7, 5, 3), (33, 9, 4), (129, 17, 6)),
                arg_names=("params", "x"), backend="xla"),
        OpAudit("kan_linear[pallas]", fn_for("pallas"), reference, make_args, ((7, 5, 3), (33, 9, 4)),
                arg_names=("params", "x"), backend="pallas"),
        # float16 operands scaled by powers of two: judged at the float16 rounding its program shows
        OpAudit("kan_linear[xla] precision=fp16_scaled", fn_for("xla", fp16_scaled.FP16_SCALED), reference,
                make_args, ((7, 5, 3), (33, 9, 4), (129, 17, 6)), arg_names=("params", "x"), backend="xla"),
        # the Mosaic kernels (Hopper): forward, dx and the weight gradients, on the same scaled float16 operands
        OpAudit("kan_linear[mosaic]", fn_for("mosaic"), reference, make_args, ((129, 17, 6), (257, 96, 33)),
                arg_names=("params", "x"), backend="mosaic"),
        # the scaled product alone: its own VJP (reached when the layer's backward is differentiated again)
        OpAudit("kan_fp16_scaled_matmul[xla]", fp16_scaled.matmul, jnp.matmul, _matmul_args,
                ((7, 5, 3), (33, 96, 10), (129, 520, 7)), arg_names=("a", "b"), backend="xla"),
    )


def _matmul_args(key, size):
    """``a[m, k]``, ``b[k, n]``: white noise, rows of ``a`` from 1e-3 to 1e3 (the per-row scales at work)."""
    m, k, n = size
    ka, kb = jax.random.split(key)
    rows = jnp.logspace(-3, 3, m, dtype=jnp.float32)[:, None]
    return jax.random.normal(ka, (m, k)) * rows, jax.random.normal(kb, (k, n))
