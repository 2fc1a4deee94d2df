"""The training loop: :func:`fit` runs a :class:`~jaxgrad.train.task.Task` in a run directory.

Data position. Micro-batch ``m`` (0-based, counted over the run) is batch ``m mod n_b`` of epoch ``m // n_b``
(``n_b`` = ``task.batches_per_epoch``); optimiser step ``s`` trains on micro-batches ``s k .. s k + k - 1``
(``k`` = ``accumulate``). A checkpoint at step ``s`` holds ``{"params", "opt_state", "rng"}`` and its meta
``{"step", "epoch", "batch_in_epoch", "batches_per_epoch", "accumulate", "loss", "time", ...}``; resuming
restores them, re-creates the epoch and skips its consumed batches, so (on a deterministic backend such as the
CPU) a resumed run's state is bitwise equal to an uninterrupted run's -- after a crash, a ``kill -9``, or a
SIGINT/SIGTERM (the current step finishes, a checkpoint is written, ``SystemExit(128 + signal)``; a second signal
gets the default action).

Checkpoints: every ``checkpoint_every`` steps, at the end and on a signal (:mod:`jaxgrad.train.checkpoint`).
A periodic save that fails is reported and training goes on (the last good checkpoint is intact); a failing final
or signal save raises :class:`~jaxgrad.train.checkpoint.CheckpointSaveError`.

Transitions (``task.transition_steps``): before step ``s`` in the list, params are replaced by
``task.transition(params, s)`` and the optimiser state restarts; the jitted step retraces once per new shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrad.train.checkpoint import Checkpointer, CheckpointSaveError
from jaxgrad.train.config import TrainConfig
from jaxgrad.train.mesh import data_mesh, replicate, shard_batch
from jaxgrad.train.metrics import MetricsLog, Reporter
from jaxgrad.train.optim import make_optimizer
from jaxgrad.train.precision import Policy
from jaxgrad.train.step import Steps, accumulate_window, fresh_buffers, make_steps
from jaxgrad.train.task import Task

CKPT_DIR = "checkpoints"


class TrainingDiverged(FloatingPointError):
    """A non-finite loss or gradient under ``nan_policy="stop"``; the message names the step."""


@dataclasses.dataclass
class FitResult:
    state: dict
    step: int
    final_loss: float | None
    eval: dict | None
    traces: dict
    skipped: int


class StopRequest:
    """SIGINT/SIGTERM -> finish the current step, checkpoint, exit. The second signal gets the default action."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def _handler(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self._old.get(signum, signal.SIG_DFL))

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.getsignal(s)
                signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def policy_of(cfg: TrainConfig) -> Policy:
    return Policy(cfg.param_dtype, cfg.compute_dtype, cfg.output_dtype)


def initial_params(task: Task, cfg: TrainConfig):
    """``task.init`` at ``cfg.seed``, in the policy's parameter dtype."""
    return policy_of(cfg).cast_params(task.init(jax.random.key(cfg.seed)))


def _rng0(cfg: TrainConfig):
    return jax.random.key_data(jax.random.fold_in(jax.random.key(cfg.seed), 0x7A11))


def _key_rng(task: Task, state: dict):
    """The state's key data when the task's loss takes a key (accumulation), else None."""
    return state["rng"] if task.loss_takes_key else None


def params_at(task: Task, cfg: TrainConfig, step: int, abstract: bool = False):
    """Params as they enter step ``step`` before training: init + the transitions at steps ``< step`` (abstract:
    shapes only)."""
    def build():
        p = initial_params(task, cfg)
        for t in sorted(task.transition_steps):
            if t < step:
                p = task.transition(p, t)
        return p
    return jax.eval_shape(build) if abstract else build()


def abstract_state(task: Task, cfg: TrainConfig, steps: Steps, step: int):
    params = params_at(task, cfg, step, abstract=True)
    opt = jax.eval_shape(steps.init_opt, params)
    return {"params": params, "opt_state": opt, "rng": jax.eval_shape(lambda: _rng0(cfg))}


def micro_batches(task: Task, start: int) -> Iterator[tuple[int, int, Any]]:
    """``(epoch, batch_in_epoch, batch)`` from global micro-batch index ``start`` on, across epochs."""
    nb = task.batches_per_epoch
    epoch, skip = divmod(start, nb)
    while True:
        gen = task.batches(epoch)
        try:
            for i, batch in enumerate(gen):
                if i >= skip:
                    yield epoch, i, batch
        finally:
            close = getattr(gen, "close", None)
            if close is not None:
                close()
        epoch, skip = epoch + 1, 0


def build(task: Task, cfg: TrainConfig, mesh=None, max_traces: int | None = None):
    """``(mesh, steps)`` for ``cfg`` (exposed for tests and notebooks)."""
    mesh = data_mesh(cfg.devices) if mesh is None else mesh
    steps = make_steps(task, make_optimizer(cfg), mesh, policy=policy_of(cfg), grad_path=cfg.grad_path,
                       lbfgs=cfg.optimizer == "lbfgs", max_traces=max_traces)
    return mesh, steps


def init_state(task: Task, cfg: TrainConfig, steps: Steps, mesh, params=None, rng=None) -> dict:
    """``{"params", "opt_state", "rng"}`` on the mesh: ``params`` (default: the task's init) with a fresh optimiser
    state; ``rng`` (key data) carries the engine's RNG stream over a transition (default: the seed's)."""
    params = initial_params(task, cfg) if params is None else params
    rng = _rng0(cfg) if rng is None else rng
    return replicate(fresh_buffers({"params": params, "opt_state": steps.init_opt(params), "rng": rng}), mesh)


def fit(task: Task, cfg: TrainConfig, out: pathlib.Path, *, resuming: bool = False, use_bar: bool = False,
        argv: list[str] | None = None, step_callback: Callable | None = None,
        hooks: tuple[tuple[int, Callable], ...] = (), max_traces: int | None = None, mesh=None,
        say: Callable[[str], None] | None = None) -> FitResult:
    """Train ``task`` for ``cfg.steps`` steps in run directory ``out`` (prepared by the caller:
    :mod:`jaxgrad.train.rundir`), resuming from its latest good checkpoint when ``resuming``.

    ``step_callback(step, loss)`` runs after every step (after that step's checkpoint if one was due);
    ``hooks``: ``(every, fn(step, params, last_loss))`` pairs; ``max_traces``: ``chex.assert_max_traces`` on the
    step.
    """
    out = pathlib.Path(out)
    mesh, steps = build(task, cfg, mesh, max_traces)
    nb, k, total = task.batches_per_epoch, cfg.accumulate, cfg.steps
    if cfg.optimizer == "lbfgs" and nb != 1:
        raise ValueError(f"optimizer 'lbfgs' needs the whole objective in one batch, but task {task.name!r} has "
                         f"{nb} batches per epoch")
    ckpt = Checkpointer(out / CKPT_DIR, cfg.keep)
    metrics = MetricsLog(out)
    wall0 = time.perf_counter()
    echo = say or (lambda m: print(m, flush=True))
    try:
        restored = ckpt.restore_latest_good(lambda meta: abstract_state(task, cfg, steps, int(meta["step"])),
                                            echo) if resuming else None
        if restored is not None:
            state, meta = restored
            step = int(meta["step"])
            if meta.get("batches_per_epoch") != nb or meta.get("accumulate", 1) != k:
                raise ValueError(f"checkpoint {step}: data position {meta} does not match {nb} batches per epoch "
                                 f"and accumulate={k}")
            state = replicate(state, mesh)
        else:
            state, step = init_state(task, cfg, steps, mesh), 0
        ckpt_step = step if restored is not None else None
        if step > total:
            echo(f"note: the run is at step {step}, past the requested total of {total}; nothing to train")
        metrics.event({"event": "resume" if resuming else "start", "step": step, "time": time.time(),
                       "total_steps": total, "batches_per_epoch": nb, "argv": list(sys.argv[1:] if argv is None
                                                                                   else argv),
                       "device": str(jax.devices()[0]), "mesh_devices": int(mesh.devices.size)})
        window: list = []
        last = {"loss": None, "sps": None, "ips": None}
        skipped = 0
        t_win = time.perf_counter()

        def check_window():
            if cfg.nan_policy != "stop" or not window:
                return
            oks = np.asarray(jnp.stack([w[1] for w in window]))
            if not oks.all():
                bad = window[int(np.argmin(oks))]
                raise TrainingDiverged(f"step {bad[3]}: the loss or a gradient is not finite (loss "
                                       f"{float(bad[0])}); the update was not applied; stopping (nan_policy='stop'; "
                                       f"last checkpoint: step {ckpt_step}; nan_policy='skip' skips such steps)")

        def checkpoint(final: bool):
            nonlocal ckpt_step
            check_window()
            meta = {"step": step, "epoch": step * k // nb, "batch_in_epoch": step * k % nb, "batches_per_epoch": nb,
                    "accumulate": k, "loss": last["loss"], "time": time.time(), "task": task.name}
            try:
                ckpt.save(step, state, meta)
            except CheckpointSaveError as err:
                metrics.event({"event": "checkpoint_failed", "step": step, "error": str(err), "time": time.time()})
                if final:
                    raise
                rep.say(f"warning: {err}; training goes on")
                return
            metrics.sync()
            ckpt_step = step

        def flush_window():
            nonlocal window, t_win, skipped
            losses = np.asarray(jnp.stack([jnp.asarray(w[0]) for w in window]), np.float64)
            items = float(sum(np.asarray(w[2], np.float64) for w in window))
            oks = np.asarray(jnp.stack([w[1] for w in window]))
            check_window()
            now = time.perf_counter()
            good = losses[oks]
            n_bad = int((~oks).sum())
            skipped += n_bad
            last["sps"] = len(window) / max(now - t_win, 1e-9)
            last["ips"] = items / max(now - t_win, 1e-9)
            last["loss"] = float(good.mean()) if good.size else float("nan")
            rec = {"step": step, "epoch": ((step - 1) * k) // nb, "batch": ((step - 1) * k) % nb,
                   "loss": last["loss"], "loss_last": float(losses[-1]), "n_steps": len(window),
                   "steps_per_s": last["sps"], "items_per_s": last["ips"], "time": time.time(),
                   "elapsed_s": now - wall0}
            if cfg.nan_policy == "skip":
                rec["skipped"] = n_bad
            metrics.step(rec)
            window, t_win = [], now

        data = micro_batches(task, step * k)
        transitions = set(task.transition_steps)
        with Reporter(use_bar, total, step, cfg.print_every, label=f"train {task.name}") as rep, StopRequest() as stop:
            rep.say(f"{task.describe + '; ' if task.describe else ''}{'resuming at' if resuming else 'starting at'} "
                    f"step {step} of {total}; {nb} batches per epoch, accumulate {k}; {cfg.optimizer}, "
                    f"grad path {cfg.grad_path}; mesh of {mesh.devices.size} x {jax.devices()[0].platform}")
            while step < total and stop.signum is None:
                if step in transitions:
                    state = init_state(task, cfg, steps, mesh, task.transition(state["params"], step),
                                       state["rng"])
                if k == 1:
                    _, _, batch = next(data)
                    state, loss, ok = steps.train_step(state, shard_batch(batch, mesh))
                    n_items = len(jax.tree.leaves(batch)[0])
                else:
                    mbs = [shard_batch(next(data)[2], mesh) for _ in range(k)]
                    s, n, g = accumulate_window(steps, state["params"], mbs, _key_rng(task, state))
                    state, loss, ok = steps.apply_sums(state, s, n, g)
                    n_items = n
                step += 1
                window.append((loss, ok, n_items, step))
                if step % cfg.log_every == 0 or step == total:
                    flush_window()
                    if cfg.nan_policy == "stop" and last["loss"] is not None and not math.isfinite(last["loss"]):
                        raise TrainingDiverged(f"loss is {last['loss']} at step {step}; stopping (last good "
                                               f"checkpoint: step {ckpt_step})")
                rep.advance(step, ((step - 1) * k) // nb, last["loss"], last["sps"], last["ips"])
                if step % cfg.checkpoint_every == 0 or step == total:
                    checkpoint(final=step == total)
                if cfg.eval_every and task.evaluate is not None and step % cfg.eval_every == 0:
                    metrics.event({"event": "eval", "step": step, "time": time.time(),
                                   **task.evaluate(state["params"])})
                for every, fn in hooks:
                    if every and step % every == 0:
                        fn(step, state["params"], last["loss"])
                if step_callback is not None:
                    step_callback(step, loss)
            if stop.signum is not None:
                if window:
                    flush_window()
                if ckpt_step != step:
                    checkpoint(final=True)
                name = signal.Signals(stop.signum).name
                metrics.event({"event": "stopped", "step": step, "signal": name, "time": time.time()})
                rep.say(f"stopped by {name} at step {step}; checkpoint written; continue with --resume")
                raise SystemExit(128 + stop.signum)
            if ckpt_step != step:
                checkpoint(final=True)
        ev = task.evaluate(state["params"]) if task.evaluate is not None else None
        return FitResult(state=state, step=step, final_loss=last["loss"], eval=ev, traces=dict(steps.traces),
                         skipped=skipped)
    finally:
        with contextlib.suppress(Exception):
            metrics.close()
        with contextlib.suppress(NameError):
            data.close()  # the family's epoch iterator (e.g. a stream's file handles)
        ckpt.close()


def log_end(out: pathlib.Path, result: FitResult, **extra) -> None:
    """Append the ``end`` event (after the caller's own end-of-run work)."""
    m = MetricsLog(out, tensorboard=False)
    try:
        m.event({"event": "end", "step": result.step, "time": time.time(), "final_loss": result.final_loss,
                 **({"eval": result.eval} if result.eval else {}), **extra})
    finally:
        m.close()


def train_in_memory(task: Task, cfg: TrainConfig, params=None, *, mesh=None, max_traces: int | None = None,
                    on_step: Callable | None = None) -> tuple[dict, list]:
    """:func:`fit`'s step loop without a run directory (no checkpoints, metrics or signals): for notebooks and
    for scripts that chain phases (``scripts/kan_fit.py``). Starts from ``params`` (default ``task.init``) with a
    fresh optimiser state; applies the task's transitions; returns ``(state, losses)`` (device scalars;
    ``losses[i]`` of step ``i + 1``, NaN where the guard skipped a step). ``nan_policy="stop"`` raises
    :class:`TrainingDiverged` at the end if a step was not finite."""
    mesh, steps = build(task, cfg, mesh, max_traces)
    if cfg.optimizer == "lbfgs" and task.batches_per_epoch != 1:
        raise ValueError(f"optimizer 'lbfgs' needs the whole objective in one batch, but task {task.name!r} has "
                         f"{task.batches_per_epoch} batches per epoch")
    state = init_state(task, cfg, steps, mesh, params)
    data = micro_batches(task, 0)
    losses, oks = [], []
    for step in range(cfg.steps):
        if step in task.transition_steps:
            state = init_state(task, cfg, steps, mesh, task.transition(state["params"], step), state["rng"])
        if cfg.accumulate == 1:
            state, loss, ok = steps.train_step(state, shard_batch(next(data)[2], mesh))
        else:
            s, n, g = accumulate_window(steps, state["params"],
                                        [shard_batch(next(data)[2], mesh) for _ in range(cfg.accumulate)],
                                        _key_rng(task, state))
            state, loss, ok = steps.apply_sums(state, s, n, g)
        losses.append(loss)
        oks.append(ok)
        if on_step is not None:
            on_step(step + 1, loss)
    data.close()
    if cfg.nan_policy == "stop" and oks and not bool(np.all(np.asarray(jnp.stack(oks)))):
        first = int(np.argmin(np.asarray(jnp.stack(oks)))) + 1
        raise TrainingDiverged(f"step {first}: the loss or a gradient is not finite; the update was not applied "
                               f"(nan_policy='stop')")
    return state, losses
