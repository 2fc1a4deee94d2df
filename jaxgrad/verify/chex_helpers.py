r"""Tolerance-aware tree comparisons for chex test suites: tolerances from the verifier's error model.

``chex.assert_trees_all_close(actual, expected, rtol=..., atol=...)`` needs one hand-picked tolerance for every
entry of every leaf. The right tolerance is neither relative nor absolute: it is the rounding bound of
:mod:`jaxgrad.verify.precision` times the sum of |terms| of that entry (:mod:`jaxgrad.verify.magnitude`), which is
large where terms cancel and small where they do not. :func:`assert_tree_matches_reference` computes it:

1. ``reference(*args)`` is evaluated in float64 at HIGHEST matmul precision (``args`` cast to float64: the same
   point, f32/bf16 values are exact in float64), together with the sum of |terms| :math:`M_i`, the accumulation
   length :math:`N` of every output leaf and the branch-flip term :math:`K_i` of any rounded comparison (not at
   ``"f64"``, where a branch flip needs operands within 1e-10 of each other);
2. each entry of ``actual`` must satisfy :math:`|a_i - r_i| \le C\,(u_{\text{op}} + u_{\text{acc}}\sqrt N)\,M_i +
   K_i` -- the per-entry gate of :func:`jaxgrad.verify.check_vjp`, with the same ``safety`` :math:`C`;
3. on failure the ``AssertionError`` names each failing leaf (its pytree path), its worst entry (index, actual,
   expected, error / sum|terms| against the bound) and how many entries exceed it.

The precision is that of the run that produced ``actual`` (``precision=``): by default the coarsest of its leaves'
and the floating ``args``' dtypes, coarsened to TF32 when a leaf lives on a GPU and JAX's default matmul precision
is in effect (every leaf float64: ``"f64"``, whose bound is :math:`\max(C\,2^{-53}(1+\sqrt N), 10^{-10})`). State it
when the kernel computes coarser than its arrays (``precision="bf16"`` for a bf16 kernel behind f32 arrays).

This is the per-entry gate only. :func:`jaxgrad.verify.check_vjp` adds what a single comparison cannot: the
statistical verdict at the adopted precision, the float64 re-run, finite differences, the adjoint identity and the
structural checks. Use this helper to compare trees (a jitted or device-placed variant of an op, a training step,
a gradient tree) and ``assert_vjp_matches`` to prove a VJP.

:func:`value_and_vjp` turns an op into one function of arrays, ``(args, cotangent) -> (output, gradients)``, to wrap
in a chex variant and to pass as the reference::

    f = self.variant(value_and_vjp(my_op))
    assert_tree_matches_reference(f(args, ct), value_and_vjp(my_op_reference), args, ct)
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.verify import precision as prec
from jaxgrad.verify.core import norm2
from jaxgrad.verify.magnitude import magnitudes

__all__ = ["LooseToleranceWarning", "ReferenceBounds", "assert_tree_matches_reference", "default_precision",
           "reference_bounds", "value_and_vjp"]


class LooseToleranceWarning(UserWarning):
    """A leaf's tolerance admits an error as large as the leaf itself (``bound * kappa >= 1``): the per-entry gate
    cannot fail there. Compare that leaf normwise as well."""


def value_and_vjp(fn: Callable[..., Any]) -> Callable[[tuple, Any], tuple[Any, tuple]]:
    """``(args, cotangent) -> (fn(*args), vjp of fn at args applied to cotangent)``: one function of arrays (jit-,
    device- and variant-friendly); close over non-array arguments with ``functools.partial``."""

    def f(args, cotangent):
        y, pullback = jax.vjp(fn, *args)
        return y, pullback(cotangent)

    f.__name__ = f"value_and_vjp({getattr(fn, '__name__', 'fn')})"
    return f


def _floating(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _on_gpu(x) -> bool:
    try:
        return any(d.platform == "gpu" for d in x.devices())
    except Exception:  # numpy arrays (host); tracers have no devices
        return False


def default_precision(actual: Any, *args: Any) -> str:
    """The precision a run that produced ``actual`` from ``args`` is judged at (module doc)."""
    leaves = [x for x in jax.tree.leaves((actual, args)) if _floating(x)]
    names = {prec.dtype_precision(jnp.result_type(x)) for x in leaves}
    if not names or names == {"f64"}:
        return "f64"
    p = max(names - {"f64"}, key=lambda n: prec.UNIT_ROUNDOFF[n])
    setting = jax.config.jax_default_matmul_precision
    if any(_on_gpu(x) for x in jax.tree.leaves(actual)) and \
            setting in (None, "default", "bfloat16", "tensorfloat32", "fastest") and \
            prec.UNIT_ROUNDOFF["tf32"] > prec.UNIT_ROUNDOFF[p]:
        p = "tf32"
    return p


@dataclasses.dataclass(frozen=True)
class ReferenceBounds:
    """The float64 reference of a tree and the per-entry tolerance of each leaf under one error model.

    ``expected`` and ``tolerance`` have the reference's tree structure (float64 NumPy leaves); ``tolerance`` is
    ``model.bound(N_leaf) * sum|terms| + K`` per entry. ``kappa[j]``: ``||sum|terms| || / ||expected||`` of leaf
    ``j``, the normwise condition number; a large value means the per-entry tolerance is loose there (terms
    cancel, or the magnitude model overestimates through a long nonlinear chain). Where ``bound(N) * kappa >= 1``
    the tolerance admits an error as large as the leaf: :meth:`loose_leaves` lists those, and
    :func:`reference_bounds` warns (:class:`LooseToleranceWarning`)."""

    expected: Any
    tolerance: Any
    model: prec.ErrorModel
    terms: tuple[int, ...]
    kappa: tuple[float, ...]
    approximated: tuple[str, ...]  # primitives where sum|terms| is the generic fallback (magnitude.py)

    def loose_leaves(self) -> list[tuple[str, float]]:
        """``(leaf path, bound(N) * kappa)`` of each leaf whose tolerance is normwise at least the leaf itself."""
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.expected)[0]]
        return [(p, self.model.bound(n) * k) for p, n, k in zip(paths, self.terms, self.kappa, strict=True)
                if self.model.bound(n) * k >= 1]

    def errors(self, actual: Any) -> list[tuple[str, float]]:
        """``(leaf path, max_i |a_i - r_i| / tolerance_i)`` per leaf: <= 1 passes (inf for non-finite entries)."""
        out = []
        for path, a, r, t in self._leaves(actual):
            out.append((path, float(np.max(self._ratio(a, r, t), initial=0.0))))
        return out

    def assert_close(self, actual: Any, name: str | None = None) -> None:
        """Raise ``AssertionError`` naming every leaf of ``actual`` outside its tolerance (module doc)."""
        failures = []
        for (path, a, r, t), n in zip(self._leaves(actual), self.terms, strict=True):
            ratio = self._ratio(a, r, t)
            bad = int(np.count_nonzero(ratio > 1))
            if not bad:
                continue
            i = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.ndim else ()
            m = float(t[i] / self.model.bound(n)) if np.ndim(t) else float(t / self.model.bound(n))
            err = float(np.abs(a[i] - r[i])) if np.isfinite(a[i]) else float("inf")
            failures.append(
                f"  {path or '<root>'} {tuple(np.shape(a))}: {bad}/{max(np.size(a), 1)} entries outside; worst at "
                f"{tuple(int(j) for j in i)}: actual {float(a[i]):.9g}, expected {float(r[i]):.9g}, |error| "
                f"{err:.3g} = {err / m if m > 0 else float('inf'):.3g} x sum|terms| ({m:.3g}) against the bound "
                f"{self.model.bound(n):.3g} = {self.model.formula()} at N={n} ({float(ratio[i]):.3g}x the tolerance)")
        if failures:
            head = f"{name}: " if name else ""
            raise AssertionError(f"{head}tree differs from the float64 reference beyond {self.model.precision} "
                                 f"rounding (safety {self.model.safety:g}):\n" + "\n".join(failures))

    # -- internals
    def _leaves(self, actual):
        exp_paths, exp_def = jax.tree_util.tree_flatten_with_path(self.expected)
        act_leaves, act_def = jax.tree.flatten(actual)
        if act_def != exp_def:
            raise AssertionError(f"tree structures differ: actual {act_def}, reference {exp_def}")
        tol = jax.tree.leaves(self.tolerance)
        out = []
        for (path, r), a, t in zip(exp_paths, act_leaves, tol, strict=True):
            a = np.asarray(a)
            if a.shape != r.shape:
                raise AssertionError(f"leaf {jax.tree_util.keystr(path)}: actual shape {a.shape}, reference shape "
                                     f"{r.shape}")
            out.append((jax.tree_util.keystr(path), a.astype(np.float64), r, t))
        return out

    @staticmethod
    def _ratio(a, r, t):
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.abs(a - r)
            ratio = np.where(d == 0, 0.0, d / np.maximum(t, 1e-300))
        return np.where(np.isfinite(a), ratio, np.inf)


def reference_bounds(reference: Callable[..., Any], *args: Any, precision: str = "f64",
                     safety: float = 8.0) -> ReferenceBounds:
    """``reference(*args)`` in float64 with the per-entry tolerance of a run at ``precision`` (module doc).

    Compute once, compare many trees (``bounds.assert_close(actual)``): e.g. every chex variant of one op."""
    if precision not in prec.UNIT_ROUNDOFF:
        raise ValueError(f"reference_bounds: precision must be one of {sorted(prec.UNIT_ROUNDOFF)}, "
                         f"got {precision!r}")
    model = prec.ErrorModel(precision, safety, "reference_bounds")

    def f(*a):
        return reference(*a)

    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        args64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64) if _floating(x) else x, args)
        out_def = jax.tree.structure(jax.eval_shape(f, *args64))
        # Branch flips need operands within the run's rounding of each other: at f64 (radius 1e-10 at most) they
        # do not happen on test data, and tracking them costs half again the interpretation: skipped there.
        mags = magnitudes(f, *args64, kink_bound=None if precision == "f64" else model.bound)
    values = [np.asarray(v, np.float64) for v in mags.values]
    kinks = mags.kinks if mags.kinks is not None else [0.0] * len(values)
    tol, kappa = [], []
    for v, m, n, k in zip(values, mags.magnitudes, mags.terms, kinks, strict=True):
        m = np.asarray(m, np.float64)
        tol.append(model.bound(n) * m + np.asarray(k, np.float64))
        vn = norm2(v)
        kappa.append(norm2(m) / vn if vn > 0 else float("inf"))
    bounds = ReferenceBounds(expected=jax.tree.unflatten(out_def, values),
                             tolerance=jax.tree.unflatten(out_def, tol), model=model,
                             terms=tuple(int(n) for n in mags.terms), kappa=tuple(kappa),
                             approximated=mags.approximated)
    loose = bounds.loose_leaves()
    if loose:
        warnings.warn(f"{len(loose)} leaves of {getattr(reference, '__name__', 'reference')} have a tolerance at "
                      f"least as large as the leaf ({loose[0][0]}: {loose[0][1]:.1e}x its norm): sum|terms| is far "
                      "above the values there, so the per-entry gate cannot fail; compare them normwise as well",
                      LooseToleranceWarning, stacklevel=2)
    return bounds


def assert_tree_matches_reference(actual: Any, reference: Callable[..., Any], *args: Any,
                                  precision: str | None = None, safety: float = 8.0,
                                  name: str | None = None) -> ReferenceBounds:
    """Assert that the pytree ``actual`` equals ``reference(*args)`` to the rounding of the run that produced it.

    Args:
      actual: a pytree of arrays (e.g. ``(y, grads)`` of a jitted op) with ``reference(*args)``'s structure.
      reference: plain JAX computing the exact quantity (``value_and_vjp(ref)``, ``jax.grad(loss_ref)``, ...).
      *args: the point; floating leaves are cast to float64, other leaves (masks, indices) pass unchanged.
      precision: the compute precision of ``actual`` ("f64", "f32", "tf32", "f16", "bf16"); default
        :func:`default_precision`.
      safety: the constant ``C`` of the rounding model (as in ``check_vjp``).
      name: prefix of the failure message.

    Returns:
      The :class:`ReferenceBounds` used (expected values, tolerances, per-leaf ``kappa``).

    Raises:
      AssertionError: a leaf's structure, shape or any entry differs beyond its tolerance (message: module doc).
    """
    bounds = reference_bounds(reference, *args, precision=precision or default_precision(actual, *args),
                              safety=safety)
    bounds.assert_close(actual, name=name)
    return bounds
