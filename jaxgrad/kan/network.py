r"""Multi-layer KAN ``[in, h_1, ..., out]``: pure functions over a list of layer dicts.

.. math::

    x^{(l+1)} = \mathrm{KANLinear}_l\bigl(x^{(l)}\bigr), \qquad l = 0 \dots L-1

Parameters are a ``list`` (or ``tuple``) of the layer dicts of :func:`jaxgrad.kan.layer.init` -- an ordinary
pytree, so ``optax``, ``jax.tree.map`` and checkpointing work on it directly. Each layer carries its own ``grid``
(not trained: mask it with :func:`trainable_mask` or leave it out of the differentiated tree).

Every layer goes through :func:`jaxgrad.kan.layer.kan_linear`, whose VJP is hand-written; its backend notes apply
(``"xla"``: first and second order reverse mode and ``jax.hessian``; ``"reference"``: plain autodiff, every
transformation including ``jax.jacfwd``; ``"pallas"``: first-order reverse mode).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp

from jaxgrad.checks import check_float_dtype, check_key
from jaxgrad.kan.layer import KANConfig, init, kan_linear, kan_linear_reference
from jaxgrad.kan.layer import trainable_mask as _layer_mask

__all__ = ["kan_apply", "kan_apply_reference", "kan_init", "kan_widths", "trainable_mask"]


def kan_init(key: jax.Array, widths: Sequence[int], *, dtype=jnp.float32, **layer_cfg) -> list[dict[str, jax.Array]]:
    """Initialise ``KAN(widths)``: one :func:`~jaxgrad.kan.layer.init` per consecutive pair of ``widths``.

    Args:
      key: PRNG key (split once per layer).
      widths: ``[in, h_1, ..., out]``, at least two positive integers.
      dtype: parameter dtype.
      **layer_cfg: the other fields of :class:`~jaxgrad.kan.layer.KANConfig` (``grid_size``, ``spline_order``,
        ``grid_range``, ``scale_noise``, ``scale_base``, ``scale_spline``, ``grid_eps``, ``bias``, ``init``:
        ``"efficient_kan"`` (default) or ``"pykan"``), shared by every layer.
    """
    if isinstance(widths, (str, bytes, Mapping)) or not isinstance(widths, Iterable):
        raise TypeError(f"kan_init: 'widths' must be a list of layer widths [in, h_1, ..., out], got "
                        f"{type(widths).__name__} {widths!r}")
    widths = list(widths)
    if len(widths) < 2:
        raise ValueError(f"kan_init: 'widths' needs at least [in, out], got {widths}")
    try:
        widths = [operator.index(w) for w in widths]
    except TypeError:
        raise TypeError(f"kan_init: 'widths' must be integers, got {widths}") from None
    if min(widths) < 1:
        raise ValueError(f"kan_init: every entry of 'widths' must be >= 1, got {widths}")
    bad = {"in_features", "out_features"} & set(layer_cfg)
    if bad:
        raise TypeError(f"kan_init: {sorted(bad)} come from 'widths', do not pass them")
    fields = [f.name for f in dataclasses.fields(KANConfig) if f.name not in ("in_features", "out_features")]
    unknown = sorted(set(layer_cfg) - set(fields))
    if unknown:
        raise TypeError(f"kan_init: unknown layer setting {unknown[0]!r} (the KANConfig fields are {fields})")
    check_key(key, "kan_init")
    check_float_dtype(dtype, "kan_init")
    cfgs = [KANConfig(a, b, **layer_cfg) for a, b in zip(widths[:-1], widths[1:])]
    keys = jax.random.split(key, len(cfgs))
    return [_init_jit(k, cfg, dtype) for k, cfg in zip(keys, cfgs)]


# One compiled program per layer configuration (eager, the lstsq fit dispatches dozens of small compiled ops).
_init_jit = jax.jit(init, static_argnums=(1, 2))


def kan_widths(params: Sequence[dict[str, jax.Array]]) -> list[int]:
    """``[in, h_1, ..., out]`` from the layer shapes (after checking that consecutive layers chain)."""
    if isinstance(params, Mapping) or not isinstance(params, (list, tuple)) or not params:
        raise TypeError("KAN network: 'params' must be a non-empty list/tuple of layer dicts (see kan_init), got "
                        f"{type(params).__name__}")
    widths = []
    for i, p in enumerate(params):
        if not isinstance(p, Mapping) or "base_weight" not in p:
            raise TypeError(f"KAN network: params[{i}] must be a layer dict with 'base_weight', ..., got "
                            f"{type(p).__name__}")
        out_f, in_f = p["base_weight"].shape
        if i and in_f != widths[-1]:
            raise ValueError(f"KAN network: layer {i} takes {in_f} inputs but layer {i - 1} produces {widths[-1]}")
        if not i:
            widths.append(in_f)
        widths.append(out_f)
    return widths


def trainable_mask(params):
    """``False`` for every ``grid``, ``True`` elsewhere, in the structure of ``params`` (a network's list of layer
    dicts, or one layer dict): for ``optax.masked`` / ``optax.multi_transform``."""
    if isinstance(params, Mapping):
        return _layer_mask(params)
    return [_layer_mask(p) for p in params]


def kan_apply(params: Sequence[dict[str, jax.Array]], x: jax.Array, *, backend: str = "xla", precision=None,
              interpret: bool | None = None) -> jax.Array:
    """``KAN(widths)(x)``: ``x[..., in] -> [..., out]``, each layer by :func:`~jaxgrad.kan.layer.kan_linear` with
    the same ``backend``, ``precision`` and ``interpret``.

    ``precision``: a ``jax.lax`` precision, or ``"fp16_scaled"`` (``backend="xla"``, float32 params and ``x``):
    every product of every layer's forward and backward from float16 operands scaled by powers of two, float32 sums
    (:mod:`jaxgrad.kan.fp16_scaled`: TF32's 11-bit significand at the float16 tensor-core rate). Checked per layer,
    errors naming the argument."""
    kan_widths(params)
    for p in params:
        x = kan_linear(p, x, backend=backend, precision=precision, interpret=interpret)
    return x


def kan_apply_reference(params: Sequence[dict[str, jax.Array]], x: jax.Array, precision=None) -> jax.Array:
    """The same network through :func:`~jaxgrad.kan.layer.kan_linear_reference` (plain JAX, autodiff oracle)."""
    kan_widths(params)
    for p in params:
        x = kan_linear_reference(p, x, precision=precision)
    return x
