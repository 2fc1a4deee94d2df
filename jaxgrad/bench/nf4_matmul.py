"""The ``nf4_matmul`` tool: the fused NF4 dequantise + matmul kernels against XLA dequantise + matmul and a plain
bf16 matmul, at the LoRA block's MLP shapes (the largest of its seven projections), in one process; ``--sweep`` times
the tile configurations :mod:`jaxgrad.ops.nf4_matmul`'s defaults were chosen from.

    python -m jaxgrad.bench nf4_matmul [--rows 8192] [--sweep] [--budget-s 240] [--out DIR]

Problems (what the block's ``backend="pallas"`` calls, ``jaxgrad/lora/kernels.py``):

* ``fwd gate``: ``x [rows, 2048] bf16 @ W[5632, 2048]^T``, the weight rounded to bf16, fp32 result;
* ``dx gate``:  ``dY [rows, 5632] fp32 @ W[5632, 2048]`` (the block's fp32 dY, the bf16-rounded weight), fp32 result;
* ``fwd down``: ``x [rows, 5632] bf16 @ W[2048, 5632]^T``;   ``dx down``: ``dY [rows, 2048] fp32 @ W[2048, 5632]``.

Variants per problem: ``xla dequant+dot`` (what the block's XLA path runs: ``nf4_dequantize`` then a dot; the fp32
dx dot at JAX's default precision, TF32 on an H100); ``bf16 dot`` (a dense bf16 weight, bf16 operands, fp32
result; for dx, dY cast to bf16 outside the timing): the tensor-core reference; the kernel in its configurations.
``old`` reproduces the kernel as of issue #13's measurement (general path, 64x64x64 tiles, 4 warps, 2 stages, f32
dots at HIGHEST). Each kernel output is compared with the XLA path at HIGHEST (``rel_err`` = max |diff| / max |ref|).
Floor = 2 rows O K / 989 TFLOP/s (one bf16 pass). Writes ``nf4-matmul-timing-<device>-bf16-<YYYYmmdd>-<HHMMSS>``
``.txt`` / ``.json`` (UTC) into
``--out`` (default ``runs/bench`` under the current directory: git-ignored in a checkout, so a run never changes the
repository; ``--out benchmarks/results`` adds them to the committed results).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.bench import harness as bm
from jaxgrad.ops.nf4 import nf4_absmax, nf4_dequantize, nf4_quantize
from jaxgrad.ops.nf4_matmul import _dequant_xla, nf4_matmul_dx_pallas, nf4_matmul_fwd_pallas

OLD = dict(path="general", block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=2, f32_split=False,
           lut="gather")
# (block_m, block_n, block_k, num_warps, num_stages) tried by --sweep (tiled path, lut=select); the default config
# is always timed. For dx, block_n bounds the output's K tile and block_k the O loop's.
SWEEP = [(256, 128, 64, 8, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 128, 64, 4, 3),
         (128, 256, 64, 8, 3), (64, 256, 64, 4, 3), (256, 64, 64, 8, 3), (64, 128, 32, 4, 4)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxgrad.bench nf4_matmul",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--sweep", action="store_true",
                   help="also time the SWEEP tile configurations, lut=gather and the general path")
    p.add_argument("--no-old", action="store_true", help="skip the old (issue #13) kernel")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting new variants after this")
    p.add_argument("--out", default=bm.DEFAULT_RESULTS_DIR,
                   help="results directory (default: %(default)s, git-ignored; --out benchmarks/results to commit)")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    env = bm.environment()
    lines = [f"# device: {env['device_kind']} ({env['platform']}), jax {env['jax']}, jaxlib {env['jaxlib']}, "
             f"python {env['python']}, {env['datetime_utc']}",
             f"# commit {env['commit']} (uncommitted changes: {env['dirty']}); command: "
             f"{' '.join(['python -m jaxgrad.bench nf4_matmul', *(sys.argv[1:] if argv is None else argv)])}",
             f"# matmul precision: {env['matmul_precision']}; rows = {args.rows}; floor = 2 rows O K / 989e12 "
             "(one bf16 tensor-core pass); rel_err = max|kernel - ref| / max|ref|, ref = dequantise + dot at HIGHEST",
             f"{'problem':9s}  {'variant':58s}  {'median_ms':>9s}  {'p10_ms':>8s}  {'p90_ms':>8s}  {'floor_ms':>8s}  "
             f"{'frac':>5s}  {'rel_err':>8s}  notes"]
    print("\n".join(lines), flush=True)
    records = []
    n = args.rows
    rng = np.random.default_rng(0)
    for o, k, tag in [(5632, 2048, "gate"), (2048, 5632, "down")]:
        w = nf4_quantize((0.02 * rng.standard_normal((o, k))).astype(np.float32), blocksize=64)
        packed, absmax = jnp.asarray(w.packed, jnp.uint8), nf4_absmax(w)
        wb = nf4_dequantize(w, jnp.bfloat16)  # the dense bf16 weight (for the bf16 baseline)
        x = jax.random.normal(jax.random.key(1), (n, k), jnp.float32).astype(jnp.bfloat16)
        g = jax.random.normal(jax.random.key(2), (n, o), jnp.float32)
        gb = g.astype(jnp.bfloat16)
        floor = bm.floor_ms(flops=2.0 * n * o * k, dtype="bf16")["floor_ms"]
        with jax.default_matmul_precision("highest"):
            ref_y = jax.jit(lambda x_: x_.astype(jnp.float32) @ nf4_dequantize(w, jnp.bfloat16).astype(
                jnp.float32).T)(x)
            ref_dx = jax.jit(lambda g_: g_ @ nf4_dequantize(w, jnp.bfloat16).astype(jnp.float32))(g)

        def xla_fwd(x_, p_, a_):
            wd = _dequant_xla(p_, a_, (o, k), 64, jnp.bfloat16)
            return jax.lax.dot_general(x_, wd, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        def xla_dx(g_, p_, a_):
            wd = _dequant_xla(p_, a_, (o, k), 64, jnp.bfloat16)
            return jnp.matmul(g_, wd.astype(jnp.float32))  # default precision: TF32 on an H100

        def bf16_fwd(x_, w_):
            return jax.lax.dot_general(x_, w_, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        def bf16_dx(g_, w_):
            return jnp.matmul(g_, w_, preferred_element_type=jnp.float32)

        def kern(fn, **kw):
            return jax.jit(functools.partial(fn, shape=(o, k), blocksize=64, interpret=None, w_dtype=jnp.bfloat16,
                                             out_dtype=jnp.float32, **kw))

        problems = {
            f"fwd {tag}": (x, ref_y, xla_fwd, bf16_fwd, (x, wb), nf4_matmul_fwd_pallas),
            f"dx {tag}": (g, ref_dx, xla_dx, bf16_dx, (gb, wb), nf4_matmul_dx_pallas),
        }
        for prob, (act, ref, xla_fn, bf16_fn, bf16_args, kfn) in problems.items():
            variants = [("xla dequant+dot", jax.jit(xla_fn), (act, packed, absmax)),
                        ("bf16 dot (dense bf16 W)", jax.jit(bf16_fn), bf16_args),
                        ("kernel default (tiled, lut=select)", kern(kfn), (act, packed, absmax))]
            if prob.startswith("dx"):
                variants.append(("kernel default, f32 dot at HIGHEST (no bf16 split)", kern(kfn, f32_split=False),
                                 (act, packed, absmax)))
            if args.sweep:
                variants.append(("kernel default, lut=gather", kern(kfn, lut="gather"), (act, packed, absmax)))
                for cfg in SWEEP:
                    bmm, bnn, bkk, nw, ns = cfg
                    variants.append((f"kernel tiled select {bmm}x{bnn}x{bkk} w{nw} s{ns}",
                                     kern(kfn, block_m=bmm, block_n=bnn, block_k=bkk, num_warps=nw, num_stages=ns),
                                     (act, packed, absmax)))
                variants.append(("kernel general path, 64^3 w4 s2, bf16 split, gather", kern(kfn, **(OLD | dict(
                    f32_split=True))), (act, packed, absmax)))
                variants.append(("kernel general path, 64^3 w4 s2, bf16 split, select", kern(kfn, **(OLD | dict(
                    f32_split=True, lut="select"))), (act, packed, absmax)))
            if not args.no_old:
                variants.append(("kernel OLD (general, 64^3, w4 s2, f32 HIGHEST)", kern(kfn, **OLD),
                                 (act, packed, absmax)))
            for name, fn, fargs in variants:
                if time.perf_counter() - t_start > args.budget_s:
                    print(f"# budget spent: {prob} {name} not run", flush=True)
                    records.append(dict(problem=prob, variant=name, error="budget"))
                    continue
                rec = dict(problem=prob, variant=name, rows=n, out=o, inp=k, floor_ms=floor)
                try:
                    t0 = time.perf_counter()
                    out = jax.block_until_ready(fn(*fargs))
                    rec["first_call_s"] = time.perf_counter() - t0
                    rec["rel_err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
                    slow = rec["first_call_s"] > 0.5
                    rec |= bm.time_fn(fn, *fargs, warmup=1 if slow else 3, repeats=3 if slow else 20)
                    rec["frac"] = None if floor is None else floor / rec["median_ms"]
                    line = (f"{prob:9s}  {name:58s}  {rec['median_ms']:9.3f}  {rec['p10_ms']:8.3f}  "
                            f"{rec['p90_ms']:8.3f}  {floor or float('nan'):8.3f}  {rec['frac'] or float('nan'):5.2f}  "
                            f"{rec['rel_err']:8.2e}  "
                            f"first call {rec['first_call_s']:.1f} s, {rec['repeats']} reps")
                except Exception as e:  # noqa: BLE001 -- a config Triton refuses is recorded, not fatal
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    line = f"{prob:9s}  {name:58s}  ERROR {rec['error']}"
                print(line, flush=True)
                lines.append(line)
                records.append(rec)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / bm.result_stem("nf4-matmul-timing", env, "bf16")
    base.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    base.with_suffix(".json").write_text(json.dumps(dict(env=env, records=records), indent=1, default=str))
    print(f"wrote {base}.txt / .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
