"""The run directory: which entries a run owns, when it may start, resume or replace them.

A run directory holds ``run.json`` (``{"script": owner, "config": ..., ...}``, written first) and the entries its
owner lists (``checkpoints/``, ``metrics.jsonl``, ``metrics.csv``, ...). Rules (nothing a user wrote is lost):

* a fresh run needs an empty or absent directory;
* ``overwrite`` allows a non-empty one and deletes only the owned entries, and refuses if any of them exists without
  a ``run.json`` of the same owner;
* ``resume`` continues the run described by ``run.json`` (an empty or absent directory starts fresh, so job
  scripts can always pass it); a directory of another owner is refused.
"""

from __future__ import annotations

import json
import pathlib
import shutil

from jaxgrad.train.checkpoint import write_atomic

RUN_FILE = "run.json"


class RunDirError(ValueError):
    """A run directory that may not be used as asked; the message names it and says why."""


def read_run_file(out: pathlib.Path, owner: str) -> dict | None:
    p = pathlib.Path(out) / RUN_FILE
    if not p.exists():
        return None
    try:
        run = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunDirError(f"{p}: not a valid run file ({err})") from None
    if not isinstance(run, dict) or run.get("script") != owner:
        raise RunDirError(f"{p} was not written by {owner}.py; refusing to touch {out}" if not owner.startswith(
            "jaxgrad") else f"{p} was not written by `{owner}` (it says {run.get('script')!r}); refusing to "
                            f"touch {out}")
    return run


def inspect(out: pathlib.Path, owner: str, owned: tuple[str, ...], *, resume: bool, overwrite: bool,
            flag=lambda name: f"--{name}") -> dict | None:
    """Read-only checks of ``out``; returns the saved run file when resuming (``None``: a fresh run)."""
    out = pathlib.Path(out)
    if resume and overwrite:
        raise RunDirError(f"give {flag('resume')} or {flag('overwrite')}, not both")
    if out.exists() and not out.is_dir():
        raise RunDirError(f"{flag('out')} {out}: exists and is not a directory")
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    listing = f"{', '.join(entries[:5])}{' ...' if len(entries) > 5 else ''}"
    run = read_run_file(out, owner) if entries else None
    if resume:
        if run is None and entries:
            raise RunDirError(f"{flag('resume')}: {out} is not empty but has no {RUN_FILE} of a {owner} run; "
                              f"nothing to resume (entries: {listing})")
        return run
    if entries:
        if not overwrite:
            raise RunDirError(f"{flag('out')} {out} is not empty ({listing}); use a new directory, {flag('resume')} "
                              f"to continue a run, or {flag('overwrite')} to start again (replaces only this "
                              f"run's files)")
        mine = [e for e in entries if e in owned or e == RUN_FILE]
        if mine and run is None:
            raise RunDirError(f"{flag('overwrite')}: {out} holds {', '.join(mine)} but no {RUN_FILE} of a {owner} "
                              f"run; refusing to delete files this program did not create")
    return None


def clear_owned(out: pathlib.Path, owned: tuple[str, ...]) -> None:
    """Delete the owned entries (only after :func:`inspect` allowed it); ``run.json`` last, so an interrupted
    clean-up can be redone."""
    out = pathlib.Path(out)
    for e in (*[o for o in owned if o != RUN_FILE], RUN_FILE):
        p = out / e
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def write_run_file(out: pathlib.Path, owner: str, config: dict, **extra) -> None:
    write_atomic(pathlib.Path(out) / RUN_FILE, json.dumps({"script": owner, "config": config, **extra},
                                                          indent=1, default=str) + "\n")
