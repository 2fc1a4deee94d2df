"""Stage 2 of ``jaxgrad demo``: fit a KAN to ``exp(sin(pi x) + y^2)`` with grid refinement (pykan's first example).

A ``[2, 1, 1]`` KAN with cubic splines, in float64, trained by the engine (:func:`jaxgrad.train.train_in_memory`)
on the task of :mod:`jaxgrad.kan.task` through the hand-written KAN VJP (``backend="xla"``):

1. Adam on the first grid, with pykan-style grid updates (the knots follow the data) at steps 0 and 200;
2. L-BFGS on every grid in turn; between grids, :func:`jaxgrad.kan.task.refine_params` refits the splines on a
   finer knot grid (a least-squares fit that keeps the learned function), so training continues where it was.

The test RMSE after each grid's training is recorded: refinement should lower it by an order of magnitude.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.demo.plan import DemoPlan

TARGET = "exp_sin_pi_x_plus_y2"
TARGET_TEXT = "exp(sin(pi x) + y^2)"
WIDTHS = (2, 1, 1)
ADAM_LR = 1e-2
ADAM_GRID_UPDATE_EVERY = 200
# updates only early on: each one moves the knots and restarts Adam's moments (a loss spike), and later ones no
# longer change the data range the grid covers
ADAM_GRID_UPDATE_UNTIL = 400


@dataclasses.dataclass(frozen=True)
class GridFit:
    """The fit after training on grid ``grid`` (``steps``: the stage's steps so far)."""

    grid: int
    train_rmse: float
    test_rmse: float
    steps: int


@dataclasses.dataclass(frozen=True)
class KANResult:
    """``losses[i]``: training MSE of step ``i + 1`` (NaN where the engine skipped a non-finite step);
    ``phases``: ``(first step, label)`` of each phase; ``params``: the final layers as numpy float64 arrays."""

    per_grid: tuple[GridFit, ...]
    losses: np.ndarray
    phases: tuple[tuple[int, str], ...]
    params: list
    n_train: int
    n_test: int
    seconds: float

    @property
    def rmse_before_refinement(self) -> float:
        return self.per_grid[0].test_rmse

    @property
    def rmse_after_refinement(self) -> float:
        return self.per_grid[-1].test_rmse


def _train_phase(fit, params, cfg, grid: int, update_every: int = 0, update_until: int = 0):
    """``cfg.steps`` engine steps on grid ``grid`` from ``params`` (fresh optimiser state), with grid updates every
    ``update_every`` steps before step ``update_until``; returns ``(params, losses)``."""
    from jaxgrad.kan.task import KANFit, make_task
    from jaxgrad.train import train_in_memory

    phase_fit = KANFit(**{**fit.__dict__, "grids": (grid,), "refine_every": 0, "grid_update_every": update_every,
                          "stop_grid_update_step": update_until})
    state, losses = train_in_memory(make_task(phase_fit, cfg.steps), cfg, params)
    return state["params"], np.asarray(jnp.stack(losses), np.float64)


def run_kan(plan: DemoPlan, seed: int = 0) -> KANResult:
    """Train the KAN of the plan; float64 is enabled for this stage only (``jax.enable_x64``)."""
    from jaxgrad.kan.task import KANFit, make_dataset, make_task, refine_params, rmse
    from jaxgrad.train import TrainConfig

    t0 = time.perf_counter()
    with jax.enable_x64(True):
        fit = KANFit(target=TARGET, widths=WIDTHS, grids=plan.kan_grids[:1], backend="xla", dtype="float64",
                     n_train=plan.kan_n_train, n_test=plan.kan_n_test)
        xtr, ytr, xte, yte = make_dataset(fit)
        params = make_task(fit, 1).init(jax.random.key(seed))
        # nan_policy "skip": a line-search step that overflows is dropped by the engine's guard, not fatal
        adam = TrainConfig(steps=max(plan.kan_adam_steps, 1), optimizer="adam", lr=ADAM_LR, nan_policy="skip",
                           seed=seed)
        lbfgs = TrainConfig(steps=max(plan.kan_lbfgs_steps, 1), optimizer="lbfgs", nan_policy="skip", seed=seed)
        curves, phases, per_grid, step = [], [], [], 0
        for i, grid in enumerate(plan.kan_grids):
            if i == 0 and plan.kan_adam_steps:
                phases.append((step, f"Adam, G={grid}"))
                params, losses = _train_phase(fit, params, adam, grid, ADAM_GRID_UPDATE_EVERY, ADAM_GRID_UPDATE_UNTIL)
                curves.append(losses)
                step += len(losses)
            if i > 0:
                params = refine_params(params, grid, xtr)
            if plan.kan_lbfgs_steps:
                phases.append((step, f"L-BFGS, G={grid}"))
                params, losses = _train_phase(fit, params, lbfgs, grid)
                curves.append(losses)
                step += len(losses)
            per_grid.append(GridFit(grid=grid, train_rmse=rmse(params, xtr, ytr), test_rmse=rmse(params, xte, yte),
                                    steps=step))
        params = jax.tree.map(lambda a: np.asarray(a), params)
    return KANResult(per_grid=tuple(per_grid), losses=np.concatenate(curves), phases=tuple(phases), params=params,
                     n_train=plan.kan_n_train, n_test=plan.kan_n_test, seconds=time.perf_counter() - t0)
