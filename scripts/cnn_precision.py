#!/usr/bin/env python
"""Rounding vs layout bugs in the cryo-EM denoiser's gradients: the numbers behind "float32 accumulation error?".

    PYTHONPATH=$PWD python3 scripts/cnn_precision.py --sizes 64,128,256,512,1024     # GPU: exact f32 and TF32
    PYTHONPATH=$PWD python3 scripts/cnn_precision.py --sizes 16,32 --out /tmp/p.json  # CPU: a quick check

For each size (batch 2, one channel, the seed network 1 -> 16 -> 16 -> 1 with a fixed init, white-noise input and
target) it runs :func:`jaxgrad.cnn.precision.precision_study`: the f32 loss and gradients at precision HIGHEST
(exact f32) and at JAX's default (TF32 on the GPU) against a float64 reference with its sums of |terms|, per layer;
the same errors for planted layout bugs (flip, kh<->kw transpose, O<->I swap, 1-pixel shift) applied to the f32
weight gradient; and ``check_vjp`` on one conv layer, correct and with a planted flip. It prints the tables and a
verdict computed from the numbers and writes everything as JSON (``--out``, default
``runs/bench/cnn-precision-<backend>-ref<device>-<device>-<precision>-<date>-<time>.json`` under the current
directory: git-ignored in a checkout, so a run never changes the repository; ``--out benchmarks/results/<name>.json``
adds it to the committed results), rewritten after each size so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

from jaxgrad.bench import harness as bm  # noqa: E402
from jaxgrad.cnn import precision as cp  # noqa: E402


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def _write(path: pathlib.Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_jsonable(payload), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,128,256,512,1024", help="comma-separated square image sizes")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precisions", default="highest,default", help="highest (exact f32), default (TF32 on GPU)")
    ap.add_argument("--backend", default="xla", choices=("xla", "pallas"), help="conv2d backend under test")
    ap.add_argument("--oracle", default="conv", choices=cp.ORACLES, help="float64 reference network")
    ap.add_argument("--reference-device", default=None, help="e.g. 'cpu' (default: the default device)")
    ap.add_argument("--no-bugs", action="store_true", help="skip the planted-bug rows")
    ap.add_argument("--no-verifier", action="store_true", help="skip check_vjp on one conv layer")
    ap.add_argument("--no-time-reference", action="store_true", help="do not time a plain float64 run")
    ap.add_argument("--out", default=None, help=f"JSON path (default {bm.DEFAULT_RESULTS_DIR}/cnn-precision-"
                                                 "<backend>-ref<device>-<device>-<precision>-<date>-<time>.json, "
                                                 "git-ignored)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]

    t_start = time.perf_counter()
    env = bm.environment()
    env["precisions"] = {p: cp.effective_precision(p)[0] for p in precisions}  # what "default" means here
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    prec = "highest" if precisions == ["highest"] else ("tf32" if env["platform"] == "gpu" else "default")
    suite = f"cnn-precision-{args.backend}-ref{args.reference_device or env['platform']}"
    out = pathlib.Path(args.out) if args.out else (
        pathlib.Path(bm.DEFAULT_RESULTS_DIR) / f"{suite}-{bm.device_slug(env['device_kind'])}-{prec}-{stamp}.json")
    print(f"device: {env['device_kind']} ({env['platform']}), jax {env['jax']}, matmul precision "
          f"{env['matmul_precision']}; precisions {env['precisions']}; sizes {sizes}, batch {args.batch}", flush=True)

    payload = {"environment": env, "args": vars(args), "rows": [], "verifier": [], "growth_exponents": {},
               "verdict": None, "complete": False}
    rows: list[dict] = []
    for size in sizes:
        rows += cp.precision_study([size], seed=args.seed, batch=args.batch, precisions=precisions,
                                   backend=args.backend, bugs=not args.no_bugs, oracle=args.oracle,
                                   reference_device=args.reference_device,
                                   time_reference=not args.no_time_reference,
                                   progress=lambda s: print("  " + s, flush=True))
        payload["rows"] = rows
        _write(out, payload)

    verifier = []
    if not args.no_verifier:
        print("  check_vjp on conv layer 2 (correct, planted flip) ...", flush=True)
        t0 = time.perf_counter()
        verifier = cp.verifier_demo(seed=args.seed, backend=args.backend)
        print(f"  check_vjp: {time.perf_counter() - t0:.1f} s", flush=True)

    print()
    print(cp.format_table(rows + verifier))
    for v in verifier:
        print()
        print(v["report"])
    text = cp.verdict(rows)
    print()
    print("VERDICT")
    print(text)
    payload.update(verifier=verifier, verdict=text, table=cp.format_table(rows + verifier), complete=True,
                   growth_exponents={f"{p}/{layer}": v for (p, layer), v in cp.growth_exponents(rows).items()},
                   total_s=time.perf_counter() - t_start)
    _write(out, payload)
    print(f"\nwrote {out} (total {time.perf_counter() - t_start:.1f} s)")
    ok = all(v["passed"] == (v["case"] == "correct") for v in verifier)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
