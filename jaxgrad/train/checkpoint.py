"""Orbax checkpoints with checksums: atomic saves, verified restores, a fall-back to the previous good one.

Layout: ``<dir>/<step>/`` as orbax writes it (item ``state``: the pytree ``{"params", "opt_state", "rng"}`` in
orbax's array format; item ``meta``: JSON), plus ``<dir>/<step>/jaxgrad-checksums.json``: the SHA-256 and size of
every file of the step, written (atomically, last) after orbax has finished and renamed its temporary directory.
The checksum file is the commit mark:

* a step directory without it (a save killed after orbax's rename) or whose files do not match it (a truncated
  or corrupted file) is not used: it is moved aside to ``<dir>/<step>.corrupt-<unix time>`` (kept for
  inspection, ignored by orbax) and the previous good checkpoint is restored, with a message saying so; when none
  is good, :class:`NoGoodCheckpointError` names them, and so does every later restore of a directory that holds
  only moved-aside checkpoints (it never starts again from step 0 without a word);
* a save that fails (disk full, permissions) raises :class:`CheckpointSaveError` naming the step and the last
  good checkpoint, which is untouched (orbax writes into ``<step>.orbax-checkpoint-tmp-*`` and only renames a
  complete directory; partial ones are removed when the directory is next opened).

Nothing is unpickled: orbax stores arrays in OCDBT/zarr and metadata as JSON; ``meta`` and the checksums are JSON.

Several processes (:mod:`jaxgrad.train.distributed`; the directory on a file system they share): every process
saves and restores (each writes and reads its own shards; orbax finalises on process 0); process 0 writes the
checksum file, and a barrier holds the others until it has.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

from jaxgrad.train.distributed import barrier


CHECKSUM_FILE = "jaxgrad-checksums.json"


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the message names the step, the cause and the last good checkpoint."""


class NoGoodCheckpointError(RuntimeError):
    """Checkpoints exist but none passes its checksums."""


class CheckpointMismatchError(ValueError):
    """A checkpoint that passes its checksums but does not fit the model/optimiser being restored (another model
    or configuration); nothing is moved aside."""


def _file_digests(step_dir: pathlib.Path) -> dict[str, list]:
    out = {}
    for p in sorted(step_dir.rglob("*")):
        if p.is_file() and p.name != CHECKSUM_FILE:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            out[str(p.relative_to(step_dir))] = [h.hexdigest(), p.stat().st_size]
    return out


def write_atomic(path: pathlib.Path, data: bytes | str) -> None:
    """Write ``path`` through a temporary file, fsync, rename: readers see the old or the new content."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def verify_step_dir(step_dir: pathlib.Path) -> str | None:
    """``None`` if ``step_dir`` matches its checksum file, else what is wrong (one line)."""
    mark = step_dir / CHECKSUM_FILE
    if not mark.is_file():
        return f"no {CHECKSUM_FILE} (the save did not finish)"
    try:
        want = json.loads(mark.read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        return f"{CHECKSUM_FILE} is unreadable ({err})"
    have = _file_digests(step_dir)
    for name, (digest, size) in want.items():
        if name not in have:
            return f"{name} is missing"
        if have[name][1] != size:
            return f"{name} has {have[name][1]} bytes, expected {size} (truncated?)"
        if have[name][0] != digest:
            return f"{name} does not match its SHA-256 (corrupted)"
    return None


def _path_key(entry) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def tree_mismatch(item_dir: pathlib.Path, abstract: Any) -> str | None:
    """The first difference (one line) between the pytree orbax saved in ``item_dir`` (its metadata: each leaf's
    path and whole-array shape, whatever the devices it was written from) and ``abstract``; ``None`` if they agree
    or the metadata cannot be read."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    try:
        meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(item_dir))
        tree = getattr(meta, "tree", meta)
        saved = {tuple(_path_key(e) for e in path): tuple(leaf.shape)
                 for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(leaf, "shape")}
    except Exception:  # noqa: BLE001 - unreadable metadata: orbax's restore reports what does not fit
        return None
    want = {tuple(_path_key(e) for e in path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    for key in sorted(set(saved) | set(want)):
        name = "/".join(key)
        if key not in saved:
            return f"{name} is not in the checkpoint"
        if key not in want:
            return f"the checkpoint has {name}, which this configuration does not"
        if saved[key] != want[key]:
            return f"{name} has shape {list(saved[key])} in the checkpoint, {list(want[key])} here"
    return None


def _process_index() -> int:
    import jax

    return jax.process_index()


class Checkpointer:
    """Synchronous orbax ``CheckpointManager`` over ``directory`` keeping the last ``keep`` steps."""

    def __init__(self, directory: os.PathLike, keep: int, *, create: bool = True):
        import orbax.checkpoint as ocp

        self.directory = pathlib.Path(directory).resolve()
        self._keep = keep
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False, create=create,
                                            cleanup_tmp_directories=True)
        self._mngr = ocp.CheckpointManager(self.directory, options=opts, item_names=("state", "meta"))
        self.last_good: int | None = None

    def close(self) -> None:
        self._mngr.close()

    def steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        import orbax.checkpoint as ocp

        try:
            self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                          meta=ocp.args.JsonSave(meta)), force=True)
            self._mngr.wait_until_finished()
            step_dir = self.directory / str(step)
            if _process_index() == 0:  # several processes: each wrote its shards, orbax finalised on process 0
                write_atomic(step_dir / CHECKSUM_FILE,
                             json.dumps({"step": step, "files": _file_digests(step_dir)}, indent=0) + "\n")
            barrier(f"jaxgrad-checkpoint-{step}")  # no process goes on before the commit mark is written
        except Exception as err:  # noqa: BLE001 - any failure: report it with the state of the directory
            with contextlib.suppress(Exception):
                self._mngr.reload()
            where = (f"the last good checkpoint, step {self.last_good}, is intact" if self.last_good is not None
                     else "no earlier checkpoint of this run exists")
            raise CheckpointSaveError(f"checkpoint at step {step} could not be written to {self.directory} "
                                      f"({type(err).__name__}: {err}); {where}") from err
        self.last_good = step

    def read_meta(self, step: int) -> dict:
        import orbax.checkpoint as ocp

        r = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(r.meta)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        import orbax.checkpoint as ocp

        r = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                             meta=ocp.args.JsonRestore()))
        return r.state, dict(r.meta)

    def restore_latest_good(self, abstract_for: Callable[[dict], Any], say: Callable[[str], None] = print,
                            quarantine: bool = True) -> tuple[Any, dict] | None:
        """Restore the newest checkpoint that passes its checksums (``None``: there is none at all).

        ``abstract_for(meta)``: the abstract state (``jax.ShapeDtypeStruct`` pytree) a checkpoint with this meta
        holds. Bad ones are moved aside (``quarantine``) and named in a message through ``say``."""
        steps = self.steps()
        if not steps:
            aside = self.quarantined()
            if aside:
                raise NoGoodCheckpointError(
                    f"{self.directory}: no usable checkpoint; {', '.join(aside)} failed verification and "
                    f"{'was' if len(aside) == 1 else 'were'} moved aside. Resuming would silently start again from "
                    f"step 0: inspect or delete {'it' if len(aside) == 1 else 'them'} first, or start a new run "
                    f"(--overwrite)")
            return None
        bad = []
        for step in reversed(steps):
            problem = verify_step_dir(self.directory / str(step))
            if problem is None:
                meta = self.read_meta(step)
                abstract = abstract_for(meta)
                mismatch = tree_mismatch(self.directory / str(step) / "state", abstract)
                if mismatch:
                    raise CheckpointMismatchError(
                        f"checkpoint {self.directory / str(step)} does not fit the model and optimiser of this "
                        f"configuration ({mismatch})")
                try:
                    state, meta = self.restore(step, abstract)
                except Exception as err:  # noqa: BLE001 - verified files that do not fit: another model/config
                    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                    raise CheckpointMismatchError(
                        f"checkpoint {self.directory / str(step)} does not fit the model and optimiser of this "
                        f"configuration ({first})") from None
                if bad:
                    say(f"checkpoint(s) {', '.join(str(s) for s, _ in bad)} failed verification "
                        f"({'; '.join(f'{s}: {p}' for s, p in bad)}); resuming from the previous good one, step "
                        f"{step}")
                self.last_good = step
                return state, meta
            bad.append((step, problem))
            if quarantine:
                self._quarantine(step)
        raise NoGoodCheckpointError(f"{self.directory}: no checkpoint passes verification "
                                    f"({'; '.join(f'{s}: {p}' for s, p in bad)})"
                                    + (f"; moved aside: {', '.join(self.quarantined())}" if quarantine else ""))

    def quarantined(self) -> list[str]:
        """The names of the step directories moved aside (``<step>.corrupt-<time>``), oldest step first."""
        if not self.directory.is_dir():
            return []
        names = [p.name for p in self.directory.iterdir() if ".corrupt-" in p.name and p.is_dir()]
        return sorted(names, key=lambda n: (int(n.split(".", 1)[0]) if n.split(".", 1)[0].isdigit() else -1, n))

    def _quarantine(self, step: int) -> None:
        src = self.directory / str(step)
        dst = self.directory / f"{step}.corrupt-{int(time.time())}"
        n = 1
        while dst.exists():  # the same step moved aside twice within a second
            dst = self.directory / f"{step}.corrupt-{int(time.time())}-{n}"
            n += 1
        src.rename(dst)
        self._mngr.reload()

