#!/usr/bin/env python
"""Reproduce pykan's function-fitting anchor (docs ``Example_1_function_fitting``) with jaxgrad's KAN layers.

    python scripts/kan_fit.py [--quick] [--out-dir benchmarks/results] [--grids 3,5,10,20,50] [--steps 200]

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

The layer forward is ``kan_linear_reference`` (plain JAX; the model is tiny). No bias, as in pykan's default
``MultKAN`` (its node affine parameters are frozen). Prints train/test RMSE per G next to pykan's reported values,
writes ``kan_fit_<date>.json`` and ``kan_fit_activations.png`` into ``--out-dir``.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxgrad.kan.grid import refine_network, update_grids  # noqa: E402
from jaxgrad.kan.layer import KANConfig, init, kan_linear_reference  # noqa: E402

# pykan docs, Example_1_function_fitting (200 LBFGS steps per grid; refine 3 -> 10 -> 20 -> 50 -> 100)
PYKAN_REPORTED = {3: (1.46e-2, 1.53e-2), 10: (2.84e-4, 3.29e-4), 20: (4.21e-5, 4.04e-5), 50: (1.02e-5, 1.24e-5),
                  100: (1.64e-4, 1.74e-3)}


def target(x):
    return jnp.exp(jnp.sin(jnp.pi * x[:, :1]) + x[:, 1:2] ** 2)


def make_dataset(n_train, n_test, seed):
    rng = np.random.default_rng(seed)
    xtr = jnp.asarray(rng.uniform(-1, 1, (n_train, 2)))
    xte = jnp.asarray(rng.uniform(-1, 1, (n_test, 2)))
    return xtr, target(xtr), xte, target(xte)


def forward(layers, x):
    for p in layers:
        x = kan_linear_reference(p, x)
    return x


def split(layers):
    train = [{n: v for n, v in p.items() if n != "grid"} for p in layers]
    grids = [p["grid"] for p in layers]
    return train, grids


def merge(train, grids):
    return [dict(t, grid=g) for t, g in zip(train, grids)]


def rmse(layers, x, y):
    return float(jnp.sqrt(jnp.mean((forward(layers, x) - y) ** 2)))


def make_runner(memory_size):
    opt = optax.lbfgs(memory_size=memory_size)

    def run(train, grids, x, y, n_iters):
        def loss(tr):
            return jnp.mean((forward(merge(tr, grids), x) - y) ** 2)

        value_and_grad = optax.value_and_grad_from_state(loss)

        def body(_, carry):
            tr, state = carry
            value, grad = value_and_grad(tr, state=state)
            updates, new_state = opt.update(grad, state, tr, value=value, grad=grad, value_fn=loss)
            new_tr = optax.apply_updates(tr, updates)
            ok = jnp.isfinite(optax.tree.get(new_state, "value"))  # never step into a NaN
            new_tr = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_tr, tr)
            new_state = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_state, state)
            return new_tr, new_state

        tr, _ = jax.lax.fori_loop(0, n_iters, body, (train, opt.init(train)))
        return tr

    return jax.jit(run)


_update_grids_jit = jax.jit(update_grids)  # x is checked for NaN/Inf by make_dataset's construction
_refine_network_jit = jax.jit(refine_network, static_argnums=1)


def fit_stage(layers, xtr, ytr, *, steps, iters_per_step, grid_update_every, stop_grid_update_step, runner):
    """One pykan ``fit``: grid updates at steps 0, every, ..., < stop; L-BFGS in between (memory reset at each)."""
    update_steps = [s for s in range(0, min(steps, stop_grid_update_step), grid_update_every)] if grid_update_every \
        else []
    bounds = update_steps + [steps]
    if not update_steps or update_steps[0] != 0:
        bounds = [0] + bounds
    for s0, s1 in zip(bounds[:-1], bounds[1:]):
        if s0 in update_steps:
            layers = _update_grids_jit(layers, xtr)
        if s1 > s0:
            train, grids = split(layers)
            train = runner(train, grids, xtr, ytr, (s1 - s0) * iters_per_step)
            layers = merge(train, grids)
    return layers


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny version (test): G=3,5, 200 samples, 10 steps")
    ap.add_argument("--grids", default=None, help="comma-separated grid sizes (default 3,5,10,20,50)")
    ap.add_argument("--steps", type=int, default=None, help="pykan LBFGS steps per grid (default 200)")
    ap.add_argument("--iters-per-step", type=int, default=20, help="L-BFGS iterations per step (torch max_iter)")
    ap.add_argument("--grid-update-every", type=int, default=5, help="0 = only refine, no fit-time grid updates")
    ap.add_argument("--stop-grid-update-step", type=int, default=50)
    ap.add_argument("--memory-size", type=int, default=10)
    ap.add_argument("--n-train", type=int, default=None)
    ap.add_argument("--n-test", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out-dir", default=str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks/results"))
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    grids = [int(g) for g in (args.grids or ("3,5" if args.quick else "3,5,10,20,50")).split(",")]
    steps = args.steps if args.steps is not None else (10 if args.quick else 200)
    n_train = args.n_train or (200 if args.quick else 1000)
    n_test = args.n_test or (200 if args.quick else 1000)
    ips = 2 if args.quick and args.iters_per_step == 20 else args.iters_per_step

    xtr, ytr, xte, yte = make_dataset(n_train, n_test, args.seed)
    keys = jax.random.split(jax.random.key(args.seed), 2)
    widths = [2, 1, 1]
    layers = [init(kk, KANConfig(a, b, grid_size=grids[0], spline_order=3), jnp.float64)
              for kk, a, b in zip(keys, widths[:-1], widths[1:])]
    runner = make_runner(args.memory_size)

    rows = []
    t_all = time.perf_counter()
    print(f"KAN {widths}, k=3, float64, {n_train} train / {n_test} test, {steps} steps x {ips} L-BFGS iters per grid")
    print(f"{'G':>4} {'train RMSE':>11} {'test RMSE':>11} {'pykan train':>12} {'pykan test':>11} {'time s':>7}")
    for gi, G in enumerate(grids):
        t0 = time.perf_counter()
        if gi > 0:
            layers = _refine_network_jit(layers, G, xtr)
        layers = fit_stage(layers, xtr, ytr, steps=steps, iters_per_step=ips, grid_update_every=args.grid_update_every,
                           stop_grid_update_step=args.stop_grid_update_step, runner=runner)
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
    stamp = datetime.datetime.now().strftime("%Y%m%d")
    result = {
        "task": "pykan Example_1_function_fitting: f(x,y)=exp(sin(pi x)+y^2), width [2,1,1], k=3",
        "quick": args.quick, "grids": grids, "steps_per_grid": steps, "lbfgs_iters_per_step": ips,
        "grid_update_every": args.grid_update_every, "stop_grid_update_step": args.stop_grid_update_step,
        "lbfgs_memory": args.memory_size, "n_train": n_train, "n_test": n_test, "seed": args.seed,
        "dtype": "float64", "device": str(jax.devices()[0]), "machine": platform.processor() or platform.machine(),
        "jax": jax.__version__, "total_seconds": total, "results": rows,
    }
    json_path = out_dir / f"kan_fit_{stamp}{'_quick' if args.quick else ''}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {json_path} ({total:.1f} s total)")
    if not args.no_plot:
        from jaxgrad.kan.plot import plot_activations

        png = out_dir / ("kan_fit_activations_quick.png" if args.quick else "kan_fit_activations.png")
        plot_activations(layers, png, title=f"exp(sin(pi x) + y^2), [2,1,1], G={grids[-1]}")
        print(f"wrote {png}")
    return result


if __name__ == "__main__":
    main()
