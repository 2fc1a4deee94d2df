#!/usr/bin/env python
"""The floor of pykan's Example 1 at a given grid: the least test RMSE a [2, 1, 1] KAN (k = 3) reaches on
exp(sin(pi x) + y^2), by knot placement, computed by jaxgrad.kan.fit_floor (float64, CPU).

    python scripts/kan_fit_floor.py [--grid 3] [--restarts 8] [--random-inits 4] [--out-dir benchmarks/results]

Per placement (``--grid-eps`` values with the knots spanning the samples' range, as pykan and the grid updates
place them, then ``--overhangs``: knot intervals of the inputs' range left outside the input layer's knots): the
linearised floor (each inner edge's least-squares residual and their F'-weighted joint one) and the joint fit's best
and every start's train / test RMSE. The data are ``jaxgrad train kan``'s (``configs/kan.toml``: 1000 / 1000 points,
data seed 1). Writes ``kan-fit-floor-cpu-f64-<YYYYmmdd>-<HHMMSS>.json`` with the bench results' ``environment``
block into ``--out-dir`` (default ``runs/bench``, git-ignored).
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

from jaxgrad.bench import harness as bm  # noqa: E402
from jaxgrad.kan.fit_floor import Placement, joint_fit, linearised_floor, place_grids, start_network  # noqa: E402
from jaxgrad.kan.task import KANFit, make_dataset  # noqa: E402

INNER = (lambda t: jnp.sin(jnp.pi * t), lambda t: t ** 2)
OUTER = jnp.exp


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", type=int, default=3)
    ap.add_argument("--grid-eps", default="1,0.5,0", help="grid_eps values, knots spanning the samples' range")
    ap.add_argument("--overhangs", default="0.5,1,1.5", help="input-layer overhangs in knot intervals (grid_eps 1)")
    ap.add_argument("--restarts", type=int, default=8, help="least-squares start and its perturbations")
    ap.add_argument("--random-inits", type=int, default=4, help="pykan inits")
    ap.add_argument("--rounds", type=int, default=4, help="L-BFGS + grid update rounds per start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=bm.DEFAULT_RESULTS_DIR)
    args = ap.parse_args(argv)

    fit = KANFit(dtype="float64")
    data = make_dataset(fit)
    placements = [Placement(grid_eps=float(e)) for e in args.grid_eps.split(",") if e] + \
        [Placement(grid_eps=1.0, input_overhang=float(a)) for a in args.overhangs.split(",") if a]
    env = bm.environment()
    t_all = time.perf_counter()
    rows = []
    print(f"exp(sin(pi x) + y^2), [2, 1, 1], k=3, G={args.grid}, {fit.n_train} train / {fit.n_test} test, float64")
    print(f"{'grid_eps':>8} {'overhang':>8} {'sin edge':>9} {'y^2 edge':>9} {'linearised':>10} {'LS start':>9} "
          f"{'best train':>10} {'best test':>10} {'tests of all starts':>22}")
    for pl in placements:
        start = start_network(jnp.asarray(data[0]), INNER, OUTER, args.grid, 3, pl)
        grids = place_grids(start, jnp.asarray(data[0]), pl)[0]["grid"]
        lin = linearised_floor(data[0], INNER, OUTER, grids, 3)
        res = joint_fit(data, INNER, OUTER, grid_size=args.grid, placement=pl, restarts=args.restarts,
                        random_inits=args.random_inits, rounds=args.rounds, seed=args.seed)
        res["linearised_floor"] = lin
        rows.append(res)
        tests = sorted(r["test_rmse"] for r in res["runs"])
        print(f"{pl.grid_eps:>8g} {pl.input_overhang:>8g} {lin['edge_rmse'][0]:>9.2e} {lin['edge_rmse'][1]:>9.2e} "
              f"{lin['rmse']:>10.3e} {res['least_squares_start']['test_rmse']:>9.2e} "
              f"{res['best']['train_rmse']:>10.3e} {res['best']['test_rmse']:>10.3e} "
              f"{tests[0]:.2e} .. {tests[-1]:.2e}", flush=True)
    total = time.perf_counter() - t_all
    stem = "kan-fit-floor-cpu-f64-" + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"environment": env,
               "task": "pykan Example_1_function_fitting: f(x,y)=exp(sin(pi x)+y^2), width [2,1,1], k=3",
               "grid_size": args.grid, "n_train": fit.n_train, "n_test": fit.n_test, "data_seed": fit.data_seed,
               "args": vars(args), "total_seconds": total, "placements": rows}
    path = out / f"{stem}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path} ({total:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
