"""The ``lora_curve_drift`` tool: how far two f32 training runs that differ only by rounding drift apart over 100
steps (issue #12, item 6).

The issue asks that the custom-VJP and `jax.grad` paths give the same f32 loss curve to 1e-5 relative per step over
100 steps. This script measures that drift next to the drift of the *reference path against itself* when its
initial LoRA A factors are moved by one f32 ulp -- the same training, the same code, a rounding-sized change. If the
self-drift is as large as the paths' drift, the 1e-5 criterion sits below the training dynamics' own noise floor at
f32 and cannot tell a correct backward from a wrong one; the paths' agreement is then shown by float64 (see
tests/test_train_lora.py) and per step by the verifier.

    python -m jaxgrad.bench lora_curve_drift [--steps 100] [--out runs/bench]

The JSON, ``lora-curve-drift-<device>-<precision>-<YYYYmmdd>-<HHMMSS>.json`` (UTC; ``default`` on a CPU, ``tf32`` on
an NVIDIA GPU), goes to ``runs/bench/`` under the current directory by default (git-ignored in a checkout, so a run
never changes the repository); ``--out benchmarks/results`` adds it to the committed results.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import numpy as np

from jaxgrad.bench import harness as bm
from jaxgrad.lora.task import LoraFit, make_task
from jaxgrad.train import TrainConfig, train_in_memory

FIT = LoraFit(mode="lora", init_lora_weights=False, n_bytes=16384, batch_size=4)  # as tests/test_train_lora.py
CFG = dict(optimizer="adam", lr=3e-3, seed=3)


def _nudge_a(params):
    """Every LoRA A entry moved one f32 ulp up: a change of the size rounding makes."""
    def f(path, x):
        name = jax.tree_util.keystr(path)
        return np.nextafter(np.asarray(x), np.float32(np.inf)) if "lora_A" in name else x
    return jax.tree_util.tree_map_with_path(f, params)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxgrad.bench lora_curve_drift",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=bm.DEFAULT_RESULTS_DIR,
                    help="results directory (default: %(default)s, git-ignored; --out benchmarks/results to commit)")
    args = ap.parse_args(argv)
    env = bm.environment()
    print(f"# lora_curve_drift: {env['device_kind']} ({env['platform']}), jax {env['jax']}, {env['datetime_utc']}")
    print(f"# commit {env['commit']} (uncommitted changes: {env['dirty']}); command: {env['command']}")
    task = make_task(FIT)
    init = jax.device_get(task.init(jax.random.key(CFG["seed"])))
    curves = {}
    for name, path, params in (("custom_vjp", "custom_vjp", init), ("reference", "reference", init),
                               ("reference_nudged", "reference", _nudge_a(init)),
                               ("custom_vjp_nudged", "custom_vjp", _nudge_a(init))):
        t0 = time.perf_counter()
        _, losses = train_in_memory(task, TrainConfig(**CFG, steps=args.steps, grad_path=path), params=params)
        curves[name] = np.array([float(x) for x in losses])
        print(f"{name:18s} {args.steps} steps in {time.perf_counter() - t0:.0f} s: loss {curves[name][0]:.4f} -> "
              f"{curves[name][-1]:.4f}")

    def drift(a, b):
        rel = np.abs(curves[a] - curves[b]) / np.abs(curves[b])
        return {"max": float(rel.max()), "at_step_20": float(rel[:20].max()), "at_step_50": float(rel[:50].max()),
                "per_step": rel.tolist()}

    out = {"environment": env, "config": {**CFG, "steps": args.steps, "fit": str(FIT)},
           "paths": drift("custom_vjp", "reference"),
           "reference_vs_itself_nudged": drift("reference_nudged", "reference"),
           "custom_vjp_vs_itself_nudged": drift("custom_vjp_nudged", "custom_vjp"),
           "curves": {k: v.tolist() for k, v in curves.items()}}
    for k in ("paths", "reference_vs_itself_nudged", "custom_vjp_vs_itself_nudged"):
        d = out[k]
        print(f"{k:28s} max relative loss difference: first 20 steps {d['at_step_20']:.1e}, first 50 "
              f"{d['at_step_50']:.1e}, all {args.steps} {d['max']:.1e}")
    stem = bm.result_stem("lora-curve-drift", env, bm.precision_slug(None, (), env["platform"]))
    p = pathlib.Path(args.out) / f"{stem}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(bm._jsonable(out), indent=1) + "\n")
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
