"""Convert between efficient-kan ``state_dict``s and our KAN params (no torch import: ``np.asarray`` only).

efficient-kan's ``KANLinear`` holds ``base_weight[out, in]``, ``spline_weight[out, in, G+k]``,
``spline_scaler[out, in]`` (absent when ``enable_standalone_scale_spline=False``) and the buffer
``grid[in, G+2k+1]`` -- the very names and layouts of :mod:`jaxgrad.kan.layer`. Its ``KAN`` network prefixes them
with ``layers.{i}.`` (any further outer prefix, e.g. ``model.``, is accepted on input).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from jaxgrad.kan.layer import check_params

__all__ = ["from_efficient_kan", "to_efficient_kan"]

_NAMES = ("base_weight", "spline_weight", "spline_scaler", "grid")
_LAYER_KEY = re.compile(r"^(?P<prefix>.*?)layers\.(?P<idx>\d+)\.(?P<name>[A-Za-z_]+)$")


def _to_numpy(v) -> np.ndarray:
    # torch tensors: detach / move to CPU by duck typing, so that torch is never imported here
    if hasattr(v, "detach"):
        v = v.detach()
    if hasattr(v, "cpu"):
        v = v.cpu()
    return np.asarray(v)


def _layer(entries: Mapping[str, object], where: str, dtype) -> dict:
    missing = [n for n in ("base_weight", "spline_weight", "grid") if n not in entries]
    if missing:
        raise KeyError(f"from_efficient_kan: {where} lacks {missing} (have {sorted(entries)})")
    arrs = {n: _to_numpy(entries[n]) for n in _NAMES if n in entries}
    if "spline_scaler" not in arrs:  # enable_standalone_scale_spline=False
        arrs["spline_scaler"] = np.ones_like(arrs["base_weight"])
    params = {n: jnp.asarray(arrs[n], dtype=dtype) for n in _NAMES}
    try:
        check_params(params)
    except (KeyError, ValueError) as e:
        raise ValueError(f"from_efficient_kan: {where}: {e}") from None
    return params


def from_efficient_kan(state_dict: Mapping[str, object], dtype=None) -> dict | list[dict]:
    """efficient-kan ``state_dict`` -> params.

    A ``KANLinear`` state dict (keys ``base_weight``, ...) gives one layer dict; a ``KAN`` state dict
    (``layers.{i}.base_weight``, ...) gives a list of layer dicts in index order. ``dtype`` (default: the arrays'
    own, subject to JAX's x64 setting) casts every leaf. Keys that are not KAN parameters raise ``KeyError``.
    """
    keys = list(state_dict)
    if all(k in _NAMES for k in keys):
        return _layer(state_dict, "state_dict", dtype)
    layers: dict[int, dict[str, object]] = {}
    prefixes = set()
    for key in keys:
        m = _LAYER_KEY.match(key)
        if m is None or m["name"] not in _NAMES:
            raise KeyError(f"from_efficient_kan: unexpected key {key!r} (expected {list(_NAMES)} or "
                           f"'layers.<i>.<name>')")
        prefixes.add(m["prefix"])
        layers.setdefault(int(m["idx"]), {})[m["name"]] = state_dict[key]
    if len(prefixes) > 1:
        raise KeyError(f"from_efficient_kan: keys from several networks (prefixes {sorted(prefixes)})")
    idx = sorted(layers)
    if idx != list(range(len(idx))):
        raise KeyError(f"from_efficient_kan: layer indices {idx} are not 0..{len(idx) - 1}")
    out = [_layer(layers[i], f"layers.{i}", dtype) for i in idx]
    for i in range(1, len(out)):
        if out[i]["base_weight"].shape[1] != out[i - 1]["base_weight"].shape[0]:
            raise ValueError(f"from_efficient_kan: layers.{i} has in_features {out[i]['base_weight'].shape[1]} but "
                             f"layers.{i - 1} has out_features {out[i - 1]['base_weight'].shape[0]}")
    return out


def to_efficient_kan(params: dict | Sequence[dict]) -> dict[str, np.ndarray]:
    """params -> efficient-kan ``state_dict`` of numpy arrays (``torch.from_numpy`` each to load it).

    A layer dict gives ``KANLinear`` keys, a list gives ``layers.{i}.`` keys. efficient-kan has no bias: a bias
    that is all zero is dropped, a nonzero one raises ``ValueError``.
    """
    def one(p, prefix):
        check_params(p)
        if "bias" in p and np.any(np.asarray(p["bias"]) != 0):
            raise ValueError(f"to_efficient_kan: {prefix or 'layer'} has a nonzero 'bias', which efficient-kan's "
                             f"KANLinear cannot represent")
        return {prefix + n: np.asarray(p[n]) for n in _NAMES}

    if isinstance(params, Mapping):
        return one(params, "")
    sd = {}
    for i, p in enumerate(params):
        sd.update(one(p, f"layers.{i}."))
    return sd
