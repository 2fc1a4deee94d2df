r"""``fit(params, dataset, ...)`` (``jaxgrad.kan.fit``): pykan's ``model.fit(dataset, ...)`` for functional KAN
parameters.

It builds the KAN task (:func:`jaxgrad.kan.task.make_task`) on the dataset and runs the training engine's
:func:`jaxgrad.train.fit` on it (the same step, guards and L-BFGS plumbing as ``jaxgrad train kan``), in a
temporary run directory unless ``out`` is given. Differences from pykan, by design:

* parameters are values: ``params, results = fit(params, dataset)`` returns new ones (pykan updates the model);
* ``steps`` counts optimiser iterations. pykan's L-BFGS ``step`` is up to 20 iterations (``torch.optim.LBFGS``'s
  ``max_iter``), so pykan's ``steps=200`` is comparable to ``steps`` of a few thousand here;
* a grid update restarts the optimiser state (the engine's rule for a change of the parameters between steps;
  pykan keeps its L-BFGS history across it). With ``warmup_steps`` > 0, every restart begins with the Adam
  warm-up;
* no regularisation (``lamb``), no ``batch`` other than the full training set with L-BFGS, no ``metrics`` /
  ``save_fig`` / ``singularity_avoiding``: an unknown keyword is a ``TypeError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tempfile

import numpy as np

from jaxgrad.kan.data import check_dataset
from jaxgrad.kan.layer import spline_order
from jaxgrad.kan.network import kan_widths
from jaxgrad.kan.task import KANFit, make_task, rmse

__all__ = ["OPTIMIZERS", "fit"]

#: pykan's ``opt`` names (any case) and the engine's optimizer
OPTIMIZERS = {"lbfgs": "lbfgs", "adam": "adam", "adamw": "adamw", "sgd": "sgd"}


def fit(params, dataset: dict, opt: str = "LBFGS", steps: int = 100, log: int = 1, *, lr: float | None = None,
        warmup_steps: int = 0, warmup_lr: float | None = None, update_grid: bool = True, grid_update_num: int = 10,
        stop_grid_update_step: int = 50, grid_eps: float = 0.02, batch: int = -1, seed: int = 0,
        backend: str = "xla", grad_path: str = "custom_vjp", out=None, verbose: bool = False):
    r"""Train ``params`` (a network's list of layer dicts, :func:`jaxgrad.kan.kan_init`) on ``dataset``.

    Args:
      params: the starting parameters (their widths, grid and spline order define the model).
      dataset: pykan's dict ``train_input``, ``train_label``, ``test_input``, ``test_label``
        (:func:`jaxgrad.kan.create_dataset`, :func:`jaxgrad.kan.data.dataset_from_file`).
      opt: ``"LBFGS"`` (strong-Wolfe line search, no learning rate: ``lr`` must stay ``None``), ``"Adam"``,
        ``"AdamW"``, ``"SGD"`` (``lr``, default 1e-3). The positional order is pykan's: ``opt, steps, log``.
      steps: optimiser steps (L-BFGS iterations, Adam steps).
      log: steps between the recorded losses.
      warmup_steps, warmup_lr: with ``"LBFGS"``, Adam at ``warmup_lr`` (default 1e-2) for the first
        ``warmup_steps`` steps of each optimiser state, then L-BFGS (``train.lbfgs_warmup_steps``).
      update_grid, grid_update_num, stop_grid_update_step, grid_eps: pykan's grid updates: every
        ``stop_grid_update_step // grid_update_num`` steps while ``step < stop_grid_update_step`` the grids move to
        the samples (``grid_eps`` 0: their quantiles, 1: uniform over their range).
      batch: ``-1`` (full batch) or a mini-batch size (first-order optimizers).
      seed: the engine's seed (its RNG stream; the data order of mini-batches).
      backend, grad_path: ``kan_apply``'s backend and the engine's gradient path.
      out: a run directory to keep (checkpoint, ``metrics.jsonl``); ``None``: a temporary one.
      verbose: print the engine's lines.

    Returns:
      ``(params, results)``: the trained parameters, and ``results`` with pykan's ``train_loss`` and ``test_loss``
      (RMSE, one entry every ``log`` steps and at the end), ``step`` (the step of each entry) and ``eval`` (the
      task's final evaluation; per target when the dataset names its targets).
    """
    from jaxgrad.train import TrainConfig
    from jaxgrad.train import fit as engine_fit

    widths = kan_widths(params)
    if not isinstance(opt, str) or opt.lower() not in OPTIMIZERS:
        raise ValueError(f"fit: 'opt' must be one of {['LBFGS', 'Adam', 'AdamW', 'SGD']}, got {opt!r}")
    for name, v, lo in (("steps", steps, 1), ("log", log, 1), ("grid_update_num", grid_update_num, 0),
                        ("stop_grid_update_step", stop_grid_update_step, 0), ("warmup_steps", warmup_steps, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"fit: {name!r} must be an int >= {lo}, got {v!r}")
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or (batch != -1 and batch < 1):
        raise ValueError(f"fit: 'batch' must be -1 (full batch) or an int >= 1, got {batch!r}")
    xtr, ytr, xte, yte = check_dataset(dataset, "fit: 'dataset'")
    grids = {int(p["spline_weight"].shape[-1]) - spline_order(p) for p in params}
    if len(grids) != 1:
        raise ValueError(f"fit: every layer must have the same grid size (refine_network makes it so), got "
                         f"{sorted(grids)}")
    freq = stop_grid_update_step // grid_update_num if update_grid and grid_update_num else 0
    if update_grid and grid_update_num and not freq:
        raise ValueError(f"fit: grid updates every stop_grid_update_step // grid_update_num = "
                         f"{stop_grid_update_step} // {grid_update_num} = 0 steps; make stop_grid_update_step >= "
                         f"grid_update_num, or pass update_grid=False")
    dtype = np.dtype(params[0]["base_weight"].dtype).name
    kfit = KANFit(target=None, widths=tuple(widths), grids=(grids.pop(),), spline_order=spline_order(params[0]),
                  grid_update_every=freq, stop_grid_update_step=stop_grid_update_step if freq else 50,
                  grid_eps=grid_eps, backend=backend, dtype=dtype,
                  batch_size=None if batch == -1 else int(batch), data_seed=seed)
    task = make_task(kfit, steps, dataset)
    task = dataclasses.replace(task, init=lambda key: params)
    cfg = TrainConfig(steps=steps, optimizer=OPTIMIZERS[opt.lower()], lr=lr, lbfgs_warmup_steps=warmup_steps,
                      lbfgs_warmup_lr=warmup_lr, grad_path=grad_path, seed=seed, checkpoint_every=steps, keep=1,
                      log_every=min(log, steps), print_every=max(steps // 10, 1))
    results = {"train_loss": [], "test_loss": [], "step": []}

    def record(step, p, _loss):
        results["step"].append(step)
        results["train_loss"].append(rmse(p, xtr, ytr))
        results["test_loss"].append(rmse(p, xte, yte))

    def run(directory):
        quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
        with quiet:
            res = engine_fit(task, cfg, directory, hooks=((log, record),))
        if not results["step"] or results["step"][-1] != res.step:
            record(res.step, res.state["params"], None)
        return res

    if out is None:
        with tempfile.TemporaryDirectory(prefix="jaxgrad-kan-fit-") as tmp:
            res = run(tmp)
    else:
        res = run(out)
    results["eval"] = res.eval
    return list(res.state["params"]), results
