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
DEFAULT_LR = 1e-3  # the first-order optimizers' learning rate when ``lr`` is not given
DEFAULT_LBFGS_WARMUP_LR = 1e-2  # Adam's learning rate in an L-BFGS warm-up when ``lbfgs_warmup_lr`` is not given


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Engine settings.

    Attributes:
      steps: total optimiser steps of the run (counted from step 0, across resumes).
      optimizer, lr, schedule, warmup_steps, weight_decay, momentum: see :mod:`jaxgrad.train.optim`. ``lr``
        ``None`` is :data:`DEFAULT_LR` for the first-order optimizers and must stay ``None`` for ``"lbfgs"`` (its
        line search picks the step). A setting the chosen optimizer or schedule would not use is refused by name,
        never ignored: ``weight_decay`` needs ``"adamw"``, ``momentum`` needs ``"sgd"``, ``"lbfgs"`` takes no
        ``lr``, ``schedule`` or ``warmup_steps``, ``"cosine"`` has no warm-up (``"warmup_cosine"`` has).
      lbfgs_memory, linesearch: ``optax.lbfgs`` settings (full-batch tasks only).
      lbfgs_warmup_steps, lbfgs_warmup_lr: with ``"lbfgs"``, Adam at ``lbfgs_warmup_lr`` (``None``:
        :data:`DEFAULT_LBFGS_WARMUP_LR`) for the first ``lbfgs_warmup_steps`` steps of each optimiser state, then
        L-BFGS (:func:`jaxgrad.train.optim.lbfgs_after_warmup`). Refused with another optimizer; the rate is
        refused without warm-up steps.
      accumulate: micro-batches per optimiser step; the gradient is ``sum of item-loss gradients / items``
        over the whole window.
      clip_norm: global-norm gradient clipping (``None``: off).
      nan_policy: a step whose loss or gradient is not finite is never applied; ``"skip"`` goes on with the next
        batch (counted in the metrics and the summary), ``"stop"`` ends the run with an error naming the step.
      max_consecutive_skips: with ``nan_policy="skip"``, the run stops with an error naming the steps once this
        many steps in a row were skipped (nothing is being trained any more), and a run none of whose steps was
        applied is an error too.
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
    lr: float | None = None
    schedule: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    momentum: float = 0.0
    lbfgs_memory: int = 10
    linesearch: str = "zoom"
    lbfgs_warmup_steps: int = 0
    lbfgs_warmup_lr: float | None = None
    accumulate: int = 1
    clip_norm: float | None = None
    nan_policy: str = "stop"
    max_consecutive_skips: int = 10
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

        def unused(field, why, instead):
            raise ValueError(f"train config: '{field}' = {getattr(self, field)!r} is not used {why}; {instead}")

        for f, lo in (("steps", 1), ("warmup_steps", 0), ("lbfgs_memory", 1), ("lbfgs_warmup_steps", 0),
                      ("accumulate", 1), ("seed", 0), ("checkpoint_every", 1), ("keep", 1), ("log_every", 1),
                      ("eval_every", 0), ("print_every", 1), ("max_consecutive_skips", 1)):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= lo, f, f"an int >= {lo}")
        for f in ("weight_decay", "momentum"):
            v = getattr(self, f)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, f, "a number >= 0")
        need(self.lr is None or (isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool) and self.lr > 0),
             "lr", "a number > 0 (or None: the optimizer's default)")
        need(self.lbfgs_warmup_lr is None or (isinstance(self.lbfgs_warmup_lr, (int, float))
                                              and not isinstance(self.lbfgs_warmup_lr, bool)
                                              and self.lbfgs_warmup_lr > 0),
             "lbfgs_warmup_lr", f"a number > 0 (or None: {DEFAULT_LBFGS_WARMUP_LR})")
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
            if self.lr is not None:
                unused("lr", "by optimizer 'lbfgs' (its line search picks the step length)", "leave it unset")
            if self.schedule != "constant":
                unused("schedule", "by optimizer 'lbfgs' (its line search picks the step length)",
                       "leave it 'constant'")
            if self.warmup_steps:
                unused("warmup_steps", "by optimizer 'lbfgs' (its line search picks the step length)",
                       "leave it 0 (an Adam warm-up before L-BFGS is 'lbfgs_warmup_steps')")
            if not self.lbfgs_warmup_steps and self.lbfgs_warmup_lr is not None:
                unused("lbfgs_warmup_lr", "without an Adam warm-up", "set 'lbfgs_warmup_steps' > 0, or leave "
                                                                     "lbfgs_warmup_lr unset")
            if self.lbfgs_warmup_steps and self.lbfgs_warmup_lr is None:
                object.__setattr__(self, "lbfgs_warmup_lr", DEFAULT_LBFGS_WARMUP_LR)
        else:
            if self.lbfgs_memory != 10 or self.linesearch != "zoom":
                f = "lbfgs_memory" if self.lbfgs_memory != 10 else "linesearch"
                unused(f, f"by optimizer {self.optimizer!r} (it is an L-BFGS setting)",
                       "use optimizer 'lbfgs', or leave it at its default")
            for f, off in (("lbfgs_warmup_steps", "set it to 0"), ("lbfgs_warmup_lr", "leave it unset")):
                if getattr(self, f):
                    unused(f, f"by optimizer {self.optimizer!r} (it is L-BFGS's Adam warm-up)",
                           f"use optimizer 'lbfgs', or {off}")
            if self.lr is None:
                object.__setattr__(self, "lr", DEFAULT_LR)
        if self.weight_decay and self.optimizer != "adamw":
            unused("weight_decay", f"by optimizer {self.optimizer!r}",
                   "decoupled weight decay is optimizer 'adamw' (optax.adamw); or leave weight_decay at 0")
        if self.momentum and self.optimizer != "sgd":
            unused("momentum", f"by optimizer {self.optimizer!r}",
                   "momentum belongs to optimizer 'sgd' (Adam's are its fixed betas); or leave momentum at 0")
        if self.warmup_steps and self.schedule == "cosine":
            unused("warmup_steps", "by schedule 'cosine' (it has no warm-up)", "use schedule 'warmup_cosine', or "
                                                                               "leave warmup_steps at 0")
        if self.schedule in ("warmup_cosine", "linear"):
            need(self.warmup_steps < self.steps, "warmup_steps",
                 f"< steps = {self.steps} with schedule {self.schedule!r} (the decay follows the warm-up)")

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def train_config_fields() -> dict[str, object]:
    """``{field: default}`` (the TOML ``[train]`` section's keys)."""
    return {f.name: f.default for f in dataclasses.fields(TrainConfig)}
