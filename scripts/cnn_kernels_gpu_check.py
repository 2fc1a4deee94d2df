#!/usr/bin/env python
"""Sanity check and timing of the 3x3 conv kernels (jaxgrad.cnn.kernels) against XLA (cuDNN).

    python scripts/cnn_kernels_gpu_check.py             # GPU: checks, then timings at N=2, 1024x1024
    python scripts/cnn_kernels_gpu_check.py --small     # CPU (interpret mode) or quick GPU smoke: tiny sizes
    python scripts/cnn_kernels_gpu_check.py --sweep     # also time block_p / num_warps / num_stages / num_splits

1. **Checks**: for each mode (f32 default precision = TF32 dots on the GPU, f32 HIGHEST = IEEE, bf16) and a few
   sizes and channel pairs, runs the forward (bias + ReLU), input grad and weight grad (ReLU' mask from ``y``) and
   compares them with a float64 ``lax.conv_general_dilated`` / ``jax.vjp`` reference: ``max |err| / M`` where
   ``M = sum |terms|``, against ``k_op u_op + (2 sqrt(n) + 2) u_f32`` (the tests' error model).
2. **Timings** (median / p10 / p90 ms, ``jaxgrad.bench.harness.time_fn``) at N=2, 1024x1024 (the cryo-EM denoiser
   1 -> 16 -> 16 -> 1): each kernel for each layer, the same op in XLA, and the whole network's loss + gradient
   (MSE vs a random target; layers 1->16 ReLU, 16->16 ReLU, 16->1) built from the three kernels vs
   ``jax.value_and_grad`` of the plain XLA network, at the same precision. The traffic floor of each kernel
   (every input read once, every output written once) is printed at 3.35 TB/s (H100 SXM; H200: 4.8 TB/s).

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
from jaxgrad.cnn import kernels as K  # noqa: E402

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

HP = jax.lax.Precision.HIGHEST
F32_U, TF32_U, BF16_U = 2.0**-24, 2.0**-11, 2.0**-8
MODES = {  # name: (dtype, precision, k_op, u_op)
    "f32-default": (jnp.float32, None, 8, TF32_U),
    "f32-highest": (jnp.float32, HP, 0, 0.0),
    "bf16": (jnp.bfloat16, None, 2, BF16_U),
    "f32-tf32x3": (jnp.float32, jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3, 0, 0.0),  # optional
}
DEFAULT_MODES = ("f32-default", "f32-highest", "bf16")
CHECK_SIZES = [(2, 256, 256, 16, 16), (1, 129, 67, 1, 16), (1, 129, 67, 16, 1), (1, 67, 129, 3, 5),
               (1, 64, 64, 32, 32)]
SMALL_SIZES = [(2, 7, 9, 3, 5), (1, 17, 3, 16, 1)]
BW = 3.35e12  # bytes/s for the printed floors


def conv_xla(x, w, precision=None):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        precision=precision, preferred_element_type=jnp.promote_types(x.dtype,
                                                                                                       jnp.float32))


@jax.jit
def _ref64(x, w, b, g, mask):
    gz = g * mask
    c = functools.partial(conv_xla, precision=HP)
    y_pre = c(x, w) + b
    _, vjp = jax.vjp(c, x, w)
    dx, dw = vjp(gz)
    ax, aw, agz = jnp.abs(x), jnp.abs(w), jnp.abs(gz)
    mags = (c(ax, aw) + jnp.abs(b), jax.vjp(lambda x_: c(x_, aw), ax)[1](agz)[0],
            jax.vjp(lambda w_: c(ax, w_), aw)[1](agz)[0], agz.sum((0, 1, 2)))
    return (jnp.maximum(y_pre, 0), dx, dw, gz.sum((0, 1, 2))), mags


def make_inputs(n, h, w, cin, cout, dtype, seed=0):
    rng = np.random.default_rng(seed)
    arrs = (rng.standard_normal((n, h, w, cin)), rng.standard_normal((3, 3, cin, cout)) / np.sqrt(9 * cin),
            rng.standard_normal(cout), rng.standard_normal((n, h, w, cout)), rng.standard_normal((n, h, w, cout)))
    return tuple(jnp.asarray(a, dtype) for a in arrs)


def check_one(size, mode, interpret) -> tuple[bool, str]:
    n, h, w, cin, cout = size
    dtype, precision, k_op, u_op = MODES[mode]
    x, wt, b, g, y = make_inputs(n, h, w, cin, cout, dtype)
    got = (K.conv3x3_forward(x, wt, b, relu=True, precision=precision, interpret=interpret),
           K.conv3x3_input_grad(g, wt, y=y, precision=precision, interpret=interpret),
           *K.conv3x3_weight_grad(x, g, y=y, precision=precision, interpret=interpret))
    cpu = jax.devices("cpu")[0]  # exact f64 reference on the host
    with jax.enable_x64(True):
        a64 = [jax.device_put(np.asarray(a, np.float64), cpu) for a in (x, wt, b, g)]
        vals, mags = _ref64(*a64, jax.device_put((np.asarray(y, np.float64) > 0).astype(np.float64), cpu))
        vals, mags = [np.asarray(v) for v in vals], [np.asarray(m) for m in mags]
    ok, parts = True, []
    for name, o, want, mag, n_terms in zip(("y", "dx", "dw", "db"), got, vals, mags,
                                           (9 * cin + 1, 9 * cout, n * h * w, n * h * w), strict=True):
        tol = k_op * u_op + (2 * np.sqrt(n_terms) + 2) * F32_U
        o = np.asarray(o, np.float64)
        finite = bool(np.all(np.isfinite(o)))
        ratio = float(np.max(np.abs(o - want) / (mag + 1e-30)))
        good = finite and ratio <= tol
        ok &= good
        parts.append(f"{name}: {ratio:.1e}/{tol:.0e}{'' if good else ' FAIL'}")
    return ok, "  ".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# The seed network: 1 -> 16 (ReLU) -> 16 (ReLU) -> 1, MSE
# ---------------------------------------------------------------------------------------------------------------
def init_params(dtype, seed=1):
    rng = np.random.default_rng(seed)
    params = []
    for cin, cout in ((1, 16), (16, 16), (16, 1)):
        params.append((jnp.asarray(rng.standard_normal((3, 3, cin, cout)) * np.sqrt(2 / (9 * cin)), dtype),
                       jnp.asarray(0.1 * rng.standard_normal(cout), dtype)))
    return params


def xla_loss(params, x, tgt, precision):
    a = x
    for i, (w, b) in enumerate(params):
        a = (conv_xla(a, w, precision) + b.astype(jnp.float32)).astype(x.dtype)
        if i < 2:
            a = jnp.maximum(a, 0)
    r = a.astype(jnp.float32) - tgt.astype(jnp.float32)
    return jnp.mean(r * r)


def kernel_loss_and_grad(params, x, tgt, precision, cfg=None):
    cfg = cfg or {}
    fw, ig, wg = cfg.get("fwd", {}), cfg.get("igrad", {}), cfg.get("wgrad", {})
    (w1, b1), (w2, b2), (w3, b3) = params
    a1 = K.conv3x3_forward(x, w1, b1, relu=True, precision=precision, **fw)
    a2 = K.conv3x3_forward(a1, w2, b2, relu=True, precision=precision, **fw)
    out = K.conv3x3_forward(a2, w3, b3, relu=False, precision=precision, **fw)
    r = out.astype(jnp.float32) - tgt.astype(jnp.float32)
    loss = jnp.mean(r * r)
    g3 = (2 / r.size * r).astype(x.dtype)
    dw3, db3 = K.conv3x3_weight_grad(a2, g3, precision=precision, **wg)
    da2 = K.conv3x3_input_grad(g3, w3, precision=precision, **ig)
    dw2, db2 = K.conv3x3_weight_grad(a1, da2, y=a2, precision=precision, **wg)
    da1 = K.conv3x3_input_grad(da2, w2, y=a2, precision=precision, **ig)
    dw1, db1 = K.conv3x3_weight_grad(x, da1, y=a1, precision=precision, **wg)
    return loss, [(dw1, db1), (dw2, db2), (dw3, db3)]


def timed(name, fn, args, repeats, rows, floor_bytes=None):
    try:
        t = bm.time_fn(fn, *args, warmup=2, repeats=repeats)
    except Exception as e:  # noqa: BLE001 - report and go on (e.g. a Triton compile error for one config)
        rows.append((f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", *[float("nan")] * 4))
        print(f"  {rows[-1][0]}", flush=True)
        return float("nan")
    floor = floor_bytes / BW * 1e3 if floor_bytes else float("nan")
    rows.append((name, t["median_ms"], t["p10_ms"], t["p90_ms"], floor))
    print(f"  {name}: {t['median_ms']:.3f} ms (floor {floor:.3f})", flush=True)  # as we go (time limits)
    return t["median_ms"]


def sweep_configs(kinds=("fwd", "igrad", "wgrad")):
    out = []
    for bp in (128, 256):  # row-strip variant (rows_per_program): 3 loads per row instead of 9
        for rpp in (8, 32):
            for nw in (4, 8):
                out.append(("fwd", dict(block_p=bp, rows_per_program=rpp, num_warps=nw)))
                out.append(("igrad", dict(block_p=bp, rows_per_program=rpp, num_warps=nw)))
    for bp in (128, 256, 512):
        for nw in (4, 8):
            out.append(("fwd", dict(block_p=bp, num_warps=nw, num_stages=1)))
            out.append(("igrad", dict(block_p=bp, num_warps=nw, num_stages=1)))
    for bp in (64, 128, 256, 512):
        for nw in (4, 8):
            for ns in (1, 2):
                out.append(("wgrad", dict(block_p=bp, num_warps=nw, num_stages=ns)))
    for sp in (132, 264, 1024):
        out.append(("wgrad", dict(num_splits=sp)))
    return [(k, c) for k, c in out if k in kinds]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny sizes (CPU interpret mode is slow)")
    p.add_argument("--sweep", action="store_true", help="time block configurations of each kernel")
    p.add_argument("--sweep-kinds", default="fwd,igrad,wgrad", help="kernels the sweep times")
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma list of {list(MODES)}")
    p.add_argument("--time-modes", default="f32-default,f32-highest,bf16", help="modes timed")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--size", default=None, help="N,H,W of the timed network (default 2,1024,1024)")
    p.add_argument("--check-sizes", default=None, help="';'-separated N,H,W,Cin,Cout lists to check")
    args = p.parse_args(argv)
    interpret = pb.default_interpret()
    repeats = args.repeats or (3 if args.small else 20)
    print(f"# {pb.describe()} | {jax.devices()[0].device_kind} | jax {jax.__version__}")
    all_ok = True
    if not args.no_check:
        for mode in args.modes.split(","):
            sizes = SMALL_SIZES if args.small else CHECK_SIZES
            if args.check_sizes:
                sizes = [tuple(int(v) for v in c.split(",")) for c in args.check_sizes.split(";")]
            for size in sizes:
                try:
                    ok, msg = check_one(size, mode, interpret)
                except Exception as e:  # noqa: BLE001
                    ok, msg = False, f"{type(e).__name__}: {str(e)[:400]}"
                all_ok &= ok
                print(f"[{'ok' if ok else 'FAIL'}] {mode:12s} N,H,W,Cin,Cout={size}  {msg}", flush=True)

    n, h, w = (2, 33, 31) if args.small else (2, 1024, 1024)
    if args.size:
        n, h, w = (int(v) for v in args.size.split(","))
    print(f"\n# timings: N={n} H={h} W={w}; floor = bytes read once + written once at {BW / 1e12:.2f} TB/s")
    rows: list[tuple] = []
    for mode in args.time_modes.split(","):
        dtype, precision, _, _ = MODES[mode]
        isz = jnp.dtype(dtype).itemsize
        rng = np.random.default_rng(2)
        x = jnp.asarray(rng.standard_normal((n, h, w, 1)), dtype)
        tgt = jnp.asarray(rng.standard_normal((n, h, w, 1)), dtype)
        params = init_params(dtype)
        npix = n * h * w
        # activations of the network (for realistic ReLU masks)
        a1 = jax.jit(lambda x, w, b: K.conv3x3_forward(x, w, b, relu=True, precision=precision))(x, *params[0])
        a2 = jax.jit(lambda x, w, b: K.conv3x3_forward(x, w, b, relu=True, precision=precision))(a1, *params[1])
        g16 = jnp.asarray(rng.standard_normal((n, h, w, 16)), dtype)
        g1 = jnp.asarray(rng.standard_normal((n, h, w, 1)), dtype)
        for (cin, cout), (wt, b), xin, gin, yin in (((1, 16), params[0], x, g16, a1),
                                                    ((16, 16), params[1], a1, g16, a2),
                                                    ((16, 1), params[2], a2, g1, None)):
            tag = f"{mode} {cin:2d}->{cout:<2d}"
            f = jax.jit(lambda x, w, b, p=precision, r=cout > 1: K.conv3x3_forward(x, w, b, relu=r, precision=p))
            fx = jax.jit(lambda x, w, b, p=precision, r=cout > 1: (lambda z: jnp.maximum(z, 0) if r else z)(
                (conv_xla(x, w, p) + b).astype(x.dtype)))
            timed(f"{tag} pallas fwd", f, (xin, wt, b), repeats, rows, npix * (cin + cout) * isz)
            timed(f"{tag} xla    fwd", fx, (xin, wt, b), repeats, rows, npix * (cin + cout) * isz)
            ym = yin if cout > 1 else None
            fi = jax.jit(lambda g, w, y, p=precision: K.conv3x3_input_grad(g, w, y=y, precision=p))
            fix = jax.jit(lambda g, w, x, y, p=precision: jax.vjp(lambda x_: conv_xla(x_, w, p), x)[1](
                (g * (y > 0) if y is not None else g).astype(jnp.float32))[0].astype(g.dtype))
            yb = (2 if ym is not None else 1) * npix * cout * isz
            timed(f"{tag} pallas input_grad", fi, (gin, wt, ym), repeats, rows, yb + npix * cin * isz)
            timed(f"{tag} xla    input_grad", fix, (gin, wt, xin, ym), repeats, rows, yb + npix * cin * isz)
            fw = jax.jit(lambda x, g, y, p=precision: K.conv3x3_weight_grad(x, g, y=y, precision=p))
            fwx = jax.jit(lambda x, g, w, y, p=precision: jax.vjp(lambda w_: conv_xla(x, w_, p), w)[1](
                (g * (y > 0) if y is not None else g).astype(jnp.float32)))
            timed(f"{tag} pallas weight_grad", fw, (xin, gin, ym), repeats, rows, yb + npix * cin * isz)
            timed(f"{tag} xla    weight_grad", fwx, (xin, gin, wt, ym), repeats, rows, yb + npix * cin * isz)
            if (cin, cout) == (16, 16):
                sweep_args = (xin, wt, b, gin, ym)
                sweep_refs = (f, fi, fw)
        # the whole network
        chain = jax.jit(lambda prm, x, t, p=precision: kernel_loss_and_grad(prm, x, t, p))
        xla_chain = jax.jit(jax.value_and_grad(lambda prm, x, t, p=precision: xla_loss(prm, x, t, p)))
        try:
            (lk, gk), (lx, gx) = chain(params, x, tgt), xla_chain(params, x, tgt)
            rel = max(float(jnp.linalg.norm((a - c).astype(jnp.float32)) / jnp.linalg.norm(c.astype(jnp.float32)))
                      for a, c in zip(jax.tree.leaves(gk), jax.tree.leaves(gx), strict=True))
            print(f"[chain] {mode}: loss pallas {float(lk):.6f} xla {float(lx):.6f}; max normwise rel grad diff "
                  f"vs XLA {rel:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"[chain] {mode}: FAILED {type(e).__name__}: {str(e)[:300]}")
            all_ok = False
        chain_bytes = npix * isz * (1 + 16 + 16 + 16 + 16 + 1  # forward: reads + writes
                                    + (16 + 1) + (1 + 16) + (16 + 16 + 16) + (16 + 16 + 16) + (1 + 16 + 16))
        timed(f"{mode} CHAIN pallas (fwd+bwd, 3 layers)", chain, (params, x, tgt), repeats, rows, chain_bytes)
        timed(f"{mode} CHAIN xla value_and_grad", xla_chain, (params, x, tgt), repeats, rows, chain_bytes)
        if args.sweep:  # after the chain: the sweep is what a time limit may cut
            xin, wt, b, gin, ym = sweep_args
            f, fi, fw = sweep_refs
            tag = f"{mode} 16->16"
            for kind, cfg in sweep_configs(tuple(args.sweep_kinds.split(","))):
                if kind == "fwd":
                    fs = jax.jit(lambda x, w, b, p=precision, c=cfg: K.conv3x3_forward(
                        x, w, b, relu=True, precision=p, **c))
                    a = (xin, wt, b)
                elif kind == "igrad":
                    fs = jax.jit(lambda g, w, y, p=precision, c=cfg: K.conv3x3_input_grad(
                        g, w, y=y, precision=p, **c))
                    a = (gin, wt, ym)
                else:
                    fs = jax.jit(lambda x, g, y, p=precision, c=cfg: K.conv3x3_weight_grad(
                        x, g, y=y, precision=p, **c))
                    a = (xin, gin, ym)
                try:  # each configuration must reproduce the default kernel's output (same precision)
                    ref = {"fwd": f, "igrad": fi, "wgrad": fw}[kind]
                    want = [np.asarray(v, np.float64) for v in jax.tree.leaves(ref(*a))]
                    got = [np.asarray(v, np.float64) for v in jax.tree.leaves(fs(*a))]
                    diff = max(float(np.max(np.abs(u - v)) / max(np.max(np.abs(v)), 1e-300))
                               for u, v in zip(got, want, strict=True))
                    diff = f"vs default {diff:.1e}"
                except Exception as e:  # noqa: BLE001 - reported by timed() below
                    diff = f"failed: {type(e).__name__}"
                timed(f"{tag}   sweep {kind} {cfg} [{diff}]", fs, a, repeats, rows)
    width = max([len("variant")] + [len(r[0]) for r in rows])
    print(f"\n{'variant':{width}s} {'median ms':>10s} {'p10':>9s} {'p90':>9s} {'floor':>9s}")
    for name, med, p10, p90, floor in rows:
        print(f"{name:{width}s} {med:10.3f} {p10:9.3f} {p90:9.3f} {floor:9.3f}")
    print("\nALL CHECKS PASSED" if all_ok else "\nSOME CHECKS FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
