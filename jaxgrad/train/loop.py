"""The training loop: :func:`fit` runs a :class:`~jaxgrad.train.task.Task` in a run directory.

Data position. Micro-batch ``m`` (0-based, counted over the run) is batch ``m mod n_b`` of epoch ``m // n_b``
(``n_b`` = ``task.batches_per_epoch``); optimiser step ``s`` trains on micro-batches ``s k .. s k + k - 1``
(``k`` = ``accumulate``). A checkpoint at step ``s`` holds ``{"params", "opt_state", "rng"}`` and its meta
``{"step", "epoch", "batch_in_epoch", "batches_per_epoch", "accumulate", "loss", "time", "total_steps",
"skipped", ...}``; resuming restores them, re-creates the epoch and skips its consumed batches, so (on a
deterministic backend such as the CPU) a resumed run's state is bitwise equal to an uninterrupted run's -- after
a crash, a ``kill -9``, or a SIGINT/SIGTERM (the current step finishes, a checkpoint is written,
``SystemExit(128 + signal)``; a second signal gets the default action).

Checkpoints: every ``checkpoint_every`` steps, at the end and on a signal (:mod:`jaxgrad.train.checkpoint`).
A periodic save that fails is reported and training goes on (the last good checkpoint is intact); a failing final
or signal save raises :class:`~jaxgrad.train.checkpoint.CheckpointSaveError`.

Transitions (``task.transition_steps``): before step ``s`` in the list, params are replaced by
``task.transition(params, s)`` and the optimiser state restarts; the jitted step retraces once per new shape.

Layout. The state lies on the mesh as :func:`state_shardings` says: replicated, or with a
:class:`~jaxgrad.train.mesh.ShardPlan` the frozen params (and, with ``shard_trainable``, the trainable ones and
the optimiser state) sharded over ``fsdp``. A checkpoint stores the global arrays, whatever the layout: it is
restored onto the mesh of the resuming run (another device count or layout included), bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
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

from jaxgrad.train.checkpoint import Checkpointer, CheckpointMismatchError, CheckpointSaveError
from jaxgrad.train.config import TrainConfig
from jaxgrad.train.errors import ConfigError
from jaxgrad.train.mesh import (FSDP_AXIS, ShardPlan, check_divisible, data_mesh, param_shardings, put, replicate,
                                replicated, shard_batch)
from jaxgrad.train.metrics import MetricsLog, Reporter
from jaxgrad.train.optim import HORIZON_SCHEDULES, lr_at, make_optimizer
from jaxgrad.train.precision import Policy
from jaxgrad.train.step import Steps, accumulate_window, fresh_buffers, make_steps
from jaxgrad.train.task import Task

CKPT_DIR = "checkpoints"


class _NoMetrics:
    """The metrics log of a process other than process 0 of a multi-process run (process 0 writes the run's)."""

    def event(self, rec: dict) -> None:
        pass

    step = event

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


class TrainingDiverged(FloatingPointError):
    """A non-finite loss or gradient under ``nan_policy="stop"``, or ``max_consecutive_skips`` skipped steps in a
    row (or none applied) under ``nan_policy="skip"``; the message names the steps."""


@dataclasses.dataclass
class FitResult:
    """``skipped``: steps skipped by the NaN guard over the whole run (across resumes); ``final_loss``: the last
    logged loss (on a resume with nothing left to train, the checkpoint's); ``throughput``: ``{"unit",
    "<unit>_per_s", "<unit>_this_process"}`` (the rate over this process's steps after its first, which includes
    the compilation)."""

    state: dict
    step: int
    final_loss: float | None
    eval: dict | None
    traces: dict
    skipped: int
    throughput: dict = dataclasses.field(default_factory=dict)


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


def state_shardings(task: Task, steps: Steps, mesh, params) -> dict:
    """The ``NamedSharding`` of every leaf of the state ``{"params", "opt_state", "rng"}`` whose params are
    ``params`` (arrays or shapes): :func:`jaxgrad.train.mesh.param_shardings` for the params, the sharding XLA gives
    the optimiser state initialised from them (Adam's moments follow their parameter), the rng replicated."""
    rep = replicated(mesh)
    mask = None if task.trainable is None else task.trainable(params)
    p_shard = param_shardings(mesh, params, mask, steps.plan)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    if steps.plan is None or not steps.plan.shard_trainable:
        opt = jax.tree.map(lambda _: rep, jax.eval_shape(steps.init_opt, abstract))
    else:
        opt = jax.jit(steps.init_opt, in_shardings=(p_shard,)).lower(abstract).compile().output_shardings
        # a constant leaf (a step count) comes back on one device: it is replicated on the mesh
        opt = jax.tree.map(lambda s: s if s.device_set == set(mesh.devices.flat) else rep, opt)
    return {"params": p_shard, "opt_state": opt, "rng": rep}


def abstract_state(task: Task, cfg: TrainConfig, steps: Steps, step: int, mesh=None):
    """The state a checkpoint at ``step`` holds, as shapes (on ``mesh``'s layout when given: a checkpoint is
    restored straight onto the resuming run's devices)."""
    params = params_at(task, cfg, step, abstract=True)
    opt = jax.eval_shape(steps.init_opt, params)
    state = {"params": params, "opt_state": opt, "rng": jax.eval_shape(lambda: _rng0(cfg))}
    if mesh is None:
        return state
    shard = state_shardings(task, steps, mesh, params)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shard)


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


def build(task: Task, cfg: TrainConfig, mesh=None, max_traces: int | None = None, plan: ShardPlan | None = None):
    """``(mesh, steps)`` for ``cfg`` (exposed for tests and notebooks); ``plan``: the task's model sharded over
    the mesh's ``fsdp`` axis (:class:`~jaxgrad.train.mesh.ShardPlan`; the mesh must have that axis)."""
    mesh = data_mesh(cfg.devices) if mesh is None else mesh
    if plan is not None and FSDP_AXIS not in mesh.axis_names:
        raise ValueError(f"build: a ShardPlan needs a mesh with an '{FSDP_AXIS}' axis (jaxgrad.train.mesh."
                         f"train_mesh), got axes {mesh.axis_names}")
    steps = make_steps(task, make_optimizer(cfg), mesh, policy=policy_of(cfg), grad_path=cfg.grad_path,
                       lbfgs=cfg.optimizer == "lbfgs", max_traces=max_traces, plan=plan)
    return mesh, steps


def init_state(task: Task, cfg: TrainConfig, steps: Steps, mesh, params=None, rng=None) -> dict:
    """``{"params", "opt_state", "rng"}`` on the mesh: ``params`` (default: the task's init) with a fresh optimiser
    state; ``rng`` (key data) carries the engine's RNG stream over a transition (default: the seed's)."""
    params = initial_params(task, cfg) if params is None else params
    rng = _rng0(cfg) if rng is None else rng
    if steps.plan is None:
        return replicate(fresh_buffers({"params": params, "opt_state": steps.init_opt(params), "rng": rng}), mesh)
    shard = state_shardings(task, steps, mesh, params)
    params = put(params, shard["params"])  # from the host: no device holds more than its shards
    opt = jax.jit(steps.init_opt, out_shardings=shard["opt_state"])(params)
    # the placed params are buffers of their own already: copying them too would hold every frozen shard twice
    # at once (a sharded base is most of a device's memory); the optimiser state may share buffers with them
    # (a jit output that is its input), and weakly typed leaves are made strong (fresh_buffers' reasons)
    params = jax.tree.map(lambda a: fresh_buffers(a) if getattr(a, "weak_type", False) else a, params)
    return {"params": params, **fresh_buffers({"opt_state": opt, "rng": put(rng, shard["rng"])})}


def _lbfgs_check(task: Task, cfg: TrainConfig) -> None:
    if cfg.optimizer == "lbfgs" and task.batches_per_epoch != 1:
        raise ConfigError(f"optimizer 'lbfgs' needs the whole objective in one batch, but task {task.name!r} has "
                          f"{task.batches_per_epoch} batches per epoch")


def _last_ckpt(step) -> str:
    return "no checkpoint written yet" if step is None else f"last checkpoint: step {step}"


class _SkipGuard:
    """``nan_policy="skip"``: counts the skipped steps and stops the run (:class:`TrainingDiverged`) once
    ``max_consecutive_skips`` steps in a row were skipped, or when a run ends none of whose steps was applied."""

    def __init__(self, cfg: TrainConfig, skipped_before: int = 0):
        self.limit = cfg.max_consecutive_skips
        self.active = cfg.nan_policy == "skip"
        self.skipped = skipped_before     # over the whole run, across resumes (checkpoint meta)
        self.applied = 0                  # steps applied by this process
        self.seen = 0                     # steps trained by this process
        self.run_start: int | None = None  # first step of the current run of skipped steps

    def update(self, oks, step_numbers, last_ckpt) -> int:
        """Account for the flags of steps ``step_numbers``; returns how many of them were skipped."""
        n_bad = 0
        for ok, st in zip(oks, step_numbers):
            self.seen += 1
            if ok:
                self.applied += 1
                self.run_start = None
                continue
            n_bad += 1
            self.run_start = st if self.run_start is None else self.run_start
            n_run = st - self.run_start + 1
            if self.active and n_run >= self.limit:
                raise TrainingDiverged(
                    f"steps {self.run_start}..{st}: {n_run} consecutive steps had a non-finite loss or gradient and "
                    f"were skipped (nan_policy='skip', max_consecutive_skips={self.limit}); the parameters have not "
                    f"changed since step {self.run_start - 1}; stopping ({_last_ckpt(last_ckpt)}). Lower "
                    f"the learning rate, check the data, or raise train.max_consecutive_skips")
        self.skipped += n_bad
        return n_bad

    def check_end(self, step: int, last_ckpt) -> None:
        if self.active and self.seen and not self.applied:
            raise TrainingDiverged(
                f"none of the {self.seen} steps up to step {step} was applied: every one had a non-finite loss or "
                f"gradient and was skipped (nan_policy='skip'); the parameters are those of step {step - self.seen}; "
                f"stopping ({_last_ckpt(last_ckpt)})")


def fit(task: Task, cfg: TrainConfig, out: pathlib.Path, *, resuming: bool = False, use_bar: bool = False,
        argv: list[str] | None = None, step_callback: Callable | None = None,
        hooks: tuple[tuple[int, Callable], ...] = (), max_traces: int | None = None, mesh=None,
        say: Callable[[str], None] | None = None, on_start: Callable[[], None] | None = None,
        plan: ShardPlan | None = None) -> FitResult:
    """Train ``task`` for ``cfg.steps`` steps in run directory ``out`` (prepared by the caller:
    :mod:`jaxgrad.train.rundir`), resuming from its latest good checkpoint when ``resuming``.

    ``step_callback(step, loss)`` runs after every step (after that step's checkpoint if one was due);
    ``hooks``: ``(every, fn(step, params, last_loss))`` pairs; ``max_traces``: ``chex.assert_max_traces`` on the
    step. ``on_start()`` runs once every check that can refuse the run has passed (the configuration, the
    checkpoint to resume from, the first batch against the mesh) and before anything is logged: the CLI writes the
    run's configuration files there, so a run refused before it starts leaves none behind.

    ``mesh`` (default: :func:`~jaxgrad.train.mesh.data_mesh` of ``cfg.devices``) and ``plan`` (the task's model
    sharded over its ``fsdp`` axis) give the layout; a checkpoint of another layout or device count is restored
    onto this one.

    Errors: :class:`~jaxgrad.train.errors.ConfigError` for a configuration the task cannot train (L-BFGS on
    mini-batches, a batch that does not split over the mesh), :class:`TrainingDiverged` (non-finite steps, see
    ``nan_policy``), checkpoint errors (:mod:`jaxgrad.train.checkpoint`).
    """
    out = pathlib.Path(out)
    mesh, steps = build(task, cfg, mesh, max_traces, plan)
    nb, k, total = task.batches_per_epoch, cfg.accumulate, cfg.steps
    _lbfgs_check(task, cfg)
    primary = jax.process_index() == 0  # several processes: all train and checkpoint, process 0 writes the logs
    ckpt = Checkpointer(out / CKPT_DIR, cfg.keep)
    metrics = None
    source = None
    echo = say or (lambda m: print(m, flush=True))
    unit = task.throughput_unit
    try:
        restored = ckpt.restore_latest_good(lambda meta: abstract_state(task, cfg, steps, int(meta["step"]), mesh),
                                            echo, quarantine=primary) if resuming else None
        notes, resume_info = [], {}
        if restored is not None:
            state, meta = restored
            step = int(meta["step"])
            if meta.get("batches_per_epoch") != nb or meta.get("accumulate", 1) != k:
                raise CheckpointMismatchError(f"checkpoint {step}: data position {meta} does not match {nb} batches "
                                              f"per epoch and accumulate={k}")
            state = put(state, state_shardings(task, steps, mesh, state["params"]))
            old_total = meta.get("total_steps")
            if old_total is not None and old_total != total and cfg.schedule in HORIZON_SCHEDULES:
                before, after = lr_at(cfg, step, old_total), lr_at(cfg, step)
                notes.append(f"note: train.steps changed from {old_total} to {total}: the {cfg.schedule!r} schedule "
                             f"decays over the run's total steps, so its horizon moves with it; the learning rate at "
                             f"step {step} is {after:.4g} (it was {before:.4g} with the old horizon)")
                resume_info["schedule_horizon"] = {"from": old_total, "to": total, "lr_before": before,
                                                   "lr_after": after}
        else:
            state, step, meta = init_state(task, cfg, steps, mesh), 0, {}
        ckpt_step = step if restored is not None else None
        guard = _SkipGuard(cfg, int(meta.get("skipped", 0) or 0))
        if step > total:
            notes.append(f"note: the run is at step {step}, past the requested total of {total}; nothing to train")
        source = micro_batches(task, step * k)
        data = source
        if step < total:  # the first micro-batch must split over the mesh: a configuration error, before the start
            first = next(source)
            check_divisible(first[2], mesh)
            data = itertools.chain([first], source)
        if on_start is not None:
            on_start()
        for n in notes:
            echo(n)
        metrics = MetricsLog(out) if primary else _NoMetrics()
        wall0 = time.perf_counter()
        metrics.event({"event": "resume" if resuming else "start", "step": step, "time": time.time(),
                       "total_steps": total, "batches_per_epoch": nb, "argv": list(sys.argv[1:] if argv is None
                                                                                   else argv),
                       "device": str(jax.devices()[0]), "mesh_devices": int(mesh.devices.size),
                       "mesh": {str(k): int(v) for k, v in dict(mesh.shape).items()},
                       "throughput_unit": unit, **resume_info})
        window: list = []
        last = {"loss": meta.get("loss"), "sps": None, "ips": None}
        t_win = time.perf_counter()
        thr = {"units": 0, "first": None}  # units trained by this process; (time, units) after its first step

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
            pending = int((~np.asarray(jnp.stack([w[1] for w in window]))).sum()) if window else 0
            meta = {"step": step, "epoch": step * k // nb, "batch_in_epoch": step * k % nb, "batches_per_epoch": nb,
                    "accumulate": k, "loss": last["loss"], "time": time.time(), "task": task.name,
                    "total_steps": total, "skipped": guard.skipped + pending}
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
            nonlocal window, t_win
            losses = np.asarray(jnp.stack([jnp.asarray(w[0]) for w in window]), np.float64)
            items = float(sum(w[2] for w in window))
            oks = np.asarray(jnp.stack([w[1] for w in window]))
            check_window()
            n_bad = guard.update(oks, [w[3] for w in window], ckpt_step)
            now = time.perf_counter()
            good = losses[oks]
            last["sps"] = len(window) / max(now - t_win, 1e-9)
            last["ips"] = items / max(now - t_win, 1e-9)
            last["loss"] = float(good.mean()) if good.size else float("nan")
            rec = {"step": step, "epoch": ((step - 1) * k) // nb, "batch": ((step - 1) * k) % nb,
                   "loss": last["loss"], "loss_last": float(losses[-1]), "n_steps": len(window),
                   "steps_per_s": last["sps"], f"{unit}_per_s": last["ips"], "time": time.time(),
                   "elapsed_s": now - wall0}
            if cfg.nan_policy == "skip":
                rec["skipped"] = n_bad
            metrics.step(rec)
            window, t_win = [], now
            if step == total:
                guard.check_end(step, ckpt_step)

        transitions = set(task.transition_steps)
        with Reporter(use_bar, total, step, cfg.print_every, label=f"train {task.name}", unit=unit) as rep, \
                StopRequest() as stop:
            rep.say(f"{task.describe + '; ' if task.describe else ''}{'resuming at' if resuming else 'starting at'} "
                    f"step {step} of {total}; {nb} batches per epoch, accumulate {k}; {cfg.optimizer}, "
                    f"grad path {cfg.grad_path}; mesh of {mesh.devices.size} x {jax.devices()[0].platform}"
                    + (f" ({' x '.join(f'{a} {n}' for a, n in dict(mesh.shape).items())}; {steps.plan.describe})"
                       if steps.plan is not None else ""))
            while step < total and stop.signum is None:
                if step in transitions:
                    state = init_state(task, cfg, steps, mesh, task.transition(state["params"], step),
                                       state["rng"])
                if k == 1:
                    _, _, batch = next(data)
                    n_units = task.count(batch)
                    state, loss, ok = steps.train_step(state, shard_batch(batch, mesh))
                else:
                    raw = [next(data)[2] for _ in range(k)]
                    n_units = sum(task.count(b) for b in raw)
                    s, n, g = accumulate_window(steps, state["params"], [shard_batch(b, mesh) for b in raw],
                                                _key_rng(task, state))
                    state, loss, ok = steps.apply_sums(state, s, n, g)
                step += 1
                thr["units"] += n_units
                if thr["first"] is None:  # the first step includes the compilation: the throughput starts after it
                    jax.block_until_ready(loss)
                    thr["first"] = (time.perf_counter(), thr["units"])
                window.append((loss, ok, n_units, step))
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
        t_end = time.perf_counter()
        throughput = {"unit": unit, f"{unit}_this_process": thr["units"], f"{unit}_per_s": None}
        if thr["first"] is not None:
            t1, u1 = thr["first"]
            throughput[f"{unit}_per_s"] = ((thr["units"] - u1) / (t_end - t1) if thr["units"] > u1 and t_end > t1
                                           else thr["units"] / max(t_end - wall0, 1e-9))
        ev = task.evaluate(state["params"]) if task.evaluate is not None else None
        return FitResult(state=state, step=step, final_loss=last["loss"], eval=ev, traces=dict(steps.traces),
                         skipped=guard.skipped, throughput=throughput)
    finally:
        if metrics is not None:
            with contextlib.suppress(Exception):
                metrics.close()
        if source is not None:
            source.close()  # the family's epoch iterator (e.g. a stream's file handles)
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
                    on_step: Callable | None = None, plan: ShardPlan | None = None) -> tuple[dict, list]:
    """:func:`fit`'s step loop without a run directory (no checkpoints, metrics or signals): for notebooks and
    for scripts that chain phases (``scripts/kan_fit.py``). Starts from ``params`` (default ``task.init``) with a
    fresh optimiser state; applies the task's transitions; returns ``(state, losses)`` (device scalars;
    ``losses[i]`` of step ``i + 1``, NaN where the guard skipped a step). At the end, :class:`TrainingDiverged` is
    raised if a step was not finite under ``nan_policy="stop"``, and under ``"skip"`` if ``max_consecutive_skips``
    steps in a row, or all of them, were skipped."""
    mesh, steps = build(task, cfg, mesh, max_traces, plan)
    _lbfgs_check(task, cfg)
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
    if oks:
        guard = _SkipGuard(cfg)
        guard.update(np.asarray(jnp.stack(oks)), range(1, len(oks) + 1), None)
        guard.check_end(len(oks), None)
    return state, losses
