#!/usr/bin/env python
"""Reproduce pykan's function-fitting anchor (docs ``Example_1_function_fitting``) with jaxgrad's KAN layers.

    python scripts/kan_fit.py [--quick] [--out-dir runs/bench] [--grids 3,5,10,20,50] [--steps 200]

Task: ``f(x, y) = exp(sin(pi x) + y^2)`` on ``[-1, 1]^2``, 1000 train / 1000 test uniform samples, a ``[2, 1, 1]``
KAN with cubic splines (k = 3), trained in float64 on CPU with grid refinement ``G = 3, 5, 10, 20, 50``.

Per grid (pykan's ``model = model.refine(G); model.fit(dataset, opt="LBFGS", steps=200)``):

1. ``refine_network`` to the new ``G`` on the training inputs (lstsq refit; the function is preserved);
2. ``--steps`` pykan "steps", each ``--iters-per-step`` L-BFGS iterations (pykan's torch ``LBFGS`` runs
   ``max_iter=20`` iterations per ``step``, history 10, strong-Wolfe line search; here ``optax.lbfgs`` with its
   zoom (strong-Wolfe) line search, memory 10);
3. like pykan's ``fit(update_grid=True)``, ``update_grids`` from the training inputs at steps ``0, 5, ..., 45``
   (``grid_update_num=10``, ``stop_grid_update_step=50``); the L-BFGS memory restarts after each update, since
   the parameters jump.

Before the first grid's L-BFGS, ``--adam-steps`` (2000) full-batch Adam steps (lr 1e-2, grid update every 200):
with pure L-BFGS from efficient-kan's initialisation, optax's L-BFGS fell into a bad basin (RMSE 0.5-0.6, the x
edge left unused) for 3 of 4 seeds; with the Adam warm-up every seed tried reached ~1.7e-2 at G=3.
``--adam-steps 0`` gives the pure-L-BFGS run.

Every phase runs on the training engine (:func:`jaxgrad.train.train_in_memory`: jitted step, optax L-BFGS through
``optax.value_and_grad_from_state``, the NaN guard skipping a non-finite step, the grid updates as task
transitions that restart the optimiser state) with the model and data of :mod:`jaxgrad.kan.task`; this script
chains the phases and reports. The layer forward is ``kan_linear_reference`` (``backend="reference"``, plain JAX;
the model is tiny; ``--backend xla|pallas`` trains through the custom VJP instead). ``jaxgrad train kan`` is the
checkpointed, resumable run of the same fit. No bias, as in pykan's default
``MultKAN`` (its node affine parameters are frozen). Prints train/test RMSE per G next to pykan's reported values,
writes ``kan-fit-<device>-f64-<YYYYmmdd>-<HHMMSS>.json`` and the ``.png`` of the learned activations
(``kan-fit-quick-...`` with ``--quick``) into ``--out-dir`` (default ``runs/bench`` under the
current directory: git-ignored in a checkout, so a run never changes the repository; ``--out-dir
benchmarks/results`` adds them to the committed results).
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import optax  # noqa: E402

from jaxgrad.bench import harness as bm  # noqa: E402
from jaxgrad.kan.task import KANFit, make_dataset, make_task, refine_params, rmse  # noqa: E402
from jaxgrad.train import TrainConfig, train_in_memory  # noqa: E402

# pykan docs, Example_1_function_fitting (200 LBFGS steps per grid; refine 3 -> 10 -> 20 -> 50 -> 100)
PYKAN_REPORTED = {3: (1.46e-2, 1.53e-2), 10: (2.84e-4, 3.29e-4), 20: (4.21e-5, 4.04e-5), 50: (1.02e-5, 1.24e-5),
                  100: (1.64e-4, 1.74e-3)}


def phase(fit: KANFit, params, cfg: TrainConfig, *, update_every: int, stop_update: int):
    """``cfg.steps`` engine steps on grid ``params`` (fresh optimiser state), grid updates every ``update_every``
    steps while ``< stop_update`` (each restarts the optimiser state: the parameters jump)."""
    if cfg.steps == 0:
        return params
    grid = int(params[0]["spline_weight"].shape[-1] - fit.spline_order)
    task = make_task(KANFit(**{**fit.__dict__, "grids": (grid,), "refine_every": 0,
                               "grid_update_every": update_every, "stop_grid_update_step": stop_update}), cfg.steps)
    state, _ = train_in_memory(task, cfg, params)
    return state["params"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny version (for the test): G=3,5, 200 samples, few steps")
    ap.add_argument("--grids", default=None, help="comma-separated grid sizes (default 3,5,10,20,50)")
    ap.add_argument("--steps", type=int, default=None, help="pykan LBFGS steps per grid (default 200)")
    ap.add_argument("--iters-per-step", type=int, default=None, help="L-BFGS iterations per step (torch max_iter 20)")
    ap.add_argument("--grid-update-every", type=int, default=5, help="pykan steps between grid updates; 0 = none")
    ap.add_argument("--stop-grid-update-step", type=int, default=50)
    ap.add_argument("--memory-size", type=int, default=10)
    ap.add_argument("--linesearch", choices=["zoom", "backtracking"], default=None,
                    help="L-BFGS line search (default zoom = strong Wolfe)")
    ap.add_argument("--adam-steps", type=int, default=None,
                    help="Adam warm-up steps on the first grid (default 2000; 0 = pure L-BFGS)")
    ap.add_argument("--adam-lr", type=float, default=1e-2)
    ap.add_argument("--adam-grid-update-every", type=int, default=200)
    ap.add_argument("--backend", choices=["reference", "xla", "pallas"], default="reference",
                    help="KAN layer used for the gradients (default: plain-JAX reference)")
    ap.add_argument("--n-train", type=int, default=None)
    ap.add_argument("--n-test", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out-dir", default=bm.DEFAULT_RESULTS_DIR,
                    help="results directory (default: %(default)s, git-ignored; --out-dir benchmarks/results to "
                         "commit)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    q = args.quick
    grids = [int(g) for g in (args.grids or ("3,5" if q else "3,5,10,20,50")).split(",")]
    steps = args.steps if args.steps is not None else (10 if q else 200)
    ips = args.iters_per_step if args.iters_per_step is not None else (2 if q else 20)
    adam_steps = args.adam_steps if args.adam_steps is not None else (50 if q else 2000)
    n_train = args.n_train or (200 if q else 1000)
    n_test = args.n_test or (200 if q else 1000)
    linesearch = args.linesearch or "zoom"
    widths = (2, 1, 1)

    fit = KANFit(widths=widths, grids=(grids[0],), backend=args.backend, dtype="float64", n_train=n_train,
                 n_test=n_test, data_seed=args.seed)
    xtr, ytr, xte, yte = make_dataset(fit)
    layers = make_task(fit, 1).init(jax.random.key(args.seed))
    lbfgs = TrainConfig(steps=max(steps * ips, 1), optimizer="lbfgs", lbfgs_memory=args.memory_size,
                        linesearch=linesearch, nan_policy="skip", seed=args.seed)
    adam = TrainConfig(steps=max(adam_steps, 1), optimizer="adam", lr=args.adam_lr, nan_policy="skip",
                       seed=args.seed)
    every = args.adam_grid_update_every or max(adam_steps, 1)

    rows = []
    t_all = time.perf_counter()
    print(f"KAN {list(widths)}, k=3, float64, {n_train} train / {n_test} test; per grid {steps} steps x {ips} L-BFGS "
          f"iterations (grid updates every {args.grid_update_every} steps < {args.stop_grid_update_step}); "
          f"{adam_steps} Adam steps first on G={grids[0]}; gradients: {args.backend}")
    print(f"{'G':>4} {'train RMSE':>11} {'test RMSE':>11} {'pykan train':>12} {'pykan test':>11} {'time s':>7}")
    for gi, G in enumerate(grids):
        t0 = time.perf_counter()
        if gi > 0:
            layers = refine_params(layers, G, xtr)
        elif adam_steps:
            layers = phase(fit, layers, adam.replace(steps=adam_steps), update_every=every, stop_update=adam_steps)
        if steps * ips:
            layers = phase(fit, layers, lbfgs.replace(steps=steps * ips),
                           update_every=args.grid_update_every * ips, stop_update=args.stop_grid_update_step * ips)
        jax.block_until_ready(layers)
        dt = time.perf_counter() - t0
        row = {"G": G, "train_rmse": rmse(layers, xtr, ytr), "test_rmse": rmse(layers, xte, yte), "seconds": dt}
        ref = PYKAN_REPORTED.get(G)
        row["pykan_train_rmse"], row["pykan_test_rmse"] = ref if ref else (None, None)
        rows.append(row)
        fmt = lambda v: f"{v:.2e}" if v is not None else "-"  # noqa: E731
        print(f"{G:>4} {fmt(row['train_rmse']):>11} {fmt(row['test_rmse']):>11} {fmt(row['pykan_train_rmse']):>12} "
              f"{fmt(row['pykan_test_rmse']):>11} {dt:>7.1f}", flush=True)
    total = time.perf_counter() - t_all

    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = re.sub(r"[^a-z0-9]+", "-", jax.devices()[0].device_kind.lower()).strip("-")
    stem = f"kan-fit{'-quick' if q else ''}-{device}-f64-" + \
        datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    result = {
        "task": "pykan Example_1_function_fitting: f(x,y)=exp(sin(pi x)+y^2), width [2,1,1], k=3",
        "quick": q, "grids": grids, "steps_per_grid": steps, "lbfgs_iters_per_step": ips,
        "grid_update_every": args.grid_update_every, "stop_grid_update_step": args.stop_grid_update_step,
        "lbfgs_memory": args.memory_size, "linesearch": linesearch, "adam_steps_first_grid": adam_steps,
        "adam_lr": args.adam_lr, "backend": args.backend,
        "adam_grid_update_every": args.adam_grid_update_every, "n_train": n_train, "n_test": n_test,
        "seed": args.seed, "dtype": "float64", "device": str(jax.devices()[0]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "jax": jax.__version__, "optax": optax.__version__,
        "total_seconds": total, "results": rows,
    }
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {json_path} ({total:.1f} s total)")
    if not args.no_plot:
        from jaxgrad.kan.plot import plot_activations

        png = out_dir / f"{stem}.png"
        plot_activations(layers, png, title=f"exp(sin(pi x) + y^2), [2,1,1], G={grids[-1]}")
        print(f"wrote {png}")
    return result


if __name__ == "__main__":
    main()
