"""What :func:`jaxgrad.verify.check_vjp` is given: its arguments checked and named, and the host-side arrays it draws.

Every argument leaf is differentiated, so each must be a floating array (integer or boolean inputs are closed over);
a bad argument or option gets one error naming it. The random arrays (cotangents, directions, the low-bit fill of
the float64 re-run) are drawn with NumPy on the host and moved with ``jax.device_put``: an eager ``jnp`` operation
compiles one XLA program per shape and dtype (~0.05 s each on the CPU, several times that on a GPU; ``jnp.asarray``
of a NumPy array too), and a pytree of leaves makes dozens of them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def _leaf_names(args, arg_names=None) -> list[str]:
    """``x``, ``params['w']`` (with ``arg_names``) or ``args[0]``, ``args[1]['w']`` (without)."""
    if arg_names is not None and len(arg_names) != len(args):
        raise ValueError(f"check_vjp: 'arg_names' names {len(arg_names)} arguments but {len(args)} were passed")
    paths, _ = jax.tree_util.tree_flatten_with_path(args)
    names = []
    for path, _ in paths:
        i = path[0].idx  # the positional index of the argument
        head = arg_names[i] if arg_names is not None else f"args[{i}]"
        names.append(head + jax.tree_util.keystr(path[1:]))
    return names


def _validate_args(fn, reference, args) -> None:
    for what, f in (("fn", fn), ("reference", reference)):
        if not callable(f):
            raise TypeError(f"check_vjp: '{what}' must be callable, got {type(f).__name__}")
    if not args:
        raise ValueError("check_vjp: pass the arguments to differentiate, e.g. check_vjp(fn, ref, x, w)")
    leaves = jax.tree.leaves(args)
    if not leaves:
        raise ValueError("check_vjp: the arguments contain no arrays to differentiate")
    for name, leaf in zip(_leaf_names(args), leaves, strict=True):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            raise TypeError(f"check_vjp: argument leaf {name} is a {type(leaf).__name__}, not an array; close over "
                            "non-array arguments with functools.partial")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"check_vjp: argument leaf {name} has dtype {dtype}; every argument leaf is "
                            "differentiated and must be floating point (bf16/f16/f32/f64). Close over integer or "
                            "boolean inputs (indices, masks, NF4 codes) with functools.partial.")
        if np.size(leaf) and not _all_finite32(leaf):
            raise ValueError(f"check_vjp: argument leaf {name} contains NaN or Inf")


def _validate_options(seed, safety, fd, fd_directions, replicas) -> None:
    """The numeric options, named when out of range (each would otherwise fail deep inside, or pass silently)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"check_vjp: 'seed' must be a non-negative integer, got {seed!r}")
    if isinstance(safety, bool) or not isinstance(safety, (int, float, np.floating, np.integer)) \
            or not math.isfinite(safety) or safety <= 0:
        raise ValueError(f"check_vjp: 'safety' (the constant C of the rounding bound) must be a finite number > 0, "
                         f"got {safety!r}")
    if fd and (isinstance(fd_directions, bool) or not isinstance(fd_directions, (int, np.integer))
               or fd_directions < 1):
        raise ValueError(f"check_vjp: 'fd_directions' must be an integer >= 1 (or pass fd=False), got "
                         f"{fd_directions!r}")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, (int, np.integer))
                                 or replicas < 8):
        raise ValueError(f"check_vjp: 'replicas' (the rounding samples of the statistical verdict) must be an "
                         f"integer >= 8, or None for the default, got {replicas!r}")


def _all_finite32(x) -> bool:
    """Every entry finite once in float32 (as the verifier's float32 runs see it), tested on the host."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.all(np.isfinite(np.asarray(x).astype(np.float32))))


def _call(f, what, args):
    """Abstract evaluation (shapes and dtypes only, nothing compiled) with a readable error."""
    try:
        return jax.eval_shape(f, *args)
    except Exception as e:  # surface the user's error with context
        raise ValueError(f"check_vjp: calling {what}(*args) failed: {type(e).__name__}: {e}") from e


def _check_outputs(out, ref_out) -> None:
    s1, s2 = jax.tree.structure(out), jax.tree.structure(ref_out)
    if s1 != s2:
        raise ValueError(f"check_vjp: fn and reference return different structures: fn -> {s1}, reference -> {s2}")
    for i, (a, b) in enumerate(zip(jax.tree.leaves(out), jax.tree.leaves(ref_out), strict=True)):
        if a.shape != b.shape:
            raise ValueError(f"check_vjp: output leaf {i}: fn returns shape {a.shape} but reference returns "
                             f"shape {b.shape}")
        for who, x in (("fn", a), ("reference", b)):
            if not jnp.issubdtype(x.dtype, jnp.inexact):
                raise TypeError(f"check_vjp: output leaf {i} of {who} has dtype {x.dtype}; only "
                                "floating outputs can carry a cotangent")



def _rng(seed: int, stream: int) -> np.random.Generator:
    # NumPy streams rather than jax.random: no compilation per new shape/dtype (~0.6 s each on CPU).
    return np.random.default_rng([seed, stream])


def _white_noise_like(tree, rng: np.random.Generator, dtype=None):
    leaves, treedef = jax.tree.flatten(tree)
    out = [jax.device_put(rng.standard_normal(x.shape).astype(dtype or x.dtype)) for x in leaves]
    return jax.tree.unflatten(treedef, out)


def _fill_low_bits(tree, rng: np.random.Generator):
    """x * (1 + 2^-26 xi): the same point to f32 precision, with the mantissa bits below f32 populated."""
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for x in leaves:
        xh = np.asarray(x)
        out.append(jax.device_put(xh * (1 + 2.0**-26 * rng.standard_normal(xh.shape).astype(xh.dtype))))
    return jax.tree.unflatten(treedef, out)


def _to64(tree):
    """Every leaf as a float64 array (converted on the host: exact from any narrower float)."""
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) and x.dtype == jnp.float64
                        else jax.device_put(np.asarray(x).astype(np.float64)), tree)
