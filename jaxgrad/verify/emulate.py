r"""Run plain JAX code the way a low-precision kernel computes it, to model the rounding error it *should* have.

A tensor-core kernel in TF32, f16 or bf16 rounds the operands of every matrix product to that format and accumulates
in f32. :func:`at_precision` re-interprets a function's jaxpr and does exactly that: the floating operands of every
contraction -- ``dot_general``, ``conv_general_dilated`` and ``reduce_sum`` (a kernel often sums a bias gradient as
a product with ones, or from the same rounded tile that feeds its GEMM) -- pass through ``lax.reduce_precision`` to
the named format, and products run at HIGHEST precision (exact f32 products and accumulation, also on a GPU), so the
only rounding added is the operand rounding of the hypothesis. Elementwise work stays in the arrays' own dtype: a
bf16 array program already rounds every intermediate to bf16.

=========  ==========================  ======================================================================
precision  operand format (exp, mant)  notes
=========  ==========================  ======================================================================
``f32``    unchanged                   exact f32 products, f32 accumulation
``tf32``   (8, 10)                     round to nearest even, f32's exponent range
``f16``    (5, 10)                     same unit roundoff as TF32, but overflow above 65504 and no range
                                       below 2^-24: part of its model (an operand that overflows gives inf)
``bf16``   (8, 7)                      round to nearest even
=========  ==========================  ======================================================================

:func:`perturb` draws the independent rounding realisations: the same point moved by a few units in the last place
of the hypothesis (``x (1 + 2 u_p xi)``, rounded back to the arrays' dtype), which re-randomises where every
rounded operand falls in its rounding interval while the exact result moves by O(u_p), and is recomputed exactly
by the float64 oracle at the moved point. With ``reorder=True`` (what the replicas use) every sum also runs in a random
order (:func:`_reorder`: the reduced axes of ``reduce_sum``, the contracting dimensions of ``dot_general`` and the
input features of an ungrouped convolution, permuted alike in both operands): the exact result is unchanged and its
rounding re-drawn, so a replica does not inherit the reference's summation order and that order's luck on each row
(a kernel sums in its own order: a tree over padded lanes, split-K partials). The orders are drawn on the host
(NumPy, from a replica's integer seed) and enter the compiled program as arguments, one permutation per reordered
axis in the order the contractions ask for them, so the program holds no random-number generator (drawn inside, a
threefry and a sort per contraction made it the largest compilation of a verdict) and one compiled program serves
every replica (:meth:`Reordered.replicas`). The replicas are not batched with ``vmap``: a batched convolution is a
grouped one, which XLA accumulates differently from the convolution the kernel under test runs (on the CPU an f32
conv's input gradient came out ~7x more accurate than any summation order of the unbatched one, and the replicas
then called a correct conv's rounding a bug); each replica is the unbatched program, as the reference runs.

Calls (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``) are entered; loops (``scan``, ``while``,
``cond``) are evaluated as they are, and :func:`at_precision` reports them in ``not_emulated`` so the report can
say that the operands inside them were not rounded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jaxgrad.verify import cost

__all__ = ["OPERAND_FORMAT", "Reordered", "at_precision", "perturb", "perturb_host"]

# (exponent bits, mantissa bits) of the operand format of each precision hypothesis; None: left as it is.
OPERAND_FORMAT: dict[str, tuple[int, int] | None] = {"f64": None, "f32": None, "tf32": (8, 10), "f16": (5, 10), "bf16": (8, 7)}
_PRODUCTS = {"dot_general", "conv_general_dilated"}
_CONTRACTIONS = _PRODUCTS | {"reduce_sum"}
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr"}
_LOOPS = {"scan", "while", "cond"}
_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


def _round_operand(x, fmt: tuple[int, int] | None):
    if fmt is None or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    e, m = fmt
    if jnp.finfo(x.dtype).nmant <= m and jnp.finfo(x.dtype).nexp <= e:
        return x  # already no finer than the format (bf16 arrays under the bf16 hypothesis)
    return lax.reduce_precision(x, exponent_bits=e, mantissa_bits=m)


class _Orders:
    """The summation orders of one run, handed out in the order the contractions ask for them.

    Without ``given`` (the first trace) it records the length of each reordered axis and hands out the identity;
    with ``given`` (a sequence of permutations for those lengths, in that order) it hands them out."""

    def __init__(self, given: Sequence[Any] | None = None):
        self.sizes: list[int] = []
        self.given = given

    def take(self, n: int):
        if self.given is None:
            self.sizes.append(n)
            return np.arange(n, dtype=np.int32)
        i = len(self.sizes)
        self.sizes.append(n)
        perm = self.given[i]
        if perm.shape[-1] != n:
            raise AssertionError(f"summation order {i}: permutation of {perm.shape[-1]}, axis of {n}")
        return perm


def _take(x, perm, axis: int):
    """``x`` with its ``axis`` in the order ``perm`` (a permutation: every index in bounds). ``x`` may be a constant
    of the traced program held as a NumPy-backed literal (a closed-over host array), which has no ``.at``."""
    return jnp.asarray(x).at[(slice(None),) * axis + (perm,)].get(mode="promise_in_bounds", unique_indices=True)


def _reorder(prim: str, ins: list, params: dict, orders: _Orders) -> list:
    """The operands of a sum in a random summation order: the exact result is unchanged, its rounding re-drawn.

    A reduction's rounding depends on the order its terms meet, and a kernel sums in its own (a tree over padded
    lanes, split-K partials); a replica that keeps the reference's order keeps that order's luck on every row. The
    reduced axes of ``reduce_sum``, the contracting dimensions of ``dot_general`` (both operands alike) and the input
    features of an ungrouped ``conv_general_dilated`` (lhs and rhs alike) are permuted."""
    if prim == "reduce_sum":
        x = ins[0]
        for ax in params["axes"]:
            if x.shape[ax] > 1:
                x = _take(x, orders.take(x.shape[ax]), ax)
        return [x]
    if prim == "dot_general":
        (lc, rc), _ = params["dimension_numbers"]
        a, b = ins
        for la, ra in zip(lc, rc, strict=True):
            if a.shape[la] > 1:
                perm = orders.take(a.shape[la])
                a, b = _take(a, perm, la), _take(b, perm, ra)
        return [a, b]
    if prim == "conv_general_dilated" and params["feature_group_count"] == 1 and params["batch_group_count"] == 1:
        dn = params["dimension_numbers"]
        la, ra = dn.lhs_spec[1], dn.rhs_spec[1]
        a, b = ins
        if a.shape[la] > 1:
            perm = orders.take(a.shape[la])
            a, b = _take(a, perm, la), _take(b, perm, ra)
        return [a, b]
    return ins


def _eval(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any], fmt, loops: set[str],
          orders: _Orders | None = None) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for var, c in zip(jaxpr.constvars, consts, strict=True):
        env[var] = c
    for var, a in zip(jaxpr.invars, args, strict=True):
        env[var] = a
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        prim = eqn.primitive.name
        sub = eqn.params.get(_CALLS[prim]) if prim in _CALLS else None
        if sub is not None:
            outs = (_eval(sub.jaxpr, sub.consts, ins, fmt, loops, orders) if isinstance(sub, jcore.ClosedJaxpr)
                    else _eval(sub, [], ins, fmt, loops, orders))
        else:
            params = dict(eqn.params)
            if prim in _CONTRACTIONS and fmt is not None:
                ins = [_round_operand(x, fmt) for x in ins]
            if prim in _CONTRACTIONS and orders is not None:
                ins = _reorder(prim, ins, params, orders)
            if prim in _PRODUCTS:
                params["precision"] = _HIGHEST
            if prim in _LOOPS:
                loops.add(prim)
            outs = eqn.primitive.bind(*ins, **params)
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
        for var, o in zip(eqn.outvars, outs, strict=True):
            env[var] = o
    return [read(v) for v in jaxpr.outvars]


_CACHE: dict[Any, tuple[Callable[..., Any], set[str]]] = {}
_CACHE_SIZE = 64


def at_precision(fn: Callable[..., Any], precision: str, *example_args: Any,
                 reorder: bool = False) -> tuple[Callable[..., Any], set[str]]:
    """``fn`` as a ``precision`` kernel would compute it (module doc), jit-compiled for ``example_args``' shapes.

    Returns:
      ``(emulated, not_emulated)``: ``emulated(*args)`` returns ``fn(*args)``'s flat output leaves (with
      ``reorder=True`` a :class:`Reordered`: ``emulated(seed, *args)``, every sum in a random order drawn from the
      integer ``seed``, :func:`_reorder`; ``emulated.replicas(seeds, points)`` for many runs of one program);
      ``not_emulated`` names the loop primitives whose bodies ran unrounded. Memoised on ``(fn, precision, reorder,
      shapes, dtypes, x64)`` (a few dozen entries), so repeated checks of one function compile once.
    """
    if precision not in OPERAND_FORMAT:
        raise ValueError(f"at_precision: precision must be one of {sorted(OPERAND_FORMAT)}, got {precision!r}")
    leaves, treedef = jax.tree.flatten(example_args)
    key = (fn, precision, bool(reorder), treedef, tuple((np.shape(x), jnp.result_type(x)) for x in leaves),
           bool(jax.config.jax_enable_x64))
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = _build(fn, precision, reorder, *example_args)
    return _CACHE[key]


class Reordered:
    """``fn`` at a precision with every sum in a random order (:func:`at_precision` with ``reorder=True``).

    The orders come from the host: :meth:`orders` draws one permutation per reordered axis (``sizes``, in the order
    the contractions ask for them) from a NumPy generator seeded with the run's integer seed, and the compiled
    program takes them as arguments. ``emulated(seed, *args)`` is one run; :meth:`replicas` runs many, each with the
    same compiled program."""

    def __init__(self, closed, fmt, sizes: Sequence[int]):
        self.sizes = tuple(int(n) for n in sizes)

        def run(orders, *args):
            return _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), fmt, set(), _Orders(orders))

        self._one = cost.jit(run)

    def orders(self, seed) -> list[np.ndarray]:
        """The permutations of the run seeded with ``seed``, one per reordered axis."""
        rng = np.random.default_rng(int(seed))
        return [rng.permutation(n).astype(np.int32) for n in self.sizes]

    def __call__(self, seed, *args) -> list[Any]:
        return self._one(self.orders(seed), *args)

    def jaxpr(self, *args):
        """The program of one run at ``args``' shapes (the orders among its arguments), for inspection."""
        return self._one.trace(self.orders(0), *args).jaxpr

    def replicas(self, seeds: Sequence[int], points: Sequence[tuple]) -> list[np.ndarray]:
        """Runs at ``points[k]`` (each a tuple of ``fn``'s arguments) in the orders of ``seeds[k]``: per flat output,
        a float64 array ``[K, *shape]``. All runs are dispatched before the first result is read."""
        if len(points) == 0 or len(seeds) != len(points):
            raise ValueError(f"Reordered.replicas: {len(seeds)} seeds for {len(points)} points")
        runs = [self._one(self.orders(s), *p) for s, p in zip(seeds, points, strict=True)]
        return [np.stack([np.asarray(r[j], np.float64) for r in runs]) for j in range(len(runs[0]))]


def _build(fn, precision, reorder, *example_args):
    fmt = OPERAND_FORMAT[precision]
    closed = jax.make_jaxpr(fn)(*example_args)
    loops: set[str] = set()
    orders = _Orders() if reorder else None
    jax.make_jaxpr(lambda *a: _eval(closed.jaxpr, closed.consts, jax.tree.leaves(a), fmt, loops, orders))(
        *example_args)
    if reorder:
        return Reordered(closed, fmt, orders.sizes), loops

    @cost.jit
    def emulated(*args):
        return _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), fmt, set())

    return emulated, loops


def perturb(tree: Any, precision: str, rng: np.random.Generator) -> Any:
    """The same point moved by a few units in the last place of ``precision``: ``x (1 + 2 u_p xi)``, ``xi ~ N(0, 1)``,
    rounded back to each leaf's dtype (a bf16 leaf moves by whole bf16 ulps)."""
    return jax.tree.map(jax.device_put, perturb_host(tree, precision, rng))


def perturb_host(tree: Any, precision: str, rng: np.random.Generator) -> Any:
    """:func:`perturb` as NumPy arrays of each leaf's dtype (the same draws and values; nothing on a device)."""
    fmt = OPERAND_FORMAT[precision]
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for x in leaves:
        dt = jnp.result_type(x)
        mant = fmt[1] if fmt is not None else jnp.finfo(dt).nmant
        mant = min(mant, jnp.finfo(dt).nmant)
        u = 2.0 ** -(mant + 1)
        xi = rng.standard_normal(np.shape(x))
        moved = np.asarray(x, np.float64) * (1.0 + 2.0 * u * xi)
        out.append(moved.astype(dt))
    return jax.tree.unflatten(treedef, out)
