r"""Correct low-precision kernels and planted systematic bugs, to measure what the statistical verdict can see.

Each case is a hand-written ``jax.custom_vjp`` that computes as a tensor-core kernel does -- operands of every
product rounded to the precision (``lax.reduce_precision``), f32 accumulation, its own masks and softmax -- next to
the plain-JAX reference it must match:

* ``dense``: ``y = x W + b``; the planted leaf is ``W`` (``n_in x n_out`` entries).
* ``conv_relu``: ``y = relu(conv3x3(x, w) + b)``, SAME padding; the planted leaf is ``x`` (behind ReLU kinks).
* ``attention``: ``y = softmax(q k^T / sqrt(d)) v``; the planted leaf is ``q``. Leaves above 262,144 entries are
  multi-head, ``[heads, seq, 128]`` with ``heads = ceil(size / 131072)`` (10^6 entries: 8 heads of 976 queries), as
  such a leaf is in a transformer; one head of 7,812 queries would cost 15x the 262k cell's score matrix.
* ``long_sum``: ``y = x W`` with a batch of ``size`` rows, so every entry of ``dW`` is a ``size``-term sum; the
  planted leaf is ``W``.

:func:`leaf_errors` returns, for the planted leaf, what :func:`jaxgrad.verify.stats.leaf_statistics` judges: the
kernel's error against the float64 oracle, K rounding samples of the reference at the precision, the oracle, the
sum of |terms| and the kink term. A planted bug is then added to the kernel's gradient (a scale ``(1 + s)``, or an
error confined to the last 1% of the entries), so one set of samples serves every bug size.
``python -m jaxgrad.bench verify_detection_limits`` and ``verify_false_alarms`` use these.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxgrad.verify.emulate import OPERAND_FORMAT
from jaxgrad.verify.hypothesis import float64_oracle, sample_rounding
from jaxgrad.verify.magnitude import magnitudes
from jaxgrad.verify.precision import ErrorModel

__all__ = ["MIXED_PAIRS", "OPS", "Case", "LeafErrors", "leaf_errors", "make_case", "make_mixed_case"]

OPS = ("dense", "conv_relu", "attention", "long_sum")
_HI = lax.Precision.HIGHEST
_DN = ("NHWC", "HWIO", "NHWC")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: Callable  # the correct low-precision kernel (custom VJP)
    reference: Callable
    args: tuple
    leaf: int  # index of the planted argument

    @property
    def native(self) -> Callable:
        """The reference at the platform's default precision, as a user's jitted code runs it: on a GPU, f32 dots and
        convs in TF32 (XLA's default) and bf16 arrays in bf16 -- the hardware's own rounding, no emulation."""
        return functools.partial(self.reference, p=lax.Precision.DEFAULT)


def _rounder(precision: str) -> Callable:
    fmt = OPERAND_FORMAT[precision]
    return (lambda a: a) if fmt is None else (lambda a: lax.reduce_precision(a, *fmt))


@functools.lru_cache(maxsize=None)
def _dense(precision):
    r = _rounder(precision)

    def ref(x, w, b, p=_HI):
        return jnp.dot(x, w, precision=p) + b

    @jax.custom_vjp
    def f(x, w, b):
        return jnp.dot(r(x), r(w), precision=_HI) + b

    def fwd(x, w, b):
        return f(x, w, b), (x, w)

    def bwd(res, g):
        x, w = res
        # dW accumulated in two halves of the batch (another summation order than the reference's), in f32 as a
        # tensor core accumulates: partial sums stored in bf16 cancel catastrophically, and the verifier flags that
        h = x.shape[0] // 2
        f32 = jnp.float32
        dw = (jnp.dot(r(x[:h]).T, r(g[:h]), precision=_HI, preferred_element_type=f32)
              + jnp.dot(r(x[h:]).T, r(g[h:]), precision=_HI, preferred_element_type=f32)).astype(w.dtype)
        return jnp.dot(r(g), r(w).T, precision=_HI), dw, jnp.sum(r(g), axis=0)

    f.defvjp(fwd, bwd)
    return f, ref


@functools.lru_cache(maxsize=None)
def _conv_relu(precision):
    r = _rounder(precision)

    def conv(x, w, p=_HI):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=_DN, precision=p)

    def ref(x, w, b, p=_HI):
        return jax.nn.relu(conv(x, w, p) + b)

    @jax.custom_vjp
    def f(x, w, b):
        return jax.nn.relu(conv(r(x), r(w)) + b)

    def fwd(x, w, b):
        z = conv(r(x), r(w)) + b
        return jax.nn.relu(z), (x, w, z > 0)

    def bwd(res, g):
        x, w, mask = res
        gz = jnp.where(mask, g, 0.0)
        _, pb = jax.vjp(conv, r(x), r(w))
        dx, dw = pb(r(gz))
        return dx, dw, jnp.sum(r(gz), axis=(0, 1, 2))

    f.defvjp(fwd, bwd)
    return f, ref


@functools.lru_cache(maxsize=None)
def _attention(precision):
    r = _rounder(precision)

    # every product over the last two axes (a leading head axis is a batch): "...qd,...kd->...qk" etc.
    def mm(a, b, spec, p=_HI):
        return jnp.einsum(spec, a, b, precision=p)

    def ref(q, k, v, p=_HI):
        s = mm(q, k, "...qd,...kd->...qk", p) / math.sqrt(q.shape[-1])
        return mm(jax.nn.softmax(s, axis=-1), v, "...qk,...kd->...qd", p)

    def probs(q, k):
        return jax.nn.softmax(mm(r(q), r(k), "...qd,...kd->...qk") / math.sqrt(q.shape[-1]), axis=-1)

    @jax.custom_vjp
    def f(q, k, v):
        return mm(r(probs(q, k)), r(v), "...qk,...kd->...qd")

    def fwd(q, k, v):
        return f(q, k, v), (q, k, v)

    def bwd(res, g):
        q, k, v = res
        p = probs(q, k)  # recomputed, as a flash-attention backward does
        scale = 1 / math.sqrt(q.shape[-1])
        dv = mm(r(p), r(g), "...qk,...qd->...kd")
        dp = mm(r(g), r(v), "...qd,...kd->...qk")
        ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True))
        dq = mm(r(ds), r(k), "...qk,...kd->...qd") * scale
        dk = mm(r(ds), r(q), "...qk,...qd->...kd") * scale
        return dq, dk, dv

    f.defvjp(fwd, bwd)
    return f, ref


def make_case(op: str, size: int, precision: str, rng: np.random.Generator, dtype=jnp.float32) -> Case:
    """A correct ``precision`` kernel for ``op`` whose planted leaf has about ``size`` entries, on white noise."""
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    if op in ("dense", "long_sum"):
        f, ref = _dense(precision)
        if op == "dense":
            n_in = max(2, round(math.sqrt(size * 1.25)))
            n_out = max(2, size // n_in)
            args = (normal(16, n_in), normal(n_in, n_out) / math.sqrt(n_in), normal(n_out))
        else:
            args = (normal(size, 5), normal(5, 3), normal(3))
        return Case(op, f, ref, args, 1)
    if op == "conv_relu":
        f, ref = _conv_relu(precision)
        side = max(2, round(math.sqrt(size / 4)))
        return Case(op, f, ref, (normal(1, side, side + 1, 4), normal(3, 3, 4, 6) / 6.0, normal(6)), 0)
    if op == "attention":
        f, ref = _attention(precision)
        d = 8 if size <= 64 else 16 if size <= 1024 else 64 if size <= 16384 else 128
        heads = () if size <= 262144 else (-(-size // 131072),)  # module doc: large leaves are multi-head
        seq = max(2, size // (d * math.prod(heads)))
        return Case(op, f, ref, (normal(*heads, seq, d), normal(*heads, seq + 3, d), normal(*heads, seq + 3, d + 1)),
                    0)
    raise ValueError(f"make_case: op must be one of {OPS}, got {op!r}")


# Forward / backward precision pairs of the mixed cases: a backward that rounds more coarsely than its forward (or
# merely differently), as cuBLAS / cuDNN dgrad in bf16, a bf16 flash backward or a TF32 backward behind f32 do.
MIXED_PAIRS = (("f32", "bf16"), ("tf32", "bf16"), ("f32", "tf32"), ("bf16", "f16"))


def _native_product(precision: str, emulate: bool) -> Callable:
    """``(op, a, b) -> op(a, b, precision=...)`` as the hardware computes it at ``precision``, f32 in and out:
    ``f32`` at HIGHEST; ``tf32`` at the default precision (the GPU's TF32; with ``emulate``, operands rounded to TF32
    and products at HIGHEST, for a CPU); ``bf16`` / ``f16`` with operands cast to that dtype, f32 accumulation."""
    def product(op, a, b):
        if precision == "f32":
            return op(a, b, _HI)
        if precision == "tf32":
            if emulate:
                rnd = _rounder("tf32")
                return op(rnd(a), rnd(b), _HI)
            return op(a, b, lax.Precision.DEFAULT)
        dt = {"bf16": jnp.bfloat16, "f16": jnp.float16}[precision]
        return op(a.astype(dt), b.astype(dt), None, jnp.float32)
    return product


def _dense_op(x, w, p, out=None):
    return jnp.dot(x, w, precision=p, preferred_element_type=out)


def _conv_op(x, w, p, out=None):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=_DN, precision=p,
                                    preferred_element_type=out)


@functools.lru_cache(maxsize=None)
def _mixed(op: str, forward: str, backward: str, emulate: bool, scale: float = 1.0, leaf: int = 0):
    """A correct ``op`` (dense ``x W`` or a 3x3 SAME conv, no bias) whose forward computes at ``forward`` and whose
    backward is ``jax.vjp`` of the same op at ``backward`` with the cotangent in the backward's precision; ``scale``
    multiplies gradient ``leaf`` (a planted error when not 1)."""
    base = {"dense": _dense_op, "conv": _conv_op}[op]
    fprod, bprod = _native_product(forward, emulate), _native_product(backward, emulate)

    def ref(x, w, p=_HI):
        return base(x, w, p)

    @jax.custom_vjp
    def f(x, w):
        return fprod(base, x, w).astype(x.dtype)

    def fwd(x, w):
        return f(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        _, pb = jax.vjp(lambda a, b: bprod(base, a, b).astype(jnp.float32), x, w)
        grads = list(pb(g.astype(jnp.float32)))
        grads[leaf] = grads[leaf] * scale
        return tuple(gr.astype(a.dtype) for gr, a in zip(grads, res))

    f.defvjp(fwd, bwd)
    return f, ref


def make_mixed_case(op: str, forward: str, backward: str, size: int, rng: np.random.Generator, *,
                    emulate: bool = False, planted: float = 0.0, leaf: int = 0) -> Case:
    """A correct mixed-precision ``op`` ('dense' or 'conv', :data:`MIXED_PAIRS`) whose larger leaf has about ``size``
    entries, on white noise, f32 arrays; ``planted``: gradient ``leaf`` is ``(1 + planted)`` times too large."""
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    f, ref = _mixed(op, forward, backward, emulate, 1.0 + planted, leaf)
    if op == "dense":
        n_in = max(2, round(math.sqrt(size * 1.25)))
        args = (normal(max(2, size // n_in), n_in), normal(n_in, max(2, size // n_in + 3)) / math.sqrt(n_in))
    elif op == "conv":
        side = max(3, round(math.sqrt(size / 5)))
        args = (normal(1, side, side + 2, 5), normal(3, 3, 5, 7) / 6.0)
    else:
        raise ValueError(f"make_mixed_case: op must be 'dense' or 'conv', got {op!r}")
    return Case(f"{op}-{forward}-fwd-{backward}-bwd", f, ref, args, leaf)


@dataclasses.dataclass(frozen=True)
class LeafErrors:
    """What the statistical verdict sees of one leaf (see :func:`jaxgrad.verify.stats.leaf_statistics`)."""

    error: np.ndarray  # the kernel's gradient minus the float64 oracle
    gradient: np.ndarray  # the kernel's gradient
    replicas: np.ndarray  # [K, ...] rounding samples of the reference at the precision
    oracle: np.ndarray
    magnitude: np.ndarray  # sum of |terms|
    kink: np.ndarray | None


@functools.lru_cache(maxsize=None)
def _reference_vjp(reference):
    """One ``(args, ct) -> (outputs, gradients)`` function and its float64 oracle per reference, so repeated trials
    of a case compile once."""

    def fwd_and_vjp(a, c):
        out, pull = jax.vjp(reference, *a)
        return out, pull(c)

    return fwd_and_vjp, float64_oracle(fwd_and_vjp)


def leaf_errors(case: Case, precision: str, replicas: int, rng: np.random.Generator) -> LeafErrors:
    """Errors of ``case``'s planted leaf: the kernel's, and ``replicas`` samples of the modelled rounding."""
    y, pb = jax.vjp(case.fn, *case.args)
    ct = jnp.asarray(rng.standard_normal(y.shape), y.dtype)
    g = np.asarray(pb(ct)[case.leaf], np.float64)
    fwd_and_vjp, oracle = _reference_vjp(case.reference)
    samples = sample_rounding(fwd_and_vjp, case.args, ct, precision, replicas, rng, oracle)
    truth = oracle(case.args, ct)
    j = 1 + case.leaf  # flat outputs: the forward output, then the gradients
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        a64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), case.args)
        c64 = jnp.asarray(ct, jnp.float64)
        mags = magnitudes(fwd_and_vjp, a64, c64)
        kink = None
        if mags.rounded_comparisons:
            mk = magnitudes(fwd_and_vjp, a64, c64, kink_bound=ErrorModel(precision, 8.0, "").bound)
            kink = np.asarray(mk.kinks[j], np.float64) if mk.kink_counts[j] else None
    return LeafErrors(error=g - truth[j], gradient=g, replicas=samples.errors[j], oracle=truth[j],
                      magnitude=np.asarray(mags.magnitudes[j], np.float64), kink=kink)
