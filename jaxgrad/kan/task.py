r"""The KAN function fit (pykan's ``Example_1_function_fitting``) as a :class:`jaxgrad.train.Task`.

Data: ``n_train`` / ``n_test`` points uniform on ``[-1, 1]^d`` (numpy generator of ``data_seed``), targets from
:data:`TARGETS` (default ``exp(sin(pi x) + y^2)``). Model: ``KAN(widths)`` with spline order ``spline_order`` on
grid ``grids[0]``, refined to ``grids[1], grids[2], ...`` every ``refine_every`` steps
(:func:`jaxgrad.kan.grid.refine_network`, least-squares refit on the training inputs; shapes change, so the
optimiser state restarts and the step retraces once per grid). Optional pykan-style grid updates
(:func:`jaxgrad.kan.grid.update_grids`) every ``grid_update_every`` steps of each grid while
``< stop_grid_update_step`` steps into it.

Loss: item ``i`` is one sample, :math:`\ell_i = \frac{1}{d_{out}} \sum_o (f(x_i)_o - y_{io})^2`, returned as
:math:`(\sum_i \ell_i, B)`: the engine's loss is the MSE. ``grad_path="custom_vjp"`` differentiates
:func:`jaxgrad.kan.network.kan_apply` (``backend`` ``"xla"`` or ``"pallas"``: hand-written VJP / kernels),
``"reference"`` differentiates :func:`~jaxgrad.kan.network.kan_apply_reference`. The knot grids are not trained
(:func:`~jaxgrad.kan.network.trainable_mask`).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.kan.grid import refine_network, update_grids
from jaxgrad.kan.network import kan_apply, kan_apply_reference, kan_init, trainable_mask
from jaxgrad.train.errors import ConfigError
from jaxgrad.train.task import Task

TARGETS = {
    "exp_sin_pi_x_plus_y2": (2, lambda x: jnp.exp(jnp.sin(jnp.pi * x[:, :1]) + x[:, 1:2] ** 2)),
    "sin_pi_x": (1, lambda x: jnp.sin(jnp.pi * x[:, :1])),
}
BACKENDS = ("xla", "pallas", "reference")


@dataclasses.dataclass(frozen=True)
class KANFit:
    """The fit's model and data (everything that defines the params' shapes and the data order)."""

    target: str = "exp_sin_pi_x_plus_y2"
    widths: tuple[int, ...] = (2, 1, 1)
    grids: tuple[int, ...] = (3,)
    refine_every: int = 0
    spline_order: int = 3
    grid_update_every: int = 0
    stop_grid_update_step: int = 50
    backend: str = "xla"
    dtype: str = "float32"
    n_train: int = 1000
    n_test: int = 1000
    batch_size: int | None = None
    data_seed: int = 1

    def __post_init__(self):
        def need(cond, field, expected):
            if not cond:
                raise ConfigError(f"KAN fit: '{field}' must be {expected}, got {getattr(self, field)!r}")

        need(self.target in TARGETS, "target", f"one of {tuple(TARGETS)}")
        object.__setattr__(self, "widths", tuple(self.widths))
        object.__setattr__(self, "grids", tuple(self.grids))
        need(len(self.widths) >= 2 and all(isinstance(w, int) and w >= 1 for w in self.widths), "widths",
             "at least two ints >= 1")
        need(self.widths[0] == TARGETS[self.target][0], "widths",
             f"a list starting with {TARGETS[self.target][0]} (the inputs of target {self.target!r})")
        need(self.grids and all(isinstance(g, int) and g >= 1 for g in self.grids), "grids", "ints >= 1")
        need(len(self.grids) == 1 or self.refine_every >= 1, "refine_every", ">= 1 when several grids are given")
        need(self.backend in BACKENDS, "backend", f"one of {BACKENDS}")
        need(self.dtype in ("float32", "float64"), "dtype", "'float32' or 'float64'")
        for f in ("n_train", "n_test", "spline_order", "data_seed"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) >= (0 if f == "data_seed" else 1), f,
                 "a positive int")
        need(self.batch_size is None or (isinstance(self.batch_size, int) and 1 <= self.batch_size <= self.n_train),
             "batch_size", f"None (full batch) or an int in 1..n_train={self.n_train}")
        if self.dtype == "float64" and not jax.config.jax_enable_x64:
            raise ConfigError("KAN fit: dtype 'float64' needs jax_enable_x64 (set it before creating arrays)")

    @property
    def refine_steps(self) -> tuple[int, ...]:
        return tuple(i * self.refine_every for i in range(1, len(self.grids)))

    def grid_update_steps(self, total: int) -> tuple[int, ...]:
        if not self.grid_update_every:
            return ()
        starts = (0, *self.refine_steps)
        ends = (*self.refine_steps, total)
        return tuple(s + u for s, e in zip(starts, ends)
                     for u in range(0, min(e - s, self.stop_grid_update_step), self.grid_update_every))


def make_dataset(fit: KANFit):
    """``(x_train, y_train, x_test, y_test)`` as numpy arrays of ``fit.dtype``."""
    d, f = TARGETS[fit.target]
    rng = np.random.default_rng(fit.data_seed)
    dt = np.dtype(fit.dtype)
    xtr = rng.uniform(-1, 1, (fit.n_train, d)).astype(dt)
    xte = rng.uniform(-1, 1, (fit.n_test, d)).astype(dt)
    return xtr, np.asarray(f(jnp.asarray(xtr))), xte, np.asarray(f(jnp.asarray(xte)))


def per_item_sq_err_sum(pred, y):
    return jnp.sum(jnp.mean(jnp.square(pred - y), axis=-1)), pred.shape[0]


_refine = jax.jit(refine_network, static_argnums=1)
_update = jax.jit(update_grids)


def refine_params(params, grid_size: int, x):
    """:func:`~jaxgrad.kan.grid.refine_network` (jitted) to ``grid_size`` on the samples ``x``."""
    return _refine(params, grid_size, jnp.asarray(x))


def make_task(fit: KANFit, total_steps: int) -> Task:
    xtr, ytr, xte, yte = make_dataset(fit)
    refine_at = dict(zip(fit.refine_steps, fit.grids[1:]))
    updates = set(fit.grid_update_steps(total_steps))
    dtype = jnp.dtype(fit.dtype)

    def init(key):
        return kan_init(key, fit.widths, dtype=dtype, grid_size=fit.grids[0], spline_order=fit.spline_order)

    def loss(params, batch):
        x, y = batch
        return per_item_sq_err_sum(kan_apply(params, x, backend="reference" if fit.backend == "reference" else
                                             fit.backend), y)

    def reference_loss(params, batch):
        x, y = batch
        return per_item_sq_err_sum(kan_apply_reference(params, x), y)

    bs = fit.batch_size or fit.n_train
    nb = fit.n_train // bs

    def batches(epoch):
        if bs == fit.n_train:
            yield xtr, ytr
            return
        order = np.random.default_rng([fit.data_seed, epoch]).permutation(fit.n_train)
        for i in range(nb):
            idx = order[i * bs:(i + 1) * bs]
            yield xtr[idx], ytr[idx]

    def transition(params, step):
        if step in refine_at:
            params = _refine(params, refine_at[step], xtr)
        if step in updates:
            params = _update(params, xtr)
        return params

    def evaluate(params):
        return {"train_rmse": rmse(params, xtr, ytr), "test_rmse": rmse(params, xte, yte),
                "grid_size": int(params[0]["spline_weight"].shape[-1] - fit.spline_order)}

    return Task("kan", init=init, loss=loss, reference_loss=reference_loss, batches=batches, batches_per_epoch=nb,
                evaluate=evaluate, transition=transition, transition_steps=tuple(sorted(set(refine_at) | updates)),
                trainable=trainable_mask,
                describe=f"KAN {list(fit.widths)}, k={fit.spline_order}, grids {list(fit.grids)}"
                         f"{f' (refined every {fit.refine_every} steps)' if len(fit.grids) > 1 else ''}, "
                         f"{fit.dtype}, backend {fit.backend}; {fit.target}: {fit.n_train} train / {fit.n_test} test, "
                         f"batch {bs}")


@functools.partial(jax.jit)
def _rmse(params, x, y):
    return jnp.sqrt(jnp.mean((kan_apply_reference(params, x) - y) ** 2))


def rmse(params, x, y) -> float:
    return float(_rmse(params, jnp.asarray(x), jnp.asarray(y)))


# ----------------------------------------------------------------------------------------------------------------
# `jaxgrad train kan`
# ----------------------------------------------------------------------------------------------------------------

CLI_SCHEMA = {
    "model": {"widths": ("ints", [2, 1, 1]), "grids": ("ints", [3, 5, 10]), "refine_every": ("int", 200),
              "spline_order": ("int", 3), "grid_update_every": ("int", 0), "stop_grid_update_step": ("int", 50),
              "backend": ("str", "xla", BACKENDS), "dtype": ("str", "float64", ("float32", "float64"))},
    "data": {"target": ("str", "exp_sin_pi_x_plus_y2", tuple(TARGETS)), "n_train": ("int", 1000),
             "n_test": ("int", 1000), "batch_size": ("int?", None), "seed": ("int", 1)},
}
CLI_TRAIN_DEFAULTS = {"optimizer": "lbfgs", "steps": 600, "log_every": 10, "checkpoint_every": 100}
# on --resume these may not change: they define the params' shapes or the data order
CLI_FIXED = {"model": ("widths", "grids", "refine_every", "spline_order", "grid_update_every",
                       "stop_grid_update_step", "dtype"), "data": "*"}


def needs_x64(cfg: dict) -> bool:
    return cfg["model"]["dtype"] == "float64"


def fit_from_config(cfg: dict) -> KANFit:
    m, d = cfg["model"], cfg["data"]
    return KANFit(target=d["target"], widths=tuple(m["widths"]), grids=tuple(m["grids"]),
                  refine_every=m["refine_every"], spline_order=m["spline_order"],
                  grid_update_every=m["grid_update_every"], stop_grid_update_step=m["stop_grid_update_step"],
                  backend=m["backend"], dtype=m["dtype"], n_train=d["n_train"], n_test=d["n_test"],
                  batch_size=d["batch_size"], data_seed=d["seed"])


def cli_task(cfg: dict, out, say):
    """``(task, finish)`` for ``jaxgrad train kan``; ``finish(result) -> summary dict`` writes the plot."""
    fit = fit_from_config(cfg)
    task = make_task(fit, cfg["train"]["steps"])

    def finish(result):
        summary = {"eval": result.eval}
        try:
            from jaxgrad.kan.plot import plot_activations
        except ImportError:  # matplotlib is optional
            return summary
        png = plot_activations(result.state["params"], pathlib.Path(out) / "activations.png",
                               title=f"{fit.target}, {list(fit.widths)}, G={fit.grids[-1]}")
        summary["activations_png"] = str(png)
        return summary

    return task, finish


CLI_OUTPUTS = ("activations.png",)
