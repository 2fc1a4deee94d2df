"""``jaxgrad train FAMILY [CONFIG.toml] [--set key=value ...] --out DIR [--resume | --overwrite]``.

Resolves the configuration (defaults <- the family's train defaults <- the file <- ``--set``; on ``--resume``:
the run's saved configuration <- the file <- ``--set``, where a key given with ``--set`` by an earlier command of
the run keeps its value against the file, and refusing changes to keys that alter the model, the data order or the
optimiser state), prints it, builds the task and checks the run can start, then saves the configuration
(``run.json``, ``config.toml``: only once the run starts, so a refused run leaves nothing to ``--overwrite``),
trains with :func:`jaxgrad.train.fit` and writes ``summary.json``.

Layout (``[mesh]``, every family): ``axes = "data" | "fsdp" | "data,fsdp"``, ``fsdp`` (the devices per fsdp group
with ``"data,fsdp"``), ``shard_trainable`` (the adapters and the optimiser state sharded too) and
``reshard_after_forward`` (false: the backward uses the forward's gathered weights instead of gathering again);
``train.devices`` is how many devices in all. ``"data"`` without ``shard_trainable`` is the plain data parallel
path; the others need the family's ``sharding`` module (``jaxgrad.<family>.sharding.cli_task``: LoRA / QLoRA) and
are refused by name for a family without one. Several processes: :mod:`jaxgrad.train.distributed` starts JAX's
distributed runtime from the environment before anything touches a device.

Errors a user can fix -- :class:`~jaxgrad.train.errors.ConfigError` and its
:class:`~jaxgrad.train.errors.DataError`, a run directory that may not be used, a checkpoint that does not fit or
does not verify -- print one line and exit with status 2; a run that failed (non-finite loss, a checkpoint that
could not be written) exits with status 1. Anything else is a bug (ours or a library's) and keeps its traceback.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import shutil
import sys
import time

from jaxgrad.train import rundir, toml_config
from jaxgrad.train.checkpoint import (CheckpointMismatchError, CheckpointSaveError, NoGoodCheckpointError,
                                      write_atomic)
from jaxgrad.train.config import DEFAULT_LR
from jaxgrad.train.errors import ConfigError
from jaxgrad.train.families import family_module
from jaxgrad.train.mesh import LAYOUTS
from jaxgrad.train.metrics import CSV_FILE, METRICS_FILE, TB_DIR
from jaxgrad.train.plot import LOSS_PLOT

CONFIG_FILE = "config.toml"
SUMMARY_FILE = "summary.json"
#: ``[mesh]``: the devices' layout (:mod:`jaxgrad.train.mesh`); may change on ``--resume`` (a checkpoint restores
#: onto any layout and device count)
MESH_SCHEMA = {"axes": ("str", "data", LAYOUTS), "fsdp": ("int?", None), "shard_trainable": ("bool", False),
               "reshard_after_forward": ("bool", True)}


def owner_of(family: str) -> str:
    return f"jaxgrad train {family}"


def schema_of(fam) -> dict:
    train = toml_config.train_schema()
    for k, v in fam.CLI_TRAIN_DEFAULTS.items():
        if k != "lr":  # the learning rate's default depends on the optimizer: fill_defaults
            train[k] = (train[k][0], v) + tuple(train[k][2:])
    return {"train": train, "mesh": dict(MESH_SCHEMA), **fam.CLI_SCHEMA}


def fill_defaults(fam, cfg: dict) -> dict:
    """Defaults that depend on other keys: ``train.lr`` unset takes the family's default learning rate for the
    first-order optimizers and stays unset for L-BFGS (which has none); ``train.lbfgs_warmup_lr`` unset takes
    :data:`~jaxgrad.train.config.DEFAULT_LBFGS_WARMUP_LR` where an L-BFGS run has warm-up steps, so the printed
    and saved configuration shows the rate the run uses."""
    from jaxgrad.train.config import DEFAULT_LBFGS_WARMUP_LR

    t = cfg["train"]
    if t["lr"] is None and t["optimizer"] != "lbfgs":
        t["lr"] = float(fam.CLI_TRAIN_DEFAULTS.get("lr", DEFAULT_LR))
    if t["optimizer"] == "lbfgs" and t.get("lbfgs_warmup_steps") and t.get("lbfgs_warmup_lr") is None:
        t["lbfgs_warmup_lr"] = DEFAULT_LBFGS_WARMUP_LR
    return cfg


def layout_of(family: str, cfg: dict, devices: int | None, say):
    """``(mesh, cli_task)`` of the ``[mesh]`` settings: ``(None, None)`` for the plain data parallel path (axes
    ``"data"``, nothing sharded, unless the family's ``sharding.plan_on_data_mesh(cfg)`` asks for its planned path
    there), else the ``("data", "fsdp")`` mesh and the family's sharded ``cli_task``."""
    from jaxgrad.train.mesh import train_mesh

    m = cfg["mesh"]
    mesh = train_mesh(m["axes"], devices, m["fsdp"])  # refuses bad values by name
    package = family_module(family).__name__.rsplit(".", 1)[0]
    try:
        sharding = importlib.import_module(f"{package}.sharding")
    except ModuleNotFoundError:
        sharding = None
    if m["axes"] == "data" and not m["reshard_after_forward"]:
        raise ConfigError("mesh.reshard_after_forward = false keeps the weights gathered over the 'fsdp' axis, which "
                          "mesh.axes = 'data' does not have (nothing is gathered); use mesh.axes = 'fsdp' or "
                          "'data,fsdp', or leave it unset")
    if m["axes"] == "data" and not m["shard_trainable"]:
        # a family may take its planned path on the data mesh too (an fsdp axis of 1: nothing sharded), e.g. for
        # frozen arrays that must be arguments of the step rather than constants of its program
        if sharding is None or not getattr(sharding, "plan_on_data_mesh", lambda cfg: False)(cfg):
            return None, None
    elif m["axes"] == "data":
        raise ConfigError("mesh.shard_trainable = true shards over the 'fsdp' axis, which mesh.axes = 'data' does "
                          "not have; use mesh.axes = 'fsdp' or 'data,fsdp'")
    elif sharding is None:
        raise ConfigError(f"mesh.axes = {m['axes']!r}: family {family!r} has no sharded layout (only the LoRA "
                          f"family shards its frozen base); use mesh.axes = 'data'")

    def cli_task(cfg, out, say):
        return sharding.cli_task(cfg, out, say, mesh, m["shard_trainable"])
    return mesh, cli_task


def peak_device_memory() -> int | None:
    """The peak bytes in use on this process's first device since it started (``memory_stats()``'s
    ``peak_bytes_in_use``: GPUs report it), or ``None`` where the backend reports none (the CPU)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else int(peak)


def peak_memory_per_device() -> list | None:
    """``peak_bytes_in_use`` of each of this process's devices (``None`` where the backend reports none)."""
    import jax

    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    return None if all(p is None for p in peaks) else [None if p is None else int(p) for p in peaks]


def owned_entries(fam) -> tuple[str, ...]:
    return (rundir.RUN_FILE, CONFIG_FILE, METRICS_FILE, CSV_FILE, TB_DIR, "checkpoints", SUMMARY_FILE, LOSS_PLOT,
            *fam.CLI_OUTPUTS)


def _plot_loss(out: pathlib.Path) -> str:
    """The run's loss curve beside its metrics (:func:`jaxgrad.train.plot.plot_loss_curve`): ``", <path>"`` for
    the closing line, or ``""`` where no training loss was logged (nothing to draw)."""
    from jaxgrad.train.plot import plot_loss_curve

    try:
        return f", {plot_loss_curve(out / METRICS_FILE, out / LOSS_PLOT)}"
    except ValueError:
        return ""


def resolve_for_run(family: str, config: str | None, sets: list[str], out: pathlib.Path, resume: bool,
                    overwrite: bool) -> tuple[dict, bool, list[str], list[str]]:
    """``(cfg, resuming, set_keys, notes)``; checks the run directory (read-only) and, on resume, the fixed keys.
    ``set_keys``: every key given with ``--set`` in the run so far (saved in ``run.json``); ``notes``: lines to
    print (what a resume changes)."""
    fam = family_module(family)
    schema = schema_of(fam)
    saved = rundir.inspect(out, owner_of(family), owned_entries(fam), resume=resume, overwrite=overwrite)
    if saved is None:
        set_keys: list[str] = []
        cfg = fill_defaults(fam, toml_config.resolve(schema, config, sets, set_keys=set_keys))
        return cfg, False, set_keys, []
    old = saved.get("config")
    if not isinstance(old, dict) or not all(isinstance(v, dict) for v in old.values()):
        raise rundir.RunDirError(f"{out / rundir.RUN_FILE}: no saved configuration to resume (a 'config' table of "
                                 f"sections), got {old!r}")
    old = {sec: dict(body) for sec, body in old.items()}
    for sec, added in getattr(fam, "CLI_KEYS_ADDED", {}).items():  # a run saved before these keys existed
        if sec in old:
            for key, value in added.items():
                old[sec].setdefault(key, value)
    t = old.get("train", {})
    if t.get("optimizer") == "lbfgs" and t.get("lr") is not None:  # saved by a version that stored an unused lr
        t["lr"] = None
    earlier = saved.get("set_keys", [])  # absent in run files of older versions: no key was set with --set
    if not isinstance(earlier, list) or not all(isinstance(k, str) for k in earlier):
        raise rundir.RunDirError(f"{out / rundir.RUN_FILE}: 'set_keys' must be a list of 'section.key' names, got "
                                 f"{earlier!r}")
    cfg, set_keys, notes = toml_config.resolve_resume(schema, old, earlier, config, sets)
    cfg = fill_defaults(fam, cfg)
    base = fill_defaults(fam, toml_config.resolve_resume(schema, old, [], None, [])[0])  # the run as saved
    fixed = {"train": toml_config.TRAIN_FIXED, **fam.CLI_FIXED}
    changed = toml_config.changed_fixed_keys(base, cfg, fixed)
    if changed:
        raise ConfigError(f"--resume: {'; '.join(changed)}: these keys define the model, the data order or the "
                          f"optimiser state and cannot change in a run (start a new run with --out elsewhere)")
    diff = toml_config.changed_keys(base, cfg)
    if diff:
        notes.append(f"resuming with changes: {'; '.join(diff)}")
    return cfg, True, set_keys, notes


def check_out_path(out: pathlib.Path) -> None:
    """``--out`` must be a directory or a path that can become one: no existing ancestor may be a file (the
    directory itself is checked by :func:`jaxgrad.train.rundir.inspect`)."""
    for parent in pathlib.Path(out).parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise rundir.RunDirError(f"--out {out}: {parent} exists and is not a directory (--out must be a "
                                         f"directory or a new path below one)")
            return


def _remove_new_entries(out: pathlib.Path, owned: tuple[str, ...], before: set[str] | None) -> None:
    """After a run refused before it started: remove the owned entries it created (``before``: the entries that
    existed, ``None``: the directory did not), and the directory if it created it and it is empty."""
    if not out.is_dir():
        return
    for e in owned:
        p = out / e
        if (before is None or e not in before) and (p.exists() or p.is_symlink()):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    if before is None and not any(out.iterdir()):
        out.rmdir()


def _previous_summary(out: pathlib.Path) -> dict:
    try:
        old = json.loads((out / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return old if isinstance(old, dict) else {}


def run(family: str, config: str | None, sets: list[str], out: str, *, resume: bool = False,
        overwrite: bool = False, progress: bool = True) -> int:
    from jaxgrad.train.loop import TrainingDiverged

    out = pathlib.Path(out)
    prog = f"jaxgrad train {family}"
    started = False
    before: set[str] | None = None
    owned: tuple[str, ...] = ()
    resuming = resume
    primary = True
    try:
        from jaxgrad.train import distributed

        # several processes (the environment says so): before any device is touched. Each process checks the run
        # directory (read-only) before any of them writes to it; process 0 writes the run's files
        multi = distributed.initialize()
        primary = distributed.is_primary()
        check_out_path(out)
        cfg, resuming, set_keys, notes = resolve_for_run(family, config, sets, out, resume, overwrite)
        if multi:
            distributed.barrier("jaxgrad-train-resolved")
        fam = family_module(family)
        owned = owned_entries(fam)
        tcfg = toml_config.train_config(cfg)
        print(f"{prog}: resolved configuration ({'resuming ' if resuming else ''}run in {out}):")
        print(toml_config.to_toml(cfg), flush=True)
        for n in notes:
            print(n, flush=True)
        import jax

        if fam.needs_x64(cfg) or "float64" in (tcfg.param_dtype, tcfg.compute_dtype):
            jax.config.update("jax_enable_x64", True)
        if not resuming:
            if overwrite and primary:
                rundir.clear_owned(out, owned)
            before = {p.name for p in out.iterdir()} if out.is_dir() else None
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise rundir.RunDirError(f"--out {out}: cannot create the directory ({err.strerror})") from None
        mesh, sharded_task = layout_of(family, cfg, tcfg.devices, print)
        plan = None
        if sharded_task is None:
            task, finish = fam.cli_task(cfg, out, lambda m: print(m, flush=True))
        else:
            task, finish, plan = sharded_task(cfg, out, lambda m: print(m, flush=True))
        from jaxgrad.train.loop import fit, log_end
        from jaxgrad.train.mesh import bytes_per_device

        def on_start():
            nonlocal started
            if primary:
                rundir.write_run_file(out, owner_of(family), cfg, set_keys=set_keys)
                write_atomic(out / CONFIG_FILE, toml_config.to_toml(cfg))
            started = True

        t0 = time.perf_counter()
        res = fit(task, tcfg, out, resuming=resuming, use_bar=progress and sys.stdout.isatty(),
                  argv=sys.argv[1:], on_start=on_start, mesh=mesh, plan=plan)
        if not primary:  # process 0 writes the model or adapter (a sharded finish gathers with every process)
            if plan is not None:
                finish(res)
            return 0
        extra = finish(res)
        thr = {k: v for k, v in res.throughput.items() if k != "unit"}
        rate = f"{res.throughput.get('unit', 'items')}_per_s"
        if thr.get(rate) is None:  # nothing trained by this process: keep the rate the run's summary had
            thr[rate] = _previous_summary(out).get(rate)
        peak = peak_device_memory()
        summary = {"family": family, "step": res.step, "final_loss": res.final_loss, "skipped_steps": res.skipped,
                   **thr, "wall_s_this_process": time.perf_counter() - t0, "device": str(jax.devices()[0]),
                   "peak_device_memory_bytes": peak, "peak_device_memory_bytes_per_device": peak_memory_per_device(),
                   "mesh": ({"data": len(jax.devices()) if tcfg.devices is None else tcfg.devices} if mesh is None
                            else {str(k): int(v) for k, v in dict(mesh.shape).items()}),
                   "processes": jax.process_count(), "state_bytes_per_device": bytes_per_device(res.state),
                   "config": cfg, **extra}
        write_atomic(out / SUMMARY_FILE, json.dumps(summary, indent=1, default=str) + "\n")
        log_end(out, res, skipped_steps=res.skipped)
        plot_txt = _plot_loss(out)
        ev = summary.get("eval") or {}
        ev_txt = ", ".join(f"{k} {v:.4g}" for k, v in ev.items() if isinstance(v, float))
        skip_txt = f"; {res.skipped} step(s) skipped (non-finite)" if res.skipped else ""
        rate_txt = f"; {thr[rate]:.4g} {rate.replace('_per_s', '')}/s" if thr.get(rate) else ""
        mem_txt = (f"; peak device memory {peak / 2**30:.2f} GiB" if peak is not None
                   else "; peak device memory not reported by this backend")
        print(f"done: step {res.step}, final loss {res.final_loss}{skip_txt}{'; ' + ev_txt if ev_txt else ''}"
              f"{rate_txt}{mem_txt}; wrote {out / SUMMARY_FILE}{plot_txt}", flush=True)
        return 0
    except (ConfigError, rundir.RunDirError, CheckpointMismatchError, NoGoodCheckpointError) as err:
        if not started and not resuming and owned and primary:
            _remove_new_entries(out, owned, before)
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except (TrainingDiverged, CheckpointSaveError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    except BaseException:
        if not started and not resuming and owned and primary:
            _remove_new_entries(out, owned, before)
        raise
