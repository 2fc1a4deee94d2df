"""Optimisers and learning-rate schedules from the engine's configuration (all optax).

``make_optimizer(cfg)``: ``optax.adam`` / ``adamw`` / ``sgd`` with a schedule, preceded by
``optax.clip_by_global_norm`` when ``clip_norm`` is set; or ``optax.lbfgs`` (memory ``lbfgs_memory``, zoom =
strong-Wolfe or backtracking line search), which the step drives through ``optax.value_and_grad_from_state``;
with ``lbfgs_warmup_steps = N > 0``, :func:`lbfgs_after_warmup`: ``optax.adam(lbfgs_warmup_lr)`` for the first
``N`` steps of the optimiser state, then L-BFGS, one transformation whose state holds both (checkpointed and
resumed like any other). A plain constant-rate Adam is ``optax.adam(lr)`` itself (its state ``(ScaleByAdamState,
EmptyState)``).

Schedules (``steps`` is the run's total, the horizon of the decaying ones): ``constant`` (after an optional linear
warm-up from 0 over ``warmup_steps``), ``cosine`` (``lr -> 0`` over ``steps``; no warm-up), ``warmup_cosine``
(``0 -> lr`` over ``warmup_steps``, then cosine to 0 at ``steps``), ``linear`` (``0 -> lr`` over ``warmup_steps``,
then linear to 0 at ``steps``). Settings a configuration would not use are refused by
:class:`~jaxgrad.train.config.TrainConfig`, never ignored.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

OPTIMIZERS = ("adam", "adamw", "sgd", "lbfgs")
SCHEDULES = ("constant", "cosine", "warmup_cosine", "linear")


def make_schedule(name: str, lr: float, steps: int, warmup_steps: int = 0, end_factor: float = 0.0):
    """A float (constant) or an optax schedule of the step count."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
    if name == "constant":
        return lr if not warmup_steps else optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup_steps), optax.constant_schedule(lr)], [warmup_steps])
    if name == "cosine":
        return optax.cosine_decay_schedule(lr, max(steps, 1), alpha=end_factor)
    if name == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, max(steps, warmup_steps + 1),
                                                  end_value=lr * end_factor)
    decay = optax.linear_schedule(lr, lr * end_factor, max(steps - warmup_steps, 1))
    if not warmup_steps:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup_steps), decay], [warmup_steps])


def lr_at(cfg, step: int, steps: int | None = None) -> float | None:
    """The learning rate of ``cfg``'s schedule at optimiser step ``step`` with horizon ``steps`` (default
    ``cfg.steps``); ``None`` for L-BFGS (no learning rate)."""
    if cfg.optimizer == "lbfgs":
        return None
    sched = make_schedule(cfg.schedule, cfg.lr, cfg.steps if steps is None else steps, cfg.warmup_steps)
    return float(sched(step)) if callable(sched) else float(sched)


#: Schedules whose shape depends on the run's total ``steps`` (a changed ``steps`` on resume moves them).
HORIZON_SCHEDULES = ("cosine", "warmup_cosine", "linear")


class LBFGSWarmupState(NamedTuple):
    """State of :func:`lbfgs_after_warmup`: ``count`` steps taken since init (saturating), both inner states."""

    count: jax.Array
    warmup: Any
    lbfgs: Any


def lbfgs_after_warmup(warmup: optax.GradientTransformation, lbfgs: optax.GradientTransformationExtraArgs,
                       warmup_steps: int) -> optax.GradientTransformationExtraArgs:
    r"""``warmup`` (e.g. ``optax.adam(1e-2)``) for the first ``warmup_steps`` updates, then ``lbfgs``.

    .. math::

        u_t = \begin{cases} \text{warmup}(g_t) & t < N \\ \text{lbfgs}(g_t; f, x_t) & t \ge N \end{cases}

    One ``lax.cond`` per step picks the branch, so the state (``count``, both inner states) has one structure
    throughout and a checkpoint taken in either phase resumes bit-exactly. The L-BFGS state is the one of its
    ``init``: its memory starts empty at step ``N`` and its stored value is infinite, so
    ``optax.value_and_grad_from_state`` evaluates the objective at the warm-up's end point. ``count`` restarts
    with the optimiser state (e.g. after a KAN grid refinement).

    Why: L-BFGS from a poor starting point can settle on a plateau its line search never leaves (the KAN fit of
    ``configs/kan.toml`` from efficient-kan's init, docs/design.md section 4); a few hundred Adam steps move the
    iterate into the basin that L-BFGS then converges in quickly.
    """
    if not (isinstance(warmup_steps, int) and warmup_steps >= 1):
        raise ValueError(f"lbfgs_after_warmup: 'warmup_steps' must be an int >= 1, got {warmup_steps!r}")

    def init(params):
        return LBFGSWarmupState(jnp.zeros([], jnp.int32), warmup.init(params), lbfgs.init(params))

    def update(updates, state, params=None, *, value, grad, value_fn, **extra):
        count = optax.safe_increment(state.count)

        def warm(_):
            u, ws = warmup.update(updates, state.warmup, params)
            return u, LBFGSWarmupState(count, ws, state.lbfgs)

        def quasi_newton(_):
            u, ls = lbfgs.update(updates, state.lbfgs, params, value=value, grad=grad, value_fn=value_fn, **extra)
            return u, LBFGSWarmupState(count, state.warmup, ls)

        return jax.lax.cond(state.count < warmup_steps, warm, quasi_newton, None)

    return optax.GradientTransformationExtraArgs(init, update)


def make_lbfgs(cfg) -> optax.GradientTransformationExtraArgs:
    """``optax.lbfgs`` with ``cfg``'s memory and line search."""
    if cfg.linesearch == "zoom":
        ls = optax.scale_by_zoom_linesearch(max_linesearch_steps=20, initial_guess_strategy="one")
    else:
        ls = optax.scale_by_backtracking_linesearch(max_backtracking_steps=20, store_grad=True)
    return optax.lbfgs(memory_size=cfg.lbfgs_memory, linesearch=ls)


def make_optimizer(cfg) -> optax.GradientTransformation:
    """``cfg``: a :class:`jaxgrad.train.config.TrainConfig` (or anything with its attributes)."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {cfg.optimizer!r}")
    if cfg.optimizer == "lbfgs":
        n = getattr(cfg, "lbfgs_warmup_steps", 0)
        if not n:
            return make_lbfgs(cfg)
        return lbfgs_after_warmup(optax.adam(cfg.lbfgs_warmup_lr), make_lbfgs(cfg), n)
    lr = make_schedule(cfg.schedule, cfg.lr, cfg.steps, cfg.warmup_steps)
    if cfg.optimizer == "adam":
        opt = optax.adam(lr)
    elif cfg.optimizer == "adamw":
        opt = optax.adamw(lr, weight_decay=cfg.weight_decay)
    else:
        opt = optax.sgd(lr, momentum=cfg.momentum or None)
    if cfg.clip_norm is not None:
        opt = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt)
    return opt
