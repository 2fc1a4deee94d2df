"""Argument checks shared by the families: a bad argument gets one error naming it and what was expected, before
JAX would fail on it deep inside (or accept it silently)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_float_dtype", "check_key", "check_precision"]


def check_key(key: Any, where: str) -> None:
    """``key`` must be a JAX PRNG key: ``jax.random.key(seed)`` or the legacy ``jax.random.PRNGKey(seed)``."""
    dtype = getattr(key, "dtype", None)
    if dtype is not None and (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
                              or (dtype == np.uint32 and getattr(key, "shape", ())[-1:] in ((2,), (4,)))):
        return
    what = f"an array of {dtype} {tuple(key.shape)}" if dtype is not None and hasattr(key, "shape") else \
        f"{type(key).__name__} {key!r}"
    raise TypeError(f"{where}: 'key' must be a JAX PRNG key (jax.random.key(seed)), got {what}")


def check_float_dtype(dtype: Any, where: str, allow_none: bool = False) -> None:
    """``dtype`` must be a floating dtype (an integer cast would truncate the values without a word); with
    ``allow_none``, ``None`` (keep the stored dtype) too."""
    if allow_none and dtype is None:
        return
    try:
        ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        ok = False
    if not ok:
        what = "None (as stored) or a floating dtype" if allow_none else "a floating dtype"
        raise TypeError(f"{where}: 'dtype' must be {what} (float32, bfloat16, float16, float64), got {dtype!r}")


def check_precision(precision: Any, where: str) -> None:
    """``precision`` must be what ``lax`` accepts: ``None``, a ``jax.lax.Precision``, one of its names
    (``"highest"``, ``"float32"``, ``"high"``, ``"tensorfloat32"``, ``"default"``, ...), a pair of them, or a
    ``jax.lax.DotAlgorithmPreset``."""
    def ok(p):
        if p is None or isinstance(p, jax.lax.Precision):
            return True
        if isinstance(p, str):
            try:
                jax.lax.Precision(p)
                return True
            except ValueError:
                return False
        return False

    pair = isinstance(precision, (tuple, list)) and len(precision) == 2 and all(ok(p) for p in precision)
    if not (ok(precision) or pair or isinstance(precision, getattr(jax.lax, "DotAlgorithmPreset", ()))):
        raise ValueError(f"{where}: 'precision' must be None, a jax.lax.Precision, one of 'default', 'high', "
                         f"'highest' (or 'bfloat16', 'tensorfloat32', 'float32', ...) or a pair of them, got "
                         f"{precision!r}")
