"""``jaxgrad train FAMILY [CONFIG.toml] [--set key=value ...] --out DIR [--resume | --overwrite]``.

Resolves the configuration (defaults <- the family's train defaults <- the file <- ``--set``; on ``--resume``:
the run's saved configuration <- the file <- ``--set``, refusing changes to keys that alter the model, the data
order or the optimiser state), prints it, saves it (``run.json``, ``config.toml``), trains with
:func:`jaxgrad.train.fit` and writes ``summary.json``. Errors a user can fix print one line and exit with status 2
(1 for a run that failed: non-finite loss, a checkpoint that could not be written).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from jaxgrad.train import rundir, toml_config
from jaxgrad.train.checkpoint import (CheckpointMismatchError, CheckpointSaveError, NoGoodCheckpointError,
                                      write_atomic)
from jaxgrad.train.errors import ConfigError
from jaxgrad.train.families import family_module
from jaxgrad.train.metrics import CSV_FILE, METRICS_FILE, TB_DIR

CONFIG_FILE = "config.toml"
SUMMARY_FILE = "summary.json"


def owner_of(family: str) -> str:
    return f"jaxgrad train {family}"


def schema_of(fam) -> dict:
    train = toml_config.train_schema()
    for k, v in fam.CLI_TRAIN_DEFAULTS.items():
        train[k] = (train[k][0], v) + tuple(train[k][2:])
    return {"train": train, **fam.CLI_SCHEMA}


def resolve_for_run(family: str, config: str | None, sets: list[str], out: pathlib.Path, resume: bool,
                    overwrite: bool) -> tuple[dict, bool]:
    """``(cfg, resuming)``; checks the run directory (read-only) and, on resume, the fixed keys."""
    fam = family_module(family)
    schema = schema_of(fam)
    owned = (rundir.RUN_FILE, CONFIG_FILE, METRICS_FILE, CSV_FILE, TB_DIR, "checkpoints", SUMMARY_FILE,
             *fam.CLI_OUTPUTS)
    saved = rundir.inspect(out, owner_of(family), owned, resume=resume, overwrite=overwrite)
    if saved is None:
        if config is None and not resume:
            pass  # defaults + --set are a valid configuration
        return toml_config.resolve(schema, config, sets), False
    base = toml_config.resolve(schema, config, []) if config is not None else saved["config"]
    cfg = toml_config.resolve(schema, None, sets, base=base)
    fixed = {"train": toml_config.TRAIN_FIXED, **fam.CLI_FIXED}
    changed = toml_config.changed_fixed_keys(saved["config"], cfg, fixed)
    if changed:
        raise ConfigError(f"--resume: {'; '.join(changed)}: these keys define the model, the data order or the "
                          f"optimiser state and cannot change in a run (start a new run with --out elsewhere)")
    return cfg, True


def run(family: str, config: str | None, sets: list[str], out: str, *, resume: bool = False,
        overwrite: bool = False, progress: bool = True) -> int:
    from jaxgrad.train.loop import TrainingDiverged

    out = pathlib.Path(out)
    prog = f"jaxgrad train {family}"
    try:
        cfg, resuming = resolve_for_run(family, config, sets, out, resume, overwrite)
        fam = family_module(family)
        tcfg = toml_config.train_config(cfg)
        print(f"{prog}: resolved configuration ({'resuming ' if resuming else ''}run in {out}):")
        print(toml_config.to_toml(cfg), flush=True)
        import jax

        if fam.needs_x64(cfg) or "float64" in (tcfg.param_dtype, tcfg.compute_dtype):
            jax.config.update("jax_enable_x64", True)
        if not resuming:
            if overwrite:
                rundir.clear_owned(out, (rundir.RUN_FILE, CONFIG_FILE, METRICS_FILE, CSV_FILE, TB_DIR,
                                         "checkpoints", SUMMARY_FILE, *fam.CLI_OUTPUTS))
            out.mkdir(parents=True, exist_ok=True)
        rundir.write_run_file(out, owner_of(family), cfg)
        write_atomic(out / CONFIG_FILE, toml_config.to_toml(cfg))
        try:
            task, finish = fam.cli_task(cfg, out, lambda m: print(m, flush=True))
        except ValueError as err:
            raise ConfigError(str(err)) from None
        from jaxgrad.train.loop import fit, log_end

        t0 = time.perf_counter()
        res = fit(task, tcfg, out, resuming=resuming, use_bar=progress and sys.stdout.isatty(),
                  argv=sys.argv[1:])
        extra = finish(res)
        summary = {"family": family, "step": res.step, "final_loss": res.final_loss, "skipped_steps": res.skipped,
                   "wall_s_this_process": time.perf_counter() - t0, "device": str(jax.devices()[0]),
                   "config": cfg, **extra}
        write_atomic(out / SUMMARY_FILE, json.dumps(summary, indent=1, default=str) + "\n")
        log_end(out, res)
        ev = summary.get("eval") or {}
        ev_txt = ", ".join(f"{k} {v:.4g}" for k, v in ev.items() if isinstance(v, float))
        print(f"done: step {res.step}, final loss {res.final_loss}{'; ' + ev_txt if ev_txt else ''}; wrote "
              f"{out / SUMMARY_FILE}", flush=True)
        return 0
    except (ConfigError, rundir.RunDirError, CheckpointMismatchError, NoGoodCheckpointError, FileNotFoundError,
            FileExistsError, KeyError, ValueError) as err:  # ValueError: a setting the engine or family refused
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
    except (TrainingDiverged, CheckpointSaveError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
