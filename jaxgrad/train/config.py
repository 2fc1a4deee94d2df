"""The engine's settings (:class:`TrainConfig`): optimisation, accumulation, precision, guards, checkpoints, logs.

Every field is checked in ``__post_init__``; a bad value raises ``ValueError`` naming the field and what was
expected. Family settings (model, data) live with the family (``jaxgrad.kan.task``, ``jaxgrad.cnn.task``); the
TOML front end that combines both is :mod:`jaxgrad.train.toml_config`.
"""

from __future__ import annotations

import dataclasses

from jaxgrad.train.optim import OPTIMIZERS, SCHEDULES
from jaxgrad.train.precision import DTYPES
from jaxgrad.train.task import GRAD_PATHS

NAN_POLICIES = ("skip", "stop")
LINESEARCHES = ("zoom", "backtracking")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Engine settings.

    Attributes:
      steps: total optimiser steps of the run (counted from step 0, across resumes).
      optimizer, lr, schedule, warmup_steps, weight_decay, momentum: see :mod:`jaxgrad.train.optim`.
      lbfgs_memory, linesearch: ``optax.lbfgs`` settings (full-batch tasks only).
      accumulate: micro-batches per optimiser step; the gradient is ``sum of item-loss gradients / items``
        over the whole window.
      clip_norm: global-norm gradient clipping (``None``: off).
      nan_policy: a step whose loss or gradient is not finite is never applied; ``"skip"`` goes on with the next
        batch (counted in the metrics), ``"stop"`` ends the run with an error naming the step.
      grad_path: ``"custom_vjp"`` (the family's hand-written VJPs / kernels) or ``"reference"`` (``jax.grad`` of
        the plain-JAX reference), for A/B runs.
      seed: initialisation and the engine's RNG stream (data order is the family's, from its own seed).
      param_dtype, compute_dtype, output_dtype: the :class:`~jaxgrad.train.precision.Policy`.
      devices: size of the ``data`` mesh (``None``: every device).
      checkpoint_every, keep: orbax checkpoint period (steps) and how many are kept.
      log_every: steps per metrics line; eval_every: steps between evaluations (0: at the end only);
      print_every: steps per printed line when there is no progress bar.
    """

    steps: int = 100
    optimizer: str = "adam"
    lr: float = 1e-3
    schedule: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    momentum: float = 0.0
    lbfgs_memory: int = 10
    linesearch: str = "zoom"
    accumulate: int = 1
    clip_norm: float | None = None
    nan_policy: str = "stop"
    grad_path: str = "custom_vjp"
    seed: int = 0
    param_dtype: str | None = None
    compute_dtype: str | None = None
    output_dtype: str | None = None
    devices: int | None = None
    checkpoint_every: int = 500
    keep: int = 3
    log_every: int = 10
    eval_every: int = 0
    print_every: int = 100

    def __post_init__(self):
        def need(cond, field, expected):
            if not cond:
                raise ValueError(f"train config: '{field}' must be {expected}, got {getattr(self, field)!r}")

        for f, lo in (("steps", 1), ("warmup_steps", 0), ("lbfgs_memory", 1), ("accumulate", 1), ("seed", 0),
                      ("checkpoint_every", 1), ("keep", 1), ("log_every", 1), ("eval_every", 0),
                      ("print_every", 1)):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= lo, f, f"an int >= {lo}")
        for f in ("lr", "weight_decay", "momentum"):
            v = getattr(self, f)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, f, "a number >= 0")
        need(self.lr > 0, "lr", "> 0")
        need(self.clip_norm is None or (isinstance(self.clip_norm, (int, float)) and self.clip_norm > 0),
             "clip_norm", "a number > 0 or None")
        need(self.devices is None or (isinstance(self.devices, int) and self.devices >= 1), "devices",
             "an int >= 1 or None")
        for f, choices in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES), ("linesearch", LINESEARCHES),
                           ("nan_policy", NAN_POLICIES), ("grad_path", GRAD_PATHS)):
            need(getattr(self, f) in choices, f, f"one of {choices}")
        for f in ("param_dtype", "compute_dtype", "output_dtype"):
            need(getattr(self, f) is None or getattr(self, f) in DTYPES, f, f"one of {DTYPES} or None")
        if self.optimizer == "lbfgs":
            need(self.accumulate == 1, "accumulate", "1 with optimizer 'lbfgs' (its line search needs the whole "
                                                     "objective)")
            need(self.clip_norm is None, "clip_norm", "None with optimizer 'lbfgs'")

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def train_config_fields() -> dict[str, object]:
    """``{field: default}`` (the TOML ``[train]`` section's keys)."""
    return {f.name: f.default for f in dataclasses.fields(TrainConfig)}
