#!/usr/bin/env python
"""Probe (session 4): the wide-K KAN kernels (jaxgrad/kan/kernels_wide.py) vs the current ones, one run.

Checks each variant against a float64 reference (max |err| / sum|terms|) and times it (median of 20, f32 TF32
dots unless --highest). B=16384, 512->512, G=5, k=3 unless told otherwise."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import argparse  # noqa: E402
import itertools  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxgrad import benchmarking as bm  # noqa: E402
from jaxgrad.kan import kernels as K  # noqa: E402
from jaxgrad.kan import kernels_wide as W  # noqa: E402
from kan_kernels_gpu_check import _ref64, make_inputs  # noqa: E402

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384,512,512,5,3")
    ap.add_argument("--only", default="fwd,dcoef,dx")
    ap.add_argument("--highest", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    a = ap.parse_args()
    B, n_in, n_out, G, k = map(int, a.shape.split(","))
    prec = jax.lax.Precision.HIGHEST if a.highest else None
    dt = jnp.bfloat16 if a.bf16 else jnp.float32
    x, grid, coef, g = make_inputs(B, n_in, n_out, G, k, np.float32)
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(v, np.float64)) for v in (x, grid, coef, g)]
        vals, mags = _ref64(*args, k)
        (y64, dx64, dc64), (My, Mdx, Mdc) = [[np.asarray(v) for v in t] for t in (vals, mags)]
    x, coef, g = (jnp.asarray(v, dt) for v in (x, coef, g))
    grid = jnp.asarray(grid)
    flops = 2 * B * n_in * n_out * (G + k)
    print(bm.environment() if hasattr(bm, "environment") else "", flush=True)
    print(f"shape B={B} in={n_in} out={n_out} G={G} k={k} dtype={jnp.dtype(dt).name} "
          f"precision={'highest' if a.highest else 'default(tf32)'}", flush=True)

    def run(name, fn, ref, M):
        try:
            f = jax.jit(fn)
            out = f()
            err = float(np.max(np.abs(np.asarray(out, np.float64) - ref) / (M + 1e-30)))
            t = bm.time_fn(f, warmup=2, repeats=20)
            ms = t["median_ms"]
            print(f"{name:60s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s err/M {err:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name:60s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)

    only = a.only.split(",")
    if "fwd" in only:
        run("fwd current", lambda: K.kan_spline_forward(x, grid, coef, k, precision=prec), y64, My)
        for bb, bo, bs, nw, ns in itertools.product((64, 128), (128, 256), (False, True), (8,), (1, 2)):
            run(f"fwd wide bb={bb} bo={bo} bases_second={bs} w={nw} s={ns}",
                lambda: W.forward(x, grid, coef, k=k, precision=prec, bb=bb, bo=bo, bases_second=bs, num_warps=nw,
                                  num_stages=ns), y64, My)
    if "ablate" in only:
        for bb, bo, bs, nw, ns in ((128, 256, True, 8, 2), (128, 256, False, 8, 1), (64, 128, True, 4, 2),
                                   (128, 128, True, 4, 2), (256, 256, True, 16, 1), (128, 512, True, 16, 1)):
            for ab in (None, "no_basis", "no_dot"):
                run(f"fwd wide bb={bb} bo={bo} bases_second={bs} w={nw} s={ns} ablate={ab}",
                    lambda: W.forward(x, grid, coef, k=k, precision=prec, bb=bb, bo=bo, bases_second=bs,
                                      num_warps=nw, num_stages=ns, ablate=ab), y64, My)
    if "dcoef" in only:
        run("dcoef current", lambda: K.kan_spline_dcoef(x, grid, g, k, G + k, precision=prec), dc64, Mdc)
        for bb, bo, bs, sp, nw in itertools.product((64, 128), (64, 128), (False, True), (1, 2), (8,)):
            run(f"dcoef wide bb={bb} bo={bo} bases_second={bs} splits={sp} w={nw}",
                lambda: W.dcoef(x, grid, g, k=k, nb=G + k, precision=prec, bb=bb, bo=bo, bases_second=bs,
                                splits=sp, num_warps=nw), dc64, Mdc)
    if "dx" in only:
        run("dx current", lambda: K.kan_spline_dx(x, grid, coef, g, k, precision=prec), dx64, Mdx)
        for bb, bo, nw, ns in itertools.product((64, 128), (32, 64, 128), (8,), (1, 2)):
            run(f"dx wide bb={bb} bo={bo} w={nw} s={ns}",
                lambda: W.dx(x, grid, coef, g, k=k, precision=prec, bb=bb, bo=bo, num_warps=nw, num_stages=ns),
                dx64, Mdx)


if __name__ == "__main__":
    main()
