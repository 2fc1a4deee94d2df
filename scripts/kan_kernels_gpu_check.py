#!/usr/bin/env python
"""Sanity check and timing of the KAN spline kernels (jaxgrad.kan.kernels) against XLA.

    python scripts/kan_kernels_gpu_check.py            # GPU: B=16384, in=out=512, G=5, k=3
    python scripts/kan_kernels_gpu_check.py --small    # CPU (interpret mode) or quick GPU smoke: B=129, 33x17
    python scripts/kan_kernels_gpu_check.py --sweep    # also time a few block configurations per kernel

For each mode (f32 default precision = TF32 dots on the GPU, f32 HIGHEST, bf16) it

1. runs the forward, dcoef and dx kernels and compares them with a float64 plain-JAX reference built from
   ``bspline_basis`` / ``bspline_basis_derivative``: ``max |err| / M`` where ``M = sum |terms|`` (the scale of
   rounding error), next to the tolerance the GPU tests use (TF32 8*2^-11, HIGHEST 3e-5, bf16 3*2^-8);
2. prints median / p10 / p90 wall times (``jaxgrad.bench.harness.time_fn``) of the kernels and of the XLA
   reference (``einsum`` over the materialised ``[B, in, G+k]`` basis; backward by the same equations) at the
   same precision, and the matrix-unit rate ``2 B in out (G+k) / t`` of each.

Exit status 1 if a check fails.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import argparse  # noqa: E402
import functools  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxgrad.bench import harness as bm  # noqa: E402
from jaxgrad import pallas_backend as pb  # noqa: E402
from jaxgrad.kan import kernels as K  # noqa: E402
from jaxgrad.kan.spline import bspline_basis, bspline_basis_derivative, make_grid  # noqa: E402

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

MODES = {  # name: (dtype, precision, tolerance against M)
    "f32-default": (jnp.float32, None, 8 * 2.0**-11),  # TF32 operands (possibly truncated): <= 4u per product
    "f32-highest": (jnp.float32, jax.lax.Precision.HIGHEST, 3e-5),
    "bf16": (jnp.bfloat16, None, 3 * 2.0**-8),
    # optional (not in the default --modes): 3-pass TF32 on tensor cores, ~f32 accuracy
    "f32-tf32x3": (jnp.float32, jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3, 3e-5),
}
DEFAULT_MODES = ("f32-default", "f32-highest", "bf16")


def make_inputs(n_batch, n_in, n_out, grid_size, k, dtype, seed=0):
    """Uniform grid on [-1, 1] nudged to non-uniform, x ~ U(-1.3, 1.3) (partly outside), normal coef and g."""
    rng = np.random.default_rng(seed)
    grid = np.asarray(make_grid(n_in, grid_size, k), np.float64)
    grid = grid + rng.uniform(-0.2, 0.2, grid.shape) * (2.0 / grid_size)  # |jitter| < h/5 keeps rows sorted
    grid = np.sort(grid, axis=1).astype(np.float32)
    x = rng.uniform(-1.3, 1.3, (n_batch, n_in))
    coef = rng.standard_normal((n_out, n_in, grid_size + k)) / np.sqrt(n_in)
    g = rng.standard_normal((n_batch, n_out))
    return jnp.asarray(x, dtype), jnp.asarray(grid), jnp.asarray(coef, dtype), jnp.asarray(g, dtype)


@functools.partial(jax.jit, static_argnums=4)
def _ref64(x, grid, coef, g, k):
    hp = jax.lax.Precision.HIGHEST
    phi = bspline_basis(x, grid, k)
    dphi = bspline_basis_derivative(x, grid, k)
    lower = bspline_basis(x, grid, k - 1)
    t = grid.astype(x.dtype)
    w1, w2 = t[:, k:-1] - t[:, :-(k + 1)], t[:, k + 1:] - t[:, 1:-k]
    inv1 = jnp.where(w1 > 0, 1 / jnp.where(w1 > 0, w1, 1), 0)
    inv2 = jnp.where(w2 > 0, 1 / jnp.where(w2 > 0, w2, 1), 0)
    dmag = k * (lower[..., :-1] * inv1 + lower[..., 1:] * inv2)
    ac, ag = jnp.abs(coef), jnp.abs(g)
    vals = (jnp.einsum("bim,oim->bo", phi, coef, precision=hp),
            (dphi * jnp.einsum("bo,oim->bim", g, coef, precision=hp)).sum(-1),
            jnp.einsum("bo,bim->oim", g, phi, precision=hp))
    mags = (jnp.einsum("bim,oim->bo", phi, ac, precision=hp),
            (dmag * jnp.einsum("bo,oim->bim", ag, ac, precision=hp)).sum(-1),
            jnp.einsum("bo,bim->oim", ag, phi, precision=hp))
    return vals, mags


def check(x, grid, coef, g, k, got, tol) -> tuple[bool, str]:
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, grid, coef, g)]
        vals, mags = _ref64(*args, k)
        vals, mags = [np.asarray(v) for v in vals], [np.asarray(m) for m in mags]
    ok, parts = True, []
    for name, o, want, mag in zip(("y", "dx", "dcoef"), got, vals, mags, strict=True):
        o = np.asarray(o, np.float64)
        finite = bool(np.all(np.isfinite(o)))
        ratio = float(np.max(np.abs(o - want) / (mag + 1e-30)))
        nrm = float(np.linalg.norm(o - want) / max(np.linalg.norm(want), 1e-300))
        good = finite and ratio <= tol
        ok &= good
        parts.append(f"{name}: max|err|/M={ratio:.2e} rel-norm={nrm:.2e}{'' if good else ' FAIL'}")
    return ok, f"tol={tol:.1e}  " + "  ".join(parts)


def xla_forward(x, grid, coef, k, precision):
    cdt = jnp.promote_types(x.dtype, jnp.float32)
    phi = bspline_basis(x.astype(cdt), grid, k).astype(x.dtype)
    return jnp.einsum("bim,oim->bo", phi, coef, precision=precision, preferred_element_type=cdt).astype(x.dtype)


def xla_backward(x, grid, coef, g, k, precision):
    cdt = jnp.promote_types(x.dtype, jnp.float32)
    xc = x.astype(cdt)
    phi = bspline_basis(xc, grid, k).astype(x.dtype)
    dphi = bspline_basis_derivative(xc, grid, k)
    dcoef = jnp.einsum("bo,bim->oim", g, phi, precision=precision, preferred_element_type=cdt)
    h = jnp.einsum("bo,oim->bim", g, coef, precision=precision, preferred_element_type=cdt)
    return (dphi * h).sum(-1).astype(x.dtype), dcoef.astype(coef.dtype)


def timed(name, fn, args, flops, repeats, rows):
    try:
        t = bm.time_fn(fn, *args, warmup=2, repeats=repeats)
    except Exception as e:  # noqa: BLE001 - report and go on (e.g. out of shared memory, bf16 dot on CPU)
        rows.append((f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", *[float("nan")] * 4))
        print(f"  {rows[-1][0]}", flush=True)
        return
    rate = flops / (t["median_ms"] * 1e-3) / 1e12
    rows.append((name, t["median_ms"], t["p10_ms"], t["p90_ms"], rate))
    print(f"  {name}: {t['median_ms']:.3f} ms", flush=True)  # as it comes: a time limit may cut the table


# Alternatives to the defaults (K.FWD_DEFAULTS etc.): the runners-up of the session-4 H100 sweep and wider
# contractions (block_k = bk * nbp). Rough L2 traffic: the forward re-reads coef once per batch block
# (~ B/bb * NB*in*out words), dx likewise plus g once per input block, dcoef re-reads x and g once per
# (input, output) block pair; the bases are recomputed once per output block (fwd, dcoef).
SWEEP_HIGHEST = {  # IEEE f32 dots are FMA loops in registers: smaller tiles than the TF32 defaults
    "fwd": [dict(block_b=64, block_k=128, block_out=64, num_warps=8, num_stages=1),
            dict(block_b=64, block_k=64, block_out=128, num_warps=8, num_stages=1),
            dict(block_b=32, block_k=128, block_out=128, num_warps=4, num_stages=1),
            dict(block_b=64, block_k=32, block_out=64, num_warps=4, num_stages=1)],
    "dcoef": [dict(block_b=64, block_k=128, block_out=64, num_warps=8, num_stages=1),
              dict(block_b=32, block_k=64, block_out=64, num_warps=4, num_stages=1),
              dict(block_b=32, block_k=128, block_out=32, num_warps=4, num_stages=1)],
    "dx": [dict(block_b=64, block_k=128, block_out=64, num_warps=8, num_stages=1),
           dict(block_b=64, block_k=64, block_out=64, num_warps=4, num_stages=1),
           dict(block_b=32, block_k=128, block_out=32, num_warps=4, num_stages=1)],
}
SWEEP_LARGE_GRID = {  # G=20: nbp=32, so block_k=128 leaves 4 inputs per tile; wider contractions
    "fwd": [dict(block_b=128, block_k=256, block_out=128, num_warps=8, num_stages=1),
            dict(block_b=64, block_k=256, block_out=256, num_warps=8, num_stages=1),
            dict(block_b=64, block_k=512, block_out=128, num_warps=8, num_stages=1)],
    "dcoef": [dict(block_b=64, block_k=256, block_out=128, num_warps=8, num_stages=1),
              dict(block_b=64, block_k=512, block_out=64, num_warps=8, num_stages=1)],
    "dx": [dict(block_b=128, block_k=256, block_out=64, num_warps=8, num_stages=1),
           dict(block_b=64, block_k=512, block_out=64, num_warps=8, num_stages=1)],
}
SWEEP = {
    "fwd": [dict(block_b=128, block_k=128, block_out=256, num_warps=8, num_stages=1),
            dict(block_b=64, block_k=128, block_out=256, num_warps=8, num_stages=1),
            dict(block_b=128, block_k=128, block_out=128, num_warps=8, num_stages=2),
            dict(block_b=128, block_k=256, block_out=128, num_warps=8, num_stages=1)],
    "dcoef": [dict(block_b=128, block_k=128, block_out=128, num_warps=8),
              dict(block_b=64, block_k=256, block_out=128, num_warps=8, num_stages=1),
              dict(block_b=64, block_k=128, block_out=128, num_warps=8, batch_splits=2)],
    "dx": [dict(block_b=128, block_k=128, block_out=128, num_warps=8),
           dict(block_b=128, block_k=128, block_out=32, num_warps=8),
           dict(block_b=128, block_k=256, block_out=64, num_warps=8, num_stages=1),
           dict(block_b=64, block_k=128, block_out=128, num_warps=8)],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="B=129, in=17, out=33 (CPU interpret mode is slow)")
    p.add_argument("--sweep", action="store_true", help="also time a few block configurations per kernel")
    p.add_argument("--sweep-set", choices=["tf32", "highest", "large-grid"], default="tf32",
                   help="which configurations --sweep times (SWEEP, SWEEP_HIGHEST or SWEEP_LARGE_GRID)")
    p.add_argument("--grid-size", type=int, default=5)
    p.add_argument("--order", type=int, default=3, help="spline order k")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma list of {list(MODES)}")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    args = p.parse_args(argv)
    n_batch, n_in, n_out = (129, 17, 33) if args.small else (16384, 512, 512)
    n_batch = args.batch or n_batch
    grid_size, k = args.grid_size, args.order
    repeats = args.repeats or (3 if args.small else 20)
    env = bm.environment()
    print(f"# {pb.describe()} | {env.get('device_kind', jax.devices()[0].device_kind)} | jax {jax.__version__}")
    print(f"# B={n_batch} in={n_in} out={n_out} G={grid_size} k={k}")
    flops = 2.0 * n_batch * n_in * n_out * (grid_size + k)  # one matmul-equivalent
    all_ok = True
    rows: list[tuple] = []
    for mode in args.modes.split(","):
        dtype, precision, tol = MODES[mode]
        x, grid, coef, g = make_inputs(n_batch, n_in, n_out, grid_size, k, dtype)
        fwd = jax.jit(lambda x, grid, coef, p=precision: K.kan_spline_forward(x, grid, coef, k, precision=p))
        bwd = jax.jit(lambda x, grid, coef, g, p=precision: K.kan_spline_backward(x, grid, coef, g, k, precision=p))
        y = fwd(x, grid, coef)
        dx, dcoef = bwd(x, grid, coef, g)
        ok, msg = check(x, grid, coef, g, k, (y, dx, dcoef), tol)
        all_ok &= ok
        print(f"[{'ok' if ok else 'FAIL'}] {mode:12s} {msg}")
        xf = jax.jit(lambda x, grid, coef, p=precision: xla_forward(x, grid, coef, k, p))
        xb = jax.jit(lambda x, grid, coef, g, p=precision: xla_backward(x, grid, coef, g, k, p))
        dcoef_only = jax.jit(lambda x, grid, g, p=precision, nb=coef.shape[-1], cd=coef.dtype:
                             K.kan_spline_dcoef(x, grid, g, k, nb, coef_dtype=cd, precision=p))
        dx_only = jax.jit(lambda x, grid, coef, g, p=precision: K.kan_spline_dx(x, grid, coef, g, k, precision=p))
        timed(f"{mode} pallas fwd", fwd, (x, grid, coef), flops, repeats, rows)
        timed(f"{mode} xla    fwd", xf, (x, grid, coef), flops, repeats, rows)
        timed(f"{mode} pallas bwd (dx+dcoef)", bwd, (x, grid, coef, g), 2 * flops, repeats, rows)
        timed(f"{mode}   pallas dcoef", dcoef_only, (x, grid, g), flops, repeats, rows)
        timed(f"{mode}   pallas dx", dx_only, (x, grid, coef, g), flops, repeats, rows)
        timed(f"{mode} xla    bwd (dx+dcoef)", xb, (x, grid, coef, g), 2 * flops, repeats, rows)
        # What the matrix units can do on this contraction when nothing else is in the way: one XLA (cuBLAS) GEMM
        # [B, in*NB] @ [in*NB, out] over operands computed beforehand (not timed). The kernels' dots cannot beat it.
        basis = jax.jit(lambda x, grid: bspline_basis(x, grid, k).reshape(x.shape[0], -1).astype(x.dtype))(x, grid)
        gemm = jax.jit(lambda a, c, p=precision: jnp.dot(a, c.reshape(c.shape[0], -1).T, precision=p,
                                                         preferred_element_type=jnp.float32))
        timed(f"{mode} xla    GEMM only (basis precomputed)", gemm, (basis, coef), flops, repeats, rows)
        if args.sweep:
            for kind, configs in {"tf32": SWEEP, "highest": SWEEP_HIGHEST,
                                  "large-grid": SWEEP_LARGE_GRID}[args.sweep_set].items():
                for cfg in configs:
                    if kind == "fwd":
                        f = jax.jit(lambda x, grid, coef, p=precision, c=cfg:
                                    K.kan_spline_forward(x, grid, coef, k, precision=p, **c))
                        a = (x, grid, coef)
                    elif kind == "dcoef":
                        f = jax.jit(lambda x, grid, g, p=precision, c=cfg, nb=coef.shape[-1]:
                                    K.kan_spline_dcoef(x, grid, g, k, nb, precision=p, **c))
                        a = (x, grid, g)
                    else:
                        f = jax.jit(lambda x, grid, coef, g, p=precision, c=cfg:
                                    K.kan_spline_dx(x, grid, coef, g, k, precision=p, **c))
                        a = (x, grid, coef, g)
                    want = {"fwd": y, "dcoef": dcoef, "dx": dx}[kind]
                    try:  # each configuration must reproduce the default kernel's output (same precision)
                        got = np.asarray(f(*a), np.float64)
                        w = np.asarray(want, np.float64)
                        diff = f"vs default {np.max(np.abs(got - w)) / max(np.max(np.abs(w)), 1e-300):.1e}"
                    except Exception as e:  # noqa: BLE001 - reported in the table by timed() below
                        diff = f"failed: {type(e).__name__}"
                    timed(f"{mode}   sweep {kind} {cfg} [{diff}]", f, a, flops, repeats, rows)
    width = max([len("variant")] + [len(r[0]) for r in rows])
    print(f"\n{'variant':{width}s} {'median ms':>10s} {'p10':>9s} {'p90':>9s} {'TFLOP/s':>8s}")
    for name, med, p10, p90, rate in rows:
        print(f"{name:{width}s} {med:10.3f} {p10:9.3f} {p90:9.3f} {rate:8.2f}")
    print("\nALL CHECKS PASSED" if all_ok else "\nSOME CHECKS FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
