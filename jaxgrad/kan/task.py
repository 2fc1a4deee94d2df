r"""The KAN function fit as a :class:`jaxgrad.train.Task`: pykan's ``Example_1_function_fitting``, or your data.

Data: a built-in target (:data:`TARGETS`, default ``exp(sin(pi x) + y^2)``) on ``n_train`` / ``n_test`` points
uniform on ``[-1, 1]^d`` (numpy generator of ``data_seed``), or a dataset dict (:mod:`jaxgrad.kan.data`:
``create_dataset``, ``dataset_from_file``) passed to :func:`make_task` with ``target=None``. Model: ``KAN(widths)``
initialised as ``init`` says (``"pykan"`` or ``"efficient_kan"``, :func:`jaxgrad.kan.layer.init`) with spline order
``spline_order`` on grid ``grids[0]``, refined to ``grids[1], grids[2], ...`` every ``refine_every`` steps
(:func:`jaxgrad.kan.grid.refine_network`, least-squares refit on the training inputs; shapes change, so the
optimiser state restarts and the step retraces once per grid). Optional pykan-style grid updates
(:func:`jaxgrad.kan.grid.update_grids`; ``grid_eps``, as pykan's, applies to them: 0 follows the samples'
quantiles, 1 is uniform over their range; a refinement keeps :func:`~jaxgrad.kan.grid.refine_network`'s 0.02)
every ``grid_update_every`` steps of each grid while ``< stop_grid_update_step`` steps into it, or at the steps
``grid_update_at`` of each grid. On a grid whose size is in ``input_overhang_grids`` those updates leave one knot
interval of the inputs' range outside the input layer's knots on each side (``update_grids``'s
``input_overhang=1``); elsewhere the knots span the range, as pykan places them.

Loss: item ``i`` is one sample, :math:`\ell_i = \frac{1}{d_{out}} \sum_o (f(x_i)_o - y_{io})^2`, returned as
:math:`(\sum_i \ell_i, B)`: the engine's loss is the MSE. ``grad_path="custom_vjp"`` differentiates
:func:`jaxgrad.kan.network.kan_apply` (``backend`` ``"xla"`` or ``"pallas"``: hand-written VJP / kernels;
``precision`` one of :data:`PRECISIONS`), ``"reference"`` differentiates
:func:`~jaxgrad.kan.network.kan_apply_reference`. The knot grids are not trained
(:func:`~jaxgrad.kan.network.trainable_mask`).

Evaluation: ``train_rmse`` and ``test_rmse`` over every target on the scale the model fits, and for a dataset
``test_rmse/<target>`` per target in the target's own units (a standardised target's RMSE times its training
standard deviation).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.kan.data import STANDARDIZE, check_dataset, dataset_from_file, target_names
from jaxgrad.kan.grid import refine_network, update_grids
from jaxgrad.kan.layer import INITS
from jaxgrad.kan.network import kan_apply, kan_apply_reference, kan_init, trainable_mask
from jaxgrad.train.errors import ConfigError
from jaxgrad.train.task import Task

TARGETS = {
    "exp_sin_pi_x_plus_y2": (2, lambda x: jnp.exp(jnp.sin(jnp.pi * x[:, :1]) + x[:, 1:2] ** 2)),
    "sin_pi_x": (1, lambda x: jnp.sin(jnp.pi * x[:, :1])),
}
BACKENDS = ("xla", "pallas", "reference")
#: ``model.precision``: the products' precision (``"default"``: JAX's, TF32 for float32 on a GPU; ``"highest"``:
#: exact float32; ``"fp16_scaled"``: float16 operands scaled by powers of two, float32 sums, backend ``"xla"`` and
#: dtype ``"float32"`` only, :mod:`jaxgrad.kan.fp16_scaled`)
PRECISIONS = ("default", "highest", "fp16_scaled")


@dataclasses.dataclass(frozen=True)
class KANFit:
    """The fit's model and data (everything that defines the params' shapes and the data order). ``target=None``:
    the data is a dataset given to :func:`make_task` (``n_train``, ``n_test`` unused)."""

    target: str | None = "exp_sin_pi_x_plus_y2"
    widths: tuple[int, ...] = (2, 1, 1)
    grids: tuple[int, ...] = (3,)
    refine_every: int = 0
    spline_order: int = 3
    grid_update_every: int = 0
    stop_grid_update_step: int = 50
    backend: str = "xla"
    precision: str = "default"
    dtype: str = "float32"
    init: str = "efficient_kan"  # the library's default (scripts/kan_fit.py's committed series); the CLI's: pykan
    grid_eps: float = 0.02
    grid_update_at: tuple[int, ...] = ()
    input_overhang_grids: tuple[int, ...] = ()
    n_train: int = 1000
    n_test: int = 1000
    batch_size: int | None = None
    data_seed: int = 1

    def __post_init__(self):
        def need(cond, field, expected):
            if not cond:
                raise ConfigError(f"KAN fit: '{field}' must be {expected}, got {getattr(self, field)!r}")

        need(self.target is None or self.target in TARGETS, "target", f"one of {tuple(TARGETS)} or None")
        object.__setattr__(self, "widths", tuple(self.widths))
        object.__setattr__(self, "grids", tuple(self.grids))
        need(len(self.widths) >= 2 and all(isinstance(w, int) and w >= 1 for w in self.widths), "widths",
             "at least two ints >= 1")
        if self.target is not None:
            need(self.widths[0] == TARGETS[self.target][0], "widths",
                 f"a list starting with {TARGETS[self.target][0]} (the inputs of target {self.target!r})")
        need(self.grids and all(isinstance(g, int) and g >= 1 for g in self.grids), "grids", "ints >= 1")
        object.__setattr__(self, "grid_update_at", tuple(self.grid_update_at))
        object.__setattr__(self, "input_overhang_grids", tuple(self.input_overhang_grids))
        need(all(isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in self.grid_update_at)
             and list(self.grid_update_at) == sorted(set(self.grid_update_at)), "grid_update_at",
             "increasing ints >= 0 (steps into each grid)")
        if self.grid_update_at and self.grid_update_every:
            raise ConfigError(f"KAN fit: 'grid_update_at' = {list(self.grid_update_at)} and 'grid_update_every' = "
                              f"{self.grid_update_every} both schedule grid updates; keep one: grid_update_every = 0, "
                              f"or grid_update_at = [] (pykan's every-N-steps schedule)")
        need(all(isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in self.input_overhang_grids),
             "input_overhang_grids", "grid sizes (ints >= 1)")
        need(len(self.grids) == 1 or self.refine_every >= 1, "refine_every", ">= 1 when several grids are given")
        need(self.backend in BACKENDS, "backend", f"one of {BACKENDS}")
        need(self.precision in PRECISIONS, "precision", f"one of {PRECISIONS}")
        if self.precision == "fp16_scaled" and (self.backend, self.dtype) != ("xla", "float32"):
            raise ConfigError(f"KAN fit: precision 'fp16_scaled' needs backend 'xla' and dtype 'float32' (float16 "
                              f"operands made from float32 arrays, in the XLA custom VJP), got backend "
                              f"{self.backend!r}, dtype {self.dtype!r}")
        need(self.init in INITS, "init", f"one of {INITS}")
        need(isinstance(self.grid_eps, (int, float)) and not isinstance(self.grid_eps, bool)
             and 0.0 <= self.grid_eps <= 1.0, "grid_eps", "a number in [0, 1]")
        need(self.dtype in ("float32", "float64"), "dtype", "'float32' or 'float64'")
        for f in ("n_train", "n_test", "spline_order", "data_seed"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) >= (0 if f == "data_seed" else 1), f,
                 "a positive int")
        need(self.batch_size is None or (isinstance(self.batch_size, int) and self.batch_size >= 1
                                         and (self.target is None or self.batch_size <= self.n_train)),
             "batch_size", "None (full batch) or an int in 1..n_train" + (f"={self.n_train}" if self.target else ""))
        if self.dtype == "float64" and not jax.config.jax_enable_x64:
            raise ConfigError("KAN fit: dtype 'float64' needs jax_enable_x64 (set it before creating arrays)")

    @property
    def refine_steps(self) -> tuple[int, ...]:
        return tuple(i * self.refine_every for i in range(1, len(self.grids)))

    def grid_update_steps(self, total: int) -> tuple[int, ...]:
        starts = (0, *self.refine_steps)
        ends = (*self.refine_steps, total)
        if self.grid_update_at:
            return tuple(s + u for s, e in zip(starts, ends) for u in self.grid_update_at if u < e - s)
        if not self.grid_update_every:
            return ()
        return tuple(s + u for s, e in zip(starts, ends)
                     for u in range(0, min(e - s, self.stop_grid_update_step), self.grid_update_every))

    def input_overhang_at(self, step: int) -> int:
        """The input layer's overhang (knot intervals) for grid updates on the grid that step ``step`` trains."""
        return int(self.grids[sum(step >= r for r in self.refine_steps)] in self.input_overhang_grids)


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


_refine = jax.jit(refine_network, static_argnums=1, static_argnames=("grid_eps",))
_update = jax.jit(update_grids, static_argnames=("grid_eps",))


def refine_params(params, grid_size: int, x, grid_eps: float = 0.02):
    """:func:`~jaxgrad.kan.grid.refine_network` (jitted) to ``grid_size`` on the samples ``x``."""
    return _refine(params, grid_size, jnp.asarray(x), grid_eps=grid_eps)


def _data_of(fit: KANFit, dataset):
    """``(x_train, y_train, x_test, y_test, target names, standardizer or None)`` in ``fit.dtype``."""
    if dataset is None:
        if fit.target is None:
            raise ConfigError("KAN fit: target None takes its data from a dataset (make_task(fit, steps, dataset))")
        return (*make_dataset(fit), (fit.target,), None)
    if fit.target is not None:
        raise ConfigError(f"KAN fit: a dataset was given with target {fit.target!r}; set target=None (one source "
                          f"of data)")
    try:
        arrays = check_dataset(dataset)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"KAN fit: {e}") from None
    xtr, ytr, xte, yte = (a.astype(fit.dtype) for a in arrays)
    for side, n, w in (("inputs", xtr.shape[1], fit.widths[0]), ("targets", ytr.shape[1], fit.widths[-1])):
        if n != w:
            raise ConfigError(f"KAN fit: the data has {n} {side} but 'widths' = {list(fit.widths)} "
                              f"{'starts' if side == 'inputs' else 'ends'} with {w}")
    if fit.batch_size is not None and fit.batch_size > len(xtr):
        raise ConfigError(f"KAN fit: 'batch_size' must be at most the {len(xtr)} training samples, got "
                          f"{fit.batch_size}")
    return xtr, ytr, xte, yte, target_names(dataset, ytr.shape[1]), dataset.get("stats")


def make_task(fit: KANFit, total_steps: int, dataset: dict | None = None) -> Task:
    """The fit as a task; ``dataset`` (with ``fit.target=None``): pykan's dataset dict (:mod:`jaxgrad.kan.data`)."""
    xtr, ytr, xte, yte, names, stats = _data_of(fit, dataset)
    n_train = len(xtr)
    refine_at = dict(zip(fit.refine_steps, fit.grids[1:]))
    updates = set(fit.grid_update_steps(total_steps))
    dtype = jnp.dtype(fit.dtype)
    scale = np.ones(ytr.shape[1]) if stats is None or stats.target_std is None else stats.target_std

    def init(key):
        return kan_init(key, fit.widths, dtype=dtype, grid_size=fit.grids[0], spline_order=fit.spline_order,
                        init=fit.init)

    precision = {"default": None, "highest": jax.lax.Precision.HIGHEST}.get(fit.precision, fit.precision)

    def loss(params, batch):
        x, y = batch
        return per_item_sq_err_sum(kan_apply(params, x, backend=fit.backend, precision=precision), y)

    def reference_loss(params, batch):
        x, y = batch
        return per_item_sq_err_sum(kan_apply_reference(params, x), y)

    bs = fit.batch_size or n_train
    nb = n_train // bs

    def batches(epoch):
        if bs == n_train:
            yield xtr, ytr
            return
        order = np.random.default_rng([fit.data_seed, epoch]).permutation(n_train)
        for i in range(nb):
            idx = order[i * bs:(i + 1) * bs]
            yield xtr[idx], ytr[idx]

    def transition(params, step):
        if step in refine_at:
            params = _refine(params, refine_at[step], xtr)
        if step in updates:
            params = _update(params, xtr, grid_eps=fit.grid_eps, input_overhang=float(fit.input_overhang_at(step)))
        return params

    def evaluate(params):
        ev = {"train_rmse": rmse(params, xtr, ytr), "test_rmse": rmse(params, xte, yte),
              "grid_size": int(params[0]["spline_weight"].shape[-1] - fit.spline_order)}
        if dataset is not None:
            per = np.asarray(_rmse_per_target(params, jnp.asarray(xte), jnp.asarray(yte))) * scale
            ev.update({f"test_rmse/{n}": float(v) for n, v in zip(names, per)})
        return ev

    source = (f"{fit.target}: {fit.n_train} train / {fit.n_test} test" if dataset is None else
              f"{dataset.get('path', 'dataset')}: {n_train} train / {len(xte)} test, targets {list(names)}")

    return Task("kan", init=init, loss=loss, reference_loss=reference_loss, batches=batches, batches_per_epoch=nb,
                evaluate=evaluate, transition=transition, transition_steps=tuple(sorted(set(refine_at) | updates)),
                trainable=trainable_mask,
                describe=f"KAN {list(fit.widths)}, k={fit.spline_order}, grids {list(fit.grids)}"
                         f"{f' (refined every {fit.refine_every} steps)' if len(fit.grids) > 1 else ''}, "
                         f"{fit.dtype}, backend {fit.backend}"
                         f"{'' if fit.precision == 'default' else f', precision {fit.precision}'}, init {fit.init}; "
                         f"{source}, batch {bs}")


@functools.partial(jax.jit)
def _rmse(params, x, y):
    return jnp.sqrt(jnp.mean((kan_apply_reference(params, x) - y) ** 2))


def rmse(params, x, y) -> float:
    return float(_rmse(params, jnp.asarray(x), jnp.asarray(y)))


@jax.jit
def _rmse_per_target(params, x, y):
    return jnp.sqrt(jnp.mean((kan_apply_reference(params, x) - y) ** 2, axis=0))


# ----------------------------------------------------------------------------------------------------------------
# `jaxgrad train kan`
# ----------------------------------------------------------------------------------------------------------------

CLI_SCHEMA = {
    "model": {"widths": ("ints", [2, 1, 1]), "grids": ("ints", [3, 5, 10]), "refine_every": ("int", 2500),
              "spline_order": ("int", 3), "init": ("str", "pykan", INITS), "grid_update_every": ("int", 0),
              "stop_grid_update_step": ("int", 50), "grid_update_at": ("ints", [0, 100, 1500]),
              "input_overhang_grids": ("ints", [3, 5]), "grid_eps": ("float", 1.0),
              "backend": ("str", "xla", BACKENDS), "precision": ("str", "default", PRECISIONS),
              "dtype": ("str", "float64", ("float32", "float64"))},
    "data": {"target": ("str", "exp_sin_pi_x_plus_y2", tuple(TARGETS)), "n_train": ("int", 1000),
             "n_test": ("int", 1000), "path": ("str?", None), "inputs": ("strs|ints|str|int?", None),
             "targets": ("strs|ints|str|int?", None), "test_fraction": ("float", 0.2),
             "standardize": ("str", "none", STANDARDIZE), "batch_size": ("int?", None), "seed": ("int", 1)},
}
# the family's defaults are configs/kan.toml's fit (another optimizer: set lbfgs_warmup_steps to 0 too)
CLI_TRAIN_DEFAULTS = {"optimizer": "lbfgs", "steps": 7500, "lbfgs_warmup_steps": 100, "log_every": 10,
                      "checkpoint_every": 500}
# a run saved before these keys existed resumes with the schedule it ran: grid updates every
# grid_update_every steps only, the input knots spanning the samples
CLI_KEYS_ADDED = {"model": {"grid_update_at": [], "input_overhang_grids": []}}
# on --resume these may not change: they define the params' shapes or the data order
CLI_FIXED = {"model": ("widths", "grids", "refine_every", "spline_order", "init", "grid_update_every",
                       "stop_grid_update_step", "grid_update_at", "input_overhang_grids", "grid_eps", "dtype"),
             "data": "*"}
#: ``[data]`` keys of the built-in targets and of a data file: the other source's keys must keep their defaults
BUILTIN_DATA_KEYS = ("target", "n_train", "n_test")
FILE_DATA_KEYS = ("inputs", "targets", "test_fraction", "standardize")
DATA_FILE = "data.json"


def needs_x64(cfg: dict) -> bool:
    return cfg["model"]["dtype"] == "float64"


def _check_data_keys(d: dict) -> None:
    unused, why = ((BUILTIN_DATA_KEYS, "with data.path (the data comes from the file)") if d["path"] is not None
                   else (FILE_DATA_KEYS, "without data.path (they describe a data file)"))
    for k in unused:
        if d[k] != CLI_SCHEMA["data"][k][1]:
            raise ConfigError(f"KAN fit: data.{k} = {d[k]!r} is not used {why}; leave it at its default "
                              f"{CLI_SCHEMA['data'][k][1]!r}")


def fit_from_config(cfg: dict) -> KANFit:
    m, d = cfg["model"], cfg["data"]
    _check_data_keys(d)
    return KANFit(target=None if d["path"] is not None else d["target"], widths=tuple(m["widths"]),
                  grids=tuple(m["grids"]), refine_every=m["refine_every"], spline_order=m["spline_order"],
                  grid_update_every=m["grid_update_every"], stop_grid_update_step=m["stop_grid_update_step"],
                  grid_update_at=tuple(m["grid_update_at"]), input_overhang_grids=tuple(m["input_overhang_grids"]),
                  backend=m["backend"], precision=m["precision"], dtype=m["dtype"], init=m["init"],
                  grid_eps=m["grid_eps"], n_train=d["n_train"], n_test=d["n_test"], batch_size=d["batch_size"],
                  data_seed=d["seed"])


def dataset_from_config(cfg: dict) -> dict | None:
    """The ``data.path`` file's dataset (:func:`jaxgrad.kan.data.dataset_from_file`), or None (a built-in
    target)."""
    d = cfg["data"]
    if d["path"] is None:
        return None
    return dataset_from_file(d["path"], d["inputs"], d["targets"], test_fraction=d["test_fraction"], seed=d["seed"],
                             standardize=d["standardize"], dtype=cfg["model"]["dtype"])


def data_record(ds: dict) -> dict:
    """What ``DIR/data.json`` holds: the file, the columns, the split sizes and the standardisation statistics
    (``y = model(standardised x) * target_std + target_mean``)."""
    st = ds.get("stats")
    return {"path": ds["path"], "rows": ds["n_rows"], "train": len(ds["train_input"]), "test": len(ds["test_input"]),
            "inputs": list(ds["input_names"]), "targets": list(ds["target_names"]),
            "standardizer": None if st is None else st.to_dict()}


def cli_task(cfg: dict, out, say):
    """``(task, finish)`` for ``jaxgrad train kan``; ``finish(result) -> summary dict`` writes the plot (and, for a
    data file, ``data.json``)."""
    fit = fit_from_config(cfg)
    ds = dataset_from_config(cfg)
    t = cfg["train"]
    if t["optimizer"] == "lbfgs" and t["lbfgs_warmup_steps"]:
        from jaxgrad.train.config import DEFAULT_LBFGS_WARMUP_LR

        lr = DEFAULT_LBFGS_WARMUP_LR if t["lbfgs_warmup_lr"] is None else t["lbfgs_warmup_lr"]
        say(f"optimizer: Adam at lr {lr:g} for the first {t['lbfgs_warmup_steps']} steps of each optimiser state "
            f"(the run's start and each grid refinement or update), then L-BFGS")
    if ds is not None:
        d = cfg["data"]
        say(f"data: {ds['path']}: {ds['n_rows']} rows; inputs {list(ds['input_names'])}, targets "
            f"{list(ds['target_names'])}; {len(ds['train_input'])} train / {len(ds['test_input'])} test "
            f"(test_fraction {d['test_fraction']}, seed {d['seed']}); standardize {d['standardize']}")
    task = make_task(fit, cfg["train"]["steps"], ds)

    def finish(result):
        summary = {"eval": result.eval}
        if ds is not None:
            import json

            rec = data_record(ds)
            (pathlib.Path(out) / DATA_FILE).write_text(json.dumps(rec, indent=1) + "\n")
            summary["data"] = rec
        try:
            from jaxgrad.kan.plot import plot_activations
        except ImportError:  # matplotlib is optional
            return summary
        title = fit.target if ds is None else pathlib.Path(ds["path"]).name
        png = plot_activations(result.state["params"], pathlib.Path(out) / "activations.png",
                               title=f"{title}, {list(fit.widths)}, G={fit.grids[-1]}")
        summary["activations_png"] = str(png)
        return summary

    return task, finish


CLI_OUTPUTS = ("activations.png", DATA_FILE)
