r"""How large is rounding error in the denoiser's gradients, and what does a layout bug look like next to it?

The question (a cryo-EM group's report): a hand-written cuDNN CNN ``1 -> 16 -> 16 -> 1`` (3x3, ReLU, MSE,
``2 x 1 x 1024 x 1024``) had weight gradients off by 25-175 % against PyTorch, blamed on "float32 accumulation
error over 2M terms". :func:`precision_study` measures, per layer, the error of the loss, the bias gradients and
the weight gradients of :mod:`jaxgrad.cnn.denoiser` against a float64 reference, for exact f32
(``precision="highest"``) and JAX's default precision (TF32 for f32 convolutions on NVIDIA GPUs, exact f32 on the
CPU), at several image sizes; and the same errors for planted layout bugs applied to the f32 weight gradient.

What is compared
----------------
* **Reference**: ``jax.value_and_grad`` of a *plain-JAX* network in float64 at ``Precision.HIGHEST``, at exactly
  the f32 parameters and images (f32 values are exact in f64): ``oracle="conv"`` (default) is
  ``lax.conv_general_dilated`` + bias + ReLU differentiated by JAX's own transpose rules, ``oracle="einsum"`` the
  package's ``backend="reference"`` (one ``einsum`` per kernel tap, no convolution primitive); neither shares code
  with the hand-written VJP under test. The float64 run is on the default device (the GPU if any). It runs through
  :func:`jaxgrad.verify.magnitudes`, which returns alongside every value its sum of |terms| :math:`M_i` (first-order
  running error analysis through the whole network: the VJPs, the ReLU masks, the MSE).
* **Under test**: ``jax.value_and_grad(denoiser.mse_loss)`` in float32 with the hand-written conv2d VJP
  (``backend="xla"``: cuDNN on the GPU) at each precision.

Per layer and parameter (``w`` [3, 3, Cin, Cout], ``b`` [Cout]) and for the loss:

* ``rel_err`` = :math:`\|g - g_{64}\| / \|g_{64}\|` (normwise), ``max_abs_ratio`` = :math:`\max|g - g_{64}| /
  \max|g_{64}|` (the cryo-EM group's kind of number), ``cosine``;
* ``normalized_err`` = :math:`\max_i |g_i - g_{64,i}| / M_i` and ``normalized_units`` = that divided by the unit
  roundoff :math:`u` of the precision in effect (:math:`2^{-24}` f32, :math:`2^{-11}` TF32): rounding stays below
  O(1-100) units whatever the condition of the entry (measured on the CPU: < 0.01 units, the first-order sum of
  |terms| through the whole network being a loose scale); ``bound`` = the verifier's rounding bound
  :math:`8(u + 2^{-24}\sqrt N)` for that entry's accumulation length :math:`N`. With white-noise residuals the
  gradients are cancelling sums (``kappa`` = :math:`\|M\|/\|g_{64}\|` of 1e3-1e5), so a bug's error divided by
  :math:`M_i` can fall below that bound at large N: judge bugs by ``rel_err`` and by the ratio to the measured
  rounding (``w_rel_over_<precision>``).

The "float32 accumulation over 2M terms" hypothesis predicts :math:`\sqrt{N}\,u_{f32}` with :math:`N = B H W` (each
weight-gradient entry and each bias-gradient entry is a sum over all :math:`B H W` pixels): ``sqrtN_u_f32`` in every
row. The bias gradient is the control: it sums the *same* cotangent over the *same* :math:`N` pixels as the weight
gradient, without pairing it with the input.

Bugs (``kind="bug"`` rows) are applied to the finest f32 weight gradient measured: ``flip`` (both spatial axes,
convolution vs cross-correlation), ``transpose`` (kh <-> kw, row- vs column-major), ``swap-io`` (Cin <-> Cout, 16->16
layer only: OIHW read as IOHW) and ``shift`` (the kernel gradient rolled by one pixel along kh: a padding offset).

Use :func:`format_table` and :func:`verdict` for a report, :func:`verifier_demo` for ``check_vjp``'s verdict on one
conv layer with and without a planted flip. ``scripts/cnn_precision.py`` runs it all and writes JSON.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.cnn import denoiser
from jaxgrad.cnn.conv import conv2d, conv2d_reference
from jaxgrad.verify import check_vjp, magnitudes
from jaxgrad.verify import precision as vprec

__all__ = ["BUGS", "ORACLES", "PRECISIONS", "effective_precision", "format_table", "growth_exponents",
           "precision_study", "verdict", "verifier_demo"]

PRECISIONS = {"highest": jax.lax.Precision.HIGHEST, "default": None}
BUGS = ("flip", "transpose", "swap-io", "shift")
BUG_TEXT = {
    "flip": "kernel flipped in kh and kw (convolution vs cross-correlation)",
    "transpose": "kh <-> kw transposed (row- vs column-major)",
    "swap-io": "Cin <-> Cout swapped (OIHW read as IOHW; 16->16 layer)",
    "shift": "rolled by one pixel along kh (padding offset)",
}
SAFETY = 8.0  # the verifier's C
_U = vprec.UNIT_ROUNDOFF


# ---------------------------------------------------------------------------------------------------------------
# Precision bookkeeping
# ---------------------------------------------------------------------------------------------------------------
def effective_precision(precision: str) -> tuple[str, str]:
    """(``"f32"`` or ``"tf32"``, why) for f32 convolutions run with ``precision`` on the current default device.

    ``"highest"`` is exact f32 everywhere; ``"default"`` is what :func:`jaxgrad.verify.precision.platform_precision`
    says (TF32 on NVIDIA GPUs unless ``jax_default_matmul_precision`` asks for more). Read outside any
    ``default_matmul_precision`` context.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision_study: precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if precision == "highest":
        return "f32", "precision=HIGHEST: exact f32 products, f32 accumulation"
    return vprec.platform_precision()


def _bound(eff: str, n_terms: int) -> float:
    return vprec.ErrorModel(eff, SAFETY, "").bound(n_terms)


# ---------------------------------------------------------------------------------------------------------------
# The network, its data, the two computations
# ---------------------------------------------------------------------------------------------------------------
def _data(size: int, batch: int, seed: int, cfg: denoiser.DenoiserConfig):
    """White-noise images and an independent white-noise target, f32 (NumPy streams: no compile per shape)."""
    rng = np.random.default_rng([seed, size, batch])
    shape = (batch, size, size, cfg.channels[0])
    x = rng.standard_normal(shape).astype(np.float32)
    t = rng.standard_normal((batch, size, size, cfg.channels[-1])).astype(np.float32)
    return x, t


ORACLES = ("conv", "einsum")


def _loss64(params, x, t, oracle: str = "conv"):
    """The MSE of a plain-JAX network (none of the code under test), in the arguments' dtype.

    ``oracle="conv"``: ``lax.conv_general_dilated`` differentiated by JAX; ``"einsum"``: ``denoiser.apply`` with
    ``backend="reference"`` (one einsum per tap, no convolution primitive at all; ~2x slower to compile).
    """
    if oracle == "conv":
        y = denoiser.apply_lax(params, x, precision=jax.lax.Precision.HIGHEST)
    else:
        y = denoiser.apply(params, x, backend="reference", precision=jax.lax.Precision.HIGHEST)
    return jnp.mean(jnp.square(y - t))


@functools.lru_cache(maxsize=None)
def _f32_value_and_grad(precision: str, backend: str):
    prec = PRECISIONS[precision]
    return jax.jit(jax.value_and_grad(
        lambda p, x, t: denoiser.mse_loss(p, x, t, backend=backend, precision=prec)))


def _to64(tree, device):
    return jax.device_put(jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float64), tree), device)


def _reference(params, x, t, device, oracle):
    """float64 loss and gradients with their sums of |terms| and accumulation lengths, on ``device``."""
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        p64, x64, t64 = _to64((params, x, t), device)
        res = magnitudes(jax.value_and_grad(functools.partial(_loss64, oracle=oracle)), p64, x64, t64)
        jax.block_until_ready(res.values)
        tree = jax.tree.structure((0.0, params))
        vals = jax.tree.unflatten(tree, [np.asarray(v, np.float64) for v in res.values])
        mags = jax.tree.unflatten(tree, [np.asarray(m, np.float64) for m in res.magnitudes])
        terms = jax.tree.unflatten(tree, list(res.terms))
    return vals, mags, terms, res.approximated


def _time_f64(params, x, t, device, oracle) -> tuple[float, float]:
    """Wall time of the plain float64 loss + gradients (no magnitudes): first call (compiles) and second call."""
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        args = _to64((params, x, t), device)
        fn = jax.jit(jax.value_and_grad(functools.partial(_loss64, oracle=oracle)))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        t1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return t1, time.perf_counter() - t0


def _compare(g, r, m, eff: str, n_terms: int) -> dict[str, float]:
    """Normwise, max-abs and per-entry normalised errors of ``g`` against the float64 ``r`` with sum|terms| ``m``."""
    g, r, m = (np.asarray(a, np.float64) for a in (g, r, m))
    d = g - r
    rn, gn = float(np.linalg.norm(r)), float(np.linalg.norm(g))
    maxr = float(np.max(np.abs(r), initial=0.0))
    tiny = 1e-300 + 1e-30 * float(np.max(m, initial=0.0))
    ne = float(np.max(np.abs(d) / (m + tiny), initial=0.0))
    return {
        "rel_err": float(np.linalg.norm(d)) / rn if rn > 0 else math.inf,
        "max_abs_ratio": float(np.max(np.abs(d), initial=0.0)) / maxr if maxr > 0 else math.inf,
        "cosine": float(np.vdot(g.ravel(), r.ravel())) / (gn * rn) if gn > 0 and rn > 0 else 0.0,
        "normalized_err": ne,
        "normalized_units": ne / _U[eff],
        "bound": _bound(eff, n_terms),
        "n_terms_model": int(n_terms),
        "kappa": float(np.linalg.norm(m)) / rn if rn > 0 else math.inf,
    }


def _plant(bug: str, g: np.ndarray) -> np.ndarray | None:
    """The weight gradient ``g`` [kh, kw, Cin, Cout] as a layout bug would return it (None: not applicable)."""
    if bug == "flip":
        return g[::-1, ::-1]
    if bug == "transpose":
        return np.swapaxes(g, 0, 1)
    if bug == "swap-io":
        return np.swapaxes(g, 2, 3) if g.shape[2] == g.shape[3] and g.shape[2] > 1 else None
    if bug == "shift":
        return np.roll(g, 1, axis=0)
    raise ValueError(f"unknown bug {bug!r}; one of {BUGS}")


def _prefixed(prefix: str, d: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}_{k}": v for k, v in d.items()}


# ---------------------------------------------------------------------------------------------------------------
# The study
# ---------------------------------------------------------------------------------------------------------------
def precision_study(sizes: Iterable[int], *, seed: int = 0, batch: int = 2,
                    precisions: Sequence[str] = ("highest", "default"), backend: str = "xla", bugs: bool = True,
                    cfg: denoiser.DenoiserConfig = denoiser.DenoiserConfig(), oracle: str = "conv",
                    reference_device: Any = None, time_reference: bool = False,
                    progress: Callable[[str], Any] | None = None) -> list[dict[str, Any]]:
    """Errors of the denoiser's loss and gradients against float64, per size, precision and layer.

    Args:
      sizes: square image sizes (e.g. ``(64, 128, 256, 512, 1024)``); images are ``batch x size x size x C_in``.
      seed: seeds the parameters (``denoiser.init(jax.random.key(seed))``, the same for every size) and the data
        (white-noise input, independent white-noise target).
      batch: images per batch (the cryo-EM case: 2).
      precisions: any of ``"highest"`` (exact f32) and ``"default"`` (JAX's default: TF32 on the GPU).
      backend: the conv2d backend under test, ``"xla"`` or ``"pallas"``.
      bugs: also return the planted-bug rows.
      cfg: the network (default the seed's ``1 -> 16 -> 16 -> 1``, 3x3).
      oracle: the float64 reference network, ``"conv"`` (``lax.conv_general_dilated`` differentiated by JAX) or
        ``"einsum"`` (one einsum per tap, the package's ``backend="reference"``).
      reference_device: where the float64 reference runs: a ``jax.Device``, a platform name (``"cpu"``) or None
        (default: JAX's default device, i.e. the GPU if any; falls back to the CPU if it fails there).
      time_reference: also time a plain jitted float64 loss + gradients (without the magnitudes), twice.
      progress: optional callable taking a string (e.g. ``print``) for progress lines.

    Returns:
      A list of plain dicts (JSON-ready), each with ``kind``, ``size``, ``batch``, ``n_terms`` (= B H W, the pixels
      every weight- and bias-gradient entry sums over), ``device``, ``platform``, ``precision`` and
      ``effective_precision``:

      * ``kind="rounding"``: one per (size, precision, layer), fields ``loss_*``, ``w_*``, ``b_*``: ``rel_err``,
        ``max_abs_ratio``, ``cosine``, ``normalized_err``, ``normalized_units``, ``bound``, ``kappa``;
      * ``kind="bug"``: one per (size, bug, layer): the ``w_*`` fields of the bugged gradient, ``flagged`` (above
        the verifier's bound), ``w_rel_over_<precision>`` and ``w_normalized_over_<precision>`` (the bug's error
        divided by the rounding error measured for the same layer and size at that precision);
      * ``kind="timing"``: per size, wall times of the float64 reference and of each f32 run.
    """
    sizes = [int(s) for s in sizes]
    if not sizes or any(s < 3 for s in sizes):
        raise ValueError(f"precision_study: sizes must be ints >= 3, got {sizes}")
    precisions = list(dict.fromkeys(precisions))
    if not precisions:
        raise ValueError("precision_study: give at least one precision")
    effs = {p: effective_precision(p) for p in precisions}  # raises on an unknown name; read outside contexts
    if backend not in ("xla", "pallas"):
        raise ValueError(f"precision_study: backend must be 'xla' or 'pallas', got {backend!r}")
    if oracle not in ORACLES:
        raise ValueError(f"precision_study: oracle must be one of {ORACLES}, got {oracle!r}")
    dev = jax.devices()[0]
    ref_dev = jax.devices(reference_device)[0] if isinstance(reference_device, str) else (reference_device or dev)
    common = {"device": dev.device_kind, "platform": dev.platform, "backend": backend, "batch": batch,
              "seed": seed, "oracle": oracle}
    say = progress or (lambda s: None)

    params = denoiser.init(jax.random.key(seed), cfg)
    names = denoiser.layer_names(params)
    finest = "highest" if "highest" in precisions else precisions[0]
    rows: list[dict[str, Any]] = []
    for size in sizes:
        x, t = _data(size, batch, seed, cfg)
        n_pix = batch * size * size
        base = dict(common, size=size, n_terms=n_pix, sqrtN_u_f32=math.sqrt(n_pix) * _U["f32"])

        t0 = time.perf_counter()
        try:
            (loss64, g64), (m_loss, m_g), (n_loss, n_g), approx = _reference(params, x, t, ref_dev, oracle)
        except Exception as e:  # noqa: BLE001 - e.g. no float64 convolution on this device: use the host CPU
            if ref_dev.platform == "cpu":
                raise
            say(f"size {size}^2: float64 reference failed on {ref_dev} ({type(e).__name__}: {e}); using the CPU")
            ref_dev = jax.devices("cpu")[0]
            t0 = time.perf_counter()
            (loss64, g64), (m_loss, m_g), (n_loss, n_g), approx = _reference(params, x, t, ref_dev, oracle)
        t_ref = time.perf_counter() - t0
        rows.append(dict(base, kind="timing", what="f64 reference + sum|terms| (magnitudes)", precision="f64",
                         effective_precision="f64", reference_device=str(ref_dev), first_call_s=t_ref,
                         second_call_s=None, magnitude_notes=list(approx)))
        say(f"size {size}^2: float64 reference with sum|terms| {t_ref:.1f} s (compilation included)")
        if time_reference:
            t1, t2 = _time_f64(params, x, t, ref_dev, oracle)
            rows.append(dict(base, kind="timing", what=f"f64 loss + grads ({oracle} oracle)", precision="f64",
                             effective_precision="f64", reference_device=str(ref_dev), first_call_s=t1,
                             second_call_s=t2))
            say(f"size {size}^2: plain float64 loss + grads {t1:.1f} s first call, {t2 * 1e3:.1f} ms second")

        grads32: dict[str, Any] = {}
        by_layer: dict[tuple[str, int], dict[str, float]] = {}
        for p in precisions:
            eff, why = effs[p]
            fn = _f32_value_and_grad(p, backend)
            xs, ts = jnp.asarray(x), jnp.asarray(t)
            t0 = time.perf_counter()
            loss32, g32 = jax.block_until_ready(fn(params, xs, ts))
            t1 = time.perf_counter() - t0
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, xs, ts))
            t2 = time.perf_counter() - t0
            grads32[p] = g32
            rows.append(dict(base, kind="timing", what=f"f32 loss + grads ({backend})", precision=p,
                             effective_precision=eff, first_call_s=t1, second_call_s=t2))
            loss_cmp = _compare(loss32, loss64, m_loss, eff, n_loss)
            for li, name in enumerate(names):
                w = _compare(g32[li]["w"], g64[li]["w"], m_g[li]["w"], eff, n_g[li]["w"])
                b = _compare(g32[li]["b"], g64[li]["b"], m_g[li]["b"], eff, n_g[li]["b"])
                by_layer[(p, li)] = w
                rows.append(dict(base, kind="rounding", precision=p, effective_precision=eff,
                                 precision_source=why, u=_U[eff], layer=name, layer_index=li,
                                 loss=float(loss32), loss64=float(loss64), **_prefixed("loss", loss_cmp),
                                 w_shape=list(np.shape(g64[li]["w"])), **_prefixed("w", w),
                                 b_shape=list(np.shape(g64[li]["b"])), **_prefixed("b", b)))
            say(f"size {size}^2: f32 {p} ({eff}) {t1:.1f} s first call, {t2 * 1e3:.1f} ms second")

        if bugs:
            eff = effs[finest][0]
            for bug in BUGS:
                for li, name in enumerate(names):
                    gb = _plant(bug, np.asarray(grads32[finest][li]["w"], np.float64))
                    if gb is None:
                        continue
                    w = _compare(gb, g64[li]["w"], m_g[li]["w"], eff, n_g[li]["w"])
                    ratios = {}
                    for p in precisions:
                        rw = by_layer[(p, li)]
                        ratios[f"w_rel_over_{p}"] = w["rel_err"] / max(rw["rel_err"], 1e-300)
                        ratios[f"w_normalized_over_{p}"] = w["normalized_err"] / max(rw["normalized_err"], 1e-300)
                    rows.append(dict(base, kind="bug", bug=bug, bug_text=BUG_TEXT[bug], precision=finest,
                                     effective_precision=eff, u=_U[eff], layer=name, layer_index=li,
                                     flagged=bool(w["normalized_err"] > w["bound"]), **_prefixed("w", w), **ratios))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# check_vjp on one conv layer: correct VJP vs a planted flip
# ---------------------------------------------------------------------------------------------------------------
def _conv_flipped_dw(**options):
    """conv2d whose backward returns the weight gradient flipped in both spatial axes (the planted bug)."""

    def f(x, w, b):
        return conv2d(x, w, b, **options)

    @jax.custom_vjp
    def conv2d_flipped_dw(x, w, b):
        return f(x, w, b)

    def fwd(x, w, b):
        return jax.vjp(f, x, w, b)  # (y, pullback): the pullback is a pytree residual

    def bwd(pullback, g):
        dx, dw, db = pullback(g)
        return dx, dw[::-1, ::-1], db  # BUG: kernel gradient rotated by 180 degrees

    conv2d_flipped_dw.defvjp(fwd, bwd)
    return conv2d_flipped_dw


def verifier_demo(*, seed: int = 0, shape: tuple[int, int, int] = (2, 12, 10), layer: int = 1,
                  backend: str = "xla", fd: bool = False) -> list[dict[str, Any]]:
    """``check_vjp`` on one layer of the seed network (its weights, white-noise input of ``shape`` = (N, H, W)).

    Two cases: the package's conv2d (ReLU fused, ``backend``) and the same op wrapped in a custom VJP whose backward
    flips the weight gradient. Returns one dict per case: ``passed``, the weight leaf's errors, bound and diagnosis,
    and the full report text (``report``).
    """
    params = denoiser.init(jax.random.key(seed))
    w, b = params[layer]["w"], params[layer]["b"]
    rng = np.random.default_rng([seed, 7])
    x = jnp.asarray(rng.standard_normal((*shape, w.shape[2])), jnp.float32)
    options = {"activation": "relu", "backend": backend}

    def conv2d_layer(x, w, b):
        return conv2d(x, w, b, **options)

    def reference(x, w, b):
        return conv2d_reference(x, w, b, activation="relu")

    out = []
    for case, fn in (("correct", conv2d_layer), ("planted flip of dW", _conv_flipped_dw(**options))):
        rep = check_vjp(fn, reference, x, w, b, seed=seed, fd=fd, arg_names=("x", "w", "b"),
                        name=f"conv2d layer {layer + 1} [{backend}] ({case}) vs conv2d_reference")
        lw = rep.as_called("w")
        out.append({"kind": "verifier", "case": case, "passed": rep.passed, "precision": lw.run,
                    "w_rel_err": lw.rel_err, "w_normalized_err": lw.normalized_err, "w_bound": lw.bound,
                    "w_normalized_units": lw.normalized_err / _U[lw.run],
                    "w_diagnosis": lw.diagnosis_kind, "w_diagnosis_message": lw.diagnosis.message
                    if lw.diagnosis else None, "x_shape": list(x.shape), "w_shape": list(w.shape),
                    "device": jax.devices()[0].device_kind, "report": str(rep)})
    return out


# ---------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *[fmt(r) for r in rows]])


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rounding table, the bug table, the growth fits, the timings and the verifier rows, as text."""
    out = []
    rnd = [r for r in rows if r.get("kind") == "rounding"]
    if rnd:
        out.append("Rounding: f32 loss and gradients vs float64. rel = ||g - g64|| / ||g64||; "
                   "units = max_i |g_i - g64_i| / sum|terms_i| / u (u = 2^-24 f32, 2^-11 tf32)")
        out.append(_table(
            ["size", "precision", "layer", "loss rel", "b rel", "w rel", "w max|d|/max|g|", "w units", "b units",
             "sqrt(N) u_f32"],
            [[f"{r['size']}^2", f"{r['precision']} ({r['effective_precision']})", r["layer"],
              f"{r['loss_rel_err']:.1e}", f"{r['b_rel_err']:.1e}", f"{r['w_rel_err']:.1e}",
              f"{r['w_max_abs_ratio']:.1e}", f"{r['w_normalized_units']:.2g}", f"{r['b_normalized_units']:.2g}",
              f"{r['sqrtN_u_f32']:.1e}"] for r in rnd]))
        slopes = growth_exponents(rnd)
        if any(not math.isnan(v) for v in slopes.values()):
            out.append("")
            out.append("Growth of the weight-gradient rel. error with N = B*H*W (least-squares exponent a in N^a; "
                       "sqrt(N) accumulation is a = 0.5, a real bug a ~ 0)")
            out.append(_table(["precision", "layer", "exponent"],
                              [[p, ln, f"{v:.2f}"] for (p, ln), v in slopes.items()]))
    bug = [r for r in rows if r.get("kind") == "bug"]
    if bug:
        precs = [k[len("w_rel_over_"):] for k in bug[0] if k.startswith("w_rel_over_")]
        out.append("")
        out.append(f"Planted layout bugs applied to the f32 ({bug[0]['precision']}) weight gradient, same scale; "
                   "'x <prec>' = bug rel. error / rounding rel. error of the same layer and size")
        out.append(_table(
            ["size", "bug", "layer", "w rel", "w max|d|/max|g|", "cosine", "w err/sum|t|",
             *[f"x {p}" for p in precs], "x bound"],
            [[f"{r['size']}^2", r["bug"], r["layer"], f"{r['w_rel_err']:.2f}", f"{r['w_max_abs_ratio']:.2f}",
              f"{r['w_cosine']:.3f}", f"{r['w_normalized_err']:.1e}",
              *[f"{r['w_rel_over_' + p]:.1e}" for p in precs], f"{r['w_normalized_err'] / r['w_bound']:.2g}"]
             for r in bug]))
    tim = [r for r in rows if r.get("kind") == "timing"]
    if tim:
        out.append("")
        out.append("Wall times (s); the first call includes compilation")
        out.append(_table(["size", "what", "precision", "first call", "second call"],
                          [[f"{r['size']}^2", r["what"], r["precision"], f"{r['first_call_s']:.2f}",
                            "-" if r["second_call_s"] is None else f"{r['second_call_s']:.4f}"] for r in tim]))
    ver = [r for r in rows if r.get("kind") == "verifier"]
    if ver:
        out.append("")
        out.append("check_vjp on one conv layer")
        out.append(_table(["case", "verdict", "w rel", "w err/sum|t|", "bound", "diagnosis"],
                          [[r["case"], "PASS" if r["passed"] else "FAIL", f"{r['w_rel_err']:.1e}",
                            f"{r['w_normalized_err']:.1e}", f"{r['w_bound']:.1e}",
                            r["w_diagnosis_message"] or "-"] for r in ver]))
    return "\n".join(out)


def growth_exponents(rows: Sequence[dict[str, Any]], field: str = "w_rel_err") -> dict[tuple[str, str], float]:
    """Least-squares slope of log(``field``) against log(N) (N = pixels summed), per (precision, layer).

    0.5 is the sqrt(N) growth of a random-walk sum; blocked/pairwise sums (GEMM, cuDNN) grow more slowly; NaN with
    fewer than two sizes.
    """
    out = {}
    rnd = [r for r in rows if r.get("kind") == "rounding"]
    keys = sorted({(r["precision"], r["layer_index"], r["layer"]) for r in rnd},
                  key=lambda k: (_prec_order(k[0]), k[1]))
    for p, li, name in keys:
        pts = [(r["n_terms"], r[field]) for r in rnd
               if (r["precision"], r["layer_index"]) == (p, li) and r[field] > 0]
        if len({n for n, _ in pts}) < 2:
            out[(p, name)] = math.nan
            continue
        lx, ly = np.log([q[0] for q in pts]), np.log([q[1] for q in pts])
        out[(p, name)] = float(np.polyfit(lx, ly, 1)[0])
    return out


def _prec_order(p: str) -> int:
    return list(PRECISIONS).index(p) if p in PRECISIONS else len(PRECISIONS)


def verdict(rows: Sequence[dict[str, Any]], reported: tuple[float, float] = (0.25, 1.75)) -> str:
    """A paragraph computed from ``rows``: the largest rounding errors, their growth, the control, the bugs."""
    rnd = [r for r in rows if r.get("kind") == "rounding"]
    bug = [r for r in rows if r.get("kind") == "bug"]
    if not rnd:
        return "No rounding rows: nothing to conclude."
    smax = max(r["size"] for r in rnd)
    nmax = max(r["n_terms"] for r in rnd)
    slopes = growth_exponents(rnd)
    env = f"{rnd[0]['device']} ({rnd[0]['platform']})"
    size_list = ", ".join(f"{s}^2" for s in sorted({r["size"] for r in rnd}))
    text = [f"Measured on {env}, batch {rnd[0]['batch']}, sizes {size_list}."]
    worst = 0.0
    for p in sorted({r["precision"] for r in rnd}, key=_prec_order):
        sel = [r for r in rnd if r["precision"] == p]
        eff = sel[0]["effective_precision"]
        top = max(sel, key=lambda r: r["w_rel_err"])
        at_max = sorted((r for r in sel if r["size"] == smax), key=lambda r: r["layer_index"])
        wmax_b = max(r["b_rel_err"] for r in sel)
        worst = max(worst, top["w_rel_err"], wmax_b)
        units = max(max(r["w_normalized_units"], r["b_normalized_units"]) for r in sel)
        sl = [v for (pp, _), v in slopes.items() if pp == p and not math.isnan(v)]
        grow = (f"fitted growth N^{min(sl):.2f} to N^{max(sl):.2f} over the layers (sqrt(N) would be N^0.50)"
                if sl else "one size only, no growth fit")
        text.append(
            f"{p} ({eff}): weight-gradient rel. error at {smax}^2 = "
            f"{', '.join(f'{r['w_rel_err']:.1e}' for r in at_max)} (layers 1-{len(at_max)}), largest "
            f"{top['w_rel_err']:.1e} ({top['layer']}, {top['size']}^2); {grow}; bias gradients (the control: the "
            f"same cotangent summed over the same N pixels) <= {wmax_b:.1e}; loss <= "
            f"{max(r['loss_rel_err'] for r in sel):.1e}; per entry at most {units:.2g} u_{eff} x sum|terms|.")
    claim = math.sqrt(nmax) * _U["f32"]
    f32_at_max = [r for r in rnd if r["effective_precision"] == "f32" and r["size"] == smax]
    measured = (f"exact f32 measured {max(max(r['w_rel_err'], r['b_rel_err']) for r in f32_at_max):.1e} there"
                if f32_at_max else "")
    text.append(f"The 'float32 accumulation over N terms' estimate sqrt(N) u_f32 is {claim:.1e} at N = {nmax:,} "
                f"({smax}^2 x {rnd[0]['batch']}){' (' + measured + ')' if measured else ''}; even that estimate is "
                f"{reported[0] / claim:,.0f}x smaller than the reported {reported[0]:.0%}.")
    wb = [(max(r["w_rel_err"] for r in rnd if r["precision"] == p),
           max(r["b_rel_err"] for r in rnd if r["precision"] == p)) for p in {r["precision"] for r in rnd}]
    control_ok = all(b <= 10 * w and w <= 10 * b for w, b in wb)
    text.append("Control: the bias gradients sum the same cotangent over the same N pixels and their errors are "
                + ("of the same order as the weight gradients' (within 10x at every precision), so long "
                   "accumulation by itself does not produce large errors." if control_ok else
                   "NOT of the same order as the weight gradients' here: look at the rows above."))
    if bug:
        low = min(bug, key=lambda r: r["w_rel_err"])
        low_max = min(bug, key=lambda r: r["w_max_abs_ratio"])
        kinds = sorted({r["bug"] for r in bug}, key=BUGS.index)
        text.append(
            f"The planted layout bugs ({', '.join(kinds)}) give weight-gradient rel. errors "
            f"{low['w_rel_err']:.2f}..{max(r['w_rel_err'] for r in bug):.2f} (max|d|/max|g| >= "
            f"{low_max['w_max_abs_ratio']:.2f}), the size of the reported 25-175 %: the smallest "
            f"({low['bug']}, {low['layer']}, {low['size']}^2) is {low['w_rel_err'] / worst:,.0f}x the largest "
            f"rounding error measured ({worst:.1e}).")
        nflag = sum(r["flagged"] for r in bug)
        if nflag < len(bug):
            miss = [r for r in bug if not r["flagged"]]
            text.append(
                f"Caveat for per-entry gating: only {nflag}/{len(bug)} bug rows exceed the verifier's per-entry "
                f"bound 8(u + u_f32 sqrt(N)) x sum|terms| (missed from {min(r['size'] for r in miss)}^2 on). With a "
                f"white-noise residual each gradient entry is itself a cancelling sum (kappa = ||sum|terms| || / ||g|| "
                f"= {min(r['w_kappa'] for r in bug):.0f}..{max(r['w_kappa'] for r in bug):.0f} here, larger at "
                f"larger N), so a bug's O(|g|) error divided by sum|terms| falls like 1/kappa while the bound grows "
                f"like sqrt(N); the normwise error and the ratio to the measured rounding (above) separate them at "
                f"every size.")
        else:
            text.append(f"All {len(bug)} bug rows exceed the verifier's per-entry rounding bound.")
    lo, hi = reported
    has_tf32 = any(r["effective_precision"] == "tf32" for r in rnd)
    text.append(
        f"Verdict: rounding{' (TF32 included)' if has_tf32 else ''} accounts for relative errors up to "
        f"{worst:.1e}, {lo / worst:,.0f}-{hi / worst:,.0f}x below the reported {lo:.0%}-{hi:.0%}; errors of that "
        f"size are what layout bugs produce. The "
        f"reported discrepancy is a bug in the weight-gradient pairing, not float32 accumulation error.")
    if not has_tf32:
        text.append(f"(TF32 was not exercised: JAX's default precision is exact f32 on {rnd[0]['platform']}; "
                    "run on a GPU for the TF32 rows.)")
    return " ".join(text)
